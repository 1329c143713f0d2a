"""The Pythonic layer on one process: Comm.self, in-process ranks, buffers, lifecycle, use after close."""
import os
import threading
import time

import numpy as np
import pytest

import libddp
from libddp import DDP, Comm


def test_version_and_library_path():
    assert libddp.version() == libddp._lib.DDP_VERSION_CODE
    assert libddp.library_path.endswith(("libddp.so.0", "libddp.so"))


def test_self_comm_lifecycle_with_numpy():
    g = [np.arange(10, dtype=np.float32), np.linspace(0, 1, 7)]
    with Comm.self() as c:
        assert (c.rank, c.size) == (0, 1)
        with DDP(c, message_size=8, gradient_predivide_factor=4.0) as d:
            idx = [d.register(x) for x in g]
            assert idx == [0, 1] and d.num_grads == 2
            with d.backward():
                for i in reversed(idx):
                    d.grad_ready(i)
            assert np.allclose(g[0], np.arange(10)) and np.allclose(g[1], np.linspace(0, 1, 7))
            s = d.stats
            assert s.iterations == 1 and s.world_size == 1 and s.buckets_reduced >= 2
            p = d.plan
            assert p.learned and sorted(i for b in p.buckets for i in b.grads) == [0, 1]
            assert {b.dtype for b in p.buckets} == {"float32", "float64"}


def test_buffers_of_every_kind():
    torch = pytest.importorskip("torch")
    a = np.zeros(6, np.float64)
    t = torch.zeros(3, 4, dtype=torch.float32)
    h = np.zeros(5, np.float16)
    raw = np.zeros(8, np.float32)
    raw16 = np.zeros(2, np.uint16)
    with Comm.self() as c, DDP(c) as d:
        d.register(a)
        d.register(t)
        d.register(h)
        d.register((raw.ctypes.data, 8, "float32"))
        d.register((raw16.ctypes.data, 2, libddp.BF16))  # memory of its own: grads may not overlap
        d.commit()
        assert d.grad_ptr(1) == t.data_ptr() and d.grad_ptr(3) == raw.ctypes.data
        with pytest.raises(libddp.InvalidArgumentError, match="read-only"):
            ro = np.zeros(3, np.float32)
            ro.flags.writeable = False
            libddp.buffer_info(ro)
        with pytest.raises(libddp.InvalidArgumentError, match="contiguous"):
            libddp.buffer_info(np.zeros((4, 4), np.float32)[:, 1])
        with pytest.raises(libddp.InvalidArgumentError, match="contiguous"):
            libddp.buffer_info(torch.zeros(4, 4).t())
        with pytest.raises(libddp.InvalidArgumentError, match="dtype"):
            libddp.buffer_info(np.zeros(3, np.int32))
        with pytest.raises(libddp.InvalidArgumentError, match="has 6"):
            d.set_grad(0, np.zeros(5, np.float64))


def test_unknown_config_key_and_enum_names():
    with Comm.self() as c:
        with pytest.raises(TypeError, match="unknown config key"):
            DDP(c, bucket_cap=3)
        with pytest.raises(libddp.InvalidArgumentError, match="layout"):
            DDP(c, layout="flat")
        DDP(c, layout="arena", plan_order="registration", unused_policy="zero", check_finite=True,
            timeout_ms=5000, num_streams=2, delay_allreduce=True).close()


def test_use_after_close_raises_not_crashes():
    c = Comm.self()
    d = DDP(c)
    i = d.register(np.zeros(3, np.float32))
    d.close()
    d.close()  # twice is fine
    for call in (lambda: d.register(np.zeros(3, np.float32)), d.commit, lambda: d.grad_ptr(i), d.begin_backward,
                 lambda: d.grad_ready(i), d.finish_backward, lambda: d.set_sync(True), d.reduce_all, d.synchronize,
                 lambda: d.stats, lambda: d.plan, lambda: d.broadcast([np.zeros(1)]),
                 lambda: d.set_grad(i, np.zeros(3, np.float32))):
        with pytest.raises(libddp.ClosedError):
            call()
    c.close()
    with pytest.raises(libddp.ClosedError):
        c.rank
    with pytest.raises(libddp.ClosedError):
        DDP(c)
    assert "closed" in repr(c)


def test_ddp_outlives_its_comm():
    c = Comm.self()
    d = DDP(c)
    c.close()
    g = np.ones(4, np.float32)
    d.register(g)
    d.reduce_all()
    assert np.all(g == 1)
    d.close()


def test_four_thread_ranks_reduce_and_arena():
    def body(r, d):
        i = d.register(numel=40, dtype="f32")
        j = d.register(numel=3, dtype=np.float64)
        with d.backward():
            d.grad_array(i)[:] = r + 1
            d.grad_array(j)[:] = 10.0 * r
            d.grad_ready(j)
            d.grad_ready(i)
        return d.grad_array(i).copy(), d.grad_array(j).copy()

    for a, b in _arena_ranks(4, body, plan_order="registration"):
        assert np.allclose(a, 2.5) and np.allclose(b, 15.0)


