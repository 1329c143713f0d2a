//! Safe Rust API over libddp. `Comm` and `Ddp` own their handles (`Drop` destroys them); every call
//! returns `Result<_, Error>` carrying the library's status and message. Host grads live in the
//! context: `Ddp::register` returns a `Grad<T>` handle (an index and a type, `Copy`), and
//! `Ddp::grad_mut` lends the grad's slice for one statement at a time, so a training loop writes a
//! grad and marks it ready in turn. Device grads go through `unsafe` pointers.
//!
//! ```no_run
//! use libddp::{Comm, Config, Ddp};
//!
//! fn main() -> Result<(), libddp::Error> {
//!     let comm = Comm::mpi()?;
//!     let mut ddp = Ddp::new(&comm, &Config::default())?;
//!     let layers = [1000usize, 10, 500]; // each layer's grad
//!     let grads = layers.iter().map(|&n| ddp.register::<f32>(n)).collect::<Result<Vec<_>, _>>()?;
//!     for step in 0..10 {
//!         ddp.begin_backward()?;
//!         for g in grads.iter().rev() {
//!             // backward: the last layer's grad is final first
//!             for (i, x) in ddp.grad_mut(g)?.iter_mut().enumerate() {
//!                 *x = (step * i) as f32;
//!             }
//!             ddp.grad_ready(g)?;
//!         }
//!         ddp.finish_backward()?; // every grad now holds the average over the ranks
//!         let first = ddp.grad(&grads[0])?[0];
//!         assert_eq!(first, 0.0);
//!     }
//!     Ok(())
//! }
//! ```
use std::cell::Cell;
use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::ptr;

pub use libddp_sys as sys;

/// A failed libddp call: its `ddp_status_t` and the library's detailed message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: i32,
    pub message: String,
}

impl Error {
    /// The library's fixed text for the status ("invalid argument", ...).
    pub fn status_text(&self) -> &'static str {
        status_string(self.status)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "libddp: {} ({}): {}", self.status_text(), self.status, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The fixed text of a status.
pub fn status_string(status: i32) -> &'static str {
    unsafe { CStr::from_ptr(sys::ddp_status_string(status)) }.to_str().unwrap_or("?")
}

/// The loaded library's version code (10000*major + 100*minor + patch).
pub fn version() -> i32 {
    unsafe { sys::ddp_version() }
}

/// `(rank, size, local_rank)` as the launcher that started this process set them (torchrun, Slurm's
/// srun, Open MPI's mpirun, MPICH's mpiexec), read as the init method "auto" reads them, without
/// making a comm: e.g. to pick the CUDA device (`local_rank % device count`) before
/// `Comm::nccl_store("auto", ...)`. `local_rank` is -1 when no variable gives it and the job may span
/// hosts. An error when no launcher's variables give a rank and a size, or two launchers' disagree.
pub fn launcher_ranks() -> Result<(i32, i32, i32)> {
    let (mut rank, mut size, mut local_rank): (c_int, c_int, c_int) = (0, 0, 0);
    check(unsafe { sys::ddp_launcher_ranks(&mut rank, &mut size, &mut local_rank) })?;
    Ok((rank, size, local_rank))
}

fn check(status: sys::ddp_status_t) -> Result<()> {
    if status == sys::DDP_SUCCESS {
        return Ok(());
    }
    let message = unsafe { CStr::from_ptr(sys::ddp_last_error()) }.to_string_lossy().into_owned();
    Err(Error { status, message })
}

/// The reduction of `Ddp::allreduce_host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Op {
    Sum = sys::DDP_OP_SUM,
    Avg = sys::DDP_OP_AVG,
    Max = sys::DDP_OP_MAX,
    Min = sys::DDP_OP_MIN,
}

/// Element types `Ddp::allreduce_host` and `Ddp::broadcast` take.
pub trait HostElement: Copy {
    const HOST_DTYPE: sys::ddp_dtype_t;
}
impl HostElement for f32 {
    const HOST_DTYPE: sys::ddp_dtype_t = sys::DDP_F32;
}
impl HostElement for f64 {
    const HOST_DTYPE: sys::ddp_dtype_t = sys::DDP_F64;
}
impl HostElement for i32 {
    const HOST_DTYPE: sys::ddp_dtype_t = sys::DDP_I32;
}
impl HostElement for i64 {
    const HOST_DTYPE: sys::ddp_dtype_t = sys::DDP_I64;
}

