"""A port of torch 1.13's DistributedDataParallel tests that run on CPU (the distributed test module,
test_c10d_gloo, test_c10d_common) to libddp.torch.DistributedDataParallel, each compared with torch's own
DDP over Gloo where torch defines the result. Run under mpirun (MASTER_ADDR/MASTER_PORT set); prints
"rank R: CASE ok" or "rank R: CASE FAILED: ..." per case and "port: N passed, N failed" per rank."""
import copy
import io
import os
import pickle
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

import libddp
import libddp.torch as ltorch
import torch_world

rank, world, comm = torch_world.init()
TorchDDP = nn.parallel.DistributedDataParallel
results = []


def LDDP(model, **kw):
    kw.setdefault("comm", comm)
    return ltorch.DistributedDataParallel(model, **kw)


def case(fn):
    results.append(fn)
    return fn


def seeded(make, seed=0):
    torch.manual_seed(seed)
    return make()


def mlp():
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))


def data(step, n=4, d=6, out=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, d, generator=g), torch.randn(n, out, generator=g)


def close(a, b, what, rtol=1e-5, atol=1e-6):
    if a is None or b is None:
        assert a is None and b is None, "%s: %s vs %s" % (what, a is None, b is None)
        return
    assert torch.allclose(a, b, rtol=rtol, atol=atol), "%s differs by %g" % (what, (a - b).abs().max().item())


def train(model, steps=3, loss_fn=None, lr=0.1, zero_none=True):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad(set_to_none=zero_none)
        out = model(x)
        (loss_fn(out, y) if loss_fn else F.mse_loss(out, y)).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def parity(make, steps=3, loss_fn=None, rtol=1e-5, atol=1e-6, torch_kw=None, lib_kw=None, setup=None):
    ref = TorchDDP(seeded(make), **(torch_kw or {}))
    mine = LDDP(seeded(make), **(lib_kw or {}))
    if setup:
        setup(ref, mine)
    want = train(ref, steps, loss_fn)
    got = train(mine, steps, loss_fn)
    for k, (a, b) in enumerate(zip(got[0], want[0])):
        close(a, b, "grad %d" % k, rtol, atol)
    for k, (a, b) in enumerate(zip(got[1], want[1])):
        close(a, b, "param %d" % k, rtol, atol)
    mine.close()
    return mine


def raises(exc, fn, match=None):
    try:
        fn()
    except exc as e:
        assert match is None or match in str(e), str(e)
        return e
    raise AssertionError("no %s raised" % exc.__name__)


# -- construction ----------------------------------------------------------------------------------
@case
def basic_parity_copy_and_bucket_view():
    parity(mlp)
    parity(mlp, torch_kw=dict(gradient_as_bucket_view=True), lib_kw=dict(gradient_as_bucket_view=True))
    parity(mlp, torch_kw=dict(bucket_cap_mb=0.0001), lib_kw=dict(bucket_cap_mb=0.0001))


@case
def no_parameter_requires_grad():  # test_DistributedDataParallel_requires_grad
    m = nn.Linear(2, 2).requires_grad_(False)
    raises(RuntimeError, lambda: TorchDDP(m), "doesn't have any parameter that requires a gradient")
    raises(RuntimeError, lambda: LDDP(m), "doesn't have any parameter that requires a gradient")


@case
def model_diff_shape_across_ranks():  # test_ddp_model_diff_shape_across_ranks
    # torch over Gloo raises on the ranks whose model differs from rank 0's only (rank 0 then waits in
    # the broadcast); libddp raises on every rank.
    make = lambda: nn.Linear(4, 3 + (rank % 2))  # noqa: E731
    e = raises(RuntimeError, lambda: LDDP(make()), "same model on every rank")
    assert "weight" in str(e), str(e)


@case
def model_diff_num_params_across_ranks():  # test_ddp_model_diff_num_params_across_ranks
    make = lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + rank % 2)])  # noqa: E731
    raises(RuntimeError, lambda: LDDP(make()), "same model on every rank")


@case
def sync_module_states_frozen_params_and_buffers():  # test_ddp_sync_module_states
    def make():
        torch.manual_seed(rank)  # different on every rank
        m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        m[0].requires_grad_(False)
        m[1].running_mean += rank
        return m
    for wrap in (TorchDDP, LDDP):
        m = make()
        w = wrap(m)
        got = [t.clone() for t in list(m.parameters()) + list(m.buffers())]
        want = [t.clone() for t in got]
        for t in want:
            dist.broadcast(t, 0)
        for a, b in zip(got, want):
            assert torch.equal(a, b), wrap.__name__
        if wrap is LDDP:
            w.close()


