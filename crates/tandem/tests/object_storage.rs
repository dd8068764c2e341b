//! `s3://` paths through the real binary against a real S3-protocol server on loopback
//! (`s3s-fs`, which checks every request's signature): data read from one bucket and every
//! output written to another, a run killed with SIGKILL and resumed on a "fresh node" from
//! the bucket alone, bit-identical; each failure as its named error; an upload whose
//! connection is cut mid-way; outages at several moments, after which the next run uploads
//! everything left pending; checkpoints that find their data from another cache; the
//! launcher's logs; and no credential in any file a run writes.
//!
//! Where `s3s-fs` is missing the tests are skipped with the reason, unless `CI` is set
//! (`.ci/run` installs it), where they fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tandem_remote::test_server::{
    Cut, CuttingProxy, OutageProxy, S3Server, ACCESS_KEY, SECRET_KEY,
};

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

/// The test S3 server with a `runs` bucket, and a scratch folder; `None` where the server
/// cannot run here (the test skips).
fn server_with_a_runs_bucket() -> Option<(S3Server, tempfile::TempDir)> {
    let server = S3Server::start()?;
    server.create_bucket("runs");
    Some((server, tempfile::tempdir().expect("a temporary folder")))
}

/// Runs `eval --checkpoint <checkpoint> --json` at `server` with `cache`, checks that it
/// reports the last validation accuracy of the run's `metrics` file, and returns its output.
fn eval_as_trained(server: &S3Server, cache: &Path, checkpoint: &str, metrics: &Path) -> Output {
    let eval = run(
        &server.endpoint(),
        cache,
        &["eval", "--checkpoint", checkpoint, "--json"].map(String::from),
    );
    let report = expect_success(&eval);
    let accuracy = serde_json::from_str::<serde_json::Value>(report.trim())
        .expect("one JSON object")["accuracy"]
        .as_f64()
        .expect("an accuracy");
    let metrics = std::fs::read_to_string(metrics).expect("metrics");
    let last: serde_json::Value =
        serde_json::from_str(metrics.lines().last().expect("a line")).expect("a record");
    assert_eq!(Some(accuracy), last["val_accuracy"].as_f64());
    eval
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
    let mut args = small_model_train(
        "--data cifar10-py --epochs 2 --batch-size 64 --threads 1 --seed 3 --keep-last 1",
    );
    args.extend(["--data-dir", data_dir, "--output-dir", output_dir].map(String::from));
    args
}

