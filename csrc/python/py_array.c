/*
 * py_array.c — ctrainstate.Array, a C type (PyType_FromSpec), and the host-side hot loop of
 * an in-place optimizer step (handing Arrays' buffers to new Arrays).
 *
 * An Array is a global shape and dtype, a sharding, and one block per device of the sharding:
 * `_blocks`, a list of (device, _C.Buffer, start, replica_id) tuples. The fields are C
 * members (ct_py_array, ct_py.h) that the Python layer reads and writes by their historical
 * names (`_shape`, `_dtype`, `_sharding`, `_blocks`, `_shard_shape`, `_host_scalar`, `_base`,
 * `_donated`); the C code (the dispatcher, the optimizer plans) reads them directly.
 *
 * What runs on every call is C: the arithmetic slots (+ - * / and unary -, through the
 * primitives of py_dispatch.c; @ too), `shape`, `dtype`, `ndim`, `sharding`, `_check_alive`,
 * `_create`, `_moved`. The rest (repr, indexing, conversions, pickling, notebook views) is
 * Python, written in python/ctrainstate/array.py and attached to this type once at import by
 * `_C.array_type_extend`; after that the type is immutable. It has no subclasses.
 *
 *   Array._create(shape, dtype, sharding, blocks)   a new Array (shard shape from sharding)
 *   a._moved()                                      a new Array owning a's blocks; a donated
 *   move_arrays(arrays)                             [a._moved() for a in arrays], all or none
 *   array_type_extend(namespace)                    attach the Python methods, then freeze
 */
#include "ct_py.h"

#include <stddef.h>
#include <structmember.h>

static PyTypeObject *array_type; /* a strong reference, set once at module init */

static const Py_ssize_t slot_off[CT_PY_A_COUNT] = {
    offsetof(ct_py_array, shape),       offsetof(ct_py_array, dtype),
    offsetof(ct_py_array, sharding),    offsetof(ct_py_array, blocks),
    offsetof(ct_py_array, shard_shape), offsetof(ct_py_array, host_scalar),
    offsetof(ct_py_array, base),        offsetof(ct_py_array, donated),
};

PyObject **ct_py_array_slot(PyObject *a, int s) { return (PyObject **)((char *)a + slot_off[s]); }

PyTypeObject *ct_py_array_type(void) {
    if (array_type == NULL)
        PyErr_SetString(PyExc_RuntimeError, "ctrainstate._C.Array is not initialised");
    return array_type;
}

/* A new Array with every field set (references stolen); NULL on MemoryError (the stolen
 * references are released). */
PyObject *ct_py_array_new(PyObject *shape, PyObject *dtype, PyObject *sharding, PyObject *blocks,
                          PyObject *shard_shape) {
    ct_py_array *a = (ct_py_array *)array_type->tp_alloc(array_type, 0);
    if (a == NULL) {
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        Py_XDECREF(sharding);
        Py_XDECREF(blocks);
        Py_XDECREF(shard_shape);
        return NULL;
    }
    a->shape = shape;
    a->dtype = dtype;
    a->sharding = sharding;
    a->blocks = blocks;
    a->shard_shape = shard_shape;
    a->host_scalar = Py_NewRef(Py_None);
    a->base = Py_NewRef(Py_None);
    a->donated = Py_NewRef(Py_False);
    return (PyObject *)a;
}

PyObject *ct_py_idkey(PyObject *x) {
    if (!Py_IS_TYPE(x, array_type)) return PyLong_FromVoidPtr(x);
    ct_py_array *a = (ct_py_array *)x;
    if (a->idkey == NULL && (a->idkey = PyLong_FromVoidPtr(x)) == NULL) return NULL;
    return Py_NewRef(a->idkey);
}

static PyObject *array_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)type;
    (void)args;
    (void)kwds;
    PyErr_SetString(PyExc_TypeError,
                    "Arrays are created with ctrainstate.device_put(...) or ctrainstate ops");
    return NULL;
}

