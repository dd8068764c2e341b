//! CIFAR-10's binary layout: records of 1 label byte + 3,072 pixel bytes (R, G, B planes,
//! row-major), in `data_batch_{1..5}.bin` and `test_batch.bin`, from a folder or straight
//! from the `.tar.gz` archive.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::dataset::{cifar10_class_names, planes_to_hwc, Dataset, Split};
use crate::error::DataError;

/// Bytes per record: the label, then the 3,072 pixel bytes.
pub(crate) const RECORD_LEN: usize = 1 + 3072;
/// Most records a batch file holds: CIFAR-10's batches hold 10,000 each.
const MAX_RECORDS_PER_BATCH: usize = 10_000;
/// Most bytes a batch file holds: 30,730,000.
const MAX_BATCH_BYTES: u64 = (MAX_RECORDS_PER_BATCH * RECORD_LEN) as u64;
/// Most bytes of the class-names file (the official one has 61).
const MAX_META_BYTES: u64 = 4096;
/// Most bytes the archive may inflate to: six batches, the class names and a readme, with
/// room for the tar headers (the official archive inflates to about 184.4 MB).
const MAX_ARCHIVE_INFLATED_BYTES: u64 = 6 * MAX_BATCH_BYTES + (8 << 20);
/// The folder name inside the official archive.
const BATCHES_FOLDER: &str = "cifar-10-batches-bin";
/// Archive names accepted in a data folder: the official one, then the shared copy's.
const ARCHIVE_NAMES: [&str; 2] = ["cifar-10-binary.tar.gz", "cifar-10-batches-bin.tar.gz"];
/// The class-names file.
const META_FILE: &str = "batches.meta.txt";

/// The batch files of a split, in order.
fn batch_files(split: Split) -> Vec<String> {
    match split {
        Split::Train => (1..=5)
            .map(|batch| format!("data_batch_{batch}.bin"))
            .collect(),
        Split::Test => vec!["test_batch.bin".to_string()],
    }
}

/// Where the binary layout was found.
enum Location {
    Folder(PathBuf),
    Archive(PathBuf),
}

/// Reads one split from any accepted location of the binary layout.
pub(crate) fn load(dir: &Path, split: Split) -> Result<Dataset, DataError> {
    match locate(dir)? {
        Location::Folder(folder) => load_folder(&folder, split),
        Location::Archive(archive) => load_archive(&archive, split),
    }
}

/// Whether `dir` holds the binary layout in any accepted form.
pub(crate) fn is_present(dir: &Path) -> bool {
    locate(dir).is_ok()
}

fn locate(dir: &Path) -> Result<Location, DataError> {
    if dir.is_file() {
        return Ok(Location::Archive(dir.to_path_buf()));
    }
    if dir.join("data_batch_1.bin").is_file() || dir.join("test_batch.bin").is_file() {
        return Ok(Location::Folder(dir.to_path_buf()));
    }
    if dir.join(BATCHES_FOLDER).is_dir() {
        return Ok(Location::Folder(dir.join(BATCHES_FOLDER)));
    }
    for name in ARCHIVE_NAMES {
        if dir.join(name).is_file() {
            return Ok(Location::Archive(dir.join(name)));
        }
    }
    Err(DataError::NotFound {
        path: dir.to_path_buf(),
        message: format!(
            "no CIFAR-10 binary data: expected data_batch_1.bin here, a {BATCHES_FOLDER}/ folder, or {} (run with --download to fetch it)",
            ARCHIVE_NAMES.join(" or ")
        ),
    })
}

fn load_folder(folder: &Path, split: Split) -> Result<Dataset, DataError> {
    let mut parsed = Parsed::default();
    for name in batch_files(split) {
        let path = folder.join(&name);
        let file = File::open(&path).map_err(|source| DataError::io(&path, source))?;
        let len = file
            .metadata()
            .map_err(|source| DataError::io(&path, source))?
            .len();
        check_batch_len(&path, len)?;
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(MAX_BATCH_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| DataError::io(&path, source))?;
        check_batch_len(&path, bytes.len() as u64)?;
        parsed.add_records(&path, &bytes)?;
    }
    let meta_path = folder.join(META_FILE);
    let class_names = if meta_path.is_file() {
        let file = File::open(&meta_path).map_err(|source| DataError::io(&meta_path, source))?;
        let mut bytes = Vec::new();
        file.take(MAX_META_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| DataError::io(&meta_path, source))?;
        check_meta_len(&meta_path, bytes.len() as u64)?;
        parse_class_names(&meta_path, &String::from_utf8_lossy(&bytes))?
    } else {
        cifar10_class_names()
    };
    Ok(Dataset::cifar10(parsed.pixels, parsed.labels, class_names))
}

