//! What a checkpoint says about itself: the model, the classes, the normalization, the data
//! and the epoch it came from, stored as strings in the safetensors `__metadata__` of every
//! `epoch_N.safetensors` and snapshot, so that `eval` and `predict` need no flags.
//!
//! The keys repeat `train`'s flag names under a `tandem.` prefix (`tandem.n-blocks` =
//! `6,6,6`), so a person reading `safe_open(...).metadata()` sees the command that made it.
//! The tensors keep their PyTorch `state_dict` names; PyTorch ignores the metadata.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use tandem_metrics::EpochRecord;
use tandem_models::ModelSpec;

use crate::model_args::{value_name, ModelArgs, ModelKind};
use crate::settings::{DataKind, Rgb, TrainSettings};
use crate::terminal::printable;

/// The key whose presence marks a file as carrying Tandem's description.
const MODEL_KEY: &str = "tandem.model";

/// Per-channel (mean, std) of the normalization after scaling pixels to [0, 1].
pub type Normalization = (Rgb, Rgb);

/// Everything needed to use a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointInfo {
    /// The Tandem version that wrote the file.
    pub tandem_version: String,
    /// The model, with every setting of its kind filled in.
    pub model: ModelArgs,
    /// A name per class of the training data, in label order.
    pub class_names: Vec<String>,
    /// The per-channel (mean, std) the training images were normalized with, if any.
    pub normalization: Option<Normalization>,
    /// Where the training images came from.
    pub data: DataInfo,
    /// The epoch (from 1) whose end the weights are, with its metrics; `None` for a
    /// snapshot taken inside an epoch.
    pub epoch: Option<EpochMetrics>,
    /// Optimizer steps taken to reach these weights.
    pub step: u64,
}

/// What an epoch measured, less the timings: a run resumed from a snapshot writes
/// checkpoints byte for byte the same as the uninterrupted run's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// The epoch, counting from 1.
    pub epoch: u64,
    /// Mean training loss over the epoch's steps.
    pub train_loss: f64,
    /// Mean cross-entropy on the test split.
    pub val_loss: f64,
    /// Accuracy on the test split.
    pub val_accuracy: f64,
    /// Learning rate of the epoch's last step.
    pub lr: f64,
    /// Optimizer steps in the epoch.
    pub steps: u64,
}

impl From<&EpochRecord> for EpochMetrics {
    fn from(record: &EpochRecord) -> Self {
        EpochMetrics {
            epoch: record.epoch,
            train_loss: record.train_loss,
            val_loss: record.val_loss,
            val_accuracy: record.val_accuracy,
            lr: record.lr,
            steps: record.steps,
        }
    }
}

/// Where the training images came from.
#[derive(Clone, Debug, PartialEq)]
pub struct DataInfo {
    /// The data source.
    pub kind: DataKind,
    /// The folder as given to `train` (relative to the folder it ran in).
    pub data_dir: PathBuf,
    /// The synthetic set's train size, test size and seed, which decide its images.
    pub synthetic: Option<(usize, usize, u64)>,
}

impl CheckpointInfo {
    /// The description of a run's weights after `step` steps, at the end of `epoch` if given.
    pub fn of_run(
        settings: &TrainSettings,
        model: &ModelArgs,
        class_names: &[String],
        epoch: Option<&EpochRecord>,
        step: u64,
    ) -> Self {
        let data = &settings.data;
        CheckpointInfo {
            tandem_version: env!("CARGO_PKG_VERSION").to_string(),
            model: model.clone(),
            class_names: class_names.to_vec(),
            normalization: data.mean.zip(data.std),
            data: DataInfo {
                kind: data.data,
                data_dir: data.data_dir.clone(),
                synthetic: (data.data == DataKind::Synthetic).then_some((
                    data.synthetic_train,
                    data.synthetic_test,
                    settings.seed,
                )),
            },
            epoch: epoch.map(EpochMetrics::from),
            step,
        }
    }

    /// The description as safetensors metadata strings.
    pub fn to_metadata(&self) -> anyhow::Result<BTreeMap<String, String>> {
        let mut metadata = BTreeMap::new();
        let mut put = |key: &str, value: String| {
            metadata.insert(key.to_string(), value);
        };
        // What `safetensors.torch.save_file` writes; some PyTorch tools look for it.
        put("format", "pt".into());
        put("tandem.version", self.tandem_version.clone());
        for (flag, value) in self.model.flag_values() {
            put(&format!("tandem.{flag}"), value);
        }
        put(
            "tandem.class-names",
            serde_json::to_string(&self.class_names)?,
        );
        if let Some((mean, std)) = &self.normalization {
            put("tandem.mean", rgb_text(mean));
            put("tandem.std", rgb_text(std));
        }
        put("tandem.data", value_name(&self.data.kind));
        put(
            "tandem.data-dir",
            self.data.data_dir.to_string_lossy().into_owned(),
        );
        if let Some((train, test, seed)) = self.data.synthetic {
            put("tandem.synthetic-train", train.to_string());
            put("tandem.synthetic-test", test.to_string());
            put("tandem.seed", seed.to_string());
        }
        if let Some(record) = &self.epoch {
            put("epoch", record.epoch.to_string());
            put("tandem.metrics", serde_json::to_string(record)?);
        }
        put("tandem.step", self.step.to_string());
        Ok(metadata)
    }

