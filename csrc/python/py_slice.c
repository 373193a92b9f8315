/*
 * py_slice.c — the C path of basic indexing: Array.__getitem__ for x[0], x[1:3], x[:, -1],
 * x[..., None], x[:] on Arrays whose every block holds the whole array (one device, or
 * replicated over a mesh), any dtype.
 *
 * An index that is an int (a Python int or a numpy integer), a slice with step 1 (or None),
 * None, ..., or a tuple of these is parsed here. The result is the indexed region of every
 * block copied into a new buffer on that block's device — ct_copy_overlap, the core copy of the
 * Python path's _C.copy_overlap; a whole block is copied as _C.copy_bytes does — under the
 * sharding the Python path gives its result:
 *   - region whole and shape kept (x[:], x[...], x[()]): x's sharding and x's (start,
 *     replica_id) per block, as the Python path's copy (optim.base.copy_array);
 *   - otherwise: the plan's sharding (ops._sharding_for of x's placement and an unsharded
 *     layout of the result's rank) and its blocks' (device, replica_id), start 0.
 * A plan is made by a Python planner (ctrainstate._src.ops.slicing._getitem_plan) on a miss,
 * once per (x's sharding object, x's rank, the result's rank), and kept in a small cache; the
 * planner's None (a sharded layout) is kept too.
 *
 * Everything else goes to the Python op (`fallback`, slicing.getitem), which decides and
 * raises: advanced indices (arrays, masks, bools, slices with another step), any error (an int
 * out of range, too many indices, two ellipses, a bad slice bound), a donated or deleted
 * operand, a sharded layout, a jit trace recording on this thread (getitem is an op node
 * there), an autodiff tape recording on this thread (the Python op records the slice's vjp).
 * The C path never raises an indexing error of its own, so messages are the Python path's.
 *
 *   array_getitem(x, idx)                Array.__getitem__ (a method descriptor of the type,
 *                                        attached by array.py)
 *   getitem_register(fallback, planner)  the Python op and the planner; once, at import
 *   getitem_cache_info()                 {"hits", "misses", "fallbacks", "entries"}
 *
 * Planner: planner(x, out_ndim) -> None or (tape_local, sharding, devices, replica_ids):
 * tape_local the threading.local whose `tapes` stack says whether a tape records on this
 * thread (ops._tls); devices a tuple of x's blocks' devices in block order (each call checks
 * them by identity) and replica_ids the output blocks' replica ids, one per device.
 */
#include "ct_py.h"

#include <string.h>

#include "../core/ct_backend.h"
#include "../core/ct_copy.h"

/* Copies of fewer bytes than this (all blocks together) on CPU devices run with the GIL held:
 * on small regions releasing and taking it back costs more than the copy. */
#define GI_GIL_BYTES ((size_t)1 << 17)
#define GI_NCACHE 16
/* items of one index: at most CT_MAX_NDIM ints and slices, CT_MAX_NDIM Nones, one ... */
#define GI_MAX_ITEMS (2 * CT_MAX_NDIM + 1)

typedef struct {
    PyObject *sharding; /* key: x's sharding object (held, so its address stays unique) */
    int in_ndim, out_ndim;
    int ok;                 /* 0: the planner said None (the Python op for this kind) */
    PyObject *out_sharding; /* the result's sharding (a region or a new rank) */
    PyObject *devices;      /* tuple: x's blocks' devices, in block order */
    PyObject *rids;         /* tuple: the result's blocks' replica ids */
    PyObject *zeros;        /* tuple: out_ndim zeros (every block's start) */
} gi_entry;

static PyObject *gi_fallback, *gi_planner, *gi_tls, *gi_trace_active, *gi_tapes_name;
static gi_entry gi_cache[GI_NCACHE];
static int gi_next;
static unsigned long long gi_hits, gi_misses, gi_falls;

static void entry_clear(gi_entry *e) {
    Py_CLEAR(e->sharding);
    Py_CLEAR(e->out_sharding);
    Py_CLEAR(e->devices);
    Py_CLEAR(e->rids);
    Py_CLEAR(e->zeros);
    e->ok = 0;
}

