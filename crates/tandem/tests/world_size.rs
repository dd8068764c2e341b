//! Steps independent of the number of workers (`--global-batch-size`): the same global batch
//! of 128 in 8 shards of 16 trained by one process and under `tandem launch` by 1, 2, 3, 4
//! and 8 workers ends with the same bits, and a snapshot resumes on another number of
//! workers with the bits of the uninterrupted run.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::freeze::{freeze_thread, training_thread};
use common::*;

const LIMIT: Duration = Duration::from_secs(300);

/// 20 steps of 128 samples in one epoch, on one thread per worker.
fn run_args(output_dir: &Path, optimizer: &str) -> Vec<String> {
    let mut args = small_model_train(&format!(
        "--data synthetic --synthetic-train 2560 --synthetic-test 64 --epochs 1 \
         --global-batch-size 128 --batch-size 16 --threads 1 --seed 5 --device cpu \
         --log-every-steps 0 {optimizer}"
    ));
    args.extend(["--output-dir".to_string(), output_dir.display().to_string()]);
    args
}

const SGD_NESTEROV: &str = "--optimizer sgd --momentum 0.9 --nesterov --lr 0.05";
const ADAMW: &str = "--optimizer adamw --lr 0.002 --weight-decay 0.01";

/// Trains `args` in one process (`workers` 0) or under `launch` with `workers` workers.
fn train(workers: usize, args: &[String]) -> String {
    train_tracing(workers, args, None)
}

/// [`train`], each process recording the samples of its steps in `trace` (a folder).
fn train_tracing(workers: usize, args: &[String], trace: Option<&Path>) -> String {
    let mut command = tandem();
    if workers > 0 {
        command
            .args(standalone_launch(&workers.to_string()))
            .arg("--");
    }
    if let Some(folder) = trace {
        command.env("TANDEM_SAMPLE_TRACE", folder);
    }
    expect_success(&run_bounded(command.args(args), LIMIT))
}

/// How often each sample was trained in each epoch, from the per-step records in `trace`.
fn samples_per_epoch(trace: &Path) -> BTreeMap<u64, BTreeMap<u64, usize>> {
    let mut counts: BTreeMap<u64, BTreeMap<u64, usize>> = BTreeMap::new();
    for entry in std::fs::read_dir(trace).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        // A worker killed with SIGKILL while writing a record leaves it without its newline.
        for line in text
            .split_inclusive('\n')
            .filter_map(|line| line.strip_suffix('\n'))
        {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let epoch = counts.entry(record["epoch"].as_u64().unwrap()).or_default();
            for index in record["indices"].as_array().unwrap() {
                *epoch.entry(index.as_u64().unwrap()).or_default() += 1;
            }
        }
    }
    counts
}

/// Asserts that each of `epochs` epochs trained each of `samples` samples exactly once.
fn assert_each_sample_once(trace: &Path, epochs: u64, samples: u64) {
    let counts = samples_per_epoch(trace);
    assert_eq!(
        counts.keys().copied().collect::<Vec<_>>(),
        (0..epochs).collect::<Vec<_>>()
    );
    for (epoch, count) in counts {
        let wrong: Vec<_> = (0..samples)
            .filter(|index| count.get(index) != Some(&1))
            .take(5)
            .map(|index| (index, count.get(&index).copied().unwrap_or(0)))
            .collect();
        assert!(wrong.is_empty(), "epoch {epoch}: (sample, times) {wrong:?}");
        assert_eq!(count.len() as u64, samples, "epoch {epoch}");
    }
}

fn the_same_bits_on_any_number_of_workers(optimizer: &str) {
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("alone");
    train(0, &run_args(&alone, optimizer));
    for workers in [1, 2, 3, 4, 8] {
        let output_dir = dir.path().join(format!("workers-{workers}"));
        let stdout = train(workers, &run_args(&output_dir, optimizer));
        assert_contains(
            &stdout,
            &format!("global batch 128 in 8 shards of 16, shared by {workers} process"),
        );
        assert_same_bits(
            &alone,
            &output_dir,
            &format!("{workers} workers ({optimizer})"),
        );
    }
}

