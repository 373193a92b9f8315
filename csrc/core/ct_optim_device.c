/*
 * ct_optim_device.c — the optimizer step for device groups on GPUs.
 *
 * ct_optim_step sends here when every group of a step lives on a GPU device
 * (a step that mixes CPU and GPU groups is refused there). The per-element
 * math is ct_optim_math.h; the backend runs it (ct_backend.optim_pass, one
 * launch per device and pass: csrc/backend/cuda/cuda_optim.cu). This file
 * only sequences passes and combines reductions:
 *
 *   for each reduction stage k (GLOBAL_NORM, FINITE_GATE), in order:
 *       every device: a read-only pass over its counting blocks (replica 0 of
 *       each global block, so each global element counts once) computing the
 *       u entering stage k -> (sum u^2, non-finite count) in double;
 *       GLOBAL_NORM: the sums stay on the devices (reduce = 2, see
 *       ct_opt_pass): each later pass waits for every device's reduce pass
 *       (stream events, no host wait) and computes the norm itself, adding
 *       the devices' sums in group order, exactly as the host would;
 *       FINITE_GATE (and GLOBAL_NORM with CTRAINSTATE_HOST_NORM=1): HOST ROUND
 *       TRIP: each device's sums come back to the host (the pass waits for its
 *       stream), are added in device order (deterministic), and the result
 *       (the gate's verdict, or norm and clip flag) goes into the fp32
 *       constants of stage k for the later passes (the gate's verdict also
 *       decides, on the host, which stages the step skips);
 *   every device: the fused apply pass, queued on its stream (no host wait).
 *
 *   per-leaf stages k (TRUST_RATIO: lamb / lars / fromage, BLOCK_RMS,
 *       PARAM_RMS): a read-only pass per device returns, per block, the sums of
 *       u^2 and p^2 (reduce = 3, a host round trip); they are added per leaf
 *       over the devices (group order, block order), the leaf's factor is
 *       ct_opt_leaf_factor's (as on CPU), and later passes get one factor per
 *       block (blk_f);
 *   adafactor's FACTORED stage k (one per step): a read-only pass per device
 *       (reduce = 4) returns each counting factored block's statistics of
 *       (u^2 + eps), summed over each factored dim (a host round trip); v_row
 *       and v_col of every factored block come to the host (small: one row or
 *       column per block; one batch per device, ct_backend.copy_segments: a
 *       host round trip), the CPU driver's own combine step
 *       (ct_opt_factored_combine: sums over the blocks sharing a statistic, new
 *       v_row / v_col, row and column factors) runs there, and v_row / v_col
 *       and the factors go back to the devices (one batch per device, queued
 *       on its stream: no host wait); later passes multiply each element by
 *       its factors (ct_opt_pass.ffac). Factor buffers are allocated on the
 *       devices before any pass.
 * A step with two FACTORED stages, or on a backend without these passes
 * (optim_factored = 0), or with CTRAINSTATE_STAGE_FACTORED=1, runs whole
 * through host staging instead: every array of every block is copied to host
 * memory, the CPU driver runs the step there, and what it wrote (params or
 * updates, state) is copied back. Correct (the CPU driver's results) but bound
 * by the copies; allocated before anything is written. Every array travels in
 * its own dtype (16-bit ones too: ct_optim.h), and so do adafactor's v_row /
 * v_col on their way through the host.
 * So a chain without reductions costs one launch per device and no sync; a
 * clip_by_global_norm chain one extra read of g per device and no sync either;
 * apply_if_finite one sync; adafactor (defaults) four waits per device,
 * however many leaves it has: three passes (its statistics, the block RMS clip
 * and the parameter scale) and the batch of v_row / v_col copies to the host
 * (the batch back does not wait). On a backend without copy_segments each of
 * those copies is a copy_block of its own, a round trip each. A device error
 * after FACTORED wrote v_row / v_col leaves them one step ahead of the params
 * (the CPU driver writes them at the same point); an error while they are
 * written back leaves the devices already written one step ahead, the others
 * not. A device-resident norm is not read back: stages[k].result is NaN for it.
 *
 * Across processes (ct_optim_step_procs with GPU groups; another process's
 * groups carry no device and no buffers): the same passes run over this
 * process's groups, and every reduction is a host round trip. GLOBAL_NORM
 * and FINITE_GATE take reduce = 1 (no device-resident norm: the board is
 * this process's); the per-device sums of every process are exchanged
 * (ct_opt_procs.allgather, one call per reduction) and added in group order,
 * so every process gets the one-process step's norm, verdict and per-leaf
 * factors bit for bit (reduce = 1's sums are reduce = 2's). The per-leaf
 * stages exchange their per-block sums the same way. A step with a FACTORED
 * stage is staged whole (host_staged_step): the CPU driver's step across
 * processes (ct_optim_step_procs on the host copies) combines the statistics,
 * so adafactor gives the one-process run's results under
 * CTRAINSTATE_STAGE_FACTORED=1 (the CPU driver's arithmetic, not the GPU
 * statistics pass's order of sums).
 */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ct_device.h"
