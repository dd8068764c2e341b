//! How `tandem` ends on an error: the one message it prints and, under `tandem launch`,
//! records in the worker's error file, and the exit code that tells a failure (1) from a
//! command or settings that can never work ([`SETTINGS_ERROR_EXIT_CODE`]).

use tandem_dist::cluster::contract::{WorkerErrorRecord, ERROR_FILE_ENV};

pub use tandem_dist::cluster::contract::SETTINGS_ERROR_EXIT_CODE;

use crate::terminal::{printable_line, printable_lines};
use crate::train::stop_signal::{self, StoppedBySignal};

/// Settings that no run can use (a value out of range, a config file that does not read,
/// a contradiction with the run's snapshot): the same command fails the same way every
/// time. `tandem` exits with [`SETTINGS_ERROR_EXIT_CODE`] on it, as on a bad flag, and
/// `tandem launch` ends the job instead of restarting the worker.
#[derive(Debug)]
pub struct SettingsError {
    /// The error and its causes, in one line.
    message: String,
    /// The same as printed on a terminal (see [`shown_message_of`]).
    shown: String,
}

impl SettingsError {
    /// `error` (and its causes) as a settings error.
    pub fn from_error(error: anyhow::Error) -> anyhow::Error {
        anyhow::Error::new(SettingsError {
            message: message_of(&error),
            shown: shown_message_of(&error),
        })
    }
}

impl std::fmt::Display for SettingsError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.message)
    }
}

impl std::error::Error for SettingsError {}

