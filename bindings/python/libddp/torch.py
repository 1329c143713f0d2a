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
- no_sync(): grads accumulate locally; the next synced pass reduces the sum. As in torch, "used" means used
  in that synced pass: a parameter used only in the no_sync passes and by no rank in the synced one keeps
  its local, unreduced .grad.

Sharded (ZeRO-1/2, Megatron's distributed optimizer): DistributedDataParallel(model, shard=True) keeps
the parameters in the library's parameter arena (p.data become views) and reduce-scatters the grads;
ShardedOptimizer(model, torch.optim.Adam, lr=...) runs any elementwise torch optimizer over this rank's
flat shards only (its state is 1/world of the model), clips by the global norm if asked, and gathers
the parameters, which the next forward pass waits for layer by layer.
"""
import contextlib
import ctypes
import os
import socket
import threading

import torch

from . import _lib as L
from .core import _ENUMS, DDP, Comm, dtype_code
from .errors import DDPError, InvalidArgumentError, InvalidStateError, UnsupportedError

__all__ = ["DistributedDataParallel", "ShardedOptimizer", "default_comm"]


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
    n = like.numel()
    if like.is_cuda:
        if like.dtype not in _TYPESTR:
            raise TypeError("libddp.torch: the arena layout on CUDA supports float16/bfloat16/32/64, not %s"
                            % like.dtype)
        typestr, cast = _TYPESTR[like.dtype]
        t = torch.as_tensor(_CudaView(ptr, n, typestr), device=like.device)
        if cast is not None:
            t = t.view(cast)
    else:
        raw = (ctypes.c_byte * (n * like.element_size())).from_address(ptr)
        t = torch.frombuffer(raw, dtype=like.dtype, count=n)
    return t.view(like.shape)


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


def _torch_gloo(dist):
    """A Gloo comm over torch.distributed's world: rank 0 picks a free port of its own, the address
    travels over torch.distributed, the ranks meet there (tcp://)."""
    if dist.get_world_size() == 1:
        return Comm.self()
    box = [None]
    if dist.get_rank() == 0:
        host = _store_address()
        box[0] = "tcp://%s:%d" % (host, _free_port(host))
    dist.broadcast_object_list(box, src=0)
    return Comm.gloo(box[0], dist.get_rank(), dist.get_world_size())


def default_comm(device):
    """The communicator for parameters on `device`, over the job this process was launched in:
    - torch.distributed initialized (torchrun, any launcher): its world. CPU memory: a Gloo comm of
      libddp's own whose address travels over torch.distributed; CUDA memory: NCCL, rank 0's id
      broadcast over torch.distributed.
    - else RANK/WORLD_SIZE/MASTER_ADDR set (torchrun without init_process_group): Gloo (CPU) or NCCL
      with its id sent over Gloo (CUDA), env://.
    - else MPI (CPU) or NCCL with its id sent over MPI (CUDA); one lone process in a build without MPI
      gets Comm.self().
    Never a world of one in a job of more (see DistributedDataParallel)."""
    dist = torch.distributed
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    if dist.is_available() and dist.is_initialized():
        if not cuda:
            return _torch_gloo(dist)
        box = [bytes(Comm.nccl_unique_id()) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return Comm.nccl(box[0], dist.get_world_size(), dist.get_rank(), index)
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


def _check_world(comm):
    """Raises when `comm` leaves this process alone (or in a smaller world) in a job of more processes:
    training alone silently is the one failure a DDP wrapper must never have."""
    n, where = _launched_world()
    size = comm.size
    if n > 1 and size != n:
        raise InvalidStateError(
            "libddp.torch: this process is rank %d of %d in libddp's communicator, but %s says the job has %d "
            "processes: the model would %s. To train together, %s."
            % (comm.rank, size, where, n, "train alone" if size == 1 else "train in a different world",
               _HOW_TO_LAUNCH))


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its parameters' grads are reduced across the ranks of `comm` in every backward pass.

    comm: a libddp.Comm (default: default_comm(device of the parameters): torch.distributed's world when it
    is initialized (Gloo for CPU parameters, NCCL for CUDA ones), else torchrun's environment, else MPI).
    A comm whose world differs from the job's (torch.distributed's, or WORLD_SIZE, OMPI_COMM_WORLD_SIZE,
    PMI_SIZE) raises libddp.InvalidStateError: a process never trains alone silently.
    layout: "copy" (grads stay torch's own tensors) or "arena" (p.grad become views into the library's
    bucket buffers: zero copies; apex retain_allreduce_buffers / torch gradient_as_bucket_view).
    find_unused_parameters: parameters that get no grad in a backward pass are allowed (see the module's
    docstring for what their .grad becomes); without it such a pass raises libddp.InvalidStateError.
    broadcast_parameters: copy rank 0's parameters and buffers to every rank at construction.
    broadcast_buffers: copy rank 0's buffers to every rank before each training forward (torch's default).
    Other keywords are libddp config fields (message_size, delay_allreduce, gradient_average,
    gradient_predivide_factor, allreduce_always_fp32, num_streams, timeout_ms, plan_order, ...).
    """

    def __init__(self, module, comm=None, *, layout="copy", find_unused_parameters=False,
                 broadcast_parameters=True, broadcast_buffers=True, allreduce_trigger_params=None, **config):
        super().__init__()
        self.module = module
        self._params = self._trainable(module)
        self._cuda = self._params[0].is_cuda
        self._own_comm = comm is None  # made here: closed with this wrapper
        self.comm = comm if comm is not None else default_comm(self._params[0].device)
        try:
            _check_world(self.comm)
        except Exception:
            if self._own_comm:
                self.comm.close()
            raise
        self.sharded = bool(config.get("shard", False))
        if self.sharded:
            layout = "arena" if layout == "copy" else layout  # a shard is a range of the arena
            if find_unused_parameters:
                raise ValueError("libddp.torch: find_unused_parameters is not available with shard=True (the usage "
                                 "map would be reduced into one rank's shard); use unused_policy='zero'")
        self.arena = layout in ("arena", L.DDP_LAYOUT_ARENA)
        config.setdefault("plan_order", "registration" if self.arena else "learned")
        uneven = config.get("uneven_inputs", "off")
        self._uneven = _ENUMS["uneven_inputs"].get(uneven, uneven)
        if self._uneven != L.DDP_UNEVEN_OFF and broadcast_buffers and any(b.numel() for b in module.buffers()):
            if self._own_comm:
                self.comm.close()
            raise InvalidArgumentError(
                "libddp.torch: uneven_inputs with broadcast_buffers=True and a module with buffers (%s): a rank in "
                "join() takes no part in the buffers' broadcast before each forward, so the others would wait for it "
                "until the timeout; create the wrapper with broadcast_buffers=False (each rank keeps its own "
                "BatchNorm statistics), and after join() returns copy the buffers from the rank that ran every "
                "iteration (model.ddp.broadcast(list(model.module.buffers()), root=that_rank))"
                % ", ".join(n for n, b in module.named_buffers() if b.numel())[:200])
        self.ddp = DDP(self.comm, layout=layout, **config)
        self.find_unused = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._buffers_due = True  # torch syncs buffers before the first forward too
        self._sync = True
        self._early_exit_check = False  # inside join(throw_on_early_termination=True)

        if broadcast_parameters:
            with torch.no_grad():
                params = [p.data if p.is_contiguous() else p.data.contiguous() for p in self._params]
                self.ddp.broadcast(params, root=0, stream=self._stream())
            self._sync_buffers()
        self._register(allreduce_trigger_params)
        self._install_hooks()
        self._gathering = False
        if self.sharded:
            self._bind_params()

    @staticmethod
    def _trainable(module):
        seen, params = set(), []
        for p in module.parameters():  # tied weights appear once
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if not params:
            raise ValueError("libddp.torch: the module has no parameter that requires grad")
        if any(p.is_cuda != params[0].is_cuda for p in params):
            raise ValueError("libddp.torch: parameters must all be on CPU or all on CUDA")
        for p in params:
            dtype_code(p.dtype)  # raises for unsupported dtypes
        return params

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
            if self.arena:
                buf = None
            elif g is not None and g.is_contiguous():
                buf = (g.data_ptr(), p.numel(), p.dtype)
            else:
                buf = (self._scratch.data_ptr(), p.numel(), p.dtype)
            self.ddp.register(buf, numel=p.numel(), dtype=p.dtype, trigger=id(p) in triggers, device=self._cuda)
        try:
            self.ddp.commit()
        except DDPError as e:  # ranks that registered different parameters
            raise _with_param_names(e, self) from None
        self._h = self.ddp._h
        self._views = [None] * len(self._params)
        self._epoch = None
        if self.arena:
            self._bind_views()

    def _install_hooks(self):
        self._in_backward = False
        self._queued = False
        self._marked = [False] * len(self._params)
        self._hooks = []
        self._accs = []
        self._lock = threading.Lock()  # CUDA autograd runs hooks on device threads
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(acc.register_hook(self._make_hook(i)))
                self._accs.append(acc)  # keep the accumulators alive, as apex does

    # -- internals ------------------------------------------------------------------------------
    def _stream(self):
        return torch.cuda.current_stream().cuda_stream if self._cuda else None

    def _sync_buffers(self, root=0):
        """Copies `root`'s buffers (any dtype) to every rank. Collective."""
        raws, back = [], []
        with torch.no_grad():
            for b in self.module.buffers():
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
                self.ddp.broadcast(raws, root=root, stream=self._stream())
            for b, t, nbytes in back:
                flat = t.reshape(-1).view(torch.uint8)[:nbytes]
                b.data.copy_(flat.view(b.dtype).view(b.shape))

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
        def wait(*_):
            if self._gathering:
                for i in indices:
                    self.ddp.wait_params(i, self._stream())
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
        self.ddp.begin_backward(self._stream())
        self._in_backward = True
        self._queued = False
        self._marked = [False] * len(self._params)

    def _make_hook(self, i):
        def hook(*_):
            with self._lock:
                if not self._in_backward:
                    self._begin()
                if not self._queued:
                    self._queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            p = self._params[i]
            try:
                if self.arena:
                    self._adopt_grad(i)
                    L.lib.ddp_grad_ready(self._h, self._base + i)
                else:
                    g = p.grad
                    if not g.is_contiguous():
                        g = p.grad = g.contiguous()
                    L.lib.ddp_grad_ready_ptr(self._h, self._base + i, g.data_ptr())
            except DDPError as e:
                raise _with_param_names(e, self) from None
            self._marked[i] = True
        return hook

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
            raise _with_param_names(e, self) from None
        if self.arena and self.ddp.stats.layout_epoch != self._epoch:
            self._bind_views()
        self._settle_unused(saved)

    # -- the module ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._early_exit_check and torch.is_grad_enabled():
            self._check_no_rank_finished(0)
        if self.broadcast_buffers and self._buffers_due:
            self._sync_buffers()
        training = torch.is_grad_enabled()
        if training and not self._in_backward:
            self._begin()
        out = self.module(*args, **kwargs)
        if self._gathering:  # parameters of modules the forward did not run
            self.ddp.wait_params(-1, self._stream())
            self._gathering = False
        # torch: buffers are synced before the next forward only after a training forward with sync on.
        self._buffers_due = training and self._sync
        return out

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Uneven inputs, as torch's `with model.join(): for batch in my_batches: ...`. On leaving the block,
        a rank out of batches shadows the others' iterations (ddp_join) until every rank is done, then
        every rank takes the parameters and buffers of the rank that ran the most iterations (the highest
        such rank), as torch does. Needs the wrapper created with uneven_inputs="by_world" (torch's
        divide_by_initial_world_size=True: averages over the world, joined ranks counting as zeros) or
        "by_contributors" (False: over the ranks that still have data), and with broadcast_buffers=False
        when the module has buffers. throw_on_early_termination=True: instead, every rank raises
        RuntimeError at the first forward pass after some rank ran out (one small allreduce per forward;
        no uneven_inputs needed). enable=False: the block does nothing."""
        return self._join_context(bool(divide_by_initial_world_size), bool(enable), bool(throw_on_early_termination))

    @contextlib.contextmanager
    def _join_context(self, by_world, enable, throw):
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
            raise InvalidStateError(
                "libddp.torch: join(divide_by_initial_world_size=%s) needs the wrapper created with "
                "uneven_inputs=%r (it is %r now): DistributedDataParallel(model, uneven_inputs=%r%s)" % (
                    by_world, "by_world" if by_world else "by_contributors",
                    {v: k for k, v in _ENUMS["uneven_inputs"].items()}.get(self._uneven, self._uneven),
                    "by_world" if by_world else "by_contributors",
                    ", broadcast_buffers=False" if any(b.numel() for b in self.module.buffers()) else ""))
        ran = self.ddp.stats.iterations
        yield self  # an exception in the block propagates: no join (the other ranks time out, as in torch)
        self.ddp.join()
        # torch's final sync: the last rank to join (the most iterations; ties: the highest rank) is the
        # authoritative model copy.
        world = self.comm.size
        import numpy as np

        key = self.ddp.allreduce_host(np.array([ran * world + self.comm.rank], np.int64), "max")
        root = int(key[0] % world)
        with torch.no_grad():
            params = [p.data if p.is_contiguous() else p.data.contiguous() for p in self._params]
            self.ddp.broadcast(params, root=root, stream=self._stream())
            for p, t in zip(self._params, params):
                if t.data_ptr() != p.data.data_ptr():
                    p.data.copy_(t)
        self._sync_buffers(root)

    def _check_no_rank_finished(self, finished):
        """join(throw_on_early_termination=True): one allreduce per forward; a rank out of data sends 1."""
        import numpy as np

        flag = self.ddp.allreduce_host(np.array([finished], np.int32), "sum")
        if flag[0]:
            raise RuntimeError("libddp.torch: rank %d: %s" % (self.comm.rank, "exhausted all inputs" if finished else
                               "a rank exhausted all its inputs (join(throw_on_early_termination=True))"))

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate grads locally; the next one outside reduces the sum."""
        if self._in_backward:
            raise RuntimeError("libddp.torch: no_sync() must be entered before the forward pass")
        self.ddp.set_sync(False)
        self._sync = False
        try:
            yield
        finally:
            if not self.ddp.closed and not self._in_backward:
                self.ddp.set_sync(True)
                self._sync = True

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

    def close(self):
        """Removes the hooks and destroys the context (arena grads are copied out to torch's own memory), and
        the communicator when it was made here (no comm given)."""
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
        if self._own_comm:
            self.comm.close()


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