/// Streams the archive once, keeping the members the split needs.
fn load_archive(archive_path: &Path, split: Split) -> Result<Dataset, DataError> {
    let archive_error = |message: String| DataError::Archive {
        path: archive_path.to_path_buf(),
        message,
    };
    let file = File::open(archive_path).map_err(|source| DataError::io(archive_path, source))?;
    let inflated = InflationBound {
        inner: flate2::read::GzDecoder::new(std::io::BufReader::new(file)),
        remaining: MAX_ARCHIVE_INFLATED_BYTES,
    };
    let mut archive = tar::Archive::new(inflated);
    let wanted = batch_files(split);
    let mut members: HashMap<String, Vec<u8>> = HashMap::new();
    let mut meta_text = None;
    let entries = archive
        .entries()
        .map_err(|error| archive_error(format!("not a readable .tar.gz: {error}")))?;
    for entry in entries {
        let mut entry =
            entry.map_err(|error| archive_error(format!("damaged archive: {error}")))?;
        let member_path = entry
            .path()
            .map_err(|error| archive_error(format!("damaged member name: {error}")))?
            .to_path_buf();
        let Some(file_name) = member_path.file_name().and_then(|name| name.to_str()) else {
            continue;
        };
        let file_name = file_name.to_string();
        let is_meta = file_name == META_FILE;
        if !wanted.contains(&file_name) && !is_meta {
            continue;
        }
        let shown_path = archive_path.join(&member_path);
        let limit = if is_meta {
            check_meta_len(&shown_path, entry.size())?;
            MAX_META_BYTES
        } else {
            check_batch_len(&shown_path, entry.size())?;
            MAX_BATCH_BYTES
        };
        let mut bytes = Vec::with_capacity(entry.size().min(limit) as usize);
        entry
            .by_ref()
            .take(limit + 1)
            .read_to_end(&mut bytes)
            .map_err(|error| {
                archive_error(format!("damaged member {}: {error}", member_path.display()))
            })?;
        if is_meta {
            meta_text = Some(String::from_utf8_lossy(&bytes).into_owned());
        } else {
            members.insert(file_name, bytes);
        }
    }
    let mut parsed = Parsed::default();
    for name in &wanted {
        let bytes = members.get(name).ok_or_else(|| {
            archive_error(format!("archive lacks the member {BATCHES_FOLDER}/{name}"))
        })?;
        let member_path = archive_path.join(BATCHES_FOLDER).join(name);
        parsed.add_records(&member_path, bytes)?;
    }
    let class_names = match meta_text {
        Some(text) => parse_class_names(&archive_path.join(BATCHES_FOLDER).join(META_FILE), &text)?,
        None => cifar10_class_names(),
    };
    Ok(Dataset::cifar10(parsed.pixels, parsed.labels, class_names))
}

/// Refuses a batch file longer than any CIFAR-10 batch, before it is read.
fn check_batch_len(path: &Path, len: u64) -> Result<(), DataError> {
    if len > MAX_BATCH_BYTES {
        return Err(DataError::format(
            path,
            format!(
                "{len} bytes, more than a CIFAR-10 batch holds (at most {MAX_BATCH_BYTES} bytes: {MAX_RECORDS_PER_BATCH} records of {RECORD_LEN})"
            ),
        ));
    }
    Ok(())
}

/// Refuses a class-names file longer than ten names can need, before it is read.
fn check_meta_len(path: &Path, len: u64) -> Result<(), DataError> {
    if len > MAX_META_BYTES {
        return Err(DataError::format(
            path,
            format!("{len} bytes, more than ten class names need (at most {MAX_META_BYTES})"),
        ));
    }
    Ok(())
}

/// A reader that fails once more than `remaining` bytes have come through: the archive's
/// whole inflated stream is bounded, members that are skipped included.
struct InflationBound<R> {
    inner: R,
    remaining: u64,
}

impl<R: Read> Read for InflationBound<R> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        if self.remaining == 0 {
            let mut probe = [0u8; 1];
            if self.inner.read(&mut probe)? == 0 {
                return Ok(0);
            }
            return Err(std::io::Error::other(format!(
                "it inflates to more than {MAX_ARCHIVE_INFLATED_BYTES} bytes, more than CIFAR-10's archive holds"
            )));
        }
        let wanted = buffer
            .len()
            .min(self.remaining.min(usize::MAX as u64) as usize);
        let count = self.inner.read(&mut buffer[..wanted])?;
        self.remaining -= count as u64;
        Ok(count)
    }
}

/// Labels and HWC pixels gathered from batch files.
#[derive(Default)]
struct Parsed {
    pixels: Vec<u8>,
    labels: Vec<u32>,
}

impl Parsed {
    fn add_records(&mut self, path: &Path, bytes: &[u8]) -> Result<(), DataError> {
        if !bytes.len().is_multiple_of(RECORD_LEN) {
            return Err(DataError::format(
                path,
                format!(
                    "size {} bytes is not a multiple of the {RECORD_LEN}-byte record (1 label byte + 3,072 pixel bytes)",
                    bytes.len()
                ),
            ));
        }
        let records = bytes.len() / RECORD_LEN;
        let start = self.pixels.len();
        self.pixels.resize(start + records * 3072, 0);
        self.labels.reserve(records);
        let hwc_images = self.pixels[start..].chunks_exact_mut(3072);
        for (record_index, (record, hwc)) in
            bytes.chunks_exact(RECORD_LEN).zip(hwc_images).enumerate()
        {
            let label = record[0];
            if label > 9 {
                return Err(DataError::format(
                    path,
                    format!("record {record_index}: label byte {label}, expected 0..=9"),
                ));
            }
            self.labels.push(u32::from(label));
            planes_to_hwc(&record[1..], hwc);
        }
        Ok(())
    }
}

/// Class names, one a line; blank lines are ignored. There must be ten.
fn parse_class_names(path: &Path, text: &str) -> Result<Vec<String>, DataError> {
    let names: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_string)
        .collect();
    if names.len() != 10 {
        return Err(DataError::format(
            path,
            format!("{} class names, expected 10 (one a line)", names.len()),
        ));
    }
    Ok(names)
}
