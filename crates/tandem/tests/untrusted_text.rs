//! Text tandem did not write (class names from `batches.meta` or a checkpoint's metadata,
//! image file names, metadata values) reaches the terminal escaped and bounded: no escape
//! sequence, no line break of its own, at most 200 characters of a name. JSON output keeps
//! the exact text.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

/// An OSC sequence that sets the terminal's title, ended by BEL.
const TITLE: &str = "\u{1b}]0;pwned\u{7}";
/// [`TITLE`] as tandem prints it.
const TITLE_SHOWN: &str = "\\x1b]0;pwned\\x07";
/// How many characters of a name are printed.
const NAME_LIMIT: usize = 200;

/// Ten class names: an escape sequence, a line break, a name of `long` characters.
fn hostile_class_names(long: usize) -> Vec<String> {
    let mut names = vec![
        format!("{TITLE}cat"),
        "two\nerror: lines".to_string(),
        "x".repeat(long),
    ];
    names.extend(["deer", "dog", "frog", "horse", "ship", "truck", "plane"].map(String::from));
    names
}

/// Fails unless `bytes` is text with no character a terminal acts on but the line ends.
fn assert_printable(what: &str, bytes: &[u8]) {
    let text = std::str::from_utf8(bytes).unwrap_or_else(|_| panic!("{what}: not UTF-8"));
    let acted_on: Vec<char> = text
        .chars()
        .filter(|&character| character != '\n' && character.is_control())
        .collect();
    assert!(
        acted_on.is_empty(),
        "{what} holds control characters {acted_on:?}: {}",
        excerpt(text)
    );
}

/// The start of `text`, for a failure's message (today's build prints megabytes).
fn excerpt(text: &str) -> String {
    text.chars().take(3000).collect()
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs `tandem args` within `LIMIT`, its output into files (it may be megabytes, more
/// than a pipe holds), and returns it.
fn run(dir: &Path, args: &[&str]) -> Output {
    let stdout_path = dir.join("stdout.txt");
    let stderr_path = dir.join("stderr.txt");
    let child = tandem()
        .args(args)
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut output = wait_bounded(child, LIMIT);
    output.stdout = std::fs::read(&stdout_path).unwrap();
    output.stderr = std::fs::read(&stderr_path).unwrap();
    output
}

/// Asserts success and returns standard output, showing the start of both streams if not.
fn succeeded(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "tandem failed with {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        excerpt(&stdout),
        excerpt(&stderr_of(output))
    );
    stdout
}

/// The checkpoint of a one-epoch synthetic run in `dir/run`.
fn trained_checkpoint(dir: &Path) -> PathBuf {
    let out = dir.join("run");
    let run = with_flag(synthetic_run(&out, 96), "--epochs", "1");
    tandem_succeeds(run, LIMIT);
    out.join("epoch_1.safetensors")
}

/// A copy of `trained` as `dir/name`, its metadata entry `key` set to `value`.
fn with_metadata(trained: &Path, dir: &Path, name: &str, key: &str, value: &str) -> PathBuf {
    let mut metadata = tandem_models::read_safetensors_metadata(trained).unwrap();
    assert!(metadata.contains_key(key), "{key} is not in {metadata:?}");
    metadata.insert(key.to_string(), value.to_string());
    let bytes = std::fs::read(trained).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let edited = tandem_models::serialize_safetensors(tensors.tensors(), &metadata).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, edited).unwrap();
    path
}

/// A black 32x32 PNG at `path`.
fn write_png(path: &Path) {
    image::RgbImage::new(32, 32).save(path).unwrap();
}

/// Fails unless eval succeeded with a printable report of bounded size, as many lines as the
/// `plain` report of plainly named classes, showing the hostile names (the longest of `long`
/// characters).
fn assert_report_shows_the_names(output: &Output, plain: &str, long: usize) {
    let stdout = succeeded(output);
    assert_printable("eval's report", &output.stdout);
    assert!(
        stdout.len() < REPORT_BOUND,
        "eval printed {} bytes",
        stdout.len()
    );
    assert_eq!(
        stdout.lines().count(),
        plain.lines().count(),
        "{}",
        excerpt(&stdout)
    );
    assert_shows_the_names(&stdout, long, ": ");
}

/// Fails unless `stdout` shows each of [`hostile_class_names`]`(long)` escaped and cut,
/// followed by `after`.
fn assert_shows_the_names(stdout: &str, long: usize, after: &str) {
    let long_shown = format!("{}… ({long} characters in all)", "x".repeat(NAME_LIMIT));
    for shown in [
        format!("{TITLE_SHOWN}cat{after}"),
        format!("two\\nerror: lines{after}"),
        format!("{long_shown}{after}"),
    ] {
        assert!(
            stdout.contains(&shown),
            "{shown} is not in {}",
            excerpt(stdout)
        );
    }
}