/* The parsed index: the region x[starts : starts + sizes] (x's rank) and the result's shape. */
typedef struct {
    int nd, out_nd;
    int64_t shape[CT_MAX_NDIM], starts[CT_MAX_NDIM], sizes[CT_MAX_NDIM];
    int64_t out[CT_MAX_NDIM];
} gi_index;

enum { IT_INT = 0, IT_SLICE, IT_NONE, IT_ELLIPSIS };

/* The value of an int index (a Python int or a numpy integer): 1, or 0 when it is another
 * kind of index (a bool is a 0-d mask; an int subclass, whose int() the Python op calls, is
 * left to it) or does not fit (no exception set either way). */
static int int_index(PyObject *o, int64_t *v) {
    PyObject *idx;
    if (PyLong_CheckExact(o)) {
        idx = Py_NewRef(o);
    } else if (PyArray_IsScalar(o, Integer)) {
        idx = PyNumber_Index(o);
        if (idx == NULL) {
            PyErr_Clear();
            return 0;
        }
    } else {
        return 0;
    }
    int overflow = 0;
    long long r = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (overflow || (r == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *v = (int64_t)r;
    return 1;
}

/* Parse `idx` against x's shape (gi->nd, gi->shape): 1 when it is a basic index the C path
 * takes, 0 otherwise (the Python op's case; no exception set). */
static int parse_index(PyObject *idx, gi_index *gi) {
    PyObject *const *items = &idx;
    Py_ssize_t n = 1;
    if (PyTuple_Check(idx)) {
        items = &PyTuple_GET_ITEM(idx, 0);
        n = PyTuple_GET_SIZE(idx);
    }
    if (n > GI_MAX_ITEMS) return 0;
    int kind[GI_MAX_ITEMS];
    int64_t ival[GI_MAX_ITEMS];
    int used = 0, nell = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *o = items[k];
        if (o == Py_None) {
            kind[k] = IT_NONE;
        } else if (o == Py_Ellipsis) {
            kind[k] = IT_ELLIPSIS;
            nell++;
        } else if (PySlice_Check(o)) {
            PyObject *step = ((PySliceObject *)o)->step;
            if (step != Py_None && !PyLong_CheckExact(step)) {
                /* (a step given some other way: the Python op reads it with its own rules) */
                return 0;
            }
            kind[k] = IT_SLICE;
            used++;
        } else if (int_index(o, &ival[k])) {
            kind[k] = IT_INT;
            used++;
        } else {
            return 0;
        }
    }
    if (nell > 1 || used > gi->nd) return 0;
    const int fill = gi->nd - used; /* dimensions ... (or the end) takes whole */
    int d = 0, j = 0;
    for (Py_ssize_t k = 0; k <= n; k++) {
        if (k == n || kind[k] == IT_ELLIPSIS) {
            if (k == n && nell) break;
            for (int f = 0; f < fill; f++, d++) {
                if (j >= CT_MAX_NDIM) return 0;
                gi->starts[d] = 0;
                gi->sizes[d] = gi->shape[d];
                gi->out[j++] = gi->shape[d];
            }
            continue;
        }
        if (kind[k] == IT_NONE) {
            if (j >= CT_MAX_NDIM) return 0;
            gi->out[j++] = 1;
            continue;
        }
        const int64_t len = gi->shape[d];
        if (kind[k] == IT_INT) {
            int64_t v = ival[k];
            if (v < -len || v >= len) return 0; /* (IndexError: the Python op's message) */
            gi->starts[d] = v < 0 ? v + len : v;
            gi->sizes[d] = 1;
            d++;
            continue;
        }
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(items[k], &start, &stop, &step) < 0) {
            PyErr_Clear();
            return 0;
        }
        if (step != 1) return 0;
        Py_ssize_t m = PySlice_AdjustIndices((Py_ssize_t)len, &start, &stop, step);
        if (j >= CT_MAX_NDIM) return 0;
        gi->starts[d] = start;
        gi->sizes[d] = m;
        gi->out[j++] = m;
        d++;
    }
    gi->out_nd = j;
    return 1;
}

