// Misuse returns Err with the library's status and message (one rank, no MPI).
use libddp::{sys, Comm, Config, Ddp, Dtype};

#[test]
fn misuse_returns_err_with_status() {
    let comm = Comm::single().unwrap();
    assert_eq!((comm.rank().unwrap(), comm.size().unwrap()), (0, 1));
    let mut ddp = Ddp::new(&comm, &Config::default()).unwrap();
    let g = ddp.register::<f32>(8).unwrap();
    ddp.grad_mut(&g).unwrap().fill(1.0);
    let e = ddp.grad_ready(g).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_STATE);
    assert!(e.message.contains("no backward pass in progress"), "{}", e.message);
    assert_eq!(e.status_text(), "call not valid in the current state");
    ddp.begin_backward().unwrap();
    assert_eq!(ddp.begin_backward().unwrap_err().status, sys::DDP_ERR_INVALID_STATE);
    ddp.grad_ready(g).unwrap();
    assert_eq!(ddp.grad_ready(g).unwrap_err().status, sys::DDP_ERR_INVALID_STATE);
    assert_eq!(ddp.grad_ready(99).unwrap_err().status, sys::DDP_ERR_INVALID_ARGUMENT);
    // marked ready: the library may be reducing it until finish_backward
    let e = ddp.grad_mut(&g).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_STATE);
    assert!(e.message.contains("grad_mut: grad 0 is marked ready"), "{}", e.message);
    assert!(ddp.grad(&g).is_err());
    ddp.finish_backward().unwrap();
    assert_eq!(ddp.stats().unwrap().iterations, 1);
    assert!(ddp.grad(&g).unwrap().iter().all(|&x| x == 1.0)); // one rank: the average is the grad
    let e = unsafe { ddp.register_ptr(std::ptr::null_mut(), 4, Dtype::F32, false) }.unwrap_err();
    assert!(e.status == sys::DDP_ERR_INVALID_ARGUMENT || e.status == sys::DDP_ERR_INVALID_STATE, "{e}");
    let e = ddp.register::<f32>(4).unwrap_err(); // registration closed at the first backward
    assert_eq!(e.status, sys::DDP_ERR_INVALID_STATE, "{e}");
    let e = ddp.arena_slice::<f32>(g.index(), 8).unwrap_err();
    assert!(e.message.contains("not in the arena layout"), "{e}");
    drop(ddp);

    let bad = Config { gradient_predivide_factor: -1.0, ..Config::default() };
    let e = Ddp::new(&comm, &bad).err().expect("negative predivide must fail");
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT);
    assert!(format!("{e}").contains("invalid argument"));
    assert_eq!(libddp::version(), sys::DDP_VERSION_CODE);
}

#[test]
fn arena_slice_refuses_more_elements_than_registered_and_another_dtype() {
    let comm = Comm::single().unwrap();
    let cfg = Config { arena: true, registration_plan: true, ..Config::default() };
    let mut ddp = Ddp::new(&comm, &cfg).unwrap();
    let a = unsafe { ddp.register_ptr(std::ptr::null_mut(), 8, Dtype::F32, false) }.unwrap();
    let b = unsafe { ddp.register_ptr(std::ptr::null_mut(), 3, Dtype::F64, false) }.unwrap();
    ddp.commit().unwrap();
    // one element too many: before, a slice past the grad (a write through it could crash)
    let e = ddp.arena_slice::<f32>(a, 9).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT, "{e}");
    assert!(e.message.contains("arena_slice: 9 elements asked of grad 0, which has 8"), "{e}");
    let e = ddp.arena_slice::<f32>(a, usize::MAX).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT, "{e}");
    // f64 over an f32 grad would be twice its bytes
    let e = ddp.arena_slice::<f64>(a, 8).unwrap_err();
    assert!(e.message.contains("grad 0 holds f32, not the f64 asked for"), "{e}");
    let e = ddp.arena_slice::<f32>(7, 1).unwrap_err();
    assert!(e.message.contains("grad index 7 out of range (2 grads registered)"), "{e}");
    let e = ddp.arena_slice::<f32>(-1, 1).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT, "{e}");
    // the registered lengths and fewer are lent
    ddp.arena_slice::<f32>(a, 8).unwrap().fill(2.0);
    ddp.arena_slice::<f64>(b, 3).unwrap().fill(3.0);
    assert_eq!(ddp.arena_slice::<f32>(a, 5).unwrap().len(), 5);
    ddp.begin_backward().unwrap();
    ddp.grad_ready(b).unwrap();
    assert_eq!(ddp.arena_slice::<f64>(b, 3).unwrap_err().status, sys::DDP_ERR_INVALID_STATE);
    ddp.arena_slice::<f32>(a, 8).unwrap()[0] = 4.0; // not ready yet: still the caller's to write
    ddp.grad_ready(a).unwrap();
    ddp.finish_backward().unwrap();
    assert_eq!(ddp.arena_slice::<f32>(a, 8).unwrap()[..2], [4.0, 2.0]);
    assert!(ddp.arena_slice::<f64>(b, 3).unwrap().iter().all(|&x| x == 3.0));
}

