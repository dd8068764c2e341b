//! The rendezvous store: a small authenticated key-value server (the role of c10d's TCPStore)
//! and its client.

mod ballot;
mod client;
mod gate;
mod keyspace;
mod limits;
mod log;
mod peers;
pub(crate) mod protocol;
mod replica;
mod server;

pub(crate) use client::remaining;
pub use client::{StoreClient, WaitBreaker};
pub use limits::StoreLimits;
pub use protocol::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
pub use replica::{ReplicaStart, StoreReplica};
pub use server::StoreServer;
