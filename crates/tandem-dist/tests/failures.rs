//! Failures: a killed process, a stalled rank, a rank that never arrives, mismatched calls.
//! Every live rank must end with an error naming the failed rank, within the test's timeout.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{on_rank_threads, options, run_groups, start_store};
use tandem_dist::{
    DistError, JobToken, ProcessGroup, ReduceOp, StoreClient, DEFAULT_SEGMENT_BYTES,
};

/// Set in child processes: "rank,world_size,store_port,token,transport".
const CHILD_ENV: &str = "TANDEM_DIST_TEST_CHILD";
const TIMEOUT: Duration = Duration::from_secs(5);
/// Allowance for thread scheduling on a loaded two-core machine.
const MARGIN: Duration = Duration::from_millis(1500);
const CHILD_NUMEL: usize = 1 << 20;

fn child_values(rank: usize) -> Vec<f32> {
    (0..CHILD_NUMEL)
        .map(|i| ((i * 31 + rank * 7) % 1000) as f32 * 0.25)
        .collect()
}

fn checksum(values: &[f32]) -> String {
    let hash = bytemuck::cast_slice::<f32, u8>(values)
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
            (hash ^ *byte as u64).wrapping_mul(0x100_0000_01b3)
        });
    format!("{hash:016x}")
}

/// What carries the data of the all-reduces in the killed-process test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    Unix,
    Tcp,
    SharedMemory,
}

impl Transport {
    fn parse(name: &str) -> Transport {
        match name {
            "Unix" => Transport::Unix,
            "Tcp" => Transport::Tcp,
            "SharedMemory" => Transport::SharedMemory,
            other => panic!("unknown transport {other}"),
        }
    }

    fn apply(self, options: &mut tandem_dist::ProcessGroupOptions) {
        options.unix_sockets = self != Transport::Tcp;
        options.shared_memory = self == Transport::SharedMemory;
    }
}

/// All-reduces `values` through the ring or through a shared buffer.
struct Reducer {
    shared: Option<tandem_dist::SharedBuffer<f32>>,
}

impl Reducer {
    fn new(group: &mut ProcessGroup, transport: Transport) -> Reducer {
        let shared = (transport == Transport::SharedMemory).then(|| {
            let buffer = group.shared_buffer(CHILD_NUMEL).expect("shared buffer");
            assert!(buffer.is_shared(), "{:?}", group.shared_memory_refusal());
            buffer
        });
        Reducer { shared }
    }

    fn all_reduce(
        &mut self,
        group: &mut ProcessGroup,
        values: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), DistError> {
        let Some(shared) = &mut self.shared else {
            return group.all_reduce_f32(values, op);
        };
        shared.copy_from_slice(values);
        group.all_reduce_shared(shared, op)?;
        values.copy_from_slice(shared);
        Ok(())
    }
}

/// One all-reduce whose checksum goes to the store, a "ready" key, then all-reduces until one
/// fails. Returns the failure and when it happened.
fn ready_then_loop(group: &mut ProcessGroup, transport: Transport) -> (DistError, Instant) {
    let mut reducer = Reducer::new(group, transport);
    let mut values = child_values(group.rank());
    reducer
        .all_reduce(group, &mut values, ReduceOp::Sum)
        .expect("first all_reduce");
    let rank = group.rank();
    group
        .store()
        .set(&format!("checksum/{rank}"), checksum(&values).as_bytes())
        .expect("publish checksum");
    group
        .store()
        .set(&format!("ready/{rank}"), b"1")
        .expect("publish ready");
    for _ in 0..100_000 {
        if let Err(error) = reducer.all_reduce(group, &mut values, ReduceOp::Max) {
            return (error, Instant::now());
        }
    }
    panic!("rank {rank}: the all-reduces never failed");
}

#[test]
#[ignore = "entry point of the child process that killed_process_during_all_reduce_is_named_on_every_rank spawns"]
fn child_rank_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let fields: Vec<&str> = spec.split(',').collect();
    let [rank, world_size, port, token, transport] = fields[..] else {
        panic!("bad {CHILD_ENV}: {spec}")
    };
    let token = JobToken::new(token).expect("token");
    let store = format!("127.0.0.1:{port}").parse().expect("store address");
    let mut options = options(
        rank.parse().expect("rank"),
        world_size.parse().expect("world size"),
        store,
        &token,
        TIMEOUT,
    );
    let transport = Transport::parse(transport);
    transport.apply(&mut options);
    let mut group = ProcessGroup::connect(options).expect("child joins");
    ready_then_loop(&mut group, transport);
}

