/*
 * ct_optim.h — fused, multi-tensor optimizer steps (optax numerics).
 *
 * An optimizer (an optax-style chain of transforms) is compiled by the Python
 * layer into a list of *stages*. Elementwise stages (scale, Adam, weight
 * decay, trace/momentum, Lion, RMS, RSS/Adagrad, clip, EMA) run on a small
 * chunk `u` of the update vector held in L1; the driver walks every leaf of a
 * device in chunks, runs all stages of the chain on each chunk, then either
 * applies `p += u` in place (apply mode) or writes `u` to an output buffer
 * (emit mode, used by the functional tx.update). So each of p, g and every
 * state slot is read once and written once per step: 28 bytes per parameter
 * for fp32 AdamW, no temporaries, one OpenMP parallel loop per device over
 * all leaves of that device. The loop runs over *tasks* (at most
 * 16 chunks of one block, scheduled dynamically) so leaves of very different
 * sizes balance; the task functions are compiled per ISA (AVX-512, AVX2,
 * baseline) and chosen at load time, with identical results.
 *
 * Reduction stages need a property of the update vector *entering* them
 * before any element can be finished:
 *   GLOBAL_NORM  (clip_by_global_norm)  sum of u^2 over all leaves,
 *   TRUST_RATIO  (lamb)                 per-leaf |u| and |p|,
 *   FINITE_GATE  (apply_if_finite)      any non-finite u.
 * For each reduction stage k (in order) the driver runs one extra read-only
 * pass over every device computing stages [0, k) without writing state, and
 * only blocks with `counts` set (replica 0 of each global block) contribute,
 * so every global element is counted once whatever the mesh. Partial sums are
 * per chunk and added in chunk order: results do not depend on thread count.
 * Cost: one extra read of g (and of the slots of earlier stateful stages) per
 * reduction stage; with the reduction first in the chain (the usual
 * clip_by_global_norm placement) that is one extra read of g.
 *
 * Adafactor's factored second moments (FACTORED) are a reduction too: its
 * pass sums (u^2 + eps) along the two factored dims of every factored block
 * (a row statistic over d0, a column statistic over d1) into per-block
 * partials; the driver adds the partials of the blocks that share a
 * statistic (the devices along the mesh axis a factored dim is sharded over,
 * replica 0 of each block only, so each global element counts once), updates
 * v_row / v_col in place and turns them into row/column factors that the
 * fused pass multiplies in. Non-factored leaves take the elementwise path
 * (state v). BLOCK_RMS (clip_by_block_rms) needs per-leaf sum u^2, PARAM_RMS
 * (scale_by_param_block_rms) per-leaf sum p^2, which rides along with an
 * earlier reduce pass when there is one (p does not change before the fused
 * pass), else reads p alone. Cost of adafactor (defaults): two read-only
 * passes (g for the statistics; g, p and the v of unfactored leaves for the
 * block RMS clip and the param RMS) before the fused pass — about 24 bytes
 * per fp32 parameter instead of the 12 a fused pass needs.
 *
 * GPU devices. A step whose groups all live on GPU devices goes to
 * ct_optim_step_device (ct_optim_device.c): the backend's optim_pass runs one
 * launch per device and pass (csrc/backend/cuda/cuda_optim.cu) with the
 * per-element math of ct_optim_math.h; GLOBAL_NORM's norm stays on the
 * devices, FINITE_GATE and the per-leaf reductions (TRUST_RATIO, BLOCK_RMS,
 * PARAM_RMS) combine on the host (one round trip each), and FACTORED's
 * statistics come to the host, where the CPU driver's combine step makes the
 * factors the later passes multiply in (see ct_optim_device.c). A step mixing
 * CPU and GPU groups is refused.
 *
 * Numerics follow optax: fp32 arithmetic in the same operation order
 * (e.g. Adam: mu/(1-b1^t) / (sqrt(nu/(1-b2^t) + eps_root) + eps)). Per-step
 * scalars (learning rate from a schedule, bias corrections) are computed once
 * per step by the caller and passed in `ct_opt_stage.s`.
 *
 * Operand dtypes. Params, grads, updates and each state slot of a block is
 * float32, bfloat16 or float16, each with its own dtype (ct_opt_block's *_dt;
 * a zeroed block is all float32). The kernels load a 16-bit operand in its
 * own dtype and widen it exactly to float32 in registers (CPU: a chunk in L1;
 * AdamW chains on CPUs with AVX-512: 16 elements in registers, one pass),
 * compute in float32 as for float32 operands, and round what they store once,
 * to nearest even, to the operand's dtype (ct_random_math.h's conversions,
 * NaNs included): a 16-bit state slot is read, updated in float32 and
 * rounded when stored; 16-bit params are updated as p + u in float32 and
 * rounded once; emit mode rounds u to the updates' dtype. So a step is bit
 * for bit "widen every operand to float32, run the float32 step, round what
 * it wrote to each operand's dtype" (llm.c's adamw_update<Tp, Tg>), without
 * the float32 copies: all-bfloat16 AdamW moves 14 bytes per parameter.
 * Reductions (norms, trust ratios, the finite gate, adafactor's statistics,
 * per-leaf RMS) read 16-bit operands the same way. Other dtypes are refused
 * (CT_ETYPE).
 */
