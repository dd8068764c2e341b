//! One training step of the seed-004 model on the GPU executor against the CPU executor, in
//! fp32 with deterministic algorithms: logits within 1e-4, gradients within 1e-3 or five times
//! the CPU's own sensitivity to a rounding of the input (see [`assert_gradients_close`]), the
//! running statistics and the gradient-ready ranges; two chained SGD steps and an evaluation
//! forward; two AdamW steps from the same buffers bit for bit; whole training steps replayed as
//! CUDA graphs against the same steps run eagerly and through the separate calls, bit for bit.
//! CI runs them on the fake GPU of `tests/fake_gpu`; without a GPU they are skipped with a
//! printed reason.

mod common;

use std::ops::Range;

use common::kernel_checks::assert_bits_equal;
use common::{formula_batch, gpu_probe, host_step, momentum_sgd, seed_004};
use tandem_cuda::executor::conv::AlgorithmCounts;
use tandem_cuda::executor::HostPixels;
use tandem_cuda::{CudaExecutor, Precision, Probe, PtxCache};
use tandem_engine::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use tandem_models::workspace::Mode;
use tandem_models::{LossOptions, Model};

const BATCH: usize = 8;
const SIDE: usize = 32;

fn assert_close(gpu: &[f32], cpu: &[f32], tolerance: f32, what: &str) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let mut worst = (0.0f32, 0);
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let error = (g - c).abs() / (1.0 + c.abs());
        assert!(error.is_finite(), "{what}[{i}]: GPU {g} CPU {c}");
        if error > worst.0 {
            worst = (error, i);
        }
    }
    let (error, i) = worst;
    assert!(
        error <= tolerance,
        "{what}[{i}]: GPU {} CPU {} (relative error {error:e} > {tolerance:e})",
        gpu[i],
        cpu[i]
    );
}

/// One rounding of float32 relative to 1 (2^-23).
const ONE_ROUNDING: f32 = 1.192_092_9e-7;

/// The input perturbations that measure the CPU's own sensitivity, as the golden tests do.
const PERTURBATIONS: [f32; 3] = [ONE_ROUNDING, -ONE_ROUNDING, 2.0 * ONE_ROUNDING];

/// How many times the CPU's own sensitivity a gradient may differ by.
const SENSITIVITY_FACTOR: f32 = 5.0;

/// The largest `|found - expected| / (1 + |expected|)` and where.
fn worst_error(found: &[f32], expected: &[f32]) -> (f32, usize) {
    found
        .iter()
        .zip(expected)
        .map(|(f, e)| (f - e).abs() / (1.0 + e.abs()))
        .enumerate()
        .fold((0.0, 0), |worst, (i, error)| {
            if error > worst.0 || error.is_nan() {
                (error, i)
            } else {
                worst
            }
        })
}

/// The CPU's gradients of one training forward and backward of `images` from `params`.
fn cpu_gradients(params: &[f32], images: &[f32], labels: &[u32], loss: &LossOptions) -> Vec<f32> {
    let mut cpu = seed_004();
    cpu.params_mut().copy_from_slice(params);
    cpu.forward_train(images, BATCH, SIDE, SIDE, labels, loss, None)
        .unwrap();
    cpu.backward(1.0, None, &mut |_, _| {}).unwrap();
    cpu.grads().to_vec()
}

/// Asserts the GPU's gradients `gpu` close to the CPU's `cpu` (both of `images` from
/// `params`), tensor by tensor: within 1e-3 (relative to 1 + |CPU|), or within
/// [`SENSITIVITY_FACTOR`] times how far the CPU's own gradients move when the images are
/// perturbed by a rounding or two. The seed-004 network in training mode amplifies rounding
/// a lot: a ReLU input on the knife's edge flips with the last bit of the forward, and its
/// gradient with it, so two correct devices (or the CPU against itself on images one rounding
/// apart) differ by up to about 1e-2 in the first layers.
fn assert_gradients_close(
    model: &Model,
    gpu: &[f32],
    cpu: &[f32],
    (params, images, labels, loss): (&[f32], &[f32], &[u32], &LossOptions),
    what: &str,
) {
    let perturbed: Vec<Vec<f32>> = PERTURBATIONS
        .iter()
        .map(|factor| {
            let scaled: Vec<f32> = images.iter().map(|v| v * (1.0 + factor)).collect();
            cpu_gradients(params, &scaled, labels, loss)
        })
        .collect();
    for info in model.tensors() {
        if info.kind != tandem_models::TensorKind::Param {
            continue;
        }
        let range = info.range();
        let sensitivity = perturbed
            .iter()
            .map(|run| worst_error(&run[range.clone()], &cpu[range.clone()]).0)
            .fold(0.0, f32::max);
        let tolerance = (1e-3f32).max(SENSITIVITY_FACTOR * sensitivity);
        let (error, i) = worst_error(&gpu[range.clone()], &cpu[range.clone()]);
        assert!(
            error <= tolerance,
            "{what} {}[{i}]: GPU {} CPU {} (relative error {error:e} > {tolerance:e}; the \
             CPU's own sensitivity {sensitivity:e})",
            info.name,
            gpu[range.start + i],
            cpu[range.start + i]
        );
    }
}

