// The exact sum of `--global-batch-size` on the device: tandem_dist::exact's block maxima,
// integer sums and write-back, bit for bit (tests/common/kernel_checks.rs compares them with
// the host functions). The spec, as the host computes it:
//
// - Values fall into blocks of EXACT_BLOCK. A block's key is the largest |value| over every
//   term (and, after NCCL's Max over int32, every rank) as its float bits with the sign bit
//   cleared: non-negative floats order as their bits, infinity is 0x7f800000 and any NaN lies
//   above it, so the integer maximum keeps a NaN (a float maximum need not).
// - A block's unit is 1 when its key is 0 or not finite, else 2^(e + 1 - (62 - b)), e the
//   binary exponent of the largest magnitude (as a double) and b = ceil(log2 total_terms).
// - A value becomes trunc(double(value) * (1 / unit)) as a long long, saturating, NaN giving
//   0 (Rust's `as`); a thread adds its element's integers over the terms in term order,
//   wrapping. NCCL's Sum over int64 then adds the ranks' sums: integers, so in any order.
// - A sum becomes float(double(sum) * unit), rounded to nearest; a block whose key is not
//   finite becomes NaN (0x7fc00000, Rust's f32::NAN).
//
// exact_unit mirrors the host's unit_of and exact_to_units its to_units: a change of the
// host's conversion changes these two, and the check of the kernels against the host
// (exact_sum_kernels_equal_tandem_dist_exact_bit_for_bit in gpu_kernels) fails until they do.
//
// The terms are `count` buffers of `n` floats, term k at `terms + k * stride`.

#define EXACT_BLOCK 64

// ceil(log2(total_terms)) for total_terms >= 1 (0 for one term).
__device__ __forceinline__ int exact_terms_bits(long long total_terms) {
    int bits = 0;
    while (bits < 62 && (1LL << bits) < total_terms) bits++;
    return bits;
}

// The unit of a block whose key is `key`, in a sum of 2^terms_bits terms at most.
__device__ __forceinline__ double exact_unit(int key, int terms_bits) {
    if (key <= 0 || key >= 0x7f800000) return 1.0;
    double largest = (double)__int_as_float(key);
    long long exponent = ((__double_as_longlong(largest) >> 52) & 0x7ff) - 1023;
    long long unit_exponent = exponent + 1 - (62 - terms_bits);
    return __longlong_as_double((unit_exponent + 1023) << 52);
}

// `value` as a whole number of units, `per_unit` of them to 1, truncated toward zero and
// saturating (a NaN gives 0).
__device__ __forceinline__ long long exact_to_units(float value, double per_unit) {
    double scaled = (double)value * per_unit;
    if (scaled != scaled) return 0;
    if (scaled >= 9223372036854775808.0) return 0x7fffffffffffffffLL;
    if (scaled <= -9223372036854775808.0) return -0x7fffffffffffffffLL - 1;
    return (long long)scaled;
}

// keys[b] = the largest magnitude of block b over the terms, as its bits (see above).
// Launch: one thread per block of EXACT_BLOCK values.
extern "C" __global__ void exact_block_maxima(const float* terms, long long stride, int count,
                                              long long n, int* keys) {
    long long block = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long start = block * EXACT_BLOCK;
    if (start >= n) return;
    long long end = start + EXACT_BLOCK < n ? start + EXACT_BLOCK : n;
    int key = 0;
    for (int k = 0; k < count; k++) {
        const float* term = terms + (long long)k * stride;
        for (long long i = start; i < end; i++) {
            int bits = __float_as_int(term[i]) & 0x7fffffff;
            key = bits > key ? bits : key;
        }
    }
    keys[block] = key;
}

// sums[i] = the sum over the terms of element i as whole numbers of its block's unit.
// Launch: one thread per element.
extern "C" __global__ void exact_integer_sums(const float* terms, long long stride, int count,
                                              long long n, const int* keys,
                                              long long total_terms, long long* sums) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double per_unit = 1.0 / exact_unit(keys[i / EXACT_BLOCK], exact_terms_bits(total_terms));
    unsigned long long sum = 0;
    for (int k = 0; k < count; k++) {
        sum += (unsigned long long)exact_to_units(terms[(long long)k * stride + i], per_unit);
    }
    sums[i] = (long long)sum;
}

// into[i] = sums[i] in units of its block, as a float; NaN in a block whose key is not
// finite. Launch: one thread per element.
extern "C" __global__ void exact_write_sums(const long long* sums, long long n, const int* keys,
                                            long long total_terms, float* into) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int key = keys[i / EXACT_BLOCK];
    if (key >= 0x7f800000) {
        into[i] = __int_as_float(0x7fc00000);
        return;
    }
    into[i] = (float)((double)sums[i] * exact_unit(key, exact_terms_bits(total_terms)));
}
