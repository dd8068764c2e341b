//! The store server: a key-value map behind a TCP listener.
//!
//! New connections wait at the [gate](super::gate), one thread for every handshake; a client
//! that proves the job token gets a thread of its own (its requests may block in `wait` for as
//! long as the job runs), and the number of such clients is bounded by the store's limits.
//! Malformed frames, oversized lengths and unknown opcodes close the connection. Nothing a
//! client sends can make the server panic or allocate more than one frame's limit.

use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use super::client::remaining;
use super::gate::{Gate, Passed};
use super::keyspace::Keyspace;
use super::limits::StoreLimits;
use super::protocol::{read_frame, write_frame, FrameError, Request, Response};
use crate::auth::JobToken;
use crate::error::{DistError, Result};

/// How long the gate waits for readiness before it checks whether the server was dropped.
const GATE_SLICE: Duration = Duration::from_millis(50);
/// How long the server may take to hand an answer to a client that does not read it.
const ANSWER_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The rendezvous store (the role of c10d's TCPStore). It serves on background threads until
/// dropped; dropping it closes every client connection.
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
}

/// What answers the clients' requests: a keyspace of its own, or a replica of a replicated
/// store.
pub(crate) trait Answer: Send + Sync + 'static {
    /// The answer to `request`, or `None` for a message that gets none.
    fn answer(&self, request: Request) -> Option<Response>;
    /// Ends every blocked request now.
    fn stop(&self);
}

impl Answer for Keyspace {
    fn answer(&self, request: Request) -> Option<Response> {
        match request {
            Request::Raft { .. } => Some(Response::Error(
                "this store is not replicated: it takes no Raft messages".into(),
            )),
            request => Some(Keyspace::answer(self, request)),
        }
    }

    fn stop(&self) {
        Keyspace::stop(self);
    }
}

/// State shared by the gate thread and the client threads.
struct Shared {
    answerer: Arc<dyn Answer>,
    stopping: AtomicBool,
    /// The descriptor of each authenticated client's stream, to shut it down when the server
    /// is dropped. A client thread removes its entry before its stream closes, so every
    /// descriptor here is open (and not yet reused) while the lock is held.
    clients: Mutex<HashMap<u64, RawFd>>,
    next_client: AtomicU64,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving clients that know `token`,
    /// within the default [`StoreLimits`].
    pub fn bind(addr: SocketAddr, token: JobToken) -> Result<StoreServer> {
        StoreServer::bind_with(addr, token, StoreLimits::default())
    }

    /// [`bind`](Self::bind) within `limits`. The descriptor budget is read now: the soft
    /// `RLIMIT_NOFILE` less the descriptors open and `limits.reserved_descriptors`.
    pub fn bind_with(
        addr: SocketAddr,
        token: JobToken,
        limits: StoreLimits,
    ) -> Result<StoreServer> {
        StoreServer::serve(addr, token, limits, Arc::new(Keyspace::new()))
    }