/// Element types of host grads.
pub trait Element: Copy {
    const DTYPE: sys::ddp_dtype_t;
}
impl Element for f32 {
    const DTYPE: sys::ddp_dtype_t = sys::DDP_F32;
}
impl Element for f64 {
    const DTYPE: sys::ddp_dtype_t = sys::DDP_F64;
}

/// Element types by name, for device grads and arena registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Dtype {
    F16 = sys::DDP_F16,
    BF16 = sys::DDP_BF16,
    F32 = sys::DDP_F32,
    F64 = sys::DDP_F64,
}

/// A communicator.
pub struct Comm {
    raw: sys::ddp_comm_t,
    device: bool, // reduces device memory (NCCL): host slices of its grads would be wrong
}

// The library's communicators may be used from any thread.
unsafe impl Send for Comm {}

impl Comm {
    fn make(device: bool, init: impl FnOnce(*mut sys::ddp_comm_t) -> sys::ddp_status_t) -> Result<Comm> {
        let mut raw = ptr::null_mut();
        check(init(&mut raw))?;
        Ok(Comm { raw, device })
    }
    /// Host memory over MPI_COMM_WORLD (libddp initializes MPI if needed). Collective.
    pub fn mpi() -> Result<Comm> {
        Comm::make(false, |raw| unsafe { sys::ddp_comm_init_mpi(ptr::null(), raw) })
    }
    /// Host memory over Gloo (TCP), needing no MPI: processes started by any launcher meet through
    /// `init_method`: "env://" (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them;
    /// without RANK or WORLD_SIZE, as "auto"), "auto" (rank, size and rendezvous from whichever
    /// launcher started the process: torchrun, srun, mpirun, mpiexec), "tcp://HOST:PORT" or
    /// "file:///DIR". `rank` and `size` of None are read from RANK and WORLD_SIZE (with "auto", from
    /// the launcher). Collective; bounded by DDP_INIT_TIMEOUT_MS (default 300 s).
    pub fn gloo(init_method: &str, rank: Option<i32>, size: Option<i32>) -> Result<Comm> {
        let method = c_method(init_method)?;
        let (r, n) = (rank.unwrap_or(-1), size.unwrap_or(-1));
        Comm::make(false, |raw| unsafe { sys::ddp_comm_init_gloo(method.as_ptr(), r, n, raw) })
    }
    /// As `gloo`, bounded by `timeout_ms` milliseconds (0 waits forever).
    pub fn gloo_timeout(init_method: &str, rank: Option<i32>, size: Option<i32>, timeout_ms: i64) -> Result<Comm> {
        let method = c_method(init_method)?;
        let (r, n) = (rank.unwrap_or(-1), size.unwrap_or(-1));
        Comm::make(false, |raw| unsafe { sys::ddp_comm_init_gloo_timeout(method.as_ptr(), r, n, timeout_ms, raw) })
    }
    /// A joiner's comm: joins a running elastic job over `init_method`'s store (as in `gloo`; a TCP
    /// store must outlive the ranks that died: `ddp_launch --elastic`). No rank until admitted: make
    /// an elastic `Ddp` over it, register the job's grads, then `Ddp::recover` waits for the job to
    /// admit it (up to `timeout_ms`, 0: forever) and returns the membership; take `source`'s state.
    pub fn join_gloo(init_method: &str, timeout_ms: i64) -> Result<Comm> {
        let method = c_method(init_method)?;
        Comm::make(false, |raw| unsafe { sys::ddp_comm_join_gloo(method.as_ptr(), timeout_ms, raw) })
    }
    /// Device memory over NCCL needing no MPI: the ranks meet as in `gloo` and rank 0's NCCL id
    /// travels over a Gloo comm. Collective; bounded as `gloo`.
    pub fn nccl_store(init_method: &str, rank: Option<i32>, size: Option<i32>, cuda_device: i32) -> Result<Comm> {
        let method = c_method(init_method)?;
        let (r, n) = (rank.unwrap_or(-1), size.unwrap_or(-1));
        Comm::make(true, |raw| unsafe { sys::ddp_comm_init_nccl_store(method.as_ptr(), r, n, cuda_device, raw) })
    }
    /// A joiner's comm for an elastic job whose ranks use `nccl_store`: admitted as in `join_gloo`,
    /// then it makes an NCCL comm on `cuda_device` with the job's ranks. Bounded as `join_gloo`.
    pub fn join_nccl(init_method: &str, cuda_device: i32, timeout_ms: i64) -> Result<Comm> {
        let method = c_method(init_method)?;
        Comm::make(true, |raw| unsafe { sys::ddp_comm_join_nccl(method.as_ptr(), cuda_device, timeout_ms, raw) })
    }
    /// One rank, no MPI.
    pub fn single() -> Result<Comm> {
        Comm::make(false, |raw| unsafe { sys::ddp_comm_init_self(raw) })
    }
    /// Device memory over NCCL, with the id made on rank 0 of MPI_COMM_WORLD. Collective.
    pub fn nccl_mpi(cuda_device: i32) -> Result<Comm> {
        Comm::make(true, |raw| unsafe { sys::ddp_comm_init_nccl_mpi(ptr::null(), cuda_device, raw) })
    }
    pub fn rank(&self) -> Result<i32> {
        let mut v: c_int = 0;
        check(unsafe { sys::ddp_comm_rank(self.raw, &mut v) })?;
        Ok(v)
    }
    pub fn size(&self) -> Result<i32> {
        let mut v: c_int = 0;
        check(unsafe { sys::ddp_comm_size(self.raw, &mut v) })?;
        Ok(v)
    }
    /// Whether the communicator reduces device memory (NCCL).
    pub fn is_device(&self) -> bool {
        self.device
    }
    pub fn as_raw(&self) -> sys::ddp_comm_t {
        self.raw
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        unsafe { sys::ddp_comm_destroy(self.raw) };
    }
}

