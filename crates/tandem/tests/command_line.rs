//! The command line of `tandem train` through the real binary, as a user of argparse and
//! torchrun meets it: a repeated flag, negative numbers, switches, `--help` in groups, the
//! banner, a `--config` file written the wrong way, and the messages of errors.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

/// A one-epoch synthetic run of the small model into `out`, with `extra` flags after it.
fn run_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = with_flag(synthetic_run(out, 96), "--epochs", "1");
    args.extend(extra.iter().map(|arg| arg.to_string()));
    args
}

/// Runs `tandem args`, expecting it to fail with `code`; returns its standard error.
fn refused(args: &[String], code: i32) -> String {
    let output = run_bounded(tandem().args(args), LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert_eq!(output.status.code(), Some(code), "{stderr}");
    stderr
}

#[test]
fn a_repeated_flag_takes_its_last_value_as_argparse_does() {
    let (_dir, out) = run_folder();
    // A wrapper's flags first, the user's after them.
    let mut args = with_flag(synthetic_run(&out, 96), "--epochs", "3");
    args.extend(
        [
            "--epochs",
            "1",
            "--n-blocks",
            "2,1,1",
            "--no-augment",
            "--no-augment",
        ]
        .map(String::from),
    );
    let stdout = tandem_succeeds(&args, LIMIT);
    assert!(
        stdout.contains("model: resnet-base (blocks 2,1,1, channels 8,16,32,"),
        "{stdout}"
    );
    assert_contains(&stdout, " | 1 epoch\n");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1, "{metrics}");
    let config: toml::Table =
        toml::from_str(&std::fs::read_to_string(out.join("config.toml")).unwrap()).unwrap();
    assert_eq!(config["epochs"].as_integer(), Some(1));
    assert_eq!(config["no-augment"].as_bool(), Some(true));
    assert_eq!(config["model"]["n-blocks"].to_string(), "[2, 1, 1]");
}

#[test]
fn a_negative_number_reaches_the_check_that_names_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = refused(&run_args(&dir.path().join("run"), &["--lr", "-1"]), 2);
    assert!(
        stderr.ends_with("error: --lr must be a positive number, got -1\n"),
        "{stderr}"
    );
}

#[test]
fn help_groups_the_flags_and_switches_take_no_value() {
    let output = run_bounded(tandem().args(["train", "--help"]), LIMIT);
    let help = expect_success(&output);
    assert!(!help.contains("possible values: true, false"), "{help}");
    assert!(!help.contains("[<"), "{help}");
    let mut sections: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            sections.push((line.trim_end_matches(':').to_string(), String::new()));
        } else if let Some((_, text)) = sections.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    let headings: Vec<&str> = sections.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        headings,
        [
            "Options",
            "Model",
            "Data",
            "Optimization",
            "Schedule",
            "Outputs",
            "Data parallelism",
            "Devices",
            "Object storage"
        ],
        "{help}"
    );
    let section = |name: &str| {
        sections
            .iter()
            .find(|(heading, _)| heading == name)
            .map(|(_, text)| text.clone())
            .unwrap()
    };
    for (heading, flags) in [
        (
            "Model",
            &["--model <MODEL>", "--n-blocks", "--init-from"][..],
        ),
        (
            "Data",
            &["--data-dir", "--mean", "--download\n", "--no-augment\n"],
        ),
        (
            "Optimization",
            &["--lr <LR>", "--optimizer", "--scale-lr\n", "--nesterov\n"],
        ),
        (
            "Schedule",
            &[
                "--epochs",
                "--lr-schedule",
                "--warmup-epochs",
                "--max-steps",
            ],
        ),
        (
            "Outputs",
            &["--output-dir", "--snapshot <", "--fresh\n", "--keep-last"],
        ),
        (
            "Data parallelism",
            &["--world-size", "--sync-bn\n", "--bucket-mb", "--backend"],
        ),
        ("Devices", &["--device", "--precision", "--threads"]),
        (
            "Object storage",
            &["--s3-endpoint", "--s3-path-style\n", "--cache-dir"],
        ),
    ] {
        let text = section(heading);
        for flag in flags {
            assert!(
                text.contains(flag),
                "{flag} is not under {heading}:\n{text}"
            );
        }
    }
}

