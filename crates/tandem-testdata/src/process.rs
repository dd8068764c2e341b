//! Running a child process with a bound on its time, so that a hung program fails its test
//! with both of its streams instead of hanging the suite.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `command` to completion within `limit`, its streams captured, killing it and
/// failing the test past that.
pub fn run_bounded(command: &mut Command, limit: Duration) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {:?}: {error}", command.get_program()));
    wait_bounded(child, limit)
}

/// Waits for a child within `limit`, killing it and failing the test past that.
pub fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait().expect("cannot poll child") {
            Some(_) => return child.wait_with_output().expect("cannot collect output"),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let output = child.wait_with_output().expect("cannot collect output");
                panic!(
                    "command took longer than {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Asserts that a child succeeded and returns its stdout, showing both streams on failure.
pub fn expect_success(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "tandem failed with {}\nstdout:\n{stdout}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Asserts that a child failed and returns its stderr, showing both streams where it
/// succeeded.
pub fn expect_failure(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(
        !output.status.success(),
        "the command succeeded, where it should fail\nstdout:\n{}\nstderr:\n{stderr}",
        String::from_utf8_lossy(&output.stdout)
    );
    stderr
}
