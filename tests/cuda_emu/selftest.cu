// selftest.cu — checks of the CUDA emulation itself (tests/cuda_emu), written in CUDA
// syntax and built by tools/cuda_emu.sh through the same launch rewrite as the backend.
// Each check fails the run with its name; run with CT_EMU_NGPU=2.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures = 0;
#define EXPECT(cond)                                                            \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "selftest.cu:%d: FAILED: %s\n", __LINE__, #cond);   \
            failures++;                                                         \
        }                                                                       \
    } while (0)

// A block's sum through shared memory: every thread takes part in every barrier.
__global__ void block_sum(const float *x, float *out) {
    __shared__ float buf[256];
    buf[threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) buf[threadIdx.x] += buf[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = buf[0];
}

// Every (block, thread) coordinate of a 3-d launch, written once.
__global__ void coords(int *out) {
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    out[b * blockDim.x * blockDim.y * blockDim.z + t] += 1 + b * 1000 + t;
}

__global__ void fill(float *x, int n, float v) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = v;
}

// Thread 0 leaves before the barrier the others wait at: undefined on a GPU.
__global__ void divergent(float *x) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    x[threadIdx.x] = 1.0f;
}

// Reaches __syncthreads only when asked: the launch site still runs its threads as fibers
// (rewrite_launches.py sees the barrier in the source), whatever the first launch did.
__global__ void maybe_barrier(int use, float *x) {
    if (use) __syncthreads();
    x[threadIdx.x] = 2.0f;
}

static void launch_maybe(int use, float *x) { maybe_barrier<<<1, 32>>>(use, x); }

// One launch site (the emulation tells a graph's kernels apart by their launch sites).
static void launch_fill(cudaStream_t s, float *x, float v) { fill<<<1, 32, 0, s>>>(x, 64, v); }

// A barrier two calls down: found through the call graph.
__device__ void sync_inner() { __syncthreads(); }
__device__ void sync_outer(float *x) {
    x[threadIdx.x] = (float)threadIdx.x;
    sync_inner();
}
__global__ void reverse_through_helpers(float *x, float *y) {
    sync_outer(x);
    y[threadIdx.x] = x[blockDim.x - 1 - threadIdx.x]; // another thread's write: needs the barrier
}

// The same through templates whose parameter lists name `class` (not a type's header).
template <class T>
__device__ void sync_outer_t(T *x) {
    x[threadIdx.x] = (T)threadIdx.x;
    sync_inner();
}
template <class T, int N>
__global__ void reverse_templated(T *x, T *y) {
    sync_outer_t<T>(x);
    y[threadIdx.x] = x[N - 1 - threadIdx.x];
}

