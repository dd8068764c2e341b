//! The CUDA kernels against the CPU engine and loader, on a GPU, on odd shapes. Skipped with a
//! printed reason when the driver, NVRTC or a GPU is missing (as on CI's machines).

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use tandem_cuda::executor::scalars::{AdamStepScalars, OptimizerScalars, SgdScalars};
use tandem_cuda::{Library, KERNELS};
use tandem_engine::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};

/// A context on GPU 0 with every kernel file loaded.
struct Gpu {
    stream: Arc<CudaStream>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
}

impl Gpu {
    /// The GPU, or `None` (after printing why) when there is none to test on.
    fn open(test: &str) -> Option<Gpu> {
        let probe = common::probe_with_nvrtc(test)?;
        if let Some(reason) = tandem_cuda::why_no_gpu(probe, &[Library::Nvrtc]) {
            eprintln!("{test}: skipped, {reason}");
            return None;
        }
        let context = CudaContext::new(0).expect("cannot open GPU 0");
        let compiler = common::compiler_for(probe, &context);
        let modules = KERNELS
            .iter()
            .map(|kernel| {
                let (compiled, _) = compiler.compile(kernel).unwrap_or_else(|e| panic!("{e}"));
                let module = context
                    .load_module(Ptx::from_binary(compiled.cubin))
                    .unwrap_or_else(|e| panic!("{}: {e:?}", kernel.name));
                (kernel.name, module)
            })
            .collect();
        Some(Gpu {
            stream: context.default_stream(),
            modules,
        })
    }

    fn function(&self, file: &str, name: &str) -> CudaFunction {
        self.modules[file]
            .load_function(name)
            .unwrap_or_else(|e| panic!("{file}.{name}: {e:?}"))
    }

    fn upload<T: cudarc::driver::DeviceRepr>(&self, values: &[T]) -> CudaSlice<T> {
        self.stream.clone_htod(values).expect("upload")
    }

    fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        values: &CudaSlice<T>,
    ) -> Vec<T> {
        self.stream.clone_dtoh(values).expect("download")
    }
}

/// One thread per element, 256 to a block.
fn per_element(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Deterministic values in about [-1, 1).
fn values(len: usize, salt: u64) -> Vec<f32> {
    let mut rng = tandem_data::SampleRng::new(salt, 0, 0, 0);
    (0..len)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

fn assert_bits_equal(gpu: &[f32], cpu: &[f32], what: &str) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert_eq!(g.to_bits(), c.to_bits(), "{what}[{i}]: GPU {g} CPU {c}");
    }
}

#[test]
fn sgd_steps_match_the_cpu_bit_for_bit() {
    let Some(gpu) = Gpu::open("sgd_steps_match_the_cpu_bit_for_bit") else {
        return;
    };
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
    let mut params = gpu.upload(&cpu_params);
    let mut buffer = gpu.upload(&vec![0f32; n]);
    let step = gpu.function("optimizers", "sgd_step");
    for round in 0..2 {
        let grads = values(n, 10 + round);
        sgd.step(&mut cpu_params, &grads);
        let device_grads = gpu.upload(&grads);
        let count = n as i64;
        // The executor's layout of the step's scalars (`struct SgdScalars`).
        let scalars = OptimizerScalars::Sgd(SgdScalars::new(&config, round)).bytes();
        let scalars = gpu.upload(&scalars);
        let mut launch = gpu.stream.launch_builder(&step);
        launch
            .arg(&mut params)
            .arg(&device_grads)
            .arg(&mut buffer)
            .arg(&count)
            .arg(&scalars);
        // SAFETY: the arguments match sgd_step's parameters, the buffers hold n floats and
        // the scalars the 24 bytes of SgdScalars.
        unsafe { launch.launch(per_element(n)) }.expect("sgd_step");
    }
    assert_bits_equal(&gpu.download(&params), &cpu_params, "sgd params");
    let state = sgd.state();
    assert_bits_equal(&gpu.download(&buffer), &state.slots[0].1, "momentum buffer");
}