/// The configuration (ddp_config_t). `Config::default()` holds the library's defaults, as
/// `ddp_config_init` writes them: this crate restates none.
#[derive(Clone, Debug)]
pub struct Config {
    pub message_size: usize,
    pub delay_allreduce: bool,
    pub arena: bool,
    pub registration_plan: bool,
    pub allreduce_always_fp32: bool,
    pub gradient_average: bool,
    pub gradient_predivide_factor: f64,
    pub num_streams: i32,
    pub timeout_ms: i64,
    pub unused_zero: bool,
    pub timeline_path: Option<String>,
    pub check_finite: bool,
    pub inplace_min_numel: usize,
    /// Host memory: bytes per collective piece; 0 lets the library choose, else at least 4096.
    pub host_piece_bytes: usize,
    /// Warn (through the log callback) when a bucket has waited this long; 0: the library's 60 s.
    pub stall_warning_ms: i64,
    /// Sharded reduction (reduce-scatter; needs `arena` and `registration_plan`).
    pub shard: bool,
    /// The wire of f32/f64 buckets: `sys::DDP_COMPRESS_NONE`, `_BF16`, `_FP16` or `_INT8`.
    pub compression: i32,
    /// Uneven inputs (`Ddp::join`): `sys::DDP_UNEVEN_OFF`, `_BY_CONTRIBUTORS` or `_BY_WORLD`.
    pub uneven_inputs: i32,
    /// Elastic (0/1): a lost peer ends the call with `DDP_ERR_RANK_LOST`; `Ddp::recover` goes on.
    pub elastic: i32,
    /// Warn when a rank is this many ms late in 8 of 10 iterations (0: the library's choice, 100).
    pub straggler_warning_ms: i64,
}

// The library's defaults for this crate's ddp_config_t (the sized call: the unsized symbol writes
// version 1 only).
fn raw_defaults() -> Result<sys::ddp_config_t> {
    let mut c = std::mem::MaybeUninit::<sys::ddp_config_t>::zeroed();
    check(unsafe { sys::ddp_config_init_sized(c.as_mut_ptr(), std::mem::size_of::<sys::ddp_config_t>()) })?;
    Ok(unsafe { c.assume_init() })
}

