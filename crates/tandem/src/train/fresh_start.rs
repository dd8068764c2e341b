//! `--fresh`: start a run over in a folder that holds one, after moving the old run's files
//! aside into `OUT/previous-<time>/`, so that nothing is lost.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::clock::UtcTime;
use crate::train::snapshot::previous_path;

/// Whether `name` is a file a run writes in its output folder (logs and error files of
/// `tandem launch` stay: the launcher is writing them as the run starts).
fn is_run_file(name: &str) -> bool {
    matches!(name, "config.toml" | "metrics.jsonl" | "curves.png")
        || (name.starts_with("epoch_") && name.ends_with(".safetensors"))
        || name.starts_with("events.out.tfevents.")
}

/// Moves the run files of `output_dir`, and the snapshot and its `.prev` wherever they are,
/// into a new `output_dir/previous-<time>/`; returns that folder, or `None` when there was
/// nothing to move.
pub fn move_previous_run_aside(
    output_dir: &Path,
    snapshot: &Path,
) -> anyhow::Result<Option<PathBuf>> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(output_dir) {
        Ok(entries) => entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_file()))
            .filter(|entry| entry.file_name().to_str().is_some_and(is_run_file))
            .map(|entry| entry.path())
            .collect(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot list {}", output_dir.display()))
        }
    };
    files.extend(
        [snapshot.to_path_buf(), previous_path(snapshot)]
            .into_iter()
            .filter(|path| path.is_file()),
    );
    if files.is_empty() {
        return Ok(None);
    }
    let aside = unused_folder(
        output_dir,
        &format!("previous-{}", UtcTime::now().compact()),
    );
    std::fs::create_dir_all(&aside)
        .with_context(|| format!("cannot create {}", aside.display()))?;
    for file in files {
        let target = aside.join(file.file_name().unwrap_or_default());
        std::fs::rename(&file, &target)
            .with_context(|| format!("cannot move {} to {}", file.display(), target.display()))?;
    }
    Ok(Some(aside))
}

/// `parent/name`, or `parent/name-2`, `-3`, ... when it exists.
fn unused_folder(parent: &Path, name: &str) -> PathBuf {
    let mut candidate = parent.join(name);
    let mut suffix = 2;
    while candidate.exists() {
        candidate = parent.join(format!("{name}-{suffix}"));
        suffix += 1;
    }
    candidate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_files_move_aside_and_launcher_files_stay() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        for name in [
            "config.toml",
            "metrics.jsonl",
            "epoch_3.safetensors",
            "snapshot.safetensors",
            "snapshot.safetensors.prev",
            "events.out.tfevents.1.host",
            "notes.txt",
            "tandem.lock",
        ] {
            std::fs::write(out.join(name), name).unwrap();
        }
        std::fs::create_dir(out.join("logs")).unwrap();
        let aside = move_previous_run_aside(out, &out.join("snapshot.safetensors"))
            .unwrap()
            .unwrap();
        let mut moved: Vec<String> = std::fs::read_dir(&aside)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        moved.sort();
        assert_eq!(
            moved,
            [
                "config.toml",
                "epoch_3.safetensors",
                "events.out.tfevents.1.host",
                "metrics.jsonl",
                "snapshot.safetensors",
                "snapshot.safetensors.prev"
            ]
        );
        assert!(out.join("notes.txt").is_file() && out.join("tandem.lock").is_file());
        assert!(out.join("logs").is_dir());
        assert_eq!(
            move_previous_run_aside(out, &out.join("snapshot.safetensors")).unwrap(),
            None
        );
    }
}
