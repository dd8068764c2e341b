//! What each node reports at the end of a round, how the agents pick the root cause of a
//! failed round, and the one summary the launcher prints.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tandem_dist::cluster::contract::{
    WorkerErrorRecord, SETTINGS_ERROR_EXIT_CODE, STOPPED_ON_REQUEST,
};

use super::worker::WorkerEnd;
use tandem_files::terminal::{printable, printable_line};

/// How many log lines the summary shows when a worker left no error file.
pub const LOG_TAIL_LINES: usize = 10;

/// A worker's last fatal error, as the launcher read it from the worker's error file
/// (a [`WorkerErrorRecord`], or an older writer's object with a `message`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorRecord {
    /// The error message.
    pub message: String,
    /// The timestamp the worker wrote, as text (any JSON value is accepted).
    pub timestamp: Option<String>,
    /// The file it came from.
    pub file: String,
}

/// Reads an error file: `Ok(None)` when the worker wrote none, an error naming the file and
/// what is wrong with it when it cannot be used.
pub fn read_error_file(path: &Path) -> Result<Option<ErrorRecord>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(format!(
                "could not read the error file {}: {error}",
                path.display()
            ))
        }
    };
    let read = WorkerErrorRecord::read_text(&text)
        .map_err(|problem| format!("the error file {} {problem}", path.display()))?;
    Ok(Some(ErrorRecord {
        message: read.message,
        timestamp: read.timestamp,
        file: path.display().to_string(),
    }))
}

/// The end of one worker in one round, with what it left behind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Its node.
    pub node_rank: usize,
    /// Its global rank.
    pub rank: usize,
    /// Its rank on the node.
    pub local_rank: usize,
    /// How it ended.
    pub end: WorkerEnd,
    /// When it ended, in microseconds since the Unix epoch (the node's clock).
    pub ended_at_micros: u64,
    /// Its error file's content, when it failed and wrote one.
    pub error: Option<ErrorRecord>,
    /// Why its error file could not be used, if it could not.
    pub error_file_problem: Option<String>,
    /// The last lines of its log, when it failed without an error file.
    pub log_tail: Vec<String>,
    /// Its log file.
    pub log_file: String,
}

/// What one node's agent reports at the end of a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The node.
    pub node_rank: usize,
    /// Its workers, in local-rank order.
    pub workers: Vec<WorkerReport>,
}

/// The first failure of a round: the worker that failed earliest, or a node whose agent
/// went silent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCause {
    /// A worker failed on its own.
    Worker(Box<WorkerReport>),
    /// A node sent no report in time.
    NodeSilent {
        /// The node.
        node_rank: usize,
    },
}

/// The worker found stuck (stopped while its peers gave up on it), or else the earliest
/// worker failure among `reports` that did not only follow another rank's stop request (ties
/// go to the lower rank); when no worker failed, the first node that did not report (`None`
/// entries). A stuck worker wins over earlier failures because those are its peers noticing
/// it; a rank that stopped on another rank's request may end before the rank that asked
/// (which writes its own snapshot and error first), so it is a cause only when no other is.
pub fn root_cause(reports: &[Option<NodeReport>]) -> Option<RootCause> {
    let earliest = reports
        .iter()
        .flatten()
        .flat_map(|report| &report.workers)
        .filter(|worker| worker.end.is_failure())
        .min_by_key(|worker| {
            (
                !worker.end.gave_up_on(),
                followed_a_stop_request(worker),
                worker.ended_at_micros,
                worker.rank,
            )
        });
    if let Some(worker) = earliest {
        return Some(RootCause::Worker(Box::new(worker.clone())));
    }
    reports
        .iter()
        .position(Option::is_none)
        .map(|node_rank| RootCause::NodeSilent { node_rank })
}

/// Whether the worker's error says it stopped only because another rank asked.
fn followed_a_stop_request(worker: &WorkerReport) -> bool {
    worker
        .error
        .as_ref()
        .is_some_and(|error| error.message.starts_with(STOPPED_ON_REQUEST))
}

