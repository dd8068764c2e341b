//! `s3://` paths through the real binary against a real S3-protocol server on loopback
//! (`s3s-fs`, which checks every request's signature): data read from one bucket and every
//! output written to another, a run killed with SIGKILL and resumed on a "fresh node" from
//! the bucket alone, bit-identical; each failure as its named error; an upload whose
//! connection is cut mid-way; and no credential in any file a run writes.
//!
//! Where `s3s-fs` is missing the tests are skipped with the reason, unless `CI` is set
//! (`.ci/run` installs it), where they fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tandem_remote::test_server::{Cut, CuttingProxy, S3Server, ACCESS_KEY, SECRET_KEY};

/// Bound on one training job.
const JOB_LIMIT: Duration = Duration::from_secs(120);

/// `tandem` pointed at `endpoint` with the server's credentials, and none of the
/// environment's own object-storage settings.
fn tandem_at(endpoint: &str) -> Command {
    let mut command = tandem();
    for name in [
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT",
        "OBS_ENDPOINT",
        "S3_ENDPOINT",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "OBS_ACCESS_KEY_ID",
        "OBS_SECRET_ACCESS_KEY",
        "ACCESS_KEY_ID",
        "SECRET_ACCESS_KEY",
    ] {
        command.env_remove(name);
    }
    command
        .env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_REGION", "us-east-1");
    command
}

/// `args` (a subcommand and its flags) with `--cache-dir cache_dir` after the subcommand.
fn with_cache(args: &[String], cache_dir: &Path) -> Vec<String> {
    let mut full = args[..1].to_vec();
    full.extend(["--cache-dir".to_string(), cache_dir.display().to_string()]);
    full.extend(args[1..].iter().cloned());
    full
}

/// Runs `tandem ARGS` at `endpoint` to its end.
fn run(endpoint: &str, cache_dir: &Path, args: &[String]) -> Output {
    run_bounded(
        tandem_at(endpoint).args(with_cache(args, cache_dir)),
        JOB_LIMIT,
    )
}

/// Copies the files of `from` into `to` (recursively), as objects of a bucket.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("the bucket folder");
    for entry in std::fs::read_dir(from).expect("a folder to copy") {
        let entry = entry.expect("an entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a file type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("a copied file");
        }
    }
}

