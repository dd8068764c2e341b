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
//!
//! The network description is read-only during a step; a step runs on an [`Executor`]
//! (see [`executor`]), which owns the activations and per-step state of a
//! [`workspace::Plan`]. The CPU executor over `tandem-engine` is the one built in.

#![warn(missing_docs)]

mod cpu;
mod cpu_device;
mod error;
pub mod executor;
mod inspect;
mod io;
mod model;
mod network;
mod spec;
mod tensors;
pub mod training_device;
pub mod workspace;

pub use cpu_device::CpuDevice;
pub use error::ModelError;
pub use executor::Executor;
pub use inspect::{infer_spec, spec_tensor_shapes, StateDictMismatch, TensorShapes};
pub use io::state_dict_safetensors;
pub use io::{
    load_named_tensors, load_safetensors, read_safetensors, read_safetensors_header,
    read_safetensors_metadata, save_safetensors, serialize_safetensors, NamedTensor,
    SafetensorsHeader, TensorData, TorchCheckpoint, TorchSaveFile,
};
pub use model::{LossOptions, Model};
pub use network::{BatchNormLayer, ConvLayer, Head};
pub use spec::{ModelSpec, ResNetBaseSpec};
pub use tandem_engine::BatchNormReducer;
pub use tensors::{channels_last_indices, StorageLayout, TensorInfo, TensorKind};
pub use training_device::{TrainingDevice, TrainingDeviceError};
