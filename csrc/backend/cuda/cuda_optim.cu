/*
 * cuda_optim.cu — the fused multi-tensor optimizer pass on one GPU device
 * (ct_backend.optim_pass; the sequencing of passes is core/ct_optim_device.c).
 *
 * One launch per device and pass covers every block (leaf shard) of the
 * device. The host writes a table of block descriptors (pointers, n, active
 * stage mask, slot pointers, first tile) and uploads it once per pass kind,
 * only when it changed since the last step of that kind (params and state are
 * updated in place, so the table of a cached plan stays the same). The step's
 * stages and their fp32 constants are a __grid_constant__ kernel argument.
 *
 * Work: a block is cut into tiles of TILE elements; CTA i handles tile i
 * (grid-stride past 2^31 tiles) and finds its block by binary search over the
 * descriptors' first tiles, so tiny leaves and huge ones share one launch and
 * no thread ever spans two blocks. A thread takes 4 consecutive elements: one
 * float4 load/store per array when every pointer of the block is 16-byte
 * aligned, else (and for the last < 4 elements of a block) scalar. Each
 * element runs all stages of the chain in registers (ct_optim_math.h), each
 * state slot is read once and written once, then p += u in place (or out = u).
 * fp32 AdamW moves 28 bytes per parameter and nothing else: the kernel is
 * memory-bound.
 *
 * 16-bit operands (bfloat16 / float16 params, grads, updates or state slots, each
 * with its own dtype in the descriptor): loaded in their dtype (8 bytes per quad
 * instead of 16), widened exactly to float32 in registers, and what is stored is
 * rounded once to nearest even with ct_random_math.h's conversions, the CPU
 * driver's definitions: the same bits as the CPU (ct_optim.h). A pass whose
 * blocks are all float32 runs kernels compiled for float32 alone (template LP
 * false: the loads and stores above, unchanged); a pass with a 16-bit operand
 * runs their LP forms, which read each array's dtype from its descriptor.
 *
 * Numerics: this file is compiled with -fmad=false (setup.py) and default
 * IEEE division and sqrt, so each element is bit-identical to the CPU
 * reference. Reductions sum u^2 in double per thread, then per CTA in a fixed
 * tree; the CTA partials are added in CTA order: deterministic. A host
 * reduction (reduce = 1) copies them to the host (the round trip documented
 * in ct_optim_device.c). A device-resident global norm (reduce = 2) adds them
 * on the device (one thread, CTA order) into the norm board: pinned, mapped
 * host memory every GPU can read, one double per (stage, device position).
 * Later passes wait for every device's board write (cudaStreamWaitEvent on
 * the other devices' `reduced` events); a one-thread kernel per device
 * (fetch_norms) then adds the devices' sums in group order, as the host
 * would, into the device's own memory, where each CTA's prologue reads them. A board write first waits for the previous pass (its
 * `last` event) of every device that has run one, in this step's group or
 * not (the board's slots are group positions, which another train state's
 * steps reuse), so no pass still reading the board of an earlier step sees it
 * change.
 *
 * Adafactor (FACTORED): its statistics pass (reduce = 4) sums (u^2 + eps) of
 * each factored block along each factored dim in double, in a fixed order (the
 * lower dim in segments added in order, a matrix's rows by one CTA each with a
 * fixed tree), and copies them to the host (the pass waits); later passes multiply each element of a factored block by its row
 * and column factors (ct_om_factored_apply: device buffers the core filled),
 * and leaves that are not factored take the elementwise update of their v.
 *
 * The descriptor table, CTA partials and their pinned host mirrors are
 * allocated with cudaMalloc / cudaMallocHost outside the per-device
 * accounting (a few KB per device, kept for the process' life).
 */
#include <math.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "cuda_common.cuh"

extern "C" {
#include "../../core/ct_optim.h"
#include "../../core/ct_optim_math.h"
#include "../../core/ct_random_math.h" /* the float16 / bfloat16 conversions */
}

#define OPT_TPB 256
#define OPT_TILE (OPT_TPB * 4 * 2) /* elements per CTA tile: two float4 per thread */
#define OPT_RED_CTAS 1024          /* reduce passes: CTAs (grid-stride over the tiles) */

// --- descriptors ------------------------------------------------------------------------

struct opt_desc {
    void *p;
    const void *g;
    void *out;
    void *slot[CT_OPT_MAX_SLOTS];
    long long n;
    long long tile0;  /* first tile of this block in the launch */
    unsigned active;
    int vec;          /* every pointer used is aligned to a quad (16 bytes of float32, 8 of a
                       * 16-bit dtype): the quad path */
    int need_p;       /* p is read (DECAY, or p += u, or a per-leaf sum of p^2) */
    int pad;
    unsigned char pdt, gdt, odt, pad2; /* dtypes (ct_dtype) of p, g, out */
    unsigned char sdt[CT_OPT_MAX_SLOTS]; /* and of each slot */
    float f[CT_OPT_MAX_STAGES]; /* per-leaf stages: this block's factor (ct_om_leaf_apply) */
    /* adafactor (the step's FACTORED stage): the block's geometry if it is factored, and
     * once computed its row / column factors (device memory; NULL: not factored, or not yet) */
    const float *flo, *fhi;
    ct_om_fg fg;
};

struct opt_params {
    int nstages, upto, nblocks;
    unsigned skip;
    long long ntiles;
    int kind[CT_OPT_MAX_STAGES];
    int slot_off[CT_OPT_MAX_STAGES];
    float c[CT_OPT_MAX_STAGES][CT_OM_NC];
    unsigned dev_norm;       /* GLOBAL_NORM stages whose (clip, norm) come from normc */
    const float *normc;      /* normc[2k], normc[2k+1]: stage k's clip flag and norm, on
                              * this device (fetch_norms wrote them from the board) */
    int per_tile;            /* reduce passes: sums per tile (3 doubles: u^2, non-finite,
                              * p^2) instead of per CTA (2 doubles) */
};

/* The CTA's three sums in a fixed-order tree (deterministic), written by thread 0. */
__device__ __forceinline__ void cta_sum3(double ss, double bad, double pp, double *out) {
    __shared__ double s3[3][OPT_TPB];
    s3[0][threadIdx.x] = ss;
    s3[1][threadIdx.x] = bad;
    s3[2][threadIdx.x] = pp;
    __syncthreads();
    for (int w = OPT_TPB / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) {
            s3[0][threadIdx.x] += s3[0][threadIdx.x + w];
            s3[1][threadIdx.x] += s3[1][threadIdx.x + w];
            s3[2][threadIdx.x] += s3[2][threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = s3[0][0];
        out[1] = s3[1][0];
        out[2] = s3[2][0];
    }
    __syncthreads(); /* s3 is reused by the next tile */
}

// --- kernel -----------------------------------------------------------------------------

/* Element groups of a thread: L = 1 (one element), 4 (four consecutive elements, one float4
 * per array) or 8 (two such quads, the second OPT_GS elements after the first: each of the two
 * loads of a warp reads 512 consecutive bytes). Element j of the group is at offset goff(j). */
#define OPT_GS (4 * OPT_TPB)

template <int L>
__device__ __forceinline__ long long goff(int j) {
    return L == 8 ? (long long)(j & 3) + (long long)(j >> 2) * OPT_GS : (long long)j;
}

/* One 16-byte load from global memory (ld.global.v4.f32). Written out for the kernels that
 * store with st_v4: with those inline stores in a kernel, nvcc 13 no longer proves that the
 * descriptors' pointers are global and emits generic loads (ld.v4.f32) for a plain float4
 * read. Neither asm has a "memory" clobber, so the compiler may move these loads past the
 * stores and other memory accesses: safe because in a pass no thread reads an address it
 * (or any thread) writes in the same pass except the element it owns, which it loads once
 * before computing the value it stores there (the store depends on the load's result). */
__device__ __forceinline__ float4 ld_v4(const float *x) {
#ifdef CT_CUDA_EMU_RUNTIME_H
    return *reinterpret_cast<const float4 *>(x);
#else
    float4 t;
    asm("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(t.x), "=f"(t.y), "=f"(t.z), "=f"(t.w)
        : "l"(x));
    return t;
#endif
}

/* VS: each quad through ld_v4; else a float4 read */
template <int L, bool VS = false>
__device__ __forceinline__ void ld(const float *x, float *v) {
    if (L == 1) {
        v[0] = x[0];
    } else {
#pragma unroll
        for (int q = 0; q < L / 4; q++) {
            const float4 t = VS ? ld_v4(x + q * OPT_GS) : *reinterpret_cast<const float4 *>(x + q * OPT_GS);
            v[4 * q] = t.x; v[4 * q + 1] = t.y; v[4 * q + 2] = t.z; v[4 * q + 3] = t.w;
        }
    }
}

/* One 16-byte store to global memory (st.global.v4.f32, the default cache policy), for
 * st's VS form. A float4 assignment is split by nvcc 13's front end into four 32-bit
 * st.global.f32; ptxas merges them back into one 16-byte store only where it saw a 16-byte
 * load through the same address register (the state slots), not for p or out, whose
 * pointers it reloads from the descriptor: four store instructions, and four partial-sector
 * L2 writes, where one would do. Both forms are built (CTRAINSTATE_OPT_VSTORE picks;
 * tests/gpu/test_cuda_codegen.py checks the PTX). Volatile, no "memory" clobber: see ld_v4. */
__device__ __forceinline__ void st_v4(float *x, float4 t) {
#ifdef CT_CUDA_EMU_RUNTIME_H
    *reinterpret_cast<float4 *>(x) = t;
#else
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(x), "f"(t.x), "f"(t.y),
                 "f"(t.z), "f"(t.w));
#endif
}

template <int L, bool VS = false>
__device__ __forceinline__ void st(float *x, const float *v) {
    if (L == 1) {
        x[0] = v[0];
    } else {
#pragma unroll
        for (int q = 0; q < L / 4; q++) {
            const float4 t = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
            if (VS) st_v4(x + q * OPT_GS, t);
            else *reinterpret_cast<float4 *>(x + q * OPT_GS) = t;
        }
    }
}

/* A 16-bit element widened to float32 (exact), and a float32 rounded to nearest even to a
 * 16-bit dtype: ct_random_math.h's conversions, those of the CPU driver. */
__device__ __forceinline__ float w16(int dt, unsigned short h) {
    return dt == CT_BF16 ? ct_rm_bf16_to_f32(h) : ct_rm_f16_to_f32(h);
}

