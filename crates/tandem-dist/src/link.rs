//! A ring link: an authenticated connection (TCP, or a Unix socket on one host) to one
//! neighbouring rank, carrying messages that each start with a header the receiver checks
//! against what it expects.
//!
//! ```text
//! hello   (connector -> acceptor, once, after the token handshake)
//!         = u64 rank, u64 world size, u64 membership epoch
//! message = u64 collective number, u32 kind, u32 membership epoch, u64 byte length, the bytes
//! ```
//! The receiver always knows how many bytes to expect, so it never allocates from a length it
//! reads; a header that disagrees fails the collective with an error naming the sender.
//!
//! The membership epoch fences off stale members (`--keep-survivors`): a worker dropped from
//! the job, for instance stopped and continued later, may still hold a connection or try a
//! new one. A hello of another epoch is not admitted, and a message of another epoch fails
//! the collective, so such a worker's data never reaches a step.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::auth::{
    accept_handshake, connect_handshake, is_closed, ConnectError, JobToken, Purpose,
};
use crate::error::{DistError, Result};
use crate::store::remaining;
use crate::transport::{connect_local, DeadlineStream, PeerListeners, PeerStream};

const HEADER_BYTES: usize = 24;
const HELLO_BYTES: usize = 24;
/// The longest one incoming handshake may take, however slowly its bytes trickle.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);
const RETRY_PAUSE: Duration = Duration::from_millis(20);
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// The most handshakes an accepting rank runs at once.
const MAX_HANDSHAKES: usize = 32;

/// The handshakes in progress of one accept, by number, each with a handle that closes its
/// connection.
#[derive(Default)]
struct Handshakes {
    next_id: u64,
    open: std::collections::VecDeque<(u64, PeerStream)>,
}

impl Handshakes {
    /// Numbers a new handshake, closing the oldest when [`MAX_HANDSHAKES`] are open.
    fn open(&mut self, handle: PeerStream) -> u64 {
        if self.open.len() >= MAX_HANDSHAKES {
            if let Some((_, oldest)) = self.open.pop_front() {
                oldest.shutdown();
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.open.push_back((id, handle));
        id
    }

    /// Marks handshake `id` finished; whether it was still open (not closed as the oldest).
    fn finish(&mut self, id: u64) -> bool {
        let before = self.open.len();
        self.open.retain(|(open, _)| *open != id);
        self.open.len() != before
    }

    /// Closes every open handshake (their threads then end at once).
    fn close_all(&mut self) {
        for (_, handle) in self.open.drain(..) {
            handle.shutdown();
        }
    }
}

/// The header of one message: which collective, which kind, how many bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// The collective's number in this group, counted the same on every rank.
    pub sequence: u64,
    /// The collective and element type, see [`kind_name`].
    pub kind: u32,
    /// The payload's length.
    pub bytes: u64,
}

impl Header {
    /// The header's bytes, sent by a member of membership `epoch`.
    fn encode(&self, epoch: u32) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[..8].copy_from_slice(&self.sequence.to_le_bytes());
        out[8..12].copy_from_slice(&self.kind.to_le_bytes());
        out[12..16].copy_from_slice(&epoch.to_le_bytes());
        out[16..].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    /// The header and the sender's membership epoch.
    fn decode(bytes: &[u8; HEADER_BYTES]) -> (Header, u32) {
        let mut sequence = [0u8; 8];
        let mut kind = [0u8; 4];
        let mut epoch = [0u8; 4];
        let mut length = [0u8; 8];
        sequence.copy_from_slice(&bytes[..8]);
        kind.copy_from_slice(&bytes[8..12]);
        epoch.copy_from_slice(&bytes[12..16]);
        length.copy_from_slice(&bytes[16..]);
        let header = Header {
            sequence: u64::from_le_bytes(sequence),
            kind: u32::from_le_bytes(kind),
            bytes: u64::from_le_bytes(length),
        };
        (header, u32::from_le_bytes(epoch))
    }
}

/// The collectives, as the high byte of a header's kind.
pub(crate) mod collective {
    pub const ALL_REDUCE: u32 = 1;
    pub const BROADCAST: u32 = 2;
    pub const ALL_GATHER: u32 = 3;
    pub const REDUCE_SCATTER: u32 = 4;
    pub const BARRIER: u32 = 5;
}

/// The name of a collective as used in errors, e.g. "all_reduce".
pub(crate) fn collective_name(collective: u32) -> &'static str {
    match collective {
        collective::ALL_REDUCE => "all_reduce",
        collective::BROADCAST => "broadcast",
        collective::ALL_GATHER => "all_gather",
        collective::REDUCE_SCATTER => "reduce_scatter",
        collective::BARRIER => "barrier",
        _ => "unknown collective",
    }
}

