"""libddp.torch: DistributedDataParallel for torch.nn.Module over libddp (the only part of libddp that imports torch).

    import libddp.torch
    model = libddp.torch.DistributedDataParallel(model)          # the job's world: torchrun or mpirun
    loss = model(x).sum(); loss.backward()                        # grads reduced when backward returns

As apex does, it hooks each parameter's grad accumulator: when the accumulator has run, the grad is
final for this backward pass and is handed to ddp_grad_ready; a callback queued on the autograd engine
calls ddp_finish_backward before backward() returns.

Where torch.nn.parallel.DistributedDataParallel defines a behaviour, this module follows it:
- find_unused_parameters=True: a parameter that no rank used keeps its .grad untouched (None after
  zero_grad(set_to_none=True), so optimizers skip it); one unused on some ranks only gets the reduced
  value on every rank, the unused ranks contributing their current .grad (zeros if None). As torch does,
  the ranks learn which parameters were used anywhere by reducing a usage map with the grads.
- broadcast_buffers=True (the default): rank 0's buffers (BatchNorm statistics, any dtype) are copied to
  every rank at the start of every forward pass that follows a synced training forward, and at the first.
  Once join() was used, they come from the highest rank that still has data instead (torch's
  authoritative rank), and ranks that have joined take part in that copy.
- no_sync(): grads accumulate locally; the next synced pass reduces the sum. As in torch, "used" means used
  in that synced pass: a parameter used only in the no_sync passes and by no rank in the synced one keeps
  its local, unreduced .grad.
- join() with find_unused_parameters=True: a joined rank reports no parameter as used while it shadows the
  others' iterations. torch's sends the stale usage map of its last reduction, so its results differ there
  (docs/bindings.md, "From torch DDP").

Sharded (ZeRO-1/2, Megatron's distributed optimizer): DistributedDataParallel(model, shard=True) keeps
the parameters in the library's parameter arena (p.data become views) and reduce-scatters the grads;
ShardedOptimizer(model, torch.optim.Adam, lr=...) runs any elementwise torch optimizer over this rank's
flat shards only (its state is 1/world of the model), clips by the global norm if asked, and gathers
the parameters, which the next forward pass waits for layer by layer.

The public names are those below; the modules of this package each hold one part of the wrapper:
wrapper (DistributedDataParallel: construction, forward, no_sync, settings, pickling, close), world
(launchers, process groups, default_comm), model (which tensors are reduced and broadcast, the checks on
them, parameter names in errors), grads (one context's grads and their storage), backward (the grad
hooks and the library's iteration), comm_hooks, buffers (broadcast_buffers), join (uneven inputs and the
buffers' authoritative rank), sharded (the parameter arena and ShardedOptimizer), memory (tensors over
the library's memory, byte-wise broadcasts).
"""
from .comm_hooks import GradBucket
from .sharded import ShardedOptimizer
from .world import default_comm
from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket", "ShardedOptimizer", "default_comm"]
