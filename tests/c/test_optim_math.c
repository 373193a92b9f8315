/*
 * test_optim_math.c — the per-element stage functions of ct_optim_math.h
 * (what the CUDA kernel runs) against the scalar reference ct_optim_reference.
 *
 * Random chains of elementwise stages with random per-step scalars, run for a
 * few steps on random data, once through ct_optim_reference and once element
 * by element through ct_om_prepare / ct_om_stage. The header does the same
 * IEEE fp32 operations in the same order as the reference, so params and every
 * state slot must agree BIT FOR BIT (no ulp tolerance). Inputs are finite: the
 * one documented difference (CLIP of a NaN) is not exercised here.
 *
 * Second part: the GPU step sequencing (ct_optim_device.c: reduction passes,
 * cross-device sums with replicas counted once, gate skipping, errors) through
 * a host stand-in for the CUDA backend's optim_pass, against the CPU driver
 * (within 1e-6 relative: the norm's double sum is added in another order).
 *
 *   make -C tests/c test
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct_convert_math.h"
#include "ct_device.h"
#include "ct_optim.h"
#include "ct_optim_math.h"
#include "ct_status.h"

#include "check.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static double unif(void) { return (double)(next() >> 11) / 9007199254740992.0; }
static float gauss(void) { /* sum of uniforms: cheap, roughly normal, finite */
    double s = 0;
    for (int i = 0; i < 4; i++) s += unif() - 0.5;
    return (float)(s * 1.7);
}

static const int kinds[] = {CT_OPT_SCALE, CT_OPT_ADAM, CT_OPT_DECAY, CT_OPT_TRACE, CT_OPT_LION,
                            CT_OPT_RMS,   CT_OPT_RSS,  CT_OPT_CLIP,  CT_OPT_EMA, CT_OPT_ZERO,
                            CT_OPT_BELIEF, CT_OPT_YOGI, CT_OPT_STDDEV, CT_OPT_ACCUM,
                            CT_OPT_ADAMAX, CT_OPT_AMSGRAD};

static void random_scalars(int kind, double *s, int t) {
    memset(s, 0, CT_OPT_NSCALARS * sizeof *s);
    switch (kind) {
    case CT_OPT_SCALE: s[0] = -(1e-4 + unif() * 1e-2); break;
    case CT_OPT_DECAY: s[0] = unif() * 0.1; break;
    case CT_OPT_CLIP: s[0] = 0.05 + unif(); break;
    case CT_OPT_ADAM: case CT_OPT_BELIEF: case CT_OPT_YOGI: case CT_OPT_ADAMAX:
    case CT_OPT_AMSGRAD: {
        double b1 = 0.8 + 0.19 * unif(), b2 = 0.9 + 0.0999 * unif();
        s[0] = b1; s[1] = b2; s[2] = unif() < 0.5 ? 1e-8 : 1e-3 * unif(); s[3] = unif() < 0.5 ? 0 : 1e-8;
        s[4] = 1 - pow(b1, t); s[5] = 1 - pow(b2, t); s[7] = 1 - pow(b1, t + 1);
        /* mode: nesterov bit, and for ADAM the moment-only bit (radam) */
        s[6] = kind == CT_OPT_YOGI || kind == CT_OPT_ADAMAX || kind == CT_OPT_AMSGRAD ? 0 : (double)((unif() < 0.3) | (kind == CT_OPT_ADAM && unif() < 0.3 ? 2 : 0));
        break;
    }
    case CT_OPT_TRACE: s[0] = 0.5 + 0.49 * unif(); s[1] = unif() < 0.5; break;
    case CT_OPT_LION: s[0] = 0.8 + 0.19 * unif(); s[1] = 0.9 + 0.099 * unif(); break;
    case CT_OPT_ACCUM: s[0] = (double)(1 + next() % 5); s[1] = unif() < 0.4; s[2] = unif() < 0.3; break;
    case CT_OPT_STDDEV:
        /* A fixed decay and no bias correction keep nu - mu^2 >= d^t nu > 0 (Cauchy-Schwarz on
         * the moments' weights, which sum to 1 - d^t). Random per-step decays, or the bias
         * correction at step 1 (where nu^ - mu^^2 is 0 up to rounding), can make it negative:
         * NaN, as in optax, which this finite-input comparison avoids. */
        s[0] = 0.9; s[1] = unif() < 0.5 ? 1e-8 : 1e-3; s[2] = unif() < 0.5; s[3] = 1.0;
        break;
    case CT_OPT_RMS: {
        double d = 0.8 + 0.19 * unif();
        s[0] = d; s[1] = unif() < 0.5 ? 1e-8 : 1e-3; s[2] = unif() < 0.5;
        s[3] = unif() < 0.5 ? 1.0 : 1 - pow(d, t);
        break;
    }
    case CT_OPT_RSS: s[0] = unif() < 0.5 ? 1e-7 : 0.1 * unif(); break;
    case CT_OPT_EMA: { double d = 0.5 + 0.49 * unif(); s[0] = d; s[1] = unif() < 0.5 ? 1.0 : 1 - pow(d, t); break; }
    default: break;
    }
}

