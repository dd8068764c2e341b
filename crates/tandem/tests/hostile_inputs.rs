//! Hostile files given to `tandem eval` and `tandem train`: `torch.save` archives whose
//! tensors share or overstate one storage or whose end records declare millions of entries,
//! compressed pickle and archive "bombs", a giant PNG, empty CIFAR files, and temporary
//! files left by a killed writer. Each file is built
//! by the test; each run is a child process whose peak resident memory (`ru_maxrss` from
//! `wait4`) must stay within what a legitimate evaluation of the same model takes, plus a
//! margin smaller than any of the hostile payloads.
//!
//! On Linux a child's `ru_maxrss` is the larger of its own peak and its spawner's peak at
//! the time of the spawn (exec carries the old address space's high-water mark over), so it
//! never understates the child; the tests also check that this process's own peak stays
//! below the bound, so that it cannot hide a child's.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{small_model, synthetic_run, tandem, with_flag, SMALL_MODEL};
use tandem_models::TensorKind;

/// Peak memory a refused hostile file may add to a legitimate evaluation's: below each
/// payload (64 MiB and more), above the noise of a run.
const MARGIN_KIB: i64 = 32 * 1024;
/// Every child must finish within this.
const CHILD_LIMIT: Duration = Duration::from_secs(60);

/// A finished child: how it ended, what it printed, and its peak resident memory.
struct Measured {
    exit_code: Option<i32>,
    stdout: String,
    stderr: String,
    peak_kib: i64,
}

impl Measured {
    fn describe(&self) -> String {
        format!(
            "exit {:?}, peak {} KiB\nstdout:\n{}\nstderr:\n{}",
            self.exit_code, self.peak_kib, self.stdout, self.stderr
        )
    }

    /// Asserts the run failed with an error containing every one of `needles`.
    fn expect_refusal(&self, needles: &[&str]) {
        assert!(
            self.exit_code.is_some_and(|code| code != 0),
            "expected a refusal: {}",
            self.describe()
        );
        for needle in needles {
            assert!(
                self.stderr.contains(needle),
                "stderr lacks {needle:?}: {}",
                self.describe()
            );
        }
    }
}

/// This process's peak resident memory, from `/proc/self/status`.
fn own_peak_kib() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status")
}

/// Asserts a hostile run's peak is within the legitimate evaluation's plus [`MARGIN_KIB`],
/// and prints both.
fn assert_peak_within(what: &str, measured: &Measured, baseline: &Measured) {
    let bound = baseline.peak_kib + MARGIN_KIB;
    eprintln!(
        "{what}: peak {} KiB (legitimate eval {} KiB, this test process {} KiB)",
        measured.peak_kib,
        baseline.peak_kib,
        own_peak_kib()
    );
    assert!(
        own_peak_kib() < bound,
        "this test process's peak ({} KiB) would hide a child's above the bound {bound} KiB",
        own_peak_kib()
    );
    assert!(
        measured.peak_kib < bound,
        "{what}: peak {} KiB, more than the legitimate eval's {} KiB + {MARGIN_KIB} KiB",
        measured.peak_kib,
        baseline.peak_kib
    );
}

