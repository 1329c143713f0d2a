"""Uneven inputs with buffers: a model with two BatchNorm layers and a buffer of its own, trained inside
`with model.join():` on ranks holding different numbers of batches, by libddp.torch and by torch DDP over
Gloo; then two more steps after the block. Every rank's final parameters and buffers must be torch's
(relative difference at most 1e-5; integer buffers equal). Cases: find_unused_parameters on and off, both
divide_by_initial_world_size, no_sync() micro-batches, gradient_as_bucket_view, uneven_inputs= given at
construction, a buffer comm hook run before the forward, and find_unused_parameters with no_sync()
micro-batches, broadcast_buffers on and off (on, torch's default, everywhere else). While some ranks
have joined, the others take their buffers before each forward from the highest rank that still has
data, and the joined ranks take part in that broadcast, as torch's do. Which rank holds the most batches
is drawn at random (JOIN_SEED repeats a draw). With find_unused_parameters the reference is torch DDP
whose joined ranks report no parameter as used (joined_ranks_use_nothing; torch's report a stale usage
map, a difference docs/bindings.md documents under "From torch DDP"). Run under mpirun (needs
MASTER_PORT); prints "join buffers parity ok" per rank, exits 1 on a failure."""
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel.distributed import _BufferCommHookLocation

import libddp.torch as ltorch
import torch_world

rank, world, comm = torch_world.init()
failures = []


class Net(nn.Module):
    """Two BatchNorm layers (running mean, variance and batch count) and a buffer of its own (a running
    sum of the inputs, and how many forwards it saw). branchy: the last layer alternates between two
    heads, so some parameters go unused in every other step (find_unused_parameters)."""

    def __init__(self, branchy):
        super().__init__()
        torch.manual_seed(0)
        self.branchy = branchy
        self.fc1, self.bn1 = nn.Linear(6, 8), nn.BatchNorm1d(8)
        self.fc2, self.bn2 = nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=0.3)
        self.head, self.other = nn.Linear(8, 3), nn.Linear(8, 3)
        self.register_buffer("input_sum", torch.zeros(6, dtype=torch.float64))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.input_sum += x.detach().double().sum(0)
            self.forwards += 1
        h = torch.relu(self.bn1(self.fc1(x)))
        h = torch.relu(self.bn2(self.fc2(h)))
        if not self.branchy:
            return self.head(h) + self.other(h)
        return self.head(h) if int(self.forwards) % 2 else self.other(h)


def batches(n, salt):
    g = torch.Generator().manual_seed(1000 * salt + rank)  # different data on every rank
    return [(torch.randn(8, 6, generator=g) + rank, torch.randn(8, 3, generator=g)) for _ in range(n)]


def train(model, counts, salt, by_world, accumulate=False, set_to_none=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)  # a wrong rank's copy shows
    with model.join(divide_by_initial_world_size=by_world):
        for k, (x, y) in enumerate(batches(counts[rank], salt)):
            opt.zero_grad(set_to_none=set_to_none)
            if accumulate and k % 2:  # a micro-batch under no_sync(): the next forward broadcasts no buffers
                with model.no_sync():
                    F.mse_loss(model(x[:4]), y[:4]).backward()
                x, y = x[4:], y[4:]
            F.mse_loss(model(x), y).backward()
            opt.step()
    for x, y in batches(2, salt + 500):  # after the block, every rank has data
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return dict((n, t.detach().clone()) for n, t in list(model.module.named_parameters())
                + list(model.module.named_buffers()))


TOL = 1e-5  # relative to the tensor's largest value: at 3 ranks the sums' order differs from Gloo's
worst = [0.0]


def largest_difference(got, want):
    """(relative difference, name) of the floating-point tensor that differs most, as compare measures it."""
    return max((((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)).item(), n)
               for n in want if want[n].dtype.is_floating_point)


def compare(got, want):
    assert list(got) == list(want), (list(got), list(want))
    for name in want:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        if a.dtype.is_floating_point:
            rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            worst[0] = max(worst[0], rel)
            assert rel <= TOL, "%s differs by %g (relative)" % (name, rel)
        else:
            assert torch.equal(a, b), "%s: %s vs %s" % (name, a.tolist(), b.tolist())


