//! The one error type of the crate.

use std::path::PathBuf;

/// Why data could not be found, read, downloaded or served.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// No data in any layout this source accepts was found.
    #[error("{path}: {message}")]
    NotFound {
        /// Where it was looked for.
        path: PathBuf,
        /// What was looked for.
        message: String,
    },
    /// A file's contents are not what its layout requires (size, record, field, label).
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// Which record or field, what was expected and what was found.
        message: String,
    },
    /// A python-pickle batch file could not be unpickled.
    #[error("{path}: {source}")]
    Pickle {
        /// The file.
        path: PathBuf,
        /// The pickle reader's error.
        source: tandem_pickle::PickleError,
    },
    /// A `.tar.gz` archive is damaged or lacks a member.
    #[error("{path}: {message}")]
    Archive {
        /// The archive.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A download failed.
    #[error("download of {url}: {message}")]
    Download {
        /// The address.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// A downloaded file does not have the expected md5.
    #[error("{path}: md5 is {actual}, expected {expected} (the partial file was removed; run again to download afresh)")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The md5 it should have.
        expected: String,
        /// The md5 it has.
        actual: String,
    },
    /// A setting is out of range (batch size 0, rank not below the world size, ...).
    #[error("invalid setting: {message}")]
    Invalid {
        /// Which setting, what was expected and what was given.
        message: String,
    },
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> DataError {
        DataError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> DataError {
        DataError::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}
