/*
 * ct_random.c — uniform / normal / truncated-normal / bernoulli block fills
 * that reproduce jax.random on CPU bit for bit (see ct_random.h).
 *
 * The scalar definitions (XLA's float32 log, log1p, erf, erf_inv, the
 * float16/bfloat16 roundings and each element transform) are in
 * ct_random_math.h, shared with the CUDA kernels. Layout here: sampler
 * constants, then the tiled fast path (threefry tile ->
 * transform tile, vectorised, OpenMP over the block), then the scalar
 * reference used by the tests.
 *
 * Exactness depends on the order and fusion of every float operation, so this
 * file is compiled with floating-point contraction off (the pragma below) and
 * spells each fused multiply-add as fmaf(); no -ffast-math. The fast path
 * evaluates the very same operation sequence as the scalar reference, only
 * written branch-free (selects, no calls) so that gcc vectorises it; the
 * tests compare the two exhaustively over every possible input of each
 * transform.
 */
#if defined(__GNUC__) && !defined(__clang__)
/* no-trapping-math lets the if-converter evaluate both arms of a select
 * (a vector blend); it changes no value, only which FP exception flags may be
 * raised, and nothing here reads them. */
#pragma GCC optimize("fp-contract=off", "no-math-errno", "no-trapping-math")
#endif

#include "ct_random.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ct_device.h"
#include "ct_random_x86.h"
#include "ct_simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define CT_MXCSR_FTZ_DAZ 0x8040u /* flush-to-zero and denormals-are-zero */
#endif

#define CT_INLINE static inline __attribute__((always_inline))

/* The scalar definitions live in ct_random_math.h (shared with CUDA). */
#define f2u ct_rm_f2u
#define u2f ct_rm_u2f
#define f32_to_f16 ct_rm_f32_to_f16
#define f16_to_f32 ct_rm_f16_to_f32
#define rnd ct_rm_rnd
#define xla_log ct_rm_log
#define log1p_small ct_rm_log1p_small
#define xla_log1p ct_rm_log1p
#define xla_erfinv ct_rm_erfinv
#define xla_erf ct_rm_erf
typedef ct_random_consts consts;

/* --- float16 --------------------------------------------------------------- */

uint16_t ct_f32_to_f16(float f) { return f32_to_f16(f); }
float ct_f16_to_f32(uint16_t h) { return f16_to_f32(h); }

/* double -> dtype, as convert_element_type of a Python float. */
static float cvt(ct_dtype dt, double v) { return rnd(dt, (float)v); }

CT_INLINE void store(ct_dtype dt, void *out, uint64_t i, float v) {
    if (dt == CT_F32) ((float *)out)[i] = v;
    else if (dt == CT_F16) ((uint16_t *)out)[i] = f32_to_f16(v);
    else ((uint16_t *)out)[i] = ct_f32_to_bf16(v);
}

/* Largest float of dtype below / above x (x finite or inf; dtype-exact). */
static float next_toward(ct_dtype dt, float x, int up) {
    if (dt == CT_F32) return nextafterf(x, up ? INFINITY : -INFINITY);
    /* 16-bit types: step the 16-bit pattern. */
    uint16_t h = dt == CT_F16 ? f32_to_f16(x) : ct_f32_to_bf16(x);
    uint16_t inf = dt == CT_F16 ? 0x7c00u : 0x7f80u;
    int neg = (h & 0x8000u) != 0;
    if ((h & 0x7fffu) == 0) h = up ? 1u : 0x8001u;
    else if ((h & 0x7fffu) == inf && neg == up) h = (uint16_t)(h - 1u); /* -inf up / +inf down */
    else if ((h & 0x7fffu) == inf) return x;
    else if (neg == !up) h = (uint16_t)(h + 1u);  /* away from zero */
    else h = (uint16_t)(h - 1u);                    /* toward zero */
    return dt == CT_F16 ? f16_to_f32(h) : ct_bf16_to_f32(h);
}

float ct_xla_logf(float x) { return xla_log(x); }
float ct_xla_log1pf(float x) { return xla_log1p(x); }
float ct_xla_erff(float x) { return xla_erf(x); }
float ct_xla_erfinvf(float x) { return xla_erfinv(x); }

