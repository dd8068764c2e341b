//! Where a dataset comes from, and reading one split of it.

use std::path::PathBuf;

use crate::dataset::{Dataset, Split};
use crate::error::DataError;
use crate::synthetic::SyntheticSpec;
use crate::{cifar_bin, cifar_py, json_folder, synthetic};

/// Where a dataset comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// CIFAR-10's binary layout. `dir` is the `cifar-10-batches-bin` folder, a folder
    /// holding it, a folder holding `cifar-10-binary.tar.gz` (or `cifar-10-batches-bin.tar.gz`),
    /// or the archive itself.
    Cifar10Bin {
        /// See above.
        dir: PathBuf,
    },
    /// CIFAR-10's python-pickle layout: the `cifar-10-batches-py` folder or a folder holding it.
    Cifar10Py {
        /// See above.
        dir: PathBuf,
    },
    /// Seed 004's layout: `<root>/annotations/cifar10_{train,test}.json` and images in
    /// `<root>/{train,test}_cifar10/`.
    JsonFolder {
        /// See above.
        root: PathBuf,
    },
    /// Seed 000's "custom data": standard-normal noise with labels 0 and 1.
    Synthetic(SyntheticSpec),
}

/// Reads one split of a data source into memory.
pub fn load_dataset(source: &DataSource, split: Split) -> Result<Dataset, DataError> {
    match source {
        DataSource::Cifar10Bin { dir } => cifar_bin::load(dir, split),
        DataSource::Cifar10Py { dir } => cifar_py::load(dir, split),
        DataSource::JsonFolder { root } => json_folder::load(root, split),
        DataSource::Synthetic(spec) => synthetic::generate(spec, split),
    }
}
