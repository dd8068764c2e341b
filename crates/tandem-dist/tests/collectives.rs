//! Collectives on groups of 1 to 4 threads: results against references computed here, and
//! the same bytes on every rank.

mod common;

use std::time::Duration;

use common::{on_rank_threads, run_groups_over, run_ranks, value};
use tandem_dist::{chunk_range, ProcessGroup, ReduceOp, DEFAULT_SEGMENT_BYTES};

const TIMEOUT: Duration = Duration::from_secs(20);
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

fn lengths(world_size: usize) -> Vec<usize> {
    vec![0, 1, world_size - 1, 7, 1001]
}

/// The reduction of `values` (one per rank) in f64.
fn reference(op: ReduceOp, values: impl Iterator<Item = f64>) -> f64 {
    let values: Vec<f64> = values.collect();
    match op {
        ReduceOp::Sum => values.iter().sum(),
        ReduceOp::Mean => values.iter().sum::<f64>() / values.len() as f64,
        ReduceOp::Max => values.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => values.iter().cloned().fold(f64::INFINITY, f64::min),
    }
}

fn assert_same_bytes<T: bytemuck::Pod>(results: &[Vec<T>], what: &str) {
    for (rank, result) in results.iter().enumerate() {
        assert_eq!(
            bytemuck::cast_slice::<T, u8>(result),
            bytemuck::cast_slice::<T, u8>(&results[0]),
            "{what}: rank {rank} differs from rank 0"
        );
    }
}

/// Every op on f32, f64 and i64 for every length; returns nothing, asserts everything.
fn all_reduce_everything(group: &mut ProcessGroup) -> Vec<(String, Vec<u8>)> {
    let (rank, world_size) = (group.rank(), group.world_size());
    let mut outputs = Vec::new();
    for len in lengths(world_size) {
        for op in OPS {
            let mut floats: Vec<f32> = (0..len).map(|i| value(rank, i) as f32).collect();
            group
                .all_reduce_f32(&mut floats, op)
                .expect("all_reduce f32");
            for (i, got) in floats.iter().enumerate() {
                let expected = reference(op, (0..world_size).map(|r| value(r, i) as f32 as f64));
                assert!(
                    (*got as f64 - expected).abs() <= 1e-5 * expected.abs().max(1.0),
                    "f32 {op:?} len {len} [{i}]: {got} vs {expected}"
                );
            }
            outputs.push((
                format!("f32 {op:?} {len}"),
                bytemuck::cast_slice(&floats).to_vec(),
            ));

            let mut doubles: Vec<f64> = (0..len).map(|i| value(rank, i)).collect();
            group
                .all_reduce_f64(&mut doubles, op)
                .expect("all_reduce f64");
            for (i, got) in doubles.iter().enumerate() {
                let expected = reference(op, (0..world_size).map(|r| value(r, i)));
                assert!(
                    (got - expected).abs() <= 1e-12 * expected.abs().max(1.0),
                    "f64 {op:?} len {len} [{i}]"
                );
            }
            outputs.push((
                format!("f64 {op:?} {len}"),
                bytemuck::cast_slice(&doubles).to_vec(),
            ));

            let mut integers: Vec<i64> = (0..len).map(|i| (value(rank, i) * 8.0) as i64).collect();
            group
                .all_reduce_i64(&mut integers, op)
                .expect("all_reduce i64");
            for (i, got) in integers.iter().enumerate() {
                let column = (0..world_size).map(|r| (value(r, i) * 8.0) as i64);
                let expected = match op {
                    ReduceOp::Sum => column.sum::<i64>(),
                    ReduceOp::Mean => column.sum::<i64>() / world_size as i64,
                    ReduceOp::Max => column.max().unwrap_or_default(),
                    ReduceOp::Min => column.min().unwrap_or_default(),
                };
                assert_eq!(*got, expected, "i64 {op:?} len {len} [{i}]");
            }
            outputs.push((
                format!("i64 {op:?} {len}"),
                bytemuck::cast_slice(&integers).to_vec(),
            ));
        }
    }
    outputs
}

fn check_all_reduce(world_size: usize, segment_bytes: usize, unix_sockets: bool) {
    let outputs = run_groups_over(
        unix_sockets,
        world_size,
        TIMEOUT,
        segment_bytes,
        |mut group| all_reduce_everything(&mut group),
    );
    for rank_outputs in &outputs {
        assert_eq!(
            rank_outputs, &outputs[0],
            "world {world_size}: ranks ended with different bytes"
        );
    }
}

#[test]
fn all_reduce_world_1_is_the_identity() {
    check_all_reduce(1, DEFAULT_SEGMENT_BYTES, true);
}

#[test]
fn all_reduce_world_2_over_unix_sockets_and_tcp() {
    check_all_reduce(2, DEFAULT_SEGMENT_BYTES, true);
    check_all_reduce(2, 100, false);
}

#[test]
fn all_reduce_world_3_with_tiny_segments() {
    // 12-byte segments: many pipelined messages per chunk, and segments that straddle nothing.
    check_all_reduce(3, 12, true);
}

#[test]
fn all_reduce_world_4_over_tcp() {
    check_all_reduce(4, 64, false);
}