/// One forward and backward on both devices; returns the GPU executor and the CPU model
/// after it, having compared the loss, logits, gradients, statistics and ready ranges.
fn one_step(probe: &Probe) -> (CudaExecutor, Model, Model) {
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions {
        label_smoothing: 0.1,
    };
    let mut cpu = seed_004();
    let cpu_loss = cpu
        .forward_train(&images, BATCH, SIDE, SIDE, &labels, &loss, None)
        .unwrap();
    let mut cpu_ranges: Vec<Range<usize>> = Vec::new();
    cpu.backward(1.0, None, &mut |range, _| cpu_ranges.push(range))
        .unwrap();

    let model = seed_004();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let gpu_loss = exec
        .forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    let mut gpu_logits = Vec::new();
    exec.logits_to_host(&mut gpu_logits).unwrap();
    let mut gpu_ranges: Vec<Range<usize>> = Vec::new();
    let mut reported = vec![f32::NAN; model.params().len()];
    exec.backward(
        &model,
        &plan,
        1.0,
        None,
        Some(&mut |range, values| {
            reported[range.clone()].copy_from_slice(values);
            gpu_ranges.push(range);
        }),
    )
    .unwrap();

    assert!(
        (gpu_loss - cpu_loss).abs() <= 1e-4 * cpu_loss.abs(),
        "loss GPU {gpu_loss} CPU {cpu_loss}"
    );
    assert_close(&gpu_logits, cpu.logits(), 1e-4, "logits");
    let mut grads = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut grads).unwrap();
    assert_gradients_close(
        &model,
        &grads,
        cpu.grads(),
        (model.params(), &images, &labels, &loss),
        "gradients",
    );
    assert_eq!(gpu_ranges, cpu_ranges, "gradient-ready ranges");
    assert_bits_equal(
        &reported,
        &grads,
        "reported gradients against the final ones",
    );
    let mut buffers = vec![0.0; model.buffers().len()];
    exec.buffers_to_host(&mut buffers).unwrap();
    assert_close(&buffers, cpu.buffers(), 1e-5, "running statistics");
    (exec, cpu, model)
}

#[test]
fn a_training_step_matches_the_cpu_in_fp32() {
    let Some(probe) = gpu_probe("a_training_step_matches_the_cpu_in_fp32", &[]) else {
        return;
    };
    one_step(probe);
}

/// One training forward and backward of `images` on `exec`: the loss's and the gradients'
/// bits.
fn train_bits(
    exec: &mut CudaExecutor,
    model: &Model,
    images: &[f32],
    labels: &[u32],
) -> (u32, Vec<u32>) {
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let loss = exec
        .forward_train(model, &plan, images, labels, &LossOptions::default(), None)
        .unwrap();
    exec.backward(model, &plan, 1.0, None, None).unwrap();
    let mut grads = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut grads).unwrap();
    (loss.to_bits(), bits(&grads))
}

/// An evaluation measures only the forward algorithms of its shapes; a training step of the
/// same shapes after it measures their backward ones then, and computes what a fresh executor
/// computes, bit for bit (deterministic algorithms: the same choices).
#[test]
fn training_after_an_evaluation_of_the_same_shape_equals_training_alone() {
    let Some(probe) = gpu_probe(
        "training_after_an_evaluation_of_the_same_shape_equals_training_alone",
        &[],
    ) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let model = seed_004();
    let train = |exec: &mut CudaExecutor| train_bits(exec, &model, &images, &labels);
    let mut alone = common::executor(probe, Precision::Fp32, &model);
    let expected = train(&mut alone);
    let mut after_eval = common::executor(probe, Precision::Fp32, &model);
    let eval_plan = model.plan(Mode::Eval, BATCH, SIDE, SIDE).unwrap();
    let mut logits = Vec::new();
    after_eval
        .forward_eval(&model, &eval_plan, &images, &mut logits)
        .unwrap();
    assert_eq!(logits.len(), BATCH * 10);
    assert!(
        train(&mut after_eval) == expected,
        "loss or gradients differ"
    );
}