#[test]
fn adam_and_adamw_steps_match_the_cpu_bit_for_bit() {
    let Some(gpu) = Gpu::open("adam_and_adamw_steps_match_the_cpu_bit_for_bit") else {
        return;
    };
    let n = 1001;
    let step_kernel = gpu.function("optimizers", "adam_step");
    for decoupled in [false, true] {
        let config = AdamConfig {
            weight_decay: 1e-2,
            decoupled,
            ..AdamConfig::with_lr(1e-3)
        };
        let mut cpu_params = values(n, 2);
        let mut adam = Adam::new(n, config);
        let mut params = gpu.upload(&cpu_params);
        let mut exp_avg = gpu.upload(&vec![0f32; n]);
        let mut exp_avg_sq = gpu.upload(&vec![0f32; n]);
        for step in 1..=2u64 {
            let grads = values(n, 20 + step);
            adam.step(&mut cpu_params, &grads);
            // The host scalars, as optim.rs computes them, in the executor's layout.
            let scalars = OptimizerScalars::Adam(AdamStepScalars::new(&config, step)).bytes();
            let scalars = gpu.upload(&scalars);
            let device_grads = gpu.upload(&grads);
            let count = n as i64;
            let mut launch = gpu.stream.launch_builder(&step_kernel);
            launch
                .arg(&mut params)
                .arg(&device_grads)
                .arg(&mut exp_avg)
                .arg(&mut exp_avg_sq)
                .arg(&count)
                .arg(&scalars);
            // SAFETY: the arguments match adam_step's parameters; the buffers hold n floats
            // and the scalars the 36 bytes of AdamScalars.
            unsafe { launch.launch(per_element(n)) }.expect("adam_step");
        }
        assert_bits_equal(&gpu.download(&params), &cpu_params, "adam params");
        let state = adam.state();
        assert_bits_equal(&gpu.download(&exp_avg), &state.slots[0].1, "exp_avg");
        assert_bits_equal(&gpu.download(&exp_avg_sq), &state.slots[1].1, "exp_avg_sq");
    }
}

#[test]
fn average_pooling_matches_the_cpu_bit_for_bit() {
    let Some(gpu) = Gpu::open("average_pooling_matches_the_cpu_bit_for_bit") else {
        return;
    };
    let (batch, pixels, channels) = (3, 49, 37);
    let input = values(batch * pixels * channels, 3);
    let mut cpu = vec![0f32; batch * channels];
    tandem_engine::head::average_pool_forward(&input, pixels, channels, &mut cpu);
    let device_input = gpu.upload(&input);
    let mut output = gpu.upload(&vec![0f32; batch * channels]);
    let (b, p, c) = (batch as i32, pixels as i32, channels as i32);
    let forward = gpu.function("pooling", "average_pool_forward");
    let mut launch = gpu.stream.launch_builder(&forward);
    launch
        .arg(&device_input)
        .arg(&b)
        .arg(&p)
        .arg(&c)
        .arg(&mut output);
    // SAFETY: the arguments match average_pool_forward's; the buffers have the shapes given.
    unsafe { launch.launch(per_element(batch * channels)) }.expect("forward");
    assert_bits_equal(&gpu.download(&output), &cpu, "pooled");

    let grad = values(batch * channels, 4);
    let mut cpu_grad = vec![0f32; input.len()];
    tandem_engine::head::average_pool_backward(&grad, pixels, channels, &mut cpu_grad);
    let device_grad = gpu.upload(&grad);
    let mut grad_input = gpu.upload(&vec![0f32; input.len()]);
    let backward = gpu.function("pooling", "average_pool_backward");
    let mut launch = gpu.stream.launch_builder(&backward);
    launch
        .arg(&device_grad)
        .arg(&b)
        .arg(&p)
        .arg(&c)
        .arg(&mut grad_input);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(input.len())) }.expect("backward");
    assert_bits_equal(&gpu.download(&grad_input), &cpu_grad, "pool gradient");
}

