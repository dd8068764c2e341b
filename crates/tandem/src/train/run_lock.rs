//! One run at a time in an output folder: an advisory lock (`flock`) on `OUT/tandem.lock`,
//! and in the file a description of its owner (pid, host, start time) for the message a
//! second run gets. The operating system drops the lock when its process ends however it
//! ends, so a description left in an unlocked file is a stale one, from a run that died.

use std::fs::File;
use std::io::{Read, Seek, Write};

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::clock::UtcTime;
use crate::files::{open_regular_file, try_lock_exclusive};
use crate::terminal::printable;

/// The lock file's name in the output folder.
pub const LOCK_FILE_NAME: &str = "tandem.lock";
/// The pause between two attempts to take a lock that another process holds.
const LOCK_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Who holds (or held) the lock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LockOwner {
    /// The owner's process id.
    pub pid: u32,
    /// The host it runs on.
    pub host: String,
    /// When it took the lock, e.g. `2026-12-01 01:32:07 UTC`.
    pub started: String,
}

impl LockOwner {
    /// This process, now.
    fn this_process() -> Self {
        LockOwner {
            pid: std::process::id(),
            host: host_name(),
            started: UtcTime::now().readable(),
        }
    }
}

impl std::fmt::Display for LockOwner {
    /// The owner in words; the host and time come from the lock file, which anyone who can
    /// write the folder can edit, so they are printed escaped.
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "pid {} on host {}, started {}",
            self.pid,
            printable(&self.host),
            printable(&self.started)
        )
    }
}

/// The lock of an output folder, held until dropped.
pub struct RunLock {
    file: File,
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock of `output_dir` (creating the folder), or fails naming the process that
    /// holds it. A description left by a run that died is reported and replaced. A lock
    /// file that is not a regular file (a symbolic link, a FIFO) is refused, naming it: the
    /// lock file is emptied and written, and so would be whatever a link points to.
    pub fn acquire(output_dir: &Path) -> anyhow::Result<RunLock> {
        std::fs::create_dir_all(output_dir)
            .with_context(|| format!("cannot create output folder {}", output_dir.display()))?;
        let path = output_dir.join(LOCK_FILE_NAME);
        let mut options = std::fs::OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        let mut file = open_regular_file(&path, &options)
            .with_context(|| format!("cannot open lock file {}", path.display()))?;
        let locked =
            try_lock_exclusive(&file).with_context(|| format!("cannot lock {}", path.display()))?;
        let previous = read_owner(&mut file);
        if !locked {
            let holder =
                previous.map_or_else(|| "another process".to_string(), |owner| owner.to_string());
            bail!(
                "output folder {} is in use by another run ({holder}); wait for it, stop it, \
                 or choose another --output-dir",
                output_dir.display()
            );
        }
        if let Some(stale) = previous {
            tell!(
                "note: taking over the lock of {}: its run ({stale}) is no longer running",
                output_dir.display()
            );
        }
        let mut lock = RunLock { file, path };
        lock.write_owner(&LockOwner::this_process())?;
        Ok(lock)
    }

    /// [`acquire`](Self::acquire), waiting up to `patience` for a holder that is going away:
    /// the rank 0 of an earlier membership, left out of the job, whose launcher stops it.
    pub fn acquire_within(output_dir: &Path, patience: Duration) -> anyhow::Result<RunLock> {
        let deadline = Instant::now() + patience;
        let mut said = false;
        loop {
            match RunLock::acquire(output_dir) {
                Ok(lock) => return Ok(lock),
                Err(error) if Instant::now() >= deadline => return Err(error),
                Err(error) => {
                    if !said {
                        tell!(
                            "waiting up to {:.0} s for the output folder's lock: {error:#}",
                            patience.as_secs_f64()
                        );
                        said = true;
                    }
                    std::thread::sleep(LOCK_RETRY_PAUSE);
                }
            }
        }
    }

    /// Replaces the lock file's description with `owner`.
    fn write_owner(&mut self, owner: &LockOwner) -> anyhow::Result<()> {
        let text = serde_json::to_string(owner)?;
        let result = (|| {
            self.file.set_len(0)?;
            self.file.rewind()?;
            self.file.write_all(text.as_bytes())?;
            self.file.sync_all()
        })();
        result.with_context(|| format!("cannot write lock file {}", self.path.display()))
    }
}

