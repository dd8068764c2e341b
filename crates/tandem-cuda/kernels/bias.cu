// Per-channel biases over NHWC [rows, channels] tensors: a convolution's bias and the linear
// layer's (its logits are [batch, classes]).
//
// The forward adds the bias after the product (cuDNN and cuBLAS compute the product alone).
// The CPU engine may add it in a different place of its float sums, so outputs agree with the
// CPU's to rounding, not bit for bit.
//
// The bias gradient is the column sum of the output gradient. It is taken by bn_stats
// (batchnorm.cu) in its fixed order, in double, then added here:
// grad_bias[c] += (float)totals[1 + c], totals as bn_stats writes them.
//
// Launch: bias_add(_bf16) with one thread per element; add_channel_sums with one thread per
// channel.

// x (activations, or the logits: float32) += bias per channel.
template <typename Act>
__device__ void bias_add_body(Act* x, const float* bias, long long n, int channels) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    store(x, i, as_float(x[i]) + bias[channel_of(i, n, channels)]);
}

extern "C" __global__ void bias_add(float* x, const float* bias, long long n, int channels) {
    bias_add_body(x, bias, n, channels);
}

extern "C" __global__ void bias_add_bf16(bf16_bits* x, const float* bias, long long n,
                                         int channels) {
    bias_add_body(x, bias, n, channels);
}

extern "C" __global__ void add_channel_sums(const double* totals, int channels,
                                            float* grad_bias) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    grad_bias[c] += (float)totals[1 + c];
}
