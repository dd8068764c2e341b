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
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use super::client::remaining;
use super::gate::{Gate, Passed};
use super::limits::StoreLimits;
use super::protocol::{read_frame, write_frame, FrameError, Request, Response};
use crate::auth::JobToken;
use crate::error::{DistError, Result};

/// How long the gate waits for readiness before it checks whether the server was dropped.
const GATE_SLICE: Duration = Duration::from_millis(50);
/// How long the server may take to hand an answer to a client that does not read it.
const ANSWER_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest `wait` the server honours, whatever the client asks.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// The rendezvous store (the role of c10d's TCPStore). It serves on background threads until
/// dropped; dropping it closes every client connection.
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
}

/// State shared by the gate thread and the client threads.
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
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
        let gate = Gate::bind(addr, token, limits)?;
        let local_addr = gate.local_addr()?;
        let shared = Arc::new(Shared {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
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
        self.shared.changed.notify_all();
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
        let response = shared.answer(request);
        write_frame(stream, &response.encode())?;
        stream.flush()?;
        if shared.stopping.load(Ordering::SeqCst) {
            return Ok(());
        }
    }
}

impl Shared {
    fn answer(&self, request: Request) -> Response {
        match request {
            Request::Set { key, value } => {
                lock(&self.map).insert(key, value);
                self.changed.notify_all();
                Response::Done
            }
            Request::Get { key } => match lock(&self.map).get(&key) {
                Some(value) => Response::Value(value.clone()),
                None => Response::NotFound,
            },
            Request::Wait { keys, timeout } => self.wait(&keys, timeout.min(MAX_WAIT)),
            Request::Add { key, delta } => self.add(&key, delta),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let mut map = lock(&self.map);
                let current = map.get(&key);
                if current.map(Vec::as_slice) == expected.as_deref() {
                    map.insert(key, desired.clone());
                    self.changed.notify_all();
                    Response::Value(desired)
                } else {
                    // c10d semantics: on a mismatch, answer what is stored (empty when missing).
                    Response::Value(current.cloned().unwrap_or_default())
                }
            }
            Request::Delete { key } => Response::Deleted(lock(&self.map).remove(&key).is_some()),
            Request::NumKeys => Response::Count(lock(&self.map).len() as u64),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Response {
        let mut map = lock(&self.map);
        let current = match map.get(key) {
            None => 0,
            Some(bytes) => match std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| text.parse::<i64>().ok())
            {
                Some(number) => number,
                None => {
                    return Response::Error(format!(
                        "value of key {key:?} is not a decimal integer"
                    ))
                }
            },
        };
        let Some(sum) = current.checked_add(delta) else {
            return Response::Error(format!(
                "adding {delta} to {current} (key {key:?}) overflows i64"
            ));
        };
        map.insert(key.to_string(), sum.to_string().into_bytes());
        self.changed.notify_all();
        Response::Integer(sum)
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Response {
        let deadline = Instant::now() + timeout;
        let mut map = lock(&self.map);
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|key| !map.contains_key(*key))
                .cloned()
                .collect();
            if missing.is_empty() {
                return Response::Done;
            }
            let now = Instant::now();
            if now >= deadline || self.stopping.load(Ordering::SeqCst) {
                return Response::TimedOut { missing };
            }
            map = match self.changed.wait_timeout(map, deadline - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
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