/* Whether a tape records on this thread (_tape() is not None): 0 no, 1 yes or unknown. */
static int tape_recording(void) {
    if (gi_tls == NULL) return 1;
    PyObject *stack = ct_py_tls_getattr(gi_tls, gi_tapes_name);
    if (stack == NULL) {
        PyErr_Clear();
        return 1;
    }
    int rec;
    if (stack == Py_None) {
        rec = 0;
    } else if (PyList_CheckExact(stack)) {
        const Py_ssize_t n = PyList_GET_SIZE(stack);
        rec = n > 0 && PyList_GET_ITEM(stack, n - 1) != Py_None;
    } else {
        rec = 1;
    }
    Py_DECREF(stack);
    return rec;
}

/* Whether a jit trace records on this thread (_C.trace_active()): 0 no, 1 yes or unknown. */
static int trace_recording(void) {
    if (gi_trace_active == NULL) return 1;
    PyObject *r = PyObject_CallNoArgs(gi_trace_active);
    if (r == NULL) {
        PyErr_Clear();
        return 1;
    }
    int rec = r != Py_False;
    Py_DECREF(r);
    return rec;
}

/* The plan for x's sharding and these ranks: a cached entry or the planner's, made now.
 * NULL with an exception when the planner fails or returns something malformed. */
static gi_entry *lookup(ct_py_array *x, int in_nd, int out_nd) {
    for (int i = 0; i < GI_NCACHE; i++) {
        gi_entry *e = &gi_cache[i];
        if (e->sharding == x->sharding && e->in_ndim == in_nd && e->out_ndim == out_nd) return e;
    }
    if (gi_planner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "array_getitem: no planner (getitem_register)");
        return NULL;
    }
    gi_misses++;
    PyObject *sharding = Py_NewRef(x->sharding);
    PyObject *r = PyObject_CallFunction(gi_planner, "Oi", (PyObject *)x, out_nd);
    if (r == NULL) {
        Py_DECREF(sharding);
        return NULL;
    }
    PyObject *tls = NULL, *out_sh = NULL, *devs = NULL, *rids = NULL, *zeros = NULL;
    int ok = 0;
    if (r != Py_None) {
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 4 ||
            !PyTuple_CheckExact(PyTuple_GET_ITEM(r, 2)) ||
            !PyTuple_CheckExact(PyTuple_GET_ITEM(r, 3)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(r, 2)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(r, 3)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(r, 2)) < 1) {
            PyErr_Format(PyExc_TypeError,
                         "array_getitem: the planner returned %R, not None or (tape_local, "
                         "sharding, devices, replica_ids) with one replica id per device",
                         r);
            Py_DECREF(r);
            Py_DECREF(sharding);
            return NULL;
        }
        tls = Py_NewRef(PyTuple_GET_ITEM(r, 0));
        out_sh = Py_NewRef(PyTuple_GET_ITEM(r, 1));
        devs = Py_NewRef(PyTuple_GET_ITEM(r, 2));
        rids = Py_NewRef(PyTuple_GET_ITEM(r, 3));
        zeros = PyTuple_New(out_nd);
        if (zeros == NULL) goto fail;
        for (int d = 0; d < out_nd; d++) {
            PyObject *z = PyLong_FromLong(0);
            if (z == NULL) goto fail;
            PyTuple_SET_ITEM(zeros, d, z);
        }
        ok = 1;
    }
    Py_DECREF(r);
    /* (the planner ran Python code: the slot is taken now, whatever it held) */
    gi_entry *e = &gi_cache[gi_next];
    gi_next = (gi_next + 1) % GI_NCACHE;
    entry_clear(e);
    e->sharding = sharding;
    e->in_ndim = in_nd;
    e->out_ndim = out_nd;
    e->ok = ok;
    e->out_sharding = out_sh;
    e->devices = devs;
    e->rids = rids;
    e->zeros = zeros;
    if (tls != NULL) Py_XSETREF(gi_tls, tls);
    return e;
fail:
    Py_XDECREF(tls);
    Py_XDECREF(out_sh);
    Py_XDECREF(devs);
    Py_XDECREF(rids);
    Py_XDECREF(zeros);
    Py_DECREF(sharding);
    return NULL;
}

static PyObject *fallback(PyObject *x, PyObject *idx) {
    if (gi_fallback == NULL) {
        PyErr_SetString(PyExc_ImportError,
                        "ctrainstate: '_slicing' is used before its module was imported (import "
                        "ctrainstate first)");
        return NULL;
    }
    gi_falls++;
    PyObject *args[2] = {x, idx};
    return PyObject_Vectorcall(gi_fallback, args, 2, NULL);
}

