/*
 * test_random.c — standalone test of the PRNG core against vectors recorded
 * from jax.random (tests/data/random_vectors.txt, made by
 * tests/data/make_random_vectors.py), plus block / reference / error checks.
 *
 *   gcc -std=c11 -O2 -fopenmp -Wall -Wextra -Werror -Icsrc/core tests/c/test_random.c \
 *       csrc/core/ct_threefry.c csrc/core/ct_random.c csrc/core/ct_status.c -lm -o /tmp/t
 *   /tmp/t tests/data/random_vectors.txt
 * Add -fsanitize=address,undefined for the sanitizer run.
 *
 * It also proves the GPU kernel's math on the host: ct_random_math.h's
 * per-element functions (what csrc/backend/cuda/cuda_random.cu runs) are
 * compared with the vectorised CPU fill for every possible input word, and
 * the kernel's block indexing is emulated element by element.
 */
#if defined(__GNUC__) && !defined(__clang__)
/* ct_random_math.h's functions are compiled here too: no contraction, as in
 * ct_random.c and (with --fmad=false) in the CUDA kernel. */
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct_random.h"
#include "ct_random_math.h"
#include "ct_threefry.h"

#include "check.h"
#include "ct_device.h"

/* ct_random.c names a device by its global id (ct_device.c) in one error message; these tests
 * make no devices, so the device registry is not linked: its id is the device's own. */
int ct_device_global_id(const ct_device *dev) { return dev->id; }

/* The float32 sweeps below feed every one of the 2^23 mantissas. The sanitizer build
 * (tests/c/Makefile) defines CT_SWEEP_STRIDE=256: there the sweeps take every 256th mantissa
 * with a varying low part (k * 5 mod 256: every residue), and the first and last, so that
 * the fast path's packing sees the same mix of branches; what the sanitizers check (buffer
 * bounds, undefined behaviour) does not need every value, and the full sweeps run in the
 * plain -O3 builds. */
#ifndef CT_SWEEP_STRIDE
#define CT_SWEEP_STRIDE 1
#endif
#define N_SWEEP32 (((size_t)1 << 23) / CT_SWEEP_STRIDE)
/* the sweeps' buffers: the float32 sweep's words, or float16's 2^16 if a stride makes fewer */
#define N_SWEEP_BUF (N_SWEEP32 > 65536 ? N_SWEEP32 : (size_t)65536)

/* The k-th float32 mantissa of a sweep of N_SWEEP32. */
static uint32_t sweep_mantissa(size_t k) {
    if (CT_SWEEP_STRIDE == 1) return (uint32_t)k;
    if (k == N_SWEEP32 - 1) return ((uint32_t)1 << 23) - 1u;
    return (uint32_t)(k * CT_SWEEP_STRIDE + (k * 5u) % CT_SWEEP_STRIDE);
}

/* The exhaustive sweeps' outputs are the same bits on every CPU path. `make test` runs this
 * test once per path: the first run (--write-sweeps FILE) checks each sweep's output against
 * the scalar reference and ct_rm_element and writes a digest of it; the runs on the other
 * paths (--check-sweeps FILE) compare their outputs' digests with those instead of
 * computing the references again (the path-independent nine tenths of a run). An output whose
 * digest differs (or a missing or short file) takes the full comparison, which names the
 * first differing byte. */
static FILE *g_sweeps_out, *g_sweeps_in;
static size_t g_sweeps_known;

/* FNV-1a over 64-bit words, then the bytes left: two outputs that differ in one word
 * always differ here. */
static uint64_t digest(const void *buf, size_t bytes) {
    const uint8_t *p = buf;
    uint64_t h = 0xcbf29ce484222325u ^ bytes;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3u;
    }
    for (; i < bytes; i++) h = (h ^ p[i]) * 0x100000001b3u;
    return h;
}

/* Whether a sweep's output is the first run's (the next digest of --check-sweeps' file). */
static int sweep_known(const void *buf, size_t bytes) {
    unsigned long long want;
    if (!g_sweeps_in || fscanf(g_sweeps_in, "%llx", &want) != 1) return 0;
    if ((uint64_t)want != digest(buf, bytes)) return 0;
    g_sweeps_known++;
    return 1;
}

