/*
 * test_ops_math.c — the float element kernels of ABI 7 in csrc/core/ct_ops_math.h
 * (ct_unary_ext CT_UN_SINH .. CT_UN_SIGNBIT, ct_binary_apply CT_BIN_ATAN2 .. CT_BIN_LDEXP:
 * the code the CPU loops, the CUDA kernels and the mock GPU backend evaluate), against
 * references written here: the double-precision libm function rounded once to float32
 * (an ulp bound: glibc's float functions are within 2 ulp of it on these points), and the
 * exact operations (sign bit, nextafter, fmod, ldexp) bit for bit against a computation in
 * double or on the bits.
 *
 * Inputs: a dense sweep of float32 values (every 509-th bit pattern, every 4093-th under
 * the sanitizers; both signs: subnormals, normals, inf and NaN), plus the edge values of
 * each function's domain.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "ct_ops_math.h"

/* the sweep's step between bit patterns (the sanitizer build takes a coarser one) */
#ifndef CT_OPS_STRIDE
#define CT_OPS_STRIDE 509
#endif

static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The distance in float32 ulps between got and want (want a float32 value); both NaN
 * counts as 0, a NaN against a number as a huge distance. */
static double ulp_dist(float got, float want) {
    if (got != got || want != want) return (got != got && want != want) ? 0.0 : 1e30;
    if (got == want) return 0.0;
    int32_t a = (int32_t)bits(got), b = (int32_t)bits(want);
    int64_t ia = a < 0 ? (int64_t)INT32_MIN - a : a, ib = b < 0 ? (int64_t)INT32_MIN - b : b;
    return (double)(ia > ib ? ia - ib : ib - ia);
}

static double ref_unary(int op, double x) {
    switch (op) {
    case CT_UN_SINH: return sinh(x);
    case CT_UN_COSH: return cosh(x);
    case CT_UN_TAN: return tan(x);
    case CT_UN_ASIN: return asin(x);
    case CT_UN_ACOS: return acos(x);
    case CT_UN_ATAN: return atan(x);
    case CT_UN_ASINH: return asinh(x);
    case CT_UN_ACOSH: return acosh(x);
    case CT_UN_ATANH: return atanh(x);
    case CT_UN_CBRT: return cbrt(x);
    default: return exp2(x); /* CT_UN_EXP2 */
    }
}

static const char *NAMES[] = {"sinh", "cosh", "tan", "asin", "acos", "atan", "asinh", "acosh",
                              "atanh", "cbrt", "exp2"};

static void test_unary_sweep(void) {
    double worst[CT_UN_EXP2 - CT_UN_SINH + 1] = {0};
    for (int op = CT_UN_SINH; op <= CT_UN_EXP2; op++) {
        for (uint64_t u = 0; u <= 0xffffffffull; u += CT_OPS_STRIDE) {
            float x = from_bits((uint32_t)u);
            float got = ct_unary_ext(op, x);
            float want = (float)ref_unary(op, (double)x);
            double d = ulp_dist(got, want);
            if (d > worst[op - CT_UN_SINH]) worst[op - CT_UN_SINH] = d;
            if (d > 2.0) {
                CHECK(0, "%s(%a) = %a, want %a (%g ulp)", NAMES[op - CT_UN_SINH], (double)x,
                      (double)got, (double)want, d);
                break;
            }
        }
        checks++;
        printf("  %-5s max %g ulp over the sweep (every %d-th float32)\n", NAMES[op - CT_UN_SINH], worst[op - CT_UN_SINH],
               CT_OPS_STRIDE);
    }
}

