//! A data set under an object prefix, fetched once into the local cache (see
//! `tandem_remote::cache`) and read from there by every data source as a local folder. The
//! files whose official md5 is known (the CIFAR-10 archives and binary batches) are checked
//! against it as they arrive.

use std::path::{Path, PathBuf};

use anyhow::bail;
use tandem_remote::{ObjectInfo, Storage};

use super::object_url;
use crate::settings::{DataKind, DataSettings};

/// CIFAR-10's official files: name, size and md5. A fetched file with an official name and
/// size must have its md5; a file of another size is somebody's own subset, left alone.
const KNOWN_FILES: [(&str, u64, &str); 8] = [
    (
        tandem_data::CIFAR10_ARCHIVE_NAME,
        170_052_171,
        tandem_data::CIFAR10_MD5,
    ),
    (
        "cifar-10-python.tar.gz",
        170_498_071,
        "c58f30108f718f92721af3b95e74349a",
    ),
    (
        "data_batch_1.bin",
        BIN_BATCH_BYTES,
        "5dd7e06a14cb22eb9f671a540d1b7c25",
    ),
    (
        "data_batch_2.bin",
        BIN_BATCH_BYTES,
        "5ea93a67294ea407fff1d09f752e9692",
    ),
    (
        "data_batch_3.bin",
        BIN_BATCH_BYTES,
        "942cd6a4bcdd0dd3c604fbe906cb4421",
    ),
    (
        "data_batch_4.bin",
        BIN_BATCH_BYTES,
        "ae636b3ba5c66a11e91e8cb52e771fcb",
    ),
    (
        "data_batch_5.bin",
        BIN_BATCH_BYTES,
        "53f37980c15c3d472c316c40844f3f0d",
    ),
    (
        "test_batch.bin",
        BIN_BATCH_BYTES,
        "803d5f7f4d78ea53de84dbe85f74fb6d",
    ),
];
/// A binary batch: 10,000 records of a label byte and 3,072 pixel bytes.
const BIN_BATCH_BYTES: u64 = 10_000 * 3_073;

/// For data whose folder is an object URL, the folder of its copy in the cache (fetched
/// as `tandem_remote::Storage::fetch_prefix` does); `None` for a local folder or synthetic data.
pub fn fetched_data_dir(storage: &Storage, data: &DataSettings) -> anyhow::Result<Option<PathBuf>> {
    let Some(url) = object_url(&data.data_dir)? else {
        return Ok(None);
    };
    if data.data == DataKind::Synthetic {
        return Ok(None);
    }
    if data.download {
        bail!(
            "--download fetches CIFAR-10 into a local --data-dir; {url} is in object storage, \
             whose copy is fetched instead: leave out --download"
        );
    }
    Ok(Some(storage.fetch_prefix(&url, check_known_md5)?))
}

/// Fails when `path` holds one of CIFAR-10's official files (by name and size) without its
/// md5; the file is removed so that the next run fetches it again.
fn check_known_md5(path: &Path, object: &ObjectInfo) -> Result<(), String> {
    let Some((_, _, expected)) = KNOWN_FILES
        .iter()
        .find(|(name, size, _)| *name == object.url.file_name() && *size == object.size)
    else {
        return Ok(());
    };
    let actual = tandem_data::file_md5(path).map_err(|error| error.to_string())?;
    if actual != *expected {
        let _ = std::fs::remove_file(path);
        return Err(format!(
            "{}: md5 is {actual}, expected CIFAR-10's {expected}: the object is damaged (its \
             copy was removed)",
            object.url
        ));
    }
    Ok(())
}
