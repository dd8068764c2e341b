// float32 <-> bfloat16 for the bf16 precision's convolutions and linear layer (PyTorch
// autocast's rules): activations, weights and gradients stay float32 in memory; each
// convolution and GEMM narrows its operands to bfloat16 scratch buffers and its bfloat16
// result is widened back here.
//
// bfloat16 is float32's upper 16 bits, held as `unsigned short` (no cuda_bf16.h needed).
// Narrowing rounds to nearest, ties to even, on the bits (integer arithmetic only, so it is
// exact and the same on every GPU and on the host: tandem_cuda::bf16::f32_to_bf16_bits is its
// reference): finite values past the largest bfloat16 round to infinity, subnormals round as
// any other value (no flush to zero), a NaN stays a NaN (its sign and upper payload kept, the
// quiet bit set, so a NaN whose payload lies in the dropped bits does not become infinity).
// Widening is exact: the bits shifted up.
//
// Launch: one thread per element.

__device__ __forceinline__ unsigned short narrow_bits(float value) {
    unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((bits >> 16) | 0x0040u);
    }
    unsigned int lsb = (bits >> 16) & 1u;
    return (unsigned short)((bits + 0x7fffu + lsb) >> 16);
}

__device__ __forceinline__ float widen_bits(unsigned short bits) {
    return __uint_as_float((unsigned int)bits << 16);
}

// y[i] = bfloat16(x[i]).
extern "C" __global__ void float_to_bf16(const float* x, long long n, unsigned short* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = narrow_bits(x[i]);
}

// y[i] = float(x[i]), exactly.
extern "C" __global__ void bf16_to_float(const unsigned short* x, long long n, float* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = widen_bits(x[i]);
}

// y[i] += float(x[i]): a bfloat16 gradient added into a float32 one (the weight gradient's
// accumulation over micro-batches, an input gradient that accumulates).
extern "C" __global__ void bf16_add_to_float(const unsigned short* x, long long n, float* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = y[i] + widen_bits(x[i]);
}
