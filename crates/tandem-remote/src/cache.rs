//! The local cache beside a connection: objects fetched once and read from there, a data
//! set under a prefix copied whole, and the staging folders of runs whose outputs are in
//! object storage. The cache folder holds `AREA/BUCKET/KEY` for the areas `data`, `objects`
//! and `runs` (see [`ObjectUrl::staging_path`]).
//!
//! A data set is copied to `CACHE/data/BUCKET/KEY/`, each object at its relative path, so
//! every data source reads the copy as it reads a local folder. A file beside the folder
//! records each object's size and entity tag; a second fetch copies only what changed, and
//! an interrupted fetch resumes with the files it lacks. The processes of one node take
//! turns (a lock beside the folder), so one of them fetches and the others find the copy
//! current. Sizes are checked on every transfer; the caller checks what else it knows of a
//! file (the data sources know the md5 of CIFAR-10's official files).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tandem_files::{sidecar, tell, FileError};

use crate::{ObjectInfo, ObjectUrl, RemoteError, RemoteStore};

/// How often a process waiting for another's fetch says so.
const WAIT_NOTICE: Duration = Duration::from_secs(30);
/// Objects fetched at once.
const FETCH_THREADS: usize = 8;
/// The manifest is written after this many fetched files (and at the end).
const MANIFEST_EVERY: usize = 64;

