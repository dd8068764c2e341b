//! A store replicated on several hosts with Raft (the `raft` crate), so that the job's store
//! outlives any one of them.
//!
//! Each replica serves the store's protocol on its own address. Only the leader answers:
//! a write is applied once a majority has it in its log, and a read waits for a majority to
//! confirm the leader (Raft's read index), so a leader cut off in a minority answers
//! nothing. Other replicas answer `NotLeader`, naming the leader when they know it, and a
//! client given every replica's address moves to it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::eraftpb::{Entry, EntryType, HardState, Message, MessageType, Snapshot};
use raft::{Config, RawNode, ReadState, StateRole};

use super::ballot::Ballot;
use super::keyspace::Keyspace;
use super::limits::StoreLimits;
use super::log::ReplicaLog;
use super::peers::{is_cut, Peers};
use super::protocol::{Request, Response};
use super::server::{Answer, StoreServer};
use crate::auth::JobToken;
use crate::error::{DistError, Result};

/// One Raft tick.
const TICK: Duration = Duration::from_millis(50);
/// Ticks without a leader's word before a follower stands for election (randomized up to
/// twice this): 0.4 to 0.8 s, well under the default heartbeat timeout of 1 s.
const ELECTION_TICKS: usize = 8;
/// Ticks between the leader's heartbeats.
const HEARTBEAT_TICKS: usize = 2;
/// How long a replica waits for a write or a read to be confirmed by a majority (one round
/// trip to the others when it leads).
const CONFIRM_TIMEOUT: Duration = Duration::from_millis(400);
/// Entries kept in the log before it is compacted into a keyspace image.
const COMPACT_AFTER: usize = 4096;

/// One replica of a replicated store. Dropping it stops it: its clients and peers see it
/// gone, as if its host had died.
pub struct StoreReplica {
    server: StoreServer,
    core: Arc<Core>,
    token: JobToken,
    raft_thread: Option<JoinHandle<()>>,
}

/// How a replica starts.
#[derive(Debug, Clone, Default)]
pub struct ReplicaStart {
    /// The file that keeps the replica's last term and vote across a restart of its agent;
    /// none: they are kept in memory only.
    pub ballot: Option<PathBuf>,
    /// Whether the store was under way before this replica started (its host started
    /// again). It then holds none of the entries it may have acknowledged before, so it
    /// grants no vote and stands for no election until it has caught up with a leader: a
    /// write that it helped to commit is never lost for it.
    pub behind: bool,
}

/// What the client threads share with the Raft thread.
struct Core {
    keyspace: Keyspace,
    inbox: Mutex<Option<Sender<Event>>>,
    view: Mutex<View>,
    /// The peers whose links a test cut.
    cut: Arc<Mutex<HashSet<u64>>>,
}

/// What the Raft thread last said about the replica's role.
#[derive(Clone, Default)]
struct View {
    is_leader: bool,
    leader_addr: Option<SocketAddr>,
}

/// Work for the Raft thread.
enum Event {
    Message(Box<Message>),
    Propose {
        request: Request,
        reply: SyncSender<Response>,
    },
    Read {
        reply: SyncSender<()>,
    },
    Stop,
}

impl StoreReplica {
    /// Binds `addr` (port 0 picks a free port) for clients and peers that know `token`. It
    /// answers `NotLeader` until [`start`](Self::start).
    pub fn bind(addr: SocketAddr, token: JobToken, limits: StoreLimits) -> Result<StoreReplica> {
        let core = Arc::new(Core {
            keyspace: Keyspace::new(),
            inbox: Mutex::new(None),
            view: Mutex::new(View::default()),
            cut: Arc::new(Mutex::new(HashSet::new())),
        });
        let answerer: Arc<dyn Answer> = core.clone();
        let server = StoreServer::serve(addr, token.clone(), limits, answerer)?;
        Ok(StoreReplica {
            server,
            core,
            token,
            raft_thread: None,
        })
    }

    /// The address clients and peers reach this replica at.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// Joins the replicas at `replicas` (every replica's address, this one's included, in
    /// the same order on every host) of a new store; this one is at `index`.
    pub fn start(&mut self, replicas: &[SocketAddr], index: usize) -> Result<()> {
        self.start_with(replicas, index, &ReplicaStart::default())
    }

