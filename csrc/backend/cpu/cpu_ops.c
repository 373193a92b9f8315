/*
 * cpu_ops.c — OpenMP kernels of the array ops on CPU devices (ct_ops.h).
 *
 * Elementwise loops are written so gcc vectorises them (-O3); transcendental
 * functions come from libm. GEMM goes to an optimized BLAS when one was
 * registered (ct_set_blas_sgemm: the bindings hand over scipy's OpenBLAS
 * sgemm when available) and otherwise to a cache-blocked OpenMP kernel here;
 * TF32 / bfloat16 precisions round the operands as ct_prec_math.h defines (as
 * they are read in the built-in kernel, tile by tile into a bounded scratch for
 * the BLAS) and accumulate in float32.
 */
/* No errno from libm here: lets sqrtf/logf loops vectorise (ops report NaN/inf, not errno). */
#pragma GCC optimize("no-math-errno")
#pragma GCC optimize("fp-contract=off") /* no FMA contraction in the wider clones: same bits */

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/ct_convert_math.h"
#include "../../core/ct_ewise_math.h"
#include "../../core/ct_layout.h"
#include "../../core/ct_ops.h"
#include "../../core/ct_ops_math.h"
#include "../../core/ct_par.h"
#include "../../core/ct_prec_math.h"
#include "cpu_ops.h"
#include "cpu_vmath.h"

#define PAR_MIN 32768 /* below this many elements a parallel region costs more than it saves */

/* The transcendental loops (sin, cos, exp, tanh, sigmoid) are compute-bound: besides the
 * build's baseline (x86-64-v2, 4 floats a vector) each is also compiled for AVX2 (v3) and
 * AVX-512 (v4), and the loader picks the widest the CPU has (GCC function multiversioning).
 * FP contraction is off (the file's pragma), so the wider clones make the same IEEE
 * operations in the same order: the same bits on every machine. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(__SANITIZE_ADDRESS__)
#define CT_VCLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CT_VCLONES
#endif
enum { VK_SIN = 0, VK_COS, VK_EXP, VK_TANH, VK_SIGMOID };
#define VBLOCK 8192 /* elements a task runs through the clone */

CT_VCLONES static void vmath_run(int kind, int64_t n, const float *restrict x, float *restrict y) {
    switch (kind) {
    case VK_SIN:
    case VK_COS: {
        const int want_cos = kind == VK_COS;
        int huge = 0;
        for (int64_t i = 0; i < n; i++) {
            y[i] = ct_vsincos(x[i], want_cos);
            huge |= !(fabsf(x[i]) < CT_VSIN_MAX);
        }
        if (huge) /* the rare huge arguments (and NaN/inf): libm's full range reduction */
            for (int64_t i = 0; i < n; i++)
                if (!(fabsf(x[i]) < CT_VSIN_MAX)) y[i] = want_cos ? cosf(x[i]) : sinf(x[i]);
        break;
    }
    case VK_EXP:
        for (int64_t i = 0; i < n; i++) y[i] = ct_vexp(x[i]);
        break;
    case VK_TANH:
        for (int64_t i = 0; i < n; i++) y[i] = ct_vtanh(x[i]);
        break;
    default: /* (a NaN comes back as it came: the vector and scalar NaN rules differ) */
        for (int64_t i = 0; i < n; i++) {
            const float v = x[i];
            y[i] = v != v ? v : 1.0f / (1.0f + ct_vexp(-v));
        }
        break;
    }
}

/* y = f(x) for one of the VK_ kinds, in blocks of VBLOCK over the threads. x and y may be the
 * same buffer (in place), never partly overlapping. */
static void vmath(int kind, int64_t n, const float *x, float *y) {
    if (x == y) { /* (restrict: the clone must not see aliasing pointers) */
        CT_PAR_FOR(ct_par_threads(n > PAR_MIN), b, (n + 511) / 512, {
            float tmp[512];
            const int64_t lo = b * 512, m = n - lo < 512 ? n - lo : 512;
            vmath_run(kind, m, x + lo, tmp);
            memcpy(y + lo, tmp, (size_t)m * sizeof(float));
        });
        return;
    }
    CT_PAR_FOR(ct_par_threads(n > PAR_MIN), b, (n + VBLOCK - 1) / VBLOCK, {
        const int64_t lo = b * VBLOCK, m = n - lo < VBLOCK ? n - lo : VBLOCK;
        vmath_run(kind, m, x + lo, y + lo);
    });
}

// --- unary ------------------------------------------------------------------------

static inline float gelu_tanh(float x) { return ct_gelu_from_tanh(x, ct_vtanh(ct_gelu_inner(x))); }

static inline float gelu_tanh_grad(float x) {
    return ct_gelu_grad_from_tanh(x, ct_vtanh(ct_gelu_inner(x)));
}

enum { UN_PIECE = 16384 }; /* elements one task of ct_cpu_unary runs (at most) */

/* y[i] = op(x[i]) for i < n, in the widest clone the CPU runs (elementwise: the same bits in
 * each); -1 for an op it does not know (the transcendental ones go to vmath). */
CT_VCLONES static int unary_range(int op, float alpha, float beta, int64_t n,
                                  const float *x, float *y) {
#define LOOP(expr) \
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) { const float v = x[i]; y[i] = (expr); }
    switch (op) {
    case CT_UN_AFFINE:
        if (alpha == 0.0f) { /* a fill: must not read x (it may be uninitialised) */
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) y[i] = beta;
        } else {
            LOOP(alpha * v + beta);
        }
        break;
    case CT_UN_NEG: LOOP(-v); break;
    case CT_UN_RELU: LOOP((v > 0.0f || v != v) ? v : 0.0f); break; /* NaN stays NaN (jnp) */
    case CT_UN_STEP: LOOP(v > 0.0f ? 1.0f : 0.0f); break;
    case CT_UN_GELU: LOOP(gelu_tanh(v)); break;
    case CT_UN_GELU_GRAD: LOOP(gelu_tanh_grad(v)); break;
    case CT_UN_LOG: LOOP(logf(v)); break;
    case CT_UN_SQRT: LOOP(sqrtf(v)); break;
    case CT_UN_RSQRT: LOOP(1.0f / sqrtf(v)); break;
    case CT_UN_SQUARE: LOOP(v * v); break;
    case CT_UN_ABS: LOOP(fabsf(v)); break;
    case CT_UN_SIGN: LOOP(ct_sign(v)); break;
    case CT_UN_POW: LOOP(ct_pow(v, alpha)); break;
    case CT_UN_RDIV: LOOP(alpha / v); break;
    case CT_UN_LOG1P: LOOP(log1pf(v)); break;
    case CT_UN_EXPM1: LOOP(expm1f(v)); break;
    case CT_UN_ERF: LOOP(erff(v)); break;
    case CT_UN_FLOOR: LOOP(ct_unary_ext(CT_UN_FLOOR, v)); break; /* a NaN quietened: ct_ops_math.h */
    case CT_UN_CEIL: LOOP(ct_unary_ext(CT_UN_CEIL, v)); break;
    case CT_UN_ROUND: LOOP(ct_unary_ext(CT_UN_ROUND, v)); break;
    case CT_UN_TRUNC: LOOP(ct_unary_ext(CT_UN_TRUNC, v)); break;
    case CT_UN_ERFC: LOOP(erfcf(v)); break;
    case CT_UN_SINH: LOOP(sinhf(v)); break;
    case CT_UN_COSH: LOOP(coshf(v)); break;
    case CT_UN_TAN: LOOP(tanf(v)); break;
    case CT_UN_ASIN: LOOP(asinf(v)); break;
    case CT_UN_ACOS: LOOP(acosf(v)); break;
    case CT_UN_ATAN: LOOP(atanf(v)); break;
    case CT_UN_ASINH: LOOP(asinhf(v)); break;
    case CT_UN_ACOSH: LOOP(acoshf(v)); break;
    case CT_UN_ATANH: LOOP(atanhf(v)); break;
    case CT_UN_CBRT: LOOP(cbrtf(v)); break;
    case CT_UN_EXP2: LOOP(exp2f(v)); break;
    case CT_UN_SIGNBIT: LOOP(ct_signbit(v)); break;
    default: return -1;
    }