/// Why an object or a data set could not be fetched into the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The object store refused or failed.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// A file of the cache could not be written.
    #[error(transparent)]
    File(#[from] FileError),
    /// A folder or lock of the cache could not be created or taken.
    #[error("cannot {action} {}", .path.display())]
    Local {
        /// What was being done: "create cache folder", "open lock file", "lock".
        action: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The data set's prefix could not be listed.
    #[error("cannot list the data set at {url}")]
    List {
        /// The prefix.
        url: String,
        /// What the store said.
        source: RemoteError,
    },
    /// The data set's prefix holds nothing.
    #[error("{url} holds no objects: expected the data set's files under this prefix")]
    EmptyPrefix {
        /// The prefix.
        url: String,
    },
    /// Copying the data set failed part way; what was fetched is kept.
    #[error("cannot fetch the data set from {url}")]
    Fetch {
        /// The prefix.
        url: String,
        /// The first failure.
        source: Box<CacheError>,
    },
    /// The caller's check refused a fetched file (it has been removed).
    #[error("{0}")]
    Refused(String),
    /// The manifest could not be encoded.
    #[error("cannot encode the cache's manifest")]
    Manifest(#[source] serde_json::Error),
    /// A fetching thread panicked.
    #[error("a fetching thread panicked")]
    Panicked,
}

/// A connection to the object store and the local cache beside it.
#[derive(Clone)]
pub struct Storage {
    /// The client, shared with the uploader's thread.
    pub store: Arc<RemoteStore>,
    /// Where fetched objects and staged outputs live.
    pub cache_dir: PathBuf,
}

impl Storage {
    /// Where the object `url` is kept in the cache's `area` (`data`, `objects`, `runs`).
    pub fn cache_path(&self, area: &str, url: &ObjectUrl) -> PathBuf {
        url.staging_path(&self.cache_dir, area)
    }

    /// A local copy of the object `url`: fetched into the cache unless the copy there has
    /// the object's size and entity tag already.
    pub fn fetch_object(&self, url: &ObjectUrl) -> Result<PathBuf, CacheError> {
        let local = self.cache_path("objects", url);
        let info = self
            .store
            .head(url)?
            .ok_or_else(|| RemoteError::NoSuchKey {
                url: url.to_string(),
            })?;
        let tag_path = sidecar(&local, "etag");
        let cached_tag = std::fs::read_to_string(&tag_path).ok();
        let current = local.metadata().is_ok_and(|meta| meta.len() == info.size)
            && info.e_tag.is_some()
            && cached_tag.as_deref() == info.e_tag.as_deref();
        if !current {
            self.store.download_listed(url, info.size, &local)?;
            if let Some(tag) = &info.e_tag {
                tandem_files::write_atomically(&tag_path, tag.as_bytes())?;
            }
        }
        Ok(local)
    }

    /// The local folder holding a current copy of every object under `url`, fetching what
    /// is missing or changed. `check` sees each fetched file and its object; a refusal
    /// (its message) fails the fetch.
    pub fn fetch_prefix(
        &self,
        url: &ObjectUrl,
        check: impl Fn(&Path, &ObjectInfo) -> Result<(), String> + Sync,
    ) -> Result<PathBuf, CacheError> {
        let folder = self.cache_path("data", url);
        std::fs::create_dir_all(&folder).map_err(|source| CacheError::Local {
            action: "create cache folder",
            path: folder.clone(),
            source,
        })?;
        let _turn = wait_for_turn(&sidecar(&folder, "lock"), url)?;
        let objects = self.store.list(url).map_err(|source| CacheError::List {
            url: url.to_string(),
            source,
        })?;
        if objects.is_empty() {
            return Err(CacheError::EmptyPrefix {
                url: url.to_string(),
            });
        }
        let manifest_path = sidecar(&folder, "fetched.json");
        let manifest = read_manifest(&manifest_path);
        let missing: Vec<Missing> = objects
            .iter()
            .filter_map(|object| {
                let relative = url.relative_key(&object.url)?;
                let local = relative
                    .split('/')
                    .fold(folder.clone(), |path, segment| path.join(segment));
                let current = manifest.get(relative) == Some(&FetchedObject::of(object))
                    && local.metadata().is_ok_and(|meta| meta.len() == object.size);
                (!current).then_some(Missing {
                    relative,
                    local,
                    object,
                })
            })
            .collect();
        let fetched_bytes: u64 = missing.iter().map(|missing| missing.object.size).sum();
        self.fetch_all(&missing, manifest, &manifest_path, &check)
            .map_err(|source| CacheError::Fetch {
                url: url.to_string(),
                source: Box::new(source),
            })?;
        if missing.is_empty() {
            tell!(
                "data: {} holds a current copy of {url} ({} files)",
                folder.display(),
                objects.len()
            );
        } else {
            tell!(
                "data: fetched {} of {} files ({:.1} MB) from {url} into {}",
                missing.len(),
                objects.len(),
                fetched_bytes as f64 / 1e6,
                folder.display()
            );
        }
        Ok(folder)
    }

    /// Fetches every object of `missing`, [`FETCH_THREADS`] at a time, recording each in the
    /// manifest (written every [`MANIFEST_EVERY`] files and at the end, so an interrupted
    /// fetch keeps most of its progress).
    fn fetch_all(
        &self,
        missing: &[Missing],
        manifest: BTreeMap<String, FetchedObject>,
        manifest_path: &Path,
        check: &(impl Fn(&Path, &ObjectInfo) -> Result<(), String> + Sync),
    ) -> Result<(), CacheError> {
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let manifest = Mutex::new((manifest, 0usize));
        let record = |relative: &str, object: &ObjectInfo| -> Result<(), CacheError> {
            let mut guard = manifest.lock().unwrap_or_else(PoisonError::into_inner);
            let (entries, done) = &mut *guard;
            entries.insert(relative.to_string(), FetchedObject::of(object));
            *done += 1;
            if (*done).is_multiple_of(MANIFEST_EVERY) {
                write_manifest(manifest_path, entries)?;
            }
            Ok(())
        };
        let fetch_one = |missing: &Missing| -> Result<(), CacheError> {
            let Missing {
                relative,
                local,
                object,
            } = missing;
            self.store
                .download_listed(&object.url, object.size, local)?;
            check(local, object).map_err(CacheError::Refused)?;
            record(relative, object)
        };
        let results: Vec<Result<(), CacheError>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..FETCH_THREADS.min(missing.len()))
                .map(|_| {
                    scope.spawn(|| -> Result<(), CacheError> {
                        while !failed.load(Ordering::Relaxed) {
                            let Some(one) = missing.get(next.fetch_add(1, Ordering::Relaxed))
                            else {
                                break;
                            };
                            if let Err(error) = fetch_one(one) {
                                failed.store(true, Ordering::Relaxed);
                                return Err(error);
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|worker| worker.join().unwrap_or(Err(CacheError::Panicked)))
                .collect()
        });
        let (entries, _) = manifest
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        write_manifest(manifest_path, &entries)?;
        results.into_iter().collect()
    }
}

/// An object of a data set whose local copy is missing or out of date.
struct Missing<'a> {
    /// Its key below the data set's prefix.
    relative: &'a str,
    /// Where its copy goes.
    local: PathBuf,
    /// The object as listed.
    object: &'a ObjectInfo,
}

/// What the cache knows of one fetched object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct FetchedObject {
    size: u64,
    e_tag: Option<String>,
}

impl FetchedObject {
    fn of(object: &ObjectInfo) -> FetchedObject {
        FetchedObject {
            size: object.size,
            e_tag: object.e_tag.clone(),
        }
    }
}

/// The manifest of a cache folder; a missing or unreadable one is empty (everything is
/// fetched again).
fn read_manifest(path: &Path) -> BTreeMap<String, FetchedObject> {
    std::fs::read(path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

/// Writes the manifest of a cache folder.
fn write_manifest(
    path: &Path,
    manifest: &BTreeMap<String, FetchedObject>,
) -> Result<(), CacheError> {
    let bytes = serde_json::to_vec_pretty(manifest).map_err(CacheError::Manifest)?;
    Ok(tandem_files::write_atomically(path, &bytes)?)
}

/// Holds the cache folder's lock: waits while another process of this node fetches into it.
fn wait_for_turn(lock_path: &Path, url: &ObjectUrl) -> Result<std::fs::File, CacheError> {
    let local_error = |action| {
        move |source| CacheError::Local {
            action,
            path: lock_path.to_path_buf(),
            source,
        }
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path)
        .map_err(local_error("open lock file"))?;
    let mut noticed = Instant::now() - WAIT_NOTICE;
    while !tandem_files::try_lock_exclusive(&file).map_err(local_error("lock"))? {
        if noticed.elapsed() >= WAIT_NOTICE {
            tell!("data: waiting for another process of this node to fetch {url}");
            noticed = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(file)
}
