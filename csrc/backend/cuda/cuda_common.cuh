/*
 * cuda_common.cuh — error checking and shared helpers of the CUDA backend.
 *
 * Every CUDA call goes through CT_CUDA_TRY, which turns a failure into a core
 * error naming the call, the file and the line (via the core's set_error,
 * handed to the backend when it is opened).
 */
#ifndef CT_CUDA_COMMON_CUH
#define CT_CUDA_COMMON_CUH

#include <cuda_runtime.h>

#include <atomic> /* before the extern "C" block: ct_device.h uses std::atomic in C++ */

extern "C" {
#include "../../core/ct_backend.h"
#include "../../core/ct_device.h"
}

/* The core's services (set once by ct_cuda_backend_open). */
extern const ct_core_services *ct_cuda_core;

#define CT_CUDA_TRY(call)                                                                  \
    do {                                                                                   \
        cudaError_t ct_cuda_err_ = (call);                                                 \
        if (ct_cuda_err_ != cudaSuccess)                                                   \
            return ct_cuda_core->set_error(CT_EDEVICE, "CUDA error in %s at %s:%d: %s",   \
                                           #call, __FILE__, __LINE__,                      \
                                           cudaGetErrorString(ct_cuda_err_));              \
    } while (0)

static inline cudaStream_t ct_cuda_stream(const ct_device *dev) {
    return (cudaStream_t)dev->stream;
}

/* Let kernels running on GPU `gpu` read and write buffers of GPU `peer`
 * (cuda_backend.cu); leaves `gpu` the current device. */
ct_status ct_cuda_enable_peer(int gpu, int peer);

#endif /* CT_CUDA_COMMON_CUH */