/// The most bytes `eval`'s report of ten classes may take with names cut at 200 characters
/// (a confusion matrix may be as wide as its labels), where megabytes printed the names
/// whole.
const REPORT_BOUND: usize = 100_000;

#[test]
fn eval_and_predict_print_a_checkpoints_class_names_escaped_and_json_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let names = hostile_class_names(3_000_000);
    let trained = trained_checkpoint(dir.path());
    let named = |file: &str, names: &[String]| {
        let names = serde_json::to_string(names).unwrap();
        with_metadata(&trained, dir.path(), file, "tandem.class-names", &names)
    };
    let checkpoint = named("hostile.safetensors", &names);
    let checkpoint_arg = checkpoint.display().to_string();
    let eval = |checkpoint: &str| {
        run(
            dir.path(),
            &["eval", "--checkpoint", checkpoint, "--threads", "1"],
        )
    };
    let plain_names: Vec<String> = (0..10).map(|class| format!("class{class}")).collect();
    let plain = succeeded(&eval(
        named("plain.safetensors", &plain_names).to_str().unwrap(),
    ));

    // A line break in a name makes no line of its own.
    assert_report_shows_the_names(&eval(&checkpoint_arg), &plain, 3_000_000);

    let image = dir.path().join(format!("{TITLE}photo.png"));
    write_png(&image);
    let predict = |extra: &[&str]| {
        let mut args = vec!["predict", "--checkpoint", &checkpoint_arg, "--top", "10"];
        args.extend(extra);
        args.push(image.to_str().unwrap());
        run(dir.path(), &args)
    };
    let output = predict(&[]);
    let stdout = succeeded(&output);
    assert_printable("predict's output", &output.stdout);
    assert_eq!(stdout.lines().count(), 1, "{}", excerpt(&stdout));
    let file_shown = format!("{}/{TITLE_SHOWN}photo.png: ", dir.path().display());
    assert!(stdout.starts_with(&file_shown), "{}", excerpt(&stdout));
    assert_shows_the_names(&stdout, 3_000_000, " (");
    assert!(
        stdout.len() < 2_000,
        "predict printed {} bytes",
        stdout.len()
    );

    // JSON carries the exact text, escaped as JSON escapes it.
    let output = predict(&["--json"]);
    let stdout = succeeded(&output);
    assert_printable("predict's JSON", &output.stdout);
    let prediction: serde_json::Value = serde_json::from_str(stdout.trim_end()).unwrap();
    assert_eq!(prediction["file"], image.to_str().unwrap());
    let mut listed: Vec<String> = prediction["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["name"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    let mut expected = names.clone();
    expected.sort();
    assert!(listed == expected, "the names in the JSON differ");
}

/// A `batches.meta` pickle (protocol 2) whose `label_names` are `names`.
fn batches_meta(names: &[String]) -> Vec<u8> {
    let mut pickle = vec![0x80, 2, b'}', b'U', 11];
    pickle.extend_from_slice(b"label_names");
    pickle.extend([b']', b'(']);
    for name in names {
        pickle.push(b'X');
        pickle.extend_from_slice(&(name.len() as u32).to_le_bytes());
        pickle.extend_from_slice(name.as_bytes());
    }
    pickle.extend([b'e', b's', b'.']);
    pickle
}