#ifndef CT_OPTIM_H
#define CT_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "ct_dtype.h"
#include "ct_status.h"

#define CT_OPT_MAX_STAGES 32
#define CT_OPT_MAX_SLOTS 16   /* state arrays per leaf, all stages together */
#define CT_OPT_NSCALARS 8
#define CT_OPT_CHUNK 2048     /* elements per chunk: u (and the float32 views of 16-bit
                                 arrays) live in 8 KiB of stack each */
#define CT_OPT_MAX_DIMS 8     /* rank of a factored (adafactor) leaf */

typedef enum {
    CT_OPT_SCALE = 0,        /* u = s0*u                                    (0 slots) */
    CT_OPT_ADAM = 1,         /* s: b1 b2 eps eps_root bc1 bc2 mode bc1_next      (mu, nu)
                                mode bits: 1 nesterov, 2 moment only (u = mu_hat:
                                radam's unrectified steps) */
    CT_OPT_DECAY = 2,        /* u = u + s0*p                                (0 slots) */
    CT_OPT_TRACE = 3,        /* s: decay nesterov                            (trace) */
    CT_OPT_LION = 4,         /* s: b1 b2                                     (mu) */
    CT_OPT_RMS = 5,          /* s: decay eps eps_in_sqrt bc (1 if none)      (nu) */
    CT_OPT_RSS = 6,          /* s: eps                                       (sum_of_squares) */
    CT_OPT_CLIP = 7,         /* s: max_delta                                (0 slots) */
    CT_OPT_GLOBAL_NORM = 8,  /* s: max_norm; result: the global norm        (0 slots) */
    CT_OPT_TRUST_RATIO = 9,  /* s: min_norm trust_coefficient eps           (0 slots) */
    CT_OPT_FINITE_GATE = 10, /* s: ncovered force; result: 1 finite, 0 not   (0 slots) */
    CT_OPT_EMA = 11,         /* s: decay bc (1 if no debias)                 (ema) */
    CT_OPT_FACTORED = 12,    /* s: decay_rate_t eps                 (v_row, v_col, v) */
    CT_OPT_BLOCK_RMS = 13,   /* s: threshold: u / max(1, rms(u)/threshold)  (0 slots) */
    CT_OPT_PARAM_RMS = 14,   /* s: min_scale: u * max(rms(p), min_scale)    (0 slots) */
    CT_OPT_ZERO = 15,        /* u = +0, whatever u was (also NaN / inf)      (0 slots) */
    CT_OPT_BELIEF = 16,      /* s: as ADAM (mode: nesterov bit only); nu tracks
                                (g - mu)^2 + eps_root (adabelief)          (mu, nu) */
    CT_OPT_YOGI = 17,        /* s: b1 b2 eps eps_root bc1 bc2;
                                nu -= (1-b2) sign(nu - g^2) g^2            (mu, nu) */
    CT_OPT_STDDEV = 18,      /* s: as RMS; u = g / sqrt(nu^ - mu^^2 (+eps))
                                (centered rmsprop)                         (mu, nu) */
    CT_OPT_ACCUM = 19,       /* s: n+1 emit sum: acc += (u - acc)/(n+1) (sum: acc = u +
                                acc); emit: u = acc, acc = 0; else u = 0 (MultiSteps) (acc) */
    CT_OPT_ADAMAX = 20,      /* s: as ADAM (eps_root, bc2, mode, bc1_next unused);
                                nu = max(|g| + eps, b2 nu) (NaN kept), u = mu^ / nu (mu, nu) */
    CT_OPT_AMSGRAD = 21,     /* s: as ADAM (mode: 0); nu_max = max(nu_max, nu^) (NaN
                                kept), u = mu^ / (sqrt(nu_max + eps_root) + eps) (mu, nu, nu_max) */
    CT_OPT_NUM_KINDS
} ct_opt_kind;

