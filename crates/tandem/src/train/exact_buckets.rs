//! The exact gradient sum of `--global-batch-size` ([`tandem_dist::exact`]) in buckets, so
//! that it overlaps the backward pass as the averaging of per-process DDP does.
//!
//! A bucket's block maxima are folded while the last backward hands its ranges over, and
//! their `Max` all-reduce starts on the comm thread as soon as the bucket is final. After
//! the backward, each bucket is turned into integers and its `Sum` all-reduce starts while
//! the next bucket is converted; the sums are written back into the gradients last. The
//! buckets start at multiples of [`BLOCK`], so that the blocks, and with them the result,
//! are those of one sum over the whole vector.

use std::ops::Range;

use tandem_dist::exact::{fold_maxima, integer_sums, write_sums, BLOCK};
use tandem_dist::{CommThread, DistError, Pending, ReduceOp, SharedBuffer};

/// One bucket's buffers, each in shared memory between the ranks of a host, or on its way
/// through the comm thread.
struct ExactBucket {
    range: Range<usize>,
    maxima: Option<SharedBuffer<f32>>,
    maxima_in_flight: Option<Pending<SharedBuffer<f32>>>,
    sums: Option<SharedBuffer<i64>>,
    sums_in_flight: Option<Pending<SharedBuffer<i64>>>,
}

/// The buckets of repeated exact sums of one gradient vector over the job's ranks.
pub struct ExactBuckets {
    buckets: Vec<ExactBucket>,
    /// The first bucket whose maxima have not been sent in this step.
    next: usize,
}

impl ExactBuckets {
    /// Buckets over the ranges of `plan` (moved to multiples of [`BLOCK`]), with their shared
    /// buffers: a collective, which every rank makes at the same point of its run.
    pub fn new(comm: &CommThread, plan: &[Range<usize>]) -> tandem_dist::Result<ExactBuckets> {
        let len = plan.last().map_or(0, |last| last.end);
        let mut buckets = Vec::new();
        let mut start = 0;
        for bucket in plan {
            let end = bucket.end.next_multiple_of(BLOCK).min(len);
            if end <= start {
                continue;
            }
            let mut maxima = comm.shared_buffer::<f32>((end - start).div_ceil(BLOCK))?;
            maxima.fill(0.0);
            buckets.push(ExactBucket {
                range: start..end,
                maxima: Some(maxima),
                maxima_in_flight: None,
                sums: Some(comm.shared_buffer::<i64>(end - start)?),
                sums_in_flight: None,
            });
            start = end;
        }
        Ok(ExactBuckets { buckets, next: 0 })
    }

    /// The number of values summed.
    pub fn len(&self) -> usize {
        self.buckets.last().map_or(0, |last| last.range.end)
    }

    /// Called by the last backward with each range of gradients that is final (its values
    /// are those of the last term): folds the range into its buckets' maxima and sends the
    /// maxima of every bucket now complete, with the `earlier` terms folded in.
    pub fn gradients_ready(
        &mut self,
        comm: &CommThread,
        earlier: &[&[f32]],
        range: Range<usize>,
        values: &[f32],
    ) {
        for bucket in self.buckets.iter_mut().skip(self.next) {
            if bucket.range.start >= range.end {
                break;
            }
            let start = bucket.range.start.max(range.start);
            let end = bucket.range.end.min(range.end);
            if let (true, Some(maxima)) = (start < end, bucket.maxima.as_mut()) {
                let part = &values[start - range.start..end - range.start];
                fold_maxima(part, start - bucket.range.start, maxima);
            }
        }
        while self.next < self.buckets.len() && self.buckets[self.next].range.end <= range.end {
            self.send_maxima(comm, self.next, earlier);
            self.next += 1;
        }
    }

    /// Folds the `earlier` terms into bucket `index`'s maxima and starts their all-reduce.
    fn send_maxima(&mut self, comm: &CommThread, index: usize, earlier: &[&[f32]]) {
        let bucket = &mut self.buckets[index];
        if let Some(mut maxima) = bucket.maxima.take() {
            for term in earlier {
                fold_maxima(&term[bucket.range.clone()], 0, &mut maxima);
            }
            bucket.maxima_in_flight = Some(comm.all_reduce_shared(maxima, ReduceOp::Max));
        }
    }

