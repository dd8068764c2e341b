//! Files and text that a Tandem run writes. A crash at any instant leaves either the old
//! file or the new one, and nothing is written through a symbolic link (or into a FIFO) that
//! someone else put at a name Tandem writes.
//!
//! Every file is opened so that a link is never followed: a file that must be new (a
//! temporary file, a TensorBoard event file) with `O_EXCL`, so a name already taken is
//! refused rather than written through; a file that is appended to or locked must be a
//! regular file. A name that is taken is refused with an error naming it, never removed: it
//! is not ours. [`terminal`] makes text that Tandem did not write safe to print.

pub mod terminal;

use std::fs::{File, OpenOptions, Permissions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// A file operation that failed, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The folder that holds a file could not be created.
    #[error("cannot create folder {}", .path.display())]
    CreateFolder {
        /// The folder.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The temporary file a write goes through could not be created.
    #[error("cannot write {}: cannot create its temporary file {}", .path.display(), .temporary.display())]
    CreateTemporary {
        /// The file being written.
        path: PathBuf,
        /// Its temporary name.
        temporary: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// Writing, syncing or renaming a file failed.
    #[error("cannot write {}", .path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A folder could not be listed.
    #[error("cannot list folder {}", .path.display())]
    ListFolder {
        /// The folder.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A file could not be removed.
    #[error("cannot remove {}", .path.display())]
    Remove {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

/// `error` and its causes in one line, joined by `: ` (as `anyhow` prints an error with `{:#}`).
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        text.push_str(": ");
        text.push_str(&next.to_string());
        cause = next.source();
    }
    text
}

/// `PATH.NAME`: a file kept beside `path` (a folder or a file).
pub fn sidecar(path: &Path, name: &str) -> PathBuf {
    let mut file_name = path.file_name().unwrap_or_default().to_os_string();
    file_name.push(format!(".{name}"));
    path.with_file_name(file_name)
}

/// The name of the checkpoint of epoch `epoch`: `epoch_N.safetensors`.
pub fn checkpoint_name(epoch: u64) -> String {
    format!("epoch_{epoch}.safetensors")
}

/// N of an epoch checkpoint's name, `epoch_N.safetensors`.
pub fn checkpoint_epoch(name: &str) -> Option<u64> {
    name.strip_prefix("epoch_")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

/// The temporary name a file is written under before it is renamed into place:
/// `<name>.<pid>.tmp`, so that a writer that died can be told from one still running.
pub fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// Writes `bytes` to a temporary name beside `path`, syncs it, renames it to `path` and syncs
/// the folder. The temporary file must be new: a symbolic link (or anything else) already at
/// its name is refused, naming it. Whatever `path` itself was, a link included, the rename
/// replaces it with the new regular file; a link's target is never opened.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    write_atomically_with_mode(path, bytes, 0o666)
}

/// [`write_atomically`] for a file that only its owner may read or write (mode 0600 from
/// its creation), such as one that holds a secret.
pub fn write_private_atomically(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    write_atomically_with_mode(path, bytes, 0o600)
}

/// [`write_atomically`] with the temporary file created with `mode` (before the umask).
fn write_atomically_with_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FileError> {
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(folder).map_err(|source| FileError::CreateFolder {
        path: folder.to_path_buf(),
        source,
    })?;
    let temporary = temporary_path(path);
    let mut file =
        new_temporary_file(&temporary, mode).map_err(|source| FileError::CreateTemporary {
            path: path.to_path_buf(),
            temporary: temporary.clone(),
            source,
        })?;
    let write_error = |source| FileError::Write {
        path: path.to_path_buf(),
        source,
    };
    file.write_all(bytes)
        .and_then(|()| file.as_file().sync_all())
        .map_err(write_error)?;
    // A failed rename hands the file back; dropping it removes the temporary name.
    file.persist(path)
        .map_err(|persist| write_error(persist.error))?;
    sync_folder(folder);
    Ok(())
}

/// Creates the temporary file at exactly `temporary` (no random part, one try) with `mode`,
/// removed again if it is dropped before it is persisted.
fn new_temporary_file(temporary: &Path, mode: u32) -> std::io::Result<tempfile::NamedTempFile> {
    let name = temporary.file_name().unwrap_or_default();
    let folder = temporary.parent().unwrap_or(Path::new("."));
    tempfile::Builder::new()
        .prefix(name)
        .suffix("")
        .rand_bytes(0)
        .permissions(Permissions::from_mode(mode))
        .tempfile_in(folder)
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::AlreadyExists => name_taken(temporary),
            _ => error,
        })
}

/// Creates `path` for writing; the name must be free. A name already taken, by a file, a
/// symbolic link (dangling or not) or anything else, is refused, saying what holds it.
pub fn create_new_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::AlreadyExists => name_taken(path),
            _ => error,
        })
}