/// Every file under `folder`, recursively.
fn files_under(folder: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let Ok(entries) = std::fs::read_dir(folder) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The names of the files directly in `folder`, sorted (hidden ones left out).
fn names_in(folder: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(folder)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| !name.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Fails when the secret key appears in any file under `folder` or in `output`.
fn assert_no_secret(folders: &[&Path], output: &Output) {
    for folder in folders {
        for file in files_under(folder) {
            let bytes = std::fs::read(&file).expect("a readable file");
            assert!(
                !bytes
                    .windows(SECRET_KEY.len())
                    .any(|window| window == SECRET_KEY.as_bytes()),
                "the secret key is in {}",
                file.display()
            );
        }
    }
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!text.contains(SECRET_KEY), "the secret key was printed");
}

/// Training flags of the small model on the pickle mini set of CIFAR-10 in `data_dir`.
fn pickle_run(data_dir: &str, output_dir: &str) -> Vec<String> {
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    args.extend(
        [
            "--data",
            "cifar10-py",
            "--data-dir",
            data_dir,
            "--epochs",
            "2",
            "--batch-size",
            "64",
            "--threads",
            "1",
            "--seed",
            "3",
            "--keep-last",
            "1",
            "--output-dir",
            output_dir,
        ]
        .iter()
        .map(|arg| arg.to_string()),
    );
    args
}

#[test]
fn a_run_reads_cifar10_from_a_bucket_and_writes_every_output_to_another() {
    tandem_testdata::skip_without_shared!();
    let Some(server) = S3Server::start() else {
        return;
    };
    let shared = tandem_testdata::shared_dir().join("data/cifar10/py-mini");
    assert!(shared.is_dir(), "missing {}", shared.display());
    copy_tree(
        &shared,
        &server.bucket_folder("datasets").join("cifar10-py"),
    );
    server.create_bucket("runs");
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let cache = scratch.path().join("cache");

    let output = run(
        &server.endpoint(),
        &cache,
        &pickle_run("obs://datasets/cifar10-py", "s3://runs/seed-000/output_dir"),
    );
    let stdout = expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("data: fetched 7 of 7 files (")
            && stderr.contains("from obs://datasets/cifar10-py into "),
        "{stderr}"
    );
    assert!(
        stdout.contains("output: s3://runs/seed-000/output_dir (staged in "),
        "{stdout}"
    );
    let bucket_output = server.bucket_folder("runs").join("seed-000/output_dir");
    let names = names_in(&bucket_output);
    let events = names
        .iter()
        .filter(|name| name.starts_with("events.out.tfevents."))
        .count();
    assert_eq!(events, 1, "{names:?}");
    let others: Vec<&String> = names
        .iter()
        .filter(|name| !name.starts_with("events.out.tfevents."))
        .collect();
    assert_eq!(
        others,
        [
            "config.toml",
            "curves.png",
            "epoch_2.safetensors",
            "metrics.jsonl",
            "snapshot.safetensors"
        ],
        "every output is in the bucket, and --keep-last 1 applies there"
    );
    let staged = cache.join("runs/runs/seed-000/output_dir");
    for name in &names {
        let object = std::fs::read(bucket_output.join(name)).expect("the object");
        let local = std::fs::read(staged.join(name)).expect("the staged file");
        assert!(
            object == local,
            "{name} in the bucket differs from the staged file"
        );
    }
    let config = std::fs::read_to_string(bucket_output.join("config.toml")).expect("config");
    assert!(
        config.contains("output-dir = \"s3://runs/seed-000/output_dir\"")
            && config.contains("data-dir = \"obs://datasets/cifar10-py\""),
        "config.toml keeps the URLs as given:\n{config}"
    );
    assert_eq!(
        std::fs::read_to_string(bucket_output.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .count(),
        2
    );
    assert_no_secret(&[scratch.path(), &server.bucket_folder("runs")], &output);

    // The same job on the local copy of the data gives the same weights, bit for bit.
    let local_output = scratch.path().join("local");
    let local = run(
        &server.endpoint(),
        &cache,
        &pickle_run(
            &shared.display().to_string(),
            &local_output.display().to_string(),
        ),
    );
    expect_success(&local);
    assert_eq!(
        read_tensors(&bucket_output.join("epoch_2.safetensors")),
        read_tensors(&local_output.join("epoch_2.safetensors"))
    );

    // A second run finds the data current and fetches nothing; the finished run says so.
    let again = run(
        &server.endpoint(),
        &cache,
        &pickle_run("obs://datasets/cifar10-py", "s3://runs/seed-000/output_dir"),
    );
    let again_stdout = expect_success(&again);
    let again_stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        again_stderr.contains("holds a current copy of obs://datasets/cifar10-py (7 files)"),
        "{again_stderr}"
    );
    assert!(
        again_stdout.contains("2/2 epochs done; raise --epochs to continue"),
        "{again_stdout}"
    );

    // eval reads the checkpoint and, through it, the data from the buckets.
    let eval = run(
        &server.endpoint(),
        &cache,
        &[
            "eval".to_string(),
            "--checkpoint".to_string(),
            "s3://runs/seed-000/output_dir/epoch_2.safetensors".to_string(),
            "--json".to_string(),
        ],
    );
    let report = expect_success(&eval);
    let accuracy = serde_json::from_str::<serde_json::Value>(report.trim())
        .expect("one JSON object")["accuracy"]
        .as_f64()
        .expect("an accuracy");
    let metrics = std::fs::read_to_string(bucket_output.join("metrics.jsonl")).expect("metrics");
    let last: serde_json::Value =
        serde_json::from_str(metrics.lines().last().expect("a line")).expect("a record");
    assert_eq!(Some(accuracy), last["val_accuracy"].as_f64());
}

