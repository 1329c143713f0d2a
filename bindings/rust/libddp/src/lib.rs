//! Safe Rust API over libddp. `Comm` and `Ddp` own their handles (`Drop` destroys them); every call
//! returns `Result<_, Error>` carrying the library's status and message. Host grads are borrowed
//! mutable slices (the borrow lasts as long as the `Ddp`); device grads go through `unsafe` pointers.
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

fn check(status: sys::ddp_status_t) -> Result<()> {
    if status == sys::DDP_SUCCESS {
        return Ok(());
    }
    let message = unsafe { CStr::from_ptr(sys::ddp_last_error()) }.to_string_lossy().into_owned();
    Err(Error { status, message })
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
pub enum Dtype {
    F16 = 0,
    BF16 = 1,
    F32 = 2,
    F64 = 3,
}

/// A communicator.
pub struct Comm {
    raw: sys::ddp_comm_t,
}

// The library's communicators may be used from any thread.
unsafe impl Send for Comm {}

impl Comm {
    /// Host memory over MPI_COMM_WORLD (libddp initializes MPI if needed). Collective.
    pub fn mpi() -> Result<Comm> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::ddp_comm_init_mpi(ptr::null(), &mut raw) })?;
        Ok(Comm { raw })
    }
    /// One rank, no MPI.
    pub fn single() -> Result<Comm> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::ddp_comm_init_self(&mut raw) })?;
        Ok(Comm { raw })
    }
    /// Device memory over NCCL, with the id made on rank 0 of MPI_COMM_WORLD. Collective.
    pub fn nccl_mpi(cuda_device: i32) -> Result<Comm> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::ddp_comm_init_nccl_mpi(ptr::null(), cuda_device, &mut raw) })?;
        Ok(Comm { raw })
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
    pub fn as_raw(&self) -> sys::ddp_comm_t {
        self.raw
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        unsafe { sys::ddp_comm_destroy(self.raw) };
    }
}

/// The configuration (ddp_config_t) with the library's defaults.
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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            message_size: 10_000_000,
            delay_allreduce: false,
            arena: false,
            registration_plan: false,
            allreduce_always_fp32: false,
            gradient_average: true,
            gradient_predivide_factor: 1.0,
            num_streams: 1,
            timeout_ms: 300_000,
            unused_zero: false,
            timeline_path: None,
            check_finite: false,
            inplace_min_numel: 0,
            host_piece_bytes: 0,
            stall_warning_ms: 0,
            shard: false,
        }
    }
}

/// One DDP context. `'g` is the lifetime of the host grads it borrows.
pub struct Ddp<'g> {
    raw: sys::ddp_t,
    _grads: PhantomData<&'g mut [u8]>,
}

unsafe impl Send for Ddp<'_> {}

