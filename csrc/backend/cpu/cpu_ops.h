/*
 * cpu_ops.h — the CPU backend's array-op kernels (implemented in cpu_ops.c),
 * entered in ct_cpu_backend's table.
 */
#ifndef CT_CPU_OPS_H
#define CT_CPU_OPS_H

#include "../../core/ct_device.h"

ct_status ct_cpu_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n, int dtype,
                             const void *x, void *y);
ct_status ct_cpu_unary(ct_device *dev, int op, float alpha, float beta, int64_t n, const float *x,
                       float *y);
ct_status ct_cpu_binary(ct_device *dev, int op, int ndim, const int64_t *shape, float *out,
                        const float *a, const int64_t *as, const float *b, const int64_t *bs);
ct_status ct_cpu_reduce(ct_device *dev, int op, int ndim, const int64_t *shape, uint32_t axes,
                        const float *x, float *out);
ct_status ct_cpu_gemm(ct_device *dev, int ta, int tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                      float beta, float *c, int64_t ldc, int prec);
/* Whether ct_cpu_gemm computes a product whose op(B) is k x n with its small kernel (never the
 * registered BLAS sgemm): op(B)'s size alone decides. */
int ct_cpu_gemm_small(int64_t n, int64_t k);
ct_status ct_cpu_ewise(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                       void *out, const void *a, const int64_t *as, const void *b,
                       const int64_t *bs);
ct_status ct_cpu_reduce_typed(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                              uint32_t axes, const void *x, void *out);
ct_status ct_cpu_convert(ct_device *dev, int64_t n, int src_dtype, const void *x, int dst_dtype,
                         void *y);
/* Return the CPU backend's cached free blocks to the system (cpu_backend.c). */
void ct_cpu_release_cached(void);
ct_status ct_cpu_allreduce(ct_device **devs, float **bufs, int nbufs, int64_t count, int op);
ct_status ct_cpu_gather_rows(ct_device *dev, const float *table, int64_t nrows, int64_t ncols,
                             int64_t row0, const int32_t *ids, int64_t nids, float *out);
ct_status ct_cpu_scatter_add_rows(ct_device *dev, float *table, int64_t nrows, int64_t ncols,
                                  int64_t row0, const int32_t *hit, const int32_t *start,
                                  int64_t nhit, const int32_t *pos, const float *g);

#endif /* CT_CPU_OPS_H */
