/*
 * ct_ewise_math.h — the typed elementwise ops (ct_op_ewise) and the integer reductions
 * (ct_op_reduce_typed) element by element, shared by C and CUDA: the CPU backend's loops,
 * the CUDA kernels and the mock GPU backend evaluate this code, so every backend gives the
 * same bits. The semantics are jax's (jax.numpy on XLA, measured with jax 0.10 on CPU):
 *
 *   comparisons      any dtype -> bool; floats compare as float32 (exact for the 16-bit
 *                    floats), NaN compares false except `!=`; ints compare exactly. A float32
 *                    or bfloat16 subnormal counts as zero (ct_ew_daz: XLA's CPU flushes).
 *   add/sub/mul      ints wrap (two's complement); floats in float32, rounded once to the
 *                    dtype; bool: add is or, mul is and (sub is refused above this layer).
 *   max/min          a NaN on either side wins (jnp.maximum); ints exact; bool or/and.
 *   floor_divide     ints: XLA's division (x / 0 = -1 signed, all ones unsigned;
 *                    INT_MIN / -1 = INT_MIN, for int8 and int16 too) then jnp's floor correction
 *                    (q - 1 where sign(x) != sign(y) and rem(x, y) != 0): 5 // 0 = -2,
 *                    0 // 0 = -1. Floats: jnp's _float_divmod (fmod, then round).
 *   remainder        ints: jnp.remainder replaces a zero divisor by 1, so x % 0 = 0; the
 *                    result has the divisor's sign. Floats: fmod plus the divisor where
 *                    the signs differ; x % 0 = NaN, 5.5 % inf = 5.5, 3 % -inf = -inf.
 *   and/or/xor/not   ints bitwise, bool logical (not: ~x on ints, !x on bool).
 *   shifts           ints only: a shift count outside [0, width) gives 0 (left, logical
 *                    right) or the sign fill (arithmetic right shift of the signed ints).
 *   narrow ints      uint8, int8, int16, uint16 are loaded into int64 registers, computed as
 *                    above and wrapped to their width when stored: uint8 200 + 100 = 44.
 *   neg/abs          ints wrap: -INT_MIN = abs(INT_MIN) = INT_MIN; floats flip / clear
 *                    the sign bit.
 *   isnan/isinf/isfinite  floats only -> bool.
 */
#ifndef CT_EWISE_MATH_H
#define CT_EWISE_MATH_H

#include <stdint.h>

#include "ct_convert_math.h" /* ct_cv_load_* / ct_cv_store_* and CT_RM */
#include "ct_layout.h"       /* CT_MAX_NDIM */
#include "ct_ops.h"          /* CT_EW_*, CT_RED_* */
#include "ct_ops_math.h"     /* ct_sign (jnp.sign) */

#ifdef __CUDACC__
#define CT_EW_FMOD fmodf
#define CT_EW_ROUND roundf
#else
#include <math.h>
#define CT_EW_FMOD fmodf
#define CT_EW_ROUND roundf
#endif

/* Whether op's result is bool whatever the operands' dtype. */
CT_RM int ct_ew_bool_out(int op) {
    return op <= CT_EW_GE || op == CT_EW_ISNAN || op == CT_EW_ISINF || op == CT_EW_ISFINITE;
}

/* Whether op reads only its first operand. */
CT_RM int ct_ew_is_unary(int op) { return op >= CT_EW_NOT; }

/* The six comparisons on two values of one C type (float for the float dtypes, int64_t
 * for the integer ones and bool): one table for both. */
#define CT_EW_CMP(op, a, b)                                                                  \
    ((op) == CT_EW_EQ ? (a) == (b) : (op) == CT_EW_NE ? (a) != (b) : (op) == CT_EW_LT ? (a) < (b) \
     : (op) == CT_EW_LE ? (a) <= (b) : (op) == CT_EW_GT ? (a) > (b) : (a) >= (b))

CT_RM int ct_ew_cmp_f(int op, float a, float b) { return CT_EW_CMP(op, a, b); }

