/*
 * ct_optim.c — the fused multi-tensor optimizer driver and its stages.
 *
 * See ct_optim.h for the model. Layout of this file:
 *   --- conversions  16-bit operands to and from float32 chunks (hand-written
 *                    F16C / AVX-512 paths for float16, see there)
 *   --- stages       one static inline function per elementwise stage, on a chunk
 *   --- factored     adafactor's factored statistics: block geometry, the
 *                    statistics of a chunk, cross-block sums, the factors
 *   --- tasks        the per-task work of each pass, compiled once per ISA, and
 *                    adamw16: AdamW on blocks with 16-bit arrays in one hand-written
 *                    AVX-512 pass (the chunk path is twice as slow there)
 *   --- driver       task tables, reduction passes, the fused pass
 *   --- reference    a plain one-element-at-a-time version for the tests
 *
 * Speed. The step is memory-bound once its arithmetic runs at vector width:
 * every stage is a plain loop over a chunk held in L1 that GCC vectorises
 * (this file is compiled with -fno-math-errno so sqrtf becomes vsqrtps; see
 * setup.py), and the task functions are compiled for x86-64-v4 (AVX-512),
 * x86-64-v3 (AVX2) and the baseline and picked at load time by CPU features.
 * All clones give identical results: only correctly rounded IEEE operations
 * (+, *, /, sqrt; fp-contract is off under -std=c11, so no FMA contraction).
 * Work is split into tasks of at most CT_OPT_TASK elements of one block,
 * handed out dynamically: a 38.6M-element embedding becomes ~600 tasks and a
 * 768-element bias one, so leaves of very different sizes balance, and a core
 * taken by another process does not hold up a static half.
 *
 * 16-bit operands. A bfloat16 / float16 array (params, grads, updates, a
 * state slot) is widened chunk by chunk into float32 scratch beside u (L1),
 * the stages run on the scratch exactly as on a float32 array, and what a
 * stage wrote is rounded once and stored (--- conversions). A float32 array is
 * used in place, as before: its path does not change. AdamW on a block with a
 * 16-bit array takes a one-pass AVX-512 loop instead (adamw16, before
 * task_apply): the chunk path's extra passes would make a bfloat16 step as slow
 * as a float32 one, with half the bytes.
 */
#include "ct_optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ct_convert_math.h"
#include "ct_device.h"
#include "ct_par.h"
#include "ct_simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CT_OPT_X86 1
#else
#define CT_OPT_X86 0
#endif

static const int kind_nslots[CT_OPT_NUM_KINDS] = {
    [CT_OPT_SCALE] = 0, [CT_OPT_ADAM] = 2, [CT_OPT_DECAY] = 0, [CT_OPT_TRACE] = 1,
    [CT_OPT_LION] = 1,  [CT_OPT_RMS] = 1,  [CT_OPT_RSS] = 1,   [CT_OPT_CLIP] = 0,
    [CT_OPT_GLOBAL_NORM] = 0, [CT_OPT_TRUST_RATIO] = 0, [CT_OPT_FINITE_GATE] = 0,
    [CT_OPT_EMA] = 1, [CT_OPT_FACTORED] = 3, [CT_OPT_BLOCK_RMS] = 0, [CT_OPT_PARAM_RMS] = 0,
    [CT_OPT_ZERO] = 0, [CT_OPT_BELIEF] = 2, [CT_OPT_YOGI] = 2,
    [CT_OPT_STDDEV] = 2, [CT_OPT_ACCUM] = 1, [CT_OPT_ADAMAX] = 2, [CT_OPT_AMSGRAD] = 3,
};

int ct_opt_kind_nslots(int kind) {
    return (kind >= 0 && kind < CT_OPT_NUM_KINDS) ? kind_nslots[kind] : -1;
}

static int kind_is_reduction(int kind) {
    return kind == CT_OPT_GLOBAL_NORM || kind == CT_OPT_TRUST_RATIO ||
           kind == CT_OPT_FINITE_GATE || kind == CT_OPT_FACTORED || kind == CT_OPT_BLOCK_RMS ||
           kind == CT_OPT_PARAM_RMS;
}

static int kind_needs_params(int kind) {
    return kind == CT_OPT_DECAY || kind == CT_OPT_TRUST_RATIO || kind == CT_OPT_PARAM_RMS;
}

// ---------------------------------------------------------------------------------------------
// conversions
//
// The exact definitions are ct_random_math.h's (also those of op_convert): widening is exact
// (a float16 signalling NaN stays signalling), narrowing rounds to nearest even, a float16
// NaN becomes 0x7e00 with its sign, a bfloat16 NaN keeps its top 16 bits with the quiet bit
// set. bfloat16 is shifts and an add: plain loops, vectorised by GCC in each ISA clone of the
// task functions. float16: vcvtph2ps / vcvtps2ph (F16C; 16 lanes with AVX-512, 8 with AVX2)
// where the CPU has them, picked once like ct_random.c's paths. They differ from the
// definition only on NaNs (F16C quiets a signalling NaN when widening and keeps a NaN's
// payload when narrowing): a vector holding a NaN, rare, is redone element by element.

#define CT_INLINE static inline __attribute__((always_inline))

typedef enum { CVT_PORTABLE = 0, CVT_AVX2 = 1, CVT_AVX512 = 2 } cvt_path_t;

static void f16_load_portable(const uint16_t *restrict x, int64_t n, float *restrict y) {
    for (int64_t i = 0; i < n; i++) y[i] = ct_rm_f16_to_f32(x[i]);
}

static void f16_store_portable(const float *restrict x, int64_t n, uint16_t *restrict y) {
    for (int64_t i = 0; i < n; i++) y[i] = ct_rm_f32_to_f16(x[i]);
}

#if CT_OPT_X86
#define CT_OPT_AVX512 __attribute__((target("avx512f,avx512vl,f16c")))
#define CT_OPT_AVX2 __attribute__((target("avx2,f16c")))

CT_OPT_AVX512 static void f16_load_avx512(const uint16_t *restrict x, int64_t n,
                                          float *restrict y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i)));
        if (_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q) != 0) {
            for (int j = 0; j < 16; j++) y[i + j] = ct_rm_f16_to_f32(x[i + j]);
            continue;
        }
        _mm512_storeu_ps(y + i, f);
    }
    for (; i < n; i++) y[i] = ct_rm_f16_to_f32(x[i]);
}

CT_OPT_AVX512 static void f16_store_avx512(const float *restrict x, int64_t n,
                                           uint16_t *restrict y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 f = _mm512_loadu_ps(x + i);
        if (_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q) != 0) {
            for (int j = 0; j < 16; j++) y[i + j] = ct_rm_f32_to_f16(x[i + j]);
            continue;
        }
        _mm256_storeu_si256((__m256i *)(y + i),
                            _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) y[i] = ct_rm_f32_to_f16(x[i]);
}

CT_OPT_AVX2 static void f16_load_avx2(const uint16_t *restrict x, int64_t n, float *restrict y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
            for (int j = 0; j < 8; j++) y[i + j] = ct_rm_f16_to_f32(x[i + j]);
            continue;
        }
        _mm256_storeu_ps(y + i, f);
    }
    for (; i < n; i++) y[i] = ct_rm_f16_to_f32(x[i]);
}

CT_OPT_AVX2 static void f16_store_avx2(const float *restrict x, int64_t n, uint16_t *restrict y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 f = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
            for (int j = 0; j < 8; j++) y[i + j] = ct_rm_f32_to_f16(x[i + j]);
            continue;
        }
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) y[i] = ct_rm_f32_to_f16(x[i]);
}
#endif

static int cvt_env_flag(const char *name) {
    const char *v = getenv(name);
    return v != NULL && *v != '\0' && strcmp(v, "0") != 0;
}

/* The widest path the CPU has that is not above `want`. */
static cvt_path_t cvt_supported(int want) {
#if CT_OPT_X86
    __builtin_cpu_init();
    if (want >= CVT_AVX512 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
        return CVT_AVX512;
    if (want >= CVT_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return CVT_AVX2;
#else
    (void)want;
#endif
    return CVT_PORTABLE;
}

/* The driver's path, picked once (a benign race: every thread computes the same value). */
static cvt_path_t cvt_path(void) {
    static int path = -1;
    if (path < 0) {
        int want = CVT_AVX512;
#if CT_OPT_X86
        if (cvt_env_flag("CTRAINSTATE_NO_AVX512")) want = CVT_AVX2;
        if (cvt_env_flag("CTRAINSTATE_NO_AVX2")) want = CVT_PORTABLE;
#endif
        path = (int)cvt_supported(want);
    }
    return (cvt_path_t)path;
}

static void f16_load(cvt_path_t path, const uint16_t *x, int64_t n, float *y) {
#if CT_OPT_X86
    if (path == CVT_AVX512) {
        f16_load_avx512(x, n, y);
        return;
    }
    if (path == CVT_AVX2) {
        f16_load_avx2(x, n, y);
        return;
    }
#endif
    (void)path;
    f16_load_portable(x, n, y);
}

static void f16_store(cvt_path_t path, const float *x, int64_t n, uint16_t *y) {
#if CT_OPT_X86
    if (path == CVT_AVX512) {
        f16_store_avx512(x, n, y);
        return;
    }
    if (path == CVT_AVX2) {
        f16_store_avx2(x, n, y);
        return;
    }
#endif
    (void)path;
    f16_store_portable(x, n, y);
}

/* ct_rm_f32_to_bf16 as a select, so the loops below vectorise. */
CT_INLINE uint16_t bf16_round(float f) {
    const uint32_t u = ct_rm_f2u(f);
    const uint16_t nan = (uint16_t)((u >> 16) | 0x40u);
    const uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : r;
}

/* y[0, n) = elements [off, off + n) of x (dtype dt) as float32. */
CT_INLINE void cvt_load(int dt, const void *x, int64_t off, int64_t n, float *restrict y) {
    if (dt == CT_BF16) {
        const uint16_t *restrict h = (const uint16_t *)x + off;
        for (int64_t i = 0; i < n; i++) y[i] = ct_rm_bf16_to_f32(h[i]);
    } else if (dt == CT_F16) {
        f16_load(cvt_path(), (const uint16_t *)x + off, n, y);
    } else {
        memcpy(y, (const float *)x + off, (size_t)n * sizeof *y);
    }
}

/* Elements [off, off + n) of y (dtype dt) = x[0, n) rounded to dt. */
CT_INLINE void cvt_store(int dt, const float *restrict x, int64_t n, void *y, int64_t off) {
    if (dt == CT_BF16) {
        uint16_t *restrict h = (uint16_t *)y + off;
        for (int64_t i = 0; i < n; i++) h[i] = bf16_round(x[i]);
    } else if (dt == CT_F16) {
        f16_store(cvt_path(), x, n, (uint16_t *)y + off);
    } else {
        memcpy((float *)y + off, x, (size_t)n * sizeof *x);
    }
}

// ---------------------------------------------------------------------------------------------
// stages
//
// Each works on n elements of the chunk u (in place). `W` is a compile-time
// constant after inlining: 1 writes the stage's state, 0 (the read-only
// reduction passes) only computes u.

/* Double sums over NL fixed lanes: vectorised with independent accumulators
 * (the add latency does not bind), in an order that does not depend on the
 * number of threads. lanes_sum folds them pairwise (and consumes s). */
#define NL 16

CT_INLINE double lanes_sum(double *s) {
    for (int w = NL / 2; w >= 1; w /= 2)
        for (int t = 0; t < w; t++) s[t] += s[t + w];
    return s[0];
}

CT_INLINE void st_scale(float *restrict u, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) u[i] = s * u[i];
}

CT_INLINE void st_div(float *restrict u, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) u[i] = u[i] / s;
}

CT_INLINE void st_decay(float *restrict u, const float *restrict p, int64_t n, float wd) {
    for (int64_t i = 0; i < n; i++) u[i] = u[i] + wd * p[i];
}

/* One loop, no scratch: with -fno-math-errno sqrtf and the division
 * vectorise (vsqrtps / vdivps), bitwise equal to the scalar reference. */
CT_INLINE void st_adam(float *restrict u, float *restrict m, float *restrict v, int64_t n,
                       const double *s, const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1], eps = (float)s[2], eps_root = (float)s[3];
    const float bc1 = (float)s[4], bc2 = (float)s[5], bc1n = (float)s[7];
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    /* Bias corrections as multiplications by their reciprocals: within an
     * ulp of optax's divisions, one division per element fewer. */
    const float ibc1 = 1.0f / bc1, ibc2 = 1.0f / bc2, ibc1n = 1.0f / bc1n;
    const int mode = (int)s[6];
    if (mode & 2) { /* moment only (radam before rectification): u = mu_hat */
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float mi = c1 * g + b1 * m[i];
            float vi = c2 * (g * g) + b2 * v[i];
            u[i] = (mode & 1) ? b1 * (mi * ibc1n) + c1 * (g * ibc1) : mi * ibc1;
            if (W) { m[i] = mi; v[i] = vi; }
        }
    } else if (mode & 1) { /* nesterov: b1*mu/(1-b1^(t+1)) + (1-b1)*g/(1-b1^t) */
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float mi = c1 * g + b1 * m[i];
            float vi = c2 * (g * g) + b2 * v[i];
            float mh = b1 * (mi * ibc1n) + c1 * (g * ibc1);
            u[i] = mh / (sqrtf(vi * ibc2 + eps_root) + eps);
            if (W) { m[i] = mi; v[i] = vi; }
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float mi = c1 * g + b1 * m[i];
            float vi = c2 * (g * g) + b2 * v[i];
            u[i] = (mi * ibc1) / (sqrtf(vi * ibc2 + eps_root) + eps);
            if (W) { m[i] = mi; v[i] = vi; }
        }
    }
}