/* A sweep's output, checked against the references: its digest to --write-sweeps' file. */
static void sweep_record(const void *buf, size_t bytes) {
    if (g_sweeps_out) fprintf(g_sweeps_out, "%016llx\n", (unsigned long long)digest(buf, bytes));
}

static ct_dtype parse_dtype(const char *s) {
    if (!strcmp(s, "float16")) return CT_F16;
    if (!strcmp(s, "bfloat16")) return CT_BF16;
    return CT_F32;
}

/* Read hex words after ':' into a uint64 array; returns the count. */
static size_t read_hex(char *p, uint64_t *out, size_t max) {
    size_t n = 0;
    char *end;
    while (n < max) {
        unsigned long long v = strtoull(p, &end, 16);
        if (end == p) break;
        out[n++] = v;
        p = end;
    }
    return n;
}

/* Compare a filled buffer of elements of `esize` bytes with expected words. */
static int equal_words(const void *buf, size_t esize, const uint64_t *want, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint64_t got = esize == 1 ? ((const uint8_t *)buf)[i]
                     : esize == 2 ? ((const uint16_t *)buf)[i]
                     : esize == 4 ? ((const uint32_t *)buf)[i]
                                  : ((const uint64_t *)buf)[i];
        if (got != want[i]) {
            fprintf(stderr, "  element %zu: got %llx want %llx\n", i, (unsigned long long)got,
                    (unsigned long long)want[i]);
            return 0;
        }
    }
    return 1;
}

typedef struct {
    int bits; /* 8/16/32 for bits, 0 for a sampler */
    ct_sampler s;
} job;

static ct_status run(const job *j, const uint32_t key[2], int ndim, const int64_t *g,
                     const int64_t *st, const int64_t *b, void *out, int ref) {
    if (j->bits)
        return ref ? ct_random_bits_block_ref(key, ndim, g, st, b, j->bits, out)
                   : ct_random_bits_block(key, ndim, g, st, b, j->bits, out);
    return ref ? ct_random_fill_block_ref(key, &j->s, ndim, g, st, b, out)
               : ct_random_fill_block(key, &j->s, ndim, g, st, b, out);
}

static void sample_case(char *line, size_t lineno) {
    char dist[32], dtype[16];
    unsigned k0, k1;
    double mn, mx, lo, hi, p, scale;
    int has_scale, ndim, off = 0;
    if (sscanf(line, "sample %31s %15s %u %u %lf %lf %lf %lf %lf %d %lf %d%n", dist, dtype, &k0,
               &k1, &mn, &mx, &lo, &hi, &p, &has_scale, &scale, &ndim, &off) != 12) {
        CHECK(0, "line %zu: cannot parse", lineno);
        return;
    }
    int64_t g[CT_RANDOM_MAX_NDIM], zero[CT_RANDOM_MAX_NDIM] = { 0 };
    char *q = line + off;
    uint64_t count = 1;
    for (int d = 0; d < ndim; d++) {
        g[d] = strtoll(q, &q, 10);
        count *= (uint64_t)g[d];
    }
    q = strchr(q, ':');
    uint64_t *want = malloc(sizeof(uint64_t) * (count + 1));
    size_t n = read_hex(q + 1, want, count + 1);
    CHECK(n == count, "line %zu: %zu values for %llu elements", lineno, n,
          (unsigned long long)count);
    job j;
    memset(&j, 0, sizeof j);
    size_t esize;
    if (!strncmp(dist, "bits", 4)) {
        j.bits = atoi(dist + 4);
        esize = (size_t)j.bits / 8;
    } else {
        j.s.dist = !strcmp(dist, "uniform") ? CT_DIST_UNIFORM
                 : !strcmp(dist, "normal") ? CT_DIST_NORMAL
                 : !strcmp(dist, "truncated_normal") ? CT_DIST_TRUNCATED_NORMAL
                                                     : CT_DIST_BERNOULLI;
        j.s.dtype = parse_dtype(dtype);
        j.s.minval = mn; j.s.maxval = mx; j.s.lower = lo; j.s.upper = hi; j.s.p = p;
        j.s.has_scale = has_scale; j.s.scale = scale;
        esize = j.s.dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(j.s.dtype);
    }
    const uint32_t key[2] = { k0, k1 };
    void *buf = malloc(esize * (count + 1));
    for (int ref = 0; ref < 2; ref++) {
        memset(buf, 0xAB, esize * (count + 1));
        ct_status st = run(&j, key, ndim, g, zero, g, buf, ref);
        CHECK(st == CT_OK, "line %zu: status %d (%s)", lineno, (int)st, ct_last_error());
        CHECK(equal_words(buf, esize, want, count), "line %zu (%s %s, %s path) differs from jax",
              lineno, dist, dtype, ref ? "reference" : "fast");
    }
    /* Every block of a 2-way split of the first dimension alone gives its slice. */
    if (ndim >= 1 && g[0] >= 2) {
        int64_t st0[CT_RANDOM_MAX_NDIM] = { 0 }, b[CT_RANDOM_MAX_NDIM];
        memcpy(b, g, sizeof(int64_t) * (size_t)ndim);
        uint64_t inner = count / (uint64_t)g[0];
        st0[0] = g[0] / 2;
        b[0] = g[0] - st0[0];
        ct_status s2 = run(&j, key, ndim, g, st0, b, buf, 0);
        CHECK(s2 == CT_OK && equal_words(buf, esize, want + (uint64_t)st0[0] * inner,
                                         inner * (uint64_t)b[0]),
              "line %zu: second-half block differs", lineno);
    }
    free(buf);
    free(want);
}

