/*
 * py_buffer.c — ctrainstate._C.Buffer: one device allocation.
 *
 * A Buffer is the storage of one shard. It owns `nbytes` bytes on one device,
 * accounted by ct_device_alloc. CPU buffers export the buffer protocol (raw
 * bytes, writable) so numpy views need no copy; a buffer with live views, or
 * one that a call is using without the GIL (pinned: ct_py_pin), cannot be
 * deleted.
 */
#include "ct_py.h"

#include <string.h>

ct_py_buffer *ct_py_buffer_check(PyObject *obj, const char *what) {
    if (!PyObject_TypeCheck(obj, &ct_py_BufferType)) {
        PyErr_Format(PyExc_TypeError, "%s must be a ctrainstate._C.Buffer, got %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    ct_py_buffer *b = (ct_py_buffer *)obj;
    if (b->deleted) {
        PyErr_Format(ct_py_DonatedBufferError, "%s: the buffer was deleted or donated", what);
        return NULL;
    }
    ct_py_trace_touch(b, what);
    return b;
}

/* A Buffer of n bytes on dev (shape and dtype checked by the caller). */
static ct_py_buffer *buffer_make(PyTypeObject *type, ct_device *dev, int ndim,
                                 const int64_t *shape, ct_dtype dtype, size_t n) {
    void *data = NULL;
    ct_status st = ct_device_alloc(dev, n, &data);
    if (st != CT_OK) {
        ct_py_raise(st);
        return NULL;
    }
    ct_py_buffer *self = (ct_py_buffer *)type->tp_alloc(type, 0);
    if (self == NULL) {
        ct_device_free(dev, data, n);
        return NULL;
    }
    self->dev = dev;
    self->data = data;
    self->nbytes = n;
    self->dtype = dtype;
    self->ndim = ndim;
    if (ndim > 0) memcpy(self->shape, shape, (size_t)ndim * sizeof shape[0]);
    return self;
}

static PyObject *buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"device_id", "shape", "dtype", NULL};
    int device_id, dtype;
    PyObject *shape_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOi:Buffer", kwlist, &device_id, &shape_obj,
                                     &dtype))
        return NULL;
    if (dtype < 0 || dtype >= CT_NUM_DTYPES) {
        PyErr_Format(PyExc_ValueError, "invalid dtype code %d", dtype);
        return NULL;
    }
    int64_t shape[CT_MAX_NDIM];
    int ndim = ct_py_int64_seq(shape_obj, shape, CT_MAX_NDIM, "shape");
    if (ndim < 0) return NULL;
    size_t n = ct_dtype_size((ct_dtype)dtype);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            PyErr_Format(PyExc_ValueError, "shape has a negative dimension %lld",
                         (long long)shape[i]);
            return NULL;
        }
        if (shape[i] != 0 && n > SIZE_MAX / (size_t)shape[i]) {
            PyErr_SetString(PyExc_ValueError, "buffer size overflows");
            return NULL;
        }
        n *= (size_t)shape[i];
    }
    ct_device *dev = ct_device_by_id(device_id);
    if (dev == NULL) return ct_py_raise(CT_EINVAL);
    return (PyObject *)buffer_make(type, dev, ndim, shape, (ct_dtype)dtype, n);
}

ct_py_buffer *ct_py_buffer_alloc(ct_device *dev, int ndim, const int64_t *shape, ct_dtype dtype) {
    size_t n = ct_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) n *= (size_t)shape[i]; /* the callers' shapes were checked */
    return buffer_make(&ct_py_BufferType, dev, ndim, shape, dtype, n);
}

ct_py_buffer *ct_py_buffer_borrowed(ct_device *dev, int ndim, const int64_t *shape, ct_dtype dtype) {
    ct_py_buffer *self = (ct_py_buffer *)ct_py_BufferType.tp_alloc(&ct_py_BufferType, 0);
    if (self == NULL) return NULL;
    size_t n = ct_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
    self->dev = dev;
    self->borrowed = 1;
    self->nbytes = n;
    self->dtype = dtype;
    self->ndim = ndim;
    if (ndim > 0) memcpy(self->shape, shape, (size_t)ndim * sizeof shape[0]);
    return self;
}

static void buffer_release_memory(ct_py_buffer *self) {
    if (self->borrowed) { /* (not this Buffer's to free) */
        self->data = NULL;
        self->deleted = 1;
        return;
    }
    if (!self->deleted && self->dev != NULL) {
        ct_device_free(self->dev, self->data, self->nbytes);
        self->data = NULL;
        self->deleted = 1;
        if (self->plan_refs > 0) ct_py_plan_deletions++; /* plans check their buffers again */
    }
}

