//! `s3://` and `obs://` paths: data fetched once into a local cache, weights fetched before
//! they are read, and a training run's outputs staged locally and uploaded beside training
//! (see [`crate::train::mirror`]).
//!
//! A path flag holds either a local path or an object URL; [`object_url`] tells which. The
//! connection comes from the `[storage]` flags and the usual variables (see
//! `tandem_remote::Connection`); credentials are never read from, or written to, a file of
//! the run.

pub mod data;
pub mod launcher_logs;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tandem_remote::{Connection, ConnectionOptions, ObjectUrl, RemoteStore, Storage};

use crate::settings::StorageOptions;

/// The object URL `path` holds, or `None` for a local path.
pub fn object_url(path: &Path) -> anyhow::Result<Option<ObjectUrl>> {
    let Some(text) = path.to_str() else {
        return Ok(None);
    };
    Ok(ObjectUrl::parse(text)?)
}

/// Connects as `options` and the environment say (nothing is sent yet).
pub fn connect(options: &StorageOptions) -> anyhow::Result<Storage> {
    let retry_timeout = match options.s3_retry_timeout {
        Some(seconds) if !(seconds.is_finite() && seconds > 0.0) => {
            bail!("--s3-retry-timeout must be a positive number of seconds, got {seconds}")
        }
        Some(seconds) => Some(Duration::from_secs_f64(seconds)),
        None => None,
    };
    let connection = Connection::from_env(&ConnectionOptions {
        endpoint: options.s3_endpoint.clone(),
        region: options.s3_region.clone(),
        // Not given: the connection decides by the endpoint.
        path_style: options.s3_path_style.then_some(true),
        retry_timeout,
    })?;
    Ok(Storage {
        store: Arc::new(RemoteStore::new(connection)?),
        cache_dir: options.cache_dir(),
    })
}

/// `path` itself when it is local; for an object URL, its copy fetched into the cache.
pub fn local_copy(options: &StorageOptions, path: &Path) -> anyhow::Result<PathBuf> {
    match object_url(path)? {
        None => Ok(path.to_path_buf()),
        Some(url) => connect(options)?
            .fetch_object(&url)
            .with_context(|| format!("cannot fetch {url}")),
    }
}

/// `data` with its folder replaced by the fetched copy when it is an object URL.
pub fn local_data(
    options: &StorageOptions,
    mut data: crate::settings::DataSettings,
) -> anyhow::Result<crate::settings::DataSettings> {
    if object_url(&data.data_dir)?.is_some() {
        if let Some(folder) = data::fetched_data_dir(&connect(options)?, &data)? {
            data.data_dir = folder;
        }
    }
    Ok(data)
}
