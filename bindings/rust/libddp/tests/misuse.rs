// Misuse returns Err with the library's status and message (one rank, no MPI).
use libddp::{sys, Comm, Config, Ddp, Dtype};

#[test]
fn misuse_returns_err_with_status() {
    let comm = Comm::single().unwrap();
    assert_eq!((comm.rank().unwrap(), comm.size().unwrap()), (0, 1));
    let mut g = vec![1f32; 8];
    let mut ddp = Ddp::new(&comm, &Config::default()).unwrap();
    let i = ddp.register(g.as_mut_slice()).unwrap();
    let e = ddp.grad_ready(i).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_STATE);
    assert!(e.message.contains("no backward pass in progress"), "{}", e.message);
    assert_eq!(e.status_text(), "call not valid in the current state");
    ddp.begin_backward().unwrap();
    assert_eq!(ddp.begin_backward().unwrap_err().status, sys::DDP_ERR_INVALID_STATE);
    ddp.grad_ready(i).unwrap();
    assert_eq!(ddp.grad_ready(i).unwrap_err().status, sys::DDP_ERR_INVALID_STATE);
    assert_eq!(ddp.grad_ready(99).unwrap_err().status, sys::DDP_ERR_INVALID_ARGUMENT);
    ddp.finish_backward().unwrap();
    assert_eq!(ddp.stats().unwrap().iterations, 1);
    let e = unsafe { ddp.register_ptr(std::ptr::null_mut(), 4, Dtype::F32, false) }.unwrap_err();
    assert!(e.status == sys::DDP_ERR_INVALID_ARGUMENT || e.status == sys::DDP_ERR_INVALID_STATE, "{e}");
    drop(ddp);
    assert!(g.iter().all(|&x| x == 1.0));

    let bad = Config { gradient_predivide_factor: -1.0, ..Config::default() };
    let e = Ddp::new(&comm, &bad).err().expect("negative predivide must fail");
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT);
    assert!(format!("{e}").contains("invalid argument"));
    assert_eq!(libddp::version(), sys::DDP_VERSION_CODE);
}