fn kind_name(kind: u32) -> String {
    let element = match kind & 0xff {
        1 => "f32",
        2 => "f64",
        3 => "i64",
        _ => "bytes",
    };
    format!("{} of {element}", collective_name(kind >> 8))
}

/// A connection to a neighbour, named by its rank and advertised address in every error.
pub(crate) struct PeerLink {
    rank: usize,
    addr: String,
    stream: PeerStream,
    /// The membership epoch of the group, carried by every message.
    epoch: u32,
}

impl PeerLink {
    /// Connects to rank `peer_rank`: over its Unix socket when `local_endpoint` is reachable,
    /// else over TCP at `addr` (`host:port`), retrying until `deadline` while it is not
    /// listening yet; then proves the token and introduces this rank: `me` is its rank, the
    /// world size and the membership epoch.
    pub(crate) fn connect(
        me: (usize, usize, u64),
        peer_rank: usize,
        addr: &str,
        local_endpoint: Option<&str>,
        token: &JobToken,
        deadline: Instant,
    ) -> Result<PeerLink> {
        let failure = |what: String| DistError::Peer {
            rank: peer_rank,
            addr: addr.to_string(),
            what,
            op: "rendezvous".into(),
        };
        let stream = match local_endpoint.and_then(connect_local) {
            Some(stream) => stream,
            None => connect_tcp(addr, deadline).map_err(&failure)?,
        };
        let left = remaining(deadline)
            .ok_or_else(|| failure("could not be reached before the rendezvous deadline".into()))?;
        stream
            .configure(Some(left))
            .map_err(|error| failure(error.to_string()))?;
        match connect_handshake(&stream, token, Purpose::Peer) {
            Ok(()) => {}
            Err(ConnectError::Refused) => {
                return Err(failure("refused this rank's job token".into()))
            }
            Err(ConnectError::NotTrusted(message)) => {
                return Err(failure(format!("is not trusted: {message}")))
            }
            Err(ConnectError::Io(error)) => {
                return Err(failure(format!("failed the handshake: {error}")))
            }
        }
        let (my_rank, world_size, epoch) = me;
        let mut hello = [0u8; HELLO_BYTES];
        hello[..8].copy_from_slice(&(my_rank as u64).to_le_bytes());
        hello[8..16].copy_from_slice(&(world_size as u64).to_le_bytes());
        hello[16..].copy_from_slice(&epoch.to_le_bytes());
        (&stream)
            .write_all(&hello)
            .map_err(|error| failure(format!("failed the handshake: {error}")))?;
        Ok(PeerLink {
            rank: peer_rank,
            addr: addr.to_string(),
            stream,
            epoch: epoch as u32,
        })
    }

    /// Accepts connections until one proves the token and introduces itself as rank
    /// `peer_rank` of a group of `world_size` in membership `epoch`; strangers and stale
    /// members are dropped. Each connection's
    /// handshake runs on a thread of its own with one deadline for the whole handshake, so a
    /// stranger that trickles its bytes delays no peer; at most [`MAX_HANDSHAKES`] run at
    /// once (beyond that the oldest is closed), and once the peer is admitted every other
    /// handshake is closed.
    pub(crate) fn accept(
        listeners: &PeerListeners,
        peer_rank: usize,
        peer_addr: &str,
        (world_size, epoch): (usize, u64),
        token: &JobToken,
        deadline: Instant,
    ) -> Result<PeerLink> {
        let (admitted, results) = mpsc::channel::<(u64, Option<PeerLink>)>();
        let mut handshakes = Handshakes::default();
        loop {
            let Some(left) = remaining(deadline) else {
                handshakes.close_all();
                return Err(DistError::Peer {
                    rank: peer_rank,
                    addr: peer_addr.to_string(),
                    what: "did not connect before the rendezvous deadline".into(),
                    op: "rendezvous".into(),
                });
            };
            // Finished handshakes first, so that a flood of connections neither keeps an
            // admitted peer waiting nor has it closed as the oldest.
            while let Ok((id, link)) = results.try_recv() {
                let live = handshakes.finish(id);
                if let Some(link) = link.filter(|_| live) {
                    handshakes.close_all();
                    return Ok(link);
                }
            }
            if let Some(stream) = listeners.try_accept() {
                let Ok(handle) = stream.try_clone() else {
                    continue;
                };
                let id = handshakes.open(handle);
                let handshake_deadline = Instant::now() + left.min(HANDSHAKE_LIMIT);
                let admitted = admitted.clone();
                let (peer_addr, token) = (peer_addr.to_string(), token.clone());
                thread::spawn(move || {
                    let link = Self::admit(
                        stream,
                        peer_rank,
                        &peer_addr,
                        (world_size, epoch),
                        &token,
                        handshake_deadline,
                    );
                    let _ = admitted.send((id, link));
                });
                continue;
            }
            thread::sleep(ACCEPT_POLL);
        }
    }

