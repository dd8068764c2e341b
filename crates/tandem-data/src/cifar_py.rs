//! CIFAR-10's python-pickle layout (`cifar-10-batches-py/`), read as seed 000's
//! `load_cifar_data` does: each batch is a Python 2 pickle of a dict with `data` (a numpy
//! uint8 array [rows, 3072], R, G, B planes) and `labels` (a list of ints). Any number of
//! rows per batch is accepted.

use std::path::{Path, PathBuf};

use tandem_pickle::{loads, ndarray_from_value, DType, Value};

use crate::dataset::{cifar10_class_names, planes_to_hwc, Dataset, Split};
use crate::error::DataError;

/// The folder name of the layout.
const BATCHES_FOLDER: &str = "cifar-10-batches-py";
/// Pixel bytes per row of `data`.
const ROW_LEN: usize = 3072;

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

fn unpickle(path: &Path) -> Result<Value, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::io(path, source))?;
    loads(&bytes).map_err(|source| DataError::Pickle {
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
    let batch = unpickle(path)?;
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
    let meta = unpickle(path)?;
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