#[test]
fn cross_entropy_matches_the_cpu() {
    let Some(gpu) = Gpu::open("cross_entropy_matches_the_cpu") else {
        return;
    };
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

    let (device_logits, device_labels) = (gpu.upload(&logits), gpu.upload(&labels));
    let mut probs = gpu.upload(&vec![0f32; logits.len()]);
    let mut sample_loss = gpu.upload(&vec![0f64; batch]);
    let mut bad_sample = gpu.upload(&[i32::MAX]);
    let mut loss = gpu.upload(&[0f32]);
    let (b, k) = (batch as i32, classes as i32);
    let rows = gpu.function("loss", "cross_entropy_rows");
    let mut launch = gpu.stream.launch_builder(&rows);
    launch
        .arg(&device_logits)
        .arg(&device_labels)
        .arg(&b)
        .arg(&k)
        .arg(&smoothing)
        .arg(&mut probs)
        .arg(&mut sample_loss)
        .arg(&mut bad_sample);
    // SAFETY: the arguments match cross_entropy_rows'; the buffers have the shapes given.
    unsafe { launch.launch(per_element(batch)) }.expect("rows");
    let mean = gpu.function("loss", "cross_entropy_mean");
    let mut launch = gpu.stream.launch_builder(&mean);
    launch.arg(&sample_loss).arg(&b).arg(&mut loss);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(1)) }.expect("mean");
    let mut grad = gpu.upload(&vec![0f32; logits.len()]);
    let backward = gpu.function("loss", "cross_entropy_backward");
    let mut launch = gpu.stream.launch_builder(&backward);
    launch
        .arg(&probs)
        .arg(&device_labels)
        .arg(&b)
        .arg(&k)
        .arg(&smoothing)
        .arg(&1f32)
        .arg(&mut grad);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(logits.len())) }.expect("backward");

    assert_eq!(gpu.download(&bad_sample), vec![i32::MAX]);
    let gpu_loss = gpu.download(&loss)[0];
    assert!(
        (gpu_loss - cpu_loss).abs() <= 1e-6 * cpu_loss.abs(),
        "{gpu_loss} vs {cpu_loss}"
    );
    for (what, gpu_values, cpu_values) in [
        ("probabilities", gpu.download(&probs), &cpu_probs),
        ("gradient", gpu.download(&grad), &cpu_grad),
    ] {
        for (g, c) in gpu_values.iter().zip(cpu_values) {
            assert!((g - c).abs() <= 1e-6, "{what}: GPU {g} CPU {c}");
        }
    }
}

