/*
 * ct_ops.c — validation and dispatch of per-shard array ops (see ct_ops.h).
 */
#include "ct_ops.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "ct_layout.h"

static _Atomic(ct_sgemm_fn) g_sgemm = NULL;

void ct_set_blas_sgemm(ct_sgemm_fn fn) { atomic_store(&g_sgemm, fn); }

ct_sgemm_fn ct_get_blas_sgemm(void) { return atomic_load(&g_sgemm); }

ct_status ct_broadcast_strides(int out_ndim, const int64_t *out, int in_ndim, const int64_t *in,
                               int64_t *strides) {
    if (in_ndim > out_ndim)
        return ct_set_error(CT_EINVAL, "cannot broadcast rank %d to rank %d", in_ndim, out_ndim);
    int64_t s = 1;
    for (int d = out_ndim - 1; d >= 0; d--) {
        int k = d - (out_ndim - in_ndim);
        if (k < 0) {
            strides[d] = 0;
            continue;
        }
        if (in[k] == out[d] && in[k] != 1) {
            strides[d] = s;
        } else if (in[k] == 1) {
            strides[d] = 0;
        } else {
            return ct_set_error(CT_EINVAL,
                                "shapes do not broadcast: dimension %d has size %" PRId64
                                " where %" PRId64 " is needed",
                                k, in[k], out[d]);
        }
        s *= in[k];
    }
    return CT_OK;
}

static ct_status need(const ct_device *dev, const void *fn, const char *what) {
    if (fn == NULL) {
        char name[64];
        ct_device_name(dev, name, sizeof name);
        return ct_set_error(CT_EDEVICE, "%s is not implemented on %s", what, name);
    }
    return CT_OK;
}

ct_status ct_op_unary(ct_device *dev, int op, float alpha, float beta, int64_t n, const float *x,
                      float *y) {
    if (op < 0 || op >= CT_UN_COUNT) return ct_set_error(CT_EINVAL, "unknown unary op %d", op);
    if (n < 0) return ct_set_error(CT_EINVAL, "negative element count");
    CT_TRY(need(dev, (const void *)dev->backend->unary, "unary ops"));
    return dev->backend->unary(dev, op, alpha, beta, n, x, y);
}

ct_status ct_op_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n, int dtype,
                            const void *x, void *y) {
    if (op < 0 || op >= CT_UN_COUNT) return ct_set_error(CT_EINVAL, "unknown unary op %d", op);
    if (n < 0) return ct_set_error(CT_EINVAL, "negative element count");
    if (dtype != CT_BF16 && dtype != CT_F16)
        return ct_set_error(CT_ETYPE, "a 16-bit unary op on dtype %s", ct_dtype_name((ct_dtype)dtype));
    CT_TRY(need(dev, (const void *)dev->backend->unary_typed, "16-bit float unary ops"));
    return dev->backend->unary_typed(dev, op, alpha, beta, n, dtype, x, y);
}

ct_status ct_op_chain(ct_device *dev, int ndim, const int64_t *shape, const float *a,
                      const int64_t *a_strides, int nsteps, const ct_chain_step *steps, float *out) {
    if (ndim < 1 || ndim > CT_CHAIN_NDIM) return ct_set_error(CT_EINVAL, "chain: rank %d", ndim);
    if (nsteps < 1 || nsteps > CT_CHAIN_MAX)
        return ct_set_error(CT_EINVAL, "chain: %d steps", nsteps);
    for (int j = 0; j < nsteps; j++) {
        const ct_chain_step *st = &steps[j];
        if (st->binary ? (st->op < 0 || st->op >= CT_BIN_COUNT || st->other == NULL)
                       : (st->op < 0 || st->op >= CT_UN_COUNT))
            return ct_set_error(CT_EINVAL, "chain: step %d: op %d", j, st->op);
    }
    CT_TRY(need(dev, (const void *)dev->backend->chain, "fused chains"));
    return dev->backend->chain(dev, ndim, shape, a, a_strides, nsteps, steps, out);
}

ct_status ct_op_binary(ct_device *dev, int op, int ndim, const int64_t *shape, float *out,
                       const float *a, const int64_t *a_strides, const float *b,
                       const int64_t *b_strides) {
    if (op < 0 || op >= CT_BIN_COUNT) return ct_set_error(CT_EINVAL, "unknown binary op %d", op);
    if (ndim < 0 || ndim > CT_MAX_NDIM) return ct_set_error(CT_EINVAL, "rank %d", ndim);
    CT_TRY(need(dev, (const void *)dev->backend->binary, "binary ops"));
    return dev->backend->binary(dev, op, ndim, shape, out, a, a_strides, b, b_strides);
}

