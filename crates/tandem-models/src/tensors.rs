//! The table of named views into a model's flat buffers.

/// What a `state_dict` entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A learned parameter: lives in `params` (and its gradient in `grads`).
    Param,
    /// A batch-norm running statistic: lives in `buffers`.
    Buffer,
    /// A batch-norm `num_batches_tracked` (int64 scalar): see `Model::num_batches_tracked`.
    BatchCount,
}

/// How a tensor's values are ordered inside the flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageLayout {
    /// The same row-major order as PyTorch's shape.
    Plain,
    /// A convolution weight stored `[out, kh, kw, in]` (OHWI) while PyTorch's shape is OIHW.
    ConvOhwi,
}

/// One `state_dict` entry and where its values live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// PyTorch `state_dict` key.
    pub name: String,
    /// PyTorch shape (e.g. OIHW for convolution weights; `[]` for `num_batches_tracked`).
    pub shape: Vec<usize>,
    /// Which buffer holds it.
    pub kind: TensorKind,
    /// Offset in the buffer of its kind (0 for `BatchCount`).
    pub offset: usize,
    /// Number of values (0 for `BatchCount`).
    pub len: usize,
    /// Order of the values inside the buffer.
    pub layout: StorageLayout,
}

impl TensorInfo {
    /// The buffer range holding this tensor.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// Where each element of a channels-first tensor of shape `[n, c, h, w]`, taken in
/// row-major order, stands in the same tensor stored channels-last (`[n, h, w, c]`).
pub fn channels_last_indices(shape: [usize; 4]) -> impl Iterator<Item = usize> {
    let [batch, channels, height, width] = shape;
    (0..batch).flat_map(move |n| {
        (0..channels).flat_map(move |c| {
            (0..height).flat_map(move |h| {
                (0..width).map(move |w| ((n * height + h) * width + w) * channels + c)
            })
        })
    })
}

/// Converts stored values to PyTorch's row-major order for `shape`.
pub(crate) fn to_pytorch_order(layout: StorageLayout, shape: &[usize], stored: &[f32]) -> Vec<f32> {
    match (layout, shape) {
        (StorageLayout::ConvOhwi, &[out, inp, kh, kw]) => channels_last_indices([out, inp, kh, kw])
            .map(|index| stored[index])
            .collect(),
        _ => stored.to_vec(),
    }
}

/// Writes values given in PyTorch's row-major order for `shape` into `stored`.
pub(crate) fn from_pytorch_order(
    layout: StorageLayout,
    shape: &[usize],
    values: &[f32],
    stored: &mut [f32],
) {
    match (layout, shape) {
        (StorageLayout::ConvOhwi, &[out, inp, kh, kw]) => {
            for (&value, index) in values.iter().zip(channels_last_indices([out, inp, kh, kw])) {
                stored[index] = value;
            }
        }
        _ => stored.copy_from_slice(values),
    }
}
