/*
 * ct_optim.c — the fused multi-tensor optimizer driver and its stages.
 *
 * See ct_optim.h for the model. Layout of this file:
 *   --- stages       one static inline function per elementwise stage, on a chunk
 *   --- driver       chunk tables, reduction passes, the fused pass
 *   --- reference    a plain one-element-at-a-time version for the tests
 */
#include "ct_optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

static const int kind_nslots[CT_OPT_NUM_KINDS] = {
    [CT_OPT_SCALE] = 0, [CT_OPT_ADAM] = 2, [CT_OPT_DECAY] = 0, [CT_OPT_TRACE] = 1,
    [CT_OPT_LION] = 1,  [CT_OPT_RMS] = 1,  [CT_OPT_RSS] = 1,   [CT_OPT_CLIP] = 0,
    [CT_OPT_GLOBAL_NORM] = 0, [CT_OPT_TRUST_RATIO] = 0, [CT_OPT_FINITE_GATE] = 0,
    [CT_OPT_EMA] = 1,
};

int ct_opt_kind_nslots(int kind) {
    return (kind >= 0 && kind < CT_OPT_NUM_KINDS) ? kind_nslots[kind] : -1;
}

static int kind_is_reduction(int kind) {
    return kind == CT_OPT_GLOBAL_NORM || kind == CT_OPT_TRUST_RATIO ||
           kind == CT_OPT_FINITE_GATE;
}

static int kind_needs_params(int kind) {
    return kind == CT_OPT_DECAY || kind == CT_OPT_TRUST_RATIO;
}

// ---------------------------------------------------------------------------------------------
// stages
//
// Each works on n elements of the chunk u (in place). `W` is a compile-time
// constant after inlining: 1 writes the stage's state, 0 (the read-only
// reduction passes) only computes u.

#define CT_INLINE static inline __attribute__((always_inline))

/* x = sqrt(x) over a chunk. A loop of sqrtf does not vectorise under the
 * default -fmath-errno (GCC keeps the errno path), so the square roots of a
 * stage are gathered into a scratch chunk and taken 4 at a time. sqrtps is
 * correctly rounded, like sqrtf: results are bitwise those of the reference. */
CT_INLINE void v_sqrt(float *restrict x, int64_t n) {
    int64_t i = 0;
#if defined(__SSE__)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = sqrtf(x[i]);
}

CT_INLINE void st_scale(float *restrict u, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) u[i] = s * u[i];
}

CT_INLINE void st_decay(float *restrict u, const float *restrict p, int64_t n, float wd) {
    for (int64_t i = 0; i < n; i++) u[i] = u[i] + wd * p[i];
}

CT_INLINE void st_adam(float *restrict u, float *restrict m, float *restrict v, int64_t n,
                       const double *s, const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1], eps = (float)s[2], eps_root = (float)s[3];
    const float bc1 = (float)s[4], bc2 = (float)s[5], bc1n = (float)s[7];
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    /* Bias corrections as multiplications by their reciprocals (divps is the
     * bottleneck on SSE): within an ulp of optax's divisions. */
    const float ibc1 = 1.0f / bc1, ibc2 = 1.0f / bc2, ibc1n = 1.0f / bc1n;
    float d[CT_OPT_CHUNK] __attribute__((aligned(64)));
    if (s[6] != 0.0) { /* nesterov: b1*mu/(1-b1^(t+1)) + (1-b1)*g/(1-b1^t) */
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float mi = c1 * g + b1 * m[i];
            float vi = c2 * (g * g) + b2 * v[i];
            u[i] = b1 * (mi * ibc1n) + c1 * (g * ibc1);
            d[i] = vi * ibc2 + eps_root;
            if (W) { m[i] = mi; v[i] = vi; }
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float g = u[i];
            float mi = c1 * g + b1 * m[i];
            float vi = c2 * (g * g) + b2 * v[i];
            u[i] = mi * ibc1;
            d[i] = vi * ibc2 + eps_root;
            if (W) { m[i] = mi; v[i] = vi; }
        }
    }
    v_sqrt(d, n);
    for (int64_t i = 0; i < n; i++) u[i] = u[i] / (d[i] + eps);
}

