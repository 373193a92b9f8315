/*
 * ct_random_math.h — the per-element math of the PRNG, shared by C and CUDA:
 * one Threefry-2x32 block, float16/bfloat16 rounding, XLA's float32 log /
 * log1p / erf / erf_inv, and each sampler's transform from a 32-bit random
 * word to the stored value.
 *
 * These functions are the scalar definition: ct_random.c's reference path
 * calls them, its vectorised CPU path spells the same operation sequence
 * branch-free (tests/c/test_random.c compares them over every possible input
 * word), and csrc/backend/cuda/cuda_random.cu runs them per element on GPUs.
 *
 * Exactness depends on the order and fusion of every float operation. Every
 * fused multiply-add is spelled fmaf(); any other a * b + c must stay two
 * roundings, so includers compile with contraction off (gcc: fp-contract=off,
 * as ct_random.c's pragma; nvcc: --fmad=false, as setup.py gives
 * cuda_random.cu), and division and sqrt must be IEEE round-to-nearest (no
 * fast-math; nvcc's defaults -prec-div=true -prec-sqrt=true).
 */
#ifndef CT_RANDOM_MATH_H
#define CT_RANDOM_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ct_dtype.h"

#include "ct_hd.h"

#ifdef __CUDACC__
#define CT_RM static __forceinline__ __host__ __device__
#else
#define CT_RM static inline __attribute__((always_inline))
#endif

/* Samplers (the values are part of the binding contract). */
typedef enum {
    CT_DIST_UNIFORM = 0,          /* jax.random.uniform(key, shape, dtype, minval, maxval) */
    CT_DIST_NORMAL = 1,           /* jax.random.normal(key, shape, dtype) */
    CT_DIST_TRUNCATED_NORMAL = 2, /* jax.random.truncated_normal(key, lower, upper, shape, dtype) */
    CT_DIST_BERNOULLI = 3         /* jax.random.bernoulli(key, p, shape), mode='low' */
} ct_dist;

/* A sampler's constants, already converted to its dtype (held as float32);
 * made on the host by ct_random_consts_make (ct_random.h) and passed by value
 * to kernels. */
typedef struct ct_random_consts {
    ct_dist dist;
    ct_dtype dt;
    float minval, range;      /* uniform stage: u = max(minval, f * range + minval) */
    float sqrt2;              /* normal stages */
    float clip_lo, clip_hi;   /* truncated normal */
    float p;                  /* bernoulli */
    int has_scale;
    float scale;
} ct_random_consts;

// --- bits ------------------------------------------------------------------------

CT_RM uint32_t ct_rm_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

CT_RM float ct_rm_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

#define CT_RM_INF ct_rm_u2f(0x7f800000u)
#define CT_RM_NAN ct_rm_u2f(0x7fc00000u)

// --- Threefry-2x32 -----------------------------------------------------------------

#define CT_RM_ROTL(x, r) (((x) << (r)) | ((x) >> (32 - (r))))
#define CT_RM_R(r) do { a += b; b = CT_RM_ROTL(b, r); b ^= a; } while (0)
#define CT_RM_R0 do { CT_RM_R(13); CT_RM_R(15); CT_RM_R(26); CT_RM_R(6); } while (0)
#define CT_RM_R1 do { CT_RM_R(17); CT_RM_R(29); CT_RM_R(16); CT_RM_R(24); } while (0)

/* The 20-round cipher on the counter pair (*x0, *x1), in place. */
CT_RM void ct_rm_threefry(uint32_t k0, uint32_t k1, uint32_t *x0, uint32_t *x1) {
    const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
    uint32_t a = *x0 + k0, b = *x1 + k1;
    CT_RM_R0; a += k1; b += k2 + 1u;
    CT_RM_R1; a += k2; b += k0 + 2u;
    CT_RM_R0; a += k0; b += k1 + 3u;
    CT_RM_R1; a += k1; b += k2 + 4u;
    CT_RM_R0; a += k2; b += k0 + 5u;
    *x0 = a;
    *x1 = b;
}