#include "ct_optim.h"
#include "ct_optim_math.h"

/* The arrays of one block (host staging), in their dtypes. */
typedef struct {
    void *p, *g, *out, *slot[CT_OPT_MAX_SLOTS];
} staged_block;

/* n elements of dtype dt. */
static ct_status stage_copy(struct ct_device *dst_dev, struct ct_device *src_dev, void *dst,
                            const void *src, int64_t n, int dt, struct ct_device *dev) {
    if (n <= 0 || dst == NULL || src == NULL) return CT_OK;
    const int64_t stride = (int64_t)ct_dtype_size((ct_dtype)dt);
    return dev->backend->copy_block(dst_dev, src_dev, 1, &n, (size_t)stride, dst, &stride, src,
                                    &stride);
}

/* Bytes of n (at least 1) elements of dtype dt. */
static size_t dt_bytes(int64_t n, int dt) {
    return (size_t)(n > 0 ? n : 1) * ct_dtype_size((ct_dtype)dt);
}

/* Whether group gi is this process's (always, in a step of one process). */
static int mine(const ct_opt_procs *pr, int gi) {
    return pr == NULL || pr->group_proc[gi] == pr->rank;
}

/* A step with a stage the GPU passes do not implement: through host memory and the CPU
 * driver (see the top of the file); across processes (pr) the CPU driver's step across
 * processes, another process's groups as they are (no buffers). */
static ct_status host_staged_step(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                                  int ngroups, const ct_opt_procs *pr) {
    int64_t nblk = 0;
    int nleaves = 0;
    for (int gi = 0; gi < ngroups; gi++) {
        nblk += groups[gi].nblocks;
        for (int i = 0; i < groups[gi].nblocks; i++)
            if (groups[gi].blocks[i].leaf >= nleaves) nleaves = groups[gi].blocks[i].leaf + 1;
    }
    const size_t nb = (size_t)(nblk > 0 ? nblk : 1);
    ct_opt_group *hg = calloc((size_t)(ngroups > 0 ? ngroups : 1), sizeof *hg);
    ct_opt_block *hb = calloc(nb, sizeof *hb);
    staged_block *sb = calloc(nb, sizeof *sb);
    ct_status st = (hg && hb && sb) ? CT_OK : ct_set_error(CT_EOOM, "optimizer: out of host memory");
    int64_t j = 0;
    for (int gi = 0; gi < ngroups && st == CT_OK; gi++) {
        hg[gi].blocks = hb + j;
        hg[gi].nblocks = groups[gi].nblocks;
        hg[gi].dev = NULL; /* the CPU driver */
        for (int i = 0; i < groups[gi].nblocks && st == CT_OK; i++, j++) {
            const ct_opt_block *b = &groups[gi].blocks[i];
            hb[j] = *b; /* the dtypes too */
            if (!mine(pr, gi)) continue; /* another process's: no buffers */
            if (b->p) st = (sb[j].p = malloc(dt_bytes(b->n, b->p_dt))) ? st : CT_EOOM;
            if (b->g) st = (sb[j].g = malloc(dt_bytes(b->n, b->g_dt))) ? st : CT_EOOM;
            if (b->out) st = (sb[j].out = malloc(dt_bytes(b->n, b->out_dt))) ? st : CT_EOOM;
            for (int q = 0; q < CT_OPT_MAX_SLOTS && st == CT_OK; q++)
                if (b->slot[q])
                    st = (sb[j].slot[q] = malloc(dt_bytes(b->slot_n[q], b->slot_dt[q]))) ? st : CT_EOOM;
            hb[j].p = sb[j].p;
            hb[j].g = sb[j].g;
            hb[j].out = sb[j].out;
            for (int q = 0; q < CT_OPT_MAX_SLOTS; q++) hb[j].slot[q] = sb[j].slot[q];
        }
    }
    if (st == CT_EOOM) st = ct_set_error(CT_EOOM, "optimizer: out of host memory staging a step");
    /* down: everything the CPU driver reads */
    j = 0;
    for (int gi = 0; gi < ngroups && st == CT_OK; gi++)
        for (int i = 0; i < groups[gi].nblocks && st == CT_OK; i++, j++) {
            if (!mine(pr, gi)) continue;
            const ct_opt_block *b = &groups[gi].blocks[i];
            ct_device *dev = groups[gi].dev;
            st = stage_copy(NULL, dev, sb[j].p, b->p, b->n, b->p_dt, dev);
            if (st == CT_OK) st = stage_copy(NULL, dev, sb[j].g, b->g, b->n, b->g_dt, dev);
            for (int q = 0; q < CT_OPT_MAX_SLOTS && st == CT_OK; q++)
                st = stage_copy(NULL, dev, sb[j].slot[q], b->slot[q], b->slot_n[q], b->slot_dt[q],
                                dev);
        }
    if (st == CT_OK) st = ct_optim_step_procs(stages, nstages, hg, ngroups, nleaves, pr);
    /* up: what it wrote (params or updates, and the state) */
    j = 0;
    for (int gi = 0; gi < ngroups && st == CT_OK; gi++)
        for (int i = 0; i < groups[gi].nblocks && st == CT_OK; i++, j++) {
            if (!mine(pr, gi)) continue;
            const ct_opt_block *b = &groups[gi].blocks[i];
            ct_device *dev = groups[gi].dev;
            if (b->out) st = stage_copy(dev, NULL, b->out, sb[j].out, b->n, b->out_dt, dev);
            else st = stage_copy(dev, NULL, b->p, sb[j].p, b->n, b->p_dt, dev);
            for (int q = 0; q < CT_OPT_MAX_SLOTS && st == CT_OK; q++)
                st = stage_copy(dev, NULL, b->slot[q], sb[j].slot[q], b->slot_n[q], b->slot_dt[q],
                                dev);
        }
    for (int64_t k = 0; sb != NULL && k < nblk; k++) {
        free(sb[k].p);
        free(sb[k].g);
        free(sb[k].out);
        for (int q = 0; q < CT_OPT_MAX_SLOTS; q++) free(sb[k].slot[q]);
    }
    free(sb);
    free(hb);
    free(hg);
    return st;
}

