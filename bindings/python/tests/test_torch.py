"""libddp.torch on one rank (Comm.self): hooks, both layouts, unused params, no_sync, close."""
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import libddp  # noqa: E402
import libddp.torch as ltorch  # noqa: E402
from conftest import CHILD_PATH, PYTHON  # noqa: E402


def make():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


@pytest.mark.parametrize("layout,plan", [("copy", "learned"), ("copy", "registration"), ("arena", "registration"),
                                         ("arena", "learned")])
def test_single_rank_grads_equal_local(layout, plan):
    ref, m = make(), make()
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(m, c, layout=layout, plan_order=plan, message_size=20)
        for step in range(3):
            x = torch.randn(4, 5)
            for mod in (ref, model):
                mod.zero_grad(set_to_none=step % 2 == 0)
                mod(x).pow(2).sum().backward()
            for a, b in zip(ref.parameters(), m.parameters()):
                assert torch.equal(a.grad, b.grad)
        assert model.stats.iterations == 3
        if layout == "arena":
            assert m[0].weight.grad.data_ptr() == model.ddp.grad_ptr(0)
            assert model.stats.layout_epoch == (1 if plan == "learned" else 0)
        model.close()
        assert m[0].weight.grad is not None


def test_unused_parameters():
    m = make()
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(m, c, find_unused_parameters=True)
        model.module[0](torch.randn(2, 5)).sum().backward()  # the last layer is unused
        assert m[2].weight.grad is None and m[2].bias.grad is None  # as torch DDP: untouched
        assert m[0].weight.grad is not None
        m[2].weight.grad = torch.ones_like(m[2].weight)  # an existing grad of an unused param stays as it is
        model.module[0](torch.randn(2, 5)).sum().backward()
        assert torch.equal(m[2].weight.grad, torch.ones_like(m[2].weight))
        model.close()
        strict = ltorch.DistributedDataParallel(make(), c)
        with pytest.raises(libddp.InvalidStateError, match="never marked ready"):
            strict.module[0](torch.randn(2, 5)).sum().backward()
        strict.close()


def test_no_sync_accumulates():
    m = make()
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(m, c)
        x = torch.randn(3, 5)
        with model.no_sync():
            model(x).sum().backward()
        model(x).sum().backward()
        assert model.stats.iterations == 1
        model.close()


def test_no_comm_given_uses_the_default_comm(monkeypatch):
    """DistributedDataParallel(model) alone: CPU parameters get default_comm's MPI communicator (a
    one-rank stand-in here, so the test needs no MPI job)."""
    asked = []
    monkeypatch.setattr(libddp.Comm, "mpi", classmethod(lambda cls: asked.append(1) or libddp.Comm.self()))
    ref, m = make(), make()
    model = ltorch.DistributedDataParallel(m)
    assert asked == [1]
    x = torch.randn(4, 5)
    for mod in (ref, model):
        mod(x).sum().backward()
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a.grad, b.grad)
    model.close()
    model.comm.close()


def test_unused_grad_stays_none_through_no_sync_in_the_arena():
    """A parameter no pass uses keeps grad None across a no_sync window (the arena must not hand it a
    view early)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.never = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    m = Net()
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(m, c, layout="arena", find_unused_parameters=True)
        x = torch.randn(2, 3)
        for _ in range(2):
            with model.no_sync():
                model(x).sum().backward()
            assert m.never.weight.grad is None
            model(x).sum().backward()
            assert m.never.weight.grad is None and m.used.weight.grad is not None
            m.zero_grad(set_to_none=False)
        model.close()


def test_torch_not_imported_by_the_package():
    code = "import sys, libddp; c = libddp.Comm.self(); libddp.DDP(c).close(); print('torch' in sys.modules)"
    out = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, env=dict(__import__("os").environ,
                         PYTHONPATH=CHILD_PATH), check=True).stdout.decode().strip()
    assert out == "False"


def test_default_comm_bootstraps_nccl_through_torch_distributed(monkeypatch):
    """Under torchrun (torch.distributed initialized, no MPI) the NCCL id travels through torch.distributed.
    No GPU here: Comm.nccl and the id are stand-ins that record what they were given."""
    import socket
    import torch.distributed as dist

    made = {}
    monkeypatch.setattr(libddp.Comm, "nccl_unique_id", staticmethod(lambda: b"\x07" * 128))
    monkeypatch.setattr(libddp.Comm, "nccl", classmethod(lambda cls, uid, n, r, d: made.update(
        uid=uid, nranks=n, rank=r, device=d) or "nccl-comm"))
    monkeypatch.setattr(libddp.Comm, "nccl_mpi", classmethod(lambda cls, d: pytest.fail("MPI used under torchrun")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=0, world_size=1)
    try:
        assert ltorch.default_comm(torch.device("cuda", 3)) == "nccl-comm"
    finally:
        dist.destroy_process_group()
    assert made == {"uid": b"\x07" * 128, "nranks": 1, "rank": 0, "device": 3}


class Branches(torch.nn.Module):
    """Two branches; forward uses `b` only when asked (an unused branch otherwise)."""

    def __init__(self, width=6, extra=0):
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 2), torch.nn.Linear(5, width)
        self.more = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(extra))
        self.use_b = False

    def forward(self, x):
        y = self.a(x).sum()
        return y + self.b(x).sum() if self.use_b else y


@pytest.mark.parametrize("layout", ["copy", "arena"])
def test_unused_parameters_error_names_them_and_the_torch_fix(layout):
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(Branches(), c, layout=layout)
        with pytest.raises(libddp.InvalidStateError) as info:
            model(torch.randn(2, 5)).backward()
        text = str(info.value)
        assert info.value.message == text and info.value.status == libddp.errors.INVALID_STATE
        assert "rank 0: b.weight, b.bias." in text, text
        assert "find_unused_parameters=True" in text, text
        assert "a.weight" not in text and "a.bias" not in text, text
        assert "rank 0: grads 2, 3" in text, text  # the library's own words stay, at the end
        model.module.use_b = True  # every parameter used: no error, and the context goes on
        model(torch.randn(2, 5)).backward()
        assert model.stats.iterations == 2
        model.close()


def test_unused_parameters_error_names_every_one_of_this_rank_past_the_library_six():
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(Branches(extra=3), c)  # b and more.*: 8 unused
        with pytest.raises(libddp.InvalidStateError) as info:
            model(torch.randn(2, 5)).backward()
        text = str(info.value)
        assert "and 2 more" in text, text
        unused = ["b.weight", "b.bias"] + ["more.%d.%s" % (k, w) for k in range(3) for w in ("weight", "bias")]
        assert "All of this rank's: %s." % ", ".join(unused) in text, text
        model.close()


def _on_local_ranks(n, fn):
    """Runs fn(rank, comm) on n in-process ranks (threads); returns each rank's result or exception."""
    import threading
    group = libddp.LocalGroup(n)
    out = [None] * n

    def run(r):
        try:
            with group.comm(r) as c:
                out[r] = fn(r, c)
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    group.close()
    return out