/* The 32-bit word of global element g (JAX's partitionable layout): one
 * cipher call per element, its two output words xor-ed. */
CT_RM uint32_t ct_rm_bits32(uint32_t k0, uint32_t k1, uint64_t g) {
    uint32_t a = (uint32_t)(g >> 32), b = (uint32_t)g;
    ct_rm_threefry(k0, k1, &a, &b);
    return a ^ b;
}

#undef CT_RM_R
#undef CT_RM_R0
#undef CT_RM_R1

// --- float16 / bfloat16 ----------------------------------------------------------------

CT_RM uint16_t ct_rm_f32_to_f16(float f) {
    /* Round to nearest even; after F. Giesen's float_to_half_fast3_rtne. */
    uint32_t x = ct_rm_f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    uint16_t o;
    if (x >= 0x47800000u) {                 /* >= 65536, inf or nan */
        o = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x < 0x38800000u) {           /* subnormal half or zero */
        o = (uint16_t)(ct_rm_f2u(ct_rm_u2f(x) + 0.5f) - 0x3f000000u);
    } else {
        uint32_t odd = (x >> 13) & 1u;
        x += 0xc8000fffu + odd;             /* rebias exponent, round */
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | sign);
}

CT_RM float ct_rm_f16_to_f32(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == 0x0f800000u) {
        o += (uint32_t)(128 - 16) << 23;    /* inf / nan */
    } else if (exp == 0) {
        o += 1u << 23;                      /* subnormal: renormalise */
        o = ct_rm_f2u(ct_rm_u2f(o) - ct_rm_u2f(113u << 23));
    }
    return ct_rm_u2f(o | ((uint32_t)(h & 0x8000u) << 16));
}