#undef LOOP
    return 0;
}

ct_status ct_cpu_unary(ct_device *dev, int op, float alpha, float beta, int64_t n, const float *x,
                       float *y) {
    (void)dev;
    switch (op) {
    case CT_UN_SIN: vmath(VK_SIN, n, x, y); return CT_OK;
    case CT_UN_COS: vmath(VK_COS, n, x, y); return CT_OK;
    case CT_UN_TANH: vmath(VK_TANH, n, x, y); return CT_OK;
    case CT_UN_EXP: vmath(VK_EXP, n, x, y); return CT_OK;
    case CT_UN_SIGMOID: vmath(VK_SIGMOID, n, x, y); return CT_OK;
    default: break;
    }
    if (n <= UN_PIECE) {
        if (unary_range(op, alpha, beta, n, x, y) < 0)
            return ct_set_error(CT_EINVAL, "unknown unary op %d", op);
        return CT_OK;
    }
    if (unary_range(op, alpha, beta, 0, x, y) < 0) /* (the op checked before any task runs) */
        return ct_set_error(CT_EINVAL, "unknown unary op %d", op);
    CT_PAR_FOR(ct_par_threads(n > PAR_MIN), t, (n + UN_PIECE - 1) / UN_PIECE,
               const int64_t i0 = t * UN_PIECE;
               (void)unary_range(op, alpha, beta, n - i0 < UN_PIECE ? n - i0 : UN_PIECE, x + i0,
                                 y + i0));
    return CT_OK;
}

// --- binary with broadcasting ----------------------------------------------------------

enum { BIN_PIECE = 16384 }; /* elements one task of ct_cpu_binary runs (at most) */

/* `rows` inner rows of n elements, row r at o + r * n, a + r * ra and b + r * rb, with
 * element strides sa, sb (0 = broadcast, 1 = dense): the op chosen once for all of them. */
CT_VCLONES static void bin_rows(int op, int64_t rows, int64_t n, float *o0, const float *a0, int64_t ra,
                     int64_t sa, const float *b0, int64_t rb, int64_t sb) {
#define ROW(expr)                                                                  \
    for (int64_t r_ = 0; r_ < rows; r_++) {                                        \
        float *o = o0 + r_ * n;                                                    \
        const float *a = a0 + r_ * ra, *b = b0 + r_ * rb;                          \
        if (sa == 1 && sb == 1) {                                                  \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {                  \
                float x = a[i], y = b[i];                                          \
                o[i] = (expr);                                                     \
            }                                                                      \
        } else if (sa == 1 && sb == 0) {                                           \
            const float y = b[0];                                                  \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {                  \
                float x = a[i];                                                    \
                o[i] = (expr);                                                     \
            }                                                                      \
        } else if (sa == 0 && sb == 1) {                                           \
            const float x = a[0];                                                  \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {                  \
                float y = b[i];                                                    \
                o[i] = (expr);                                                     \
            }                                                                      \
        } else if (sa == 0 && sb == 0) { /* one value along the row */             \
            const float x = a[0], y = b[0], v = (expr);                            \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) o[i] = v;          \
        } else {                                                                   \
            for (int64_t i = 0; i < n; i++) {                                      \
                float x = a[i * sa], y = b[i * sb];                                \
                o[i] = (expr);                                                     \
            }                                                                      \
        }                                                                          \
    }
    switch (op) {
    case CT_BIN_ADD: ROW(x + y); break;
    case CT_BIN_SUB: ROW(x - y); break;
    case CT_BIN_MUL: ROW(x * y); break;
    case CT_BIN_DIV: ROW(x / y); break;
    /* (ct_binary_apply's expressions, inline so that the loops vectorise: max(v, v) is the
     * broadcasting copy of the dispatcher's K_BCAST plans, a reduction's cotangent) */
    case CT_BIN_MAX: ROW((x > y || x != x) ? x : y); break;
    case CT_BIN_MIN: ROW((x < y || x != x) ? x : y); break;
    default: ROW(ct_binary_apply(op, x, y)); break;
    }
#undef ROW
}

