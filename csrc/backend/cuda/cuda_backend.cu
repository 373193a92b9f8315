/*
 * cuda_backend.cu — the CUDA backend: device memory, streams and copies.
 *
 * Built by setup.py into a separate shared library (ctrainstate/_cuda_backend.so)
 * that the core dlopen()s at device-registry creation; importing ctrainstate
 * therefore never needs CUDA libraries or a driver. Each logical device (a GPU,
 * or a slice of one with CTRAINSTATE_GPU_SPLIT) has its own stream and memory
 * accounting; memory comes from cudaMallocAsync's pool on that stream, so
 * freeing is cheap and ordered with the work queued there. Many small copies
 * between a device and the host go as one batch (copy_segments) through a
 * pinned staging buffer of the device.
 */
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "cuda_common.cuh"

extern "C" {
#include "../../core/ct_ops.h"
#include "../../core/ct_ops_math.h"
}

const ct_core_services *ct_cuda_core = NULL;

/* cuda_ops.cu */
extern "C" ct_status ct_cuda_unary(ct_device *dev, int op, float alpha, float beta, int64_t n,
                                   const float *x, float *y);
extern "C" ct_status ct_cuda_unary_typed(ct_device *dev, int op, float alpha, float beta, int64_t n,
                                         int dtype, const void *x, void *y);
extern "C" ct_status ct_cuda_chain(ct_device *dev, int ndim, const int64_t *shape, const float *a,
                                   const int64_t *a_strides, int nsteps, const ct_chain_step *steps,
                                   float *out);
extern "C" ct_status ct_cuda_binary(ct_device *dev, int op, int ndim, const int64_t *shape,
                                    float *out, const float *a, const int64_t *as, const float *b,
                                    const int64_t *bs);
extern "C" ct_status ct_cuda_reduce(ct_device *dev, int op, int ndim, const int64_t *shape,
                                    uint32_t axes, const float *x, float *out);
extern "C" ct_status ct_cuda_gemm(ct_device *dev, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                  float alpha, const float *a, int64_t lda, const float *b,
                                  int64_t ldb, float beta, float *c, int64_t ldc, int prec);
extern "C" ct_status ct_cuda_nccl_unique_id(ct_device *dev, unsigned char *id);
extern "C" ct_status ct_cuda_allreduce_ranks(ct_device **devs, float **bufs, int nbufs,
                                             int64_t count, int op, const unsigned char *id,
                                             int nranks, const int *ranks);
extern "C" ct_status ct_cuda_allreduce(ct_device **devs, float **bufs, int nbufs,
                                       int64_t count, int op);
extern "C" ct_status ct_cuda_gather_rows(ct_device *dev, const float *table, int64_t nrows,
                                         int64_t ncols, int64_t row0, const int32_t *ids,
                                         int64_t nids, float *out);
extern "C" ct_status ct_cuda_scatter_add_rows(ct_device *dev, float *table, int64_t nrows,
                                              int64_t ncols, int64_t row0, const int32_t *hit,
                                              const int32_t *start, int64_t nhit,
                                              const int32_t *pos, const float *g);
extern "C" ct_status ct_cuda_optim_pass(ct_device *dev, const struct ct_opt_pass *ps, double *acc);
/* cuda_random.cu */
extern "C" ct_status ct_cuda_random_fill(ct_device *dev, uint32_t k0, uint32_t k1,
                                         const struct ct_random_consts *c,
                                         const struct ct_rm_block *blk, void *out);
/* cuda_convert.cu */
extern "C" ct_status ct_cuda_convert(ct_device *dev, int64_t n, int sdt, const void *x, int ddt,
                                     void *y);
/* cuda_ewise.cu */
extern "C" ct_status ct_cuda_ewise(ct_device *dev, int op, int dtype, int ndim,
                                   const int64_t *shape, void *out, const void *a,
                                   const int64_t *as, const void *b, const int64_t *bs);