#[test]
fn large_f32_sum_matches_f64_reference_and_is_identical_on_every_rank() {
    let len = 1_000_003;
    for world_size in [2, 3] {
        let results = run_ranks(world_size, TIMEOUT, 256 << 10, |group| {
            let mut buffer: Vec<f32> = (0..len).map(|i| value(group.rank(), i) as f32).collect();
            group
                .all_reduce_f32(&mut buffer, ReduceOp::Sum)
                .expect("all_reduce");
            buffer
        });
        assert_same_bytes(&results, "large f32 sum");
        for (i, got) in results[0].iter().enumerate().step_by(997) {
            let expected: f64 = (0..world_size)
                .map(|rank| value(rank, i) as f32 as f64)
                .sum();
            assert!(
                (*got as f64 - expected).abs() <= 1e-4,
                "[{i}] {got} vs {expected}"
            );
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for world_size in 1..=4 {
        let results = run_ranks(world_size, TIMEOUT, 40, |group| {
            let mut received = Vec::new();
            for root in 0..group.world_size() {
                for len in [0, 1, 3, 101] {
                    let mut buffer: Vec<f32> =
                        (0..len).map(|i| value(group.rank(), i) as f32).collect();
                    group.broadcast_f32(&mut buffer, root).expect("broadcast");
                    let expected: Vec<f32> = (0..len).map(|i| value(root, i) as f32).collect();
                    assert_eq!(
                        buffer,
                        expected,
                        "world {} root {root} len {len}",
                        group.world_size()
                    );
                    received.push(buffer);
                }
                let mut bytes = if group.rank() == root {
                    format!("hello from {root}").into_bytes()
                } else {
                    vec![7; 50]
                };
                group
                    .broadcast_bytes(&mut bytes, root)
                    .expect("broadcast_bytes");
                assert_eq!(bytes, format!("hello from {root}").into_bytes());
            }
            received
        });
        assert_eq!(results.len(), world_size);
    }
}

#[test]
fn all_gather_concatenates_in_rank_order() {
    for world_size in 1..=4 {
        for part_len in [0, 1, 5, 300] {
            let results = run_ranks(world_size, TIMEOUT, 64, |group| {
                let part: Vec<f32> = (0..part_len)
                    .map(|i| value(group.rank(), i) as f32)
                    .collect();
                group.all_gather_f32(&part).expect("all_gather")
            });
            let expected: Vec<f32> = (0..world_size)
                .flat_map(|rank| (0..part_len).map(move |i| value(rank, i) as f32))
                .collect();
            for result in &results {
                assert_eq!(result, &expected, "world {world_size} part {part_len}");
            }
        }
    }
}

#[test]
fn reduce_scatter_returns_each_rank_its_chunk() {
    for world_size in 1..=4 {
        for len in [0, 1, world_size - 1, 7, 333] {
            let results = run_ranks(world_size, TIMEOUT, 64, |group| {
                let input: Vec<f32> = (0..len).map(|i| value(group.rank(), i) as f32).collect();
                (
                    group
                        .reduce_scatter_f32(&input, ReduceOp::Sum)
                        .expect("sum"),
                    group
                        .reduce_scatter_f32(&input, ReduceOp::Max)
                        .expect("max"),
                )
            });
            for (rank, (sums, maxima)) in results.iter().enumerate() {
                let range = chunk_range(len, world_size, rank);
                assert_eq!(sums.len(), range.len());
                for (offset, i) in range.enumerate() {
                    let column = || (0..world_size).map(|r| value(r, i) as f32 as f64);
                    assert!(
                        (sums[offset] as f64 - reference(ReduceOp::Sum, column())).abs() < 1e-3
                    );
                    assert_eq!(maxima[offset] as f64, reference(ReduceOp::Max, column()));
                }
            }
        }
    }
}

#[test]
fn barrier_holds_every_rank_until_the_last_arrives() {
    let arrived = std::sync::atomic::AtomicUsize::new(0);
    let world_size = 4;
    let seen = run_ranks(world_size, TIMEOUT, DEFAULT_SEGMENT_BYTES, |group| {
        if group.rank() == 3 {
            std::thread::sleep(Duration::from_millis(300));
        }
        arrived.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        group.barrier().expect("barrier");
        arrived.load(std::sync::atomic::Ordering::SeqCst)
    });
    assert_eq!(seen, vec![world_size; world_size]);
}

#[test]
fn mean_divides_once_and_identically() {
    // Values whose sum is not exactly representable after division: every rank must still agree.
    let results = run_ranks(3, TIMEOUT, 16, |group| {
        let mut buffer: Vec<f32> = (0..100)
            .map(|i| 0.1 * (i as f32 + group.rank() as f32))
            .collect();
        group
            .all_reduce_f32(&mut buffer, ReduceOp::Mean)
            .expect("mean");
        buffer
    });
    assert_same_bytes(&results, "mean");
    for (i, got) in results[0].iter().enumerate() {
        let expected = (0..3)
            .map(|rank| (0.1 * (i as f32 + rank as f32)) as f64)
            .sum::<f64>()
            / 3.0;
        assert!((*got as f64 - expected).abs() < 1e-5);
    }
}

#[test]
fn rank_zero_can_host_the_store_itself() {
    // The store's port must be known before rank 0 binds it: probe a free one.
    let port = tandem_testdata::free_port();
    let token = tandem_dist::JobToken::generate().expect("token");
    let results = on_rank_threads(3, |rank| {
        let mut options =
            tandem_dist::ProcessGroupOptions::new(rank, 3, "127.0.0.1", port, token.clone());
        options.timeout = TIMEOUT;
        assert!(
            options.host_store,
            "hosting the store on rank 0 is the default"
        );
        let mut group = ProcessGroup::connect(options).expect("join");
        let mut values = vec![group.rank() as i64 + 1; 5];
        group
            .all_reduce_i64(&mut values, ReduceOp::Sum)
            .expect("all_reduce");
        // Rank 0 must outlive the others' last use of the store.
        group.barrier().expect("barrier");
        values
    });
    assert_eq!(results, vec![vec![6i64; 5]; 3]);
}
