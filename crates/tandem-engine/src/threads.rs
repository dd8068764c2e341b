//! The global thread count honoured by every kernel.

use std::sync::atomic::{AtomicUsize, Ordering};

/// 0 means "not set": use the number of cores available.
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the number of worker threads every kernel splits its work into.
///
/// The first call also builds rayon's global pool with `n` threads. Call it before any
/// other rayon use; if the pool already exists, kernels still split their work into `n`
/// fixed parts (so results depend only on `n`), run on the existing pool.
pub fn set_threads(n: usize) {
    let n = n.max(1);
    THREADS.store(n, Ordering::Relaxed);
    // An error only means the global pool was built before; the partitioning above still holds.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
}

/// The number of worker threads kernels use: the value given to [`set_threads`], or the
/// number of cores available.
pub fn threads() -> usize {
    match THREADS.load(Ordering::Relaxed) {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// Runs `work` on one of the kernel threads. Kernels called from there hand their parts to
/// the other threads from inside the pool, where a waiting thread steals work and idle
/// threads spin briefly; called from outside it, every kernel call costs a wake-up of a
/// sleeping thread and a wait on a lock, which adds up over the hundreds of kernel calls of a
/// training step. Kernels split their work the same way either way, so results do not change.
pub fn run_on_kernel_threads<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| work())
}