static int bits_equal(const float *a, const float *b, int64_t n, int64_t *where) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof *a) != 0) {
            *where = i;
            return 0;
        }
    return 1;
}

static void one_chain(int trial) {
    enum { N = 257 };
    ct_opt_stage st[8];
    const int nst = 1 + (int)(next() % 6);
    int nslots = 0, off[8];
    for (int k = 0; k < nst; k++) {
        int kind = kinds[next() % (sizeof kinds / sizeof *kinds)];
        if (nslots + ct_opt_kind_nslots(kind) > CT_OPT_MAX_SLOTS) kind = CT_OPT_SCALE;
        memset(&st[k], 0, sizeof st[k]);
        st[k].kind = kind;
        off[k] = nslots;
        nslots += ct_opt_kind_nslots(kind);
    }
    const uint32_t active = (uint32_t)(next() & ((1u << nst) - 1)) | 1u;
    float *p = malloc(N * sizeof *p), *p2 = malloc(N * sizeof *p), *g = malloc(N * sizeof *g);
    float *sl[CT_OPT_MAX_SLOTS], *sl2[CT_OPT_MAX_SLOTS];
    for (int i = 0; i < N; i++) p[i] = p2[i] = gauss();
    for (int q = 0; q < nslots; q++) {
        sl[q] = calloc(N, sizeof(float));
        sl2[q] = calloc(N, sizeof(float));
    }
    for (int t = 1; t <= 4; t++) {
        for (int i = 0; i < N; i++) g[i] = gauss() * (float)(i % 7 == 0 ? 1e-3 : 1.0);
        for (int k = 0; k < nst; k++) random_scalars(st[k].kind, st[k].s, t);
        ct_opt_block b;
        memset(&b, 0, sizeof b);
        b.n = N;
        b.p = p;
        b.g = g;
        b.active = active;
        b.counts = 1;
        for (int q = 0; q < nslots; q++) {
            b.slot[q] = sl[q];
            b.slot_n[q] = N;
        }
        ct_status cs = ct_optim_reference(st, nst, &b);
        CHECK(cs == CT_OK, "trial %d: reference failed: %s", trial, ct_last_error());
        float c[8][CT_OM_NC];
        for (int k = 0; k < nst; k++) ct_om_prepare(st[k].kind, st[k].s, c[k]);
        for (int i = 0; i < N; i++) {
            float u = g[i];
            for (int k = 0; k < nst; k++) {
                if (!((active >> k) & 1u)) continue;
                const int ns = ct_om_nslots(st[k].kind);
                float *a = ns > 0 ? &sl2[off[k]][i] : NULL, *bb = ns > 1 ? &sl2[off[k] + 1][i] : NULL;
                float *xx = ns > 2 ? &sl2[off[k] + 2][i] : NULL;
                float da = a ? *a : 0.0f, db = bb ? *bb : 0.0f, dx = xx ? *xx : 0.0f;
                u = ct_om_stage(st[k].kind, c[k], u, p2[i], &da, &db, &dx, 1);
                if (a) *a = da;
                if (bb) *bb = db;
                if (xx) *xx = dx;
            }
            p2[i] = p2[i] + u;
        }
        int64_t w = 0;
        CHECK(bits_equal(p, p2, N, &w), "trial %d step %d: params differ at %lld: %.9g vs %.9g",
              trial, t, (long long)w, p[w], p2[w]);
        for (int q = 0; q < nslots; q++)
            CHECK(bits_equal(sl[q], sl2[q], N, &w), "trial %d step %d: slot %d differs at %lld: %.9g vs %.9g",
                  trial, t, q, (long long)w, sl[q][w], sl2[q][w]);
    }
    for (int q = 0; q < nslots; q++) {
        free(sl[q]);
        free(sl2[q]);
    }
    free(p);
    free(p2);
    free(g);
}

