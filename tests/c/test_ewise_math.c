/*
 * test_ewise_math.c — the typed elementwise ops and integer reductions of
 * csrc/core/ct_ewise_math.h (the element code every backend runs), against references
 * written here: int64 arithmetic with Python's floor division for nonzero divisors, and
 * for what numpy cannot say the values jax 0.10 returns on CPU (measured): int x // 0 is
 * -1 (x == 0) or -2, x % 0 is 0, uint32 x // 0 is 2^32 - 1; shifts past the width give 0
 * or the sign fill; float32 subnormals compare as zero.
 *
 * Inputs: every pair of a set of int32 / uint32 edge values and random ones (all ops), every
 * pair of uint8 / int8 values and of int16 / uint16 edge and random ones (all ops), and
 * float pairs with NaN, inf, signed zeros and subnormals (comparisons, floor_divide,
 * remainder).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "ct_ewise_math.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t next32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

/* floor division and modulo of int64 values, b != 0 */
static int64_t floordiv64(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
    return q;
}
static int64_t fmod64(int64_t a, int64_t b) { return a - floordiv64(a, b) * b; }

static int64_t ref_i(int op, int sgn, int64_t a, int64_t b) {
    uint32_t s = (uint32_t)b;
    switch (op) {
    case CT_EW_ADD: return a + b;
    case CT_EW_SUB: return a - b;
    case CT_EW_MUL: return (int64_t)((uint64_t)a * (uint64_t)b);
    case CT_EW_MAX: return a > b ? a : b;
    case CT_EW_MIN: return a < b ? a : b;
    case CT_EW_FLOORDIV:
        if (b == 0) return sgn ? (a == 0 ? -1 : -2) : 0xffffffffll;
        return floordiv64(a, b);
    case CT_EW_REM: return b == 0 ? 0 : fmod64(a, b);
    case CT_EW_AND: return a & b;
    case CT_EW_OR: return a | b;
    case CT_EW_XOR: return a ^ b;
    case CT_EW_SHL: return s >= 32 ? 0 : (int64_t)((uint64_t)(uint32_t)a << s);
    case CT_EW_SHR:
        if (sgn) return s >= 32 ? (a < 0 ? -1 : 0) : (int64_t)floor((double)a / ldexp(1.0, (int)s));
        return s >= 32 ? 0 : (int64_t)((uint32_t)a >> s);
    case CT_EW_NOT: return ~a;
    case CT_EW_NEG: return -a;
    default: return a < 0 ? -a : a;
    }
}

static int ref_cmp(int op, double a, double b) {
    switch (op) {
    case CT_EW_EQ: return a == b;
    case CT_EW_NE: return a != b;
    case CT_EW_LT: return a < b;
    case CT_EW_LE: return a <= b;
    case CT_EW_GT: return a > b;
    default: return a >= b;
    }
}

static void ints(int dt) {
    const int sgn = dt == CT_I32;
    enum { N = 64 };
    int64_t v[N] = {0, 1, -1, 2, -2, 3, -3, 7, -7, 31, 32, 33, 100, INT32_MAX, INT32_MIN,
                    INT32_MIN + 1, 65536, -65536, 1 << 24, 0x55555555, (int64_t)0xaaaaaaaau};
    for (int i = 21; i < N; i++) v[i] = (int32_t)next32() >> (next32() % 31);
    int32_t xa[N];
    uint32_t xu[N];
    for (int i = 0; i < N; i++) {
        xa[i] = (int32_t)(uint32_t)v[i];
        xu[i] = (uint32_t)v[i];
    }
    const void *x = sgn ? (const void *)xa : (const void *)xu;
    for (int op = 0; op < CT_EW_ISNAN; op++) {
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N; j++) {
                int64_t a = sgn ? (int64_t)xa[i] : (int64_t)xu[i], b = sgn ? (int64_t)xa[j] : (int64_t)xu[j];
                if (op <= CT_EW_GE) {
                    uint8_t o = 2;
                    ct_ew_elem(op, dt, &o, 0, x, i, x, j);
                    CHECK(o == ref_cmp(op, (double)a, (double)b), "%s cmp %d: %lld %lld -> %d",
                          sgn ? "int32" : "uint32", op, (long long)a, (long long)b, o);
                    continue;
                }
                if (op >= CT_EW_NOT && j > 0) continue;
                uint32_t o = 0xdeadbeefu, want = (uint32_t)(uint64_t)ref_i(op, sgn, a, b);
                ct_ew_elem(op, dt, &o, 0, x, i, x, j);
                CHECK(o == want, "%s op %d: %lld, %lld -> %u, want %u", sgn ? "int32" : "uint32",
                      op, (long long)a, (long long)b, o, want);
            }
    }
}