CT_INLINE void st_trace(float *restrict u, float *restrict t, int64_t n, const double *s,
                        const int W) {
    const float d = (float)s[0];
    const int nesterov = s[1] != 0.0;
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float ti = g + d * t[i];
        u[i] = nesterov ? g + d * ti : ti;
        if (W) t[i] = ti;
    }
}

CT_INLINE void st_lion(float *restrict u, float *restrict m, int64_t n, const double *s,
                       const int W) {
    const float b1 = (float)s[0], b2 = (float)s[1];
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float x = (1.0f - b1) * g + b1 * m[i];
        u[i] = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); /* sign; keeps 0 and NaN */
        if (W) m[i] = (1.0f - b2) * g + b2 * m[i];
    }
}

CT_INLINE void st_rms(float *restrict u, float *restrict v, int64_t n, const double *s,
                      const int W) {
    const float dc = (float)s[0], eps = (float)s[1], bc = (float)s[3];
    const int in_sqrt = s[2] != 0.0;
    float d[CT_OPT_CHUNK] __attribute__((aligned(64)));
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float vi = (1.0f - dc) * (g * g) + dc * v[i];
        d[i] = in_sqrt ? vi / bc + eps : vi / bc;
        if (W) v[i] = vi;
    }
    v_sqrt(d, n);
    if (in_sqrt)
        for (int64_t i = 0; i < n; i++) u[i] = (1.0f / d[i]) * u[i];
    else
        for (int64_t i = 0; i < n; i++) u[i] = (1.0f / (d[i] + eps)) * u[i];
}

CT_INLINE void st_rss(float *restrict u, float *restrict a, int64_t n, const double *s,
                      const int W) {
    const float eps = (float)s[0];
    float d[CT_OPT_CHUNK] __attribute__((aligned(64)));
    float e[CT_OPT_CHUNK] __attribute__((aligned(64)));
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        float ai = g * g + a[i];
        e[i] = ai;
        d[i] = ai + eps;
        if (W) a[i] = ai;
    }
    v_sqrt(d, n);
    for (int64_t i = 0; i < n; i++) u[i] = (e[i] > 0.0f ? 1.0f / d[i] : 0.0f) * u[i];
}

CT_INLINE void st_ema(float *restrict u, float *restrict e, int64_t n, const double *s,
                      const int W) {
    const float d = (float)s[0], bc = (float)s[1];
    for (int64_t i = 0; i < n; i++) {
        float ei = (1.0f - d) * u[i] + d * e[i];
        u[i] = ei / bc;
        if (W) e[i] = ei;
    }
}

CT_INLINE void st_clip(float *restrict u, int64_t n, float mx) {
    for (int64_t i = 0; i < n; i++) {
        float x = u[i] < -mx ? -mx : u[i];
        u[i] = x > mx ? mx : x;
    }
}

// ---------------------------------------------------------------------------------------------
// driver

typedef struct {
    const ct_opt_stage *st;
    int nstages;
    int slot_off[CT_OPT_MAX_STAGES];
    uint32_t skip;                    /* stages covered by a rejecting gate */
    uint32_t zero;                    /* rejecting gates: u = 0 there */
    float norm[CT_OPT_MAX_STAGES];    /* GLOBAL_NORM: the norm */
    int clip[CT_OPT_MAX_STAGES];      /* GLOBAL_NORM: 1 when u must be rescaled */
    float *trust[CT_OPT_MAX_STAGES];  /* TRUST_RATIO: per-leaf factor */
    int acc_p;                        /* reduction pass also sums p^2 (trust ratio) */
} ct_opt_ctx;

typedef struct {
    int32_t block;
    int64_t off;
} ct_opt_chunk;

/* Run stages [0, upto) on chunk [off, off+n) of block b. acc != NULL: reduction
 * pass (accumulate, write nothing); else write state and p/out when `write`. */
