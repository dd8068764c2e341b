//! A store replicated on three replicas: it outlives its leader, a write is applied once
//! however often a failover makes the client send it, a replica cut off in a minority
//! answers nothing, and a replica that fell far behind catches up from a keyspace image.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tandem_dist::{
    DistError, JobToken, ProcessGroup, ProcessGroupOptions, ReduceOp, ReplicaStart, StoreClient,
    StoreLimits, StoreReplica,
};

/// The bound on every wait of these tests.
const LIMIT: Duration = Duration::from_secs(20);

fn token() -> JobToken {
    JobToken::new("replicated").expect("token")
}

/// `count` started replicas on free loopback ports, and their addresses.
fn replicas(count: usize) -> (Vec<Option<StoreReplica>>, Vec<SocketAddr>) {
    let mut replicas: Vec<StoreReplica> = (0..count)
        .map(|_| {
            StoreReplica::bind(
                "127.0.0.1:0".parse().expect("addr"),
                token(),
                StoreLimits::default(),
            )
            .expect("bind")
        })
        .collect();
    let addrs: Vec<SocketAddr> = replicas.iter().map(StoreReplica::local_addr).collect();
    for (index, replica) in replicas.iter_mut().enumerate() {
        replica.start(&addrs, index).expect("start");
    }
    (replicas.into_iter().map(Some).collect(), addrs)
}