static void key_case(char *line, size_t lineno) {
    unsigned k0, k1;
    unsigned long long a;
    uint64_t want[64], got[64];
    uint32_t out[64];
    int split = !strncmp(line, "split", 5);
    if (sscanf(line + (split ? 5 : 7), "%u %u %llu", &k0, &k1, &a) != 3) {
        CHECK(0, "line %zu: cannot parse", lineno);
        return;
    }
    size_t n = read_hex(strchr(line, ':') + 1, want, 64);
    const uint32_t key[2] = { k0, k1 };
    if (split) ct_key_split(key, a, out);
    else ct_key_fold_in(key, (uint32_t)a, out);
    for (size_t i = 0; i < n; i++) got[i] = out[i];
    CHECK(n == (split ? 2 * a : 2) && !memcmp(got, want, n * sizeof(uint64_t)),
          "line %zu: %s differs from jax", lineno, split ? "split" : "fold_in");
}

/* Blocks of a larger array, fast path against the scalar reference. */
static void test_blocks_vs_reference(void) {
    const uint32_t key[2] = { 0x12345678u, 0x9abcdef0u };
    int64_t g[3] = { 9, 37, 1031 }, st[3] = { 2, 5, 100 }, b[3] = { 5, 20, 900 };
    size_t n = 5 * 20 * 900;
    float *x = malloc(n * 4), *y = malloc(n * 4);
    for (int dist = 0; dist < 4; dist++) {
        for (int dt = 0; dt < 3; dt++) {
            ct_sampler s = { (ct_dist)dist, (ct_dtype)dt, -0.5, 3.0, -1.0, 2.5, 0.25, 1, 0.5 };
            if (dist == CT_DIST_BERNOULLI) s.has_scale = 0;
            CHECK(ct_random_fill_block(key, &s, 3, g, st, b, x) == CT_OK, "fill");
            CHECK(ct_random_fill_block_ref(key, &s, 3, g, st, b, y) == CT_OK, "ref");
            size_t bytes = n * (dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size((ct_dtype)dt));
            CHECK(!memcmp(x, y, bytes), "dist %d dtype %d: fast != reference", dist, dt);
        }
    }
    CHECK(ct_random_bits_block(key, 3, g, st, b, 32, x) == CT_OK, "bits");
    CHECK(ct_random_bits_block_ref(key, 3, g, st, b, 32, y) == CT_OK, "bits ref");
    CHECK(!memcmp(x, y, n * 4), "bits: fast != reference");
    free(x);
    free(y);
}

/* The sampler configurations both exhaustive tests run: dist, minval, maxval, lower,
 * upper, p, has_scale, scale. */
