//! PyTorch interop: weights from the tutorials' own `torch.save` files and from safetensors
//! files written outside Tandem load into the seed-004 model and give PyTorch's
//! `logits_eval` of the golden file.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::{nchw_to_nhwc, read_golden, set_formula_weights};
use safetensors::tensor::{Dtype, TensorView};
use tandem_models::{
    load_named_tensors, load_safetensors, save_safetensors, Model, ModelSpec, ResNetBaseSpec,
    TensorKind,
};

const GOLDEN: &str = "resnet_bottleneck_seed004.safetensors";

fn seed004_model() -> Model {
    Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())).expect("valid spec")
}

/// Worst |ours - PyTorch| of `logits_eval`, relative to PyTorch's largest logit.
fn logits_eval_error(model: &mut Model) -> f64 {
    let golden = read_golden(GOLDEN);
    let x = &golden["x"];
    let batch = x.shape[0];
    let images: Vec<f32> = x.values.iter().map(|v| *v as f32).collect();
    let images = nchw_to_nhwc(&images, batch, 3, 32, 32);
    let logits = model
        .forward_eval(&images, batch, 32, 32)
        .expect("eval forward");
    let expected = &golden["logits_eval"].values;
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    logits
        .iter()
        .zip(expected)
        .map(|(ours, theirs)| (f64::from(*ours) - theirs).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Loads weights into a fresh seed-004 model with `load` and checks its `logits_eval`
/// against PyTorch's; `what` starts the failure's message.
fn assert_evaluates_as_pytorch<T>(
    what: &str,
    load: impl FnOnce(&mut Model) -> Result<T, tandem_models::ModelError>,
) {
    let mut model = seed004_model();
    load(&mut model).expect("loads");
    let error = logits_eval_error(&mut model);
    assert!(error < 1e-4, "{what}logits_eval relative error {error}");
}

/// The checkpoint `name` as PyTorch saved it, among the shared golden outputs.
fn pytorch_checkpoint(name: &str) -> tandem_pickle::TorchCheckpoint {
    let path = tandem_testdata::shared_dir()
        .join("golden/pytorch-checkpoints")
        .join(name);
    tandem_pickle::read_torch_state_dict(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

#[test]
fn ddp_prefixed_state_dict_from_torch_save() {
    tandem_testdata::skip_without_shared!();
    let checkpoint = pytorch_checkpoint("epoch_3.pth");
    assert!(checkpoint
        .tensors
        .iter()
        .all(|tensor| tensor.name.starts_with("module.")));
    assert_evaluates_as_pytorch("", |model| {
        load_named_tensors(model, &checkpoint.tensors, Some("module."))
    });
}

#[test]
fn snapshot_dict_from_torch_save() {
    tandem_testdata::skip_without_shared!();
    let checkpoint = pytorch_checkpoint("snapshot.pt");
    assert_evaluates_as_pytorch("", |model| {
        load_named_tensors(model, &checkpoint.tensors, None)
    });
}

#[test]
fn safetensors_written_by_tandem_and_by_another_writer() {
    tandem_testdata::skip_without_shared!();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut formula = seed004_model();
    set_formula_weights(&mut formula);

    // Ours: save, load into a fresh model.
    let ours = dir.path().join("ours.safetensors");
    save_safetensors(&formula, &ours, &BTreeMap::new()).expect("save");
    assert_evaluates_as_pytorch("ours: ", |model| load_safetensors(model, &ours));

    // Another writer: the state dict in PyTorch layout written straight with the
    // safetensors crate, as `safetensors.torch.save_file` would.
    let mut bytes: Vec<(String, Vec<u8>, Vec<usize>, Dtype)> = Vec::new();
    for info in formula.tensors() {
        let (data, dtype) = match info.kind {
            TensorKind::BatchCount => (0i64.to_le_bytes().to_vec(), Dtype::I64),
            _ => {
                let values = formula.tensor_values(&info.name).expect("tensor exists");
                (
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    Dtype::F32,
                )
            }
        };
        bytes.push((info.name.clone(), data, info.shape.clone(), dtype));
    }
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(name, data, shape, dtype)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).expect("view"),
            )
        })
        .collect();
    let theirs = dir.path().join("theirs.safetensors");
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(
        &theirs,
        safetensors::serialize(views, Some(metadata)).expect("serialize"),
    )
    .expect("write");
    assert_evaluates_as_pytorch("theirs: ", |model| load_safetensors(model, &theirs));
}