static void array_dealloc(ct_py_array *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->sharding);
    Py_CLEAR(self->blocks);
    Py_CLEAR(self->shard_shape);
    Py_CLEAR(self->host_scalar);
    Py_CLEAR(self->base);
    Py_CLEAR(self->donated);
    Py_CLEAR(self->idkey);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Array._create(shape, dtype, sharding, blocks): blocks is a list of (device, buffer, start,
 * replica_id), one per device of the sharding (taken as it is, not copied). */
static PyObject *array_create(PyObject *cls, PyObject *const *args, Py_ssize_t nargs) {
    (void)cls;
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "Array._create takes 4 arguments (%zd given)", nargs);
    PyObject *shape = PySequence_Tuple(args[0]);
    if (shape == NULL) return NULL;
    PyArray_Descr *descr = NULL;
    if (!PyArray_DescrConverter(args[1], &descr)) {
        Py_DECREF(shape);
        return NULL;
    }
    PyObject *ss = PyObject_CallMethod(args[2], "shard_shape", "(O)", shape);
    if (ss == NULL) {
        Py_DECREF(shape);
        Py_DECREF(descr);
        return NULL;
    }
    return ct_py_array_new(shape, (PyObject *)descr, Py_NewRef(args[2]), Py_NewRef(args[3]), ss);
}

static PyObject *donated_error(void) {
    PyErr_SetString(ct_py_DonatedBufferError,
                    "this Array was donated: its buffers now belong to the result of the call it "
                    "was passed to (e.g. TrainState.apply_gradients updates params and optimizer "
                    "state in place); use the returned value instead");
    return NULL;
}

/* 0 when the Array may be read: not donated, no block deleted; else -1 with
 * DonatedBufferError (the messages of the Python layer). */