CT_RM int ct_ew_cmp_i(int op, int64_t a, int64_t b) { return CT_EW_CMP(op, a, b); }

/* XLA's CPU backend runs with denormals-are-zero and flush-to-zero: jax compares a float32
 * (or bfloat16) subnormal as a zero of its sign (1e-40 == 0.0 is true), and a subnormal
 * result is a zero. Applied to the float operands and results here, so every backend
 * agrees with jax (float16 subnormals are normal float32 numbers once loaded: kept). */
CT_RM float ct_ew_daz(float v) {
    union { float f; uint32_t u; } w;
    w.f = v;
    if ((w.u & 0x7f800000u) == 0u) w.u &= 0x80000000u;
    return w.f;
}

/* v rounded to dtype dt (nearest even) and back: how jax's 16-bit float ops round each
 * step of a composite (float32 values pass unchanged). */
CT_RM float ct_ew_in(int dt, float v) {
    if (dt == CT_F32) return v;
    uint16_t h;
    ct_cv_store_f(dt, &h, 0, v);
    return ct_cv_load_f(dt, &h, 0);
}

/* jnp.floor_divide of floats (jax's _float_divmod): mod = rem(a, b) (exact), then
 * (a - mod) / b, the -1 where the signs of mod and b differ and the rounding, each step
 * in the operands' dtype `dt` as jax computes a 16-bit floor_divide. */
CT_RM float ct_ew_floordiv_f(int dt, float a, float b) {
    float mod = CT_EW_FMOD(a, b);
    float div = ct_ew_in(dt, ct_ew_in(dt, b == 0.0f ? a : a - mod) / b);
    float sb = ct_sign(b), sm = ct_sign(mod);
    if (mod != 0.0f && sb != sm) div = ct_ew_in(dt, div - 1.0f); /* NaN signs differ */
    return CT_EW_ROUND(div);                        /* lax.round: half away from zero */
}

/* jnp.remainder of floats, as XLA's CPU computes it: the truncated remainder of the
 * dividend as it is (a subnormal one kept: 1e-40 % 3 is 1e-40) by the divisor with
 * subnormals flushed (3 % 1e-40 is NaN), then the divisor added where the flushed
 * remainder and the divisor have different signs. */
CT_RM float ct_ew_rem_f(float a, float b) {
    float t = CT_EW_FMOD(a, b), tz = ct_ew_daz(t);
    return (tz != 0.0f && ((tz < 0.0f) != (b < 0.0f))) ? t + b : t;
}

CT_RM float ct_ew_flip_sign(float v, int clear) {
    union { float f; uint32_t u; } w;
    w.f = v;
    w.u = clear ? (w.u & 0x7fffffffu) : (w.u ^ 0x80000000u);
    return w.f;
}


/* A float op on float32 values (compute type of the three float dtypes). */
CT_RM float ct_ew_arith_f(int op, float a, float b) {
    switch (op) {
    case CT_EW_ADD: return a + b;
    case CT_EW_SUB: return a - b;
    case CT_EW_MUL: return a * b;
    case CT_EW_MAX: return (a > b || a != a) ? a : b;
    case CT_EW_MIN: return (a < b || a != a) ? a : b;
    case CT_EW_FLOORDIV: return ct_ew_floordiv_f(CT_F32, a, b);
    case CT_EW_REM: return ct_ew_rem_f(a, b);
    case CT_EW_NEG: return ct_ew_flip_sign(a, 0);
    default: return ct_ew_flip_sign(a, 1); /* CT_EW_ABS */
    }
}

CT_RM int64_t ct_ew_sgn_i(int64_t v) { return v > 0 ? 1 : (v < 0 ? -1 : 0); }

/* An integer op on values loaded exactly (signed dtypes sign-extended, unsigned ones and
 * bool zero-extended); the result is wrapped to the dtype when stored, so one int64
 * computation serves every width: a shift count at or past the dtype's width (and below
 * 32) shifts every bit out before the store keeps the low bits. `sgn`: a signed dtype. */