ct_status ct_cpu_binary(ct_device *dev, int op, int ndim, const int64_t *shape, float *out,
                        const float *a, const int64_t *as, const float *b, const int64_t *bs) {
    (void)dev;
    if (ndim == 0) {
        out[0] = ct_binary_apply(op, a[0], b[0]);
        return CT_OK;
    }
    int64_t total = 1;
    for (int d = 0; d < ndim; d++) total *= shape[d];
    if (total == 0) return CT_OK;
    /* Dims merged where both operands step through them as through one (a dense operand,
     * one broadcast along both, a dim of size 1), so that rows are as long as they can be:
     * a dense or scalar operand makes one row of the whole. */
    int64_t sh[CT_MAX_NDIM], sa_[CT_MAX_NDIM], sb_[CT_MAX_NDIM];
    int nd = 0; /* merged dims, innermost first */
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] == 1) continue;
        if (nd > 0 && as[d] == sa_[nd - 1] * sh[nd - 1] && bs[d] == sb_[nd - 1] * sh[nd - 1]) {
            sh[nd - 1] *= shape[d];
            continue;
        }
        sh[nd] = shape[d];
        sa_[nd] = as[d];
        sb_[nd] = bs[d];
        nd++;
    }
    if (nd == 0) { /* every dim of size 1 */
        out[0] = ct_binary_apply(op, a[0], b[0]);
        return CT_OK;
    }
    int64_t mshape[CT_MAX_NDIM], mas[CT_MAX_NDIM], mbs[CT_MAX_NDIM]; /* outermost first */
    for (int j = 0; j < nd; j++) {
        mshape[j] = sh[nd - 1 - j];
        mas[j] = sa_[nd - 1 - j];
        mbs[j] = sb_[nd - 1 - j];
    }
    const int64_t inner = mshape[nd - 1];
    const int64_t rows = total / inner;
    const int64_t sa = mas[nd - 1], sb = mbs[nd - 1];
    const int nt = ct_par_threads(total > PAR_MIN);
    if (nd == 2 && inner <= BIN_PIECE) { /* blocks of whole rows, each a task */
        const int64_t ra = mas[0], rb = mbs[0], per = BIN_PIECE / inner;
        CT_PAR_FOR(nt, t, (rows + per - 1) / per,
                   const int64_t r0 = t * per;
                   bin_rows(op, rows - r0 < per ? rows - r0 : per, inner, out + r0 * inner,
                            a + r0 * ra, ra, sa, b + r0 * rb, rb, sb));
        return CT_OK;
    }
    /* each row in pieces of at most BIN_PIECE elements, the tasks of the parallel loop */
    const int64_t pieces = (inner + BIN_PIECE - 1) / BIN_PIECE;
    CT_PAR_FOR(nt, t, rows * pieces,
               const int64_t r = t / pieces, i0 = t % pieces * BIN_PIECE;
               const int64_t len = inner - i0 < BIN_PIECE ? inner - i0 : BIN_PIECE;
               int64_t ao; int64_t bo; /* outer coordinates of row r */
               ct_offsets2(r, nd - 1, mshape, mas, mbs, &ao, &bo);
               bin_rows(op, 1, len, out + r * inner + i0, a + ao + i0 * sa, 0, sa,
                        b + bo + i0 * sb, 0, sb));
    return CT_OK;
}

// --- sum over axes ---------------------------------------------------------------

/* base + the offset (in elements) of row-major index t over dims[0..n) with strides. */
static inline int64_t unravel_offset(int64_t t, int n, const int64_t *dims, const int64_t *strides,
                                     int64_t base) {
    for (int j = n - 1; j >= 0; j--) {
        base += (t % dims[j]) * strides[j];
        t /= dims[j];
    }
    return base;
}

/* Output row o (inner elements of a kept innermost dim) of a reduction: the rows of x at
 * base + each reduced offset, combined elementwise. */
CT_VCLONES static void red_row(float *o, const float *x, int64_t inner, int64_t base, int64_t nred, int nr,
                    const int64_t *red, const int64_t *rstride, int op) {
    for (int64_t i = 0; i < inner; i++) o[i] = ct_red_identity(op);
    for (int64_t t = 0; t < nred; t++) {
        /* (one reduced dim, a bias gradient's rows: its offset without the divisions) */
        const float *src = x + (nr == 1 ? base + t * rstride[0]
                                        : unravel_offset(t, nr, red, rstride, base));
        if (op == CT_RED_MAX) {
#pragma omp simd
            for (int64_t i = 0; i < inner; i++) o[i] = ct_red_combine(CT_RED_MAX, o[i], src[i]);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < inner; i++) o[i] += src[i];
        }
    }
}

/* One output element of a reduction: x's elements at base + each reduced offset (sums in
 * float runs of the innermost contiguous dim, added in double; maxima exact in float). */
static float red_one(const float *x, int64_t base, int64_t nred, int nr, const int64_t *red,
                     const int64_t *rstride, int op) {
    if (op == CT_RED_MAX) { /* exact in float: no wider accumulator, any order */
        float m = ct_red_identity(CT_RED_MAX);
        for (int64_t t = 0; t < nred; t++)
            m = ct_red_combine(CT_RED_MAX, m, x[unravel_offset(t, nr, red, rstride, base)]);
        return m;
    }
    double acc = 0.0;
    if (nr >= 1 && rstride[nr - 1] == 1 && red[nr - 1] > 0) {
        /* innermost reduced dim is contiguous (and not empty): sum rows */
        int64_t inner = red[nr - 1];
        int64_t outer = nred / inner;
        for (int64_t t = 0; t < outer; t++) {
            const int64_t off = unravel_offset(t, nr - 1, red, rstride, base);
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < inner; i++) s += x[off + i];
            acc += s;
        }
    } else {
        for (int64_t t = 0; t < nred; t++) acc += x[unravel_offset(t, nr, red, rstride, base)];
    }
    return (float)acc;
}

ct_status ct_cpu_reduce(ct_device *dev, int op, int ndim, const int64_t *shape, uint32_t axes,
                        const float *x, float *out) {
    (void)dev;
    /* Output index space: the kept dims in order. For each output element,
     * combine the reduced dims (sums in double past the innermost run); when the
     * innermost dim is kept, accumulate whole rows so the inner loop stays contiguous. */
    int64_t kept[CT_MAX_NDIM], kstride[CT_MAX_NDIM], red[CT_MAX_NDIM], rstride[CT_MAX_NDIM];
    int nk = 0, nr = 0;
    int64_t stride = 1, xs[CT_MAX_NDIM];
    for (int d = ndim - 1; d >= 0; d--) {
        xs[d] = stride;
        stride *= shape[d];
    }
    int64_t nout = 1, nred = 1;
    for (int d = 0; d < ndim; d++) {
        if (axes & (1u << d)) {
            red[nr] = shape[d];
            rstride[nr++] = xs[d];
            nred *= shape[d];
        } else {
            kept[nk] = shape[d];
            kstride[nk++] = xs[d];
            nout *= shape[d];
        }
    }
    if (nout == 0) return CT_OK;
    int inner_kept = ndim > 0 && !(axes & (1u << (ndim - 1)));
    if (inner_kept && nred > 0) {
        /* rows of the innermost (kept) dim */
        int64_t inner = shape[ndim - 1];
        int64_t orows = nout / inner;
        CT_PAR_FOR(ct_par_threads(nout * nred > PAR_MIN), r, orows,
                   red_row(out + r * inner, x, inner, unravel_offset(r, nk - 1, kept, kstride, 0),
                           nred, nr, red, rstride, op));
        return CT_OK;
    }
    CT_PAR_FOR(ct_par_threads(nout * nred > PAR_MIN), q, nout,
               out[q] = red_one(x, unravel_offset(q, nk, kept, kstride, 0), nred, nr, red,
                                rstride, op));
    return CT_OK;
}

// --- GEMM ------------------------------------------------------------------------

