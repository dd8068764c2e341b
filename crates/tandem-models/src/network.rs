//! The layer structure of both models, the `state_dict` table and the flat-buffer layout.

use std::ops::Range;

use crate::spec::{ModelSpec, ResNetBaseSpec};
use crate::tensors::{StorageLayout, TensorInfo, TensorKind};

/// A convolution and where its parameters live in the flat parameter buffer.
#[derive(Clone, Debug)]
pub struct ConvLayer {
    /// The `state_dict` prefix (e.g. `conv1.0`).
    pub name: String,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel height and width.
    pub kernel: usize,
    /// Stride on both axes.
    pub stride: usize,
    /// Zero padding on each side.
    pub padding: usize,
    /// Whether the layer has a bias.
    pub has_bias: bool,
    /// The weight, OHWI, in the flat parameters.
    pub weight: Range<usize>,
    /// The bias in the flat parameters, right after the weight.
    pub bias: Option<Range<usize>>,
}

impl ConvLayer {
    fn new(
        name: String,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        has_bias: bool,
    ) -> Self {
        ConvLayer {
            name,
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            has_bias,
            weight: 0..0,
            bias: None,
        }
    }

    /// Fan-in for PyTorch's default init: `in_channels * kernel * kernel`.
    pub fn fan_in(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    /// The parameter range of weight and bias together (they are allocated adjacently).
    pub fn param_range(&self) -> Range<usize> {
        self.weight.start..self.bias.as_ref().map_or(self.weight.end, |bias| bias.end)
    }
}

/// A batch norm layer and its parameter and running-statistic ranges. Its per-step state
/// (the batch statistics) lives in the workspace, so the network stays immutable in a step.
#[derive(Clone, Debug)]
pub struct BatchNormLayer {
    /// The `state_dict` prefix (e.g. `conv1.1`).
    pub name: String,
    /// Channels.
    pub channels: usize,
    /// `weight` (gamma) in the flat parameters.
    pub weight: Range<usize>,
    /// `bias` (beta) in the flat parameters, right after the weight.
    pub bias: Range<usize>,
    /// `running_mean` in the flat running-statistics buffer.
    pub running_mean: Range<usize>,
    /// `running_var` in the flat running-statistics buffer.
    pub running_var: Range<usize>,
}

impl BatchNormLayer {
    fn new(name: String, channels: usize) -> Self {
        BatchNormLayer {
            name,
            channels,
            weight: 0..0,
            bias: 0..0,
            running_mean: 0..0,
            running_var: 0..0,
        }
    }

    /// The parameter range of weight and bias together.
    pub fn param_range(&self) -> Range<usize> {
        self.weight.start..self.bias.end
    }
}

/// A convolution followed by batch norm.
pub(crate) struct ConvBn {
    pub conv: ConvLayer,
    pub bn: BatchNormLayer,
}

impl ConvBn {
    fn new(conv: ConvLayer, bn_name: String) -> Self {
        let channels = conv.out_channels;
        ConvBn {
            conv,
            bn: BatchNormLayer::new(bn_name, channels),
        }
    }
}

/// A residual block: `relu(chain(x) + shortcut(x))`, where the chain is conv-bn units with
/// ReLU between them and the shortcut is the identity or a conv-bn projection.
pub(crate) struct Block {
    pub units: Vec<ConvBn>,
    pub shortcut: Option<ConvBn>,
}

impl Block {
    /// A block of `units` (at least one) with the shortcut their shapes call for: the
    /// identity where they keep the channels and the size, else a 1x1 conv-bn projection
    /// named `conv_name` and `bn_name`, with a bias where the units' convolutions have one.
    fn new(units: Vec<ConvBn>, conv_name: String, bn_name: String) -> Self {
        let first = &units[0].conv;
        let in_channels = first.in_channels;
        let out_channels = Block::out_channels(&units);
        let stride: usize = units.iter().map(|unit| unit.conv.stride).product();
        let shortcut = (stride != 1 || in_channels != out_channels).then(|| {
            let conv = ConvLayer::new(
                conv_name,
                in_channels,
                out_channels,
                1,
                stride,
                0,
                first.has_bias,
            );
            ConvBn::new(conv, bn_name)
        });
        Block { units, shortcut }
    }

