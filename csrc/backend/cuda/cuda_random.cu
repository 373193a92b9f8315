/*
 * cuda_random.cu — PRNG block fills on the GPU, bit-identical to the CPU
 * fill (csrc/core/ct_random.c) and to jax.random.
 *
 * Every element is a pure function of (key, global flat index): the kernel
 * runs ct_random_math.h's ct_rm_bits32 (one Threefry-2x32 call, its two words
 * xor-ed, as JAX's partitionable layout defines an element's 32 bits) and
 * ct_rm_element (the sampler's transform) — the very functions that
 * tests/c/test_random.c proves equal to the CPU fill for every input word.
 * Exactness needs the same float operations: setup.py compiles this file
 * with --fmad=false (no a * b + c contraction beyond the explicit fmaf), and
 * division / sqrt stay IEEE (-prec-div=true -prec-sqrt=true, nvcc's defaults).
 *
 * Two kernels: a block that is one contiguous range of global indices (a
 * whole array, or any shard split only along its first sharded dimension)
 * takes 4 consecutive elements per thread with one vector store; any other
 * block indexes element by element through ct_rm_block_index.
 */
#include "cuda_common.cuh"

#include "../../core/ct_random_math.h"

// --- kernels --------------------------------------------------------------------

template <ct_dtype T>
struct store_vec;

/* 4 float32 words: one 16-byte store. */
template <>
struct store_vec<CT_F32> {
    static __device__ __forceinline__ void put(void *out, uint64_t e, const uint32_t w[4]) {
        reinterpret_cast<uint4 *>(out)[e / 4] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    static __device__ __forceinline__ void put1(void *out, uint64_t e, uint32_t w) {
        reinterpret_cast<uint32_t *>(out)[e] = w;
    }
};

/* 4 16-bit patterns: one 8-byte store. */
struct store_u16x4 {
    static __device__ __forceinline__ void put(void *out, uint64_t e, const uint32_t w[4]) {
        reinterpret_cast<uint2 *>(out)[e / 4] =
            make_uint2((w[0] & 0xffffu) | (w[1] << 16), (w[2] & 0xffffu) | (w[3] << 16));
    }
    static __device__ __forceinline__ void put1(void *out, uint64_t e, uint32_t w) {
        reinterpret_cast<uint16_t *>(out)[e] = (uint16_t)w;
    }
};
template <>
struct store_vec<CT_F16> : store_u16x4 {};
template <>
struct store_vec<CT_BF16> : store_u16x4 {};

/* 4 bernoulli bytes: one 4-byte store. */
struct store_u8x4 {
    static __device__ __forceinline__ void put(void *out, uint64_t e, const uint32_t w[4]) {
        reinterpret_cast<uint32_t *>(out)[e / 4] = w[0] | (w[1] << 8) | (w[2] << 16) | (w[3] << 24);
    }
    static __device__ __forceinline__ void put1(void *out, uint64_t e, uint32_t w) {
        reinterpret_cast<uint8_t *>(out)[e] = (uint8_t)w;
    }
};

template <ct_dist D, ct_dtype T>
struct storer {
    typedef store_vec<T> type;
};
template <ct_dtype T>
struct storer<CT_DIST_BERNOULLI, T> {
    typedef store_u8x4 type;
};

/* Elements [0, n) of a contiguous block whose element 0 has global index
 * base. Thread i of the grid-stride loop writes elements 4i .. 4i+3 with one
 * store when `vec` (the output is aligned for it) and all four exist. */
template <ct_dist D, ct_dtype T>
__global__ void __launch_bounds__(256)
random_contig_kernel(uint32_t k0, uint32_t k1, const ct_random_consts c, uint64_t base,
                     uint64_t n, int vec, void *out) {
    typedef typename storer<D, T>::type S;
    const uint64_t nquads = (n + 3) / 4;
    for (uint64_t q = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; q < nquads;
         q += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t e = 4 * q;
        if (vec && e + 4 <= n) {
            uint32_t w[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                w[j] = ct_rm_element(&c, D, T, ct_rm_bits32(k0, k1, base + e + (uint64_t)j));
            S::put(out, e, w);
        } else {
            for (uint64_t j = e; j < n && j < e + 4; j++)
                S::put1(out, j, ct_rm_element(&c, D, T, ct_rm_bits32(k0, k1, base + j)));
        }
    }
}

/* Any block: one element per thread, its global index from the geometry. */
template <ct_dist D, ct_dtype T>
__global__ void __launch_bounds__(256)
random_block_kernel(uint32_t k0, uint32_t k1, const ct_random_consts c, const ct_rm_block blk,
                    void *out) {
    typedef typename storer<D, T>::type S;
    for (uint64_t e = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; e < blk.count;
         e += (uint64_t)gridDim.x * blockDim.x)
        S::put1(out, e, ct_rm_element(&c, D, T, ct_rm_bits32(k0, k1, ct_rm_block_index(&blk, e))));
}

// --- launch -----------------------------------------------------------------------

static const int kThreads = 256;

/* Enough blocks to fill the GPU several times over, at most one per work item. */
static unsigned grid_for(int ordinal, uint64_t items) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess ||
        sms <= 0) {
        cudaGetLastError();
        sms = 132;
    }
    uint64_t want = (items + kThreads - 1) / kThreads;
    uint64_t cap = (uint64_t)sms * 16;
    return (unsigned)(want < cap ? (want ? want : 1) : cap);
}