def test_wait_grad_reads_a_reduced_grad_before_finish_backward():
    """Registration plan, one grad per bucket: the last registered is reduced first and can be read
    before finish_backward; outside a backward pass wait_grad is refused."""
    def body(r, d):
        first, last = d.register(numel=40, dtype="f32"), d.register(numel=3, dtype=np.float64)
        seen = []
        with d.backward():
            for k, g in ((10.0 * r, last), (r + 1, first)):
                d.grad_array(g)[:] = k
                d.grad_ready(g)
                seen.append((d.wait_grad(g), d.grad_array(g).copy()))
        with pytest.raises(libddp.InvalidStateError, match="no backward pass in progress"):
            d.wait_grad(first)
        return seen

    for (got_last, v_last), (got_first, v_first) in _arena_ranks(4, body, plan_order="registration", message_size=3):
        assert got_last and got_first and np.allclose(v_last, 15.0) and np.allclose(v_first, 2.5)


def test_no_sync_context():
    g = np.zeros(3, np.float32)
    with Comm.self() as c, DDP(c) as d:
        i = d.register(g)
        with d.no_sync():
            with d.backward():
                d.grad_ready(i)
        with d.backward():
            d.grad_ready(i)
        assert d.stats.iterations == 1


def test_cuda_array_interface_is_taken_as_device_memory():
    class FakeCupy:  # what CuPy arrays expose; the memory is never touched here
        __cuda_array_interface__ = {"shape": (3, 5), "typestr": "<f4", "data": (0xABC000, False), "version": 3,
                                    "strides": None}
    assert libddp.buffer_info(FakeCupy()) == (0xABC000, 15, libddp.F32, True)


def test_library_found_next_to_the_package_and_on_the_search_path(tmp_path):
    import os
    import shutil
    import subprocess
    from conftest import PKG, PYTHON

    lib = os.path.realpath(libddp.library_path)
    shutil.copytree(os.path.join(PKG, "libddp"), tmp_path / "next" / "libddp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(lib, tmp_path / "next" / "libddp" / "libddp.so.0")
    shutil.copytree(os.path.join(PKG, "libddp"), tmp_path / "sys" / "libddp", ignore=shutil.ignore_patterns("__pycache__"))
    code = "import libddp; print(libddp.library_path); print(libddp.version())"
    env = {k: v for k, v in os.environ.items() if k not in ("LIBDDP_PATH", "LD_LIBRARY_PATH")}
    out = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, check=True, cwd=str(tmp_path),
                         env=dict(env, PYTHONPATH=str(tmp_path / "next"))).stdout.decode().split()
    assert out == [str(tmp_path / "next" / "libddp" / "libddp.so.0"), str(libddp._lib.DDP_VERSION_CODE)]
    out = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, check=True, cwd=str(tmp_path),
                         env=dict(env, PYTHONPATH=str(tmp_path / "sys"), LD_LIBRARY_PATH=os.path.dirname(lib))
                         ).stdout.decode().split()
    assert out[1] == str(libddp._lib.DDP_VERSION_CODE)
    bad = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(tmp_path),
                         env=dict(env, PYTHONPATH=str(tmp_path / "sys"), LIBDDP_PATH=str(tmp_path / "nothing.so")))
    assert bad.returncode != 0 and b"set LIBDDP_PATH" in bad.stdout


def test_log_callback_gets_the_stall_warning_naming_the_late_rank():
    n = 3
    group = libddp.LocalGroup(n)
    lines = []
    libddp.set_log_callback(lambda level, msg: lines.append((level, msg)))
    errs = []

    def rank(r):
        try:
            with group.comm(r) as c, DDP(c, plan_order="registration", stall_warning_ms=100) as d:
                g = np.ones(8, dtype=np.float32)
                i = d.register(g)
                with d.backward():
                    if r == n - 1:
                        time.sleep(0.5)
                    d.grad_ready(i)
        except Exception as e:
            errs.append(e)

    try:
        ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
    finally:
        libddp.set_log_callback(None)
        group.close()
    assert not errs, errs
    warns = [m for lv, m in lines if lv == libddp.LOG_WARN]
    assert len(warns) == n - 1, lines
    assert all("behind this rank: rank %d" % (n - 1) in m for m in warns), warns


_DEBUG_SCRIPT = """
import numpy as np, libddp
with libddp.Comm.self() as c, libddp.DDP(c, plan_order="registration") as d:
    g = np.ones(8, dtype=np.float32)
    i = d.register(g)
    for _ in range(4):
        with d.backward():
            d.grad_ready(i)
"""


