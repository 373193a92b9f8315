/*
 * ct_py.h — shared declarations of the CPython bindings (ctrainstate._C).
 *
 * The bindings parse arguments, convert Python objects to core types once,
 * release the GIL around copies and kernels, and turn a core ct_status into a
 * Python exception. They do no math. Each csrc/python/py_*.c file exports one
 * `int ct_py_init_<part>(PyObject *module)` that module.c calls in order.
 */
#ifndef CT_PY_H
#define CT_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef CT_PY_NUMPY_IMPORT
#define NO_IMPORT_ARRAY
#endif
#define PY_ARRAY_UNIQUE_SYMBOL ct_py_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "../core/ct_device.h"
#include "../core/ct_dtype.h"
#include "../core/ct_layout.h"
#include "../core/ct_status.h"

/* Exceptions (created in module.c). */
extern PyObject *ct_py_ResourceExhaustedError;
extern PyObject *ct_py_DonatedBufferError;

/* Raise the Python exception for the core's last error on this thread; returns NULL. */
PyObject *ct_py_raise(ct_status st);

/* A block of device memory owned by one device (see py_buffer.c). */
typedef struct {
    PyObject_HEAD
    ct_device *dev;
    void *data;
    size_t nbytes;
    ct_dtype dtype;
    int ndim;
    int64_t shape[CT_MAX_NDIM];
    Py_ssize_t exports; /* live buffer-protocol views */
    Py_ssize_t busy;    /* calls using the memory without the GIL (ct_py_pin) */
    int deleted;
    PyObject *weakreflist;
} ct_py_buffer;

extern PyTypeObject ct_py_BufferType;

/* The live buffer behind `obj`, or NULL with TypeError / DonatedBufferError set. */
ct_py_buffer *ct_py_buffer_check(PyObject *obj, const char *what);

/* Pin a buffer that a call will use without the GIL: a reference and a busy count, so that
 * neither deallocation nor delete() frees the memory meanwhile (delete() raises instead).
 * Both with the GIL held; every pin is undone by one ct_py_unpin. */
static inline void ct_py_pin(ct_py_buffer *b) {
    Py_INCREF(b);
    b->busy++;
}
static inline void ct_py_unpin(ct_py_buffer *b) {
    b->busy--;
    Py_DECREF(b);
}

/* PyArg "O&" converters that reject what does not fit instead of truncating it: an integer
 * (anything with __index__) in [0, 2**32) into a uint32_t, in [INT_MIN, INT_MAX] into an
 * int; OverflowError / TypeError otherwise. */
int ct_py_conv_u32(PyObject *obj, void *out);
int ct_py_conv_int(PyObject *obj, void *out);

/* Convert a Python sequence of ints into int64 values; returns ndim or -1 with an exception. */
int ct_py_int64_seq(PyObject *seq, int64_t *out, int max, const char *what);

int ct_py_init_devices(PyObject *m);
int ct_py_init_buffer(PyObject *m);
int ct_py_init_layout(PyObject *m);
int ct_py_init_ops(PyObject *m);
int ct_py_init_dlpack(PyObject *m);
int ct_py_init_rules(PyObject *m);  /* py_rules.c: axis rules context + resolution */
int ct_py_init_random(PyObject *m);
int ct_py_init_optim(PyObject *m);  /* py_optim.c: fused optimizer step */
int ct_py_init_array(PyObject *m);  /* py_array.c: moving Arrays' buffers (in-place steps) */
int ct_py_init_dist(PyObject *m);   /* py_dist.c: MPI process engine, host collectives */

#endif /* CT_PY_H */
