//! The one error type of the crate: every failure names what failed and, for a peer, its rank
//! and address.

use std::time::Duration;

use thiserror::Error;

/// Everything that can go wrong in the store, the process group and the cluster environment.
///
/// The type is `Clone` so that a failed process group can hand the same first error to every
/// later call.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum DistError {
    /// A local I/O operation failed (bind, accept, spawn a thread).
    #[error("{context}: {message}")]
    Io {
        /// What was being done, e.g. "bind the peer listener on 127.0.0.1".
        context: String,
        /// The operating system's message.
        message: String,
    },
    /// The store could not be reached before the deadline.
    #[error("could not reach the store at {addr} within {timeout:?}: {message}")]
    StoreUnreachable {
        /// The address tried.
        addr: String,
        /// How long connecting was retried.
        timeout: Duration,
        /// The last connection error.
        message: String,
    },
    /// The store refused this client's proof of the job token.
    #[error("the job token was refused by the store at {addr} (check TANDEM_JOB_TOKEN)")]
    TokenRefused {
        /// The store's address.
        addr: String,
    },
    /// A peer or store answered the handshake without proving it knows the job token.
    #[error("{addr} did not prove it knows the job token: {message}")]
    NotTrusted {
        /// The remote address.
        addr: String,
        /// What was wrong with its answer.
        message: String,
    },
    /// The connection to the store broke or the store sent something malformed.
    #[error("store at {addr}: {message}")]
    Store {
        /// The store's address.
        addr: String,
        /// What went wrong.
        message: String,
    },
    /// The store refused a request (e.g. `add` on a value that is not an integer).
    #[error("store request on key {key:?} failed: {message}")]
    StoreRequest {
        /// The key of the request.
        key: String,
        /// The store's explanation.
        message: String,
    },
    /// `wait` reached its timeout with keys still missing.
    #[error("timed out after {timeout:?} waiting for store keys {missing:?}")]
    StoreTimeout {
        /// The keys still missing.
        missing: Vec<String>,
        /// The timeout of the wait.
        timeout: Duration,
    },
    /// A key or value is larger than the store accepts.
    #[error("{what} is {len} bytes, above the limit of {max} bytes")]
    TooLarge {
        /// Which key or value, e.g. "value of key \"a\"".
        what: String,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A key holds a value of the wrong form (e.g. an NCCL unique id of the wrong length).
    #[error("store key {key:?} holds a bad value: {message}")]
    BadValue {
        /// The key.
        key: String,
        /// What is wrong with its value.
        message: String,
    },
    /// Ranks did not publish a value the others wait for before the deadline.
    #[error(
        "{ranks} did not publish the {what} within {timeout:?} (store keys {keys:?} still missing)",
        ranks = describe_ranks(ranks)
    )]
    NotPublished {
        /// What was waited for, e.g. "NCCL unique id".
        what: String,
        /// The ranks that did not publish it.
        ranks: Vec<usize>,
        /// Their keys.
        keys: Vec<String>,
        /// The timeout of the wait.
        timeout: Duration,
    },
    /// Some ranks did not join the process group before the deadline.
    #[error(
        "rendezvous failed: rank(s) {missing:?} of {world_size} did not join within {timeout:?}"
    )]
    RendezvousTimeout {
        /// The ranks that never published their address.
        missing: Vec<usize>,
        /// The world size of the group.
        world_size: usize,
        /// The rendezvous timeout.
        timeout: Duration,
    },
    /// A peer failed, closed its connection, timed out or sent something unexpected.
    #[error("rank {rank} ({addr}) {what} during {op}")]
    Peer {
        /// The peer's rank.
        rank: usize,
        /// The peer's advertised `host:port`.
        addr: String,
        /// What happened, e.g. "closed the connection".
        what: String,
        /// The operation, e.g. "all_reduce #3".
        op: String,
    },
    /// Another rank failed first and published the root cause in the store.
    #[error("{op} aborted because {report}")]
    Aborted {
        /// The operation of this rank that was aborted.
        op: String,
        /// The first failure report found in the store, e.g. "rank 1 reported: rank 2 (...) closed the connection during all_reduce #3".
        report: String,
    },
    /// The process group failed earlier and cannot be used any more.
    #[error("the process group failed earlier: {0}")]
    GroupFailed(Box<DistError>),
    /// Options or arguments are inconsistent (rank >= world size, mismatched lengths, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The comm thread stopped before answering.
    #[error("the comm thread stopped before finishing the operation")]
    CommThreadStopped,
    /// An environment variable of a cluster environment is missing or malformed.
    #[error("{source_name} environment: {variable}={value:?}: {message}")]
    Env {
        /// The cluster environment, e.g. "slurm".
        source_name: String,
        /// The variable.
        variable: String,
        /// Its value (empty when missing).
        value: String,
        /// What was expected.
        message: String,
    },
}

impl DistError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, error: &std::io::Error) -> DistError {
        DistError::Io {
            context: context.into(),
            message: error.to_string(),
        }
    }
}

/// `rank 0`, or `ranks 1, 3` for several.
fn describe_ranks(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match list.as_slice() {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, DistError>;
