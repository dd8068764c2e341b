//! How the agents of a job meet and agree, through the store that node 0's agent hosts.
//!
//! ```text
//! launch/heartbeat/{node}             counter each agent's heartbeat thread bumps every 100 ms
//! launch/stop                         set once by the first agent that received SIGTERM/SIGINT
//! launch/current                      the number of the round opened last
//! launch/ended                        Ended JSON: the job ended (read by nodes waiting to join)
//! launch/round{r}/member/{node}       Member JSON: an agent offers its node for round r (first offer wins)
//! launch/round{r}/members             Round JSON: round r closed with these members (first close wins)
//! launch/round{r}/failed              set by the first node whose worker failed: everyone stops
//! launch/round{r}/resize              set by an agent left out of round r: the members end it to let it in
//! launch/round{r}/report/{node}       NodeReport JSON: how each worker of the node ended
//! launch/round{r}/lost/{node}         LostWorker JSON list: the node's workers lost so far
//!                                     (--keep-survivors: node 0 leaves them out)
//! launch/round{r}/dropped/{node}      set by node 0 when it left a silent node's workers out
//!                                     (--keep-survivors): nobody waits for its report
//! launch/round{r}/left/{node}         the node has read every report; node 0 may drop the store
//! launch/round{r}/epoch/{e}           the node that published membership epoch e (first claim wins)
//! ```
//! Node 0 opens and closes the first round; each later one is opened and closed by the lowest
//! node that reported the round before it (node 0 while it lives; with a replicated store,
//! another node once node 0 is lost). A round closes once all `--nnodes` nodes offered
//! themselves, or, in an elastic job (`--nnodes MIN:MAX`), once MIN did and the last call
//! passed. An agent left out of a round (it came late, or came back after its node was lost)
//! offers itself for the next one and sets the round's `resize`, which the members watch.
//! Worker process groups use other keys (`round{r}/pg/...`), so nothing here collides with
//! them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tandem_dist::cluster::contract::MembershipRecord;
use tandem_dist::heartbeat::{Heartbeat, HEARTBEAT_INTERVAL};
use tandem_dist::{
    DistError, JobToken, ReplicaStart, StoreClient, StoreLimits, StoreReplica, StoreServer,
};

use super::options::{StoreLocation, Topology};
use super::report::NodeReport;

/// Bound on every single store request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// How long one blocking store wait lasts before the agent looks at its signals again.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a connection attempt lasts before the agent looks at its signals again.
const CONNECT_SLICE: Duration = Duration::from_secs(1);

/// What an agent offers when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The node (its `--node-rank`).
    pub node: usize,
    /// Workers the node starts.
    pub nproc: usize,
    /// The agent process that offered it: an agent started again for the node is another.
    pub agent: String,
}

/// A round as node 0 closed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    /// Its number: the workers' `TANDEM_RESTART_COUNT` and store prefix.
    pub number: u32,
    /// Restarts after failures before this round (a round that only let a node in is none).
    pub restarts: u32,
    /// The members in node order; a member's node rank in the round is its place here.
    pub members: Vec<Member>,
    /// The round's first line: its members and why the size changed.
    pub line: String,
}

impl Round {
    /// Workers of the whole round.
    pub fn world_size(&self) -> usize {
        self.members.iter().map(|member| member.nproc).sum()
    }

    /// The node rank of `node` in this round and the global rank of its first worker.
    pub fn place_of(&self, node: usize) -> Option<(usize, usize)> {
        let index = self.members.iter().position(|member| member.node == node)?;
        let first_rank = self.members[..index]
            .iter()
            .map(|member| member.nproc)
            .sum();
        Some((index, first_rank))
    }

    /// Whether `member` (this very agent) is in the round.
    pub fn includes(&self, member: &Member) -> bool {
        self.members.contains(member)
    }

    /// The members' nodes, in order.
    pub fn nodes(&self) -> Vec<usize> {
        self.members.iter().map(|member| member.node).collect()
    }
}

/// A worker that another node's agent lost (`--keep-survivors`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostWorker {
    /// Its rank at the round's start.
    pub rank: usize,
    /// What happened to it, e.g. "rank 3 (pid 4242) killed by SIGKILL".
    pub why: String,
}

/// How node 0 ended the job, for the agents still waiting for a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ended {
    /// Whether every worker of the last round finished successfully.
    pub succeeded: bool,
    /// What ended it, as node 0 said it.
    pub message: String,
}

/// What an agent waiting for a round learns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// The round was closed with this agent in it.
    Member(Round),
    /// The round was closed without this agent (it came too late), as it was closed.
    LeftOut(Round),
    /// Node 0 ended the job.
    Ended(Ended),
}

/// How many nodes a round takes, and how long it waits for more than the fewest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundSize {
    /// The fewest nodes.
    pub min: usize,
    /// The most nodes.
    pub max: usize,
    /// How long node 0 waits for more nodes once it has `min`.
    pub last_call: Duration,
}

/// The end of a wait that a stop signal may cut short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waited<T> {
    /// The wait finished.
    Done(T),
    /// The launcher received a stop signal first.
    Interrupted,
}

/// The last heartbeat seen from each node and when it last moved. Time the store spent
/// without a leader (its clients failing over) is no silence: nobody could beat then. That
/// credit lasts until [`RESUME_GRACE`] after the observer's own failover ended: every live
/// node's beats reach the new leader by then.
pub struct Heartbeats {
    last_seen: Vec<NodeBeat>,
    silence: Duration,
    /// The store's time failing over, as last noted.
    outage: Duration,
    /// When the store's time failing over last grew: the observer's failover ended then.
    outage_ended: Option<Instant>,
}

/// What the observer knows of one node's heartbeat.
#[derive(Clone, Copy)]
struct NodeBeat {
    /// The beat last read.
    beat: i64,
    /// When it was last seen to move, and the store's time failing over then.
    moved: (Instant, Duration),
    /// When it was last read, and the store's time failing over then.
    read: (Instant, Duration),
}

impl NodeBeat {
    fn unseen(outage: Duration) -> NodeBeat {
        let now = Instant::now();
        NodeBeat {
            beat: i64::MIN,
            moved: (now, outage),
            read: (now, outage),
        }
    }
}

/// How long after the observer's failover to a new leader of the store the other nodes have
/// to beat again before a failover stops excusing their silence. Every client waits the same
/// answer timeout on a lost leader, so a live node's beats resume within a few heartbeat
/// intervals of the observer's requests.
const RESUME_GRACE: Duration = Duration::from_millis(400);

impl Heartbeats {
    /// Starts tracking `nnodes` nodes now; a node is silent once its heartbeat stays still
    /// for `silence`.
    pub fn new(nnodes: usize, silence: Duration) -> Heartbeats {
        Heartbeats {
            last_seen: vec![NodeBeat::unseen(Duration::ZERO); nnodes],
            silence,
            outage: Duration::ZERO,
            outage_ended: None,
        }
    }

    /// Tracks `count` more, from now.
    pub fn grow(&mut self, count: usize) {
        let unseen = NodeBeat::unseen(self.outage);
        self.last_seen.extend(std::iter::repeat_n(unseen, count));
    }

    /// Starts every silence again from now: an agent cut off from the store read no beats,
    /// which says nothing of the beats' senders.
    pub fn restart(&mut self) {
        let now = (Instant::now(), self.outage);
        for last in &mut self.last_seen {
            last.moved = now;
            last.read = now;
        }
    }