/* The read-only form (w = 0) leaves state untouched and returns the same u. */
static void readonly_form(void) {
    double s[CT_OPT_NSCALARS];
    for (size_t j = 0; j < sizeof kinds / sizeof *kinds; j++) {
        random_scalars(kinds[j], s, 3);
        float c[CT_OM_NC];
        ct_om_prepare(kinds[j], s, c);
        float a = 0.25f, b = 0.5f, x = 0.125f, a2 = 0.25f, b2 = 0.5f, x2 = 0.125f;
        float u0 = ct_om_stage(kinds[j], c, 0.3f, 1.5f, &a, &b, &x, 0);
        float u1 = ct_om_stage(kinds[j], c, 0.3f, 1.5f, &a2, &b2, &x2, 1);
        CHECK(a == 0.25f && b == 0.5f && x == 0.125f, "kind %d: w=0 wrote state", kinds[j]);
        CHECK(memcmp(&u0, &u1, sizeof u0) == 0, "kind %d: w=0 and w=1 disagree", kinds[j]);
        CHECK(ct_om_nslots(kinds[j]) == ct_opt_kind_nslots(kinds[j]), "kind %d: slot count", kinds[j]);
    }
    float c[CT_OM_NC];
    ct_om_set_norm(c, 1, 4.0f, 1.0f);
    CHECK(ct_om_stage(CT_OPT_GLOBAL_NORM, c, 2.0f, 0, NULL, NULL, NULL, 1) == 0.5f, "global norm clip");
    ct_om_set_norm(c, 0, 4.0f, 1.0f);
    CHECK(ct_om_stage(CT_OPT_GLOBAL_NORM, c, 2.0f, 0, NULL, NULL, NULL, 1) == 2.0f, "global norm no clip");
    ct_om_set_gate(c, 1);
    CHECK(ct_om_stage(CT_OPT_FINITE_GATE, c, 2.0f, 0, NULL, NULL, NULL, 1) == 0.0f, "gate zero");
    ct_om_set_gate(c, 0);
    CHECK(ct_om_stage(CT_OPT_FINITE_GATE, c, 2.0f, 0, NULL, NULL, NULL, 1) == 2.0f, "gate pass");
}

// --- the GPU sequencing (ct_optim_device.c) through a host stand-in backend -------------------
//
// fake_pass does on the host what cuda_optim.cu does on a device (same
// ct_om_stage calls, counting blocks only in reduce passes), so the device
// driver's order of passes, cross-device sums, gate skipping and errors are
// checked here, against the CPU driver, without a GPU.

/* ct_optim_device.c allocates adafactor's factor buffers with ct_device_alloc (ct_device.c is
 * not linked here); the fake backend has no factored passes (optim_factored = 0: adafactor is
 * staged), so these only satisfy the linker. */
ct_status ct_device_alloc(ct_device *dev, size_t nbytes, void **out) {
    (void)dev;
    *out = malloc(nbytes ? nbytes : 1);
    return *out != NULL ? CT_OK : CT_EOOM;
}
void ct_device_free(ct_device *dev, void *ptr, size_t nbytes) {
    (void)dev;
    (void)nbytes;
    free(ptr);
}