/* Built-in kernel: C = alpha*op(A)op(B) + beta*C, row-major, blocked over k
 * and parallel over rows of C; the inner loop is a contiguous axpy. `drop`
 * (ct_prec_drop_bits) rounds every operand element as it is read, so a reduced
 * precision needs no rounded copy; the kernel is inlined with a constant
 * `drop`, and with 0 it is the plain float32 loop. */
static inline __attribute__((always_inline)) void gemm_kernel(int ta, int tb, int64_t m, int64_t n,
                                                              int64_t k, float alpha, const float *a,
                                                              int64_t lda, const float *b,
                                                              int64_t ldb, float beta, float *c,
                                                              int64_t ldc, int drop) {
    enum { KB = 256 };
#pragma omp parallel for schedule(static) num_threads(ct_par_threads(m * n * k > 1000000))
    for (int64_t i = 0; i < m; i++) {
        float *ci = c + i * ldc;
        if (beta == 0.0f) memset(ci, 0, (size_t)n * sizeof(float));
        else if (beta != 1.0f)
            for (int64_t j = 0; j < n; j++) ci[j] *= beta;
        for (int64_t k0 = 0; k0 < k; k0 += KB) {
            int64_t k1 = k0 + KB < k ? k0 + KB : k;
            for (int64_t p = k0; p < k1; p++) {
                float av = alpha * ct_prec_round(ta ? a[p * lda + i] : a[i * lda + p], drop);
                if (!tb) {
                    const float *bp = b + p * ldb;
#pragma omp simd
                    for (int64_t j = 0; j < n; j++) ci[j] += av * ct_prec_round(bp[j], drop);
                } else {
                    for (int64_t j = 0; j < n; j++) ci[j] += av * ct_prec_round(b[j * ldb + p], drop);
                }
            }
        }
    }
}

static void gemm_builtin(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                         const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                         float *c, int64_t ldc, int prec) {
    switch (ct_prec_drop_bits(prec)) {
    case 13: gemm_kernel(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 13); break;
    case 16: gemm_kernel(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 16); break;
    default: gemm_kernel(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 0); break;
    }
}

/* A reduced precision through the BLAS, which cannot round its inputs: the product runs
 * over tiles of TILE_K columns of op(A) by TILE_N columns of op(B). Each tile of op(B) is
 * rounded into a shared scratch, each thread rounds TILE_M-row slices of the matching
 * tile of op(A) into its own, and the BLAS adds their product into C (beta on the first
 * K tile, 1 after). Scratch: TILE_K * TILE_N + threads * TILE_M * TILE_K floats (4 MiB +
 * 1 MiB a thread at most), never a rounded copy of a whole operand. */
enum { TILE_K = 512, TILE_N = 2048, TILE_M = 512 };

static ct_status gemm_blas_rounded(ct_sgemm_fn blas, int ta, int tb, int64_t m, int64_t n,
                                   int64_t k, float alpha, const float *a, int64_t lda,
                                   const float *b, int64_t ldb, float beta, float *c,
                                   int64_t ldc, int drop) {
    const int nt = ct_par_max_threads();
    const int64_t kt = k < TILE_K ? k : TILE_K, ntl = n < TILE_N ? n : TILE_N;
    /* row slices: at most TILE_M rows, and no more slices than it takes to keep every thread
     * busy (each slice makes the BLAS pack the tile of op(B) again) */
    const int64_t per_thread = (m + nt - 1) / nt;
    const int64_t mt = per_thread < TILE_M ? per_thread : TILE_M, mchunks = (m + mt - 1) / mt;
    size_t bbytes = (size_t)(kt * ntl) * sizeof(float), abytes = (size_t)(nt * mt * kt) * sizeof(float);
    float *bs = malloc(bbytes), *as = malloc(abytes);
    if (bs == NULL || as == NULL) {
        free(bs);
        free(as);
        return ct_set_error(CT_EOOM, "RESOURCE_EXHAUSTED: host out of memory for %zu bytes of "
                                     "matmul rounding scratch", bbytes + abytes);
    }
    const int ildc = (int)ldc;
    for (int64_t k0 = 0; k0 < k; k0 += kt) {
        const int64_t kb = k - k0 < kt ? k - k0 : kt;
        const float bet = k0 == 0 ? beta : 1.0f;
        for (int64_t n0 = 0; n0 < n; n0 += ntl) {
            const int64_t nb = n - n0 < ntl ? n - n0 : ntl;
            const int par = mchunks > 1 && 2 * m * nb * kb >= (1 << 22);
#pragma omp parallel num_threads(ct_par_team(par ? nt : 1))
            {
                /* op(B)[k0 + p, n0 + j] -> bs[p * nb + j] */
                if (!tb) {
#pragma omp for schedule(static)
                    for (int64_t p = 0; p < kb; p++)
                        for (int64_t j = 0; j < nb; j++)
                            bs[p * nb + j] = ct_prec_round(b[(k0 + p) * ldb + n0 + j], drop);
                } else {
#pragma omp for schedule(static)
                    for (int64_t j = 0; j < nb; j++)
                        for (int64_t p = 0; p < kb; p++)
                            bs[p * nb + j] = ct_prec_round(b[(n0 + j) * ldb + k0 + p], drop);
                }
                float *my = as + (size_t)omp_get_thread_num() * (size_t)(mt * kt);
#pragma omp for schedule(static)
                for (int64_t ch = 0; ch < mchunks; ch++) {
                    const int64_t r0 = ch * mt, mb = m - r0 < mt ? m - r0 : mt;
                    /* op(A)[r0 + i, k0 + p] -> my[i * kb + p] */
                    for (int64_t i = 0; i < mb; i++)
                        for (int64_t p = 0; p < kb; p++)
                            my[i * kb + p] = ct_prec_round(
                                ta ? a[(k0 + p) * lda + r0 + i] : a[(r0 + i) * lda + k0 + p], drop);
                    /* row-major C[r0:, n0:] (mb x nb) = my (mb x kb) @ bs (kb x nb), i.e.
                     * column-major C^T = bs^T my^T */
                    int inb = (int)nb, imb = (int)mb, ikb = (int)kb;
                    blas("N", "N", &inb, &imb, &ikb, &alpha, bs, &inb, my, &ikb, &bet,
                         c + r0 * ldc + n0, &ildc);
                }
            }
        }
    }
    free(bs);
    free(as);
    return CT_OK;
}

/* Small products: op(B) (k x n, n padded to a multiple of SMALL_W) fits SMALL_TILE floats.
 * op(B) is packed (rounded to the precision) into a zero-padded tile on the stack (a dense,
 * aligned op(B) at full precision is that tile already and is read in place), and C is
 * computed SMALL_ROWS rows by SMALL_W columns at a time, accumulated in registers over k in
 * order: every element of C is ((a0*b0 + a1*b1) + a2*b2) + ..., rounded at each step (no FMA:
 * the file's pragma), times alpha, plus beta*C when beta is not 0. That sum depends on
 * nothing but its own row and column, so any split of the rows or columns (a sharded
 * matmul on any mesh) and every vector width gives the same bits. It replaces the BLAS call
 * for these sizes, where the call and its parallel region cost several times the product. */