/// Runs `tandem args`, with output to files, and reaps it with `wait4` to read its peak
/// resident set size (never less than its own peak; see the module comment).
// The child is reaped by `wait4` (which also gives its resource usage), not `Child::wait`.
#[allow(clippy::zombie_processes)]
fn run_measured(args: &[String]) -> Measured {
    let logs = tempfile::tempdir().expect("temp dir");
    let stdout_path = logs.path().join("stdout");
    let stderr_path = logs.path().join("stderr");
    let child = tandem()
        .args(args)
        .stdout(File::create(&stdout_path).expect("stdout file"))
        .stderr(File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .expect("cannot start tandem");
    let pid = child.id() as libc::pid_t;
    let deadline = Instant::now() + CHILD_LIMIT;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our own unreaped child; `status` and `usage` are valid for writes.
        let reaped = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(
            reaped >= 0,
            "wait4 failed: {}",
            std::io::Error::last_os_error()
        );
        if reaped == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: `pid` is our own unreaped child, so the signal cannot reach another process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above; blocks until the killed child is reaped.
            unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
            panic!(
                "tandem {args:?} took longer than {CHILD_LIMIT:?}\nstderr:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let exit_code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Measured {
        exit_code,
        stdout: std::fs::read_to_string(&stdout_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&stderr_path).unwrap_or_default(),
        peak_kib: usage.ru_maxrss,
    }
}

/// A CIFAR-10 binary folder whose test batch holds `records` records (and whose training
/// batches hold one each).
fn cifar_bin_folder(dir: &Path, records: usize) -> PathBuf {
    let folder = dir.join("cifar-bin");
    std::fs::create_dir_all(&folder).expect("data folder");
    let record = |index: usize| {
        let mut bytes = vec![(index % 10) as u8];
        bytes.extend((0..3072).map(|pixel| ((pixel * 7 + index * 13) % 256) as u8));
        bytes
    };
    let test: Vec<u8> = (0..records).flat_map(record).collect();
    std::fs::write(folder.join("test_batch.bin"), test).expect("test batch");
    for batch in 1..=5 {
        std::fs::write(
            folder.join(format!("data_batch_{batch}.bin")),
            record(batch),
        )
        .expect("train batch");
    }
    folder
}

/// `tandem eval` of the small model on CIFAR-10 binary data in `data_dir`.
fn eval_args(checkpoint: &Path, data: &str, data_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = vec!["eval".into()];
    args.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    args.extend(
        [
            "--checkpoint",
            &checkpoint.display().to_string(),
            "--data",
            data,
            "--data-dir",
            &data_dir.display().to_string(),
            "--threads",
            "1",
            "--json",
        ]
        .iter()
        .map(|arg| arg.to_string()),
    );
    args
}

/// A new folder holding the small model's weights (`weights.safetensors`) and 16 CIFAR
/// records, with what a legitimate evaluation of them measured (its peak memory and JSON
/// report) and the records' folder.
fn legitimate_eval() -> (tempfile::TempDir, Measured, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = small_model();
    let weights = dir.path().join("weights.safetensors");
    tandem_models::save_safetensors(&model, &weights, &Default::default()).expect("save");
    let data = cifar_bin_folder(dir.path(), 16);
    let measured = run_measured(&eval_args(&weights, "cifar10-bin", &data));
    assert_eq!(measured.exit_code, Some(0), "{}", measured.describe());
    (dir, measured, data)
}

/// Pickle opcodes for the few values a state dict needs (protocol 2).
struct PickleWriter(Vec<u8>);

impl PickleWriter {
    fn new() -> Self {
        PickleWriter(vec![0x80, 2])
    }

    fn text(&mut self, text: &str) {
        self.0.push(b'X');
        self.0.extend((text.len() as u32).to_le_bytes());
        self.0.extend(text.as_bytes());
    }

    fn int(&mut self, value: usize) {
        self.0.push(b'J');
        self.0.extend((value as i32).to_le_bytes());
    }

    fn int_tuple(&mut self, values: &[usize]) {
        self.0.push(b'(');
        for &value in values {
            self.int(value);
        }
        self.0.push(b't');
    }

    fn global(&mut self, module: &str, name: &str) {
        self.0.extend(format!("c{module}\n{name}\n").as_bytes());
    }
}

/// One tensor of a hand-built `torch.save` file: a view of `len` elements from `offset`
/// of storage `key` (which holds `storage_len` elements).
struct TensorEntry {
    name: String,
    shape: Vec<usize>,
    key: String,
    offset: usize,
    storage_len: usize,
    long: bool,
}

impl TensorEntry {
    /// Tensor `info` of the model as a view from the start of storage `key` of
    /// `storage_len` elements (`LongStorage` for a batch count, else `FloatStorage`).
    fn of(info: &tandem_models::TensorInfo, key: &str, storage_len: usize) -> TensorEntry {
        TensorEntry {
            name: info.name.clone(),
            shape: info.shape.clone(),
            key: key.into(),
            offset: 0,
            storage_len,
            long: info.kind == TensorKind::BatchCount,
        }
    }
}

/// `data.pkl` of a state dict of `entries`, as `torch.save` writes it.
fn state_dict_pickle(entries: &[TensorEntry]) -> Vec<u8> {
    let mut pickle = PickleWriter::new();
    pickle.0.extend(b"}(");
    for entry in entries {
        pickle.text(&entry.name);
        pickle.global("torch._utils", "_rebuild_tensor_v2");
        pickle.0.push(b'(');
        pickle.0.push(b'(');
        pickle.text("storage");
        let class = if entry.long {
            "LongStorage"
        } else {
            "FloatStorage"
        };
        pickle.global("torch", class);
        pickle.text(&entry.key);
        pickle.text("cpu");
        pickle.int(entry.storage_len);
        pickle.0.extend(b"tQ");
        pickle.int(entry.offset);
        pickle.int_tuple(&entry.shape);
        let mut strides = vec![1usize; entry.shape.len()];
        for axis in (0..entry.shape.len().saturating_sub(1)).rev() {
            strides[axis] = strides[axis + 1] * entry.shape[axis + 1];
        }
        pickle.int_tuple(&strides);
        pickle.0.extend(b"\x89tR");
    }
    pickle.0.extend(b"u.");
    pickle.0
}

/// A storage of a hand-built archive: its key and a reader of its bytes.
type Storage = (String, Box<dyn Read>);

/// Writes a `torch.save` zip archive, every entry deflated.
fn write_torch_save(path: &Path, pickle: &mut dyn Read, storages: Vec<Storage>) {
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .compression_level(Some(1));
    let mut zip = zip::ZipWriter::new(File::create(path).expect("archive file"));
    zip.start_file("archive/data.pkl", options).expect("entry");
    std::io::copy(pickle, &mut zip).expect("pickle");
    zip.start_file("archive/byteorder", options).expect("entry");
    zip.write_all(b"little").expect("byteorder");
    for (key, mut bytes) in storages {
        zip.start_file(format!("archive/data/{key}"), options)
            .expect("entry");
        std::io::copy(&mut bytes, &mut zip).expect("storage");
    }
    zip.finish().expect("finish archive");
}

/// Writes `file` in `dir`, a torch.save archive of the state dict of `entries` over
/// `storages`, and evaluates it on the CIFAR records in `data`.
fn eval_state_dict(
    dir: &Path,
    file: &str,
    entries: &[TensorEntry],
    storages: Vec<Storage>,
    data: &Path,
) -> Measured {
    let path = dir.join(file);
    write_torch_save(&path, &mut state_dict_pickle(entries).as_slice(), storages);
    run_measured(&eval_args(&path, "cifar10-bin", data))
}

fn zeros(len: u64) -> Box<dyn Read> {
    Box::new(std::io::repeat(0).take(len))
}

/// The entries `entry` makes of the small model's tensors.
fn small_model_entries(
    entry: impl Fn(&tandem_models::TensorInfo) -> TensorEntry,
) -> Vec<TensorEntry> {
    small_model().tensors().iter().map(entry).collect()
}

/// 64 MiB of f32 zeros: the storage the hostile archives share.
const BIG_STORAGE_ELEMENTS: usize = 16 << 20;

#[test]
fn tensors_sharing_one_large_storage_are_checked_against_the_model_before_it_is_read() {
    let (dir, baseline, data) = legitimate_eval();
    // Every tensor of the model, each claiming the whole 64 MiB storage.
    let entries = small_model_entries(|info| TensorEntry {
        shape: vec![BIG_STORAGE_ELEMENTS],
        long: false,
        ..TensorEntry::of(info, "0", BIG_STORAGE_ELEMENTS)
    });
    let storages = vec![("0".into(), zeros(BIG_STORAGE_ELEMENTS as u64 * 4))];
    let file = "shared_whole_storage.pth";
    let measured = eval_state_dict(dir.path(), file, &entries, storages, &data);
    measured.expect_refusal(&[
        "shared_whole_storage.pth",
        "not the model built here",
        "with another shape (first `",
        &format!("[{BIG_STORAGE_ELEMENTS}] in the file"),
    ]);
    assert_peak_within("whole-storage views", &measured, &baseline);
}

#[test]
fn a_storage_larger_than_the_model_needs_is_refused_before_it_is_read() {
    let (dir, baseline, data) = legitimate_eval();
    // The model's names and shapes, every tensor a view at the start of one 64 MiB storage.
    let entries = small_model_entries(|info| match info.kind {
        TensorKind::BatchCount => TensorEntry::of(info, "1", 1),
        _ => TensorEntry::of(info, "0", BIG_STORAGE_ELEMENTS),
    });
    let storages = vec![
        ("0".into(), zeros(BIG_STORAGE_ELEMENTS as u64 * 4)),
        ("1".into(), zeros(8)),
    ];
    let file = "oversized_storage.pth";
    let measured = eval_state_dict(dir.path(), file, &entries, storages, &data);
    measured.expect_refusal(&[
        "oversized_storage.pth",
        &format!(
            "its storages hold {} bytes, more than the",
            BIG_STORAGE_ELEMENTS * 4 + 8
        ),
    ]);
    assert_peak_within("oversized storage", &measured, &baseline);
}

#[test]
fn a_key_repeated_thousands_of_times_is_refused_before_any_storage_is_decoded() {
    let (dir, baseline, data) = legitimate_eval();
    let model = small_model();
    // The model's tensors, each with a storage of its own, then the largest one's entry
    // again 4,000 times: decoded once per entry, 4,000 copies of it (147 MB).
    let entry = |index: usize, info: &tandem_models::TensorInfo| {
        TensorEntry::of(
            info,
            &index.to_string(),
            info.shape.iter().product::<usize>().max(1),
        )
    };
    let mut entries: Vec<TensorEntry> = model
        .tensors()
        .iter()
        .enumerate()
        .map(|(index, info)| entry(index, info))
        .collect();
    let (largest, info) = model
        .tensors()
        .iter()
        .enumerate()
        .max_by_key(|(_, info)| info.shape.iter().product::<usize>())
        .expect("tensors");
    entries.extend((0..4000).map(|_| entry(largest, info)));
    let storages = model
        .tensors()
        .iter()
        .enumerate()
        .map(|(index, info)| {
            let elements = info.shape.iter().product::<usize>().max(1) as u64;
            let bytes = if info.kind == TensorKind::BatchCount {
                8
            } else {
                4
            };
            (index.to_string(), zeros(elements * bytes))
        })
        .collect();
    let file = "repeated_key.pth";
    let measured = eval_state_dict(dir.path(), file, &entries, storages, &data);
    measured.expect_refusal(&[
        "repeated_key.pth",
        &format!("state dict key \"{}\" appears more than once", info.name),
    ]);
    assert_peak_within("a repeated key", &measured, &baseline);
}

#[test]
fn an_annotation_file_naming_one_png_200_000_times_is_refused_before_decoding() {
    let (dir, baseline, _) = legitimate_eval();
    let weights = dir.path().join("weights.safetensors");
    // 1.2 MB of JSON: the same file 200,000 times (each entry was one decoded image).
    let entries = 200_000;
    let names = vec!["\"one.png\""; entries].join(",");
    let labels = vec!["3"; entries].join(",");
    let annotations = format!(r#"{{"images": [{names}], "categories": [{labels}]}}"#);
    let root = json_test_folder(dir.path(), &annotations);
    let image = image::RgbImage::from_pixel(32, 32, image::Rgb([9, 99, 199]));
    image.save(root.join("test_cifar10/one.png")).expect("png");
    let measured = run_measured(&eval_args(&weights, "json-folder", &root));
    measured.expect_refusal(&[
        "cifar10_test.json",
        "images[1] is \"one.png\" again (as images[0]), expected each image once",
    ]);
    assert_peak_within("one PNG named 200,000 times", &measured, &baseline);
}

#[test]
fn a_compressed_pickle_bomb_is_refused_at_the_bound() {
    let (dir, baseline, data) = legitimate_eval();
    // BINBYTES of 96 MiB: a valid opcode whose payload is all the pickle is.
    let payload: u32 = 96 << 20;
    let mut head = vec![0x80, 2, b'B'];
    head.extend(payload.to_le_bytes());
    let mut pickle = head
        .as_slice()
        .chain(std::io::repeat(0).take(u64::from(payload)))
        .chain(&b"."[..]);
    let path = dir.path().join("pickle_bomb.pth");
    write_torch_save(&path, &mut pickle, Vec::new());
    assert!(std::fs::metadata(&path).expect("archive").len() < 1 << 20);
    let measured = run_measured(&eval_args(&path, "cifar10-bin", &data));
    measured.expect_refusal(&["pickle_bomb.pth", "archive/data.pkl is longer than"]);
    assert_peak_within("pickle bomb", &measured, &baseline);
}

#[test]
fn tensors_sharing_one_storage_of_the_models_size_load_as_from_safetensors() {
    let (dir, baseline, data) = legitimate_eval();
    let model = small_model();
    // One float storage holding every parameter and buffer back to back, and one long
    // storage that every `num_batches_tracked` views.
    let mut floats = Vec::new();
    let mut entries = Vec::new();
    for info in model.tensors() {
        let long = info.kind == TensorKind::BatchCount;
        let offset = if long { 0 } else { floats.len() };
        if !long {
            floats.extend(model.tensor_values(&info.name).expect("values"));
        }
        entries.push(TensorEntry {
            name: format!("module.{}", info.name),
            offset,
            ..TensorEntry::of(info, if long { "counts" } else { "weights" }, 0)
        });
    }
    for entry in &mut entries {
        entry.storage_len = if entry.long { 1 } else { floats.len() };
    }
    let float_bytes: Vec<u8> = floats
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect();
    let count_bytes = (model.num_batches_tracked() as i64).to_le_bytes().to_vec();
    let storages: Vec<Storage> = vec![
        (
            "weights".into(),
            Box::new(std::io::Cursor::new(float_bytes)),
        ),
        ("counts".into(), Box::new(std::io::Cursor::new(count_bytes))),
    ];
    let file = "shared_storage.pth";
    let measured = eval_state_dict(dir.path(), file, &entries, storages, &data);
    assert_eq!(measured.exit_code, Some(0), "{}", measured.describe());
    assert_eq!(measured.stdout, baseline.stdout);
    assert!(
        measured.stdout.contains("\"samples\":16"),
        "{}",
        measured.stdout
    );
    assert_peak_within("shared storage of the model's size", &measured, &baseline);
}

#[test]
fn a_cifar_archive_member_longer_than_a_batch_is_refused_before_it_is_read() {
    let (dir, baseline, _) = legitimate_eval();
    let weights = dir.path().join("weights.safetensors");
    // 32,768 records of zeros (label 0, black pixels): 100.7 MB inflated from ~100 KB.
    let len = 3073 * 32_768;
    let archive = dir.path().join("cifar-10-binary.tar.gz");
    let member = ("cifar-10-batches-bin/test_batch.bin", len, 0);
    tandem_testdata::archive::tar_gz(&archive, &[member]);
    assert!(std::fs::metadata(&archive).expect("archive").len() < 1 << 20);
    let measured = run_measured(&eval_args(&weights, "cifar10-bin", &archive));
    measured.expect_refusal(&[
        "test_batch.bin",
        &format!("{len} bytes"),
        "at most 30730000 bytes",
    ]);
    assert_peak_within("tar.gz bomb", &measured, &baseline);
}

/// Makes `dir/json`, a `json-folder` data set whose test split's annotations are
/// `annotations` and whose images folder is empty, and returns its path.
fn json_test_folder(dir: &Path, annotations: &str) -> PathBuf {
    let root = dir.join("json");
    std::fs::create_dir_all(root.join("annotations")).expect("folder");
    std::fs::create_dir_all(root.join("test_cifar10")).expect("folder");
    std::fs::write(root.join("annotations/cifar10_test.json"), annotations).expect("json");
    root
}

/// Writes an RGB PNG of `width` x `height` black pixels, compressed row by row.
fn write_black_png(path: &Path, width: u32, height: u32) {
    let mut pixels = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    let row = vec![0u8; 1 + 3 * width as usize];
    for _ in 0..height {
        pixels.write_all(&row).expect("row");
    }
    let pixels = pixels.finish().expect("zlib end");
    let png = tandem_testdata::png::rgb_png(width, height, &pixels);
    std::fs::write(path, png).expect("png");
}

#[test]
fn a_giant_png_is_refused_from_its_header_before_decoding() {
    let (dir, baseline, _) = legitimate_eval();
    let weights = dir.path().join("weights.safetensors");
    let root = json_test_folder(
        dir.path(),
        r#"{"images": ["giant.png"], "categories": [3]}"#,
    );
    // 6,000 x 6,000 RGB: 108 MB once decoded.
    write_black_png(&root.join("test_cifar10/giant.png"), 6000, 6000);
    let measured = run_measured(&eval_args(&weights, "json-folder", &root));
    measured.expect_refusal(&["giant.png", "image is 6000x6000", "expected 32x32"]);
    assert_peak_within("giant PNG", &measured, &baseline);
}

#[test]
fn empty_cifar_files_are_refused_by_eval_and_train() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = small_model();
    let weights = dir.path().join("weights.safetensors");
    tandem_models::save_safetensors(&model, &weights, &Default::default()).expect("save");
    let data = cifar_bin_folder(dir.path(), 0);
    for batch in 1..=5 {
        std::fs::write(data.join(format!("data_batch_{batch}.bin")), b"").expect("empty");
    }
    let eval = run_measured(&eval_args(&weights, "cifar10-bin", &data));
    eval.expect_refusal(&["the test split of --data cifar10-bin", "holds no samples"]);

    let output = dir.path().join("run");
    let mut train = synthetic_run(&output, 64);
    train = with_flag(train, "--data", "cifar10-bin");
    train = with_flag(train, "--data-dir", &data.display().to_string());
    let measured = run_measured(&train);
    measured.expect_refusal(&["the train split of --data cifar10-bin", "holds no samples"]);
    let written: Vec<_> = std::fs::read_dir(&output)
        .map(|entries| entries.flatten().map(|entry| entry.file_name()).collect())
        .unwrap_or_default();
    assert!(
        !written
            .iter()
            .any(|name| name.to_string_lossy().ends_with(".safetensors")),
        "train wrote {written:?}"
    );
}

#[test]
fn temporary_files_of_dead_writers_are_removed_when_train_starts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = dir.path().join("run");
    std::fs::create_dir_all(&output).expect("output folder");
    // Above any pid_max Linux allows (2^22): no live process has this pid.
    let dead = 1u64 << 30;
    let stale = [
        format!("snapshot.safetensors.{dead}.tmp"),
        format!("metrics.jsonl.{dead}.tmp"),
        format!(".epoch_1.safetensors.{dead}.tmp"),
    ];
    // A concurrent writer that is alive: this test process.
    let live = format!("snapshot.safetensors.{}.tmp", std::process::id());
    let unrelated = "notes.123.tmp.txt";
    for name in stale.iter().chain([&live, &unrelated.to_string()]) {
        std::fs::write(output.join(name), b"partial").expect("temporary file");
    }
    let args = with_flag(synthetic_run(&output, 64), "--epochs", "1");
    let measured = run_measured(&args);
    assert_eq!(measured.exit_code, Some(0), "{}", measured.describe());
    for name in &stale {
        assert!(!output.join(name).exists(), "{name} was left behind");
    }
    assert!(
        output.join(&live).exists(),
        "a live writer's {live} was removed"
    );
    assert!(output.join(unrelated).exists(), "{unrelated} was removed");
    assert!(output.join("snapshot.safetensors").exists());
}

