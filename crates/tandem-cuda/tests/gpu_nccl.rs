//! The executor's NCCL group on one GPU (NCCL refuses two ranks on one GPU, so only world
//! size 1 runs on the reference machine): a backward whose buckets are all-reduced on NCCL's
//! stream leaves the gradients of a plain backward bit for bit, and the device broadcasts
//! leave the parameters and running statistics as they were; whole training steps through
//! the group, captured as a CUDA graph with their bucket all-reduces and replayed, end with
//! the bits of the same steps run eagerly and of steps without NCCL, with SyncBatchNorm
//! through the group too, and of several micro-batches; a communicator of two ranks whose second rank never joins ends in
//! an error within the timeout, not a hang. On the fake GPU only, a *mirrored* communicator
//! of two ranks (the fake NCCL's: the other rank holds the same values, so each sum doubles)
//! checks that SyncBatchNorm's statistics really are summed over the ranks: two identical
//! ranks must train as one. The exact sum of `--global-batch-size`'s shard gradients on the
//! device, through a world of one and the mirrored pair, equals `tandem_dist::exact`'s. A
//! sum blocked on a lost rank (faked through the fake NCCL's files) counts as a wait for the
//! peers while it blocks, returns when another thread aborts the communicator, and the
//! executor then joins a new one.
//!
//! Skipped with a printed reason without a driver, the CUDA libraries, libnccl or a GPU (as
//! on CI's machines).

mod common;

use std::time::{Duration, Instant};

use common::{formula_batch, gpu_probe, host_step, momentum_sgd, seed_004};
use tandem_cuda::executor::graph::StepRun;
use tandem_cuda::executor::StepOptimizer;
use tandem_cuda::nccl::{create_unique_id, UNIQUE_ID_BYTES};
use tandem_cuda::{CollectiveError, CudaExecutor, GpuError, Library, Precision, Probe};
use tandem_dist::heartbeat::Activity;
use tandem_models::workspace::Mode;
use tandem_models::{LossOptions, Model};

const BATCH: usize = 8;
const SIDE: usize = 32;

fn model() -> Model {
    let mut model = seed_004();
    model.init_default(5);
    model
}

/// Small buckets over `len` gradients, so that many are all-reduced during the backward.
fn buckets(len: usize) -> Vec<std::ops::Range<usize>> {
    (0..len)
        .step_by(4096)
        .map(|start| start..(start + 4096).min(len))
        .collect()
}

/// The gradients, parameters and running statistics after one forward and backward, with
/// the backward all-reduced through a world-size-1 NCCL group or plain.
fn one_step(probe: &Probe, through_nccl: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let model = model();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    if through_nccl {
        let id = create_unique_id(probe).unwrap();
        let len = model.params().len();
        exec.join_nccl(probe, &id, 0, 1, Duration::from_secs(30), buckets(len))
            .unwrap();
        exec.broadcast_params_and_buffers().unwrap();
    }
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions::default();
    exec.zero_grads().unwrap();
    if through_nccl {
        exec.broadcast_buffers().unwrap();
    }
    exec.forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    if through_nccl {
        exec.backward_all_reduced(&model, &plan, 1.0, None).unwrap();
        exec.finish_all_reduce().unwrap();
        exec.nccl_health().unwrap();
    } else {
        exec.backward(&model, &plan, 1.0, None, None).unwrap();
    }
    let mut grads = vec![0.0; model.params().len()];
    let mut params = vec![0.0; model.params().len()];
    let mut buffers = vec![0.0; model.buffers().len()];
    exec.grads_to_host(&mut grads).unwrap();
    exec.params_to_host(&mut params).unwrap();
    exec.buffers_to_host(&mut buffers).unwrap();
    (grads, params, buffers)
}

#[test]
fn a_world_of_one_through_nccl_leaves_every_bit_as_without_it() {
    let Some(probe) = gpu_probe(
        "a_world_of_one_through_nccl_leaves_every_bit_as_without_it",
        &[Library::Nccl],
    ) else {
        return;
    };
    let plain = one_step(probe, false);
    let through_nccl = one_step(probe, true);
    assert!(plain.0 == through_nccl.0, "gradients differ");
    assert!(plain.1 == through_nccl.1, "parameters differ");
    assert!(plain.2 == through_nccl.2, "running statistics differ");
    assert!(
        plain.0.iter().any(|&grad| grad != 0.0),
        "no gradient at all"
    );
}

/// What `STEPS` whole steps left: the losses, parameters and running statistics (as bits),
/// and how each step ran.
struct WholeSteps {
    losses: Vec<u32>,
    params: Vec<u32>,
    buffers: Vec<u32>,
    runs: Vec<StepRun>,
}

