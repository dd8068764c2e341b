// Batch normalization over NHWC tensors, viewed as [rows, channels] (rows = batch*height*width),
// with PyTorch BatchNorm2d semantics, as crates/tandem-engine/src/batchnorm.rs computes them.
//
// Every sum that reaches the weights is taken in a FIXED order, with no floating-point atomics,
// in ONE launch per sum (a small layer's step is a chain of short kernels, so each launch saved
// is latency saved):
//   pass 1: block (row block, channel group) sums its rows in double, each thread over rows
//           ty, ty + ROW_LANES, ... in order; the ROW_LANES lanes are then added in lane order
//           into one partial per (row block, channel), written to `partials`;
//   pass 2: the LAST row block of a channel group to write its partials (counted in
//           `arrivals`, one counter per channel group) adds the group's partials: lane ty adds
//           those of row blocks ty, ty + ROW_LANES, ... in order, and the lanes are added in
//           lane order, as in pass 1 (one thread per channel looping over every row block
//           would wait on one load after another: 512 of them for a 32x32 layer at batch 128).
//           Which block comes last changes who adds, never the order of the additions.
// The result depends only on the shape and the launch's rows_per_block, never on scheduling.
// The CPU engine splits rows by worker thread instead, so the two devices agree to rounding of
// the double sums (about 1e-16 relative), not bit for bit.
//
// Without SyncBatchNorm the last block also turns the totals into the per-channel coefficients
// (forward: mean, invstd, scale, shift and the running statistics; backward: the input
// gradient's coefficients), so a unit's statistics are one launch. With it, the totals are
// all-reduced across processes first and the coefficients are a launch of their own
// (bn_train_coefficients, bn_backward_coefficients), computed by the same functions.
//
// Layouts, shared with the CPU engine so the same SyncBatchNorm all-reduce applies:
//   forward totals:  [count, sum x per channel..., sum x^2 per channel...]   (double)
//   backward totals: [sum dy per channel..., sum dy*xhat per channel...]     (double)
//
// Launch: the sums with blockDim (CHANNEL_LANES, ROW_LANES), gridDim (ceil(rows /
// rows_per_block), ceil(channels / CHANNEL_LANES)): the row blocks on x, whose limit is 2^31 - 1
// blocks rather than y's 65,535; `arrivals` holds gridDim.y zeros before the launch and holds
// them again after it. Per-channel kernels with one thread per channel.

#define CHANNEL_LANES 32
#define ROW_LANES 8

// PyTorch's defaults.
#define BN_EPS 1e-5
#define BN_MOMENTUM 0.1

// Adds the ROW_LANES lane sums of this block's channel column in lane order (lane 0 writes).
__device__ double sum_row_lanes(double value, double lanes[ROW_LANES][CHANNEL_LANES]) {
    lanes[threadIdx.y][threadIdx.x] = value;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.y == 0) {
        for (int lane = 0; lane < ROW_LANES; lane++) {
            total += lanes[lane][threadIdx.x];
        }
    }
    __syncthreads();
    return total;
}

// Writes this block's two partials of channel c (lane 0 holds them) and returns whether the
// block is the last of its channel group to do so. Every thread fences its own writes before
// the barrier, one thread counts the block in, and the last block fences again before reading
// the others' partials (with __ldcg, past its own L1), the release/acquire pattern of the CUDA
// programming guide's last-block sum. The last block sets the counter back to zero.
__device__ bool write_partials(double first, double second, int c, int channels,
                               double* partials, unsigned int* arrivals) {
    __shared__ int is_last;
    if (threadIdx.y == 0 && c < channels) {
        double* out = partials + (long long)blockIdx.x * 2 * channels;
        out[c] = first;
        out[channels + c] = second;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        unsigned int arrived = atomicAdd(&arrivals[blockIdx.y], 1u);
        is_last = arrived == gridDim.x - 1;
        if (is_last) arrivals[blockIdx.y] = 0u;
    }
    __syncthreads();
    bool last = is_last != 0;
    if (last) __threadfence();
    return last;
}

