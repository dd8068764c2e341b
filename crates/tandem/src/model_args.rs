//! The model flags shared by `train`, `eval`, `predict` and `bench step`, and in a
//! `--config` file.

use anyhow::bail;
use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_models::{ModelSpec, ResNetBaseSpec};

/// The model architectures `tandem` can build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// Seed 000's ResNet-18 for 32x32 images.
    Resnet18,
    /// Seed 004's configurable (bottleneck) ResNet plus a linear classifier.
    ResnetBase,
}

/// Which model to build; each flag is optional so that flags and a config file merge. A list
/// flag given twice takes the last list, as every other flag takes its last value.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelArgs {
    /// Model architecture [default: resnet-base].
    #[arg(long, value_enum)]
    pub model: Option<ModelKind>,
    /// resnet-base: residual blocks per stage [default: 6,6,6].
    #[arg(long, value_delimiter = ',', action = clap::ArgAction::Set)]
    pub n_blocks: Option<Vec<usize>>,
    /// resnet-base: channels per stage [default: 16,32,64].
    #[arg(long, value_delimiter = ',', action = clap::ArgAction::Set)]
    pub n_channels: Option<Vec<usize>>,
    /// resnet-base: bottleneck channels per stage, or `none` for plain residual blocks
    /// [default: 8,16,16].
    #[arg(long)]
    pub bottlenecks: Option<String>,
    /// resnet-base: kernel size of the first convolution [default: 3].
    #[arg(long)]
    pub first_kernel_size: Option<usize>,
    /// Number of classes [default: 10].
    #[arg(long)]
    pub num_classes: Option<usize>,
}

impl ModelArgs {
    /// The model the flags describe, with the tutorial's defaults for what is not given.
    pub fn to_spec(&self) -> anyhow::Result<ModelSpec> {
        let num_classes = self.num_classes.unwrap_or(10);
        let spec = match self.model.unwrap_or(ModelKind::ResnetBase) {
            ModelKind::Resnet18 => {
                if self.n_blocks.is_some()
                    || self.n_channels.is_some()
                    || self.bottlenecks.is_some()
                    || self.first_kernel_size.is_some()
                {
                    bail!("--n-blocks, --n-channels, --bottlenecks and --first-kernel-size apply to --model resnet-base only");
                }
                ModelSpec::ResNet18 { num_classes }
            }
            ModelKind::ResnetBase => {
                let defaults = ResNetBaseSpec::tutorial_default();
                ModelSpec::ResNetBase(ResNetBaseSpec {
                    n_blocks: self.n_blocks.clone().unwrap_or(defaults.n_blocks),
                    n_channels: self.n_channels.clone().unwrap_or(defaults.n_channels),
                    bottlenecks: match &self.bottlenecks {
                        None => defaults.bottlenecks,
                        Some(text) => parse_bottlenecks(text)?,
                    },
                    first_kernel_size: self.first_kernel_size.unwrap_or(defaults.first_kernel_size),
                    img_channels: defaults.img_channels,
                    num_classes,
                })
            }
        };
        spec.validate()?;
        Ok(spec)
    }
}

impl ModelArgs {
    /// The flags that build `spec`, every setting of its kind filled in.
    pub fn from_spec(spec: &ModelSpec) -> ModelArgs {
        match spec {
            ModelSpec::ResNet18 { num_classes } => ModelArgs {
                model: Some(ModelKind::Resnet18),
                num_classes: Some(*num_classes),
                ..ModelArgs::default()
            },
            ModelSpec::ResNetBase(spec) => ModelArgs {
                model: Some(ModelKind::ResnetBase),
                n_blocks: Some(spec.n_blocks.clone()),
                n_channels: Some(spec.n_channels.clone()),
                bottlenecks: Some(match &spec.bottlenecks {
                    Some(channels) => comma_list(channels),
                    None => "none".into(),
                }),
                first_kernel_size: Some(spec.first_kernel_size),
                num_classes: Some(spec.num_classes),
            },
        }
    }

    /// The settings given, as (flag name without `--`, value) pairs in the flags' order.
    pub fn flag_values(&self) -> Vec<(&'static str, String)> {
        let model = self.model.map(|kind| value_name(&kind));
        [
            ("model", model),
            ("n-blocks", self.n_blocks.as_deref().map(comma_list)),
            ("n-channels", self.n_channels.as_deref().map(comma_list)),
            ("bottlenecks", self.bottlenecks.clone()),
            (
                "first-kernel-size",
                self.first_kernel_size.map(|k| k.to_string()),
            ),
            ("num-classes", self.num_classes.map(|n| n.to_string())),
        ]
        .into_iter()
        .filter_map(|(flag, value)| value.map(|value| (flag, value)))
        .collect()
    }

