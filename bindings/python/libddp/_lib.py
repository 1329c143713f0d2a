"""The low layer: ctypes declarations that mirror include/ddp.h one to one.

Every function of the header is listed in FUNCTIONS with its exact C types; tests/test_header.py parses
the header and fails when a function is missing here or declared with another type. Functions that
return a ddp_status_t get an errcheck that raises the matching DDPError subclass (see errors.py), so a
call through this layer either succeeds (returns 0) or raises.
"""
import ctypes
import ctypes.util
import os

from . import errors

# --- scalar types, named after the header ------------------------------------------------------


class ddp_status_t(ctypes.c_int):
    """ddp_status_t: a distinct type so that status-returning functions get the raising errcheck."""


ddp_dtype_t = ctypes.c_int
ddp_comm_t = ctypes.c_void_p
ddp_local_group_t = ctypes.c_void_p
ddp_t = ctypes.c_void_p

# --- constants (the header's enums and macros) --------------------------------------------------
DDP_F16, DDP_BF16, DDP_F32, DDP_F64 = 0, 1, 2, 3
DDP_I32, DDP_I64 = 16, 17
DDP_OP_SUM, DDP_OP_AVG, DDP_OP_MAX, DDP_OP_MIN = 0, 1, 2, 3
DDP_COMPRESS_NONE, DDP_COMPRESS_BF16, DDP_COMPRESS_FP16, DDP_COMPRESS_INT8 = 0, 1, 2, 3
DDP_UNEVEN_OFF, DDP_UNEVEN_BY_CONTRIBUTORS, DDP_UNEVEN_BY_WORLD = 0, 1, 2
DDP_LAYOUT_COPY, DDP_LAYOUT_ARENA = 0, 1
DDP_PLAN_LEARNED, DDP_PLAN_REGISTRATION = 0, 1
DDP_UNUSED_ERROR, DDP_UNUSED_ZERO = 0, 1
DDP_GRAD_TRIGGER = 1
DDP_CONFIG_MAGIC = 0xDD9C0F16
DDP_CONFIG_VERSION = 4
DDP_VERSION_MAJOR, DDP_VERSION_MINOR, DDP_VERSION_PATCH = 0, 2, 0
DDP_VERSION_CODE = DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH


class ddp_nccl_id_t(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 128)]


class ddp_config_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("message_size", ctypes.c_size_t),
        ("delay_allreduce", ctypes.c_int),
        ("layout", ctypes.c_int),
        ("plan_order", ctypes.c_int),
        ("allreduce_always_fp32", ctypes.c_int),
        ("gradient_average", ctypes.c_int),
        ("gradient_predivide_factor", ctypes.c_double),
        ("num_streams", ctypes.c_int),
        ("stream_comms", ctypes.POINTER(ddp_comm_t)),
        ("timeout_ms", ctypes.c_int64),
        ("unused_policy", ctypes.c_int),
        ("timeline_path", ctypes.c_char_p),
        ("check_finite", ctypes.c_int),
        ("inplace_min_numel", ctypes.c_size_t),
        ("host_piece_bytes", ctypes.c_size_t),  # version 2
        ("stall_warning_ms", ctypes.c_int64),  # version 2
        ("shard", ctypes.c_int),  # version 3
        ("compression", ctypes.c_int),  # version 4
        ("uneven_inputs", ctypes.c_int),
    ]


# The first version of ddp_config_t ends after inplace_min_numel: the smallest size the library accepts.
DDP_CONFIG_V1_SIZE = ddp_config_t.inplace_min_numel.offset + ctypes.sizeof(ctypes.c_size_t)


class ddp_stats_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("iterations", ctypes.c_uint64),
        ("buckets_reduced", ctypes.c_uint64),
        ("bytes_reduced", ctypes.c_uint64),
        ("comm_time_ns", ctypes.c_uint64),
        ("exposed_time_ns", ctypes.c_uint64),
        ("last_exposed_ns", ctypes.c_uint64),
        ("library_bytes", ctypes.c_uint64),
        ("arena_bytes", ctypes.c_uint64),
        ("nonfinite_buckets", ctypes.c_uint64),
        ("layout_epoch", ctypes.c_uint64),
        ("world_size", ctypes.c_int),
        ("rank", ctypes.c_int),
    ]


class ddp_bucket_info_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("dtype", ddp_dtype_t),
        ("wire", ddp_dtype_t),
        ("numel", ctypes.c_size_t),
        ("num_grads", ctypes.c_int),
        ("stream", ctypes.c_int),
    ]