const STEPS: u64 = 5;

/// The NCCL group a run of steps goes through.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Group {
    /// None.
    Alone,
    /// A communicator of one rank.
    WorldOfOne,
    /// The fake NCCL's mirrored communicator of two ranks (see the fake's `MIRRORED_ID`).
    MirroredPair,
}

/// A unique id the fake NCCL takes for a mirrored communicator.
fn mirrored_id() -> [u8; UNIQUE_ID_BYTES] {
    let mut id = [0u8; UNIQUE_ID_BYTES];
    let prefix = b"tandem-fake-nccl-mirrored";
    id[..prefix.len()].copy_from_slice(prefix);
    id
}

/// Joins `group` as rank 0 (with SyncBatchNorm through it when `sync_bn`) and broadcasts
/// the parameters and buffers, as the trainer does at the start.
fn join(probe: &Probe, exec: &mut CudaExecutor, model: &Model, group: Group, sync_bn: bool) {
    let (id, world_size) = match group {
        Group::Alone => return,
        Group::WorldOfOne => (create_unique_id(probe).unwrap(), 1),
        Group::MirroredPair => (mirrored_id(), 2),
    };
    let len = model.params().len();
    exec.join_nccl(
        probe,
        &id,
        0,
        world_size,
        Duration::from_secs(30),
        buckets(len),
    )
    .unwrap();
    if sync_bn {
        exec.sync_batch_norm_through_nccl().unwrap();
    }
    exec.broadcast_params_and_buffers().unwrap();
}

/// `STEPS` whole training steps (`train_step`, SGD with momentum, the learning rate changing,
/// host batches) of `micro_batches` each, with the executor's graphs on or off, through
/// `group` (rank 0's running statistics broadcast before each step, as the trainer does) or
/// alone, with SyncBatchNorm through the group when `sync_bn`.
fn whole_steps(
    probe: &Probe,
    group: Group,
    sync_bn: bool,
    graphs: bool,
    micro_batches: usize,
) -> WholeSteps {
    let model = model();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    exec.set_graphs(graphs);
    join(probe, &mut exec, &model, group, sync_bn);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let loss = LossOptions {
        label_smoothing: 0.1,
    };
    let (mut losses, mut runs) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let micro_batch_steps =
            (0..micro_batches as u64).map(|micro_batch| 10 * step + micro_batch);
        let (images, labels) = common::formula_batches(BATCH, SIDE, micro_batch_steps);
        let config = momentum_sgd(0.05 / (step + 1) as f32, false);
        if group != Group::Alone {
            exec.broadcast_buffers().unwrap();
        }
        let optimizer = StepOptimizer::Sgd(&config);
        let train = host_step(&images, &labels, micro_batches, &loss, optimizer);
        let outcome = exec.train_step(&model, &plan, train).unwrap();
        losses.extend(outcome.losses.iter().map(|loss| loss.to_bits()));
        runs.push(outcome.run);
    }
    exec.synchronize().unwrap();
    exec.nccl_health().unwrap();
    let mut params = vec![0.0f32; model.params().len()];
    let mut buffers = vec![0.0f32; model.buffers().len()];
    exec.params_to_host(&mut params).unwrap();
    exec.buffers_to_host(&mut buffers).unwrap();
    WholeSteps {
        losses,
        params: params.iter().map(|value| value.to_bits()).collect(),
        buffers: buffers.iter().map(|value| value.to_bits()).collect(),
        runs,
    }
}

/// Fails unless `ours` and `theirs` ended with the same losses, parameters and running
/// statistics, bit for bit.
fn assert_same_bits(ours: &WholeSteps, theirs: &WholeSteps, name: &str) {
    assert_eq!(ours.losses, theirs.losses, "losses against {name}");
    assert!(
        ours.params == theirs.params,
        "parameters differ from {name}"
    );
    assert!(
        ours.buffers == theirs.buffers,
        "running statistics differ from {name}"
    );
}

#[test]
fn whole_steps_through_nccl_as_a_cuda_graph_equal_eager_ones_bit_for_bit() {
    let Some(probe) = gpu_probe(
        "whole_steps_through_nccl_as_a_cuda_graph_equal_eager_ones_bit_for_bit",
        &[Library::Nccl],
    ) else {
        return;
    };
    use StepRun::{Capture, Eager, Replay};
    let graphed = whole_steps(probe, Group::WorldOfOne, false, true, 1);
    let eager = whole_steps(probe, Group::WorldOfOne, false, false, 1);
    let alone = whole_steps(probe, Group::Alone, false, true, 1);
    assert_eq!(graphed.runs, [Eager, Capture, Replay, Replay, Replay]);
    assert_eq!(eager.runs, [Eager; STEPS as usize]);
    assert_eq!(alone.runs, graphed.runs);
    assert_same_bits(&graphed, &eager, "eager through NCCL");
    assert_same_bits(&graphed, &alone, "without NCCL");
    let initial: Vec<u32> = model()
        .params()
        .iter()
        .map(|value| value.to_bits())
        .collect();
    assert!(graphed.params != initial, "the steps changed nothing");
}