/* A subnormal float32 as the signed zero XLA's CPU code reads it as (denormals as zero). */
static inline float flush_denormal(float v) {
    uint32_t b = f2u(v);
    return (b & 0x7f800000u) == 0 ? u2f(b & 0x80000000u) : v;
}

ct_status ct_xla_math_n(int fn, float *x, size_t n) {
    if (fn != CT_XLA_LOG && fn != CT_XLA_LOG1P)
        return ct_set_error(CT_EINVAL, "xla_math: unknown function %d", fn);
    if (n && !x) return ct_set_error(CT_EINVAL, "xla_math: NULL array");
    for (size_t i = 0; i < n; i++) {
        /* XLA's CPU code runs with denormals as zero, and its NaNs are all-ones bits */
        float v = flush_denormal(x[i]);
        float r = fn == CT_XLA_LOG ? xla_log(v) : xla_log1p(v);
        x[i] = r != r ? u2f(0xffffffffu) : r;
    }
    return CT_OK;
}

/* XLA's CPU pow is a call to the C library's powf made while the thread runs with
 * denormals flushed (x86's MXCSR FTZ and DAZ bits set for the compiled code), so powf
 * sees a subnormal input as zero in its arithmetic, and a subnormal result comes back
 * as zero. The same call under the same mode gives XLA's bits, whatever SIMD code
 * numpy's own float32 power picks on the host (its AVX-512 one differs from powf in
 * about a fifth of the last bits). Elsewhere than x86 the inputs and the results are
 * flushed explicitly. */
ct_status ct_xla_pow_n(float *x, const float *y, size_t n) {
    if (n && (!x || !y)) return ct_set_error(CT_EINVAL, "xla_pow: NULL array");
#if defined(__x86_64__) || defined(__i386__)
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | CT_MXCSR_FTZ_DAZ);
    for (size_t i = 0; i < n; i++) x[i] = powf(x[i], y[i]);
    _mm_setcsr(csr);
#else
    for (size_t i = 0; i < n; i++) x[i] = flush_denormal(powf(flush_denormal(x[i]), y[i]));
#endif
    return CT_OK;
}

/* --- element transforms ---------------------------------------------------- */

ct_status ct_sampler_check(const ct_sampler *s) {
    if (!s) return ct_set_error(CT_EINVAL, "random: sampler is NULL");
    if (s->dist < CT_DIST_UNIFORM || s->dist > CT_DIST_BERNOULLI)
        return ct_set_error(CT_EINVAL, "random: unknown distribution %d", (int)s->dist);
    if (s->dtype != CT_F32 && s->dtype != CT_F16 && s->dtype != CT_BF16)
        return ct_set_error(CT_ETYPE, "random: dtype %s is not float32, float16 or bfloat16",
                            ct_dtype_name(s->dtype));
    if (s->dist == CT_DIST_BERNOULLI && s->has_scale)
        return ct_set_error(CT_EINVAL, "random: bernoulli takes no scale");
    return CT_OK;
}

static consts make_consts(const ct_sampler *s) {
    consts c;
    memset(&c, 0, sizeof c);
    const ct_dtype dt = s->dtype;
    c.dist = s->dist;
    c.dt = dt;
    c.sqrt2 = cvt(dt, 1.4142135623730951);
    float lo = 0.0f, hi = 1.0f;
    switch (s->dist) {
    case CT_DIST_UNIFORM:
        lo = cvt(dt, s->minval);
        hi = cvt(dt, s->maxval);
        break;
    case CT_DIST_NORMAL:
        lo = next_toward(dt, -1.0f, 1);
        hi = 1.0f;
        break;
    case CT_DIST_TRUNCATED_NORMAL: {
        /* XLA rewrites `x / sqrt(2)` as `x * (1 / sqrt(2))` for float32 and
         * float16 (reciprocal rounded to the dtype); bfloat16 keeps the
         * division (each verified against jax). */
        float l = cvt(dt, s->lower), u = cvt(dt, s->upper);
        float ls, us;
        if (dt == CT_BF16) {
            ls = rnd(dt, l / c.sqrt2);
            us = rnd(dt, u / c.sqrt2);
        } else {
            const float rsqrt2 = rnd(dt, 0.707106769f);
            ls = rnd(dt, l * rsqrt2);
            us = rnd(dt, u * rsqrt2);
        }
        lo = rnd(dt, xla_erf(ls));
        hi = rnd(dt, xla_erf(us));
        c.clip_lo = next_toward(dt, l, 1);
        c.clip_hi = next_toward(dt, u, 0);
        break;
    }
    case CT_DIST_BERNOULLI:
        c.p = cvt(dt, s->p);
        break;
    }
    c.minval = lo;
    c.range = rnd(dt, hi - lo);
    c.has_scale = s->has_scale;
    c.scale = cvt(dt, s->scale);
    return c;
}