class ddp_shard_info_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("dtype", ddp_dtype_t),
        ("bucket_numel", ctypes.c_size_t),
        ("shard_numel", ctypes.c_size_t),
        ("shard_offset", ctypes.c_size_t),
        ("arena_offset", ctypes.c_size_t),
        ("grad_shard", ctypes.c_void_p),
        ("param_shard", ctypes.c_void_p),
        ("grads_numel", ctypes.c_size_t),
    ]


class ddp_hook_bucket_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("bucket", ctypes.c_int),
        ("stream_index", ctypes.c_int),
        ("iteration", ctypes.c_uint64),
        ("buffer", ctypes.c_void_p),
        ("count", ctypes.c_size_t),
        ("dtype", ddp_dtype_t),
        ("stream", ctypes.c_void_p),
        ("comm", ddp_comm_t),
        ("rank", ctypes.c_int),
        ("world", ctypes.c_int),
    ]


# Structs the header defines, by their typedef name (checked against the header too).
STRUCTS = {
    "ddp_nccl_id_t": ddp_nccl_id_t,
    "ddp_config_t": ddp_config_t,
    "ddp_stats_t": ddp_stats_t,
    "ddp_bucket_info_t": ddp_bucket_info_t,
    "ddp_shard_info_t": ddp_shard_info_t,
    "ddp_hook_bucket_t": ddp_hook_bucket_t,
}

_P = ctypes.POINTER
_vp = ctypes.c_void_p
_int = ctypes.c_int

# ddp_log_fn: (level, message, user).
ddp_log_fn = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
DDP_LOG_WARN = 1
DDP_LOG_INFO = 2
# ddp_comm_hook_fn: (bucket, user_data) -> ddp_status_t (an int: a callback's return is not checked).
ddp_comm_hook_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ddp_hook_bucket_t), ctypes.c_void_p)

