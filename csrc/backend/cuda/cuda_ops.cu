/*
 * cuda_ops.cu — the array-op kernels of the CUDA backend (semantics in core/ct_ops.h).
 *
 * Elementwise kernels use grid-stride loops; broadcasting binary ops compute
 * operand offsets from the output index and per-operand element strides (0 on
 * broadcast dimensions). GEMM goes to cuBLAS (one handle per logical device,
 * bound to its stream). The all-reduce sums the buffers of logical devices
 * with one kernel that reads every buffer directly (same GPU, or peers through
 * unified addressing); a group spanning GPUs goes through NCCL (cuda_nccl.cu).
 * Every launch is on the device's stream; work is ordered per
 * device and synchronised where data leaves it (copies, all-reduce).
 */
#include <cublas_v2.h>
#include <math.h>
#include <stdlib.h>

#include "cuda_common.cuh"

extern "C" {
#include "../../core/ct_ops.h"
#include "../../core/ct_ops_math.h"
}
#include "../../core/ct_convert_math.h"

#define MAX_ND 16

static unsigned grid_for(long long n, int threads) {
    long long b = (n + threads - 1) / threads;
    if (b > 65535LL * 8) b = 65535LL * 8;
    if (b < 1) b = 1;
    return (unsigned)b;
}

// --- unary ------------------------------------------------------------------------

__device__ __forceinline__ float gelu_tanh(float x) {
    return ct_gelu_from_tanh(x, tanhf(ct_gelu_inner(x)));
}

__device__ __forceinline__ float gelu_tanh_grad(float x) {
    return ct_gelu_grad_from_tanh(x, tanhf(ct_gelu_inner(x)));
}

/* One unary op on one value (the unary kernel's and the chain kernel's: the same formulas). */
__device__ __forceinline__ float unary_apply(int op, float alpha, float beta, float v) {
        float r;
        switch (op) {
        case CT_UN_AFFINE: r = alpha == 0.0f ? beta : alpha * v + beta; break;
        case CT_UN_NEG: r = -v; break;
        case CT_UN_SIN: r = sinf(v); break;
        case CT_UN_COS: r = cosf(v); break;
        case CT_UN_TANH: r = tanhf(v); break;
        case CT_UN_RELU: r = (v > 0.0f || v != v) ? v : 0.0f; break;
        case CT_UN_STEP: r = v > 0.0f ? 1.0f : 0.0f; break;
        case CT_UN_GELU: r = gelu_tanh(v); break;
        case CT_UN_GELU_GRAD: r = gelu_tanh_grad(v); break;
        case CT_UN_EXP: r = expf(v); break;
        case CT_UN_LOG: r = logf(v); break;
        case CT_UN_SQRT: r = sqrtf(v); break;
        case CT_UN_RSQRT: r = rsqrtf(v); break;
        case CT_UN_SQUARE: r = v * v; break;
        case CT_UN_SIGMOID: r = 1.0f / (1.0f + expf(-v)); break;
        case CT_UN_ABS: r = fabsf(v); break;
        case CT_UN_SIGN: r = ct_sign(v); break;
        case CT_UN_POW: r = ct_pow(v, alpha); break;
        case CT_UN_RDIV: r = alpha / v; break;
        default: r = ct_unary_ext(op, v); break; /* CT_UN_LOG1P .. CT_UN_SIGNBIT */
        }
        return r;
}

__global__ void unary_kernel(int op, float alpha, float beta, long long n, const float *x, float *y) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = op == CT_UN_AFFINE && alpha == 0.0f ? 0.0f : x[i];
        y[i] = unary_apply(op, alpha, beta, v);
    }
}

/* A unary op on 16-bit floats: widened, the float32 formula (unary_apply, as unary_kernel),
 * rounded back with the conversion kernels' functions: one kernel. */
__global__ void unary_typed_kernel(int op, float alpha, float beta, long long n, int bf16,
                                   const uint16_t *x, uint16_t *y) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = op == CT_UN_AFFINE && alpha == 0.0f ? 0.0f
                        : bf16 ? ct_rm_bf16_to_f32(x[i]) : ct_rm_f16_to_f32(x[i]);
        const float r = unary_apply(op, alpha, beta, v);
        y[i] = bf16 ? ct_rm_f32_to_bf16(r) : ct_rm_f32_to_f16(r);
    }
}