enum { SMALL_W = 16, SMALL_ROWS = 4, SMALL_TILE = 4096, SMALL_CHUNK = 64 };

/* Half of SMALL_W columns: a vector AVX2 holds in one register. A SMALL_W-wide vector type
 * is lowered through the stack where the target has no such register; two halves are not. */
typedef float small_half __attribute__((vector_size(SMALL_W / 2 * sizeof(float))));

/* `rows` rows of C (from c) from their rounded elements of op(A) (row r, column p at
 * ap[p * sp + r * sr]) and the tile: each SMALL_W columns held in registers (two halves a
 * row) while k runs in order. */
static inline __attribute__((always_inline)) void gemm_small_block(
    const int rows, int64_t n, int64_t np, int64_t k, float alpha, const float *restrict ap,
    int64_t sp, int64_t sr, const float *restrict bs, float beta, float *c, int64_t ldc) {
    for (int64_t j0 = 0; j0 < np; j0 += SMALL_W) {
        small_half lo[SMALL_ROWS], hi[SMALL_ROWS];
        for (int r = 0; r < rows; r++) lo[r] = hi[r] = (small_half){0};
        for (int64_t p = 0; p < k; p++) {
            const small_half b0 = *(const small_half *)(bs + p * np + j0);
            const small_half b1 = *(const small_half *)(bs + p * np + j0 + SMALL_W / 2);
            for (int r = 0; r < rows; r++) {
                const float s = ap[p * sp + r * sr];
                lo[r] += s * b0;
                hi[r] += s * b1;
            }
        }
        const int nb = n - j0 < SMALL_W ? (int)(n - j0) : SMALL_W;
        if (nb == SMALL_W && beta == 0.0f) { /* whole vectors stored (the same values) */
            for (int r = 0; r < rows; r++) {
                const small_half vlo = alpha * lo[r], vhi = alpha * hi[r];
                memcpy(c + r * ldc + j0, &vlo, sizeof vlo);
                memcpy(c + r * ldc + j0 + SMALL_W / 2, &vhi, sizeof vhi);
            }
            continue;
        }
        for (int r = 0; r < rows; r++) {
            float v[SMALL_W] __attribute__((aligned(32)));
            *(small_half *)v = alpha * lo[r];
            *(small_half *)(v + SMALL_W / 2) = alpha * hi[r];
            float *cr = c + r * ldc + j0;
            if (beta == 0.0f)
                for (int jj = 0; jj < nb; jj++) cr[jj] = v[jj];
            else
                for (int jj = 0; jj < nb; jj++) cr[jj] = v[jj] + beta * cr[jj];
        }
    }
}

/* Rows [r0, r1) of C from the packed tile: groups of SMALL_ROWS, then single rows. op(A) is
 * read in place at full precision; rounded to a lower one, each group's elements are packed
 * and rounded first (k <= SMALL_TILE / SMALL_W). */
CT_VCLONES static void gemm_small_rows(int ta, int64_t r0, int64_t r1, int64_t n, int64_t np,
                                       int64_t k, float alpha, const float *a, int64_t lda,
                                       const float *restrict bs, float beta, float *c,
                                       int64_t ldc, int drop) {
    float ap[SMALL_TILE / SMALL_W * SMALL_ROWS];
    /* op(A)'s element (row i, column p) at a[i * ai + p * ak] */
    const int64_t ai = ta ? 1 : lda, ak = ta ? lda : 1;
    int64_t i = r0;
    if (drop == 0) {
        for (; i + SMALL_ROWS <= r1; i += SMALL_ROWS)
            gemm_small_block(SMALL_ROWS, n, np, k, alpha, a + i * ai, ak, ai, bs, beta,
                             c + i * ldc, ldc);
        for (; i < r1; i++)
            gemm_small_block(1, n, np, k, alpha, a + i * ai, ak, ai, bs, beta, c + i * ldc, ldc);
        return;
    }
    for (; i + SMALL_ROWS <= r1; i += SMALL_ROWS) {
        for (int64_t p = 0; p < k; p++)
            for (int r = 0; r < SMALL_ROWS; r++)
                ap[p * SMALL_ROWS + r] =
                    ct_prec_round(ta ? a[p * lda + i + r] : a[(i + r) * lda + p], drop);
        gemm_small_block(SMALL_ROWS, n, np, k, alpha, ap, SMALL_ROWS, 1, bs, beta, c + i * ldc,
                         ldc);
    }
    for (; i < r1; i++) {
        for (int64_t p = 0; p < k; p++) ap[p] = ct_prec_round(ta ? a[p * lda + i] : a[i * lda + p], drop);
        gemm_small_block(1, n, np, k, alpha, ap, 1, 1, bs, beta, c + i * ldc, ldc);
    }
}

/* Rows [r0, r1) of C for a narrow op(B) (n < SMALL_W / 2 columns, k <= SMALL_NARROW_K,
 * packed without padding): SMALL_W rows at a time, their elements of op(A) packed transposed
 * (at[p * SMALL_W + r]), each column of C one vector over those rows, accumulated over k in
 * order: the same sums, so the same bits, as gemm_small_rows. */
enum { SMALL_NARROW_K = 64 };

CT_VCLONES static void gemm_narrow_rows(int ta, int64_t r0, int64_t r1, int64_t n, int64_t k,
                                        float alpha, const float *a, int64_t lda,
                                        const float *restrict bs, float beta, float *c,
                                        int64_t ldc, int drop) {
    float at[SMALL_NARROW_K * SMALL_W] __attribute__((aligned(64)));
    for (int64_t i = r0; i < r1; i += SMALL_W) {
        const int rows = r1 - i < SMALL_W ? (int)(r1 - i) : SMALL_W;
        for (int64_t p = 0; p < k; p++) {
            if (ta) /* (op(A)'s column p of these rows is contiguous: a vector copy) */
                for (int r = 0; r < rows; r++)
                    at[p * SMALL_W + r] = ct_prec_round(a[p * lda + i + r], drop);
            else
                for (int r = 0; r < rows; r++)
                    at[p * SMALL_W + r] = ct_prec_round(a[(i + r) * lda + p], drop);
            for (int r = rows; r < SMALL_W; r++) at[p * SMALL_W + r] = 0.0f;
        }
        for (int64_t j = 0; j < n; j++) {
            small_half lo = (small_half){0}, hi = (small_half){0};
            for (int64_t p = 0; p < k; p++) {
                const float s = bs[p * n + j];
                lo += s * *(const small_half *)(at + p * SMALL_W);
                hi += s * *(const small_half *)(at + p * SMALL_W + SMALL_W / 2);
            }
            float v[SMALL_W] __attribute__((aligned(32)));
            *(small_half *)v = alpha * lo;
            *(small_half *)(v + SMALL_W / 2) = alpha * hi;
            float *cj = c + i * ldc + j;
            if (beta == 0.0f)
                for (int r = 0; r < rows; r++) cj[r * ldc] = v[r];
            else
                for (int r = 0; r < rows; r++) cj[r * ldc] = v[r] + beta * cj[r * ldc];
        }
    }
}

