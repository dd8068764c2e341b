//! The uploads of a run that are not done yet, kept on disk beside its staging folder, so
//! that what one process could not upload (the object store was down, the process was
//! killed) is uploaded by the next one with the same cache before it does anything else.
//!
//! Each job is one small JSON file in `STAGING.pending-uploads/`, written (atomically) when
//! the job is queued and removed once it is done. One file per job lets the processes that
//! share a cache (a launcher and its workers, the nodes of a job on a shared disk) add and
//! remove their own jobs without rewriting each other's. The file names begin with the time
//! they were written, so the jobs are found in the order they were queued.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tandem_files::{sidecar, tell};

use super::{Job, UploadsError};
use crate::ObjectUrl;

/// A job as its file records it: the objects only, since the staged file of an object
/// follows from its URL.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
enum Record {
    /// Upload the staged file of this object.
    Put { url: String },
    /// Delete the epoch checkpoints under this prefix but the last `keep`.
    PruneCheckpoints { prefix: String, keep: usize },
}

impl Record {
    fn of(job: &Job) -> Record {
        match job {
            Job::Put { url, .. } => Record::Put {
                url: url.to_string(),
            },
            Job::PruneCheckpoints { prefix, keep } => Record::PruneCheckpoints {
                prefix: prefix.to_string(),
                keep: *keep,
            },
        }
    }
}

/// The folder of pending uploads of the staging folder (or file) `staging`.
pub fn pending_folder(staging: &Path) -> PathBuf {
    sidecar(staging, "pending-uploads")
}

/// The pending uploads of one staging folder: the files of the jobs this process has
/// recorded or found there.
pub struct PendingUploads {
    folder: PathBuf,
    files: HashMap<Record, Vec<PathBuf>>,
    /// Files written by this process so far (part of each new file's name).
    written: u64,
}

impl PendingUploads {
    /// Opens the folder `folder` and returns the jobs recorded there, oldest first; each
    /// object's staged file is `local_of(url)`. A job whose object is outside this run's
    /// outputs is left in place and reported.
    pub fn open(
        folder: &Path,
        local_of: impl Fn(&ObjectUrl) -> Option<PathBuf>,
    ) -> Result<(PendingUploads, Vec<Job>), UploadsError> {
        let mut pending = PendingUploads {
            folder: folder.to_path_buf(),
            files: HashMap::new(),
            written: 0,
        };
        tandem_files::remove_stale_temporaries(folder)?;
        let mut jobs = Vec::new();
        for (path, record) in read_records(folder)? {
            let Some(job) = job_of(&record, &path, &local_of)? else {
                tell!(
                    "warning: {} names an object outside this run's outputs; left for the run \
                     it belongs to",
                    path.display()
                );
                continue;
            };
            let files = pending.files.entry(record).or_default();
            if files.is_empty() {
                jobs.push(job);
            }
            files.push(path);
        }
        // A prune runs after every upload it may concern.
        jobs.sort_by_key(|job| matches!(job, Job::PruneCheckpoints { .. }));
        Ok((pending, jobs))
    }

    /// The folder the jobs are kept in.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// How many jobs are pending, as far as this process knows.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether no job is pending, as far as this process knows.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Records `job` as pending (once, however often it is queued).
    pub fn record(&mut self, job: &Job) -> Result<(), UploadsError> {
        let record = Record::of(job);
        if self.files.contains_key(&record) {
            return Ok(());
        }
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        self.written += 1;
        let path = self.folder.join(format!(
            "{:020}-{}-{}.json",
            since_epoch.as_nanos(),
            std::process::id(),
            self.written
        ));
        let bytes = serde_json::to_vec(&record).map_err(UploadsError::Encode)?;
        tandem_files::write_atomically(&path, &bytes).map_err(UploadsError::Record)?;
        self.files.insert(record, vec![path]);
        Ok(())
    }

    /// Forgets `job`: it is done.
    pub fn done(&mut self, job: &Job) -> Result<(), UploadsError> {
        for path in self.files.remove(&Record::of(job)).unwrap_or_default() {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                // Another process that shares the cache did the same job.
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(UploadsError::Remove { path, source }),
            }
        }
        if self.files.is_empty() {
            // Left in place while another process still has jobs in it.
            let _ = std::fs::remove_dir(&self.folder);
        }
        Ok(())
    }
}

