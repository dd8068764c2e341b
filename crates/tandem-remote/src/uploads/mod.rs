//! The uploads of a run in object storage: a queue that a thread carries out beside
//! training ([`queue`]), each job recorded on disk until it is done ([`pending`]), so that
//! what one process could not upload is uploaded by the next; [`mirror`] ties them to a
//! run's staging folders.

pub mod mirror;
pub mod pending;
pub mod queue;

use std::path::PathBuf;

use tandem_files::FileError;

use crate::{ObjectUrl, RemoteError};

pub use mirror::Mirror;
pub use pending::{pending_folder, PendingUploads};
pub use queue::Uploader;

/// One thing to do in the bucket.
#[derive(Clone, Debug, PartialEq)]
pub enum Job {
    /// Copy the local file to the object.
    Put {
        /// The staged file.
        local: PathBuf,
        /// The object it becomes.
        url: ObjectUrl,
    },
    /// Delete `epoch_N.safetensors` objects directly under the prefix but the `keep`
    /// with the largest N.
    PruneCheckpoints {
        /// The output folder's prefix.
        prefix: ObjectUrl,
        /// How many checkpoints stay.
        keep: usize,
    },
}

impl Job {
    /// Whether `other` does the same thing (an upload of the same object, maybe of a newer
    /// version of its file).
    pub(crate) fn same_as(&self, other: &Job) -> bool {
        match (self, other) {
            (Job::Put { url, .. }, Job::Put { url: other, .. }) => url == other,
            _ => self == other,
        }
    }
}

/// Why the pending uploads of a run could not be recorded or read.
#[derive(Debug, thiserror::Error)]
pub enum UploadsError {
    /// Writing or cleaning the folder of pending uploads failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// A job could not be recorded.
    #[error("cannot record a pending upload")]
    Record(#[source] FileError),
    /// A job could not be encoded as JSON.
    #[error("cannot encode a pending upload")]
    Encode(#[source] serde_json::Error),
    /// The folder of pending uploads could not be listed.
    #[error("cannot list {}", .path.display())]
    List {
        /// The folder.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A record could not be read.
    #[error("cannot read {}", .path.display())]
    Read {
        /// The record's file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The record of a finished job could not be removed.
    #[error("cannot remove {}, a finished upload's record", .path.display())]
    Remove {
        /// The record's file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A file in the folder is not a record.
    #[error(
        "{} is not a pending upload (expected {{\"put\":{{\"url\":\"s3://...\"}}}} or \
         {{\"prune-checkpoints\":{{\"prefix\":\"s3://...\",\"keep\":N}}}}); remove it to \
         forget it",
        .path.display()
    )]
    NotARecord {
        /// The file.
        path: PathBuf,
        /// What the JSON parser said.
        source: serde_json::Error,
    },
    /// A record names something that is not a valid object URL.
    #[error("{}: not an object URL", .path.display())]
    InvalidUrl {
        /// The record's file.
        path: PathBuf,
        /// Why the URL is invalid.
        source: Box<RemoteError>,
    },
    /// A mirror was started without a staging folder.
    #[error("a mirror needs a staging folder")]
    NoStagingFolder,
    /// What an earlier process left pending could not be uploaded.
    #[error(
        "{failure}\nthe uploads an earlier run left pending are still pending (recorded in \
         {}): run the same command again once {url} can be reached",
        .folder.display()
    )]
    EarlierStillPending {
        /// The upload's failure, in words.
        failure: String,
        /// Where the pending jobs are recorded.
        folder: PathBuf,
        /// The prefix of the run's outputs.
        url: String,
    },
    /// The bucket's snapshot could not be looked for or fetched.
    #[error("cannot {action} the snapshot {url}")]
    Snapshot {
        /// "look for" or "fetch".
        action: &'static str,
        /// The snapshot's object.
        url: String,
        /// What the store said.
        source: Box<RemoteError>,
    },
    /// A record names a local path rather than an object URL.
    #[error("{}: {text} is not an object URL", .path.display())]
    NotAnObjectUrl {
        /// The record's file.
        path: PathBuf,
        /// What it names.
        text: String,
    },
}