#define uniform_of ct_rm_uniform
#define sample_of ct_rm_sample

ct_status ct_random_consts_make(const ct_sampler *s, ct_random_consts *out) {
    CT_TRY(ct_sampler_check(s));
    if (!out) return ct_set_error(CT_EINVAL, "random: constants output is NULL");
    *out = make_consts(s);
    return CT_OK;
}

/* --- vectorised tile transforms ---------------------------------------------
 * A tile of random bits becomes a tile of samples in a few flat loops with no
 * calls and no branches (selects only), which gcc vectorises in every
 * CT_MULTIVERSION clone. Each element goes through exactly the operations of
 * the scalar definition above; only their spelling differs:
 *   - float16 / bfloat16 conversions compute every case and select;
 *   - erf_inv takes its central branch (w < 5) for every lane, and the rare
 *     lanes with w >= 5 or NaN (|u| > ~0.9966, about 1 in 300, and |u| == 1)
 *     are redone afterwards, one at a time, with the other branch (same w).
 *     This keeps the sqrt (a libm call for errno, even with the pragma, which
 *     blocks vectorisation) and nine coefficient blends out of the vector
 *     loop. */

/* float -> float16 bits, as f32_to_f16 (round to nearest even). */
CT_INLINE uint32_t v_f32_to_f16(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    uint32_t o_big = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    uint32_t o_sub = f2u(u2f(x) + 0.5f) - 0x3f000000u;
    uint32_t o_nrm = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
    uint32_t o = x >= 0x47800000u ? o_big : x < 0x38800000u ? o_sub : o_nrm;
    return (o | sign) & 0xffffu;
}

/* float16 bits -> float, as f16_to_f32. */
CT_INLINE float v_f16_to_f32(uint32_t h) {
    uint32_t o = (h & 0x7fffu) << 13;
    uint32_t exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    uint32_t o_inf = o + ((uint32_t)(128 - 16) << 23);
    uint32_t o_sub = f2u(u2f(o + (1u << 23)) - u2f(113u << 23));
    o = exp == 0x0f800000u ? o_inf : exp == 0 ? o_sub : o;
    return u2f(o | ((h & 0x8000u) << 16));
}

/* float -> bfloat16 bits, as ct_f32_to_bf16. */
CT_INLINE uint32_t v_f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    uint32_t nan = (u >> 16) | 0x40u;
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return ((u & 0x7fffffffu) > 0x7f800000u ? nan : r) & 0xffffu;
}

CT_INLINE float v_rnd(ct_dtype dt, float x) {
    if (dt == CT_F16) return v_f16_to_f32(v_f32_to_f16(x));
    if (dt == CT_BF16) return u2f(v_f32_to_bf16(x) << 16);
    return x;
}

/* uniform_of: unit() then the affine map, in the dtype. The unit value's
 * 16-bit pattern is a normal number in [1, 2), so its widening is exact bit
 * placement. */
CT_INLINE float v_uniform(ct_dtype dt, float mn, float rg, uint32_t b) {
    float f, u;
    if (dt == CT_F32) {
        f = u2f((b >> 9) | 0x3f800000u) - 1.0f;
        u = fmaf(f, rg, mn);
    } else {
        if (dt == CT_F16) f = u2f(((b & 0xffc0u) << 7) | 0x3f800000u) - 1.0f;
        else f = u2f(((b & 0xfeu) << 15) | 0x3f800000u) - 1.0f;
        u = v_rnd(dt, v_rnd(dt, f * rg) + mn);
    }
    return u > mn ? u : mn;
}

/* sample_unscaled for an element whose w = -xla_log1p(u * -u) is >= 5 or NaN. */
static float tail_sample(const consts *c, ct_dist dist, ct_dtype dt, uint32_t b, float w) {
    float u = v_uniform(dt, c->minval, c->range, b);
    float v = v_rnd(dt, c->sqrt2 * v_rnd(dt, ct_rm_erfinv_tail(u, w)));
    if (dist == CT_DIST_TRUNCATED_NORMAL) {
        v = v > c->clip_lo ? v : c->clip_lo;
        v = v < c->clip_hi ? v : c->clip_hi;
    }
    return v;
}

