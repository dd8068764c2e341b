//! `tandem predict`: a checkpoint on image files.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;
use tandem_models::Model;

use crate::evaluation::softmax;
use crate::model_args::ModelArgs;
use crate::settings::{available_cores, Rgb};

/// Settings of `tandem predict`.
#[derive(Args)]
pub struct PredictArgs {
    /// Weights to use: a Tandem or PyTorch safetensors file, or a `torch.save` file.
    #[arg(long)]
    pub checkpoint: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Per-channel mean used in training.
    #[arg(long)]
    pub mean: Option<Rgb>,
    /// Per-channel standard deviation used in training.
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
    /// Image files (PNG or JPEG, 32x32 RGB).
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
}

/// One class and its probability.
#[derive(Serialize)]
struct ClassProbability {
    class: usize,
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
    anyhow::ensure!(
        args.mean.is_some() == args.std.is_some(),
        "--mean and --std must be given together"
    );
    crate::device::select(args.device, crate::device::announce_for_json(args.json))?;
    tandem_engine::set_threads(args.threads.unwrap_or_else(available_cores).max(1));
    let mut model = Model::new(&args.model.to_spec()?)?;
    crate::weights::load_weights(&mut model, &args.checkpoint)?;
    for path in &args.images {
        let image = tandem_data::read_image(path)?;
        let mut pixels = image.pixels;
        if let (Some(Rgb(mean)), Some(Rgb(std))) = (args.mean, args.std) {
            for (index, value) in pixels.iter_mut().enumerate() {
                let channel = index % 3;
                *value = (*value - mean[channel]) / std[channel];
            }
        }
        let logits = model
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
                probability: probabilities[class],
            })
            .collect();
        let file = path.display().to_string();
        if args.json {
            let prediction = Prediction {
                file,
                logits,
                probabilities,
                top,
            };
            say!("{}", serde_json::to_string(&prediction)?);
        } else {
            let listed: Vec<String> = top
                .iter()
                .map(|entry| format!("{} ({:.3})", entry.class, entry.probability))
                .collect();
            say!("{file}: {}", listed.join(", "));
        }
    }
    Ok(())
}