static int gpu_kind(int kind) {
    return ct_om_is_elementwise(kind) || ct_om_is_leafwise(kind) || kind == CT_OPT_GLOBAL_NORM ||
           kind == CT_OPT_FINITE_GATE;
}

/* Buffers of adafactor's FACTORED stage on GPU devices (one stage per step), per block in
 * global order; allocated before any pass, so a failed allocation changes nothing. */
typedef struct {
    int k;                 /* the stage, -1: none */
    int64_t nb;
    ct_opt_block *hb;      /* host views of the blocks: slot[o], slot[o+1] -> vrow, vcol */
    const ct_opt_block **db; /* the blocks themselves */
    ct_device **dev;       /* each block's device */
    double **stat;         /* statistics (blocks that count), host */
    float **fac;           /* factors, host */
    void **vrow, **vcol;   /* host copies of v_row / v_col (in their dtypes) */
    float **dfac;          /* factors on the block's device */
    size_t *dfac_bytes;
    void **seg_dst;        /* one device's batch of copies (copy_segments): 3 per block */
    const void **seg_src;
    size_t *seg_bytes;
} fact_bufs;

static void free_fact_bufs(fact_bufs *fb) {
    for (int64_t i = 0; i < fb->nb; i++) {
        if (fb->stat) free(fb->stat[i]);
        if (fb->fac) free(fb->fac[i]);
        if (fb->vrow) free(fb->vrow[i]);
        if (fb->vcol) free(fb->vcol[i]);
        if (fb->dfac && fb->dfac[i]) ct_device_free(fb->dev[i], fb->dfac[i], fb->dfac_bytes[i]);
    }
    free(fb->hb);
    free(fb->db);
    free(fb->dev);
    free(fb->stat);
    free(fb->fac);
    free(fb->vrow);
    free(fb->vcol);
    free(fb->dfac);
    free(fb->dfac_bytes);
    free(fb->seg_dst);
    free(fb->seg_src);
    free(fb->seg_bytes);
    memset(fb, 0, sizeof *fb);
    fb->k = -1;
}