    /// [`start`](Self::start), as `how` says.
    pub fn start_with(
        &mut self,
        replicas: &[SocketAddr],
        index: usize,
        how: &ReplicaStart,
    ) -> Result<()> {
        if index >= replicas.len() || self.raft_thread.is_some() {
            return Err(DistError::InvalidArgument(format!(
                "replica {index} of {} cannot start (already started, or no such replica)",
                replicas.len()
            )));
        }
        let voters: Vec<u64> = (1..=replicas.len() as u64).collect();
        let id = index as u64 + 1;
        let mut log = ReplicaLog::new(voters);
        let ballot = how.ballot.as_deref().map(Ballot::open).transpose()?;
        if let Some(ballot) = &ballot {
            let mut hard_state = HardState::default();
            (hard_state.term, hard_state.vote) = (ballot.term(), ballot.vote());
            log.set_hard_state(hard_state);
        }
        let node = new_node(id, log)?;
        let peers: Vec<(u64, SocketAddr)> = (1u64..)
            .zip(replicas.iter().copied())
            .filter(|(peer, _)| *peer != id)
            .collect();
        let links = Peers::start(&peers, &self.token, Arc::clone(&self.core.cut));
        let (sender, inbox) = mpsc::channel();
        *lock(&self.core.inbox) = Some(sender);
        let core = Arc::clone(&self.core);
        let addrs = replicas.to_vec();
        let catch_up = how.behind.then_some(CatchUp {
            leader_commit: None,
        });
        let handle = thread::Builder::new()
            .name(format!("store-raft-{id}"))
            .spawn(move || {
                let mut raft = RaftLoop::new(node, core, links, addrs);
                (raft.ballot, raft.catch_up) = (ballot, catch_up);
                raft.run(&inbox);
            })
            .map_err(|error| DistError::io("spawn the store's Raft thread", &error))?;
        self.raft_thread = Some(handle);
        Ok(())
    }

    /// Whether this replica leads the store now.
    pub fn is_leader(&self) -> bool {
        lock(&self.core.view).is_leader
    }

    /// Cuts (or, with an empty list, restores) this replica's links to the replicas at
    /// `indices`, in both directions, as a network partition would.
    #[doc(hidden)]
    pub fn cut_links_to(&self, indices: &[usize]) {
        *lock(&self.core.cut) = indices.iter().map(|index| *index as u64 + 1).collect();
    }
}

impl Drop for StoreReplica {
    fn drop(&mut self) {
        if let Some(inbox) = lock(&self.core.inbox).take() {
            let _ = inbox.send(Event::Stop);
        }
        if let Some(handle) = self.raft_thread.take() {
            let _ = handle.join();
        }
    }
}

fn new_node(id: u64, log: ReplicaLog) -> Result<RawNode<ReplicaLog>> {
    let config = Config {
        id,
        election_tick: ELECTION_TICKS,
        heartbeat_tick: HEARTBEAT_TICKS,
        check_quorum: true,
        pre_vote: true,
        max_size_per_msg: 1 << 20,
        max_inflight_msgs: 256,
        ..Default::default()
    };
    let logger = slog::Logger::root(slog::Discard, slog::o!());
    RawNode::new(&config, log, &logger)
        .map_err(|error| DistError::InvalidArgument(format!("the store's Raft node: {error}")))
}

impl Answer for Core {
    fn answer(&self, request: Request) -> Option<Response> {
        if let Request::Raft { message } = request {
            self.take_message(&message);
            return None;
        }
        let leader = lock(&self.view).clone();
        if !leader.is_leader {
            return Some(not_leader(&leader));
        }
        let answer = match Keyspace::is_write(&request) {
            true => self.confirmed(|reply| Event::Propose { request, reply }),
            false => self
                .confirmed(|reply| Event::Read { reply })
                .map(|()| self.keyspace.answer(request)),
        };
        Some(answer.unwrap_or_else(|not_leader| not_leader))
    }

    fn stop(&self) {
        self.keyspace.stop();
        if let Some(inbox) = lock(&self.inbox).take() {
            let _ = inbox.send(Event::Stop);
        }
    }
}

impl Core {
    fn take_message(&self, bytes: &[u8]) {
        let Ok(message) = Message::parse_from_bytes(bytes) else {
            return;
        };
        if is_cut(&self.cut, message.from) {
            return;
        }
        if let Some(inbox) = lock(&self.inbox).as_ref() {
            let _ = inbox.send(Event::Message(Box::new(message)));
        }
    }

    /// Hands an event to the Raft thread and waits for its answer; `NotLeader`, as the
    /// error, when no majority confirms it in time.
    fn confirmed<T>(
        &self,
        event: impl FnOnce(SyncSender<T>) -> Event,
    ) -> std::result::Result<T, Response> {
        let (reply, answer) = mpsc::sync_channel(1);
        let sent = lock(&self.inbox)
            .as_ref()
            .is_some_and(|inbox| inbox.send(event(reply)).is_ok());
        let unconfirmed = || not_leader(&lock(&self.view));
        if !sent {
            return Err(unconfirmed());
        }
        answer
            .recv_timeout(CONFIRM_TIMEOUT)
            .map_err(|_| unconfirmed())
    }
}