/* One block's copy: the region of src (x's shape) into dst (the result's block), or the
 * whole buffer when the region is the whole array. */
static ct_status copy_block(ct_py_buffer *dst, ct_py_buffer *src, const gi_index *gi, int whole) {
    if (dst->nbytes == 0) return CT_OK;
    const ct_backend *be =
        dst->dev->platform != CT_PLATFORM_CPU ? dst->dev->backend : src->dev->backend;
    if (whole) { /* as _C.copy_bytes */
        int64_t n = (int64_t)dst->nbytes, one = 1;
        return be->copy_block(dst->dev, src->dev, 1, &n, 1, dst->data, &one, src->data, &one);
    }
    static const int64_t zero[CT_MAX_NDIM];
    int64_t copied = 0;
    return ct_copy_overlap(dst->dev, src->dev, gi->nd, ct_dtype_size(dst->dtype), dst->data,
                           gi->starts, gi->sizes, src->data, zero, gi->shape, &copied);
}

/* The C path; NULL without an exception when the call is the Python op's. */
static PyObject *fast_getitem(ct_py_array *x, PyObject *idx) {
    if (x->donated != Py_False || x->shape == NULL || !PyTuple_CheckExact(x->shape) ||
        x->blocks == NULL || !PyList_CheckExact(x->blocks) || x->sharding == NULL ||
        x->dtype == NULL)
        return NULL;
    gi_index gi;
    const Py_ssize_t nd = PyTuple_GET_SIZE(x->shape);
    if (nd > CT_MAX_NDIM) return NULL;
    gi.nd = (int)nd;
    for (int d = 0; d < gi.nd; d++) {
        PyObject *s = PyTuple_GET_ITEM(x->shape, d);
        if (!PyLong_CheckExact(s)) return NULL;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(s, &overflow);
        if (overflow || v < 0) {
            PyErr_Clear();
            return NULL;
        }
        gi.shape[d] = (int64_t)v;
    }
    if (!parse_index(idx, &gi)) return NULL;
    if (trace_recording()) return NULL;
    gi_entry *e = lookup(x, gi.nd, gi.out_nd);
    if (e == NULL) return NULL; /* (the planner's exception propagates) */
    if (!e->ok || tape_recording()) return NULL;

    int whole = 1; /* the region is the whole array */
    for (int d = 0; d < gi.nd; d++) whole &= gi.sizes[d] == gi.shape[d];
    int same_shape = whole && gi.out_nd == gi.nd; /* (then out == shape) */
    for (int d = 0; same_shape && d < gi.nd; d++) same_shape = gi.out[d] == gi.shape[d];

    /* every block: (device, Buffer, start, rid), the plan's device, x's whole shape */
    PyObject *blocks = PySequence_Tuple(x->blocks); /* (holds the blocks while Python may run) */
    if (blocks == NULL) return NULL;
    const Py_ssize_t nblk = PyTuple_GET_SIZE(blocks);
    PyObject *devs = Py_NewRef(e->devices), *rids = Py_NewRef(e->rids);
    PyObject *zeros = Py_NewRef(e->zeros), *out_sh = Py_NewRef(e->out_sharding);
    PyObject *out_blocks = NULL, *shape = NULL, *res = NULL;
    ct_py_buffer **outs = NULL;
    Py_ssize_t made = 0;
    int fall = 1, dt = -1;
    size_t total = 0;
    int on_cpu = 1;
    if (nblk != PyTuple_GET_SIZE(devs)) goto done;
    for (Py_ssize_t i = 0; i < nblk; i++) {
        PyObject *b = PyTuple_GET_ITEM(blocks, i);
        if (!PyTuple_CheckExact(b) || PyTuple_GET_SIZE(b) != 4 ||
            PyTuple_GET_ITEM(b, 0) != PyTuple_GET_ITEM(devs, i) ||
            !Py_IS_TYPE(PyTuple_GET_ITEM(b, 1), &ct_py_BufferType))
            goto done;
        ct_py_buffer *buf = (ct_py_buffer *)PyTuple_GET_ITEM(b, 1);
        if (buf->deleted || buf->ndim != gi.nd || (dt >= 0 && (int)buf->dtype != dt)) goto done;
        if (gi.nd > 0 && memcmp(buf->shape, gi.shape, (size_t)gi.nd * sizeof gi.shape[0]) != 0)
            goto done;
        dt = (int)buf->dtype;
        on_cpu &= buf->dev->platform == CT_PLATFORM_CPU;
    }
    fall = 0;
    outs = PyMem_Calloc((size_t)nblk, sizeof *outs);
    if (outs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; made < nblk; made++) {
        ct_py_buffer *src = (ct_py_buffer *)PyTuple_GET_ITEM(PyTuple_GET_ITEM(blocks, made), 1);
        outs[made] = ct_py_buffer_alloc(src->dev, gi.out_nd, gi.out, (ct_dtype)dt);
        if (outs[made] == NULL) goto done;
        total += outs[made]->nbytes;
    }
    /* (allocating may have run Python code: a block deleted meanwhile is the Python op's) */
    for (Py_ssize_t i = 0; i < nblk; i++)
        if (((ct_py_buffer *)PyTuple_GET_ITEM(PyTuple_GET_ITEM(blocks, i), 1))->deleted) {
            fall = 1;
            goto done;
        }
    ct_status st = CT_OK;
    if (on_cpu && total < GI_GIL_BYTES) {
        for (Py_ssize_t i = 0; i < nblk && st == CT_OK; i++)
            st = copy_block(outs[i], (ct_py_buffer *)PyTuple_GET_ITEM(PyTuple_GET_ITEM(blocks, i), 1),
                            &gi, whole);
    } else { /* pinned: another thread may drop or delete x meanwhile */
        for (Py_ssize_t i = 0; i < nblk; i++)
            ct_py_pin((ct_py_buffer *)PyTuple_GET_ITEM(PyTuple_GET_ITEM(blocks, i), 1));
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < nblk && st == CT_OK; i++)
            st = copy_block(outs[i], (ct_py_buffer *)PyTuple_GET_ITEM(PyTuple_GET_ITEM(blocks, i), 1),
                            &gi, whole);
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < nblk; i++)
            ct_py_unpin((ct_py_buffer *)PyTuple_GET_ITEM(PyTuple_GET_ITEM(blocks, i), 1));
    }
    if (st != CT_OK) {
        ct_py_raise(st);
        goto done;
    }
    out_blocks = PyList_New(nblk);
    if (out_blocks == NULL) goto done;
    for (Py_ssize_t i = 0; i < nblk; i++) {
        PyObject *b = PyTuple_GET_ITEM(blocks, i);
        PyObject *start = same_shape ? PyTuple_GET_ITEM(b, 2) : zeros;
        PyObject *rid = same_shape ? PyTuple_GET_ITEM(b, 3) : PyTuple_GET_ITEM(rids, i);
        PyObject *t = PyTuple_Pack(4, PyTuple_GET_ITEM(b, 0), (PyObject *)outs[i], start, rid);
        if (t == NULL) goto done;
        PyList_SET_ITEM(out_blocks, i, t);
    }
    if (same_shape) {
        shape = Py_NewRef(x->shape);
        res = ct_py_array_new(Py_NewRef(shape), Py_NewRef(x->dtype), Py_NewRef(x->sharding),
                              Py_NewRef(out_blocks), Py_NewRef(x->shard_shape));
    } else {
        shape = PyTuple_New(gi.out_nd);
        if (shape == NULL) goto done;
        for (int d = 0; d < gi.out_nd; d++) {
            PyObject *v = PyLong_FromLongLong((long long)gi.out[d]);
            if (v == NULL) goto done;
            PyTuple_SET_ITEM(shape, d, v);
        }
        /* (every block holds the whole result: the shard shape is the shape) */
        res = ct_py_array_new(Py_NewRef(shape), Py_NewRef(x->dtype), Py_NewRef(out_sh),
                              Py_NewRef(out_blocks), Py_NewRef(shape));
    }
    if (res != NULL) gi_hits++;
