//! The agent: one per node. It runs the job round by round: join the round with the other
//! nodes, start the workers, watch them, stop them all when any worker anywhere fails or a
//! stop signal comes, agree on the outcome with the other nodes, then restart or finish.

use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_files::tell;

use super::descriptors;
use super::logs::RankLog;
use super::options::LaunchPlan;
use super::rendezvous::{AgentStore, Heartbeats, Member, Waited};
use super::report::{self, NodeReport, RootCause, WorkerReport, LOG_TAIL_LINES};
use super::signals::{self, signal_name, StopRequest, SIGKILL, SIGTERM};
use super::worker::{
    error_file_path, now_micros, retry_while_short_of_resources, worker_env, JobEnv, Worker,
    WorkerEnd, WorkerPlace,
};

/// How often the agent looks at its workers.
const WATCH_INTERVAL: Duration = Duration::from_millis(10);
/// How often the agent asks the store whether another node failed or asked to stop.
const STORE_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// How long the agent waits for a worker to die after SIGKILL before giving up on it.
const AFTER_KILL_WAIT: Duration = Duration::from_secs(5);
/// How long the agent waits for a dead worker's output to reach its log.
const OUTPUT_FLUSH_WAIT: Duration = Duration::from_secs(2);
/// Extra time, beyond the stop grace, that a decided round waits for the nodes' reports.
const REPORT_SLACK: Duration = Duration::from_secs(10);
/// How often the agent bumps its heartbeat and looks at the others'.
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
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
    /// A worker refused its command line or settings, which no restart would change.
    Refused {
        /// The summary to print.
        summary: String,
    },
    /// A stop signal ended the job (on this node or another).
    Stopped {
        /// Who asked, e.g. "node 0's launcher received SIGTERM".
        reason: String,
        /// The signal this launcher received, if it was this one.
        signal: Option<i32>,
        /// How this node's workers ended.
        workers: WorkersStopped,
    },
}

/// How a node's workers ended when the job was stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkersStopped {
    /// No round was running.
    NoneRunning,
    /// Every worker ended within the grace period after SIGTERM (or by itself).
    WithinTheGrace,
    /// These ranks outlived the grace period and were killed (SIGKILL).
    Killed(Vec<usize>),
}

impl WorkersStopped {
    /// How the workers of `report` ended.
    fn of(report: &NodeReport) -> WorkersStopped {
        let killed: Vec<usize> = report
            .workers
            .iter()
            .filter(|worker| {
                matches!(
                    worker.end,
                    WorkerEnd::StoppedByLauncher { signal: SIGKILL } | WorkerEnd::Unkillable
                )
            })
            .map(|worker| worker.rank)
            .collect();
        match killed.is_empty() {
            true => WorkersStopped::WithinTheGrace,
            false => WorkersStopped::Killed(killed),
        }
    }
}

