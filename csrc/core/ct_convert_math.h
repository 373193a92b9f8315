/*
 * ct_convert_math.h — element conversions between the stored dtypes (ct_dtype.h),
 * jax's `convert_element_type` / `Array.astype` semantics, shared by C and CUDA: the
 * CPU backend's loops, the CUDA kernel, and the mock GPU backend evaluate the same code.
 *
 *   float -> float:  round to nearest even (float16: overflow to inf, subnormals kept;
 *                    bfloat16: ct_rm_f32_to_bf16); widening is exact.
 *   float -> int32 / uint32: truncation toward zero, saturating at the type's range;
 *                    NaN -> 0, -inf -> the minimum, +inf -> the maximum (uint32: every
 *                    negative -> 0). What jax 0.10 on CPU gives.
 *   int -> int:      two's complement wrap (int32 <-> uint32 reinterpret the 32 bits).
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

/* An integer or bool element as int64 (exact). */
CT_RM int64_t ct_cv_load_i(int dt, const void *x, int64_t i) {
    if (dt == CT_I32) return ((const int32_t *)x)[i];
    if (dt == CT_U32) return ((const uint32_t *)x)[i];
    return ((const uint8_t *)x)[i] != 0;
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

/* A float as a saturated integer of `dt` (int32 / uint32), truncated toward zero. */
CT_RM int64_t ct_cv_f2i(int dt, float v) {
    if (v != v) return 0;
    if (dt == CT_I32) {
        if (v >= 2147483648.0f) return 2147483647;
        if (v <= -2147483648.0f) return -2147483647 - 1;
        return (int64_t)(int32_t)v;
    }
    if (v >= 4294967296.0f) return 4294967295u;
    if (v <= 0.0f) return 0;
    return (int64_t)(uint32_t)v;
}

CT_RM void ct_cv_store_f(int dt, void *y, int64_t i, float v) {
    if (dt == CT_F32) ((float *)y)[i] = v;
    else if (dt == CT_F16) ((uint16_t *)y)[i] = ct_rm_f32_to_f16(v);
    else ((uint16_t *)y)[i] = ct_rm_f32_to_bf16(v);
}

CT_RM void ct_cv_store_i(int dt, void *y, int64_t i, int64_t v) {
    if (dt == CT_I32) ((int32_t *)y)[i] = (int32_t)(uint32_t)(uint64_t)v;
    else if (dt == CT_U32) ((uint32_t *)y)[i] = (uint32_t)(uint64_t)v;
    else ((uint8_t *)y)[i] = v != 0;
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