    /// After the last backward: the exact sum over every rank of `earlier` and `last`,
    /// `total_terms` terms over all ranks, written into `last`. Every term is as long as the
    /// buckets.
    pub fn finish(
        &mut self,
        comm: &CommThread,
        earlier: &[&[f32]],
        last: &mut [f32],
        total_terms: usize,
    ) -> tandem_dist::Result<()> {
        while self.next < self.buckets.len() {
            let bucket = &mut self.buckets[self.next];
            if let Some(maxima) = bucket.maxima.as_mut() {
                fold_maxima(&last[bucket.range.clone()], 0, maxima);
            }
            self.send_maxima(comm, self.next, earlier);
            self.next += 1;
        }
        self.next = 0;
        let mut first_error = None;
        for bucket in &mut self.buckets {
            bucket.receive_maxima(&mut first_error);
            if first_error.is_none() {
                bucket.send_sums(comm, earlier, last, total_terms);
            }
        }
        for bucket in &mut self.buckets {
            bucket.receive_sums(&mut first_error, last, total_terms);
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

impl ExactBucket {
    /// Waits for this bucket's maxima (over every rank); keeps the first error.
    fn receive_maxima(&mut self, first_error: &mut Option<DistError>) {
        let Some(pending) = self.maxima_in_flight.take() else {
            return;
        };
        match pending.wait() {
            Ok(maxima) => self.maxima = Some(maxima),
            Err(error) => {
                first_error.get_or_insert(error);
                // The group has failed; later collectives report it.
                self.maxima = Some(SharedBuffer::heap(self.range.len().div_ceil(BLOCK)));
            }
        }
    }

    /// Converts this bucket of every term into integers and starts their all-reduce.
    fn send_sums(
        &mut self,
        comm: &CommThread,
        earlier: &[&[f32]],
        last: &[f32],
        total_terms: usize,
    ) {
        let (Some(maxima), Some(mut sums)) = (self.maxima.as_ref(), self.sums.take()) else {
            return;
        };
        let range = self.range.clone();
        let mut terms: Vec<&[f32]> = earlier.iter().map(|term| &term[range.clone()]).collect();
        terms.push(&last[range]);
        integer_sums(&terms, maxima, total_terms, &mut sums);
        self.sums_in_flight = Some(comm.all_reduce_shared(sums, ReduceOp::Sum));
    }

    /// Waits for this bucket's sums and writes them into `last`; keeps the first error.
    fn receive_sums(
        &mut self,
        first_error: &mut Option<DistError>,
        last: &mut [f32],
        total_terms: usize,
    ) {
        let Some(pending) = self.sums_in_flight.take() else {
            if let Some(maxima) = self.maxima.as_mut() {
                maxima.fill(0.0);
            }
            return;
        };
        match pending.wait() {
            Ok(sums) => {
                if let (None, Some(maxima)) = (first_error.as_ref(), self.maxima.as_ref()) {
                    write_sums(&sums, maxima, total_terms, &mut last[self.range.clone()]);
                }
                self.sums = Some(sums);
            }
            Err(error) => {
                first_error.get_or_insert(error);
                self.sums = Some(SharedBuffer::heap(self.range.len()));
            }
        }
        if let Some(maxima) = self.maxima.as_mut() {
            maxima.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use tandem_dist::exact::local_exact_sum;

    use crate::train::ddp::tests::{on_ranks, small_model};

    /// Term `k` of the sum: values of mixed magnitudes and signs, with one block of large
    /// values that cancel between terms.
    fn term(k: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let value = ((i * 7919 + k * 104_729) % 2001) as f32 - 1000.0;
                let scale = 10f32.powi(((i / 97 + k) % 7) as i32 - 5);
                match i < 64 {
                    true => value * 1.0e6 * (k as f32 - 2.0),
                    false => value * scale,
                }
            })
            .collect()
    }

    #[test]
    fn buckets_over_three_ranks_give_the_bits_of_one_sum_in_one_process() {
        let len = small_model().params().len();
        let terms: Vec<Vec<f32>> = (0..5).map(|k| term(k, len)).collect();
        let views: Vec<&[f32]> = terms.iter().map(Vec::as_slice).collect();
        let mut expected = vec![0.0; len];
        local_exact_sum(&views, &mut expected);
        let held = [0..2, 2..4, 4..5];
        let sums = on_ranks(3, |rank, mut ddp| {
            let own = &terms[held[rank].clone()];
            let (earlier, last) = own.split_at(own.len() - 1);
            let earlier: Vec<&[f32]> = earlier.iter().map(Vec::as_slice).collect();
            let mut sums = Vec::new();
            // Two steps: the second reuses the buffers the first made.
            for _ in 0..2 {
                let mut last = last[0].clone();
                // The backward hands over the first ranges in uneven pieces; the rest is
                // left to the finish.
                let mut start = 0;
                for piece in [1000, 37, 4096 + 5, 20_000] {
                    let end = (start + piece).min(len / 2);
                    ddp.exact_gradients_ready(&earlier, start..end, &last[start..end])
                        .unwrap();
                    start = end;
                }
                ddp.finish_exact_sum(&earlier, &mut last, 5).unwrap();
                sums.push(last);
            }
            sums
        });
        for (rank, sums) in sums.iter().enumerate() {
            for sum in sums {
                let same = sum
                    .iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "rank {rank} differs from the sum in one process");
            }
        }
        assert_ne!(expected[0], 0.0);
    }
}