/// The error and its causes in one line, as `{:#}` writes them, but without a cause whose
/// text its error already ends with (an error that writes its source into its own message
/// would otherwise say it twice: `x.png: No such file or directory (os error 2): No such
/// file or directory (os error 2)`).
pub fn message_of(error: &anyhow::Error) -> String {
    distinct_causes(error)
        .into_iter()
        .map(|cause| cause.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}

/// [`message_of`] as printed on a terminal: an error of a library crate (data, weights,
/// pickle, object storage, the system) is one line by design, so it is escaped whole, a
/// line break in it (from a file name it quotes) included; tandem's own messages keep their
/// lines (the launcher's summary, `load it with: ...`), escaped within each, as they escape
/// the names they quote themselves. Every line is bounded (see [`crate::terminal`]).
fn shown_message_of(error: &anyhow::Error) -> String {
    distinct_causes(error)
        .into_iter()
        .map(|cause| match cause.downcast_ref::<SettingsError>() {
            Some(settings) => settings.shown.clone(),
            None if is_library_error(cause) => printable_line(&cause.to_string()),
            None => printable_lines(&cause.to_string()),
        })
        .collect::<Vec<_>>()
        .join(": ")
}

/// The causes [`message_of`] writes.
fn distinct_causes(error: &anyhow::Error) -> Vec<&(dyn std::error::Error + 'static)> {
    let mut text = String::new();
    let mut causes = Vec::new();
    for cause in error.chain() {
        let part = cause.to_string();
        if !text.is_empty() && text.ends_with(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
        causes.push(cause);
    }
    causes
}

/// Whether `cause` is an error of a library crate or the system, whose messages are one line.
fn is_library_error(cause: &(dyn std::error::Error + 'static)) -> bool {
    cause.is::<tandem_data::DataError>()
        || cause.is::<tandem_models::ModelError>()
        || cause.is::<tandem_pickle::PickleError>()
        || cause.is::<tandem_remote::RemoteError>()
        || cause.is::<std::io::Error>()
}

/// Ends the process on `error`: prints it (prefixed with the rank on ranks other than 0),
/// records it in the worker's error file under `tandem launch`, and exits with its code.
/// An error quotes names from files and peers: it is printed escaped and bounded (see
/// [`shown_message_of`]), and recorded exactly (the error file is JSON).
/// A run stopped on request is no error: rank 0 has said where it stopped, and the process
/// ends on the signal (see [`stop_signal::end_on`]).
pub fn fail(error: &anyhow::Error) -> ! {
    let rank = worker_rank();
    let message = message_of(error);
    let shown = shown_message_of(error);
    let stopped = error.downcast_ref::<StoppedBySignal>();
    match (rank.filter(|rank| *rank != 0), stopped) {
        (None, Some(_)) => {}
        (Some(rank), Some(_)) => tell!("[rank {rank}] {shown}"),
        (Some(rank), None) => tell!("[rank {rank}] error: {shown}"),
        (None, None) => tell!("error: {shown}"),
    }
    record_in_error_file(rank, message);
    if let Some(stopped) = stopped {
        stop_signal::end_on(stopped);
    }
    let settings = error.chain().any(|cause| cause.is::<SettingsError>());
    std::process::exit(if settings {
        SETTINGS_ERROR_EXIT_CODE
    } else {
        1
    })
}

/// Ends the process on a command-line error of clap's: prints it as clap does, help and
/// version on standard output with 0, a bad flag on standard error with
/// [`SETTINGS_ERROR_EXIT_CODE`], after recording it in the worker's error file.
pub fn fail_on_command_line(error: clap::Error) -> ! {
    if !error.use_stderr() {
        error.exit()
    }
    let rendered = error.render().to_string();
    let first_line = rendered.lines().next().unwrap_or_default();
    let message = first_line.strip_prefix("error: ").unwrap_or(first_line);
    record_in_error_file(worker_rank(), message.to_string());
    let _ = error.print();
    std::process::exit(SETTINGS_ERROR_EXIT_CODE)
}

/// Under `tandem launch`, writes `message` to this worker's error file (atomically).
fn record_in_error_file(rank: Option<u64>, message: String) {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV) else {
        return;
    };
    let record = WorkerErrorRecord::now(rank, message);
    if let Err(write_error) =
        crate::files::write_atomically(std::path::Path::new(&path), record.to_json().as_bytes())
    {
        tell!(
            "warning: cannot record the error in {}: {}",
            path.to_string_lossy(),
            crate::files::with_causes(&write_error)
        );
    }
}

/// This process's rank in a job: `RANK` (torchrun's, what `tandem launch` sets), else the
/// rank the cluster that started it gives (`mpirun`, `srun`, ...); `None` outside a job.
fn worker_rank() -> Option<u64> {
    use tandem_dist::cluster::{contract::RANK_ENV, WorkerEnv};
    match std::env::var(RANK_ENV) {
        Ok(rank) => rank.parse::<u64>().ok(),
        Err(_) => WorkerEnv::from_env()
            .ok()
            .flatten()
            .map(|worker| worker.rank as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_already_in_its_errors_message_is_not_repeated() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let data = tandem_data::DataError::Io {
            path: "nope.png".into(),
            source: io,
        };
        let error = anyhow::Error::new(data).context("cannot classify nope.png");
        assert_eq!(
            message_of(&error),
            "cannot classify nope.png: nope.png: entity not found"
        );
        assert_eq!(
            message_of(&anyhow::anyhow!("inner").context("outer")),
            "outer: inner"
        );
    }

    #[test]
    fn a_library_error_is_shown_as_one_line_and_tandems_own_keep_their_lines() {
        let data = tandem_data::DataError::Io {
            path: "\u{1b}]0;pwned\u{7}\nerror: fake.png".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        let error = anyhow::Error::new(data).context("cannot classify\nthe image");
        assert_eq!(
            shown_message_of(&error),
            "cannot classify\nthe image: \\x1b]0;pwned\\x07\\nerror: fake.png: entity not found"
        );
        assert_eq!(
            message_of(&error),
            "cannot classify\nthe image: \u{1b}]0;pwned\u{7}\nerror: fake.png: entity not found"
        );
        let summary = anyhow::anyhow!("the job failed\nroot cause: \u{1b}[2J");
        let refused = SettingsError::from_error(summary).context("launch");
        assert_eq!(
            shown_message_of(&refused),
            "launch: the job failed\nroot cause: \\x1b[2J"
        );
    }

    #[test]
    fn a_settings_error_is_found_under_context_and_keeps_its_causes() {
        let refused = SettingsError::from_error(anyhow::anyhow!("-1").context("--lr is wrong"));
        let error = refused.context("cannot start");
        assert!(error.chain().any(|cause| cause.is::<SettingsError>()));
        assert_eq!(message_of(&error), "cannot start: --lr is wrong: -1");
    }
}