fn not_leader(view: &View) -> Response {
    let leader = match view.is_leader {
        true => None,
        false => view.leader_addr.map(|addr| addr.to_string()),
    };
    Response::NotLeader { leader }
}

/// A replica started behind a store under way, until it has caught up with a leader.
struct CatchUp {
    /// The commit index of the first leader's message it received.
    leader_commit: Option<u64>,
}

/// The Raft thread's state: the node, the requests waiting for it, and the links.
struct RaftLoop {
    node: RawNode<ReplicaLog>,
    /// Where the term and vote are kept, if anywhere but memory.
    ballot: Option<Ballot>,
    /// While it is catching up: it votes for nobody and stands for no election.
    catch_up: Option<CatchUp>,
    core: Arc<Core>,
    peers: Peers,
    addrs: Vec<SocketAddr>,
    /// Writes proposed here, by proposal number, waiting to be applied.
    proposals: HashMap<u64, SyncSender<Response>>,
    /// Reads waiting for the leader's confirmation, by read number.
    reads: HashMap<u64, SyncSender<()>>,
    /// Confirmed reads waiting for the keyspace to reach their index.
    confirmed_reads: Vec<(u64, SyncSender<()>)>,
    next_number: u64,
    applied: u64,
}

impl RaftLoop {
    fn new(
        node: RawNode<ReplicaLog>,
        core: Arc<Core>,
        peers: Peers,
        addrs: Vec<SocketAddr>,
    ) -> RaftLoop {
        RaftLoop {
            node,
            ballot: None,
            catch_up: None,
            core,
            peers,
            addrs,
            proposals: HashMap::new(),
            reads: HashMap::new(),
            confirmed_reads: Vec::new(),
            next_number: 0,
            applied: 0,
        }
    }

    fn run(mut self, inbox: &Receiver<Event>) {
        let mut last_tick = Instant::now();
        loop {
            let until_tick = TICK.saturating_sub(last_tick.elapsed());
            match inbox.recv_timeout(until_tick) {
                Ok(Event::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(event) => self.take(event),
                Err(RecvTimeoutError::Timeout) => {}
            }
            if last_tick.elapsed() >= TICK {
                // Without ticks a follower never stands for election.
                if self.catch_up.is_none() {
                    self.node.tick();
                }
                last_tick = Instant::now();
            }
            if let Err(error) = self.handle_ready() {
                // Silent, the replica is as if its host had died: the others go on.
                eprintln!(
                    "tandem: the store's replica {} stops: {error}",
                    self.node.raft.id
                );
                return;
            }
            self.see_whether_caught_up();
            self.publish_view();
        }
    }

    /// While catching up: notes the commit index of the first message from a leader, and
    /// whether `message` asks for a vote, which is then refused.
    fn catching_up_refuses(&mut self, message: &Message) -> bool {
        let Some(catch_up) = &mut self.catch_up else {
            return false;
        };
        let leader_commit = match message.get_msg_type() {
            MessageType::MsgAppend | MessageType::MsgHeartbeat => message.commit,
            MessageType::MsgSnapshot => message.get_snapshot().get_metadata().index,
            MessageType::MsgRequestVote | MessageType::MsgRequestPreVote => return true,
            _ => return false,
        };
        catch_up.leader_commit.get_or_insert(leader_commit);
        false
    }

    /// Ends the catching up once this replica's log is committed up to the first leader's
    /// commit index, and up to an entry of the current term: every write committed before
    /// this replica started is then in its log, whichever leader committed it.
    fn see_whether_caught_up(&mut self) {
        let Some(leader_commit) = self.catch_up.as_ref().and_then(|c| c.leader_commit) else {
            return;
        };
        let raft = &self.node.raft;
        let committed = raft.raft_log.committed;
        let of_this_term = raft.raft_log.term(committed).ok() == Some(raft.term);
        if committed >= leader_commit && of_this_term {
            self.catch_up = None;
        }
    }

    /// Bounds a leader's heartbeat's commit index by this replica's log. A replica started
    /// again (its host restarted) holds no log, while the leader remembers what it held
    /// before: the commit would reach past its log, which Raft takes for a broken
    /// invariant. Bounded, the replica answers, is found behind, and catches up.
    fn bound_heartbeat_commit(&self, message: &mut Message) {
        if message.get_msg_type() == MessageType::MsgHeartbeat {
            let last = self.node.raft.raft_log.last_index();
            message.commit = message.commit.min(last);
        }
    }

    fn take(&mut self, event: Event) {
        match event {
            Event::Message(mut message) => {
                if self.catching_up_refuses(&message) {
                    return;
                }
                self.bound_heartbeat_commit(&mut message);
                let _ = self.node.step(*message);
            }
            Event::Propose { request, reply } => {
                let number = self.number();
                let context = self.context(number);
                if self.node.propose(context, request.encode()).is_ok() {
                    self.proposals.insert(number, reply);
                }
            }
            Event::Read { reply } => {
                let number = self.number();
                self.node.read_index(self.context(number));
                self.reads.insert(number, reply);
            }
            Event::Stop => {}
        }
    }

    fn number(&mut self) -> u64 {
        self.next_number += 1;
        self.next_number
    }

    /// A proposal's context: this replica's id and the proposal's number.
    fn context(&self, number: u64) -> Vec<u8> {
        let mut context = self.node.raft.id.to_le_bytes().to_vec();
        context.extend_from_slice(&number.to_le_bytes());
        context
    }

    /// The number of a proposal or read made here, from its context.
    fn own_number(&self, context: &[u8]) -> Option<u64> {
        let (id, number) = context.split_at_checked(8)?;
        let id = u64::from_le_bytes(id.try_into().ok()?);
        let number = u64::from_le_bytes(number.try_into().ok()?);
        (id == self.node.raft.id).then_some(number)
    }

    /// Handles what Raft made ready; fails when the term and vote cannot be recorded.
    fn handle_ready(&mut self) -> Result<()> {
        if !self.node.has_ready() {
            return Ok(());
        }
        let mut ready = self.node.ready();
        self.send(ready.take_messages());
        if !ready.snapshot().is_empty() {
            self.install(ready.snapshot().clone());
        }
        self.apply(ready.take_committed_entries());
        self.node.mut_store().append(ready.entries());
        if let Some(hard_state) = ready.hs() {
            if let Some(ballot) = &mut self.ballot {
                ballot.record(hard_state.term, hard_state.vote)?;
            }
            self.node.mut_store().set_hard_state(hard_state.clone());
        }
        self.confirm_reads(ready.take_read_states());
        self.send(ready.take_persisted_messages());
        let mut light = self.node.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.node.mut_store().set_commit(commit);
        }
        self.send(light.take_messages());
        self.apply(light.take_committed_entries());
        self.node.advance_apply();
        self.release_reads();
        self.compact();
        Ok(())
    }

