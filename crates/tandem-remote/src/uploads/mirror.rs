//! The uploads of a run whose outputs are in object storage: its staging folders and the
//! objects they stand for, an upload queue beside training, and what an earlier process left
//! pending for them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tandem_files::{sidecar, tell};

use super::{pending_folder, Job, PendingUploads, Uploader, UploadsError};
use crate::{ObjectUrl, Storage};

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
    ) -> Result<Mirror, UploadsError> {
        let Some((first_place, _)) = places.first() else {
            return Err(UploadsError::NoStagingFolder);
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
    pub fn upload_earlier(&mut self) -> Result<(), UploadsError> {
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
            UploadsError::EarlierStillPending {
                failure,
                folder: folder.clone(),
                url: url.clone(),
            }
        })?;
        tell!("uploads: {uploaded} file(s) an earlier run left pending are now in {url}");
        Ok(())
    }

    /// Forgets what an earlier process left pending, as the bucket is further on than the
    /// staged files it stands for (another machine continued the run), and says so.
    pub fn forget_earlier(&mut self) -> Result<(), UploadsError> {
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
    pub fn fetch_snapshot(&self, local: &Path) -> Result<Option<PathBuf>, UploadsError> {
        let Some(url) = self.url_of(local) else {
            return Ok(None);
        };
        let Some(info) =
            self.storage
                .store
                .head(&url)
                .map_err(|source| UploadsError::Snapshot {
                    action: "look for",
                    url: url.to_string(),
                    source: Box::new(source),
                })?
        else {
            return Ok(None);
        };
        let fetched = sidecar(local, "from-bucket");
        self.storage
            .store
            .download_listed(&url, info.size, &fetched)
            .map_err(|source| UploadsError::Snapshot {
                action: "fetch",
                url: url.to_string(),
                source: Box::new(source),
            })?;
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
