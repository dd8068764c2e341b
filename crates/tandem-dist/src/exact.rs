//! A sum of float vectors whose result does not depend on the order of its terms, nor on
//! how they are spread over ranks.
//!
//! Float addition is not associative, so a ring all-reduce gives other bits when the same
//! terms are grouped over another number of ranks. Here the terms are added as integers:
//! for each block of [`BLOCK`] values, the largest magnitude over every term (a maximum, the
//! same in any order) fixes a power of two, the unit, so small that `total_terms` values of up
//! to that magnitude, as whole numbers of units, sum to at most 2^[`SUM_BITS`]. Each value
//! becomes a whole number of units, truncated toward zero (what is lost lies below 2^-(SUM_BITS -
//! ceil(log2 total_terms)) of the block's largest), the integers are summed in any order, and
//! the sum is rounded once back to `f32`. A block that holds a NaN or an infinity anywhere
//! gives NaN. Over ranks, [`ProcessGroup::exact_sum`] runs two all-reduces (a `Max` of one
//! `f32` per block, a `Sum` of `i64`) on buffers in shared memory between ranks of one host.

use crate::element::ReduceOp;
use crate::error::{DistError, Result};
use crate::group::ProcessGroup;
use crate::shared::SharedBuffer;

/// Values that share one unit.
pub const BLOCK: usize = 64;

/// The exact sum of all terms, in units, has at most this many bits of magnitude.
pub const SUM_BITS: i64 = 62;

/// Folds the magnitudes of `values`, whose first value is element `start` of the summed
/// vector, into the largest magnitude of each block, `maxima` (block 0 starting at element
/// 0): a NaN or an infinity makes its block's maximum NaN or infinite.
pub fn fold_maxima(values: &[f32], start: usize, maxima: &mut [f32]) {
    let mut offset = 0;
    while offset < values.len() {
        let element = start + offset;
        let block = element / BLOCK;
        let end = (offset + BLOCK - element % BLOCK).min(values.len());
        // Magnitudes compare as their bit patterns, NaNs and infinities above every finite
        // value; an integer maximum vectorizes where a NaN-aware float one does not.
        let largest_bits = values[offset..end].iter().fold(0u32, |largest, value| {
            largest.max(value.to_bits() & 0x7fff_ffff)
        });
        maxima[block] = nan_max(maxima[block], f32::from_bits(largest_bits));
        offset = end;
    }
}

/// The largest magnitude of each block over `terms`, each as long as `maxima` has blocks
/// for.
pub fn block_maxima(terms: &[&[f32]], maxima: &mut [f32]) {
    maxima.fill(0.0);
    for term in terms {
        fold_maxima(term, 0, maxima);
    }
}

/// The sum of `terms` as whole numbers of each block's unit, into `sums`: the unit of block
/// b follows `maxima[b]`, the largest magnitude over every term of the whole sum,
/// `total_terms` of them. `sums` and every term start at a block's first element.
pub fn integer_sums(terms: &[&[f32]], maxima: &[f32], total_terms: usize, sums: &mut [i64]) {
    for (block, sums) in sums.chunks_mut(BLOCK).enumerate() {
        let per_unit = 1.0 / unit_of(maxima[block], total_terms);
        let start = block * BLOCK;
        sums.fill(0);
        for term in terms {
            let values = &term[start..start + sums.len()];
            for (sum, &value) in sums.iter_mut().zip(values) {
                *sum = sum.wrapping_add(to_units(value, per_unit));
            }
        }
    }
}

/// Writes the sums (over every rank) of [`integer_sums`] back as floats into `into`.
pub fn write_sums(sums: &[i64], maxima: &[f32], total_terms: usize, into: &mut [f32]) {
    for (block, (into, sums)) in into.chunks_mut(BLOCK).zip(sums.chunks(BLOCK)).enumerate() {
        let largest = maxima[block];
        if !largest.is_finite() {
            into.fill(f32::NAN);
            continue;
        }
        let unit = unit_of(largest, total_terms);
        for (value, &sum) in into.iter_mut().zip(sums) {
            *value = (sum as f64 * unit) as f32;
        }
    }
}

/// The exact sum of one process's terms, with its buffers kept from one sum to the next.
#[derive(Default)]
pub struct LocalExactSum {
    maxima: Vec<f32>,
    sums: Vec<i64>,
}

