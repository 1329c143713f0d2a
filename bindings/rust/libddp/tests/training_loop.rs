// The training loop as one writes it: register every layer's grad, then in each step write each grad
// and mark it ready in turn, and finish. The handles borrow nothing, so the loop compiles (with grads
// borrowed by the context it did not: E0499). One rank: the averaged grads are the written ones.
use libddp::{Comm, Config, Ddp, Grad};

fn value(step: usize, layer: usize, i: usize) -> f64 {
    ((step * 7 + layer * 3) as f64 * 0.1 + i as f64 * 0.013).sin()
}

fn train(cfg: &Config) {
    let comm = Comm::single().unwrap();
    let mut ddp = Ddp::new(&comm, cfg).unwrap();
    let layers = [300usize, 20, 77, 5];
    let grads: Vec<Grad<f32>> = layers.iter().map(|&n| ddp.register::<f32>(n).unwrap()).collect();
    let bias: Grad<f64> = ddp.register::<f64>(9).unwrap();
    for step in 0..4 {
        ddp.begin_backward().unwrap();
        for (layer, g) in grads.iter().enumerate().rev() {
            for (i, x) in ddp.grad_mut(g).unwrap().iter_mut().enumerate() {
                *x = value(step, layer, i) as f32;
            }
            ddp.grad_ready(g).unwrap();
        }
        ddp.grad_mut(&bias).unwrap().fill(step as f64);
        ddp.grad_ready(bias).unwrap();
        ddp.finish_backward().unwrap();
        for (layer, g) in grads.iter().enumerate() {
            let got = ddp.grad(g).unwrap();
            assert_eq!(got.len(), layers[layer]);
            for (i, &x) in got.iter().enumerate() {
                assert_eq!(x, value(step, layer, i) as f32, "step {step} layer {layer} [{i}]");
            }
        }
        assert!(ddp.grad(&bias).unwrap().iter().all(|&x| x == step as f64));
    }
    assert_eq!(ddp.stats().unwrap().iterations, 4);
}

#[test]
fn natural_loop_copy_layout_learned_plan() {
    train(&Config { message_size: 100, ..Config::default() });
}

#[test]
fn natural_loop_arena_layout_learned_plan() {
    // the learned plan moves the arena after the first step: grad_mut asks where the grad lives each time
    train(&Config { message_size: 100, arena: true, ..Config::default() });
}

#[test]
fn natural_loop_arena_layout_registration_plan() {
    train(&Config { arena: true, registration_plan: true, ..Config::default() });
}
