"""The wrapped module as the library sees it: which parameters are reduced and which tensors construction
broadcasts, the checks made on them (devices, sparse grads, the same model on every rank), and their
names in the library's error messages."""
import re

import torch

from ..core import dtype_code
from ..errors import InvalidArgumentError, MismatchError, UnsupportedError


def trainable(module, ignore=()):
    """The parameters that are reduced: those that require a grad and are not ignored, tied ones once."""
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


def checked_device_ids(device, device_ids, output_device):
    """torch's device_ids for parameters on `device`: None for a CPU module, one device for a CUDA one."""
    cuda = device.type == "cuda"
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("libddp.torch: device_ids can only be None or contain a single element")
    if not cuda and (device_ids or output_device):  # as torch: a falsy output_device (0) passes
        raise ValueError("libddp.torch: device_ids and output_device only work with a single-device GPU module; "
                         "this module's parameters are on %s (got device_ids %s, output_device %s)"
                         % (device, device_ids, output_device))
    return [torch.device("cuda", torch.cuda._utils._get_device_index(device_ids[0], True))] \
        if cuda and device_ids else None


def refuse_sparse(module, params):
    """Sparse grads (Embedding(sparse=True)) of reduced parameters raise, naming the way out."""
    reduced = set(id(p) for p in params)
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and id(m.weight) in reduced:
            raise UnsupportedError(
                "libddp.torch: %s (%s(sparse=True)) produces sparse gradients, which libddp does not reduce: "
                "make it with sparse=False, or leave its weight out with DistributedDataParallel."
                "_set_params_and_buffers_to_ignore_for_model(module, [%r])"
                % (name or "the module", type(m).__name__, (name + "." if name else "") + "weight"))


def named_buffers(module, ignore):
    return [(n, b) for n, b in module.named_buffers() if n not in ignore]


def synced_tensors(module, ignore):
    """(name, tensor) of what construction broadcasts from rank 0: every parameter (frozen ones too)
    and buffer not ignored, as torch's state sync."""
    seen, out = set(), []
    for n, p in module.named_parameters():
        if n not in ignore and id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out + named_buffers(module, ignore)


def verify_same_model(ddp, rank, named):
    """Every rank must hold the same model: the count, shapes, dtypes and requires_grad of what is
    reduced and broadcast are compared across ranks (four small allreduces over `ddp`) before anything
    of the model travels. A difference raises MismatchError on every rank."""
    import zlib
    import numpy as np

    n = len(named)
    nd = max([t.dim() for _, t in named] + [0])
    head = np.array([n, nd], np.int64)
    hi = ddp.allreduce_host(head.copy(), "max")
    lo = ddp.allreduce_host(head.copy(), "min")
    if hi[0] != lo[0]:
        raise MismatchError(
            "libddp.torch: DistributedDataParallel expects the same model on every rank, but rank %d has %d "
            "parameters and buffers while another rank has %d" % (rank, n, lo[0] if hi[0] == n else hi[0]))
    nd = int(hi[1])
    rows = np.full((n, nd + 3), -1, np.int64)
    for k, (_, t) in enumerate(named):
        rows[k, 0] = zlib.crc32(str(t.dtype).encode())
        rows[k, 1] = t.dim() * 2 + int(t.requires_grad)
        rows[k, 2:2 + t.dim()] = list(t.shape)
    hi = ddp.allreduce_host(rows.reshape(-1).copy(), "max").reshape(rows.shape)
    lo = ddp.allreduce_host(rows.reshape(-1).copy(), "min").reshape(rows.shape)
    bad = np.nonzero((hi != lo).any(axis=1))[0]
    if bad.size:
        name, t = named[int(bad[0])]
        raise MismatchError(
            "libddp.torch: DistributedDataParallel expects the same model on every rank, but %s (shape %s, %s%s) "
            "on rank %d does not match the same parameter or buffer on every other rank"
            % (name, list(t.shape), t.dtype, ", requires_grad" if t.requires_grad else "", rank))


def param_names(module, params, base):
    """The library's grad index -> the parameter's name in the wrapped module (as named_parameters()
    gives it: "b.weight"); with find_unused_parameters (base 1), grad 0 is the usage map."""
    by_id = {}
    for name, p in module.named_parameters():
        by_id.setdefault(id(p), name)
    names = {base + i: by_id.get(id(p), "parameter %d" % i) for i, p in enumerate(params)}
    if base:
        names[0] = "(the usage map of find_unused_parameters)"
    return names


_UNUSED_HINT = ("If a forward pass may leave some parameters out of the loss, wrap the model with "
                "DistributedDataParallel(model, find_unused_parameters=True) (as torch.nn.parallel."
                "DistributedDataParallel wants too); otherwise make every parameter take part in the loss")


def with_param_names(err, module, params, base, marked=()):
    """The library's error `err` (of a DDPError class), its grad indices turned into parameter names:
    the same class, a message for a torch user. Grads that were never marked ready name the torch fix;
    `marked` (per parameter, whether this rank handed its grad over) lists this rank's."""
    names = param_names(module, params, base)
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
    mine = [name(base + i) for i, done in enumerate(marked) if not done]
    text = "libddp.torch: parameters that got no grad in this backward pass (reduced as zeros): %s." % named
    if " more" in named and mine:
        text += " All of this rank's: %s." % ", ".join(mine)
    text += " %s. (%s%s)" % (_UNUSED_HINT, head, sep + body)
    return type(err)(text, err.status)