/// The algorithms an executor measured are kept in its kernel cache's folder, one file per
/// convolution shape, and read back by the next executor there: an evaluation's files gain the
/// backward directions when a training step measures them; a later executor measures nothing
/// and computes what one without the folder computes, bit for bit; a spoiled file is measured
/// (and written) again.
#[test]
fn measured_algorithms_are_read_back_by_the_next_executor() {
    let Some(probe) = gpu_probe(
        "measured_algorithms_are_read_back_by_the_next_executor",
        &[],
    ) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let model = seed_004();
    let train_plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let eval_plan = model.plan(Mode::Eval, BATCH, SIDE, SIDE).unwrap();
    let shapes: std::collections::HashSet<String> = train_plan
        .unit_plans()
        .map(|unit| format!("{:?}", unit.shape))
        .collect();
    let folder = tempfile::tempdir().unwrap();
    let cache = PtxCache::new(folder.path().join("ptx"));
    let open = |cache: Option<PtxCache>| {
        CudaExecutor::new(probe, common::gpu_settings(Precision::Fp32), cache, &model).unwrap()
    };
    let train = |exec: &mut CudaExecutor| train_bits(exec, &model, &images, &labels);
    let algorithm_files = || -> Vec<std::path::PathBuf> {
        let mut files: Vec<_> = std::fs::read_dir(&cache.dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.to_string_lossy().ends_with(".txt"))
            .collect();
        files.sort();
        files
    };
    let counts = |measured, loaded| AlgorithmCounts { measured, loaded };

    let mut evaluation = open(Some(cache.clone()));
    let mut logits = Vec::new();
    evaluation
        .forward_eval(&model, &eval_plan, &images, &mut logits)
        .unwrap();
    assert_eq!(evaluation.algorithm_counts(), counts(shapes.len(), 0));
    assert_eq!(algorithm_files().len(), shapes.len());

    let mut first_training = open(Some(cache.clone()));
    let expected = train(&mut first_training);
    // The forwards read back; the backward directions measured.
    assert_eq!(
        first_training.algorithm_counts(),
        counts(shapes.len(), shapes.len())
    );
    assert!(
        train(&mut open(None)) == expected,
        "a fresh executor differs"
    );

    let mut later = open(Some(cache.clone()));
    assert!(
        train(&mut later) == expected,
        "an executor reading the folder differs"
    );
    assert_eq!(later.algorithm_counts(), counts(0, shapes.len()));

    let files = algorithm_files();
    assert_eq!(files.len(), shapes.len());
    std::fs::write(&files[0], "spoiled").unwrap();
    let mut after_spoiling = open(Some(cache.clone()));
    assert!(
        train(&mut after_spoiling) == expected,
        "after a spoiled file"
    );
    assert_eq!(
        after_spoiling.algorithm_counts(),
        counts(1, shapes.len() - 1)
    );
    let mut last = open(Some(cache.clone()));
    assert!(train(&mut last) == expected);
    assert_eq!(last.algorithm_counts(), counts(0, shapes.len()));
}

/// Two chained SGD steps (Nesterov, weight decay: the momentum buffer carried on the device)
/// and an evaluation forward. Each step starts both devices from the CPU's gradients, so the
/// steps and the momentum buffer agree bit for bit, the second backward (from the stepped
/// weights) is compared as the first, and the evaluation runs on equal weights.
#[test]
fn two_sgd_steps_then_an_evaluation_match_the_cpu() {
    let Some(probe) = gpu_probe("two_sgd_steps_then_an_evaluation_match_the_cpu", &[]) else {
        return;
    };
    let (mut exec, mut cpu, model) = one_step(probe);
    let config = momentum_sgd(0.1, true);
    let mut sgd = Sgd::new(cpu.params().len(), config);
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions::default();
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    for round in 0..2 {
        if round > 0 {
            cpu.zero_grads();
            cpu.forward_train(&images, BATCH, SIDE, SIDE, &labels, &loss, None)
                .unwrap();
            cpu.backward(1.0, None, &mut |_, _| {}).unwrap();
            exec.zero_grads().unwrap();
            exec.forward_train(&model, &plan, &images, &labels, &loss, None)
                .unwrap();
            exec.backward(&model, &plan, 1.0, None, None).unwrap();
            let mut grads = vec![0.0; cpu.params().len()];
            exec.grads_to_host(&mut grads).unwrap();
            assert_gradients_close(
                &model,
                &grads,
                cpu.grads(),
                (cpu.params(), &images, &labels, &loss),
                "gradients after one SGD step",
            );
        }
        exec.grads_from_host(cpu.grads()).unwrap();
        let (params, grads) = cpu.params_and_grads_mut();
        sgd.step(params, grads);
        exec.sgd_step(&config).unwrap();
        let mut gpu_params = vec![0.0; cpu.params().len()];
        exec.params_to_host(&mut gpu_params).unwrap();
        for (i, (g, c)) in gpu_params.iter().zip(cpu.params()).enumerate() {
            assert_eq!(
                g.to_bits(),
                c.to_bits(),
                "parameter {i} after SGD step {round}: GPU {g} CPU {c}"
            );
        }
    }
    let eval_plan = model.plan(Mode::Eval, BATCH, SIDE, SIDE).unwrap();
    let mut gpu_logits = Vec::new();
    exec.forward_eval(&model, &eval_plan, &images, &mut gpu_logits)
        .unwrap();
    // Equal weights; the running statistics of each device's own two training forwards.
    let cpu_logits = cpu
        .forward_eval(&images, BATCH, SIDE, SIDE)
        .unwrap()
        .to_vec();
    assert_close(
        &gpu_logits,
        &cpu_logits,
        1e-4,
        "evaluation logits after two SGD steps",
    );
}