/// A replica bound to `addr` again once the one dropped there let go of it (within
/// [`LIMIT`]): its host started again.
fn bind_again(addr: SocketAddr) -> StoreReplica {
    let started = Instant::now();
    loop {
        match StoreReplica::bind(addr, token(), StoreLimits::default()) {
            Ok(replica) => return replica,
            Err(error) => assert!(started.elapsed() < LIMIT, "bind {addr} again: {error}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn client(addrs: &[SocketAddr], timeout: Duration) -> StoreClient {
    StoreClient::connect_replicated(addrs, &token(), timeout).expect("connect")
}

/// The index of the replica that leads, once one does.
fn leader(replicas: &[Option<StoreReplica>]) -> usize {
    let started = Instant::now();
    loop {
        let leading: Vec<usize> = (0..replicas.len())
            .filter(|&index| {
                replicas[index]
                    .as_ref()
                    .is_some_and(StoreReplica::is_leader)
            })
            .collect();
        if let [one] = leading[..] {
            return one;
        }
        assert!(started.elapsed() < LIMIT, "no single leader: {leading:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Cuts the links between replica `alone` and every other one, or heals them all.
fn partition(replicas: &[Option<StoreReplica>], alone: Option<usize>) {
    for (index, replica) in replicas.iter().enumerate() {
        let Some(replica) = replica else { continue };
        let cut: Vec<usize> = match alone {
            Some(alone) if alone == index => (0..replicas.len()).filter(|&i| i != alone).collect(),
            Some(alone) => vec![alone],
            None => Vec::new(),
        };
        replica.cut_links_to(&cut);
    }
}

#[test]
fn the_store_outlives_its_leader_and_applies_each_write_once() {
    let (mut replicas, addrs) = replicas(3);
    let store = client(&addrs, LIMIT);
    store.set("membership", b"epoch 1").expect("set");
    for _ in 0..10 {
        store.add("steps", 1).expect("add");
    }
    let first = leader(&replicas);
    replicas[first] = None;
    let killed = Instant::now();
    // The client moves to the new leader by itself; nothing written is lost or doubled.
    assert_eq!(store.add("steps", 1).expect("add after the loss"), 11);
    let failover = killed.elapsed();
    assert_eq!(
        store.get("membership").expect("get"),
        Some(b"epoch 1".to_vec())
    );
    let second = leader(&replicas);
    assert_ne!(first, second);
    assert!(failover < Duration::from_secs(5), "{failover:?}");
    eprintln!("a write waited {failover:?} for a new leader");
    // A wait started now is answered by the new leader.
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| client(&addrs, LIMIT).wait(&["late"], LIMIT));
        std::thread::sleep(Duration::from_millis(200));
        store.set("late", b"1").expect("set");
        waiting.join().expect("wait thread").expect("wait");
    });
}

#[test]
fn a_replica_cut_off_alone_answers_nothing_and_rejoins_when_the_partition_heals() {
    let (replicas, addrs) = replicas(3);
    let store = client(&addrs, LIMIT);
    store.set("step", b"1").expect("set");
    let old = leader(&replicas);
    partition(&replicas, Some(old));
    // A client that reaches only the cut-off replica gets no answer, whatever it asks.
    let cut_off = client(&addrs[old..=old], Duration::from_secs(4));
    let refused = cut_off.set("step", b"minority");
    assert!(
        matches!(&refused, Err(DistError::Store { message, .. })
            if message.starts_with("no answer within 4s; the last try: ")),
        "{refused:?}"
    );
    assert!(cut_off.get("step").is_err());
    // The majority goes on under a new leader.
    store.set("step", b"2").expect("set in the majority");
    let new = leader(&replicas);
    assert_ne!(old, new);
    partition(&replicas, None);
    // Healed, the old leader is a member again: with the new leader's help it forms the
    // majority that the third replica's loss leaves.
    store.set("step", b"3").expect("set after healing");
    let third = (0..3).find(|&index| index != old && index != new);
    let mut replicas = replicas;
    if let Some(third) = third {
        replicas[third] = None;
    }
    assert_eq!(store.get("step").expect("get"), Some(b"3".to_vec()));
    store
        .set("step", b"4")
        .expect("set on the two that are left");
}

#[test]
fn a_replica_that_fell_far_behind_catches_up_from_the_leaders_image() {
    let (replicas, addrs) = replicas(3);
    let store = client(&addrs, LIMIT);
    store.set("first", b"kept").expect("set");
    let lead = leader(&replicas);
    let behind = (lead + 1) % 3;
    let other = (lead + 2) % 3;
    partition(&replicas, Some(behind));
    // Enough writes that the leader compacts its log past what the lagging replica has.
    for step in 0..5000 {
        store.set("step", step.to_string().as_bytes()).expect("set");
    }
    partition(&replicas, None);
    std::thread::sleep(Duration::from_secs(2));
    let mut replicas = replicas;
    replicas[other] = None;
    // The leader and the replica that was behind are the majority now.
    assert_eq!(store.get("step").expect("get"), Some(b"4999".to_vec()));
    assert_eq!(store.get("first").expect("get"), Some(b"kept".to_vec()));
    store.set("after", b"1").expect("set");
}

#[test]
fn a_replica_started_again_empty_catches_up_and_counts_in_the_majority() {
    let (mut replicas, addrs) = replicas(3);
    let store = client(&addrs, LIMIT);
    store.set("first", b"kept").expect("set");
    // A follower: the leader remembers how far its log reached.
    let lost = (leader(&replicas) + 1) % 3;
    replicas[lost] = None;
    for step in 0..50 {
        store.set("step", step.to_string().as_bytes()).expect("set");
    }
    // Its host started again: a replica at the same address, with nothing of the old one.
    let mut again = bind_again(addrs[lost]);
    again.start(&addrs, lost).expect("start");
    replicas[lost] = Some(again);
    store.set("after", b"1").expect("set");
    std::thread::sleep(Duration::from_secs(1));
    // Each of the two others in turn leaves it in a majority of two.
    let others: Vec<usize> = (0..3).filter(|&index| index != lost).collect();
    partition(&replicas, Some(others[0]));
    assert_eq!(store.get("step").expect("get"), Some(b"49".to_vec()));
    assert_eq!(store.get("first").expect("get"), Some(b"kept".to_vec()));
    partition(&replicas, None);
    partition(&replicas, Some(others[1]));
    store
        .set("last", b"2")
        .expect("set without the second other");
    assert_eq!(store.get("after").expect("get"), Some(b"1".to_vec()));
}

#[test]
fn a_replica_started_again_behind_votes_for_nobody_until_it_caught_up_so_no_write_is_lost() {
    let (mut replicas, addrs) = replicas(3);
    let store = client(&addrs, LIMIT);
    store.set("first", b"kept").expect("set");
    let lead = leader(&replicas);
    let (helper, lagging) = ((lead + 1) % 3, (lead + 2) % 3);
    // A write that only the leader and `helper` hold.
    partition(&replicas, Some(lagging));
    store
        .set("only-on-two", b"1")
        .expect("set without the lagging replica");
    // `helper`'s host starts again, away from the leader, and then the leader's host dies.
    replicas[helper] = None;
    let mut again = bind_again(addrs[helper]);
    again.cut_links_to(&[lead]);
    let behind = ReplicaStart {
        ballot: None,
        behind: true,
    };
    again.start_with(&addrs, helper, &behind).expect("start");
    replicas[helper] = Some(again);
    replicas[lead] = None;
    replicas[lagging]
        .as_ref()
        .expect("the lagging replica")
        .cut_links_to(&[lead]);
    // The lagging replica would lead without the write, had the other voted for it.
    let short = client(&addrs, Duration::from_secs(3));
    match short.get("only-on-two") {
        Ok(value) => panic!("the store answered {value:?} without the leader"),
        Err(error) => assert!(error.to_string().contains("no replica"), "{error}"),
    }
}

#[test]
fn a_replica_started_again_behind_catches_up_then_votes_and_keeps_its_ballot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ballot = |index: usize| dir.path().join(format!("ballot-{index}"));
    let mut replicas: Vec<Option<StoreReplica>> = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let replica = StoreReplica::bind(
            "127.0.0.1:0".parse().expect("addr"),
            token(),
            StoreLimits::default(),
        )
        .expect("bind");
        addrs.push(replica.local_addr());
        replicas.push(Some(replica));
    }
    for (index, replica) in replicas.iter_mut().enumerate() {
        let how = ReplicaStart {
            ballot: Some(ballot(index)),
            behind: false,
        };
        let replica = replica.as_mut().expect("replica");
        replica.start_with(&addrs, index, &how).expect("start");
    }
    let store = client(&addrs, LIMIT);
    store.set("first", b"kept").expect("set");
    let lead = leader(&replicas);
    let recorded = std::fs::read_to_string(ballot(lead)).expect("the leader's ballot");
    let id = lead + 1;
    assert!(
        recorded.ends_with(&format!("\nvote {id}\n")),
        "{recorded:?}"
    );
    // A follower's host starts again behind; it catches up, and then counts in a majority
    // without the other follower, for writes and for an election after the leader's loss.
    let lost = (lead + 1) % 3;
    replicas[lost] = None;
    store.set("while-away", b"1").expect("set");
    let mut again = bind_again(addrs[lost]);
    let behind = ReplicaStart {
        ballot: Some(ballot(lost)),
        behind: true,
    };
    again.start_with(&addrs, lost, &behind).expect("start");
    replicas[lost] = Some(again);
    store.set("back", b"1").expect("set");
    std::thread::sleep(Duration::from_millis(500));
    replicas[lead] = None;
    // Two replicas are left: neither leads without the other's vote.
    let winner = leader(&replicas);
    assert_eq!(store.get("while-away").expect("get"), Some(b"1".to_vec()));
    assert_eq!(store.get("back").expect("get"), Some(b"1".to_vec()));
    let voter = [lost, (lead + 2) % 3]
        .into_iter()
        .find(|&index| index != winner)
        .expect("the other replica");
    let ballots = [ballot(winner), ballot(voter)].map(|path| {
        let text = std::fs::read_to_string(path).expect("ballot");
        text.lines().map(str::to_string).collect::<Vec<_>>()
    });
    assert_eq!(ballots[0][1], ballots[1][1], "one term: {ballots:?}");
    assert_eq!(ballots[1][2], format!("vote {}", winner + 1), "{ballots:?}");
}

#[test]
fn a_process_group_forms_and_keeps_its_store_through_the_loss_of_the_stores_leader() {
    let (replicas, addrs) = replicas(3);
    let replicas = std::sync::Mutex::new(replicas);
    let lost_leader = std::sync::Barrier::new(3);
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (addrs, lost_leader) = (&addrs, &lost_leader);
                scope.spawn(move || {
                    let mut options = ProcessGroupOptions::new(rank, 2, "unused", 0, token());
                    options.store_replicas = addrs.clone();
                    options.timeout = LIMIT;
                    options.advertise_host = Some("127.0.0.1".into());
                    let mut group = ProcessGroup::connect(options).expect("connect");
                    let mut sum = [rank as f32 + 1.0];
                    group.all_reduce_f32(&mut sum, ReduceOp::Sum).expect("sum");
                    lost_leader.wait();
                    // The group's store requests move to the new leader; the ring is untouched.
                    let key = format!("after/{rank}");
                    group.store().set(&key, b"1").expect("set after the loss");
                    group
                        .store()
                        .wait(&["after/0", "after/1"], LIMIT)
                        .expect("wait");
                    group.all_reduce_f32(&mut sum, ReduceOp::Sum).expect("sum");
                    sum[0]
                })
            })
            .collect();
        let first = leader(&replicas.lock().expect("replicas"));
        replicas.lock().expect("replicas")[first] = None;
        lost_leader.wait();
        for rank in ranks {
            assert_eq!(rank.join().expect("rank"), 6.0);
        }
    });
}