ct_status ct_op_reduce(ct_device *dev, int op, int ndim, const int64_t *shape, uint32_t axes,
                       const float *x, float *out) {
    if (op < 0 || op >= CT_RED_COUNT) return ct_set_error(CT_EINVAL, "unknown reduction %d", op);
    if (ndim < 0 || ndim > CT_MAX_NDIM) return ct_set_error(CT_EINVAL, "rank %d", ndim);
    if (ndim < 32 && (axes >> ndim) != 0)
        return ct_set_error(CT_EINVAL, "reduction axes outside rank %d", ndim);
    CT_TRY(need(dev, (const void *)dev->backend->reduce, "reductions"));
    return dev->backend->reduce(dev, op, ndim, shape, axes, x, out);
}

ct_status ct_op_gather_rows(ct_device *dev, const float *table, int64_t nrows, int64_t ncols,
                            int64_t row0, const int32_t *ids, int64_t nids, float *out) {
    if (nrows < 0 || ncols < 0 || nids < 0) return ct_set_error(CT_EINVAL, "negative row-gather size");
    CT_TRY(need(dev, (const void *)dev->backend->gather_rows, "row gathers (embedding lookups)"));
    return dev->backend->gather_rows(dev, table, nrows, ncols, row0, ids, nids, out);
}

/* A scatter plan's start (nhit + 1) and pos (npos) in host memory: the kernels read
 * pos[start[0] .. start[nhit]) and then g rows pos[k] without checks of their own. */
static ct_status scatter_plan_check(const int32_t *start, int64_t nhit, const int32_t *pos,
                                    int64_t npos) {
    if (start[0] < 0)
        return ct_set_error(CT_EINVAL, "row scatter plan: start[0] is %" PRId32 ", not >= 0",
                            start[0]);
    for (int64_t u = 0; u < nhit; u++)
        if (start[u + 1] < start[u] || start[u + 1] > npos)
            return ct_set_error(CT_EINVAL, "row scatter plan: start[%" PRId64 "] = %" PRId32
                                " is not in [start[%" PRId64 "], %" PRId64 "]",
                                u + 1, start[u + 1], u, npos);
    for (int64_t k = 0; k < npos; k++)
        if (pos[k] < 0 || pos[k] >= npos)
            return ct_set_error(CT_EINVAL, "row scatter plan: pos[%" PRId64 "] = %" PRId32
                                " is not a row of the %" PRId64 " gradient rows", k, pos[k], npos);
    return CT_OK;
}

/* The plan check on a copy in host memory when the plan lives on a device. */
static ct_status scatter_plan_check_dev(ct_device *dev, const int32_t *start, int64_t nhit,
                                        const int32_t *pos, int64_t npos) {
    if (dev->platform == CT_PLATFORM_CPU) return scatter_plan_check(start, nhit, pos, npos);
    int32_t *h = malloc((size_t)(nhit + 1 + npos) * sizeof(int32_t));
    if (h == NULL)
        return ct_set_error(CT_EOOM, "RESOURCE_EXHAUSTED: host out of memory for a %" PRId64
                                     "-entry row scatter plan", nhit + 1 + npos);
    const int64_t n1 = nhit + 1, st4 = 4;
    ct_status st = dev->backend->copy_block(NULL, dev, 1, &n1, 4, h, &st4, start, &st4);
    if (st == CT_OK && npos > 0)
        st = dev->backend->copy_block(NULL, dev, 1, &npos, 4, h + n1, &st4, pos, &st4);
    if (st == CT_OK) st = scatter_plan_check(h, nhit, h + n1, npos);
    free(h);
    return st;
}

ct_status ct_op_scatter_add_rows(ct_device *dev, float *table, int64_t nrows, int64_t ncols,
                                 int64_t row0, const int32_t *hit, const int32_t *start,
                                 int64_t nhit, const int32_t *pos, int64_t npos, const float *g) {
    if (nrows < 0 || ncols < 0 || nhit < 0 || npos < 0)
        return ct_set_error(CT_EINVAL, "negative row-scatter size");
    CT_TRY(need(dev, (const void *)dev->backend->scatter_add_rows, "row scatters (embedding gradients)"));
    CT_TRY(scatter_plan_check_dev(dev, start, nhit, pos, npos));
    return dev->backend->scatter_add_rows(dev, table, nrows, ncols, row0, hit, start, nhit, pos, g);
}