#[test]
fn an_edited_epoch_in_the_snapshot_metadata_is_caught_and_the_previous_snapshot_used() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = dir.path().join("run");
    let mut args = synthetic_run(&output, 192);
    args.extend(["--snapshot-every-steps".to_string(), "1".to_string()]);
    let mut first = args.clone();
    first.extend(["--max-steps".to_string(), "3".to_string()]);
    let measured = run_measured(&first);
    assert_eq!(measured.exit_code, Some(0), "{}", measured.describe());
    // The description is JSON inside the header's JSON, so its quotes are escaped.
    let snapshot = output.join("snapshot.safetensors");
    let bytes = std::fs::read(&snapshot).expect("snapshot");
    let (from, to) = (br#"\"epoch\":0"#, br#"\"epoch\":1"#);
    let at = bytes
        .windows(from.len())
        .position(|window| window == from)
        .expect("the snapshot's epoch");
    let mut edited = bytes.clone();
    edited[at..at + to.len()].copy_from_slice(to);
    std::fs::write(&snapshot, edited).expect("edited snapshot");
    let measured = run_measured(&args);
    assert_eq!(measured.exit_code, Some(0), "{}", measured.describe());
    assert!(
        measured.stderr.contains("checksum does not match"),
        "{}",
        measured.describe()
    );
    assert!(measured.stderr.contains("snapshot.safetensors.prev"));
    assert!(
        measured
            .stdout
            .contains("Resuming training from snapshot at epoch 1, step 2"),
        "{}",
        measured.describe()
    );
}