static void chunk_run(const ct_opt_ctx *c, const ct_opt_block *b, int64_t off, int64_t n,
                      int upto, float *restrict u, double *acc) {
    const int W = acc == NULL;
    const float *g = b->g + off;
    const float *p = b->p ? b->p + off : NULL;
    for (int64_t i = 0; i < n; i++) u[i] = g[i];
    for (int k = 0; k < upto; k++) {
        if (!((b->active >> k) & 1u) || ((c->skip >> k) & 1u)) continue;
        const ct_opt_stage *s = &c->st[k];
        float *s0 = kind_nslots[s->kind] > 0 ? b->slot[c->slot_off[k]] + off : NULL;
        float *s1 = kind_nslots[s->kind] > 1 ? b->slot[c->slot_off[k] + 1] + off : NULL;
        switch (s->kind) {
        case CT_OPT_SCALE: st_scale(u, n, (float)s->s[0]); break;
        case CT_OPT_DECAY: st_decay(u, p, n, (float)s->s[0]); break;
        case CT_OPT_CLIP: st_clip(u, n, (float)s->s[0]); break;
        case CT_OPT_ADAM:
            if (W) st_adam(u, s0, s1, n, s->s, 1); else st_adam(u, s0, s1, n, s->s, 0);
            break;
        case CT_OPT_TRACE:
            if (W) st_trace(u, s0, n, s->s, 1); else st_trace(u, s0, n, s->s, 0);
            break;
        case CT_OPT_LION:
            if (W) st_lion(u, s0, n, s->s, 1); else st_lion(u, s0, n, s->s, 0);
            break;
        case CT_OPT_RMS:
            if (W) st_rms(u, s0, n, s->s, 1); else st_rms(u, s0, n, s->s, 0);
            break;
        case CT_OPT_RSS:
            if (W) st_rss(u, s0, n, s->s, 1); else st_rss(u, s0, n, s->s, 0);
            break;
        case CT_OPT_EMA:
            if (W) st_ema(u, s0, n, s->s, 1); else st_ema(u, s0, n, s->s, 0);
            break;
        case CT_OPT_GLOBAL_NORM:
            if (c->clip[k]) {
                const float nrm = c->norm[k], mx = (float)s->s[0];
                for (int64_t i = 0; i < n; i++) u[i] = (u[i] / nrm) * mx;
            }
            break;
        case CT_OPT_TRUST_RATIO:
            st_scale(u, n, c->trust[k][b->leaf]);
            break;
        case CT_OPT_FINITE_GATE:
            if ((c->zero >> k) & 1u) memset(u, 0, (size_t)n * sizeof *u);
            break;
        default: break;
        }
    }
    if (acc != NULL) {
        double su = 0.0, sp = 0.0, bad = 0.0;
        for (int64_t i = 0; i < n; i++) {
            su += (double)u[i] * (double)u[i];
            bad += isfinite(u[i]) ? 0.0 : 1.0;
        }
        if (p != NULL && c->acc_p)
            for (int64_t i = 0; i < n; i++) sp += (double)p[i] * (double)p[i];
        acc[0] = su;
        acc[1] = sp;
        acc[2] = bad;
    } else if (b->out != NULL) {
        memcpy(b->out + off, u, (size_t)n * sizeof *u);
    } else {
        float *pw = b->p + off;
        for (int64_t i = 0; i < n; i++) pw[i] = pw[i] + u[i];
    }
}

/* Chunk table of a group (caller frees). */
static ct_status make_chunks(const ct_opt_group *grp, ct_opt_chunk **out, int64_t *nout,
                             int64_t *nelem) {
    int64_t nch = 0, tot = 0;
    for (int i = 0; i < grp->nblocks; i++) {
        nch += (grp->blocks[i].n + CT_OPT_CHUNK - 1) / CT_OPT_CHUNK;
        tot += grp->blocks[i].n;
    }
    ct_opt_chunk *ch = malloc((size_t)(nch > 0 ? nch : 1) * sizeof *ch);
    if (ch == NULL) return ct_set_error(CT_EOOM, "optimizer step: out of host memory for %lld chunks", (long long)nch);
    int64_t j = 0;
    for (int i = 0; i < grp->nblocks; i++)
        for (int64_t off = 0; off < grp->blocks[i].n; off += CT_OPT_CHUNK) ch[j++] = (ct_opt_chunk){i, off};
    *out = ch;
    *nout = nch;
    *nelem = tot;
    return CT_OK;
}

