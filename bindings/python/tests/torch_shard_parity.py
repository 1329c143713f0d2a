"""Run under mpirun: trains the same models with libddp.torch sharded (DistributedDataParallel(shard=True)
and ShardedOptimizer) and with torch.nn.parallel.DistributedDataParallel (Gloo) plus the same torch
optimizer over the whole model, both clipping by the global grad norm, for 10 steps; the parameters must
agree within 1e-6 (relative to each tensor's largest value). Also checks that the sharded optimizer's
state is about 1/world of the unsharded one. Needs MASTER_PORT. Exits 1 on a failure."""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

import libddp
import libddp.torch as ltorch

STEPS = 10
TOL = 1e-6
MAX_NORM = 0.5
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
torch.set_num_threads(1)
comm = libddp.Comm.mpi()


class Net(torch.nn.Module):
    """A convolution, tied embedding and output weights, BatchNorm buffers, a frozen layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        # No bias before BatchNorm (as usual): its grad would be rounding noise around 0, which Adam
        # turns into steps of +-lr, so that the 1e-7 difference of the two clip coefficients (our norm is
        # summed in float64, torch's in float32) would decide their sign.
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm1d(8)
        self.fc = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(8, 13, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens).transpose(1, 2)           # (batch, 8, length)
        h = torch.tanh(self.norm(self.conv(h))).mean(2)
        return self.out(torch.relu(self.fc(h)) + 0.1 * self.frozen(h))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
               and t.dim() > 0)


def run(opt_name, message_size, streams):
    torch.manual_seed(0)
    ref_model = Net()
    our_model = copy.deepcopy(ref_model)
    our_model.out.weight = our_model.emb.weight
    for m in (ref_model, our_model):
        m.norm.running_mean.add_(float(rank))  # only the broadcasts make them agree
    ref = torch.nn.parallel.DistributedDataParallel(ref_model)
    ours = ltorch.DistributedDataParallel(our_model, comm, shard=True, message_size=message_size,
                                          num_streams=streams)
    make, kw = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                "adam": (torch.optim.Adam, {"lr": 0.01}),
                "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}[opt_name]
    opt_ref = make(ref.parameters(), **kw)
    opt_ours = ltorch.ShardedOptimizer(ours, make, max_grad_norm=MAX_NORM, **kw)
    norm_diff = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(11 * step + rank)
        tokens, target = torch.randint(0, 13, (6, 5), generator=g), torch.randn(6, 13, generator=g)
        for model, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            torch.nn.functional.mse_loss(model(tokens), target).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        opt_ref.step()
        our_norm = opt_ours.step()
        norm_diff = max(norm_diff, abs(our_norm - ref_norm) / ref_norm)
    ours.ddp.wait_params(-1)  # the last gather (a forward pass would wait for it too)
    pdiff = max(rel(a.data, b.data) for a, b in zip(our_model.parameters(), ref_model.parameters()))
    bdiff = max(rel(a.float(), b.float()) for a, b in zip(our_model.buffers(), ref_model.buffers()))
    full, mine = state_bytes(opt_ref), state_bytes(opt_ours.optimizer)
    ours.close()
    return {"opt": opt_name, "message_size": message_size, "streams": streams, "max_rel_param": pdiff,
            "max_rel_buffer": bdiff, "max_rel_norm": norm_diff, "state_bytes": mine, "unsharded_state_bytes": full}


results = [run(o, m, s) for o, m, s in [a.split(":") and (a.split(":")[0], int(a.split(":")[1]), int(a.split(":")[2])) for a in os.environ.get("SHARD_CASES", "sgd:100:1,adam:300:2,adamw:10000000:1").split(",")]]
ok = all(r["max_rel_param"] <= TOL and r["max_rel_buffer"] <= TOL and r["max_rel_norm"] <= 1e-6 for r in results)
# momentum/Adam state: 1/world of the model's (plus the shards' padding, at most 256 bytes a bucket per state)
ok = ok and all(r["state_bytes"] * world <= r["unsharded_state_bytes"] + world * 2 * 256 * 16 for r in results)
print("rank %d: %s" % (rank, json.dumps(results)), flush=True)
comm.close()
dist.destroy_process_group()
print("rank %d: sharded parity %s" % (rank, "ok" if ok else "FAILED"), flush=True)
sys.exit(0 if ok else 1)
