/*
 * test_optim_lowp.c — 16-bit operands (bfloat16 / float16 params, grads, updates and state
 * slots) in the CPU optimizer driver (ct_optim.c), bit for bit.
 *
 * 1. The chunk conversions on every path the CPU has (portable C, AVX2 + F16C, AVX-512,
 *    and adamw16's bfloat16 rounding with AVX512_BF16) against ct_random_math.h's scalar
 *    definitions: every 16-bit pattern widened, a sweep of
 *    float32 patterns (and the rounding edges: ties, float16 overflow and subnormals, NaNs of
 *    both kinds, signalling float16 NaNs) narrowed, vectors mixing NaNs and numbers, odd
 *    lengths and offsets (the vector loops' tails).
 * 2. A step with 16-bit operands against the float32 step on widened copies, rounded once to
 *    each operand's dtype afterwards: random chains of elementwise and reduction stages
 *    (global norm, finite gate, trust ratio, block / param RMS, adafactor's factored moments),
 *    and AdamW chains (the driver's one-pass adamw16 path where the CPU has AVX-512; the
 *    float32 run takes the chunk path), a random dtype per operand, apply and emit modes,
 *    leaves spanning many chunks and tasks, a leaf split over two devices and one
 *    replicated, a few steps each. Params, updates, every state slot and the stage results
 *    must agree exactly.
 * 3. The scalar reference (ct_optim_reference) with 16-bit operands against the driver.
 * 4. Errors: an operand of another dtype is refused (CT_ETYPE) before anything is written.
 *
 *   make -C tests/c test   (runs this on each conversion path: CTRAINSTATE_NO_AVX512 / _AVX2,
 *                           adamw16 without AVX512_BF16: CTRAINSTATE_NO_AVX512BF16, and
 *                           without adamw16: CTRAINSTATE_OPT_NO_FUSED16)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct_convert_math.h"
#include "ct_device.h"
#include "ct_optim.h"
#include "ct_status.h"

#include "check.h"

/* ct_optim_device.c (linked with the driver) allocates adafactor's device factors through
 * these; no step here runs on a device. */
ct_status ct_device_alloc(struct ct_device *dev, size_t nbytes, void **out) {
    (void)dev;
    *out = malloc(nbytes ? nbytes : 1);
    return *out != NULL ? CT_OK : CT_EOOM;
}
void ct_device_free(struct ct_device *dev, void *ptr, size_t nbytes) {
    (void)dev;
    (void)nbytes;
    free(ptr);
}

static uint64_t rng = 0x243F6A8885A308D3ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static double unif(void) { return (double)(next() >> 11) / 9007199254740992.0; }
static float gauss(void) {
    double s = 0;
    for (int i = 0; i < 4; i++) s += unif() - 0.5;
    return (float)(s * 1.7);
}

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static const char *dt_name(int dt) { return ct_dtype_name((ct_dtype)dt); }

// --- 1. conversions ----------------------------------------------------------------------------

static uint16_t scalar_round(int dt, float f) {
    return dt == CT_F16 ? ct_rm_f32_to_f16(f) : ct_rm_f32_to_bf16(f);
}

static float scalar_widen(int dt, uint16_t h) {
    return dt == CT_F16 ? ct_rm_f16_to_f32(h) : ct_rm_bf16_to_f32(h);
}

/* x[0, n) through path `path` against the definitions, both directions; where: a label */
static void check_cvt_arrays(int path, int dt, const uint16_t *h, const float *f, int64_t n,
                             const char *where) {
    float *y = malloc((size_t)(n > 0 ? n : 1) * sizeof *y);
    uint16_t *z = malloc((size_t)(n > 0 ? n : 1) * sizeof *z);
    ct_opt_cvt_load(path, dt, h, n, y);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (f2u(y[i]) != f2u(scalar_widen(dt, h[i])) && bad++ == 0) first = i;
    CHECK(bad == 0, "%s: path %d widening %s: %lld differ, first %04x -> %08x, expected %08x",
          where, path, dt_name(dt), (long long)bad, first >= 0 ? h[first] : 0,
          first >= 0 ? f2u(y[first]) : 0, first >= 0 ? f2u(scalar_widen(dt, h[first])) : 0);
    ct_opt_cvt_store(path, dt, f, n, z);
    bad = 0;
    first = -1;
    for (int64_t i = 0; i < n; i++)
        if (z[i] != scalar_round(dt, f[i]) && bad++ == 0) first = i;
    CHECK(bad == 0, "%s: path %d rounding to %s: %lld differ, first %08x -> %04x, expected %04x",
          where, path, dt_name(dt), (long long)bad, first >= 0 ? f2u(f[first]) : 0,
          first >= 0 ? z[first] : 0, first >= 0 ? scalar_round(dt, f[first]) : 0);
    free(y);
    free(z);
}

