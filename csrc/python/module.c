/*
 * module.c — the ctrainstate._C extension module: exceptions, error
 * conversion and the registration of every binding file.
 */
#define CT_PY_NUMPY_IMPORT
#include "ct_py.h"

PyObject *ct_py_ResourceExhaustedError;
PyObject *ct_py_DonatedBufferError;
PyObject *ct_py_ConcretizationTypeError;

PyObject *ct_py_raise(ct_status st) {
    const char *msg = ct_last_error();
    PyObject *type;
    switch (st) {
    case CT_EINVAL: type = PyExc_ValueError; break;
    case CT_ETYPE: type = PyExc_TypeError; break;
    case CT_EOOM: type = ct_py_ResourceExhaustedError; break;
    case CT_EDONATED: type = ct_py_DonatedBufferError; break;
    default: type = PyExc_RuntimeError; break;
    }
    PyErr_SetString(type, msg && *msg ? msg : "ctrainstate: unknown error");
    ct_clear_error();
    return NULL;
}

int ct_py_int64_seq(PyObject *seq, int64_t *out, int max, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > max) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries; at most %d are supported", what, n, max);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *idx = PyNumber_Index(item);
        if (idx == NULL) {
            PyErr_Format(PyExc_TypeError, "%s must contain integers, got %R", what, item);
            Py_DECREF(fast);
            return -1;
        }
        long long v = PyLong_AsLongLong(idx);
        if (v == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError,
                             "%s: %R is out of range (values must fit in a signed 64-bit integer)",
                             what, idx);
            }
            Py_DECREF(idx);
            Py_DECREF(fast);
            return -1;
        }
        Py_DECREF(idx);
        out[i] = (int64_t)v;
    }
    Py_DECREF(fast);
    return (int)n;
}

int ct_py_conv_u32(PyObject *obj, void *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "%R is not a 32-bit unsigned integer", obj);
        }
        return 0;
    }
    if (v > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%R is not a 32-bit unsigned integer", obj);
        return 0;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 1;
}

int ct_py_conv_int(PyObject *obj, void *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) return 0;
    if (overflow != 0 || v < INT_MIN || v > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%R does not fit in a C int", obj);
        return 0;
    }
    *(int *)out = (int)v;
    return 1;
}

/* (the module definition: at the end, after its exec slot) */

/* _C.dtype_names: ct_dtype_name of every core dtype code, in code order, so the Python
 * layer maps numpy dtypes to codes without a copy of the enum. */
static int ct_py_init_dtypes(PyObject *m) {
    PyObject *names = PyTuple_New(CT_NUM_DTYPES);
    if (names == NULL) return -1;
    for (int c = 0; c < CT_NUM_DTYPES; c++) {
        PyObject *s = PyUnicode_FromString(ct_dtype_name((ct_dtype)c));
        if (s == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, c, s);
    }
    int rc = PyModule_AddObjectRef(m, "dtype_names", names);
    Py_DECREF(names);
    return rc;
}

typedef int (*ct_py_init_fn)(PyObject *);

/* Binding parts, registered in order. */
static const ct_py_init_fn ct_py_parts[] = {
    ct_py_init_dtypes,
    ct_py_init_devices,
    ct_py_init_buffer,
    ct_py_init_layout,
    ct_py_init_ops,
    ct_py_init_dlpack,
    ct_py_init_rules,
    ct_py_init_random,
    ct_py_init_optim,
    ct_py_init_optim_plan,
    ct_py_init_array,
    ct_py_init_dispatch,
    ct_py_init_slice, /* (after dispatch: it calls _C.trace_active) */
    ct_py_init_tree,
    ct_py_init_module,
    ct_py_init_dist,
};

/* --- the module: multi-phase initialisation, its state ------------------------------------
 * The module's state owns what the binding parts create once: the exception types and the
 * heap types (Array, Program, Primitive, ...) it exposes, visited by the garbage collector
 * through the module. The C layer itself is one per process (the device registry, the
 * allocators' counters, the MPI engine), so the module executes once per process: a second
 * execution (a sub-interpreter, a reload) raises ImportError instead of registering the same
 * devices twice. The binding files keep fast process-wide pointers to the same objects. */
