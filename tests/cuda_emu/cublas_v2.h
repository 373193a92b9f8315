/*
 * cublas_v2.h (emulation) — cublasCreate / cublasSetStream / cublasSgemm /
 * cublasGemmEx as the CUDA backend calls them, on the host (cuda_emu.cpp).
 * Column-major, like cuBLAS; checks the leading dimensions cuBLAS checks.
 * cublasGemmEx takes float32 operands only, with the compute types 32F,
 * 32F_FAST_TF32 and 32F_FAST_16BF; the fast ones round every input element to
 * TF32 / bfloat16 as core/ct_prec_math.h defines (the CPU backend's reference),
 * which real tensor cores need not match bit for bit. Enum values are the
 * toolkit's.
 */
#ifndef CT_CUDA_EMU_CUBLAS_H
#define CT_CUDA_EMU_CUBLAS_H

#include "cuda_runtime.h"

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;
typedef struct cublasContext *cublasHandle_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType;
typedef cudaDataType cudaDataType_t;
typedef enum {
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_PEDANTIC = 69,
    CUBLAS_COMPUTE_32F_FAST_16F = 74,
    CUBLAS_COMPUTE_32F_FAST_16BF = 75,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
} cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *a, cudaDataType_t atype,
                            int lda, const void *b, cudaDataType_t btype, int ldb,
                            const void *beta, void *c, cudaDataType_t ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo);

#endif /* CT_CUDA_EMU_CUBLAS_H */