static void test_unary_edges(void) {
    const float inf = INFINITY, nan = NAN;
    /* {op, x, expected}: the values C99 Annex F (and jax) give at the domain edges */
    struct { int op; float x, want; } t[] = {
        {CT_UN_SINH, -0.0f, -0.0f}, {CT_UN_SINH, inf, inf}, {CT_UN_SINH, -inf, -inf},
        {CT_UN_SINH, 89.5f, inf}, {CT_UN_COSH, -0.0f, 1.0f}, {CT_UN_COSH, -inf, inf},
        {CT_UN_TAN, -0.0f, -0.0f}, {CT_UN_TAN, inf, nan}, {CT_UN_ASIN, 1.0f, 1.5707963705062866f},
        {CT_UN_ASIN, -1.0f, -1.5707963705062866f}, {CT_UN_ASIN, 1.0000001f, nan},
        {CT_UN_ASIN, -0.0f, -0.0f}, {CT_UN_ACOS, 1.0f, 0.0f}, {CT_UN_ACOS, -1.0f, 3.1415927410125732f},
        {CT_UN_ACOS, -1.0000001f, nan}, {CT_UN_ATAN, inf, 1.5707963705062866f},
        {CT_UN_ATAN, -inf, -1.5707963705062866f}, {CT_UN_ATAN, -0.0f, -0.0f},
        {CT_UN_ASINH, -inf, -inf}, {CT_UN_ASINH, -0.0f, -0.0f}, {CT_UN_ACOSH, 1.0f, 0.0f},
        {CT_UN_ACOSH, 0.99999994f, nan}, {CT_UN_ACOSH, inf, inf}, {CT_UN_ATANH, 1.0f, inf},
        {CT_UN_ATANH, -1.0f, -inf}, {CT_UN_ATANH, 1.0000001f, nan}, {CT_UN_ATANH, -0.0f, -0.0f},
        {CT_UN_CBRT, -8.0f, -2.0f}, {CT_UN_CBRT, -0.0f, -0.0f}, {CT_UN_CBRT, -inf, -inf},
        {CT_UN_EXP2, -inf, 0.0f}, {CT_UN_EXP2, 128.0f, inf}, {CT_UN_EXP2, -149.0f, 0x1p-149f},
        {CT_UN_EXP2, 127.0f, 0x1p127f}, {CT_UN_EXP2, 0.0f, 1.0f},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        float got = ct_unary_ext(t[i].op, t[i].x);
        int ok = t[i].want != t[i].want ? got != got : bits(got) == bits(t[i].want);
        CHECK(ok, "%s(%a) = %a, want %a", NAMES[t[i].op - CT_UN_SINH], (double)t[i].x,
              (double)got, (double)t[i].want);
    }
    for (int op = CT_UN_SINH; op <= CT_UN_EXP2; op++)
        CHECK(ct_unary_ext(op, nan) != ct_unary_ext(op, nan), "%s(NaN) is not NaN",
              NAMES[op - CT_UN_SINH]);
}

static void test_signbit(void) {
    for (uint64_t u = 0; u <= 0xffffffffull; u += 4093) {
        float x = from_bits((uint32_t)u);
        CHECK(ct_unary_ext(CT_UN_SIGNBIT, x) == (float)(u >> 31), "signbit(bits %08x)", (unsigned)u);
    }
    CHECK(ct_unary_ext(CT_UN_SIGNBIT, -0.0f) == 1.0f, "signbit(-0.0)");
    CHECK(ct_unary_ext(CT_UN_SIGNBIT, from_bits(0xffc00000u)) == 1.0f, "signbit(-NaN)");
    CHECK(ct_unary_ext(CT_UN_SIGNBIT, NAN) == 0.0f, "signbit(NaN)");
}

/* a dense set of operands for the binary kernels: every 65521st bit pattern, and edges */
static int operands(float *v, int cap) {
    int n = 0;
    for (uint64_t u = 0; u <= 0xffffffffull && n < cap; u += 65521) v[n++] = from_bits((uint32_t)u);
    const float e[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.5f, -3.0f, 1e-40f, -1e-40f, 0x1p-149f,
                       INFINITY, -INFINITY, NAN, 3.4028235e38f, 7.0f, 0.1f};
    for (size_t i = 0; i < sizeof e / sizeof e[0] && n < cap; i++) v[n++] = e[i];
    return n;
}

