//! `tandem train`: the training job of both tutorials, on one process or many.
//!
//! The run is a loop over epochs and, within an epoch, over optimizer steps. Everything that
//! decides a step's numbers (the data order, the augmentation, the learning rate) is a
//! function of the seed, the epoch and the step, so a run resumed from a snapshot taken at
//! any step continues with exactly the numbers the uninterrupted run would have had.

pub mod batches;
pub mod ddp;
pub mod exact_buckets;
pub mod fresh_start;
pub mod gradient_sync;
pub mod lockstep;
pub mod mirror;
pub mod on_device;
pub mod placement;
pub mod reform;
pub mod resume_settings;
pub mod run_lock;
pub mod sample_trace;
pub mod schedule;
pub mod shards;
pub mod snapshot;
pub mod stop_signal;

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tandem_cuda::Device;
use tandem_data::{
    eval_shard, Augment, Dataset, DistributedSampler, Loader, LoaderOptions, Normalize,
};
use tandem_engine::{AdamConfig, OptimizerConfig, SgdConfig};
use tandem_metrics::tensorboard::EventWriter;
use tandem_metrics::{write_history, EpochRecord};
use tandem_models::training_device::{update_host, NcclJoin, StepRequest, StepRun, TrainBatch};
use tandem_models::{LossOptions, Model, ModelSpec, TrainingDevice};

use crate::backend::{Backend, BackendRequest};
use crate::checkpoint_info::{checkpoint_epoch, checkpoint_name, CheckpointInfo};
use crate::data_source::{load_split, normalization, Split};
use crate::device::Announce;
use crate::evaluation::{evaluate, Evaluation};
use crate::exit::SettingsError;
use crate::math::GpuMath;
use crate::model_args::{curves_title, value_name, ModelArgs};
use crate::settings::{available_cores, OptimizerKind, TrainOptions, TrainSettings};
use batches::{EpochBatches, IndexBatches, MicroBatch};
use ddp::{graphs_agree, Ddp};
use gradient_sync::{run_step, GradientSync, LocalStep};
use mirror::{localize, Mirror};
use on_device::{dataset_upload, uploaded_bytes, StepNotes};
use placement::find_placement_of;
use resume_settings::fingerprint;
use run_lock::{host_name, OutputLock, RunLock};
use sample_trace::SampleTrace;
use schedule::Schedule;
use shards::ShardSync;
use snapshot::{load_latest, Progress, Snapshot};
use tandem_data::ShardPlan;
use tandem_metrics::WorldSizeChange;

/// Runs `tandem train`.
///
/// Returns when the run ends by itself; exits the process with 128 + the signal (130 after
/// SIGINT, 143 after SIGTERM) when a stop request ended it, once its snapshot is written.
pub fn run(options: TrainOptions) -> anyhow::Result<()> {
    let device = options.device.unwrap_or_default();
    let (device, math) = crate::device::select(
        device,
        options.precision,
        options.algorithms.unwrap_or_default(),
        crate::device::Announce::Stdout,
    )?;
    let backend = options.backend.unwrap_or_default();
    let settings = options
        .merged_with_file()
        .and_then(TrainOptions::resolve)
        .map_err(SettingsError::from_error)?;
    let stop_signal = stop_signal::install()?;
    let mut trainer = Trainer::new(
        settings,
        &device,
        math,
        backend,
        Arc::clone(&stop_signal.requested),
    )?;
    stop_signal.run_under_way();
    let end = tandem_engine::run_on_kernel_threads(|| trainer.train());
    let end = trainer.finish_uploads(end)?;
    if end != RunEnd::StoppedOnRequest {
        return Ok(());
    }
    let received = stop_signal.received();
    let signal = received.unwrap_or(signal_hook::consts::SIGTERM);
    Err(stop_signal::StoppedBySignal {
        signal,
        received: received.is_some(),
        name: stop_signal::name(signal),
        epoch: trainer.progress.epoch + 1,
        step: trainer.progress.step_in_epoch,
        snapshot: trainer.shown(&trainer.settings.snapshot),
    }
    .into())
}

/// Rank 0's uploads of the run's staging `places` to object storage, if it has any; a failed
/// upload sets `stop_requested`.
fn start_mirror(
    storage: tandem_remote::Storage,
    places: Vec<(std::path::PathBuf, tandem_remote::ObjectUrl)>,
    stop_requested: &Arc<AtomicBool>,
) -> anyhow::Result<Option<Mirror>> {
    if places.is_empty() {
        return Ok(None);
    }
    Ok(Some(Mirror::start(
        storage,
        places,
        Arc::clone(stop_requested),
    )?))
}

/// The run's model, initialized from the seed or from `--init-from` (`given` names it as the
/// user wrote it), and how the banner names those weights.
fn build_model(
    settings: &TrainSettings,
    given: &TrainSettings,
) -> anyhow::Result<(ModelSpec, Model, Option<String>)> {
    let spec = settings
        .model
        .to_spec()
        .map_err(SettingsError::from_error)?;
    let mut model = Model::new(&spec)?;
    model.init_default(settings.seed);
    let initial_weights = match (&settings.init_from, &given.init_from) {
        (Some(local), Some(as_given)) => {
            let progress = crate::weights::load_weights(&mut model, local)?;
            Some(describe_initial_weights(as_given, &progress))
        }
        _ => None,
    };
    Ok((spec, model, initial_weights))
}

/// What the process that writes the run's files holds: the output folder's lock (after
/// `--fresh` cleared it) and the uploads to object storage, when outputs go there.
fn take_the_output_folder(
    settings: &TrainSettings,
    storage: Option<tandem_remote::Storage>,
    places: Vec<(std::path::PathBuf, tandem_remote::ObjectUrl)>,
    stop_requested: &Arc<AtomicBool>,
) -> anyhow::Result<(OutputLock, Option<Mirror>)> {
    let lock = RunLock::acquire(&settings.output_dir)?;
    let lock = OutputLock::holding(lock, &settings.output_dir);
    if settings.fresh {
        start_fresh(settings)?;
    }
    let mirror = match storage {
        Some(storage) => start_mirror(storage, places, stop_requested)?,
        None => None,
    };
    Ok((lock, mirror))
}

/// Joins the job's other processes as `place` says: the job token from the environment, the
/// gradient buckets of `param_len` parameters; the group must form within `formation`, else
/// the collective timeout.
fn join_the_job(
    place: &ddp::WorkerPlacement,
    settings: &TrainSettings,
    param_len: usize,
    formation: Option<Duration>,
) -> anyhow::Result<Ddp> {
    let token = tandem_dist::JobToken::from_env()?
        .context(MISSING_TOKEN)
        .map_err(SettingsError::from_error)?;
    let bucket_bytes = (settings.bucket_mb * 1e6) as usize;
    let collectives = Duration::from_secs_f64(settings.collective_timeout);
    Ddp::join_within(
        place,
        token,
        (formation.unwrap_or(collectives), collectives),
        param_len,
        (bucket_bytes, FIRST_BUCKET_BYTES.min(bucket_bytes)),
    )
}

/// Joins the device to the NCCL group of `ddp`'s ranks (a unique id of its own, through
/// the group's store namespace), and SyncBatchNorm through it. The group's heartbeat
/// aborts the communicator when the job's membership moves on without one of its members
/// (`--keep-survivors`), so that a collective blocked on the lost peer returns.
fn join_nccl(
    compute: &mut dyn TrainingDevice,
    ddp: &Ddp,
    settings: &TrainSettings,
) -> anyhow::Result<()> {
    let timeout = Duration::from_secs_f64(settings.collective_timeout);
    let unique_id = ddp.nccl_unique_id(timeout)?;
    compute.join_nccl(NcclJoin {
        unique_id: &unique_id,
        rank: ddp.rank(),
        world_size: ddp.world_size(),
        timeout,
        buckets: ddp.buckets(),
    })?;
    if settings.sync_bn {
        compute.sync_batch_norm_through_nccl()?;
    }
    if let Some(abort) = compute.nccl_abort() {
        ddp.on_membership_loss(Box::new(move |why| {
            abort(&format!("the job lost a member ({why})"));
        }));
    }
    Ok(())
}