static int fake_calls = 0, fake_board_writes = 0;
static double fake_board[CT_OPT_MAX_STAGES][64]; /* cuda_optim.cu's norm board */
static ct_status fake_pass(struct ct_device *dev, const struct ct_opt_pass *ps, double *acc) {
    (void)dev;
    fake_calls++;
    float cst[CT_OPT_MAX_STAGES][CT_OM_NC];
    memcpy(cst, ps->c, sizeof cst);
    /* device-resident norms this pass reads (cuda_optim.cu's fetch_norms) */
    const uint32_t reads = ps->dev_norm & (ps->upto >= 32 ? 0xffffffffu : ((1u << ps->upto) - 1u));
    for (int k = 0; k < ps->nstages; k++) {
        if (!((reads >> k) & 1u)) continue;
        double sum = 0.0;
        for (int j = 0; j < ps->ngroup; j++) sum += fake_board[k][j];
        const float nrm = (float)sqrt(sum);
        cst[k][0] = !(nrm < cst[k][2]) ? 1.0f : 0.0f;
        cst[k][1] = nrm;
    }
    double tmp[2];
    if (ps->reduce == 2 || ps->reduce == 3) acc = tmp;
    if (ps->reduce) acc[0] = acc[1] = 0.0;
    for (int i = 0; i < ps->nblocks; i++) {
        const ct_opt_block *b = &ps->blocks[i];
        if (ps->reduce == 3) {
            ps->blk_acc[3 * i] = ps->blk_acc[3 * i + 1] = ps->blk_acc[3 * i + 2] = 0.0;
        }
        if (ps->reduce && !b->counts) continue;
        for (int64_t e = 0; e < b->n; e++) {
            float u = ct_cv_load_f(b->g_dt, b->g, e);
            float p = b->p ? ct_cv_load_f(b->p_dt, b->p, e) : 0.0f;
            for (int k = 0; k < ps->upto; k++) {
                if (!((b->active >> k) & 1u) || ((ps->skip >> k) & 1u)) continue;
                if (ct_om_is_leafwise(ps->kind[k])) {
                    CHECK(ps->blk_f != NULL, "per-leaf stage %d without factors", k);
                    u = ct_om_leaf_apply(ps->kind[k], ps->blk_f[i * CT_OPT_MAX_STAGES + k], u);
                    continue;
                }
                const int ns = ct_om_nslots(ps->kind[k]), o = ps->slot_off[k];
                float sv[3] = {0.0f, 0.0f, 0.0f};
                for (int q = 0; q < ns; q++) sv[q] = ct_cv_load_f(b->slot_dt[o + q], b->slot[o + q], e);
                u = ct_om_stage(ps->kind[k], cst[k], u, p, &sv[0], &sv[1], &sv[2], !ps->reduce);
                for (int q = 0; !ps->reduce && q < ns; q++)
                    ct_cv_store_f(b->slot_dt[o + q], b->slot[o + q], e, sv[q]);
            }
            if (ps->reduce == 3) {
                ps->blk_acc[3 * i] += (double)u * (double)u;
                ps->blk_acc[3 * i + 1] += (double)p * (double)p;
                ps->blk_acc[3 * i + 2] += isfinite(u) ? 0.0 : 1.0;
            } else if (ps->reduce) {
                acc[0] += (double)u * (double)u;
                acc[1] += isfinite(u) ? 0.0 : 1.0;
            } else if (b->out) {
                ct_cv_store_f(b->out_dt, b->out, e, u);
            } else {
                ct_cv_store_f(b->p_dt, b->p, e, p + u);
            }
        }
    }
    if (ps->reduce == 2) {
        CHECK(ps->igroup >= 0 && ps->igroup < 64 && ps->upto < CT_OPT_MAX_STAGES, "board slot");
        fake_board[ps->upto][ps->igroup] = acc[0];
        fake_board_writes++;
    }
    return CT_OK;
}

/* The stand-in's copies (its "device" memory is host memory): 1-d, contiguous. */
static int fake_copies = 0;
static ct_status fake_copy(struct ct_device *dd, struct ct_device *sd, int ndim,
                           const int64_t *shape, size_t isz, void *dst, const int64_t *ds,
                           const void *src, const int64_t *ss) {
    (void)dd;
    (void)sd;
    CHECK(ndim == 1 && ds[0] == (int64_t)isz && ss[0] == (int64_t)isz, "fake copy: not 1-d");
    memcpy(dst, src, (size_t)shape[0] * isz);
    fake_copies++;
    return CT_OK;
}