int ct_py_array_check_alive(PyObject *o) {
    ct_py_array *a = (ct_py_array *)o;
    if (a->donated == NULL || a->blocks == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Array has no blocks");
        return -1;
    }
    if (a->donated != Py_False) {
        int t = PyObject_IsTrue(a->donated);
        if (t < 0) return -1;
        if (t) {
            donated_error();
            return -1;
        }
    }
    PyObject *fast = PySequence_Fast(a->blocks, "Array._blocks");
    if (fast == NULL) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *blk = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyTuple_Check(blk) || PyTuple_GET_SIZE(blk) < 2) continue;
        PyObject *b = PyTuple_GET_ITEM(blk, 1);
        int deleted;
        if (Py_IS_TYPE(b, &ct_py_BufferType)) {
            deleted = ((ct_py_buffer *)b)->deleted;
        } else { /* another buffer type (a test's stand-in): ask it */
            PyObject *d = PyObject_GetAttrString(b, "is_deleted");
            if (d == NULL) {
                Py_DECREF(fast);
                return -1;
            }
            deleted = PyObject_IsTrue(d);
            Py_DECREF(d);
            if (deleted < 0) {
                Py_DECREF(fast);
                return -1;
            }
        }
        if (deleted) {
            Py_DECREF(fast);
            PyErr_SetString(ct_py_DonatedBufferError, "this Array has been deleted");
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *array_check_alive(PyObject *self, PyObject *noargs) {
    (void)noargs;
    if (ct_py_array_check_alive(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *view_error(void) {
    PyErr_SetString(PyExc_ValueError,
                    "this Array is a view of another Array's shard (Shard.data): it cannot be "
                    "donated or updated in place (e.g. as TrainState params); pass a copy, "
                    "cts.device_put(np.asarray(x), x.sharding)");
    return NULL;
}

/* a._moved(): a new Array owning a's blocks (the same list); a is donated. Only donation is
 * checked (the callers validated the buffers earlier in the same step; a deleted buffer
 * still raises when the new Array is used). */
static PyObject *array_moved(PyObject *self, PyObject *noargs) {
    (void)noargs;
    ct_py_array *a = (ct_py_array *)self;
    if (a->donated != Py_False) {
        int t = PyObject_IsTrue(a->donated);
        if (t < 0) return NULL;
        if (t) return donated_error();
    }
    if (a->base != Py_None) return view_error();
    if (PyList_Check(a->blocks) && PyList_GET_SIZE(a->blocks) > 0 &&
        PyTuple_Check(PyList_GET_ITEM(a->blocks, 0)) && PyTuple_GET_SIZE(PyList_GET_ITEM(a->blocks, 0)) > 1)
        ct_py_trace_touch(PyTuple_GET_ITEM(PyList_GET_ITEM(a->blocks, 0), 1), "donating a value");
    ct_py_array *nw = (ct_py_array *)array_type->tp_alloc(array_type, 0);
    if (nw == NULL) return NULL;
    nw->shape = Py_XNewRef(a->shape);
    nw->dtype = Py_XNewRef(a->dtype);
    nw->sharding = Py_XNewRef(a->sharding);
    nw->blocks = Py_XNewRef(a->blocks);
    nw->shard_shape = Py_XNewRef(a->shard_shape);
    nw->host_scalar = Py_XNewRef(a->host_scalar); /* same buffers, same value */
    nw->base = Py_NewRef(Py_None);
    nw->donated = Py_NewRef(Py_False);
    Py_XSETREF(a->donated, Py_NewRef(Py_True));
    return (PyObject *)nw;
}

PyObject *ct_py_move_arrays(PyObject *const *items, Py_ssize_t n, Py_ssize_t *bad) {
    *bad = -1;
    if (ct_py_array_type() == NULL) return NULL;
    /* every check before any change */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = items[i];
        if (!Py_IS_TYPE(a, array_type))
            return PyErr_Format(PyExc_TypeError, "move_arrays: item %zd is a %s, not an Array", i,
                                Py_TYPE(a)->tp_name);
        /* identity tests only (no __bool__ runs): anything but False / None (unset
         * included) is left to the caller's Array._moved, which raises for it */
        ct_py_array *x = (ct_py_array *)a;
        if (x->donated != Py_False || x->base != Py_None) {
            *bad = i;
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        ct_py_array *nw = (ct_py_array *)array_type->tp_alloc(array_type, 0);
        if (nw == NULL) { /* nothing donated yet: the old Arrays stay as they were */
            Py_DECREF(out);
            return NULL;
        }
        ct_py_array *a = (ct_py_array *)items[i];
        nw->shape = Py_XNewRef(a->shape);
        nw->dtype = Py_XNewRef(a->dtype);
        nw->sharding = Py_XNewRef(a->sharding);
        nw->blocks = Py_XNewRef(a->blocks);
        nw->shard_shape = Py_XNewRef(a->shard_shape);
        nw->host_scalar = Py_XNewRef(a->host_scalar);
        nw->base = Py_NewRef(Py_None);
        nw->donated = Py_NewRef(Py_False);
        PyList_SET_ITEM(out, i, (PyObject *)nw);
    }
    for (Py_ssize_t i = 0; i < n; i++) /* the new Arrays exist: now donate the old ones */
        Py_XSETREF(((ct_py_array *)items[i])->donated, Py_NewRef(Py_True));
    return out;
}

static PyObject *py_move_arrays(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg) && !PyTuple_Check(arg))
        return PyErr_Format(PyExc_TypeError, "move_arrays: expected a list of Arrays, got %s",
                            Py_TYPE(arg)->tp_name);
    /* a tuple of our own: the items stay alive and in place whatever code runs below (a
     * garbage collection during tp_alloc may run finalizers) */
    PyObject *seq = PySequence_Tuple(arg);
    if (seq == NULL) return NULL;
    Py_ssize_t bad;
    PyObject *out = ct_py_move_arrays(&PyTuple_GET_ITEM(seq, 0), PyTuple_GET_SIZE(seq), &bad);
    Py_DECREF(seq);
    if (out == NULL && bad >= 0) return PyLong_FromSsize_t(bad);
    return out;
}

static PyObject *unset(const char *name) {
    return PyErr_Format(PyExc_AttributeError, "Array field %s is unset", name);
}

static PyObject *array_get_shape(ct_py_array *self, void *c) {
    (void)c;
    return self->shape ? Py_NewRef(self->shape) : unset("_shape");
}

static PyObject *array_get_dtype(ct_py_array *self, void *c) {
    (void)c;
    return self->dtype ? Py_NewRef(self->dtype) : unset("_dtype");
}

static PyObject *array_get_sharding(ct_py_array *self, void *c) {
    (void)c;
    return self->sharding ? Py_NewRef(self->sharding) : unset("_sharding");
}

static PyObject *array_get_ndim(ct_py_array *self, void *c) {
    (void)c;
    if (self->shape == NULL) return unset("_shape");
    Py_ssize_t n = PyObject_Length(self->shape);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

/* --- host conversions ------------------------------------------------------------------ */

/* The product of a tuple of ints (-1 with an exception set). */
static long long tuple_prod(PyObject *t) {
    long long n = 1;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(t); d++) {
        long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(t, d));
        if (s == -1 && PyErr_Occurred()) return -1;
        n *= s;
    }
    return n;
}

/* Whether the bytes of block i (a replica) are copied from another block of `blocks`:
 * a primary (replica id 0) anywhere, or an earlier replica, with the same start (-1 on
 * error). */
static int copied_elsewhere(PyObject *blocks, Py_ssize_t i) {
    PyObject *start = PyTuple_GET_ITEM(PyList_GET_ITEM(blocks, i), 2);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(blocks); j++) {
        PyObject *b = PyList_GET_ITEM(blocks, j);
        if (j == i || !PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 4) continue;
        long rid = PyLong_AsLong(PyTuple_GET_ITEM(b, 3));
        if (rid == -1 && PyErr_Occurred()) return -1;
        if (rid != 0 && j > i) continue;
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(b, 2), start, Py_EQ);
        if (same != 0) return same;
    }
    return 0;
}