    /// Records `beat` for `node`, read when the store had spent `outage` in all failing
    /// over (see [`StoreClient::time_failing_over`]); returns whether the node is silent.
    ///
    /// A beat that moved across a failover may have been sent before it: a new leader
    /// commits the beats that its predecessor had replicated but not yet confirmed. Such a
    /// move counts from the read before the failover; the next one shows a live node. After
    /// a gap of reads longer than half the silence, not spent failing over, the count starts
    /// again.
    pub fn observe(&mut self, node: usize, beat: i64, outage: Duration) -> bool {
        if outage > self.outage {
            self.outage = outage;
            self.outage_ended = Some(Instant::now());
        }
        let now = (Instant::now(), self.outage);
        let Some(last) = self.last_seen.get_mut(node) else {
            return false;
        };
        // Not looking for a while for another reason than a failover (this agent was stopped,
        // or starved of CPU) says nothing of the node: its count starts again.
        let unlooked = now.0.duration_since(last.read.0);
        let looked_away = unlooked.saturating_sub(now.1.saturating_sub(last.read.1));
        if looked_away > self.silence / 2 {
            last.moved = now;
        } else if last.beat != beat {
            let across_a_failover = last.read.1 < self.outage;
            last.moved = if across_a_failover { last.read } else { now };
        }
        last.beat = beat;
        last.read = now;
        self.silence_of(node) >= self.silence
    }

    /// How long `node`'s heartbeat has not moved, as last observed, the store's failovers
    /// included.
    pub fn stillness_of(&self, node: usize) -> Duration {
        self.last_seen
            .get(node)
            .map_or(Duration::ZERO, |last| last.moved.0.elapsed())
    }

    /// How long `node`'s heartbeat has not moved, as last observed, less the time the store
    /// spent failing over since, unless that failover ended [`RESUME_GRACE`] ago.
    pub fn silence_of(&self, node: usize) -> Duration {
        self.last_seen.get(node).map_or(Duration::ZERO, |last| {
            let stillness = last.moved.0.elapsed();
            let grace_passed = self
                .outage_ended
                .is_some_and(|ended| ended.elapsed() >= RESUME_GRACE);
            if grace_passed {
                return stillness;
            }
            stillness.saturating_sub(self.outage.saturating_sub(last.moved.1))
        })
    }
}

/// This agent's view of the store: the server when this is node 0 (or this node's replica
/// of a replicated store), and a client.
pub struct AgentStore {
    /// This node's heartbeat.
    _beat: Heartbeat,
    client: StoreClient,
    // Declared after the client so the client closes first; kept alive for the whole job.
    server: Option<StoreServer>,
    _replica: Option<StoreReplica>,
    /// Whether this node's replica started behind a job under way.
    replica_behind: bool,
    /// Whether this agent's and its workers' clients connect again after a cut off the
    /// store, so that the node may pause rather than end.
    rides_out_cuts: bool,
    /// Every replica's address, when the store is replicated.
    replicas: Vec<SocketAddr>,
    node_rank: usize,
    nnodes: usize,
    /// The store's host as the workers receive it in `MASTER_ADDR`.
    pub master_addr: String,
    /// The store's port as the workers receive it in `MASTER_PORT`.
    pub master_port: u16,
}

