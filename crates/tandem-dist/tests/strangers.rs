//! A stranger who knows a rank's ring port but not the job token: connecting first and
//! trickling a byte now and then (each read of the handshake well within any per-read limit),
//! it delays no rank's rendezvous.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{options, start_store};
use tandem_dist::{ProcessGroup, StoreClient};

const TIMEOUT: Duration = Duration::from_secs(30);

/// Connects to `addr`, reads what the acceptor sends first, then writes one byte every 400 ms
/// until the connection is closed or `stop` passes.
fn trickle(addr: &str, stop: Instant) {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(400)));
    let mut hello = [0u8; 25];
    let _ = stream.read_exact(&mut hello);
    while Instant::now() < stop {
        if stream.write_all(&[0]).is_err() {
            return;
        }
        let mut byte = [0u8; 1];
        if let Ok(0) = stream.read(&mut byte) {
            return;
        }
    }
}

#[test]
fn a_trickling_stranger_on_a_ranks_port_does_not_delay_the_rendezvous() {
    let (server, token) = start_store();
    let store = server.local_addr();
    let client = StoreClient::connect(store, &token, TIMEOUT).expect("store client");
    let stop = Instant::now() + Duration::from_secs(20);
    let started = std::thread::scope(|scope| {
        let rank0 = scope.spawn(|| {
            let mut options = options(0, 2, store, &token, TIMEOUT);
            options.unix_sockets = false;
            ProcessGroup::connect(options)
        });
        // The stranger is on rank 0's port before rank 1 exists, so its connection is the
        // first that rank 0 accepts. (The test reads the port from the store; a stranger
        // would scan for it.)
        client
            .wait(&["pg/addr/0"], TIMEOUT)
            .expect("rank 0's address");
        let addr = String::from_utf8(client.get("pg/addr/0").unwrap().unwrap()).unwrap();
        let stranger = scope.spawn(move || trickle(&addr, stop));
        std::thread::sleep(Duration::from_millis(500));
        let started = Instant::now();
        let rank1 = scope.spawn(|| {
            let mut options = options(1, 2, store, &token, TIMEOUT);
            options.unix_sockets = false;
            ProcessGroup::connect(options)
        });
        let mut groups = [rank0.join().unwrap(), rank1.join().unwrap()]
            .map(|group| group.expect("the rendezvous completes"));
        let formed = started.elapsed();
        std::thread::scope(|inner| {
            for group in &mut groups {
                inner.spawn(move || group.barrier().expect("barrier"));
            }
        });
        assert!(
            formed < Duration::from_secs(3),
            "the rendezvous took {formed:?} with a stranger on rank 0's port"
        );
        stranger.join().unwrap();
        started
    });
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the stranger was not closed once the peer was in"
    );
}
