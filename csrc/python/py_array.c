/*
 * py_array.c — the host-side hot loop of an in-place optimizer step: handing
 * every param and state Array's buffers to a new Array (ctrainstate.Array is
 * a Python class with __slots__; see python/ctrainstate/array.py).
 *
 * An in-place step donates each param and state Array and returns new Arrays
 * that own the same blocks: `Array._moved_all`. For a 148-leaf AdamW state that
 * is 444 objects per step, and in Python each costs an allocation and eight
 * slot stores (~0.17 us, 77 us a step on the 2-core VM, about a fifth of the
 * step's host time). Here the slots are copied by their offsets, which
 * `array_type_register` reads once from the class's member descriptors.
 *
 *   array_type_register(cls)   cls: the Array class (its slots are looked up by name)
 *   move_arrays(arrays)        a list of new Arrays, each with its old one's slots
 *                              (shape, dtype, sharding, blocks, shard shape, host
 *                              scalar), _base None and _donated False; every old one
 *                              marked _donated. If any Array is not exactly _donated
 *                              False and _base None (donated, or a view), nothing is
 *                              changed and its index is returned instead (the caller
 *                              raises the error).
 */
#include "ct_py.h"

#include <structmember.h>

/* The slots (ct_py.h's CT_PY_A_*), in this order: copied (shape .. host scalar), then the
 * two that are set. */
enum { S_BASE = CT_PY_A_BASE, S_DONATED = CT_PY_A_DONATED, S_COUNT = CT_PY_A_COUNT };
static const char *const slot_names[S_COUNT] = {"_shape",       "_dtype",       "_sharding",
                                                "_blocks",      "_shard_shape", "_host_scalar",
                                                "_base",        "_donated"};

static PyTypeObject *array_type; /* a strong reference, set once */
static Py_ssize_t slot_off[S_COUNT];

static PyObject **slot_at(PyObject *o, int s) { return (PyObject **)((char *)o + slot_off[s]); }

PyObject **ct_py_array_slot(PyObject *a, int s) { return slot_at(a, s); }

PyTypeObject *ct_py_array_type(void) {
    if (array_type == NULL)
        PyErr_SetString(PyExc_RuntimeError, "ctrainstate.Array is not registered "
                                            "(_C.array_type_register was not called)");
    return array_type;
}

static PyObject *py_array_type_register(PyObject *self, PyObject *cls) {
    (void)self;
    if (!PyType_Check(cls))
        return PyErr_Format(PyExc_TypeError, "array_type_register: expected a class, got %s",
                            Py_TYPE(cls)->tp_name);
    PyTypeObject *t = (PyTypeObject *)cls;
    Py_ssize_t off[S_COUNT];
    for (int s = 0; s < S_COUNT; s++) {
        PyObject *d = PyObject_GetAttrString(cls, slot_names[s]);
        if (d == NULL) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                return PyErr_Format(PyExc_TypeError,
                                    "array_type_register: %s has no __slots__ member %s",
                                    t->tp_name, slot_names[s]);
            }
            return NULL;
        }
        const int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                       ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX &&
                       PyType_IsSubtype(t, ((PyDescrObject *)d)->d_type);
        if (ok) off[s] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok)
            return PyErr_Format(PyExc_TypeError,
                                "array_type_register: %s.%s is not a __slots__ member",
                                t->tp_name, slot_names[s]);
        if (off[s] <= 0 || off[s] + (Py_ssize_t)sizeof(PyObject *) > t->tp_basicsize)
            return PyErr_Format(PyExc_ValueError, "array_type_register: bad offset of %s.%s",
                                t->tp_name, slot_names[s]);
    }
    Py_INCREF(cls);
    Py_XSETREF(array_type, t);
    memcpy(slot_off, off, sizeof off);
    Py_RETURN_NONE;
}

PyObject *ct_py_move_arrays(PyObject *const *items, Py_ssize_t n, Py_ssize_t *bad) {
    *bad = -1;
    if (ct_py_array_type() == NULL) return NULL;
    /* every check before any change */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = items[i];
        if (!PyObject_TypeCheck(a, array_type))
            return PyErr_Format(PyExc_TypeError, "move_arrays: item %zd is a %s, not an Array", i,
                                Py_TYPE(a)->tp_name);
        /* identity tests only (no __bool__ runs): anything but False / None (unset
         * included) is left to the caller's Array._moved, which raises for it */
        PyObject *don = *slot_at(a, S_DONATED), *base = *slot_at(a, S_BASE);
        if (don != Py_False || base != Py_None) {
            *bad = i;
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *nw = array_type->tp_alloc(array_type, 0);
        if (nw == NULL) { /* nothing donated yet: the old Arrays stay as they were */
            Py_DECREF(out);
            return NULL;
        }
        PyObject *a = items[i];
        for (int s = 0; s < S_BASE; s++) *slot_at(nw, s) = Py_XNewRef(*slot_at(a, s));
        *slot_at(nw, S_BASE) = Py_NewRef(Py_None);
        *slot_at(nw, S_DONATED) = Py_NewRef(Py_False);
        PyList_SET_ITEM(out, i, nw);
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* the new Arrays exist: now donate the old ones */
        PyObject **d = slot_at(items[i], S_DONATED);
        PyObject *was = *d;
        *d = Py_NewRef(Py_True);
        Py_XDECREF(was);
    }
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

static PyMethodDef array_methods[] = {
    {"array_type_register", py_array_type_register, METH_O,
     "array_type_register(cls, /)\n--\n\n"
     "Register ctrainstate.Array (its __slots__ offsets) for move_arrays."},
    {"move_arrays", py_move_arrays, METH_O,
     "move_arrays(arrays, /)\n--\n\n"
     "New Arrays owning the given Arrays' buffers; the given ones are marked donated. If one\n"
     "is already donated or is a view, nothing changes and its index is returned."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_array(PyObject *m) { return PyModule_AddFunctions(m, array_methods); }