extern "C" ct_status ct_cuda_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n,
                                         int dtype, const void *x, void *y) {
    if (n == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    unary_typed_kernel<<<grid_for(n, 256), 256, 0, ct_cuda_stream(dev)>>>(
        op, alpha, beta, n, dtype == CT_BF16, (const uint16_t *)x, (uint16_t *)y);
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

extern "C" ct_status ct_cuda_unary(ct_device *dev, int op, float alpha, float beta, int64_t n,
                                   const float *x, float *y) {
    if (n == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    unary_kernel<<<grid_for(n, 256), 256, 0, ct_cuda_stream(dev)>>>(op, alpha, beta, n, x, y);
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

// --- fused chains ----------------------------------------------------------------------
// One thread per output element (grid-stride): its coordinates once, then the value through
// every step, each step the formula of its own kernel (unary_apply, ct_binary_apply), the
// operands read by their broadcast strides: the bits of the steps run one by one, with one
// pass over memory and one launch.

struct chain_args {
    int ndim, nsteps;
    int64_t shape[CT_CHAIN_NDIM];
    int64_t as[CT_CHAIN_NDIM];
    ct_chain_step steps[CT_CHAIN_MAX];
};

__global__ void chain_kernel(long long n, const float *a, float *out, chain_args g) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int64_t c[CT_CHAIN_NDIM];
        long long rem = i;
        int64_t ao = 0;
        for (int d = g.ndim - 1; d >= 0; d--) {
            c[d] = rem % g.shape[d];
            rem /= g.shape[d];
            ao += c[d] * g.as[d];
        }
        float v = a[ao];
        for (int j = 0; j < g.nsteps; j++) {
            const ct_chain_step &st = g.steps[j];
            if (!st.binary) {
                v = st.op == CT_UN_AFFINE && st.alpha == 0.0f ? st.beta
                                                              : unary_apply(st.op, st.alpha, st.beta, v);
                continue;
            }
            int64_t bo = 0;
            for (int d = 0; d < g.ndim; d++) bo += c[d] * st.strides[d];
            const float w = st.other[bo];
            v = st.side == 0 ? ct_binary_apply(st.op, v, w) : ct_binary_apply(st.op, w, v);
        }
        out[i] = v;
    }
}

extern "C" ct_status ct_cuda_chain(ct_device *dev, int ndim, const int64_t *shape, const float *a,
                                   const int64_t *a_strides, int nsteps, const ct_chain_step *steps,
                                   float *out) {
    chain_args g;
    g.ndim = ndim;
    g.nsteps = nsteps;
    long long n = 1;
    for (int d = 0; d < ndim; d++) {
        g.shape[d] = shape[d];
        g.as[d] = a_strides[d];
        n *= shape[d];
    }
    for (int j = 0; j < nsteps; j++) g.steps[j] = steps[j];
    if (n == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    chain_kernel<<<grid_for(n, 256), 256, 0, ct_cuda_stream(dev)>>>(n, a, out, g);
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

// --- binary with broadcasting ---------------------------------------------------------

struct bin_args {
    int ndim;
    int64_t shape[MAX_ND];
    int64_t as[MAX_ND];
    int64_t bs[MAX_ND];
};

__global__ void binary_kernel(int op, long long n, float *out, const float *a, const float *b,
                              bin_args g) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int64_t ao, bo;
        ct_offsets2(i, g.ndim, g.shape, g.as, g.bs, &ao, &bo);
        out[i] = ct_binary_apply(op, a[ao], b[bo]);
    }
}

/* The same with 32-bit index arithmetic (a 64-bit division is several times the cost of a
 * 32-bit one on a GPU), for launches whose elements and operand offsets all stay below 2^31:
 * the same elements, the same results. */
__global__ void binary_kernel32(int op, unsigned n, float *out, const float *a, const float *b,
                                bin_args g) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned rem = i, ao = 0, bo = 0;
        for (int d = g.ndim - 1; d >= 0; d--) {
            const unsigned sh = (unsigned)g.shape[d], c = rem % sh;
            rem /= sh;
            ao += c * (unsigned)g.as[d];
            bo += c * (unsigned)g.bs[d];
        }
        out[i] = ct_binary_apply(op, a[ao], b[bo]);
    }
}

/* Whether every element index and operand offset of a broadcast launch fits 31 bits. */
static bool fits32(int ndim, const int64_t *shape, const int64_t *as, const int64_t *bs,
                   long long n) {
    if (n >= (1LL << 31)) return false;
    long long amax = 0, bmax = 0;
    for (int d = 0; d < ndim; d++) {
        if (as[d] < 0 || bs[d] < 0 || as[d] >= (1LL << 31) || bs[d] >= (1LL << 31)) return false;
        amax += (shape[d] - 1) * as[d];
        bmax += (shape[d] - 1) * bs[d];
        if (amax >= (1LL << 31) || bmax >= (1LL << 31)) return false;
    }
    return true;
}

