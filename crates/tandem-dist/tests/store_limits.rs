//! The store under hostile clients: a client that trickles its handshake is cut at the one
//! deadline, the oldest idle connections beyond the per-address cap are closed at once, and a flood of
//! unauthenticated connections costs no thread each while authenticated clients (blocked in
//! long waits) keep working.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tandem_dist::{JobToken, StoreClient, StoreLimits, StoreServer};

/// Bytes of the store's hello: magic, purpose, nonce.
const HELLO_LEN: usize = 8 + 1 + 32;
/// Bytes of a connector's reply: magic, nonce, proof.
const REPLY_LEN: usize = 8 + 32 + 32;
/// Bound on any single read in these tests.
const READ_BOUND: Duration = Duration::from_secs(5);

fn start(limits: StoreLimits) -> (StoreServer, JobToken) {
    let token = JobToken::generate().expect("random token");
    let server = StoreServer::bind_with(
        "127.0.0.1:0".parse().expect("address"),
        token.clone(),
        limits,
    )
    .expect("bind store");
    (server, token)
}

fn raw_connection(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(READ_BOUND))
        .expect("read timeout");
    stream
}

/// What the server sent first on a raw connection: its hello, or nothing before closing.
fn first_bytes(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buffer = [0u8; HELLO_LEN];
    while received.len() < HELLO_LEN {
        match stream.read(&mut buffer[..HELLO_LEN - received.len()]) {
            Ok(0) => break,
            Ok(read) => received.extend_from_slice(&buffer[..read]),
            Err(error) if error.kind() == ErrorKind::ConnectionReset => break,
            Err(error) => panic!("no hello and no close within {READ_BOUND:?}: {error}"),
        }
    }
    received
}

/// Whether the server has closed `stream` (a read sees end-of-file or a reset at once).
fn is_closed_by_server(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).expect("non-blocking");
    let mut byte = [0u8; 1];
    let closed = match (&*stream).read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(error) => error.kind() != ErrorKind::WouldBlock,
    };
    stream.set_nonblocking(false).expect("blocking");
    closed
}

/// The threads of this process named after the store on `port`.
fn store_threads(port: u16) -> usize {
    let gate = format!("store-{port}");
    let client = format!("store-{port}-cl");
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.trim_end() == gate || name.trim_end() == client)
        .count()
}

#[test]
fn a_client_that_trickles_its_handshake_is_cut_at_the_deadline() {
    let deadline = Duration::from_millis(800);
    let (server, _token) = start(StoreLimits {
        handshake_deadline: deadline,
        ..StoreLimits::default()
    });
    let mut slow = raw_connection(server.local_addr());
    let started = Instant::now();
    assert_eq!(first_bytes(&mut slow).len(), HELLO_LEN);
    // One byte every 100 ms: the whole reply would take 7.2 s, and no single read ever waits
    // long, so only a deadline on the whole handshake can end it.
    let mut sent = 0;
    let mut cut_after = None;
    while sent < REPLY_LEN {
        if is_closed_by_server(&slow) {
            cut_after = Some(started.elapsed());
            break;
        }
        if slow.write_all(b"T").is_err() {
            cut_after = Some(started.elapsed());
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let cut_after = cut_after.unwrap_or_else(|| {
        panic!("the server let a client trickle all {REPLY_LEN} bytes of its handshake")
    });
    assert!(
        cut_after >= deadline,
        "cut after {cut_after:?}, before the deadline"
    );
    assert!(sent < REPLY_LEN / 2, "{sent} bytes went in before the cut");
}

#[test]
fn beyond_the_per_address_cap_the_oldest_idle_connections_are_closed_at_once() {
    let (server, token) = start(StoreLimits {
        max_pending_per_address: 3,
        ..StoreLimits::default()
    });
    let mut held: Vec<TcpStream> = Vec::new();
    for _ in 0..5 {
        let mut stream = raw_connection(server.local_addr());
        assert_eq!(first_bytes(&mut stream).len(), HELLO_LEN);
        held.push(stream);
    }
    // Five connections from one address, three allowed: the two oldest are gone.
    let closed: Vec<bool> = held.iter().map(is_closed_by_server).collect();
    assert_eq!(closed, vec![true, true, false, false, false]);

    // A client of the same address gets in at once, pushing out the oldest idle one, and
    // long before the handshake deadline (10 s) would free a slot.
    let client = StoreClient::connect(server.local_addr(), &token, Duration::from_secs(5))
        .expect("a prompt client gets in");
    client.set("in", b"yes").expect("set");
    let closed: Vec<bool> = held.iter().map(is_closed_by_server).collect();
    assert_eq!(closed, vec![true, true, true, false, false]);
}

#[test]
fn a_flood_of_unauthenticated_connections_costs_no_thread_and_clients_keep_working() {
    let (server, token) = start(StoreLimits {
        handshake_deadline: Duration::from_millis(1500),
        ..StoreLimits::default()
    });
    let addr = server.local_addr();
    let port = addr.port();
    let timeout = Duration::from_secs(10);
    let waiters: Vec<StoreClient> = (0..8)
        .map(|_| StoreClient::connect(addr, &token, timeout).expect("connect a waiter"))
        .collect();
    std::thread::scope(|scope| {
        let blocked: Vec<_> = waiters
            .iter()
            .map(|waiter| scope.spawn(move || waiter.wait(&["go"], Duration::from_secs(20))))
            .collect();
        // Three hundred outsiders that never say a word, held open.
        let flood: Vec<TcpStream> = (0..300).map(|_| raw_connection(addr)).collect();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            store_threads(port),
            1 + waiters.len(),
            "one gate thread and one per authenticated client"
        );
        let setter = StoreClient::connect(addr, &token, timeout).expect("connect the setter");
        setter.set("go", b"1").expect("set");
        for waiter in blocked {
            waiter
                .join()
                .expect("waiter thread")
                .expect("the wait ends");
        }
        assert_eq!(store_threads(port), 2 + waiters.len());
        drop(flood);
    });
}