/* AdaBelief: nu follows the squared prediction error (g - mu)^2, plus eps_root. */
CT_INLINE void st_belief(float *restrict u, float *restrict m, float *restrict v, int64_t n,
                         const double *s, const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1], eps = (float)s[2], eps_root = (float)s[3];
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    const float ibc1 = 1.0f / (float)s[4], ibc2 = 1.0f / (float)s[5], ibc1n = 1.0f / (float)s[7];
    const int nesterov = ((int)s[6]) & 1;
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float mi = c1 * g + b1 * m[i];
        float e = g - mi;
        float vi = (c2 * (e * e) + b2 * v[i]) + eps_root;
        float mh = nesterov ? b1 * (mi * ibc1n) + c1 * (g * ibc1) : mi * ibc1;
        u[i] = mh / (sqrtf(vi * ibc2) + eps);
        if (W) { m[i] = mi; v[i] = vi; }
    }
}

/* Yogi: nu moves toward g^2 by (1-b2) g^2 in the direction of sign(g^2 - nu). */
CT_INLINE void st_yogi(float *restrict u, float *restrict m, float *restrict v, int64_t n,
                       const double *s, const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1], eps = (float)s[2], eps_root = (float)s[3];
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    const float ibc1 = 1.0f / (float)s[4], ibc2 = 1.0f / (float)s[5];
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float mi = c1 * g + b1 * m[i];
        float g2 = g * g, d = v[i] - g2;
        float sg = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : d); /* sign; keeps 0 and NaN */
        float vi = v[i] - (c2 * sg) * g2;
        u[i] = (mi * ibc1) / (sqrtf(vi * ibc2 + eps_root) + eps);
        if (W) { m[i] = mi; v[i] = vi; }
    }
}

CT_INLINE void st_trace(float *restrict u, float *restrict t, int64_t n, const double *s,
                        const int W) {
    const float d = (float)s[0];
    const int nesterov = s[1] != 0.0;
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float ti = g + d * t[i];
        u[i] = nesterov ? g + d * ti : ti;
        if (W) t[i] = ti;
    }
}

CT_INLINE void st_lion(float *restrict u, float *restrict m, int64_t n, const double *s,
                       const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1];
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float x = (1.0f - b1) * g + b1 * m[i];
        u[i] = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); /* sign; keeps 0 and NaN */
        if (W) m[i] = (1.0f - b2) * g + b2 * m[i];
    }
}

CT_INLINE void st_rms(float *restrict u, float *restrict v, int64_t n, const double *s,
                      const int W) {
    const float dc = (float)s[0], eps = (float)s[1], bc = (float)s[3];
    if (s[2] != 0.0) {
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float vi = (1.0f - dc) * (g * g) + dc * v[i];
            u[i] = (1.0f / sqrtf(vi / bc + eps)) * g;
            if (W) v[i] = vi;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float vi = (1.0f - dc) * (g * g) + dc * v[i];
            u[i] = (1.0f / (sqrtf(vi / bc) + eps)) * g;
            if (W) v[i] = vi;
        }
    }
}

/* Centered RMSProp: the variance estimate nu^ - mu^^2 (both bias-corrected by bc). */
CT_INLINE void st_stddev(float *restrict u, float *restrict m, float *restrict v, int64_t n,
                         const double *s, const int W) {
    const float dc = (float)s[0], eps = (float)s[1], bc = (float)s[3], c = 1.0f - dc;
    const int in_sqrt = s[2] != 0.0;
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float mi = c * g + dc * m[i];
        float vi = c * (g * g) + dc * v[i];
        float mh = mi / bc, var = vi / bc - mh * mh;
        u[i] = (in_sqrt ? 1.0f / sqrtf(var + eps) : 1.0f / (sqrtf(var) + eps)) * g;
        if (W) { m[i] = mi; v[i] = vi; }
    }
}

/* AMSGrad: Adam's moments plus the running maximum of the bias-corrected second moment. */
CT_INLINE void st_amsgrad(float *restrict u, float *restrict m, float *restrict v,
                          float *restrict vmax, int64_t n, const double *s, const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1], eps = (float)s[2], eps_root = (float)s[3];
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    const float ibc1 = 1.0f / (float)s[4], ibc2 = 1.0f / (float)s[5];
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float mi = c1 * g + b1 * m[i];
        float vi = c2 * (g * g) + b2 * v[i];
        float ve = vi * ibc2, x = vmax[i];
        float mx = (x > ve || x != x) ? x : ve; /* jnp.maximum: NaN kept */
        u[i] = (mi * ibc1) / (sqrtf(mx + eps_root) + eps);
        if (W) { m[i] = mi; v[i] = vi; vmax[i] = mx; }
    }
}

/* Adamax: the infinity-norm moment max(|g| + eps, b2 nu), NaN-propagating like jnp.maximum. */
CT_INLINE void st_adamax(float *restrict u, float *restrict m, float *restrict v, int64_t n,
                         const double *s, const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1], eps = (float)s[2], c1 = 1.0f - b1;
    const float ibc1 = 1.0f / (float)s[4];
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float mi = c1 * g + b1 * m[i];
        float x = fabsf(g) + eps, y = b2 * v[i];
        float vi = (x > y || x != x) ? x : y;
        u[i] = (mi * ibc1) / vi;
        if (W) { m[i] = mi; v[i] = vi; }
    }
}

/* Gradient accumulation (MultiSteps, Welford mean): the running mean of the mini-step
 * grads; on the emitting mini-step it becomes the update and the accumulator resets. */
CT_INLINE void st_accum(float *restrict u, float *restrict a, int64_t n, const double *s,
                        const int W) {
    const float n1 = (float)s[0];
    const int emit = s[1] != 0.0, sum = s[2] != 0.0;
    for (int64_t i = 0; i < n; i++) {
        float ai = sum ? u[i] + a[i] : a[i] + (u[i] - a[i]) / n1;
        u[i] = emit ? ai : 0.0f;
        if (W) a[i] = emit ? 0.0f : ai;
    }
}

CT_INLINE void st_rss(float *restrict u, float *restrict a, int64_t n, const double *s,
                      const int W) {
    const float eps = (float)s[0];
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float ai = g * g + a[i];
        float r = 1.0f / sqrtf(ai + eps);
        u[i] = (ai > 0.0f ? r : 0.0f) * g;
        if (W) a[i] = ai;
    }
}

CT_INLINE void st_ema(float *restrict u, float *restrict e, int64_t n, const double *s,
                      const int W) {
    const float d = (float)s[0], bc = (float)s[1];
    for (int64_t i = 0; i < n; i++) {
        float ei = (1.0f - d) * u[i] + d * e[i];
        u[i] = ei / bc;
        if (W) e[i] = ei;
    }
}

CT_INLINE void st_clip(float *restrict u, int64_t n, float mx) {
    for (int64_t i = 0; i < n; i++) {
        float x = u[i] < -mx ? -mx : u[i];
        u[i] = x > mx ? mx : x;
    }
}

/* Adafactor, a leaf that is not factored: v = drt v + (1-drt)(g^2 + eps), u = g v^-1/2. */
CT_INLINE void st_unfactored(float *restrict u, float *restrict v, int64_t n, const double *s,
                             const int W) {
    const float drt = (float)s[0], eps = (float)s[1], c = 1.0f - drt;
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float vi = drt * v[i] + c * (g * g + eps);
        u[i] = g * (1.0f / sqrtf(vi));
        if (W) v[i] = vi;
    }
}

// ---------------------------------------------------------------------------------------------
// factored
//
// A factored block, row-major, is viewed as (P, Slo, M, Shi, Q): lo/hi are
// the factored dims in axis order, P/M/Q the products of the dims before,
// between and after them. A *line* is one (p, a, m): Shi*Q contiguous
// elements, j = b*Q + q. The statistic without hi is indexed line*Q + q (a
// line owns its entries); the one without lo (p*M + m)*Shi*Q + j.

typedef struct {
    int64_t P, Slo, M, Shi, Q, L, nlines, n_nolo, n_nohi;
    int lo, hi, d0_is_lo;
} fgeom;

static fgeom fgeom_of(const ct_opt_geom *g) {
    fgeom f;
    f.lo = g->d0 < g->d1 ? g->d0 : g->d1;
    f.hi = g->d0 < g->d1 ? g->d1 : g->d0;
    f.d0_is_lo = g->d0 == f.lo;
    f.P = f.M = f.Q = 1;
    for (int d = 0; d < f.lo; d++) f.P *= g->bshape[d];
    for (int d = f.lo + 1; d < f.hi; d++) f.M *= g->bshape[d];
    for (int d = f.hi + 1; d < g->ndim; d++) f.Q *= g->bshape[d];
    f.Slo = g->bshape[f.lo];
    f.Shi = g->bshape[f.hi];
    f.L = f.Shi * f.Q;
    f.nlines = f.P * f.Slo * f.M;
    f.n_nohi = f.nlines * f.Q;
    f.n_nolo = f.P * f.M * f.L;
    return f;
}

/* Per-block factors of a FACTORED stage: row (indexed without d0) and column
 * (without d1) factors, as the nolo / nohi statistics they are. */
typedef struct {
    float *nolo, *nohi;
} ffac;

/* u[j0..j0+n) of line `line` *= row factor, then *= column factor (optax's order). */
CT_INLINE void st_factored(float *restrict u, int64_t off, int64_t n, const fgeom *f,
                           const ffac *x) {
    int64_t line = off / f->L, j = off % f->L, i = 0;
    while (i < n) {
        int64_t len = f->L - j < n - i ? f->L - j : n - i;
        int64_t p = line / (f->Slo * f->M), m = line % f->M;
        const float *lo = x->nolo + (p * f->M + m) * f->L + j;
        float *restrict w = u + i;
        if (f->Q == 1) {
            const float h = x->nohi[line];
            if (f->d0_is_lo)
                for (int64_t k = 0; k < len; k++) w[k] = (w[k] * lo[k]) * h;
            else
                for (int64_t k = 0; k < len; k++) w[k] = (w[k] * h) * lo[k];
        } else {
            const float *hi = x->nohi + line * f->Q;
            int64_t q = j % f->Q;
            for (int64_t k = 0; k < len; k++) {
                w[k] = f->d0_is_lo ? (w[k] * lo[k]) * hi[q] : (w[k] * hi[q]) * lo[k];
                if (++q == f->Q) q = 0;
            }
        }
        i += len;
        j = 0;
        line++;
    }
}

/* Add (u^2 + eps) of a run of one line to the statistics: nohi (owned by the
 * line) and nolo (this segment's partial). */