static void gemm_small(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                       const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                       float *c, int64_t ldc, int drop) {
    /* (gemm_is_small: a narrow op(B) comes with k <= SMALL_NARROW_K) */
    const int narrow = n < SMALL_W / 2;
    const int64_t np = narrow ? n : (n + SMALL_W - 1) / SMALL_W * SMALL_W;
    float tile[SMALL_TILE] __attribute__((aligned(64)));
    const float *bs = tile;
    if (!tb && drop == 0 && np == n && ldb == n && (narrow || (uintptr_t)b % 32 == 0) &&
        (b + k * n <= c || c + (m - 1) * ldc + n <= b)) {
        bs = b; /* op(B) is the tile already: dense rows, no padding, vectors aligned; C apart */
    } else {
        for (int64_t p = 0; p < k; p++) {
            float *row = tile + p * np;
            for (int64_t j = 0; j < n; j++)
                row[j] = ct_prec_round(tb ? b[j * ldb + p] : b[p * ldb + j], drop);
            for (int64_t j = n; j < np; j++) row[j] = 0.0f;
        }
    }
    const int64_t chunks = (m + SMALL_CHUNK - 1) / SMALL_CHUNK;
    const int nt = ct_par_threads(chunks > 1 && m * (narrow ? SMALL_W : np) * k >= (1 << 20));
    if (narrow)
        CT_PAR_FOR(nt, t, chunks,
                   gemm_narrow_rows(ta, t * SMALL_CHUNK,
                                    (t + 1) * SMALL_CHUNK < m ? (t + 1) * SMALL_CHUNK : m, n, k,
                                    alpha, a, lda, bs, beta, c, ldc, drop));
    else
        CT_PAR_FOR(nt, t, chunks,
                   gemm_small_rows(ta, t * SMALL_CHUNK,
                                   (t + 1) * SMALL_CHUNK < m ? (t + 1) * SMALL_CHUNK : m, n, np, k,
                                   alpha, a, lda, bs, beta, c, ldc, drop));
}

/* Whether C = op(A) op(B) goes to the small kernel: decided by op(B)'s size alone, so the
 * rows of a product split over devices take the path of the whole. A narrow op(B) (fewer
 * than SMALL_W / 2 columns: gemm_narrow_rows) only with k <= SMALL_NARROW_K. */
static int gemm_is_small(int64_t n, int64_t k) {
    return k > 0 && n <= SMALL_TILE && k <= SMALL_TILE &&
           (n + SMALL_W - 1) / SMALL_W * SMALL_W * k <= SMALL_TILE &&
           (n >= SMALL_W / 2 || k <= SMALL_NARROW_K);
}

int ct_cpu_gemm_small(int64_t n, int64_t k) { return gemm_is_small(n, k); }

ct_status ct_cpu_gemm(ct_device *dev, int ta, int tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                      float beta, float *c, int64_t ldc, int prec) {
    (void)dev;
    if (m == 0 || n == 0) return CT_OK;
    if (gemm_is_small(n, k)) {
        gemm_small(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, ct_prec_drop_bits(prec));
        return CT_OK;
    }
    ct_sgemm_fn blas = ct_get_blas_sgemm();
    if (blas != NULL && m < INT32_MAX && n < INT32_MAX && k < INT32_MAX && lda < INT32_MAX &&
        ldb < INT32_MAX && ldc < INT32_MAX && k > 0) {
        int drop = ct_prec_drop_bits(prec);
        if (drop != 0)
            return gemm_blas_rounded(blas, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                                     drop);
        /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T. */
        int in = (int)n, ik = (int)k, ilda = (int)lda, ildb = (int)ldb, ildc = (int)ldc;
        const char *tra = tb ? "T" : "N", *trb = ta ? "T" : "N";
        /* The BLAS runs single-threaded (the bindings ask it to): OpenMP splits the rows of C,
         * so one threading runtime owns the cores (two pools spinning on two cores halve
         * the speed of both). */
        int nt = ct_par_max_threads();
        int64_t flops = 2 * m * n * k;
        int parts = (flops < (1 << 22) || m < 2 * nt) ? 1 : nt;
#pragma omp parallel for schedule(static) num_threads(ct_par_team(parts))
        for (int t = 0; t < parts; t++) {
            int64_t r0 = m * t / parts, r1 = m * (t + 1) / parts;
            int im = (int)(r1 - r0);
            if (im == 0) continue;
            const float *ap = ta ? a + r0 : a + r0 * lda; /* op(A) rows r0.. */
            blas(tra, trb, &in, &im, &ik, &alpha, b, &ildb, ap, &ilda, &beta, c + r0 * ldc, &ildc);
        }
        return CT_OK;
    }
    gemm_builtin(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, prec);
    return CT_OK;
}

// --- in-process all-reduce -----------------------------------------------------------

enum { AR_CHUNK = 4096 };

/* Elements [lo, hi) (at most AR_CHUNK) of every buffer: combined in buffer order, written back
 * to each. */
static void allreduce_chunk(float **bufs, int nbufs, int64_t lo, int64_t hi, int op) {
    float acc[AR_CHUNK];
    for (int64_t i = lo; i < hi; i++) acc[i - lo] = bufs[0][i];
    for (int j = 1; j < nbufs; j++) {
        const float *src = bufs[j];
        if (op == CT_RED_MAX) {
#pragma omp simd
            for (int64_t i = lo; i < hi; i++)
                acc[i - lo] = ct_red_combine(CT_RED_MAX, acc[i - lo], src[i]);
        } else {
#pragma omp simd
            for (int64_t i = lo; i < hi; i++) acc[i - lo] += src[i];
        }
    }
    for (int j = 0; j < nbufs; j++) memcpy(bufs[j] + lo, acc, (size_t)(hi - lo) * sizeof(float));
}

ct_status ct_cpu_allreduce(ct_device **devs, float **bufs, int nbufs, int64_t count, int op) {
    (void)devs;
    if (nbufs == 1) return CT_OK;
    enum { CH = AR_CHUNK };
    int64_t nch = (count + CH - 1) / CH;
    CT_PAR_FOR(ct_par_threads(count * nbufs > PAR_MIN), ch, nch,
               allreduce_chunk(bufs, nbufs, ch * CH, ch * CH + CH < count ? ch * CH + CH : count, op));
    return CT_OK;
}