/// `path`, a safetensors file, with its metadata entry `key` set to `value` (the header
/// rewritten, padded to 8 bytes; the tensors' bytes unchanged).
fn edit_safetensors_metadata(path: &Path, key: &str, value: &str) {
    let bytes = std::fs::read(path).expect("safetensors file");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("length")) as usize;
    let mut header: serde_json::Value =
        serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    header["__metadata__"][key] = serde_json::Value::String(value.to_string());
    let mut text = serde_json::to_vec(&header).expect("header");
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut edited = (text.len() as u64).to_le_bytes().to_vec();
    edited.extend(text);
    edited.extend(&bytes[8 + header_len..]);
    std::fs::write(path, edited).expect("edited file");
}

#[test]
fn a_checkpoint_describing_a_huge_model_is_refused_before_it_is_built() {
    let (dir, baseline, data) = legitimate_eval();
    let output = dir.path().join("run");
    let measured = run_measured(&synthetic_run(&output, 64));
    assert_eq!(measured.exit_code, Some(0), "{}", measured.describe());
    let edits = [
        (
            "tandem.n-blocks",
            "1,1,100000000",
            "tandem.n-blocks adds up to 100000002 blocks, but",
        ),
        (
            "tandem.n-channels",
            "8,16,100000000",
            "tandem.n-channels = 8,16,100000000 is not what the tensors hold, `--model \
             resnet-base --n-blocks 1,1,1 --n-channels 8,16,32",
        ),
        (
            "tandem.num-classes",
            "1000000000",
            "tandem.num-classes = 1000000000 is not what the tensors hold",
        ),
    ];
    for file in ["epoch_2.safetensors", "snapshot.safetensors"] {
        for (key, value, expected) in edits {
            let edited = dir.path().join(format!("edited-{file}"));
            std::fs::copy(output.join(file), &edited).expect("copy");
            edit_safetensors_metadata(&edited, key, value);
            let mut eval = vec![
                "eval".to_string(),
                "--checkpoint".into(),
                edited.display().to_string(),
                "--data".into(),
                "cifar10-bin".into(),
                "--data-dir".into(),
                data.display().to_string(),
                "--threads".into(),
                "1".into(),
            ];
            let measured = run_measured(&eval);
            let snapshot_values = "values, but its snapshot tensors hold";
            let expected = match (file, key) {
                ("snapshot.safetensors", "tandem.n-blocks") => expected,
                ("snapshot.safetensors", _) => snapshot_values,
                _ => expected,
            };
            measured.expect_refusal(&[
                &edited.display().to_string(),
                "describes in its metadata a model its tensors do not hold",
                expected,
            ]);
            assert_peak_within(
                &format!("{file} with {key} = {value}"),
                &measured,
                &baseline,
            );
            eval[0] = "predict".into();
            eval.truncate(3);
            eval.push(data.join("test_batch.bin").display().to_string());
            let measured = run_measured(&eval);
            measured.expect_refusal(&["describes in its metadata a model its tensors do not hold"]);
            assert_peak_within(&format!("predict, {file} with {key}"), &measured, &baseline);
        }
    }
}

