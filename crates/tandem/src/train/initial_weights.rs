//! `--init-from`: the weights a run starts from. Besides the weights files `eval` reads, a
//! Tandem snapshot works too: its weights and BN statistics are taken, its optimizer state
//! and progress are not, so a run can go on from another run's snapshot with settings of
//! its own.

use std::io::Read;
use std::path::Path;

use anyhow::Context;
use tandem_models::Model;

use crate::train::snapshot::{Snapshot, METADATA_KEY};

/// The longest safetensors header read to tell a snapshot from a weights file.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Loads the starting weights from `path` into `model`.
pub fn load_initial_weights(model: &mut Model, path: &Path) -> anyhow::Result<()> {
    if is_snapshot(path)? {
        Snapshot::load(path)?
            .restore_model(model)
            .with_context(|| format!("cannot start from the weights of {}", path.display()))
    } else {
        crate::weights::load_weights(model, path)
    }
}

/// Whether `path` is a safetensors file whose metadata marks a Tandem snapshot; reads only
/// the header.
fn is_snapshot(path: &Path) -> anyhow::Result<bool> {
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open weights file {}", path.display()))?;
    let mut length = [0u8; 8];
    if file.read_exact(&mut length).is_err() {
        return Ok(false);
    }
    let length = u64::from_le_bytes(length);
    if length > MAX_HEADER_BYTES {
        return Ok(false);
    }
    let mut header = Vec::new();
    file.take(length)
        .read_to_end(&mut header)
        .with_context(|| format!("cannot read weights file {}", path.display()))?;
    let Ok(header) = serde_json::from_slice::<serde_json::Value>(&header) else {
        return Ok(false);
    };
    Ok(header
        .get("__metadata__")
        .and_then(|metadata| metadata.get(METADATA_KEY))
        .is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::snapshot::Progress;
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
        load_initial_weights(&mut fresh, &path).unwrap();
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
        assert!(!is_snapshot(&path).unwrap());
        let mut other = small_model();
        load_initial_weights(&mut other, &path).unwrap();
        assert_eq!(other.params(), model.params());
    }
}
