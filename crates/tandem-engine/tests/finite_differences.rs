//! Each layer's backward against central finite differences of its forward.
//!
//! The loss is `Σ output · r` for a fixed random `r`, accumulated in f64, so `r` is the
//! output gradient. Convolution and linear layers are linear in each argument, so the
//! differences are exact up to float32 rounding; batch norm and the loss are smooth.

use tandem_engine::batchnorm::{
    self, BatchNormParams, BatchNormScratch, BatchNormState, OutputGrad, Residual,
};
use tandem_engine::conv::{
    conv2d_backward, conv2d_forward, ConvOutputGrad, ConvScratch, InputGrad,
};
use tandem_engine::head;
use tandem_engine::rng::Rng;
use tandem_engine::shape::Conv2dShape;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

/// Checks `analytic` against central differences of `loss` around `point`, at every index
/// (or every `stride`-th one); errors are relative to the largest analytic value.
fn check(
    what: &str,
    point: &[f32],
    analytic: &[f32],
    step: f32,
    tolerance: f64,
    loss: impl Fn(&[f32]) -> f64,
) {
    assert_eq!(point.len(), analytic.len(), "{what}: gradient length");
    let scale = analytic
        .iter()
        .fold(0.0f64, |m, g| m.max(f64::from(g.abs())))
        .max(1e-6);
    let stride = (point.len() / 200).max(1);
    let mut worst = 0.0f64;
    for index in (0..point.len()).step_by(stride) {
        let mut shifted = point.to_vec();
        shifted[index] = point[index] + step;
        let up = loss(&shifted);
        shifted[index] = point[index] - step;
        let down = loss(&shifted);
        let numeric = (up - down) / (2.0 * f64::from(step));
        worst = worst.max((numeric - f64::from(analytic[index])).abs() / scale);
    }
    assert!(
        worst <= tolerance,
        "{what}: finite-difference error {worst:.3e} > {tolerance:.0e}"
    );
}

/// One argument of a layer's loss: its name, its value and the backward's gradient of it,
/// and the finite differences' tolerance.
type Argument<'a> = (String, &'a [f32], &'a [f32], f64);

/// Checks every argument's gradient with [`check`], shifting that argument alone: `loss`
/// takes the arguments' values in order.
fn check_each(arguments: &[Argument], step: f32, loss: impl Fn(&[&[f32]]) -> f64) {
    let points: Vec<&[f32]> = arguments.iter().map(|argument| argument.1).collect();
    for (index, (what, point, analytic, tolerance)) in arguments.iter().enumerate() {
        check(what, point, analytic, step, *tolerance, |shifted| {
            let mut values = points.clone();
            values[index] = shifted;
            loss(&values)
        });
    }
}

fn conv_case(shape: Conv2dShape, with_bias: bool, seed: u64) {
    let input = random(shape.input_len(), seed);
    let weight = random(shape.weight_len(), seed + 1);
    let bias = with_bias.then(|| random(shape.out_channels, seed + 2));
    let output_grad = random(shape.output_len(), seed + 3);
    let forward = |input: &[f32], weight: &[f32], bias: Option<&[f32]>| {
        let mut output = vec![0.0; shape.output_len()];
        conv2d_forward(
            &shape,
            input,
            weight,
            bias,
            &mut output,
            &mut ConvScratch::default(),
        );
        dot(&output, &output_grad)
    };
    let backward =
        |grad_weight: &mut [f32], grad_bias: Option<&mut [f32]>, grad_input: InputGrad<'_>| {
            conv2d_backward(
                &shape,
                &input,
                &weight,
                ConvOutputGrad::Values(&output_grad),
                grad_weight,
                grad_bias,
                grad_input,
                &mut ConvScratch::default(),
            )
        };
    let mut grad_weight = vec![0.0; shape.weight_len()];
    let mut grad_bias = vec![0.0; shape.out_channels];
    let mut grad_input = vec![0.0; shape.input_len()];
    backward(
        &mut grad_weight,
        with_bias.then_some(&mut grad_bias[..]),
        InputGrad::Overwrite(&mut grad_input),
    );
    let argument = |name: &str, value, grad| {
        (
            format!("conv {name} {shape:?} bias={with_bias}"),
            value,
            grad,
            1e-3,
        )
    };
    let mut arguments = vec![
        argument("input", &input[..], &grad_input[..]),
        argument("weight", &weight[..], &grad_weight[..]),
    ];
    if let Some(bias) = &bias {
        arguments.push(argument("bias", &bias[..], &grad_bias[..]));
    }
    check_each(&arguments, 1e-2, |values| {
        forward(values[0], values[1], values.get(2).copied())
    });

    // Accumulating adds to what is there; the weight gradient accumulates too.
    let mut accumulated = vec![0.5; shape.input_len()];
    backward(
        &mut grad_weight,
        None,
        InputGrad::Accumulate(&mut accumulated),
    );
    for (a, g) in accumulated.iter().zip(&grad_input) {
        assert!(
            (a - (0.5 + g)).abs() <= 1e-5 * (1.0 + g.abs()),
            "accumulated input gradient"
        );
    }
}