/// [`join_nccl`] at the job's start, saying on rank 0 how the group carries the gradients:
/// with `shards` (`--global-batch-size`), the shards' exact sum.
fn start_nccl(
    compute: &mut dyn TrainingDevice,
    ddp: &Ddp,
    settings: &TrainSettings,
    shards: bool,
) -> anyhow::Result<()> {
    join_nccl(compute, ddp, settings)?;
    if ddp.rank() == 0 && shards {
        say!("gradients: the shards' exact sum runs on the GPUs, through NCCL");
    } else if ddp.rank() == 0 {
        say!(
            "gradients: averaged by NCCL on the GPUs in {} buckets as backward finishes them",
            ddp.buckets().len()
        );
        if settings.sync_bn {
            say!("sync-bn: batch statistics summed by NCCL on the GPUs");
        }
    }
    Ok(())
}

/// Uploads the training set (and then the test set) to the device when it keeps them, saying
/// so on rank 0; returns whether each is there.
fn upload_data_sets(
    compute: &mut dyn TrainingDevice,
    train_set: &Arc<Dataset>,
    test_set: &Arc<Dataset>,
    settings: &TrainSettings,
    normalize: Option<Normalize>,
    rank: usize,
) -> anyhow::Result<(bool, bool)> {
    let batches_on_device = match host_batches_requested() || !compute.takes_data_sets() {
        true => None,
        false => uploaded_bytes(compute.upload_train_set(dataset_upload(
            train_set,
            &mut None,
            train_augment(settings),
            normalize,
            settings.seed,
        ))?),
    };
    if let (Some(bytes), 0) = (batches_on_device, rank) {
        say!(
            "data: the training set is in GPU memory ({:.1} MB); batches are assembled there",
            bytes as f64 / 1e6
        );
    }
    let eval_on_device = match batches_on_device {
        Some(_) => {
            let mut made = None;
            let upload = dataset_upload(test_set, &mut made, None, normalize, 0);
            uploaded_bytes(compute.upload_eval_set(upload)?)
        }
        None => None,
    };
    if let (Some(bytes), 0) = (eval_on_device, rank) {
        say!(
            "data: the test set is in GPU memory ({:.1} MB); evaluation batches are assembled there",
            bytes as f64 / 1e6
        );
    }
    Ok((batches_on_device.is_some(), eval_on_device.is_some()))
}

/// A training run in progress.
struct Trainer {
    /// The settings the run works with: every object URL replaced by a local path.
    settings: TrainSettings,
    /// The settings as given, written to `config.toml`.
    given: TrainSettings,
    /// The model and its optimizer on the run's device.
    compute: Box<dyn TrainingDevice>,
    /// The notes on CUDA graphs printed so far.
    step_notes: StepNotes,
    /// The device and precision in a few words, for the banner.
    device: String,
    schedule: Schedule,
    train_set: Arc<Dataset>,
    test_set: Arc<Dataset>,
    sampler: DistributedSampler,
    /// The logical shards of `--global-batch-size`; `None` for per-process batches.
    shards: Option<ShardPlan>,
    normalize: Option<Normalize>,
    /// Whether the training set is in GPU memory and batches are assembled there.
    batches_on_device: bool,
    /// Whether the test set is in GPU memory and evaluation batches are assembled there.
    eval_on_device: bool,
    progress: Progress,
    history: Vec<EpochRecord>,
    /// How a step's gradients meet the other ranks', with the job's process group.
    sync: Box<dyn GradientSync>,
    stop_requested: Arc<AtomicBool>,
    /// The output folder's lock, held by rank 0 (the rank that writes) for the whole run.
    output_lock: OutputLock,
    /// The TensorBoard event file (rank 0, once training starts).
    events: Option<EventWriter>,
    /// Uploads to object storage (rank 0, when outputs go there).
    mirror: Option<Mirror>,
    /// `--init-from`'s weights, as the banner names them.
    initial_weights: Option<String>,
    /// The line saying that the run resumed on another number of processes.
    resize_note: Option<String>,
    /// The per-step record of the samples trained, when `TANDEM_SAMPLE_TRACE` asks for it.
    sample_trace: Option<SampleTrace>,
    /// This worker's membership when survivors re-form the job (`--keep-survivors`).
    membership: Option<reform::Membership>,
    /// A failure of the group after this worker's step was applied, which re-forms the job
    /// before the next step.
    pending_failure: Option<anyhow::Error>,
}

impl Trainer {
    /// Builds the model, data and optimizer, joins the job's other processes, chooses the
    /// backend with them, and resumes from the snapshot when one exists.
    fn new(
        given: TrainSettings,
        device: &Device,
        math: Option<GpuMath>,
        backend: BackendRequest,
        stop_requested: Arc<AtomicBool>,
    ) -> anyhow::Result<Self> {
        // An explicit --backend nccl under a launcher takes the data-parallel path even alone.
        let placement = find_placement_of(&given.placement_flags, backend == BackendRequest::Nccl)?;
        let (rank, world_size, local_world_size) = placement.as_ref().map_or((0, 1, 1), |place| {
            (place.rank, place.world_size, place.local_world_size)
        });
        // A worker started in place of a lost one writes nothing until it is let in.
        let writer = rank == 0 && !reform::started_as_joiner();
        let localized = localize(&given)?;
        let mut settings = localized.settings;
        let mut given = given;
        let (lock, mirror) = match writer {
            true => take_the_output_folder(
                &settings,
                localized.storage,
                localized.places,
                &stop_requested,
            )?,
            false => (OutputLock::default(), None),
        };
        if settings.threads == 0 {
            settings.threads = (available_cores() / local_world_size.max(1)).max(1);
        }
        given.threads = settings.threads;
        tandem_engine::set_threads(settings.threads);
        let (spec, model, initial_weights) = build_model(&settings, &given)?;
        let train_set = Arc::new(load_split(&settings.data, settings.seed, Split::Train)?);
        let test_set = Arc::new(load_split(&settings.data, settings.seed, Split::Test)?);
        check_classes(&train_set, spec.num_classes()).map_err(SettingsError::from_error)?;
        let (sampler, shards, steps_per_epoch) =
            epoch_sampling(&settings, train_set.len(), world_size, rank)?;
        check_shards_sync_bn(shards.as_ref(), device, &settings)?;
        let membership =
            reform::membership_of(placement.as_ref(), shards, device, backend, &settings)?;
        let joiner = membership.as_ref().is_some_and(|member| member.joiner);
        let schedule = build_schedule(&settings, steps_per_epoch, world_size);
        let optimizer = build_optimizer(&settings, schedule.lr_at(0));
        let normalize = normalization(&settings.data);
        // A joiner joins the running job's group later, at a step boundary.
        let ddp = placement
            .as_ref()
            .filter(|_| !joiner)
            .map(|place| join_the_job(place, &settings, model.params().len(), None))
            .transpose()?;
        reform::watch_the_first_group(membership.as_ref(), ddp.as_ref(), &lock);
        let backend = crate::backend::choose(backend, device, ddp.as_ref(), Announce::Stdout)?;
        // On the ring, GPU ranks exchange gradients and broadcasts through the host; with NCCL
        // they stay on the device, and the snapshot, batch count and metrics use the ring.
        let mut compute = crate::device::open_training_device(model, device, math)?;
        compute.set_optimizer(optimizer);
        if let (Some(Backend::Nccl), Some(ddp)) = (backend, ddp.as_ref()) {
            start_nccl(&mut *compute, ddp, &settings, shards.is_some())?;
        }
        let sync = gradient_sync_of(shards, ddp, &mut *compute, &settings)?;
        let (batches_on_device, eval_on_device) = upload_data_sets(
            &mut *compute,
            &train_set,
            &test_set,
            &settings,
            normalize,
            rank,
        )?;
        let trainer = Trainer {
            settings,
            given,
            compute,
            step_notes: StepNotes::default(),
            device: crate::math::describe(device, math),
            schedule,
            train_set,
            test_set,
            sampler,
            shards,
            normalize,
            batches_on_device,
            eval_on_device,
            progress: Progress {
                world_size,
                ..Progress::default()
            },
            history: Vec::new(),
            sync,
            stop_requested,
            output_lock: lock,
            events: None,
            mirror,
            initial_weights,
            resize_note: None,
            sample_trace: SampleTrace::from_env()?,
            membership,
            pending_failure: None,
        };
        trainer.begin(joiner)
    }

    /// The run's start: a `joiner` is let into the running job and takes a member's state;
    /// any other process resumes from the snapshot, if there is one, and agrees with the
    /// others on the model.
    fn begin(mut self, joiner: bool) -> anyhow::Result<Self> {
        if joiner {
            self.join_as_newcomer()?;
            return Ok(self);
        }
        let resumed = self.resume_if_possible()?;
        if self.is_leader() {
            self.announce_start(resumed);
        }
        self.agree_on_the_model()?;
        Ok(self)
    }