#[test]
fn json_and_binary_layouts_are_fetched_and_a_damaged_official_file_is_refused() {
    tandem_testdata::skip_without_shared!();
    let Some(server) = S3Server::start() else {
        return;
    };
    let shared = tandem_testdata::shared_dir().join("data/cifar10");
    copy_tree(
        &shared.join("json-subset"),
        &server.bucket_folder("datasets").join("json"),
    );
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let cache = scratch.path().join("cache");
    let mut json = vec!["train".to_string()];
    json.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    json.extend(
        [
            "--data",
            "json-folder",
            "--data-dir",
            "s3://datasets/json",
            "--max-steps",
            "2",
            "--batch-size",
            "32",
            "--threads",
            "1",
        ]
        .map(String::from),
    );
    json.extend([
        "--output-dir".to_string(),
        scratch.path().join("json-run").display().to_string(),
    ]);
    let output = run(&server.endpoint(), &cache, &json);
    expect_success(&output);
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("data: fetched 1202 of 1202 files"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // The binary layout: one official batch file with a flipped byte.
    let batches = scratch.path().join("batches");
    let archive = std::fs::File::open(shared.join("cifar-10-batches-bin.tar.gz"))
        .expect("the shared CIFAR-10 archive");
    tar::Archive::new(flate2::read::GzDecoder::new(archive))
        .unpack(&batches)
        .expect("the archive unpacks");
    let bin_bucket = server.bucket_folder("datasets").join("bin");
    copy_tree(&batches, &bin_bucket);
    let damaged = bin_bucket.join("cifar-10-batches-bin/data_batch_3.bin");
    let mut bytes = std::fs::read(&damaged).expect("a batch");
    bytes[12345] ^= 1;
    std::fs::write(&damaged, bytes).expect("the damaged batch");
    let mut bin = json.clone();
    bin = with_flag(bin, "--data", "cifar10-bin");
    bin = with_flag(bin, "--data-dir", "s3://datasets/bin");
    bin = with_flag(
        bin,
        "--output-dir",
        &scratch.path().join("bin-run").display().to_string(),
    );
    let refused = run(&server.endpoint(), &cache, &bin);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("s3://datasets/bin/cifar-10-batches-bin/data_batch_3.bin: md5 is ")
            && stderr.contains("expected CIFAR-10's 942cd6a4bcdd0dd3c604fbe906cb4421"),
        "{stderr}"
    );
    // Repaired in the bucket, the next run fetches only that file and trains.
    std::fs::copy(
        batches.join("cifar-10-batches-bin/data_batch_3.bin"),
        &damaged,
    )
    .expect("the repaired batch");
    let repaired = run(&server.endpoint(), &cache, &bin);
    expect_success(&repaired);
    let stderr = String::from_utf8_lossy(&repaired.stderr);
    assert!(
        stderr.contains("data: fetched 1 of 7 files (30.7 MB)"),
        "{stderr}"
    );
}

/// Flags of a synthetic run long enough to be killed mid-way, its outputs in the bucket.
fn long_run(output_dir: &str) -> Vec<String> {
    let mut args = synthetic_run(Path::new(output_dir), 3000);
    args = with_flag(args, "--epochs", "3");
    args = with_flag(args, "--output-dir", output_dir);
    args.extend(["--snapshot-every-steps".to_string(), "4".to_string()]);
    args
}

#[test]
fn a_run_killed_on_a_lost_node_resumes_from_the_bucket_and_ends_bit_identical() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("runs");
    let scratch = tempfile::tempdir().expect("a temporary folder");

    let whole = run(
        &server.endpoint(),
        &scratch.path().join("cache-whole"),
        &long_run("s3://runs/whole"),
    );
    expect_success(&whole);

    // The lost node: killed once the bucket holds a mid-run snapshot.
    let lost_cache = scratch.path().join("cache-lost");
    let mut child = tandem_at(&server.endpoint())
        .args(with_cache(&long_run("s3://runs/killed"), &lost_cache))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the run starts");
    let snapshot_object = server
        .bucket_folder("runs")
        .join("killed/snapshot.safetensors");
    let deadline = Instant::now() + JOB_LIMIT;
    while !snapshot_object.exists() {
        assert!(
            child.try_wait().expect("poll").is_none(),
            "the run ended before the bucket held a snapshot"
        );
        assert!(Instant::now() < deadline, "no snapshot reached the bucket");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert!(
        !server
            .bucket_folder("runs")
            .join("killed/epoch_3.safetensors")
            .exists(),
        "the run was killed before its end"
    );

    // A fresh node: an empty disk, the same command.
    std::fs::remove_dir_all(&lost_cache).expect("the lost node's disk is gone");
    let resumed = run(
        &server.endpoint(),
        &scratch.path().join("cache-fresh-node"),
        &long_run("s3://runs/killed"),
    );
    let stdout = expect_success(&resumed);
    assert!(
        stdout.contains("resumed from s3://runs/killed/snapshot.safetensors (epoch "),
        "{stdout}"
    );
    let bucket = server.bucket_folder("runs");
    for name in ["epoch_3.safetensors", "snapshot.safetensors"] {
        assert_eq!(
            read_tensors(&bucket.join("killed").join(name)),
            read_tensors(&bucket.join("whole").join(name)),
            "{name} differs from the uninterrupted run's"
        );
    }
}

