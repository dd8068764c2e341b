//! All-reduce through shared buffers: the ring's result bit for bit, the fallback to the ring,
//! and mismatched calls. A killed process during a shared all-reduce is in `failures.rs`.

mod common;

use std::time::Duration;

use common::{on_rank_threads, options, run_ranks, start_store, value};
use tandem_dist::{
    DistError, Element, ProcessGroup, ReduceOp, SharedBuffer, DEFAULT_SEGMENT_BYTES,
};

const TIMEOUT: Duration = Duration::from_secs(20);
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// For every op: all-reduces the same input through a shared buffer and through the ring and
/// returns both results' bytes, checking on the way that the buffer is shared when it can be.
fn shared_and_ring<T: Element>(
    group: &mut ProcessGroup,
    len: usize,
    input: impl Fn(usize, usize) -> T,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let rank = group.rank();
    let mut shared = group.shared_buffer::<T>(len).expect("shared buffer");
    assert_eq!(
        shared.is_shared(),
        group.world_size() > 1,
        "{:?}",
        group.shared_memory_refusal()
    );
    assert!(shared.iter().all(|value| *value == T::zeroed()));
    OPS.iter()
        .map(|&op| {
            let values: Vec<T> = (0..len).map(|i| input(rank, i)).collect();
            shared.copy_from_slice(&values);
            group.all_reduce_shared(&mut shared, op).expect("shared");
            let mut ring = values;
            group.all_reduce(&mut ring, op).expect("ring");
            (
                bytemuck::cast_slice::<T, u8>(&shared).to_vec(),
                bytemuck::cast_slice::<T, u8>(&ring).to_vec(),
            )
        })
        .collect()
}

#[test]
fn shared_all_reduce_gives_the_rings_bytes_on_every_rank() {
    for world_size in 1..=4 {
        let outputs = run_ranks(world_size, TIMEOUT, 4096, |group| {
            let mut outputs = Vec::new();
            // Lengths around the chunk boundaries and past one fold piece of 8192 elements.
            for len in [0, 1, world_size - 1, 7, 1001, 20_011] {
                outputs.extend(shared_and_ring(group, len, |r, i| value(r, i) as f32));
                outputs.extend(shared_and_ring(group, len, value));
                outputs.extend(shared_and_ring(group, len, |r, i| {
                    (value(r, i) * 8.0) as i64
                }));
            }
            outputs
        });
        for (rank, rank_outputs) in outputs.iter().enumerate() {
            for (case, (shared, ring)) in rank_outputs.iter().enumerate() {
                assert_eq!(shared, ring, "world {world_size} rank {rank} case {case}");
            }
            assert_eq!(rank_outputs, &outputs[0], "world {world_size} rank {rank}");
        }
    }
}

#[test]
fn shared_memory_turned_off_keeps_buffers_on_the_heap_and_still_reduces() {
    let (server, token) = start_store();
    let store = server.local_addr();
    let results = on_rank_threads(3, |rank| {
        let mut options = options(rank, 3, store, &token, TIMEOUT);
        options.shared_memory = false;
        let mut group = ProcessGroup::connect(options).expect("join");
        let mut buffer = group.shared_buffer::<f32>(5).expect("buffer");
        assert!(!buffer.is_shared());
        buffer.copy_from_slice(&[rank as f32; 5]);
        group
            .all_reduce_shared(&mut buffer, ReduceOp::Sum)
            .expect("ring all-reduce");
        (buffer.to_vec(), group.shared_memory_refusal().is_none())
    });
    for (values, no_refusal) in results {
        assert_eq!(values, vec![3.0; 5]);
        assert!(no_refusal, "turning shared memory off is not a refusal");
    }
}

#[test]
fn ranks_passing_different_shared_buffers_fail_alike_and_poison_the_group() {
    let outcomes = run_ranks(2, TIMEOUT, DEFAULT_SEGMENT_BYTES, |group| {
        let mut first = group.shared_buffer::<f32>(10).expect("first");
        let mut second = group.shared_buffer::<f32>(10).expect("second");
        let chosen = match group.rank() {
            0 => &mut first,
            _ => &mut second,
        };
        let error = group
            .all_reduce_shared(chosen, ReduceOp::Sum)
            .expect_err("buffers differ");
        let later = group.barrier().expect_err("poisoned");
        (error.to_string(), later)
    });
    assert_eq!(
        outcomes[0].0,
        "invalid argument: all_reduce_shared: rank 0 passed shared buffer #0 of 10 elements \
         but rank 1 passed #1 of 10"
    );
    assert_eq!(
        outcomes[1].0,
        "invalid argument: all_reduce_shared: rank 1 passed shared buffer #1 of 10 elements \
         but rank 0 passed #0 of 10"
    );
    for (_, later) in &outcomes {
        assert!(matches!(later, DistError::GroupFailed(_)), "{later}");
    }
}

#[test]
fn a_heap_buffer_against_a_shared_one_fails_on_both_ranks() {
    let outcomes = run_ranks(2, Duration::from_secs(5), DEFAULT_SEGMENT_BYTES, |group| {
        let mut shared = group.shared_buffer::<f32>(10).expect("shared");
        let mut heap = SharedBuffer::<f32>::heap(10);
        let chosen = match group.rank() {
            0 => &mut shared,
            _ => &mut heap,
        };
        group.all_reduce_shared(chosen, ReduceOp::Sum).is_err()
    });
    assert_eq!(outcomes, vec![true, true]);
}
