//! The per-step record of which samples each process trained on, for checking that an epoch
//! visits every sample exactly once however the number of processes changed.
//!
//! With `TANDEM_SAMPLE_TRACE=FOLDER`, every process appends one JSON line per optimizer step
//! to `FOLDER/samples-<pid>.jsonl`: `{"epoch":0,"step":3,"world_size":2,"rank":1,
//! "indices":[...],"time":...}`, the dataset indices of its micro-batches in order and when
//! the step was committed (seconds since the Unix epoch). A step that a
//! resumed run takes again appears again; the last record of an (epoch, step, rank) is the
//! one that counts. With `--global-batch-size` each record also holds `step_indices`, the
//! whole step's samples, the same on every process: a step that a process helped commit
//! but did not live to record is still in the others' records.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

/// The variable that names the folder of the records.
pub const SAMPLE_TRACE_ENV: &str = "TANDEM_SAMPLE_TRACE";

/// One step's record.
#[derive(Serialize)]
struct StepSamples<'a> {
    epoch: u64,
    step: u64,
    world_size: usize,
    rank: usize,
    indices: &'a [usize],
    #[serde(skip_serializing_if = "Option::is_none")]
    step_indices: Option<&'a [usize]>,
    /// When the step was committed, in seconds since the Unix epoch.
    time: f64,
}

/// This process's record file, when `TANDEM_SAMPLE_TRACE` asks for one.
pub struct SampleTrace {
    file: File,
    path: PathBuf,
}

impl SampleTrace {
    /// The record file the environment asks for; `None` without `TANDEM_SAMPLE_TRACE`.
    pub fn from_env() -> anyhow::Result<Option<SampleTrace>> {
        let Some(folder) = std::env::var_os(SAMPLE_TRACE_ENV) else {
            return Ok(None);
        };
        let path = PathBuf::from(folder).join(format!("samples-{}.jsonl", std::process::id()));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open the sample record {}", path.display()))?;
        Ok(Some(SampleTrace { file, path }))
    }

    /// Appends the record of step `step` of epoch `epoch`: `indices`, trained by `rank` of
    /// `world_size` processes, and the whole step's `step_indices` where every process knows
    /// them.
    pub fn record(
        &mut self,
        epoch: u64,
        step: u64,
        (world_size, rank): (usize, usize),
        indices: &[usize],
        step_indices: Option<&[usize]>,
    ) -> anyhow::Result<()> {
        let line = serde_json::to_string(&StepSamples {
            epoch,
            step,
            world_size,
            rank,
            indices,
            step_indices,
            time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |since| since.as_secs_f64()),
        })?;
        // One write, so that a record ends with its newline unless the process was killed
        // while writing it.
        self.file
            .write_all(format!("{line}\n").as_bytes())
            .with_context(|| format!("cannot write the sample record {}", self.path.display()))
    }
}
