/*
 * cpu_vmath.h — vectorisable float32 sin, cos, exp and tanh for the CPU op kernels.
 *
 * glibc's scalar sinf/expf stop gcc from vectorising a loop; these branch-free
 * versions (Cephes-style range reduction and minimax polynomials, as in the
 * classic single-precision Cephes routines) compile to SIMD inside
 * `omp simd` loops. Accuracy: within 2 ulp of the correctly rounded result
 * for |x| < 8192 (sin/cos; larger arguments are recomputed with libm by the
 * caller, see CT_VSIN_MAX), and for exp over its whole float range.
 */
#ifndef CT_CPU_VMATH_H
#define CT_CPU_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define CT_VSIN_MAX 8192.0f

typedef union {
    float f;
    uint32_t u;
} ct_f32_bits;

static inline float ct_bits_to_float(uint32_t u) {
    ct_f32_bits v;
    v.u = u;
    return v.f;
}

static inline uint32_t ct_float_to_bits(float f) {
    ct_f32_bits v;
    v.f = f;
    return v.u;
}

/* sin (want_cos = 0) or cos (want_cos = 1) of x, |x| < CT_VSIN_MAX: x = j*pi/2 + r with
 * pi/2 in three parts (Cody-Waite), then the quadrant picks +-sin(r) or +-cos(r). */
static inline float ct_vsincos(float x, int want_cos) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23 */
    float jf = (x * 0.636619772367581343f + round_magic) - round_magic;
    float r = ((x - jf * 1.5703125f) - jf * 4.837512969970703125e-4f) - jf * 7.549789954891882e-8f;
    int32_t j = (int32_t)jf + want_cos;
    float z = r * r;
    /* sin(r) and cos(r) on [-pi/4, pi/4] (Cephes sinf/cosf coefficients) */
    float s = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
    float c = ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z
              - 0.5f * z + 1.0f;
    uint32_t odd_mask = 0u - ((uint32_t)j & 1u); /* all ones in odd quadrants: cos(r) */
    uint32_t sb = ct_float_to_bits(s), cb = ct_float_to_bits(c);
    uint32_t bits = sb ^ ((sb ^ cb) & odd_mask);
    bits ^= ((uint32_t)j & 2u) << 30; /* quadrants 2 and 3 flip the sign */
    return ct_bits_to_float(bits);
}

/* exp(x) for x in [-103.97, 88.72] (no special cases: callers clamp). */
static inline float ct_vexp_core(float x) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23 */
    float n = (x * 1.44269504088896341f + round_magic) - round_magic;
    /* r = x - n*ln2 in two parts (Cody-Waite) */
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float z = r * r;
    float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    float e = p * z + r + 1.0f;
    /* scale by 2^n in two steps so that subnormal results stay representable */
    int32_t ni = (int32_t)n;
    int32_t n1 = ni >> 1, n2 = ni - n1;
    return e * ct_bits_to_float((uint32_t)(n1 + 127) << 23) *
           ct_bits_to_float((uint32_t)(n2 + 127) << 23);
}

/* exp(x) for any float x (overflow to inf, underflow to 0, NaN kept). */
static inline float ct_vexp(float x) {
    const float hi = 88.7228317f, lo = -103.972084f;
    /* (comparisons, not fminf/fmaxf, which gcc does not vectorise: the same values for every
     * x but NaN, whose result is decided below) */
    float xc = x < lo ? lo : (x > hi ? hi : x);
    float out = ct_vexp_core(xc);
    out = x > hi ? INFINITY : out;
    out = x < lo ? 0.0f : out;
    return x != x ? x : out;
}

/* tanh(x): odd polynomial near 0 (Cephes tanhf), 1 - 2/(exp(2|x|)+1) elsewhere. NaN stays
 * NaN (fminf would clamp it to 10 and give 1) and -0 stays -0, as tanhf. */
static inline float ct_vtanh(float x) {
    float ax = fabsf(x);
    float z = x * x;
    float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                    1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    float e = ct_vexp_core(2.0f * (ax < 10.0f ? ax : 10.0f)); /* (fminf: 10 for NaN too) */
    float big = 1.0f - 2.0f / (e + 1.0f);
    big = x < 0.0f ? -big : big;
    float out = ax < 0.625f ? copysignf(small, x) : big;
    return x != x ? x : out;
}

#endif /* CT_CPU_VMATH_H */
