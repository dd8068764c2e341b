//! From the data flags to a loaded data set.

use anyhow::{bail, Context};
use tandem_data::{DataSource, Dataset, Normalize, SyntheticSpec};

use crate::model_args::value_name;
use crate::settings::{DataKind, DataSettings};

pub use tandem_data::Split;

/// The data source the settings describe.
pub fn data_source(settings: &DataSettings, seed: u64) -> DataSource {
    let dir = settings.data_dir.clone();
    match settings.data {
        DataKind::Cifar10Bin => DataSource::Cifar10Bin { dir },
        DataKind::Cifar10Py => DataSource::Cifar10Py { dir },
        DataKind::JsonFolder => DataSource::JsonFolder { root: dir },
        DataKind::Synthetic => DataSource::Synthetic(SyntheticSpec {
            train_samples: settings.synthetic_train,
            test_samples: settings.synthetic_test,
            seed,
            ..SyntheticSpec::default()
        }),
    }
}

/// Loads one split of the run's data set, downloading CIFAR-10 first when asked to.
pub fn load_split(settings: &DataSettings, seed: u64, split: Split) -> anyhow::Result<Dataset> {
    if settings.download && settings.data == DataKind::Cifar10Bin {
        tandem_data::ensure_cifar10_downloaded(&settings.data_dir, tandem_data::CIFAR10_URL)
            .with_context(|| {
                format!(
                    "cannot download CIFAR-10 into {}",
                    settings.data_dir.display()
                )
            })?;
    }
    let source = data_source(settings, seed);
    let kind = value_name(&settings.data);
    let dataset = tandem_data::load_dataset(&source, split)
        .with_context(|| format!("cannot load the {} split of --data {kind}", split.name()))?;
    if dataset.is_empty() {
        bail!(
            "the {} split of --data {kind} in {} holds no samples: there is nothing to train on or evaluate",
            split.name(),
            settings.data_dir.display()
        );
    }
    Ok(dataset)
}

/// The normalization the settings ask for, if any.
pub fn normalization(settings: &DataSettings) -> Option<Normalize> {
    match (settings.mean, settings.std) {
        (Some(mean), Some(std)) => Some(Normalize {
            mean: mean.0,
            std: std.0,
        }),
        _ => None,
    }
}
