//! Training-step and eval throughput of a model on random data, without the `tandem` binary
//! (handy while working on kernels). Usage: `step_throughput resnet18|resnet-base [batch] [steps] [threads]`.

use std::time::Instant;

use tandem_engine::rng::Rng;
use tandem_engine::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use tandem_models::{LossOptions, Model, ModelSpec, ResNetBaseSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let resnet18 = args.get(1).is_some_and(|name| name == "resnet18");
    let number = |index: usize, default: usize| {
        args.get(index)
            .and_then(|text| text.parse().ok())
            .unwrap_or(default)
    };
    let batch = number(2, if resnet18 { 128 } else { 256 });
    let steps = number(3, 5);
    if let Some(threads) = args.get(4).and_then(|text| text.parse().ok()) {
        tandem_engine::set_threads(threads);
    }
    let spec = if resnet18 {
        ModelSpec::ResNet18 { num_classes: 10 }
    } else {
        ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())
    };
    let mut model = Model::new(&spec)?;
    let len = model.params().len();
    let mut optimizer: Box<dyn Optimizer> = if resnet18 {
        Box::new(Adam::new(len, AdamConfig::with_lr(0.01)))
    } else {
        Box::new(Sgd::new(len, SgdConfig::with_lr(1e-3)))
    };
    let mut rng = Rng::new(1);
    let images: Vec<f32> = (0..batch * 32 * 32 * 3)
        .map(|_| rng.uniform(-1.0, 1.0))
        .collect();
    let labels: Vec<u32> = (0..batch).map(|_| (rng.next_u64() % 10) as u32).collect();
    let mut timed = |steps: usize, step: &mut dyn FnMut(&mut Model, &mut dyn Optimizer)| {
        step(&mut model, optimizer.as_mut());
        let start = Instant::now();
        for _ in 0..steps {
            step(&mut model, optimizer.as_mut());
        }
        (batch * steps) as f64 / start.elapsed().as_secs_f64()
    };
    let train = timed(steps, &mut |model, optimizer| {
        model.zero_grads();
        model
            .forward_train(
                &images,
                batch,
                32,
                32,
                &labels,
                &LossOptions::default(),
                None,
            )
            .expect("forward");
        model.backward(1.0, None, &mut |_, _| {}).expect("backward");
        let (params, grads) = model.params_and_grads_mut();
        optimizer.step(params, grads);
    });
    let eval = timed(steps, &mut |model, _| {
        model.forward_eval(&images, batch, 32, 32).expect("eval");
    });
    let status = std::fs::read_to_string("/proc/self/status")?;
    let peak = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap_or("VmHWM: 0 kB")
        .to_string();
    println!("train: {train:.1} img/s\neval: {eval:.1} img/s\n{peak}");
    Ok(())
}