ct_status ct_op_gemm(ct_device *dev, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                     float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                     float beta, float *c, int64_t ldc, int prec) {
    if (m < 0 || n < 0 || k < 0) return ct_set_error(CT_EINVAL, "negative matmul size");
    if (prec < 0 || prec >= CT_PREC_COUNT)
        return ct_set_error(CT_EINVAL, "unknown matmul precision %d", prec);
    if (m == 0 || n == 0) return CT_OK; /* an empty C: nothing to write */
    const int64_t need_a = (trans_a ? m : k) > 1 ? (trans_a ? m : k) : 1;
    const int64_t need_b = (trans_b ? k : n) > 1 ? (trans_b ? k : n) : 1;
    if (k == 0) { /* C = beta C: A and B are not read, any leading dimension will do (BLAS
                   * and cuBLAS still want valid ones) */
        if (lda < need_a) lda = need_a;
        if (ldb < need_b) ldb = need_b;
    }
    if (ldc < (n > 1 ? n : 1) || lda < need_a || ldb < need_b)
        return ct_set_error(CT_EINVAL, "matmul leading dimensions too small");
    CT_TRY(need(dev, (const void *)dev->backend->gemm, "matmul"));
    return dev->backend->gemm(dev, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                              prec);
}

ct_status ct_op_allreduce(ct_device **devs, float **bufs, int nbufs, int64_t count, int op) {
    if (op < 0 || op >= CT_RED_COUNT) return ct_set_error(CT_EINVAL, "unknown reduction %d", op);
    if (nbufs < 1) return ct_set_error(CT_EINVAL, "all-reduce over no buffers");
    for (int i = 1; i < nbufs; i++)
        if (devs[i]->backend != devs[0]->backend)
            return ct_set_error(CT_EINVAL, "all-reduce across different backends");
    CT_TRY(need(devs[0], (const void *)devs[0]->backend->allreduce, "all-reduce"));
    return devs[0]->backend->allreduce(devs, bufs, nbufs, count, op);
}

int ct_op_has_allreduce_ranks(const ct_device *dev) {
    return dev->backend->nccl_unique_id != NULL && dev->backend->allreduce_ranks != NULL;
}

ct_status ct_op_nccl_unique_id(ct_device *dev, unsigned char *id) {
    CT_TRY(need(dev, (const void *)dev->backend->nccl_unique_id, "NCCL across processes"));
    return dev->backend->nccl_unique_id(dev, id);
}

ct_status ct_op_allreduce_ranks(ct_device **devs, float **bufs, int nbufs, int64_t count, int op,
                                const unsigned char *id, int nranks, const int *ranks) {
    if (op < 0 || op >= CT_RED_COUNT) return ct_set_error(CT_EINVAL, "unknown reduction %d", op);
    if (nbufs < 1) return ct_set_error(CT_EINVAL, "all-reduce over no buffers");
    if (nranks < 1) return ct_set_error(CT_EINVAL, "all-reduce across processes over no ranks");
    for (int i = 1; i < nbufs; i++)
        if (devs[i]->backend != devs[0]->backend)
            return ct_set_error(CT_EINVAL, "all-reduce across different backends");
    for (int i = 0; i < nbufs; i++)
        if (ranks[i] < 0 || ranks[i] >= nranks)
            return ct_set_error(CT_EINVAL, "all-reduce across processes: rank %d of %d", ranks[i],
                                nranks);
    CT_TRY(need(devs[0], (const void *)devs[0]->backend->allreduce_ranks,
                "all-reduce across processes"));
    return devs[0]->backend->allreduce_ranks(devs, bufs, nbufs, count, op, id, nranks, ranks);
}

ct_status ct_op_convert(ct_device *dev, int64_t n, int src_dtype, const void *x, int dst_dtype,
                        void *y) {
    if (src_dtype < 0 || src_dtype >= CT_NUM_DTYPES || dst_dtype < 0 || dst_dtype >= CT_NUM_DTYPES)
        return ct_set_error(CT_EINVAL, "convert: unknown dtype code %d -> %d", src_dtype, dst_dtype);
    if (n < 0) return ct_set_error(CT_EINVAL, "negative element count");
    if (n == 0) return CT_OK;
    CT_TRY(need(dev, (const void *)dev->backend->convert, "dtype conversions"));
    return dev->backend->convert(dev, n, src_dtype, x, dst_dtype, y);
}

