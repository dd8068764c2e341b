//! A worker that hangs while its heartbeat thread beats: its training thread stopped with
//! ptrace, as a deadlock or a read that never returns would stop it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The CPU time of each thread of process `pid` but the heartbeat's and the comm thread's.
fn cpu_per_thread(pid: u32) -> BTreeMap<libc::pid_t, u64> {
    let cpu_of = |tid: &str| -> Option<u64> {
        let name = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
        if name.starts_with("tandem-heartbea") || name.starts_with("comm-rank") {
            return None;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
        let (_, fields) = stat.rsplit_once(") ")?;
        let fields: Vec<&str> = fields.split_whitespace().collect();
        Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
    };
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| task.ok()?.file_name().into_string().ok())
        .filter_map(|tid| Some((tid.parse().ok()?, cpu_of(&tid)?)))
        .collect()
}

/// The thread of process `pid` that trains: the one whose CPU time grows the most.
pub fn training_thread(pid: u32) -> libc::pid_t {
    let before = cpu_per_thread(pid);
    std::thread::sleep(Duration::from_millis(500));
    cpu_per_thread(pid)
        .into_iter()
        .map(|(tid, cpu)| (cpu - before.get(&tid).copied().unwrap_or(0).min(cpu), tid))
        .max()
        .map(|(_, tid)| tid)
        .expect("a training thread")
}

/// Stops only thread `tid` (see [`training_thread`]) with ptrace, as a deadlock would,
/// while the other threads of its process (the heartbeat's) run on. The thread that returns
/// keeps tracing it until it dies or `limit` passes, so that its death reaches its parent.
pub fn freeze_thread(tid: libc::pid_t, limit: Duration) -> std::thread::JoinHandle<bool> {
    let (frozen, told) = std::sync::mpsc::channel();
    let tracer = std::thread::spawn(move || {
        let pid = tid;
        // SAFETY: ptrace on a process of this test's; no memory is passed.
        let seized = unsafe {
            libc::ptrace(libc::PTRACE_SEIZE, pid, 0, 0) == 0
                && libc::ptrace(libc::PTRACE_INTERRUPT, pid, 0, 0) == 0
        };
        let _ = frozen.send(seized);
        let deadline = Instant::now() + limit;
        while seized && Instant::now() < deadline {
            let mut status = 0;
            // SAFETY: waitpid writes only the status it is given.
            let waited = unsafe { libc::waitpid(pid, &mut status, libc::__WALL | libc::WNOHANG) };
            if waited == pid && (libc::WIFSIGNALED(status) || libc::WIFEXITED(status)) {
                return true;
            }
            if waited < 0 {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: as above.
        unsafe { libc::ptrace(libc::PTRACE_DETACH, pid, 0, 0) };
        false
    });
    assert!(
        told.recv().unwrap(),
        "ptrace could not stop the worker's thread"
    );
    tracer
}
