//! A run whose `--output-dir` (or `--snapshot`) is an object URL: its files are written to a
//! local staging folder first, as for a local run, then uploaded beside training; and a run
//! resumes from the newest good snapshot, the bucket's or the staging folder's.
//!
//! The staging folder is `CACHE/runs/BUCKET/KEY`: on the same node a relaunch finds its own
//! newest files there; on a fresh node with an empty disk it finds nothing and resumes from
//! the bucket. What a process could not upload stays recorded beside the staging folder
//! (see `tandem_remote::uploads::pending`): the next run with the same cache uploads it before it
//! trains, or drops it when the bucket is further on (another machine carried the run on).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use tandem_files::sidecar;
use tandem_remote::uploads::{pending_folder, Job, PendingUploads, Uploader};
use tandem_remote::ObjectUrl;

use crate::remote::data::fetched_data_dir;
use crate::remote::{object_url, Storage};
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
    let storage = Storage::connect(&settings.storage)?;
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

/// The uploads of a run with outputs in object storage (rank 0 only), and of the launcher's
/// logs.
pub struct Mirror {
    storage: Storage,
    places: Vec<(PathBuf, ObjectUrl)>,
    uploader: Uploader,
    /// The jobs an earlier process left pending, not queued yet.
    earlier: Vec<Job>,
    /// Where the pending jobs are recorded.
    pending_folder: PathBuf,
}

impl Mirror {
    /// Starts the uploads of the staging `places` and finds what an earlier process left
    /// pending for them (see [`Mirror::upload_earlier`]). An upload failure that outlasts
    /// the retries sets `stop_requested`, so the run stops at its next step with a snapshot.
    pub fn start(
        storage: Storage,
        places: Vec<(PathBuf, ObjectUrl)>,
        stop_requested: Arc<AtomicBool>,
    ) -> anyhow::Result<Mirror> {
        let Some((first_place, _)) = places.first() else {
            bail!("a mirror needs a staging folder");
        };
        let pending_folder = pending_folder(first_place);
        let (pending, earlier) =
            PendingUploads::open(&pending_folder, |url| local_of(&places, url))?;
        let uploader = Uploader::start(Arc::clone(&storage.store), pending, move || {
            stop_requested.store(true, Ordering::SeqCst);
        });
        Ok(Mirror {
            storage,
            places,
            uploader,
            earlier,
            pending_folder,
        })
    }

    /// The prefix of the outputs, as messages name it.
    fn first_url(&self) -> String {
        self.places
            .first()
            .map_or_else(String::new, |(_, url)| url.to_string())
    }

    /// Uploads what an earlier process left pending and waits until it is in the bucket;
    /// fails, leaving it pending, when it cannot be.
    pub fn upload_earlier(&mut self) -> anyhow::Result<()> {
        let earlier = std::mem::take(&mut self.earlier);
        if earlier.is_empty() {
            return Ok(());
        }
        let (count, url, folder) = (earlier.len(), self.first_url(), &self.pending_folder);
        tell!(
            "uploads: {count} left pending by an earlier run (recorded in {}); uploading them \
             to {url} first",
            folder.display()
        );
        for job in earlier {
            self.uploader.enqueue(job);
        }
        let uploaded = self.uploader.wait_until_done().map_err(|failure| {
            anyhow::anyhow!(
                "{failure}\nthe uploads an earlier run left pending are still pending \
                 (recorded in {}): run the same command again once {url} can be reached",
                folder.display()
            )
        })?;
        tell!("uploads: {uploaded} file(s) an earlier run left pending are now in {url}");
        Ok(())
    }

    /// Forgets what an earlier process left pending, as the bucket is further on than the
    /// staged files it stands for (another machine continued the run), and says so.
    pub fn forget_earlier(&mut self) -> anyhow::Result<()> {
        let earlier = std::mem::take(&mut self.earlier);
        if earlier.is_empty() {
            return Ok(());
        }
        for job in &earlier {
            self.uploader.forget(job)?;
        }
        tell!(
            "uploads: the {} left pending in {} by an earlier run are dropped: {} is further on \
             than they are",
            earlier.len(),
            self.pending_folder.display(),
            self.first_url()
        );
        Ok(())
    }

    /// The object a staged local file stands for, if any.
    pub fn url_of(&self, local: &Path) -> Option<ObjectUrl> {
        self.places.iter().find_map(|(place, url)| {
            let relative = local.strip_prefix(place).ok()?;
            let relative: Vec<&str> = relative
                .components()
                .map(|part| part.as_os_str().to_str())
                .collect::<Option<_>>()?;
            Some(url.join(&relative.join("/")))
        })
    }

    /// Whether an upload failed: the run's files are kept locally, and what is left is
    /// pending.
    pub fn has_failed(&self) -> bool {
        self.uploader.has_failed()
    }

    /// How many uploads are pending, and the folder that records them.
    pub fn pending(&self) -> (usize, PathBuf) {
        self.uploader.pending()
    }

    /// Queues the upload of a file the run has just written.
    pub fn publish(&self, local: &Path) {
        if let Some(url) = self.url_of(local) {
            self.uploader.enqueue(Job::Put {
                local: local.to_path_buf(),
                url,
            });
        }
    }

    /// Queues `--keep-last` in the bucket: the epoch checkpoints in the object prefix of the
    /// staged `output_dir`, but the last `keep`, are deleted there.
    pub fn prune_checkpoints(&self, output_dir: &Path, keep: usize) {
        if let Some(prefix) = self.url_of(output_dir) {
            self.uploader
                .enqueue(Job::PruneCheckpoints { prefix, keep });
        }
    }

    /// The bucket's snapshot for the staged snapshot path `local`, fetched beside it, if the
    /// bucket holds one.
    pub fn fetch_snapshot(&self, local: &Path) -> anyhow::Result<Option<PathBuf>> {
        let Some(url) = self.url_of(local) else {
            return Ok(None);
        };
        let Some(info) = self
            .storage
            .store
            .head(&url)
            .with_context(|| format!("cannot look for the snapshot {url}"))?
        else {
            return Ok(None);
        };
        let fetched = sidecar(local, "from-bucket");
        self.storage
            .store
            .download_listed(&url, info.size, &fetched)
            .with_context(|| format!("cannot fetch the snapshot {url}"))?;
        Ok(Some(fetched))
    }

    /// Waits for every queued upload; returns how many files were uploaded, or the failure.
    pub fn finish(&mut self) -> Result<usize, String> {
        self.uploader.finish()
    }
}

/// The staged path (a file or folder) of the object or prefix `url` among `places`.
fn local_of(places: &[(PathBuf, ObjectUrl)], url: &ObjectUrl) -> Option<PathBuf> {
    places.iter().find_map(|(place, place_url)| {
        if place_url.bucket() == url.bucket() && place_url.key() == url.key() {
            return Some(place.clone());
        }
        let relative = place_url.relative_key(url)?;
        Some(
            relative
                .split('/')
                .fold(place.clone(), |path, part| path.join(part)),
        )
    })
}
