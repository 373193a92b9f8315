/*
 * ct_ops_math.h — per-element pieces of the array ops shared by the CPU and
 * CUDA kernels (csrc/backend/cpu/cpu_ops.c, csrc/backend/cuda/cuda_ops.cu):
 * the binary operators, the sign and the unary ops of ABI 6 (log1p, expm1, erf
 * and the roundings) and ABI 7 (sinh .. cbrt, exp2, the sign bit; atan2, nextafter,
 * fmod and ldexp), the tanh-approximated GELU given tanh of its inner
 * argument (each backend brings its own tanh), and the offsets of a
 * row-major element index in two strided layouts.
 *
 * The libm calls here (powf, log1pf, expm1f, erff, erfcf, and ABI 7's sinhf .. exp2f,
 * atan2f) resolve to each backend's
 * own: glibc on CPUs, CUDA's device math on GPUs, not bit-identical to each other.
 * CUDA documents log1pf and expm1f within 1 ulp, erff 2, erfcf and powf 4 (glibc's
 * are within 2 ulp on the tests' points), so CPU and GPU may differ by the two bounds
 * added. ct_pow gives jax's exact results for the exponents 0, 1, 2 and -1 on both.
 * floorf, ceilf, rintf, truncf, nextafterf, fmodf and ldexpf are exact everywhere, and ct_unary_ext returns a
 * NaN input to them quietened (not the backend's own NaN: CUDA's is 0x7fffffff), so
 * the roundings give the same bits on every backend.
 */
#ifndef CT_OPS_MATH_H
#define CT_OPS_MATH_H

#include <math.h>
#include <stdint.h>

#include "ct_hd.h"
#include "ct_ops.h"

/* A NaN input quietened, its sign and payload kept (what x86's floorf returns for a NaN);
 * where an op returns this instead of the backend's NaN, CPU and GPU give the same bits.
 * The bit cast goes through a union, valid in C and in CUDA device code. */
CT_HD static inline float ct_quiet_nan(float v) {
    union { float f; uint32_t u; } w;
    w.f = v;
    w.u |= 0x00400000u;
    return w.f;
}

/* x ** p (jnp.power of float32s: CT_BIN_POW and CT_UN_POW). For a constant exponent under
 * jit, XLA's algebraic simplifier rewrites pow(x, 0) to 1 (NaN ** 0 = 1), pow(x, 1) to x,
 * pow(x, 2) to x * x and pow(x, -1) to 1 / x; those exponents give these exact results
 * here on every backend (CUDA's powf, documented within 4 ulp, is not always x * x;
 * glibc's, correctly rounded, already gave them). Other exponents go to the backend's
 * powf. (Eager jax, and jit with an array exponent, run XLA's own pow, which can be an
 * ulp off even for p = 2.) */
CT_HD static inline float ct_pow(float x, float p) {
    if (p == 0.0f) return 1.0f;
    if (p == 1.0f) return x;
    if (p == 2.0f) return x * x;
    if (p == -1.0f) return 1.0f / x;
    return powf(x, p);
}

/* a * 2 ** b (jnp.ldexp: b holds an integer, converted exactly to float32 by the caller for
 * |b| < 2^24). ldexpf rounds once (subnormal results included) on every backend; clamping b
 * to +-512 changes no result (any finite nonzero a is 0 or inf by then) and keeps the int
 * conversion defined; a NaN b (not integral) gives NaN. */
CT_HD static inline float ct_ldexp(float a, float b) {
    if (b != b) return __builtin_nanf("");
    float c = b > 512.0f ? 512.0f : (b < -512.0f ? -512.0f : b);
    return ldexpf(a, (int)c);
}

/* 1.0 where the sign bit of v is set (-0.0 and a NaN with the sign bit included), else 0.0:
 * jnp.signbit's bit test, exact everywhere. */
CT_HD static inline float ct_signbit(float v) {
    union { float f; uint32_t u; } w;
    w.f = v;
    return (w.u >> 31) ? 1.0f : 0.0f;
}

