//! The classifier head: global average pooling, a linear layer and mean cross-entropy.

use crate::error::EngineError;
use crate::matmul::{matmul, MatRef};

/// Mean over the pixels of each image and channel: `[batch, pixels, channels]` → `[batch, channels]`.
pub fn average_pool_forward(input: &[f32], pixels: usize, channels: usize, output: &mut [f32]) {
    assert_eq!(input.len(), output.len() * pixels, "average pool: lengths");
    for (image, pooled) in input
        .chunks_exact(pixels * channels)
        .zip(output.chunks_exact_mut(channels))
    {
        // Pixel rows are added in order, whole rows at a time, so the loop vectorizes over
        // the channels.
        pooled.fill(0.0);
        for pixel in image.chunks_exact(channels) {
            for (sum, value) in pooled.iter_mut().zip(pixel) {
                *sum += value;
            }
        }
        let inverse = 1.0 / pixels as f32;
        for value in pooled.iter_mut() {
            *value *= inverse;
        }
    }
}

/// Backward of [`average_pool_forward`]: writes `grad_output / pixels` to every pixel.
pub fn average_pool_backward(
    grad_output: &[f32],
    pixels: usize,
    channels: usize,
    grad_input: &mut [f32],
) {
    assert_eq!(
        grad_input.len(),
        grad_output.len() * pixels,
        "average pool backward: lengths"
    );
    let inverse = 1.0 / pixels as f32;
    for (image, grad) in grad_input
        .chunks_exact_mut(pixels * channels)
        .zip(grad_output.chunks_exact(channels))
    {
        for pixel in image.chunks_exact_mut(channels) {
            for (target, g) in pixel.iter_mut().zip(grad) {
                *target = g * inverse;
            }
        }
    }
}

/// `output[b, o] = Σ_i input[b, i] · weight[o, i] + bias[o]`; weight is `[out, in]` as in PyTorch.
pub fn linear_forward(input: &[f32], weight: &[f32], bias: &[f32], output: &mut [f32]) {
    let (outputs, inputs) = (bias.len(), weight.len() / bias.len().max(1));
    let batch = input.len() / inputs.max(1);
    assert_eq!(weight.len(), outputs * inputs, "linear: weight length");
    assert_eq!(output.len(), batch * outputs, "linear: output length");
    matmul(
        output,
        outputs,
        MatRef::row_major(input, batch, inputs),
        MatRef::row_major(weight, outputs, inputs).transposed(),
        false,
    );
    for row in output.chunks_exact_mut(outputs) {
        for (value, b) in row.iter_mut().zip(bias) {
            *value += b;
        }
    }
}

/// Backward of [`linear_forward`]: adds to `grad_weight`/`grad_bias`, writes `grad_input`.
pub fn linear_backward(
    input: &[f32],
    weight: &[f32],
    grad_output: &[f32],
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
    grad_input: Option<&mut [f32]>,
) {
    let (outputs, inputs) = (grad_bias.len(), weight.len() / grad_bias.len().max(1));
    let batch = input.len() / inputs.max(1);
    assert_eq!(
        grad_output.len(),
        batch * outputs,
        "linear backward: grad_output length"
    );
    let grad_output_matrix = MatRef::row_major(grad_output, batch, outputs);
    matmul(
        grad_weight,
        inputs,
        grad_output_matrix.transposed(),
        MatRef::row_major(input, batch, inputs),
        true,
    );
    for (o, total) in grad_bias.iter_mut().enumerate() {
        let sum: f64 = grad_output
            .chunks_exact(outputs)
            .map(|row| f64::from(row[o]))
            .sum();
        *total += sum as f32;
    }
    if let Some(grad_input) = grad_input {
        matmul(
            grad_input,
            inputs,
            grad_output_matrix,
            MatRef::row_major(weight, outputs, inputs),
            false,
        );
    }
}

/// Mean cross-entropy of `logits` (`[batch, classes]`) against `labels`, as PyTorch's
/// `CrossEntropyLoss(label_smoothing)`. Keeps the softmax in `probabilities` for the backward.
pub fn cross_entropy_forward(
    logits: &[f32],
    labels: &[u32],
    label_smoothing: f32,
    probabilities: &mut [f32],
) -> Result<f32, EngineError> {
    let batch = labels.len();
    let classes = logits.len() / batch.max(1);
    assert_eq!(
        logits.len(),
        batch * classes,
        "cross entropy: logits length"
    );
    assert_eq!(
        probabilities.len(),
        logits.len(),
        "cross entropy: probabilities length"
    );
    let smoothing = f64::from(label_smoothing);
    let mut total = 0.0f64;
    let rows = logits
        .chunks_exact(classes)
        .zip(probabilities.chunks_exact_mut(classes));
    for (sample, ((row, probs), &label)) in rows.zip(labels).enumerate() {
        let target = label as usize;
        if target >= classes {
            return Err(EngineError::InvalidLabel {
                sample,
                label,
                classes,
            });
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum_exp: f64 = row
            .iter()
            .map(|&v| (f64::from(v) - f64::from(max)).exp())
            .sum();
        let log_sum_exp = f64::from(max) + sum_exp.ln();
        for (p, &v) in probs.iter_mut().zip(row) {
            *p = (f64::from(v) - log_sum_exp).exp() as f32;
        }
        let target_log_prob = f64::from(row[target]) - log_sum_exp;
        let mean_log_prob =
            row.iter().map(|&v| f64::from(v) - log_sum_exp).sum::<f64>() / classes as f64;
        total += -(1.0 - smoothing) * target_log_prob - smoothing * mean_log_prob;
    }
    Ok((total / batch.max(1) as f64) as f32)
}

/// Backward of [`cross_entropy_forward`]: `grad_logits = scale · (softmax − target) / batch`
/// with target `(1 − ε)·onehot + ε / classes`.
pub fn cross_entropy_backward(
    probabilities: &[f32],
    labels: &[u32],
    label_smoothing: f32,
    scale: f32,
    grad_logits: &mut [f32],
) {
    let batch = labels.len();
    let classes = probabilities.len() / batch.max(1);
    let factor = scale / batch.max(1) as f32;
    let off_target = label_smoothing / classes as f32;
    let rows = probabilities
        .chunks_exact(classes)
        .zip(grad_logits.chunks_exact_mut(classes));
    for ((probs, grads), &label) in rows.zip(labels) {
        for (class, (g, &p)) in grads.iter_mut().zip(probs).enumerate() {
            let target = if class == label as usize {
                1.0 - label_smoothing + off_target
            } else {
                off_target
            };
            *g = (p - target) * factor;
        }
    }
}
