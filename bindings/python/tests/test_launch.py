"""Processes started without mpirun (tools/ddp_launch sets what torchrun sets: RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT): Comm.gloo over env:// and a file store, libddp.torch over
torch.distributed's world against torch DDP, and a process that would train alone raising instead."""
import os
import re
import subprocess
import sys

import pytest

import libddp
from conftest import CHILD_PATH, HERE, PYTHON, ROOT, free_port

LAUNCH = os.path.join(ROOT, "tools", "ddp_launch")
pytestmark = pytest.mark.skipif(not os.access(LAUNCH, os.X_OK), reason="tools/ddp_launch is not here")


def gloo_built():
    try:
        libddp.Comm.gloo("none://", 0, 1)  # refused either way: as malformed, or as not built
    except libddp.UnsupportedError:
        return False
    except libddp.InvalidArgumentError:
        return True
    raise AssertionError("Comm.gloo('none://') made a communicator")


needs_gloo = pytest.mark.skipif(not gloo_built(), reason="libddp built without Gloo")


def launch(np_, argv, env=None, timeout=200):
    """Runs `argv` on `np_` processes through tools/ddp_launch; returns (returncode, output)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX"))}
    e.update(PYTHONPATH=CHILD_PATH, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    e.update(env or {})
    cmd = [LAUNCH, "-n", str(np_), "--master-port", str(free_port())] + argv
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        return 124, (t.output or b"").decode(errors="replace") + "\n(timed out)"
    return p.returncode, p.stdout.decode(errors="replace")


@needs_gloo
@pytest.mark.parametrize("np_", [2, 3])
def test_numpy_reduction_over_gloo_env(np_):
    rc, out = launch(np_, [PYTHON, os.path.join(HERE, "mpi_worker.py")], {"LIBDDP_TEST_GLOO": "env://"})
    assert rc == 0, out
    assert len(re.findall(r"rank \d+ of %d: 0 failed" % np_, out)) == np_, out


@needs_gloo
def test_numpy_reduction_over_a_file_store(tmp_path):
    rc, out = launch(2, [PYTHON, os.path.join(HERE, "mpi_worker.py")], {"LIBDDP_TEST_GLOO": "file://%s" % tmp_path})
    assert rc == 0, out
    assert len(re.findall(r"rank \d+ of 2: 0 failed", out)) == 2, out
    assert os.listdir(tmp_path) == []  # the store's files are removed once read


@needs_gloo
@pytest.mark.parametrize("np_", [2, 4])
def test_torch_matches_torch_ddp_under_torchrun_environment(np_):
    """The defect this guards: under torchrun's environment with torch.distributed initialized, every
    process trained alone. Now DistributedDataParallel(model) with no comm runs over torch.distributed's
    world (Gloo), and matches torch DDP to 1e-6."""
    pytest.importorskip("torch")
    rc, out = launch(np_, [PYTHON, os.path.join(HERE, "torch_parity.py")], timeout=400)
    assert rc == 0, out
    assert out.count("parity ok") == np_, out


AUTO = r"""
import libddp
rank, size, local = libddp.launcher_ranks()
comm = libddp.Comm.gloo("auto")
print("rank %d of %d, local rank %d; comm rank %d of %d" % (rank, size, local, comm.rank, comm.size), flush=True)
comm.close()
"""


@needs_gloo
def test_auto_takes_the_launchers_ranks(tmp_path):
    """The init method auto and launcher_ranks() under ddp_launch (torchrun's variables)."""
    script = tmp_path / "auto.py"
    script.write_text(AUTO)
    rc, out = launch(2, [PYTHON, str(script)])
    assert rc == 0, out
    for r in (0, 1):
        assert "rank %d of 2, local rank %d; comm rank %d of 2" % (r, r, r) in out, out


def test_launcher_ranks_names_what_is_missing_or_contradicts(monkeypatch):
    for v in list(os.environ):
        if v.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "OMPI_COMM_WORLD", "PMI", "MPI_LOCAL", "SLURM_", "GROUP_RANK",
                         "TORCHELASTIC")):
            monkeypatch.delenv(v)
    with pytest.raises(libddp.InvalidArgumentError, match="no launcher's variables give this process a rank"):
        libddp.launcher_ranks()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert libddp.launcher_ranks() == (2, 3, 0)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(libddp.InvalidArgumentError, match=r"RANK=1 \(torchrun\) but OMPI_COMM_WORLD_RANK=2 \(Open MPI\)"):
        libddp.launcher_ranks()


