//! The snapshot: everything a run needs to continue exactly where it stopped.
//!
//! One safetensors file holds the flat parameter, BN-buffer and optimizer-state buffers as
//! they are in memory, and its metadata holds the progress (epoch, step), the per-epoch
//! history, the settings that must not change on resume, and a checksum of all of it.
//! Writing keeps the previous snapshot as `<name>.prev`, so a snapshot that fails its
//! check on load falls back to the one before it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use tandem_engine::OptimizerState;
use tandem_models::Model;

use crate::files::write_atomically;
use crate::train::history::EpochRecord;

/// Metadata key under which the snapshot's JSON description is stored.
pub const METADATA_KEY: &str = "tandem.snapshot";
/// Version of the snapshot layout; bumped when it changes incompatibly.
const SNAPSHOT_VERSION: u32 = 1;

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
    checksum: String,
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
        write_atomically(path, &bytes)
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
            checksum: checksum(&named_bytes),
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
        Ok(tandem_models::serialize_safetensors(views, &metadata)?)
    }

    /// Reads and checks the snapshot at `path`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read snapshot {}", path.display()))?;
        Self::from_bytes(&bytes).with_context(|| format!("snapshot {} is damaged", path.display()))
    }

    /// Reads and checks a snapshot from its serialized bytes.
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
        let description: Description = serde_json::from_str(&description_json)
            .context("its tandem.snapshot metadata is not valid")?;
        if description.version != SNAPSHOT_VERSION {
            bail!(
                "it has layout version {}, this tandem reads version {SNAPSHOT_VERSION}",
                description.version
            );
        }
        let tensors = safetensors::SafeTensors::deserialize(bytes)?;
        let tensor_bytes = |name: &str| -> anyhow::Result<Vec<u8>> {
            let view = tensors
                .tensor(name)
                .with_context(|| format!("it lacks tensor {name}"))?;
            if view.dtype() != Dtype::F32 {
                bail!("tensor {name} is {:?}, expected F32", view.dtype());
            }
            Ok(view.data().to_vec())
        };
        let mut named_bytes = vec![
            ("params".to_string(), tensor_bytes("params")?),
            ("buffers".to_string(), tensor_bytes("buffers")?),
        ];
        for slot in &description.optimizer_slots {
            let name = format!("optimizer.{slot}");
            named_bytes.push((name.clone(), tensor_bytes(&name)?));
        }
        if checksum(&named_bytes) != description.checksum {
            bail!("its checksum does not match its contents");
        }
        let mut values = named_bytes.into_iter().map(|(_, bytes)| f32_values(&bytes));
        let params = values.next().unwrap_or_default();
        let buffers = values.next().unwrap_or_default();
        let slots = description
            .optimizer_slots
            .iter()
            .cloned()
            .zip(values)
            .collect();
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
                    eprintln!(
                        "warning: {error:#}; resuming from {} instead",
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

/// FNV-1a (64-bit) over the names and bytes of the tensors, as 16 hex digits.
fn checksum(named_bytes: &[(String, Vec<u8>)]) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for (name, bytes) in named_bytes {
        for &byte in name.as_bytes().iter().chain(bytes) {
            hash = (hash ^ byte as u64).wrapping_mul(PRIME);
        }
    }
    format!("{hash:016x}")
}
