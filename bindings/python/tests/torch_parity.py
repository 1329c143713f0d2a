"""Trains the same small model with libddp.torch.DistributedDataParallel and with
torch.nn.parallel.DistributedDataParallel (Gloo over loopback) side by side and compares the grads at
every step. Prints the largest relative difference per setting and exits 1 when one exceeds 1e-6.
Two ways to start it:
- under mpirun (needs MASTER_PORT): libddp over Comm.mpi();
- under torchrun (or its environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), no MPI at all:
  libddp.torch picks its communicator itself (no comm given: Gloo over torch.distributed's world)."""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

import libddp
import libddp.torch as ltorch

STEPS = 5
TOL = 1e-6
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
UNDER_MPI = "OMPI_COMM_WORLD_RANK" in os.environ
if UNDER_MPI:
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    comm = libddp.Comm.mpi()
    assert comm.rank == rank and comm.size == world
else:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = None  # each wrapper makes (and closes) its own: default_comm over torch.distributed
torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 14, 32)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x):
        x = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + rank)  # different data per rank and step
    return torch.randn(8, 2, 16, generator=g), torch.randn(8, 5, generator=g)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(layout, predivide, set_to_none, plan_order=None):
    torch.manual_seed(0)
    ref_model = Net()
    our_model = copy.deepcopy(ref_model)
    ref = torch.nn.parallel.DistributedDataParallel(ref_model)
    extra = {"plan_order": plan_order} if plan_order else {}
    ours = ltorch.DistributedDataParallel(our_model, comm, layout=layout, message_size=300,
                                          gradient_predivide_factor=predivide, **extra)
    assert ours.comm.rank == rank and ours.comm.size == world, ours.comm
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    worst, local_diff = 0.0, 0.0
    for step in range(STEPS):
        x, y = batch(step)
        for model, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=set_to_none)
            torch.nn.functional.mse_loss(model(x), y).backward()
        # a local (unreduced) grad, to show that reduction did happen
        local = copy.deepcopy(ref_model)
        local.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        for pr, po, pl in zip(ref_model.parameters(), our_model.parameters(), local.parameters()):
            worst = max(worst, rel(po.grad, pr.grad))
            local_diff = max(local_diff, rel(pl.grad, pr.grad))
        opt_ref.step()
        opt_ours.step()
    pdiff = max(rel(a.data, b.data) for a, b in zip(our_model.parameters(), ref_model.parameters()))
    buckets = len(ours.plan.buckets)
    iters = ours.stats.iterations
    ours.close()
    return {"layout": layout, "plan": plan_order or "default", "predivide": predivide, "set_to_none": set_to_none, "max_rel_grad": worst,
            "max_rel_param": pdiff, "local_vs_reduced": local_diff, "buckets": buckets, "iterations": iters}


