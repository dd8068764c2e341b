//! The store client: one authenticated connection, one request at a time.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::protocol::{
    read_frame, write_frame, FrameError, Request, Response, MAX_KEY_BYTES, MAX_VALUE_BYTES,
};
use crate::auth::{connect_handshake, fill_random, ConnectError, JobToken, Purpose};
use crate::error::{DistError, Result};

/// How long to wait between attempts while the store is not up yet.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Extra time a client allows a `wait` answer beyond the wait's own timeout.
const WAIT_SLACK: Duration = Duration::from_secs(5);
/// How long one replica of a replicated store may take to answer before the client tries
/// another: a little over the time a replica takes to find that no majority confirms it. A
/// leader whose link went down answers nothing, so this is also how long a client takes to
/// leave it.
const REPLICA_ANSWER_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a replica that failed a request is not taken for the leader on another
/// replica's word: that word may predate the failure.
const FAILED_REPLICA_PAUSE: Duration = Duration::from_secs(2);
/// The longest single wait request: a longer wait is several, so that it can be abandoned.
const WAIT_REQUEST_SLICE: Duration = Duration::from_millis(200);
/// How long a client of a replicated store tries one replica's address before the next.
const REPLICA_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// A connection to a [`StoreServer`](crate::StoreServer). Methods take `&self`; requests from
/// several threads are serialized.
pub struct StoreClient {
    addr: SocketAddr,
    timeout: Duration,
    stream: Mutex<Connection>,
    /// With a replicated store: every replica, and what failing over needs.
    replicas: Option<Replicas>,
    /// Why this client's waits were abandoned, once they were.
    abandoned: Arc<Mutex<Option<String>>>,
}

/// Abandons a client's waits from another thread: the one blocked now and every later one
/// fail at once, with the reason given.
#[derive(Clone)]
pub struct WaitBreaker {
    abandoned: Arc<Mutex<Option<String>>>,
}

impl WaitBreaker {
    /// Abandons the waits, saying `why` (the first reason given stays).
    pub fn abandon(&self, why: &str) {
        let mut abandoned = self
            .abandoned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        abandoned.get_or_insert_with(|| why.to_string());
    }
}

/// The stream, and whether an earlier failure left it out of step.
struct Connection {
    stream: TcpStream,
    broken: Option<String>,
    /// The replica it is connected to (0 for a single store).
    replica: usize,
    /// The replica that last failed a request, and when.
    failed: Option<(usize, Instant)>,
}

/// What a client of a replicated store needs to move from replica to replica.
struct Replicas {
    addrs: Vec<SocketAddr>,
    token: JobToken,
    /// This client's session number, and the number of its last request.
    session: u64,
    last_request: AtomicU64,
    /// Microseconds its requests spent on replicas that failed or did not lead.
    failing_over_micros: AtomicU64,
}

