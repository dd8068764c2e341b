//! The process group: rendezvous through the store, a ring of authenticated links, and the
//! collectives on top of it.
//!
//! Rendezvous: every rank listens on a free TCP port (and a Unix socket), publishes
//! `host:port` under `{prefix}/addr/{rank}` (and the socket under `{prefix}/local/{rank}`),
//! waits for all ranks' addresses, then connects to its right neighbour while accepting its
//! left one. A failed collective closes both links (so the
//! neighbours fail at once and the failure travels around the ring) after publishing its
//! cause under `{prefix}/abort`, so that every rank reports the rank that actually failed.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::auth::JobToken;
use crate::cluster::contract::HOST_ENV;
use crate::element::{chunk_range, Element, ReduceOp};
use crate::error::{DistError, Result};
use crate::link::{collective, collective_name, kind, resolve, PeerLink};
use crate::ring::{run_plan, Planner, Ring};
use crate::shared::{self, MappedParts, OwnFile, SharedBuffer};
use crate::store::{StoreClient, StoreServer, WaitBreaker};
use crate::transport::{PeerListeners, PeerStream};

/// The default timeout of every operation: 5 minutes.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The default size of one ring message.
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;
/// The largest buffer [`ProcessGroup::broadcast_bytes`] accepts from the root.
pub const MAX_BROADCAST_BYTES: u64 = 1 << 32;
/// How long a failing rank spends on each store request while reporting its failure.
const ABORT_PUBLISH_LIMIT: Duration = Duration::from_secs(2);
/// The longest a rank that timed out waits for the other ranks' timeout reports.
const STALL_REPORT_GRACE: Duration = Duration::from_secs(1);
/// The end of every timeout message of a peer link.
const DEADLINE_SUFFIX: &str = "before the deadline";

/// How to join a process group.
#[derive(Debug, Clone)]
pub struct ProcessGroupOptions {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Host of the store.
    pub master_addr: String,
    /// Port of the store.
    pub master_port: u16,
    /// The job's shared secret.
    pub token: JobToken,
    /// Bound on the rendezvous and on every collective.
    pub timeout: Duration,
    /// Whether rank 0 serves the store itself (at `master_addr:master_port`).
    pub host_store: bool,
    /// Namespace of this group's keys in the store, e.g. one per restart round.
    pub prefix: String,
    /// The address peers should use to reach this rank; by default the interface that
    /// reaches the store.
    pub advertise_host: Option<String>,
    /// Size of one ring message; smaller pipelines better, larger costs fewer system calls.
    pub segment_bytes: usize,
    /// Whether ranks on one host talk over Unix sockets instead of loopback TCP.
    pub unix_sockets: bool,
    /// Whether [`ProcessGroup::shared_buffer`] may place buffers in shared memory when every
    /// rank is on one host.
    pub shared_memory: bool,
    /// The job's membership epoch this group belongs to (`--keep-survivors`); peers of
    /// another epoch are refused. 0 for a job whose membership never changes.
    pub membership_epoch: u64,
    /// The replicas of a replicated store ([`StoreReplica`](crate::StoreReplica)); when
    /// set, the group uses them, failing over between them, and neither `master_addr` nor
    /// `host_store` applies.
    pub store_replicas: Vec<SocketAddr>,
}

impl ProcessGroupOptions {
    /// Options with the defaults: 5-minute timeout, rank 0 hosts the store, prefix "pg", the
    /// advertised host from `TANDEM_HOST` when set, 1 MiB segments, Unix sockets and shared
    /// memory between ranks of one host.
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: u16,
        token: JobToken,
    ) -> Self {
        ProcessGroupOptions {
            rank,
            world_size,
            master_addr: master_addr.to_string(),
            master_port,
            token,
            timeout: DEFAULT_TIMEOUT,
            host_store: true,
            prefix: "pg".into(),
            advertise_host: std::env::var(HOST_ENV).ok().filter(|host| !host.is_empty()),
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            unix_sockets: true,
            shared_memory: true,
            membership_epoch: 0,
            store_replicas: Vec::new(),
        }
    }
}