/// Kills the child when the test ends, whatever happens.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn killed_process_during_all_reduce_is_named_on_every_rank() {
    killed_process_is_named(Transport::Unix);
    killed_process_is_named(Transport::Tcp);
    killed_process_is_named(Transport::SharedMemory);
}

fn killed_process_is_named(transport: Transport) {
    let (server, token) = start_store();
    let store = server.local_addr();
    let world_size = 3;
    let child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "child_rank_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            CHILD_ENV,
            format!(
                "2,{world_size},{},{},{transport:?}",
                store.port(),
                token.expose_secret()
            ),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child rank");
    let mut child = KillOnDrop(child);
    let observer = StoreClient::connect(store, &token, TIMEOUT).expect("observer");

    let (outcomes, killed_at) = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let mut options = options(rank, world_size, store, &token, TIMEOUT);
                transport.apply(&mut options);
                scope.spawn(move || {
                    let mut group = ProcessGroup::connect(options).expect("join");
                    let expected = if transport == Transport::Tcp {
                        "tcp"
                    } else {
                        "unix"
                    };
                    assert_eq!(group.ring_transport(), expected);
                    ready_then_loop(&mut group, transport)
                })
            })
            .collect();
        observer
            .wait(&["ready/0", "ready/1", "ready/2"], Duration::from_secs(30))
            .expect("all ranks ready");
        std::thread::sleep(Duration::from_millis(200));
        child.0.kill().expect("kill child");
        let killed_at = Instant::now();
        let outcomes: Vec<_> = ranks
            .into_iter()
            .map(|rank| rank.join().expect("rank thread"))
            .collect();
        (outcomes, killed_at)
    });

    // The first all-reduce crossed processes and gave the same bytes on every rank.
    let checksums: Vec<Vec<u8>> = (0..3)
        .map(|rank| {
            observer
                .get(&format!("checksum/{rank}"))
                .expect("get")
                .expect("checksum set")
        })
        .collect();
    assert_eq!(checksums[0], checksums[1]);
    assert_eq!(checksums[0], checksums[2]);

    for (rank, (error, failed_at)) in outcomes.iter().enumerate() {
        let message = error.to_string();
        eprintln!(
            "{transport:?}: rank {rank} after {:?}: {message}",
            failed_at.saturating_duration_since(killed_at)
        );
        // Through shared memory only the small synchronizing steps use the ring.
        let during = match transport {
            Transport::SharedMemory => "closed the connection during all_reduce_shared (its ",
            _ => "closed the connection during all_reduce #",
        };
        assert!(
            message.contains("rank 2 (127.0.0.1:") && message.contains(during),
            "{transport:?}: rank {rank}: {message}"
        );
        let after_kill = failed_at.saturating_duration_since(killed_at);
        assert!(
            after_kill < TIMEOUT + MARGIN,
            "rank {rank} took {after_kill:?} to fail"
        );
    }
}

/// Rank `rank` of a group over TCP through the store at `store`, its collectives bounded by
/// `timeout`. Joining is not what is timed: it gets a bound a loaded machine keeps.
fn tcp_group(
    rank: usize,
    world_size: usize,
    (store, token): (std::net::SocketAddr, &JobToken),
    timeout: Duration,
) -> ProcessGroup {
    let mut options = options(rank, world_size, store, token, Duration::from_secs(30));
    options.unix_sockets = false;
    let mut group = ProcessGroup::connect(options).expect("join");
    group.set_timeout(timeout);
    group
}

#[test]
fn stalled_rank_is_named_by_every_waiting_rank() {
    let (server, token) = start_store();
    let store = server.local_addr();
    let world_size = 3;
    let timeout = Duration::from_millis(1500);
    let outcomes = on_rank_threads(world_size, |rank| {
        let mut group = tcp_group(rank, world_size, (store, &token), timeout);
        if rank == 2 {
            // Joins, then never takes part; leaves after the others gave up.
            std::thread::sleep(timeout * 2);
            return None;
        }
        let started = Instant::now();
        let mut values = vec![1.0f32; 1000];
        let error = group
            .all_reduce_f32(&mut values, ReduceOp::Sum)
            .expect_err("must fail");
        Some((error, started.elapsed()))
    });
    for (rank, outcome) in outcomes.iter().enumerate().take(2) {
        let Some((error, elapsed)) = outcome else {
            panic!("rank {rank} did not fail")
        };
        let message = error.to_string();
        eprintln!("rank {rank} after {elapsed:?}: {message}");
        assert!(
            message.contains("rank 2 (127.0.0.1:") && message.contains("during all_reduce #1"),
            "rank {rank}: {message}"
        );
        assert!(
            *elapsed < timeout + MARGIN + Duration::from_secs(1),
            "rank {rank} took {elapsed:?}"
        );
    }
}

