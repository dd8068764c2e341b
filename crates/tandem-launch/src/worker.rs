//! One worker process: started with its rank's environment, watched by a thread that notes
//! the exact moment it exits, stopped by pid with a signal.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tandem_dist::cluster::contract::{
    self, ERROR_FILE_ENV, GROUP_RANK_ENV, JOB_TOKEN_ENV, JOINER_ENV, KEEP_SURVIVORS_ENV,
    LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV, MASTER_ADDR_ENV, MASTER_PORT_ENV, RANK_ENV,
    RESTART_COUNT_ENV, STORE_HOSTED_ENV, STORE_PREFIX_ENV, STORE_REPLICAS_ENV, WORLD_SIZE_ENV,
};

use super::descriptors;
use super::logs::RankLog;
use super::signals::{self, signal_name};

/// What a worker needs to know about its place in the job (it receives it as environment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPlace {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// This node's `--node-rank`.
    pub node_rank: usize,
    /// This node's rank among the round's members (`GROUP_RANK`): its `--node-rank` unless
    /// an elastic round has fewer nodes.
    pub group_rank: usize,
    /// Workers in the whole job.
    pub world_size: usize,
    /// Workers on this node.
    pub local_world_size: usize,
}

/// The job-wide part of a worker's environment. No `Debug`: it holds the job token.
#[derive(Clone)]
pub struct JobEnv {
    /// Host of the store, as workers should reach it.
    pub master_addr: String,
    /// Port of the store.
    pub master_port: u16,
    /// The job token, as text.
    pub token: String,
    /// Which restart this round is (0 for the first round).
    pub restart_count: u32,
    /// Whether the workers re-form the job in-process when one is lost.
    pub keep_survivors: bool,
    /// Whether the worker starts in place of a lost one, to join the running job.
    pub joiner: bool,
    /// The replicas of a replicated store, as `HOST:PORT` entries separated by commas.
    pub store_replicas: Option<String>,
}

/// The environment variables a worker receives, in a fixed order.
pub fn worker_env(place: &WorkerPlace, job: &JobEnv, error_file: &Path) -> Vec<(String, String)> {
    let pairs = [
        (RANK_ENV, place.rank.to_string()),
        (LOCAL_RANK_ENV, place.local_rank.to_string()),
        (GROUP_RANK_ENV, place.group_rank.to_string()),
        (WORLD_SIZE_ENV, place.world_size.to_string()),
        (LOCAL_WORLD_SIZE_ENV, place.local_world_size.to_string()),
        (MASTER_ADDR_ENV, job.master_addr.clone()),
        (MASTER_PORT_ENV, job.master_port.to_string()),
        (JOB_TOKEN_ENV, job.token.clone()),
        (RESTART_COUNT_ENV, job.restart_count.to_string()),
        (STORE_PREFIX_ENV, contract::store_prefix(job.restart_count)),
        (STORE_HOSTED_ENV, "1".to_string()),
        (ERROR_FILE_ENV, error_file.display().to_string()),
    ];
    let flags = [
        (job.keep_survivors, KEEP_SURVIVORS_ENV),
        (job.joiner, JOINER_ENV),
    ];
    let flags = flags
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| (name.to_string(), "1".to_string()));
    let replicas = job
        .store_replicas
        .iter()
        .map(|replicas| (STORE_REPLICAS_ENV.to_string(), replicas.clone()));
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .chain(flags)
        .chain(replicas)
        .collect()
}

/// The path of rank `rank`'s error file under `log_dir`.
pub fn error_file_path(log_dir: &Path, rank: usize) -> PathBuf {
    log_dir.join("errors").join(format!("rank_{rank}.json"))
}

/// How a worker ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerEnd {
    /// Exited with code 0.
    Succeeded,
    /// Exited with a non-zero code on its own.
    ExitCode(i32),
    /// Killed by a signal the launcher did not send.
    Signal(i32),
    /// Ended after the launcher sent it `signal` (SIGTERM, or SIGKILL after the grace period).
    StoppedByLauncher {
        /// The last signal the launcher sent.
        signal: i32,
    },
    /// Was found stopped (SIGSTOP, a debugger) while the round was failing, most likely the
    /// peer the others gave up on, and was killed at once.
    Stuck,
    /// Sent no heartbeat for `millis` milliseconds (stopped when `stopped`: SIGSTOP or a
    /// debugger; else hung) and was killed at once.
    Silent {
        /// How long its heartbeat had not moved.
        millis: u64,
        /// Whether it was found stopped.
        stopped: bool,
    },
    /// Its heartbeat thread beat, but it used no CPU and waited for nobody for `idle_ms`
    /// milliseconds while `waiting_rank` waited `waited_ms` for it in a collective; killed
    /// at once.
    Stalled {
        /// How long it made no progress.
        idle_ms: u64,
        /// The rank that waited longest for it.
        waiting_rank: usize,
        /// That rank's node, when it runs on another node than the stalled worker.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        waiting_node: Option<usize>,
        /// How long that rank had waited.
        waited_ms: u64,
    },
    /// The program could not be started.
    NotStarted(String),
    /// Still running after SIGKILL and the wait that follows it.
    Unkillable,
}