/// SyncBatchNorm through a world of one sums nothing: graphed and eager, its steps end with
/// the bits of steps without it (its coefficients are computed by the SyncBatchNorm kernels,
/// which compute what the statistics' own launch does).
#[test]
fn sync_bn_through_a_world_of_one_as_a_cuda_graph_equals_steps_without_it() {
    let Some(probe) = gpu_probe(
        "sync_bn_through_a_world_of_one_as_a_cuda_graph_equals_steps_without_it",
        &[Library::Nccl],
    ) else {
        return;
    };
    use StepRun::{Capture, Eager, Replay};
    let graphed = whole_steps(probe, Group::WorldOfOne, true, true, 1);
    let eager = whole_steps(probe, Group::WorldOfOne, true, false, 1);
    let alone = whole_steps(probe, Group::Alone, false, false, 1);
    assert_eq!(graphed.runs, [Eager, Capture, Replay, Replay, Replay]);
    assert_same_bits(&graphed, &eager, "eager SyncBatchNorm through NCCL");
    assert_same_bits(&graphed, &alone, "steps without NCCL");
}

/// Whole steps of two micro-batches (`--grad-accum 2`) through a world of one, with
/// SyncBatchNorm through it: captured with every micro-batch's statistics all-reduced and the
/// last one's buckets, they end with the bits of the same steps eager and of steps without
/// NCCL, each micro-batch's loss included.
#[test]
fn accumulated_steps_through_nccl_with_sync_bn_as_a_cuda_graph_equal_eager_and_alone() {
    let Some(probe) = gpu_probe(
        "accumulated_steps_through_nccl_with_sync_bn_as_a_cuda_graph_equal_eager_and_alone",
        &[Library::Nccl],
    ) else {
        return;
    };
    use StepRun::{Capture, Eager, Replay};
    let graphed = whole_steps(probe, Group::WorldOfOne, true, true, 2);
    let eager = whole_steps(probe, Group::WorldOfOne, true, false, 2);
    let alone = whole_steps(probe, Group::Alone, false, false, 2);
    assert_eq!(graphed.runs, [Eager, Capture, Replay, Replay, Replay]);
    assert_eq!(graphed.losses.len(), 2 * STEPS as usize);
    assert_same_bits(&graphed, &eager, "eager steps through NCCL");
    assert_same_bits(&graphed, &alone, "steps without NCCL");
    let one_micro_batch = whole_steps(probe, Group::Alone, false, false, 1);
    assert!(
        one_micro_batch.params != alone.params,
        "the second micro-batch changed nothing"
    );
}

/// Two ranks holding the same batch train as one, with SyncBatchNorm's statistics summed
/// over both (each layer's count doubled with its sums): on the fake NCCL's mirrored pair,
/// where every sum doubles. Without the sum the doubled count would halve the mean. The
/// losses, parameters and running means are one rank's bit for bit; the running variances
/// are not, as in PyTorch: they are unbiased over the 2N values of both ranks, not N.
#[test]
fn two_mirrored_ranks_with_sync_bn_through_nccl_train_as_one_bit_for_bit() {
    let test = "two_mirrored_ranks_with_sync_bn_through_nccl_train_as_one_bit_for_bit";
    let Some(probe) = gpu_probe(test, &[Library::Nccl]) else {
        return;
    };
    if std::env::var_os("TANDEM_FAKE_GPU_KERNELS").is_none() {
        println!("{test}: skipped: a mirrored communicator is the fake NCCL's (a real one would wait for the second rank)");
        return;
    }
    use StepRun::{Capture, Eager, Replay};
    let pair = whole_steps(probe, Group::MirroredPair, true, true, 1);
    let pair_eager = whole_steps(probe, Group::MirroredPair, true, false, 1);
    let alone = whole_steps(probe, Group::Alone, false, true, 1);
    assert_eq!(pair.runs, [Eager, Capture, Replay, Replay, Replay]);
    assert_same_bits(&pair, &pair_eager, "the pair's eager steps");
    assert_eq!(pair.losses, alone.losses, "losses against one rank alone");
    assert!(
        pair.params == alone.params,
        "parameters differ from one rank alone"
    );
    let model = model();
    let (mut variances, mut different) = (0, 0);
    for info in model.tensors() {
        let range = info.range();
        if info.name.ends_with("running_mean") {
            assert!(
                pair.buffers[range.clone()] == alone.buffers[range],
                "{} differs from one rank alone",
                info.name
            );
        } else if info.name.ends_with("running_var") {
            for index in range {
                let (ours, theirs) = (
                    f32::from_bits(pair.buffers[index]),
                    f32::from_bits(alone.buffers[index]),
                );
                assert!(
                    (ours - theirs).abs() <= 0.1 * theirs.abs(),
                    "{}[{index}]: {ours} against one rank's {theirs}",
                    info.name
                );
                variances += 1;
                different += usize::from(ours != theirs);
            }
        }
    }
    assert!(
        different > variances / 2,
        "only {different} of {variances} running variances are unbiased over both ranks"
    );
}

