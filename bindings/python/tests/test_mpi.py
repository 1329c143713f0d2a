"""Real ranks under mpirun: numpy reduction at 2 and 3 ranks, PyTorch parity with torch DDP (Gloo)."""
import os
import re
import shutil

import pytest

from conftest import HERE, ROOT, PYTHON, mpirun

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("MPIRUN", "mpirun")) is None, reason="no mpirun")


@pytest.mark.parametrize("np_", [2, 3])
def test_numpy_reduction_across_ranks(np_):
    rc, out = mpirun(np_, [PYTHON, os.path.join(HERE, "mpi_worker.py")])
    assert rc == 0, out
    assert len(re.findall(r"rank \d+ of %d: 0 failed" % np_, out)) == np_, out


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_matches_torch_ddp_on_gloo(np_):
    pytest.importorskip("torch")
    rc, out = mpirun(np_, [PYTHON, os.path.join(HERE, "torch_parity.py")])
    assert rc == 0, out
    assert out.count("parity ok") == np_, out
    print(out)


def test_docs_example_runs_as_written(tmp_path):
    text = open(os.path.join(ROOT, "docs", "bindings.md")).read()
    m = re.search(r"## Python.*?```python\n(.*?)```", text, re.S)
    assert m, "no python example in docs/bindings.md"
    script = tmp_path / "example.py"
    script.write_text(m.group(1))
    rc, out = mpirun(2, [PYTHON, str(script)])
    assert rc == 0, out
    assert out.count("ok") >= 2, out