CT_HD static inline float ct_binary_apply(int op, float a, float b) {
    switch (op) {
    case CT_BIN_ADD: return a + b;
    case CT_BIN_SUB: return a - b;
    case CT_BIN_MUL: return a * b;
    case CT_BIN_DIV: return a / b;
    case CT_BIN_MAX: return (a > b || a != a) ? a : b; /* a NaN on either side wins (jnp) */
    case CT_BIN_MIN: return (a < b || a != a) ? a : b;
    case CT_BIN_GT: return a > b ? 1.0f : 0.0f;
    case CT_BIN_POW: return ct_pow(a, b);
    case CT_BIN_ATAN2: return atan2f(a, b);
    case CT_BIN_NEXTAFTER: return nextafterf(a, b);
    case CT_BIN_FMOD: return fmodf(a, b);
    case CT_BIN_LDEXP: return ct_ldexp(a, b);
    case CT_BIN_PICK: return b != 0.0f ? a : -0.0f;
    default: return b != 0.0f ? a : 0.0f; /* CT_BIN_KEEP: a where the mask b is set, else 0 */
    }
}

/* The reductions' combine (CT_RED_*): a running value and the next element. The max keeps
 * a NaN from either side, as jnp.max does. */
CT_HD static inline float ct_red_combine(int op, float acc, float x) {
    if (op == CT_RED_SUM) return acc + x;
    return (acc > x || acc != acc) ? acc : x;
}

/* The reductions' identity: 0 for the sum, -inf for the max. */
CT_HD static inline float ct_red_identity(int op) { return op == CT_RED_SUM ? 0.0f : -__builtin_inff(); }

/* jnp.sign: -1, 0 or 1, keeping the sign of a zero (sign(-0.0) = -0.0) and NaN. */
CT_HD static inline float ct_sign(float v) { return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : v); }

/* The unary ops appended in ABI 6 and 7 (CT_UN_LOG1P .. CT_UN_SIGNBIT); any other op gives NaN
 * (the core has rejected unknown codes before a kernel runs). rintf rounds halves to
 * even in the default rounding mode, which nothing here changes. The roundings return a
 * NaN input quietened (ct_quiet_nan), the same bits on every backend. */
CT_HD static inline float ct_unary_ext(int op, float v) {
    if (v != v && op >= CT_UN_FLOOR && op <= CT_UN_TRUNC) return ct_quiet_nan(v);
    switch (op) {
    case CT_UN_LOG1P: return log1pf(v);
    case CT_UN_EXPM1: return expm1f(v);
    case CT_UN_ERF: return erff(v);
    case CT_UN_ERFC: return erfcf(v);
    case CT_UN_FLOOR: return floorf(v);
    case CT_UN_CEIL: return ceilf(v);
    case CT_UN_ROUND: return rintf(v);
    case CT_UN_TRUNC: return truncf(v);
    case CT_UN_SINH: return sinhf(v);
    case CT_UN_COSH: return coshf(v);
    case CT_UN_TAN: return tanf(v);
    case CT_UN_ASIN: return asinf(v);
    case CT_UN_ACOS: return acosf(v);
    case CT_UN_ATAN: return atanf(v);
    case CT_UN_ASINH: return asinhf(v);
    case CT_UN_ACOSH: return acoshf(v);
    case CT_UN_ATANH: return atanhf(v);
    case CT_UN_CBRT: return cbrtf(v);
    case CT_UN_EXP2: return exp2f(v);
    case CT_UN_SIGNBIT: return ct_signbit(v);
    default: return __builtin_nanf("");
    }
}

/* GELU, tanh approximation: gelu(x) = 0.5 x (1 + tanh(u)), u = ct_gelu_inner(x). */
CT_HD static inline float ct_gelu_inner(float x) {
    return 0.7978845608028654f * (x + 0.044715f * x * x * x); /* sqrt(2/pi) (x + c x^3) */
}

CT_HD static inline float ct_gelu_from_tanh(float x, float t) { return 0.5f * x * (1.0f + t); }

/* d gelu / dx given t = tanh(ct_gelu_inner(x)). */
CT_HD static inline float ct_gelu_grad_from_tanh(float x, float t) {
    float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

/* Offsets (in the strides' unit) of row-major element `i` of `shape` in two layouts. */
CT_HD static inline void ct_offsets2(int64_t i, int ndim, const int64_t *shape,
                                     const int64_t *s1, const int64_t *s2, int64_t *o1,
                                     int64_t *o2) {
    int64_t rem = i, a = 0, b = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        int64_t c = rem % shape[d];
        rem /= shape[d];
        a += c * s1[d];
        b += c * s2[d];
    }
    *o1 = a;
    *o2 = b;
}

#endif /* CT_OPS_MATH_H */
