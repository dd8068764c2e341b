//! The rendezvous store: semantics of every request, blocking waits, the job token, and
//! clients that misbehave.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::start_store;
use tandem_dist::{DistError, JobToken, StoreClient, MAX_KEY_BYTES};

const TIMEOUT: Duration = Duration::from_secs(5);

#[test]
fn set_get_add_compare_set_delete_and_count() {
    let (server, token) = start_store();
    let client = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    assert_eq!(client.get("missing").expect("get"), None);
    client.set("a", b"alpha").expect("set");
    assert_eq!(client.get("a").expect("get"), Some(b"alpha".to_vec()));
    client.set("a", b"").expect("overwrite with empty");
    assert_eq!(client.get("a").expect("get"), Some(Vec::new()));

    assert_eq!(client.add("counter", 5).expect("add"), 5);
    assert_eq!(client.add("counter", -7).expect("add"), -2);
    assert_eq!(client.get("counter").expect("get"), Some(b"-2".to_vec()));
    match client.add("a", 1) {
        Err(DistError::StoreRequest { key, message }) => {
            assert_eq!(key, "a");
            assert_eq!(message, "value of key \"a\" is not a decimal integer");
        }
        other => panic!("expected a refused add, got {other:?}"),
    }

    assert_eq!(
        client.compare_set("cas", None, b"first").expect("cas"),
        b"first".to_vec()
    );
    assert_eq!(
        client.compare_set("cas", None, b"second").expect("cas"),
        b"first".to_vec()
    );
    assert_eq!(
        client
            .compare_set("cas", Some(b"wrong"), b"second")
            .expect("cas"),
        b"first".to_vec()
    );
    assert_eq!(
        client
            .compare_set("cas", Some(b"first"), b"second")
            .expect("cas"),
        b"second".to_vec()
    );
    assert_eq!(
        client.compare_set("absent", Some(b"x"), b"y").expect("cas"),
        Vec::<u8>::new()
    );
    assert_eq!(client.get("absent").expect("get"), None);

    assert_eq!(client.num_keys().expect("count"), 3);
    assert!(client.delete("a").expect("delete"));
    assert!(!client.delete("a").expect("delete again"));
    assert_eq!(client.num_keys().expect("count"), 2);
}

#[test]
fn wait_blocks_until_another_client_sets_the_keys() {
    let (server, token) = start_store();
    let waiter = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    let setter = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    let started = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            setter.set("x", b"1").expect("set x");
            setter.set("y", b"2").expect("set y");
        });
        waiter.wait(&["x", "y"], TIMEOUT).expect("wait");
    });
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < TIMEOUT,
        "waited {waited:?}"
    );
}

#[test]
fn a_wait_abandoned_from_another_thread_fails_at_once_with_the_reason() {
    let (server, token) = start_store();
    let client = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    let breaker = client.wait_breaker();
    let started = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            breaker.abandon("membership 2 left rank 3 out");
        });
        let error = client
            .wait(&["never"], Duration::from_secs(60))
            .expect_err("abandoned");
        assert_eq!(
            error.to_string(),
            "the wait for \"never\" aborted because membership 2 left rank 3 out"
        );
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    // Later waits fail at once too; other requests go on.
    assert!(client.wait(&["never"], Duration::from_secs(60)).is_err());
    client.set("still", b"1").expect("set");
}

#[test]
fn wait_times_out_naming_the_missing_keys() {
    let (server, token) = start_store();
    let client = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    client.set("here", b"1").expect("set");
    let started = Instant::now();
    let error = client
        .wait(&["here", "gone"], Duration::from_millis(300))
        .expect_err("must time out");
    assert_eq!(
        error.to_string(),
        "timed out after 300ms waiting for store keys [\"gone\"]"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    // The connection is still usable after a timed-out wait.
    assert_eq!(client.get("here").expect("get"), Some(b"1".to_vec()));
}

#[test]
fn wrong_token_is_refused_and_cannot_read_or_write() {
    let (server, token) = start_store();
    let good = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    good.set("secret", b"s").expect("set");
    let wrong = JobToken::new("not-the-token").expect("token");
    let started = Instant::now();
    let error = match StoreClient::connect(server.local_addr(), &wrong, TIMEOUT) {
        Err(error) => error,
        Ok(_) => panic!("a client with the wrong token was let in"),
    };
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refusal must not wait for the timeout"
    );
    assert_eq!(
        error.to_string(),
        format!(
            "the job token was refused by the store at {} (check TANDEM_JOB_TOKEN)",
            server.local_addr()
        )
    );

    // A client that skips the handshake and sends a request gets nothing and changes nothing.
    let mut raw = TcpStream::connect(server.local_addr()).expect("connect raw");
    raw.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut set_request = vec![1u8];
    set_request.extend_from_slice(&3u32.to_le_bytes());
    set_request.extend_from_slice(b"own");
    set_request.extend_from_slice(&1u32.to_le_bytes());
    set_request.push(b'!');
    let mut frame = (set_request.len() as u64).to_le_bytes().to_vec();
    frame.extend_from_slice(&set_request);
    let _ = raw.write_all(&frame);
    let _ = raw.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    // Only the greeting (magic, purpose, nonce) comes back; then the server closes.
    assert_eq!(answer.len(), 41, "unexpected answer {answer:?}");
    assert_eq!(&answer[..9], b"TANDEM01S");
    assert_eq!(good.get("own").expect("get"), None);
    assert_eq!(good.num_keys().expect("count"), 1);
}

#[test]
fn oversized_keys_and_values_are_refused_by_the_client() {
    let (server, token) = start_store();
    let client = StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect");
    let long_key = "k".repeat(MAX_KEY_BYTES + 1);
    assert_eq!(
        client
            .set(&long_key, b"v")
            .expect_err("too long")
            .to_string(),
        format!(
            "key is {} bytes, above the limit of {MAX_KEY_BYTES} bytes",
            MAX_KEY_BYTES + 1
        )
    );
}

#[test]
fn server_survives_garbage_and_early_closes() {
    let (server, token) = start_store();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..40 {
        let mut raw = TcpStream::connect(server.local_addr()).expect("connect raw");
        raw.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let length = (next() % 200) as usize;
        let garbage: Vec<u8> = (0..length).map(|_| next() as u8).collect();
        let _ = raw.write_all(&garbage);
        if round % 2 == 0 {
            // Read the greeting sometimes, then close early.
            let mut greeting = [0u8; 41];
            let _ = raw.read_exact(&mut greeting);
        }
    }
    let client =
        StoreClient::connect(server.local_addr(), &token, TIMEOUT).expect("connect after garbage");
    client.set("alive", b"yes").expect("set");
    assert_eq!(client.get("alive").expect("get"), Some(b"yes".to_vec()));
}

#[test]
fn connect_retries_until_the_store_is_up_and_gives_up_at_the_timeout() {
    let port = tandem_testdata::free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let token = JobToken::generate().expect("token");
    let started = Instant::now();
    let error = match StoreClient::connect(addr, &token, Duration::from_millis(400)) {
        Err(error) => error,
        Ok(_) => panic!("connected to nothing"),
    };
    assert!(
        matches!(error, DistError::StoreUnreachable { .. }),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .starts_with(&format!("could not reach the store at {addr} within 400ms")),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));

    let late_token = token.clone();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        tandem_dist::StoreServer::bind(addr, late_token)
    });
    let client = StoreClient::connect(addr, &token, TIMEOUT).expect("connect once the store is up");
    let _server = starter.join().expect("thread").expect("bind late store");
    client.set("k", b"v").expect("set");
}