/* The Array gathered into a new numpy array of its dtype: each block with replica id 0
 * written at its start. An Array of several processes holds only this process's blocks:
 * where their primaries (replica id 0) do not cover it, a replica of each missing block
 * is read instead (a value replicated across processes), and where no block covers it
 * RuntimeError names the fix (jax's message). */
static PyObject *array_gather(PyObject *self) {
    ct_py_array *a = (ct_py_array *)self;
    if (ct_py_array_check_alive(self) < 0) return NULL;
    if (a->shape == NULL || !PyTuple_Check(a->shape) || a->dtype == NULL ||
        !PyArray_DescrCheck(a->dtype) || !PyList_Check(a->blocks)) {
        PyErr_SetString(PyExc_TypeError, "Array: shape, dtype or blocks of the wrong type");
        return NULL;
    }
    const Py_ssize_t nd = PyTuple_GET_SIZE(a->shape);
    if (nd > CT_MAX_NDIM) return PyErr_Format(PyExc_ValueError, "Array: rank %zd", nd);
    npy_intp dims[CT_MAX_NDIM];
    for (Py_ssize_t d = 0; d < nd; d++) {
        dims[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(a->shape, d));
        if (dims[d] == -1 && PyErr_Occurred()) return NULL;
    }
    Py_INCREF(a->dtype); /* (PyArray_Empty steals the descriptor) */
    PyObject *out = PyArray_Empty((int)nd, dims, (PyArray_Descr *)a->dtype, 0);
    if (out == NULL) return NULL;
    PyObject *blocks = Py_NewRef(a->blocks);
    long long total = 1, each = 0, covered = 0;
    for (Py_ssize_t d = 0; d < nd; d++) total *= (long long)dims[d];
    if (a->shard_shape == NULL || !PyTuple_Check(a->shard_shape)) {
        PyErr_SetString(PyExc_TypeError, "Array: shard shape is not a tuple");
        goto fail;
    }
    each = tuple_prod(a->shard_shape);
    if (each < 0) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 4) {
            PyErr_SetString(PyExc_TypeError, "Array: a block is not (device, buffer, start, rid)");
            goto fail;
        }
        long rid = PyLong_AsLong(PyTuple_GET_ITEM(b, 3));
        if (rid == -1 && PyErr_Occurred()) goto fail;
        if (rid != 0) continue; /* a replica: its primary block has the same bytes */
        PyObject *r = ct_py_copy_to_host(PyTuple_GET_ITEM(b, 1), out, PyTuple_GET_ITEM(b, 2));
        if (r == NULL) goto fail;
        Py_DECREF(r);
        covered += each;
    }
    if (covered < total) { /* this process's part of an Array of several processes */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks) && covered < total; i++) {
            PyObject *b = PyList_GET_ITEM(blocks, i);
            long rid = PyLong_AsLong(PyTuple_GET_ITEM(b, 3));
            if (rid == -1 && PyErr_Occurred()) goto fail;
            if (rid == 0) continue; /* copied above */
            int seen = copied_elsewhere(blocks, i);
            if (seen < 0) goto fail;
            if (seen) continue;
            PyObject *r = ct_py_copy_to_host(PyTuple_GET_ITEM(b, 1), out, PyTuple_GET_ITEM(b, 2));
            if (r == NULL) goto fail;
            Py_DECREF(r);
            covered += each;
        }
        if (covered < total) {
            PyErr_SetString(PyExc_RuntimeError,
                            "Fetching the value of an Array that spans devices of other "
                            "processes (not fully addressable) is not possible: use "
                            "ctrainstate.experimental.multihost_utils.process_allgather(x) to "
                            "gather it to every process, or x.addressable_shards to read this "
                            "process's shards");
            goto fail;
        }
    }
    Py_DECREF(blocks);
    return out;