#[test]
fn the_banner_names_the_optimizer_the_learning_rate_and_the_initial_weights() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    tandem_succeeds(run_args(&first, &[]), LIMIT);
    let weights = first.join("epoch_1.safetensors");
    let second = dir.path().join("second");
    let mut worker = run_args(
        &second,
        &["--scale-lr", "--init-from", &weights.display().to_string()],
    );
    worker = with_flag(worker, "--epochs", "0");
    let mut args: Vec<String> = ["launch", "--standalone", "--nproc-per-node", "2", "--"]
        .map(String::from)
        .to_vec();
    args.extend(worker);
    let output = run_bounded(tandem().env_remove("TANDEM_JOB_TOKEN").args(&args), LIMIT);
    let stdout = expect_success(&output);
    for expected in [
        "[rank 0] global batch 64 (32 per process x 2 processes x 1 accumulated) | 0 epochs\n"
            .to_string(),
        "[rank 0] optimizer: sgd (momentum 0.9) | lr 0.1 (--lr 0.05 x 2 processes, --scale-lr) \
         | schedule: constant\n"
            .to_string(),
        format!(
            "[rank 0] output: {} | fresh, from the weights of {} (epoch 1, step 3)\n",
            second.display(),
            weights.display()
        ),
    ] {
        assert!(stdout.contains(&expected), "no '{expected}' in:\n{stdout}");
    }
}

#[test]
fn joining_by_hand_without_a_token_says_how_to_make_one() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let init_method = format!("tcp://127.0.0.1:{port}");
    let args = run_args(
        &dir.path().join("run"),
        &[
            "--init-method",
            &init_method,
            "--rank",
            "0",
            "--world-size",
            "2",
        ],
    );
    let output = run_bounded(tandem().env_remove("TANDEM_JOB_TOKEN").args(&args), LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.ends_with(
            "error: a job of several processes needs TANDEM_JOB_TOKEN, the same secret on every \
             rank (tandem launch makes one itself): make one with `export \
             TANDEM_JOB_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')` and start \
             every rank with it\n"
        ),
        "{stderr}"
    );
}

#[test]
fn a_flat_table_key_in_the_config_file_is_shown_in_its_table() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    std::fs::write(&config, "epochs = 1\ndata = \"synthetic\"\n").unwrap();
    let stderr = refused(
        &[
            "train".to_string(),
            "--config".to_string(),
            config.display().to_string(),
        ],
        2,
    );
    assert!(
        stderr.ends_with(&format!(
            "error: config file {} is not valid: `data = \"synthetic\"` is a setting of the \
             [data] table; write it there:\n[data]\ndata = \"synthetic\"\n",
            config.display()
        )),
        "{stderr}"
    );
}

#[test]
fn config_toml_holds_the_values_as_given() {
    let (_dir, out) = run_folder();
    let args = with_flag(
        run_args(
            &out,
            &["--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225"],
        ),
        "--epochs",
        "0",
    );
    tandem_succeeds(&args, LIMIT);
    let text = std::fs::read_to_string(out.join("config.toml")).unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap();
    let expected = [
        ("mean", "[0.485, 0.456, 0.406]"),
        ("std", "[0.229, 0.224, 0.225]"),
    ];
    for (key, values) in expected {
        assert_eq!(config["data"][key].to_string(), values, "{text}");
    }
}

#[test]
fn errors_name_the_flags_value_and_say_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-cifar");
    let stderr = refused(
        &run_args(
            &dir.path().join("run"),
            &[
                "--data",
                "cifar10-bin",
                "--data-dir",
                &missing.display().to_string(),
            ],
        ),
        1,
    );
    assert!(
        stderr.contains(&format!(
            "error: cannot load the train split of --data cifar10-bin: {}: no CIFAR-10 binary data",
            missing.display()
        )) && !stderr.contains("Cifar10Bin"),
        "{stderr}"
    );

    let out = dir.path().join("weights");
    tandem_succeeds(run_args(&out, &[]), LIMIT);
    let image = dir.path().join("nope.png");
    let output = run_bounded(
        tandem().args([
            "predict",
            "--checkpoint",
            &out.join("epoch_1.safetensors").display().to_string(),
            &image.display().to_string(),
        ]),
        LIMIT,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.ends_with(&format!(
            "error: {}: No such file or directory (os error 2)\n",
            image.display()
        )),
        "{stderr}"
    );
}

#[test]
fn the_banner_names_the_epochs_of_the_tutorials_torch_save_snapshot() {
    tandem_testdata::skip_without_shared!();
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = tandem_testdata::shared_dir().join("golden/pytorch-checkpoints");
    for (file, when) in [
        ("snapshot.pt", "epoch 7"),
        ("epoch_3.pth", "the file records no epoch or step"),
    ] {
        let out = dir.path().join(file);
        let weights = checkpoints.join(file);
        let args = [
            "train",
            "--init-from",
            &weights.display().to_string(),
            "--epochs",
            "0",
            "--synthetic-train",
            "64",
            "--synthetic-test",
            "32",
            "--output-dir",
            &out.display().to_string(),
        ];
        let stdout = tandem_succeeds(args, LIMIT);
        let expected = format!(
            "output: {} | fresh, from the weights of {} ({when})\n",
            out.display(),
            weights.display()
        );
        assert!(stdout.contains(&expected), "no '{expected}' in:\n{stdout}");
    }
}