impl Default for Config {
    fn default() -> Self {
        let c = raw_defaults().expect("ddp_config_init_sized refused this crate's own ddp_config_t");
        let path = (!c.timeline_path.is_null())
            .then(|| unsafe { CStr::from_ptr(c.timeline_path) }.to_string_lossy().into_owned());
        Config {
            message_size: c.message_size,
            delay_allreduce: c.delay_allreduce != 0,
            arena: c.layout == sys::DDP_LAYOUT_ARENA,
            registration_plan: c.plan_order == sys::DDP_PLAN_REGISTRATION,
            allreduce_always_fp32: c.allreduce_always_fp32 != 0,
            gradient_average: c.gradient_average != 0,
            gradient_predivide_factor: c.gradient_predivide_factor,
            num_streams: c.num_streams,
            timeout_ms: c.timeout_ms,
            unused_zero: c.unused_policy == sys::DDP_UNUSED_ZERO,
            timeline_path: path,
            check_finite: c.check_finite != 0,
            inplace_min_numel: c.inplace_min_numel,
            host_piece_bytes: c.host_piece_bytes,
            stall_warning_ms: c.stall_warning_ms,
            shard: c.shard != 0,
            compression: c.compression,
            uneven_inputs: c.uneven_inputs,
            elastic: c.elastic,
            straggler_warning_ms: c.straggler_warning_ms,
        }
    }
}

impl Config {
    // The raw config: the library's defaults with every field of `self` written over them.
    // `timeline_path` is the caller's C string (copied by ddp_create), or NULL.
    fn to_raw(&self, timeline_path: Option<&CString>) -> Result<sys::ddp_config_t> {
        let mut c = raw_defaults()?;
        c.message_size = self.message_size;
        c.delay_allreduce = self.delay_allreduce as c_int;
        c.layout = if self.arena { sys::DDP_LAYOUT_ARENA } else { sys::DDP_LAYOUT_COPY };
        c.plan_order = if self.registration_plan { sys::DDP_PLAN_REGISTRATION } else { sys::DDP_PLAN_LEARNED };
        c.allreduce_always_fp32 = self.allreduce_always_fp32 as c_int;
        c.gradient_average = self.gradient_average as c_int;
        c.gradient_predivide_factor = self.gradient_predivide_factor;
        c.num_streams = self.num_streams;
        c.timeout_ms = self.timeout_ms;
        c.unused_policy = if self.unused_zero { sys::DDP_UNUSED_ZERO } else { sys::DDP_UNUSED_ERROR };
        c.timeline_path = timeline_path.map_or(ptr::null(), |p| p.as_ptr());
        c.check_finite = self.check_finite as c_int;
        c.inplace_min_numel = self.inplace_min_numel;
        c.host_piece_bytes = self.host_piece_bytes;
        c.stall_warning_ms = self.stall_warning_ms;
        c.shard = self.shard as c_int;
        c.compression = self.compression;
        c.uneven_inputs = self.uneven_inputs;
        c.elastic = self.elastic;
        c.straggler_warning_ms = self.straggler_warning_ms;
        Ok(c)
    }
}

/// A host grad registered with `Ddp::register`: its index in the context and its element type.
/// A plain value (`Copy`): it borrows nothing, so a loop may hold every handle while it writes the
/// grads through `Ddp::grad_mut`.
pub struct Grad<T> {
    index: i32,
    numel: usize,
    _type: PhantomData<fn() -> T>,
}

impl<T> Grad<T> {
    /// The grad's index in its context (what `ddp_register_grad` returned).
    pub fn index(&self) -> i32 {
        self.index
    }
    /// Its number of elements.
    pub fn len(&self) -> usize {
        self.numel
    }
    pub fn is_empty(&self) -> bool {
        self.numel == 0
    }
}

impl<T> Clone for Grad<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Grad<T> {}
impl<T> fmt::Debug for Grad<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Grad({}, {} elements)", self.index, self.numel)
    }
}

/// What names a grad in `grad_ready`: a `Grad<T>` handle or a raw index (from `register_ptr`).
pub trait GradIndex {
    fn grad_index(&self) -> i32;
}
impl GradIndex for i32 {
    fn grad_index(&self) -> i32 {
        *self
    }
}
impl<T> GradIndex for Grad<T> {
    fn grad_index(&self) -> i32 {
        self.index
    }
}
impl<T> GradIndex for &Grad<T> {
    fn grad_index(&self) -> i32 {
        self.index
    }
}

// One registered grad as this binding knows it. `owned`: the copy layout's storage of a grad
// registered with `register`, made and freed here (8-byte words, aligned for f32 and f64); the library
// holds a pointer to it, so it is only ever reached through raw pointers.
struct Slot {
    numel: usize,
    dtype: sys::ddp_dtype_t,
    owned: *mut u64,
    words: usize,
    ready: Cell<bool>, // marked ready in the backward pass in progress: the library may be reducing it
}

