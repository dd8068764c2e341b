//! Which gradient buckets the backward pass has finished: pure bookkeeping, no CUDA.
//!
//! The model lays its flat gradients out in the order the backward pass finishes them and
//! reports "final up to `end`" as it goes, so bucket `i` is complete once `end` reaches its
//! last value. The cursor hands out each bucket exactly once per backward, in order, so every
//! rank issues the same sequence of collectives (NCCL requires it).

use std::ops::Range;

/// Buckets over the flat gradients and how many of them this backward has handed out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketCursor {
    buckets: Vec<Range<usize>>,
    next: usize,
}

impl BucketCursor {
    /// A cursor over `buckets`: contiguous, in order, starting at 0 (as `plan_buckets` of the
    /// binary's DDP makes them).
    pub fn new(buckets: Vec<Range<usize>>) -> Self {
        BucketCursor { buckets, next: 0 }
    }

    /// The buckets.
    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// The buckets that became complete now that every gradient below `end` is final, each
    /// handed out once: the indices from the first not yet handed out up to the last one
    /// that ends at or before `end`.
    pub fn finished_up_to(&mut self, end: usize) -> Range<usize> {
        let start = self.next;
        while self.next < self.buckets.len() && self.buckets[self.next].end <= end {
            self.next += 1;
        }
        start..self.next
    }

    /// The buckets not handed out yet (the end of the backward, or a backward that reported
    /// nothing), after which the cursor starts over for the next backward.
    pub fn rest(&mut self) -> Range<usize> {
        let rest = self.next..self.buckets.len();
        self.next = 0;
        rest
    }

    /// Starts a backward afresh, forgetting what an earlier one that failed half-way handed
    /// out (so that every rank's next backward issues its collectives from the first bucket).
    pub fn restart(&mut self) {
        self.next = 0;
    }

    /// Whether this backward has handed out no bucket yet.
    pub fn at_start(&self) -> bool {
        self.next == 0
    }
}

/// One step of the work queued for finished buckets, in queue order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BucketOp {
    /// The collectives' stream waits for an event recorded on the compute stream (after the
    /// backward kernels that finished the buckets).
    WaitForCompute,
    /// In-place sum over the ranks of a range of the gradients, on the collectives' stream.
    AllReduceSum(Range<usize>),
    /// Division of a summed range by the world size, on the collectives' stream.
    DivideByWorld(Range<usize>),
    /// The compute stream waits for an event recorded on the collectives' stream, which the
    /// watchdog gives the timeout to finish.
    HandBack,
}

/// The work to queue for the buckets numbered `indices` of `buckets` (one wait for the
/// compute stream, then each bucket's sum and its division by the world size), ending with
/// the hand-back to the compute stream when `last` (the end of the backward). One rank
/// divides too: by 1, which changes no bit, and its NCCL sum is a no-op, so the division is
/// what puts work on the collectives' stream (and into a captured step) at world size 1, the
/// only NCCL a machine with one GPU can run.
pub fn bucket_ops(buckets: &[Range<usize>], indices: Range<usize>, last: bool) -> Vec<BucketOp> {
    let mut ops = Vec::new();
    if !indices.is_empty() {
        ops.push(BucketOp::WaitForCompute);
        for bucket in &buckets[indices] {
            ops.push(BucketOp::AllReduceSum(bucket.clone()));
            ops.push(BucketOp::DivideByWorld(bucket.clone()));
        }
    }
    if last {
        ops.push(BucketOp::HandBack);
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backward_queues_each_bucket_after_the_compute_stream_and_hands_back_once() {
        let buckets = vec![0..3, 3..7, 7..10];
        let mut cursor = BucketCursor::new(buckets.clone());
        // Backward reports 4, then 10; the end of the backward hands back.
        let mut queued = Vec::new();
        for end in [4, 10] {
            let finished = cursor.finished_up_to(end);
            queued.extend(bucket_ops(&buckets, finished, false));
        }
        queued.extend(bucket_ops(&buckets, cursor.rest(), true));
        use BucketOp::*;
        assert_eq!(
            queued,
            vec![
                WaitForCompute,
                AllReduceSum(0..3),
                DivideByWorld(0..3),
                WaitForCompute,
                AllReduceSum(3..7),
                DivideByWorld(3..7),
                AllReduceSum(7..10),
                DivideByWorld(7..10),
                HandBack,
            ]
        );
        // A backward that reported nothing sends every bucket at the end.
        assert_eq!(
            bucket_ops(&buckets, cursor.rest(), true),
            vec![
                WaitForCompute,
                AllReduceSum(0..3),
                DivideByWorld(0..3),
                AllReduceSum(3..7),
                DivideByWorld(3..7),
                AllReduceSum(7..10),
                DivideByWorld(7..10),
                HandBack,
            ]
        );
        assert_eq!(bucket_ops(&buckets, 3..3, false), Vec::new());
    }

    #[test]
    fn buckets_are_handed_out_once_in_order_as_backward_reports() {
        let mut cursor = BucketCursor::new(vec![0..3, 3..7, 7..10]);
        assert!(cursor.at_start());
        // A report inside the first bucket completes nothing.
        assert_eq!(cursor.finished_up_to(2), 0..0);
        assert_eq!(cursor.finished_up_to(3), 0..1);
        // The same end again hands out nothing twice.
        assert_eq!(cursor.finished_up_to(3), 1..1);
        // One report can complete several buckets.
        assert_eq!(cursor.finished_up_to(10), 1..3);
        assert_eq!(cursor.rest(), 3..3);
        // The next backward starts over.
        assert!(cursor.at_start());
        assert_eq!(cursor.finished_up_to(5), 0..1);
        assert_eq!(cursor.rest(), 1..3);
        assert_eq!(cursor.rest(), 0..3, "a backward that reported nothing");
        // A backward that failed after handing out a bucket: the next one starts over.
        assert_eq!(cursor.finished_up_to(7), 0..2);
        cursor.restart();
        assert!(cursor.at_start());
        assert_eq!(cursor.finished_up_to(3), 0..1);
    }

    #[test]
    fn no_gradients_means_no_buckets() {
        let mut cursor = BucketCursor::new(Vec::new());
        assert_eq!(cursor.finished_up_to(0), 0..0);
        assert_eq!(cursor.rest(), 0..0);
    }
}
