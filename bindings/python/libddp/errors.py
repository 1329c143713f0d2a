"""Exceptions: one DDPError subclass per ddp_status_t, each carrying the status and the library's message."""

from . import _ddp_h as H

# The status codes, as ddp.h numbers them.
SUCCESS = H.DDP_SUCCESS
INVALID_ARGUMENT = H.DDP_ERR_INVALID_ARGUMENT
INVALID_STATE = H.DDP_ERR_INVALID_STATE
MISMATCH = H.DDP_ERR_MISMATCH
OUT_OF_MEMORY = H.DDP_ERR_OUT_OF_MEMORY
UNSUPPORTED = H.DDP_ERR_UNSUPPORTED
CUDA = H.DDP_ERR_CUDA
NCCL = H.DDP_ERR_NCCL
MPI = H.DDP_ERR_MPI
TIMEOUT = H.DDP_ERR_TIMEOUT
ABORTED = H.DDP_ERR_ABORTED
INTERNAL = H.DDP_ERR_INTERNAL
RANK_LOST = H.DDP_ERR_RANK_LOST
RANK_JOINING = H.DDP_ERR_RANK_JOINING


class DDPError(RuntimeError):
    """A libddp call failed. `status` is the ddp_status_t value, `message` the library's detailed text."""

    status = None

    def __init__(self, message, status=None):
        if status is not None:
            self.status = status
        self.message = message
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.message, self.status))


class InvalidArgumentError(DDPError, ValueError):
    status = INVALID_ARGUMENT


class InvalidStateError(DDPError):
    status = INVALID_STATE


class MismatchError(DDPError):
    status = MISMATCH


class OutOfMemoryError(DDPError, MemoryError):
    status = OUT_OF_MEMORY


class UnsupportedError(DDPError):
    status = UNSUPPORTED


class CudaError(DDPError):
    status = CUDA


class NcclError(DDPError):
    status = NCCL


class MpiError(DDPError):
    status = MPI


class DDPTimeoutError(DDPError, TimeoutError):
    status = TIMEOUT


class AbortedError(DDPError):
    status = ABORTED


class InternalError(DDPError):
    status = INTERNAL


class RankLostError(DDPError):
    """Elastic contexts (elastic=True): a peer was lost and this iteration was not committed (skip its
    update); call DDP.recover(), take the state of the returned membership's source, and go on."""
    status = RANK_LOST


class RankJoiningError(DDPError):
    """Elastic contexts: a process asked to join and waits at this step boundary (nothing of the call was
    done); call DDP.recover(), take the state of the returned membership's source, and make the call again.
    On a joiner's context (Comm.join_gloo) before its admission: call DDP.recover() to be admitted."""
    status = RANK_JOINING


class ClosedError(InvalidStateError):
    """A method was called on a Comm or DDP after close(). Raised by the binding, not the library."""


BY_STATUS = {c.status: c for c in (InvalidArgumentError, InvalidStateError, MismatchError, OutOfMemoryError,
                                   UnsupportedError, CudaError, NcclError, MpiError, DDPTimeoutError,
                                   AbortedError, InternalError, RankLostError, RankJoiningError)}


def from_status(status, message):
    """The exception for a non-success status (a plain DDPError for a value this binding does not know)."""
    cls = BY_STATUS.get(status)
    if cls is None:
        return DDPError(message or "unknown status %d" % status, status)
    return cls(message)
