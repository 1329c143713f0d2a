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
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import zipfile

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1: the wheel package's command, when it is installed
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

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


def _requires_dist(requires_txt):
    """requires.txt (egg-info: "[extra]" or "[extra:marker]" sections) as Requires-Dist lines."""
    lines, section = [], ""
    for line in requires_txt.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("["):
            section = line[1:-1]
            continue
        extra, _, marker = section.partition(":")
        conds = (["(%s)" % marker] if marker else []) + (['extra == "%s"' % extra] if extra else [])
        lines.append("Requires-Dist: %s%s" % (line, "; " + " and ".join(conds) if conds else ""))
    return lines


class StdlibWheel(Command):
    """bdist_wheel for a Python without one (setuptools < 70.1 and no `wheel` package): the built package
    and a .dist-info made from egg_info's metadata, zipped as a py3-none-<platform> wheel. It also gives
    setuptools' dist_info command (pip's metadata step) the egg2dist it asks bdist_wheel for."""

    description = "build a py3-none-<platform> wheel with the standard library"
    user_options = [("dist-dir=", "d", "directory to put the wheel in")]

    def initialize_options(self):
        self.dist_dir = None

    def finalize_options(self):
        self.dist_dir = self.dist_dir or "dist"

    def egg2dist(self, egg_info_dir, dist_info_dir):
        os.makedirs(dist_info_dir, exist_ok=True)
        with open(os.path.join(egg_info_dir, "PKG-INFO")) as f:
            head, sep, body = f.read().partition("\n\n")
        head = head.splitlines()
        requires = os.path.join(egg_info_dir, "requires.txt")
        if os.path.exists(requires):
            with open(requires) as f:
                head += [r for r in _requires_dist(f.read()) if r not in head]
        with open(os.path.join(dist_info_dir, "METADATA"), "w") as f:
            f.write("\n".join(head) + "\n" + sep + body)
        for name in ("top_level.txt", "entry_points.txt"):
            if os.path.exists(os.path.join(egg_info_dir, name)):
                shutil.copy2(os.path.join(egg_info_dir, name), dist_info_dir)

    def run(self):
        self.run_command("build")
        build_lib = self.get_finalized_command("build").build_lib
        self.run_command("egg_info")
        egg_info = self.get_finalized_command("egg_info").egg_info
        name = re.sub(r"[-_.]+", "_", self.distribution.get_name())
        version = self.distribution.get_version()
        tag = "py3-none-" + re.sub(r"[-.]", "_", sysconfig.get_platform())
        info = "%s-%s.dist-info" % (name, version)
        with tempfile.TemporaryDirectory() as stage:
            shutil.copytree(build_lib, stage, dirs_exist_ok=True)
            self.egg2dist(egg_info, os.path.join(stage, info))
            with open(os.path.join(stage, info, "WHEEL"), "w") as f:
                f.write("Wheel-Version: 1.0\nGenerator: libddp setup.py\nRoot-Is-Purelib: false\nTag: %s\n" % tag)
            files = sorted(os.path.relpath(os.path.join(d, n), stage).replace(os.sep, "/")
                           for d, _, names in os.walk(stage) for n in names)
            record = []
            for rel in files:
                with open(os.path.join(stage, rel), "rb") as f:
                    data = f.read()
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                record.append("%s,sha256=%s,%d" % (rel, digest, len(data)))
            record.append("%s/RECORD,," % info)
            with open(os.path.join(stage, info, "RECORD"), "w") as f:
                f.write("\n".join(record) + "\n")
            os.makedirs(self.dist_dir, exist_ok=True)
            wheel = os.path.join(self.dist_dir, "%s-%s-%s.whl" % (name, version, tag))
            with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
                for rel in files + [info + "/RECORD"]:
                    z.write(os.path.join(stage, rel), rel)
        print("libddp: wrote %s" % wheel)


if bdist_wheel is None:
    PlatformWheel = StdlibWheel
else:
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