/// The ring backend's crossing: `with_host_grads` hands over the device gradients (on the
/// host, page-locked: after a reporting backward only what it did not copy is copied) and
/// puts back what it is given; after anything else that changes the device gradients (zeros,
/// a backward without a hook, a copy from the host) it hands over the new values, never the
/// host's stale copy. On the fake GPU a copy to or from page-locked memory is only done at a
/// synchronization, so a missing one shows here.
#[test]
fn gradients_cross_to_the_host_and_back_through_page_locked_memory() {
    let Some(probe) = gpu_probe(
        "gradients_cross_to_the_host_and_back_through_page_locked_memory",
        &[],
    ) else {
        return;
    };
    let (mut exec, _cpu, model) = one_step(probe);
    let n = model.params().len();
    let device_grads = |exec: &CudaExecutor| {
        let mut grads = vec![0.0; n];
        exec.grads_to_host(&mut grads).unwrap();
        grads
    };
    let reported = device_grads(&exec);
    let halved: Vec<f32> = reported.iter().map(|v| v * 0.5).collect();
    exec.with_host_grads(|grads| {
        assert_bits_equal(grads, &reported, "handed over after the backward");
        grads.iter_mut().for_each(|v| *v *= 0.5);
    })
    .unwrap();
    assert_bits_equal(&device_grads(&exec), &halved, "put back");
    exec.with_host_grads(|grads| {
        assert_bits_equal(grads, &halved, "handed over a second time");
        grads.iter_mut().for_each(|v| *v += 1.0);
    })
    .unwrap();
    let shifted: Vec<f32> = halved.iter().map(|v| v + 1.0).collect();
    assert_bits_equal(&device_grads(&exec), &shifted, "put back twice");

    exec.zero_grads().unwrap();
    exec.with_host_grads(|grads| {
        assert!(grads.iter().all(|&v| v == 0.0), "handed over after zeros");
    })
    .unwrap();

    let (images, labels) = formula_batch(BATCH, SIDE, 1);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    exec.forward_train(
        &model,
        &plan,
        &images,
        &labels,
        &LossOptions::default(),
        None,
    )
    .unwrap();
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let unreported = device_grads(&exec);
    assert!(unreported != reported, "another batch's gradients");
    exec.with_host_grads(|grads| {
        assert_bits_equal(grads, &unreported, "after a backward without a hook");
    })
    .unwrap();

    exec.grads_from_host(&halved).unwrap();
    exec.with_host_grads(|grads| {
        assert_bits_equal(grads, &halved, "after a copy from the host");
    })
    .unwrap();
}

#[test]
fn two_adamw_steps_over_the_same_buffers_match_the_cpu_bit_for_bit() {
    let Some(probe) = gpu_probe(
        "two_adamw_steps_over_the_same_buffers_match_the_cpu_bit_for_bit",
        &[],
    ) else {
        return;
    };
    let (mut exec, mut cpu, _model) = one_step(probe);
    // The GPU starts from the CPU's parameters and gradients, so the two optimizers see the
    // same inputs; adam_step is element-wise with the CPU's float operations.
    exec.params_from_host(cpu.params(), cpu.buffers()).unwrap();
    exec.grads_from_host(cpu.grads()).unwrap();
    let config = AdamConfig {
        weight_decay: 0.01,
        decoupled: true,
        ..AdamConfig::with_lr(1e-3)
    };
    let mut adam = Adam::new(cpu.params().len(), config);
    // The same gradients twice: the step count and moments differ between the steps.
    for round in 0..2 {
        let (params, grads) = cpu.params_and_grads_mut();
        adam.step(params, grads);
        exec.adam_step(&config).unwrap();
        let mut gpu_params = vec![0.0; cpu.params().len()];
        exec.params_to_host(&mut gpu_params).unwrap();
        for (i, (g, c)) in gpu_params.iter().zip(cpu.params()).enumerate() {
            assert_eq!(
                g.to_bits(),
                c.to_bits(),
                "parameter {i} after AdamW step {round}: GPU {g} CPU {c}"
            );
        }
    }
}

/// `dataset` with its bytes made floats of both signs (as synthetic data holds).
fn float_dataset(dataset: tandem_data::Dataset) -> tandem_data::Dataset {
    let tandem_data::Pixels::U8(bytes) = &dataset.images else {
        panic!("a byte dataset holds bytes")
    };
    let floats = bytes
        .iter()
        .map(|&byte| (f32::from(byte) - 127.0) * 0.0173)
        .collect();
    tandem_data::Dataset {
        images: tandem_data::Pixels::F32(floats),
        ..dataset
    }
}

/// The pixels of `dataset` as `upload_dataset` takes them.
fn host_pixels(dataset: &tandem_data::Dataset) -> HostPixels<'_> {
    match &dataset.images {
        tandem_data::Pixels::U8(bytes) => HostPixels::U8(bytes),
        tandem_data::Pixels::F32(floats) => HostPixels::F32(floats),
        tandem_data::Pixels::Synthetic(_) => panic!("these tests make no synthetic data"),
    }
}

