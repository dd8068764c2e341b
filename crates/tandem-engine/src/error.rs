//! Errors of the engine.

/// What can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The SyncBatchNorm reducer (an all-reduce across processes) failed.
    #[error("batch norm statistics all-reduce failed: {0}")]
    BatchNormSync(String),
    /// A statistic count is too small to normalize (e.g. a batch of one value per channel).
    #[error("batch norm needs more than one value per channel to normalize in training mode, got {count}")]
    BatchNormTooFewValues {
        /// The number of values per channel over the (global) batch.
        count: f64,
    },
    /// A label is not a class index.
    #[error("label {label} of sample {sample} is not a class index (0..{classes})")]
    InvalidLabel {
        /// The sample's position in the batch.
        sample: usize,
        /// Its label.
        label: u32,
        /// The number of classes.
        classes: usize,
    },
    /// An optimizer state to import lacks a slot that this optimizer keeps.
    #[error("optimizer state has no slot `{slot}` (it has: {present})")]
    MissingOptimizerSlot {
        /// The slot that is missing, e.g. `exp_avg`.
        slot: String,
        /// The slots that are present, comma-separated.
        present: String,
    },
    /// An optimizer state slot has a different length than the parameters.
    #[error("optimizer state slot `{slot}` has {found} values, expected {expected}")]
    OptimizerSlotLength {
        /// The slot name.
        slot: String,
        /// Its length in the imported state.
        found: usize,
        /// The number of parameters this optimizer updates.
        expected: usize,
    },
    /// An optimizer state holds a slot this optimizer does not know.
    #[error("optimizer state has an unknown slot `{slot}` (this optimizer keeps: {known})")]
    UnknownOptimizerSlot {
        /// The unexpected slot name.
        slot: String,
        /// The slots this optimizer keeps.
        known: String,
    },
}