    /// Makes every rank start from rank 0's model: its parameters and buffers (on the
    /// device through NCCL, else through the host ring).
    fn agree_on_the_model(&mut self) -> anyhow::Result<()> {
        self.sync.agree_on_the_model(&mut *self.compute)
    }

    /// Whether this process speaks for the job: prints progress and writes files.
    fn is_leader(&self) -> bool {
        self.sync.group().is_none_or(|ddp| ddp.rank() == 0)
    }

    fn world_size(&self) -> usize {
        self.sync.group().map_or(1, Ddp::world_size)
    }

    /// Continues from the latest good snapshot, if there is one. Rank 0 reads it and gives
    /// it to the other ranks, so only rank 0 needs the file.
    fn resume_if_possible(&mut self) -> anyhow::Result<bool> {
        let local = if self.is_leader() {
            let _files = tandem_dist::heartbeat::doing_file_work();
            self.newest_snapshot()?
        } else {
            None
        };
        let snapshot = match self.sync.group_mut() {
            Some(ddp) => {
                let bytes = match &local {
                    Some(snapshot) => snapshot.to_bytes()?,
                    None => Vec::new(),
                };
                let shared = ddp.broadcast_bytes(bytes)?;
                if shared.is_empty() {
                    None
                } else {
                    Some(Snapshot::from_bytes(&shared)?)
                }
            }
            None => local,
        };
        let Some(snapshot) = snapshot else {
            return Ok(false);
        };
        self.check_resumable(&snapshot)?;
        update_host(&mut *self.compute, |model| snapshot.restore_model(model))?;
        self.compute.load_optimizer_state(&snapshot.optimizer)?;
        self.progress = snapshot.progress;
        self.history = snapshot.history;
        let saved_world_size = snapshot
            .settings
            .get("world-size")
            .and_then(|size| size.parse().ok());
        self.resize_note = self.adopt_world_size(saved_world_size);
        Ok(true)
    }

    /// Records this job's number of processes in the progress. When the snapshot was written
    /// by another number (`saved_world_size` in a snapshot that kept it among its settings),
    /// records the change and moves per-process batches to the same position in the epoch's
    /// order; returns the line that says so.
    fn adopt_world_size(&mut self, saved_world_size: Option<usize>) -> Option<String> {
        let now = self.world_size();
        let before = match self.progress.world_size {
            0 => saved_world_size.unwrap_or(now),
            recorded => recorded,
        };
        self.progress.world_size = now;
        if before == now {
            return None;
        }
        let progress = &mut self.progress;
        progress.world_size_changes.push(WorldSizeChange {
            step: progress.global_step,
            from: before,
            to: now,
        });
        let at = format!(
            "world size: {before} -> {now} at epoch {}, step {}",
            progress.epoch + 1,
            progress.step_in_epoch
        );
        if let Some(plan) = self.shards {
            return Some(format!(
                "{at}: the steps stay the same (global batch {} in {} shards of {})",
                plan.global_batch,
                plan.shards_per_step(),
                plan.micro_batch
            ));
        }
        let per_step = self.settings.batch_size as u64 * self.settings.grad_accum;
        let base = &mut progress.epoch_base;
        base.samples += (progress.step_in_epoch - base.step) * per_step * before as u64;
        base.step = progress.step_in_epoch;
        let lr = match self.settings.scale_lr {
            true => format!(
                "; --scale-lr: the learning rate is now {}",
                self.schedule.base_lr
            ),
            false => String::new(),
        };
        Some(format!(
            "{at}: the global batch goes from {} to {} ({} per process); training goes on from \
             sample {} of the epoch's {}{lr}. --global-batch-size {} would have kept the steps \
             the same on any number of processes",
            per_step * before as u64,
            per_step * now as u64,
            per_step,
            base.samples,
            self.train_set.len(),
            per_step * before as u64
        ))
    }

    /// Fails, as a settings error, when this run's settings differ from those the snapshot was
    /// written with: the conflicts first, in the flags' words, then the ways out.
    fn check_resumable(&self, snapshot: &Snapshot) -> anyhow::Result<()> {
        let snapshot_info = CheckpointInfo::from_metadata(&snapshot.metadata)
            .ok()
            .flatten();
        let context = resume_settings::ResumeContext {
            settings: &self.settings,
            snapshot_model: snapshot_info.as_ref().map(|info| &info.model),
        };
        let current = fingerprint(&self.settings);
        let conflicts = resume_settings::conflicts(&snapshot.settings, &current, &context);
        if conflicts.is_empty() {
            return Ok(());
        }
        let shown = self.shown(&self.settings.snapshot);
        Err(SettingsError::from_error(anyhow::anyhow!(
            "settings conflict with the snapshot {shown}: {}. To resume it, use the settings it \
             was written with; to change them, start a new run from its weights with \
             --init-from {shown} --output-dir NEW, or start over here with --fresh",
            conflicts.join("; ")
        )))
    }

    /// Prints what the run is about to do: the banner, then whether it resumes, or is done.
    fn announce_start(&self, resumed: bool) {
        let settings = &self.settings;
        let world_size = self.world_size();
        say!(
            "tandem {} | device: {} | {} per process | world size {world_size}",
            env!("CARGO_PKG_VERSION"),
            self.device,
            count(settings.threads as u64, "compute thread")
        );
        say!(
            "data: {} | {} training, {} test images ({}x{}) | normalize: {}",
            value_name(&settings.data.data),
            self.train_set.len(),
            self.test_set.len(),
            self.train_set.height,
            self.train_set.width,
            match (settings.data.mean, settings.data.std) {
                (Some(mean), Some(std)) => format!("mean {:?}, std {:?}", mean.0, std.0),
                _ => "none".to_string(),
            }
        );
        say!(
            "model: {} | {} parameters",
            describe_model(self.compute.spec()),
            group_digits(self.compute.param_count())
        );
        say!(
            "{} | {}",
            self.describe_batch(),
            count(settings.epochs, "epoch")
        );
        say!(
            "optimizer: {} | {} | schedule: {}",
            describe_optimizer(settings),
            describe_lr(settings, world_size, self.schedule.base_lr),
            describe_schedule(settings)
        );
        let finished = resumed && self.progress.epoch >= settings.epochs;
        let start = if finished {
            format!(
                "finished: {} holds the end of epoch {}",
                self.shown(&settings.snapshot),
                self.progress.epoch
            )
        } else if resumed {
            let position = match self.progress.step_in_epoch {
                0 => format!("after {}", count(self.progress.epoch, "epoch")),
                step => format!("(epoch {}, step {step})", self.progress.epoch + 1),
            };
            format!("resumed from {} {position}", self.shown(&settings.snapshot))
        } else {
            "fresh".to_string()
        };
        let initial_weights = match (&self.initial_weights, resumed) {
            (None, _) => String::new(),
            (Some(_), true) => {
                " (--init-from is not used: the snapshot's weights go on)".to_string()
            }
            (Some(weights), false) => format!(", from the weights of {weights}"),
        };
        let staged = match self
            .mirror
            .as_ref()
            .and_then(|mirror| mirror.url_of(&settings.output_dir))
        {
            Some(_) => format!(" (staged in {})", settings.output_dir.display()),
            None => String::new(),
        };
        say!(
            "output: {}{staged} | {start}{initial_weights}",
            self.shown(&settings.output_dir)
        );
        if !resumed {
            return;
        }
        if finished {
            say!(
                "{}/{} done; raise --epochs to continue",
                self.progress.epoch,
                count(settings.epochs, "epoch")
            );
        } else {
            say!("{}", self.resume_line());
        }
        if let Some(note) = &self.resize_note {
            say!("{note}");
        }
    }

    /// The global batch and how it is made, for the banner.
    fn describe_batch(&self) -> String {
        let (settings, world_size) = (&self.settings, self.world_size());
        match self.shards {
            Some(plan) => format!(
                "global batch {} in {} shards of {}, shared by {} (the same steps on 1 to {}){}",
                plan.global_batch,
                plan.shards_per_step(),
                plan.micro_batch,
                count(world_size as u64, "process"),
                plan.shards_per_step(),
                match settings.sync_bn {
                    true => "; --sync-bn: batch statistics of the whole global batch",
                    false => "",
                }
            ),
            None => format!(
                "global batch {} ({} per process x {} x {} accumulated)",
                settings.batch_size * world_size * settings.grad_accum as usize,
                settings.batch_size,
                count(world_size as u64, "process"),
                settings.grad_accum
            ),
        }
    }