/// A CIFAR-shaped uint8 training set of `images` images with labels below 10.
fn byte_dataset(images: usize) -> tandem_data::Dataset {
    tandem_data::Dataset {
        images: tandem_data::Pixels::U8(
            (0..images * SIDE * SIDE * 3)
                .map(|i| ((i as u64 * 2_654_435_761) % 251) as u8)
                .collect(),
        ),
        labels: (0..images as u32).map(|i| (i * 3 + 1) % 10).collect(),
        height: SIDE,
        width: SIDE,
        channels: 3,
        num_classes: 10,
        class_names: Vec::new(),
    }
}

/// The training set on the device gives, for the same (seed, epoch, indices), the CPU loader's
/// batches bit for bit (bytes and floats, with and without augmentation and normalization,
/// the last batch partial), and a training forward of a gathered batch gives the loss of the same batch sent
/// from the host, bit for bit (same input bits, same GPU work).
#[test]
fn device_assembled_batches_equal_the_cpu_loaders() {
    let Some(probe) = gpu_probe("device_assembled_batches_equal_the_cpu_loaders", &[]) else {
        return;
    };
    use tandem_cuda::executor::{AugmentSettings, DatasetShape};
    use tandem_data::{Augment, Loader, LoaderOptions, Normalize, IMAGENET_NORMALIZE};
    let dataset = std::sync::Arc::new(byte_dataset(21));
    let floats = std::sync::Arc::new(float_dataset(byte_dataset(21)));
    let shape = DatasetShape {
        len: dataset.len(),
        height: SIDE,
        width: SIDE,
        channels: 3,
    };
    let model = seed_004();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    let sampler = tandem_data::DistributedSampler::new(21, 2, 1, true, 9, false).unwrap();
    let cases: [(Option<Augment>, Option<Normalize>); 3] = [
        (Some(Augment::crop_and_flip()), Some(IMAGENET_NORMALIZE)),
        (Some(Augment::crop_and_flip()), None),
        (None, None),
    ];
    let cases = [dataset.clone(), floats]
        .into_iter()
        .flat_map(|data| cases.map(|case| (data.clone(), case)));
    for (data, (augment, normalize)) in cases {
        let (seed, epoch) = (41u64, 2u64);
        let plain = augment.unwrap_or_default();
        let values = normalize.unwrap_or(Normalize {
            mean: [0.0; 3],
            std: [1.0; 3],
        });
        let settings = AugmentSettings {
            crop_padding: plain.random_crop_padding.unwrap_or(0),
            horizontal_flip: plain.horizontal_flip,
            mean: values.mean,
            std: values.std,
            seed,
        };
        let mut device = exec
            .upload_dataset(host_pixels(&data), shape, settings)
            .unwrap();
        let loader = Loader::new(
            data.clone(),
            sampler.indices(epoch),
            LoaderOptions {
                batch_size: 4,
                augment,
                normalize,
                seed,
                epoch,
                threads: 0,
                ..LoaderOptions::default()
            },
        )
        .unwrap();
        let mut batches = 0;
        for batch in loader {
            let batch = batch.unwrap();
            let gathered = exec
                .gather_to_host(&mut device, &batch.indices, epoch)
                .unwrap();
            assert_eq!(gathered.len(), batch.images.len());
            for (i, (gpu, cpu)) in gathered.iter().zip(&batch.images).enumerate() {
                assert_eq!(
                    gpu.to_bits(),
                    cpu.to_bits(),
                    "{augment:?} {normalize:?} batch {} value {i}: GPU {gpu} CPU {cpu}",
                    batch.batch_index
                );
            }
            batches += 1;
        }
        assert_eq!(batches, 3, "11 samples in batches of 4, the last partial");
    }

    // A gathered training forward against the same batch from the host.
    let indices = [20usize, 3, 3, 0, 17, 9, 11, 5];
    let settings = AugmentSettings {
        crop_padding: 4,
        horizontal_flip: true,
        mean: IMAGENET_NORMALIZE.mean,
        std: IMAGENET_NORMALIZE.std,
        seed: 5,
    };
    let mut device = exec
        .upload_dataset(host_pixels(&dataset), shape, settings)
        .unwrap();
    let host_images = exec.gather_to_host(&mut device, &indices, 1).unwrap();
    let labels: Vec<u32> = indices.iter().map(|&i| dataset.labels[i]).collect();
    let loss = LossOptions::default();
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let from_host = exec
        .forward_train(&model, &plan, &host_images, &labels, &loss, None)
        .unwrap();
    let mut host_logits = Vec::new();
    exec.logits_to_host(&mut host_logits).unwrap();
    let gathered = exec
        .forward_train_gathered(
            &model,
            &plan,
            &mut device,
            &indices,
            1,
            &labels,
            &loss,
            None,
        )
        .unwrap();
    let mut gathered_logits = Vec::new();
    exec.logits_to_host(&mut gathered_logits).unwrap();
    assert_eq!(gathered.to_bits(), from_host.to_bits(), "loss");
    assert_eq!(gathered_logits, host_logits, "logits");
    let error = exec
        .forward_train_gathered(
            &model,
            &plan,
            &mut device,
            &[21; BATCH],
            1,
            &labels,
            &loss,
            None,
        )
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("batch index 21, expected below the dataset size 21"),
        "{error}"
    );
}

