/*
 * ct_device.c — device registry and memory accounting (see ct_device.h).
 */
#include "ct_device.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ct_device *g_devices;           /* all devices, cpu first */
static int g_num_devices;
static int g_platform_first[CT_NUM_PLATFORMS];
static int g_platform_count[CT_NUM_PLATFORMS];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static ct_status g_init_status = CT_OK;
static char g_init_error[CT_ERRMSG_MAX];

/* Parse a positive integer environment variable; returns 0 when unset. */
static ct_status env_u64(const char *name, uint64_t min, uint64_t max, uint64_t *out) {
    const char *s = getenv(name);
    *out = 0;
    if (s == NULL || *s == '\0') return CT_OK;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    while (end && (*end == ' ' || *end == '\n')) end++;
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-' || v < min || v > max)
        return ct_set_error(CT_EINVAL, "%s=%s is not an integer in [%" PRIu64 ", %" PRIu64 "]",
                            name, s, min, max);
    *out = v;
    return CT_OK;
}

static void init_once(void) {
    uint64_t ncpu = 0, limit = 0;
    ct_status st = env_u64("CTRAINSTATE_NUM_CPU_DEVICES", 1, CT_MAX_DEVICES, &ncpu);
    if (st == CT_OK) st = env_u64("CTRAINSTATE_CPU_DEVICE_MEMORY", 1, UINT64_MAX, &limit);
    if (st != CT_OK) {
        g_init_status = st;
        snprintf(g_init_error, sizeof g_init_error, "%s", ct_last_error());
        return;
    }
    if (ncpu == 0) ncpu = 1;
    g_devices = calloc((size_t)ncpu, sizeof *g_devices);
    if (g_devices == NULL) {
        g_init_status = CT_EOOM;
        snprintf(g_init_error, sizeof g_init_error, "out of host memory creating %d devices", (int)ncpu);
        return;
    }
    for (int i = 0; i < (int)ncpu; i++) {
        ct_device *d = &g_devices[i];
        d->id = i;
        d->platform = CT_PLATFORM_CPU;
        d->backend = &ct_cpu_backend;
        d->bytes_limit = (size_t)limit;
    }
    g_num_devices = (int)ncpu;
    g_platform_first[CT_PLATFORM_CPU] = 0;
    g_platform_count[CT_PLATFORM_CPU] = (int)ncpu;
    g_platform_first[CT_PLATFORM_GPU] = (int)ncpu;
    g_platform_count[CT_PLATFORM_GPU] = 0;
}

ct_status ct_devices_init(void) {
    pthread_once(&g_once, init_once);
    if (g_init_status != CT_OK) return ct_set_error(g_init_status, "%s", g_init_error);
    return CT_OK;
}

int ct_device_count(ct_platform platform) {
    if (ct_devices_init() != CT_OK || platform < 0 || platform >= CT_NUM_PLATFORMS) return 0;
    return g_platform_count[platform];
}

ct_device *ct_device_get(ct_platform platform, int index) {
    if (ct_devices_init() != CT_OK) return NULL;
    if (platform < 0 || platform >= CT_NUM_PLATFORMS || index < 0 ||
        index >= g_platform_count[platform]) {
        ct_set_error(CT_EINVAL, "no device with index %d on this platform", index);
        return NULL;
    }
    return &g_devices[g_platform_first[platform] + index];
}

ct_device *ct_device_by_id(int id) {
    if (ct_devices_init() != CT_OK) return NULL;
    if (id < 0 || id >= g_num_devices) {
        ct_set_error(CT_EINVAL, "no device with id %d (there are %d devices)", id, g_num_devices);
        return NULL;
    }
    return &g_devices[id];
}

void ct_device_name(const ct_device *dev, char *buf, size_t n) {
    snprintf(buf, n, "%s(id=%d)", dev->platform == CT_PLATFORM_CPU ? "CpuDevice" : "CudaDevice",
             dev->id);
}

ct_status ct_device_alloc(ct_device *dev, size_t nbytes, void **out) {
    *out = NULL;
    /* Reserve first so that concurrent allocations cannot both pass the limit. */
    size_t before = atomic_fetch_add(&dev->bytes_in_use, nbytes);
    if (dev->bytes_limit != 0 && (before + nbytes > dev->bytes_limit || before + nbytes < before)) {
        atomic_fetch_sub(&dev->bytes_in_use, nbytes);
        char name[64];
        ct_device_name(dev, name, sizeof name);
        return ct_set_error(CT_EOOM,
                            "RESOURCE_EXHAUSTED: out of memory on %s while trying to allocate %zu "
                            "bytes: %zu bytes in use, limit %zu bytes",
                            name, nbytes, before, dev->bytes_limit);
    }
    ct_status st = dev->backend->alloc(dev, nbytes, out);
    if (st != CT_OK) {
        atomic_fetch_sub(&dev->bytes_in_use, nbytes);
        return st;
    }
    size_t now = before + nbytes;
    size_t peak = atomic_load(&dev->peak_bytes_in_use);
    while (now > peak && !atomic_compare_exchange_weak(&dev->peak_bytes_in_use, &peak, now)) {
    }
    size_t big = atomic_load(&dev->largest_alloc_size);
    while (nbytes > big && !atomic_compare_exchange_weak(&dev->largest_alloc_size, &big, nbytes)) {
    }
    atomic_fetch_add(&dev->num_allocs, 1);
    return CT_OK;
}

void ct_device_free(ct_device *dev, void *ptr, size_t nbytes) {
    if (ptr == NULL && nbytes == 0) return;
    dev->backend->free(dev, ptr, nbytes);
    atomic_fetch_sub(&dev->bytes_in_use, nbytes);
    atomic_fetch_sub(&dev->num_allocs, 1);
}

void ct_devices_reset_peaks(void) {
    if (ct_devices_init() != CT_OK) return;
    for (int i = 0; i < g_num_devices; i++)
        atomic_store(&g_devices[i].peak_bytes_in_use, atomic_load(&g_devices[i].bytes_in_use));
}