static int close_rel(const float *a, const float *b, int64_t n, float tol, int64_t *where) {
    for (int64_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]), m = fmaxf(fabsf(a[i]), fabsf(b[i]));
        if (!(d <= tol * m + 1e-30f) && !(isnan(a[i]) && isnan(b[i]))) {
            *where = i;
            return 0;
        }
    }
    return 1;
}

/* 2 devices x 2 leaves; leaf 1 replicated on both (counts only on device 0). gate: a
 * FINITE_GATE before the GLOBAL_NORM (2: after it, so its reduce pass reads the norm);
 * host_norm: CTRAINSTATE_HOST_NORM=1 (norms through the host, not the devices' board). */
static void device_driver(int gate, int with_nan, int host_norm, int leafwise) {
    setenv("CTRAINSTATE_HOST_NORM", host_norm ? "1" : "0", 1);
    static ct_backend fake;
    memset(&fake, 0, sizeof fake);
    fake.name = "fake-gpu";
    fake.platform = CT_PLATFORM_GPU;
    fake.optim_pass = fake_pass;
    fake.copy_block = fake_copy;
    static ct_device dev[2];
    memset(dev, 0, sizeof dev);
    for (int d = 0; d < 2; d++) {
        dev[d].id = 100 + d;
        dev[d].platform = CT_PLATFORM_GPU;
        dev[d].backend = &fake;
    }
    enum { NA = 301, NB = 45 };
    ct_opt_stage st[8];
    memset(st, 0, sizeof st);
    int nst = 0;
    if (gate == 1) { st[nst].kind = CT_OPT_FINITE_GATE; st[nst].s[0] = 3; nst++; }
    st[nst].kind = CT_OPT_GLOBAL_NORM; st[nst].s[0] = 1.0; nst++;
    if (gate == 2) { st[nst].kind = CT_OPT_FINITE_GATE; st[nst].s[0] = 2; nst++; }
    st[nst].kind = CT_OPT_ADAM;
    double s[CT_OPT_NSCALARS];
    random_scalars(CT_OPT_ADAM, s, 2);
    memcpy(st[nst].s, s, sizeof s);
    nst++;
    if (leafwise) { /* lamb's trust ratio, then adafactor's block and param RMS */
        st[nst].kind = CT_OPT_TRUST_RATIO; st[nst].s[0] = 0.0; st[nst].s[1] = 1.0; nst++;
        st[nst].kind = CT_OPT_BLOCK_RMS; st[nst].s[0] = 0.5; nst++;
        st[nst].kind = CT_OPT_PARAM_RMS; st[nst].s[0] = 1e-3; nst++;
    }
    st[nst].kind = CT_OPT_SCALE; st[nst].s[0] = -1e-2; nst++;
    /* two copies of all data: [0] through the fake GPU driver, [1] through the CPU driver */
    float *p[2][2][2], *g[2][2][2], *m[2][2][2], *v[2][2][2]; /* [copy][device][leaf] */
    const int64_t n[2] = {NA, NB};
    uint64_t seed = rng;
    for (int cp = 0; cp < 2; cp++) {
        rng = seed;
        for (int d = 0; d < 2; d++)
            for (int l = 0; l < 2; l++) {
                p[cp][d][l] = malloc((size_t)n[l] * sizeof(float));
                g[cp][d][l] = malloc((size_t)n[l] * sizeof(float));
                m[cp][d][l] = calloc((size_t)n[l], sizeof(float));
                v[cp][d][l] = calloc((size_t)n[l], sizeof(float));
                for (int64_t i = 0; i < n[l]; i++) {
                    p[cp][d][l][i] = gauss();
                    g[cp][d][l][i] = gauss();
                }
            }
        if (with_nan) g[cp][0][0][7] = NAN;
        for (int64_t i = 0; i < NB; i++) { /* the replica holds the same data */
            p[cp][1][1][i] = p[cp][0][1][i];
            g[cp][1][1][i] = g[cp][0][1][i];
        }
    }
    ct_opt_block blk[2][2][2];
    ct_opt_group grp[2][2];
    memset(blk, 0, sizeof blk);
    for (int cp = 0; cp < 2; cp++) {
        for (int d = 0; d < 2; d++) {
            for (int l = 0; l < 2; l++) {
                ct_opt_block *b = &blk[cp][d][l];
                b->n = n[l];
                b->p = p[cp][d][l];
                b->g = g[cp][d][l];
                b->active = (1u << nst) - 1;
                b->leaf = l == 0 ? d : 2; /* leaf 0 split over devices (leaves 0,1), leaf 2 replicated */
                b->counts = !(l == 1 && d == 1);
                b->slot[0] = m[cp][d][l];
                b->slot[1] = v[cp][d][l];
                b->slot_n[0] = b->slot_n[1] = n[l];
            }
            grp[cp][d].blocks = blk[cp][d];
            grp[cp][d].nblocks = 2;
            grp[cp][d].dev = cp == 0 ? &dev[d] : NULL;
        }
    }
    ct_opt_stage st_gpu[8], st_cpu[8];
    memcpy(st_gpu, st, sizeof st);
    memcpy(st_cpu, st, sizeof st);
    fake_calls = 0;
    fake_board_writes = 0;
    ct_status a = ct_optim_step(st_gpu, nst, grp[0], 2, 3);
    ct_status b = ct_optim_step(st_cpu, nst, grp[1], 2, 3);
    CHECK(a == CT_OK && b == CT_OK, "device driver: step failed: %s", ct_last_error());
    /* a rejecting gate before the norm skips the norm's pass */
    const int norm_runs = !(gate == 1 && with_nan);
    /* a rejecting gate covers the trust ratio (not the block / param RMS after it) */
    const int leaf_runs = leafwise ? 3 - (gate && with_nan ? 1 : 0) : 0;
    const int npass = 2 * (1 + norm_runs + (gate ? 1 : 0) + leaf_runs);
    CHECK(fake_calls == npass, "device driver: %d passes, expected %d", fake_calls, npass);
    CHECK(fake_board_writes == (host_norm ? 0 : 2 * norm_runs), "device driver: %d board writes",
          fake_board_writes);
    for (int k = 0; k < nst; k++) {
        if (st[k].kind == CT_OPT_GLOBAL_NORM && !host_norm && norm_runs) {
            CHECK(isnan(st_gpu[k].result), "device driver: a device norm was read back");
            continue;
        }
        CHECK((isnan(st_gpu[k].result) && isnan(st_cpu[k].result)) ||
                  fabs(st_gpu[k].result - st_cpu[k].result) <= 1e-6 * fabs(st_cpu[k].result),
              "device driver: stage %d result %.9g vs %.9g", k, st_gpu[k].result, st_cpu[k].result);
    }
    int64_t w = 0;
    for (int d = 0; d < 2; d++)
        for (int l = 0; l < 2; l++) {
            CHECK(close_rel(p[0][d][l], p[1][d][l], n[l], 1e-6f, &w), "device driver: p[%d][%d] at %lld", d, l, (long long)w);
            CHECK(close_rel(m[0][d][l], m[1][d][l], n[l], 1e-6f, &w), "device driver: m[%d][%d] at %lld", d, l, (long long)w);
            CHECK(close_rel(v[0][d][l], v[1][d][l], n[l], 1e-6f, &w), "device driver: v[%d][%d] at %lld", d, l, (long long)w);
        }
    /* errors: a mixed step, an unsupported reduction */
    grp[0][1].dev = NULL;
    CHECK(ct_optim_step(st_gpu, nst, grp[0], 2, 3) == CT_EINVAL &&
          strstr(ct_last_error(), "mixes CPU and GPU") != NULL, "device driver: mixed step accepted");
    grp[0][1].dev = &dev[1];
    ct_opt_stage tr[2];
    memset(tr, 0, sizeof tr);
    /* a kind with no GPU pass (adafactor's factored moments): the step goes through host
     * staging and the CPU driver, with the same results as the CPU driver */
    tr[0].kind = CT_OPT_FACTORED;
    tr[1].kind = CT_OPT_SCALE;
    tr[1].s[0] = -0.5;
    for (int cp = 0; cp < 2; cp++)
        for (int d = 0; d < 2; d++)
            for (int l = 0; l < 2; l++) blk[cp][d][l].active = 2u;
    fake_calls = fake_copies = 0;
    CHECK(ct_optim_step(tr, 2, grp[0], 2, 3) == CT_OK, "device driver: staged step: %s",
          ct_last_error());
    CHECK(fake_calls == 0 && fake_copies > 0, "device driver: staged step ran %d passes, %d copies",
          fake_calls, fake_copies);
    memcpy(st_cpu, tr, 2 * sizeof tr[0]);
    CHECK(ct_optim_step(st_cpu, 2, grp[1], 2, 3) == CT_OK, "device driver: cpu step");
    for (int d = 0; d < 2; d++)
        for (int l = 0; l < 2; l++)
            CHECK(close_rel(p[0][d][l], p[1][d][l], n[l], 0.0f, &w), "device driver: staged p[%d][%d]", d, l);
    for (int cp = 0; cp < 2; cp++)
        for (int d = 0; d < 2; d++)
            for (int l = 0; l < 2; l++) {
                free(p[cp][d][l]);
                free(g[cp][d][l]);
                free(m[cp][d][l]);
                free(v[cp][d][l]);
            }
}

