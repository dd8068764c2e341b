//! `tandem eval`: a checkpoint on a data set's test split.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::bail;
use clap::Args;
use serde::Serialize;
use tandem_models::Model;

use crate::checkpoint_info::{class_name, model_for, normalization_for, CheckpointInfo};
use crate::data_source::{load_split, normalization, Split};
use crate::evaluation::{evaluate, EvaluationReport};
use crate::model_args::value_name;
use crate::model_args::ModelArgs;
use crate::settings::{available_cores, DataKind, DataOptions, DataSettings};
use crate::terminal::printable;
use crate::weights::read_checkpoint_info;

/// Settings of `tandem eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// Weights to evaluate: a Tandem checkpoint or snapshot, a PyTorch safetensors file, or
    /// a `torch.save` file. A Tandem checkpoint supplies the model, data and normalization
    /// it was trained with; flags override them. A local path, or an s3:// or obs:// URL.
    #[arg(long)]
    pub checkpoint: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub data: DataOptions,
    #[command(flatten)]
    pub storage: crate::settings::StorageOptions,
    /// Images per forward pass.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Compute threads [default: the cores available].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seed of the synthetic data set (as given to `train`) [default: the checkpoint's, else 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[arg(long, default_value = "auto", help = crate::device::DEVICE_HELP)]
    pub device: tandem_cuda::DeviceRequest,
    #[arg(long, value_enum, help = crate::math::PRECISION_HELP)]
    pub precision: Option<crate::math::PrecisionRequest>,
}

/// Runs `tandem eval`.
pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.batch_size > 0, "--batch-size must be at least 1");
    let (device, math) = crate::device::select(
        args.device,
        args.precision,
        crate::math::Algorithms::Deterministic,
        crate::device::announce_for_json(args.json),
    )?;
    tandem_engine::set_threads(args.threads.unwrap_or_else(available_cores).max(1));
    let checkpoint = crate::remote::local_copy(&args.storage, &args.checkpoint)?;
    let info = read_checkpoint_info(&checkpoint)?;
    let spec = model_for(&args.model, info.as_ref(), &checkpoint)?;
    let mut data = data_for(&args.data, args.seed, info.as_ref(), &checkpoint)?;
    data.settings = crate::remote::local_data(&args.storage, data.settings)?;
    let mut model = Model::new(&spec)?;
    crate::weights::load_weights(&mut model, &checkpoint)?;
    let mut compute = crate::device::open_training_device(model, &device, math)?;
    for warning in &data.warnings {
        tell!("warning: {warning}");
    }
    let test_set = match (
        load_split(&data.settings, data.seed, Split::Test),
        &data.data_dir_hint,
    ) {
        (Ok(test_set), _) => test_set,
        (Err(error), Some(hint)) => return Err(error.context(hint.clone())),
        (Err(error), None) => return Err(error),
    };
    let test_set = Arc::new(test_set);
    let indices = (0..test_set.len()).collect();
    let evaluation = evaluate(
        &mut *compute,
        &test_set,
        false,
        indices,
        args.batch_size,
        normalization(&data.settings),
        1,
    )?;
    let report = evaluation.report();
    let class_names = match &info {
        Some(info) if !info.class_names.is_empty() => &info.class_names,
        _ => &test_set.class_names,
    };
    if args.json {
        say!(
            "{}",
            serde_json::to_string(&JsonReport::new(&report, class_names))?
        );
    } else {
        print!("{}", render_text(&report, class_names));
    }
    Ok(())
}

/// The data to evaluate on, and what the user should hear about it.
#[derive(Debug)]
struct EvalData {
    settings: DataSettings,
    /// Seed of the synthetic data set.
    seed: u64,
    /// Flags that differ from the checkpoint's description, in words.
    warnings: Vec<String>,
    /// When the data folder is the one the checkpoint names: what to say if it cannot be read.
    data_dir_hint: Option<String>,
}