    fn send(&self, messages: Vec<Message>) {
        for message in messages {
            if let Ok(bytes) = message.write_to_bytes() {
                self.peers.send(message.to, bytes);
            }
        }
    }

    fn install(&mut self, snapshot: Snapshot) {
        if self.core.keyspace.restore(snapshot.get_data()).is_ok() {
            self.applied = snapshot.get_metadata().index;
            self.node.mut_store().install(snapshot);
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) {
        for entry in entries {
            self.applied = entry.index;
            if entry.get_entry_type() != EntryType::EntryNormal || entry.data.is_empty() {
                continue;
            }
            let answer = match Request::decode(&entry.data) {
                Ok(request) => self.core.keyspace.answer(request),
                Err(message) => Response::Error(format!("malformed log entry: {message}")),
            };
            if let Some(reply) = self
                .own_number(&entry.context)
                .and_then(|number| self.proposals.remove(&number))
            {
                let _ = reply.try_send(answer);
            }
        }
    }

    fn confirm_reads(&mut self, states: Vec<ReadState>) {
        for state in states {
            if let Some(reply) = self
                .own_number(&state.request_ctx)
                .and_then(|number| self.reads.remove(&number))
            {
                self.confirmed_reads.push((state.index, reply));
            }
        }
    }

    /// Answers the confirmed reads whose index the keyspace has reached.
    fn release_reads(&mut self) {
        let applied = self.applied;
        self.confirmed_reads.retain(|(index, reply)| {
            let ready = *index <= applied;
            if ready {
                let _ = reply.try_send(());
            }
            !ready
        });
    }

    fn compact(&mut self) {
        if self.node.store().len() > COMPACT_AFTER {
            let image = self.core.keyspace.encode();
            let applied = self.applied;
            self.node.mut_store().compact(applied, image);
        }
    }

    /// Tells the client threads whether this replica leads; on losing the lead, drops the
    /// requests waiting here, whose clients then retry elsewhere.
    fn publish_view(&mut self) {
        let is_leader = self.node.raft.state == StateRole::Leader;
        let leader = self.node.raft.leader_id;
        let leader_addr = (leader > 0)
            .then(|| self.addrs.get(leader as usize - 1).copied())
            .flatten();
        if !is_leader {
            self.proposals.clear();
            self.reads.clear();
            self.confirmed_reads.clear();
        }
        *lock(&self.core.view) = View {
            is_leader,
            leader_addr,
        };
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // No thread panics while holding the lock, but recover the data if one did.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