    /// The output channels of a chain of `units`: those of its last convolution.
    fn out_channels(units: &[ConvBn]) -> usize {
        units.last().map_or(0, |unit| unit.conv.out_channels)
    }
}

/// The linear classifier (after global average pooling).
#[derive(Clone, Debug)]
pub struct Head {
    /// The `state_dict` prefix (e.g. `dense_layer`).
    pub name: String,
    /// Input features (the last block's channels).
    pub in_features: usize,
    /// Output classes.
    pub classes: usize,
    /// The weight `[classes, in_features]` in the flat parameters.
    pub weight: Range<usize>,
    /// The bias in the flat parameters, right after the weight.
    pub bias: Range<usize>,
}

/// The whole network: stem, residual blocks, global average pooling and classifier.
pub(crate) struct Network {
    pub stem: ConvBn,
    pub stem_relu: bool,
    pub blocks: Vec<Block>,
    pub head: Head,
}

/// The flat-buffer sizes and the `state_dict` table of a network.
pub(crate) struct Layout {
    pub params_len: usize,
    pub buffers_len: usize,
    pub tensors: Vec<TensorInfo>,
}

impl Network {
    /// A network of `stem` (followed by ReLU where `stem_relu`), `blocks`, and a classifier
    /// named `head_name` from the last block's channels into `classes`.
    fn new(
        stem: ConvBn,
        stem_relu: bool,
        blocks: Vec<Block>,
        head_name: &str,
        classes: usize,
    ) -> Self {
        let in_features = blocks.last().map_or(stem.conv.out_channels, |block| {
            Block::out_channels(&block.units)
        });
        let head = Head {
            name: head_name.into(),
            in_features,
            classes,
            weight: 0..0,
            bias: 0..0,
        };
        Network {
            stem,
            stem_relu,
            blocks,
            head,
        }
    }

    /// Builds the structure for `spec` (assumed valid) and lays out its buffers.
    pub fn build(spec: &ModelSpec) -> (Network, Layout) {
        let mut network = match spec {
            ModelSpec::ResNet18 { num_classes } => resnet18(*num_classes),
            ModelSpec::ResNetBase(spec) => resnet_base(spec),
        };
        let params_len = network.allocate_params();
        let (tensors, buffers_len) = network.state_dict_table();
        (
            network,
            Layout {
                params_len,
                buffers_len,
                tensors,
            },
        )
    }

    /// Every conv-bn pair in forward (state_dict) order.
    pub fn conv_bns(&self) -> impl Iterator<Item = &ConvBn> {
        std::iter::once(&self.stem).chain(
            self.blocks
                .iter()
                .flat_map(|block| block.units.iter().chain(&block.shortcut)),
        )
    }

    /// Every conv-bn pair in the order a training forward computes their batch statistics:
    /// the stem, then each block's shortcut before its units.
    pub fn conv_bns_in_statistics_order(&self) -> impl Iterator<Item = &ConvBn> {
        std::iter::once(&self.stem).chain(
            self.blocks
                .iter()
                .flat_map(|block| block.shortcut.iter().chain(&block.units)),
        )
    }

    /// Gives every parameter its range, in the order the backward pass finishes gradients:
    /// classifier, then blocks from last to first (shortcut, then units from last to first,
    /// batch norm before convolution), then the stem.
    fn allocate_params(&mut self) -> usize {
        let mut next = 0;
        let mut take = |len: usize| {
            let range = next..next + len;
            next += len;
            range
        };
        self.head.weight = take(self.head.classes * self.head.in_features);
        self.head.bias = take(self.head.classes);
        let allocate_conv_bn = |unit: &mut ConvBn, take: &mut dyn FnMut(usize) -> Range<usize>| {
            unit.bn.weight = take(unit.bn.channels);
            unit.bn.bias = take(unit.bn.channels);
            let conv = &mut unit.conv;
            conv.weight = take(conv.out_channels * conv.fan_in());
            conv.bias = conv.has_bias.then(|| take(conv.out_channels));
        };
        for block in self.blocks.iter_mut().rev() {
            if let Some(shortcut) = &mut block.shortcut {
                allocate_conv_bn(shortcut, &mut take);
            }
            for unit in block.units.iter_mut().rev() {
                allocate_conv_bn(unit, &mut take);
            }
        }
        allocate_conv_bn(&mut self.stem, &mut take);
        next
    }