extern "C" ct_status ct_cuda_reduce_typed(ct_device *dev, int op, int dtype, int ndim,
                                          const int64_t *shape, uint32_t axes, const void *x,
                                          void *out);

// --- memory -------------------------------------------------------------------

static ct_status cuda_alloc(ct_device *dev, size_t nbytes, void **out) {
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, nbytes ? nbytes : 256, ct_cuda_stream(dev));
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError(); /* clear the sticky-free error state */
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        return ct_cuda_core->set_error(
            CT_EOOM,
            "RESOURCE_EXHAUSTED: out of memory on CudaDevice(id=%d) while trying to allocate %zu "
            "bytes: %zu bytes in use on this device, %zu bytes free on GPU %d",
            dev->id, nbytes, (size_t)atomic_load(&dev->bytes_in_use) - nbytes, free_b,
            dev->ordinal);
    }
    CT_CUDA_TRY(e);
    *out = p;
    return CT_OK;
}

static void cuda_free(ct_device *dev, void *ptr, size_t nbytes) {
    (void)nbytes;
    if (ptr == NULL) return;
    cudaSetDevice(dev->ordinal);
    cudaFreeAsync(ptr, ct_cuda_stream(dev));
}

static ct_status cuda_synchronize(ct_device *dev) {
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    CT_CUDA_TRY(cudaStreamSynchronize(ct_cuda_stream(dev)));
    return CT_OK;
}

static ct_status cuda_init_device(ct_device *dev) {
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    /* A blocking stream: it is ordered after the legacy default stream, which is how
     * DLPack producers hand us tensors (we pass stream=1 to __dlpack__). */
    cudaStream_t s;
    CT_CUDA_TRY(cudaStreamCreate(&s));
    dev->stream = (void *)s;
    size_t free_b = 0, total_b = 0;
    CT_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    /* Logical devices of one GPU share it evenly. */
    int split = 1;
    const char *e = getenv("CTRAINSTATE_GPU_SPLIT");
    if (e != NULL && atoi(e) > 0) split = atoi(e);
    dev->bytes_limit = total_b / (size_t)split;
    /* Keep freed pool memory cached instead of returning it at every sync. */
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev->ordinal) == cudaSuccess) {
        uint64_t threshold = UINT64_MAX;
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    }
    return CT_OK;
}

// --- copies ---------------------------------------------------------------------

#define CT_CUDA_MAX_NDIM 16

struct ct_strided_args {
    int ndim;
    int64_t shape[CT_CUDA_MAX_NDIM];
    int64_t dst_strides[CT_CUDA_MAX_NDIM];
    int64_t src_strides[CT_CUDA_MAX_NDIM];
};

/* One thread per element; offsets from the row-major element index. */
template <typename T>
__global__ void strided_copy_kernel(char *dst, const char *src, long long n, ct_strided_args a) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int64_t doff, soff;
        ct_offsets2(i, a.ndim, a.shape, a.dst_strides, a.src_strides, &doff, &soff);
        *(T *)(dst + doff) = *(const T *)(src + soff);
    }
}

static int is_dense(int ndim, const int64_t *shape, size_t itemsize, const int64_t *strides) {
    int64_t s = (int64_t)itemsize;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && strides[d] != s) return 0;
        s *= shape[d];
    }
    return 1;
}

static void host_strided_copy(int ndim, const int64_t *shape, size_t itemsize, char *dst,
                              const int64_t *ds, const char *src, const int64_t *ss) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    for (int64_t i = 0; i < n; i++) {
        int64_t doff, soff;
        ct_offsets2(i, ndim, shape, ds, ss, &doff, &soff);
        memcpy(dst + doff, src + soff, itemsize);
    }
}

