//! The reader on real files from `../shared`: the python-pickle CIFAR-10 batches (numpy
//! arrays in Python 2 pickles) and PyTorch's torch.save checkpoints of the seed-004 model.

use std::path::Path;

use tandem_pickle::{
    loads, ndarray_from_value, read_torch_state_dict, read_torch_state_dict_from_bytes, DType,
    PickleError, Scalar, TensorData, TorchCheckpoint,
};

use tandem_testdata::shared_path as shared_file;
use tandem_testdata::{assert_close, Tolerance};

#[test]
fn python2_cifar_batch_holds_a_uint8_array_and_bytes_keys() {
    tandem_testdata::skip_without_shared!();
    let path = shared_file("data/cifar10/py-mini/cifar-10-batches-py/data_batch_1");
    let bytes = std::fs::read(&path).unwrap();
    let batch = loads(&bytes).unwrap();
    let labels: Vec<i64> = batch
        .get("labels")
        .and_then(|labels| labels.as_sequence())
        .unwrap()
        .iter()
        .map(|label| label.as_int().unwrap())
        .collect();
    assert_eq!(labels.len(), 500);
    assert_eq!(labels[..5], [6, 9, 9, 4, 1]);
    assert_eq!(
        batch.get("batch_label").and_then(|label| label.as_bytes()),
        Some(&b"training batch 1 of 5"[..])
    );
    let data = ndarray_from_value(batch.get("data").unwrap()).unwrap();
    assert_eq!(data.shape, vec![500, 3072]);
    assert_eq!(data.dtype, DType::U8);
    assert_eq!(data.data.len(), 500 * 3072);
}

#[test]
fn every_truncation_of_a_real_pickle_is_an_error_not_a_panic() {
    tandem_testdata::skip_without_shared!();
    let path = shared_file("data/cifar10/py-mini/cifar-10-batches-py/batches.meta");
    let bytes = std::fs::read(&path).unwrap();
    assert!(loads(&bytes).is_ok());
    for length in 0..bytes.len() {
        assert!(
            loads(&bytes[..length]).is_err(),
            "prefix of {length} bytes loaded"
        );
    }
}

/// FNV-1a, 32 bits, over UTF-8 bytes.
fn fnv1a32(text: &str) -> u32 {
    text.bytes().fold(0x811c9dc5u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x01000193)
    })
}

/// `s[j] = sin(phase + 0.7 j)`, phase from the tensor name (golden/README.md).
fn formula_wave(name: &str, n: usize) -> Vec<f32> {
    let phase =
        2.0 * std::f64::consts::PI * f64::from(fnv1a32(&format!("tandem{name}"))) / 2f64.powi(32);
    (0..n)
        .map(|j| (phase + 0.7 * j as f64).sin() as f32)
        .collect()
}

/// The formula value of a state-dict tensor of the seed-004 model, by its role.
fn formula_tensor(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let wave = formula_wave(name, n);
    let is_batch_norm = name.contains(".bn") || name.contains("0.bn.");
    if name.ends_with("running_mean") || (name.ends_with("bias")) {
        wave.iter().map(|s| 0.1 * s).collect()
    } else if name.ends_with("running_var") {
        wave.iter().map(|s| 1.0 + 0.5 * s * s).collect()
    } else if is_batch_norm && name.ends_with("weight") {
        wave.iter().map(|s| 1.0 + 0.1 * s).collect()
    } else {
        let scale = ((n / shape[0]) as f32).sqrt();
        wave.iter().map(|s| s / scale).collect()
    }
}

/// How close a tensor read from a file is to the formula it was written from.
const FORMULA: Tolerance<f32> = Tolerance::Scaled(2e-6);

