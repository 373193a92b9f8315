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
 *   make -C tests/c test
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct_optim.h"
#include "ct_optim_math.h"
#include "ct_status.h"

static int failures = 0, checks = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        checks++;                                                          \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "%s:%d: FAIL: ", __FILE__, __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

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
                            CT_OPT_RMS,   CT_OPT_RSS,  CT_OPT_CLIP,  CT_OPT_EMA};

static void random_scalars(int kind, double *s, int t) {
    memset(s, 0, CT_OPT_NSCALARS * sizeof *s);
    switch (kind) {
    case CT_OPT_SCALE: s[0] = -(1e-4 + unif() * 1e-2); break;
    case CT_OPT_DECAY: s[0] = unif() * 0.1; break;
    case CT_OPT_CLIP: s[0] = 0.05 + unif(); break;
    case CT_OPT_ADAM: {
        double b1 = 0.8 + 0.19 * unif(), b2 = 0.9 + 0.0999 * unif();
        s[0] = b1; s[1] = b2; s[2] = unif() < 0.5 ? 1e-8 : 1e-3 * unif(); s[3] = unif() < 0.5 ? 0 : 1e-8;
        s[4] = 1 - pow(b1, t); s[5] = 1 - pow(b2, t); s[6] = unif() < 0.3; s[7] = 1 - pow(b1, t + 1);
        break;
    }
    case CT_OPT_TRACE: s[0] = 0.5 + 0.49 * unif(); s[1] = unif() < 0.5; break;
    case CT_OPT_LION: s[0] = 0.8 + 0.19 * unif(); s[1] = 0.9 + 0.099 * unif(); break;
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
                float da = a ? *a : 0.0f, db = bb ? *bb : 0.0f;
                u = ct_om_stage(st[k].kind, c[k], u, p2[i], &da, &db, 1);
                if (a) *a = da;
                if (bb) *bb = db;
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
        float a = 0.25f, b = 0.5f, a2 = 0.25f, b2 = 0.5f;
        float u0 = ct_om_stage(kinds[j], c, 0.3f, 1.5f, &a, &b, 0);
        float u1 = ct_om_stage(kinds[j], c, 0.3f, 1.5f, &a2, &b2, 1);
        CHECK(a == 0.25f && b == 0.5f, "kind %d: w=0 wrote state", kinds[j]);
        CHECK(memcmp(&u0, &u1, sizeof u0) == 0, "kind %d: w=0 and w=1 disagree", kinds[j]);
        CHECK(ct_om_nslots(kinds[j]) == ct_opt_kind_nslots(kinds[j]), "kind %d: slot count", kinds[j]);
    }
    float c[CT_OM_NC];
    ct_om_set_norm(c, 1, 4.0f, 1.0f);
    CHECK(ct_om_stage(CT_OPT_GLOBAL_NORM, c, 2.0f, 0, NULL, NULL, 1) == 0.5f, "global norm clip");
    ct_om_set_norm(c, 0, 4.0f, 1.0f);
    CHECK(ct_om_stage(CT_OPT_GLOBAL_NORM, c, 2.0f, 0, NULL, NULL, 1) == 2.0f, "global norm no clip");
    ct_om_set_gate(c, 1);
    CHECK(ct_om_stage(CT_OPT_FINITE_GATE, c, 2.0f, 0, NULL, NULL, 1) == 0.0f, "gate zero");
    ct_om_set_gate(c, 0);
    CHECK(ct_om_stage(CT_OPT_FINITE_GATE, c, 2.0f, 0, NULL, NULL, 1) == 2.0f, "gate pass");
}

int main(void) {
    for (int trial = 0; trial < 400; trial++) one_chain(trial);
    readonly_form();
    printf("test_optim_math: %d checks, %d failures (bit-exact vs ct_optim_reference)\n", checks,
           failures);
    return failures != 0;
}