static void conversions(void) {
    enum { NH = 65536 };
    const int64_t nf = 1 << 20;
    uint16_t *h = malloc(NH * sizeof *h);
    float *f = malloc((size_t)nf * sizeof *f);
    for (int i = 0; i < NH; i++) h[i] = (uint16_t)i;
    /* float32 patterns: a sweep of all exponents and signs, then the edges */
    for (int64_t i = 0; i < nf; i++) f[i] = u2f((uint32_t)(i * 4099u + (uint32_t)(i >> 7)));
    const uint32_t edges[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, /* zeros, infinities */
        0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u, /* NaNs: quiet, signalling */
        0x7fffffffu, 0x477fe000u, 0x477fefffu, 0x477ff000u, /* max float16 65504, ties to inf */
        0x477fffffu, 0x47800000u, 0x33800000u, 0x33000000u, /* 65520-, 65536, float16 subnormals */
        0x33000001u, 0x387fc000u, 0x38800000u, 0x387fe000u, /* half the smallest, normal edge */
        0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, /* bfloat16 ties: even, odd, above */
        0x7f7fffffu, 0x7f7f8000u, 0x00000001u, 0x80000001u, /* bfloat16 overflow, subnormals */
        0x3f801000u, 0x3f803000u, 0x3f800fffu, 0x3f801001u, /* float16 ties */
    };
    const int nedge = (int)(sizeof edges / sizeof *edges);
    for (int i = 0; i < nedge; i++) f[i] = u2f(edges[i]);
    int top = -1;
    /* path 3: adamw16's bfloat16 rounding through AVX512_BF16 (stores; else as path 2) */
    for (int path = 0; path <= 3; path++) {
        const int ran = ct_opt_cvt_store(path, CT_BF16, f, 0, NULL);
        top = ran > top ? ran : top;
        for (int dti = 0; dti < 2; dti++) {
            const int dt = dti ? CT_F16 : CT_BF16;
            check_cvt_arrays(path, dt, h, f, NH, "all 16-bit patterns");
            /* every float32 pattern of the sweep (and the edges), in 16-bit slices */
            for (int64_t o = 0; o < nf; o += NH) {
                uint16_t *hh = malloc(NH * sizeof *hh);
                for (int i = 0; i < NH; i++) hh[i] = h[(i * 7 + o) % NH];
                check_cvt_arrays(path, dt, hh, f + o, NH, "float32 sweep");
                free(hh);
            }
            /* offsets and lengths: every tail of the 16- and 8-lane loops */
            for (int64_t off = 0; off < 5; off++)
                for (int64_t n = 0; n < 70; n++) check_cvt_arrays(path, dt, h + 31000 + off, f + off, n, "tails");
            /* NaNs in random lanes of vectors of numbers (each vector redone by the scalar
             * loop), and vectors without */
            uint16_t hn[256];
            float fn[256];
            for (int rep = 0; rep < 200; rep++) {
                for (int i = 0; i < 256; i++) {
                    fn[i] = gauss();
                    hn[i] = scalar_round(dt, gauss());
                    if (next() % 23 == 0) {
                        fn[i] = u2f(0x7f800000u | (uint32_t)(next() & 0x7fffff) | 1u) ;
                        if (next() & 1) fn[i] = -fn[i];
                        hn[i] = (uint16_t)(dt == CT_F16 ? 0x7c01u + next() % 0x3fe : 0x7f81u + next() % 0x7e);
                        if (next() & 1) hn[i] |= 0x8000u;
                    }
                }
                check_cvt_arrays(path, dt, hn, fn, 256, "NaN lanes");
            }
        }
    }
#if defined(__x86_64__)
    const int want = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                         ? (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq") &&
                                    __builtin_cpu_supports("avx512bw") && !getenv("CTRAINSTATE_NO_AVX512BF16")
                                ? 3 : 2)
                         : __builtin_cpu_supports("avx2") ? 1 : 0;
    CHECK(top == want, "conversions: the widest path run was %d, the CPU has %d", top, want);
#endif
    printf("test_optim_lowp: conversion paths 0..%d checked; the driver's: %d\n", top,
           ct_opt_cvt_load(-1, CT_F16, h, 0, NULL));
    free(h);
    free(f);
}