static ct_status launch_strided(ct_device *dev, int ndim, const int64_t *shape, size_t itemsize,
                                void *dst, const int64_t *ds, const void *src, const int64_t *ss,
                                long long n) {
    ct_strided_args a;
    a.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        a.shape[d] = shape[d];
        a.dst_strides[d] = ds[d];
        a.src_strides[d] = ss[d];
    }
    int threads = 256;
    long long blocks = (n + threads - 1) / threads;
    if (blocks > 65535LL * 16) blocks = 65535LL * 16;
    cudaStream_t s = ct_cuda_stream(dev);
    switch (itemsize) {
    case 1: strided_copy_kernel<uint8_t><<<(unsigned)blocks, threads, 0, s>>>((char *)dst, (const char *)src, n, a); break;
    case 2: strided_copy_kernel<uint16_t><<<(unsigned)blocks, threads, 0, s>>>((char *)dst, (const char *)src, n, a); break;
    case 4: strided_copy_kernel<uint32_t><<<(unsigned)blocks, threads, 0, s>>>((char *)dst, (const char *)src, n, a); break;
    case 8: strided_copy_kernel<uint64_t><<<(unsigned)blocks, threads, 0, s>>>((char *)dst, (const char *)src, n, a); break;
    default:
        return ct_cuda_core->set_error(CT_EINVAL, "unsupported item size %zu", itemsize);
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}

/* Buffers come from each GPU's default memory pool (cudaMallocAsync), and pool
 * allocations do not follow cudaDeviceEnablePeerAccess: the peer's pool must
 * grant access to `gpu` itself (cudaMemPoolSetAccess). Done once per pair. */
#define CT_CUDA_PEER_CACHE 64
static std::atomic<uint64_t> g_peer_ok[CT_CUDA_PEER_CACHE];

ct_status ct_cuda_enable_peer(int gpu, int peer) {
    CT_CUDA_TRY(cudaSetDevice(gpu));
    if (gpu == peer) return CT_OK;
    const bool cached = gpu < CT_CUDA_PEER_CACHE && peer < CT_CUDA_PEER_CACHE;
    if (cached && ((g_peer_ok[gpu].load() >> peer) & 1u)) return CT_OK;
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
    else CT_CUDA_TRY(e);
    cudaMemPool_t pool;
    CT_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, peer));
    cudaMemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = cudaMemLocationTypeDevice;
    acc.location.id = gpu;
    acc.flags = cudaMemAccessFlagsProtReadWrite;
    CT_CUDA_TRY(cudaMemPoolSetAccess(pool, &acc, 1));
    if (cached) g_peer_ok[gpu].fetch_or(1ull << peer);
    return CT_OK;
}

/* A side is "host" when it is NULL or a device of another backend (CPU devices
 * live in host memory). */
static ct_device *as_gpu(ct_device *d);

static const ct_backend *self_backend(void);

static ct_device *as_gpu(ct_device *d) {
    return (d != NULL && d->backend == self_backend()) ? d : NULL;
}

