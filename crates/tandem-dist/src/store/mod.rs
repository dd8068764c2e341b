//! The rendezvous store: a small authenticated key-value server (the role of c10d's TCPStore)
//! and its client.

mod client;
mod gate;
mod limits;
pub(crate) mod protocol;
mod server;

pub(crate) use client::remaining;
pub use client::StoreClient;
pub use limits::StoreLimits;
pub use protocol::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
pub use server::StoreServer;
