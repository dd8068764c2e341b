//! Loading model weights from any file a user may bring: our checkpoints and snapshots,
//! PyTorch's safetensors, and the tutorials' own `torch.save` files. A file that holds
//! another model is refused with what it holds and the flags that load it.

use std::path::Path;

use anyhow::{bail, Context};
use tandem_models::{
    infer_spec, spec_tensor_shapes, Model, ModelSpec, NamedTensor, StateDictMismatch, TensorKind,
    TensorShapes,
};

use crate::checkpoint_info::CheckpointInfo;
use crate::model_args::ModelArgs;
use crate::train::snapshot::{Snapshot, METADATA_KEY as SNAPSHOT_KEY};

/// The prefix `DistributedDataParallel` puts before every key of its `state_dict`.
const DDP_PREFIX: &str = "module.";

/// What a weights file says about itself: `None` for files without Tandem's description
/// (PyTorch's, `torch.save` files, Tandem's older checkpoints).
/// A description the file's tensors do not bear out is an error naming its fields, found
/// before any model is built from it.
pub fn read_checkpoint_info(path: &Path) -> anyhow::Result<Option<CheckpointInfo>> {
    if is_zip_archive(path)? {
        return Ok(None);
    }
    let header = tandem_models::read_safetensors_header(path)
        .with_context(|| format!("cannot read weights file {}", path.display()))?;
    let info = CheckpointInfo::from_metadata(&header.metadata)
        .with_context(|| format!("cannot read the description in {}", path.display()))?;
    if let Some(info) = &info {
        check_description(info, &header, path)?;
    }
    Ok(info)
}

/// Refuses a described model that the file's tensors do not hold: a state dict must hold
/// exactly its tensors, a snapshot's flat parameters and buffers exactly its values. The
/// described model's layout (names and shapes, no values) is computed only once its blocks
/// are no more than the file has tensors (or a snapshot has values), so a description of
/// 10^8 blocks or channels costs nothing.
fn check_description(
    info: &CheckpointInfo,
    header: &tandem_models::SafetensorsHeader,
    path: &Path,
) -> anyhow::Result<()> {
    let spec = info
        .model
        .to_spec()
        .with_context(|| format!("cannot read the description in {}", path.display()))?;
    let snapshot = header.metadata.contains_key(SNAPSHOT_KEY);
    let elements = |name: &str| {
        header.shapes.get(name).map_or(0usize, |shape| {
            shape.iter().fold(1usize, |n, &dim| n.saturating_mul(dim))
        })
    };
    let (capacity, holds) = match snapshot {
        true => {
            let values = elements("params").saturating_add(elements("buffers"));
            (values, format!("its snapshot tensors hold {values} values"))
        }
        false => (
            header.shapes.len(),
            format!("it holds {} tensors", header.shapes.len()),
        ),
    };
    let blocks = match &spec {
        ModelSpec::ResNet18 { .. } => 8,
        ModelSpec::ResNetBase(base) => base
            .n_blocks
            .iter()
            .fold(0usize, |total, &blocks| total.saturating_add(blocks)),
    };
    let refuse = |details: String| {
        anyhow::anyhow!(
            "{} describes in its metadata a model its tensors do not hold ({}): {details}; \
             the metadata was edited or damaged",
            path.display(),
            metadata_fields(&info.model)
        )
    };
    if blocks > capacity {
        return Err(refuse(format!(
            "{} adds up to {blocks} blocks, but {holds}",
            match spec {
                ModelSpec::ResNet18 { .. } => "the model",
                ModelSpec::ResNetBase(_) => "tandem.n-blocks",
            }
        )));
    }
    let described = spec_tensor_shapes(&spec);
    if snapshot {
        let values = described
            .iter()
            .filter(|(name, _)| !name.ends_with("num_batches_tracked"))
            .map(|(_, shape)| shape.iter().fold(1usize, |n, &dim| n.saturating_mul(dim)))
            .fold(0usize, usize::saturating_add);
        if values != capacity {
            return Err(refuse(format!("{values} values, but {holds}")));
        }
        return Ok(());
    }
    let prefixed = header
        .shapes
        .keys()
        .any(|name| name.starts_with(DDP_PREFIX));
    let shapes = without_prefix(header.shapes.clone(), prefixed.then_some(DDP_PREFIX));
    let mismatch = StateDictMismatch::between(&shapes, &described);
    if mismatch.is_empty() {
        return Ok(());
    }
    let details = match infer_spec(&shapes) {
        Some(inferred) => {
            let inferred = ModelArgs::from_spec(&inferred);
            let differing: Vec<String> = ModelArgs::from_spec(&spec)
                .contradictions(&inferred)
                .iter()
                .filter_map(|flag| flag.strip_prefix("--"))
                .map(|flag| flag.replacen(' ', " = ", 1))
                .map(|field| format!("tandem.{field}"))
                .collect();
            format!(
                "{} is not what the tensors hold, `{}`",
                differing.join(", "),
                inferred.to_flags()
            )
        }
        None => mismatch.summary(),
    };
    Err(refuse(details))
}

