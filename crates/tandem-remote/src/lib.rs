//! Objects in S3-protocol storage: Amazon S3, Huawei Cloud OBS (seed 000 keeps its data
//! and outputs there) and any S3-compatible server.
//!
//! [`ObjectUrl`] reads `s3://bucket/key` and `obs://bucket/key`; [`Connection`] gathers the
//! endpoint, region and credentials from flags and the usual variables; [`RemoteStore`]
//! moves whole files in and out, blocking, through the `object_store` crate (signing,
//! retries with back-off, multipart uploads). Nothing here ever prints a secret.

mod client;
mod connection;
mod error;
mod url;

#[cfg(feature = "test-server")]
pub mod test_server;

pub use client::{ObjectInfo, RemoteStore, PART_BYTES};
pub use connection::{Connection, ConnectionOptions, Credentials, Secret, DEFAULT_RETRY_TIMEOUT};
pub use error::RemoteError;
pub use url::{ObjectUrl, Scheme};