/// One line naming the root cause, e.g. "rank 1 (node 0, local rank 1) exited with code 3".
pub fn headline(cause: &RootCause) -> String {
    match cause {
        RootCause::Worker(worker) => format!(
            "rank {} (node {}, local rank {}) {}",
            worker.rank,
            worker.node_rank,
            worker.local_rank,
            worker.end.describe()
        ),
        RootCause::NodeSilent { node_rank } => {
            format!(
                "node {node_rank}'s agent sent no report (it may have died or lost the network)"
            )
        }
    }
}

/// Whether the worker refused its own command line or settings (it exited with
/// [`SETTINGS_ERROR_EXIT_CODE`]): a restart would fail the same way.
pub fn refused_its_settings(worker: &WorkerReport) -> bool {
    worker.end == WorkerEnd::ExitCode(SETTINGS_ERROR_EXIT_CODE)
}

/// The summary of a round that ends the job because `worker` refused its command line or
/// settings. When the error reached this console (`shown_above`: its output or that of a
/// worker with the same error), it is not said again; otherwise it follows, from the error
/// file or the log.
pub fn refusal_summary(worker: &WorkerReport, shown_above: bool) -> String {
    let cause = RootCause::Worker(Box::new(worker.clone()));
    let mut text = format!(
        "{}, refusing its command line or settings{}: a restart would fail the same way, so \
         the job ends without one\n",
        headline(&cause),
        if shown_above {
            " (the error is above)"
        } else {
            ""
        }
    );
    if !shown_above {
        describe_evidence(&mut text, worker);
    }
    text.trim_end().to_string()
}

/// The full summary of a failed round: the root cause with its error (or log tail), then
/// every other rank's state in brief.
pub fn summary(title: &str, cause: &RootCause, reports: &[Option<NodeReport>]) -> String {
    let mut text = format!("{title}\nroot cause: {}\n", headline(cause));
    if let RootCause::Worker(worker) = cause {
        describe_evidence(&mut text, worker);
        if worker.end.gave_up_on() {
            describe_peer_reports(&mut text, worker.rank, reports);
        }
    }
    let cause_rank = match cause {
        RootCause::Worker(worker) => Some(worker.rank),
        RootCause::NodeSilent { .. } => None,
    };
    let mut others = String::new();
    for (node_rank, report) in reports.iter().enumerate() {
        match report {
            Some(report) => {
                for worker in report
                    .workers
                    .iter()
                    .filter(|worker| Some(worker.rank) != cause_rank)
                {
                    let _ = writeln!(others, "  rank {}: {}", worker.rank, worker.end.describe());
                }
            }
            None => {
                let _ = writeln!(others, "  node {node_rank}: no report");
            }
        }
    }
    if !others.is_empty() {
        text.push_str("other ranks:\n");
        text.push_str(&others);
    }
    text.trim_end().to_string()
}

/// What the failed peers of a stuck worker recorded: they name the peer that stopped
/// answering, and what it was doing.
fn describe_peer_reports(text: &mut String, stuck_rank: usize, reports: &[Option<NodeReport>]) {
    let peers = reports
        .iter()
        .flatten()
        .flat_map(|report| &report.workers)
        .filter(|worker| worker.rank != stuck_rank && worker.end.is_failure());
    for peer in peers {
        if let Some(error) = &peer.error {
            let _ = writeln!(
                text,
                "rank {} reported: {}",
                peer.rank,
                printable_line(&error.message)
            );
        }
    }
}

