//! The agent: one per node. It runs the job round by round: join the round with the other
//! nodes, start the workers, watch them, stop them all when any worker anywhere fails or a
//! stop signal comes, agree on the outcome with the other nodes, then restart or finish.

use std::time::{Duration, Instant};

use anyhow::Context;

use super::logs::RankLog;
use super::options::LaunchPlan;
use super::rendezvous::{AgentStore, Member, Waited};
use super::report::{self, NodeReport, RootCause, WorkerReport, LOG_TAIL_LINES};
use super::signals::{self, signal_name, SIGKILL, SIGTERM};
use super::worker::{
    error_file_path, now_micros, worker_env, JobEnv, Worker, WorkerEnd, WorkerPlace,
};

/// How often the agent looks at its workers.
const WATCH_INTERVAL: Duration = Duration::from_millis(10);
/// How often the agent asks the store whether another node failed or asked to stop.
const STORE_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// How long the agent waits for a worker to die after SIGKILL before giving up on it.
const AFTER_KILL_WAIT: Duration = Duration::from_secs(5);
/// How long the agent waits for a dead worker's output to reach its log.
const OUTPUT_FLUSH_WAIT: Duration = Duration::from_secs(2);
/// A node whose heartbeat stops for this long is taken for dead.
const HEARTBEAT_SILENCE: Duration = Duration::from_secs(60);
/// Extra time, beyond the stop grace, that a decided round waits for the nodes' reports.
const REPORT_SLACK: Duration = Duration::from_secs(30);
/// How long node 0 keeps the store up for the other nodes to read the outcome.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEnd {
    /// Every worker of the last round finished successfully.
    Succeeded,
    /// Workers failed in the last round allowed; `summary` names the root cause.
    Failed {
        /// The summary to print.
        summary: String,
    },
    /// A stop signal ended the job (on this node or another).
    Stopped {
        /// Who asked, e.g. "node 0's launcher received SIGTERM".
        reason: String,
        /// The signal this launcher received, if it was this one.
        signal: Option<i32>,
    },
}

/// Why this node is stopping its workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stopping {
    sigterm_at: Instant,
    sigkill_at: Option<Instant>,
}

/// Runs the whole job on this node.
pub fn run_job(plan: &LaunchPlan) -> anyhow::Result<JobEnd> {
    let topology = &plan.topology;
    for folder in ["logs", "errors"] {
        let path = plan.log_dir.join(folder);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("create the log folder {}", path.display()))?;
    }
    let interrupted = || signals::stop_requested().is_some();
    let join_deadline = Instant::now() + plan.join_timeout;
    let store = match AgentStore::open(topology, &plan.token, join_deadline, &interrupted)? {
        Waited::Done(store) => store,
        Waited::Interrupted => return Ok(stopped_here()),
    };
    say(&format!(
        "node {} of {} ({}), {} worker(s), store at {}:{}, logs in {}",
        topology.node_rank,
        topology.nnodes,
        topology.source,
        topology.nproc_per_node,
        store.master_addr,
        store.master_port,
        plan.log_dir.display()
    ));
    for restart in 0..=plan.max_restarts {
        let join_deadline = Instant::now() + plan.join_timeout;
        let member = Member {
            nproc: topology.nproc_per_node,
        };
        let members = match store.join(restart, member, join_deadline, &interrupted)? {
            Waited::Done(members) => members,
            Waited::Interrupted => return Ok(stop_before_round(&store, restart)),
        };
        let mut workers = start_workers(plan, &store, restart, &members)?;
        watch_round(plan, &store, restart, &workers)?;
        let report = node_report(topology.node_rank, &mut workers);
        store.publish_report(restart, &report)?;
        let reports =
            store.gather_reports(restart, HEARTBEAT_SILENCE, plan.stop_grace + REPORT_SLACK)?;
        let present: Vec<bool> = reports.iter().map(Option::is_some).collect();

        if every_worker_succeeded(&reports) {
            store.leave(restart, &present, LEAVE_TIMEOUT)?;
            return Ok(JobEnd::Succeeded);
        }
        if let Some(reason) = store.stop_request()? {
            store.leave(restart, &present, LEAVE_TIMEOUT)?;
            let signal = signals::stop_requested().map(|request| request.signal);
            return Ok(JobEnd::Stopped { reason, signal });
        }
        let cause = report::root_cause(&reports).unwrap_or(RootCause::NodeSilent {
            node_rank: topology.node_rank,
        });
        if restart < plan.max_restarts {
            say(&format!(
                "round {restart} failed: {}; restarting every node (restart {} of {})",
                report::headline(&cause),
                restart + 1,
                plan.max_restarts
            ));
            continue;
        }
        store.leave(restart, &present, LEAVE_TIMEOUT)?;
        let title = format!(
            "the job failed in round {restart} and no restart is left (--max-restarts {})",
            plan.max_restarts
        );
        return Ok(JobEnd::Failed {
            summary: report::summary(&title, &cause, &reports),
        });
    }
    unreachable!("the last round always returns")
}

