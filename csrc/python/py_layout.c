/*
 * py_layout.c — bindings for mesh/spec validation, shard layout and the
 * block copies behind device_put, np.asarray(Array) and resharding.
 */
#include "ct_py.h"

#include <string.h>

#include "../core/ct_copy.h"

/* Holds the UTF-8 strings of a parsed mesh/spec alive while the core uses them. */
typedef struct {
    PyObject *refs; /* list of bytes-like owners */
} str_pool;

static const char *pool_str(str_pool *pool, PyObject *s, const char *what) {
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "%s must be a string, got %R", what, s);
        return NULL;
    }
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(s, &len);
    if (u == NULL) return NULL;
    /* The core compares names as C strings: 'x\0y' would be taken for 'x'. */
    if (strlen(u) != (size_t)len) {
        PyErr_Format(PyExc_ValueError, "%s must not contain a NUL character, got %R", what, s);
        return NULL;
    }
    if (PyList_Append(pool->refs, s) < 0) return NULL;
    return u;
}

static int parse_mesh(PyObject *shape_obj, PyObject *names_obj, PyObject *ids_obj, ct_mesh *mesh,
                      str_pool *pool) {
    int64_t shape[CT_MAX_NDIM];
    int ndim = ct_py_int64_seq(shape_obj, shape, CT_MAX_NDIM, "mesh shape");
    if (ndim < 0) return -1;
    PyObject *names = PySequence_Fast(names_obj, "axis_names must be a sequence of strings");
    if (names == NULL) return -1;
    Py_ssize_t nn = PySequence_Fast_GET_SIZE(names);
    const char *cnames[CT_MAX_NDIM];
    if (nn > CT_MAX_NDIM) {
        Py_DECREF(names);
        PyErr_Format(PyExc_ValueError, "Mesh: at most %d axes are supported", CT_MAX_MESH_NDIM);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nn; i++) {
        cnames[i] = pool_str(pool, PySequence_Fast_GET_ITEM(names, i), "a mesh axis name");
        if (cnames[i] == NULL) {
            Py_DECREF(names);
            return -1;
        }
    }
    Py_DECREF(names);
    PyObject *ids = PySequence_Fast(ids_obj, "device ids must be a sequence");
    if (ids == NULL) return -1;
    Py_ssize_t nids = PySequence_Fast_GET_SIZE(ids);
    int64_t expect = 1;
    for (int i = 0; i < ndim; i++) { /* (a product that wrapped matched a short id list) */
        if (shape[i] < 1 || expect > INT64_MAX / shape[i]) {
            Py_DECREF(ids);
            if (shape[i] < 1)
                PyErr_Format(PyExc_ValueError, "Mesh: axis %d has size %lld; sizes must be >= 1",
                             i, (long long)shape[i]);
            else
                PyErr_SetString(PyExc_ValueError,
                                "Mesh: the device array has more than 2**63 - 1 elements");
            return -1;
        }
        expect *= shape[i];
    }
    if (nids != expect) {
        Py_DECREF(ids);
        PyErr_Format(PyExc_ValueError, "Mesh: %zd device ids for a device array of %lld elements",
                     nids, (long long)expect);
        return -1;
    }
    int *cids = PyMem_Malloc((size_t)(nids ? nids : 1) * sizeof *cids);
    if (cids == NULL) {
        Py_DECREF(ids);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nids; i++) {
        if (!ct_py_conv_int(PySequence_Fast_GET_ITEM(ids, i), &cids[i])) {
            PyMem_Free(cids);
            Py_DECREF(ids);
            return -1;
        }
    }
    Py_DECREF(ids);
    ct_status st = ct_mesh_init(mesh, ndim, shape, (int)nn, cnames, cids);
    PyMem_Free(cids);
    if (st != CT_OK) {
        ct_py_raise(st);
        return -1;
    }
    return 0;
}

