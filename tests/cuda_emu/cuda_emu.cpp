/*
 * cuda_emu.cpp — the host implementation of tests/cuda_emu/cuda_runtime.h and
 * cublas_v2.h (see cuda_runtime.h for the model). Linked with the backend's
 * rewritten .cu sources into an emulated ctrainstate/_cuda_backend.so by
 * tools/cuda_emu.sh.
 *
 * Environment: CT_EMU_NGPU (emulated GPUs, default 1), CT_EMU_GPU_MB (memory
 * per GPU, default 4096), CT_EMU_SMS (multiprocessors reported, default 4),
 * CT_EMU_SCHEDULE=lazy|eager (when queued operations run, see cuda_runtime.h;
 * default lazy), CT_EMU_FIBERS=1 (run every launch with fibers, not only launch
 * sites whose kernel reached __syncthreads before).
 *
 * A call that breaks a rule of the CUDA runtime returns the error a GPU would
 * give and prints why on stderr ("cuda_emu: ..."), so the backend's own error
 * path is what a test sees.
 */
#include "cublas_v2.h"
#include "cuda_runtime.h"

#include "core/ct_prec_math.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <ucontext.h>

#include <errno.h>
#include <string.h>
#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

thread_local uint3 ct_emu_threadIdx, ct_emu_blockIdx;
thread_local dim3 ct_emu_blockDim, ct_emu_gridDim;

namespace {

enum { KIND_DEVICE = 0, KIND_PINNED = 1 };
struct Alloc {
    size_t n;
    int dev;   /* owning GPU (device memory) */
    int kind;
    unsigned flags;
    bool freeing; /* a cudaFreeAsync is queued */
};

/* All state below except the per-thread values; recursive: running a queued operation may
 * run other streams' operations it waits for. */
std::recursive_mutex g_mu;
std::map<uintptr_t, Alloc> g_allocs;   /* start address -> allocation */
int g_ngpu = -1;
size_t g_total = 0;
std::vector<size_t> g_used;
std::vector<std::set<int>> g_peer;     /* g_peer[gpu]: peers gpu's kernels may access */
int g_sms = 4;
bool g_always_fibers = false;
bool g_eager = false;

thread_local int t_dev = 0;
thread_local cudaError_t t_err = cudaSuccess;

std::atomic<long long> n_sync{0}, n_h2d{0}, n_d2h{0};

struct Pool { int dev; };
Pool g_pools[64];

void init_locked() {
    if (g_ngpu >= 0) return;
    const char *e = getenv("CT_EMU_NGPU");
    g_ngpu = e ? atoi(e) : 1;
    if (g_ngpu < 0) g_ngpu = 0;
    if (g_ngpu > 64) g_ngpu = 64;
    e = getenv("CT_EMU_GPU_MB");
    g_total = (size_t)(e ? atoll(e) : 4096) << 20;
    e = getenv("CT_EMU_SMS");
    g_sms = e && atoi(e) > 0 ? atoi(e) : 4;
    e = getenv("CT_EMU_FIBERS");
    g_always_fibers = e && atoi(e) == 1;
    e = getenv("CT_EMU_SCHEDULE");
    g_eager = e && strcmp(e, "eager") == 0;
    g_used.assign((size_t)g_ngpu, 0);
    g_peer.assign((size_t)g_ngpu, std::set<int>());
    for (int i = 0; i < 64; i++) g_pools[i].dev = i;
}

struct Locked {
    std::lock_guard<std::recursive_mutex> lock{g_mu};
    Locked() { init_locked(); }
};

cudaError_t set_err(cudaError_t e) {
    if (e != cudaSuccess) t_err = e;
    return e;
}

/* A rule violation: say why, and fail the call as the runtime would. */
__attribute__((format(printf, 2, 3))) cudaError_t violation(cudaError_t e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda_emu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return set_err(e);
}

/* The allocation holding [p, p+n), or nullptr. Caller holds g_mu. */
const Alloc *find_locked(const void *p, size_t n, uintptr_t *base = nullptr) {
    uintptr_t a = (uintptr_t)p;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    if (a < it->first || a + n > it->first + it->second.n) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

/* Does [p, p+n) overlap device memory at all (even partly)? Caller holds g_mu. */
bool touches_device_locked(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p, b = a + (n ? n : 1);
    auto it = g_allocs.upper_bound(a);
    if (it != g_allocs.begin()) {
        auto pr = std::prev(it);
        if (pr->second.kind == KIND_DEVICE && pr->first + pr->second.n > a) return true;
    }
    for (; it != g_allocs.end() && it->first < b; ++it)
        if (it->second.kind == KIND_DEVICE) return true;
    return false;
}

}  // namespace

/* --- streams and events ---------------------------------------------------------------- */

struct Op {
    std::function<void()> fn;
    unsigned long long seq;
};
/* A captured operation: what it runs, what it is (a kernel's launch site, "cublas", "copy",
 * "memset": an update keeps the kinds), and the device memory its pointer arguments named at
 * the capture. */
struct Node {
    std::shared_ptr<std::function<void()>> fn;
    const char *kind;
    std::vector<const void *> ptrs;
};
struct CUgraph_st {
    int dev;
    std::vector<Node> nodes;
};
struct CUgraphExec_st {
    int dev;
    std::vector<Node> nodes;
};
struct CUstream_st {
    int dev;
    std::deque<Op> q;
    unsigned long long issued = 0, done = 0; /* sequence numbers of operations */
    unsigned long long executing = 0;        /* the operation running now, or 0 */
    CUgraph_st *capture = nullptr;           /* capturing into this graph */
    bool capture_bad = false;                /* the capture was invalidated */
};
struct CUevent_st {
    int dev;
    CUstream_st *stream; /* where it was last recorded (nullptr: never, or the legacy stream) */
    unsigned long long seq;
};

namespace {
std::vector<CUstream_st *> g_streams;

int stream_dev(cudaStream_t s) { return s ? s->dev : t_dev; }

/* Run s's operations up to and including sequence number upto. Caller holds g_mu. */
void run_until(CUstream_st *s, unsigned long long upto) {
    if (s->executing != 0 && upto >= s->executing) {
        /* an operation of s waits, through other streams, for itself or later work of s */
        fprintf(stderr, "cuda_emu: deadlock: work queued on a stream of GPU %d waits for that "
                "stream's operation %llu (running) or later ones\n", s->dev, s->executing);
        abort();
    }
    while (s->done < upto && !s->q.empty()) {
        Op op = std::move(s->q.front());
        s->q.pop_front();
        s->executing = op.seq;
        if (op.fn) op.fn();
        s->executing = 0;
        s->done = op.seq;
    }
}

void flush(CUstream_st *s) { run_until(s, s->issued); }

/* Everything queued on GPU dev (dev < 0: on every GPU). */
void flush_device(int dev) {
    for (size_t i = 0; i < g_streams.size(); i++)
        if (dev < 0 || g_streams[i]->dev == dev) flush(g_streams[i]);
}

thread_local std::vector<CUstream_st *> t_captures; /* streams this thread captures */
thread_local std::vector<const void *> t_note;      /* the next launch's pointer arguments */
thread_local const char *t_kind = "operation";      /* the next captured node's kind */
long long n_captures = 0, n_instantiated = 0, n_updated = 0, n_launched = 0, n_node_runs = 0;

/* A call CUDA refuses while this thread captures (cudaStreamCaptureModeThreadLocal): every
 * capture of the thread is invalidated, and the call fails. */
bool refused_in_capture(const char *what) {
    if (t_captures.empty()) return false;
    for (CUstream_st *c : t_captures) c->capture_bad = true;
    violation(cudaErrorStreamCaptureUnsupported, "%s while this thread captures a stream", what);
    return true;
}

/* Queue fn on s. The legacy default stream (s == nullptr) is ordered after all work on the
 * current device's streams (they are blocking streams) and runs at once. On a capturing
 * stream fn becomes the graph's next node instead (with t_kind and t_note). Caller holds
 * g_mu. */
void enqueue(cudaStream_t s, std::function<void()> fn, bool may_run = true) {
    if (s != nullptr && s->capture != nullptr) {
        std::vector<const void *> dev_ptrs; /* (the arguments that are device memory now) */
        for (const void *p : t_note)
            if (p != nullptr && find_locked(p, 1) != nullptr) dev_ptrs.push_back(p);
        s->capture->nodes.push_back(Node{std::make_shared<std::function<void()>>(std::move(fn)),
                                         t_kind, std::move(dev_ptrs)});
        t_note.clear();
        t_kind = "operation";
        return;
    }
    t_note.clear();
    t_kind = "operation";
    if (s == nullptr) {
        if (!t_captures.empty()) { /* an implicit synchronisation with the capturing streams */
            for (CUstream_st *c : t_captures) c->capture_bad = true;
            violation(cudaErrorStreamCaptureImplicit, "work on the legacy stream while this "
                      "thread captures a stream");
            return;
        }
        flush_device(t_dev);
        if (fn) fn();
        return;
    }
    const unsigned long long seq = ++s->issued;
    s->q.push_back(Op{std::move(fn), seq});
    if (g_eager && may_run) flush(s);
}

bool event_done(const CUevent_st *ev) { return ev->stream == nullptr || ev->stream->done >= ev->seq; }
}  // namespace

/* --- errors and devices ---------------------------------------------------------------------- */

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorIllegalState: return "the operation is not permitted in this state";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorGraphExecUpdateFailure: return "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update";
    }
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = t_err;
    t_err = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) { return t_err; }