/// Each convolution's shape (batch, size, channels, kernel, stride, padding), whether it
/// has a bias, and the seed of its values.
#[test]
fn conv_backward_matches_finite_differences() {
    let cases = [
        // 3x3 stride 2 padding 1, odd sizes.
        (Conv2dShape::new(2, (5, 7), (3, 4), 3, 2, 1), true, 10),
        (Conv2dShape::new(3, (6, 5), (2, 5), 3, 1, 0), false, 20),
        // 1x1 pointwise.
        (Conv2dShape::new(3, (4, 3), (5, 6), 1, 1, 0), true, 30),
        (Conv2dShape::new(2, (5, 5), (4, 3), 1, 2, 0), false, 40),
        (Conv2dShape::new(2, (9, 11), (3, 4), 7, 2, 3), true, 50),
        // More images than one chunk holds, so several chunks and workers are involved.
        (Conv2dShape::new(37, (3, 3), (2, 3), 3, 1, 1), true, 60),
    ];
    for (shape, with_bias, seed) in cases {
        conv_case(shape, with_bias, seed);
    }
}

#[test]
fn conv_output_matches_direct_sum() {
    let shape = Conv2dShape::new(1, (3, 4), (2, 2), 3, 2, 1);
    let input = random(shape.input_len(), 1);
    let weight = random(shape.weight_len(), 2);
    let mut output = vec![0.0; shape.output_len()];
    conv2d_forward(
        &shape,
        &input,
        &weight,
        None,
        &mut output,
        &mut ConvScratch::default(),
    );
    let (out_h, out_w) = (shape.out_height(), shape.out_width());
    assert_eq!((out_h, out_w), (2, 2));
    for oy in 0..out_h {
        for ox in 0..out_w {
            for o in 0..2 {
                let mut sum = 0.0f32;
                for ky in 0..3 {
                    for kx in 0..3 {
                        let (iy, ix) = ((oy * 2 + ky) as isize - 1, (ox * 2 + kx) as isize - 1);
                        if iy < 0 || ix < 0 || iy >= 3 || ix >= 4 {
                            continue;
                        }
                        for i in 0..2 {
                            sum += input[((iy as usize) * 4 + ix as usize) * 2 + i]
                                * weight[((o * 3 + ky) * 3 + kx) * 2 + i];
                        }
                    }
                }
                let ours = output[(oy * out_w + ox) * 2 + o];
                assert!(
                    (ours - sum).abs() < 1e-5,
                    "output ({oy},{ox},{o}): {ours} vs {sum}"
                );
            }
        }
    }
}

/// Training-mode batch norm output for `input`, `weight`, `bias`.
fn batchnorm_train(input: &[f32], weight: &[f32], bias: &[f32]) -> (Vec<f32>, BatchNormState) {
    let channels = weight.len();
    let mut state = BatchNormState::new(channels);
    let (mut running_mean, mut running_var) = (vec![0.0; channels], vec![1.0; channels]);
    let params = BatchNormParams { weight, bias };
    batchnorm::train_statistics(
        input,
        &params,
        &mut running_mean,
        &mut running_var,
        &mut state,
    )
    .expect("statistics");
    let mut output = vec![0.0; input.len()];
    batchnorm::apply(input, &state, Residual::None, false, &mut output);
    (output, state)
}

