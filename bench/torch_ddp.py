#!/usr/bin/python3
"""PyTorch DDP (Gloo, CPU) on the same work as `ddp_bench lastready`: the same gradient sizes, the same
world size, the same bucket size (torch's default bucket_cap_mb = 25), each grad written by backward
(one pass over its memory) and handed to DDP in reverse registration order. Measured: the time from
the last grad becoming ready (a tensor hook, which fires as the grad is produced) to loss.backward()
returning, when DDP's final callback has waited for every bucket's allreduce. Slowest rank, median.

Usage: torch_ddp.py run OUTDIR WORLD SIZES_FILE   (loopback 127.0.0.1 only): writes lastready_torch.json
                                                  and prints "pace <copy ms> <arena ms>" for libddp's matched runs
       torch_ddp.py report OUTDIR                  table 4 from both JSON files; writes pytorch.json
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPS = 9


class ChainModel(torch.nn.Module):
    """Parameters of the given sizes and a forward that chains them, so that backward produces the grads
    from the last parameter to the first, each as one elementwise pass (grad = c). Horovod's bench
    (bench/horovod_bench.py) runs the same model."""

    def __init__(self, sizes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])

    def forward(self, c):
        x = None
        for p in self.ps:
            t = (p * c).sum()
            x = t if x is None else x + t
        return x


def keep_and_check(r, t, tails, steps, model, world):
    """Iteration r's slowest-rank times t (seconds: the tail, the whole backward) kept past the two
    warm-ups, in ms; and the first grad checked to be the average of every rank's c = 0.5 + rank + r."""
    if r >= 2:
        tails.append(t[0].item() * 1e3)
        steps.append(t[1].item() * 1e3)
    want = sum(0.5 + k + r for k in range(world)) / world
    got = model.ps[0].grad[0].item()
    assert abs(got - want) < 1e-4, (got, want)


