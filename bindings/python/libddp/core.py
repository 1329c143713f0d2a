"""The Pythonic layer: Comm, LocalGroup and DDP over the low layer in _lib.py."""
import contextlib
import ctypes
import os
import weakref
from collections import namedtuple

from . import _lib as L
from .errors import ClosedError, InvalidArgumentError

F16, BF16, F32, F64 = L.DDP_F16, L.DDP_BF16, L.DDP_F32, L.DDP_F64
DTYPE_NAMES = {F16: "float16", BF16: "bfloat16", F32: "float32", F64: "float64"}
_DTYPE_ALIASES = {
    "float16": F16, "f16": F16, "half": F16, "<f2": F16, "torch.float16": F16, "torch.half": F16,
    "bfloat16": BF16, "bf16": BF16, "torch.bfloat16": BF16,
    "float32": F32, "f32": F32, "float": F32, "<f4": F32, "torch.float32": F32, "torch.float": F32,
    "float64": F64, "f64": F64, "double": F64, "<f8": F64, "torch.float64": F64, "torch.double": F64,
}
I32, I64 = L.DDP_I32, L.DDP_I64
# Integers are never grads; ddp_broadcast and ddp_allreduce_host take them.
_INT_NAMES = {I32: "int32", I64: "int64"}
_INT_ALIASES = {
    "int32": I32, "i32": I32, "<i4": I32, "torch.int32": I32, "torch.int": I32,
    "int64": I64, "i64": I64, "<i8": I64, "torch.int64": I64, "torch.long": I64,
}
_ITEMSIZE = {F16: 2, BF16: 2, F32: 4, F64: 8, I32: 4, I64: 8}


def dtype_code(dtype, integers=False):
    """A ddp_dtype_t from an int, a name ('float32', 'f32', 'bf16', ...), a numpy or a torch dtype;
    with `integers`, int32 and int64 too."""
    names = {**DTYPE_NAMES, **_INT_NAMES} if integers else DTYPE_NAMES
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype in names:
            return dtype
    else:
        key = getattr(dtype, "__name__", None) or str(dtype)
        code = _DTYPE_ALIASES.get(key, _INT_ALIASES.get(key) if integers else None)
        if code is not None:
            return code
    raise InvalidArgumentError("libddp: dtype %r is not one of %s" % (dtype, ", ".join(names.values())))


def buffer_info(buf, integers=False):
    """(address, numel, ddp dtype, is_device) of a numpy array, a torch tensor, a CuPy array (or anything
    with __cuda_array_interface__ / __array_interface__), or a (pointer, numel, dtype) tuple; with
    `integers`, int32 and int64 buffers too."""
    if isinstance(buf, (tuple, list)):
        if len(buf) != 3:
            raise InvalidArgumentError("libddp: a raw buffer is a (pointer, numel, dtype) tuple")
        ptr, numel, dtype = buf
        return int(ptr), int(numel), dtype_code(dtype, integers), None
    mod = type(buf).__module__ or ""
    if mod.startswith("torch") and hasattr(buf, "data_ptr"):
        if not buf.is_contiguous():
            raise InvalidArgumentError("libddp: the tensor is not contiguous")
        return buf.data_ptr(), buf.numel(), dtype_code(buf.dtype, integers), buf.is_cuda
    for attr, device in (("__cuda_array_interface__", True), ("__array_interface__", False)):
        iface = getattr(buf, attr, None)
        if iface is None:
            continue
        ptr, readonly = iface["data"]
        if readonly:
            raise InvalidArgumentError("libddp: the array is read-only")
        code = dtype_code(iface["typestr"], integers)
        numel = 1
        for n in iface["shape"]:
            numel *= n
        strides = iface.get("strides")
        if strides is not None:
            expect = _ITEMSIZE[code]
            for n, s in zip(reversed(iface["shape"]), reversed(strides)):
                if n != 1 and s != expect:
                    raise InvalidArgumentError("libddp: the array is not C-contiguous")
                expect *= n
        return ptr, numel, code, device
    raise InvalidArgumentError("libddp: cannot take a buffer from %r (give a numpy array, a torch tensor, "
                               "a CuPy array or a (pointer, numel, dtype) tuple)" % type(buf).__name__)


