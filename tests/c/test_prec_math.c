/*
 * test_prec_math.c — ct_prec_round (csrc/core/ct_prec_math.h), the TF32 / bfloat16 input
 * rounding of reduced-precision matmuls, against a reference written with double arithmetic
 * (frexp, then nearbyint in the default round-to-nearest-even mode on the value scaled to
 * the format's quantum, which never falls below the format's denormal quantum).
 *
 * Inputs: every sign and exponent (NaNs, infs and denormals included) x every kept
 * mantissa (TF32: 1024, bfloat16: 128) x dropped bits that sit at the ties and next to
 * them, plus random ones: 8.4 M (TF32) and 1 M (bfloat16) cases.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "ct_prec_math.h"

static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static float reference(float x, int mantissa) {
    if (x == 0.0f || isinf(x) || isnan(x)) return x;
    int e;
    frexp((double)x, &e); /* 2^(e-1) <= |x| < 2^e */
    int q = e - 1 - mantissa;
    if (q < -126 - mantissa) q = -126 - mantissa;
    double r = ldexp(nearbyint(ldexp((double)x, -q)), q);
    if (fabs(r) >= 0x1p128) return copysignf(INFINITY, x);
    return (float)r;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

static void sweep(int prec, const char *name) {
    const int drop = ct_prec_drop_bits(prec), mantissa = 23 - drop;
    const uint32_t low = (1u << drop) - 1u, half = 1u << (drop - 1);
    const uint32_t tails[8] = {0, 1, half - 1, half, half + 1, low - 1, low, half >> 1};
    long cases = 0;
    for (uint32_t se = 0; se < 512; se++)
        for (uint32_t kept = 0; kept < (1u << mantissa); kept++)
            for (int t = 0; t < 16; t++) {
                uint32_t tail = t < 8 ? tails[t] : next32() & low;
                uint32_t u = (se << 23) | (kept << drop) | tail;
                float x = u2f(u), got = ct_prec_round(x, drop), want = reference(x, mantissa);
                cases++;
                if (isnan(x)) {
                    uint32_t g = f2u(got);
                    CHECK(isnan(got) && (g & low) == 0 && (g & 0x00400000u) && (g >> 31) == (u >> 31),
                          "%s: NaN 0x%08x -> 0x%08x", name, u, g);
                } else {
                    CHECK(f2u(got) == f2u(want), "%s: 0x%08x -> 0x%08x, want 0x%08x", name, u,
                          f2u(got), f2u(want));
                }
            }
    printf("test_prec_math: %s, %ld cases\n", name, cases);
}

int main(void) {
    CHECK(ct_prec_drop_bits(CT_PREC_F32) == 0 && ct_prec_drop_bits(CT_PREC_TF32) == 13 &&
              ct_prec_drop_bits(CT_PREC_BF16) == 16, "drop bits");
    CHECK(f2u(ct_prec_round(u2f(0x7f800001u), 0)) == 0x7f800001u, "float32 keeps the bits");
    sweep(CT_PREC_TF32, "tensorfloat32");
    sweep(CT_PREC_BF16, "bfloat16");
    printf("test_prec_math: %d checks, %d failures\n", checks, failures);
    return failures != 0;
}
