//! Self-describing checkpoints, through the real binary: what `epoch_N.safetensors` and the
//! snapshot say about themselves, and `eval` and `predict` using it.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

/// The normalization of the tiny real-data run.
const MEAN: &str = "0.49,0.48,0.45";
const STD: &str = "0.25,0.24,0.26";

/// The real-data subset: 1,000 training and 200 test PNGs of CIFAR-10.
fn json_subset() -> PathBuf {
    tandem_testdata::shared_dir().join("data/cifar10/json-subset")
}

/// Trains the small model for one epoch on the json-folder subset (well under a second),
/// into `run` in a new folder; returns the folder and the run's.
fn train_tiny_real_run() -> (tempfile::TempDir, PathBuf) {
    let (dir, out) = run_folder();
    let mut args = small_model_train(&format!(
        "--data json-folder --mean {MEAN} --std {STD} --epochs 1 --batch-size 64 \
         --optimizer sgd --momentum 0.9 --lr 0.05 --threads 1"
    ));
    args.extend(["--data-dir".into(), json_subset().display().to_string()]);
    args.extend(["--output-dir".into(), out.display().to_string()]);
    tandem_succeeds(&args, LIMIT);
    (dir, out)
}

/// The `__metadata__` strings of a safetensors file.
fn metadata(path: &Path) -> BTreeMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect()
}

/// Runs tandem with `args`, expecting failure; returns stderr.
fn refused(args: &[String]) -> String {
    expect_failure(&run_bounded(tandem().args(args), LIMIT))
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|arg| arg.to_string()).collect()
}

/// `args`, then `flags` split at white space.
fn words(args: &[&str], flags: &str) -> Vec<String> {
    let mut words = strings(args);
    words.extend(flags.split_whitespace().map(String::from));
    words
}

fn test_images(count: usize) -> Vec<String> {
    (0..count)
        .map(|index| {
            json_subset()
                .join(format!("test_cifar10/test_{index:05}.png"))
                .display()
                .to_string()
        })
        .collect()
}

/// The `metrics.jsonl` line less `epoch_seconds` and `images_per_second`, which a
/// checkpoint leaves out so that a resumed run writes the same bytes.
fn without_timings(line: &str) -> serde_json::Value {
    let mut record: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(line.trim()).unwrap();
    assert!(record.remove("epoch_seconds").is_some());
    assert!(record.remove("images_per_second").is_some());
    serde_json::Value::Object(record)
}

/// Removes `tandem.metrics` from `metadata` and checks it against the `metrics.jsonl` line.
fn take_metrics_matching(metadata: &mut BTreeMap<String, String>, line: &str) {
    let metrics = metadata.remove("tandem.metrics").expect("tandem.metrics");
    let metrics: serde_json::Value = serde_json::from_str(&metrics).unwrap();
    assert_eq!(metrics, without_timings(line));
}

#[test]
fn epoch_checkpoint_and_snapshot_describe_themselves() {
    tandem_testdata::skip_without_shared!();
    let (_dir, out) = train_tiny_real_run();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let class_names =
        r#"["airplane","automobile","bird","cat","deer","dog","frog","horse","ship","truck"]"#;
    let expected = BTreeMap::from(
        [
            ("format", "pt"),
            ("epoch", "1"),
            ("tandem.version", env!("CARGO_PKG_VERSION")),
            ("tandem.model", "resnet-base"),
            ("tandem.n-blocks", "1,1,1"),
            ("tandem.n-channels", "8,16,32"),
            ("tandem.bottlenecks", "none"),
            ("tandem.first-kernel-size", "3"),
            ("tandem.num-classes", "10"),
            ("tandem.class-names", class_names),
            ("tandem.mean", MEAN),
            ("tandem.std", STD),
            ("tandem.data", "json-folder"),
            ("tandem.data-dir", &json_subset().display().to_string()),
            // 1,000 images in batches of 64.
            ("tandem.step", "16"),
        ]
        .map(|(key, value)| (key.to_string(), value.to_string())),
    );
    let mut epoch = metadata(&out.join("epoch_1.safetensors"));
    take_metrics_matching(&mut epoch, &metrics);
    assert_eq!(epoch, expected);
    let mut snapshot = metadata(&out.join("snapshot.safetensors"));
    take_metrics_matching(&mut snapshot, &metrics);
    assert!(snapshot.remove("tandem.snapshot").is_some());
    let checksum = snapshot.remove("tandem.checksum").unwrap_or_default();
    assert_eq!(checksum.len(), 16, "the snapshot's checksum: {checksum:?}");
    assert_eq!(snapshot, expected);
    // The tensors keep their PyTorch state_dict names.
    let tensors = read_tensors(&out.join("epoch_1.safetensors"));
    assert!(tensors.contains_key("0.blocks.2.shortcut.bn.running_var"));
    assert_eq!(tensors["1.weight"].len(), 10 * 32);
}

