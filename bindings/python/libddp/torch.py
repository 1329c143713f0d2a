"""libddp.torch: DistributedDataParallel for torch.nn.Module over libddp (torch is imported here only).

    import libddp.torch
    model = libddp.torch.DistributedDataParallel(model)          # CPU: MPI; CUDA: NCCL over MPI
    loss = model(x).sum(); loss.backward()                        # grads reduced when backward returns

As apex does, it hooks each parameter's grad accumulator: when the accumulator has run, the grad is
final for this backward pass and is handed to ddp_grad_ready; a callback queued on the autograd engine
calls ddp_finish_backward before backward() returns.
"""
import contextlib
import ctypes
import threading

import torch

from . import _lib as L
from .core import DDP, Comm, dtype_code

__all__ = ["DistributedDataParallel"]


class _CudaView:
    """Exposes device memory through __cuda_array_interface__ so torch.as_tensor can view it."""

    def __init__(self, ptr, numel, typestr):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (ptr, False),
                                         "version": 2, "strides": None}


_TYPESTR = {torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}


def _view(ptr, param):
    """A tensor shaped like `param` over the library's memory at `ptr`."""
    n = param.numel()
    if param.is_cuda:
        if param.dtype not in _TYPESTR:
            raise TypeError("libddp.torch: the arena layout on CUDA supports float16/32/64, not %s" % param.dtype)
        t = torch.as_tensor(_CudaView(ptr, n, _TYPESTR[param.dtype]), device=param.device)
    else:
        raw = (ctypes.c_byte * (n * param.element_size())).from_address(ptr)
        t = torch.frombuffer(raw, dtype=param.dtype, count=n)
    return t.view(param.shape)


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its parameters' grads are reduced across the ranks of `comm` in every backward pass.

    comm: a libddp.Comm (default: Comm.mpi() for CPU parameters, Comm.nccl_mpi(device) for CUDA ones).
    layout: "copy" (grads stay torch's own tensors) or "arena" (p.grad become views into the library's
    bucket buffers: zero copies; apex retain_allreduce_buffers / torch gradient_as_bucket_view).
    find_unused_parameters: grads that never became ready are reduced as zeros instead of raising.
    broadcast_parameters: copy rank 0's parameters and float buffers to every rank at construction.
    Other keywords are libddp config fields (message_size, delay_allreduce, gradient_average,
    gradient_predivide_factor, allreduce_always_fp32, num_streams, timeout_ms, plan_order, ...).
    """

    def __init__(self, module, comm=None, *, layout="copy", find_unused_parameters=False,
                 broadcast_parameters=True, allreduce_trigger_params=None, **config):
        super().__init__()
        self.module = module
        seen = set()
        self._params = []
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._params.append(p)
        if not self._params:
            raise ValueError("libddp.torch: the module has no parameter that requires grad")
        self._cuda = self._params[0].is_cuda
        if any(p.is_cuda != self._cuda for p in self._params):
            raise ValueError("libddp.torch: parameters must all be on CPU or all on CUDA")
        for p in self._params:
            dtype_code(p.dtype)  # raises for unsupported dtypes
        if comm is None:
            comm = Comm.nccl_mpi(self._params[0].device.index or 0) if self._cuda else Comm.mpi()
        self.comm = comm
        self.arena = layout in ("arena", L.DDP_LAYOUT_ARENA)
        config.setdefault("plan_order", "registration" if self.arena else "learned")
        if find_unused_parameters:
            config.setdefault("unused_policy", "zero")
        self.ddp = DDP(comm, layout=layout, **config)
        triggers = set(id(p) for p in (allreduce_trigger_params or ()))

        if broadcast_parameters:
            with torch.no_grad():
                tensors = [p.data for p in self._params]
                tensors += [b.data for b in module.buffers()
                            if b.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]
                tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
                self.ddp.broadcast(tensors, root=0, stream=self._stream())

        # Copy layout: registration needs a pointer; one scratch buffer stands in for grads that do not
        # exist yet. Every grad's real storage is given to the library before it is reduced.
        big = max(p.numel() * p.element_size() for p in self._params)
        self._scratch = torch.empty(big, dtype=torch.uint8, device=self._params[0].device)
        for p in self._params:
            g = p.grad
            if self.arena:
                buf = None
            elif g is not None and g.is_contiguous():
                buf = (g.data_ptr(), p.numel(), p.dtype)
            else:
                buf = (self._scratch.data_ptr(), p.numel(), p.dtype)
            self.ddp.register(buf, numel=p.numel(), dtype=p.dtype, trigger=id(p) in triggers, device=self._cuda)
        self.ddp.commit()
        self._h = self.ddp._h
        self._views = [None] * len(self._params)
        self._epoch = None
        if self.arena:
            self._bind_views()

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

    def _bind_views(self):
        """Arena: make every p.grad the library's view (moving current values in)."""
        self._epoch = self.ddp.stats.layout_epoch
        with torch.no_grad():
            for i, p in enumerate(self._params):
                old = self._views[i]
                v = _view(self.ddp.grad_ptr(i), p)
                self._views[i] = v
                g = p.grad
                if old is not None and g is not None and g.data_ptr() == old.data_ptr():
                    pass  # the storage moved with its values; the old view is dangling now
                elif g is None:
                    v.zero_()
                elif g.data_ptr() != v.data_ptr():
                    v.copy_(g)
                p.grad = v
                del old, g

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
            for i in range(len(self._params)):
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
            if self.arena:
                self._adopt_grad(i)
                L.lib.ddp_grad_ready(self._h, i)
            else:
                g = p.grad
                if not g.is_contiguous():
                    g = p.grad = g.contiguous()
                L.lib.ddp_grad_ready_ptr(self._h, i, g.data_ptr())
            self._marked[i] = True
        return hook

    def _finish(self):
        # Grads that never became ready are reduced as zeros (or reported): give them real storage.
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
                L.lib.ddp_set_grad_ptr(self._h, i, p.grad.data_ptr())
        self._in_backward = False
        self.ddp.finish_backward(self._stream())
        if self.arena and self.ddp.stats.layout_epoch != self._epoch:
            self._bind_views()

    # -- the module ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self._in_backward:
            self._begin()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate grads locally; the next one outside reduces the sum."""
        if self._in_backward:
            raise RuntimeError("libddp.torch: no_sync() must be entered before the forward pass")
        self.ddp.set_sync(False)
        try:
            yield
        finally:
            if not self.ddp.closed and not self._in_backward:
                self.ddp.set_sync(True)

    @property
    def stats(self):
        return self.ddp.stats

    @property
    def plan(self):
        return self.ddp.plan

    def close(self):
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
        self._views = [None] * len(self._params)
        self.ddp.close()