impl StoreClient {
    /// Connects to the store at `addr` and proves the job token. Refused or unreachable
    /// connections are retried until `timeout` (the store may not be up yet); a refused token
    /// is final. `timeout` also bounds every later request.
    pub fn connect(addr: SocketAddr, token: &JobToken, timeout: Duration) -> Result<StoreClient> {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = Self::connect_once(addr, token, deadline);
            match attempt {
                Ok(stream) => {
                    return Ok(StoreClient {
                        addr,
                        timeout,
                        stream: Mutex::new(Connection {
                            stream,
                            broken: None,
                            replica: 0,
                            failed: None,
                        }),
                        replicas: None,
                        abandoned: Arc::default(),
                    })
                }
                Err(Attempt::Final(error)) => return Err(error),
                Err(Attempt::Retry(message)) => {
                    if Instant::now() + RETRY_PAUSE >= deadline {
                        return Err(DistError::StoreUnreachable {
                            addr: addr.to_string(),
                            timeout,
                            message,
                        });
                    }
                    thread::sleep(RETRY_PAUSE);
                }
            }
        }
    }

    /// Connects to a store replicated at `addrs` (see
    /// [`StoreReplica`](crate::StoreReplica)): to the first replica that answers, and later
    /// to whichever leads. A request whose replica fails, or does not lead, is sent again
    /// to another until it is answered or its timeout passes; a write is applied once
    /// however often it is sent.
    pub fn connect_replicated(
        addrs: &[SocketAddr],
        token: &JobToken,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let Some(&first) = addrs.first() else {
            return Err(DistError::InvalidArgument(
                "a replicated store needs the address of at least one replica".into(),
            ));
        };
        let mut session = [0u8; 8];
        fill_random(&mut session)?;
        let deadline = Instant::now() + timeout;
        let mut failures = Vec::new();
        let start = first_to_try(addrs, *lock_hint());
        loop {
            for index in (0..addrs.len()).map(|offset| (start + offset) % addrs.len()) {
                let addr = addrs[index];
                let attempt_deadline = deadline.min(Instant::now() + REPLICA_CONNECT_TIMEOUT);
                match Self::connect_once(addr, token, attempt_deadline) {
                    Ok(stream) => {
                        return Ok(StoreClient {
                            addr: first,
                            timeout,
                            stream: Mutex::new(Connection {
                                stream,
                                broken: None,
                                replica: index,
                                failed: None,
                            }),
                            replicas: Some(Replicas {
                                addrs: addrs.to_vec(),
                                token: token.clone(),
                                session: u64::from_le_bytes(session),
                                last_request: AtomicU64::new(0),
                                failing_over_micros: AtomicU64::new(0),
                            }),
                            abandoned: Arc::default(),
                        });
                    }
                    Err(Attempt::Final(error)) => return Err(error),
                    Err(Attempt::Retry(message)) => failures.push(format!("{addr}: {message}")),
                }
            }
            if Instant::now() + RETRY_PAUSE >= deadline {
                return Err(DistError::StoreUnreachable {
                    addr: addrs_text(addrs),
                    timeout,
                    message: failures.last().cloned().unwrap_or_default(),
                });
            }
            thread::sleep(RETRY_PAUSE);
        }
    }

    fn connect_once(
        addr: SocketAddr,
        token: &JobToken,
        deadline: Instant,
    ) -> std::result::Result<TcpStream, Attempt> {
        let remaining =
            remaining(deadline).ok_or_else(|| Attempt::Retry("deadline passed".into()))?;
        let mut stream = TcpStream::connect_timeout(&addr, remaining)
            .map_err(|error| Attempt::Retry(error.to_string()))?;
        let setup = stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(remaining)))
            .and_then(|()| stream.set_write_timeout(Some(remaining)));
        setup.map_err(|error| Attempt::Retry(error.to_string()))?;
        match connect_handshake(&mut stream, token, Purpose::Store) {
            Ok(()) => Ok(stream),
            Err(ConnectError::Refused) => Err(Attempt::Final(DistError::TokenRefused {
                addr: addr.to_string(),
            })),
            Err(ConnectError::NotTrusted(message)) => Err(Attempt::Final(DistError::NotTrusted {
                addr: addr.to_string(),
                message,
            })),
            Err(ConnectError::Io(error)) => Err(Attempt::Retry(format!("handshake: {error}"))),
        }
    }

    /// The store's address (a replicated store's first replica).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// For a replicated store, the replica that answered this client's last request: the
    /// leader then. `None` for a single store.
    pub fn answering_replica(&self) -> Option<SocketAddr> {
        let replicas = self.replicas.as_ref()?;
        replicas.addrs.get(self.connection().replica).copied()
    }

    /// The bound on each request of this client.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the store is replicated: a failed request then means that no majority of its
    /// replicas answered, which may heal, rather than that the store is gone.
    pub fn is_replicated(&self) -> bool {
        self.replicas.is_some()
    }

    /// How long this client's requests have spent, in all, on replicas of a replicated store
    /// that failed or did not lead: while it grows, nobody could write to the store, so a
    /// heartbeat that did not move then says nothing of its sender. Zero for a single store.
    pub fn time_failing_over(&self) -> Duration {
        self.replicas.as_ref().map_or(Duration::ZERO, |replicas| {
            Duration::from_micros(replicas.failing_over_micros.load(Ordering::SeqCst))
        })
    }

    /// Another connection to the same store, replicated or not, for another thread.
    pub fn connect_again(&self, token: &JobToken, timeout: Duration) -> Result<StoreClient> {
        match &self.replicas {
            Some(replicas) => StoreClient::connect_replicated(&replicas.addrs, token, timeout),
            None => StoreClient::connect(self.addr, token, timeout),
        }
    }

    /// This end's address on the connection: the local interface that reaches the store.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        let connection = self.connection();
        connection
            .stream
            .local_addr()
            .map_err(|error| DistError::io("read the store client's local address", &error))
    }

    /// Stores `value` under `key`, replacing any earlier value.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.set_within(key, value, self.timeout)
    }

    /// The value under `key`, or `None` when it is not set. Does not block.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.get_within(key, self.timeout)
    }

    /// [`get`](Self::get) with its own bound on the round trip.
    pub fn get_within(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        match self.request(key, &Request::Get { key: key.into() }, timeout)? {
            Response::Value(value) => Ok(Some(value)),
            Response::NotFound => Ok(None),
            other => Err(self.unexpected(key, &other)),
        }
    }

    /// [`set`](Self::set) with its own bound on the round trip.
    pub(crate) fn set_within(&self, key: &str, value: &[u8], timeout: Duration) -> Result<()> {
        check_key(key)?;
        check_value(key, value)?;
        match self.request(
            key,
            &Request::Set {
                key: key.into(),
                value: value.to_vec(),
            },
            timeout,
        )? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(key, &other)),
        }
    }

    /// Blocks until every key in `keys` is set, or fails with the missing keys after `timeout`,
    /// or at once when its waits are abandoned (see [`wait_breaker`](Self::wait_breaker)).
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        for key in keys {
            check_key(key)?;
        }
        let deadline = Instant::now() + timeout;
        let first_key = keys.first().copied().unwrap_or_default();
        loop {
            if let Some(why) = self.abandoned_for() {
                return Err(DistError::Aborted {
                    op: format!("the wait for {first_key:?}"),
                    report: why,
                });
            }
            let slice = remaining(deadline)
                .unwrap_or_default()
                .min(WAIT_REQUEST_SLICE);
            let request = Request::Wait {
                keys: keys.iter().map(|key| key.to_string()).collect(),
                timeout: slice,
            };
            match self.request(first_key, &request, slice + WAIT_SLACK)? {
                Response::Done => return Ok(()),
                Response::TimedOut { missing } if remaining(deadline).is_none() => {
                    return Err(DistError::StoreTimeout { missing, timeout })
                }
                Response::TimedOut { .. } => {}
                other => return Err(self.unexpected(first_key, &other)),
            }
        }
    }

    /// What abandons this client's waits from another thread.
    pub fn wait_breaker(&self) -> WaitBreaker {
        WaitBreaker {
            abandoned: Arc::clone(&self.abandoned),
        }
    }

    fn abandoned_for(&self) -> Option<String> {
        self.abandoned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Adds `delta` to the integer under `key` (missing counts as 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.add_within(key, delta, self.timeout)
    }

    /// [`add`](Self::add) with its own bound on the round trip.
    pub(crate) fn add_within(&self, key: &str, delta: i64, timeout: Duration) -> Result<i64> {
        check_key(key)?;
        let request = Request::Add {
            key: key.into(),
            delta,
        };
        match self.request(key, &request, timeout)? {
            Response::Integer(value) => Ok(value),
            other => Err(self.unexpected(key, &other)),
        }
    }

    /// Sets `key` to `desired` if its value equals `expected` (`None`: the key is missing).
    /// Returns the value stored afterwards: `desired` on success, the current value (empty when
    /// missing) otherwise.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        self.compare_set_within(key, expected, desired, self.timeout)
    }

    /// [`compare_set`](Self::compare_set) with its own bound on the round trip.
    pub(crate) fn compare_set_within(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        check_key(key)?;
        check_value(key, desired)?;
        if let Some(expected) = expected {
            check_value(key, expected)?;
        }
        let request = Request::CompareSet {
            key: key.into(),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.to_vec(),
        };
        match self.request(key, &request, timeout)? {
            Response::Value(value) => Ok(value),
            other => Err(self.unexpected(key, &other)),
        }
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        match self.request(key, &Request::Delete { key: key.into() }, self.timeout)? {
            Response::Deleted(existed) => Ok(existed),
            other => Err(self.unexpected(key, &other)),
        }
    }

    /// The number of keys in the store.
    pub fn num_keys(&self) -> Result<u64> {
        match self.request("", &Request::NumKeys, self.timeout)? {
            Response::Count(count) => Ok(count),
            other => Err(self.unexpected("", &other)),
        }
    }

    fn connection(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.stream
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sends one request and reads its response, both within `timeout`. Any I/O failure
    /// breaks the connection for good: a half-read response would put it out of step.
    fn request(&self, key: &str, request: &Request, timeout: Duration) -> Result<Response> {
        let _waiting = crate::heartbeat::waiting_on_the_store();
        if let Some(replicas) = &self.replicas {
            return self.request_replicated(replicas, key, request, timeout);
        }
        let mut connection = self.connection();
        if let Some(reason) = &connection.broken {
            return Err(self.store_error(format!("the connection broke earlier: {reason}")));
        }
        let result = exchange(&mut connection.stream, request, timeout);
        match result {
            Ok(Response::Error(message)) => Err(DistError::StoreRequest {
                key: key.into(),
                message,
            }),
            Ok(response) => Ok(response),
            Err(message) => {
                connection.broken = Some(message.clone());
                Err(self.store_error(message))
            }
        }
    }

    /// Sends `request` to the leading replica, moving to another on a failure or a
    /// `NotLeader` answer, until `timeout`.
    fn request_replicated(
        &self,
        replicas: &Replicas,
        key: &str,
        request: &Request,
        timeout: Duration,
    ) -> Result<Response> {
        let started = Instant::now();
        let deadline = started + timeout;
        let seq = replicas.last_request.fetch_add(1, Ordering::SeqCst) + 1;
        let mut connection = self.connection();
        let mut last_failure = String::from("no replica answered");
        let mut moved = false;
        let count_failover = |moved: bool| {
            if moved {
                let micros = started.elapsed().as_micros() as u64;
                replicas
                    .failing_over_micros
                    .fetch_add(micros, Ordering::SeqCst);
            }
        };
        loop {
            let Some(left) = remaining(deadline) else {
                count_failover(moved);
                let message = match replicas.addrs.len() {
                    1 => format!("no answer within {timeout:?}; the last try: {last_failure}"),
                    _ => format!(
                        "no replica of the store answered as its leader within {timeout:?}; \
                         the last: {last_failure}"
                    ),
                };
                return Err(DistError::Store {
                    addr: addrs_text(&replicas.addrs),
                    message,
                });
            };
            replicas.follow_the_hint(&mut connection);
            if connection.broken.is_some() {
                moved = true;
                if !replicas.reconnect(&mut connection, deadline) {
                    thread::sleep(RETRY_PAUSE.min(left));
                    continue;
                }
            }
            let attempt = Request::Session {
                client: replicas.session,
                seq,
                request: Box::new(within(request, left)),
            };
            let bound = match request {
                Request::Wait { .. } => left,
                _ => left.min(REPLICA_ANSWER_TIMEOUT),
            };
            let addr = replicas.addrs[connection.replica];
            match exchange(&mut connection.stream, &attempt, bound) {
                Ok(Response::NotLeader { leader }) => {
                    last_failure = format!("{addr} does not lead the store");
                    replicas.move_on(&mut connection, leader.as_deref());
                    if leader.is_none() {
                        thread::sleep(RETRY_PAUSE.min(left));
                    }
                }
                Ok(Response::Error(message)) => {
                    count_failover(moved);
                    return Err(DistError::StoreRequest {
                        key: key.into(),
                        message,
                    });
                }
                Ok(response) => {
                    count_failover(moved);
                    *lock_hint() = Some(addr);
                    return Ok(response);
                }
                Err(message) => {
                    last_failure = format!("{addr}: {message}");
                    connection.failed = Some((connection.replica, Instant::now()));
                    replicas.move_on(&mut connection, None);
                }
            }
        }
    }

    fn store_error(&self, message: String) -> DistError {
        DistError::Store {
            addr: self.addr.to_string(),
            message,
        }
    }

    fn unexpected(&self, key: &str, response: &Response) -> DistError {
        DistError::StoreRequest {
            key: key.into(),
            message: format!("unexpected answer {response:?}"),
        }
    }
}

