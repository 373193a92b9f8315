/*
 * cuda_ewise.cu — comparisons, booleans and integer arithmetic on the GPU (ct_op_ewise), and
 * the integer reductions (ct_op_reduce_typed): the CPU backend's bits.
 *
 * The element functions are ct_ewise_math.h's, as on the CPU and in the mock backend; the
 * operands' dtype is a template argument, the op a kernel argument. Grid-stride loops; the
 * broadcasting kernel computes operand offsets from the output index and per-operand
 * element strides (0 on broadcast dimensions). An integer reduction gives each output
 * element to one thread, or, for few outputs of many elements, to a block of threads and a
 * shared-memory tree (exact in any order: wrapping sums and maxima are associative).
 * setup.py builds this file with -ftz=false (a denormal float compares as itself) and
 * --fmad=false (float floor_divide / remainder round as on the CPU).
 */
#include "cuda_common.cuh"

extern "C" {
#include "../../core/ct_ewise_math.h"
#include "../../core/ct_ops_math.h"
}

#define EW_MAX_ND 16

struct ew_args {
    int ndim;
    int64_t shape[EW_MAX_ND];
    int64_t as[EW_MAX_ND];
    int64_t bs[EW_MAX_ND];
};

static unsigned ew_grid(long long n) {
    long long b = (n + 255) / 256;
    if (b > 65535LL * 8) b = 65535LL * 8;
    if (b < 1) b = 1;
    return (unsigned)b;
}

template <int DT>
__global__ void ewise_dense_kernel(int op, long long n, void *out, const void *a, const void *b) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        ct_ew_elem(op, DT, out, i, a, i, b, i);
}

template <int DT>
__global__ void ewise_kernel(int op, long long n, void *out, const void *a, const void *b,
                             ew_args g) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int64_t ao, bo;
        ct_offsets2(i, g.ndim, g.shape, g.as, g.bs, &ao, &bo);
        ct_ew_elem(op, DT, out, i, a, ao, b, bo);
    }
}

template <int DT>
static void ewise_launch(cudaStream_t s, int op, int dense, long long n, void *out, const void *a,
                         const void *b, const ew_args &g) {
    if (dense) ewise_dense_kernel<DT><<<ew_grid(n), 256, 0, s>>>(op, n, out, a, b);
    else ewise_kernel<DT><<<ew_grid(n), 256, 0, s>>>(op, n, out, a, b, g);
}

extern "C" ct_status ct_cuda_ewise(ct_device *dev, int op, int dtype, int ndim,
                                   const int64_t *shape, void *out, const void *a,
                                   const int64_t *as, const void *b, const int64_t *bs) {
    if (ndim > EW_MAX_ND) return ct_cuda_core->set_error(CT_EINVAL, "rank %d", ndim);
    long long n = 1, st = 1;
    int dense = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        n *= shape[d];
        if (shape[d] != 1 && (as[d] != st || bs[d] != st)) dense = 0;
        st *= shape[d];
    }
    if (n == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    ew_args g;
    g.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        g.shape[d] = shape[d];
        g.as[d] = as[d];
        g.bs[d] = bs[d];
    }
    cudaStream_t s = ct_cuda_stream(dev);
    switch (dtype) {
    case CT_F32: ewise_launch<CT_F32>(s, op, dense, n, out, a, b, g); break;
    case CT_F16: ewise_launch<CT_F16>(s, op, dense, n, out, a, b, g); break;
    case CT_BF16: ewise_launch<CT_BF16>(s, op, dense, n, out, a, b, g); break;
    case CT_I32: ewise_launch<CT_I32>(s, op, dense, n, out, a, b, g); break;
    case CT_U32: ewise_launch<CT_U32>(s, op, dense, n, out, a, b, g); break;
    case CT_U8: ewise_launch<CT_U8>(s, op, dense, n, out, a, b, g); break;
    case CT_I8: ewise_launch<CT_I8>(s, op, dense, n, out, a, b, g); break;
    case CT_I16: ewise_launch<CT_I16>(s, op, dense, n, out, a, b, g); break;
    case CT_U16: ewise_launch<CT_U16>(s, op, dense, n, out, a, b, g); break;
    default: ewise_launch<CT_BOOL>(s, op, dense, n, out, a, b, g); break;
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

// --- integer reductions ----------------------------------------------------------------

template <int DT>
__global__ void reduce_typed_kernel(int op, long long nout, ct_ew_red_plan p, const void *x,
                                    void *out) {
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < nout;
         q += (long long)gridDim.x * blockDim.x)
        ct_ew_reduce_one(op, DT, &p, x, out, q);
}

/* Few outputs with many elements each: a block per output, its threads striding over the
 * elements, then a tree in shared memory (exact: wrapping sums and maxima). */
template <int DT>
__global__ void reduce_typed_block_kernel(int op, long long nout, ct_ew_red_plan p,
                                          const void *x, void *out) {
    __shared__ long long part[256];
    for (long long q = blockIdx.x; q < nout; q += gridDim.x) {
        const int64_t base = ct_ew_unravel(q, p.nk, p.kdim, p.kstr);
        int64_t acc = ct_ew_red_identity(op, DT);
        for (long long t = threadIdx.x; t < p.nred; t += blockDim.x)
            acc = ct_ew_red_combine(op, acc, ct_ew_red_load(DT, &p, x, base, t));
        part[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned h = blockDim.x / 2; h > 0; h /= 2) {
            if (threadIdx.x < h)
                part[threadIdx.x] = ct_ew_red_combine(op, part[threadIdx.x], part[threadIdx.x + h]);
            __syncthreads();
        }
        if (threadIdx.x == 0) ct_cv_store_i(DT, out, q, part[0]);
        __syncthreads(); /* part[] is reused by the next output */
    }
}

template <int DT>
static void reduce_typed_launch(cudaStream_t s, int op, long long nout, const ct_ew_red_plan &p,
                                const void *x, void *out) {
    if (p.nred >= 1024 && nout < 4096) {
        unsigned g = (unsigned)(nout < 65535 ? nout : 65535);
        reduce_typed_block_kernel<DT><<<g, 256, 0, s>>>(op, nout, p, x, out);
    } else {
        reduce_typed_kernel<DT><<<ew_grid(nout), 256, 0, s>>>(op, nout, p, x, out);
    }
}

extern "C" ct_status ct_cuda_reduce_typed(ct_device *dev, int op, int dtype, int ndim,
                                          const int64_t *shape, uint32_t axes, const void *x,
                                          void *out) {
    ct_ew_red_plan p;
    ct_ew_red_plan_init(&p, ndim, shape, axes);
    long long nout = 1;
    for (int j = 0; j < p.nk; j++) nout *= p.kdim[j];
    if (nout == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    cudaStream_t s = ct_cuda_stream(dev);
    switch (dtype) {
    case CT_I32: reduce_typed_launch<CT_I32>(s, op, nout, p, x, out); break;
    case CT_U32: reduce_typed_launch<CT_U32>(s, op, nout, p, x, out); break;
    case CT_U8: reduce_typed_launch<CT_U8>(s, op, nout, p, x, out); break;
    case CT_I8: reduce_typed_launch<CT_I8>(s, op, nout, p, x, out); break;
    case CT_I16: reduce_typed_launch<CT_I16>(s, op, nout, p, x, out); break;
    case CT_U16: reduce_typed_launch<CT_U16>(s, op, nout, p, x, out); break;
    default: reduce_typed_launch<CT_BOOL>(s, op, nout, p, x, out); break;
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}
