// What every kernel file shares, prepended to each by tandem-cuda (src/kernels.rs) and by the
// fake GPU's build: the element types of activations and the channel of an NHWC element.
//
// Activations (a layer's outputs, their gradients) are float32 in memory, or under
// --precision bf16 bfloat16, as PyTorch autocast keeps them. bfloat16 is float32's upper 16
// bits, held as `bf16_bits` (no cuda_bf16.h needed). The kernels that read or write
// activations are written once as templates over the element type and compute in float;
// each has a float32 entry point and a `_bf16` one.
//
// Narrowing rounds to nearest, ties to even, on the bits (integer arithmetic only, so it is
// exact and the same on every GPU and on the host: tandem_cuda::bf16::f32_to_bf16_bits is its
// reference): finite values past the largest bfloat16 round to infinity, subnormals round as
// any other value (no flush to zero), a NaN stays a NaN (its sign and upper payload kept, the
// quiet bit set, so a NaN whose payload lies in the dropped bits does not become infinity).
// Widening is exact: the bits shifted up.

typedef unsigned short bf16_bits;

__device__ __forceinline__ bf16_bits narrow_bits(float value) {
    unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_bits)((bits >> 16) | 0x0040u);
    }
    unsigned int lsb = (bits >> 16) & 1u;
    return (bf16_bits)((bits + 0x7fffu + lsb) >> 16);
}

__device__ __forceinline__ float widen_bits(bf16_bits bits) {
    return __uint_as_float((unsigned int)bits << 16);
}

// An activation as float.
__device__ __forceinline__ float as_float(float value) { return value; }
__device__ __forceinline__ float as_float(bf16_bits bits) { return widen_bits(bits); }

// Stores a float as an activation (rounded to nearest even in bfloat16).
__device__ __forceinline__ void store(float* to, long long i, float value) { to[i] = value; }
__device__ __forceinline__ void store(bf16_bits* to, long long i, float value) {
    to[i] = narrow_bits(value);
}

// The channel of element i of an NHWC tensor of n elements, in 32-bit arithmetic whenever n
// allows: a 64-bit remainder is a long instruction sequence on the GPU, and the element-wise
// kernels have little else to do per element.
__device__ __forceinline__ int channel_of(long long i, long long n, int channels) {
    return n <= 0xffffffffLL ? (int)((unsigned int)i % (unsigned int)channels)
                             : (int)(i % channels);
}