# name -> (restype, [argtypes]); the header's order.
FUNCTIONS = {
    "ddp_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "ddp_last_error": (ctypes.c_char_p, []),
    "ddp_version": (_int, []),
    "ddp_comm_init_mpi": (ddp_status_t, [_vp, _P(ddp_comm_t)]),
    "ddp_comm_init_self": (ddp_status_t, [_P(ddp_comm_t)]),
    "ddp_comm_init_gloo": (ddp_status_t, [ctypes.c_char_p, _int, _int, _P(ddp_comm_t)]),
    "ddp_comm_init_gloo_timeout": (ddp_status_t, [ctypes.c_char_p, _int, _int, ctypes.c_int64, _P(ddp_comm_t)]),
    "ddp_comm_init_nccl_store": (ddp_status_t, [ctypes.c_char_p, _int, _int, _int, _P(ddp_comm_t)]),
    "ddp_comm_init_nccl_store_timeout": (ddp_status_t, [ctypes.c_char_p, _int, _int, _int, ctypes.c_int64,
                                                        _P(ddp_comm_t)]),
    "ddp_local_group_create": (ddp_status_t, [_int, _P(ddp_local_group_t)]),
    "ddp_comm_init_local": (ddp_status_t, [ddp_local_group_t, _int, _P(ddp_comm_t)]),
    "ddp_local_group_destroy": (ddp_status_t, [ddp_local_group_t]),
    "ddp_nccl_get_unique_id": (ddp_status_t, [_P(ddp_nccl_id_t)]),
    "ddp_comm_init_nccl": (ddp_status_t, [_P(ddp_nccl_id_t), _int, _int, _int, _P(ddp_comm_t)]),
    "ddp_comm_init_nccl_mpi": (ddp_status_t, [_vp, _int, _P(ddp_comm_t)]),
    "ddp_comm_init_nccl_timeout": (ddp_status_t, [_P(ddp_nccl_id_t), _int, _int, _int, ctypes.c_int64, _P(ddp_comm_t)]),
    "ddp_comm_init_nccl_mpi_timeout": (ddp_status_t, [_vp, _int, ctypes.c_int64, _P(ddp_comm_t)]),
    "ddp_comm_wrap_nccl": (ddp_status_t, [_vp, _P(ddp_comm_t)]),
    "ddp_comm_rank": (ddp_status_t, [ddp_comm_t, _P(_int)]),
    "ddp_comm_size": (ddp_status_t, [ddp_comm_t, _P(_int)]),
    "ddp_comm_destroy": (ddp_status_t, [ddp_comm_t]),
    "ddp_config_init_sized": (ddp_status_t, [_P(ddp_config_t), ctypes.c_size_t]),
    "ddp_config_init": (ddp_status_t, [_P(ddp_config_t)]),
    "ddp_create": (ddp_status_t, [ddp_comm_t, _P(ddp_config_t), _P(ddp_t)]),
    "ddp_register_grad": (ddp_status_t, [ddp_t, _vp, ctypes.c_size_t, ddp_dtype_t, ctypes.c_uint, _P(_int)]),
    "ddp_commit": (ddp_status_t, [ddp_t]),
    "ddp_grad_ptr": (ddp_status_t, [ddp_t, _int, _P(_vp)]),
    "ddp_set_grad_ptr": (ddp_status_t, [ddp_t, _int, _vp]),
    "ddp_begin_backward": (ddp_status_t, [ddp_t, _vp]),
    "ddp_grad_ready": (ddp_status_t, [ddp_t, _int]),
    "ddp_grad_ready_ptr": (ddp_status_t, [ddp_t, _int, _vp]),
    "ddp_finish_backward": (ddp_status_t, [ddp_t, _vp]),
    "ddp_set_sync": (ddp_status_t, [ddp_t, _int]),
    "ddp_reduce_all": (ddp_status_t, [ddp_t, _vp]),
    "ddp_broadcast": (ddp_status_t, [ddp_t, _P(_vp), _P(ctypes.c_size_t), _P(ddp_dtype_t), _int, _int, _vp]),
    "ddp_synchronize": (ddp_status_t, [ddp_t]),
    "ddp_get_stats": (ddp_status_t, [ddp_t, _P(ddp_stats_t)]),
    "ddp_get_plan": (ddp_status_t, [ddp_t, _P(_int), _P(_int)]),
    "ddp_get_bucket": (ddp_status_t, [ddp_t, _int, _P(ddp_bucket_info_t), _P(_int), ctypes.c_size_t]),
    "ddp_get_shard": (ddp_status_t, [ddp_t, _int, _P(ddp_shard_info_t)]),
    "ddp_grad_shard": (ddp_status_t, [ddp_t, _int, _P(ctypes.c_size_t), _P(ctypes.c_size_t), _P(ctypes.c_size_t)]),
    "ddp_param_ptr": (ddp_status_t, [ddp_t, _int, _P(_vp)]),
    "ddp_broadcast_params": (ddp_status_t, [ddp_t, _int, _vp]),
    "ddp_gather_params": (ddp_status_t, [ddp_t, _vp]),
    "ddp_wait_params": (ddp_status_t, [ddp_t, _int, _vp]),
    "ddp_shard_norm": (ddp_status_t, [ddp_t, _vp, _P(ctypes.c_double), _P(ctypes.c_uint64)]),
    "ddp_destroy": (ddp_status_t, [ddp_t]),
    "ddp_set_log_callback": (ddp_status_t, [ddp_log_fn, _vp]),
    "ddp_join": (ddp_status_t, [ddp_t, _P(ctypes.c_int64)]),
    "ddp_allreduce_host": (ddp_status_t, [ddp_t, _vp, ctypes.c_size_t, ddp_dtype_t, _int]),
    "ddp_barrier": (ddp_status_t, [ddp_t]),
    "ddp_set_comm_hook": (ddp_status_t, [ddp_t, ddp_comm_hook_fn, _vp]),
    "ddp_comm_allreduce": (ddp_status_t, [ddp_comm_t, _vp, ctypes.c_size_t, ddp_dtype_t, _int, _vp]),
}


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
    result = result.value
    if result != 0:
        raise errors.from_status(result, _lib.ddp_last_error().decode("utf-8", "replace"))
    return result


def declare(lib, table=None):
    """Sets restype/argtypes (and the raising errcheck) on every function of `table` found in `lib`."""
    for name, (res, args) in (FUNCTIONS if table is None else table).items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
        if res is ddp_status_t:
            f.errcheck = _errcheck
    return lib


def load():
    errs = []
    for path in _candidates():
        try:
            # RTLD_GLOBAL: Open MPI's plugins resolve libmpi symbols globally.
            return declare(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)), path
        except OSError as e:
            errs.append("%s: %s" % (path, e))
    raise OSError("libddp: cannot load the library (set LIBDDP_PATH to libddp.so.0 or its directory): "
                  + "; ".join(errs))


_lib, path = load()
lib = _lib
