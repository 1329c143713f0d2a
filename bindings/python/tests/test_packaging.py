"""The package builds and installs with a bare pip: a virtual environment as `python3 -m venv` makes it
(pip and setuptools, no `wheel` package), offline (--no-index --no-build-isolation)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PKG

import libddp

BASE_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _run(argv, **kw):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600, **kw)
    return p.returncode, p.stdout.decode(errors="replace")


def test_pip_install_without_the_wheel_package(tmp_path):
    venv = tmp_path / "venv"
    rc, out = _run([BASE_PYTHON, "-m", "venv", str(venv)])
    if rc != 0:
        pytest.skip("%s -m venv failed (apt-get install python3-venv): %s" % (BASE_PYTHON, out))
    py = str(venv / "bin" / "python")
    rc, out = _run([py, "-m", "pip", "--version"])
    if rc != 0:
        pytest.skip("the virtual environment has no pip: %s" % out)
    rc, _ = _run([py, "-c", "import wheel"])
    if rc == 0:  # a venv that has wheel cannot show the defect; remove it (offline, nothing to fetch)
        _run([py, "-m", "pip", "uninstall", "-y", "-q", "wheel"])
        assert _run([py, "-c", "import wheel"])[0] != 0, "could not remove wheel from the test venv"
    # The package's sources, as in a checkout, with the library built already (LIBDDP_PREBUILT), so the
    # test neither runs make nor writes build folders into the source tree.
    src = tmp_path / "python"
    shutil.copytree(PKG, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests",
                                                            "libddp.so*"))
    env = dict(os.environ, LIBDDP_PREBUILT=os.path.realpath(libddp.library_path), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("LIBDDP_PATH", None)
    env.pop("PYTHONPATH", None)
    rc, out = _run([py, "-m", "pip", "install", "--no-index", "--no-build-isolation", str(src)], env=env,
                   cwd=str(tmp_path))
    assert rc == 0, out
    assert "Traceback" not in out, out
    rc, out = _run([py, "-c", "import libddp; print(libddp.version()); print(libddp.library_path)"], env=env,
                   cwd=str(tmp_path))
    assert rc == 0, out
    version, path = out.split()
    assert int(version) == libddp.version()
    assert path.startswith(str(venv)) and path.endswith(os.path.join("libddp", "libddp.so.0")), out
