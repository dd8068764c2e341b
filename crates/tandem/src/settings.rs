//! The settings of a training run: command-line flags, an optional TOML file, and the
//! resolved values the run uses.
//!
//! Every setting of `tandem train` is an `Option` in [`TrainOptions`], so that a flag given
//! on the command line overrides the same key in `--config FILE`, which overrides the
//! default. [`TrainOptions::resolve`] turns the merged options into [`TrainSettings`], the
//! plain values the trainer reads and writes to `OUT/config.toml`.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::model_args::ModelArgs;
use crate::train::schedule::ScheduleKind;

/// Three per-channel values (R, G, B), written `0.485,0.456,0.406` on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct Rgb(pub [f32; 3]);

impl Serialize for Rgb {
    /// Each value as the shortest decimal that reads back as the same `f32`, so that
    /// `config.toml` holds `0.485` as the user wrote it (TOML has only 64-bit floats, and
    /// the `f32` widened would read `0.48500001430511475`).
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let values = self
            .0
            .map(|value| value.to_string().parse::<f64>().unwrap_or(f64::from(value)));
        values.serialize(serializer)
    }
}

impl FromStr for Rgb {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let values: Vec<f32> = text
            .split(',')
            .map(|part| part.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("expected three numbers like 0.5,0.5,0.5, got '{text}'"))?;
        match values.as_slice() {
            [r, g, b] => Ok(Rgb([*r, *g, *b])),
            _ => Err(format!(
                "expected three numbers like 0.5,0.5,0.5, got '{text}'"
            )),
        }
    }
}

/// Where the images come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DataKind {
    /// CIFAR-10 in its official binary layout (folder or `.tar.gz`).
    Cifar10Bin,
    /// CIFAR-10 in its python-pickle layout.
    Cifar10Py,
    /// Annotation JSON plus an image folder (the torchrun tutorial's `CIFAR10_IMG`).
    JsonFolder,
    /// Random standard-normal images with labels 0 and 1 (seed 000's "custom data").
    Synthetic,
}

/// The optimizers `tandem train` offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Stochastic gradient descent, optionally with (Nesterov) momentum.
    Sgd,
    /// Adam with L2 weight decay.
    Adam,
    /// Adam with decoupled weight decay.
    Adamw,
}

/// The data flags shared by `train` and `eval`.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DataOptions {
    /// Data source [default: synthetic].
    #[arg(long, value_enum)]
    pub data: Option<DataKind>,
    /// Folder holding the data set, or an object-storage prefix (s3://BUCKET/PREFIX,
    /// obs://BUCKET/PREFIX) fetched once into --cache-dir [default: data].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Download CIFAR-10 into --data-dir when it is missing (with --data cifar10-bin).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub download: bool,
    /// Per-channel mean subtracted after scaling pixels to [0,1] [default: none].
    #[arg(long)]
    pub mean: Option<Rgb>,
    /// Per-channel standard deviation divided by after the mean [default: none].
    #[arg(long)]
    pub std: Option<Rgb>,
    /// Training images of the synthetic data set [default: 5000].
    #[arg(long)]
    pub synthetic_train: Option<usize>,
    /// Test images of the synthetic data set [default: 1000].
    #[arg(long)]
    pub synthetic_test: Option<usize>,
}

/// The resolved data settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DataSettings {
    /// The data source.
    pub data: DataKind,
    /// The folder holding it.
    pub data_dir: PathBuf,
    /// Whether to download CIFAR-10 when it is missing.
    pub download: bool,
    /// Per-channel mean, if normalizing.
    pub mean: Option<Rgb>,
    /// Per-channel standard deviation, if normalizing.
    pub std: Option<Rgb>,
    /// Training images of the synthetic data set.
    pub synthetic_train: usize,
    /// Test images of the synthetic data set.
    pub synthetic_test: usize,
}

impl DataOptions {
    /// Fills in defaults and checks the values; errors name the flag.
    pub fn resolve(&self) -> anyhow::Result<DataSettings> {
        let settings = DataSettings {
            data: self.data.unwrap_or(DataKind::Synthetic),
            data_dir: self
                .data_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("data")),
            download: self.download,
            mean: self.mean,
            std: self.std,
            synthetic_train: self.synthetic_train.unwrap_or(5000),
            synthetic_test: self.synthetic_test.unwrap_or(1000),
        };
        if settings.mean.is_some() != settings.std.is_some() {
            bail!("--mean and --std must be given together");
        }
        if let Some(Rgb(std)) = settings.std {
            if std.iter().any(|value| *value <= 0.0) {
                bail!("--std values must be positive, got {std:?}");
            }
        }
        Ok(settings)
    }
}