CT_INLINE void stats_run(const float *restrict u, int64_t n, int64_t line, int64_t j,
                         const fgeom *f, float eps, double *restrict nolo,
                         double *restrict nohi) {
    double *restrict lo = nolo + ((line / (f->Slo * f->M)) * f->M + line % f->M) * f->L + j;
    if (f->Q == 1) {
        double s[NL] = {0};
        int64_t k = 0;
        for (; k + NL <= n; k += NL)
            for (int t = 0; t < NL; t++) {
                float x = u[k + t] * u[k + t] + eps;
                lo[k + t] += (double)x;
                s[t] += (double)x;
            }
        for (; k < n; k++) {
            float x = u[k] * u[k] + eps;
            lo[k] += (double)x;
            s[k % NL] += (double)x;
        }
        nohi[line] += lanes_sum(s);
    } else {
        double *hi = nohi + line * f->Q;
        int64_t q = j % f->Q;
        for (int64_t k = 0; k < n; k++) {
            float x = u[k] * u[k] + eps;
            lo[k] += (double)x;
            hi[q] += (double)x;
            if (++q == f->Q) q = 0;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// tasks

typedef struct {
    const ct_opt_stage *st;
    int nstages;
    int slot_off[CT_OPT_MAX_STAGES];
    uint32_t skip;                    /* stages covered by a rejecting gate */
    uint32_t zero;                    /* rejecting gates: u = 0 there */
    float norm[CT_OPT_MAX_STAGES];    /* GLOBAL_NORM: the norm */
    int clip[CT_OPT_MAX_STAGES];      /* GLOBAL_NORM: 1 when u must be rescaled */
    float *leaf_f[CT_OPT_MAX_STAGES]; /* TRUST_RATIO, PARAM_RMS: per-leaf factor; BLOCK_RMS: divisor */
    ffac *fac[CT_OPT_MAX_STAGES];     /* FACTORED: factors per global block index */
    int acc_p;                        /* reduction pass also sums p^2 */
    int no_fused;                     /* CTRAINSTATE_OPT_NO_FUSED16: adamw16 off (tests) */
} ct_opt_ctx;

/* Float32 chunks of one task: u, and the float32 views of 16-bit operands (params, up to
 * three slots of the stage running). */
typedef struct {
    float u[CT_OPT_CHUNK] __attribute__((aligned(64)));
    float p[CT_OPT_CHUNK] __attribute__((aligned(64)));
    float s[3][CT_OPT_CHUNK] __attribute__((aligned(64)));
} chunk_buf;

/* Elements [off, off+n) of slot q of block b as float32: the slot itself when it is
 * float32, else widened into buf. */
CT_INLINE float *slot_open(const ct_opt_block *b, int q, int64_t off, int64_t n, float *buf) {
    if (b->slot_dt[q] == CT_F32) return (float *)b->slot[q] + off;
    cvt_load(b->slot_dt[q], b->slot[q], off, n, buf);
    return buf;
}

/* After a stage wrote slot q through slot_open's view: a 16-bit slot is stored, rounded. */
CT_INLINE void slot_close(const ct_opt_block *b, int q, int64_t off, int64_t n, const float *buf) {
    if (b->slot_dt[q] != CT_F32) cvt_store(b->slot_dt[q], buf, n, b->slot[q], off);
}

/* Whether a stage in [0, upto) that reads p (DECAY) runs on block b. */
static inline int reads_p(const ct_opt_ctx *c, const ct_opt_block *b, int upto) {
    for (int k = 0; k < upto; k++)
        if (((b->active >> k) & 1u) && !((c->skip >> k) & 1u) && c->st[k].kind == CT_OPT_DECAY)
            return 1;
    return 0;
}

/* Elements [off, off+n) of block b's params as float32 (b->p in place when it is float32,
 * else widened into buf). */
CT_INLINE float *params_view(const ct_opt_block *b, int64_t off, int64_t n, float *buf) {
    if (b->p_dt == CT_F32) return (float *)b->p + off;
    cvt_load(b->p_dt, b->p, off, n, buf);
    return buf;
}

/* buf->u = the update after stages [0, upto) on chunk [off, off+n) of block b
 * (global index bid); p: the chunk's params as float32 (NULL unless a stage reads them);
 * W: write the stages' state. */
CT_INLINE void compute_u(const ct_opt_ctx *c, const ct_opt_block *b, int64_t bid, int64_t off,
                         int64_t n, int upto, chunk_buf *buf, const float *p, const int W) {
    float *restrict u = buf->u;
    cvt_load(b->g_dt, b->g, off, n, u);
    for (int k = 0; k < upto; k++) {
        if (!((b->active >> k) & 1u) || ((c->skip >> k) & 1u)) continue;
        const ct_opt_stage *s = &c->st[k];
        const int o = c->slot_off[k];
        /* the slots read per element: FACTORED's v only on a leaf that is not factored */
        int q0 = 0, q1 = kind_nslots[s->kind];
        if (s->kind == CT_OPT_FACTORED) q0 = b->geom.ndim == 0 ? 2 : q1;
        float *sv[3] = {NULL, NULL, NULL};
        for (int q = q0; q < q1; q++) sv[q] = slot_open(b, o + q, off, n, buf->s[q]);
        float *s0 = sv[0], *s1 = sv[1], *s2 = sv[2];
        switch (s->kind) {
        case CT_OPT_SCALE: st_scale(u, n, (float)s->s[0]); break;
        case CT_OPT_ZERO: memset(u, 0, (size_t)n * sizeof *u); break;
        case CT_OPT_DECAY: st_decay(u, p, n, (float)s->s[0]); break;
        case CT_OPT_CLIP: st_clip(u, n, (float)s->s[0]); break;
        case CT_OPT_ADAM: st_adam(u, s0, s1, n, s->s, W); break;
        case CT_OPT_BELIEF: st_belief(u, s0, s1, n, s->s, W); break;
        case CT_OPT_YOGI: st_yogi(u, s0, s1, n, s->s, W); break;
        case CT_OPT_STDDEV: st_stddev(u, s0, s1, n, s->s, W); break;
        case CT_OPT_ACCUM: st_accum(u, s0, n, s->s, W); break;
        case CT_OPT_ADAMAX: st_adamax(u, s0, s1, n, s->s, W); break;
        case CT_OPT_AMSGRAD: st_amsgrad(u, s0, s1, s2, n, s->s, W); break;
        case CT_OPT_TRACE: st_trace(u, s0, n, s->s, W); break;
        case CT_OPT_LION: st_lion(u, s0, n, s->s, W); break;
        case CT_OPT_RMS: st_rms(u, s0, n, s->s, W); break;
        case CT_OPT_RSS: st_rss(u, s0, n, s->s, W); break;
        case CT_OPT_EMA: st_ema(u, s0, n, s->s, W); break;
        case CT_OPT_GLOBAL_NORM:
            if (c->clip[k]) {
                const float nrm = c->norm[k], mx = (float)s->s[0];
                for (int64_t i = 0; i < n; i++) u[i] = (u[i] / nrm) * mx;
            }
            break;
        case CT_OPT_TRUST_RATIO:
        case CT_OPT_PARAM_RMS: st_scale(u, n, c->leaf_f[k][b->leaf]); break;
        case CT_OPT_BLOCK_RMS: st_div(u, n, c->leaf_f[k][b->leaf]); break;
        case CT_OPT_FINITE_GATE:
            if ((c->zero >> k) & 1u) memset(u, 0, (size_t)n * sizeof *u);
            break;
        case CT_OPT_FACTORED:
            if (b->geom.ndim == 0) {
                st_unfactored(u, s2, n, s->s, W);
            } else {
                const fgeom f = fgeom_of(&b->geom);
                st_factored(u, off, n, &f, &c->fac[k][bid]);
            }
            break;
        default: break;
        }
        if (W)
            for (int q = q0; q < q1; q++) slot_close(b, o + q, off, n, buf->s[q]);
    }
}

/* Whether any of stages [0, upto) changes u on block b: if none, passes read g
 * in place instead of copying it. */
static inline int any_stage(const ct_opt_ctx *c, const ct_opt_block *b, int upto) {
    for (int k = 0; k < upto; k++)
        if (((b->active >> k) & 1u) && !((c->skip >> k) & 1u)) return 1;
    return 0;
}

/* AdamW on a block with 16-bit arrays, in one pass (llm.c's adamw_update<Tp, Tg>).
 *
 * The chunk path above widens each 16-bit array of a chunk into L1 scratch, runs each stage
 * as its own loop and rounds the results back: about ten passes over L1 per chunk, and the
 * widening and rounding passes stall on memory without the arithmetic to hide it. For the
 * chain most steps run, AdamW (optax.adamw / adam, optionally after clip_by_global_norm or
 * behind a gate that passes), this loop takes 16 elements at a time through the whole step
 * in AVX-512 registers: each array loaded in its dtype and widened, Adam, weight decay, the
 * learning rate, p + u (or u to the updates), the results rounded and stored. The same
 * float32 operations in the same order as st_adam, st_decay, st_scale and the apply loop
 * (fp-contract is off for this file: no FMA), and the same conversions (--- conversions; a
 * float16 vector holding a NaN is converted element by element), so the bits are those of
 * the chunk path. Used where the CPU has AVX-512 (the conversions' path) and a block has a
 * 16-bit array; float32 blocks keep the chunk path. Elements past the last multiple of 16 of
 * a task take the chunk path. */
typedef struct {
    const void *g;
    void *p, *m, *v, *out;
    int gdt, pdt, mdt, vdt, odt;
    int clip, decay, scale;
    float nrm, mx, b1, b2, c1, c2, ibc1, ibc2, eps, eps_root, wd, sc;
} adamw16_args;

/* Whether block b's fused pass is AdamW: active stages that run, in order, an optional
 * GLOBAL_NORM, ADAM without nesterov / moment-only, an optional DECAY, an optional SCALE (a
 * FINITE_GATE that lets the step through anywhere); then *a holds its arguments. */
static int adamw16_chain(const ct_opt_ctx *c, const ct_opt_block *b, adamw16_args *a) {
    int at = 0; /* the next expected position: 0 norm, 1 adam, 2 decay, 3 scale, 4 done */
    memset(a, 0, sizeof *a);
    for (int k = 0; k < c->nstages; k++) {
        if (!((b->active >> k) & 1u) || ((c->skip >> k) & 1u)) continue;
        const ct_opt_stage *s = &c->st[k];
        switch (s->kind) {
        case CT_OPT_FINITE_GATE:
            if ((c->zero >> k) & 1u) return 0;
            break;
        case CT_OPT_GLOBAL_NORM:
            if (at > 0) return 0;
            at = 1;
            a->clip = c->clip[k];
            a->nrm = c->norm[k];
            a->mx = (float)s->s[0];
            break;
        case CT_OPT_ADAM: {
            if (at > 1 || ((int)s->s[6] & 3) != 0) return 0;
            at = 2;
            const int o = c->slot_off[k];
            a->m = b->slot[o];
            a->v = b->slot[o + 1];
            a->mdt = b->slot_dt[o];
            a->vdt = b->slot_dt[o + 1];
            /* st_adam's constants */
            a->b1 = (float)s->s[0];
            a->b2 = (float)s->s[1];
            a->eps = (float)s->s[2];
            a->eps_root = (float)s->s[3];
            a->c1 = 1.0f - a->b1;
            a->c2 = 1.0f - a->b2;
            a->ibc1 = 1.0f / (float)s->s[4];
            a->ibc2 = 1.0f / (float)s->s[5];
            break;
        }
        case CT_OPT_DECAY:
            if (at != 2) return 0;
            at = 3;
            a->decay = 1;
            a->wd = (float)s->s[0];
            break;
        case CT_OPT_SCALE:
            if (at < 2 || at > 3) return 0;
            at = 4;
            a->scale = 1;
            a->sc = (float)s->s[0];
            break;
        default: return 0;
        }
    }
    if (at < 2) return 0;
    a->g = b->g;
    a->gdt = b->g_dt;
    a->p = b->p;
    a->pdt = b->p_dt;
    a->out = b->out;
    a->odt = b->out_dt;
    return 1;
}

#if CT_OPT_X86
#define CT_OPT_AVX512BW __attribute__((target("avx512f,avx512vl,avx512bw,f16c")))

/* 16 elements from i of x (dtype dt) as float32, for adamw16_loop. float16 through F16C,
 * which widens a signalling NaN to its quiet twin where cvt_load keeps it signalling: the
 * loop only uses a loaded value as an operand of +, *, / or sqrt, which quiet a signalling
 * NaN (and pick between two NaNs by position, not by kind), so its results are the same. */
CT_OPT_AVX512BW static inline __m512 v16_load(int dt, const void *x, int64_t i) {
    if (dt == CT_F32) return _mm512_loadu_ps((const float *)x + i);
    const __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (dt == CT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    return _mm512_cvtph_ps(w);
}

#define CT_OPT_AVX512BF16 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,f16c")))

/* Elements [i, i + 16) of x (dtype dt) = f rounded to dt (cvt_store's bits). */
CT_OPT_AVX512BW static inline void v16_store(int dt, void *x, int64_t i, __m512 f) {
    if (dt == CT_F32) {
        _mm512_storeu_ps((float *)x + i, f);
        return;
    }
    __m256i *h = (__m256i *)((uint16_t *)x + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    const __m512i u = _mm512_castps_si512(f), hi = _mm512_srli_epi32(u, 16);
    if (dt == CT_BF16) { /* bf16_round: (u + 0x7fff + ((u >> 16) & 1)) >> 16, NaN: quiet */
        const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
        _mm256_storeu_si256(h, _mm512_cvtepi32_epi16(r));
        return;
    }
    /* float16: vcvtps2ph rounds to nearest even; a NaN becomes 0x7e00 with its sign */
    const __m256i r = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i qnan = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)),
                                         _mm512_set1_epi32(0x7e00));
    _mm256_storeu_si256(h, _mm256_mask_blend_epi16(nan, r, _mm512_cvtepi32_epi16(qnan)));
}

/* v16_store to bfloat16 with AVX512_BF16's vcvtneps2bf16: bf16_round's rounding and NaNs, but
 * a subnormal input becomes a zero (DAZ), so a vector holding one takes v16_store. */
CT_OPT_AVX512BF16 static inline void v16_store_bf16(void *x, int64_t i, __m512 f) {
    if (_mm512_fpclass_ps_mask(f, 0x20) != 0) { /* 0x20: subnormal */
        v16_store(CT_BF16, x, i, f);
        return;
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)x + i), (__m256i)_mm512_cvtneps_pbh(f));
}

/* v16_store, bfloat16 through v16_store_bf16 */
CT_OPT_AVX512BF16 static inline void v16_store_ne(int dt, void *x, int64_t i, __m512 f) {
    if (dt == CT_BF16) v16_store_bf16(x, i, f);
    else v16_store(dt, x, i, f);
}

/* x[0, n) rounded to bfloat16 into y through v16_store_bf16 (ct_opt_cvt_store's path 3). */
CT_OPT_AVX512BF16 static void bf16_store_avx512bf16(const float *x, int64_t n, uint16_t *y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) v16_store_bf16(y, i, _mm512_loadu_ps(x + i));
    for (; i < n; i++) y[i] = ct_rm_f32_to_bf16(x[i]);
}

/* adamw16's loop, stamped out for two targets below: elements [i0, i0 + 16 * (n / 16)) of
 * the block, the arrays of the dtypes given (a's, or constants: see CT_ADAMW16_DISPATCH),
 * each vector stored through STORE(dt, x, i, f); returns how many. */
#define CT_ADAMW16_LOOP(NAME, TARGET, STORE)                                                           \
TARGET static inline __attribute__((always_inline)) int64_t                                            \
NAME(const adamw16_args *a, int64_t i0, int64_t n, const int gdt, const int pdt, const int mdt,        \
     const int vdt, const int odt) {                                                                   \
    const __m512 b1 = _mm512_set1_ps(a->b1), b2 = _mm512_set1_ps(a->b2);                               \
    const __m512 c1 = _mm512_set1_ps(a->c1), c2 = _mm512_set1_ps(a->c2);                               \
    const __m512 ibc1 = _mm512_set1_ps(a->ibc1), ibc2 = _mm512_set1_ps(a->ibc2);                       \
    const __m512 eps = _mm512_set1_ps(a->eps), eps_root = _mm512_set1_ps(a->eps_root);                 \
    const __m512 wd = _mm512_set1_ps(a->wd), sc = _mm512_set1_ps(a->sc);                               \
    const __m512 nrm = _mm512_set1_ps(a->nrm), mx = _mm512_set1_ps(a->mx);                             \
    const int need_p = a->decay || a->out == NULL;                                                     \
    const int64_t end = i0 + (n & ~(int64_t)15);                                                       \
    for (int64_t i = i0; i < end; i += 16) {                                                           \
        __m512 g = v16_load(gdt, a->g, i);                                                             \
        if (a->clip) g = _mm512_mul_ps(_mm512_div_ps(g, nrm), mx); /* (u / norm) * max_norm */         \
        const __m512 m = v16_load(mdt, a->m, i), v = v16_load(vdt, a->v, i);                           \
        const __m512 p = need_p ? v16_load(pdt, a->p, i) : _mm512_setzero_ps();                        \
        /* st_adam: mi = c1 g + b1 m, vi = c2 (g g) + b2 v,                                            \
         * u = (mi ibc1) / (sqrt(vi ibc2 + eps_root) + eps) */                                         \
        const __m512 mi = _mm512_add_ps(_mm512_mul_ps(c1, g), _mm512_mul_ps(b1, m));                   \
        const __m512 vi = _mm512_add_ps(_mm512_mul_ps(c2, _mm512_mul_ps(g, g)), _mm512_mul_ps(b2, v)); \
        const __m512 den = _mm512_add_ps(                                                              \
            _mm512_sqrt_ps(_mm512_add_ps(_mm512_mul_ps(vi, ibc2), eps_root)), eps);                    \
        __m512 u = _mm512_div_ps(_mm512_mul_ps(mi, ibc1), den);                                        \
        STORE(mdt, a->m, i, mi);                                                                       \
        STORE(vdt, a->v, i, vi);                                                                       \
        if (a->decay) u = _mm512_add_ps(u, _mm512_mul_ps(wd, p)); /* st_decay: u + wd p */             \
        if (a->scale) u = _mm512_mul_ps(sc, u);                    /* st_scale: s u */                 \
        if (a->out != NULL) STORE(odt, a->out, i, u);                                                  \
        else STORE(pdt, a->p, i, _mm512_add_ps(p, u)); /* p + u */                                     \
    }                                                                                                  \
    return end - i0;                                                                                   \
}

