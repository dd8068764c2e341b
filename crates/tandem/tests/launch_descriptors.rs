//! `tandem launch` and its limit on open files, through the real binary with `sh` workers:
//! the launcher raises its soft limit to the hard one (so more workers start than the soft
//! limit allows) and gives the workers the soft limit it was given; when even the hard limit
//! is too low, spawning a worker fails with EMFILE and the job ends with one error naming
//! the worker, the limit and what to do, leaving no process behind.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{assert_contains, tandem, Launcher};

/// Bound on any launcher in these tests: the spawn is retried for 20 s before it fails.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(120);

/// Starts `tandem launch --standalone --nproc-per-node <nproc> --max-restarts 0 -- sh -c
/// <script>` in `dir`, with the limit on open files set to `soft` and `hard`, and
/// `TANDEM_TEST_MARKER` set to `dir` so that its processes can be found.
fn launch_with_limit(dir: &Path, nproc: usize, script: &str, soft: u64, hard: u64) -> Launcher {
    let mut command = tandem();
    command
        .args(["launch", "--standalone", "--nproc-per-node"])
        .arg(nproc.to_string())
        .args(["--max-restarts", "0", "--", "sh", "-c", script])
        .current_dir(dir)
        .env_remove("TANDEM_JOB_TOKEN")
        .env("TANDEM_TEST_MARKER", dir);
    // SAFETY: runs between fork and exec and only calls `setrlimit`, which is
    // async-signal-safe; lowering a limit needs no privileges.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    Launcher::spawn(command, dir, "launcher")
}

/// The live (not zombie) processes whose environment holds `TANDEM_TEST_MARKER=<dir>`.
fn processes_marked_with(dir: &Path) -> Vec<u32> {
    let marker = format!("TANDEM_TEST_MARKER={}", dir.display());
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let marked = std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
                environ
                    .split(|&byte| byte == 0)
                    .any(|entry| entry == marker.as_bytes())
            });
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('Z'))
            });
            marked && !zombie
        })
        .collect()
}

/// Asserts that no process started for `dir` outlives its launcher (waiting at most 10 s
/// for the kernel to finish them).
fn assert_nothing_left(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = processes_marked_with(dir);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "processes of the job outlived the launcher: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_launcher_raises_its_soft_limit_and_gives_the_workers_the_one_it_was_given() {
    let dir = tempfile::tempdir().unwrap();
    // Each worker holds two descriptors in the launcher while it runs: 48 of them at once
    // need more than the soft limit of 64, less than the hard limit of 256.
    let workers = 48;
    let script = format!(
        "(ulimit -Sn; ulimit -Hn) > soft_$RANK.tmp && mv soft_$RANK.tmp soft_$RANK; \
         if [ $RANK = 0 ]; then grep 'Max open files' /proc/$PPID/limits > launcher_limits; fi; \
         count() {{ ls | grep -c '^soft_[0-9]*$'; }}; \
         i=0; while [ $(count) -lt {workers} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; \
         [ $(count) -ge {workers} ]"
    );
    let mut launcher = launch_with_limit(dir.path(), workers, &script, 64, 256);
    let status = launcher.wait(LAUNCH_TIMEOUT);
    let stderr = launcher.stderr();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert_contains(&stderr, "every worker finished successfully");
    for rank in 0..workers {
        let limits = std::fs::read_to_string(dir.path().join(format!("soft_{rank}"))).unwrap();
        assert_eq!(limits, "64\n256\n", "rank {rank}");
    }
    let launcher_limits = std::fs::read_to_string(dir.path().join("launcher_limits")).unwrap();
    assert_eq!(
        launcher_limits.split_whitespace().collect::<Vec<_>>(),
        ["Max", "open", "files", "256", "256", "files"]
    );
    assert_nothing_left(dir.path());
}

#[test]
fn a_spawn_failing_with_emfile_ends_the_job_naming_the_worker_the_limit_and_the_remedy() {
    let dir = tempfile::tempdir().unwrap();
    let workers = 64;
    // A hard limit of 64 too: the launcher cannot raise its way out.
    let mut launcher = launch_with_limit(dir.path(), workers, "exec sleep 60", 64, 64);
    let status = launcher.wait(LAUNCH_TIMEOUT);
    let stderr = launcher.stderr();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Which rank runs out depends on what the launcher holds open before its workers.
    let rank: usize = stderr
        .split("root cause: rank ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|rank| rank.parse().ok())
        .unwrap_or_else(|| panic!("no root cause naming a rank:\n{stderr}"));
    assert!(
        (1..workers - 1).contains(&rank),
        "rank {rank} ran out:\n{stderr}"
    );
    assert_contains(
        &stderr,
        &format!(
            "tandem launch: rank {rank} could not start, so the {} worker(s) after it on this \
             node were not started either\n",
            workers - rank - 1
        ),
    );
    let others: String = (0..rank)
        .map(|other| format!("  rank {other}: stopped by the launcher (SIGTERM)\n"))
        .collect();
    let summary = format!(
        "error: the job failed in round 0 and no restart is left (--max-restarts 0)\n\
         root cause: rank {rank} (node 0, local rank {rank}) could not start: sh: Too many open \
         files (os error 24): the launcher reached its limit of 64 open files (hard limit 64); \
         raise it with `ulimit -n` before starting the launcher (above the hard limit as root, \
         or with `nofile` in /etc/security/limits.conf), or start fewer workers per node \
         (--nproc-per-node)\nother ranks:\n{others}"
    );
    assert!(stderr.ends_with(&summary), "{stderr}");
    assert_nothing_left(dir.path());
}