#[test]
fn sync_bn_ends_with_the_same_bits_in_one_process_and_on_1_2_3_4_and_8_workers() {
    let dir = tempfile::tempdir().unwrap();
    let optimizer = format!("{SGD_NESTEROV} --sync-bn");
    let alone = dir.path().join("alone");
    let stdout = train(0, &run_args(&alone, &optimizer));
    assert_contains(
        &stdout,
        "global batch 128 in 8 shards of 16, shared by 1 process (the same steps on 1 to 8); \
         --sync-bn: batch statistics of the whole global batch",
    );
    let without = dir.path().join("without-sync-bn");
    train(0, &run_args(&without, SGD_NESTEROV));
    let (with_state, without_state) = (final_state(&alone), final_state(&without));
    assert!(with_state.0 != without_state.0, "--sync-bn changes nothing");
    for workers in [1, 2, 3, 4, 8] {
        let output_dir = dir.path().join(format!("workers-{workers}"));
        let stdout = train(workers, &run_args(&output_dir, &optimizer));
        assert_contains(&stdout, &format!("shared by {workers} process"));
        assert_same_bits(
            &alone,
            &output_dir,
            &format!("{workers} workers with --sync-bn"),
        );
    }
}

#[test]
fn a_sync_bn_snapshot_of_3_workers_resumes_on_2_with_the_bits_of_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let optimizer = format!("{ADAMW} --sync-bn");
    let alone = dir.path().join("alone");
    train(0, &run_args(&alone, &optimizer));
    let resumed = dir.path().join("resumed");
    let args = run_args(&resumed, &optimizer);
    train(3, &with_flag(args.clone(), "--max-steps", "7"));
    let stdout = train(2, &args);
    assert_contains(&stdout, "world size: 3 -> 2 at epoch 1, step 7");
    assert_same_bits(
        &alone,
        &resumed,
        "--sync-bn stopped on 3 workers, resumed on 2",
    );
}

#[test]
fn sgd_with_nesterov_ends_with_the_same_bits_on_1_2_3_4_and_8_workers() {
    the_same_bits_on_any_number_of_workers(SGD_NESTEROV);
}

#[test]
fn adamw_ends_with_the_same_bits_on_1_2_3_4_and_8_workers() {
    the_same_bits_on_any_number_of_workers(ADAMW);
}

#[test]
fn a_snapshot_of_4_workers_resumes_on_2_and_on_3_with_the_bits_of_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let uninterrupted = dir.path().join("uninterrupted");
    train(4, &run_args(&uninterrupted, SGD_NESTEROV));
    for workers in [2, 3] {
        let output_dir = dir.path().join(format!("resumed-on-{workers}"));
        let args = run_args(&output_dir, SGD_NESTEROV);
        train(4, &with_flag(args.clone(), "--max-steps", "7"));
        let stdout = train(workers, &args);
        assert_contains(
            &stdout,
            "Resuming training from snapshot at epoch 1, step 7",
        );
        assert_contains(
            &stdout,
            &format!(
                "world size: 4 -> {workers} at epoch 1, step 7: the steps stay the same (global \
                 batch 128 in 8 shards of 16)"
            ),
        );
        assert_eq!(
            world_size_changes(&output_dir),
            [format!(r#"[{{"from":4,"step":7,"to":{workers}}}]"#)]
        );
        assert_same_bits(
            &uninterrupted,
            &output_dir,
            &format!("stopped at step 7 on 4 workers, resumed on {workers}"),
        );
    }
}

#[test]
fn a_4_worker_job_killed_with_sigkill_resumes_on_2_with_the_bits_of_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str| {
        let args = with_flag(run_args(&dir.path().join(name), ADAMW), "--epochs", "3");
        with_flag(args, "--snapshot-every-steps", "1")
    };
    train(4, &run("uninterrupted"));
    let killed = dir.path().join("killed");
    let mut command = tandem();
    command
        .args(standalone_launch("4"))
        .arg("--")
        .args(run("killed"));
    let mut launcher = Launcher::spawn(command, dir.path(), "killed");
    let deadline = std::time::Instant::now() + LIMIT;
    while !killed.join("snapshot.safetensors.prev").exists() {
        assert!(!launcher.has_exited(), "{}", launcher.stderr());
        assert!(std::time::Instant::now() < deadline, "no second snapshot");
        std::thread::sleep(Duration::from_millis(5));
    }
    let workers = children(launcher.pid());
    launcher.signal(libc::SIGKILL);
    for worker in workers {
        // SAFETY: `kill` has no memory-safety preconditions; a worker already gone is fine.
        unsafe { libc::kill(worker as libc::pid_t, libc::SIGKILL) };
    }
    launcher.wait(LIMIT);
    assert!(
        !killed.join("epoch_3.safetensors").exists(),
        "the run finished before it could be killed"
    );
    let stdout = train(2, &run("killed"));
    assert_contains(&stdout, "world size: 4 -> 2 at epoch 1, step");
    assert_same_bits(
        &dir.path().join("uninterrupted"),
        &killed,
        "killed on 4 workers, resumed on 2",
    );
}

