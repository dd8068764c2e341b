//! The store's gate: it accepts connections and runs every handshake on one thread, waiting
//! for readiness with `poll(2)`, so that outsiders cost no thread and a bounded number of
//! descriptors. Only a connection that proves the job token leaves the gate.
//!
//! Connections in the handshake are capped in total and per peer address: beyond a cap, the
//! oldest pending connection (of that address first) is closed at once. A new connection is
//! closed at once, before any byte is sent, when it would exceed the authenticated clients or
//! the descriptors the store may use. An admitted one has one deadline for the whole
//! handshake, however slowly it trickles its bytes.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::limits::StoreLimits;
use crate::auth::{AcceptorChallenge, JobToken, Purpose, CONNECTOR_REPLY_LEN, REFUSAL};
use crate::error::{DistError, Result};

/// How long the gate stops accepting after the process ran out of descriptors (the waiting
/// connections stay in the kernel's backlog meanwhile).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Descriptors an authenticated client holds: its stream.
const DESCRIPTORS_PER_CLIENT: usize = 1;

/// A connection that passed the handshake. Its `answer` (the acceptance and this end's proof)
/// is still to be sent, before `deadline`.
pub(super) struct Passed {
    /// The connection, in blocking mode.
    pub stream: TcpStream,
    /// The bytes that complete the handshake.
    pub answer: Vec<u8>,
    /// The handshake's deadline.
    pub deadline: Instant,
}

/// A connection in the handshake: the hello is sent, the reply is arriving.
struct Pending {
    stream: TcpStream,
    peer: IpAddr,
    deadline: Instant,
    challenge: AcceptorChallenge,
    reply: [u8; CONNECTOR_REPLY_LEN],
    received: usize,
}

/// What reading from a pending connection came to.
enum Progress {
    Waiting,
    Complete,
    Closed,
}

/// The listener and the handshakes in progress.
pub(super) struct Gate {
    listener: TcpListener,
    token: JobToken,
    limits: StoreLimits,
    max_descriptors: usize,
    pending: Vec<Pending>,
    accept_paused_until: Option<Instant>,
}

impl Gate {
    /// Binds `addr` for clients that know `token`; the descriptor budget is read now.
    pub(super) fn bind(addr: SocketAddr, token: JobToken, limits: StoreLimits) -> Result<Gate> {
        let listener = TcpListener::bind(addr)
            .map_err(|error| DistError::io(format!("bind the store on {addr}"), &error))?;
        listener
            .set_nonblocking(true)
            .map_err(|error| DistError::io("make the store listener non-blocking", &error))?;
        Ok(Gate {
            listener,
            token,
            max_descriptors: limits.descriptor_budget(),
            limits,
            pending: Vec::new(),
            accept_paused_until: None,
        })
    }

