/*
 * ct_random.h — samplers of jax.random (uniform, normal, truncated_normal,
 * bernoulli) as block fills: each call writes the values JAX gives the global
 * elements [start, start + block_shape) of an array of global_shape, from the
 * random bits of ct_threefry.h. A device fills its own shard; no full-size
 * temporary exists (scratch is one tile per thread on the stack).
 *
 * Numerics follow what JAX's CPU backend (XLA) computes, op by op:
 *   - float32: uniform = fma(bits_to_[0,1), maxval - minval, minval), then
 *     max(minval, .); normal = sqrt(2) * erf_inv(uniform(nextafter(-1, 0), 1));
 *     erf_inv, log1p, log and erf are XLA's float32 polynomial approximations,
 *     evaluated with the same fused multiply-adds, so results are bit-identical
 *     to jax.random on CPU (verified by tests/c/test_random.c and pytest).
 *   - float16 / bfloat16: random bits of width 16 (float16) or 8 (bfloat16,
 *     whose 7-bit mantissa is below JAX's 8-bit floor), every arithmetic op
 *     rounded to the storage type, transcendental functions evaluated in
 *     float32 and rounded, as XLA does.
 * Scalars (minval, maxval, lower, upper, p, scale) are given as double and
 * converted to the dtype first, as jax's convert_element_type does.
 */
#ifndef CT_RANDOM_H
#define CT_RANDOM_H

#include <stdint.h>

#include "ct_dtype.h"
#include "ct_random_math.h"
#include "ct_status.h"
#include "ct_threefry.h"

/* ct_dist and ct_random_consts are defined in ct_random_math.h (shared with
 * the CUDA kernels). */

typedef struct {
    ct_dist dist;
    /* Output dtype (CT_F32, CT_F16, CT_BF16); for bernoulli the dtype of p
     * (the uniforms are drawn in it) and the output is CT_BOOL bytes 0/1. */
    ct_dtype dtype;
    double minval, maxval; /* uniform */
    double lower, upper;   /* truncated normal; +-inf allowed */
    double p;              /* bernoulli */
    /* If has_scale, the result is then multiplied by scale (converted to
     * dtype), as `sample * jnp.array(scale, dtype)` in jax initializers:
     * two roundings, exactly like JAX's two ops. Not for bernoulli. */
    int has_scale;
    double scale;
} ct_sampler;

/* Check the sampler's fields (dist, dtype). CT_EINVAL / CT_ETYPE on error. */
ct_status ct_sampler_check(const ct_sampler *s);

/* Check s and convert its scalars to the dtype: the constants every element
 * transform of ct_random_math.h reads (what a device kernel is given). */
ct_status ct_random_consts_make(const ct_sampler *s, ct_random_consts *out);

/* Fill a dense row-major block (prod(block_shape) elements of the output
 * dtype) with samples. Parallel (OpenMP) and vectorised. */
ct_status ct_random_fill_block(const uint32_t key[2], const ct_sampler *s, int ndim,
                               const int64_t *global_shape, const int64_t *start,
                               const int64_t *block_shape, void *out);

struct ct_device;

/* 1 if dev's backend fills random blocks in its own memory (a kernel), 0 if
 * the caller must fill a host block and copy it. */
int ct_random_device_supported(const struct ct_device *dev);

/* ct_random_fill_block into `out`, memory of `dev`, by the backend's kernel
 * (queued on the device's stream; complete before any later work there).
 * CT_EINVAL if the backend has none (see ct_random_device_supported). */
ct_status ct_random_fill_block_device(struct ct_device *dev, const uint32_t key[2],
                                      const ct_sampler *s, int ndim,
                                      const int64_t *global_shape, const int64_t *start,
                                      const int64_t *block_shape, void *out);

/* Plain one-element-at-a-time reference of ct_random_fill_block (tests). */
ct_status ct_random_fill_block_ref(const uint32_t key[2], const ct_sampler *s, int ndim,
                                   const int64_t *global_shape, const int64_t *start,
                                   const int64_t *block_shape, void *out);

/* Tests: the samples the fill functions make from the given 32-bit random
 * words (in place of threefry's), by the vectorised fast path (ref = 0) or the
 * scalar reference (ref = 1); n elements of the output dtype into out. Lets a
 * test feed every possible input of a transform to both. */
ct_status ct_random_transform_words(const ct_sampler *s, const uint32_t *words, size_t n,
                                    void *out, int ref);

/* out[i] = the sample of shape () that key (k0[i], k1[i]) gives, for i < n:
 * jax's `sampler(key_i, (), dtype, ...)` of each key, as the samplers that run a
 * loop per element with its own keys (gamma, poisson) draw. Element i's random
 * word is threefry((k0[i], k1[i]), (0, 0)) with its two halves xor-ed; the
 * transform is the block fill's. n elements of the output dtype (bytes 0/1 for
 * bernoulli) into out. */
ct_status ct_random_keyed(const ct_sampler *s, size_t n, const uint32_t *k0,
                          const uint32_t *k1, void *out);

/* Which CPU fill path float32 normal / truncated-normal samples take:
 * "avx512" (ct_random_x86.c, CPUs with AVX-512, unless CTRAINSTATE_NO_AVX512
 * is set), else "avx2" (ct_random_avx2.c, CPUs with AVX2 and FMA, unless
 * CTRAINSTATE_NO_AVX2 is set), else "portable" (the compiler-vectorised
 * loops). Same bits on every path. Read once, at the first fill. */
const char *ct_random_cpu_path(void);

/* XLA's float32 approximations, exposed for tests. */
float ct_xla_logf(float x);
float ct_xla_log1pf(float x);
float ct_xla_erff(float x);
float ct_xla_erfinvf(float x);

/* x[i] = XLA's float32 log (fn CT_XLA_LOG) or log1p (fn CT_XLA_LOG1P) of x[i], in place,
 * for the samplers finished on the host (gumbel, and the log of choice's p): the same
 * bits as jnp.log / jnp.log1p on CPU, denormal inputs read as zero and every NaN result
 * all-ones, as XLA's CPU code gives them. */
enum { CT_XLA_LOG = 0, CT_XLA_LOG1P = 1 };
ct_status ct_xla_math_n(int fn, float *x, size_t n);

/* x[i] = XLA's float32 pow(x[i], y[i]) on CPU, in place: the C library's powf run with
 * denormals flushed to zero (inputs and results), as XLA's compiled code calls it. The
 * same bits as jax.lax.pow / jnp.power on CPU, independent of the host's SIMD. */
ct_status ct_xla_pow_n(float *x, const float *y, size_t n);

/* IEEE binary16 <-> float32 (round to nearest even). */
uint16_t ct_f32_to_f16(float f);
float ct_f16_to_f32(uint16_t h);

#endif /* CT_RANDOM_H */