impl<'g> Ddp<'g> {
    /// Makes a context over `comm` (duplicated: `comm` may be dropped afterwards). Collective.
    pub fn new(comm: &Comm, config: &Config) -> Result<Ddp<'g>> {
        let mut c = std::mem::MaybeUninit::<sys::ddp_config_t>::uninit();
        check(unsafe { sys::ddp_config_init_sized(c.as_mut_ptr(), std::mem::size_of::<sys::ddp_config_t>()) })?;
        let mut c = unsafe { c.assume_init() };
        c.message_size = config.message_size;
        c.delay_allreduce = config.delay_allreduce as c_int;
        c.layout = if config.arena { sys::DDP_LAYOUT_ARENA } else { sys::DDP_LAYOUT_COPY };
        c.plan_order = if config.registration_plan { sys::DDP_PLAN_REGISTRATION } else { sys::DDP_PLAN_LEARNED };
        c.allreduce_always_fp32 = config.allreduce_always_fp32 as c_int;
        c.gradient_average = config.gradient_average as c_int;
        c.gradient_predivide_factor = config.gradient_predivide_factor;
        c.num_streams = config.num_streams;
        c.timeout_ms = config.timeout_ms;
        c.unused_policy = if config.unused_zero { sys::DDP_UNUSED_ZERO } else { sys::DDP_UNUSED_ERROR };
        c.check_finite = config.check_finite as c_int;
        c.inplace_min_numel = config.inplace_min_numel;
        c.host_piece_bytes = config.host_piece_bytes;
        c.stall_warning_ms = config.stall_warning_ms;
        c.shard = config.shard as c_int;
        let path = match &config.timeline_path {
            Some(p) => Some(CString::new(p.as_str()).map_err(|_| Error {
                status: sys::DDP_ERR_INVALID_ARGUMENT,
                message: "timeline_path holds a NUL byte".into(),
            })?),
            None => None,
        };
        c.timeline_path = path.as_ref().map_or(ptr::null(), |p| p.as_ptr()); // copied by ddp_create
        let mut raw = ptr::null_mut();
        check(unsafe { sys::ddp_create(comm.raw, &c, &mut raw) })?;
        Ok(Ddp { raw, _grads: PhantomData })
    }

    /// Registers a host grad (copy layout); returns its index. The slice stays borrowed while `self` lives.
    pub fn register<T: Element>(&mut self, grad: &'g mut [T]) -> Result<i32> {
        let mut idx: c_int = 0;
        check(unsafe {
            sys::ddp_register_grad(self.raw, grad.as_mut_ptr() as *mut c_void, grad.len(), T::DTYPE, 0, &mut idx)
        })?;
        Ok(idx)
    }

    /// Registers a grad by pointer: device memory for an NCCL comm, or NULL in the arena layout.
    ///
    /// # Safety
    /// `grad` must hold `numel` elements of `dtype` in the comm's memory kind and stay valid (and not be
    /// written during reduction) while the context uses it.
    pub unsafe fn register_ptr(&mut self, grad: *mut c_void, numel: usize, dtype: Dtype, trigger: bool) -> Result<i32> {
        let mut idx: c_int = 0;
        let flags = if trigger { sys::DDP_GRAD_TRIGGER } else { 0 };
        check(sys::ddp_register_grad(self.raw, grad, numel, dtype as c_int, flags, &mut idx))?;
        Ok(idx)
    }

    /// Closes registration (collective; implied by the first backward).
    pub fn commit(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_commit(self.raw) })
    }
    /// Where grad `index` lives (the library's view in the arena layout).
    pub fn grad_ptr(&mut self, index: i32) -> Result<*mut c_void> {
        let mut p = ptr::null_mut();
        check(unsafe { sys::ddp_grad_ptr(self.raw, index, &mut p) })?;
        Ok(p)
    }
    /// Host memory in the arena layout: grad `index` as a slice of `T` with `numel` elements.
    pub fn arena_slice<T: Element>(&mut self, index: i32, numel: usize) -> Result<&mut [T]> {
        let p = self.grad_ptr(index)?;
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut T, numel) })
    }
    pub fn begin_backward(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_begin_backward(self.raw, ptr::null_mut()) })
    }
    /// # Safety
    /// `stream` must be a valid cudaStream_t of the comm's device (or NULL).
    pub unsafe fn begin_backward_on(&mut self, stream: *mut c_void) -> Result<()> {
        check(sys::ddp_begin_backward(self.raw, stream))
    }
    /// The hook: grad `index` is final for this iteration. Thread-safe in the library; `&self` here.
    pub fn grad_ready(&self, index: i32) -> Result<()> {
        check(unsafe { sys::ddp_grad_ready(self.raw, index) })
    }
    pub fn finish_backward(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_finish_backward(self.raw, ptr::null_mut()) })
    }
    /// # Safety
    /// As `begin_backward_on`.
    pub unsafe fn finish_backward_on(&mut self, stream: *mut c_void) -> Result<()> {
        check(sys::ddp_finish_backward(self.raw, stream))
    }
    pub fn set_sync(&mut self, enabled: bool) -> Result<()> {
        check(unsafe { sys::ddp_set_sync(self.raw, enabled as c_int) })
    }
    pub fn reduce_all(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_reduce_all(self.raw, ptr::null_mut()) })
    }
    /// Broadcasts `buf` from `root`. Collective.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: i32) -> Result<()> {
        let p = buf.as_mut_ptr() as *mut c_void;
        let n = buf.len();
        let d = T::DTYPE;
        check(unsafe { sys::ddp_broadcast(self.raw, &p, &n, &d, 1, root, ptr::null_mut()) })
    }
    pub fn synchronize(&mut self) -> Result<()> {
        check(unsafe { sys::ddp_synchronize(self.raw) })
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

impl Drop for Ddp<'_> {
    fn drop(&mut self) {
        unsafe { sys::ddp_destroy(self.raw) };
    }
}
