//! The launch shapes of our kernels: how many threads and blocks each launch runs.

use cudarc::driver::LaunchConfig;

/// Rows a block of the column sums (`bn_stats`, `bn_backward_sums`) adds in their first pass;
/// fixed, so that the order of every sum depends only on the shape.
pub const ROWS_PER_BLOCK: usize = 256;

/// Row blocks of a column sum over `rows` rows.
pub fn row_blocks(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_BLOCK).max(1)
}

/// Channels a block of the column sums adds (`CHANNEL_LANES` in `batchnorm.cu`).
pub const CHANNELS_PER_BLOCK: usize = 32;

/// Groups of [`CHANNELS_PER_BLOCK`] channels of a column sum over `channels` columns: the
/// launch's blocks on the grid's y, and its arrival counters.
pub fn channel_groups(channels: usize) -> usize {
    channels.div_ceil(CHANNELS_PER_BLOCK).max(1)
}

/// One thread per element, 256 to a block.
pub fn per_element(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch of the batch-norm column sums (`bn_stats`, `bn_backward_sums`): blocks of 32
/// channels by 8 row lanes, one block per row block of `rows_per_block` rows (on the grid's x,
/// which holds 2^31 - 1 blocks) and per 32 channels (on y, one arrival counter each).
pub fn column_sums(channels: usize, row_blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (row_blocks as u32, channel_groups(channels) as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}