typedef struct {
    int kind;                    /* ct_opt_kind */
    double s[CT_OPT_NSCALARS];   /* per-step scalars, see ct_opt_kind */
    double result;               /* out: reduction result (norm, finite flag) */
} ct_opt_stage;

/* Where a block of a factored leaf (FACTORED stage) lies in its leaf. ndim
 * 0: the leaf is not factored. d0 / d1 are optax's factored dims (d0 the
 * largest, d1 the second largest). The block's v_row slot holds its box of
 * the statistic without d0 (bshape with d0 removed), v_col without d1. */
typedef struct {
    int ndim;
    int d0, d1;
    int64_t shape[CT_OPT_MAX_DIMS];   /* global shape of the leaf */
    int64_t start[CT_OPT_MAX_DIMS];   /* block start */
    int64_t bshape[CT_OPT_MAX_DIMS];  /* block shape (product n) */
} ct_opt_geom;

/* One block (the part of one leaf on one device). Each array has a dtype (ct_dtype): CT_F32,
 * CT_BF16 or CT_F16 (0, CT_F32, in a zeroed block); n and slot_n count elements. */
typedef struct {
    int64_t n;                        /* elements */
    void *p;                          /* params: read; updated in place in apply mode */
    const void *g;                    /* gradients */
    void *out;                        /* emit mode: updates written here (p untouched) */
    void *slot[CT_OPT_MAX_SLOTS];     /* state arrays in stage order (NULL where inactive) */
    int64_t slot_n[CT_OPT_MAX_SLOTS]; /* their elements (n, except FACTORED's) */
    ct_opt_geom geom;                 /* FACTORED leaves only */
    uint32_t active;                  /* bit i set: stage i applies to this leaf */
    int leaf;                         /* global leaf index, for per-leaf reductions */
    int counts;                       /* 1 for replica 0 of its global block */
    uint8_t p_dt, g_dt, out_dt;       /* dtypes of p, g, out */
    uint8_t slot_dt[CT_OPT_MAX_SLOTS]; /* and of each slot */
} ct_opt_block;

struct ct_device;

/* The blocks of one device. */
typedef struct {
    ct_opt_block *blocks;
    int nblocks;
    struct ct_device *dev; /* owner of every buffer of the group; NULL or a CPU device: the
                            * CPU driver; a GPU device: its backend's optim_pass */
} ct_opt_group;

/* One fused pass over one device's blocks, as a backend runs it (the
 * ct_backend.optim_pass entry; ct_optim_device.c drives it). Stages [0, upto)
 * that are active on a block and not in `skip` run on each element, with the
 * fp32 constants of ct_optim_math.h (`c`, already holding the results of
 * earlier reductions). reduce = 0: the apply pass (upto = nstages): state
 * written, then p += u (or out = u). reduce = 1: read-only; over blocks with
 * `counts` on which stage upto is active (a GLOBAL_NORM or FINITE_GATE inside
 * masked / partition covers its own leaves only), acc[0] = sum of u^2 (double),
 * acc[1] = number of non-finite u, for the u entering stage upto.
 *
 * Device-resident global norms: reduce = 2 is the read-only pass of the
 * GLOBAL_NORM stage `upto` whose sum stays on the device: the backend leaves
 * this device's sum of u^2 (the same double as reduce = 1's acc[0], over the same
 * blocks) in its
 * board at (stage upto, position igroup) and returns nothing (acc unused).
 * A later pass (reduce 0 or 1) with bit k of dev_norm set first waits for the
 * reduce = 2 passes of every device in group_dev[0, ngroup), then takes stage
 * k's norm as (float)sqrt of the ngroup sums added in group order (what the
 * host would compute) and c[k] = {!(norm < c[k][2]), norm, c[k][2]}: no host
 * round trip.
 *
 * Per-leaf reductions (TRUST_RATIO, BLOCK_RMS, PARAM_RMS): reduce = 3 is the
 * read-only pass of such a stage `upto`: for each block i of the pass, over
 * its elements if it `counts` (zeros otherwise), blk_acc[3i] = sum of u^2 for
 * the u entering the stage, blk_acc[3i+1] = sum of p^2, blk_acc[3i+2] = the
 * number of non-finite u (doubles, written on the host: the pass waits). The
 * driver turns them into one factor per leaf (ct_opt_leaf_factor) and, in
 * later passes, blk_f[i * CT_OPT_MAX_STAGES + k] is block i's factor for such
 * a stage k (ct_om_leaf_apply). */