/// The device parameters, running statistics and optimizer state of `exec`.
fn device_state(exec: &CudaExecutor, model: &Model) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let mut params = vec![0.0; model.params().len()];
    exec.params_to_host(&mut params).unwrap();
    let mut buffers = vec![0.0; model.buffers().len()];
    exec.buffers_to_host(&mut buffers).unwrap();
    let state = exec.optimizer_state_to_host().unwrap().unwrap();
    let slots = state.slots.into_iter().map(|(_, values)| values).collect();
    (params, buffers, slots)
}

/// Asserts the parameters, running statistics and optimizer state of each of `executors`
/// bit-identical to those of `expected` (after steps with the `optimizer`).
fn assert_same_device_state(
    executors: [&CudaExecutor; 2],
    expected: &CudaExecutor,
    model: &Model,
    optimizer: &str,
) {
    let (params, buffers, slots) = device_state(expected, model);
    for exec in executors {
        let (found_params, found_buffers, found_slots) = device_state(exec, model);
        assert_bits_equal(&found_params, &params, &format!("{optimizer}: parameters"));
        assert_bits_equal(
            &found_buffers,
            &buffers,
            &format!("{optimizer}: running statistics"),
        );
        assert_eq!(found_slots.len(), slots.len(), "{optimizer}: state slots");
        for (slot, want) in found_slots.iter().zip(&slots) {
            assert_bits_equal(slot, want, &format!("{optimizer}: optimizer state"));
        }
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|value| value.to_bits()).collect()
}

/// Executors of `model` for comparing whole steps: CUDA graphs on, off, and off (for the
/// separate calls).
fn three_executors(probe: &Probe, model: &Model) -> [CudaExecutor; 3] {
    [true, false, false].map(|graphs| {
        let mut exec = common::executor(probe, Precision::Fp32, model);
        exec.set_graphs(graphs);
        exec
    })
}

/// `dataset` uploaded to each of `executors`, augmented with padding 4, flips and
/// draws of `seed`.
fn upload_to_each(
    executors: [&CudaExecutor; 3],
    dataset: &tandem_data::Dataset,
    seed: u64,
) -> Vec<tandem_cuda::executor::DeviceDataset> {
    use tandem_cuda::executor::{AugmentSettings, DatasetShape};
    let shape = DatasetShape {
        len: dataset.len(),
        height: SIDE,
        width: SIDE,
        channels: 3,
    };
    let augment = AugmentSettings {
        crop_padding: 4,
        horizontal_flip: true,
        mean: [0.5; 3],
        std: [0.25; 3],
        seed,
    };
    executors
        .map(|exec| {
            exec.upload_dataset(host_pixels(dataset), shape, augment)
                .unwrap()
        })
        .into_iter()
        .collect()
}

