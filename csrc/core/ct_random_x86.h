/*
 * ct_random_x86.h — hand-vectorised tile transforms for float32 normal and
 * truncated_normal samples, bit-identical to the scalar definition in
 * ct_random_math.h: AVX-512 (ct_random_x86.c) and AVX2 + FMA
 * (ct_random_avx2.c). ct_random.c's tile loop uses the widest one the CPU
 * has; elsewhere, and for every other sampler and dtype, the portable
 * vectorised loop runs.
 */
#ifndef CT_RANDOM_X86_H
#define CT_RANDOM_X86_H

#include <stddef.h>
#include <stdint.h>

#include "ct_random_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(CT_NO_MULTIVERSION)
#define CT_RANDOM_HAVE_X86 1
#else
#define CT_RANDOM_HAVE_X86 0
#endif

/* Largest tile (elements) the tile transforms below accept. */
#define CT_RANDOM_X86_TILE 1024

#if CT_RANDOM_HAVE_X86
/* 1 when this CPU runs the AVX-512 path. */
int ct_random_avx512_available(void);
/* Samples (scaled when c->has_scale) of words b[0..m) into out, for c->dt == float32
 * and c->dist normal or truncated normal, m <= CT_RANDOM_X86_TILE: returns 1.
 * Any other sampler: returns 0 and writes nothing. Call only when
 * ct_random_avx512_available(). */
int ct_random_tile_normal_f32_avx512(const ct_random_consts *c, const uint32_t *b, size_t m,
                                     float *out);
/* 1 when this CPU runs the AVX2 path (AVX2 and FMA). */
int ct_random_avx2_available(void);
/* As ct_random_tile_normal_f32_avx512, with AVX2 + FMA. Call only when
 * ct_random_avx2_available(). */
int ct_random_tile_normal_f32_avx2(const ct_random_consts *c, const uint32_t *b, size_t m,
                                   float *out);
#endif

#endif /* CT_RANDOM_X86_H */