#[test]
fn rank_that_never_arrives_fails_the_rendezvous_naming_it() {
    let (server, token) = start_store();
    let store = server.local_addr();
    let timeout = Duration::from_millis(800);
    let outcomes = on_rank_threads(2, |rank| {
        let options = options(rank, 3, store, &token, timeout);
        let started = Instant::now();
        let error = ProcessGroup::connect(options)
            .err()
            .expect("rendezvous must fail");
        (error, started.elapsed())
    });
    for (error, elapsed) in outcomes {
        assert_eq!(
            error.to_string(),
            "rendezvous failed: rank(s) [2] of 3 did not join within 800ms"
        );
        assert!(elapsed < timeout + MARGIN, "took {elapsed:?}");
    }
}

#[test]
fn mismatched_lengths_fail_on_every_rank_and_poison_the_group() {
    let outcomes = run_groups(2, TIMEOUT, DEFAULT_SEGMENT_BYTES, |mut group| {
        let mut values = vec![1.0f32; 10 + group.rank() * 2];
        let first = group
            .all_reduce_f32(&mut values, ReduceOp::Sum)
            .expect_err("lengths differ");
        let second = group.barrier().expect_err("group is poisoned");
        (first.to_string(), second)
    });
    for (rank, (first, second)) in outcomes.iter().enumerate() {
        assert!(
            first.contains("where")
                && first.contains("bytes")
                && first.contains("the ranks disagree on the buffer's length"),
            "rank {rank}: {first}"
        );
        assert!(
            matches!(second, DistError::GroupFailed(_)),
            "rank {rank}: {second}"
        );
    }
}

#[test]
fn wrong_world_size_is_refused_at_rendezvous() {
    let (server, token) = start_store();
    let store = server.local_addr();
    let first = ProcessGroup::connect(options(0, 1, store, &token, TIMEOUT)).expect("world of one");
    let error = ProcessGroup::connect(options(1, 2, store, &token, TIMEOUT))
        .err()
        .expect("must refuse");
    assert_eq!(
        error.to_string(),
        "invalid argument: rank 1 has world size 2 but the group was started with world size 1"
    );
    drop(first);
}

#[test]
fn abort_fails_the_other_ranks_at_once_with_the_reason() {
    let outcomes = run_groups(3, TIMEOUT, DEFAULT_SEGMENT_BYTES, |mut group| {
        if group.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            group.abort("the loss is NaN");
            return None;
        }
        let started = Instant::now();
        let error = group.barrier().expect_err("must fail");
        Some((error.to_string(), started.elapsed()))
    });
    for (rank, outcome) in outcomes.iter().enumerate() {
        let Some((message, elapsed)) = outcome else {
            continue;
        };
        assert!(
            message == "barrier #1 aborted because rank 1 gave up: the loss is NaN",
            "rank {rank}: {message}"
        );
        assert!(
            *elapsed < Duration::from_secs(2),
            "rank {rank} took {elapsed:?}"
        );
    }
}

#[test]
fn a_broken_ring_fails_a_collective_blocked_on_a_silent_rank_at_once() {
    let (server, token) = start_store();
    let store = server.local_addr();
    let world_size = 3;
    let timeout = Duration::from_secs(60);
    let outcomes = on_rank_threads(world_size, |rank| {
        let mut group = tcp_group(rank, world_size, (store, &token), timeout);
        if rank == 2 {
            // Joins, then never takes part, as a peer whose link went down.
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        let breaker = group.ring_breaker().expect("breaker");
        let started = Instant::now();
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            breaker.break_ring("the test broke the ring");
        });
        let mut values = vec![1.0f32; 1000];
        let error = group
            .all_reduce_f32(&mut values, ReduceOp::Sum)
            .expect_err("a broken ring must fail the collective");
        let elapsed = started.elapsed();
        waker.join().expect("waker");
        let again = group.all_reduce_f32(&mut values, ReduceOp::Sum);
        Some((error, elapsed, again.is_err()))
    });
    for (rank, outcome) in outcomes.iter().enumerate().take(2) {
        let Some((error, elapsed, later_failed)) = outcome else {
            panic!("rank {rank} did not fail")
        };
        eprintln!("rank {rank} after {elapsed:?}: {error}");
        assert!(
            matches!(error, DistError::Peer { .. } | DistError::Aborted { .. }),
            "rank {rank}: {error:?}"
        );
        // Far below the 60 s collective timeout: the wait ended when the ring broke.
        assert!(
            *elapsed < Duration::from_secs(10),
            "rank {rank} took {elapsed:?}"
        );
        assert!(
            later_failed,
            "rank {rank}: a later collective must fail too"
        );
    }
}