static ct_status init_fact_bufs(fact_bufs *fb, int k, int slot_off, const ct_opt_group *groups,
                                int ngroups) {
    int64_t nb = 0;
    for (int gi = 0; gi < ngroups; gi++) nb += groups[gi].nblocks;
    const size_t n = (size_t)(nb > 0 ? nb : 1);
    fb->k = k;
    fb->nb = nb;
    fb->hb = calloc(n, sizeof *fb->hb);
    fb->db = calloc(n, sizeof *fb->db);
    fb->dev = calloc(n, sizeof *fb->dev);
    fb->stat = calloc(n, sizeof *fb->stat);
    fb->fac = calloc(n, sizeof *fb->fac);
    fb->vrow = calloc(n, sizeof *fb->vrow);
    fb->vcol = calloc(n, sizeof *fb->vcol);
    fb->dfac = calloc(n, sizeof *fb->dfac);
    fb->dfac_bytes = calloc(n, sizeof *fb->dfac_bytes);
    fb->seg_dst = calloc(3 * n, sizeof *fb->seg_dst);
    fb->seg_src = calloc(3 * n, sizeof *fb->seg_src);
    fb->seg_bytes = calloc(3 * n, sizeof *fb->seg_bytes);
    if (!fb->hb || !fb->db || !fb->dev || !fb->stat || !fb->fac || !fb->vrow || !fb->vcol ||
        !fb->dfac || !fb->dfac_bytes || !fb->seg_dst || !fb->seg_src || !fb->seg_bytes)
        return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
    int64_t i = 0;
    for (int gi = 0; gi < ngroups; gi++)
        for (int j = 0; j < groups[gi].nblocks; j++, i++) {
            const ct_opt_block *b = &groups[gi].blocks[j];
            fb->db[i] = b;
            fb->hb[i] = *b;
            fb->dev[i] = groups[gi].dev;
            if (b->n == 0 || !((b->active >> k) & 1u) || b->geom.ndim == 0) continue;
            const ct_om_fg f = ct_om_fgeom(&b->geom);
            const size_t ns = (size_t)(f.n_nolo + f.n_nohi);
            if (b->counts && (fb->stat[i] = calloc(ns, sizeof(double))) == NULL)
                return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
            fb->fac[i] = malloc(ns * sizeof(float));
            fb->vrow[i] = malloc(dt_bytes(b->slot_n[slot_off], b->slot_dt[slot_off]));
            fb->vcol[i] = malloc(dt_bytes(b->slot_n[slot_off + 1], b->slot_dt[slot_off + 1]));
            if (!fb->fac[i] || !fb->vrow[i] || !fb->vcol[i])
                return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
            fb->hb[i].slot[slot_off] = fb->vrow[i];
            fb->hb[i].slot[slot_off + 1] = fb->vcol[i];
            fb->dfac_bytes[i] = ns * sizeof(float);
            void *d = NULL;
            CT_TRY(ct_device_alloc(groups[gi].dev, fb->dfac_bytes[i], &d));
            fb->dfac[i] = d;
        }
    return CT_OK;
}

/* Host buffers of the per-leaf reductions of one step. */
typedef struct {
    double *acc;   /* per block (all groups, group order): sum u^2, sum p^2, non-finite */
    float *f;      /* per block: CT_OPT_MAX_STAGES factors */
    double *leaf;  /* per leaf: sum u^2, sum p^2, counted elements */
    float *leaf_f; /* per leaf: the factor of the stage being reduced */
} leaf_bufs;

static void free_leaf_bufs(leaf_bufs *lb) {
    free(lb->acc);
    free(lb->f);
    free(lb->leaf);
    free(lb->leaf_f);
}

static ct_status step_locked(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                             int ngroups, int nleaves, leaf_bufs *lb, fact_bufs *fb,
                             const ct_opt_procs *pr);
static ct_status leaf_reduce(ct_opt_stage *stages, int k, const ct_opt_group *groups,
                             int ngroups, int nleaves, leaf_bufs *lb, ct_opt_pass *ps,
                             float *const *ffac, const ct_opt_procs *pr);

/* Across processes: v holds per_group + per_block * nblocks doubles per group, group after
 * group; this process's groups' values go to every process, and another process's groups'
 * values come from it (one allgather, the same width on every process). */