/// The headings that group the flags in `tandem train --help`.
pub mod heading {
    /// The model and the weights it starts from.
    pub const MODEL: &str = "Model";
    /// The images and how they are prepared.
    pub const DATA: &str = "Data";
    /// The optimizer and the loss.
    pub const OPTIMIZATION: &str = "Optimization";
    /// How long to train and the learning rate over time.
    pub const SCHEDULE: &str = "Schedule";
    /// What the run writes, and where.
    pub const OUTPUTS: &str = "Outputs";
    /// A job of several processes.
    pub const DATA_PARALLELISM: &str = "Data parallelism";
    /// Where and how this process computes.
    pub const DEVICES: &str = "Devices";
    /// s3:// and obs:// paths.
    pub const OBJECT_STORAGE: &str = "Object storage";
}

/// Every setting of `tandem train`, each optional so that flags, file and defaults merge. A
/// switch is a `bool`: given, it is true and overrides the file; absent, the file decides.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TrainOptions {
    /// Read settings from this TOML file; flags given on the command line override it.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    #[command(flatten, next_help_heading = heading::MODEL)]
    #[serde(default)]
    pub model: ModelArgs,
    /// Load initial weights from a safetensors or PyTorch (`torch.save`) file, a path or an
    /// s3:// or obs:// URL.
    #[arg(long, help_heading = heading::MODEL)]
    pub init_from: Option<PathBuf>,
    #[command(flatten, next_help_heading = heading::DATA)]
    #[serde(default)]
    pub data: DataOptions,
    /// Turn off the pad-4 random crop and horizontal flip of training images.
    #[arg(long, help_heading = heading::DATA)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_augment: bool,
    /// Images per optimizer step on each process [default: 128]; with
    /// --global-batch-size, the images of one micro-batch (a logical shard).
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub batch_size: Option<usize>,
    /// Images per optimizer step for the whole job, whatever its number of processes: each
    /// step's images form --global-batch-size / --batch-size logical shards, shared out
    /// among the processes, and every step ends with the same bits on 1 process or as many
    /// as there are shards; a snapshot resumes on any of those numbers.
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub global_batch_size: Option<usize>,
    /// Base learning rate [default: 0.01].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub lr: Option<f64>,
    /// Multiply the learning rate by the number of processes (the tutorials' rule).
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub scale_lr: bool,
    /// Optimizer [default: adam].
    #[arg(long, value_enum, help_heading = heading::OPTIMIZATION)]
    pub optimizer: Option<OptimizerKind>,
    /// SGD momentum [default: 0].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub momentum: Option<f64>,
    /// Use Nesterov momentum with SGD.
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nesterov: bool,
    /// Weight decay (L2 for sgd and adam, decoupled for adamw) [default: 0].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub weight_decay: Option<f64>,
    /// Adam's beta1 [default: 0.9].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub beta1: Option<f64>,
    /// Adam's beta2 [default: 0.999].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub beta2: Option<f64>,
    /// Adam's epsilon [default: 1e-8].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub eps: Option<f64>,
    /// Label smoothing of the cross-entropy loss [default: 0].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub label_smoothing: Option<f64>,
    /// Accumulate gradients over K batches per optimizer step [default: 1].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub grad_accum: Option<u64>,
    /// Seed of initialization, data order and augmentation [default: 0].
    #[arg(long, help_heading = heading::OPTIMIZATION)]
    pub seed: Option<u64>,
    /// Epochs to train [default: 10].
    #[arg(long, help_heading = heading::SCHEDULE)]
    pub epochs: Option<u64>,
    /// Stop after this many optimizer steps in total (for tests and quick looks).
    #[arg(long, help_heading = heading::SCHEDULE)]
    pub max_steps: Option<u64>,
    /// Learning-rate schedule [default: constant].
    #[arg(long, value_enum, help_heading = heading::SCHEDULE)]
    pub lr_schedule: Option<ScheduleKind>,
    /// Epochs of linear learning-rate warm-up [default: 0].
    #[arg(long, help_heading = heading::SCHEDULE)]
    pub warmup_epochs: Option<f64>,
    /// With --lr-schedule step: epochs between decays [default: 30].
    #[arg(long, help_heading = heading::SCHEDULE)]
    pub step_epochs: Option<u64>,
    /// With --lr-schedule step: the decay factor [default: 0.1].
    #[arg(long, help_heading = heading::SCHEDULE)]
    pub gamma: Option<f64>,
    /// Folder for checkpoints, metrics, plots and logs, or an object-storage prefix
    /// (s3://BUCKET/PREFIX, obs://BUCKET/PREFIX) they are uploaded to [default: runs/latest].
    #[arg(long, help_heading = heading::OUTPUTS)]
    pub output_dir: Option<PathBuf>,
    /// Start over: move the files of the run in the output folder aside, into
    /// `OUTPUT_DIR/previous-<time>/`, instead of resuming it.
    #[arg(long, help_heading = heading::OUTPUTS)]
    #[serde(skip)]
    pub fresh: bool,
    /// Write `epoch_N.safetensors` every N epochs; 0 never [default: 1].
    #[arg(long, help_heading = heading::OUTPUTS)]
    pub save_every: Option<u64>,
    /// Keep only the last K epoch checkpoints; 0 keeps all [default: 0].
    #[arg(long, help_heading = heading::OUTPUTS)]
    pub keep_last: Option<usize>,
    /// The snapshot to resume from and to write, a path or an s3:// or obs:// URL; a
    /// relative path is inside the output folder [default: snapshot.safetensors].
    #[arg(long, help_heading = heading::OUTPUTS)]
    pub snapshot: Option<PathBuf>,
    /// Also write a snapshot every N optimizer steps within an epoch; 0 only at epoch ends
    /// and on a stop request [default: 0].
    #[arg(long, help_heading = heading::OUTPUTS)]
    pub snapshot_every_steps: Option<u64>,
    /// Write the training loss, learning rate and images per second to the TensorBoard event
    /// file every N optimizer steps; 0 only per epoch [default: 10].
    #[arg(long, help_heading = heading::OUTPUTS)]
    pub log_every_steps: Option<u64>,
    /// The tutorial's rendezvous address, `tcp://HOST:PORT` (else MASTER_ADDR/MASTER_PORT).
    #[arg(long, help_heading = heading::DATA_PARALLELISM)]
    #[serde(skip)]
    pub init_method: Option<String>,
    /// This process's rank (else RANK or the cluster's variables).
    #[arg(long, help_heading = heading::DATA_PARALLELISM)]
    #[serde(skip)]
    pub rank: Option<usize>,
    /// The number of processes (else WORLD_SIZE or the cluster's variables).
    #[arg(long, help_heading = heading::DATA_PARALLELISM)]
    #[serde(skip)]
    pub world_size: Option<usize>,
    /// What carries the gradients in a job of several processes: auto (nccl when every rank
    /// has its own GPU and NCCL loads, else ring), nccl or ring [default: auto].
    #[arg(long, value_enum, help_heading = heading::DATA_PARALLELISM)]
    #[serde(skip)]
    pub backend: Option<crate::backend::BackendRequest>,
    /// Normalize with the statistics of the global batch over all processes (SyncBatchNorm);
    /// with --global-batch-size, over all of a step's shards, with the same bits on any
    /// number of processes (on the CPU only for now).
    #[arg(long, help_heading = heading::DATA_PARALLELISM)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sync_bn: bool,
    /// Size of a gradient bucket for the all-reduce, in MB [default: 25].
    #[arg(long, help_heading = heading::DATA_PARALLELISM)]
    pub bucket_mb: Option<f64>,
    /// Timeout of each collective and of the rendezvous, in seconds [default: 300].
    #[arg(long, help_heading = heading::DATA_PARALLELISM)]
    pub collective_timeout: Option<f64>,
    #[arg(long, help = crate::device::DEVICE_HELP, help_heading = heading::DEVICES)]
    #[serde(skip)]
    pub device: Option<tandem_cuda::DeviceRequest>,
    #[arg(long, value_enum, help = crate::math::PRECISION_HELP, help_heading = heading::DEVICES)]
    #[serde(skip)]
    pub precision: Option<crate::math::PrecisionRequest>,
    #[arg(long, value_enum, help = crate::math::ALGORITHMS_HELP, help_heading = heading::DEVICES)]
    #[serde(skip)]
    pub algorithms: Option<crate::math::Algorithms>,
    /// Compute threads of this process [default: the cores available, shared among the
    /// processes of this node].
    #[arg(long, help_heading = heading::DEVICES)]
    pub threads: Option<usize>,
    /// Data-loader threads [default: 1].
    #[arg(long, help_heading = heading::DEVICES)]
    pub loader_threads: Option<usize>,
    #[command(flatten, next_help_heading = heading::OBJECT_STORAGE)]
    #[serde(default)]
    pub storage: StorageOptions,
}

