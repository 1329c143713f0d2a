"""Uneven inputs in PyTorch: libddp.torch's `with model.join():` against torch DDP's (Gloo) on ranks
holding different numbers of batches; the final parameters must agree. Also: BatchNorm with
broadcast_buffers=False ends with the last joiner's statistics on every rank (with buffers broadcast:
torch_join_buffers_parity.py), and throw_on_early_termination raises on every rank as torch's does.
Run under mpirun (needs MASTER_PORT); prints "join parity ok" per rank, exits 1 on a failure."""
import sys

import torch
import torch.distributed as dist

import libddp.torch as ltorch
import torch_world

rank, world, comm = torch_world.init()
failures = []


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(lowest_most=False):  # rank r holds 2 + 2 r batches (or the reverse), different data on every rank
    g = torch.Generator().manual_seed(100 + rank)
    n = 2 + 2 * (world - 1 - rank if lowest_most else rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def train(model, lowest_most=False, momentum=0.0, set_to_none=False, **join):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    with model.join(**join):
        for x, y in batches(lowest_most):
            opt.zero_grad(set_to_none=set_to_none)
            out = model(x)
            out = out[0] if isinstance(out, tuple) else out
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)  # the grads the library saw last may be gone at the join
    return [p.detach().clone() for p in model.parameters()]


def check(name, fn):
    try:
        fn()
        print("rank %d: %s ok" % (rank, name), flush=True)
    except Exception as e:
        failures.append(name)
        print("rank %d: %s FAILED: %r" % (rank, name, e), flush=True)


def parity(by_world):
    def run():
        want = train(torch.nn.parallel.DistributedDataParallel(net()), divide_by_initial_world_size=by_world)
        model = ltorch.DistributedDataParallel(net(), comm, uneven_inputs="by_world" if by_world else "by_contributors")
        got = train(model, divide_by_initial_world_size=by_world)
        model.close()
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max().item()
    return run


def lowest_rank_most():
    """The rank with the most batches is rank 0: every rank ends with its parameters (its last optimizer
    steps included), as torch's; with momentum, so that a wrong rank's copy shows."""
    want = train(torch.nn.parallel.DistributedDataParallel(net()), lowest_most=True, momentum=0.9)
    model = ltorch.DistributedDataParallel(net(), comm)
    got = train(model, lowest_most=True, momentum=0.9)
    model.close()
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max().item()


class Branchy(torch.nn.Module):
    """A head used on even batches only (find_unused_parameters)."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.other = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)
        self.step = 0

    def forward(self, x):
        self.step += 1
        h = torch.tanh(self.body(x))
        return self.head(h) if self.step % 2 else self.other(h)


def unused_grads_dropped_before_the_join():
    """find_unused_parameters with zero_grad(set_to_none=True) after each step: the grads the library
    last wrote are gone when a rank joins. The joined rank's shadow iterations must not write into them
    (they did: heap corruption); the result is torch's."""
    want = train(torch.nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True),
                 set_to_none=True)
    model = ltorch.DistributedDataParallel(Branchy(), comm, find_unused_parameters=True)
    got = train(model, set_to_none=True)
    model.close()
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max().item()


def join_without_uneven_inputs():
    """A wrapper made with torch's arguments alone: join() switches the context to the uneven mode on
    entering the block; the result is torch's."""
    want = train(torch.nn.parallel.DistributedDataParallel(net()))
    model = ltorch.DistributedDataParallel(net(), comm)
    got = train(model)
    assert model.ddp.join() >= 0  # the context is in the uneven mode from then on
    model.close()
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max().item()


def batchnorm_without_broadcast_buffers():
    bn = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    model = ltorch.DistributedDataParallel(bn, comm, uneven_inputs="by_world", broadcast_buffers=False)
    train(model)  # completes on uneven batches; then every rank holds the last joiner's model
    mine = torch.cat([t.detach().reshape(-1) for t in list(model.parameters()) + list(model.buffers())
                      if t.dtype == torch.float32])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    assert all(torch.equal(every[0], e) for e in every)
    model.close()


def throws_on_early_termination():
    for make in (lambda: torch.nn.parallel.DistributedDataParallel(net()),
                 lambda: ltorch.DistributedDataParallel(net(), comm)):
        model = make()
        try:
            train(model, throw_on_early_termination=True)
        except RuntimeError:
            pass
        else:
            raise AssertionError("%s: no RuntimeError" % type(model).__module__)
        if hasattr(model, "close"):
            model.close()


for name, fn in (("join parity divide_by_initial_world_size=True", parity(True)),
                 ("join parity divide_by_initial_world_size=False", parity(False)),
                 ("join: the lowest rank ran the most", lowest_rank_most),
                 ("join: grads dropped before the join", unused_grads_dropped_before_the_join),
                 ("join without uneven_inputs", join_without_uneven_inputs),
                 ("batchnorm, broadcast_buffers=False", batchnorm_without_broadcast_buffers),
                 ("throw_on_early_termination", throws_on_early_termination)):
    check(name, fn)
comm.close()
print("rank %d: %s" % (rank, "join parity ok" if not failures else "FAILED: " + ", ".join(failures)), flush=True)
sys.exit(1 if failures else 0)