static ct_status xchg_groups(const ct_opt_procs *pr, const ct_opt_group *groups, int ngroups,
                             size_t per_group, size_t per_block, double *v) {
    size_t *per = calloc((size_t)pr->nproc, sizeof *per);
    size_t *cur = calloc((size_t)pr->nproc, sizeof *cur);
    double *send = NULL, *recv = NULL;
    size_t w = 0, m = 0, off = 0;
    ct_status st = (per && cur) ? CT_OK : ct_set_error(CT_EOOM, "optimizer step: out of host "
                                                       "memory for an exchange");
    for (int gi = 0; st == CT_OK && gi < ngroups; gi++)
        per[pr->group_proc[gi]] += per_group + per_block * (size_t)groups[gi].nblocks;
    for (int p = 0; st == CT_OK && p < pr->nproc; p++) w = per[p] > w ? per[p] : w;
    if (st == CT_OK && w > 0) {
        send = calloc(w, sizeof *send);
        recv = malloc((size_t)pr->nproc * w * sizeof *recv);
        if (send == NULL || recv == NULL)
            st = ct_set_error(CT_EOOM, "optimizer step: out of host memory for an exchange");
        for (int gi = 0; st == CT_OK && gi < ngroups; gi++) {
            const size_t n = per_group + per_block * (size_t)groups[gi].nblocks;
            if (mine(pr, gi)) {
                memcpy(send + m, v + off, n * sizeof *v);
                m += n;
            }
            off += n;
        }
        if (st == CT_OK) st = pr->allgather(pr->ctx, send, recv, w);
        off = 0;
        for (int gi = 0; st == CT_OK && gi < ngroups; gi++) {
            const int p = pr->group_proc[gi];
            const size_t n = per_group + per_block * (size_t)groups[gi].nblocks;
            if (!mine(pr, gi)) memcpy(v + off, recv + (size_t)p * w + cur[p], n * sizeof *v);
            cur[p] += n;
            off += n;
        }
    }
    free(send);
    free(recv);
    free(per);
    free(cur);
    return st;
}

ct_status ct_optim_step_device(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                               int ngroups, const ct_opt_procs *pr) {
    /* FACTORED runs on the devices when every backend has the passes and the step has one
     * such stage; otherwise (and for kinds with no GPU pass at all) the step is staged */
    int staged = 0, nfact = 0, kfact = -1, fact_ok = 1;
    const char *force = getenv("CTRAINSTATE_STAGE_FACTORED"); /* debugging: the host path */
    if (force != NULL && *force != '\0' && strcmp(force, "0") != 0) fact_ok = 0;
    for (int gi = 0; gi < ngroups; gi++)
        fact_ok &= !mine(pr, gi) || (groups[gi].dev != NULL && groups[gi].dev->backend != NULL &&
                                     groups[gi].dev->backend->optim_factored);
    for (int k = 0; k < nstages; k++) {
        if (stages[k].kind == CT_OPT_FACTORED) {
            nfact++;
            kfact = k;
            continue;
        }
        staged |= !gpu_kind(stages[k].kind);
    }
    staged |= nfact > 1 || (nfact == 1 && (!fact_ok || pr != NULL));
    for (int gi = 0; gi < ngroups; gi++) {
        if (!mine(pr, gi)) continue;
        const ct_device *d = groups[gi].dev;
        if (d == NULL || d->backend == NULL ||
            (staged ? d->backend->copy_block == NULL : d->backend->optim_pass == NULL))
            return ct_set_error(CT_EINVAL, "optimizer: the backend of device group %d has no %s", gi,
                                staged ? "copies (host staging of a factored step)"
                                       : "fused optimizer kernel");
    }
    if (staged) return host_staged_step(stages, nstages, groups, ngroups, pr);
    if (ngroups > CT_MAX_DEVICES)
        return ct_set_error(CT_EINVAL, "optimizer: %d device groups (at most %d)", ngroups,
                            CT_MAX_DEVICES);
    /* Device-resident norms write the backends' boards: one GPU step at a time. */
    static pthread_mutex_t step_mu = PTHREAD_MUTEX_INITIALIZER;
    /* per-leaf stages: per-block sums in, per-block factors out; allocated before any pass */
    int leafwise = 0, nleaves = 0;
    for (int k = 0; k < nstages; k++) leafwise |= ct_om_is_leafwise(stages[k].kind);
    int64_t nblk = 0;
    for (int gi = 0; gi < ngroups; gi++) {
        nblk += groups[gi].nblocks;
        for (int i = 0; i < groups[gi].nblocks; i++)
            if (groups[gi].blocks[i].leaf >= nleaves) nleaves = groups[gi].blocks[i].leaf + 1;
    }
    leaf_bufs lb = {NULL, NULL, NULL, NULL};
    if (leafwise) {
        const size_t nb = (size_t)(nblk > 0 ? nblk : 1), nl = (size_t)(nleaves > 0 ? nleaves : 1);
        lb.acc = calloc(nb * 3, sizeof(double));
        lb.f = calloc(nb * CT_OPT_MAX_STAGES, sizeof(float));
        lb.leaf = calloc(nl * 3, sizeof(double));
        lb.leaf_f = calloc(nl, sizeof(float));
        if (!lb.acc || !lb.f || !lb.leaf || !lb.leaf_f) {
            free_leaf_bufs(&lb);
            return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
        }
    }
    fact_bufs fb;
    memset(&fb, 0, sizeof fb);
    fb.k = -1;
    if (kfact >= 0) {
        int off = 0;
        for (int k = 0; k < kfact; k++) off += ct_opt_kind_nslots(stages[k].kind);
        ct_status st = init_fact_bufs(&fb, kfact, off, groups, ngroups);
        if (st != CT_OK) {
            free_fact_bufs(&fb);
            free_leaf_bufs(&lb);
            return st;
        }
    }
    pthread_mutex_lock(&step_mu);
    ct_status st = step_locked(stages, nstages, groups, ngroups, nleaves, &lb, &fb, pr);
    pthread_mutex_unlock(&step_mu);
    free_fact_bufs(&fb); /* device buffers: freed in stream order after the passes */
    free_leaf_bufs(&lb);
    return st;
}

