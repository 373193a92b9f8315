/*
 * py_tree.c — ctrainstate._C.flatten_spec / unflatten_spec: a jitted call's argument tree
 * checked against, and flattened by, the structure of an earlier call, in C.
 *
 * ctrainstate.jit keys its programs by the arguments' pytree structure. Flattening a train
 * state with optree (a registered dataclass, dicts of params, the optimizer's named tuples)
 * and hashing the treedef costs more than replaying a small program. After a call has been
 * keyed the slow way, python/ctrainstate/_src/jit/jit.py builds a *spec* of its structure
 * (and keeps it only if flattening that very call with the spec gives optree's leaves, object
 * for object). A later call whose tree matches the spec exactly has the same treedef, so the
 * same key: its leaves come from here and the key is not rebuilt. Anything the spec does not
 * describe exactly (another type, another dict key set, a static field that is not the same
 * object) is a mismatch: the caller takes the slow path, which decides.
 *
 * A spec is a tuple (kind, ...):
 *   (LEAF, type)                      a leaf whose type is exactly `type`
 *   (NONE,)                           None (a node without children in optree)
 *   (DICT, keys, children)            an exact dict with exactly these keys; children in the
 *                                     order of `keys` (the flatten order: sorted)
 *   (TUPLE, n, children)              an exact tuple of n items
 *   (LIST, n, children)               an exact list of n items
 *   (NAMED, cls, children)            a named tuple of exactly type cls
 *   (STRUCT, cls, names, children, meta_names, meta_values)
 *                                     a registered dataclass of exactly type cls (no
 *                                     __post_init__): its data fields `names` are children, its
 *                                     static fields must be the very objects `meta_values`
 * unflatten_spec(spec, leaves) builds the tree back (dicts in the keys' order, a STRUCT by
 * object.__new__ and its fields set, as the dataclass's registered unflatten does).
 */
#include "ct_py.h"

enum { SP_LEAF = 0, SP_NONE, SP_DICT, SP_TUPLE, SP_LIST, SP_NAMED, SP_STRUCT, SP_COUNT };

#define SPEC_MAX_DEPTH 64

/* Whether spec's own tuple has the fields of its kind (its children are checked as they are
 * reached). */
static int spec_shape_ok(PyObject *spec, long kind) {
    const Py_ssize_t n = PyTuple_GET_SIZE(spec);
    switch (kind) {
    case SP_LEAF: return n == 2;
    case SP_NONE: return n == 1;
    case SP_DICT:
        return n == 3 && PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 1)) &&
               PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 2)) &&
               PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 1)) == PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 2));
    case SP_TUPLE:
    case SP_LIST:
    case SP_NAMED: return n == 3 && PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 2));
    case SP_STRUCT:
        return n == 6 && PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 2)) &&
               PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 3)) &&
               PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 4)) &&
               PyTuple_CheckExact(PyTuple_GET_ITEM(spec, 5)) &&
               PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 2)) == PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 3)) &&
               PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 4)) == PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 5));
    default: return 0;
    }
}

