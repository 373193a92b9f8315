/*
 * ct_backend.h — the seam between the core and a device backend.
 *
 * A backend is a table of function pointers. The core calls only these to
 * touch device memory; it never knows whether the bytes live in host RAM or
 * on a GPU. csrc/backend/cpu implements it with host memory and OpenMP; a CUDA
 * backend (csrc/backend/cuda, later) fills the same table with cudaMalloc,
 * streams and kernels. A backend knows neither Python nor logical rules.
 */
#ifndef CT_BACKEND_H
#define CT_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ct_status.h"

typedef enum { CT_PLATFORM_CPU = 0, CT_PLATFORM_GPU = 1, CT_NUM_PLATFORMS } ct_platform;

struct ct_device;

typedef struct ct_backend {
    const char *name;       /* "cpu", "cuda" */
    ct_platform platform;
    /* Memory. alloc returns CT_EOOM (with the message set) when the backend
     * itself has no memory; the per-device limit is enforced by ct_device. */
    ct_status (*alloc)(struct ct_device *dev, size_t nbytes, void **out);
    void (*free)(struct ct_device *dev, void *ptr, size_t nbytes);
    /* Strided n-d block copy between two buffers the backend can address
     * (host<->host for cpu; d2d/h2d/d2h for cuda). Strides are in bytes. */
    ct_status (*copy_block)(int ndim, const int64_t *shape, size_t itemsize,
                            void *dst, const int64_t *dst_strides,
                            const void *src, const int64_t *src_strides);
    /* Wait for all work queued on the device. */
    ct_status (*synchronize)(struct ct_device *dev);
} ct_backend;

/* The CPU backend (csrc/backend/cpu/cpu_backend.c). */
extern const ct_backend ct_cpu_backend;

#endif /* CT_BACKEND_H */