/// Each epoch's record of the changes of the number of processes, as JSON.
fn world_size_changes(output_dir: &Path) -> Vec<String> {
    let metrics = std::fs::read_to_string(output_dir.join("metrics.jsonl")).unwrap();
    metrics
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            record["world_size_changes"].to_string()
        })
        .collect()
}

#[test]
fn a_per_process_run_resumed_on_fewer_processes_goes_on_at_its_sample_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let output_dir = dir.path().join("run");
    let mut args = small_model_train(
        "--data synthetic --synthetic-train 600 --synthetic-test 64 --epochs 2 --batch-size 16 \
         --threads 1 --seed 3 --device cpu --optimizer sgd --lr 0.05 --scale-lr \
         --log-every-steps 0",
    );
    args.extend(["--output-dir".to_string(), output_dir.display().to_string()]);
    let trace = dir.path().join("trace");
    std::fs::create_dir(&trace).unwrap();
    train_tracing(
        2,
        &with_flag(args.clone(), "--max-steps", "5"),
        Some(&trace),
    );
    let stdout = train_tracing(0, &args, Some(&trace));
    assert_each_sample_once(&trace, 2, 600);
    assert_contains(
        &stdout,
        "world size: 2 -> 1 at epoch 1, step 5: the global batch goes from 32 to 16 (16 per \
         process); training goes on from sample 160 of the epoch's 600; --scale-lr: the \
         learning rate is now 0.05. --global-batch-size 32 would have kept the steps the same \
         on any number of processes",
    );
    // 5 steps of 32, then the other 440 samples in 28 steps of 16 (the last of 8); then an
    // epoch of 38 steps of 16.
    let metrics = std::fs::read_to_string(output_dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            record["steps"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(steps, [33, 38]);
    assert_eq!(
        world_size_changes(&output_dir),
        [r#"[{"from":2,"step":5,"to":1}]"#, "null"]
    );
}

#[test]
fn every_sample_is_trained_once_per_epoch_on_4_then_2_then_3_workers() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    std::fs::create_dir(&trace).unwrap();
    let output_dir = dir.path().join("run");
    let args = with_flag(run_args(&output_dir, SGD_NESTEROV), "--epochs", "2");
    // 20 steps an epoch: 7 on 4 workers, 16 on 2 (into the second epoch), the rest on 3.
    train_tracing(
        4,
        &with_flag(args.clone(), "--max-steps", "7"),
        Some(&trace),
    );
    train_tracing(
        2,
        &with_flag(args.clone(), "--max-steps", "23"),
        Some(&trace),
    );
    train_tracing(3, &args, Some(&trace));
    assert_each_sample_once(&trace, 2, 2560);
    assert_eq!(
        world_size_changes(&output_dir),
        [
            r#"[{"from":4,"step":7,"to":2}]"#.to_string(),
            r#"[{"from":2,"step":23,"to":3}]"#.to_string()
        ]
    );
}

#[test]
fn more_workers_than_shards_and_a_batch_that_does_not_divide_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let args = run_args(&dir.path().join("run"), SGD_NESTEROV);
    let output = run_bounded(
        tandem().args(with_flag(args.clone(), "--batch-size", "24")),
        LIMIT,
    );
    assert_contains(
        &expect_failure(&output),
        "--global-batch-size 128 is not a whole number of micro-batches of --batch-size 24",
    );
    let output = run_bounded(
        tandem()
            .args(standalone_launch("3"))
            .arg("--")
            .args(with_flag(args, "--batch-size", "64")),
        LIMIT,
    );
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{printed}");
    assert_contains(&printed, "3 workers cannot share the 2 shards of a step");
}