/* v wrapped to a `w`-bit integer, sign-extended when `sgn` */
static int64_t wrap_w(int64_t v, int w, int sgn) {
    uint64_t m = (1ull << w) - 1u, u = (uint64_t)v & m;
    return (sgn && (u >> (w - 1))) ? (int64_t)(u | ~m) : (int64_t)u;
}

/* The reference for the narrow ints: the width-exact rules (shift counts against the
 * width, division by zero as jax 0.10 on CPU: -1 / -2 signed, all ones unsigned), results
 * wrapped to the width. */
static int64_t ref_narrow(int op, int w, int sgn, int64_t a, int64_t b) {
    uint32_t s = (uint32_t)b; /* a negative count is huge: past the width */
    switch (op) {
    case CT_EW_FLOORDIV:
        if (b == 0) return sgn ? (a == 0 ? -1 : -2) : wrap_w(-1, w, 0);
        return wrap_w(floordiv64(a, b), w, sgn);
    case CT_EW_SHL: return s >= (uint32_t)w ? 0 : wrap_w((int64_t)((uint64_t)a << s), w, sgn);
    case CT_EW_SHR:
        if (sgn) return s >= (uint32_t)w ? (a < 0 ? -1 : 0) : (int64_t)floor((double)a / ldexp(1.0, (int)s));
        return s >= (uint32_t)w ? 0 : a >> s;
    default: return wrap_w(ref_i(op, sgn, a, b), w, sgn);
    }
}

/* uint8 / int8: every pair of values; int16 / uint16: edge values and random ones. Every
 * op, the loads' extension, the stores' wrap; then float -> narrow conversions (truncation,
 * saturation, NaN -> 0) and the maximum's identity. */