impl Drop for RunLock {
    /// Empties the description, so that the next run finds no stale owner; closing the file
    /// releases the lock.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// The output folder's lock as the worker that writes the run's files holds it, shared with
/// its heartbeat thread: a worker cut off from the job's store lets go of it, so that the
/// rank 0 of the majority's next membership can write.
#[derive(Clone, Default)]
pub struct OutputLock(Arc<Mutex<HeldLock>>);

/// The lock, when held, and the folder it was last taken for.
#[derive(Default)]
struct HeldLock {
    lock: Option<RunLock>,
    output_dir: Option<PathBuf>,
}

impl OutputLock {
    /// Holds `lock`, taken for `output_dir`.
    pub fn holding(lock: RunLock, output_dir: &Path) -> OutputLock {
        OutputLock(Arc::new(Mutex::new(HeldLock {
            lock: Some(lock),
            output_dir: Some(output_dir.to_path_buf()),
        })))
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HeldLock> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the lock is held.
    pub fn is_held(&self) -> bool {
        self.held().lock.is_some()
    }

    /// Lets go of the lock; returns whether it was held.
    pub fn release(&self) -> bool {
        self.held().lock.take().is_some()
    }

    /// Takes the lock of `output_dir` unless it is held, waiting up to `patience` for a
    /// holder that is going away (see [`RunLock::acquire_within`]).
    pub fn take_within(&self, output_dir: &Path, patience: Duration) -> anyhow::Result<()> {
        if !self.is_held() {
            let lock = RunLock::acquire_within(output_dir, patience)?;
            let mut held = self.held();
            held.lock = Some(lock);
            held.output_dir = Some(output_dir.to_path_buf());
        }
        Ok(())
    }

    /// Takes the lock of the folder it was last taken for again, if nobody holds it now;
    /// returns whether it is held.
    pub fn take_again(&self) -> bool {
        let mut held = self.held();
        if held.lock.is_none() {
            let again = held.output_dir.as_deref().map(RunLock::acquire);
            held.lock = again.and_then(Result::ok);
        }
        held.lock.is_some()
    }
}

/// The description in the lock file, if it holds one.
fn read_owner(file: &mut File) -> Option<LockOwner> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

/// This machine's host name, or `unknown`.
pub fn host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: the pointer and length describe `buffer`, which outlives the call; the name is
    // NUL-terminated when it fits, and we stop at the first NUL or the buffer's end.
    let result = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if result != 0 {
        return "unknown".to_string();
    }
    let end = buffer
        .iter()
        .position(|&byte| byte == 0)
        .unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_read_from_the_lock_file_is_printed_escaped() {
        let owner = LockOwner {
            pid: 7,
            host: "node\u{1b}]0;pwned\u{7}\nerror: x".into(),
            started: "2026-12-01 01:32:07 UTC".into(),
        };
        assert_eq!(
            owner.to_string(),
            "pid 7 on host node\\x1b]0;pwned\\x07\\nerror: x, started 2026-12-01 01:32:07 UTC"
        );
    }

    #[test]
    fn a_second_lock_is_refused_naming_the_owner_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        let error = RunLock::acquire(dir.path())
            .err()
            .expect("a second lock was granted");
        let message = format!("{error:#}");
        assert!(
            message.contains(&format!(
                "pid {} on host {}",
                std::process::id(),
                host_name()
            )),
            "{message}"
        );
        drop(first);
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE_NAME)).unwrap();
        assert_eq!(text, "");
        RunLock::acquire(dir.path()).unwrap();
    }

    #[test]
    fn a_lock_let_go_of_while_waiting_is_taken_and_one_held_too_long_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let held = RunLock::acquire(dir.path()).unwrap();
        assert!(RunLock::acquire_within(dir.path(), Duration::from_millis(200)).is_err());
        std::thread::scope(|scope| {
            scope.spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                drop(held);
            });
            let started = Instant::now();
            RunLock::acquire_within(dir.path(), Duration::from_secs(10)).unwrap();
            assert!(started.elapsed() >= Duration::from_millis(250));
        });
    }
}
