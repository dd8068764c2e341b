//! Shared helpers of the integration tests: the shared-data location, the golden files and
//! the formula weights of `golden/README.md`.
#![allow(dead_code)]

use std::collections::BTreeMap;

use safetensors::tensor::{Dtype, SafeTensors};
use tandem_models::{Model, TensorKind};

/// A golden tensor converted to f64.
pub struct GoldenTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

/// Every tensor of a golden file, by name. Panics (failing the test) with the missing path.
pub fn read_golden(file: &str) -> BTreeMap<String, GoldenTensor> {
    let path = tandem_testdata::shared_path(&format!("golden/{file}"));
    let bytes = std::fs::read(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    let file = SafeTensors::deserialize(&bytes).expect("golden file parses");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values: Vec<f64> = match view.dtype() {
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
                    .collect(),
                Dtype::F64 => data
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("golden tensor {name} has unexpected dtype {other:?}"),
            };
            (
                name,
                GoldenTensor {
                    shape: view.shape().to_vec(),
                    values,
                },
            )
        })
        .collect()
}

fn fnv1a32(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

/// `sin(phase + 0.7 j)` for `j = 0..n`, phase from the FNV-1a hash of `"tandem" + name`.
pub fn formula_sines(name: &str, n: usize) -> Vec<f64> {
    let phase =
        2.0 * std::f64::consts::PI * f64::from(fnv1a32(&format!("tandem{name}"))) / 4_294_967_296.0;
    (0..n).map(|j| (phase + 0.7 * j as f64).sin()).collect()
}

/// The formula input `x` (NCHW, as stored) and labels `y` for a batch.
pub fn formula_input(batch: usize) -> (Vec<f32>, Vec<u32>) {
    let x = formula_sines("input", batch * 3 * 32 * 32)
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let y = (0..batch).map(|i| ((7 * i + 6) % 10) as u32).collect();
    (x, y)
}

/// NCHW → NHWC.
pub fn nchw_to_nhwc(
    x: &[f32],
    batch: usize,
    channels: usize,
    height: usize,
    width: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    let positions = tandem_models::channels_last_indices([batch, channels, height, width]);
    for (&value, position) in x.iter().zip(positions) {
        out[position] = value;
    }
    out
}

/// Sets every parameter and buffer of `model` to the README's formula values.
pub fn set_formula_weights(model: &mut Model) {
    let infos = model.tensors().to_vec();
    let is_batchnorm = |prefix: &str| {
        infos
            .iter()
            .any(|info| info.name == format!("{prefix}.running_mean"))
    };
    for info in &infos {
        if info.kind == TensorKind::BatchCount {
            continue;
        }
        let n: usize = info.shape.iter().product();
        let s = formula_sines(&info.name, n);
        let (prefix, suffix) = info.name.rsplit_once('.').expect("names have a suffix");
        let values: Vec<f32> = match suffix {
            "running_mean" => s.iter().map(|v| 0.1 * v).collect::<Vec<f64>>(),
            "running_var" => s.iter().map(|v| 1.0 + 0.5 * v * v).collect(),
            "weight" if is_batchnorm(prefix) => s.iter().map(|v| 1.0 + 0.1 * v).collect(),
            "weight" => {
                let scale = (n as f64 / info.shape[0] as f64).sqrt();
                s.iter().map(|v| v / scale).collect()
            }
            "bias" => s.iter().map(|v| 0.1 * v).collect(),
            other => panic!("unexpected tensor suffix {other}"),
        }
        .into_iter()
        .map(|v| v as f32)
        .collect();
        assert!(
            model.set_tensor_values(&info.name, &values),
            "set {}",
            info.name
        );
    }
    model.set_num_batches_tracked(0);
}