done:
    if (outs != NULL) {
        for (Py_ssize_t i = 0; i < made; i++) Py_XDECREF((PyObject *)outs[i]);
        PyMem_Free(outs);
    }
    Py_XDECREF(out_blocks);
    Py_XDECREF(shape);
    Py_DECREF(blocks);
    Py_DECREF(devs);
    Py_DECREF(rids);
    Py_DECREF(zeros);
    Py_DECREF(out_sh);
    if (res == NULL && fall) PyErr_Clear(); /* (nothing raised on the way to a fallback) */
    return res;
}

static PyObject *array_getitem(PyObject *self, PyObject *idx) {
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    if (!Py_IS_TYPE(self, at))
        return PyErr_Format(PyExc_TypeError, "array_getitem: expected an Array, got %s",
                            Py_TYPE(self)->tp_name);
    PyObject *r = fast_getitem((ct_py_array *)self, idx);
    if (r != NULL || PyErr_Occurred()) return r;
    return fallback(self, idx);
}

static PyObject *py_getitem_register(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2)
        return PyErr_Format(PyExc_TypeError, "getitem_register takes 2 arguments (%zd given)", n);
    if (!PyCallable_Check(args[0]) || !PyCallable_Check(args[1]))
        return PyErr_Format(PyExc_TypeError,
                            "getitem_register: fallback and planner must be callable, got %s "
                            "and %s",
                            Py_TYPE(args[0])->tp_name, Py_TYPE(args[1])->tp_name);
    Py_XSETREF(gi_fallback, Py_NewRef(args[0]));
    Py_XSETREF(gi_planner, Py_NewRef(args[1]));
    for (int i = 0; i < GI_NCACHE; i++) entry_clear(&gi_cache[i]); /* (the old planner's) */
    Py_RETURN_NONE;
}

