//! The CUDA kernels against the CPU engine and loader, on odd shapes (`gpu_kernels.rs` runs
//! them, on a GPU or on the fake GPU of `tests/fake_gpu`). Launches go through the executor's
//! untyped path ([`Arg`] lists checked against each kernel's signature) and launch shapes.

use std::marker::PhantomData;

use cudarc::driver::LaunchConfig;
use tandem_cuda::bf16::f32_to_bf16_bits;
use tandem_cuda::executor::kernels::Arg;
use tandem_cuda::executor::launch::{column_sums, per_element};
use tandem_cuda::executor::scalars::{AdamStepScalars, OptimizerScalars, SgdScalars};
use tandem_engine::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};

use super::gpu_rig::GpuRig;

/// An element type that may cross to the GPU as its bytes: a plain number, no padding.
pub trait Plain: Copy + Default + 'static {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for i32 {}
impl Plain for u32 {}
impl Plain for u64 {}
impl Plain for i64 {}
impl Plain for f32 {}
impl Plain for f64 {}

/// The bytes of `values`.
pub fn bytes_of<T: Plain>(values: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding and every bit pattern of their bytes is readable.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

/// `bytes` read back as `T`s (`bytes.len()` a multiple of `T`'s size).
pub fn values_of<T: Plain>(bytes: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    assert_eq!(
        bytes.len() % size,
        0,
        "{} bytes are not whole values",
        bytes.len()
    );
    let mut values = vec![T::default(); bytes.len() / size];
    // SAFETY: `values` holds exactly `bytes.len()` bytes, and every bit pattern is a valid
    // `Plain` value.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), values.as_mut_ptr().cast(), bytes.len())
    };
    values
}