/// The end of a job stopped by this launcher's signal before any worker ran in this round.
fn stopped_here() -> JobEnd {
    let signal = signals::stop_requested().map(|request| request.signal);
    let name = signal.map_or_else(|| "a stop signal".to_string(), signal_name);
    JobEnd::Stopped {
        reason: format!("this launcher received {name}"),
        signal,
    }
}

/// Tells the other nodes that this one stops, while it waits to join a round.
fn stop_before_round(store: &AgentStore, restart: u32) -> JobEnd {
    let end = stopped_here();
    if let JobEnd::Stopped { reason, .. } = &end {
        // Best effort: the job ends here whatever the store says.
        let _ = store.request_stop(&format!("node waiting for round {restart}: {reason}"));
    }
    end
}

/// Starts this node's workers for round `restart`.
fn start_workers(
    plan: &LaunchPlan,
    store: &AgentStore,
    restart: u32,
    members: &[Member],
) -> anyhow::Result<Vec<Worker>> {
    let topology = &plan.topology;
    let world_size: usize = members.iter().map(|member| member.nproc).sum();
    let first_rank: usize = members
        .iter()
        .take(topology.node_rank)
        .map(|member| member.nproc)
        .sum();
    let job = JobEnv {
        master_addr: store.master_addr.clone(),
        master_port: store.master_port,
        token: plan.token.expose_secret(),
        restart_count: restart,
    };
    let mut workers = Vec::with_capacity(topology.nproc_per_node);
    for local_rank in 0..topology.nproc_per_node {
        match start_worker(
            plan,
            restart,
            &job,
            world_size,
            first_rank + local_rank,
            local_rank,
        ) {
            Ok(worker) => workers.push(worker),
            Err(error) => {
                kill_and_reap(&workers);
                return Err(error);
            }
        }
    }
    Ok(workers)
}

/// Starts one worker: a fresh error file path, a round header in its log, its environment.
fn start_worker(
    plan: &LaunchPlan,
    restart: u32,
    job: &JobEnv,
    world_size: usize,
    rank: usize,
    local_rank: usize,
) -> anyhow::Result<Worker> {
    let topology = &plan.topology;
    let place = WorkerPlace {
        rank,
        local_rank,
        node_rank: topology.node_rank,
        world_size,
        local_world_size: topology.nproc_per_node,
    };
    let error_file = error_file_path(&plan.log_dir, place.rank);
    match std::fs::remove_file(&error_file) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            return Err(error)
                .with_context(|| format!("remove the old error file {}", error_file.display()))
        }
    }
    let header = format!(
        "===== tandem launch: round {restart} (restart {restart} of at most {}), rank {}, node {}, local rank {}, \
         started at unix time {} =====",
        plan.max_restarts,
        place.rank,
        place.node_rank,
        place.local_rank,
        now_micros() / 1_000_000
    );
    let log = RankLog::open(&plan.log_dir, place.rank, &header)
        .with_context(|| format!("open the log of rank {}", place.rank))?;
    let env = worker_env(&place, job, &error_file);
    let echo = plan.tee || place.rank == 0;
    Ok(Worker::start(
        &plan.program,
        &plan.program_args,
        &env,
        place,
        error_file,
        log,
        echo,
    ))
}

/// Ends already-started workers when a round cannot start completely.
fn kill_and_reap(workers: &[Worker]) {
    signal_running(workers, SIGKILL);
    let deadline = Instant::now() + AFTER_KILL_WAIT;
    while workers.iter().any(|worker| worker.end().is_none()) && Instant::now() < deadline {
        std::thread::sleep(WATCH_INTERVAL);
    }
}

