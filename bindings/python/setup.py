"""Builds the C library with the repository's Makefile and ships it inside the package.

Everything declarative is in pyproject.toml; this file only adds the native build:
`make -C <repository> lib` (the environment passes through: CUDA=0, MPI=0, CXX, ...), then
build/lib/libddp.so.0 is copied to libddp/libddp.so.0, where the loader looks first after
LIBDDP_PATH. LIBDDP_PREBUILT=<path to libddp.so.0> ships that file instead of building.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NAME = "libddp.so.0"


def native_library():
    prebuilt = os.environ.get("LIBDDP_PREBUILT")
    if prebuilt:
        if not os.path.isfile(prebuilt):
            raise SystemExit("libddp: LIBDDP_PREBUILT=%s is not a file" % prebuilt)
        return prebuilt
    if not (os.path.isfile(os.path.join(ROOT, "Makefile")) and os.path.isfile(os.path.join(ROOT, "include", "ddp.h"))):
        raise SystemExit("libddp: the C library is built from the libddp repository; build this package from "
                         "bindings/python inside a checkout, or set LIBDDP_PREBUILT to a built libddp.so.0")
    jobs = os.environ.get("LIBDDP_JOBS", str(os.cpu_count() or 2))
    subprocess.check_call([os.environ.get("MAKE", "make"), "-C", ROOT, "-j" + jobs, "lib"])
    return os.path.join(ROOT, "build", "lib", NAME)


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        lib = native_library()
        dest = os.path.join(self.build_lib, "libddp", NAME)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.realpath(lib), dest)


class NativeDistribution(Distribution):
    # The package holds a shared library: the wheel is tagged for this platform, not "any".
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=NativeDistribution)