    /// The address the gate listens on.
    pub(super) fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|error| DistError::io("read the store's local address", &error))
    }

    /// Waits at most `slice` for connections and handshake bytes, and returns the
    /// connections that passed. `clients` is the number of authenticated clients now.
    pub(super) fn turn(&mut self, slice: Duration, clients: usize) -> Vec<Passed> {
        let (listener_ready, pending_ready) = self.poll(slice);
        let mut passed = self.advance_handshakes(&pending_ready);
        if listener_ready {
            self.accept_all(clients + passed.len());
        }
        self.drop_expired();
        passed.retain(|passed| passed.stream.set_nonblocking(false).is_ok());
        passed
    }

    /// Waits for readiness of the listener (unless accepting is paused) and of the pending
    /// connections; returns which are ready.
    fn poll(&mut self, slice: Duration) -> (bool, Vec<bool>) {
        let now = Instant::now();
        let accepting = self.accept_paused_until.is_none_or(|until| now >= until);
        if accepting {
            self.accept_paused_until = None;
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(1 + self.pending.len());
        fds.push(libc::pollfd {
            // A negative descriptor is ignored by poll: the listener while accepting pauses.
            fd: if accepting {
                self.listener.as_raw_fd()
            } else {
                -1
            },
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(self.pending.iter().map(|pending| libc::pollfd {
            fd: pending.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        let next_deadline = self.pending.iter().map(|pending| pending.deadline).min();
        let mut wait = slice;
        if let Some(deadline) = next_deadline {
            wait = wait.min(deadline.saturating_duration_since(now));
        }
        if let Some(until) = self.accept_paused_until {
            wait = wait.min(until.saturating_duration_since(now));
        }
        // Rounded up, so a deadline less than a millisecond away is not a busy loop.
        let wait_ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs that outlives the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        if ready <= 0 {
            return (false, vec![false; self.pending.len()]);
        }
        let listener_ready = accepting && fds[0].revents != 0;
        let pending_ready = fds[1..].iter().map(|fd| fd.revents != 0).collect();
        (listener_ready, pending_ready)
    }

    /// Reads what the ready pending connections sent; checks complete replies.
    fn advance_handshakes(&mut self, ready: &[bool]) -> Vec<Passed> {
        let mut passed = Vec::new();
        let mut keep = Vec::with_capacity(self.pending.len());
        for (index, mut pending) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            if !ready.get(index).copied().unwrap_or(false) {
                keep.push(pending);
                continue;
            }
            match read_available(&mut pending) {
                Progress::Waiting => keep.push(pending),
                Progress::Closed => {}
                Progress::Complete => match pending.challenge.verify(&self.token, &pending.reply) {
                    Ok(answer) => passed.push(Passed {
                        stream: pending.stream,
                        answer,
                        deadline: pending.deadline,
                    }),
                    Err(_) => {
                        // Best effort: say why before closing; the reply was read whole, so
                        // the close is orderly and the byte arrives.
                        let _ = pending.stream.write(&REFUSAL);
                    }
                },
            }
        }
        self.pending = keep;
        passed
    }

    /// Accepts every connection waiting in the backlog, admitting or closing each.
    fn accept_all(&mut self, clients: usize) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer.ip(), clients),
                Err(error) if error.kind() == ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): the listener
                    // stays readable, so pause instead of spinning.
                    self.accept_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Starts the handshake of a new connection, or closes it at once when it is over a limit.
    fn admit(&mut self, stream: TcpStream, peer: IpAddr, clients: usize) {
        if !self.make_room_for(peer, clients) {
            return;
        }
        let Ok(challenge) = AcceptorChallenge::new(Purpose::Store) else {
            return;
        };
        let setup = stream
            .set_nonblocking(true)
            .and_then(|()| stream.set_nodelay(true));
        if setup.is_err() {
            return;
        }
        let hello = challenge.hello();
        // A fresh socket's send buffer takes the short hello whole; anything less means the
        // connection is already broken.
        if !matches!((&stream).write(&hello), Ok(written) if written == hello.len()) {
            return;
        }
        self.pending.push(Pending {
            stream,
            peer,
            deadline: Instant::now() + self.limits.handshake_deadline,
            challenge,
            reply: [0; CONNECTOR_REPLY_LEN],
            received: 0,
        });
    }

    /// Makes room for one more connection from `peer`, or says there is none. Over the
    /// handshake caps, the oldest pending connection of `peer` (else the oldest of all) is
    /// closed: a flood then pushes out its own idle connections, while a client that answers
    /// at once gets through. Every pending connection counts as a future client, so that
    /// passing the handshake always finds room under the client and descriptor caps.
    fn make_room_for(&mut self, peer: IpAddr, clients: usize) -> bool {
        let from_peer = self
            .pending
            .iter()
            .filter(|pending| pending.peer == peer)
            .count();
        let oldest = if from_peer >= self.limits.max_pending_per_address {
            self.pending.iter().position(|pending| pending.peer == peer)
        } else if self.pending.len() >= self.limits.max_pending {
            (!self.pending.is_empty()).then_some(0)
        } else {
            None
        };
        let over_a_cap = from_peer >= self.limits.max_pending_per_address
            || self.pending.len() >= self.limits.max_pending;
        match oldest {
            Some(index) => drop(self.pending.remove(index)),
            None if over_a_cap => return false,
            None => {}
        }
        let future_clients = clients + self.pending.len() + 1;
        future_clients <= self.limits.max_clients
            && future_clients * DESCRIPTORS_PER_CLIENT <= self.max_descriptors
    }

    /// Closes the connections whose handshake deadline has passed.
    fn drop_expired(&mut self) {
        let now = Instant::now();
        self.pending.retain(|pending| pending.deadline > now);
    }
}

/// Reads the bytes of the reply that have arrived, without blocking.
fn read_available(pending: &mut Pending) -> Progress {
    loop {
        let Some(rest) = pending.reply.get_mut(pending.received..) else {
            return Progress::Closed;
        };
        if rest.is_empty() {
            return Progress::Complete;
        }
        match (&pending.stream).read(rest) {
            Ok(0) => return Progress::Closed,
            Ok(read) => pending.received += read,
            Err(error) if error.kind() == ErrorKind::WouldBlock => return Progress::Waiting,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Progress::Closed,
        }
    }
}
