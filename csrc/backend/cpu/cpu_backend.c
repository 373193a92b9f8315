/*
 * cpu_backend.c — the CPU backend: host memory and OpenMP copies.
 *
 * CPU virtual devices all live in this process's RAM; what makes them
 * separate devices is that each allocation belongs to one of them and is
 * accounted there (ct_device.c). Buffers are 64-byte aligned so kernels can
 * use full-width vector loads. Large buffers (>= 4 MiB, numpy's threshold
 * too) are 2 MiB aligned and advised as transparent huge pages: streaming
 * kernels (the fused optimizer reads 4 and writes 3 arrays at once) then
 * take far fewer TLB misses. Where THP is off the advice is a no-op.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../../core/ct_backend.h"
#include "../../core/ct_device.h"
#include "../../core/ct_ops_math.h"
#include "../../core/ct_par.h"
#include "cpu_ops.h"

#define CT_CPU_ALIGN 64
#define CT_CPU_HUGE_MIN ((size_t)4 << 20)
#define CT_CPU_HUGE_ALIGN ((size_t)2 << 20)

/* --- a small cache of freed blocks ------------------------------------------
 * Training loops allocate the same shapes every step; handing a freed block
 * back instead of returning it to the OS avoids a page fault per 4 KiB on every
 * allocation (costly on VMs). Blocks are matched by exact (rounded) size; the
 * cache is bounded in entries and bytes, and is shared by all CPU devices (they
 * live in one address space). Device accounting (bytes_in_use) is unaffected:
 * cached blocks belong to no device. */

#define CACHE_ENTRIES 128
#define CACHE_MAX_BYTES ((size_t)512 << 20)
#define CACHE_MIN_BYTES ((size_t)64 << 10) /* small blocks come cheaply from malloc */

static struct {
    void *ptr[CACHE_ENTRIES];
    size_t size[CACHE_ENTRIES];
    int n;
    size_t bytes;
    pthread_mutex_t lock;
} g_cache = {.n = 0, .bytes = 0, .lock = PTHREAD_MUTEX_INITIALIZER};

static size_t round_size(size_t nbytes) {
    size_t unit = nbytes >= CT_CPU_HUGE_MIN ? CT_CPU_HUGE_ALIGN
                  : nbytes >= CACHE_MIN_BYTES ? 4096 : CT_CPU_ALIGN;
    size_t r = (nbytes + unit - 1) / unit * unit;
    return r == 0 ? CT_CPU_ALIGN : r;
}

static void *cache_take(size_t size) {
    void *p = NULL;
    if (size < CACHE_MIN_BYTES) return NULL;
    pthread_mutex_lock(&g_cache.lock);
    for (int i = g_cache.n - 1; i >= 0; i--) {
        if (g_cache.size[i] == size) {
            p = g_cache.ptr[i];
            g_cache.bytes -= size;
            g_cache.n--;
            g_cache.ptr[i] = g_cache.ptr[g_cache.n];
            g_cache.size[i] = g_cache.size[g_cache.n];
            break;
        }
    }
    pthread_mutex_unlock(&g_cache.lock);
    return p;
}

static int cache_put(void *p, size_t size) {
    int kept = 0;
    if (size < CACHE_MIN_BYTES) return 0;
    pthread_mutex_lock(&g_cache.lock);
    if (g_cache.n < CACHE_ENTRIES && g_cache.bytes + size <= CACHE_MAX_BYTES) {
        g_cache.ptr[g_cache.n] = p;
        g_cache.size[g_cache.n] = size;
        g_cache.n++;
        g_cache.bytes += size;
        kept = 1;
    }
    pthread_mutex_unlock(&g_cache.lock);
    return kept;
}

/* Small blocks (under CACHE_MIN_BYTES): a free list per rounded size (a multiple of
 * CT_CPU_ALIGN), bounded in blocks per size and in bytes. An eager op or a replayed program
 * allocates and frees a few small blocks per call; glibc's aligned_alloc of them splits and
 * merges chunks (malloc_consolidate) at a cost comparable to the kernels themselves. A cached
 * block holds the next one's address in its first bytes. */
#define SMALL_CLASSES (CACHE_MIN_BYTES / CT_CPU_ALIGN)
#define SMALL_KEEP 64
#define SMALL_MAX_BYTES ((size_t)32 << 20)

static struct {
    void *head[SMALL_CLASSES];
    unsigned short n[SMALL_CLASSES];
    size_t bytes;
    pthread_mutex_t lock;
} g_small = {.bytes = 0, .lock = PTHREAD_MUTEX_INITIALIZER};

static void *small_take(size_t size) {
    const size_t c = size / CT_CPU_ALIGN - 1;
    pthread_mutex_lock(&g_small.lock);
    void *p = g_small.head[c];
    if (p != NULL) {
        g_small.head[c] = *(void **)p;
        g_small.n[c]--;
        g_small.bytes -= size;
    }
    pthread_mutex_unlock(&g_small.lock);
    return p;
}

static int small_put(void *p, size_t size) {
    const size_t c = size / CT_CPU_ALIGN - 1;
    int kept = 0;
    pthread_mutex_lock(&g_small.lock);
    if (g_small.n[c] < SMALL_KEEP && g_small.bytes + size <= SMALL_MAX_BYTES) {
        *(void **)p = g_small.head[c];
        g_small.head[c] = p;
        g_small.n[c]++;
        g_small.bytes += size;
        kept = 1;
    }
    pthread_mutex_unlock(&g_small.lock);
    return kept;
}

