// Host emulation of the CUDA backend table (for exercising the core + Python GPU paths
// without a GPU). Device pointers are real pointers + OFF (non-canonical addresses), so
// any host dereference of "device memory" outside this file segfaults.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <atomic>
#include <vector>

extern "C" {
#include "core/ct_backend.h"
#include "core/ct_device.h"
#include "core/ct_ops.h"
#include "core/ct_ops_math.h"
#include "core/ct_prec_math.h"
#include "core/ct_optim.h"
#include "core/ct_optim_math.h"
}
#include "core/ct_random_math.h"
#include "core/ct_convert_math.h"
#include "core/ct_ewise_math.h"

static const ct_core_services *core;
static const ct_backend *self_backend(void);
static const uintptr_t OFF = (uintptr_t)1 << 46;

template <typename T> static T *R(T *p) { return p ? (T *)((uintptr_t)p - OFF) : p; }
template <typename T> static const T *R(const T *p) { return p ? (const T *)((uintptr_t)p - OFF) : p; }

static ct_device *as_gpu(ct_device *d) { return (d && d->backend == self_backend()) ? d : NULL; }

// What would make a real GPU step wait for the device: stream synchronisations and copies
// between host and device memory. Tests read them through mock_gpu_stats (ctypes).
static std::atomic<long long> n_sync{0}, n_h2d{0}, n_d2h{0};
extern "C" __attribute__((visibility("default"))) void mock_gpu_stats(long long *out) {
    out[0] = n_sync.load();
    out[1] = n_h2d.load();
    out[2] = n_d2h.load();
}

static ct_status m_alloc(ct_device *dev, size_t nbytes, void **out) {
    (void)dev;
    size_t n = nbytes ? nbytes : 256;
    void *p = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!p) return core->set_error(CT_EOOM, "mock oom");
    memset(p, 0xAB, n);  // uninitialised memory is garbage
    *out = (void *)((uintptr_t)p + OFF);
    return CT_OK;
}
static void m_free(ct_device *dev, void *ptr, size_t nbytes) {
    (void)dev; (void)nbytes;
    if (ptr) free(R((char *)ptr));
}
static ct_status m_sync(ct_device *dev) { (void)dev; n_sync++; return CT_OK; }
static ct_status m_init(ct_device *dev) {
    dev->stream = (void *)(uintptr_t)(0x1000 + dev->id);
    int split = 1;
    const char *e = getenv("CTRAINSTATE_GPU_SPLIT");
    if (e != NULL && atoi(e) > 0) split = atoi(e);
    dev->bytes_limit = ((size_t)8 << 30) / (size_t)split;
    return CT_OK;
}

static ct_status m_copy(ct_device *dd, ct_device *sd, int ndim, const int64_t *shape, size_t isz,
                        void *dst, const int64_t *ds, const void *src, const int64_t *ss) {
    if (ndim > 16) return core->set_error(CT_EINVAL, "rank");
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    if (n == 0) return CT_OK;
    if (as_gpu(dd) && !as_gpu(sd)) n_h2d++;
    if (!as_gpu(dd) && as_gpu(sd)) n_d2h++;
    char *D = as_gpu(dd) ? R((char *)dst) : (char *)dst;
    const char *S = as_gpu(sd) ? R((const char *)src) : (const char *)src;
    for (int64_t i = 0; i < n; i++) {
        int64_t a, b;
        ct_offsets2(i, ndim, shape, ds, ss, &a, &b);
        memcpy(D + a, S + b, isz);
    }
    return CT_OK;
}