static void test_binary(void) {
    static float v[70000];
    const int n = operands(v, 70000);
    double worst_atan2 = 0.0;
    int bad_atan2 = 0, bad_next = 0, bad_fmod = 0;
    /* pairs: each operand with 64 others spread over the set */
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < 64; k++) {
            float a = v[i], b = v[(i * 7919 + k * 1031 + k * k) % n];
            double d = ulp_dist(ct_binary_apply(CT_BIN_ATAN2, a, b), (float)atan2((double)a, (double)b));
            if (d > worst_atan2) worst_atan2 = d;
            if (d > 2.0 && bad_atan2++ < 5) CHECK(0, "atan2(%a, %a): %g ulp", (double)a, (double)b, d);
            float nx = ct_binary_apply(CT_BIN_NEXTAFTER, a, b);
            if (bits(nx) != bits(nextafterf(a, b)) && !(nx != nx && (a != a || b != b)) &&
                bad_next++ < 5)
                CHECK(0, "nextafter(%a, %a) = %a", (double)a, (double)b, (double)nx);
            float fm = ct_binary_apply(CT_BIN_FMOD, a, b);
            float wf = (float)fmod((double)a, (double)b);  /* exact in double, then in float */
            if (!(fm != fm ? wf != wf : bits(fm) == bits(wf)) && bad_fmod++ < 5)
                CHECK(0, "fmod(%a, %a) = %a, want %a", (double)a, (double)b, (double)fm, (double)wf);
        }
    }
    checks += 3;
    printf("  atan2 max %g ulp over %d pairs\n", worst_atan2, n * 64);
    /* atan2 at the signed zeros and infinities (C99 Annex F) */
    const float pi = 3.1415927410125732f, h = 1.5707963705062866f, q = 0.78539818525314331f;
    struct { float a, b, want; } t[] = {
        {0.0f, 0.0f, 0.0f}, {-0.0f, 0.0f, -0.0f}, {0.0f, -0.0f, pi}, {-0.0f, -0.0f, -pi},
        {1.0f, 0.0f, h}, {-1.0f, -0.0f, -h}, {INFINITY, INFINITY, q}, {-INFINITY, -INFINITY, -3 * q},
        {1.0f, -INFINITY, pi}, {-1.0f, INFINITY, -0.0f},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        float got = ct_binary_apply(CT_BIN_ATAN2, t[i].a, t[i].b);
        CHECK(bits(got) == bits(t[i].want), "atan2(%a, %a) = %a", (double)t[i].a, (double)t[i].b,
              (double)got);
    }
    /* nextafter: into the subnormals, across zero, at the top, NaN */
    CHECK(bits(ct_binary_apply(CT_BIN_NEXTAFTER, 0.0f, 1.0f)) == 1u, "nextafter(0, 1)");
    CHECK(bits(ct_binary_apply(CT_BIN_NEXTAFTER, 0.0f, -1.0f)) == 0x80000001u, "nextafter(0, -1)");
    CHECK(ct_binary_apply(CT_BIN_NEXTAFTER, 1.0f, 2.0f) == 1.00000012f, "nextafter(1, 2)");
    CHECK(ct_binary_apply(CT_BIN_NEXTAFTER, INFINITY, 0.0f) == 3.4028235e38f, "nextafter(inf, 0)");
    CHECK(ct_binary_apply(CT_BIN_NEXTAFTER, 1.0f, 1.0f) == 1.0f, "nextafter(1, 1)");
    float nn = ct_binary_apply(CT_BIN_NEXTAFTER, 1.0f, NAN);
    CHECK(nn != nn, "nextafter(1, NaN)");
    /* fmod: the dividend's sign, x % 0 and inf % y NaN, x % inf = x */
    float z = ct_binary_apply(CT_BIN_FMOD, 1.0f, 0.0f);
    CHECK(z != z, "fmod(1, 0)");
    z = ct_binary_apply(CT_BIN_FMOD, INFINITY, 2.0f);
    CHECK(z != z, "fmod(inf, 2)");
    CHECK(ct_binary_apply(CT_BIN_FMOD, -5.5f, 2.0f) == -1.5f, "fmod(-5.5, 2)");
    CHECK(ct_binary_apply(CT_BIN_FMOD, 5.5f, -INFINITY) == 5.5f, "fmod(5.5, -inf)");
    CHECK(bits(ct_binary_apply(CT_BIN_FMOD, -4.0f, 2.0f)) == 0x80000000u, "fmod(-4, 2) is -0");
}