__device__ __forceinline__ unsigned r16(int dt, float f) {
    return dt == CT_BF16 ? ct_rm_f32_to_bf16(f) : ct_rm_f32_to_f16(f);
}

/* Elements [e, e+L) (goff<L>'s layout) of array x of dtype dt, as float32. LP false: x is
 * float32, and this is ld<L, VS> on it. A 16-bit quad is one 8-byte load. */
template <int L, bool LP, bool VS = false>
__device__ __forceinline__ void ldx(const void *x, int dt, long long e, float *v) {
    if (!LP || dt == CT_F32) {
        ld<L, VS>(static_cast<const float *>(x) + e, v);
    } else if (L == 1) {
        v[0] = w16(dt, static_cast<const unsigned short *>(x)[e]);
    } else {
        const unsigned short *h = static_cast<const unsigned short *>(x) + e;
#pragma unroll
        for (int q = 0; q < L / 4; q++) {
            const uint2 t = *reinterpret_cast<const uint2 *>(h + q * OPT_GS);
            v[4 * q] = w16(dt, (unsigned short)(t.x & 0xffffu));
            v[4 * q + 1] = w16(dt, (unsigned short)(t.x >> 16));
            v[4 * q + 2] = w16(dt, (unsigned short)(t.y & 0xffffu));
            v[4 * q + 3] = w16(dt, (unsigned short)(t.y >> 16));
        }
    }
}

/* Elements [e, e+L) of array x of dtype dt = v, rounded to dt (LP false: st<L, VS>). */
template <int L, bool LP, bool VS = false>
__device__ __forceinline__ void stx(void *x, int dt, long long e, const float *v) {
    if (!LP || dt == CT_F32) {
        st<L, VS>(static_cast<float *>(x) + e, v);
    } else if (L == 1) {
        static_cast<unsigned short *>(x)[e] = (unsigned short)r16(dt, v[0]);
    } else {
        unsigned short *h = static_cast<unsigned short *>(x) + e;
#pragma unroll
        for (int q = 0; q < L / 4; q++) {
            uint2 t;
            t.x = r16(dt, v[4 * q]) | (r16(dt, v[4 * q + 1]) << 16);
            t.y = r16(dt, v[4 * q + 2]) | (r16(dt, v[4 * q + 3]) << 16);
            *reinterpret_cast<uint2 *>(h + q * OPT_GS) = t;
        }
    }
}

/* The first stage of [0, upto) that reads state slots per element in block d (-1: none).
 * compute_u issues that stage's slot loads together with the loads of g and p, so the
 * common chains (one stateful stage: adam, adamw, lion, momentum, rmsprop...) wait for
 * memory once per element group instead of twice. */
__device__ __forceinline__ int first_slot_stage(const opt_params &P, const opt_desc *d) {
    for (int k = 0; k < P.upto; k++) {
        if (!((d->active >> k) & 1u) || ((P.skip >> k) & 1u)) continue;
        const int kind = P.kind[k];
        if (ct_om_is_leafwise(kind) || (kind == CT_OPT_FACTORED && d->flo != nullptr)) continue;
        if (ct_om_nslots(kind) > (kind == CT_OPT_FACTORED ? 2 : 0)) return k;
    }
    return -1;
}

/* Stage k's slots of block d (NULL: that slot is not per element) and their dtypes. */
struct slot3 {
    void *a, *b, *x;
    int adt, bdt, xdt;
};

__device__ __forceinline__ slot3 slot_ptrs(const opt_params &P, const opt_desc *d, int k) {
    const int kind = P.kind[k], o = P.slot_off[k];
    const int ns = ct_om_nslots(kind), s0 = kind == CT_OPT_FACTORED ? 2 : 0;
    slot3 r;
    r.a = ns > 0 && s0 <= 0 ? d->slot[o] : nullptr;
    r.b = ns > 1 && s0 <= 1 ? d->slot[o + 1] : nullptr;
    r.x = ns > 2 ? d->slot[o + 2] : nullptr;
    r.adt = r.a ? (int)d->sdt[o] : (int)CT_F32;
    r.bdt = r.b ? (int)d->sdt[o + 1] : (int)CT_F32;
    r.xdt = r.x ? (int)d->sdt[o + 2] : (int)CT_F32;
    return r;
}

/* u (and p) of elements [e, e+L) of block d after stages [0, upto); state written unless
 * RED. C: the stages' fp32 constants (P.c with the device-resident norms filled in); k0:
 * first_slot_stage(P, d). LP: the arrays may be 16-bit (ldx / stx). */
template <int L, bool RED, bool LP>
__device__ __forceinline__ void compute_u(const opt_params &P, const float (*C)[CT_OM_NC],
                                          const opt_desc *d, int k0, long long e, float *u,
                                          float *p) {
    /* every load the first stateful stage needs is issued before any is used */
    float a0[L], b0[L];
    slot3 s0 = {nullptr, nullptr, nullptr, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < L; j++) p[j] = a0[j] = b0[j] = 0.0f;
    ldx<L, LP>(d->g, d->gdt, e, u);
    if (d->need_p) ldx<L, LP>(d->p, d->pdt, e, p);
    if (k0 >= 0) {
        s0 = slot_ptrs(P, d, k0);
        if (s0.a) ldx<L, LP>(s0.a, s0.adt, e, a0);
        if (s0.b) ldx<L, LP>(s0.b, s0.bdt, e, b0); /* a third slot (rare) is loaded in the stage loop */
    }
    for (int k = 0; k < P.upto; k++) {
        if (!((d->active >> k) & 1u) || ((P.skip >> k) & 1u)) continue;
        const int kind = P.kind[k];
        if (ct_om_is_leafwise(kind)) {
#pragma unroll
            for (int j = 0; j < L; j++) u[j] = ct_om_leaf_apply(kind, d->f[k], u[j]);
            continue;
        }
        if (kind == CT_OPT_FACTORED && d->flo != nullptr) { /* a factored block */
#pragma unroll
            for (int j = 0; j < L; j++) u[j] = ct_om_factored_apply(&d->fg, d->flo, d->fhi, e + goff<L>(j), u[j]);
            continue;
        }
        /* FACTORED on a leaf that is not factored: only its third slot (v) is per element */
        float a[L], b[L], x[L];
        slot3 sl;
        if (k == k0) {
            sl = s0;
#pragma unroll
            for (int j = 0; j < L; j++) {
                a[j] = a0[j];
                b[j] = b0[j];
                x[j] = 0.0f;
            }
            if (sl.x) ldx<L, LP>(sl.x, sl.xdt, e, x);
        } else {
            sl = slot_ptrs(P, d, k);
#pragma unroll
            for (int j = 0; j < L; j++) a[j] = b[j] = x[j] = 0.0f;
            if (sl.a) ldx<L, LP>(sl.a, sl.adt, e, a);
            if (sl.b) ldx<L, LP>(sl.b, sl.bdt, e, b);
            if (sl.x) ldx<L, LP>(sl.x, sl.xdt, e, x);
        }
#pragma unroll
        for (int j = 0; j < L; j++)
            u[j] = ct_om_stage(kind, C[k], u[j], p[j], &a[j], &b[j], &x[j], !RED);
        if (!RED) {
            if (sl.a) stx<L, LP>(sl.a, sl.adt, e, a);
            if (sl.b) stx<L, LP>(sl.b, sl.bdt, e, b);
            if (sl.x) stx<L, LP>(sl.x, sl.xdt, e, x);
        }
    }
}

/* Elements [e, e+L) of block d: stages [0, upto), then apply or accumulate. */
template <int L, bool RED, bool LP>
__device__ __forceinline__ void run_elems(const opt_params &P, const float (*C)[CT_OM_NC],
                                          const opt_desc *d, int k0, long long e, double &ss,
                                          double &bad, double &pp) {
    float u[L], p[L];
    compute_u<L, RED, LP>(P, C, d, k0, e, u, p);
    if (RED) {
#pragma unroll
        for (int j = 0; j < L; j++) {
            ss += (double)u[j] * (double)u[j];
            bad += isfinite(u[j]) ? 0.0 : 1.0;
            pp += (double)p[j] * (double)p[j]; /* 0 unless p was loaded (need_p) */
        }
    } else if (d->out != nullptr) {
        stx<L, LP>(d->out, d->odt, e, u);
    } else {
#pragma unroll
        for (int j = 0; j < L; j++) p[j] = p[j] + u[j];
        stx<L, LP>(d->p, d->pdt, e, p);
    }
}

/* The stages' constants into shared memory C, device-resident norms filled in (every thread
 * of the CTA calls it). */
__device__ __forceinline__ void load_consts(const opt_params &P, float (*C)[CT_OM_NC]) {
    for (int i = threadIdx.x; i < CT_OPT_MAX_STAGES * CT_OM_NC; i += blockDim.x)
        C[i / CT_OM_NC][i % CT_OM_NC] = P.c[i / CT_OM_NC][i % CT_OM_NC];
    __syncthreads();
    if (P.dev_norm != 0u && threadIdx.x == 0) {
        for (int k = 0; k < P.nstages; k++) {
            if (!((P.dev_norm >> k) & 1u)) continue;
            C[k][0] = P.normc[2 * k];
            C[k][1] = P.normc[2 * k + 1];
        }
    }
    __syncthreads();
}

/* The block of tile t: the last whose first tile is <= t. Tiles come in increasing order, so
 * the search starts after the previous tile's block `cur` (-1: none yet), which is returned
 * as it is while t is still in it. */
