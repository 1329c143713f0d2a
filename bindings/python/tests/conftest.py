import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
ROOT = os.path.dirname(os.path.dirname(PKG))
# LIBDDP_TEST_INSTALLED=1: the suite tests the installed package (run from a virtual environment
# outside the source tree, the library inside the package); otherwise the sources here.
INSTALLED = os.environ.get("LIBDDP_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, PKG)
sys.path.insert(0, HERE)
PYTHON = sys.executable if INSTALLED else "/usr/bin/python3"
# What child processes put on PYTHONPATH to import the same libddp as this process.
CHILD_PATH = HERE if INSTALLED else PKG


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpirun(np, argv, timeout=150, env=None):
    """Runs `argv` on `np` ranks; returns (returncode, output)."""
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONPATH=CHILD_PATH, MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(free_port()))
    e.update(env or {})
    cmd = [os.environ.get("MPIRUN", "mpirun"), "--oversubscribe", "-np", str(np)] + argv
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        return 124, (t.output or b"").decode(errors="replace") + "\n(timed out)"
    return p.returncode, p.stdout.decode(errors="replace")
