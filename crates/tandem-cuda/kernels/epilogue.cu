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

// residual_kind: 0 none, 1 identity shortcut s, 2 normalized shortcut s * scale2 + shift2.
// x, s and out are activations (bn_apply: float32, bn_apply_bf16: bfloat16).
#define BN_APPLY_PARAMS(Act)                                                                   \
    const Act *x, const float *scale, const float *shift, const Act *s, const float *scale2,   \
        const float *shift2, int residual_kind, int relu, long long n, int channels, Act *out
#define BN_APPLY_ARGS x, scale, shift, s, scale2, shift2, residual_kind, relu, n, channels, out

template <typename Act>
__device__ void bn_apply_body(BN_APPLY_PARAMS(Act)) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int c = channel_of(i, n, channels);
    float value = as_float(x[i]) * scale[c] + shift[c];
    if (residual_kind == 1) {
        value = value + as_float(s[i]);
    } else if (residual_kind == 2) {
        value = value + (as_float(s[i]) * scale2[c] + shift2[c]);
    }
    // fmaxf(value, 0) as Rust's f32::max(0.0): a NaN input gives 0 in both.
    store(out, i, relu ? fmaxf(value, 0.0f) : value);
}

extern "C" __global__ void bn_apply(BN_APPLY_PARAMS(float)) {
    bn_apply_body(BN_APPLY_ARGS);
}

extern "C" __global__ void bn_apply_bf16(BN_APPLY_PARAMS(bf16_bits)) {
    bn_apply_body(BN_APPLY_ARGS);
}

// ReLU backward given the ReLU's output: grad_in = grad_out where out > 0, else 0. This is the
// gradient of an identity shortcut (the shortcut's value entered the sum before the ReLU).
// All three are activations.
template <typename Act>
__device__ void relu_backward_body(const Act* grad_out, const Act* relu_out, long long n,
                                   Act* grad_in) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    grad_in[i] = as_float(relu_out[i]) > 0.0f ? grad_out[i] : (Act)0;
}

extern "C" __global__ void relu_backward(const float* grad_out, const float* relu_out,
                                         long long n, float* grad_in) {
    relu_backward_body(grad_out, relu_out, n, grad_in);
}

extern "C" __global__ void relu_backward_bf16(const bf16_bits* grad_out,
                                              const bf16_bits* relu_out, long long n,
                                              bf16_bits* grad_in) {
    relu_backward_body(grad_out, relu_out, n, grad_in);
}
