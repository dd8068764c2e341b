//! DistributedSampler's contract and the exact evaluation split, over many cases.

use std::collections::BTreeSet;

use tandem_data::{eval_shard, DistributedSampler};

#[test]
fn shards_are_equal_disjoint_up_to_padding_and_cover_everything() {
    for dataset_len in [0usize, 1, 2, 3, 7, 10, 64, 101, 1000] {
        for world in [1usize, 2, 3, 4, 7, 8, 16] {
            for shuffle in [false, true] {
                for epoch in [0u64, 1, 5] {
                    check_padded(dataset_len, world, shuffle, epoch);
                    check_dropped(dataset_len, world, shuffle, epoch);
                }
            }
        }
    }
}

fn shards(
    dataset_len: usize,
    world: usize,
    shuffle: bool,
    epoch: u64,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    (0..world)
        .map(|rank| {
            let sampler =
                DistributedSampler::new(dataset_len, world, rank, shuffle, 42, drop_last).unwrap();
            let indices = sampler.indices(epoch);
            assert_eq!(indices.len(), sampler.num_samples());
            indices
        })
        .collect()
}

fn check_padded(dataset_len: usize, world: usize, shuffle: bool, epoch: u64) {
    let shards = shards(dataset_len, world, shuffle, epoch, false);
    let per_rank = if dataset_len == 0 {
        0
    } else {
        dataset_len.div_ceil(world)
    };
    let all: Vec<usize> = shards.iter().flatten().copied().collect();
    assert!(
        shards.iter().all(|shard| shard.len() == per_rank),
        "{dataset_len}/{world}"
    );
    assert!(all.iter().all(|&index| index < dataset_len));
    let distinct: BTreeSet<usize> = all.iter().copied().collect();
    assert_eq!(
        distinct,
        (0..dataset_len).collect(),
        "{dataset_len}/{world}: every index covered"
    );
    // Only the padding repeats: as many duplicates as the padding adds.
    assert_eq!(all.len() - distinct.len(), per_rank * world - dataset_len);
}

fn check_dropped(dataset_len: usize, world: usize, shuffle: bool, epoch: u64) {
    let shards = shards(dataset_len, world, shuffle, epoch, true);
    let per_rank = dataset_len / world;
    let all: Vec<usize> = shards.iter().flatten().copied().collect();
    assert!(shards.iter().all(|shard| shard.len() == per_rank));
    let distinct: BTreeSet<usize> = all.iter().copied().collect();
    assert_eq!(distinct.len(), all.len(), "no index twice with drop_last");
    assert_eq!(all.len(), per_rank * world);
}

/// Every rank's indices of epoch `epoch` over 10 items, without dropping the last.
fn shards_of_ten(world: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<Vec<usize>> {
    (0..world)
        .map(|rank| {
            DistributedSampler::new(10, world, rank, shuffle, seed, false)
                .unwrap()
                .indices(epoch)
        })
        .collect()
}

#[test]
fn rank_r_takes_every_world_th_index_of_the_shared_order() {
    let world = 3;
    let unshuffled = shards_of_ten(world, false, 0, 0);
    // 10 items, 3 ranks: padded to 12 by wrapping around to 0 and 1.
    assert_eq!(
        unshuffled,
        vec![vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
    );

    // With shuffling, interleaving the ranks' lists gives back one permutation (+ padding).
    let shuffled = shards_of_ten(world, true, 7, 3);
    let interleaved: Vec<usize> = (0..4)
        .flat_map(|step| shuffled.iter().map(move |shard| shard[step]))
        .collect();
    let head: BTreeSet<usize> = interleaved[..10].iter().copied().collect();
    assert_eq!(head, (0..10).collect());
    assert_eq!(interleaved[10..], interleaved[..2]);
}

#[test]
fn order_depends_on_seed_and_epoch_only() {
    let sampler = DistributedSampler::new(1000, 4, 1, true, 9, false).unwrap();
    let again = DistributedSampler::new(1000, 4, 1, true, 9, false).unwrap();
    assert_eq!(sampler.indices(2), again.indices(2));
    assert_ne!(
        sampler.indices(2),
        sampler.indices(3),
        "a new epoch gives a new order"
    );
    let other_seed = DistributedSampler::new(1000, 4, 1, true, 10, false).unwrap();
    assert_ne!(sampler.indices(2), other_seed.indices(2));
    let unshuffled = DistributedSampler::new(1000, 4, 1, false, 9, false).unwrap();
    assert_eq!(unshuffled.indices(0), unshuffled.indices(1));
}

#[test]
fn invalid_settings_are_errors() {
    let error = DistributedSampler::new(10, 0, 0, true, 0, false).unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid setting: sampler world size 0, expected at least 1"
    );
    let error = DistributedSampler::new(10, 2, 2, true, 0, false).unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid setting: sampler rank 2, expected below the world size 2"
    );
}

#[test]
fn eval_shards_cover_every_index_exactly_once() {
    for len in [0usize, 1, 5, 9, 10, 11, 999, 10_000] {
        for world in 1..=9 {
            let mut next = 0;
            let mut sizes = Vec::new();
            for rank in 0..world {
                let range = eval_shard(len, world, rank);
                assert_eq!(range.start, next, "contiguous and in rank order");
                next = range.end;
                sizes.push(range.len());
            }
            assert_eq!(next, len);
            let largest = sizes.iter().max().unwrap();
            let smallest = sizes.iter().min().unwrap();
            assert!(largest - smallest <= 1, "{len}/{world}: {sizes:?}");
        }
    }
    assert_eq!(eval_shard(10, 0, 0), 0..0);
    assert_eq!(eval_shard(10, 2, 5), 0..0);
}

/// A job that visited the first 4 of an epoch's 10 indices on 2 ranks (2 each) and goes on
/// with 3 ranks visits every index of the epoch exactly once: the rest of the epoch's order,
/// rank r taking every third index of it from r.
#[test]
fn the_rest_of_an_epoch_is_shared_among_another_number_of_ranks() {
    let sampler = |world: usize, rank: usize| {
        DistributedSampler::new(10, world, rank, true, 7, false).unwrap()
    };
    let order = sampler(1, 0).indices(3);
    let mut visited: Vec<usize> = (0..2)
        .flat_map(|rank| sampler(2, rank).indices(3)[..2].to_vec())
        .collect();
    let mut visited_order = order[..4].to_vec();
    visited.sort_unstable();
    visited_order.sort_unstable();
    assert_eq!(visited, visited_order);
    for rank in 0..3 {
        let rest = sampler(3, rank).indices_from(3, 4);
        assert_eq!(rest, vec![order[4 + rank], order[7 + rank]], "rank {rank}");
        visited.extend(rest);
    }
    visited.sort_unstable();
    assert_eq!(visited, (0..10).collect::<Vec<_>>());
    assert_eq!(sampler(3, 1).indices_from(3, 0), sampler(3, 1).indices(3));
    assert!(sampler(3, 1).indices_from(3, 12).is_empty());
}
