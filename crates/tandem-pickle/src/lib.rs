//! tandem-pickle: read Python pickles without executing anything.
//!
//! A pickle is a program for a small stack machine. [`loads`] runs that program over a
//! closed set of opcodes (protocols 2 to 5) and returns a [`Value`] tree. Class references
//! stay opaque ([`Value::Global`]) and calling them only records the call
//! ([`Value::Object`]); the interpreters in [`numpy`] and [`torch`] then recognise the few
//! objects Tandem needs: numpy arrays, `OrderedDict` and torch tensors.
//!
//! Every length is checked against the bytes that remain, nesting is bounded, and every
//! failure is a [`PickleError`] that names the byte offset and what was expected.

mod error;
mod machine;
pub mod numpy;
pub mod torch;
mod value;
mod zip_end;

pub use error::PickleError;
pub use machine::{loads, loads_with_limits, Limits};
pub use numpy::{ndarray_from_value, DType, NdArray};
pub use torch::{
    open_torch_state_dict, read_torch_state_dict, read_torch_state_dict_from_bytes, NamedTensor,
    Scalar, TensorData, TensorDtype, TensorHeader, TorchCheckpoint, TorchStateDict,
    DEFAULT_MAX_PICKLE_BYTES,
};
pub use value::Value;
pub use zip_end::MAX_ARCHIVE_ENTRIES;