#[test]
fn each_object_storage_failure_is_a_named_error_without_credentials() {
    let Some(mut server) = S3Server::start() else {
        return;
    };
    server.create_bucket("runs");
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let cache = scratch.path().join("cache");
    let train = |output: &str| synthetic_run(Path::new(output), 64);
    let stderr_of = |output: &Output| {
        assert!(!output.status.success(), "the run should fail");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };

    // Wrong credentials.
    let mut wrong = tandem();
    wrong
        .env("AWS_ENDPOINT_URL", server.endpoint())
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", "not-the-secret-key")
        .args(["train", "--cache-dir"])
        .arg(&cache)
        .args(&train("s3://runs/denied")[1..]);
    let denied = run_bounded(&mut wrong, JOB_LIMIT);
    let message = stderr_of(&denied);
    assert!(message.contains(": access denied ("), "{message}");
    assert!(!message.contains("not-the-secret-key"), "{message}");

    // No credentials at all for a non-Amazon endpoint.
    let mut anonymous = tandem();
    anonymous
        .env("AWS_ENDPOINT_URL", server.endpoint())
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .args(["train", "--cache-dir"])
        .arg(&cache)
        .args(&train("s3://runs/anonymous")[1..]);
    let message = stderr_of(&run_bounded(&mut anonymous, JOB_LIMIT));
    assert!(
        message.contains(&format!(
            "no credentials for {}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            server.endpoint()
        )),
        "{message}"
    );

    // A missing bucket, a missing key.
    let missing_bucket = run(
        &server.endpoint(),
        &cache,
        &with_flag(
            with_flag(train("x"), "--data", "cifar10-py"),
            "--data-dir",
            "s3://no-such-bucket/cifar",
        ),
    );
    let message = stderr_of(&missing_bucket);
    assert!(
        message.contains("s3://no-such-bucket/cifar: no such bucket 'no-such-bucket'"),
        "{message}"
    );
    let missing_key = run(
        &server.endpoint(),
        &cache,
        &with_flag(
            train(&scratch.path().join("out").display().to_string()),
            "--init-from",
            "s3://runs/none/weights.safetensors",
        ),
    );
    let message = stderr_of(&missing_key);
    assert!(
        message.contains("s3://runs/none/weights.safetensors: no such object"),
        "{message}"
    );

    // A stopped server, after a bounded retry.
    let endpoint = server.endpoint();
    server.stop();
    let started = Instant::now();
    let stopped = run(
        &endpoint,
        &cache,
        &with_flag(train("s3://runs/stopped"), "--s3-retry-timeout", "1"),
    );
    let message = stderr_of(&stopped);
    assert!(
        message.contains(&format!("endpoint {endpoint} unreachable (")),
        "{message}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the retries are bounded"
    );
    for output in [&denied, &missing_bucket, &missing_key, &stopped] {
        assert_no_secret(&[scratch.path()], output);
    }
}

