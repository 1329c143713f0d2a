"""libddp.torch: DistributedDataParallel for torch.nn.Module over libddp (torch is imported here only).

    import libddp.torch
    model = libddp.torch.DistributedDataParallel(model)          # the job's world: torchrun or mpirun
    loss = model(x).sum(); loss.backward()                        # grads reduced when backward returns

As apex does, it hooks each parameter's grad accumulator: when the accumulator has run, the grad is
final for this backward pass and is handed to ddp_grad_ready; a callback queued on the autograd engine
calls ddp_finish_backward before backward() returns.

Where torch.nn.parallel.DistributedDataParallel defines a behaviour, this module follows it:
- find_unused_parameters=True: a parameter that no rank used keeps its .grad untouched (None after
  zero_grad(set_to_none=True), so optimizers skip it); one unused on some ranks only gets the reduced
  value on every rank, the unused ranks contributing their current .grad (zeros if None). As torch does,
  the ranks learn which parameters were used anywhere by reducing a usage map with the grads.
- broadcast_buffers=True (the default): rank 0's buffers (BatchNorm statistics, any dtype) are copied to
  every rank at the start of every forward pass that follows a synced training forward, and at the first.
  Once join() was used, they come from the highest rank that still has data instead (torch's
  authoritative rank), and ranks that have joined take part in that copy.
- no_sync(): grads accumulate locally; the next synced pass reduces the sum. As in torch, "used" means used
  in that synced pass: a parameter used only in the no_sync passes and by no rank in the synced one keeps
  its local, unreduced .grad.
- join() with find_unused_parameters=True: a joined rank reports no parameter as used while it shadows the
  others' iterations. torch's sends the stale usage map of its last reduction, so its results differ there
  (docs/bindings.md, "From torch DDP").

Sharded (ZeRO-1/2, Megatron's distributed optimizer): DistributedDataParallel(model, shard=True) keeps
the parameters in the library's parameter arena (p.data become views) and reduce-scatters the grads;
ShardedOptimizer(model, torch.optim.Adam, lr=...) runs any elementwise torch optimizer over this rank's
flat shards only (its state is 1/world of the model), clips by the global norm if asked, and gathers
the parameters, which the next forward pass waits for layer by layer.
"""
import contextlib
import copy
import ctypes
import os
import socket
import threading
import warnings
import weakref

import torch

from . import _lib as L
from .core import _ENUMS, DDP, Comm, dtype_code
from .errors import DDPError, InvalidArgumentError, InvalidStateError, MismatchError, UnsupportedError

__all__ = ["DistributedDataParallel", "GradBucket", "ShardedOptimizer", "default_comm"]


class _CudaView:
    """Exposes device memory through __cuda_array_interface__ so torch.as_tensor can view it."""

    def __init__(self, ptr, numel, typestr):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (ptr, False),
                                         "version": 2, "strides": None}


# __cuda_array_interface__ has no bfloat16: such memory is viewed as int16 and reinterpreted.
_TYPESTR = {torch.float16: ("<f2", None), torch.bfloat16: ("<i2", torch.bfloat16),
            torch.float32: ("<f4", None), torch.float64: ("<f8", None)}


def _view(ptr, like):
    """A tensor shaped like `like` (a parameter or tensor) over the library's memory at `ptr`."""
    return _flat(ptr, like.numel(), like.dtype, like.device).view(like.shape)


_RAW_WIDTHS = ((8, torch.float64), (4, torch.float32), (2, torch.float16))


