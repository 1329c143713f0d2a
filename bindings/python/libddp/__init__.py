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
                     InternalError, ClosedError, from_status)
from .core import (Comm, LocalGroup, DDP, Stats, Bucket, Plan, F16, BF16, F32, F64, dtype_code, buffer_info,
                   make_config)

library_path = _lib.path


def version():
    """The loaded library's version code (10000*major + 100*minor + patch)."""
    return _lib.lib.ddp_version()


def status_string(status):
    return _lib.lib.ddp_status_string(status).decode()


__all__ = ["Comm", "LocalGroup", "DDP", "DDPError", "InvalidArgumentError", "InvalidStateError", "MismatchError",
           "OutOfMemoryError", "UnsupportedError", "CudaError", "NcclError", "MpiError", "DDPTimeoutError",
           "AbortedError", "InternalError", "ClosedError", "Stats", "Bucket", "Plan", "F16", "BF16", "F32", "F64",
           "version", "status_string", "library_path"]