impl LocalExactSum {
    /// The exact sum of `earlier` and `last`, written into `last`; every term is as long as
    /// `last`.
    pub fn sum_into_last(&mut self, earlier: &[&[f32]], last: &mut [f32]) {
        let len = last.len();
        self.maxima.resize(len.div_ceil(BLOCK), 0.0);
        self.sums.resize(len, 0);
        let mut terms = earlier.to_vec();
        terms.push(last);
        block_maxima(&terms, &mut self.maxima);
        integer_sums(&terms, &self.maxima, terms.len(), &mut self.sums);
        write_sums(&self.sums, &self.maxima, terms.len(), last);
    }
}

/// The exact sum of `terms` (each as long as `into`) in one process, as
/// [`ProcessGroup::exact_sum`] of one rank gives it.
pub fn local_exact_sum(terms: &[&[f32]], into: &mut [f32]) {
    let mut maxima = vec![0.0; into.len().div_ceil(BLOCK)];
    let mut sums = vec![0i64; into.len()];
    block_maxima(terms, &mut maxima);
    integer_sums(terms, &maxima, terms.len(), &mut sums);
    write_sums(&sums, &maxima, terms.len(), into);
}

/// The buffers of repeated exact sums of one length over a group, in shared memory between
/// ranks of one host.
pub struct ExactSumBuffers {
    maxima: SharedBuffer<f32>,
    sums: SharedBuffer<i64>,
}

impl ExactSumBuffers {
    /// The number of values each sum has.
    pub fn len(&self) -> usize {
        self.sums.len()
    }

    /// Whether the sums have no values.
    pub fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }
}

impl ProcessGroup {
    /// Buffers for exact sums of `len` values (a collective, as
    /// [`shared_buffer`](Self::shared_buffer)).
    pub fn exact_sum_buffers(&mut self, len: usize) -> Result<ExactSumBuffers> {
        Ok(ExactSumBuffers {
            maxima: self.shared_buffer(len.div_ceil(BLOCK))?,
            sums: self.shared_buffer(len)?,
        })
    }

    /// The exact sum over every rank of each rank's `terms`, `total_terms` of them over all
    /// ranks, into `into`: the same bits however the terms are spread over the ranks and in
    /// whatever order they are added (see the module). Every term and `into` are as long as
    /// `buffers`.
    pub fn exact_sum(
        &mut self,
        buffers: &mut ExactSumBuffers,
        terms: &[&[f32]],
        total_terms: usize,
        into: &mut [f32],
    ) -> Result<()> {
        let len = buffers.len();
        if let Some(wrong) = terms
            .iter()
            .map(|term| term.len())
            .chain([into.len()])
            .find(|&l| l != len)
        {
            return Err(DistError::InvalidArgument(format!(
                "exact_sum: a vector of {wrong} values, the buffers hold {len}"
            )));
        }
        block_maxima(terms, &mut buffers.maxima);
        self.all_reduce_shared(&mut buffers.maxima, ReduceOp::Max)?;
        integer_sums(terms, &buffers.maxima, total_terms, &mut buffers.sums);
        self.all_reduce_shared(&mut buffers.sums, ReduceOp::Sum)?;
        write_sums(&buffers.sums, &buffers.maxima, total_terms, into);
        Ok(())
    }
}

/// The larger of two magnitudes, NaN when either is.
fn nan_max(a: f32, b: f32) -> f32 {
    match a.is_nan() || b.is_nan() {
        true => f32::NAN,
        false => a.max(b),
    }
}

/// The unit of a block whose largest magnitude is `largest`, in a sum of `terms` values: a
/// power of two so small that each value is a whole number of units of magnitude at most
/// 2^(SUM_BITS - ceil(log2 terms)), so that the sum of `terms` of them is at most
/// 2^SUM_BITS. 1 for a block of zeros, a NaN or an infinity.
fn unit_of(largest: f32, terms: usize) -> f64 {
    if !(largest.is_finite() && largest > 0.0) {
        return 1.0;
    }
    let exponent = ((f64::from(largest).to_bits() >> 52) & 0x7ff) as i64 - 1023;
    let terms_bits = i64::from(usize::BITS - terms.max(1).saturating_sub(1).leading_zeros());
    let unit_exponent = exponent + 1 - (SUM_BITS - terms_bits);
    f64::from_bits(((unit_exponent + 1023) as u64) << 52)
}

