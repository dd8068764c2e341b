//! How much of the process a store may take: connections before and after the handshake,
//! the handshake's deadline, and the file descriptors it must leave to its host (a launcher
//! spawning workers needs pipes and log files even while outsiders knock on the store port).

use std::time::Duration;

/// The bounds a [`StoreServer`](crate::StoreServer) keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// How long a new connection may take to pass the whole handshake, counted from its
    /// accept, however it trickles its bytes.
    pub handshake_deadline: Duration,
    /// Connections in the handshake at once; beyond it, the oldest is closed at once.
    pub max_pending: usize,
    /// Connections in the handshake at once from one peer address; beyond it, the oldest
    /// from that address is closed at once.
    pub max_pending_per_address: usize,
    /// Authenticated clients at once (each holds a thread and a descriptor).
    pub max_clients: usize,
    /// File descriptors (of `RLIMIT_NOFILE`, beyond those open when the store starts) that
    /// the store never uses, for the rest of the process.
    pub reserved_descriptors: usize,
}

impl Default for StoreLimits {
    fn default() -> StoreLimits {
        StoreLimits {
            handshake_deadline: Duration::from_secs(10),
            max_pending: 64,
            max_pending_per_address: 8,
            max_clients: 1024,
            reserved_descriptors: 64,
        }
    }
}

/// The fewest descriptors a store keeps for itself however tight the limit: enough for a few
/// clients, so that a process at its limit still has a working store.
const MIN_STORE_DESCRIPTORS: usize = 16;
/// What counts as "no limit" when `RLIMIT_NOFILE` is infinite or unreadable.
const UNLIMITED_DESCRIPTORS: usize = 1 << 20;

impl StoreLimits {
    /// Descriptors the store may hold for its connections: the soft `RLIMIT_NOFILE` less the
    /// descriptors open now and the reserve.
    pub(crate) fn descriptor_budget(&self) -> usize {
        budget(
            soft_descriptor_limit(),
            open_descriptors().unwrap_or(0),
            self.reserved_descriptors,
        )
    }
}

/// `limit` less `open` less `reserved`, but never below [`MIN_STORE_DESCRIPTORS`].
fn budget(limit: usize, open: usize, reserved: usize) -> usize {
    limit
        .saturating_sub(open)
        .saturating_sub(reserved)
        .max(MIN_STORE_DESCRIPTORS)
}

/// The soft limit on open files of this process.
fn soft_descriptor_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return UNLIMITED_DESCRIPTORS;
    }
    usize::try_from(limit.rlim_cur).unwrap_or(UNLIMITED_DESCRIPTORS)
}

/// How many descriptors this process has open (from `/proc/self/fd`).
pub(crate) fn open_descriptors() -> Option<usize> {
    // The listing's own descriptor is counted too; one too many is on the safe side.
    std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|entries| entries.count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_leaves_the_reserve_and_the_open_descriptors() {
        assert_eq!(budget(256, 12, 80), 164);
        assert_eq!(budget(1024, 10, 64), 950);
        assert_eq!(budget(100, 30, 64), MIN_STORE_DESCRIPTORS);
        assert!(soft_descriptor_limit() > 3);
        assert!(open_descriptors().is_some_and(|open| open >= 3));
    }
}
