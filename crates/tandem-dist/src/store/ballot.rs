//! What a replica remembers across a restart of its agent: the last Raft term it knew and
//! the replica it voted for in that term. Raft needs both on stable storage. Without them, a
//! replica started again could vote twice in one term, or help a leader that a later term
//! already replaced to commit entries. The log itself stays in memory: a replica started
//! again catches up from the leader (see [`ReplicaStart::behind`]).
//!
//! [`ReplicaStart::behind`]: super::ReplicaStart::behind

use std::path::{Path, PathBuf};

use crate::error::{DistError, Result};

/// The first line of a ballot file.
const HEADER: &str = "tandem store ballot 1";

/// A replica's last term and vote, kept in a file of its own.
pub(crate) struct Ballot {
    path: PathBuf,
    term: u64,
    vote: u64,
}

impl Ballot {
    /// Reads the ballot at `path`; a missing file is term 0 with no vote.
    pub(crate) fn open(path: &Path) -> Result<Ballot> {
        let (term, vote) = match std::fs::read_to_string(path) {
            Ok(text) => parse(&text).map_err(|message| DistError::Io {
                context: format!("read the store replica's ballot {}", path.display()),
                message,
            })?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => (0, 0),
            Err(error) => {
                let context = format!("read the store replica's ballot {}", path.display());
                return Err(DistError::io(&context, &error));
            }
        };
        Ok(Ballot {
            path: path.to_path_buf(),
            term,
            vote,
        })
    }

    /// The last term recorded.
    pub(crate) fn term(&self) -> u64 {
        self.term
    }

    /// The Raft id voted for in that term (0: none).
    pub(crate) fn vote(&self) -> u64 {
        self.vote
    }

    /// Records `term` and `vote` if either changed. The file is written under a temporary
    /// name, synced and renamed into place before this returns.
    pub(crate) fn record(&mut self, term: u64, vote: u64) -> Result<()> {
        if (term, vote) == (self.term, self.vote) {
            return Ok(());
        }
        let text = format!("{HEADER}\nterm {term}\nvote {vote}\n");
        tandem_files::write_atomically(&self.path, text.as_bytes()).map_err(|error| {
            DistError::Io {
                context: "record the store replica's term and vote".into(),
                message: error.to_string(),
            }
        })?;
        (self.term, self.vote) = (term, vote);
        Ok(())
    }
}

/// The term and vote of a ballot file's text.
fn parse(text: &str) -> std::result::Result<(u64, u64), String> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(format!("expected its first line to be {HEADER:?}"));
    }
    let mut field = |name: &str| -> std::result::Result<u64, String> {
        let line = lines.next().unwrap_or_default();
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|number| number.parse().ok())
            .ok_or_else(|| format!("expected a line `{name} <number>`, found {line:?}"))
    };
    Ok((field("term")?, field("vote")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ballot_keeps_the_last_term_and_vote_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ballot");
        let mut ballot = Ballot::open(&path).expect("open");
        assert_eq!((ballot.term(), ballot.vote()), (0, 0));
        ballot.record(7, 2).expect("record");
        let again = Ballot::open(&path).expect("open again");
        assert_eq!((again.term(), again.vote()), (7, 2));

        std::fs::write(&path, format!("{HEADER}\nterm 7\nvote two\n")).expect("write");
        let error = Ballot::open(&path)
            .err()
            .expect("a damaged ballot")
            .to_string();
        assert_eq!(
            error,
            format!(
                "read the store replica's ballot {}: expected a line `vote <number>`, found \
                 \"vote two\"",
                path.display()
            )
        );
    }
}
