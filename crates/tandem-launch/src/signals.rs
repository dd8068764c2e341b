//! Signals: catching SIGTERM / SIGINT sent to the launcher, sending signals to workers,
//! and naming signals in messages.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// The last stop signal the launcher received (0: none yet).
static LAST_STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many stop signals the launcher received; a second one means "stop now".
static STOP_SIGNAL_COUNT: AtomicU32 = AtomicU32::new(0);

/// The signal the launcher sends to stop a worker politely.
pub const SIGTERM: i32 = libc::SIGTERM;
/// The signal the launcher sends when the grace period is over.
pub const SIGKILL: i32 = libc::SIGKILL;

extern "C" fn record_stop_signal(signal: libc::c_int) {
    // Only async-signal-safe work here: two atomic stores.
    LAST_STOP_SIGNAL.store(signal, Ordering::SeqCst);
    STOP_SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Makes SIGTERM and SIGINT set a flag instead of killing the launcher, so it can stop its
/// workers first. Read the flag with [`stop_requested`].
pub fn catch_stop_signals() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `sigaction` is given a zeroed, then fully initialised struct, and the handler
        // only touches atomics, which is async-signal-safe.
        let result = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction =
                record_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if result != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A stop signal the launcher received: which one, and how many so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopRequest {
    /// The last signal received (SIGTERM or SIGINT).
    pub signal: i32,
    /// How many stop signals arrived; two or more means the user insists.
    pub count: u32,
}

/// The stop signals received so far, if any.
pub fn stop_requested() -> Option<StopRequest> {
    let count = STOP_SIGNAL_COUNT.load(Ordering::SeqCst);
    (count > 0).then(|| StopRequest {
        signal: LAST_STOP_SIGNAL.load(Ordering::SeqCst),
        count,
    })
}

/// Sends `signal` to the process `pid`.
pub fn send_signal(pid: u32, signal: i32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("pid {pid} is out of range"),
        )
    })?;
    // SAFETY: `kill` has no memory-safety preconditions.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The conventional name of a signal, e.g. "SIGTERM", or "signal 42".
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_named() {
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(11), "SIGSEGV");
        assert_eq!(signal_name(63), "signal 63");
    }
}
