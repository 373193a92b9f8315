/*
 * cublas_v2.h (emulation) — cublasCreate / cublasSetStream / cublasSgemm as the
 * CUDA backend calls them, on the host (cuda_emu.cpp). Column-major, like cuBLAS;
 * checks the leading dimensions cuBLAS checks.
 */
#ifndef CT_CUDA_EMU_CUBLAS_H
#define CT_CUDA_EMU_CUBLAS_H

#include "cuda_runtime.h"

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;
typedef struct cublasContext *cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc);

#endif /* CT_CUDA_EMU_CUBLAS_H */