    /// Serves clients that know `token` on `addr`, within `limits`, with `answerer`'s answers.
    pub(crate) fn serve(
        addr: SocketAddr,
        token: JobToken,
        limits: StoreLimits,
        answerer: Arc<dyn Answer>,
    ) -> Result<StoreServer> {
        let gate = Gate::bind(addr, token, limits)?;
        let local_addr = gate.local_addr()?;
        let shared = Arc::new(Shared {
            answerer,
            stopping: AtomicBool::new(false),
            clients: Mutex::new(HashMap::new()),
            next_client: AtomicU64::new(0),
        });
        let gate_shared = Arc::clone(&shared);
        thread::Builder::new()
            .name(format!("store-{}", local_addr.port()))
            .spawn(move || serve_gate(gate, &gate_shared))
            .map_err(|error| DistError::io("spawn the store's gate thread", &error))?;
        Ok(StoreServer { local_addr, shared })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.answerer.stop();
        for &fd in lock(&self.shared.clients).values() {
            // SAFETY: `shutdown` touches no memory; `fd` is an open socket while the lock is
            // held (see `Shared::clients`), so no other file is affected.
            unsafe {
                libc::shutdown(fd, libc::SHUT_RDWR);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A client thread cannot panic while holding a lock, but recover the data if one did.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs the gate until the server is dropped; the listener and every pending handshake close
/// with it.
fn serve_gate(mut gate: Gate, shared: &Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        let clients = lock(&shared.clients).len();
        for passed in gate.turn(GATE_SLICE, clients) {
            start_client(passed, shared);
        }
    }
}

/// Registers a client that passed the handshake and starts its thread. Registration happens
/// here, on the gate's thread, so the gate's next count includes it.
fn start_client(passed: Passed, shared: &Arc<Shared>) {
    let id = shared.next_client.fetch_add(1, Ordering::SeqCst);
    let port = passed.stream.local_addr().map_or(0, |addr| addr.port());
    let client_shared = Arc::clone(shared);
    // Held across the spawn: if it fails, the stream closes with the closure, and nobody may
    // shut its descriptor down before the entry is gone.
    let mut clients = lock(&shared.clients);
    clients.insert(id, passed.stream.as_raw_fd());
    let spawned = thread::Builder::new()
        .name(format!("store-{port}-cl"))
        .spawn(move || serve_client(passed, id, &client_shared));
    if spawned.is_err() {
        // The client sees a closed connection.
        clients.remove(&id);
    }
}

fn serve_client(mut passed: Passed, id: u64, shared: &Shared) {
    // The server may have been dropped between the handshake and registration.
    if !shared.stopping.load(Ordering::SeqCst) {
        let _ =
            finish_handshake(&mut passed).and_then(|()| serve_requests(&mut passed.stream, shared));
    }
    let _ = passed.stream.shutdown(Shutdown::Both);
    lock(&shared.clients).remove(&id);
    drop(passed);
}

/// Sends the acceptance, within what is left of the handshake's deadline.
fn finish_handshake(passed: &mut Passed) -> std::io::Result<()> {
    let left = remaining(passed.deadline)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::TimedOut))?;
    passed.stream.set_write_timeout(Some(left))?;
    passed.stream.write_all(&passed.answer)?;
    passed.stream.flush()
}

/// Answers requests until the client leaves or misbehaves.
fn serve_requests(stream: &mut TcpStream, shared: &Shared) -> std::io::Result<()> {
    // Clients may stay idle for as long as the job runs.
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(ANSWER_WRITE_TIMEOUT))?;
    loop {
        let payload = match read_frame(stream) {
            Ok(payload) => payload,
            Err(FrameError::Io(_)) | Err(FrameError::Malformed(_)) => return Ok(()),
        };
        let request = match Request::decode(&payload) {
            Ok(request) => request,
            Err(message) => {
                // Say why, then close: the stream may be out of step.
                let _ = write_frame(
                    stream,
                    &Response::Error(format!("malformed request: {message}")).encode(),
                );
                return Ok(());
            }
        };
        if let Some(response) = shared.answerer.answer(request) {
            write_frame(stream, &response.encode())?;
            stream.flush()?;
        }
        if shared.stopping.load(Ordering::SeqCst) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
    use std::time::Instant;

    use crate::auth::{connect_handshake, Purpose};
    use crate::store::StoreClient;

    /// A store server on a free loopback port, and its job token.
    fn loopback_server() -> (StoreServer, JobToken) {
        let token = JobToken::new("token").expect("token");
        let server =
            StoreServer::bind("127.0.0.1:0".parse().expect("addr"), token.clone()).expect("bind");
        (server, token)
    }

    fn authenticated_raw_client(server: &StoreServer, token: &JobToken) -> TcpStream {
        let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        connect_handshake(&mut stream, token, Purpose::Store).expect("handshake");
        stream
    }

    #[test]
    fn length_prefix_of_2_pow_40_closes_the_connection_and_the_server_lives_on() {
        let (server, token) = loopback_server();
        let mut raw = authenticated_raw_client(&server, &token);
        raw.write_all(&(1u64 << 40).to_le_bytes())
            .expect("write prefix");
        let mut answer = Vec::new();
        let started = Instant::now();
        let read = raw.read_to_end(&mut answer);
        assert!(
            read.is_ok() && answer.is_empty(),
            "expected a plain close, got {read:?} {answer:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));

        let client = StoreClient::connect(server.local_addr(), &token, Duration::from_secs(5))
            .expect("connect");
        client.set("still", b"here").expect("set");
        assert_eq!(client.num_keys().expect("count"), 1);
    }

    #[test]
    fn authenticated_garbage_frames_are_answered_or_closed_without_harm() {
        let (server, token) = loopback_server();
        let mut seed = 12345u64;
        for _ in 0..30 {
            let mut raw = authenticated_raw_client(&server, &token);
            let mut payload = Vec::new();
            for _ in 0..(seed % 40) {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                payload.push((seed >> 33) as u8);
            }
            let _ = write_frame(&mut raw, &payload);
            let _ = raw.shutdown(std::net::Shutdown::Write);
            let mut answer = Vec::new();
            let _ = raw.read_to_end(&mut answer);
        }
        let client = StoreClient::connect(server.local_addr(), &token, Duration::from_secs(5))
            .expect("connect");
        client.set("ok", b"1").expect("set");
        assert_eq!(client.get("ok").expect("get"), Some(b"1".to_vec()));
    }

    #[test]
    fn dropping_the_server_closes_its_clients_even_mid_wait() {
        let (server, token) = loopback_server();
        let connect = || {
            StoreClient::connect(server.local_addr(), &token, Duration::from_secs(5))
                .expect("connect")
        };
        let (idle, waiting) = (connect(), connect());
        let started = std::time::Instant::now();
        std::thread::scope(|scope| {
            let wait = scope.spawn(|| waiting.wait(&["never"], Duration::from_secs(30)));
            std::thread::sleep(Duration::from_millis(100));
            drop(server);
            // Depending on when the close lands, the client sees its request refused, the
            // connection closed under it, or a timeout; never an answer, and never the
            // whole 30 s wait.
            let result = wait.join().expect("wait thread");
            assert!(
                matches!(
                    result,
                    Err(crate::DistError::StoreTimeout { .. }
                        | crate::DistError::StoreRequest { .. }
                        | crate::DistError::Store { .. })
                ),
                "{result:?}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(25),
                "{:?}",
                started.elapsed()
            );
        });
        assert!(idle.get("any").is_err());
    }

    #[test]
    fn malformed_request_gets_an_explanation_before_the_close() {
        let (server, token) = loopback_server();
        let mut raw = authenticated_raw_client(&server, &token);
        write_frame(&mut raw, &[99]).expect("write");
        let answer = read_frame(&mut raw).unwrap_or_else(|_| panic!("no answer"));
        assert_eq!(
            Response::decode(&answer),
            Ok(Response::Error(
                "malformed request: unknown opcode 99".into()
            ))
        );
        let mut rest = Vec::new();
        assert_eq!(raw.read_to_end(&mut rest).expect("closed"), 0);
    }
}