impl AgentStore {
    /// Hosts the store (node 0) or connects to it (the other nodes, retrying until `deadline`;
    /// `interrupted` is polled between attempts). `request_timeout` bounds each request of
    /// another node's agent (node 0 reaches its own store on loopback). A replica of a
    /// replicated store hosted here keeps its term and vote in `log_dir`. With
    /// `rides_out_cuts` (`--keep-survivors`), another node's agent connects again to a
    /// single store it was cut off from and sends its request again, as it does to a
    /// replicated store.
    pub fn open(
        topology: &Topology,
        token: &JobToken,
        (log_dir, rides_out_cuts): (&Path, bool),
        deadline: Instant,
        request_timeout: Duration,
        interrupted: &dyn Fn() -> bool,
    ) -> anyhow::Result<Waited<AgentStore>> {
        if let StoreLocation::Replicated { replicas } = &topology.store {
            return AgentStore::open_replicated(
                topology,
                replicas,
                (token, log_dir),
                deadline,
                request_timeout,
                interrupted,
            );
        }
        let (server, connect_to, master_addr, master_port) = match &topology.store {
            StoreLocation::Loopback => {
                let server = StoreServer::bind_with(
                    SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0),
                    token.clone(),
                    store_limits(topology),
                )
                .context("start the store on 127.0.0.1")?;
                let addr = server.local_addr();
                (Some(server), addr, "127.0.0.1".to_string(), addr.port())
            }
            StoreLocation::Master { addr, port } if topology.node_rank == 0 => {
                let (server, loopback) = host_store(topology, token, addr, *port)?;
                (Some(server), loopback, addr.clone(), *port)
            }
            StoreLocation::Master { addr, port } => {
                let Waited::Done(store_addr) = resolve_until(addr, *port, deadline, interrupted)?
                else {
                    return Ok(Waited::Interrupted);
                };
                (None, store_addr, addr.clone(), *port)
            }
            StoreLocation::Replicated { .. } => unreachable!("opened above"),
        };
        let request_timeout = match server {
            Some(_) => REQUEST_TIMEOUT,
            None => request_timeout,
        };
        // Each write carries a request number, so it is applied once however often it is
        // sent; node 0 reaches its own store on loopback.
        let rides_out_cuts = rides_out_cuts && server.is_none();
        let bounds = (deadline, request_timeout);
        let Waited::Done(client) =
            connect_until(connect_to, token, bounds, rides_out_cuts, interrupted)?
        else {
            return Ok(Waited::Interrupted);
        };
        // Beats from a thread of their own, so that the others hear this node while its
        // agent waits on its workers.
        let beat_client = client
            .connect_again(token, request_timeout)
            .with_context(|| format!("connect the heartbeat to the store at {connect_to}"))?;
        let beat = Heartbeat::start(
            beat_client,
            HEARTBEAT_PREFIX,
            topology.node_rank,
            HEARTBEAT_INTERVAL,
        );
        Ok(Waited::Done(AgentStore {
            _beat: beat,
            client,
            server,
            _replica: None,
            replica_behind: false,
            rides_out_cuts,
            replicas: Vec::new(),
            node_rank: topology.node_rank,
            nnodes: topology.nnodes,
            master_addr,
            master_port,
        }))
    }

    /// Hosts this node's replica of a replicated store when it has one (node i hosts
    /// `replicas[i]`), and reaches the store through every replica, waiting (until
    /// `deadline`) for them to elect a leader.
    fn open_replicated(
        topology: &Topology,
        replicas: &[(String, u16)],
        (token, log_dir): (&JobToken, &Path),
        deadline: Instant,
        request_timeout: Duration,
        interrupted: &dyn Fn() -> bool,
    ) -> anyhow::Result<Waited<AgentStore>> {
        let mut addrs = Vec::new();
        for (host, port) in replicas {
            match resolve_until(host, *port, deadline, interrupted)? {
                Waited::Done(addr) => addrs.push(addr),
                Waited::Interrupted => return Ok(Waited::Interrupted),
            }
        }
        let replica = match addrs.get(topology.node_rank) {
            Some(own) => Some(host_replica(topology, (token, log_dir), &addrs, *own)?),
            None => None,
        };
        let replica_behind = replica.as_ref().is_some_and(|(_, behind)| *behind);
        let Waited::Done(client) =
            await_leader(&addrs, token, deadline, request_timeout, interrupted)?
        else {
            return Ok(Waited::Interrupted);
        };
        let beat_client = client
            .connect_again(token, request_timeout)
            .context("connect the heartbeat to the replicated store")?;
        let beat = Heartbeat::start(
            beat_client,
            HEARTBEAT_PREFIX,
            topology.node_rank,
            HEARTBEAT_INTERVAL,
        );
        let (master_addr, master_port) = replicas[0].clone();
        Ok(Waited::Done(AgentStore {
            _beat: beat,
            client,
            server: None,
            _replica: replica.map(|(replica, _)| replica),
            replica_behind,
            rides_out_cuts: true,
            replicas: addrs,
            node_rank: topology.node_rank,
            nnodes: topology.nnodes,
            master_addr,
            master_port,
        }))
    }

    /// Whether this agent and its workers ride out a cut off the store: their clients
    /// connect again and send a request again (a replicated store, or with
    /// `--keep-survivors` another node's agent of a single one). The node then pauses when
    /// cut off, rather than end.
    pub fn rides_out_cuts(&self) -> bool {
        self.rides_out_cuts
    }

    /// Whether this node's replica of the store started behind a job under way (its host
    /// was started again), and catches up before it votes.
    pub fn replica_started_behind(&self) -> bool {
        self.replica_behind
    }

    /// The store's address as this agent reaches it.
    pub fn addr(&self) -> SocketAddr {
        self.client.addr()
    }

    /// Where the store is, as `tandem status` and the workers take it: one address, or
    /// every replica's, separated by commas.
    pub fn location(&self) -> String {
        match self.replicas.is_empty() {
            true => self.addr().to_string(),
            false => self
                .replicas
                .iter()
                .map(SocketAddr::to_string)
                .collect::<Vec<_>>()
                .join(","),
        }
    }

    /// How long this agent's store requests have spent failing over between replicas.
    pub fn time_failing_over(&self) -> Duration {
        self.client.time_failing_over()
    }

    /// Whether the store is replicated on several nodes' agents.
    pub fn is_replicated(&self) -> bool {
        !self.replicas.is_empty()
    }

    /// Whether the store answers this agent within `within` (a replicated store: whether a
    /// majority of its replicas, with their leader, is reachable).
    pub fn answers_within(&self, within: Duration) -> bool {
        self.client.get_within(CURRENT_KEY, within).is_ok()
    }

    /// Whether a single store is gone for good: its host refuses connections, so nothing
    /// listens there any more, and the job's state went with the store. A replicated store,
    /// or a host that does not answer at all (a cut link), may come back.
    pub fn single_store_is_gone(&self) -> bool {
        if self.is_replicated() {
            return false;
        }
        let refused = std::net::TcpStream::connect_timeout(&self.addr(), CUT_OFF_PROBE);
        refused.is_err_and(|error| error.kind() == std::io::ErrorKind::ConnectionRefused)
    }

    /// The node that opens the rounds (node 0, then the lowest node that reported the last
    /// round): makes `round` the round that arriving agents offer themselves for.
    pub fn open_round(&self, round: u32) -> anyhow::Result<()> {
        self.client
            .set(CURRENT_KEY, round.to_string().as_bytes())
            .context("open the round in the store")?;
        Ok(())
    }

    /// Whether the job is already under way: a round of a replicated store was opened before
    /// this agent started (it is node 0 started again after its loss). A single store is new
    /// with its host.
    pub fn job_under_way(&self) -> anyhow::Result<bool> {
        Ok(self.is_replicated() && self.client.get(CURRENT_KEY)?.is_some())
    }

    /// The round opened last, waiting (until `deadline`) for node 0 to open the first.
    pub fn current_round(
        &self,
        deadline: Instant,
        interrupted: &dyn Fn() -> bool,
    ) -> anyhow::Result<Waited<u32>> {
        loop {
            if interrupted() {
                return Ok(Waited::Interrupted);
            }
            if let Some(bytes) = self.client.get(CURRENT_KEY)? {
                let text = String::from_utf8_lossy(&bytes);
                let round = text
                    .parse()
                    .with_context(|| format!("the store's current round {text:?} is no number"))?;
                return Ok(Waited::Done(round));
            }
            if Instant::now() >= deadline {
                bail!("node 0 opened no round before the join timeout");
            }
            self.wait_slice(&[CURRENT_KEY.to_string()])?;
        }
    }

    /// Offers this agent's node for round `round`. The first offer of a node wins: another
    /// agent's offer for this node in a round not closed yet is an error naming it.
    pub fn offer(&self, round: u32, member: &Member) -> anyhow::Result<()> {
        let value = serde_json::to_vec(member).context("encode this node's membership")?;
        let stored = self
            .client
            .compare_set(&member_key(round, member.node), None, &value)
            .context("join the round in the store")?;
        if stored != value && self.client.get(&closed_key(round))?.is_none() {
            let other: Option<Member> = serde_json::from_slice(&stored).ok();
            bail!(
                "node {node} already joined round {round} from another agent ({}): is another \
                 `tandem launch --node-rank {node}` running?",
                other.map_or_else(|| "unreadable".to_string(), |other| other.agent),
                node = member.node
            );
        }
        Ok(())
    }

    /// The node that opens the rounds: waits until round `round` can close (every node offered
    /// itself, or at least `size.min` did and the last call passed), closes it and returns it
    /// (the round another node closed first, if one did). `describe` gives the round's line
    /// from its members; `missing` what the error of an elastic round says of a node that did
    /// not come before `deadline`.
    #[allow(clippy::too_many_arguments)]
    pub fn close_round(
        &self,
        round: u32,
        restarts: u32,
        size: RoundSize,
        deadline: Instant,
        interrupted: &dyn Fn() -> bool,
        describe: &dyn Fn(&[Member]) -> String,
        missing: &dyn Fn(usize) -> String,
    ) -> anyhow::Result<Waited<Round>> {
        let keys: Vec<String> = (0..self.nnodes)
            .map(|node| member_key(round, node))
            .collect();
        let mut enough_since: Option<Instant> = None;
        loop {
            if interrupted() {
                return Ok(Waited::Interrupted);
            }
            let offers = self.offers(round, &keys)?;
            if offers.len() >= size.min {
                enough_since.get_or_insert_with(Instant::now);
            }
            let last_call_over = enough_since.is_some_and(|at| at.elapsed() >= size.last_call);
            if offers.len() >= size.max || last_call_over {
                let closed = Round {
                    number: round,
                    restarts,
                    line: describe(&offers),
                    members: offers,
                };
                let value = serde_json::to_vec(&closed).context("encode the round")?;
                let stored = self
                    .client
                    .compare_set(&closed_key(round), None, &value)
                    .context("close the round in the store")?;
                if stored == value {
                    return Ok(Waited::Done(closed));
                }
                // Two nodes each took themselves for the lowest that reported: the first
                // close stands.
                let first = serde_json::from_slice(&stored)
                    .with_context(|| format!("round {round}'s record in the store is malformed"))?;
                return Ok(Waited::Done(first));
            }
            if Instant::now() >= deadline {
                let came: Vec<usize> = offers.iter().map(|member| member.node).collect();
                let absent: Vec<usize> = (0..self.nnodes)
                    .filter(|node| !came.contains(node))
                    .collect();
                if size.min == size.max {
                    let absent: Vec<String> = absent.iter().map(usize::to_string).collect();
                    bail!(
                        "node(s) {} did not join round {round} before the join timeout",
                        absent.join(", ")
                    );
                }
                let absent: Vec<String> = absent.into_iter().map(missing).collect();
                bail!(
                    "round {round} needs at least {} nodes (--nnodes {}:{}), but only {} joined \
                     before the join timeout; missing: {}",
                    size.min,
                    size.min,
                    size.max,
                    node_list(&came),
                    absent.join(", ")
                );
            }
            self.wait_slice(&keys)?;
        }
    }

    /// The other nodes: waits (until `deadline`) for the node that opens the rounds to close
    /// round `round`, or to end the job. `member` is this agent's offer.
    pub fn await_round(
        &self,
        round: u32,
        member: &Member,
        deadline: Instant,
        interrupted: &dyn Fn() -> bool,
    ) -> anyhow::Result<Waited<Entry>> {
        let closed = closed_key(round);
        loop {
            if interrupted() {
                return Ok(Waited::Interrupted);
            }
            if let Some(bytes) = self.client.get(&closed)? {
                let closed: Round = serde_json::from_slice(&bytes)
                    .with_context(|| format!("round {round}'s record in the store is malformed"))?;
                return Ok(Waited::Done(match closed.includes(member) {
                    true => Entry::Member(closed),
                    false => Entry::LeftOut(closed),
                }));
            }
            if let Some(bytes) = self.client.get(ENDED_KEY)? {
                let ended: Ended = serde_json::from_slice(&bytes)
                    .context("the job's end in the store is malformed")?;
                return Ok(Waited::Done(Entry::Ended(ended)));
            }
            if Instant::now() >= deadline {
                let keys: Vec<String> = (0..self.nnodes)
                    .map(|node| member_key(round, node))
                    .collect();
                let absent: Vec<String> =
                    self.missing(&keys)?.iter().map(usize::to_string).collect();
                bail!(
                    "round {round} did not start before the join timeout (node(s) {} did not \
                     join it)",
                    absent.join(", ")
                );
            }
            self.wait_slice(std::slice::from_ref(&closed))?;
        }
    }

    /// Node 0: tells the agents still waiting for a round that the job ended.
    pub fn end_job(&self, ended: &Ended) -> anyhow::Result<()> {
        let value = serde_json::to_vec(ended).context("encode the job's end")?;
        self.client.set(ENDED_KEY, &value)?;
        Ok(())
    }

    /// Asks the members of round `round`, which left this node out, to end it so that the
    /// next round takes the node in (the first request wins).
    pub fn ask_to_join(&self, round: u32) -> anyhow::Result<()> {
        let reason = format!("node {} is waiting to join", self.node_rank);
        self.client
            .compare_set(&resize_key(round), None, reason.as_bytes())?;
        Ok(())
    }

    /// Why round `round` ends to let a node in, if a node asked.
    pub fn join_request(&self, round: u32) -> anyhow::Result<Option<String>> {
        Ok(self
            .client
            .get(&resize_key(round))?
            .map(|reason| String::from_utf8_lossy(&reason).into_owned()))
    }

    /// The nodes that offered themselves for round `round`.
    pub fn offered_nodes(&self, round: u32) -> anyhow::Result<Vec<usize>> {
        let keys: Vec<String> = (0..self.nnodes)
            .map(|node| member_key(round, node))
            .collect();
        Ok(self
            .offers(round, &keys)?
            .iter()
            .map(|member| member.node)
            .collect())
    }

    /// The offers of round `round` among `keys`, in node order.
    fn offers(&self, round: u32, keys: &[String]) -> anyhow::Result<Vec<Member>> {
        let mut offers = Vec::new();
        for (node, key) in keys.iter().enumerate() {
            if let Some(bytes) = self.client.get(key)? {
                let member: Member = serde_json::from_slice(&bytes).with_context(|| {
                    format!("node {node}'s membership of round {round} is malformed")
                })?;
                offers.push(member);
            }
        }
        Ok(offers)
    }

    /// Tells every node that a worker of this node failed in `round`.
    pub fn mark_failed(&self, round: u32) -> anyhow::Result<()> {
        self.client
            .set(&failed_key(round), self.node_rank.to_string().as_bytes())?;
        Ok(())
    }

    /// Whether some node marked `round` as failed.
    pub fn round_failed(&self, round: u32) -> anyhow::Result<bool> {
        Ok(self.client.get(&failed_key(round))?.is_some())
    }

    /// Asks every node to stop the job (first request wins); `reason` says who and why.
    pub fn request_stop(&self, reason: &str) -> anyhow::Result<()> {
        self.client.compare_set(STOP_KEY, None, reason.as_bytes())?;
        Ok(())
    }

    /// The stop request of the job, if some node made one.
    pub fn stop_request(&self) -> anyhow::Result<Option<String>> {
        Ok(self
            .client
            .get(STOP_KEY)?
            .map(|reason| String::from_utf8_lossy(&reason).into_owned()))
    }

    /// Publishes the membership of round `round` after a worker was lost
    /// (`--keep-survivors`): the survivors read it and re-form the job.
    pub fn publish_membership(&self, round: u32, record: &MembershipRecord) -> anyhow::Result<()> {
        let prefix = tandem_dist::cluster::contract::store_prefix(round);
        let key = tandem_dist::cluster::contract::membership_key(&prefix);
        self.client.set(&key, &record.to_json())?;
        Ok(())
    }

    /// Claims membership epoch `epoch` of round `round` for this node before it publishes
    /// it: false when another node claimed it first (it decides now, not this one).
    pub fn claim_membership_epoch(&self, round: u32, epoch: u64) -> anyhow::Result<bool> {
        let mine = self.node_rank.to_string();
        let stored = self
            .client
            .compare_set(&epoch_key(round, epoch), None, mine.as_bytes())?;
        Ok(stored == mine.as_bytes())
    }

    /// The node that published membership epoch `epoch` of round `round`, once one did.
    pub fn membership_decider(&self, round: u32, epoch: u64) -> anyhow::Result<Option<usize>> {
        let claimed = self.client.get(&epoch_key(round, epoch))?;
        Ok(claimed.and_then(|node| String::from_utf8_lossy(&node).parse().ok()))
    }

    /// The latest membership of round `round` (`--keep-survivors`), `None` before the first
    /// change.
    pub fn membership(&self, round: u32) -> anyhow::Result<Option<MembershipRecord>> {
        let prefix = tandem_dist::cluster::contract::store_prefix(round);
        let key = tandem_dist::cluster::contract::membership_key(&prefix);
        let Some(bytes) = self.client.get(&key)? else {
            return Ok(None);
        };
        let record = MembershipRecord::from_json(&bytes)
            .map_err(|why| anyhow::anyhow!("round {round}'s membership in the store {why}"))?;
        Ok(Some(record))
    }

    /// Tells node 0 which workers of this node were lost so far in round `round`
    /// (`--keep-survivors`), so that it leaves them out of the job.
    pub fn report_lost(&self, round: u32, lost: &[LostWorker]) -> anyhow::Result<()> {
        let value = serde_json::to_vec(lost).context("encode this node's lost workers")?;
        self.client.set(&lost_key(round, self.node_rank), &value)?;
        Ok(())
    }

    /// The workers that node `node` lost so far in round `round`, as it reported them.
    pub fn lost_workers(&self, round: u32, node: usize) -> anyhow::Result<Vec<LostWorker>> {
        let Some(bytes) = self.client.get(&lost_key(round, node))? else {
            return Ok(Vec::new());
        };
        serde_json::from_slice(&bytes)
            .with_context(|| format!("node {node}'s lost workers of round {round} are malformed"))
    }

    /// Node 0: records that it left node `node` out of round `round` (`why`), so that no
    /// agent waits for its report.
    pub fn drop_node(&self, round: u32, node: usize, why: &str) -> anyhow::Result<()> {
        self.client.set(&dropped_key(round, node), why.as_bytes())?;
        Ok(())
    }

    /// The deciding node: takes node `node`, left out of round `round` before, back in (its
    /// workers rejoin), so that it reports at the round's end like any member.
    pub fn readmit_node(&self, round: u32, node: usize) -> anyhow::Result<()> {
        self.client.delete(&dropped_key(round, node))?;
        Ok(())
    }

    /// Whether round `round` is over for every member: the job ended, or a later round
    /// opened.
    pub fn round_is_over(&self, round: u32) -> anyhow::Result<bool> {
        Ok(self.client.get(ENDED_KEY)?.is_some()
            || self.client.get(&closed_key(round + 1))?.is_some())
    }

    /// The nodes among `nodes` that node 0 left out of round `round`, with why.
    pub fn dropped_nodes(
        &self,
        round: u32,
        nodes: &[usize],
    ) -> anyhow::Result<Vec<(usize, String)>> {
        let mut dropped = Vec::new();
        for &node in nodes {
            if let Some(why) = self.client.get(&dropped_key(round, node))? {
                dropped.push((node, String::from_utf8_lossy(&why).into_owned()));
            }
        }
        Ok(dropped)
    }

    /// Whether the worker of id `worker_id` started in place of a lost one in round `round`
    /// said it is ready to join; takes the word back so that it is read once.
    pub fn joiner_ready(&self, round: u32, worker_id: usize) -> anyhow::Result<bool> {
        let prefix = tandem_dist::cluster::contract::store_prefix(round);
        let key = tandem_dist::cluster::contract::joiner_key(&prefix, worker_id);
        // A read first: most looks find nobody, and a read adds nothing to a replicated
        // store's log.
        Ok(self.client.get(&key)?.is_some() && self.client.delete(&key)?)
    }

    /// The heartbeat counter of the worker of global `rank` in round `round` (0 before its
    /// first beat).
    pub fn worker_heartbeat(&self, round: u32, rank: usize) -> anyhow::Result<i64> {
        let prefix = tandem_dist::cluster::contract::store_prefix(round);
        Ok(self
            .client
            .add(&tandem_dist::heartbeat::heartbeat_key(&prefix, rank), 0)?)
    }

    /// The activity of worker `rank` of `round`, `None` before it wrote one.
    pub fn worker_activity(
        &self,
        round: u32,
        rank: usize,
    ) -> anyhow::Result<Option<tandem_dist::heartbeat::Activity>> {
        let prefix = tandem_dist::cluster::contract::store_prefix(round);
        let key = tandem_dist::heartbeat::activity_key(&prefix, rank);
        let Some(bytes) = self.client.get(&key)? else {
            return Ok(None);
        };
        Ok(tandem_dist::heartbeat::Activity::from_json(&bytes).ok())
    }

    /// The other nodes among `nodes` whose heartbeat has not moved for the tracker's silence.
    pub fn silent_nodes(
        &self,
        nodes: &[usize],
        heartbeats: &mut Heartbeats,
    ) -> anyhow::Result<Vec<usize>> {
        let mut silent = Vec::new();
        for &node in nodes.iter().filter(|&&node| node != self.node_rank) {
            let beat = self.client.add(&heartbeat_key(node), 0)?;
            if heartbeats.observe(node, beat, self.client.time_failing_over()) {
                silent.push(node);
            }
        }
        Ok(silent)
    }

    /// Whether node `node` published its report of `round` (its workers all ended).
    pub fn has_reported(&self, round: u32, node: usize) -> anyhow::Result<bool> {
        Ok(self.client.get(&report_key(round, node))?.is_some())
    }

    /// Publishes this node's report of `round`.
    pub fn publish_report(&self, round: u32, report: &NodeReport) -> anyhow::Result<()> {
        let value = serde_json::to_vec(report).context("encode this node's report")?;
        self.client
            .set(&report_key(round, self.node_rank), &value)?;
        Ok(())
    }

    /// Collects the report of `round` of every node among `nodes` (the round's members), in
    /// the order of `nodes`. A node counts as silent (`None`) when its heartbeat stops for the
    /// tracker's silence, or when the round was decided (failed, stopped or ending to let a
    /// node in) and `decided_grace` passed without its report.
    pub fn gather_reports(
        &self,
        round: u32,
        nodes: &[usize],
        heartbeats: &mut Heartbeats,
        decided_grace: Duration,
    ) -> anyhow::Result<Vec<Option<NodeReport>>> {
        let keys: Vec<String> = nodes.iter().map(|&node| report_key(round, node)).collect();
        let mut decided_at: Option<Instant> = None;
        loop {
            let missing = self.missing(&keys)?;
            if missing.is_empty() {
                break;
            }
            if decided_at.is_none()
                && (self.round_failed(round)?
                    || self.stop_request()?.is_some()
                    || self.join_request(round)?.is_some())
            {
                decided_at = Some(Instant::now());
            }
            let silent = self.silent_nodes(nodes, heartbeats)?;
            let waited_enough = decided_at.is_some_and(|at| at.elapsed() >= decided_grace);
            if waited_enough || missing.iter().all(|&index| silent.contains(&nodes[index])) {
                break;
            }
            self.wait_slice(&keys)?;
        }
        let mut reports = Vec::with_capacity(nodes.len());
        for (&node, key) in nodes.iter().zip(&keys) {
            let report = match self.client.get(key)? {
                Some(bytes) => Some(serde_json::from_slice(&bytes).with_context(|| {
                    format!("node {node}'s report of round {round} is malformed")
                })?),
                None => None,
            };
            reports.push(report);
        }
        Ok(reports)
    }

    /// Says this node is done with the store (it last waited for or ran round `round`); node 0
    /// then waits (bounded) for the others, since dropping the store ends their connections.
    /// `others` are the nodes to wait for, each with the round it last waited for or ran.
    pub fn leave(
        &self,
        round: u32,
        others: &[(u32, usize)],
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let said = self.client.set(&left_key(round, self.node_rank), b"1");
        if self.server.is_none() && self._replica.is_none() {
            // Node 0 may drop the store as soon as this key lands, before its answer reaches
            // us: the outcome is known already, so a lost answer is no failure.
            let _ = said;
            return Ok(());
        }
        // A replica's host keeps it up for the others too; the outcome is known already.
        if said.is_err() && self._replica.is_some() {
            return Ok(());
        }
        said?;
        let keys: Vec<String> = others
            .iter()
            .filter(|&&(_, node)| node != self.node_rank)
            .map(|&(round, node)| left_key(round, node))
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.client.wait(&key_refs, timeout) {
            Ok(()) | Err(DistError::StoreTimeout { .. }) => Ok(()),
            Err(_) if self._replica.is_some() => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// The indices of `keys` not set yet.
    fn missing(&self, keys: &[String]) -> anyhow::Result<Vec<usize>> {
        let mut missing = Vec::new();
        for (index, key) in keys.iter().enumerate() {
            if self.client.get(key)?.is_none() {
                missing.push(index);
            }
        }
        Ok(missing)
    }

    /// Blocks up to [`WAIT_SLICE`] for `keys`; a timeout is not an error.
    fn wait_slice(&self, keys: &[String]) -> anyhow::Result<()> {
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.client.wait(&key_refs, WAIT_SLICE) {
            Ok(()) | Err(DistError::StoreTimeout { .. }) => Ok(()),
            Err(error) => Err(error.into()),
        }
    }
}

/// Descriptors the launcher keeps out of the store's reach whatever happens on the store
/// port: its own files and sockets, and per worker a log file, an output pipe (two ends
/// while spawning) and the spare that `Command::spawn` needs.
const RESERVED_DESCRIPTORS: usize = 64;
/// Descriptors reserved per local worker.
const RESERVED_DESCRIPTORS_PER_WORKER: usize = 8;

/// The store's limits for this node: the defaults, with descriptors kept for the workers.
fn store_limits(topology: &Topology) -> StoreLimits {
    StoreLimits {
        reserved_descriptors: RESERVED_DESCRIPTORS
            + RESERVED_DESCRIPTORS_PER_WORKER * topology.nproc_per_node,
        ..StoreLimits::default()
    }
}

const STOP_KEY: &str = "launch/stop";
/// The number of the round opened last.
pub(crate) const CURRENT_KEY: &str = "launch/current";
const ENDED_KEY: &str = "launch/ended";

/// `nodes` in words: "node 0", "nodes 0, 2".
pub fn node_list(nodes: &[usize]) -> String {
    let listed: Vec<String> = nodes.iter().map(usize::to_string).collect();
    match nodes.len() {
        1 => format!("node {}", listed[0]),
        _ => format!("nodes {}", listed.join(", ")),
    }
}

/// The record of round `round` once it closed.
pub(crate) fn closed_key(round: u32) -> String {
    format!("launch/round{round}/members")
}

fn resize_key(round: u32) -> String {
    format!("launch/round{round}/resize")
}

fn member_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/member/{node}")
}

