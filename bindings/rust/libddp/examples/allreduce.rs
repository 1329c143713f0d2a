use libddp::{Comm, Config, Ddp};

fn main() -> Result<(), libddp::Error> {
    let comm = Comm::mpi()?;
    let (rank, world) = (comm.rank()?, comm.size()?);
    let mut ddp = Ddp::new(&comm, &Config { message_size: 512, ..Config::default() })?;
    let a = ddp.register::<f32>(1000)?; // handles: the grads live in the context
    let b = ddp.register::<f64>(10)?;
    for _step in 0..3 {
        ddp.begin_backward()?;
        ddp.grad_mut(&b)?.fill(rank as f64 + 1.0); // backward: the last layer's grad first
        ddp.grad_ready(b)?;
        ddp.grad_mut(&a)?.fill(rank as f32 + 1.0);
        ddp.grad_ready(a)?;
        ddp.finish_backward()?;
        let expect = (1..=world).sum::<i32>() as f64 / world as f64;
        assert!(ddp.grad(&a)?.iter().all(|&x| (x as f64 - expect).abs() < 1e-6));
        assert!(ddp.grad(&b)?.iter().all(|&x| (x - expect).abs() < 1e-12));
    }
    println!("rank {rank}: ok");
    Ok(())
}