    /// The line that says where a resumed run goes on: `... at epoch 2, step 17` within an
    /// epoch; at an epoch's end, the epochs run so far, as the tutorial counts them: `...: 3
    /// epochs run, continuing with epoch 4 of 5`.
    fn resume_line(&self) -> String {
        let progress = &self.progress;
        match progress.step_in_epoch {
            0 => format!(
                "Resuming training from snapshot: {} run, continuing with epoch {} of {}",
                count(progress.epoch, "epoch"),
                progress.epoch + 1,
                self.settings.epochs
            ),
            step => format!(
                "Resuming training from snapshot at epoch {}, step {step}",
                progress.epoch + 1
            ),
        }
    }

    /// Trains until the last epoch, `--max-steps` or a stop request, and writes the run's
    /// files.
    fn train(&mut self) -> anyhow::Result<RunEnd> {
        if self.is_leader() {
            std::fs::create_dir_all(&self.settings.output_dir).with_context(|| {
                format!(
                    "cannot create output folder {}",
                    self.settings.output_dir.display()
                )
            })?;
            self.remove_stale_temporaries()?;
            let config = self.settings.output_dir.join("config.toml");
            self.given.write_toml(&config)?;
            self.publish(&config);
        }
        if self.settings.epochs == 0 && self.is_leader() {
            say!("--epochs is 0: nothing to train");
        }
        if self.is_leader() && self.progress.epoch < self.settings.epochs {
            self.open_events()?;
        }
        while self.progress.epoch < self.settings.epochs {
            match self.run_epoch()? {
                EpochEnd::Stopped(end) => return Ok(end),
                EpochEnd::Completed | EpochEnd::Reformed => {}
            }
        }
        Ok(RunEnd::Finished)
    }

    /// Opens the run's TensorBoard events (rank 0), marking where this session starts.
    fn open_events(&mut self) -> anyhow::Result<()> {
        let mut events = EventWriter::create(&self.settings.output_dir, &host_name())?;
        // What earlier sessions logged past the snapshot is trained again from here.
        events.add_session_start(self.progress.global_step + 1)?;
        events.flush()?;
        self.events = Some(events);
        Ok(())
    }

    /// Removes what killed writers left in the folders this run writes to (see
    /// [`crate::files::remove_stale_temporaries`]), saying so on stderr.
    fn remove_stale_temporaries(&self) -> anyhow::Result<()> {
        let mut folders = vec![self.settings.output_dir.clone()];
        if let Some(parent) = self.settings.snapshot.parent() {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            if !folders.iter().any(|folder| folder == parent) {
                folders.push(parent.to_path_buf());
            }
        }
        for folder in folders {
            for path in crate::files::remove_stale_temporaries(&folder)? {
                tell!(
                    "removed {}, left by a writer that is no longer running",
                    crate::terminal::printable(&path.display().to_string())
                );
            }
        }
        Ok(())
    }

    /// Trains the rest of the current epoch, evaluates, and writes the epoch's files.
    fn run_epoch(&mut self) -> anyhow::Result<EpochEnd> {
        let epoch = self.progress.epoch;
        let accumulation = self.settings.grad_accum as usize;
        let mut batches = self.epoch_batches(epoch)?;
        let steps_in_epoch = match &self.shards {
            Some(plan) => plan.steps_per_epoch(),
            None => {
                let base = self.progress.epoch_base.step;
                base + batches.num_batches().div_ceil(accumulation) as u64
            }
        };
        let mut bar = self
            .is_leader()
            .then(|| ProgressLine::new(epoch + 1, steps_in_epoch, self.progress.step_in_epoch));
        let started = Instant::now();
        let seconds_before = self.progress.epoch_seconds;
        let mut images_this_session = 0usize;
        let mut log_window = LogWindow::new();
        let mut lr = self.schedule.lr_at(self.progress.global_step);
        while let Some(micro_batches) = self.next_step(&mut batches, steps_in_epoch)? {
            lr = self.schedule.lr_at(self.progress.global_step);
            if let Some(error) = self.pending_failure.take() {
                self.reform(error)?;
                return Ok(EpochEnd::Reformed);
            }
            if self.reform_at_step_boundary()? {
                return Ok(EpochEnd::Reformed);
            }
            let step_started = Instant::now();
            let outcome = match self.train_step(&micro_batches, lr) {
                Ok(outcome) => outcome,
                Err(error) if self.can_reform(&error) => {
                    self.reform(error)?;
                    return Ok(EpochEnd::Reformed);
                }
                Err(error) => return Err(error),
            };
            let job_images = outcome.images * self.world_size();
            images_this_session += job_images;
            self.progress.epoch_loss_sum += outcome.mean_loss;
            self.progress.step_in_epoch += 1;
            if let Some(ddp) = self.sync.group() {
                let seconds = step_started.elapsed().as_secs_f64().max(1e-9);
                let step = self.progress.step_in_epoch;
                ddp.publish_status(epoch + 1, step, outcome.images as f64 / seconds);
            }
            self.progress.global_step += 1;
            self.progress.epoch_seconds = seconds_before + started.elapsed().as_secs_f64();
            self.log_step(&mut log_window, job_images, outcome.mean_loss, lr)?;
            if let Some(bar) = bar.as_mut() {
                bar.update(
                    self.progress.step_in_epoch,
                    outcome.mean_loss,
                    images_this_session,
                    started,
                );
            }
            let end = match (outcome.stop, self.reached_max_steps()) {
                (true, _) => Some(RunEnd::StoppedOnRequest),
                (false, true) => Some(RunEnd::MaxSteps),
                (false, false) => None,
            };
            if let Some(end) = end {
                if let Some(bar) = &bar {
                    bar.finish();
                }
                self.stop_within_epoch(end)?;
                return Ok(EpochEnd::Stopped(end));
            }
            let every = self.settings.snapshot_every_steps;
            if every > 0 && self.progress.step_in_epoch.is_multiple_of(every) {
                self.save_snapshot()?;
            }
        }
        if let Some(bar) = &bar {
            bar.finish();
        }
        match self.finish_epoch(steps_in_epoch, lr)? {
            true => Ok(EpochEnd::Completed),
            false => Ok(EpochEnd::Reformed),
        }
    }

    /// Counts a step's `images` (the job's) in `window`, and every `--log-every-steps` steps
    /// writes the loss, the learning rate and the window's images per second to TensorBoard.
    fn log_step(
        &mut self,
        window: &mut LogWindow,
        images: usize,
        loss: f64,
        lr: f64,
    ) -> anyhow::Result<()> {
        window.images += images;
        let every = self.settings.log_every_steps;
        if every == 0 || !self.progress.global_step.is_multiple_of(every) {
            return Ok(());
        }
        if let Some(events) = self.events.as_mut() {
            let seconds = window.started.elapsed().as_secs_f64().max(1e-9);
            events.add_scalars(
                self.progress.global_step,
                &[
                    ("train/loss", loss),
                    ("train/lr", lr),
                    ("train/images_per_second", window.images as f64 / seconds),
                ],
            )?;
            events.flush()?;
        }
        *window = LogWindow::new();
        Ok(())
    }

    /// Ends the run within an epoch: writes the snapshot and the event file, and says why
    /// and where the snapshot is.
    fn stop_within_epoch(&mut self, end: RunEnd) -> anyhow::Result<()> {
        self.save_snapshot()?;
        self.publish_events();
        // After a failed upload the error that ends the run says where things are.
        let upload_failed = self.mirror.as_ref().is_some_and(Mirror::has_failed);
        if !self.is_leader() || upload_failed {
            return Ok(());
        }
        let reason = match end {
            RunEnd::StoppedOnRequest => "Stopped on request".to_string(),
            _ => format!("Stopped after --max-steps {}", self.progress.global_step),
        };
        tell!(
            "{reason} at epoch {}, step {}; the snapshot is {}",
            self.progress.epoch + 1,
            self.progress.step_in_epoch,
            self.snapshot_place()
        );
        Ok(())
    }