static ct_status cuda_copy_block(ct_device *dst_dev, ct_device *src_dev, int ndim,
                                 const int64_t *shape, size_t itemsize, void *dst,
                                 const int64_t *dst_strides, const void *src,
                                 const int64_t *src_strides) {
    if (ndim > CT_CUDA_MAX_NDIM)
        return ct_cuda_core->set_error(CT_EINVAL, "copies of rank > %d", CT_CUDA_MAX_NDIM);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    if (n == 0) return CT_OK;
    size_t bytes = (size_t)n * itemsize;
    ct_device *gd = as_gpu(dst_dev), *gs = as_gpu(src_dev);
    int dd = is_dense(ndim, shape, itemsize, dst_strides);
    int sd = is_dense(ndim, shape, itemsize, src_strides);

    if (gd == NULL && gs == NULL) {  // host -> host
        host_strided_copy(ndim, shape, itemsize, (char *)dst, dst_strides, (const char *)src,
                          src_strides);
        return CT_OK;
    }
    if (gd != NULL && gs != NULL) {  // device -> device (same or peer GPU)
        CT_CUDA_TRY(cudaSetDevice(gd->ordinal));
        if (gs->stream != gd->stream) {
            /* Order after the source's pending work. */
            cudaEvent_t ev;
            CT_CUDA_TRY(cudaSetDevice(gs->ordinal));
            CT_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
            CT_CUDA_TRY(cudaEventRecord(ev, ct_cuda_stream(gs)));
            CT_CUDA_TRY(cudaSetDevice(gd->ordinal));
            CT_CUDA_TRY(cudaStreamWaitEvent(ct_cuda_stream(gd), ev, 0));
            CT_CUDA_TRY(cudaEventDestroy(ev));
        }
        if (dd && sd) {
            if (gd->ordinal == gs->ordinal)
                CT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                            ct_cuda_stream(gd)));
            else
                CT_CUDA_TRY(cudaMemcpyPeerAsync(dst, gd->ordinal, src, gs->ordinal, bytes,
                                                ct_cuda_stream(gd)));
        } else {
            /* Strided: the kernel reads the peer directly (UVA + peer access). */
            if (gd->ordinal != gs->ordinal) CT_TRY(ct_cuda_enable_peer(gd->ordinal, gs->ordinal));
            CT_TRY(launch_strided(gd, ndim, shape, itemsize, dst, dst_strides, src, src_strides, n));
        }
        /* Within one device the copy is ordered on its stream with everything that later
         * reads or frees either buffer (a host read synchronises first), so it completes
         * without a wait here; between two devices the source's stream does not see it. */
        if (gs != gd) CT_CUDA_TRY(cudaStreamSynchronize(ct_cuda_stream(gd)));
        return CT_OK;
    }
    ct_device *g = gd ? gd : gs;
    CT_CUDA_TRY(cudaSetDevice(g->ordinal));
    cudaStream_t s = ct_cuda_stream(g);
    if (dd && sd) {
        CT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, gd ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s));
        CT_CUDA_TRY(cudaStreamSynchronize(s));
        return CT_OK;
    }
    /* Host side strided: stage through a dense host buffer. */
    char *stage = (char *)malloc(bytes);
    if (stage == NULL) return ct_cuda_core->set_error(CT_EOOM, "host out of memory staging %zu bytes", bytes);
    int64_t dense[CT_CUDA_MAX_NDIM];
    int64_t st = (int64_t)itemsize;
    for (int d = ndim - 1; d >= 0; d--) {
        dense[d] = st;
        st *= shape[d];
    }
    ct_status rc = CT_OK;
    if (gd) {  // host (strided) -> stage -> device
        host_strided_copy(ndim, shape, itemsize, stage, dense, (const char *)src, src_strides);
        if (dd) {
            cudaError_t e = cudaMemcpyAsync(dst, stage, bytes, cudaMemcpyHostToDevice, s);
            if (e == cudaSuccess) e = cudaStreamSynchronize(s);
            if (e != cudaSuccess) rc = ct_cuda_core->set_error(CT_EDEVICE, "CUDA h2d copy: %s", cudaGetErrorString(e));
        } else {
            void *tmp = NULL;
            cudaError_t e = cudaMallocAsync(&tmp, bytes, s);
            if (e == cudaSuccess) e = cudaMemcpyAsync(tmp, stage, bytes, cudaMemcpyHostToDevice, s);
            if (e == cudaSuccess) rc = launch_strided(gd, ndim, shape, itemsize, dst, dst_strides, tmp, dense, n);
            if (tmp) cudaFreeAsync(tmp, s);
            if (e == cudaSuccess) e = cudaStreamSynchronize(s);
            if (e != cudaSuccess) rc = ct_cuda_core->set_error(CT_EDEVICE, "CUDA h2d copy: %s", cudaGetErrorString(e));
        }
    } else {  // device -> stage -> host (strided)
        cudaError_t e = cudaSuccess;
        if (sd) {
            e = cudaMemcpyAsync(stage, src, bytes, cudaMemcpyDeviceToHost, s);
        } else {
            void *tmp = NULL;
            e = cudaMallocAsync(&tmp, bytes, s);
            if (e == cudaSuccess) rc = launch_strided(gs, ndim, shape, itemsize, tmp, dense, src, src_strides, n);
            if (e == cudaSuccess && rc == CT_OK) e = cudaMemcpyAsync(stage, tmp, bytes, cudaMemcpyDeviceToHost, s);
            if (tmp) cudaFreeAsync(tmp, s);
        }
        if (e == cudaSuccess) e = cudaStreamSynchronize(s);
        if (e != cudaSuccess) rc = ct_cuda_core->set_error(CT_EDEVICE, "CUDA d2h copy: %s", cudaGetErrorString(e));
        if (rc == CT_OK) host_strided_copy(ndim, shape, itemsize, (char *)dst, dst_strides, stage, dense);
    }
    free(stage);
    return rc;
}

