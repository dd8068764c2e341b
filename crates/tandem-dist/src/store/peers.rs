//! The links from one replica to the others: one thread per peer that connects to the peer's
//! store address, proves the job token, and sends it Raft messages as `Raft` requests.
//! Raft tolerates lost messages, so a message for a peer that cannot be reached, or whose
//! queue is full, is dropped; the link reconnects on its own.

use std::collections::HashSet;
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use super::protocol::{write_frame, Request};
use crate::auth::{connect_handshake, JobToken, Purpose};

/// Messages queued for one peer before new ones are dropped.
const QUEUE: usize = 4096;
/// How long a link waits to connect, and to write one message.
const IO_TIMEOUT: Duration = Duration::from_millis(500);
/// The pause between two attempts to connect.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);

/// The outgoing links of one replica, by Raft id.
pub(crate) struct Peers {
    links: Vec<(u64, SyncSender<Vec<u8>>)>,
    cut: Arc<Mutex<HashSet<u64>>>,
}

impl Peers {
    /// Starts a link to each of `peers` (Raft id and store address).
    pub(crate) fn start(
        peers: &[(u64, SocketAddr)],
        token: &JobToken,
        cut: Arc<Mutex<HashSet<u64>>>,
    ) -> Peers {
        let mut links = Vec::new();
        for &(id, addr) in peers {
            let (sender, receiver) = mpsc::sync_channel(QUEUE);
            let token = token.clone();
            let started = thread::Builder::new()
                .name(format!("store-peer-{id}"))
                .spawn(move || run_link(addr, &token, &receiver));
            if started.is_ok() {
                links.push((id, sender));
            }
        }
        Peers { links, cut }
    }

    /// Queues `message` (encoded) for peer `to`; drops it when the queue is full or the link
    /// to that peer is cut.
    pub(crate) fn send(&self, to: u64, message: Vec<u8>) {
        if is_cut(&self.cut, to) {
            return;
        }
        if let Some((_, sender)) = self.links.iter().find(|(id, _)| *id == to) {
            match sender.try_send(message) {
                Ok(()) | Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {}
            }
        }
    }
}

/// Whether the links to and from peer `id` are cut (a test's partition).
pub(crate) fn is_cut(cut: &Mutex<HashSet<u64>>, id: u64) -> bool {
    cut.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .contains(&id)
}

/// Sends the queued messages to `addr` until the queue's sender is dropped.
fn run_link(addr: SocketAddr, token: &JobToken, queue: &Receiver<Vec<u8>>) {
    let mut stream: Option<TcpStream> = None;
    loop {
        let message = match queue.recv_timeout(Duration::from_secs(1)) {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if stream.is_none() {
            stream = connect(addr, token);
            if stream.is_none() {
                thread::sleep(RECONNECT_PAUSE);
                continue;
            }
        }
        let frame = Request::Raft { message }.encode();
        if let Some(open) = stream.as_mut() {
            if write_frame(open, &frame).is_err() {
                stream = None;
            }
        }
    }
}

fn connect(addr: SocketAddr, token: &JobToken) -> Option<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT).ok()?;
    stream.set_nodelay(true).ok()?;
    stream.set_read_timeout(Some(IO_TIMEOUT)).ok()?;
    stream.set_write_timeout(Some(IO_TIMEOUT)).ok()?;
    connect_handshake(&mut stream, token, Purpose::Store).ok()?;
    Some(stream)
}
