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


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_sharded_matches_torch_ddp_with_clipping(np_):
    """shard=True and ShardedOptimizer (SGD with momentum, Adam, AdamW, clipped by the global norm)
    against torch DDP and the same optimizer over the whole model, 10 steps."""
    pytest.importorskip("torch")
    rc, out = mpirun(np_, [PYTHON, os.path.join(HERE, "torch_shard_parity.py")])
    assert rc == 0, out
    assert out.count("sharded parity ok") == np_, out
    print(out)


def _python_examples():
    text = open(os.path.join(ROOT, "docs", "bindings.md")).read()
    section = re.search(r"## Python(.*?)\n## ", text, re.S).group(1)
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_docs_python_examples_run_as_written(tmp_path, k):
    blocks = _python_examples()
    assert len(blocks) == 3, "docs/bindings.md: expected three python examples"
    if "import torch" in blocks[k]:
        pytest.importorskip("torch")
    script = tmp_path / "example.py"
    script.write_text(blocks[k])
    rc, out = mpirun(2, [PYTHON, str(script)])
    assert rc == 0, out
    assert len(re.findall(r"rank \d: ok", out)) == 2, out


def test_docs_rust_example_is_the_crate_example():
    text = open(os.path.join(ROOT, "docs", "bindings.md")).read()
    block = re.search(r"## Rust.*?```rust\n(.*?)```", text, re.S).group(1)
    ex = open(os.path.join(ROOT, "bindings", "rust", "libddp", "examples", "allreduce.rs")).read()
    assert block == ex


def test_torch_join_matches_torch_ddp_on_uneven_inputs():
    """`with model.join():` on ranks with different numbers of batches against torch DDP's (Gloo); BatchNorm
    with broadcast_buffers=False; throw_on_early_termination."""
    pytest.importorskip("torch")
    rc, out = mpirun(2, [PYTHON, os.path.join(HERE, "torch_join_parity.py")])
    assert rc == 0, out
    assert out.count("join parity ok") == 2, out


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_join_with_buffers_matches_torch_ddp(np_):
    """`with model.join():` with broadcast_buffers=True and a model with buffers (two BatchNorm layers and
    one of its own) on uneven inputs, the rank with the most batches drawn at random, find_unused_parameters
    on and off: the final parameters and buffers are torch DDP's (Gloo). With find_unused_parameters,
    no_sync() micro-batches or grads set to None (broadcast_buffers off too): torch DDP's whose joined ranks
    report no parameter as used (torch's own report a stale usage map: docs/bindings.md)."""
    pytest.importorskip("torch")
    rc, out = mpirun(np_, [PYTHON, os.path.join(HERE, "torch_join_buffers_parity.py")], timeout=300)
    print(out)
    assert rc == 0, out
    assert out.count("join buffers parity ok") == np_, out