// --- batched copies ---------------------------------------------------------------------------

/* copy_segments stages through one pinned host buffer per logical device: device -> host, every
 * segment is queued into it, the host waits once and copies out; host -> device, the host packs
 * every segment into it and queues the copies (no wait). `idle` is recorded after the last
 * copies queued from or into the buffer: before the host writes the buffer again (or frees it
 * to grow it) it waits for that event, which has normally completed by then (a later pass of
 * the step waits for the stream). Copies into the buffer need no wait: they are queued on the
 * same stream, after the copies out of it. Kept for the process' life (outside the per-device
 * accounting), like cuda_optim.cu's caches. */
struct seg_stage {
    std::mutex mu;
    char *h = nullptr;
    size_t cap = 0;
    cudaEvent_t idle = nullptr;
};
static seg_stage g_seg_stage[CT_MAX_DEVICES];

#define CT_SEG_ALIGN 256 /* each segment's offset in the staging buffer */

static ct_status seg_wait_idle(seg_stage *st) {
    if (st->idle == nullptr) return CT_OK;
    const cudaError_t q = cudaEventQuery(st->idle);
    if (q == cudaErrorNotReady) CT_CUDA_TRY(cudaEventSynchronize(st->idle));
    else CT_CUDA_TRY(q);
    return CT_OK;
}

/* The staging buffer holds at least `bytes`; false (and no error) when pinned memory could
 * not be had: the caller copies without it. */
static ct_status seg_reserve(seg_stage *st, size_t bytes, bool *ok) {
    *ok = true;
    if (bytes <= st->cap) return CT_OK;
    CT_TRY(seg_wait_idle(st)); /* copies still queued may read or write the old buffer */
    if (st->h != nullptr) CT_CUDA_TRY(cudaFreeHost(st->h));
    st->h = nullptr;
    st->cap = 0;
    size_t cap = bytes < ((size_t)1 << 16) ? ((size_t)1 << 16) : bytes + bytes / 2;
    if (cudaMallocHost((void **)&st->h, cap) != cudaSuccess) {
        cudaGetLastError(); /* not sticky: the copies go without staging */
        st->h = nullptr;
        *ok = false;
        return CT_OK;
    }
    st->cap = cap;
    return CT_OK;
}