def run(rank, world, sizes, port, as_view, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    model = ChainModel(sizes)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    stamps = {}
    for i, p in enumerate(model.ps):
        p.register_hook(lambda g, i=i: stamps.__setitem__(i, time.perf_counter()) or g)
    tails, steps = [], []
    for r in range(REPS + 2):  # two warm-ups: DDP rebuilds its buckets after the first iteration
        c = torch.tensor(0.5 + rank + r)
        loss = ddp(c)
        stamps.clear()
        dist.barrier()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        t = torch.tensor([t1 - max(stamps.values()), t1 - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        keep_and_check(r, t, tails, steps, model, world)
        for p in model.ps:
            p.grad = None if not as_view else p.grad.zero_()
    if rank == 0:
        queue.put((tails, steps))
    dist.destroy_process_group()


def measure(world, sizes, port, as_view):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, world, sizes, port, as_view, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"a torch rank failed (exit {p.exitcode})")
    return res


def run_torch(out, world, sizes_file):
    sizes = [int(x) for x in open(sizes_file).read().split()]
    port = 29500 + os.getpid() % 1000
    runs = {}
    for name, as_view in (("torch DDP", False), ("torch DDP gradient_as_bucket_view", True)):
        tails, steps = measure(world, sizes, port, as_view)
        port += 1
        runs[name] = {"tail_ms": tails, "step_ms": steps,
                      "ready_ms": statistics.median(s - t for s, t in zip(steps, tails))}
        print(f"{name}: last ready -> reduced {statistics.median(tails):.1f} ms, whole backward "
              f"{statistics.median(steps):.1f} ms (median of {REPS})")
    with open(os.path.join(out, "lastready_torch.json"), "w") as f:
        json.dump({"bench": "lastready_torch", "world": world, "torch": torch.__version__, "grads": len(sizes),
                   "numel": sum(sizes), "loadavg": open("/proc/loadavg").read().strip(), "runs": runs}, f, indent=1)
    # The paces for the matched libddp runs: torch's time from backward start to its last grad ready.
    print(f"pace {runs['torch DDP']['ready_ms']:.3f} {runs['torch DDP gradient_as_bucket_view']['ready_ms']:.3f}")


def report(out):
    theirs = json.load(open(os.path.join(out, "lastready_torch.json")))
    ours = json.load(open(os.path.join(out, "lastready_libddp.json")))
    runs = theirs["runs"]
    med = statistics.median
    print(f"\n## 4. against PyTorch {theirs['torch']} DDP (Gloo, CPU, loopback): {theirs['world']} ranks, "
          f"{theirs['grads']} f32 grads, {theirs['numel'] / 1e6:.1f}M elements, 25 MB buckets\n")
    print(f"time from the last grad ready to all grads reduced (tail); median of {REPS}, slowest rank. 'as fast as "
          "written': each grad written once then marked ready; 'paced to torch': the same, with busy CPU work so that the "
          "last grad is ready as late as in torch's backward\n")
    print("| libddp run | backward to last ready ms | tail ms | whole backward ms | PyTorch run | backward to last ready ms "
          "| tail ms | whole backward ms | ours over theirs (tail) | ours over theirs (whole) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    table = []
    for r in ours["runs"]:
        tname = "torch DDP" if r["layout"] == "copy" else "torch DDP gradient_as_bucket_view"
        t = runs[tname]
        a, b = med(r["tail_ms"]), med(t["tail_ms"])
        wa, wb = med(r["step_ms"]), med(t["step_ms"])
        label = f"{r['layout']}, " + ("paced to torch" if r["pace_ms"] > 0 else "as fast as written")
        print(f"| {label} | {med(r['ready_ms']):.0f} | {a:.1f} | {wa:.1f} | {tname} | {t['ready_ms']:.0f} | {b:.1f} | "
              f"{wb:.1f} | {a / b:.3f} | {wa / wb:.3f} |")
        table.append({"libddp": label, "torch": tname, "ours_tail_ms": a, "theirs_tail_ms": b, "ratio": a / b,
                      "ours_whole_ms": wa, "theirs_whole_ms": wb, "whole_ratio": wa / wb,
                      "ours_ready_ms": med(r["ready_ms"]), "theirs_ready_ms": t["ready_ms"]})
    paced = [t["ratio"] for t in table if "paced" in t["libddp"]] or [t["ratio"] for t in table]
    fast = [t["whole_ratio"] for t in table if "paced" not in t["libddp"]] or [t["whole_ratio"] for t in table]
    worst, worst_whole = max(paced), max(fast)
    print(f"\ntargets against PyTorch DDP: paced, tail <= 0.80x torch's: worst {worst:.3f} "
          f"{'met' if worst <= 0.80 else 'MISSED'}; as fast as written, whole backward <= torch's: worst "
          f"{worst_whole:.3f} {'met' if worst_whole <= 1.0 else 'MISSED'}")
    horovod = report_horovod(out, ours)
    with open(os.path.join(out, "pytorch.json"), "w") as f:
        json.dump({"bench": "pytorch", "torch": theirs, "libddp": ours, "table": table, "horovod": horovod}, f,
                  indent=1)


def report_horovod(out, ours):
    """Horovod's run (bench/horovod_bench.py), against libddp's copy layout (Horovod copies every grad into
    its fusion buffer): the tail against libddp paced to torch (Horovod's backward is torch's autograd),
    the whole backward against libddp as fast as written. None when Horovod did not run."""
    path = os.path.join(out, "lastready_horovod.json")
    if not os.path.exists(path):
        return None
    h = json.load(open(path))
    run = h["runs"]["Horovod"]
    med = statistics.median
    copy = {("paced" if r["pace_ms"] > 0 else "fast"): r for r in ours["runs"] if r["layout"] == "copy"}
    tail, whole = med(run["tail_ms"]), med(run["step_ms"])
    paced_tail = med(copy["paced"]["tail_ms"]) if "paced" in copy else med(copy["fast"]["tail_ms"])
    fast_whole = med(copy["fast"]["step_ms"])
    print(f"\nagainst Horovod {h['horovod']} (PyTorch frontend, CPU, started by mpirun, {h['controller'].upper()} "
          f"controller, fusion buffers of {h['fusion_threshold_bytes'] / 2**20:.0f} MiB): the same grads, "
          f"hvd.DistributedOptimizer's hooks, the time to optimizer.synchronize()\n")
    print("| Horovod | backward to last ready ms | tail ms | whole backward ms | libddp copy, paced: tail ms "
          "| ours over theirs (tail) | libddp copy, as fast as written: whole ms | ours over theirs (whole) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| hvd.DistributedOptimizer | {run['ready_ms']:.0f} | {tail:.1f} | {whole:.1f} | {paced_tail:.1f} | "
          f"{paced_tail / tail:.3f} | {fast_whole:.1f} | {fast_whole / whole:.3f} |")
    return {"horovod": h, "tail_ms": tail, "whole_ms": whole, "libddp_paced_tail_ms": paced_tail,
            "tail_ratio": paced_tail / tail, "libddp_fast_whole_ms": fast_whole, "whole_ratio": fast_whole / whole}


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run_torch(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "report":
        report(sys.argv[2])
    else:
        raise SystemExit("usage: torch_ddp.py run OUTDIR WORLD SIZES_FILE | report OUTDIR")
