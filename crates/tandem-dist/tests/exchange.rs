//! Values handed between ranks through the store: rank 0's NCCL unique id and every rank's
//! record, over real store servers on loopback with fake id bytes.

mod common;

use std::time::{Duration, Instant};

use common::{on_rank_threads, start_store};
use tandem_dist::{
    gather_records, nccl_unique_id_key, publish_nccl_unique_id, receive_nccl_unique_id, DistError,
    JobToken, StoreClient, StoreServer, NCCL_UNIQUE_ID_BYTES,
};

const TIMEOUT: Duration = Duration::from_secs(10);

/// A fake NCCL unique id: 128 bytes that differ with `seed`.
fn fake_id(seed: u8) -> Vec<u8> {
    (0..NCCL_UNIQUE_ID_BYTES)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn client(server: &StoreServer, token: &JobToken) -> StoreClient {
    StoreClient::connect(server.local_addr(), token, TIMEOUT).expect("connect to the store")
}

/// Runs rank 0 (publishing `id`) and ranks 1.. (receiving) of one round, each with its own
/// connection, and returns the id every rank ends with.
fn exchange(
    server: &StoreServer,
    token: &JobToken,
    prefix: &str,
    world_size: usize,
    id: &[u8],
) -> Vec<Vec<u8>> {
    on_rank_threads(world_size, |rank| {
        let store = client(server, token);
        if rank == 0 {
            publish_nccl_unique_id(&store, prefix, id).expect("publish");
            id.to_vec()
        } else {
            receive_nccl_unique_id(&store, prefix, TIMEOUT)
                .expect("receive")
                .to_vec()
        }
    })
}

#[test]
fn every_rank_gets_rank_0s_id_for_one_to_four_ranks() {
    for world_size in 1..=4 {
        let (server, token) = start_store();
        let id = fake_id(world_size as u8);
        let received = exchange(&server, &token, "round0/pg", world_size, &id);
        assert_eq!(received.len(), world_size);
        for (rank, bytes) in received.iter().enumerate() {
            assert_eq!(bytes, &id, "rank {rank} of {world_size}");
        }
    }
}

#[test]
fn a_value_of_the_wrong_length_is_a_named_error() {
    let (server, token) = start_store();
    let store = client(&server, &token);
    let key = nccl_unique_id_key("round0/pg");
    assert_eq!(key, "round0/pg/nccl/unique_id");
    store.set(&key, &[7; 127]).unwrap();
    match receive_nccl_unique_id(&store, "round0/pg", TIMEOUT) {
        Err(error @ DistError::BadValue { .. }) => assert_eq!(
            error.to_string(),
            "store key \"round0/pg/nccl/unique_id\" holds a bad value: an NCCL unique id is 128 \
             bytes, this one is 127"
        ),
        other => panic!("expected a bad value, got {other:?}"),
    }
    // Rank 0 refuses to publish one too.
    let error = publish_nccl_unique_id(&store, "round1/pg", &[0; 129]).unwrap_err();
    assert!(error.to_string().ends_with("this one is 129"), "{error}");
    assert_eq!(store.get(&nccl_unique_id_key("round1/pg")).unwrap(), None);
}

#[test]
fn a_rank_0_that_never_publishes_ends_the_wait_within_the_timeout_naming_it() {
    let (server, token) = start_store();
    let store = client(&server, &token);
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let error = receive_nccl_unique_id(&store, "round0/pg", timeout).unwrap_err();
    let waited = start.elapsed();
    assert!(waited >= timeout, "gave up after {waited:?}");
    assert!(
        waited < timeout + Duration::from_secs(3),
        "waited {waited:?}"
    );
    match &error {
        DistError::NotPublished { ranks, keys, .. } => {
            assert_eq!(ranks, &[0]);
            assert_eq!(keys, &["round0/pg/nccl/unique_id".to_string()]);
        }
        other => panic!("expected a missing id, got {other:?}"),
    }
    assert_eq!(
        error.to_string(),
        "rank 0 did not publish the NCCL unique id within 300ms (store keys \
         [\"round0/pg/nccl/unique_id\"] still missing)"
    );
}

#[test]
fn an_id_of_an_earlier_restart_round_is_never_picked_up() {
    let (server, token) = start_store();
    let old_id = fake_id(1);
    let new_id = fake_id(2);
    // Round 0 exchanged its id, then failed; its key stays in the store.
    assert!(exchange(&server, &token, "round0/pg", 2, &old_id)
        .iter()
        .all(|id| id == &old_id));
    // A rank of round 1 that comes before its rank 0 does not take round 0's id...
    let store = client(&server, &token);
    let error = receive_nccl_unique_id(&store, "round1/pg", Duration::from_millis(200));
    assert!(
        matches!(&error, Err(DistError::NotPublished { ranks, .. }) if ranks == &[0]),
        "{error:?}"
    );
    // ...and once round 1's rank 0 publishes, every rank gets the new one.
    let received = exchange(&server, &token, "round1/pg", 3, &new_id);
    assert!(received.iter().all(|id| id == &new_id), "{received:?}");
    assert_ne!(old_id, new_id);
}

#[test]
fn a_second_rank_0_in_the_same_round_is_refused() {
    let (server, token) = start_store();
    let store = client(&server, &token);
    publish_nccl_unique_id(&store, "round0/pg", &fake_id(1)).unwrap();
    let error = publish_nccl_unique_id(&store, "round0/pg", &fake_id(2)).unwrap_err();
    assert!(
        error.to_string().contains("two processes claim rank 0"),
        "{error}"
    );
    // The first id stays.
    assert_eq!(
        receive_nccl_unique_id(&store, "round0/pg", TIMEOUT)
            .unwrap()
            .to_vec(),
        fake_id(1)
    );
}

#[test]
fn records_are_gathered_in_rank_order_and_missing_ranks_are_named() {
    let (server, token) = start_store();
    let world_size = 3;
    let gathered = on_rank_threads(world_size, |rank| {
        let store = client(&server, &token);
        let record = format!("rank {rank} on cuda:{rank}");
        gather_records(
            &store,
            "round0/pg",
            "device",
            rank,
            world_size,
            record.as_bytes(),
            TIMEOUT,
        )
        .expect("gather")
    });
    let expected: Vec<Vec<u8>> = (0..world_size)
        .map(|rank| format!("rank {rank} on cuda:{rank}").into_bytes())
        .collect();
    assert!(gathered.iter().all(|records| records == &expected));

    // Ranks 1 and 3 of a new round never come.
    let store = client(&server, &token);
    let rank_2 = client(&server, &token);
    rank_2.set("round1/pg/device/2", b"here").unwrap();
    let error = gather_records(
        &store,
        "round1/pg",
        "device",
        0,
        4,
        b"rank 0",
        Duration::from_millis(200),
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("ranks 1, 3 did not publish the device within 200ms"),
        "{error}"
    );
}
