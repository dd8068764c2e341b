//! `tandem train` workers placed as `tandem launch` places them on a replicated store
//! (`TANDEM_STORE_REPLICAS`): they form their group through the store's replicas, and finish
//! their run though the store's leader is lost while they train.
//!
//! Every worker runs in its own process group, which a failing test kills whole, and every
//! wait is bounded.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::scheduler::*;
use common::*;
use tandem_dist::cluster::contract::{store_prefix, STORE_REPLICAS_ENV};
use tandem_dist::heartbeat::{heartbeat_key, ENDED};
use tandem_dist::{JobToken, StoreClient, StoreLimits, StoreReplica};

/// The job token of the test's store and workers.
const TOKEN: &str = "store-replicas-test";

/// Three started replicas of a store on loopback, and their addresses.
fn started_replicas() -> (Vec<Option<StoreReplica>>, Vec<SocketAddr>) {
    let token = JobToken::new(TOKEN).unwrap();
    let mut replicas: Vec<StoreReplica> = (0..3)
        .map(|_| {
            let any_port = "127.0.0.1:0".parse().unwrap();
            StoreReplica::bind(any_port, token.clone(), StoreLimits::default()).unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = replicas.iter().map(StoreReplica::local_addr).collect();
    for (index, replica) in replicas.iter_mut().enumerate() {
        replica.start(&addrs, index).unwrap();
    }
    (replicas.into_iter().map(Some).collect(), addrs)
}

/// Drops the replica that leads, once one does.
fn drop_the_leader(replicas: &mut [Option<StoreReplica>]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let leading = replicas
            .iter()
            .position(|replica| replica.as_ref().is_some_and(StoreReplica::is_leader));
        if let Some(index) = leading {
            replicas[index] = None;
            return;
        }
        assert!(Instant::now() < deadline, "no replica became the leader");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Worker `rank` of two on one node, with the variables `tandem launch` gives a worker of a
/// job whose store is replicated at `replicas`; the store is not the worker's to host.
fn worker(rank: usize, replicas: &[SocketAddr], output_dir: &Path) -> GroupJob {
    let args = with_flag(synthetic_run(output_dir, 512), "--batch-size", "16");
    let args = with_flag(args, "--collective-timeout", "30");
    let list: Vec<String> = replicas.iter().map(SocketAddr::to_string).collect();
    let mut command = tandem();
    command
        .args(args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", replicas[0].ip().to_string())
        .env("MASTER_PORT", replicas[0].port().to_string())
        .env(STORE_REPLICAS_ENV, list.join(","))
        .env("TANDEM_JOB_TOKEN", TOKEN)
        .env_remove("TANDEM_STORE_HOSTED")
        .env_remove("TANDEM_ERROR_FILE");
    GroupJob::start(&mut command)
}

#[test]
fn workers_on_a_replicated_store_train_through_the_loss_of_its_leader() {
    let (mut replicas, addrs) = started_replicas();
    let dir = tempfile::tempdir().unwrap();
    let output_dir = dir.path().join("run");
    let workers = [
        worker(0, &addrs, &output_dir),
        worker(1, &addrs, &output_dir),
    ];
    let token = JobToken::new(TOKEN).unwrap();
    let store = StoreClient::connect_replicated(&addrs, &token, JOB_LIMIT).unwrap();
    let beats: Vec<String> = (0..2)
        .map(|rank| heartbeat_key(&store_prefix(0), rank))
        .collect();
    let beats: Vec<&str> = beats.iter().map(String::as_str).collect();
    store.wait(&beats, JOB_LIMIT).unwrap();
    for beat in &beats {
        let count = store.add(beat, 0).unwrap();
        assert!(
            count >= 0,
            "a worker ended before the store lost its leader"
        );
    }
    drop_the_leader(&mut replicas);
    for job in workers {
        expect_success(&job.wait(JOB_LIMIT));
    }
    assert!(output_dir.join("epoch_2.safetensors").is_file());
    // Both heartbeats reached the new leader as they ended.
    for beat in &beats {
        assert!(
            store.add(beat, 0).unwrap() < ENDED / 2,
            "{beat} did not end"
        );
    }
}