@case
def device_ids_refused_for_cpu_module():
    raises(ValueError, lambda: TorchDDP(mlp(), device_ids=[0]))
    raises(ValueError, lambda: LDDP(mlp(), device_ids=[0]), "device_ids")


@case
def sparse_gradients_refused_at_construction():
    m = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    raises(libddp.UnsupportedError, lambda: LDDP(m), "0 (Embedding(sparse=True))")


# -- unused parameters ---------------------------------------------------------------------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.a(h), self.b(h)


@case
def output_unused_in_loss_grads_stay_none():  # test_c10d_common: test_output_unused_in_loss
    for kw in (dict(find_unused_parameters=True), dict(find_unused_parameters=True, gradient_as_bucket_view=True)):
        parity(TwoHeads, loss_fn=lambda out, y: F.mse_loss(out[0], y), torch_kw=kw, lib_kw=kw)


@case
def unused_on_some_ranks():  # test_ddp_control_flow_different_across_ranks (CPU)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(6, 4), nn.Linear(6, 4)

        def forward(self, x):
            return self.l1(x) + (self.l2(x) if rank == 0 else 0)
    parity(Net, torch_kw=dict(find_unused_parameters=True), lib_kw=dict(find_unused_parameters=True))


class OneLayer(nn.Module):
    """nn.Linear(6, 4) whose output goes through `post`."""

    def __init__(self, post):
        super().__init__()
        self.l, self.post = nn.Linear(6, 4), post

    def forward(self, x):
        return self.post(self.l(x))


@case
def returns_tensor_with_no_grad():  # test_ddp_returns_tensor_with_no_grad
    Net = lambda: OneLayer(lambda y: (y, torch.ones(1)))  # noqa: E731
    for fu in (False, True):
        parity(Net, loss_fn=lambda out, y: F.mse_loss(out[0], y), torch_kw=dict(find_unused_parameters=fu),
               lib_kw=dict(find_unused_parameters=fu))


@case
def new_tensor_in_forward():  # test_ddp_new_tensor_in_fwd (static graph too)
    Net = lambda: OneLayer(lambda y: y * torch.ones(4, requires_grad=True))  # noqa: E731
    for kw in (dict(), dict(static_graph=True)):
        parity(Net, torch_kw=kw, lib_kw=kw)


# -- hooks and wrappers --------------------------------------------------------------------------
@case
def dropped_wrapper_stops_reducing():
    m = seeded(mlp)
    old = LDDP(m)
    del old  # no gc.collect(): the old wrapper must go at once
    mine = LDDP(m)
    ref = TorchDDP(seeded(mlp))
    got, want = train(mine, 2), train(ref, 2)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        close(a, b, "after replacing the wrapper")
    local = copy.deepcopy(m)
    x, y = data(7)
    with mine.no_sync():  # the grads stay this rank's own: no hook of the dropped wrapper reduces them
        m.zero_grad()
        F.mse_loss(mine(x), y).backward()
    F.mse_loss(local(x), y).backward()
    for a, b in zip(m.parameters(), local.parameters()):
        close(a.grad, b.grad, "no_sync after replacing the wrapper")
    mine.close()


class Checkpointed(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.inp, self.mid, self.out, self.twice = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4), twice

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.mid, h, use_reentrant=True)
        if self.twice:
            h = checkpoint(self.mid, h, use_reentrant=True)
        return checkpoint(self.out, h, use_reentrant=True)  # the first grads come from a nested backward


@case
def checkpointing_reentrant_once():  # test_c10d_common: test_ddp_checkpointing_once
    parity(Checkpointed)
    parity(Checkpointed, torch_kw=dict(static_graph=True), lib_kw=dict(static_graph=True))


@case
def checkpointing_reentrant_twice_static_graph():  # test_ddp_checkpointing_twice
    parity(lambda: Checkpointed(True), torch_kw=dict(static_graph=True), lib_kw=dict(static_graph=True), steps=4)


@case
def set_static_graph_after_construction():  # test_ddp_checkpointing_twice with _set_static_graph
    parity(lambda: Checkpointed(True), steps=3, setup=lambda ref, mine: (ref._set_static_graph(),
                                                                        mine._set_static_graph()))


