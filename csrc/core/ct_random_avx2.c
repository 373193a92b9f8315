/*
 * ct_random_avx2.c — the float32 normal / truncated-normal tile transform with
 * AVX2 + FMA (x86-64-v3), bit-identical to ct_random_math.h's scalar
 * definition. The same three passes as the AVX-512 path (ct_random_x86.c),
 * which says why the tile is partitioned by log1p's branch instead of
 * evaluating both formulas in every lane.
 *
 * What differs: AVX2 has no compress / expand instructions. A lane mask
 * (movemask, 8 bits) indexes a table of 8 lane numbers (bytes); widened,
 * they are the index vector of one vpermps, which packs the selected lanes to the front (compress, then a
 * full-width unaligned store whose extra lanes the next store overwrites) or
 * spreads packed values back onto the selected lanes (expand, then a blend).
 * The tables are built once when the library loads.
 *
 * Every float operation is the one ct_random_math.h performs, in the same
 * order with the same fusion (contraction off: GCC would otherwise fuse the
 * intrinsics' a * b + c). tests/c/test_random.c sweeps every 32-bit word
 * through this path and the reference on CPUs with AVX2, and tiles of every
 * length 1..1024 for the partial-vector edges.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off", "no-math-errno", "no-trapping-math")
#endif

#include "ct_random_x86.h"

#include "ct_random_math.h"

#if CT_RANDOM_HAVE_X86

#include <immintrin.h>
#include <string.h>

#define CT_AVX2 __attribute__((target("avx2,fma,popcnt")))

int ct_random_avx2_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// --- lane tables ---------------------------------------------------------------------

/* g_compress[m]: the set lanes of m in increasing order, byte k = the lane
 * that goes to position k. g_expand[m]: byte i = the packed position lane i
 * takes, popcount(m & ((1 << i) - 1)), for each set lane i. Unused bytes 0. */
static uint8_t g_compress[256][8], g_expand[256][8];

__attribute__((constructor)) static void lane_tables(void) {
    for (unsigned m = 0; m < 256; m++) {
        unsigned k = 0;
        memset(g_compress[m], 0, 8);
        memset(g_expand[m], 0, 8);
        for (unsigned i = 0; i < 8; i++) {
            if (!(m >> i & 1u)) continue;
            g_compress[m][k] = (uint8_t)i;
            g_expand[m][i] = (uint8_t)k;
            k++;
        }
    }
}

/* The 8 lane numbers of a table row as a vpermps index vector (one vpmovzxbd). */
CT_AVX2 static inline __m256i lane_index(const uint8_t *row) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)row));
}

/* The lanes of x selected by mask m, packed to the front (the rest: lane 0's value). */
CT_AVX2 static inline __m256 compress(__m256 x, unsigned m) {
    return _mm256_permutevar8x32_ps(x, lane_index(g_compress[m]));
}

/* Packed values p spread onto the lanes of mask m (other lanes: p[0]). */
CT_AVX2 static inline __m256 expand(__m256 p, unsigned m) {
    return _mm256_permutevar8x32_ps(p, lane_index(g_expand[m]));
}

// --- the math, as ct_random_math.h -------------------------------------------------

#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps

#define CT_VF __m256
#define CT_VFN CT_AVX2 static inline
#define CT_VSET1 SET1
#define CT_VFMA FMA
#define CT_VMUL MUL
#define CT_VADD ADD
#define CT_VSUB SUB
#define CT_VDIV _mm256_div_ps
#include "ct_random_vpoly.h"

/* ct_rm_uniform for float32 (maxps keeps its second operand unless the first
 * is greater: `u > mn ? u : mn`). */
CT_AVX2 static inline __m256 v_uniform(__m256i b, __m256 mn, __m256 rg) {
    __m256i bits = _mm256_or_si256(_mm256_srli_epi32(b, 9), _mm256_set1_epi32(0x3f800000));
    __m256 f = SUB(_mm256_castsi256_ps(bits), SET1(1.0f));
    return _mm256_max_ps(FMA(f, rg, mn), mn);
}

