//! The comm thread: owned buffers in and out, FIFO order across ranks, the synchronous
//! pass-through, and errors handed to every pending operation.

mod common;

use std::time::Duration;

use common::{run_groups, value};
use tandem_dist::{CommThread, DistError, ProcessGroup, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn queued_operations_run_in_order_and_hand_buffers_back() {
    let results = run_groups(3, TIMEOUT, 1 << 10, |group: ProcessGroup| {
        let rank = group.rank();
        let comm = CommThread::spawn(group).expect("spawn");
        // Several buckets in flight at once, as DDP submits them during backward.
        let buckets: Vec<Vec<f32>> = (0..5)
            .map(|bucket| {
                (0..1000 + bucket)
                    .map(|i| value(rank, i + bucket) as f32)
                    .collect()
            })
            .collect();
        let pending: Vec<_> = buckets
            .into_iter()
            .map(|bucket| comm.all_reduce_f32(bucket, ReduceOp::Sum))
            .collect();
        let counts = comm.all_reduce_i64(vec![rank as i64, 1], ReduceOp::Sum);
        let root_bytes = comm.broadcast_bytes(format!("from rank {rank}").into_bytes(), 1);
        let weights = comm.broadcast_f32(vec![rank as f32; 3], 2);
        let mean = comm.run(|group| {
            let mut statistics = vec![group.rank() as f64, 2.0];
            group.all_reduce_f64(&mut statistics, ReduceOp::Mean)?;
            Ok(statistics)
        });
        let reduced: Vec<Vec<f32>> = pending
            .into_iter()
            .map(|pending| pending.wait().expect("bucket"))
            .collect();
        let outcome = (
            reduced,
            counts.wait().expect("counts"),
            root_bytes.wait().expect("bytes"),
            weights.wait().expect("weights"),
            mean.expect("mean"),
        );
        let group = comm.into_process_group().expect("group back");
        assert_eq!(group.rank(), rank);
        outcome
    });
    for (rank, (reduced, counts, bytes, weights, mean)) in results.iter().enumerate() {
        for (bucket, values) in reduced.iter().enumerate() {
            assert_eq!(values.len(), 1000 + bucket);
            for (i, got) in values.iter().enumerate().step_by(37) {
                let expected: f64 = (0..3).map(|r| value(r, i + bucket) as f32 as f64).sum();
                assert!(
                    (*got as f64 - expected).abs() < 1e-3,
                    "rank {rank} bucket {bucket} [{i}]"
                );
            }
        }
        assert_eq!(reduced, &results[0].0, "rank {rank}: different bytes");
        assert_eq!(counts, &vec![3, 3]);
        assert_eq!(bytes, b"from rank 1");
        assert_eq!(weights, &vec![2.0; 3]);
        assert_eq!(mean, &vec![1.0, 2.0]);
    }
}

#[test]
fn a_failed_collective_fails_every_later_pending_operation() {
    let results = run_groups(2, Duration::from_secs(3), 1 << 10, |group: ProcessGroup| {
        let rank = group.rank();
        let comm = CommThread::spawn(group).expect("spawn");
        // Different lengths: the first all-reduce fails on both ranks, the next is refused.
        let first = comm.all_reduce_f32(vec![1.0; 4 + rank], ReduceOp::Sum);
        let second = comm.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum);
        (
            first.wait().expect_err("mismatch"),
            second.wait().expect_err("poisoned"),
        )
    });
    for (first, second) in results {
        assert!(
            first
                .to_string()
                .contains("the ranks disagree on the buffer's length"),
            "{first}"
        );
        assert!(matches!(second, DistError::GroupFailed(_)), "{second}");
    }
}