@case
def set_static_graph_after_training_began():  # torch's reducer: "should be called before training loop starts"
    def forward(m):
        m(data(0)[0])

    def step(m):
        x, y = data(0)
        F.mse_loss(m(x), y).backward()

    for began in (forward, step):  # a training forward with sync on is where torch's training loop starts
        ref, mine = TorchDDP(seeded(mlp)), LDDP(seeded(mlp))
        began(ref)
        began(mine)
        want = raises(RuntimeError, ref._set_static_graph, "should be called before training loop starts")
        got = raises(RuntimeError, mine._set_static_graph)
        assert type(got) is type(want) and str(got) == str(want), (repr(got), repr(want))
        assert not mine.static_graph
        mine.close()
    for wrap in (TorchDDP, LDDP):  # forwards without grad or inside no_sync() do not start it
        m = wrap(seeded(mlp))
        with torch.no_grad():
            m(data(0)[0])
        with m.no_sync():
            step(m)
        m._set_static_graph()
        if wrap is LDDP:
            assert m.static_graph
            m.close()


@case
def static_graph_nested_types():  # test_ddp_static_graph_nested_types
    Net = lambda: OneLayer(lambda y: {"a": [y, (y * 2,)], "b": y.detach()})  # noqa: E731
    parity(Net, loss_fn=lambda out, t: F.mse_loss(out["a"][0] + out["a"][1][0], t),
           torch_kw=dict(static_graph=True), lib_kw=dict(static_graph=True))


@case
def deepcopy_and_pickle():
    mine = LDDP(seeded(mlp))
    twin = copy.deepcopy(mine)
    assert twin.comm is comm and twin.module is not mine.module
    mine.close()
    ref = TorchDDP(seeded(mlp))
    got, want = train(twin, 2), train(ref, 2)
    for a, b in zip(got[1], want[1]):
        close(a, b, "deepcopy")
    twin.close()
    raises(TypeError, lambda: pickle.dumps(comm), "cannot be pickled")
    saved = LDDP(seeded(mlp))
    buf = io.BytesIO()
    torch.save(saved, buf)
    saved.close()
    buf.seek(0)
    loaded = torch.load(buf)  # its own context over default_comm (torch.distributed's world)
    got = train(loaded, 2)
    for a, b in zip(got[1], want[1]):
        close(a, b, "torch.save / torch.load")
    loaded.close()


@case
def ignored_params_and_buffers():  # test_ddp_ignore_params_arg (CPU)
    def make():
        m = seeded(mlp)
        torch.manual_seed(rank)
        with torch.no_grad():
            m[2].bias.normal_()  # different on every rank: not broadcast
        return m
    names = ["2.bias"]
    mods = [make(), make()]
    for m in mods:
        TorchDDP._set_params_and_buffers_to_ignore_for_model(m, names)
    ref = TorchDDP(mods[0])
    mine = ltorch.DistributedDataParallel(mods[1], comm)
    assert mine.parameters_to_ignore == names
    got, want = train(mine, 2), train(ref, 2)
    for k, (a, b) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
        close(a, b, "tensor %d" % k)
    mine.close()


# -- comm hooks ----------------------------------------------------------------------------------
def hook_parity(hook, state=None, rtol=1e-5, atol=1e-6, ref_hook=None, **kw):
    parity(mlp, rtol=rtol, atol=atol, torch_kw=kw, lib_kw=kw,
           setup=lambda ref, mine: (ref.register_comm_hook(state, ref_hook or hook),
                                    mine.register_comm_hook(state, hook)))


def noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def checking_hook(state, bucket):
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        assert g.shape == p.shape and torch.equal(g, p.grad), "gradients() is not the parameters' grads"
    return default_hooks.allreduce_hook(None, bucket)


def torch_pg_hook(state, bucket):  # a user hook over torch.distributed: the sum
    return dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future().then(lambda f: f.value()[0])


@case
def comm_hook_allreduce():  # test_ddp_hook_parity_allreduce / test_ddp_comm_hook_allreduce_hook
    hook_parity(default_hooks.allreduce_hook)
    hook_parity(default_hooks.allreduce_hook, find_unused_parameters=True)
    hook_parity(default_hooks.allreduce_hook, gradient_as_bucket_view=True, bucket_cap_mb=0.0001)


@case
def comm_hook_allreduce_process_group():  # test_ddp_hook_parity_allreduce_process_group
    hook_parity(default_hooks.allreduce_hook, state=dist.group.WORLD)
    hook_parity(torch_pg_hook, state=dist.group.WORLD)


@case
def comm_hook_fp16_compress():  # test_ddp_comm_hook_fp16compress_hook
    hook_parity(default_hooks.fp16_compress_hook, rtol=1e-3, atol=1e-3)


