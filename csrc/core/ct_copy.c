/*
 * ct_copy.c — block intersection and host<->block copies (see ct_copy.h).
 */
#include "ct_copy.h"

#include "ct_layout.h"

void ct_dense_strides(int ndim, const int64_t *shape, size_t itemsize, int64_t *strides) {
    int64_t s = (int64_t)itemsize;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = s;
        s *= shape[d] > 0 ? shape[d] : 1;
    }
}

ct_status ct_copy_overlap(const ct_backend *be, int ndim, size_t itemsize, void *dst,
                          const int64_t *dst_start, const int64_t *dst_shape, const void *src,
                          const int64_t *src_start, const int64_t *src_shape, int64_t *copied) {
    int64_t lo[CT_MAX_NDIM], ext[CT_MAX_NDIM];
    int64_t ds[CT_MAX_NDIM], ss[CT_MAX_NDIM];
    int64_t n = 1;
    *copied = 0;
    for (int d = 0; d < ndim; d++) {
        int64_t a = dst_start[d] > src_start[d] ? dst_start[d] : src_start[d];
        int64_t de = dst_start[d] + dst_shape[d], se = src_start[d] + src_shape[d];
        int64_t b = de < se ? de : se;
        if (b <= a) return CT_OK;
        lo[d] = a;
        ext[d] = b - a;
        n *= ext[d];
    }
    ct_dense_strides(ndim, dst_shape, itemsize, ds);
    ct_dense_strides(ndim, src_shape, itemsize, ss);
    int64_t doff = 0, soff = 0;
    for (int d = 0; d < ndim; d++) {
        doff += (lo[d] - dst_start[d]) * ds[d];
        soff += (lo[d] - src_start[d]) * ss[d];
    }
    CT_TRY(be->copy_block(ndim, ext, itemsize, (char *)dst + doff, ds, (const char *)src + soff, ss));
    *copied = n;
    return CT_OK;
}

ct_status ct_copy_from_global(const ct_backend *be, int ndim, size_t itemsize, void *block,
                              const int64_t *start, const int64_t *block_shape, const void *global,
                              const int64_t *global_strides) {
    int64_t bs[CT_MAX_NDIM];
    int64_t off = 0;
    ct_dense_strides(ndim, block_shape, itemsize, bs);
    for (int d = 0; d < ndim; d++) off += start[d] * global_strides[d];
    return be->copy_block(ndim, block_shape, itemsize, block, bs, (const char *)global + off,
                          global_strides);
}

ct_status ct_copy_to_global(const ct_backend *be, int ndim, size_t itemsize, void *global,
                            const int64_t *global_strides, const void *block, const int64_t *start,
                            const int64_t *block_shape) {
    int64_t bs[CT_MAX_NDIM];
    int64_t off = 0;
    ct_dense_strides(ndim, block_shape, itemsize, bs);
    for (int d = 0; d < ndim; d++) off += start[d] * global_strides[d];
    return be->copy_block(ndim, block_shape, itemsize, (char *)global + off, global_strides, block,
                          bs);
}