    /// Reads the description back; `None` when the file carries none (PyTorch's files,
    /// Tandem's older ones). A damaged entry is an error naming its key.
    pub fn from_metadata(metadata: &BTreeMap<String, String>) -> anyhow::Result<Option<Self>> {
        if !metadata.contains_key(MODEL_KEY) {
            return Ok(None);
        }
        let entries = Entries(metadata);
        let model = ModelArgs {
            model: Some(entries.parse_with(MODEL_KEY, |text| ModelKind::from_str(text, false))?),
            n_blocks: entries.optional("tandem.n-blocks", parse_list)?,
            n_channels: entries.optional("tandem.n-channels", parse_list)?,
            bottlenecks: entries.optional("tandem.bottlenecks", as_text)?,
            first_kernel_size: entries.optional("tandem.first-kernel-size", parse_number)?,
            num_classes: Some(entries.parse_with("tandem.num-classes", parse_number)?),
        };
        model.to_spec().with_context(|| {
            format!(
                "the model in its metadata ({}) is not valid",
                model.to_flags()
            )
        })?;
        let mean = entries.optional("tandem.mean", Rgb::from_str)?;
        let std = entries.optional("tandem.std", Rgb::from_str)?;
        let synthetic = match entries.get("tandem.synthetic-train") {
            None => None,
            Some(_) => Some((
                entries.parse_with("tandem.synthetic-train", parse_number)?,
                entries.parse_with("tandem.synthetic-test", parse_number)?,
                entries.parse_with("tandem.seed", parse_number)?,
            )),
        };
        let epoch = entries.optional("tandem.metrics", |text| {
            serde_json::from_str::<EpochMetrics>(text).map_err(|error| error.to_string())
        })?;
        Ok(Some(CheckpointInfo {
            tandem_version: entries.parse_with("tandem.version", as_text)?,
            model,
            class_names: entries.parse_with("tandem.class-names", |text| {
                serde_json::from_str(text).map_err(|error| error.to_string())
            })?,
            normalization: mean.zip(std),
            data: DataInfo {
                kind: entries.parse_with("tandem.data", |text| DataKind::from_str(text, false))?,
                data_dir: PathBuf::from(entries.parse_with("tandem.data-dir", as_text)?),
                synthetic,
            },
            epoch,
            step: entries.parse_with("tandem.step", parse_number)?,
        }))
    }
}

/// The model to build for a checkpoint: the one it describes, else the flags'. A flag that
/// contradicts the description is an error naming it, as the weights would not fit.
pub fn model_for(
    flags: &ModelArgs,
    info: Option<&CheckpointInfo>,
    path: &Path,
) -> anyhow::Result<ModelSpec> {
    let Some(info) = info else {
        return flags.to_spec();
    };
    let contradictions = flags.contradictions(&info.model);
    if !contradictions.is_empty() {
        bail!(
            "{} contradicts {}, which holds the model `{}` (from its metadata); \
             leave the model flags out to use the checkpoint's",
            contradictions.join(" "),
            path.display(),
            info.model.to_flags()
        );
    }
    info.model.to_spec()
}

/// The normalization to use: the flags', else the one the checkpoint was trained with.
/// Flags that differ from the checkpoint's come with a warning naming both.
pub fn normalization_for(
    mean: Option<Rgb>,
    std: Option<Rgb>,
    info: Option<&CheckpointInfo>,
) -> anyhow::Result<(Option<Normalization>, Option<String>)> {
    if mean.is_some() != std.is_some() {
        bail!("--mean and --std must be given together");
    }
    let Some(info) = info else {
        return Ok((mean.zip(std), None));
    };
    let Some(given) = mean.zip(std) else {
        return Ok((info.normalization, None));
    };
    let warning = (info.normalization != Some(given)).then(|| {
        let trained = match &info.normalization {
            Some(normalization) => normalization_flags(normalization),
            None => "no normalization".into(),
        };
        format!(
            "{} differ from what the checkpoint was trained with ({trained}); using the flags' values",
            normalization_flags(&given)
        )
    });
    Ok((Some(given), warning))
}

/// `--mean R,G,B --std R,G,B`.
fn normalization_flags((mean, std): &Normalization) -> String {
    format!("--mean {} --std {}", rgb_text(mean), rgb_text(std))
}

/// The name of class `class` as printed (escaped and bounded, see [`printable`]: names come
/// from data and checkpoint files), or its number when there are fewer names.
pub fn class_name(class_names: &[String], class: usize) -> String {
    class_names
        .get(class)
        .map(|name| printable(name))
        .unwrap_or_else(|| class.to_string())
}

/// The metadata entries, read with errors that name the key.
struct Entries<'a>(&'a BTreeMap<String, String>);