fn c_method(init_method: &str) -> Result<CString> {
    CString::new(init_method).map_err(|_| invalid(sys::DDP_ERR_INVALID_ARGUMENT, "init_method holds a NUL byte".into()))
}

fn invalid(status: i32, message: String) -> Error {
    Error { status, message }
}

fn dtype_name(d: sys::ddp_dtype_t) -> &'static str {
    match d {
        sys::DDP_F16 => "f16",
        sys::DDP_BF16 => "bf16",
        sys::DDP_F32 => "f32",
        sys::DDP_F64 => "f64",
        _ => "an unknown dtype",
    }
}

// Zeroed storage for `numel` elements of `size` bytes, as 8-byte words; Err (not an abort) when it
// cannot be had.
fn zeroed_words(numel: usize, size: usize) -> Result<(*mut u64, usize)> {
    let too_big = || invalid(sys::DDP_ERR_OUT_OF_MEMORY, format!("register: no memory for {numel} elements"));
    let words = numel.checked_mul(size).ok_or_else(too_big)?.div_ceil(8).max(1);
    let mut v: Vec<u64> = Vec::new();
    v.try_reserve_exact(words).map_err(|_| too_big())?;
    v.resize(words, 0);
    Ok((Box::into_raw(v.into_boxed_slice()) as *mut u64, words))
}

/// One DDP context.
///
/// Host grads belong to the context: `register::<f32>(n)` makes one (zeros) and returns its handle;
/// `grad_mut(&g)` and `grad(&g)` lend its elements. A grad marked ready in the backward pass in
/// progress may be in the library's hands (its bucket is being reduced), so lending it then is an
/// `Err` until `finish_backward` returns; so is any grad once a reduction failed (a timed-out
/// collective may still touch it: drop the context).
pub struct Ddp {
    raw: sys::ddp_t,
    slots: Vec<Slot>,
    arena: bool,
    device: bool,
    in_backward: bool,
    failed: Cell<bool>,
}

unsafe impl Send for Ddp {}

