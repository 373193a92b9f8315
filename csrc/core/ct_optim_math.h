/*
 * ct_optim_math.h — the per-element math of the elementwise optimizer stages,
 * shared by C and CUDA.
 *
 * One element of the update u runs through a chain of stages (ct_optim.h).
 * Here each stage is a pure function of (u, p, its state a/b, its fp32
 * constants c[]): ct_om_prepare turns a stage's per-step double scalars into
 * fp32 constants once per step (on the host), ct_om_stage applies one stage
 * to one element. The CUDA kernel (csrc/backend/cuda/cuda_optim.cu) calls
 * these in registers; tests/c/test_optim_math.c proves them against
 * ct_optim_reference. The vectorised CPU driver (ct_optim.c) keeps its own
 * chunk loops (same operations, same order) so GCC vectorises them.
 *
 * Numerics: only correctly rounded IEEE fp32 operations (+, *, /, sqrtf), in
 * the reference's order; the CUDA file that includes this is compiled with
 * -fmad=false (no FMA contraction) and IEEE div/sqrt, so GPU and CPU results
 * are bit-identical. The one deliberate difference from the reference: CLIP
 * uses comparisons (NaN passes through, as jnp.clip and the fast CPU driver)
 * instead of fminf/fmaxf (NaN becomes -max_delta).
 */
#ifndef CT_OPTIM_MATH_H
#define CT_OPTIM_MATH_H

#include <math.h>
#include <stdint.h>

#include "ct_optim.h"

#include "ct_hd.h"

#define CT_OM_NC 8 /* fp32 constants per stage */

/* Slots a stage kind owns (same table as ct_opt_kind_nslots, usable on a device). */
CT_HD static inline int ct_om_nslots(int kind) {
    switch (kind) {
    case CT_OPT_ADAM: case CT_OPT_BELIEF: case CT_OPT_YOGI: case CT_OPT_STDDEV:
    case CT_OPT_ADAMAX:
        return 2;
    case CT_OPT_TRACE: case CT_OPT_LION: case CT_OPT_RMS: case CT_OPT_RSS: case CT_OPT_EMA:
    case CT_OPT_ACCUM:
        return 1;
    case CT_OPT_FACTORED: case CT_OPT_AMSGRAD: return 3;
    default: return 0;
    }
}

/* Whether ct_om_stage implements the kind (GLOBAL_NORM and FINITE_GATE only
 * apply a factor the driver computed: see ct_om_set_norm / ct_om_set_gate). */
CT_HD static inline int ct_om_is_elementwise(int kind) {
    return kind == CT_OPT_SCALE || kind == CT_OPT_ADAM || kind == CT_OPT_DECAY ||
           kind == CT_OPT_TRACE || kind == CT_OPT_LION || kind == CT_OPT_RMS ||
           kind == CT_OPT_RSS || kind == CT_OPT_CLIP || kind == CT_OPT_EMA || kind == CT_OPT_ZERO ||
           kind == CT_OPT_BELIEF || kind == CT_OPT_YOGI || kind == CT_OPT_STDDEV ||
           kind == CT_OPT_ACCUM || kind == CT_OPT_ADAMAX ||
           kind == CT_OPT_AMSGRAD;
}

/* Per-leaf stages: their u is scaled by one factor per leaf (ct_opt_leaf_factor), which a
 * GPU pass gets per block (ct_opt_pass.blk_f) and applies with ct_om_leaf_apply. */
CT_HD static inline int ct_om_is_leafwise(int kind) {
    return kind == CT_OPT_TRUST_RATIO || kind == CT_OPT_BLOCK_RMS || kind == CT_OPT_PARAM_RMS;
}

/* As the CPU driver's st_scale (f * u) and st_div (u / f, BLOCK_RMS). */
CT_HD static inline float ct_om_leaf_apply(int kind, float f, float u) {
    return kind == CT_OPT_BLOCK_RMS ? u / f : f * u;
}