CT_RM int64_t ct_ew_arith_i(int op, int sgn, int64_t a, int64_t b) {
    switch (op) {
    case CT_EW_ADD: return (int64_t)((uint64_t)a + (uint64_t)b);
    case CT_EW_SUB: return (int64_t)((uint64_t)a - (uint64_t)b);
    case CT_EW_MUL: return (int64_t)((uint64_t)a * (uint64_t)b);
    case CT_EW_MAX: return a > b ? a : b;
    case CT_EW_MIN: return a < b ? a : b;
    case CT_EW_FLOORDIV: {
        if (!sgn) return b == 0 ? (int64_t)0xffffffffu : a / b; /* stored: all ones */
        int64_t q = b == 0 ? -1 : a / b;        /* INT_MIN / -1 = 2^31: wraps to INT_MIN */
        int64_t r = b == 0 ? a : a % b;
        return (ct_ew_sgn_i(a) != ct_ew_sgn_i(b) && r != 0) ? q - 1 : q;
    }
    case CT_EW_REM: {
        if (b == 0) return 0;                   /* jnp.remainder divides by 1 instead */
        int64_t t = a % b;
        return (t != 0 && ((t < 0) != (b < 0))) ? t + b : t;
    }
    case CT_EW_AND: return a & b;
    case CT_EW_OR: return a | b;
    case CT_EW_XOR: return a ^ b;
    case CT_EW_SHL: {
        uint32_t s = (uint32_t)(uint64_t)b;
        return s >= 32u ? 0 : (int64_t)(((uint64_t)a << s) & 0xffffffffu);
    }
    case CT_EW_SHR: {
        uint32_t s = (uint32_t)(uint64_t)b;
        if (sgn) {
            if (s >= 32u) return a < 0 ? -1 : 0;
            return a < 0 ? ~((~a) >> s) : a >> s; /* arithmetic, without signed >> */
        }
        return s >= 32u ? 0 : a >> s;
    }
    case CT_EW_NOT: return ~a;                  /* bool is handled by the caller */
    case CT_EW_NEG: return (int64_t)(0u - (uint64_t)a);
    default: return a < 0 ? (int64_t)(0u - (uint64_t)a) : a; /* CT_EW_ABS */
    }
}

/* out[o] = op(a[ia], b[ib]) for operands of dtype `dt` (b unread by unary ops); out has
 * dtype bool for comparisons and the is* tests, else `dt`. op and dt were validated. */
CT_RM void ct_ew_elem(int op, int dt, void *out, int64_t o, const void *a, int64_t ia,
                      const void *b, int64_t ib) {
    if (ct_cv_is_float(dt)) {
        float x = ct_cv_load_f(dt, a, ia);
        if (op == CT_EW_ISNAN || op == CT_EW_ISINF || op == CT_EW_ISFINITE) {
            int inf = x == __builtin_inff() || x == -__builtin_inff();
            int r = op == CT_EW_ISNAN ? x != x : (op == CT_EW_ISINF ? inf : (x == x && !inf));
            ((uint8_t *)out)[o] = (uint8_t)r;
            return;
        }
        float y = ct_ew_is_unary(op) ? x : ct_ew_daz(ct_cv_load_f(dt, b, ib));
        if (op == CT_EW_REM) { /* the dividend and the result keep their subnormals */
            ct_cv_store_f(dt, out, o, ct_ew_rem_f(x, y));
            return;
        }
        x = ct_ew_daz(x);
        if (ct_ew_is_unary(op)) y = x;
        if (ct_ew_bool_out(op)) ((uint8_t *)out)[o] = (uint8_t)ct_ew_cmp_f(op, x, y);
        else if (op == CT_EW_FLOORDIV) ct_cv_store_f(dt, out, o, ct_ew_daz(ct_ew_floordiv_f(dt, x, y)));
        else ct_cv_store_f(dt, out, o, ct_ew_daz(ct_ew_arith_f(op, x, y)));
        return;
    }
    int64_t x = ct_cv_load_i(dt, a, ia);
    int64_t y = ct_ew_is_unary(op) ? x : ct_cv_load_i(dt, b, ib);
    if (ct_ew_bool_out(op)) {
        ((uint8_t *)out)[o] = (uint8_t)ct_ew_cmp_i(op, x, y);
    } else if (dt == CT_BOOL && op == CT_EW_NOT) {
        ((uint8_t *)out)[o] = (uint8_t)(x == 0);
    } else {
        ct_cv_store_i(dt, out, o, ct_ew_arith_i(op, ct_cv_is_signed(dt), x, y));
    }
}