/* 1: matched (leaves appended), 0: no match, -1: an exception. */
static int flat(PyObject *spec, PyObject *x, PyObject *out, int depth) {
    if (depth > SPEC_MAX_DEPTH || !PyTuple_CheckExact(spec) || PyTuple_GET_SIZE(spec) < 1 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(spec, 0)))
        return 0;
    const long kind = PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
    const Py_ssize_t n = PyTuple_GET_SIZE(spec);
    if (!spec_shape_ok(spec, kind)) return 0;
    switch (kind) {
    case SP_LEAF:
        if (n != 2 || (PyObject *)Py_TYPE(x) != PyTuple_GET_ITEM(spec, 1)) return 0;
        return PyList_Append(out, x) < 0 ? -1 : 1;
    case SP_NONE:
        return x == Py_None;
    case SP_DICT: {
        if (n != 3 || !PyDict_CheckExact(x)) return 0;
        PyObject *keys = PyTuple_GET_ITEM(spec, 1), *ch = PyTuple_GET_ITEM(spec, 2);
        if (PyDict_GET_SIZE(x) != PyTuple_GET_SIZE(keys)) return 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
            PyObject *v = PyDict_GetItemWithError(x, PyTuple_GET_ITEM(keys, i));
            if (v == NULL) return PyErr_Occurred() ? -1 : 0;
            int r = flat(PyTuple_GET_ITEM(ch, i), v, out, depth + 1);
            if (r != 1) return r;
        }
        return 1;
    }
    case SP_TUPLE:
    case SP_LIST:
    case SP_NAMED: {
        if (n != 3) return 0;
        PyObject *ch = PyTuple_GET_ITEM(spec, 2);
        PyObject *const *items;
        Py_ssize_t m;
        if (kind == SP_LIST) {
            if (!PyList_CheckExact(x)) return 0;
            items = ((PyListObject *)x)->ob_item;
            m = PyList_GET_SIZE(x);
        } else {
            if (kind == SP_TUPLE ? !PyTuple_CheckExact(x)
                                 : (PyObject *)Py_TYPE(x) != PyTuple_GET_ITEM(spec, 1))
                return 0;
            items = ((PyTupleObject *)x)->ob_item;
            m = PyTuple_GET_SIZE(x);
        }
        if (m != PyTuple_GET_SIZE(ch)) return 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            int r = flat(PyTuple_GET_ITEM(ch, i), items[i], out, depth + 1);
            if (r != 1) return r;
        }
        return 1;
    }
    case SP_STRUCT: {
        if (n != 6 || (PyObject *)Py_TYPE(x) != PyTuple_GET_ITEM(spec, 1)) return 0;
        PyObject *names = PyTuple_GET_ITEM(spec, 2), *ch = PyTuple_GET_ITEM(spec, 3);
        PyObject *mnames = PyTuple_GET_ITEM(spec, 4), *mvals = PyTuple_GET_ITEM(spec, 5);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mnames); i++) {
            PyObject *v = PyObject_GetAttr(x, PyTuple_GET_ITEM(mnames, i));
            if (v == NULL) return -1;
            const int same = v == PyTuple_GET_ITEM(mvals, i);
            Py_DECREF(v);
            if (!same) return 0;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
            PyObject *v = PyObject_GetAttr(x, PyTuple_GET_ITEM(names, i));
            if (v == NULL) return -1;
            int r = flat(PyTuple_GET_ITEM(ch, i), v, out, depth + 1);
            Py_DECREF(v);
            if (r != 1) return r;
        }
        return 1;
    }
    default:
        return 0;
    }
}

/* flatten_spec(spec, tree): tree's leaves (a list) when it has spec's structure, else None. */
static PyObject *py_flatten_spec(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "flatten_spec(spec, tree)");
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    int r = flat(args[0], args[1], out, 0);
    if (r == 1) return out;
    Py_DECREF(out);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

