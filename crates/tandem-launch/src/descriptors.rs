//! The launcher's limit on open files (`RLIMIT_NOFILE`). Each worker holds a pipe and a log
//! file open in the launcher, and the store a socket per client, so the launcher raises its
//! soft limit to the hard one at start. The workers get back the soft limit the launcher was
//! given: programs using `select()` rely on it. Running out anyway is explained with the
//! limits and what to do.

use std::sync::OnceLock;

/// The soft and hard limits the launcher was started with, once it has raised its own.
static GIVEN_LIMIT: OnceLock<libc::rlimit> = OnceLock::new();

/// Raises this process's soft limit on open files to its hard limit, keeping the given one
/// for [`restore_given_limit`]. A limit that cannot be read or raised is left as it is: the
/// launcher runs within it, and [`explain`] says what to do if it runs out.
pub fn raise_soft_limit() {
    let Some(given) = current_limit() else {
        return;
    };
    if given.rlim_cur >= given.rlim_max {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: given.rlim_max,
        rlim_max: given.rlim_max,
    };
    // SAFETY: `setrlimit` reads the one `rlimit` it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        let _ = GIVEN_LIMIT.set(given);
    }
}

/// Gives the calling process the soft limit the launcher was started with, if the launcher
/// raised its own. Meant for a worker between fork and exec: it only reads an initialized
/// `OnceLock` and calls `setrlimit`, both async-signal-safe. Lowering a soft limit cannot
/// fail for want of privileges, and a worker left with the higher limit still runs, so the
/// result of `setrlimit` is not checked.
pub fn restore_given_limit() {
    if let Some(given) = GIVEN_LIMIT.get() {
        // SAFETY: `setrlimit` reads the one `rlimit` it is given.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, given) };
    }
}

/// `error` in words, followed by what to do when it is a lack of file descriptors: this
/// process's limit (EMFILE) or the system's (ENFILE).
pub fn explain(error: &std::io::Error) -> String {
    match error.raw_os_error() {
        Some(libc::EMFILE) => {
            let limits = current_limit().map_or_else(
                || "its limit of open files".to_string(),
                |limit| {
                    format!(
                        "its limit of {} open files (hard limit {})",
                        count(limit.rlim_cur),
                        count(limit.rlim_max)
                    )
                },
            );
            format!(
                "{error}: the launcher reached {limits}; raise it with `ulimit -n` before \
                 starting the launcher (above the hard limit as root, or with `nofile` in \
                 /etc/security/limits.conf), or start fewer workers per node \
                 (--nproc-per-node)"
            )
        }
        Some(libc::ENFILE) => format!(
            "{error}: the system's table of open files is full; close programs holding many \
             files, or raise `fs.file-max` (sysctl)"
        ),
        _ => error.to_string(),
    }
}

/// This process's limits on open files, or `None` when they cannot be read.
fn current_limit() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

/// A limit in words: its number, or "unlimited".
fn count(limit: libc::rlim_t) -> String {
    match limit {
        libc::RLIM_INFINITY => "unlimited".to_string(),
        limit => limit.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lack_of_descriptors_gets_advice() {
        let limit = current_limit().expect("readable limits");
        let emfile = explain(&std::io::Error::from_raw_os_error(libc::EMFILE));
        assert_eq!(
            emfile,
            format!(
                "Too many open files (os error 24): the launcher reached its limit of {} open \
                 files (hard limit {}); raise it with `ulimit -n` before starting the launcher \
                 (above the hard limit as root, or with `nofile` in /etc/security/limits.conf), \
                 or start fewer workers per node (--nproc-per-node)",
                count(limit.rlim_cur),
                count(limit.rlim_max)
            )
        );
        assert_eq!(
            explain(&std::io::Error::from_raw_os_error(libc::ENFILE)),
            "Too many open files in system (os error 23): the system's table of open files is \
             full; close programs holding many files, or raise `fs.file-max` (sysctl)"
        );
        assert_eq!(
            explain(&std::io::Error::from_raw_os_error(libc::ENOENT)),
            "No such file or directory (os error 2)"
        );
        assert_eq!(count(libc::RLIM_INFINITY), "unlimited");
    }
}