    /// The settings given, as a command line: `--model resnet-base --n-blocks 6,6,6 ...`.
    pub fn to_flags(&self) -> String {
        self.flag_values()
            .into_iter()
            .map(|(flag, value)| format!("--{flag} {value}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The flags given here that build something other than `recorded` (a checkpoint's
    /// complete settings), each as `--flag value`.
    pub fn contradictions(&self, recorded: &ModelArgs) -> Vec<String> {
        let recorded_bottlenecks = recorded
            .bottlenecks
            .as_deref()
            .map(parse_bottlenecks)
            .and_then(Result::ok);
        let differs = |flag: &str| match flag {
            "model" => self.model != recorded.model,
            "n-blocks" => self.n_blocks != recorded.n_blocks,
            "n-channels" => self.n_channels != recorded.n_channels,
            "bottlenecks" => {
                let given = self.bottlenecks.as_deref().map(parse_bottlenecks);
                !matches!((given, &recorded_bottlenecks), (Some(Ok(given)), Some(recorded)) if given == *recorded)
            }
            "first-kernel-size" => self.first_kernel_size != recorded.first_kernel_size,
            _ => self.num_classes != recorded.num_classes,
        };
        self.flag_values()
            .into_iter()
            .filter(|(flag, _)| differs(flag))
            .map(|(flag, value)| format!("--{flag} {value}"))
            .collect()
    }
}

/// `6,6,6`.
fn comma_list(values: &[usize]) -> String {
    values
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// `none` or a comma list of channel counts.
fn parse_bottlenecks(text: &str) -> anyhow::Result<Option<Vec<usize>>> {
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let channels = text
        .split(',')
        .map(|part| part.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| {
            anyhow::anyhow!("--bottlenecks must be 'none' or a list like 8,16,16, got '{text}'")
        })?;
    Ok(Some(channels))
}

/// The command-line spelling of a value of a `clap::ValueEnum`.
pub fn value_name<T: clap::ValueEnum>(value: &T) -> String {
    value
        .to_possible_value()
        .map(|value| value.get_name().to_string())
        .unwrap_or_default()
}

/// The title of `curves.png`: the run folder (as the user gave it) and the model, as
/// `--model` names it.
pub fn curves_title(run_folder: &str, spec: &ModelSpec) -> String {
    let model = ModelArgs::from_spec(spec)
        .model
        .map(|kind| value_name(&kind))
        .unwrap_or_default();
    format!("{run_folder} | {model}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_tutorials_config() {
        let spec = ModelArgs::default().to_spec().unwrap();
        assert_eq!(
            spec,
            ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())
        );
    }

    #[test]
    fn flags_of_a_spec_build_it_and_contradictions_are_named() {
        let specs = [
            ModelSpec::ResNet18 { num_classes: 7 },
            ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default()),
        ];
        for spec in &specs {
            assert_eq!(ModelArgs::from_spec(spec).to_spec().unwrap(), *spec);
        }
        let recorded = ModelArgs::from_spec(&specs[1]);
        assert_eq!(
            recorded.to_flags(),
            "--model resnet-base --n-blocks 6,6,6 --n-channels 16,32,64 --bottlenecks 8,16,16 --first-kernel-size 3 --num-classes 10"
        );
        let given = ModelArgs {
            n_blocks: Some(vec![1, 1, 1]),
            bottlenecks: Some(" 8, 16,16".into()),
            num_classes: Some(10),
            ..ModelArgs::default()
        };
        assert_eq!(given.contradictions(&recorded), vec!["--n-blocks 1,1,1"]);
        let other_kind = ModelArgs {
            model: Some(ModelKind::Resnet18),
            ..ModelArgs::default()
        };
        assert_eq!(
            other_kind.contradictions(&recorded),
            vec!["--model resnet18"]
        );
        assert!(ModelArgs::default().contradictions(&recorded).is_empty());
    }

    #[test]
    fn plain_blocks_and_errors() {
        let args = ModelArgs {
            bottlenecks: Some("none".into()),
            n_blocks: Some(vec![1, 2]),
            n_channels: Some(vec![8, 16]),
            ..ModelArgs::default()
        };
        let ModelSpec::ResNetBase(spec) = args.to_spec().unwrap() else {
            panic!("expected resnet-base");
        };
        assert_eq!(spec.bottlenecks, None);
        assert_eq!(spec.n_blocks, vec![1, 2]);
        let bad = ModelArgs {
            bottlenecks: Some("8,x".into()),
            ..ModelArgs::default()
        };
        let error = bad.to_spec().unwrap_err().to_string();
        assert!(error.contains("--bottlenecks must be 'none'"), "{error}");
        let mismatched = ModelArgs {
            n_blocks: Some(vec![1, 1]),
            ..ModelArgs::default()
        };
        let error = format!("{:#}", mismatched.to_spec().unwrap_err());
        assert!(error.contains("n_channels"), "{error}");
        let resnet18 = ModelArgs {
            model: Some(ModelKind::Resnet18),
            n_blocks: Some(vec![1]),
            ..ModelArgs::default()
        };
        assert!(resnet18.to_spec().is_err());
    }

    #[test]
    fn the_curves_are_titled_with_the_run_folder_and_model() {
        assert_eq!(
            curves_title("runs/demo", &ModelSpec::ResNet18 { num_classes: 10 }),
            "runs/demo | resnet18"
        );
        let base = ModelSpec::ResNetBase(tandem_models::ResNetBaseSpec::tutorial_default());
        assert_eq!(
            curves_title("s3://runs/a", &base),
            "s3://runs/a | resnet-base"
        );
    }
}