// --- 2. steps: 16-bit operands against float32 on widened copies --------------------------------

/* An operand: x in its dtype (the 16-bit run), w its float32 copy (the float32 run). */
typedef struct {
    int dt;
    int64_t n;
    void *x;
    float *w;
} arr;

static const int dtypes[3] = {CT_F32, CT_BF16, CT_F16};

static void arr_make(arr *a, int dt, int64_t n) {
    a->dt = dt;
    a->n = n;
    a->x = calloc((size_t)(n > 0 ? n : 1), ct_dtype_size((ct_dtype)dt));
    a->w = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
}

static void arr_free(arr *a) {
    free(a->x);
    free(a->w);
}

static void arr_set(arr *a, int64_t i, float v) { ct_cv_store_f(a->dt, a->x, i, v); }

/* w = x widened (the float32 run's inputs) */
static void arr_widen(arr *a) {
    for (int64_t i = 0; i < a->n; i++) a->w[i] = ct_cv_load_f(a->dt, a->x, i);
}

/* x must be the float32 run's w rounded to x's dtype */
static void arr_check(const arr *a, const char *what, int trial, int step) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < a->n; i++) {
        uint32_t got, want;
        if (a->dt == CT_F32) {
            got = f2u(((const float *)a->x)[i]);
            want = f2u(a->w[i]);
        } else {
            got = ((const uint16_t *)a->x)[i];
            want = scalar_round(a->dt, a->w[i]);
        }
        if (got != want && bad++ == 0) first = i;
    }
    CHECK(bad == 0, "trial %d step %d: %s (%s, %lld elements): %lld differ, first at %lld: %.9g vs "
          "%.9g rounded", trial, step, what, dt_name(a->dt), (long long)a->n, (long long)bad,
          (long long)first, first >= 0 ? ct_cv_load_f(a->dt, a->x, first) : 0.0,
          first >= 0 ? a->w[first] : 0.0);
}

static const int elementwise[] = {CT_OPT_SCALE, CT_OPT_ADAM, CT_OPT_DECAY, CT_OPT_TRACE,
                                  CT_OPT_LION, CT_OPT_RMS, CT_OPT_RSS, CT_OPT_CLIP, CT_OPT_EMA,
                                  CT_OPT_ZERO, CT_OPT_BELIEF, CT_OPT_YOGI, CT_OPT_STDDEV,
                                  CT_OPT_ACCUM, CT_OPT_ADAMAX, CT_OPT_AMSGRAD};
static const int reductions[] = {CT_OPT_GLOBAL_NORM, CT_OPT_TRUST_RATIO, CT_OPT_FINITE_GATE,
                                 CT_OPT_BLOCK_RMS, CT_OPT_PARAM_RMS, CT_OPT_FACTORED};