/* Adafactor's FACTORED stage k: every device's statistics (reduce = 4, a host round trip),
 * v_row / v_col through the host, the CPU driver's combine step, then v_row / v_col and the
 * factors back onto the devices; later passes multiply by the factors (ps->ffac). */
static ct_status factored_device(ct_opt_stage *stages, int nstages, int k,
                                 const ct_opt_group *groups, int ngroups, int nleaves,
                                 const leaf_bufs *lb, fact_bufs *fb, ct_opt_pass *ps);

static void set_group(ct_opt_pass *ps, const ct_opt_group *groups, int gi, const leaf_bufs *lb,
                      float *const *ffac, double *const *fstat);

/* The per-leaf reduction of stage k: per-block sums from every device (reduce = 3), per-leaf
 * sums and factors, then every block's factor for later passes. */
static ct_status leaf_reduce(ct_opt_stage *stages, int k, const ct_opt_group *groups,
                             int ngroups, int nleaves, leaf_bufs *lb, ct_opt_pass *ps,
                             float *const *ffac, const ct_opt_procs *pr) {
    ps->upto = k;
    ps->reduce = 3;
    int64_t base = 0;
    for (int gi = 0; gi < ngroups; gi++) {
        if (mine(pr, gi)) {
            set_group(ps, groups, gi, lb, ffac, NULL);
            ps->blk_acc = lb->acc + 3 * base;
            CT_TRY(groups[gi].dev->backend->optim_pass(groups[gi].dev, ps, NULL));
        }
        base += groups[gi].nblocks;
    }
    ps->blk_acc = NULL;
    if (pr != NULL) CT_TRY(xchg_groups(pr, groups, ngroups, 0, 3, lb->acc));
    memset(lb->leaf, 0, (size_t)(nleaves > 0 ? nleaves : 1) * 3 * sizeof(double));
    base = 0;
    for (int gi = 0; gi < ngroups; gi++) {
        for (int i = 0; i < groups[gi].nblocks; i++) {
            const ct_opt_block *b = &groups[gi].blocks[i];
            if (b->counts && b->n > 0) {
                lb->leaf[3 * b->leaf] += lb->acc[3 * (base + i)];
                lb->leaf[3 * b->leaf + 1] += lb->acc[3 * (base + i) + 1];
                lb->leaf[3 * b->leaf + 2] += (double)b->n;
            }
        }
        base += groups[gi].nblocks;
    }
    for (int l = 0; l < nleaves; l++)
        lb->leaf_f[l] = ct_opt_leaf_factor(stages[k].kind, stages[k].s, lb->leaf[3 * l],
                                           lb->leaf[3 * l + 1], lb->leaf[3 * l + 2]);
    base = 0;
    for (int gi = 0; gi < ngroups; gi++) {
        for (int i = 0; i < groups[gi].nblocks; i++)
            lb->f[CT_OPT_MAX_STAGES * (base + i) + k] = lb->leaf_f[groups[gi].blocks[i].leaf];
        base += groups[gi].nblocks;
    }
    return CT_OK;
}

static int host_norm(void) {
    const char *e = getenv("CTRAINSTATE_HOST_NORM");
    return e != NULL && *e != '\0' && strcmp(e, "0") != 0;
}

/* Group gi's per-block factors (NULL when the step has no per-leaf stage). */
static const float *group_f(const leaf_bufs *lb, const ct_opt_group *groups, int gi) {
    if (lb->f == NULL) return NULL;
    int64_t base = 0;
    for (int j = 0; j < gi; j++) base += groups[j].nblocks;
    return lb->f + (size_t)CT_OPT_MAX_STAGES * (size_t)base;
}

/* Point *ps at group gi's blocks (and their slices of the step's per-block arrays: per-leaf
 * factors, adafactor factors `ffac` once computed, statistics `fstat` for its reduce pass). */