/// `value` as a whole number of units, `per_unit` of them to 1, truncated toward zero (exact:
/// `per_unit` is a power of two and the quotient fits in SUM_BITS bits). A NaN or an
/// infinity gives 0 or the largest integer (the cast saturates); its block is NaN whatever
/// the sum.
fn to_units(value: f32, per_unit: f64) -> i64 {
    (f64::from(value) * per_unit) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two large values that cancel among small ones: a float sum loses the small ones that
    /// it adds while a large one is in it.
    fn ill_conditioned() -> Vec<f32> {
        let mut values: Vec<f32> = (0..14)
            .map(|k| ((k * 7919 % 1000) as f32 - 500.0) * 10f32.powi(k % 5 - 3))
            .collect();
        values.insert(3, 1.0e8);
        values.push(-1.0e8);
        values
    }

    /// The exact sum of `values` taken one term each, in `order`.
    fn sum_in(values: &[f32], order: &[usize]) -> f32 {
        let terms: Vec<[f32; 1]> = order.iter().map(|&k| [values[k]]).collect();
        let terms: Vec<&[f32]> = terms.iter().map(|term| &term[..]).collect();
        let mut into = [0.0f32];
        local_exact_sum(&terms, &mut into);
        into[0]
    }

    #[test]
    fn the_exact_sum_does_not_depend_on_the_order_of_its_terms() {
        let values = ill_conditioned();
        let forward: Vec<usize> = (0..16).collect();
        let backward: Vec<usize> = (0..16).rev().collect();
        let shuffled = [3, 15, 5, 11, 0, 8, 1, 14, 9, 2, 12, 7, 4, 13, 6, 10];
        let exact: f64 = values.iter().map(|&v| f64::from(v)).sum();
        assert_eq!(
            sum_in(&values, &forward).to_bits(),
            sum_in(&values, &backward).to_bits()
        );
        assert_eq!(
            sum_in(&values, &forward).to_bits(),
            sum_in(&values, &shuffled).to_bits()
        );
        assert_eq!(sum_in(&values, &forward), exact as f32);
        // The float sum itself depends on the order.
        let float_sum = |order: &[usize]| order.iter().fold(0.0f32, |sum, &k| sum + values[k]);
        assert_ne!(
            float_sum(&forward).to_bits(),
            float_sum(&shuffled).to_bits()
        );
    }

    #[test]
    fn the_unit_leaves_room_for_every_term_and_keeps_its_precision() {
        for terms in [1, 2, 3, 8, 1000] {
            let unit = unit_of(1.9999999, terms);
            let whole = to_units(1.9999999, 1.0 / unit) as i128 * terms as i128;
            assert!(whole <= 1i128 << SUM_BITS, "{terms} terms: {whole}");
            assert!(
                whole > 1i128 << (SUM_BITS - 3),
                "{terms} terms keep their precision: {whole}"
            );
        }
        assert_eq!(unit_of(0.0, 8), 1.0);
        assert_eq!(to_units(-2.75, 4.0), -11);
        assert_eq!(to_units(f32::NAN, 1.0), 0);
    }

    #[test]
    fn maxima_folded_in_pieces_equal_the_maxima_of_whole_terms() {
        let term: Vec<f32> = (0..3 * BLOCK + 5)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1.5f32.powi((i % 9) as i32))
            .collect();
        let mut whole = vec![0.0; term.len().div_ceil(BLOCK)];
        block_maxima(&[&term], &mut whole);
        let mut pieces = vec![0.0; whole.len()];
        for (start, end) in [(150, term.len()), (0, 7), (7, 150)] {
            fold_maxima(&term[start..end], start, &mut pieces);
        }
        assert_eq!(pieces, whole);
        let expected = term[BLOCK..2 * BLOCK]
            .iter()
            .fold(0.0f32, |largest, value| largest.max(value.abs()));
        assert_eq!(whole[1], expected);
        let mut spoiled = term.clone();
        spoiled[2 * BLOCK + 3] = f32::NEG_INFINITY;
        block_maxima(&[&term, &spoiled], &mut whole);
        assert_eq!(whole[2], f32::INFINITY);
        spoiled[3] = -f32::NAN;
        block_maxima(&[&spoiled], &mut whole);
        assert!(whole[0].is_nan());
    }

    #[test]
    fn blocks_have_units_of_their_own_and_a_nan_spoils_only_its_block() {
        let mut first = vec![1.0e-6f32; 2 * BLOCK];
        first[0] = 1.0e6;
        let second = vec![2.0e-6f32; 2 * BLOCK];
        let mut into = vec![0.0; 2 * BLOCK];
        local_exact_sum(&[&first, &second], &mut into);
        // The second block's unit follows its own largest value, so 3e-6 keeps every bit.
        assert_eq!(into[BLOCK], 1.0e-6f32 + 2.0e-6f32);
        assert_eq!(into[0], 1.0e6 + 2.0e-6);
        first[BLOCK + 1] = f32::NAN;
        local_exact_sum(&[&first, &second], &mut into);
        assert!(into[BLOCK..].iter().all(|value| value.is_nan()));
        assert!(into[..BLOCK].iter().all(|value| value.is_finite()));
    }
}