/* scalars of stage kind at step t; k: the stage's position + 1, nst: the chain's length */
static void random_scalars(int kind, double *s, int t, int k, int nst) {
    memset(s, 0, CT_OPT_NSCALARS * sizeof *s);
    switch (kind) {
    case CT_OPT_SCALE: s[0] = -(1e-4 + unif() * 1e-1); break;
    case CT_OPT_DECAY: s[0] = unif() * 0.1; break;
    case CT_OPT_CLIP: s[0] = 0.05 + unif(); break;
    case CT_OPT_ADAM: case CT_OPT_BELIEF: case CT_OPT_YOGI: case CT_OPT_ADAMAX:
    case CT_OPT_AMSGRAD: {
        double b1 = 0.8 + 0.19 * unif(), b2 = 0.9 + 0.0999 * unif();
        s[0] = b1; s[1] = b2; s[2] = unif() < 0.5 ? 1e-8 : 1e-3 * unif(); s[3] = unif() < 0.5 ? 0 : 1e-8;
        s[4] = 1 - pow(b1, t); s[5] = 1 - pow(b2, t); s[7] = 1 - pow(b1, t + 1);
        s[6] = kind == CT_OPT_YOGI || kind == CT_OPT_ADAMAX || kind == CT_OPT_AMSGRAD
                   ? 0 : (double)((unif() < 0.3) | (kind == CT_OPT_ADAM && unif() < 0.3 ? 2 : 0));
        break;
    }
    case CT_OPT_TRACE: s[0] = 0.5 + 0.49 * unif(); s[1] = unif() < 0.5; break;
    case CT_OPT_LION: s[0] = 0.8 + 0.19 * unif(); s[1] = 0.9 + 0.099 * unif(); break;
    case CT_OPT_ACCUM: s[0] = (double)(1 + next() % 5); s[1] = unif() < 0.4; s[2] = unif() < 0.3; break;
    case CT_OPT_STDDEV: s[0] = 0.9; s[1] = unif() < 0.5 ? 1e-8 : 1e-3; s[2] = unif() < 0.5; s[3] = 1.0; break;
    case CT_OPT_RMS: {
        double d = 0.8 + 0.19 * unif();
        s[0] = d; s[1] = unif() < 0.5 ? 1e-8 : 1e-3; s[2] = unif() < 0.5;
        s[3] = unif() < 0.5 ? 1.0 : 1 - pow(d, t);
        break;
    }
    case CT_OPT_RSS: s[0] = unif() < 0.5 ? 1e-7 : 0.1 * unif(); break;
    case CT_OPT_EMA: { double d = 0.5 + 0.49 * unif(); s[0] = d; s[1] = unif() < 0.5 ? 1.0 : 1 - pow(d, t); break; }
    case CT_OPT_GLOBAL_NORM: s[0] = 0.5 + 50.0 * unif() * unif(); break; /* clips some steps */
    case CT_OPT_TRUST_RATIO: s[0] = 0.0; s[1] = 0.5 + unif(); s[2] = unif() < 0.5 ? 0.0 : 1e-6; break;
    case CT_OPT_FINITE_GATE: s[0] = (double)(next() % (uint64_t)(nst - k + 1)); s[1] = 0.0; break;
    case CT_OPT_BLOCK_RMS: s[0] = 0.2 + unif(); break;
    case CT_OPT_PARAM_RMS: s[0] = 1e-3; break;
    case CT_OPT_FACTORED: s[0] = 0.5 + 0.49 * unif(); s[1] = 1e-30; break;
    default: break;
    }
}

/* The leaves: 0 a (37, 300) matrix, 1 a vector split over the two devices, 2 a (3, 5, 70)
 * tensor, 3 a short vector replicated on both (counting on device 0). */
enum { NLEAF = 4, NBLK = 5 };
static const int64_t leaf_n[NLEAF] = {37 * 300, 2 * 20011, 3 * 5 * 70, 77};
static const int blk_leaf[NBLK] = {0, 1, 2, 3, 1}; /* blocks 0-3 on device 0, then 4 (and 3') */

typedef struct {
    arr p, g, out, slot[CT_OPT_MAX_SLOTS];
    int64_t n;
    ct_opt_geom geom;
} tblock;

static void make_geom(int leaf, int fact, ct_opt_geom *g) {
    memset(g, 0, sizeof *g);
    if (!fact || leaf == 1 || leaf == 3) return;
    if (leaf == 0) {
        g->ndim = 2; g->d0 = 1; g->d1 = 0;
        g->shape[0] = g->bshape[0] = 37;
        g->shape[1] = g->bshape[1] = 300;
    } else {
        g->ndim = 3; g->d0 = 2; g->d1 = 1;
        g->shape[0] = g->bshape[0] = 3;
        g->shape[1] = g->bshape[1] = 5;
        g->shape[2] = g->bshape[2] = 70;
    }
}

