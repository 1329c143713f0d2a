"""The world of the torch scripts run under mpirun: torch.distributed over Gloo (torch's DDP, the
reference) and a libddp comm over MPI, the same ranks."""
import os

import torch
import torch.distributed as dist

import libddp


def init():
    """(rank, world, comm) of this process; torch.distributed initialized."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    torch.set_num_threads(1)
    return rank, world, libddp.Comm.mpi()
