//! A stop request from outside: SIGTERM or SIGINT (a cluster's pre-emption, Ctrl-C, or
//! `tandem launch` passing one on). The trainer finishes its step, agrees with the other
//! ranks to stop at the same step, writes a snapshot and exits. The rank that received the
//! signal then ends on it ([`StoppedBySignal`]), so that whoever watches the process (a
//! launcher, a scheduler, a shell) sees a stop, not a finished run.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::Context;

/// The last stop signal this process received (0: none).
static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// Installs the handlers and returns the flag they set.
pub fn install() -> anyhow::Result<Arc<AtomicBool>> {
    let stop_requested = Arc::new(AtomicBool::new(false));
    let received = Arc::clone(RECEIVED.get_or_init(|| Arc::new(AtomicUsize::new(0))));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // A second signal while the first is being honoured ends the process at once.
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&stop_requested))
            .context("cannot install the stop-signal handler")?;
        signal_hook::flag::register(signal, Arc::clone(&stop_requested))
            .context("cannot install the stop-signal handler")?;
        signal_hook::flag::register_usize(signal, Arc::clone(&received), signal as usize)
            .context("cannot install the stop-signal handler")?;
    }
    Ok(stop_requested)
}

/// The stop signal this process received, if any.
pub fn received() -> Option<i32> {
    let signal = RECEIVED.get()?.load(Ordering::SeqCst);
    i32::try_from(signal).ok().filter(|&signal| signal != 0)
}

/// The end of a run that stopped because this process received `signal`: the snapshot is
/// written, and the process should now end on the signal (see [`end_on`]).
#[derive(Debug)]
pub struct StoppedBySignal {
    /// The signal received.
    pub signal: i32,
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
        write!(
            formatter,
            "stopped by {} at epoch {}, step {}; the snapshot is {}",
            self.name, self.epoch, self.step, self.snapshot
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

/// Ends the process on `signal` with its default action (termination), as if the handler
/// had never been installed; exits with 128 + `signal` if that fails.
pub fn end_on(signal: i32) -> ! {
    let _ = signal_hook::low_level::emulate_default_handler(signal);
    std::process::exit(128 + signal)
}