impl WorkerEnd {
    /// True when this end is a failure of the worker itself (not one the launcher caused).
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            WorkerEnd::ExitCode(_)
                | WorkerEnd::Signal(_)
                | WorkerEnd::Stuck
                | WorkerEnd::Silent { .. }
                | WorkerEnd::Stalled { .. }
                | WorkerEnd::NotStarted(_)
        )
    }

    /// Whether the launcher killed it as the worker its peers were waiting for: found stopped
    /// or silent.
    pub fn gave_up_on(&self) -> bool {
        matches!(
            self,
            WorkerEnd::Stuck | WorkerEnd::Silent { .. } | WorkerEnd::Stalled { .. }
        )
    }

    /// A short description, e.g. "exited with code 3" or "stopped by the launcher (SIGTERM)".
    pub fn describe(&self) -> String {
        match self {
            WorkerEnd::Succeeded => "finished successfully".into(),
            WorkerEnd::ExitCode(code) => format!("exited with code {code}"),
            WorkerEnd::Signal(signal) => format!("killed by {}", signal_name(*signal)),
            WorkerEnd::StoppedByLauncher { signal } => {
                format!("stopped by the launcher ({})", signal_name(*signal))
            }
            WorkerEnd::Stuck => {
                "was stopped (SIGSTOP or a debugger) and stopped answering its peers; \
                 the launcher killed it (SIGKILL)"
                    .into()
            }
            WorkerEnd::Silent { millis, stopped } => format!(
                "sent no heartbeat for {:.1} s ({}); the launcher killed it (SIGKILL)",
                *millis as f64 / 1000.0,
                match stopped {
                    true => "it was stopped: SIGSTOP or a debugger",
                    false => "it runs but is hung",
                }
            ),
            WorkerEnd::Stalled {
                idle_ms,
                waiting_rank,
                waiting_node,
                waited_ms,
            } => format!(
                "made no progress for {:.1} s (no CPU time, no wait for its peers) while rank \
                 {waiting_rank}{} waited {:.1} s for it in a collective: it hangs; the launcher \
                 killed it (SIGKILL)",
                *idle_ms as f64 / 1000.0,
                waiting_node.map_or(String::new(), |node| format!(" (node {node})")),
                *waited_ms as f64 / 1000.0
            ),
            WorkerEnd::NotStarted(reason) => format!("could not start: {reason}"),
            WorkerEnd::Unkillable => "still running after SIGKILL".into(),
        }
    }
}

/// Where a running worker stands; shared with its exit-watching thread.
#[derive(Debug)]
struct ProcessState {
    pid: u32,
    exit: Option<(WorkerEnd, u64)>,
    launcher_signal: Option<i32>,
    /// The launcher killed it because it was found stopped.
    found_stopped: bool,
    /// The end the launcher gave it when it killed it as a worker that its peers wait for
    /// in vain (silent, or stalled).
    given_up: Option<WorkerEnd>,
}

/// A started (or failed-to-start) worker.
pub struct Worker {
    /// Its place in the job.
    pub place: WorkerPlace,
    /// Its error file.
    pub error_file: PathBuf,
    /// Its log for this round.
    pub log: RankLog,
    state: Arc<Mutex<ProcessState>>,
}

impl Worker {
    /// Starts `program args` with the worker environment `env`; its output (stdout and stderr
    /// together) goes to `log`, and to the console when `echo` is true. A program that cannot start gives a worker that
    /// has already ended with [`WorkerEnd::NotStarted`].
    pub fn start(
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        place: WorkerPlace,
        error_file: PathBuf,
        log: RankLog,
        echo: bool,
    ) -> Worker {
        let spawned = retry_while_short_of_resources(|| spawn(program, args, env, &log, echo));
        let state = spawned.unwrap_or_else(|failure| {
            Arc::new(Mutex::new(ProcessState {
                pid: 0,
                exit: Some((WorkerEnd::NotStarted(failure.to_string()), now_micros())),
                launcher_signal: None,
                found_stopped: false,
                given_up: None,
            }))
        });
        Worker {
            place,
            error_file,
            log,
            state,
        }
    }