/// A buffer of `T`s on the GPU: its address as kernels see it, and its length.
pub struct Buffer<T> {
    address: u64,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: Plain> Buffer<T> {
    /// The buffer of `len` values at `address`.
    pub fn new(address: u64, len: usize) -> Self {
        Buffer {
            address,
            len,
            _element: PhantomData,
        }
    }

    /// The buffer as a kernel argument.
    pub fn arg(&self) -> Arg {
        Arg::Ptr(self.address)
    }

    /// Its address.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

/// Deterministic values in about [-1, 1).
fn values(len: usize, salt: u64) -> Vec<f32> {
    let mut rng = tandem_data::SampleRng::new(salt, 0, 0, 0);
    (0..len)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

/// Asserts `found` bit-identical to `expected`, naming the first element that differs.
pub fn assert_bits_equal(found: &[f32], expected: &[f32], what: &str) {
    assert_eq!(found.len(), expected.len(), "{what}: lengths");
    for (i, (f, e)) in found.iter().zip(expected).enumerate() {
        assert_eq!(f.to_bits(), e.to_bits(), "{what}[{i}]: {f} against {e}");
    }
}

fn assert_bits_equal_f64(device: &[f64], expected: &[f64], what: &str) {
    assert_eq!(device.len(), expected.len(), "{what}: lengths");
    for (i, (d, e)) in device.iter().zip(expected).enumerate() {
        assert_eq!(d.to_bits(), e.to_bits(), "{what}[{i}]: {d} against {e}");
    }
}

/// Two SGD steps (Nesterov, weight decay) of `sgd_step` equal the CPU optimizer's bit for bit.
pub fn sgd_steps_match_the_cpu_bit_for_bit(rig: &mut GpuRig) {
    let n = 1237;
    let config = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 5e-4,
    };
    let mut cpu_params = values(n, 1);
    let mut sgd = Sgd::new(n, config);
    let params = rig.upload(&cpu_params);
    let buffer = rig.zeros::<f32>(n);
    for round in 0..2 {
        let grads = values(n, 10 + round);
        sgd.step(&mut cpu_params, &grads);
        let device_grads = rig.upload(&grads);
        // The executor's layout of the step's scalars (`struct SgdScalars`).
        let scalars = rig.upload(&OptimizerScalars::Sgd(SgdScalars::new(&config, round)).bytes());
        rig.launch(
            "sgd_step",
            per_element(n),
            &[
                params.arg(),
                device_grads.arg(),
                buffer.arg(),
                Arg::I64(n as i64),
                scalars.arg(),
            ],
        );
    }
    assert_bits_equal(&rig.download(&params), &cpu_params, "sgd params");
    let state = sgd.state();
    assert_bits_equal(&rig.download(&buffer), &state.slots[0].1, "momentum buffer");
}

/// Two steps of `adam_step`, as Adam and as AdamW, equal the CPU optimizer's bit for bit.
pub fn adam_and_adamw_steps_match_the_cpu_bit_for_bit(rig: &mut GpuRig) {
    let n = 1001;
    for decoupled in [false, true] {
        let config = AdamConfig {
            weight_decay: 1e-2,
            decoupled,
            ..AdamConfig::with_lr(1e-3)
        };
        let mut cpu_params = values(n, 2);
        let mut adam = Adam::new(n, config);
        let params = rig.upload(&cpu_params);
        let exp_avg = rig.zeros::<f32>(n);
        let exp_avg_sq = rig.zeros::<f32>(n);
        for step in 1..=2u64 {
            let grads = values(n, 20 + step);
            adam.step(&mut cpu_params, &grads);
            // The host scalars, as optim.rs computes them, in the executor's layout.
            let scalars =
                rig.upload(&OptimizerScalars::Adam(AdamStepScalars::new(&config, step)).bytes());
            let device_grads = rig.upload(&grads);
            rig.launch(
                "adam_step",
                per_element(n),
                &[
                    params.arg(),
                    device_grads.arg(),
                    exp_avg.arg(),
                    exp_avg_sq.arg(),
                    Arg::I64(n as i64),
                    scalars.arg(),
                ],
            );
        }
        assert_bits_equal(&rig.download(&params), &cpu_params, "adam params");
        let state = adam.state();
        assert_bits_equal(&rig.download(&exp_avg), &state.slots[0].1, "exp_avg");
        assert_bits_equal(&rig.download(&exp_avg_sq), &state.slots[1].1, "exp_avg_sq");
    }
}

/// Global average pooling and its backward equal the CPU head's bit for bit.
pub fn average_pooling_matches_the_cpu_bit_for_bit(rig: &mut GpuRig) {
    let (batch, pixels, channels) = (3, 49, 37);
    let input = values(batch * pixels * channels, 3);
    let mut cpu = vec![0f32; batch * channels];
    tandem_engine::head::average_pool_forward(&input, pixels, channels, &mut cpu);
    let device_input = rig.upload(&input);
    let output = rig.zeros::<f32>(batch * channels);
    let shape = [batch, pixels, channels].map(|n| Arg::I32(n as i32));
    rig.launch(
        "average_pool_forward",
        per_element(batch * channels),
        &[
            device_input.arg(),
            shape[0],
            shape[1],
            shape[2],
            output.arg(),
        ],
    );
    assert_bits_equal(&rig.download(&output), &cpu, "pooled");

    let grad = values(batch * channels, 4);
    let mut cpu_grad = vec![0f32; input.len()];
    tandem_engine::head::average_pool_backward(&grad, pixels, channels, &mut cpu_grad);
    let device_grad = rig.upload(&grad);
    let grad_input = rig.zeros::<f32>(input.len());
    rig.launch(
        "average_pool_backward",
        per_element(input.len()),
        &[
            device_grad.arg(),
            shape[0],
            shape[1],
            shape[2],
            grad_input.arg(),
        ],
    );
    assert_bits_equal(&rig.download(&grad_input), &cpu_grad, "pool gradient");
}

/// Cross-entropy with label smoothing: loss, probabilities and gradient within 1e-6 of the
/// CPU head's; a label out of range is reported by the first sample that has one.
pub fn cross_entropy_matches_the_cpu(rig: &mut GpuRig) {
    let (batch, classes, smoothing) = (13usize, 10usize, 0.1f32);
    let logits: Vec<f32> = values(batch * classes, 5).iter().map(|v| v * 4.0).collect();
    let labels: Vec<u32> = (0..batch as u32)
        .map(|s| (s * 7) % classes as u32)
        .collect();
    let mut cpu_probs = vec![0f32; logits.len()];
    let cpu_loss =
        tandem_engine::head::cross_entropy_forward(&logits, &labels, smoothing, &mut cpu_probs)
            .unwrap();
    let mut cpu_grad = vec![0f32; logits.len()];
    tandem_engine::head::cross_entropy_backward(&cpu_probs, &labels, smoothing, 1.0, &mut cpu_grad);

    let (b, k) = (Arg::I32(batch as i32), Arg::I32(classes as i32));
    let device_logits = rig.upload(&logits);
    let probs = rig.zeros::<f32>(logits.len());
    let loss = rig.zeros::<f32>(1);
    let grad = rig.zeros::<f32>(logits.len());
    let device_labels = rig.upload(&labels);
    let (sample_loss, bad_sample) = cross_entropy_rows(
        rig,
        &device_logits,
        &device_labels,
        (batch, classes, smoothing),
        &probs,
    );
    rig.launch(
        "cross_entropy_mean",
        per_element(1),
        &[sample_loss.arg(), b, loss.arg()],
    );
    rig.launch(
        "cross_entropy_backward",
        per_element(logits.len()),
        &[
            probs.arg(),
            device_labels.arg(),
            b,
            k,
            Arg::F32(smoothing),
            Arg::F32(1.0),
            grad.arg(),
        ],
    );
    assert_eq!(rig.download(&bad_sample), vec![i32::MAX], "no bad label");
    let device_loss = rig.download(&loss)[0];
    assert!(
        (device_loss - cpu_loss).abs() <= 1e-6 * cpu_loss.abs(),
        "loss: kernel {device_loss} CPU {cpu_loss}"
    );
    for (what, device_values, cpu_values) in [
        ("probabilities", rig.download(&probs), &cpu_probs),
        ("gradient", rig.download(&grad), &cpu_grad),
    ] {
        for (d, c) in device_values.iter().zip(cpu_values) {
            assert!((d - c).abs() <= 1e-6, "{what}: kernel {d} CPU {c}");
        }
    }

    // Labels 10 and 12 are out of range: the first such sample, 4, is reported.
    let mut bad_labels = labels.clone();
    bad_labels[9] = 12;
    bad_labels[4] = classes as u32;
    let device_bad_labels = rig.upload(&bad_labels);
    let (_, bad_sample) = cross_entropy_rows(
        rig,
        &device_logits,
        &device_bad_labels,
        (batch, classes, smoothing),
        &probs,
    );
    assert_eq!(
        rig.download(&bad_sample),
        vec![4],
        "first sample with a bad label"
    );
}

/// Launches `cross_entropy_rows` and returns its per-sample losses and bad-sample index.
fn cross_entropy_rows(
    rig: &mut GpuRig,
    logits: &Buffer<f32>,
    labels: &Buffer<u32>,
    (batch, classes, smoothing): (usize, usize, f32),
    probs: &Buffer<f32>,
) -> (Buffer<f64>, Buffer<i32>) {
    let sample_loss = rig.zeros::<f64>(batch);
    let bad_sample = rig.upload(&[i32::MAX]);
    rig.launch(
        "cross_entropy_rows",
        per_element(batch),
        &[
            logits.arg(),
            labels.arg(),
            Arg::I32(batch as i32),
            Arg::I32(classes as i32),
            Arg::F32(smoothing),
            probs.arg(),
            sample_loss.arg(),
            bad_sample.arg(),
        ],
    );
    (sample_loss, bad_sample)
}

/// Random crop (padding 4), flip and normalization of `augment_draws` + `augment_apply`
/// (bytes) and `augment_apply_f32` (floats, as synthetic data) equal the CPU loader's pixels
/// bit for bit, for the same (seed, epoch, index).
pub fn augmented_batches_equal_the_cpu_loaders(rig: &mut GpuRig) {
    let (height, width, channels) = (7usize, 9usize, 3usize);
    let values = 11 * height * width * channels;
    let bytes: Vec<u8> = (0..values).map(|i| (i * 37 % 256) as u8).collect();
    augmented_pixels_equal_the_cpu_loaders(rig, tandem_data::Pixels::U8(bytes), [7, 9, 3]);
    // Floats of both signs and many exponents, so that a contracted multiply-add or a
    // division in place of the CPU's multiplication by 1 / std would round differently.
    let floats: Vec<f32> = (0..values)
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 1.37e-3 * (1 + i % 5) as f32)
        .collect();
    augmented_pixels_equal_the_cpu_loaders(rig, tandem_data::Pixels::F32(floats), [7, 9, 3]);
}

/// The check of [`augmented_batches_equal_the_cpu_loaders`] for one kind of pixels, of
/// images `[height, width, channels]`.
fn augmented_pixels_equal_the_cpu_loaders(
    rig: &mut GpuRig,
    pixels: tandem_data::Pixels,
    [height, width, channels]: [usize; 3],
) {
    let image_len = height * width * channels;
    let images = pixels.len() / image_len;
    let (device_images, apply) = match &pixels {
        tandem_data::Pixels::U8(bytes) => (rig.upload(bytes).arg(), "augment_apply"),
        tandem_data::Pixels::F32(floats) => (rig.upload(floats).arg(), "augment_apply_f32"),
        tandem_data::Pixels::Synthetic(synthetic) => {
            (rig.upload(&synthetic.make_all()).arg(), "augment_apply_f32")
        }
    };
    let dataset = tandem_data::Dataset {
        images: pixels,
        labels: vec![0; images],
        height,
        width,
        channels,
        num_classes: 1,
        class_names: vec!["only".to_string()],
    };
    let augment = tandem_data::Augment::crop_and_flip();
    let normalize = tandem_data::IMAGENET_NORMALIZE;
    let (seed, epoch) = (1234u64, 3u64);
    let indices: Vec<u32> = vec![10, 0, 5, 5, 7];
    let mut cpu = vec![0f32; indices.len() * image_len];
    for (s, &index) in indices.iter().enumerate() {
        tandem_data::transform_image(
            &dataset,
            index as usize,
            &augment,
            Some(&normalize),
            seed,
            epoch,
            &mut cpu[s * image_len..(s + 1) * image_len],
        );
    }
    let device_indices = rig.upload(&indices);
    let draws = rig.zeros::<i32>(3 * indices.len());
    let batch = Arg::I32(indices.len() as i32);
    // The epoch goes through a pointer, so that a captured step replays with the next epoch.
    let device_epoch = rig.upload(&[epoch]);
    rig.launch(
        "augment_draws",
        per_element(indices.len()),
        &[
            device_indices.arg(),
            batch,
            Arg::U64(seed),
            device_epoch.arg(),
            Arg::I32(4),
            Arg::I32(1),
            draws.arg(),
        ],
    );
    let (mean, std) = (rig.upload(&normalize.mean), rig.upload(&normalize.std));
    let output = rig.zeros::<f32>(cpu.len());
    let [h, w, c] = [height, width, channels].map(|n| Arg::I32(n as i32));
    rig.launch(
        apply,
        per_element(cpu.len()),
        &[
            device_images,
            device_indices.arg(),
            draws.arg(),
            batch,
            h,
            w,
            c,
            Arg::I32(4),
            mean.arg(),
            std.arg(),
            output.arg(),
        ],
    );
    assert_bits_equal(&rig.download(&output), &cpu, apply);
}

/// Batch-norm statistics (two passes in one launch, fixed order), the training coefficients
/// and running statistics (in that launch, or from the totals as SyncBatchNorm computes them),
/// and the backward (sums and coefficients, then the input gradient) against the CPU engine
/// and an f64 reference.
pub fn batch_norm_statistics_and_backward_match_the_cpu(rig: &mut GpuRig) {
    use tandem_engine::batchnorm::{
        train_statistics_from_sums, BatchNormParams, BatchNormScratch, BatchNormState,
    };
    // 19 row blocks: more than the 8 lanes that add them, and not a multiple of 8; 37
    // channels: two channel groups, the second partly empty.
    let (rows, channels, rows_per_block) = (301usize, 37usize, 16usize);
    let x = values(rows * channels, 6);
    let dy = values(rows * channels, 7);
    let row_blocks = rows.div_ceil(rows_per_block);
    let (r, c, rpb) = (
        Arg::I32(rows as i32),
        Arg::I32(channels as i32),
        Arg::I32(rows_per_block as i32),
    );
    let null = || Arg::Ptr(0);
    let device_x = rig.upload(&x);
    let partials = rig.zeros::<f64>(row_blocks * 2 * channels);
    let arrivals = rig.zeros::<u32>(channels.div_ceil(32));
    let totals = rig.zeros::<f64>(1 + 2 * channels);
    let stats_totals_only = |rig: &mut GpuRig, totals: &Buffer<f64>| {
        let mut args = vec![
            device_x.arg(),
            r,
            c,
            rpb,
            partials.arg(),
            arrivals.arg(),
            totals.arg(),
        ];
        args.extend((0..8).map(|_| null()));
        rig.launch("bn_stats", column_sums(channels, row_blocks), &args);
    };
    stats_totals_only(rig, &totals);
    let totals_host = rig.download(&totals);
    assert_eq!(totals_host[0], rows as f64);
    let x_ref = &x;
    let column = |c: usize| (0..rows).map(move |row| f64::from(x_ref[row * channels + c]));
    for ch in 0..channels {
        let (sum, sum_sq) = column(ch).fold((0.0, 0.0), |(s, q), v| (s + v, q + v * v));
        assert!((totals_host[1 + ch] - sum).abs() <= 1e-12 * (1.0 + sum.abs()));
        assert!((totals_host[1 + channels + ch] - sum_sq).abs() <= 1e-12 * (1.0 + sum_sq));
    }
    // The last block of each channel group set its arrival counter back for the next launch.
    assert_eq!(rig.download(&arrivals), vec![0u32; channels.div_ceil(32)]);
    // The same sums again: the order is fixed by rows_per_block alone, not by scheduling.
    let again = rig.zeros::<f64>(1 + 2 * channels);
    stats_totals_only(rig, &again);
    assert_bits_equal_f64(&rig.download(&again), &totals_host, "totals launched again");

    // Training coefficients and running statistics: the CPU's formulas in double, bit for bit
    // from the same totals, computed by the statistics' own launch and, as SyncBatchNorm
    // does after its all-reduce, by bn_train_coefficients.
    let weight: Vec<f32> = (0..channels).map(|ch| 0.5 + 0.01 * ch as f32).collect();
    let bias: Vec<f32> = (0..channels).map(|ch| 0.1 - 0.003 * ch as f32).collect();
    let (device_weight, device_bias) = (rig.upload(&weight), rig.upload(&bias));
    let (mut cpu_running_mean, mut cpu_running_var) = (values(channels, 14), values(channels, 15));
    for var in &mut cpu_running_var {
        *var = var.abs() + 0.5;
    }
    let mut cpu_state = BatchNormState::new(channels);
    let params = BatchNormParams {
        weight: &weight,
        bias: &bias,
    };
    let (initial_mean, initial_var) = (cpu_running_mean.clone(), cpu_running_var.clone());
    train_statistics_from_sums(
        rows,
        &totals_host[1..],
        &params,
        &mut cpu_running_mean,
        &mut cpu_running_var,
        &mut cpu_state,
        None,
        &mut BatchNormScratch::default(),
    )
    .unwrap();
    let coefficients_of = |rig: &mut GpuRig, fused: bool| {
        let running_mean = rig.upload(&initial_mean);
        let running_var = rig.upload(&initial_var);
        let [mean, invstd, scale, shift] = [(); 4].map(|()| rig.zeros::<f32>(channels));
        let outputs = [
            device_weight.arg(),
            device_bias.arg(),
            running_mean.arg(),
            running_var.arg(),
            mean.arg(),
            invstd.arg(),
            scale.arg(),
            shift.arg(),
        ];
        if fused {
            let fused_totals = rig.zeros::<f64>(1 + 2 * channels);
            let mut args = vec![
                device_x.arg(),
                r,
                c,
                rpb,
                partials.arg(),
                arrivals.arg(),
                fused_totals.arg(),
            ];
            args.extend(outputs);
            rig.launch("bn_stats", column_sums(channels, row_blocks), &args);
            assert_bits_equal_f64(&rig.download(&fused_totals), &totals_host, "fused totals");
        } else {
            let mut args = vec![totals.arg(), c];
            args.extend(outputs);
            rig.launch("bn_train_coefficients", per_element(channels), &args);
        }
        (mean, invstd, scale, shift, running_mean, running_var)
    };
    for fused in [true, false] {
        let (mean, invstd, scale, shift, running_mean, running_var) = coefficients_of(rig, fused);
        for (what, buffer, cpu) in [
            ("mean", &mean, &cpu_state.mean),
            ("invstd", &invstd, &cpu_state.invstd),
            ("scale", &scale, &cpu_state.scale),
            ("shift", &shift, &cpu_state.shift),
            ("running_mean", &running_mean, &cpu_running_mean),
            ("running_var", &running_var, &cpu_running_var),
        ] {
            let what = format!("{what} (coefficients in the statistics' launch: {fused})");
            assert_bits_equal(&rig.download(buffer), cpu, &what);
        }
    }
    let (mean, invstd, ..) = coefficients_of(rig, true);

    // The backward against an f64 reference: sums and coefficients in one launch, and (as
    // SyncBatchNorm computes them) the sums, then the coefficients from their totals.
    let device_dy = rig.upload(&dy);
    let backward_totals = rig.zeros::<f64>(2 * channels);
    // bn_backward_sums of `dy` (behind the ReLU output `relu`, or null) into fresh parameter
    // gradients, with the coefficients or (SyncBatchNorm's way) without.
    let backward_sums =
        |rig: &mut GpuRig, dy: &Buffer<f32>, relu: Arg, coefficients: Option<&Buffer<f32>>| {
            let (grad_weight, grad_bias) = (rig.zeros::<f32>(channels), rig.zeros::<f32>(channels));
            rig.launch(
                "bn_backward_sums",
                column_sums(channels, row_blocks),
                &[
                    dy.arg(),
                    relu,
                    device_x.arg(),
                    mean.arg(),
                    invstd.arg(),
                    r,
                    c,
                    rpb,
                    partials.arg(),
                    arrivals.arg(),
                    backward_totals.arg(),
                    grad_weight.arg(),
                    grad_bias.arg(),
                    Arg::F64(rows as f64),
                    device_weight.arg(),
                    coefficients.map_or(null(), Buffer::arg),
                ],
            );
            (rig.download(&grad_weight), rig.download(&grad_bias))
        };
    // bn_backward_input of `dy` with `coefficients`, the masked gradient written to
    // `masked_dy` (or not, null).
    let backward_input = |rig: &mut GpuRig,
                          dy: &Buffer<f32>,
                          relu: Arg,
                          coefficients: &Buffer<f32>,
                          masked_dy: Arg| {
        let dx = rig.zeros::<f32>(x.len());
        rig.launch(
            "bn_backward_input",
            per_element(x.len()),
            &[
                dy.arg(),
                relu,
                device_x.arg(),
                mean.arg(),
                invstd.arg(),
                coefficients.arg(),
                Arg::I64(x.len() as i64),
                c,
                dx.arg(),
                masked_dy,
            ],
        );
        rig.download(&dx)
    };
    let coefficients = rig.zeros::<f32>(3 * channels);
    let (grad_weight, grad_bias) = backward_sums(rig, &device_dy, null(), Some(&coefficients));
    assert_eq!(rig.download(&arrivals), vec![0u32; channels.div_ceil(32)]);
    let (separate_grad_weight, separate_grad_bias) = backward_sums(rig, &device_dy, null(), None);
    assert_bits_equal(&separate_grad_weight, &grad_weight, "grad_weight");
    assert_bits_equal(&separate_grad_bias, &grad_bias, "grad_bias");
    let separate = rig.zeros::<f32>(3 * channels);
    rig.launch(
        "bn_backward_coefficients",
        per_element(channels),
        &[
            backward_totals.arg(),
            Arg::F64(rows as f64),
            c,
            device_weight.arg(),
            invstd.arg(),
            separate.arg(),
        ],
    );
    assert_bits_equal(
        &rig.download(&separate),
        &rig.download(&coefficients),
        "backward coefficients from the totals",
    );
    let dx = backward_input(rig, &device_dy, null(), &coefficients, null());
    for ch in 0..channels {
        let mean = column(ch).sum::<f64>() / rows as f64;
        let variance = column(ch).map(|v| (v - mean) * (v - mean)).sum::<f64>() / rows as f64;
        let invstd = 1.0 / (variance + 1e-5).sqrt();
        let xhat = |row: usize| (f64::from(x[row * channels + ch]) - mean) * invstd;
        let g = |row: usize| f64::from(dy[row * channels + ch]);
        let mean_dy = (0..rows).map(g).sum::<f64>() / rows as f64;
        let mean_dy_xhat = (0..rows).map(|row| g(row) * xhat(row)).sum::<f64>() / rows as f64;
        let close = |got: f32, expected: f64| {
            (f64::from(got) - expected).abs() <= 1e-4 * (1.0 + expected.abs())
        };
        assert!(
            close(grad_bias[ch], mean_dy * rows as f64),
            "grad_bias[{ch}]"
        );
        assert!(
            close(grad_weight[ch], mean_dy_xhat * rows as f64),
            "grad_weight[{ch}]"
        );
        for row in 0..rows {
            let expected =
                f64::from(weight[ch]) * invstd * (g(row) - mean_dy - xhat(row) * mean_dy_xhat);
            let got = dx[row * channels + ch];
            assert!(
                close(got, expected),
                "dx[{row}, {ch}]: kernel {got} f64 {expected}"
            );
        }
    }

    // Behind a ReLU, a block's first unit backward masks the gradient in the sums and the
    // input gradient, and leaves it masked in place (`masked_dy`): the same bits as masking it
    // first with the CPU's relu_backward and running the backward without a ReLU.
    let relu_out: Vec<f32> = values(rows * channels, 8)
        .iter()
        .map(|v| v.max(0.0))
        .collect();
    let device_relu_out = rig.upload(&relu_out);
    let mut masked_host = dy.clone();
    tandem_engine::batchnorm::relu_backward_in_place(&mut masked_host, &relu_out);
    let backward = |rig: &mut GpuRig, dy: &Buffer<f32>, relu: Arg, masked_dy: Arg| {
        let coefficients = rig.zeros::<f32>(3 * channels);
        let (grad_weight, grad_bias) = backward_sums(rig, dy, relu, Some(&coefficients));
        let dx = backward_input(rig, dy, relu, &coefficients, masked_dy);
        [grad_weight, grad_bias, dx]
    };
    let in_place = rig.upload(&dy);
    let fused = backward(rig, &in_place, device_relu_out.arg(), in_place.arg());
    assert_bits_equal(&rig.download(&in_place), &masked_host, "masked dy in place");
    let premasked = rig.upload(&masked_host);
    let separate = backward(rig, &premasked, null(), null());
    for (what, fused, separate) in [
        ("grad_weight", &fused[0], &separate[0]),
        ("grad_bias", &fused[1], &separate[1]),
        ("dx", &fused[2], &separate[2]),
    ] {
        assert_bits_equal(fused, separate, &format!("{what} behind a ReLU"));
    }
}

/// Eval-mode coefficients from running statistics equal the CPU's `eval_statistics`.
pub fn batch_norm_eval_coefficients_match_the_cpu_bit_for_bit(rig: &mut GpuRig) {
    use tandem_engine::batchnorm::{eval_statistics, BatchNormParams, BatchNormState};
    let channels = 45;
    let (weight, bias) = (values(channels, 16), values(channels, 17));
    let running_mean = values(channels, 18);
    let running_var: Vec<f32> = values(channels, 19).iter().map(|v| v.abs() * 3.0).collect();
    let mut cpu = BatchNormState::new(channels);
    let params = BatchNormParams {
        weight: &weight,
        bias: &bias,
    };
    eval_statistics(&params, &running_mean, &running_var, &mut cpu);
    let inputs = [&weight, &bias, &running_mean, &running_var].map(|v| rig.upload(v));
    let [invstd, scale, shift] = [(); 3].map(|()| rig.zeros::<f32>(channels));
    rig.launch(
        "bn_eval_coefficients",
        per_element(channels),
        &[
            Arg::I32(channels as i32),
            inputs[0].arg(),
            inputs[1].arg(),
            inputs[2].arg(),
            inputs[3].arg(),
            invstd.arg(),
            scale.arg(),
            shift.arg(),
        ],
    );
    assert_bits_equal(&rig.download(&invstd), &cpu.invstd, "invstd");
    assert_bits_equal(&rig.download(&scale), &cpu.scale, "scale");
    assert_bits_equal(&rig.download(&shift), &cpu.shift, "shift");
}

/// `bn_apply` (no residual, identity, projection; with and without ReLU) equals the CPU
/// formula bit for bit; `relu_backward` equals the CPU's.
pub fn the_fused_epilogue_matches_the_cpu_bit_for_bit(rig: &mut GpuRig) {
    let (rows, channels) = (29usize, 19usize);
    let n = rows * channels;
    let (x, s) = (values(n, 8), values(n, 9));
    let (scale, shift) = (values(channels, 10), values(channels, 11));
    let (scale2, shift2) = (values(channels, 12), values(channels, 13));
    let device = [&x, &s, &scale, &shift, &scale2, &shift2].map(|v| rig.upload(v));
    for kind in 0..3i32 {
        for relu in [false, true] {
            let expected: Vec<f32> = (0..n)
                .map(|i| {
                    let c = i % channels;
                    let value = x[i] * scale[c] + shift[c];
                    let value = match kind {
                        0 => value,
                        1 => value + s[i],
                        _ => value + (s[i] * scale2[c] + shift2[c]),
                    };
                    if relu {
                        value.max(0.0)
                    } else {
                        value
                    }
                })
                .collect();
            let out = rig.zeros::<f32>(n);
            rig.launch(
                "bn_apply",
                per_element(n),
                &[
                    device[0].arg(),
                    device[2].arg(),
                    device[3].arg(),
                    device[1].arg(),
                    device[4].arg(),
                    device[5].arg(),
                    Arg::I32(kind),
                    Arg::I32(relu.into()),
                    Arg::I64(n as i64),
                    Arg::I32(channels as i32),
                    out.arg(),
                ],
            );
            let what = format!("epilogue kind {kind} relu {relu}");
            assert_bits_equal(&rig.download(&out), &expected, &what);
        }
    }

    let mut cpu_grad = values(n, 20);
    let grad_out = rig.upload(&cpu_grad);
    tandem_engine::batchnorm::relu_backward_in_place(&mut cpu_grad, &x);
    let grad_in = rig.zeros::<f32>(n);
    rig.launch(
        "relu_backward",
        per_element(n),
        &[
            grad_out.arg(),
            device[0].arg(),
            Arg::I64(n as i64),
            grad_in.arg(),
        ],
    );
    assert_bits_equal(&rig.download(&grad_in), &cpu_grad, "relu backward");
}

/// The linear layer's `bias_add` and `add_channel_sums`, and the gradient average's
/// `divide_in_place`, against the same float operations on the host.
pub fn bias_and_division_kernels_match_the_host_bit_for_bit(rig: &mut GpuRig) {
    let (rows, channels) = (23usize, 10usize);
    let n = rows * channels;
    let (x, bias) = (values(n, 21), values(channels, 22));
    let device_x = rig.upload(&x);
    let device_bias = rig.upload(&bias);
    rig.launch(
        "bias_add",
        per_element(n),
        &[
            device_x.arg(),
            device_bias.arg(),
            Arg::I64(n as i64),
            Arg::I32(channels as i32),
        ],
    );
    let expected: Vec<f32> = (0..n).map(|i| x[i] + bias[i % channels]).collect();
    assert_bits_equal(&rig.download(&device_x), &expected, "bias_add");

    // totals as the column sums leave them: [count, sums...]; the sums are added to grad_bias.
    let totals: Vec<f64> = std::iter::once(rows as f64)
        .chain((0..channels).map(|c| 0.1 + c as f64 / 3.0))
        .collect();
    let device_totals = rig.upload(&totals);
    let grad_bias = rig.upload(&bias);
    rig.launch(
        "add_channel_sums",
        per_element(channels),
        &[
            device_totals.arg(),
            Arg::I32(channels as i32),
            grad_bias.arg(),
        ],
    );
    let expected: Vec<f32> = (0..channels)
        .map(|c| bias[c] + totals[1 + c] as f32)
        .collect();
    assert_bits_equal(&rig.download(&grad_bias), &expected, "add_channel_sums");

    let world_size = 3.0f32;
    rig.launch(
        "divide_in_place",
        per_element(n),
        &[device_x.arg(), Arg::I64(n as i64), Arg::F32(world_size)],
    );
    let expected: Vec<f32> = (0..n)
        .map(|i| (x[i] + bias[i % channels]) / world_size)
        .collect();
    assert_bits_equal(&rig.download(&device_x), &expected, "divide_in_place");
}

/// An odd count of floats: the cases of the host reference's tests, then a spread of bit
/// patterns over all of float32 (every sign, exponent, NaN and subnormal region).
fn narrowing_inputs() -> Vec<f32> {
    let mut values: Vec<f32> = [
        0x3f80_8000u32,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_7fff,
        0xbf80_8000,
        0x3fff_ffff,
        0x7f7f_8000,
        0x7f7f_7fff,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7fa0_0000,
        0x0000_0001,
        0x8000_0001,
        0x0000_8000,
        0x0000_8001,
        0x0001_8000,
        0x007f_ffff,
        0x0000_0000,
        0x8000_0000,
    ]
    .into_iter()
    .map(f32::from_bits)
    .collect();
    values.extend((0..100_003u32).map(|i| f32::from_bits(i.wrapping_mul(42_943))));
    assert!(!values.len().is_multiple_of(2), "an odd count");
    values
}

/// `convert.cu`'s narrowing, widening and widening add equal the host reference
/// (`tandem_cuda::bf16`) bit for bit, on an odd count and on every bfloat16.
pub fn conversion_kernels_equal_the_host_reference_bit_for_bit(rig: &mut GpuRig) {
    use tandem_cuda::bf16::{bf16_bits_to_f32, f32_to_bf16_bits};
    let inputs = narrowing_inputs();
    let narrowed = convert(rig, "float_to_bf16", &inputs, &vec![0u16; inputs.len()]);
    for (i, (&value, &bits)) in inputs.iter().zip(&narrowed).enumerate() {
        assert_eq!(
            bits,
            f32_to_bf16_bits(value),
            "float_to_bf16[{i}] of {:#010x}",
            value.to_bits()
        );
    }
    // Every bfloat16 but the last (an odd count), widened exactly.
    let every: Vec<u16> = (0..u16::MAX).collect();
    let widened = convert(rig, "bf16_to_float", &every, &vec![0f32; every.len()]);
    for (&bits, &value) in every.iter().zip(&widened) {
        assert_eq!(
            value.to_bits(),
            bf16_bits_to_f32(bits).to_bits(),
            "{bits:#06x}"
        );
    }
    // The widening add is one IEEE float add (NaN payloads aside, which the GPU may not keep).
    let finite: Vec<u16> = every
        .iter()
        .copied()
        .filter(|&bits| !bf16_bits_to_f32(bits).is_nan())
        .collect();
    let targets: Vec<f32> = (0..finite.len())
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    let sums = convert(rig, "bf16_add_to_float", &finite, &targets);
    for (i, ((&bits, &target), &sum)) in finite.iter().zip(&targets).zip(&sums).enumerate() {
        let expected = target + bf16_bits_to_f32(bits);
        if expected.is_nan() {
            assert!(sum.is_nan(), "bf16_add_to_float[{i}]");
        } else {
            assert_eq!(sum.to_bits(), expected.to_bits(), "bf16_add_to_float[{i}]");
        }
    }
}

/// Runs `kernel(input, n, output)` of `convert.cu` over `input` into `output`, and returns
/// `output`.
fn convert<I: Plain, O: Plain>(
    rig: &mut GpuRig,
    kernel: &'static str,
    input: &[I],
    output: &[O],
) -> Vec<O> {
    let (input_device, output_device) = (rig.upload(input), rig.upload(output));
    rig.launch(
        kernel,
        per_element(input.len()),
        &[
            input_device.arg(),
            Arg::I64(input.len() as i64),
            output_device.arg(),
        ],
    );
    rig.download(&output_device)
}

/// One argument of a kernel launched both as its float32 entry point and as its `_bf16` twin.
#[derive(Clone, Copy)]
enum Twin<'a> {
    /// Activations read (bfloat16-exact values, so both twins read the same numbers).
    Act(&'a [f32]),
    /// Activations read and written in place, or written (start values).
    ActOut(&'a [f32]),
    /// float32 values read, the same for both.
    Floats(&'a [f32]),
    /// float32 values written: equal bit for bit.
    FloatsOut(usize),
    /// double values written: equal bit for bit.
    DoublesOut(usize),
    /// Arrival counters (zeros).
    Counters(usize),
    /// Any other argument, passed as it is.
    Value(Arg),
}

/// The device buffers of one launch's written arguments, in order.
enum Written {
    Act(Buffer<f32>),
    Bf16(Buffer<u16>),
    Floats(Buffer<f32>),
    Doubles(Buffer<f64>),
}

/// Launches `name` on float32 activations and `name_bf16` on the same values in bfloat16:
/// every activation the twin writes equals the float32 kernel's rounded to bfloat16, and
/// every float32 or double it writes equals the float32 kernel's, bit for bit (both compute
/// in float on the same numbers).
fn twins_agree(rig: &mut GpuRig, name: &'static str, config: LaunchConfig, args: &[Twin]) {
    let twin = tandem_cuda::executor::kernels::signature(name)
        .and_then(|signature| signature.twin)
        .unwrap_or_else(|| panic!("{name}: no bfloat16 twin"));
    let mut runs = Vec::new();
    for bf16 in [false, true] {
        let mut launch_args = Vec::new();
        let mut written = Vec::new();
        for arg in args {
            match arg {
                Twin::Act(values) | Twin::ActOut(values) => {
                    let out = matches!(arg, Twin::ActOut(_));
                    if bf16 {
                        let bits: Vec<u16> = values.iter().map(|v| f32_to_bf16_bits(*v)).collect();
                        let buffer = rig.upload(&bits);
                        launch_args.push(buffer.arg());
                        if out {
                            written.push(Written::Bf16(buffer));
                        }
                    } else {
                        let buffer = rig.upload(values);
                        launch_args.push(buffer.arg());
                        if out {
                            written.push(Written::Act(buffer));
                        }
                    }
                }
                Twin::Floats(values) => launch_args.push(rig.upload(values).arg()),
                Twin::FloatsOut(len) => {
                    let buffer = rig.zeros::<f32>(*len);
                    launch_args.push(buffer.arg());
                    written.push(Written::Floats(buffer));
                }
                Twin::DoublesOut(len) => {
                    let buffer = rig.zeros::<f64>(*len);
                    launch_args.push(buffer.arg());
                    written.push(Written::Doubles(buffer));
                }
                Twin::Counters(len) => launch_args.push(rig.zeros::<u32>(*len).arg()),
                Twin::Value(value) => launch_args.push(*value),
            }
        }
        rig.launch(if bf16 { twin } else { name }, config, &launch_args);
        let results: Vec<Vec<u64>> = written
            .iter()
            .map(|buffer| match buffer {
                // float32 activations compared as the bfloat16 they round to.
                Written::Act(buffer) => rig
                    .download(buffer)
                    .iter()
                    .map(|v| u64::from(f32_to_bf16_bits(*v)))
                    .collect(),
                Written::Bf16(buffer) => rig.download(buffer).into_iter().map(u64::from).collect(),
                Written::Floats(buffer) => rig
                    .download(buffer)
                    .iter()
                    .map(|v| u64::from(v.to_bits()))
                    .collect(),
                Written::Doubles(buffer) => {
                    rig.download(buffer).iter().map(|v| v.to_bits()).collect()
                }
            })
            .collect();
        runs.push(results);
    }
    for (output, (float32, bfloat16)) in runs[0].iter().zip(&runs[1]).enumerate() {
        for (i, (f, b)) in float32.iter().zip(bfloat16).enumerate() {
            assert_eq!(
                f, b,
                "{twin} against {name}: written argument {output}, element {i}"
            );
        }
    }
}

/// Values in about [-1, 1) that bfloat16 holds exactly.
fn bf16_values(len: usize, salt: u64) -> Vec<f32> {
    values(len, salt)
        .into_iter()
        .map(tandem_cuda::bf16::round_to_bf16)
        .collect()
}

/// Every kernel over activations has a `_bf16` twin (bfloat16 activations in memory, the
/// bf16 precision) that computes what its float32 entry point computes on the same numbers,
/// rounding only what it stores as an activation.
pub fn bf16_kernels_equal_their_float32_twins_rounded_bit_for_bit(rig: &mut GpuRig) {
    let (rows, channels, rows_per_block) = (301usize, 37usize, 16usize);
    let n = rows * channels;
    let blocks = rows.div_ceil(rows_per_block);
    let groups = channels.div_ceil(32);
    let (x, dy, s) = (bf16_values(n, 30), bf16_values(n, 31), bf16_values(n, 32));
    let relu_out: Vec<f32> = bf16_values(n, 33).iter().map(|v| v.max(0.0)).collect();
    let per_channel = |salt| values(channels, salt);
    let (weight, bias, mean, invstd) = (per_channel(34), per_channel(35), per_channel(36), {
        per_channel(37)
            .iter()
            .map(|v| v.abs() + 0.5)
            .collect::<Vec<_>>()
    });
    let running: Vec<f32> = per_channel(38).iter().map(|v| v.abs() + 0.5).collect();
    let coefficients = values(3 * channels, 39);
    let (r, c, rpb) = (
        Twin::Value(Arg::I32(rows as i32)),
        Twin::Value(Arg::I32(channels as i32)),
        Twin::Value(Arg::I32(rows_per_block as i32)),
    );
    let null = || Twin::Value(Arg::Ptr(0));
    let sums = column_sums(channels, blocks);
    twins_agree(
        rig,
        "bn_stats",
        sums,
        &[
            Twin::Act(&x),
            r,
            c,
            rpb,
            Twin::DoublesOut(blocks * 2 * channels),
            Twin::Counters(groups),
            Twin::DoublesOut(1 + 2 * channels),
            Twin::Floats(&weight),
            Twin::Floats(&bias),
            Twin::Floats(&running),
            Twin::Floats(&running),
            Twin::FloatsOut(channels),
            Twin::FloatsOut(channels),
            Twin::FloatsOut(channels),
            Twin::FloatsOut(channels),
        ],
    );
    twins_agree(
        rig,
        "bn_backward_sums",
        sums,
        &[
            Twin::Act(&dy),
            Twin::Act(&relu_out),
            Twin::Act(&x),
            Twin::Floats(&mean),
            Twin::Floats(&invstd),
            r,
            c,
            rpb,
            Twin::DoublesOut(blocks * 2 * channels),
            Twin::Counters(groups),
            Twin::DoublesOut(2 * channels),
            Twin::FloatsOut(channels),
            Twin::FloatsOut(channels),
            Twin::Value(Arg::F64(rows as f64)),
            Twin::Floats(&weight),
            Twin::FloatsOut(3 * channels),
        ],
    );
    let len = Twin::Value(Arg::I64(n as i64));
    // The masked gradient in place over a copy of dy (the dy read is the same values).
    twins_agree(
        rig,
        "bn_backward_input",
        per_element(n),
        &[
            Twin::ActOut(&dy),
            Twin::Act(&relu_out),
            Twin::Act(&x),
            Twin::Floats(&mean),
            Twin::Floats(&invstd),
            Twin::Floats(&coefficients),
            len,
            c,
            Twin::ActOut(&vec![0.0; n]),
            null(),
        ],
    );
    let (scale, shift) = (per_channel(40), per_channel(41));
    for (kind, relu) in [(0, 1), (1, 1), (2, 0)] {
        twins_agree(
            rig,
            "bn_apply",
            per_element(n),
            &[
                Twin::Act(&x),
                Twin::Floats(&scale),
                Twin::Floats(&shift),
                Twin::Act(&s),
                Twin::Floats(&weight),
                Twin::Floats(&bias),
                Twin::Value(Arg::I32(kind)),
                Twin::Value(Arg::I32(relu)),
                len,
                c,
                Twin::ActOut(&vec![0.0; n]),
            ],
        );
    }
    twins_agree(
        rig,
        "relu_backward",
        per_element(n),
        &[
            Twin::Act(&dy),
            Twin::Act(&relu_out),
            len,
            Twin::ActOut(&vec![0.0; n]),
        ],
    );
    twins_agree(
        rig,
        "bias_add",
        per_element(n),
        &[Twin::ActOut(&x), Twin::Floats(&bias), len, c],
    );
    // Pooling: 7 images of 43 pixels.
    let (batch, pixels) = (7usize, 43usize);
    let features = bf16_values(batch * pixels * channels, 42);
    let pooled_gradient = values(batch * channels, 43);
    let (b, p) = (
        Twin::Value(Arg::I32(batch as i32)),
        Twin::Value(Arg::I32(pixels as i32)),
    );
    twins_agree(
        rig,
        "average_pool_forward",
        per_element(batch * channels),
        &[
            Twin::Act(&features),
            b,
            p,
            c,
            Twin::FloatsOut(batch * channels),
        ],
    );
    twins_agree(
        rig,
        "average_pool_backward",
        per_element(batch * pixels * channels),
        &[
            Twin::Floats(&pooled_gradient),
            b,
            p,
            c,
            Twin::ActOut(&vec![0.0; batch * pixels * channels]),
        ],
    );
}

/// `terms` of `n` floats each, with blocks that the exact sum finds awkward: subnormal and
/// tiny values, values near `f32::MAX` (whose sum overflows to infinity), mixed magnitudes
/// with both signs and zeros of both signs, a NaN, an infinity, an all-zero block, and a
/// partial last block.
fn exact_sum_terms(terms: usize, n: usize) -> Vec<Vec<f32>> {
    (0..terms)
        .map(|term| {
            let mut values = values(n, 40 + term as u64);
            let k = term as f32 + 1.0;
            for (i, value) in values.iter_mut().enumerate() {
                let x = *value;
                *value = match i / 64 {
                    0 => x * f32::from_bits(0x0000_0400 * (i as u32 % 7 + 1)),
                    1 => x.signum() * f32::MAX / (k + (i % 3) as f32),
                    2 => x * 10f32.powi((i % 17) as i32 - 8) * if i % 5 == 0 { 0.0 } else { k },
                    5 => {
                        if i % 2 == 0 {
                            0.0
                        } else {
                            -0.0
                        }
                    }
                    _ => x,
                };
            }
            values[2 * 64 + 7] = -0.0;
            if term == 1 {
                values[3 * 64 + 9] = f32::NAN;
                values[4 * 64 + 63] = f32::NEG_INFINITY;
            }
            values
        })
        .collect()
}

/// Runs the exact-sum kernels over `terms` (one rank's) with `total_terms` over all ranks,
/// taking `other_keys` (the other ranks' maximum) into the keys: this rank's keys and
/// integer sums.
fn exact_sum_on_gpu(
    rig: &mut GpuRig,
    terms: &[Vec<f32>],
    n: usize,
    other_keys: Option<&[i32]>,
    total_terms: usize,
) -> (Vec<i32>, Vec<i64>) {
    let blocks = n.div_ceil(64);
    let flat: Vec<f32> = terms.concat();
    let device_terms = rig.upload(&flat);
    let keys = rig.zeros::<i32>(blocks);
    let (n_arg, count) = (Arg::I64(n as i64), Arg::I32(terms.len() as i32));
    rig.launch(
        "exact_block_maxima",
        per_element(blocks),
        &[device_terms.arg(), n_arg, count, n_arg, keys.arg()],
    );
    let mut found = rig.download(&keys);
    let keys = match other_keys {
        Some(other) => {
            found = found.iter().zip(other).map(|(&a, &b)| a.max(b)).collect();
            rig.upload(&found)
        }
        None => keys,
    };
    let sums = rig.zeros::<i64>(n);
    let args = [
        device_terms.arg(),
        n_arg,
        count,
        n_arg,
        keys.arg(),
        Arg::I64(total_terms as i64),
        sums.arg(),
    ];
    rig.launch("exact_integer_sums", per_element(n), &args);
    (found, rig.download(&sums))
}

/// The exact-sum kernels of `--global-batch-size` through NCCL (`exact_sum.cu`) equal
/// `tandem_dist::exact` bit for bit: the block maxima (as keys), the integer sums and the
/// floats written back, in one process and spread over two ranks, on awkward blocks. A change
/// of the host's arithmetic without the kernels' shows here.
pub fn exact_sum_kernels_equal_tandem_dist_exact_bit_for_bit(rig: &mut GpuRig) {
    use tandem_dist::exact;
    assert_eq!(exact::BLOCK, 64, "EXACT_BLOCK of exact_sum.cu");
    let n = 6 * 64 + 13;
    let terms = exact_sum_terms(3, n);
    let all: Vec<&[f32]> = terms.iter().map(Vec::as_slice).collect();
    let mut maxima = vec![0.0f32; n.div_ceil(exact::BLOCK)];
    exact::block_maxima(&all, &mut maxima);
    for total_terms in [3, 5, 1000] {
        let (keys, sums) = exact_sum_on_gpu(rig, &terms, n, None, total_terms);
        for (block, (&key, &largest)) in keys.iter().zip(&maxima).enumerate() {
            match largest.is_nan() {
                true => assert!(key > 0x7f80_0000, "block {block}: key {key:#x} of a NaN"),
                false => assert_eq!(key as u32, largest.to_bits(), "block {block}'s key"),
            }
        }
        let mut expected = vec![0i64; n];
        exact::integer_sums(&all, &maxima, total_terms, &mut expected);
        if let Some(i) = (0..n).find(|&i| sums[i] != expected[i]) {
            panic!(
                "integer sum {i} of {total_terms} terms: {} against {}",
                sums[i], expected[i]
            );
        }
        let mut into = vec![0.0f32; n];
        exact::write_sums(&expected, &maxima, total_terms, &mut into);
        let device_keys = rig.upload(&keys);
        let device_sums = rig.upload(&sums);
        let written = rig.zeros::<f32>(n);
        let args = [
            device_sums.arg(),
            Arg::I64(n as i64),
            device_keys.arg(),
            Arg::I64(total_terms as i64),
            written.arg(),
        ];
        rig.launch("exact_write_sums", per_element(n), &args);
        assert_bits_equal(&rig.download(&written), &into, "exact_write_sums");
    }
    // Two ranks (terms 0 and 1; term 2): keys combined by the maximum, sums by a wrapping
    // sum, as NCCL's all-reduces do; the result is one process's exact sum.
    let (first, second) = terms.split_at(2);
    let (second_keys, _) = exact_sum_on_gpu(rig, second, n, None, 3);
    let (keys, first_sums) = exact_sum_on_gpu(rig, first, n, Some(&second_keys), 3);
    let (_, second_sums) = exact_sum_on_gpu(rig, second, n, Some(&keys), 3);
    let sums: Vec<i64> = first_sums
        .iter()
        .zip(&second_sums)
        .map(|(a, b)| a.wrapping_add(*b))
        .collect();
    let (device_keys, device_sums) = (rig.upload(&keys), rig.upload(&sums));
    let written = rig.zeros::<f32>(n);
    let args = [
        device_sums.arg(),
        Arg::I64(n as i64),
        device_keys.arg(),
        Arg::I64(3),
        written.arg(),
    ];
    rig.launch("exact_write_sums", per_element(n), &args);
    let mut expected = vec![0.0f32; n];
    exact::local_exact_sum(&all, &mut expected);
    assert_bits_equal(&rig.download(&written), &expected, "two ranks' exact sum");
    assert!(expected[3 * 64..5 * 64].iter().all(|value| value.is_nan()));
    assert!(expected[64..128].iter().any(|value| value.is_infinite()));
    assert!(expected[..64].iter().any(|value| value.is_subnormal()));
}