/// `bench step --shards-per-process` times the step of `--global-batch-size` under launch.
#[test]
fn bench_step_times_the_step_of_logical_shards() {
    let output = run_bounded(
        tandem()
            .args(standalone_launch("2"))
            .arg("--")
            .args(BENCH_STEP)
            .args(["--batch", "4", "--steps", "1", "--threads", "1"])
            .args(["--device", "cpu", "--shards-per-process", "2"]),
        LIMIT,
    );
    let stdout = expect_success(&output);
    assert_contains(
        &stdout,
        "gradients: 2 shard(s) of 4 images per process, summed exactly",
    );
    assert_contains(&stdout, "train: ");
}

/// The furthest step any worker recorded in `trace`, counted over the epochs of `per_epoch`
/// steps.
fn furthest_step(trace: &Path, per_epoch: u64) -> u64 {
    let mut furthest = 0;
    for entry in std::fs::read_dir(trace).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap_or_default();
        for line in text.lines() {
            if let Ok(record) = serde_json::from_str::<serde_json::Value>(line) {
                let epoch = record["epoch"].as_u64().unwrap_or(0);
                let step = record["step"].as_u64().unwrap_or(0);
                furthest = furthest.max(epoch * per_epoch + step + 1);
            }
        }
    }
    furthest
}