/// Batch norm alone, and followed by a ReLU whose backward is fused into the batch-norm pass.
#[test]
fn batchnorm_train_backward_matches_finite_differences() {
    for relu in [false, true] {
        batchnorm_backward_case(relu);
    }
}

fn batchnorm_backward_case(relu: bool) {
    let (rows, channels) = (2 * 3 * 5, 3);
    let input: Vec<f32> = random(rows * channels, 70)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2.0 + (i % channels) as f32)
        .collect();
    let weight = vec![1.2, 0.7, -0.9];
    let bias = vec![0.1, -0.3, 0.2];
    let output_grad = random(rows * channels, 71);
    let layer = |x: &[f32], w: &[f32], b: &[f32]| {
        let (output, state) = batchnorm_train(x, w, b);
        let output = if relu {
            output.iter().map(|v| v.max(0.0)).collect()
        } else {
            output
        };
        (output, state)
    };
    let (output, state) = layer(&input, &weight, &bias);
    assert!(
        !relu || output.iter().filter(|v| **v == 0.0).count() > rows * channels / 4,
        "the ReLU case must cut a good part of the gradient"
    );
    let (mut grad_weight, mut grad_bias, mut grad_input) = (
        vec![0.0; channels],
        vec![0.0; channels],
        vec![0.0; input.len()],
    );
    let grad = OutputGrad {
        values: &output_grad,
        relu_output: relu.then_some(&output[..]),
    };
    let mut scratch = BatchNormScratch::default();
    let coefficients = batchnorm::backward_coefficients(
        grad,
        &input,
        &weight,
        &state,
        &mut grad_weight,
        &mut grad_bias,
        None,
        &mut scratch,
    )
    .expect("backward");
    batchnorm::backward(grad, &input, coefficients, &mut grad_input);
    let loss = |x: &[f32], w: &[f32], b: &[f32]| dot(&layer(x, w, b).0, &output_grad);
    let what = if relu { "batchnorm+relu" } else { "batchnorm" };
    let arguments = [
        (format!("{what} input"), &input[..], &grad_input[..], 2e-3),
        (
            format!("{what} weight"),
            &weight[..],
            &grad_weight[..],
            1e-3,
        ),
        (format!("{what} bias"), &bias[..], &grad_bias[..], 1e-3),
    ];
    check_each(&arguments, 1e-3, |values| {
        loss(values[0], values[1], values[2])
    });
}

#[test]
fn batchnorm_statistics_follow_pytorch() {
    // One channel, values 1..=4: mean 2.5, biased var 1.25, unbiased var 5/3.
    let input = [1.0, 2.0, 3.0, 4.0];
    let mut state = BatchNormState::new(1);
    let (mut running_mean, mut running_var) = (vec![0.0], vec![1.0]);
    let params = BatchNormParams {
        weight: &[2.0],
        bias: &[0.5],
    };
    batchnorm::train_statistics(
        &input,
        &params,
        &mut running_mean,
        &mut running_var,
        &mut state,
    )
    .unwrap();
    assert!((running_mean[0] - 0.25).abs() < 1e-7);
    assert!((running_var[0] - (0.9 + 0.1 * 5.0 / 3.0)).abs() < 1e-6);
    let mut output = [0.0; 4];
    batchnorm::apply(
        &input,
        &state,
        Residual::Identity(&[1.0; 4]),
        true,
        &mut output,
    );
    let invstd = 1.0 / (1.25f64 + 1e-5).sqrt();
    for (x, y) in input.iter().zip(output) {
        let expected = ((f64::from(*x) - 2.5) * invstd * 2.0 + 0.5 + 1.0).max(0.0);
        assert!((f64::from(y) - expected).abs() < 1e-5, "{y} vs {expected}");
    }
    let error = batchnorm::train_statistics(
        &[1.0],
        &params,
        &mut running_mean,
        &mut running_var,
        &mut state,
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "batch norm needs more than one value per channel to normalize in training mode, got 1"
    );
}

#[test]
fn relu_backward_masks_where_output_is_not_positive() {
    let mut grad = vec![1.0, 2.0, 3.0, 4.0];
    batchnorm::relu_backward_in_place(&mut grad, &[0.5, 0.0, -1.0, 2.0]);
    assert_eq!(grad, vec![1.0, 0.0, 0.0, 4.0]);
}