static void narrow(int dt, int w, int sgn, const char *name) {
    enum { M = 96 };
    const int64_t lo = sgn ? -(1ll << (w - 1)) : 0, span = 1ll << w;
    int64_t vals[256];
    int n = 0;
    if (w == 8) {
        for (int i = 0; i < 256; i++) vals[n++] = lo + i;
    } else {
        const int64_t edge[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 100, 255, 256, 32767, 32768 % span,
                                65535 % span, -1, -2, -7, -100, -32768, -32767};
        for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) vals[n++] = wrap_w(edge[i], w, sgn);
        while (n < M) vals[n++] = wrap_w((int64_t)next32(), w, sgn);
    }
    uint8_t xb[256 * 2];
    for (int i = 0; i < n; i++) ct_cv_store_i(dt, xb, i, vals[i]);
    for (int i = 0; i < n; i++)
        CHECK(ct_cv_load_i(dt, xb, i) == vals[i], "%s load %lld", name, (long long)vals[i]);
    for (int op = 0; op < CT_EW_ISNAN; op++)
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                if (op >= CT_EW_NOT && j > 0) continue;
                const int64_t a = vals[i], b = vals[j];
                if (op <= CT_EW_GE) {
                    uint8_t o = 2;
                    ct_ew_elem(op, dt, &o, 0, xb, i, xb, j);
                    CHECK(o == ref_cmp(op, (double)a, (double)b), "%s cmp %d: %lld %lld -> %d",
                          name, op, (long long)a, (long long)b, o);
                    continue;
                }
                uint8_t o[2] = {0xa5, 0xa5}, guard[2] = {0x5a, 0x5a};
                ct_ew_elem(op, dt, o, 0, xb, i, xb, j);
                const int64_t got = ct_cv_load_i(dt, o, 0), want = ref_narrow(op, w, sgn, a, b);
                CHECK(got == want, "%s op %d: %lld, %lld -> %lld, want %lld", name, op,
                      (long long)a, (long long)b, (long long)got, (long long)want);
                CHECK(guard[0] == 0x5a && guard[1] == 0x5a, "%s op %d wrote past", name, op);
            }
    /* float32 -> the dtype: truncation toward zero, saturation, NaN -> 0 (jax 0.10, CPU) */
    const double hi = (double)(lo + span - 1);
    const float fv[] = {NAN, INFINITY, -INFINITY, -1.7f, -0.5f, 0.9f, 127.9f, 128.0f, 255.5f,
                        256.0f, -129.0f, -128.5f, 32767.5f, 32768.0f, -32768.5f, 65535.9f,
                        65536.0f, 1e10f, -1e10f, 3e9f};
    uint8_t y[64];   /* ct_cv_elem writes element i of y */
    for (size_t i = 0; i < sizeof fv / sizeof fv[0]; i++) {
        ct_cv_elem(CT_F32, fv, dt, y, (int64_t)i);
        double t = isnan(fv[i]) ? 0.0 : trunc((double)fv[i]);
        double want = t < (double)lo ? (double)lo : (t > hi ? hi : t);
        CHECK((double)ct_cv_load_i(dt, y, (int64_t)i) == want, "%s from %g -> %lld, want %g",
              name, fv[i], (long long)ct_cv_load_i(dt, y, (int64_t)i), want);
    }
    /* int32 -> the dtype wraps; the dtype -> int32 extends */
    const int32_t iv[] = {INT32_MIN, -40000, -129, -1, 0, 127, 128, 255, 256, 65535, 65536, INT32_MAX};
    int32_t back[16];
    for (size_t i = 0; i < sizeof iv / sizeof iv[0]; i++) {
        ct_cv_elem(CT_I32, iv, dt, y, (int64_t)i);
        ct_cv_elem(dt, y, CT_I32, back, (int64_t)i);
        CHECK(back[i] == wrap_w(iv[i], w, sgn), "%s from int32 %d -> %d", name, iv[i], back[i]);
    }
    CHECK(ct_ew_red_identity(CT_RED_MAX, dt) == lo, "%s max identity", name);
}

static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* DAZ as XLA's CPU does it: a subnormal is a zero of its sign */
static double daz(float f) { return fabsf(f) < 1.17549435e-38f ? copysign(0.0, f) : (double)f; }

