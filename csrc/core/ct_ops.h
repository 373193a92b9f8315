/*
 * ct_ops.h — the array operations of ctrainstate.numpy, per shard.
 *
 * An op on a sharded Array is one call per device on that device's blocks;
 * which blocks meet, and which collectives follow (the sharding propagation),
 * is decided above this layer. Here each op is validated (shapes, broadcast)
 * and dispatched to the device's backend kernels. The float ops compute in
 * float32; the typed ops (ct_op_ewise: comparisons, booleans, integer arithmetic)
 * and ct_op_reduce_typed compute in their operands' own dtype.
 *
 * Broadcasting: a binary op gets the output shape and, per input, strides in
 * elements with 0 on broadcast dimensions (numpy semantics, computed by the
 * caller from the block shapes with ct_broadcast_strides).
 */
#ifndef CT_OPS_H
#define CT_OPS_H

#include <stdint.h>

#include "ct_device.h"
#include "ct_dtype.h"
#include "ct_prec_math.h" /* CT_PREC_*: matmul precisions */
#include "ct_status.h"

typedef enum {
    CT_UN_AFFINE = 0,   /* y = alpha*x + beta; alpha == 0 fills with beta without reading x */
    CT_UN_NEG,
    CT_UN_SIN,
    CT_UN_COS,
    CT_UN_TANH,
    CT_UN_RELU,
    CT_UN_STEP,         /* y = x > 0 ? 1 : 0 (relu's derivative) */
    CT_UN_GELU,         /* tanh approximation (jax.nn.gelu(approximate=True)) */
    CT_UN_GELU_GRAD,    /* d gelu / dx, same approximation */
    CT_UN_EXP,
    CT_UN_LOG,
    CT_UN_SQRT,
    CT_UN_RSQRT,
    CT_UN_SQUARE,
    CT_UN_SIGMOID,
    CT_UN_ABS,
    CT_UN_SIGN,
    CT_UN_POW,          /* y = x^alpha (ct_pow: exact for alpha 0, 1, 2, -1) */
    CT_UN_RDIV,         /* y = alpha / x */
    /* ABI 6. Transcendental ones come from each backend's libm (log1pf, expm1f, erff, erfcf;
     * CUDA documents 1, 1, 2 and 4 ulp from the correctly rounded value, glibc's are within
     * 2 ulp on the tests' points, so CPU and GPU bits may differ by up to their sum); the
     * roundings are exact, the same bits everywhere (a NaN input comes back quietened). */
    CT_UN_LOG1P,        /* y = log(1 + x), accurate near 0 */
    CT_UN_EXPM1,        /* y = exp(x) - 1, accurate near 0 */
    CT_UN_ERF,          /* the error function */
    CT_UN_FLOOR,
    CT_UN_CEIL,
    CT_UN_ROUND,        /* to the nearest integer, halves to even (jnp.round, rintf) */
    CT_UN_TRUNC,        /* toward zero */
    CT_UN_ERFC,         /* 1 - erf(x), accurate where erf(x) is near 1 */
    /* ABI 7: jax.lax's remaining float primitives, each backend's libm float function
     * (ct_unary_ext: sinhf, coshf, tanf, asinf, acosf, atanf, asinhf, acoshf, atanhf, cbrtf,
     * exp2f; CUDA documents 1 to 4 ulp for these, glibc's are within 1-2 on the tests'
     * points), and the sign bit (exact). */
    CT_UN_SINH,
    CT_UN_COSH,
    CT_UN_TAN,
    CT_UN_ASIN,
    CT_UN_ACOS,
    CT_UN_ATAN,
    CT_UN_ASINH,
    CT_UN_ACOSH,
    CT_UN_ATANH,
    CT_UN_CBRT,
    CT_UN_EXP2,         /* 2 ** x */
    CT_UN_SIGNBIT,      /* 1.0 where x's sign bit is set (-0.0 and negative NaNs too), else 0.0 */
    CT_UN_COUNT
} ct_unary_op;

typedef enum {
    CT_BIN_ADD = 0,
    CT_BIN_SUB,
    CT_BIN_MUL,
    CT_BIN_DIV,
    CT_BIN_MAX,
    CT_BIN_MIN,
    CT_BIN_GT,          /* 1.0 where a > b, else 0.0 */
    CT_BIN_KEEP,        /* a where b != 0, else exactly 0 (even for an inf or NaN a): a select */
    CT_BIN_POW,         /* a ** b, elementwise (ct_pow: exact for b 0, 1, 2, -1; ABI 6) */
    /* ABI 7 (ct_binary_apply) */
    CT_BIN_ATAN2,       /* atan2f(a, b): the angle of the point (b, a) */
    CT_BIN_NEXTAFTER,   /* nextafterf(a, b): exact, subnormals included */
    CT_BIN_FMOD,        /* fmodf(a, b): the remainder with a's sign (lax.rem); exact */
    CT_BIN_LDEXP,       /* a * 2 ** b for an integral b (ldexpf; b clamped to +-512): exact */
    /* ABI 8 */
    CT_BIN_PICK,        /* a where b != 0, else -0.0: an addend of an exact select, since
                         * x + -0.0 is x for every x (+0.0, -0.0, inf and NaN included) */
    CT_BIN_COUNT
} ct_binary_op;

