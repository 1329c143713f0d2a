// Run by `cargo test` alone (one rank) and under `mpirun -np 2 cargo test`, or with LIBDDP_TEST_GLOO=METHOD
// under any launcher (Comm::gloo, no MPI): every rank reduces f32 and f64 slices of its own data and
// checks the result against a float64 reference built from every rank's data. One #[test] so that
// every rank issues the same collectives in the same order.
use libddp::{Comm, Config, Ddp};

fn value(rank: i32, i: usize, salt: f64) -> f64 {
    ((rank as f64 + 1.0) * 0.37 + i as f64 * 0.011 + salt).sin()
}

#[test]
fn reduce_f32_and_f64_across_ranks() {
    let comm = match std::env::var("LIBDDP_TEST_GLOO") {
        Ok(method) => Comm::gloo(&method, None, None).expect("Comm::gloo"),
        Err(_) => Comm::mpi().expect("Comm::mpi"),
    };
    let (rank, world) = (comm.rank().unwrap(), comm.size().unwrap());
    for (average, predivide, arena) in [(true, 1.0, false), (true, 2.0, false), (false, 1.0, false), (true, 1.0, true)] {
        let cfg = Config {
            message_size: 300,
            gradient_average: average,
            gradient_predivide_factor: predivide,
            arena,
            registration_plan: arena,
            ..Config::default()
        };
        let scale = if average { 1.0 / world as f64 } else { 1.0 };
        let n32 = [1usize, 500, 77];
        let n64 = [129usize, 3];
        let a: Vec<Vec<f32>> = n32.iter().map(|&n| (0..n).map(|i| value(rank, i, 0.5) as f32).collect()).collect();
        let b: Vec<Vec<f64>> = n64.iter().map(|&n| (0..n).map(|i| value(rank, i, 1.5)).collect()).collect();
        let mut got32: Vec<Vec<f32>> = Vec::new();
        let mut got64: Vec<Vec<f64>> = Vec::new();
        {
            let mut ddp = Ddp::new(&comm, &cfg).expect("Ddp::new");
            let mut idx = Vec::new();
            let mut copy_handles = None;
            if arena {
                for &n in &n32 {
                    idx.push(unsafe { ddp.register_ptr(std::ptr::null_mut(), n, libddp::Dtype::F32, false) }.unwrap());
                }
                for &n in &n64 {
                    idx.push(unsafe { ddp.register_ptr(std::ptr::null_mut(), n, libddp::Dtype::F64, false) }.unwrap());
                }
                ddp.commit().unwrap();
                for (k, v) in a.iter().enumerate() {
                    ddp.arena_slice::<f32>(idx[k], v.len()).unwrap().copy_from_slice(v);
                }
                for (k, v) in b.iter().enumerate() {
                    ddp.arena_slice::<f64>(idx[3 + k], v.len()).unwrap().copy_from_slice(v);
                }
            } else {
                let (mut h32, mut h64) = (Vec::new(), Vec::new());
                for v in a.iter() {
                    let g = ddp.register::<f32>(v.len()).unwrap();
                    ddp.grad_mut(&g).unwrap().copy_from_slice(v);
                    idx.push(g.index());
                    h32.push(g);
                }
                for v in b.iter() {
                    let g = ddp.register::<f64>(v.len()).unwrap();
                    ddp.grad_mut(&g).unwrap().copy_from_slice(v);
                    idx.push(g.index());
                    h64.push(g);
                }
                copy_handles = Some((h32, h64));
            }
            ddp.begin_backward().unwrap();
            // a different ready order on every rank
            for k in 0..idx.len() {
                ddp.grad_ready(idx[(k + rank as usize) % idx.len()]).unwrap();
            }
            ddp.finish_backward().unwrap();
            assert!(ddp.plan().unwrap().len() >= 2);
            let s = ddp.stats().unwrap();
            assert_eq!((s.iterations, s.world_size, s.rank), (1, world, rank));
            if arena {
                for (k, &n) in n32.iter().enumerate() {
                    got32.push(ddp.arena_slice::<f32>(idx[k], n).unwrap().to_vec());
                }
                for (k, &n) in n64.iter().enumerate() {
                    got64.push(ddp.arena_slice::<f64>(idx[3 + k], n).unwrap().to_vec());
                }
            } else if let Some((h32, h64)) = &copy_handles {
                got32 = h32.iter().map(|g| ddp.grad(g).unwrap().to_vec()).collect();
                got64 = h64.iter().map(|g| ddp.grad(g).unwrap().to_vec()).collect();
            }
        }
        for (k, &n) in n32.iter().enumerate() {
            for i in 0..n {
                let want: f64 = (0..world).map(|r| value(r, i, 0.5) as f32 as f64).sum::<f64>() * scale;
                let got = got32[k][i] as f64;
                assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "f32 grad {k}[{i}]: {got} vs {want}");
            }
        }
        for (k, &n) in n64.iter().enumerate() {
            for i in 0..n {
                let want: f64 = (0..world).map(|r| value(r, i, 1.5)).sum::<f64>() * scale;
                let got = got64[k][i];
                assert!((got - want).abs() <= 1e-12 * want.abs().max(1.0), "f64 grad {k}[{i}]: {got} vs {want}");
            }
        }
    }
    // a registration that differs on the last rank: Err(MISMATCH) on every rank, never a hang
    if world > 1 {
        let mut ddp = Ddp::new(&comm, &Config::default()).unwrap();
        ddp.register::<f32>(10 + (rank == world - 1) as usize).unwrap();
        let e = ddp.commit().unwrap_err();
        assert_eq!(e.status, libddp::sys::DDP_ERR_MISMATCH, "{e}");
        assert!(!e.message.is_empty());
    }
    // Host collectives: the loss and a token count.
    {
        let mut ddp = Ddp::new(&comm, &Config::default()).expect("Ddp::new");
        let mut loss = [rank as f64, 1.0];
        ddp.allreduce_host(&mut loss, libddp::Op::Avg).unwrap();
        assert_eq!(loss, [(world - 1) as f64 / 2.0, 1.0]);
        let mut tokens = [rank as i64 + 10];
        ddp.allreduce_host(&mut tokens, libddp::Op::Max).unwrap();
        assert_eq!(tokens[0], world as i64 + 9);
        // A step count (an integer) from the last rank.
        let mut step = [if rank == world - 1 { 4711i64 } else { -1 }];
        ddp.broadcast(&mut step, world - 1).unwrap();
        assert_eq!(step[0], 4711);
        ddp.barrier().unwrap();
        let e = ddp.join().unwrap_err(); // uneven_inputs is off
        assert_eq!(e.status, libddp::sys::DDP_ERR_INVALID_STATE, "{e}");
    }
    println!("rank {rank} of {world}: rust mpi ok");
}