static void floats(void) {
    enum { N = 40 };
    float v[N] = {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 2.5f, -2.5f, 7.0f, -7.0f, 3.0f, 0.3f,
                  INFINITY, -INFINITY, NAN, 1e-40f, -1e-40f, u2f(0x00800000u), 3e38f, -3e38f, 5.5f};
    for (int i = 20; i < N; i++) v[i] = (float)((int32_t)next32() % 2000) / 16.0f;
    for (int op = 0; op <= CT_EW_GE; op++)
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N; j++) {
                uint8_t o = 2;
                ct_ew_elem(op, CT_F32, &o, 0, v, i, v, j);
                CHECK(o == ref_cmp(op, daz(v[i]), daz(v[j])), "f32 cmp %d: %g %g -> %d", op,
                      v[i], v[j], o);
            }
    /* floor_divide / remainder: Python's float // and % (CPython's float_divmod, which
     * jnp follows), with subnormal operands of // as zeros */
    for (int i = 0; i < N; i++)
        for (int j = 0; j < N; j++) {
            double a = daz(v[i]), b = daz(v[j]);
            float q, r;
            ct_ew_elem(CT_EW_FLOORDIV, CT_F32, &q, 0, v, i, v, j);
            ct_ew_elem(CT_EW_REM, CT_F32, &r, 0, v, i, v, j);
            double m = fmod(a, b), wq, wr = m;
            if (b == 0.0) {
                wq = a / b;
                wr = NAN;
                if (a == 0.0 || isnan(a)) wq = NAN;
            } else {
                double d = (a - m) / b;
                if (m != 0.0 && ((b < 0) != (m < 0))) { wr = m + b; d -= 1.0; }
                wq = isnan(m) ? NAN : round(d);
                if (isinf(b) && !isinf(a) && !isnan(a)) { /* a // ±inf: 0 or -1 (signs) */
                    wq = (a == 0.0 || (a > 0) == (b > 0)) ? 0.0 : -1.0;
                    wr = (a == 0.0 || (a > 0) == (b > 0)) ? a : b;
                }
            }
            wq = (double)(float)wq; /* overflow to inf as float32 */
            /* % as XLA's CPU computes it (measured with jax): the dividend as it is (1e-40 %
             * 3 is 1e-40), the divisor flushed, the sign test on the flushed remainder */
            if (b == 0.0) {
                wr = NAN;
            } else {
                double m2 = fmod((double)v[i], b), mz = daz((float)m2);
                wr = (mz != 0.0 && ((b < 0) != (mz < 0))) ? m2 + b : m2;
            }
            wr = (double)(float)wr;
            CHECK((isnan(wq) && isnan(q)) || (double)q == wq, "f32 %g // %g -> %g, want %g", a, b, q, wq);
            CHECK((isnan(wr) && isnan(r)) || (double)r == wr, "f32 %g %% %g -> %g, want %g", a, b, r, wr);
        }
}

static void reductions(void) {
    /* a 3 x 4 x 5 int32 block near the wrap point, summed / maxed over every axis set */
    int32_t x[60];
    for (int i = 0; i < 60; i++) x[i] = (int32_t)(INT32_MAX - 7 + (uint32_t)i * 0x1234567u);
    const int64_t shape[3] = {3, 4, 5};
    for (uint32_t axes = 0; axes < 8; axes++)
        for (int op = 0; op < 2; op++) {
            ct_ew_red_plan p;
            ct_ew_red_plan_init(&p, 3, shape, axes);
            int64_t nout = 1;
            for (int j = 0; j < p.nk; j++) nout *= p.kdim[j];
            /* reference: brute force over all 60 elements, bucketed by kept coordinates */
            int64_t acc[60];
            int have[60] = {0};
            for (int i = 0; i < 60; i++) {
                int c[3] = {i / 20, (i / 5) % 4, i % 5}, k = 0;
                for (int d = 0; d < 3; d++)
                    if (!(axes & (1u << d))) k = k * (int)shape[d] + c[d];
                if (!have[k]) { acc[k] = x[i]; have[k] = 1; }
                else acc[k] = op == 0 ? acc[k] + x[i] : (x[i] > acc[k] ? x[i] : acc[k]);
            }
            int32_t out[60];
            for (int64_t q = 0; q < nout; q++) ct_ew_reduce_one(op, CT_I32, &p, x, out, q);
            for (int64_t q = 0; q < nout; q++)
                CHECK(out[q] == (int32_t)(uint32_t)(uint64_t)acc[q], "reduce op %d axes %u out %lld",
                      op, axes, (long long)q);
        }
}

int main(void) {
    ints(CT_I32);
    ints(CT_U32);
    narrow(CT_U8, 8, 0, "uint8");
    narrow(CT_I8, 8, 1, "int8");
    narrow(CT_I16, 16, 1, "int16");
    narrow(CT_U16, 16, 0, "uint16");
    floats();
    reductions();
    printf("test_ewise_math: %d checks, %d failures\n", checks, failures);
    return failures != 0;
}