void ct_cpu_release_cached(void) {
    pthread_mutex_lock(&g_cache.lock);
    for (int i = 0; i < g_cache.n; i++) free(g_cache.ptr[i]);
    g_cache.n = 0;
    g_cache.bytes = 0;
    pthread_mutex_unlock(&g_cache.lock);
    pthread_mutex_lock(&g_small.lock);
    for (size_t c = 0; c < SMALL_CLASSES; c++) {
        while (g_small.head[c] != NULL) {
            void *p = g_small.head[c];
            g_small.head[c] = *(void **)p;
            free(p);
        }
        g_small.n[c] = 0;
    }
    g_small.bytes = 0;
    pthread_mutex_unlock(&g_small.lock);
}

static ct_status cpu_alloc(struct ct_device *dev, size_t nbytes, void **out) {
    /* Round up: aligned_alloc needs a multiple of the alignment, and a
     * zero-byte buffer still gets a unique pointer. */
    size_t rounded = round_size(nbytes);
    const size_t align = rounded >= CT_CPU_HUGE_MIN ? CT_CPU_HUGE_ALIGN : CT_CPU_ALIGN;
    void *p = rounded < CACHE_MIN_BYTES ? small_take(rounded)
                                        : cache_take(rounded); /* same size, alignment, advice */
    if (p == NULL) {
        p = aligned_alloc(align, rounded);
        if (p == NULL) {
            ct_cpu_release_cached();
            p = aligned_alloc(align, rounded);
        }
#if defined(MADV_HUGEPAGE)
        if (p != NULL && align == CT_CPU_HUGE_ALIGN) (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
    }
    if (p == NULL) {
        char name[64];
        ct_device_name(dev, name, sizeof name);
        return ct_set_error(CT_EOOM,
                            "RESOURCE_EXHAUSTED: host out of memory on %s while trying to allocate "
                            "%zu bytes: %zu bytes in use",
                            name, nbytes, (size_t)atomic_load(&dev->bytes_in_use) - nbytes);
    }
    *out = p;
    return CT_OK;
}

static void cpu_free(struct ct_device *dev, void *ptr, size_t nbytes) {
    (void)dev;
    if (ptr == NULL) return;
    const size_t rounded = round_size(nbytes);
    if (!(rounded < CACHE_MIN_BYTES ? small_put(ptr, rounded) : cache_put(ptr, rounded))) free(ptr);
}

/* Copy rows of the innermost dimension; the outer dimensions are flattened
 * into one row index so the parallel loop has enough iterations. */
static inline void copy_row(char *drow, const char *srow, int contiguous, int64_t inner,
                            size_t itemsize, int64_t dstride, int64_t sstride) {
    if (contiguous) {
        memcpy(drow, srow, (size_t)inner * itemsize);
    } else {
        for (int64_t i = 0; i < inner; i++) memcpy(drow + i * dstride, srow + i * sstride, itemsize);
    }
}

static ct_status cpu_copy_block(struct ct_device *dst_dev, struct ct_device *src_dev, int ndim,
                                const int64_t *shape, size_t itemsize, void *dst,
                                const int64_t *dst_strides, const void *src,
                                const int64_t *src_strides) {
    (void)dst_dev; /* all CPU devices share the host address space */
    (void)src_dev;
    int64_t total = 1;
    for (int d = 0; d < ndim; d++) total *= shape[d];
    if (total == 0) return CT_OK;
    if (ndim == 0) {
        memcpy(dst, src, itemsize);
        return CT_OK;
    }
    const int64_t inner = shape[ndim - 1];
    const int64_t rows = total / inner;
    const int contiguous_rows = dst_strides[ndim - 1] == (int64_t)itemsize &&
                                src_strides[ndim - 1] == (int64_t)itemsize;
    char *d0 = (char *)dst;
    const char *s0 = (const char *)src;
    const size_t bytes = (size_t)total * itemsize;
    CT_PAR_FOR(ct_par_threads(bytes > (1u << 20)), r, rows,
               int64_t doff; int64_t soff; /* the outer coordinates of row r (row-major) */
               ct_offsets2(r, ndim - 1, shape, dst_strides, src_strides, &doff, &soff);
               copy_row(d0 + doff, s0 + soff, contiguous_rows, inner, itemsize,
                        dst_strides[ndim - 1], src_strides[ndim - 1]));
    return CT_OK;
}

static ct_status cpu_synchronize(struct ct_device *dev) {
    (void)dev;
    return CT_OK;
}

const ct_backend ct_cpu_backend = {
    .name = "cpu",
    .platform = CT_PLATFORM_CPU,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_block = cpu_copy_block,
    .synchronize = cpu_synchronize,
    .init_device = NULL,
    .unary = ct_cpu_unary,
    .unary_typed = ct_cpu_unary_typed,
    .binary = ct_cpu_binary,
    .reduce = ct_cpu_reduce,
    .gemm = ct_cpu_gemm,
    .allreduce = ct_cpu_allreduce,
    .gather_rows = ct_cpu_gather_rows,
    .scatter_add_rows = ct_cpu_scatter_add_rows,
    .convert = ct_cpu_convert,
    .ewise = ct_cpu_ewise,
    .reduce_typed = ct_cpu_reduce_typed,
    .optim_pass = NULL, /* the core's CPU driver (ct_optim.c) */
};