    /// The batches of the rest of `epoch`: the CPU loader's, or their indices when the GPU
    /// assembles them; the same samples either way.
    fn epoch_batches(&self, epoch: u64) -> anyhow::Result<EpochBatches> {
        let accumulation = self.settings.grad_accum as usize;
        let step = self.progress.step_in_epoch;
        let (indices, start_batch) = match &self.shards {
            Some(plan) => {
                let (world_size, rank) = self.rank_in_world();
                let order = self.sampler.indices(epoch);
                (
                    plan.worker_indices(&order, world_size, rank),
                    plan.micro_batches_before(step, world_size, rank),
                )
            }
            None => {
                let base = self.progress.epoch_base;
                (
                    self.sampler.indices_from(epoch, base.samples as usize),
                    (step - base.step) as usize * accumulation,
                )
            }
        };
        if self.batches_on_device {
            let batches = IndexBatches::new(
                Arc::clone(&self.train_set),
                indices,
                self.settings.batch_size,
                start_batch,
            )?;
            return Ok(EpochBatches::Device(batches));
        }
        let loader = Loader::new(
            Arc::clone(&self.train_set),
            indices,
            LoaderOptions {
                batch_size: self.settings.batch_size,
                drop_last: false,
                augment: train_augment(&self.settings),
                normalize: self.normalize,
                seed: self.settings.seed,
                epoch,
                threads: self.settings.loader_threads,
                prefetch: 2 * self.settings.loader_threads + accumulation,
                start_batch,
            },
        )?;
        Ok(EpochBatches::host(loader))
    }

    /// The micro-batches of the epoch's next step, `None` once its `steps_in_epoch` are done:
    /// `--grad-accum` of them (fewer at the end), or this worker's shards of the step (none,
    /// in an epoch's last step with fewer shards than workers).
    fn next_step(
        &self,
        batches: &mut EpochBatches,
        steps_in_epoch: u64,
    ) -> anyhow::Result<Option<Vec<MicroBatch>>> {
        let step = self.progress.step_in_epoch;
        if step >= steps_in_epoch {
            return Ok(None);
        }
        match &self.shards {
            Some(plan) => {
                let (world_size, rank) = self.rank_in_world();
                let count = plan.worker_shards(step, world_size, rank).len();
                Ok(Some(batches.take(count)?))
            }
            None => batches.next_step(self.settings.grad_accum as usize),
        }
    }

    /// The number of processes and this one's rank.
    fn rank_in_world(&self) -> (usize, usize) {
        self.sync
            .group()
            .map_or((1, 0), |ddp| (ddp.world_size(), ddp.rank()))
    }

    /// One optimizer step over `micro_batches` (one, or `--grad-accum` of them): forward,
    /// backward, gradient averaging over the ranks, update. When an NCCL collective timed
    /// out, the error also names the peer that stopped answering, as the ring finds it.
    fn train_step(&mut self, micro_batches: &[MicroBatch], lr: f64) -> anyhow::Result<StepOutcome> {
        let outcome = self.averaged_step(micro_batches, lr);
        outcome.map_err(|error| {
            if self.compute.nccl_failure().is_none() {
                return error;
            }
            if self.membership.is_some() {
                // The survivors re-form the job without asking the ring, which lost a member.
                return reform::nccl_group_failed(error);
            }
            match self.sync.group().and_then(Ddp::name_stalled_peer) {
                Some(peer) => error.context(format!("the ring's view of the failure: {peer}")),
                None => error,
            }
        })
    }

    /// [`Trainer::train_step`]'s work: the step through the gradient-sync strategy, then
    /// the loss over the ranks. The loss is read after the update, so a non-finite loss stops
    /// the run after that step's update rather than before it; the run ends with the same
    /// error and writes nothing.
    fn averaged_step(
        &mut self,
        micro_batches: &[MicroBatch],
        lr: f64,
    ) -> anyhow::Result<StepOutcome> {
        let loss = LossOptions {
            label_smoothing: self.settings.label_smoothing as f32,
        };
        let epoch = self.progress.epoch;
        let step_batches: Vec<TrainBatch<'_>> = micro_batches
            .iter()
            .map(|batch| batch.train_batch(epoch))
            .collect();
        let request = StepRequest {
            micro_batches: &step_batches,
            height: self.train_set.height,
            width: self.train_set.width,
            loss: &loss,
            lr,
            momentum: self.schedule.momentum_at(self.progress.global_step),
        };
        let local = run_step(
            &mut *self.compute,
            &mut *self.sync,
            &mut self.step_notes,
            request,
            self.progress.step_in_epoch,
        )?;
        let (mean_loss, stop) = match self.over_the_ranks(local) {
            Ok(agreed) => agreed,
            // The step is applied here: the job re-forms before the next one.
            Err(error) if local.agreed && self.can_reform(&error) => {
                self.pending_failure = Some(error);
                (local.mean_loss, self.stop_requested.load(Ordering::Relaxed))
            }
            Err(error) => return Err(error),
        };
        if self.sample_trace.is_some() {
            self.trace_step(micro_batches)?;
        }
        if !mean_loss.is_finite() {
            bail!(
                "the training loss became {mean_loss} at epoch {}, step {}: lower --lr",
                self.progress.epoch + 1,
                self.progress.step_in_epoch + 1
            );
        }
        Ok(StepOutcome {
            mean_loss,
            images: micro_batches.iter().map(MicroBatch::len).sum(),
            stop,
        })
    }

    /// Records the samples of this step (`TANDEM_SAMPLE_TRACE`): this process's, and with
    /// `--global-batch-size` the whole step's.
    fn trace_step(&mut self, micro_batches: &[MicroBatch]) -> anyhow::Result<()> {
        let (epoch, step) = (self.progress.epoch, self.progress.step_in_epoch);
        let place = self.rank_in_world();
        let indices: Vec<usize> = micro_batches
            .iter()
            .flat_map(|batch| batch.indices().iter().copied())
            .collect();
        let step_indices = self.shards.map(|plan| {
            let everyone = plan.worker_indices(&self.sampler.indices(epoch), 1, 0);
            let start = (step as usize * plan.global_batch).min(everyone.len());
            let end = (start + plan.global_batch).min(everyone.len());
            everyone[start..end].to_vec()
        });
        match self.sample_trace.as_mut() {
            Some(trace) => trace.record(epoch, step, place, &indices, step_indices.as_deref()),
            None => Ok(()),
        }
    }

    /// The step's loss and whether to stop, as the job's: the mean of the ranks' losses
    /// (unless the strategy agreed on the job's already) and whether any rank was asked to
    /// stop (summed on the host ring); this rank's own without DDP. With a `run` (a whole
    /// step through NCCL: how this rank ran it), the ranks that ran it as a CUDA graph, and
    /// those that captured a new one, are counted too, and an error says so when not all or
    /// none did (NCCL requires every rank's collectives captured alike, and launched from the
    /// same capture).
    fn over_the_ranks(&mut self, local: LocalStep) -> anyhow::Result<(f64, bool)> {
        let LocalStep {
            mean_loss,
            agreed,
            run,
        } = local;
        let local_stop = self.stop_requested.load(Ordering::Relaxed);
        let Some(ddp) = self.sync.group_mut() else {
            return Ok((mean_loss, local_stop));
        };
        let flag = |on: bool| if on { 1.0 } else { 0.0 };
        let mut sums = vec![mean_loss, flag(local_stop)];
        if let Some(run) = run {
            sums.extend([flag(run != StepRun::Eager), flag(run == StepRun::Capture)]);
        }
        ddp.sum_f64(&mut sums)?;
        if let [_, _, graphed_ranks, captured_ranks] = sums[..] {
            graphs_agree(graphed_ranks, captured_ranks, ddp.world_size())?;
        }
        let mean_loss = match agreed {
            true => mean_loss,
            false => sums[0] / ddp.world_size() as f64,
        };
        Ok((mean_loss, sums[1] > 0.0))
    }

    /// This rank's share of the test set evaluated, summed over the ranks.
    fn evaluate_over_the_ranks(&mut self, test_indices: Vec<usize>) -> anyhow::Result<Evaluation> {
        let mut evaluation = evaluate(
            &mut *self.compute,
            &self.test_set,
            self.eval_on_device,
            test_indices,
            self.settings.batch_size,
            self.normalize,
            self.settings.loader_threads,
        )?;
        if let Some(ddp) = self.sync.group_mut() {
            let mut sums = evaluation.to_sums();
            ddp.sum_f64(&mut sums)?;
            evaluation = Evaluation::from_sums(evaluation.classes, &sums);
        }
        Ok(evaluation)
    }