cudaError_t cudaGetDeviceCount(int *n) {
    Locked l;
    *n = g_ngpu;
    return g_ngpu > 0 ? cudaSuccess : set_err(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int dev) {
    Locked l;
    if (dev < 0 || dev >= g_ngpu)
        return violation(cudaErrorInvalidDevice, "cudaSetDevice(%d) with %d GPUs", dev, g_ngpu);
    t_dev = dev;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *dev) {
    *dev = t_dev;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev) {
    Locked l;
    if (dev < 0 || dev >= g_ngpu) return set_err(cudaErrorInvalidDevice);
    if (attr != cudaDevAttrMultiProcessorCount) return set_err(cudaErrorInvalidValue);
    *value = g_sms;
    return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
    Locked l;
    if (flags != 0) return violation(cudaErrorInvalidValue, "cudaDeviceEnablePeerAccess flags %u", flags);
    if (peer < 0 || peer >= g_ngpu || peer == t_dev)
        return violation(cudaErrorInvalidDevice, "cudaDeviceEnablePeerAccess(%d) on GPU %d", peer, t_dev);
    if (!g_peer[(size_t)t_dev].insert(peer).second) return set_err(cudaErrorPeerAccessAlreadyEnabled);
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    Locked l;
    n_sync++;
    if (refused_in_capture("cudaDeviceSynchronize")) return cudaErrorStreamCaptureUnsupported;
    flush_device(t_dev);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    Locked l;
    *total_bytes = g_total;
    *free_bytes = g_total - g_used[(size_t)t_dev];
    return cudaSuccess;
}

/* --- memory ---------------------------------------------------------------------------------- */

namespace {
/* The default pools' cached blocks, per (GPU, rounded size): a cudaFreeAsync puts its block
 * here when the free runs, and cudaMallocAsync takes the block freed last of its size on its
 * GPU, as a caching pool hands recently freed memory back (a loop that frees and allocates the
 * same sizes gets the same addresses). A cached block is no allocation: a use of it is a use
 * of freed memory. */
std::map<std::pair<int, size_t>, std::vector<void *>> g_pool_free;

cudaError_t alloc_device_locked(void **p, size_t n, int dev, bool pooled = false) {
    if (p == nullptr) return violation(cudaErrorInvalidValue, "cudaMalloc: null result pointer");
    *p = nullptr;
    if (n == 0) return cudaSuccess;
    if (g_used[(size_t)dev] + n > g_total) return set_err(cudaErrorMemoryAllocation);
    size_t rounded = (n + 255) / 256 * 256;
    void *m = nullptr;
    auto cached = pooled ? g_pool_free.find({dev, rounded}) : g_pool_free.end();
    if (cached != g_pool_free.end() && !cached->second.empty()) {
        m = cached->second.back();
        cached->second.pop_back();
    } else {
        m = aligned_alloc(256, rounded);
    }
    if (m == nullptr) return set_err(cudaErrorMemoryAllocation);
    memset(m, 0xAB, rounded); /* fresh device memory holds garbage */
    g_allocs[(uintptr_t)m] = Alloc{n, dev, KIND_DEVICE, 0, false};
    g_used[(size_t)dev] += n;
    *p = m;
    return cudaSuccess;
}

/* Check that p is the start of a live allocation of this kind (and mark it as being freed). */
cudaError_t check_free_locked(void *p, int kind, const char *what) {
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || it->second.kind != kind || it->second.freeing)
        return violation(cudaErrorInvalidValue, "%s(%p): not the start of a live %s allocation", what,
                         p, kind == KIND_DEVICE ? "device" : "pinned host");
    it->second.freeing = true;
    return cudaSuccess;
}

void release_locked(void *p, bool pooled = false) {
    auto it = g_allocs.find((uintptr_t)p);
    if (it->second.kind == KIND_DEVICE) g_used[(size_t)it->second.dev] -= it->second.n;
    memset(p, 0xCD, it->second.n); /* a use after free reads garbage */
    const int dev = it->second.dev;
    const size_t rounded = (it->second.n + 255) / 256 * 256;
    g_allocs.erase(it);
    if (pooled) g_pool_free[{dev, rounded}].push_back(p);
    else free(p);
}

/* cudaFree and cudaFreeHost wait for all work on the GPUs first. */
cudaError_t free_locked(void *p, int kind, const char *what) {
    if (p == nullptr) return cudaSuccess;
    cudaError_t e = check_free_locked(p, kind, what);
    if (e) return e;
    flush_device(-1);
    release_locked(p);
    return cudaSuccess;
}
}  // namespace

