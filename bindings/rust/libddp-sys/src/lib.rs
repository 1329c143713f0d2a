//! Raw declarations of `include/ddp.h`, one to one. Widths follow the header: `size_t` is `usize`,
//! `int` is `c_int`, enums are `c_int`, handles are opaque pointers.
#![allow(non_camel_case_types)]
use std::os::raw::{c_char, c_int, c_uint, c_void};

pub type ddp_status_t = c_int;
pub type ddp_dtype_t = c_int;

pub const DDP_SUCCESS: ddp_status_t = 0;
pub const DDP_LOG_WARN: c_int = 1;
pub const DDP_LOG_INFO: c_int = 2;
/// ddp_log_fn: (level, message, user); None restores the library's default (stderr).
pub type ddp_log_fn = Option<unsafe extern "C" fn(level: c_int, message: *const c_char, user: *mut c_void)>;
pub const DDP_ERR_INVALID_ARGUMENT: ddp_status_t = 1;
pub const DDP_ERR_INVALID_STATE: ddp_status_t = 2;
pub const DDP_ERR_MISMATCH: ddp_status_t = 3;
pub const DDP_ERR_OUT_OF_MEMORY: ddp_status_t = 4;
pub const DDP_ERR_UNSUPPORTED: ddp_status_t = 5;
pub const DDP_ERR_CUDA: ddp_status_t = 6;
pub const DDP_ERR_NCCL: ddp_status_t = 7;
pub const DDP_ERR_MPI: ddp_status_t = 8;
pub const DDP_ERR_TIMEOUT: ddp_status_t = 9;
pub const DDP_ERR_ABORTED: ddp_status_t = 10;
pub const DDP_ERR_INTERNAL: ddp_status_t = 11;

pub const DDP_F16: ddp_dtype_t = 0;
pub const DDP_BF16: ddp_dtype_t = 1;
pub const DDP_F32: ddp_dtype_t = 2;
pub const DDP_F64: ddp_dtype_t = 3;
/// Integers, for ddp_allreduce_host alone.
pub const DDP_I32: ddp_dtype_t = 16;
pub const DDP_I64: ddp_dtype_t = 17;
pub const DDP_OP_SUM: c_int = 0;
pub const DDP_OP_AVG: c_int = 1;
pub const DDP_OP_MAX: c_int = 2;
pub const DDP_OP_MIN: c_int = 3;
pub const DDP_COMPRESS_NONE: c_int = 0;
pub const DDP_COMPRESS_BF16: c_int = 1;
pub const DDP_COMPRESS_FP16: c_int = 2;
pub const DDP_COMPRESS_INT8: c_int = 3;
pub const DDP_UNEVEN_OFF: c_int = 0;
pub const DDP_UNEVEN_BY_CONTRIBUTORS: c_int = 1;
pub const DDP_UNEVEN_BY_WORLD: c_int = 2;
pub const DDP_LAYOUT_COPY: c_int = 0;
pub const DDP_LAYOUT_ARENA: c_int = 1;
pub const DDP_PLAN_LEARNED: c_int = 0;
pub const DDP_PLAN_REGISTRATION: c_int = 1;
pub const DDP_UNUSED_ERROR: c_int = 0;
pub const DDP_UNUSED_ZERO: c_int = 1;
pub const DDP_GRAD_TRIGGER: c_uint = 1;
pub const DDP_CONFIG_MAGIC: u32 = 0xDD9C0F16;
pub const DDP_CONFIG_VERSION: u32 = 4;
pub const DDP_VERSION_MAJOR: c_int = 0;
pub const DDP_VERSION_MINOR: c_int = 2;
pub const DDP_VERSION_PATCH: c_int = 0;
pub const DDP_VERSION_CODE: c_int = DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH;
/// The first version of ddp_config_t ends after inplace_min_numel: the smallest size accepted.
pub const DDP_CONFIG_V1_SIZE: usize =
    std::mem::offset_of!(ddp_config_t, inplace_min_numel) + std::mem::size_of::<usize>();