/* The GPU sequencing with 16-bit arrays (the fake pass loads and stores each in its dtype, as
 * cuda_optim.cu): an elementwise chain, then a factored step through host staging, each bit for
 * bit against the CPU driver on the same 16-bit arrays. dt: p, g, m, v dtypes; emit: updates
 * written to an out array of dtype dt[4]. */
static void device_lowp(const int *dt, int emit) {
    setenv("CTRAINSTATE_HOST_NORM", "0", 1);
    static ct_backend fake;
    memset(&fake, 0, sizeof fake);
    fake.name = "fake-gpu";
    fake.platform = CT_PLATFORM_GPU;
    fake.optim_pass = fake_pass;
    fake.copy_block = fake_copy;
    static ct_device dev[2];
    memset(dev, 0, sizeof dev);
    for (int d = 0; d < 2; d++) {
        dev[d].id = 100 + d;
        dev[d].platform = CT_PLATFORM_GPU;
        dev[d].backend = &fake;
    }
    enum { NA = 301, NB = 45, NARR = 5 };
    const int64_t n[2] = {NA, NB};
    /* [copy][device][leaf][array: p g m v out] */
    void *x[2][2][2][NARR];
    for (int d = 0; d < 2; d++)
        for (int l = 0; l < 2; l++)
            for (int a = 0; a < NARR; a++) {
                const size_t bytes = (size_t)n[l] * ct_dtype_size((ct_dtype)dt[a]);
                x[0][d][l][a] = calloc(1, bytes);
                x[1][d][l][a] = calloc(1, bytes);
                for (int64_t i = 0; i < n[l] && a < 2; i++)
                    ct_cv_store_f(dt[a], x[0][d][l][a], i, gauss());
                if (l == 1 && d == 1) memcpy(x[0][1][1][a], x[0][0][1][a], bytes); /* the replica */
                memcpy(x[1][d][l][a], x[0][d][l][a], bytes);
            }
    ct_opt_block blk[2][2][2];
    ct_opt_group grp[2][2];
    memset(blk, 0, sizeof blk);
    for (int cp = 0; cp < 2; cp++)
        for (int d = 0; d < 2; d++) {
            for (int l = 0; l < 2; l++) {
                ct_opt_block *b = &blk[cp][d][l];
                b->n = n[l];
                b->p = x[cp][d][l][0];
                b->g = x[cp][d][l][1];
                b->out = emit ? x[cp][d][l][4] : NULL;
                b->p_dt = (uint8_t)dt[0];
                b->g_dt = (uint8_t)dt[1];
                b->out_dt = (uint8_t)dt[4];
                for (int q = 0; q < 3; q++) { /* adam's m, v; adafactor's v_row, v_col, v */
                    b->slot[q] = x[cp][d][l][2 + (q == 1)];
                    b->slot_dt[q] = (uint8_t)dt[2 + (q == 1)];
                    b->slot_n[q] = n[l];
                }
                b->active = 7u;
                b->leaf = l == 0 ? d : 2;
                b->counts = !(l == 1 && d == 1);
            }
            grp[cp][d].blocks = blk[cp][d];
            grp[cp][d].nblocks = 2;
            grp[cp][d].dev = cp == 0 ? &dev[d] : NULL;
        }
    ct_opt_stage st[3];
    memset(st, 0, sizeof st);
    st[0].kind = CT_OPT_ADAM;
    random_scalars(CT_OPT_ADAM, st[0].s, 3);
    st[1].kind = CT_OPT_DECAY;
    st[1].s[0] = 0.05;
    st[2].kind = CT_OPT_SCALE;
    st[2].s[0] = -0.01;
    for (int step = 0; step < 2; step++) {
        if (step == 1) { /* adafactor on unfactored leaves: v is slot 2 (here m's array) */
            st[0].kind = CT_OPT_FACTORED;
            st[0].s[0] = 0.8;
            st[0].s[1] = 1e-30;
            for (int cp = 0; cp < 2; cp++)
                for (int d = 0; d < 2; d++)
                    for (int l = 0; l < 2; l++) blk[cp][d][l].slot_n[0] = blk[cp][d][l].slot_n[1] = 1;
        }
        fake_calls = fake_copies = 0;
        ct_opt_stage a[3], b[3];
        memcpy(a, st, sizeof st);
        memcpy(b, st, sizeof st);
        CHECK(ct_optim_step(a, 3, grp[0], 2, 3) == CT_OK, "device 16-bit: step %d: %s", step,
              ct_last_error());
        CHECK(ct_optim_step(b, 3, grp[1], 2, 3) == CT_OK, "device 16-bit: cpu step %d", step);
        CHECK(step == 0 ? fake_calls == 2 : (fake_calls == 0 && fake_copies > 0),
              "device 16-bit: step %d ran %d passes, %d copies", step, fake_calls, fake_copies);
        for (int d = 0; d < 2; d++)
            for (int l = 0; l < 2; l++)
                for (int ar = 0; ar < NARR; ar++)
                    CHECK(memcmp(x[0][d][l][ar], x[1][d][l][ar],
                                 (size_t)n[l] * ct_dtype_size((ct_dtype)dt[ar])) == 0,
                          "device 16-bit (%s %s %s %s, emit %d): step %d: array %d of [%d][%d] differs",
                          ct_dtype_name((ct_dtype)dt[0]), ct_dtype_name((ct_dtype)dt[1]),
                          ct_dtype_name((ct_dtype)dt[2]), ct_dtype_name((ct_dtype)dt[3]), emit,
                          step, ar, d, l);
    }
    for (int cp = 0; cp < 2; cp++)
        for (int d = 0; d < 2; d++)
            for (int l = 0; l < 2; l++)
                for (int a = 0; a < NARR; a++) free(x[cp][d][l][a]);
}

int main(void) {
    for (int trial = 0; trial < 400; trial++) one_chain(trial);
    readonly_form();
    for (int host = 0; host < 2; host++) {
        for (int leafwise = 0; leafwise < 2; leafwise++) {
            device_driver(0, 0, host, leafwise);
            device_driver(1, 0, host, leafwise);
            device_driver(1, 1, host, leafwise);
            device_driver(2, 0, host, leafwise);
            device_driver(2, 1, host, leafwise);
        }
    }
    const int lowp[4][5] = {{CT_BF16, CT_BF16, CT_BF16, CT_F32, CT_BF16},
                            {CT_F16, CT_F32, CT_F16, CT_F16, CT_F32},
                            {CT_F32, CT_BF16, CT_BF16, CT_BF16, CT_F16},
                            {CT_F16, CT_F16, CT_F16, CT_F16, CT_F16}};
    for (int j = 0; j < 4; j++) {
        device_lowp(lowp[j], 0);
        device_lowp(lowp[j], 1);
    }
    printf("test_optim_math: %d checks, %d failures (bit-exact vs ct_optim_reference)\n", checks,
           failures);
    return failures != 0;
}