    /// The `state_dict` entries in PyTorch order; also gives running statistics their ranges.
    fn state_dict_table(&mut self) -> (Vec<TensorInfo>, usize) {
        let mut tensors = Vec::new();
        let mut buffers_len = 0;
        let mut add_conv_bn = |unit: &mut ConvBn, tensors: &mut Vec<TensorInfo>| {
            let conv = &unit.conv;
            let weight_shape = vec![
                conv.out_channels,
                conv.in_channels,
                conv.kernel,
                conv.kernel,
            ];
            tensors.push(param(
                format!("{}.weight", conv.name),
                weight_shape,
                &conv.weight,
                StorageLayout::ConvOhwi,
            ));
            if let Some(bias) = &conv.bias {
                tensors.push(param(
                    format!("{}.bias", conv.name),
                    vec![conv.out_channels],
                    bias,
                    StorageLayout::Plain,
                ));
            }
            let bn = &mut unit.bn;
            let channels = bn.channels;
            tensors.push(param(
                format!("{}.weight", bn.name),
                vec![channels],
                &bn.weight,
                StorageLayout::Plain,
            ));
            tensors.push(param(
                format!("{}.bias", bn.name),
                vec![channels],
                &bn.bias,
                StorageLayout::Plain,
            ));
            bn.running_mean = buffers_len..buffers_len + channels;
            bn.running_var = buffers_len + channels..buffers_len + 2 * channels;
            buffers_len += 2 * channels;
            for (suffix, range) in [
                ("running_mean", &bn.running_mean),
                ("running_var", &bn.running_var),
            ] {
                tensors.push(TensorInfo {
                    name: format!("{}.{suffix}", bn.name),
                    shape: vec![channels],
                    kind: TensorKind::Buffer,
                    offset: range.start,
                    len: channels,
                    layout: StorageLayout::Plain,
                });
            }
            tensors.push(TensorInfo {
                name: format!("{}.num_batches_tracked", bn.name),
                shape: vec![],
                kind: TensorKind::BatchCount,
                offset: 0,
                len: 0,
                layout: StorageLayout::Plain,
            });
        };
        add_conv_bn(&mut self.stem, &mut tensors);
        for block in &mut self.blocks {
            for unit in &mut block.units {
                add_conv_bn(unit, &mut tensors);
            }
            if let Some(shortcut) = &mut block.shortcut {
                add_conv_bn(shortcut, &mut tensors);
            }
        }
        let head = &self.head;
        tensors.push(param(
            format!("{}.weight", head.name),
            vec![head.classes, head.in_features],
            &head.weight,
            StorageLayout::Plain,
        ));
        tensors.push(param(
            format!("{}.bias", head.name),
            vec![head.classes],
            &head.bias,
            StorageLayout::Plain,
        ));
        (tensors, buffers_len)
    }
}

fn param(
    name: String,
    shape: Vec<usize>,
    range: &Range<usize>,
    layout: StorageLayout,
) -> TensorInfo {
    TensorInfo {
        name,
        shape,
        kind: TensorKind::Param,
        offset: range.start,
        len: range.len(),
        layout,
    }
}

/// Seed 000: `conv1` (3x3 conv, bn, relu), four stages of two `Block`s, average pool, `dense_layer`.
fn resnet18(num_classes: usize) -> Network {
    let stem = ConvBn::new(
        ConvLayer::new("conv1.0".into(), 3, 64, 3, 1, 1, false),
        "conv1.1".into(),
    );
    let stages = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)];
    let mut blocks = Vec::new();
    for (stage, &(stage_in, out, first_stride)) in stages.iter().enumerate() {
        let mut in_channels = stage_in;
        for index in 0..2 {
            let stride = if index == 0 { first_stride } else { 1 };
            let prefix = format!("conv{}.{index}", stage + 2);
            let residual = |i: usize| format!("{prefix}.residual_function.{i}");
            let units = vec![
                ConvBn::new(
                    ConvLayer::new(residual(0), in_channels, out, 3, stride, 1, false),
                    residual(1),
                ),
                ConvBn::new(
                    ConvLayer::new(residual(3), out, out, 3, 1, 1, false),
                    residual(4),
                ),
            ];
            let shortcut = |i: usize| format!("{prefix}.shortcut.{i}");
            blocks.push(Block::new(units, shortcut(0), shortcut(1)));
            in_channels = out;
        }
    }
    Network::new(stem, true, blocks, "dense_layer", num_classes)
}

/// Seed 004: `0.conv` (stride 2) and `0.bn` without ReLU, `0.blocks.*`, mean pooling, `1` linear.
/// Only the very first block has stride 2, as in the tutorial's code.
fn resnet_base(spec: &ResNetBaseSpec) -> Network {
    let kernel = spec.first_kernel_size;
    let first_channels = spec.n_channels.first().copied().unwrap_or(1);
    let stem_conv = ConvLayer::new(
        "0.conv".into(),
        spec.img_channels,
        first_channels,
        kernel,
        2,
        kernel / 2,
        true,
    );
    let stem = ConvBn::new(stem_conv, "0.bn".into());
    let mut blocks: Vec<Block> = Vec::new();
    let mut in_channels = first_channels;
    for (stage, (&channels, &count)) in spec.n_channels.iter().zip(&spec.n_blocks).enumerate() {
        for _ in 0..count {
            let stride = if blocks.is_empty() { 2 } else { 1 };
            let prefix = format!("0.blocks.{}", blocks.len());
            let conv = |i: usize, cin, cout, k, s, p| {
                ConvLayer::new(format!("{prefix}.conv{i}"), cin, cout, k, s, p, true)
            };
            let bn = |i: usize| format!("{prefix}.bn{i}");
            let units = match spec.bottlenecks.as_ref().and_then(|b| b.get(stage)) {
                Some(&bottleneck) => vec![
                    ConvBn::new(conv(1, in_channels, bottleneck, 1, 1, 0), bn(1)),
                    ConvBn::new(conv(2, bottleneck, bottleneck, 3, stride, 1), bn(2)),
                    ConvBn::new(conv(3, bottleneck, channels, 1, 1, 0), bn(3)),
                ],
                None => vec![
                    ConvBn::new(conv(1, in_channels, channels, 3, stride, 1), bn(1)),
                    ConvBn::new(conv(2, channels, channels, 3, 1, 1), bn(2)),
                ],
            };
            let shortcut = |layer: &str| format!("{prefix}.shortcut.{layer}");
            blocks.push(Block::new(units, shortcut("conv"), shortcut("bn")));
            in_channels = channels;
        }
    }
    Network::new(stem, false, blocks, "1", spec.num_classes)
}