static ct_status cuda_copy_segments(ct_device *dst_dev, ct_device *src_dev, int nseg,
                                    void *const *dst, const void *const *src,
                                    const size_t *nbytes) {
    ct_device *gd = as_gpu(dst_dev), *gs = as_gpu(src_dev);
    if ((gd == NULL) == (gs == NULL)) { /* host -> host, device -> device: nothing to batch */
        const int64_t one = 1;
        for (int i = 0; i < nseg; i++) {
            const int64_t n = (int64_t)nbytes[i];
            CT_TRY(cuda_copy_block(dst_dev, src_dev, 1, &n, 1, dst[i], &one, src[i], &one));
        }
        return CT_OK;
    }
    ct_device *g = gd ? gd : gs;
    if (g->id < 0 || g->id >= CT_MAX_DEVICES)
        return ct_cuda_core->set_error(CT_EINVAL, "copy_segments: device id %d", g->id);
    size_t total = 0;
    for (int i = 0; i < nseg; i++)
        total += (nbytes[i] + CT_SEG_ALIGN - 1) / CT_SEG_ALIGN * CT_SEG_ALIGN;
    if (total == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(g->ordinal));
    cudaStream_t s = ct_cuda_stream(g);
    seg_stage *st = &g_seg_stage[g->id];
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->idle == nullptr) CT_CUDA_TRY(cudaEventCreateWithFlags(&st->idle, cudaEventDisableTiming));
    bool staged = false;
    CT_TRY(seg_reserve(st, total, &staged));
    cudaError_t e = cudaSuccess;
    if (!staged) { /* pageable memory: each d2h copy waits, each h2d one is staged by CUDA */
        for (int i = 0; i < nseg && e == cudaSuccess; i++)
            if (nbytes[i] > 0)
                e = cudaMemcpyAsync(dst[i], src[i], nbytes[i],
                                    gd ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s);
        if (e == cudaSuccess && gs) e = cudaStreamSynchronize(s);
        if (e != cudaSuccess)
            return ct_cuda_core->set_error(CT_EDEVICE, "CUDA error in a batch of %d copies: %s",
                                           nseg, cudaGetErrorString(e));
        return CT_OK;
    }
    if (gd) CT_TRY(seg_wait_idle(st)); /* the host writes the buffer */
    size_t off = 0;
    int queued = 0;
    for (int i = 0; i < nseg && e == cudaSuccess; i++) {
        if (nbytes[i] == 0) continue;
        if (gd) {
            memcpy(st->h + off, src[i], nbytes[i]);
            e = cudaMemcpyAsync(dst[i], st->h + off, nbytes[i], cudaMemcpyHostToDevice, s);
        } else {
            e = cudaMemcpyAsync(st->h + off, src[i], nbytes[i], cudaMemcpyDeviceToHost, s);
        }
        queued += e == cudaSuccess;
        off += (nbytes[i] + CT_SEG_ALIGN - 1) / CT_SEG_ALIGN * CT_SEG_ALIGN;
    }
    /* after what was queued, even on an error: the next writer of the buffer waits for it */
    if (queued > 0) {
        const cudaError_t r = cudaEventRecord(st->idle, s);
        if (e == cudaSuccess) e = r;
    }
    if (e == cudaSuccess && gs) e = cudaEventSynchronize(st->idle); /* the one host wait */
    if (e != cudaSuccess)
        return ct_cuda_core->set_error(CT_EDEVICE, "CUDA error in a batch of %d copies: %s",
                                       nseg, cudaGetErrorString(e));
    if (gs) {
        off = 0;
        for (int i = 0; i < nseg; i++) {
            if (nbytes[i] == 0) continue;
            memcpy(dst[i], st->h + off, nbytes[i]);
            off += (nbytes[i] + CT_SEG_ALIGN - 1) / CT_SEG_ALIGN * CT_SEG_ALIGN;
        }
    }
    return CT_OK;
}

// --- graphs -------------------------------------------------------------------------

/* ThreadLocal mode: only this thread's calls that would break the capture are refused; other
 * threads may use their devices meanwhile (a kernel releasing the GIL lets them run). */
static ct_status cuda_graph_begin(ct_device *dev) {
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    CT_CUDA_TRY(cudaStreamBeginCapture(ct_cuda_stream(dev), cudaStreamCaptureModeThreadLocal));
    return CT_OK;
}