/* ct_rm_log for x > 0 finite (the only lanes the caller keeps). */
CT_AVX2 static inline __m256 v_log_pos(__m256 x) {
    __m256 xc = _mm256_max_ps(x, SET1(1.17549435e-38f));
    __m256i xi = _mm256_castps_si256(xc);
    __m256 e = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(126)));
    __m256 m = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32((int)0x807fffffu)),
                        _mm256_set1_epi32(0x3f000000)));
    __m256 lt = _mm256_cmp_ps(m, SET1(0.707106781186547524f), _CMP_LT_OQ);
    __m256 tmp = _mm256_and_ps(lt, m);
    m = SUB(m, SET1(1.0f));
    e = SUB(e, _mm256_and_ps(lt, SET1(1.0f)));
    m = ADD(m, tmp);
    return ct_vlog_poly(m, e);
}

CT_AVX2 static inline __m256 v_neg(__m256 x) { return _mm256_xor_ps(x, SET1(-0.0f)); }

/* ct_rm_erfinv_tail, with its |x| == 1 case. */
CT_AVX2 static inline __m256 v_erfinv_tail(__m256 x, __m256 w) {
    __m256 r = ct_verfinv_tail_poly(x, SUB(_mm256_sqrt_ps(w), SET1(3.0f)));
    __m256 one = _mm256_cmp_ps(_mm256_andnot_ps(SET1(-0.0f), x), SET1(1.0f), _CMP_EQ_OQ);
    return _mm256_blendv_ps(r, MUL(x, SET1(__builtin_inff())), one);
}

/* The sampler's constants as vectors, loaded once per tile (the compiler
 * cannot keep c's fields in registers across the stores to the output). */
typedef struct {
    __m256 sqrt2, clip_lo, clip_hi;
    int trunc;
} finish_consts;

/* sqrt2 * erfinv(u), then truncated_normal's clip (maxps / minps keep the
 * bound unless the value is strictly inside). */
CT_AVX2 static inline __m256 v_finish(const finish_consts *f, __m256 r) {
    __m256 x = MUL(f->sqrt2, r);
    if (f->trunc) {
        x = _mm256_max_ps(x, f->clip_lo);
        x = _mm256_min_ps(x, f->clip_hi);
    }
    return x;
}

// --- the tile ------------------------------------------------------------------------

#define TILE CT_RANDOM_X86_TILE
#define PAD (TILE + 16)