/// The formula implemented here matches PyTorch's: the golden `x` is the formula with the
/// name `input`.
#[test]
fn formula_matches_the_golden_input() {
    tandem_testdata::skip_without_shared!();
    let golden =
        std::fs::read(shared_file("golden/resnet_bottleneck_seed004.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&golden).unwrap();
    let x = tensors.tensor("x").unwrap();
    let values: Vec<f32> = x
        .data()
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .collect();
    assert_eq!(x.shape(), [16, 3, 32, 32]);
    assert_close("x", &values, &formula_wave("input", values.len()), FORMULA);
}

/// Checks a checkpoint against the formula and the golden file's shapes.
fn check_seed004_state_dict(checkpoint: &TorchCheckpoint, prefix: &str) {
    let golden =
        std::fs::read(shared_file("golden/resnet_bottleneck_seed004.safetensors")).unwrap();
    let golden = safetensors::SafeTensors::deserialize(&golden).unwrap();
    let mut checked = 0;
    for tensor in &checkpoint.tensors {
        let name = tensor
            .name
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("tensor {} lacks the prefix {prefix:?}", tensor.name));
        match &tensor.data {
            TensorData::I64(values) => {
                assert!(name.ends_with("num_batches_tracked"), "{name} is int64");
                assert_eq!(values, &vec![0]);
                assert!(tensor.shape.is_empty());
            }
            TensorData::F32(values) => {
                assert_close(name, values, &formula_tensor(name, &tensor.shape), FORMULA);
                // Parameters have a gradient in the golden file, buffers an updated copy.
                let golden_name = if name.contains("running_") {
                    format!("buffer.{name}")
                } else {
                    format!("grad.{name}")
                };
                let golden_tensor = golden.tensor(&golden_name).unwrap();
                assert_eq!(golden_tensor.shape(), tensor.shape.as_slice(), "{name}");
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "only {checked} float tensors");
    let first = &checkpoint.tensors[0];
    assert_eq!(first.name, format!("{prefix}0.conv.weight"));
    assert_eq!(first.shape, vec![16, 3, 3, 3]);
    let head = checkpoint.tensor(&format!("{prefix}1.weight")).unwrap();
    assert_eq!(head.shape, vec![10, 64]);
}

#[test]
fn epoch_checkpoint_is_a_ddp_state_dict() {
    tandem_testdata::skip_without_shared!();
    let checkpoint =
        read_torch_state_dict(&shared_file("golden/pytorch-checkpoints/epoch_3.pth")).unwrap();
    assert_eq!(checkpoint.state_dict_key, None);
    assert!(checkpoint.scalars.is_empty());
    check_seed004_state_dict(&checkpoint, "module.");
}

#[test]
fn snapshot_wraps_the_state_dict_with_epochs_run() {
    tandem_testdata::skip_without_shared!();
    let checkpoint =
        read_torch_state_dict(&shared_file("golden/pytorch-checkpoints/snapshot.pt")).unwrap();
    assert_eq!(checkpoint.state_dict_key.as_deref(), Some("MODEL_STATE"));
    assert_eq!(checkpoint.scalar("EPOCHS_RUN"), Some(&Scalar::Int(7)));
    check_seed004_state_dict(&checkpoint, "");
}

#[test]
fn damaged_checkpoints_are_errors_naming_the_file() {
    tandem_testdata::skip_without_shared!();
    let path = shared_file("golden/pytorch-checkpoints/snapshot.pt");
    let bytes = std::fs::read(&path).unwrap();
    let name = Path::new("snapshot.pt");

    let error = read_torch_state_dict_from_bytes(&bytes[..bytes.len() / 2], name).unwrap_err();
    assert!(matches!(error, PickleError::Archive { .. }), "{error}");
    assert!(
        error
            .to_string()
            .starts_with("snapshot.pt: not a torch.save zip archive"),
        "{error}"
    );

    let error = read_torch_state_dict_from_bytes(b"not a zip at all", name).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("snapshot.pt: not a torch.save zip archive"),
        "{error}"
    );

    let missing = read_torch_state_dict(Path::new("/nonexistent/snapshot.pt")).unwrap_err();
    assert!(
        missing
            .to_string()
            .starts_with("/nonexistent/snapshot.pt: "),
        "{missing}"
    );

    // Flip bytes inside the stored pickle: the zip CRC check or the pickle reader must refuse.
    let mut corrupted = bytes.clone();
    let pickle_start = corrupted
        .windows(8)
        .position(|window| window == b"data.pkl")
        .unwrap()
        + 8;
    for byte in &mut corrupted[pickle_start + 40..pickle_start + 60] {
        *byte ^= 0x5a;
    }
    let error = read_torch_state_dict_from_bytes(&corrupted, name).unwrap_err();
    assert!(error.to_string().starts_with("snapshot.pt: "), "{error}");
}