#[repr(C)]
pub struct ddp_comm {
    _private: [u8; 0],
}
#[repr(C)]
pub struct ddp_local_group {
    _private: [u8; 0],
}
#[repr(C)]
pub struct ddp_context {
    _private: [u8; 0],
}
pub type ddp_comm_t = *mut ddp_comm;
pub type ddp_local_group_t = *mut ddp_local_group;
pub type ddp_t = *mut ddp_context;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ddp_nccl_id_t {
    pub bytes: [c_char; 128],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ddp_config_t {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub message_size: usize,
    pub delay_allreduce: c_int,
    pub layout: c_int,
    pub plan_order: c_int,
    pub allreduce_always_fp32: c_int,
    pub gradient_average: c_int,
    pub gradient_predivide_factor: f64,
    pub num_streams: c_int,
    pub stream_comms: *const ddp_comm_t,
    pub timeout_ms: i64,
    pub unused_policy: c_int,
    pub timeline_path: *const c_char,
    pub check_finite: c_int,
    pub inplace_min_numel: usize,
    // version 2
    pub host_piece_bytes: usize,
    pub stall_warning_ms: i64,
    // version 3
    pub shard: c_int,
    pub compression: c_int,
    pub uneven_inputs: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ddp_stats_t {
    pub size: usize,
    pub iterations: u64,
    pub buckets_reduced: u64,
    pub bytes_reduced: u64,
    pub comm_time_ns: u64,
    pub exposed_time_ns: u64,
    pub last_exposed_ns: u64,
    pub library_bytes: u64,
    pub arena_bytes: u64,
    pub nonfinite_buckets: u64,
    pub layout_epoch: u64,
    pub world_size: c_int,
    pub rank: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ddp_shard_info_t {
    pub size: usize,
    pub dtype: ddp_dtype_t,
    pub bucket_numel: usize,
    pub shard_numel: usize,
    pub shard_offset: usize,
    pub arena_offset: usize,
    pub grad_shard: *mut c_void,
    pub param_shard: *mut c_void,
    pub grads_numel: usize,
}

/// A bucket handed to a comm hook (ddp_set_comm_hook).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ddp_hook_bucket_t {
    pub size: usize,
    pub bucket: c_int,
    pub stream_index: c_int,
    pub iteration: u64,
    pub buffer: *mut c_void,
    pub count: usize,
    pub dtype: ddp_dtype_t,
    pub stream: *mut c_void,
    pub comm: ddp_comm_t,
    pub rank: c_int,
    pub world: c_int,
}

/// ddp_comm_hook_fn: (bucket, user_data) -> status.
pub type ddp_comm_hook_fn =
    Option<unsafe extern "C" fn(bucket: *const ddp_hook_bucket_t, user_data: *mut c_void) -> ddp_status_t>;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ddp_bucket_info_t {
    pub size: usize,
    pub dtype: ddp_dtype_t,
    pub wire: ddp_dtype_t,
    pub numel: usize,
    pub num_grads: c_int,
    pub stream: c_int,
}

extern "C" {
    pub fn ddp_status_string(status: ddp_status_t) -> *const c_char;
    pub fn ddp_last_error() -> *const c_char;
    pub fn ddp_version() -> c_int;
    pub fn ddp_comm_init_mpi(mpi_comm: *const c_void, comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_self(comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_local_group_create(nranks: c_int, group: *mut ddp_local_group_t) -> ddp_status_t;
    pub fn ddp_comm_init_local(group: ddp_local_group_t, rank: c_int, comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_local_group_destroy(group: ddp_local_group_t) -> ddp_status_t;
    pub fn ddp_nccl_get_unique_id(id: *mut ddp_nccl_id_t) -> ddp_status_t;
    pub fn ddp_comm_init_nccl(id: *const ddp_nccl_id_t, nranks: c_int, rank: c_int, cuda_device: c_int,
                              comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_nccl_mpi(mpi_comm: *const c_void, cuda_device: c_int, comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_nccl_timeout(id: *const ddp_nccl_id_t, nranks: c_int, rank: c_int, cuda_device: c_int,
                                      timeout_ms: i64, comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_nccl_mpi_timeout(mpi_comm: *const c_void, cuda_device: c_int, timeout_ms: i64,
                                          comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_wrap_nccl(nccl_comm: *mut c_void, comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_gloo(init_method: *const c_char, rank: c_int, size: c_int, comm: *mut ddp_comm_t)
                              -> ddp_status_t;
    pub fn ddp_comm_init_gloo_timeout(init_method: *const c_char, rank: c_int, size: c_int, timeout_ms: i64,
                                      comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_nccl_store(init_method: *const c_char, rank: c_int, size: c_int, cuda_device: c_int,
                                    comm: *mut ddp_comm_t) -> ddp_status_t;
    pub fn ddp_comm_init_nccl_store_timeout(init_method: *const c_char, rank: c_int, size: c_int,
                                            cuda_device: c_int, timeout_ms: i64, comm: *mut ddp_comm_t)
                                            -> ddp_status_t;
    pub fn ddp_comm_rank(comm: ddp_comm_t, rank: *mut c_int) -> ddp_status_t;
    pub fn ddp_comm_size(comm: ddp_comm_t, size: *mut c_int) -> ddp_status_t;
    pub fn ddp_comm_destroy(comm: ddp_comm_t) -> ddp_status_t;
    pub fn ddp_config_init_sized(config: *mut ddp_config_t, size: usize) -> ddp_status_t;
    /// The 0.1 symbol: writes the first version's fields only. Call ddp_config_init_sized instead.
    pub fn ddp_config_init(config: *mut ddp_config_t) -> ddp_status_t;
    pub fn ddp_create(comm: ddp_comm_t, config: *const ddp_config_t, ddp: *mut ddp_t) -> ddp_status_t;
    pub fn ddp_register_grad(ddp: ddp_t, grad: *mut c_void, numel: usize, dtype: ddp_dtype_t, flags: c_uint,
                             index: *mut c_int) -> ddp_status_t;
    pub fn ddp_commit(ddp: ddp_t) -> ddp_status_t;
    pub fn ddp_grad_ptr(ddp: ddp_t, index: c_int, grad: *mut *mut c_void) -> ddp_status_t;
    pub fn ddp_set_grad_ptr(ddp: ddp_t, index: c_int, grad: *mut c_void) -> ddp_status_t;
    pub fn ddp_begin_backward(ddp: ddp_t, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_grad_ready(ddp: ddp_t, index: c_int) -> ddp_status_t;
    pub fn ddp_grad_ready_ptr(ddp: ddp_t, index: c_int, grad: *mut c_void) -> ddp_status_t;
    pub fn ddp_finish_backward(ddp: ddp_t, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_set_sync(ddp: ddp_t, enabled: c_int) -> ddp_status_t;
    pub fn ddp_reduce_all(ddp: ddp_t, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_broadcast(ddp: ddp_t, buffers: *const *mut c_void, counts: *const usize, dtypes: *const ddp_dtype_t,
                         n: c_int, root: c_int, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_synchronize(ddp: ddp_t) -> ddp_status_t;
    pub fn ddp_get_stats(ddp: ddp_t, stats: *mut ddp_stats_t) -> ddp_status_t;
    pub fn ddp_get_plan(ddp: ddp_t, num_buckets: *mut c_int, learned: *mut c_int) -> ddp_status_t;
    pub fn ddp_get_shard(ddp: ddp_t, bucket: c_int, info: *mut ddp_shard_info_t) -> ddp_status_t;
    pub fn ddp_grad_shard(ddp: ddp_t, index: c_int, first: *mut usize, count: *mut usize, shard_pos: *mut usize)
        -> ddp_status_t;
    pub fn ddp_param_ptr(ddp: ddp_t, index: c_int, param: *mut *mut c_void) -> ddp_status_t;
    pub fn ddp_broadcast_params(ddp: ddp_t, root: c_int, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_gather_params(ddp: ddp_t, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_wait_params(ddp: ddp_t, index: c_int, stream: *mut c_void) -> ddp_status_t;
    pub fn ddp_shard_norm(ddp: ddp_t, stream: *mut c_void, norm: *mut f64, nonfinite: *mut u64) -> ddp_status_t;
    pub fn ddp_get_bucket(ddp: ddp_t, bucket: c_int, info: *mut ddp_bucket_info_t, grads: *mut c_int,
                          capacity: usize) -> ddp_status_t;
    pub fn ddp_destroy(ddp: ddp_t) -> ddp_status_t;
    pub fn ddp_set_log_callback(log: ddp_log_fn, user: *mut c_void) -> ddp_status_t;
    pub fn ddp_join(ddp: ddp_t, all_joined_iteration: *mut i64) -> ddp_status_t;
    pub fn ddp_allreduce_host(ddp: ddp_t, buf: *mut c_void, count: usize, dtype: ddp_dtype_t, op: c_int)
        -> ddp_status_t;
    pub fn ddp_barrier(ddp: ddp_t) -> ddp_status_t;
    pub fn ddp_set_comm_hook(ddp: ddp_t, hook: ddp_comm_hook_fn, user_data: *mut c_void) -> ddp_status_t;
    pub fn ddp_comm_allreduce(comm: ddp_comm_t, buf: *mut c_void, count: usize, dtype: ddp_dtype_t, op: c_int,
                              stream: *mut c_void) -> ddp_status_t;
}