/// `archive` (as the zip crate writes it: no comment, no zip64 records) with its
/// end-of-central-directory record replaced by zip64 end records declaring `entries`.
fn declaring_entries(archive: &[u8], entries: u64) -> Vec<u8> {
    let (body, end) = archive.split_at(archive.len() - 22);
    assert_eq!(
        &end[..4],
        b"PK\x05\x06",
        "the archive ends with its end record"
    );
    let field = |at: usize| u32::from_le_bytes([end[at], end[at + 1], end[at + 2], end[at + 3]]);
    let (directory_bytes, directory_offset) = (field(12), field(16));
    let mut bytes = body.to_vec();
    let record_at = bytes.len() as u64;
    bytes.extend(b"PK\x06\x06");
    bytes.extend(44u64.to_le_bytes());
    bytes.extend([45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    bytes.extend(entries.to_le_bytes());
    bytes.extend(entries.to_le_bytes());
    bytes.extend(u64::from(directory_bytes).to_le_bytes());
    bytes.extend(u64::from(directory_offset).to_le_bytes());
    bytes.extend(b"PK\x06\x07");
    bytes.extend([0; 4]);
    bytes.extend(record_at.to_le_bytes());
    bytes.extend(1u32.to_le_bytes());
    bytes.extend(b"PK\x05\x06");
    bytes.extend([0; 4]);
    bytes.extend([0xff; 12]);
    bytes.extend([0; 2]);
    bytes
}

#[test]
fn an_archive_declaring_millions_of_entries_is_refused_before_the_zip_reader_sees_it() {
    let (dir, baseline, _) = legitimate_eval();
    let path = dir.path().join("millions.pth");
    write_torch_save(&path, &mut state_dict_pickle(&[]).as_slice(), Vec::new());
    let archive = std::fs::read(&path).expect("archive");
    std::fs::write(&path, declaring_entries(&archive, 4_000_000)).expect("edited archive");
    let output = dir.path().join("run");
    let train = with_flag(
        synthetic_run(&output, 64),
        "--init-from",
        &path.display().to_string(),
    );
    let measured = run_measured(&train);
    let path = path.display();
    measured.expect_refusal(&[&format!(
        "error: cannot read PyTorch checkpoint {path}: {path}: the zip archive declares \
         4000000 entries in a central directory of 125 bytes, which holds at most 2 (each \
         entry takes at least 46 bytes)\n"
    )]);
    assert_peak_within("4,000,000 entries declared", &measured, &baseline);
}
