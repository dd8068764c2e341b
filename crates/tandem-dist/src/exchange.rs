//! Small values the ranks hand each other through the job's store, outside the ring:
//!
//! - [`gather_records`]: every rank publishes a short record and reads everyone's (the device
//!   each rank computes on, before the backend is chosen);
//! - [`publish_nccl_unique_id`] / [`receive_nccl_unique_id`]: rank 0's NCCL unique id, which
//!   every rank needs before NCCL can connect them (PyTorch passes it through its TCPStore too).
//!
//! Keys live under the process group's prefix, which is one per restart round
//! (`round{r}/pg` under `tandem launch`), so a value left by an earlier round is never read.
//! Every wait is bounded by the caller's timeout and its error names the key and the ranks that
//! did not publish.
//!
//! ```text
//! {prefix}/{name}/{rank}        a rank's record of gather_records(name)
//! {prefix}/nccl/unique_id       rank 0's NCCL unique id, 128 bytes
//! ```

use std::time::Duration;

use crate::error::{DistError, Result};
use crate::store::StoreClient;

/// The size of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES` of nccl.h).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// The rank that creates the NCCL unique id.
const NCCL_ID_ROOT: usize = 0;

/// The key of the NCCL unique id in the namespace `prefix`.
pub fn nccl_unique_id_key(prefix: &str) -> String {
    format!("{prefix}/nccl/unique_id")
}

/// Rank 0's part: publishes `id` for the other ranks. Fails when `id` is not
/// [`NCCL_UNIQUE_ID_BYTES`] long, or when another id is already there (a second rank 0 in the
/// same round).
pub fn publish_nccl_unique_id(store: &StoreClient, prefix: &str, id: &[u8]) -> Result<()> {
    let key = nccl_unique_id_key(prefix);
    check_unique_id_len(&key, id)?;
    let stored = store.compare_set(&key, None, id)?;
    if stored != id {
        return Err(DistError::BadValue {
            key,
            message: "another NCCL unique id was published first in this round: two processes \
                      claim rank 0"
                .into(),
        });
    }
    Ok(())
}

/// The other ranks' part: waits up to `timeout` for rank 0's NCCL unique id and returns it.
pub fn receive_nccl_unique_id(
    store: &StoreClient,
    prefix: &str,
    timeout: Duration,
) -> Result<[u8; NCCL_UNIQUE_ID_BYTES]> {
    let key = nccl_unique_id_key(prefix);
    wait_published(
        store,
        &[(NCCL_ID_ROOT, key.as_str())],
        "NCCL unique id",
        timeout,
    )?;
    let value = store.get(&key)?.unwrap_or_default();
    check_unique_id_len(&key, &value)?;
    let mut id = [0; NCCL_UNIQUE_ID_BYTES];
    id.copy_from_slice(&value);
    Ok(id)
}

/// Publishes `record` as this rank's under `name` and returns every rank's, in rank order,
/// once all `world_size` ranks have published theirs (at most `timeout`).
pub fn gather_records(
    store: &StoreClient,
    prefix: &str,
    name: &str,
    rank: usize,
    world_size: usize,
    record: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    if rank >= world_size {
        return Err(DistError::InvalidArgument(format!(
            "rank {rank} is not within a world of size {world_size}"
        )));
    }
    let keys: Vec<String> = (0..world_size)
        .map(|rank| format!("{prefix}/{name}/{rank}"))
        .collect();
    store.set(&keys[rank], record)?;
    let ranked: Vec<(usize, &str)> = keys.iter().map(String::as_str).enumerate().collect();
    wait_published(store, &ranked, name, timeout)?;
    keys.iter()
        .map(|key| Ok(store.get(key)?.unwrap_or_default()))
        .collect()
}

/// Waits until every `(rank, key)` is set; a timeout names the ranks and keys still missing.
fn wait_published(
    store: &StoreClient,
    keys: &[(usize, &str)],
    what: &str,
    timeout: Duration,
) -> Result<()> {
    let key_list: Vec<&str> = keys.iter().map(|(_, key)| *key).collect();
    match store.wait(&key_list, timeout) {
        Err(DistError::StoreTimeout { missing, timeout }) => Err(DistError::NotPublished {
            what: what.into(),
            ranks: keys
                .iter()
                .filter(|(_, key)| missing.iter().any(|missing| missing == key))
                .map(|(rank, _)| *rank)
                .collect(),
            keys: missing,
            timeout,
        }),
        other => other,
    }
}

fn check_unique_id_len(key: &str, id: &[u8]) -> Result<()> {
    if id.len() == NCCL_UNIQUE_ID_BYTES {
        return Ok(());
    }
    Err(DistError::BadValue {
        key: key.into(),
        message: format!(
            "an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, this one is {}",
            id.len()
        ),
    })
}
