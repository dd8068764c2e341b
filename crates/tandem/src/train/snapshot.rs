//! The snapshot: everything a run needs to continue exactly where it stopped.
//!
//! One safetensors file holds the flat parameter, BN-buffer and optimizer-state buffers as
//! they are in memory, and its metadata holds the progress (epoch, step), the per-epoch
//! history and the settings that must not change on resume. A second metadata entry holds
//! a checksum of everything else in the file: every metadata entry and every tensor's name,
//! dtype, shape and bytes, so that an edit anywhere (an epoch number included) is caught.
//! Writing keeps the previous snapshot as `<name>.prev`, so a snapshot that fails its
//! check on load falls back to the one before it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use tandem_engine::OptimizerState;
use tandem_metrics::{EpochRecord, WorldSizeChange};
use tandem_models::Model;

use crate::files::write_atomically;

/// Metadata key under which the snapshot's JSON description is stored.
pub const METADATA_KEY: &str = "tandem.snapshot";
/// Metadata key under which the checksum of the rest of the file is stored.
const CHECKSUM_KEY: &str = "tandem.checksum";
/// Version of the snapshot layout; bumped when it changes incompatibly. Version 1 had its
/// checksum inside the description and covering the tensors only.
const SNAPSHOT_VERSION: u32 = 2;

/// Where a run stands: the position in the data and the running sums of the epoch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// The epoch in progress, counting from 0.
    pub epoch: u64,
    /// Optimizer steps already taken in this epoch.
    pub step_in_epoch: u64,
    /// Optimizer steps taken in the whole run.
    pub global_step: u64,
    /// Sum of the training losses of this epoch's steps so far.
    pub epoch_loss_sum: f64,
    /// Seconds spent in this epoch before the snapshot was taken.
    pub epoch_seconds: f64,
    /// The job's number of processes (0 in a snapshot that did not record it).
    #[serde(default)]
    pub world_size: usize,
    /// Where per-process batches started on the current number of processes in this epoch.
    #[serde(default)]
    pub epoch_base: EpochBase,
    /// The changes of the number of processes in this epoch so far.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub world_size_changes: Vec<WorldSizeChange>,
}

/// Where the per-process batches of an epoch started on the job's current number of
/// processes: after `step` steps of the epoch, at `samples` of the epoch's order (both 0
/// unless the run resumed on another number of processes within the epoch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochBase {
    /// Steps of the epoch before it.
    pub step: u64,
    /// Samples of the epoch's order visited before it.
    pub samples: u64,
}

/// The JSON description stored in the snapshot's metadata.
#[derive(Debug, Serialize, Deserialize)]
struct Description {
    version: u32,
    progress: Progress,
    history: Vec<EpochRecord>,
    settings: BTreeMap<String, String>,
    num_batches_tracked: u64,
    optimizer_step: u64,
    optimizer_slots: Vec<String>,
}

/// Just the layout version, to name it when a snapshot cannot be read as this version.
#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

/// A snapshot in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Where the run stands.
    pub progress: Progress,
    /// The records of the epochs completed.
    pub history: Vec<EpochRecord>,
    /// The settings that must be the same when the run continues.
    pub settings: BTreeMap<String, String>,
    /// The model's flat parameters.
    pub params: Vec<f32>,
    /// The model's flat BN running statistics.
    pub buffers: Vec<f32>,
    /// The BN layers' `num_batches_tracked`.
    pub num_batches_tracked: u64,
    /// The optimizer's state.
    pub optimizer: OptimizerState,
    /// Further metadata strings: what `eval` and `predict` need to use the weights
    /// (see `checkpoint_info`); outside the checksum, as it decides no numbers.
    pub metadata: BTreeMap<String, String>,
}