/* NAME: LOOP with the dtypes as constants for the usual combinations (all bfloat16, all
 * float16, optax's mu_dtype: float32 with a bfloat16 first moment), so each load and store
 * compiles to its conversion alone; others read the dtypes per vector (about a fifth
 * slower in cache). */
#define CT_ADAMW16_DISPATCH(NAME, TARGET, LOOP)                                          \
TARGET static int64_t NAME(const adamw16_args *a, int64_t i0, int64_t n) {               \
    const int same = a->gdt == a->pdt && a->gdt == a->mdt && a->gdt == a->vdt &&         \
                     (a->out == NULL || a->odt == a->gdt);                               \
    if (same && a->gdt == CT_BF16)                                                       \
        return LOOP(a, i0, n, CT_BF16, CT_BF16, CT_BF16, CT_BF16, CT_BF16);              \
    if (same && a->gdt == CT_F16)                                                        \
        return LOOP(a, i0, n, CT_F16, CT_F16, CT_F16, CT_F16, CT_F16);                   \
    if (a->gdt == CT_F32 && a->pdt == CT_F32 && a->mdt == CT_BF16 && a->vdt == CT_F32 && \
        (a->out == NULL || a->odt == CT_F32))                                            \
        return LOOP(a, i0, n, CT_F32, CT_F32, CT_BF16, CT_F32, CT_F32);                  \
    return LOOP(a, i0, n, a->gdt, a->pdt, a->mdt, a->vdt, a->odt);                       \
}

/* The AVX-512 loop, and the one that rounds bfloat16 with AVX512_BF16 (a fifth faster). */
CT_ADAMW16_LOOP(adamw16_loop, CT_OPT_AVX512BW, v16_store)
CT_ADAMW16_DISPATCH(adamw16_avx512, CT_OPT_AVX512BW, adamw16_loop)
CT_ADAMW16_LOOP(adamw16_loop_bf16, CT_OPT_AVX512BF16, v16_store_ne)
CT_ADAMW16_DISPATCH(adamw16_avx512bf16, CT_OPT_AVX512BF16, adamw16_loop_bf16)
#endif

#if CT_OPT_X86
static int avx512bw(void) {
    static int have = -1; /* a benign race, as below */
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512bw") != 0;
    }
    return have;
}

/* Whether adamw16 rounds bfloat16 with vcvtneps2bf16: the CPU has AVX512_BF16 (and DQ), and
 * CTRAINSTATE_NO_AVX512BF16 does not turn it off (tests compare the two). */
static int avx512bf16(void) {
    static int have = -1; /* a benign race, as below */
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq") &&
               avx512bw() && !cvt_env_flag("CTRAINSTATE_NO_AVX512BF16");
    }
    return have;
}
#endif

/* CTRAINSTATE_OPT_NO_FUSED16=1 turns adamw16 off (read once): every block takes the chunk
 * path, for tests and benchmarks that compare the two. */
static int adamw16_off(void) {
    static int off = -1; /* a benign race: every thread computes the same value */
    if (off < 0) off = cvt_env_flag("CTRAINSTATE_OPT_NO_FUSED16");
    return off;
}

/* Elements [off, off + n) of block b through adamw16 where it applies; returns how many
 * (a multiple of 16 from off; 0: the chunk path takes them all). */
static int64_t adamw16(const ct_opt_ctx *c, const ct_opt_block *b, int64_t off, int64_t n) {
#if CT_OPT_X86
    if (n < 16 || cvt_path() != CVT_AVX512 || !avx512bw() || c->no_fused) return 0;
    int lowp = b->g_dt != CT_F32 || (b->out != NULL && b->out_dt != CT_F32) ||
               (b->p != NULL && b->p_dt != CT_F32);
    adamw16_args a;
    if (!adamw16_chain(c, b, &a)) return 0;
    lowp |= a.mdt != CT_F32 || a.vdt != CT_F32;
    if (!lowp) return 0; /* float32 blocks: the chunk path, as before */
    return avx512bf16() ? adamw16_avx512bf16(&a, off, n) : adamw16_avx512(&a, off, n);
#else
    (void)c;
    (void)b;
    (void)off;
    (void)n;
    return 0;
#endif
}

int ct_opt_cvt_load(int path, int dt, const void *x, int64_t n, float *y) {
    const cvt_path_t pt = path < 0 ? cvt_path() : cvt_supported(path);
    if (dt == CT_F16) f16_load(pt, (const uint16_t *)x, n, y);
    else cvt_load(dt, x, 0, n, y);
    return (int)pt;
}

int ct_opt_cvt_store(int path, int dt, const float *x, int64_t n, void *y) {
#if CT_OPT_X86
    if (path == 3 && dt == CT_BF16 && avx512bf16()) { /* adamw16's bfloat16 rounding */
        bf16_store_avx512bf16(x, n, (uint16_t *)y);
        return 3;
    }
#endif
    const cvt_path_t pt = path < 0 ? cvt_path() : cvt_supported(path);
    if (dt == CT_F16) f16_store(pt, x, n, (uint16_t *)y);
    else cvt_store(dt, x, n, y, 0);
    return (int)pt;
}

/* The fused pass on one task: every stage, then p += u (or out = u). */
CT_MULTIVERSION static void task_apply(const ct_opt_ctx *c, const ct_opt_block *b, int64_t bid,
                                     int64_t off, int64_t n) {
    chunk_buf buf;
    const int need_p = b->out == NULL || reads_p(c, b, c->nstages);
    const int64_t done = adamw16(c, b, off, n);
    for (int64_t o = off + done; o < off + n; o += CT_OPT_CHUNK) {
        const int64_t m = off + n - o < CT_OPT_CHUNK ? off + n - o : CT_OPT_CHUNK;
        float *pv = need_p ? params_view(b, o, m, buf.p) : NULL;
        compute_u(c, b, bid, o, m, c->nstages, &buf, pv, 1);
        if (b->out != NULL) {
            cvt_store(b->out_dt, buf.u, m, b->out, o);
        } else {
            float *restrict pw = pv;
            const float *restrict u = buf.u;
            for (int64_t i = 0; i < m; i++) pw[i] = pw[i] + u[i];
            if (b->p_dt != CT_F32) cvt_store(b->p_dt, pw, m, b->p, o);
        }
    }
}

/* A read-only reduction pass on one task: sum u^2, sum p^2 (acc_p), count of
 * non-finite u, for the u entering stage `upto`. p_only: p^2 alone. */
CT_INLINE void sumsq_lanes(const float *restrict x, int64_t m, double *restrict s) {
    int64_t i = 0;
    for (; i + NL <= m; i += NL)
        for (int t = 0; t < NL; t++) s[t] += (double)x[i + t] * (double)x[i + t];
    for (; i < m; i++) s[i % NL] += (double)x[i] * (double)x[i];
}

CT_MULTIVERSION static void task_reduce(const ct_opt_ctx *c, const ct_opt_block *b, int64_t bid,
                                      int64_t off, int64_t n, int upto, int p_only,
                                      double *acc) {
    chunk_buf buf;
    double su[NL] = {0}, sp[NL] = {0};
    int64_t bad = 0;
    /* float32 grads that no stage changes are read in place */
    const int direct = !any_stage(c, b, upto) && b->g_dt == CT_F32;
    const int sum_p = c->acc_p && b->p != NULL;
    const int need_p = sum_p || (!p_only && reads_p(c, b, upto));
    for (int64_t o = off; o < off + n; o += CT_OPT_CHUNK) {
        const int64_t m = off + n - o < CT_OPT_CHUNK ? off + n - o : CT_OPT_CHUNK;
        const float *pv = need_p ? params_view(b, o, m, buf.p) : NULL;
        if (!p_only) {
            const float *x = (const float *)b->g + o;
            if (direct == 0) {
                compute_u(c, b, bid, o, m, upto, &buf, pv, 0);
                x = buf.u;
            }
            sumsq_lanes(x, m, su);
            for (int64_t i = 0; i < m; i++) bad += !isfinite(x[i]);
        }
        if (sum_p) sumsq_lanes(pv, m, sp);
    }
    acc[0] = lanes_sum(su);
    acc[1] = lanes_sum(sp);
    acc[2] = (double)bad;
}

/* FACTORED statistics of lines [l0, l1) of a factored block, for the u
 * entering stage k: nohi entries of these lines, nolo into this segment's partial. */
CT_MULTIVERSION static void task_stats(const ct_opt_ctx *c, const ct_opt_block *b, int64_t bid,
                                     int64_t l0, int64_t l1, int k, double *nolo, double *nohi) {
    chunk_buf buf;
    const fgeom f = fgeom_of(&b->geom);
    const float eps = (float)c->st[k].s[1];
    const int direct = !any_stage(c, b, k) && b->g_dt == CT_F32;
    const int need_p = reads_p(c, b, k);
    for (int64_t line = l0; line < l1; line++)
        for (int64_t j = 0; j < f.L; j += CT_OPT_CHUNK) {
            const int64_t m = f.L - j < CT_OPT_CHUNK ? f.L - j : CT_OPT_CHUNK;
            const float *x = (const float *)b->g + line * f.L + j;
            if (!direct) {
                const float *pv = need_p ? params_view(b, line * f.L + j, m, buf.p) : NULL;
                compute_u(c, b, bid, line * f.L + j, m, k, &buf, pv, 0);
                x = buf.u;
            }
            stats_run(x, m, line, j, &f, eps, nolo, nohi);
        }
}

// ---------------------------------------------------------------------------------------------
// driver

typedef struct {
    int32_t block;  /* index in its group */
    int64_t off, n;
} ct_opt_task;

#define CT_OPT_TASK (16 * CT_OPT_CHUNK) /* elements per task: ~0.9 MB of AdamW traffic */
#define CT_OPT_PAR_MIN 32768            /* below this many elements a group runs on one thread */
#define CT_OPT_MAX_PEERS 1024 /* blocks per leaf (devices) */
#define CT_OPT_MAX_SEG 16               /* FACTORED: line segments per block (partials) */

/* Per-task reduction results, one cache line each: no false sharing. */
typedef struct {
    double v[8];
} acc_line;

/* Task table of one group. */
typedef struct {
    ct_opt_task *t;
    int64_t n, nelem, base; /* base: global index of the group's first block */
} task_table;

static ct_status make_tasks(const ct_opt_group *grp, int64_t base, task_table *tt) {
    int64_t nt = 0, tot = 0;
    for (int i = 0; i < grp->nblocks; i++) {
        nt += (grp->blocks[i].n + CT_OPT_TASK - 1) / CT_OPT_TASK;
        tot += grp->blocks[i].n;
    }
    tt->t = malloc((size_t)(nt > 0 ? nt : 1) * sizeof *tt->t);
    if (tt->t == NULL)
        return ct_set_error(CT_EOOM, "optimizer step: out of host memory for %lld tasks", (long long)nt);
    int64_t j = 0;
    for (int i = 0; i < grp->nblocks; i++)
        for (int64_t off = 0; off < grp->blocks[i].n; off += CT_OPT_TASK) {
            int64_t m = grp->blocks[i].n - off < CT_OPT_TASK ? grp->blocks[i].n - off : CT_OPT_TASK;
            tt->t[j++] = (ct_opt_task){i, off, m};
        }
    tt->n = nt;
    tt->nelem = tot;
    tt->base = base;
    return CT_OK;
}

/* FACTORED scratch of one block. */
typedef struct {
    fgeom f;
    int nseg;
    double *part;  /* nseg partials of the nolo statistic; part[0..n_nolo) ends as the sum */
    double *nohi;  /* the nohi statistic */
    double *t;     /* row statistic summed over d1 (P*M*Q) */
    float *rcm;    /* row_col_mean (P*M*Q) */
    int on;        /* active and factored */
    int stat;      /* on and counts: computes statistics (a replica uses its peers') */
    int remote;    /* another process's block: part / nohi / t come from the exchanges */
    float *vn;     /* across processes: the new v_row / v_col (nolo, nohi layouts), stored
                    * into the state once every exchange of the step is done */
} fblock;

typedef struct {
    ct_opt_ctx c;
    const ct_opt_group *groups;
    int ngroups, nleaves;
    int64_t nb;               /* blocks, all groups */
    const ct_opt_block **blk; /* by global index */
    int *leaf_next;           /* next block of the same leaf (-1) */
    int *leaf_head;           /* first block of each leaf (-1) */
    task_table *tt;           /* per group */
    acc_line **acc;           /* per group: per task */
    double *leaf_acc;         /* 3 per leaf */
    double *leaf_n;           /* elements per leaf (counting blocks) */
    fblock *fb[CT_OPT_MAX_STAGES];
    const ct_opt_procs *pr;   /* params spanning processes (NULL: one process) */
    int *blk_proc;            /* with pr: the process of each block (by global index) */
} step_env;

/* Whether group gi / global block i belongs to another process (ct_opt_procs). */
static inline int grp_remote(const step_env *e, int gi) {
    return e->pr != NULL && e->pr->group_proc[gi] != e->pr->rank;
}
static inline int blk_remote(const step_env *e, int64_t i) {
    return e->blk_proc != NULL && e->blk_proc[i] != e->pr->rank;
}

/* Every process's doubles, process p sending per[p] of them (every process knows per[]) and
 * this one `mine`: *out (nproc * *width doubles, width the largest per[p]; free it) holds
 * process p's at p * width. No call when every process sends nothing. */