fail:
    Py_DECREF(blocks);
    Py_DECREF(out);
    return NULL;
}

static PyObject *array_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    static const char *const names[] = {"dtype", "copy"};
    PyObject *vals[2] = {Py_None, Py_None};
    const Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 2) return PyErr_Format(PyExc_TypeError, "__array__ takes at most 2 arguments");
    for (Py_ssize_t i = 0; i < nargs; i++) vals[i] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < 2 && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) j++;
        if (j == 2 || j < nargs)
            return PyErr_Format(PyExc_TypeError, "__array__() got an unexpected keyword %R", key);
        vals[j] = args[nargs + k];
    }
    /* (copy: the result is always a new array, which every value of copy allows) */
    PyArray_Descr *want = NULL;
    if (vals[0] != Py_None && !PyArray_DescrConverter(vals[0], &want)) return NULL;
    PyObject *out = array_gather(self);
    if (out == NULL || want == NULL) {
        Py_XDECREF(want);
        return out;
    }
    if (PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)out), want)) {
        Py_DECREF(want);
        return out;
    }
    PyObject *cast = PyArray_CastToType((PyArrayObject *)out, want, 0); /* (steals want) */
    Py_DECREF(out);
    return cast;
}

/* The one element as a Python scalar (item()); ValueError for any other size. */
static PyObject *array_item(PyObject *self, PyObject *noargs) {
    (void)noargs;
    ct_py_array *a = (ct_py_array *)self;
    if (a->shape == NULL || !PyTuple_Check(a->shape)) {
        PyErr_SetString(PyExc_TypeError, "Array: shape is not a tuple");
        return NULL;
    }
    int64_t n = 1;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(a->shape); d++) {
        long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(a->shape, d));
        if (s == -1 && PyErr_Occurred()) return NULL;
        n *= s;
    }
    if (n != 1) {
        PyErr_SetString(PyExc_ValueError, "item() needs an Array of one element");
        return NULL;
    }
    PyObject *host = array_gather(self);
    if (host == NULL) return NULL;
    PyObject *v = PyArray_GETITEM((PyArrayObject *)host, PyArray_DATA((PyArrayObject *)host));
    Py_DECREF(host);
    return v;
}