typedef struct {
    PyObject *owned; /* list: the module's types and exceptions */
} ct_module_state;

static int ct_module_executed;

static int ct_module_exec(PyObject *m) {
    if (ct_module_executed) {
        PyErr_SetString(PyExc_ImportError,
                        "ctrainstate._C is already initialised in this process (its device "
                        "registry and allocators are per process): it cannot be loaded again in "
                        "a sub-interpreter or reloaded");
        return -1;
    }
    if (_import_array() < 0) return -1;
    ct_py_ResourceExhaustedError = PyErr_NewExceptionWithDoc(
        "ctrainstate.ResourceExhaustedError",
        "A device ran out of memory (its limit or the backend's). The message names the device, "
        "the bytes asked and the bytes in use.",
        PyExc_RuntimeError, NULL);
    ct_py_DonatedBufferError = PyErr_NewExceptionWithDoc(
        "ctrainstate.DonatedBufferError",
        "An Array was used after its buffers were donated (e.g. to TrainState.apply_gradients) "
        "or deleted.",
        PyExc_RuntimeError, NULL);
    ct_py_ConcretizationTypeError = PyErr_NewExceptionWithDoc(
        "ctrainstate.errors.ConcretizationTypeError",
        "A value traced by jit was read on the host (float(x), int(x), bool(x), `if x:`, "
        "np.asarray(x), printing): while tracing, a value computed from the function's "
        "arguments is not known (jax.errors.ConcretizationTypeError). Mark the argument static "
        "(static_argnums / static_argnames), compute with ops (cnp.where, lax.cond), or read the "
        "value outside the jitted function.",
        PyExc_TypeError, NULL);
    if (ct_py_ResourceExhaustedError == NULL || ct_py_DonatedBufferError == NULL ||
        ct_py_ConcretizationTypeError == NULL ||
        PyModule_AddObjectRef(m, "ResourceExhaustedError", ct_py_ResourceExhaustedError) < 0 ||
        PyModule_AddObjectRef(m, "DonatedBufferError", ct_py_DonatedBufferError) < 0 ||
        PyModule_AddObjectRef(m, "ConcretizationTypeError", ct_py_ConcretizationTypeError) < 0)
        return -1;
    for (size_t i = 0; i < sizeof ct_py_parts / sizeof ct_py_parts[0]; i++)
        if (ct_py_parts[i](m) < 0) return -1;
    /* the state takes a reference to every type the parts registered */
    ct_module_state *st = PyModule_GetState(m);
    PyObject *owned = PyList_New(0), *d = PyModule_GetDict(m);
    if (owned == NULL || d == NULL) {
        Py_XDECREF(owned);
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &key, &value))
        if (PyType_Check(value) && PyList_Append(owned, value) < 0) {
            Py_DECREF(owned);
            return -1;
        }
    st->owned = owned;
    ct_module_executed = 1;
    return 0;
}

static int ct_module_traverse(PyObject *m, visitproc visit, void *arg) {
    ct_module_state *st = PyModule_GetState(m);
    if (st != NULL) Py_VISIT(st->owned);
    return 0;
}

static int ct_module_clear(PyObject *m) {
    ct_module_state *st = PyModule_GetState(m);
    if (st != NULL) Py_CLEAR(st->owned);
    return 0;
}

static void ct_module_free(void *m) { ct_module_clear((PyObject *)m); }

static PyModuleDef_Slot ct_module_slots[] = {
    {Py_mod_exec, (void *)ct_module_exec},
    {0, NULL},
};

static struct PyModuleDef ct_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ctrainstate._C",
    .m_doc = "C core of ctrainstate: devices, buffers, shard layout and kernels.",
    .m_size = sizeof(ct_module_state),
    .m_slots = ct_module_slots,
    .m_traverse = ct_module_traverse,
    .m_clear = ct_module_clear,
    .m_free = ct_module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ct_module); }