static const struct { int dist; double mn, mx, lo, hi, p; int has_scale; double scale; } g_cfg[] = {
    { CT_DIST_UNIFORM, 0.0, 1.0, 0, 0, 0, 0, 0 },
    { CT_DIST_UNIFORM, -3.7, 2.3, 0, 0, 0, 1, 0.02 },
    { CT_DIST_UNIFORM, 1e-3, 7e4, 0, 0, 0, 0, 0 },
    { CT_DIST_NORMAL, 0, 0, 0, 0, 0, 0, 0 },
    { CT_DIST_NORMAL, 0, 0, 0, 0, 0, 1, 0.0625 },
    { CT_DIST_TRUNCATED_NORMAL, 0, 0, -2.0, 2.0, 0, 1, 0.3 },
    { CT_DIST_TRUNCATED_NORMAL, 0, 0, -INFINITY, 1.5, 0, 0, 0 },
    { CT_DIST_TRUNCATED_NORMAL, 0, 0, 3.0, 4.0, 0, 0, 0 },
    { CT_DIST_BERNOULLI, 0, 0, 0, 0, 0.3, 0, 0 },
};
#define N_CFG (sizeof g_cfg / sizeof g_cfg[0])

static ct_sampler cfg_sampler(size_t i, int dt) {
    ct_sampler s = { (ct_dist)g_cfg[i].dist, (ct_dtype)dt, g_cfg[i].mn, g_cfg[i].mx,
                     g_cfg[i].lo, g_cfg[i].hi, g_cfg[i].p, g_cfg[i].has_scale, g_cfg[i].scale };
    return s;
}

/* Every possible input of each transform through the fast path and the scalar
 * reference: the float32 samplers read the top 23 bits of the random word
 * (all 2^23 are fed, but see CT_SWEEP_STRIDE), float16 the low 16 and bfloat16 the low 8. Covers the
 * rare erf_inv tail (|u| near 1), both log1p branches and the 16-bit rounding
 * cases that a random block hits seldom or never. */
static void test_transforms_exhaustive(void) {
    const size_t n32 = N_SWEEP32;
    uint32_t *words = malloc(N_SWEEP_BUF * 4);
    uint8_t *x = malloc(N_SWEEP_BUF * 4), *y = malloc(N_SWEEP_BUF * 4);
    for (size_t i = 0; i < N_CFG; i++) {
        for (int dt = 0; dt < 3; dt++) {
            ct_sampler s = cfg_sampler(i, dt);
            size_t n = dt == CT_F32 ? n32 : dt == CT_F16 ? 65536 : 256;
            /* In order (neighbouring lanes take the same branches), then
             * shuffled by an odd multiplier, a bijection of the 23 bits
             * (every vector mixes log1p's and erf_inv's branches). */
            for (int order = 0; order < 2; order++) {
                for (size_t k = 0; k < n; k++) {
                    uint32_t kk = order ? (uint32_t)(k * 0x9E3779B1u) & (uint32_t)(n - 1)
                                        : (uint32_t)k;
                    words[k] = dt == CT_F32 ? sweep_mantissa(kk) << 9 | 0x1ffu * (k & 1)
                                            : kk | 0xabcd0000u;
                }
                size_t bytes = n * (s.dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s.dtype));
                memset(x, 0x5a, bytes);
                memset(y, 0xa5, bytes);
                CHECK(ct_random_transform_words(&s, words, n, x, 0) == CT_OK, "fast");
                if (sweep_known(x, bytes)) continue;
                sweep_record(x, bytes);
                CHECK(ct_random_transform_words(&s, words, n, y, 1) == CT_OK, "ref");
                size_t bad = 0;
                while (bad < bytes && x[bad] == y[bad]) bad++;
                CHECK(bad == bytes,
                      "config %zu dtype %d order %d: fast != reference at byte %zu of %zu", i,
                      dt, order, bad, bytes);
            }
        }
    }
    free(words);
    free(x);
    free(y);
}


/* Tiles of every length up to one past two tiles, fast path against the
 * reference: the hand-vectorised paths handle a last partial vector and a
 * last partial tile themselves. The words put a lane in erf_inv's tail
 * (|u| ~ 1) every 7th element and in log1p's other branch every 3rd, so
 * partial vectors meet every kind of lane. */