/* The tree of spec from leaves[*i...]; NULL with an exception. */
static PyObject *unflat(PyObject *spec, PyObject *leaves, Py_ssize_t *i, int depth) {
    if (depth > SPEC_MAX_DEPTH || !PyTuple_CheckExact(spec) || PyTuple_GET_SIZE(spec) < 1 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(spec, 0)))
        return PyErr_Format(PyExc_ValueError, "unflatten_spec: not a spec");
    const long kind = PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
    if (!spec_shape_ok(spec, kind)) return PyErr_Format(PyExc_ValueError, "unflatten_spec: not a spec");
    switch (kind) {
    case SP_LEAF:
        if (*i >= PyList_GET_SIZE(leaves))
            return PyErr_Format(PyExc_ValueError, "unflatten_spec: too few leaves");
        return Py_NewRef(PyList_GET_ITEM(leaves, (*i)++));
    case SP_NONE:
        Py_RETURN_NONE;
    case SP_DICT: {
        PyObject *keys = PyTuple_GET_ITEM(spec, 1), *ch = PyTuple_GET_ITEM(spec, 2);
        PyObject *d = PyDict_New();
        if (d == NULL) return NULL;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
            PyObject *v = unflat(PyTuple_GET_ITEM(ch, k), leaves, i, depth + 1);
            if (v == NULL || PyDict_SetItem(d, PyTuple_GET_ITEM(keys, k), v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(d);
                return NULL;
            }
            Py_DECREF(v);
        }
        return d;
    }
    case SP_TUPLE:
    case SP_LIST:
    case SP_NAMED: {
        PyObject *ch = PyTuple_GET_ITEM(spec, 2);
        const Py_ssize_t m = PyTuple_GET_SIZE(ch);
        PyObject *t = kind == SP_LIST ? PyList_New(m) : PyTuple_New(m);
        if (t == NULL) return NULL;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *v = unflat(PyTuple_GET_ITEM(ch, k), leaves, i, depth + 1);
            if (v == NULL) {
                Py_DECREF(t);
                return NULL;
            }
            if (kind == SP_LIST) PyList_SET_ITEM(t, k, v);
            else PyTuple_SET_ITEM(t, k, v);
        }
        if (kind != SP_NAMED) return t;
        /* a named tuple: cls(*items), as optree rebuilds one */
        PyObject *r = PyObject_Call(PyTuple_GET_ITEM(spec, 1), t, NULL);
        Py_DECREF(t);
        return r;
    }
    case SP_STRUCT: {
        PyObject *cls = PyTuple_GET_ITEM(spec, 1);
        PyObject *names = PyTuple_GET_ITEM(spec, 2), *ch = PyTuple_GET_ITEM(spec, 3);
        PyObject *mnames = PyTuple_GET_ITEM(spec, 4), *mvals = PyTuple_GET_ITEM(spec, 5);
        if (!PyType_Check(cls)) return PyErr_Format(PyExc_ValueError, "unflatten_spec: not a spec");
        PyObject *empty = PyTuple_New(0);
        PyObject *obj = empty != NULL ? PyBaseObject_Type.tp_new((PyTypeObject *)cls, empty, NULL)
                                      : NULL;
        Py_XDECREF(empty);
        if (obj == NULL) return NULL;
        for (int half = 0; half < 2; half++) {
            PyObject *nm = half ? mnames : names;
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(nm); k++) {
                PyObject *v = half ? Py_NewRef(PyTuple_GET_ITEM(mvals, k))
                                   : unflat(PyTuple_GET_ITEM(ch, k), leaves, i, depth + 1);
                /* object.__setattr__: the dataclass is frozen */
                int rc = v != NULL ? PyObject_GenericSetAttr(obj, PyTuple_GET_ITEM(nm, k), v) : -1;
                Py_XDECREF(v);
                if (rc < 0) {
                    Py_DECREF(obj);
                    return NULL;
                }
            }
        }
        return obj;
    }
    default:
        return PyErr_Format(PyExc_ValueError, "unflatten_spec: not a spec");
    }
}

/* unflatten_spec(spec, leaves): the tree of spec's structure holding `leaves` (a list). */
static PyObject *py_unflatten_spec(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "unflatten_spec(spec, leaves: list)");
    Py_ssize_t i = 0;
    PyObject *r = unflat(args[0], args[1], &i, 0);
    if (r != NULL && i != PyList_GET_SIZE(args[1])) {
        Py_DECREF(r);
        return PyErr_Format(PyExc_ValueError, "unflatten_spec: %zd leaves for a spec of %zd",
                            PyList_GET_SIZE(args[1]), i);
    }
    return r;
}

static PyMethodDef tree_methods[] = {
    {"flatten_spec", (PyCFunction)(void (*)(void))py_flatten_spec, METH_FASTCALL,
     "flatten_spec(spec, tree, /)\n--\n\nThe leaves of `tree` (a list) when it has exactly the "
     "structure `spec` describes (csrc/python/py_tree.c), else None."},
    {"unflatten_spec", (PyCFunction)(void (*)(void))py_unflatten_spec, METH_FASTCALL,
     "unflatten_spec(spec, leaves, /)\n--\n\nThe tree of `spec`'s structure holding `leaves`."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_tree(PyObject *m) {
    if (PyModule_AddFunctions(m, tree_methods) < 0) return -1;
    PyObject *kinds = Py_BuildValue("{sisisisisisisi}", "LEAF", SP_LEAF, "NONE", SP_NONE, "DICT",
                                    SP_DICT, "TUPLE", SP_TUPLE, "LIST", SP_LIST, "NAMED", SP_NAMED,
                                    "STRUCT", SP_STRUCT);
    if (kinds == NULL || PyModule_AddObject(m, "spec_kinds", kinds) < 0) {
        Py_XDECREF(kinds);
        return -1;
    }
    return 0;
}