ct_status ct_op_transpose(ct_device *dev, int ndim, const int64_t *shape, const int *perm,
                          size_t itemsize, const void *x, void *y) {
    if (ndim < 0 || ndim > CT_MAX_NDIM) return ct_set_error(CT_EINVAL, "rank %d", ndim);
    int64_t xs[CT_MAX_NDIM], ys[CT_MAX_NDIM], yshape[CT_MAX_NDIM], src[CT_MAX_NDIM];
    int seen[CT_MAX_NDIM] = {0};
    for (int d = 0; d < ndim; d++) {
        if (perm[d] < 0 || perm[d] >= ndim || seen[perm[d]])
            return ct_set_error(CT_EINVAL, "transpose: axes are not a permutation of 0..%d",
                                ndim - 1);
        seen[perm[d]] = 1;
    }
    int64_t s = (int64_t)itemsize;
    for (int d = ndim - 1; d >= 0; d--) {
        xs[d] = s;
        s *= shape[d];
    }
    for (int d = 0; d < ndim; d++) {
        yshape[d] = shape[perm[d]];
        src[d] = xs[perm[d]];
    }
    s = (int64_t)itemsize;
    for (int d = ndim - 1; d >= 0; d--) {
        ys[d] = s;
        s *= yshape[d];
    }
    return dev->backend->copy_block(dev, dev, ndim, yshape, itemsize, y, ys, x, src);
}

// --- typed elementwise ops and integer reductions -------------------------------------

static int is_float_dt(int dt) { return dt == CT_F32 || dt == CT_F16 || dt == CT_BF16; }

int ct_ewise_supported(int op, int dtype) {
    if (op < 0 || op >= CT_EW_COUNT || dtype < 0 || dtype >= CT_NUM_DTYPES) return 0;
    const int fl = is_float_dt(dtype), bl = dtype == CT_BOOL;
    switch (op) {
    case CT_EW_FLOORDIV: case CT_EW_REM: case CT_EW_NEG: return !bl;
    case CT_EW_AND: case CT_EW_OR: case CT_EW_XOR: case CT_EW_NOT: return !fl;
    case CT_EW_SHL: case CT_EW_SHR: return !fl && !bl;
    case CT_EW_ISNAN: case CT_EW_ISINF: case CT_EW_ISFINITE: return fl;
    default: return 1; /* comparisons, add/sub/mul/max/min, abs */
    }
}

int ct_ewise_out_dtype(int op, int dtype) {
    return (op <= CT_EW_GE || op == CT_EW_ISNAN || op == CT_EW_ISINF || op == CT_EW_ISFINITE)
               ? CT_BOOL : dtype;
}

ct_status ct_op_ewise(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape, void *out,
                      const void *a, const int64_t *a_strides, const void *b,
                      const int64_t *b_strides) {
    if (op < 0 || op >= CT_EW_COUNT) return ct_set_error(CT_EINVAL, "unknown elementwise op %d", op);
    if (dtype < 0 || dtype >= CT_NUM_DTYPES)
        return ct_set_error(CT_EINVAL, "elementwise op: unknown dtype code %d", dtype);
    if (!ct_ewise_supported(op, dtype))
        return ct_set_error(CT_EINVAL, "elementwise op %d does not accept dtype %s", op,
                            ct_dtype_name((ct_dtype)dtype));
    if (ndim < 0 || ndim > CT_MAX_NDIM) return ct_set_error(CT_EINVAL, "rank %d", ndim);
    if (op >= CT_EW_NOT) { /* unary: the backend reads a twice rather than a NULL b */
        b = a;
        b_strides = a_strides;
    }
    if (a == NULL || b == NULL || out == NULL || a_strides == NULL || b_strides == NULL)
        return ct_set_error(CT_EINVAL, "elementwise op: missing operand");
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0) return ct_set_error(CT_EINVAL, "negative dimension");
    CT_TRY(need(dev, (const void *)dev->backend->ewise, "comparisons and integer ops"));
    return dev->backend->ewise(dev, op, dtype, ndim, shape, out, a, a_strides, b, b_strides);
}

ct_status ct_op_reduce_typed(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                             uint32_t axes, const void *x, void *out) {
    if (op < 0 || op >= CT_RED_COUNT) return ct_set_error(CT_EINVAL, "unknown reduction %d", op);
    if (dtype < 0 || dtype >= CT_NUM_DTYPES || dtype == CT_F32 || dtype == CT_F16 ||
        dtype == CT_BF16)
        return ct_set_error(CT_EINVAL, "integer reduction of dtype %s",
                            ct_dtype_name((ct_dtype)dtype));
    if (ndim < 0 || ndim > CT_MAX_NDIM) return ct_set_error(CT_EINVAL, "rank %d", ndim);
    if (ndim < 32 && (axes >> ndim) != 0)
        return ct_set_error(CT_EINVAL, "reduction axes outside rank %d", ndim);
    CT_TRY(need(dev, (const void *)dev->backend->reduce_typed, "integer reductions"));
    return dev->backend->reduce_typed(dev, op, dtype, ndim, shape, axes, x, out);
}