/// Three shards' gradients (two backwards and one of awkward magnitudes, with a NaN) kept
/// on the device and summed exactly through `group` (`exact_sum_shards`), then a second sum
/// of the first two shards only: the terms kept and the two results.
fn shard_sums(probe: &Probe, group: Group) -> (Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let model = model();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    join(probe, &mut exec, &model, group, false);
    let world_size = if group == Group::MirroredPair { 2 } else { 1 };
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let len = model.params().len();
    let mut terms = Vec::new();
    exec.zero_grads().unwrap();
    for shard in 0..3 {
        if shard < 2 {
            let (images, labels) = formula_batch(BATCH, SIDE, shard as u64);
            let loss = LossOptions::default();
            exec.forward_train(&model, &plan, &images, &labels, &loss, None)
                .unwrap();
            exec.backward(&model, &plan, 0.25, None, None).unwrap();
        } else {
            let awkward: Vec<f32> = (0..len)
                .map(|i| match i % 7 {
                    0 => 1.0e-40 * (i % 13) as f32,
                    1 => -3.0e30,
                    2 => 0.0,
                    _ => (i as f32).sin() * 10f32.powi((i % 11) as i32 - 5),
                })
                .collect();
            exec.grads_from_host(&awkward).unwrap();
        }
        let mut grads = vec![0.0; len];
        exec.grads_to_host(&mut grads).unwrap();
        if shard == 2 {
            grads[len - 1] = f32::NAN;
            exec.grads_from_host(&grads).unwrap();
        }
        terms.push(grads);
        exec.keep_shard_gradients(shard).unwrap();
    }
    let mut zeros = vec![1.0; len];
    exec.grads_to_host(&mut zeros).unwrap();
    assert!(zeros.iter().all(|&value| value == 0.0), "kept, then zeroed");
    let mut sums = (vec![0.0; len], vec![0.0; len]);
    exec.exact_sum_shards(3, 3 * world_size).unwrap();
    exec.grads_to_host(&mut sums.0).unwrap();
    exec.exact_sum_shards(2, 2 * world_size).unwrap();
    exec.grads_to_host(&mut sums.1).unwrap();
    exec.nccl_health().unwrap();
    (terms, sums.0, sums.1)
}

/// The exact sum of `terms` taken `copies` times each, as the host computes it.
fn host_exact_sum(terms: &[Vec<f32>], copies: usize) -> Vec<f32> {
    let all: Vec<&[f32]> = (0..copies)
        .flat_map(|_| terms.iter().map(Vec::as_slice))
        .collect();
    let mut into = vec![0.0; terms[0].len()];
    tandem_dist::exact::local_exact_sum(&all, &mut into);
    into
}

/// Asserts `found` and `expected` bit for bit, naming the first value that differs.
fn assert_bits(found: &[f32], expected: &[f32], what: &str) {
    assert_eq!(found.len(), expected.len(), "{what}: lengths");
    let first = (0..found.len()).find(|&i| found[i].to_bits() != expected[i].to_bits());
    if let Some(i) = first {
        panic!("{what}: value {i} is {} against {}", found[i], expected[i]);
    }
}

