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