/* Samples (before scale, as float32 values of the dtype) of a tile of m <=
 * CT_TILE elements. The normal transform is a chain of ~100 dependent
 * operations per element; as one loop, each vector's chain fills the
 * out-of-order scheduler. Split in four loops over L1-resident arrays, more
 * iterations overlap (measured 10% faster for float32, 20% for bfloat16). */
CT_INLINE void tile_samples(const consts *c, ct_dist dist, ct_dtype dt,
                            const uint32_t *restrict b, size_t m, float *restrict v,
                            float *restrict t, float *restrict lg, float *restrict w) {
    const float mn = c->minval, rg = c->range, s2 = c->sqrt2;
    const float clo = c->clip_lo, chi = c->clip_hi;
    if (dist == CT_DIST_UNIFORM) {
        for (size_t j = 0; j < m; j++) v[j] = v_uniform(dt, mn, rg, b[j]);
        return;
    }
    /* u, then w = -log1p(u * -u) as xla_log1p computes it. */
    for (size_t j = 0; j < m; j++) {
        float u = v_uniform(dt, mn, rg, b[j]);
        v[j] = u;
        t[j] = u * -u;
    }
    for (size_t j = 0; j < m; j++) lg[j] = xla_log(t[j] + 1.0f);
    for (size_t j = 0; j < m; j++)
        w[j] = -(fabsf(t[j]) < CT_LOG1P_SMALL ? log1p_small(t[j]) : lg[j]);
    for (size_t j = 0; j < m; j++) {
        float x = v_rnd(dt, s2 * v_rnd(dt, ct_rm_erfinv_central(v[j], w[j])));
        if (dist == CT_DIST_TRUNCATED_NORMAL) {
            x = x > clo ? x : clo;
            x = x < chi ? x : chi;
        }
        v[j] = x;
    }
    /* The lanes ct_rm_erfinv_central did not cover (about 1 in 300), found 64 at a
     * time; w is already known for them, the rest is short. */
    for (size_t g = 0; g < m; g += 64) {
        size_t e = m - g < 64 ? m : g + 64;
        int any = 0;
        for (size_t j = g; j < e; j++) any |= !(w[j] < 5.0f);
        if (!any) continue;
        for (size_t j = g; j < e; j++)
            if (!(w[j] < 5.0f)) v[j] = tail_sample(c, dist, dt, b[j], w[j]);
    }
}

#define CT_TILE CT_RANDOM_X86_TILE

/* One tile: bits b[0..m) -> samples in `out` (m elements of the output). */
CT_INLINE void transform_tile(const consts *c, ct_dist dist, ct_dtype dt,
                              const uint32_t *restrict b, size_t m, void *restrict out) {
    float tmp[CT_TILE], t[CT_TILE], lg[CT_TILE], w[CT_TILE];
    if (dist == CT_DIST_BERNOULLI) {
        uint8_t *restrict o = out;
        const float mn = c->minval, rg = c->range, p = c->p;
        for (size_t j = 0; j < m; j++) o[j] = v_uniform(dt, mn, rg, b[j]) < p;
        return;
    }
    float *restrict v = dt == CT_F32 ? (float *)out : tmp;
    tile_samples(c, dist, dt, b, m, v, t, lg, w);
    if (c->has_scale) {
        const float sc = c->scale;
        for (size_t j = 0; j < m; j++) v[j] = v_rnd(dt, v[j] * sc);
    }
    if (dt == CT_F16) {
        uint16_t *restrict o = out;
        for (size_t j = 0; j < m; j++) o[j] = (uint16_t)v_f32_to_f16(v[j]);
    } else if (dt == CT_BF16) {
        uint16_t *restrict o = out;
        for (size_t j = 0; j < m; j++) o[j] = (uint16_t)v_f32_to_bf16(v[j]);
    }
}

#define CT_DISPATCH_DT(DIST)                                                  \
    switch (c->dt) {                                                          \
    case CT_F32: transform_tile(c, DIST, CT_F32, b, m, out); break;           \
    case CT_F16: transform_tile(c, DIST, CT_F16, b, m, out); break;           \
    default: transform_tile(c, DIST, CT_BF16, b, m, out); break;              \
    }