static int rand_dt(void) { return dtypes[next() % 3]; }

/* adamw: the chain is AdamW's (ct_optim.c's adamw16 path on CPUs with AVX-512): an optional
 * clip_by_global_norm or gate, adam (plain), weight decay, the learning rate. */
static void step_trial(int trial, int adamw) {
    ct_opt_stage st[10];
    int nst = 1 + (int)(next() % 7), nslots = 0, off[10], fact = -1;
    const int emit = next() % 3 == 0, nan_grad = next() % 6 == 0;
    int chain[4] = {-1, CT_OPT_ADAM, CT_OPT_DECAY, CT_OPT_SCALE};
    if (adamw) {
        const int lead = (int)(next() % 3);
        chain[0] = lead == 0 ? -1 : (lead == 1 ? CT_OPT_GLOBAL_NORM : CT_OPT_FINITE_GATE);
        nst = chain[0] < 0 ? 3 : 4;
    }
    for (int k = 0; k < nst; k++) {
        int kind = next() % 3 == 0 ? reductions[next() % 6] : elementwise[next() % 16];
        if (adamw) kind = chain[k + (nst == 3)];
        if (kind == CT_OPT_FACTORED && fact >= 0) kind = CT_OPT_GLOBAL_NORM;
        if (nslots + ct_opt_kind_nslots(kind) > CT_OPT_MAX_SLOTS) kind = CT_OPT_SCALE;
        if (kind == CT_OPT_FACTORED) fact = k;
        memset(&st[k], 0, sizeof st[k]);
        st[k].kind = kind;
        off[k] = nslots;
        nslots += ct_opt_kind_nslots(kind);
    }
    /* per leaf: which stages are active (masked chains), dtypes */
    uint32_t active[NLEAF];
    int pdt[NLEAF], gdt[NLEAF], odt[NLEAF], sdt[NLEAF][CT_OPT_MAX_SLOTS];
    for (int l = 0; l < NLEAF; l++) {
        active[l] = (uint32_t)(next() & ((1u << nst) - 1)) | (next() % 3 ? (1u << nst) - 1 : 0u);
        if (adamw && next() % 4 != 0) active[l] = (1u << nst) - 1; /* masks: weight decay off */
        pdt[l] = rand_dt();
        gdt[l] = next() % 2 ? pdt[l] : rand_dt();
        odt[l] = rand_dt();
        for (int q = 0; q < nslots; q++) sdt[l][q] = next() % 2 ? pdt[l] : rand_dt();
    }
    /* a gate covers stages after it: keep its coverage inside the chain */
    for (int k = 0; k < nst; k++) random_scalars(st[k].kind, st[k].s, 1, k + 1, nst);
    for (int k = 0; adamw && k < nst; k++)
        if (st[k].kind == CT_OPT_ADAM && next() % 4 != 0) st[k].s[6] = 0; /* mostly plain adam */
    /* the blocks, each once per run; block 5 is leaf 3's replica on device 1 */
    tblock tb[NBLK + 1];
    const int nb = NBLK + 1;
    for (int i = 0; i < nb; i++) {
        const int l = i < NBLK ? blk_leaf[i] : 3;
        tblock *b = &tb[i];
        memset(b, 0, sizeof *b);
        b->n = l == 1 ? leaf_n[1] / 2 : leaf_n[l];
        make_geom(l, fact >= 0, &b->geom);
        arr_make(&b->p, pdt[l], b->n);
        arr_make(&b->g, gdt[l], b->n);
        arr_make(&b->out, odt[l], emit ? b->n : 0);
        for (int q = 0; q < nslots; q++) {
            int64_t sn = b->n;
            if (fact >= 0 && q >= off[fact] && q < off[fact] + 3) {
                const int r = q - off[fact];
                if (b->geom.ndim == 0) sn = r == 2 ? b->n : 1;
                else if (r == 2) sn = 1;
                else sn = b->n / b->geom.bshape[r == 0 ? b->geom.d0 : b->geom.d1];
            }
            arr_make(&b->slot[q], sdt[l][q], sn);
        }
        for (int64_t e = 0; e < b->n; e++) arr_set(&b->p, e, gauss());
    }
    /* the replica holds the same params as the original */
    memcpy(tb[NBLK].p.x, tb[3].p.x, (size_t)tb[3].n * ct_dtype_size((ct_dtype)tb[3].p.dt));
    for (int t = 1; t <= 3; t++) {
        for (int k = 0; k < nst; k++)
            if (st[k].kind != CT_OPT_FINITE_GATE) {
                const double mode = st[k].s[6];
                random_scalars(st[k].kind, st[k].s, t, k + 1, nst);
                if (adamw && st[k].kind == CT_OPT_ADAM) st[k].s[6] = mode;
            }
        for (int i = 0; i < nb; i++) {
            tblock *b = &tb[i];
            for (int64_t e = 0; e < b->n; e++)
                arr_set(&b->g, e, gauss() * (e % 11 == 0 ? 1e-3f : (e % 13 == 0 ? 30.0f :
                                             (e % 17 == 0 ? 1e-20f : 1.0f)))); /* g^2: subnormal */
            if (i == NBLK) memcpy(b->g.x, tb[3].g.x, (size_t)b->n * ct_dtype_size((ct_dtype)b->g.dt));
        }
        if (nan_grad && t == 2) { /* NaNs for the finite gate: signalling ones, and a float32
                                   * payload in the low 16 bits (bfloat16 rounding must not
                                   * carry into it) */
            arr *g = &tb[1].g;
            if (g->dt == CT_F16) ((uint16_t *)g->x)[100] = 0x7d01u;
            else if (g->dt == CT_BF16) ((uint16_t *)g->x)[100] = 0xffa1u;
            else ((float *)g->x)[100] = u2f(0x7fc0ffffu);
            for (int64_t e = 200; e < 240; e++) arr_set(g, e, NAN);
        }
        for (int i = 0; i < nb; i++) {
            arr_widen(&tb[i].p);
            arr_widen(&tb[i].g);
            for (int q = 0; q < nslots; q++) arr_widen(&tb[i].slot[q]);
        }
        ct_opt_block blk[2][NBLK + 1]; /* [run: 0 16-bit, 1 float32][block] */
        for (int run = 0; run < 2; run++)
            for (int i = 0; i < nb; i++) {
                tblock *b = &tb[i];
                ct_opt_block *x = &blk[run][i];
                memset(x, 0, sizeof *x);
                const int l = i < NBLK ? blk_leaf[i] : 3;
                x->n = b->n;
                x->p = run ? (void *)b->p.w : b->p.x;
                x->g = run ? (void *)b->g.w : b->g.x;
                x->out = emit ? (run ? (void *)b->out.w : b->out.x) : NULL;
                x->p_dt = run ? CT_F32 : (uint8_t)b->p.dt;
                x->g_dt = run ? CT_F32 : (uint8_t)b->g.dt;
                x->out_dt = run ? CT_F32 : (uint8_t)b->out.dt;
                for (int q = 0; q < nslots; q++) {
                    x->slot[q] = run ? (void *)b->slot[q].w : b->slot[q].x;
                    x->slot_dt[q] = run ? CT_F32 : (uint8_t)b->slot[q].dt;
                    x->slot_n[q] = b->slot[q].n;
                }
                x->geom = b->geom;
                x->active = active[l];
                x->leaf = l;
                x->counts = i != NBLK;
            }
        /* device 0: blocks 0-3, device 1: block 4 (leaf 1's second half) and 5 (leaf 3) */
        ct_opt_group grp[2][2];
        ct_opt_stage res[2][10];
        for (int run = 0; run < 2; run++) {
            grp[run][0] = (ct_opt_group){blk[run], 4, NULL};
            grp[run][1] = (ct_opt_group){blk[run] + 4, 2, NULL};
            memcpy(res[run], st, sizeof st);
        }
        ct_status a = ct_optim_step(res[0], nst, grp[0], 2, NLEAF);
        ct_status b = ct_optim_step(res[1], nst, grp[1], 2, NLEAF);
        CHECK(a == CT_OK && b == CT_OK, "trial %d: step failed: %s", trial, ct_last_error());
        for (int k = 0; k < nst; k++)
            CHECK(memcmp(&res[0][k].result, &res[1][k].result, sizeof(double)) == 0 ||
                      (isnan(res[0][k].result) && isnan(res[1][k].result)),
                  "trial %d step %d: stage %d (kind %d) result %.17g vs %.17g", trial, t, k,
                  st[k].kind, res[0][k].result, res[1][k].result);
        for (int i = 0; i < nb; i++) {
            char what[64];
            snprintf(what, sizeof what, "block %d %s", i, emit ? "updates" : "params");
            arr_check(emit ? &tb[i].out : &tb[i].p, what, trial, t);
            for (int q = 0; q < nslots; q++) {
                snprintf(what, sizeof what, "block %d slot %d", i, q);
                arr_check(&tb[i].slot[q], what, trial, t);
            }
        }
        if (failures > 20) break;
    }
    for (int i = 0; i < nb; i++) {
        arr_free(&tb[i].p);
        arr_free(&tb[i].g);
        arr_free(&tb[i].out);
        for (int q = 0; q < nslots; q++) arr_free(&tb[i].slot[q]);
    }
}

