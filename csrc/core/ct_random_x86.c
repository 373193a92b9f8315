/*
 * ct_random_x86.c — the float32 normal / truncated-normal tile transform with
 * AVX-512, bit-identical to ct_random_math.h's scalar definition.
 *
 * Why a hand-written path: XLA's erf_inv starts with w = -log1p(-u*u), and
 * log1p picks one of two formulas per element (a rational approximation for
 * |t| < sqrt(2) - 1, about 64% of the lanes, else a full log of 1 + t). A
 * vectorised loop that selects has to evaluate both for every lane, and
 * together they are about two thirds of the transform's floating-point work.
 * Here each tile is partitioned instead: the first pass computes u and t and
 * compress-stores t into one of two packed arrays by branch; each formula
 * then runs only on its own packed array; the last pass expand-loads w back
 * into lane order, finishes erf_inv's central branch and stores. Lanes that
 * need erf_inv's tail (w >= 5 or NaN, about 1 in 300) are packed again and
 * finished in a short vector loop; lanes whose 1 + t is not positive (only
 * |u| == 1 or a NaN u, reachable from truncated_normal's bounds) are redone
 * with the scalar reference.
 *
 * Every float operation is the one ct_random_math.h performs, in the same
 * order with the same fusion (this file is compiled with contraction off, as
 * GCC would otherwise fuse the intrinsics' vector a * b + c). The exhaustive
 * test in tests/c/test_random.c (every 32-bit word through the fast path and
 * the reference) covers this path on CPUs with AVX-512.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off", "no-math-errno", "no-trapping-math")
#endif

#include "ct_random_x86.h"

#include "ct_random_math.h"

#if CT_RANDOM_HAVE_X86

#include <immintrin.h>

#define CT_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,popcnt,bmi2")))

int ct_random_avx512_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps

#define CT_VF __m512
#define CT_VFN CT_AVX512 static inline
#define CT_VSET1 SET1
#define CT_VFMA FMA
#define CT_VMUL MUL
#define CT_VADD ADD
#define CT_VSUB SUB
#define CT_VDIV _mm512_div_ps
#include "ct_random_vpoly.h"

/* ct_rm_uniform for float32: unit float from the word's top 23 bits, affine
 * map as one fma, then max(minval, .) (maxps keeps its second operand when
 * the first is not greater, exactly `u > mn ? u : mn`). */
CT_AVX512 static inline __m512 v_uniform(__m512i b, __m512 mn, __m512 rg) {
    __m512i bits = _mm512_or_si512(_mm512_srli_epi32(b, 9), _mm512_set1_epi32(0x3f800000));
    __m512 f = SUB(_mm512_castsi512_ps(bits), SET1(1.0f));
    return _mm512_max_ps(FMA(f, rg, mn), mn);
}

/* ct_rm_log for x >= 0 (or NaN), without its final special cases: the caller
 * only keeps lanes with x > 0 finite, where those cases do not apply. */
CT_AVX512 static inline __m512 v_log_pos(__m512 x) {
    __m512 xc = _mm512_max_ps(x, SET1(1.17549435e-38f));
    __m512i xi = _mm512_castps_si512(xc);
    __m512 e = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_srli_epi32(xi, 23), _mm512_set1_epi32(126)));
    __m512 m = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(xi, _mm512_set1_epi32((int)0x807fffffu)),
                        _mm512_set1_epi32(0x3f000000)));
    __mmask16 lt = _mm512_cmp_ps_mask(m, SET1(0.707106781186547524f), _CMP_LT_OQ);
    __m512 tmp = _mm512_maskz_mov_ps(lt, m);
    m = SUB(m, SET1(1.0f));
    e = SUB(e, _mm512_maskz_mov_ps(lt, SET1(1.0f)));
    m = ADD(m, tmp);
    return ct_vlog_poly(m, e);
}

CT_AVX512 static inline __m512 v_neg(__m512 x) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