/* One specialised loop nest per (dist, dtype); m <= CT_TILE. */
CT_MULTIVERSION
static void transform(const consts *c, const uint32_t *b, size_t m, void *out) {
    switch (c->dist) {
    case CT_DIST_UNIFORM: CT_DISPATCH_DT(CT_DIST_UNIFORM); break;
    case CT_DIST_NORMAL: CT_DISPATCH_DT(CT_DIST_NORMAL); break;
    case CT_DIST_TRUNCATED_NORMAL: CT_DISPATCH_DT(CT_DIST_TRUNCATED_NORMAL); break;
    default: CT_DISPATCH_DT(CT_DIST_BERNOULLI); break;
    }
}

/* 1 when the environment variable `name` is set to something other than "" or "0". */
static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

/* Which hand-vectorised float32 normal / truncated-normal tile transform
 * runs: the widest the CPU has, less those turned off by
 * CTRAINSTATE_NO_AVX512 / CTRAINSTATE_NO_AVX2 (every path gives the same
 * bits; the flags exist to compare and test them). */
typedef enum { PATH_UNSET = -1, PATH_PORTABLE, PATH_AVX2, PATH_AVX512 } cpu_path;

static cpu_path normal_path(void) {
#if CT_RANDOM_HAVE_X86
    static int path = PATH_UNSET; /* benign race: every thread computes the same value */
    if (path == PATH_UNSET) {
        if (ct_random_avx512_available() && !env_flag("CTRAINSTATE_NO_AVX512"))
            path = PATH_AVX512;
        else if (ct_random_avx2_available() && !env_flag("CTRAINSTATE_NO_AVX2"))
            path = PATH_AVX2;
        else
            path = PATH_PORTABLE;
    }
    return (cpu_path)path;
#else
    return PATH_PORTABLE;
#endif
}

const char *ct_random_cpu_path(void) {
    switch (normal_path()) {
    case PATH_AVX512: return "avx512";
    case PATH_AVX2: return "avx2";
    default: return "portable";
    }
}

/* transform(), or a hand-vectorised float32 normal path where it applies. */
static void transform_any(const consts *c, const uint32_t *b, size_t m, void *out) {
#if CT_RANDOM_HAVE_X86
    switch (normal_path()) {
    case PATH_AVX512:
        if (ct_random_tile_normal_f32_avx512(c, b, m, out)) return;
        break;
    case PATH_AVX2:
        if (ct_random_tile_normal_f32_avx2(c, b, m, out)) return;
        break;
    default: break;
    }
#endif
    transform(c, b, m, out);
}

/* --- block fill ------------------------------------------------------------ */

typedef struct {
    const uint32_t *key;
    consts c;
    size_t esize;
    char *out;
} fill_ctx;

static void fill_run(void *vctx, uint64_t g0, uint64_t off, uint64_t n) {
    const fill_ctx *cx = vctx;
    uint32_t b[CT_TILE];
    for (uint64_t t = 0; t < n; t += CT_TILE) {
        size_t m = (size_t)(n - t < CT_TILE ? n - t : CT_TILE);
        ct_threefry_counters(cx->key, g0 + t, m, b, NULL, NULL);
        transform_any(&cx->c, b, m, cx->out + (off + t) * cx->esize);
    }
}

static ct_status fill_check(const uint32_t key[2], const ct_sampler *s, int ndim,
                            const int64_t *global_shape, const int64_t *start,
                            const int64_t *block_shape, const void *out) {
    uint64_t count;
    if (!key) return ct_set_error(CT_EINVAL, "random: key is NULL");
    CT_TRY(ct_sampler_check(s));
    CT_TRY(ct_block_check(ndim, global_shape, start, block_shape, &count));
    if (count && !out) return ct_set_error(CT_EINVAL, "random: output buffer is NULL");
    return CT_OK;
}

ct_status ct_random_fill_block(const uint32_t key[2], const ct_sampler *s, int ndim,
                               const int64_t *global_shape, const int64_t *start,
                               const int64_t *block_shape, void *out) {
    CT_TRY(fill_check(key, s, ndim, global_shape, start, block_shape, out));
    fill_ctx cx;
    cx.key = key;
    cx.c = make_consts(s);
    cx.esize = s->dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s->dtype);
    cx.out = out;
    ct_block_for_each_run(ndim, global_shape, start, block_shape, fill_run, &cx);
    return CT_OK;
}

