//! The worker contract: what a worker is told when it starts, and what it leaves behind when
//! it fails, whoever starts it (`tandem launch`, `srun`, `mpirun`, ModelArts, Kubeflow).
//!
//! The launcher writes these variables and the worker reads them through the same names; the
//! store prefix of a restart round, the error file's record and the reading of a replicated
//! store's replicas are built here only.

use std::net::{SocketAddr, ToSocketAddrs};

use serde::{Deserialize, Serialize};

pub use crate::auth::JOB_TOKEN_ENV;

/// Global rank of the worker (torchrun's name).
pub const RANK_ENV: &str = "RANK";
/// Rank of the worker among those of its node.
pub const LOCAL_RANK_ENV: &str = "LOCAL_RANK";
/// Rank of the worker's node.
pub const GROUP_RANK_ENV: &str = "GROUP_RANK";
/// Number of workers in the job.
pub const WORLD_SIZE_ENV: &str = "WORLD_SIZE";
/// Number of workers on the worker's node.
pub const LOCAL_WORLD_SIZE_ENV: &str = "LOCAL_WORLD_SIZE";
/// Host of the store.
pub const MASTER_ADDR_ENV: &str = "MASTER_ADDR";
/// Port of the store.
pub const MASTER_PORT_ENV: &str = "MASTER_PORT";
/// The environment variable that overrides the address this rank advertises to its peers.
pub const HOST_ENV: &str = "TANDEM_HOST";
/// Set by `tandem launch`: how many times the job has been restarted.
pub const RESTART_COUNT_ENV: &str = "TANDEM_RESTART_COUNT";
/// Set by `tandem launch`: the namespace of this round's process-group keys in the store.
pub const STORE_PREFIX_ENV: &str = "TANDEM_STORE_PREFIX";
/// Set to `1` by `tandem launch` when its agent hosts the store for the workers.
pub const STORE_HOSTED_ENV: &str = "TANDEM_STORE_HOSTED";
/// The replicas of a replicated store (`launch --store-replicas`), as `HOST:PORT` entries
/// separated by commas; when set, a worker reaches the store through them, following the
/// leader, and not at `MASTER_ADDR:MASTER_PORT`.
pub const STORE_REPLICAS_ENV: &str = "TANDEM_STORE_REPLICAS";
/// Set by `tandem launch`: where the worker records its fatal error (torchrun's error files).
pub const ERROR_FILE_ENV: &str = "TANDEM_ERROR_FILE";

/// The exit code of a worker refused by its own command line or settings: a bad flag (the
/// code clap and argparse give a usage error), a value out of range, settings that
/// contradict the run's snapshot. The same command fails the same way every time, so
/// `tandem launch` ends the job at once instead of restarting it.
pub const SETTINGS_ERROR_EXIT_CODE: i32 = 2;

/// How the error of a rank stopped by another rank's request begins: the launcher reads it
/// to tell such a rank, which only followed, from the one whose stop it followed.
pub const STOPPED_ON_REQUEST: &str = "stopped with the other ranks on another rank's request";

/// torchrun's default port of the store, used where a cluster names no port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The store key prefix of a restart round's process group, so that keys of an old round
/// never collide with a new one's. The round is its restart count, as a number (the
/// launcher) or as the text of [`RESTART_COUNT_ENV`] (a worker).
pub fn store_prefix(restart_round: impl std::fmt::Display) -> String {
    format!("round{restart_round}/pg")
}

/// The replicas that `text`, a value of [`STORE_REPLICAS_ENV`], lists, each `HOST:PORT`
/// resolved to its first address (a host name, an IPv4 address, or an IPv6 address in
/// brackets); none for a blank `text`. An error names the entry at fault, to be prefixed with
/// where `text` came from.
pub fn resolve_store_replicas(text: &str) -> Result<Vec<SocketAddr>, String> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    text.split(',').map(resolve_store_replica).collect()
}

/// One entry of [`resolve_store_replicas`].
fn resolve_store_replica(entry: &str) -> Result<SocketAddr, String> {
    let entry = entry.trim();
    let not_host_port = || {
        format!(
            "entry {entry:?} is not HOST:PORT (a host name or IP address, a colon and a port \
             below 65536, e.g. node0:29500 or [fd00::1]:29500)"
        )
    };
    let (host, port) = entry.rsplit_once(':').ok_or_else(not_host_port)?;
    let port: u16 = port.parse().map_err(|_| not_host_port())?;
    let host = host
        .strip_prefix('[')
        .and_then(|host| host.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(not_host_port());
    }
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|error| format!("entry {entry:?} does not resolve: {error}"))?;
    addrs
        .next()
        .ok_or_else(|| format!("entry {entry:?} resolves to no address"))
}