impl Entries<'_> {
    fn get(&self, key: &str) -> Option<&String> {
        self.0.get(key)
    }

    /// The entry `key`, which must be present, parsed with `parse`.
    fn parse_with<T, E: std::fmt::Display>(
        &self,
        key: &str,
        parse: impl Fn(&str) -> Result<T, E>,
    ) -> anyhow::Result<T> {
        match self.0.get(key) {
            None => bail!("its metadata has {MODEL_KEY} but lacks {key}"),
            Some(text) => parse(text).map_err(|error| {
                anyhow::anyhow!(
                    "its metadata {key} = '{}' is not valid: {}",
                    printable(text),
                    printable(&error.to_string())
                )
            }),
        }
    }

    /// The entry `key` parsed with `parse`, or `None` when absent.
    fn optional<T, E: std::fmt::Display>(
        &self,
        key: &str,
        parse: impl Fn(&str) -> Result<T, E>,
    ) -> anyhow::Result<Option<T>> {
        match self.0.contains_key(key) {
            true => self.parse_with(key, parse).map(Some),
            false => Ok(None),
        }
    }
}

/// `0.485,0.456,0.406`, each value written so that it reads back exactly.
pub fn rgb_text(rgb: &Rgb) -> String {
    let [r, g, b] = rgb.0;
    format!("{r},{g},{b}")
}

fn as_text(text: &str) -> Result<String, String> {
    Ok(text.to_string())
}

fn parse_number<T: FromStr>(text: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .map_err(|_| "expected a whole number".to_string())
}

fn parse_list(text: &str) -> Result<Vec<usize>, String> {
    text.split(',').map(parse_number).collect()
}

pub use tandem_files::{checkpoint_epoch, checkpoint_name};

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointInfo {
        CheckpointInfo {
            tandem_version: "0.1.0".into(),
            model: ModelArgs {
                model: Some(ModelKind::ResnetBase),
                n_blocks: Some(vec![1, 2]),
                n_channels: Some(vec![8, 16]),
                bottlenecks: Some("none".into()),
                first_kernel_size: Some(5),
                num_classes: Some(3),
            },
            class_names: vec!["cat, black".into(), "dog".into(), "\"bird\"".into()],
            normalization: Some((Rgb([0.485, 0.456, 0.1]), Rgb([0.229, 1e-3, 3.0]))),
            data: DataInfo {
                kind: DataKind::Cifar10Bin,
                data_dir: PathBuf::from("../shared/data/cifar10"),
                synthetic: None,
            },
            epoch: Some(EpochMetrics {
                epoch: 3,
                train_loss: 1.25,
                val_loss: 0.3,
                val_accuracy: 0.4125,
                lr: 0.1,
                steps: 40,
            }),
            step: 120,
        }
    }

    #[test]
    fn metadata_reads_back_exactly() {
        let info = sample();
        let metadata = info.to_metadata().unwrap();
        let expected = [
            ("tandem.model", "resnet-base"),
            ("tandem.n-blocks", "1,2"),
            ("tandem.bottlenecks", "none"),
            ("tandem.mean", "0.485,0.456,0.1"),
            ("tandem.std", "0.229,0.001,3"),
            ("tandem.data", "cifar10-bin"),
            ("epoch", "3"),
            ("format", "pt"),
        ];
        for (key, value) in expected {
            assert_eq!(metadata[key], value, "{key}");
        }
        assert_eq!(
            CheckpointInfo::from_metadata(&metadata).unwrap(),
            Some(info)
        );

        let mut synthetic = sample();
        synthetic.model =
            ModelArgs::from_spec(&tandem_models::ModelSpec::ResNet18 { num_classes: 10 });
        synthetic.normalization = None;
        synthetic.data = DataInfo {
            kind: DataKind::Synthetic,
            data_dir: PathBuf::from("data"),
            synthetic: Some((192, 64, 7)),
        };
        synthetic.epoch = None;
        let metadata = synthetic.to_metadata().unwrap();
        assert!(!metadata.contains_key("tandem.n-blocks"));
        assert_eq!(metadata["tandem.seed"], "7");
        assert_eq!(
            CheckpointInfo::from_metadata(&metadata).unwrap(),
            Some(synthetic)
        );
    }

    #[test]
    fn missing_or_damaged_metadata() {
        let plain = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        assert_eq!(CheckpointInfo::from_metadata(&plain).unwrap(), None);
        let mut metadata = sample().to_metadata().unwrap();
        metadata.insert("tandem.n-blocks".into(), "1,x".into());
        let error = CheckpointInfo::from_metadata(&metadata).unwrap_err();
        assert_eq!(
            error.to_string(),
            "its metadata tandem.n-blocks = '1,x' is not valid: expected a whole number"
        );
        let mut metadata = sample().to_metadata().unwrap();
        metadata.remove("tandem.data");
        let error = CheckpointInfo::from_metadata(&metadata).unwrap_err();
        assert_eq!(
            error.to_string(),
            "its metadata has tandem.model but lacks tandem.data"
        );
    }
}