/// When this node began stopping its workers, and when it escalated to SIGKILL.
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
        tandem_files::create_own_folder(&path)
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
    let mut restart = 0;
    loop {
        let join_deadline = Instant::now() + plan.join_timeout;
        let member = Member {
            nproc: topology.nproc_per_node,
        };
        let members = match store.join(restart, member, join_deadline, &interrupted)? {
            Waited::Done(members) => members,
            Waited::Interrupted => return Ok(stop_before_round(&store, restart)),
        };
        let mut workers = start_workers(plan, &store, restart, &members)?;
        let mut heartbeats = Heartbeats::new(topology.nnodes, plan.heartbeat_timeout);
        let watched = watch_round(plan, &store, restart, &workers, &mut heartbeats);
        let report = node_report(topology.node_rank, &mut workers);
        let shared = watched.and_then(|()| {
            store.publish_report(restart, &report)?;
            store.gather_reports(restart, &mut heartbeats, plan.stop_grace + REPORT_SLACK)
        });
        let reports = match shared {
            Ok(reports) => reports,
            Err(error) => return Ok(lost_the_store(&error, topology.nnodes, report)),
        };
        let present: Vec<bool> = reports.iter().map(Option::is_some).collect();

        if every_worker_succeeded(&reports) {
            store.leave(restart, &present, LEAVE_TIMEOUT)?;
            return Ok(JobEnd::Succeeded);
        }
        if let Some(reason) = store.stop_request()? {
            store.leave(restart, &present, LEAVE_TIMEOUT)?;
            let signal = signals::stop_requested().map(|request| request.signal);
            let workers = reports
                .get(topology.node_rank)
                .and_then(Option::as_ref)
                .map_or(WorkersStopped::NoneRunning, WorkersStopped::of);
            return Ok(JobEnd::Stopped {
                reason,
                signal,
                workers,
            });
        }
        let cause = report::root_cause(&reports).unwrap_or(RootCause::NodeSilent {
            node_rank: topology.node_rank,
        });
        if let Some(summary) = refusal(plan, &cause, &reports) {
            store.leave(restart, &present, LEAVE_TIMEOUT)?;
            return Ok(JobEnd::Refused { summary });
        }
        if restart < plan.max_restarts {
            say(&format!(
                "round {restart} failed: {}; restarting every node (restart {} of {})",
                report::headline(&cause),
                restart + 1,
                plan.max_restarts
            ));
            restart += 1;
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
}

/// The summary that ends the job when its root cause is a worker that refused its command
/// line or settings (every node decides so from the same reports). The worker named is one
/// whose output this console showed, when one refused, so that its error is said once.
fn refusal(plan: &LaunchPlan, cause: &RootCause, reports: &[Option<NodeReport>]) -> Option<String> {
    let RootCause::Worker(first) = cause else {
        return None;
    };
    if !report::refused_its_settings(first) {
        return None;
    }
    let shown_here = |worker: &&WorkerReport| {
        worker.node_rank == plan.topology.node_rank && (plan.tee || worker.rank == 0)
    };
    // A worker that printed the same error may have been stopped before it exited.
    let same_error = |worker: &&WorkerReport| match (&worker.error, &first.error) {
        (Some(error), Some(first_error)) => error.message == first_error.message,
        _ => false,
    };
    let shown = reports
        .iter()
        .flatten()
        .flat_map(|report| &report.workers)
        .filter(shown_here)
        .find(|worker| report::refused_its_settings(worker) || same_error(worker));
    Some(match shown {
        Some(worker) if report::refused_its_settings(worker) => {
            report::refusal_summary(worker, true)
        }
        Some(_) => report::refusal_summary(first, true),
        None => report::refusal_summary(first, false),
    })
}

/// The end of a job whose store became unreachable mid-round: the workers here are stopped
/// already, and only this node's side of the story can be told.
fn lost_the_store(error: &anyhow::Error, nnodes: usize, report: NodeReport) -> JobEnd {
    let node_rank = report.node_rank;
    let mut reports: Vec<Option<NodeReport>> = vec![None; nnodes];
    if let Some(slot) = reports.get_mut(node_rank) {
        *slot = Some(report);
    }
    let cause = report::root_cause(&reports).unwrap_or(RootCause::NodeSilent { node_rank: 0 });
    let title =
        format!("the job failed: node {node_rank} lost the store ({error:#}); what this node saw:");
    JobEnd::Failed {
        summary: report::summary(&title, &cause, &reports),
    }
}

/// The end of a job stopped by this launcher's signal before any worker ran in this round.
fn stopped_here() -> JobEnd {
    let signal = signals::stop_requested().map(|request| request.signal);
    let name = signal.map_or_else(|| "a stop signal".to_string(), signal_name);
    JobEnd::Stopped {
        reason: format!("this launcher received {name}"),
        signal,
        workers: WorkersStopped::NoneRunning,
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
        let rank = first_rank + local_rank;
        match start_worker(plan, restart, &job, world_size, rank, local_rank) {
            Ok(worker) => {
                let not_started = matches!(worker.end(), Some((WorkerEnd::NotStarted(_), _)));
                workers.push(worker);
                // The round has failed: the rest would only wait out the same shortage.
                let left = topology.nproc_per_node - local_rank - 1;
                if not_started && left > 0 {
                    say(&format!(
                        "rank {rank} could not start, so the {left} worker(s) after it on this \
                         node were not started either"
                    ));
                    break;
                }
            }
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
    let log = retry_while_short_of_resources(|| RankLog::open(&plan.log_dir, place.rank, &header))
        .map_err(|error| anyhow::anyhow!(descriptors::explain(&error)))
        .with_context(|| {
            format!(
                "open the log of rank {} ({})",
                place.rank,
                super::logs::rank_log_path(&plan.log_dir, place.rank).display()
            )
        })?;
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
/// failed here or elsewhere, a node went silent, or a stop signal came. Never returns while a
/// worker runs, even when the store fails (the workers are stopped first, then the error is
/// returned).
fn watch_round(
    plan: &LaunchPlan,
    store: &AgentStore,
    restart: u32,
    workers: &[Worker],
    heartbeats: &mut Heartbeats,
) -> anyhow::Result<()> {
    let mut duties = StoreDuties::new(plan.topology.node_rank, restart);
    let mut stopping: Option<Stopping> = None;
    loop {
        let ends: Vec<Option<WorkerEnd>> = workers
            .iter()
            .map(|worker| worker.end().map(|(end, _)| end))
            .collect();
        let local_failure = ends.iter().flatten().any(WorkerEnd::is_failure);
        let signal = signals::stop_requested();
        let others_stop = duties.update(store, heartbeats, local_failure, signal);
        if ends.iter().all(Option::is_some) {
            break;
        }
        let must_stop = local_failure || signal.is_some() || others_stop;
        if must_stop && stopping.is_none() {
            stopping = Some(Stopping {
                sigterm_at: Instant::now(),
                sigkill_at: None,
            });
            signal_running(workers, SIGTERM);
        }
        if let Some(phase) = stopping.as_mut() {
            // A stopped worker can honour no SIGTERM: no grace for it. It is most likely
            // the peer the failed ones gave up on.
            for worker in workers {
                worker.kill_if_stopped();
            }
            let insists = signal.is_some_and(|request| request.count >= 2);
            escalate(phase, workers, plan.stop_grace, insists);
        }
        std::thread::sleep(WATCH_INTERVAL);
    }
    match duties.store_error {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// SIGKILL once the grace period is over (or at once when the user insists), then give up
/// on workers that survive even that.
fn escalate(phase: &mut Stopping, workers: &[Worker], grace: Duration, insists: bool) {
    if phase.sigkill_at.is_none() && (insists || phase.sigterm_at.elapsed() >= grace) {
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

/// What the agent tells the store, and learns from it, while it watches a round. The first
/// store error is kept; after it the agent only stops its workers.
struct StoreDuties {
    node_rank: usize,
    restart: u32,
    failure_marked: bool,
    stop_published: bool,
    others_stop: bool,
    last_check: Instant,
    last_heartbeat: Instant,
    store_error: Option<anyhow::Error>,
}

impl StoreDuties {
    fn new(node_rank: usize, restart: u32) -> StoreDuties {
        StoreDuties {
            node_rank,
            restart,
            failure_marked: false,
            stop_published: false,
            others_stop: false,
            last_check: Instant::now(),
            last_heartbeat: Instant::now(),
            store_error: None,
        }
    }

    /// Publishes a local failure or stop signal, bumps the heartbeat, and returns whether the
    /// workers must stop for a reason outside this node (a failure elsewhere, a stop request,
    /// a silent node, or the store itself failing).
    fn update(
        &mut self,
        store: &AgentStore,
        heartbeats: &mut Heartbeats,
        local_failure: bool,
        signal: Option<StopRequest>,
    ) -> bool {
        if let Err(error) = self.try_update(store, heartbeats, local_failure, signal) {
            self.store_error.get_or_insert(error);
        }
        self.others_stop || self.store_error.is_some()
    }

    fn try_update(
        &mut self,
        store: &AgentStore,
        heartbeats: &mut Heartbeats,
        local_failure: bool,
        signal: Option<StopRequest>,
    ) -> anyhow::Result<()> {
        if self.store_error.is_some() {
            return Ok(());
        }
        if local_failure && !self.failure_marked {
            self.failure_marked = true;
            store.mark_failed(self.restart)?;
        }
        if let (Some(request), false) = (signal, self.stop_published) {
            self.stop_published = true;
            let reason = format!(
                "node {}'s launcher received {}",
                self.node_rank,
                signal_name(request.signal)
            );
            store.request_stop(&reason)?;
        }
        if !self.others_stop && self.last_check.elapsed() >= STORE_CHECK_INTERVAL {
            self.last_check = Instant::now();
            self.others_stop = store.round_failed(self.restart)? || store.stop_request()?.is_some();
        }
        if self.last_heartbeat.elapsed() >= HEARTBEAT_INTERVAL {
            self.last_heartbeat = Instant::now();
            store.heartbeat()?;
            let silent = store.silent_nodes(heartbeats)?;
            if !silent.is_empty() && !self.others_stop {
                self.others_stop = true;
                store.mark_failed(self.restart)?;
            }
        }
        Ok(())
    }
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
    tell!("tandem launch: {message}");
}
