"""torch 1.13's DistributedDataParallel tests that run on CPU, ported to libddp.torch (torch_port.py), at
2 and 3 ranks under mpirun, against torch's own DDP over Gloo."""
import os
import re
import shutil

import pytest

from conftest import HERE, PYTHON, mpirun

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("MPIRUN", "mpirun")) is None, reason="no mpirun")


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_ddp_port(np_):
    pytest.importorskip("torch")
    rc, out = mpirun(np_, [PYTHON, os.path.join(HERE, "torch_port.py")], timeout=240)
    print(out)
    counts = re.findall(r"rank (\d+): port: (\d+) passed, (\d+) failed", out)
    assert len(counts) == np_, out
    failed = sorted(set(re.findall(r"rank \d+: (\w+) FAILED", out)))
    assert not failed and all(f == "0" for _, _, f in counts), "failed: %s\n%s" % (", ".join(failed), out)
    assert rc == 0, out
    assert len(set(p for _, p, _ in counts)) == 1 and int(counts[0][1]) >= 30, counts