typedef struct ct_opt_pass {
    const ct_opt_block *blocks;
    int nblocks;
    int nstages, upto, reduce;
    uint32_t skip;
    int kind[CT_OPT_MAX_STAGES];
    int slot_off[CT_OPT_MAX_STAGES];
    float c[CT_OPT_MAX_STAGES][8]; /* CT_OM_NC */
    uint32_t dev_norm;             /* GLOBAL_NORM stages whose norm stays on the devices */
    int igroup, ngroup;            /* this device's position among the step's devices */
    const int *group_dev;          /* the step's device ids, in group order */
    double *blk_acc;               /* reduce = 3: per-block sums (out) */
    const float *blk_f;            /* per-block factors of per-leaf stages (NULL: none yet) */
    /* Adafactor (FACTORED stage fstage, at most one per step; -1: none). reduce = 4 is its
     * statistics pass (upto = fstage): for each block i with fstat[i] != NULL (factored,
     * active, counting), fstat[i] (host, n_nolo + n_nohi doubles) receives the sums of
     * (u^2 + eps) for the u entering the stage, over the lower factored dim then over the
     * higher (ct_om_fg's layouts); the pass waits. Later passes multiply element i of block
     * i's u by its factors ffac[i] (device memory, n_nolo + n_nohi floats,
     * ct_om_factored_apply); blocks with ffac[i] == NULL (leaves that are not factored)
     * take the elementwise update (state slot 3, ct_om_stage). */
    int fstage;
    double *const *fstat;
    const float *const *ffac;
} ct_opt_pass;

/* The factor of a per-leaf stage (TRUST_RATIO, BLOCK_RMS: the divisor, PARAM_RMS) for a leaf
 * of n counted elements with sum_u2 = sum of u^2 entering the stage and sum_p2 = sum of p^2
 * (s: the stage's scalars). The CPU and GPU drivers both use it. */
float ct_opt_leaf_factor(int kind, const double *s, double sum_u2, double sum_p2, double n);

/* Number of state slots a stage kind owns per leaf. */
int ct_opt_kind_nslots(int kind);

/* Validate a stage list (kinds, slot budget, gate coverage). */
ct_status ct_optim_check(const ct_opt_stage *stages, int nstages);

/* Run one optimizer step over every group: the reduction passes, then the
 * fused pass. Stage results are written to stages[i].result. `nleaves` is
 * the number of distinct global leaves (blocks' `leaf` < nleaves). Each group
 * is one parallel loop; the caller releases the GIL. Fails only on bad input
 * or allocation failure, before writing anything. */
ct_status ct_optim_step(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                        int ngroups, int nleaves);

/* A step over params that span processes (ct_optim_step_procs; each process runs it with
 * the same arguments but its own buffers). `groups` are the groups of the one-process step on
 * the same global devices, in its order: group gi belongs to process group_proc[gi]. This
 * process's groups (group_proc[gi] == rank) hold its blocks as in ct_optim_step; another
 * process's blocks carry only what the reductions must know of them (n, active, leaf, counts
 * and, for factored leaves, geom; no buffers: they are never read or written here). Each
 * reduction computes this process's partial results (the per-task sums of a reduce pass,
 * adafactor's per-block statistics and row sums), exchanges them with every process through
 * `allgather`, and combines the partials of every group in the one-process step's order: so
 * every process gets the norms, gates, trust ratios and factors of the one-process step bit
 * for bit, a replicated block counted once (its replica 0, wherever it lives). Every process
 * calls `allgather` the same number of times with the same n. On GPU devices (every group of
 * this process on GPUs) the step is ct_optim_step_device's, its reductions host round trips
 * exchanged the same way. A failed exchange fails the step before anything is written. */