static void buffer_dealloc(ct_py_buffer *self) {
    if (self->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    buffer_release_memory(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 0 if the memory of `self` may be freed now, else -1 with RuntimeError set. */
static int buffer_deletable(const ct_py_buffer *self) {
    if (self->exports > 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "cannot delete a buffer with %zd live view(s) (numpy or DLPack); drop them first",
                     self->exports);
        return -1;
    }
    if (self->busy > 0 || (self->plan_refs > 0 && ct_py_plans_running > 0)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cannot delete a buffer that an operation running in another thread is "
                        "using; delete it after that operation returns");
        return -1;
    }
    return 0;
}

static PyObject *buffer_delete(ct_py_buffer *self, PyObject *noargs) {
    (void)noargs;
    if (buffer_deletable(self) < 0) return NULL;
    buffer_release_memory(self);
    Py_RETURN_NONE;
}

/* delete_buffers(buffers): every buffer checked first, then all freed, or none (an Array's
 * shards: no Array left with some shards freed). Already deleted ones are skipped. */
static PyObject *py_delete_buffers(PyObject *self, PyObject *seq) {
    (void)self;
    PyObject *fast = PySequence_Fast(seq, "delete_buffers needs a sequence of Buffers");
    if (fast == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyObject_TypeCheck(o, &ct_py_BufferType)) {
            PyErr_Format(PyExc_TypeError, "delete_buffers: item %zd is a %.100s, not a "
                         "ctrainstate._C.Buffer", i, Py_TYPE(o)->tp_name);
            Py_DECREF(fast);
            return NULL;
        }
        if (buffer_deletable((ct_py_buffer *)o) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        ct_py_trace_touch(o, "deleting a buffer");
    }
    /* nothing below runs Python code: the checks still hold */
    for (Py_ssize_t i = 0; i < n; i++)
        buffer_release_memory((ct_py_buffer *)PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

static PyMethodDef buffer_module_methods[] = {
    {"delete_buffers", py_delete_buffers, METH_O,
     "delete_buffers($module, buffers, /)\n--\n\nFree the memory of every Buffer in the "
     "sequence, or of none: fails (RuntimeError) if any has live views or is in use by an "
     "operation in another thread."},
    {NULL, NULL, 0, NULL},
};

static int buffer_getbuffer(ct_py_buffer *self, Py_buffer *view, int flags) {
    if (ct_py_trace_host_read(self, "a host view (the buffer protocol, np.asarray(x))") < 0) {
        view->obj = NULL;
        return -1;
    }
    if (self->deleted) {
        PyErr_SetString(ct_py_DonatedBufferError, "the buffer was deleted or donated");
        view->obj = NULL;
        return -1;
    }
    if (self->dev->platform != CT_PLATFORM_CPU) {
        PyErr_SetString(PyExc_BufferError, "only CPU buffers can be viewed from the host");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->data, (Py_ssize_t)self->nbytes, 0, flags) <
        0)
        return -1;
    self->exports++;
    return 0;
}

static void buffer_releasebuffer(ct_py_buffer *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

static PyBufferProcs buffer_as_buffer = {
    (getbufferproc)buffer_getbuffer,
    (releasebufferproc)buffer_releasebuffer,
};

static PyObject *buffer_get_device_id(ct_py_buffer *self, void *c) {
    (void)c;
    return PyLong_FromLong(ct_device_global_id(self->dev));
}
static PyObject *buffer_get_nbytes(ct_py_buffer *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->nbytes);
}
static PyObject *buffer_get_dtype(ct_py_buffer *self, void *c) {
    (void)c;
    return PyLong_FromLong((long)self->dtype);
}
static PyObject *buffer_get_deleted(ct_py_buffer *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->deleted);
}
static PyObject *buffer_get_shape(ct_py_buffer *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New(self->ndim);
    if (t == NULL) return NULL;
    for (int i = 0; i < self->ndim; i++) {
        PyObject *v = PyLong_FromLongLong((long long)self->shape[i]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyGetSetDef buffer_getset[] = {
    {"device_id", (getter)buffer_get_device_id, NULL, "Global id of the owning device.", NULL},
    {"nbytes", (getter)buffer_get_nbytes, NULL, "Size in bytes.", NULL},
    {"dtype", (getter)buffer_get_dtype, NULL, "Core dtype code.", NULL},
    {"shape", (getter)buffer_get_shape, NULL, "Shape of the block this buffer stores.", NULL},
    {"is_deleted", (getter)buffer_get_deleted, NULL, "True once the memory was released.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef buffer_methods[] = {
    {"delete", (PyCFunction)buffer_delete, METH_NOARGS,
     "delete($self, /)\n--\n\nRelease the memory now (fails while numpy views exist)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject ct_py_BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ctrainstate._C.Buffer",
    .tp_basicsize = sizeof(ct_py_buffer),
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_as_buffer = &buffer_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Buffer(device_id, shape, dtype)\n--\n\nUninitialised storage of one shard on one "
              "device (dtype is a core dtype code).",
    .tp_weaklistoffset = offsetof(ct_py_buffer, weakreflist),
    .tp_methods = buffer_methods,
    .tp_getset = buffer_getset,
    .tp_new = buffer_new,
};

int ct_py_init_buffer(PyObject *m) {
    if (PyType_Ready(&ct_py_BufferType) < 0) return -1;
    if (PyModule_AddFunctions(m, buffer_module_methods) < 0) return -1;
    return PyModule_AddObjectRef(m, "Buffer", (PyObject *)&ct_py_BufferType);
}