/// A model description as its metadata fields: `tandem.model = resnet-base, tandem.n-blocks
/// = 1,1,1, ...`.
fn metadata_fields(model: &ModelArgs) -> String {
    model
        .flag_values()
        .into_iter()
        .map(|(flag, value)| format!("tandem.{flag} = {value}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where loaded weights stand in the run that wrote them, as far as their file says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightsProgress {
    /// The epochs done: a Tandem file's epoch, or a `torch.save` file's `EPOCHS_RUN` (the
    /// DDP tutorial's snapshot).
    pub epoch: Option<u64>,
    /// The optimizer steps done (Tandem files).
    pub step: Option<u64>,
}

impl WeightsProgress {
    /// What a Tandem file's description says.
    fn of(info: Option<&CheckpointInfo>) -> WeightsProgress {
        WeightsProgress {
            epoch: info
                .and_then(|info| info.epoch.as_ref())
                .map(|epoch| epoch.epoch),
            step: info.map(|info| info.step),
        }
    }
}

/// Loads weights into `model` from `path`, choosing the reader by the file's first bytes:
/// a zip archive is a `torch.save` file, anything else is safetensors: a snapshot (its
/// weights; the optimizer state is left out) or a `state_dict`. Returns where the weights
/// stand, as the file says.
pub fn load_weights(model: &mut Model, path: &Path) -> anyhow::Result<WeightsProgress> {
    if is_zip_archive(path)? {
        let file = tandem_models::TorchSaveFile::open(model, path)
            .with_context(|| format!("cannot read PyTorch checkpoint {}", path.display()))?;
        let shapes = file.shapes();
        let prefixed = shapes.keys().any(|name| name.starts_with(DDP_PREFIX));
        let prefix = prefixed.then_some(DDP_PREFIX);
        check_fits(model, &without_prefix(shapes, prefix), None, path)?;
        let checkpoint = file
            .load_into(model, prefix)
            .with_context(|| format!("cannot load weights from {}", path.display()))?;
        let epochs_run = checkpoint
            .scalars
            .iter()
            .find_map(|(key, value)| match value {
                tandem_pickle::Scalar::Int(epochs) if key == "EPOCHS_RUN" => {
                    u64::try_from(*epochs).ok()
                }
                _ => None,
            });
        return Ok(WeightsProgress {
            epoch: epochs_run,
            step: None,
        });
    }
    let metadata = tandem_models::read_safetensors_metadata(path)
        .with_context(|| format!("cannot read weights file {}", path.display()))?;
    // A damaged description is no reason to refuse weights that fit.
    let info = CheckpointInfo::from_metadata(&metadata).ok().flatten();
    if metadata.contains_key(SNAPSHOT_KEY) {
        load_snapshot_weights(model, path, info.as_ref())?;
        return Ok(WeightsProgress::of(info.as_ref()));
    }
    let (tensors, _) = tandem_models::read_safetensors(path, |name| {
        match model.tensor_info(name).map(|info| info.kind) {
            Some(TensorKind::BatchCount) => "I64",
            _ => "F32",
        }
    })
    .with_context(|| format!("cannot read weights file {}", path.display()))?;
    load_state_dict(model, &tensors, info.as_ref(), path)?;
    Ok(WeightsProgress::of(info.as_ref()))
}

/// Loads `state_dict` tensors after checking that they are this model's, every one.
fn load_state_dict(
    model: &mut Model,
    tensors: &[NamedTensor],
    info: Option<&CheckpointInfo>,
    path: &Path,
) -> anyhow::Result<()> {
    let shapes: TensorShapes = tensors
        .iter()
        .map(|tensor| (tensor.name.clone(), tensor.shape.clone()))
        .collect();
    check_fits(model, &shapes, info, path)?;
    tandem_models::load_named_tensors(model, tensors, None)
        .with_context(|| format!("cannot load weights from {}", path.display()))
}

/// `shapes` with `prefix` taken off the names that carry it.
fn without_prefix(shapes: TensorShapes, prefix: Option<&str>) -> TensorShapes {
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let name = prefix
                .and_then(|prefix| name.strip_prefix(prefix))
                .map_or(name.clone(), str::to_string);
            (name, shape)
        })
        .collect()
}

/// Refuses a file whose tensors (`shapes`) are not exactly this model's, saying what the
/// file holds and the flags that load it.
fn check_fits(
    model: &Model,
    shapes: &TensorShapes,
    info: Option<&CheckpointInfo>,
    path: &Path,
) -> anyhow::Result<()> {
    let mismatch = StateDictMismatch::between(shapes, &spec_tensor_shapes(model.spec()));
    if mismatch.is_empty() {
        return Ok(());
    }
    let holds = match info {
        Some(info) => Holds::Described(info.model.clone()),
        None => match infer_spec(shapes) {
            Some(spec) => Holds::Inferred(ModelArgs::from_spec(&spec)),
            None => Holds::Unknown(shapes.len()),
        },
    };
    bail!(wrong_model_message(
        path,
        model.spec(),
        &holds,
        &mismatch.summary()
    ))
}

