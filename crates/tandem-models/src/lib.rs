//! `tandem-models`: the two tutorial models with PyTorch `state_dict` names and shapes.
//!
//! - `resnet18`: seed 000's `ResNet(Block)` for CIFAR (convolutions without bias).
//! - `resnet-base`: seed 004's `nn.Sequential(ResNetBase(...), nn.Linear(...))` for any
//!   block counts, widths and optional bottlenecks (convolutions with bias).
//!
//! A [`Model`] keeps its parameters, gradients and batch-norm running statistics in one flat
//! buffer each, with a table of named views ([`TensorInfo`]) in `state_dict` order. Parameters
//! are laid out in the order the backward pass finishes their gradients (classifier first,
//! stem last), so the backward can report finished gradient ranges in increasing order.

#![warn(missing_docs)]

mod error;
mod io;
mod model;
mod network;
mod spec;
mod tensors;
mod workspace;

pub use error::ModelError;
pub use io::{
    load_named_tensors, load_safetensors, load_torch_save, save_safetensors, NamedTensor,
    TensorData, TorchCheckpoint,
};
pub use model::{LossOptions, Model};
pub use spec::{ModelSpec, ResNetBaseSpec};
pub use tandem_engine::BatchNormReducer;
pub use tensors::{StorageLayout, TensorInfo, TensorKind};
