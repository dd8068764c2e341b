//! The agent: one per node. It runs the job round by round: join the round with the other
//! nodes, start the workers, watch them, stop them all when any worker anywhere fails or a
//! stop signal comes, agree on the outcome with the other nodes, then restart or finish.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_files::tell;

use super::descriptors;
use super::logs::RankLog;
use super::options::{LaunchPlan, StoreLocation};
use super::rendezvous::{
    AgentStore, Ended, Entry, Heartbeats, LostWorker, Member, Round, RoundSize, Waited,
    REQUEST_TIMEOUT,
};
use super::report::{self, NodeReport, RootCause, WorkerReport, LOG_TAIL_LINES};
use super::signals::{self, signal_name, StopRequest, SIGKILL, SIGTERM};
use super::stalls::{Stalls, Waiter};
use super::status;
use super::worker::{
    error_file_path, now_micros, retry_while_short_of_resources, worker_env, JobEnv, Worker,
    WorkerEnd, WorkerPlace,
};
use tandem_dist::cluster::contract::{MembershipRecord, SETTINGS_ERROR_EXIT_CODE};

/// How often the agent looks at its workers.
const WATCH_INTERVAL: Duration = Duration::from_millis(10);
/// How often the agent asks the store whether another node failed or asked to stop.
const STORE_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// The least bound on a store request of an agent when the store is replicated: long
/// enough for the replicas to elect a new leader, so that a node of the majority never
/// pauses for an election. A request that fails pauses the node until the store answers
/// again (see [`CutOff`]).
const REPLICATED_REQUEST_TIMEOUT: Duration = Duration::from_secs(4);
/// How long another node's heartbeat may stay still before no worker here is found stalled.
const QUIET_NODE: Duration = Duration::from_millis(300);
/// How long the agent waits for a worker to die after SIGKILL before giving up on it.
const AFTER_KILL_WAIT: Duration = Duration::from_secs(5);
/// How long the launcher gathers losses before it publishes a membership without the lost
/// workers.
const LOSS_SETTLE: Duration = Duration::from_millis(50);
/// How long the agent waits for a dead worker's output to reach its log.
const OUTPUT_FLUSH_WAIT: Duration = Duration::from_secs(2);
/// Extra time, beyond the stop grace, that a decided round waits for the nodes' reports.
const REPORT_SLACK: Duration = Duration::from_secs(10);
/// How often the agent bumps its heartbeat and looks at the others' and its workers'.
const HEARTBEAT_INTERVAL: Duration = tandem_dist::heartbeat::HEARTBEAT_INTERVAL;
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

/// When this node began stopping its workers, when their SIGTERM is due while it waits,
/// and when it escalated to SIGKILL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stopping {
    sigterm_at: Instant,
    sigterm_due: Option<Instant>,
    sigkill_at: Option<Instant>,
}

/// How long the other workers of a node get to say why they refuse their settings too,
/// after one did, before they are stopped.
const REFUSAL_SETTLE: Duration = Duration::from_secs(1);

impl Stopping {
    /// Begins stopping the running `workers` after `failures` (or a stop `signal`).
    /// Workers that ended on a stop request show that every rank is stopping already: a
    /// SIGTERM would hide which rank asked, so only the grace's end is enforced. A worker
    /// that refused its settings is most often one of several that refuse alike: the
    /// others get [`REFUSAL_SETTLE`] to say why.
    fn begin(failures: &[&WorkerEnd], signal: Option<StopRequest>, workers: &[Worker]) -> Self {
        let now = Instant::now();
        let only = |wanted: &WorkerEnd| {
            !failures.is_empty() && failures.iter().all(|failure| *failure == wanted)
        };
        let sigterm_due = match signal {
            Some(_) => Some(now),
            None if only(&STOPPED_ON_REQUEST_EXIT) => None,
            None if only(&WorkerEnd::ExitCode(SETTINGS_ERROR_EXIT_CODE)) => {
                Some(now + REFUSAL_SETTLE)
            }
            None => Some(now),
        };
        let mut stopping = Stopping {
            sigterm_at: now,
            sigterm_due,
            sigkill_at: None,
        };
        stopping.send_due_sigterm(workers);
        stopping
    }

    /// Sends the SIGTERM once it is due.
    fn send_due_sigterm(&mut self, workers: &[Worker]) {
        if self.sigterm_due.is_some_and(|due| Instant::now() >= due) {
            self.sigterm_due = None;
            signal_running(workers, SIGTERM);
        }
    }
}

/// What the agent remembers of the last round it ran, for the next round's line.
#[derive(Default)]
struct History {
    /// The last round this agent ran.
    previous: Option<Round>,
    /// Members of that round that sent no report, and why they count as lost.
    lost: BTreeMap<usize, String>,
}

/// Runs the whole job on this node.
pub fn run_job(plan: &LaunchPlan) -> anyhow::Result<JobEnd> {
    let topology = &plan.topology;
    let interrupted = || signals::stop_requested().is_some();
    let join_deadline = Instant::now() + plan.join_timeout;
    let store = match open_store(plan, join_deadline, &interrupted)? {
        Waited::Done(store) => store,
        Waited::Interrupted => return Ok(stopped_here()),
    };
    let me = Member {
        node: topology.node_rank,
        nproc: topology.nproc_per_node,
        agent: format!("pid {} started at {}", std::process::id(), now_micros()),
    };
    // Node 0 opens the first round, unless it was started again while the others went on.
    let mut opens_rounds = topology.node_rank == 0 && !store.job_under_way()?;
    let mut number = match opens_rounds {
        true => 0,
        false => match store.current_round(join_deadline, &interrupted)? {
            Waited::Done(number) => number,
            Waited::Interrupted => return Ok(stopped_here()),
        },
    };
    let mut history = History::default();
    let mut restarts = 0;
    let mut left_out = false;
    loop {
        let join_deadline = Instant::now() + plan.join_timeout;
        if opens_rounds {
            store.open_round(number)?;
        }
        store.offer(number, &me)?;
        if left_out {
            store.ask_to_join(number - 1)?;
        }
        let entered = match opens_rounds {
            true => close_round(
                plan,
                &store,
                (number, restarts),
                &me,
                &history,
                join_deadline,
            )?,
            // The opener says first why a round could not start.
            false => store.await_round(number, &me, join_deadline + LEAVE_TIMEOUT, &interrupted)?,
        };
        opens_rounds = false;
        let (round, joining) = match entered {
            Waited::Done(Entry::Member(round)) => (round, false),
            Waited::Done(Entry::LeftOut(closed)) => {
                match rejoins_in_process(plan, &store, &closed)? {
                    true => (closed, true),
                    false => {
                        number += 1;
                        left_out = true;
                        continue;
                    }
                }
            }
            Waited::Done(Entry::Ended(ended)) => {
                return ended_while_waiting(&store, number, ended);
            }
            Waited::Interrupted => {
                let was_member = history.previous.is_some();
                return Ok(stop_before_round(
                    &store,
                    number,
                    was_member || !topology.is_elastic(),
                ));
            }
        };
        left_out = false;
        restarts = round.restarts;
        if topology.is_elastic() {
            say(&round.line);
        }
        let (reports, mut others, lost) = match run_round(plan, &store, &round, joining)? {
            Ok(outcome) => outcome,
            Err(end) => return Ok(end),
        };
        history.lost = lost;
        history.previous = Some(round.clone());
        let coordinates = coordinates(&others, topology.node_rank);
        let outcome = (number, reports.as_slice(), coordinates);
        match after_round(plan, &store, outcome, &history, restarts, &mut others)? {
            Next::End(end) => return Ok(end),
            Next::Round { restart } => {
                restarts += u32::from(restart);
                number += 1;
                opens_rounds = coordinates;
            }
        }
    }
}

/// Whether this node, started while round `closed` runs without it, rejoins that round
/// in-process: when the round lost it (`--keep-survivors`), its workers start as joiners in
/// their old places, and the deciding node lets them in at a step boundary; nobody restarts.
/// Otherwise it joins the next round. Says which.
fn rejoins_in_process(
    plan: &LaunchPlan,
    store: &AgentStore,
    closed: &Round,
) -> anyhow::Result<bool> {
    let node = plan.topology.node_rank;
    let its_place = closed
        .members
        .iter()
        .any(|member| member.node == node && member.nproc == plan.topology.nproc_per_node);
    let lost_here = plan.keep_survivors && its_place;
    let rejoins = lost_here
        && !store.dropped_nodes(closed.number, &[node])?.is_empty()
        && !store.round_is_over(closed.number)?;
    if !rejoins {
        say(&format!(
            "round {} started without this node; it joins the next one",
            closed.number
        ));
        return Ok(false);
    }
    // Its old agent's reports of lost workers are of processes that are gone.
    store.report_lost(closed.number, &[])?;
    say(&format!(
        "round {} runs without this node, which it lost: this node's workers rejoin it at a \
         step boundary, and nobody restarts",
        closed.number
    ));
    Ok(true)
}