__device__ __forceinline__ int opt_tile_block(const opt_params &P, const opt_desc *D, long long t,
                                              int cur) {
    if (cur >= 0 && !(cur + 1 < P.nblocks && D[cur + 1].tile0 <= t)) return cur;
    int lo = cur + 1 > 0 ? cur + 1 : 0, hi = P.nblocks - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (D[mid].tile0 <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <bool RED, bool PRE, int U, bool LP>
__global__ void __launch_bounds__(OPT_TPB)
opt_kernel(const __grid_constant__ opt_params P, const opt_desc *__restrict__ D, double *part) {
    __shared__ float C[CT_OPT_MAX_STAGES][CT_OM_NC];
    load_consts(P, C);
    double ss = 0.0, bad = 0.0, pp = 0.0;
    int cur = -1, k0 = -1; /* the block of the previous tile, and its first_slot_stage */
    for (long long t = blockIdx.x; t < P.ntiles; t += gridDim.x) {
        if (cur < 0 || (cur + 1 < P.nblocks && D[cur + 1].tile0 <= t)) {
            cur = opt_tile_block(P, D, t, cur);
            k0 = PRE ? first_slot_stage(P, &D[cur]) : -1;
        }
        const opt_desc *d = &D[cur];
        const long long base = (t - d->tile0) * OPT_TILE;
        const long long end = base + OPT_TILE < d->n ? base + OPT_TILE : d->n;
        /* U = 2: a thread's two quads of a full stretch go through the stages together (twice
         * the loads in flight per thread); elsewhere quad by quad */
        for (long long e0 = base + 4LL * threadIdx.x; e0 < end; e0 += (long long)U * OPT_GS) {
            if (U == 2 && d->vec && e0 + OPT_GS + 4 <= end) {
                run_elems<U == 2 ? 8 : 4, RED, LP>(P, C, d, k0, e0, ss, bad, pp);
                continue;
            }
            for (int q = 0; q < U; q++) {
                const long long e = e0 + (long long)q * OPT_GS;
                if (e >= end) break;
                if (d->vec && e + 4 <= end) {
                    run_elems<4, RED, LP>(P, C, d, k0, e, ss, bad, pp);
                } else {
                    for (long long i = e; i < end && i < e + 4; i++)
                        run_elems<1, RED, LP>(P, C, d, k0, i, ss, bad, pp);
                }
            }
        }
        if (RED && P.per_tile) { /* per-leaf reductions: every tile on its own */
            cta_sum3(ss, bad, pp, part + 3 * t);
            ss = bad = pp = 0.0;
        }
    }
    if (RED && !P.per_tile) { /* fixed-order tree over the CTA: deterministic */
        __shared__ double s_ss[OPT_TPB], s_bad[OPT_TPB];
        s_ss[threadIdx.x] = ss;
        s_bad[threadIdx.x] = bad;
        __syncthreads();
        for (int w = OPT_TPB / 2; w > 0; w >>= 1) {
            if ((int)threadIdx.x < w) {
                s_ss[threadIdx.x] += s_ss[threadIdx.x + w];
                s_bad[threadIdx.x] += s_bad[threadIdx.x + w];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            part[2 * blockIdx.x] = s_ss[0];
            part[2 * blockIdx.x + 1] = s_bad[0];
        }
    }
}

// --- chain kernels ----------------------------------------------------------------------

/* The update pass of common optimizer chains, with the chain's stage kinds fixed at
 * compile time.
 *
 * The generic kernel (opt_kernel) reads each stage's kind at run time, so every stage of
 * the loop is compiled for every kind ct_om_stage knows, and the registers of the largest
 * one are held throughout: 62 per thread unrolled once, 80 with a spill unrolled twice
 * (nvcc --resource-usage, sm_90), which caps it at 4 or 3 CTAs of 256 threads per SM. Here a
 * chain of up to four known kinds compiles to straight-line code for those kinds only.
 *
 * Same bits: each element runs the same ct_om_stage calls in the same order as the generic
 * kernel's compute_u for the same constants, masks and skip bits; tiles, element groups and
 * the block walk are the generic kernel's (opt_tile_block). Only the update pass (no
 * reductions, no adafactor factors, no per-leaf stages) takes this path; anything else, or
 * CTRAINSTATE_OPT_CHAIN=0, runs opt_kernel. tests/gpu/test_gpu.py compares the two bit for bit
 * and counts these launches (ct_cuda_optim_chain_launches).
 */

/* A chain: up to four stage kinds, -1 past the end. */
template <int K0, int K1 = -1, int K2 = -1, int K3 = -1>
struct opt_chain {
    static constexpr int n = (K0 >= 0) + (K1 >= 0) + (K2 >= 0) + (K3 >= 0);
    static constexpr int k0 = K0, k1 = K1, k2 = K2, k3 = K3;
};

/* The chains with a kernel of their own (optax's names). Order: their ids. */
using chain_adamw = opt_chain<CT_OPT_ADAM, CT_OPT_DECAY, CT_OPT_SCALE>;
using chain_adam = opt_chain<CT_OPT_ADAM, CT_OPT_SCALE>;
using chain_clip_adamw = opt_chain<CT_OPT_GLOBAL_NORM, CT_OPT_ADAM, CT_OPT_DECAY, CT_OPT_SCALE>;
using chain_clip_adam = opt_chain<CT_OPT_GLOBAL_NORM, CT_OPT_ADAM, CT_OPT_SCALE>;
using chain_momentum = opt_chain<CT_OPT_TRACE, CT_OPT_SCALE>;
using chain_sgd = opt_chain<CT_OPT_SCALE>;
#define OPT_NCHAINS 6

/* Slots per element of the kinds a chain may hold. */
template <int KIND>
__device__ constexpr int chain_nslots() {
    static_assert(KIND == CT_OPT_ADAM || KIND == CT_OPT_TRACE || KIND == CT_OPT_SCALE ||
                      KIND == CT_OPT_DECAY || KIND == CT_OPT_GLOBAL_NORM,
                  "chain kernels take elementwise kinds whose slot count is listed here");
    return KIND == CT_OPT_ADAM ? 2 : (KIND == CT_OPT_TRACE ? 1 : 0);
}

/* Stage k (of kind KIND, not per-leaf, not FACTORED) on elements [e, e+L) of block d: as
 * compute_u's stage loop body. */
template <int KIND, int L, bool LP>
__device__ __forceinline__ void chain_stage(int k, const opt_params &P,
                                            const float (*C)[CT_OM_NC], const opt_desc *d,
                                            long long e, float *u, const float *p) {
    if (!((d->active >> k) & 1u) || ((P.skip >> k) & 1u)) return;
    constexpr int ns = chain_nslots<KIND>();
    float a[L], b[L], x[L];
#pragma unroll
    for (int j = 0; j < L; j++) a[j] = b[j] = x[j] = 0.0f;
    const int o = P.slot_off[k];
    void *sa = ns > 0 ? d->slot[o] : nullptr;
    void *sb = ns > 1 ? d->slot[o + 1] : nullptr;
    const int adt = ns > 0 && LP ? (int)d->sdt[o] : (int)CT_F32;
    const int bdt = ns > 1 && LP ? (int)d->sdt[o + 1] : (int)CT_F32;
    if (ns > 0) ldx<L, LP>(sa, adt, e, a);
    if (ns > 1) ldx<L, LP>(sb, bdt, e, b);
#pragma unroll
    for (int j = 0; j < L; j++) u[j] = ct_om_stage(KIND, C[k], u[j], p[j], &a[j], &b[j], &x[j], 1);
    if (ns > 0) stx<L, LP>(sa, adt, e, a);
    if (ns > 1) stx<L, LP>(sb, bdt, e, b);
}

/* Elements [e, e+L) of block d through the chain, then p += u in place (or out = u): as
 * run_elems<L, false, LP>. The stages run over all L elements in turn, and everything is
 * stored at the end: the stores are as nvcc compiles a float4 assignment (st, VS false). */
template <class CH, int L, bool LP>
__device__ __forceinline__ void chain_elems(const opt_params &P, const float (*C)[CT_OM_NC],
                                            const opt_desc *d, long long e) {
    float u[L], p[L];
#pragma unroll
    for (int j = 0; j < L; j++) p[j] = 0.0f;
    ldx<L, LP>(d->g, d->gdt, e, u);
    if (d->need_p) ldx<L, LP>(d->p, d->pdt, e, p);
    chain_stage<CH::k0, L, LP>(0, P, C, d, e, u, p);
    if constexpr (CH::k1 >= 0) chain_stage<CH::k1, L, LP>(1, P, C, d, e, u, p);
    if constexpr (CH::k2 >= 0) chain_stage<CH::k2, L, LP>(2, P, C, d, e, u, p);
    if constexpr (CH::k3 >= 0) chain_stage<CH::k3, L, LP>(3, P, C, d, e, u, p);
    if (d->out != nullptr) {
        stx<L, LP>(d->out, d->odt, e, u);
    } else {
#pragma unroll
        for (int j = 0; j < L; j++) p[j] = p[j] + u[j];
        stx<L, LP>(d->p, d->pdt, e, p);
    }
}

/* The 16-byte-store form of chain_elems (CTRAINSTATE_OPT_VSTORE=1): every load of the group
 * (g, p, each running stage's slots) is issued first through ld_v4; then each quad goes
 * through the whole chain and is stored through st_v4 before the next quad starts, so its
 * registers are free again while the next one computes. Element by element the same
 * operations as chain_elems. Registers: see opt_chain_kernel. */
template <int KIND, int L>
__device__ __forceinline__ bool chain_load_q(int k, const opt_params &P, const opt_desc *d,
                                             long long e, float *a, float *b) {
    constexpr int ns = chain_nslots<KIND>();
#pragma unroll
    for (int j = 0; j < L; j++) a[j] = b[j] = 0.0f;
    if (!((d->active >> k) & 1u) || ((P.skip >> k) & 1u)) return false;
    if (ns > 0) ld<L, true>(static_cast<const float *>(d->slot[P.slot_off[k]]) + e, a);
    if (ns > 1) ld<L, true>(static_cast<const float *>(d->slot[P.slot_off[k] + 1]) + e, b);
    return true;
}

/* Stage k of kind KIND (`on`: chain_load_q's answer) on the W elements (one quad, or one
 * element) at e, its slots stored. */
template <int KIND, int W>
__device__ __forceinline__ void chain_apply_q(int k, bool on, const opt_params &P,
                                              const float (*C)[CT_OM_NC], const opt_desc *d,
                                              long long e, float *u, const float *p, float *a,
                                              float *b) {
    constexpr int ns = chain_nslots<KIND>();
    if (!on) return;
    float x[W];
#pragma unroll
    for (int j = 0; j < W; j++) {
        x[j] = 0.0f;
        u[j] = ct_om_stage(KIND, C[k], u[j], p[j], &a[j], &b[j], &x[j], 1);
    }
    if (ns > 0) st<W, true>(static_cast<float *>(d->slot[P.slot_off[k]]) + e, a);
    if (ns > 1) st<W, true>(static_cast<float *>(d->slot[P.slot_off[k] + 1]) + e, b);
}

template <class CH, int L>
__device__ __forceinline__ void chain_elems_q(const opt_params &P, const float (*C)[CT_OM_NC],
                                              const opt_desc *d, long long e) {
    constexpr int W = L == 1 ? 1 : 4, Q = L / W;
    float u[L], p[L], a[4][L], b[4][L];
    bool on[4] = {false, false, false, false};
#pragma unroll
    for (int j = 0; j < L; j++) p[j] = 0.0f;
    ld<L, true>(static_cast<const float *>(d->g) + e, u);
    if (d->need_p) ld<L, true>(static_cast<const float *>(d->p) + e, p);
    on[0] = chain_load_q<CH::k0, L>(0, P, d, e, a[0], b[0]);
    if constexpr (CH::k1 >= 0) on[1] = chain_load_q<CH::k1, L>(1, P, d, e, a[1], b[1]);
    if constexpr (CH::k2 >= 0) on[2] = chain_load_q<CH::k2, L>(2, P, d, e, a[2], b[2]);
    if constexpr (CH::k3 >= 0) on[3] = chain_load_q<CH::k3, L>(3, P, d, e, a[3], b[3]);
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const long long eq = e + (long long)q * OPT_GS; /* e + goff<L>(q * W) */
        float *uq = u + q * W, *pq = p + q * W;
        chain_apply_q<CH::k0, W>(0, on[0], P, C, d, eq, uq, pq, a[0] + q * W, b[0] + q * W);
        if constexpr (CH::k1 >= 0)
            chain_apply_q<CH::k1, W>(1, on[1], P, C, d, eq, uq, pq, a[1] + q * W, b[1] + q * W);
        if constexpr (CH::k2 >= 0)
            chain_apply_q<CH::k2, W>(2, on[2], P, C, d, eq, uq, pq, a[2] + q * W, b[2] + q * W);
        if constexpr (CH::k3 >= 0)
            chain_apply_q<CH::k3, W>(3, on[3], P, C, d, eq, uq, pq, a[3] + q * W, b[3] + q * W);
        if (d->out != nullptr) {
            st<W, true>(static_cast<float *>(d->out) + eq, uq);
        } else {
#pragma unroll
            for (int j = 0; j < W; j++) pq[j] = pq[j] + uq[j];
            st<W, true>(static_cast<float *>(d->p) + eq, pq);
        }
    }
}

/* LP: the arrays may be 16-bit (chain_elems only: the VS form is float32's) */
template <class CH, int L, bool VS, bool LP>
__device__ __forceinline__ void chain_group(const opt_params &P, const float (*C)[CT_OM_NC],
                                            const opt_desc *d, long long e) {
    static_assert(!(VS && LP), "the 16-byte form is for float32 arrays");
    if (VS) chain_elems_q<CH, L>(P, C, d, e);
    else chain_elems<CH, L, LP>(P, C, d, e);
}

/* The tiles of CTA blockIdx.x (as opt_kernel's loop), each element group through chain_group;
 * C: the stages' constants. */
template <class CH, int U, bool VS, bool LP>
__device__ __forceinline__ void chain_tiles(const opt_params &P, const float (*C)[CT_OM_NC],
                                            const opt_desc *__restrict__ D) {
    int cur = -1;
    for (long long t = blockIdx.x; t < P.ntiles; t += gridDim.x) {
        cur = opt_tile_block(P, D, t, cur);
        const opt_desc *d = &D[cur];
        const long long base = (t - d->tile0) * OPT_TILE;
        const long long end = base + OPT_TILE < d->n ? base + OPT_TILE : d->n;
        for (long long e0 = base + 4LL * threadIdx.x; e0 < end; e0 += (long long)U * OPT_GS) {
            if (U == 2 && d->vec && e0 + OPT_GS + 4 <= end) {
                chain_group<CH, U == 2 ? 8 : 4, VS, LP>(P, C, d, e0);
                continue;
            }
            for (int q = 0; q < U; q++) {
                const long long e = e0 + (long long)q * OPT_GS;
                if (e >= end) break;
                if (d->vec && e + 4 <= end) {
                    chain_group<CH, 4, VS, LP>(P, C, d, e);
                } else {
                    for (long long i = e; i < end && i < e + 4; i++) chain_group<CH, 1, VS, LP>(P, C, d, i);
                }
            }
        }
    }
}

/* VS: 16-byte loads and stores (chain_elems_q). A chain with a GLOBAL_NORM stage copies the
 * constants into shared memory first (load_consts: the device-resident norm is filled in
 * from global memory, behind two barriers); the others read them straight from the kernel
 * argument (the constant bank), so a CTA starts on its first tile at once, which matters
 * most with one CTA per tile (CTRAINSTATE_OPT_WAVES=0).
 *
 * Registers: the bounds ask for 4 CTAs of 256 threads per SM unrolled twice, 5 once, the
 * occupancy of the smallest forms, so that ptxas does not trade one form's occupancy for a
 * few registers. nvcc 13, sm_90, --resource-usage, adamw: 64 and 48 registers (the default
 * form; one 4-byte spill per tile unrolled once), 60 and 47 with 16-byte loads and stores;
 * without the bounds ptxas took 62 and 46, and 71 (3 CTAs per SM) and 48, or spilled 60
 * bytes with the constants in the constant bank. */
template <class CH, int U, bool VS, bool LP>
__device__ __forceinline__ void chain_body(const opt_params &P, const opt_desc *__restrict__ D) {
    if constexpr (CH::k0 == CT_OPT_GLOBAL_NORM || CH::k1 == CT_OPT_GLOBAL_NORM ||
                  CH::k2 == CT_OPT_GLOBAL_NORM || CH::k3 == CT_OPT_GLOBAL_NORM) {
        __shared__ float C[CT_OPT_MAX_STAGES][CT_OM_NC];
        load_consts(P, C);
        chain_tiles<CH, U, VS, LP>(P, C, D);
    } else {
        chain_tiles<CH, U, VS, LP>(P, P.c, D);
    }
}

template <class CH, int U, bool VS>
__global__ void __launch_bounds__(OPT_TPB, U == 2 ? 4 : 5)
opt_chain_kernel(const __grid_constant__ opt_params P, const opt_desc *__restrict__ D) {
    chain_body<CH, U, VS, false>(P, D);
}

/* The chain kernels of passes with 16-bit arrays (ldx / stx: each array in its dtype), in the
 * default form only (CTRAINSTATE_OPT_VSTORE does not apply to them). A kernel of its own name
 * (not a template argument of opt_chain_kernel): tests/gpu/test_cuda_codegen.py reads the float32
 * kernels' PTX by their names. Same bounds: not measured on a GPU yet. */
template <class CH, int U>
__global__ void __launch_bounds__(OPT_TPB, U == 2 ? 4 : 5)
opt_chain16_kernel(const __grid_constant__ opt_params P, const opt_desc *__restrict__ D) {
    chain_body<CH, U, false, true>(P, D);
}

template <class CH>
static bool chain_is(const opt_params &P) {
    const int k[4] = {CH::k0, CH::k1, CH::k2, CH::k3};
    if (P.nstages != CH::n || P.upto != CH::n) return false;
    for (int i = 0; i < CH::n; i++)
        if (P.kind[i] != k[i]) return false;
    return true;
}

/* The id of P's chain among the chains above, or -1 (the generic kernel). Per-leaf stages
 * (ct_om_is_leafwise) and FACTORED are not in any chain, so a match needs neither. */
static int chain_id(const opt_params &P) {
    if (chain_is<chain_adamw>(P)) return 0;
    if (chain_is<chain_adam>(P)) return 1;
    if (chain_is<chain_clip_adamw>(P)) return 2;
    if (chain_is<chain_clip_adam>(P)) return 3;
    if (chain_is<chain_momentum>(P)) return 4;
    if (chain_is<chain_sgd>(P)) return 5;
    return -1;
}

/* CTAs of chain `id`'s kernel (unrolled 1 or 2 times, VS: 16-byte stores; LP: the 16-bit
 * kernel, VS ignored) resident per SM. */
template <int U, bool VS, bool LP>
static cudaError_t chain_occupancy(int id, int *n) {
    if (LP) switch (id) {
    case 0: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain16_kernel<chain_adamw, U>, OPT_TPB, 0);
    case 1: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain16_kernel<chain_adam, U>, OPT_TPB, 0);
    case 2: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain16_kernel<chain_clip_adamw, U>, OPT_TPB, 0);
    case 3: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain16_kernel<chain_clip_adam, U>, OPT_TPB, 0);
    case 4: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain16_kernel<chain_momentum, U>, OPT_TPB, 0);
    default: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain16_kernel<chain_sgd, U>, OPT_TPB, 0);
    }
    switch (id) {
    case 0: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain_kernel<chain_adamw, U, VS>, OPT_TPB, 0);
    case 1: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain_kernel<chain_adam, U, VS>, OPT_TPB, 0);
    case 2: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain_kernel<chain_clip_adamw, U, VS>, OPT_TPB, 0);
    case 3: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain_kernel<chain_clip_adam, U, VS>, OPT_TPB, 0);
    case 4: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain_kernel<chain_momentum, U, VS>, OPT_TPB, 0);
    default: return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, opt_chain_kernel<chain_sgd, U, VS>, OPT_TPB, 0);
    }
}