/// What the worker left: its error file's message, else the last lines of its log. Both are
/// the worker's text, printed escaped and bounded (see [`tandem_files::terminal`]).
fn describe_evidence(text: &mut String, worker: &WorkerReport) {
    if let Some(error) = &worker.error {
        let when = error
            .timestamp
            .as_deref()
            .map(|timestamp| format!(", at {}", printable(timestamp)))
            .unwrap_or_default();
        let _ = writeln!(
            text,
            "error (from {}{when}): {}",
            error.file,
            printable_line(&error.message)
        );
        return;
    }
    if let Some(problem) = &worker.error_file_problem {
        let _ = writeln!(text, "({})", printable_line(problem));
    }
    if worker.log_tail.is_empty() {
        if matches!(worker.end, WorkerEnd::NotStarted(_)) {
            // The program never ran: there is nothing it could have written.
            return;
        }
        let _ = writeln!(
            text,
            "it wrote no error file and no output (log: {})",
            worker.log_file
        );
        return;
    }
    let _ = writeln!(
        text,
        "it wrote no error file; the last lines of {}:",
        worker.log_file
    );
    for line in &worker.log_tail {
        let _ = writeln!(text, "  | {}", printable_line(line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(rank: usize, end: WorkerEnd, ended_at_micros: u64) -> WorkerReport {
        WorkerReport {
            node_rank: rank / 2,
            rank,
            local_rank: rank % 2,
            end,
            ended_at_micros,
            error: None,
            error_file_problem: None,
            log_tail: vec![],
            log_file: format!("logs/rank_{rank}.log"),
        }
    }

    #[test]
    fn root_cause_is_the_earliest_failure_not_the_launchers_stops() {
        let reports = vec![
            Some(NodeReport {
                node_rank: 0,
                workers: vec![
                    worker(0, WorkerEnd::StoppedByLauncher { signal: 15 }, 100),
                    worker(1, WorkerEnd::ExitCode(1), 900),
                ],
            }),
            Some(NodeReport {
                node_rank: 1,
                workers: vec![
                    worker(2, WorkerEnd::Signal(9), 500),
                    worker(3, WorkerEnd::Succeeded, 50),
                ],
            }),
        ];
        let cause = root_cause(&reports).unwrap();
        assert_eq!(
            headline(&cause),
            "rank 2 (node 1, local rank 0) killed by SIGKILL"
        );
        let text = summary("job failed", &cause, &reports);
        assert_eq!(
            text,
            "job failed\nroot cause: rank 2 (node 1, local rank 0) killed by SIGKILL\n\
             it wrote no error file and no output (log: logs/rank_2.log)\n\
             other ranks:\n  rank 0: stopped by the launcher (SIGTERM)\n  rank 1: exited with code 1\n  \
             rank 3: finished successfully"
        );
    }

    #[test]
    fn the_rank_that_asked_to_stop_is_the_cause_though_a_follower_ended_first() {
        // Rank 0 stopped on rank 1's request and exited before rank 1, which received the
        // SIGTERM, had written its error and ended on the signal.
        let mut follower = worker(0, WorkerEnd::ExitCode(143), 100);
        follower.error = Some(ErrorRecord {
            message: format!(
                "{} at epoch 1, step 3; the snapshot is run/snapshot.safetensors",
                STOPPED_ON_REQUEST
            ),
            timestamp: None,
            file: "errors/rank_0.json".into(),
        });
        let reports = vec![Some(NodeReport {
            node_rank: 0,
            workers: vec![follower.clone(), worker(1, WorkerEnd::Signal(15), 200)],
        })];
        assert_eq!(
            headline(&root_cause(&reports).unwrap()),
            "rank 1 (node 0, local rank 1) killed by SIGTERM"
        );
        // Alone, a follower is still the cause.
        let reports = vec![Some(NodeReport {
            node_rank: 0,
            workers: vec![follower, worker(1, WorkerEnd::Succeeded, 200)],
        })];
        assert_eq!(
            headline(&root_cause(&reports).unwrap()),
            "rank 0 (node 0, local rank 0) exited with code 143"
        );
    }

    #[test]
    fn a_stuck_worker_is_the_cause_though_its_peer_failed_first() {
        let mut noticed = worker(0, WorkerEnd::ExitCode(1), 100);
        noticed.error = Some(ErrorRecord {
            message: "rank 1 (127.0.0.1:5) sent nothing before the deadline during all_reduce #9"
                .into(),
            timestamp: None,
            file: "errors/rank_0.json".into(),
        });
        let reports = vec![Some(NodeReport {
            node_rank: 0,
            workers: vec![noticed, worker(1, WorkerEnd::Stuck, 200)],
        })];
        let cause = root_cause(&reports).unwrap();
        assert_eq!(
            summary("job failed", &cause, &reports),
            "job failed\nroot cause: rank 1 (node 0, local rank 1) was stopped (SIGSTOP or a \
             debugger) and stopped answering its peers; the launcher killed it (SIGKILL)\n\
             it wrote no error file and no output (log: logs/rank_1.log)\n\
             rank 0 reported: rank 1 (127.0.0.1:5) sent nothing before the deadline during \
             all_reduce #9\nother ranks:\n  rank 0: exited with code 1"
        );
    }

    #[test]
    fn a_refusal_of_the_settings_gives_its_error_once() {
        let mut refused = worker(1, WorkerEnd::ExitCode(2), 100);
        refused.error = Some(ErrorRecord {
            message: "--lr must be a positive number, got -1".into(),
            timestamp: None,
            file: "errors/rank_1.json".into(),
        });
        assert!(refused_its_settings(&refused));
        assert!(!refused_its_settings(&worker(
            1,
            WorkerEnd::ExitCode(1),
            100
        )));
        let headline = "rank 1 (node 0, local rank 1) exited with code 2, refusing its command \
                        line or settings";
        let ending = "a restart would fail the same way, so the job ends without one";
        assert_eq!(
            refusal_summary(&refused, false),
            format!(
                "{headline}: {ending}\nerror (from errors/rank_1.json): --lr must be a positive \
                 number, got -1"
            )
        );
        assert_eq!(
            refusal_summary(&refused, true),
            format!("{headline} (the error is above): {ending}")
        );
    }

    #[test]
    fn a_silent_node_is_the_cause_only_when_no_worker_failed() {
        let reports = vec![
            Some(NodeReport {
                node_rank: 0,
                workers: vec![worker(0, WorkerEnd::Succeeded, 1)],
            }),
            None,
        ];
        assert_eq!(
            root_cause(&reports),
            Some(RootCause::NodeSilent { node_rank: 1 })
        );
        let all_fine = vec![Some(NodeReport {
            node_rank: 0,
            workers: vec![worker(0, WorkerEnd::Succeeded, 1)],
        })];
        assert_eq!(root_cause(&all_fine), None);
    }

    #[test]
    fn error_files_are_read_leniently_and_problems_named() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("rank_1.json");
        std::fs::write(
            &good,
            r#"{"rank":1,"message":"loss is NaN at step 7","timestamp":1700000000.5}"#,
        )
        .unwrap();
        let record = read_error_file(&good).unwrap().unwrap();
        assert_eq!(record.message, "loss is NaN at step 7");
        assert_eq!(record.timestamp.as_deref(), Some("1700000000.5"));

        assert_eq!(read_error_file(&dir.path().join("missing.json")), Ok(None));
        let broken = dir.path().join("broken.json");
        std::fs::write(&broken, "{not json").unwrap();
        let problem = read_error_file(&broken).unwrap_err();
        assert!(
            problem.starts_with(&format!(
                "the error file {} is not valid JSON",
                broken.display()
            )),
            "{problem}"
        );
        let no_message = dir.path().join("no_message.json");
        std::fs::write(&no_message, r#"{"rank":1}"#).unwrap();
        assert_eq!(
            read_error_file(&no_message),
            Err(format!(
                "the error file {} has no \"message\" field",
                no_message.display()
            ))
        );
    }

    #[test]
    fn a_worker_that_never_started_has_no_output_to_show() {
        let not_started = WorkerEnd::NotStarted("sh: Too many open files (os error 24)".into());
        let reports = vec![Some(NodeReport {
            node_rank: 0,
            workers: vec![
                worker(0, WorkerEnd::StoppedByLauncher { signal: 15 }, 900),
                worker(1, not_started, 500),
            ],
        })];
        let cause = root_cause(&reports).unwrap();
        assert_eq!(
            summary("job failed", &cause, &reports),
            "job failed\nroot cause: rank 1 (node 0, local rank 1) could not start: sh: Too \
             many open files (os error 24)\nother ranks:\n  rank 0: stopped by the launcher \
             (SIGTERM)"
        );
    }
}