/// Makes the log folders, reaches the job's store (hosting it on node 0) by `deadline`, and
/// says where this node stands.
fn open_store(
    plan: &LaunchPlan,
    deadline: Instant,
    interrupted: &dyn Fn() -> bool,
) -> anyhow::Result<Waited<AgentStore>> {
    let topology = &plan.topology;
    for folder in ["logs", "errors"] {
        let path = plan.log_dir.join(folder);
        tandem_files::create_own_folder(&path)
            .with_context(|| format!("create the log folder {}", path.display()))?;
    }
    let store = match AgentStore::open(
        topology,
        &plan.token,
        (&plan.log_dir, plan.keep_survivors),
        deadline,
        store_request_timeout(plan),
        interrupted,
    )? {
        Waited::Done(store) => store,
        Waited::Interrupted => return Ok(Waited::Interrupted),
    };
    status::write_job_file(&plan.log_dir, &store.location(), &plan.token)?;
    let nodes = match topology.is_elastic() {
        true => format!("{}:{}", topology.min_nodes, topology.nnodes),
        false => topology.nnodes.to_string(),
    };
    let store_at = match store.is_replicated() {
        true => format!("store replicated at {}", store.location()),
        false => format!("store at {}:{}", store.master_addr, store.master_port),
    };
    say(&format!(
        "node {} of {nodes} ({}), {} worker(s), {store_at}, logs in {}",
        topology.node_rank,
        topology.source,
        topology.nproc_per_node,
        plan.log_dir.display()
    ));
    if store.replica_started_behind() {
        say(&format!(
            "node {}'s replica of the store starts behind a job under way: it votes once it \
             has caught up with the leader",
            topology.node_rank
        ));
    }
    Ok(Waited::Done(store))
}

/// How long another node's agent waits for each answer of the store. With `--keep-survivors`
/// it is twice the heartbeat timeout: node 0 has left this node out by then, so its workers
/// must stop rather than wait out the usual bound.
fn store_request_timeout(plan: &LaunchPlan) -> Duration {
    let replicated = matches!(plan.topology.store, StoreLocation::Replicated { .. });
    match (plan.keep_survivors, replicated) {
        (true, true) => (plan.heartbeat_timeout * 2).max(REPLICATED_REQUEST_TIMEOUT),
        (true, false) => (plan.heartbeat_timeout * 2).max(Duration::from_secs(1)),
        (false, _) => REQUEST_TIMEOUT,
    }
}

/// The nodes a round of `plan` may have, and its last call.
fn round_size(plan: &LaunchPlan) -> RoundSize {
    RoundSize {
        min: plan.topology.min_nodes,
        max: plan.topology.nnodes,
        last_call: plan.last_call,
    }
}

/// How the job ends for a node that waited for round `number` when node 0 `ended` it.
fn ended_while_waiting(store: &AgentStore, number: u32, ended: Ended) -> anyhow::Result<JobEnd> {
    store.leave(number, &[], LEAVE_TIMEOUT)?;
    let message = format!(
        "the job ended while this node waited for round {number}: {}",
        ended.message
    );
    Ok(match ended.succeeded {
        true => {
            say(&message);
            JobEnd::Succeeded
        }
        false => JobEnd::Failed { summary: message },
    })
}

/// The nodes of round `number` (`members`) that reported (`gathered`), as `(round, node)`
/// for the store's leave, and those that did not, with why each was lost.
fn reported_and_lost(
    members: &[usize],
    gathered: &[Option<NodeReport>],
    number: u32,
    heartbeats: &Heartbeats,
    silence: Duration,
) -> (Vec<(u32, usize)>, BTreeMap<usize, String>) {
    let (reported, lost): (Vec<_>, Vec<_>) = members
        .iter()
        .zip(gathered)
        .partition(|(_, report)| report.is_some());
    (
        reported
            .into_iter()
            .map(|(&node, _)| (number, node))
            .collect(),
        lost.into_iter()
            .map(|(&node, _)| (node, why_lost(node, number, heartbeats, silence)))
            .collect(),
    )
}

/// The outcome of a round on this node: every node's report (by node rank), the nodes that
/// reported as `(round, node)`, and those lost with why.
type RoundOutcome = (
    Vec<Option<NodeReport>>,
    Vec<(u32, usize)>,
    BTreeMap<usize, String>,
);

/// Runs `round` on this node: starts its workers (`joining` the running round, when this
/// node rejoins it), watches them, and shares the reports; or, when the store is lost, says
/// how the job ends.
fn run_round(
    plan: &LaunchPlan,
    store: &AgentStore,
    round: &Round,
    joining: bool,
) -> anyhow::Result<Result<RoundOutcome, JobEnd>> {
    let (topology, number) = (&plan.topology, round.number);
    let mut workers = start_workers(plan, store, round, joining)?;
    let mut heartbeats = Heartbeats::new(topology.nnodes, plan.heartbeat_timeout);
    let watched = watch_round(plan, store, round, &mut workers, &mut heartbeats, joining);
    // Workers left out by a membership change are no part of the round's outcome.
    let dropped = watched
        .as_ref()
        .map_or(Vec::new(), |watched| watched.dropped_workers.clone());
    let all_workers: Vec<(usize, u32)> = workers
        .iter()
        .map(|worker| (worker.place.rank, worker.pid()))
        .collect();
    let mut workers: Vec<Worker> = workers
        .into_iter()
        .enumerate()
        .filter(|(index, _)| !dropped.contains(index))
        .map(|(_, worker)| worker)
        .collect();
    let report = node_report(topology.node_rank, &mut workers);
    let decider = watched.as_ref().map_or(0, |watched| watched.decider);
    if let Some(why) = watched
        .as_ref()
        .ok()
        .and_then(|watched| watched.left_out.clone())
    {
        return Ok(Err(left_out_of_the_job(topology.node_rank, decider, &why)));
    }
    let mut members = round.nodes();
    let mut left_out = None;
    let shared = watched.and_then(|_| {
        if plan.keep_survivors {
            // Nodes left out by the deciding node send no report.
            let gone = store.dropped_nodes(number, &members)?;
            members.retain(|node| gone.iter().all(|(gone, _)| gone != node));
            left_out = gone
                .into_iter()
                .find(|(node, _)| *node == topology.node_rank)
                .map(|(_, why)| why);
            if left_out.is_some() {
                return Ok(Vec::new());
            }
        }
        store.publish_report(number, &report)?;
        store.gather_reports(
            number,
            &members,
            &mut heartbeats,
            plan.stop_grace + REPORT_SLACK,
        )
    });
    if let Some(why) = left_out {
        return Ok(Err(left_out_of_the_job(topology.node_rank, decider, &why)));
    }
    let gathered = match shared {
        Ok(reports) => reports,
        Err(error) if plan.keep_survivors => {
            let store_kind = match (store.is_replicated(), store.single_store_is_gone()) {
                (true, _) => StoreKind::Replicated,
                (false, false) => StoreKind::Single,
                (false, true) => StoreKind::Gone,
            };
            return Ok(Err(lost_the_store_keeping_survivors(
                &error,
                topology.node_rank,
                &all_workers,
                store_kind,
            )));
        }
        Err(error) => return Ok(Err(lost_the_store(&error, topology.nnodes, report))),
    };
    let (others, lost) = reported_and_lost(
        &members,
        &gathered,
        number,
        &heartbeats,
        plan.heartbeat_timeout,
    );
    let reports = by_node(topology.nnodes, &members, gathered);
    Ok(Ok((reports, others, lost)))
}

/// What follows a round.
enum Next {
    /// The job ends so.
    End(JobEnd),
    /// Another round, counted as a restart or not (one that admits a new member).
    Round {
        /// Whether it counts against `--max-restarts`.
        restart: bool,
    },
}

/// Whether this node (`node_rank`) is the lowest of the nodes that reported a round
/// (`reported`, as `(round, node)`): it then tells the job's end, or opens the next round.
/// That is node 0 while it lives; with a replicated store, another node once it is lost.
fn coordinates(reported: &[(u32, usize)], node_rank: usize) -> bool {
    reported.iter().map(|&(_, node)| node).min() == Some(node_rank)
}

/// Decides, after round `number` whose nodes reported `reports` (`history.lost` those that
/// did not), whether the job ends or goes on; an ending is told, when this node
/// `coordinates`, to the `others` nodes that still read the store.
fn after_round(
    plan: &LaunchPlan,
    store: &AgentStore,
    (number, reports, coordinates): (u32, &[Option<NodeReport>], bool),
    history: &History,
    restarts: u32,
    others: &mut Vec<(u32, usize)>,
) -> anyhow::Result<Next> {
    let topology = &plan.topology;
    let end_job = |ended: Ended, others: &mut Vec<(u32, usize)>| -> anyhow::Result<()> {
        if coordinates {
            store.end_job(&ended)?;
            // Agents that wait to join the next round learn the end too.
            let next = number + 1;
            others.extend(
                store
                    .offered_nodes(next)?
                    .into_iter()
                    .map(|node| (next, node)),
            );
        }
        store.leave(number, others, LEAVE_TIMEOUT)
    };
    if every_worker_succeeded(reports) {
        end_job(
            Ended {
                succeeded: true,
                message: "every worker finished successfully".into(),
            },
            others,
        )?;
        return Ok(Next::End(JobEnd::Succeeded));
    }
    if let Some(reason) = store.stop_request()? {
        end_job(
            Ended {
                succeeded: false,
                message: format!("stopped: {reason}"),
            },
            others,
        )?;
        let signal = signals::stop_requested().map(|request| request.signal);
        let workers = reports
            .get(topology.node_rank)
            .and_then(Option::as_ref)
            .map_or(WorkersStopped::NoneRunning, WorkersStopped::of);
        return Ok(Next::End(JobEnd::Stopped {
            reason,
            signal,
            workers,
        }));
    }
    if history.lost.is_empty()
        && store.join_request(number)?.is_some()
        && only_stopped_for_the_join(reports)
    {
        return Ok(Next::Round { restart: false });
    }
    let cause = report::root_cause(reports).unwrap_or(RootCause::NodeSilent {
        node_rank: topology.node_rank,
    });
    if let Some(summary) = refusal(plan, &cause, reports) {
        end_job(
            Ended {
                succeeded: false,
                message: summary.clone(),
            },
            others,
        )?;
        return Ok(Next::End(JobEnd::Refused { summary }));
    }
    if restarts < plan.max_restarts {
        say(&format!(
            "round {number} failed: {}; restarting every node (restart {} of {})",
            report::headline(&cause),
            restarts + 1,
            plan.max_restarts
        ));
        return Ok(Next::Round { restart: true });
    }
    let title = format!(
        "the job failed in round {number} and no restart is left (--max-restarts {})",
        plan.max_restarts
    );
    let summary = report::summary(&title, &cause, reports);
    end_job(
        Ended {
            succeeded: false,
            message: title,
        },
        others,
    )?;
    Ok(Next::End(JobEnd::Failed { summary }))
}

