"""Every ddp_status_t maps to its DDPError subclass, carrying the status and the library's message."""
import ctypes
import threading

import numpy as np
import pytest

import libddp
from libddp import _lib as L
from libddp import errors

EXPECTED = {
    1: libddp.InvalidArgumentError, 2: libddp.InvalidStateError, 3: libddp.MismatchError,
    4: libddp.OutOfMemoryError, 5: libddp.UnsupportedError, 6: libddp.CudaError, 7: libddp.NcclError,
    8: libddp.MpiError, 9: libddp.DDPTimeoutError, 10: libddp.AbortedError, 11: libddp.InternalError,
    12: libddp.RankLostError, 13: libddp.RankJoiningError,
}


def test_status_strings_come_from_the_library():
    assert libddp.status_string(0) == "success"
    assert libddp.status_string(3) == "ranks disagree"
    assert libddp.status_string(999) == "unknown status"


@pytest.mark.parametrize("status", sorted(EXPECTED))
def test_each_status_raises_its_class_with_the_last_error(status):
    # Make the library fail for real, so that ddp_last_error holds its message, then pass the status
    # through the errcheck every status-returning function uses (ctypes hands it an int).
    with pytest.raises(libddp.InvalidArgumentError):
        L.lib.ddp_comm_rank(None, None)
    msg = L.lib.ddp_last_error().decode()
    assert msg.startswith("ddp_comm_rank")
    with pytest.raises(libddp.DDPError) as ei:
        L._errcheck(status, None, ())
    e = ei.value
    assert type(e) is EXPECTED[status] and e.status == status and e.message == msg and str(e) == msg
    assert errors.BY_STATUS[status] is EXPECTED[status]


def test_every_status_of_the_header_has_its_class():
    codes = {n: getattr(L, n) for n in dir(L) if n.startswith("DDP_ERR_")}
    assert sorted(codes.values()) == sorted(EXPECTED)
    for name, code in codes.items():
        assert getattr(errors, name[len("DDP_ERR_"):]) == code and errors.BY_STATUS[code] is EXPECTED[code], name
    assert errors.SUCCESS == L.DDP_SUCCESS == 0


def test_unknown_status_is_a_plain_ddperror():
    e = errors.from_status(77, "x")
    assert type(e) is libddp.DDPError and e.status == 77


def test_python_exception_bases():
    assert issubclass(libddp.InvalidArgumentError, ValueError)
    assert issubclass(libddp.DDPTimeoutError, TimeoutError)
    assert issubclass(libddp.OutOfMemoryError, MemoryError)
    assert issubclass(libddp.ClosedError, libddp.InvalidStateError)


def test_invalid_argument_for_real():
    with libddp.Comm.self() as c, libddp.DDP(c) as d:
        with pytest.raises(libddp.InvalidArgumentError) as ei:
            L.lib.ddp_register_grad(d._h, None, 4, 2, 0, ctypes.byref(ctypes.c_int()))
        assert ei.value.status == 1 and "grad is NULL" in ei.value.message
        a = np.zeros(4, np.float32)
        with pytest.raises(libddp.InvalidArgumentError, match="numel"):
            d.register((a.ctypes.data, 0, "f32"))
    with libddp.Comm.self() as c:
        with pytest.raises(libddp.InvalidArgumentError, match="predivide"):
            libddp.DDP(c, gradient_predivide_factor=0.0)


def test_invalid_state_for_real():
    a = np.zeros(4, np.float32)
    with libddp.Comm.self() as c, libddp.DDP(c) as d:
        i = d.register(a)
        d.begin_backward()
        with pytest.raises(libddp.InvalidStateError, match="already in progress") as ei:
            d.begin_backward()
        assert ei.value.status == 2
        d.grad_ready(i)
        with pytest.raises(libddp.InvalidStateError, match="already marked ready"):
            d.grad_ready(i)
        with pytest.raises(libddp.InvalidStateError, match="inside a backward"):
            d.set_sync(False)
        d.finish_backward()


def test_mismatch_for_real_across_threads():
    group = libddp.LocalGroup(2)
    got = [None, None]

    def rank(r):
        with group.comm(r) as c, libddp.DDP(c) as d:
            d.register(np.zeros(5 + r, np.float32))
            try:
                d.commit()
            except libddp.DDPError as e:
                got[r] = e

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    group.close()
    for e in got:
        assert isinstance(e, libddp.MismatchError) and e.status == 3 and e.message, got


def test_unsupported_or_device_error_for_nccl_without_a_gpu():
    try:
        libddp.Comm.nccl_unique_id()
    except (libddp.UnsupportedError, libddp.CudaError, libddp.NcclError) as e:
        assert e.message.startswith("ddp_")
    # with a CUDA build and a GPU the id is made: nothing to check here


def test_join_nccl_without_a_gpu_names_the_cause():
    """Comm.join_nccl checks its device before it files a join request (no store is touched)."""
    try:
        libddp.Comm.join_nccl("file:///nonexistent-libddp-store", device=0, timeout_ms=100)
    except (libddp.UnsupportedError, libddp.CudaError) as e:
        assert e.message.startswith("ddp_comm_join_nccl"), e.message
    else:  # a CUDA build on a machine with a GPU: a joiner's comm, which has no rank until admitted
        pass
