#!/usr/bin/python3
"""Horovod (PyTorch frontend, CPU) on the same work as `ddp_bench lastready` and bench/torch_ddp.py: the
same gradient sizes and world size, each grad written by backward (one pass over its memory) and handed
to Horovod in reverse registration order by hvd.DistributedOptimizer's hooks, fused into buffers of
25 MB (HOROVOD_FUSION_THRESHOLD, the bucket size of the other two; Horovod's default is 128 MB).
Measured: the time from the last grad becoming ready (a tensor hook) to optimizer.synchronize()
returning, when every allreduce is done and averaged. Slowest rank, median.

Usage (one process per rank, started by mpirun; Horovod's controller and its CPU operations then run
over the same MPI as libddp's):
       mpirun -np WORLD -x PYTHONPATH /usr/bin/python3 horovod_bench.py OUTDIR SIZES_FILE
writes OUTDIR/lastready_horovod.json. bench/torch_ddp.py report puts it beside the other two.
"""
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(25 * 1024 * 1024))
import torch  # noqa: E402
import horovod  # noqa: E402
import horovod.torch as hvd  # noqa: E402

from torch_ddp import ChainModel, keep_and_check  # noqa: E402  (this directory: as for torch DDP)

REPS = 9


def main(out, sizes_file):
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    sizes = [int(x) for x in open(sizes_file).read().split()]

    model = ChainModel(sizes)  # the model of bench/torch_ddp.py
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), op=hvd.Average)
    stamps = {}
    for i, p in enumerate(model.ps):
        p.register_hook(lambda g, i=i: stamps.__setitem__(i, time.perf_counter()) or g)
    tails, steps = [], []
    for r in range(REPS + 2):  # two warm-ups, as for torch DDP
        opt.zero_grad()
        c = torch.tensor(0.5 + rank + r)
        loss = model(c)
        stamps.clear()
        hvd.allreduce(torch.zeros(1), name=f"barrier.{r}")  # the ranks start the backward together
        t0 = time.perf_counter()
        loss.backward()
        opt.synchronize()
        t1 = time.perf_counter()
        t = torch.tensor([t1 - max(stamps.values()), t1 - t0], dtype=torch.float64)
        t = hvd.allreduce(t, op=hvd.Max, name=f"times.{r}")
        keep_and_check(r, t, tails, steps, model, world)
        with opt.skip_synchronize():
            opt.step()
    if rank == 0:
        run = {"tail_ms": tails, "step_ms": steps, "ready_ms": statistics.median(s - t for s, t in zip(steps, tails))}
        with open(os.path.join(out, "lastready_horovod.json"), "w") as f:
            json.dump({"bench": "lastready_horovod", "world": world, "horovod": horovod.__version__,
                       "torch": torch.__version__, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
                       "fusion_threshold_bytes": int(os.environ["HOROVOD_FUSION_THRESHOLD"]),
                       "grads": len(sizes), "numel": sum(sizes), "loadavg": open("/proc/loadavg").read().strip(),
                       "runs": {"Horovod": run}}, f, indent=1)
        print(f"Horovod {horovod.__version__}: last ready -> reduced {statistics.median(tails):.1f} ms, whole backward "
              f"{statistics.median(steps):.1f} ms (median of {REPS})")
    hvd.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: horovod_bench.py OUTDIR SIZES_FILE (one process per rank, under mpirun)")
    main(sys.argv[1], sys.argv[2])
