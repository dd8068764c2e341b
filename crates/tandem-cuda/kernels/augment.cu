// Training-image augmentation on the GPU: uint8 (or float) NHWC images -> pad-4 random crop +
// horizontal flip + normalize to float, with the SAME counter-based draws as the CPU loader
// (crates/tandem-data/src/rng.rs and transform.rs), so the same (seed, epoch, index) gives the
// same crop offset, flip and pixels on both devices. The value of a byte is
// (byte / 255 - mean[c]) / std[c] in float with IEEE division, as the CPU's byte table; that of
// a float is value * (1 / std[c]) + -mean[c] / std[c], as the CPU's scale and shift; a padding
// pixel is -mean[c] / std[c], as the CPU's shift. The outputs are bit-identical.
//
// Launch: augment_draws with one thread per sample; augment_apply (bytes) or augment_apply_f32
// (floats) with one thread per output value (batch * height * width * channels). The epoch is read from device memory (the
// executor's step-scalar buffer), so that a step captured as a CUDA graph replays with the
// next epoch's draws.

typedef unsigned long long u64;

// SplitMix64's increment and output function (rng.rs: GOLDEN_GAMMA, mix64).
#define GOLDEN_GAMMA 0x9e3779b97f4a7c15ULL
__device__ u64 mix64(u64 value) {
    value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ULL;
    value = (value ^ (value >> 27)) * 0x94d049bb133111ebULL;
    return value ^ (value >> 31);
}

// SampleRng::new(seed, stream, epoch, index): the stream's starting state.
__device__ u64 sample_rng(u64 seed, u64 stream, u64 epoch, u64 index) {
    u64 state = mix64(seed + GOLDEN_GAMMA);
    u64 words[3] = {stream, epoch, index};
    for (int k = 0; k < 3; k++) state = mix64(state ^ mix64(words[k] + GOLDEN_GAMMA));
    return state;
}

// SampleRng::next_u64.
__device__ u64 next_u64(u64* state) {
    *state += GOLDEN_GAMMA;
    return mix64(*state);
}

// SampleRng::below: uniform in 0..bound without modulo bias (rejection above the last whole zone).
__device__ u64 below(u64* state, u64 bound) {
    if (bound < 1) bound = 1;
    u64 zone = ~0ULL - ~0ULL % bound;
    for (;;) {
        u64 value = next_u64(state);
        if (value < zone) return value % bound;
    }
}

// The stream tag of augmentation draws (rng.rs: stream::AUGMENT).
#define STREAM_AUGMENT 1ULL

// Draw::for_sample: draws[3 * s] = top, [3 * s + 1] = left, [3 * s + 2] = flip (0 or 1) for
// the dataset image indices[s]. padding == 0: no crop draws; flip == 0: no flip draw.
extern "C" __global__ void augment_draws(const unsigned int* indices, int batch, u64 seed,
                                         const u64* epoch, int padding, int flip, int* draws) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= batch) return;
    u64 state = sample_rng(seed, STREAM_AUGMENT, *epoch, (u64)indices[s]);
    int top = 0, left = 0;
    if (padding > 0) {
        top = (int)below(&state, 2 * (u64)padding + 1);
        left = (int)below(&state, 2 * (u64)padding + 1);
    }
    int flipped = flip && (next_u64(&state) >> 63) == 1;
    draws[3 * s] = top;
    draws[3 * s + 1] = left;
    draws[3 * s + 2] = flipped;
}

// The CPU's value map (transform.rs: ValueMap): a byte through its byte table,
// (byte / 255 - mean) / std; a float (synthetic data) through its scale and shift,
// value * (1 / std) + (-mean / std), in that order and rounding (NVRTC runs with --fmad=false:
// no contraction).
__device__ float normalized(unsigned char byte, float mean, float std) {
    return ((float)byte / 255.0f - mean) / std;
}
__device__ float normalized(float value, float mean, float std) {
    return value * (1.0f / std) + -mean / std;
}

// transform_with_map: output[s, row, column, c] from images[indices[s]] (HWC), cropped at
// (top, left) of the zero-padded image, mirrored when flipped, normalized; a padding pixel is
// the CPU's shift, -mean / std.
template <typename Pixel>
__device__ void augment_pixels(const Pixel* images, const unsigned int* indices, const int* draws,
                               int batch, int height, int width, int channels, int padding,
                               const float* mean, const float* std, float* output) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long image_len = (long long)height * width * channels;
    if (i >= batch * image_len) return;
    int s = (int)(i / image_len);
    int within = (int)(i % image_len);
    int row = within / (width * channels);
    int column = within / channels % width;
    int c = within % channels;
    int m = c % 3;
    int top = draws[3 * s], left = draws[3 * s + 1], flipped = draws[3 * s + 2];
    int source_row = row + top - padding;
    int cropped_column = flipped ? width - 1 - column : column;
    int source_column = cropped_column + left - padding;
    if (source_row < 0 || source_row >= height || source_column < 0 || source_column >= width) {
        output[i] = -mean[m] / std[m];
        return;
    }
    long long offset = (long long)indices[s] * image_len +
                       ((long long)source_row * width + source_column) * channels + c;
    output[i] = normalized(images[offset], mean[m], std[m]);
}

// augment_pixels of uint8 images.
extern "C" __global__ void augment_apply(const unsigned char* images, const unsigned int* indices,
                                         const int* draws, int batch, int height, int width,
                                         int channels, int padding, const float* mean,
                                         const float* std, float* output) {
    augment_pixels(images, indices, draws, batch, height, width, channels, padding, mean, std,
                   output);
}

// augment_pixels of float images (synthetic data).
extern "C" __global__ void augment_apply_f32(const float* images, const unsigned int* indices,
                                             const int* draws, int batch, int height, int width,
                                             int channels, int padding, const float* mean,
                                             const float* std, float* output) {
    augment_pixels(images, indices, draws, batch, height, width, channels, padding, mean, std,
                   output);
}