impl Ddp {
    /// Makes a context over `comm` (duplicated: `comm` may be dropped afterwards). Collective.
    pub fn new(comm: &Comm, config: &Config) -> Result<Ddp> {
        let path = match &config.timeline_path {
            Some(p) => Some(
                CString::new(p.as_str())
                    .map_err(|_| invalid(sys::DDP_ERR_INVALID_ARGUMENT, "timeline_path holds a NUL byte".into()))?,
            ),
            None => None,
        };
        let c = config.to_raw(path.as_ref())?;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::ddp_create(comm.raw, &c, &mut raw) })?;
        Ok(Ddp {
            raw,
            slots: Vec::new(),
            arena: config.arena,
            device: comm.device,
            in_backward: false,
            failed: Cell::new(false),
        })
    }

    /// Registers a host grad of `numel` elements of `T`, zeros, owned by the context: in the copy layout
    /// a buffer made here, in the arena layout the library's arena. Returns its handle; the elements are
    /// `grad_mut(&g)` / `grad(&g)`. Only while registration is open (before `commit` or the first backward).
    pub fn register<T: Element>(&mut self, numel: usize) -> Result<Grad<T>> {
        if self.device {
            return Err(invalid(
                sys::DDP_ERR_INVALID_ARGUMENT,
                "register: host grads on a device (NCCL) communicator; device grads go through register_ptr".into(),
            ));
        }
        let (owned, words) =
            if self.arena { (ptr::null_mut(), 0) } else { zeroed_words(numel, std::mem::size_of::<T>())? };
        let index = match self.register_raw(owned as *mut c_void, numel, T::DTYPE, 0) {
            Ok(i) => i,
            Err(e) => {
                if !owned.is_null() {
                    drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(owned, words)) });
                }
                return Err(e);
            }
        };
        self.slots.push(Slot { numel, dtype: T::DTYPE, owned, words, ready: Cell::new(false) });
        Ok(Grad { index, numel, _type: PhantomData })
    }

    fn register_raw(&mut self, grad: *mut c_void, numel: usize, dtype: sys::ddp_dtype_t, flags: u32) -> Result<i32> {
        let mut idx: c_int = 0;
        check(unsafe { sys::ddp_register_grad(self.raw, grad, numel, dtype, flags, &mut idx) })?;
        Ok(idx)
    }

    /// Registers a grad by pointer: device memory for an NCCL comm, or NULL in the arena layout.
    ///
    /// # Safety
    /// `grad` must hold `numel` elements of `dtype` in the comm's memory kind and stay valid (and not be
    /// written during reduction) while the context uses it.
    pub unsafe fn register_ptr(&mut self, grad: *mut c_void, numel: usize, dtype: Dtype, trigger: bool) -> Result<i32> {
        let flags = if trigger { sys::DDP_GRAD_TRIGGER } else { 0 };
        let idx = self.register_raw(grad, numel, dtype as c_int, flags)?;
        self.slots.push(Slot {
            numel,
            dtype: dtype as c_int,
            owned: ptr::null_mut(),
            words: 0,
            ready: Cell::new(false),
        });
        Ok(idx)
    }

    /// Closes registration (collective; implied by the first backward).
    pub fn commit(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_commit(self.raw) })
    }
    /// Where grad `index` lives (the library's view in the arena layout).
    pub fn grad_ptr(&mut self, index: i32) -> Result<*mut c_void> {
        self.raw_ptr(index)
    }
    fn raw_ptr(&self, index: i32) -> Result<*mut c_void> {
        let mut p = ptr::null_mut();
        check(unsafe { sys::ddp_grad_ptr(self.raw, index, &mut p) })?;
        Ok(p)
    }

    // The slot of `index` if its host elements may be lent now as `numel` elements of `T`.
    fn lendable<T: Element>(&self, what: &str, index: i32, numel: usize) -> Result<&Slot> {
        let bad = |m: String| Err(invalid(sys::DDP_ERR_INVALID_ARGUMENT, format!("{what}: {m}")));
        let slot = match usize::try_from(index).ok().and_then(|i| self.slots.get(i)) {
            Some(s) => s,
            None => return bad(format!("grad index {index} out of range ({} grads registered)", self.slots.len())),
        };
        if slot.dtype != T::DTYPE {
            return bad(format!(
                "grad {index} holds {}, not the {} asked for",
                dtype_name(slot.dtype),
                dtype_name(T::DTYPE)
            ));
        }
        if numel > slot.numel {
            return bad(format!("{numel} elements asked of grad {index}, which has {}", slot.numel));
        }
        if self.device {
            return bad("the grads of a device (NCCL) communicator are not host memory".into());
        }
        if self.failed.get() {
            let m = format!("{what}: a reduction failed; its collectives may still use the grads: drop the context");
            return Err(invalid(sys::DDP_ERR_ABORTED, m));
        }
        if self.in_backward && slot.ready.get() {
            let m = format!("{what}: grad {index} is marked ready and may be being reduced until finish_backward");
            return Err(invalid(sys::DDP_ERR_INVALID_STATE, m));
        }
        Ok(slot)
    }

    fn host_ptr<T: Element>(&self, what: &str, index: i32, numel: usize) -> Result<*mut T> {
        let slot = self.lendable::<T>(what, index, numel)?;
        if !slot.owned.is_null() {
            return Ok(slot.owned as *mut T);
        }
        if !self.arena {
            let m = format!("{what}: grad {index} is the caller's memory (register_ptr), not the context's");
            return Err(invalid(sys::DDP_ERR_INVALID_STATE, m));
        }
        Ok(self.raw_ptr(index)? as *mut T) // the arena moves once, with the learned plan: asked every time
    }

    /// The elements of grad `g`, to write (the backward pass's result, or zeros). The borrow lasts as
    /// long as the returned slice; `Err` while the grad is marked ready in a backward pass in progress.
    /// The first call in the arena layout closes registration (collective).
    pub fn grad_mut<T: Element>(&mut self, g: &Grad<T>) -> Result<&mut [T]> {
        let p = self.host_ptr::<T>("grad_mut", g.index, g.numel)?;
        Ok(unsafe { std::slice::from_raw_parts_mut(p, g.numel) })
    }
    /// The elements of grad `g` (after `finish_backward`, the reduced values).
    pub fn grad<T: Element>(&self, g: &Grad<T>) -> Result<&[T]> {
        let p = self.host_ptr::<T>("grad", g.index, g.numel)?;
        Ok(unsafe { std::slice::from_raw_parts(p, g.numel) })
    }
    /// Host memory in the arena layout: the first `numel` elements of grad `index` (registered with
    /// `register_ptr(NULL, ...)`) as a slice of `T`. `Err` if `numel` exceeds the registered length, `T`
    /// is not the registered dtype, the layout is not the arena, or the grad may be being reduced.
    pub fn arena_slice<T: Element>(&mut self, index: i32, numel: usize) -> Result<&mut [T]> {
        if !self.arena {
            let m = "arena_slice: the context is not in the arena layout (use grad_mut)".to_string();
            return Err(invalid(sys::DDP_ERR_INVALID_STATE, m));
        }
        let p = self.host_ptr::<T>("arena_slice", index, numel)?;
        Ok(unsafe { std::slice::from_raw_parts_mut(p, numel) })
    }
    pub fn begin_backward(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_begin_backward(self.raw, ptr::null_mut()) })?;
        self.started();
        Ok(())
    }
    /// # Safety
    /// `stream` must be a valid cudaStream_t of the comm's device (or NULL).
    pub unsafe fn begin_backward_on(&mut self, stream: *mut c_void) -> Result<()> {
        check(sys::ddp_begin_backward(self.raw, stream))?;
        self.started();
        Ok(())
    }
    fn started(&mut self) {
        self.in_backward = true;
        for s in &self.slots {
            s.ready.set(false);
        }
    }
    /// The hook: grad `g` (a `Grad` handle or an index) is final for this iteration; until
    /// `finish_backward` the library may be reducing it. Thread-safe in the library; `&self` here.
    pub fn grad_ready(&self, g: impl GradIndex) -> Result<()> {
        let index = g.grad_index();
        self.settle(check(unsafe { sys::ddp_grad_ready(self.raw, index) }))?;
        if let Some(s) = usize::try_from(index).ok().and_then(|i| self.slots.get(i)) {
            s.ready.set(true);
        }
        Ok(())
    }
    /// Inside a backward pass, after `g` was marked ready: `Ok(true)` once its reduced value can be
    /// read (its bucket is reduced, later buckets may still travel; `grad` lends it from then on), so
    /// a trainer can update that layer before `finish_backward`; `Ok(false)` when nothing is launched
    /// for it yet (its bucket or an earlier one waits for grads, the first iteration of a learned
    /// plan, delay_allreduce, sync off, a sharded context): it is final after `finish_backward`.
    pub fn wait_grad(&self, g: impl GradIndex) -> Result<bool> {
        let index = g.grad_index();
        let mut reduced: c_int = 0;
        self.settle(check(unsafe { sys::ddp_wait_grad(self.raw, index, ptr::null_mut(), &mut reduced) }))?;
        if reduced != 0 {
            if let Some(s) = usize::try_from(index).ok().and_then(|i| self.slots.get(i)) {
                s.ready.set(false); // the library is done with it in this iteration
            }
        }
        Ok(reduced != 0)
    }
    // A fatal error leaves collectives that may still touch the grads; a refused call leaves none.
    fn settle(&self, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            let refused = [sys::DDP_ERR_INVALID_ARGUMENT, sys::DDP_ERR_INVALID_STATE, sys::DDP_ERR_UNSUPPORTED];
            if !refused.contains(&e.status) {
                self.failed.set(true);
            }
        }
        r
    }
    pub fn finish_backward(&mut self) -> Result<()> {
        let r = check(unsafe { sys::ddp_finish_backward(self.raw, ptr::null_mut()) });
        self.in_backward = false;
        self.settle(r)
    }
    /// # Safety
    /// As `begin_backward_on`.
    pub unsafe fn finish_backward_on(&mut self, stream: *mut c_void) -> Result<()> {
        let r = check(sys::ddp_finish_backward(self.raw, stream));
        self.in_backward = false;
        self.settle(r)
    }
    pub fn set_sync(&mut self, enabled: bool) -> Result<()> {
        check(unsafe { sys::ddp_set_sync(self.raw, enabled as c_int) })
    }
    pub fn reduce_all(&mut self) -> Result<()> {
        let r = check(unsafe { sys::ddp_reduce_all(self.raw, ptr::null_mut()) });
        self.settle(r)
    }
    /// Broadcasts `buf` from `root` (floats or integers: a step count as `i64`). Collective.
    pub fn broadcast<T: HostElement>(&mut self, buf: &mut [T], root: i32) -> Result<()> {
        let p = buf.as_mut_ptr() as *mut c_void;
        let n = buf.len();
        let d = T::HOST_DTYPE;
        check(unsafe { sys::ddp_broadcast(self.raw, &p, &n, &d, 1, root, ptr::null_mut()) })
    }
    pub fn synchronize(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_synchronize(self.raw) })
    }
    /// Uneven inputs (needs `Config::uneven_inputs`): this rank is out of data and shadows the others'
    /// iterations until every rank has joined; returns the synced iterations done by then. Collective.
    pub fn join(&mut self) -> Result<i64> {
        let mut at: i64 = 0;
        check(unsafe { sys::ddp_join(self.raw, &mut at) })?;
        Ok(at)
    }
    /// Reduces `buf` (the loss, metrics, token counts) across the ranks in place with `op`; every rank
    /// gets the same bits. Not inside a backward pass. Collective.
    pub fn allreduce_host<T: HostElement>(&mut self, buf: &mut [T], op: Op) -> Result<()> {
        check(unsafe {
            sys::ddp_allreduce_host(self.raw, buf.as_mut_ptr() as *mut c_void, buf.len(), T::HOST_DTYPE, op as c_int)
        })
    }
    /// Returns when every rank has called it (bounded by the timeout). Collective.
    pub fn barrier(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_barrier(self.raw) })
    }
    /// Elastic contexts, after a call failed with `DDP_ERR_RANK_LOST`: agrees with the other live ranks
    /// on the new membership and rebuilds the context over it; after `DDP_ERR_RANK_JOINING`: admits the
    /// processes that wait to join; on a joiner's context (`Comm::join_gloo`): asks to be admitted and
    /// waits. Returns the membership and, for each new rank, its number in the old world (-1: a
    /// joiner); every rank should then take the state of `source` (`broadcast`). Collective over the
    /// job's ranks and the joiners.
    pub fn recover(&mut self, old_world: usize) -> Result<(sys::ddp_membership_t, Vec<i32>)> {
        let mut m = sys::ddp_membership_t::default();
        let mut members = vec![-1 as c_int; (2 * old_world).max(4096)];
        check(unsafe { sys::ddp_recover(self.raw, &mut m, members.as_mut_ptr(), members.len()) })?;
        members.truncate(m.world.max(0) as usize);
        Ok((m, members))
    }
    pub fn stats(&self) -> Result<sys::ddp_stats_t> {
        let mut s = sys::ddp_stats_t { size: std::mem::size_of::<sys::ddp_stats_t>(), ..Default::default() };
        check(unsafe { sys::ddp_get_stats(self.raw, &mut s) })?;
        Ok(s)
    }
    /// The current plan: each bucket's info and grad indices.
    pub fn plan(&mut self) -> Result<Vec<(sys::ddp_bucket_info_t, Vec<i32>)>> {
        let (mut n, mut learned): (c_int, c_int) = (0, 0);
        check(unsafe { sys::ddp_get_plan(self.raw, &mut n, &mut learned) })?;
        let mut out = Vec::new();
        for b in 0..n {
            let mut info =
                sys::ddp_bucket_info_t { size: std::mem::size_of::<sys::ddp_bucket_info_t>(), ..Default::default() };
            check(unsafe { sys::ddp_get_bucket(self.raw, b, &mut info, ptr::null_mut(), 0) })?;
            let mut grads = vec![0 as c_int; info.num_grads as usize];
            check(unsafe { sys::ddp_get_bucket(self.raw, b, &mut info, grads.as_mut_ptr(), grads.len()) })?;
            out.push((info, grads));
        }
        Ok(out)
    }
    pub fn as_raw(&self) -> sys::ddp_t {
        self.raw
    }
}

impl Drop for Ddp {
    fn drop(&mut self) {
        unsafe { sys::ddp_destroy(self.raw) }; // waits for the context's work: then the buffers may go
        for s in &self.slots {
            if !s.owned.is_null() {
                drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(s.owned, s.words)) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Config::default() read back into a raw config is the library's defaults, field by field: no
    // field is lost or mapped wrong on the way in or out.
    #[test]
    fn default_config_is_the_librarys() {
        let raw = Config::default().to_raw(None).unwrap();
        assert_eq!(format!("{:?}", raw), format!("{:?}", raw_defaults().unwrap()));
        assert_eq!(raw.size, std::mem::size_of::<sys::ddp_config_t>());
        assert_eq!((raw.magic, raw.version), (sys::DDP_CONFIG_MAGIC, sys::DDP_CONFIG_VERSION));
    }
}
