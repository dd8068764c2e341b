//! Collectives between GPU ranks through NCCL: [`NcclGroup`] joins a communicator from rank
//! 0's unique id, all-reduces and broadcasts device buffers on its own stream ordered after
//! the compute stream's work by CUDA events, and aborts the communicator when a collective
//! does not finish within the timeout ([`watchdog`]) or when an [`NcclAbort`] handle says so
//! (the job lost a member). [`buckets`] is the bookkeeping of which gradient buckets the
//! backward pass has finished.

pub mod buckets;
mod group;
pub mod watchdog;

pub use buckets::{bucket_ops, BucketCursor, BucketOp};
pub(crate) use group::peer_wait;
pub use group::{CollectiveError, NcclAbort, NcclGroup};
pub use watchdog::{Deadlines, Verdict};