/* fp32 constants of one stage for one step, from its double scalars s[]. */
static inline void ct_om_prepare(int kind, const double *s, float *c) {
    for (int j = 0; j < CT_OM_NC; j++) c[j] = 0.0f;
    switch (kind) {
    case CT_OPT_SCALE: case CT_OPT_DECAY: case CT_OPT_CLIP: c[0] = (float)s[0]; break;
    case CT_OPT_ADAM: case CT_OPT_BELIEF: case CT_OPT_YOGI: case CT_OPT_ADAMAX:
    case CT_OPT_AMSGRAD:
        /* b1 b2 eps eps_root 1/bc1 1/bc2 mode 1/bc1_next (yogi: the first six) */
        c[0] = (float)s[0]; c[1] = (float)s[1]; c[2] = (float)s[2]; c[3] = (float)s[3];
        c[4] = 1.0f / (float)s[4]; c[5] = 1.0f / (float)s[5]; c[6] = (float)((int)s[6] & 3);
        c[7] = kind == CT_OPT_YOGI ? 0.0f : 1.0f / (float)s[7];
        break;
    case CT_OPT_TRACE: c[0] = (float)s[0]; c[1] = s[1] != 0.0 ? 1.0f : 0.0f; break;
    case CT_OPT_LION: c[0] = (float)s[0]; c[1] = (float)s[1]; break;
    case CT_OPT_RMS: case CT_OPT_STDDEV:
        c[0] = (float)s[0]; c[1] = (float)s[1]; c[2] = s[2] != 0.0 ? 1.0f : 0.0f; c[3] = (float)s[3];
        break;
    case CT_OPT_RSS: c[0] = (float)s[0]; break;
    case CT_OPT_ACCUM:
        c[0] = (float)s[0]; c[1] = s[1] != 0.0 ? 1.0f : 0.0f; c[2] = s[2] != 0.0 ? 1.0f : 0.0f;
        break;
    case CT_OPT_EMA: c[0] = (float)s[0]; c[1] = (float)s[1]; break;
    case CT_OPT_FACTORED: /* decay_rate_t eps 1-decay_rate_t (unfactored leaves) */
        c[0] = (float)s[0]; c[1] = (float)s[1]; c[2] = 1.0f - c[0];
        break;
    default: break;
    }
}

/* Adafactor's factored blocks (FACTORED), row-major, viewed as (P, Slo, M, Shi, Q): lo/hi
 * are the two factored dims in axis order. A line is one (p, a, m): L = Shi*Q contiguous
 * elements. The statistic summed over lo has n_nolo = P*M*L entries, the one summed over hi
 * n_nohi = P*Slo*M*Q; the factors use the same two layouts. d0lo: optax's d0 (the row
 * factor's dim) is lo. */
typedef struct {
    int64_t L, Q, Slo, Shi, M, n_nolo, n_nohi;
    int d0lo;
    int pad; /* explicit: descriptors holding this are compared with memcmp */
} ct_om_fg;

CT_HD static inline ct_om_fg ct_om_fgeom(const ct_opt_geom *g) {
    ct_om_fg f;
    const int lo = g->d0 < g->d1 ? g->d0 : g->d1, hi = g->d0 < g->d1 ? g->d1 : g->d0;
    int64_t P = 1, M = 1, Q = 1;
    for (int d = 0; d < lo; d++) P *= g->bshape[d];
    for (int d = lo + 1; d < hi; d++) M *= g->bshape[d];
    for (int d = hi + 1; d < g->ndim; d++) Q *= g->bshape[d];
    f.Slo = g->bshape[lo];
    f.Shi = g->bshape[hi];
    f.M = M;
    f.Q = Q;
    f.L = f.Shi * Q;
    f.n_nolo = P * M * f.L;
    f.n_nohi = P * f.Slo * M * Q;
    f.d0lo = g->d0 == lo;
    f.pad = 0;
    return f;
}

/* Element i of a factored block times its row and column factors, in optax's order (as the
 * CPU driver's st_factored). */
CT_HD static inline float ct_om_factored_apply(const ct_om_fg *f, const float *flo,
                                               const float *fhi, int64_t i, float u) {
    const int64_t line = i / f->L, j = i % f->L;
    const int64_t p = line / (f->Slo * f->M), m = line % f->M;
    const float lo = flo[(p * f->M + m) * f->L + j];
    const float hi = f->Q == 1 ? fhi[line] : fhi[line * f->Q + j % f->Q];
    return f->d0lo ? (u * lo) * hi : (u * hi) * lo;
}

/* GLOBAL_NORM after its reduction: u = (u / norm) * max_norm when clipping. */
static inline void ct_om_set_norm(float *c, int clip, float norm, float max_norm) {
    c[0] = clip ? 1.0f : 0.0f;
    c[1] = norm;
    c[2] = max_norm;
}

/* FINITE_GATE after its reduction: zero = 1 sets u = 0 (a rejected step). */
static inline void ct_om_set_gate(float *c, int zero) { c[0] = zero ? 1.0f : 0.0f; }

/* One stage on one element: returns the new u. a, b, d: the stage's state slots
 * (read; written only when w; d only for 3-slot kinds). p: the param (DECAY). */