/* Typed elementwise ops (ct_op_ewise): both operands have one dtype (the caller converts
 * them to jax's promoted type first); the result is bool for the comparisons and the is*
 * tests, else of that dtype. Element semantics: ct_ewise_math.h. */
typedef enum {
    CT_EW_EQ = 0,       /* comparisons: any dtype -> bool */
    CT_EW_NE,
    CT_EW_LT,
    CT_EW_LE,
    CT_EW_GT,
    CT_EW_GE,
    CT_EW_ADD,          /* arithmetic: any dtype (floats computed in float32, rounded once) */
    CT_EW_SUB,
    CT_EW_MUL,
    CT_EW_MAX,
    CT_EW_MIN,
    CT_EW_FLOORDIV,     /* floats and ints (not bool) */
    CT_EW_REM,
    CT_EW_AND,          /* bitwise: ints and bool */
    CT_EW_OR,
    CT_EW_XOR,
    CT_EW_SHL,          /* shifts: ints only */
    CT_EW_SHR,          /* arithmetic for the signed ints, logical for the unsigned ones */
    CT_EW_NOT,          /* unary from here on (the second operand is not read): ints, bool */
    CT_EW_NEG,          /* floats and ints */
    CT_EW_ABS,          /* floats and ints */
    CT_EW_ISNAN,        /* floats -> bool */
    CT_EW_ISINF,
    CT_EW_ISFINITE,
    CT_EW_COUNT
} ct_ewise_op;

/* Element strides (0 on broadcast dims) of an input of shape `in` (rank
 * in_ndim, aligned right) broadcast to `out`; CT_EINVAL if incompatible. */
ct_status ct_broadcast_strides(int out_ndim, const int64_t *out, int in_ndim, const int64_t *in,
                               int64_t *strides);

ct_status ct_op_unary(ct_device *dev, int op, float alpha, float beta, int64_t n, const float *x,
                      float *y);

/* y = op(x) on n elements of a 16-bit float dtype (CT_BF16 or CT_F16): each element widened to
 * float32 (exactly), ct_op_unary's float32 formula, rounded back to nearest even — the bits of
 * converting, running ct_op_unary and converting back, in one kernel. */
ct_status ct_op_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n, int dtype,
                            const void *x, void *y);

/* --- fused elementwise chains ---------------------------------------------------------------
 * A chain of float32 elementwise ops run as one kernel: per output element, the value starts
 * as a[offset by a_strides] and each step replaces it — a unary step by op(value) (CT_UN_*,
 * with alpha and beta as ct_op_unary's), a binary step by op(value, other) or op(other, value)
 * (CT_BIN_*, `other` read by its broadcast strides) — and the last value is written. Each step
 * computes what the step's own kernel computes (the same formulas): the same bits as the ops
 * run one by one. Backends without a chain kernel (the CPU, which tiles chains instead): NULL,
 * and the caller runs the steps one by one. At most CT_CHAIN_MAX steps over at most
 * CT_CHAIN_NDIM dimensions. */
#define CT_CHAIN_MAX 16
#define CT_CHAIN_NDIM 8
typedef struct ct_chain_step_ {
    int binary;                       /* 0: unary op, 1: binary op */
    int op;                           /* CT_UN_* or CT_BIN_* */
    float alpha, beta;                /* a unary step's constants */
    int side;                         /* a binary step: 0 op(value, other), 1 op(other, value) */
    const float *other;               /* a binary step's other operand */
    int64_t strides[CT_CHAIN_NDIM];   /* its element strides over the output (0: broadcast) */
} ct_chain_step;

ct_status ct_op_chain(ct_device *dev, int ndim, const int64_t *shape, const float *a,
                      const int64_t *a_strides, int nsteps, const ct_chain_step *steps, float *out);

ct_status ct_op_binary(ct_device *dev, int op, int ndim, const int64_t *shape, float *out,
                       const float *a, const int64_t *a_strides, const float *b,
                       const int64_t *b_strides);

/* Reductions of ct_op_reduce and ct_op_allreduce. MAX propagates NaN (jnp.max). */
enum { CT_RED_SUM = 0, CT_RED_MAX = 1, CT_RED_COUNT };

/* out = the sum (or max) of x over the dimensions whose bit is set in `axes` (x dense). */
ct_status ct_op_reduce(ct_device *dev, int op, int ndim, const int64_t *shape, uint32_t axes,
                       const float *x, float *out);