impl TrainOptions {
    /// The options a TOML file gives (the flags' names; those of the model, the data and
    /// object storage in `[model]`, `[data]` and `[storage]` tables). A key of a table
    /// written outside it is refused with the table it belongs in.
    pub fn from_toml(text: &str) -> anyhow::Result<TrainOptions> {
        let table: toml::Table = toml::from_str(text)?;
        check_tables(&table)?;
        Ok(toml::from_str(text)?)
    }

    /// Merges `self` (flags) over the options of a TOML file: a flag wins over the file.
    pub fn merged_with_file(self) -> anyhow::Result<TrainOptions> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        let file = TrainOptions::from_toml(&text)
            .with_context(|| format!("config file {} is not valid", path.display()))?;
        let config = self.config.clone();
        let mut merged = toml::Table::try_from(&file).context("cannot merge the config file")?;
        merge_tables(
            &mut merged,
            toml::Table::try_from(&self).context("cannot merge the flags")?,
        );
        let mut options: TrainOptions = merged.try_into().context("cannot merge the flags")?;
        options.config = config;
        Ok(options)
    }
}

/// The tables of a config file, each with the keys (the flags' names) it holds.
fn config_tables() -> [(&'static str, Vec<String>); 3] {
    [
        ("model", flag_names::<ModelArgs>()),
        ("data", flag_names::<DataOptions>()),
        ("storage", flag_names::<StorageOptions>()),
    ]
}

/// The long names of the flags of `A`, without `--`.
fn flag_names<A: Args>() -> Vec<String> {
    A::augment_args(clap::Command::new("flags"))
        .get_arguments()
        .filter_map(|arg| arg.get_long())
        .map(str::to_string)
        .collect()
}

/// Refuses a key of `[model]`, `[data]` or `[storage]` written outside its table (`data =
/// "synthetic"` at the top, where `data` would be the `[data]` table itself), showing the
/// table that holds it.
fn check_tables(file: &toml::Table) -> anyhow::Result<()> {
    for (table, keys) in config_tables() {
        let misplaced: toml::Table = file
            .iter()
            .filter(|(key, value)| {
                let names_the_table = key.as_str() == table && !value.is_table();
                names_the_table || (keys.contains(key) && key.as_str() != table)
            })
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        if misplaced.is_empty() {
            continue;
        }
        let written: Vec<String> = misplaced
            .iter()
            .map(|(key, value)| format!("`{key} = {value}`"))
            .collect();
        let (is, them) = match written.len() {
            1 => ("is a setting", "it"),
            _ => ("are settings", "them"),
        };
        let mut moved = toml::Table::new();
        moved.insert(table.to_string(), toml::Value::Table(misplaced));
        let moved = toml::to_string(&moved).context("cannot render the table")?;
        bail!(
            "{} {is} of the [{table}] table; write {them} there:\n{}",
            written.join(", "),
            moved.trim_end()
        );
    }
    Ok(())
}

/// Sets every key of `overrides` in `base`, descending into tables (`[model]`, `[data]`)
/// so that a flag replaces only its own key.
fn merge_tables(base: &mut toml::Table, overrides: toml::Table) {
    for (key, value) in overrides {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(base_table)), toml::Value::Table(override_table)) => {
                merge_tables(base_table, override_table)
            }
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// The snapshot's file name in the output folder, unless `--snapshot` names another.
pub const DEFAULT_SNAPSHOT_NAME: &str = "snapshot.safetensors";

/// The resolved settings of a training run, written to `OUT/config.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct TrainSettings {
    /// The model's description, as `--model` and its flags give it.
    pub model: ModelArgs,
    /// Where the images come from and how they are normalized.
    pub data: DataSettings,
    /// How to reach object storage, for paths that are s3:// or obs:// URLs.
    pub storage: StorageOptions,
    pub epochs: u64,
    pub batch_size: usize,
    /// `--global-batch-size`: images per step for the whole job, in shards of `batch_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch_size: Option<usize>,
    pub lr: f64,
    pub optimizer: OptimizerKind,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub lr_schedule: ScheduleKind,
    pub warmup_epochs: f64,
    pub step_epochs: u64,
    pub gamma: f64,
    pub scale_lr: bool,
    pub label_smoothing: f64,
    /// Pad-4 random crop and horizontal flip; written as `no-augment`, the flag's name, so
    /// that the file reads back through `--config`.
    #[serde(rename = "no-augment", with = "inverted_bool")]
    pub augment: bool,
    pub save_every: u64,
    pub keep_last: usize,
    pub output_dir: PathBuf,
    pub snapshot: PathBuf,
    pub snapshot_every_steps: u64,
    pub log_every_steps: u64,
    pub seed: u64,
    pub threads: usize,
    pub loader_threads: usize,
    pub init_from: Option<PathBuf>,
    /// `--fresh`: move the folder's previous run aside instead of resuming it.
    #[serde(skip)]
    pub fresh: bool,
    pub max_steps: Option<u64>,
    pub grad_accum: u64,
    pub sync_bn: bool,
    pub bucket_mb: f64,
    pub collective_timeout: f64,
    /// `--init-method`, `--rank`, `--world-size` as given (the environment fills the rest).
    #[serde(skip)]
    pub placement_flags: PlacementFlags,
}