def draw_seed():
    box = [int(os.environ.get("JOIN_SEED", "0")) or random.SystemRandom().randrange(1, 1 << 30)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def average_float_buffers(_state, buffers):
    """A buffer comm hook: every rank's floating-point buffers averaged over torch.distributed."""
    for b in buffers.values():
        if b.dtype.is_floating_point:
            dist.all_reduce(b)
            b /= world


def with_hook(model, hook):
    if hook:  # before the forward: torch's joined ranks run it too
        model._register_buffer_comm_hook(None, average_float_buffers, _BufferCommHookLocation.PRE_FORWARD)
    return model


def joined_ranks_use_nothing(ref):
    """torch DDP as the reference with find_unused_parameters, but a joined rank reports no parameter as used
    in the iterations it shadows, as libddp's does. torch's sends the usage map its reducer last reduced:
    the global map of its own last synced iteration, then, since the allreduce is in place, the sum of that
    and every shadowed iteration's, so a parameter some rank used once stays "used" until every rank has
    joined; its .grad on the ranks with data is then overwritten by their current grads reduced as the
    others are (no_sync accumulations included, joined ranks counting zeros), and a None grad becomes
    zeros."""
    def match():
        used = ref.reducer._get_local_used_map()
        used.zero_()
        ref.process_group.allreduce(used).wait()
    ref._match_unused_params_allreduce = match
    return ref


def case(counts, salt, by_world, find_unused, uneven_at_construction, hook=False, accumulate=False,
         bucket_view=False, broadcast=True, set_to_none=False, report_torch=False):
    def run():
        both = dict(find_unused_parameters=find_unused, gradient_as_bucket_view=bucket_view,
                    broadcast_buffers=broadcast)
        if report_torch:  # torch as it is, for the record (docs/bindings.md quotes these numbers)
            plain = train(nn.parallel.DistributedDataParallel(Net(find_unused), **both), counts, salt, by_world,
                          accumulate, set_to_none)
        ref = nn.parallel.DistributedDataParallel(Net(find_unused), **both)
        if find_unused:
            joined_ranks_use_nothing(ref)
        want = train(with_hook(ref, hook), counts, salt, by_world, accumulate, set_to_none)
        if report_torch:
            print("rank %d: torch DDP with its joined ranks' stale usage map differs from it by %g (%s; relative)"
                  % ((rank,) + largest_difference(plain, want)), flush=True)
        kw = dict(uneven_inputs="by_world" if by_world else "by_contributors") if uneven_at_construction else {}
        model = ltorch.DistributedDataParallel(Net(find_unused), comm, **both, **kw)
        t0 = time.monotonic()
        got = train(with_hook(model, hook), counts, salt, by_world, accumulate, set_to_none)
        model.close()
        compare(got, want)
        assert time.monotonic() - t0 < 60, "took %.0f s" % (time.monotonic() - t0)
    return run


seed = draw_seed()
rng = random.Random(seed)
if rank == 0:
    print("join buffers parity: seed %d (JOIN_SEED=%d repeats it)" % (seed, seed), flush=True)
cases = []
for k, (by_world, find_unused) in enumerate(((True, False), (False, False), (True, True), (False, True))):
    counts = [rng.randint(1, 6) for _ in range(world)]
    counts[rng.randrange(world)] = 8  # the most data on a rank drawn at random (ties broken by rank)
    extra = [", no_sync micro-batches", ", gradient_as_bucket_view", "", ""][k]
    cases.append(("counts %s by_world=%s find_unused=%s%s" % (counts, by_world, find_unused, extra),
                  case(counts, k, by_world, find_unused, k == 1, accumulate=k == 0, bucket_view=k == 1)))
lowest = [8 - 2 * r for r in range(world)]  # rank 0 the most: the broadcasting rank changes as ranks join
cases.append(("counts %s by_world=True find_unused=False" % lowest, case(lowest, 7, True, False, True)))
counts = [rng.randint(1, 8) for _ in range(world)]
counts[rng.randrange(world)] = 9
cases.append(("counts %s, a buffer comm hook before the forward" % counts, case(counts, 8, True, False, False, True)))
# find_unused_parameters while ranks have joined, where torch's own result differs (joined_ranks_use_nothing):
# no_sync() micro-batches, or grads set to None (by_world=False: that difference needs two ranks with data)
for k, (by_world, broadcast, accumulate) in enumerate(((True, True, True), (True, False, True),
                                                      (False, False, True), (True, True, False))):
    counts = [rng.randint(1, 6) for _ in range(world)]
    counts[rng.randrange(world)] = 8
    what = "no_sync micro-batches" if accumulate else "zero_grad(set_to_none=True)"
    cases.append(("counts %s by_world=%s find_unused=True, %s, broadcast_buffers=%s"
                  % (counts, by_world, what, broadcast),
                  case(counts, 9 + k, by_world, True, k == 0, accumulate=accumulate, broadcast=broadcast,
                       set_to_none=not accumulate, report_torch=True)))
for name, fn in cases:
    try:
        fn()
        print("rank %d: %s ok" % (rank, name), flush=True)
    except Exception as e:
        failures.append(name)
        print("rank %d: %s FAILED: %s: %s" % (rank, name, type(e).__name__, e), flush=True)
comm.close()
print("rank %d: largest relative difference %g" % (rank, worst[0]), flush=True)
print("rank %d: %s" % (rank, "join buffers parity ok" if not failures else "FAILED: " + "; ".join(failures)),
      flush=True)
sys.exit(1 if failures else 0)
