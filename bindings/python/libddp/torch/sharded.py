"""Sharded (ZeRO-1/2, Megatron's distributed optimizer): DistributedDataParallel(model, shard=True) keeps the
parameters in the library's parameter arena (p.data become views) and reduce-scatters the grads;
ShardedOptimizer runs any elementwise torch optimizer over this rank's flat shards only and launches the
parameters' gather, which the next forward pass waits for layer by layer."""
import weakref

import torch

from .memory import stream, view


class ParamGather:
    """The parameter arena of a context (shard=True binds the parameters to it): the gather launched after
    the optimizer step, and each module's wait for its own parameters before its forward."""

    def __init__(self, device):
        self.device = device
        self.ddp = None
        self.params = []
        self.gathering = False
        self.handles = []

    def attach(self, ddp):
        """A new context: nothing bound, no gather in flight."""
        self.ddp, self.params, self.gathering = ddp, [], False

    def bind(self, module, params, base):
        """Sharded: every parameter's data becomes its view in the parameter arena (values moved in), and
        each module waits, before its forward, for the gather of its own parameters."""
        self.params = params
        index = {}
        with torch.no_grad():
            for i, p in enumerate(params):
                v = view(self.ddp.param_ptr(base + i), p)
                v.copy_(p.data)
                p.data = v
                index[id(p)] = base + i
        for m in module.modules():
            mine = sorted(set(index[id(p)] for p in m.parameters(recurse=False) if id(p) in index))
            if mine:
                self.handles.append(m.register_forward_pre_hook(self._waiter(mine)))

    def _waiter(self, indices):
        ref = weakref.ref(self)

        def wait(*_):
            gather = ref()
            if gather is not None and gather.gathering:
                for i in indices:
                    gather.ddp.wait_params(i, stream(gather.device))
        return wait

    def launch(self):
        """Launches the all-gather of the parameters (after the optimizer updated the shards)."""
        self.ddp.gather_params(stream(self.device))
        self.gathering = True

    def after_forward(self):
        """The parameters of modules the forward pass did not run are waited for too."""
        if self.gathering:
            self.ddp.wait_params(-1, stream(self.device))
            self.gathering = False

    def release(self):
        """Removes the hooks; bound parameters move out of the arena before its context goes."""
        for h in self.handles:
            try:
                h.remove()
            except Exception:
                pass
        self.handles = []
        if self.ddp is not None and not self.ddp.closed:
            with torch.no_grad():
                for p in self.params:
                    p.data = p.data.clone()


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
            p = torch.nn.Parameter(view(s.param_ptr, like), requires_grad=True)
            p.grad = view(s.grad_ptr, like)
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
        norm, _ = self.model.ddp.shard_norm(stream(self.model.device))
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