static void set_group(ct_opt_pass *ps, const ct_opt_group *groups, int gi, const leaf_bufs *lb,
                      float *const *ffac, double *const *fstat) {
    int64_t base = 0;
    for (int j = 0; j < gi; j++) base += groups[j].nblocks;
    ps->blocks = groups[gi].blocks;
    ps->nblocks = groups[gi].nblocks;
    ps->igroup = gi;
    ps->blk_f = group_f(lb, groups, gi);
    ps->ffac = ffac ? (const float *const *)(ffac + base) : NULL;
    ps->fstat = fstat ? fstat + base : NULL;
}

/* Pass *ps (its mode set by the caller) over group gi's blocks. */
static ct_status run_pass(ct_opt_pass *ps, const ct_opt_group *groups, int gi,
                          const leaf_bufs *lb, float *const *ffac, double *acc) {
    set_group(ps, groups, gi, lb, ffac, NULL);
    return groups[gi].dev->backend->optim_pass(groups[gi].dev, ps, acc);
}

/* Send the batch fb->seg_*[0, *ns) between the host and device d (up: to the device) and
 * empty it: one backend call when the backend batches (copy_segments), else one copy_block
 * per segment. */
static ct_status fact_flush(fact_bufs *fb, ct_device *d, int up, int *ns) {
    const int n = *ns;
    *ns = 0;
    if (n == 0) return CT_OK;
    if (d->backend->copy_segments != NULL)
        return d->backend->copy_segments(up ? d : NULL, up ? NULL : d, n, fb->seg_dst,
                                         fb->seg_src, fb->seg_bytes);
    const int64_t one = 1;
    for (int i = 0; i < n; i++) {
        const int64_t nb = (int64_t)fb->seg_bytes[i];
        CT_TRY(d->backend->copy_block(up ? d : NULL, up ? NULL : d, 1, &nb, 1, fb->seg_dst[i],
                                      &one, fb->seg_src[i], &one));
    }
    return CT_OK;
}

/* The FACTORED stage's copies, one batch per device (the factored blocks of its groups):
 * up = 0, v_row and v_col (slots o, o + 1) to the host; up = 1, the new v_row, v_col and the
 * factors back. A device that fails stops the step: the devices before it hold the new
 * values (one step ahead of the params, as after any error past FACTORED), the rest the old. */
static ct_status fact_copies(fact_bufs *fb, int o, const ct_opt_group *groups, int ngroups,
                             int up) {
    int64_t base = 0;
    for (int gi = 0; gi < ngroups; base += groups[gi].nblocks, gi++) {
        ct_device *d = groups[gi].dev;
        int seen = 0; /* d's blocks went with an earlier group's batch */
        for (int gj = 0; gj < gi && !seen; gj++) seen = groups[gj].dev == d;
        if (seen) continue;
        int ns = 0;
        int64_t bj = base;
        for (int gj = gi; gj < ngroups; bj += groups[gj].nblocks, gj++) {
            if (groups[gj].dev != d) continue;
            for (int64_t i = bj; i < bj + groups[gj].nblocks; i++) {
                if (fb->fac[i] == NULL) continue;
                const ct_opt_block *b = fb->db[i];
                void *host[3] = {fb->vrow[i], fb->vcol[i], fb->fac[i]};
                void *dev[3] = {b->slot[o], b->slot[o + 1], fb->dfac[i]};
                const size_t bytes[3] = {(size_t)b->slot_n[o] * ct_dtype_size((ct_dtype)b->slot_dt[o]),
                                         (size_t)b->slot_n[o + 1] *
                                             ct_dtype_size((ct_dtype)b->slot_dt[o + 1]),
                                         fb->dfac_bytes[i]};
                for (int q = 0; q < (up ? 3 : 2); q++) {
                    if (bytes[q] == 0) continue;
                    if (ns == INT_MAX) CT_TRY(fact_flush(fb, d, up, &ns)); /* an int counts them */
                    fb->seg_dst[ns] = up ? dev[q] : host[q];
                    fb->seg_src[ns] = up ? host[q] : dev[q];
                    fb->seg_bytes[ns++] = bytes[q];
                }
            }
        }
        CT_TRY(fact_flush(fb, d, up, &ns));
    }
    return CT_OK;
}

