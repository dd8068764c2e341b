//! What a test that needs the shared folder does without it: this test binary runs its own
//! `probe_entry` as a child, with the folder present, absent, and absent under
//! `TANDEM_REQUIRE_SHARED=1`.

use std::path::Path;
use std::process::{Command, Output};

/// Set in the child, where `probe_entry` does its work.
const PROBE_ENV: &str = "TANDEM_TESTDATA_PROBE";

/// The child's side: skips without the shared folder, else prints the folder (shown when
/// the child fails) and reads `golden` in it.
#[test]
fn probe_entry() {
    if std::env::var_os(PROBE_ENV).is_none() {
        return;
    }
    tandem_testdata::skip_without_shared!();
    println!("reached with {}", tandem_testdata::shared_dir().display());
    assert!(tandem_testdata::shared_path("golden").is_dir());
}

/// Runs `probe_entry` in a child with the shared folder at `shared`, its output captured
/// by the test harness as in a plain `cargo test`.
fn probe(shared: &Path, required: bool) -> Output {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", "probe_entry", "--test-threads", "1"])
        .env(PROBE_ENV, "1")
        .env("TANDEM_SHARED", shared)
        .env_remove("TANDEM_REQUIRE_SHARED");
    if required {
        command.env("TANDEM_REQUIRE_SHARED", "1");
    }
    command.output().unwrap()
}

/// Both streams of a child, for the assertions' messages.
fn both_streams(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The probe run with its shared folder missing, under `TANDEM_REQUIRE_SHARED=1` when
/// `require`: whether it succeeded, what it printed, and the missing folder.
fn probe_without_the_folder(require: bool) -> (bool, String, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-shared");
    let output = probe(&missing, require);
    (output.status.success(), both_streams(&output), missing)
}

#[test]
fn a_missing_folder_skips_with_the_reason_printed() {
    let (succeeded, text, missing) = probe_without_the_folder(false);
    assert!(succeeded, "{text}");
    assert!(
        text.contains(&format!(
            "skipped probe_entry: the shared test data is missing: no folder {} (set TANDEM_SHARED",
            missing.display()
        )),
        "{text}"
    );
    assert!(!text.contains("reached with"), "{text}");
}

#[test]
fn a_missing_folder_fails_under_tandem_require_shared() {
    let (succeeded, text, _) = probe_without_the_folder(true);
    assert!(!succeeded, "{text}");
    assert!(
        text.contains("and TANDEM_REQUIRE_SHARED=1 requires it"),
        "{text}"
    );
    assert!(!text.contains("reached with"), "{text}");
}

#[test]
fn a_present_folder_is_read_and_a_missing_file_in_it_fails() {
    let dir = tempfile::tempdir().unwrap();
    let output = probe(dir.path(), false);
    let text = both_streams(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains(&format!("reached with {}", dir.path().display())),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "the shared test data is incomplete: {} is missing",
            dir.path().join("golden").display()
        )),
        "{text}"
    );
    std::fs::create_dir(dir.path().join("golden")).unwrap();
    let output = probe(dir.path(), true);
    let text = both_streams(&output);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
    assert!(!text.contains("skipped"), "{text}");
}
