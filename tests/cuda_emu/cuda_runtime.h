/*
 * cuda_runtime.h (emulation) — the part of the CUDA runtime API that
 * csrc/backend/cuda uses, implemented on the host by cuda_emu.cpp, so that the
 * backend's real .cu sources compile with a host C++ compiler and their kernels
 * run on a CPU (tools/cuda_emu.sh). Not a general CUDA emulator: only what the
 * backend calls exists, and every call checks the rules a GPU would enforce
 * (launch configuration limits, a kernel launched into a stream of the current
 * device, event and stream on the same device, copy kinds that match where the
 * pointers live, frees of live allocations, __syncthreads reached by every
 * thread of a block).
 *
 * Execution model: each stream is a queue. By default (CT_EMU_SCHEDULE=lazy)
 * an operation runs only when something needs it: a host synchronisation, a
 * blocking copy, a stream waiting on an event recorded after it. That is the
 * latest schedule a GPU may legally choose, so a missing wait (the host reading
 * pinned memory a kernel has not written yet, one stream reading another's
 * buffer before its event) reads stale data and fails the test.
 * CT_EMU_SCHEDULE=eager runs every operation when it is issued (the earliest).
 * A kernel's blocks run one after another; a block's threads run as fibers
 * and switch at __syncthreads, so __shared__ arrays (static storage here) are
 * shared by the threads of the running block.
 */
#ifndef CT_CUDA_EMU_RUNTIME_H
#define CT_CUDA_EMU_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

/* --- qualifiers ------------------------------------------------------------------- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__
#define __launch_bounds__(...)
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif

/* --- vector types ------------------------------------------------------------------- */
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }

/* --- the running thread (set by the block scheduler) ---------------------------------- */
extern thread_local uint3 ct_emu_threadIdx, ct_emu_blockIdx;
extern thread_local dim3 ct_emu_blockDim, ct_emu_gridDim;
#define threadIdx ct_emu_threadIdx
#define blockIdx ct_emu_blockIdx
#define blockDim ct_emu_blockDim
#define gridDim ct_emu_gridDim

void ct_emu_syncthreads(void);
#define __syncthreads() ct_emu_syncthreads()
static inline void __threadfence_system(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* --- device math and bit casts ---------------------------------------------------------- */
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

/* --- runtime types ------------------------------------------------------------------------ */
typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorPeerAccessAlreadyEnabled = 704,
    cudaErrorPeerAccessNotEnabled = 705,
    cudaErrorLaunchFailure = 719,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorGraphExecUpdateFailure = 910,
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;

typedef enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 } cudaDeviceAttr;
typedef enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 } cudaMemPoolAttr;
typedef enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1 } cudaMemLocationType;
typedef enum cudaMemAccessFlags {
    cudaMemAccessFlagsProtNone = 0,
    cudaMemAccessFlagsProtRead = 1,
    cudaMemAccessFlagsProtReadWrite = 3,
} cudaMemAccessFlags;
struct cudaMemLocation { cudaMemLocationType type; int id; };
struct cudaMemAccessDesc { cudaMemLocation location; cudaMemAccessFlags flags; };

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUmemPoolHandle_st *cudaMemPool_t;
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
} cudaStreamCaptureMode;
typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2,
} cudaStreamCaptureStatus;
typedef enum cudaGraphExecUpdateResult {
    cudaGraphExecUpdateSuccess = 0,
    cudaGraphExecUpdateError = 1,
    cudaGraphExecUpdateErrorTopologyChanged = 2,
} cudaGraphExecUpdateResult;
typedef struct cudaGraphExecUpdateResultInfo_st {
    cudaGraphExecUpdateResult result;
    void *errorNode, *errorFromNode;
} cudaGraphExecUpdateResultInfo;

#define cudaEventDefault 0x00u
#define cudaEventDisableTiming 0x02u
#define cudaHostAllocDefault 0x00u
#define cudaHostAllocPortable 0x01u
#define cudaHostAllocMapped 0x02u

/* --- runtime API ---------------------------------------------------------------------------- */
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaHostGetDevicePointer(void **dev_ptr, void *host_ptr, unsigned flags);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int dev);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool, const cudaMemAccessDesc *desc, size_t n);

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s = 0);
cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev, size_t n,
                                cudaStream_t s = 0);
cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s = 0);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned flags = 0);
cudaError_t cudaEventCreate(cudaEvent_t *ev);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t ev);
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t ev);
cudaError_t cudaEventQuery(cudaEvent_t ev);

/* Stream capture and graphs. Work queued on a capturing stream becomes the graph's nodes, in
 * order (one chain: the backend captures one stream at a time); a launch queues them again
 * with the arguments of the capture. While this thread captures, the calls CUDA forbids
 * during a capture in cudaStreamCaptureModeThreadLocal (synchronisations, cudaMalloc/Free,
 * synchronous copies, work on the legacy stream) fail and invalidate it; what CUDA allows but
 * this emulation does not model (events, memory nodes from cudaMallocAsync / cudaFreeAsync,
 * NCCL) fails too. A launched node whose pointer arguments were device memory at the capture
 * checks, when it runs, that they still are: a graph replaying freed memory aborts the run. */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo *info);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

/* CTAs of a kernel resident per SM: the emulation says 2 (CT_EMU_SMS SMs, default 4), so a
 * launch sized to "what the GPU holds" has few CTAs, each looping over many work items. */
template <typename F>
static inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *n, F, int block,
                                                                        size_t shmem) {
    (void)shmem;
    if (n == nullptr || block <= 0 || block > 1024) return cudaErrorInvalidValue;
    *n = 2;
    return cudaSuccess;
}

/* --- kernel launch ---------------------------------------------------------------------------
 * tests/cuda_emu/rewrite_launches.py turns `kern<<<g, b, shmem, stream>>>(args);` into
 *   { auto ct_emu_k_ = ct_emu_bind([](auto... a) { kern(a...); }, args);
 *     ct_emu_launch_fibers(ct_emu_k_, g, b, shmem, stream); }   (or _plain, see below)
 * The arguments are evaluated and copied at the launch, as CUDA does; the kernel runs when
 * its stream gets to it. */
void ct_emu_enqueue_kernel(std::function<void()> body, int *site_mode, const char *site,
                           dim3 grid, dim3 block, size_t shmem, cudaStream_t s);

/* The launch's pointer arguments, noted for a capture (checked when a graph replays it). */
void ct_emu_note_begin(void);
void ct_emu_note_arg(const void *p);
template <typename T>
static inline void ct_emu_note(const T &v) {
    if constexpr (std::is_pointer<T>::value) ct_emu_note_arg((const void *)v);
}

template <typename G, typename... A>
static inline auto ct_emu_bind(G g, A... a) {
    ct_emu_note_begin();
    (ct_emu_note(a), ...);
    return [g, t = std::make_tuple(a...)]() { std::apply(g, t); };
}

template <typename F>
static inline void ct_emu_launch_at(const char *site, int *site_mode, F f, dim3 grid, dim3 block,
                                    size_t shmem = 0, cudaStream_t s = 0) {
    ct_emu_enqueue_kernel(std::function<void()>(std::move(f)), site_mode, site, grid, block,
                          shmem, s);
}
/* A launch site's mode: 2, its threads run as fibers (the kernel may reach __syncthreads:
 * rewrite_launches.py decides from the source); 1, one after another (a barrier reached then
 * aborts the run: the source analysis missed it). */
#define ct_emu_launch_mode(mode, f, ...)                                                  \
    do {                                                                                  \
        static int ct_emu_site_mode_ = (mode);                                            \
        ct_emu_launch_at(__FILE__ ":" CT_EMU_STR(__LINE__), &ct_emu_site_mode_, f,        \
                         __VA_ARGS__);                                                    \
    } while (0)
#define ct_emu_launch_fibers(f, ...) ct_emu_launch_mode(2, f, __VA_ARGS__)
#define ct_emu_launch_plain(f, ...) ct_emu_launch_mode(1, f, __VA_ARGS__)
#define CT_EMU_STR2(x) #x
#define CT_EMU_STR(x) CT_EMU_STR2(x)

#endif /* CT_CUDA_EMU_RUNTIME_H */
