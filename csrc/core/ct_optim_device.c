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
 * So a chain without reductions costs one launch per device and no sync; a
 * clip_by_global_norm chain one extra read of g per device and no sync either;
 * apply_if_finite one sync. A device-resident norm is not read back:
 * stages[k].result is NaN for it.
 * Other reductions (TRUST_RATIO, FACTORED, BLOCK_RMS, PARAM_RMS) are not
 * supported on GPU devices yet and fail before anything is written.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ct_device.h"
#include "ct_optim.h"
#include "ct_optim_math.h"

static const char *kind_name(int kind) {
    switch (kind) {
    case CT_OPT_TRUST_RATIO: return "trust ratio (lamb/lars)";
    case CT_OPT_FACTORED: return "factored second moments (adafactor)";
    case CT_OPT_BLOCK_RMS: return "clip_by_block_rms";
    case CT_OPT_PARAM_RMS: return "scale_by_param_block_rms";
    default: return "reduction";
    }
}

static ct_status step_locked(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                             int ngroups);

ct_status ct_optim_step_device(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                               int ngroups) {
    for (int k = 0; k < nstages; k++) {
        const int kind = stages[k].kind;
        if (!ct_om_is_elementwise(kind) && kind != CT_OPT_GLOBAL_NORM && kind != CT_OPT_FINITE_GATE)
            return ct_set_error(CT_EINVAL, "optimizer: stage %d (%s) is not supported on GPU devices "
                                "yet; run this optimizer on CPU devices", k, kind_name(kind));
    }
    for (int gi = 0; gi < ngroups; gi++) {
        const ct_device *d = groups[gi].dev;
        if (d == NULL || d->backend == NULL || d->backend->optim_pass == NULL)
            return ct_set_error(CT_EINVAL, "optimizer: the backend of device group %d has no fused "
                                "optimizer kernel", gi);
    }
    if (ngroups > CT_MAX_DEVICES)
        return ct_set_error(CT_EINVAL, "optimizer: %d device groups (at most %d)", ngroups,
                            CT_MAX_DEVICES);
    /* Device-resident norms write the backends' boards: one GPU step at a time. */
    static pthread_mutex_t step_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&step_mu);
    ct_status st = step_locked(stages, nstages, groups, ngroups);
    pthread_mutex_unlock(&step_mu);
    return st;
}

static int host_norm(void) {
    const char *e = getenv("CTRAINSTATE_HOST_NORM");
    return e != NULL && *e != '\0' && strcmp(e, "0") != 0;
}

static ct_status step_locked(ct_opt_stage *stages, int nstages, const ct_opt_group *groups,
                             int ngroups) {
    int group_dev[CT_MAX_DEVICES];
    for (int gi = 0; gi < ngroups; gi++) group_dev[gi] = groups[gi].dev->id;
    const int device_norms = !host_norm();
    ct_opt_pass ps;
    memset(&ps, 0, sizeof ps);
    ps.nstages = nstages;
    ps.ngroup = ngroups;
    ps.group_dev = group_dev;
    for (int k = 0, off = 0; k < nstages; k++) {
        ps.kind[k] = stages[k].kind;
        ps.slot_off[k] = off;
        off += ct_opt_kind_nslots(stages[k].kind);
        ct_om_prepare(stages[k].kind, stages[k].s, ps.c[k]);
        stages[k].result = 0.0;
    }
    for (int k = 0; k < nstages; k++) {
        const int kind = stages[k].kind;
        if ((kind != CT_OPT_GLOBAL_NORM && kind != CT_OPT_FINITE_GATE) || ((ps.skip >> k) & 1u))
            continue;
        ps.upto = k;
        if (kind == CT_OPT_GLOBAL_NORM && device_norms) {
            ps.reduce = 2;
            for (int gi = 0; gi < ngroups; gi++) {
                ps.blocks = groups[gi].blocks;
                ps.nblocks = groups[gi].nblocks;
                ps.igroup = gi;
                CT_TRY(groups[gi].dev->backend->optim_pass(groups[gi].dev, &ps, NULL));
            }
            ps.c[k][0] = 0.0f; /* filled in by each later pass from the devices' sums */
            ps.c[k][1] = 0.0f;
            ps.c[k][2] = (float)stages[k].s[0];
            ps.dev_norm |= 1u << k;
            stages[k].result = NAN;
            continue;
        }
        ps.reduce = 1;
        double ss = 0.0, bad = 0.0;
        for (int gi = 0; gi < ngroups; gi++) {
            double acc[2] = {0.0, 0.0};
            ps.blocks = groups[gi].blocks;
            ps.nblocks = groups[gi].nblocks;
            ps.igroup = gi;
            CT_TRY(groups[gi].dev->backend->optim_pass(groups[gi].dev, &ps, acc));
            ss += acc[0];
            bad += acc[1];
        }
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
    for (int gi = 0; gi < ngroups; gi++) {
        ps.blocks = groups[gi].blocks;
        ps.nblocks = groups[gi].nblocks;
        ps.igroup = gi;
        CT_TRY(groups[gi].dev->backend->optim_pass(groups[gi].dev, &ps, NULL));
    }
    return CT_OK;
}
