//! What the trainer tells the training device about its data sets, and what it says about
//! how the device ran its steps: the uploads of the training and test sets, and the notes on
//! CUDA graphs, each printed once.

use tandem_data::{Augment, Dataset, Normalize, Pixels};
use tandem_models::training_device::{
    DatasetUpload, StepConditions, StepReport, StepRun, UploadPixels, Uploaded, WholeSteps,
};
use tandem_models::TrainingDevice;

/// `dataset` with `augment`, `normalize` and `seed` for the device's batch assembly, as the
/// CPU loader would draw and normalize its batches. Synthetic images are made into `made`.
pub fn dataset_upload<'a>(
    dataset: &'a Dataset,
    made: &'a mut Option<Vec<f32>>,
    augment: Option<Augment>,
    normalize: Option<Normalize>,
    seed: u64,
) -> DatasetUpload<'a> {
    let pixels = match &dataset.images {
        Pixels::U8(bytes) => UploadPixels::U8(bytes),
        Pixels::F32(floats) => UploadPixels::F32(floats),
        Pixels::Synthetic(synthetic) => UploadPixels::F32(made.insert(synthetic.make_all())),
    };
    let augment = augment.unwrap_or_default();
    let normalize = normalize.unwrap_or(Normalize {
        mean: [0.0; 3],
        std: [1.0; 3],
    });
    DatasetUpload {
        pixels,
        len: dataset.len(),
        height: dataset.height,
        width: dataset.width,
        channels: dataset.channels,
        crop_padding: augment.random_crop_padding.unwrap_or(0),
        horizontal_flip: augment.horizontal_flip,
        mean: normalize.mean,
        std: normalize.std,
        seed,
    }
}

/// The bytes a data set put in device memory, or `None` where its batches stay on the host
/// (with a note when it was too large for the device).
pub fn uploaded_bytes(uploaded: Uploaded) -> Option<usize> {
    match uploaded {
        Uploaded::OnDevice(bytes) => Some(bytes),
        Uploaded::OnHost => None,
        Uploaded::TooLarge { bytes, free } => {
            tell!(
                "note: the data set's {:.1} MB of pixels are more than half the GPU's {:.1} MB \
                 of free memory; its batches are assembled on the host",
                bytes as f64 / 1e6,
                free as f64 / 1e6
            );
            None
        }
    }
}

/// The notes on CUDA graphs a run prints.
#[derive(Default)]
pub struct StepNotes {
    /// Whether the note saying why CUDA graphs are off was printed.
    graphs_off_noted: bool,
}

impl StepNotes {
    /// Whether a step of `conditions` runs as one [`TrainingDevice::train_step`] on
    /// `device`; the first step that does not on a GPU prints why it is not captured: the
    /// strategy's `own_reason` when it has one, else the device's.
    pub fn whole_steps(
        &mut self,
        device: &dyn TrainingDevice,
        conditions: &StepConditions,
        own_reason: Option<&str>,
    ) -> bool {
        match device.whole_steps(conditions) {
            WholeSteps::Yes => true,
            WholeSteps::No => false,
            WholeSteps::NoBecause(reason) => {
                self.graphs_off(own_reason.unwrap_or(&reason));
                false
            }
        }
    }

    /// The notes of a whole step of `count` micro-batches of `batch` images of `height x
    /// width`: graphs turned off (once), relaxed capture, and a captured graph's shape.
    pub fn after_step(
        &mut self,
        report: &StepReport,
        count: usize,
        batch: usize,
        height: usize,
        width: usize,
    ) {
        if let Some(reason) = &report.graphs_off {
            self.graphs_off(reason);
        }
        if let Some(reason) = &report.relaxed_capture {
            tell!(
                "note: CUDA graphs are captured in relaxed mode: the thread-local capture was \
                 refused ({reason})"
            );
        }
        if report.run == Some(StepRun::Capture) {
            let shape = match count {
                1 => format!("{batch} images of {height}x{width}"),
                _ => format!("{count} micro-batches of {batch} images of {height}x{width}"),
            };
            tell!("note: CUDA graphs on: training steps of {shape} replay one captured graph");
        }
    }

    /// Prints `note: CUDA graphs off: {reason}` unless it was printed.
    fn graphs_off(&mut self, reason: &str) {
        if !self.graphs_off_noted {
            tell!("note: CUDA graphs off: {reason}");
            self.graphs_off_noted = true;
        }
    }
}