#[test]
fn a_heartbeat_that_reaches_no_majority_says_so_once_after_the_cut_off_bound() {
    use std::sync::{Arc, Mutex};
    use tandem_dist::heartbeat::{heartbeat_key, Heartbeat, CUT_OFF_AFTER};

    let (mut replicas, addrs) = replicas(3);
    let observer = client(&addrs, LIMIT);
    let heartbeat = Heartbeat::start(
        client(&addrs, LIMIT),
        "job/r0",
        1,
        Duration::from_millis(10),
    );
    let heard = Arc::new(Mutex::new(Vec::<(bool, Instant)>::new()));
    let (told, interrupted) = (Arc::clone(&heard), Arc::new(Mutex::new(0)));
    heartbeat.on_store_cut(Box::new(move |cut| {
        told.lock().expect("heard").push((cut, Instant::now()));
    }));
    let counted = Arc::clone(&interrupted);
    heartbeat.add_interrupt(Box::new(move |_| *counted.lock().expect("count") += 1));
    let key = heartbeat_key("job/r0", 1);
    let started = Instant::now();
    while observer.add(&key, 0).expect("read the beat") < 3 {
        assert!(started.elapsed() < LIMIT, "the heartbeat never beat");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Two of three replicas gone: the one left leads nothing and answers nothing.
    let lead = leader(&replicas);
    replicas[lead] = None;
    replicas[(lead + 1) % 3] = None;
    let cut = Instant::now();
    while heard.lock().expect("heard").is_empty() {
        assert!(
            cut.elapsed() < LIMIT,
            "the heartbeat never said it was cut off"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    drop(heartbeat);
    let heard = heard.lock().expect("heard").clone();
    assert_eq!(heard.len(), 1, "{heard:?}");
    assert!(heard[0].0, "the first word is the cut");
    let waited = heard[0].1 - cut;
    // The last answer came at most one beat interval before the replicas went.
    assert!(
        waited + Duration::from_millis(50) >= CUT_OFF_AFTER,
        "{waited:?}"
    );
    assert!(waited < CUT_OFF_AFTER * 3, "{waited:?}");
    assert_eq!(
        *interrupted.lock().expect("count"),
        0,
        "a cut breaks no collective"
    );
}