CT_HD static inline float ct_om_stage(int kind, const float *c, float u, float p, float *a,
                                      float *b, float *d, int w) {
    const float g = u;
    switch (kind) {
    case CT_OPT_SCALE: return c[0] * u;
    case CT_OPT_ZERO: return 0.0f;
    case CT_OPT_DECAY: return u + c[0] * p;
    case CT_OPT_CLIP: {
        float x = u < -c[0] ? -c[0] : u;
        return x > c[0] ? c[0] : x;
    }
    case CT_OPT_ADAM: {
        const float b1 = c[0], b2 = c[1];
        float mi = (1.0f - b1) * g + b1 * *a;
        float vi = (1.0f - b2) * (g * g) + b2 * *b;
        const int mode = (int)c[6];
        float mh = (mode & 1) ? b1 * (mi * c[7]) + (1.0f - b1) * (g * c[4]) : mi * c[4];
        if (w) { *a = mi; *b = vi; }
        return (mode & 2) ? mh : mh / (sqrtf(vi * c[5] + c[3]) + c[2]);
    }
    case CT_OPT_BELIEF: {
        const float b1 = c[0], b2 = c[1];
        float mi = (1.0f - b1) * g + b1 * *a;
        float e = g - mi;
        float vi = ((1.0f - b2) * (e * e) + b2 * *b) + c[3];
        float mh = ((int)c[6] & 1) ? b1 * (mi * c[7]) + (1.0f - b1) * (g * c[4]) : mi * c[4];
        if (w) { *a = mi; *b = vi; }
        return mh / (sqrtf(vi * c[5]) + c[2]);
    }
    case CT_OPT_YOGI: {
        const float b1 = c[0], b2 = c[1];
        float mi = (1.0f - b1) * g + b1 * *a;
        float g2 = g * g, d = *b - g2;
        float sg = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : d); /* sign; keeps 0 and NaN */
        float vi = *b - ((1.0f - b2) * sg) * g2;
        if (w) { *a = mi; *b = vi; }
        return (mi * c[4]) / (sqrtf(vi * c[5] + c[3]) + c[2]);
    }
    case CT_OPT_TRACE: {
        float ti = g + c[0] * *a;
        if (w) *a = ti;
        return c[1] != 0.0f ? g + c[0] * ti : ti;
    }
    case CT_OPT_LION: {
        float x = (1.0f - c[0]) * g + c[0] * *a;
        if (w) *a = (1.0f - c[1]) * g + c[1] * *a;
        return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); /* sign; keeps 0 and NaN */
    }
    case CT_OPT_RMS: {
        float vi = (1.0f - c[0]) * (g * g) + c[0] * *a;
        float vh = vi / c[3];
        if (w) *a = vi;
        return (c[2] != 0.0f ? 1.0f / sqrtf(vh + c[1]) : 1.0f / (sqrtf(vh) + c[1])) * g;
    }
    case CT_OPT_AMSGRAD: {
        const float b1 = c[0], b2 = c[1];
        float mi = (1.0f - b1) * g + b1 * *a;
        float vi = (1.0f - b2) * (g * g) + b2 * *b;
        float ve = vi * c[5], x = *d;
        float mx = (x > ve || x != x) ? x : ve; /* jnp.maximum: NaN kept */
        if (w) { *a = mi; *b = vi; *d = mx; }
        return (mi * c[4]) / (sqrtf(mx + c[3]) + c[2]);
    }
    case CT_OPT_ADAMAX: {
        float mi = (1.0f - c[0]) * g + c[0] * *a;
        float x = fabsf(g) + c[2], y = c[1] * *b;
        float vi = (x > y || x != x) ? x : y; /* jnp.maximum: NaN kept */
        if (w) { *a = mi; *b = vi; }
        return (mi * c[4]) / vi;
    }
    case CT_OPT_ACCUM: {
        float ai = c[2] != 0.0f ? g + *a : *a + (g - *a) / c[0];
        if (w) *a = c[1] != 0.0f ? 0.0f : ai;
        return c[1] != 0.0f ? ai : 0.0f;
    }
    case CT_OPT_STDDEV: {
        float mi = (1.0f - c[0]) * g + c[0] * *a;
        float vi = (1.0f - c[0]) * (g * g) + c[0] * *b;
        float mh = mi / c[3], var = vi / c[3] - mh * mh;
        if (w) { *a = mi; *b = vi; }
        return (c[2] != 0.0f ? 1.0f / sqrtf(var + c[1]) : 1.0f / (sqrtf(var) + c[1])) * g;
    }
    case CT_OPT_RSS: {
        float ai = g * g + *a;
        if (w) *a = ai;
        return (ai > 0.0f ? 1.0f / sqrtf(ai + c[0]) : 0.0f) * g;
    }
    case CT_OPT_EMA: {
        float ei = (1.0f - c[0]) * g + c[0] * *a;
        if (w) *a = ei;
        return ei / c[1];
    }
    case CT_OPT_FACTORED: { /* a leaf that is not factored (as the CPU's st_unfactored) */
        float vi = c[0] * *d + c[2] * (g * g + c[1]);
        if (w) *d = vi;
        return g * (1.0f / sqrtf(vi));
    }
    case CT_OPT_GLOBAL_NORM: return c[0] != 0.0f ? (u / c[1]) * c[2] : u;
    case CT_OPT_FINITE_GATE: return c[0] != 0.0f ? 0.0f : u;
    default: return u;
    }
}

#endif /* CT_OPTIM_MATH_H */
