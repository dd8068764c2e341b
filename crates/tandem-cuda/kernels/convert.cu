// float32 <-> bfloat16 for the bf16 precision (PyTorch autocast's rules): the images and the
// weights are narrowed for cuDNN and cuBLAS, the weight gradients and the linear layer's
// results widened back into float32.
//
// The rounding is the prelude's narrow_bits (activations.cuh); widening is exact.
//
// Launch: one thread per element.

// y[i] = bfloat16(x[i]).
extern "C" __global__ void float_to_bf16(const float* x, long long n, bf16_bits* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = narrow_bits(x[i]);
}

// y[i] = float(x[i]), exactly.
extern "C" __global__ void bf16_to_float(const bf16_bits* x, long long n, float* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = widen_bits(x[i]);
}

// y[i] += float(x[i]): a bfloat16 gradient added into a float32 one (the weight gradient's
// accumulation over micro-batches, an input gradient that accumulates).
extern "C" __global__ void bf16_add_to_float(const bf16_bits* x, long long n, float* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = y[i] + widen_bits(x[i]);
}
