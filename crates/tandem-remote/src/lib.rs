//! Objects in S3-protocol storage: Amazon S3, Huawei Cloud OBS (seed 000 keeps its data
//! and outputs there) and any S3-compatible server.
//!
//! [`ObjectUrl`] reads `s3://bucket/key` and `obs://bucket/key`; [`Connection`] gathers the
//! endpoint, region and credentials from flags and the usual variables; [`RemoteStore`]
//! moves whole files in and out, blocking, through the `object_store` crate (signing,
//! retries with back-off, multipart uploads); [`cache`] keeps local copies of objects and
//! data sets, and the staging folders of runs; [`uploads`] carries out a run's uploads on a
//! thread beside training, each recorded on disk until it is done. Nothing here ever prints
//! a secret.

pub mod cache;
mod client;
mod connection;
mod error;
pub mod uploads;
mod url;

#[cfg(feature = "test-server")]
pub mod test_server;

pub use cache::{CacheError, Storage};
pub use client::{ObjectInfo, RemoteStore, PART_BYTES};
pub use connection::{Connection, ConnectionOptions, Credentials, Secret, DEFAULT_RETRY_TIMEOUT};
pub use error::RemoteError;
pub use url::{ObjectUrl, Scheme};

/// The local folder for objects fetched from and staged for object storage when no
/// `--cache-dir` is given: `TMPDIR/tandem-cache`.
pub fn default_cache_dir() -> std::path::PathBuf {
    std::env::temp_dir().join("tandem-cache")
}