typedef ct_status (*ct_opt_allgather_fn)(void *ctx, const double *send, double *recv, size_t n);
typedef struct {
    int rank, nproc;
    const int *group_proc;          /* per group: the process that holds it */
    ct_opt_allgather_fn allgather;  /* recv[p * n + i] = send[i] of process p, i < n */
    void *ctx;
} ct_opt_procs;

ct_status ct_optim_step_procs(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                              int ngroups, int nleaves, const ct_opt_procs *procs);

/* A step prepared once and run many times over the same blocks (a persistent plan,
 * csrc/python/py_optim_plan.c): ct_optim_prepare checks the stages and the blocks and, on
 * CPU devices, makes the driver's tables (tasks, per-leaf lists); ct_optim_run runs a step
 * with this step's scalars (same kinds) after the caller set every block's g (the only
 * field that may change between runs; the groups' memory stays the caller's and must
 * outlive the prepared step). On GPU devices, and with a FACTORED stage, a run is
 * ct_optim_step. */
typedef struct ct_optim_prepared ct_optim_prepared;
ct_status ct_optim_prepare(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                           int ngroups, int nleaves, ct_optim_prepared **out);
ct_status ct_optim_run(ct_optim_prepared *p, ct_opt_stage *stages, int nstages);
void ct_optim_prepared_free(ct_optim_prepared *p);

/* ct_optim_step for groups on GPU devices (ct_optim_device.c): the stages
 * and blocks were checked by ct_optim_step_procs. procs: NULL, or a step across processes
 * (ct_opt_procs; another process's groups have no device). */
ct_status ct_optim_step_device(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                               int ngroups, const ct_opt_procs *procs);

/* For GPU drivers: FACTORED stage k of a step from statistics computed elsewhere (the CPU
 * driver's own combine step). blocks: the step's nb blocks in global order (group after group)
 * as host views: geom, n, active, counts and leaf as in the step, slot[o] and slot[o + 1]
 * (o: stage k's first slot) host copies of v_row and v_col in their dtypes (slot_dt),
 * updated in place. stat[i], for
 * each block that counts and is factored and active: its statistics of (u^2 + eps) for the u
 * entering stage k, n_nolo sums over the lower factored dim followed by n_nohi sums over the
 * higher one (ct_om_fgeom's sizes). fac[i], for each factored active block: n_nolo + n_nohi
 * floats out, the factors in the same two layouts (ct_om_factored_apply reads them). */
ct_status ct_opt_factored_combine(const ct_opt_stage *stages, int nstages, int k,
                                  const ct_opt_block *blocks, int64_t nb, int nleaves,
                                  double *const *stat, float *const *fac);

/* Plain scalar reference of one fused step on one block (no chunking, no
 * threads, double-free of clever tricks): for tests of the fast driver. Only
 * elementwise stages (no reduction stages). 16-bit operands element by element
 * (ct_convert_math.h's loads and stores). */
ct_status ct_optim_reference(const ct_opt_stage *stages, int nstages, ct_opt_block *b);

/* The CPU driver's chunk conversions, for tests: y[0, n) = x[0, n) of dtype dt (CT_F32,
 * CT_BF16, CT_F16) widened to float32 (load), or x rounded to dt (store), on conversion
 * path `path`: 0 portable C, 1 AVX2 with F16C, 2 AVX-512 (a path the CPU lacks falls back
 * to the next narrower one), 3 (stores to bfloat16) the AVX512_BF16 rounding of the AdamW
 * loop, -1 the driver's own (the widest the CPU has, less those turned off by
 * CTRAINSTATE_NO_AVX512 / CTRAINSTATE_NO_AVX2). Every path gives the same bits. Return the
 * path that ran. */
int ct_opt_cvt_load(int path, int dt, const void *x, int64_t n, float *y);
int ct_opt_cvt_store(int path, int dt, const float *x, int64_t n, void *y);

#endif /* CT_OPTIM_H */
