/*
 * ct_threefry.h — Threefry-2x32 and JAX's partitionable counter layout.
 *
 * A key is two uint32 words, exactly JAX's legacy raw key (`jax.random.PRNGKey`),
 * so keys pass between JAX and ctrainstate unchanged.
 *
 * Invariant (the reason this file exists): the random bits of element `i` of an
 * array, `i` its global row-major flat index, are
 *
 *     (b0, b1) = threefry2x32(key, (hi32(i), lo32(i)))
 *     bits32   = b0 ^ b1          bits16 = low 16 of bits32     bits8 = low 8
 *     bits64   = b0 << 32 | b1
 *
 * which is what jax.random produces with jax_threefry_partitionable=True (the
 * default since JAX 0.5). Bits depend on (key, global index) only, so any block
 * of any array can be generated alone, on any device, and agree bit for bit.
 */
#ifndef CT_THREEFRY_H
#define CT_THREEFRY_H

#include <stddef.h>
#include <stdint.h>

#include "ct_status.h"

/* Largest rank a block fill accepts. */
#define CT_RANDOM_MAX_NDIM 32

/* The 20-round Threefry-2x32 block cipher: encrypt the pair x in place. */
void ct_threefry2x32(const uint32_t key[2], uint32_t x[2]);

/* The cipher of one counter (x0, x1) under each of n keys (k0[i], k1[i]):
 * y0[i], y1[i] = threefry2x32((k0[i], k1[i]), (x0, x1)). With (x0, x1) = (0, j)
 * that is word pair j of split(key_i, num) for every key at once; with (0, 0),
 * y0 ^ y1 is the 32-bit word of a draw of shape () (the samplers that run one
 * jax loop per element, each with its own key). Outputs may not alias inputs. */
void ct_threefry2x32_keys(size_t n, const uint32_t *k0, const uint32_t *k1, uint32_t x0,
                          uint32_t x1, uint32_t *y0, uint32_t *y1);

/* split(key_i, num) of n keys at once, key i being (k0[i], k1[i]): out is num x 2 x n
 * words, out[(2 j) n + i], out[(2 j + 1) n + i] = word pair j of split(key_i, num)
 * (threefry of counter (hi32(j), lo32(j)), as ct_key_split). */
void ct_keys_split(size_t n, const uint32_t *k0, const uint32_t *k1, uint64_t num,
                   uint32_t *out);

/* jax.random.PRNGKey(seed) with 64-bit mode off: (0, seed mod 2^32). */
void ct_key_from_seed(int64_t seed, uint32_t out[2]);

/* jax.random.split(key, num): out[2*i .. 2*i+1] = threefry(key, (0, i)) for
 * i < num (num may be 0). out must hold 2*num words. */
void ct_key_split(const uint32_t key[2], uint64_t num, uint32_t *out);

/* jax.random.fold_in(key, data) = threefry(key, (0, data)). */
void ct_key_fold_in(const uint32_t key[2], uint32_t data, uint32_t out[2]);

/*
 * Validate a block of a global array: 0 <= ndim <= CT_RANDOM_MAX_NDIM, all
 * extents >= 0, 0 <= start[d] and start[d] + block[d] <= global[d], and the
 * global size below 2^64. Sets CT_EINVAL with a message naming the dimension.
 * Also returns the number of elements of the block in *count (may be NULL).
 */
ct_status ct_block_check(int ndim, const int64_t *global_shape, const int64_t *start,
                         const int64_t *block_shape, uint64_t *count);

/*
 * Fill `out` (a dense row-major buffer of prod(block_shape) elements of
 * bit_width/8 bytes each) with the random bits JAX gives the global elements
 * [start, start + block_shape) of an array of global_shape.
 * bit_width is 8, 16, 32 or 64. Parallel (OpenMP) over the block.
 */
ct_status ct_random_bits_block(const uint32_t key[2], int ndim, const int64_t *global_shape,
                               const int64_t *start, const int64_t *block_shape,
                               int bit_width, void *out);

/* Plain scalar reference of ct_random_bits_block, one element at a time (tests). */
ct_status ct_random_bits_block_ref(const uint32_t key[2], int ndim,
                                   const int64_t *global_shape, const int64_t *start,
                                   const int64_t *block_shape, int bit_width, void *out);

/* --- block iteration shared with ct_random.c ------------------------------ */

/* Called for a run of `n` consecutive global indices g0, g0+1, ..., written at
 * block offset `off` (elements) of the output. */
typedef void (*ct_run_fn)(void *ctx, uint64_t g0, uint64_t off, uint64_t n);

/* Call fn over the whole block, split into runs of consecutive global indices,
 * in parallel chunks (each run lies inside one chunk). The block must have
 * passed ct_block_check. */
void ct_block_for_each_run(int ndim, const int64_t *global_shape, const int64_t *start,
                           const int64_t *block_shape, ct_run_fn fn, void *ctx);

/* Threefry over n consecutive counters g0..g0+n-1: bits32[j] = b0 ^ b1, and if
 * hi is not NULL, also b0 in hi[j] and b1 in lo[j] (for 64-bit bits). */
void ct_threefry_counters(const uint32_t key[2], uint64_t g0, size_t n, uint32_t *bits32,
                          uint32_t *hi, uint32_t *lo);

#endif /* CT_THREEFRY_H */
