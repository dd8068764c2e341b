//! A run whose `--output-dir` (or `--snapshot`) is an object URL: its files are written to a
//! local staging folder first, as for a local run, then uploaded beside training; and a run
//! resumes from the newest good snapshot, the bucket's or the staging folder's.
//!
//! The staging folder is `CACHE/runs/BUCKET/KEY`: on the same node a relaunch finds its own
//! newest files there; on a fresh node with an empty disk it finds nothing and resumes from
//! the bucket. What a process could not upload stays recorded beside the staging folder
//! (see `tandem_remote::uploads::pending`): the next run with the same cache uploads it before it
//! trains, or drops it when the bucket is further on (another machine carried the run on).

use std::path::PathBuf;

use anyhow::{bail, Context};
use tandem_remote::{ObjectUrl, Storage};

use crate::remote::data::fetched_data_dir;
use crate::remote::object_url;
use crate::settings::TrainSettings;

/// The run's settings with every object URL replaced by a local path, and what the URLs
/// were.
pub struct LocalizedRun {
    /// The settings the run works with: local paths only.
    pub settings: TrainSettings,
    /// The connection, when any path was an object URL.
    pub storage: Option<Storage>,
    /// Local staging paths (folders or files) and the objects they stand for.
    pub places: Vec<(PathBuf, ObjectUrl)>,
}

/// Replaces the object URLs of `settings`: the data set and `--init-from` are fetched into
/// the cache (every process needs them), the output folder and snapshot become staging
/// paths.
pub fn localize(settings: &TrainSettings) -> anyhow::Result<LocalizedRun> {
    let output_url = object_url(&settings.output_dir)?;
    let snapshot_url = object_url(&settings.snapshot)?;
    let init_url = match &settings.init_from {
        Some(path) => object_url(path)?,
        None => None,
    };
    let mut local = settings.clone();
    let data_is_remote = object_url(&settings.data.data_dir)?.is_some();
    if output_url.is_none() && snapshot_url.is_none() && !data_is_remote && init_url.is_none() {
        return Ok(LocalizedRun {
            settings: local,
            storage: None,
            places: Vec::new(),
        });
    }
    if settings.fresh && (output_url.is_some() || snapshot_url.is_some()) {
        bail!(
            "--fresh moves a previous run aside, which objects in a bucket cannot do: give \
             --output-dir (or --snapshot) a new prefix instead"
        );
    }
    let storage = crate::remote::connect(&settings.storage)?;
    if let Some(folder) = fetched_data_dir(&storage, &settings.data)? {
        local.data.data_dir = folder;
    }
    if let Some(url) = init_url {
        local.init_from = Some(
            storage
                .fetch_object(&url)
                .with_context(|| format!("cannot fetch --init-from {url}"))?,
        );
    }
    let mut places = Vec::new();
    if let Some(url) = &output_url {
        local.output_dir = storage.cache_path("runs", url);
        places.push((local.output_dir.clone(), url.clone()));
    }
    if let Some(url) = snapshot_url {
        let inside_output = output_url
            .as_ref()
            .and_then(|output| output.relative_key(&url).map(str::to_string));
        local.snapshot = match inside_output {
            Some(relative) => local.output_dir.join(relative),
            None => {
                let staged = storage.cache_path("runs", &url);
                places.push((staged.clone(), url));
                staged
            }
        };
    }
    Ok(LocalizedRun {
        settings: local,
        storage: Some(storage),
        places,
    })
}

pub use tandem_remote::uploads::Mirror;