fn failed_key(round: u32) -> String {
    format!("launch/round{round}/failed")
}

fn report_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/report/{node}")
}

fn lost_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/lost/{node}")
}

fn dropped_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/dropped/{node}")
}

fn epoch_key(round: u32, epoch: u64) -> String {
    format!("launch/round{round}/epoch/{epoch}")
}

fn left_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/left/{node}")
}

/// The current round as node 0 closed it, read by `client`; `None` while its nodes are still
/// joining.
pub fn current_round_record(client: &StoreClient) -> anyhow::Result<Option<Round>> {
    let Some(bytes) = client.get(CURRENT_KEY)? else {
        return Ok(None);
    };
    let number: u32 = String::from_utf8_lossy(&bytes)
        .parse()
        .context("the store's current round is not a number")?;
    let Some(bytes) = client.get(&closed_key(number))? else {
        return Ok(None);
    };
    let round = serde_json::from_slice(&bytes)
        .with_context(|| format!("round {number}'s record in the store is malformed"))?;
    Ok(Some(round))
}

fn heartbeat_key(node: usize) -> String {
    tandem_dist::heartbeat::heartbeat_key(HEARTBEAT_PREFIX, node)
}

/// The namespace of the agents' heartbeats: `launch/heartbeat/{node}`.
const HEARTBEAT_PREFIX: &str = "launch";