TRAINS_ALONE = r"""
import os, sys, torch
import libddp, libddp.torch as ltorch
model = torch.nn.Linear(3, 2)
mode = sys.argv[1]
if mode == "init":  # torch.distributed over the launcher's world: the default comm is Gloo over it
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ddp = ltorch.DistributedDataParallel(model)
elif mode == "env":  # the launcher's environment alone: Gloo over env://
    ddp = ltorch.DistributedDataParallel(model)
else:  # a one-rank comm in a job of more: refused
    try:
        ltorch.DistributedDataParallel(model, libddp.Comm.self())
    except libddp.InvalidStateError as e:
        # one write(2) of the whole line: on a pipe (under PIPE_BUF) it never interleaves with the
        # other rank's, where print() may write the text and its newline apart (python -u)
        os.write(1, ("rank %s refused: %s\n" % (os.environ["RANK"], e)).encode())
        sys.exit(0)
    sys.exit("rank %s: trained alone" % os.environ["RANK"])
model(torch.full((1, 3), float(os.environ["RANK"]))).sum().backward()
print("rank %s: world %d, weight grad %s" % (os.environ["RANK"], ddp.comm.size, model.weight.grad[0].tolist()), flush=True)
ddp.close()
"""


@needs_gloo
@pytest.mark.parametrize("mode", ["init", "env"])
def test_default_comm_joins_the_launched_world(tmp_path, mode):
    pytest.importorskip("torch")
    script = tmp_path / "alone.py"
    script.write_text(TRAINS_ALONE)
    rc, out = launch(2, [PYTHON, str(script), mode])
    assert rc == 0, out
    # inputs 0 and 1 on the two ranks: the averaged grad of every weight is 0.5 everywhere
    assert len(re.findall(r"rank \d: world 2, weight grad \[0\.5, 0\.5, 0\.5\]", out)) == 2, out