/// The records in `folder` with their files, oldest first; none when it does not exist.
fn read_records(folder: &Path) -> Result<Vec<(PathBuf, Record)>, UploadsError> {
    let entries = tandem_files::folder_entries(folder).map_err(|source| UploadsError::List {
        path: folder.to_path_buf(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = entries
        .iter()
        .map(std::fs::DirEntry::path)
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "json")
        })
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let bytes = match std::fs::read(&path) {
                Ok(bytes) => bytes,
                Err(source) => return Err(UploadsError::Read { path, source }),
            };
            match serde_json::from_slice(&bytes) {
                Ok(record) => Ok((path, record)),
                Err(source) => Err(UploadsError::NotARecord { path, source }),
            }
        })
        .collect()
}

/// The job `record` (kept in `path`) stands for; `None` when `local_of` knows no staged file
/// for its object.
fn job_of(
    record: &Record,
    path: &Path,
    local_of: &impl Fn(&ObjectUrl) -> Option<PathBuf>,
) -> Result<Option<Job>, UploadsError> {
    let parse = |text: &str| -> Result<ObjectUrl, UploadsError> {
        ObjectUrl::parse(text)
            .map_err(|source| UploadsError::InvalidUrl {
                path: path.to_path_buf(),
                source: Box::new(source),
            })?
            .ok_or_else(|| UploadsError::NotAnObjectUrl {
                path: path.to_path_buf(),
                text: text.to_string(),
            })
    };
    Ok(match record {
        Record::Put { url } => {
            let url = parse(url)?;
            local_of(&url).map(|local| Job::Put { local, url })
        }
        Record::PruneCheckpoints { prefix, keep } => {
            let prefix = parse(prefix)?;
            local_of(&prefix).map(|_| Job::PruneCheckpoints {
                prefix,
                keep: *keep,
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> ObjectUrl {
        ObjectUrl::parse(text)
            .expect("a valid URL")
            .expect("an object URL")
    }

    /// The staged file of an object of bucket `runs` under `root`.
    fn local_under(root: &Path) -> impl Fn(&ObjectUrl) -> Option<PathBuf> + '_ {
        move |object: &ObjectUrl| {
            (object.bucket() == "runs").then(|| root.join(object.key().replace('/', "-")))
        }
    }

    #[test]
    fn recorded_jobs_are_found_by_the_next_process_in_order_until_done() {
        let scratch = tempfile::tempdir().expect("a temporary folder");
        let folder = scratch.path().join("out.pending-uploads");
        let local = local_under(scratch.path());
        let checkpoint = Job::Put {
            local: scratch.path().join("f-epoch_1.safetensors"),
            url: url("s3://runs/f/epoch_1.safetensors"),
        };
        let prune = Job::PruneCheckpoints {
            prefix: url("s3://runs/f"),
            keep: 1,
        };
        let snapshot = Job::Put {
            local: scratch.path().join("f-snapshot.safetensors"),
            url: url("obs://runs/f/snapshot.safetensors"),
        };
        let (mut first, found) = PendingUploads::open(&folder, &local).expect("opens");
        assert!(found.is_empty());
        for job in [&checkpoint, &prune, &snapshot, &checkpoint] {
            first.record(job).expect("recorded");
        }
        assert_eq!(first.len(), 3);
        assert_eq!(std::fs::read_dir(&folder).expect("the folder").count(), 3);

        let (mut second, found) = PendingUploads::open(&folder, &local).expect("opens");
        assert_eq!(found, [checkpoint.clone(), snapshot.clone(), prune.clone()]);
        second.done(&checkpoint).expect("done");
        second.done(&prune).expect("done");
        let (_, found) = PendingUploads::open(&folder, &local).expect("opens");
        assert_eq!(found, std::slice::from_ref(&snapshot));
        second.done(&snapshot).expect("done");
        assert!(!folder.exists(), "an empty folder is removed");
    }

    #[test]
    fn a_damaged_record_is_named_and_a_foreign_one_is_left_alone() {
        let scratch = tempfile::tempdir().expect("a temporary folder");
        let folder = scratch.path().join("out.pending-uploads");
        std::fs::create_dir_all(&folder).expect("the folder");
        let foreign = folder.join("1-1-1.json");
        std::fs::write(&foreign, r#"{"put":{"url":"s3://other/x"}}"#).expect("written");
        let (pending, found) =
            PendingUploads::open(&folder, local_under(scratch.path())).expect("opens");
        assert!(found.is_empty());
        assert_eq!(pending.len(), 0);
        assert!(foreign.exists());

        let damaged = folder.join("2-1-1.json");
        std::fs::write(&damaged, "{\"put\":").expect("written");
        let error = PendingUploads::open(&folder, local_under(scratch.path()))
            .err()
            .expect("refused");
        assert!(
            error.to_string().starts_with(&format!(
                "{} is not a pending upload (expected {{\"put\":",
                damaged.display()
            )),
            "{error}"
        );
    }
}
