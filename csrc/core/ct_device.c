/*
 * ct_device.c — device registry and memory accounting (see ct_device.h).
 */
#include "ct_device.h"

#include <dlfcn.h>
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
static char g_gpu_status[CT_ERRMSG_MAX] = "GPU backend not probed yet";
static char g_cuda_backend[CT_ERRMSG_MAX]; /* the package's own CUDA backend ("" unknown) */
static int g_probed;                       /* init_once has run */
/* Global ids (ct_devices_set_id_offset): this process's first id and the job's device count
 * (0: one process, ids are local indices). */
static int g_id_offset;
static int g_id_total;

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

/* --- the loadable CUDA backend ------------------------------------------- */

static const ct_core_services g_services = {
    .abi_version = CT_BACKEND_ABI_VERSION,
    .set_error = ct_set_error,
};

/* Load the CUDA backend if one is configured; on any failure record why and
 * report zero GPUs (never an error: a CPU-only machine is normal). */
static void probe_gpu(const ct_backend **backend, int *num_physical) {
    *backend = NULL;
    *num_physical = 0;
    const char *path = getenv("CTRAINSTATE_CUDA_BACKEND");
    const char *off = getenv("CTRAINSTATE_NO_GPU");
    if (off != NULL && *off != '\0' && strcmp(off, "0") != 0) {
        snprintf(g_gpu_status, sizeof g_gpu_status, "GPUs disabled by CTRAINSTATE_NO_GPU=%s", off);
        return;
    }
    if (path == NULL || *path == '\0') {
        snprintf(g_gpu_status, sizeof g_gpu_status,
                 "ctrainstate was built without the CUDA backend (no nvcc at build time, or "
                 "CTRAINSTATE_NO_CUDA=1)");
        return;
    }
    if (g_cuda_backend[0] != '\0' && strcmp(path, g_cuda_backend) == 0) {
        /* the CUDA runtime needs the driver's library: without it no GPU can be used, and
         * loading the backend (cuBLAS's libraries: a tenth of a second) is skipped. Kept
         * loaded otherwise: the runtime loads it next. */
        void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
        if (drv == NULL) {
            const char *e = dlerror();
            snprintf(g_gpu_status, sizeof g_gpu_status,
                     "no NVIDIA driver: libcuda.so.1 could not be loaded (%s), so the CUDA "
                     "backend was not loaded", e ? e : "no reason given");
            return;
        }
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *e = dlerror();
        snprintf(g_gpu_status, sizeof g_gpu_status,
                 "the CUDA backend could not be loaded (CUDA runtime libraries missing?): %s",
                 e ? e : path);
        return;
    }
    ct_backend_open_fn open_fn;
    *(void **)(&open_fn) = dlsym(h, CT_CUDA_ENTRY_POINT);
    if (open_fn == NULL) {
        snprintf(g_gpu_status, sizeof g_gpu_status, "%s has no entry point %s", path,
                 CT_CUDA_ENTRY_POINT);
        dlclose(h);
        return;
    }
    const ct_backend *be = NULL;
    int n = 0;
    ct_clear_error();
    if (open_fn(&g_services, &be, &n) != CT_OK) {
        if (ct_last_error()[0] != '\0')
            snprintf(g_gpu_status, sizeof g_gpu_status, "%s", ct_last_error());
        else /* a library of ABI 6 or older refuses another ABI without a message */
            snprintf(g_gpu_status, sizeof g_gpu_status,
                     "%s refused backend ABI %d (built from other sources: rebuild it)", path,
                     CT_BACKEND_ABI_VERSION);
        ct_clear_error();
        return; /* keep the library loaded: harmless, and dlclose of CUDA libs is fragile */
    }
    if (n == 0) {
        snprintf(g_gpu_status, sizeof g_gpu_status, "the CUDA backend found no GPU");
        return;
    }
    snprintf(g_gpu_status, sizeof g_gpu_status, "CUDA backend loaded: %d GPU(s)", n);
    *backend = be;
    *num_physical = n;
}

ct_status ct_devices_set_cuda_backend(const char *path) {
    if (path == NULL || strlen(path) >= sizeof g_cuda_backend) {
        ct_set_error(CT_EINVAL, "the CUDA backend's path is missing or too long");
        return CT_EINVAL;
    }
    if (__atomic_load_n(&g_probed, __ATOMIC_ACQUIRE)) {
        ct_set_error(CT_EINVAL, "devices exist already: the CUDA backend was probed");
        return CT_EINVAL;
    }
    snprintf(g_cuda_backend, sizeof g_cuda_backend, "%s", path);
    return CT_OK;
}

