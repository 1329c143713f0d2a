"""The backward pass, seen from the grad accumulators' hooks (as apex does): when a parameter's accumulator
has run, its grad is final for this pass and goes to the library; a callback queued on the autograd
engine finishes the library's iteration before backward() returns. static_graph: a grad is ready after
its hook's last run of the iteration, as learned in the first."""
import threading
import weakref

import torch

from ..errors import DDPError
from .memory import stream, tensors


class Backward:
    """The wrapper's backward passes over its current context's grads (a GradStore, attached anew when the
    context is rebuilt). `next_sync` is the forward pass's say: whether the backward that follows is
    reduced (False under no_sync)."""

    def __init__(self, params, device, buffer_sync):
        self.params, self.device = params, device
        self.buffer_sync = buffer_sync  # its futures are awaited at the end of each pass
        self.store = None
        self.comm_hook = None
        self.static_graph = False
        self.next_sync = True  # require_backward_grad_sync at the last training forward
        self.static_counts = None  # static_graph: how many times each grad hook fires per iteration
        self.in_backward = False
        self.handles = []

    def attach(self, store, static_graph, comm_hook):
        """Hooks every parameter's grad accumulator for the context of `store`."""
        self.store, self.static_graph, self.comm_hook = store, static_graph, comm_hook
        self.sync = True  # the library's setting (ddp_set_sync), applied when a backward pass begins
        self.in_backward = False
        self.queued = False
        self.any_grad = False
        self.marked = [False] * len(self.params)
        self.fired = [0] * len(self.params)
        self.accs = []
        self.lock = threading.Lock()  # CUDA autograd runs hooks on device threads
        ref = weakref.ref(self)  # the hooks must not keep a dropped wrapper alive
        with torch.enable_grad():
            for i, p in enumerate(self.params):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self.handles.append(acc.register_hook(_grad_hook(ref, i)))
                self.accs.append(acc)  # keep the accumulators alive, as apex does

    def detach(self):
        """Removes the hooks; the store's arena grads are copied out before its context goes."""
        for h in self.handles:
            try:
                h.remove()
            except Exception:
                pass
        self.handles = []
        if self.store is not None:
            self.store.release()

    def live(self):
        return self.store is not None and not self.store.ddp.closed

    def stuck(self):
        """A backward pass handed grads to the library but never finished (an exception inside it?)."""
        return self.in_backward and self.any_grad

    def watch(self, out):
        """Hooks the forward's outputs that need a grad: the first grad to reach one queues the finish on the
        outermost backward pass (not on a nested one that reentrant checkpointing runs)."""
        ref = weakref.ref(self)

        def on_grad(_):
            backward = ref()
            if backward is not None and backward.live():
                with backward.lock:
                    backward.enter()
        for t in tensors(out):
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(on_grad)

    def _begin(self):
        store = self.store
        store.begin()
        if self.comm_hook is not None:
            self.comm_hook.prepare()
        if self.sync != self.next_sync:  # decided at the forward pass, as torch decides
            store.ddp.set_sync(self.next_sync)
            self.sync = self.next_sync
        store.ddp.begin_backward(stream(self.device))
        self.in_backward = True
        store.lent = None  # every grad gets real storage again before the library writes it
        self.queued = False
        self.any_grad = False
        self.marked = [False] * len(self.params)
        self.fired = [0] * len(self.params)

    def enter(self):
        """Under the lock: the iteration has begun, and the finish is queued on the autograd engine. Called
        first from the hook on the forward's outputs, else from the first grad hook."""
        if not self.in_backward:
            self._begin()
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def on_grad(self, i):
        with self.lock:
            self.enter()
            self.any_grad = True
            self.fired[i] += 1
            if self.static_graph and (self.static_counts is None or self.fired[i] < self.static_counts[i]):
                return  # static_graph: ready after the hook's last run of the iteration (learned in the first)
        self._mark(i)

    def _mark(self, i):
        try:
            handed = self.store.ready(i)
        except DDPError as e:
            raise self.store.named(e, self.marked) from None
        if handed:
            self.marked[i] = True

    def _static_changes(self):
        """static_graph: marks the grads delayed in the first iteration (or fired fewer times), learns the
        counts in the first synced one; later, which parameters' use differs from the first's."""
        for i, n in enumerate(self.fired):
            if n and not self.marked[i]:
                self._mark(i)
        if self.sync and self.static_counts is None:
            self.static_counts = list(self.fired)
        elif self.sync:  # as torch: the set of parameters used must stay that of the first iteration
            return [i for i, n in enumerate(self.fired) if (n == 0) != (self.static_counts[i] == 0)]
        return []

    def _finish(self):
        if not self.any_grad:
            self.queued = False  # no grad of the model in this backward pass (torch.autograd.grad): later
            return
        store = self.store
        changed = self._static_changes() if self.static_graph else []
        saved = {}
        if not self.sync:
            pass  # no_sync: the library only records marks; nothing is reduced
        elif store.find_unused:
            saved = store.hand_over_unused(self.marked)
        else:
            store.give_storage_to_unused(self.marked)
        self.in_backward = False
        try:
            store.ddp.finish_backward(stream(self.device))
        except DDPError as e:
            raised = getattr(store.ddp, "hook_error", None)
            if raised is not None:
                raise RuntimeError("libddp.torch: the communication hook raised %r; the context is aborted"
                                   % (raised,)) from raised
            raise store.named(e, self.marked) from None
        store.rebind_if_moved()
        store.settle_unused(saved)
        self.buffer_sync.wait()
        if changed:  # the iteration is complete on every rank (its values those of find_unused_parameters)
            names = store.names()
            listed = ", ".join(names[store.base + i] for i in changed[:6])
            if len(changed) > 6:
                listed += " and %d more" % (len(changed) - 6)
            raise RuntimeError("libddp.torch: static_graph=True, but the training graph changed in this iteration: "
                               "%s %s used in the first iteration and not now, or the reverse (torch raises too); "
                               "use find_unused_parameters=True for a graph that changes"
                               % (listed, "was" if len(changed) == 1 else "were"))


def _grad_hook(ref, i):
    def hook(*_):
        backward = ref()
        if backward is not None and backward.live():
            backward.on_grad(i)
    return hook