static void test_ldexp(void) {
    static float v[70000];
    const int n = operands(v, 70000);
    const float es[] = {0, 1, -1, 10, -10, 126, -126, 127, -127, 128, -149, -150, 200, -200,
                        254, -277, 400, -400, 1e6f, -1e6f, 3e9f, -3e9f};
    int bad = 0;
    for (int i = 0; i < n; i++) {
        for (size_t k = 0; k < sizeof es / sizeof es[0]; k++) {
            float a = v[i], e = es[k], got = ct_binary_apply(CT_BIN_LDEXP, a, e);
            /* a * 2^e in double is exact for |e| <= 400 (the range of double's exponent
             * covers float32 values scaled so); beyond, the result is 0 or inf already */
            double ec = e > 400 ? 400 : (e < -400 ? -400 : e);
            float want = (float)((double)a * ldexp(1.0, (int)ec));
            if (!(got != got ? want != want : bits(got) == bits(want)) && bad++ < 5)
                CHECK(0, "ldexp(%a, %g) = %a, want %a", (double)a, (double)e, (double)got, (double)want);
        }
    }
    checks++;
    float r = ct_binary_apply(CT_BIN_LDEXP, 1.0f, NAN);
    CHECK(r != r, "ldexp(1, NaN)");
    CHECK(bits(ct_binary_apply(CT_BIN_LDEXP, 1.0f, -149.0f)) == 1u, "ldexp(1, -149) is the least subnormal");
    CHECK(ct_binary_apply(CT_BIN_LDEXP, 0x1p-149f, 276.0f) == 0x1p127f, "ldexp(2^-149, 276)");
}

/* CT_BIN_PICK and the select it builds: pick(x, m) + pick(y, !m) is x or y bit for bit, over
 * the operand sweep (signed zeros, subnormals, infinities, NaNs with payloads) in both
 * branches; the +0.0 fill of CT_BIN_KEEP loses a selected -0.0, which is why PICK exists. */
static void test_pick(void) {
    static float v[70000];
    const int n = operands(v, 70000);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        const float x = v[i], y = v[(i * 7919 + 13) % n];
        for (int set = 0; set < 2; set++) {
            const float m = set ? 1.0f : 0.0f, not_m = set ? 0.0f : 1.0f;
            const float got = ct_binary_apply(CT_BIN_ADD, ct_binary_apply(CT_BIN_PICK, x, m),
                                              ct_binary_apply(CT_BIN_PICK, y, not_m));
            const float want = set ? x : y;
            /* a NaN payload may be quieted by the add; the sign and the NaN-ness are kept */
            const int ok = want != want ? (got != got && (bits(got) >> 31) == (bits(want) >> 31))
                                        : bits(got) == bits(want);
            if (!ok && bad++ < 5)
                CHECK(0, "select(%d, %a, %a) = %a", set, (double)x, (double)y, (double)got);
        }
    }
    checks++;
    CHECK(bits(ct_binary_apply(CT_BIN_PICK, 3.0f, 0.0f)) == 0x80000000u, "pick fills -0.0");
    CHECK(bits(ct_binary_apply(CT_BIN_PICK, NAN, 0.0f)) == 0x80000000u, "an unpicked NaN is -0.0");
    CHECK(ct_binary_apply(CT_BIN_PICK, 3.0f, -2.0f) == 3.0f, "any nonzero mask picks");
    CHECK(bits(ct_binary_apply(CT_BIN_ADD, ct_binary_apply(CT_BIN_KEEP, -0.0f, 1.0f),
                               ct_binary_apply(CT_BIN_KEEP, 5.0f, 0.0f))) == 0u,
          "keep + keep turns a selected -0.0 into +0.0 (the reason for pick)");
}

int main(void) {
    test_unary_sweep();
    test_unary_edges();
    test_signbit();
    test_binary();
    test_ldexp();
    test_pick();
    printf("test_ops_math: %d checks, %d failures\n", checks, failures);
    return failures != 0;
}