/// The data the checkpoint was trained on, unless flags say otherwise. A flag that differs
/// from the checkpoint's description gives a warning; one that would evaluate real-data
/// weights on synthetic noise, or the other way round, is an error.
fn data_for(
    flags: &DataOptions,
    seed: Option<u64>,
    info: Option<&CheckpointInfo>,
    path: &Path,
) -> anyhow::Result<EvalData> {
    let mut warnings = Vec::new();
    let Some(info) = info else {
        if flags.data.is_none() {
            warnings.push(format!(
                "{} does not say what it was trained on (it has no Tandem metadata); evaluating on synthetic data: give --data and --data-dir",
                path.display()
            ));
        }
        return Ok(EvalData {
            settings: flags.resolve()?,
            seed: seed.unwrap_or(0),
            warnings,
            data_dir_hint: None,
        });
    };
    let trained = info.data.kind;
    let kind = flags.data.unwrap_or(trained);
    if kind != trained {
        let (kind_name, trained_name) = (value_name(&kind), value_name(&trained));
        if kind == DataKind::Synthetic || trained == DataKind::Synthetic {
            bail!(
                "--data {kind_name} contradicts {}, which was trained on {trained_name} (from its metadata): \
                 its accuracy on {kind_name} would mean nothing; leave --data out to evaluate on {trained_name}",
                path.display()
            );
        }
        warnings.push(format!(
            "--data {kind_name} differs from {trained_name}, which the checkpoint was trained on; evaluating on {kind_name}"
        ));
    }
    let mut options = flags.clone();
    options.data = Some(kind);
    let mut data_dir_hint = None;
    if kind == trained && flags.data_dir.is_none() {
        options.data_dir = Some(info.data.data_dir.clone());
        data_dir_hint = Some(format!(
            "{} was trained on {} from '{}', as given to train (relative to the folder it ran in); give --data-dir",
            path.display(),
            value_name(&trained),
            printable(&info.data.data_dir.display().to_string())
        ));
    }
    let (normalization, warning) = normalization_for(flags.mean, flags.std, Some(info))?;
    warnings.extend(warning);
    options.mean = normalization.map(|(mean, _)| mean);
    options.std = normalization.map(|(_, std)| std);
    let mut seed_used = seed.unwrap_or(0);
    if let (DataKind::Synthetic, Some((train, test, trained_seed))) = (kind, info.data.synthetic) {
        let recorded = [
            (
                "synthetic-train",
                flags.synthetic_train.map(|n| n as u64),
                train as u64,
            ),
            (
                "synthetic-test",
                flags.synthetic_test.map(|n| n as u64),
                test as u64,
            ),
            ("seed", seed, trained_seed),
        ];
        for (flag, given, trained) in recorded {
            if given.is_some_and(|given| given != trained) {
                warnings.push(format!(
                    "--{flag} {} differs from the checkpoint's synthetic data ({trained}): these are other images",
                    given.unwrap_or_default()
                ));
            }
        }
        options.synthetic_train = flags.synthetic_train.or(Some(train));
        options.synthetic_test = flags.synthetic_test.or(Some(test));
        seed_used = seed.unwrap_or(trained_seed);
    }
    Ok(EvalData {
        settings: options.resolve()?,
        seed: seed_used,
        warnings,
        data_dir_hint,
    })
}

/// What `eval --json` prints: the report, and each class's figures under its name.
#[derive(Serialize)]
struct JsonReport<'a> {
    #[serde(flatten)]
    report: &'a EvaluationReport,
    per_class: Vec<ClassResult>,
}

/// One class of the JSON report.
#[derive(Debug, PartialEq, Serialize)]
struct ClassResult {
    class: usize,
    /// The class's name, when the checkpoint or the data set names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    /// Test samples of this true class.
    samples: u64,
    accuracy: f64,
}

impl<'a> JsonReport<'a> {
    fn new(report: &'a EvaluationReport, class_names: &[String]) -> Self {
        let per_class = report
            .per_class_accuracy
            .iter()
            .zip(&report.confusion)
            .enumerate()
            .map(|(class, (&accuracy, row))| ClassResult {
                class,
                name: class_names.get(class).cloned(),
                samples: row.iter().sum(),
                accuracy,
            })
            .collect();
        JsonReport { report, per_class }
    }
}