impl Replicas {
    /// Marks the connection for a move to the replica at `leader` when it is one of the
    /// store's, else to the next one.
    fn move_on(&self, connection: &mut Connection, leader: Option<&str>) {
        let recently_failed = |index: usize| {
            connection
                .failed
                .is_some_and(|(failed, at)| failed == index && at.elapsed() < FAILED_REPLICA_PAUSE)
        };
        let hinted = leader
            .and_then(|leader| {
                self.addrs
                    .iter()
                    .position(|addr| addr.to_string() == leader)
            })
            .filter(|&index| !recently_failed(index));
        connection.replica = hinted.unwrap_or((connection.replica + 1) % self.addrs.len());
        connection.broken = Some("moving to another replica".into());
    }

    /// Marks the connection for a move to the replica that last answered another client
    /// of this process as the leader, when that is another one: a leader whose host was cut
    /// off answers nothing, and each client would wait its answer timeout to find out.
    fn follow_the_hint(&self, connection: &mut Connection) {
        let hint = *lock_hint();
        let Some(index) = hint.and_then(|hint| self.addrs.iter().position(|&addr| addr == hint))
        else {
            return;
        };
        if index != connection.replica && connection.broken.is_none() {
            connection.replica = index;
            connection.broken = Some("moving to the replica that leads".into());
        }
    }