@pytest.mark.parametrize("debug", [None, "INFO"])
def test_ddp_debug_info_prints_the_plan_and_summaries_and_nothing_otherwise(debug):
    import subprocess
    from conftest import PYTHON, CHILD_PATH
    env = dict(os.environ, PYTHONPATH=CHILD_PATH)
    env.pop("DDP_DEBUG", None)
    if debug:
        env.update(DDP_DEBUG=debug, DDP_DEBUG_EVERY="2")
    p = subprocess.run([PYTHON, "-c", _DEBUG_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    err = p.stderr.decode()
    if debug is None:
        assert err == "" and p.stdout == b""
    else:
        assert "libddp info: rank 0: plan of 1 grads in 1 buckets" in err, err
        assert "bucket 0: 1 grads, 8 elements of f32" in err, err
        assert err.count("libddp info: rank 0: iteration") == 2, err  # iterations 2 and 4


_LEARNED_SCRIPT = """
import numpy as np, libddp
lines = []
libddp.set_log_callback(lambda level, message: lines.append((level, message)))
with libddp.Comm.self() as c, libddp.DDP(c, message_size=10) as d:
    grads = [np.ones(8, dtype=np.float32) for _ in range(3)]
    idx = [d.register(g) for g in grads]
    for _ in range(3):
        with d.backward():
            for i in reversed(idx):
                d.grad_ready(i)
libddp.set_log_callback(None)
for level, message in lines:
    print(level, message)
"""


def _run_child(script, debug):
    import subprocess
    from conftest import PYTHON, CHILD_PATH
    env = dict(os.environ, PYTHONPATH=CHILD_PATH)
    env.pop("DDP_DEBUG", None)
    if debug is not None:
        env["DDP_DEBUG"] = debug
    p = subprocess.run([PYTHON, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.decode(), p.stderr.decode()


@pytest.mark.parametrize("debug", ["INFO", "info"])
def test_ddp_debug_info_logs_the_learned_plan_when_it_is_adopted(debug):
    out, err = _run_child(_LEARNED_SCRIPT, debug)
    plans = [ln for ln in out.splitlines() if ": plan of 3 grads" in ln]
    assert len(plans) == 2, out  # the committed plan, then the learned one (adopted once)
    assert "registration order until learned" in plans[0], plans
    assert "learned from the ready order of iteration 0" in plans[1], plans
    assert err == "", err  # with a callback set the library prints nothing


@pytest.mark.parametrize("value", ["verbose", "DEBUG", "1"])
def test_ddp_debug_unknown_value_warns_once_naming_the_accepted_values(value):
    two = _DEBUG_SCRIPT + _DEBUG_SCRIPT  # two contexts: still one warning
    out, err = _run_child(two, value)
    assert out == ""
    warns = [ln for ln in err.splitlines() if ln.startswith("libddp warning: DDP_DEBUG='%s'" % value)]
    assert len(warns) == 1 and len(err.splitlines()) == 1, err
    for accepted in ("INFO", "WARN", "OFF", "NONE", "any case"):
        assert accepted in warns[0], warns
    # through the callback when one is set, as every warning
    out, err = _run_child(_LEARNED_SCRIPT, value)
    assert err == "" and out.count("DDP_DEBUG='%s' is not a value libddp knows" % value) == 1, (out, err)
    assert "plan of" not in out  # warnings only


@pytest.mark.parametrize("value", ["WARN", "warning", "off", "NONE", ""])
def test_ddp_debug_known_values_do_not_warn(value):
    out, err = _run_child(_DEBUG_SCRIPT, value)
    assert out == "" and err == "", err


def test_sharded_context_on_one_rank():
    """The shard views and calls of a sharded context; misuse raises with the library's message."""
    comm = libddp.Comm.self()
    with libddp.DDP(comm, layout="arena", plan_order="registration", shard=True, message_size=100,
                    gradient_predivide_factor=2.0, gradient_average=False) as d:
        a = d.register(numel=70, dtype="float32")
        b = d.register(numel=30, dtype="float64")
        d.commit()
        d.grad_array(a)[:] = np.arange(70)
        d.grad_array(b)[:] = 1.0
        with d.backward():
            d.grad_ready(b)
            d.grad_ready(a)
        shards = d.shards()
        assert [s.shard_offset for s in shards] == [0, 0]
        assert all(s.bucket_numel >= s.grads_numel and s.arena_offset % 256 == 0 for s in shards)
        assert d.grad_shard(a) == (0, 70, 0)
        np.testing.assert_array_equal(d.grad_array(a), np.arange(70) / 2.0)
        norm, bad = d.shard_norm()
        assert abs(norm - np.sqrt((np.arange(70) / 2.0) @ (np.arange(70) / 2.0) + 30 * 0.25)) < 1e-9 and bad == 0
        grads, params = d.shard_arrays(0)
        params[:] = 3.0
        d.gather_params()
        d.wait_params(a)
        assert (d.param_array(a) == 3.0).all()
        with pytest.raises(libddp.InvalidStateError, match="already gathered since the last reduction"):
            d.gather_params()
    with libddp.DDP(comm) as plain:
        with pytest.raises(libddp.InvalidStateError, match="needs a sharded context"):
            plain.gather_params()
    with pytest.raises(libddp.InvalidArgumentError, match="config.shard needs config.layout = DDP_LAYOUT_ARENA"):
        libddp.DDP(comm, shard=True)



def _arena_ranks(n, body, **config):
    """Runs body(rank, ddp) on n thread ranks, each with an arena context (the learned plan unless
    `config` says otherwise); returns their results, raising the first rank's exception."""
    group = libddp.LocalGroup(n)
    out, errs = [None] * n, []

    def rank(r):
        try:
            with group.comm(r) as c, DDP(c, layout="arena", **{"message_size": 16, **config}) as d:
                out[r] = body(r, d)
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    group.close()
    if errs:
        raise errs[0]
    return out


def test_arena_arrays_taken_before_the_plan_is_learned_follow_the_arena():
    """The numpy pattern: arrays taken once before the loop. The learned plan moves the arena at the end of
    the first synced backward; the arrays must still be the grads (written, reduced, read) after it."""
    def body(r, d):
        i = d.register(numel=40, dtype="f32")
        j = d.register(numel=3, dtype=np.float64)
        gi, gj = d.grad_array(i), d.grad_array(j, shape=(3, 1))  # before the loop
        seen = []
        for step in range(4):
            with d.backward():
                gj[:] = 10.0 * r + step
                d.grad_ready(j)
                gi[:] = r + 1 + step
                d.grad_ready(i)
            seen.append((gi.copy(), gj.copy()))
        assert d.stats.layout_epoch == 1
        fresh = d.grad_array(i)                 # the same grad seen through a new array: same values
        fresh[:] = 7.0                          # ... and one storage: writes through either are one grad
        assert (gi == 7.0).all()
        return seen

    for seen in _arena_ranks(2, body):
        for step, (a, b) in enumerate(seen):
            assert np.allclose(a, 1.5 + step), (step, a)   # mean of r + 1 + step over r = 0, 1
            assert np.allclose(b, 5.0 + step), (step, b)


def test_arena_arrays_after_the_move_are_the_arena_itself():
    """Arrays taken after the move (no array of before it alive) are zero-copy views of the arena."""
    def body(r, d):
        i = d.register(numel=8, dtype="f32")
        d.grad_array(i)  # dropped at once
        with d.backward():
            d.grad_ready(i)
        g = d.grad_array(i)
        assert g.ctypes.data == d.grad_ptr(i)
        with d.backward():
            g[:] = r
            d.grad_ready(i)
        return g.copy()

    for g in _arena_ranks(2, body):
        assert np.allclose(g, 0.5)


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_contexts_made_and_closed_over_one_comm_leave_nothing_behind():
    """Each context duplicates its comm (control, broadcast, streams); over a long-lived local comm those
    channels, with their copies of the largest message, used to stay until the comm was closed: 8 MB a
    context here (160 MB for 20). They now go with the context."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    state = np.ones(2 * 2**20, np.float32)  # 8 MB
    with Comm.self() as c:
        def cycle():
            with DDP(c) as d:
                d.broadcast([state])
        cycle()
        if trim:
            trim(0)
        before = _rss_mb()
        for _ in range(20):
            cycle()
        if trim:
            trim(0)
        grown = _rss_mb() - before
    assert grown < 48, "%.1f MB more after 20 contexts" % grown


def test_broadcast_takes_integer_buffers_beside_float_ones():
    """A step count (int64), token ids (int32) and float state from one rank, numpy and torch alike."""
    torch = pytest.importorskip("torch")
    n = 3
    group = libddp.LocalGroup(n)
    got, errs = [None] * n, []

    def rank(r):
        try:
            with group.comm(r) as c, DDP(c) as d:
                step = np.array([123456789012345 if r == 2 else -1], dtype=np.int64)
                ids = torch.full((5,), -7 if r == 2 else r, dtype=torch.int32)
                w = np.full(4, float(r))
                d.broadcast([step, ids, w], root=2)
                got[r] = (int(step[0]), ids.tolist(), w.tolist())
                with pytest.raises(libddp.InvalidArgumentError, match="int64"):
                    d.broadcast([np.zeros(2, np.uint8)])  # not a ddp_dtype_t: refused before any call
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    group.close()
    assert not errs, errs
    assert got == [(123456789012345, [-7] * 5, [2.0] * 4)] * n