/* As ct_f32_to_bf16 (ct_dtype.h): round to nearest even, NaN kept quiet. */
CT_RM uint16_t ct_rm_f32_to_bf16(float f) {
    uint32_t u = ct_rm_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

CT_RM float ct_rm_bf16_to_f32(uint16_t h) { return ct_rm_u2f((uint32_t)h << 16); }

/* Round a float32 to the storage dtype and back (identity for float32). */
CT_RM float ct_rm_rnd(ct_dtype dt, float x) {
    if (dt == CT_F16) return ct_rm_f16_to_f32(ct_rm_f32_to_f16(x));
    if (dt == CT_BF16) return ct_rm_bf16_to_f32(ct_rm_f32_to_bf16(x));
    return x;
}

// --- XLA's float32 math ------------------------------------------------------------
// Reimplemented from the LLVM IR XLA's CPU backend emits (Cephes/Eigen
// polynomials) and checked bit for bit against jax.lax on CPU.

CT_RM float ct_rm_log(float x) {
    const float p0 = 7.0376836292E-2f, p1 = -1.1514610310E-1f, p2 = 1.1676998740E-1f,
                p3 = -1.2420140846E-1f, p4 = 1.4249322787E-1f, p5 = -1.6668057665E-1f,
                p6 = 2.0000714765E-1f, p7 = -2.4999993993E-1f, p8 = 3.3333331174E-1f;
    const float q1 = -2.12194440e-4f, q2 = 0.693359375f;
    float xc = x > 1.17549435e-38f ? x : 1.17549435e-38f;   /* no denormals */
    uint32_t xi = ct_rm_f2u(xc);
    float e = (float)((int32_t)(xi >> 23) - 126);
    float m = ct_rm_u2f((xi & 0x807fffffu) | 0x3f000000u);  /* in [0.5, 1) */
    /* Selects spelled as bit operations, values as written in XLA: gcc
     * would otherwise duplicate the rest of the function per case. */
    int lt = m < 0.707106781186547524f;
    float tmp = ct_rm_u2f(ct_rm_f2u(m) & (0u - (uint32_t)lt)); /* lt ? m : 0.0f */
    m = m - 1.0f;
    e = e - (float)lt;                                         /* lt ? 1.0f : 0.0f */
    m = m + tmp;
    float x2 = m * m, x3 = x2 * m;
    float y = fmaf(p0, m, p1), y1 = fmaf(p3, m, p4), y2 = fmaf(p6, m, p7);
    y = fmaf(y, m, p2);
    y1 = fmaf(y1, m, p5);
    y2 = fmaf(y2, m, p8);
    y = fmaf(y, x3, y1);
    y = fmaf(y, x3, y2);
    y = fmaf(y, x3, q1 * e);
    float r = m - 0.5f * x2;
    r = r + y;
    r = r + q2 * e;
    r = x == 0.0f ? -CT_RM_INF : r;
    r = x == CT_RM_INF ? CT_RM_INF : r;
    return (x < 0.0f || x != x) ? CT_RM_NAN : r;
}

/* log1p's Cephes rational approximation, used for |x| < sqrt(2) - 1. */
CT_RM float ct_rm_log1p_small(float x) {
    float x2 = x * x;
    float num = 4.5270000862445199635E-5f;
    num = fmaf(num, x, 4.9854102823193375972E-1f);
    num = fmaf(num, x, 6.5787325942061044846E0f);
    num = fmaf(num, x, 2.9911919328553073277E1f);
    num = fmaf(num, x, 6.0949667980987787057E1f);
    num = fmaf(num, x, 5.7112963590585538103E1f);
    num = fmaf(num, x, 2.0039553499201281259E1f);
    float den = 1.0f;
    den = fmaf(den, x, 1.5062909083469192198E1f);
    den = fmaf(den, x, 8.3047565967967209469E1f);
    den = fmaf(den, x, 2.2176239823732856465E2f);
    den = fmaf(den, x, 3.0909872225312059774E2f);
    den = fmaf(den, x, 2.1642788614495947685E2f);
    den = fmaf(den, x, 6.0118660497603843919E1f);
    return x + fmaf(-0.5f, x2, (x * x2) * (num / den));
}

#define CT_LOG1P_SMALL 0.41421356237309504880f

CT_RM float ct_rm_log1p(float x) {
    /* Cephes rational approximation for |x| < sqrt(2) - 1, log(1 + x) beyond. */
    return fabsf(x) < CT_LOG1P_SMALL ? ct_rm_log1p_small(x) : ct_rm_log(x + 1.0f);
}

/* erf_inv from w = -log1p(x * -x) (M. Giles, "Approximating the erfinv
 * function", single precision): two polynomials, split at w = 5. Written as
 * a branch, not as one polynomial with selected coefficients: the tail
 * (about 1 element in 300) then costs a GPU warp only when one of its lanes
 * needs it. The CPU's tiled path (ct_random.c) calls the branches itself. */

/* w < 5, so |x| < 1 (|x| == 1 gives w = inf): the polynomial in w - 2.5, times x. */
CT_RM float ct_rm_erfinv_central(float x, float w) {
    float v = w - 2.5f;
    float p = 2.81022636e-08f;
    p = fmaf(p, v, 3.43273939e-07f);
    p = fmaf(p, v, -3.5233877e-06f);
    p = fmaf(p, v, -4.39150654e-06f);
    p = fmaf(p, v, 0.00021858087f);
    p = fmaf(p, v, -0.00125372503f);
    p = fmaf(p, v, -0.00417768164f);
    p = fmaf(p, v, 0.246640727f);
    p = fmaf(p, v, 1.50140941f);
    return p * x;
}

/* w >= 5 or NaN: the polynomial in sqrt(w) - 3, times x; erf_inv(+-1) = +-inf. */
CT_RM float ct_rm_erfinv_tail(float x, float w) {
    float v = sqrtf(w) - 3.0f;
    float p = -0.000200214257f;
    p = fmaf(p, v, 0.000100950558f);
    p = fmaf(p, v, 0.00134934322f);
    p = fmaf(p, v, -0.00367342844f);
    p = fmaf(p, v, 0.00573950773f);
    p = fmaf(p, v, -0.0076224613f);
    p = fmaf(p, v, 0.00943887047f);
    p = fmaf(p, v, 1.00167406f);
    p = fmaf(p, v, 2.83297682f);
    float r = p * x;
    return fabsf(x) == 1.0f ? x * CT_RM_INF : r;
}

CT_RM float ct_rm_erfinv(float x) {
    float w = -ct_rm_log1p(x * -x);
    return w < 5.0f ? ct_rm_erfinv_central(x, w) : ct_rm_erfinv_tail(x, w);
}

CT_RM float ct_rm_erf(float x) {
    /* Eigen's rational interpolant, clamped to +-1 beyond erfinv(1 - ulp/2). */
    float x2 = x * x;
    float p = fmaf(x2, 0.00022905065861350646f, 0.0034082910107109506f);
    p = fmaf(x2, p, 0.050955695062380861f);
    p = fmaf(x2, p, 0.18520832239976145f);
    p = fmaf(x2, p, 1.128379143519084f);
    p = x * p;
    float q = fmaf(x2, -1.1791602954361697e-7f, 0.000023547966471313185f);
    q = fmaf(x2, q, 0.0010179625278914885f);
    q = fmaf(x2, q, 0.014070470171167667f);
    q = fmaf(x2, q, 0.11098505178285362f);
    q = fmaf(x2, q, 0.49746925110067538f);
    q = fmaf(x2, q, 1.0f);
    return 3.832506856900711f <= fabsf(x) ? copysignf(1.0f, x) : p / q;
}

// --- element transforms ------------------------------------------------------------

/* [0, 1) float from the random bits, as JAX's _uniform: mantissa bits under
 * exponent 0, minus one (exact). 16-bit floats use the low 16 bits (float16)
 * or low 8 bits (bfloat16) of the 32-bit word. */
CT_RM float ct_rm_unit(ct_dtype dt, uint32_t b) {
    if (dt == CT_F32) return ct_rm_u2f((b >> 9) | 0x3f800000u) - 1.0f;
    if (dt == CT_F16) return ct_rm_f16_to_f32((uint16_t)(((b & 0xffffu) >> 6) | 0x3c00u)) - 1.0f;
    return ct_rm_bf16_to_f32((uint16_t)(((b & 0xffu) >> 1) | 0x3f80u)) - 1.0f;
}

CT_RM float ct_rm_uniform(const ct_random_consts *c, ct_dtype dt, uint32_t b) {
    float f = ct_rm_unit(dt, b), u;
    if (dt == CT_F32) u = fmaf(f, c->range, c->minval);
    else u = ct_rm_rnd(dt, ct_rm_rnd(dt, f * c->range) + c->minval);
    return u > c->minval ? u : c->minval;
}

/* normal's (or truncated_normal's) value from r = erf_inv(u), before the scale:
 * sqrt(2) * r in the dtype, and truncated_normal's clip (`v > lo ? v : lo`). */
CT_RM float ct_rm_normal_value(const ct_random_consts *c, ct_dist dist, ct_dtype dt, float r) {
    float v = ct_rm_rnd(dt, c->sqrt2 * ct_rm_rnd(dt, r));
    if (dist == CT_DIST_TRUNCATED_NORMAL) {
        v = v > c->clip_lo ? v : c->clip_lo;
        v = v < c->clip_hi ? v : c->clip_hi;
    }
    return v;
}

/* A sample value times the sampler's scale, if it has one (one rounding in the dtype). */
CT_RM float ct_rm_scaled(const ct_random_consts *c, ct_dtype dt, float v) {
    return c->has_scale ? ct_rm_rnd(dt, v * c->scale) : v;
}

/* The sample (a float32 value of the dtype) of word b, before the scale. */
CT_RM float ct_rm_sample_unscaled(const ct_random_consts *c, ct_dist dist, ct_dtype dt,
                                  uint32_t b) {
    float u = ct_rm_uniform(c, dt, b), v;
    if (dist == CT_DIST_UNIFORM) {
        v = u;
    } else {
        v = ct_rm_normal_value(c, dist, dt, ct_rm_erfinv(u));
    }
    return v;
}

/* The sample of word b, scaled (not for bernoulli). */
CT_RM float ct_rm_sample(const ct_random_consts *c, ct_dist dist, ct_dtype dt, uint32_t b) {
    return ct_rm_scaled(c, dt, ct_rm_sample_unscaled(c, dist, dt, b));
}

/* Bernoulli's byte (0 or 1) of word b; dt is the dtype of p. */
CT_RM uint8_t ct_rm_bernoulli(const ct_random_consts *c, ct_dtype dt, uint32_t b) {
    return (uint8_t)(ct_rm_uniform(c, dt, b) < c->p);
}

/* The stored bits of a sample: float32 bits, or the 16-bit pattern in the low
 * half for float16 / bfloat16. */
CT_RM uint32_t ct_rm_store_bits(ct_dtype dt, float v) {
    if (dt == CT_F16) return ct_rm_f32_to_f16(v);
    if (dt == CT_BF16) return ct_rm_f32_to_bf16(v);
    return ct_rm_f2u(v);
}

/* The stored value of word b for sampler c (dist and dt equal c's): the
 * float32 bits, the 16-bit pattern in the low half for float16 / bfloat16,
 * or bernoulli's 0 / 1. This is the whole per-element transform a kernel runs. */
CT_RM uint32_t ct_rm_element(const ct_random_consts *c, ct_dist dist, ct_dtype dt, uint32_t b) {
    if (dist == CT_DIST_BERNOULLI) return ct_rm_bernoulli(c, dt, b);
    return ct_rm_store_bits(dt, ct_rm_sample(c, dist, dt, b));
}

// --- block geometry ------------------------------------------------------------------
// A block [start, start + block) of a row-major global array, its dimensions
// merged where the block's elements are evenly spaced in the global array: a
// block that is a contiguous range of global indices (any shard split along
// the first sharded dimension only, or a whole array) becomes one group of
// stride 1, and a column shard of a matrix two groups.

#define CT_RM_MAX_GROUPS 32

typedef struct ct_rm_block {
    int ngroups;                      /* 0 for a single element */
    uint64_t base;                    /* global index of block element 0 */
    uint64_t count;                   /* elements in the block */
    uint64_t extent[CT_RM_MAX_GROUPS]; /* outermost first */
    uint64_t stride[CT_RM_MAX_GROUPS]; /* global index step of each group */
} ct_rm_block;

/* Build the geometry; the block must have passed ct_block_check (so ndim <=
 * CT_RM_MAX_GROUPS and the global size fits in 64 bits). */
CT_RM void ct_rm_block_make(int ndim, const int64_t *global_shape, const int64_t *start,
                            const int64_t *block_shape, ct_rm_block *blk) {
    uint64_t ext[CT_RM_MAX_GROUPS], str[CT_RM_MAX_GROUPS]; /* innermost first */
    int n = 0;
    uint64_t gstride = 1;
    blk->base = 0;
    blk->count = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        uint64_t b = (uint64_t)block_shape[d];
        blk->base += (uint64_t)start[d] * gstride;
        blk->count *= b;
        if (b != 1) {
            if (n > 0 && ext[n - 1] * str[n - 1] == gstride) ext[n - 1] *= b;
            else { ext[n] = b; str[n] = gstride; n++; }
        }
        gstride *= (uint64_t)global_shape[d];
    }
    blk->ngroups = n;
    for (int i = 0; i < n; i++) {
        blk->extent[i] = ext[n - 1 - i];
        blk->stride[i] = str[n - 1 - i];
    }
}

/* Global flat index of block element e (row-major order in the block). */
CT_RM uint64_t ct_rm_block_index(const ct_rm_block *blk, uint64_t e) {
    uint64_t g = blk->base;
    for (int i = blk->ngroups - 1; i > 0; i--) {
        g += (e % blk->extent[i]) * blk->stride[i];
        e /= blk->extent[i];
    }
    return blk->ngroups > 0 ? g + e * blk->stride[0] : g;
}

#endif /* CT_RANDOM_MATH_H */
