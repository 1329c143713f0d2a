"""libddp for Python: data-parallel gradient reduction over the libddp C library (ctypes only).

    from libddp import Comm, DDP
    comm = Comm.mpi()
    with DDP(comm) as ddp: ...

libddp.torch.DistributedDataParallel wraps a torch.nn.Module (torch is imported only there).
The library is loaded from LIBDDP_PATH (a file or a directory), else next to this package, else the
system search path.
"""
from . import _lib
from .errors import (DDPError, InvalidArgumentError, InvalidStateError, MismatchError, OutOfMemoryError,
                     UnsupportedError, CudaError, NcclError, MpiError, DDPTimeoutError, AbortedError,
                     InternalError, RankLostError, RankJoiningError, ClosedError, from_status)
from .core import (Comm, LocalGroup, DDP, Stats, Bucket, Plan, Shard, Membership, F16, BF16, F32, F64, dtype_code, buffer_info,
                   make_config)

library_path = _lib.path


def version():
    """The loaded library's version code (10000*major + 100*minor + patch)."""
    return _lib.lib.ddp_version()


def launcher_ranks():
    """(rank, size, local_rank) as the launcher that started this process set them (torchrun, Slurm's
    srun, Open MPI's mpirun, MPICH's mpiexec), read as the init method "auto" reads them, without making
    a comm: e.g. to pick the CUDA device (local_rank % device count) before Comm.nccl_store("auto").
    local_rank is -1 when no variable gives it and the job may span hosts. Raises
    InvalidArgumentError when no launcher's variables give a rank and a size, or two launchers' disagree."""
    import ctypes
    rank, size, local_rank = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _lib.lib.ddp_launcher_ranks(ctypes.byref(rank), ctypes.byref(size), ctypes.byref(local_rank))
    return rank.value, size.value, local_rank.value


def status_string(status):
    return _lib.lib.ddp_status_string(status).decode()


LOG_WARN = _lib.DDP_LOG_WARN
LOG_INFO = _lib.DDP_LOG_INFO
_log_callback = None  # the ctypes thunk must outlive its registration


def set_log_callback(fn):
    """Routes libddp's log (stall warnings; with DDP_DEBUG=INFO, the plan and summaries) to
    fn(level, message), level LOG_WARN or LOG_INFO, instead of stderr; None restores stderr. fn is
    called from libddp's threads; an exception it raises is printed and dropped."""
    global _log_callback
    if fn is None:
        thunk = _lib.ddp_log_fn()
    else:
        def call(level, message, _user):
            try:
                fn(level, message.decode("utf-8", "replace"))
            except Exception:  # nothing may unwind into C
                import traceback
                traceback.print_exc()
        thunk = _lib.ddp_log_fn(call)
    _lib.lib.ddp_set_log_callback(thunk, None)
    _log_callback = thunk if fn is not None else None


__all__ = ["Comm", "LocalGroup", "DDP", "DDPError", "InvalidArgumentError", "InvalidStateError", "MismatchError",
           "OutOfMemoryError", "UnsupportedError", "CudaError", "NcclError", "MpiError", "DDPTimeoutError",
           "AbortedError", "InternalError", "RankLostError", "RankJoiningError", "ClosedError", "Stats", "Bucket", "Plan", "F16", "BF16", "F32", "F64",
           "version", "launcher_ranks", "status_string", "library_path", "set_log_callback", "LOG_WARN", "LOG_INFO"]
