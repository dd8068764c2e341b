// Batch normalization over NHWC tensors, viewed as [rows, channels] (rows = batch*height*width),
// with PyTorch BatchNorm2d semantics, as crates/tandem-engine/src/batchnorm.rs computes them.
//
// Every sum that reaches the weights is taken in a FIXED order, with no floating-point atomics:
//   pass 1 (*_partial): block (channel group, row block) sums its rows in double, each thread
//           over rows ty, ty + ROW_LANES, ... in order; the ROW_LANES lanes are then added in
//           lane order into one partial per (row block, channel);
//   pass 2 (*_finish):  block (channel group): lane ty adds the partials of row blocks ty,
//           ty + ROW_LANES, ... in order, and the lanes are added in lane order, as in pass 1
//           (one thread per channel looping over every row block would wait on one load after
//           another: 512 of them for a 32x32 layer at batch 128).
// The result depends only on the shape and the launch's rows_per_block, never on scheduling.
// The CPU engine splits rows by worker thread instead, so the two devices agree to rounding of
// the double sums (about 1e-16 relative), not bit for bit.
//
// Layouts, shared with the CPU engine so the same SyncBatchNorm all-reduce applies:
//   forward totals:  [count, sum x per channel..., sum x^2 per channel...]   (double)
//   backward totals: [sum dy per channel..., sum dy*xhat per channel...]     (double)
//
// Launch: *_partial with blockDim (CHANNEL_LANES, ROW_LANES), gridDim (ceil(rows /
// rows_per_block), ceil(channels / CHANNEL_LANES)): the row blocks on x, whose limit is 2^31 - 1
// blocks rather than y's 65,535; *_finish with the same blocks and one row block on x;
// per-channel kernels with one thread per channel.

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

// Pass 1 of the statistics: partials[row_block][0][c] = sum x, partials[row_block][1][c] = sum x^2
// over this block's rows.
extern "C" __global__ void bn_stats_partial(const float* x, int rows, int channels,
                                            int rows_per_block, double* partials) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    int c = blockIdx.y * CHANNEL_LANES + threadIdx.x;
    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    double sum = 0.0, sum_sq = 0.0;
    if (c < channels) {
        for (int row = first + threadIdx.y; row < last; row += ROW_LANES) {
            double value = (double)x[(long long)row * channels + c];
            sum += value;
            sum_sq += value * value;
        }
    }
    sum = sum_row_lanes(sum, lanes);
    sum_sq = sum_row_lanes(sum_sq, lanes);
    if (threadIdx.y == 0 && c < channels) {
        double* out = partials + (long long)blockIdx.x * 2 * channels;
        out[c] = sum;
        out[channels + c] = sum_sq;
    }
}

// Pass 2 of the statistics: totals = [rows, sum x..., sum x^2...], the row blocks' partials
// added in the fixed order of the header.
extern "C" __global__ void bn_stats_finish(const double* partials, int row_blocks, int rows,
                                           int channels, double* totals) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    int c = blockIdx.y * CHANNEL_LANES + threadIdx.x;
    if (c == 0 && threadIdx.y == 0) totals[0] = (double)rows;
    double sum = 0.0, sum_sq = 0.0;
    if (c < channels) {
        for (int block = threadIdx.y; block < row_blocks; block += ROW_LANES) {
            sum += partials[(long long)block * 2 * channels + c];
            sum_sq += partials[(long long)block * 2 * channels + channels + c];
        }
    }
    sum = sum_row_lanes(sum, lanes);
    sum_sq = sum_row_lanes(sum_sq, lanes);
    if (threadIdx.y == 0 && c < channels) {
        totals[1 + c] = sum;
        totals[1 + channels + c] = sum_sq;
    }
}

