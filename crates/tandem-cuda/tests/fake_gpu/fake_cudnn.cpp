// A fake cuDNN (libcudnn.so.9) for the fake GPU (fake_cuda.cpp): handles, 4-d tensor,
// filter and convolution descriptors, the cudnnFind* calls (a fixed list of algorithms, each
// reported with the descriptor's math type), and the three convolution directions computed
// on the CPU in double from the descriptors alone (any strides, KRSC or KCRS filters,
// padding, stride, dilation, cross-correlation or convolution, float32 or bfloat16 data),
// `alpha * result + beta * previous` as cuDNN blends, queued on the handle's stream.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fake_gpu.h"

typedef int cudnnStatus_t;

enum {
    CUDNN_STATUS_SUCCESS = 0,
    CUDNN_STATUS_BAD_PARAM = 2000,
    CUDNN_STATUS_NOT_SUPPORTED = 3000,
    CUDNN_STATUS_EXECUTION_FAILED = 5000,
};
enum { CUDNN_DATA_FLOAT = 0, CUDNN_DATA_BFLOAT16 = 9 };
enum { CUDNN_TENSOR_NCHW = 0, CUDNN_TENSOR_NHWC = 1 };
enum { CUDNN_CONVOLUTION = 0, CUDNN_CROSS_CORRELATION = 1 };
enum { CUDNN_NON_DETERMINISTIC = 0, CUDNN_DETERMINISTIC = 1 };

// cudnnConvolution*AlgoPerf_t: the three have this layout.
struct AlgoPerf {
    int algo;
    cudnnStatus_t status;
    float time;
    size_t memory;
    int determinism;
    int mathType;
    int reserved[3];
};

namespace {

struct Handle {
    void* stream = nullptr;
};

struct Tensor {
    int type = CUDNN_DATA_FLOAT;
    long long dims[4] = {0, 0, 0, 0};     // n, c, h, w
    long long strides[4] = {0, 0, 0, 0};  // of n, c, h, w
};

struct Filter {
    int type = CUDNN_DATA_FLOAT;
    int format = CUDNN_TENSOR_NCHW;
    long long k = 0, c = 0, r = 0, s = 0;