/* Embedding rows. `table` is a block of `nrows` rows of `ncols` floats holding global rows
 * [row0, row0 + nrows); indices are global row numbers (int32, on the device).
 * gather: out[i, :] = table[ids[i] - row0, :] where that row is in the block, else 0.
 * scatter_add, given the ids grouped by row (the caller sorts them): for each of the `nhit`
 * distinct rows hit[u] in the block, table[hit[u] - row0, :] += g[pos[k], :] for k in
 * [start[u], start[u + 1]), in that order (pos ascending: the order the ids came in). Rows
 * are independent, so every backend can spread them over threads and still add each row's
 * terms in the same order: the same bits everywhere. */
ct_status ct_op_gather_rows(ct_device *dev, const float *table, int64_t nrows, int64_t ncols,
                            int64_t row0, const int32_t *ids, int64_t nids, float *out);
/* `npos`: the rows of g (entries of pos). The plan is checked first (start non-decreasing
 * from 0 to at most npos, every pos in [0, npos)): CT_EINVAL, nothing added, if not. */
ct_status ct_op_scatter_add_rows(ct_device *dev, float *table, int64_t nrows, int64_t ncols,
                                 int64_t row0, const int32_t *hit, const int32_t *start,
                                 int64_t nhit, const int32_t *pos, int64_t npos, const float *g);

/* Row-major C[m,n] = alpha * op(A) @ op(B) + beta * C, op = transpose when set.
 * `prec` (CT_PREC_*, ct_prec_math.h): CT_PREC_F32 multiplies the float32 operands as they
 * are; CT_PREC_TF32 / CT_PREC_BF16 round every element of A and B to TF32 / bfloat16
 * first (ct_prec_round) and accumulate in float32 (cuBLAS: the FAST_TF32 / FAST_16BF
 * compute types). alpha, beta and C are not rounded. */
ct_status ct_op_gemm(ct_device *dev, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                     float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                     float beta, float *c, int64_t ldc, int prec);

/* In-process all-reduce: every buffer becomes the elementwise sum (or max) of
 * all of them (combined in buffer order, so the result is deterministic). */
ct_status ct_op_allreduce(ct_device **devs, float **bufs, int nbufs, int64_t count, int op);

/* NCCL across processes (ct_backend's nccl_unique_id / allreduce_ranks): a new unique id
 * (CT_NCCL_ID_BYTES) made by dev's backend, and an all-reduce of this process's members of
 * a group that spans processes. ct_op_has_allreduce_ranks: whether dev's backend has them. */
int ct_op_has_allreduce_ranks(const ct_device *dev);
ct_status ct_op_nccl_unique_id(ct_device *dev, unsigned char *id);
ct_status ct_op_allreduce_ranks(ct_device **devs, float **bufs, int nbufs, int64_t count, int op,
                                const unsigned char *id, int nranks, const int *ranks);

/* An optimized single-precision GEMM with the Fortran BLAS signature (column
 * major), e.g. scipy's OpenBLAS; NULL restores the built-in kernel. */
typedef void (*ct_sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                            const int *k, const float *alpha, const float *a, const int *lda,
                            const float *b, const int *ldb, const float *beta, float *c,
                            const int *ldc);
void ct_set_blas_sgemm(ct_sgemm_fn fn);
ct_sgemm_fn ct_get_blas_sgemm(void);



/* y[i] = x[i] converted from dtype src_dtype to dst_dtype (ct_dtype codes), n dense elements:
 * jax's convert_element_type, as ct_convert_math.h defines it (floats round to nearest even;
 * floats to ints truncate and saturate, NaN -> 0; ints wrap; bool is x != 0). */
ct_status ct_op_convert(ct_device *dev, int64_t n, int src_dtype, const void *x, int dst_dtype,
                        void *y);

/* out = op(a, b) elementwise with broadcasting (strides as ct_op_binary's, in elements),
 * a and b of dtype `dtype`, out of dtype bool for comparisons and is* tests and `dtype`
 * otherwise (ct_ewise_math.h). A unary op reads a only (b and b_strides may be NULL).
 * CT_EINVAL names an op the dtype does not have (a shift of floats, isnan of ints). */
ct_status ct_op_ewise(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape, void *out,
                      const void *a, const int64_t *a_strides, const void *b,
                      const int64_t *b_strides);

/* Whether ct_op_ewise has op for operands of dtype (1) or not (0); the result's dtype. */
int ct_ewise_supported(int op, int dtype);
int ct_ewise_out_dtype(int op, int dtype);

/* out = the sum (wrapping) or maximum (CT_RED_SUM / CT_RED_MAX) of an integer or bool
 * block x (dense) over the dims in `axes`, in x's dtype (jnp.sum's widening of bool and the
 * narrow ints to 32 bits is a conversion before this, as XLA does it). */
ct_status ct_op_reduce_typed(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                             uint32_t axes, const void *x, void *out);

/* y = transpose(x, perm): x dense of `shape`, y dense of the permuted shape. */
ct_status ct_op_transpose(ct_device *dev, int ndim, const int64_t *shape, const int *perm,
                          size_t itemsize, const void *x, void *y);
#endif /* CT_OPS_H */