@case
def comm_hook_bf16_compress():  # torch 1.13 allows bf16 only with NCCL: compared with allreduce_hook
    hook_parity(default_hooks.bf16_compress_hook, rtol=2e-2, atol=2e-2, ref_hook=default_hooks.allreduce_hook)


@case
def comm_hook_noop_and_gradients():  # test_ddp_comm_hook_future_passing / noop hook
    hook_parity(noop_hook)
    hook_parity(checking_hook)


@case
def builtin_comm_hooks():  # test_builtin_ddp_comm_hooks_nccl (its Gloo form)
    for t in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        parity(mlp, rtol=1e-3, atol=1e-3, setup=lambda ref, mine: (ref.register_comm_hook(
            None, default_hooks.allreduce_hook if t.name == "ALLREDUCE" else default_hooks.fp16_compress_hook),
            mine._register_builtin_comm_hook(t)))


@case
def comm_hook_registered_once():  # test_ddp_comm_hook_register_just_once
    mine = LDDP(mlp())
    mine.register_comm_hook(None, default_hooks.allreduce_hook)
    raises(RuntimeError, lambda: mine.register_comm_hook(None, default_hooks.allreduce_hook), "only be called once")
    raises(TypeError, lambda: LDDP(mlp()).register_comm_hook(None, 1))
    mine.close()


def buffer_allreduce_hook(state, buffers):
    futs = [dist.all_reduce(b, async_op=True).get_future() for b in buffers.values()]
    return futs


@case
def buffer_comm_hook():  # test_ddp_buffer_hook_allreduce / _return_future
    def make():
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))

    def run(wrap):
        m = wrap(seeded(make))
        m._register_buffer_comm_hook(None, buffer_allreduce_hook)
        train(m, 2)
        return [b.clone() for b in m.module.buffers()], m
    want, _ = run(TorchDDP)
    got, m = run(LDDP)
    for a, b in zip(got, want):
        close(a.float(), b.float(), "buffer")
    m.close()


# -- groups, no_sync, buffers, uneven inputs -----------------------------------------------------
@case
def process_group_subgroup():  # DDP over dist.new_group
    ranks = [0, 1]
    g = dist.new_group(ranks)
    if rank in ranks:
        parity(mlp, torch_kw=dict(process_group=g), lib_kw=dict(process_group=g, comm=None))


@case
def no_sync_accumulation():  # test_accumulate_gradients_no_sync
    def run(model):
        for s in range(2):
            x, y = data(s)
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
        x, y = data(9)
        F.mse_loss(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]
    mine = LDDP(seeded(mlp))
    for a, b in zip(run(mine), run(TorchDDP(seeded(mlp)))):
        close(a, b, "no_sync grads")
    mine.close()


@case
def broadcast_buffers_batchnorm():  # test_ddp_broadcast_buffer
    make = lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))  # noqa: E731
    parity(make)


def uneven(model, by_world=True, **join):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(divide_by_initial_world_size=by_world, **join):
        for s in range(2 + rank):
            x, y = data(s)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@case
def join_without_uneven_inputs_argument():  # test_ddp_uneven_inputs / test_ddp_grad_div_uneven_inputs
    for by_world in (True, False):
        want = uneven(TorchDDP(seeded(mlp)), by_world)
        mine = LDDP(seeded(mlp))  # torch's arguments only
        got = uneven(mine, by_world)
        for a, b in zip(got, want):
            close(a, b, "join(divide_by_initial_world_size=%s)" % by_world)
        mine.close()


@case
def join_disabled_and_exception():  # test_ddp_uneven_input_join_disable / _exception
    mine = LDDP(seeded(mlp))
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    with mine.join(enable=False):
        for s in range(2):
            opt.zero_grad()
            F.mse_loss(mine(data(s)[0]), data(s)[1]).backward()

    def body():
        with mine.join():
            raise ValueError("inside the block")
    raises(ValueError, body, "inside the block")  # propagates on every rank, no join
    mine.close()
    raises(NotImplementedError, lambda: LDDP(mlp()).join_hook(), "join_hook")


def main():
    passed = failed = 0
    only = os.environ.get("PORT_CASES")
    for fn in results:
        if only and fn.__name__ not in only.split(","):
            continue
        try:
            fn()
            passed += 1
            print("rank %d: %s ok" % (rank, fn.__name__), flush=True)
        except Exception as e:
            failed += 1
            print("rank %d: %s FAILED: %r\n%s" % (rank, fn.__name__, e, traceback.format_exc()), flush=True)
        dist.barrier()
    print("rank %d: port: %d passed, %d failed" % (rank, passed, failed), flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