#[test]
fn augmented_batches_equal_the_cpu_loaders() {
    let Some(gpu) = Gpu::open("augmented_batches_equal_the_cpu_loaders") else {
        return;
    };
    let (height, width, channels) = (7usize, 9usize, 3usize);
    let images = 11usize;
    let bytes: Vec<u8> = (0..images * height * width * channels)
        .map(|i| (i * 37 % 256) as u8)
        .collect();
    let dataset = tandem_data::Dataset {
        images: tandem_data::Pixels::U8(bytes.clone()),
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
    let image_len = height * width * channels;
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
    let device_images = gpu.upload(&bytes);
    let device_indices = gpu.upload(&indices);
    let mut draws = gpu.upload(&vec![0i32; 3 * indices.len()]);
    let batch = indices.len() as i32;
    let device_epoch = gpu.upload(&[epoch]);
    let draw = gpu.function("augment", "augment_draws");
    let mut launch = gpu.stream.launch_builder(&draw);
    launch
        .arg(&device_indices)
        .arg(&batch)
        .arg(&seed)
        .arg(&device_epoch)
        .arg(&4i32)
        .arg(&1i32)
        .arg(&mut draws);
    // SAFETY: the arguments match augment_draws' (the epoch through a pointer); draws holds
    // 3 ints per sample.
    unsafe { launch.launch(per_element(indices.len())) }.expect("draws");
    let (mean, std) = (gpu.upload(&normalize.mean), gpu.upload(&normalize.std));
    let mut output = gpu.upload(&vec![0f32; cpu.len()]);
    let (h, w, c) = (height as i32, width as i32, channels as i32);
    let apply = gpu.function("augment", "augment_apply");
    let mut launch = gpu.stream.launch_builder(&apply);
    launch
        .arg(&device_images)
        .arg(&device_indices)
        .arg(&draws)
        .arg(&batch)
        .arg(&h)
        .arg(&w)
        .arg(&c)
        .arg(&4i32)
        .arg(&mean)
        .arg(&std)
        .arg(&mut output);
    // SAFETY: the arguments match augment_apply's; the buffers have the shapes given.
    unsafe { launch.launch(per_element(cpu.len())) }.expect("apply");
    assert_bits_equal(&gpu.download(&output), &cpu, "augmented pixels");
}

#[test]
fn batch_norm_statistics_and_backward_match_f64_references() {
    let Some(gpu) = Gpu::open("batch_norm_statistics_and_backward_match_f64_references") else {
        return;
    };
    let (rows, channels, rows_per_block) = (301usize, 37usize, 64usize);
    let x = values(rows * channels, 6);
    let dy = values(rows * channels, 7);
    let row_blocks = rows.div_ceil(rows_per_block);
    let grid = |rows_per_block: usize| {
        tandem_cuda::executor::launch::column_sums(channels, rows.div_ceil(rows_per_block))
    };
    let (r, c, rpb, blocks) = (
        rows as i32,
        channels as i32,
        rows_per_block as i32,
        row_blocks as i32,
    );
    let device_x = gpu.upload(&x);
    let mut partials = gpu.upload(&vec![0f64; row_blocks * 2 * channels]);
    let mut totals = gpu.upload(&vec![0f64; 1 + 2 * channels]);
    let partial = gpu.function("batchnorm", "bn_stats_partial");
    let mut launch = gpu.stream.launch_builder(&partial);
    launch
        .arg(&device_x)
        .arg(&r)
        .arg(&c)
        .arg(&rpb)
        .arg(&mut partials);
    // SAFETY: the arguments match bn_stats_partial's; partials holds one row per block.
    unsafe { launch.launch(grid(rows_per_block)) }.expect("stats partial");
    let finish = gpu.function("batchnorm", "bn_stats_finish");
    let mut launch = gpu.stream.launch_builder(&finish);
    launch
        .arg(&partials)
        .arg(&blocks)
        .arg(&r)
        .arg(&c)
        .arg(&mut totals);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(channels)) }.expect("stats finish");
    let totals_host = gpu.download(&totals);
    assert_eq!(totals_host[0], rows as f64);
    let x_ref = &x;
    let column = |c: usize| (0..rows).map(move |row| f64::from(x_ref[row * channels + c]));
    for ch in 0..channels {
        let (sum, sum_sq) = column(ch).fold((0.0, 0.0), |(s, q), v| (s + v, q + v * v));
        assert!((totals_host[1 + ch] - sum).abs() <= 1e-12 * (1.0 + sum.abs()));
        assert!((totals_host[1 + channels + ch] - sum_sq).abs() <= 1e-12 * (1.0 + sum_sq));
    }
    // The same sums whatever the block split: the order is fixed by rows_per_block alone.
    let mut again = gpu.upload(&vec![0f64; row_blocks * 2 * channels]);
    let mut launch = gpu.stream.launch_builder(&partial);
    launch
        .arg(&device_x)
        .arg(&r)
        .arg(&c)
        .arg(&rpb)
        .arg(&mut again);
    // SAFETY: as above.
    unsafe { launch.launch(grid(rows_per_block)) }.expect("stats partial again");
    assert_eq!(gpu.download(&again), gpu.download(&partials));

    // Training coefficients, then the backward against an f64 reference.
    let weight: Vec<f32> = (0..channels).map(|ch| 0.5 + 0.01 * ch as f32).collect();
    let bias: Vec<f32> = (0..channels).map(|ch| 0.1 - 0.003 * ch as f32).collect();
    let (device_weight, device_bias) = (gpu.upload(&weight), gpu.upload(&bias));
    let mut running_mean = gpu.upload(&vec![0f32; channels]);
    let mut running_var = gpu.upload(&vec![1f32; channels]);
    let zeros = vec![0f32; channels];
    let (mut mean, mut invstd) = (gpu.upload(&zeros), gpu.upload(&zeros));
    let (mut scale, mut shift) = (gpu.upload(&zeros), gpu.upload(&zeros));
    let coefficients = gpu.function("batchnorm", "bn_train_coefficients");
    let mut launch = gpu.stream.launch_builder(&coefficients);
    launch
        .arg(&totals)
        .arg(&c)
        .arg(&device_weight)
        .arg(&device_bias)
        .arg(&mut running_mean)
        .arg(&mut running_var)
        .arg(&mut mean)
        .arg(&mut invstd)
        .arg(&mut scale)
        .arg(&mut shift);
    // SAFETY: the arguments match bn_train_coefficients'; every buffer holds `channels` values.
    unsafe { launch.launch(per_element(channels)) }.expect("coefficients");
    let device_dy = gpu.upload(&dy);
    let mut backward_partials = gpu.upload(&vec![0f64; row_blocks * 2 * channels]);
    let mut backward_totals = gpu.upload(&vec![0f64; 2 * channels]);
    let (mut grad_weight, mut grad_bias) = (gpu.upload(&zeros), gpu.upload(&zeros));
    let partial = gpu.function("batchnorm", "bn_backward_partial");
    let mut launch = gpu.stream.launch_builder(&partial);
    launch
        .arg(&device_dy)
        .arg(&0u64)
        .arg(&device_x)
        .arg(&mean)
        .arg(&invstd)
        .arg(&r)
        .arg(&c)
        .arg(&rpb)
        .arg(&mut backward_partials);
    // SAFETY: the arguments match bn_backward_partial's; a null ReLU output means none.
    unsafe { launch.launch(grid(rows_per_block)) }.expect("backward partial");
    let finish = gpu.function("batchnorm", "bn_backward_finish");
    let mut launch = gpu.stream.launch_builder(&finish);
    launch
        .arg(&backward_partials)
        .arg(&blocks)
        .arg(&c)
        .arg(&mut backward_totals)
        .arg(&mut grad_weight)
        .arg(&mut grad_bias);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(channels)) }.expect("backward finish");
    let mut coefficients_out = gpu.upload(&vec![0f32; 3 * channels]);
    let backward_coefficients = gpu.function("batchnorm", "bn_backward_coefficients");
    let count = rows as f64;
    let mut launch = gpu.stream.launch_builder(&backward_coefficients);
    launch
        .arg(&backward_totals)
        .arg(&count)
        .arg(&c)
        .arg(&device_weight)
        .arg(&invstd)
        .arg(&mut coefficients_out);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(channels)) }.expect("backward coefficients");
    let mut dx = gpu.upload(&vec![0f32; x.len()]);
    let n = x.len() as i64;
    let input = gpu.function("batchnorm", "bn_backward_input");
    let mut launch = gpu.stream.launch_builder(&input);
    launch
        .arg(&device_dy)
        .arg(&0u64)
        .arg(&device_x)
        .arg(&mean)
        .arg(&invstd)
        .arg(&coefficients_out)
        .arg(&n)
        .arg(&c)
        .arg(&mut dx);
    // SAFETY: as above.
    unsafe { launch.launch(per_element(x.len())) }.expect("backward input");
    let dx = gpu.download(&dx);
    let grad_weight = gpu.download(&grad_weight);
    for ch in 0..channels {
        let mean = column(ch).sum::<f64>() / rows as f64;
        let variance = column(ch).map(|v| (v - mean) * (v - mean)).sum::<f64>() / rows as f64;
        let invstd = 1.0 / (variance + 1e-5).sqrt();
        let xhat = |row: usize| (f64::from(x[row * channels + ch]) - mean) * invstd;
        let g = |row: usize| f64::from(dy[row * channels + ch]);
        let mean_dy = (0..rows).map(g).sum::<f64>() / rows as f64;
        let mean_dy_xhat = (0..rows).map(|row| g(row) * xhat(row)).sum::<f64>() / rows as f64;
        let expected_weight_grad = mean_dy_xhat * rows as f64;
        assert!(
            (f64::from(grad_weight[ch]) - expected_weight_grad).abs()
                <= 1e-4 * (1.0 + expected_weight_grad.abs())
        );
        for row in 0..rows {
            let expected =
                f64::from(weight[ch]) * invstd * (g(row) - mean_dy - xhat(row) * mean_dy_xhat);
            let got = f64::from(dx[row * channels + ch]);
            assert!(
                (got - expected).abs() <= 1e-4 * (1.0 + expected.abs()),
                "dx[{row}, {ch}]: GPU {got} f64 {expected}"
            );
        }
    }
}

