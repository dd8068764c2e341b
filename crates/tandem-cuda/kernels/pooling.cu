// Global average pooling of NHWC tensors, [batch, pixels, channels] -> [batch, channels], as
// crates/tandem-engine/src/head.rs: the pixels of each (image, channel) are added in pixel
// order in float, then multiplied by the float 1 / pixels, which is the CPU's order of
// operations exactly (bit-identical results). The features and their gradient are
// activations (float32, or bfloat16 in the `_bf16` kernels); the pooled values and their
// gradient are float32.
//
// Launch: forward with one thread per (image, channel), i.e. batch * channels threads;
// backward with one thread per input element.

template <typename Act>
__device__ void average_pool_forward_body(const Act* input, int batch, int pixels, int channels,
                                          float* output) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * channels) return;
    int image = i / channels, c = i % channels;
    const Act* values = input + (long long)image * pixels * channels + c;
    float sum = 0.0f;
    for (int pixel = 0; pixel < pixels; pixel++) {
        sum += as_float(values[(long long)pixel * channels]);
    }
    output[i] = sum * (1.0f / (float)pixels);
}

extern "C" __global__ void average_pool_forward(const float* input, int batch, int pixels,
                                                int channels, float* output) {
    average_pool_forward_body(input, batch, pixels, channels, output);
}

extern "C" __global__ void average_pool_forward_bf16(const bf16_bits* input, int batch,
                                                     int pixels, int channels, float* output) {
    average_pool_forward_body(input, batch, pixels, channels, output);
}

// Backward: every pixel of (image, channel) receives grad_output / pixels (as grad * (1 / pixels)).
template <typename Act>
__device__ void average_pool_backward_body(const float* grad_output, int batch, int pixels,
                                           int channels, Act* grad_input) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long n = (long long)batch * pixels * channels;
    if (i >= n) return;
    int c = channel_of(i, n, channels);
    long long image = i / ((long long)pixels * channels);
    store(grad_input, i, grad_output[image * channels + c] * (1.0f / (float)pixels));
}

extern "C" __global__ void average_pool_backward(const float* grad_output, int batch, int pixels,
                                                 int channels, float* grad_input) {
    average_pool_backward_body(grad_output, batch, pixels, channels, grad_input);
}

extern "C" __global__ void average_pool_backward_bf16(const float* grad_output, int batch,
                                                      int pixels, int channels,
                                                      bf16_bits* grad_input) {
    average_pool_backward_body(grad_output, batch, pixels, channels, grad_input);
}
