//! `exact_sum.cu`: the exact sum of `--global-batch-size`'s shards on the device, bit for bit
//! `tandem_dist::exact` (the file states the arithmetic). `count` terms of `n` floats lie
//! `stride` floats apart; a block's key is its largest magnitude as float bits, sign cleared.

use super::{kernels, Ptr};

kernels! {
    file "exact_sum";

    /// `keys[b]` = the bits of the largest magnitude of block `b` (of
    /// [`EXACT_BLOCK`](crate::executor::exact_sum::EXACT_BLOCK) values) over the terms.
    fn exact_block_maxima(terms: Ptr<f32>, stride: i64, count: i32, n: i64, keys: Ptr<i32>);

    /// `sums[i]` = the sum over the terms of value `i` as whole numbers of its block's unit
    /// in a sum of `total_terms` terms.
    fn exact_integer_sums(
        terms: Ptr<f32>,
        stride: i64,
        count: i32,
        n: i64,
        keys: Ptr<i32>,
        total_terms: i64,
        sums: Ptr<i64>,
    );

    /// `into[i]` = `sums[i]` units as a float, NaN in a block whose key is not finite.
    fn exact_write_sums(sums: Ptr<i64>, n: i64, keys: Ptr<i32>, total_terms: i64, into: Ptr<f32>);
}
