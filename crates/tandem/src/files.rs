//! Writing files so that a crash at any instant leaves either the old file or the new one.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The temporary name a file is written under before it is renamed into place.
pub fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// Writes `bytes` to a temporary name beside `path`, syncs it, and renames it to `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(parent) = path
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create folder {}", parent.display()))?;
    }
    let temporary = temporary_path(path);
    let result = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.with_context(|| format!("cannot write {}", path.display()))?;
    sync_parent(path);
    Ok(())
}

/// Removes the temporary files that writers which are no longer running left in `folder`
/// (a process killed between creating its temporary file and renaming it). A temporary
/// file is one named `<name>.<pid>.tmp`, as [`temporary_path`] and the weights writer of
/// `tandem-models` (`.<name>.<pid>.tmp`) name them; it is stale when no process with that
/// pid is running, or when the pid is this process's own (it has written nothing yet when
/// this runs). A file of a writer that is still running is left alone, whatever its age.
/// Returns the names removed; a folder that does not exist has none.
pub fn remove_stale_temporaries(folder: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(folder) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot list folder {}", folder.display()))
        }
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list folder {}", folder.display()))?;
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(temporary_writer_pid) else {
            continue;
        };
        if !entry.file_type().is_ok_and(|kind| kind.is_file()) || is_running_elsewhere(pid) {
            continue;
        }
        let path = entry.path();
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            // Another process cleaning the same folder got there first.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                return Err(error).with_context(|| format!("cannot remove {}", path.display()))
            }
        }
    }
    Ok(removed)
}

/// The writer's pid in a temporary file name `<name>.<pid>.tmp`, if it is one.
fn temporary_writer_pid(file_name: &str) -> Option<u32> {
    let stem = file_name.strip_suffix(".tmp")?;
    let (name, pid) = stem.rsplit_once('.')?;
    if name.is_empty() || pid.is_empty() || !pid.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether a process other than this one runs with `pid` (or might: when the system does
/// not say, the file is kept).
fn is_running_elsewhere(pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled; nothing is sent.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    alive || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Syncs the folder holding `path`, so that a rename in it survives a power loss.
fn sync_parent(path: &Path) {
    if let Some(parent) = path.parent() {
        let folder = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        if let Ok(handle) = std::fs::File::open(folder) {
            let _ = handle.sync_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_give_their_writer_pid() {
        assert_eq!(
            temporary_writer_pid("snapshot.safetensors.4242.tmp"),
            Some(4242)
        );
        assert_eq!(
            temporary_writer_pid(".epoch_3.safetensors.17.tmp"),
            Some(17)
        );
        assert_eq!(temporary_writer_pid("snapshot.safetensors"), None);
        assert_eq!(temporary_writer_pid("notes.tmp"), None);
        assert_eq!(temporary_writer_pid("a.12x.tmp"), None);
        assert_eq!(temporary_writer_pid(".12.tmp"), None);
    }

    #[test]
    fn only_files_of_writers_that_are_gone_are_removed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let dead = dir
            .path()
            .join(format!("snapshot.safetensors.{}.tmp", 1u32 << 30));
        let own = temporary_path(&dir.path().join("metrics.jsonl"));
        // pid 1 always runs (init); its file belongs to a live writer.
        let live = dir.path().join("snapshot.safetensors.1.tmp");
        let other = dir.path().join("snapshot.safetensors");
        for path in [&dead, &own, &live, &other] {
            std::fs::write(path, b"x").expect("write");
        }
        let mut removed = remove_stale_temporaries(dir.path()).expect("clean");
        removed.sort();
        let mut expected = vec![dead.clone(), own.clone()];
        expected.sort();
        assert_eq!(removed, expected);
        assert!(live.exists() && other.exists());
        assert!(!dead.exists() && !own.exists());
        assert_eq!(
            remove_stale_temporaries(&dir.path().join("absent")).expect("absent folder"),
            Vec::<PathBuf>::new()
        );
    }
}
