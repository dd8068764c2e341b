//! How the agents of a job meet and agree, through the store that node 0's agent hosts.
//!
//! ```text
//! launch/heartbeat/{node}             counter each agent bumps while it is alive
//! launch/stop                         set once by the first agent that received SIGTERM/SIGINT
//! launch/round{r}/member/{node}       {"nproc":N}: node joined round r (a barrier: all start together)
//! launch/round{r}/failed              set by the first node whose worker failed: everyone stops
//! launch/round{r}/report/{node}       NodeReport JSON: how each worker of the node ended
//! launch/round{r}/left/{node}         the node has read every report; node 0 may drop the store
//! ```
//! Worker process groups use other keys (`round{r}/pg/...`), so nothing here collides with them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use serde::{Deserialize, Serialize};
use tandem_dist::{DistError, JobToken, StoreClient, StoreLimits, StoreServer};

use super::options::{StoreLocation, Topology};
use super::report::NodeReport;

/// Bound on every single store request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// How long one blocking store wait lasts before the agent looks at its signals again.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a connection attempt lasts before the agent looks at its signals again.
const CONNECT_SLICE: Duration = Duration::from_secs(1);

/// What a node tells the others when it joins a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Workers the node starts.
    pub nproc: usize,
}

/// The end of a wait that a stop signal may cut short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waited<T> {
    /// The wait finished.
    Done(T),
    /// The launcher received a stop signal first.
    Interrupted,
}

/// The last heartbeat seen from each node and when it last moved.
pub struct Heartbeats {
    last_seen: Vec<(i64, Instant)>,
    silence: Duration,
}

impl Heartbeats {
    /// Starts tracking `nnodes` nodes now; a node is silent once its heartbeat stays still
    /// for `silence`.
    pub fn new(nnodes: usize, silence: Duration) -> Heartbeats {
        Heartbeats {
            last_seen: vec![(i64::MIN, Instant::now()); nnodes],
            silence,
        }
    }

    /// Records `beat` for `node`; returns whether the node is silent.
    fn observe(&mut self, node: usize, beat: i64) -> bool {
        let Some(last) = self.last_seen.get_mut(node) else {
            return false;
        };
        if last.0 != beat {
            *last = (beat, Instant::now());
        }
        last.1.elapsed() >= self.silence
    }
}

/// This agent's view of the store: the server when this is node 0, and a client.
pub struct AgentStore {
    client: StoreClient,
    // Declared after the client so the client closes first; kept alive for the whole job.
    server: Option<StoreServer>,
    node_rank: usize,
    nnodes: usize,
    /// The store's host as the workers receive it in `MASTER_ADDR`.
    pub master_addr: String,
    /// The store's port as the workers receive it in `MASTER_PORT`.
    pub master_port: u16,
}