static ct_status xchg(const step_env *e, const double *mine, const size_t *per, double **out,
                      size_t *width) {
    const ct_opt_procs *pr = e->pr;
    size_t w = 0;
    for (int p = 0; p < pr->nproc; p++) w = per[p] > w ? per[p] : w;
    double *send = calloc(w > 0 ? w : 1, sizeof *send);
    double *recv = malloc((size_t)pr->nproc * (w > 0 ? w : 1) * sizeof *recv);
    if (send == NULL || recv == NULL) {
        free(send);
        free(recv);
        return ct_set_error(CT_EOOM, "optimizer step: out of host memory for an exchange");
    }
    if (per[pr->rank] > 0) memcpy(send, mine, per[pr->rank] * sizeof *send);
    ct_status st = w > 0 ? pr->allgather(pr->ctx, send, recv, w) : CT_OK;
    free(send);
    if (st != CT_OK) {
        free(recv);
        return st;
    }
    *out = recv;
    *width = w;
    return CT_OK;
}

/* Per-process counts and cursors of an exchange (nproc each), zeroed. */
static ct_status xchg_counts(const step_env *e, size_t **per, size_t **cur) {
    *per = calloc((size_t)e->pr->nproc, sizeof **per);
    *cur = calloc((size_t)e->pr->nproc, sizeof **cur);
    if (*per == NULL || *cur == NULL) {
        free(*per);
        free(*cur);
        return ct_set_error(CT_EOOM, "optimizer step: out of host memory for an exchange");
    }
    return CT_OK;
}

/* A reduce pass across processes: the sums of every counting task of every process's groups
 * (3 doubles each, group after group, task after task), into the tasks' acc lines of the
 * other processes' groups. */
static ct_status xchg_tasks(step_env *e) {
    const ct_opt_procs *pr = e->pr;
    size_t *per, *cur;
    CT_TRY(xchg_counts(e, &per, &cur));
    for (int gi = 0; gi < e->ngroups; gi++)
        for (int64_t j = 0; j < e->tt[gi].n; j++)
            if (e->groups[gi].blocks[e->tt[gi].t[j].block].counts) per[pr->group_proc[gi]] += 3;
    double *mine = malloc((per[pr->rank] > 0 ? per[pr->rank] : 1) * sizeof *mine), *all = NULL;
    size_t w = 0, m = 0;
    ct_status st = mine != NULL ? CT_OK
                                : ct_set_error(CT_EOOM, "optimizer step: out of host memory");
    for (int gi = 0; st == CT_OK && gi < e->ngroups; gi++) {
        if (grp_remote(e, gi)) continue;
        for (int64_t j = 0; j < e->tt[gi].n; j++)
            if (e->groups[gi].blocks[e->tt[gi].t[j].block].counts)
                for (int q = 0; q < 3; q++) mine[m++] = e->acc[gi][j].v[q];
    }
    if (st == CT_OK) st = xchg(e, mine, per, &all, &w);
    for (int gi = 0; st == CT_OK && gi < e->ngroups; gi++) {
        if (!grp_remote(e, gi)) continue;
        const int p = pr->group_proc[gi];
        for (int64_t j = 0; j < e->tt[gi].n; j++)
            if (e->groups[gi].blocks[e->tt[gi].t[j].block].counts)
                for (int q = 0; q < 3; q++) e->acc[gi][j].v[q] = all[(size_t)p * w + cur[p]++];
    }
    free(all);
    free(mine);
    free(per);
    free(cur);
    return st;
}

