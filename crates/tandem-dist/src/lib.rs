//! tandem-dist: what Tandem's data-parallel training needs from the network.
//!
//! - [`StoreServer`] / [`StoreClient`]: the rendezvous store (the role of c10d's TCPStore),
//!   authenticated by a shared [`JobToken`].
//! - [`ProcessGroup`]: ranks found through the store, linked in a TCP ring, with pipelined ring
//!   collectives (all-reduce, broadcast, all-gather, reduce-scatter, barrier). Every operation
//!   has a deadline and a failed peer is named in the error of every rank.
//! - [`exact`]: a sum of float vectors over the ranks whose bits do not depend on how the terms
//!   are spread over them ([`ProcessGroup::exact_sum`]).
//! - [`SharedBuffer`]: a buffer in shared memory that ranks of one host all-reduce without
//!   copying it through sockets.
//! - [`gather_records`], [`publish_nccl_unique_id`], [`receive_nccl_unique_id`]: small values
//!   handed between ranks through the store (each rank's device, rank 0's NCCL unique id).
//! - [`heartbeat`]: each worker's heartbeat and status in the store, for the launcher and
//!   `tandem status`.
//! - [`CommThread`]: a thread that owns the group and runs submitted collectives in order,
//!   so communication overlaps computation.
//! - [`cluster`]: the launch environments of torchrun, ModelArts, Slurm, Open MPI and Kubeflow.

mod auth;
pub mod cluster;
mod comm_thread;
mod element;
mod error;
pub mod exact;
mod exchange;
mod group;
pub mod heartbeat;
mod link;
mod ring;
mod shared;
mod store;
mod transport;

pub use auth::{JobToken, JOB_TOKEN_ENV};
pub use cluster::contract::HOST_ENV;
pub use comm_thread::{CommThread, Pending};
pub use element::{chunk_range, Element, ReduceOp};
pub use error::{DistError, Result};
pub use exchange::{
    gather_records, nccl_unique_id_key, publish_nccl_unique_id, receive_nccl_unique_id,
    NCCL_UNIQUE_ID_BYTES,
};
pub use group::{
    ProcessGroup, ProcessGroupOptions, RingBreaker, DEFAULT_SEGMENT_BYTES, DEFAULT_TIMEOUT,
    MAX_BROADCAST_BYTES,
};
pub use shared::SharedBuffer;
pub use store::{
    ReplicaStart, StoreClient, StoreLimits, StoreReplica, StoreServer, WaitBreaker, MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
};
