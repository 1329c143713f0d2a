"""Communication hooks (torch's register_comm_hook): a hook(state, GradBucket) -> Future runs for every bucket
of every synced iteration on the library's bucket thread, in place of the bucket's allreduce. torch's
default hooks with state None run natively over the bucket's comm."""
import weakref

import torch

from .. import _lib as L
from ..core import dtype_code
from .memory import TORCH_DTYPES, flat


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


def builtin_hook(comm_hook_type):
    """dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS: torch's default hook of that name."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    hooks = {"ALLREDUCE": default_hooks.allreduce_hook, "FP16_COMPRESS": default_hooks.fp16_compress_hook}
    name = getattr(comm_hook_type, "name", str(comm_hook_type).rsplit(".", 1)[-1])
    if name not in hooks:
        raise ValueError("libddp.torch: unknown builtin comm hook %r" % (comm_hook_type,))
    return hooks[name]


class CommHook:
    """A registered (state, hook), set on each context the wrapper makes (attach), run for one bucket at a
    time (run). prepare() reads the plan's bucket layout at the start of each backward pass."""

    def __init__(self, state, hook):
        self.state, self.hook = state, hook
        self.ddp = self.params = self.device = None
        self.base = 0
        self.segments = None

    def attach(self, ddp, params, base, device):
        """Sets the hook on the context `ddp` (before its grads are committed); base 1: grad 0 is the usage
        map of find_unused_parameters."""
        self.ddp, self.params, self.base, self.device = ddp, params, base, device
        self.segments = None
        ref = weakref.ref(self)

        def run(bucket):
            hook = ref()
            if hook is not None:
                hook.run(bucket)
        ddp.set_comm_hook(run)

    def prepare(self):
        """Per bucket of the plan: [(library grad index, offset, numel)] as the hook's buffer packs them."""
        out = []
        for b in self.ddp.plan.buckets:
            off, segs = 0, []
            for g in b.grads:
                n = self.ddp._grads[g][0]
                segs.append((g, off, n))
                off += n
            out.append(segs)
        self.segments = out

    def run(self, b):
        """The library's hook call for one bucket (on its bucket thread)."""
        dtype = TORCH_DTYPES[b.dtype]
        whole = flat(b.buffer, b.count, dtype, self.device)
        segs = self.segments[b.bucket]
        usage = [s for s in segs if self.base and s[0] == 0]
        grads = [s for s in segs if not (self.base and s[0] == 0)]
        for _, off, n in usage:  # the usage map is summed, whatever the hook does with the grads
            L.lib.ddp_comm_allreduce(b.comm, whole[off:off + n].data_ptr(), n, b.dtype, L.DDP_OP_SUM, b.stream)
        if not grads:
            return
        lo, hi = grads[0][1], grads[-1][1] + grads[-1][2]
        if sum(n for _, _, n in grads) == hi - lo:
            buf, offs = whole[lo:hi], [(g, off - lo, n) for g, off, n in grads]
        else:
            buf = torch.cat([whole[off:off + n] for _, off, n in grads])
            offs, at = [], 0
            for g, _, n in grads:
                offs.append((g, at, n))
                at += n
        native = _NATIVE_HOOKS.get(self.hook) if self.state is None else None
        if native is not None:
            native(b, buf)
        else:
            self._run_python(b, buf, offs)
        if buf.data_ptr() != whole[lo:].data_ptr() or buf.numel() != hi - lo:
            for (_, off, n), (_, src, _) in zip(grads, offs):
                whole[off:off + n].copy_(buf[src:src + n])

    def _run_python(self, b, buf, offs):
        """The user's hook over a GradBucket of `buf`; its future's value is written back into `buf`."""
        params = [self.params[g - self.base] for g, _, _ in offs]
        views = [buf[off:off + n].view(p.shape) for (_, off, n), p in zip(offs, params)]
        bucket = GradBucket(b.bucket, buf, views, params, b.bucket == len(self.segments) - 1)
        fut = self.hook(self.state, bucket)
        value = fut.wait() if hasattr(fut, "wait") else fut
        if isinstance(value, (list, tuple)):
            value = value[0]
        result = bucket.buffer()
        if value.data_ptr() != result.data_ptr():
            result.copy_(value.reshape(-1))
        if result.data_ptr() != buf.data_ptr():
            buf.copy_(result)