#[test]
fn gloo_refuses_a_bad_method_and_a_nul_byte() {
    let e = Comm::gloo("a\0b", Some(0), Some(1)).err().expect("a NUL byte must fail");
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT);
    assert!(e.message.contains("NUL byte"), "{e}");
    let e = Comm::gloo("udp://host:1", Some(0), Some(2)).err().expect("udp:// must fail");
    if e.status != sys::DDP_ERR_UNSUPPORTED {
        // a build with Gloo: the method is named
        assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT, "{e}");
        assert!(e.message.contains("udp://host:1"), "{e}");
    }
}

#[test]
fn a_joiner_that_no_job_admits_times_out_saying_so() {
    let e = Comm::join_gloo("a\0b", 100).err().expect("a NUL byte must fail");
    assert_eq!(e.status, sys::DDP_ERR_INVALID_ARGUMENT);
    let dir = std::env::temp_dir().join(format!("libddp-rust-join-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let comm = match Comm::join_gloo(&format!("file://{}", dir.display()), 300) {
        Ok(c) => c,
        Err(e) => {
            assert_eq!(e.status, sys::DDP_ERR_UNSUPPORTED, "{e}"); // a build without Gloo
            return;
        }
    };
    let mut config = Config::default();
    config.elastic = 1;
    config.arena = false;
    let mut ddp = Ddp::new(&comm, &config).expect("an elastic context over a joiner's comm");
    let _g = ddp.register::<f32>(10).expect("registration before the admission");
    let e = ddp.recover(1).err().expect("no job: the admission times out");
    assert_eq!(e.status, sys::DDP_ERR_TIMEOUT, "{e}");
    assert!(e.message.contains("no running elastic job"), "{e}");
    let e = ddp.commit().err().expect("not admitted: the other calls refuse");
    assert_eq!(e.status, sys::DDP_ERR_RANK_JOINING, "{e}");
    drop(ddp);
    let _ = std::fs::remove_dir_all(&dir);
}

// wait_grad: "not yet" while the learned plan is recorded, then the reduced value before
// finish_backward (and `grad` lends it); refused outside a backward pass.
#[test]
fn wait_grad_lends_a_reduced_grad_before_finish() {
    let comm = Comm::single().unwrap();
    let mut ddp = Ddp::new(&comm, &Config::default()).unwrap();
    let a = ddp.register::<f32>(16).unwrap();
    let b = ddp.register::<f32>(16).unwrap();
    let e = ddp.wait_grad(a).unwrap_err();
    assert_eq!(e.status, sys::DDP_ERR_INVALID_STATE);
    assert!(e.message.contains("no backward pass in progress"), "{}", e.message);
    for it in 0..2 {
        ddp.grad_mut(&a).unwrap().fill(2.0);
        ddp.grad_mut(&b).unwrap().fill(3.0);
        ddp.begin_backward().unwrap();
        ddp.grad_ready(b).unwrap();
        ddp.grad_ready(a).unwrap();
        let reduced = ddp.wait_grad(a).unwrap();
        assert_eq!(reduced, it == 1, "iteration {it}: the first one learns the plan");
        if reduced {
            assert!(ddp.grad(&a).unwrap().iter().all(|&x| x == 2.0));
        } else {
            assert!(ddp.grad(&a).is_err());
        }
        ddp.finish_backward().unwrap();
    }
}