/* Update passes that took a chain kernel, since the process started (tests check that the
 * common chains do; benchmarks/bench_optim.py --gpu reports it). */
static std::atomic<long long> g_chain_launches{0};

extern "C" __attribute__((visibility("default"))) long long ct_cuda_optim_chain_launches(void) {
    return g_chain_launches.load();
}

/* Launch chain `id`'s kernel (0 <= id < OPT_NCHAINS), unrolled 1 or 2 times, VS: 16-byte
 * stores; LP: the 16-bit kernel (VS ignored). */
template <int U, bool VS, bool LP>
static void chain_launch(int id, unsigned grid, cudaStream_t s, const opt_params &P,
                         const opt_desc *table) {
    if (LP) {
        switch (id) {
        case 0: opt_chain16_kernel<chain_adamw, U><<<grid, OPT_TPB, 0, s>>>(P, table); break;
        case 1: opt_chain16_kernel<chain_adam, U><<<grid, OPT_TPB, 0, s>>>(P, table); break;
        case 2: opt_chain16_kernel<chain_clip_adamw, U><<<grid, OPT_TPB, 0, s>>>(P, table); break;
        case 3: opt_chain16_kernel<chain_clip_adam, U><<<grid, OPT_TPB, 0, s>>>(P, table); break;
        case 4: opt_chain16_kernel<chain_momentum, U><<<grid, OPT_TPB, 0, s>>>(P, table); break;
        default: opt_chain16_kernel<chain_sgd, U><<<grid, OPT_TPB, 0, s>>>(P, table); break;
        }
        return;
    }
    switch (id) {
    case 0: opt_chain_kernel<chain_adamw, U, VS><<<grid, OPT_TPB, 0, s>>>(P, table); break;
    case 1: opt_chain_kernel<chain_adam, U, VS><<<grid, OPT_TPB, 0, s>>>(P, table); break;
    case 2: opt_chain_kernel<chain_clip_adamw, U, VS><<<grid, OPT_TPB, 0, s>>>(P, table); break;
    case 3: opt_chain_kernel<chain_clip_adam, U, VS><<<grid, OPT_TPB, 0, s>>>(P, table); break;
    case 4: opt_chain_kernel<chain_momentum, U, VS><<<grid, OPT_TPB, 0, s>>>(P, table); break;
    default: opt_chain_kernel<chain_sgd, U, VS><<<grid, OPT_TPB, 0, s>>>(P, table); break;
    }
}

