/*
 * ct_convert_math.h — element conversions between the stored dtypes (ct_dtype.h),
 * jax's `convert_element_type` / `Array.astype` semantics, shared by C and CUDA: the
 * CPU backend's loops, the CUDA kernel, and the mock GPU backend evaluate the same code.
 *
 *   float -> float:  round to nearest even (float16: overflow to inf, subnormals kept;
 *                    bfloat16: ct_rm_f32_to_bf16); widening is exact.
 *   float -> int:    (int32, uint32, int16, uint16, int8, uint8) truncation toward zero,
 *                    saturating at the type's range; NaN -> 0, -inf -> the minimum, +inf ->
 *                    the maximum (unsigned: every negative -> 0). What jax 0.10 on CPU gives.
 *   int -> int:      two's complement wrap (int32 <-> uint32 reinterpret the 32 bits;
 *                    int32 300 -> uint8 44, uint8 200 -> int8 -56).
 *   int -> float:    round to nearest even, once: an int that float32 cannot hold is first
 *                    rounded to odd at float32's 24 bits, so the final rounding to a 16-bit
 *                    float is the correctly rounded one (no double rounding).
 *   any -> bool:     x != 0 (NaN is true, -0.0 false); bool -> any: 0 or 1.
 */
#ifndef CT_CONVERT_MATH_H
#define CT_CONVERT_MATH_H

#include <stdint.h>

#include "ct_random_math.h" /* ct_rm_f32_to_f16 / ..._bf16 and back, CT_RM */

CT_RM int ct_cv_is_float(int dt) { return dt == CT_F32 || dt == CT_F16 || dt == CT_BF16; }

/* A float element as float32 (exact). */
CT_RM float ct_cv_load_f(int dt, const void *x, int64_t i) {
    if (dt == CT_F32) return ((const float *)x)[i];
    if (dt == CT_F16) return ct_rm_f16_to_f32(((const uint16_t *)x)[i]);
    return ct_rm_bf16_to_f32(((const uint16_t *)x)[i]);
}

/* Whether dt is a signed integer dtype (int32, int8, int16). */
CT_RM int ct_cv_is_signed(int dt) { return dt == CT_I32 || dt == CT_I8 || dt == CT_I16; }

/* The smallest and largest value of an integer dtype (bool: 0 and 1). */
CT_RM int64_t ct_cv_int_min(int dt) {
    switch (dt) {
    case CT_I32: return -2147483647 - 1;
    case CT_I16: return -32768;
    case CT_I8: return -128;
    default: return 0;
    }
}

CT_RM int64_t ct_cv_int_max(int dt) {
    switch (dt) {
    case CT_I32: return 2147483647;
    case CT_U32: return 4294967295u;
    case CT_I16: return 32767;
    case CT_U16: return 65535;
    case CT_I8: return 127;
    case CT_U8: return 255;
    default: return 1;
    }
}

/* An integer or bool element as int64 (exact: signed dtypes sign-extended, unsigned ones
 * zero-extended, bool 0 or 1). */
CT_RM int64_t ct_cv_load_i(int dt, const void *x, int64_t i) {
    switch (dt) {
    case CT_I32: return ((const int32_t *)x)[i];
    case CT_U32: return ((const uint32_t *)x)[i];
    case CT_I16: return ((const int16_t *)x)[i];
    case CT_U16: return ((const uint16_t *)x)[i];
    case CT_I8: return ((const int8_t *)x)[i];
    case CT_U8: return ((const uint8_t *)x)[i];
    default: return ((const uint8_t *)x)[i] != 0;
    }
}

/* An int64 of at most 33 significant bits as float32, rounded to odd when inexact (the
 * low bits that do not fit are or-ed into the last kept one), so a later rounding to
 * a narrower float is correct; exact ints (|v| <= 2^24) are returned as they are. */
CT_RM float ct_cv_i2f_odd(int64_t v) {
    uint64_t m = v < 0 ? (uint64_t)(-v) : (uint64_t)v;
    if (m <= (1u << 24)) return (float)v;
    int shift = 0;
    while ((m >> shift) >= (1u << 24)) shift++;
    uint64_t kept = m >> shift;
    if (m & ((1ull << shift) - 1u)) kept |= 1u;
    float f = (float)kept * (float)(1ull << shift); /* exact: 24 bits times a power of two */
    return v < 0 ? -f : f;
}

/* A float as a saturated integer of `dt` (an integer dtype), truncated toward zero: NaN
 * is 0, values at or beyond the range give its end. The bounds are exact floats (0, a
 * negative power of two, a power of two past the maximum). */
CT_RM int64_t ct_cv_f2i(int dt, float v) {
    if (v != v) return 0;
    const int64_t lo = ct_cv_int_min(dt), hi = ct_cv_int_max(dt);
    if (v >= (float)(hi + 1)) return hi;
    if (v <= (float)lo) return lo;
    return (int64_t)v; /* in (lo, hi + 1): truncates to [lo, hi] */
}

CT_RM void ct_cv_store_f(int dt, void *y, int64_t i, float v) {
    if (dt == CT_F32) ((float *)y)[i] = v;
    else if (dt == CT_F16) ((uint16_t *)y)[i] = ct_rm_f32_to_f16(v);
    else ((uint16_t *)y)[i] = ct_rm_f32_to_bf16(v);
}

/* v wrapped (two's complement) to an integer dtype and stored; bool stores v != 0. */
CT_RM void ct_cv_store_i(int dt, void *y, int64_t i, int64_t v) {
    const uint64_t u = (uint64_t)v;
    switch (dt) {
    case CT_I32: ((int32_t *)y)[i] = (int32_t)(uint32_t)u; break;
    case CT_U32: ((uint32_t *)y)[i] = (uint32_t)u; break;
    case CT_I16: ((int16_t *)y)[i] = (int16_t)(uint16_t)u; break;
    case CT_U16: ((uint16_t *)y)[i] = (uint16_t)u; break;
    case CT_I8: ((int8_t *)y)[i] = (int8_t)(uint8_t)u; break;
    case CT_U8: ((uint8_t *)y)[i] = (uint8_t)u; break;
    default: ((uint8_t *)y)[i] = v != 0; break;
    }
}

/* y[i] = x[i] converted from dtype `sdt` to dtype `ddt` (both valid ct_dtype codes). */
CT_RM void ct_cv_elem(int sdt, const void *x, int ddt, void *y, int64_t i) {
    if (ct_cv_is_float(sdt)) {
        float v = ct_cv_load_f(sdt, x, i);
        if (ct_cv_is_float(ddt)) ct_cv_store_f(ddt, y, i, v);
        else if (ddt == CT_BOOL) ((uint8_t *)y)[i] = v != 0.0f; /* NaN != 0 */
        else ct_cv_store_i(ddt, y, i, ct_cv_f2i(ddt, v));
    } else {
        int64_t v = ct_cv_load_i(sdt, x, i);
        if (ddt == CT_F32) ((float *)y)[i] = (float)v; /* one rounding, to nearest even */
        else if (ct_cv_is_float(ddt)) ct_cv_store_f(ddt, y, i, ct_cv_i2f_odd(v));
        else ct_cv_store_i(ddt, y, i, v);
    }
}

#endif /* CT_CONVERT_MATH_H */
