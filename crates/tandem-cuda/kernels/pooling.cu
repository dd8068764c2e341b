// Global average pooling of NHWC tensors, [batch, pixels, channels] -> [batch, channels], as
// crates/tandem-engine/src/head.rs: the pixels of each (image, channel) are added in pixel
// order in float, then multiplied by the float 1 / pixels, which is the CPU's order of
// operations exactly (bit-identical results).
//
// Launch: one thread per (image, channel), i.e. batch * channels threads.

extern "C" __global__ void average_pool_forward(const float* input, int batch, int pixels,
                                                int channels, float* output) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * channels) return;
    int image = i / channels, c = i % channels;
    const float* values = input + (long long)image * pixels * channels + c;
    float sum = 0.0f;
    for (int pixel = 0; pixel < pixels; pixel++) {
        sum += values[(long long)pixel * channels];
    }
    output[i] = sum * (1.0f / (float)pixels);
}

// Backward: every pixel of (image, channel) receives grad_output / pixels (as grad * (1 / pixels)).
// Launch: one thread per input element.
extern "C" __global__ void average_pool_backward(const float* grad_output, int batch, int pixels,
                                                 int channels, float* grad_input) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)batch * pixels * channels) return;
    int c = (int)(i % channels);
    long long image = i / ((long long)pixels * channels);
    grad_input[i] = grad_output[image * channels + c] * (1.0f / (float)pixels);
}
