use libddp::{Comm, Config, Ddp};

fn main() -> Result<(), libddp::Error> {
    let comm = Comm::mpi()?;
    let (rank, world) = (comm.rank()?, comm.size()?);
    let mut a = vec![rank as f32 + 1.0; 1000];
    let mut b = vec![rank as f64 + 1.0; 10];
    let mut ddp = Ddp::new(&comm, &Config { message_size: 512, ..Config::default() })?;
    let ia = ddp.register(&mut a)?;
    let ib = ddp.register(&mut b)?;
    ddp.begin_backward()?;
    ddp.grad_ready(ib)?;
    ddp.grad_ready(ia)?;
    ddp.finish_backward()?;
    drop(ddp); // releases the borrows of a and b
    let expect = (1..=world).sum::<i32>() as f64 / world as f64;
    assert!(a.iter().all(|&x| (x as f64 - expect).abs() < 1e-6));
    assert!(b.iter().all(|&x| (x - expect).abs() < 1e-12));
    println!("rank {rank}: ok");
    Ok(())
}
