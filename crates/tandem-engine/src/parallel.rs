//! Fixed partitioning of work among workers, so that reductions never depend on scheduling.

/// Number of rows per chunk for memory-bound passes over `[rows, channels]` data, so each
/// chunk moves a cache-friendly amount of data.
pub(crate) fn elementwise_rows_per_chunk(channels: usize) -> usize {
    const CHUNK_VALUES: usize = 1 << 14;
    (CHUNK_VALUES / channels.max(1)).max(1)
}