/// Watches the workers until they have all ended: on their own, or stopped because a worker
/// failed here or elsewhere, or a stop signal came. Never returns while a worker runs, even
/// when the store fails (the workers are stopped first, then the error is returned).
fn watch_round(
    plan: &LaunchPlan,
    store: &AgentStore,
    restart: u32,
    workers: &[Worker],
) -> anyhow::Result<()> {
    let mut stopping: Option<Stopping> = None;
    let mut failure_marked = false;
    let mut stop_published = false;
    let mut store_error: Option<anyhow::Error> = None;
    let mut last_store_check = Instant::now();
    let mut last_heartbeat = Instant::now();
    loop {
        let ends: Vec<Option<WorkerEnd>> = workers
            .iter()
            .map(|worker| worker.end().map(|(end, _)| end))
            .collect();
        let local_failure = ends.iter().flatten().any(WorkerEnd::is_failure);
        let all_ended = ends.iter().all(Option::is_some);

        if local_failure && !failure_marked && store_error.is_none() {
            failure_marked = true;
            if let Err(error) = store.mark_failed(restart) {
                store_error = Some(error);
            }
        }
        let signal = signals::stop_requested();
        if let Some(request) = signal {
            if !stop_published && store_error.is_none() {
                stop_published = true;
                let reason = format!(
                    "node {}'s launcher received {}",
                    plan.topology.node_rank,
                    signal_name(request.signal)
                );
                if let Err(error) = store.request_stop(&reason) {
                    store_error = Some(error);
                }
            }
        }
        let mut peer_asked = false;
        if stopping.is_none()
            && store_error.is_none()
            && last_store_check.elapsed() >= STORE_CHECK_INTERVAL
        {
            last_store_check = Instant::now();
            match check_store(store, restart) {
                Ok(asked) => peer_asked = asked,
                Err(error) => store_error = Some(error),
            }
        }
        if store_error.is_none() && last_heartbeat.elapsed() >= Duration::from_secs(1) {
            last_heartbeat = Instant::now();
            if let Err(error) = store.heartbeat() {
                store_error = Some(error);
            }
        }

        if all_ended {
            break;
        }
        let must_stop = local_failure || signal.is_some() || peer_asked || store_error.is_some();
        if must_stop && stopping.is_none() {
            stopping = Some(Stopping {
                sigterm_at: Instant::now(),
                sigkill_at: None,
            });
            signal_running(workers, SIGTERM);
        }
        if let Some(phase) = stopping.as_mut() {
            let insists = signal.is_some_and(|request| request.count >= 2);
            if phase.sigkill_at.is_none()
                && (insists || phase.sigterm_at.elapsed() >= plan.stop_grace)
            {
                phase.sigkill_at = Some(Instant::now());
                signal_running(workers, SIGKILL);
            }
            if phase
                .sigkill_at
                .is_some_and(|at| at.elapsed() >= AFTER_KILL_WAIT)
            {
                workers.iter().for_each(Worker::give_up);
            }
        }
        std::thread::sleep(WATCH_INTERVAL);
    }
    match store_error {
        Some(error) => Err(error.context("lost the store; this node's workers were stopped")),
        None => Ok(()),
    }
}

/// Whether another node failed in this round or asked the job to stop.
fn check_store(store: &AgentStore, restart: u32) -> anyhow::Result<bool> {
    Ok(store.round_failed(restart)? || store.stop_request()?.is_some())
}

fn signal_running(workers: &[Worker], signal: i32) {
    for worker in workers {
        worker.stop_with(signal);
    }
}

/// This node's report of the round: each worker's end, its error file, and its log's tail
/// when it failed without an error file.
fn node_report(node_rank: usize, workers: &mut [Worker]) -> NodeReport {
    let flush_deadline = Instant::now() + OUTPUT_FLUSH_WAIT;
    let mut reports = Vec::with_capacity(workers.len());
    for worker in workers.iter_mut() {
        worker.flush_output(flush_deadline);
        let (end, ended_at_micros) = worker
            .end()
            .unwrap_or((WorkerEnd::Unkillable, now_micros()));
        let (error, error_file_problem) = match report::read_error_file(&worker.error_file) {
            Ok(error) => (error, None),
            Err(problem) => (None, Some(problem)),
        };
        let log_tail = match (&error, end.is_failure()) {
            (None, true) => worker.log.tail(LOG_TAIL_LINES).unwrap_or_default(),
            _ => Vec::new(),
        };
        reports.push(WorkerReport {
            node_rank,
            rank: worker.place.rank,
            local_rank: worker.place.local_rank,
            end,
            ended_at_micros,
            error,
            error_file_problem,
            log_tail,
            log_file: worker.log.path().display().to_string(),
        });
    }
    NodeReport {
        node_rank,
        workers: reports,
    }
}

fn every_worker_succeeded(reports: &[Option<NodeReport>]) -> bool {
    reports.iter().all(|report| {
        report.as_ref().is_some_and(|report| {
            report
                .workers
                .iter()
                .all(|worker| worker.end == WorkerEnd::Succeeded)
        })
    })
}

/// Prints one line of the launcher's own, marked as such.
pub fn say(message: &str) {
    eprintln!("tandem launch: {message}");
}