#define CT_OPT_PAR_MIN 32768 /* below this many elements a group runs on one thread */

static void run_group(const ct_opt_ctx *c, const ct_opt_group *grp, const ct_opt_chunk *ch,
                      int64_t nch, int64_t nelem, int upto, double *acc) {
    /* dynamic: a core taken by another process must not hold up a static half */
#pragma omp parallel for schedule(dynamic, 8) if (nelem >= CT_OPT_PAR_MIN)
    for (int64_t j = 0; j < nch; j++) {
        float u[CT_OPT_CHUNK] __attribute__((aligned(64)));
        const ct_opt_block *b = &grp->blocks[ch[j].block];
        int64_t n = b->n - ch[j].off < CT_OPT_CHUNK ? b->n - ch[j].off : CT_OPT_CHUNK;
        chunk_run(c, b, ch[j].off, n, upto, u, acc ? acc + 3 * j : NULL);
    }
}

ct_status ct_optim_check(const ct_opt_stage *stages, int nstages) {
    if (nstages < 0 || nstages > CT_OPT_MAX_STAGES)
        return ct_set_error(CT_EINVAL, "optimizer: %d stages; at most %d are supported", nstages,
                            CT_OPT_MAX_STAGES);
    int slots = 0;
    for (int k = 0; k < nstages; k++) {
        int kind = stages[k].kind;
        if (kind < 0 || kind >= CT_OPT_NUM_KINDS)
            return ct_set_error(CT_EINVAL, "optimizer: stage %d has unknown kind %d", k, kind);
        slots += kind_nslots[kind];
        if (kind == CT_OPT_FINITE_GATE) {
            double cov = stages[k].s[0];
            if (!(cov >= 0 && k + 1 + cov <= nstages))
                return ct_set_error(CT_EINVAL, "optimizer: gate %d covers %g stages of %d", k, cov,
                                    nstages - k - 1);
        }
    }
    if (slots > CT_OPT_MAX_SLOTS)
        return ct_set_error(CT_EINVAL, "optimizer: %d state arrays per leaf; at most %d are supported",
                            slots, CT_OPT_MAX_SLOTS);
    return CT_OK;
}

static ct_status check_blocks(const ct_opt_ctx *c, const ct_opt_group *groups, int ngroups,
                              int nleaves) {
    for (int gi = 0; gi < ngroups; gi++) {
        for (int i = 0; i < groups[gi].nblocks; i++) {
            const ct_opt_block *b = &groups[gi].blocks[i];
            if (b->n < 0 || b->leaf < 0 || b->leaf >= nleaves)
                return ct_set_error(CT_EINVAL, "optimizer: block %d of group %d is malformed", i, gi);
            if (b->n == 0) continue;
            if (b->g == NULL || (b->out == NULL && b->p == NULL))
                return ct_set_error(CT_EINVAL, "optimizer: block %d of group %d lacks grads or params", i, gi);
            for (int k = 0; k < c->nstages; k++) {
                if (!((b->active >> k) & 1u)) continue;
                int kind = c->st[k].kind;
                if (kind_needs_params(kind) && b->p == NULL)
                    return ct_set_error(CT_EINVAL, "optimizer: stage %d needs params (leaf %d)", k, b->leaf);
                for (int q = 0; q < kind_nslots[kind]; q++)
                    if (b->slot[c->slot_off[k] + q] == NULL)
                        return ct_set_error(CT_EINVAL, "optimizer: stage %d has no state array for leaf %d", k, b->leaf);
            }
        }
    }
    return CT_OK;
}