#[test]
fn the_fused_epilogue_matches_the_cpu_formula_bit_for_bit() {
    let Some(gpu) = Gpu::open("the_fused_epilogue_matches_the_cpu_formula_bit_for_bit") else {
        return;
    };
    let (rows, channels) = (29usize, 19usize);
    let n = rows * channels;
    let (x, s) = (values(n, 8), values(n, 9));
    let (scale, shift) = (values(channels, 10), values(channels, 11));
    let (scale2, shift2) = (values(channels, 12), values(channels, 13));
    let apply = gpu.function("epilogue", "bn_apply");
    let device = [&x, &s, &scale, &shift, &scale2, &shift2].map(|v| gpu.upload(v));
    for kind in 0..3i32 {
        let expected: Vec<f32> = (0..n)
            .map(|i| {
                let c = i % channels;
                let value = x[i] * scale[c] + shift[c];
                let value = match kind {
                    0 => value,
                    1 => value + s[i],
                    _ => value + (s[i] * scale2[c] + shift2[c]),
                };
                value.max(0.0)
            })
            .collect();
        let mut out = gpu.upload(&vec![0f32; n]);
        let count = n as i64;
        let c = channels as i32;
        let mut launch = gpu.stream.launch_builder(&apply);
        launch
            .arg(&device[0])
            .arg(&device[2])
            .arg(&device[3])
            .arg(&device[1])
            .arg(&device[4])
            .arg(&device[5])
            .arg(&kind)
            .arg(&1i32)
            .arg(&count)
            .arg(&c)
            .arg(&mut out);
        // SAFETY: the arguments match bn_apply's; the buffers have the shapes given.
        unsafe { launch.launch(per_element(n)) }.expect("bn_apply");
        assert_bits_equal(
            &gpu.download(&out),
            &expected,
            &format!("epilogue kind {kind}"),
        );
    }
}
