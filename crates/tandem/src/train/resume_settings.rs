//! The settings a resumed run must share with its snapshot (the snapshot's fingerprint of
//! them), and the conflicts between the two said in the words of the flags.
//!
//! The fingerprint's values are the snapshot's format: they stay as they are written, so
//! that every snapshot written so far still resumes. Only the messages translate them.

use std::collections::BTreeMap;
use std::fmt::Debug;

use clap::ValueEnum;

use super::schedule::ScheduleKind;
use crate::model_args::value_name;
use crate::model_args::ModelArgs;
use crate::settings::{DataKind, OptimizerKind, TrainSettings};

/// The settings that decide a run's numbers, which a resumed run must share.
/// The number of processes is not among them: a run resumes on any number (see
/// [`crate::train::Trainer`]'s resume).
pub fn fingerprint(settings: &TrainSettings) -> BTreeMap<String, String> {
    let mut values = BTreeMap::new();
    let mut put = |key: &str, value: String| {
        values.insert(key.to_string(), value);
    };
    put("model", format!("{:?}", settings.model.to_spec().ok()));
    put("data", format!("{:?}", settings.data.data));
    put("batch-size", settings.batch_size.to_string());
    put("lr", settings.lr.to_string());
    put("optimizer", format!("{:?}", settings.optimizer));
    put("momentum", settings.momentum.to_string());
    put("nesterov", settings.nesterov.to_string());
    put("weight-decay", settings.weight_decay.to_string());
    put("betas", format!("{},{}", settings.beta1, settings.beta2));
    put("eps", settings.eps.to_string());
    put("lr-schedule", format!("{:?}", settings.lr_schedule));
    put("warmup-epochs", settings.warmup_epochs.to_string());
    put("label-smoothing", settings.label_smoothing.to_string());
    put("augment", settings.augment.to_string());
    put(
        "normalize",
        format!("{:?} {:?}", settings.data.mean, settings.data.std),
    );
    put("seed", settings.seed.to_string());
    let global_batch = settings
        .global_batch_size
        .map_or("per process".to_string(), |global| global.to_string());
    put("global-batch-size", global_batch);
    put("grad-accum", settings.grad_accum.to_string());
    put("sync-bn", settings.sync_bn.to_string());
    // More epochs continue a constant or step schedule as they would have run; the
    // curves of cosine and one-cycle depend on the total, so it must stay.
    match settings.lr_schedule {
        ScheduleKind::Constant => {}
        ScheduleKind::Step => {
            put("step-epochs", settings.step_epochs.to_string());
            put("gamma", settings.gamma.to_string());
        }
        ScheduleKind::Cosine | ScheduleKind::Onecycle => {
            put("epochs", settings.epochs.to_string());
        }
    }
    values
}

/// What the run knows beyond its fingerprint, to say a conflict in the user's words.
pub struct ResumeContext<'a> {
    /// The run's settings.
    pub settings: &'a TrainSettings,
    /// The model the snapshot's description records (complete settings), if it has one.
    pub snapshot_model: Option<&'a ModelArgs>,
}

/// Every setting that differs between the snapshot's fingerprint and this run's, each said
/// in the words of the flags; empty when the run may resume.
pub fn conflicts(
    snapshot: &BTreeMap<String, String>,
    current: &BTreeMap<String, String>,
    context: &ResumeContext<'_>,
) -> Vec<String> {
    current
        .iter()
        .filter_map(|(key, value)| match snapshot.get(key) {
            Some(saved) if saved != value => Some(describe(key, value, saved, context)),
            _ => None,
        })
        .collect()
}

/// One conflict: `--lr is 0.2, the snapshot has 0.05`.
fn describe(key: &str, value: &str, saved: &str, context: &ResumeContext<'_>) -> String {
    let settings = context.settings;
    match key {
        "model" => describe_model(&settings.model, context.snapshot_model),
        "data" => flag_conflict(
            "data",
            value_name(&settings.data.data),
            as_value::<DataKind>(saved),
        ),
        "optimizer" => flag_conflict(
            "optimizer",
            value_name(&settings.optimizer),
            as_value::<OptimizerKind>(saved),
        ),
        "lr-schedule" => flag_conflict(
            "lr-schedule",
            value_name(&settings.lr_schedule),
            as_value::<ScheduleKind>(saved),
        ),
        "betas" => describe_betas(settings, saved),
        "augment" if settings.augment => {
            "--no-augment is not given, but the snapshot's run had it".to_string()
        }
        "augment" => {
            "--no-augment is given, but the snapshot's run augmented its images".to_string()
        }
        "normalize" => format!(
            "{}, the snapshot has {}",
            normalization_flags(&format!("{:?} {:?}", settings.data.mean, settings.data.std)),
            normalization_flags(saved)
        ),
        "global-batch-size" => match (value, saved) {
            ("per process", _) => format!(
                "--global-batch-size is not given, but the snapshot's run had \
                 --global-batch-size {saved}"
            ),
            (_, "per process") => format!(
                "--global-batch-size is {value}, but the snapshot's run had per-process batches"
            ),
            _ => flag_conflict(key, value.to_string(), saved.to_string()),
        },
        "epochs" => format!(
            "--epochs is {value}, the snapshot has {saved}: the {} schedule's curve depends on \
             the number of epochs, so it cannot be raised on resume (a constant or step \
             schedule could)",
            value_name(&settings.lr_schedule)
        ),
        "nesterov" | "sync-bn" => match value {
            "true" => format!("--{key} is given, but the snapshot's run did without it"),
            _ => format!("--{key} is not given, but the snapshot's run had it"),
        },
        _ => flag_conflict(key, value.to_string(), saved.to_string()),
    }
}