    /// Checks one incoming connection within `deadline`; `None` if it is not the expected
    /// rank of this job's membership `epoch`.
    fn admit(
        stream: PeerStream,
        peer_rank: usize,
        peer_addr: &str,
        (world_size, epoch): (usize, u64),
        token: &JobToken,
        deadline: Instant,
    ) -> Option<PeerLink> {
        stream.configure(remaining(deadline)).ok()?;
        let mut bounded = DeadlineStream::new(&stream, deadline);
        accept_handshake(&mut bounded, token, Purpose::Peer).ok()?;
        let mut hello = [0u8; HELLO_BYTES];
        bounded.read_exact(&mut hello).ok()?;
        let word = |at: usize| hello[at..at + 8].try_into().map(u64::from_le_bytes);
        let claimed = (word(0).ok()?, word(8).ok()?, word(16).ok()?);
        (claimed == (peer_rank as u64, world_size as u64, epoch)).then(|| PeerLink {
            rank: peer_rank,
            addr: peer_addr.to_string(),
            stream,
            epoch: epoch as u32,
        })
    }

    /// "tcp" or "unix".
    pub(crate) fn transport(&self) -> &'static str {
        self.stream.kind()
    }

    /// Sends one message, failing if the neighbour does not take it before `deadline`.
    pub(crate) fn send(
        &self,
        header: Header,
        payload: &[u8],
        deadline: Instant,
        op: &str,
    ) -> Result<()> {
        let timeout = remaining(deadline)
            .ok_or_else(|| self.error("did not take data before the deadline", op))?;
        let mut stream = &self.stream;
        let result = self
            .stream
            .set_write_timeout(Some(timeout))
            .and_then(|()| stream.write_all(&header.encode(self.epoch)))
            .and_then(|()| stream.write_all(payload));
        result.map_err(|error| self.io_error(&error, "did not take data before the deadline", op))
    }

    /// Receives one message into `payload`, whose length is the number of bytes expected.
    pub(crate) fn receive(
        &self,
        expected: Header,
        payload: &mut [u8],
        deadline: Instant,
        op: &str,
    ) -> Result<()> {
        const LATE: &str = "sent nothing before the deadline";
        let mut header = [0u8; HEADER_BYTES];
        self.read_exact(&mut header, deadline, op, LATE)?;
        let (header, epoch) = Header::decode(&header);
        if epoch != self.epoch {
            return Err(self.error(
                &format!(
                    "sent a message of membership epoch {epoch} to this group of epoch {}: a \
                     member left out of the job is refused, and must rejoin",
                    self.epoch
                ),
                op,
            ));
        }
        if header.sequence != expected.sequence || header.kind != expected.kind {
            return Err(self.error(
                &format!(
                    "is at collective #{} ({}) while this rank is at #{} ({}): the ranks called different collectives",
                    header.sequence,
                    kind_name(header.kind),
                    expected.sequence,
                    kind_name(expected.kind)
                ),
                op,
            ));
        }
        if header.bytes != expected.bytes {
            return Err(self.error(
                &format!(
                    "sent a message of {} bytes where {} were expected (the ranks disagree on the buffer's length)",
                    header.bytes, expected.bytes
                ),
                op,
            ));
        }
        self.read_exact(payload, deadline, op, LATE)
    }

    fn read_exact(&self, bytes: &mut [u8], deadline: Instant, op: &str, late: &str) -> Result<()> {
        let timeout = remaining(deadline).ok_or_else(|| self.error(late, op))?;
        let mut stream = &self.stream;
        let result = self
            .stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.read_exact(bytes));
        result.map_err(|error| self.io_error(&error, late, op))
    }

    /// Closes both directions, so that blocked threads here and the neighbour fail at once.
    pub(crate) fn shut_down(&self) {
        self.stream.shutdown();
    }

    /// A second handle to the connection, to shut it down from another thread.
    pub(crate) fn shutdown_handle(&self) -> std::io::Result<PeerStream> {
        self.stream.try_clone()
    }

    fn io_error(&self, error: &std::io::Error, late: &str, op: &str) -> DistError {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        if is_closed(error) {
            self.error("closed the connection", op)
        } else if matches!(error.kind(), WouldBlock | TimedOut) {
            self.error(late, op)
        } else {
            self.error(&format!("failed: {error}"), op)
        }
    }

    pub(crate) fn error(&self, what: &str, op: &str) -> DistError {
        DistError::Peer {
            rank: self.rank,
            addr: self.addr.clone(),
            what: what.to_string(),
            op: op.to_string(),
        }
    }

    /// Test access to the raw stream, to play a misbehaving peer.
    #[cfg(test)]
    pub(crate) fn stream(&self) -> &PeerStream {
        &self.stream
    }
}