/// Set to `1` by `tandem launch --keep-survivors`: when a worker is lost, the others stay
/// up and re-form the job among themselves from the membership the launcher publishes.
pub const KEEP_SURVIVORS_ENV: &str = "TANDEM_KEEP_SURVIVORS";

/// Set to `1` by `tandem launch --replace-lost` for a worker started in place of a lost one:
/// it reads no snapshot, and joins the running job at a step boundary with a peer's state.
pub const JOINER_ENV: &str = "TANDEM_JOINER";

/// The store key by which the joiner of id `worker_id` says it is ready to join the round
/// whose keys start with `round_prefix`.
pub fn joiner_key(round_prefix: &str, worker_id: usize) -> String {
    format!("{round_prefix}/joining/{worker_id}")
}

/// The store key of the membership record of the round whose keys start with `round_prefix`.
pub fn membership_key(round_prefix: &str) -> String {
    format!("{round_prefix}/membership")
}

/// Who is in the job after a worker was lost, as the launcher publishes it: the workers by
/// their rank at the round's start (their lasting id), in the order of their new ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MembershipRecord {
    /// The membership epoch: 0 at the round's start, one more at each change.
    pub epoch: u64,
    /// The members' ids (their ranks at the round's start); a member's new rank is its place.
    pub members: Vec<usize>,
    /// Why the membership changed, e.g. "rank 2 (pid 1234) killed by SIGKILL".
    pub why: String,
    /// Seconds the members wait for more before the job ends, when they are fewer than the
    /// job's minimum; `None` when they go on.
    #[serde(default)]
    pub paused_for: Option<f64>,
}

impl MembershipRecord {
    /// The store prefix of the process group of this membership, inside the round's.
    pub fn group_prefix(&self, round_prefix: &str) -> String {
        format!("{round_prefix}/m{}", self.epoch)
    }

    /// The record as JSON.
    pub fn to_json(&self) -> Vec<u8> {
        // Numbers and a string always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record read back from the store.
    pub fn from_json(bytes: &[u8]) -> Result<MembershipRecord, String> {
        serde_json::from_slice(bytes)
            .map_err(|error| format!("is not a membership record: {error}"))
    }
}

/// A worker's fatal error as it records it in its error file:
/// `{"rank":R,"message":"...","timestamp":SECONDS}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerErrorRecord {
    /// The worker's global rank, when it knew it.
    pub rank: Option<u64>,
    /// The error, with its causes.
    pub message: String,
    /// When it was recorded, in seconds since the Unix epoch.
    pub timestamp: Option<f64>,
}

/// An error file read leniently: its message and timestamp as text, whatever their JSON types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFileText {
    /// The message (a JSON value other than a string, as JSON text).
    pub message: String,
    /// The timestamp as text, when there is one.
    pub timestamp: Option<String>,
}

