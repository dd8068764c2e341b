//! Helpers shared by the integration tests: a store on a free port and ranks run as threads.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use tandem_dist::{JobToken, ProcessGroup, ProcessGroupOptions, StoreServer};

/// A store on 127.0.0.1 with a free port, and the token it accepts.
pub fn start_store() -> (StoreServer, JobToken) {
    let token = JobToken::generate().expect("random token");
    let server = StoreServer::bind("127.0.0.1:0".parse().expect("address"), token.clone())
        .expect("bind store");
    (server, token)
}

/// Options for `rank` of a group whose store is already running at `store`.
pub fn options(
    rank: usize,
    world_size: usize,
    store: SocketAddr,
    token: &JobToken,
    timeout: Duration,
) -> ProcessGroupOptions {
    let mut options =
        ProcessGroupOptions::new(rank, world_size, "127.0.0.1", store.port(), token.clone());
    options.host_store = false;
    options.timeout = timeout;
    options.advertise_host = Some("127.0.0.1".into());
    options
}

/// Runs `body` on every rank of a fresh group of `world_size` threads (linked by Unix
/// sockets, as ranks of one host are) and returns the results in rank order.
pub fn run_ranks<T: Send>(
    world_size: usize,
    timeout: Duration,
    segment_bytes: usize,
    body: impl Fn(&mut ProcessGroup) -> T + Sync,
) -> Vec<T> {
    run_groups(world_size, timeout, segment_bytes, |mut group| {
        body(&mut group)
    })
}

/// Like [`run_ranks`], but `body` owns its rank's group.
pub fn run_groups<T: Send>(
    world_size: usize,
    timeout: Duration,
    segment_bytes: usize,
    body: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    run_groups_over(true, world_size, timeout, segment_bytes, body)
}

/// Runs `body` on owned groups, with or without Unix sockets, and checks the transport used.
pub fn run_groups_over<T: Send>(
    unix_sockets: bool,
    world_size: usize,
    timeout: Duration,
    segment_bytes: usize,
    body: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    let (server, token) = start_store();
    let store = server.local_addr();
    on_rank_threads(world_size, |rank| {
        let mut options = options(rank, world_size, store, &token, timeout);
        options.segment_bytes = segment_bytes;
        options.unix_sockets = unix_sockets;
        let group = ProcessGroup::connect(options).expect("join the group");
        let expected = match (world_size, unix_sockets) {
            (1, _) => "none",
            (_, true) => "unix",
            (_, false) => "tcp",
        };
        assert_eq!(group.ring_transport(), expected);
        body(group)
    })
}

/// Runs `body(rank)` for ranks `0..ranks`, each on a thread of its own, and returns the
/// results in rank order.
pub fn on_rank_threads<T: Send>(ranks: usize, body: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|scope| {
        let body = &body;
        let handles: Vec<_> = (0..ranks)
            .map(|rank| scope.spawn(move || body(rank)))
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("rank thread panicked"))
            .collect()
    })
}

/// A deterministic, rank-dependent test value with a fractional part.
pub fn value(rank: usize, index: usize) -> f64 {
    let mixed = (rank as u64 * 7919 + index as u64 * 104_729 + 13) % 2003;
    mixed as f64 / 8.0 - 120.0
}