impl ProcessGroupOptions {
    /// Options for a worker started by a cluster (Slurm, Open MPI, torchrun, ...), which must
    /// say where the store is (or `default_port` fills in a missing port).
    pub fn from_worker_env(
        worker: &crate::cluster::WorkerEnv,
        default_port: Option<u16>,
        token: JobToken,
    ) -> Result<ProcessGroupOptions> {
        let missing = |variable: &str| DistError::Env {
            source_name: worker.source.name().into(),
            variable: variable.into(),
            value: String::new(),
            message: "is not set, and the workers need the store's address".into(),
        };
        let master_addr = worker
            .master_addr
            .as_deref()
            .ok_or_else(|| missing(crate::cluster::contract::MASTER_ADDR_ENV))?;
        let master_port = worker
            .master_port
            .or(default_port)
            .ok_or_else(|| missing(crate::cluster::contract::MASTER_PORT_ENV))?;
        Ok(ProcessGroupOptions::new(
            worker.rank,
            worker.world_size,
            master_addr,
            master_port,
            token,
        ))
    }
}

/// One rank's membership of a group: its links to the ring neighbours and the store.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    segment_bytes: usize,
    prefix: String,
    store: StoreClient,
    links: Option<Links>,
    sequence: u64,
    failure: Option<DistError>,
    shared_memory: bool,
    shared_buffers_made: u64,
    shared_memory_refusal: Option<String>,
    /// The collective that the ring operations now running are steps of, for error messages.
    enclosing_collective: Option<&'static str>,
    // Declared last: dropped after the client and links, so rank 0 serves until it leaves.
    _server: Option<StoreServer>,
}

/// Breaks a group's ring from another thread: every collective blocked on it, here or at
/// the neighbours, fails at once, and so does every later one.
pub struct RingBreaker {
    streams: Vec<PeerStream>,
    /// The group's store waits (a formation, a gather of records), which end too.
    waits: WaitBreaker,
}

impl RingBreaker {
    /// Shuts down both ring links and abandons the group's store waits, saying `why`.
    pub fn break_ring(&self, why: &str) {
        for stream in &self.streams {
            stream.shutdown();
        }
        self.waits.abandon(why);
    }
}

/// The two ring links; for two ranks both lead to the same peer over separate connections.
struct Links {
    left: PeerLink,
    right: PeerLink,
}