/// The node that opens the rounds: closes round `number` after `restarts` restarts (see
/// [`AgentStore::close_round`]), and says whether this agent (`me`) is in it. When too few
/// nodes come before `deadline`, tells the agents that wait that the job ended, and fails
/// with why.
fn close_round(
    plan: &LaunchPlan,
    store: &AgentStore,
    (number, restarts): (u32, u32),
    me: &Member,
    history: &History,
    deadline: Instant,
) -> anyhow::Result<Waited<Entry>> {
    let interrupted = || signals::stop_requested().is_some();
    let describe = |members: &[Member]| round_line(number, members, history);
    let missing = |node: usize| match (history.lost.get(&node), &history.previous) {
        (Some(why), Some(previous)) => {
            format!("node {node} (lost in round {}: {why})", previous.number)
        }
        _ => format!("node {node}"),
    };
    match store.close_round(
        number,
        restarts,
        round_size(plan),
        deadline,
        &interrupted,
        &describe,
        &missing,
    ) {
        Ok(Waited::Done(round)) if round.includes(me) => Ok(Waited::Done(Entry::Member(round))),
        Ok(Waited::Done(round)) => Ok(Waited::Done(Entry::LeftOut(round))),
        Ok(Waited::Interrupted) => Ok(Waited::Interrupted),
        Err(error) => {
            let ended = Ended {
                succeeded: false,
                message: format!("{error:#}"),
            };
            // Best effort: this node's error says it all the same.
            if store.end_job(&ended).is_ok() {
                if let Ok(waiting) = store.offered_nodes(number) {
                    let others: Vec<(u32, usize)> =
                        waiting.into_iter().map(|node| (number, node)).collect();
                    let _ = store.leave(number, &others, LEAVE_TIMEOUT.min(plan.join_timeout));
                }
            }
            Err(error)
        }
    }
}

/// A round's first line: its members, and how and why they differ from the last round's,
/// e.g. `round 2: nodes 0 (2 workers); node 1 lost (no heartbeat for 5.0 s); world size 4 -> 2`.
fn round_line(number: u32, members: &[Member], history: &History) -> String {
    let listed: Vec<String> = members
        .iter()
        .map(|member| {
            let plural = if member.nproc == 1 { "" } else { "s" };
            format!("{} ({} worker{plural})", member.node, member.nproc)
        })
        .collect();
    let world_size: usize = members.iter().map(|member| member.nproc).sum();
    let mut line = format!("round {number}: nodes {}", listed.join(", "));
    let Some(previous) = &history.previous else {
        line.push_str(&format!("; world size {world_size}"));
        return line;
    };
    let now: Vec<usize> = members.iter().map(|member| member.node).collect();
    let before = previous.nodes();
    for node in before.iter().filter(|node| !now.contains(node)) {
        let why = history
            .lost
            .get(node)
            .map_or("it did not answer the last call", String::as_str);
        line.push_str(&format!("; node {node} lost ({why})"));
    }
    for node in now.iter().filter(|node| !before.contains(node)) {
        line.push_str(&format!("; node {node} joined"));
    }
    match previous.world_size() {
        same if same == world_size => line.push_str(&format!("; world size {world_size}")),
        before => line.push_str(&format!("; world size {before} -> {world_size}")),
    }
    line
}

/// Why member `node` of round `number` sent no report.
fn why_lost(node: usize, number: u32, heartbeats: &Heartbeats, timeout: Duration) -> String {
    let silence = heartbeats.silence_of(node);
    match silence >= timeout {
        true => format!("no heartbeat for {:.1} s", silence.as_secs_f64()),
        false => format!("it sent no report of round {number}"),
    }
}

/// The reports of a round's `members` (in their order) as one entry per node of the job; a
/// node outside the round has no workers in it.
fn by_node(
    nnodes: usize,
    members: &[usize],
    gathered: Vec<Option<NodeReport>>,
) -> Vec<Option<NodeReport>> {
    let mut reports: Vec<Option<NodeReport>> = (0..nnodes)
        .map(|node_rank| {
            Some(NodeReport {
                node_rank,
                workers: Vec::new(),
            })
        })
        .collect();
    for (&node, report) in members.iter().zip(gathered) {
        if let Some(slot) = reports.get_mut(node) {
            *slot = report;
        }
    }
    reports
}

/// Whether every worker that did not finish was stopped for a node's join: by this launcher,
/// or, exiting with 128 + SIGTERM, on another rank's request when its launcher stopped it.
fn only_stopped_for_the_join(reports: &[Option<NodeReport>]) -> bool {
    reports
        .iter()
        .flatten()
        .flat_map(|report| &report.workers)
        .all(|worker| {
            matches!(
                worker.end,
                WorkerEnd::Succeeded | WorkerEnd::StoppedByLauncher { .. }
            ) || worker.end == STOPPED_ON_REQUEST_EXIT
        })
}

/// How a worker exits when another rank's stop request, not a signal of its own, stopped it.
const STOPPED_ON_REQUEST_EXIT: WorkerEnd = WorkerEnd::ExitCode(128 + SIGTERM);

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

/// What a node that lost the store knows of it.
enum StoreKind {
    /// A replicated store: the nodes that reach a majority of its replicas go on.
    Replicated,
    /// Node 0's store, which may still run.
    Single,
    /// Node 0's store, whose host refuses connections: it is gone, and the job with it.
    Gone,
}

/// The end of this node's part of a `--keep-survivors` job when it lost the store: node 0
/// leaves its workers out once its heartbeat stops, so they were killed (`workers`, as
/// `(rank, pid)`); the others go on without them, unless node 0 itself is gone. With a
/// replicated store, the nodes that still reach a majority of its replicas go on.
fn lost_the_store_keeping_survivors(
    error: &anyhow::Error,
    node_rank: usize,
    workers: &[(usize, u32)],
    store: StoreKind,
) -> JobEnd {
    let listed: Vec<String> = workers
        .iter()
        .map(|(rank, pid)| format!("rank {rank} (pid {pid})"))
        .collect();
    let who_goes_on = match store {
        StoreKind::Replicated => {
            "with --keep-survivors, the nodes that still reach a majority of the store's \
             replicas leave a node that they cannot hear out of the job, and go on without it"
        }
        StoreKind::Single => {
            "with --keep-survivors, node 0 leaves a node that it cannot hear out of the job, \
             and the other nodes go on without it"
        }
        StoreKind::Gone => {
            "node 0's store refuses connections: it is gone, and the job's state with it \
             (--store-replicas keeps the store on several nodes)"
        }
    };
    JobEnd::Failed {
        summary: format!(
            "node {node_rank} lost the store ({error:#}) and killed its workers ({}): \
             {who_goes_on}",
            listed.join(", ")
        ),
    }
}

