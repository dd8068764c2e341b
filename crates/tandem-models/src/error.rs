//! Errors of the models crate.

use std::path::PathBuf;

use tandem_engine::EngineError;

/// What can go wrong building, running, loading or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model specification is invalid; `field` names the offending setting.
    #[error("invalid model spec: {field}: {reason}")]
    InvalidSpec {
        /// The setting, e.g. `n_channels`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An input slice has the wrong length for the stated batch shape.
    #[error("{what} has {found} values, expected {expected} ({shape})")]
    InputLength {
        /// Which input, e.g. `images`.
        what: &'static str,
        /// Its length.
        found: usize,
        /// The length the shape needs.
        expected: usize,
        /// The shape, in words.
        shape: String,
    },
    /// A batch of zero images.
    #[error("a batch needs at least one image")]
    EmptyBatch,
    /// The images are too small for a convolution of the model.
    #[error("images are too small: layer `{layer}` gets a {height}x{width} input, smaller than its kernel")]
    ImageTooSmall {
        /// Height of the layer's input.
        height: usize,
        /// Width of the layer's input.
        width: usize,
        /// The PyTorch name of the layer that does not fit.
        layer: String,
    },
    /// `backward` was called without a preceding `forward_train`.
    #[error("backward needs a forward_train first (each forward_train allows one backward)")]
    NoForward,
    /// An engine kernel failed (bad label, SyncBatchNorm failure, ...).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Writing a file atomically failed.
    #[error(transparent)]
    File(#[from] tandem_files::FileError),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A safetensors file could not be parsed or written.
    #[error("{path}: not a valid safetensors file: {message}")]
    SafeTensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// A tensor the model needs is absent.
    #[error("{source_name}: tensor `{name}` is missing")]
    MissingTensor {
        /// The file or tensor list.
        source_name: String,
        /// The PyTorch name of the missing tensor.
        name: String,
    },
    /// A tensor that is not part of the model is present.
    #[error("{source_name}: unexpected tensor `{name}` (not in this model's state_dict)")]
    UnexpectedTensor {
        /// The file or tensor list.
        source_name: String,
        /// Its name.
        name: String,
    },
    /// A tensor has a different shape than the model's.
    #[error("{source_name}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        /// The file or tensor list.
        source_name: String,
        /// Its name.
        name: String,
        /// Its shape.
        found: Vec<usize>,
        /// The model's shape.
        expected: Vec<usize>,
    },
    /// A tensor has a different element type than the model's.
    #[error("{source_name}: tensor `{name}` has dtype {found}, expected {expected}")]
    TensorDtype {
        /// The file or tensor list.
        source_name: String,
        /// Its name.
        name: String,
        /// Its dtype.
        found: String,
        /// The dtype the model stores.
        expected: &'static str,
    },
    /// A `torch.save` file could not be read, or holds more than the model can need.
    #[error(transparent)]
    TorchSave(#[from] tandem_pickle::PickleError),
    /// A device executor (e.g. the GPU's) failed; the error names the call and its status.
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync + 'static>),
}