// --- embedding rows --------------------------------------------------------------------

ct_status ct_cpu_gather_rows(ct_device *dev, const float *table, int64_t nrows, int64_t ncols,
                             int64_t row0, const int32_t *ids, int64_t nids, float *out) {
    (void)dev;
#pragma omp parallel for schedule(static) num_threads(ct_par_threads(nids * ncols > PAR_MIN))
    for (int64_t i = 0; i < nids; i++) {
        const int64_t r = (int64_t)ids[i] - row0;
        float *o = out + i * ncols;
        if (r >= 0 && r < nrows) memcpy(o, table + r * ncols, (size_t)ncols * sizeof(float));
        else memset(o, 0, (size_t)ncols * sizeof(float));
    }
    return CT_OK;
}

ct_status ct_cpu_scatter_add_rows(ct_device *dev, float *table, int64_t nrows, int64_t ncols,
                                  int64_t row0, const int32_t *hit, const int32_t *start,
                                  int64_t nhit, const int32_t *pos, const float *g) {
    (void)dev;
    /* threads own distinct rows; each adds its row's terms in order */
#pragma omp parallel for schedule(dynamic, 16) num_threads(ct_par_threads(nhit * ncols > PAR_MIN))
    for (int64_t u = 0; u < nhit; u++) {
        const int64_t r = (int64_t)hit[u] - row0;
        if (r < 0 || r >= nrows) continue;
        float *t = table + r * ncols;
        for (int32_t k = start[u]; k < start[u + 1]; k++) {
            const float *s = g + (int64_t)pos[k] * ncols;
            for (int64_t c = 0; c < ncols; c++) t[c] += s[c];
        }
    }
    return CT_OK;
}

// --- dtype conversion ---------------------------------------------------------------

/* One conversion loop over typed pointers; `pragma` picks simd or plain OpenMP. */
#define CONVERT_LOOP(pragma, in_t, out_t, fn)                                  \
    do {                                                                       \
        const in_t *xs_ = (const in_t *)x;                                     \
        out_t *ys_ = (out_t *)y;                                               \
        _Pragma(pragma) for (int64_t i = 0; i < n; i++) ys_[i] = fn(xs_[i]);  \
    } while (0)
#define PAR_SIMD "omp parallel for simd schedule(static) num_threads(ct_par_threads(n > PAR_MIN))"
#define PAR_PLAIN "omp parallel for schedule(static) num_threads(ct_par_threads(n > PAR_MIN))"

/* A conversion loop with both dtypes compile-time constants at each call site below, so the
 * element function folds to one load, conversion and store. */
static inline __attribute__((always_inline)) void cv_loop_t(int sdt, int ddt, int64_t n,
                                                            const void *x, void *y) {
    _Pragma(PAR_PLAIN)
    for (int64_t i = 0; i < n; i++) ct_cv_elem(sdt, x, ddt, y, i);
}

/* The narrow ints to and from float32 (pixels in, quantised values out) on loops of their
 * own; 1 if the pair was one of them. */
static int cv_narrow_f32(int sdt, int ddt, int64_t n, const void *x, void *y) {
#define CV_CASE(S, D)                                                                       \
    if (sdt == S && ddt == D) {                                                             \
        cv_loop_t(S, D, n, x, y);                                                           \
        return 1;                                                                           \
    }
    CV_CASE(CT_U8, CT_F32) CV_CASE(CT_I8, CT_F32) CV_CASE(CT_I16, CT_F32) CV_CASE(CT_U16, CT_F32)
    CV_CASE(CT_F32, CT_U8) CV_CASE(CT_F32, CT_I8) CV_CASE(CT_F32, CT_I16) CV_CASE(CT_F32, CT_U16)
#undef CV_CASE
    return 0;
}

/* A unary op on 16-bit floats: chunks of UT_CHUNK elements widened into a float32 scratch on
 * the stack, the float32 kernel (single-threaded on a chunk: ct_cpu_unary's own loop, the same
 * formula and bits), rounded back with the conversion kernel's functions; chunks in parallel. */
#define UT_CHUNK 2048
ct_status ct_cpu_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n, int dtype,
                             const void *x, void *y) {
    const uint16_t *xs = (const uint16_t *)x;
    uint16_t *ys = (uint16_t *)y;
    const int64_t nch = (n + UT_CHUNK - 1) / UT_CHUNK;
    int failed = 0;
    CT_PAR_FOR(ct_par_threads(n > PAR_MIN), c, nch, {
        float buf[UT_CHUNK];
        const int64_t i0 = c * UT_CHUNK, m = n - i0 < UT_CHUNK ? n - i0 : UT_CHUNK;
        if (dtype == CT_BF16)
            for (int64_t i = 0; i < m; i++) buf[i] = ct_rm_bf16_to_f32(xs[i0 + i]);
        else
            for (int64_t i = 0; i < m; i++) buf[i] = ct_rm_f16_to_f32(xs[i0 + i]);
        if (ct_cpu_unary(dev, op, alpha, beta, m, buf, buf) != CT_OK) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        if (dtype == CT_BF16)
            for (int64_t i = 0; i < m; i++) ys[i0 + i] = ct_rm_f32_to_bf16(buf[i]);
        else
            for (int64_t i = 0; i < m; i++) ys[i0 + i] = ct_rm_f32_to_f16(buf[i]);
    });
    return failed ? ct_set_error(CT_EINVAL, "unknown unary op %d", op) : CT_OK;
}

ct_status ct_cpu_convert(ct_device *dev, int64_t n, int src_dtype, const void *x, int dst_dtype,
                         void *y) {
    (void)dev;
    /* The float32 <-> 16-bit float pairs (mixed precision's casts) and float32 <-> the
     * narrow ints get loops of their own (bfloat16's vectorise; float16's branch per
     * element); every other pair goes through the generic element function. */
    if (src_dtype == CT_F32 && dst_dtype == CT_BF16)
        CONVERT_LOOP(PAR_SIMD, float, uint16_t, ct_rm_f32_to_bf16);
    else if (src_dtype == CT_F32 && dst_dtype == CT_F16)
        CONVERT_LOOP(PAR_PLAIN, float, uint16_t, ct_rm_f32_to_f16);
    else if (src_dtype == CT_BF16 && dst_dtype == CT_F32)
        CONVERT_LOOP(PAR_SIMD, uint16_t, float, ct_rm_bf16_to_f32);
    else if (src_dtype == CT_F16 && dst_dtype == CT_F32)
        CONVERT_LOOP(PAR_PLAIN, uint16_t, float, ct_rm_f16_to_f32);
    else if (!cv_narrow_f32(src_dtype, dst_dtype, n, x, y)) {
        _Pragma(PAR_PLAIN)
        for (int64_t i = 0; i < n; i++) ct_cv_elem(src_dtype, x, dst_dtype, y, i);
    }
    return CT_OK;
}
#undef CONVERT_LOOP
#undef PAR_SIMD
#undef PAR_PLAIN