impl Snapshot {
    /// Takes a snapshot of a model and optimizer state.
    pub fn capture(
        model: &Model,
        optimizer: OptimizerState,
        progress: Progress,
        history: Vec<EpochRecord>,
        settings: BTreeMap<String, String>,
    ) -> Self {
        Snapshot {
            progress,
            history,
            settings,
            params: model.params().to_vec(),
            buffers: model.buffers().to_vec(),
            num_batches_tracked: model.num_batches_tracked(),
            optimizer,
            metadata: BTreeMap::new(),
        }
    }

    /// The snapshot with `metadata` stored beside its own description.
    pub fn with_metadata(mut self, metadata: BTreeMap<String, String>) -> Self {
        self.metadata = metadata;
        self
    }

    /// Puts the snapshot's weights and BN state into `model`.
    pub fn restore_model(&self, model: &mut Model) -> anyhow::Result<()> {
        if model.params().len() != self.params.len() || model.buffers().len() != self.buffers.len()
        {
            bail!(
                "the snapshot holds {} parameters and {} buffer values, the model has {} and {}",
                self.params.len(),
                self.buffers.len(),
                model.params().len(),
                model.buffers().len()
            );
        }
        model.params_mut().copy_from_slice(&self.params);
        model.buffers_mut().copy_from_slice(&self.buffers);
        model.set_num_batches_tracked(self.num_batches_tracked);
        Ok(())
    }

    /// Writes the snapshot to `path`, keeping the one that was there as `path.prev`.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let bytes = self.to_bytes()?;
        if path.exists() {
            let previous = previous_path(path);
            std::fs::rename(path, &previous).with_context(|| {
                format!("cannot move {} to {}", path.display(), previous.display())
            })?;
        }
        Ok(write_atomically(path, &bytes)?)
    }

    /// Serializes the snapshot as safetensors.
    pub fn to_bytes(&self) -> anyhow::Result<Vec<u8>> {
        let mut named_bytes: Vec<(String, Vec<u8>)> = vec![
            ("params".to_string(), f32_bytes(&self.params)),
            ("buffers".to_string(), f32_bytes(&self.buffers)),
        ];
        for (slot, values) in &self.optimizer.slots {
            named_bytes.push((format!("optimizer.{slot}"), f32_bytes(values)));
        }
        let description = Description {
            version: SNAPSHOT_VERSION,
            progress: self.progress.clone(),
            history: self.history.clone(),
            settings: self.settings.clone(),
            num_batches_tracked: self.num_batches_tracked,
            optimizer_step: self.optimizer.step,
            optimizer_slots: self
                .optimizer
                .slots
                .iter()
                .map(|(slot, _)| slot.clone())
                .collect(),
        };
        let views = named_bytes
            .iter()
            .map(|(name, bytes)| {
                let view = TensorView::new(Dtype::F32, vec![bytes.len() / 4], bytes)?;
                Ok((name.clone(), view))
            })
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
        let mut metadata = self.metadata.clone();
        metadata.insert(
            METADATA_KEY.to_string(),
            serde_json::to_string(&description)?,
        );
        let tensors: Vec<(&str, TensorView)> = views
            .iter()
            .map(|(name, view)| (name.as_str(), view.clone()))
            .collect();
        metadata.insert(CHECKSUM_KEY.to_string(), checksum(&metadata, &tensors));
        Ok(tandem_models::serialize_safetensors(views, &metadata)?)
    }

    /// Reads and checks the snapshot at `path`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read snapshot {}", path.display()))?;
        Self::from_bytes(&bytes).with_context(|| format!("snapshot {} is damaged", path.display()))
    }

    /// Reads and checks a snapshot from its serialized bytes: the checksum over the whole
    /// file first, then the description and tensors it vouches for.
    pub fn from_bytes(bytes: &[u8]) -> anyhow::Result<Self> {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
        let mut metadata: BTreeMap<String, String> = header
            .metadata()
            .as_ref()
            .map(|metadata| metadata.clone().into_iter().collect())
            .unwrap_or_default();
        let description_json = metadata
            .remove(METADATA_KEY)
            .context("it has no tandem.snapshot metadata")?;
        let Some(stored_checksum) = metadata.remove(CHECKSUM_KEY) else {
            match serde_json::from_str::<VersionOnly>(&description_json) {
                Ok(old) if old.version != SNAPSHOT_VERSION => bail!(
                    "it has layout version {}, this tandem reads version {SNAPSHOT_VERSION}",
                    old.version
                ),
                _ => bail!("it has no {CHECKSUM_KEY} metadata"),
            }
        };
        let file = safetensors::SafeTensors::deserialize(bytes)?;
        let tensors: Vec<(String, TensorView)> = file.tensors();
        let tensors: Vec<(&str, TensorView)> = tensors
            .iter()
            .map(|(name, view)| (name.as_str(), view.clone()))
            .collect();
        let mut covered = metadata.clone();
        covered.insert(METADATA_KEY.to_string(), description_json.clone());
        if checksum(&covered, &tensors) != stored_checksum {
            bail!("its checksum does not match its contents (metadata and tensors)");
        }
        let description: Description = serde_json::from_str(&description_json)
            .context("its tandem.snapshot metadata is not valid")?;
        if description.version != SNAPSHOT_VERSION {
            bail!(
                "it has layout version {}, this tandem reads version {SNAPSHOT_VERSION}",
                description.version
            );
        }
        let tensor_values = |name: &str| -> anyhow::Result<Vec<f32>> {
            let view = file
                .tensor(name)
                .with_context(|| format!("it lacks tensor {name}"))?;
            if view.dtype() != Dtype::F32 {
                bail!("tensor {name} is {:?}, expected F32", view.dtype());
            }
            Ok(f32_values(view.data()))
        };
        let params = tensor_values("params")?;
        let buffers = tensor_values("buffers")?;
        let slots = description
            .optimizer_slots
            .iter()
            .map(|slot| Ok((slot.clone(), tensor_values(&format!("optimizer.{slot}"))?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Snapshot {
            progress: description.progress,
            history: description.history,
            settings: description.settings,
            params,
            buffers,
            num_batches_tracked: description.num_batches_tracked,
            optimizer: OptimizerState {
                step: description.optimizer_step,
                slots,
            },
            metadata,
        })
    }
}

/// The name the previous snapshot is kept under.
pub fn previous_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".prev");
    path.with_file_name(name)
}