/* --- device fill ----------------------------------------------------------- */

int ct_random_device_supported(const struct ct_device *dev) {
    return dev && dev->backend && dev->backend->random_fill;
}

ct_status ct_random_fill_block_device(struct ct_device *dev, const uint32_t key[2],
                                      const ct_sampler *s, int ndim,
                                      const int64_t *global_shape, const int64_t *start,
                                      const int64_t *block_shape, void *out) {
    if (!ct_random_device_supported(dev))
        return ct_set_error(CT_EINVAL, "random: device %d's backend has no random fill kernel",
                            dev ? ct_device_global_id(dev) : -1);
    CT_TRY(fill_check(key, s, ndim, global_shape, start, block_shape, out));
    ct_random_consts c = make_consts(s);
    ct_rm_block blk;
    ct_rm_block_make(ndim, global_shape, start, block_shape, &blk);
    if (blk.count == 0) return CT_OK;
    return dev->backend->random_fill(dev, key[0], key[1], &c, &blk, out);
}

/* --- scalar reference ------------------------------------------------------ */

static void ref_element(const consts *c, uint32_t b, void *out, uint64_t e) {
    if (c->dist == CT_DIST_BERNOULLI) ((uint8_t *)out)[e] = uniform_of(c, c->dt, b) < c->p;
    else store(c->dt, out, e, sample_of(c, c->dist, c->dt, b));
}

ct_status ct_random_fill_block_ref(const uint32_t key[2], const ct_sampler *s, int ndim,
                                   const int64_t *global_shape, const int64_t *start,
                                   const int64_t *block_shape, void *out) {
    CT_TRY(fill_check(key, s, ndim, global_shape, start, block_shape, out));
    const consts c = make_consts(s);
    int64_t idx[CT_RANDOM_MAX_NDIM] = { 0 };
    uint64_t count = 1;
    for (int d = 0; d < ndim; d++) count *= (uint64_t)block_shape[d];
    for (uint64_t e = 0; e < count; e++) {
        uint64_t g = 0;
        for (int d = 0; d < ndim; d++)
            g = g * (uint64_t)global_shape[d] + (uint64_t)(start[d] + idx[d]);
        uint32_t x[2] = { (uint32_t)(g >> 32), (uint32_t)g };
        ct_threefry2x32(key, x);
        ref_element(&c, x[0] ^ x[1], out, e);
        for (int d = ndim - 1; d >= 0; d--) {
            if (++idx[d] < block_shape[d]) break;
            idx[d] = 0;
        }
    }
    return CT_OK;
}

ct_status ct_random_keyed(const ct_sampler *s, size_t n, const uint32_t *k0,
                          const uint32_t *k1, void *out) {
    CT_TRY(ct_sampler_check(s));
    if (n && (!k0 || !k1 || !out)) return ct_set_error(CT_EINVAL, "random: NULL keys or output");
    const consts c = make_consts(s);
    const size_t esize = s->dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s->dtype);
    uint32_t w[CT_TILE], hi[CT_TILE];
    for (size_t t = 0; t < n; t += CT_TILE) {
        size_t m = n - t < CT_TILE ? n - t : CT_TILE;
        ct_threefry2x32_keys(m, k0 + t, k1 + t, 0u, 0u, hi, w);
        for (size_t j = 0; j < m; j++) w[j] ^= hi[j];
        transform_any(&c, w, m, (char *)out + t * esize);
    }
    return CT_OK;
}

ct_status ct_random_transform_words(const ct_sampler *s, const uint32_t *words, size_t n,
                                    void *out, int ref) {
    CT_TRY(ct_sampler_check(s));
    if (n && (!words || !out)) return ct_set_error(CT_EINVAL, "random: NULL words or output");
    const consts c = make_consts(s);
    const size_t esize = s->dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s->dtype);
    for (size_t t = 0; t < n; t += CT_TILE) {
        size_t m = n - t < CT_TILE ? n - t : CT_TILE;
        if (ref) {
            for (size_t j = 0; j < m; j++) ref_element(&c, words[t + j], out, t + j);
        } else {
            transform_any(&c, words + t, m, (char *)out + t * esize);
        }
    }
    return CT_OK;
}
