// A fake cuBLAS (libcublas.so.13) for the fake GPU (fake_cuda.cpp): handles, stream, math
// mode and workspace settings, and column-major GEMM (cublasSgemm_v2, cublasGemmEx with
// float32 or bfloat16 operands and float32 accumulation), computed on the CPU in double and
// queued on the handle's stream. Scalars are read at the call (host pointer mode), as cuBLAS
// reads them when the call is captured.

#include <cstdint>
#include <cstdio>

#include "fake_gpu.h"

typedef int cublasStatus_t;

enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 };

namespace {

struct Handle {
    void* stream = nullptr;
};

// Element (row, column) of op(matrix), column-major with leading dimension `ld`.
float element(const void* matrix, int type, int op, int ld, int row, int column) {
    long long index = op == CUBLAS_OP_N ? row + (long long)column * ld : column + (long long)row * ld;
    if (type == CUDA_R_16BF) return fake_bf16_to_float(static_cast<const uint16_t*>(matrix)[index]);
    return static_cast<const float*>(matrix)[index];
}

cublasStatus_t gemm(Handle* handle, int op_a, int op_b, int m, int n, int k, float alpha,
                    const void* a, int type_a, int lda, const void* b, int type_b, int ldb,
                    float beta, void* c, int type_c, int ldc) {
    if (handle == nullptr || m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    for (int type : {type_a, type_b, type_c}) {
        if (type != CUDA_R_32F && type != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    fake_enqueue(handle->stream, [=] {
#pragma omp parallel for
        for (int column = 0; column < n; column++) {
            for (int row = 0; row < m; row++) {
                double sum = 0.0;
                for (int l = 0; l < k; l++) {
                    sum += (double)element(a, type_a, op_a, lda, row, l) *
                           (double)element(b, type_b, op_b, ldb, l, column);
                }
                long long index = row + (long long)column * ldc;
                float previous = beta == 0.0f ? 0.0f
                                 : type_c == CUDA_R_16BF
                                     ? fake_bf16_to_float(static_cast<uint16_t*>(c)[index])
                                     : static_cast<float*>(c)[index];
                float value = (float)(alpha * sum + (double)beta * previous);
                if (type_c == CUDA_R_16BF) {
                    static_cast<uint16_t*>(c)[index] = fake_float_to_bf16(value);
                } else {
                    static_cast<float*>(c)[index] = value;
                }
            }
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasGetProperty(int type, int* value) {
    const int version[3] = {13, 0, 0};
    if (type < 0 || type > 2) return CUBLAS_STATUS_INVALID_VALUE;
    *value = version[type];
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasCreate_v2(void** handle) {
    *handle = new Handle();
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(void* handle) {
    delete static_cast<Handle*>(handle);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(void* handle, void* stream) {
    static_cast<Handle*>(handle)->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(void*, void*, size_t) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasSetMathMode(void*, int) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasSgemm_v2(void* handle, int op_a, int op_b, int m, int n, int k,
                              const float* alpha, const float* a, int lda, const float* b,
                              int ldb, const float* beta, float* c, int ldc) {
    return gemm(static_cast<Handle*>(handle), op_a, op_b, m, n, k, *alpha, a, CUDA_R_32F, lda, b,
                CUDA_R_32F, ldb, *beta, c, CUDA_R_32F, ldc);
}

cublasStatus_t cublasGemmEx(void* handle, int op_a, int op_b, int m, int n, int k,
                            const void* alpha, const void* a, int type_a, int lda, const void* b,
                            int type_b, int ldb, const void* beta, void* c, int type_c, int ldc,
                            int, int) {
    return gemm(static_cast<Handle*>(handle), op_a, op_b, m, n, k,
                *static_cast<const float*>(alpha), a, type_a, lda, b, type_b, ldb,
                *static_cast<const float*>(beta), c, type_c, ldc);
}

}  // extern "C"