/// A CIFAR-10 python `test_batch` of `rows` images (protocol 2, `data` a numpy uint8 array
/// `[rows, 3072]`, as the originals are).
fn test_batch(rows: usize) -> Vec<u8> {
    let mut pickle = vec![0x80, 2, b'}', b'(', b'U', 6];
    pickle.extend_from_slice(b"labels");
    pickle.extend([b']', b'(']);
    for row in 0..rows {
        pickle.extend([b'K', (row % 10) as u8]);
    }
    pickle.extend([b'e', b'U', 4]);
    pickle.extend_from_slice(b"data");
    pickle.extend_from_slice(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n");
    pickle.extend_from_slice(b"K\x00\x85U\x01b\x87R(K\x01M");
    pickle.extend_from_slice(&(rows as u16).to_le_bytes());
    pickle.extend_from_slice(b"M\x00\x0c\x86cnumpy\ndtype\nU\x02u1K\x00K\x01\x87R");
    pickle.extend_from_slice(b"(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T");
    let pixels: Vec<u8> = (0..rows * 3072)
        .map(|index| (index * 7 % 256) as u8)
        .collect();
    pickle.extend_from_slice(&(pixels.len() as u32).to_le_bytes());
    pickle.extend_from_slice(&pixels);
    pickle.extend([b't', b'b', b'u', b'.']);
    pickle
}

/// The small model's weights, without Tandem metadata (no class names of their own).
fn plain_weights(dir: &Path) -> PathBuf {
    let path = dir.join("weights.safetensors");
    tandem_models::save_safetensors(&small_model(), &path, &BTreeMap::new()).unwrap();
    path
}

/// `tandem eval` of [`plain_weights`] on `data` in `data_dir`, in the files of `dir`.
fn eval_plain_weights(dir: &Path, data: &str, data_dir: &Path) -> Output {
    let weights = plain_weights(dir);
    let mut args: Vec<&str> = vec!["eval"];
    args.extend(SMALL_MODEL);
    args.extend([
        "--checkpoint",
        weights.to_str().unwrap(),
        "--data",
        data,
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--threads",
        "1",
    ]);
    run(dir, &args)
}

#[test]
fn eval_prints_the_class_names_of_batches_meta_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cifar-py");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("test_batch"), test_batch(20)).unwrap();
    // Without batches.meta, the data set's names are CIFAR-10's.
    let plain = succeeded(&eval_plain_weights(dir.path(), "cifar10-py", &data));
    assert_contains(&plain, "samples: 20\n");
    // batches.meta may hold 64 KiB: a name of 60,000 characters fits.
    let names = hostile_class_names(60_000);
    std::fs::write(data.join("batches.meta"), batches_meta(&names)).unwrap();
    let output = eval_plain_weights(dir.path(), "cifar10-py", &data);
    assert_report_shows_the_names(&output, &plain, 60_000);
}

/// Fails unless `output` failed with one line on standard error, printable, holding `shown`.
fn assert_one_printable_error(what: &str, output: &Output, shown: &str) {
    let stderr = stderr_of(output);
    assert!(!output.status.success(), "{what} succeeded: {stderr}");
    assert_printable(what, &output.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|line| !line.starts_with("device: "))
        .collect();
    assert_eq!(errors.len(), 1, "{what}: {stderr}");
    assert!(errors[0].starts_with("error: "), "{what}: {stderr}");
    assert!(
        errors[0].contains(shown),
        "{what}: {shown} is not in {stderr}"
    );
}

#[test]
fn errors_that_quote_hostile_names_are_escaped_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    // A metadata value of three megabytes behind an escape sequence.
    let value = format!("{TITLE}{}", "x".repeat(3_000_000));
    let trained = trained_checkpoint(dir.path());
    let checkpoint = with_metadata(
        &trained,
        dir.path(),
        "hostile.safetensors",
        "tandem.data",
        &value,
    );
    let output = run(
        dir.path(),
        &["eval", "--checkpoint", checkpoint.to_str().unwrap()],
    );
    let shown = format!(
        "its metadata tandem.data = '{TITLE_SHOWN}{}… (3000010 characters in all)' is not valid",
        "x".repeat(NAME_LIMIT - TITLE_SHOWN.len())
    );
    assert_one_printable_error("eval of a hostile checkpoint", &output, &shown);
    assert!(
        output.stderr.len() < 10_000,
        "{} bytes",
        output.stderr.len()
    );

    // An image whose name holds an escape sequence and a line break, which is no image.
    let image = dir
        .path()
        .join(format!("{TITLE}\nerror: everything is fine.png"));
    std::fs::write(&image, "not a PNG").unwrap();
    let output = run(
        dir.path(),
        &[
            "predict",
            "--checkpoint",
            trained.to_str().unwrap(),
            image.to_str().unwrap(),
        ],
    );
    let shown = format!(
        "{}/{TITLE_SHOWN}\\nerror: everything is fine.png",
        dir.path().display()
    );
    assert_one_printable_error("predict of a hostile file name", &output, &shown);

    // An annotation file naming an image that way.
    let data = dir.path().join("json");
    std::fs::create_dir_all(data.join("annotations")).unwrap();
    std::fs::create_dir_all(data.join("test_cifar10")).unwrap();
    write_png(&data.join("test_cifar10/0.png"));
    let annotation = serde_json::json!({
        "images": [format!("{TITLE}\nerror: fine.png")],
        "categories": [0],
    });
    std::fs::write(
        data.join("annotations/cifar10_test.json"),
        annotation.to_string(),
    )
    .unwrap();
    let output = eval_plain_weights(dir.path(), "json-folder", &data);
    assert_one_printable_error(
        "eval of a hostile annotation",
        &output,
        &format!("{TITLE_SHOWN}\\nerror: fine.png"),
    );
}