cudaError_t cudaMalloc(void **p, size_t n) {
    Locked l;
    if (refused_in_capture("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
    return alloc_device_locked(p, n, t_dev);
}

cudaError_t cudaFree(void *p) {
    Locked l;
    if (refused_in_capture("cudaFree")) return cudaErrorStreamCaptureUnsupported;
    return free_locked(p, KIND_DEVICE, "cudaFree");
}

cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s) {
    Locked l; /* from the pool of the stream's device */
    if (s != nullptr && s->capture != nullptr) { /* (CUDA would add a memory node) */
        s->capture_bad = true;
        return violation(cudaErrorStreamCaptureUnsupported, "cudaMallocAsync on a capturing "
                         "stream: memory nodes are not emulated (the backend captures none)");
    }
    return alloc_device_locked(p, n, stream_dev(s), true);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
    Locked l;
    if (p == nullptr) return cudaSuccess;
    if (s != nullptr && s->capture != nullptr) {
        s->capture_bad = true;
        return violation(cudaErrorStreamCaptureUnsupported, "cudaFreeAsync on a capturing "
                         "stream: memory nodes are not emulated (the backend captures none)");
    }
    cudaError_t e = check_free_locked(p, KIND_DEVICE, "cudaFreeAsync");
    if (e) return e;
    enqueue(s, [p] { release_locked(p, true); }); /* after the work queued before it */
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
    Locked l;
    if (refused_in_capture("cudaHostAlloc")) return cudaErrorStreamCaptureUnsupported;
    size_t rounded = ((n ? n : 1) + 255) / 256 * 256;
    void *m = aligned_alloc(256, rounded);
    if (m == nullptr) return set_err(cudaErrorMemoryAllocation);
    memset(m, 0xAB, rounded);
    g_allocs[(uintptr_t)m] = Alloc{n ? n : 1, -1, KIND_PINNED, flags, false};
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void *p) {
    Locked l;
    if (refused_in_capture("cudaFreeHost")) return cudaErrorStreamCaptureUnsupported;
    return free_locked(p, KIND_PINNED, "cudaFreeHost");
}

cudaError_t cudaHostGetDevicePointer(void **dev_ptr, void *host_ptr, unsigned flags) {
    Locked l;
    const Alloc *a = find_locked(host_ptr, 1);
    if (flags != 0) return violation(cudaErrorInvalidValue, "cudaHostGetDevicePointer flags %u", flags);
    if (a == nullptr || a->kind != KIND_PINNED || !(a->flags & cudaHostAllocMapped))
        return violation(cudaErrorInvalidValue,
                         "cudaHostGetDevicePointer(%p): not memory from cudaHostAlloc(..., "
                         "cudaHostAllocMapped)", host_ptr);
    *dev_ptr = host_ptr; /* unified addressing: the same address */
    return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int dev) {
    Locked l;
    if (dev < 0 || dev >= g_ngpu) return set_err(cudaErrorInvalidDevice);
    *pool = (cudaMemPool_t)&g_pools[dev];
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value) {
    if (pool == nullptr || value == nullptr || attr != cudaMemPoolAttrReleaseThreshold)
        return set_err(cudaErrorInvalidValue);
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool, const cudaMemAccessDesc *desc, size_t n) {
    Locked l;
    if (pool == nullptr || desc == nullptr) return set_err(cudaErrorInvalidValue);
    const int owner = ((Pool *)pool)->dev;
    for (size_t i = 0; i < n; i++) {
        if (desc[i].location.type != cudaMemLocationTypeDevice || desc[i].location.id < 0 ||
            desc[i].location.id >= g_ngpu)
            return violation(cudaErrorInvalidValue, "cudaMemPoolSetAccess: bad location");
        const int who = desc[i].location.id;
        if (who != owner && !g_peer[(size_t)who].count(owner))
            return violation(cudaErrorInvalidDevice,
                             "cudaMemPoolSetAccess: GPU %d to GPU %d's pool without peer access",
                             who, owner);
    }
    return cudaSuccess;
}

/* --- copies ------------------------------------------------------------------------------------ */

namespace {
/* Check that [p, p+n) is device memory (dev_must >= 0: on that GPU). */
cudaError_t need_device_locked(const void *p, size_t n, int dev_must, const char *what,
                               const char *side) {
    const Alloc *a = find_locked(p, n);
    if (a == nullptr || a->kind != KIND_DEVICE)
        return violation(cudaErrorInvalidValue, "%s: %s [%p, +%zu) is not inside one device allocation",
                         what, side, p, n);
    if (a->freeing)
        return violation(cudaErrorInvalidValue, "%s: %s [%p, +%zu) was freed (cudaFreeAsync)", what,
                         side, p, n);
    if (dev_must >= 0 && a->dev != dev_must)
        return violation(cudaErrorInvalidValue, "%s: %s is on GPU %d, not GPU %d", what, side, a->dev,
                         dev_must);
    return cudaSuccess;
}

cudaError_t need_host_locked(const void *p, size_t n, const char *what, const char *side) {
    if (touches_device_locked(p, n))
        return violation(cudaErrorInvalidValue, "%s: %s [%p, +%zu) overlaps device memory", what,
                         side, p, n);
    return cudaSuccess;
}

bool pageable_locked(const void *p, size_t n) {
    const Alloc *a = find_locked(p, n);
    return a == nullptr || a->kind != KIND_PINNED;
}

/* A copy on stream s (nullptr: the legacy stream, synchronous). What a GPU reads when: a
 * source in pageable host memory is read at the call (staged); a destination in pageable
 * host memory is written before the call returns (the stream is drained); pinned and
 * device memory are read and written when the copy runs. */
cudaError_t memcpy_impl(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s,
                        const char *what) {
    if (n == 0) return cudaSuccess;
    Locked l;
    cudaError_t e = cudaSuccess;
    if (kind == cudaMemcpyDefault) {
        const bool dd = touches_device_locked(dst, n), sd = touches_device_locked(src, n);
        kind = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                  : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    }
    bool stage_src = false, sync_dst = false;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        if ((e = need_device_locked(dst, n, -1, what, "destination")) ||
            (e = need_host_locked(src, n, what, "source")))
            return e;
        stage_src = pageable_locked(src, n);
        if (stage_src) n_h2d++;
        break;
    case cudaMemcpyDeviceToHost:
        if ((e = need_device_locked(src, n, -1, what, "source")) ||
            (e = need_host_locked(dst, n, what, "destination")))
            return e;
        sync_dst = pageable_locked(dst, n);
        if (sync_dst) n_d2h++;
        break;
    case cudaMemcpyDeviceToDevice:
        if ((e = need_device_locked(dst, n, -1, what, "destination")) ||
            (e = need_device_locked(src, n, -1, what, "source")))
            return e;
        break;
    case cudaMemcpyHostToHost:
        if ((e = need_host_locked(dst, n, what, "destination")) ||
            (e = need_host_locked(src, n, what, "source")))
            return e;
        stage_src = sync_dst = true;
        break;
    default:
        return violation(cudaErrorInvalidMemcpyDirection, "%s: kind %d", what, (int)kind);
    }
    t_kind = "copy";
    t_note = {dst, src};
    if (stage_src) {
        auto copy = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
        enqueue(s, [dst, copy] { memcpy(dst, copy->data(), copy->size()); });
    } else {
        enqueue(s, [dst, src, n] { memmove(dst, src, n); });
    }
    if (sync_dst && s != nullptr) flush(s);
    return cudaSuccess;
}
}  // namespace

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    n_sync++;
    {
        Locked l;
        if (refused_in_capture("cudaMemcpy")) return cudaErrorStreamCaptureUnsupported;
    }
    return memcpy_impl(dst, src, n, kind, nullptr, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s) {
    /* a copy may be issued to a stream of another device */
    return memcpy_impl(dst, src, n, kind, s, "cudaMemcpyAsync");
}

cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev, size_t n,
                                cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    Locked l;
    cudaError_t e;
    if ((e = need_device_locked(dst, n, dst_dev, "cudaMemcpyPeerAsync", "destination")) ||
        (e = need_device_locked(src, n, src_dev, "cudaMemcpyPeerAsync", "source")))
        return e;
    enqueue(s, [dst, src, n] { memmove(dst, src, n); });
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    Locked l;
    cudaError_t e = need_device_locked(p, n, -1, "cudaMemsetAsync", "destination");
    if (e) return e;
    t_kind = "memset";
    t_note = {p};
    enqueue(s, [p, value, n] { memset(p, value, n); });
    return cudaSuccess;
}

/* --- stream and event calls ------------------------------------------------------------------- */

