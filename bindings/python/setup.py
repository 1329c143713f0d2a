"""Builds the C library with the repository's Makefile and ships it inside the package.

Everything declarative is in pyproject.toml; this file only adds the native build:
`make -C <repository> lib` (the environment passes through: CUDA=0, MPI=0, CXX, ...), then
build/lib/libddp.so.0 is copied to libddp/libddp.so.0, where the loader looks first after
LIBDDP_PATH. LIBDDP_PREBUILT=<path to libddp.so.0> ships that file instead of building.

The version is the C library's: DDP_VERSION_MAJOR/MINOR/PATCH of include/ddp.h, read from
libddp/_ddp_h.py, which tools/gen_bindings.py generates from the header (make bindings-check keeps
them equal). The wheel is tagged py3-none-<platform>: it holds a prebuilt library loaded with
ctypes, no CPython extension, so any Python 3 on that platform can use it.
"""
import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1: the wheel package's command
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NAME = "libddp.so.0"
GENERATED = os.path.join(HERE, "libddp", "_ddp_h.py")


def library_version():
    """"MAJOR.MINOR.PATCH" of include/ddp.h, as libddp/_ddp_h.py (generated from it) holds it: there in a
    checkout and in a source distribution alike."""
    with open(GENERATED) as f:
        text = f.read()
    parts = [re.search(r"^DDP_VERSION_%s = (\d+)$" % k, text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise SystemExit("libddp: %s holds no DDP_VERSION_MAJOR/MINOR/PATCH (run make bindings)" % GENERATED)
    return ".".join(m.group(1) for m in parts)


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
    # The package holds a shared library: install puts it in platlib, as the wheel's root.
    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    # The package holds a shared library: the wheel is for this platform (not pure), but for any
    # Python 3 and ABI, as ctypes loads the library.
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(version=library_version(), cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel},
      distclass=NativeDistribution)