impl WorkerErrorRecord {
    /// The record of `message` from the worker of `rank`, stamped with the current time.
    pub fn now(rank: Option<u64>, message: String) -> WorkerErrorRecord {
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |elapsed| elapsed.as_secs_f64());
        WorkerErrorRecord {
            rank,
            message,
            timestamp: Some(timestamp),
        }
    }

    /// The record as one line of JSON, the error file's content.
    pub fn to_json(&self) -> String {
        // A struct of a string, an integer and a float always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads an error file's content. A record of this type gives its fields; a file of an
    /// older or foreign writer is accepted when it is a JSON object with a `message` (any
    /// JSON value, taken as text). Anything else is an error saying what is wrong, to be
    /// prefixed with the file's name.
    pub fn read_text(text: &str) -> Result<ErrorFileText, String> {
        if let Ok(record) = serde_json::from_str::<WorkerErrorRecord>(text) {
            return Ok(ErrorFileText {
                message: record.message,
                timestamp: record.timestamp.map(|seconds| seconds.to_string()),
            });
        }
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|error| format!("is not valid JSON: {error}"))?;
        let as_text = |value: &serde_json::Value| match value {
            serde_json::Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        let message = value
            .get("message")
            .map(as_text)
            .ok_or_else(|| "has no \"message\" field".to_string())?;
        Ok(ErrorFileText {
            message,
            timestamp: value.get("timestamp").map(as_text),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_its_round_trip_through_the_file_format() {
        let record = WorkerErrorRecord {
            rank: Some(3),
            message: "loss is NaN at step 7: \"quoted\"\nsecond line".into(),
            timestamp: Some(1_700_000_000.5),
        };
        let json = record.to_json();
        assert_eq!(
            json,
            r#"{"rank":3,"message":"loss is NaN at step 7: \"quoted\"\nsecond line","timestamp":1700000000.5}"#
        );
        assert_eq!(
            serde_json::from_str::<WorkerErrorRecord>(&json).unwrap(),
            record
        );
        assert_eq!(
            WorkerErrorRecord::read_text(&json),
            Ok(ErrorFileText {
                message: record.message.clone(),
                timestamp: Some("1700000000.5".into()),
            })
        );
        let unranked = WorkerErrorRecord::now(None, "no rank".into());
        assert_eq!(
            serde_json::from_str::<WorkerErrorRecord>(&unranked.to_json()).unwrap(),
            unranked
        );
        assert!(unranked.timestamp.is_some_and(|seconds| seconds > 1.6e9));
        // Any timestamp, not only this run's, reads back to the bit (serde_json's
        // float_roundtrip; without it about one in a few hundred came back one ulp off).
        for step in 0..10_000u64 {
            let seconds = 1.7e9 + step as f64 * 0.123_456_789_1;
            let record = WorkerErrorRecord {
                timestamp: Some(seconds),
                ..unranked.clone()
            };
            let read: WorkerErrorRecord = serde_json::from_str(&record.to_json()).unwrap();
            assert_eq!(read.timestamp.map(f64::to_bits), Some(seconds.to_bits()));
        }
    }

    #[test]
    fn old_and_foreign_error_files_are_read_as_text() {
        // torchrun's error file: the message is an object.
        let torchrun = r#"{"message":{"message":"RuntimeError: boom","extraInfo":{"timestamp":"1700000000"}}}"#;
        let read = WorkerErrorRecord::read_text(torchrun).unwrap();
        assert_eq!(read.timestamp, None);
        assert!(
            read.message.starts_with('{')
                && read.message.contains(r#""message":"RuntimeError: boom""#),
            "{}",
            read.message
        );
        // An untyped record: a rank as text and a timestamp as a string.
        let untyped = r#"{"rank":"one","message":"disk full","timestamp":"12:00"}"#;
        assert_eq!(
            WorkerErrorRecord::read_text(untyped),
            Ok(ErrorFileText {
                message: "disk full".into(),
                timestamp: Some("12:00".into()),
            })
        );
    }

    #[test]
    fn damaged_error_files_are_reported_not_a_panic() {
        let truncated = WorkerErrorRecord::read_text(r#"{"rank":1,"message":"disk"#).unwrap_err();
        assert!(truncated.starts_with("is not valid JSON: "), "{truncated}");
        assert_eq!(
            WorkerErrorRecord::read_text(r#"{"rank":1}"#),
            Err("has no \"message\" field".to_string())
        );
        assert_eq!(
            WorkerErrorRecord::read_text("[1,2]"),
            Err("has no \"message\" field".to_string())
        );
        let binary = WorkerErrorRecord::read_text("\u{0}\u{1}garbage").unwrap_err();
        assert!(binary.starts_with("is not valid JSON: "), "{binary}");
        let empty = WorkerErrorRecord::read_text("").unwrap_err();
        assert!(empty.starts_with("is not valid JSON: "), "{empty}");
    }

    #[test]
    fn the_store_prefix_names_the_round() {
        assert_eq!(store_prefix(0), "round0/pg");
        assert_eq!(store_prefix(3), store_prefix("3"));
    }

    #[test]
    fn store_replicas_resolve_in_order_and_a_bad_entry_is_named() {
        let replicas = resolve_store_replicas("127.0.0.1:29500, [::1]:29501,localhost:29502")
            .expect("three good entries");
        assert_eq!(replicas.len(), 3);
        assert_eq!(replicas[0], "127.0.0.1:29500".parse().unwrap());
        assert_eq!(replicas[1], "[::1]:29501".parse().unwrap());
        assert!(replicas[2].ip().is_loopback() && replicas[2].port() == 29502);
        for (text, entry) in [
            ("127.0.0.1:29500,node1", "\"node1\""),
            ("127.0.0.1:29500,node1:99999", "\"node1:99999\""),
            ("127.0.0.1:29500,:29501", "\":29501\""),
            ("127.0.0.1:29500,,127.0.0.1:29501", "\"\""),
        ] {
            let error = resolve_store_replicas(text).unwrap_err();
            assert!(
                error.starts_with(&format!("entry {entry} is not HOST:PORT")),
                "{text}: {error}"
            );
        }
        let error = resolve_store_replicas("no-such-host.invalid:29500").unwrap_err();
        assert!(
            error.starts_with("entry \"no-such-host.invalid:29500\" does not resolve"),
            "{error}"
        );
        assert_eq!(resolve_store_replicas(""), Ok(Vec::new()));
        assert_eq!(resolve_store_replicas("  "), Ok(Vec::new()));
    }
}
