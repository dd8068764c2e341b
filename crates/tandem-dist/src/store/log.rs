//! A replica's Raft log in memory: the entries since the last compaction, the Raft state,
//! and the keyspace image that stands for the entries compacted away.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

/// The log of one replica; Raft reads it through [`Storage`].
pub(crate) struct ReplicaLog {
    hard_state: HardState,
    conf_state: ConfState,
    /// The entries after the snapshot's index, in order.
    entries: Vec<Entry>,
    /// The keyspace as of the last entry compacted away, with that entry's index and term.
    snapshot: Snapshot,
}

impl ReplicaLog {
    /// An empty log of a store replicated on `voters` (their Raft ids).
    pub(crate) fn new(voters: Vec<u64>) -> ReplicaLog {
        let conf_state = ConfState::from((voters, Vec::new()));
        let mut snapshot = Snapshot::default();
        snapshot.mut_metadata().set_conf_state(conf_state.clone());
        ReplicaLog {
            hard_state: HardState::default(),
            conf_state,
            entries: Vec::new(),
            snapshot,
        }
    }

    fn snapshot_index(&self) -> u64 {
        self.snapshot.get_metadata().index
    }

    /// Appends `entries`, replacing any that conflict (from the first one's index on).
    pub(crate) fn append(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else {
            return;
        };
        let keep = first.index.saturating_sub(self.snapshot_index() + 1) as usize;
        self.entries.truncate(keep);
        self.entries.extend_from_slice(entries);
    }

    /// Records the Raft state to restore on a restart of the Raft loop.
    pub(crate) fn set_hard_state(&mut self, hard_state: HardState) {
        self.hard_state = hard_state;
    }

    /// Records a new commit index.
    pub(crate) fn set_commit(&mut self, commit: u64) {
        self.hard_state.commit = commit;
    }

    /// Replaces the log with `snapshot` (sent by the leader to a replica that fell behind).
    pub(crate) fn install(&mut self, snapshot: Snapshot) {
        let metadata = snapshot.get_metadata();
        self.hard_state.term = self.hard_state.term.max(metadata.term);
        self.hard_state.commit = self.hard_state.commit.max(metadata.index);
        self.conf_state = metadata.get_conf_state().clone();
        self.entries.clear();
        self.snapshot = snapshot;
    }

    /// Drops the entries up to `applied`, keeping `image` (the keyspace as of `applied`) in
    /// their place.
    pub(crate) fn compact(&mut self, applied: u64, image: Vec<u8>) {
        let Ok(term) = self.term(applied) else {
            return;
        };
        if applied <= self.snapshot_index() {
            return;
        }
        let drop_count = (applied - self.snapshot_index()) as usize;
        self.entries.drain(..drop_count.min(self.entries.len()));
        let mut snapshot = Snapshot::default();
        snapshot.set_data(image.into());
        let metadata = snapshot.mut_metadata();
        metadata.index = applied;
        metadata.term = term;
        metadata.set_conf_state(self.conf_state.clone());
        self.snapshot = snapshot;
    }

    /// How many entries the log holds.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

impl Storage for ReplicaLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let first = self.snapshot_index() + 1;
        if low < first {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        let last = first + self.entries.len() as u64;
        if high > last {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let mut entries = self.entries[(low - first) as usize..(high - first) as usize].to_vec();
        raft::util::limit_size(&mut entries, max_size.into());
        Ok(entries)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        let base = self.snapshot_index();
        if index == base {
            return Ok(self.snapshot.get_metadata().term);
        }
        if index < base {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.entries
            .get((index - base - 1) as usize)
            .map(|entry| entry.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snapshot_index() + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.snapshot_index() + self.entries.len() as u64)
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        if self.snapshot_index() < request_index {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(self.snapshot.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            ..Default::default()
        }
    }

    #[test]
    fn appending_replaces_conflicting_entries_and_compaction_keeps_the_terms_after_it() {
        let mut log = ReplicaLog::new(vec![1, 2, 3]);
        log.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]);
        log.append(&[entry(3, 2), entry(4, 2)]);
        assert_eq!(log.last_index().ok(), Some(4));
        assert_eq!(log.term(3).ok(), Some(2));
        log.compact(2, b"image".to_vec());
        assert_eq!(log.first_index().ok(), Some(3));
        assert_eq!(log.term(2).ok(), Some(1));
        assert!(log.term(1).is_err());
        let kept = log
            .entries(3, 5, None, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(kept, vec![entry(3, 2), entry(4, 2)]);
        let snapshot = log.snapshot(0, 2).expect("snapshot");
        assert_eq!(
            (snapshot.get_metadata().index, snapshot.get_data()),
            (2, &b"image"[..])
        );
        assert!(log.snapshot(3, 2).is_err());
    }
}