/// `--flag is VALUE, the snapshot has SAVED`.
fn flag_conflict(flag: &str, value: String, saved: String) -> String {
    format!("--{flag} is {value}, the snapshot has {saved}")
}

/// The flag value of the variant of `T` whose `Debug` form the snapshot holds (its format),
/// or that form itself when no variant has it.
fn as_value<T: ValueEnum + Debug>(saved: &str) -> String {
    T::value_variants()
        .iter()
        .find(|variant| format!("{variant:?}") == saved)
        .map_or_else(|| saved.to_string(), value_name)
}

/// The model flags given that build another model than the snapshot's, with the snapshot's
/// model in full.
fn describe_model(given: &ModelArgs, recorded: Option<&ModelArgs>) -> String {
    let Some(recorded) = recorded else {
        return format!(
            "the model ({}) is not the snapshot's",
            model_flags_or_defaults(given)
        );
    };
    let contradictions = given.contradictions(recorded);
    let ours = match contradictions.is_empty() {
        true => format!("the model ({})", model_flags_or_defaults(given)),
        false => contradictions.join(" "),
    };
    format!(
        "{ours} builds another model than the snapshot's ({})",
        recorded.to_flags()
    )
}

/// The model flags given, or "the defaults" when none is.
fn model_flags_or_defaults(given: &ModelArgs) -> String {
    match given.to_flags() {
        flags if flags.is_empty() => "the default flags".to_string(),
        flags => flags,
    }
}

/// `--beta1` and `--beta2`, each where it differs.
fn describe_betas(settings: &TrainSettings, saved: &str) -> String {
    let (saved_beta1, saved_beta2) = saved.split_once(',').unwrap_or((saved, ""));
    let mut parts = Vec::new();
    if settings.beta1.to_string() != saved_beta1 {
        parts.push(flag_conflict(
            "beta1",
            settings.beta1.to_string(),
            saved_beta1.to_string(),
        ));
    }
    if settings.beta2.to_string() != saved_beta2 {
        parts.push(flag_conflict(
            "beta2",
            settings.beta2.to_string(),
            saved_beta2.to_string(),
        ));
    }
    parts.join("; ")
}

/// `--mean R,G,B --std R,G,B`, or `no --mean and --std`, from the fingerprint's form of the
/// normalization (`Some(Rgb([0.5, 0.5, 0.5])) Some(Rgb([...]))` or `None None`).
fn normalization_flags(fingerprint: &str) -> String {
    let values: Vec<String> = fingerprint
        .split('[')
        .skip(1)
        .filter_map(|part| part.split_once(']'))
        .map(|(list, _)| list.replace(' ', ""))
        .collect();
    match values.as_slice() {
        [mean, std] => format!("--mean {mean} --std {std}"),
        _ => "no --mean and --std".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::TrainOptions;

    fn settings_of(toml: &str) -> TrainSettings {
        TrainOptions::from_toml(toml).unwrap().resolve().unwrap()
    }

    #[test]
    fn conflicts_are_said_in_the_flags_words() {
        let saved = fingerprint(
            &settings_of("lr-schedule = \"onecycle\"\nepochs = 1\noptimizer = \"sgd\"\nbeta2 = 0.99\n[data]\nmean = [0.5, 0.5, 0.5]\nstd = [0.25, 0.25, 0.25]\n"),
        );
        let settings = settings_of(
            "lr-schedule = \"onecycle\"\nepochs = 3\nno-augment = true\nsync-bn = true\n[data]\ndata = \"cifar10-bin\"\n",
        );
        let context = ResumeContext {
            settings: &settings,
            snapshot_model: None,
        };
        let found = conflicts(&saved, &fingerprint(&settings), &context);
        assert_eq!(
            found,
            [
                "--no-augment is given, but the snapshot's run augmented its images",
                "--beta2 is 0.999, the snapshot has 0.99",
                "--data is cifar10-bin, the snapshot has synthetic",
                "--epochs is 3, the snapshot has 1: the onecycle schedule's curve depends on the \
                 number of epochs, so it cannot be raised on resume (a constant or step schedule \
                 could)",
                "no --mean and --std, the snapshot has --mean 0.5,0.5,0.5 --std 0.25,0.25,0.25",
                "--optimizer is adam, the snapshot has sgd",
                "--sync-bn is given, but the snapshot's run did without it",
            ]
        );
    }

    #[test]
    fn a_model_conflict_names_the_flags_given_and_the_snapshots_model() {
        let settings = settings_of("[model]\nn-blocks = [2, 2, 2]\n");
        let recorded = ModelArgs::from_spec(
            &settings_of("[model]\nn-blocks = [1, 1, 1]\n")
                .model
                .to_spec()
                .unwrap(),
        );
        assert_eq!(
            describe_model(&settings.model, Some(&recorded)),
            "--n-blocks 2,2,2 builds another model than the snapshot's (--model resnet-base \
             --n-blocks 1,1,1 --n-channels 16,32,64 --bottlenecks 8,16,16 --first-kernel-size 3 \
             --num-classes 10)"
        );
    }
}