/// The tutorial's flags for joining a job by hand.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlacementFlags {
    /// `tcp://HOST:PORT`.
    pub init_method: Option<String>,
    /// This process's rank.
    pub rank: Option<usize>,
    /// The number of processes.
    pub world_size: Option<usize>,
}

/// The cores this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |cores| cores.get())
}

impl TrainOptions {
    /// Fills in defaults and checks the values; errors name the setting.
    pub fn resolve(self) -> anyhow::Result<TrainSettings> {
        let output_dir = self
            .output_dir
            .unwrap_or_else(|| PathBuf::from("runs/latest"));
        // A relative snapshot path is inside the output folder, so `--output-dir` moves it.
        let snapshot = output_dir.join(
            self.snapshot
                .unwrap_or_else(|| PathBuf::from(DEFAULT_SNAPSHOT_NAME)),
        );
        let settings = TrainSettings {
            model: self.model,
            data: self.data.resolve()?,
            storage: self.storage,
            epochs: self.epochs.unwrap_or(10),
            batch_size: self.batch_size.unwrap_or(128),
            global_batch_size: self.global_batch_size,
            lr: self.lr.unwrap_or(0.01),
            optimizer: self.optimizer.unwrap_or(OptimizerKind::Adam),
            momentum: self.momentum.unwrap_or(0.0),
            nesterov: self.nesterov,
            weight_decay: self.weight_decay.unwrap_or(0.0),
            beta1: self.beta1.unwrap_or(0.9),
            beta2: self.beta2.unwrap_or(0.999),
            eps: self.eps.unwrap_or(1e-8),
            lr_schedule: self.lr_schedule.unwrap_or(ScheduleKind::Constant),
            warmup_epochs: self.warmup_epochs.unwrap_or(0.0),
            step_epochs: self.step_epochs.unwrap_or(30),
            gamma: self.gamma.unwrap_or(0.1),
            scale_lr: self.scale_lr,
            label_smoothing: self.label_smoothing.unwrap_or(0.0),
            augment: !self.no_augment,
            save_every: self.save_every.unwrap_or(1),
            keep_last: self.keep_last.unwrap_or(0),
            output_dir,
            snapshot,
            snapshot_every_steps: self.snapshot_every_steps.unwrap_or(0),
            log_every_steps: self.log_every_steps.unwrap_or(10),
            seed: self.seed.unwrap_or(0),
            threads: self.threads.unwrap_or(0),
            loader_threads: self.loader_threads.unwrap_or(1),
            init_from: self.init_from,
            fresh: self.fresh,
            max_steps: self.max_steps,
            grad_accum: self.grad_accum.unwrap_or(1),
            sync_bn: self.sync_bn,
            bucket_mb: self.bucket_mb.unwrap_or(25.0),
            collective_timeout: self.collective_timeout.unwrap_or(300.0),
            placement_flags: PlacementFlags {
                init_method: self.init_method,
                rank: self.rank,
                world_size: self.world_size,
            },
        };
        settings.check()?;
        Ok(settings)
    }
}