def _raw(t):
    """(pointer, count, dtype) covering the bytes of contiguous `t` (an even number of them), for a
    broadcast: a broadcast copies bytes, so any tensor travels as the widest float type that tiles it."""
    nbytes = t.numel() * t.element_size()
    for width, dt in _RAW_WIDTHS:
        if nbytes % width == 0:
            return (t.data_ptr(), nbytes // width, dt)
    raise ValueError("odd byte count")


# Where a launcher says how many processes it started: torchrun, Open MPI, MPICH / Intel MPI.
_LAUNCHER_WORLD = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_HOW_TO_LAUNCH = ("start every process with torchrun (python -m torch.distributed.run --nproc_per_node N "
                  "train.py) or mpirun -np N, and call torch.distributed.init_process_group() before wrapping "
                  "the model, or pass comm=libddp.Comm.gloo() (env://) / Comm.mpi()")


def _launched_world():
    """(size, where it was read) of the job this process belongs to, as far as anyone knows: torch.distributed's
    world when it is initialized, else the launcher's environment; (1, None) for a lone process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "torch.distributed"
    for var in _LAUNCHER_WORLD:
        try:
            n = int(os.environ.get(var, "1"))
        except ValueError:
            continue
        if n > 1:
            return n, var
    return 1, None


def _store_address():
    """The host the other ranks reach rank 0 at: MASTER_ADDR, else the default store's host, else this
    host's name."""
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    try:
        host = torch.distributed.distributed_c10d._get_default_store().host
        if host:
            return host
    except Exception:
        pass
    return socket.getfqdn()


def _free_port(host):
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


def _torch_gloo(dist, group=None):
    """A Gloo comm over torch.distributed's world (or `group`'s members): the group's first rank picks a
    free port of its own, the address travels over torch.distributed, the ranks meet there (tcp://)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return Comm.self()
    box = [None]
    if me == 0:
        host = _store_address()
        box[0] = "tcp://%s:%d" % (host, _free_port(host))
    dist.broadcast_object_list(box, src=_group_root(dist, group), group=group)
    return Comm.gloo(box[0], me, size)


def _group_root(dist, group):
    """The global rank of `group`'s rank 0."""
    if group is None:
        return 0
    return dist.distributed_c10d._get_global_rank(group, 0)


def default_comm(device, process_group=None):
    """The communicator for parameters on `device`, over the job this process was launched in:
    - torch.distributed initialized (torchrun, any launcher): its world. CPU memory: a Gloo comm of
      libddp's own whose address travels over torch.distributed; CUDA memory: NCCL, rank 0's id
      broadcast over torch.distributed.
    - else RANK/WORLD_SIZE/MASTER_ADDR set (torchrun without init_process_group): Gloo (CPU) or NCCL
      with its id sent over Gloo (CUDA), env://.
    - else MPI (CPU) or NCCL with its id sent over MPI (CUDA); one lone process in a build without MPI
      gets Comm.self().
    - process_group (a torch.distributed group): a comm of that group's members, as above.
    Never a world of one in a job of more (see DistributedDataParallel)."""
    dist = torch.distributed
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    if process_group is not None and not (dist.is_available() and dist.is_initialized()):
        raise InvalidStateError("libddp.torch: process_group given but torch.distributed is not initialized")
    if dist.is_available() and dist.is_initialized():
        if not cuda:
            return _torch_gloo(dist, process_group)
        g = process_group
        box = [bytes(Comm.nccl_unique_id()) if dist.get_rank(g) == 0 else None]
        dist.broadcast_object_list(box, src=_group_root(dist, g), group=g)
        return Comm.nccl(box[0], dist.get_world_size(g), dist.get_rank(g), index)
    if all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return Comm.nccl_store("env://", device=index) if cuda else Comm.gloo("env://")
    if cuda:
        return Comm.nccl_mpi(index)
    try:
        return Comm.mpi()
    except UnsupportedError:
        if _launched_world()[0] > 1:
            raise
        return Comm.self()


def _check_world(comm, process_group=None):
    """Raises when `comm` leaves this process alone (or in a smaller world) in a job of more processes:
    training alone silently is the one failure a DDP wrapper must never have. With a process group, the
    comm must have the group's size."""
    if process_group is not None:
        n, where = torch.distributed.get_world_size(process_group), "process_group"
    else:
        n, where = _launched_world()
    size = comm.size
    if n > 1 and size != n:
        raise InvalidStateError(
            "libddp.torch: this process is rank %d of %d in libddp's communicator, but %s says the job has %d "
            "processes: the model would %s. To train together, %s."
            % (comm.rank, size, where, n, "train alone" if size == 1 else "train in a different world",
               _HOW_TO_LAUNCH))


# torch's positional arguments after device_ids, in its order.
_TORCH_POSITIONAL = ("output_device", "dim", "broadcast_buffers", "process_group", "bucket_cap_mb",
                     "find_unused_parameters", "check_reduction", "gradient_as_bucket_view", "static_graph")


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its parameters' grads are reduced across the ranks of `comm` in every backward pass.
    torch.nn.parallel.DistributedDataParallel's arguments mean what they mean there (docs/bindings.md,
    "From torch DDP", says row by row what is the same and what differs):
    device_ids, output_device: None for a CPU module; one device for a CUDA module (inputs are moved there).
    dim: accepted (a single-device module scatters nothing). broadcast_buffers: rank 0's buffers copied to
    every rank before each training forward (after join(): the highest rank's that still has data).
    process_group: a torch.distributed group (a subgroup included): the ranks reduce over a libddp comm of
    that group's members. bucket_cap_mb: the bucket size
    (message_size in elements of the parameters' type). find_unused_parameters, static_graph: as torch's.
    check_reduction: deprecated in torch, ignored. gradient_as_bucket_view=True: layout="arena".
    libddp's own keywords:
    comm: a libddp.Comm (default: default_comm(device of the parameters): torch.distributed's world when it
    is initialized (Gloo for CPU parameters, NCCL for CUDA ones), else torchrun's environment, else MPI).
    A comm whose world differs from the job's (torch.distributed's, or WORLD_SIZE, OMPI_COMM_WORLD_SIZE,
    PMI_SIZE; process_group's size when one is given) raises libddp.InvalidStateError: a process never
    trains alone silently.
    layout: "copy" (grads stay torch's own tensors) or "arena" (p.grad become views into the library's
    bucket buffers: zero copies; apex retain_allreduce_buffers / torch gradient_as_bucket_view).
    broadcast_parameters: copy rank 0's parameters (frozen ones too) and buffers to every rank at
    construction (torch always does).
    Other keywords are libddp config fields (message_size, delay_allreduce, gradient_average,
    gradient_predivide_factor, allreduce_always_fp32, num_streams, timeout_ms, plan_order, ...).
    """

    def __init__(self, module, comm=None, *torch_args, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False, layout=None,
                 broadcast_parameters=True, allreduce_trigger_params=None, **config):
        super().__init__()
        if comm is not None and not isinstance(comm, Comm):  # torch's second positional argument
            if isinstance(comm, (list, tuple, int, torch.device)):
                device_ids, comm = comm, None
            elif _is_process_group(comm):
                process_group, comm = comm, None
            else:
                raise TypeError("libddp.torch: comm must be a libddp.Comm, not %s" % type(comm).__name__)
        if torch_args:  # torch's later positional arguments: output_device, dim, broadcast_buffers, ...
            if len(torch_args) > len(_TORCH_POSITIONAL):
                raise TypeError("libddp.torch: DistributedDataParallel takes at most %d positional arguments "
                                "(%d given)" % (2 + len(_TORCH_POSITIONAL), 2 + len(torch_args)))
            given = dict(zip(_TORCH_POSITIONAL, torch_args))
            output_device = given.get("output_device", output_device)
            dim = given.get("dim", dim)
            broadcast_buffers = given.get("broadcast_buffers", broadcast_buffers)
            process_group = given.get("process_group", process_group)
            bucket_cap_mb = given.get("bucket_cap_mb", bucket_cap_mb)
            find_unused_parameters = given.get("find_unused_parameters", find_unused_parameters)
            check_reduction = given.get("check_reduction", check_reduction)
            gradient_as_bucket_view = given.get("gradient_as_bucket_view", gradient_as_bucket_view)
            static_graph = given.get("static_graph", static_graph)
        if process_group is not None and not _is_process_group(process_group):
            raise TypeError("libddp.torch: process_group must be a torch.distributed ProcessGroup, not %s"
                            % type(process_group).__name__)
        if check_reduction:
            warnings.warn("The `check_reduction` argument of DistributedDataParallel is deprecated in torch and "
                          "ignored: a backward pass that leaves parameters without a grad is reported anyway")
        if gradient_as_bucket_view:
            layout = "arena" if layout in (None, "copy") else layout
        opts = dict(device_ids=device_ids, output_device=output_device, dim=dim, broadcast_buffers=broadcast_buffers,
                    bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                    static_graph=static_graph, layout=layout or "copy", triggers=allreduce_trigger_params,
                    config=dict(config))
        self._setup(module, comm, process_group, opts, broadcast_parameters)

    def _setup(self, module, comm, process_group, opts, broadcast):
        self._options = opts
        self._hooks = []
        self.module = module
        self.dim = opts["dim"]
        self.parameters_to_ignore = list(getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ())
        self._ignore = set(self.parameters_to_ignore)
        self._params = self._trainable(module, self._ignore)
        kinds = sorted(set(p.device.type for p in self._params))
        if len(kinds) > 1:
            raise ValueError("libddp.torch: the module's parameters must all be on one type of device; they are "
                             "on %s" % ", ".join(kinds))
        self._cuda = self._params[0].is_cuda
        self.device = self._params[0].device
        self._check_devices(opts["device_ids"], opts["output_device"])
        self._refuse_sparse(module)
        config = dict(opts["config"])
        if opts["bucket_cap_mb"] is not None and "message_size" not in config:
            config["message_size"] = max(1, int(opts["bucket_cap_mb"] * 1024 * 1024) // self._params[0].element_size())
        # torch's attribute: the group given, else the default group (the wrapper's comm spans its ranks).
        self.process_group = process_group if process_group is not None else _default_group()
        self._own_comm = comm is None  # made here: closed with this wrapper
        self.comm = comm if comm is not None else default_comm(self.device, process_group)
        try:
            _check_world(self.comm, process_group)
        except Exception:
            if self._own_comm:
                self.comm.close()
            raise
        self.sharded = bool(config.get("shard", False))
        layout = opts["layout"]
        self.static_graph = bool(opts["static_graph"])
        self.find_unused_parameters = bool(opts["find_unused_parameters"])
        if self.sharded:
            layout = "arena" if layout == "copy" else layout  # a shard is a range of the arena
            if self.find_unused_parameters or self.static_graph:
                raise ValueError("libddp.torch: find_unused_parameters and static_graph are not available with "
                                 "shard=True (the usage map would be reduced into one rank's shard); use "
                                 "unused_policy='zero'")
        self._layout = layout
        self.arena = layout in ("arena", L.DDP_LAYOUT_ARENA)
        self.gradient_as_bucket_view = self.arena
        config.setdefault("plan_order", "registration" if self.arena else "learned")
        uneven = config.get("uneven_inputs", "off")
        self._uneven = _ENUMS["uneven_inputs"].get(uneven, uneven)
        self.broadcast_buffers = bool(opts["broadcast_buffers"])
        self._config = config
        self._triggers = opts["triggers"]
        self.require_backward_grad_sync = True
        self._buffers_due = True  # torch syncs buffers before the first forward too
        self._next_sync = True  # require_backward_grad_sync at the last training forward: the next backward's
        self._early_exit_check = False  # inside join(throw_on_early_termination=True)
        self._join_enabled = False  # join() was used: buffers come from the highest rank with data, as torch's
        self._join_side = None  # the context of the buffers' broadcasts inside join() (made at the first)
        self._join_buffers = None  # that context while inside a join() block that broadcasts buffers
        self.num_iterations = 0  # torch's: training forward passes with sync on
        self._comm_hook = None  # (state, hook) of register_comm_hook
        self._buffer_hook = None  # (state, hook, location) of _register_buffer_comm_hook
        self._buffer_futures = []
        self._static_counts = None  # static_graph: how many times each grad hook fires per iteration
        self._in_backward = False
        self._make_context(broadcast)

    @property
    def find_unused(self):
        """Whether the usage map is reduced with the grads: find_unused_parameters, or static_graph (which
        finds the unused parameters by itself, as torch's does)."""
        return self.find_unused_parameters or self.static_graph

    def _make_context(self, broadcast):
        """A new libddp context for the model: created, checked across ranks and (at construction) the
        model broadcast, the comm hook set, the grads registered (collective), the grad hooks installed."""
        self.ddp = DDP(self.comm, layout=self._layout, **self._config)
        self._sync = True  # the library's setting (ddp_set_sync), applied when a backward pass begins
        if broadcast is not None:
            synced = self._synced_tensors()
            self._verify_same_model(synced)
            if broadcast:
                self._broadcast_tensors([t for _, t in synced], 0)
        if self._comm_hook is not None:
            ref = weakref.ref(self)

            def run(bucket):
                model = ref()
                if model is not None:
                    model._run_comm_hook(bucket)
            self.ddp.set_comm_hook(run)
        self._register(self._triggers)
        self._install_hooks()
        self._gathering = False
        if self.sharded:
            self._bind_params()

    def _rebuild(self):
        """A fresh context with the current settings (comm hook, static graph, uneven inputs), the grads as
        they are. Collective: every rank calls it at the same point."""
        if self._in_backward:
            raise RuntimeError("libddp.torch: not between a forward pass and its backward pass")
        self._teardown()
        self._make_context(None)

    @staticmethod
    def _trainable(module, ignore=()):
        named = dict((id(p), n) for n, p in module.named_parameters())
        seen, params = set(), []
        for p in module.parameters():  # tied weights appear once
            if p.requires_grad and id(p) not in seen and named.get(id(p)) not in ignore:
                seen.add(id(p))
                params.append(p)
        if not params:
            raise InvalidArgumentError("libddp.torch: DistributedDataParallel is not needed when a module doesn't "
                                       "have any parameter that requires a gradient")
        if any(p.is_cuda != params[0].is_cuda for p in params):
            raise ValueError("libddp.torch: parameters must all be on CPU or all on CUDA")
        for p in params:
            dtype_code(p.dtype)  # raises for unsupported dtypes
        return params

    def _check_devices(self, device_ids, output_device):
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("libddp.torch: device_ids can only be None or contain a single element")
        if not self._cuda and (device_ids or output_device):  # as torch: a falsy output_device (0) passes
            raise ValueError("libddp.torch: device_ids and output_device only work with a single-device GPU module; "
                             "this module's parameters are on %s (got device_ids %s, output_device %s)"
                             % (self.device, device_ids, output_device))
        self.device_ids = [torch.device("cuda", torch.cuda._utils._get_device_index(device_ids[0], True))] \
            if self._cuda and device_ids else None
        self.output_device = output_device

    def _refuse_sparse(self, module):
        trainable = set(id(p) for p in self._params)
        for name, m in module.named_modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and id(m.weight) in trainable:
                raise UnsupportedError(
                    "libddp.torch: %s (%s(sparse=True)) produces sparse gradients, which libddp does not reduce: "
                    "make it with sparse=False, or leave its weight out with DistributedDataParallel."
                    "_set_params_and_buffers_to_ignore_for_model(module, [%r])"
                    % (name or "the module", type(m).__name__, (name + "." if name else "") + "weight"))

    def _named_buffers(self):
        return [(n, b) for n, b in self.module.named_buffers() if n not in self._ignore]

    def _synced_tensors(self):
        """(name, tensor) of what construction broadcasts from rank 0: every parameter (frozen ones too)
        and buffer not ignored, as torch's state sync."""
        seen, out = set(), []
        for n, p in self.module.named_parameters():
            if n not in self._ignore and id(p) not in seen:
                seen.add(id(p))
                out.append((n, p))
        return out + self._named_buffers()

    def _verify_same_model(self, named):
        """Every rank must hold the same model: the count, shapes, dtypes and requires_grad of what is
        reduced and broadcast are compared across ranks (four small allreduces) before anything of the
        model travels. A difference raises MismatchError on every rank."""
        import zlib
        import numpy as np

        n = len(named)
        nd = max([t.dim() for _, t in named] + [0])
        head = np.array([n, nd], np.int64)
        hi = self.ddp.allreduce_host(head.copy(), "max")
        lo = self.ddp.allreduce_host(head.copy(), "min")
        if hi[0] != lo[0]:
            raise MismatchError(
                "libddp.torch: DistributedDataParallel expects the same model on every rank, but rank %d has %d "
                "parameters and buffers while another rank has %d" % (self.comm.rank, n, lo[0] if hi[0] == n else hi[0]))
        nd = int(hi[1])
        rows = np.full((n, nd + 3), -1, np.int64)
        for k, (_, t) in enumerate(named):
            rows[k, 0] = zlib.crc32(str(t.dtype).encode())
            rows[k, 1] = t.dim() * 2 + int(t.requires_grad)
            rows[k, 2:2 + t.dim()] = list(t.shape)
        hi = self.ddp.allreduce_host(rows.reshape(-1).copy(), "max").reshape(rows.shape)
        lo = self.ddp.allreduce_host(rows.reshape(-1).copy(), "min").reshape(rows.shape)
        bad = np.nonzero((hi != lo).any(axis=1))[0]
        if bad.size:
            name, t = named[int(bad[0])]
            raise MismatchError(
                "libddp.torch: DistributedDataParallel expects the same model on every rank, but %s (shape %s, %s%s) "
                "on rank %d does not match the same parameter or buffer on every other rank"
                % (name, list(t.shape), t.dtype, ", requires_grad" if t.requires_grad else "", self.comm.rank))

    def _register(self, triggers):
        dev = self._params[0].device
        # find_unused_parameters: grad 0 is the usage map (1.0 where this rank used a parameter), reduced
        # with the grads. Registered first, it is last in reverse registration order: marked ready at the
        # end of backward, it holds back only the last bucket.
        self._base = 1 if self.find_unused else 0
        self._used = torch.zeros(len(self._params), dtype=torch.float32, device=dev) if self.find_unused else None
        # Copy layout: registration needs a pointer; one scratch buffer stands in for grads that do not
        # exist yet. Every grad's real storage is given to the library before it is reduced.
        big = max(p.numel() * p.element_size() for p in self._params)
        self._scratch = torch.empty(big, dtype=torch.uint8, device=dev)
        triggers = set(id(p) for p in (triggers or ()))
        if self.find_unused:
            self.ddp.register(None if self.arena else self._used, numel=len(self._params), dtype=torch.float32,
                              device=self._cuda)
        for p in self._params:
            g = p.grad
            stand_in = False
            if self.arena:
                buf = None
            elif g is not None and g.is_contiguous():
                buf = (g.data_ptr(), p.numel(), p.dtype)
            else:
                buf, stand_in = (self._scratch.data_ptr(), p.numel(), p.dtype), True
            self.ddp.register(buf, numel=p.numel(), dtype=p.dtype, trigger=id(p) in triggers, device=self._cuda,
                              stand_in=stand_in)
        try:
            self.ddp.commit()
        except DDPError as e:  # ranks that registered different parameters
            raise _with_param_names(e, self) from None
        self._h = self.ddp._h
        self._views = [None] * len(self._params)
        self._epoch = None
        self._hook_segments = None
        if self.arena:
            self._bind_views()

    def _install_hooks(self):
        self._in_backward = False
        self._queued = False
        self._any_grad = False
        self._marked = [False] * len(self._params)
        self._fired = [0] * len(self._params)
        self._accs = []
        self._lock = threading.Lock()  # CUDA autograd runs hooks on device threads
        ref = weakref.ref(self)  # the hooks must not keep a dropped wrapper alive
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(acc.register_hook(_grad_hook(ref, i)))
                self._accs.append(acc)  # keep the accumulators alive, as apex does

    # -- internals ------------------------------------------------------------------------------
    def _stream(self):
        return torch.cuda.current_stream().cuda_stream if self._cuda else None

    def _broadcast_tensors(self, tensors, root, ddp=None):
        """Copies `root`'s tensors (any dtype, any layout) to every rank, over `ddp` (default: the wrapper's
        context). Collective."""
        raws, back = [], []
        with torch.no_grad():
            for b in tensors:
                nbytes = b.numel() * b.element_size()
                if nbytes == 0:
                    continue
                t = b.data if b.is_contiguous() else b.data.contiguous()
                if nbytes % 2:
                    t = torch.cat([t.reshape(-1).view(torch.uint8), t.new_zeros(1, dtype=torch.uint8)])
                if t.data_ptr() != b.data_ptr():
                    back.append((b, t, nbytes))
                raws.append(_raw(t))
            if raws:
                (ddp or self.ddp).broadcast(raws, root=root, stream=self._stream())
            for b, t, nbytes in back:
                flat = t.reshape(-1).view(torch.uint8)[:nbytes]
                b.data.copy_(flat.view(b.dtype).view(b.shape))

    def _sync_buffers(self, root=0, ddp=None):
        """Copies `root`'s buffers (any dtype) to every rank. Collective."""
        self._broadcast_tensors([b for _, b in self._named_buffers()], root, ddp)

    def _sync_buffers_before_forward(self):
        """torch's source of the buffers before a forward pass: rank 0, or once join() was used, the highest
        rank that still has data (its _find_common_rank): inside a join() block, found by one small
        allreduce over the buffers' own context, in which ranks that have joined send -1 (see
        _join_shadowing); outside one every rank has data, so the highest rank. A buffer comm hook set
        to run before the forward runs instead of the broadcast (on the joined ranks too, as in torch)."""
        side = self._join_buffers
        if side is not None:
            root = self._common_rank(side, True)
        else:
            root = self.comm.size - 1 if self._join_enabled else 0
        if self._buffer_hook is None:
            self._sync_buffers(root, side)
        else:
            self._run_buffer_hook()

    def _common_rank(self, ddp, candidate):
        """torch's _find_common_rank: the highest rank that is a candidate, -1 if none is. Collective."""
        import numpy as np

        return int(ddp.allreduce_host(np.array([self.comm.rank if candidate else -1], np.int64), "max")[0])

    def _bind_views(self):
        """Arena: make every existing p.grad the library's view (moving current values in). A .grad
        that is None stays None until its parameter takes part in a backward pass, as in torch."""
        self._epoch = self.ddp.stats.layout_epoch
        with torch.no_grad():
            if self.find_unused:
                self._used = _view(self.ddp.grad_ptr(0), self._used)
            for i, p in enumerate(self._params):
                old = self._views[i]
                v = _view(self.ddp.grad_ptr(self._base + i), p)
                self._views[i] = v
                g = p.grad
                if old is not None and g is not None and g.data_ptr() == old.data_ptr():
                    pass  # the storage moved with its values; the old view is dangling now
                elif g is None:
                    v.zero_()
                    continue
                elif g.data_ptr() != v.data_ptr():
                    v.copy_(g)
                p.grad = v
                del old, g

    def _bind_params(self):
        """Sharded: every parameter's data becomes its view in the parameter arena (values moved in), and
        each module waits, before its forward, for the gather of its own parameters."""
        index = {}
        with torch.no_grad():
            for i, p in enumerate(self._params):
                v = _view(self.ddp.param_ptr(self._base + i), p)
                v.copy_(p.data)
                p.data = v
                index[id(p)] = self._base + i
        for m in self.module.modules():
            mine = sorted(set(index[id(p)] for p in m.parameters(recurse=False) if id(p) in index))
            if mine:
                self._hooks.append(m.register_forward_pre_hook(self._make_waiter(mine)))

    def _make_waiter(self, indices):
        ref = weakref.ref(self)

        def wait(*_):
            model = ref()
            if model is not None and model._gathering:
                for i in indices:
                    model.ddp.wait_params(i, model._stream())
        return wait

    def _adopt_grad(self, i):
        """Arena: p.grad must be the view before it is reduced (torch may have replaced or dropped it)."""
        p, v = self._params[i], self._views[i]
        g = p.grad
        if g is None:
            v.zero_()
        elif g.data_ptr() != v.data_ptr():
            with torch.no_grad():
                v.copy_(g)
        p.grad = v

    def _begin(self):
        if self.arena:
            # Whether each .grad existed before the pass: a parameter no rank uses gets its None back.
            # A None .grad stays None here; the hook adopts the view if the parameter takes part.
            self._had_grad = [p.grad is not None for p in self._params]
            for i, had in enumerate(self._had_grad):
                if had:
                    self._adopt_grad(i)
        if self._comm_hook is not None:
            self._hook_segments = self._bucket_segments()
        if self._sync != self._next_sync:  # decided at the forward pass, as torch decides
            self.ddp.set_sync(self._next_sync)
            self._sync = self._next_sync
        self.ddp.begin_backward(self._stream())
        self._in_backward = True
        self._join_scratch = None  # every grad gets real storage again before the library writes it
        self._queued = False
        self._any_grad = False
        self._marked = [False] * len(self._params)
        self._fired = [0] * len(self._params)

    def _enter_backward(self):
        """Under the lock: the iteration has begun, and the finish is queued on the autograd engine. Called
        first from the hook on the forward's outputs, so the finish goes to the outermost backward (not to
        a nested one that reentrant checkpointing runs), else from the first grad hook."""
        if not self._in_backward:
            self._begin()
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _on_grad(self, i):
        with self._lock:
            self._enter_backward()
            self._any_grad = True
            self._fired[i] += 1
            if self.static_graph and (self._static_counts is None or self._fired[i] < self._static_counts[i]):
                return  # static_graph: ready after the hook's last run of the iteration (learned in the first)
        self._mark(i)

    def _mark(self, i):
        """Grad i is final: handed to the library. A grad torch left undefined (None) counts as unused with
        find_unused_parameters; without it, it is reduced as zeros, as torch does."""
        p = self._params[i]
        if p.grad is None and self.find_unused:
            return  # _mark_unused hands it over at the end: used nowhere, it stays None
        try:
            if self.arena:
                self._adopt_grad(i)
                L.lib.ddp_grad_ready(self._h, self._base + i)
            else:
                g = p.grad
                if g is None:
                    g = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                elif not g.is_contiguous():
                    g = p.grad = g.contiguous()
                L.lib.ddp_grad_ready_ptr(self._h, self._base + i, g.data_ptr())
        except DDPError as e:
            raise _with_param_names(e, self) from None
        self._marked[i] = True

    def _mark_unused(self):
        """find_unused_parameters: hands the library every unused grad (its current value, or zeros) and
        the usage map. Returns, per unused parameter, what restores it if no rank used it."""
        saved = {}
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if self._marked[i]:
                    continue
                if self.arena:
                    had = self._had_grad[i] and p.grad is not None
                    saved[i] = (had, p.grad.detach().clone() if had else None)
                    self._adopt_grad(i)
                    L.lib.ddp_grad_ready(self._h, self._base + i)
                else:
                    had = p.grad is not None
                    tmp = p.grad.detach().clone(memory_format=torch.contiguous_format) if had else torch.zeros_like(p)
                    saved[i] = (had, tmp)
                    L.lib.ddp_grad_ready_ptr(self._h, self._base + i, tmp.data_ptr())
            self._used.copy_(torch.tensor(self._marked, dtype=torch.float32))
        if self.arena:
            L.lib.ddp_grad_ready(self._h, 0)
        else:
            L.lib.ddp_grad_ready_ptr(self._h, 0, self._used.data_ptr())
        return saved

    def _settle_unused(self, saved):
        """After the reduction: used somewhere -> the reduced value; used nowhere -> .grad as it was."""
        if not saved:
            return
        used = (self._used > 0).tolist()
        with torch.no_grad():
            for i, (had, value) in saved.items():
                p = self._params[i]
                if used[i]:
                    if not self.arena:
                        if had:
                            p.grad.copy_(value)
                        else:
                            p.grad = value
                elif self.arena:
                    if had:
                        self._views[i].copy_(value)
                    else:
                        p.grad = None  # the next backward adopts the view again, zeroed
                # copy layout, used nowhere: the library reduced a copy; .grad is untouched

    def _give_storage_to_unused(self):
        """Without find_unused_parameters: grads that never became ready are reduced as zeros and then
        reported by the library; they still need real storage."""
        for i, p in enumerate(self._params):
            if self._marked[i]:
                continue
            if self.arena:
                self._adopt_grad(i)
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                L.lib.ddp_set_grad_ptr(self._h, self._base + i, p.grad.data_ptr())

    def _finish(self):
        if not self._any_grad:
            self._queued = False  # no grad of the model in this backward pass (torch.autograd.grad): later
            return
        changed = []
        if self.static_graph:
            for i, n in enumerate(self._fired):  # delayed in the first iteration (or fired fewer times)
                if n and not self._marked[i]:
                    self._mark(i)
            if self._sync and self._static_counts is None:
                self._static_counts = list(self._fired)
            elif self._sync:  # as torch: the set of parameters used must stay that of the first iteration
                changed = [i for i, n in enumerate(self._fired) if (n == 0) != (self._static_counts[i] == 0)]
        saved = {}
        if not self._sync:
            pass  # no_sync: the library only records marks; nothing is reduced
        elif self.find_unused:
            saved = self._mark_unused()
        else:
            self._give_storage_to_unused()
        self._in_backward = False
        try:
            self.ddp.finish_backward(self._stream())
        except DDPError as e:
            raised = getattr(self.ddp, "hook_error", None)
            if raised is not None:
                raise RuntimeError("libddp.torch: the communication hook raised %r; the context is aborted"
                                   % (raised,)) from raised
            raise _with_param_names(e, self) from None
        if self.arena and self.ddp.stats.layout_epoch != self._epoch:
            self._bind_views()
        self._settle_unused(saved)
        self._wait_buffer_futures()
        if changed:  # the iteration is complete on every rank (its values those of find_unused_parameters)
            names = _param_names(self)
            listed = ", ".join(names[self._base + i] for i in changed[:6])
            if len(changed) > 6:
                listed += " and %d more" % (len(changed) - 6)
            raise RuntimeError("libddp.torch: static_graph=True, but the training graph changed in this iteration: "
                               "%s %s used in the first iteration and not now, or the reverse (torch raises too); "
                               "use find_unused_parameters=True for a graph that changes"
                               % (listed, "was" if len(changed) == 1 else "were"))

    # -- comm hooks -----------------------------------------------------------------------------
    def register_comm_hook(self, state, hook):
        """torch's contract: hook(state, bucket: GradBucket) -> torch.futures.Future[Tensor] whose value is
        the bucket's reduced gradient (no averaging after it: torch's allreduce_hook divides by the world
        size itself). Runs for every bucket of every synced iteration, on the library's bucket thread.
        torch's default hooks (allreduce_hook, fp16_compress_hook, bf16_compress_hook) with state None run
        over this wrapper's comm; with a process group as state, and any other hook, as written (they may
        use torch.distributed). Once, before the first backward pass, on every rank. Collective."""
        if not callable(hook):
            raise TypeError("libddp.torch: the communication hook must be callable")
        if self._comm_hook is not None:
            raise RuntimeError("libddp.torch: register_comm_hook or _register_builtin_comm_hook can only be called "
                               "once")
        if self.ddp.stats.iterations or self._in_backward:
            raise RuntimeError("libddp.torch: register the communication hook before the first backward pass")
        if self.sharded:
            raise UnsupportedError("libddp.torch: register_comm_hook is not available with shard=True (the library "
                                   "reduce-scatters sharded buckets itself)")
        self._comm_hook = (state, hook)
        try:
            self._rebuild()
        except Exception:
            self._comm_hook = None
            raise

    def _register_builtin_comm_hook(self, comm_hook_type):
        """dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS: torch's default hooks, over this comm."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hooks = {"ALLREDUCE": default_hooks.allreduce_hook, "FP16_COMPRESS": default_hooks.fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type).rsplit(".", 1)[-1])
        if name not in hooks:
            raise ValueError("libddp.torch: unknown builtin comm hook %r" % (comm_hook_type,))
        self.register_comm_hook(None, hooks[name])

    def _bucket_segments(self):
        """Per bucket of the plan: [(library grad index, offset, numel)] as the hook's buffer packs them."""
        out = []
        for b in self.ddp.plan.buckets:
            off, segs = 0, []
            for g in b.grads:
                n = self.ddp._grads[g][0]
                segs.append((g, off, n))
                off += n
            out.append(segs)
        return out

    def _run_comm_hook(self, b):
        """The library's hook call for one bucket (on its bucket thread)."""
        dtype = _TORCH_DTYPES[b.dtype]
        flat = _flat(b.buffer, b.count, dtype, self.device)
        segs = self._hook_segments[b.bucket]
        usage = [s for s in segs if self.find_unused and s[0] == 0]
        grads = [s for s in segs if not (self.find_unused and s[0] == 0)]
        for _, off, n in usage:  # the usage map is summed, whatever the hook does with the grads
            L.lib.ddp_comm_allreduce(b.comm, flat[off:off + n].data_ptr(), n, b.dtype, L.DDP_OP_SUM, b.stream)
        if not grads:
            return
        lo, hi = grads[0][1], grads[-1][1] + grads[-1][2]
        if sum(n for _, _, n in grads) == hi - lo:
            buf, offs = flat[lo:hi], [(g, off - lo, n) for g, off, n in grads]
        else:
            buf = torch.cat([flat[off:off + n] for _, off, n in grads])
            offs, at = [], 0
            for g, _, n in grads:
                offs.append((g, at, n))
                at += n
        state, hook = self._comm_hook
        native = _NATIVE_HOOKS.get(hook) if state is None else None
        if native is not None:
            native(b, buf)
        else:
            params = [self._params[g - self._base] for g, _, _ in offs]
            views = [buf[off:off + n].view(p.shape) for (_, off, n), p in zip(offs, params)]
            bucket = GradBucket(b.bucket, buf, views, params, b.bucket == len(self._hook_segments) - 1)
            fut = hook(state, bucket)
            value = fut.wait() if hasattr(fut, "wait") else fut
            if isinstance(value, (list, tuple)):
                value = value[0]
            result = bucket.buffer()
            if value.data_ptr() != result.data_ptr():
                result.copy_(value.reshape(-1))
            if result.data_ptr() != buf.data_ptr():
                buf.copy_(result)
        if buf.data_ptr() != flat[lo:].data_ptr() or buf.numel() != hi - lo:
            for (_, off, n), (_, src, _) in zip(grads, offs):
                flat[off:off + n].copy_(buf[src:src + n])

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=None):
        """torch's: hook(state, {name: buffer}) -> None or a list of futures (awaited at the end of the
        backward pass) runs instead of the buffers' broadcast, before the forward pass
        (_BufferCommHookLocation.PRE_FORWARD) or after it (POST_FORWARD, the default)."""
        if not callable(hook):
            raise TypeError("libddp.torch: the buffer communication hook must be callable")
        post = comm_hook_location is None or getattr(comm_hook_location, "name", str(comm_hook_location)).endswith(
            "POST_FORWARD")
        self._buffer_hook = (state, hook, post)

    def _run_buffer_hook(self):
        state, hook, _ = self._buffer_hook
        futs = hook(state, dict(self._named_buffers()))
        if futs:
            self._buffer_futures.extend(futs)

    def _wait_buffer_futures(self):
        futs, self._buffer_futures = self._buffer_futures, []
        for f in futs:
            f.wait()

    # -- static graph, ignored parameters, pickling ---------------------------------------------
    def _set_static_graph(self):
        """torch's: the graph is the same in every iteration. The first iteration learns how many times each
        grad hook runs (a parameter used twice, as under reentrant checkpointing, is ready after its last
        run) and which parameters are unused; call it before the first training forward pass with sync on
        (after it, RuntimeError with torch's message). Collective."""
        if self.static_graph:
            warnings.warn("libddp.torch: static_graph is set already")
            return
        if self.num_iterations or self.ddp.stats.iterations or self._in_backward:
            raise RuntimeError("set_static_graph() should be called before training loop starts and after "
                               "DistributedDataParallel is constructed.")
        if self.sharded:
            raise ValueError("libddp.torch: static_graph is not available with shard=True")
        self.static_graph = True
        self._options["static_graph"] = True
        try:
            self._rebuild()  # the usage map joins the grads
        except Exception:
            self.static_graph = self._options["static_graph"] = False
            raise

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """torch's: the parameters and buffers named (fully qualified, as named_parameters() and
        named_buffers() give them) are neither reduced nor broadcast by wrappers created afterwards."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def __getstate__(self):
        """Pickling (torch.save(model), copy.deepcopy): the module and the settings; the unpickled wrapper
        makes a context of its own over default_comm (torch's uses the default group), without a
        broadcast, as torch's does; a comm hook is not kept (torch's neither)."""
        if self.sharded:
            raise TypeError("libddp.torch: a sharded wrapper (shard=True) cannot be pickled: its parameters live "
                            "in the library's arena; pickle model.module after close()")
        state = {k: v for k, v in self.__dict__.items() if k in _MODULE_KEYS}
        state["_options"] = dict(self._options, static_graph=self.static_graph)
        return state

    def __setstate__(self, state):
        self._restore(state, None)

    def __deepcopy__(self, memo):
        """A copy of the wrapped module in a new wrapper of its own; it shares this wrapper's comm when one
        was given (else it makes its own, as this one did). Collective when every rank copies."""
        state = self.__getstate__()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new._restore(copy.deepcopy(state, memo), None if self._own_comm else self.comm)
        return new

    def _restore(self, state, comm):
        state = dict(state)
        opts = state.pop("_options")
        module = state["_modules"].pop("module")
        torch.nn.Module.__setstate__(self, state)
        self._setup(module, comm, None, opts, False)

    # -- the module ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._early_exit_check and torch.is_grad_enabled():
            self._check_no_rank_finished(0)
        self._wait_buffer_futures()
        if self.device_ids:
            args, kwargs = _to_device((args, kwargs), self.device_ids[0])
        training = torch.is_grad_enabled()
        if training and self._in_backward and self._any_grad:
            raise RuntimeError("libddp.torch: the last backward pass handed grads to the library but never finished "
                               "(an exception inside it?): its iteration cannot complete, and this wrapper cannot go "
                               "on; make a new one (torch raises too: 'Expected to have finished reduction in the "
                               "prior iteration')")
        sync_buffers = self.broadcast_buffers and self._buffers_due and bool(self._named_buffers())
        if sync_buffers and (self._buffer_hook is None or not self._buffer_hook[2]):
            self._sync_buffers_before_forward()
        if training:
            # torch decides at the forward pass whether the backward that follows is reduced; the library's
            # iteration begins with that backward (a forward without one, as in a validation pass with grad
            # enabled, leaves nothing begun).
            self._next_sync = self.require_backward_grad_sync
            self.num_iterations += int(self._next_sync)
        out = self.module(*args, **kwargs)
        if self._gathering:  # parameters of modules the forward did not run
            self.ddp.wait_params(-1, self._stream())
            self._gathering = False
        if sync_buffers and self._buffer_hook is not None and self._buffer_hook[2]:
            self._run_buffer_hook()
        # torch: buffers are synced before the next forward only after a training forward with sync on.
        self._buffers_due = training and self._next_sync
        if training:
            _watch_outputs(out, weakref.ref(self))
        return out

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Uneven inputs, as torch's `with model.join(): for batch in my_batches: ...`. On leaving the block,
        a rank out of batches shadows the others' iterations (ddp_join) until every rank is done, then
        every rank takes the parameters and buffers of the rank that ran the most iterations (the highest
        such rank), as torch does. divide_by_initial_world_size=True averages over the world, joined ranks
        counting as zeros; False over the ranks that still have data. A wrapper created without the
        matching uneven_inputs= ("by_world", "by_contributors") gets a new context in that mode on entering
        the block (every rank enters it: collective); from then on each synced iteration begins with one
        small exchange. broadcast_buffers=True with a module that has buffers: as in torch, each forward
        pass that broadcasts the buffers first finds the highest rank that still has data (one small
        allreduce) and takes its buffers; the ranks that have joined take part in those broadcasts while
        they shadow the others' iterations (they run over a second libddp context, made at the first such
        block, which the joined rank serves while a thread of its own runs ddp_join). From the first join()
        on, buffers come from the highest rank outside the block too, as torch's do.
        throw_on_early_termination=True: instead, every rank raises RuntimeError at the first forward pass
        after some rank ran out (one small allreduce per forward). enable=False: the block does nothing."""
        return self._join_context(bool(divide_by_initial_world_size), bool(enable), bool(throw_on_early_termination))

    @contextlib.contextmanager
    def _join_context(self, by_world, enable, throw):
        self._join_enabled = enable  # torch keeps its join config after the block: the buffers' source
        if not enable:
            yield self
            return
        if throw:
            self._early_exit_check = True
            try:
                yield self
            finally:
                self._early_exit_check = False
            self._check_no_rank_finished(1)
            return
        want = L.DDP_UNEVEN_BY_WORLD if by_world else L.DDP_UNEVEN_BY_CONTRIBUTORS
        if self._uneven != want:
            old = self._config.get("uneven_inputs")
            self._config["uneven_inputs"] = want
            try:
                self._rebuild()
            except Exception:
                self._config["uneven_inputs"] = old
                raise
            self._uneven = want
        side = None
        if self.broadcast_buffers and self._named_buffers() and (self._buffer_hook is None or
                                                                not self._buffer_hook[2]):
            if self._join_side is None:  # collective: every rank enters the block
                self._join_side = DDP(self.comm, **{k: v for k, v in self._config.items() if k == "timeout_ms"})
            side = self._join_buffers = self._join_side
        try:
            yield self  # an exception in the block propagates: no join (the other ranks time out, as in torch)
        finally:
            self._join_buffers = None
        ran = self.ddp.stats.iterations  # this rank's synced iterations: who ran the most decides below
        self._join_shadowing(side)
        # torch's final sync: the last rank to join (the most iterations; ties: the highest rank) is the
        # authoritative model copy. Whether the next forward broadcasts buffers is that rank's say too (a
        # joined rank's own last forward may have been under no_sync).
        world = self.comm.size
        import numpy as np

        key = self.ddp.allreduce_host(np.array([(ran * world + self.comm.rank) * 2 + int(self._buffers_due)],
                                               np.int64), "max")
        root = int(key[0] // 2 % world)
        self._buffers_due = bool(key[0] % 2)
        self._broadcast_tensors(self._params, root)
        self._sync_buffers(root)

    def _join_shadowing(self, side=None):
        """ddp_join: the others' remaining iterations reduce zeros from this rank and write their result
        into its grads. Copy layout: the grads the library last saw may be gone (zero_grad(set_to_none),
        the copies of unused grads), so it gets scratch storage of its own for the shadow iterations, kept
        until the next backward pass gives it real grads again; torch leaves a joined rank's .grad alone.
        side: the others' forward passes broadcast buffers over that context (torch's joined ranks
        shadow those broadcasts too): a thread runs ddp_join while this one answers each broadcast, until
        every rank has left its block (none is a candidate for the source any more)."""
        if not self.arena:
            self._join_scratch = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self._params]
            for i, t in enumerate(self._join_scratch):
                L.lib.ddp_set_grad_ptr(self._h, self._base + i, t.data_ptr())
        if side is None:
            self.ddp.join()
            return
        failed = []

        def shadow():
            try:
                with torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext():
                    self.ddp.join()
            except BaseException as e:  # raised on the caller's thread below
                failed.append(e)
        thread = threading.Thread(target=shadow, name="libddp-join", daemon=True)
        thread.start()
        try:
            while True:
                root = self._common_rank(side, False)
                if root < 0:
                    break
                if self._buffer_hook is None:
                    self._sync_buffers(root, side)
                else:
                    self._run_buffer_hook()
        finally:
            thread.join()  # the context must outlive ddp_join (bounded by timeout_ms)
        if failed:
            raise failed[0]

    def join_hook(self, **kwargs):
        """torch's generic Join context manager (torch.distributed.algorithms.join.Join) is not supported: it
        drives a joined rank one shadow iteration at a time from Python, while libddp's join shadows every
        remaining iteration inside one library call; use `with model.join():`."""
        raise NotImplementedError("libddp.torch: join_hook() (torch.distributed.algorithms.join.Join) is not "
                                  "supported: libddp shadows a joined rank's iterations inside ddp_join, not one "
                                  "iteration at a time; use `with model.join(): ...`")

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def _check_no_rank_finished(self, finished):
        """join(throw_on_early_termination=True): one allreduce per forward; a rank out of data sends 1."""
        import numpy as np

        flag = self.ddp.allreduce_host(np.array([finished], np.int32), "sum")
        if flag[0]:
            raise RuntimeError("libddp.torch: rank %d: %s" % (self.comm.rank, "exhausted all inputs" if finished else
                               "a rank exhausted all its inputs (join(throw_on_early_termination=True))"))

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forward passes run inside only accumulate grads locally; the next synced one
        reduces the sum. As in torch, the forward pass decides: a forward inside the block whose backward
        runs after it is not reduced, and entering the block between a forward and its backward does not
        change that backward."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def gather_params(self):
        """Sharded: launches the all-gather of the parameters (after the optimizer updated the shards);
        the next forward pass waits for each module's own."""
        self.ddp.gather_params(self._stream())
        self._gathering = True

    @property
    def stats(self):
        return self.ddp.stats

    @property
    def plan(self):
        return self.ddp.plan

    def _teardown(self):
        """Removes the hooks and destroys the context (arena grads are copied out to torch's own memory)."""
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []
        if self.arena and not self.ddp.closed:
            with torch.no_grad():
                for p in self._params:
                    if p.grad is not None:
                        p.grad = p.grad.clone()
        if self.sharded and not self.ddp.closed:
            with torch.no_grad():
                for p in self._params:  # the parameter arena goes with the context
                    p.data = p.data.clone()
        self._views = [None] * len(self._params)
        self.ddp.close()

    def close(self):
        """Removes the hooks and destroys the context (arena grads are copied out to torch's own memory), and
        the communicator when it was made here (no comm given). A wrapper that is dropped does this itself."""
        if "ddp" in self.__dict__:
            self._teardown()
        side = self.__dict__.get("_join_side")
        if side is not None:
            side.close()
            self._join_side = None
        if self.__dict__.get("_own_comm") and "comm" in self.__dict__:
            self.comm.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class GradBucket:
    """What a comm hook gets, as torch.distributed.GradBucket: index(), buffer() (the bucket's grads, flat),
    gradients() (views of buffer() shaped as the parameters), parameters(), is_last(), set_buffer()."""

    def __init__(self, index, buffer, gradients, parameters, is_last):
        self._index, self._buffer, self._grads, self._params, self._last = index, buffer, gradients, parameters, is_last

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def gradients(self):
        return list(self._grads)

    def parameters(self):
        return list(self._params)

    def is_last(self):
        return self._last

    def set_buffer(self, buffer):
        self._buffer = buffer


def _grad_hook(ref, i):
    def hook(*_):
        model = ref()
        if model is not None and "ddp" in model.__dict__ and not model.ddp.closed:
            model._on_grad(i)
    return hook


def _watch_outputs(out, ref):
    """Hooks the forward's outputs that need a grad: the first grad to reach one queues the finish on the
    outermost backward pass."""
    def on_grad(_):
        model = ref()
        if model is not None and not model.ddp.closed:
            with model._lock:
                model._enter_backward()
    for t in _tensors(out):
        if t.requires_grad and t.grad_fn is not None:
            t.register_hook(on_grad)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, f))


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[_to_device(o, device) for o in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _default_group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _is_process_group(obj):
    dist = torch.distributed
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)
_TORCH_DTYPES = {L.DDP_F16: torch.float16, L.DDP_BF16: torch.bfloat16, L.DDP_F32: torch.float32,
                 L.DDP_F64: torch.float64}


def _flat(ptr, n, dtype, device):
    """A flat tensor of n `dtype` elements over the library's memory at `ptr` on `device`."""
    if device.type == "cuda":
        if dtype not in _TYPESTR:
            raise TypeError("libddp.torch: the arena layout on CUDA supports float16/bfloat16/32/64, not %s" % dtype)
        typestr, cast = _TYPESTR[dtype]
        t = torch.as_tensor(_CudaView(ptr, n, typestr), device=device)
        return t.view(cast) if cast is not None else t
    raw = (ctypes.c_byte * (n * torch.empty(0, dtype=dtype).element_size())).from_address(ptr)
    return torch.frombuffer(raw, dtype=dtype, count=n)


def _comm_allreduce(b, t):
    L.lib.ddp_comm_allreduce(b.comm, t.data_ptr(), t.numel(), dtype_code(t.dtype), L.DDP_OP_SUM, b.stream)


def _allreduce_native(b, buf):
    """torch's allreduce_hook over the bucket's comm: divided by the world size, then summed."""
    buf.div_(b.world)
    _comm_allreduce(b, buf)


def _compress_native(dtype):
    def hook(b, buf):
        """torch's fp16/bf16_compress_hook over the bucket's comm: cast, divided by the world size, summed,
        cast back."""
        c = buf.to(dtype).div_(b.world)
        _comm_allreduce(b, c)
        buf.copy_(c)
    return hook


def _native_hooks():
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d
    except Exception:
        return {}
    return {d.allreduce_hook: _allreduce_native, d.fp16_compress_hook: _compress_native(torch.float16),
            d.bf16_compress_hook: _compress_native(torch.bfloat16)}


_NATIVE_HOOKS = _native_hooks()


def _param_names(model):
    """The library's grad index -> the parameter's name in the wrapped module (as named_parameters()
    gives it: "b.weight"); with find_unused_parameters, grad 0 is the usage map."""
    by_id = {}
    for name, p in model.module.named_parameters():
        by_id.setdefault(id(p), name)
    names = {model._base + i: by_id.get(id(p), "parameter %d" % i) for i, p in enumerate(model._params)}
    if model._base:
        names[0] = "(the usage map of find_unused_parameters)"
    return names


_UNUSED_HINT = ("If a forward pass may leave some parameters out of the loss, wrap the model with "
                "DistributedDataParallel(model, find_unused_parameters=True) (as torch.nn.parallel."
                "DistributedDataParallel wants too); otherwise make every parameter take part in the loss")


def _with_param_names(err, model):
    """The library's error `err` (of a DDPError class), its grad indices turned into parameter names:
    the same class, a message for a torch user. Grads that were never marked ready name the torch fix."""
    import re

    names = _param_names(model)
    msg = err.message

    def name(i):
        return names.get(int(i), "grad %s" % i)

    def unused_list(m):  # "rank 1: grads 2, 3 and 4 more" -> "rank 1: b.weight, b.bias and 4 more"
        return "rank %s: %s%s" % (m.group(1), ", ".join(name(i) for i in m.group(2).split(", ")), m.group(3) or "")

    head, sep, body = msg.partition("grads never marked ready in this iteration (reduced as zeros): ")
    if not sep:  # any other message: each "grad N" gets its name
        text = re.sub(r"\bgrad (\d+)\b", lambda m: "grad %s (%s)" % (m.group(1), name(m.group(1))), msg)
        return type(err)("libddp.torch: " + text, err.status)
    lists = body.split(". ", 1)[0]
    named = re.sub(r"rank (\d+): grads? (\d+(?:, \d+)*)( and \d+ more)?", unused_list, lists)
    mine = [name(model._base + i) for i, done in enumerate(model._marked) if not done]
    text = "libddp.torch: parameters that got no grad in this backward pass (reduced as zeros): %s." % named
    if " more" in named and mine:
        text += " All of this rank's: %s." % ", ".join(mine)
    text += " %s. (%s%s)" % (_UNUSED_HINT, head, sep + body)
    return type(err)(text, err.status)


class ShardedOptimizer:
    """Any elementwise torch optimizer (SGD with momentum, Adam, AdamW, ...) over this rank's flat shards
    of a sharded DistributedDataParallel (shard=True): its state holds 1/world of the parameters.

        model = DistributedDataParallel(net, shard=True)
        opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, max_grad_norm=1.0)
        loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

    step() clips by the global L2 norm over every rank's shards when max_grad_norm is set (as
    torch.nn.utils.clip_grad_norm_: grads scaled by max_norm / (norm + 1e-6) when that is below 1),
    runs the optimizer on the shards, and launches the parameter gather. It returns the global norm
    (None without max_grad_norm). zero_grad() acts on the model's grads."""

    def __init__(self, model, optimizer_class, max_grad_norm=None, **kwargs):
        if not getattr(model, "sharded", False):
            raise ValueError("libddp.torch: ShardedOptimizer needs DistributedDataParallel(..., shard=True)")
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.flat = []
        for s in model.ddp.shards():
            like = torch.empty(s.shard_numel, dtype=getattr(torch, s.dtype), device=model._params[0].device)
            p = torch.nn.Parameter(_view(s.param_ptr, like), requires_grad=True)
            p.grad = _view(s.grad_ptr, like)
            self.flat.append(p)
        self.optimizer = optimizer_class(self.flat, **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def clip_grad_norm(self, max_norm):
        """Scales the shards' grads so that their global norm is at most max_norm; returns the norm."""
        norm, _ = self.model.ddp.shard_norm(self.model._stream())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for p in self.flat:
                    p.grad.mul_(coef)
        return norm

    def step(self):
        norm = self.clip_grad_norm(self.max_grad_norm) if self.max_grad_norm is not None else None
        self.optimizer.step()
        self.model.gather_params()
        return norm

    def zero_grad(self, set_to_none=True):
        for p in self.model._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                with torch.no_grad():
                    p.grad.zero_()