static void test_tile_lengths(void) {
    const size_t nmax = 2 * 1024 + 1;
    uint32_t *words = malloc(nmax * 4);
    float *x = malloc(nmax * 4), *y = malloc(nmax * 4);
    for (size_t k = 0; k < nmax; k++) {
        uint32_t h = (uint32_t)k * 0x9E3779B1u;
        words[k] = k % 7 == 0 ? (k % 14 ? 0xffffff00u : 0x00000100u) | (h & 0xffu)
                 : k % 3 == 0 ? 0xe0000000u | (h >> 3)
                              : h;
    }
    for (size_t i = 0; i < N_CFG; i++) {
        if (g_cfg[i].dist != CT_DIST_NORMAL && g_cfg[i].dist != CT_DIST_TRUNCATED_NORMAL)
            continue;
        ct_sampler s = cfg_sampler(i, CT_F32);
        for (size_t n = 1; n <= nmax; n += n < 64 ? 1 : n < 1100 ? 3 : 61) {
            memset(x, 0x5a, nmax * 4);
            memset(y, 0x5a, nmax * 4);
            CHECK(ct_random_transform_words(&s, words, n, x, 0) == CT_OK, "fast");
            CHECK(ct_random_transform_words(&s, words, n, y, 1) == CT_OK, "ref");
            CHECK(!memcmp(x, y, nmax * 4), "config %zu, %zu words: fast != reference", i, n);
        }
    }
    free(words);
    free(x);
    free(y);
}

/* The dtype-sized stored value of element k of a transform output. */
static uint32_t out_word(const void *buf, size_t esize, size_t k) {
    return esize == 1 ? ((const uint8_t *)buf)[k]
         : esize == 2 ? ((const uint16_t *)buf)[k]
                      : ((const uint32_t *)buf)[k];
}


/* ct_rm_element (the kernel's transform) == the vectorised CPU transform for
 * every input the dtype distinguishes: all 2^23 float32 mantissas (with the
 * discarded low 9 bits both 0 and 1), all 2^16 float16 words, all 2^8 for
 * bfloat16. */
static void test_math_header_exhaustive(void) {
    const size_t n32 = N_SWEEP32;
    uint32_t *words = malloc(N_SWEEP_BUF * 4);
    uint8_t *x = malloc(N_SWEEP_BUF * 4);
    for (size_t i = 0; i < N_CFG; i++) {
        for (int dt = 0; dt < 3; dt++) {
            ct_sampler s = cfg_sampler(i, dt);
            ct_random_consts c;
            CHECK(ct_random_consts_make(&s, &c) == CT_OK, "consts");
            size_t n = dt == CT_F32 ? n32 : dt == CT_F16 ? 65536 : 256;
            for (int low = 0; low < 2; low++) {
                for (size_t k = 0; k < n; k++)
                    words[k] = dt == CT_F32 ? sweep_mantissa(k) << 9 | 0x1ffu * (uint32_t)low
                                            : (uint32_t)k | (low ? 0xabcd0000u : 0u);
                size_t esize = s.dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s.dtype);
                CHECK(ct_random_transform_words(&s, words, n, x, 0) == CT_OK, "fast");
                if (sweep_known(x, n * esize)) continue;
                sweep_record(x, n * esize);
                size_t bad = n;
                for (size_t k = 0; k < n && bad == n; k++)
                    if (ct_rm_element(&c, c.dist, c.dt, words[k]) != out_word(x, esize, k)) bad = k;
                CHECK(bad == n, "config %zu dtype %d: ct_rm_element != CPU fill at word 0x%08x",
                      i, dt, bad < n ? words[bad] : 0u);
            }
        }
    }
    free(words);
    free(x);
}

/* The kernel's indexing (ct_rm_block_make / ct_rm_block_index) and threefry
 * (ct_rm_bits32), run element by element on the host, == the CPU fill, for
 * blocks that merge to one group, two groups, three, a single element, and
 * counters past 2^32. */