def test_a_one_rank_comm_in_a_job_of_two_raises(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "alone.py"
    script.write_text(TRAINS_ALONE)
    rc, out = launch(2, [PYTHON, str(script), "self"])
    assert rc == 0, out
    refused = re.findall(r"rank \d refused: (.*?)(?=rank \d refused: |\n|$)", out)
    assert len(refused) == 2, out
    assert "rank 0 of 1" in refused[0] and "WORLD_SIZE says the job has 2 processes" in refused[0], refused[0]
    assert "torchrun" in refused[0] and "mpirun -np N" in refused[0], refused[0]


@pytest.mark.parametrize("var", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_default_comm_of_one_under_a_launcher_of_more_raises(monkeypatch, var):
    """mpirun started 2 processes but this one's MPI world is 1 (another MPI's mpirun, a singleton):
    the wrapper raises instead of training alone."""
    torch = pytest.importorskip("torch")
    import libddp.torch as ltorch

    for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "2")
    monkeypatch.setattr(libddp.Comm, "mpi", classmethod(lambda cls: libddp.Comm.self()))
    with pytest.raises(libddp.InvalidStateError, match="%s says the job has 2 processes" % var):
        ltorch.DistributedDataParallel(torch.nn.Linear(2, 2))
    monkeypatch.setenv(var, "1")  # a job of one: fine
    ltorch.DistributedDataParallel(torch.nn.Linear(2, 2)).close()


def test_comm_gloo_bad_method_names_it():
    if not gloo_built():
        with pytest.raises(libddp.UnsupportedError):
            libddp.Comm.gloo("env://", 0, 2)
        return
    with pytest.raises(libddp.InvalidArgumentError, match="udp://x"):
        libddp.Comm.gloo("udp://x", 0, 2)


ELASTIC = r"""
import os, signal, sys
import numpy as np
import libddp
store, out, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
if store == "env://":  # started by ddp_launch --elastic: its own store process outlives rank 0
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
else:
    rank, n = int(sys.argv[4]), int(sys.argv[5])
out = out % rank
comm = libddp.Comm.gloo(store, rank, n)
ddp = libddp.DDP(comm, elastic=True, timeout_ms=20000, message_size=1000)
params = [np.linspace(0, 1, 3000, dtype=np.float32), np.linspace(1, 2, 500, dtype=np.float32)]
grads = [np.zeros_like(p) for p in params]
for g in grads:
    ddp.register(g)
ids, step, lost = list(range(n)), 0, None
while step < 6:
    if rank == victim and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the victim
    try:
        ddp.begin_backward()
        for i, g in enumerate(grads):
            g[:] = (rank + 1) * (i + 1) * 0.01
            ddp.grad_ready(i)
        ddp.finish_backward()
    except libddp.RankLostError as e:
        m = ddp.recover()
        lost = m
        ids = [ids[r] for r in m.members]
        ddp.broadcast(params, root=m.source)
        step = m.committed
        continue
    for p, g in zip(params, grads):
        p -= 0.1 * g
    step += 1
np.save(out, np.concatenate(params))
print("rank %d: membership epoch %d, world %d, members %s" % (rank, lost.epoch, lost.world, ids))
"""


@needs_gloo
def test_elastic_survivors_recover_from_a_killed_rank(tmp_path):
    """Three processes over a file store; the last one SIGKILLs itself at step 2: the others get
    RankLostError, recover() over the two of them, and end with the same parameters."""
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    store = tmp_path / "store"
    store.mkdir()
    e = dict(os.environ, PYTHONPATH=CHILD_PATH, GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([PYTHON, str(script), "file://%s" % store, str(tmp_path / "p%d.npy"), "2", str(r), "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e) for r in range(3)]
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert procs[2].returncode == -9, outs[2]
    for r in (0, 1):
        assert procs[r].returncode == 0, outs[r]
        assert "membership epoch 1, world 2, members [0, 1]" in outs[r], outs[r]
    import numpy as np
    a, b = np.load(tmp_path / "p0.npy"), np.load(tmp_path / "p1.npy")
    assert a.tobytes() == b.tobytes()


@needs_gloo
def test_elastic_launch_survives_losing_rank_0(tmp_path):
    """ddp_launch --elastic: the store lives in a ddp_store process, so the job goes on when rank 0
    (which serves the store otherwise) is killed; ddp_launch reports the death and exits 0."""
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    rc, out = launch(3, ["--elastic", PYTHON, str(script), "env://", str(tmp_path / "p%d.npy"), "0"], timeout=120)
    assert rc == 0, out
    assert "rank 0 was killed by signal 9; the other ranks go on" in out, out
    assert out.count("membership epoch 1, world 2, members [1, 2]") == 2, out
    import numpy as np
    a, b = np.load(tmp_path / "p1.npy"), np.load(tmp_path / "p2.npy")
    assert a.tobytes() == b.tobytes()


REPLACED = r"""
import os, signal, sys, time
import numpy as np
import libddp
out, n = sys.argv[1], int(sys.argv[2])
joiner = os.environ.get("DDP_JOIN") == "1"  # restarted by ddp_launch --max-restarts
if joiner:  # no rank until admitted: the number it replaces is DDP_REPLACES (its grads are that rank's)
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ, "a replacement sees RANK=%s WORLD_SIZE=%s" % (
        os.environ.get("RANK"), os.environ.get("WORLD_SIZE"))
    rank = int(os.environ["DDP_REPLACES"])
else:
    rank = int(os.environ["RANK"])
comm = libddp.Comm.join_gloo("env://") if joiner else libddp.Comm.gloo("env://")
ddp = libddp.DDP(comm, elastic=True, timeout_ms=20000, message_size=1000)
params = [np.linspace(0, 1, 3000, dtype=np.float32), np.linspace(1, 2, 500, dtype=np.float32)]
grads = [np.zeros_like(p) for p in params]
for g in grads:
    ddp.register(g)
world, step, changes = n, 0, []


def take_state(m):
    global world, step
    ddp.broadcast(params, root=m.source)
    world, step = m.world, m.committed
    changes.append((m.epoch, m.world, m.old_rank == -1))


if joiner:
    take_state(ddp.recover())
while step < 6 or (world < n and step < 200):  # the same bound on every rank: the step and the world
    if rank == 1 and step == 2 and not joiner:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        ddp.begin_backward()
        for i, g in enumerate(grads):
            g[:] = (rank + 1) * (i + 1) * 0.01 + step * 0.001
            ddp.grad_ready(i)
        ddp.finish_backward()
    except (libddp.RankLostError, libddp.RankJoiningError):
        take_state(ddp.recover())
        continue
    for p, g in zip(params, grads):
        p -= 0.1 * g
    step += 1
    if world < n:
        time.sleep(0.2)  # a rank is missing: give its replacement time to come
np.save(out % os.getpid(), np.concatenate(params))
print("rank %d%s: world %d at step %d; changes %s" % (rank, " (joiner)" if joiner else "", world, step, changes))
"""


@needs_gloo
def test_launch_max_restarts_replaces_a_killed_rank(tmp_path):
    """ddp_launch --max-restarts 1: rank 1 is killed at step 2; the survivors recover, ddp_launch starts a
    process with DDP_JOIN=1 and DDP_REPLACES=1 (no RANK or WORLD_SIZE) that joins through Comm.join_gloo,
    the survivors admit it (RankJoiningError, recover) and all three end with the same parameters."""
    script = tmp_path / "replaced.py"
    script.write_text(REPLACED)
    rc, out = launch(3, ["--max-restarts", "1", PYTHON, str(script), str(tmp_path / "p%d.npy"), "3"], timeout=120)
    assert rc == 0, out
    assert "rank 1 was killed by signal 9; starting a process that joins the running job in its place (restart 1 of 1)" in out, out
    assert "rank 1 (joiner): world 3" in out, out
    assert len(re.findall(r"rank [02]: world 3 at step \d+; changes \[\(1, 2, False\), \(2, 3, False\)\]", out)) == 2, out
    import numpy as np
    saved = sorted(tmp_path.glob("p*.npy"))
    assert len(saved) == 3, out
    first = np.load(saved[0]).tobytes()
    assert all(np.load(p).tobytes() == first for p in saved[1:]), out