static void run_apply(const step_env *e) {
    for (int gi = 0; gi < e->ngroups; gi++) {
        if (grp_remote(e, gi)) continue;
        const task_table *tt = &e->tt[gi];
        const ct_opt_group *grp = &e->groups[gi];
        if (tt->nelem < CT_OPT_PAR_MIN) { /* one thread: no parallel region to open */
            for (int64_t j = 0; j < tt->n; j++) {
                const ct_opt_task *t = &tt->t[j];
                task_apply(&e->c, &grp->blocks[t->block], tt->base + t->block, t->off, t->n);
            }
            continue;
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(ct_par_threads(1))
        for (int64_t j = 0; j < tt->n; j++) {
            const ct_opt_task *t = &tt->t[j];
            task_apply(&e->c, &grp->blocks[t->block], tt->base + t->block, t->off, t->n);
        }
    }
}

/* One read-only pass: per-leaf sums of the u entering stage k (only blocks
 * that count; the tasks' sums added in group order, then task order, so
 * deterministic). Across processes, the other processes' tasks' sums come from
 * an exchange and are added at their groups' places. */
static ct_status reduce_pass(step_env *e, int k, int p_only) {
    memset(e->leaf_acc, 0, (size_t)(e->nleaves > 0 ? e->nleaves : 1) * 3 * sizeof(double));
    for (int gi = 0; gi < e->ngroups; gi++) {
        if (grp_remote(e, gi)) continue;
        const task_table *tt = &e->tt[gi];
        const ct_opt_group *grp = &e->groups[gi];
        acc_line *acc = e->acc[gi];
#pragma omp parallel for schedule(dynamic, 1) num_threads(ct_par_threads(tt->nelem >= CT_OPT_PAR_MIN))
        for (int64_t j = 0; j < tt->n; j++) {
            const ct_opt_task *t = &tt->t[j];
            if (!grp->blocks[t->block].counts) continue; /* a replica: its sums are not used */
            task_reduce(&e->c, &grp->blocks[t->block], tt->base + t->block, t->off, t->n, k,
                        p_only, acc[j].v);
        }
    }
    if (e->pr != NULL) CT_TRY(xchg_tasks(e));
    for (int gi = 0; gi < e->ngroups; gi++) {
        const task_table *tt = &e->tt[gi];
        const ct_opt_group *grp = &e->groups[gi];
        const acc_line *acc = e->acc[gi];
        for (int64_t j = 0; j < tt->n; j++) {
            const ct_opt_block *b = &grp->blocks[tt->t[j].block];
            if (!b->counts) continue;
            for (int q = 0; q < 3; q++) e->leaf_acc[3 * b->leaf + q] += acc[j].v[q];
        }
    }
    return CT_OK;
}

/* Whether stage k is active on leaf l (every block of a leaf has the leaf's mask). */
static int leaf_on(const step_env *e, int l, int k) {
    const int j = e->leaf_head[l];
    return j >= 0 && ((e->blk[j]->active >> k) & 1u);
}

static int same_start(const ct_opt_geom *a, const ct_opt_geom *b, int skip1, int skip2) {
    for (int d = 0; d < a->ndim; d++)
        if (d != skip1 && d != skip2 && a->start[d] != b->start[d]) return 0;
    return 1;
}

/* FACTORED stage k: statistics pass, cross-block sums, new v_row / v_col
 * (written to the state), factors for the fused pass. Fails only on a failed
 * exchange across processes, before writing the state. */
static ct_status factored_combine(step_env *e, int k);

/* Across processes: whether block i of FACTORED stage k gives its row sums t to the
 * row_col_mean of its peers (factored_combine's step C). */
static inline int gives_t(const step_env *e, const fblock *fb, int64_t i) {
    const ct_opt_block *b = e->blk[i];
    return fb[i].on && b->counts && b->geom.start[b->geom.d0] == 0;
}

/* Across processes: the runs of doubles block i of FACTORED stage k adds to an exchange, into
 * p[] / n[] (their number; 0 when it adds none). kind 0: its statistics (nolo sums, then nohi
 * sums) when it counts; kind 1: its row sums t when it gives them (gives_t). */
static int xchg_runs(const step_env *e, int k, int kind, int64_t i, double **p, size_t *n) {
    fblock *x = &e->fb[k][i];
    if (kind == 0) {
        if (!x->stat) return 0;
        p[0] = x->part;
        n[0] = (size_t)x->f.n_nolo;
        p[1] = x->nohi;
        n[1] = (size_t)x->f.n_nohi;
        return 2;
    }
    if (!gives_t(e, e->fb[k], i)) return 0;
    p[0] = x->t;
    n[0] = (size_t)(x->f.P * x->f.M * x->f.Q);
    return 1;
}

/* Across processes: the runs (xchg_runs, `kind`) of stage k's blocks of every process, in
 * global block order, into the other processes' blocks: the statistics (kind 0, before
 * factored_combine's sums) or the row sums t (kind 1, its step C). */
static ct_status xchg_blocks(step_env *e, int k, int kind) {
    const fblock *fb = e->fb[k];
    size_t *per, *cur;
    CT_TRY(xchg_counts(e, &per, &cur));
    const int me = e->pr->rank;
    double *p[2];
    size_t n[2];
    for (int64_t i = 0; i < e->nb; i++) {
        const int r = xchg_runs(e, k, kind, i, p, n);
        for (int q = 0; q < r; q++) per[e->blk_proc[i]] += n[q];
    }
    double *mine = malloc((per[me] > 0 ? per[me] : 1) * sizeof *mine), *all = NULL;
    size_t w = 0, m = 0;
    ct_status st = mine != NULL ? CT_OK
                                : ct_set_error(CT_EOOM, "optimizer step: out of host memory");
    for (int64_t i = 0; st == CT_OK && i < e->nb; i++) {
        if (fb[i].remote) continue;
        const int r = xchg_runs(e, k, kind, i, p, n);
        for (int q = 0; q < r; q++) {
            memcpy(mine + m, p[q], n[q] * sizeof *mine);
            m += n[q];
        }
    }
    if (st == CT_OK) st = xchg(e, mine, per, &all, &w);
    for (int64_t i = 0; st == CT_OK && i < e->nb; i++) {
        if (!fb[i].remote) continue;
        const int pi = e->blk_proc[i], r = xchg_runs(e, k, kind, i, p, n);
        for (int q = 0; q < r; q++) {
            memcpy(p[q], all + (size_t)pi * w + cur[pi], n[q] * sizeof *p[q]);
            cur[pi] += n[q];
        }
    }
    free(all);
    free(mine);
    free(per);
    free(cur);
    return st;
}

/* Across processes: store stage k's new v_row / v_col (kept in vn) into the state. */
static void factored_commit(step_env *e, int k) {
    const fblock *fb = e->fb[k];
    const int o = e->c.slot_off[k];
    for (int64_t i = 0; i < e->nb; i++) {
        const fblock *x = &fb[i];
        if (!x->on || x->remote) continue;
        const ct_opt_block *b = e->blk[i];
        const fgeom *f = &x->f;
        const float *lo = x->vn, *hi = x->vn + f->n_nolo;
        cvt_store(b->slot_dt[o], f->d0_is_lo ? lo : hi, f->d0_is_lo ? f->n_nolo : f->n_nohi,
                  b->slot[o], 0);
        cvt_store(b->slot_dt[o + 1], f->d0_is_lo ? hi : lo, f->d0_is_lo ? f->n_nohi : f->n_nolo,
                  b->slot[o + 1], 0);
    }
}

static ct_status factored_pass(step_env *e, int k) {
    fblock *fb = e->fb[k];
    for (int gi = 0; gi < e->ngroups; gi++) { /* the statistics: (block, segment) tasks */
        if (grp_remote(e, gi)) continue;
        const ct_opt_group *grp = &e->groups[gi];
        const int64_t base = e->tt[gi].base;
        int64_t ntask = 0, nelem = 0;
        for (int i = 0; i < grp->nblocks; i++)
            if (fb[base + i].stat) {
                ntask += fb[base + i].nseg;
                nelem += grp->blocks[i].n;
            }
#pragma omp parallel for schedule(dynamic, 1) num_threads(ct_par_threads(nelem >= CT_OPT_PAR_MIN))
        for (int64_t j = 0; j < ntask; j++) {
            int64_t r = j;
            int i = 0;
            for (;; i++) { /* few blocks per group: a walk is fine */
                if (!fb[base + i].stat) continue;
                if (r < fb[base + i].nseg) break;
                r -= fb[base + i].nseg;
            }
            const fblock *x = &fb[base + i];
            const int64_t l0 = x->f.nlines * r / x->nseg, l1 = x->f.nlines * (r + 1) / x->nseg;
            task_stats(&e->c, &grp->blocks[i], base + i, l0, l1, k, x->part + r * x->f.n_nolo,
                       x->nohi);
        }
    }
    for (int64_t i = 0; i < e->nb; i++) { /* partials of the segments, in order */
        fblock *x = &fb[i];
        if (!x->stat) continue;
        for (int r = 1; r < x->nseg; r++)
            for (int64_t q = 0; q < x->f.n_nolo; q++) x->part[q] += x->part[r * x->f.n_nolo + q];
    }
    if (e->pr != NULL) CT_TRY(xchg_blocks(e, k, 0));
    return factored_combine(e, k);
}

/* FACTORED stage k from its statistics (fb[k][i].part[0, n_nolo) and .nohi of the blocks
 * that count): new v_row / v_col (written to the state; across processes kept in vn until
 * factored_commit), factors for the fused pass. Another process's blocks (remote) lend
 * their statistics and row sums and are otherwise skipped. */
static ct_status factored_combine(step_env *e, int k) {
    fblock *fb = e->fb[k];
    ffac *fac = e->c.fac[k];
    const ct_opt_stage *s = &e->c.st[k];
    const int o = e->c.slot_off[k];
    const float drt = (float)s->s[0], cdrt = 1.0f - drt;
    /* A: sums over the blocks that share a statistic (replica 0 of each, so
     * every global element once), means, new v_row / v_col. */
    for (int64_t i = 0; i < e->nb; i++) {
        fblock *x = &fb[i];
        if (!x->on || x->remote) continue;
        const ct_opt_block *b = e->blk[i];
        const ct_opt_geom *g = &b->geom;
        int np_lo = 0;
        const double *plo[CT_OPT_MAX_PEERS], *phi[CT_OPT_MAX_PEERS];
        int np_hi = 0;
        for (int j = e->leaf_head[b->leaf]; j >= 0; j = e->leaf_next[j]) {
            const ct_opt_block *bj = e->blk[j];
            if (!fb[j].stat) continue;
            if (same_start(g, &bj->geom, x->f.lo, -1) && np_lo < CT_OPT_MAX_PEERS) plo[np_lo++] = fb[j].part;
            if (same_start(g, &bj->geom, x->f.hi, -1) && np_hi < CT_OPT_MAX_PEERS) phi[np_hi++] = fb[j].nohi;
        }
        const double nlo = (double)g->shape[x->f.lo], nhi = (double)g->shape[x->f.hi];
        void *vr = b->slot[o], *vc = b->slot[o + 1];
        const int dr = b->slot_dt[o], dc = b->slot_dt[o + 1];
        float *rowbuf = x->f.d0_is_lo ? fac[i].nolo : fac[i].nohi;
        float *colbuf = x->f.d0_is_lo ? fac[i].nohi : fac[i].nolo;
        for (int64_t q = 0; q < x->f.n_nolo; q++) {
            double sum = 0.0;
            for (int pi = 0; pi < np_lo; pi++) sum += plo[pi][q];
            fac[i].nolo[q] = (float)(sum / nlo); /* the mean, for now */
        }
        for (int64_t q = 0; q < x->f.n_nohi; q++) {
            double sum = 0.0;
            for (int pi = 0; pi < np_hi; pi++) sum += phi[pi][q];
            fac[i].nohi[q] = (float)(sum / nhi);
        }
        const int64_t nrow = x->f.d0_is_lo ? x->f.n_nolo : x->f.n_nohi;
        const int64_t ncol = x->f.d0_is_lo ? x->f.n_nohi : x->f.n_nolo;
        for (int64_t q = 0; q < nrow; q++)
            rowbuf[q] = drt * ct_cv_load_f(dr, vr, q) + cdrt * rowbuf[q];
        for (int64_t q = 0; q < ncol; q++)
            colbuf[q] = drt * ct_cv_load_f(dc, vc, q) + cdrt * colbuf[q];
        /* stored in the slots' dtypes; the factors below use the float32 values */
        if (e->pr == NULL) {
            cvt_store(dr, rowbuf, nrow, vr, 0);
            cvt_store(dc, colbuf, ncol, vc, 0);
        }
    }
    /* B: each block's new v_row summed over its part of d1. */
    for (int64_t i = 0; i < e->nb; i++) {
        fblock *x = &fb[i];
        if (!x->on || x->remote) continue;
        const fgeom *f = &x->f;
        const float *rowbuf = f->d0_is_lo ? fac[i].nolo : fac[i].nohi;
        const int64_t S1 = f->d0_is_lo ? f->Shi : f->Slo;
        memset(x->t, 0, (size_t)(f->P * f->M * f->Q) * sizeof *x->t);
        for (int64_t p = 0; p < f->P; p++)
            for (int64_t a = 0; a < S1; a++)
                for (int64_t m = 0; m < f->M; m++)
                    for (int64_t q = 0; q < f->Q; q++) {
                        int64_t ei = f->d0_is_lo ? ((p * f->M + m) * f->Shi + a) * f->Q + q
                                                 : ((p * f->Slo + a) * f->M + m) * f->Q + q;
                        x->t[(p * f->M + m) * f->Q + q] += (double)rowbuf[ei];
                    }
    }
    if (e->pr != NULL) {
        CT_TRY(xchg_blocks(e, k, 1));
        for (int64_t i = 0; i < e->nb; i++) { /* the new v_row / v_col, for factored_commit */
            fblock *x = &fb[i];
            if (!x->on || x->remote) continue;
            memcpy(x->vn, fac[i].nolo, (size_t)x->f.n_nolo * sizeof *x->vn);
            memcpy(x->vn + x->f.n_nolo, fac[i].nohi, (size_t)x->f.n_nohi * sizeof *x->vn);
        }
    }
    /* C: row_col_mean over the blocks along d1 (one per distinct v_row box),
     * row factor (v_row / row_col_mean)^-1/2, column factor v_col^-1/2. */
    for (int64_t i = 0; i < e->nb; i++) {
        fblock *x = &fb[i];
        if (!x->on || x->remote) continue;
        const ct_opt_block *b = e->blk[i];
        const ct_opt_geom *g = &b->geom;
        const fgeom *f = &x->f;
        const int64_t nt = f->P * f->M * f->Q;
        for (int64_t q = 0; q < nt; q++) x->rcm[q] = 0.0f;
        const double *pt[CT_OPT_MAX_PEERS];
        int npt = 0;
        for (int j = e->leaf_head[b->leaf]; j >= 0; j = e->leaf_next[j]) {
            const ct_opt_block *bj = e->blk[j];
            if (!fb[j].on || !bj->counts || bj->geom.start[g->d0] != 0) continue;
            if (same_start(g, &bj->geom, g->d0, g->d1) && npt < CT_OPT_MAX_PEERS) pt[npt++] = fb[j].t;
        }
        const double n1 = (double)g->shape[g->d1];
        for (int64_t q = 0; q < nt; q++) {
            double sum = 0.0;
            for (int pi = 0; pi < npt; pi++) sum += pt[pi][q];
            x->rcm[q] = (float)(sum / n1);
        }
        float *rowbuf = f->d0_is_lo ? fac[i].nolo : fac[i].nohi;
        float *colbuf = f->d0_is_lo ? fac[i].nohi : fac[i].nolo;
        const int64_t S1 = f->d0_is_lo ? f->Shi : f->Slo;
        for (int64_t p = 0; p < f->P; p++)
            for (int64_t a = 0; a < S1; a++)
                for (int64_t m = 0; m < f->M; m++)
                    for (int64_t q = 0; q < f->Q; q++) {
                        int64_t ei = f->d0_is_lo ? ((p * f->M + m) * f->Shi + a) * f->Q + q
                                                 : ((p * f->Slo + a) * f->M + m) * f->Q + q;
                        rowbuf[ei] = 1.0f / sqrtf(rowbuf[ei] / x->rcm[(p * f->M + m) * f->Q + q]);
                    }
        const int64_t ncol = f->d0_is_lo ? f->n_nohi : f->n_nolo;
        for (int64_t q = 0; q < ncol; q++) colbuf[q] = 1.0f / sqrtf(colbuf[q]);
    }
    return CT_OK;
}

ct_status ct_optim_check(const ct_opt_stage *stages, int nstages) {
    if (nstages < 0 || nstages > CT_OPT_MAX_STAGES)
        return ct_set_error(CT_EINVAL, "optimizer: %d stages; at most %d are supported", nstages,
                            CT_OPT_MAX_STAGES);
    int slots = 0;
    for (int k = 0; k < nstages; k++) {
        int kind = stages[k].kind;
        if (kind < 0 || kind >= CT_OPT_NUM_KINDS)
            return ct_set_error(CT_EINVAL, "optimizer: stage %d has unknown kind %d", k, kind);
        slots += kind_nslots[kind];
        if (kind == CT_OPT_FINITE_GATE) {
            double cov = stages[k].s[0];
            if (!(cov >= 0 && k + 1 + cov <= nstages))
                return ct_set_error(CT_EINVAL, "optimizer: gate %d covers %g stages of %d", k, cov,
                                    nstages - k - 1);
        }
    }
    if (slots > CT_OPT_MAX_SLOTS)
        return ct_set_error(CT_EINVAL, "optimizer: %d state arrays per leaf; at most %d are supported",
                            slots, CT_OPT_MAX_SLOTS);
    return CT_OK;
}

/* local: the block's own (its state arrays are checked too); else another process's. */
static ct_status check_geom(const ct_opt_block *b, int k, int o, int local) {
    const ct_opt_geom *g = &b->geom;
    if (g->ndim == 0) {
        if (local && b->slot_n[o + 2] != b->n)
            return ct_set_error(CT_EINVAL, "optimizer: stage %d: state v of leaf %d has %lld elements, expected %lld",
                                k, b->leaf, (long long)b->slot_n[o + 2], (long long)b->n);
        return CT_OK;
    }
    if (g->ndim < 2 || g->ndim > CT_OPT_MAX_DIMS || g->d0 < 0 || g->d1 < 0 || g->d0 >= g->ndim ||
        g->d1 >= g->ndim || g->d0 == g->d1)
        return ct_set_error(CT_EINVAL, "optimizer: stage %d: bad factored dims for leaf %d", k, b->leaf);
    int64_t n = 1;
    for (int d = 0; d < g->ndim; d++) {
        if (g->bshape[d] < 1 || g->start[d] < 0 || g->start[d] + g->bshape[d] > g->shape[d])
            return ct_set_error(CT_EINVAL, "optimizer: stage %d: block of leaf %d lies outside it", k, b->leaf);
        n *= g->bshape[d];
    }
    if (n != b->n)
        return ct_set_error(CT_EINVAL, "optimizer: stage %d: block shape of leaf %d has %lld elements, the block %lld",
                            k, b->leaf, (long long)n, (long long)b->n);
    if (local && (b->slot_n[o] != n / g->bshape[g->d0] || b->slot_n[o + 1] != n / g->bshape[g->d1]))
        return ct_set_error(CT_EINVAL, "optimizer: stage %d: v_row/v_col of leaf %d have %lld/%lld elements, expected %lld/%lld",
                            k, b->leaf, (long long)b->slot_n[o], (long long)b->slot_n[o + 1],
                            (long long)(n / g->bshape[g->d0]), (long long)(n / g->bshape[g->d1]));
    return CT_OK;
}

static int float_dtype(int dt) { return dt == CT_F32 || dt == CT_BF16 || dt == CT_F16; }

/* The dtypes of block b's arrays (those it has): float32, bfloat16 or float16. */
static ct_status check_dtypes(const ct_opt_block *b, const char *where) {
    const char *bad = NULL;
    int dt = CT_F32;
    if (b->p != NULL && !float_dtype(dt = b->p_dt)) bad = "params";
    else if (b->g != NULL && !float_dtype(dt = b->g_dt)) bad = "grads";
    else if (b->out != NULL && !float_dtype(dt = b->out_dt)) bad = "updates";
    for (int q = 0; bad == NULL && q < CT_OPT_MAX_SLOTS; q++)
        if (b->slot[q] != NULL && !float_dtype(dt = b->slot_dt[q])) bad = "a state array";
    if (bad == NULL) return CT_OK;
    return ct_set_error(CT_ETYPE, "optimizer%s: %s of leaf %d %s %s; the fused optimizers take "
                        "float32, bfloat16 or float16", where, bad, b->leaf,
                        bad[0] == 'a' ? "is" : "are",
                        ct_dtype_name((ct_dtype)dt));
}

static ct_status check_blocks(const ct_opt_ctx *c, const ct_opt_group *groups, int ngroups,
                              int nleaves, const ct_opt_procs *pr) {
    for (int gi = 0; gi < ngroups; gi++) {
        const int remote = pr != NULL && pr->group_proc[gi] != pr->rank;
        for (int i = 0; i < groups[gi].nblocks; i++) {
            const ct_opt_block *b = &groups[gi].blocks[i];
            if (b->n < 0 || b->leaf < 0 || b->leaf >= nleaves)
                return ct_set_error(CT_EINVAL, "optimizer: block %d of group %d is malformed", i, gi);
            if (remote) { /* another process's: no buffers; its factored geometry is used */
                for (int k = 0; k < c->nstages; k++)
                    if (((b->active >> k) & 1u) && c->st[k].kind == CT_OPT_FACTORED && b->n > 0)
                        CT_TRY(check_geom(b, k, c->slot_off[k], 0));
                continue;
            }
            CT_TRY(check_dtypes(b, ""));
            if (b->n == 0) continue;
            if (b->g == NULL || (b->out == NULL && b->p == NULL))
                return ct_set_error(CT_EINVAL, "optimizer: block %d of group %d lacks grads or params", i, gi);
            for (int k = 0; k < c->nstages; k++) {
                if (!((b->active >> k) & 1u)) continue;
                int kind = c->st[k].kind;
                if (kind_needs_params(kind) && b->p == NULL)
                    return ct_set_error(CT_EINVAL, "optimizer: stage %d needs params (leaf %d)", k, b->leaf);
                for (int q = 0; q < kind_nslots[kind]; q++)
                    if (b->slot[c->slot_off[k] + q] == NULL)
                        return ct_set_error(CT_EINVAL, "optimizer: stage %d has no state array for leaf %d", k, b->leaf);
                if (kind == CT_OPT_FACTORED) {
                    CT_TRY(check_geom(b, k, c->slot_off[k], 1));
                } else {
                    for (int q = 0; q < kind_nslots[kind]; q++)
                        if (b->slot_n[c->slot_off[k] + q] != b->n)
                            return ct_set_error(CT_EINVAL, "optimizer: stage %d: state array of leaf %d has %lld elements, expected %lld",
                                                k, b->leaf, (long long)b->slot_n[c->slot_off[k] + q], (long long)b->n);
                }
            }
        }
    }
    return CT_OK;
}

static void env_free(step_env *e) {
    if (e->tt != NULL)
        for (int gi = 0; gi < e->ngroups; gi++) free(e->tt[gi].t);
    if (e->acc != NULL)
        for (int gi = 0; gi < e->ngroups; gi++) free(e->acc[gi]);
    for (int k = 0; k < e->c.nstages; k++) {
        free(e->c.leaf_f[k]);
        if (e->fb[k] != NULL)
            for (int64_t i = 0; i < e->nb; i++) {
                free(e->fb[k][i].part);
                free(e->fb[k][i].nohi);
                free(e->fb[k][i].t);
                free(e->fb[k][i].rcm);
                free(e->fb[k][i].vn);
                if (e->c.fac[k] != NULL) {
                    free(e->c.fac[k][i].nolo);
                    free(e->c.fac[k][i].nohi);
                }
            }
        free(e->fb[k]);
        free(e->c.fac[k]);
    }
    free(e->tt);
    free(e->acc);
    free(e->blk);
    free(e->leaf_next);
    free(e->leaf_head);
    free(e->leaf_acc);
    free(e->leaf_n);
    free(e->blk_proc);
}

#define OOM() ct_set_error(CT_EOOM, "optimizer step: out of host memory")

/* Everything a step needs, allocated before anything is written: a failed
 * step leaves params and state as they were. */
static ct_status env_init(step_env *e) {
    const int ng = e->ngroups, nl = e->nleaves > 0 ? e->nleaves : 1;
    e->tt = calloc((size_t)(ng > 0 ? ng : 1), sizeof *e->tt);
    e->acc = calloc((size_t)(ng > 0 ? ng : 1), sizeof *e->acc);
    e->leaf_acc = calloc((size_t)nl * 3, sizeof *e->leaf_acc);
    e->leaf_n = calloc((size_t)nl, sizeof *e->leaf_n);
    e->leaf_head = malloc((size_t)nl * sizeof *e->leaf_head);
    if (!e->tt || !e->acc || !e->leaf_acc || !e->leaf_n || !e->leaf_head) return OOM();
    e->nb = 0;
    for (int gi = 0; gi < ng; gi++) {
        CT_TRY(make_tasks(&e->groups[gi], e->nb, &e->tt[gi]));
        e->acc[gi] = aligned_alloc(64, (size_t)(e->tt[gi].n > 0 ? e->tt[gi].n : 1) * sizeof(acc_line));
        if (e->acc[gi] == NULL) return OOM();
        e->nb += e->groups[gi].nblocks;
    }
    const int64_t nb = e->nb > 0 ? e->nb : 1;
    e->blk = malloc((size_t)nb * sizeof *e->blk);
    e->leaf_next = malloc((size_t)nb * sizeof *e->leaf_next);
    if (!e->blk || !e->leaf_next) return OOM();
    if (e->pr != NULL && (e->blk_proc = malloc((size_t)nb * sizeof *e->blk_proc)) == NULL)
        return OOM();
    for (int l = 0; l < nl; l++) e->leaf_head[l] = -1;
    for (int gi = ng - 1; gi >= 0; gi--) /* lists in global block order */
        for (int i = e->groups[gi].nblocks - 1; i >= 0; i--) {
            const int64_t id = e->tt[gi].base + i;
            const ct_opt_block *b = &e->groups[gi].blocks[i];
            e->blk[id] = b;
            if (e->blk_proc != NULL) e->blk_proc[id] = e->pr->group_proc[gi];
            e->leaf_next[id] = e->leaf_head[b->leaf];
            e->leaf_head[b->leaf] = (int)id;
            if (b->counts) e->leaf_n[b->leaf] += (double)b->n;
        }
    for (int l = 0; l < e->nleaves; l++) { /* factored_pass keeps a leaf's peers on the stack */
        int cnt = 0;
        for (int j = e->leaf_head[l]; j >= 0; j = e->leaf_next[j]) cnt++;
        if (cnt > CT_OPT_MAX_PEERS)
            return ct_set_error(CT_EINVAL, "optimizer: leaf %d has %d blocks; at most %d are supported",
                                l, cnt, CT_OPT_MAX_PEERS);
    }
    for (int k = 0; k < e->c.nstages; k++) {
        const int kind = e->c.st[k].kind;
        if (kind == CT_OPT_TRUST_RATIO || kind == CT_OPT_BLOCK_RMS || kind == CT_OPT_PARAM_RMS) {
            if ((e->c.leaf_f[k] = malloc((size_t)nl * sizeof(float))) == NULL) return OOM();
        }
        if (kind != CT_OPT_FACTORED) continue;
        e->fb[k] = calloc((size_t)nb, sizeof(fblock));
        e->c.fac[k] = calloc((size_t)nb, sizeof(ffac));
        if (!e->fb[k] || !e->c.fac[k]) return OOM();
        for (int64_t i = 0; i < e->nb; i++) {
            const ct_opt_block *b = e->blk[i];
            fblock *x = &e->fb[k][i];
            if (b->n == 0 || !((b->active >> k) & 1u) || b->geom.ndim == 0) continue;
            x->on = 1;
            x->stat = b->counts != 0;
            x->f = fgeom_of(&b->geom);
            const int64_t nt = x->f.P * x->f.M * x->f.Q;
            if ((x->remote = blk_remote(e, i))) { /* what the exchanges bring */
                x->nseg = 1;
                if (x->stat && ((x->part = malloc((size_t)x->f.n_nolo * sizeof(double))) == NULL ||
                                (x->nohi = malloc((size_t)x->f.n_nohi * sizeof(double))) == NULL))
                    return OOM();
                if (gives_t(e, e->fb[k], i) && (x->t = malloc((size_t)nt * sizeof(double))) == NULL)
                    return OOM();
                continue;
            }
            if (e->pr != NULL &&
                (x->vn = malloc((size_t)(x->f.n_nolo + x->f.n_nohi) * sizeof(float))) == NULL)
                return OOM();
            int64_t nseg = x->f.nlines < CT_OPT_MAX_SEG ? x->f.nlines : CT_OPT_MAX_SEG;
            int64_t cap = x->f.Slo / 8 > 1 ? x->f.Slo / 8 : 1; /* partials <= n bytes */
            x->nseg = (int)(nseg < cap ? nseg : cap);
            x->part = calloc((size_t)(x->nseg * x->f.n_nolo), sizeof(double));
            x->nohi = calloc((size_t)x->f.n_nohi, sizeof(double));
            x->t = malloc((size_t)nt * sizeof(double));
            x->rcm = malloc((size_t)nt * sizeof(float));
            e->c.fac[k][i].nolo = malloc((size_t)x->f.n_nolo * sizeof(float));
            e->c.fac[k][i].nohi = malloc((size_t)x->f.n_nohi * sizeof(float));
            if (!x->part || !x->nohi || !x->t || !x->rcm || !e->c.fac[k][i].nolo ||
                !e->c.fac[k][i].nohi)
                return OOM();
        }
    }
    return CT_OK;
}

float ct_opt_leaf_factor(int kind, const double *s, double sum_u2, double sum_p2, double n) {
    switch (kind) {
    case CT_OPT_TRUST_RATIO: { /* coef * ||p|| / (||u|| + eps), 1 where either norm is 0 */
        const float min_norm = (float)s[0], coef = (float)s[1], eps = (float)s[2];
        float un = (float)sqrt(sum_u2), pn = (float)sqrt(sum_p2);
        un = un <= min_norm ? min_norm : un;
        pn = pn <= min_norm ? min_norm : pn;
        return (pn == 0.0f || un == 0.0f) ? 1.0f : coef * pn / (un + eps);
    }
    /* The maxima are jnp.maximum's: a NaN operand gives NaN (a NaN in one element of the
     * leaf makes the whole leaf NaN, as in optax), which `a > b ? a : b` would drop. */
    case CT_OPT_BLOCK_RMS: { /* the divisor max(1, sqrt(mean(u^2)) / threshold) */
        const float thr = (float)s[0];
        float rms = sqrtf((float)(sum_u2 / (n > 0 ? n : 1.0)));
        float q = rms / thr;
        return (q > 1.0f || q != q) ? q : 1.0f;
    }
    case CT_OPT_PARAM_RMS: { /* max(sqrt(mean(p^2)), min_scale) */
        const float mn = (float)s[0];
        float rms = sqrtf((float)(sum_p2 / (n > 0 ? n : 1.0)));
        return (rms > mn || rms != rms) ? rms : mn;
    }
    default: return 1.0f;
    }
}

/* The reduction passes and the fused pass of one step over e's blocks (stages: this
 * step's scalars; e->c is reset for them). Fails only on allocation failure, before
 * writing anything. */
static ct_status run_passes(step_env *e, ct_opt_stage *stages, int nstages, int nleaves) {
    ct_opt_ctx *c = &e->c;
    c->st = stages;
    c->skip = 0;
    c->zero = 0;
    c->acc_p = 0;
    int want_p2 = 0, have_p2 = 0;
    double *p2 = NULL; /* per-leaf sums of a reduce pass that also summed p^2 */
    for (int k = 0; k < nstages; k++) want_p2 |= stages[k].kind == CT_OPT_PARAM_RMS;
    if (want_p2 && (p2 = malloc((size_t)(nleaves > 0 ? nleaves : 1) * 3 * sizeof *p2)) == NULL) {
        return OOM();
    }
    for (int k = 0; k < nstages; k++) {
        const int kind = stages[k].kind;
        if (!kind_is_reduction(kind) || ((c->skip >> k) & 1u)) continue;
        if (kind == CT_OPT_FACTORED) {
            ct_status fs = factored_pass(e, k);
            if (fs != CT_OK) {
                free(p2);
                return fs;
            }
            continue;
        }
        /* p is not changed before the fused pass, so per-leaf sum p^2 (PARAM_RMS)
         * rides along with the first reduce pass that reads p anyway or can:
         * adafactor's block-RMS pass then streams g and p together and the
         * param-RMS pass is not run. */
        const int p_only = kind == CT_OPT_PARAM_RMS;
        if (p_only && have_p2) {
            memcpy(e->leaf_acc, p2, (size_t)(nleaves > 0 ? nleaves : 1) * 3 * sizeof *p2);
        } else {
            c->acc_p = kind == CT_OPT_TRUST_RATIO || p_only || (want_p2 && !have_p2);
            ct_status rs = reduce_pass(e, k, p_only);
            if (rs != CT_OK) {
                free(p2);
                return rs;
            }
            if (c->acc_p && want_p2 && !have_p2) {
                memcpy(p2, e->leaf_acc, (size_t)(nleaves > 0 ? nleaves : 1) * 3 * sizeof *p2);
                have_p2 = 1;
            }
            c->acc_p = 0;
        }
        const double *la = e->leaf_acc;
        if (kind == CT_OPT_TRUST_RATIO || kind == CT_OPT_BLOCK_RMS || kind == CT_OPT_PARAM_RMS) {
            for (int l = 0; l < nleaves; l++)
                c->leaf_f[k][l] = ct_opt_leaf_factor(kind, stages[k].s, la[3 * l], la[3 * l + 1],
                                                     e->leaf_n[l]);
        } else if (kind == CT_OPT_GLOBAL_NORM) {
            double ss = 0.0; /* over the leaves the stage is active on (masked / partition) */
            for (int l = 0; l < nleaves; l++) ss += leaf_on(e, l, k) ? la[3 * l] : 0.0;
            float nrm = (float)sqrt(ss);
            c->norm[k] = nrm;
            c->clip[k] = !(nrm < (float)stages[k].s[0]);
            stages[k].result = nrm;
        } else { /* FINITE_GATE */
            double bad = 0.0;
            for (int l = 0; l < nleaves; l++) bad += leaf_on(e, l, k) ? la[3 * l + 2] : 0.0;
            int finite = bad == 0.0;
            stages[k].result = finite;
            if (!finite && stages[k].s[1] == 0.0) { /* reject: zero updates, inner untouched */
                c->zero |= 1u << k;
                int cov = (int)stages[k].s[0];
                for (int q = k + 1; q <= k + cov; q++) c->skip |= 1u << q;
            }
        }
    }
    if (e->pr != NULL) /* every exchange done: the new factored statistics */
        for (int k = 0; k < nstages; k++)
            if (stages[k].kind == CT_OPT_FACTORED && !((c->skip >> k) & 1u)) factored_commit(e, k);
    run_apply(e);
    free(p2);
    return CT_OK;
}

/* Check a step's stages and blocks and make its driver tables (e, on CPU devices); *gpu:
 * 1 when every group is on GPU devices (e is then not made). */
static ct_status step_setup(step_env *e, ct_opt_stage *stages, int nstages,
                            const ct_opt_group *groups, int ngroups, int nleaves, int *gpu,
                            const ct_opt_procs *pr) {
    CT_TRY(ct_optim_check(stages, nstages));
    if (nleaves < 0) return ct_set_error(CT_EINVAL, "optimizer: negative leaf count");
    if (ngroups < 0) return ct_set_error(CT_EINVAL, "optimizer: negative group count");
    if (pr != NULL) {
        if (pr->nproc < 1 || pr->rank < 0 || pr->rank >= pr->nproc || pr->allgather == NULL ||
            (ngroups > 0 && pr->group_proc == NULL))
            return ct_set_error(CT_EINVAL, "optimizer: bad processes (%d of %d)", pr->rank, pr->nproc);
        for (int gi = 0; gi < ngroups; gi++) {
            if (pr->group_proc[gi] < 0 || pr->group_proc[gi] >= pr->nproc)
                return ct_set_error(CT_EINVAL, "optimizer: group %d belongs to process %d of %d",
                                    gi, pr->group_proc[gi], pr->nproc);
        }
    }
    memset(e, 0, sizeof *e);
    ct_opt_ctx *c = &e->c;
    c->st = stages;
    c->nstages = nstages;
    c->no_fused = adamw16_off();
    for (int k = 0, off = 0; k < nstages; k++) {
        c->slot_off[k] = off;
        off += kind_nslots[stages[k].kind];
    }
    CT_TRY(check_blocks(c, groups, ngroups, nleaves, pr));
    int ngpu = 0, nmine = 0; /* this process's groups (another's have no device here) */
    for (int gi = 0; gi < ngroups; gi++) {
        if (pr != NULL && pr->group_proc[gi] != pr->rank) continue;
        nmine++;
        ngpu += groups[gi].dev != NULL && groups[gi].dev->platform != CT_PLATFORM_CPU;
    }
    if (ngpu > 0 && ngpu < nmine)
        return ct_set_error(CT_EINVAL, "optimizer: a step mixes CPU and GPU devices (%d of %d "
                            "device groups on GPUs); keep a train state on one platform", ngpu, nmine);
    *gpu = ngpu > 0;
    if (*gpu) return CT_OK;
    e->groups = groups;
    e->ngroups = ngroups;
    e->nleaves = nleaves;
    e->pr = pr;
    ct_status st = env_init(e);
    if (st != CT_OK) env_free(e);
    return st;
}

ct_status ct_optim_step(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                        int ngroups, int nleaves) {
    return ct_optim_step_procs(stages, nstages, groups, ngroups, nleaves, NULL);
}

ct_status ct_optim_step_procs(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                              int ngroups, int nleaves, const ct_opt_procs *procs) {
    step_env e;
    int gpu = 0;
    CT_TRY(step_setup(&e, stages, nstages, groups, ngroups, nleaves, &gpu, procs));
    if (gpu) return ct_optim_step_device(stages, nstages, groups, ngroups, procs);
    ct_status st = run_passes(&e, stages, nstages, nleaves);
    env_free(&e);
    return st;
}

struct ct_optim_prepared {
    step_env e;        /* CPU groups without a FACTORED stage: kept from step to step */
    int keep;          /* e is kept */
    const ct_opt_group *groups;
    int ngroups, nleaves, nstages;
    int kind[CT_OPT_MAX_STAGES];
};

ct_status ct_optim_prepare(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                           int ngroups, int nleaves, ct_optim_prepared **out) {
    *out = NULL;
    ct_optim_prepared *p = calloc(1, sizeof *p);
    if (p == NULL) return OOM();
    int gpu = 0;
    ct_status st = step_setup(&p->e, stages, nstages, groups, ngroups, nleaves, &gpu, NULL);
    if (st != CT_OK) {
        free(p);
        return st;
    }
    p->keep = !gpu;
    for (int k = 0; k < nstages; k++) {
        p->kind[k] = stages[k].kind;
        if (stages[k].kind == CT_OPT_FACTORED) p->keep = 0; /* its scratch is made per step */
    }
    if (!p->keep && !gpu) env_free(&p->e);
    p->groups = groups;
    p->ngroups = ngroups;
    p->nleaves = nleaves;
    p->nstages = nstages;
    *out = p;
    return CT_OK;
}

ct_status ct_optim_run(ct_optim_prepared *p, ct_opt_stage *stages, int nstages) {
    if (nstages != p->nstages)
        return ct_set_error(CT_EINVAL, "optimizer: a prepared step of %d stages run with %d",
                            p->nstages, nstages);
    for (int k = 0; k < nstages; k++)
        if (stages[k].kind != p->kind[k])
            return ct_set_error(CT_EINVAL, "optimizer: stage %d of a prepared step changed kind", k);
    for (int gi = 0; gi < p->ngroups; gi++)
        for (int i = 0; i < p->groups[gi].nblocks; i++)
            if (p->groups[gi].blocks[i].g == NULL && p->groups[gi].blocks[i].n > 0)
                return ct_set_error(CT_EINVAL, "optimizer: block %d of group %d has no grads", i, gi);
    if (!p->keep) return ct_optim_step(stages, nstages, p->groups, p->ngroups, p->nleaves);
    return run_passes(&p->e, stages, nstages, p->nleaves);
}

void ct_optim_prepared_free(ct_optim_prepared *p) {
    if (p == NULL) return;
    if (p->keep) env_free(&p->e);
    free(p);
}

ct_status ct_opt_factored_combine(const ct_opt_stage *stages, int nstages, int k,
                                  const ct_opt_block *blocks, int64_t nb, int nleaves,
                                  double *const *stat, float *const *fac) {
    if (k < 0 || k >= nstages || stages[k].kind != CT_OPT_FACTORED || nb < 0 || nleaves < 0)
        return ct_set_error(CT_EINVAL, "optimizer: bad factored combine (stage %d)", k);
    step_env e;
    memset(&e, 0, sizeof e);
    e.c.st = stages;
    e.c.nstages = nstages;
    for (int q = 0, off = 0; q < nstages; q++) {
        e.c.slot_off[q] = off;
        off += kind_nslots[stages[q].kind];
    }
    e.nb = nb;
    e.nleaves = nleaves;
    const size_t nbs = (size_t)(nb > 0 ? nb : 1), nl = (size_t)(nleaves > 0 ? nleaves : 1);
    e.blk = malloc(nbs * sizeof *e.blk);
    e.leaf_next = malloc(nbs * sizeof *e.leaf_next);
    e.leaf_head = malloc(nl * sizeof *e.leaf_head);
    fblock *fb = calloc(nbs, sizeof *fb);
    ffac *ff = calloc(nbs, sizeof *ff);
    ct_status st = (e.blk && e.leaf_next && e.leaf_head && fb && ff) ? CT_OK : OOM();
    for (int64_t l = 0; st == CT_OK && l < (int64_t)nl; l++) e.leaf_head[l] = -1;
    for (int64_t i = nb - 1; st == CT_OK && i >= 0; i--) { /* lists in global block order */
        const ct_opt_block *b = &blocks[i];
        if (b->leaf < 0 || b->leaf >= nleaves) {
            st = ct_set_error(CT_EINVAL, "optimizer: block %lld has leaf %d of %d", (long long)i,
                              b->leaf, nleaves);
            break;
        }
        e.blk[i] = b;
        e.leaf_next[i] = e.leaf_head[b->leaf];
        e.leaf_head[b->leaf] = (int)i;
    }
    for (int l = 0; st == CT_OK && l < nleaves; l++) {
        int cnt = 0;
        for (int j = e.leaf_head[l]; j >= 0; j = e.leaf_next[j]) cnt++;
        if (cnt > CT_OPT_MAX_PEERS)
            st = ct_set_error(CT_EINVAL, "optimizer: leaf %d has %d blocks; at most %d are supported",
                              l, cnt, CT_OPT_MAX_PEERS);
    }
    for (int64_t i = 0; st == CT_OK && i < nb; i++) {
        const ct_opt_block *b = &blocks[i];
        fblock *x = &fb[i];
        if (b->n == 0 || !((b->active >> k) & 1u) || b->geom.ndim == 0) continue;
        x->on = 1;
        x->stat = b->counts != 0;
        x->f = fgeom_of(&b->geom);
        x->nseg = 1;
        if (x->stat && stat[i] == NULL) {
            st = ct_set_error(CT_EINVAL, "optimizer: factored block %lld has no statistics",
                              (long long)i);
            break;
        }
        x->part = x->stat ? stat[i] : NULL;             /* borrowed */
        x->nohi = x->stat ? stat[i] + x->f.n_nolo : NULL;
        const int64_t nt = x->f.P * x->f.M * x->f.Q;
        x->t = malloc((size_t)nt * sizeof(double));
        x->rcm = malloc((size_t)nt * sizeof(float));
        ff[i].nolo = fac[i];
        ff[i].nohi = fac[i] != NULL ? fac[i] + x->f.n_nolo : NULL;
        if (!x->t || !x->rcm || !fac[i]) st = fac[i] ? OOM() : ct_set_error(CT_EINVAL,
                                                 "optimizer: factored block %lld has no factor buffer",
                                                 (long long)i);
    }
    if (st == CT_OK) {
        e.fb[k] = fb;
        e.c.fac[k] = ff;
        st = factored_combine(&e, k); /* (one process: cannot fail) */
    }
    for (int64_t i = 0; fb != NULL && i < nb; i++) {
        free(fb[i].t);
        free(fb[i].rcm);
    }
    free(fb);
    free(ff);
    free(e.blk);
    free(e.leaf_next);
    free(e.leaf_head);
    return st;
}

// ---------------------------------------------------------------------------------------------
// reference

ct_status ct_optim_reference(const ct_opt_stage *stages, int nstages, ct_opt_block *b) {
    CT_TRY(ct_optim_check(stages, nstages));
    int off[CT_OPT_MAX_STAGES];
    for (int k = 0, o = 0; k < nstages; k++) {
        if (kind_is_reduction(stages[k].kind))
            return ct_set_error(CT_EINVAL, "optimizer reference: stage %d is a reduction", k);
        off[k] = o;
        o += kind_nslots[stages[k].kind];
    }
    if (b->n > 0 && (b->g == NULL || (b->out == NULL && b->p == NULL)))
        return ct_set_error(CT_EINVAL, "optimizer reference: the block lacks grads or params");
    CT_TRY(check_dtypes(b, " reference"));
    for (int k = 0; k < nstages; k++) {
        if (!((b->active >> k) & 1u)) continue;
        if (kind_needs_params(stages[k].kind) && b->p == NULL)
            return ct_set_error(CT_EINVAL, "optimizer reference: stage %d needs params", k);
        for (int q = 0; q < kind_nslots[stages[k].kind]; q++)
            if (b->slot[off[k] + q] == NULL || b->slot_n[off[k] + q] != b->n)
                return ct_set_error(CT_EINVAL, "optimizer reference: stage %d: state array %d "
                                    "missing or not of %lld elements", k, q, (long long)b->n);
    }
    for (int64_t i = 0; i < b->n; i++) {
        float u = ct_cv_load_f(b->g_dt, b->g, i);
        const float pi = b->p != NULL ? ct_cv_load_f(b->p_dt, b->p, i) : 0.0f;
        for (int k = 0; k < nstages; k++) {
            if (!((b->active >> k) & 1u)) continue;
            const double *s = stages[k].s;
            const int ns = kind_nslots[stages[k].kind];
            float sv[3] = {0.0f, 0.0f, 0.0f}; /* the element of each slot, as float32 */
            for (int q = 0; q < ns; q++) sv[q] = ct_cv_load_f(b->slot_dt[off[k] + q], b->slot[off[k] + q], i);
            float *a = ns > 0 ? &sv[0] : NULL;
            float *v = ns > 1 ? &sv[1] : NULL;
            float *x3 = ns > 2 ? &sv[2] : NULL;
            float g = u;
            switch (stages[k].kind) {
            case CT_OPT_SCALE: u = (float)s[0] * u; break;
            case CT_OPT_ZERO: u = 0.0f; break;
            case CT_OPT_DECAY: u = u + (float)s[0] * pi; break;
            case CT_OPT_CLIP: u = fminf(fmaxf(u, -(float)s[0]), (float)s[0]); break;
            case CT_OPT_ADAM: {
                float b1 = (float)s[0], b2 = (float)s[1];
                *a = (1.0f - b1) * g + b1 * *a;
                *v = (1.0f - b2) * (g * g) + b2 * *v;
                float ib1 = 1.0f / (float)s[4], ib2 = 1.0f / (float)s[5], ib1n = 1.0f / (float)s[7];
                const int mode = (int)s[6];
                float mh = (mode & 1) ? b1 * (*a * ib1n) + (1.0f - b1) * (g * ib1) : *a * ib1;
                u = (mode & 2) ? mh : mh / (sqrtf(*v * ib2 + (float)s[3]) + (float)s[2]);
                break;
            }
            case CT_OPT_BELIEF: {
                float b1 = (float)s[0], b2 = (float)s[1];
                *a = (1.0f - b1) * g + b1 * *a;
                float e = g - *a;
                *v = ((1.0f - b2) * (e * e) + b2 * *v) + (float)s[3];
                float ib1 = 1.0f / (float)s[4], ib2 = 1.0f / (float)s[5], ib1n = 1.0f / (float)s[7];
                float mh = ((int)s[6] & 1) ? b1 * (*a * ib1n) + (1.0f - b1) * (g * ib1) : *a * ib1;
                u = mh / (sqrtf(*v * ib2) + (float)s[2]);
                break;
            }
            case CT_OPT_AMSGRAD: {
                float b1 = (float)s[0], b2 = (float)s[1];
                *a = (1.0f - b1) * g + b1 * *a;
                *v = (1.0f - b2) * (g * g) + b2 * *v;
                float ve = *v * (1.0f / (float)s[5]), x = *x3;
                *x3 = (x > ve || x != x) ? x : ve;
                u = (*a * (1.0f / (float)s[4])) / (sqrtf(*x3 + (float)s[3]) + (float)s[2]);
                break;
            }
            case CT_OPT_ADAMAX: {
                float b1 = (float)s[0];
                *a = (1.0f - b1) * g + b1 * *a;
                float x = fabsf(g) + (float)s[2], y = (float)s[1] * *v;
                *v = (x > y || x != x) ? x : y;
                u = (*a * (1.0f / (float)s[4])) / *v;
                break;
            }
            case CT_OPT_ACCUM: {
                float ai = s[2] != 0.0 ? g + *a : *a + (g - *a) / (float)s[0];
                if (s[1] != 0.0) { u = ai; *a = 0.0f; } else { u = 0.0f; *a = ai; }
                break;
            }
            case CT_OPT_STDDEV: {
                float dc = (float)s[0];
                *a = (1.0f - dc) * g + dc * *a;
                *v = (1.0f - dc) * (g * g) + dc * *v;
                float mh = *a / (float)s[3], var = *v / (float)s[3] - mh * mh;
                u = (s[2] != 0.0 ? 1.0f / sqrtf(var + (float)s[1])
                                 : 1.0f / (sqrtf(var) + (float)s[1])) * g;
                break;
            }
            case CT_OPT_YOGI: {
                float b1 = (float)s[0], b2 = (float)s[1];
                *a = (1.0f - b1) * g + b1 * *a;
                float g2 = g * g, d = *v - g2;
                float sg = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : d);
                *v = *v - ((1.0f - b2) * sg) * g2;
                u = (*a * (1.0f / (float)s[4])) / (sqrtf(*v * (1.0f / (float)s[5]) + (float)s[3]) +
                                                   (float)s[2]);
                break;
            }
            case CT_OPT_TRACE:
                *a = g + (float)s[0] * *a;
                u = s[1] != 0.0 ? g + (float)s[0] * *a : *a;
                break;
            case CT_OPT_LION: {
                float x = (1.0f - (float)s[0]) * g + (float)s[0] * *a;
                u = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
                *a = (1.0f - (float)s[1]) * g + (float)s[1] * *a;
                break;
            }
            case CT_OPT_RMS: {
                *a = (1.0f - (float)s[0]) * (g * g) + (float)s[0] * *a;
                float vh = *a / (float)s[3];
                u = (s[2] != 0.0 ? 1.0f / sqrtf(vh + (float)s[1]) : 1.0f / (sqrtf(vh) + (float)s[1])) * g;
                break;
            }
            case CT_OPT_RSS:
                *a = g * g + *a;
                u = (*a > 0.0f ? 1.0f / sqrtf(*a + (float)s[0]) : 0.0f) * g;
                break;
            case CT_OPT_EMA:
                *a = (1.0f - (float)s[0]) * g + (float)s[0] * *a;
                u = *a / (float)s[1];
                break;
            default: break;
            }
            for (int q = 0; q < ns; q++) /* rounded once to the slot's dtype */
                ct_cv_store_f(b->slot_dt[off[k] + q], b->slot[off[k] + q], i, sv[q]);
        }
        if (b->out != NULL) ct_cv_store_f(b->out_dt, b->out, i, u);
        else ct_cv_store_f(b->p_dt, b->p, i, pi + u);
    }
    return CT_OK;
}
