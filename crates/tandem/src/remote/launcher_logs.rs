//! The `logs/` and `errors/` that `tandem launch` writes into the staging folder of a run
//! whose `--output-dir` is an object URL: uploaded beside the run's outputs when the job
//! ends, however it ended, through the run's [`Mirror`] (after what its workers left
//! pending), so that what cannot be uploaded then stays pending for the next process with
//! the same cache.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::bail;
use clap::Parser;
use tandem_remote::ObjectUrl;

use super::object_url;
use crate::settings::TrainOptions;
use crate::train::mirror::Mirror;

/// The folders of the launcher's files in the run's folder.
const LAUNCHER_FOLDERS: [&str; 2] = ["logs", "errors"];

/// A worker command `train FLAGS...`, read as `tandem train` reads it.
#[derive(Parser)]
struct TrainCommand {
    #[command(flatten)]
    options: TrainOptions,
}

/// Uploads the files of `log_dir`'s `logs/` and `errors/` when `log_dir` is the staging
/// folder of the object URL that the worker command `command` writes to; returns what was
/// uploaded, in words. A failed upload is an error that says what stays pending, and where.
pub fn upload(command: &[String], log_dir: &Path) -> anyhow::Result<Option<String>> {
    let Some((options, url, staging)) = staged_run(command)? else {
        return Ok(None);
    };
    if staging != log_dir {
        return Ok(None);
    }
    let storage = crate::remote::connect(&options.storage)?;
    let mut mirror = Mirror::start(
        storage,
        vec![(staging.clone(), url.clone())],
        Arc::new(AtomicBool::new(false)),
    )?;
    mirror.upload_earlier()?;
    let files: Vec<PathBuf> = LAUNCHER_FOLDERS
        .iter()
        .flat_map(|folder| files_in(&staging.join(folder)))
        .collect();
    for file in &files {
        mirror.publish(file);
    }
    if let Err(failure) = mirror.finish() {
        let (pending, folder) = mirror.pending();
        bail!(
            "{failure}\nthe launcher's logs stay in {}, and {pending} upload(s) are pending \
             (recorded in {}): the next `tandem train` with this --output-dir and --cache-dir \
             uploads them",
            staging.display(),
            folder.display()
        );
    }
    Ok(Some(format!(
        "logs: {} file(s) of logs/ and errors/ are in {url}",
        files.len()
    )))
}

/// For a worker command `train ...` whose output folder is an object URL: its options, the
/// URL and the staging folder (absolute); `None` for any other command, or one that does
/// not parse (the workers report that).
fn staged_run(command: &[String]) -> anyhow::Result<Option<(TrainOptions, ObjectUrl, PathBuf)>> {
    if command.first().map(String::as_str) != Some("train") {
        return Ok(None);
    }
    let Ok(parsed) = TrainCommand::try_parse_from(command) else {
        return Ok(None);
    };
    let Ok(options) = parsed.options.merged_with_file() else {
        return Ok(None);
    };
    let Some(url) = options
        .output_dir
        .as_deref()
        .map(object_url)
        .transpose()?
        .flatten()
    else {
        return Ok(None);
    };
    let staging = std::path::absolute(url.staging_path(&options.storage.cache_dir(), "runs"))?;
    Ok(Some((options, url, staging)))
}

/// The files in `folder`, sorted; none when it does not exist.
fn files_in(folder: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .map(|entries| {
            entries
                .flatten()
                .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_file()))
                .map(|entry| entry.path())
                .filter(|path| !path.to_string_lossy().ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}