static PyObject *array_float(PyObject *self) {
    PyObject *v = array_item(self, NULL);
    if (v == NULL) return NULL;
    PyObject *f = PyNumber_Float(v);
    Py_DECREF(v);
    return f;
}

static PyObject *array_int(PyObject *self) {
    PyObject *v = array_item(self, NULL);
    if (v == NULL) return NULL;
    PyObject *i = PyNumber_Long(v);
    Py_DECREF(v);
    return i;
}

/* `if loss < 1.0:` reads the one element; a larger Array has no single truth value. */
static int array_bool(PyObject *self) {
    PyObject *v = array_item(self, NULL);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError))
            PyErr_SetString(PyExc_ValueError,
                            "The truth value of an array with more than one element is "
                            "ambiguous. Use a.any() or a.all()");
        return -1;
    }
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* --- DLPack ----------------------------------------------------------------------------- */

/* The buffer a whole-Array export hands out (a new reference): the first block's, when every
 * block starts at the origin (one device, or replicated); BufferError otherwise. */
static PyObject *single_buffer(PyObject *self) {
    ct_py_array *a = (ct_py_array *)self;
    if (ct_py_array_check_alive(self) < 0) return NULL;
    if (!PyList_Check(a->blocks) || PyList_GET_SIZE(a->blocks) < 1) {
        PyErr_SetString(PyExc_TypeError, "Array: no blocks");
        return NULL;
    }
    PyObject *first = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a->blocks); i++) {
        PyObject *b = PyList_GET_ITEM(a->blocks, i);
        if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 4) {
            PyErr_SetString(PyExc_TypeError, "Array: a block is not (device, buffer, start, rid)");
            return NULL;
        }
        if (first == NULL) {
            first = b;
            continue;
        }
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(b, 2), PyTuple_GET_ITEM(first, 2), Py_EQ);
        if (same < 0) return NULL;
        if (!same) {
            PyErr_SetString(PyExc_BufferError,
                            "a sharded Array has no single buffer to export; export a shard "
                            "instead: array.addressable_shards[i].data");
            return NULL;
        }
    }
    return Py_NewRef(PyTuple_GET_ITEM(first, 1));
}

static PyObject *array_dlpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    PyObject *buf = single_buffer(self);
    if (buf == NULL) return NULL;
    PyObject *name = PyUnicode_InternFromString("__dlpack__");
    PyObject *meth = name != NULL ? PyObject_GetAttr(buf, name) : NULL;
    Py_XDECREF(name);
    Py_DECREF(buf);
    if (meth == NULL) return NULL;
    PyObject *r = PyObject_Vectorcall(meth, args, (size_t)nargs, kwnames);
    Py_DECREF(meth);
    return r;
}

static PyObject *array_dlpack_device(PyObject *self, PyObject *noargs) {
    (void)noargs;
    PyObject *buf = single_buffer(self);
    if (buf == NULL) return NULL;
    PyObject *r = PyObject_CallMethod(buf, "__dlpack_device__", NULL);
    Py_DECREF(buf);
    return r;
}