cudaError_t cudaStreamCreate(cudaStream_t *s) {
    Locked l;
    *s = new CUstream_st();
    (*s)->dev = t_dev;
    g_streams.push_back(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
    Locked l;
    if (s == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(null)");
    flush(s); /* queued work still completes; the object stays (events and waits may name it) */
    for (size_t i = 0; i < g_streams.size(); i++)
        if (g_streams[i] == s) g_streams.erase(g_streams.begin() + (long)i);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    Locked l;
    n_sync++;
    if (refused_in_capture("cudaStreamSynchronize")) return cudaErrorStreamCaptureUnsupported;
    if (s == nullptr) flush_device(t_dev);
    else flush(s);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned flags) {
    Locked l;
    if (ev == nullptr || flags != 0)
        return violation(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: null event or flags");
    /* waits for the event's most recent record at the time of this call */
    if ((s != nullptr && s->capture != nullptr) || (ev->stream && ev->stream->capture)) {
        if (s != nullptr && s->capture != nullptr) s->capture_bad = true;
        return violation(cudaErrorStreamCaptureUnsupported, "cudaStreamWaitEvent during a "
                         "capture: not emulated (the backend captures no events)");
    }
    CUstream_st *from = ev->stream;
    const unsigned long long seq = ev->seq;
    if (from == nullptr || from == s) return cudaSuccess;
    enqueue(s, [from, seq] { run_until(from, seq); });
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *ev) { return cudaEventCreateWithFlags(ev, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags) {
    (void)flags;
    *ev = new CUevent_st{t_dev, nullptr, 0};
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
    if (ev == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaEventDestroy(null)");
    delete ev; /* a wait queued on it keeps its own (stream, sequence) */
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s) {
    Locked l;
    if (ev == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaEventRecord(null)");
    if (ev->dev != stream_dev(s))
        return violation(cudaErrorInvalidResourceHandle,
                         "cudaEventRecord: event of GPU %d recorded on a stream of GPU %d", ev->dev,
                         stream_dev(s));
    if (s == nullptr) {
        if (refused_in_capture("cudaEventRecord on the legacy stream"))
            return cudaErrorStreamCaptureImplicit;
        flush_device(t_dev);
        ev->stream = nullptr;
        return cudaSuccess;
    }
    if (s->capture != nullptr) {
        s->capture_bad = true;
        return violation(cudaErrorStreamCaptureUnsupported, "cudaEventRecord on a capturing "
                         "stream: not emulated (the backend captures no events)");
    }
    enqueue(s, std::function<void()>()); /* a marker */
    ev->stream = s;
    ev->seq = s->issued;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
    Locked l;
    if (ev == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaEventSynchronize(null)");
    n_sync++;
    if (refused_in_capture("cudaEventSynchronize")) return cudaErrorStreamCaptureUnsupported;
    if (ev->stream != nullptr) run_until(ev->stream, ev->seq);
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t ev) {
    Locked l;
    if (ev == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaEventQuery(null)");
    return event_done(ev) ? cudaSuccess : cudaErrorNotReady;
}

/* --- stream capture and graphs ----------------------------------------------------------------- */

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    Locked l;
    if (s == nullptr)
        return violation(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture on the legacy stream");
    if (mode != cudaStreamCaptureModeThreadLocal)
        return violation(cudaErrorInvalidValue, "cudaStreamBeginCapture: only "
                         "cudaStreamCaptureModeThreadLocal is emulated (got %d)", (int)mode);
    if (s->capture != nullptr)
        return violation(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream captures already");
    s->capture = new CUgraph_st{s->dev, {}};
    s->capture_bad = false;
    t_captures.push_back(s);
    n_captures++;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    Locked l;
    *graph = nullptr;
    if (s == nullptr || s->capture == nullptr)
        return violation(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
    bool mine = false;
    for (size_t i = 0; i < t_captures.size(); i++)
        if (t_captures[i] == s) {
            t_captures.erase(t_captures.begin() + (long)i);
            mine = true;
            break;
        }
    if (!mine)
        return violation(cudaErrorIllegalState, "cudaStreamEndCapture from another thread than "
                         "the capture's");
    CUgraph_st *g = s->capture;
    s->capture = nullptr;
    if (s->capture_bad) {
        delete g;
        s->capture_bad = false;
        return set_err(cudaErrorStreamCaptureInvalidated);
    }
    *graph = g;
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    Locked l;
    *status = s == nullptr || s->capture == nullptr ? cudaStreamCaptureStatusNone
              : s->capture_bad                      ? cudaStreamCaptureStatusInvalidated
                                                    : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    Locked l;
    if (graph == nullptr || flags != 0)
        return violation(cudaErrorInvalidValue, "cudaGraphInstantiate: null graph or flags");
    *exec = new CUgraphExec_st{graph->dev, graph->nodes};
    n_instantiated++;
    return cudaSuccess;
}

/* An update keeps the executable graph's topology: the same number of nodes, each of the same
 * kind (launch site); their arguments may differ. */
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo *info) {
    Locked l;
    if (exec == nullptr || graph == nullptr)
        return violation(cudaErrorInvalidValue, "cudaGraphExecUpdate: null graph");
    bool same = exec->dev == graph->dev && exec->nodes.size() == graph->nodes.size();
    for (size_t i = 0; same && i < graph->nodes.size(); i++)
        same = strcmp(exec->nodes[i].kind, graph->nodes[i].kind) == 0;
    if (info != nullptr) {
        info->result = same ? cudaGraphExecUpdateSuccess : cudaGraphExecUpdateErrorTopologyChanged;
        info->errorNode = info->errorFromNode = nullptr;
    }
    if (!same) return set_err(cudaErrorGraphExecUpdateFailure);
    exec->nodes = graph->nodes;
    n_updated++;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    Locked l;
    if (exec == nullptr || s == nullptr)
        return violation(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: null graph or the "
                         "legacy stream");
    if (s->dev != exec->dev || s->dev != t_dev)
        return violation(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: a graph of GPU %d "
                         "into a stream of GPU %d while GPU %d is current", exec->dev, s->dev, t_dev);
    if (s->capture != nullptr)
        return violation(cudaErrorStreamCaptureUnsupported, "cudaGraphLaunch into a capturing "
                         "stream: not emulated");
    n_launched++;
    for (size_t i = 0; i < exec->nodes.size(); i++) {
        /* the pointers that were device memory at the capture: still allocated when it runs */
        const std::vector<const void *> dev_ptrs = exec->nodes[i].ptrs;
        auto fn = exec->nodes[i].fn;
        const char *kind = exec->nodes[i].kind;
        enqueue(s, [fn, kind, dev_ptrs, i] {
            for (const void *p : dev_ptrs)
                if (find_locked(p, 1) == nullptr) {
                    fprintf(stderr, "cuda_emu: a graph's node %zu (%s) uses %p, device memory "
                            "at the capture that has been freed since: the graph replays a "
                            "stale address\n", i, kind, p);
                    abort();
                }
            n_node_runs++;
            (*fn)();
        });
    }
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    if (exec == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaGraphExecDestroy(null)");
    delete exec; /* (queued launches hold their nodes' functions) */
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    if (graph == nullptr) return violation(cudaErrorInvalidResourceHandle, "cudaGraphDestroy(null)");
    delete graph;
    return cudaSuccess;
}

void ct_emu_note_begin(void) { t_note.clear(); }
void ct_emu_note_arg(const void *p) { t_note.push_back(p); }

/* (stream captures begun, graphs instantiated, updated in place, launched; nodes run) */
extern "C" __attribute__((visibility("default"))) void cuda_emu_graph_stats(long long *out) {
    Locked l;
    out[0] = n_captures;
    out[1] = n_instantiated;
    out[2] = n_updated;
    out[3] = n_launched;
    out[4] = n_node_runs;
}

/* --- kernels ----------------------------------------------------------------------------------- */

namespace {
enum { F_RUN = 0, F_BARRIER = 1, F_DONE = 2 };

/* Switching between a block's threads. glibc's swapcontext saves and restores the signal
 * mask, a system call per switch: three quarters of an emulated run's time went there. On
 * x86-64 a fiber switch is ct_emu_switch below (the callee-saved registers, the SSE and x87
 * control words, the stack pointer: what a function call may not change), elsewhere it is
 * swapcontext. */
#if defined(__x86_64__)
#define CT_EMU_FAST_SWITCH 1
/* ct_emu_switch(save, to): push this context's registers, store its stack pointer in *save,
 * continue the context whose stack pointer is `to` (it returns from its own ct_emu_switch
 * call, or enters fiber_entry the first time). */
extern "C" void ct_emu_switch(void **save, void *to);
asm(".text\n"
    ".globl ct_emu_switch\n"
    ".hidden ct_emu_switch\n"
    ".type ct_emu_switch, @function\n"
    "ct_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size ct_emu_switch, .-ct_emu_switch\n");
#endif

struct Fiber {
#if CT_EMU_FAST_SWITCH
    void *sp; /* saved stack pointer while switched out */
#else
    ucontext_t ctx;
#endif
    int state;
    uint3 tid;
};
const size_t kStack = 256 << 10;
std::vector<char *> g_stacks;
std::vector<Fiber> g_fibers;
#if CT_EMU_FAST_SWITCH
thread_local void *t_sched_sp;
#else
thread_local ucontext_t t_sched;
#endif
thread_local Fiber *t_cur = nullptr;
thread_local bool t_in_fibers = false;
thread_local unsigned t_block_threads = 0;
thread_local const char *t_site = nullptr;
const std::function<void()> *g_body; /* the running kernel */

#if CT_EMU_FAST_SWITCH
[[noreturn]] void fiber_entry() {
    (*g_body)();
    t_cur->state = F_DONE;
    ct_emu_switch(&t_cur->sp, t_sched_sp); /* never resumed: the block is done */
    abort();
}

/* Fiber f's first context on the stack [base, base + kStack): what ct_emu_switch pops
 * (control words, six registers zeroed), then fiber_entry as the return address, entered with
 * the stack aligned as after a call (rsp = 8 mod 16). */
void fiber_start(Fiber &f, char *base) {
    uint64_t *top = (uint64_t *)(base + kStack);
    uint64_t *sp = top - 9;      /* top - 72 bytes: 8 mod 16 */
    uint32_t mxcsr;
    uint16_t fcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fcw));
    sp[0] = (uint64_t)mxcsr | ((uint64_t)fcw << 32);
    for (int r = 1; r <= 6; r++) sp[r] = 0; /* r15 r14 r13 r12 rbx rbp */
    sp[7] = (uint64_t)(uintptr_t)&fiber_entry;
    sp[8] = 0; /* fiber_entry's return address: it never returns */
    f.sp = sp;
}
#else
void trampoline() {
    (*g_body)();
    t_cur->state = F_DONE; /* returns to t_sched through uc_link */
}
#endif

uint3 thread_index(unsigned t, dim3 b) {
    return uint3{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
}

/* Run one block with its threads as fibers; returns whether any reached __syncthreads. */
bool run_block_fibers(dim3 block, const char *site) {
    const unsigned T = block.x * block.y * block.z;
    while (g_stacks.size() < T) {
        void *m = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            fprintf(stderr, "cuda_emu: cannot map a fiber stack\n");
            abort();
        }
        g_stacks.push_back((char *)m);
    }
    if (g_fibers.size() < T) g_fibers.resize(T);
    for (unsigned t = 0; t < T; t++) {
        Fiber &f = g_fibers[t];
        f.state = F_RUN;
        f.tid = thread_index(t, block);
#if CT_EMU_FAST_SWITCH
        fiber_start(f, g_stacks[t]);
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks[t];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &t_sched;
        makecontext(&f.ctx, trampoline, 0);
#endif
    }
    bool barrier = false;
    for (;;) {
        for (unsigned t = 0; t < T; t++) {
            Fiber &f = g_fibers[t];
            if (f.state != F_RUN) continue;
            t_cur = &f;
            ct_emu_threadIdx = f.tid;
#if CT_EMU_FAST_SWITCH
            ct_emu_switch(&t_sched_sp, f.sp);
#else
            swapcontext(&t_sched, &f.ctx);
#endif
        }
        unsigned done = 0, waiting = 0;
        for (unsigned t = 0; t < T; t++) {
            done += g_fibers[t].state == F_DONE;
            waiting += g_fibers[t].state == F_BARRIER;
        }
        if (done == T) break;
        if (done != 0) {
            fprintf(stderr,
                    "cuda_emu: kernel launched at %s: in block (%u,%u,%u), %u threads wait at "
                    "__syncthreads while %u have exited (divergent barrier)\n",
                    site, ct_emu_blockIdx.x, ct_emu_blockIdx.y, ct_emu_blockIdx.z, waiting, done);
            abort();
        }
        barrier = true;
        for (unsigned t = 0; t < T; t++) g_fibers[t].state = F_RUN;
    }
    t_cur = nullptr;
    return barrier;
}
}  // namespace

void ct_emu_syncthreads(void) {
    if (t_in_fibers) {
        t_cur->state = F_BARRIER;
#if CT_EMU_FAST_SWITCH
        ct_emu_switch(&t_cur->sp, t_sched_sp);
#else
        swapcontext(&t_cur->ctx, &t_sched);
#endif
        return;
    }
    if (t_block_threads <= 1) return;
    fprintf(stderr,
            "cuda_emu: the kernel launched at %s reached __syncthreads, but "
            "tests/cuda_emu/rewrite_launches.py found no path from it to a barrier (a call it "
            "cannot follow), so its threads ran without fibers; rerun with CT_EMU_FIBERS=1\n",
            t_site ? t_site : "?");
    abort();
}

namespace {
std::map<const char *, long long> g_site_launches; /* launches per site (string literal) */

/* Run a kernel (under g_mu: one at a time, so the static __shared__ arrays are its own). */
void run_kernel(const std::function<void()> &body, int *site_mode, const char *site, dim3 grid,
                dim3 block) {
    const unsigned T = block.x * block.y * block.z;
    ct_emu_gridDim = grid;
    ct_emu_blockDim = block;
    t_site = site;
    t_block_threads = T;
    const bool fibers = g_always_fibers || *site_mode != 1;
    bool barrier = false;
    g_body = &body;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                ct_emu_blockIdx = uint3{bx, by, bz};
                if (fibers) {
                    t_in_fibers = true;
                    barrier |= run_block_fibers(block, site);
                    t_in_fibers = false;
                } else {
                    for (unsigned t = 0; t < T; t++) {
                        ct_emu_threadIdx = thread_index(t, block);
                        body();
                    }
                }
            }
    g_body = nullptr;
    if (fibers && *site_mode != 2) *site_mode = barrier ? 2 : 1;
}
}  // namespace

void ct_emu_enqueue_kernel(std::function<void()> body, int *site_mode, const char *site,
                           dim3 grid, dim3 block, size_t shmem, cudaStream_t s) {
    Locked l;
    const unsigned long long T = (unsigned long long)block.x * block.y * block.z;
    if (block.x == 0 || block.y == 0 || block.z == 0 || T > 1024 || block.z > 64 ||
        grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535 || shmem > 48 * 1024) {
        violation(cudaErrorInvalidConfiguration,
                  "launch at %s: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of dynamic "
                  "shared memory", site, grid.x, grid.y, grid.z, block.x, block.y, block.z, shmem);
        return;
    }
    if (s != nullptr && s->dev != t_dev) {
        violation(cudaErrorInvalidResourceHandle,
                  "launch at %s into a stream of GPU %d while GPU %d is current", site, s->dev,
                  t_dev);
        return;
    }
    auto b = std::make_shared<std::function<void()>>(std::move(body));
    g_site_launches[site]++;
    t_kind = site;
    enqueue(s, [b, site_mode, site, grid, block] { run_kernel(*b, site_mode, site, grid, block); });
}

/* Kernel launches so far from launch sites whose "file:line" contains `part` (tests: "one
 * launch per device and step"). */
extern "C" __attribute__((visibility("default"))) long long cuda_emu_launches(const char *part) {
    Locked l;
    long long n = 0;
    for (const auto &kv : g_site_launches)
        if (part == nullptr || strstr(kv.first, part) != nullptr) n += kv.second;
    return n;
}

/* --- cuBLAS ------------------------------------------------------------------------------------- */

struct cublasContext {
    int dev;
    cudaStream_t stream;
};

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new cublasContext{t_dev, nullptr};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (s != nullptr && s->dev != h->dev) {
        violation(cudaErrorInvalidResourceHandle,
                  "cublasSetStream: a stream of GPU %d for a handle of GPU %d", s->dev, h->dev);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

/* C (m x n, ldc) = alpha op(A) op(B) + beta C, column-major; op(A) is m x k, op(B) k x n;
 * every element of A and B rounded by ct_prec_round(x, drop) first (drop 0: float32). */
static cublasStatus_t gemm_emu(const char *fn, cublasHandle_t h, cublasOperation_t ta,
                               cublasOperation_t tb, int m, int n, int k, const float *alpha,
                               const float *a, int lda, const float *b, int ldb,
                               const float *beta, float *c, int ldc, int drop) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (h->dev != t_dev) {
        violation(cudaErrorInvalidResourceHandle,
                  "%s with a handle of GPU %d while GPU %d is current", fn, h->dev, t_dev);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    const int arows = ta == CUBLAS_OP_N ? m : k, acols = ta == CUBLAS_OP_N ? k : m;
    const int brows = tb == CUBLAS_OP_N ? k : n, bcols = tb == CUBLAS_OP_N ? n : k;
    if (m < 0 || n < 0 || k < 0 || lda < (arows > 1 ? arows : 1) ||
        ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    {
        Locked l;
        const size_t fa = k ? (size_t)lda * (acols - 1) + arows : 0;
        const size_t fb = k ? (size_t)ldb * (bcols - 1) + brows : 0;
        const size_t fc = (size_t)ldc * (n - 1) + m;
        if ((fa && need_device_locked(a, fa * 4, -1, fn, "A")) ||
            (fb && need_device_locked(b, fb * 4, -1, fn, "B")) ||
            need_device_locked(c, fc * 4, -1, fn, "C"))
            return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    const float al = *alpha, be = *beta; /* host scalars: read at the call */
    Locked l;
    t_kind = "cublas";
    t_note = {a, b, c};
    enqueue(h->stream, [=] {
        std::vector<float> out((size_t)m * n);
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double acc = 0.0;
                for (int p = 0; p < k; p++) {
                    const float av = ta == CUBLAS_OP_N ? a[i + (size_t)p * lda] : a[p + (size_t)i * lda];
                    const float bv = tb == CUBLAS_OP_N ? b[p + (size_t)j * ldb] : b[j + (size_t)p * ldb];
                    acc += (double)ct_prec_round(av, drop) * ct_prec_round(bv, drop);
                }
                float r = al * (float)acc;
                if (be != 0.0f) r += be * c[i + (size_t)j * ldc];
                out[(size_t)j * m + i] = r;
            }
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) c[i + (size_t)j * ldc] = out[(size_t)j * m + i];
    });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc) {
    return gemm_emu("cublasSgemm", h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 0);
}

/* Only what the backend asks for: float32 A, B, C and scalars, compute type 32F (exact
 * float32 inputs) or 32F_FAST_TF32 / 32F_FAST_16BF (inputs rounded, ct_prec_math.h). Any
 * other combination is refused (cuBLAS supports more; the backend must not need it here). */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *a, cudaDataType_t atype,
                            int lda, const void *b, cudaDataType_t btype, int ldb,
                            const void *beta, void *c, cudaDataType_t ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    if (atype != CUDA_R_32F || btype != CUDA_R_32F || ctype != CUDA_R_32F) {
        fprintf(stderr, "cuda_emu: cublasGemmEx: only CUDA_R_32F operands are emulated (got %d %d %d)\n",
                (int)atype, (int)btype, (int)ctype);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (algo != CUBLAS_GEMM_DEFAULT) return CUBLAS_STATUS_NOT_SUPPORTED;
    int drop;
    switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC: drop = 0; break;
    case CUBLAS_COMPUTE_32F_FAST_TF32: drop = ct_prec_drop_bits(CT_PREC_TF32); break;
    case CUBLAS_COMPUTE_32F_FAST_16BF: drop = ct_prec_drop_bits(CT_PREC_BF16); break;
    default:
        fprintf(stderr, "cuda_emu: cublasGemmEx: compute type %d is not emulated\n", (int)compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return gemm_emu("cublasGemmEx", h, ta, tb, m, n, k, (const float *)alpha, (const float *)a,
                    lda, (const float *)b, ldb, (const float *)beta, (float *)c, ldc, drop);
}

/* --- NCCL (the calls csrc/backend/cuda/cuda_nccl.cu makes, found with dlsym) -------------------
 * Rules checked: one rank per GPU in a communicator (NCCL: "Duplicate GPU detected"), ranks
 * driven from one thread grouped between ncclGroupStart/End, every rank of the communicator
 * taking part in each collective with the same count, type and operation, the stream and the
 * buffers on the rank's GPU. A collective runs when the first of its ranks' streams reaches
 * it, after everything queued before it on every rank's stream.
 *
 * Across processes (ncclGetUniqueId, ncclCommInitRank): the unique id is 128 random bytes and
 * names a POSIX shared memory object (/ct_emu_nccl_<hex>) in which the ranks of every process
 * meet: a header (ranks joined, each rank's GPU identity, collectives' arrival and departure
 * counts, each rank's count and operation) and one slot per rank. A collective copies each of
 * the process's ranks' send buffers into their slots, waits (spinning with sched_yield) until
 * every rank has arrived, reduces the slots in rank order into each receive buffer and
 * departs; the next collective writes its slots once every rank has departed the last one.
 * Large collectives run in slot-sized pieces. A wait longer than CT_EMU_NCCL_TIMEOUT seconds
 * (default 60) aborts the process with what it waited for. A GPU's identity is its ordinal
 * plus CT_EMU_GPU_ID_BASE (0 by default; a test launching several processes gives each its
 * own): two ranks of one communicator on one identity fail the init ("Duplicate GPU").
 */

typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclInvalidArgument = 4, ncclInvalidUsage = 5 };

namespace {
struct ShmComm;
struct Coll {
    size_t count;
    int dtype, op;
    std::vector<const void *> send;
    std::vector<void *> recv;
    std::vector<CUstream_st *> streams;
    std::vector<unsigned long long> seqs;
    int posted = 0;
    bool done = false;
    std::shared_ptr<ShmComm> shm; /* across processes (the group's) */
    std::vector<int> granks;
};
struct CommGroup {
    std::shared_ptr<ShmComm> shm; /* across processes: the shared memory; the ranks below are
                                     this process's (granks: their ranks in the communicator) */
    std::vector<int> granks;
    std::vector<int> devs;
    std::vector<unsigned long long> issued; /* collectives posted per rank */
    std::map<unsigned long long, std::shared_ptr<Coll>> open;
};
thread_local int t_nccl_depth = 0;
thread_local std::vector<std::shared_ptr<Coll>> t_nccl_pending;
std::atomic<long long> n_comm_init{0}, n_collectives{0};

ncclResult_t nccl_violation(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t nccl_violation(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda_emu: NCCL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return r;
}

/* --- across processes ---------------------------------------------------------------------- */
enum { SHM_MAX_RANKS = 64, SHM_SLOT_FLOATS = 1 << 16 };
struct ShmHdr {                      /* zero-filled when the object is created */
    long long joined;                /* ranks that called ncclCommInitRank */
    long long arrived, departed;     /* rank-collectives begun / finished, over all collectives */
    long long ident[SHM_MAX_RANKS];  /* each rank's GPU identity + 1 (0: not joined) */
    long long count[SHM_MAX_RANKS], op[SHM_MAX_RANKS]; /* each rank's current piece */
};
struct ShmComm {
    std::string name;
    int nranks = 0;
    void *base = nullptr;
    size_t size = 0;
    long long rounds = 0; /* pieces this process has run (the same in every process) */
    ShmHdr *hdr() const { return (ShmHdr *)base; }
    float *slot(int r) const { return (float *)((char *)base + 4096) + (size_t)r * SHM_SLOT_FLOATS; }
    ~ShmComm() {
        if (base != nullptr) munmap(base, size);
    }
};
std::map<std::string, std::shared_ptr<ShmComm>> g_shm;        /* this process's, by name */
std::map<std::string, std::shared_ptr<CommGroup>> g_shm_groups; /* their local ranks */
thread_local std::vector<std::pair<std::shared_ptr<ShmComm>, int>> t_pending_inits;
std::atomic<long long> n_proc_comm_init{0}, n_proc_collectives{0};

long long shm_load(const long long *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Spin until *p >= want, or abort after CT_EMU_NCCL_TIMEOUT seconds saying what was awaited. */
void shm_wait(const ShmComm *sc, const long long *p, long long want, const char *what) {
    if (shm_load(p) >= want) return;
    const char *e = getenv("CT_EMU_NCCL_TIMEOUT");
    const double limit = e && atof(e) > 0 ? atof(e) : 60.0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned long spins = 1; shm_load(p) < want; spins++) {
        sched_yield();
        if (spins % 1024 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            const double waited = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            if (waited > limit) {
                fprintf(stderr, "cuda_emu: NCCL across processes (%s, %d ranks): waited %.0f s "
                        "for %s (%lld of %lld): a process did not take part; aborting (raise "
                        "CT_EMU_NCCL_TIMEOUT to wait longer)\n", sc->name.c_str(), sc->nranks,
                        waited, what, shm_load(p), want);
                abort();
            }
        }
    }
}

/* Every rank has joined: check one rank per GPU identity. */
ncclResult_t nccl_violation(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t shm_joined(ShmComm *sc) {
    shm_wait(sc, &sc->hdr()->joined, sc->nranks, "every rank to call ncclCommInitRank");
    shm_unlink(sc->name.c_str()); /* every rank has it mapped (a second unlink fails: fine) */
    const long long *id = sc->hdr()->ident;
    for (int i = 0; i < sc->nranks; i++)
        for (int j = i + 1; j < sc->nranks; j++)
            if (id[i] == id[j])
                return nccl_violation(5, "ncclCommInitRank: Duplicate GPU detected: ranks %d and "
                                      "%d on one GPU (emulated identity %lld; give each process its "
                                      "own CT_EMU_GPU_ID_BASE)", i, j, id[i] - 1);
    return 0;
}

/* One collective of this process's ranks of c (in place allowed), piece by piece. */
void shm_perform(Coll *c) {
    ShmComm *sc = c->shm.get();
    ShmHdr *h = sc->hdr();
    const long long nr = sc->nranks, nl = (long long)c->granks.size();
    std::vector<float> acc;
    for (size_t off = 0; off < c->count || (off == 0 && c->count == 0); off += SHM_SLOT_FLOATS) {
        const size_t n = std::min((size_t)SHM_SLOT_FLOATS, c->count - off);
        const long long k = ++sc->rounds;
        shm_wait(sc, &h->departed, nr * (k - 1), "the ranks to finish the last collective");
        for (long long l = 0; l < nl; l++) {
            const int g = c->granks[(size_t)l];
            memcpy(sc->slot(g), (const float *)c->send[(size_t)l] + off, n * 4);
            h->count[g] = (long long)c->count;
            h->op[g] = c->op;
        }
        __atomic_add_fetch(&h->arrived, nl, __ATOMIC_ACQ_REL);
        shm_wait(sc, &h->arrived, nr * k, "the other ranks to post this collective");
        for (int g = 1; g < nr; g++)
            if (h->count[g] != h->count[0] || h->op[g] != h->op[0]) {
                fprintf(stderr, "cuda_emu: NCCL across processes: rank %d posts count %lld op %lld "
                        "where rank 0 posted count %lld op %lld: NCCL would hang or corrupt; "
                        "aborting\n", g, h->count[g], h->op[g], h->count[0], h->op[0]);
                abort();
            }
        acc.assign(sc->slot(0), sc->slot(0) + n);
        for (int g = 1; g < nr; g++) {
            const float *x = sc->slot(g);
            for (size_t i = 0; i < n; i++)
                acc[i] = c->op == 0 ? acc[i] + x[i] : ((acc[i] > x[i] || acc[i] != acc[i]) ? acc[i] : x[i]);
        }
        __atomic_add_fetch(&h->departed, nl, __ATOMIC_ACQ_REL);
        for (long long l = 0; l < nl; l++)
            if (n > 0) memcpy((float *)c->recv[(size_t)l] + off, acc.data(), n * 4);
        if (c->count == 0) break;
    }
    n_proc_collectives++;
}

void perform(Coll *c) {
    if (c->done) return;
    for (size_t r = 0; r < c->streams.size(); r++) run_until(c->streams[r], c->seqs[r] - 1);
    if (c->shm) {
        shm_perform(c);
        c->done = true;
        return;
    }
    std::vector<float> sum(c->count);
    for (size_t i = 0; i < c->count; i++) {
        float acc = ((const float *)c->send[0])[i];
        for (size_t r = 1; r < c->send.size(); r++) {
            const float x = ((const float *)c->send[r])[i];
            acc = c->op == 0 ? acc + x : ((acc > x || acc != acc) ? acc : x); /* ncclSum, ncclMax */
        }
        sum[i] = acc;
    }
    for (size_t r = 0; r < c->recv.size(); r++) memcpy(c->recv[r], sum.data(), c->count * 4);
    c->done = true;
    n_collectives++;
}

/* Queue the ranks' parts of complete collectives (at ncclGroupEnd). */
ncclResult_t launch_pending() {
    std::vector<std::shared_ptr<Coll>> colls;
    colls.swap(t_nccl_pending);
    for (auto &c : colls)
        if (c->posted != (int)c->streams.size())
            return nccl_violation(ncclInvalidUsage,
                                  "a collective with %d of its %zu ranks posted at ncclGroupEnd: "
                                  "NCCL would hang", c->posted, c->streams.size());
    for (auto &c : colls)
        for (size_t r = 0; r < c->streams.size(); r++) {
            Coll *raw = c.get();
            enqueue(c->streams[r], [c, raw] { perform(raw); }, false);
            c->seqs[r] = c->streams[r]->issued;
        }
    if (g_eager)
        for (auto &c : colls)
            for (CUstream_st *st : c->streams) flush(st);
    return ncclSuccess;
}
}  // namespace

struct ncclComm {
    int rank, dev;
    std::shared_ptr<CommGroup> group;
};

extern "C" __attribute__((visibility("default"))) const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    }
    return "unknown result code";
}

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclGetVersion(int *version) {
    *version = 22800; /* reports itself as 2.28.0 */
    return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t
ncclCommInitAll(ncclComm **comms, int ndev, const int *devlist) {
    Locked l;
    if (comms == nullptr || ndev < 1) return nccl_violation(ncclInvalidArgument, "ncclCommInitAll: %d devices", ndev);
    auto g = std::make_shared<CommGroup>();
    for (int i = 0; i < ndev; i++) {
        const int d = devlist ? devlist[i] : i;
        if (d < 0 || d >= g_ngpu)
            return nccl_violation(ncclInvalidArgument, "ncclCommInitAll: no GPU %d", d);
        for (int p : g->devs)
            if (p == d)
                return nccl_violation(ncclInvalidUsage, "ncclCommInitAll: Duplicate GPU detected: "
                                      "two ranks on GPU %d", d);
        g->devs.push_back(d);
    }
    g->issued.assign((size_t)ndev, 0);
    for (int i = 0; i < ndev; i++) comms[i] = new ncclComm{i, g->devs[(size_t)i], g};
    n_comm_init++;
    return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclCommDestroy(ncclComm *comm) {
    delete comm;
    return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclCommAbort(ncclComm *comm) {
    delete comm;
    return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclGroupStart(void) {
    t_nccl_depth++;
    return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclGroupEnd(void) {
    Locked l;
    if (t_nccl_depth == 0) return nccl_violation(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_nccl_depth > 0) return ncclSuccess;
    std::vector<std::pair<std::shared_ptr<ShmComm>, int>> inits;
    inits.swap(t_pending_inits);
    for (auto &pi : inits)
        if (ncclResult_t r = shm_joined(pi.first.get())) return r;
    return launch_pending();
}

typedef struct {
    char internal[128];
} ncclUniqueId;

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (id == nullptr) return nccl_violation(ncclInvalidArgument, "ncclGetUniqueId: null id");
    size_t got = 0;
    while (got < sizeof id->internal) {
        ssize_t r = getrandom(id->internal + got, sizeof id->internal - got, 0);
        if (r <= 0) return nccl_violation(ncclInvalidUsage, "ncclGetUniqueId: getrandom failed");
        got += (size_t)r;
    }
    return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t
ncclCommInitRank(ncclComm **comm, int nranks, ncclUniqueId id, int rank) {
    Locked l;
    if (comm == nullptr || nranks < 1 || nranks > SHM_MAX_RANKS || rank < 0 || rank >= nranks)
        return nccl_violation(ncclInvalidArgument, "ncclCommInitRank: rank %d of %d ranks (at most "
                              "%d emulated)", rank, nranks, (int)SHM_MAX_RANKS);
    if (t_dev < 0 || t_dev >= g_ngpu)
        return nccl_violation(ncclInvalidArgument, "ncclCommInitRank: no GPU %d", t_dev);
    char name[64];
    int len = snprintf(name, sizeof name, "/ct_emu_nccl_");
    for (int i = 0; i < 16; i++)
        len += snprintf(name + len, sizeof name - (size_t)len, "%02x", (unsigned char)id.internal[i]);
    std::shared_ptr<ShmComm> &sc = g_shm[name];
    if (!sc) {
        auto made = std::make_shared<ShmComm>();
        made->name = name;
        made->nranks = nranks;
        made->size = 4096 + (size_t)nranks * SHM_SLOT_FLOATS * 4;
        static_assert(sizeof(ShmHdr) <= 4096, "the header fits its page");
        int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)made->size) != 0) {
            if (fd >= 0) close(fd);
            g_shm.erase(name);
            return nccl_violation(ncclInvalidUsage, "ncclCommInitRank: shared memory %s: %s", name,
                                  strerror(errno));
        }
        made->base = mmap(nullptr, made->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (made->base == MAP_FAILED) {
            made->base = nullptr;
            g_shm.erase(name);
            return nccl_violation(ncclInvalidUsage, "ncclCommInitRank: mmap of %s failed", name);
        }
        sc = made;
    } else if (sc->nranks != nranks) {
        return nccl_violation(ncclInvalidArgument, "ncclCommInitRank: %d ranks where another rank "
                              "of this process said %d", nranks, sc->nranks);
    }
    ShmHdr *h = sc->hdr();
    const char *e = getenv("CT_EMU_GPU_ID_BASE");
    const long long ident = (e ? atoll(e) : 0) + t_dev;
    long long none = 0;
    if (!__atomic_compare_exchange_n(&h->ident[rank], &none, ident + 1, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return nccl_violation(ncclInvalidUsage, "ncclCommInitRank: rank %d joined twice", rank);
    std::shared_ptr<CommGroup> &g = g_shm_groups[name];
    if (!g) {
        g = std::make_shared<CommGroup>();
        g->shm = sc;
    }
    g->devs.push_back(t_dev);
    g->granks.push_back(rank);
    g->issued.push_back(0);
    *comm = new ncclComm{(int)g->devs.size() - 1, t_dev, g};
    __atomic_add_fetch(&h->joined, 1, __ATOMIC_ACQ_REL);
    n_proc_comm_init++;
    if (t_nccl_depth > 0) {
        t_pending_inits.emplace_back(sc, rank);
        return ncclSuccess;
    }
    return shm_joined(sc.get());
}

extern "C" __attribute__((visibility("default"))) ncclResult_t
ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, ncclComm *comm,
              cudaStream_t stream) {
    Locked l;
    if (comm == nullptr) return nccl_violation(ncclInvalidArgument, "ncclAllReduce: null communicator");
    const size_t nranks = comm->group->devs.size();
    if (dtype != 7 || (op != 0 && op != 2))
        return nccl_violation(ncclInvalidArgument, "ncclAllReduce: only float32 sums and maxima "
                              "are emulated");
    if (stream == nullptr || stream->dev != comm->dev)
        return nccl_violation(ncclInvalidArgument, "ncclAllReduce: rank %d (GPU %d) given a stream "
                              "of GPU %d", comm->rank, comm->dev, stream ? stream->dev : t_dev);
    if (stream->capture != nullptr) {
        stream->capture_bad = true;
        return nccl_violation(ncclInvalidUsage, "ncclAllReduce on a capturing stream: not "
                              "emulated (the backend captures no collective)");
    }
    if (count > 0 && (need_device_locked(send, count * 4, comm->dev, "ncclAllReduce", "send buffer") ||
                      need_device_locked(recv, count * 4, comm->dev, "ncclAllReduce", "receive buffer"))) {
        t_err = cudaSuccess;
        return ncclInvalidArgument;
    }
    if (t_nccl_depth == 0 && nranks > 1)
        return nccl_violation(ncclInvalidUsage, "ncclAllReduce outside ncclGroupStart/End for a "
                              "communicator of %zu ranks driven from one thread: NCCL would hang",
                              nranks);
    const unsigned long long k = comm->group->issued[(size_t)comm->rank]++;
    std::shared_ptr<Coll> &c = comm->group->open[k];
    if (!c) {
        c = std::make_shared<Coll>();
        c->count = count;
        c->dtype = dtype;
        c->op = op;
        c->send.assign(nranks, nullptr);
        c->recv.assign(nranks, nullptr);
        c->streams.assign(nranks, nullptr);
        c->seqs.assign(nranks, 0);
        c->shm = comm->group->shm;
        c->granks = comm->group->granks;
        t_nccl_pending.push_back(c);
    } else if (c->count != count || c->dtype != dtype || c->op != op) {
        return nccl_violation(ncclInvalidUsage, "ncclAllReduce: rank %d posts count %zu where rank "
                              "0 posted %zu", comm->rank, count, c->count);
    }
    c->send[(size_t)comm->rank] = send;
    c->recv[(size_t)comm->rank] = recv;
    c->streams[(size_t)comm->rank] = stream;
    if (++c->posted == (int)nranks) comm->group->open.erase(k);
    if (t_nccl_depth == 0) return launch_pending();
    return ncclSuccess;
}

/* (communicators created, collectives run) */
extern "C" __attribute__((visibility("default"))) void cuda_emu_nccl_stats(long long *out) {
    out[0] = n_comm_init.load();
    out[1] = n_collectives.load();
}

/* (communicator ranks made with ncclCommInitRank, collectives run across processes) */
extern "C" __attribute__((visibility("default"))) void cuda_emu_nccl_proc_stats(long long *out) {
    out[0] = n_proc_comm_init.load();
    out[1] = n_proc_collectives.load();
}

/* --- what a test may ask ------------------------------------------------------------------------ */

/* (host synchronisations, host->device copies from pageable memory, device->host copies to
 * pageable memory), read by tests/gpu/test_gpu.py through ctypes, like the mock backend's. */
extern "C" __attribute__((visibility("default"))) void mock_gpu_stats(long long *out) {
    out[0] = n_sync.load();
    out[1] = n_h2d.load();
    out[2] = n_d2h.load();
}