CT_AVX2 static void tile_normal(const ct_random_consts *c, int trunc, const uint32_t *b,
                                size_t m, float *out) {
    float ts[PAD] __attribute__((aligned(32)));   /* t of small-branch lanes, packed */
    float tl[PAD] __attribute__((aligned(32)));   /* t of log-branch lanes, packed */
    float uu[TILE] __attribute__((aligned(32)));  /* u in lane order */
    float res[TILE] __attribute__((aligned(32))); /* results, when m is not a whole vector */
    __m256 km[TILE / 8];                          /* small-branch lanes (all ones) */
    uint8_t ks[TILE / 8];                         /* the same as bits */
    uint32_t special[TILE];                       /* 1 + t not > 0: scalar reference */
    size_t ns = 0, nl = 0, nsp = 0;
    const __m256 mn = SET1(c->minval), rg = SET1(c->range);
    const finish_consts fc = { SET1(c->sqrt2), SET1(c->clip_lo), SET1(c->clip_hi), trunc };
    const size_t nv = (m + 7) / 8, rem = m % 8;
    const unsigned last_valid = rem ? (1u << rem) - 1u : 0xffu;
    float *dst = rem ? res : out;   /* whole vectors go straight to out */

    /* Pass 1: u, t = u * -u, and the branch split of log1p(t). */
    for (size_t i = 0; i < nv; i++) {
        size_t j = i * 8;
        unsigned valid = i + 1 < nv ? 0xffu : last_valid;
        __m256i bw;
        if (valid == 0xffu) {
            bw = _mm256_loadu_si256((const __m256i *)(b + j));
        } else {
            uint32_t tmp[8] = { 0 };
            memcpy(tmp, b + j, rem * 4);
            bw = _mm256_loadu_si256((const __m256i *)tmp);
        }
        __m256 u = v_uniform(bw, mn, rg);
        _mm256_store_ps(uu + j, u);
        __m256 t = MUL(u, v_neg(u));
        __m256 at = _mm256_andnot_ps(SET1(-0.0f), t);
        km[i] = _mm256_cmp_ps(at, SET1(CT_LOG1P_SMALL), _CMP_LT_OQ);
        unsigned small = (unsigned)_mm256_movemask_ps(km[i]) & valid;
        unsigned large = valid & ~small;
        _mm256_storeu_ps(ts + ns, compress(t, small));
        _mm256_storeu_ps(tl + nl, compress(t, large));
        ns += (size_t)__builtin_popcount(small);
        nl += (size_t)__builtin_popcount(large);
        ks[i] = (uint8_t)small;
        /* 1 + t > 0 fails only for |u| == 1 (t == -1) or NaN. */
        unsigned bad =
            (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(t, SET1(-1.0f), _CMP_NGT_UQ)) & valid;
        while (bad) {
            special[nsp++] = (uint32_t)(j + (size_t)__builtin_ctz(bad));
            bad &= bad - 1u;
        }
    }
    /* Pass 2: w = -log1p(t), each formula on its own packed lanes. Zero the
     * padding up to the last whole vector pass 2 computes and pass 3's loads
     * read (their extra lanes are never used). */
    for (size_t i = ns, e = (ns + 7) / 8 * 8 + 8; i < e; i++) ts[i] = 0.0f;
    for (size_t i = nl, e = (nl + 7) / 8 * 8 + 8; i < e; i++) tl[i] = 0.0f;
    for (size_t i = 0; i < ns; i += 8)
        _mm256_store_ps(ts + i, v_neg(ct_vlog1p_small(_mm256_load_ps(ts + i))));
    for (size_t i = 0; i < nl; i += 8)
        _mm256_store_ps(tl + i, v_neg(v_log_pos(ADD(_mm256_load_ps(tl + i), SET1(1.0f)))));
    /* Pass 3: w back in lane order, erf_inv's central branch, store; lanes
     * needing the tail (w >= 5 or NaN, about 1 in 300) are packed (u, w, position). */
    float tu[PAD] __attribute__((aligned(32))), tw[PAD] __attribute__((aligned(32)));
    uint32_t tpos[PAD];
    size_t ps = 0, pl = 0, nt = 0;
    for (size_t i = 0; i < nv; i++) {
        size_t j = i * 8;
        unsigned valid = i + 1 < nv ? 0xffu : last_valid;
        unsigned small = ks[i], large = valid & ~small;
        __m256 w = _mm256_blendv_ps(expand(_mm256_loadu_ps(tl + pl), large),
                                    expand(_mm256_loadu_ps(ts + ps), small), km[i]);
        ps += (size_t)__builtin_popcount(small);
        pl += (size_t)__builtin_popcount(large);
        __m256 u = _mm256_load_ps(uu + j);
        _mm256_storeu_ps(dst + j, v_finish(&fc, ct_verfinv_central(u, w)));
        unsigned tail =
            (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(w, SET1(5.0f), _CMP_NLT_UQ)) & valid;
        if (tail) {
            _mm256_storeu_ps(tu + nt, compress(u, tail));
            _mm256_storeu_ps(tw + nt, compress(w, tail));
            while (tail) {
                tpos[nt++] = (uint32_t)(j + (size_t)__builtin_ctz(tail));
                tail &= tail - 1u;
            }
        }
    }
    for (size_t i = nt; i < (nt + 7) / 8 * 8; i++) tu[i] = tw[i] = 0.0f;
    for (size_t i = 0; i < nt; i += 8) {
        float r[8] __attribute__((aligned(32)));
        __m256 u = _mm256_load_ps(tu + i), w = _mm256_load_ps(tw + i);
        _mm256_store_ps(r, v_finish(&fc, v_erfinv_tail(u, w)));
        for (size_t q = 0; q < 8 && i + q < nt; q++) dst[tpos[i + q]] = r[q];
    }
    for (size_t i = 0; i < nsp; i++) {
        uint32_t j = special[i];
        dst[j] = ct_rm_sample_unscaled(c, c->dist, CT_F32, b[j]);
    }
    if (c->has_scale) { /* ct_rm_sample: v * scale, one rounding for float32 */
        const __m256 sc = SET1(c->scale);
        for (size_t j = 0; j < nv * 8; j += 8)
            _mm256_storeu_ps(dst + j, MUL(_mm256_loadu_ps(dst + j), sc));
    }
    if (rem) memcpy(out, res, m * sizeof(float));
}

int ct_random_tile_normal_f32_avx2(const ct_random_consts *c, const uint32_t *b, size_t m,
                                   float *out) {
    if (c->dt != CT_F32 || m > TILE ||
        (c->dist != CT_DIST_NORMAL && c->dist != CT_DIST_TRUNCATED_NORMAL))
        return 0;
    tile_normal(c, c->dist == CT_DIST_TRUNCATED_NORMAL, b, m, out);
    return 1;
}

#endif /* CT_RANDOM_HAVE_X86 */
