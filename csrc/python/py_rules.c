/*
 * py_rules.c — bindings for logical axis rules: the thread-local rules context
 * and logical_to_mesh_axes resolution (core: csrc/core/ct_rules.c).
 *
 * Python objects are converted once per call into the encoded form of
 * ct_rules.h: logical names become UTF-8 bytes, every pytree leaf of a mesh
 * value (and of a kept-verbatim spec entry) becomes an integer atom interned
 * through a dict (so equal leaves share an atom, as in Flax's set test), and
 * PartitionSpec.UNCONSTRAINED is the reserved atom 0. The core answers with a
 * rule index per dimension; this file maps indices back to the rule's mesh
 * value object exactly as given.
 *
 * The rules context lives in each thread's state dict under RULES_KEY and
 * holds the object exactly as set (no copy, no validation), default ().
 */
#include "ct_py.h"

#include <structmember.h>

#include "../core/ct_rules.h"

#define RULES_KEY "ctrainstate._C.axis_rules"

static PyObject *g_unconstrained = NULL;  /* PartitionSpec.UNCONSTRAINED, set at import */

// ---------------------------------------------------------------------------
// thread-local rules context

/* Borrowed reference to the current thread's rules, () if never set. */
static PyObject *rules_get_borrowed(void) {
    static PyObject *empty = NULL;
    PyObject *d = PyThreadState_GetDict();
    if (d != NULL) {
        PyObject *r = PyDict_GetItemString(d, RULES_KEY);
        if (r != NULL) return r;
    }
    if (empty == NULL) empty = PyTuple_New(0);
    return empty;
}

static int rules_set(PyObject *rules) {
    PyObject *d = PyThreadState_GetDict();
    if (d == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no thread state dict for the axis rules context");
        return -1;
    }
    return PyDict_SetItemString(d, RULES_KEY, rules);
}

PyDoc_STRVAR(get_axis_rules_doc,
"get_axis_rules($module, /)\n--\n\n"
"Return this thread's logical axis rules exactly as set (default ()).");

static PyObject *py_get_axis_rules(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    PyObject *r = rules_get_borrowed();
    if (r == NULL) return NULL;
    Py_INCREF(r);
    return r;
}

PyDoc_STRVAR(set_axis_rules_doc,
"set_axis_rules($module, rules, /)\n--\n\n"
"Store `rules` as this thread's logical axis rules (no copy, no validation).");

static PyObject *py_set_axis_rules(PyObject *self, PyObject *rules) {
    (void)self;
    if (rules_set(rules) < 0) return NULL;
    Py_RETURN_NONE;
}

// ---------------------------------------------------------------------------
// axis_rules context manager type

typedef struct {
    PyObject_HEAD
    PyObject *rules;  /* rules to install */
    PyObject *saved;  /* list: stack of previous rules, one per active __enter__ */
} AxisRulesObject;

static int axis_rules_init(AxisRulesObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"rules", NULL};
    PyObject *rules;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:axis_rules", kwlist, &rules)) return -1;
    Py_INCREF(rules);
    Py_XSETREF(self->rules, rules);
    if (self->saved == NULL && (self->saved = PyList_New(0)) == NULL) return -1;
    return 0;
}

static void axis_rules_dealloc(AxisRulesObject *self) {
    Py_XDECREF(self->rules);
    Py_XDECREF(self->saved);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *axis_rules_enter(AxisRulesObject *self, PyObject *unused) {
    (void)unused;
    if (self->rules == NULL || self->saved == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "axis_rules object was not initialised");
        return NULL;
    }
    PyObject *prev = rules_get_borrowed();
    if (prev == NULL || PyList_Append(self->saved, prev) < 0) return NULL;
    if (rules_set(self->rules) < 0) {
        PySequence_DelItem(self->saved, PyList_GET_SIZE(self->saved) - 1);
        return NULL;
    }
    Py_RETURN_NONE;  /* like Flax: `with axis_rules(r) as x` binds None */
}

