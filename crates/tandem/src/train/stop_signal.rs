//! A stop request from outside: SIGTERM or SIGINT (a cluster's pre-emption, Ctrl-C, or
//! `tandem launch` passing one on). The trainer finishes its step, agrees with the other
//! ranks to stop at the same step, writes a snapshot and exits.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;

/// Installs the handlers and returns the flag they set.
pub fn install() -> anyhow::Result<Arc<AtomicBool>> {
    let stop_requested = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // A second signal while the first is being honoured ends the process at once.
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&stop_requested))
            .context("cannot install the stop-signal handler")?;
        signal_hook::flag::register(signal, Arc::clone(&stop_requested))
            .context("cannot install the stop-signal handler")?;
    }
    Ok(stop_requested)
}
