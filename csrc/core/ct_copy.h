/*
 * ct_copy.h — moving blocks of a global array between shards and host arrays.
 *
 * Shards are dense row-major blocks of a global array, identified by their
 * start index. These routines compute which elements two regions share and
 * hand the strided copy to the backend; they are the whole of scatter
 * (device_put of a host array), gather (np.asarray of an Array) and reshard.
 */
#ifndef CT_COPY_H
#define CT_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "ct_backend.h"

/* Copy the elements that block `src` (start, shape) and block `dst` share.
 * Sets *copied to the number of elements copied (0 when they do not meet). */
ct_status ct_copy_overlap(const ct_backend *be, int ndim, size_t itemsize, void *dst,
                          const int64_t *dst_start, const int64_t *dst_shape, const void *src,
                          const int64_t *src_start, const int64_t *src_shape, int64_t *copied);

/* Host array (any byte strides, pointing at global element 0) -> dense block. */
ct_status ct_copy_from_global(const ct_backend *be, int ndim, size_t itemsize, void *block,
                              const int64_t *start, const int64_t *block_shape, const void *global,
                              const int64_t *global_strides);

/* Dense block -> host array (any byte strides, pointing at global element 0). */
ct_status ct_copy_to_global(const ct_backend *be, int ndim, size_t itemsize, void *global,
                            const int64_t *global_strides, const void *block, const int64_t *start,
                            const int64_t *block_shape);

/* Byte strides of a dense row-major block. */
void ct_dense_strides(int ndim, const int64_t *shape, size_t itemsize, int64_t *strides);

#endif /* CT_COPY_H */