static ct_status cuda_graph_end(ct_device *dev, int keep, void **exec, int *updated) {
    *updated = 0;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    cudaGraph_t g = nullptr;
    const cudaError_t e = cudaStreamEndCapture(ct_cuda_stream(dev), &g);
    if (e != cudaSuccess || !keep) {
        if (g != nullptr) cudaGraphDestroy(g);
        if (e == cudaSuccess) return CT_OK;
        cudaGetLastError();
        return ct_cuda_core->set_error(CT_EDEVICE, "CUDA graph capture on CudaDevice(id=%d) "
                                       "failed: %s", dev->id, cudaGetErrorString(e));
    }
    cudaGraphExec_t x = (cudaGraphExec_t)*exec;
    if (x != nullptr) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(x, g, &info) == cudaSuccess) {
            cudaGraphDestroy(g);
            *updated = 1;
            return CT_OK;
        }
        cudaGetLastError(); /* (another topology: made again) */
        cudaGraphExecDestroy(x);
        *exec = nullptr;
    }
    const cudaError_t ei = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    CT_CUDA_TRY(ei);
    *exec = (void *)x;
    return CT_OK;
}

static ct_status cuda_graph_launch(ct_device *dev, void *exec) {
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    CT_CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)exec, ct_cuda_stream(dev)));
    return CT_OK;
}

static void cuda_graph_free(ct_device *dev, void *exec) {
    if (exec == nullptr) return;
    cudaSetDevice(dev->ordinal);
    cudaGraphExecDestroy((cudaGraphExec_t)exec);
}

// --- the table and the entry point ------------------------------------------------

static const ct_backend g_cuda_backend = {
    /* name */ "cuda",
    /* platform */ CT_PLATFORM_GPU,
    /* alloc */ cuda_alloc,
    /* free */ cuda_free,
    /* copy_block */ cuda_copy_block,
    /* copy_segments */ cuda_copy_segments,
    /* synchronize */ cuda_synchronize,
    /* init_device */ cuda_init_device,
    /* unary */ ct_cuda_unary,
    /* binary */ ct_cuda_binary,
    /* reduce */ ct_cuda_reduce,
    /* gemm */ ct_cuda_gemm,
    /* allreduce */ ct_cuda_allreduce,
    /* gather_rows */ ct_cuda_gather_rows,
    /* scatter_add_rows */ ct_cuda_scatter_add_rows,
    /* optim_pass */ ct_cuda_optim_pass,
    /* random_fill */ ct_cuda_random_fill,
    /* convert */ ct_cuda_convert,
    /* ewise */ ct_cuda_ewise,
    /* reduce_typed */ ct_cuda_reduce_typed,
    /* optim_factored */ 1,
    /* chain */ ct_cuda_chain,
    /* unary_typed */ ct_cuda_unary_typed,
    /* graph_begin */ cuda_graph_begin,
    /* graph_end */ cuda_graph_end,
    /* graph_launch */ cuda_graph_launch,
    /* graph_free */ cuda_graph_free,
    /* nccl_unique_id */ ct_cuda_nccl_unique_id,
    /* allreduce_ranks */ ct_cuda_allreduce_ranks,
};

static const ct_backend *self_backend(void) { return &g_cuda_backend; }

extern "C" __attribute__((visibility("default"))) ct_status
ct_cuda_backend_open(const ct_core_services *services, const ct_backend **backend,
                     int *num_physical) {
    *backend = NULL;
    *num_physical = 0;
    if (services == NULL) return CT_EINVAL;
    if (services->abi_version != CT_BACKEND_ABI_VERSION)
        return services->set_error(CT_EINVAL,
                                   "the CUDA backend was built for backend ABI %d, the core has %d "
                                   "(built from other sources: rebuild both)",
                                   CT_BACKEND_ABI_VERSION, services->abi_version);
    ct_cuda_core = services;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return services->set_error(CT_EDEVICE, "no usable GPU: cudaGetDeviceCount: %s",
                                   cudaGetErrorString(e));
    }
    *backend = &g_cuda_backend;
    *num_physical = n;
    return CT_OK;
}