def stream_ptr(stream):
    """A cudaStream_t as an int from None, an int, a torch.cuda.Stream or a CuPy stream."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise InvalidArgumentError("libddp: cannot take a CUDA stream from %r" % type(stream).__name__)


class _Handle:
    """Owns one library handle; methods on a closed object raise ClosedError."""

    _h = None
    _kind = "object"

    def _handle(self):
        if self._h is None:
            raise ClosedError("libddp: this %s is closed" % self._kind)
        return self._h

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        self._handle()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce_ex__(self, protocol):
        # A copy would own the same library handle and destroy it a second time.
        raise TypeError("libddp: a %s is a live handle of the library; it cannot be pickled or copied (make a new "
                        "one in the process that needs it)" % self._kind)


class Comm(_Handle):
    """A communicator. Make one with Comm.mpi(), Comm.gloo(...), Comm.self(), Comm.nccl(...), Comm.nccl_mpi(...),
    Comm.nccl_store(...)."""

    _kind = "Comm"

    def __init__(self, handle):
        self._h = handle

    @classmethod
    def mpi(cls, mpi_comm=None):
        """Host-memory comm over MPI (MPI_COMM_WORLD, or the MPI_Comm at address `mpi_comm`). Collective."""
        h = L.ddp_comm_t()
        L.lib.ddp_comm_init_mpi(mpi_comm, ctypes.byref(h))
        return cls(h.value)

    @classmethod
    def gloo(cls, init_method="env://", rank=-1, size=-1, timeout_ms=None):
        """Host-memory comm over Gloo (TCP), needing no MPI. `init_method`: "env://" (MASTER_ADDR,
        MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them; libddp's store listens on MASTER_PORT + 1
        or DDP_STORE_PORT; without RANK or WORLD_SIZE, as "auto"), "auto" (rank, size and rendezvous
        from whichever launcher started the process: torchrun, srun, mpirun, mpiexec; docs/api.md, "The
        init method auto"), "tcp://HOST:PORT" or "file:///DIR". A rank or size of -1 is read from RANK /
        WORLD_SIZE (with "auto", from the launcher). Collective; gives up with TimeoutError after `timeout_ms` (default:
        DDP_INIT_TIMEOUT_MS, else 300000; 0 waits forever)."""
        h = L.ddp_comm_t()
        method = None if init_method is None else str(init_method).encode()
        if timeout_ms is None:
            L.lib.ddp_comm_init_gloo(method, int(rank), int(size), ctypes.byref(h))
        else:
            L.lib.ddp_comm_init_gloo_timeout(method, int(rank), int(size), int(timeout_ms), ctypes.byref(h))
        return cls(h.value)

    @classmethod
    def join_gloo(cls, init_method="env://", timeout_ms=None):
        """A joiner's comm: joins a running elastic job over `init_method`'s store (as in gloo(); a TCP store
        must outlive the ranks that died: ddp_launch --elastic). It has no rank until admitted: make a
        DDP(comm, elastic=True, ...) over it, register the job's grads, then DDP.recover() waits for the
        job to admit it (up to `timeout_ms`; default DDP_INIT_TIMEOUT_MS, else 300000; 0: forever) and
        returns the Membership; take the state of its `source`."""
        h = L.ddp_comm_t()
        method = None if init_method is None else str(init_method).encode()
        if timeout_ms is None:
            timeout_ms = int(os.environ.get("DDP_INIT_TIMEOUT_MS") or 300000)
        L.lib.ddp_comm_join_gloo(method, int(timeout_ms), ctypes.byref(h))
        comm = cls(h.value)
        comm._joining = True  # no rank or size until admitted
        return comm

    @classmethod
    def nccl_store(cls, init_method="env://", rank=-1, size=-1, device=0, timeout_ms=None):
        """Device-memory comm over NCCL needing no MPI: the ranks meet as in gloo() and rank 0's NCCL id
        travels over that Gloo comm. Collective; bounded as gloo()."""
        h = L.ddp_comm_t()
        method = None if init_method is None else str(init_method).encode()
        if timeout_ms is None:
            L.lib.ddp_comm_init_nccl_store(method, int(rank), int(size), int(device), ctypes.byref(h))
        else:
            L.lib.ddp_comm_init_nccl_store_timeout(method, int(rank), int(size), int(device), int(timeout_ms),
                                                   ctypes.byref(h))
        return cls(h.value)

    @classmethod
    def join_nccl(cls, init_method="env://", device=0, timeout_ms=None):
        """A joiner's comm for an elastic job whose ranks use nccl_store(): admitted as in join_gloo(), then
        it makes an NCCL comm on CUDA device `device` with the job's ranks. Bounded as join_gloo()."""
        h = L.ddp_comm_t()
        method = None if init_method is None else str(init_method).encode()
        if timeout_ms is None:
            timeout_ms = int(os.environ.get("DDP_INIT_TIMEOUT_MS") or 300000)
        L.lib.ddp_comm_join_nccl(method, int(device), int(timeout_ms), ctypes.byref(h))
        comm = cls(h.value)
        comm._joining = True  # no rank or size until admitted
        return comm

    @classmethod
    def self(cls):
        """A one-rank comm needing no MPI."""
        h = L.ddp_comm_t()
        L.lib.ddp_comm_init_self(ctypes.byref(h))
        return cls(h.value)

    @staticmethod
    def nccl_unique_id():
        """128 bytes to make on one rank and send to the others."""
        nid = L.ddp_nccl_id_t()
        L.lib.ddp_nccl_get_unique_id(ctypes.byref(nid))
        return ctypes.string_at(ctypes.addressof(nid), 128)

    @classmethod
    def nccl(cls, unique_id, nranks, rank, device=0, timeout_ms=None):
        """Device-memory comm over NCCL for `rank` of `nranks` on CUDA device `device`. Collective.
        Gives up with TimeoutError after `timeout_ms` (default: DDP_INIT_TIMEOUT_MS, else 300000;
        0 waits forever) with NCCL 2.14 or later."""
        if len(unique_id) != 128:
            raise InvalidArgumentError("libddp: an NCCL unique id has 128 bytes")
        nid = L.ddp_nccl_id_t()
        ctypes.memmove(ctypes.addressof(nid), bytes(unique_id), 128)
        h = L.ddp_comm_t()
        if timeout_ms is None:
            L.lib.ddp_comm_init_nccl(ctypes.byref(nid), nranks, rank, device, ctypes.byref(h))
        else:
            L.lib.ddp_comm_init_nccl_timeout(ctypes.byref(nid), nranks, rank, device, int(timeout_ms), ctypes.byref(h))
        return cls(h.value)

    @classmethod
    def nccl_mpi(cls, device=0, mpi_comm=None, timeout_ms=None):
        """NCCL comm whose id is made on rank 0 of MPI_COMM_WORLD (or `mpi_comm`) and sent over MPI;
        bounded as nccl()."""
        h = L.ddp_comm_t()
        if timeout_ms is None:
            L.lib.ddp_comm_init_nccl_mpi(mpi_comm, device, ctypes.byref(h))
        else:
            L.lib.ddp_comm_init_nccl_mpi_timeout(mpi_comm, device, int(timeout_ms), ctypes.byref(h))
        return cls(h.value)

    @classmethod
    def wrap_nccl(cls, nccl_comm):
        """Borrows an existing ncclComm_t (an address); it must outlive every DDP made over this comm."""
        h = L.ddp_comm_t()
        L.lib.ddp_comm_wrap_nccl(nccl_comm, ctypes.byref(h))
        return cls(h.value)

    @property
    def rank(self):
        v = ctypes.c_int()
        L.lib.ddp_comm_rank(self._handle(), ctypes.byref(v))
        return v.value

    @property
    def size(self):
        v = ctypes.c_int()
        L.lib.ddp_comm_size(self._handle(), ctypes.byref(v))
        return v.value

    def close(self):
        h, self._h = self._h, None
        if h is not None:
            L.lib.ddp_comm_destroy(h)

    def __repr__(self):
        if self._h is None:
            return "<libddp.Comm closed>"
        return "<libddp.Comm rank %d of %d>" % (self.rank, self.size)


class LocalGroup(_Handle):
    """`nranks` in-process ranks: each of `nranks` threads calls group.comm(rank)."""

    _kind = "LocalGroup"

    def __init__(self, nranks):
        h = L.ddp_local_group_t()
        L.lib.ddp_local_group_create(nranks, ctypes.byref(h))
        self._h = h.value
        self.nranks = nranks

    def comm(self, rank):
        h = L.ddp_comm_t()
        L.lib.ddp_comm_init_local(self._handle(), rank, ctypes.byref(h))
        return Comm(h.value)

    def close(self):
        h, self._h = self._h, None
        if h is not None:
            L.lib.ddp_local_group_destroy(h)


Stats = namedtuple("Stats", [f for f, _ in L.ddp_stats_t._fields_ if f != "size"])
Bucket = namedtuple("Bucket", "dtype wire numel grads stream")
Plan = namedtuple("Plan", "learned buckets")
# What DDP.recover() agreed on (ddp_membership_t), with `members`: each new rank's number in the old world.
Membership = namedtuple("Membership", "epoch rank world old_rank old_world source behind committed members")
Shard = namedtuple("Shard", "dtype bucket_numel shard_numel shard_offset arena_offset grad_ptr param_ptr grads_numel")


def _host_array(ptr, n, code, shape=None):
    """A numpy array over n elements of `code` at host address `ptr`."""
    import numpy as np

    if code == BF16:
        raise InvalidArgumentError("libddp: numpy has no bfloat16; use the pointer")
    ct = {F16: ctypes.c_uint16, F32: ctypes.c_float, F64: ctypes.c_double}[code]
    a = np.ctypeslib.as_array((ct * n).from_address(ptr))
    if code == F16:
        a = a.view(np.float16)
    return a.reshape(shape) if shape is not None else a


class _Storage:
    """Python-owned memory for one grad, exposed through __array_interface__: arrays made from it keep it
    alive (their .base), and a weak reference to it says whether any of them still exists."""

    __slots__ = ("raw", "__array_interface__", "__weakref__")

    def __init__(self, nbytes):
        import numpy as np

        self.raw = np.zeros(max(nbytes, 1), np.uint8)
        self.__array_interface__ = self.raw.__array_interface__

    def array(self, n, code, shape):
        import numpy as np

        ct = {F16: ctypes.c_uint16, F32: ctypes.c_float, F64: ctypes.c_double}
        if code == BF16:
            raise InvalidArgumentError("libddp: numpy has no bfloat16; use the pointer")
        a = np.asarray(self).view(np.float16 if code == F16 else np.dtype(ct[code]))[:n]
        return a.reshape(shape) if shape is not None else a


_ENUMS = {
    "layout": {"copy": L.DDP_LAYOUT_COPY, "arena": L.DDP_LAYOUT_ARENA},
    "plan_order": {"learned": L.DDP_PLAN_LEARNED, "registration": L.DDP_PLAN_REGISTRATION},
    "unused_policy": {"error": L.DDP_UNUSED_ERROR, "zero": L.DDP_UNUSED_ZERO},
    "compression": {
        "none": L.DDP_COMPRESS_NONE,
        "bf16": L.DDP_COMPRESS_BF16,
        "fp16": L.DDP_COMPRESS_FP16,
        "int8": L.DDP_COMPRESS_INT8,
    },
    "uneven_inputs": {"off": L.DDP_UNEVEN_OFF, "by_contributors": L.DDP_UNEVEN_BY_CONTRIBUTORS,
                      "by_world": L.DDP_UNEVEN_BY_WORLD},
}
CONFIG_KEYS = tuple(f for f, _ in L.ddp_config_t._fields_ if f not in ("size", "magic", "version"))


def make_config(**config):
    """A ddp_config_t from keyword arguments named as its fields (layout='arena', plan_order='registration',
    unused_policy='zero', stream_comms=[Comm, ...], timeline_path='t.json', ...). Returns (config, keepalive)."""
    c = L.ddp_config_t()
    # the sized call with our own struct size: the unsized symbol writes version 1 only
    L.lib.ddp_config_init_sized(ctypes.byref(c), ctypes.sizeof(c))
    keep = []
    for key, value in config.items():
        if key not in CONFIG_KEYS:
            raise TypeError("libddp: unknown config key %r (known: %s)" % (key, ", ".join(CONFIG_KEYS)))
        if key in _ENUMS and isinstance(value, str):
            if value not in _ENUMS[key]:
                raise InvalidArgumentError("libddp: %s must be one of %s, not %r" % (key, sorted(_ENUMS[key]), value))
            value = _ENUMS[key][value]
        elif key == "stream_comms":
            if value is None:
                continue
            handles = (L.ddp_comm_t * len(value))(*[cm._handle() for cm in value])
            keep.append((handles, list(value)))
            value = ctypes.cast(handles, ctypes.POINTER(L.ddp_comm_t))
        elif key == "timeline_path":
            value = None if value is None else str(value).encode()
            keep.append(value)
        elif isinstance(value, bool):
            value = int(value)
        setattr(c, key, value)
    return c, keep


class DDP(_Handle):
    """One libddp context over `comm`. Keyword arguments are ddp_config_t fields (see make_config).

        with DDP(comm, message_size=1 << 20) as ddp:
            i = ddp.register(grad_array)
            with ddp.backward():
                ...; ddp.grad_ready(i)
    """

    _kind = "DDP"

    def __init__(self, comm, **config):
        cfg, keep = make_config(**config)
        h = L.ddp_t()
        L.lib.ddp_create(comm._handle(), ctypes.byref(cfg), ctypes.byref(h))
        self._h = h.value
        self._keep = keep
        self._world = 0 if getattr(comm, "_joining", False) else comm.size  # elastic: the world before a change
        self.arena = cfg.layout == L.DDP_LAYOUT_ARENA
        self._grads = []     # (numel, dtype, is_device) per index
        self._buffers = {}   # index -> the object whose memory the library uses (copy layout)
        # Arena layout with the learned plan: the arena moves (and its old storage is freed) at the end of
        # the first synced backward. Arrays handed out before then are over Python-owned storage that
        # follows the arena (see _moved, _push, _pull); index -> weakref to that _Storage.
        self._arena_moves = (self.arena and cfg.plan_order == L.DDP_PLAN_LEARNED and not cfg.shard)
        self._mirrors = {}
        self._synced = True

    # -- registration --------------------------------------------------------------------------
    def register(self, buf=None, *, numel=None, dtype=None, trigger=False, device=False, stand_in=False):
        """Registers a grad; returns its index. Copy layout: `buf` is a numpy array, a torch tensor, a CuPy
        array or (pointer, numel, dtype); stand_in=True: `buf` only stands in for a grad that does not exist
        yet (one scratch buffer may stand in for many; DDP_GRAD_STAND_IN), and the real buffer is given with
        set_grad() or grad_ready(index, buf) before its values matter. Arena layout: give numel= and dtype=
        (buf None), or a buffer whose numel and dtype are used (its memory is not); the storage is then at
        grad_ptr(index)/grad_array(index)."""
        h = self._handle()
        if buf is None:
            if numel is None or dtype is None:
                raise InvalidArgumentError("libddp: register() needs a buffer, or numel= and dtype=")
            ptr, n, code = None, int(numel), dtype_code(dtype)
        else:
            ptr, n, code, dev = buffer_info(buf)
            device = device if dev is None else dev
            if self.arena:
                ptr = None
        idx = ctypes.c_int()
        flags = (L.DDP_GRAD_TRIGGER if trigger else 0) | (L.DDP_GRAD_STAND_IN if stand_in and ptr else 0)
        L.lib.ddp_register_grad(h, ptr, n, code, flags, ctypes.byref(idx))
        self._grads.append((n, code, bool(device)))
        if ptr is not None:
            self._buffers[idx.value] = buf
        return idx.value

    def commit(self):
        """Closes registration (collective; optional, the first backward does it)."""
        L.lib.ddp_commit(self._handle())

    @property
    def num_grads(self):
        return len(self._grads)

    def grad_ptr(self, index):
        """The address where grad `index` lives (arena: the library's view)."""
        p = ctypes.c_void_p()
        L.lib.ddp_grad_ptr(self._handle(), index, ctypes.byref(p))
        return p.value or 0

    def grad_array(self, index, shape=None):
        """A numpy array over grad `index` (host memory), valid until close(). Arena layout: the library's
        storage itself, except before the learned plan's arena has its final place (the end of the first
        synced backward): then the array is Python-owned memory that follows the grad (written into the
        arena at grad_ready, the reduced values read back after each synced reduction) for as long as it
        lives; take the array again after the first synced backward, with none of before alive, for
        zero-copy."""
        if not 0 <= index < len(self._grads):
            raise InvalidArgumentError("libddp: grad index %d out of range (0..%d)" % (index, len(self._grads) - 1))
        n, code, device = self._grads[index]
        if device:
            raise InvalidArgumentError("libddp: grad %d is device memory; use grad_ptr()" % index)
        ptr = self.grad_ptr(index)
        storage = self._mirrors[index]() if index in self._mirrors else None
        if storage is None and self._arena_moves and not self._layout_final():
            storage = _Storage(n * _ITEMSIZE[code])
            ctypes.memmove(storage.raw.ctypes.data, ptr, n * _ITEMSIZE[code])
            self._mirrors[index] = weakref.ref(storage)
        if storage is not None:
            return storage.array(n, code, shape)
        return _host_array(ptr, n, code, shape)

    def _layout_final(self):
        """True once the arena will not move again (the learned plan is in place); then stays true."""
        if self._arena_moves:
            nb, learned = ctypes.c_int(), ctypes.c_int()
            L.lib.ddp_get_plan(self._handle(), ctypes.byref(nb), ctypes.byref(learned))
            self._arena_moves = not learned.value
        return not self._arena_moves

    def _live_mirrors(self):
        """(index, storage) of each array handed out before the arena's final place that is still alive."""
        live = []
        for i, ref in list(self._mirrors.items()):
            storage = ref()
            if storage is None:
                del self._mirrors[i]
            else:
                live.append((i, storage))
        return live

    def _push(self, index=None):
        """The values of the live mirror arrays (of `index`, or all) into the arena, before the library
        reads them."""
        for i, storage in self._live_mirrors():
            if index is None or i == index:
                n, code, _ = self._grads[i]
                ctypes.memmove(self.grad_ptr(i), storage.raw.ctypes.data, n * _ITEMSIZE[code])

    def _pull(self, index=None):
        """The reduced values from the arena (wherever it is now) into the live mirror arrays (of `index`,
        or all)."""
        for i, storage in self._live_mirrors():
            if index is not None and i != index:
                continue
            n, code, _ = self._grads[i]
            ctypes.memmove(storage.raw.ctypes.data, self.grad_ptr(i), n * _ITEMSIZE[code])

    def set_grad(self, index, buf):
        """Copy layout: grad `index` now lives in `buf` (same numel and dtype)."""
        ptr = self._check_buf(index, buf)
        L.lib.ddp_set_grad_ptr(self._handle(), index, ptr)
        self._buffers[index] = buf

    def _check_buf(self, index, buf):
        if not 0 <= index < len(self._grads):
            raise InvalidArgumentError("libddp: grad index %d out of range (0..%d)" % (index, len(self._grads) - 1))
        ptr, n, code, _ = buffer_info(buf)
        if (n, code) != self._grads[index][:2]:
            raise InvalidArgumentError("libddp: grad %d has %d %s elements, the buffer %d %s" % (
                index, self._grads[index][0], DTYPE_NAMES[self._grads[index][1]], n, DTYPE_NAMES[code]))
        return ptr

    # -- the iteration ---------------------------------------------------------------------------
    def begin_backward(self, stream=None):
        L.lib.ddp_begin_backward(self._handle(), stream_ptr(stream))

    def grad_ready(self, index, buf=None):
        """Grad `index` is final for this iteration (thread-safe). `buf`: its storage now (copy layout)."""
        h = self._handle()
        if buf is None:
            if self._mirrors:
                self._push(index)
            L.lib.ddp_grad_ready(h, index)
        else:
            ptr = self._check_buf(index, buf)
            L.lib.ddp_grad_ready_ptr(h, index, ptr)
            self._buffers[index] = buf

    def finish_backward(self, stream=None):
        """Waits for every bucket (host) or makes `stream` wait (GPU); errors of any bucket raise here."""
        self._reduce(L.lib.ddp_finish_backward, self._synced, stream_ptr(stream))

    def wait_grad(self, index, stream=None):
        """Inside a backward pass, after grad `index` was marked ready: True once its reduced value can be
        read (host: its bucket is reduced; GPU: `stream` waits for that bucket), so a trainer can update
        that layer while later buckets still travel; False when nothing is launched for it yet (its
        bucket or an earlier one waits for grads, the first iteration of a learned plan,
        delay_allreduce, sync off, a sharded context): then it is final after finish_backward."""
        reduced = ctypes.c_int(0)
        L.lib.ddp_wait_grad(self._handle(), index, stream_ptr(stream), ctypes.byref(reduced))
        if reduced.value and self._mirrors:
            self._pull(index)
        return bool(reduced.value)

    def _reduce(self, fn, reduces, *args):
        """fn(handle, *args), a call after which the arena may have moved and hold reduced grads (when
        `reduces`): the live mirror arrays read them, even when the call raised (the values kept)."""
        try:
            fn(self._handle(), *args)
        finally:
            if reduces and self._mirrors and self._h is not None:
                try:
                    self._pull()
                except Exception:
                    pass

    @contextlib.contextmanager
    def backward(self, stream=None):
        """begin_backward on entry, finish_backward on a normal exit."""
        self.begin_backward(stream)
        yield self
        self.finish_backward(stream)

    def set_sync(self, enabled):
        L.lib.ddp_set_sync(self._handle(), 1 if enabled else 0)
        self._synced = bool(enabled)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate locally (torch no_sync, apex disable_allreduce)."""
        self.set_sync(False)
        try:
            yield self
        finally:
            if self._h is not None:
                self.set_sync(True)

    def reduce_all(self, stream=None):
        if self._mirrors:
            self._push()
        self._reduce(L.lib.ddp_reduce_all, True, stream_ptr(stream))

    def broadcast(self, buffers, root=0, stream=None):
        """Broadcasts each buffer (numpy array, tensor, (ptr, numel, dtype); float or int32/int64) from
        `root`. Collective."""
        infos = [buffer_info(b, integers=True) for b in buffers]
        n = len(infos)
        ptrs = (ctypes.c_void_p * n)(*[i[0] for i in infos])
        counts = (ctypes.c_size_t * n)(*[i[1] for i in infos])
        dtypes = (L.ddp_dtype_t * n)(*[i[2] for i in infos])
        L.lib.ddp_broadcast(self._handle(), ptrs, counts, dtypes, n, root, stream_ptr(stream))

    def synchronize(self):
        L.lib.ddp_synchronize(self._handle())

    def set_comm_hook(self, fn):
        """ddp_set_comm_hook with a Python function: fn(bucket), `bucket` a ddp_hook_bucket_t, runs on the
        library's threads for every bucket of every synced iteration and leaves the reduced gradient in
        bucket.buffer (the library applies no scaling). An exception it raises fails the bucket (the
        context aborts) and is kept in `hook_error`. None: the library's allreduce again. Before the first
        backward pass."""
        if fn is None:
            thunk = L.ddp_comm_hook_fn()
        else:
            def call(bucket, _user):
                try:
                    fn(bucket.contents)
                    return L.DDP_SUCCESS
                except BaseException as e:  # nothing may unwind into C
                    self.hook_error = e
                    return L.DDP_ERR_INTERNAL
            thunk = L.ddp_comm_hook_fn(call)
        L.lib.ddp_set_comm_hook(self._handle(), thunk, None)
        self._hook_thunk = thunk  # must outlive its registration
        self.hook_error = None

    def join(self):
        """Uneven inputs (uneven_inputs="by_contributors" or "by_world"): this rank is out of data and
        shadows the others' iterations until every rank has joined; returns the synced iterations done
        by then (the same on every rank). Collective."""
        at = ctypes.c_int64()
        self._reduce(L.lib.ddp_join, True, ctypes.byref(at))
        return at.value

    _HOST_OPS = {"sum": L.DDP_OP_SUM, "avg": L.DDP_OP_AVG, "max": L.DDP_OP_MAX, "min": L.DDP_OP_MIN}

    def allreduce_host(self, array, op="sum"):
        """Reduces a contiguous numpy array (float16/32/64, int32/64: the loss, metrics, token counts)
        across the ranks in place; op is "sum", "avg", "max" or "min". Returns the array. Collective."""
        import numpy as np

        codes = {np.dtype(np.float16): L.DDP_F16, np.dtype(np.float32): L.DDP_F32, np.dtype(np.float64): L.DDP_F64,
                 np.dtype(np.int32): L.DDP_I32, np.dtype(np.int64): L.DDP_I64}
        if array.dtype not in codes or not array.flags["C_CONTIGUOUS"] or not array.flags["WRITEABLE"]:
            raise InvalidArgumentError("libddp: allreduce_host takes a writable contiguous float16/32/64 or "
                                       "int32/64 array, not %s" % array.dtype)
        if op not in self._HOST_OPS:
            raise InvalidArgumentError("libddp: op is 'sum', 'avg', 'max' or 'min', not %r" % (op,))
        L.lib.ddp_allreduce_host(self._handle(), array.ctypes.data, array.size, codes[array.dtype],
                                 self._HOST_OPS[op])
        return array

    def barrier(self):
        """Returns when every rank has called it. Collective."""
        L.lib.ddp_barrier(self._handle())

    def recover(self):
        """Elastic contexts (elastic=True), after a call raised RankLostError: agrees with the other live
        ranks on the new membership and rebuilds the context over it; after RankJoiningError: admits the
        processes that wait to join; on a joiner's context (Comm.join_gloo): asks to be admitted and waits
        (see ddp_recover in ddp.h). Returns a Membership (members: each rank's old number, -1 for a
        joiner); every rank should then take the state of `source` (broadcast(..., root=source)) and go
        on from iteration `committed`. Raises RankLostError when this rank was left out, MismatchError
        when the job refused a joiner (with its reason). Collective over the job's ranks and joiners."""
        m = L.ddp_membership_t()
        members = (ctypes.c_int * max(4096, 2 * self._world))()
        L.lib.ddp_recover(self._handle(), ctypes.byref(m), members, len(members))
        self._world = m.world
        return Membership(m.epoch, m.rank, m.world, m.old_rank, m.old_world, m.source, bool(m.behind), m.committed,
                          tuple(members[:m.world]))

    # -- sharded contexts (shard=True) -----------------------------------------------------------
    def shard(self, bucket):
        """This rank's shard of `bucket`: Shard(dtype, bucket_numel, shard_numel, shard_offset, arena_offset,
        grad_ptr, param_ptr, grads_numel). After a reduction only the shard holds reduced grads."""
        info = L.ddp_shard_info_t()
        info.size = ctypes.sizeof(info)
        L.lib.ddp_get_shard(self._handle(), bucket, ctypes.byref(info))
        return Shard(DTYPE_NAMES.get(info.dtype, info.dtype), info.bucket_numel, info.shard_numel, info.shard_offset,
                     info.arena_offset, info.grad_shard or 0, info.param_shard or 0, info.grads_numel)

    def shards(self):
        """Every bucket's shard, in plan order."""
        return [self.shard(b) for b in range(len(self.plan.buckets))]

    def shard_arrays(self, bucket):
        """(grads, params): numpy arrays over this rank's shard of `bucket` in the grad and parameter
        arenas (host memory): flat vectors an elementwise optimizer can update in place."""
        s = self.shard(bucket)
        code = dtype_code(s.dtype)
        return _host_array(s.grad_ptr, s.shard_numel, code), _host_array(s.param_ptr, s.shard_numel, code)

    def grad_shard(self, index):
        """(first, count, shard_pos): the elements [first, first + count) of grad `index` this rank owns,
        at shard_pos in its bucket's shard."""
        first, count, pos = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        L.lib.ddp_grad_shard(self._handle(), index, ctypes.byref(first), ctypes.byref(count), ctypes.byref(pos))
        return first.value, count.value, pos.value

    def param_ptr(self, index):
        """The address of parameter `index` in the library's parameter arena."""
        p = ctypes.c_void_p()
        L.lib.ddp_param_ptr(self._handle(), index, ctypes.byref(p))
        return p.value or 0

    def param_array(self, index, shape=None):
        """A numpy array over parameter `index` in the parameter arena (host memory)."""
        n, code, device = self._grads[index]
        if device:
            raise InvalidArgumentError("libddp: parameter %d is device memory; use param_ptr()" % index)
        return _host_array(self.param_ptr(index), n, code, shape)

    def broadcast_params(self, root=0, stream=None):
        """The whole parameter arena from `root`. Collective."""
        L.lib.ddp_broadcast_params(self._handle(), root, stream_ptr(stream))

    def gather_params(self, stream=None):
        """Launches the all-gather of every bucket's parameter shard (forward order). Collective."""
        L.lib.ddp_gather_params(self._handle(), stream_ptr(stream))

    def wait_params(self, index=-1, stream=None):
        """Waits for the gather of parameter `index`'s bucket (-1: all of them)."""
        L.lib.ddp_wait_params(self._handle(), index, stream_ptr(stream))

    def shard_norm(self, stream=None):
        """(norm, nonfinite): the global L2 norm of the reduced grads over every rank's shard, and the
        number of NaN/Inf among them; the same on every rank. Collective."""
        norm, bad = ctypes.c_double(), ctypes.c_uint64()
        L.lib.ddp_shard_norm(self._handle(), stream_ptr(stream), ctypes.byref(norm), ctypes.byref(bad))
        return norm.value, bad.value

    # -- inspection ----------------------------------------------------------------------------
    @property
    def stats(self):
        s = L.ddp_stats_t()
        s.size = ctypes.sizeof(s)
        L.lib.ddp_get_stats(self._handle(), ctypes.byref(s))
        return Stats(*[getattr(s, f) for f in Stats._fields])

    @property
    def plan(self):
        """The current plan: Plan(learned, [Bucket(dtype, wire, numel, grads, stream), ...])."""
        h = self._handle()
        nb, learned = ctypes.c_int(), ctypes.c_int()
        L.lib.ddp_get_plan(h, ctypes.byref(nb), ctypes.byref(learned))
        buckets = []
        cap = max(len(self._grads), 1)
        for b in range(nb.value):
            info = L.ddp_bucket_info_t()
            info.size = ctypes.sizeof(info)
            grads = (ctypes.c_int * cap)()
            L.lib.ddp_get_bucket(h, b, ctypes.byref(info), grads, cap)
            buckets.append(Bucket(DTYPE_NAMES.get(info.dtype, info.dtype), DTYPE_NAMES.get(info.wire, info.wire),
                                  info.numel, list(grads[:info.num_grads]), info.stream))
        return Plan(bool(learned.value), buckets)

    def close(self):
        """Destroys the context (waits for its work). Further calls raise ClosedError."""
        h, self._h = self._h, None
        if h is not None:
            self._buffers = {}
            L.lib.ddp_destroy(h)
