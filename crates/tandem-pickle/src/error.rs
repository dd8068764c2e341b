//! The one error type of the crate.

use std::path::PathBuf;

/// Why a pickle, a numpy array inside one, or a torch.save archive could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    /// The byte stream ended before an opcode or its argument was complete.
    #[error("pickle truncated at byte {offset}: expected {needed} more bytes for {what}")]
    Truncated {
        /// Offset of the first missing byte.
        offset: usize,
        /// How many bytes were still needed.
        needed: u64,
        /// What was being read.
        what: &'static str,
    },
    /// An opcode this reader does not run (it may be valid pickle, but Tandem never needs it).
    #[error("pickle byte {offset}: unsupported opcode 0x{opcode:02x} ({name})")]
    UnsupportedOpcode {
        /// Offset of the opcode.
        offset: usize,
        /// The opcode byte.
        opcode: u8,
        /// Its pickletools name, or "unknown".
        name: &'static str,
    },
    /// The program is well-formed bytes but not a valid pickle program.
    #[error("pickle byte {offset}: {message}")]
    Malformed {
        /// Offset of the offending opcode.
        offset: usize,
        /// What was expected and what was found.
        message: String,
    },
    /// A safety limit (nesting depth, output size) was exceeded.
    #[error("pickle exceeds a limit: {message}")]
    LimitExceeded {
        /// Which limit, and its value.
        message: String,
    },
    /// A decoded value does not have the shape an interpreter expected.
    #[error("{context}: expected {expected}, found {found}")]
    UnexpectedValue {
        /// Where in the value tree (e.g. `numpy array dtype`, `tensor 0.conv.weight`).
        context: String,
        /// What was expected.
        expected: String,
        /// What was there.
        found: String,
    },
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A torch.save file is not a readable zip archive, or lacks an entry.
    #[error("{path}: {message}")]
    Archive {
        /// The checkpoint file.
        path: PathBuf,
        /// What is wrong with the archive.
        message: String,
    },
    /// A tensor of a torch.save file cannot be rebuilt.
    #[error("{path}: tensor {tensor}: {message}")]
    Tensor {
        /// The checkpoint file.
        path: PathBuf,
        /// The state-dict key of the tensor.
        tensor: String,
        /// What is wrong with it.
        message: String,
    },
}