impl TrainSettings {
    /// Rejects values no run can use, naming the setting.
    fn check(&self) -> anyhow::Result<()> {
        if self.batch_size == 0 {
            bail!("--batch-size must be at least 1");
        }
        if self.loader_threads == 0 {
            bail!("--loader-threads must be at least 1");
        }
        if self.grad_accum == 0 {
            bail!("--grad-accum must be at least 1");
        }
        if let Some(global) = self.global_batch_size {
            if self.grad_accum != 1 {
                bail!(
                    "--grad-accum and --global-batch-size both set a step's micro-batches: \
                     --global-batch-size {global} with --batch-size {} already makes {} of them",
                    self.batch_size,
                    global / self.batch_size.max(1)
                );
            }
            if self.scale_lr {
                bail!(
                    "--global-batch-size does not go with --scale-lr: its steps are the same \
                     whatever the number of processes"
                );
            }
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            bail!(
                "--bucket-mb must be a positive number, got {}",
                self.bucket_mb
            );
        }
        if !(self.collective_timeout.is_finite() && self.collective_timeout > 0.0) {
            bail!(
                "--collective-timeout must be a positive number of seconds, got {}",
                self.collective_timeout
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("--lr must be a positive number, got {}", self.lr);
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            bail!(
                "--label-smoothing must be in [0, 1), got {}",
                self.label_smoothing
            );
        }
        if self.optimizer != OptimizerKind::Sgd && (self.momentum != 0.0 || self.nesterov) {
            bail!("--momentum and --nesterov apply to --optimizer sgd only");
        }
        if self.nesterov && self.momentum <= 0.0 {
            bail!("--nesterov needs a positive --momentum");
        }
        Ok(())
    }

    /// The settings as `OUT/config.toml` holds them: in the vocabulary of `--config`, so that
    /// `tandem train --config OUT/config.toml` gives the same run, and with the snapshot
    /// relative to the output folder (omitted when it is the default), so that the same file
    /// with another `--output-dir` starts a run of its own there.
    pub fn to_config_toml(&self) -> anyhow::Result<String> {
        let mut table = toml::Table::try_from(self).context("cannot render the settings")?;
        match self.snapshot.strip_prefix(&self.output_dir) {
            Ok(inside) if inside == Path::new(DEFAULT_SNAPSHOT_NAME) => {
                table.remove("snapshot");
            }
            Ok(inside) => {
                let relative = inside.to_string_lossy().into_owned();
                table.insert("snapshot".to_string(), toml::Value::String(relative));
            }
            Err(_) => {}
        }
        toml::to_string_pretty(&table).context("cannot render the settings as TOML")
    }

    /// Writes [`TrainSettings::to_config_toml`] to `path`, atomically.
    pub fn write_toml(&self, path: &Path) -> anyhow::Result<()> {
        Ok(crate::files::write_atomically(
            path,
            self.to_config_toml()?.as_bytes(),
        )?)
    }
}

/// Serializes a `bool` as its negation: `augment = true` is written `no-augment = false`.
mod inverted_bool {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &bool, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bool(!value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
        bool::deserialize(deserializer).map(|value| !value)
    }
}

/// The object-storage flags shared by `train`, `eval` and `predict` (the `[storage]` table
/// of a config file). Credentials are not among them: they come from the environment only.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct StorageOptions {
    /// Endpoint of the object store for s3:// and obs:// paths, e.g. http://127.0.0.1:9000
    /// or https://obs.cn-north-4.myhuaweicloud.com [default: AWS_ENDPOINT_URL, OBS_ENDPOINT
    /// or S3_ENDPOINT; else Amazon S3, for s3:// paths only].
    #[arg(long)]
    pub s3_endpoint: Option<String>,
    /// Signing region of the object store [default: AWS_REGION; an OBS endpoint's own; else
    /// us-east-1].
    #[arg(long)]
    pub s3_region: Option<String>,
    /// Path-style addressing (ENDPOINT/BUCKET/KEY) [default: only for an IP or localhost
    /// endpoint].
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub s3_path_style: bool,
    /// How long a failing object-store request is retried, with back-off, before the failure
    /// is final, in seconds [default: 120].
    #[arg(long)]
    pub s3_retry_timeout: Option<f64>,
    /// Local folder for data and weights fetched from object storage, and for staging the
    /// outputs of a run whose --output-dir is in object storage [default: TMPDIR/tandem-cache].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

impl StorageOptions {
    /// The cache folder.
    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(tandem_remote::default_cache_dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_args::ModelKind;

    /// Options with every setting that `config.toml` holds given a value other than its
    /// default; a setting added to [`TrainOptions`] fails to compile here until it is added.
    fn every_setting() -> TrainOptions {
        TrainOptions {
            config: None,
            model: ModelArgs {
                model: Some(ModelKind::ResnetBase),
                n_blocks: Some(vec![1, 2, 1]),
                n_channels: Some(vec![8, 16, 32]),
                bottlenecks: Some("4,8,8".to_string()),
                first_kernel_size: Some(5),
                num_classes: Some(3),
            },
            data: DataOptions {
                data: Some(DataKind::Cifar10Py),
                data_dir: Some(PathBuf::from("/data/cifar")),
                download: true,
                mean: Some(Rgb([0.4, 0.5, 0.6])),
                std: Some(Rgb([0.2, 0.25, 0.3])),
                synthetic_train: Some(77),
                synthetic_test: Some(33),
            },
            storage: StorageOptions {
                s3_endpoint: Some("http://127.0.0.1:9000".to_string()),
                s3_region: Some("cn-north-4".to_string()),
                s3_path_style: true,
                s3_retry_timeout: Some(30.0),
                cache_dir: Some(PathBuf::from("/scratch/cache")),
            },
            epochs: Some(7),
            batch_size: Some(12),
            // Goes with neither --grad-accum nor --scale-lr: see the test of its own.
            global_batch_size: None,
            lr: Some(0.3),
            optimizer: Some(OptimizerKind::Sgd),
            momentum: Some(0.8),
            nesterov: true,
            weight_decay: Some(1e-3),
            beta1: Some(0.8),
            beta2: Some(0.99),
            eps: Some(1e-6),
            lr_schedule: Some(ScheduleKind::Step),
            warmup_epochs: Some(0.5),
            step_epochs: Some(3),
            gamma: Some(0.5),
            scale_lr: true,
            label_smoothing: Some(0.1),
            no_augment: true,
            save_every: Some(2),
            keep_last: Some(4),
            output_dir: Some(PathBuf::from("/runs/every")),
            snapshot: Some(PathBuf::from("/runs/elsewhere/snap.safetensors")),
            snapshot_every_steps: Some(5),
            log_every_steps: Some(3),
            seed: Some(42),
            threads: Some(3),
            loader_threads: Some(2),
            init_from: Some(PathBuf::from("/weights/start.safetensors")),
            fresh: false,
            max_steps: Some(99),
            grad_accum: Some(2),
            sync_bn: true,
            bucket_mb: Some(4.5),
            collective_timeout: Some(60.0),
            // Placement, like the rank: not a setting of the run (a run may resume elsewhere).
            device: None,
            precision: None,
            algorithms: None,
            init_method: None,
            backend: None,
            rank: None,
            world_size: None,
        }
    }

    /// The keys of a TOML table, with `table.key` for the keys of its sub-tables.
    fn key_paths(table: &toml::Table, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        for (key, value) in table {
            match value {
                toml::Value::Table(inner) => keys.extend(key_paths(inner, &format!("{key}."))),
                _ => keys.push(format!("{prefix}{key}")),
            }
        }
        keys.sort();
        keys
    }

    #[test]
    fn config_toml_reads_back_as_the_same_settings() {
        let settings = every_setting().resolve().unwrap();
        let text = settings.to_config_toml().unwrap();
        let read_back = TrainOptions::from_toml(&text)
            .unwrap_or_else(|error| panic!("config.toml does not read back: {error}\n{text}"));
        assert_eq!(read_back.clone().resolve().unwrap(), settings, "{text}");
        assert_eq!(read_back.resolve().unwrap().to_config_toml().unwrap(), text);
    }

    #[test]
    fn config_toml_holds_every_setting() {
        let options = toml::Table::try_from(every_setting()).unwrap();
        let text = every_setting().resolve().unwrap().to_config_toml().unwrap();
        let written: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(key_paths(&written, ""), key_paths(&options, ""), "{text}");
    }

    #[test]
    fn config_toml_holds_the_global_batch_size_and_its_refusals_name_the_flags() {
        let options = TrainOptions {
            batch_size: Some(12),
            global_batch_size: Some(48),
            ..TrainOptions::default()
        };
        let settings = options.clone().resolve().unwrap();
        let text = settings.to_config_toml().unwrap();
        assert!(text.contains("global-batch-size = 48"), "{text}");
        let read_back = TrainOptions::from_toml(&text).unwrap().resolve().unwrap();
        assert_eq!(read_back, settings, "{text}");
        let refused = |options: TrainOptions| options.resolve().unwrap_err().to_string();
        assert_eq!(
            refused(TrainOptions {
                grad_accum: Some(2),
                ..options.clone()
            }),
            "--grad-accum and --global-batch-size both set a step's micro-batches: \
             --global-batch-size 48 with --batch-size 12 already makes 4 of them"
        );
        assert_eq!(
            refused(TrainOptions {
                scale_lr: true,
                ..options.clone()
            }),
            "--global-batch-size does not go with --scale-lr: its steps are the same whatever \
             the number of processes"
        );
        assert!(TrainOptions {
            sync_bn: true,
            ..options
        }
        .resolve()
        .is_ok());
    }

    #[test]
    fn defaults_read_back_as_the_same_settings() {
        let settings = TrainOptions::default().resolve().unwrap();
        let text = settings.to_config_toml().unwrap();
        let read_back = TrainOptions::from_toml(&text).unwrap().resolve().unwrap();
        assert_eq!(read_back, settings, "{text}");
    }
}

#[cfg(test)]
mod config_file_tests {
    use super::*;