// Run fn in a child process; true if it died of SIGABRT (the emulator's verdict).
template <typename F>
static bool aborts(F fn) {
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        fn();
        cudaDeviceSynchronize();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

int main() {
    int n = 0;
    EXPECT(cudaGetDeviceCount(&n) == cudaSuccess && n == 2);
    EXPECT(cudaSetDevice(0) == cudaSuccess);

    // shared memory and barriers: 3 blocks of 256
    float hx[768], hs[3], *dx = nullptr, *ds = nullptr;
    for (int i = 0; i < 768; i++) hx[i] = (float)(i % 17);
    EXPECT(cudaMalloc((void **)&dx, sizeof hx) == cudaSuccess);
    EXPECT(cudaMalloc((void **)&ds, sizeof hs) == cudaSuccess);
    EXPECT(cudaMemcpy(dx, hx, sizeof hx, cudaMemcpyHostToDevice) == cudaSuccess);
    block_sum<<<3, 256>>>(dx, ds);
    EXPECT(cudaGetLastError() == cudaSuccess);
    EXPECT(cudaMemcpy(hs, ds, sizeof hs, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int b = 0; b < 3; b++) {
        float want = 0.0f;
        for (int i = 0; i < 256; i++) want += hx[b * 256 + i];
        EXPECT(hs[b] == want);
    }

    // 3-d grid and block coordinates
    const int nb = 4 * 2 * 3, nt = 8 * 4 * 2;
    int *dc = nullptr, hc[nb * nt];
    EXPECT(cudaMalloc((void **)&dc, sizeof hc) == cudaSuccess);
    EXPECT(cudaMemsetAsync(dc, 0, sizeof hc) == cudaSuccess);
    coords<<<dim3(4, 2, 3), dim3(8, 4, 2)>>>(dc);
    EXPECT(cudaMemcpy(hc, dc, sizeof hc, cudaMemcpyDeviceToHost) == cudaSuccess);
    int bad = 0;
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < nt; t++) bad += hc[b * nt + t] != 1 + b * 1000 + t;
    EXPECT(bad == 0);

    // launch limits: the kernel does not run, the error is the launch's
    hs[0] = -1.0f;
    EXPECT(cudaMemcpy(ds, hs, 4, cudaMemcpyHostToDevice) == cudaSuccess);
    block_sum<<<1, 2048>>>(dx, ds);
    EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration);
    EXPECT(cudaGetLastError() == cudaSuccess);
    block_sum<<<0, 256>>>(dx, ds);
    EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration);
    EXPECT(cudaMemcpy(hs, ds, 4, cudaMemcpyDeviceToHost) == cudaSuccess && hs[0] == -1.0f);

    // streams, events and devices
    cudaStream_t s1;
    cudaEvent_t e0;
    EXPECT(cudaEventCreate(&e0) == cudaSuccess);
    EXPECT(cudaSetDevice(1) == cudaSuccess);
    EXPECT(cudaStreamCreate(&s1) == cudaSuccess);
    EXPECT(cudaSetDevice(0) == cudaSuccess);
    block_sum<<<1, 256, 0, s1>>>(dx, ds); // a stream of GPU 1 while GPU 0 is current
    EXPECT(cudaGetLastError() == cudaErrorInvalidResourceHandle);
    EXPECT(cudaEventRecord(e0, s1) == cudaErrorInvalidResourceHandle);
    EXPECT(cudaStreamWaitEvent(s1, e0, 0) == cudaSuccess); // allowed across devices
    EXPECT(cudaSetDevice(2) == cudaErrorInvalidDevice);
    EXPECT(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
    EXPECT(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
    cudaGetLastError();

    // copies must match where the pointers live, and stay inside allocations
    EXPECT(cudaMemcpy(hx, hs, 4, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    EXPECT(cudaMemcpy(hx, dx, sizeof hx + 4, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
    EXPECT(cudaMemcpy(dx, ds, 4, cudaMemcpyDeviceToDevice) == cudaSuccess);
    EXPECT(cudaMemcpyPeerAsync(dx, 1, ds, 0, 4) == cudaErrorInvalidValue); // dx is on GPU 0
    EXPECT(cudaFree(hx) == cudaErrorInvalidValue);
    EXPECT(cudaFree(dx + 1) == cudaErrorInvalidValue);
    cudaGetLastError();

    // memory accounting and out of memory
    size_t free0 = 0, total = 0, free1 = 0;
    EXPECT(cudaMemGetInfo(&free0, &total) == cudaSuccess && free0 < total);
    void *big = nullptr;
    EXPECT(cudaMalloc(&big, total) == cudaErrorMemoryAllocation && big == nullptr);
    EXPECT(cudaGetLastError() == cudaErrorMemoryAllocation);
    EXPECT(cudaMalloc(&big, 1 << 20) == cudaSuccess);
    EXPECT(cudaMemGetInfo(&free1, &total) == cudaSuccess && free1 == free0 - (1 << 20));
    EXPECT(cudaFree(big) == cudaSuccess);
    EXPECT(cudaMemGetInfo(&free1, &total) == cudaSuccess && free1 == free0);

    // mapped pinned memory
    double *h = nullptr, *hd = nullptr, *hp = nullptr;
    EXPECT(cudaHostAlloc((void **)&h, 64, cudaHostAllocMapped) == cudaSuccess);
    EXPECT(cudaHostGetDevicePointer((void **)&hd, h, 0) == cudaSuccess && hd == h);
    EXPECT(cudaMallocHost((void **)&hp, 64) == cudaSuccess);
    EXPECT(cudaHostGetDevicePointer((void **)&hd, hp, 0) == cudaErrorInvalidValue);
    cudaGetLastError();

    // cuBLAS: C(2x3) = A(2x4) B(4x3), column-major, B given transposed; handle on its device
    float ha[8], hb[12], hcm[6], *da, *db, *dcm;
    for (int i = 0; i < 8; i++) ha[i] = (float)(i + 1);
    for (int i = 0; i < 12; i++) hb[i] = (float)(i % 5) - 2.0f;
    EXPECT(cudaMalloc((void **)&da, sizeof ha) == cudaSuccess);
    EXPECT(cudaMalloc((void **)&db, sizeof hb) == cudaSuccess);
    EXPECT(cudaMalloc((void **)&dcm, sizeof hcm) == cudaSuccess);
    cudaMemcpy(da, ha, sizeof ha, cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb, sizeof hb, cudaMemcpyHostToDevice);
    cublasHandle_t hb0;
    EXPECT(cublasCreate(&hb0) == CUBLAS_STATUS_SUCCESS);
    const float one = 1.0f, zero = 0.0f;
    // A: lda 2 (2x4); B^T stored as 3x4 (ldb 3), op T gives 4x3
    EXPECT(cublasSgemm(hb0, CUBLAS_OP_N, CUBLAS_OP_T, 2, 3, 4, &one, da, 2, db, 3, &zero, dcm, 2) ==
           CUBLAS_STATUS_SUCCESS);
    cudaMemcpy(hcm, dcm, sizeof hcm, cudaMemcpyDeviceToHost);
    bad = 0;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) {
            float want = 0.0f;
            for (int p = 0; p < 4; p++) want += ha[i + 2 * p] * hb[j + 3 * p];
            bad += hcm[i + 2 * j] != want;
        }
    EXPECT(bad == 0);
    EXPECT(cublasSgemm(hb0, CUBLAS_OP_N, CUBLAS_OP_T, 2, 3, 4, &one, da, 1, db, 3, &zero, dcm, 2) ==
           CUBLAS_STATUS_INVALID_VALUE); // lda < rows
    EXPECT(cublasSgemm(hb0, CUBLAS_OP_N, CUBLAS_OP_N, 2, 3, 4, &one, da, 2, db, 5, &zero, dcm, 2) ==
           CUBLAS_STATUS_EXECUTION_FAILED); // B read past its allocation
    EXPECT(cublasSetStream(hb0, s1) == CUBLAS_STATUS_INVALID_VALUE);
    EXPECT(cudaSetDevice(1) == cudaSuccess);
    EXPECT(cublasSgemm(hb0, CUBLAS_OP_N, CUBLAS_OP_T, 2, 3, 4, &one, da, 2, db, 3, &zero, dcm, 2) ==
           CUBLAS_STATUS_EXECUTION_FAILED); // a handle of GPU 0 while GPU 1 is current
    EXPECT(cudaSetDevice(0) == cudaSuccess);
    cudaGetLastError();

    // cublasGemmEx: the fast compute types round the float32 inputs (1 + 2^-12 is 1 in TF32,
    // 1 + 2^-9 is 1 in bfloat16), 32F keeps them; other operand types are refused
    {
        const float hx[2] = {1.0f + 0x1p-12f, 1.0f + 0x1p-9f}, hy = 1.0f;
        float *dx, *dy, *dz, hz[2];
        EXPECT(cudaMalloc((void **)&dx, sizeof hx) == cudaSuccess);
        EXPECT(cudaMalloc((void **)&dy, sizeof hy) == cudaSuccess);
        EXPECT(cudaMalloc((void **)&dz, sizeof hz) == cudaSuccess);
        cudaMemcpy(dx, hx, sizeof hx, cudaMemcpyHostToDevice);
        cudaMemcpy(dy, &hy, sizeof hy, cudaMemcpyHostToDevice);
        const cublasComputeType_t cts[3] = {CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32,
                                            CUBLAS_COMPUTE_32F_FAST_16BF};
        const float want[3][2] = {{hx[0], hx[1]}, {1.0f, hx[1]}, {1.0f, 1.0f}};
        for (int t = 0; t < 3; t++) {
            // z (2x1) = x (2x1) y (1x1), column-major
            EXPECT(cublasGemmEx(hb0, CUBLAS_OP_N, CUBLAS_OP_N, 2, 1, 1, &one, dx, CUDA_R_32F, 2, dy,
                                CUDA_R_32F, 1, &zero, dz, CUDA_R_32F, 2, cts[t],
                                CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
            cudaMemcpy(hz, dz, sizeof hz, cudaMemcpyDeviceToHost);
            EXPECT(hz[0] == want[t][0] && hz[1] == want[t][1]);
        }
        EXPECT(cublasGemmEx(hb0, CUBLAS_OP_N, CUBLAS_OP_N, 2, 1, 1, &one, dx, CUDA_R_16F, 2, dy,
                            CUDA_R_32F, 1, &zero, dz, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED);
        cudaFree(dx);
        cudaFree(dy);
        cudaFree(dz);
    }

    // the lazy schedule: queued work runs only when something waits for it
    {
        cudaStream_t a, b;
        cudaEvent_t ev;
        float *buf = nullptr, *dst = nullptr, *pin = nullptr;
        EXPECT(cudaStreamCreate(&a) == cudaSuccess && cudaStreamCreate(&b) == cudaSuccess);
        EXPECT(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);
        EXPECT(cudaMalloc((void **)&buf, 64 * 4) == cudaSuccess);
        EXPECT(cudaMalloc((void **)&dst, 64 * 4) == cudaSuccess);
        EXPECT(cudaMallocHost((void **)&pin, 64 * 4) == cudaSuccess);
        pin[0] = -1.0f;
        fill<<<2, 32, 0, a>>>(buf, 64, 3.0f);
        EXPECT(cudaMemcpyAsync(pin, buf, 64 * 4, cudaMemcpyDeviceToHost, a) == cudaSuccess);
        EXPECT(cudaEventRecord(ev, a) == cudaSuccess);
        EXPECT(cudaEventQuery(ev) == cudaErrorNotReady);
        EXPECT(pin[0] == -1.0f); // the host has not waited: nothing ran yet
        EXPECT(cudaStreamSynchronize(a) == cudaSuccess);
        EXPECT(cudaEventQuery(ev) == cudaSuccess && pin[0] == 3.0f && pin[63] == 3.0f);
        // stream b reads a's buffer: right after waiting on a's event, stale without the wait
        fill<<<2, 32, 0, a>>>(buf, 64, 5.0f);
        EXPECT(cudaMemcpyAsync(dst, buf, 64 * 4, cudaMemcpyDeviceToDevice, b) == cudaSuccess);
        EXPECT(cudaMemcpyAsync(pin, dst, 64 * 4, cudaMemcpyDeviceToHost, b) == cudaSuccess);
        EXPECT(cudaStreamSynchronize(b) == cudaSuccess && pin[0] == 3.0f);
        EXPECT(cudaEventRecord(ev, a) == cudaSuccess);
        EXPECT(cudaStreamWaitEvent(b, ev, 0) == cudaSuccess);
        EXPECT(cudaMemcpyAsync(dst, buf, 64 * 4, cudaMemcpyDeviceToDevice, b) == cudaSuccess);
        EXPECT(cudaMemcpyAsync(pin, dst, 64 * 4, cudaMemcpyDeviceToHost, b) == cudaSuccess);
        EXPECT(cudaStreamSynchronize(b) == cudaSuccess && pin[0] == 5.0f && pin[63] == 5.0f);
        // a queued free happens after the work queued before it
        fill<<<1, 32, 0, a>>>(buf, 64, 7.0f);
        EXPECT(cudaFreeAsync(buf, a) == cudaSuccess);
        EXPECT(cudaFreeAsync(buf, a) == cudaErrorInvalidValue); // twice
        cudaGetLastError();
        EXPECT(cudaStreamSynchronize(a) == cudaSuccess);
    }

    // a barrier some threads never reach, and a site that reaches one only later
    EXPECT(aborts([&] { divergent<<<1, 64>>>(dx); }));
    EXPECT(!aborts([&] { launch_maybe(0, dx); launch_maybe(1, dx); }));
    {
        float *rx = nullptr, *ry = nullptr, hy[64];
        EXPECT(cudaMalloc((void **)&rx, sizeof hy) == cudaSuccess);
        EXPECT(cudaMalloc((void **)&ry, sizeof hy) == cudaSuccess);
        reverse_through_helpers<<<1, 64>>>(rx, ry);
        EXPECT(cudaMemcpy(hy, ry, sizeof hy, cudaMemcpyDeviceToHost) == cudaSuccess);
        bad = 0;
        for (int i = 0; i < 64; i++) bad += hy[i] != (float)(63 - i);
        EXPECT(bad == 0);
        for (int i = 0; i < 64; i++) hy[i] = -1.0f;
        EXPECT(cudaMemcpy(ry, hy, sizeof hy, cudaMemcpyHostToDevice) == cudaSuccess);
        reverse_templated<float, 64><<<1, 64>>>(rx, ry);
        EXPECT(cudaMemcpy(hy, ry, sizeof hy, cudaMemcpyDeviceToHost) == cudaSuccess);
        bad = 0;
        for (int i = 0; i < 64; i++) bad += hy[i] != (float)(63 - i);
        EXPECT(bad == 0);
    }

    // stream capture and graphs
    {
        cudaStream_t s;
        EXPECT(cudaSetDevice(0) == cudaSuccess && cudaStreamCreate(&s) == cudaSuccess);
        float *g1 = nullptr, *g2 = nullptr, h[64];
        EXPECT(cudaMalloc((void **)&g1, sizeof h) == cudaSuccess);
        EXPECT(cudaMalloc((void **)&g2, sizeof h) == cudaSuccess);
        fill<<<1, 32, 0, s>>>(g1, 64, 1.0f);
        EXPECT(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        launch_fill(s, g1, 3.0f); // recorded, not run
        cudaGraph_t graph = nullptr;
        EXPECT(cudaStreamEndCapture(s, &graph) == cudaSuccess && graph != nullptr);
        EXPECT(cudaMemcpy(h, g1, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess && h[0] == 1.0f);
        cudaGraphExec_t exec = nullptr;
        EXPECT(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess && cudaGraphDestroy(graph) == cudaSuccess);
        EXPECT(cudaGraphLaunch(exec, s) == cudaSuccess);
        EXPECT(cudaMemcpy(h, g1, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess && h[63] == 3.0f);
        // an update with the same kernel on another buffer; another topology is refused
        EXPECT(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        launch_fill(s, g2, 4.0f);
        EXPECT(cudaStreamEndCapture(s, &graph) == cudaSuccess);
        cudaGraphExecUpdateResultInfo info;
        EXPECT(cudaGraphExecUpdate(exec, graph, &info) == cudaSuccess && cudaGraphDestroy(graph) == cudaSuccess);
        EXPECT(cudaGraphLaunch(exec, s) == cudaSuccess);
        EXPECT(cudaMemcpy(h, g2, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess && h[0] == 4.0f);
        EXPECT(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        launch_fill(s, g2, 5.0f);
        launch_fill(s, g1, 5.0f);
        EXPECT(cudaStreamEndCapture(s, &graph) == cudaSuccess);
        EXPECT(cudaGraphExecUpdate(exec, graph, &info) == cudaErrorGraphExecUpdateFailure);
        cudaGetLastError();
        EXPECT(cudaGraphDestroy(graph) == cudaSuccess);
        // a synchronisation while capturing is refused and invalidates the capture
        EXPECT(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        EXPECT(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported);
        EXPECT(cudaStreamEndCapture(s, &graph) == cudaErrorStreamCaptureInvalidated && graph == nullptr);
        cudaGetLastError();
        // a graph replaying memory freed since its capture aborts the run
        EXPECT(cudaFree(g2) == cudaSuccess);
        EXPECT(aborts([&] { cudaGraphLaunch(exec, s); cudaStreamSynchronize(s); }));
        EXPECT(cudaGraphExecDestroy(exec) == cudaSuccess);
        // the pool hands a freed block of the same size back
        float *p1 = nullptr, *p2 = nullptr;
        EXPECT(cudaMallocAsync((void **)&p1, 1000, s) == cudaSuccess);
        EXPECT(cudaFreeAsync(p1, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess);
        EXPECT(cudaMallocAsync((void **)&p2, 1000, s) == cudaSuccess && p2 == p1);
        EXPECT(cudaFreeAsync(p2, s) == cudaSuccess && cudaFree(g1) == cudaSuccess);
    }

    if (failures) {
        fprintf(stderr, "cuda emulation self-test: %d check(s) failed\n", failures);
        return 1;
    }
    printf("cuda emulation self-test: all checks passed\n");
    return 0;
}