static void test_kernel_emulation(void) {
    static const struct { int nd; int64_t g[3], st[3], b[3]; } blocks[] = {
        { 1, { 1000 }, { 0 }, { 1000 } },
        { 2, { 64, 48 }, { 16, 0 }, { 16, 48 } },
        { 2, { 64, 48 }, { 0, 12 }, { 64, 12 } },
        { 3, { 6, 10, 14 }, { 2, 3, 5 }, { 3, 4, 7 } },
        { 3, { 4, 5, 6 }, { 1, 0, 0 }, { 2, 1, 6 } },
        { 0, { 0 }, { 0 }, { 0 } },
        { 2, { 3, (int64_t)1 << 31 }, { 1, ((int64_t)1 << 31) - 40 }, { 2, 40 } },
    };
    const uint32_t k0 = 0x1234abcdu, k1 = 0x0badf00du;
    const uint32_t key[2] = { k0, k1 };
    for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++) {
        const int nd = blocks[bi].nd;
        ct_rm_block blk;
        ct_rm_block_make(nd, blocks[bi].g, blocks[bi].st, blocks[bi].b, &blk);
        uint64_t count;
        CHECK(ct_block_check(nd, blocks[bi].g, blocks[bi].st, blocks[bi].b, &count) == CT_OK,
              "block %zu", bi);
        CHECK(count == blk.count, "block %zu count", bi);
        if (bi == 0 || bi == 1) CHECK(blk.ngroups == 1 && blk.stride[0] == 1, "contiguous %zu", bi);
        uint8_t *x = malloc(count * 4 + 1);
        for (size_t i = 0; i < N_CFG; i++) {
            for (int dt = 0; dt < 3; dt++) {
                ct_sampler s = cfg_sampler(i, dt);
                ct_random_consts c;
                CHECK(ct_random_consts_make(&s, &c) == CT_OK, "consts");
                size_t esize = s.dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s.dtype);
                CHECK(ct_random_fill_block(key, &s, nd, blocks[bi].g, blocks[bi].st,
                                           blocks[bi].b, x) == CT_OK, "fill");
                uint64_t bad = count;
                for (uint64_t e = 0; e < count && bad == count; e++) {
                    uint32_t w = ct_rm_bits32(k0, k1, ct_rm_block_index(&blk, e));
                    if (ct_rm_element(&c, c.dist, c.dt, w) != out_word(x, esize, e)) bad = e;
                }
                CHECK(bad == count, "block %zu config %zu dtype %d: emulated kernel != CPU fill "
                      "at element %llu", bi, i, dt, (unsigned long long)bad);
            }
        }
        free(x);
    }
}

/* Counters past 2^32 use the high word of the index (JAX's iota_2x32_shape). */
static void test_high_counter(void) {
    const uint32_t key[2] = { 0, 42 };
    int64_t g[2] = { 3, (int64_t)1 << 31 }, st[2] = { 2, 5 }, b[2] = { 1, 4 };
    uint32_t out[4];
    CHECK(ct_random_bits_block(key, 2, g, st, b, 32, out) == CT_OK, "bits");
    for (int i = 0; i < 4; i++) {
        uint64_t gi = 2 * ((uint64_t)1 << 31) + 5 + (uint64_t)i;
        uint32_t x[2] = { (uint32_t)(gi >> 32), (uint32_t)gi };
        ct_threefry2x32(key, x);
        CHECK(out[i] == (x[0] ^ x[1]), "high counter element %d", i);
    }
}

/* Draws under arrays of keys: each key's cipher of one counter is ct_threefry2x32's, and
 * its keyed sample is the one-element block fill of shape () under that key, for every
 * sampler configuration and dtype; n spans more than one tile and ends in a partial one. */
