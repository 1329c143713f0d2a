"""The job a wrapper reduces over: the launcher's world (torch.distributed, torchrun's environment, MPI),
torch process groups, the communicator made for them (default_comm), and the check that a process never
trains alone in a job of more."""
import os
import socket

import torch

from ..core import Comm
from ..errors import InvalidStateError, UnsupportedError

# Where a launcher says how many processes it started: torchrun, Open MPI, MPICH / Intel MPI.
_LAUNCHER_WORLD = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_HOW_TO_LAUNCH = ("start every process with torchrun (python -m torch.distributed.run --nproc_per_node N "
                  "train.py) or mpirun -np N, and call torch.distributed.init_process_group() before wrapping "
                  "the model, or pass comm=libddp.Comm.gloo() (env://) / Comm.mpi()")


def launched_world():
    """(size, where it was read) of the job this process belongs to, as far as anyone knows: torch.distributed's
    world when it is initialized, else the launcher's environment; (1, None) for a lone process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "torch.distributed"
    for var in _LAUNCHER_WORLD:
        try:
            n = int(os.environ.get(var, "1"))
        except ValueError:
            continue
        if n > 1:
            return n, var
    return 1, None


def _store_address():
    """The host the other ranks reach rank 0 at: MASTER_ADDR, else the default store's host, else this
    host's name."""
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    try:
        host = torch.distributed.distributed_c10d._get_default_store().host
        if host:
            return host
    except Exception:
        pass
    return socket.getfqdn()


def _free_port(host):
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


def _torch_gloo(dist, group=None):
    """A Gloo comm over torch.distributed's world (or `group`'s members): the group's first rank picks a
    free port of its own, the address travels over torch.distributed, the ranks meet there (tcp://)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return Comm.self()
    box = [None]
    if me == 0:
        host = _store_address()
        box[0] = "tcp://%s:%d" % (host, _free_port(host))
    dist.broadcast_object_list(box, src=_group_root(dist, group), group=group)
    return Comm.gloo(box[0], me, size)


def _group_root(dist, group):
    """The global rank of `group`'s rank 0."""
    if group is None:
        return 0
    return dist.distributed_c10d._get_global_rank(group, 0)


def default_comm(device, process_group=None):
    """The communicator for parameters on `device`, over the job this process was launched in:
    - torch.distributed initialized (torchrun, any launcher): its world. CPU memory: a Gloo comm of
      libddp's own whose address travels over torch.distributed; CUDA memory: NCCL, rank 0's id
      broadcast over torch.distributed.
    - else RANK/WORLD_SIZE/MASTER_ADDR set (torchrun without init_process_group): Gloo (CPU) or NCCL
      with its id sent over Gloo (CUDA), env://.
    - else MPI (CPU) or NCCL with its id sent over MPI (CUDA); one lone process in a build without MPI
      gets Comm.self().
    - process_group (a torch.distributed group): a comm of that group's members, as above.
    Never a world of one in a job of more (see DistributedDataParallel)."""
    dist = torch.distributed
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    if process_group is not None and not (dist.is_available() and dist.is_initialized()):
        raise InvalidStateError("libddp.torch: process_group given but torch.distributed is not initialized")
    if dist.is_available() and dist.is_initialized():
        if not cuda:
            return _torch_gloo(dist, process_group)
        g = process_group
        box = [bytes(Comm.nccl_unique_id()) if dist.get_rank(g) == 0 else None]
        dist.broadcast_object_list(box, src=_group_root(dist, g), group=g)
        return Comm.nccl(box[0], dist.get_world_size(g), dist.get_rank(g), index)
    if all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return Comm.nccl_store("env://", device=index) if cuda else Comm.gloo("env://")
    if cuda:
        return Comm.nccl_mpi(index)
    try:
        return Comm.mpi()
    except UnsupportedError:
        if launched_world()[0] > 1:
            raise
        return Comm.self()


def check_world(comm, process_group=None):
    """Raises when `comm` leaves this process alone (or in a smaller world) in a job of more processes:
    training alone silently is the one failure a DDP wrapper must never have. With a process group, the
    comm must have the group's size."""
    if process_group is not None:
        n, where = torch.distributed.get_world_size(process_group), "process_group"
    else:
        n, where = launched_world()
    size = comm.size
    if n > 1 and size != n:
        raise InvalidStateError(
            "libddp.torch: this process is rank %d of %d in libddp's communicator, but %s says the job has %d "
            "processes: the model would %s. To train together, %s."
            % (comm.rank, size, where, n, "train alone" if size == 1 else "train in a different world",
               _HOW_TO_LAUNCH))


def default_group():
    """torch's process_group attribute when none is given: the default group, if torch.distributed is
    initialized."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def is_process_group(obj):
    dist = torch.distributed
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)