static ct_status factored_device(ct_opt_stage *stages, int nstages, int k,
                                 const ct_opt_group *groups, int ngroups, int nleaves,
                                 const leaf_bufs *lb, fact_bufs *fb, ct_opt_pass *ps) {
    const int o = ps->slot_off[k];
    ps->upto = k;
    ps->reduce = 4;
    for (int gi = 0; gi < ngroups; gi++) {
        set_group(ps, groups, gi, lb, NULL, fb->stat);
        CT_TRY(groups[gi].dev->backend->optim_pass(groups[gi].dev, ps, NULL));
    }
    ps->fstat = NULL;
    CT_TRY(fact_copies(fb, o, groups, ngroups, 0)); /* v_row, v_col to the host */
    CT_TRY(ct_opt_factored_combine(stages, nstages, k, fb->hb, fb->nb, nleaves, fb->stat, fb->fac));
    return fact_copies(fb, o, groups, ngroups, 1); /* new v_row, v_col and the factors back */
}

static ct_status step_locked(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                             int ngroups, int nleaves, leaf_bufs *lb, fact_bufs *fb,
                             const ct_opt_procs *pr) {
    int group_dev[CT_MAX_DEVICES];
    for (int gi = 0; gi < ngroups; gi++) group_dev[gi] = mine(pr, gi) ? groups[gi].dev->id : -1;
    const int device_norms = !host_norm() && pr == NULL;
    ct_opt_pass ps;
    memset(&ps, 0, sizeof ps);
    ps.nstages = nstages;
    ps.ngroup = ngroups;
    ps.group_dev = group_dev;
    ps.fstage = fb->k;
    float *const *ffac = NULL; /* the factored stage's factors, once computed */
    for (int k = 0, off = 0; k < nstages; k++) {
        ps.kind[k] = stages[k].kind;
        ps.slot_off[k] = off;
        off += ct_opt_kind_nslots(stages[k].kind);
        ct_om_prepare(stages[k].kind, stages[k].s, ps.c[k]);
        stages[k].result = 0.0;
    }
    for (int k = 0; k < nstages; k++) {
        const int kind = stages[k].kind;
        if ((ps.skip >> k) & 1u) continue;
        if (ct_om_is_leafwise(kind)) {
            CT_TRY(leaf_reduce(stages, k, groups, ngroups, nleaves, lb, &ps, ffac, pr));
            continue;
        }
        if (kind == CT_OPT_FACTORED) {
            CT_TRY(factored_device(stages, nstages, k, groups, ngroups, nleaves, lb, fb, &ps));
            ffac = fb->dfac;
            continue;
        }
        if (kind != CT_OPT_GLOBAL_NORM && kind != CT_OPT_FINITE_GATE) continue;
        ps.upto = k;
        if (kind == CT_OPT_GLOBAL_NORM && device_norms) {
            ps.reduce = 2;
            for (int gi = 0; gi < ngroups; gi++) CT_TRY(run_pass(&ps, groups, gi, lb, ffac, NULL));
            ps.c[k][0] = 0.0f; /* filled in by each later pass from the devices' sums */
            ps.c[k][1] = 0.0f;
            ps.c[k][2] = (float)stages[k].s[0];
            ps.dev_norm |= 1u << k;
            stages[k].result = NAN;
            continue;
        }
        ps.reduce = 1;
        double ss = 0.0, bad = 0.0, *accs = calloc((size_t)(ngroups > 0 ? ngroups : 1) * 2,
                                                   sizeof *accs);
        if (accs == NULL) return ct_set_error(CT_EOOM, "optimizer step: out of host memory");
        ct_status st = CT_OK;
        for (int gi = 0; st == CT_OK && gi < ngroups; gi++)
            if (mine(pr, gi)) st = run_pass(&ps, groups, gi, lb, ffac, accs + 2 * gi);
        if (st == CT_OK && pr != NULL) st = xchg_groups(pr, groups, ngroups, 2, 0, accs);
        for (int gi = 0; gi < ngroups; gi++) { /* in group order, whoever computed them */
            ss += accs[2 * gi];
            bad += accs[2 * gi + 1];
        }
        free(accs);
        CT_TRY(st);
        if (kind == CT_OPT_GLOBAL_NORM) {
            const float nrm = (float)sqrt(ss), mx = (float)stages[k].s[0];
            ct_om_set_norm(ps.c[k], !(nrm < mx), nrm, mx);
            stages[k].result = nrm;
        } else {
            const int finite = bad == 0.0;
            const int zero = !finite && stages[k].s[1] == 0.0; /* reject: zero u, inner untouched */
            stages[k].result = finite;
            ct_om_set_gate(ps.c[k], zero);
            if (zero)
                for (int q = k + 1; q <= k + (int)stages[k].s[0]; q++) ps.skip |= 1u << q;
        }
    }
    ps.upto = nstages;
    ps.reduce = 0;
    for (int gi = 0; gi < ngroups; gi++)
        if (mine(pr, gi)) CT_TRY(run_pass(&ps, groups, gi, lb, ffac, NULL));
    return CT_OK;
}