template <ct_dist D, ct_dtype T>
static void launch(cudaStream_t s, int ordinal, uint32_t k0, uint32_t k1,
                   const ct_random_consts &c, const ct_rm_block &blk, void *out) {
    const bool contig = blk.ngroups == 0 || (blk.ngroups == 1 && blk.stride[0] == 1);
    if (contig) {
        const size_t esize = D == CT_DIST_BERNOULLI ? 1 : (T == CT_F32 ? 4 : 2);
        const int vec = ((uintptr_t)out % (4 * esize)) == 0;
        random_contig_kernel<D, T><<<grid_for(ordinal, (blk.count + 3) / 4), kThreads, 0, s>>>(
            k0, k1, c, blk.base, blk.count, vec, out);
    } else {
        random_block_kernel<D, T><<<grid_for(ordinal, blk.count), kThreads, 0, s>>>(k0, k1, c,
                                                                                   blk, out);
    }
}

template <ct_dist D>
static void launch_dt(cudaStream_t s, int ordinal, uint32_t k0, uint32_t k1,
                      const ct_random_consts &c, const ct_rm_block &blk, void *out) {
    switch (c.dt) {
    case CT_F32: launch<D, CT_F32>(s, ordinal, k0, k1, c, blk, out); break;
    case CT_F16: launch<D, CT_F16>(s, ordinal, k0, k1, c, blk, out); break;
    default: launch<D, CT_BF16>(s, ordinal, k0, k1, c, blk, out); break;
    }
}

extern "C" ct_status ct_cuda_random_fill(ct_device *dev, uint32_t k0, uint32_t k1,
                                         const struct ct_random_consts *c,
                                         const struct ct_rm_block *blk, void *out) {
    if (c->dt != CT_F32 && c->dt != CT_F16 && c->dt != CT_BF16)
        return ct_cuda_core->set_error(CT_ETYPE, "CUDA random fill: unsupported dtype %d",
                                       (int)c->dt);
    if (blk->count == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    cudaStream_t s = ct_cuda_stream(dev);
    switch (c->dist) {
    case CT_DIST_UNIFORM: launch_dt<CT_DIST_UNIFORM>(s, dev->ordinal, k0, k1, *c, *blk, out); break;
    case CT_DIST_NORMAL: launch_dt<CT_DIST_NORMAL>(s, dev->ordinal, k0, k1, *c, *blk, out); break;
    case CT_DIST_TRUNCATED_NORMAL:
        launch_dt<CT_DIST_TRUNCATED_NORMAL>(s, dev->ordinal, k0, k1, *c, *blk, out);
        break;
    case CT_DIST_BERNOULLI:
        launch_dt<CT_DIST_BERNOULLI>(s, dev->ordinal, k0, k1, *c, *blk, out);
        break;
    default:
        return ct_cuda_core->set_error(CT_EINVAL, "CUDA random fill: unknown distribution %d",
                                       (int)c->dist);
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}