/* A device-resident norm: this device's sum, CTA partials added in CTA order, onto the
 * board (system memory: fenced so that other GPUs see it once the event completes). */
__global__ void norm_to_board(const double *part, unsigned nparts, double *slot) {
    double sum = 0.0;
    for (unsigned i = 0; i < nparts; i++) sum += part[2 * i];
    *slot = sum;
    __threadfence_system();
}

/* Adafactor's statistics of descriptor j (reduce = 4): x = u^2 + eps for the u entering stage
 * P.upto, summed in double along one factored dim, in a fixed order (run to run identical).
 *
 * Over the lower dim (entry t of n_nolo, t = (p*M + m)*L + jj; elements ((p*Slo + a)*M + m)*L
 * + jj): the a range is cut into nseg segments so that there are enough threads; thread
 * (seg, t), consecutive t in a warp (coalesced), sums its segment into part[seg*n_nolo + t];
 * fstat_sum_segments then adds the segments in order. */
__device__ __forceinline__ double fstat_x(const opt_params &P, const float (*C)[CT_OM_NC],
                                          const opt_desc *d, long long idx, float eps) {
    float u, p;
    compute_u<1, true, true>(P, C, d, -1, idx, &u, &p); /* no prefetch: the slots in the stage loop */
    const float x = u * u + eps;
    return (double)x;
}

__global__ void __launch_bounds__(OPT_TPB)
fstat_lo_kernel(const __grid_constant__ opt_params P, const opt_desc *__restrict__ D, int j,
                float eps, long long nseg, double *part) {
    __shared__ float C[CT_OPT_MAX_STAGES][CT_OM_NC];
    load_consts(P, C);
    const opt_desc *d = &D[j];
    const ct_om_fg f = d->fg;
    const long long n = f.n_nolo;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n * nseg;
         i += (long long)gridDim.x * blockDim.x) {
        const long long seg = i / n, t = i % n;
        const long long a0 = f.Slo * seg / nseg, a1 = f.Slo * (seg + 1) / nseg;
        const long long pm = t / f.L, jj = t % f.L, pp = pm / f.M, m = pm % f.M;
        long long idx = ((pp * f.Slo + a0) * f.M + m) * f.L + jj;
        double sum = 0.0;
        for (long long a = a0; a < a1; a++, idx += f.M * f.L) sum += fstat_x(P, C, d, idx, eps);
        part[i] = sum;
    }
}

/* out[t] = sum over seg of part[seg*n + t], segments in order. */
__global__ void fstat_sum_segments(const double *part, long long n, long long nseg, double *out) {
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n;
         t += (long long)gridDim.x * blockDim.x) {
        double sum = 0.0;
        for (long long s = 0; s < nseg; s++) sum += part[s * n + t];
        out[t] = sum;
    }
}

/* Over the higher dim (entry t of n_nohi, t = line*Q + q; elements line*L + b*Q + q). Q == 1
 * (a matrix's rows): one CTA per line, thread k sums b = k, k + OPT_TPB, ... (coalesced), then
 * a fixed-order tree over the CTA. Q > 1: one thread per entry. */
__global__ void __launch_bounds__(OPT_TPB)
fstat_hi_kernel(const __grid_constant__ opt_params P, const opt_desc *__restrict__ D, int j,
                float eps, double *out) {
    __shared__ float C[CT_OPT_MAX_STAGES][CT_OM_NC];
    __shared__ double red[OPT_TPB];
    load_consts(P, C);
    const opt_desc *d = &D[j];
    const ct_om_fg f = d->fg;
    if (f.Q == 1) {
        for (long long line = blockIdx.x; line < f.n_nohi; line += gridDim.x) {
            double sum = 0.0;
            for (long long b = threadIdx.x; b < f.Shi; b += OPT_TPB)
                sum += fstat_x(P, C, d, line * f.L + b, eps);
            red[threadIdx.x] = sum;
            __syncthreads();
            for (int w = OPT_TPB / 2; w > 0; w >>= 1) {
                if ((int)threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
                __syncthreads();
            }
            if (threadIdx.x == 0) out[line] = red[0];
            __syncthreads(); /* red is reused by the next line */
        }
        return;
    }
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < f.n_nohi;
         t += (long long)gridDim.x * blockDim.x) {
        const long long line = t / f.Q, q = t % f.Q;
        double sum = 0.0;
        long long idx = line * f.L + q;
        for (long long b = 0; b < f.Shi; b++, idx += f.Q) sum += fstat_x(P, C, d, idx, eps);
        out[t] = sum;
    }
}

/* Per-leaf reductions: each descriptor's tile sums, in tile order, into out[3i..3i+2]
 * (sum u^2, sum p^2, non-finite: ct_opt_pass.blk_acc's order). */
__global__ void sum_tiles(const opt_desc *__restrict__ D, int m, const double *part,
                          double *out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    const long long t0 = D[i].tile0, nt = (D[i].n + OPT_TILE - 1) / OPT_TILE;
    double ss = 0.0, bad = 0.0, pp = 0.0;
    for (long long t = t0; t < t0 + nt; t++) {
        ss += part[3 * t];
        bad += part[3 * t + 1];
        pp += part[3 * t + 2];
    }
    out[3 * i] = ss;
    out[3 * i + 1] = pp;
    out[3 * i + 2] = bad;
}

/* The norms a pass reads, from the board into this device's memory (one read of system
 * memory per device and stage, not one per CTA): ct_optim_device.c's host formula, the
 * devices' sums added in group order. */
struct fetch_norms_args {
    float maxn[CT_OPT_MAX_STAGES]; /* max_norm of each GLOBAL_NORM stage */
};

__global__ void fetch_norms(const double *board, int ngroup, unsigned mask,
                           const __grid_constant__ fetch_norms_args a, float *normc) {
    for (int k = 0; k < CT_OPT_MAX_STAGES; k++) {
        if (!((mask >> k) & 1u)) continue;
        const volatile double *b = board + (size_t)k * CT_MAX_DEVICES;
        double sum = 0.0;
        for (int j = 0; j < ngroup; j++) sum += b[j];
        const float nrm = (float)sqrt(sum), mx = a.maxn[k];
        normc[2 * k] = !(nrm < mx) ? 1.0f : 0.0f;
        normc[2 * k + 1] = nrm;
    }
}

// --- per-device cache -----------------------------------------------------------------------

/* A descriptor table on one device. Each pass kind (0 apply, 1 reduce) keeps OPT_TABLES of
 * them, so plans that alternate (MultiSteps' accumulate and update steps, two train states
 * on one device) each find their table already on the device: no upload, no wait. */
#define OPT_TABLES 4
struct opt_table {
    opt_desc *h = nullptr;  /* pinned host copy of what the device table holds */
    opt_desc *d = nullptr;
    int cap = 0, n = -1;
    unsigned long long used = 0;    /* LRU stamp */
    cudaEvent_t uploaded = nullptr; /* h is free to rewrite once this completed */
};

struct opt_cache {
    std::mutex mu;
    opt_table tab[2][OPT_TABLES];
    unsigned long long clock = 0;
    double *d_part = nullptr, *h_part = nullptr;
    cudaEvent_t reduced = nullptr; /* after this device's last board write */
    cudaEvent_t last = nullptr;    /* after this device's last pass */
    float *d_normc = nullptr;      /* fetch_norms' output: 2 floats per stage */
    double *d_tiles = nullptr;     /* per-leaf reductions: 3 sums per tile */
    long long tiles_cap = 0;
    double *d_blk = nullptr, *h_blk = nullptr; /* and per descriptor (device, pinned host) */
    int blk_cap = 0;
    double *d_fstat = nullptr;  /* adafactor statistics of one pass (device) */
    long long fstat_cap = 0;
    /* main_grid: CTAs per SM of each update-pass kernel (occ_index; 0: not asked yet) */
    int per_sm[8 + 6 * OPT_NCHAINS] = {};
    int sms = 0;                  /* and the device's SMs (0: not asked yet) */
};

static opt_cache g_opt_cache[CT_MAX_DEVICES];

/* The norm board (see the top of the file), allocated once. */
static std::mutex g_board_mu;
static double *g_board = nullptr;