impl AgentStore {
    /// Hosts the store (node 0) or connects to it (the other nodes, retrying until `deadline`;
    /// `interrupted` is polled between attempts).
    pub fn open(
        topology: &Topology,
        token: &JobToken,
        deadline: Instant,
        interrupted: &dyn Fn() -> bool,
    ) -> anyhow::Result<Waited<AgentStore>> {
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
                let unspecified: IpAddr = match resolve(addr, *port) {
                    Ok(SocketAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
                    _ => Ipv4Addr::UNSPECIFIED.into(),
                };
                let limits = store_limits(topology);
                let server = StoreServer::bind_with(
                    SocketAddr::new(unspecified, *port),
                    token.clone(),
                    limits,
                )
                .with_context(|| format!("start the store on port {port} (--master-port)"))?;
                let loopback: IpAddr = if unspecified.is_ipv6() {
                    Ipv6Addr::LOCALHOST.into()
                } else {
                    Ipv4Addr::LOCALHOST.into()
                };
                (
                    Some(server),
                    SocketAddr::new(loopback, *port),
                    addr.clone(),
                    *port,
                )
            }
            StoreLocation::Master { addr, port } => {
                let Waited::Done(store_addr) = resolve_until(addr, *port, deadline, interrupted)?
                else {
                    return Ok(Waited::Interrupted);
                };
                (None, store_addr, addr.clone(), *port)
            }
        };
        let Waited::Done(client) = connect_until(connect_to, token, deadline, interrupted)? else {
            return Ok(Waited::Interrupted);
        };
        Ok(Waited::Done(AgentStore {
            client,
            server,
            node_rank: topology.node_rank,
            nnodes: topology.nnodes,
            master_addr,
            master_port,
        }))
    }

    /// Joins round `round` and waits (until `deadline`) for every node to join it; returns
    /// each node's membership in node order.
    pub fn join(
        &self,
        round: u32,
        member: Member,
        deadline: Instant,
        interrupted: &dyn Fn() -> bool,
    ) -> anyhow::Result<Waited<Vec<Member>>> {
        let value = serde_json::to_vec(&member).context("encode this node's membership")?;
        self.client
            .set(&member_key(round, self.node_rank), &value)
            .context("join the round in the store")?;
        let keys: Vec<String> = (0..self.nnodes)
            .map(|node| member_key(round, node))
            .collect();
        loop {
            if interrupted() {
                return Ok(Waited::Interrupted);
            }
            self.heartbeat()?;
            let missing = self.missing(&keys)?;
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let nodes: Vec<String> = missing.iter().map(|&index| index.to_string()).collect();
                bail!(
                    "node(s) {} did not join round {round} before the join timeout",
                    nodes.join(", ")
                );
            }
            self.wait_slice(&keys)?;
        }
        let mut members = Vec::with_capacity(self.nnodes);
        for (node, key) in keys.iter().enumerate() {
            let bytes = self
                .client
                .get(key)?
                .ok_or_else(|| anyhow!("node {node}'s membership vanished from the store"))?;
            let member: Member = serde_json::from_slice(&bytes).with_context(|| {
                format!("node {node}'s membership of round {round} is malformed")
            })?;
            members.push(member);
        }
        Ok(Waited::Done(members))
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

    /// Bumps this node's heartbeat so the others know its agent is alive.
    pub fn heartbeat(&self) -> anyhow::Result<()> {
        self.client.add(&heartbeat_key(self.node_rank), 1)?;
        Ok(())
    }

    /// The other nodes whose heartbeat has not moved for the tracker's silence.
    pub fn silent_nodes(&self, heartbeats: &mut Heartbeats) -> anyhow::Result<Vec<usize>> {
        let mut silent = Vec::new();
        for node in (0..self.nnodes).filter(|&node| node != self.node_rank) {
            let beat = self.client.add(&heartbeat_key(node), 0)?;
            if heartbeats.observe(node, beat) {
                silent.push(node);
            }
        }
        Ok(silent)
    }

    /// Publishes this node's report of `round`.
    pub fn publish_report(&self, round: u32, report: &NodeReport) -> anyhow::Result<()> {
        let value = serde_json::to_vec(report).context("encode this node's report")?;
        self.client
            .set(&report_key(round, self.node_rank), &value)?;
        Ok(())
    }

    /// Collects every node's report of `round`. A node counts as silent (`None`) when its
    /// heartbeat stops for the tracker's silence, or when the round was decided (failed or
    /// stopped) and `decided_grace` passed without its report.
    pub fn gather_reports(
        &self,
        round: u32,
        heartbeats: &mut Heartbeats,
        decided_grace: Duration,
    ) -> anyhow::Result<Vec<Option<NodeReport>>> {
        let keys: Vec<String> = (0..self.nnodes)
            .map(|node| report_key(round, node))
            .collect();
        let mut decided_at: Option<Instant> = None;
        loop {
            self.heartbeat()?;
            let missing = self.missing(&keys)?;
            if missing.is_empty() {
                break;
            }
            if decided_at.is_none() && (self.round_failed(round)? || self.stop_request()?.is_some())
            {
                decided_at = Some(Instant::now());
            }
            let silent = self.silent_nodes(heartbeats)?;
            let waited_enough = decided_at.is_some_and(|at| at.elapsed() >= decided_grace);
            if waited_enough || missing.iter().all(|node| silent.contains(node)) {
                break;
            }
            self.wait_slice(&keys)?;
        }
        let mut reports = Vec::with_capacity(self.nnodes);
        for (node, key) in keys.iter().enumerate() {
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

    /// Says this node is done with the store; node 0 then waits (bounded) for the others,
    /// since dropping the store ends their connections. `present` marks the nodes to wait for.
    pub fn leave(&self, round: u32, present: &[bool], timeout: Duration) -> anyhow::Result<()> {
        let said = self.client.set(&left_key(round, self.node_rank), b"1");
        if self.server.is_none() {
            // Node 0 may drop the store as soon as this key lands, before its answer reaches
            // us: the outcome is known already, so a lost answer is no failure.
            let _ = said;
            return Ok(());
        }
        said?;
        let keys: Vec<String> = (0..self.nnodes)
            .filter(|&node| present.get(node).copied().unwrap_or(false))
            .map(|node| left_key(round, node))
            .collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.client.wait(&key_refs, timeout) {
            Ok(()) | Err(DistError::StoreTimeout { .. }) => Ok(()),
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

fn member_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/member/{node}")
}

fn failed_key(round: u32) -> String {
    format!("launch/round{round}/failed")
}

fn report_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/report/{node}")
}

fn left_key(round: u32, node: usize) -> String {
    format!("launch/round{round}/left/{node}")
}

fn heartbeat_key(node: usize) -> String {
    format!("launch/heartbeat/{node}")
}

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

/// Connects to the store, retrying in short slices until `deadline`.
fn connect_until(
    addr: SocketAddr,
    token: &JobToken,
    deadline: Instant,
    interrupted: &dyn Fn() -> bool,
) -> anyhow::Result<Waited<StoreClient>> {
    retry(interrupted, || {
        let slice = deadline
            .saturating_duration_since(Instant::now())
            .min(CONNECT_SLICE)
            .max(Duration::from_millis(100));
        match StoreClient::connect(addr, token, slice) {
            // The probe's short timeout would bound every request too: reconnect with the
            // request bound now that the store is known to be up.
            Ok(probe) => {
                drop(probe);
                let client = StoreClient::connect(addr, token, REQUEST_TIMEOUT)
                    .with_context(|| format!("connect to the store at {addr}"))?;
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
