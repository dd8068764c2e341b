//! `tandem launch`: torchrun's job. One agent per node starts the workers with their ranks in
//! the environment, hosts (node 0) or joins the job's store, restarts every node's workers
//! together when one fails, passes a stop signal on to the workers, and names the root cause
//! when the job fails. With `--nnodes MIN:MAX` the job is elastic: each round starts with the
//! nodes that answer, so a lost node is left behind and a node that comes back joins.
//!
//! - [`options`]: the command line and its resolution into a plan.
//! - [`cluster`]: the cluster environments read when the flags are absent.
//! - [`agent`]: the rounds of the job on this node.
//! - [`rendezvous`]: how the agents meet and agree through the store.
//! - [`worker`]: one worker process and its environment.
//! - [`logs`]: per-rank log files and the console.
//! - [`report`]: root cause and summary of a failed round.
//! - [`signals`]: catching and sending signals.
//! - [`descriptors`]: the launcher's limit on open files.

mod agent;
mod cluster;
mod descriptors;
mod logs;
mod options;
mod rendezvous;
mod report;
mod signals;
mod stalls;
mod status;
mod worker;

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use tandem_files::tell;

pub use options::{missing_separator_hint, LaunchArgs};
pub use status::{run as status, StatusArgs};

use agent::{JobEnd, WorkersStopped};

/// How this node's workers ended when the job was stopped, in words.
fn how_they_stopped(workers: &WorkersStopped, grace: std::time::Duration) -> String {
    match workers {
        WorkersStopped::NoneRunning => "no worker was running".to_string(),
        WorkersStopped::WithinTheGrace => "the workers stopped, none needed SIGKILL".to_string(),
        WorkersStopped::Killed(ranks) => {
            let listed: Vec<String> = ranks.iter().map(usize::to_string).collect();
            let (rank, was) = match ranks.len() {
                1 => ("rank", "was"),
                _ => ("ranks", "were"),
            };
            format!(
                "{rank} {} did not stop within {grace:?} of SIGTERM (--stop-grace-seconds) and \
                 {was} killed (SIGKILL)",
                listed.join(", ")
            )
        }
    }
}

/// How a job that did not fail ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker finished successfully.
    Succeeded,
    /// A worker refused its settings (exit code 2): restarting it would not help. The text
    /// names the worker and what it refused.
    Refused(String),
}

/// Runs `tandem launch`: returns when the job succeeded or a worker refused its settings;
/// exits the process with 128 + the signal (143 for SIGTERM) when a stop signal ended it;
/// fails with the summary of the root cause when the workers failed past `--max-restarts`.
/// However it ended, `upload_logs` is then given the worker command and the log folder (the
/// binary uploads the logs of a run in object storage; it returns what to say); a job that
/// succeeded fails when they cannot be uploaded.
pub fn run(
    args: &LaunchArgs,
    upload_logs: impl FnOnce(&[String], &Path) -> anyhow::Result<Option<String>>,
) -> anyhow::Result<Outcome> {
    descriptors::raise_soft_limit();
    let env: HashMap<String, String> = std::env::vars().collect();
    let plan = options::LaunchPlan::resolve(args, &env)?;
    signals::catch_stop_signals().context("install the SIGTERM/SIGINT handlers")?;
    let end = agent::run_job(&plan)?;
    let logs_uploaded = upload_logs(&args.command, &plan.log_dir);
    match &logs_uploaded {
        Ok(Some(uploaded)) => agent::say(uploaded),
        Ok(None) => {}
        // A failed job's own error comes after this one.
        Err(error) if end != JobEnd::Succeeded => tell!("error: {error:#}"),
        Err(_) => {}
    }
    match end {
        JobEnd::Succeeded => {
            agent::say("every worker finished successfully");
            logs_uploaded.map(|_| Outcome::Succeeded)
        }
        JobEnd::Failed { summary } => Err(anyhow::anyhow!(summary)),
        JobEnd::Refused { summary } => Ok(Outcome::Refused(summary)),
        JobEnd::Stopped {
            reason,
            signal,
            workers,
        } => {
            agent::say(&format!(
                "stopped: {reason}; {}. Run the same command again to continue from the last \
                 snapshot.",
                how_they_stopped(&workers, plan.stop_grace)
            ));
            std::process::exit(128 + signal.unwrap_or(signals::SIGTERM));
        }
    }
}