#[test]
fn eval_with_only_the_checkpoint_uses_its_data_and_normalization() {
    tandem_testdata::skip_without_shared!();
    let (_dir, out) = train_tiny_real_run();
    let checkpoint = out.join("epoch_1.safetensors").display().to_string();
    let alone = strings(&["eval", "--checkpoint", &checkpoint, "--json"]);
    let report = tandem_succeeds(&alone, LIMIT);
    let mut explicit = alone.clone();
    explicit.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    explicit.extend(strings(&[
        "--data",
        "json-folder",
        "--data-dir",
        &json_subset().display().to_string(),
        "--mean",
        MEAN,
        "--std",
        STD,
    ]));
    let explicit_report = tandem_succeeds(&explicit, LIMIT);
    assert_eq!(report, explicit_report);
    let parsed: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(parsed["samples"].as_u64(), Some(200));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(metrics.trim()).unwrap();
    assert_eq!(parsed["accuracy"], record["val_accuracy"]);
    // The text report names the classes.
    let text = tandem_succeeds(["eval", "--checkpoint", &checkpoint], LIMIT);
    assert_contains(&text, "    automobile: ");
    // ... and the confusion matrix's columns, as its rows.
    let classes: Vec<&str> = "airplane automobile bird cat deer dog frog horse ship truck"
        .split(' ')
        .collect();
    let mut matrix = text
        .lines()
        .skip_while(|line| !line.starts_with("confusion matrix"))
        .skip(1);
    let header: Vec<&str> = matrix.next().unwrap().split_whitespace().collect();
    assert_eq!(header, classes, "{text}");
    let rows: Vec<&str> = matrix
        .map(|line| line.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(rows, classes, "{text}");
    // The JSON report names each class beside its figures.
    let per_class = parsed["per_class"].as_array().unwrap();
    let names: Vec<&str> = per_class
        .iter()
        .map(|class| class["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, classes);
    for (index, class) in per_class.iter().enumerate() {
        assert_eq!(class["class"], index);
        assert_eq!(class["accuracy"], parsed["per_class_accuracy"][index]);
        let row_sum: u64 = parsed["confusion"][index]
            .as_array()
            .unwrap()
            .iter()
            .map(|count| count.as_u64().unwrap())
            .sum();
        assert_eq!(class["samples"], row_sum);
    }

    // The snapshot is loaded as the weights it holds: the same evaluation.
    let snapshot = out.join("snapshot.safetensors").display().to_string();
    let from_snapshot = tandem_succeeds(["eval", "--checkpoint", &snapshot, "--json"], LIMIT);
    assert_eq!(from_snapshot, report);
}

#[test]
fn flags_that_contradict_the_checkpoint_are_named() {
    tandem_testdata::skip_without_shared!();
    let (dir, out) = train_tiny_real_run();
    let checkpoint = out.join("epoch_1.safetensors").display().to_string();
    let small_model_flags =
        "--model resnet-base --n-blocks 1,1,1 --n-channels 8,16,32 --bottlenecks none --first-kernel-size 3 --num-classes 10";

    let eval = ["eval", "--checkpoint", &checkpoint];
    let stderr = refused(&words(&eval, "--n-blocks 2,2,2"));
    assert_contains(&stderr, &format!(
            "--n-blocks 2,2,2 contradicts {checkpoint}, which holds the model `{small_model_flags}` (from its metadata)"
        ));

    let stderr = refused(&words(&eval, "--data synthetic"));
    assert_contains(
        &stderr,
        &format!("--data synthetic contradicts {checkpoint}, which was trained on json-folder"),
    );

    let normalization = "--mean 0.5,0.5,0.5 --std 0.5,0.5,0.5";
    let output = run_bounded(tandem().args(words(&eval, normalization)), LIMIT);
    expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_contains(&stderr, &format!(
            "warning: --mean 0.5,0.5,0.5 --std 0.5,0.5,0.5 differ from what the checkpoint was trained with (--mean {MEAN} --std {STD})"
        ));

    // An epoch checkpoint given to another model says what it holds and how to load it.
    let other = dir.path().join("other").display().to_string();
    let stderr = refused(&strings(&[
        "train",
        "--init-from",
        &checkpoint,
        "--output-dir",
        &other,
    ]));
    assert_contains(&stderr, &format!(
            "{checkpoint} holds the model `{small_model_flags}` (from its metadata), not the model built here \
             (`--model resnet-base --n-blocks 6,6,6 --n-channels 16,32,64 --bottlenecks 8,16,16 --first-kernel-size 3 --num-classes 10`)"
        ));
    assert_contains(&stderr, &format!("load it with: {small_model_flags}"));
}

#[test]
fn predict_prints_class_names() {
    tandem_testdata::skip_without_shared!();
    let (_dir, out) = train_tiny_real_run();
    let checkpoint = out.join("epoch_1.safetensors").display().to_string();
    let mut args = strings(&["predict", "--checkpoint", &checkpoint, "--top", "10"]);
    args.extend(test_images(2));
    let text = tandem_succeeds(&args, LIMIT);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    for line in lines {
        // All ten classes, each by name.
        for name in ["airplane", "automobile", "truck", "ship", "cat"] {
            assert!(line.contains(&format!(" {name} (")), "{line}");
        }
    }
    args.push("--json".into());
    let json = tandem_succeeds(&args, LIMIT);
    let names = tandem_data::CIFAR10_CLASS_NAMES;
    for line in json.lines() {
        let prediction: serde_json::Value = serde_json::from_str(line).unwrap();
        for entry in prediction["top"].as_array().unwrap() {
            let class = entry["class"].as_u64().unwrap() as usize;
            assert_eq!(entry["name"].as_str(), Some(names[class]));
        }
    }
}

#[test]
fn a_file_without_metadata_loads_with_flags_and_a_wrong_model_is_explained() {
    tandem_testdata::skip_without_shared!();
    let (dir, out) = train_tiny_real_run();
    // What an older Tandem file, or PyTorch's `save_file(model.state_dict())`, holds: the
    // same tensors under the same names, without the description.
    let bare = dir.path().join("bare.safetensors");
    let bytes = std::fs::read(out.join("epoch_1.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    safetensors::serialize_to_file(file.tensors(), None, &bare).unwrap();
    let bare = bare.display().to_string();
    let checkpoint = out.join("epoch_1.safetensors").display().to_string();
    let mut with_flags = strings(&["eval", "--json", "--checkpoint", &bare]);
    with_flags.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    with_flags.extend(words(
        &["--data-dir", &json_subset().display().to_string()],
        &format!("--data json-folder --mean {MEAN} --std {STD}"),
    ));
    let bare_report = tandem_succeeds(&with_flags, LIMIT);
    let described = tandem_succeeds(["eval", "--json", "--checkpoint", &checkpoint], LIMIT);
    assert_eq!(bare_report, described);

    // Without metadata the model comes from the flags; the wrong one is explained from the
    // tensors' names and shapes.
    let mut default_model = with_flags.clone();
    default_model.retain(|arg| !SMALL_MODEL.contains(&arg.as_str()));
    let stderr = refused(&default_model);
    assert_contains(&stderr, &format!(
            "{bare} holds the model `--model resnet-base --n-blocks 1,1,1 --n-channels 8,16,32 --bottlenecks none --first-kernel-size 3 --num-classes 10` (told from its tensors)"
        ));

    // PyTorch's own torch.save file of the tutorial's model, with `module.` keys.
    let pytorch = tandem_testdata::shared_dir()
        .join("golden/pytorch-checkpoints/epoch_3.pth")
        .display()
        .to_string();
    let mut args = strings(&["predict", "--checkpoint", &pytorch]);
    args.extend(test_images(1));
    let text = tandem_succeeds(&args, LIMIT);
    // No class names in the file: classes by number.
    assert!(
        text.trim_end()
            .split(": ")
            .nth(1)
            .is_some_and(|top| top.starts_with(|c: char| c.is_ascii_digit())),
        "{text}"
    );
    let mut wrong = strings(&["predict", "--checkpoint", &pytorch]);
    wrong.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    wrong.extend(test_images(1));
    let stderr = refused(&wrong);
    assert!(
        stderr.contains(
            "(told from its tensors), not the model built here (`--model resnet-base --n-blocks 1,1,1"
        ) && stderr.contains(
            "load it with: --model resnet-base --n-blocks 6,6,6 --n-channels 16,32,64 --bottlenecks 8,16,16 --first-kernel-size 3 --num-classes 10"
        ),
        "{stderr}"
    );
}

#[test]
fn a_snapshot_gives_its_weights_to_init_from() {
    tandem_testdata::skip_without_shared!();
    let (dir, out) = train_tiny_real_run();
    // One step from the snapshot's weights and one from the epoch checkpoint's (the same
    // weights) end in the same parameters.
    let params_after_one_step_from = |file: &str| {
        let run = dir.path().join(format!("from-{file}"));
        let mut args = with_flag(synthetic_run(&run, 64), "--epochs", "1");
        let init = out.join(file).display().to_string();
        args.extend(strings(&["--init-from", &init, "--max-steps", "1"]));
        tandem_succeeds(&args, LIMIT);
        read_tensors(&run.join("snapshot.safetensors"))["params"].clone()
    };
    let from_snapshot = params_after_one_step_from("snapshot.safetensors");
    let from_epoch = params_after_one_step_from("epoch_1.safetensors");
    assert_eq!(from_snapshot, from_epoch);
}