/// The report as text: totals, per-class accuracy and the confusion matrix, whose rows
/// and columns are labelled with the class names (or numbers).
fn render_text(report: &EvaluationReport, class_names: &[String]) -> String {
    let labels: Vec<String> = (0..report.confusion.len())
        .map(|class| class_name(class_names, class))
        .collect();
    let mut text = format!(
        "samples: {}\nloss: {:.4}\naccuracy: {:.4}\n\nper-class accuracy:\n",
        report.samples, report.loss, report.accuracy
    );
    for (label, accuracy) in labels.iter().zip(&report.per_class_accuracy) {
        text.push_str(&format!("  {label:>12}: {accuracy:.4}\n"));
    }
    text.push_str("\nconfusion matrix (rows: true class, columns: predicted):\n");
    let widest = |texts: &mut dyn Iterator<Item = usize>| texts.max().unwrap_or(0);
    let row_label_width = widest(&mut labels.iter().map(|label| label.chars().count())).max(12);
    let cell_width = 1 + widest(
        &mut labels.iter().map(|label| label.chars().count()).chain(
            report
                .confusion
                .iter()
                .flatten()
                .map(|count| count.to_string().len()),
        ),
    )
    .max(5);
    let header: String = labels
        .iter()
        .map(|label| format!("{label:>cell_width$}"))
        .collect();
    text.push_str(&format!("  {:row_label_width$} {header}\n", ""));
    for (label, row) in labels.iter().zip(&report.confusion) {
        let cells: String = row
            .iter()
            .map(|count| format!("{count:>cell_width$}"))
            .collect();
        text.push_str(&format!("  {label:>row_label_width$} {cells}\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint_info::DataInfo;
    use crate::model_args::ModelArgs;
    use crate::settings::Rgb;

    fn trained_on(kind: DataKind, synthetic: Option<(usize, usize, u64)>) -> CheckpointInfo {
        CheckpointInfo {
            tandem_version: "0.1.0".into(),
            model: ModelArgs::from_spec(&tandem_models::ModelSpec::ResNet18 { num_classes: 10 }),
            class_names: Vec::new(),
            normalization: Some((Rgb([0.5; 3]), Rgb([0.25; 3]))),
            data: DataInfo {
                kind,
                data_dir: PathBuf::from("cifar"),
                synthetic,
            },
            epoch: None,
            step: 0,
        }
    }

    #[test]
    fn the_checkpoints_data_unless_flags_say_otherwise() {
        let path = Path::new("epoch_1.safetensors");
        let info = trained_on(DataKind::Cifar10Bin, None);
        let data = data_for(&DataOptions::default(), None, Some(&info), path).unwrap();
        assert_eq!(data.settings.data, DataKind::Cifar10Bin);
        assert_eq!(data.settings.data_dir, PathBuf::from("cifar"));
        assert_eq!(data.settings.mean, Some(Rgb([0.5; 3])));
        assert!(data.warnings.is_empty());
        assert!(data.data_dir_hint.unwrap().contains("give --data-dir"));

        let other_real = DataOptions {
            data: Some(DataKind::JsonFolder),
            ..DataOptions::default()
        };
        let data = data_for(&other_real, None, Some(&info), path).unwrap();
        assert_eq!(data.settings.data_dir, PathBuf::from("data"));
        assert_eq!(
            data.warnings,
            vec!["--data json-folder differs from cifar10-bin, which the checkpoint was trained on; evaluating on json-folder"]
        );

        let synthetic = trained_on(DataKind::Synthetic, Some((192, 64, 7)));
        let data = data_for(&DataOptions::default(), None, Some(&synthetic), path).unwrap();
        assert_eq!(
            (
                data.seed,
                data.settings.synthetic_train,
                data.settings.synthetic_test
            ),
            (7, 192, 64)
        );
        let data = data_for(&DataOptions::default(), Some(3), Some(&synthetic), path).unwrap();
        assert_eq!(data.seed, 3);
        assert_eq!(
            data.warnings,
            vec![
                "--seed 3 differs from the checkpoint's synthetic data (7): these are other images"
            ]
        );
        let error = data_for(&other_real, None, Some(&synthetic), path).unwrap_err();
        assert!(error.to_string().starts_with("--data json-folder contradicts epoch_1.safetensors, which was trained on synthetic"), "{error}");

        let data = data_for(&DataOptions::default(), None, None, path).unwrap();
        assert_eq!(data.settings.data, DataKind::Synthetic);
        assert!(data.warnings[0].contains("does not say what it was trained on"));
    }

    fn three_class_report() -> EvaluationReport {
        EvaluationReport {
            samples: 12,
            loss: 0.5,
            accuracy: 0.75,
            per_class_accuracy: vec![1.0, 0.5, 0.75],
            confusion: vec![vec![4, 0, 0], vec![1, 2, 1], vec![0, 1, 3]],
        }
    }

    #[test]
    fn the_confusion_matrix_labels_its_columns_as_its_rows() {
        // The lines after `header` in the report with class `names`.
        let matrix = |names: &[String], header: &str| -> Vec<String> {
            let text = render_text(&three_class_report(), names);
            let after = text.split(header).nth(1).unwrap();
            after.lines().map(String::from).collect()
        };
        let names: Vec<String> = ["cat", "automobile", "dog"].map(String::from).into();
        assert_eq!(
            matrix(&names, "columns: predicted):\n"),
            [
                "                       cat automobile        dog",
                "           cat           4          0          0",
                "    automobile           1          2          1",
                "           dog           0          1          3",
            ]
        );
        // Without names, numbers label both.
        let numbered = [
            "                    0     1     2",
            "             0      4     0     0",
            "             1      1     2     1",
            "             2      0     1     3",
        ];
        assert_eq!(matrix(&[], "predicted):\n"), numbered);
    }

    #[test]
    fn the_json_report_names_each_class() {
        let report = three_class_report();
        let names: Vec<String> = ["cat", "automobile"].map(String::from).into();
        let json = serde_json::to_value(JsonReport::new(&report, &names)).unwrap();
        assert_eq!(
            json["per_class"],
            serde_json::json!([
                {"class": 0, "name": "cat", "samples": 4, "accuracy": 1.0},
                {"class": 1, "name": "automobile", "samples": 4, "accuracy": 0.5},
                {"class": 2, "samples": 4, "accuracy": 0.75},
            ])
        );
        assert_eq!(
            json["per_class_accuracy"],
            serde_json::json!([1.0, 0.5, 0.75])
        );
        assert_eq!(json["samples"], 12);
        assert_eq!(json["confusion"][1], serde_json::json!([1, 2, 1]));
    }
}