/// The refusal of a name that is taken already.
fn name_taken(path: &Path) -> std::io::Error {
    refusal(std::io::ErrorKind::AlreadyExists, path, |what| {
        format!(
            "the name is taken already, by {what}; tandem writes only files it creates: remove it"
        )
    })
}

/// A refusal of `kind` to write at `path`: `message` of what is there (see [`what_is_at`]).
fn refusal(
    kind: std::io::ErrorKind,
    path: &Path,
    message: impl FnOnce(&str) -> String,
) -> std::io::Error {
    std::io::Error::new(kind, message(&what_is_at(path)))
}

/// Opens `path` with `options` (creating it when they say so) when it is a regular file: a
/// symbolic link, a FIFO, a socket or a folder at that name is refused, saying which, rather
/// than written through or waited on.
pub fn open_regular_file(path: &Path, options: &OpenOptions) -> std::io::Result<File> {
    let mut options = options.clone();
    // O_NONBLOCK: opening a FIFO must fail or return at once, not wait for a reader; it has
    // no effect on a regular file.
    options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    let file = options.open(path).map_err(|error| {
        match error.raw_os_error() {
            // ELOOP: the name is a symbolic link; ENXIO: a FIFO without a reader or a socket.
            Some(libc::ELOOP | libc::ENXIO) => not_a_regular_file(path),
            _ => error,
        }
    })?;
    if !file.metadata()?.file_type().is_file() {
        return Err(not_a_regular_file(path));
    }
    Ok(file)
}

/// Creates the folder `path` (and its parents) where a run keeps files of its own
/// (`logs/`, `errors/`); a symbolic link at that name is refused, as what is written there
/// would land wherever it points.
pub fn create_own_folder(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_dir() => Ok(()),
        Ok(_) => {
            Err(refusal(std::io::ErrorKind::InvalidInput, path, |what| {
                format!("it is {what}, not a folder; tandem writes only into folders it creates: remove it")
            }))
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(path),
        Err(error) => Err(error),
    }
}

/// The refusal of a name that holds something other than a regular file.
fn not_a_regular_file(path: &Path) -> std::io::Error {
    refusal(std::io::ErrorKind::InvalidInput, path, |what| {
        format!("it is {what}, not a regular file; tandem writes only regular files: remove it")
    })
}

/// What holds the name `path`, in words ("a symbolic link to /etc/passwd").
fn what_is_at(path: &Path) -> String {
    let Ok(metadata) = std::fs::symlink_metadata(path) else {
        return "something that cannot be examined".to_string();
    };
    let kind = metadata.file_type();
    if kind.is_symlink() {
        return match std::fs::read_link(path) {
            Ok(target) => format!(
                "a symbolic link to {}",
                terminal::printable(&target.to_string_lossy())
            ),
            Err(_) => "a symbolic link".to_string(),
        };
    }
    let words = if kind.is_file() {
        "a regular file"
    } else if kind.is_dir() {
        "a folder"
    } else if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a device"
    };
    words.to_string()
}

/// Removes the temporary files that writers which are no longer running left in `folder`
/// (a process killed between creating its temporary file and renaming it). A temporary
/// file is one named `<name>.<pid>.tmp`, as [`temporary_path`] names them; it is stale when no process with that
/// pid is running, or when the pid is this process's own (it has written nothing yet when
/// this runs). A file of a writer that is still running is left alone, whatever its age.
/// Returns the names removed; a folder that does not exist has none.
pub fn remove_stale_temporaries(folder: &Path) -> Result<Vec<PathBuf>, FileError> {
    let entries = folder_entries(folder).map_err(|source| FileError::ListFolder {
        path: folder.to_path_buf(),
        source,
    })?;
    let mut removed = Vec::new();
    for entry in entries {
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
            Err(source) => return Err(FileError::Remove { path, source }),
        }
    }
    Ok(removed)
}