/// `--global-batch-size` through NCCL: shard gradients kept on the device and summed exactly
/// through a world of one (and, on the fake GPU, through the fake NCCL's mirrored pair, whose
/// second rank holds the same shards: the sum of six terms) equal `tandem_dist::exact` on the
/// host bit for bit, a NaN spoiling only its block.
#[test]
fn exact_sums_of_shard_gradients_through_nccl_equal_the_hosts_bit_for_bit() {
    let test = "exact_sums_of_shard_gradients_through_nccl_equal_the_hosts_bit_for_bit";
    let Some(probe) = gpu_probe(test, &[Library::Nccl]) else {
        return;
    };
    let mut groups = vec![(Group::WorldOfOne, 1)];
    match std::env::var_os("TANDEM_FAKE_GPU_KERNELS") {
        Some(_) => groups.push((Group::MirroredPair, 2)),
        None => println!("{test}: the mirrored pair skipped: it is the fake NCCL's"),
    }
    for (group, copies) in groups {
        let (terms, three, two) = shard_sums(probe, group);
        let what = format!("{group:?}, three shards");
        assert_bits(&three, &host_exact_sum(&terms, copies), &what);
        let what = format!("{group:?}, the first two shards");
        assert_bits(&two, &host_exact_sum(&terms[..2], copies), &what);
        assert!(three[three.len() - 1].is_nan());
        assert!(three[..three.len() - 64]
            .iter()
            .all(|value| value.is_finite()));
    }
}

#[test]
fn a_rank_that_never_joins_ends_the_join_within_the_timeout() {
    let Some(probe) = gpu_probe(
        "a_rank_that_never_joins_ends_the_join_within_the_timeout",
        &[Library::Nccl],
    ) else {
        return;
    };
    let model = model();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    let id = create_unique_id(probe).unwrap();
    let len = model.params().len();
    let started = Instant::now();
    let error = exec
        .join_nccl(probe, &id, 0, 2, Duration::from_secs(3), buckets(len))
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(
            error,
            GpuError::Collective(CollectiveError::JoinTimedOut { world_size: 2, .. })
        ),
        "{error}"
    );
    assert!(waited < Duration::from_secs(10), "took {waited:?}");
    assert!(!exec.has_nccl());
    assert!(matches!(
        exec.finish_all_reduce(),
        Err(GpuError::NoCommunicator)
    ));
}

/// On the fake GPU only: an exact sum blocked on a rank that joined the communicator and
/// then was lost (the fake NCCL waits for its values forever, as NCCL does) returns within
/// a second of an abort through the group's handle, from another thread, with the reason
/// given; later calls fail with it, and after leaving the group the executor joins a new
/// communicator and sums again. The lost rank is faked by its file in the fake NCCL's
/// meeting folder.
#[test]
fn an_abort_from_another_thread_breaks_a_sum_blocked_on_a_lost_rank() {
    let test = "an_abort_from_another_thread_breaks_a_sum_blocked_on_a_lost_rank";
    let Some(probe) = gpu_probe(test, &[Library::Nccl]) else {
        return;
    };
    if std::env::var_os("TANDEM_FAKE_GPU_KERNELS").is_none() {
        println!("{test}: skipped: the lost rank is faked through the fake NCCL's files");
        return;
    }
    let model = model();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    let id = create_unique_id(probe).unwrap();
    let name: Vec<u8> = id.iter().copied().take_while(|&byte| byte != 0).collect();
    let folder = std::env::temp_dir().join(String::from_utf8(name).unwrap());
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("joined-1"), b"").unwrap();
    let len = model.params().len();
    exec.join_nccl(probe, &id, 0, 2, Duration::from_secs(60), buckets(len))
        .unwrap();
    let abort = exec.nccl_abort_handle().unwrap();
    exec.keep_shard_gradients(0).unwrap();
    let aborting = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        // The blocked sum counts as a wait for the peers (the launcher's stall watch).
        let waited = Activity::now().waiting_ms;
        abort.abort("the job lost a member");
        (Instant::now(), waited)
    });
    let error = exec.exact_sum_shards(1, 2).unwrap_err();
    let (returned, (aborted, waited)) = (Instant::now(), aborting.join().unwrap());
    assert!(
        waited >= 200,
        "the blocked sum waited {waited} ms for its peers"
    );
    assert_eq!(Activity::now().waiting_ms, 0);
    std::fs::remove_dir_all(&folder).unwrap();
    let expected = "NCCL failed: the job lost a member; the communicator was aborted";
    assert_eq!(error.to_string(), expected);
    assert!(
        returned.saturating_duration_since(aborted) < Duration::from_secs(1),
        "returned {:?} after the abort",
        returned.saturating_duration_since(aborted)
    );
    assert_eq!(exec.nccl_health().unwrap_err().to_string(), expected);
    exec.leave_nccl();
    assert!(!exec.has_nccl() && exec.nccl_abort_handle().is_none());
    join(probe, &mut exec, &model, Group::WorldOfOne, false);
    exec.keep_shard_gradients(0).unwrap();
    exec.exact_sum_shards(1, 1).unwrap();
    exec.nccl_health().unwrap();
}