    /// How it ended and when (microseconds since the Unix epoch), or `None` while it runs.
    pub fn end(&self) -> Option<(WorkerEnd, u64)> {
        lock(&self.state).exit.clone()
    }

    /// Sends `signal` unless the worker has already ended; the launcher is then held
    /// responsible for the end. Holding the state lock while signalling means the pid cannot
    /// have been reaped (and reused) in between.
    pub fn stop_with(&self, signal: i32) {
        let mut state = lock(&self.state);
        if state.exit.is_none() && !has_exited(state.pid) {
            state.launcher_signal = Some(signal);
            // ESRCH is impossible while unreaped; other errors leave the SIGKILL to come.
            let _ = signals::send_signal(state.pid, signal);
        }
    }

    /// Kills the worker at once (SIGKILL) if it is stopped (SIGSTOP, a debugger): it can
    /// neither answer its peers nor honour a SIGTERM. Returns whether it was.
    pub fn kill_if_stopped(&self) -> bool {
        let mut state = lock(&self.state);
        if state.exit.is_some() || state.found_stopped || !is_stopped(state.pid) {
            return false;
        }
        state.found_stopped = true;
        state.launcher_signal = Some(signals::SIGKILL);
        // SIGKILL ends a stopped process too; ESRCH is impossible while unreaped.
        let _ = signals::send_signal(state.pid, signals::SIGKILL);
        true
    }

    /// Kills a running worker that its peers wait for in vain (its heartbeat is silent, or
    /// it stalls); `end(stopped)` says why, given whether it was found stopped (SIGSTOP or a
    /// debugger). Returns that end, or `None` when it had already ended or been given up on.
    pub fn give_up_on(&self, end: impl FnOnce(bool) -> WorkerEnd) -> Option<WorkerEnd> {
        let mut state = lock(&self.state);
        if state.exit.is_some() || state.given_up.is_some() {
            return None;
        }
        let end = end(is_stopped(state.pid));
        state.given_up = Some(end.clone());
        state.launcher_signal = Some(signals::SIGKILL);
        // SIGKILL ends a stopped process too; ESRCH is impossible while unreaped.
        let _ = signals::send_signal(state.pid, signals::SIGKILL);
        Some(end)
    }

    /// The process id of a started worker.
    pub fn pid(&self) -> u32 {
        lock(&self.state).pid
    }

    /// Marks a worker that survived SIGKILL as [`WorkerEnd::Unkillable`] so the round can end.
    pub fn give_up(&self) {
        let mut state = lock(&self.state);
        if state.exit.is_none() {
            state.exit = Some((WorkerEnd::Unkillable, now_micros()));
        }
    }

    /// Waits (bounded by `deadline`) for the output of the worker to reach its log.
    pub fn flush_output(&mut self, deadline: Instant) -> bool {
        self.log.wait_for_pumps(deadline)
    }
}

/// Why a worker could not be started: what failed, and the system's error.
#[derive(Debug)]
pub struct SpawnError {
    what: String,
    error: std::io::Error,
}

impl SpawnError {
    fn new(what: impl Into<String>, error: std::io::Error) -> SpawnError {
        SpawnError {
            what: what.into(),
            error,
        }
    }
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "{}: {}",
            self.what,
            descriptors::explain(&self.error)
        )
    }
}

/// An error that comes down to one of the system's.
pub trait SystemError {
    /// The system's error.
    fn system_error(&self) -> &std::io::Error;
}

impl SystemError for std::io::Error {
    fn system_error(&self) -> &std::io::Error {
        self
    }
}

impl SystemError for SpawnError {
    fn system_error(&self) -> &std::io::Error {
        &self.error
    }
}

/// Spawns the worker with stdout and stderr on one pipe (so its log keeps their order) and
/// starts the threads that copy its output and watch for its exit.
fn spawn(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &RankLog,
    echo: bool,
) -> Result<Arc<Mutex<ProcessState>>, SpawnError> {
    let (output, output_for_stdout) = output_pipe()
        .map_err(|error| SpawnError::new("could not create its output pipe", error))?;
    let output_for_stderr = output_for_stdout
        .try_clone()
        .map_err(|error| SpawnError::new("could not create its output pipe", error))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .envs(env.iter().map(|(name, value)| (name, value)));
    command
        .stdin(Stdio::null())
        .stdout(output_for_stdout)
        .stderr(output_for_stderr);
    // SAFETY: the closure runs between fork and exec and only calls `setrlimit` and
    // `prctl`, which are async-signal-safe, after an atomic load.
    unsafe {
        command.pre_exec(|| {
            descriptors::restore_given_limit();
            die_with_the_launcher()
        });
    }
    let child = command
        .spawn()
        .map_err(|error| SpawnError::new(program.display().to_string(), error))?;
    // The command holds our copies of the pipe's write end: drop them, or the output would
    // never reach end-of-file.
    drop(command);
    watch(child, File::from(output), log, echo)
}