    /// Evaluates, records and prints the epoch, and writes checkpoint and snapshot; returns
    /// `false` when a lost worker stopped the evaluation and the survivors re-formed the
    /// job instead (the epoch is finished again after it).
    fn finish_epoch(&mut self, steps_in_epoch: u64, lr: f64) -> anyhow::Result<bool> {
        let epoch_number = self.progress.epoch + 1;
        let train_loss = self.progress.epoch_loss_sum / steps_in_epoch.max(1) as f64;
        let (world_size, rank) = self.rank_in_world();
        let test_indices: Vec<usize> = eval_shard(self.test_set.len(), world_size, rank).collect();
        let evaluation = match self.evaluate_over_the_ranks(test_indices) {
            Ok(evaluation) => evaluation,
            Err(error) if self.can_reform(&error) => {
                self.reform(error)?;
                return Ok(false);
            }
            Err(error) => return Err(error),
        };
        let epoch_seconds = self.progress.epoch_seconds;
        // With shards the job visits the data set once; per process each rank visits its share.
        let images = match self.shards {
            Some(plan) => plan.dataset_len,
            None => self.sampler.num_samples() * world_size,
        } as f64;
        let record = EpochRecord {
            epoch: epoch_number,
            train_loss,
            val_loss: evaluation.loss(),
            val_accuracy: evaluation.accuracy(),
            epoch_seconds,
            images_per_second: images / epoch_seconds.max(1e-9),
            lr,
            steps: steps_in_epoch,
            world_size_changes: std::mem::take(&mut self.progress.world_size_changes),
        };
        self.history.push(record.clone());
        self.progress = Progress {
            epoch: epoch_number,
            global_step: self.progress.global_step,
            world_size: self.progress.world_size,
            ..Progress::default()
        };
        let own_rate = images / world_size as f64 / epoch_seconds.max(1e-9);
        let rates = match self.gather_per_rank(own_rate) {
            Ok(rates) => rates,
            // The epoch is done here: the job re-forms before the next step.
            Err(error) if self.can_reform(&error) => {
                self.pending_failure = Some(error);
                vec![own_rate]
            }
            Err(error) => return Err(error),
        };
        if !self.is_leader() {
            say!(
                "epoch: {} | loss: {:.4} | {own_rate:.1} img/s on rank {rank}",
                record.epoch,
                record.train_loss
            );
            return Ok(true);
        }
        say!(
            "train | epoch: {} | loss: {:.4}",
            record.epoch,
            record.train_loss
        );
        let slowest = match slowest_rank(&rates) {
            Some((slow_rank, rate)) if rates.len() > 1 => {
                format!(" | slowest: rank {slow_rank}, {rate:.1} img/s")
            }
            _ => String::new(),
        };
        say!(
            "val | epoch: {} | loss: {:.4} | accuracy: {:.4} | time: {:.1} s | {:.1} img/s{slowest}",
            record.epoch,
            record.val_loss,
            record.val_accuracy,
            record.epoch_seconds,
            record.images_per_second
        );
        // Its peers wait for rank 0 meanwhile: it is busy, not hung.
        let _files = tandem_dist::heartbeat::doing_file_work();
        let title = curves_title(&self.shown(&self.settings.output_dir), self.compute.spec());
        write_history(&self.settings.output_dir, &self.history, &title)?;
        for name in ["metrics.jsonl", "curves.png"] {
            self.publish(&self.settings.output_dir.join(name));
        }
        self.write_epoch_checkpoint(epoch_number)?;
        self.save_snapshot()?;
        // After the snapshot: an epoch's scalars are in the event file only once a snapshot
        // holds the epoch, so a resumed run never writes them a second time.
        self.log_epoch_scalars(&record)?;
        Ok(true)
    }

    /// The epoch's figures as TensorBoard scalars at step `epoch` (rank 0).
    fn log_epoch_scalars(&mut self, record: &EpochRecord) -> anyhow::Result<()> {
        let Some(events) = self.events.as_mut() else {
            return Ok(());
        };
        events.add_scalars(
            record.epoch,
            &[
                ("epoch/train_loss", record.train_loss),
                ("epoch/val_loss", record.val_loss),
                ("epoch/val_accuracy", record.val_accuracy),
                ("epoch/images_per_second", record.images_per_second),
                ("epoch/lr", record.lr),
            ],
        )?;
        events.flush()?;
        self.publish_events();
        Ok(())
    }

    /// Writes `epoch_N.safetensors` when due, and drops the ones past `--keep-last`.
    fn write_epoch_checkpoint(&mut self, epoch_number: u64) -> anyhow::Result<()> {
        let every = self.settings.save_every;
        if every == 0 || !epoch_number.is_multiple_of(every) {
            return Ok(());
        }
        let path = self.settings.output_dir.join(checkpoint_name(epoch_number));
        let metadata = self.checkpoint_metadata(self.history.last())?;
        let bytes = tandem_models::state_dict_safetensors(self.compute.host_model()?, &metadata)
            .with_context(|| format!("cannot serialize checkpoint {}", path.display()))?;
        crate::files::write_atomically(&path, &bytes)?;
        self.publish(&path);
        if self.settings.keep_last > 0 {
            prune_checkpoints(&self.settings.output_dir, self.settings.keep_last)?;
            if let Some(mirror) = &self.mirror {
                mirror.prune_checkpoints(&self.settings.output_dir, self.settings.keep_last);
            }
        }
        Ok(())
    }

    /// Writes the snapshot of the run as it stands (rank 0 only).
    fn save_snapshot(&mut self) -> anyhow::Result<()> {
        if !self.is_leader() {
            return Ok(());
        }
        let _files = tandem_dist::heartbeat::doing_file_work();
        let optimizer = self.compute.optimizer_state()?;
        let metadata = self.checkpoint_metadata(
            self.history
                .last()
                .filter(|_| self.progress.step_in_epoch == 0),
        )?;
        let settings = fingerprint(&self.settings);
        let snapshot = Snapshot::capture(
            self.compute.host_model()?,
            optimizer,
            self.progress.clone(),
            self.history.clone(),
            settings,
        )
        .with_metadata(metadata);
        snapshot.save(&self.settings.snapshot)?;
        self.publish(&self.settings.snapshot);
        Ok(())
    }

    /// Queues the upload of a file just written, when the run's outputs go to object
    /// storage.
    fn publish(&self, path: &Path) {
        if let Some(mirror) = &self.mirror {
            mirror.publish(path);
        }
    }

    /// Queues the upload of this session's TensorBoard event file as it stands.
    fn publish_events(&self) {
        if let Some(events) = &self.events {
            self.publish(events.path());
        }
    }

    /// Where the snapshot just written is: its path, and for a staged one the object it is
    /// being uploaded to (it is there once the uploads finish).
    fn snapshot_place(&self) -> String {
        let snapshot = &self.settings.snapshot;
        match self
            .mirror
            .as_ref()
            .and_then(|mirror| mirror.url_of(snapshot))
        {
            Some(url) => format!("{}, being uploaded to {url}", snapshot.display()),
            None => snapshot.display().to_string(),
        }
    }

    /// How a staged path is shown: as the object it stands for, else as itself.
    fn shown(&self, path: &Path) -> String {
        self.mirror
            .as_ref()
            .and_then(|mirror| mirror.url_of(path))
            .map_or_else(|| path.display().to_string(), |url| url.to_string())
    }

    /// The newest good snapshot: the staging folder's, or the bucket's when it is further
    /// on (a relaunch on a fresh node has only the bucket's). What an earlier run left
    /// pending is uploaded first, unless the bucket is further on than the staged files.
    fn newest_snapshot(&mut self) -> anyhow::Result<Option<Snapshot>> {
        let local = load_latest(&self.settings.snapshot)?;
        let shown = self.shown(&self.settings.snapshot);
        let Some(mirror) = self.mirror.as_mut() else {
            return Ok(local);
        };
        let from_bucket = mirror
            .fetch_snapshot(&self.settings.snapshot)?
            .map(|fetched| {
                let loaded = Snapshot::load(&fetched);
                let _ = std::fs::remove_file(&fetched);
                loaded
            });
        let newest = match (from_bucket, local) {
            (Some(Ok(from_bucket)), local)
                if local.as_ref().is_none_or(|local| {
                    local.progress.global_step < from_bucket.progress.global_step
                }) =>
            {
                mirror.forget_earlier()?;
                return Ok(Some(from_bucket));
            }
            (Some(Err(error)), None) => {
                return Err(error.context(format!(
                "{shown} is damaged and no other copy exists: start over with another --output-dir"
            )))
            }
            (Some(Err(error)), Some(local)) => {
                tell!("warning: {shown} in the bucket is damaged ({error:#}); resuming from the staged copy");
                Some(local)
            }
            (_, local) => local,
        };
        mirror.upload_earlier()?;
        Ok(newest)
    }

