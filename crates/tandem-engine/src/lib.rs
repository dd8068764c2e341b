//! `tandem-engine`: the numeric core of Tandem.
//!
//! Tensors are plain `f32` slices in NHWC layout (`[batch, height, width, channels]`).
//! Each layer is a pair of free functions, a forward and an explicit backward; there is
//! no autograd. Kernels split their work into fixed chunks per worker (see [`threads`]),
//! so the same inputs and thread count give bit-identical results run after run.
//!
//! - [`shape`]: layer shapes ([`shape::Conv2dShape`]), plain data that any executor reads.
//! - [`conv`]: 2-D convolution (im2col + GEMM, Winograd F(2x2, 3x3) for wide 3x3 layers, or
//!   direct kernels for few channels), any square kernel, stride and padding.
//! - [`batchnorm`]: batch normalization with fused residual add and ReLU.
//! - [`head`]: global average pooling, linear layer and cross-entropy loss.
//! - [`optim`]: SGD and Adam/AdamW with PyTorch's update rules on flat slices.

#![warn(missing_docs)]

pub mod batchnorm;
mod channels;
pub mod conv;
mod direct;
mod error;
pub mod head;
pub mod matmul;
pub mod optim;
mod parallel;
pub mod rng;
mod scratch;
pub mod shape;
mod simd;
mod threads;
mod winograd;

pub use batchnorm::BatchNormReducer;
pub use error::EngineError;
pub use optim::{Adam, AdamConfig, Optimizer, OptimizerConfig, OptimizerState, Sgd, SgdConfig};
pub use threads::{run_on_kernel_threads, set_threads, threads};