/// How long the launcher keeps retrying an action that fails for lack of resources.
const RESOURCE_RETRY_WINDOW: Duration = Duration::from_secs(20);
/// The first pause between such retries; it doubles up to [`RESOURCE_RETRY_MAX_PAUSE`].
const RESOURCE_RETRY_FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between such retries.
const RESOURCE_RETRY_MAX_PAUSE: Duration = Duration::from_secs(2);

/// Runs `attempt` until it succeeds, fails for another reason than a lack of resources
/// (descriptors, processes, memory), a stop signal arrives, or [`RESOURCE_RETRY_WINDOW`]
/// passes, pausing longer after each failure. A shortage is often brief (outsiders holding
/// connections, a peer's burst of files), and spending every restart on it ends the job.
pub fn retry_while_short_of_resources<T, E: SystemError>(
    mut attempt: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + RESOURCE_RETRY_WINDOW;
    let mut pause = RESOURCE_RETRY_FIRST_PAUSE;
    loop {
        match attempt() {
            Err(error)
                if is_resource_shortage(error.system_error())
                    && Instant::now() + pause < deadline
                    && signals::stop_requested().is_none() =>
            {
                thread::sleep(pause);
                pause = (pause * 2).min(RESOURCE_RETRY_MAX_PAUSE);
            }
            result => return result,
        }
    }
}

/// True for the errors that mean "not now": out of descriptors (EMFILE, ENFILE), processes
/// or threads (EAGAIN), or memory (ENOMEM).
fn is_resource_shortage(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::EAGAIN | libc::ENOMEM)
    )
}

/// A pipe whose ends close on exec (so no other worker inherits them): (read end, write end).
fn output_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors `pipe2` writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `pipe2` succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Makes the kernel kill the worker if the launcher dies (even by SIGKILL), so no worker
/// outlives its agent and keeps a job half-alive.
fn die_with_the_launcher() -> std::io::Result<()> {
    // SAFETY: `prctl(PR_SET_PDEATHSIG, signal)` has no memory-safety preconditions.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn lock(state: &Mutex<ProcessState>) -> MutexGuard<'_, ProcessState> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Starts the output pump and the exit-watching thread of a spawned child.
fn watch(
    child: Child,
    output: File,
    log: &RankLog,
    echo: bool,
) -> Result<Arc<Mutex<ProcessState>>, SpawnError> {
    let pid = child.id();
    let pump = log.pump(output, echo);
    let state = Arc::new(Mutex::new(ProcessState {
        pid,
        exit: None,
        launcher_signal: None,
        found_stopped: false,
        given_up: None,
    }));
    let watcher_state = Arc::clone(&state);
    let watcher = thread::Builder::new()
        .name(format!("watch-{pid}"))
        .spawn(move || watch_until_exit(child, &watcher_state));
    if let Err(error) = watcher.and(pump) {
        // Without a watcher nobody would reap it: end it now and report why.
        let _ = signals::send_signal(pid, signals::SIGKILL);
        return Err(SpawnError::new(
            "could not start the threads that watch it",
            error,
        ));
    }
    Ok(state)
}

/// Blocks until the child exits, notes the time, then reaps it under the state lock.
fn watch_until_exit(mut child: Child, state: &Mutex<ProcessState>) {
    let exited = wait_without_reaping(child.id());
    let ended_at = now_micros();
    let mut state = lock(state);
    let end = match (exited, child.wait()) {
        (Ok(()), Ok(_)) if state.given_up.is_some() => {
            state.given_up.take().unwrap_or(WorkerEnd::Stuck)
        }
        (Ok(()), Ok(_)) if state.found_stopped => WorkerEnd::Stuck,
        (Ok(()), Ok(status)) => classify(status, state.launcher_signal),
        (Err(error), _) | (_, Err(error)) => {
            WorkerEnd::NotStarted(format!("lost track of the process: {error}"))
        }
    };
    state.exit = Some((end, ended_at));
}

/// Waits until process `pid` has exited, leaving it a zombie so its pid stays reserved.
fn wait_without_reaping(pid: u32) -> std::io::Result<()> {
    loop {
        // SAFETY: `info` is a plain C struct that `waitid` fills in.
        let result = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if result == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// True when process `pid` has exited but the watcher has not reaped it yet: it ended on
/// its own, before any signal the launcher would send now.
fn has_exited(pid: u32) -> bool {
    // SAFETY: `info` is a plain C struct that `waitid` fills in; WNOHANG makes it return at once.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let result = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        result == 0 && info.si_pid() != 0
    }
}

/// True when process `pid` is stopped by a signal or a tracer (state `T` or `t` in
/// `/proc/<pid>/stat`).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name, which may itself hold ") ".
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
    })
}