static void init_once(void) {
    __atomic_store_n(&g_probed, 1, __ATOMIC_RELEASE);
    uint64_t ncpu = 0, limit = 0, split = 0;
    ct_status st = env_u64("CTRAINSTATE_NUM_CPU_DEVICES", 1, CT_MAX_DEVICES, &ncpu);
    if (st == CT_OK) st = env_u64("CTRAINSTATE_CPU_DEVICE_MEMORY", 1, UINT64_MAX, &limit);
    if (st == CT_OK) st = env_u64("CTRAINSTATE_GPU_SPLIT", 1, 64, &split);
    if (st != CT_OK) {
        g_init_status = st;
        snprintf(g_init_error, sizeof g_init_error, "%s", ct_last_error());
        return;
    }
    if (ncpu == 0) ncpu = 1;
    if (split == 0) split = 1;
    const ct_backend *gpu = NULL;
    int nphys = 0;
    probe_gpu(&gpu, &nphys);
    int ngpu = nphys * (int)split;
    if ((int)ncpu + ngpu > CT_MAX_DEVICES) ngpu = CT_MAX_DEVICES - (int)ncpu;
    g_devices = calloc((size_t)ncpu + (size_t)ngpu, sizeof *g_devices);
    if (g_devices == NULL) {
        g_init_status = CT_EOOM;
        snprintf(g_init_error, sizeof g_init_error, "out of host memory creating devices");
        return;
    }
    for (int i = 0; i < (int)ncpu; i++) {
        ct_device *d = &g_devices[i];
        d->id = i;
        d->platform = CT_PLATFORM_CPU;
        d->backend = &ct_cpu_backend;
        d->ordinal = 0;
        d->split_index = i;
        d->bytes_limit = (size_t)limit;
    }
    int made = 0;
    for (int i = 0; i < ngpu; i++) {
        ct_device *d = &g_devices[ncpu + (size_t)made];
        d->id = (int)ncpu + made;
        d->platform = CT_PLATFORM_GPU;
        d->backend = gpu;
        d->ordinal = i / (int)split;
        d->split_index = i % (int)split;
        if (gpu->init_device != NULL && gpu->init_device(d) != CT_OK) {
            snprintf(g_gpu_status, sizeof g_gpu_status, "GPU %d could not be set up: %s",
                     d->ordinal, ct_last_error());
            ct_clear_error();
            break;
        }
        made++;
    }
    g_num_devices = (int)ncpu + made;
    g_platform_first[CT_PLATFORM_CPU] = 0;
    g_platform_count[CT_PLATFORM_CPU] = (int)ncpu;
    g_platform_first[CT_PLATFORM_GPU] = (int)ncpu;
    g_platform_count[CT_PLATFORM_GPU] = made;
}

ct_status ct_devices_init(void) {
    pthread_once(&g_once, init_once);
    if (g_init_status != CT_OK) return ct_set_error(g_init_status, "%s", g_init_error);
    return CT_OK;
}

const char *ct_gpu_status(void) {
    ct_devices_init();
    return g_gpu_status;
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
    const int local = id - g_id_offset;
    if (local < 0 || local >= g_num_devices) {
        if (g_id_total > 0 && id >= 0 && id < g_id_total)
            ct_set_error(CT_EINVAL,
                         "device %d belongs to another process (this process has devices "
                         "%d..%d): an operation on an Array that spans processes is not "
                         "supported yet; gather it with "
                         "ctrainstate.experimental.multihost_utils.process_allgather(x), or "
                         "work on x.addressable_shards",
                         id, g_id_offset, g_id_offset + g_num_devices - 1);
        else
            ct_set_error(CT_EINVAL, "no device with id %d (there are %d devices)", id,
                         g_id_total > 0 ? g_id_total : g_num_devices);
        return NULL;
    }
    return &g_devices[local];
}

int ct_device_global_id(const ct_device *dev) { return dev->id + g_id_offset; }

ct_status ct_devices_set_id_offset(int offset, int total) {
    ct_status st = ct_devices_init();
    if (st != CT_OK) return st;
    if (offset < 0 || total < offset + g_num_devices)
        return ct_set_error(CT_EINVAL,
                            "device id offset %d and total %d do not fit this process's %d "
                            "devices", offset, total, g_num_devices);
    if (g_id_total > 0 && (offset != g_id_offset || total != g_id_total))
        return ct_set_error(CT_EINVAL,
                            "the global device ids were already set (offset %d of %d devices)",
                            g_id_offset, g_id_total);
    g_id_offset = offset;
    g_id_total = total;
    return CT_OK;
}

void ct_device_name(const ct_device *dev, char *buf, size_t n) {
    snprintf(buf, n, "%s(id=%d)", dev->platform == CT_PLATFORM_CPU ? "CpuDevice" : "CudaDevice",
             ct_device_global_id(dev));
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