    /// Waits for the uploads of a run that ended (`end`), however it ended; an upload that
    /// failed ends the run with an error saying what is kept where, and what is pending.
    fn finish_uploads(&mut self, end: anyhow::Result<RunEnd>) -> anyhow::Result<RunEnd> {
        let Some(mirror) = self.mirror.as_mut() else {
            return end;
        };
        let outcome = mirror.finish();
        let end = end?;
        let Err(failure) = outcome else {
            return Ok(end);
        };
        let (pending, folder) = mirror.pending();
        let state = match end {
            RunEnd::Finished => format!(
                "the run finished (epoch {}), but not every file reached the bucket",
                self.progress.epoch
            ),
            _ => format!(
                "the run stopped at epoch {}, step {}, as its files cannot reach the bucket",
                self.progress.epoch + 1,
                self.progress.step_in_epoch
            ),
        };
        bail!(
            "{failure}\n{state}: its snapshot is kept locally in {}, and {pending} upload(s) are \
             pending (recorded in {}); run the same command again (with this --cache-dir) to \
             upload them and resume",
            self.settings.snapshot.display(),
            folder.display()
        );
    }

    /// Every rank's `value`, indexed by rank (all ranks take part; one process: its own).
    fn gather_per_rank(&mut self, value: f64) -> anyhow::Result<Vec<f64>> {
        let Some(ddp) = self.sync.group_mut() else {
            return Ok(vec![value]);
        };
        let mut values = vec![0.0; ddp.world_size()];
        values[ddp.rank()] = value;
        ddp.sum_f64(&mut values)?;
        Ok(values)
    }

    /// What a checkpoint of the weights as they stand says about itself; `epoch` is the
    /// record of the epoch whose end they are, if they are one.
    fn checkpoint_metadata(
        &self,
        epoch: Option<&EpochRecord>,
    ) -> anyhow::Result<BTreeMap<String, String>> {
        // The data as given: an object URL stays one, for `eval` on another machine.
        CheckpointInfo::of_run(
            &self.given,
            &ModelArgs::from_spec(self.compute.spec()),
            &self.train_set.class_names,
            epoch,
            self.progress.global_step,
        )
        .to_metadata()
    }

    fn reached_max_steps(&self) -> bool {
        self.settings
            .max_steps
            .is_some_and(|max_steps| self.progress.global_step >= max_steps)
    }
}

/// The job's gradient sync: that of the logical `shards` when there are (with SyncBatchNorm
/// over the global batch when `settings.sync_bn`), else the one [`gradient_sync::choose`]
/// picks for the process group `ddp` on `device`.
fn gradient_sync_of(
    shards: Option<ShardPlan>,
    ddp: Option<Ddp>,
    device: &mut dyn TrainingDevice,
    settings: &TrainSettings,
) -> anyhow::Result<Box<dyn GradientSync>> {
    Ok(match shards {
        Some(plan) => {
            let sync = ShardSync::new(ddp, plan, device)?;
            match settings.sync_bn {
                true => Box::new(
                    sync.with_sync_bn(Duration::from_secs_f64(settings.collective_timeout)),
                ),
                false => Box::new(sync),
            }
        }
        None => gradient_sync::choose(ddp, device, settings.sync_bn),
    })
}

/// Refuses `--sync-bn` with `--global-batch-size` (`shards`) on a GPU.
fn check_shards_sync_bn(
    shards: Option<&ShardPlan>,
    device: &Device,
    settings: &TrainSettings,
) -> anyhow::Result<()> {
    if shards.is_some() && settings.sync_bn && !matches!(device, Device::Cpu { .. }) {
        return Err(SettingsError::from_error(anyhow::anyhow!(
            "--sync-bn with --global-batch-size works on the CPU only for now (--device cpu): \
             on a GPU, run --global-batch-size without --sync-bn, or --sync-bn without \
             --global-batch-size"
        )));
    }
    Ok(())
}

/// How rank `rank` of `world_size` draws an epoch's `dataset_len` samples: the sampler, the
/// logical shards of `--global-batch-size` if given (every rank then draws the epoch's whole
/// order and takes its shards of it), and the optimizer steps of an epoch.
fn epoch_sampling(
    settings: &TrainSettings,
    dataset_len: usize,
    world_size: usize,
    rank: usize,
) -> anyhow::Result<(DistributedSampler, Option<ShardPlan>, u64)> {
    let shards =
        shard_plan(settings, dataset_len, world_size).map_err(SettingsError::from_error)?;
    let (sampler_world, sampler_rank) = match shards {
        Some(_) => (1, 0),
        None => (world_size, rank),
    };
    let sampler = DistributedSampler::new(
        dataset_len,
        sampler_world,
        sampler_rank,
        true,
        settings.seed,
        false,
    )?;
    let batches_per_epoch = sampler.num_samples().div_ceil(settings.batch_size) as u64;
    let steps_per_epoch = match &shards {
        Some(plan) => plan.steps_per_epoch(),
        None => batches_per_epoch.div_ceil(settings.grad_accum),
    };
    Ok((sampler, shards, steps_per_epoch))
}

/// The logical shards of `--global-batch-size` over `dataset_len` samples, checked against
/// the job's `world_size`; `None` without it.
fn shard_plan(
    settings: &TrainSettings,
    dataset_len: usize,
    world_size: usize,
) -> anyhow::Result<Option<ShardPlan>> {
    let Some(global) = settings.global_batch_size else {
        return Ok(None);
    };
    let plan = ShardPlan::new(global, settings.batch_size, dataset_len)?;
    plan.check_world_size(world_size)?;
    Ok(Some(plan))
}

/// The training augmentation of `settings`: pad-4 random crop and horizontal flip, or none.
fn train_augment(settings: &TrainSettings) -> Option<Augment> {
    settings.augment.then_some(Augment::crop_and_flip())
}

/// Whether `TANDEM_HOST_BATCHES=1` asks a GPU run to take its batches from the CPU loader
/// (the reference of the device data path's test) instead of assembling them on the GPU.
fn host_batches_requested() -> bool {
    std::env::var_os("TANDEM_HOST_BATCHES").is_some_and(|value| value == "1")
}

/// `--fresh`: moves the folder's previous run aside and says where. A worker restarted by
/// `tandem launch` resumes instead: its first round already started over.
fn start_fresh(settings: &TrainSettings) -> anyhow::Result<()> {
    let restarted = std::env::var(tandem_dist::cluster::contract::RESTART_COUNT_ENV)
        .ok()
        .and_then(|count| count.parse::<u64>().ok())
        .is_some_and(|count| count > 0);
    if restarted {
        return Ok(());
    }
    match fresh_start::move_previous_run_aside(&settings.output_dir, &settings.snapshot)? {
        Some(aside) => say!(
            "Starting over (--fresh): the previous run's files are now in {}",
            aside.display()
        ),
        None => say!(
            "Starting over (--fresh): {} held no previous run",
            settings.output_dir.display()
        ),
    }
    Ok(())
}

/// The steps since the last TensorBoard record of the images per second.
struct LogWindow {
    started: Instant,
    /// The job's images in the window.
    images: usize,
}

impl LogWindow {
    fn new() -> Self {
        LogWindow {
            started: Instant::now(),
            images: 0,
        }
    }
}

/// What one optimizer step reports.
struct StepOutcome {
    /// The step's loss, averaged over micro-batches and ranks.
    mean_loss: f64,
    /// Images this process trained on.
    images: usize,
    /// Whether any rank was asked to stop.
    stop: bool,
}

/// What a process of a job says when it has no job token.
const MISSING_TOKEN: &str = "a job of several processes needs TANDEM_JOB_TOKEN, the same \
     secret on every rank (tandem launch makes one itself): make one with `export \
     TANDEM_JOB_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')` and start \
     every rank with it";

/// The first gradient bucket is small, so that communication starts early in backward.
const FIRST_BUCKET_BYTES: usize = 1_000_000;