impl ProcessGroup {
    /// Joins the group: serves the store on rank 0 if asked, then finds every rank through the
    /// store and connects the ring. Fails within `opts.timeout` naming the ranks that never came.
    pub fn connect(opts: ProcessGroupOptions) -> Result<ProcessGroup> {
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(DistError::InvalidArgument(format!(
                "rank {} is not within a world of size {}",
                opts.rank, opts.world_size
            )));
        }
        let deadline = Instant::now() + opts.timeout;
        if !opts.store_replicas.is_empty() {
            let store =
                StoreClient::connect_replicated(&opts.store_replicas, &opts.token, opts.timeout)?;
            return ProcessGroup::form(opts, store, None, deadline);
        }
        let master = format!("{}:{}", opts.master_addr, opts.master_port);
        let store_addr = resolve(&master).map_err(|message| DistError::StoreUnreachable {
            addr: master.clone(),
            timeout: opts.timeout,
            message: format!("the store address {message}"),
        })?;
        let server = match opts.host_store && opts.rank == 0 {
            true => Some(StoreServer::bind(store_addr, opts.token.clone())?),
            false => None,
        };
        let store = StoreClient::connect(store_addr, &opts.token, opts.timeout)?;
        ProcessGroup::form(opts, store, server, deadline)
    }

    /// Finds every rank through `store` and connects the ring, by `deadline`.
    fn form(
        opts: ProcessGroupOptions,
        store: StoreClient,
        server: Option<StoreServer>,
        deadline: Instant,
    ) -> Result<ProcessGroup> {
        let mut group = ProcessGroup {
            rank: opts.rank,
            world_size: opts.world_size,
            timeout: opts.timeout,
            segment_bytes: opts.segment_bytes.max(8),
            prefix: opts.prefix.clone(),
            store,
            links: None,
            sequence: 0,
            failure: None,
            shared_memory: opts.shared_memory,
            shared_buffers_made: 0,
            shared_memory_refusal: None,
            enclosing_collective: None,
            _server: server,
        };
        group.check_world_size()?;
        if opts.world_size > 1 {
            group.links = Some(group.connect_ring(&opts, deadline)?);
        }
        Ok(group)
    }

    /// Records the world size under a shared key; a rank that disagrees fails at once.
    fn check_world_size(&self) -> Result<()> {
        let key = format!("{}/world_size", self.prefix);
        let mine = self.world_size.to_string();
        let stored = self.store.compare_set(&key, None, mine.as_bytes())?;
        if stored != mine.as_bytes() {
            return Err(DistError::InvalidArgument(format!(
                "rank {} has world size {} but the group was started with world size {}",
                self.rank,
                self.world_size,
                String::from_utf8_lossy(&stored)
            )));
        }
        Ok(())
    }

    fn connect_ring(&self, opts: &ProcessGroupOptions, deadline: Instant) -> Result<Links> {
        let host = match &opts.advertise_host {
            Some(host) => host.clone(),
            None => self.store.local_addr()?.ip().to_string(),
        };
        let listeners = PeerListeners::bind(&host, opts.unix_sockets)?;
        let my_addr = join_host_port(&host, listeners.port()?);
        // Published before the address: a peer that sees the address also sees this.
        if let Some(endpoint) = listeners.local_endpoint() {
            self.store
                .set(&self.local_key(self.rank), endpoint.as_bytes())?;
        }
        self.store
            .set(&self.addr_key(self.rank), my_addr.as_bytes())?;

        let addresses = self.wait_for_addresses(deadline)?;
        let right_rank = (self.rank + 1) % self.world_size;
        let left_rank = (self.rank + self.world_size - 1) % self.world_size;
        let right_addr = addresses.get(right_rank).cloned().unwrap_or_default();
        let left_addr = addresses.get(left_rank).cloned().unwrap_or_default();
        let right_local = match opts.unix_sockets {
            true => self.store.get(&self.local_key(right_rank))?,
            false => None,
        };
        let right_local = right_local.map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        std::thread::scope(|scope| {
            let left = scope.spawn(|| {
                PeerLink::accept(
                    &listeners,
                    left_rank,
                    &left_addr,
                    (self.world_size, opts.membership_epoch),
                    &opts.token,
                    deadline,
                )
            });
            let right = PeerLink::connect(
                (self.rank, self.world_size, opts.membership_epoch),
                right_rank,
                &right_addr,
                right_local.as_deref(),
                &opts.token,
                deadline,
            );
            let left = left.join().unwrap_or_else(|_| {
                Err(DistError::InvalidArgument(
                    "the accept thread panicked".into(),
                ))
            });
            Ok(Links {
                left: left?,
                right: right?,
            })
        })
    }

    /// Waits until every rank has published its address; returns them in rank order.
    fn wait_for_addresses(&self, deadline: Instant) -> Result<Vec<String>> {
        let keys: Vec<String> = (0..self.world_size)
            .map(|rank| self.addr_key(rank))
            .collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let left = crate::store::remaining(deadline).unwrap_or_default();
        match self.store.wait(&key_refs, left) {
            Ok(()) => {}
            Err(DistError::StoreTimeout { missing, .. }) => {
                let missing_ranks = (0..self.world_size)
                    .filter(|rank| missing.contains(&self.addr_key(*rank)))
                    .collect();
                return Err(DistError::RendezvousTimeout {
                    missing: missing_ranks,
                    world_size: self.world_size,
                    timeout: self.timeout,
                });
            }
            Err(other) => return Err(other),
        }
        keys.iter()
            .map(|key| {
                let value = self.store.get(key)?.unwrap_or_default();
                Ok(String::from_utf8_lossy(&value).into_owned())
            })
            .collect()
    }

    fn addr_key(&self, rank: usize) -> String {
        format!("{}/addr/{rank}", self.prefix)
    }

    fn local_key(&self, rank: usize) -> String {
        format!("{}/local/{rank}", self.prefix)
    }

    fn abort_key(&self) -> String {
        format!("{}/abort", self.prefix)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The bound on each collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the bound on each later collective.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// What carries the ring: "unix" (ranks on one host), "tcp", "mixed" (a left link of one
    /// kind and a right link of the other), or "none" in a world of one.
    pub fn ring_transport(&self) -> &'static str {
        match &self.links {
            None => "none",
            Some(links) if links.left.transport() == links.right.transport() => {
                links.right.transport()
            }
            Some(_) => "mixed",
        }
    }

    /// The connection to the job's store, for the caller's own keys.
    pub fn store(&self) -> &StoreClient {
        &self.store
    }

    /// The namespace of this group's keys in the store (one per restart round under
    /// `tandem launch`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Every rank's `record` published under `name`, in rank order (see
    /// [`gather_records`](crate::gather_records)), within the group's timeout; then a barrier,
    /// so that a rank 0 that serves the store and leaves next (an error that every rank
    /// reaches from the records) does not close it while another rank is still reading.
    pub fn gather_records(&mut self, name: &str, record: &[u8]) -> Result<Vec<Vec<u8>>> {
        let records = crate::exchange::gather_records(
            &self.store,
            &self.prefix,
            name,
            self.rank,
            self.world_size,
            record,
            self.timeout,
        )?;
        self.barrier()?;
        Ok(records)
    }

    /// Reduces `buffer` over all ranks in place; every rank ends with the same bytes.
    pub fn all_reduce<T: Element>(&mut self, buffer: &mut [T], op: ReduceOp) -> Result<()> {
        let plan = self.planner::<T>().all_reduce(buffer.len());
        self.run(collective::ALL_REDUCE, T::CODE, buffer, &plan, op)
    }

    /// [`all_reduce`](Self::all_reduce) on `f32`.
    pub fn all_reduce_f32(&mut self, buffer: &mut [f32], op: ReduceOp) -> Result<()> {
        self.all_reduce(buffer, op)
    }

    /// [`all_reduce`](Self::all_reduce) on `f64`.
    pub fn all_reduce_f64(&mut self, buffer: &mut [f64], op: ReduceOp) -> Result<()> {
        self.all_reduce(buffer, op)
    }

    /// [`all_reduce`](Self::all_reduce) on `i64`.
    pub fn all_reduce_i64(&mut self, buffer: &mut [i64], op: ReduceOp) -> Result<()> {
        self.all_reduce(buffer, op)
    }

    /// Makes a zero-filled buffer of `len` elements for [`all_reduce_shared`](Self::all_reduce_shared).
    /// A collective: every rank calls it, in the same order, with the same `len`.
    ///
    /// When every rank can map every other rank's buffer (one host, same user), the buffer
    /// lives in shared memory; otherwise, on every rank, on the heap (see
    /// [`shared_memory_refusal`](Self::shared_memory_refusal) for why).
    pub fn shared_buffer<T: Element>(&mut self, len: usize) -> Result<SharedBuffer<T>> {
        let id = self.shared_buffers_made;
        self.shared_buffers_made += 1;
        if self.world_size == 1 || !self.shared_memory {
            return Ok(SharedBuffer::with_storage(id, len, None));
        }
        let own = OwnFile::create::<T>(len);
        let endpoint = match &own {
            Ok(file) => file.endpoint(),
            Err(reason) => format!("none {reason}"),
        };
        let key = |rank: usize| format!("{}/shared/{id}/{rank}", self.prefix);
        self.store.set(&key(self.rank), endpoint.as_bytes())?;
        let keys: Vec<String> = (0..self.world_size).map(key).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.store.wait(&key_refs, self.timeout)?;
        let mut refusal = own
            .as_ref()
            .err()
            .map(|reason| format!("rank {}: {reason}", self.rank));
        let mut peers = Vec::with_capacity(self.world_size);
        for (rank, key) in keys.iter().enumerate() {
            if rank == self.rank || refusal.is_some() {
                peers.push(None);
                continue;
            }
            let endpoint = self.store.get(key)?.unwrap_or_default();
            let endpoint = String::from_utf8_lossy(&endpoint);
            match shared::map_peer::<T>(&endpoint, len) {
                Ok(mapping) => peers.push(Some(mapping)),
                Err(reason) => {
                    refusal = Some(format!(
                        "rank {} cannot map rank {rank}'s buffer: {reason}",
                        self.rank
                    ));
                    peers.push(None);
                }
            }
        }
        // Every rank keeps its file open until all have mapped it.
        let mut everyone_mapped = [i64::from(refusal.is_none())];
        self.all_reduce(&mut everyone_mapped, ReduceOp::Min)?;
        match (own, everyone_mapped[0] == 1) {
            (Ok(file), true) => {
                let own = file.into_mapping();
                Ok(SharedBuffer::with_storage(
                    id,
                    len,
                    Some(MappedParts { own, peers }),
                ))
            }
            _ => {
                self.shared_memory_refusal = Some(
                    refusal.unwrap_or_else(|| "another rank could not map a peer's buffer".into()),
                );
                Ok(SharedBuffer::with_storage(id, len, None))
            }
        }
    }

    /// Why the last [`shared_buffer`](Self::shared_buffer) fell back to the heap, as this rank
    /// saw it; `None` when it did not.
    pub fn shared_memory_refusal(&self) -> Option<&str> {
        self.shared_memory_refusal.as_deref()
    }

    /// Reduces `buffer` over all ranks in place, like [`all_reduce`](Self::all_reduce), but
    /// without copying the data through sockets when the buffer is in shared memory: each rank
    /// combines its chunk from its peers' buffers, then copies the other chunks. The result is
    /// the ring's, bit for bit. Every rank must pass its buffer of the same
    /// [`shared_buffer`](Self::shared_buffer) call.
    pub fn all_reduce_shared<T: Element>(
        &mut self,
        buffer: &mut SharedBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        if let Some(values) = buffer.heap_values() {
            return self.all_reduce(values, op);
        }
        self.enclosing_collective = Some("all_reduce_shared");
        let result = self.all_reduce_mapped(buffer, op);
        self.enclosing_collective = None;
        result
    }

    /// [`all_reduce_shared`](Self::all_reduce_shared) on a buffer in shared memory.
    fn all_reduce_mapped<T: Element>(
        &mut self,
        buffer: &mut SharedBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        // Also the start barrier: every rank's buffer holds its final input.
        let identity = [buffer.id() as i64, buffer.len() as i64];
        let identities = self.all_gather(&identity)?;
        if let Some((rank, other)) = identities
            .chunks(2)
            .enumerate()
            .find(|(_, other)| *other != identity)
        {
            let error = DistError::InvalidArgument(format!(
                "all_reduce_shared: rank {} passed shared buffer #{} of {} elements but rank {rank} passed #{} of {}",
                self.rank, identity[0], identity[1], other[0], other.get(1).copied().unwrap_or(0)
            ));
            self.failure = Some(error.clone());
            return Err(error);
        }
        buffer.combine_own_chunk(self.rank, op);
        self.barrier()?;
        buffer.copy_peer_chunks();
        // No rank may return (and write its buffer) while another still copies from it.
        self.barrier()
    }

    /// Copies `root`'s `buffer` into every rank's `buffer` (all ranks pass the same length).
    pub fn broadcast<T: Element>(&mut self, buffer: &mut [T], root: usize) -> Result<()> {
        self.check_root(root)?;
        let plan = self.planner::<T>().broadcast(root, buffer.len());
        self.run(collective::BROADCAST, T::CODE, buffer, &plan, ReduceOp::Sum)
    }

    /// [`broadcast`](Self::broadcast) on `f32`.
    pub fn broadcast_f32(&mut self, buffer: &mut [f32], root: usize) -> Result<()> {
        self.broadcast(buffer, root)
    }

    /// Copies `root`'s bytes to every rank; other ranks' vectors are resized to match.
    pub fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        let mut length = [bytes.len() as i64];
        self.broadcast(&mut length, root)?;
        let length = u64::try_from(length[0]).unwrap_or(u64::MAX);
        if length > MAX_BROADCAST_BYTES {
            return Err(DistError::InvalidArgument(format!(
                "rank {root} broadcasts {length} bytes, above the limit of {MAX_BROADCAST_BYTES}"
            )));
        }
        bytes.resize(length as usize, 0);
        // Carry the bytes in whole i64 words, padding the tail.
        let mut words = vec![0i64; bytes.len().div_ceil(8)];
        let length = bytes.len();
        bytemuck::cast_slice_mut::<i64, u8>(&mut words)[..length].copy_from_slice(bytes);
        self.broadcast(&mut words, root)?;
        bytes.copy_from_slice(&bytemuck::cast_slice::<i64, u8>(&words)[..length]);
        Ok(())
    }

    /// Concatenates every rank's `part` in rank order; all parts must have the same length.
    pub fn all_gather<T: Element>(&mut self, part: &[T]) -> Result<Vec<T>> {
        let total = part.len().checked_mul(self.world_size).ok_or_else(|| {
            DistError::InvalidArgument(format!(
                "all_gather of {} elements from {} ranks does not fit in memory",
                part.len(),
                self.world_size
            ))
        })?;
        let mut gathered = vec![T::zeroed(); total];
        let own = self.rank * part.len()..(self.rank + 1) * part.len();
        if let Some(slot) = gathered.get_mut(own) {
            slot.copy_from_slice(part);
        }
        let plan = self.planner::<T>().all_gather(part.len());
        self.run(
            collective::ALL_GATHER,
            T::CODE,
            &mut gathered,
            &plan,
            ReduceOp::Sum,
        )?;
        Ok(gathered)
    }

    /// [`all_gather`](Self::all_gather) on `f32`.
    pub fn all_gather_f32(&mut self, part: &[f32]) -> Result<Vec<f32>> {
        self.all_gather(part)
    }

    /// Reduces `input` over all ranks and returns this rank's chunk of the result: the elements
    /// [`chunk_range`]`(input.len(), world_size, rank)`.
    pub fn reduce_scatter<T: Element>(&mut self, input: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let mut buffer = input.to_vec();
        let plan = self.planner::<T>().reduce_scatter(buffer.len());
        self.run(collective::REDUCE_SCATTER, T::CODE, &mut buffer, &plan, op)?;
        let mine = chunk_range(buffer.len(), self.world_size, self.rank);
        let mut chunk = buffer.get(mine).unwrap_or_default().to_vec();
        if self.world_size == 1 && op == ReduceOp::Mean {
            chunk.iter_mut().for_each(|value| *value = value.divide(1));
        }
        Ok(chunk)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) on `f32`.
    pub fn reduce_scatter_f32(&mut self, input: &[f32], op: ReduceOp) -> Result<Vec<f32>> {
        self.reduce_scatter(input, op)
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        let mut count = [1i64];
        let plan = self.planner::<i64>().all_reduce(1);
        self.run(
            collective::BARRIER,
            i64::CODE,
            &mut count,
            &plan,
            ReduceOp::Sum,
        )?;
        match count[0] == self.world_size as i64 {
            true => Ok(()),
            false => Err(DistError::InvalidArgument(format!(
                "barrier counted {} ranks in a world of {}",
                count[0], self.world_size
            ))),
        }
    }

    /// What breaks this group's ring from another thread (nothing to break for one rank).
    pub fn ring_breaker(&self) -> Result<RingBreaker> {
        let streams = match &self.links {
            Some(links) => {
                let handles = [links.left.shutdown_handle(), links.right.shutdown_handle()];
                handles
                    .into_iter()
                    .collect::<std::io::Result<_>>()
                    .map_err(|error| DistError::Io {
                        context: "duplicate a ring link's handle".into(),
                        message: error.to_string(),
                    })?
            }
            None => Vec::new(),
        };
        Ok(RingBreaker {
            streams,
            waits: self.store.wait_breaker(),
        })
    }

    /// Gives up on the group because of a failure outside it (e.g. a non-finite loss): records
    /// `reason` as the root cause for the other ranks, closes the ring so their collectives
    /// fail at once, and refuses further collectives here.
    pub fn abort(&mut self, reason: &str) {
        let report = format!("rank {} gave up: {reason}", self.rank);
        let error = DistError::Aborted {
            op: "the process group".into(),
            report: report.clone(),
        };
        let timeout = ABORT_PUBLISH_LIMIT.min(self.timeout);
        let _ = self
            .store
            .compare_set_within(&self.abort_key(), None, report.as_bytes(), timeout);
        if let Some(links) = &self.links {
            links.left.shut_down();
            links.right.shut_down();
        }
        if self.failure.is_none() {
            self.failure = Some(error);
        }
    }

    fn check_root(&self, root: usize) -> Result<()> {
        match root < self.world_size {
            true => Ok(()),
            false => Err(DistError::InvalidArgument(format!(
                "root {root} is not within a world of size {}",
                self.world_size
            ))),
        }
    }

    /// The planner of this rank's collectives on elements of type `T`.
    fn planner<T>(&self) -> Planner {
        Planner {
            rank: self.rank,
            world_size: self.world_size,
            segment_elements: (self.segment_bytes / std::mem::size_of::<T>()).max(1),
        }
    }

    /// Runs one collective's plan; the first failure poisons the group.
    fn run<T: Element>(
        &mut self,
        collective: u32,
        element_code: u32,
        buffer: &mut [T],
        plan: &crate::ring::Plan,
        op: ReduceOp,
    ) -> Result<()> {
        if let Some(failure) = &self.failure {
            return Err(DistError::GroupFailed(Box::new(failure.clone())));
        }
        self.sequence += 1;
        let Some(links) = &self.links else {
            return Ok(());
        };
        let op_name = match self.enclosing_collective {
            Some(outer) => format!(
                "{outer} (its {} #{})",
                collective_name(collective),
                self.sequence
            ),
            None => format!("{} #{}", collective_name(collective), self.sequence),
        };
        let on_failure = |error: DistError| self.publish_failure(error, &op_name);
        let ring = Ring {
            left: &links.left,
            right: &links.right,
            world_size: self.world_size,
            deadline: Instant::now() + self.timeout,
            op: &op_name,
            on_failure: &on_failure,
        };
        let result = run_plan(
            &ring,
            buffer,
            plan,
            op,
            kind(collective, element_code),
            self.sequence,
        );
        if let Err(error) = &result {
            self.failure = Some(error.clone());
        }
        result
    }

    /// Publishes this rank's failure under the abort key unless another rank was first; then
    /// the earlier report is the root cause to return.
    fn publish_failure(&self, error: DistError, op: &str) -> DistError {
        let error = match &error {
            DistError::Peer { rank, what, .. } if what.ends_with(DEADLINE_SUFFIX) => {
                self.find_stalled_rank(*rank, op).unwrap_or(error)
            }
            _ => error,
        };
        let report = format!("rank {} reported: {error}", self.rank);
        let timeout = ABORT_PUBLISH_LIMIT.min(self.timeout);
        match self
            .store
            .compare_set_within(&self.abort_key(), None, report.as_bytes(), timeout)
        {
            Ok(stored) if stored != report.as_bytes() => DistError::Aborted {
                op: op.to_string(),
                report: String::from_utf8_lossy(&stored).into_owned(),
            },
            // Published, or the store is gone (it may have lived in the failed rank): our own view stands.
            _ => error,
        }
    }
}