    #[test]
    fn a_table_key_outside_its_table_is_shown_in_the_table() {
        let error = TrainOptions::from_toml("epochs = 2\ndata = \"synthetic\"\n").unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "`data = \"synthetic\"` is a setting of the [data] table; write it there:\n\
             [data]\ndata = \"synthetic\""
        );
        let error =
            TrainOptions::from_toml("n-blocks = [1, 1, 1]\nmodel = \"resnet-base\"\n").unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "`model = \"resnet-base\"`, `n-blocks = [1, 1, 1]` are settings of the [model] \
             table; write them there:\n[model]\nmodel = \"resnet-base\"\nn-blocks = [1, 1, 1]"
        );
        let error =
            TrainOptions::from_toml("s3-endpoint = \"http://127.0.0.1:9000\"\n").unwrap_err();
        assert!(
            format!("{error:#}").ends_with("[storage]\ns3-endpoint = \"http://127.0.0.1:9000\""),
            "{error:#}"
        );
        let good = "[data]\ndata = \"synthetic\"\n[model]\nmodel = \"resnet18\"\n";
        let options = TrainOptions::from_toml(good).unwrap();
        assert_eq!(options.data.data, Some(DataKind::Synthetic));
    }

    #[test]
    fn config_toml_holds_the_normalization_as_given() {
        let options = TrainOptions {
            data: DataOptions {
                mean: Some("0.485,0.456,0.406".parse().unwrap()),
                std: Some("0.229,0.224,0.225".parse().unwrap()),
                ..DataOptions::default()
            },
            ..TrainOptions::default()
        };
        let settings = options.resolve().unwrap();
        let text = settings.to_config_toml().unwrap();
        let written: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(
            written["data"]["mean"].to_string(),
            "[0.485, 0.456, 0.406]",
            "{text}"
        );
        assert_eq!(written["data"]["std"].to_string(), "[0.229, 0.224, 0.225]");
        let read_back = TrainOptions::from_toml(&text).unwrap().resolve().unwrap();
        assert_eq!(read_back.data.mean, settings.data.mean);
    }