/// The first address `host:port` resolves to.
fn resolve(host: &str, port: u16) -> std::io::Result<SocketAddr> {
    (host, port).to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{host} resolves to no address"),
        )
    })
}

/// Resolves `host:port`, retrying (names of cluster nodes may appear late in DNS).
fn resolve_until(
    host: &str,
    port: u16,
    deadline: Instant,
    interrupted: &dyn Fn() -> bool,
) -> anyhow::Result<Waited<SocketAddr>> {
    retry(interrupted, || match resolve(host, port) {
        Ok(addr) => Ok(Some(addr)),
        Err(error) if Instant::now() >= deadline => {
            bail!("could not resolve --master-addr {host:?} before the join timeout: {error}")
        }
        Err(_) => {
            std::thread::sleep(CONNECT_SLICE);
            Ok(None)
        }
    })
}

/// Calls `attempt` until it gives a value or fails, first checking each time whether a stop
/// signal came (`interrupted`); an attempt that gives nothing has waited a little itself.
fn retry<T>(
    interrupted: &dyn Fn() -> bool,
    mut attempt: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<Waited<T>> {
    loop {
        if interrupted() {
            return Ok(Waited::Interrupted);
        }
        if let Some(value) = attempt()? {
            return Ok(Waited::Done(value));
        }
    }
}

/// Node 0: serves the store on every interface at `port` (of `addr`'s family); returns the
/// server and the loopback address node 0 reaches it at.
fn host_store(
    topology: &Topology,
    token: &JobToken,
    addr: &str,
    port: u16,
) -> anyhow::Result<(StoreServer, SocketAddr)> {
    let unspecified: IpAddr = match resolve(addr, port) {
        Ok(SocketAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
        _ => Ipv4Addr::UNSPECIFIED.into(),
    };
    let limits = store_limits(topology);
    let server = StoreServer::bind_with(SocketAddr::new(unspecified, port), token.clone(), limits)
        .with_context(|| format!("start the store on port {port} (--master-port)"))?;
    let loopback: IpAddr = match unspecified.is_ipv6() {
        true => Ipv6Addr::LOCALHOST.into(),
        false => Ipv4Addr::LOCALHOST.into(),
    };
    Ok((server, SocketAddr::new(loopback, port)))
}

/// Binds and starts this node's replica on every interface at `own`'s port, its term and
/// vote kept in `log_dir`. When the other replicas already hold a job under way, this
/// node's host was started again: its replica starts behind, and catches up before it
/// votes. Returns the replica, and whether it started behind.
fn host_replica(
    topology: &Topology,
    (token, log_dir): (&JobToken, &Path),
    addrs: &[SocketAddr],
    own: SocketAddr,
) -> anyhow::Result<(StoreReplica, bool)> {
    let unspecified: IpAddr = match own {
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
    };
    let listen = SocketAddr::new(unspecified, own.port());
    let mut replica = StoreReplica::bind(listen, token.clone(), store_limits(topology))
        .with_context(|| {
            format!(
                "start node {}'s replica of the store on port {} (--store-replicas)",
                topology.node_rank,
                own.port()
            )
        })?;
    let how = ReplicaStart {
        ballot: Some(log_dir.join(BALLOT_FILE)),
        behind: job_under_way_without(addrs, topology.node_rank, token),
    };
    replica
        .start_with(addrs, topology.node_rank, &how)
        .context("start the store's replica")?;
    Ok((replica, how.behind))
}

/// How long [`AgentStore::single_store_is_gone`] waits for a connection to be refused.
const CUT_OFF_PROBE: Duration = Duration::from_millis(200);

/// The file in the log folder where a node's replica keeps its last term and vote.
const BALLOT_FILE: &str = "store-ballot";

/// How long a replica about to start looks whether the others hold a job under way. At a
/// job's start they answer nothing yet, and the replica starts as a new one.
const UNDER_WAY_LOOK: Duration = Duration::from_secs(1);

/// Whether the replicas other than the `own`-th among `addrs` answer with a round opened:
/// the store was under way before this replica.
fn job_under_way_without(addrs: &[SocketAddr], own: usize, token: &JobToken) -> bool {
    let others: Vec<SocketAddr> = (0..addrs.len())
        .filter(|&index| index != own)
        .map(|index| addrs[index])
        .collect();
    StoreClient::connect_replicated(&others, token, UNDER_WAY_LOOK)
        .and_then(|client| client.get(CURRENT_KEY))
        .is_ok_and(|round| round.is_some())
}

/// One connection attempt's bound: [`CONNECT_SLICE`], or what is left until `deadline`
/// (at least 100 ms).
fn connect_slice(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .min(CONNECT_SLICE)
        .max(Duration::from_millis(100))
}

/// Connects to a replicated store and waits, until `deadline`, for it to answer: its
/// replicas may start at different times, and answer once a majority has elected a leader.
fn await_leader(
    addrs: &[SocketAddr],
    token: &JobToken,
    deadline: Instant,
    request_timeout: Duration,
    interrupted: &dyn Fn() -> bool,
) -> anyhow::Result<Waited<StoreClient>> {
    retry(interrupted, || {
        let slice = connect_slice(deadline);
        let answered = StoreClient::connect_replicated(addrs, token, slice)
            .and_then(|probe| probe.get(CURRENT_KEY).map(|_| probe));
        match answered {
            Ok(_) => {
                let client = StoreClient::connect_replicated(addrs, token, request_timeout)
                    .context("connect to the replicated store")?;
                Ok(Some(client))
            }
            Err(error) if Instant::now() >= deadline => Err(error).context(format!(
                "the replicated store ({}) elected no leader before the join timeout",
                addrs
                    .iter()
                    .map(SocketAddr::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Err(error @ (DistError::TokenRefused { .. } | DistError::NotTrusted { .. })) => {
                Err(error).context("connect to the replicated store")
            }
            Err(_) => Ok(None),
        }
    })
}

/// Connects to the store, retrying in short slices until `deadline`. With `rides_out_cuts`,
/// the client connects again after a failure and sends the request again (see
/// [`StoreClient::connect_replicated`], here with one address).
fn connect_until(
    addr: SocketAddr,
    token: &JobToken,
    (deadline, request_timeout): (Instant, Duration),
    rides_out_cuts: bool,
    interrupted: &dyn Fn() -> bool,
) -> anyhow::Result<Waited<StoreClient>> {
    retry(interrupted, || {
        let slice = connect_slice(deadline);
        match StoreClient::connect(addr, token, slice) {
            // The probe's short timeout would bound every request too: reconnect with the
            // request bound now that the store is known to be up.
            Ok(probe) => {
                drop(probe);
                let client = match rides_out_cuts {
                    true => StoreClient::connect_replicated(&[addr], token, request_timeout),
                    false => StoreClient::connect(addr, token, request_timeout),
                };
                let client = client.with_context(|| format!("connect to the store at {addr}"))?;
                Ok(Some(client))
            }
            Err(DistError::StoreUnreachable { message, .. }) if Instant::now() >= deadline => {
                bail!("could not reach the store at {addr} before the join timeout: {message}")
            }
            Err(DistError::StoreUnreachable { .. }) => Ok(None),
            Err(error) => Err(error).with_context(|| format!("connect to the store at {addr}")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `beats` (node, beat) every 50 ms for `time`, as an agent does every heartbeat
    /// interval, the store having spent `outage` failing over.
    fn read_for(
        heartbeats: &mut Heartbeats,
        beats: &[(usize, i64)],
        outage: Duration,
        time: Duration,
    ) {
        let until = Instant::now() + time;
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
            for &(node, beat) in beats {
                heartbeats.observe(node, beat, outage);
            }
        }
    }

    #[test]
    fn time_the_store_spent_failing_over_is_no_silence() {
        let mut heartbeats = Heartbeats::new(2, Duration::from_millis(300));
        let outage = Duration::from_millis(400);
        heartbeats.observe(1, 5, Duration::ZERO);
        // A read held up by a failover.
        std::thread::sleep(Duration::from_millis(450));
        // No beat moved for 450 ms, but the store had no leader for 400 of them.
        assert!(!heartbeats.observe(1, 5, outage));
        assert!(heartbeats.silence_of(1) < Duration::from_millis(300));
        read_for(
            &mut heartbeats,
            &[(1, 5)],
            outage,
            Duration::from_millis(300),
        );
        assert!(heartbeats.observe(1, 5, outage));
        // A beat that moves starts the count again.
        assert!(!heartbeats.observe(1, 6, outage));
    }

    #[test]
    fn a_failover_excuses_silence_only_until_the_others_had_time_to_beat_again() {
        let mut heartbeats = Heartbeats::new(3, Duration::from_millis(1000));
        heartbeats.observe(1, 5, Duration::ZERO);
        heartbeats.observe(2, 7, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(950));
        // The store had no leader for 900 of those 950 ms: node 1 is excused for now.
        let outage = Duration::from_millis(900);
        assert!(!heartbeats.observe(1, 5, outage));
        assert!(!heartbeats.observe(2, 8, outage));
        read_for(
            &mut heartbeats,
            &[(1, 5)],
            outage,
            Duration::from_millis(150),
        );
        assert!(!heartbeats.observe(1, 5, outage));
        // Node 2 beat again after the failover; node 1 did not within the grace.
        read_for(&mut heartbeats, &[(1, 5)], outage, RESUME_GRACE);
        assert!(!heartbeats.observe(2, 9, outage));
        assert!(heartbeats.observe(1, 5, outage));
        assert!(heartbeats.silence_of(1) >= Duration::from_millis(1400));
    }

    #[test]
    fn an_observer_that_looked_away_counts_no_silence_for_that_time() {
        let mut heartbeats = Heartbeats::new(2, Duration::from_millis(300));
        heartbeats.observe(1, 5, Duration::ZERO);
        // The observer was stopped for 400 ms, longer than the silence.
        std::thread::sleep(Duration::from_millis(400));
        assert!(!heartbeats.observe(1, 5, Duration::ZERO));
        assert!(heartbeats.stillness_of(1) < Duration::from_millis(50));
        // Read as usual from then on, a still beat is silent after the silence.
        read_for(
            &mut heartbeats,
            &[(1, 5)],
            Duration::ZERO,
            Duration::from_millis(350),
        );
        assert!(heartbeats.observe(1, 5, Duration::ZERO));
    }

    #[test]
    fn a_beat_first_seen_moving_after_a_failover_may_be_older_than_it() {
        let mut heartbeats = Heartbeats::new(3, Duration::from_millis(1000));
        heartbeats.observe(1, 5, Duration::ZERO);
        heartbeats.observe(2, 7, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(950));
        // The new leader shows each node one beat further, which either may have sent before.
        let outage = Duration::from_millis(900);
        assert!(!heartbeats.observe(1, 6, outage));
        assert!(!heartbeats.observe(2, 8, outage));
        assert!(heartbeats.stillness_of(1) >= Duration::from_millis(950));
        read_for(
            &mut heartbeats,
            &[(1, 6)],
            outage,
            Duration::from_millis(100),
        );
        // Node 2's next beat shows it alive; node 1 has shown nothing since the failover.
        assert!(!heartbeats.observe(2, 9, outage));
        assert!(heartbeats.stillness_of(2) < Duration::from_millis(50));
        read_for(&mut heartbeats, &[(1, 6), (2, 9)], outage, RESUME_GRACE);
        assert!(heartbeats.observe(1, 6, outage));
        assert!(!heartbeats.observe(2, 10, outage));
    }

    /// Node `node_rank`'s agent store in a job of up to 3 nodes whose store is on `port`.
    fn agent(node_rank: usize, port: u16) -> AgentStore {
        let topology = Topology {
            nnodes: 3,
            min_nodes: 1,
            node_rank,
            nproc_per_node: 2,
            store: StoreLocation::Master {
                addr: "127.0.0.1".into(),
                port,
            },
            source: "flags".into(),
        };
        let token = JobToken::new("rendezvous-test-secret").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let unused = (Path::new("unused"), false);
        match AgentStore::open(
            &topology,
            &token,
            unused,
            deadline,
            REQUEST_TIMEOUT,
            &|| false,
        )
        .unwrap()
        {
            Waited::Done(store) => store,
            Waited::Interrupted => unreachable!("nothing interrupts the test"),
        }
    }

    fn member(node: usize, agent: &str) -> Member {
        Member {
            node,
            nproc: 2,
            agent: agent.into(),
        }
    }

    fn size(min: usize, max: usize, last_call: Duration) -> RoundSize {
        RoundSize {
            min,
            max,
            last_call,
        }
    }

    fn close(
        store: &AgentStore,
        round: u32,
        size: RoundSize,
        timeout: Duration,
    ) -> anyhow::Result<Round> {
        let describe = |members: &[Member]| format!("{} member(s)", members.len());
        let missing = |node: usize| format!("node {node} (gone)");
        let deadline = Instant::now() + timeout;
        match store.close_round(round, 0, size, deadline, &|| false, &describe, &missing)? {
            Waited::Done(round) => Ok(round),
            Waited::Interrupted => unreachable!("nothing interrupts the test"),
        }
    }

    fn entry(store: &AgentStore, round: u32, member: &Member) -> Entry {
        let deadline = Instant::now() + Duration::from_secs(5);
        match store
            .await_round(round, member, deadline, &|| false)
            .unwrap()
        {
            Waited::Done(entry) => entry,
            Waited::Interrupted => unreachable!("nothing interrupts the test"),
        }
    }

    /// The agents of nodes 0 and 1 of a job whose store node 0 serves on a free port.
    fn two_agents() -> (AgentStore, AgentStore) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        (agent(0, port), agent(1, port))
    }

    #[test]
    fn when_two_nodes_close_one_round_the_first_close_stands_for_both() {
        let (node_0, node_1) = two_agents();
        let (first, second) = (member(0, "a"), member(1, "b"));
        node_0.open_round(4).unwrap();
        node_0.offer(4, &first).unwrap();
        let closed = close(
            &node_0,
            4,
            size(1, 3, Duration::ZERO),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(closed.members, std::slice::from_ref(&first));
        // Node 1 also took itself for the opener, and offered after node 0 closed.
        node_1.offer(4, &second).unwrap();
        let again = close(
            &node_1,
            4,
            size(1, 3, Duration::ZERO),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(again, closed);
        assert!(matches!(entry(&node_1, 4, &second), Entry::LeftOut(round) if round == closed));
    }

    #[test]
    fn rounds_close_after_the_last_call_and_a_node_left_out_asks_to_join_the_next() {
        let (node_0, node_1) = two_agents();
        let (first, second) = (member(0, "a"), member(1, "b"));

        // Alone, node 0 has the minimum and closes the round when the last call ends.
        node_0.open_round(0).unwrap();
        node_0.offer(0, &first).unwrap();
        let opened = Instant::now();
        let round = close(
            &node_0,
            0,
            size(1, 3, Duration::from_millis(300)),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(opened.elapsed() >= Duration::from_millis(300));
        assert_eq!(round.members, std::slice::from_ref(&first));
        assert_eq!(round.line, "1 member(s)");

        // Node 1 comes late: it is left out, offers itself for the next round and asks the
        // members to end this one.
        let now = Instant::now() + Duration::from_secs(5);
        assert_eq!(
            node_1.current_round(now, &|| false).unwrap(),
            Waited::Done(0)
        );
        node_1.offer(0, &second).unwrap();
        assert!(matches!(entry(&node_1, 0, &second), Entry::LeftOut(_)));
        assert_eq!(node_0.join_request(0).unwrap(), None);
        node_1.offer(1, &second).unwrap();
        node_1.ask_to_join(0).unwrap();
        assert_eq!(
            node_0.join_request(0).unwrap().as_deref(),
            Some("node 1 is waiting to join")
        );

        // Two of at most three: the last call decides; both are in, node 1 second.
        node_0.open_round(1).unwrap();
        node_0.offer(1, &first).unwrap();
        let round = close(
            &node_0,
            1,
            size(1, 3, Duration::from_millis(200)),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(round.members, [first.clone(), second.clone()]);
        assert_eq!(round.world_size(), 4);
        assert_eq!(round.place_of(1), Some((1, 2)));
        assert_eq!(round.place_of(2), None);
        assert_eq!(entry(&node_1, 1, &second), Entry::Member(round.clone()));
        // All of at most two: no last call to wait for.
        node_0.offer(2, &first).unwrap();
        node_1.offer(2, &second).unwrap();
        let opened = Instant::now();
        close(
            &node_0,
            2,
            size(1, 2, Duration::from_secs(30)),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(opened.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_second_agent_too_few_nodes_and_the_jobs_end_are_told_to_the_agents() {
        let (node_0, node_1) = two_agents();
        let (first, second) = (member(0, "a"), member(1, "b"));

        // A second agent for node 1 in a round not closed yet is refused, naming the first.
        node_1.offer(3, &second).unwrap();
        let error = node_1.offer(3, &member(1, "c")).unwrap_err().to_string();
        assert_eq!(
            error,
            "node 1 already joined round 3 from another agent (b): is another `tandem launch \
             --node-rank 1` running?"
        );

        // Too few nodes before the deadline: the error names who is missing.
        node_0.offer(4, &first).unwrap();
        let error = close(
            &node_0,
            4,
            size(2, 3, Duration::ZERO),
            Duration::from_millis(200),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            error,
            "round 4 needs at least 2 nodes (--nnodes 2:3), but only node 0 joined before the \
             join timeout; missing: node 1 (gone), node 2 (gone)"
        );
        let error = close(
            &node_0,
            4,
            size(3, 3, Duration::ZERO),
            Duration::from_millis(200),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            error,
            "node(s) 1, 2 did not join round 4 before the join timeout"
        );

        // The job's end reaches the agents waiting for a round.
        let ended = Ended {
            succeeded: false,
            message: "too few nodes".into(),
        };
        node_0.end_job(&ended).unwrap();
        assert_eq!(entry(&node_1, 5, &second), Entry::Ended(ended));
    }
}