// Pass 2 for channel c in the last block: the row blocks' two partials added in the fixed
// order of the header; lane 0 (threadIdx.y == 0) gets the totals.
__device__ void add_partials(const double* partials, int row_blocks, int c, int channels,
                             double lanes[ROW_LANES][CHANNEL_LANES], double* first,
                             double* second) {
    double sum_first = 0.0, sum_second = 0.0;
    if (c < channels) {
        for (int block = threadIdx.y; block < row_blocks; block += ROW_LANES) {
            sum_first += __ldcg(&partials[(long long)block * 2 * channels + c]);
            sum_second += __ldcg(&partials[(long long)block * 2 * channels + channels + c]);
        }
    }
    *first = sum_row_lanes(sum_first, lanes);
    *second = sum_row_lanes(sum_second, lanes);
}

// Training-mode coefficients of channel c from its totals, in double as the CPU's
// train_statistics_from_sums: batch mean and biased variance normalize; the running statistics
// take the unbiased variance. Writes mean, invstd, scale = weight*invstd and
// shift = bias - mean*scale (all float) and updates running_mean/running_var in place.
__device__ void train_coefficients(int c, double count, double sum, double sum_sq,
                                   const float* weight, const float* bias, float* running_mean,
                                   float* running_var, float* mean_out, float* invstd_out,
                                   float* scale_out, float* shift_out) {
    double mean = sum / count;
    double variance = fmax(sum_sq / count - mean * mean, 0.0);
    double invstd = 1.0 / sqrt(variance + BN_EPS);
    double unbiased = variance * count / (count - 1.0);
    running_mean[c] = (float)((1.0 - BN_MOMENTUM) * (double)running_mean[c] + BN_MOMENTUM * mean);
    running_var[c] = (float)((1.0 - BN_MOMENTUM) * (double)running_var[c] + BN_MOMENTUM * unbiased);
    double scale = (double)weight[c] * invstd;
    mean_out[c] = (float)mean;
    invstd_out[c] = (float)invstd;
    scale_out[c] = (float)scale;
    shift_out[c] = (float)((double)bias[c] - mean * scale);
}

// The statistics of x in one launch: totals = [rows, sum x..., sum x^2...] and, unless weight
// is null (SyncBatchNorm: the totals are all-reduced before bn_train_coefficients), the
// training coefficients of train_coefficients from them. The caller checks rows > 1 on the
// host (the CPU returns BatchNormTooFewValues). x holds activations (bn_stats: float32,
// bn_stats_bf16: bfloat16).
#define BN_STATS_PARAMS(Act)                                                                   \
    const Act *x, int rows, int channels, int rows_per_block, double *partials,                \
        unsigned int *arrivals, double *totals, const float *weight, const float *bias,        \
        float *running_mean, float *running_var, float *mean_out, float *invstd_out,           \
        float *scale_out, float *shift_out
#define BN_STATS_ARGS                                                                          \
    x, rows, channels, rows_per_block, partials, arrivals, totals, weight, bias, running_mean, \
        running_var, mean_out, invstd_out, scale_out, shift_out

template <typename Act>
__device__ void bn_stats_body(BN_STATS_PARAMS(Act), double lanes[ROW_LANES][CHANNEL_LANES]) {
    int c = blockIdx.y * CHANNEL_LANES + threadIdx.x;
    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    double sum = 0.0, sum_sq = 0.0;
    if (c < channels) {
        for (int row = first + threadIdx.y; row < last; row += ROW_LANES) {
            double value = (double)as_float(x[(long long)row * channels + c]);
            sum += value;
            sum_sq += value * value;
        }
    }
    sum = sum_row_lanes(sum, lanes);
    sum_sq = sum_row_lanes(sum_sq, lanes);
    if (!write_partials(sum, sum_sq, c, channels, partials, arrivals)) return;
    add_partials(partials, gridDim.x, c, channels, lanes, &sum, &sum_sq);
    if (threadIdx.y != 0 || c >= channels) return;
    if (c == 0) totals[0] = (double)rows;
    totals[1 + c] = sum;
    totals[1 + channels + c] = sum_sq;
    if (weight != nullptr) {
        train_coefficients(c, (double)rows, sum, sum_sq, weight, bias, running_mean, running_var,
                           mean_out, invstd_out, scale_out, shift_out);
    }
}

