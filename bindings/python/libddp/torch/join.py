"""Uneven inputs (torch's `with model.join():`): a rank out of batches shadows the others' iterations
(ddp_join) and, when every rank is done, all take the model of the rank that ran the most iterations.
Join also decides the buffers' authoritative rank: rank 0, and once join() was used the highest rank that
still has data; inside a block that broadcasts buffers, the joined ranks answer those broadcasts over a
second context of their own while a thread runs ddp_join."""
import contextlib
import threading

import torch

from .. import _lib as L
from ..core import _ENUMS, DDP
from .memory import broadcast_tensors, stream


def common_rank(ddp, rank, candidate):
    """torch's _find_common_rank: the highest rank that is a candidate, -1 if none is. Collective."""
    import numpy as np

    return int(ddp.allreduce_host(np.array([rank if candidate else -1], np.int64), "max")[0])


def check_no_rank_finished(ddp, rank, finished):
    """join(throw_on_early_termination=True): one allreduce per forward; a rank out of data sends 1."""
    import numpy as np

    flag = ddp.allreduce_host(np.array([finished], np.int32), "sum")
    if flag[0]:
        raise RuntimeError("libddp.torch: rank %d: %s" % (rank, "exhausted all inputs" if finished else
                           "a rank exhausted all its inputs (join(throw_on_early_termination=True))"))


def uneven_mode(config):
    """The uneven_inputs mode (its library value) of a context made with `config`."""
    uneven = config.get("uneven_inputs", "off")
    return _ENUMS["uneven_inputs"].get(uneven, uneven)


class Join:
    """A wrapper's join() blocks and what they leave behind."""

    def __init__(self):
        self.enabled = False  # join() was used: buffers come from the highest rank with data, as torch's
        self.early_exit_check = False  # inside join(throw_on_early_termination=True)
        self.side = None  # the context of the buffers' broadcasts inside join() (made at the first)
        self.block_side = None  # that context while inside a join() block that broadcasts buffers

    def buffer_source(self, model):
        """(root, context) of the buffers' sync before a forward pass: torch's source, rank 0 or, once join()
        was used, the highest rank that still has data (its _find_common_rank): inside a join() block,
        found by one small allreduce over the buffers' own context, in which ranks that have joined send
        -1 (see shadow); outside one every rank has data, so the highest rank."""
        side = self.block_side
        if side is not None:
            return common_rank(side, model.comm.rank, True), side
        return (model.comm.size - 1 if self.enabled else 0), model.ddp

    def check_forward(self, model):
        """Before a training forward inside join(throw_on_early_termination=True)."""
        if self.early_exit_check:
            check_no_rank_finished(model.ddp, model.comm.rank, 0)

    @contextlib.contextmanager
    def block(self, model, by_world, enable, throw):
        """The body of DistributedDataParallel.join() (whose docstring says what it does)."""
        self.enabled = enable  # torch keeps its join config after the block: the buffers' source
        if not enable:
            yield model
            return
        if throw:
            self.early_exit_check = True
            try:
                yield model
            finally:
                self.early_exit_check = False
            check_no_rank_finished(model.ddp, model.comm.rank, 1)
            return
        want = L.DDP_UNEVEN_BY_WORLD if by_world else L.DDP_UNEVEN_BY_CONTRIBUTORS
        if uneven_mode(model._config) != want:
            old = model._config.get("uneven_inputs")
            model._config["uneven_inputs"] = want
            try:
                model._rebuild()
            except Exception:
                model._config["uneven_inputs"] = old
                raise
        side = None
        buffers = model._buffer_sync
        if model.broadcast_buffers and buffers.named() and not buffers.after_forward:
            if self.side is None:  # collective: every rank enters the block
                self.side = DDP(model.comm, **{k: v for k, v in model._config.items() if k == "timeout_ms"})
            side = self.block_side = self.side
        try:
            yield model  # an exception in the block propagates: no join (the other ranks time out, as in torch)
        finally:
            self.block_side = None
        ran = model.ddp.stats.iterations  # this rank's synced iterations: who ran the most decides below
        self.shadow(model, side)
        self._final_sync(model, ran)

    @staticmethod
    def _final_sync(model, ran):
        """torch's final sync: the last rank to join (the most iterations; ties: the highest rank) is the
        authoritative model copy. Whether the next forward broadcasts buffers is that rank's say too (a
        joined rank's own last forward may have been under no_sync)."""
        import numpy as np

        world, buffers = model.comm.size, model._buffer_sync
        key = model.ddp.allreduce_host(np.array([(ran * world + model.comm.rank) * 2 + int(buffers.due)],
                                                np.int64), "max")
        root = int(key[0] // 2 % world)
        buffers.due = bool(key[0] % 2)
        cuda_stream = stream(model.device)
        broadcast_tensors(model.ddp, model._params, root, cuda_stream)
        buffers.broadcast(model.ddp, root, cuda_stream)

    @staticmethod
    def shadow(model, side=None):
        """ddp_join: the others' remaining iterations reduce zeros from this rank and write their result
        into its grads (copy layout: scratch grads of its own, GradStore.lend_scratch).
        side: the others' forward passes broadcast buffers over that context (torch's joined ranks
        shadow those broadcasts too): a thread runs ddp_join while this one answers each broadcast, until
        every rank has left its block (none is a candidate for the source any more)."""
        model._backward.store.lend_scratch()
        if side is None:
            model.ddp.join()
            return
        failed = []

        def run():
            try:
                with torch.cuda.device(model.device) if model.device.type == "cuda" else contextlib.nullcontext():
                    model.ddp.join()
            except BaseException as e:  # raised on the caller's thread below
                failed.append(e)
        thread = threading.Thread(target=run, name="libddp-join", daemon=True)
        thread.start()
        try:
            buffers, cuda_stream = model._buffer_sync, stream(model.device)
            while True:
                root = common_rank(side, model.comm.rank, False)
                if root < 0:
                    break
                buffers.sync(side, root, cuda_stream)
        finally:
            thread.join()  # the context must outlive ddp_join (bounded by timeout_ms)
        if failed:
            raise failed[0]

    def close(self):
        if self.side is not None:
            self.side.close()
            self.side = None