/// Waits until the workers of `launcher` recorded `step` steps in `trace`.
fn wait_for_step(launcher: &mut Launcher, trace: &Path, step: u64) {
    let deadline = std::time::Instant::now() + LIMIT;
    while furthest_step(trace, 20) < step {
        assert!(!launcher.has_exited(), "{}", launcher.stderr());
        assert!(std::time::Instant::now() < deadline, "no step {step}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn survivors_of_a_kill_a_stop_and_a_hang_re_form_in_process_with_the_bits_of_the_uninterrupted_run()
{
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str| {
        with_flag(
            run_args(&dir.path().join(name), SGD_NESTEROV),
            "--epochs",
            "6",
        )
    };
    train(4, &run("uninterrupted"));
    let trace = dir.path().join("trace");
    std::fs::create_dir(&trace).unwrap();
    let reformed = dir.path().join("reformed");
    let mut command = tandem();
    command
        .args(standalone_launch("4"))
        .arg("--keep-survivors")
        .arg("--")
        .args(run("reformed"))
        .env("TANDEM_SAMPLE_TRACE", &trace);
    let mut launcher = Launcher::spawn(command, dir.path(), "reformed");
    wait_for_step(&mut launcher, &trace, 10);
    let (first, second) = (launcher.worker(2), launcher.worker(1));
    let survivors = [launcher.worker(0), launcher.worker(3)];
    let training = training_thread(survivors[1]);
    // SAFETY: kill(2) of child process ids just read.
    assert_eq!(
        unsafe { libc::kill(first as libc::pid_t, libc::SIGKILL) },
        0
    );
    wait_for_step(&mut launcher, &trace, 50);
    let status = expect_success(&run_bounded(tandem().arg("status").arg(&reformed), LIMIT));
    assert_contains(
        &status,
        &format!(
            "membership 1: ranks [0, 1, 3] in the job (last change: rank 2 (pid {first}) killed \
             by SIGKILL)"
        ),
    );
    assert!(
        status
            .lines()
            .any(|line| line.starts_with("   2 ") && line.ends_with("  left out of the job")),
        "{status}"
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::kill(second as libc::pid_t, libc::SIGSTOP) },
        0
    );
    wait_for_step(&mut launcher, &trace, 80);
    assert_eq!(
        [launcher.worker(0), launcher.worker(3)],
        survivors,
        "the survivors were not restarted"
    );
    // The third hangs while its heartbeat thread beats on.
    let tracer = freeze_thread(training, LIMIT);
    wait_for_step(&mut launcher, &trace, 100);
    assert_eq!(launcher.worker(0), survivors[0], "rank 0 was not restarted");
    let status = launcher.wait(LIMIT);
    assert!(tracer.join().unwrap(), "the hung worker was killed");
    let stderr = launcher.stderr();
    assert!(status.success(), "{stderr}");
    assert_contains(
        &stderr,
        &format!("membership 1: rank 2 (pid {first}) killed by SIGKILL; ranks [0, 1, 3] go on"),
    );
    assert_contains(
        &stderr,
        &format!("membership 2: rank 1 (pid {second}) sent no heartbeat for "),
    );
    assert_contains(&stderr, "ranks [0, 3] go on in-process (world size 3 -> 2)");
    assert_contains(
        &stderr,
        &format!(
            "membership 3: rank 3 (pid {}) made no progress for ",
            survivors[1]
        ),
    );
    assert_contains(&stderr, "ranks [0] go on in-process (world size 2 -> 1)");
    let stdout = launcher.stdout();
    assert_contains(&stdout, "world size 4 -> 3 at epoch ");
    assert_contains(&stdout, "world size 3 -> 2 at epoch ");
    assert_contains(&stdout, "world size 2 -> 1 at epoch ");
    assert!(
        !stdout.contains("resum"),
        "nothing was read from disk:\n{stdout}"
    );
    assert_same_bits(
        &dir.path().join("uninterrupted"),
        &reformed,
        "4 workers, one killed, one stopped, one hung",
    );
    assert_each_step_and_sample_once(&trace, 6, 20, 2560);
}

/// Asserts that each of `epochs` epochs committed its `steps` steps, that every process that
/// recorded a step recorded the same samples for it, and that the steps together trained
/// each of `samples` samples exactly once.
fn assert_each_step_and_sample_once(trace: &Path, epochs: u64, steps: u64, samples: u64) {
    let mut committed: BTreeMap<(u64, u64), Vec<u64>> = BTreeMap::new();
    for entry in std::fs::read_dir(trace).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        // A worker killed with SIGKILL while writing a record leaves it without its newline.
        for line in text
            .split_inclusive('\n')
            .filter_map(|line| line.strip_suffix('\n'))
        {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let key = (
                record["epoch"].as_u64().unwrap(),
                record["step"].as_u64().unwrap(),
            );
            let indices: Vec<u64> = record["step_indices"]
                .as_array()
                .expect("a step of a global batch records its samples")
                .iter()
                .map(|index| index.as_u64().unwrap())
                .collect();
            let first = committed.entry(key).or_insert_with(|| indices.clone());
            assert_eq!(*first, indices, "step {key:?} recorded with other samples");
        }
    }
    let expected: Vec<(u64, u64)> = (0..epochs)
        .flat_map(|epoch| (0..steps).map(move |step| (epoch, step)))
        .collect();
    assert_eq!(committed.keys().copied().collect::<Vec<_>>(), expected);
    for epoch in 0..epochs {
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for ((_, _), indices) in committed.range((epoch, 0)..(epoch + 1, 0)) {
            for &index in indices {
                *counts.entry(index).or_default() += 1;
            }
        }
        assert_eq!(counts.len() as u64, samples, "epoch {epoch}");
        assert!(counts.values().all(|&count| count == 1), "epoch {epoch}");
    }
}

/// Waits until the launcher's stderr holds `text`.
fn wait_for_line(launcher: &mut Launcher, text: &str) {
    let deadline = std::time::Instant::now() + LIMIT;
    while !launcher.stderr().contains(text) {
        assert!(
            !launcher.has_exited(),
            "no {text:?} in:\n{}",
            launcher.stderr()
        );
        assert!(std::time::Instant::now() < deadline, "no {text:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn lost_workers_replaced_by_joiners_while_the_job_pauses_leave_the_bits_of_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str| with_flag(run_args(&dir.path().join(name), ADAMW), "--epochs", "6");
    train(4, &run("uninterrupted"));
    let trace = dir.path().join("trace");
    std::fs::create_dir(&trace).unwrap();
    let joined = dir.path().join("joined");
    let mut command = tandem();
    command
        .args(standalone_launch("4"))
        .args(["--keep-survivors", "--replace-lost", "--max-restarts", "2"])
        .args(["--min-workers", "4"])
        .arg("--")
        .args(run("joined"))
        .env("TANDEM_SAMPLE_TRACE", &trace);
    let mut launcher = Launcher::spawn(command, dir.path(), "joined");
    wait_for_step(&mut launcher, &trace, 10);
    let survivors = [launcher.worker(0), launcher.worker(3)];
    let first = launcher.worker(2);
    // SAFETY: kill(2) of a child process id just read.
    assert_eq!(
        unsafe { libc::kill(first as libc::pid_t, libc::SIGKILL) },
        0
    );
    wait_for_line(&mut launcher, "membership 2: rank 2 (pid ");
    let replacement = launcher.worker(2);
    assert_ne!(replacement, first);
    let at_join = furthest_step(&trace, 20);
    wait_for_step(&mut launcher, &trace, at_join + 5);
    let second = launcher.worker(1);
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::kill(second as libc::pid_t, libc::SIGSTOP) },
        0
    );
    wait_for_line(&mut launcher, "membership 4: rank 1 (pid ");
    assert_eq!([launcher.worker(0), launcher.worker(3)], survivors);
    let status = launcher.wait(LIMIT);
    let stderr = launcher.stderr();
    assert!(status.success(), "{stderr}");
    for line in [
        format!(
            "membership 1: rank 2 (pid {first}) killed by SIGKILL; ranks [0, 1, 3] are fewer \
             than --min-workers 4: the job pauses for up to 300 s, until enough are back"
        ),
        // Joiners come last: rank 0 stays with the worker that writes the files.
        format!("membership 2: rank 2 (pid {replacement}) joins; ranks [0, 1, 3, 2] go on"),
        format!("membership 3: rank 1 (pid {second}) sent no heartbeat for "),
        "; ranks [0, 3, 2, 1] go on in-process (world size 3 -> 4)".to_string(),
    ] {
        assert_contains(&stderr, &line);
    }
    let joiner_log = std::fs::read_to_string(joined.join("logs/rank_2.log")).unwrap();
    assert_contains(&joiner_log, "rank 2 joins the running job");
    assert!(
        !joiner_log.contains("resum"),
        "a joiner reads no snapshot:\n{joiner_log}"
    );
    assert_same_bits(
        &dir.path().join("uninterrupted"),
        &joined,
        "4 workers, two lost and replaced by joiners",
    );
    assert_each_step_and_sample_once(&trace, 6, 20, 2560);
}

#[test]
fn a_job_paused_below_its_minimum_ends_after_the_rendezvous_timeout_with_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let output_dir = dir.path().join("paused");
    let trace = dir.path().join("trace");
    std::fs::create_dir(&trace).unwrap();
    let args = with_flag(run_args(&output_dir, SGD_NESTEROV), "--epochs", "50");
    let mut command = tandem();
    command
        .args(standalone_launch("3"))
        .args([
            "--keep-survivors",
            "--min-workers",
            "3",
            "--rendezvous-timeout",
            "2",
        ])
        .arg("--")
        .args(args)
        .env("TANDEM_SAMPLE_TRACE", &trace);
    let mut launcher = Launcher::spawn(command, dir.path(), "paused");
    wait_for_step(&mut launcher, &trace, 5);
    let lost = launcher.worker(2);
    // SAFETY: kill(2) of a child process id just read.
    assert_eq!(unsafe { libc::kill(lost as libc::pid_t, libc::SIGKILL) }, 0);
    let stderr = launcher.exits_with(1, LIMIT);
    assert_contains(
        &stderr,
        &format!(
            "membership 1: rank 2 (pid {lost}) killed by SIGKILL; ranks [0, 1] are fewer than \
             --min-workers 3: the job pauses for up to 2 s, until enough are back"
        ),
    );
    assert_contains(
        &stderr,
        "the job stayed below --min-workers 3 for 2 s (--rendezvous-timeout): its workers write \
         a snapshot and stop",
    );
    let rank_0 = std::fs::read_to_string(output_dir.join("logs/rank_0.log")).unwrap();
    assert_contains(
        &rank_0,
        "start the job again to resume: the job stayed paused below",
    );
    assert!(output_dir.join("snapshot.safetensors").is_file());
}