static ct_status m_unary(ct_device *dev, int op, float alpha, float beta, int64_t n, const float *x, float *y) {
    (void)dev;
    x = R(x); y = R(y);
    for (int64_t i = 0; i < n; i++) {
        float v = op == CT_UN_AFFINE && alpha == 0.0f ? 0.0f : x[i], r;
        switch (op) {
        case CT_UN_AFFINE: r = alpha == 0.0f ? beta : alpha * v + beta; break;
        case CT_UN_NEG: r = -v; break;
        case CT_UN_SIN: r = sinf(v); break;
        case CT_UN_COS: r = cosf(v); break;
        case CT_UN_TANH: r = tanhf(v); break;
        case CT_UN_RELU: r = (v > 0.0f || v != v) ? v : 0.0f; break;
        case CT_UN_STEP: r = v > 0.0f ? 1.0f : 0.0f; break;
        case CT_UN_GELU: r = ct_gelu_from_tanh(v, tanhf(ct_gelu_inner(v))); break;
        case CT_UN_GELU_GRAD: r = ct_gelu_grad_from_tanh(v, tanhf(ct_gelu_inner(v))); break;
        case CT_UN_EXP: r = expf(v); break;
        case CT_UN_LOG: r = logf(v); break;
        case CT_UN_SQRT: r = sqrtf(v); break;
        case CT_UN_RSQRT: r = 1.0f / sqrtf(v); break;
        case CT_UN_SQUARE: r = v * v; break;
        case CT_UN_SIGMOID: r = 1.0f / (1.0f + expf(-v)); break;
        case CT_UN_ABS: r = fabsf(v); break;
        case CT_UN_SIGN: r = ct_sign(v); break;
        case CT_UN_POW: r = ct_pow(v, alpha); break;
        case CT_UN_RDIV: r = alpha / v; break;
        default: r = ct_unary_ext(op, v); break;
        }
        y[i] = r;
    }
    return CT_OK;
}