/* One read-only pass computing per-leaf sums of the u entering stage k. */
static ct_status reduce_pass(const ct_opt_ctx *c, const ct_opt_group *groups, int ngroups, int k,
                             double *leaf_acc, int nleaves) {
    memset(leaf_acc, 0, (size_t)nleaves * 3 * sizeof *leaf_acc);
    for (int gi = 0; gi < ngroups; gi++) {
        ct_opt_chunk *ch;
        int64_t nch, nelem;
        CT_TRY(make_chunks(&groups[gi], &ch, &nch, &nelem));
        double *acc = malloc((size_t)(nch > 0 ? nch : 1) * 3 * sizeof *acc);
        if (acc == NULL) {
            free(ch);
            return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
        }
        run_group(c, &groups[gi], ch, nch, nelem, k, acc);
        for (int64_t j = 0; j < nch; j++) { /* in chunk order: deterministic */
            const ct_opt_block *b = &groups[gi].blocks[ch[j].block];
            if (!b->counts) continue;
            for (int q = 0; q < 3; q++) leaf_acc[3 * b->leaf + q] += acc[3 * j + q];
        }
        free(acc);
        free(ch);
    }
    return CT_OK;
}

ct_status ct_optim_step(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                        int ngroups, int nleaves) {
    CT_TRY(ct_optim_check(stages, nstages));
    ct_opt_ctx c;
    memset(&c, 0, sizeof c);
    c.st = stages;
    c.nstages = nstages;
    for (int k = 0, off = 0; k < nstages; k++) {
        c.slot_off[k] = off;
        off += kind_nslots[stages[k].kind];
    }
    if (nleaves < 0) return ct_set_error(CT_EINVAL, "optimizer: negative leaf count");
    CT_TRY(check_blocks(&c, groups, ngroups, nleaves));

    ct_status st = CT_OK;
    double *leaf_acc = NULL;
    int nred = 0;
    for (int k = 0; k < nstages; k++) nred += kind_is_reduction(stages[k].kind);
    if (nred > 0) {
        leaf_acc = malloc((size_t)(nleaves > 0 ? nleaves : 1) * 3 * sizeof *leaf_acc);
        if (leaf_acc == NULL) return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
    }
    for (int k = 0; k < nstages && st == CT_OK; k++) {
        int kind = stages[k].kind;
        if (!kind_is_reduction(kind) || ((c.skip >> k) & 1u)) continue;
        c.acc_p = kind == CT_OPT_TRUST_RATIO;
        st = reduce_pass(&c, groups, ngroups, k, leaf_acc, nleaves);
        if (st != CT_OK) break;
        if (kind == CT_OPT_GLOBAL_NORM) {
            double ss = 0.0;
            for (int l = 0; l < nleaves; l++) ss += leaf_acc[3 * l];
            float nrm = (float)sqrt(ss);
            c.norm[k] = nrm;
            c.clip[k] = !(nrm < (float)stages[k].s[0]);
            stages[k].result = nrm;
        } else if (kind == CT_OPT_TRUST_RATIO) {
            float *t = malloc((size_t)(nleaves > 0 ? nleaves : 1) * sizeof *t);
            if (t == NULL) {
                st = ct_set_error(CT_EOOM, "optimizer step: out of host memory");
                break;
            }
            const float min_norm = (float)stages[k].s[0], coef = (float)stages[k].s[1],
                        eps = (float)stages[k].s[2];
            for (int l = 0; l < nleaves; l++) {
                float un = (float)sqrt(leaf_acc[3 * l]), pn = (float)sqrt(leaf_acc[3 * l + 1]);
                un = un <= min_norm ? min_norm : un;
                pn = pn <= min_norm ? min_norm : pn;
                t[l] = (pn == 0.0f || un == 0.0f) ? 1.0f : coef * pn / (un + eps);
            }
            c.trust[k] = t;
        } else { /* FINITE_GATE */
            double bad = 0.0;
            for (int l = 0; l < nleaves; l++) bad += leaf_acc[3 * l + 2];
            int finite = bad == 0.0;
            stages[k].result = finite;
            if (!finite && stages[k].s[1] == 0.0) { /* reject: zero updates, inner untouched */
                c.zero |= 1u << k;
                int cov = (int)stages[k].s[0];
                for (int q = k + 1; q <= k + cov; q++) c.skip |= 1u << q;
            }
        }
    }
    for (int gi = 0; gi < ngroups && st == CT_OK; gi++) {
        ct_opt_chunk *ch;
        int64_t nch, nelem;
        st = make_chunks(&groups[gi], &ch, &nch, &nelem);
        if (st != CT_OK) break;
        run_group(&c, &groups[gi], ch, nch, nelem, nstages, NULL);
        free(ch);
    }
    for (int k = 0; k < nstages; k++) free(c.trust[k]);
    free(leaf_acc);
    return st;
}

