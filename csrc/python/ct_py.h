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
extern PyObject *ct_py_ConcretizationTypeError;

/* Raise the Python exception for the core's last error on this thread; returns NULL. */
PyObject *ct_py_raise(ct_status st);

/* A block of device memory owned by one device (see py_buffer.c). */
typedef struct {
    PyObject_HEAD
    /* what a step reads of every buffer first, in the refcount's cache line */
    Py_ssize_t busy;    /* calls using the memory without the GIL (ct_py_pin) */
    int deleted;
    int borrowed;       /* the memory is another's (a jitted program's arena): never freed here */
    ct_dtype dtype;
    Py_ssize_t plan_refs; /* persistent optimizer plans holding it (py_optim_plan.c) */
    ct_device *dev;
    void *data;
    size_t nbytes;
    int ndim;
    int64_t shape[CT_MAX_NDIM];
    Py_ssize_t exports; /* live buffer-protocol views */
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

/* Persistent optimizer plans (_C.OptimPlan) stepping now, without the GIL. A buffer that a
 * plan holds (plan_refs > 0) is not deleted while any plan steps: a plan does not pin its
 * thousands of buffers one by one per step (py_optim_plan.c). Changed with the GIL held. */
extern Py_ssize_t ct_py_plans_running;
/* Deletions of buffers that plans hold, ever: a plan looks for deleted buffers among its
 * own only when this changed since it last looked. */
extern uint64_t ct_py_plan_deletions;

/* PyArg "O&" converters that reject what does not fit instead of truncating it: an integer
 * (anything with __index__) in [0, 2**32) into a uint32_t, in [INT_MIN, INT_MAX] into an
 * int; OverflowError / TypeError otherwise. */
int ct_py_conv_u32(PyObject *obj, void *out);
int ct_py_conv_int(PyObject *obj, void *out);

/* Convert a Python sequence of ints into int64 values; returns ndim or -1 with an exception. */
int ct_py_int64_seq(PyObject *seq, int64_t *out, int max, const char *what);

/* ctrainstate.Array, a C type (py_array.c). The Python layer reads and writes the fields by
 * their member names (_shape, _dtype, ...); every field is set once an Array exists. */
typedef struct {
    PyObject_HEAD
    PyObject *shape;       /* tuple of ints */
    PyObject *dtype;       /* numpy dtype */
    PyObject *sharding;
    PyObject *blocks;      /* list of (device, _C.Buffer, start, replica_id) */
    PyObject *shard_shape; /* tuple */
    PyObject *host_scalar; /* the host value of a 0-d counter, or None */
    PyObject *base;        /* the Array this one views, or None */
    PyObject *donated;     /* False, or True once donated */
    PyObject *weakreflist;
    PyObject *idkey;       /* id(self) as an int, made on first use (ct_py_idkey), or NULL */
} ct_py_array;

enum {
    CT_PY_A_SHAPE, CT_PY_A_DTYPE, CT_PY_A_SHARDING, CT_PY_A_BLOCKS, CT_PY_A_SHARD_SHAPE,
    CT_PY_A_HOST_SCALAR, CT_PY_A_BASE, CT_PY_A_DONATED, CT_PY_A_COUNT
};
/* The Array type, or NULL (RuntimeError set) before module init. */
PyTypeObject *ct_py_array_type(void);
/* The address of field s (CT_PY_A_*) of Array a: a borrowed value. */
PyObject **ct_py_array_slot(PyObject *a, int s);
/* A new Array with the given fields (references stolen, released on failure), host scalar
 * and base None, not donated. */
PyObject *ct_py_array_new(PyObject *shape, PyObject *dtype, PyObject *sharding, PyObject *blocks,
                          PyObject *shard_shape);
/* 0 when the Array is neither donated nor holds a deleted buffer, else -1 with
 * DonatedBufferError. */
int ct_py_array_check_alive(PyObject *a);
/* obj.name for the package's threading.local objects read on the hot path (their attributes
 * plain values, defaults on the class), with one dict lookup; PyObject_GetAttr otherwise. */
PyObject *ct_py_tls_getattr(PyObject *obj, PyObject *name);
/* obj.name (a new reference, or NULL with an exception), read straight from the instance
 * dict where the type has no attribute of that name, and at its offset where the type's is an
 * object field (a C member, a __slots__ entry); else the attribute lookup (py_rules.c). */
PyObject *ct_py_attr(PyObject *obj, PyObject *name);
/* A kernel or copy is about to use this Buffer: while a program records (ctrainstate.jit), one
 * that holds a traced value breaks the program (py_dispatch.c). Never raises. */
void ct_py_trace_touch(const void *buffer, const char *what);
/* A host read of `buffer` (a copy to the host, a view of its memory): -1 with
 * ConcretizationTypeError when it is a value traced by the program recording on this thread
 * (jit's semantics: a traced value is not known on the host), else 0. */
int ct_py_trace_host_read(const void *buffer, const char *what);
/* Write a buffer's block into the host numpy array `host` at `start` (_C.copy_to_host). */
PyObject *ct_py_copy_to_host(PyObject *buffer, PyObject *host, PyObject *start);
/* id(x) as a new reference. An Array keeps the int it made first and gives that one again,
 * so that the tape's sets and dicts keyed by ids (autodiff) find it by identity, with no
 * new int and no comparison of values. */
PyObject *ct_py_idkey(PyObject *x);
/* New Arrays owning items[i]'s blocks, the old ones marked donated (Array._moved_all).
 * Every item must be an Array that is neither donated nor a view: otherwise nothing
 * changes, *bad is its index and NULL is returned without an exception (TypeError for a
 * non-Array; *bad = -1 then, and on MemoryError). */
PyObject *ct_py_move_arrays(PyObject *const *items, Py_ssize_t n, Py_ssize_t *bad);

/* A new Buffer of `shape` and `dtype` on `dev` (uninitialised); NULL with an exception. */
ct_py_buffer *ct_py_buffer_alloc(ct_device *dev, int ndim, const int64_t *shape, ct_dtype dtype);
/* A Buffer of that shape and dtype on `dev` whose memory is borrowed (data NULL until the
 * owner points it somewhere): dealloc never frees it. Only for memory that its owner keeps
 * alive while the Buffer is used, and never handed to Python code. */
ct_py_buffer *ct_py_buffer_borrowed(ct_device *dev, int ndim, const int64_t *shape, ct_dtype dtype);

/* The Array's arithmetic slots (py_dispatch.c): the primitives add, subtract, multiply,
 * divide, negative, matmul, each with its C plan cache, the Python op on a miss. */
PyObject *ct_py_array_nb_add(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_subtract(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_multiply(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_true_divide(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_negative(PyObject *a);
PyObject *ct_py_array_nb_matmul(PyObject *a, PyObject *b);
PyObject *ct_py_array_richcompare(PyObject *a, PyObject *b, int op);
PyObject *ct_py_array_nb_and(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_or(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_xor(PyObject *a, PyObject *b);
PyObject *ct_py_array_nb_invert(PyObject *a);

int ct_py_init_devices(PyObject *m);
int ct_py_init_buffer(PyObject *m);
int ct_py_init_layout(PyObject *m);
int ct_py_init_ops(PyObject *m);
int ct_py_init_dlpack(PyObject *m);
int ct_py_init_rules(PyObject *m);  /* py_rules.c: axis rules context + resolution */
int ct_py_init_random(PyObject *m);
int ct_py_init_optim(PyObject *m);  /* py_optim.c: fused optimizer step */
int ct_py_init_optim_plan(PyObject *m); /* py_optim_plan.c: the persistent step plan */
int ct_py_init_array(PyObject *m);  /* py_array.c: the Array type; moving Arrays' buffers */
int ct_py_init_dispatch(PyObject *m); /* py_dispatch.c: primitives, their plan caches */
int ct_py_init_module(PyObject *m); /* py_module.c: nn.Module method calls, submodule attach */
/* py_module.c: Module.apply(variables, *args)'s common case (args[0] the variables), the
 * output, `miss` (returned as it is) where the Python apply must run, or NULL with an
 * exception (ModuleApply in py_rules.c calls it) */
PyObject *ct_py_module_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *miss);
int ct_py_init_slice(PyObject *m);  /* py_slice.c: basic indexing (Array.__getitem__) */
int ct_py_init_tree(PyObject *m);   /* py_tree.c: argument trees flattened by a spec (jit) */
int ct_py_init_dist(PyObject *m);   /* py_dist.c: MPI process engine, host collectives */

#endif /* CT_PY_H */
