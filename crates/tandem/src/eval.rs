//! `tandem eval`: a checkpoint on a data set's test split.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use tandem_models::Model;

use crate::data_source::{load_split, normalization, Split};
use crate::evaluation::{evaluate, EvaluationReport};
use crate::model_args::ModelArgs;
use crate::settings::{available_cores, DataOptions};

/// Settings of `tandem eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// Weights to evaluate: a Tandem or PyTorch safetensors file, or a `torch.save` file.
    #[arg(long)]
    pub checkpoint: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub data: DataOptions,
    /// Images per forward pass.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Compute threads [default: the cores available].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seed of the synthetic data set (as given to `train`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[arg(long, default_value = "auto", help = crate::device::DEVICE_HELP)]
    pub device: tandem_cuda::DeviceRequest,
}

/// Runs `tandem eval`.
pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.batch_size > 0, "--batch-size must be at least 1");
    crate::device::select(args.device, crate::device::announce_for_json(args.json))?;
    tandem_engine::set_threads(args.threads.unwrap_or_else(available_cores).max(1));
    let data = args.data.resolve()?;
    let mut model = Model::new(&args.model.to_spec()?)?;
    crate::weights::load_weights(&mut model, &args.checkpoint)?;
    let test_set = Arc::new(load_split(&data, args.seed, Split::Test)?);
    let indices = (0..test_set.len()).collect();
    let evaluation = evaluate(
        &mut model,
        &test_set,
        indices,
        args.batch_size,
        normalization(&data),
        1,
    )?;
    let report = evaluation.report();
    if args.json {
        say!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", render_text(&report, &test_set.class_names));
    }
    Ok(())
}

/// The report as text: totals, per-class accuracy and the confusion matrix.
fn render_text(report: &EvaluationReport, class_names: &[String]) -> String {
    let name = |class: usize| {
        class_names
            .get(class)
            .cloned()
            .unwrap_or_else(|| class.to_string())
    };
    let mut text = format!(
        "samples: {}\nloss: {:.4}\naccuracy: {:.4}\n\nper-class accuracy:\n",
        report.samples, report.loss, report.accuracy
    );
    for (class, accuracy) in report.per_class_accuracy.iter().enumerate() {
        text.push_str(&format!("  {:>12}: {accuracy:.4}\n", name(class)));
    }
    text.push_str("\nconfusion matrix (rows: true class, columns: predicted):\n");
    for (class, row) in report.confusion.iter().enumerate() {
        let cells: Vec<String> = row.iter().map(|count| format!("{count:>6}")).collect();
        text.push_str(&format!("  {:>12} {}\n", name(class), cells.join("")));
    }
    text
}