static PyObject *axis_rules_exit(AxisRulesObject *self, PyObject *args) {
    (void)args;
    Py_ssize_t n = self->saved ? PyList_GET_SIZE(self->saved) : 0;
    if (n == 0) {
        PyErr_SetString(PyExc_RuntimeError, "axis_rules.__exit__ without a matching __enter__");
        return NULL;
    }
    PyObject *prev = PyList_GET_ITEM(self->saved, n - 1);
    Py_INCREF(prev);
    int rc = rules_set(prev);
    Py_DECREF(prev);
    if (PySequence_DelItem(self->saved, n - 1) < 0 || rc < 0) return NULL;
    Py_RETURN_FALSE;  /* never swallow the exception */
}

static PyObject *axis_rules_repr(AxisRulesObject *self) {
    return PyUnicode_FromFormat("axis_rules(%R)", self->rules ? self->rules : Py_None);
}

static PyMethodDef axis_rules_methods[] = {
    {"__enter__", (PyCFunction)axis_rules_enter, METH_NOARGS, "Install the rules; returns None."},
    {"__exit__", (PyCFunction)axis_rules_exit, METH_VARARGS,
     "Restore the rules that were active at __enter__ (also on exceptions)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef axis_rules_members[] = {
    {"rules", T_OBJECT, offsetof(AxisRulesObject, rules), READONLY, "The rules this context installs."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(axis_rules_doc,
"axis_rules(rules)\n--\n\n"
"Context manager that installs `rules` as this thread's logical axis rules and\n"
"restores the previous rules on exit (also when an exception escapes). Nesting\n"
"replaces the rules; it does not merge them. `with axis_rules(r) as x` binds None.\n\n"
">>> from ctrainstate.partitioning import axis_rules, get_axis_rules\n"
">>> with axis_rules((('embed', 'model'),)):\n"
"...     get_axis_rules()\n"
"(('embed', 'model'),)\n"
">>> get_axis_rules()\n"
"()");

static PyTypeObject AxisRulesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ctrainstate._C.axis_rules",
    .tp_basicsize = sizeof(AxisRulesObject),
    .tp_dealloc = (destructor)axis_rules_dealloc,
    .tp_repr = (reprfunc)axis_rules_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = axis_rules_doc,
    .tp_methods = axis_rules_methods,
    .tp_members = axis_rules_members,
    .tp_init = (initproc)axis_rules_init,
    .tp_new = PyType_GenericNew,
};

// ---------------------------------------------------------------------------
// encoding

typedef struct {
    PyObject *interned;   /* dict: leaf -> atom (int) */
    int32_t *atoms;       /* all atoms, back to back */
    size_t natoms, cap;
} atom_buf;

static int atom_push(atom_buf *b, int32_t a) {
    if (b->natoms == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        int32_t *p = PyMem_Realloc(b->atoms, cap * sizeof *p);
        if (p == NULL) { PyErr_NoMemory(); return -1; }
        b->atoms = p;
        b->cap = cap;
    }
    b->atoms[b->natoms++] = a;
    return 0;
}

static int atom_of(atom_buf *b, PyObject *leaf, int32_t *out) {
    if (g_unconstrained != NULL && leaf == g_unconstrained) {
        *out = CT_RULES_ATOM_UNCONSTRAINED;
        return 0;
    }
    PyObject *v = PyDict_GetItemWithError(b->interned, leaf);
    if (v != NULL) {
        *out = (int32_t)PyLong_AsLong(v);
        return 0;
    }
    if (PyErr_Occurred()) return -1;  /* unhashable leaf: TypeError, as set() raises */
    Py_ssize_t n = PyDict_GET_SIZE(b->interned) + 1;
    if (n > INT32_MAX) { PyErr_SetString(PyExc_OverflowError, "too many mesh axes"); return -1; }
    PyObject *id = PyLong_FromSsize_t(n);
    if (id == NULL) return -1;
    int rc = PyDict_SetItem(b->interned, leaf, id);
    Py_DECREF(id);
    *out = (int32_t)n;
    return rc;
}

/* Push the atoms of every pytree leaf of `obj` (None has none; tuples, lists
 * and dict values are containers; anything else, including str, is a leaf). */
static int push_leaves(atom_buf *b, PyObject *obj, int depth) {
    if (depth > 64) {
        PyErr_SetString(PyExc_RecursionError, "mesh axis value nested too deeply");
        return -1;
    }
    if (obj == Py_None) return 0;
    if (PyTuple_Check(obj) || PyList_Check(obj) || PyDict_Check(obj)) {
        PyObject *seq = PyDict_Check(obj) ? PyDict_Values(obj) : PySequence_Tuple(obj);
        if (seq == NULL) return -1;
        Py_ssize_t n = PySequence_Length(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_GetItem(seq, i);
            int rc = item ? push_leaves(b, item, depth + 1) : -1;
            Py_XDECREF(item);
            if (rc < 0) { Py_DECREF(seq); return -1; }
        }
        Py_DECREF(seq);
        return 0;
    }
    int32_t a;
    if (atom_of(b, obj, &a) < 0) return -1;
    return atom_push(b, a);
}

/*
 * Resolve `names` under `rules` (NULL/None: the context rules). Returns a new
 * list, one entry per name: the matching rule's mesh value, the entry itself
 * when it is not a string, or `unassigned`. Returns Py_None for names None.
 */
static PyObject *resolve(PyObject *names, PyObject *rules, PyObject *unassigned) {
    PyObject *names_t = NULL, *rules_t = NULL, *pairs = NULL, *result = NULL;
    ct_rules_dim *dims = NULL;
    ct_rule *crules = NULL;
    int32_t *out = NULL;
    size_t *dim_off = NULL, *rule_off = NULL;
    atom_buf ab = {NULL, NULL, 0, 0};

    if (names == Py_None) Py_RETURN_NONE;
    if (rules == NULL || rules == Py_None) rules = rules_get_borrowed();
    if (rules == NULL) return NULL;
    Py_INCREF(rules);

    names_t = PySequence_Tuple(names);
    if (names_t == NULL) goto done;
    Py_ssize_t nd = PyTuple_GET_SIZE(names_t);
    if ((ab.interned = PyDict_New()) == NULL) goto done;
    dims = PyMem_Calloc((size_t)nd + 1, sizeof *dims);
    dim_off = PyMem_Calloc((size_t)nd + 1, sizeof *dim_off);
    out = PyMem_Calloc((size_t)nd + 1, sizeof *out);
    if (!dims || !dim_off || !out) { PyErr_NoMemory(); goto done; }

    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *e = PyTuple_GET_ITEM(names_t, i);
        if (PyUnicode_Check(e)) {
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(e, &len);
            if (s == NULL) goto done;
            dims[i].is_name = 1;
            dims[i].name = s;
            dims[i].name_len = (size_t)len;
        } else {
            /* Flax counts the names with collections.Counter: entries must hash. */
            if (PyObject_Hash(e) == -1) goto done;
            dims[i].is_name = 0;
            dim_off[i] = ab.natoms;
            if (push_leaves(&ab, e, 0) < 0) goto done;
            dims[i].natoms = ab.natoms - dim_off[i];
        }
    }

    /* The duplicate check precedes the rules-type check. */
    ct_clear_error();
    ct_status st = ct_rules_check_duplicates(dims, (size_t)nd);
    if (st != CT_OK) { ct_py_raise(st); goto done; }
    if (!PyTuple_Check(rules) && !PyList_Check(rules)) {
        PyErr_SetString(PyExc_ValueError, "Unknown axis rule specification type.");
        goto done;
    }

    rules_t = PySequence_Tuple(rules);
    if (rules_t == NULL) goto done;
    Py_ssize_t nr = PyTuple_GET_SIZE(rules_t);
    if ((pairs = PyTuple_New(nr)) == NULL) goto done;
    crules = PyMem_Calloc((size_t)nr + 1, sizeof *crules);
    rule_off = PyMem_Calloc((size_t)nr + 1, sizeof *rule_off);
    if (!crules || !rule_off) { PyErr_NoMemory(); goto done; }

    for (Py_ssize_t r = 0; r < nr; r++) {
        PyObject *rule = PyTuple_GET_ITEM(rules_t, r);
        PyObject *pair = PySequence_Tuple(rule);
        if (pair == NULL) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError,
                             "axis rule %zd (%R) is not a (logical_name, mesh_axes) pair: "
                             "cannot unpack non-iterable %.200s object",
                             r, rule, Py_TYPE(rule)->tp_name);
            }
            goto done;
        }
        PyTuple_SET_ITEM(pairs, r, pair);
        if (PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_ValueError,
                         "axis rule %zd (%R) is not a (logical_name, mesh_axes) pair: "
                         "%s values to unpack (expected 2, got %zd)",
                         r, rule, PyTuple_GET_SIZE(pair) < 2 ? "not enough" : "too many",
                         PyTuple_GET_SIZE(pair));
            goto done;
        }
        PyObject *key = PyTuple_GET_ITEM(pair, 0), *val = PyTuple_GET_ITEM(pair, 1);
        if (PyUnicode_Check(key)) {
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(key, &len);
            if (s == NULL) goto done;
            crules[r].key_is_name = 1;
            crules[r].key = s;
            crules[r].key_len = (size_t)len;
        }
        rule_off[r] = ab.natoms;
        if (push_leaves(&ab, val, 0) < 0) goto done;
        crules[r].natoms = ab.natoms - rule_off[r];
    }
    /* atoms may have moved while growing: fix the pointers now */
    for (Py_ssize_t i = 0; i < nd; i++)
        if (!dims[i].is_name) dims[i].atoms = ab.atoms + dim_off[i];
    for (Py_ssize_t r = 0; r < nr; r++) crules[r].atoms = ab.atoms + rule_off[r];

    ct_clear_error();
    st = ct_rules_resolve(dims, (size_t)nd, crules, (size_t)nr, out);
    if (st != CT_OK) { ct_py_raise(st); goto done; }

    if ((result = PyList_New(nd)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *v = out[i] >= 0 ? PyTuple_GET_ITEM(PyTuple_GET_ITEM(pairs, out[i]), 1)
                      : out[i] == CT_RULES_VERBATIM ? PyTuple_GET_ITEM(names_t, i)
                      : unassigned;
        Py_INCREF(v);
        PyList_SET_ITEM(result, i, v);
    }

done:
    Py_XDECREF(rules);
    Py_XDECREF(names_t);
    Py_XDECREF(rules_t);
    Py_XDECREF(pairs);
    Py_XDECREF(ab.interned);
    PyMem_Free(ab.atoms);
    PyMem_Free(dims);
    PyMem_Free(dim_off);
    PyMem_Free(crules);
    PyMem_Free(rule_off);
    PyMem_Free(out);
    return result;
}