    long long index(long long ki, long long ci, long long ri, long long si) const {
        return format == CUDNN_TENSOR_NHWC ? ((ki * r + ri) * s + si) * c + ci
                                           : ((ki * c + ci) * r + ri) * s + si;
    }
};

struct Convolution {
    int pad_h = 0, pad_w = 0, stride_h = 1, stride_w = 1, dilation_h = 1, dilation_w = 1;
    int mode = CUDNN_CROSS_CORRELATION;
    int math = 0;
};

float load(const void* data, int type, long long index) {
    if (type == CUDNN_DATA_BFLOAT16) return fake_bf16_to_float(static_cast<const uint16_t*>(data)[index]);
    return static_cast<const float*>(data)[index];
}

void store(void* data, int type, long long index, float value) {
    if (type == CUDNN_DATA_BFLOAT16) {
        static_cast<uint16_t*>(data)[index] = fake_float_to_bf16(value);
    } else {
        static_cast<float*>(data)[index] = value;
    }
}

long long offset(const Tensor& t, long long n, long long c, long long h, long long w) {
    return n * t.strides[0] + c * t.strides[1] + h * t.strides[2] + w * t.strides[3];
}

bool supported(int type) { return type == CUDNN_DATA_FLOAT || type == CUDNN_DATA_BFLOAT16; }

// The filter tap (r, s) as applied: flipped for a true convolution.
long long tap(const Convolution& conv, long long index, long long size) {
    return conv.mode == CUDNN_CONVOLUTION ? size - 1 - index : index;
}

// A tensor gathered into dense NHWC floats (any strides, either data type).
std::vector<float> gather_nhwc(const Tensor& t, const void* data) {
    std::vector<float> dense((size_t)(t.dims[0] * t.dims[2] * t.dims[3] * t.dims[1]));
    size_t i = 0;
    for (long long n = 0; n < t.dims[0]; n++)
        for (long long h = 0; h < t.dims[2]; h++)
            for (long long w = 0; w < t.dims[3]; w++)
                for (long long c = 0; c < t.dims[1]; c++) dense[i++] = load(data, t.type, offset(t, n, c, h, w));
    return dense;
}

// A filter gathered into dense KRSC floats, its taps flipped for a true convolution.
std::vector<float> gather_krsc(const Filter& f, const Convolution& conv, const void* data) {
    std::vector<float> dense((size_t)(f.k * f.r * f.s * f.c));
    size_t i = 0;
    for (long long k = 0; k < f.k; k++)
        for (long long r = 0; r < f.r; r++)
            for (long long s = 0; s < f.s; s++)
                for (long long c = 0; c < f.c; c++)
                    dense[i++] = load(data, f.type, f.index(k, c, tap(conv, r, f.r), tap(conv, s, f.s)));
    return dense;
}

// The input row h (or column w) that output row p (column q) reads through tap r (s).
long long input_row(const Convolution& conv, long long p, long long r) {
    return p * conv.stride_h - conv.pad_h + r * conv.dilation_h;
}
long long input_column(const Convolution& conv, long long q, long long s) {
    return q * conv.stride_w - conv.pad_w + s * conv.dilation_w;
}

// Dense NHWC sums written back as `alpha * sums + beta * previous` at a tensor's offsets.
void blend_nhwc(void* target, const Tensor& t, const std::vector<double>& sums, float alpha, float beta) {
    size_t i = 0;
    for (long long n = 0; n < t.dims[0]; n++)
        for (long long h = 0; h < t.dims[2]; h++)
            for (long long w = 0; w < t.dims[3]; w++)
                for (long long c = 0; c < t.dims[1]; c++) {
                    long long at = offset(t, n, c, h, w);
                    float previous = beta == 0.0f ? 0.0f : load(target, t.type, at);
                    store(target, t.type, at, (float)(alpha * sums[i++] + (double)beta * previous));
                }
}

// target = alpha * sums + beta * target, element by element over a tensor's offsets.
void blend(void* target, int type, const std::vector<long long>& offsets,
           const std::vector<double>& sums, float alpha, float beta) {
    for (size_t i = 0; i < offsets.size(); i++) {
        float previous = beta == 0.0f ? 0.0f : load(target, type, offsets[i]);
        store(target, type, offsets[i], (float)(alpha * sums[i] + (double)beta * previous));
    }
}

bool shapes_fit(const Tensor& x, const Filter& f, const Convolution& conv, const Tensor& y) {
    if (!supported(x.type) || !supported(f.type) || !supported(y.type)) return false;
    if (x.dims[1] != f.c || y.dims[1] != f.k || x.dims[0] != y.dims[0]) return false;
    long long p = (x.dims[2] + 2 * conv.pad_h - conv.dilation_h * (f.r - 1) - 1) / conv.stride_h + 1;
    long long q = (x.dims[3] + 2 * conv.pad_w - conv.dilation_w * (f.s - 1) - 1) / conv.stride_w + 1;
    return p == y.dims[2] && q == y.dims[3];
}

void report(AlgoPerf* perf, int* returned, int requested, const std::vector<std::pair<int, int>>& algos,
            int math) {
    int count = 0;
    for (auto [algo, determinism] : algos) {
        if (count == requested) break;
        perf[count] = AlgoPerf{algo, CUDNN_STATUS_SUCCESS, 0.1f * (float)(count + 1), 0,
                               determinism, math, {0, 0, 0}};
        count++;
    }
    *returned = count;
}

// Makes a new `T` for `*object` (a handle or a descriptor).
template <typename T>
cudnnStatus_t create(void** object) {
    *object = new T();
    return CUDNN_STATUS_SUCCESS;
}

// Deletes the `T` at `object`.
template <typename T>
cudnnStatus_t destroy(void* object) {
    delete static_cast<T*>(object);
    return CUDNN_STATUS_SUCCESS;
}

// A cudnnFind*Algorithm call of the convolution `conv` from `x` with `w` to `y` (gradients
// or not): lists `algos` once `x`, `w` and `y` fit.
cudnnStatus_t find(void* x, void* w, void* conv, void* y, int requested, int* returned,
                   AlgoPerf* perf, const std::vector<std::pair<int, int>>& algos) {
    auto* c = static_cast<Convolution*>(conv);
    if (!shapes_fit(*static_cast<Tensor*>(x), *static_cast<Filter*>(w), *c, *static_cast<Tensor*>(y)))
        return CUDNN_STATUS_BAD_PARAM;
    report(perf, returned, requested, algos, c->math);
    return CUDNN_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

size_t cudnnGetVersion() { return 92600; }

const char* cudnnGetErrorString(cudnnStatus_t status) {
    return status == CUDNN_STATUS_SUCCESS ? "CUDNN_STATUS_SUCCESS" : "fake cuDNN error";
}

cudnnStatus_t cudnnCreate(void** handle) { return create<Handle>(handle); }

cudnnStatus_t cudnnDestroy(void* handle) { return destroy<Handle>(handle); }

cudnnStatus_t cudnnSetStream(void* handle, void* stream) {
    static_cast<Handle*>(handle)->stream = stream;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateTensorDescriptor(void** desc) { return create<Tensor>(desc); }

cudnnStatus_t cudnnDestroyTensorDescriptor(void* desc) { return destroy<Tensor>(desc); }

cudnnStatus_t cudnnSetTensor4dDescriptorEx(void* desc, int type, int n, int c, int h, int w,
                                           int n_stride, int c_stride, int h_stride,
                                           int w_stride) {
    if (!supported(type) || n <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
    auto* t = static_cast<Tensor*>(desc);
    t->type = type;
    long long dims[4] = {n, c, h, w}, strides[4] = {n_stride, c_stride, h_stride, w_stride};
    for (int i = 0; i < 4; i++) {
        t->dims[i] = dims[i];
        t->strides[i] = strides[i];
    }
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateFilterDescriptor(void** desc) { return create<Filter>(desc); }

cudnnStatus_t cudnnDestroyFilterDescriptor(void* desc) { return destroy<Filter>(desc); }

cudnnStatus_t cudnnSetFilter4dDescriptor(void* desc, int type, int format, int k, int c, int r,
                                         int s) {
    if (!supported(type) || k <= 0 || c <= 0 || r <= 0 || s <= 0) return CUDNN_STATUS_BAD_PARAM;
    if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC) return CUDNN_STATUS_NOT_SUPPORTED;
    *static_cast<Filter*>(desc) = Filter{type, format, k, c, r, s};
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateConvolutionDescriptor(void** desc) { return create<Convolution>(desc); }

cudnnStatus_t cudnnDestroyConvolutionDescriptor(void* desc) { return destroy<Convolution>(desc); }

cudnnStatus_t cudnnSetConvolution2dDescriptor(void* desc, int pad_h, int pad_w, int stride_h,
                                              int stride_w, int dilation_h, int dilation_w,
                                              int mode, int compute_type) {
    if (stride_h <= 0 || stride_w <= 0 || dilation_h <= 0 || dilation_w <= 0 || pad_h < 0 ||
        pad_w < 0 || compute_type != CUDNN_DATA_FLOAT) {
        return CUDNN_STATUS_BAD_PARAM;
    }
    auto* conv = static_cast<Convolution*>(desc);
    int math = conv->math;
    *conv = Convolution{pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w, mode, math};
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolutionMathType(void* desc, int math) {
    static_cast<Convolution*>(desc)->math = math;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithm(void*, void* x, void* w, void* conv, void* y,
                                                   int requested, int* returned, AlgoPerf* perf) {
    // IMPLICIT_GEMM, IMPLICIT_PRECOMP_GEMM (both deterministic), FFT_TILING.
    return find(x, w, conv, y, requested, returned, perf,
                {{0, CUDNN_DETERMINISTIC}, {1, CUDNN_DETERMINISTIC}, {5, CUDNN_DETERMINISTIC}});
}

cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithm(void*, void* w, void* dy, void* conv,
                                                        void* dx, int requested, int* returned,
                                                        AlgoPerf* perf) {
    // ALGO_0 (not deterministic: atomics), ALGO_1.
    return find(dx, w, conv, dy, requested, returned, perf,
                {{0, CUDNN_NON_DETERMINISTIC}, {1, CUDNN_DETERMINISTIC}});
}

cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithm(void*, void* x, void* dy, void* conv,
                                                          void* dw, int requested, int* returned,
                                                          AlgoPerf* perf) {
    // ALGO_0 and ALGO_3 (not deterministic), ALGO_1.
    return find(x, dw, conv, dy, requested, returned, perf,
                {{0, CUDNN_NON_DETERMINISTIC}, {3, CUDNN_NON_DETERMINISTIC}, {1, CUDNN_DETERMINISTIC}});
}

cudnnStatus_t cudnnConvolutionForward(void* handle, const void* alpha, void* x_desc,
                                      const void* x, void* w_desc, const void* w, void* conv_desc,
                                      int, void*, size_t, const void* beta, void* y_desc, void* y) {
    Tensor xt = *static_cast<Tensor*>(x_desc), yt = *static_cast<Tensor*>(y_desc);
    Filter f = *static_cast<Filter*>(w_desc);
    Convolution conv = *static_cast<Convolution*>(conv_desc);
    if (!shapes_fit(xt, f, conv, yt)) return CUDNN_STATUS_BAD_PARAM;
    if (fake_library_allocation_refused()) return CUDNN_STATUS_EXECUTION_FAILED;
    float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
    fake_enqueue(static_cast<Handle*>(handle)->stream, [=] {
        std::vector<float> xs = gather_nhwc(xt, x), ws = gather_krsc(f, conv, w);
        const long long C = f.c, K = f.k, P = yt.dims[2], Q = yt.dims[3];
        std::vector<double> sums((size_t)(yt.dims[0] * P * Q * K), 0.0);
#pragma omp parallel for
        for (long long n = 0; n < yt.dims[0]; n++)
            for (long long p = 0; p < P; p++)
                for (long long q = 0; q < Q; q++)
                    for (long long k = 0; k < K; k++) {
                        double sum = 0.0;
                        for (long long r = 0; r < f.r; r++) {
                            long long h = input_row(conv, p, r);
                            if (h < 0 || h >= xt.dims[2]) continue;
                            for (long long s = 0; s < f.s; s++) {
                                long long wi = input_column(conv, q, s);
                                if (wi < 0 || wi >= xt.dims[3]) continue;
                                const float* xv = &xs[(size_t)(((n * xt.dims[2] + h) * xt.dims[3] + wi) * C)];
                                const float* wv = &ws[(size_t)(((k * f.r + r) * f.s + s) * C)];
                                for (long long c = 0; c < C; c++) sum += (double)xv[c] * (double)wv[c];
                            }
                        }
                        sums[(size_t)(((n * P + p) * Q + q) * K + k)] = sum;
                    }
        blend_nhwc(y, yt, sums, a, b);
    });
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnConvolutionBackwardData(void* handle, const void* alpha, void* w_desc,
                                           const void* w, void* dy_desc, const void* dy,
                                           void* conv_desc, int, void*, size_t, const void* beta,
                                           void* dx_desc, void* dx) {
    Tensor dxt = *static_cast<Tensor*>(dx_desc), dyt = *static_cast<Tensor*>(dy_desc);
    Filter f = *static_cast<Filter*>(w_desc);
    Convolution conv = *static_cast<Convolution*>(conv_desc);
    if (!shapes_fit(dxt, f, conv, dyt)) return CUDNN_STATUS_BAD_PARAM;
    float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
    fake_enqueue(static_cast<Handle*>(handle)->stream, [=] {
        std::vector<float> dys = gather_nhwc(dyt, dy), ws = gather_krsc(f, conv, w);
        const long long C = f.c, K = f.k, H = dxt.dims[2], W = dxt.dims[3];
        std::vector<double> sums((size_t)(dxt.dims[0] * H * W * C), 0.0);
#pragma omp parallel for
        for (long long n = 0; n < dyt.dims[0]; n++)
            for (long long p = 0; p < dyt.dims[2]; p++)
                for (long long q = 0; q < dyt.dims[3]; q++)
                    for (long long r = 0; r < f.r; r++) {
                        long long h = input_row(conv, p, r);
                        if (h < 0 || h >= H) continue;
                        for (long long s = 0; s < f.s; s++) {
                            long long wi = input_column(conv, q, s);
                            if (wi < 0 || wi >= W) continue;
                            double* target = &sums[(size_t)(((n * H + h) * W + wi) * C)];
                            for (long long k = 0; k < K; k++) {
                                double g = dys[(size_t)(((n * dyt.dims[2] + p) * dyt.dims[3] + q) * K + k)];
                                if (g == 0.0) continue;
                                const float* wv = &ws[(size_t)(((k * f.r + r) * f.s + s) * C)];
                                for (long long c = 0; c < C; c++) target[c] += g * (double)wv[c];
                            }
                        }
                    }
        blend_nhwc(dx, dxt, sums, a, b);
    });
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnConvolutionBackwardFilter(void* handle, const void* alpha, void* x_desc,
                                             const void* x, void* dy_desc, const void* dy,
                                             void* conv_desc, int, void*, size_t,
                                             const void* beta, void* dw_desc, void* dw) {
    // A refusal of the chosen algorithm at execution, as cuDNN may give, for tests.
    if (std::getenv("TANDEM_FAKE_CUDNN_REFUSE_BACKWARD_FILTER")) return CUDNN_STATUS_NOT_SUPPORTED;
    Tensor xt = *static_cast<Tensor*>(x_desc), dyt = *static_cast<Tensor*>(dy_desc);
    Filter f = *static_cast<Filter*>(dw_desc);
    Convolution conv = *static_cast<Convolution*>(conv_desc);
    if (!shapes_fit(xt, f, conv, dyt)) return CUDNN_STATUS_BAD_PARAM;
    float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
    fake_enqueue(static_cast<Handle*>(handle)->stream, [=] {
        std::vector<float> xs = gather_nhwc(xt, x), dys = gather_nhwc(dyt, dy);
        const long long C = f.c, K = f.k, P = dyt.dims[2], Q = dyt.dims[3];
        std::vector<double> sums((size_t)(K * f.r * f.s * C), 0.0);  // dense KRSC, unflipped taps
#pragma omp parallel for
        for (long long k = 0; k < K; k++)
            for (long long n = 0; n < dyt.dims[0]; n++)
                for (long long p = 0; p < P; p++)
                    for (long long q = 0; q < Q; q++) {
                        double g = dys[(size_t)(((n * P + p) * Q + q) * K + k)];
                        if (g == 0.0) continue;
                        for (long long r = 0; r < f.r; r++) {
                            long long h = input_row(conv, p, r);
                            if (h < 0 || h >= xt.dims[2]) continue;
                            for (long long s = 0; s < f.s; s++) {
                                long long wi = input_column(conv, q, s);
                                if (wi < 0 || wi >= xt.dims[3]) continue;
                                const float* xv = &xs[(size_t)(((n * xt.dims[2] + h) * xt.dims[3] + wi) * C)];
                                double* target = &sums[(size_t)(((k * f.r + r) * f.s + s) * C)];
                                for (long long c = 0; c < C; c++) target[c] += g * (double)xv[c];
                            }
                        }
                    }
        // Back to the filter's own layout, the taps flipped again for a true convolution.
        std::vector<long long> offsets;
        std::vector<double> ordered;
        for (long long k = 0; k < K; k++)
            for (long long r = 0; r < f.r; r++)
                for (long long s = 0; s < f.s; s++)
                    for (long long c = 0; c < C; c++) {
                        offsets.push_back(f.index(k, c, tap(conv, r, f.r), tap(conv, s, f.s)));
                        ordered.push_back(sums[(size_t)(((k * f.r + r) * f.s + s) * C + c)]);
                    }
        blend(dw, f.type, offsets, ordered, a, b);
    });
    return CUDNN_STATUS_SUCCESS;
}

}  // extern "C"