/// The entries of `folder`, in the order the system lists them; none when it does not exist.
pub fn folder_entries(folder: &Path) -> std::io::Result<Vec<std::fs::DirEntry>> {
    match std::fs::read_dir(folder) {
        Ok(entries) => entries.collect(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(error) => Err(error),
    }
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

/// Syncs `folder`, so that a rename in it survives a power loss. Not every file system
/// allows syncing a folder; where it does not, the rename stands unsynced.
fn sync_folder(folder: &Path) {
    if let Ok(handle) = File::open(folder) {
        let _ = handle.sync_all();
    }
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file`: `Ok(false)` when another process holds it.
pub fn try_lock_exclusive(file: &File) -> std::io::Result<bool> {
    loop {
        // SAFETY: the descriptor belongs to `file`, which is open for the whole call.
        let result = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if result == 0 {
            return Ok(true);
        }
        let error = std::io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(error),
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

    /// A file outside the folder, and a link to it planted at `at`.
    fn planted_link(dir: &Path, at: &Path) -> PathBuf {
        let victim = dir.join("victim.txt");
        std::fs::write(&victim, "precious").expect("write the victim");
        std::os::unix::fs::symlink(&victim, at).expect("plant the link");
        victim
    }

    /// The file a planted link pointed at still holds what it held.
    fn assert_victim_untouched(victim: &Path) {
        assert_eq!(std::fs::read_to_string(victim).expect("victim"), "precious");
    }

    #[test]
    fn a_link_at_the_temporary_name_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("metrics.jsonl");
        let temporary = temporary_path(&path);
        let victim = planted_link(dir.path(), &temporary);
        let error = write_atomically(&path, b"{}\n").expect_err("written through the link");
        assert_eq!(
            with_causes(&error),
            format!(
                "cannot write {}: cannot create its temporary file {}: the name is taken \
                 already, by a symbolic link to {}; tandem writes only files it creates: \
                 remove it",
                path.display(),
                temporary.display(),
                victim.display()
            )
        );
        assert_victim_untouched(&victim);
        assert!(std::fs::symlink_metadata(&temporary)
            .expect("the link")
            .file_type()
            .is_symlink());
        assert!(!path.exists());
    }

    #[test]
    fn a_link_at_the_final_name_is_replaced_by_a_regular_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("config.toml");
        let victim = planted_link(dir.path(), &path);
        write_atomically(&path, b"epochs = 1\n").expect("write");
        assert_victim_untouched(&victim);
        assert!(std::fs::symlink_metadata(&path)
            .expect("the file")
            .file_type()
            .is_file());
        assert_eq!(std::fs::read(&path).expect("read"), b"epochs = 1\n");
    }

    #[test]
    fn a_new_file_refuses_any_name_that_is_taken() {
        let dir = tempfile::tempdir().expect("temp dir");
        let link = dir.path().join("events.out.tfevents.1.host.2");
        let victim = planted_link(dir.path(), &link);
        let error = create_new_file(&link).expect_err("opened through the link");
        assert_eq!(
            error.to_string(),
            format!(
                "the name is taken already, by a symbolic link to {}; tandem writes only \
                 files it creates: remove it",
                victim.display()
            )
        );
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("absent"), &dangling).expect("link");
        assert!(create_new_file(&dangling).is_err());
        assert!(
            !dir.path().join("absent").exists(),
            "the link's target was created"
        );
        let error = create_new_file(&victim).expect_err("a file was opened again");
        assert!(error.to_string().contains("by a regular file"), "{error}");
        assert_victim_untouched(&victim);
        create_new_file(&dir.path().join("free")).expect("a free name");
    }

    #[test]
    fn only_a_regular_file_is_opened_for_appending_or_locking() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut append = OpenOptions::new();
        append.create(true).append(true);
        let link = dir.path().join("rank_0.log");
        let victim = planted_link(dir.path(), &link);
        let error = open_regular_file(&link, &append).expect_err("opened through the link");
        assert_eq!(
            error.to_string(),
            format!(
                "it is a symbolic link to {}, not a regular file; tandem writes only regular \
                 files: remove it",
                victim.display()
            )
        );
        assert_victim_untouched(&victim);

        let fifo = dir.path().join("tandem.lock");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("name");
        // SAFETY: `name` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let mut lock = OpenOptions::new();
        lock.read(true).write(true).create(true);
        for options in [&append, &lock] {
            let error = open_regular_file(&fifo, options).expect_err("a FIFO was opened");
            assert_eq!(
                error.to_string(),
                "it is a FIFO (named pipe), not a regular file; tandem writes only regular \
                 files: remove it"
            );
        }
        let error = open_regular_file(dir.path(), &lock).expect_err("a folder was opened");
        assert_eq!(error.raw_os_error(), Some(libc::EISDIR), "{error}");

        let log = dir.path().join("rank_1.log");
        let mut file = open_regular_file(&log, &append).expect("a new log");
        file.write_all(b"line\n").expect("append");
        let mut file = open_regular_file(&log, &append).expect("the log again");
        file.write_all(b"more\n").expect("append");
        assert_eq!(std::fs::read(&log).expect("read"), b"line\nmore\n");
    }

    #[test]
    fn a_folder_of_our_own_is_never_a_link() {
        let dir = tempfile::tempdir().expect("temp dir");
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("folder");
        let logs = dir.path().join("logs");
        std::os::unix::fs::symlink(&elsewhere, &logs).expect("link");
        let error = create_own_folder(&logs).expect_err("a link was taken for a folder");
        assert_eq!(
            error.to_string(),
            format!(
                "it is a symbolic link to {}, not a folder; tandem writes only into folders \
                 it creates: remove it",
                elsewhere.display()
            )
        );
        let errors = dir.path().join("run/errors");
        create_own_folder(&errors).expect("a new folder");
        create_own_folder(&errors).expect("the folder again");
        assert!(errors.is_dir());
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