/// The end of this node's part of a `--keep-survivors` job when node 0 left its workers out
/// (its heartbeat was silent): `why` says what node 0 said.
fn left_out_of_the_job(node_rank: usize, decider: usize, why: &str) -> JobEnd {
    JobEnd::Failed {
        summary: format!(
            "node {node_rank} was left out of the job by node {decider} ({why}); its workers were \
             stopped, and the other nodes go on without them (start this node's launcher again \
             to join at the next round)"
        ),
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

/// The end of this node, stopped while it waits to join a round; with `for_all` (a node of
/// a fixed-size job, or one that ran a round already) it stops the whole job.
fn stop_before_round(store: &AgentStore, round: u32, for_all: bool) -> JobEnd {
    let end = stopped_here();
    if let (JobEnd::Stopped { reason, .. }, true) = (&end, for_all) {
        // Best effort: the job ends here whatever the store says.
        let _ = store.request_stop(&format!("node waiting for round {round}: {reason}"));
    }
    end
}

/// Starts this node's workers for `round`.
fn start_workers(
    plan: &LaunchPlan,
    store: &AgentStore,
    round: &Round,
    joining: bool,
) -> anyhow::Result<Vec<Worker>> {
    let topology = &plan.topology;
    let (group_rank, first_rank) = round
        .place_of(topology.node_rank)
        .context("this node is not a member of the round it starts")?;
    let job = job_env(plan, store, round, joining);
    let mut workers = Vec::with_capacity(topology.nproc_per_node);
    for local_rank in 0..topology.nproc_per_node {
        let place = WorkerPlace {
            rank: first_rank + local_rank,
            local_rank,
            node_rank: topology.node_rank,
            group_rank,
            world_size: round.world_size(),
            local_world_size: topology.nproc_per_node,
        };
        let rank = place.rank;
        match start_worker(plan, round, &job, place) {
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
/// The job-wide environment of the workers of `round`; `joiner` for one started in place of a
/// lost worker.
fn job_env(plan: &LaunchPlan, store: &AgentStore, round: &Round, joiner: bool) -> JobEnv {
    JobEnv {
        master_addr: store.master_addr.clone(),
        master_port: store.master_port,
        token: plan.token.expose_secret(),
        restart_count: round.number,
        keep_survivors: plan.keep_survivors,
        joiner,
        store_replicas: store.rides_out_cuts().then(|| store.location()),
    }
}

fn start_worker(
    plan: &LaunchPlan,
    round: &Round,
    job: &JobEnv,
    place: WorkerPlace,
) -> anyhow::Result<Worker> {
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
        "===== tandem launch: round {} (restart {} of at most {}), rank {}, node {}, local rank {}, \
         started at unix time {} =====",
        round.number,
        round.restarts,
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

/// What watching a round left: the local workers left out of the job and, when node 0 left
/// this node's running workers out, the membership that did.
struct Watched {
    dropped_workers: Vec<usize>,
    left_out: Option<String>,
    /// The node that decided the membership last, as far as this agent knows.
    decider: usize,
}

/// Watches the workers until they have all ended: on their own, or stopped because a worker
/// failed here or elsewhere, a node went silent, a node waits to join, or a stop signal came.
/// Never returns while a worker runs, even when the store fails (the workers are stopped
/// first, then the error is returned).
fn watch_round(
    plan: &LaunchPlan,
    store: &AgentStore,
    round: &Round,
    workers: &mut Vec<Worker>,
    heartbeats: &mut Heartbeats,
    joining: bool,
) -> anyhow::Result<Watched> {
    let mut duties = StoreDuties::new(plan, round);
    let (mut beats, mut membership) = watchers(plan, store, round, workers, joining)?;
    let mut stopping: Option<Stopping> = None;
    let mut cut_off: Option<CutOff> = None;
    loop {
        if stopping.is_none() && cut_off.is_none() {
            if let Err(error) = beats.check(store, workers, heartbeats) {
                duties.store_error.get_or_insert(error);
            }
        }
        let ends: Vec<Option<WorkerEnd>> = workers
            .iter()
            .map(|worker| worker.end().map(|(end, _)| end))
            .collect();
        membership.formed |= beats.formed;
        let watching = stopping.is_none() && cut_off.is_none();
        if plan.keep_survivors && watching && !membership.pause_over() {
            let changed = membership.update(plan, store, round, workers, &ends, &duties.silent);
            let tracked = changed.and_then(|started| beats.add_workers(store, workers, started));
            if let Err(error) = tracked {
                duties.store_error.get_or_insert(error);
            }
        }
        let workers: &[Worker] = workers;
        let failures: Vec<&WorkerEnd> = ends
            .iter()
            .enumerate()
            .filter(|(index, _)| !membership.dropped[*index])
            .filter_map(|(_, end)| end.as_ref())
            .filter(|end| end.is_failure())
            .collect();
        let local_failure = LocalFailure {
            any: !failures.is_empty() || membership.nobody_left,
            only_stop_requests: failures.iter().all(|end| **end == STOPPED_ON_REQUEST_EXIT),
        };
        let signal = signals::stop_requested();
        if cut_off.is_none() {
            duties.update(store, heartbeats, local_failure, signal);
        }
        let must_end = local_failure.any || signal.is_some();
        let trackers = (&mut *heartbeats, &mut beats);
        cut_off = weather_the_cut(
            cut_off,
            stopping.is_none(),
            must_end,
            plan,
            store,
            &mut duties,
            trackers,
        );
        let others_stop = duties.others_stop || duties.store_error.is_some();
        if ends.iter().all(Option::is_some) {
            let may_decide = plan.keep_survivors && stopping.is_none() && !others_stop;
            let still_deciding = may_decide
                && signal.is_none()
                && membership.others_run_on(store).unwrap_or_else(|error| {
                    duties.store_error.get_or_insert(error);
                    false
                });
            if !still_deciding {
                break;
            }
        }
        let must_stop = local_failure.any || signal.is_some() || others_stop;
        if must_stop && stopping.is_none() {
            stopping = Some(Stopping::begin(&failures, signal, workers));
        }
        if let Some(phase) = stopping.as_mut() {
            // A stopped worker can honour no SIGTERM: no grace for it. It is most likely
            // the peer the failed ones gave up on.
            for worker in workers {
                worker.kill_if_stopped();
            }
            // Cut off from the store, a node's workers have been left out of the job: they
            // must not go on, nor write anything.
            let insists = signal.is_some_and(|request| request.count >= 2)
                || (plan.keep_survivors && duties.store_error.is_some());
            escalate(phase, workers, plan.stop_grace, insists);
        }
        std::thread::sleep(WATCH_INTERVAL);
    }
    match duties.store_error {
        Some(error) => Err(error),
        None => Ok(Watched {
            dropped_workers: membership.dropped_workers(),
            left_out: membership.left_out,
            decider: membership.decider,
        }),
    }
}

/// What watches the round's `workers`: their heartbeats, and the membership. Workers
/// `joining` a running round start fenced, asking to rejoin, and must move their heartbeat
/// counters past those of the workers they replace.
fn watchers(
    plan: &LaunchPlan,
    store: &AgentStore,
    round: &Round,
    workers: &[Worker],
    joining: bool,
) -> anyhow::Result<(WorkerBeats, Membership)> {
    let (node, timeout) = (plan.topology.node_rank, plan.heartbeat_timeout);
    let mut beats = WorkerBeats::new(round, node, workers.len(), timeout);
    let mut membership = Membership::new(round, workers, plan);
    if joining {
        for (baseline, worker) in beats.baselines.iter_mut().zip(workers) {
            *baseline = store
                .worker_heartbeat(round.number, worker.place.rank)?
                .max(0);
        }
        let why = format!("node {node}'s launcher started again");
        membership.rejoining = Some((Instant::now(), why));
        membership.follow_the_decider(store)?;
    }
    Ok((beats, membership))
}

/// A node cut off from the store (`--keep-survivors`; from the majority of a replicated
/// store's replicas): the other nodes leave it out of the job, and its workers, fenced, wait
/// for the cut to heal and then rejoin. It ends after the rendezvous timeout, or at once when
/// a single store is gone for good.
struct CutOff {
    since: Instant,
    /// The store's error that began the cut.
    error: anyhow::Error,
    last_look: Instant,
}

/// What a look at the store found for a node cut off from it.
enum Cut {
    /// The store answers again: the node's workers rejoin.
    Healed,
    /// No answer yet.
    Lasts(CutOff),
    /// The node stops its workers and ends, with this error.
    Ends(anyhow::Error),
}

/// How long a node cut off from the store waits for each look at it.
const CUT_OFF_LOOK: Duration = Duration::from_millis(300);

impl CutOff {
    /// Begins a cut after the store failed with `error`; says so.
    fn begin(error: anyhow::Error, plan: &LaunchPlan) -> CutOff {
        say(&format!(
            "node {} is cut off from the job's store ({error:#}): the other nodes go on without \
             it, and its workers wait for the cut to heal, for at most {:.0} s \
             (--rendezvous-timeout)",
            plan.topology.node_rank,
            plan.rendezvous_timeout.as_secs_f64()
        ));
        let now = Instant::now();
        CutOff {
            since: now,
            error,
            last_look: now,
        }
    }

    /// Looks whether the store answers again (at most once per [`STORE_CHECK_INTERVAL`]);
    /// ends the cut when it `must_end` (a worker failed, or a stop signal came) or has lasted
    /// the rendezvous timeout.
    fn look(mut self, store: &AgentStore, plan: &LaunchPlan, must_end: bool) -> Cut {
        let lasted = self.since.elapsed();
        if must_end || lasted >= plan.rendezvous_timeout {
            return Cut::Ends(self.error.context(format!(
                "cut off from the store for {:.1} s",
                lasted.as_secs_f64()
            )));
        }
        if self.last_look.elapsed() < STORE_CHECK_INTERVAL {
            return Cut::Lasts(self);
        }
        self.last_look = Instant::now();
        if !store.answers_within(CUT_OFF_LOOK) {
            if store.single_store_is_gone() {
                let lasted = self.since.elapsed().as_secs_f64();
                return Cut::Ends(self.error.context(format!("cut off for {lasted:.1} s")));
            }
            return Cut::Lasts(self);
        }
        say(&format!(
            "node {} reaches the job's store again after {:.1} s: its workers rejoin the job at \
             a step boundary",
            plan.topology.node_rank,
            lasted.as_secs_f64()
        ));
        Cut::Healed
    }
}

/// With `--keep-survivors` and a store this node rides out cuts of (see
/// [`AgentStore::rides_out_cuts`]), while the workers run (`running`): turns the store's
/// error into a cut off the store (unless a single store is gone for good), and ends a cut
/// that healed (every silence and activity seen, in `trackers`, starts again) or that must
/// end (`must_end`, or the rendezvous timeout: the store's error is back for the workers to
/// be stopped). Returns the cut that lasts.
fn weather_the_cut(
    cut_off: Option<CutOff>,
    running: bool,
    must_end: bool,
    plan: &LaunchPlan,
    store: &AgentStore,
    duties: &mut StoreDuties,
    trackers: (&mut Heartbeats, &mut WorkerBeats),
) -> Option<CutOff> {
    let may_pause = plan.keep_survivors && store.rides_out_cuts() && running;
    let begun = match duties
        .store_error
        .take_if(|_| may_pause && cut_off.is_none() && !store.single_store_is_gone())
    {
        Some(error) => Some(CutOff::begin(error, plan)),
        None => cut_off,
    };
    match begun?.look(store, plan, must_end) {
        Cut::Healed => {
            let (nodes, workers) = trackers;
            nodes.restart();
            workers.beats.restart();
            workers.stalls.forget_all();
            duties.silent.clear();
            None
        }
        Cut::Lasts(cut) => Some(cut),
        Cut::Ends(error) => {
            duties.store_error = Some(error);
            None
        }
    }
}

/// The workers of a round that go on without the lost ones (`--keep-survivors`), and those
/// started in their place (`--replace-lost`).
struct Membership {
    round: u32,
    epoch: u64,
    /// The members' ids (their ranks at the round's start), in the order of their ranks:
    /// those of the round's start in order, then joiners as they came.
    members: Vec<usize>,
    /// Per worker: whether it was lost and left out of the job.
    dropped: Vec<bool>,
    /// Workers started in place of lost ones that are not members yet.
    joining: Vec<usize>,
    /// Workers started in place of lost ones in this round.
    replaced: u32,
    /// The fewest members that train, and how long the job waits below it.
    minimum: (usize, Duration),
    /// Since when the members are fewer than the minimum.
    paused_since: Option<Instant>,
    /// Whether a pause outlasted the rendezvous timeout: the round then ends.
    pause_ended: bool,
    /// Losses not published yet: since when, why, and the members before them.
    unpublished: Option<(Instant, Vec<String>, usize)>,
    /// Whether this agent decides the membership (node 0, or with a replicated store the
    /// lowest node whose agent still beats); the others report their lost workers to it and
    /// follow what it publishes.
    decides: bool,
    /// The node that decides, as far as this agent knows.
    decider: usize,
    /// Whether the store is replicated: the decisions then move on when the deciding node
    /// is lost.
    replicated: bool,
    /// This node's rank.
    node: usize,
    /// The other nodes of the round, with their workers' ranks.
    others: Vec<(usize, Vec<usize>)>,
    /// The nodes left out as a whole for a silent heartbeat (node 0).
    dropped_nodes: Vec<usize>,
    /// This node's lost workers, as reported to node 0 (the other nodes).
    reported: Vec<LostWorker>,
    /// Whether `reported` changed since it was last written.
    report_due: bool,
    /// The other nodes' reported losses that this node, deciding, already left out: a
    /// worker started in place of a lost one takes its rank, and the loss stays reported.
    taken: Vec<String>,
    /// The epoch of the last membership read, and when it was read (the other nodes).
    followed: (u64, Instant),
    /// The membership that left this node's running workers out, once they could not
    /// rejoin.
    left_out: Option<String>,
    /// Since when this node's running workers, left out of the job, ask to rejoin it, and
    /// why they were left out (the other nodes).
    rejoining: Option<(Instant, String)>,
    /// When the deciding node last looked for workers of other nodes that ask to rejoin.
    joiners_looked: Instant,
    /// Whether every worker of the job was lost (node 0): the round then fails.
    nobody_left: bool,
    /// Whether the job's first group has formed. A worker lost before leaves the others
    /// waiting in a formation that cannot end: the round fails instead.
    formed: bool,
}

impl Membership {
    fn new(round: &Round, workers: &[Worker], plan: &LaunchPlan) -> Membership {
        let node = plan.topology.node_rank;
        let others = other_nodes(round, node);
        let mut members: Vec<usize> = workers.iter().map(|worker| worker.place.rank).collect();
        members.extend(others.iter().flat_map(|(_, ranks)| ranks.iter().copied()));
        members.sort_unstable();
        Membership {
            round: round.number,
            epoch: 0,
            members,
            dropped: vec![false; workers.len()],
            joining: Vec::new(),
            replaced: 0,
            minimum: (plan.min_workers, plan.rendezvous_timeout),
            paused_since: None,
            pause_ended: false,
            unpublished: None,
            decides: node == 0,
            decider: 0,
            replicated: matches!(plan.topology.store, StoreLocation::Replicated { .. }),
            node,
            others,
            dropped_nodes: Vec::new(),
            reported: Vec::new(),
            report_due: false,
            taken: Vec::new(),
            followed: (0, Instant::now()),
            left_out: None,
            rejoining: None,
            joiners_looked: Instant::now(),
            nobody_left: false,
            formed: false,
        }
    }

    /// One look at the job's members: leaves the lost workers out (`silent` are the other
    /// nodes whose heartbeat stopped, with for how long), starts their replacements, and on
    /// node 0 publishes the next membership, on the others reports the losses and kills the
    /// workers that node 0 left out. Returns how many workers it started.
    fn update(
        &mut self,
        plan: &LaunchPlan,
        store: &AgentStore,
        round: &Round,
        workers: &mut Vec<Worker>,
        ends: &[Option<WorkerEnd>],
        silent: &[(usize, Duration)],
    ) -> anyhow::Result<usize> {
        let lost = self.drop_the_lost(workers, ends)?;
        let started = self.replace(plan, store, round, workers, &lost)?;
        if self.replicated {
            self.move_decisions(store, silent)?;
        }
        if self.decides {
            self.take_remote_losses(store, silent)?;
            self.publish_settled_losses(store)?;
            self.admit_joiners(store, workers, silent)?;
        } else {
            if self.report_due {
                store.report_lost(self.round, &self.reported)?;
                self.report_due = false;
            }
            self.follow(store, workers)?;
        }
        Ok(started)
    }

    /// A node that enters a running round (node 0 started again): the latest membership's
    /// deciding node decides, not node 0.
    fn follow_the_decider(&mut self, store: &AgentStore) -> anyhow::Result<()> {
        self.decides = false;
        if let Some(record) = store.membership(self.round)? {
            self.decider = store
                .membership_decider(self.round, record.epoch)?
                .unwrap_or(self.decider);
        }
        Ok(())
    }

    /// With a replicated store: takes the decisions over when the deciding node's agent and
    /// every lower node's are silent (the deciding node was lost), and gives them up when
    /// another node published a later membership (this one was taken for lost).
    fn move_decisions(
        &mut self,
        store: &AgentStore,
        silent: &[(usize, Duration)],
    ) -> anyhow::Result<()> {
        let is_silent = |node: usize| silent.iter().any(|&(silent, _)| silent == node);
        let mut lower = self.others.iter().filter(|(node, _)| *node < self.node);
        let lower_silent = lower.all(|&(node, _)| is_silent(node));
        let decider_silent = self.decider != self.node && is_silent(self.decider);
        if !self.decides && lower_silent && decider_silent && self.left_out.is_none() {
            return self.take_over(store, silent);
        }
        if self.decides && self.followed.1.elapsed() >= STORE_CHECK_INTERVAL {
            self.followed.1 = Instant::now();
            if let Some(record) = store.membership(self.round)? {
                if record.epoch > self.epoch {
                    self.decides = false;
                    self.followed.0 = self.epoch;
                    self.decider = store
                        .membership_decider(self.round, record.epoch)?
                        .unwrap_or(self.decider);
                    say(&format!(
                        "membership {} was decided by node {}; this node follows it",
                        record.epoch, self.decider
                    ));
                }
            }
        }
        Ok(())
    }

    /// Becomes the deciding node: starts from the latest membership and the nodes already
    /// left out, with this node's own losses that the membership does not show yet.
    fn take_over(
        &mut self,
        store: &AgentStore,
        silent: &[(usize, Duration)],
    ) -> anyhow::Result<()> {
        let own_lost: Vec<usize> = self.reported.iter().map(|lost| lost.rank).collect();
        if let Some(record) = store.membership(self.round)? {
            let before = record.members.len();
            let unshown: Vec<String> = self
                .reported
                .iter()
                .filter(|lost| record.members.contains(&lost.rank))
                .map(|lost| lost.why.clone())
                .collect();
            self.epoch = record.epoch;
            self.members = record.members;
            self.members.retain(|rank| !own_lost.contains(rank));
            self.unpublished = (!unshown.is_empty()).then(|| (Instant::now(), unshown, before));
        }
        let nodes: Vec<usize> = self.others.iter().map(|(node, _)| *node).collect();
        self.dropped_nodes = store
            .dropped_nodes(self.round, &nodes)?
            .into_iter()
            .map(|(node, _)| node)
            .collect();
        let gone: Vec<String> = silent
            .iter()
            .filter(|(node, _)| *node < self.node || *node == self.decider)
            .map(|(node, silence)| format!("node {node} ({:.1} s)", silence.as_secs_f64()))
            .collect();
        say(&format!(
            "node {} decides the membership now: the agents of the deciding node and of every \
             lower node are silent ({})",
            self.node,
            gone.join(", ")
        ));
        self.decides = true;
        self.decider = self.node;
        Ok(())
    }

    /// Whether this node decides and members of other nodes still run (they have not
    /// reported): the decisions must go on for them after this node's workers ended.
    fn others_run_on(&mut self, store: &AgentStore) -> anyhow::Result<bool> {
        if !self.decides {
            return Ok(false);
        }
        for (node, ranks) in &self.others {
            let in_the_job = ranks.iter().any(|rank| self.members.contains(rank));
            if in_the_job
                && !self.dropped_nodes.contains(node)
                && !store.has_reported(self.round, *node)?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Node 0: leaves out the workers that the other nodes reported lost, and every worker of
    /// a node whose heartbeat stopped; when nobody would be left, the round fails instead.
    fn take_remote_losses(
        &mut self,
        store: &AgentStore,
        silent: &[(usize, Duration)],
    ) -> anyhow::Result<()> {
        let before = self.members.len();
        let mut why = Vec::new();
        let mut gone = Vec::new();
        for (node, ranks) in &self.others {
            if self.dropped_nodes.contains(node) {
                continue;
            }
            if let Some((_, silence)) = silent.iter().find(|(silent, _)| silent == node) {
                let remaining: Vec<usize> = ranks
                    .iter()
                    .copied()
                    .filter(|rank| self.members.contains(rank))
                    .collect();
                let listed: Vec<String> = remaining.iter().map(usize::to_string).collect();
                let text = format!(
                    "node {node} lost (its launcher sent no heartbeat for {:.1} s): ranks {}",
                    silence.as_secs_f64(),
                    listed.join(", ")
                );
                store.drop_node(self.round, *node, &text)?;
                self.dropped_nodes.push(*node);
                if !remaining.is_empty() {
                    gone.extend(remaining);
                    why.push(text);
                }
                continue;
            }
            for lost in store.lost_workers(self.round, *node)? {
                let new = !self.taken.contains(&lost.why);
                if new && ranks.contains(&lost.rank) && self.members.contains(&lost.rank) {
                    gone.push(lost.rank);
                    self.taken.push(lost.why.clone());
                    why.push(lost.why);
                }
            }
        }
        if gone.is_empty() {
            return Ok(());
        }
        self.members.retain(|id| !gone.contains(id));
        if self.members.is_empty() {
            self.nobody_left = true;
            return Ok(());
        }
        let unpublished = self
            .unpublished
            .get_or_insert_with(|| (Instant::now(), Vec::new(), before));
        unpublished.1.extend(why);
        Ok(())
    }

    /// The other nodes: follows the deciding node's latest membership. When it leaves out
    /// running workers of this node (it took the node for lost: cut off, or its launcher
    /// stopped), they are fenced and ask to rejoin; they are killed when they are not let
    /// back in within the rendezvous timeout, or the round ends without them.
    fn follow(&mut self, store: &AgentStore, workers: &[Worker]) -> anyhow::Result<()> {
        if self.followed.1.elapsed() < STORE_CHECK_INTERVAL {
            return Ok(());
        }
        self.followed.1 = Instant::now();
        let Some(record) = store.membership(self.round)? else {
            return Ok(());
        };
        if let Some((since, why)) = self.rejoining.clone() {
            let waited_out = since.elapsed() >= self.minimum.1;
            if waited_out || store.round_is_over(self.round)? {
                self.kill_the_fenced(workers, &record, &why, waited_out);
                return Ok(());
            }
        }
        if record.epoch <= self.followed.0 {
            return Ok(());
        }
        self.followed.0 = record.epoch;
        if self.replicated {
            if let Some(decider) = store.membership_decider(self.round, record.epoch)? {
                self.decider = decider;
            }
        }
        self.forget_what_the_decider_took(workers, &record);
        let fenced = self.fenced(workers, &record);
        match (fenced.is_empty(), self.rejoining.is_some()) {
            (true, true) => {
                self.rejoining = None;
                say(&format!(
                    "membership {}: {}; node {}'s workers are members again",
                    record.epoch, record.why, self.node
                ));
            }
            (false, false) => {
                let them = match fenced.len() {
                    1 => "it takes part in no step of it, and rejoins",
                    _ => "they take part in no step of it, and rejoin",
                };
                say(&format!(
                    "membership {}: {}; node {} left node {}'s {} out of the job: {them} at a \
                     step boundary (for at most {:.0} s, --rendezvous-timeout)",
                    record.epoch,
                    record.why,
                    self.decider,
                    self.node,
                    fenced.join(", "),
                    self.minimum.1.as_secs_f64()
                ));
                self.rejoining = Some((Instant::now(), record.why));
            }
            _ => {}
        }
        Ok(())
    }

    /// Once `record` left this node's lost workers out, they need no more reporting; once it
    /// counts a worker started in place of a lost one, that worker joined.
    fn forget_what_the_decider_took(&mut self, workers: &[Worker], record: &MembershipRecord) {
        let reported = self.reported.len();
        self.reported
            .retain(|lost| record.members.contains(&lost.rank));
        self.report_due |= self.reported.len() != reported;
        self.joining
            .retain(|&index| !record.members.contains(&workers[index].place.rank));
    }

    /// This node's running workers that `record` leaves out, as "rank R (pid P)".
    fn fenced(&self, workers: &[Worker], record: &MembershipRecord) -> Vec<String> {
        workers
            .iter()
            .enumerate()
            .filter(|(index, worker)| {
                !self.dropped[*index]
                    && !self.joining.contains(index)
                    && worker.end().is_none()
                    && !record.members.contains(&worker.place.rank)
            })
            .map(|(_, worker)| format!("rank {} (pid {})", worker.place.rank, worker.pid()))
            .collect()
    }

    /// Kills the running workers of this node that `record` leaves out, which were not let
    /// back in (`waited_out`: within the rendezvous timeout; else before the round ended),
    /// and leaves the node out of the job for `why`.
    fn kill_the_fenced(
        &mut self,
        workers: &[Worker],
        record: &MembershipRecord,
        why: &str,
        waited_out: bool,
    ) {
        let fenced = self.fenced(workers, record);
        for (index, worker) in workers.iter().enumerate() {
            if !self.dropped[index] && !record.members.contains(&worker.place.rank) {
                self.dropped[index] = true;
                worker.stop_with(SIGKILL);
            }
        }
        let when = match waited_out {
            true => format!(
                "within {:.0} s (--rendezvous-timeout)",
                self.minimum.1.as_secs_f64()
            ),
            false => "before the round ended".to_string(),
        };
        say(&format!(
            "node {}'s {} asked to rejoin the job but were not let back in {when}: this \
             launcher killed them (SIGKILL)",
            self.node,
            fenced.join(", ")
        ));
        self.rejoining = None;
        self.left_out = Some(why.to_string());
    }

    /// Whether the job has been paused below its minimum for longer than it may wait: its
    /// workers then write a snapshot and stop, and the round ends as a failed one. Says so
    /// once.
    fn pause_over(&mut self) -> bool {
        let (fewest, wait) = self.minimum;
        if let Some(since) = self.paused_since.filter(|since| since.elapsed() >= wait) {
            say(&format!(
                "the job stayed below --min-workers {fewest} for {:.0} s (--rendezvous-timeout): \
                 its workers write a snapshot and stop",
                since.elapsed().as_secs_f64()
            ));
            self.paused_since = None;
            self.pause_ended = true;
        }
        self.pause_ended
    }

    /// When workers failed while others still run, leaves them out of the members (published
    /// by [`Membership::publish_settled_losses`]); returns the indices of the lost.
    fn drop_the_lost(
        &mut self,
        workers: &[Worker],
        ends: &[Option<WorkerEnd>],
    ) -> anyhow::Result<Vec<usize>> {
        if !self.formed {
            return Ok(Vec::new());
        }
        let lost: Vec<usize> = (0..workers.len())
            .filter(|&index| !self.dropped[index])
            .filter(|&index| ends[index].as_ref().is_some_and(WorkerEnd::is_failure))
            .collect();
        let running = (0..workers.len())
            .filter(|&index| !self.dropped[index] && ends[index].is_none())
            .count();
        let elsewhere = self
            .members
            .iter()
            .filter(|id| !workers.iter().any(|worker| worker.place.rank == **id))
            .count();
        // Node 0 decides for the whole job; the other nodes leave every loss to it.
        let survivors = match self.decides {
            true => running + elsewhere,
            false => usize::MAX,
        };
        if lost.is_empty() || survivors == 0 {
            return Ok(Vec::new());
        }
        let mut why = Vec::new();
        for &index in &lost {
            self.dropped[index] = true;
            self.joining.retain(|&joining| joining != index);
            let worker = &workers[index];
            if let Some(end) = &ends[index] {
                let (rank, pid) = (worker.place.rank, worker.pid());
                if !self.decides {
                    let lost = format!(
                        "rank {rank} (pid {pid}) on node {} {}",
                        self.node,
                        end.describe()
                    );
                    say(&format!(
                        "{lost}; node {} leaves it out of the job, the others go on \
                         (--keep-survivors)",
                        self.decider
                    ));
                    self.reported.push(LostWorker { rank, why: lost });
                    self.report_due = true;
                }
                why.push(format!("rank {rank} (pid {pid}) {}", end.describe()));
            }
        }
        let before = self.members.len();
        let lost_ids: Vec<usize> = lost
            .iter()
            .map(|&index| workers[index].place.rank)
            .collect();
        self.members.retain(|id| !lost_ids.contains(id));
        if self.members.len() < before {
            let unpublished = self
                .unpublished
                .get_or_insert_with(|| (Instant::now(), Vec::new(), before));
            unpublished.1.extend(why);
        }
        Ok(lost)
    }

    /// Publishes the losses seen so far once [`LOSS_SETTLE`] passed since the first: workers
    /// lost together (a node's processes, a kill of several) then make one membership, not
    /// one that the others would try to form with members already gone.
    fn publish_settled_losses(&mut self, store: &AgentStore) -> anyhow::Result<()> {
        let settled = self
            .unpublished
            .as_ref()
            .is_some_and(|(since, _, _)| since.elapsed() >= LOSS_SETTLE);
        if !settled {
            return Ok(());
        }
        match self.unpublished.take() {
            Some((_, reasons, before)) => self.publish(store, reasons.join("; "), before),
            None => Ok(()),
        }
    }

    /// Starts a worker in place of each of the `lost` (`--replace-lost`, at most
    /// `--max-restarts` per round); returns how many it started.
    fn replace(
        &mut self,
        plan: &LaunchPlan,
        store: &AgentStore,
        round: &Round,
        workers: &mut Vec<Worker>,
        lost: &[usize],
    ) -> anyhow::Result<usize> {
        if !plan.replace_lost {
            return Ok(0);
        }
        let job = job_env(plan, store, round, true);
        let mut started = 0;
        for &index in lost {
            if self.replaced >= plan.max_restarts {
                say(&format!(
                    "rank {} is not replaced: {} worker(s) were replaced in this round \
                     (--max-restarts {})",
                    workers[index].place.rank, self.replaced, plan.max_restarts
                ));
                continue;
            }
            self.replaced += 1;
            let worker = start_worker(plan, round, &job, workers[index].place.clone())?;
            say(&format!(
                "rank {} (pid {}) started in place of the lost one: it joins at a step boundary",
                worker.place.rank,
                worker.pid()
            ));
            workers.push(worker);
            self.dropped.push(false);
            self.joining.push(workers.len() - 1);
            started += 1;
        }
        Ok(started)
    }

    /// Lets in the joiners that said they are ready (this node's replacements, and the
    /// fenced workers of other nodes whose agents beat, `silent` being those that do not):
    /// publishes the members with them.
    fn admit_joiners(
        &mut self,
        store: &AgentStore,
        workers: &[Worker],
        silent: &[(usize, Duration)],
    ) -> anyhow::Result<()> {
        // Losses not yet published come first: a joiner may take a lost worker's rank.
        if self.unpublished.is_some() {
            return Ok(());
        }
        let mut admitted = Vec::new();
        for &index in &self.joining {
            let worker = &workers[index];
            if store.joiner_ready(self.round, worker.place.rank)? {
                admitted.push(index);
            }
        }
        let rejoining = self.remote_joiners(store, silent)?;
        if admitted.is_empty() && rejoining.is_empty() {
            return Ok(());
        }
        let before = self.members.len();
        let mut why = Vec::new();
        for &index in &admitted {
            let worker = &workers[index];
            self.members.push(worker.place.rank);
            why.push(format!(
                "rank {} (pid {}) joins",
                worker.place.rank,
                worker.pid()
            ));
        }
        for &(node, rank) in &rejoining {
            self.members.push(rank);
            why.push(format!("rank {rank} of node {node} rejoins"));
            if self.dropped_nodes.contains(&node) {
                store.readmit_node(self.round, node)?;
                self.dropped_nodes.retain(|dropped| *dropped != node);
            }
        }
        // Joiners come last, so that rank 0 stays with the worker that writes the run's files.
        self.joining.retain(|index| !admitted.contains(index));
        self.publish(store, why.join("; "), before)
    }

    /// The workers of other nodes, left out of the job, that ask to rejoin it, as
    /// `(node, rank)`; looked for at most once per [`STORE_CHECK_INTERVAL`], and only on
    /// nodes whose agents beat.
    fn remote_joiners(
        &mut self,
        store: &AgentStore,
        silent: &[(usize, Duration)],
    ) -> anyhow::Result<Vec<(usize, usize)>> {
        if self.joiners_looked.elapsed() < STORE_CHECK_INTERVAL {
            return Ok(Vec::new());
        }
        self.joiners_looked = Instant::now();
        let mut joiners = Vec::new();
        for (node, ranks) in &self.others {
            if silent.iter().any(|(silent, _)| silent == node) {
                continue;
            }
            for &rank in ranks {
                if !self.members.contains(&rank) && store.joiner_ready(self.round, rank)? {
                    joiners.push((*node, rank));
                }
            }
        }
        Ok(joiners)
    }

    /// Publishes the members as the next membership epoch, saying why; below the minimum,
    /// as paused.
    fn publish(&mut self, store: &AgentStore, why: String, before: usize) -> anyhow::Result<()> {
        if !store.claim_membership_epoch(self.round, self.epoch + 1)? {
            self.decides = false;
            self.decider = store
                .membership_decider(self.round, self.epoch + 1)?
                .unwrap_or(self.decider);
            say(&format!(
                "membership {} was decided by node {}; this node follows it",
                self.epoch + 1,
                self.decider
            ));
            return Ok(());
        }
        self.epoch += 1;
        let (fewest, wait) = self.minimum;
        let paused = self.members.len() < fewest;
        let record = MembershipRecord {
            epoch: self.epoch,
            members: self.members.clone(),
            why,
            paused_for: paused.then_some(wait.as_secs_f64()),
        };
        store.publish_membership(self.round, &record)?;
        let what = match paused {
            true => format!(
                "are fewer than --min-workers {fewest}: the job pauses for up to {:.0} s, \
                 until enough are back",
                wait.as_secs_f64()
            ),
            false => "go on in-process".to_string(),
        };
        self.paused_since = match (paused, self.paused_since) {
            (true, since) => Some(since.unwrap_or_else(Instant::now)),
            (false, _) => None,
        };
        say(&format!(
            "membership {}: {}; ranks {:?} {what} (world size {before} -> {}), nobody restarts",
            record.epoch,
            record.why,
            record.members,
            record.members.len()
        ));
        Ok(())
    }

    /// The indices of the workers left out of the job.
    fn dropped_workers(&self) -> Vec<usize> {
        (0..self.dropped.len())
            .filter(|&index| self.dropped[index])
            .collect()
    }
}

/// The nodes of `round` other than `node`, each with its workers' ranks.
fn other_nodes(round: &Round, node: usize) -> Vec<(usize, Vec<usize>)> {
    round
        .members
        .iter()
        .filter(|member| member.node != node)
        .filter_map(|member| {
            let (_, first) = round.place_of(member.node)?;
            Some((member.node, (first..first + member.nproc).collect()))
        })
        .collect()
}

/// The heartbeats of this node's workers: a worker whose heartbeat stops moving for the
/// heartbeat timeout, after its first beat, is killed and named, whether it was stopped
/// (SIGSTOP), hung, or cut off from the store.
struct WorkerBeats {
    round: u32,
    beats: Heartbeats,
    /// Per worker: its counter when it started (0, or the lost worker's last beat for one
    /// started in its place), which it must move from before it counts as beating.
    baselines: Vec<i64>,
    last_check: Instant,
    /// The workers' activities, to find those that hang while they beat.
    stalls: Stalls,
    /// The other nodes' ranks, each with its node, whose waits count as a peer's.
    remote: Vec<(usize, usize)>,
    /// Whether a worker here has beaten: its heartbeat starts once the job's first group
    /// has formed, with every worker of the round.
    formed: bool,
    /// The heartbeat timeout.
    timeout: Duration,
}

impl WorkerBeats {
    fn new(round: &Round, node: usize, workers: usize, timeout: Duration) -> WorkerBeats {
        let remote = other_nodes(round, node)
            .into_iter()
            .flat_map(|(node, ranks)| ranks.into_iter().map(move |rank| (rank, node)))
            .collect();
        WorkerBeats {
            round: round.number,
            beats: Heartbeats::new(workers, timeout),
            baselines: vec![0; workers],
            last_check: Instant::now(),
            stalls: Stalls::new(workers, timeout),
            remote,
            formed: false,
            timeout,
        }
    }

    /// Tracks the last `count` of `workers`, started in place of lost ones: each must move
    /// its counter past the lost worker's last beat.
    fn add_workers(
        &mut self,
        store: &AgentStore,
        workers: &[Worker],
        count: usize,
    ) -> anyhow::Result<()> {
        self.beats.grow(count);
        self.stalls.grow(count);
        for worker in &workers[workers.len() - count..] {
            let beat = store.worker_heartbeat(self.round, worker.place.rank)?;
            self.baselines.push(beat.max(0));
        }
        Ok(())
    }

    /// Reads every running worker's heartbeat and activity (at most once per heartbeat
    /// interval), and the other nodes' activities while a worker here idles, and kills the
    /// silent ones and the stalled ones (while no other node's agent is quiet, in `nodes`).
    fn check(
        &mut self,
        store: &AgentStore,
        workers: &[Worker],
        nodes: &Heartbeats,
    ) -> anyhow::Result<()> {
        if self.last_check.elapsed() < HEARTBEAT_INTERVAL {
            return Ok(());
        }
        self.last_check = Instant::now();
        let mut beating = vec![false; workers.len()];
        for (index, worker) in workers.iter().enumerate() {
            if worker.end().is_some() {
                self.stalls.observe(index, self.last_check, None);
                continue;
            }
            let beat = store.worker_heartbeat(self.round, worker.place.rank)?;
            let baseline = self.baselines.get(index).copied().unwrap_or(0);
            // Before its first beat a worker is still starting, and after its last one it is
            // finishing: only its exit counts then.
            if beat <= baseline {
                self.stalls.observe(index, self.last_check, None);
                continue;
            }
            self.formed = true;
            if !self.beats.observe(index, beat, store.time_failing_over()) {
                let activity = store.worker_activity(self.round, worker.place.rank)?;
                self.stalls.observe(index, self.last_check, activity);
                beating[index] = true;
                continue;
            }
            let silence = self.beats.silence_of(index);
            let silent = |stopped| WorkerEnd::Silent {
                millis: silence.as_millis() as u64,
                stopped,
            };
            if let Some(end) = worker.give_up_on(silent) {
                say(&format!(
                    "rank {} (pid {}) {}",
                    worker.place.rank,
                    worker.pid(),
                    end.describe()
                ));
            }
        }
        self.read_remote_waits(store, &beating)?;
        // While another node is quiet, a worker here that waits for nobody may be waiting
        // for a peer of that node without a collective of its own: the node's heartbeat
        // decides first.
        let quiet = self.remote.iter().any(|&(_, node)| {
            // A failover of the store stills every heartbeat: it counts here.
            let silence = nodes.stillness_of(node);
            // Longer, the node was left out, and the waits for it were broken.
            silence >= QUIET_NODE && silence < self.timeout * 2
        });
        if !quiet {
            self.kill_the_stalled(workers, &beating);
        }
        Ok(())
    }

    /// Reads the activity of every other node's rank while a worker here has been idle for
    /// the heartbeat timeout: only then can another node's wait make it stalled.
    fn read_remote_waits(&mut self, store: &AgentStore, beating: &[bool]) -> anyhow::Result<()> {
        if !self.stalls.any_idle(beating) {
            self.stalls.forget_remote();
            return Ok(());
        }
        for &(rank, node) in &self.remote {
            let activity = store.worker_activity(self.round, rank)?;
            self.stalls
                .observe_remote(rank, node, self.last_check, activity);
        }
        Ok(())
    }

    /// Kills each worker that stalls while its peers, here or on another node, wait for it
    /// (see [`Stalls`]).
    fn kill_the_stalled(&mut self, workers: &[Worker], beating: &[bool]) {
        for stall in self.stalls.stalled(beating, self.last_check) {
            let worker = &workers[stall.index];
            let (waiting_rank, waiting_node) = match stall.waiting {
                Waiter::Local(index) => (workers[index].place.rank, None),
                Waiter::Remote { rank, node } => (rank, Some(node)),
            };
            let stalled = |_| WorkerEnd::Stalled {
                idle_ms: stall.idle.as_millis() as u64,
                waiting_rank,
                waiting_node,
                waited_ms: stall.waited.as_millis() as u64,
            };
            if let Some(end) = worker.give_up_on(stalled) {
                say(&format!(
                    "rank {} (pid {}) {}",
                    worker.place.rank,
                    worker.pid(),
                    end.describe()
                ));
            }
        }
    }
}

/// SIGKILL once the grace period is over (or at once when the user insists), then give up
/// on workers that survive even that.
fn escalate(phase: &mut Stopping, workers: &[Worker], grace: Duration, insists: bool) {
    phase.send_due_sigterm(workers);
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

/// Whether workers of this node failed, and whether each of them only followed another
/// rank's stop request (which a round ending for a node's join makes).
#[derive(Debug, Clone, Copy)]
struct LocalFailure {
    any: bool,
    only_stop_requests: bool,
}

/// What the agent tells the store, and learns from it, while it watches a round. The first
/// store error is kept; after it the agent only stops its workers.
struct StoreDuties {
    node_rank: usize,
    round: u32,
    members: Vec<usize>,
    /// `--keep-survivors`: a silent node is left out by node 0, not a reason to stop.
    keep_survivors: bool,
    /// The other nodes whose heartbeat stopped, with for how long (`--keep-survivors`).
    silent: Vec<(usize, Duration)>,
    failure_marked: bool,
    join_seen: bool,
    stop_published: bool,
    others_stop: bool,
    last_check: Instant,
    last_silence_check: Instant,
    store_error: Option<anyhow::Error>,
}

impl StoreDuties {
    fn new(plan: &LaunchPlan, round: &Round) -> StoreDuties {
        StoreDuties {
            node_rank: plan.topology.node_rank,
            round: round.number,
            members: round.nodes(),
            keep_survivors: plan.keep_survivors,
            silent: Vec::new(),
            failure_marked: false,
            join_seen: false,
            stop_published: false,
            others_stop: false,
            last_check: Instant::now(),
            last_silence_check: Instant::now(),
            store_error: None,
        }
    }

    /// Publishes a local failure or stop signal, looks for silent nodes, and learns whether
    /// the workers must stop for a reason outside this node (`others_stop`: a failure
    /// elsewhere, a stop request, a silent node, a node waiting to join); keeps the store's
    /// error if it fails.
    fn update(
        &mut self,
        store: &AgentStore,
        heartbeats: &mut Heartbeats,
        local_failure: LocalFailure,
        signal: Option<StopRequest>,
    ) {
        if let Err(error) = self.try_update(store, heartbeats, local_failure, signal) {
            self.store_error.get_or_insert(error);
        }
    }

    fn try_update(
        &mut self,
        store: &AgentStore,
        heartbeats: &mut Heartbeats,
        local_failure: LocalFailure,
        signal: Option<StopRequest>,
    ) -> anyhow::Result<()> {
        if self.store_error.is_some() {
            return Ok(());
        }
        if local_failure.any && !self.failure_marked {
            // Workers that stopped with the others for a node's join did not fail.
            if !(local_failure.only_stop_requests && self.join_under_way(store)?) {
                self.failure_marked = true;
                store.mark_failed(self.round)?;
            }
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
            self.others_stop = store.round_failed(self.round)?
                || store.stop_request()?.is_some()
                || self.join_under_way(store)?;
        }
        if self.last_silence_check.elapsed() >= HEARTBEAT_INTERVAL {
            self.last_silence_check = Instant::now();
            let silent = store.silent_nodes(&self.members, heartbeats)?;
            if self.keep_survivors {
                self.silent = silent
                    .iter()
                    .map(|&node| (node, heartbeats.silence_of(node)))
                    .collect();
            } else if !silent.is_empty() && !self.others_stop {
                self.others_stop = true;
                store.mark_failed(self.round)?;
            }
        }
        Ok(())
    }

    /// Whether a node left out of the round asked to join, which ends the round; says so once.
    fn join_under_way(&mut self, store: &AgentStore) -> anyhow::Result<bool> {
        if !self.join_seen {
            if let Some(reason) = store.join_request(self.round)? {
                self.join_seen = true;
                say(&format!(
                    "round {} ends for a new member ({reason}): the workers write a snapshot \
                     and stop",
                    self.round
                ));
            }
        }
        Ok(self.join_seen)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn member(node: usize, nproc: usize) -> Member {
        Member {
            node,
            nproc,
            agent: format!("agent of node {node}"),
        }
    }

    fn round(number: u32, members: Vec<Member>) -> Round {
        Round {
            number,
            restarts: 0,
            members,
            line: String::new(),
        }
    }

    #[test]
    fn a_rounds_line_names_its_members_and_why_the_size_changed() {
        let mut history = History::default();
        assert_eq!(
            round_line(0, &[member(0, 2), member(1, 2)], &history),
            "round 0: nodes 0 (2 workers), 1 (2 workers); world size 4"
        );
        history.previous = Some(round(0, vec![member(0, 2), member(1, 2), member(2, 1)]));
        history.lost.insert(1, "no heartbeat for 5.0 s".to_string());
        assert_eq!(
            round_line(1, &[member(0, 2)], &history),
            "round 1: nodes 0 (2 workers); node 1 lost (no heartbeat for 5.0 s); node 2 lost \
             (it did not answer the last call); world size 5 -> 2"
        );
        history.previous = Some(round(1, vec![member(0, 2)]));
        history.lost.clear();
        assert_eq!(
            round_line(2, &[member(0, 2), member(1, 1)], &history),
            "round 2: nodes 0 (2 workers), 1 (1 worker); node 1 joined; world size 2 -> 3"
        );
        history.previous = Some(round(2, vec![member(0, 2), member(1, 1)]));
        assert_eq!(
            round_line(3, &[member(0, 2), member(1, 1)], &history),
            "round 3: nodes 0 (2 workers), 1 (1 worker); world size 3"
        );
    }

    #[test]
    fn workers_stopped_with_the_others_for_a_join_are_no_failure() {
        let report = |ends: Vec<WorkerEnd>| {
            let workers = ends
                .into_iter()
                .enumerate()
                .map(|(rank, end)| WorkerReport {
                    node_rank: 0,
                    rank,
                    local_rank: rank,
                    end,
                    ended_at_micros: 0,
                    error: None,
                    error_file_problem: None,
                    log_tail: Vec::new(),
                    log_file: String::new(),
                })
                .collect();
            vec![Some(NodeReport {
                node_rank: 0,
                workers,
            })]
        };
        let by_the_launcher = WorkerEnd::StoppedByLauncher { signal: SIGTERM };
        assert!(only_stopped_for_the_join(&report(vec![
            by_the_launcher.clone(),
            WorkerEnd::ExitCode(143),
        ])));
        assert!(!only_stopped_for_the_join(&report(vec![
            by_the_launcher,
            WorkerEnd::ExitCode(1),
        ])));
        assert!(!only_stopped_for_the_join(&report(vec![
            WorkerEnd::Signal(SIGKILL)
        ])));
    }
}
