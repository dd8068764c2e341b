//! A stop request from outside: SIGTERM or SIGINT (a cluster's pre-emption, Ctrl-C, or
//! `tandem launch` passing one on). The trainer finishes its step, agrees with the other
//! ranks to stop at the same step, writes a snapshot and exits with 128 + the signal's
//! number (130 after SIGINT, 143 after SIGTERM), as a shell expects of a stopped program.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context;

/// The flags the handlers set.
#[derive(Clone)]
pub struct StopSignal {
    /// Set by the first SIGTERM or SIGINT.
    pub requested: Arc<AtomicBool>,
    /// The number of the last stop signal received, 0 before any.
    received: Arc<AtomicUsize>,
}

impl StopSignal {
    /// The exit code for a run stopped on request: 128 + the signal this process received,
    /// or 143 (as after SIGTERM) when another rank's request stopped it.
    pub fn exit_code(&self) -> i32 {
        let signal = match self.received.load(Ordering::Relaxed) {
            0 => signal_hook::consts::SIGTERM,
            signal => signal as i32,
        };
        128 + signal
    }
}

/// Installs the handlers and returns the flags they set.
pub fn install() -> anyhow::Result<StopSignal> {
    let requested = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicUsize::new(0));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // A second signal while the first is being honoured ends the process at once.
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&requested))
            .context("cannot install the stop-signal handler")?;
        signal_hook::flag::register_usize(signal, Arc::clone(&received), signal as usize)
            .context("cannot install the stop-signal handler")?;
        signal_hook::flag::register(signal, Arc::clone(&requested))
            .context("cannot install the stop-signal handler")?;
    }
    Ok(StopSignal {
        requested,
        received,
    })
}