PyDoc_STRVAR(resolve_doc,
"resolve_logical_axes($module, names, rules=None, unassigned=None)\n--\n\n"
"Resolve logical axis names to mesh axes (Flax 0.12.3+ semantics).\n\n"
"Returns a list with one entry per name: the mesh value of the first rule that\n"
"may claim it, the entry itself when it is not a string, or `unassigned` when\n"
"no rule applies. Returns None when `names` is None. `rules=None` uses this\n"
"thread's context rules.");

static PyObject *py_resolve(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"names", "rules", "unassigned", NULL};
    PyObject *names, *rules = Py_None, *unassigned = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO:resolve_logical_axes", kwlist, &names,
                                     &rules, &unassigned))
        return NULL;
    return resolve(names, rules, unassigned);
}

PyDoc_STRVAR(set_unconstrained_doc,
"_rules_set_unconstrained($module, obj, /)\n--\n\n"
"Register the PartitionSpec.UNCONSTRAINED singleton (called once at import).");

static PyObject *py_set_unconstrained(PyObject *self, PyObject *obj) {
    (void)self;
    Py_INCREF(obj);
    Py_XSETREF(g_unconstrained, obj);
    Py_RETURN_NONE;
}

static PyMethodDef rules_methods[] = {
    {"get_axis_rules", py_get_axis_rules, METH_NOARGS, get_axis_rules_doc},
    {"set_axis_rules", py_set_axis_rules, METH_O, set_axis_rules_doc},
    {"resolve_logical_axes", (PyCFunction)(void (*)(void))py_resolve,
     METH_VARARGS | METH_KEYWORDS, resolve_doc},
    {"_rules_set_unconstrained", py_set_unconstrained, METH_O, set_unconstrained_doc},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_rules(PyObject *m) {
    if (PyType_Ready(&AxisRulesType) < 0) return -1;
    if (PyModule_AddFunctions(m, rules_methods) < 0) return -1;
    Py_INCREF(&AxisRulesType);
    if (PyModule_AddObject(m, "axis_rules", (PyObject *)&AxisRulesType) < 0) {
        Py_DECREF(&AxisRulesType);
        return -1;
    }
    return 0;
}