static PyObject *py_getitem_cache_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int entries = 0;
    for (int i = 0; i < GI_NCACHE; i++) entries += gi_cache[i].sharding != NULL;
    return Py_BuildValue("{sKsKsKsi}", "hits", gi_hits, "misses", gi_misses, "fallbacks",
                         gi_falls, "entries", entries);
}

static PyMethodDef getitem_def = {
    "__getitem__", array_getitem, METH_O,
    "__getitem__($self, idx, /)\n--\n\n"
    "``x[idx]`` with numpy's indexing, as ``jax.Array`` (any dtype; differentiable for the\n"
    "float dtypes): ints, slices of any step, ``None``, ``...``, integer arrays (numpy arrays,\n"
    "lists, integer Arrays; broadcast together and placed as numpy places them) and boolean\n"
    "masks with concrete values. Out-of-range entries of an index array are clamped, as jax's\n"
    "gathers; a Python int out of range raises ``IndexError``. Dimensions taken whole keep\n"
    "their mesh axes; indexed ones come out unsharded (see :mod:`ctrainstate._src.ops.slicing`).\n"
    "Basic indices of an Array that every device holds whole run in C (csrc/python/py_slice.c)."};

static PyMethodDef slice_methods[] = {
    {"getitem_register", (PyCFunction)(void (*)(void))py_getitem_register, METH_FASTCALL,
     "getitem_register(fallback, planner, /)\n--\n\n"
     "The Python op behind Array.__getitem__ (every index the C path does not take) and the\n"
     "planner of its C path: planner(x, out_ndim) -> None or (tape_local, sharding, devices,\n"
     "replica_ids). Clears the plan cache."},
    {"getitem_cache_info", py_getitem_cache_info, METH_NOARGS,
     "getitem_cache_info()\n--\n\n"
     "Counters of Array.__getitem__'s C path: hits (results made in C), misses (plans made),\n"
     "fallbacks (calls of the Python op), entries (plans cached)."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_slice(PyObject *m) {
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return -1;
    gi_tapes_name = PyUnicode_InternFromString("tapes");
    if (gi_tapes_name == NULL) return -1;
    gi_trace_active = PyObject_GetAttrString(m, "trace_active"); /* (py_dispatch.c's) */
    if (gi_trace_active == NULL) return -1;
    if (PyModule_AddFunctions(m, slice_methods) < 0) return -1;
    PyObject *descr = PyDescr_NewMethod(at, &getitem_def);
    if (descr == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "array_getitem", descr);
    Py_DECREF(descr);
    return rc;
}