// --- typed elementwise ops and integer reductions -----------------------------------------

/* One row of n elements with element strides sa, sb. op and dt are compile-time constants
 * in every instantiation below (ew_row's switches), so the element function folds to the
 * one operation and the dense loop can vectorise. */
static inline __attribute__((always_inline)) void ew_row_t(int op, int dt, int64_t n, void *out,
                                                           int64_t o0, const void *a, int64_t a0,
                                                           int64_t sa, const void *b, int64_t b0,
                                                           int64_t sb) {
    if (sa == 1 && sb == 1) {
        for (int64_t i = 0; i < n; i++) ct_ew_elem(op, dt, out, o0 + i, a, a0 + i, b, b0 + i);
    } else if (sa == 1 && sb == 0) {
        for (int64_t i = 0; i < n; i++) ct_ew_elem(op, dt, out, o0 + i, a, a0 + i, b, b0);
    } else {
        for (int64_t i = 0; i < n; i++)
            ct_ew_elem(op, dt, out, o0 + i, a, a0 + i * sa, b, b0 + i * sb);
    }
}

/* Each (op, dtype) row loop is a function of its own, called through two switches (once a
 * row): GCC's time on a function grows faster than its size, so the 240 loops inlined into
 * one function would take three times as long to compile as the whole file does this way. */
#define EW_PARAMS int64_t n, void *out, int64_t o0, const void *a, int64_t a0, int64_t sa, \
                  const void *b, int64_t b0, int64_t sb
#define EW_ARGS n, out, o0, a, a0, sa, b, b0, sb
#define EW_EACH_OP(X, DT)                                                                   \
    X(CT_EW_EQ, DT) X(CT_EW_NE, DT) X(CT_EW_LT, DT) X(CT_EW_LE, DT) X(CT_EW_GT, DT)         \
    X(CT_EW_GE, DT) X(CT_EW_ADD, DT) X(CT_EW_SUB, DT) X(CT_EW_MUL, DT) X(CT_EW_MAX, DT)     \
    X(CT_EW_MIN, DT) X(CT_EW_FLOORDIV, DT) X(CT_EW_REM, DT) X(CT_EW_AND, DT)                \
    X(CT_EW_OR, DT) X(CT_EW_XOR, DT) X(CT_EW_SHL, DT) X(CT_EW_SHR, DT) X(CT_EW_NOT, DT)     \
    X(CT_EW_NEG, DT) X(CT_EW_ABS, DT) X(CT_EW_ISNAN, DT) X(CT_EW_ISINF, DT)                 \
    X(CT_EW_ISFINITE, DT)
#define EW_EACH_DTYPE(X)                                                                    \
    X(CT_F32) X(CT_F16) X(CT_BF16) X(CT_I32) X(CT_U32) X(CT_U8) X(CT_I8) X(CT_I16)          \
    X(CT_U16) X(CT_BOOL)
#define EW_DEF(OP, DT) \
    static __attribute__((noinline)) void ew_##DT##_##OP(EW_PARAMS) { ew_row_t(OP, DT, EW_ARGS); }
#define EW_DEFS(DT) EW_EACH_OP(EW_DEF, DT)
EW_EACH_DTYPE(EW_DEFS)
#define EW_CASE(OP, DT) case OP: ew_##DT##_##OP(EW_ARGS); break;
#define EW_OPS(DT) \
    case DT: switch (op) { EW_EACH_OP(EW_CASE, DT) default: break; } break;

static void ew_row(int op, int dt, EW_PARAMS) {
    switch (dt) {   /* (a dtype without a case: none, the caller checked it) */
        EW_EACH_DTYPE(EW_OPS)
    default: break;
    }
}
#undef EW_OPS
#undef EW_CASE
#undef EW_DEFS
#undef EW_DEF
#undef EW_EACH_DTYPE
#undef EW_EACH_OP
#undef EW_ARGS
#undef EW_PARAMS

/* Rows of the innermost dimension in parallel, as the float binary op. */
ct_status ct_cpu_ewise(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                       void *out, const void *a, const int64_t *as, const void *b,
                       const int64_t *bs) {
    (void)dev;
    if (ndim == 0) {
        ct_ew_elem(op, dtype, out, 0, a, 0, b, 0);
        return CT_OK;
    }
    int64_t total = 1;
    for (int d = 0; d < ndim; d++) total *= shape[d];
    if (total == 0) return CT_OK;
    const int64_t inner = shape[ndim - 1];
    const int64_t rows = total / inner;
    const int64_t sa = as[ndim - 1], sb = bs[ndim - 1];
    CT_PAR_FOR(ct_par_threads(total > PAR_MIN), r, rows,
               int64_t ao; int64_t bo;
               ct_offsets2(r, ndim - 1, shape, as, bs, &ao, &bo);
               ew_row(op, dtype, inner, out, r * inner, a, ao, sa, b, bo, sb));
    return CT_OK;
}

ct_status ct_cpu_reduce_typed(ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                              uint32_t axes, const void *x, void *out) {
    (void)dev;
    ct_ew_red_plan p;
    ct_ew_red_plan_init(&p, ndim, shape, axes);
    int64_t nout = 1;
    for (int j = 0; j < p.nk; j++) nout *= p.kdim[j];
    if (nout >= ct_par_max_threads() || nout * p.nred <= PAR_MIN) {
        CT_PAR_FOR(ct_par_threads(nout * p.nred > PAR_MIN), q, nout,
                   ct_ew_reduce_one(op, dtype, &p, x, out, q));
        return CT_OK;
    }
    /* few outputs, many elements each (a full reduction): the threads split each output's
     * elements; wrapping sums and maxima are exact in any grouping */
    for (int64_t q = 0; q < nout; q++) {
        const int64_t base = ct_ew_unravel(q, p.nk, p.kdim, p.kstr);
        int64_t acc = ct_ew_red_identity(op, dtype);
#pragma omp parallel num_threads(ct_par_threads(1))
        {
            int64_t mine = ct_ew_red_identity(op, dtype);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < p.nred; t++)
                mine = ct_ew_red_combine(op, mine, ct_ew_red_load(dtype, &p, x, base, t));
#pragma omp critical
            acc = ct_ew_red_combine(op, acc, mine);
        }
        ct_cv_store_i(dtype, out, q, acc);
    }
    return CT_OK;
}