fn classify(status: std::process::ExitStatus, launcher_signal: Option<i32>) -> WorkerEnd {
    if let Some(signal) = launcher_signal {
        return WorkerEnd::StoppedByLauncher { signal };
    }
    match (status.code(), status.signal()) {
        (Some(0), _) => WorkerEnd::Succeeded,
        (Some(code), _) => WorkerEnd::ExitCode(code),
        (None, Some(signal)) => WorkerEnd::Signal(signal),
        (None, None) => WorkerEnd::ExitCode(-1),
    }
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_get_torchruns_variables_and_tandems_own() {
        let place = WorkerPlace {
            rank: 5,
            local_rank: 1,
            node_rank: 2,
            group_rank: 2,
            world_size: 8,
            local_world_size: 2,
        };
        let job = JobEnv {
            master_addr: "node0".into(),
            master_port: 29500,
            token: "secret".into(),
            restart_count: 3,
            keep_survivors: false,
            joiner: false,
            store_replicas: None,
        };
        let env = worker_env(&place, &job, Path::new("/runs/a/errors/rank_5.json"));
        let expected = [
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
            ("GROUP_RANK", "2"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TANDEM_JOB_TOKEN", "secret"),
            ("TANDEM_RESTART_COUNT", "3"),
            ("TANDEM_STORE_PREFIX", "round3/pg"),
            ("TANDEM_STORE_HOSTED", "1"),
            ("TANDEM_ERROR_FILE", "/runs/a/errors/rank_5.json"),
        ];
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        assert_eq!(env, expected);
    }

    #[test]
    fn a_shortage_of_resources_is_retried_and_other_errors_are_not() {
        let mut attempts = 0;
        let result = retry_while_short_of_resources(|| {
            attempts += 1;
            match attempts {
                1 => Err(std::io::Error::from_raw_os_error(libc::EMFILE)),
                2 => Err(std::io::Error::from_raw_os_error(libc::EAGAIN)),
                _ => Ok(attempts),
            }
        });
        assert_eq!(result.unwrap(), 3);

        let mut attempts = 0;
        let result: std::io::Result<()> = retry_while_short_of_resources(|| {
            attempts += 1;
            Err(std::io::Error::from_raw_os_error(libc::ENOENT))
        });
        assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::ENOENT));
        assert_eq!(attempts, 1);
    }

    #[test]
    fn only_failures_of_the_worker_itself_count() {
        assert!(WorkerEnd::ExitCode(1).is_failure());
        assert!(WorkerEnd::Signal(libc::SIGSEGV).is_failure());
        assert!(WorkerEnd::NotStarted("gone".into()).is_failure());
        assert!(WorkerEnd::Stuck.is_failure());
        assert!(!WorkerEnd::Succeeded.is_failure());
        assert!(!WorkerEnd::StoppedByLauncher {
            signal: libc::SIGKILL
        }
        .is_failure());
        assert_eq!(
            WorkerEnd::Signal(libc::SIGSEGV).describe(),
            "killed by SIGSEGV"
        );
        assert_eq!(
            WorkerEnd::StoppedByLauncher {
                signal: libc::SIGKILL
            }
            .describe(),
            "stopped by the launcher (SIGKILL)"
        );
    }

    #[test]
    fn a_stall_names_the_waiting_ranks_node_when_it_is_another() {
        let stalled = |waiting_node| WorkerEnd::Stalled {
            idle_ms: 1100,
            waiting_rank: 0,
            waiting_node,
            waited_ms: 1200,
        };
        let tail =
            "waited 1.2 s for it in a collective: it hangs; the launcher killed it (SIGKILL)";
        let local = stalled(None).describe();
        assert!(local.ends_with(&format!("while rank 0 {tail}")), "{local}");
        let remote = stalled(Some(3)).describe();
        assert!(
            remote.ends_with(&format!("while rank 0 (node 3) {tail}")),
            "{remote}"
        );
        let json = r#"{"Stalled":{"idle_ms":1100,"waiting_rank":0,"waited_ms":1200}}"#;
        let read: WorkerEnd = serde_json::from_str(json).unwrap();
        assert_eq!(read, stalled(None));
        assert_eq!(serde_json::to_string(&stalled(None)).unwrap(), json);
    }
}