#[test]
fn a_run_reads_cifar10_from_a_bucket_and_writes_every_output_to_another() {
    tandem_testdata::skip_without_shared!();
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    let shared = tandem_testdata::shared_dir().join("data/cifar10/py-mini");
    assert!(shared.is_dir(), "missing {}", shared.display());
    copy_tree(
        &shared,
        &server.bucket_folder("datasets").join("cifar10-py"),
    );
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
    assert_contains(
        &again_stderr,
        "holds a current copy of obs://datasets/cifar10-py (7 files)",
    );
    assert!(
        again_stdout.contains("2/2 epochs done; raise --epochs to continue"),
        "{again_stdout}"
    );

    // eval reads the checkpoint and, through it, the data from the buckets.
    let checkpoint = "s3://runs/seed-000/output_dir/epoch_2.safetensors";
    eval_as_trained(
        &server,
        &cache,
        checkpoint,
        &bucket_output.join("metrics.jsonl"),
    );
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
    let stderr = expect_failure(&refused);
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
    assert_contains(&stderr, "data: fetched 1 of 7 files (30.7 MB)");
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
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };

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
    let Some((mut server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
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
    assert!(
        message.contains(&format!(
            ") at {} (from AWS_ENDPOINT_URL); check the credentials, the bucket's policy, and \
             that this endpoint serves the bucket",
            server.endpoint()
        )),
        "{message}"
    );
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
    assert_contains(
        &message,
        &format!(
            "no credentials for {}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            server.endpoint()
        ),
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
    assert_contains(
        &message,
        "s3://no-such-bucket/cifar: no such bucket 'no-such-bucket'",
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
    assert_contains(
        &message,
        "s3://runs/none/weights.safetensors: no such object",
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
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    let proxy = CuttingProxy::start(server.port(), Cut::Requests, 40_000);
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
fn a_launch_job_fetches_the_data_once_per_node_and_uploads_from_rank_0() {
    tandem_testdata::skip_without_shared!();
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    copy_tree(
        &tandem_testdata::shared_dir().join("data/cifar10/json-subset"),
        &server.bucket_folder("datasets").join("json"),
    );
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
    // The launcher's logs are uploaded beside the run's outputs.
    for name in ["rank_0.log", "rank_1.log"] {
        assert_eq!(
            std::fs::read(bucket.join("logs").join(name)).ok(),
            std::fs::read(logs.join(name)).ok(),
            "logs/{name} in the bucket differs from the staged log"
        );
    }
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("tandem launch: logs: 2 file(s) of logs/ and errors/ are in s3://runs/ddp"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn a_failed_launch_job_uploads_its_logs_and_error_files() {
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    let cache = scratch.path().join("cache");
    let train = with_flag(
        with_cache(&synthetic_run(Path::new("obs://runs/broken"), 64), &cache),
        "--init-from",
        "s3://runs/none/weights.safetensors",
    );
    let mut launch = tandem_at(&server.endpoint());
    launch
        .args(standalone_launch("1"))
        .arg("--")
        .args(&train)
        .env_remove("TANDEM_JOB_TOKEN");
    let output = run_bounded(&mut launch, JOB_LIMIT);
    assert!(!output.status.success(), "the worker fails");
    let staged = cache.join("runs/runs/broken");
    let bucket = server.bucket_folder("runs").join("broken");
    for name in ["logs/rank_0.log", "errors/rank_0.json"] {
        let object = std::fs::read(bucket.join(name))
            .unwrap_or_else(|_| panic!("{name} is not in the bucket"));
        assert_eq!(
            Some(object),
            std::fs::read(staged.join(name)).ok(),
            "{name} in the bucket differs from the staged file"
        );
    }
    let error = std::fs::read_to_string(bucket.join("errors/rank_0.json")).expect("the record");
    assert_contains(&error, "s3://runs/none/weights.safetensors: no such object");
}

/// Flags of a synthetic run of two epochs of a few seconds each (so that an outage's
/// failure, a second of retries after it began, comes mid-run), a snapshot every 16 steps,
/// its outputs in `output_dir`, its failing requests retried for a second.
fn outage_run(output_dir: &str) -> Vec<String> {
    let mut args = synthetic_run(Path::new(output_dir), 9600);
    args = with_flag(args, "--output-dir", output_dir);
    args = with_flag(args, "--snapshot-every-steps", "16");
    with_flag(args, "--s3-retry-timeout", "1")
}

/// Every file a run staged in `staged` (but its lock and the previous snapshot, which stay
/// local) is in `bucket` with the same bytes, and nothing is pending.
fn assert_bucket_holds_every_staged_file(staged: &Path, bucket: &Path) {
    let mut checked = 0;
    for file in files_under(staged) {
        let name = file.strip_prefix(staged).expect("below the staging folder");
        let text = name.display().to_string();
        if text == "tandem.lock" || text.ends_with(".prev") {
            continue;
        }
        let object = std::fs::read(bucket.join(name))
            .unwrap_or_else(|_| panic!("{text} is staged but not in the bucket"));
        let local = std::fs::read(&file).expect("the staged file");
        assert!(
            object == local,
            "{text} in the bucket differs from the staged file"
        );
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} files were staged");
    let pending = staged.with_file_name(format!(
        "{}.pending-uploads",
        staged.file_name().expect("a name").to_string_lossy()
    ));
    assert!(!pending.exists(), "{} is left", pending.display());
}

/// A run staged in `staged` failed for an upload: it says so, what is kept and what is
/// pending where, and claims nothing is in the bucket.
fn assert_failed_for_an_upload(output: &Output, staged: &Path) {
    assert!(
        !output.status.success(),
        "a run that could not upload must not end as if it had"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let pending = format!("{}.pending-uploads", staged.display());
    assert!(
        stderr.contains("cannot upload ")
            && stderr.contains(&format!(
                "its snapshot is kept locally in {}, and ",
                staged.join("snapshot.safetensors").display()
            ))
            && stderr.contains(&format!(
                " upload(s) are pending (recorded in {pending}); run the same command again"
            )),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !stderr.contains("Stopped on request")
            && !stderr.contains("the snapshot is s3://")
            && !stderr.contains("the snapshot is obs://"),
        "{stderr}"
    );
    assert!(!stdout.contains("Stopped on request"), "{stdout}");
    assert!(
        std::fs::read_dir(&pending).is_ok_and(|mut entries| entries.next().is_some()),
        "{pending} records nothing"
    );
    assert!(
        staged.join("snapshot.safetensors").is_file(),
        "the snapshot is kept locally"
    );
}

/// After an outage that failed the first run of `args`: the next run uploads what is
/// pending before it trains and finishes, a third finds the run done, and the bucket then
/// holds every staged file, one event file per training session.
fn assert_the_next_runs_recover(
    endpoint: &str,
    cache: &Path,
    args: &[String],
    staged: &Path,
    bucket: &Path,
) {
    let url = args
        .iter()
        .position(|arg| arg == "--output-dir")
        .map(|index| args[index + 1].clone())
        .expect("an output URL");
    let second = run(endpoint, cache, args);
    let stdout = expect_success(&second);
    let stderr = String::from_utf8_lossy(&second.stderr);
    let before_training = stderr
        .find(&format!(
            "left pending by an earlier run (recorded in {}.pending-uploads); uploading them \
             to {url} first",
            staged.display()
        ))
        .unwrap_or_else(|| panic!("nothing said of the pending uploads:\n{stderr}"));
    assert!(
        stderr[before_training..]
            .contains(&format!("an earlier run left pending are now in {url}")),
        "{stderr}"
    );
    // The first run stopped mid-run, or (on a fast machine) had trained to its end when its
    // failing uploads stopped it: either way the second run resumes or finds it done.
    let resumed = stdout.contains(&format!("resumed from {url}/snapshot.safetensors (epoch "));
    let finished = stdout.contains(&format!(
        "finished: {url}/snapshot.safetensors holds the end of epoch 2"
    ));
    assert!(resumed || finished, "{stdout}");
    let third = run(endpoint, cache, args);
    let stdout = expect_success(&third);
    assert_contains(&stdout, "2/2 epochs done");
    assert_bucket_holds_every_staged_file(staged, bucket);
    let event_files = names_in(bucket)
        .iter()
        .filter(|name| name.starts_with("events.out.tfevents."))
        .count();
    // One event file per session that trained.
    let sessions = if resumed { 2 } else { 1 };
    assert_eq!(event_files, sessions, "{:?}", names_in(bucket));
    for name in [
        "epoch_1.safetensors",
        "epoch_2.safetensors",
        "metrics.jsonl",
    ] {
        assert!(bucket.join(name).is_file(), "{name} is not in the bucket");
    }
}

#[test]
fn after_an_outage_mid_run_the_next_run_uploads_everything_left_pending_first() {
    let Some((mut server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    let cache = scratch.path().join("cache");
    let args = outage_run("s3://runs/outage");
    let staged = cache.join("runs/runs/outage");
    let child = tandem_at(&server.endpoint())
        .args(with_cache(&args, &cache))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the run starts");
    // The store goes down once the first epoch's checkpoint is written.
    let deadline = Instant::now() + JOB_LIMIT;
    while !staged.join("epoch_1.safetensors").exists() {
        assert!(Instant::now() < deadline, "the first epoch did not end");
        std::thread::sleep(Duration::from_millis(2));
    }
    server.stop();
    let first = wait_bounded(child, JOB_LIMIT);
    assert_failed_for_an_upload(&first, &staged);
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(
        stderr.contains(&format!("endpoint {} unreachable (", server.endpoint())),
        "{stderr}"
    );
    server.restart();
    assert_the_next_runs_recover(
        &server.endpoint(),
        &cache,
        &args,
        &staged,
        &server.bucket_folder("runs").join("outage"),
    );
}

/// A run whose outputs go to `scheme://runs/NAME` through a proxy that goes dark at the
/// request line `trigger`: it fails for an upload, `after_outage` checks the run's folder in
/// the bucket, and the next runs recover.
fn outage_at_request(scheme: &str, name: &str, trigger: &str, after_outage: impl Fn(&Path)) {
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    let proxy = OutageProxy::start(server.port(), trigger);
    let cache = scratch.path().join("cache");
    let args = outage_run(&format!("{scheme}://runs/{name}"));
    let staged = cache.join("runs/runs").join(name);
    let first = run(&proxy.endpoint(), &cache, &args);
    assert!(proxy.is_dark(), "the outage began");
    assert_failed_for_an_upload(&first, &staged);
    let bucket = server.bucket_folder("runs").join(name);
    after_outage(&bucket);
    proxy.restore();
    assert_the_next_runs_recover(&proxy.endpoint(), &cache, &args, &staged, &bucket);
}

#[test]
fn an_outage_during_the_first_upload_of_an_obs_run_leaves_it_pending_for_the_next_run() {
    outage_at_request("obs", "first", "PUT /runs/first/", |bucket| {
        assert!(names_in(bucket).is_empty(), "{:?}", names_in(bucket));
    });
}

#[test]
fn an_outage_during_a_snapshot_upload_leaves_it_pending_for_the_next_run() {
    let trigger = "PUT /runs/snap/snapshot.safetensors";
    outage_at_request("s3", "snap", trigger, |bucket| {
        assert!(
            bucket.join("config.toml").is_file() && !bucket.join("snapshot.safetensors").exists(),
            "the snapshot's upload was cut: {:?}",
            names_in(bucket)
        );
    });
}

#[test]
fn uploads_left_pending_in_a_cache_never_overwrite_a_bucket_that_moved_on() {
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    let proxy = OutageProxy::start(server.port(), "PUT /runs/moved/snapshot.safetensors");
    let args = outage_run("s3://runs/moved");
    let left_behind = scratch.path().join("cache-left-behind");
    let staged = left_behind.join("runs/runs/moved");
    assert_failed_for_an_upload(&run(&proxy.endpoint(), &left_behind, &args), &staged);
    proxy.restore();
    // Another machine runs the job to its end.
    let other = scratch.path().join("cache-other");
    expect_success(&run(&proxy.endpoint(), &other, &args));
    let bucket = server.bucket_folder("runs").join("moved");
    let finished = std::fs::read(bucket.join("snapshot.safetensors")).expect("the snapshot");
    // The first cache's pending snapshot is older than the bucket's: it is dropped.
    let again = run(&proxy.endpoint(), &left_behind, &args);
    assert!(
        std::fs::read(bucket.join("snapshot.safetensors")).ok() == Some(finished),
        "the bucket's snapshot was replaced by an older one"
    );
    let stdout = expect_success(&again);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_contains(
        &stderr,
        &format!(
            "left pending in {}.pending-uploads by an earlier run are dropped: s3://runs/moved \
             is further on than they are",
            staged.display()
        ),
    );
    assert_contains(&stdout, "2/2 epochs done");
    assert!(!left_behind.join("runs/runs/moved.pending-uploads").exists());
}

#[test]
fn a_checkpoint_of_obs_data_fetches_it_again_from_another_cache() {
    tandem_testdata::skip_without_shared!();
    let Some((server, scratch)) = server_with_a_runs_bucket() else {
        return;
    };
    copy_tree(
        &tandem_testdata::shared_dir().join("data/cifar10/py-mini"),
        &server.bucket_folder("datasets").join("cifar10-py"),
    );
    let first_cache = scratch.path().join("cache-first-node");
    let train = with_flag(
        pickle_run("obs://datasets/cifar10-py", "s3://runs/l2"),
        "--epochs",
        "1",
    );
    expect_success(&run(&server.endpoint(), &first_cache, &train));
    let checkpoint = server.bucket_folder("runs").join("l2/epoch_1.safetensors");
    let bytes = std::fs::read(&checkpoint).expect("the checkpoint is in the bucket");
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).expect("a safetensors file");
    let metadata = header.metadata().clone().unwrap_or_default();
    assert_eq!(
        metadata.get("tandem.data-dir").map(String::as_str),
        Some("obs://datasets/cifar10-py"),
        "the data folder as given"
    );
    // Another node: the first cache is gone.
    std::fs::remove_dir_all(&first_cache).expect("the first node's disk is gone");
    let eval = eval_as_trained(
        &server,
        &scratch.path().join("cache-other-node"),
        "obs://runs/l2/epoch_1.safetensors",
        &server.bucket_folder("runs").join("l2/metrics.jsonl"),
    );
    assert!(
        String::from_utf8_lossy(&eval.stderr).contains("data: fetched 7 of 7 files ("),
        "{}",
        String::from_utf8_lossy(&eval.stderr)
    );
}

#[test]
fn an_obs_url_with_no_endpoint_is_refused_before_any_request() {
    let scratch = tempfile::tempdir().expect("a temporary folder");
    let mut command = tandem_at("unused");
    command
        .env_remove("AWS_ENDPOINT_URL")
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env("OBS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("OBS_SECRET_ACCESS_KEY", SECRET_KEY)
        .args(with_cache(
            &synthetic_run(Path::new("obs://runs/no-endpoint"), 64),
            &scratch.path().join("cache"),
        ));
    let started = Instant::now();
    let output = run_bounded(&mut command, JOB_LIMIT);
    let stderr = expect_failure(&output);
    assert_contains(
        &stderr,
        "obs://runs/no-endpoint/snapshot.safetensors: no endpoint is set, and Amazon S3 (the \
             default) does not serve obs:// buckets: set OBS_ENDPOINT or --s3-endpoint to the \
             OBS endpoint of the bucket's region, e.g. https://obs.cn-north-4.myhuaweicloud.com",
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "nothing was retried"
    );
}