static ct_status board(double **out) {
    std::lock_guard<std::mutex> lock(g_board_mu);
    if (g_board == nullptr) {
        double *h = nullptr;
        CT_CUDA_TRY(cudaHostAlloc((void **)&h,
                                  (size_t)CT_OPT_MAX_STAGES * CT_MAX_DEVICES * sizeof(double),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
        memset(h, 0, (size_t)CT_OPT_MAX_STAGES * CT_MAX_DEVICES * sizeof(double));
        g_board = h;
    }
    void *d = nullptr;
    CT_CUDA_TRY(cudaHostGetDevicePointer(&d, g_board, 0));
    *out = (double *)d;
    return CT_OK;
}

static ct_status ensure_event(cudaEvent_t *ev) {
    if (*ev == nullptr) CT_CUDA_TRY(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    return CT_OK;
}

/* One more than the highest device id that has a `last` event (wait_board's range). */
static std::atomic<int> g_last_hi{0};

/* Make stream s wait for the `reduced` event of every other device of the step (events not
 * yet created: that device has not run such a pass, nothing to wait for). */
static ct_status wait_group(const ct_device *dev, const ct_opt_pass *ps) {
    cudaStream_t s = ct_cuda_stream(dev);
    for (int j = 0; j < ps->ngroup; j++) {
        const int id = ps->group_dev[j];
        if (id == dev->id || id < 0 || id >= CT_MAX_DEVICES) continue;
        cudaEvent_t ev = g_opt_cache[id].reduced;
        if (ev != nullptr) CT_CUDA_TRY(cudaStreamWaitEvent(s, ev, 0));
    }
    return CT_OK;
}

/* Before a board write: make stream s wait for the `last` event of every other device that
 * has run an optimizer pass, not only those of this step. The board's slots are positions
 * in a step's group, so a step of another group (another train state, on other devices or
 * in another order) reads the same slots, and its passes may not have run yet. */
static ct_status wait_board(const ct_device *dev) {
    cudaStream_t s = ct_cuda_stream(dev);
    const int hi = g_last_hi.load();
    for (int id = 0; id < hi; id++) {
        if (id == dev->id) continue;
        cudaEvent_t ev = g_opt_cache[id].last;
        if (ev != nullptr) CT_CUDA_TRY(cudaStreamWaitEvent(s, ev, 0));
    }
    return CT_OK;
}

/* Whether a quad (4 elements) of dtype dt at x is one aligned access. */
static int is_aligned(const void *x, int dt) {
    return ((uintptr_t)x & (dt == CT_F32 ? 15u : 7u)) == 0;
}

/* Build the descriptors of the pass into scratch (host), count tiles; src[j]: the index in
 * ps->blocks of descriptor j; *lowp: some descriptor has a 16-bit array. */
static int build_desc(const ct_opt_pass *ps, opt_desc *out, int *src, long long *ntiles,
                      int *lowp) {
    int m = 0;
    long long tiles = 0;
    *lowp = 0;
    /* a per-leaf reduction of TRUST_RATIO or PARAM_RMS also sums p^2 */
    const int sum_p = ps->reduce == 3 && (ps->kind[ps->upto] == CT_OPT_TRUST_RATIO ||
                                          ps->kind[ps->upto] == CT_OPT_PARAM_RMS);
    for (int i = 0; i < ps->nblocks; i++) {
        const ct_opt_block *b = &ps->blocks[i];
        if (b->n == 0 || (ps->reduce && !b->counts)) continue;
        /* a global norm or finite gate counts only the leaves it is active on */
        if ((ps->reduce == 1 || ps->reduce == 2) && !((b->active >> ps->upto) & 1u)) continue;
        if (ps->reduce == 4 && (ps->fstat == nullptr || ps->fstat[i] == nullptr)) continue;
        src[m] = i;
        opt_desc &d = out[m++];
        memset(&d, 0, sizeof d);
        if (b->geom.ndim > 0) d.fg = ct_om_fgeom(&b->geom);
        if (ps->ffac != nullptr && ps->ffac[i] != nullptr) {
            d.flo = ps->ffac[i];
            d.fhi = ps->ffac[i] + d.fg.n_nolo;
        }
        if (ps->blk_f != nullptr)
            for (int k = 0; k < CT_OPT_MAX_STAGES; k++)
                d.f[k] = ps->blk_f[(size_t)i * CT_OPT_MAX_STAGES + k];
        d.p = b->p;
        d.g = b->g;
        d.out = ps->reduce ? nullptr : b->out;
        d.n = b->n;
        d.tile0 = tiles;
        d.active = b->active;
        d.gdt = b->g_dt;
        int vec = is_aligned(b->g, b->g_dt), need_p = (!ps->reduce && b->out == nullptr) || sum_p;
        int lp = b->g_dt != CT_F32;
        if (!ps->reduce && b->out != nullptr) {
            d.odt = b->out_dt;
            vec &= is_aligned(b->out, b->out_dt);
            lp |= b->out_dt != CT_F32;
        }
        for (int k = 0; k < ps->upto; k++) {
            if (!((b->active >> k) & 1u) || ((ps->skip >> k) & 1u)) continue;
            need_p |= ps->kind[k] == CT_OPT_DECAY;
            /* FACTORED: v_row / v_col are not per element; v only on leaves not factored */
            const int q0 = ps->kind[k] == CT_OPT_FACTORED ? (b->geom.ndim > 0 ? 3 : 2) : 0;
            for (int q = q0; q < ct_om_nslots(ps->kind[k]); q++) {
                const int i = ps->slot_off[k] + q;
                d.slot[i] = b->slot[i];
                d.sdt[i] = b->slot_dt[i];
                vec &= is_aligned(b->slot[i], b->slot_dt[i]);
                lp |= b->slot_dt[i] != CT_F32;
            }
        }
        if (need_p) {
            d.pdt = b->p_dt;
            vec &= is_aligned(b->p, b->p_dt);
            lp |= b->p_dt != CT_F32;
        }
        d.need_p = need_p;
        d.vec = vec;
        *lowp |= lp;
        tiles += (b->n + OPT_TILE - 1) / OPT_TILE;
    }
    *ntiles = tiles;
    return m;
}

/* Make the table `scratch` (m descriptors) resident among the kind's tables ts; *out: its
 * device copy. A table seen recently is reused as it is. Otherwise the least recently used
 * one is overwritten: its pinned copy once the previous upload from it has completed (a
 * host wait only if it has not), its device copy in stream order after the passes that
 * read it. */
static ct_status upload(ct_device *dev, opt_table *ts, unsigned long long *clock,
                        const opt_desc *scratch, int m, const opt_desc **out) {
    cudaStream_t s = ct_cuda_stream(dev);
    opt_table *t = &ts[0];
    for (int i = 0; i < OPT_TABLES; i++) {
        if (ts[i].n == m && memcmp(scratch, ts[i].h, (size_t)m * sizeof *scratch) == 0) {
            ts[i].used = ++*clock;
            *out = ts[i].d;
            return CT_OK;
        }
        if (ts[i].used < t->used) t = &ts[i];
    }
    if (m > t->cap) {
        int cap = m < 64 ? 64 : 2 * m;
        if (t->uploaded != nullptr) CT_CUDA_TRY(cudaEventSynchronize(t->uploaded));
        CT_CUDA_TRY(cudaStreamSynchronize(s)); /* the old device table may still be read */
        if (t->h != nullptr) CT_CUDA_TRY(cudaFreeHost(t->h));
        if (t->d != nullptr) CT_CUDA_TRY(cudaFree(t->d));
        t->h = nullptr;
        t->d = nullptr;
        t->cap = 0;
        t->n = -1;
        CT_CUDA_TRY(cudaMallocHost((void **)&t->h, (size_t)cap * sizeof(opt_desc)));
        CT_CUDA_TRY(cudaMalloc((void **)&t->d, (size_t)cap * sizeof(opt_desc)));
        t->cap = cap;
    }
    if (t->uploaded == nullptr) CT_CUDA_TRY(cudaEventCreateWithFlags(&t->uploaded, cudaEventDisableTiming));
    const cudaError_t q = cudaEventQuery(t->uploaded);
    if (q == cudaErrorNotReady) CT_CUDA_TRY(cudaEventSynchronize(t->uploaded)); /* h still read */
    else CT_CUDA_TRY(q);
    t->n = -1; /* valid again once queued */
    memcpy(t->h, scratch, (size_t)m * sizeof *scratch);
    CT_CUDA_TRY(cudaMemcpyAsync(t->d, t->h, (size_t)m * sizeof(opt_desc), cudaMemcpyHostToDevice, s));
    CT_CUDA_TRY(cudaEventRecord(t->uploaded, s));
    t->n = m;
    t->used = ++*clock;
    *out = t->d;
    return CT_OK;
}

static ct_status pass_launch(ct_device *dev, opt_cache *cache, const ct_opt_pass *ps, opt_params P,
                             const opt_desc *table, int m, const int *src, unsigned reads,
                             double *board_d, double *acc, int lowp);

/* The per-leaf reduction pass (reduce = 3): per-tile sums, per-descriptor sums in tile order,
 * one copy to the host (the pass waits), then ps->blk_acc in ps->blocks order. */
static ct_status leaf_pass(ct_device *dev, opt_cache *cache, const ct_opt_pass *ps, opt_params P,
                           const opt_desc *table, int m, const int *src, int lowp) {
    cudaStream_t s = ct_cuda_stream(dev);
    for (int i = 0; i < 3 * ps->nblocks; i++) ps->blk_acc[i] = 0.0;
    if (m == 0 || P.ntiles == 0) { /* nothing to sum; later board writes still order after it */
        CT_CUDA_TRY(cudaEventRecord(cache->last, s));
        return CT_OK;
    }
    if (P.ntiles > cache->tiles_cap) {
        if (cache->d_tiles != nullptr) {
            CT_CUDA_TRY(cudaStreamSynchronize(s)); /* an earlier pass may still use it */
            CT_CUDA_TRY(cudaFree(cache->d_tiles));
            cache->d_tiles = nullptr;
            cache->tiles_cap = 0;
        }
        CT_CUDA_TRY(cudaMalloc((void **)&cache->d_tiles, 3 * (size_t)P.ntiles * sizeof(double)));
        cache->tiles_cap = P.ntiles;
    }
    if (m > cache->blk_cap) {
        if (cache->d_blk != nullptr) {
            CT_CUDA_TRY(cudaStreamSynchronize(s));
            CT_CUDA_TRY(cudaFree(cache->d_blk));
            cache->d_blk = nullptr;
        }
        if (cache->h_blk != nullptr) {
            CT_CUDA_TRY(cudaFreeHost(cache->h_blk));
            cache->h_blk = nullptr;
        }
        cache->blk_cap = 0;
        CT_CUDA_TRY(cudaMalloc((void **)&cache->d_blk, 3 * (size_t)m * sizeof(double)));
        CT_CUDA_TRY(cudaMallocHost((void **)&cache->h_blk, 3 * (size_t)m * sizeof(double)));
        cache->blk_cap = m;
    }
    P.per_tile = 1;
    const unsigned grid = P.ntiles > 0x7fffffffLL ? 0x7fffffffu : (unsigned)P.ntiles;
    if (lowp) opt_kernel<true, false, 1, true><<<grid, OPT_TPB, 0, s>>>(P, table, cache->d_tiles);
    else opt_kernel<true, false, 1, false><<<grid, OPT_TPB, 0, s>>>(P, table, cache->d_tiles);
    CT_CUDA_TRY(cudaGetLastError());
    sum_tiles<<<(unsigned)((m + 127) / 128), 128, 0, s>>>(table, m, cache->d_tiles,
                                                          cache->d_blk);
    CT_CUDA_TRY(cudaGetLastError());
    CT_CUDA_TRY(cudaMemcpyAsync(cache->h_blk, cache->d_blk, 3 * (size_t)m * sizeof(double),
                                cudaMemcpyDeviceToHost, s));
    CT_CUDA_TRY(cudaStreamSynchronize(s)); /* the host round trip of a per-leaf reduction */
    CT_CUDA_TRY(cudaEventRecord(cache->last, s));
    for (int j = 0; j < m; j++)
        for (int q = 0; q < 3; q++) ps->blk_acc[3 * src[j] + q] = cache->h_blk[3 * j + q];
    return CT_OK;
}

/* Segments of the lower-dim statistic: enough threads to fill a GPU (2^16), at most Slo. */
static long long fstat_segments(const ct_om_fg *f) {
    long long nseg = f->n_nolo > 0 ? ((1LL << 16) + f->n_nolo - 1) / f->n_nolo : 1;
    if (nseg > f->Slo) nseg = f->Slo;
    return nseg < 1 ? 1 : nseg;
}

/* CTAs of OPT_TPB threads for n items, at least 1, at most cap (grid-stride beyond). */
static unsigned fstat_grid(long long n, long long cap) {
    long long g = (n + OPT_TPB - 1) / OPT_TPB;
    return (unsigned)(g < 1 ? 1 : (g > cap ? cap : g));
}

/* Adafactor's statistics pass (reduce = 4): per factored block, the lower-dim sums in segments
 * and their sum, then the higher-dim sums; one copy to the host (the pass waits), then
 * ps->fstat[block]. */
static ct_status fstat_pass(ct_device *dev, opt_cache *cache, const ct_opt_pass *ps, opt_params P,
                            const opt_desc *table, int m, const int *src) {
    cudaStream_t s = ct_cuda_stream(dev);
    long long total = 0, part_max = 0;
    for (int j = 0; j < m; j++) {
        const ct_om_fg f = ct_om_fgeom(&ps->blocks[src[j]].geom);
        total += f.n_nolo + f.n_nohi;
        const long long nseg = fstat_segments(&f);
        if (nseg * f.n_nolo > part_max) part_max = nseg * f.n_nolo;
    }
    if (m == 0 || total == 0) {
        CT_CUDA_TRY(cudaEventRecord(cache->last, s));
        return CT_OK;
    }
    if (total + part_max > cache->fstat_cap) {
        if (cache->d_fstat != nullptr) {
            CT_CUDA_TRY(cudaStreamSynchronize(s)); /* an earlier pass may still use it */
            CT_CUDA_TRY(cudaFree(cache->d_fstat));
            cache->d_fstat = nullptr;
            cache->fstat_cap = 0;
        }
        CT_CUDA_TRY(cudaMalloc((void **)&cache->d_fstat, (size_t)(total + part_max) * sizeof(double)));
        cache->fstat_cap = total + part_max;
    }
    double *part = cache->d_fstat + total; /* segment partials, reused block after block */
    double *host = (double *)malloc((size_t)total * sizeof(double));
    if (host == nullptr)
        return ct_cuda_core->set_error(CT_EOOM, "optimizer: out of host memory for %lld statistics",
                                       total);
    const float eps = P.c[ps->upto][1];
    long long off = 0;
    cudaError_t e = cudaSuccess;
    for (int j = 0; j < m && e == cudaSuccess; j++) {
        const ct_om_fg f = ct_om_fgeom(&ps->blocks[src[j]].geom);
        const long long nseg = fstat_segments(&f);
        fstat_lo_kernel<<<fstat_grid(nseg * f.n_nolo, 65535), OPT_TPB, 0, s>>>(P, table, j, eps,
                                                                              nseg, part);
        e = cudaGetLastError();
        if (e != cudaSuccess) break;
        fstat_sum_segments<<<fstat_grid(f.n_nolo, 65535), OPT_TPB, 0, s>>>(part, f.n_nolo, nseg,
                                                                         cache->d_fstat + off);
        e = cudaGetLastError();
        if (e != cudaSuccess) break;
        off += f.n_nolo;
        /* Q == 1: a CTA per line; else a thread per entry */
        const unsigned g3 = f.Q == 1 ? (unsigned)(f.n_nohi < 0x7fffffffLL ? (f.n_nohi > 0 ? f.n_nohi : 1)
                                                                       : 0x7fffffffLL)
                                     : fstat_grid(f.n_nohi, 65535);
        fstat_hi_kernel<<<g3, OPT_TPB, 0, s>>>(P, table, j, eps, cache->d_fstat + off);
        e = cudaGetLastError();
        off += f.n_nohi;
    }
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(host, cache->d_fstat, (size_t)total * sizeof(double),
                            cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s); /* the host round trip of the statistics */
    if (e == cudaSuccess) e = cudaEventRecord(cache->last, s);
    if (e != cudaSuccess) {
        free(host);
        return ct_cuda_core->set_error(CT_EDEVICE, "CUDA error in the adafactor statistics: %s",
                                       cudaGetErrorString(e));
    }
    off = 0;
    for (int j = 0; j < m; j++) {
        const ct_om_fg f = ct_om_fgeom(&ps->blocks[src[j]].geom);
        memcpy(ps->fstat[src[j]], host + off, (size_t)(f.n_nolo + f.n_nohi) * sizeof(double));
        off += f.n_nolo + f.n_nohi;
    }
    free(host);
    return CT_OK;
}

// --- entry --------------------------------------------------------------------------------

static ct_status optim_pass_locked(ct_device *dev, opt_cache *cache, const ct_opt_pass *ps,
                                   double *acc) {
    opt_params P;
    memset(&P, 0, sizeof P);
    P.nstages = ps->nstages;
    P.upto = ps->upto;
    P.skip = ps->skip;
    const int to_board = ps->reduce == 2;
    if (to_board && (ps->igroup < 0 || ps->igroup >= CT_MAX_DEVICES || ps->upto < 0 ||
                     ps->upto >= CT_OPT_MAX_STAGES))
        return ct_cuda_core->set_error(CT_EINVAL, "optimizer: bad device-norm pass (group %d, "
                                       "stage %d)", ps->igroup, ps->upto);
    /* the norms this pass reads: only those of stages it runs */
    const unsigned reads = ps->dev_norm & (ps->upto >= 32 ? 0xffffffffu : ((1u << ps->upto) - 1u));
    double *board_d = nullptr; /* the board, as a device pointer */
    if (reads != 0u || to_board) {
        CT_TRY(board(&board_d));
        P.dev_norm = reads;
    }
    for (int k = 0; k < ps->nstages; k++) {
        P.kind[k] = ps->kind[k];
        P.slot_off[k] = ps->slot_off[k];
        for (int j = 0; j < CT_OM_NC; j++) P.c[k][j] = ps->c[k][j];
    }
    if (ps->reduce == 3 && (ps->blk_acc == nullptr || ps->upto < 0 || ps->upto >= ps->nstages))
        return ct_cuda_core->set_error(CT_EINVAL, "optimizer: bad per-leaf reduction pass");
    const size_t nb = (size_t)(ps->nblocks > 0 ? ps->nblocks : 1);
    opt_desc *scratch = (opt_desc *)malloc(nb * sizeof(opt_desc));
    int *src = (int *)malloc(nb * sizeof(int));
    if (scratch == nullptr || src == nullptr) {
        free(scratch);
        free(src);
        return ct_cuda_core->set_error(CT_EOOM, "optimizer: out of host memory for %d block descriptors",
                                       ps->nblocks);
    }
    long long ntiles = 0;
    int lowp = 0;
    const int m = build_desc(ps, scratch, src, &ntiles, &lowp);
    P.nblocks = m;
    P.ntiles = ntiles;
    ct_status st = CT_OK;
    const opt_desc *table = nullptr;
    if (m > 0) st = upload(dev, cache->tab[ps->reduce ? 1 : 0], &cache->clock, scratch, m, &table);
    free(scratch);
    if (st == CT_OK) st = pass_launch(dev, cache, ps, P, table, m, src, reads, board_d, acc, lowp);
    free(src);
    return st;
}

/* Launch settings of the update pass, settable for measurements (benchmarks/bench_optim.py
 * --gpu compares them in one run; read at each launch: a getenv beside a kernel launch):
 *   CTRAINSTATE_OPT_UNROLL=1|2     a thread takes its two quads of a tile through the stages
 *                                  one after the other, or together (default 2: twice the
 *                                  loads in flight per thread)
 *   CTRAINSTATE_OPT_PREFETCH=0|1   1: the first stateful stage's slots are loaded together
 *                                  with g and p (default 0: in the stage loop; fewer registers,
 *                                  more CTAs per SM)
 *   CTRAINSTATE_OPT_WAVES=w        CTAs: w times what the GPU holds at once, each looping over
 *                                  tiles (default 1); 0: one CTA per tile
 *   CTRAINSTATE_OPT_CHAIN=0|1      1: the chains of the chain kernels (adamw, adam, both after
 *                                  clip_by_global_norm, sgd with and without momentum) run
 *                                  their own kernel (default 1; PREFETCH does not apply to
 *                                  them); 0: every chain runs the generic kernel
 *   CTRAINSTATE_OPT_VSTORE=0|1     chain kernels: 1 loads and stores each quad with one
 *                                  16-byte access, quad by quad (chain_elems_q); 0 (default)
 *                                  as nvcc compiles float4 accesses: p and out are stored 32
 *                                  bits at a time (see st_v4)
 * Every setting computes the same bits (each element's operations do not change). The
 * defaults of the generic kernel are the fastest measured on an H200 (benchmarks/RESULTS.md,
 * 2026-11-30, stop 16): AdamW on 2^28 params 2.36 ms, against 2.56 ms for one CTA per tile,
 * no prefetch, unroll 1 and 2.82 ms with the prefetch (80 registers: 3 CTAs per SM instead of
 * 4). The chain kernels came after that run and have not been timed on a GPU yet; their
 * registers (nvcc --resource-usage) are in benchmarks/RESULTS.md, stop 17. */
static int env_flag(const char *name, int dflt) {
    const char *e = getenv(name);
    if (e == nullptr || e[0] == 0 || e[1] != 0) return dflt;
    return e[0] == '0' ? 0 : (e[0] == '1' ? 1 : (e[0] == '2' ? 2 : dflt));
}

/* 0..7: bit 0 the prefetch, bit 1 the unroll by two, bit 2 16-byte stores (chain kernels) */
static int launch_variant() {
    const int pre = env_flag("CTRAINSTATE_OPT_PREFETCH", 0), un = env_flag("CTRAINSTATE_OPT_UNROLL", 2);
    const int vs = env_flag("CTRAINSTATE_OPT_VSTORE", 0);
    return (pre == 1 ? 1 : 0) | (un == 1 ? 0 : 2) | (vs == 1 ? 4 : 0); /* other values: the defaults */
}

/* The kernel of an update pass as an index of opt_cache.per_sm: the generic kernel's four
 * variants (launch_variant & 3) for float32 passes, then for 16-bit ones (lowp), then per
 * chain its four float32 forms (default, 16-byte) x (unrolled once, twice) and its two
 * 16-bit ones (unrolled once, twice). */
static int occ_index(int variant, int chain, int lowp) {
    const int two = (variant & 2) != 0, vs = (variant & 4) != 0;
    if (chain < 0) return (variant & 3) + (lowp ? 4 : 0);
    return 8 + 6 * chain + (lowp ? 4 + two : 2 * vs + two);
}

/* chain: chain_id's id (-1: the generic kernel, in `variant`); lowp: the pass has 16-bit
 * arrays (their kernels) */
static unsigned main_grid(const ct_device *dev, opt_cache *cache, int variant, int chain,
                          long long ntiles, int lowp) {
    long long waves = 1;
    if (const char *e = getenv("CTRAINSTATE_OPT_WAVES")) {
        char *end = nullptr;
        const long long w = strtoll(e, &end, 10);
        if (end != e && *end == 0 && w >= 0 && w <= 1024) waves = w;
    }
    long long grid = ntiles;
    if (waves > 0) {
        const int two = (variant & 2) != 0, vs = (variant & 4) != 0;
        int &r = cache->per_sm[occ_index(variant, chain, lowp)]; /* under cache->mu */
        if (r == 0) {
            int n = 0;
            cudaError_t e;
            if (chain >= 0 && lowp)
                e = two ? chain_occupancy<2, false, true>(chain, &n) : chain_occupancy<1, false, true>(chain, &n);
            else if (chain >= 0)
                e = vs ? (two ? chain_occupancy<2, true, false>(chain, &n) : chain_occupancy<1, true, false>(chain, &n))
                       : (two ? chain_occupancy<2, false, false>(chain, &n) : chain_occupancy<1, false, false>(chain, &n));
            else switch ((variant & 3) | (lowp ? 4 : 0)) {
            case 0: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, false, 1, false>, OPT_TPB, 0); break;
            case 1: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, true, 1, false>, OPT_TPB, 0); break;
            case 2: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, false, 2, false>, OPT_TPB, 0); break;
            case 3: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, true, 2, false>, OPT_TPB, 0); break;
            case 4: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, false, 1, true>, OPT_TPB, 0); break;
            case 5: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, true, 1, true>, OPT_TPB, 0); break;
            case 6: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, false, 2, true>, OPT_TPB, 0); break;
            default: e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, opt_kernel<false, true, 2, true>, OPT_TPB, 0); break;
            }
            if (e != cudaSuccess || n <= 0) {
                cudaGetLastError();
                n = 2;
            }
            r = n;
        }
        if (cache->sms <= 0) {
            int sms = 0;
            if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev->ordinal) !=
                    cudaSuccess ||
                sms <= 0) {
                cudaGetLastError();
                sms = 132;
            }
            cache->sms = sms;
        }
        const long long cap = waves * r * (long long)cache->sms;
        if (grid > cap) grid = cap;
    }
    return grid > 0x7fffffffLL ? 0x7fffffffu : (unsigned)grid;
}

