"""The low layer: include/ddp.h for ctypes, and the loaded library.

The header's types, constants, struct layouts and function declarations are generated from it into
_ddp_h.py (tools/gen_bindings.py; `make bindings-check` fails while they differ) and re-exported
here. What the header cannot say is written here: where the library is found, and the errcheck that
status-returning functions get, which raises the matching DDPError subclass (see errors.py), so a
call through this layer either succeeds (returns 0) or raises.
"""
import ctypes
import ctypes.util
import os

from . import errors
from . import _ddp_h
from ._ddp_h import *  # noqa: F401,F403 (the header's names are this layer's)


def _candidates():
    env = os.environ.get("LIBDDP_PATH")
    if env:
        # A file, or a directory holding the library.
        if os.path.isdir(env):
            yield os.path.join(env, "libddp.so.0")
            yield os.path.join(env, "libddp.so")
        else:
            yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (here, os.path.dirname(here)):
        for n in ("libddp.so.0", "libddp.so", "libddp.dylib"):
            p = os.path.join(d, n)
            if os.path.exists(p):
                yield p
    found = ctypes.util.find_library("ddp")
    yield found if found else "libddp.so.0"


def _errcheck(result, func, args):
    if result != 0:
        raise errors.from_status(result, _lib.ddp_last_error().decode("utf-8", "replace"))
    return result


def load():
    errs = []
    for path in _candidates():
        try:
            # RTLD_GLOBAL: Open MPI's plugins resolve libmpi symbols globally.
            return _ddp_h.declare(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL), _errcheck), path
        except OSError as e:
            errs.append("%s: %s" % (path, e))
    raise OSError("libddp: cannot load the library (set LIBDDP_PATH to libddp.so.0 or its directory): "
                  + "; ".join(errs))


_lib, path = load()
lib = _lib
