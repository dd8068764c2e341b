//! Shapes of the layers: plain data that every executor (the CPU kernels here, a GPU
//! executor elsewhere) reads. A leaf: it imports no kernel module.

/// The sizes of one convolution applied to one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dShape {
    /// Images in the batch.
    pub batch: usize,
    /// Input height.
    pub in_height: usize,
    /// Input width.
    pub in_width: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel height and width.
    pub kernel: usize,
    /// Stride on both axes.
    pub stride: usize,
    /// Zero padding on each of the four sides.
    pub padding: usize,
}

impl Conv2dShape {
    /// The convolution of `batch` images of `size` (height, width) from `channels.0` to
    /// `channels.1` channels, with a square `kernel`, `stride` and `padding`.
    pub fn new(
        batch: usize,
        size: (usize, usize),
        channels: (usize, usize),
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Self {
        Conv2dShape {
            batch,
            in_height: size.0,
            in_width: size.1,
            in_channels: channels.0,
            out_channels: channels.1,
            kernel,
            stride,
            padding,
        }
    }

    /// Output `(height, width)`, or `None` when the kernel does not fit the padded input
    /// or the stride is zero.
    pub fn output_size(&self) -> Option<(usize, usize)> {
        if self.stride == 0 || self.kernel == 0 {
            return None;
        }
        let padded_height = self.in_height + 2 * self.padding;
        let padded_width = self.in_width + 2 * self.padding;
        if padded_height < self.kernel || padded_width < self.kernel {
            return None;
        }
        Some((
            (padded_height - self.kernel) / self.stride + 1,
            (padded_width - self.kernel) / self.stride + 1,
        ))
    }

    /// Output height (0 when the kernel does not fit).
    pub fn out_height(&self) -> usize {
        self.output_size().map_or(0, |size| size.0)
    }

    /// Output width (0 when the kernel does not fit).
    pub fn out_width(&self) -> usize {
        self.output_size().map_or(0, |size| size.1)
    }

    /// Values in one patch: `kernel * kernel * in_channels`.
    pub fn patch_len(&self) -> usize {
        self.kernel * self.kernel * self.in_channels
    }

    /// Values in the weight tensor.
    pub fn weight_len(&self) -> usize {
        self.out_channels * self.patch_len()
    }

    /// Values in the input tensor.
    pub fn input_len(&self) -> usize {
        self.batch * self.input_image_len()
    }

    /// Values in the output tensor.
    pub fn output_len(&self) -> usize {
        self.batch * self.output_image_len()
    }

    /// Values in one input image.
    pub fn input_image_len(&self) -> usize {
        self.in_height * self.in_width * self.in_channels
    }

    /// Values in one output image.
    pub fn output_image_len(&self) -> usize {
        self.out_height() * self.out_width() * self.out_channels
    }

    /// Pixels in one output image.
    pub fn output_pixels(&self) -> usize {
        self.out_height() * self.out_width()
    }

    /// A 1x1, stride-1, unpadded convolution needs no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.padding == 0
    }

    /// Panics unless the kernel fits and `input`, `weight` and the output (`output_len`
    /// values) have this shape's lengths.
    pub fn check_lengths(&self, input: &[f32], weight: &[f32], output_len: usize) {
        assert!(
            self.output_size().is_some(),
            "conv2d: kernel does not fit {self:?}"
        );
        assert_eq!(
            input.len(),
            self.input_len(),
            "conv2d: input length for {self:?}"
        );
        assert_eq!(
            weight.len(),
            self.weight_len(),
            "conv2d: weight length for {self:?}"
        );
        assert_eq!(
            output_len,
            self.output_len(),
            "conv2d: output length for {self:?}"
        );
    }
}