static PyMemberDef array_members[] = {
    {"_shape", T_OBJECT_EX, offsetof(ct_py_array, shape), 0, "The global shape (a tuple)."},
    {"_dtype", T_OBJECT_EX, offsetof(ct_py_array, dtype), 0, "The numpy dtype."},
    {"_sharding", T_OBJECT_EX, offsetof(ct_py_array, sharding), 0, "The Sharding."},
    {"_blocks", T_OBJECT_EX, offsetof(ct_py_array, blocks), 0,
     "One (device, _C.Buffer, start, replica_id) per device of the sharding."},
    {"_shard_shape", T_OBJECT_EX, offsetof(ct_py_array, shard_shape), 0,
     "The shape of each device's block."},
    {"_host_scalar", T_OBJECT_EX, offsetof(ct_py_array, host_scalar), 0,
     "The value of a 0-d Array whose every write went through the optimizers' counter helpers "
     "(no device read needed); None: unknown."},
    {"_base", T_OBJECT_EX, offsetof(ct_py_array, base), 0,
     "The Array whose buffer this one views (a GPU Shard.data), or None."},
    {"_donated", T_OBJECT_EX, offsetof(ct_py_array, donated), 0,
     "True once the buffers were handed to another Array (donation) or the view was deleted."},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ct_py_array, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef array_getset[] = {
    {"shape", (getter)array_get_shape, NULL, "The global shape.", NULL},
    {"dtype", (getter)array_get_dtype, NULL, "The dtype (numpy).", NULL},
    {"sharding", (getter)array_get_sharding, NULL, "How the Array is laid out on devices.", NULL},
    {"ndim", (getter)array_get_ndim, NULL, "The number of dimensions.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef array_type_methods[] = {
    {"_create", (PyCFunction)(void (*)(void))array_create, METH_FASTCALL | METH_CLASS,
     "_create(shape, dtype, sharding, blocks)\n--\n\n"
     "A new Array; blocks: a list of (device, buffer, start, replica_id), one per device of "
     "the sharding."},
    {"_moved", array_moved, METH_NOARGS,
     "_moved($self, /)\n--\n\n"
     "A new Array owning this one's buffers (the same blocks); this one becomes donated."},
    {"__array__", (PyCFunction)(void (*)(void))array_array, METH_FASTCALL | METH_KEYWORDS,
     "__array__($self, dtype=None, copy=None)\n--\n\n"
     "The Array gathered to a new numpy array (of `dtype` when given): the bytes of each\n"
     "block, replicas read once."},
    {"__dlpack__", (PyCFunction)(void (*)(void))array_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__($self, stream=None, **kwargs)\n--\n\n"
     "Export (no copy) when the Array is held whole by each device (one device, or\n"
     "replicated): the first device's buffer (Buffer.__dlpack__, whose arguments these are);\n"
     "BufferError for a sharded Array."},
    {"__dlpack_device__", array_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(device type, device id) of the buffer __dlpack__ exports."},
    {"item", array_item, METH_NOARGS,
     "item($self, /)\n--\n\nThe one element as a Python scalar (ValueError for another size)."},
    {"_check_alive", array_check_alive, METH_NOARGS,
     "_check_alive($self, /)\n--\n\n"
     "DonatedBufferError if the Array was donated or a buffer deleted."},
    {NULL, NULL, 0, NULL},
};

/* Identity hashing, object's (the comparison slot would otherwise leave the type
 * unhashable): Arrays stay usable as identity keys (plans, caches), as jax.Array. */
static Py_hash_t array_hash(PyObject *self) { return PyBaseObject_Type.tp_hash(self); }

/* Slots from py_dispatch.c: the arithmetic and comparison operators go through the
 * primitives. */
static PyType_Slot array_slots[] = {
    {Py_tp_new, array_tp_new},
    {Py_tp_dealloc, array_dealloc},
    {Py_tp_members, array_members},
    {Py_tp_getset, array_getset},
    {Py_tp_methods, array_type_methods},
    {Py_nb_add, ct_py_array_nb_add},
    {Py_nb_subtract, ct_py_array_nb_subtract},
    {Py_nb_multiply, ct_py_array_nb_multiply},
    {Py_nb_true_divide, ct_py_array_nb_true_divide},
    {Py_nb_negative, ct_py_array_nb_negative},
    {Py_nb_matrix_multiply, ct_py_array_nb_matmul},
    {Py_tp_richcompare, ct_py_array_richcompare},
    {Py_nb_and, ct_py_array_nb_and},
    {Py_nb_or, ct_py_array_nb_or},
    {Py_nb_xor, ct_py_array_nb_xor},
    {Py_nb_invert, ct_py_array_nb_invert},
    {Py_tp_hash, array_hash},
    {Py_nb_float, array_float},
    {Py_nb_int, array_int},
    {Py_nb_bool, array_bool},
    {0, NULL},
};

static PyType_Spec array_spec = {
    .name = "ctrainstate.Array",
    .basicsize = sizeof(ct_py_array),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = array_slots,
};

/* array_type_extend(namespace): set every entry of `namespace` (a class's __dict__ merged
 * over its bases, from python/ctrainstate/array.py) that the C type does not define itself
 * as an attribute of the type (dunder methods update the type's slots), then make the type
 * immutable. Once only. */
static PyObject *py_array_type_extend(PyObject *self, PyObject *ns) {
    (void)self;
    if (ct_py_array_type() == NULL) return NULL;
    if (array_type->tp_flags & Py_TPFLAGS_IMMUTABLETYPE) {
        PyErr_SetString(PyExc_RuntimeError, "array_type_extend: the Array type is already complete");
        return NULL;
    }
    if (!PyDict_Check(ns))
        return PyErr_Format(PyExc_TypeError, "array_type_extend: expected a dict, got %s",
                            Py_TYPE(ns)->tp_name);
    static const char *const skip[] = {"__module__", "__qualname__", "__dict__", "__weakref__",
                                       "__slots__", "__init__", "__new__", "__init_subclass__",
                                       "__subclasshook__", "__class__", "__getattribute__",
                                       "__setattr__", "__delattr__", NULL};
    PyObject *own = array_type->tp_dict;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(ns, &pos, &key, &value)) {
        if (!PyUnicode_Check(key)) continue;
        int skipped = 0;
        for (int i = 0; skip[i] != NULL && !skipped; i++)
            skipped = PyUnicode_CompareWithASCIIString(key, skip[i]) == 0;
        if (skipped) continue;
        if (PyUnicode_CompareWithASCIIString(key, "__doc__") != 0) {
            PyObject *have = PyDict_GetItemWithError(own, key);
            if (have == NULL && PyErr_Occurred()) return NULL;
            if (have != NULL) continue; /* defined in C */
        }
        if (PyObject_SetAttr((PyObject *)array_type, key, value) < 0) return NULL;
    }
    array_type->tp_flags |= Py_TPFLAGS_IMMUTABLETYPE;
    PyType_Modified(array_type);
    Py_RETURN_NONE;
}

static PyMethodDef array_methods[] = {
    {"move_arrays", py_move_arrays, METH_O,
     "move_arrays(arrays, /)\n--\n\n"
     "New Arrays owning the given Arrays' buffers; the given ones are marked donated. If one\n"
     "is already donated or is a view, nothing changes and its index is returned."},
    {"array_type_extend", py_array_type_extend, METH_O,
     "array_type_extend(namespace, /)\n--\n\n"
     "Attach the Python methods in `namespace` (those the C type does not define) to\n"
     "ctrainstate.Array, then make the type immutable. Once, at import."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_array(PyObject *m) {
    if (PyModule_AddFunctions(m, array_methods) < 0) return -1;
    PyObject *t = PyType_FromSpec(&array_spec);
    if (t == NULL) return -1;
    array_type = (PyTypeObject *)t; /* the module keeps another reference */
    /* __module__ is "ctrainstate" (from the dotted name): repr, pickling by reference */
    return PyModule_AddObjectRef(m, "Array", t);
}