/// How an epoch ended.
#[derive(PartialEq, Eq)]
enum EpochEnd {
    Completed,
    /// A worker was lost and the survivors re-formed the job: the epoch goes on from the
    /// progress they agreed on.
    Reformed,
    /// The run ends within the epoch.
    Stopped(RunEnd),
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RunEnd {
    /// Every epoch is done.
    Finished,
    /// `--max-steps` steps are done.
    MaxSteps,
    /// SIGTERM or SIGINT here or on another rank.
    StoppedOnRequest,
}

/// The rank with the lowest throughput, and its throughput.
fn slowest_rank(rates: &[f64]) -> Option<(usize, f64)> {
    rates
        .iter()
        .copied()
        .enumerate()
        .min_by(|(_, a), (_, b)| a.total_cmp(b))
}

/// `--init-from`'s file as given (a path or URL) and, as far as the file says, the epoch and
/// step its weights are from: `runs/a/epoch_3.safetensors (epoch 3, step 120)`.
fn describe_initial_weights(as_given: &Path, progress: &crate::weights::WeightsProgress) -> String {
    let when = match (progress.epoch, progress.step) {
        (Some(epoch), Some(step)) => format!("epoch {epoch}, step {step}"),
        (Some(epoch), None) => format!("epoch {epoch}"),
        (None, Some(step)) => format!("step {step}"),
        (None, None) => "the file records no epoch or step".to_string(),
    };
    format!("{} ({when})", as_given.display())
}

/// `1 epoch`, `3 epochs`: a count and its noun.
fn count(number: u64, noun: &str) -> String {
    match (number, noun.ends_with('s')) {
        (1, _) => format!("1 {noun}"),
        (_, true) => format!("{number} {noun}es"),
        (_, false) => format!("{number} {noun}s"),
    }
}

/// The optimizer and its settings that are not their defaults: `sgd (momentum 0.9,
/// nesterov, weight decay 0.0005)`.
fn describe_optimizer(settings: &TrainSettings) -> String {
    let mut details = Vec::new();
    if settings.momentum != 0.0 {
        details.push(format!("momentum {}", settings.momentum));
    }
    if settings.nesterov {
        details.push("nesterov".to_string());
    }
    if settings.optimizer != OptimizerKind::Sgd && (settings.beta1, settings.beta2) != (0.9, 0.999)
    {
        details.push(format!("betas {}, {}", settings.beta1, settings.beta2));
    }
    if settings.weight_decay != 0.0 {
        details.push(format!("weight decay {}", settings.weight_decay));
    }
    let name = value_name(&settings.optimizer);
    match details.is_empty() {
        true => name,
        false => format!("{name} ({})", details.join(", ")),
    }
}

/// The learning rate the run uses, `base_lr`, and how `--scale-lr` made it from `--lr`.
fn describe_lr(settings: &TrainSettings, world_size: usize, base_lr: f64) -> String {
    match settings.scale_lr {
        false => format!("lr {base_lr}"),
        true => format!(
            "lr {base_lr} (--lr {} x {}, --scale-lr)",
            settings.lr,
            count(world_size as u64, "process")
        ),
    }
}

/// The learning-rate schedule and its settings: `step (x0.1 every 30 epochs), 1 warm-up epoch`.
fn describe_schedule(settings: &TrainSettings) -> String {
    let kind = settings.lr_schedule;
    let mut text = value_name(&kind);
    if kind == schedule::ScheduleKind::Step {
        text.push_str(&format!(
            " (x{} every {})",
            settings.gamma,
            count(settings.step_epochs, "epoch")
        ));
    }
    if settings.warmup_epochs > 0.0 {
        let plural = if settings.warmup_epochs == 1.0 {
            ""
        } else {
            "s"
        };
        text.push_str(&format!(
            ", {} warm-up epoch{plural}",
            settings.warmup_epochs
        ));
    }
    text
}

/// The model in the words of its flags.
fn describe_model(spec: &tandem_models::ModelSpec) -> String {
    let join = |values: &[usize]| {
        values
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    match spec {
        tandem_models::ModelSpec::ResNet18 { num_classes } => {
            format!("resnet18, {num_classes} classes")
        }
        tandem_models::ModelSpec::ResNetBase(spec) => format!(
            "resnet-base (blocks {}, channels {}, bottlenecks {}, first kernel {}), {} classes",
            join(&spec.n_blocks),
            join(&spec.n_channels),
            spec.bottlenecks
                .as_deref()
                .map_or_else(|| "none".to_string(), join),
            spec.first_kernel_size,
            spec.num_classes
        ),
    }
}

/// `1234567` as `1,234,567`.
fn group_digits(value: usize) -> String {
    let digits = value.to_string();
    let mut grouped = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    grouped
}

/// Fails when the labels do not fit the model's classes.
fn check_classes(dataset: &Dataset, num_classes: usize) -> anyhow::Result<()> {
    if let Some(&label) = dataset.labels.iter().max() {
        if label as usize >= num_classes {
            bail!(
                "the data has label {label}, but the model has {num_classes} classes (--num-classes)"
            );
        }
    }
    Ok(())
}

/// The learning-rate schedule of the run.
fn build_schedule(settings: &TrainSettings, steps_per_epoch: u64, world_size: usize) -> Schedule {
    let scale = if settings.scale_lr {
        world_size as f64
    } else {
        1.0
    };
    Schedule {
        kind: settings.lr_schedule,
        base_lr: settings.lr * scale,
        steps_per_epoch,
        total_steps: steps_per_epoch * settings.epochs,
        warmup_steps: (settings.warmup_epochs * steps_per_epoch as f64).round() as u64,
        step_epochs: settings.step_epochs,
        gamma: settings.gamma,
    }
}

/// The optimizer the settings name, starting at learning rate `lr`.
fn build_optimizer(settings: &TrainSettings, lr: f64) -> OptimizerConfig {
    match settings.optimizer {
        OptimizerKind::Sgd => OptimizerConfig::Sgd(SgdConfig {
            lr: lr as f32,
            momentum: settings.momentum as f32,
            dampening: 0.0,
            nesterov: settings.nesterov,
            weight_decay: settings.weight_decay as f32,
        }),
        OptimizerKind::Adam | OptimizerKind::Adamw => OptimizerConfig::Adam(AdamConfig {
            lr: lr as f32,
            beta1: settings.beta1 as f32,
            beta2: settings.beta2 as f32,
            eps: settings.eps as f32,
            weight_decay: settings.weight_decay as f32,
            decoupled: settings.optimizer == OptimizerKind::Adamw,
        }),
    }
}

/// Deletes `epoch_N.safetensors` files in `folder` except the `keep` with the largest N.
fn prune_checkpoints(folder: &Path, keep: usize) -> anyhow::Result<()> {
    let mut epochs: Vec<(u64, std::path::PathBuf)> = std::fs::read_dir(folder)
        .with_context(|| format!("cannot list {}", folder.display()))?
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let epoch = checkpoint_epoch(entry.file_name().to_str()?)?;
            Some((epoch, entry.path()))
        })
        .collect();
    epochs.sort();
    let excess = epochs.len().saturating_sub(keep);
    for (_, path) in epochs.into_iter().take(excess) {
        std::fs::remove_file(&path)
            .with_context(|| format!("cannot remove old checkpoint {}", path.display()))?;
    }
    Ok(())
}

/// The per-epoch progress display: a bar on a terminal, a few plain lines otherwise.
struct ProgressLine {
    bar: Option<indicatif::ProgressBar>,
    epoch_number: u64,
    total_steps: u64,
}

impl ProgressLine {
    fn new(epoch_number: u64, total_steps: u64, done_steps: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total_steps);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "epoch {prefix} {bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_prefix(epoch_number.to_string());
            bar.set_position(done_steps);
            bar
        });
        ProgressLine {
            bar,
            epoch_number,
            total_steps,
        }
    }

    fn update(&mut self, step: u64, loss: f64, images: usize, started: Instant) {
        let rate = images as f64 / started.elapsed().as_secs_f64().max(1e-9);
        match &self.bar {
            Some(bar) => {
                bar.set_position(step);
                bar.set_message(format!("loss {loss:.4} | {rate:.0} img/s"));
            }
            None => {
                let every = (self.total_steps / 10).max(1);
                if step.is_multiple_of(every) || step == self.total_steps {
                    tell!(
                        "epoch {} | step {step}/{} | loss {loss:.4} | {rate:.0} img/s",
                        self.epoch_number,
                        self.total_steps
                    );
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::TrainOptions;

    #[test]
    fn sync_bn_with_a_global_batch_is_refused_on_a_gpu_only() {
        let settings = TrainOptions {
            sync_bn: true,
            global_batch_size: Some(64),
            batch_size: Some(16),
            ..TrainOptions::default()
        }
        .resolve()
        .unwrap();
        let plan = ShardPlan::new(64, 16, 640).unwrap();
        let gpu = Device::Cuda {
            ordinal: 0,
            reason: "requested".into(),
        };
        let cpu = Device::Cpu {
            reason: "requested".into(),
        };
        let error = check_shards_sync_bn(Some(&plan), &gpu, &settings).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("--sync-bn with --global-batch-size works on the CPU only for now"),
            "{error}"
        );
        assert!(check_shards_sync_bn(Some(&plan), &cpu, &settings).is_ok());
        assert!(check_shards_sync_bn(None, &gpu, &settings).is_ok());
    }
}