impl ProcessGroup {
    /// When a rank stalls, every rank waiting on it (directly or around the ring) times out at
    /// about the same moment. Each one that times out reports the neighbour it waited for;
    /// the stalled rank is the one blamed that reported nothing itself.
    fn find_stalled_rank(&self, blamed: usize, op: &str) -> Option<DistError> {
        let base = format!("{}/stalled/{}", self.prefix, self.sequence);
        let limit = ABORT_PUBLISH_LIMIT.min(self.timeout);
        self.store
            .set_within(
                &format!("{base}/{}", self.rank),
                blamed.to_string().as_bytes(),
                limit,
            )
            .ok()?;
        std::thread::sleep(STALL_REPORT_GRACE.min(self.timeout / 4));
        let mut reports = Vec::with_capacity(self.world_size);
        for rank in 0..self.world_size {
            let report = self
                .store
                .get_within(&format!("{base}/{rank}"), limit)
                .ok()?;
            reports.push(
                report.and_then(|bytes| String::from_utf8_lossy(&bytes).parse::<usize>().ok()),
            );
        }
        let mut silent: Vec<usize> = reports
            .iter()
            .flatten()
            .copied()
            .filter(|&rank| reports.get(rank).is_some_and(Option::is_none))
            .collect();
        silent.sort_unstable();
        silent.dedup();
        let [stalled] = silent[..] else { return None };
        if stalled == blamed {
            return None;
        }
        let addr = self
            .store
            .get_within(&self.addr_key(stalled), limit)
            .ok()
            .flatten()
            .unwrap_or_default();
        Some(DistError::Peer {
            rank: stalled,
            addr: String::from_utf8_lossy(&addr).into_owned(),
            what: "stalled: the ranks waiting on it timed out".into(),
            op: op.to_string(),
        })
    }
}