    /// Connects to the replica the connection should move to; false when it cannot now
    /// (the next replica is then tried on the next call).
    fn reconnect(&self, connection: &mut Connection, deadline: Instant) -> bool {
        let addr = self.addrs[connection.replica];
        let attempt_deadline = deadline.min(Instant::now() + REPLICA_CONNECT_TIMEOUT);
        match StoreClient::connect_once(addr, &self.token, attempt_deadline) {
            Ok(stream) => {
                connection.stream = stream;
                connection.broken = None;
                true
            }
            Err(_) => {
                connection.failed = Some((connection.replica, Instant::now()));
                connection.replica = (connection.replica + 1) % self.addrs.len();
                false
            }
        }
    }
}

/// The replica that last answered a request of this process as the replicated store's
/// leader. A new connection starts there: the first replica may be cut off, and a
/// connection to a host that is cut off only fails at its timeout.
static LEADER_HINT: Mutex<Option<SocketAddr>> = Mutex::new(None);

fn lock_hint() -> std::sync::MutexGuard<'static, Option<SocketAddr>> {
    LEADER_HINT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The index in `addrs` of the replica to try first: the `hint` when it is one of them.
fn first_to_try(addrs: &[SocketAddr], hint: Option<SocketAddr>) -> usize {
    hint.and_then(|hint| addrs.iter().position(|&addr| addr == hint))
        .unwrap_or(0)
}