static void test_keyed(void) {
    enum { N = 2 * 1024 + 37 };
    uint32_t *k0 = malloc(N * 4), *k1 = malloc(N * 4), *y0 = malloc(N * 4), *y1 = malloc(N * 4);
    float *x = malloc(N * 4);
    const uint32_t root[2] = { 7u, 0xdeadbeefu };
    for (uint32_t i = 0; i < N; i++) {
        uint32_t w[2] = { i >> 7, i * 2654435761u };
        ct_threefry2x32(root, w);
        k0[i] = w[0];
        k1[i] = w[1];
    }
    ct_threefry2x32_keys(N, k0, k1, 3u, 0x80000001u, y0, y1);
    int bad = 0;
    for (size_t i = 0; i < N; i++) {
        uint32_t key[2] = { k0[i], k1[i] }, w[2] = { 3u, 0x80000001u };
        ct_threefry2x32(key, w);
        bad += w[0] != y0[i] || w[1] != y1[i];
    }
    CHECK(bad == 0, "threefry of arrays of keys: %d keys differ from ct_threefry2x32", bad);
    {   /* split of every key at once == ct_key_split of each */
        enum { NUM = 3 };
        uint32_t *sp = malloc((size_t)NUM * 2 * N * 4), one[2 * NUM];
        ct_keys_split(N, k0, k1, NUM, sp);
        bad = 0;
        for (size_t i = 0; i < N; i++) {
            uint32_t key[2] = { k0[i], k1[i] };
            ct_key_split(key, NUM, one);
            for (int j = 0; j < NUM; j++)
                bad += one[2 * j] != sp[(size_t)(2 * j) * N + i] ||
                       one[2 * j + 1] != sp[(size_t)(2 * j + 1) * N + i];
        }
        CHECK(bad == 0, "split of arrays of keys: %d keys differ from ct_key_split", bad);
        free(sp);
    }
    for (int dist = 0; dist < 4; dist++) {
        for (int dt = 0; dt < 3; dt++) {
            ct_sampler s = { (ct_dist)dist, (ct_dtype)dt, -0.5, 3.0, -1.0, 2.5, 0.25, 1, 0.5 };
            if (dist == CT_DIST_BERNOULLI) s.has_scale = 0;
            size_t es = dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size((ct_dtype)dt);
            CHECK(ct_random_keyed(&s, N, k0, k1, x) == CT_OK, "keyed");
            bad = 0;
            for (size_t i = 0; i < N; i++) {
                uint32_t key[2] = { k0[i], k1[i] }, one = 0;
                CHECK(ct_random_fill_block(key, &s, 0, NULL, NULL, NULL, &one) == CT_OK, "fill");
                bad += memcmp((char *)x + i * es, &one, es) != 0;
            }
            CHECK(bad == 0, "dist %d dtype %d: %d keyed samples differ from shape-() fills", dist,
                  dt, bad);
        }
    }
    ct_sampler s = { CT_DIST_NORMAL, CT_I32, 0, 1, 0, 0, 0, 0, 0 };
    CHECK(ct_random_keyed(&s, N, k0, k1, x) == CT_ETYPE, "keyed: integer dtype accepted");
    s.dtype = CT_F32;
    CHECK(ct_random_keyed(&s, 1, NULL, k1, x) == CT_EINVAL, "keyed: NULL keys accepted");
    CHECK(ct_random_keyed(&s, 0, NULL, NULL, NULL) == CT_OK, "keyed: no keys");
    free(k0), free(k1), free(y0), free(y1), free(x);
}

static void test_errors(void) {
    const uint32_t key[2] = { 0, 0 };
    float out[4];
    int64_t g[1] = { 4 }, st[1] = { 2 }, b[1] = { 3 };
    ct_sampler s = { CT_DIST_NORMAL, CT_F32, 0, 1, 0, 0, 0, 0, 0 };
    CHECK(ct_random_fill_block(key, &s, 1, g, st, b, out) == CT_EINVAL &&
              strstr(ct_last_error(), "exceeds") != NULL,
          "block past the end must fail with a message, got '%s'", ct_last_error());
    ct_clear_error();
    int64_t neg[1] = { -1 };
    CHECK(ct_random_fill_block(key, &s, 1, g, neg, b, out) == CT_EINVAL, "negative start");
    s.dtype = CT_I32;
    CHECK(ct_random_fill_block(key, &s, 1, g, st, g, out) == CT_ETYPE, "int dtype");
    s.dtype = CT_F32;
    s.dist = (ct_dist)9;
    CHECK(ct_random_fill_block(key, &s, 1, g, st, g, out) == CT_EINVAL, "bad dist");
    CHECK(ct_random_bits_block(key, 1, g, st, b, 12, out) == CT_EINVAL, "bit width 12");
    int64_t huge[3] = { (int64_t)1 << 40, (int64_t)1 << 40, 1 };
    int64_t z3[3] = { 0, 0, 0 };
    CHECK(ct_random_bits_block(key, 3, huge, z3, z3, 32, out) == CT_EINVAL, "size over 2^64");
    CHECK(ct_random_bits_block(key, 33, g, st, b, 32, out) == CT_EINVAL, "rank 33");
    ct_clear_error();
}

