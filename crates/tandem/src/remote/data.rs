//! A data set under an object prefix, fetched once into the local cache and read from there.
//!
//! Every object below the prefix is copied to the same relative path in
//! `CACHE/data/BUCKET/KEY/`, so all four sources (binary, pickle, JSON + images, and a
//! `.tar.gz` of either CIFAR-10 layout) read the copy as they read a local folder. A file
//! beside the folder records each object's size and entity tag; a second run fetches only
//! what changed, and an interrupted fetch resumes with the files it lacks. The processes of
//! one node take turns (a lock beside the folder), so one of them fetches and the others
//! find the copy current. Sizes are checked on every transfer, and the files whose official
//! md5 is known (the CIFAR-10 archives and binary batches) are checked against it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tandem_remote::{ObjectInfo, ObjectUrl};

use tandem_files::sidecar;

use super::{object_url, Storage};
use crate::settings::{DataKind, DataSettings};

/// CIFAR-10's official files: name, size and md5. A fetched file with an official name and
/// size must have its md5; a file of another size is somebody's own subset, left alone.
const KNOWN_FILES: [(&str, u64, &str); 8] = [
    (
        tandem_data::CIFAR10_ARCHIVE_NAME,
        170_052_171,
        tandem_data::CIFAR10_MD5,
    ),
    (
        "cifar-10-python.tar.gz",
        170_498_071,
        "c58f30108f718f92721af3b95e74349a",
    ),
    (
        "data_batch_1.bin",
        BIN_BATCH_BYTES,
        "5dd7e06a14cb22eb9f671a540d1b7c25",
    ),
    (
        "data_batch_2.bin",
        BIN_BATCH_BYTES,
        "5ea93a67294ea407fff1d09f752e9692",
    ),
    (
        "data_batch_3.bin",
        BIN_BATCH_BYTES,
        "942cd6a4bcdd0dd3c604fbe906cb4421",
    ),
    (
        "data_batch_4.bin",
        BIN_BATCH_BYTES,
        "ae636b3ba5c66a11e91e8cb52e771fcb",
    ),
    (
        "data_batch_5.bin",
        BIN_BATCH_BYTES,
        "53f37980c15c3d472c316c40844f3f0d",
    ),
    (
        "test_batch.bin",
        BIN_BATCH_BYTES,
        "803d5f7f4d78ea53de84dbe85f74fb6d",
    ),
];
/// A binary batch: 10,000 records of a label byte and 3,072 pixel bytes.
const BIN_BATCH_BYTES: u64 = 10_000 * 3_073;

/// How often a process waiting for another's fetch says so.
const WAIT_NOTICE: Duration = Duration::from_secs(30);

/// Objects fetched at once.
const FETCH_THREADS: usize = 8;
/// The manifest is written after this many fetched files (and at the end).
const MANIFEST_EVERY: usize = 64;

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

/// For data whose folder is an object URL, the folder of its copy in the cache (fetched
/// as [`fetch_data`] does); `None` for a local folder or synthetic data.
pub fn fetched_data_dir(storage: &Storage, data: &DataSettings) -> anyhow::Result<Option<PathBuf>> {
    let Some(url) = object_url(&data.data_dir)? else {
        return Ok(None);
    };
    if data.data == DataKind::Synthetic {
        return Ok(None);
    }
    if data.download {
        bail!(
            "--download fetches CIFAR-10 into a local --data-dir; {url} is in object storage, \
             whose copy is fetched instead: leave out --download"
        );
    }
    fetch_data(storage, &url).map(Some)
}

/// The local folder holding a current copy of every object under `url`, fetching what is
/// missing or changed.
pub fn fetch_data(storage: &Storage, url: &ObjectUrl) -> anyhow::Result<PathBuf> {
    let folder = storage.cache_path("data", url);
    std::fs::create_dir_all(&folder)
        .with_context(|| format!("cannot create cache folder {}", folder.display()))?;
    let _turn = wait_for_turn(&sidecar(&folder, "lock"), url)?;
    let objects = storage
        .store
        .list(url)
        .with_context(|| format!("cannot list the data set at {url}"))?;
    if objects.is_empty() {
        bail!("{url} holds no objects: expected the data set's files under this prefix");
    }
    let manifest_path = sidecar(&folder, "fetched.json");
    let manifest = read_manifest(&manifest_path);
    let missing: Vec<(&str, PathBuf, &ObjectInfo)> = objects
        .iter()
        .filter_map(|object| {
            let relative = url.relative_key(&object.url)?;
            let local = relative
                .split('/')
                .fold(folder.clone(), |path, segment| path.join(segment));
            let current = manifest.get(relative) == Some(&FetchedObject::of(object))
                && local.metadata().is_ok_and(|meta| meta.len() == object.size);
            (!current).then_some((relative, local, object))
        })
        .collect();
    let fetched = missing.len();
    let fetched_bytes: u64 = missing.iter().map(|(_, _, object)| object.size).sum();
    fetch_all(storage, &missing, manifest, &manifest_path)
        .with_context(|| format!("cannot fetch the data set from {url}"))?;
    if fetched == 0 {
        tell!(
            "data: {} holds a current copy of {url} ({} files)",
            folder.display(),
            objects.len()
        );
    } else {
        tell!(
            "data: fetched {fetched} of {} files ({:.1} MB) from {url} into {}",
            objects.len(),
            fetched_bytes as f64 / 1e6,
            folder.display()
        );
    }
    Ok(folder)
}