/// Loads the newest good snapshot: `path`, or else `path.prev`, reporting a damaged one on
/// stderr. `None` when neither exists.
pub fn load_latest(path: &Path) -> anyhow::Result<Option<Snapshot>> {
    let previous = previous_path(path);
    let mut first_error = None;
    for candidate in [path, previous.as_path()] {
        if !candidate.exists() {
            continue;
        }
        match Snapshot::load(candidate) {
            Ok(snapshot) => {
                if let Some(error) = &first_error {
                    tell!(
                        "warning: {}; resuming from {} instead",
                        crate::terminal::printable_line(&format!("{error:#}")),
                        candidate.display()
                    );
                }
                return Ok(Some(snapshot));
            }
            Err(error) => {
                if first_error.is_none() {
                    first_error = Some(error);
                }
            }
        }
    }
    match first_error {
        Some(error) => Err(error.context("no usable snapshot to resume from")),
        None => Ok(None),
    }
}

/// Little-endian bytes of f32 values.
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

/// f32 values from little-endian bytes.
fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .collect()
}

/// FNV-1a (64-bit), as 16 hex digits, over everything in the file but the checksum itself:
/// every metadata entry (key and value, in key order) and every tensor (name, dtype, shape
/// and bytes, in name order). Each field is preceded by its length, so that no two
/// different files feed the hash the same bytes.
fn checksum(metadata: &BTreeMap<String, String>, tensors: &[(&str, TensorView)]) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut feed = |field: &[u8]| {
        for &byte in (field.len() as u64).to_le_bytes().iter().chain(field) {
            hash = (hash ^ byte as u64).wrapping_mul(PRIME);
        }
    };
    let entries = metadata
        .iter()
        .filter(|(key, _)| key.as_str() != CHECKSUM_KEY);
    for (key, value) in entries {
        feed(key.as_bytes());
        feed(value.as_bytes());
    }
    let mut tensors: Vec<&(&str, TensorView)> = tensors.iter().collect();
    tensors.sort_by_key(|(name, _)| *name);
    for (name, view) in tensors {
        feed(name.as_bytes());
        feed(format!("{:?}", view.dtype()).as_bytes());
        let shape: Vec<u8> = view
            .shape()
            .iter()
            .flat_map(|&dim| (dim as u64).to_le_bytes())
            .collect();
        feed(&shape);
        feed(view.data());
    }
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn snapshot() -> Snapshot {
        Snapshot {
            progress: Progress {
                epoch: 4,
                step_in_epoch: 2,
                global_step: 42,
                epoch_loss_sum: 1.5,
                epoch_seconds: 3.0,
                world_size: 2,
                epoch_base: EpochBase {
                    step: 1,
                    samples: 128,
                },
                world_size_changes: vec![WorldSizeChange {
                    step: 41,
                    from: 4,
                    to: 2,
                }],
            },
            history: Vec::new(),
            settings: BTreeMap::from([("lr".to_string(), "0.05".to_string())]),
            params: vec![0.5, -1.25, 3.0],
            buffers: vec![1.0],
            num_batches_tracked: 7,
            optimizer: OptimizerState {
                step: 42,
                slots: vec![("momentum".to_string(), vec![0.1, 0.2, 0.3])],
            },
            metadata: BTreeMap::from([("tandem.model".to_string(), "resnet-base".to_string())]),
        }
    }

    /// `bytes` with the first `from` replaced by `to` (of the same length).
    fn edited(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
        assert_eq!(from.len(), to.len());
        let at = bytes
            .windows(from.len())
            .position(|window| window == from.as_bytes())
            .unwrap_or_else(|| panic!("{from} is not in the snapshot"));
        let mut edited = bytes.to_vec();
        edited[at..at + to.len()].copy_from_slice(to.as_bytes());
        edited
    }

    #[test]
    fn a_snapshot_reads_back_as_written() {
        let original = snapshot();
        let bytes = original.to_bytes().expect("serialize");
        assert_eq!(Snapshot::from_bytes(&bytes).expect("read back"), original);
    }

    #[test]
    fn an_edit_anywhere_in_the_metadata_or_tensors_fails_the_check() {
        let bytes = snapshot().to_bytes().expect("serialize");
        let edits = [
            (r#"\"epoch\":4"#, r#"\"epoch\":6"#),
            (r#"\"lr\":\"0.05\""#, r#"\"lr\":\"0.07\""#),
            (
                r#"\"num_batches_tracked\":7"#,
                r#"\"num_batches_tracked\":9"#,
            ),
            ("resnet-base", "resnet-bas3"),
        ];
        for (from, to) in edits {
            let error = Snapshot::from_bytes(&edited(&bytes, from, to))
                .expect_err(&format!("editing {from} to {to} went unnoticed"));
            assert!(
                error.to_string().contains("checksum does not match"),
                "{error:#}"
            );
        }
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        let error = Snapshot::from_bytes(&flipped).expect_err("a flipped tensor byte");
        assert!(error.to_string().contains("checksum does not match"));
    }

    #[test]
    fn a_snapshot_of_the_previous_layout_is_refused_naming_its_version() {
        let description = r#"{"version":1,"checksum":"0"}"#;
        let bytes = safetensors::serialize(
            Vec::<(String, TensorView)>::new(),
            Some(HashMap::from([(
                METADATA_KEY.to_string(),
                description.to_string(),
            )])),
        )
        .expect("serialize");
        let error = Snapshot::from_bytes(&bytes).expect_err("version 1");
        assert_eq!(
            error.to_string(),
            "it has layout version 1, this tandem reads version 2"
        );
    }
}