/// Whole steps (`train_step`) captured as CUDA graphs and replayed give the bits of the same
/// steps run eagerly and of today's separate calls (forward, backward, optimizer), with the
/// learning rate and the epoch changing every step, a partial batch (a key of its own) in
/// between, SGD on gathered batches and then AdamW on host batches; and the schedule runs
/// each key eagerly, then captured, then replayed.
#[test]
fn graphed_steps_equal_eager_steps_bit_for_bit() {
    let Some(probe) = gpu_probe("graphed_steps_equal_eager_steps_bit_for_bit", &[]) else {
        return;
    };
    use tandem_cuda::executor::graph::StepRun;
    use tandem_cuda::executor::{StepImages, StepOptimizer, TrainStep};
    let dataset = byte_dataset(21);
    let model = seed_004();
    let [mut graphed, mut eager, mut separate] = three_executors(probe, &model);
    let mut datasets = upload_to_each([&graphed, &eager, &separate], &dataset, 17);
    let loss = LossOptions {
        label_smoothing: 0.1,
    };
    let full: Vec<usize> = vec![20, 3, 3, 0, 17, 9, 11, 5];
    let partial: Vec<usize> = vec![1, 2, 19, 4, 8];
    let steps: [(&[usize], u64); 8] = [
        (&full, 0),
        (&full, 0),
        (&full, 0),
        (&partial, 0),
        (&full, 1),
        (&partial, 1),
        (&full, 2),
        (&partial, 2),
    ];
    let plans =
        [BATCH, partial.len()].map(|batch| model.plan(Mode::Train, batch, SIDE, SIDE).unwrap());
    let mut runs = Vec::new();
    for (step, &(indices, epoch)) in steps.iter().enumerate() {
        let plan = &plans[usize::from(indices.len() != BATCH)];
        let labels: Vec<u32> = indices.iter().map(|&i| dataset.labels[i]).collect();
        let config = momentum_sgd(0.1 / (step + 1) as f32, true);
        let mut losses = Vec::new();
        for (exec, dataset) in [&mut graphed, &mut eager].into_iter().zip(&mut datasets) {
            let outcome = exec
                .train_step(
                    &model,
                    plan,
                    TrainStep {
                        images: StepImages::Gathered {
                            dataset,
                            indices,
                            epoch,
                        },
                        labels: &labels,
                        micro_batches: 1,
                        loss: &loss,
                        optimizer: StepOptimizer::Sgd(&config),
                    },
                )
                .unwrap();
            if let Some(reason) = &outcome.graphs_off {
                eprintln!("graphs off: {reason}");
            }
            losses.push(outcome.losses[0]);
            runs.push(outcome.run);
        }
        separate.zero_grads().unwrap();
        let separate_loss = separate
            .forward_train_gathered(
                &model,
                plan,
                &mut datasets[2],
                indices,
                epoch,
                &labels,
                &loss,
                None,
            )
            .unwrap();
        separate.backward(&model, plan, 1.0, None, None).unwrap();
        separate.sgd_step(&config).unwrap();
        losses.push(separate_loss);
        assert_bits_equal(&losses[..1], &losses[1..2], &format!("step {step}: loss"));
        assert_bits_equal(&losses[..1], &losses[2..], &format!("step {step}: loss"));
    }
    let mut graphed_runs: Vec<StepRun> = runs.iter().step_by(2).copied().collect();
    use StepRun::{Capture, Eager, Replay};
    // The partial batch's first (eager) step keeps the full batch's storage; only a larger
    // convolution workspace for its algorithms would make the full batch capture again.
    if graphed_runs[4] == Capture {
        eprintln!("the partial batch grew the workspace: the full batch was captured again");
        graphed_runs[4] = Replay;
    }
    assert_eq!(
        graphed_runs,
        [Eager, Capture, Replay, Eager, Replay, Capture, Replay, Replay]
    );
    assert!(runs.iter().skip(1).step_by(2).all(|run| *run == Eager));
    assert_same_device_state([&graphed, &eager], &separate, &model, "SGD");

    // AdamW on host images: a new optimizer state (a new generation) and new keys.
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let mut adam_runs = Vec::new();
    for step in 0..4 {
        let config = AdamConfig {
            weight_decay: 1e-2,
            decoupled: true,
            ..AdamConfig::with_lr(1e-3 / (step + 1) as f32)
        };
        let mut losses = Vec::new();
        for exec in [&mut graphed, &mut eager] {
            let outcome = exec
                .train_step(
                    &model,
                    &plans[0],
                    host_step(&images, &labels, 1, &loss, StepOptimizer::Adam(&config)),
                )
                .unwrap();
            if let Some(reason) = &outcome.graphs_off {
                eprintln!("graphs off: {reason}");
            }
            losses.push(outcome.losses[0]);
            adam_runs.push(outcome.run);
        }
        separate.zero_grads().unwrap();
        losses.push(
            separate
                .forward_train(&model, &plans[0], &images, &labels, &loss, None)
                .unwrap(),
        );
        separate
            .backward(&model, &plans[0], 1.0, None, None)
            .unwrap();
        separate.adam_step(&config).unwrap();
        assert_bits_equal(&losses[..1], &losses[1..2], &format!("AdamW step {step}"));
        assert_bits_equal(&losses[..1], &losses[2..], &format!("AdamW step {step}"));
    }
    let graphed_runs: Vec<StepRun> = adam_runs.iter().step_by(2).copied().collect();
    assert_eq!(graphed_runs, [Eager, Capture, Replay, Replay]);
    assert_same_device_state([&graphed, &eager], &separate, &model, "AdamW");
    assert!(graphed.graphs_on(), "no capture failed");
}

