//! Loopback ports for tests that start a server or name a rendezvous address.

use std::net::TcpListener;

/// A loopback port that was free a moment ago: the system's pick for a listener that is
/// dropped at once.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free loopback port")
}
