//! Helpers shared by the tests of tandem-cuda.

use tandem_cuda::{Library, Probe};

/// Environment variable that turns a missing NVRTC from a skip into a failure (CI sets it).
pub const REQUIRE_NVRTC_ENV: &str = "TANDEM_REQUIRE_NVRTC";

/// This process's probe when it found NVRTC; otherwise prints why and returns `None` (the
/// test skips), or fails when [`REQUIRE_NVRTC_ENV`] is `1`.
pub fn probe_with_nvrtc(test: &str) -> Option<&'static Probe> {
    let probe = Probe::process();
    match probe.get(Library::Nvrtc) {
        Ok(_) => Some(probe),
        Err(missing) => {
            assert!(
                std::env::var(REQUIRE_NVRTC_ENV).as_deref() != Ok("1"),
                "{REQUIRE_NVRTC_ENV}=1, but {missing}"
            );
            eprintln!("{test}: skipped, {missing}");
            None
        }
    }
}
