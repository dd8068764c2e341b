// The fused epilogue of a convolution + batch norm unit: apply the batch norm's per-channel
// scale and shift, add the residual, then the ReLU, in one pass over NHWC [rows, channels]:
//
//   out = [relu](x * scale + shift [+ s | + (s * scale2 + shift2)])
//
// with the CPU engine's float operations in its order (crates/tandem-engine/src/batchnorm.rs,
// apply_*): NVRTC compiles with --fmad=false, so no multiply-add is contracted and the results
// are bit-identical to the CPU's.
//
// The backward of the epilogue is the batch-norm backward (batchnorm.cu) given the ReLU's
// output, plus relu_backward below for the gradient of an identity shortcut.
//
// Launch: one thread per element.

// The channel of element i of an NHWC tensor of n elements, in 32-bit arithmetic whenever n
// allows: a 64-bit remainder is a long instruction sequence on the GPU, and this kernel has
// little else to do per element.
__device__ __forceinline__ int channel_of(long long i, long long n, int channels) {
    return n <= 0xffffffffLL ? (int)((unsigned int)i % (unsigned int)channels)
                             : (int)(i % channels);
}

// residual_kind: 0 none, 1 identity shortcut s, 2 normalized shortcut s * scale2 + shift2.
extern "C" __global__ void bn_apply(const float* x, const float* scale, const float* shift,
                                    const float* s, const float* scale2, const float* shift2,
                                    int residual_kind, int relu, long long n, int channels,
                                    float* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int c = channel_of(i, n, channels);
    float value = x[i] * scale[c] + shift[c];
    if (residual_kind == 1) {
        value = value + s[i];
    } else if (residual_kind == 2) {
        value = value + (s[i] * scale2[c] + shift2[c]);
    }
    // fmaxf(value, 0) as Rust's f32::max(0.0): a NaN input gives 0 in both.
    out[i] = relu ? fmaxf(value, 0.0f) : value;
}

// ReLU backward given the ReLU's output: grad_in = grad_out where out > 0, else 0. This is the
// gradient of an identity shortcut (the shortcut's value entered the sum before the ReLU).
extern "C" __global__ void relu_backward(const float* grad_out, const float* relu_out,
                                         long long n, float* grad_in) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    grad_in[i] = relu_out[i] > 0.0f ? grad_out[i] : 0.0f;
}
