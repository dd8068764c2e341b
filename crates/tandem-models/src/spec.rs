//! Which model to build, with the settings of the tutorials' code.

use crate::error::ModelError;

/// A model architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSpec {
    /// Seed 000's ResNet-18 for 32x32 images (3 input channels).
    ResNet18 {
        /// Number of output classes.
        num_classes: usize,
    },
    /// Seed 004's `ResNetBase` followed by a linear classifier.
    ResNetBase(ResNetBaseSpec),
}

/// Settings of seed 004's `ResNetBase` + `nn.Linear(n_channels[-1], num_classes)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResNetBaseSpec {
    /// Residual blocks per stage.
    pub n_blocks: Vec<usize>,
    /// Output channels per stage.
    pub n_channels: Vec<usize>,
    /// Bottleneck channels per stage; `None` builds plain two-conv residual blocks.
    pub bottlenecks: Option<Vec<usize>>,
    /// Kernel size of the stem convolution (stride 2, padding `k / 2`).
    pub first_kernel_size: usize,
    /// Channels of the input images.
    pub img_channels: usize,
    /// Number of output classes.
    pub num_classes: usize,
}

impl ResNetBaseSpec {
    /// Seed 004's `Config`: blocks `[6, 6, 6]`, channels `[16, 32, 64]`, bottlenecks
    /// `[8, 16, 16]`, first kernel 3, RGB input, 10 classes.
    pub fn tutorial_default() -> Self {
        ResNetBaseSpec {
            n_blocks: vec![6, 6, 6],
            n_channels: vec![16, 32, 64],
            bottlenecks: Some(vec![8, 16, 16]),
            first_kernel_size: 3,
            img_channels: 3,
            num_classes: 10,
        }
    }

    /// Checks the settings, naming the first invalid field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let invalid = |field, reason: String| Err(ModelError::InvalidSpec { field, reason });
        if self.n_blocks.is_empty() {
            return invalid("n_blocks", "needs at least one stage".into());
        }
        if self.n_channels.len() != self.n_blocks.len() {
            return invalid(
                "n_channels",
                format!(
                    "has {} entries, n_blocks has {}",
                    self.n_channels.len(),
                    self.n_blocks.len()
                ),
            );
        }
        if let Some(stage) = self.n_blocks.iter().position(|&n| n == 0) {
            return invalid(
                "n_blocks",
                format!("stage {stage} has 0 blocks, needs at least 1"),
            );
        }
        if let Some(stage) = self.n_channels.iter().position(|&n| n == 0) {
            return invalid("n_channels", format!("stage {stage} has 0 channels"));
        }
        if let Some(bottlenecks) = &self.bottlenecks {
            if bottlenecks.len() != self.n_channels.len() {
                return invalid(
                    "bottlenecks",
                    format!(
                        "has {} entries, n_channels has {}",
                        bottlenecks.len(),
                        self.n_channels.len()
                    ),
                );
            }
            if let Some(stage) = bottlenecks.iter().position(|&n| n == 0) {
                return invalid("bottlenecks", format!("stage {stage} has 0 channels"));
            }
        }
        if self.first_kernel_size == 0 {
            return invalid("first_kernel_size", "must be at least 1".into());
        }
        if self.img_channels == 0 {
            return invalid("img_channels", "must be at least 1".into());
        }
        if self.num_classes == 0 {
            return invalid("num_classes", "must be at least 1".into());
        }
        Ok(())
    }
}

impl ModelSpec {
    /// Checks the settings, naming the first invalid field.
    pub fn validate(&self) -> Result<(), ModelError> {
        match self {
            ModelSpec::ResNet18 { num_classes: 0 } => Err(ModelError::InvalidSpec {
                field: "num_classes",
                reason: "must be at least 1".into(),
            }),
            ModelSpec::ResNet18 { .. } => Ok(()),
            ModelSpec::ResNetBase(spec) => spec.validate(),
        }
    }

    /// Channels of the input images.
    pub fn img_channels(&self) -> usize {
        match self {
            ModelSpec::ResNet18 { .. } => 3,
            ModelSpec::ResNetBase(spec) => spec.img_channels,
        }
    }

    /// Number of output classes.
    pub fn num_classes(&self) -> usize {
        match self {
            ModelSpec::ResNet18 { num_classes } => *num_classes,
            ModelSpec::ResNetBase(spec) => spec.num_classes,
        }
    }
}
