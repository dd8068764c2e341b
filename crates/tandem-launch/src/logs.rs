//! Worker output: every line goes to `<log-dir>/logs/rank_R.log` (appended across rounds,
//! each round under a header), and the console shows it prefixed `[rank R] ` when asked.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Instant;

use tandem_files::{create_own_folder, open_regular_file};

/// Longest line copied in one piece: longer ones (a progress bar redrawn with `\r` for hours)
/// are cut, so a worker cannot make the launcher hold its whole output in memory.
const MAX_LINE_BYTES: u64 = 64 * 1024;
/// How many bytes at most the summary reads back from the end of a log.
const TAIL_WINDOW_BYTES: u64 = 64 * 1024;

/// The path of rank `rank`'s log under `log_dir`.
pub fn rank_log_path(log_dir: &Path, rank: usize) -> PathBuf {
    log_dir.join("logs").join(format!("rank_{rank}.log"))
}

/// One rank's log file, opened for one round.
pub struct RankLog {
    path: PathBuf,
    file: Arc<Mutex<File>>,
    round_start: u64,
    rank: usize,
    pumps_done: Receiver<()>,
    pump_alive: Option<Sender<()>>,
}

impl RankLog {
    /// Opens (creating if needed) rank `rank`'s log and appends `header` as a line of its own.
    /// A log (or `logs` folder) that is a symbolic link, or not a regular file, is refused.
    pub fn open(log_dir: &Path, rank: usize, header: &str) -> std::io::Result<RankLog> {
        let path = rank_log_path(log_dir, rank);
        if let Some(parent) = path.parent() {
            create_own_folder(parent)?;
        }
        let mut options = OpenOptions::new();
        options.create(true).append(true);
        let mut file = open_regular_file(&path, &options)?;
        writeln!(file, "{header}")?;
        let round_start = file.seek(SeekFrom::End(0))?;
        let (pump_alive, pumps_done) = mpsc::channel();
        Ok(RankLog {
            path,
            file: Arc::new(Mutex::new(file)),
            round_start,
            rank,
            pumps_done,
            pump_alive: Some(pump_alive),
        })
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Copies `stream` line by line into the log (and to the launcher's stdout, prefixed, when
    /// `echo` is true) on a thread of its own, until the stream closes.
    pub fn pump(&self, stream: impl Read + Send + 'static, echo: bool) -> std::io::Result<()> {
        let file = Arc::clone(&self.file);
        let prefix = format!("[rank {}] ", self.rank);
        let alive = self.pump_alive.clone();
        thread::Builder::new()
            .name(format!("log-rank-{}", self.rank))
            .spawn(move || {
                copy_lines(stream, &file, echo.then_some(prefix.as_str()));
                drop(alive);
            })?;
        Ok(())
    }

    /// Waits until every pump has seen its stream close, or `deadline` passes (a grandchild
    /// may hold a pipe open); returns whether they all finished.
    pub fn wait_for_pumps(&mut self, deadline: Instant) -> bool {
        self.pump_alive = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.pumps_done.recv_timeout(left) {
                Ok(()) => continue,
                Err(RecvTimeoutError::Disconnected) => return true,
                Err(RecvTimeoutError::Timeout) => return false,
            }
        }
    }

    /// The last `max_lines` lines this round wrote (from at most the last 64 KiB).
    pub fn tail(&self, max_lines: usize) -> std::io::Result<Vec<String>> {
        let mut file = File::open(&self.path)?;
        let end = file.seek(SeekFrom::End(0))?;
        let start = self.round_start.max(end.saturating_sub(TAIL_WINDOW_BYTES));
        file.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        file.take(end - start).read_to_end(&mut bytes)?;
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().collect();
        let first = lines.len().saturating_sub(max_lines);
        Ok(lines
            .iter()
            .skip(first)
            .map(|line| line.to_string())
            .collect())
    }
}

fn lock(file: &Mutex<File>) -> MutexGuard<'_, File> {
    file.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Copies lines until end of stream. Write errors (a full disk, a closed console) do not stop
/// the copy: the worker must never block on a pipe nobody reads.
fn copy_lines(stream: impl Read, file: &Mutex<File>, echo_prefix: Option<&str>) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader)
            .take(MAX_LINE_BYTES)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        let _ = lock(file).write_all(&line);
        if let Some(prefix) = echo_prefix {
            let mut echoed = Vec::with_capacity(prefix.len() + line.len());
            echoed.extend_from_slice(prefix.as_bytes());
            echoed.extend_from_slice(&line);
            let _ = std::io::stdout().lock().write_all(&echoed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rounds_append_and_tail_reads_only_the_current_round() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = RankLog::open(dir.path(), 3, "=== round 0 ===").unwrap();
        first.pump(&b"old line\n"[..], false).unwrap();
        assert!(first.wait_for_pumps(Instant::now() + Duration::from_secs(5)));

        let mut second = RankLog::open(dir.path(), 3, "=== round 1 ===").unwrap();
        second
            .pump(&b"a\nb\nc\nno newline at the end"[..], false)
            .unwrap();
        assert!(second.wait_for_pumps(Instant::now() + Duration::from_secs(5)));

        assert_eq!(
            second.tail(2).unwrap(),
            vec!["c".to_string(), "no newline at the end".to_string()]
        );
        assert_eq!(
            second.tail(10).unwrap(),
            vec!["a", "b", "c", "no newline at the end"]
        );
        let whole = std::fs::read_to_string(dir.path().join("logs/rank_3.log")).unwrap();
        assert_eq!(
            whole,
            "=== round 0 ===\nold line\n=== round 1 ===\na\nb\nc\nno newline at the end\n"
        );
    }

    #[test]
    fn endless_lines_are_cut() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = RankLog::open(dir.path(), 0, "=== round 0 ===").unwrap();
        let long = vec![b'x'; MAX_LINE_BYTES as usize + 10];
        log.pump(std::io::Cursor::new(long), false).unwrap();
        assert!(log.wait_for_pumps(Instant::now() + Duration::from_secs(5)));
        let whole = std::fs::read_to_string(log.path()).unwrap();
        let lengths: Vec<usize> = whole.lines().map(str::len).collect();
        assert_eq!(lengths, vec![15, MAX_LINE_BYTES as usize, 10]);
    }
}