// --- 3. the reference ---------------------------------------------------------------------------

static void reference_trial(int trial) {
    enum { N = 3 * 2048 + 77 };
    ct_opt_stage st[6];
    const int nst = 1 + (int)(next() % 5);
    int nslots = 0;
    for (int k = 0; k < nst; k++) {
        int kind = elementwise[next() % 16];
        /* CLIP: the reference's fminf / fmaxf make a NaN (centered RMSProp's, from random
         * state) -max_delta, where the driver keeps it (ct_optim_math.h) */
        if (kind == CT_OPT_CLIP || nslots + ct_opt_kind_nslots(kind) > CT_OPT_MAX_SLOTS)
            kind = CT_OPT_SCALE;
        memset(&st[k], 0, sizeof st[k]);
        st[k].kind = kind;
        random_scalars(kind, st[k].s, 2, k + 1, nst);
        nslots += ct_opt_kind_nslots(kind);
    }
    const int emit = next() % 2;
    arr p, g, out, sl[CT_OPT_MAX_SLOTS];
    arr_make(&p, rand_dt(), N);
    arr_make(&g, rand_dt(), N);
    arr_make(&out, rand_dt(), N);
    for (int q = 0; q < nslots; q++) arr_make(&sl[q], rand_dt(), N);
    for (int64_t e = 0; e < N; e++) {
        arr_set(&p, e, gauss());
        arr_set(&g, e, gauss());
        for (int q = 0; q < nslots; q++) arr_set(&sl[q], e, fabsf(gauss()) * 0.1f);
    }
    /* the reference runs on copies: w holds them (as raw bytes of x's dtype) */
    ct_opt_block b[2];
    void *cp[3 + CT_OPT_MAX_SLOTS];
    arr *all[3 + CT_OPT_MAX_SLOTS] = {&p, &g, &out};
    for (int q = 0; q < nslots; q++) all[3 + q] = &sl[q];
    for (int j = 0; j < 3 + nslots; j++) {
        const size_t bytes = (size_t)N * ct_dtype_size((ct_dtype)all[j]->dt);
        cp[j] = malloc(bytes);
        memcpy(cp[j], all[j]->x, bytes);
    }
    for (int r = 0; r < 2; r++) {
        memset(&b[r], 0, sizeof b[r]);
        b[r].n = N;
        b[r].p = r ? cp[0] : p.x;
        b[r].g = r ? cp[1] : g.x;
        b[r].out = emit ? (r ? cp[2] : out.x) : NULL;
        b[r].p_dt = (uint8_t)p.dt;
        b[r].g_dt = (uint8_t)g.dt;
        b[r].out_dt = (uint8_t)out.dt;
        for (int q = 0; q < nslots; q++) {
            b[r].slot[q] = r ? cp[3 + q] : sl[q].x;
            b[r].slot_dt[q] = (uint8_t)sl[q].dt;
            b[r].slot_n[q] = N;
        }
        b[r].active = (1u << nst) - 1;
        b[r].counts = 1;
    }
    ct_opt_group grp = {&b[0], 1, NULL};
    CHECK(ct_optim_step(st, nst, &grp, 1, 1) == CT_OK, "reference trial %d: step: %s", trial,
          ct_last_error());
    CHECK(ct_optim_reference(st, nst, &b[1]) == CT_OK, "reference trial %d: reference: %s", trial,
          ct_last_error());
    for (int j = 0; j < 3 + nslots; j++) { /* what the step wrote: p or out, and the slots */
        if (j == 1 || j == (emit ? 0 : 2)) continue;
        const size_t bytes = (size_t)N * ct_dtype_size((ct_dtype)all[j]->dt);
        CHECK(memcmp(cp[j], all[j]->x, bytes) == 0, "reference trial %d: array %d (%s) differs",
              trial, j, dt_name(all[j]->dt));

    }
    for (int j = 0; j < 3 + nslots; j++) {
        free(cp[j]);
        arr_free(all[j]);
    }
}