/* Launch the pass (descriptors uploaded): norms first, then the kernel(s) of its kind. */
static ct_status pass_launch(ct_device *dev, opt_cache *cache, const ct_opt_pass *ps, opt_params P,
                             const opt_desc *table, int m, const int *src, unsigned reads,
                             double *board_d, double *acc, int lowp) {
    const long long ntiles = P.ntiles;
    const int to_board = ps->reduce == 2;
    cudaStream_t s = ct_cuda_stream(dev);
    CT_TRY(ensure_event(&cache->last));
    int hi = g_last_hi.load();
    while (hi <= dev->id && !g_last_hi.compare_exchange_weak(hi, dev->id + 1)) {
    }
    if (reads != 0u) {
        CT_TRY(wait_group(dev, ps)); /* every device's board write */
        if (cache->d_normc == nullptr)
            CT_CUDA_TRY(cudaMalloc((void **)&cache->d_normc, 2 * CT_OPT_MAX_STAGES * sizeof(float)));
        float maxn[CT_OPT_MAX_STAGES];
        for (int k = 0; k < CT_OPT_MAX_STAGES; k++) maxn[k] = k < ps->nstages ? ps->c[k][2] : 0.0f;
        /* the constants travel as a kernel argument, not a host copy (no stream sync) */
        fetch_norms_args fa;
        memcpy(fa.maxn, maxn, sizeof maxn);
        fetch_norms<<<1, 1, 0, s>>>(board_d, ps->ngroup, reads, fa, cache->d_normc);
        CT_CUDA_TRY(cudaGetLastError());
        P.normc = cache->d_normc;
    }
    if (ps->reduce == 3) return leaf_pass(dev, cache, ps, P, table, m, src, lowp);
    if (ps->reduce == 4) return fstat_pass(dev, cache, ps, P, table, m, src);
    if (!ps->reduce) {
        if (ntiles > 0) {
            /* 16-bit passes: the chain kernels' default form (no 16-byte form) */
            const int v = lowp ? launch_variant() & 3 : launch_variant();
            const int ch = env_flag("CTRAINSTATE_OPT_CHAIN", 1) == 0 ? -1 : chain_id(P);
            const unsigned grid = main_grid(dev, cache, v, ch, ntiles, lowp);
            if (ch >= 0) {
                switch ((v & 6) | (lowp ? 1 : 0)) {
                case 0: chain_launch<1, false, false>(ch, grid, s, P, table); break;
                case 1: chain_launch<1, false, true>(ch, grid, s, P, table); break;
                case 2: chain_launch<2, false, false>(ch, grid, s, P, table); break;
                case 3: chain_launch<2, false, true>(ch, grid, s, P, table); break;
                case 4: chain_launch<1, true, false>(ch, grid, s, P, table); break;
                default: chain_launch<2, true, false>(ch, grid, s, P, table); break;
                }
                CT_CUDA_TRY(cudaGetLastError());
                g_chain_launches++;
            } else switch ((v & 3) | (lowp ? 4 : 0)) {
            case 0: opt_kernel<false, false, 1, false><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            case 1: opt_kernel<false, true, 1, false><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            case 2: opt_kernel<false, false, 2, false><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            case 3: opt_kernel<false, true, 2, false><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            case 4: opt_kernel<false, false, 1, true><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            case 5: opt_kernel<false, true, 1, true><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            case 6: opt_kernel<false, false, 2, true><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            default: opt_kernel<false, true, 2, true><<<grid, OPT_TPB, 0, s>>>(P, table, nullptr); break;
            }
            CT_CUDA_TRY(cudaGetLastError());
        }
        CT_CUDA_TRY(cudaEventRecord(cache->last, s));
        return CT_OK;
    }
    if (to_board) {
        CT_TRY(ensure_event(&cache->reduced));
        if (cache->d_part == nullptr)
            CT_CUDA_TRY(cudaMalloc((void **)&cache->d_part, 2 * OPT_RED_CTAS * sizeof(double)));
        const unsigned grid = ntiles < OPT_RED_CTAS ? (unsigned)ntiles : OPT_RED_CTAS;
        if (grid > 0) {
            if (lowp) opt_kernel<true, false, 1, true><<<grid, OPT_TPB, 0, s>>>(P, table, cache->d_part);
            else opt_kernel<true, false, 1, false><<<grid, OPT_TPB, 0, s>>>(P, table, cache->d_part);
            CT_CUDA_TRY(cudaGetLastError());
        }
        CT_TRY(wait_board(dev)); /* no pass of an earlier step still reads the board */
        norm_to_board<<<1, 1, 0, s>>>(cache->d_part, grid,
                                      board_d + (size_t)ps->upto * CT_MAX_DEVICES + ps->igroup);
        CT_CUDA_TRY(cudaGetLastError());
        CT_CUDA_TRY(cudaEventRecord(cache->reduced, s));
        CT_CUDA_TRY(cudaEventRecord(cache->last, s));
        return CT_OK;
    }
    acc[0] = acc[1] = 0.0;
    if (ntiles == 0) {
        CT_CUDA_TRY(cudaEventRecord(cache->last, s));
        return CT_OK;
    }
    if (cache->d_part == nullptr)
        CT_CUDA_TRY(cudaMalloc((void **)&cache->d_part, 2 * OPT_RED_CTAS * sizeof(double)));
    if (cache->h_part == nullptr) /* checked apart: a failed pinned allocation is retried */
        CT_CUDA_TRY(cudaMallocHost((void **)&cache->h_part, 2 * OPT_RED_CTAS * sizeof(double)));
    const unsigned grid = ntiles < OPT_RED_CTAS ? (unsigned)ntiles : OPT_RED_CTAS;
    if (lowp) opt_kernel<true, false, 1, true><<<grid, OPT_TPB, 0, s>>>(P, table, cache->d_part);
    else opt_kernel<true, false, 1, false><<<grid, OPT_TPB, 0, s>>>(P, table, cache->d_part);
    CT_CUDA_TRY(cudaGetLastError());
    CT_CUDA_TRY(cudaMemcpyAsync(cache->h_part, cache->d_part, 2 * grid * sizeof(double),
                                cudaMemcpyDeviceToHost, s));
    CT_CUDA_TRY(cudaStreamSynchronize(s)); /* the host round trip of a reduction */
    CT_CUDA_TRY(cudaEventRecord(cache->last, s));
    for (unsigned i = 0; i < grid; i++) {
        acc[0] += cache->h_part[2 * i];
        acc[1] += cache->h_part[2 * i + 1];
    }
    return CT_OK;
}

extern "C" ct_status ct_cuda_optim_pass(ct_device *dev, const ct_opt_pass *ps, double *acc) {
    if (dev->id < 0 || dev->id >= CT_MAX_DEVICES)
        return ct_cuda_core->set_error(CT_EINVAL, "optimizer: bad device id %d", dev->id);
    for (int k = 0; k < ps->upto; k++)
        if (!ct_om_is_elementwise(ps->kind[k]) && !ct_om_is_leafwise(ps->kind[k]) &&
            ps->kind[k] != CT_OPT_GLOBAL_NORM && ps->kind[k] != CT_OPT_FINITE_GATE &&
            ps->kind[k] != CT_OPT_FACTORED)
            return ct_cuda_core->set_error(CT_EINVAL, "optimizer: stage %d (kind %d) is not "
                                           "supported on GPU devices yet", k, ps->kind[k]);
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    opt_cache *cache = &g_opt_cache[dev->id];
    std::lock_guard<std::mutex> lock(cache->mu);
    return optim_pass_locked(dev, cache, ps, acc);
}