/* spec: a sequence of entries, each a tuple of mesh-axis names (empty = replicated). */
static int parse_spec(PyObject *spec_obj, ct_spec *spec, int *naxes, const char **axes,
                      str_pool *pool) {
    PyObject *entries = PySequence_Fast(spec_obj, "a partition spec must be a sequence");
    if (entries == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(entries);
    if (n > CT_MAX_NDIM) {
        Py_DECREF(entries);
        PyErr_Format(PyExc_ValueError, "a partition spec has at most %d entries", CT_MAX_NDIM);
        return -1;
    }
    int k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PySequence_Fast(PySequence_Fast_GET_ITEM(entries, i),
                                      "a normalised spec entry must be a tuple of names");
        if (e == NULL) {
            Py_DECREF(entries);
            return -1;
        }
        Py_ssize_t m = PySequence_Fast_GET_SIZE(e);
        if (k + m > CT_MAX_NDIM * CT_MAX_MESH_NDIM) {
            Py_DECREF(e);
            Py_DECREF(entries);
            PyErr_SetString(PyExc_ValueError, "partition spec names too many mesh axes");
            return -1;
        }
        naxes[i] = (int)m;
        for (Py_ssize_t j = 0; j < m; j++) {
            axes[k] = pool_str(pool, PySequence_Fast_GET_ITEM(e, j), "a mesh axis name");
            if (axes[k] == NULL) {
                Py_DECREF(e);
                Py_DECREF(entries);
                return -1;
            }
            k++;
        }
        Py_DECREF(e);
    }
    Py_DECREF(entries);
    spec->len = (int)n;
    spec->naxes = naxes;
    spec->axes = axes;
    return 0;
}

static PyObject *tuple_i64(const int64_t *v, int n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *py_mesh_check(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *shape, *names, *ids;
    if (!PyArg_ParseTuple(args, "OOO:mesh_check", &shape, &names, &ids)) return NULL;
    str_pool pool = {PyList_New(0)};
    if (pool.refs == NULL) return NULL;
    ct_mesh mesh;
    int rc = parse_mesh(shape, names, ids, &mesh, &pool);
    Py_DECREF(pool.refs);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_layout(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *mshape, *names, *ids, *spec_obj, *shape_obj;
    if (!PyArg_ParseTuple(args, "OOOOO:layout", &mshape, &names, &ids, &spec_obj, &shape_obj))
        return NULL;
    PyObject *result = NULL;
    str_pool pool = {PyList_New(0)};
    if (pool.refs == NULL) return NULL;
    ct_mesh mesh;
    ct_spec spec;
    int naxes[CT_MAX_NDIM];
    const char *axes[CT_MAX_NDIM * CT_MAX_MESH_NDIM];
    if (parse_mesh(mshape, names, ids, &mesh, &pool) < 0) goto done;
    if (parse_spec(spec_obj, &spec, naxes, axes, &pool) < 0) goto done;
    if (shape_obj == Py_None) {
        ct_status st = ct_spec_check(&mesh, &spec);
        if (st != CT_OK) ct_py_raise(st);
        else result = Py_NewRef(Py_None);
        goto done;
    }
    int64_t shape[CT_MAX_NDIM];
    int ndim = ct_py_int64_seq(shape_obj, shape, CT_MAX_NDIM, "array shape");
    if (ndim < 0) goto done;
    ct_layout layout;
    ct_status st = ct_layout_init(&layout, &mesh, &spec, ndim, shape);
    if (st != CT_OK) {
        ct_py_raise(st);
        goto done;
    }
    PyObject *blocks = PyList_New((Py_ssize_t)mesh.size);
    if (blocks == NULL) goto done;
    for (int64_t pos = 0; pos < mesh.size; pos++) {
        int64_t start[CT_MAX_NDIM], rid;
        ct_layout_block(&layout, &mesh, pos, start, &rid);
        PyObject *t = tuple_i64(start, ndim);
        PyObject *item = t ? Py_BuildValue("(NL)", t, (long long)rid) : NULL;
        if (item == NULL) {
            Py_DECREF(blocks);
            goto done;
        }
        PyList_SET_ITEM(blocks, (Py_ssize_t)pos, item);
    }
    PyObject *ss = tuple_i64(layout.shard_shape, ndim);
    if (ss == NULL) {
        Py_DECREF(blocks);
        goto done;
    }
    result = Py_BuildValue("(NNL)", ss, blocks, (long long)layout.num_replicas);
done:
    Py_DECREF(pool.refs);
    return result;
}

/* Check that a numpy array can exchange data with a buffer at `start`. */
static PyArrayObject *host_arg(PyObject *obj, ct_py_buffer *buf, const int64_t *start, int nstart,
                               int writable) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected a numpy array, got %.100s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyDataType_REFCHK(PyArray_DESCR(a))) {
        PyErr_SetString(PyExc_TypeError, "the host array holds Python objects; shards hold raw "
                                         "numbers");
        return NULL;
    }
    if (PyArray_NDIM(a) != buf->ndim || nstart != buf->ndim) {
        PyErr_Format(PyExc_ValueError, "rank mismatch: host array %d, shard %d, start %d",
                     PyArray_NDIM(a), buf->ndim, nstart);
        return NULL;
    }
    if ((size_t)PyArray_ITEMSIZE(a) != ct_dtype_size(buf->dtype)) {
        PyErr_Format(PyExc_TypeError, "item size mismatch: host array %d bytes, shard %s",
                     (int)PyArray_ITEMSIZE(a), ct_dtype_name(buf->dtype));
        return NULL;
    }
    if (writable && !PyArray_ISWRITEABLE(a)) {
        PyErr_SetString(PyExc_ValueError, "the host array is read-only");
        return NULL;
    }
    if (!PyArray_ISNOTSWAPPED(a)) {
        PyErr_SetString(PyExc_ValueError, "the host array must be in native byte order");
        return NULL;
    }
    for (int d = 0; d < buf->ndim; d++) {
        /* (no start + shape: a start near INT64_MAX wrapped and passed) */
        if (start[d] < 0 || start[d] > (int64_t)PyArray_DIM(a, d) - buf->shape[d]) {
            PyErr_Format(PyExc_ValueError, "shard block does not fit the host array in dimension %d",
                         d);
            return NULL;
        }
    }
    return a;
}