/// Connects over TCP, retrying until `deadline` while the peer is not listening yet.
fn connect_tcp(addr: &str, deadline: Instant) -> std::result::Result<PeerStream, String> {
    let target = resolve(addr)?;
    loop {
        let left = remaining(deadline)
            .ok_or_else(|| "could not be reached before the rendezvous deadline".to_string())?;
        match TcpStream::connect_timeout(&target, left) {
            Ok(stream) => return Ok(PeerStream::Tcp(stream)),
            Err(_) => thread::sleep(RETRY_PAUSE.min(left)),
        }
    }
}

/// Resolves `host:port` to its first address.
pub(crate) fn resolve(addr: &str) -> std::result::Result<SocketAddr, String> {
    let mut addresses = addr
        .to_socket_addrs()
        .map_err(|error| format!("has an address that does not resolve: {error}"))?;
    addresses
        .next()
        .ok_or_else(|| "has an address that resolves to nothing".to_string())
}

/// The kind code of a collective on an element type.
pub(crate) fn kind(collective: u32, element_code: u32) -> u32 {
    (collective << 8) | element_code
}

/// Writes raw bytes to a link, bypassing the protocol (tests of misbehaving peers).
#[cfg(test)]
pub(crate) fn write_raw(link: &PeerLink, bytes: &[u8]) -> std::io::Result<()> {
    let mut stream = link.stream();
    stream.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Listeners on a loopback port (and a Unix socket when `unix`), and the address to dial
    /// them at.
    fn loopback_listeners(unix: bool) -> (PeerListeners, String) {
        let listeners = PeerListeners::bind("127.0.0.1", unix).expect("bind");
        let addr = format!("127.0.0.1:{}", listeners.port().expect("port"));
        (listeners, addr)
    }

    /// Two links between "rank 0" (this test) and "rank 1", as the ring would build them,
    /// over a Unix socket or over TCP.
    fn linked_pair(unix: bool) -> (PeerLink, PeerLink) {
        let token = &JobToken::new("t").expect("token");
        let (listeners, addr) = loopback_listeners(unix);
        let endpoint = listeners.local_endpoint();
        assert_eq!(endpoint.is_some(), unix, "a Unix socket exactly when asked");
        let deadline = Instant::now() + Duration::from_secs(5);
        std::thread::scope(|scope| {
            let accepted = scope.spawn(|| accept_rank_1(&listeners, token, deadline));
            let connected =
                PeerLink::connect((0, 2, 0), 1, &addr, endpoint.as_deref(), token, deadline)
                    .expect("connect");
            assert_eq!(connected.transport(), if unix { "unix" } else { "tcp" });
            (connected, accepted.join().expect("thread").expect("accept"))
        })
    }

    #[test]
    fn length_of_2_pow_40_is_refused_naming_the_sender() {
        for unix in [false, true] {
            length_of_2_pow_40_is_refused_over(unix);
        }
    }

    fn length_of_2_pow_40_is_refused_over(unix: bool) {
        let (sender, receiver) = linked_pair(unix);
        let expected = Header {
            sequence: 3,
            kind: kind(collective::ALL_REDUCE, 1),
            bytes: 4096,
        };
        let lying = Header {
            bytes: 1 << 40,
            ..expected
        };
        write_raw(&sender, &lying.encode(0)).expect("write");
        let mut payload = vec![0u8; 4096];
        let error = receiver
            .receive(
                expected,
                &mut payload,
                Instant::now() + Duration::from_secs(5),
                "all_reduce #3",
            )
            .expect_err("must refuse");
        assert_eq!(
            error.to_string(),
            "rank 0 (rank-0-addr) sent a message of 1099511627776 bytes where 4096 were expected \
             (the ranks disagree on the buffer's length) during all_reduce #3"
        );
    }

    #[test]
    fn mismatched_collectives_are_named() {
        let (sender, receiver) = linked_pair(true);
        let theirs = Header {
            sequence: 5,
            kind: kind(collective::BROADCAST, 2),
            bytes: 8,
        };
        sender
            .send(
                theirs,
                &[0; 8],
                Instant::now() + Duration::from_secs(5),
                "broadcast #5",
            )
            .expect("send");
        let mine = Header {
            sequence: 5,
            kind: kind(collective::ALL_REDUCE, 1),
            bytes: 8,
        };
        let error = receiver
            .receive(
                mine,
                &mut [0; 8],
                Instant::now() + Duration::from_secs(5),
                "all_reduce #5",
            )
            .expect_err("mismatch");
        assert_eq!(
            error.to_string(),
            "rank 0 (rank-0-addr) is at collective #5 (broadcast of f64) while this rank is at #5 (all_reduce of f32): \
             the ranks called different collectives during all_reduce #5"
        );
    }

    /// A stranger on `addr` that reads the acceptor's hello and then sends one byte every
    /// 400 ms (each within any per-read timeout); returns when it saw its connection closed,
    /// or `None` after `give_up`.
    fn trickle(addr: &str, give_up: Duration) -> Option<Instant> {
        let started = Instant::now();
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_millis(400)))
            .expect("timeout");
        let mut hello = [0u8; 8 + 1 + 16];
        let _ = stream.read_exact(&mut hello);
        while started.elapsed() < give_up {
            if stream.write_all(&[0]).is_err() {
                return Some(Instant::now());
            }
            let mut byte = [0u8; 1];
            match stream.read(&mut byte) {
                Ok(0) => return Some(Instant::now()),
                Err(error)
                    if !matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Some(Instant::now())
                }
                _ => {}
            }
        }
        None
    }

    /// A job token, listeners on a loopback port and the address to dial them at, and the
    /// deadline `limit` from now.
    fn listening(limit: Duration) -> (JobToken, PeerListeners, String, Instant) {
        let token = JobToken::new("right").expect("token");
        let (listeners, addr) = loopback_listeners(false);
        (token, listeners, addr, Instant::now() + limit)
    }

    /// Rank 0 of 2 admitting rank 1 on `listeners`.
    fn accept_rank_1(
        listeners: &PeerListeners,
        token: &JobToken,
        deadline: Instant,
    ) -> Result<PeerLink> {
        PeerLink::accept(listeners, 0, "rank-0-addr", (2, 0), token, deadline)
    }

    #[test]
    fn a_trickling_stranger_delays_no_peer_and_is_closed_once_the_peer_is_in() {
        let (token, listeners, addr, deadline) = listening(Duration::from_secs(20));
        std::thread::scope(|scope| {
            let accepted = scope.spawn(|| accept_rank_1(&listeners, &token, deadline));
            let stranger = scope.spawn(|| trickle(&addr, Duration::from_secs(15)));
            std::thread::sleep(Duration::from_millis(300));
            let started = Instant::now();
            let _peer =
                PeerLink::connect((0, 2, 0), 1, &addr, None, &token, deadline).expect("peer");
            let link = accepted
                .join()
                .expect("thread")
                .expect("the peer is admitted");
            let admitted = started.elapsed();
            assert!(
                admitted < Duration::from_secs(2),
                "the peer waited {admitted:?}"
            );
            assert_eq!(link.rank, 0);
            let closed = stranger
                .join()
                .expect("stranger")
                .expect("the stranger is closed");
            let after = closed.saturating_duration_since(started);
            assert!(
                after < Duration::from_secs(2),
                "the stranger was closed {after:?} after the peer came"
            );
        });
    }

    #[test]
    fn a_trickling_strangers_handshake_ends_by_its_deadline_not_per_read() {
        let (token, listeners, addr, deadline) =
            listening(HANDSHAKE_LIMIT + Duration::from_secs(4));
        std::thread::scope(|scope| {
            let accepted = scope.spawn(|| accept_rank_1(&listeners, &token, deadline));
            let started = Instant::now();
            let closed = trickle(&addr, HANDSHAKE_LIMIT * 3).expect("the stranger is closed");
            let held = closed.saturating_duration_since(started);
            assert!(
                held >= HANDSHAKE_LIMIT - Duration::from_millis(500)
                    && held < HANDSHAKE_LIMIT + Duration::from_secs(2),
                "the stranger held a handshake for {held:?}"
            );
            let error = accepted
                .join()
                .expect("thread")
                .err()
                .expect("no peer came");
            assert!(error
                .to_string()
                .contains("did not connect before the rendezvous deadline"));
        });
    }

    #[test]
    fn wrong_token_and_wrong_rank_are_not_admitted() {
        let (token, listeners, addr, deadline) = listening(Duration::from_millis(1500));
        std::thread::scope(|scope| {
            let accepted = scope.spawn(|| accept_rank_1(&listeners, &token, deadline));
            let wrong = JobToken::new("wrong").expect("token");
            let refused = PeerLink::connect((0, 2, 0), 1, &addr, None, &wrong, deadline)
                .err()
                .expect("refused");
            assert_eq!(
                refused.to_string(),
                format!("rank 1 ({addr}) refused this rank's job token during rendezvous")
            );
            // Right token but claiming to be rank 1 where rank 0 is expected: dropped, so the
            // acceptor times out waiting for the real rank 0.
            let _impostor = PeerLink::connect((1, 2, 0), 1, &addr, None, &token, deadline)
                .expect("handshake passes");
            let error = accepted
                .join()
                .expect("thread")
                .err()
                .expect("no admission");
            assert_eq!(error.to_string(), "rank 0 (rank-0-addr) did not connect before the rendezvous deadline during rendezvous");
        });
    }

    #[test]
    fn a_peer_of_another_membership_epoch_is_not_admitted_and_the_right_one_is() {
        let (token, listeners, addr, deadline) = listening(Duration::from_secs(10));
        std::thread::scope(|scope| {
            let accepted = scope
                .spawn(|| PeerLink::accept(&listeners, 0, "rank-0-addr", (2, 3), &token, deadline));
            // The rank a dropped member had, with the right token, of membership 2.
            let stale = PeerLink::connect((0, 2, 2), 1, &addr, None, &token, deadline)
                .expect("the token handshake passes");
            let mut byte = [0u8; 1];
            let mut stream = stale.stream();
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            assert_eq!(
                stream.read(&mut byte).expect("closed, not timed out"),
                0,
                "the stale member's connection is closed"
            );
            let _member = PeerLink::connect((0, 2, 3), 1, &addr, None, &token, deadline)
                .expect("the member of membership 3 connects");
            let link = accepted.join().expect("thread").expect("admitted");
            assert_eq!(link.epoch, 3);
        });
    }

    #[test]
    fn a_message_of_another_membership_epoch_is_refused_naming_the_sender() {
        let (sender, receiver) = linked_pair(false);
        let header = Header {
            sequence: 9,
            kind: kind(collective::ALL_REDUCE, 1),
            bytes: 8,
        };
        write_raw(&sender, &header.encode(4)).expect("write");
        write_raw(&sender, &[0; 8]).expect("write");
        let error = receiver
            .receive(
                header,
                &mut [0; 8],
                Instant::now() + Duration::from_secs(5),
                "all_reduce #9",
            )
            .expect_err("a stale epoch must be refused");
        assert_eq!(
            error.to_string(),
            "rank 0 (rank-0-addr) sent a message of membership epoch 4 to this group of epoch 0: \
             a member left out of the job is refused, and must rejoin during all_reduce #9"
        );
    }
}