static void test_xla_math(void) {
    CHECK(ct_xla_erfinvf(0.0f) == 0.0f, "erfinv(0)");
    CHECK(isinf(ct_xla_erfinvf(1.0f)) && ct_xla_erfinvf(-1.0f) < 0, "erfinv(+-1)");
    CHECK(fabsf(ct_xla_erfinvf(0.5f) - 0.4769362762f) < 1e-6f, "erfinv(0.5)");
    CHECK(fabsf(ct_xla_logf(2.0f) - 0.6931471806f) < 1e-7f, "log(2)");
    CHECK(ct_f16_to_f32(ct_f32_to_f16(65520.0f)) == INFINITY, "f16 overflow rounds to inf");
    CHECK(ct_f16_to_f32(ct_f32_to_f16(5.9604645e-08f)) == 5.9604645e-08f, "f16 subnormal");
}

/* ct_xla_pow_n: powf with denormals flushed (inputs read as zero, results to zero), and the
 * caller's floating-point mode left as it was. */
static void test_xla_pow(void) {
    float x[6] = { 2.0f, 0.5f, 1e-40f, -1e-40f, -2.0f, 3.0f };
    const float y[6] = { 0.5f, 140.0f, 2.0f, 3.0f, 0.5f, -2.0f };
    float want3 = powf(3.0f, -2.0f), want0 = powf(2.0f, 0.5f);
    CHECK(ct_xla_pow_n(x, y, 6) == CT_OK, "xla_pow runs");
    CHECK(x[0] == want0, "2 ** 0.5 is powf's");
    CHECK(x[1] == 0.0f && !signbit(x[1]), "2^-140 (subnormal) flushed to +0");
    CHECK(x[2] == 0.0f && x[3] == 0.0f && signbit(x[3]), "subnormal bases read as +-0");
    CHECK(isnan(x[4]), "(-2) ** 0.5 is NaN");
    CHECK(x[5] == want3, "3 ** -2 is powf's");
    volatile float tiny = 1e-38f;
    CHECK(tiny * 0.01f != 0.0f, "the caller keeps gradual underflow afterwards");
    CHECK(ct_xla_pow_n(NULL, y, 1) == CT_EINVAL && ct_xla_pow_n(NULL, NULL, 0) == CT_OK,
          "NULL arrays refused unless empty");
    ct_clear_error();
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "tests/data/random_vectors.txt";
    if (argc > 3 && !strcmp(argv[2], "--write-sweeps")) {
        g_sweeps_out = fopen(argv[3], "w");
        CHECK(g_sweeps_out != NULL, "cannot write %s", argv[3]);
    } else if (argc > 3 && !strcmp(argv[2], "--check-sweeps")) {
        g_sweeps_in = fopen(argv[3], "r");
        CHECK(g_sweeps_in != NULL, "cannot read %s", argv[3]);
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        return 2;
    }
    size_t cap = 1 << 20, lineno = 0, cases = 0;
    char *line = malloc(cap);
    while (fgets(line, (int)cap, f)) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n') continue;
        if (!strncmp(line, "sample", 6)) sample_case(line, lineno);
        else key_case(line, lineno);
        cases++;
    }
    fclose(f);
    free(line);
    CHECK(cases > 100, "only %zu cases read from %s", cases, path);
    test_blocks_vs_reference();
    test_transforms_exhaustive();
    test_tile_lengths();
    test_math_header_exhaustive();
    test_kernel_emulation();
    test_high_counter();
    test_keyed();
    test_errors();
    test_xla_math();
    test_xla_pow();
    if (g_sweeps_out) CHECK(fclose(g_sweeps_out) == 0, "writing %s", argv[3]);
    if (g_sweeps_in) fclose(g_sweeps_in);
    printf("test_random (%s fill path): %zu vector cases, %d checks, %d failures",
           ct_random_cpu_path(), cases, checks, failures);
    if (g_sweeps_in) printf(" (%zu sweeps the same bits as the first path's)", g_sweeps_known);
    printf("\n");
    return failures ? 1 : 0;
}