class RealNet(torch.nn.Module):
    """What real models have: tied weights (embedding and output), BatchNorm buffers, a branch no rank
    uses, a branch only rank 0 uses, and one used every other step."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.hidden = torch.nn.Linear(6, 6)
        self.never = torch.nn.Linear(6, 6)       # used by no rank
        self.rank0_only = torch.nn.Linear(6, 6)  # used by rank 0 alone
        self.odd_steps = torch.nn.Linear(6, 6)   # used on odd steps
        self.frozen = torch.nn.Linear(6, 6)      # requires_grad False: not reduced, never moves
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight        # tied

    def forward(self, tokens, step):
        h = self.norm(self.emb(tokens))
        h = torch.tanh(self.hidden(h)) + 0.1 * self.frozen(h)
        if rank == 0:
            h = h + self.rank0_only(h)
        if step % 2:
            h = h + self.odd_steps(h)
        return self.out(h)


def run_real(layout, set_to_none, opt_name, plan_order=None):
    torch.manual_seed(0)
    ref_model = RealNet()
    our_model = copy.deepcopy(ref_model)
    our_model.out.weight = our_model.emb.weight
    # rank-dependent buffers before the first step: only the broadcasts make them agree
    for m in (ref_model, our_model):
        m.norm.running_mean.add_(float(rank))
    ref = torch.nn.parallel.DistributedDataParallel(ref_model, find_unused_parameters=True)
    extra = {"plan_order": plan_order} if plan_order else {}
    ours = ltorch.DistributedDataParallel(our_model, comm, layout=layout, message_size=50,
                                          find_unused_parameters=True, **extra)
    make = {"adam": lambda p: torch.optim.Adam(p, lr=0.01),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)}[opt_name]
    opt_ref, opt_ours = make(ref.parameters()), make(ours.parameters())
    worst = 0.0
    for step in range(REAL_STEPS):
        g = torch.Generator().manual_seed(7 * step + rank)
        tokens, target = torch.randint(0, 11, (8,), generator=g), torch.randn(8, 11, generator=g)
        for model, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=set_to_none)
            if step == 3:  # gradient accumulation: a micro-batch under no_sync, then a synced one
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(tokens[:4], step), target[:4]).backward()
                # odd_steps: used in the no_sync micro-batch only: torch keeps its local grad
                torch.nn.functional.mse_loss(model(tokens[4:], step + 1), target[4:]).backward()
            elif step == 1:  # the forward decides: its backward after the no_sync block stays local
                with model.no_sync():
                    out = model(tokens[:4], step)
                torch.nn.functional.mse_loss(out, target[:4]).backward()
                torch.nn.functional.mse_loss(model(tokens[4:], step), target[4:]).backward()
            elif step == 5:  # a forward dropped (grad enabled); no_sync entered after the forward: reduced
                model(tokens, step)
                out = model(tokens, step)
                with model.no_sync():
                    torch.nn.functional.mse_loss(out, target).backward()
            else:
                torch.nn.functional.mse_loss(model(tokens, step), target).backward()
        for (name, pr), po in zip(ref_model.named_parameters(), our_model.parameters()):
            if (pr.grad is None) != (po.grad is None):
                print("rank %d: %s %s: grad is None in one model only (step %d; torch: %s)" % (rank, layout, name, step, "None" if pr.grad is None else "set"), flush=True)
                worst = float("inf")
            elif pr.grad is not None:
                r = rel(po.grad, pr.grad)
                worst = max(worst, r)
                if r > TOL and os.environ.get("PARITY_DEBUG"):
                    print("rank %d: %s %s: grad off by %g (step %d)" % (rank, layout, name, r, step), flush=True)
        opt_ref.step()
        opt_ours.step()
    pdiff = max(rel(a.data, b.data) for a, b in zip(our_model.parameters(), ref_model.parameters()))
    bdiff = max(rel(a.float(), b.float()) for a, b in zip(our_model.buffers(), ref_model.buffers()))
    never_moved = torch.equal(our_model.never.weight, ref_model.never.weight)
    iters = ours.stats.iterations
    ours.close()
    return {"layout": layout, "plan": plan_order or "default", "set_to_none": set_to_none, "opt": opt_name,
            "max_rel_grad": worst, "max_rel_param": pdiff, "max_rel_buffer": bdiff, "never_moved": never_moved,
            "iterations": iters}


REAL_STEPS = 6
real = [run_real(layout, stn, opt) for layout in ("copy", "arena") for stn, opt in ((True, "adam"), (False, "sgd"))]
real.append(run_real("arena", True, "adam", "learned"))
real.append(run_real("copy", True, "adam", "registration"))
real_ok = all(r["max_rel_grad"] <= TOL and r["max_rel_param"] <= TOL and r["max_rel_buffer"] <= TOL
              and r["never_moved"] and r["iterations"] == REAL_STEPS for r in real)
print("rank %d: real models: %s" % (rank, json.dumps(real)), flush=True)

results = [run(layout, f, stn) for layout in ("copy", "arena") for f, stn in ((1.0, True), (float(world), False))]
results.append(run("arena", float(world), True, "learned"))  # the arena moves once, after the first backward
ok = all(r["max_rel_grad"] <= TOL and r["max_rel_param"] <= TOL and r["iterations"] == STEPS
         and (world == 1 or r["local_vs_reduced"] > 1e-3) and r["buckets"] >= 2 for r in results) and real_ok
print("rank %d: %s" % (rank, json.dumps(results)), flush=True)
if comm is not None:
    comm.close()
dist.destroy_process_group()
print("rank %d: parity %s" % (rank, "ok" if ok else "FAILED"), flush=True)
sys.exit(0 if ok else 1)
