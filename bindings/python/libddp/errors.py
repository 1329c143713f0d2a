"""Exceptions: one DDPError subclass per ddp_status_t, each carrying the status and the library's message."""

SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_STATE = 2
MISMATCH = 3
OUT_OF_MEMORY = 4
UNSUPPORTED = 5
CUDA = 6
NCCL = 7
MPI = 8
TIMEOUT = 9
ABORTED = 10
INTERNAL = 11


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


class ClosedError(InvalidStateError):
    """A method was called on a Comm or DDP after close(). Raised by the binding, not the library."""


BY_STATUS = {c.status: c for c in (InvalidArgumentError, InvalidStateError, MismatchError, OutOfMemoryError,
                                   UnsupportedError, CudaError, NcclError, MpiError, DDPTimeoutError,
                                   AbortedError, InternalError)}


def from_status(status, message):
    """The exception for a non-success status (a plain DDPError for a value this binding does not know)."""
    cls = BY_STATUS.get(status)
    if cls is None:
        return DDPError(message or "unknown status %d" % status, status)
    return cls(message)