__global__ void binary_dense_kernel(int op, long long n, float *out, const float *a, const float *b) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = ct_binary_apply(op, a[i], b[i]);
}

extern "C" ct_status ct_cuda_binary(ct_device *dev, int op, int ndim, const int64_t *shape,
                                    float *out, const float *a, const int64_t *as,
                                    const float *b, const int64_t *bs) {
    if (ndim > MAX_ND) return ct_cuda_core->set_error(CT_EINVAL, "rank %d", ndim);
    long long n = 1;
    int dense = 1;
    long long s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        n *= shape[d];
        if (shape[d] != 1 && (as[d] != s || bs[d] != s)) dense = 0;
        s *= shape[d];
    }
    if (n == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    if (dense) {
        binary_dense_kernel<<<grid_for(n, 256), 256, 0, ct_cuda_stream(dev)>>>(op, n, out, a, b);
    } else {
        bin_args g;
        g.ndim = ndim;
        for (int d = 0; d < ndim; d++) {
            g.shape[d] = shape[d];
            g.as[d] = as[d];
            g.bs[d] = bs[d];
        }
        if (fits32(ndim, shape, as, bs, n))
            binary_kernel32<<<grid_for(n, 256), 256, 0, ct_cuda_stream(dev)>>>(op, (unsigned)n, out,
                                                                              a, b, g);
        else
            binary_kernel<<<grid_for(n, 256), 256, 0, ct_cuda_stream(dev)>>>(op, n, out, a, b, g);
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

// --- sum over axes -------------------------------------------------------------------

struct red_args {
    int nk, nr;
    long long kept[MAX_ND], kstride[MAX_ND];
    long long red[MAX_ND], rstride[MAX_ND];
    long long nred;
};

/* One thread per output element; the reduced elements are walked in order (so the
 * sum does not depend on the launch shape). Coalesced when the innermost dim is kept. */
__global__ void reduce_kernel(int op, long long nout, const float *x, float *out, red_args g) {
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < nout;
         q += (long long)gridDim.x * blockDim.x) {
        long long rem = q, base = 0;
        for (int j = g.nk - 1; j >= 0; j--) {
            long long c = rem % g.kept[j];
            rem /= g.kept[j];
            base += c * g.kstride[j];
        }
        float acc = ct_red_identity(op);
        if (g.nr == 1) { /* one reduced dim (a bias gradient, a mean over rows): a strided walk */
            const long long n0 = g.red[0], s0 = g.rstride[0];
            for (long long t = 0; t < n0; t++) acc = ct_red_combine(op, acc, x[base + t * s0]);
        } else if (g.nr == 2) { /* two: nested walks, the same order as the general case */
            const long long n0 = g.red[0], s0 = g.rstride[0], n1 = g.red[1], s1 = g.rstride[1];
            for (long long t0 = 0; t0 < n0; t0++)
                for (long long t1 = 0; t1 < n1; t1++)
                    acc = ct_red_combine(op, acc, x[base + t0 * s0 + t1 * s1]);
        } else {
            for (long long t = 0; t < g.nred; t++) {
                long long trem = t, off = base;
                for (int j = g.nr - 1; j >= 0; j--) {
                    long long c = trem % g.red[j];
                    trem /= g.red[j];
                    off += c * g.rstride[j];
                }
                acc = ct_red_combine(op, acc, x[off]);
            }
        }
        out[q] = acc;
    }
}

/* Innermost dims reduced and contiguous: one block per output, tree reduction. */
__global__ void reduce_rows_kernel(int op, long long inner, const float *x, float *out) {
    __shared__ float buf[256];
    const float *row = x + blockIdx.x * inner;
    float acc = ct_red_identity(op);
    for (long long i = threadIdx.x; i < inner; i += blockDim.x) acc = ct_red_combine(op, acc, row[i]);
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] = ct_red_combine(op, buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = buf[0];
}

extern "C" ct_status ct_cuda_reduce(ct_device *dev, int op, int ndim, const int64_t *shape,
                                    uint32_t axes, const float *x, float *out) {
    red_args g;
    g.nk = g.nr = 0;
    long long xs[MAX_ND], st = 1, nout = 1;
    g.nred = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        xs[d] = st;
        st *= shape[d];
    }
    for (int d = 0; d < ndim; d++) {
        if (axes & (1u << d)) {
            g.red[g.nr] = shape[d];
            g.rstride[g.nr++] = xs[d];
            g.nred *= shape[d];
        } else {
            g.kept[g.nk] = shape[d];
            g.kstride[g.nk++] = xs[d];
            nout *= shape[d];
        }
    }
    if (nout == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    cudaStream_t s = ct_cuda_stream(dev);
    /* trailing dims all reduced (and leading kept): contiguous rows */
    int trailing = 1, seen_kept = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        int r = (axes >> d) & 1u;
        if (!r) seen_kept = 1;
        else if (seen_kept) trailing = 0;
    }
    if (trailing && g.nr > 0 && g.nred >= 256 && nout < (1LL << 31)) {
        reduce_rows_kernel<<<(unsigned)nout, 256, 0, s>>>(op, g.nred, x, out);
    } else {
        reduce_kernel<<<grid_for(nout, 256), 256, 0, s>>>(op, nout, x, out, g);
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

// --- GEMM through cuBLAS --------------------------------------------------------------------

static cublasHandle_t g_handles[CT_MAX_DEVICES];

static ct_status handle_for(ct_device *dev, cublasHandle_t *out) {
    if (dev->id < 0 || dev->id >= CT_MAX_DEVICES)
        return ct_cuda_core->set_error(CT_EINVAL, "device id %d out of range", dev->id);
    if (g_handles[dev->id] == NULL) {
        cublasHandle_t h;
        if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
            return ct_cuda_core->set_error(CT_EDEVICE, "cublasCreate failed on CudaDevice(id=%d)",
                                           dev->id);
        cublasSetStream(h, ct_cuda_stream(dev));
        g_handles[dev->id] = h;
    }
    *out = g_handles[dev->id];
    return CT_OK;
}

/* The precisions map onto cuBLAS compute types on float32 operands: CT_PREC_F32 is plain
 * cublasSgemm (the handle keeps CUBLAS_DEFAULT_MATH: no TF32), CT_PREC_TF32 and CT_PREC_BF16
 * are cublasGemmEx with CUBLAS_COMPUTE_32F_FAST_TF32 / _FAST_16BF (tensor cores with the
 * inputs converted to TF32 / bfloat16, float32 accumulation). The compute type is a
 * per-call argument, so nothing on the shared handle has to be set and restored. */
extern "C" ct_status ct_cuda_gemm(ct_device *dev, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                  float alpha, const float *a, int64_t lda, const float *b,
                                  int64_t ldb, float beta, float *c, int64_t ldc, int prec) {
    if (m == 0 || n == 0) return CT_OK;
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
        return ct_cuda_core->set_error(CT_EINVAL, "matmul dimensions exceed 2^31");
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    cublasHandle_t h = NULL;
    CT_TRY(handle_for(dev, &h));
    if (k == 0) {  /* C = beta*C */
        return ct_cuda_unary(dev, CT_UN_AFFINE, beta, 0.0f, m * n, c, c);
    }
    /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T. */
    const cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasStatus_t st;
    const char *what = "cublasSgemm";
    if (prec == CT_PREC_F32) {
        st = cublasSgemm(h, opb, opa, (int)n, (int)m, (int)k, &alpha, b, (int)ldb, a, (int)lda,
                         &beta, c, (int)ldc);
    } else {
        const cublasComputeType_t ct =
            prec == CT_PREC_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F_FAST_16BF;
        what = prec == CT_PREC_TF32 ? "cublasGemmEx (TF32)" : "cublasGemmEx (bfloat16)";
        st = cublasGemmEx(h, opb, opa, (int)n, (int)m, (int)k, &alpha, b, CUDA_R_32F, (int)ldb, a,
                          CUDA_R_32F, (int)lda, &beta, c, CUDA_R_32F, (int)ldc, ct,
                          CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        return ct_cuda_core->set_error(CT_EDEVICE, "%s failed (status %d) on CudaDevice(id=%d)",
                                       what, (int)st, dev->id);
    return CT_OK;
}

// --- all-reduce among logical devices ----------------------------------------------------------

#define MAX_GROUP 64

struct ar_args {
    int n;
    float *bufs[MAX_GROUP];
};

__global__ void allreduce_kernel(int op, long long count, ar_args g) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        float acc = g.bufs[0][i];
        for (int j = 1; j < g.n; j++) acc = ct_red_combine(op, acc, g.bufs[j][i]);
        for (int j = 0; j < g.n; j++) g.bufs[j][i] = acc;
    }
}

/* Sum into every buffer with one kernel on the group's first GPU that reads and writes all of
 * them: logical devices of one GPU, or (CTRAINSTATE_NO_NCCL=1) peers through peer access. */
extern "C" ct_status ct_cuda_allreduce_local(ct_device **devs, float **bufs, int nbufs, int64_t count,
                                            int op) {
    if (nbufs == 1 || count == 0) return CT_OK;
    if (nbufs > MAX_GROUP)
        return ct_cuda_core->set_error(CT_EINVAL, "all-reduce over more than %d devices", MAX_GROUP);
    for (int j = 0; j < nbufs; j++) {
        /* peers: let the kernel on GPU 0 of the group read and write them */
        if (devs[j]->ordinal != devs[0]->ordinal)
            CT_TRY(ct_cuda_enable_peer(devs[0]->ordinal, devs[j]->ordinal));
        CT_CUDA_TRY(cudaSetDevice(devs[j]->ordinal));
        CT_CUDA_TRY(cudaStreamSynchronize(ct_cuda_stream(devs[j])));
    }
    ar_args g;
    g.n = nbufs;
    for (int j = 0; j < nbufs; j++) g.bufs[j] = bufs[j];
    CT_CUDA_TRY(cudaSetDevice(devs[0]->ordinal));
    cudaStream_t s = ct_cuda_stream(devs[0]);
    allreduce_kernel<<<grid_for(count, 256), 256, 0, s>>>(op, count, g);
    CT_CUDA_TRY(cudaGetLastError());
    CT_CUDA_TRY(cudaStreamSynchronize(s));
    return CT_OK;
}

/* cuda_nccl.cu */
extern "C" ct_status ct_cuda_allreduce_nccl(ct_device **devs, float **bufs, int nbufs, int64_t count,
                                           int op);

extern "C" ct_status ct_cuda_allreduce(ct_device **devs, float **bufs, int nbufs, int64_t count,
                                       int op) {
    if (nbufs <= 1 || count == 0) return CT_OK;
    int one_gpu = 1;
    for (int j = 1; j < nbufs; j++) one_gpu &= devs[j]->ordinal == devs[0]->ordinal;
    const char *e = getenv("CTRAINSTATE_NO_NCCL");
    if (one_gpu || (e != NULL && atoi(e) == 1))
        return ct_cuda_allreduce_local(devs, bufs, nbufs, count, op);
    return ct_cuda_allreduce_nccl(devs, bufs, nbufs, count, op);
}

// --- embedding rows ----------------------------------------------------------------------------

/* out[i, :] = table[ids[i] - row0, :] or 0: one thread per output element. */
__global__ void gather_rows_kernel(const float *table, long long nrows, long long ncols,
                                   long long row0, const int32_t *ids, long long nids, float *out) {
    const long long n = nids * ncols;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / ncols, c = e % ncols, r = (long long)ids[i] - row0;
        out[e] = (r >= 0 && r < nrows) ? table[r * ncols + c] : 0.0f;
    }
}

/* table[hit[u] - row0, c] += g[pos[k], c] for k in [start[u], start[u + 1]): one thread per
 * (distinct row, column), adding that row's terms in order (no atomics: the CPU's bits). */
__global__ void scatter_add_rows_kernel(float *table, long long nrows, long long ncols,
                                        long long row0, const int32_t *hit, const int32_t *start,
                                        long long nhit, const int32_t *pos, const float *g) {
    const long long n = nhit * ncols;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const long long u = e / ncols, c = e % ncols, r = (long long)hit[u] - row0;
        if (r < 0 || r >= nrows) continue;
        float acc = table[r * ncols + c];
        for (int32_t k = start[u]; k < start[u + 1]; k++) acc += g[(long long)pos[k] * ncols + c];
        table[r * ncols + c] = acc;
    }
}

extern "C" ct_status ct_cuda_gather_rows(ct_device *dev, const float *table, int64_t nrows,
                                         int64_t ncols, int64_t row0, const int32_t *ids,
                                         int64_t nids, float *out) {
    if (nids == 0 || ncols == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    gather_rows_kernel<<<grid_for(nids * ncols, 256), 256, 0, ct_cuda_stream(dev)>>>(
        table, nrows, ncols, row0, ids, nids, out);
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

extern "C" ct_status ct_cuda_scatter_add_rows(ct_device *dev, float *table, int64_t nrows,
                                              int64_t ncols, int64_t row0, const int32_t *hit,
                                              const int32_t *start, int64_t nhit,
                                              const int32_t *pos, const float *g) {
    if (nhit == 0 || ncols == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    scatter_add_rows_kernel<<<grid_for(nhit * ncols, 256), 256, 0, ct_cuda_stream(dev)>>>(
        table, nrows, ncols, row0, hit, start, nhit, pos, g);
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}