extern "C" __global__ void bn_stats(BN_STATS_PARAMS(float)) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    bn_stats_body(BN_STATS_ARGS, lanes);
}

extern "C" __global__ void bn_stats_bf16(BN_STATS_PARAMS(bf16_bits)) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    bn_stats_body(BN_STATS_ARGS, lanes);
}

// Training-mode coefficients from the all-reduced totals of bn_stats (SyncBatchNorm).
extern "C" __global__ void bn_train_coefficients(const double* totals, int channels,
                                                 const float* weight, const float* bias,
                                                 float* running_mean, float* running_var,
                                                 float* mean_out, float* invstd_out,
                                                 float* scale_out, float* shift_out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    train_coefficients(c, totals[0], totals[1 + c], totals[1 + channels + c], weight, bias,
                       running_mean, running_var, mean_out, invstd_out, scale_out, shift_out);
}

// Eval-mode coefficients from the running statistics, as the CPU's eval_statistics.
extern "C" __global__ void bn_eval_coefficients(int channels, const float* weight,
                                                const float* bias, const float* running_mean,
                                                const float* running_var, float* invstd_out,
                                                float* scale_out, float* shift_out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    double invstd = 1.0 / sqrt((double)running_var[c] + BN_EPS);
    double scale = (double)weight[c] * invstd;
    invstd_out[c] = (float)invstd;
    scale_out[c] = (float)scale;
    shift_out[c] = (float)((double)bias[c] - (double)running_mean[c] * scale);
}

// The gradient a following ReLU let through: zero where its output is not positive.
// relu_out == nullptr: no ReLU followed.
template <typename Act>
__device__ float masked(float dy, const Act* relu_out, long long i) {
    return (relu_out != nullptr && as_float(relu_out[i]) <= 0.0f) ? 0.0f : dy;
}

// Coefficients of the input gradient of channel c from its backward totals:
// coefficients = [gain = weight*invstd..., mean dy..., mean dy*xhat...] (float).
__device__ void backward_coefficients(int c, double count, int channels, double sum_dy,
                                      double sum_dy_xhat, const float* weight,
                                      const float* invstd, float* coefficients) {
    coefficients[c] = weight[c] * invstd[c];
    coefficients[channels + c] = (float)(sum_dy / count);
    coefficients[2 * channels + c] = (float)(sum_dy_xhat / count);
}

// The backward sums in one launch: totals = [sum dy..., sum dy*xhat...] with
// xhat = (x - mean) * invstd computed in float as the CPU does and dy masked by the ReLU; the
// local sums added to the parameter gradients (grad_bias += sum dy, grad_weight += sum
// dy*xhat) before any all-reduce of the totals, as the CPU does; and, unless coefficients is
// null (SyncBatchNorm: the totals are all-reduced before bn_backward_coefficients), the input
// gradient's coefficients over `count` values. dy, relu_out and x are activations.
#define BN_BACKWARD_SUMS_PARAMS(Act)                                                           \
    const Act *dy, const Act *relu_out, const Act *x, const float *mean, const float *invstd,  \
        int rows, int channels, int rows_per_block, double *partials, unsigned int *arrivals,  \
        double *totals, float *grad_weight, float *grad_bias, double count,                    \
        const float *weight, float *coefficients
#define BN_BACKWARD_SUMS_ARGS                                                                  \
    dy, relu_out, x, mean, invstd, rows, channels, rows_per_block, partials, arrivals, totals, \
        grad_weight, grad_bias, count, weight, coefficients