/// Puts a snapshot's weights and BN state into `model`, after checking it is the same model.
fn load_snapshot_weights(
    model: &mut Model,
    path: &Path,
    info: Option<&CheckpointInfo>,
) -> anyhow::Result<()> {
    let snapshot = Snapshot::load(path)?;
    let built = format!("{:?}", Some(model.spec()));
    let holds = match info {
        Some(info) => (info.model.to_spec().ok().as_ref() != Some(model.spec()))
            .then(|| Holds::Described(info.model.clone())),
        // Snapshots written before the description record the model in their settings.
        None => snapshot
            .settings
            .get("model")
            .filter(|recorded| **recorded != built)
            .map(|recorded| Holds::Recorded(recorded.clone())),
    };
    if let Some(holds) = holds {
        bail!(wrong_model_message(
            path,
            model.spec(),
            &holds,
            "a snapshot's weights fit only the model it was taken of"
        ));
    }
    snapshot
        .restore_model(model)
        .with_context(|| format!("cannot load the weights of snapshot {}", path.display()))
}

/// What a file that does not fit the model holds, as far as can be told.
enum Holds {
    /// The model its metadata describes.
    Described(ModelArgs),
    /// The model its tensor names and shapes match exactly.
    Inferred(ModelArgs),
    /// The model a pre-description snapshot records, as the run printed it.
    Recorded(String),
    /// Neither model: this many tensors.
    Unknown(usize),
}

/// "FILE holds X, not the model built here (Y): DETAILS. Load it with: FLAGS".
fn wrong_model_message(path: &Path, built: &ModelSpec, holds: &Holds, details: &str) -> String {
    let built = ModelArgs::from_spec(built).to_flags();
    let (what, flags) = match holds {
        Holds::Described(args) => (
            format!("the model `{}` (from its metadata)", args.to_flags()),
            Some(args.to_flags()),
        ),
        Holds::Inferred(args) => (
            format!("the model `{}` (told from its tensors)", args.to_flags()),
            Some(args.to_flags()),
        ),
        Holds::Recorded(model) => (format!("another model ({model})"), None),
        Holds::Unknown(count) => (
            format!("{count} tensors that are not a model Tandem builds (resnet18 or resnet-base)"),
            None,
        ),
    };
    let mut message = format!(
        "{} holds {what}, not the model built here (`{built}`): {details}",
        path.display()
    );
    if let Some(flags) = flags {
        message.push_str(&format!("\nload it with: {flags}"));
    }
    message
}

/// Whether the file starts with a zip archive's local-header signature.
fn is_zip_archive(path: &Path) -> anyhow::Result<bool> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open weights file {}", path.display()))?;
    let mut signature = [0u8; 4];
    let read = file
        .read(&mut signature)
        .with_context(|| format!("cannot read weights file {}", path.display()))?;
    Ok(read == 4 && signature == *b"PK\x03\x04")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::snapshot::Progress;
    use crate::train::snapshot::Snapshot;
    use std::collections::BTreeMap;
    use tandem_engine::OptimizerState;

    fn small_model() -> Model {
        let args = crate::model_args::ModelArgs {
            n_blocks: Some(vec![1, 1, 1]),
            n_channels: Some(vec![4, 8, 8]),
            bottlenecks: Some("none".to_string()),
            ..Default::default()
        };
        let mut model = Model::new(&args.to_spec().unwrap()).unwrap();
        model.init_default(1);
        model
    }

    #[test]
    fn a_snapshot_gives_its_weights_and_bn_statistics() {
        let mut trained = small_model();
        for (index, value) in trained.params_mut().iter_mut().enumerate() {
            *value = index as f32 * 1e-3;
        }
        for (index, value) in trained.buffers_mut().iter_mut().enumerate() {
            *value = 1.0 + index as f32;
        }
        trained.set_num_batches_tracked(17);
        let snapshot = Snapshot::capture(
            &trained,
            OptimizerState {
                step: 5,
                slots: vec![(
                    "momentum_buffer".to_string(),
                    vec![0.5; trained.params().len()],
                )],
            },
            Progress {
                epoch: 3,
                ..Progress::default()
            },
            Vec::new(),
            BTreeMap::from([("lr".to_string(), "0.1".to_string())]),
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("snapshot.safetensors");
        snapshot.save(&path).unwrap();

        let mut fresh = small_model();
        load_weights(&mut fresh, &path).unwrap();
        assert_eq!(fresh.params(), trained.params());
        assert_eq!(fresh.buffers(), trained.buffers());
        assert_eq!(fresh.num_batches_tracked(), 17);
    }

    #[test]
    fn a_weights_file_is_not_taken_for_a_snapshot() {
        let model = small_model();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("epoch_1.safetensors");
        tandem_models::save_safetensors(&model, &path, &BTreeMap::new()).unwrap();
        let mut other = small_model();
        load_weights(&mut other, &path).unwrap();
        assert_eq!(other.params(), model.params());
    }
}
