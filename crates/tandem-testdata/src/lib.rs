//! The workspace's test kit, a dev-dependency only: where the shared test data is, a free
//! loopback port, float comparisons with a stated tolerance or to the bit, running a child
//! process with a bound on its time, assertions on the text it printed, and hand-made PNGs
//! and `.tar.gz` archives.
//!
//! The shared test data (the real CIFAR-10 and PyTorch's golden outputs) is not in the
//! repository. A test that reads it starts with [`skip_without_shared!`], then finds its
//! files with [`shared_path`] or [`shared_dir`]:
//!
//! ```no_run
//! #[test]
//! fn reads_the_real_data() {
//!     tandem_testdata::skip_without_shared!();
//!     let archive = tandem_testdata::shared_path("data/cifar10/cifar-10-batches-bin.tar.gz");
//!     assert!(std::fs::metadata(archive).unwrap().len() > 0);
//! }
//! ```

pub mod archive;
pub mod close;
pub mod png;
pub mod ports;
pub mod process;
mod shared;
pub mod text;

pub use close::{assert_bits_equal, assert_close, assert_close_one, Tolerance};
pub use ports::free_port;
pub use process::{expect_failure, expect_success, run_bounded, wait_bounded};
pub use shared::{
    expected_shared_dir, shared_available, shared_dir, shared_path, shared_required,
    REQUIRE_SHARED_ENV, SHARED_ENV,
};
pub use text::assert_contains;
