/*
 * ct_dtype.h — the element types ctrainstate stores, and their sizes.
 *
 * The numbering is part of the binding contract: csrc/python converts numpy
 * dtypes to these once, at the boundary, and _C.dtype_names (ct_dtype_name of every
 * code, in order) is how the Python layer learns them.
 */
#ifndef CT_DTYPE_H
#define CT_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    CT_F32 = 0,
    CT_F16 = 1,
    CT_BF16 = 2,
    CT_I32 = 3,
    CT_U32 = 4,
    CT_BOOL = 5,
    /* the narrow integers (pixels, masks, token ids): stored in their own width, computed
     * in int64 registers by the typed kernels (ct_ewise_math.h) and wrapped when stored */
    CT_U8 = 6,
    CT_I8 = 7,
    CT_I16 = 8,
    CT_U16 = 9,
    CT_NUM_DTYPES
} ct_dtype;

static inline size_t ct_dtype_size(ct_dtype dt) {
    switch (dt) {
    case CT_F32: case CT_I32: case CT_U32: return 4;
    case CT_F16: case CT_BF16: case CT_I16: case CT_U16: return 2;
    case CT_BOOL: case CT_U8: case CT_I8: return 1;
    default: return 0;
    }
}

static inline const char *ct_dtype_name(ct_dtype dt) {
    switch (dt) {
    case CT_F32: return "float32";
    case CT_F16: return "float16";
    case CT_BF16: return "bfloat16";
    case CT_I32: return "int32";
    case CT_U32: return "uint32";
    case CT_BOOL: return "bool";
    case CT_U8: return "uint8";
    case CT_I8: return "int8";
    case CT_I16: return "int16";
    case CT_U16: return "uint16";
    default: return "invalid";
    }
}

/* float <-> bfloat16 / float16 conversions (round to nearest even), used by
 * kernels that compute in fp32 and store narrower types. */
static inline uint16_t ct_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}

static inline float ct_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

#endif /* CT_DTYPE_H */