#[test]
fn linear_backward_matches_finite_differences() {
    let (batch, inputs, outputs) = (3, 5, 4);
    let input = random(batch * inputs, 80);
    let weight = random(outputs * inputs, 81);
    let bias = random(outputs, 82);
    let output_grad = random(batch * outputs, 83);
    let forward = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut output = vec![0.0; batch * outputs];
        head::linear_forward(x, w, b, &mut output);
        dot(&output, &output_grad)
    };
    let (mut grad_weight, mut grad_bias, mut grad_input) = (
        vec![0.0; weight.len()],
        vec![0.0; outputs],
        vec![0.0; input.len()],
    );
    head::linear_backward(
        &input,
        &weight,
        &output_grad,
        &mut grad_weight,
        &mut grad_bias,
        Some(&mut grad_input),
    );
    let arguments = [
        (
            "linear input".to_string(),
            &input[..],
            &grad_input[..],
            1e-3,
        ),
        (
            "linear weight".to_string(),
            &weight[..],
            &grad_weight[..],
            1e-3,
        ),
        ("linear bias".to_string(), &bias[..], &grad_bias[..], 1e-3),
    ];
    check_each(&arguments, 1e-2, |values| {
        forward(values[0], values[1], values[2])
    });
}

#[test]
fn average_pool_backward_matches_finite_differences() {
    let (batch, pixels, channels) = (2, 7, 3);
    let input = random(batch * pixels * channels, 90);
    let output_grad = random(batch * channels, 91);
    let forward = |x: &[f32]| {
        let mut output = vec![0.0; batch * channels];
        head::average_pool_forward(x, pixels, channels, &mut output);
        dot(&output, &output_grad)
    };
    let mut grad_input = vec![0.0; input.len()];
    head::average_pool_backward(&output_grad, pixels, channels, &mut grad_input);
    check("average pool", &input, &grad_input, 1e-2, 1e-3, forward);
}

#[test]
fn cross_entropy_with_label_smoothing_matches_finite_differences() {
    let (batch, classes) = (4, 5);
    let logits: Vec<f32> = random(batch * classes, 100)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let labels = [0, 4, 2, 2];
    for smoothing in [0.0, 0.1, 0.3] {
        let loss = |x: &[f32]| {
            let mut probabilities = vec![0.0; x.len()];
            f64::from(
                head::cross_entropy_forward(x, &labels, smoothing, &mut probabilities)
                    .expect("labels"),
            )
        };
        let mut probabilities = vec![0.0; logits.len()];
        head::cross_entropy_forward(&logits, &labels, smoothing, &mut probabilities).unwrap();
        let mut grad = vec![0.0; logits.len()];
        head::cross_entropy_backward(&probabilities, &labels, smoothing, 1.0, &mut grad);
        check(
            &format!("cross entropy smoothing {smoothing}"),
            &logits,
            &grad,
            1e-2,
            2e-3,
            loss,
        );
    }
}

#[test]
fn cross_entropy_values_and_bad_label() {
    // Equal logits: every class has probability 1/K, whatever the smoothing.
    let mut probabilities = vec![0.0; 6];
    let loss = head::cross_entropy_forward(&[0.0; 6], &[1, 2], 0.2, &mut probabilities).unwrap();
    assert!((f64::from(loss) - 3f64.ln()).abs() < 1e-6);
    // Smoothing mixes in the mean negative log-probability: logits [0, ln 2] label 0.
    let loss =
        head::cross_entropy_forward(&[0.0, 2f32.ln()], &[0], 0.5, &mut probabilities[..2]).unwrap();
    let expected = 0.5 * 3f64.ln() + 0.5 * (3f64.ln() + (3f64 / 2.0).ln()) / 2.0;
    assert!(
        (f64::from(loss) - expected).abs() < 1e-6,
        "{loss} vs {expected}"
    );
    let error =
        head::cross_entropy_forward(&[0.0; 6], &[1, 3], 0.0, &mut probabilities).unwrap_err();
    assert_eq!(
        error.to_string(),
        "label 3 of sample 1 is not a class index (0..3)"
    );
}
