//! `tandem predict`: a checkpoint on image files.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;
use tandem_models::Model;

use crate::checkpoint_info::{class_name, model_for, normalization_for};
use crate::evaluation::softmax;
use crate::model_args::ModelArgs;
use crate::settings::{available_cores, Rgb};
use crate::terminal::printable;
use crate::weights::read_checkpoint_info;

/// Settings of `tandem predict`.
#[derive(Args)]
pub struct PredictArgs {
    /// Weights to use: a Tandem checkpoint or snapshot, a PyTorch safetensors file, or a
    /// `torch.save` file. A Tandem checkpoint supplies its model, normalization and class
    /// names; flags override them. A local path, or an s3:// or obs:// URL.
    #[arg(long)]
    pub checkpoint: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub storage: crate::settings::StorageOptions,
    /// Per-channel mean used in training [default: the checkpoint's, else none].
    #[arg(long)]
    pub mean: Option<Rgb>,
    /// Per-channel standard deviation used in training [default: the checkpoint's, else none].
    #[arg(long)]
    pub std: Option<Rgb>,
    /// How many classes to list per image.
    #[arg(long, default_value_t = 3)]
    pub top: usize,
    /// Print one JSON object per image (with the raw logits) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Compute threads [default: the cores available].
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value = "auto", help = crate::device::DEVICE_HELP)]
    pub device: tandem_cuda::DeviceRequest,
    #[arg(long, value_enum, help = crate::math::PRECISION_HELP)]
    pub precision: Option<crate::math::PrecisionRequest>,
    /// Image files (PNG or JPEG, 32x32 RGB).
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
}

/// One class and its probability.
#[derive(Serialize)]
struct ClassProbability {
    class: usize,
    /// The class's name, when the checkpoint names its classes.
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    probability: f64,
}

/// What `--json` prints per image.
#[derive(Serialize)]
struct Prediction {
    file: String,
    logits: Vec<f32>,
    probabilities: Vec<f64>,
    top: Vec<ClassProbability>,
}

/// Runs `tandem predict`.
pub fn run(args: PredictArgs) -> anyhow::Result<()> {
    // Standard output carries the predictions alone, one line per image.
    let (device, math) = crate::device::select(
        args.device,
        args.precision,
        crate::math::Algorithms::Deterministic,
        crate::device::Announce::Stderr,
    )?;
    tandem_engine::set_threads(args.threads.unwrap_or_else(available_cores).max(1));
    let checkpoint = crate::remote::local_copy(&args.storage, &args.checkpoint)?;
    let info = read_checkpoint_info(&checkpoint)?;
    let spec = model_for(&args.model, info.as_ref(), &checkpoint)?;
    let (normalization, warning) = normalization_for(args.mean, args.std, info.as_ref())?;
    if let Some(warning) = warning {
        tell!("warning: {warning}");
    }
    let class_names = info.map(|info| info.class_names).unwrap_or_default();
    let mut model = Model::new(&spec)?;
    crate::weights::load_weights(&mut model, &checkpoint)?;
    let mut compute = crate::device::open_training_device(model, &device, math)?;
    for path in &args.images {
        let image = tandem_data::read_image(path)?;
        let mut pixels = image.pixels;
        if let Some((Rgb(mean), Rgb(std))) = normalization {
            for (index, value) in pixels.iter_mut().enumerate() {
                let channel = index % 3;
                *value = (*value - mean[channel]) / std[channel];
            }
        }
        let logits = compute
            .forward_eval(&pixels, 1, image.height, image.width)?
            .to_vec();
        let probabilities = softmax(&logits);
        let mut ranked: Vec<usize> = (0..probabilities.len()).collect();
        ranked.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
        let top: Vec<ClassProbability> = ranked
            .iter()
            .take(args.top.max(1))
            .map(|&class| ClassProbability {
                class,
                name: class_names.get(class).cloned(),
                probability: probabilities[class],
            })
            .collect();
        if args.json {
            let prediction = Prediction {
                file: path.display().to_string(),
                logits,
                probabilities,
                top,
            };
            say!("{}", serde_json::to_string(&prediction)?);
        } else {
            let listed: Vec<String> = top
                .iter()
                .map(|entry| {
                    let name = class_name(&class_names, entry.class);
                    format!("{name} ({:.3})", entry.probability)
                })
                .collect();
            let file = printable(&path.display().to_string());
            say!("{file}: {}", listed.join(", "));
        }
    }
    Ok(())
}