/// Whole steps of several micro-batches (`--grad-accum`): captured and replayed, and eager,
/// they give the bits of the separate calls (per micro-batch a forward and a backward of the
/// loss scaled by the inverse of their count, then the optimizer), each micro-batch's loss
/// included, on gathered batches with SGD and on host batches with AdamW; their count is a
/// key of its own. A bad label in a later micro-batch is the separate calls' error.
#[test]
fn accumulated_steps_graphed_equal_the_separate_calls_bit_for_bit() {
    let Some(probe) = gpu_probe(
        "accumulated_steps_graphed_equal_the_separate_calls_bit_for_bit",
        &[],
    ) else {
        return;
    };
    use tandem_cuda::executor::graph::StepRun::{self, Capture, Eager, Replay};
    use tandem_cuda::executor::{StepImages, StepOptimizer, TrainStep};
    const MICRO_BATCHES: usize = 3;
    let dataset = byte_dataset(21);
    let model = common::shallow_seed_004();
    let [mut graphed, mut eager, mut separate] = three_executors(probe, &model);
    let mut datasets = upload_to_each([&graphed, &eager, &separate], &dataset, 5);
    let loss = LossOptions {
        label_smoothing: 0.1,
    };
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let scale = 1.0 / MICRO_BATCHES as f32;
    let mut runs = Vec::new();
    for step in 0..4u64 {
        let indices: Vec<usize> = (0..MICRO_BATCHES * BATCH)
            .map(|i| (i * 5 + step as usize * 3) % dataset.len())
            .collect();
        let labels: Vec<u32> = indices.iter().map(|&i| dataset.labels[i]).collect();
        let epoch = step / 2;
        let config = momentum_sgd(0.1 / (step + 1) as f32, true);
        let mut losses: Vec<Vec<f32>> = Vec::new();
        for (exec, dataset) in [&mut graphed, &mut eager].into_iter().zip(&mut datasets) {
            let outcome = exec
                .train_step(
                    &model,
                    &plan,
                    TrainStep {
                        images: StepImages::Gathered {
                            dataset,
                            indices: &indices,
                            epoch,
                        },
                        labels: &labels,
                        micro_batches: MICRO_BATCHES,
                        loss: &loss,
                        optimizer: StepOptimizer::Sgd(&config),
                    },
                )
                .unwrap();
            losses.push(outcome.losses);
            runs.push(outcome.run);
        }
        separate.zero_grads().unwrap();
        let mut separate_losses = Vec::new();
        for (indices, labels) in indices.chunks(BATCH).zip(labels.chunks(BATCH)) {
            separate_losses.push(
                separate
                    .forward_train_gathered(
                        &model,
                        &plan,
                        &mut datasets[2],
                        indices,
                        epoch,
                        labels,
                        &loss,
                        None,
                    )
                    .unwrap(),
            );
            separate.backward(&model, &plan, scale, None, None).unwrap();
        }
        separate.sgd_step(&config).unwrap();
        for found in &losses {
            assert_bits_equal(found, &separate_losses, &format!("step {step}: losses"));
        }
    }
    let graphed_runs: Vec<StepRun> = runs.iter().step_by(2).copied().collect();
    assert_eq!(graphed_runs, [Eager, Capture, Replay, Replay]);
    assert!(runs.iter().skip(1).step_by(2).all(|run| *run == Eager));
    assert_same_device_state([&graphed, &eager], &separate, &model, "SGD");

    // AdamW on host batches of two micro-batches: another key, a new optimizer state.
    let host_micro_batches = 2;
    let mut adam_runs = Vec::new();
    for step in 0..3u64 {
        let (images, labels) = common::formula_batches(BATCH, SIDE, [2 * step, 2 * step + 1]);
        let config = AdamConfig {
            weight_decay: 1e-2,
            decoupled: true,
            ..AdamConfig::with_lr(1e-3 / (step + 1) as f32)
        };
        let mut losses = Vec::new();
        for exec in [&mut graphed, &mut eager] {
            let optimizer = StepOptimizer::Adam(&config);
            let train = host_step(&images, &labels, host_micro_batches, &loss, optimizer);
            let outcome = exec.train_step(&model, &plan, train).unwrap();
            losses.push(outcome.losses);
            adam_runs.push(outcome.run);
        }
        separate.zero_grads().unwrap();
        let image_len = images.len() / host_micro_batches;
        let mut separate_losses = Vec::new();
        for (images, labels) in images.chunks(image_len).zip(labels.chunks(BATCH)) {
            separate_losses.push(
                separate
                    .forward_train(&model, &plan, images, labels, &loss, None)
                    .unwrap(),
            );
            separate.backward(&model, &plan, 0.5, None, None).unwrap();
        }
        separate.adam_step(&config).unwrap();
        for found in &losses {
            assert_bits_equal(
                found,
                &separate_losses,
                &format!("AdamW step {step}: losses"),
            );
        }
    }
    let graphed_runs: Vec<StepRun> = adam_runs.iter().step_by(2).copied().collect();
    assert_eq!(graphed_runs, [Eager, Capture, Replay]);
    assert_same_device_state([&graphed, &eager], &separate, &model, "AdamW");
    assert!(graphed.graphs_on(), "no capture failed");

    // A label out of range in the second micro-batch: the separate calls' error for it,
    // before the step runs (nothing updated); and so for one micro-batch.
    let before = device_state(&graphed, &model);
    let (mut images, mut labels) = formula_batch(BATCH, SIDE, 0);
    images.extend_from_within(..);
    labels.extend_from_within(..);
    labels[BATCH + 3] = 10;
    let config = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::with_lr(0.1)
    };
    let error = graphed
        .train_step(
            &model,
            &plan,
            host_step(&images, &labels, 2, &loss, StepOptimizer::Sgd(&config)),
        )
        .unwrap_err();
    let separate_error = separate
        .forward_train(
            &model,
            &plan,
            &images[images.len() / 2..],
            &labels[BATCH..],
            &loss,
            None,
        )
        .unwrap_err();
    assert_eq!(error.to_string(), separate_error.to_string());
    assert!(error.to_string().contains("sample 3"), "{error}");
    let one_error = graphed
        .train_step(
            &model,
            &plan,
            host_step(
                &images[images.len() / 2..],
                &labels[BATCH..],
                1,
                &loss,
                StepOptimizer::Sgd(&config),
            ),
        )
        .unwrap_err();
    assert_eq!(one_error.to_string(), separate_error.to_string());
    let after = device_state(&graphed, &model);
    assert_bits_equal(&after.0, &before.0, "parameters after the refused steps");
    assert_bits_equal(
        &after.1,
        &before.1,
        "running statistics after the refused steps",
    );
}
