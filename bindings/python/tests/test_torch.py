"""libddp.torch on one rank (Comm.self): hooks, both layouts, unused params, no_sync, close."""
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import libddp  # noqa: E402
import libddp.torch as ltorch  # noqa: E402
from conftest import PKG, PYTHON  # noqa: E402


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


def test_torch_not_imported_by_the_package():
    code = "import sys, libddp; c = libddp.Comm.self(); libddp.DDP(c).close(); print('torch' in sys.modules)"
    out = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, env=dict(__import__("os").environ,
                         PYTHONPATH=PKG), check=True).stdout.decode().strip()
    assert out == "False"