// Training-mode coefficients from the (possibly all-reduced) totals, in double as the CPU's
// train_statistics_from_sums: batch mean and biased variance normalize; the running statistics
// take the unbiased variance. Writes mean, invstd, scale = weight*invstd and
// shift = bias - mean*scale (all float) and updates running_mean/running_var in place.
// The caller checks count > 1 on the host (the CPU returns BatchNormTooFewValues).
extern "C" __global__ void bn_train_coefficients(const double* totals, int channels,
                                                 const float* weight, const float* bias,
                                                 float* running_mean, float* running_var,
                                                 float* mean_out, float* invstd_out,
                                                 float* scale_out, float* shift_out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    double count = totals[0];
    double mean = totals[1 + c] / count;
    double variance = fmax(totals[1 + channels + c] / count - mean * mean, 0.0);
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
__device__ float masked(float dy, const float* relu_out, long long i) {
    return (relu_out != nullptr && relu_out[i] <= 0.0f) ? 0.0f : dy;
}

// Pass 1 of the backward sums: partials[row_block][0][c] = sum dy, [1][c] = sum dy*xhat with
// xhat = (x - mean) * invstd computed in float as the CPU does, dy masked by the ReLU.
extern "C" __global__ void bn_backward_partial(const float* dy, const float* relu_out,
                                               const float* x, const float* mean,
                                               const float* invstd, int rows, int channels,
                                               int rows_per_block, double* partials) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    int c = blockIdx.y * CHANNEL_LANES + threadIdx.x;
    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    if (c < channels) {
        for (int row = first + threadIdx.y; row < last; row += ROW_LANES) {
            long long i = (long long)row * channels + c;
            float g = masked(dy[i], relu_out, i);
            float xhat = (x[i] - mean[c]) * invstd[c];
            sum_dy += (double)g;
            sum_dy_xhat += (double)(g * xhat);
        }
    }
    sum_dy = sum_row_lanes(sum_dy, lanes);
    sum_dy_xhat = sum_row_lanes(sum_dy_xhat, lanes);
    if (threadIdx.y == 0 && c < channels) {
        double* out = partials + (long long)blockIdx.x * 2 * channels;
        out[c] = sum_dy;
        out[channels + c] = sum_dy_xhat;
    }
}

// Pass 2 of the backward sums: totals = [sum dy..., sum dy*xhat...], the row blocks' partials
// added in the fixed order of the header, and the local sums added to the parameter gradients
// (grad_bias += sum dy, grad_weight += sum dy*xhat), before any all-reduce of the totals, as
// the CPU does.
extern "C" __global__ void bn_backward_finish(const double* partials, int row_blocks,
                                              int channels, double* totals, float* grad_weight,
                                              float* grad_bias) {
    __shared__ double lanes[ROW_LANES][CHANNEL_LANES];
    int c = blockIdx.y * CHANNEL_LANES + threadIdx.x;
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    if (c < channels) {
        for (int block = threadIdx.y; block < row_blocks; block += ROW_LANES) {
            sum_dy += partials[(long long)block * 2 * channels + c];
            sum_dy_xhat += partials[(long long)block * 2 * channels + channels + c];
        }
    }
    sum_dy = sum_row_lanes(sum_dy, lanes);
    sum_dy_xhat = sum_row_lanes(sum_dy_xhat, lanes);
    if (threadIdx.y == 0 && c < channels) {
        totals[c] = sum_dy;
        totals[channels + c] = sum_dy_xhat;
        grad_bias[c] += (float)sum_dy;
        grad_weight[c] += (float)sum_dy_xhat;
    }
}

// Per-channel coefficients of the input gradient from the (possibly all-reduced) totals:
// coefficients = [gain = weight*invstd..., mean dy..., mean dy*xhat...] (float).
extern "C" __global__ void bn_backward_coefficients(const double* totals, double count,
                                                    int channels, const float* weight,
                                                    const float* invstd, float* coefficients) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    coefficients[c] = weight[c] * invstd[c];
    coefficients[channels + c] = (float)(totals[c] / count);
    coefficients[2 * channels + c] = (float)(totals[channels + c] / count);
}

// The input gradient, element-wise: dx = gain * (dy - mean_dy - xhat * mean_dy_xhat), with the
// CPU's float operations in the CPU's order.
extern "C" __global__ void bn_backward_input(const float* dy, const float* relu_out,
                                             const float* x, const float* mean,
                                             const float* invstd, const float* coefficients,
                                             long long n, int channels, float* dx) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int c = (int)(i % channels);
    float gain = coefficients[c];
    float mean_dy = coefficients[channels + c];
    float mean_dy_xhat = coefficients[2 * channels + c];
    float xhat = (x[i] - mean[c]) * invstd[c];
    dx[i] = gain * (masked(dy[i], relu_out, i) - mean_dy - xhat * mean_dy_xhat);
}
