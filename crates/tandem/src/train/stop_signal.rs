//! A stop request from outside: SIGTERM or SIGINT (a cluster's pre-emption, Ctrl-C, or
//! `tandem launch` passing one on). The trainer finishes its step, agrees with the other
//! ranks to stop at the same step and writes a snapshot. The rank that received the signal
//! then ends on it ([`StoppedBySignal`], [`end_on`]), and a rank stopped by another's request
//! exits with 143, so that whoever watches the process (a launcher, a scheduler, a shell)
//! sees a stop with the status a shell expects (130 after SIGINT, 143 after SIGTERM), not a
//! finished run.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context;
use tandem_dist::cluster::contract::STOPPED_ON_REQUEST;

/// The flags the handlers set.
#[derive(Clone)]
pub struct StopSignal {
    /// Set by the first SIGTERM or SIGINT.
    pub requested: Arc<AtomicBool>,
    /// The number of the last stop signal received, 0 before any.
    received: Arc<AtomicUsize>,
    /// Set until the run has something to save: a stop signal ends the process at once then.
    starting: Arc<AtomicBool>,
}

impl StopSignal {
    /// Says that the run is under way: from now on a stop signal is honoured at a step's end
    /// with a snapshot, rather than by ending the process at once.
    pub fn run_under_way(&self) {
        self.starting.store(false, Ordering::SeqCst);
    }

    /// The stop signal this process received, if any.
    pub fn received(&self) -> Option<i32> {
        let signal = self.received.load(Ordering::SeqCst);
        i32::try_from(signal).ok().filter(|&signal| signal != 0)
    }
}

/// Installs the handlers and returns the flags they set.
pub fn install() -> anyhow::Result<StopSignal> {
    let requested = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicUsize::new(0));
    let starting = Arc::new(AtomicBool::new(true));
    let second_signal_ends = !under_a_launcher();
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // Before the run is under way (its group forming, its data loading) there is nothing
        // to save, and a wait for peers may be long.
        signal_hook::flag::register_conditional_shutdown(
            signal,
            128 + signal,
            Arc::clone(&starting),
        )
        .context("cannot install the stop-signal handler")?;
        // A second signal while the first is being honoured ends the process at once.
        if second_signal_ends {
            signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&requested))
                .context("cannot install the stop-signal handler")?;
        }
        signal_hook::flag::register_usize(signal, Arc::clone(&received), signal as usize)
            .context("cannot install the stop-signal handler")?;
        signal_hook::flag::register(signal, Arc::clone(&requested))
            .context("cannot install the stop-signal handler")?;
    }
    Ok(StopSignal {
        requested,
        received,
        starting,
    })
}

/// Whether `tandem launch` started this worker. A signal sent to the whole job then reaches
/// the worker twice, directly and passed on by the launcher: Ctrl-C in a terminal signals the
/// foreground process group, and Slurm's `scancel` every process of the job. The second is
/// the same request, not an insistence; the launcher sends SIGKILL after its grace itself (at
/// once when it receives a second signal of its own).
fn under_a_launcher() -> bool {
    std::env::var_os(tandem_dist::cluster::contract::RESTART_COUNT_ENV).is_some()
}

/// The end of a run stopped on request: the snapshot is written, and the process should now
/// end on `signal` if it received it (see [`end_on`]), else exit with 128 + `signal`.
#[derive(Debug)]
pub struct StoppedBySignal {
    /// The signal received, or SIGTERM when another rank's request stopped this one.
    pub signal: i32,
    /// Whether this process received `signal` itself.
    pub received: bool,
    /// Its name, e.g. "SIGTERM".
    pub name: &'static str,
    /// The epoch in progress, counting from 1.
    pub epoch: u64,
    /// Optimizer steps done in that epoch.
    pub step: u64,
    /// The snapshot written before stopping.
    pub snapshot: String,
}

impl std::fmt::Display for StoppedBySignal {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let by = if self.received {
            format!("stopped by {}", self.name)
        } else {
            STOPPED_ON_REQUEST.to_string()
        };
        write!(
            formatter,
            "{by} at epoch {}, step {}; the snapshot is {}",
            self.epoch, self.step, self.snapshot
        )
    }
}

impl std::error::Error for StoppedBySignal {}

/// The name of a stop signal.
pub fn name(signal: i32) -> &'static str {
    match signal {
        signal_hook::consts::SIGTERM => "SIGTERM",
        signal_hook::consts::SIGINT => "SIGINT",
        _ => "a stop signal",
    }
}

/// Ends the process as a run stopped on request does: on the signal it received, with its
/// default action (termination) as if the handler had never been installed, or else (and
/// if that fails) with exit code 128 + the signal.
pub fn end_on(stopped: &StoppedBySignal) -> ! {
    let signal = stopped.signal;
    if !stopped.received {
        std::process::exit(128 + signal)
    }
    let _ = signal_hook::low_level::emulate_default_handler(signal);
    std::process::exit(128 + signal)
}
