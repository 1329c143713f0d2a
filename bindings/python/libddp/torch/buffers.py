"""broadcast_buffers: the module's buffers (BatchNorm statistics, any dtype) copied from one rank to every
rank before the forward passes that follow a synced training forward (and before the first), or a buffer
comm hook (torch's _register_buffer_comm_hook) run instead, before or after the forward pass. Which rank
they come from is join's say (join.py)."""
from .memory import broadcast_tensors
from .model import named_buffers


class BufferSync:
    """The buffers of `module` that are not ignored, and when and how they are synced."""

    def __init__(self, module, ignore):
        self.module, self.ignore = module, ignore
        self.due = True  # torch syncs buffers before the first forward too
        self.hook = None  # (state, hook, after the forward) of a buffer comm hook
        self.futures = []

    def named(self):
        return named_buffers(self.module, self.ignore)

    def set_hook(self, state, hook, comm_hook_location=None):
        """torch's: hook(state, {name: buffer}) -> None or a list of futures (awaited at the end of the
        backward pass) runs instead of the buffers' broadcast, before the forward pass
        (_BufferCommHookLocation.PRE_FORWARD) or after it (POST_FORWARD, the default)."""
        if not callable(hook):
            raise TypeError("libddp.torch: the buffer communication hook must be callable")
        post = comm_hook_location is None or getattr(comm_hook_location, "name", str(comm_hook_location)).endswith(
            "POST_FORWARD")
        self.hook = (state, hook, post)

    @property
    def after_forward(self):
        """Whether a buffer comm hook runs after the forward pass (then nothing is broadcast before it)."""
        return self.hook is not None and self.hook[2]

    def broadcast(self, ddp, root, cuda_stream=None):
        """Copies `root`'s buffers (any dtype) to every rank over `ddp`. Collective."""
        broadcast_tensors(ddp, [b for _, b in self.named()], root, cuda_stream)

    def sync(self, ddp, root, cuda_stream=None):
        """The buffers' sync before a forward pass: `root`'s broadcast over `ddp`, or the hook when one is
        set."""
        if self.hook is None:
            self.broadcast(ddp, root, cuda_stream)
        else:
            self.run_hook()

    def run_hook(self):
        state, hook, _ = self.hook
        futs = hook(state, dict(self.named()))
        if futs:
            self.futures.extend(futs)

    def wait(self):
        """Awaits the futures of the buffer hook's runs (at the end of a backward pass, and before a forward)."""
        futs, self.futures = self.futures, []
        for f in futs:
            f.wait()