// --- 4. errors -----------------------------------------------------------------------------

static void errors(void) {
    enum { N = 40 };
    float p[N], g[N], m[N], v[N];
    for (int i = 0; i < N; i++) p[i] = g[i] = m[i] = v[i] = 1.0f;
    ct_opt_stage st[2];
    memset(st, 0, sizeof st);
    st[0].kind = CT_OPT_ADAM;
    random_scalars(CT_OPT_ADAM, st[0].s, 1, 1, 2);
    st[1].kind = CT_OPT_SCALE;
    st[1].s[0] = -0.1;
    ct_opt_block b;
    memset(&b, 0, sizeof b);
    b.n = N;
    b.p = p;
    b.g = g;
    b.slot[0] = m;
    b.slot[1] = v;
    b.slot_n[0] = b.slot_n[1] = N;
    b.active = 3;
    b.counts = 1;
    ct_opt_group grp = {&b, 1, NULL};
    const struct { uint8_t *f; const char *what; int dt; } bad[] = {
        {&b.p_dt, "params of leaf 0 are int32", CT_I32},
        {&b.g_dt, "grads of leaf 0 are uint8", CT_U8},
        {&b.slot_dt[1], "a state array of leaf 0 is bool", CT_BOOL},
        {&b.slot_dt[0], "a state array of leaf 0 is invalid", 77},
    };
    for (size_t j = 0; j < sizeof bad / sizeof *bad; j++) {
        *bad[j].f = (uint8_t)bad[j].dt;
        CHECK(ct_optim_step(st, 2, &grp, 1, 1) == CT_ETYPE && strstr(ct_last_error(), bad[j].what),
              "errors: %s accepted or said otherwise: %s", bad[j].what, ct_last_error());
        CHECK(ct_optim_reference(st, 2, &b) == CT_ETYPE, "errors: reference took %s", bad[j].what);
        *bad[j].f = CT_F32;
    }
    for (int i = 0; i < N; i++)
        CHECK(p[i] == 1.0f && m[i] == 1.0f && v[i] == 1.0f, "errors: a refused step wrote");
    b.out_dt = CT_I16; /* no out: its dtype is not looked at */
    CHECK(ct_optim_step(st, 2, &grp, 1, 1) == CT_OK, "errors: the unused out dtype was checked");
}

/* Random trials of each kind (of reference trials, 2 in 5 of that number). The sanitizer
 * build (tests/c/Makefile) runs 50 of each, where a trial takes 7x as long: the same kinds of
 * chains and dtypes, fewer draws; the plain runs, on every conversion path, run 150. */
#ifndef CT_LOWP_TRIALS
#define CT_LOWP_TRIALS 150
#endif

int main(void) {
    conversions();
    for (int trial = 0; trial < CT_LOWP_TRIALS && failures < 20; trial++) step_trial(trial, 0);
    for (int trial = 0; trial < CT_LOWP_TRIALS && failures < 20; trial++) step_trial(1000 + trial, 1);
    for (int trial = 0; trial < CT_LOWP_TRIALS * 2 / 5 && failures < 20; trial++)
        reference_trial(trial);
    errors();
    printf("test_optim_lowp: %d checks, %d failures (16-bit steps bit-exact vs float32 + rounding)\n",
           checks, failures);
    return failures != 0;
}
