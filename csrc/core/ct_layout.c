/*
 * ct_layout.c — mesh validation, spec validation and shard layout (see ct_layout.h).
 */
#include "ct_layout.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- formatting helpers ------------------------------------------------- */

static void append(char *buf, size_t n, size_t *pos, const char *s) {
    size_t len = strlen(s);
    if (*pos + 1 >= n) return;
    size_t room = n - 1 - *pos;
    if (len > room) len = room;
    memcpy(buf + *pos, s, len);
    *pos += len;
    buf[*pos] = '\0';
}

void ct_spec_format(const ct_spec *spec, char *buf, size_t n) {
    size_t pos = 0;
    if (n == 0) return;
    buf[0] = '\0';
    append(buf, n, &pos, "PartitionSpec(");
    int k = 0;
    for (int i = 0; i < spec->len; i++) {
        if (i) append(buf, n, &pos, ", ");
        if (spec->naxes[i] == 0) append(buf, n, &pos, "None");
        if (spec->naxes[i] > 1) append(buf, n, &pos, "(");
        for (int j = 0; j < spec->naxes[i]; j++, k++) {
            if (j) append(buf, n, &pos, ", ");
            append(buf, n, &pos, "'");
            append(buf, n, &pos, spec->axes[k]);
            append(buf, n, &pos, "'");
        }
        if (spec->naxes[i] > 1) append(buf, n, &pos, ")");
    }
    if (spec->len == 1) append(buf, n, &pos, ","); /* tuple repr, like PartitionSpec's */
    append(buf, n, &pos, ")");
}

static void format_names(const ct_mesh *mesh, char *buf, size_t n) {
    size_t pos = 0;
    buf[0] = '\0';
    append(buf, n, &pos, "(");
    for (int i = 0; i < mesh->ndim; i++) {
        if (i) append(buf, n, &pos, ", ");
        append(buf, n, &pos, "'");
        append(buf, n, &pos, mesh->names[i]);
        append(buf, n, &pos, "'");
    }
    if (mesh->ndim == 1) append(buf, n, &pos, ",");
    append(buf, n, &pos, ")");
}

/* --- mesh --------------------------------------------------------------- */

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

ct_status ct_mesh_init(ct_mesh *mesh, int ndevice_dims, const int64_t *device_shape, int nnames,
                       const char *const *names, const int *device_ids) {
    if (ndevice_dims < 1 || ndevice_dims > CT_MAX_MESH_NDIM)
        return ct_set_error(CT_EINVAL, "Mesh: the device array must have rank 1 to %d, got rank %d",
                            CT_MAX_MESH_NDIM, ndevice_dims);
    if (nnames != ndevice_dims)
        return ct_set_error(CT_EINVAL,
                            "Mesh: got %d axis names for a device array of rank %d; give one name "
                            "per dimension of the device array",
                            nnames, ndevice_dims);
    memset(mesh, 0, sizeof *mesh);
    mesh->ndim = ndevice_dims;
    mesh->size = 1;
    for (int i = 0; i < ndevice_dims; i++) {
        if (device_shape[i] < 1)
            return ct_set_error(CT_EINVAL, "Mesh: axis %d has size %" PRId64 "; sizes must be >= 1",
                                i, device_shape[i]);
        size_t len = strlen(names[i]);
        if (len == 0 || len >= CT_AXIS_NAME_MAX)
            return ct_set_error(CT_EINVAL, "Mesh: axis name %d must have 1 to %d characters", i,
                                CT_AXIS_NAME_MAX - 1);
        for (int j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0)
                return ct_set_error(CT_EINVAL,
                                    "Mesh: axis name '%s' appears more than once; axis names must "
                                    "be unique",
                                    names[i]);
        memcpy(mesh->names[i], names[i], len + 1);
        mesh->shape[i] = device_shape[i];
        if (mesh->size > INT64_MAX / device_shape[i])
            return ct_set_error(CT_EINVAL, "Mesh: the device array has more than 2**63 - 1 "
                                           "elements");
        mesh->size *= device_shape[i];
    }
    if (device_ids == NULL) return ct_set_error(CT_EINVAL, "Mesh: no device ids given");
    /* Duplicate devices: sort a copy of the ids. */
    int *ids = malloc((size_t)mesh->size * sizeof *ids);
    if (ids == NULL) return ct_set_error(CT_EOOM, "Mesh: out of host memory");
    memcpy(ids, device_ids, (size_t)mesh->size * sizeof *ids);
    qsort(ids, (size_t)mesh->size, sizeof *ids, cmp_int);
    for (int64_t i = 1; i < mesh->size; i++) {
        if (ids[i] == ids[i - 1]) {
            int dup = ids[i];
            free(ids);
            return ct_set_error(CT_EINVAL,
                                "Mesh: device id %d appears more than once; each device may occur "
                                "once in a mesh",
                                dup);
        }
    }
    free(ids);
    return CT_OK;
}

int ct_mesh_axis_index(const ct_mesh *mesh, const char *name) {
    for (int i = 0; i < mesh->ndim; i++)
        if (strcmp(mesh->names[i], name) == 0) return i;
    return -1;
}

/* --- specs -------------------------------------------------------------- */

