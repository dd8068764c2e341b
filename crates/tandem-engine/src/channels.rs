//! Per-channel building blocks shared by the batch-norm and convolution kernels: column
//! sums of `[rows, channels]` tensors taken in a fixed order, and per-channel values
//! repeated over a tile of rows. A leaf: it imports no kernel module.

use crate::simd::multiversion;

/// Per-channel values repeated over enough rows that per-element loops run over long
/// contiguous slices (which vectorize) instead of one short row at a time.
#[derive(Clone, Debug, Default)]
pub(crate) struct ChannelTile {
    pub(crate) values: Vec<f32>,
}

impl ChannelTile {
    /// Values per tile; a whole number of rows.
    const TARGET_LEN: usize = 256;

    /// The tile length for `channels` channels.
    fn len_for(channels: usize) -> usize {
        (Self::TARGET_LEN / channels.max(1)).max(1) * channels
    }

    /// Refills the tile with `value(channel)`, reusing its buffer.
    pub(crate) fn refill(&mut self, channels: usize, value: impl Fn(usize) -> f32) {
        self.values.clear();
        let rows = Self::len_for(channels) / channels.max(1);
        for _ in 0..rows {
            self.values.extend((0..channels).map(&value));
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.values.len()
    }
}

/// Per-channel sums and sums of squares of a `[rows, channels]` tensor, gathered part by
/// part in a fixed order: by the batch norm's statistics over the rows of each worker, or by a
/// convolution over each chunk of its output while the chunk is still in cache. Values are
/// added in f32 over blocks of [`BLOCK_ROWS`] rows, then in f64.
#[derive(Default)]
pub(crate) struct ColumnSums {
    channels: usize,
    /// `[Σx per channel…, Σx² per channel…]`.
    totals: Vec<f64>,
}

impl ColumnSums {
    /// Starts over for a tensor of `channels` channels.
    pub(crate) fn reset(&mut self, channels: usize) {
        self.channels = channels;
        self.totals.clear();
        self.totals.resize(2 * channels, 0.0);
    }

    /// Adds the values of `rows` (whole rows of `channels` values).
    pub(crate) fn add(&mut self, rows: &[f32]) {
        let (sums, sums_sq) = self.totals.split_at_mut(self.channels);
        sum_columns(rows, sums, sums_sq);
    }

    /// Adds this part's `[Σx per channel…, Σx² per channel…]` into `totals`.
    pub(crate) fn add_to(&self, totals: &mut [f64]) {
        assert_eq!(
            totals.len(),
            self.totals.len(),
            "column sums: totals length"
        );
        widen_f64_into(&self.totals, totals);
    }
}

/// Rows added in f32 before a column's partial sums are added into its f64 totals: few
/// enough that the f32 sums lose only a few ulps, enough to amortize the widening.
pub(crate) const BLOCK_ROWS: usize = 16;

/// Values per line when narrow rows are read several at a time (one 16-lane group).
pub(crate) const LINE: usize = 16;

/// Whether rows of `channels` values are read several to a line: when they are narrower than
/// a line and fill it exactly (otherwise each row is a line).
pub(crate) fn rows_fill_lines(channels: usize) -> bool {
    channels > 0 && channels < LINE && LINE.is_multiple_of(channels)
}

/// Adds each line position's total into its channel's (positions repeat the channels).
pub(crate) fn fold_line(line: &[f64; LINE], totals: &mut [f64]) {
    let channels = totals.len().max(1);
    for (position, value) in line.iter().enumerate() {
        totals[position % channels] += value;
    }
}

multiversion! {
    /// Adds each column's Σx and Σx² over `rows` (whole rows of `sums.len()` values) into
    /// `sums` and `sums_sq`.
    fn sum_columns(rows: &[f32], sums: &mut [f64], sums_sq: &mut [f64]) {
        let channels = sums.len();
        if !rows_fill_lines(channels) {
            sum_lines(rows, channels, [sums, sums_sq]);
            return;
        }
        // Lines of several rows, folded into the channels at the end; rows after the last
        // whole line go one by one.
        let whole = rows.len() / LINE * LINE;
        let (mut line_sum, mut line_sum_sq) = ([0f64; LINE], [0f64; LINE]);
        sum_lines(&rows[..whole], LINE, [&mut line_sum, &mut line_sum_sq]);
        fold_line(&line_sum, sums);
        fold_line(&line_sum_sq, sums_sq);
        sum_lines(&rows[whole..], channels, [sums, sums_sq]);
    }
}

/// [`sum_columns`] over lines of `width` values, block by block of [`BLOCK_ROWS`] lines,
/// each block column group by column group (up to 32 columns, whose sums stay in registers).
#[inline(always)]
fn sum_lines(lines: &[f32], width: usize, [sums, sums_sq]: [&mut [f64]; 2]) {
    for block in lines.chunks(width * BLOCK_ROWS) {
        let mut start = 0;
        while start < width {
            let totals = [&mut sums[start..], &mut sums_sq[start..]];
            start += match width - start {
                32.. => sum_column_group::<32>(block, width, start, totals),
                16.. => sum_column_group::<16>(block, width, start, totals),
                8.. => sum_column_group::<8>(block, width, start, totals),
                _ => sum_column_group::<1>(block, width, start, totals),
            };
        }
    }
}

/// The `W` values of `row` from `start`, as an array (so loops over them unroll).
#[inline(always)]
pub(crate) fn group_of<const W: usize>(row: &[f32], start: usize) -> Option<&[f32; W]> {
    row.get(start..start + W)?.try_into().ok()
}

/// One block's Σx and Σx² for the `W` columns from `start`, summed in registers in f32 and
/// added into the f64 totals; returns `W`.
#[inline(always)]
fn sum_column_group<const W: usize>(
    block: &[f32],
    width: usize,
    start: usize,
    [sums, sums_sq]: [&mut [f64]; 2],
) -> usize {
    let mut block_sum = [0f32; W];
    let mut block_sum_sq = [0f32; W];
    for line in block.chunks_exact(width) {
        let Some(values) = group_of::<W>(line, start) else {
            break;
        };
        for lane in 0..W {
            block_sum[lane] += values[lane];
            block_sum_sq[lane] += values[lane] * values[lane];
        }
    }
    widen_into(&block_sum, sums);
    widen_into(&block_sum_sq, sums_sq);
    W
}

fn widen_f64_into(values: &[f64], totals: &mut [f64]) {
    for (total, value) in totals.iter_mut().zip(values) {
        *total += value;
    }
}

/// Adds each f32 block sum into its f64 total.
pub(crate) fn widen_into(block: &[f32], totals: &mut [f64]) {
    for (total, value) in totals.iter_mut().zip(block) {
        *total += f64::from(*value);
    }
}
