/*
 * ct_device.h — the device registry and per-device memory accounting.
 *
 * Devices are created once, at first use, from the environment:
 *   CTRAINSTATE_NUM_CPU_DEVICES  number of CPU virtual devices (default 1),
 *                                like XLA's --xla_force_host_platform_device_count
 *   CTRAINSTATE_CPU_DEVICE_MEMORY  optional per-device byte limit
 * Every allocation goes through ct_device_alloc so that bytes_in_use and the
 * peak are exact; an allocation past the limit fails with CT_EOOM and a
 * message naming the device, the bytes asked and the bytes in use.
 */
#ifndef CT_DEVICE_H
#define CT_DEVICE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ct_backend.h"
#include "ct_status.h"

#define CT_MAX_DEVICES 4096

typedef struct ct_device {
    int id;                      /* global id, unique across platforms of this process */
    ct_platform platform;
    const ct_backend *backend;
    size_t bytes_limit;          /* 0 = no limit */
    _Atomic size_t bytes_in_use;
    _Atomic size_t peak_bytes_in_use;
    _Atomic size_t num_allocs;   /* live allocations */
    _Atomic size_t largest_alloc_size;
} ct_device;

/* Create the registry if needed (thread-safe, idempotent). */
ct_status ct_devices_init(void);

/* Number of devices of a platform (0 if the platform is absent). */
int ct_device_count(ct_platform platform);

/* The i-th device of a platform, or NULL (with CT_EINVAL set) if out of range. */
ct_device *ct_device_get(ct_platform platform, int index);

/* Device by global id, or NULL (with CT_EINVAL set). */
ct_device *ct_device_by_id(int id);

/* Display name like "CpuDevice(id=3)" written into buf. */
void ct_device_name(const ct_device *dev, char *buf, size_t n);

ct_status ct_device_alloc(ct_device *dev, size_t nbytes, void **out);
void ct_device_free(ct_device *dev, void *ptr, size_t nbytes);

/* Reset peak_bytes_in_use to the current bytes_in_use on every device. */
void ct_devices_reset_peaks(void);

#endif /* CT_DEVICE_H */