#[test]
fn an_upload_cut_mid_way_is_retried_and_every_object_is_whole() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("runs");
    let proxy = CuttingProxy::start(server.port(), Cut::Requests, 40_000);
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let cache = scratch.path().join("cache");
    let output = run(
        &proxy.endpoint(),
        &cache,
        &synthetic_run(Path::new("s3://runs/cut"), 192),
    );
    expect_success(&output);
    assert_eq!(proxy.cuts(), 1, "the proxy cut a connection");
    let bucket = server.bucket_folder("runs").join("cut");
    let staged = cache.join("runs/runs/cut");
    let names = names_in(&bucket);
    assert!(
        names.contains(&"snapshot.safetensors".to_string()),
        "{names:?}"
    );
    for name in &names {
        let object = std::fs::read(bucket.join(name)).expect("the object");
        let local = std::fs::read(staged.join(name)).expect("the staged file");
        assert!(
            object == local,
            "{name} in the bucket differs from the staged file"
        );
    }
}

#[test]
fn an_upload_failure_that_outlasts_the_retries_stops_the_run_and_keeps_the_snapshot() {
    let Some(mut server) = S3Server::start() else {
        return;
    };
    server.create_bucket("runs");
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let cache = scratch.path().join("cache");
    let args = with_flag(long_run("s3://runs/failing"), "--s3-retry-timeout", "1");
    let child = tandem_at(&server.endpoint())
        .args(with_cache(&args, &cache))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the run starts");
    let config_object = server.bucket_folder("runs").join("failing/config.toml");
    let deadline = Instant::now() + JOB_LIMIT;
    while !config_object.exists() {
        assert!(Instant::now() < deadline, "nothing reached the bucket");
        std::thread::sleep(Duration::from_millis(5));
    }
    server.stop();
    let output = wait_bounded(child, JOB_LIMIT);
    assert!(
        !output.status.success(),
        "the run must not end as if uploaded"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let staged_snapshot = cache.join("runs/runs/failing/snapshot.safetensors");
    assert!(
        stderr.contains("cannot upload ")
            && stderr.contains(" unreachable (")
            && stderr.contains(&format!(
                "its snapshot is kept locally in {}: run the same command again",
                staged_snapshot.display()
            )),
        "{stderr}"
    );
    assert!(staged_snapshot.is_file(), "the snapshot is kept locally");
    assert!(
        !server
            .bucket_folder("runs")
            .join("failing/epoch_3.safetensors")
            .exists(),
        "the run stopped early"
    );
}

#[test]
fn a_launch_job_fetches_the_data_once_per_node_and_uploads_from_rank_0() {
    tandem_testdata::skip_without_shared!();
    let Some(server) = S3Server::start() else {
        return;
    };
    copy_tree(
        &tandem_testdata::shared_dir().join("data/cifar10/json-subset"),
        &server.bucket_folder("datasets").join("json"),
    );
    server.create_bucket("runs");
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let cache = scratch.path().join("cache");
    let mut train = with_cache(&synthetic_run(Path::new("s3://runs/ddp"), 64), &cache);
    train = with_flag(train, "--data", "json-folder");
    train = with_flag(train, "--data-dir", "s3://datasets/json");
    train = with_flag(train, "--max-steps", "3");
    let mut launch = tandem_at(&server.endpoint());
    launch
        .args(["launch", "--standalone", "--nproc-per-node", "2", "--"])
        .args(&train)
        .env_remove("TANDEM_JOB_TOKEN");
    let output = run_bounded(&mut launch, JOB_LIMIT);
    expect_success(&output);
    let bucket = server.bucket_folder("runs").join("ddp");
    for name in ["config.toml", "snapshot.safetensors"] {
        assert!(bucket.join(name).is_file(), "{name} is not in the bucket");
    }
    // The launcher's logs are in the run's staging folder, not in a folder named "s3:".
    let logs = cache.join("runs/runs/ddp/logs");
    let log_text: Vec<String> = ["rank_0.log", "rank_1.log"]
        .iter()
        .map(|name| std::fs::read_to_string(logs.join(name)).expect("a worker's log"))
        .collect();
    let fetched = log_text
        .iter()
        .filter(|log| log.contains("data: fetched 1202 of 1202 files"))
        .count();
    let reused = log_text
        .iter()
        .filter(|log| log.contains("holds a current copy of s3://datasets/json (1202 files)"))
        .count();
    assert_eq!((fetched, reused), (1, 1), "{log_text:?}");
    assert!(!Path::new("s3:").exists());
    assert_no_secret(&[scratch.path(), &server.bucket_folder("runs")], &output);
}
