"""DistributedDataParallel: torch's arguments, the libddp context it makes for the module (and remakes when
a setting changes), the forward pass, no_sync, the settings torch lets a user change after construction,
pickling and close. Each concern it delegates to a collaborator that holds its own state: GradStore and
Backward (the grads and the backward pass), CommHook, BufferSync, Join and ParamGather."""
import contextlib
import copy
import warnings

import torch

from .. import _lib as L
from ..core import DDP, Comm
from ..errors import UnsupportedError
from .backward import Backward
from .buffers import BufferSync
from .comm_hooks import CommHook, builtin_hook
from .grads import GradStore
from .join import Join
from .memory import broadcast_tensors, stream, to_device
from .model import checked_device_ids, refuse_sparse, synced_tensors, trainable, verify_same_model
from .sharded import ParamGather
from .world import check_world, default_comm, default_group, is_process_group

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
            elif is_process_group(comm):
                process_group, comm = comm, None
            else:
                raise TypeError("libddp.torch: comm must be a libddp.Comm, not %s" % type(comm).__name__)
        opts = dict(device_ids=device_ids, output_device=output_device, dim=dim, broadcast_buffers=broadcast_buffers,
                    process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                    find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
                    gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        if torch_args:  # torch's later positional arguments: output_device, dim, broadcast_buffers, ...
            if len(torch_args) > len(_TORCH_POSITIONAL):
                raise TypeError("libddp.torch: DistributedDataParallel takes at most %d positional arguments "
                                "(%d given)" % (2 + len(_TORCH_POSITIONAL), 2 + len(torch_args)))
            opts.update(zip(_TORCH_POSITIONAL, torch_args))
        process_group = opts.pop("process_group")
        if process_group is not None and not is_process_group(process_group):
            raise TypeError("libddp.torch: process_group must be a torch.distributed ProcessGroup, not %s"
                            % type(process_group).__name__)
        if opts.pop("check_reduction"):
            warnings.warn("The `check_reduction` argument of DistributedDataParallel is deprecated in torch and "
                          "ignored: a backward pass that leaves parameters without a grad is reported anyway")
        if opts.pop("gradient_as_bucket_view"):
            layout = "arena" if layout in (None, "copy") else layout
        opts.update(layout=layout or "copy", triggers=allreduce_trigger_params, config=dict(config))
        self._setup(module, comm, process_group, opts, broadcast_parameters)

    def _setup(self, module, comm, process_group, opts, broadcast):
        self._options = opts
        self.module = module
        self.dim = opts["dim"]
        self.parameters_to_ignore = list(getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ())
        ignore = set(self.parameters_to_ignore)
        self._params = trainable(module, ignore)
        kinds = sorted(set(p.device.type for p in self._params))
        if len(kinds) > 1:
            raise ValueError("libddp.torch: the module's parameters must all be on one type of device; they are "
                             "on %s" % ", ".join(kinds))
        self.device = self._params[0].device
        self.device_ids = checked_device_ids(self.device, opts["device_ids"], opts["output_device"])
        self.output_device = opts["output_device"]
        refuse_sparse(module, self._params)
        config = dict(opts["config"])
        if opts["bucket_cap_mb"] is not None and "message_size" not in config:
            config["message_size"] = max(1, int(opts["bucket_cap_mb"] * 1024 * 1024) // self._params[0].element_size())
        # torch's attribute: the group given, else the default group (the wrapper's comm spans its ranks).
        self.process_group = process_group if process_group is not None else default_group()
        self._own_comm = comm is None  # made here: closed with this wrapper
        self.comm = comm if comm is not None else default_comm(self.device, process_group)
        try:
            check_world(self.comm, process_group)
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
        self.gradient_as_bucket_view = layout in ("arena", L.DDP_LAYOUT_ARENA)
        config.setdefault("plan_order", "registration" if self.arena else "learned")
        config["layout"] = layout
        self._config = config  # the context's keywords (join() may change uneven_inputs)
        self.broadcast_buffers = bool(opts["broadcast_buffers"])
        self.require_backward_grad_sync = True
        self.num_iterations = 0  # torch's: training forward passes with sync on
        self._comm_hook = None  # a CommHook, once register_comm_hook was called
        self._buffer_sync = BufferSync(module, ignore)
        self._joiner = Join()
        self._backward = Backward(self._params, self.device, self._buffer_sync)
        self._gather = ParamGather(self.device)
        self._make_context(broadcast)

    @property
    def find_unused(self):
        """Whether the usage map is reduced with the grads: find_unused_parameters, or static_graph (which
        finds the unused parameters by itself, as torch's does)."""
        return self.find_unused_parameters or self.static_graph

    @property
    def arena(self):
        """Whether p.grad are views into the library's buckets (layout="arena")."""
        return self.gradient_as_bucket_view

    def _make_context(self, broadcast):
        """A new libddp context for the model: created, checked across ranks and (at construction) the
        model broadcast, the comm hook set, the grads registered (collective), the grad hooks installed."""
        self.ddp = DDP(self.comm, **self._config)
        if broadcast is not None:
            synced = synced_tensors(self.module, set(self.parameters_to_ignore))
            verify_same_model(self.ddp, self.comm.rank, synced)
            if broadcast:
                broadcast_tensors(self.ddp, [t for _, t in synced], 0, stream(self.device))
        base = 1 if self.find_unused else 0
        if self._comm_hook is not None:
            self._comm_hook.attach(self.ddp, self._params, base, self.device)
        store = GradStore(self.ddp, self.module, self._params, self.arena, self.find_unused, self._options["triggers"])
        self._backward.attach(store, self.static_graph, self._comm_hook)
        self._gather.attach(self.ddp)
        if self.sharded:
            self._gather.bind(self.module, self._params, base)

    def _rebuild(self):
        """A fresh context with the current settings (comm hook, static graph, uneven inputs), the grads as
        they are. Collective: every rank calls it at the same point."""
        if self._backward.in_backward:
            raise RuntimeError("libddp.torch: not between a forward pass and its backward pass")
        self._teardown()
        self._make_context(None)

    # -- settings torch lets a user change after construction ------------------------------------
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
        if self.ddp.stats.iterations or self._backward.in_backward:
            raise RuntimeError("libddp.torch: register the communication hook before the first backward pass")
        if self.sharded:
            raise UnsupportedError("libddp.torch: register_comm_hook is not available with shard=True (the library "
                                   "reduce-scatters sharded buckets itself)")
        self._comm_hook = CommHook(state, hook)
        try:
            self._rebuild()
        except Exception:
            self._comm_hook = None
            raise

    def _register_builtin_comm_hook(self, comm_hook_type):
        """dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS: torch's default hooks, over this comm."""
        self.register_comm_hook(None, builtin_hook(comm_hook_type))

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=None):
        self._buffer_sync.set_hook(state, hook, comm_hook_location)

    _register_buffer_comm_hook.__doc__ = BufferSync.set_hook.__doc__

    def _set_static_graph(self):
        """torch's: the graph is the same in every iteration. The first iteration learns how many times each
        grad hook runs (a parameter used twice, as under reentrant checkpointing, is ready after its last
        run) and which parameters are unused; call it before the first training forward pass with sync on
        (after it, RuntimeError with torch's message). Collective."""
        if self.static_graph:
            warnings.warn("libddp.torch: static_graph is set already")
            return
        if self.num_iterations or self.ddp.stats.iterations or self._backward.in_backward:
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

    # -- pickling --------------------------------------------------------------------------------
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
        buffers, backward = self._buffer_sync, self._backward
        if torch.is_grad_enabled():
            self._joiner.check_forward(self)
        buffers.wait()
        if self.device_ids:
            args, kwargs = to_device((args, kwargs), self.device_ids[0])
        training = torch.is_grad_enabled()
        if training and backward.stuck():
            raise RuntimeError("libddp.torch: the last backward pass handed grads to the library but never finished "
                               "(an exception inside it?): its iteration cannot complete, and this wrapper cannot go "
                               "on; make a new one (torch raises too: 'Expected to have finished reduction in the "
                               "prior iteration')")
        sync_buffers = self.broadcast_buffers and buffers.due and bool(buffers.named())
        if sync_buffers and not buffers.after_forward:
            root, ddp = self._joiner.buffer_source(self)
            buffers.sync(ddp, root, stream(self.device))
        if training:
            # torch decides at the forward pass whether the backward that follows is reduced; the library's
            # iteration begins with that backward (a forward without one, as in a validation pass with grad
            # enabled, leaves nothing begun).
            backward.next_sync = self.require_backward_grad_sync
            self.num_iterations += int(backward.next_sync)
        out = self.module(*args, **kwargs)
        self._gather.after_forward()
        if sync_buffers and buffers.after_forward:
            buffers.run_hook()
        # torch: buffers are synced before the next forward only after a training forward with sync on.
        buffers.due = training and backward.next_sync
        if training:
            backward.watch(out)
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
        return self._joiner.block(self, bool(divide_by_initial_world_size), bool(enable),
                                  bool(throw_on_early_termination))

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
        self._gather.launch()

    @property
    def stats(self):
        return self.ddp.stats

    @property
    def plan(self):
        return self.ddp.plan

    def _teardown(self):
        """Removes the hooks and destroys the context (arena grads are copied out to torch's own memory)."""
        self._backward.detach()
        self._gather.release()
        self.ddp.close()

    def close(self):
        """Removes the hooks and destroys the context (arena grads are copied out to torch's own memory), and
        the communicator when it was made here (no comm given). A wrapper that is dropped does this itself."""
        if "ddp" in self.__dict__:
            self._teardown()
        joiner = self.__dict__.get("_joiner")
        if joiner is not None:
            joiner.close()
        if self.__dict__.get("_own_comm") and "comm" in self.__dict__:
            self.comm.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)