/* ct_rm_erfinv's other branch (w >= 5 or NaN), with its |x| == 1 case. */
CT_AVX512 static inline __m512 v_erfinv_tail(__m512 x, __m512 w) {
    __m512 r = ct_verfinv_tail_poly(x, SUB(_mm512_sqrt_ps(w), SET1(3.0f)));
    __m512 ax = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
    __mmask16 one = _mm512_cmp_ps_mask(ax, SET1(1.0f), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(r, one, MUL(x, SET1(__builtin_inff())));
}

/* sqrt2 * erfinv(u), then truncated_normal's clip (maxps / minps keep the
 * bound unless the value is strictly inside: `x > lo ? x : lo`, `x < hi ? x : hi`). */
CT_AVX512 static inline __m512 v_finish(const ct_random_consts *c, int trunc, __m512 r) {
    __m512 x = MUL(SET1(c->sqrt2), r);
    if (trunc) {
        x = _mm512_max_ps(x, SET1(c->clip_lo));
        x = _mm512_min_ps(x, SET1(c->clip_hi));
    }
    return x;
}

#define TILE CT_RANDOM_X86_TILE
#define PAD (TILE + 32)

CT_AVX512 static void tile_normal(const ct_random_consts *c, int trunc, const uint32_t *b,
                                  size_t m, float *out) {
    float ts[PAD] __attribute__((aligned(64)));   /* t of small-branch lanes, packed */
    float tl[PAD] __attribute__((aligned(64)));   /* t of log-branch lanes, packed */
    float uu[TILE] __attribute__((aligned(64)));  /* u in lane order */
    __mmask16 ks[TILE / 16];                      /* small-branch lanes of each vector */
    __mmask16 kv[TILE / 16];                      /* valid lanes of each vector */
    uint32_t special[TILE];                       /* 1 + t not > 0: scalar reference */
    size_t ns = 0, nl = 0, nsp = 0;
    const __m512 mn = SET1(c->minval), rg = SET1(c->range);
    const size_t nv = (m + 15) / 16;

    /* Pass 1: u, t = u * -u, and the branch split of log1p(t). */
    for (size_t i = 0; i < nv; i++) {
        size_t j = i * 16;
        __mmask16 valid = m - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (m - j)) - 1u);
        __m512i bw = _mm512_maskz_loadu_epi32(valid, b + j);
        __m512 u = v_uniform(bw, mn, rg);
        _mm512_store_ps(uu + j, u);
        __m512 t = MUL(u, v_neg(u));
        __m512 at = _mm512_castsi512_ps(
            _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32(0x7fffffff)));
        __mmask16 small = _mm512_mask_cmp_ps_mask(valid, at, SET1(CT_LOG1P_SMALL), _CMP_LT_OQ);
        __mmask16 large = (__mmask16)(valid & ~small);
        _mm512_storeu_ps(ts + ns, _mm512_maskz_compress_ps(small, t));
        _mm512_storeu_ps(tl + nl, _mm512_maskz_compress_ps(large, t));
        ns += (size_t)__builtin_popcount(small);
        nl += (size_t)__builtin_popcount(large);
        ks[i] = small;
        kv[i] = valid;
        /* 1 + t > 0 fails only for |u| == 1 (t == -1) or NaN. */
        __mmask16 bad = _mm512_mask_cmp_ps_mask(valid, t, SET1(-1.0f), _CMP_NGT_UQ);
        while (bad) {
            special[nsp++] = (uint32_t)(j + (size_t)__builtin_ctz(bad));
            bad = (__mmask16)(bad & (bad - 1u));
        }
    }
    /* Pass 2: w = -log1p(t), each formula on its own packed lanes. Zero the
     * padding up to the last whole vector pass 2 computes and pass 3's
     * 16-wide loads read (their extra lanes are never used). */
    for (size_t i = ns, e = (ns + 15) / 16 * 16 + 16; i < e; i++) ts[i] = 0.0f;
    for (size_t i = nl, e = (nl + 15) / 16 * 16 + 16; i < e; i++) tl[i] = 0.0f;
    for (size_t i = 0; i < ns; i += 16) {
        __m512 t = _mm512_load_ps(ts + i);
        _mm512_store_ps(ts + i, v_neg(ct_vlog1p_small(t)));
    }
    for (size_t i = 0; i < nl; i += 16) {
        __m512 t = _mm512_load_ps(tl + i);
        _mm512_store_ps(tl + i, v_neg(v_log_pos(ADD(t, SET1(1.0f)))));
    }
    /* Pass 3: w back in lane order, erf_inv's central branch, store; lanes
     * needing the tail are packed (u, w, position). */
    float tu[PAD] __attribute__((aligned(64))), tw[PAD] __attribute__((aligned(64)));
    uint32_t tpos[PAD];
    size_t ps = 0, pl = 0, nt = 0;
    for (size_t i = 0; i < nv; i++) {
        size_t j = i * 16;
        __mmask16 small = ks[i], valid = kv[i], large = (__mmask16)(valid & ~small);
        __m512 w = _mm512_maskz_expand_ps(large, _mm512_loadu_ps(tl + pl));
        w = _mm512_mask_expand_ps(w, small, _mm512_loadu_ps(ts + ps));
        ps += (size_t)__builtin_popcount(small);
        pl += (size_t)__builtin_popcount(large);
        __m512 u = _mm512_load_ps(uu + j);
        __m512 x = v_finish(c, trunc, ct_verfinv_central(u, w));
        _mm512_mask_storeu_ps(out + j, valid, x);
        __mmask16 tail = _mm512_mask_cmp_ps_mask(valid, w, SET1(5.0f), _CMP_NLT_UQ);
        if (tail) {
            _mm512_storeu_ps(tu + nt, _mm512_maskz_compress_ps(tail, u));
            _mm512_storeu_ps(tw + nt, _mm512_maskz_compress_ps(tail, w));
            while (tail) {
                tpos[nt++] = (uint32_t)(j + (size_t)__builtin_ctz(tail));
                tail = (__mmask16)(tail & (tail - 1u));
            }
        }
    }
    for (size_t i = 0; i < nt; i += 16) {
        __mmask16 k = nt - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nt - i)) - 1u);
        __m512 u = _mm512_maskz_loadu_ps(k, tu + i), w = _mm512_maskz_loadu_ps(k, tw + i);
        float r[16] __attribute__((aligned(64)));
        _mm512_store_ps(r, v_finish(c, trunc, v_erfinv_tail(u, w)));
        for (size_t q = 0; q < 16 && i + q < nt; q++) out[tpos[i + q]] = r[q];
    }
    for (size_t i = 0; i < nsp; i++) {
        uint32_t j = special[i];
        out[j] = ct_rm_sample_unscaled(c, c->dist, CT_F32, b[j]);
    }
    if (c->has_scale) { /* ct_rm_sample: v * scale, one rounding for float32 */
        const __m512 sc = SET1(c->scale);
        for (size_t i = 0; i < nv; i++) {
            __mmask16 valid = kv[i];
            float *o = out + i * 16;
            _mm512_mask_storeu_ps(o, valid, MUL(_mm512_maskz_loadu_ps(valid, o), sc));
        }
    }
}

int ct_random_tile_normal_f32_avx512(const ct_random_consts *c, const uint32_t *b, size_t m,
                                     float *out) {
    if (c->dt != CT_F32 || m > TILE ||
        (c->dist != CT_DIST_NORMAL && c->dist != CT_DIST_TRUNCATED_NORMAL))
        return 0;
    tile_normal(c, c->dist == CT_DIST_TRUNCATED_NORMAL, b, m, out);
    return 1;
}

#endif /* CT_RANDOM_HAVE_X86 */