// ---------------------------------------------------------------------------------------------
// reference

ct_status ct_optim_reference(const ct_opt_stage *stages, int nstages, ct_opt_block *b) {
    CT_TRY(ct_optim_check(stages, nstages));
    int off[CT_OPT_MAX_STAGES];
    for (int k = 0, o = 0; k < nstages; k++) {
        if (kind_is_reduction(stages[k].kind))
            return ct_set_error(CT_EINVAL, "optimizer reference: stage %d is a reduction", k);
        off[k] = o;
        o += kind_nslots[stages[k].kind];
    }
    for (int64_t i = 0; i < b->n; i++) {
        float u = b->g[i];
        for (int k = 0; k < nstages; k++) {
            if (!((b->active >> k) & 1u)) continue;
            const double *s = stages[k].s;
            float *a = kind_nslots[stages[k].kind] > 0 ? &b->slot[off[k]][i] : NULL;
            float *v = kind_nslots[stages[k].kind] > 1 ? &b->slot[off[k] + 1][i] : NULL;
            float g = u;
            switch (stages[k].kind) {
            case CT_OPT_SCALE: u = (float)s[0] * u; break;
            case CT_OPT_DECAY: u = u + (float)s[0] * b->p[i]; break;
            case CT_OPT_CLIP: u = fminf(fmaxf(u, -(float)s[0]), (float)s[0]); break;
            case CT_OPT_ADAM: {
                float b1 = (float)s[0], b2 = (float)s[1];
                *a = (1.0f - b1) * g + b1 * *a;
                *v = (1.0f - b2) * (g * g) + b2 * *v;
                float ib1 = 1.0f / (float)s[4], ib2 = 1.0f / (float)s[5], ib1n = 1.0f / (float)s[7];
                float mh = s[6] != 0.0 ? b1 * (*a * ib1n) + (1.0f - b1) * (g * ib1) : *a * ib1;
                u = mh / (sqrtf(*v * ib2 + (float)s[3]) + (float)s[2]);
                break;
            }
            case CT_OPT_TRACE:
                *a = g + (float)s[0] * *a;
                u = s[1] != 0.0 ? g + (float)s[0] * *a : *a;
                break;
            case CT_OPT_LION: {
                float x = (1.0f - (float)s[0]) * g + (float)s[0] * *a;
                u = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
                *a = (1.0f - (float)s[1]) * g + (float)s[1] * *a;
                break;
            }
            case CT_OPT_RMS: {
                *a = (1.0f - (float)s[0]) * (g * g) + (float)s[0] * *a;
                float vh = *a / (float)s[3];
                u = (s[2] != 0.0 ? 1.0f / sqrtf(vh + (float)s[1]) : 1.0f / (sqrtf(vh) + (float)s[1])) * g;
                break;
            }
            case CT_OPT_RSS:
                *a = g * g + *a;
                u = (*a > 0.0f ? 1.0f / sqrtf(*a + (float)s[0]) : 0.0f) * g;
                break;
            case CT_OPT_EMA:
                *a = (1.0f - (float)s[0]) * g + (float)s[0] * *a;
                u = *a / (float)s[1];
                break;
            default: break;
            }
        }
        if (b->out != NULL) b->out[i] = u;
        else b->p[i] = b->p[i] + u;
    }
    return CT_OK;
}