/* A 16-bit float unary op: widened, m_unary's float32 formula, rounded back (ct_rm_*). */
static ct_status m_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n, int dtype,
                               const void *x, void *y) {
    const uint16_t *xs = (const uint16_t *)R(x);
    uint16_t *ys = (uint16_t *)R(y);
    std::vector<float> buf((size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        buf[(size_t)i] = dtype == CT_BF16 ? ct_rm_bf16_to_f32(xs[i]) : ct_rm_f16_to_f32(xs[i]);
    /* (m_unary takes "device" pointers: the host scratch at its device address) */
    float *dbuf = (float *)((uintptr_t)buf.data() + OFF);
    ct_status st = m_unary(dev, op, alpha, beta, n, dbuf, dbuf);
    for (int64_t i = 0; st == CT_OK && i < n; i++)
        ys[i] = dtype == CT_BF16 ? ct_rm_f32_to_bf16(buf[(size_t)i]) : ct_rm_f32_to_f16(buf[(size_t)i]);
    return st;
}

static ct_status m_binary(ct_device *dev, int op, int ndim, const int64_t *shape, float *out,
                          const float *a, const int64_t *as, const float *b, const int64_t *bs) {
    (void)dev;
    out = R(out); a = R(a); b = R(b);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    for (int64_t i = 0; i < n; i++) {
        int64_t ao, bo;
        ct_offsets2(i, ndim, shape, as, bs, &ao, &bo);
        out[i] = ct_binary_apply(op, a[ao], b[bo]);
    }
    return CT_OK;
}

static ct_status m_reduce(ct_device *dev, int op, int ndim, const int64_t *shape, uint32_t axes,
                          const float *x, float *out) {
    (void)dev;
    x = R(x); out = R(out);
    int64_t xs[16], st = 1, nout = 1, nred = 1;
    for (int d = ndim - 1; d >= 0; d--) { xs[d] = st; st *= shape[d]; }
    int64_t kept[16], ks[16], red[16], rs[16];
    int nk = 0, nr = 0;
    for (int d = 0; d < ndim; d++) {
        if (axes & (1u << d)) { red[nr] = shape[d]; rs[nr++] = xs[d]; nred *= shape[d]; }
        else { kept[nk] = shape[d]; ks[nk++] = xs[d]; nout *= shape[d]; }
    }
    for (int64_t q = 0; q < nout; q++) {
        int64_t rem = q, base = 0;
        for (int j = nk - 1; j >= 0; j--) { base += (rem % kept[j]) * ks[j]; rem /= kept[j]; }
        float acc = ct_red_identity(op);
        for (int64_t t = 0; t < nred; t++) {
            int64_t tr = t, off = base;
            for (int j = nr - 1; j >= 0; j--) { off += (tr % red[j]) * rs[j]; tr /= red[j]; }
            acc = ct_red_combine(op, acc, x[off]);
        }
        out[q] = acc;
    }
    return CT_OK;
}

static ct_status m_gemm(ct_device *dev, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                        int64_t ldc, int prec) {
    (void)dev;
    a = R(a); b = R(b); c = R(c);
    const int drop = ct_prec_drop_bits(prec); /* TF32 / bfloat16 inputs: ct_prec_math.h */
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double acc = 0;
            for (int64_t l = 0; l < k; l++) {
                float av = ct_prec_round(ta ? a[l * lda + i] : a[i * lda + l], drop);
                float bv = ct_prec_round(tb ? b[j * ldb + l] : b[l * ldb + j], drop);
                acc += (double)av * bv;
            }
            float prev = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
            c[i * ldc + j] = alpha * (float)acc + prev;
        }
    return CT_OK;
}

static ct_status m_allreduce(ct_device **devs, float **bufs, int nbufs, int64_t count, int op) {
    (void)devs;
    if (nbufs == 1 || count == 0) return CT_OK;
    for (int64_t i = 0; i < count; i++) {
        float acc = R(bufs[0])[i];
        for (int j = 1; j < nbufs; j++) acc = ct_red_combine(op, acc, R(bufs[j])[i]);
        for (int j = 0; j < nbufs; j++) R(bufs[j])[i] = acc;
    }
    return CT_OK;
}

static ct_status m_gather_rows(ct_device *dev, const float *table, int64_t nrows, int64_t ncols,
                               int64_t row0, const int32_t *ids, int64_t nids, float *out) {
    (void)dev;
    table = R(table); ids = R(ids); out = R(out);
    for (int64_t i = 0; i < nids; i++) {
        const int64_t r = (int64_t)ids[i] - row0;
        for (int64_t c = 0; c < ncols; c++)
            out[i * ncols + c] = (r >= 0 && r < nrows) ? table[r * ncols + c] : 0.0f;
    }
    return CT_OK;
}

static ct_status m_scatter_add_rows(ct_device *dev, float *table, int64_t nrows, int64_t ncols,
                                    int64_t row0, const int32_t *hit, const int32_t *start,
                                    int64_t nhit, const int32_t *pos, const float *g) {
    (void)dev;
    table = R(table); hit = R(hit); start = R(start); pos = R(pos); g = R(g);
    for (int64_t u = 0; u < nhit; u++) {
        const int64_t r = (int64_t)hit[u] - row0;
        if (r < 0 || r >= nrows) continue;
        for (int32_t k = start[u]; k < start[u + 1]; k++)
            for (int64_t c = 0; c < ncols; c++) table[r * ncols + c] += g[(int64_t)pos[k] * ncols + c];
    }
    return CT_OK;
}

// --- optimizer: the CUDA kernel's structure, run serially ----------------------------------
#define OPT_TPB 256
#define OPT_TILE (OPT_TPB * 4 * 2)
#define OPT_RED_CTAS 1024
struct opt_desc {
    void *p; const void *g; void *out; void *slot[CT_OPT_MAX_SLOTS];
    long long n, tile0; unsigned active; int vec, need_p, pad;
    float f[CT_OPT_MAX_STAGES];   // per-leaf stages: the block's factor
    int pdt, gdt, odt, sdt[CT_OPT_MAX_SLOTS];   // dtypes (float32, bfloat16, float16)
};
struct opt_params {
    int nstages, upto, nblocks; unsigned skip; long long ntiles;
    int kind[CT_OPT_MAX_STAGES]; int slot_off[CT_OPT_MAX_STAGES]; float c[CT_OPT_MAX_STAGES][CT_OM_NC];
};
// elements [e, e+L) of x (dtype dt), widened / rounded as cuda_optim.cu's ldx / stx
template <int L> static void ld(const void *x, int dt, long long e, float *v) { for (int j = 0; j < L; j++) v[j] = ct_cv_load_f(dt, R(x), e + j); }
template <int L> static void st(void *x, int dt, long long e, const float *v) { for (int j = 0; j < L; j++) ct_cv_store_f(dt, R(x), e + j, v[j]); }
template <int L, bool RED>
static void run_elems(const opt_params &P, const opt_desc *d, long long e, double &ss, double &bad) {
    float u[L], p[L];
    ld<L>(d->g, d->gdt, e, u);
    for (int j = 0; j < L; j++) p[j] = 0.0f;
    if (d->need_p) ld<L>(d->p, d->pdt, e, p);
    for (int k = 0; k < P.upto; k++) {
        if (!((d->active >> k) & 1u) || ((P.skip >> k) & 1u)) continue;
        const int kind = P.kind[k];
        if (ct_om_is_leafwise(kind)) {
            for (int j = 0; j < L; j++) u[j] = ct_om_leaf_apply(kind, d->f[k], u[j]);
            continue;
        }
        const int ns = ct_om_nslots(kind);
        float a[L], b[L], x[L];
        for (int j = 0; j < L; j++) a[j] = b[j] = x[j] = 0.0f;
        const int o = P.slot_off[k];
        if (ns > 0) ld<L>(d->slot[o], d->sdt[o], e, a);
        if (ns > 1) ld<L>(d->slot[o + 1], d->sdt[o + 1], e, b);
        if (ns > 2) ld<L>(d->slot[o + 2], d->sdt[o + 2], e, x);
        for (int j = 0; j < L; j++) u[j] = ct_om_stage(kind, P.c[k], u[j], p[j], &a[j], &b[j], &x[j], !RED);
        if (!RED) {
            if (ns > 0) st<L>(d->slot[o], d->sdt[o], e, a);
            if (ns > 1) st<L>(d->slot[o + 1], d->sdt[o + 1], e, b);
            if (ns > 2) st<L>(d->slot[o + 2], d->sdt[o + 2], e, x);
        }
    }
    if (RED) {
        for (int j = 0; j < L; j++) { ss += (double)u[j] * (double)u[j]; bad += isfinite(u[j]) ? 0.0 : 1.0; }
    } else if (d->out != nullptr) {
        st<L>(d->out, d->odt, e, u);
    } else {
        for (int j = 0; j < L; j++) p[j] = p[j] + u[j];
        st<L>(d->p, d->pdt, e, p);
    }
}
template <bool RED>
static void opt_kernel(unsigned grid, const opt_params &P, const opt_desc *D, double *part) {
    std::vector<double> s_ss(OPT_TPB), s_bad(OPT_TPB);
    for (unsigned bx = 0; bx < grid; bx++) {
        for (int tx = 0; tx < OPT_TPB; tx++) {
            double ss = 0.0, bad = 0.0;
            for (long long t = bx; t < P.ntiles; t += grid) {
                int lo = 0, hi = P.nblocks - 1;
                while (lo < hi) { int mid = (lo + hi + 1) >> 1; if (D[mid].tile0 <= t) lo = mid; else hi = mid - 1; }
                const opt_desc *d = &D[lo];
                const long long base = (t - d->tile0) * OPT_TILE;
                const long long end = base + OPT_TILE < d->n ? base + OPT_TILE : d->n;
                for (long long e = base + 4LL * tx; e < end; e += 4LL * OPT_TPB) {
                    if (d->vec && e + 4 <= end) run_elems<4, RED>(P, d, e, ss, bad);
                    else for (long long i = e; i < end && i < e + 4; i++) run_elems<1, RED>(P, d, i, ss, bad);
                }
            }
            s_ss[tx] = ss; s_bad[tx] = bad;
        }
        if (RED) {
            for (int w = OPT_TPB / 2; w > 0; w >>= 1)
                for (int tx = 0; tx < w; tx++) { s_ss[tx] += s_ss[tx + w]; s_bad[tx] += s_bad[tx + w]; }
            part[2 * bx] = s_ss[0]; part[2 * bx + 1] = s_bad[0];
        }
    }
}
static int is_aligned(const void *x) { return ((uintptr_t)x & 15u) == 0; }
// The device-resident norms (ct_opt_pass reduce = 2, dev_norm): the board of cuda_optim.cu.
static double g_board[CT_OPT_MAX_STAGES][CT_MAX_DEVICES];
static ct_status m_optim(ct_device *dev, const ct_opt_pass *ps, double *acc) {
    (void)dev;
    if (ps->reduce == 2 && (ps->igroup < 0 || ps->igroup >= CT_MAX_DEVICES || ps->upto < 0 ||
                            ps->upto >= CT_OPT_MAX_STAGES))
        return core->set_error(CT_EINVAL, "bad device-norm pass");
    for (int k = 0; k < ps->upto; k++)
        if (!ct_om_is_elementwise(ps->kind[k]) && !ct_om_is_leafwise(ps->kind[k]) &&
            ps->kind[k] != CT_OPT_GLOBAL_NORM && ps->kind[k] != CT_OPT_FINITE_GATE)
            return core->set_error(CT_EINVAL, "optimizer: stage %d (kind %d) is not supported on GPU devices yet", k, ps->kind[k]);
    opt_params P; memset(&P, 0, sizeof P);
    P.nstages = ps->nstages; P.upto = ps->upto; P.skip = ps->skip;
    for (int k = 0; k < ps->nstages; k++) {
        P.kind[k] = ps->kind[k]; P.slot_off[k] = ps->slot_off[k];
        for (int j = 0; j < CT_OM_NC; j++) P.c[k][j] = ps->c[k][j];
    }
    const unsigned reads = ps->dev_norm & (ps->upto >= 32 ? 0xffffffffu : ((1u << ps->upto) - 1u));
    for (int k = 0; k < ps->nstages; k++) {   // cuda_optim.cu's fetch_norms
        if (!((reads >> k) & 1u)) continue;
        double sum = 0.0;
        for (int j = 0; j < ps->ngroup; j++) sum += g_board[k][j];
        const float nrm = (float)sqrt(sum), mx = ps->c[k][2];
        P.c[k][0] = !(nrm < mx) ? 1.0f : 0.0f;
        P.c[k][1] = nrm;
    }
    std::vector<opt_desc> D(ps->nblocks > 0 ? ps->nblocks : 1);
    int m = 0; long long tiles = 0;
    for (int i = 0; i < ps->nblocks; i++) {
        const ct_opt_block *b = &ps->blocks[i];
        if (b->n == 0 || (ps->reduce && !b->counts)) continue;
        if ((ps->reduce == 1 || ps->reduce == 2) && !((b->active >> ps->upto) & 1u)) continue;
        opt_desc &d = D[m++];
        memset(&d, 0, sizeof d);
        if (ps->blk_f != nullptr)
            for (int k = 0; k < CT_OPT_MAX_STAGES; k++) d.f[k] = ps->blk_f[(size_t)i * CT_OPT_MAX_STAGES + k];
        d.p = b->p; d.g = b->g; d.out = ps->reduce ? nullptr : b->out; d.n = b->n; d.tile0 = tiles; d.active = b->active;
        d.pdt = b->p_dt; d.gdt = b->g_dt; d.odt = b->out_dt;
        for (int q = 0; q < CT_OPT_MAX_SLOTS; q++) d.sdt[q] = b->slot_dt[q];
        int vec = is_aligned(b->g), need_p = !ps->reduce && b->out == nullptr;
        if (!ps->reduce && b->out != nullptr) vec &= is_aligned(b->out);
        for (int k = 0; k < ps->upto; k++) {
            if (!((b->active >> k) & 1u) || ((ps->skip >> k) & 1u)) continue;
            need_p |= ps->kind[k] == CT_OPT_DECAY;
            for (int q = 0; q < ct_om_nslots(ps->kind[k]); q++) {
                d.slot[ps->slot_off[k] + q] = b->slot[ps->slot_off[k] + q];
                vec &= is_aligned(b->slot[ps->slot_off[k] + q]);
            }
        }
        if (need_p) vec &= is_aligned(b->p);
        d.need_p = need_p; d.vec = vec;
        tiles += (b->n + OPT_TILE - 1) / OPT_TILE;
    }
    P.nblocks = m; P.ntiles = tiles;
    if (ps->reduce == 3) {   // per-leaf sums of each counting block (cuda_optim.cu's leaf_pass)
        if (ps->blk_acc == nullptr) return core->set_error(CT_EINVAL, "per-leaf pass without output");
        for (int i = 0; i < 3 * ps->nblocks; i++) ps->blk_acc[i] = 0.0;
        const int sum_p = ps->kind[ps->upto] == CT_OPT_TRUST_RATIO || ps->kind[ps->upto] == CT_OPT_PARAM_RMS;
        for (int j = 0, i = 0; i < ps->nblocks; i++) {
            const ct_opt_block *b = &ps->blocks[i];
            if (b->n == 0 || !b->counts) continue;
            opt_desc d1 = D[j++];
            d1.need_p = sum_p || d1.need_p;
            for (long long e = 0; e < d1.n; e++) {
                double ss = 0, bad = 0;
                run_elems<1, true>(P, &d1, e, ss, bad);
                ps->blk_acc[3 * i] += ss;
                ps->blk_acc[3 * i + 2] += bad;
                if (sum_p) { float pv = ct_cv_load_f(d1.pdt, R(d1.p), e); ps->blk_acc[3 * i + 1] += (double)pv * pv; }
            }
        }
        return CT_OK;
    }
    if (!ps->reduce) {
        if (tiles == 0) return CT_OK;
        unsigned grid = tiles > 0x7fffffffLL ? 0x7fffffffu : (unsigned)tiles;
        opt_kernel<false>(grid, P, D.data(), nullptr);
        return CT_OK;
    }
    double tmp[2];
    if (ps->reduce == 2) acc = tmp;
    acc[0] = acc[1] = 0.0;
    const unsigned grid = tiles < OPT_RED_CTAS ? (unsigned)tiles : OPT_RED_CTAS;
    std::vector<double> part(2 * (grid > 0 ? grid : 1));
    if (grid > 0) opt_kernel<true>(grid, P, D.data(), part.data());
    for (unsigned i = 0; i < grid; i++) { acc[0] += part[2 * i]; acc[1] += part[2 * i + 1]; }
    if (ps->reduce == 2) g_board[ps->upto][ps->igroup] = acc[0];   // cuda_optim.cu's norm_to_board
    return CT_OK;
}

// --- random -------------------------------------------------------------------------------
static ct_status m_random(ct_device *dev, uint32_t k0, uint32_t k1, const ct_random_consts *c,
                          const ct_rm_block *blk, void *out) {
    (void)dev;
    if (c->dt != CT_F32 && c->dt != CT_F16 && c->dt != CT_BF16)
        return core->set_error(CT_ETYPE, "unsupported dtype");
    if (blk->count == 0) return CT_OK;
    char *o = R((char *)out);
    const bool contig = blk->ngroups == 0 || (blk->ngroups == 1 && blk->stride[0] == 1);
    size_t es = c->dist == CT_DIST_BERNOULLI ? 1 : (c->dt == CT_F32 ? 4 : 2);
    for (uint64_t e = 0; e < blk->count; e++) {
        uint64_t g = contig ? blk->base + e : ct_rm_block_index(blk, e);
        uint32_t w = ct_rm_element(c, c->dist, c->dt, ct_rm_bits32(k0, k1, g));
        if (es == 4) memcpy(o + 4 * e, &w, 4);
        else if (es == 2) { uint16_t h = (uint16_t)w; memcpy(o + 2 * e, &h, 2); }
        else o[e] = (char)(uint8_t)w;
    }
    return CT_OK;
}

static ct_status m_convert(ct_device *dev, int64_t n, int sdt, const void *x, int ddt, void *y) {
    (void)dev;
    x = R(x); y = R(y);
    for (int64_t i = 0; i < n; i++) ct_cv_elem(sdt, x, ddt, y, i);
    return CT_OK;
}

static ct_status m_ewise(ct_device *dev, int op, int dt, int ndim, const int64_t *shape, void *out,
                         const void *a, const int64_t *as, const void *b, const int64_t *bs) {
    (void)dev;
    out = R(out); a = R(a); b = R(b);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    for (int64_t i = 0; i < n; i++) {
        int64_t ao, bo;
        ct_offsets2(i, ndim, shape, as, bs, &ao, &bo);
        ct_ew_elem(op, dt, out, i, a, ao, b, bo);
    }
    return CT_OK;
}

static ct_status m_reduce_typed(ct_device *dev, int op, int dt, int ndim, const int64_t *shape,
                                uint32_t axes, const void *x, void *out) {
    (void)dev;
    x = R(x); out = R(out);
    ct_ew_red_plan p;
    ct_ew_red_plan_init(&p, ndim, shape, axes);
    int64_t nout = 1;
    for (int j = 0; j < p.nk; j++) nout *= p.kdim[j];
    for (int64_t q = 0; q < nout; q++) ct_ew_reduce_one(op, dt, &p, x, out, q);
    return CT_OK;
}

static const ct_backend g_mock = {
    "cuda", CT_PLATFORM_GPU, m_alloc, m_free, m_copy,
    NULL, /* copy_segments: the core falls back to copy_block (nothing asks: optim_factored 0) */
    m_sync, m_init,
    m_unary, m_binary, m_reduce, m_gemm, m_allreduce, m_gather_rows, m_scatter_add_rows, m_optim, m_random,
    m_convert, m_ewise, m_reduce_typed,
    0, /* optim_factored: adafactor steps are staged through the host (the CPU driver) */
    NULL, /* chain: fused chains run step by step (the CUDA chain kernel runs in tools/cuda_emu.sh) */
    m_unary_typed,
    NULL, NULL, NULL, NULL, /* graphs: replays run kernel by kernel (CUDA graphs run in tools/cuda_emu.sh) */
    NULL, NULL, /* NCCL across processes: spanning all-reduces go through the host (the emulated
                   NCCL runs them in tools/cuda_emu.sh's mpi_gpu2) */
};
static const ct_backend *self_backend(void) { return &g_mock; }

extern "C" __attribute__((visibility("default"))) ct_status
ct_cuda_backend_open(const ct_core_services *services, const ct_backend **backend, int *num_physical) {
    core = services;
    *backend = &g_mock;
    const char *e = getenv("MOCK_NGPU");
    *num_physical = e ? atoi(e) : 1;
    return CT_OK;
}