ct_status ct_spec_check(const ct_mesh *mesh, const ct_spec *spec) {
    int used_by[CT_MAX_MESH_NDIM];
    for (int i = 0; i < CT_MAX_MESH_NDIM; i++) used_by[i] = -1;
    char sbuf[512], mbuf[512];
    int k = 0;
    for (int d = 0; d < spec->len; d++) {
        for (int j = 0; j < spec->naxes[d]; j++, k++) {
            int a = ct_mesh_axis_index(mesh, spec->axes[k]);
            if (a < 0) {
                ct_spec_format(spec, sbuf, sizeof sbuf);
                format_names(mesh, mbuf, sizeof mbuf);
                return ct_set_error(CT_EINVAL,
                                    "Resource axis: '%s' of %s is undefined; the mesh has axes %s",
                                    spec->axes[k], sbuf, mbuf);
            }
            if (used_by[a] >= 0) {
                ct_spec_format(spec, sbuf, sizeof sbuf);
                if (used_by[a] == d)
                    return ct_set_error(CT_EINVAL,
                                        "%s uses mesh axis '%s' twice in dimension %d; a mesh axis "
                                        "can appear at most once in a spec",
                                        sbuf, spec->axes[k], d);
                return ct_set_error(CT_EINVAL,
                                    "%s uses mesh axis '%s' for dimensions %d and %d; a mesh axis "
                                    "can shard at most one dimension",
                                    sbuf, spec->axes[k], used_by[a], d);
            }
            used_by[a] = d;
        }
    }
    return CT_OK;
}

ct_status ct_layout_init(ct_layout *out, const ct_mesh *mesh, const ct_spec *spec, int ndim,
                         const int64_t *shape) {
    char sbuf[512];
    if (ndim < 0 || ndim > CT_MAX_NDIM)
        return ct_set_error(CT_EINVAL, "arrays of rank %d are not supported (at most %d)", ndim,
                            CT_MAX_NDIM);
    CT_TRY(ct_spec_check(mesh, spec));
    if (spec->len > ndim) {
        ct_spec_format(spec, sbuf, sizeof sbuf);
        return ct_set_error(CT_EINVAL,
                            "%s has %d entries but the array has rank %d; a spec may not be longer "
                            "than the array's rank%s",
                            sbuf, spec->len, ndim,
                            ndim == 0 ? " (for scalars the PartitionSpec should be P())" : "");
    }
    memset(out, 0, sizeof *out);
    out->ndim = ndim;
    int used[CT_MAX_MESH_NDIM] = {0};
    int k = 0, zero = 0, big = 0;
    out->shard_size = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return ct_set_error(CT_EINVAL, "dimension %d has negative size %" PRId64, d, shape[d]);
        out->shape[d] = shape[d];
        out->nparts[d] = 1;
        int na = d < spec->len ? spec->naxes[d] : 0;
        out->naxes[d] = na;
        for (int j = 0; j < na; j++, k++) {
            int a = ct_mesh_axis_index(mesh, spec->axes[k]);
            out->axes[d][j] = a;
            out->nparts[d] *= mesh->shape[a];
            used[a] = 1;
        }
        if (shape[d] % out->nparts[d] != 0) {
            if (na == 1)
                return ct_set_error(CT_EINVAL,
                                    "dimension %d of size %" PRId64
                                    " is not divisible by mesh axis '%s' of size %" PRId64,
                                    d, shape[d], mesh->names[out->axes[d][0]], out->nparts[d]);
            char abuf[256];
            size_t pos = 0;
            abuf[0] = '\0';
            append(abuf, sizeof abuf, &pos, "(");
            for (int j = 0; j < na; j++) {
                if (j) append(abuf, sizeof abuf, &pos, ", ");
                append(abuf, sizeof abuf, &pos, "'");
                append(abuf, sizeof abuf, &pos, mesh->names[out->axes[d][j]]);
                append(abuf, sizeof abuf, &pos, "'");
            }
            append(abuf, sizeof abuf, &pos, ")");
            return ct_set_error(CT_EINVAL,
                                "dimension %d of size %" PRId64
                                " is not divisible by mesh axes %s of total size %" PRId64,
                                d, shape[d], abuf, out->nparts[d]);
        }
        out->shard_shape[d] = shape[d] / out->nparts[d];
        if (out->shard_shape[d] == 0) zero = 1;
        else if (big || out->shard_size > INT64_MAX / out->shard_shape[d]) big = 1;
        else out->shard_size *= out->shard_shape[d];
    }
    /* Shapes too big to allocate still have a layout (as in jax: shard_shape of an abstract
     * shape); their element count saturates instead of overflowing. Allocation rejects them. */
    if (zero) out->shard_size = 0;
    else if (big) out->shard_size = INT64_MAX;
    out->num_replicas = 1;
    for (int a = 0; a < mesh->ndim; a++)
        if (!used[a]) out->num_replicas *= mesh->shape[a];
    return CT_OK;
}

void ct_layout_block(const ct_layout *layout, const ct_mesh *mesh, int64_t pos, int64_t *start,
                     int64_t *replica_id) {
    int64_t coord[CT_MAX_MESH_NDIM];
    for (int a = mesh->ndim - 1; a >= 0; a--) {
        coord[a] = pos % mesh->shape[a];
        pos /= mesh->shape[a];
    }
    int used[CT_MAX_MESH_NDIM] = {0};
    for (int d = 0; d < layout->ndim; d++) {
        int64_t idx = 0;
        for (int j = 0; j < layout->naxes[d]; j++) {
            int a = layout->axes[d][j];
            idx = idx * mesh->shape[a] + coord[a];
            used[a] = 1;
        }
        start[d] = idx * layout->shard_shape[d];
    }
    int64_t rid = 0;
    for (int a = 0; a < mesh->ndim; a++)
        if (!used[a]) rid = rid * mesh->shape[a] + coord[a];
    *replica_id = rid;
}