    #[test]
    fn a_switch_in_the_file_holds_unless_the_flag_is_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "no-augment = true\nsync-bn = true\n").unwrap();
        let from_file = TrainOptions {
            config: Some(path.clone()),
            ..TrainOptions::default()
        };
        let merged = from_file.merged_with_file().unwrap().resolve().unwrap();
        assert!(!merged.augment && merged.sync_bn && !merged.nesterov);
        let with_flag = TrainOptions {
            config: Some(path),
            scale_lr: true,
            ..TrainOptions::default()
        };
        let merged = with_flag.merged_with_file().unwrap().resolve().unwrap();
        assert!(!merged.augment && merged.sync_bn && merged.scale_lr);
    }
}

#[cfg(test)]
mod path_tests {
    use super::*;

    fn resolved(toml_text: &str, output_dir: Option<&str>) -> TrainSettings {
        let mut options = TrainOptions::from_toml(toml_text).unwrap();
        if let Some(dir) = output_dir {
            options.output_dir = Some(PathBuf::from(dir));
        }
        options.resolve().unwrap()
    }

    #[test]
    fn the_default_snapshot_is_left_out_and_moves_with_the_output_folder() {
        let first = resolved("output-dir = \"runs/a\"\n", None);
        let text = first.to_config_toml().unwrap();
        assert!(!text.contains("\nsnapshot ="), "{text}");
        let moved = resolved(&text, Some("runs/b"));
        assert_eq!(moved.snapshot, Path::new("runs/b/snapshot.safetensors"));
    }

    #[test]
    fn a_snapshot_inside_the_output_folder_is_written_relative_to_it() {
        let first = resolved(
            "output-dir = \"runs/a\"\nsnapshot = \"keep/snap.safetensors\"\n",
            None,
        );
        assert_eq!(first.snapshot, Path::new("runs/a/keep/snap.safetensors"));
        let text = first.to_config_toml().unwrap();
        assert!(
            text.contains("snapshot = \"keep/snap.safetensors\""),
            "{text}"
        );
        let moved = resolved(&text, Some("runs/b"));
        assert_eq!(moved.snapshot, Path::new("runs/b/keep/snap.safetensors"));
    }

    #[test]
    fn a_snapshot_elsewhere_keeps_its_absolute_path() {
        let first = resolved(
            "output-dir = \"runs/a\"\nsnapshot = \"/scratch/snap.safetensors\"\n",
            None,
        );
        let moved = resolved(&first.to_config_toml().unwrap(), Some("runs/b"));
        assert_eq!(moved.snapshot, Path::new("/scratch/snap.safetensors"));
    }
}