// --- integer reductions -------------------------------------------------------------

/* The index plan of a reduction of a dense block of `shape` over the dims in `axes`: the
 * kept dims (in order: the output's row-major order) and the reduced dims, with strides. */
typedef struct {
    int nk, nr;
    int64_t nred;
    int64_t kdim[CT_MAX_NDIM], kstr[CT_MAX_NDIM], rdim[CT_MAX_NDIM], rstr[CT_MAX_NDIM];
} ct_ew_red_plan;

CT_RM void ct_ew_red_plan_init(ct_ew_red_plan *p, int ndim, const int64_t *shape, uint32_t axes) {
    int64_t s = 1, st[CT_MAX_NDIM];
    for (int d = ndim - 1; d >= 0; d--) {
        st[d] = s;
        s *= shape[d];
    }
    p->nk = p->nr = 0;
    p->nred = 1;
    for (int d = 0; d < ndim; d++) {
        if (axes & (1u << d)) {
            p->rdim[p->nr] = shape[d];
            p->rstr[p->nr++] = st[d];
            p->nred *= shape[d];
        } else {
            p->kdim[p->nk] = shape[d];
            p->kstr[p->nk++] = st[d];
        }
    }
}

CT_RM int64_t ct_ew_unravel(int64_t t, int n, const int64_t *dims, const int64_t *strides) {
    int64_t off = 0;
    for (int j = n - 1; j >= 0; j--) {
        off += (t % dims[j]) * strides[j];
        t /= dims[j];
    }
    return off;
}

/* The reduced element t of output q (base: ct_ew_unravel of q over the kept dims). */
CT_RM int64_t ct_ew_red_load(int dt, const ct_ew_red_plan *p, const void *x, int64_t base,
                             int64_t t) {
    return ct_cv_load_i(dt, x, base + ct_ew_unravel(t, p->nr, p->rdim, p->rstr));
}

/* The reduction's combine and identity: a wrapping uint64 sum, or the maximum. */
CT_RM int64_t ct_ew_red_identity(int op, int dt) {
    return op == CT_RED_SUM ? 0 : ct_cv_int_min(dt);
}

CT_RM int64_t ct_ew_red_combine(int op, int64_t acc, int64_t v) {
    if (op == CT_RED_SUM) return (int64_t)((uint64_t)acc + (uint64_t)v);
    return v > acc ? v : acc;
}

/* out[q] = the sum (wrapping) or the maximum of x over the reduced elements of output q;
 * x and out have dtype `dt` (an integer dtype or bool). An empty sum is 0; an empty maximum
 * is the dtype's minimum (the caller refuses empty maxima, as jnp.max does). */
CT_RM void ct_ew_reduce_one(int op, int dt, const ct_ew_red_plan *p, const void *x, void *out,
                            int64_t q) {
    int64_t base = ct_ew_unravel(q, p->nk, p->kdim, p->kstr);
    int64_t acc = ct_ew_red_identity(op, dt);
    for (int64_t t = 0; t < p->nred; t++)
        acc = ct_ew_red_combine(op, acc, ct_ew_red_load(dt, p, x, base, t));
    ct_cv_store_i(dt, out, q, acc);
}

#endif /* CT_EWISE_MATH_H */