/// `request` with its wait cut to what is left of the client's own timeout.
fn within(request: &Request, left: Duration) -> Request {
    match request {
        Request::Wait { keys, timeout } => Request::Wait {
            keys: keys.clone(),
            timeout: (*timeout).min(left.saturating_sub(WAIT_SLACK)),
        },
        other => other.clone(),
    }
}

fn addrs_text(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Why one connection attempt failed.
enum Attempt {
    Retry(String),
    Final(DistError),
}

fn exchange(
    stream: &mut TcpStream,
    request: &Request,
    timeout: Duration,
) -> std::result::Result<Response, String> {
    let timeout = timeout.max(Duration::from_millis(1));
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|error| error.to_string())?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|error| error.to_string())?;
    write_frame(stream, &request.encode())
        .map_err(|error| describe_io("sending a request", &error, timeout))?;
    let payload = read_frame(stream).map_err(|error| match error {
        FrameError::Io(error) => describe_io("waiting for the answer", &error, timeout),
        FrameError::Malformed(message) => format!("malformed answer: {message}"),
    })?;
    Response::decode(&payload).map_err(|message| format!("malformed answer: {message}"))
}

fn describe_io(during: &str, error: &std::io::Error, timeout: Duration) -> String {
    use std::io::ErrorKind::*;
    match error.kind() {
        WouldBlock | TimedOut => format!("no answer within {timeout:?} while {during}"),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe => {
            format!("the store closed the connection while {during}")
        }
        _ => format!("{error} while {during}"),
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(DistError::TooLarge {
            what: "key".into(),
            len: key.len(),
            max: MAX_KEY_BYTES,
        });
    }
    Ok(())
}

fn check_value(key: &str, value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(DistError::TooLarge {
            what: format!("value of key {key:?}"),
            len: value.len(),
            max: MAX_VALUE_BYTES,
        });
    }
    Ok(())
}

/// Time left until `deadline`, or `None` when it has passed.
pub(crate) fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_connection_starts_at_the_replica_that_last_led() {
        let addrs: Vec<SocketAddr> = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
            .iter()
            .map(|addr| addr.parse().expect("addr"))
            .collect();
        assert_eq!(first_to_try(&addrs, None), 0);
        assert_eq!(first_to_try(&addrs, Some(addrs[2])), 2);
        let elsewhere = "10.0.0.9:1".parse().expect("addr");
        assert_eq!(first_to_try(&addrs, Some(elsewhere)), 0);
    }
}