static PyObject *copy_host(PyObject *bobj, PyObject *hobj, PyObject *sobj, int to_host);

static PyObject *py_copy_host(PyObject *args, int to_host) {
    PyObject *bobj, *hobj, *sobj;
    if (!PyArg_ParseTuple(args, "OOO", &bobj, &hobj, &sobj)) return NULL;
    return copy_host(bobj, hobj, sobj, to_host);
}

PyObject *ct_py_copy_to_host(PyObject *buffer, PyObject *host, PyObject *start) {
    return copy_host(buffer, host, start, 1);
}

static PyObject *copy_host(PyObject *bobj, PyObject *hobj, PyObject *sobj, int to_host) {
    if (to_host) {
        if (ct_py_trace_host_read(bobj, "a host read (float(x), int(x), bool(x), `if x:`, "
                                        "np.asarray(x), printing)") < 0)
            return NULL;
    } else {
        ct_py_trace_touch(bobj, "a host write");
    }
    /* the start first: reading it may run Python code (__index__), which could delete the
     * buffer after its check */
    int64_t start[CT_MAX_NDIM];
    int n = ct_py_int64_seq(sobj, start, CT_MAX_NDIM, "start");
    if (n < 0) return NULL;
    ct_py_buffer *buf = ct_py_buffer_check(bobj, "buffer");
    if (buf == NULL) return NULL;
    PyArrayObject *a = host_arg(hobj, buf, start, n, to_host);
    if (a == NULL) return NULL;
    int64_t strides[CT_MAX_NDIM];
    for (int d = 0; d < buf->ndim; d++) strides[d] = (int64_t)PyArray_STRIDE(a, d);
    size_t isz = ct_dtype_size(buf->dtype);
    ct_status st;
    ct_py_pin(buf);
    Py_BEGIN_ALLOW_THREADS
    if (to_host)
        st = ct_copy_to_global(buf->dev, buf->ndim, isz, PyArray_DATA(a), strides, buf->data, start,
                               buf->shape);
    else
        st = ct_copy_from_global(buf->dev, buf->ndim, isz, buf->data, start, buf->shape, PyArray_DATA(a),
                                 strides);
    Py_END_ALLOW_THREADS
    ct_py_unpin(buf);
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_copy_from_host(PyObject *self, PyObject *args) {
    (void)self;
    return py_copy_host(args, 0);
}

static PyObject *py_copy_to_host(PyObject *self, PyObject *args) {
    (void)self;
    return py_copy_host(args, 1);
}

static PyObject *py_copy_overlap(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dobj, *dsobj, *sobj, *ssobj;
    if (!PyArg_ParseTuple(args, "OOOO:copy_overlap", &dobj, &dsobj, &sobj, &ssobj)) return NULL;
    int64_t ds[CT_MAX_NDIM], ss[CT_MAX_NDIM];
    int nd = ct_py_int64_seq(dsobj, ds, CT_MAX_NDIM, "destination start");
    if (nd < 0) return NULL;
    int ns = ct_py_int64_seq(ssobj, ss, CT_MAX_NDIM, "source start");
    if (ns < 0) return NULL;
    ct_py_buffer *dst = ct_py_buffer_check(dobj, "destination buffer");
    if (dst == NULL) return NULL;
    ct_py_buffer *src = ct_py_buffer_check(sobj, "source buffer");
    if (src == NULL) return NULL;
    if (nd != dst->ndim || ns != src->ndim || dst->ndim != src->ndim ||
        dst->dtype != src->dtype) {
        PyErr_SetString(PyExc_ValueError, "copy_overlap: rank or dtype mismatch between shards");
        return NULL;
    }
    int64_t copied = 0;
    ct_status st;
    ct_py_pin(dst);
    ct_py_pin(src);
    Py_BEGIN_ALLOW_THREADS
    st = ct_copy_overlap(dst->dev, src->dev, dst->ndim, ct_dtype_size(dst->dtype), dst->data, ds,
                         dst->shape, src->data, ss, src->shape, &copied);
    Py_END_ALLOW_THREADS
    ct_py_unpin(src);
    ct_py_unpin(dst);
    if (st != CT_OK) return ct_py_raise(st);
    return PyLong_FromLongLong((long long)copied);
}

static PyObject *py_copy_bytes(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dobj, *sobj;
    if (!PyArg_ParseTuple(args, "OO:copy_bytes", &dobj, &sobj)) return NULL;
    ct_py_buffer *dst = ct_py_buffer_check(dobj, "destination buffer");
    if (dst == NULL) return NULL;
    ct_py_buffer *src = ct_py_buffer_check(sobj, "source buffer");
    if (src == NULL) return NULL;
    if (dst->nbytes != src->nbytes) {
        PyErr_Format(PyExc_ValueError, "copy_bytes: %zu bytes into %zu", src->nbytes, dst->nbytes);
        return NULL;
    }
    int64_t n = (int64_t)dst->nbytes, one = 1;
    const ct_backend *be =
        dst->dev->platform != CT_PLATFORM_CPU ? dst->dev->backend : src->dev->backend;
    ct_status st;
    ct_py_pin(dst);
    ct_py_pin(src);
    Py_BEGIN_ALLOW_THREADS
    st = be->copy_block(dst->dev, src->dev, 1, &n, 1, dst->data, &one, src->data, &one);
    Py_END_ALLOW_THREADS
    ct_py_unpin(src);
    ct_py_unpin(dst);
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

static PyMethodDef layout_methods[] = {
    {"copy_bytes", py_copy_bytes, METH_VARARGS,
     "copy_bytes($module, dst, src, /)\n--\n\nCopy a whole buffer into another of the same "
     "size (any devices)."},
    {"mesh_check", py_mesh_check, METH_VARARGS,
     "mesh_check($module, device_shape, axis_names, device_ids, /)\n--\n\nValidate a mesh: one "
     "name per axis, unique names, unique devices."},
    {"layout", py_layout, METH_VARARGS,
     "layout($module, device_shape, axis_names, device_ids, spec, shape, /)\n--\n\nValidate a "
     "normalised spec (a tuple of tuples of mesh-axis names) against a mesh and, when shape is "
     "not None, return (shard_shape, [(start, replica_id) per device in mesh order], "
     "num_replicas)."},
    {"copy_from_host", py_copy_from_host, METH_VARARGS,
     "copy_from_host($module, buffer, host, start, /)\n--\n\nFill a shard from the block of a "
     "global host array that starts at `start`."},
    {"copy_to_host", py_copy_to_host, METH_VARARGS,
     "copy_to_host($module, buffer, host, start, /)\n--\n\nWrite a shard into a global host "
     "array at `start`."},
    {"copy_overlap", py_copy_overlap, METH_VARARGS,
     "copy_overlap($module, dst, dst_start, src, src_start, /)\n--\n\nCopy the elements two "
     "shards of one global array share; returns how many."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_layout(PyObject *m) { return PyModule_AddFunctions(m, layout_methods); }
