//! Where the tests find the shared test data (the real CIFAR-10 and PyTorch's golden
//! outputs, which are not in the repository): `$TANDEM_SHARED`, else `shared/` beside the
//! checkout. Where the folder is missing, a test that needs it is skipped with the reason
//! printed; under `TANDEM_REQUIRE_SHARED=1` (as `.ci/run` sets) it fails instead.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The variable that names the shared folder.
pub const SHARED_ENV: &str = "TANDEM_SHARED";

/// The variable that, set to `1`, makes a missing shared folder fail the tests that need
/// it instead of skipping them.
pub const REQUIRE_SHARED_ENV: &str = "TANDEM_REQUIRE_SHARED";

/// Where the shared folder is expected: `$TANDEM_SHARED`, else `shared/` beside the
/// workspace's folder.
pub fn expected_shared_dir() -> PathBuf {
    match std::env::var_os(SHARED_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"),
    }
}

/// Whether a missing shared folder should fail the tests (`TANDEM_REQUIRE_SHARED=1`).
pub fn shared_required() -> bool {
    std::env::var(REQUIRE_SHARED_ENV).is_ok_and(|value| value == "1")
}

/// Whether the calling test may read the shared folder: true when it exists; false, with
/// the reason printed, when it does not. Panics (failing the test) where it is missing
/// under `TANDEM_REQUIRE_SHARED=1`. [`skip_without_shared!`] returns from the test on false.
pub fn shared_available() -> bool {
    let dir = expected_shared_dir();
    if dir.is_dir() {
        return true;
    }
    let reason = format!(
        "the shared test data is missing: no folder {} (set {SHARED_ENV} to the folder that \
         holds data/cifar10/ and golden/; the README's \"Tests\" says what it is)",
        dir.display()
    );
    assert!(
        !shared_required(),
        "{reason}, and {REQUIRE_SHARED_ENV}=1 requires it"
    );
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_string();
    // Straight to the standard error, past the test harness's capture, so that a plain
    // `cargo test` shows what it did not test.
    let _ = writeln!(std::io::stderr(), "skipped {test}: {reason}");
    false
}

/// Returns from the calling test (skipping it, with the reason printed) when the shared
/// folder is missing; see [`shared_available`].
#[macro_export]
macro_rules! skip_without_shared {
    () => {
        if !$crate::shared_available() {
            return;
        }
    };
}

/// The shared folder. Panics (failing the test) where it is missing: a test calls
/// [`skip_without_shared!`] first.
pub fn shared_dir() -> PathBuf {
    let dir = expected_shared_dir();
    assert!(
        dir.is_dir(),
        "the shared test data is missing: no folder {} (a test that reads it starts with \
         tandem_testdata::skip_without_shared!(), which skips it or, under \
         {REQUIRE_SHARED_ENV}=1, fails it)",
        dir.display()
    );
    dir
}

/// A file or folder under the shared folder. Panics (failing the test) where it is missing:
/// a shared folder without it is incomplete.
pub fn shared_path(relative: &str) -> PathBuf {
    let path = shared_dir().join(relative);
    assert!(
        path.exists(),
        "the shared test data is incomplete: {} is missing (set {SHARED_ENV} to the folder \
         that holds data/cifar10/ and golden/)",
        path.display()
    );
    path
}