/// Fetches every `(relative key, local path, object)` of `missing`, [`FETCH_THREADS`] at a
/// time, recording each in the manifest (written every [`MANIFEST_EVERY`] files and at the
/// end, so an interrupted fetch keeps most of its progress).
fn fetch_all(
    storage: &Storage,
    missing: &[(&str, PathBuf, &ObjectInfo)],
    manifest: BTreeMap<String, FetchedObject>,
    manifest_path: &Path,
) -> anyhow::Result<()> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let manifest = Mutex::new((manifest, 0usize));
    let record = |relative: &str, object: &ObjectInfo| -> anyhow::Result<()> {
        let mut guard = manifest.lock().unwrap_or_else(PoisonError::into_inner);
        let (entries, done) = &mut *guard;
        entries.insert(relative.to_string(), FetchedObject::of(object));
        *done += 1;
        if (*done).is_multiple_of(MANIFEST_EVERY) {
            write_manifest(manifest_path, entries)?;
        }
        Ok(())
    };
    let results: Vec<anyhow::Result<()>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..FETCH_THREADS.min(missing.len()))
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<()> {
                    while !failed.load(Ordering::Relaxed) {
                        let Some((relative, local, object)) =
                            missing.get(next.fetch_add(1, Ordering::Relaxed))
                        else {
                            break;
                        };
                        let outcome = storage
                            .store
                            .download_listed(&object.url, object.size, local)
                            .map_err(anyhow::Error::from)
                            .and_then(|()| check_known_md5(local, object))
                            .and_then(|()| record(relative, object));
                        if outcome.is_err() {
                            failed.store(true, Ordering::Relaxed);
                            return outcome;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a fetching thread panicked")))
            })
            .collect()
    });
    let (entries, _) = manifest
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    write_manifest(manifest_path, &entries)?;
    results.into_iter().collect()
}

/// Fails when `path` holds one of CIFAR-10's official files (by name and size) without its
/// md5; the file is removed so that the next run fetches it again.
fn check_known_md5(path: &Path, object: &ObjectInfo) -> anyhow::Result<()> {
    let Some((_, _, expected)) = KNOWN_FILES
        .iter()
        .find(|(name, size, _)| *name == object.url.file_name() && *size == object.size)
    else {
        return Ok(());
    };
    let actual = tandem_data::file_md5(path)?;
    if actual != *expected {
        let _ = std::fs::remove_file(path);
        bail!(
            "{}: md5 is {actual}, expected CIFAR-10's {expected}: the object is damaged (its \
             copy was removed)",
            object.url
        );
    }
    Ok(())
}

/// The manifest of a cache folder; a missing or unreadable one is empty (everything is
/// fetched again).
fn read_manifest(path: &Path) -> BTreeMap<String, FetchedObject> {
    std::fs::read(path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

fn write_manifest(path: &Path, manifest: &BTreeMap<String, FetchedObject>) -> anyhow::Result<()> {
    Ok(crate::files::write_atomically(
        path,
        &serde_json::to_vec_pretty(manifest)?,
    )?)
}

/// Holds the cache folder's lock: waits while another process of this node fetches into it.
fn wait_for_turn(lock_path: &Path, url: &ObjectUrl) -> anyhow::Result<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path)
        .with_context(|| format!("cannot open lock file {}", lock_path.display()))?;
    let mut noticed = Instant::now() - WAIT_NOTICE;
    while !crate::files::try_lock_exclusive(&file)
        .with_context(|| format!("cannot lock {}", lock_path.display()))?
    {
        if noticed.elapsed() >= WAIT_NOTICE {
            tell!("data: waiting for another process of this node to fetch {url}");
            noticed = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(file)
}
