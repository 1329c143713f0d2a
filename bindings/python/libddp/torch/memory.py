"""Tensors over the library's memory (arena grads, the parameter arena, a comm hook's bucket), the byte-wise
broadcast that copies any tensor from one rank to the others, and walks over a forward pass's inputs
and outputs."""
import ctypes

import torch

from .. import _lib as L


class _CudaView:
    """Exposes device memory through __cuda_array_interface__ so torch.as_tensor can view it."""

    def __init__(self, ptr, numel, typestr):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (ptr, False),
                                         "version": 2, "strides": None}


# __cuda_array_interface__ has no bfloat16: such memory is viewed as int16 and reinterpreted.
_TYPESTR = {torch.float16: ("<f2", None), torch.bfloat16: ("<i2", torch.bfloat16),
            torch.float32: ("<f4", None), torch.float64: ("<f8", None)}

# The library's dtype codes as torch dtypes.
TORCH_DTYPES = {L.DDP_F16: torch.float16, L.DDP_BF16: torch.bfloat16, L.DDP_F32: torch.float32,
                L.DDP_F64: torch.float64}


def flat(ptr, n, dtype, device):
    """A flat tensor of n `dtype` elements over the library's memory at `ptr` on `device`."""
    if device.type == "cuda":
        if dtype not in _TYPESTR:
            raise TypeError("libddp.torch: the arena layout on CUDA supports float16/bfloat16/32/64, not %s" % dtype)
        typestr, cast = _TYPESTR[dtype]
        t = torch.as_tensor(_CudaView(ptr, n, typestr), device=device)
        return t.view(cast) if cast is not None else t
    raw_bytes = (ctypes.c_byte * (n * torch.empty(0, dtype=dtype).element_size())).from_address(ptr)
    return torch.frombuffer(raw_bytes, dtype=dtype, count=n)


def view(ptr, like):
    """A tensor shaped like `like` (a parameter or tensor) over the library's memory at `ptr`."""
    return flat(ptr, like.numel(), like.dtype, like.device).view(like.shape)


def stream(device):
    """The current CUDA stream's handle for memory on `device`; None for host memory."""
    return torch.cuda.current_stream().cuda_stream if device.type == "cuda" else None


_RAW_WIDTHS = ((8, torch.float64), (4, torch.float32), (2, torch.float16))


def raw(t):
    """(pointer, count, dtype) covering the bytes of contiguous `t` (an even number of them), for a
    broadcast: a broadcast copies bytes, so any tensor travels as the widest float type that tiles it."""
    nbytes = t.numel() * t.element_size()
    for width, dt in _RAW_WIDTHS:
        if nbytes % width == 0:
            return (t.data_ptr(), nbytes // width, dt)
    raise ValueError("odd byte count")


def broadcast_tensors(ddp, tensors, root, cuda_stream=None):
    """Copies `root`'s tensors (any dtype, any layout) to every rank over the context `ddp`. Collective."""
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
            raws.append(raw(t))
        if raws:
            ddp.broadcast(raws, root=root, stream=cuda_stream)
        for b, t, nbytes in back:
            flat_bytes = t.reshape(-1).view(torch.uint8)[:nbytes]
            b.data.copy_(flat_bytes.view(b.dtype).view(b.shape))


def tensors(obj):
    """Every tensor in a forward pass's output: nested lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from tensors(getattr(obj, f))


def to_device(obj, device):
    """A forward pass's inputs with every tensor moved to `device` (named tuples keep their type)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[to_device(o, device) for o in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
