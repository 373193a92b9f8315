/*
 * ct_layout.h — meshes, partition specs and shard layout.
 *
 * A mesh is an n-d grid of devices with one name per axis. A partition spec
 * says, for each array dimension, which mesh axes (major first) split it.
 * The layout answers, for every device of the mesh: which block of the global
 * array it holds (start per dimension; all blocks have the same shape) and
 * its replica id. Conventions follow jax.sharding.NamedSharding:
 *   - the shard index along a dimension is the mixed-radix number formed by the
 *     device's coordinates on that dimension's mesh axes, first axis major;
 *   - the replica id is the mixed-radix number formed by the device's
 *     coordinates on the mesh axes the spec does not use, in mesh-axis order.
 * Every check that can fail on user input is here, with a message naming the
 * offending axis, dimension and sizes.
 */
#ifndef CT_LAYOUT_H
#define CT_LAYOUT_H

#include <stdint.h>

#include "ct_status.h"

#define CT_MAX_NDIM 16
#define CT_MAX_MESH_NDIM 8
#define CT_AXIS_NAME_MAX 64

typedef struct {
    int ndim;
    int64_t shape[CT_MAX_MESH_NDIM];
    char names[CT_MAX_MESH_NDIM][CT_AXIS_NAME_MAX];
    int64_t size;
} ct_mesh;

/* Validate and build a mesh description. `ndevice_dims`/`device_shape` is the
 * shape of the device array, `nnames` the number of axis names, `device_ids`
 * the ids in row-major order (checked for duplicates). */
ct_status ct_mesh_init(ct_mesh *mesh, int ndevice_dims, const int64_t *device_shape, int nnames,
                       const char *const *names, const int *device_ids);

/* Index of a mesh axis by name, or -1. */
int ct_mesh_axis_index(const ct_mesh *mesh, const char *name);

/* A partition spec: for each of `len` entries, `naxes[i]` mesh-axis names
 * (0 = replicated), stored consecutively in `axes`. */
typedef struct {
    int len;
    const int *naxes;
    const char *const *axes;
} ct_spec;

typedef struct {
    int ndim;
    int64_t shape[CT_MAX_NDIM];
    int64_t shard_shape[CT_MAX_NDIM];
    int naxes[CT_MAX_NDIM];
    int axes[CT_MAX_NDIM][CT_MAX_MESH_NDIM]; /* mesh axis indices, major first */
    int64_t nparts[CT_MAX_NDIM];
    int64_t num_replicas;
    int64_t shard_size; /* elements per shard (INT64_MAX when that overflows) */
} ct_layout;

/* Check a spec against a mesh alone: unknown axes, an axis used twice. */
ct_status ct_spec_check(const ct_mesh *mesh, const ct_spec *spec);

/* Full check (spec + rank + divisibility) and layout for an array shape. */
ct_status ct_layout_init(ct_layout *out, const ct_mesh *mesh, const ct_spec *spec, int ndim,
                         const int64_t *shape);

/* Block start and replica id of the device at row-major position `pos` of the mesh. */
void ct_layout_block(const ct_layout *layout, const ct_mesh *mesh, int64_t pos, int64_t *start,
                     int64_t *replica_id);

/* Write "PartitionSpec('x', None, ('a', 'b'))" into buf. */
void ct_spec_format(const ct_spec *spec, char *buf, size_t n);

#endif /* CT_LAYOUT_H */
