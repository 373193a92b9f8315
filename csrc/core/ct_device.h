/*
 * ct_device.h — the device registry and per-device memory accounting.
 *
 * Devices are created once, at first use, from the environment:
 *   CTRAINSTATE_NUM_CPU_DEVICES  number of CPU virtual devices (default 1),
 *                                like XLA's --xla_force_host_platform_device_count
 *   CTRAINSTATE_CPU_DEVICE_MEMORY  optional per-device byte limit
 *   CTRAINSTATE_CUDA_BACKEND     path of the CUDA backend library (set by the
 *                                Python package when it was built); loaded with
 *                                dlopen only here, so a machine without CUDA
 *                                libraries or a driver simply has no GPU devices
 *   CTRAINSTATE_NO_GPU=1         do not load it
 *   CTRAINSTATE_GPU_SPLIT=k      k logical devices per GPU (own stream and
 *                                accounting), to test model parallelism on one GPU
 * Ids: CPU devices first, then GPU devices. In a job of several processes
 * (ctrainstate.distributed.initialize) every id this file hands out or accepts is
 * global: the local index plus this process's offset (the devices of the processes
 * before it), set once by ct_devices_set_id_offset. `ct_device.id` stays the local
 * index, which the backends use to index their per-device tables.
 * Every allocation goes through ct_device_alloc so that bytes_in_use and the
 * peak are exact; an allocation past the limit fails with CT_EOOM and a
 * message naming the device, the bytes asked and the bytes in use.
 */
#ifndef CT_DEVICE_H
#define CT_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "ct_backend.h"
#include "ct_status.h"

#define CT_MAX_DEVICES 4096

/* The counters are atomics; the CUDA backend (C++) sees the same layout. */
#ifdef __cplusplus
#include <atomic>
typedef std::atomic<size_t> ct_atomic_size;
using std::atomic_load;
#else
#include <stdatomic.h>
typedef _Atomic size_t ct_atomic_size;
#endif

typedef struct ct_device {
    int id;                      /* local index, unique across platforms of this process */
    ct_platform platform;
    const ct_backend *backend;
    int ordinal;                 /* physical device index within the backend (GPU number) */
    int split_index;             /* index among the logical devices of that physical device */
    void *stream;                /* backend-private handle (a cudaStream_t for CUDA) */
    size_t bytes_limit;          /* 0 = no limit */
    ct_atomic_size bytes_in_use;
    ct_atomic_size peak_bytes_in_use;
    ct_atomic_size num_allocs;   /* live allocations */
    ct_atomic_size largest_alloc_size;
} ct_device;

/* Create the registry if needed (thread-safe, idempotent). */
ct_status ct_devices_init(void);

/* Number of devices of a platform (0 if the platform is absent). */
int ct_device_count(ct_platform platform);

/* The i-th device of a platform, or NULL (with CT_EINVAL set) if out of range. */
ct_device *ct_device_get(ct_platform platform, int index);

/* Device by global id, or NULL (with CT_EINVAL set; for the id of another process's
 * device the message says so). */
ct_device *ct_device_by_id(int id);

/* The global id of a device: its local index plus the offset. */
int ct_device_global_id(const ct_device *dev);

/* Set the offset of this process's ids (the number of devices of the processes before
 * it) and the number of devices of the whole job, once, before anything reads global
 * ids: CT_EINVAL when already set to another value or out of range. */
ct_status ct_devices_set_id_offset(int offset, int total);

/* Display name like "CpuDevice(id=3)" written into buf. */
void ct_device_name(const ct_device *dev, char *buf, size_t n);

ct_status ct_device_alloc(ct_device *dev, size_t nbytes, void **out);
void ct_device_free(ct_device *dev, void *ptr, size_t nbytes);

/* Why there are no GPU devices (or what was loaded): a human-readable line. */
const char *ct_gpu_status(void);

/* Name the library at `path` as the package's own CUDA backend (nvcc, cudart, cuBLAS), before
 * devices are first used: when CTRAINSTATE_CUDA_BACKEND names it, the probe first loads the
 * NVIDIA driver's libcuda.so.1 and, where that fails (no driver: no GPU can be used), reports
 * so without loading the backend and its CUDA libraries. Other backends (the host emulations
 * of tools/) are loaded as they are. CT_EINVAL for a path of CT_ERRMSG_MAX bytes or more, or
 * once devices exist. */
ct_status ct_devices_set_cuda_backend(const char *path);

/* Reset peak_bytes_in_use to the current bytes_in_use on every device. */
void ct_devices_reset_peaks(void);

#endif /* CT_DEVICE_H */