/// `host:port`, with brackets around IPv6 addresses.
fn join_host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ClusterSource, WorkerEnv};

    #[test]
    fn options_from_a_worker_environment() {
        let token = JobToken::new("t").expect("token");
        let mut worker = WorkerEnv {
            source: ClusterSource::OpenMpi,
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: Some("head".into()),
            master_port: None,
        };
        let options = ProcessGroupOptions::from_worker_env(&worker, Some(29500), token.clone())
            .expect("port from the default");
        assert_eq!(
            (options.rank, options.world_size, options.master_port),
            (3, 4, 29500)
        );
        assert_eq!(options.master_addr, "head");
        let error = ProcessGroupOptions::from_worker_env(&worker, None, token.clone())
            .expect_err("no port");
        assert_eq!(
            error.to_string(),
            "openmpi environment: MASTER_PORT=\"\": is not set, and the workers need the store's address"
        );
        worker.master_addr = None;
        let error =
            ProcessGroupOptions::from_worker_env(&worker, Some(1), token).expect_err("no host");
        assert!(error
            .to_string()
            .starts_with("openmpi environment: MASTER_ADDR=\"\""));
    }

    #[test]
    fn ipv6_hosts_get_brackets() {
        assert_eq!(join_host_port("::1", 80), "[::1]:80");
        assert_eq!(join_host_port("10.0.0.2", 80), "10.0.0.2:80");
        assert_eq!(join_host_port("node01", 80), "node01:80");
    }
}
