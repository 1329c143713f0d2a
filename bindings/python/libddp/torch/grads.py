"""The grads of one libddp context: registered with it, handed over as they become final, and given the
storage the library writes. Copy layout: the grads are torch's own tensors, handed over by pointer;
arena layout: every p.grad is the library's view into its bucket buffers. With find_unused_parameters,
grad 0 is the usage map (1.0 where this rank used a parameter), reduced with the grads."""
import torch

from .. import _lib as L
from ..errors import DDPError
from .memory import view
from .model import param_names, with_param_names


class GradStore:
    """The grads of the context `ddp`, registered (collective) on construction. One per context: a rebuilt
    context registers its grads afresh."""

    def __init__(self, ddp, module, params, arena, find_unused, triggers=None):
        self.ddp, self.module, self.params = ddp, module, params
        self.arena, self.find_unused = arena, find_unused
        self.had_grad = None  # arena: whether each .grad existed when the backward pass began
        self.lent = None  # scratch grads of a joined rank, kept until the next backward pass
        self._register(triggers)

    def _register(self, triggers):
        dev = self.params[0].device
        # The usage map, registered first, is last in reverse registration order: marked ready at the end
        # of backward, it holds back only the last bucket.
        self.base = 1 if self.find_unused else 0
        self.used = torch.zeros(len(self.params), dtype=torch.float32, device=dev) if self.find_unused else None
        # Copy layout: registration needs a pointer; one scratch buffer stands in for grads that do not
        # exist yet. Every grad's real storage is given to the library before it is reduced.
        big = max(p.numel() * p.element_size() for p in self.params)
        self.scratch = torch.empty(big, dtype=torch.uint8, device=dev)
        triggers = set(id(p) for p in (triggers or ()))
        cuda = dev.type == "cuda"
        if self.find_unused:
            self.ddp.register(None if self.arena else self.used, numel=len(self.params), dtype=torch.float32,
                              device=cuda)
        for p in self.params:
            g = p.grad
            stand_in = False
            if self.arena:
                buf = None
            elif g is not None and g.is_contiguous():
                buf = (g.data_ptr(), p.numel(), p.dtype)
            else:
                buf, stand_in = (self.scratch.data_ptr(), p.numel(), p.dtype), True
            self.ddp.register(buf, numel=p.numel(), dtype=p.dtype, trigger=id(p) in triggers, device=cuda,
                              stand_in=stand_in)
        try:
            self.ddp.commit()
        except DDPError as e:  # ranks that registered different parameters
            raise self.named(e) from None
        self.h = self.ddp._h
        self.views = [None] * len(self.params)
        self.epoch = None
        if self.arena:
            self.bind_views()

    def named(self, err, marked=()):
        """The library's error with parameter names for its grad indices."""
        return with_param_names(err, self.module, self.params, self.base, marked)

    def names(self):
        return param_names(self.module, self.params, self.base)

    def bind_views(self):
        """Arena: make every existing p.grad the library's view (moving current values in). A .grad
        that is None stays None until its parameter takes part in a backward pass, as in torch."""
        self.epoch = self.ddp.stats.layout_epoch
        with torch.no_grad():
            if self.find_unused:
                self.used = view(self.ddp.grad_ptr(0), self.used)
            for i, p in enumerate(self.params):
                old = self.views[i]
                v = view(self.ddp.grad_ptr(self.base + i), p)
                self.views[i] = v
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

    def rebind_if_moved(self):
        """Arena: after a backward pass in which the library moved the arena, the grads follow it."""
        if self.arena and self.ddp.stats.layout_epoch != self.epoch:
            self.bind_views()

    def adopt(self, i):
        """Arena: p.grad must be the view before it is reduced (torch may have replaced or dropped it)."""
        p, v = self.params[i], self.views[i]
        g = p.grad
        if g is None:
            v.zero_()
        elif g.data_ptr() != v.data_ptr():
            with torch.no_grad():
                v.copy_(g)
        p.grad = v

    def begin(self):
        """Arena: records whether each .grad existed before the pass (a parameter no rank uses gets its None
        back) and adopts the existing ones; a None .grad is adopted if its parameter takes part."""
        if self.arena:
            self.had_grad = [p.grad is not None for p in self.params]
            for i, had in enumerate(self.had_grad):
                if had:
                    self.adopt(i)

    def ready(self, i):
        """Grad i is final: handed to the library. A grad torch left undefined (None) counts as unused with
        find_unused_parameters (False: not handed over); without it, it is reduced as zeros, as torch does."""
        p = self.params[i]
        if p.grad is None and self.find_unused:
            return False  # hand_over_unused hands it over at the end: used nowhere, it stays None
        if self.arena:
            self.adopt(i)
            L.lib.ddp_grad_ready(self.h, self.base + i)
        else:
            g = p.grad
            if g is None:
                g = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not g.is_contiguous():
                g = p.grad = g.contiguous()
            L.lib.ddp_grad_ready_ptr(self.h, self.base + i, g.data_ptr())
        return True

    def hand_over_unused(self, marked):
        """find_unused_parameters: hands the library every grad not `marked` (its current value, or zeros)
        and the usage map. Returns, per unused parameter, what restores it if no rank used it."""
        saved = {}
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if marked[i]:
                    continue
                if self.arena:
                    had = self.had_grad[i] and p.grad is not None
                    saved[i] = (had, p.grad.detach().clone() if had else None)
                    self.adopt(i)
                    L.lib.ddp_grad_ready(self.h, self.base + i)
                else:
                    had = p.grad is not None
                    tmp = p.grad.detach().clone(memory_format=torch.contiguous_format) if had else torch.zeros_like(p)
                    saved[i] = (had, tmp)
                    L.lib.ddp_grad_ready_ptr(self.h, self.base + i, tmp.data_ptr())
            self.used.copy_(torch.tensor(marked, dtype=torch.float32))
        if self.arena:
            L.lib.ddp_grad_ready(self.h, 0)
        else:
            L.lib.ddp_grad_ready_ptr(self.h, 0, self.used.data_ptr())
        return saved

    def settle_unused(self, saved):
        """After the reduction: used somewhere -> the reduced value; used nowhere -> .grad as it was."""
        if not saved:
            return
        used = (self.used > 0).tolist()
        with torch.no_grad():
            for i, (had, value) in saved.items():
                p = self.params[i]
                if used[i]:
                    if not self.arena:
                        if had:
                            p.grad.copy_(value)
                        else:
                            p.grad = value
                elif self.arena:
                    if had:
                        self.views[i].copy_(value)
                    else:
                        p.grad = None  # the next backward adopts the view again, zeroed
                # copy layout, used nowhere: the library reduced a copy; .grad is untouched

    def give_storage_to_unused(self, marked):
        """Without find_unused_parameters: grads that never became ready are reduced as zeros and then
        reported by the library; they still need real storage."""
        for i, p in enumerate(self.params):
            if marked[i]:
                continue
            if self.arena:
                self.adopt(i)
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                L.lib.ddp_set_grad_ptr(self.h, self.base + i, p.grad.data_ptr())

    def lend_scratch(self):
        """Copy layout, a joined rank: the grads the library last saw may be gone (zero_grad(set_to_none),
        the copies of unused grads), so it gets scratch storage of its own for the shadow iterations, kept
        until the next backward pass gives it real grads again; torch leaves a joined rank's .grad alone."""
        if self.arena:
            return
        self.lent = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params]
        for i, t in enumerate(self.lent):
            L.lib.ddp_set_grad_ptr(self.h, self.base + i, t.data_ptr())

    def release(self):
        """Before the context is destroyed: arena grads are copied out to torch's own memory."""
        if self.arena and not self.ddp.closed:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad = p.grad.clone()
        self.views = [None] * len(self.params)
