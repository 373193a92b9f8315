/*
 * ct_prec_math.h — the input rounding of the reduced matmul precisions
 * (CT_PREC_*, ct_ops.h), per element, shared by every kernel that emulates it:
 * the CPU GEMM (csrc/backend/cpu/cpu_ops.c), the mock GPU backend and the
 * cuBLAS emulation (tests/mock_gpu, tests/cuda_emu).
 *
 * A reduced-precision product rounds each float32 operand element to the
 * narrower input format and multiplies and accumulates in float32:
 *   TF32: 10 explicit mantissa bits (13 dropped), float32's exponent range;
 *   BF16:  7 explicit mantissa bits (16 dropped), float32's exponent range.
 * Rounding is to nearest, ties to even, on the magnitude (sign kept). It is
 * what the formats define and what ml_dtypes' bfloat16 conversion does; a
 * finite value past the largest representable one rounds to inf, denormals
 * round to the format's denormal grid (multiples of 2^-136 / 2^-133), inf
 * stays inf and a NaN stays a NaN (quiet, sign and top payload bits kept, as
 * ct_f32_to_bf16 in ct_dtype.h).
 *
 * Real tensor cores may convert differently (cuBLAS does not document how its
 * FAST_TF32 / FAST_16BF compute types round the float32 inputs), so this is the
 * reference the CPU and the emulations agree on, not a bit-exact model of a GPU.
 */
#ifndef CT_PREC_MATH_H
#define CT_PREC_MATH_H

#include <stdint.h>
#include <string.h>

#include "ct_hd.h"

#ifdef __CUDACC__
#define CT_PM static __forceinline__ __host__ __device__
#else
#define CT_PM static inline __attribute__((always_inline))
#endif

/* Matmul precisions (ct_op_gemm's `prec`; the values are part of the binding contract). */
enum {
    CT_PREC_F32 = 0,  /* float32 operands, float32 products and sums */
    CT_PREC_TF32 = 1, /* operands rounded to TF32, float32 accumulation */
    CT_PREC_BF16 = 2, /* operands rounded to bfloat16, float32 accumulation */
    CT_PREC_COUNT
};

/* Mantissa bits a precision drops from float32: 0 (float32), 13 (TF32), 16 (BF16). */
CT_PM int ct_prec_drop_bits(int prec) {
    return prec == CT_PREC_TF32 ? 13 : prec == CT_PREC_BF16 ? 16 : 0;
}

/* Round the float32 bit pattern `u` to keep 23 - drop mantissa bits (1 <= drop <= 22):
 * round to nearest even on the magnitude; NaN stays a quiet NaN. Branch-free, so loops
 * over it vectorise. */
CT_PM uint32_t ct_prec_round_bits(uint32_t u, int drop) {
    const uint32_t low = (1u << drop) - 1u;
    uint32_t r = (u + (low >> 1) + ((u >> drop) & 1u)) & ~low;
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t qnan = (u | 0x00400000u) & ~low;
    return nan ? qnan : r;
}

/* `x` rounded to the input format of precision `drop` (ct_prec_drop_bits; 0: x itself). */
CT_PM float ct_prec_round(float x, int drop) {
    if (drop == 0) return x;
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(x);
    return __uint_as_float(ct_prec_round_bits(u, drop));
#else
    memcpy(&u, &x, 4);
    u = ct_prec_round_bits(u, drop);
    memcpy(&x, &u, 4);
    return x;
#endif
}

#undef CT_PM

#endif /* CT_PREC_MATH_H */