template <typename Act>
__device__ void bn_backward_sums_body(BN_BACKWARD_SUMS_PARAMS(Act),
                                      double lanes[ROW_LANES][CHANNEL_LANES]) {
    int c = blockIdx.y * CHANNEL_LANES + threadIdx.x;
    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    if (c < channels) {
        for (int row = first + threadIdx.y; row < last; row += ROW_LANES) {
            long long i = (long long)row * channels + c;
            float g = masked(as_float(dy[i]), relu_out, i);
            float xhat = (as_float(x[i]) - mean[c]) * invstd[c];
            sum_dy += (double)g;
            sum_dy_xhat += (double)(g * xhat);
        }
    }
    sum_dy = sum_row_lanes(sum_dy, lanes);
    sum_dy_xhat = sum_row_lanes(sum_dy_xhat, lanes);
    if (!write_partials(sum_dy, sum_dy_xhat, c, channels, partials, arrivals)) return;
    add_partials(partials, gridDim.x, c, channels, lanes, &sum_dy, &sum_dy_xhat);
    if (threadIdx.y != 0 || c >= channels) return;
    totals[c] = sum_dy;
    totals[channels + c] = sum_dy_xhat;
    grad_bias[c] += (float)sum_dy;
    grad_weight[c] += (float)sum_dy_xhat;
    if (coefficients != nullptr) {
        backward_coefficients(c, count, channels, sum_dy, sum_dy_xhat, weight, invstd,
                              coefficients);
    }
}

extern "C" __global__ void bn_backward_sums(BN_BACKWARD_SUMS_PARAMS(float)) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    bn_backward_sums_body(BN_BACKWARD_SUMS_ARGS, lanes);
}

extern "C" __global__ void bn_backward_sums_bf16(BN_BACKWARD_SUMS_PARAMS(bf16_bits)) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    bn_backward_sums_body(BN_BACKWARD_SUMS_ARGS, lanes);
}

// The input gradient's coefficients from the all-reduced totals of bn_backward_sums
// (SyncBatchNorm).
extern "C" __global__ void bn_backward_coefficients(const double* totals, double count,
                                                    int channels, const float* weight,
                                                    const float* invstd, float* coefficients) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    backward_coefficients(c, count, channels, totals[c], totals[channels + c], weight, invstd,
                          coefficients);
}

// The input gradient, element-wise: dx = gain * (dy - mean_dy - xhat * mean_dy_xhat), with the
// CPU's float operations in the CPU's order, dy masked by the ReLU; and, unless masked_dy is
// null, the masked dy itself, in place over dy (a block's output gradient, which its shortcut
// reads next: the ReLU's backward costs no pass of its own). dy, relu_out, x, dx and
// masked_dy are activations.
#define BN_BACKWARD_INPUT_PARAMS(Act)                                                          \
    const Act *dy, const Act *relu_out, const Act *x, const float *mean, const float *invstd,  \
        const float *coefficients, long long n, int channels, Act *dx, Act *masked_dy
#define BN_BACKWARD_INPUT_ARGS                                                                 \
    dy, relu_out, x, mean, invstd, coefficients, n, channels, dx, masked_dy

template <typename Act>
__device__ void bn_backward_input_body(BN_BACKWARD_INPUT_PARAMS(Act)) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int c = channel_of(i, n, channels);
    float gain = coefficients[c];
    float mean_dy = coefficients[channels + c];
    float mean_dy_xhat = coefficients[2 * channels + c];
    float xhat = (as_float(x[i]) - mean[c]) * invstd[c];
    float g = masked(as_float(dy[i]), relu_out, i);
    store(dx, i, gain * (g - mean_dy - xhat * mean_dy_xhat));
    if (masked_dy != nullptr) store(masked_dy, i, g);
}

extern "C" __global__ void bn_backward_input(BN_BACKWARD_INPUT_PARAMS(float)) {
    bn_backward_input_body(BN_BACKWARD_INPUT_ARGS);
}

extern "C" __global__ void bn_backward_input_bf16(BN_BACKWARD_INPUT_PARAMS(bf16_bits)) {
    bn_backward_input_body(BN_BACKWARD_INPUT_ARGS);
}
