//! What a weights file holds, told from its tensor names and shapes alone: which of the two
//! models (and with which settings) it is, and how it differs from a given model.

use std::collections::BTreeMap;

use crate::network::Network;
use crate::spec::{ModelSpec, ResNetBaseSpec};

/// Tensor shapes by `state_dict` name.
pub type TensorShapes = BTreeMap<String, Vec<usize>>;

/// The `state_dict` names and shapes of the model `spec` describes (assumed valid).
pub fn spec_tensor_shapes(spec: &ModelSpec) -> TensorShapes {
    let (_, layout) = Network::build(spec);
    layout
        .tensors
        .into_iter()
        .map(|info| (info.name, info.shape))
        .collect()
}

/// The model whose `state_dict` has exactly these names and shapes, if it is one of the two
/// models Tandem builds. Stages of equal width and bottleneck cannot be told apart (only the
/// first block has stride 2, so they build the same network) and come back merged.
pub fn infer_spec(shapes: &TensorShapes) -> Option<ModelSpec> {
    let candidate = if shapes.contains_key("dense_layer.weight") {
        let num_classes = *shapes.get("dense_layer.weight")?.first()?;
        ModelSpec::ResNet18 { num_classes }
    } else {
        ModelSpec::ResNetBase(infer_resnet_base(shapes)?)
    };
    (candidate.validate().is_ok() && spec_tensor_shapes(&candidate) == *shapes).then_some(candidate)
}

/// Reads seed 004's settings off the stem, each block's convolutions and the classifier.
fn infer_resnet_base(shapes: &TensorShapes) -> Option<ResNetBaseSpec> {
    let stem = shapes.get("0.conv.weight")?;
    let (img_channels, first_kernel_size) = (*stem.get(1)?, *stem.get(2)?);
    let num_classes = *shapes.get("1.weight")?.first()?;
    // (output channels, bottleneck channels) of each block, in order.
    let mut blocks: Vec<(usize, Option<usize>)> = Vec::new();
    loop {
        let prefix = format!("0.blocks.{}", blocks.len());
        let Some(conv1) = shapes.get(&format!("{prefix}.conv1.weight")) else {
            break;
        };
        let block = match shapes.get(&format!("{prefix}.conv3.weight")) {
            Some(conv3) => (*conv3.first()?, Some(*conv1.first()?)),
            None => (
                *shapes.get(&format!("{prefix}.conv2.weight"))?.first()?,
                None,
            ),
        };
        blocks.push(block);
    }
    let mut stages: Vec<((usize, Option<usize>), usize)> = Vec::new();
    for block in blocks {
        match stages.last_mut() {
            Some((kind, count)) if *kind == block => *count += 1,
            _ => stages.push((block, 1)),
        }
    }
    let bottlenecked = stages.iter().filter(|((_, b), _)| b.is_some()).count();
    let bottlenecks = match bottlenecked {
        0 => None,
        n if n == stages.len() => Some(stages.iter().filter_map(|((_, b), _)| *b).collect()),
        _ => return None,
    };
    Some(ResNetBaseSpec {
        n_blocks: stages.iter().map(|(_, count)| *count).collect(),
        n_channels: stages.iter().map(|((channels, _), _)| *channels).collect(),
        bottlenecks,
        first_kernel_size,
        img_channels,
        num_classes,
    })
}

/// How a file's tensors differ from a model's `state_dict`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateDictMismatch {
    /// Names the model has and the file lacks.
    pub missing: Vec<String>,
    /// Names the file has and the model lacks.
    pub unexpected: Vec<String>,
    /// Names both have, with the file's shape and the model's.
    pub wrong_shape: Vec<(String, Vec<usize>, Vec<usize>)>,
}

impl StateDictMismatch {
    /// Compares the file's tensors with the model's, name by name.
    pub fn between(file: &TensorShapes, model: &TensorShapes) -> Self {
        let mut mismatch = StateDictMismatch::default();
        for (name, expected) in model {
            match file.get(name) {
                None => mismatch.missing.push(name.clone()),
                Some(found) if found != expected => {
                    mismatch
                        .wrong_shape
                        .push((name.clone(), found.clone(), expected.clone()))
                }
                Some(_) => {}
            }
        }
        mismatch.unexpected = file
            .keys()
            .filter(|name| !model.contains_key(*name))
            .cloned()
            .collect();
        mismatch
    }

    /// Whether the file fits the model.
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.wrong_shape.is_empty()
    }

    /// The differences in brief: counts, and the first of each kind.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(first) = self.missing.first() {
            parts.push(format!(
                "{} missing from the file (first `{first}`)",
                self.missing.len()
            ));
        }
        if let Some(first) = self.unexpected.first() {
            parts.push(format!(
                "{} the model does not have (first `{first}`)",
                self.unexpected.len()
            ));
        }
        if let Some((name, found, expected)) = self.wrong_shape.first() {
            parts.push(format!(
                "{} with another shape (first `{name}`: {found:?} in the file, {expected:?} in the model)",
                self.wrong_shape.len()
            ));
        }
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tutorial's model with stages of `n_blocks` plain blocks of `n_channels`.
    fn plain_stages(n_blocks: &[usize], n_channels: &[usize]) -> ResNetBaseSpec {
        ResNetBaseSpec {
            n_blocks: n_blocks.to_vec(),
            n_channels: n_channels.to_vec(),
            bottlenecks: None,
            ..ResNetBaseSpec::tutorial_default()
        }
    }

    #[test]
    fn both_models_are_recognized_from_their_shapes() {
        let specs = [
            ModelSpec::ResNet18 { num_classes: 7 },
            ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default()),
            ModelSpec::ResNetBase(ResNetBaseSpec {
                first_kernel_size: 5,
                num_classes: 4,
                ..plain_stages(&[1, 2], &[8, 16])
            }),
        ];
        for spec in specs {
            assert_eq!(infer_spec(&spec_tensor_shapes(&spec)), Some(spec));
        }
    }

    #[test]
    fn equal_stages_merge_and_strangers_are_not_guessed() {
        let split = ModelSpec::ResNetBase(plain_stages(&[1, 2], &[8, 8]));
        let ModelSpec::ResNetBase(merged) = infer_spec(&spec_tensor_shapes(&split)).unwrap() else {
            panic!("expected resnet-base");
        };
        assert_eq!((merged.n_blocks, merged.n_channels), (vec![3], vec![8]));
        let mut shapes = spec_tensor_shapes(&ModelSpec::ResNet18 { num_classes: 10 });
        shapes.insert("extra.weight".into(), vec![1]);
        assert_eq!(infer_spec(&shapes), None);
        assert_eq!(infer_spec(&TensorShapes::new()), None);
    }

    #[test]
    fn mismatch_names_the_first_difference_of_each_kind() {
        let model = spec_tensor_shapes(&ModelSpec::ResNet18 { num_classes: 10 });
        let mut file = model.clone();
        file.remove("dense_layer.bias");
        file.insert("dense_layer.weight".into(), vec![3, 512]);
        file.insert("extra".into(), vec![2]);
        let mismatch = StateDictMismatch::between(&file, &model);
        assert_eq!(
            mismatch.summary(),
            "1 missing from the file (first `dense_layer.bias`); 1 the model does not have (first `extra`); \
             1 with another shape (first `dense_layer.weight`: [3, 512] in the file, [10, 512] in the model)"
        );
        assert!(StateDictMismatch::between(&model, &model).is_empty());
    }
}
