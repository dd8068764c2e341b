//! CIFAR-10's python-pickle layout (`cifar-10-batches-py/`), read as seed 000's
//! `load_cifar_data` does: each batch is a Python 2 pickle of a dict with `data` (a numpy
//! uint8 array [rows, 3072], R, G, B planes) and `labels` (a list of ints). Any number of
//! rows per batch up to CIFAR-10's 10,000 is accepted.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use tandem_pickle::{loads_with_limits, ndarray_from_value, DType, Limits, Value};

use crate::dataset::{cifar10_class_names, planes_to_hwc, Dataset, Split};
use crate::error::DataError;

/// The folder name of the layout.
const BATCHES_FOLDER: &str = "cifar-10-batches-py";
/// Pixel bytes per row of `data`.
const ROW_LEN: usize = 3072;
/// Most rows a batch holds: CIFAR-10's batches hold 10,000 each.
const MAX_ROWS: usize = 10_000;
/// Most bytes of a batch file, and of the strings it unpickles to: the 30,720,000 pixel
/// bytes, plus room for the labels, file names and batch label (the official batches take
/// about 316,000 bytes for these).
const MAX_BATCH_BYTES: u64 = (MAX_ROWS * ROW_LEN) as u64 + (2 << 20);
/// Most values a batch unpickles to: a label and a file name per row, and a few more.
const MAX_BATCH_VALUES: u64 = 3 * MAX_ROWS as u64 + 1000;
/// Most bytes of `batches.meta` (the official one has 158).
const MAX_META_BYTES: u64 = 64 << 10;

/// The batch files of a split, in order.
fn batch_files(split: Split) -> Vec<String> {
    match split {
        Split::Train => (1..=5).map(|batch| format!("data_batch_{batch}")).collect(),
        Split::Test => vec!["test_batch".to_string()],
    }
}

/// Reads one split from `dir` (the batches folder or a folder holding it).
pub(crate) fn load(dir: &Path, split: Split) -> Result<Dataset, DataError> {
    let folder = locate(dir)?;
    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    for name in batch_files(split) {
        read_batch(&folder.join(name), &mut pixels, &mut labels)?;
    }
    let meta_path = folder.join("batches.meta");
    let class_names = if meta_path.is_file() {
        read_class_names(&meta_path)?
    } else {
        cifar10_class_names()
    };
    Ok(Dataset::cifar10(pixels, labels, class_names))
}

fn locate(dir: &Path) -> Result<PathBuf, DataError> {
    if dir.join("data_batch_1").is_file() || dir.join("test_batch").is_file() {
        return Ok(dir.to_path_buf());
    }
    if dir.join(BATCHES_FOLDER).is_dir() {
        return Ok(dir.join(BATCHES_FOLDER));
    }
    Err(DataError::NotFound {
        path: dir.to_path_buf(),
        message: format!(
            "no CIFAR-10 python batches: expected data_batch_1 here or a {BATCHES_FOLDER}/ folder"
        ),
    })
}

/// Reads and unpickles a file of at most `max_bytes`, refused by its size before it is
/// read; what it unpickles to is bounded by the same number of bytes.
fn unpickle(path: &Path, max_bytes: u64) -> Result<Value, DataError> {
    let file = File::open(path).map_err(|source| DataError::io(path, source))?;
    let len = file
        .metadata()
        .map_err(|source| DataError::io(path, source))?
        .len();
    let too_long = |len: u64| {
        DataError::format(
            path,
            format!(
                "{len} bytes, more than this CIFAR-10 python file can hold (at most {max_bytes} bytes)"
            ),
        )
    };
    if len > max_bytes {
        return Err(too_long(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max_bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| DataError::io(path, source))?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_long(bytes.len() as u64));
    }
    let limits = Limits {
        max_depth: 32,
        max_output_bytes: max_bytes,
        max_output_values: MAX_BATCH_VALUES,
    };
    loads_with_limits(&bytes, limits).map_err(|source| DataError::Pickle {
        path: path.to_path_buf(),
        source,
    })
}

/// The value of a dict key, or an error listing the keys that are there.
fn field<'v>(path: &Path, batch: &'v Value, key: &str) -> Result<&'v Value, DataError> {
    let Some(entries) = batch.as_dict() else {
        return Err(DataError::format(
            path,
            format!(
                "holds {}, expected a dict with keys 'data' and 'labels'",
                batch.describe()
            ),
        ));
    };
    batch.get(key).ok_or_else(|| {
        let keys: Vec<String> = entries.iter().map(|(key, _)| key.describe()).collect();
        DataError::format(
            path,
            format!("missing key '{key}' (found keys: {})", keys.join(", ")),
        )
    })
}

fn read_batch(path: &Path, pixels: &mut Vec<u8>, labels: &mut Vec<u32>) -> Result<(), DataError> {
    let batch = unpickle(path, MAX_BATCH_BYTES)?;
    let data = field(path, &batch, "data")?;
    let array = ndarray_from_value(data).map_err(|source| DataError::Pickle {
        path: path.to_path_buf(),
        source,
    })?;
    if array.dtype != DType::U8 {
        return Err(DataError::format(
            path,
            format!(
                "field 'data' has dtype {}, expected u1 (uint8)",
                array.dtype.code()
            ),
        ));
    }
    let [rows, row_len] = array.shape[..] else {
        return Err(DataError::format(
            path,
            format!(
                "field 'data' has shape {:?}, expected [rows, {ROW_LEN}]",
                array.shape
            ),
        ));
    };
    if rows > MAX_ROWS {
        return Err(DataError::format(
            path,
            format!("field 'data' has {rows} rows, more than a CIFAR-10 batch holds ({MAX_ROWS})"),
        ));
    }
    if row_len != ROW_LEN {
        return Err(DataError::format(
            path,
            format!("field 'data' has rows of {row_len} values, expected {ROW_LEN} (3 x 32 x 32)"),
        ));
    }
    let label_values = field(path, &batch, "labels")?
        .as_sequence()
        .ok_or_else(|| DataError::format(path, "field 'labels' is not a list"))?;
    if label_values.len() != rows {
        return Err(DataError::format(
            path,
            format!(
                "field 'labels' has {} entries, expected {rows} (one per row of 'data')",
                label_values.len()
            ),
        ));
    }
    for (row, label) in label_values.iter().enumerate() {
        match label.as_int() {
            Some(value @ 0..=9) => labels.push(value as u32),
            _ => {
                return Err(DataError::format(
                    path,
                    format!(
                        "field 'labels' entry {row} is {}, expected an int in 0..=9",
                        label.describe()
                    ),
                ))
            }
        }
    }
    let start = pixels.len();
    pixels.resize(start + rows * ROW_LEN, 0);
    for (planes, hwc) in array
        .data
        .chunks_exact(ROW_LEN)
        .zip(pixels[start..].chunks_exact_mut(ROW_LEN))
    {
        planes_to_hwc(planes, hwc);
    }
    Ok(())
}

fn read_class_names(path: &Path) -> Result<Vec<String>, DataError> {
    let meta = unpickle(path, MAX_META_BYTES)?;
    let names = field(path, &meta, "label_names")?
        .as_sequence()
        .ok_or_else(|| DataError::format(path, "field 'label_names' is not a list"))?;
    names
        .iter()
        .enumerate()
        .map(|(index, name)| {
            name.as_text().map(str::to_string).ok_or_else(|| {
                DataError::format(
                    path,
                    format!(
                        "field 'label_names' entry {index} is {}, expected text",
                        name.describe()
                    ),
                )
            })
        })
        .collect()
}