def test_unused_on_one_rank_is_named_on_every_rank():
    def step(rank, c):
        m = Branches()
        m.use_b = rank == 0  # rank 1 leaves b unused
        model = ltorch.DistributedDataParallel(m, c, timeout_ms=20000)
        try:
            model(torch.randn(2, 5)).backward()
        finally:
            model.close()

    errs = _on_local_ranks(2, step)
    for e in errs:
        assert isinstance(e, libddp.InvalidStateError), errs
        assert "rank 1: b.weight, b.bias." in str(e) and "rank 0:" not in str(e).split(" (")[0], str(e)
        assert "find_unused_parameters=True" in str(e)


def test_registration_mismatch_names_the_parameter():
    def make_model(rank, c):
        m = Branches(width=6 + rank)  # rank 1's b is wider
        ltorch.DistributedDataParallel(m, c, broadcast_parameters=False, timeout_ms=20000).close()

    errs = _on_local_ranks(2, make_model)
    for e in errs:
        assert isinstance(e, libddp.MismatchError), errs
        assert "b.weight" in str(e) and "same model on every rank" in str(e), str(e)  # checked before registering


def test_torch_positional_arguments_and_constructor_checks():
    """torch's later positional arguments (output_device, dim, ...) are taken in torch's order; a falsy
    output_device passes on CPU; a process_group that is not one, and parameters on two device types,
    are refused as torch refuses them."""
    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(make(), c, None, 0)  # output_device=None, dim=0
        assert model.dim == 0 and model.output_device is None
        model.close()
        model = ltorch.DistributedDataParallel(make(), c, output_device=0)
        model.close()
        with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup, not str"):
            ltorch.DistributedDataParallel(make(), c, process_group="junk")
        mixed = make()
        mixed[2].bias = torch.nn.Parameter(torch.empty(2, device="meta"))
        with pytest.raises(ValueError, match="one type of device; they are on cpu, meta"):
            ltorch.DistributedDataParallel(mixed, c)


def test_static_graph_refuses_a_graph_that_changes():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)

    with libddp.Comm.self() as c:
        model = ltorch.DistributedDataParallel(TwoHeads(), c, static_graph=True)
        x = torch.randn(4, 3)
        model(x, False).sum().backward()  # the first iteration: b unused
        model(x, False).sum().backward()
        with pytest.raises(RuntimeError, match="training graph changed in this iteration: b.weight, b.bias were"):
            model(x, True).sum().backward()
        model.close()


def test_no_sync_after_a_forward_without_backward():
    """A forward with grad enabled whose output is dropped begins nothing: no_sync() after it works, and
    entering no_sync() between a forward and its backward is allowed (that backward stays synced)."""
    with libddp.Comm.self() as c:
        m = make()
        model = ltorch.DistributedDataParallel(m, c)
        x = torch.randn(4, 5)
        model(x)  # dropped
        with model.no_sync():
            model(x).sum().backward()
        assert model.stats.iterations == 0
        out = model(x)
        with model.no_sync():
            out.sum().backward()
        assert model.stats.iterations == 1
        model.close()
