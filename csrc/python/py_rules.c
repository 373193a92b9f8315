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

static PyObject *rules_key; /* RULES_KEY as an interned str (ct_py_init_rules) */

/* Borrowed reference to the current thread's rules, () if never set (NULL on an error). */
static PyObject *rules_get_borrowed(void) {
    static PyObject *empty = NULL;
    PyObject *d = PyThreadState_GetDict();
    if (d != NULL) {
        PyObject *r = PyDict_GetItemWithError(d, rules_key);
        if (r != NULL) return r;
        if (PyErr_Occurred()) return NULL;
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
    return PyDict_SetItem(d, rules_key, rules);
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

// ---------------------------------------------------------------------------
// param_with_axes' hit path
//
// partitioning.param_with_axes declares the same parameters at every model.apply; a
// declaration that passed its checks before is found in partitioning._CHECKED (see there)
// and only has its effects left to do. param_hit does that in C for the common case and
// answers the parameter's value, or the `miss` object (set with param_hit_setup) when any
// condition of the case does not hold — the Python path then runs, unchanged, so it raises
// and handles everything else. Nothing is changed before the answer is known.
//
// The case: the current module (the innermost frame of nn.module._ctx.stack) is a Module
// whose class and scope's class keep the base methods (partitioning._PLAIN_CLASSES says
// True); the parameter exists in the scope's 'params' (plain dicts along the path) as an
// Array; the initializer is a plain function whose closed-over values and defaults are
// ints, strings, None, floats, bools or classes, its arguments ints or tuples of ints, no
// keyword arguments; the key built as partitioning._checked_key builds it is in _CHECKED
// under the active mesh; the module is declaring in its @compact method or setup(); the
// name is free in the scope; the value already has one of the sharding objects seen equal to
// the constraint's target (the tuple entry[3]) or there is no constraint; the scope's collections are immutable.

enum { PH_CTX, PH_PLAIN, PH_MODULE, PH_CHECKED, PH_GET_MESH, PH_JIT_TLS, PH_ARRAY, PH_MISS,
       PH_LONG_PATH, PH_MESH_TLS, PH_UNSET, PH_STRICT, PH_N };
static PyObject *ph_env[PH_N];
static PyObject *ph_names[16];
enum { N_STACK, N_SCOPE, N_VARIABLES, N_PATH, N_DEPTH, N_IN_SETUP, N_RESERVED, N_CHILDREN,
       N_MUTABLE, N_SHARDING, N_SHAPE, N_PARAMS, N_SET, N_RULES, N_AXES, N_COUNT };

/* ph_names, interned once: 0, or -1 with an exception. */
static int ph_names_init(void) {
    static const char *const names[N_COUNT] = {"stack", "_scope", "_variables", "path", "depth",
                                               "_in_setup", "_reserved", "_children", "mutable",
                                               "sharding", "shape", "params", "set", "rules",
                                               "axes"};
    for (int i = 0; i < N_COUNT; i++)
        if (ph_names[i] == NULL && (ph_names[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return -1;
    return 0;
}

static PyObject *py_param_hit_setup(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *env[PH_N];
    env[PH_MESH_TLS] = env[PH_UNSET] = env[PH_STRICT] = Py_None;
    if (!PyArg_ParseTuple(args, "OO!OO!OOOOO|OOO:param_hit_setup", &env[PH_CTX], &PyDict_Type,
                          &env[PH_PLAIN], &env[PH_MODULE], &PyDict_Type, &env[PH_CHECKED],
                          &env[PH_GET_MESH], &env[PH_JIT_TLS], &env[PH_ARRAY], &env[PH_MISS],
                          &env[PH_LONG_PATH], &env[PH_MESH_TLS], &env[PH_UNSET], &env[PH_STRICT]))
        return NULL;
    if (ph_names_init() < 0) return NULL;
    for (int i = 0; i < PH_N; i++) Py_XSETREF(ph_env[i], Py_NewRef(env[i]));
    Py_RETURN_NONE;
}

/* A closed-over value or default as partitioning's key holds it (scope._plain_fn_key's inline
 * cases): a new reference, or NULL without an exception for anything else. Cells: int, str
 * and None as they are, float as (float, v); defaults: the same, and class, float and bool as
 * (type, v). */
static PyObject *ph_plain(PyObject *v, int is_default) {
    PyTypeObject *t = Py_TYPE(v);
    if (t == &PyLong_Type || t == &PyUnicode_Type || v == Py_None) return Py_NewRef(v);
    if (t == &PyFloat_Type || (is_default && (t == &PyBool_Type || t == &PyType_Type)))
        return PyTuple_Pack(2, (PyObject *)t, v);
    return NULL;
}

/* scope._plain_fn_key(f) for a plain function (no keyword-only defaults), or NULL (with an
 * exception only on a real error). */
static PyObject *ph_fn_key(PyObject *f) {
    if (!PyFunction_Check(f)) return NULL;
    if (PyFunction_GetKwDefaults(f) != NULL && PyFunction_GetKwDefaults(f) != Py_None) return NULL;
    PyObject *cells = PyFunction_GetClosure(f), *defs = PyFunction_GetDefaults(f);
    PyObject *ck = NULL, *dk = NULL, *r = NULL;
    const Py_ssize_t nc = cells != NULL && cells != Py_None ? PyTuple_GET_SIZE(cells) : 0;
    const Py_ssize_t nd = defs != NULL && defs != Py_None ? PyTuple_GET_SIZE(defs) : 0;
    ck = PyTuple_New(nc);
    dk = ck != NULL ? PyTuple_New(nd) : NULL;
    if (dk == NULL) goto out;
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *v = PyCell_GET(PyTuple_GET_ITEM(cells, i));
        PyObject *k = v != NULL ? ph_plain(v, 0) : NULL;
        if (k == NULL) goto out;
        PyTuple_SET_ITEM(ck, i, k);
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *k = ph_plain(PyTuple_GET_ITEM(defs, i), 1);
        if (k == NULL) goto out;
        PyTuple_SET_ITEM(dk, i, k);
    }
    PyObject *kwd = PyTuple_New(0);
    r = kwd != NULL ? PyTuple_Pack(4, PyFunction_GetCode(f), dk, kwd, ck) : NULL;
    Py_XDECREF(kwd);
out:
    Py_XDECREF(ck);
    Py_XDECREF(dk);
    return r;
}

/* Whether every init argument is an int or a tuple of ints (the key holds them as they are). */
static int ph_plain_args(PyObject *args) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        if (PyLong_CheckExact(a)) continue;
        if (!PyTuple_CheckExact(a)) return 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(a); j++)
            if (!PyLong_CheckExact(PyTuple_GET_ITEM(a, j))) return 0;
    }
    return 1;
}

/* dict.get(key) of a dict (or a subclass that keeps dict.get, as FrozenDict), borrowed; NULL
 * when absent or anything else. */
static PyObject *ph_get(PyObject *d, PyObject *key) {
    if (d == NULL || !PyDict_Check(d)) return NULL;
    if (!PyDict_CheckExact(d)) {
        static PyObject *get_name, *dict_get;
        if (get_name == NULL && (get_name = PyUnicode_InternFromString("get")) == NULL) {
            PyErr_Clear();
            return NULL;
        }
        if (dict_get == NULL) dict_get = _PyType_Lookup(&PyDict_Type, get_name);
        if (dict_get == NULL || _PyType_Lookup(Py_TYPE(d), get_name) != dict_get) return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) PyErr_Clear();
    return v;
}


/* getattr(obj, name) (a new reference): read from the instance dict where the class has no
 * attribute of that name (so no descriptor can take precedence), at its offset where the
 * class's is an object field (nn.Module's state, a scope's slots), else the generic way. */
PyObject *ct_py_attr(PyObject *obj, PyObject *name) {
    PyObject *descr = _PyType_Lookup(Py_TYPE(obj), name);
    if (descr == NULL) {
        PyObject **dp = _PyObject_GetDictPtr(obj);
        if (dp != NULL && *dp != NULL && PyDict_CheckExact(*dp)) {
            PyObject *v = PyDict_GetItemWithError(*dp, name);
            if (v != NULL) return Py_NewRef(v);
            if (PyErr_Occurred()) return NULL;
        }
    } else if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        /* an object field (nn.Module's state, a __slots__ entry): read at its offset, as the
         * descriptor's __get__ would (T_OBJECT: None where unset; T_OBJECT_EX: the lookup
         * below raises) */
        const PyMemberDef *md = ((PyMemberDescrObject *)descr)->d_member;
        if ((md->type == T_OBJECT || md->type == T_OBJECT_EX) && !(md->flags & PY_AUDIT_READ) &&
            PyObject_TypeCheck(obj, PyDescr_TYPE(descr))) {
            PyObject *v = *(PyObject **)((char *)obj + md->offset);
            if (v != NULL) return Py_NewRef(v);
            if (md->type == T_OBJECT) Py_RETURN_NONE;
        }
    }
    return PyObject_GetAttr(obj, name);
}

/* The keys of recent hits, so that a declaration seen before finds its _CHECKED key without
 * building and hashing it: a key (code object, defaults, closure, arguments, axes, rules,
 * mesh, jit flag, shape) is a nest of tuples whose hash (the code object's included) is
 * computed anew at every lookup. A declaration's tag (from its initializer's code, the
 * parameter's name and its scope's path) picks a set of PH_WAYS slots; the slot of that tag
 * keeps the last key found for it and its hash. A later call whose every component equals
 * that key's (ph_same_key: the equality the dict lookup would use) looks the stored key up by
 * its stored hash, where the dict finds it by identity. A slot is only a guess: a component
 * that differs builds the key as before. Sets of several ways keep the declarations of a
 * model from evicting each other's keys when their tags (which depend on the process's string
 * hashes) share a set. */
#define PH_WAYS 4
#define PH_SETS 256
static struct { size_t tag; PyObject *key; Py_hash_t hash; } ph_memo[PH_SETS * PH_WAYS];
static unsigned ph_victim; /* the way a full set gives up next (round robin) */
/* the keys param_hit built (its memo had none equal) and swapped into _CHECKED: a repeated
 * apply of the same model builds none (read by _C.param_hit_stats, for the tests) */
static Py_ssize_t ph_built, ph_swapped;

/* Whether ph_plain(v, is_default) would equal `k` (a component of a stored key): 1, 0, -1. */
static int ph_same_plain(PyObject *k, PyObject *v, int is_default) {
    PyTypeObject *t = Py_TYPE(v);
    if (t == &PyLong_Type || t == &PyUnicode_Type || v == Py_None)
        return k == v ? 1 : PyObject_RichCompareBool(k, v, Py_EQ);
    if (t == &PyFloat_Type || (is_default && (t == &PyBool_Type || t == &PyType_Type))) {
        if (!PyTuple_CheckExact(k) || PyTuple_GET_SIZE(k) != 2 ||
            PyTuple_GET_ITEM(k, 0) != (PyObject *)t)
            return 0;
        PyObject *kv = PyTuple_GET_ITEM(k, 1);
        return kv == v ? 1 : PyObject_RichCompareBool(kv, v, Py_EQ);
    }
    return 0;
}

/* Whether ph_fn_key(f) would equal `fk` (a stored key's first item): 1, 0 or -1. */
static int ph_same_fn_key(PyObject *fk, PyObject *f) {
    if (!PyFunction_Check(f) || !PyTuple_CheckExact(fk) || PyTuple_GET_SIZE(fk) != 4 ||
        PyTuple_GET_ITEM(fk, 0) != PyFunction_GetCode(f))
        return 0;
    if (PyFunction_GetKwDefaults(f) != NULL && PyFunction_GetKwDefaults(f) != Py_None) return 0;
    PyObject *dk = PyTuple_GET_ITEM(fk, 1), *kwd = PyTuple_GET_ITEM(fk, 2);
    PyObject *ck = PyTuple_GET_ITEM(fk, 3);
    PyObject *cells = PyFunction_GetClosure(f), *defs = PyFunction_GetDefaults(f);
    const Py_ssize_t nc = cells != NULL && cells != Py_None ? PyTuple_GET_SIZE(cells) : 0;
    const Py_ssize_t nd = defs != NULL && defs != Py_None ? PyTuple_GET_SIZE(defs) : 0;
    if (!PyTuple_CheckExact(dk) || !PyTuple_CheckExact(kwd) || !PyTuple_CheckExact(ck) ||
        PyTuple_GET_SIZE(kwd) != 0 || PyTuple_GET_SIZE(dk) != nd || PyTuple_GET_SIZE(ck) != nc)
        return 0;
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *v = PyCell_GET(PyTuple_GET_ITEM(cells, i));
        if (v == NULL) return 0;
        const int r = ph_same_plain(PyTuple_GET_ITEM(ck, i), v, 0);
        if (r != 1) return r;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        const int r = ph_same_plain(PyTuple_GET_ITEM(dk, i), PyTuple_GET_ITEM(defs, i), 1);
        if (r != 1) return r;
    }
    return 1;
}

/* x == y as the key comparison does it (identity first): 1, 0 or -1. */
static int ph_eq(PyObject *x, PyObject *y) {
    return x == y ? 1 : PyObject_RichCompareBool(x, y, Py_EQ);
}

/* The active mesh (sharding.get_mesh(), a new reference): read from its thread-local state in
 * C where param_hit_setup was given it (sharding._mesh_tls and _UNSET), else by calling
 * get_mesh. get_mesh's rule: the innermost `with mesh:` block, or the set_mesh value, whichever
 * came later (their ticks); None when neither. */
static PyObject *ph_mesh(void) {
    PyObject *tls = ph_env[PH_MESH_TLS];
    if (tls == NULL || tls == Py_None) return PyObject_CallNoArgs(ph_env[PH_GET_MESH]);
    PyObject *stack = ct_py_tls_getattr(tls, ph_names[N_STACK]);
    if (stack == NULL) return NULL;
    PyObject *set = ct_py_tls_getattr(tls, ph_names[N_SET]);
    PyObject *r = NULL;
    if (set == NULL) goto out;
    if (!PyTuple_CheckExact(set) || PyTuple_GET_SIZE(set) != 2 ||
        (stack != Py_None && !PyList_CheckExact(stack))) {
        r = PyObject_CallNoArgs(ph_env[PH_GET_MESH]); /* (not the shapes get_mesh writes) */
        goto out;
    }
    if (stack != Py_None && PyList_GET_SIZE(stack) > 0) {
        PyObject *top = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1);
        if (!PyTuple_CheckExact(top) || PyTuple_GET_SIZE(top) != 2) {
            r = PyObject_CallNoArgs(ph_env[PH_GET_MESH]);
            goto out;
        }
        const int later = PyObject_RichCompareBool(PyTuple_GET_ITEM(top, 1),
                                                   PyTuple_GET_ITEM(set, 1), Py_GT);
        if (later < 0) goto out;
        if (later) {
            r = Py_NewRef(PyTuple_GET_ITEM(top, 0));
            goto out;
        }
    }
    r = PyTuple_GET_ITEM(set, 0) == ph_env[PH_UNSET] ? Py_NewRef(Py_None)
                                                    : Py_NewRef(PyTuple_GET_ITEM(set, 0));
out:
    Py_DECREF(stack);
    Py_XDECREF(set);
    return r;
}

/* Whether the key param_hit would build equals the stored `key`: 1, 0 or -1. */
static int ph_same_key(PyObject *key, PyObject *init_fn, PyObject *init_args, PyObject *axes,
                       PyObject *rules, PyObject *mesh, int in_jit, PyObject *shape) {
    if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) != 8) return 0;
    PyObject *mid = PyTuple_GET_ITEM(key, 5), *kw = PyTuple_GET_ITEM(key, 2);
    if (!PyLong_CheckExact(mid) || PyLong_AsVoidPtr(mid) != (void *)mesh) {
        if (PyErr_Occurred()) PyErr_Clear();
        return 0;
    }
    if (PyTuple_GET_ITEM(key, 6) != (in_jit ? Py_True : Py_False) || !PyTuple_CheckExact(kw) ||
        PyTuple_GET_SIZE(kw) != 0)
        return 0;
    int r = ph_same_fn_key(PyTuple_GET_ITEM(key, 0), init_fn);
    if (r == 1) r = ph_eq(PyTuple_GET_ITEM(key, 1), init_args);
    if (r == 1) r = ph_eq(PyTuple_GET_ITEM(key, 3), axes);
    if (r == 1) r = ph_eq(PyTuple_GET_ITEM(key, 4), rules);
    if (r == 1) r = ph_eq(PyTuple_GET_ITEM(key, 7), shape);
    return r;
}

/* The memo tag of a declaration: its initializer's code, its name and its scope's path (by
 * the strings' hashes: a path's names are made anew at every call). Never 0 (an empty slot's). */
static size_t ph_tag(PyObject *init_fn, PyObject *name, PyObject *path) {
    size_t h = (size_t)(PyFunction_Check(init_fn) ? PyFunction_GetCode(init_fn) : init_fn) >> 4;
    h = h * 1000003u + (size_t)PyObject_Hash(name);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(path); i++)
        h = h * 1000003u + (size_t)PyObject_Hash(PyTuple_GET_ITEM(path, i));
    if (PyErr_Occurred()) PyErr_Clear();   /* (an unhashable item: a tag all the same) */
    h ^= h >> 29;
    return h != 0 ? h : 1;
}

/* The slot of `tag`: the one of its set that holds it, else an empty one of the set, else the
 * set's next victim (whose key the caller replaces). */
static size_t ph_slot(size_t tag) {
    const size_t base = (tag % PH_SETS) * PH_WAYS;
    size_t empty = (size_t)-1;
    for (size_t w = 0; w < PH_WAYS; w++) {
        if (ph_memo[base + w].tag == tag) return base + w;
        if (empty == (size_t)-1 && ph_memo[base + w].key == NULL) empty = base + w;
    }
    return empty != (size_t)-1 ? empty : base + (ph_victim++ % PH_WAYS);
}

/* dict[key] by a known hash (borrowed; NULL without an exception when absent). */
static PyObject *ph_get_known_hash(PyObject *d, PyObject *key, Py_hash_t hash) {
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_GetItem_KnownHash(d, key, hash);
#else
    (void)hash;
    return PyDict_GetItemWithError(d, key);
#endif
}

static PyObject *ph_hit(PyObject *name, PyObject *init_fn, PyObject *init_args, PyObject *axes) {
    PyObject *miss = ph_env[PH_MISS];
    PyObject *stack = NULL, *module = NULL, *scope = NULL, *vars = NULL, *path = NULL;
    PyObject *mesh = NULL, *fkey = NULL, *rules = NULL, *depth = NULL, *shape = NULL;
    PyObject *key = NULL, *reserved = NULL, *children = NULL, *mutable = NULL, *rkey = NULL;
    PyObject *cur = NULL, *in_setup = NULL, *result = NULL;
    PyObject *value;
    if (!PyUnicode_CheckExact(name) || !PyTuple_CheckExact(init_args) || !PyTuple_CheckExact(axes) ||
        !ph_plain_args(init_args))
        goto miss;
    stack = ct_py_tls_getattr(ph_env[PH_CTX], ph_names[N_STACK]);
    if (stack == NULL) goto error;
    if (!PyList_CheckExact(stack) || PyList_GET_SIZE(stack) == 0) goto miss;
    PyObject *top = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1);
    if (!PyTuple_Check(top) || PyTuple_GET_SIZE(top) < 2) goto miss;
    module = Py_NewRef(PyTuple_GET_ITEM(top, 0));
    const int ism = PyObject_IsInstance(module, ph_env[PH_MODULE]);
    if (ism < 0) goto error;
    if (!ism || ph_get(ph_env[PH_PLAIN], (PyObject *)Py_TYPE(module)) != Py_True) goto miss;
    scope = ct_py_attr(module, ph_names[N_SCOPE]);
    if (scope == NULL) goto error;
    if (ph_get(ph_env[PH_PLAIN], (PyObject *)Py_TYPE(scope)) != Py_True) goto miss;
    vars = ct_py_attr(scope, ph_names[N_VARIABLES]);
    path = vars != NULL ? ct_py_attr(scope, ph_names[N_PATH]) : NULL;
    if (path == NULL) goto error;
    if (!PyTuple_CheckExact(path)) goto miss;
    PyObject *d = ph_get(vars, ph_names[N_PARAMS]);
    for (Py_ssize_t i = 0; d != NULL && i < PyTuple_GET_SIZE(path); i++)
        d = ph_get(d, PyTuple_GET_ITEM(path, i));
    value = ph_get(d, name);
    if (value == NULL || (PyObject *)Py_TYPE(value) != ph_env[PH_ARRAY]) goto miss;
    Py_INCREF(value); /* (held while Python code below runs) */
    mesh = ph_mesh();
    if (mesh == NULL) goto error_v;
    rules = py_get_axis_rules(NULL, NULL);
    depth = rules != NULL ? ct_py_tls_getattr(ph_env[PH_JIT_TLS], ph_names[N_DEPTH]) : NULL;
    /* (value is an Array, checked above: its fields are read directly) */
    shape = depth != NULL ? ((ct_py_array *)value)->shape : NULL;
    if (shape == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "Array without a shape");
        goto error_v;
    }
    Py_INCREF(shape);
    const long dv = PyLong_Check(depth) ? PyLong_AsLong(depth) : -1;
    if (dv == -1 && PyErr_Occurred()) goto error_v;
    if (dv < 0) goto miss_v;
    const int in_jit = dv > 0;
    const size_t tag = ph_tag(init_fn, name, path), slot = ph_slot(tag);
    Py_hash_t hash = -1;
    if (ph_memo[slot].tag == tag && ph_memo[slot].key != NULL) {
        const int same = ph_same_key(ph_memo[slot].key, init_fn, init_args, axes, rules, mesh,
                                     in_jit, shape);
        if (same < 0) goto error_v;
        if (same) {
            key = Py_NewRef(ph_memo[slot].key);
            hash = ph_memo[slot].hash;
        }
    }
    if (key == NULL) {
        fkey = ph_fn_key(init_fn);
        if (fkey == NULL) {
            if (PyErr_Occurred()) goto error_v;
            goto miss_v;
        }
        PyObject *mid = PyLong_FromVoidPtr(mesh);
        PyObject *empty = PyTuple_New(0);
        key = mid != NULL && empty != NULL
            ? PyTuple_Pack(8, fkey, init_args, empty, axes, rules, mid,
                           in_jit ? Py_True : Py_False, shape)
            : NULL;
        Py_XDECREF(mid);
        Py_XDECREF(empty);
        if (key == NULL) goto error_v;
        ph_built++;
        hash = PyObject_Hash(key);
        if (hash == -1) { /* unhashable rules: the Python path keys nothing either */
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto error_v;
            PyErr_Clear();
            goto miss_v;
        }
    }
    PyObject *entry = ph_get_known_hash(ph_env[PH_CHECKED], key, hash);
    if (entry == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto error_v;
            PyErr_Clear();
        }
        goto miss_v;
    }
    if (ph_memo[slot].key != key) {
        /* the dict's key becomes this one (equal, of the same hash), so that the slot's later
         * lookups find it by identity instead of comparing the nests of tuples */
        Py_INCREF(entry);
        const int swapped = PyDict_DelItem(ph_env[PH_CHECKED], key) == 0 &&
                            PyDict_SetItem(ph_env[PH_CHECKED], key, entry) == 0;
        Py_DECREF(entry); /* (the dict's again) */
        if (!swapped) goto error_v;
        ph_swapped++;
        Py_XSETREF(ph_memo[slot].key, Py_NewRef(key));
        ph_memo[slot].hash = hash;
        ph_memo[slot].tag = tag;
    }
    if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) < 4 ||
        PyList_GET_ITEM(entry, 0) != mesh)
        goto miss_v;
    Py_INCREF(entry);
    /* the declaration rule: in setup(), or the module's @compact frame is on the stack */
    in_setup = ct_py_attr(module, ph_names[N_IN_SETUP]);
    if (in_setup == NULL) goto error_ve;
    if (in_setup != Py_True) {
        int found = 0;
        for (Py_ssize_t i = 0; !found && i < PyList_GET_SIZE(stack); i++) {
            PyObject *f = PyList_GET_ITEM(stack, i);
            found = PyTuple_Check(f) && PyTuple_GET_SIZE(f) >= 2 && PyTuple_GET_ITEM(f, 0) == module &&
                    PyObject_IsTrue(PyTuple_GET_ITEM(f, 1)) == 1;
        }
        if (!found) goto miss_ve;
    }
    reserved = ct_py_attr(scope, ph_names[N_RESERVED]);
    children = reserved != NULL ? ct_py_attr(scope, ph_names[N_CHILDREN]) : NULL;
    mutable = children != NULL ? ct_py_attr(scope, ph_names[N_MUTABLE]) : NULL;
    if (mutable == NULL) goto error_ve;
    if (mutable != Py_False || !PySet_CheckExact(reserved) || !PyDict_CheckExact(children))
        goto miss_ve;
    rkey = PyTuple_Pack(2, ph_names[N_PARAMS], name);
    if (rkey == NULL) goto error_ve;
    int taken = PySet_Contains(reserved, rkey);
    if (taken == 0) taken = PySet_Contains(reserved, name);
    if (taken == 0) taken = PyDict_Contains(children, name);
    if (taken < 0) goto error_ve;
    if (taken) goto miss_ve;
    PyObject *target = PyList_GET_ITEM(entry, 2);
    if (target != Py_None) {
        if (target == ph_env[PH_LONG_PATH]) goto miss_ve;
        cur = Py_XNewRef(((ct_py_array *)value)->sharding);
        if (cur == NULL) goto miss_ve; /* (an Array not set up: the Python path says so) */
        PyObject *seen = PyList_GET_ITEM(entry, 3); /* the sharding objects seen equal */
        if (!PyTuple_CheckExact(seen)) goto miss_ve;
        Py_ssize_t i = 0;
        while (i < PyTuple_GET_SIZE(seen) && PyTuple_GET_ITEM(seen, i) != cur) i++;
        if (i == PyTuple_GET_SIZE(seen)) goto miss_ve;
    }
    if (PySet_Add(reserved, rkey) < 0) goto error_ve;
    result = value;
    Py_DECREF(entry);
    goto done;
miss_ve:
    Py_DECREF(entry);
miss_v:
    Py_DECREF(value);
miss:
    result = Py_NewRef(miss);
    goto done;
error_ve:
    Py_DECREF(entry);
error_v:
    Py_DECREF(value);
error:
    result = NULL;
done:
    Py_XDECREF(stack);
    Py_XDECREF(module);
    Py_XDECREF(scope);
    Py_XDECREF(vars);
    Py_XDECREF(path);
    Py_XDECREF(mesh);
    Py_XDECREF(fkey);
    Py_XDECREF(rules);
    Py_XDECREF(depth);
    Py_XDECREF(shape);
    Py_XDECREF(key);
    Py_XDECREF(reserved);
    Py_XDECREF(children);
    Py_XDECREF(mutable);
    Py_XDECREF(rkey);
    Py_XDECREF(cur);
    Py_XDECREF(in_setup);
    return result;
}

static PyObject *py_param_hit_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{snsn}", "keys_built", ph_built, "keys_swapped", ph_swapped);
}

static PyObject *py_param_hit(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 4)
        return PyErr_Format(PyExc_TypeError, "param_hit(name, init_fn, init_args, axes)");
    if (ph_env[PH_MISS] == NULL) return PyErr_Format(PyExc_RuntimeError, "param_hit_setup first");
    return ph_hit(args[0], args[1], args[2], args[3]);
}

/* --- partitioning.param_with_axes as a callable whose hit path is C ----------------------
 * ParamWithAxes(fallback): a call (name, init_fn, *init_args, axes=<tuple>) with no other
 * keyword, while no strict rules are installed (partitioning's condition for param_hit), is
 * param_hit's; anything else, and a miss, calls `fallback` (the Python function) with the same
 * arguments. It carries a __dict__, so the function's __doc__, __name__, __module__ and
 * __wrapped__ can be set on it (inspect.signature and doctest read them). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;
    PyObject *dict;
} pwa_object;

static PyObject *pwa_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    pwa_object *f = (pwa_object *)self;
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n >= 2 && kwnames != NULL && PyTuple_GET_SIZE(kwnames) == 1 && ph_env[PH_MISS] != NULL &&
        ph_env[PH_STRICT] != NULL && ph_env[PH_STRICT] != Py_None) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, 0);
        int is_axes = kw == ph_names[N_AXES];
        if (!is_axes && PyUnicode_Check(kw)) is_axes = PyUnicode_Compare(kw, ph_names[N_AXES]) == 0;
        if (is_axes && PyTuple_CheckExact(args[n]) && PyUnicode_CheckExact(args[0])) {
            PyObject *strict = ct_py_tls_getattr(ph_env[PH_STRICT], ph_names[N_RULES]);
            if (strict == NULL) return NULL;
            const int plain = strict == Py_None;
            Py_DECREF(strict);
            if (plain) {
                PyObject *init_args = PyTuple_New(n - 2);
                if (init_args == NULL) return NULL;
                for (Py_ssize_t i = 2; i < n; i++)
                    PyTuple_SET_ITEM(init_args, i - 2, Py_NewRef(args[i]));
                PyObject *r = ph_hit(args[0], args[1], init_args, args[n]);
                Py_DECREF(init_args);
                if (r == NULL || r != ph_env[PH_MISS]) return r;
                Py_DECREF(r);
            }
        }
    }
    return PyObject_Vectorcall(f->fallback, args, nargsf, kwnames);
}

/* A new object of one of the callables with a C hit path over a Python fallback (their
 * layout is pwa_object's): `name(fallback)`, the fallback checked callable. */
static PyObject *fallback_new(PyTypeObject *type, PyObject *args, PyObject *kwds,
                              const char *name, vectorcallfunc call) {
    PyObject *fallback;
    if (!PyArg_UnpackTuple(args, name, 1, 1, &fallback)) return NULL;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) > 0)
        return PyErr_Format(PyExc_TypeError, "%s takes no keyword arguments", name);
    if (!PyCallable_Check(fallback))
        return PyErr_Format(PyExc_TypeError, "%s: the fallback must be callable", name);
    pwa_object *f = (pwa_object *)type->tp_alloc(type, 0);
    if (f == NULL) return NULL;
    f->vectorcall = call;
    f->fallback = Py_NewRef(fallback);
    return (PyObject *)f;
}

static PyObject *pwa_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return fallback_new(type, args, kwds, "ParamWithAxes", pwa_vectorcall);
}

static int pwa_traverse(pwa_object *f, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(f));
    Py_VISIT(f->fallback);
    Py_VISIT(f->dict);
    return 0;
}

static int pwa_clear(pwa_object *f) {
    Py_CLEAR(f->fallback);
    Py_CLEAR(f->dict);
    return 0;
}

static void pwa_dealloc(pwa_object *f) {
    PyTypeObject *tp = Py_TYPE(f);
    PyObject_GC_UnTrack(f);
    pwa_clear(f);
    tp->tp_free((PyObject *)f);
    Py_DECREF(tp);
}

/* pickle by name, as functions are: the module attribute it was set as (__module__, __name__) */
static PyObject *pwa_reduce(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyObject_GetAttrString(self, "__name__");
}

static PyMethodDef pwa_methods[] = {
    {"__reduce__", pwa_reduce, METH_NOARGS, "Pickled by name, as a function is."},
    {NULL, NULL, 0, NULL},
};

static PyObject *pwa_repr(pwa_object *f) {
    return PyUnicode_FromFormat("<ctrainstate function param_with_axes (C hit path over %R)>",
                                f->fallback);
}

static PyMemberDef pwa_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(pwa_object, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(pwa_object, dict), READONLY, NULL},
    {"fallback", T_OBJECT, offsetof(pwa_object, fallback), READONLY,
     "The Python function every other call goes to."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot pwa_slots[] = {
    {Py_tp_new, pwa_new},
    {Py_tp_dealloc, pwa_dealloc},
    {Py_tp_traverse, pwa_traverse},
    {Py_tp_clear, pwa_clear},
    {Py_tp_repr, pwa_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, pwa_members},
    {Py_tp_methods, pwa_methods},
    {Py_tp_doc, "ParamWithAxes(fallback)\n--\n\n"
                "partitioning.param_with_axes with its hit path in C (param_hit); every other "
                "call, and a miss, goes to `fallback`."},
    {0, NULL},
};

static PyType_Spec pwa_spec = {
    .name = "ctrainstate._C.ParamWithAxes",
    .basicsize = sizeof(pwa_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = pwa_slots,
};

/* --- spmd.with_logical_constraint's hit path -------------------------------------------
 * LogicalConstraint(fallback): a call (x, logical_spec) — no rules, mesh or fallback given —
 * of an Array outside jit while no strict rules are installed, whose constraint target is in
 * spmd._TARGETS (keyed (spec, rules, _DEFAULT_FALLBACK, id(mesh)) with the active rules and
 * mesh) and whose sharding is that target or was seen equal to it (spmd._SEEN_EQUAL), is x
 * itself, as the Python function answers; so is a call whose target is None (no mesh, or the
 * spec resolves to no constraint). Every other call runs `fallback`, the Python function. */
enum { LC_TARGETS, LC_SEEN, LC_DEFAULT_FALLBACK, LC_LONG_PATH, LC_STRICT, LC_JIT_TLS, LC_ARRAY,
       LC_N };
static PyObject *lc_env[LC_N];

static PyObject *py_constraint_setup(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *env[LC_N];
    if (!PyArg_ParseTuple(args, "O!O!OOOOO!:constraint_setup", &PyDict_Type, &env[LC_TARGETS],
                          &PyDict_Type, &env[LC_SEEN], &env[LC_DEFAULT_FALLBACK],
                          &env[LC_LONG_PATH], &env[LC_STRICT], &env[LC_JIT_TLS], &PyType_Type,
                          &env[LC_ARRAY]))
        return NULL;
    for (int i = 0; i < LC_N; i++) Py_XSETREF(lc_env[i], Py_NewRef(env[i]));
    Py_RETURN_NONE;
}

/* The entries of _TARGETS found last, with their key's spec and rules: a call with the same
 * rules object, a mesh that is the entry's and an equal spec (ls_same_spec) takes the entry
 * without building and hashing the key, whose rules are a nest of tuples hashed anew at every
 * lookup. _TARGETS is a cache of a function of its key, so an entry found once stays right
 * after the dict drops it. The entries hold their mesh and target, as _TARGETS does. */
enum { LC_MEMO = 8 };
static struct { PyObject *logical, *rules, *entry; } lc_memo[LC_MEMO];
static unsigned lc_memo_next;

/* Whether the spec `a` equals the memo's `b` by identity of their items or equal strings (an
 * equality that implies the dict's): 1 or 0. */
static int ls_same_spec(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    const Py_ssize_t n = PyTuple_GET_SIZE(a);
    if (PyTuple_GET_SIZE(b) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *u = PyTuple_GET_ITEM(a, i), *v = PyTuple_GET_ITEM(b, i);
        if (u != v && (!PyUnicode_CheckExact(u) || !PyUnicode_CheckExact(v) ||
                       PyUnicode_Compare(u, v) != 0))
            return 0;
    }
    return 1;
}

/* x when the hit path answers it (a new reference), the `miss` sentinel (borrowed, not a new
 * reference: compared by the caller) when the Python function must run, NULL on an error. */
static PyObject *lc_hit(PyObject *x, PyObject *logical) {
    static char miss;
    PyObject *const MISS = (PyObject *)&miss;
    if ((PyObject *)Py_TYPE(x) != lc_env[LC_ARRAY] || !PyTuple_CheckExact(logical)) return MISS;
    PyObject *strict = ct_py_tls_getattr(lc_env[LC_STRICT], ph_names[N_RULES]);
    if (strict == NULL) return NULL;
    const int plain = strict == Py_None;
    Py_DECREF(strict);
    if (!plain) return MISS;
    PyObject *rules = py_get_axis_rules(NULL, NULL);
    if (rules == NULL) return NULL;
    PyObject *mesh = NULL, *mid = NULL, *key = NULL, *held = NULL, *r = MISS;
    if (!PyTuple_CheckExact(rules) || PyTuple_GET_SIZE(rules) == 0) goto out; /* (empty: Python) */
    mesh = ph_mesh();
    if (mesh == NULL) goto error;
    PyObject *entry = NULL;
    for (int i = 0; i < LC_MEMO && entry == NULL; i++)
        if (lc_memo[i].rules == rules && PyTuple_GET_ITEM(lc_memo[i].entry, 0) == mesh &&
            ls_same_spec(logical, lc_memo[i].logical))
            entry = lc_memo[i].entry;
    if (entry == NULL) {
        mid = PyLong_FromVoidPtr(mesh);
        key = mid != NULL ? PyTuple_Pack(4, logical, rules, lc_env[LC_DEFAULT_FALLBACK], mid)
                          : NULL;
        if (key == NULL) goto error;
        entry = PyDict_GetItemWithError(lc_env[LC_TARGETS], key);
        if (entry == NULL) {
            if (PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto error;
                PyErr_Clear(); /* (an unhashable spec: the Python function's long way) */
            }
            goto out;
        }
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
            PyTuple_GET_ITEM(entry, 0) != mesh)
            goto out;
        const unsigned m = lc_memo_next++ % LC_MEMO;
        Py_XSETREF(lc_memo[m].logical, Py_NewRef(logical));
        Py_XSETREF(lc_memo[m].rules, Py_NewRef(rules));
        Py_XSETREF(lc_memo[m].entry, Py_NewRef(entry));
    }
    held = Py_NewRef(entry); /* (the memo's may be replaced by a call on another thread) */
    PyObject *target = PyTuple_GET_ITEM(entry, 1);
    if (target == Py_None) {
        r = Py_NewRef(x);
        goto out;
    }
    if (target == lc_env[LC_LONG_PATH]) goto out;
    PyObject *depth = ct_py_tls_getattr(lc_env[LC_JIT_TLS], ph_names[N_DEPTH]);
    if (depth == NULL) goto error;
    const long dv = PyLong_Check(depth) ? PyLong_AsLong(depth) : 1;
    Py_DECREF(depth);
    if (dv == -1 && PyErr_Occurred()) goto error;
    if (dv > 0) goto out;
    PyObject *cur = Py_XNewRef(((ct_py_array *)x)->sharding); /* (x is an Array) */
    if (cur == NULL) goto out; /* (an Array not set up: the Python function says so) */
    int same = cur == target;
    if (!same) {
        PyObject *tid = PyLong_FromVoidPtr(target);
        if (tid == NULL) {
            Py_DECREF(cur);
            goto error;
        }
        PyObject *seen = PyDict_GetItemWithError(lc_env[LC_SEEN], tid);
        Py_DECREF(tid);
        if (seen == NULL && PyErr_Occurred()) {
            Py_DECREF(cur);
            goto error;
        }
        if (seen != NULL && PyTuple_CheckExact(seen) && PyTuple_GET_SIZE(seen) == 2 &&
            PyTuple_GET_ITEM(seen, 0) == target && PyTuple_CheckExact(PyTuple_GET_ITEM(seen, 1))) {
            PyObject *curs = PyTuple_GET_ITEM(seen, 1); /* (the shardings seen equal) */
            for (Py_ssize_t i = 0; !same && i < PyTuple_GET_SIZE(curs); i++)
                same = PyTuple_GET_ITEM(curs, i) == cur;
        }
    }
    Py_DECREF(cur);
    if (same) r = Py_NewRef(x);
    goto out;
error:
    r = NULL;
out:
    Py_DECREF(rules);
    Py_XDECREF(mesh);
    Py_XDECREF(mid);
    Py_XDECREF(key);
    Py_XDECREF(held);
    return r;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;
    PyObject *dict;
} lc_object;

static PyObject *lc_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    lc_object *f = (lc_object *)self;
    if (PyVectorcall_NARGS(nargsf) == 2 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) &&
        lc_env[LC_TARGETS] != NULL && ph_env[PH_MESH_TLS] != NULL &&
        ph_env[PH_MESH_TLS] != Py_None) {
        PyObject *r = lc_hit(args[0], args[1]);
        if (r == NULL) return NULL;
        if (r == args[0]) return r;    /* (a new reference to x) */
    }
    return PyObject_Vectorcall(f->fallback, args, nargsf, kwnames);
}

_Static_assert(offsetof(lc_object, vectorcall) == offsetof(pwa_object, vectorcall) &&
                   offsetof(lc_object, fallback) == offsetof(pwa_object, fallback) &&
                   sizeof(lc_object) == sizeof(pwa_object),
               "LogicalConstraint has ParamWithAxes' layout (fallback_new makes both)");

static PyObject *lc_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return fallback_new(type, args, kwds, "LogicalConstraint", lc_vectorcall);
}

static PyObject *lc_repr(lc_object *f) {
    return PyUnicode_FromFormat("<ctrainstate function with_logical_constraint (C hit path over "
                                "%R)>", f->fallback);
}

static PyMemberDef lc_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(lc_object, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(lc_object, dict), READONLY, NULL},
    {"fallback", T_OBJECT, offsetof(lc_object, fallback), READONLY,
     "The Python function every other call goes to."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot lc_slots[] = {
    {Py_tp_new, lc_new},
    {Py_tp_dealloc, pwa_dealloc}, /* (the same layout as ParamWithAxes) */
    {Py_tp_traverse, pwa_traverse},
    {Py_tp_clear, pwa_clear},
    {Py_tp_repr, lc_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, lc_members},
    {Py_tp_methods, pwa_methods},
    {Py_tp_doc, "LogicalConstraint(fallback)\n--\n\n"
                "spmd.with_logical_constraint with its hit path in C (an Array already placed "
                "as its logical spec resolves: the Array itself); every other call goes to "
                "`fallback`."},
    {0, NULL},
};

static PyType_Spec lc_spec = {
    .name = "ctrainstate._C.LogicalConstraint",
    .basicsize = sizeof(lc_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = lc_slots,
};

/* --- nn.Module.param's hit path ----------------------------------------------------------
 * ModuleParam(fallback) is what nn.module puts in place of Module.param: a method descriptor
 * whose call (self, name, init_fn, *init_args) — no keyword argument — answers the existing
 * parameter's value in C where nn.module._existing_param would (the module bound and
 * declaring, no strict rules, its scope of a class keeping Scope's methods (nn.module.
 * _PLAIN_SCOPES says True), the name free, the parameter in the scope's 'params' (plain
 * dicts along the path) an Array whose shape is the one the initializer makes, found in
 * nn.scope._SHAPES_BY_ID by the initializer's identity and arguments); the name is then
 * reserved, as there. Every other call, and any condition that does not hold (nothing is
 * changed before all are checked), goes to `fallback`, the Python method, with the same
 * arguments: it raises, creates or handles the rest. */
enum { MP_MODULE, MP_CTX, MP_STRICT, MP_PLAIN_SCOPES, MP_SHAPES_BY_ID, MP_ARRAY, MP_N };
static PyObject *mp_env[MP_N];
static PyObject *mp_str_params, *mp_str_in_setup, *mp_str_scope;

static PyObject *py_module_param_setup(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *env[MP_N];
    if (!PyArg_ParseTuple(args, "O!OOO!O!O!:module_param_setup", &PyType_Type, &env[MP_MODULE],
                          &env[MP_CTX], &env[MP_STRICT], &PyDict_Type, &env[MP_PLAIN_SCOPES],
                          &PyDict_Type, &env[MP_SHAPES_BY_ID], &PyType_Type, &env[MP_ARRAY]))
        return NULL;
    if (ph_names_init() < 0 ||
        (mp_str_params == NULL && (mp_str_params = PyUnicode_InternFromString("params")) == NULL) ||
        (mp_str_in_setup == NULL &&
         (mp_str_in_setup = PyUnicode_InternFromString("_in_setup")) == NULL) ||
        (mp_str_scope == NULL && (mp_str_scope = PyUnicode_InternFromString("_scope")) == NULL))
        return NULL;
    for (int i = 0; i < MP_N; i++) Py_XSETREF(mp_env[i], Py_NewRef(env[i]));
    Py_RETURN_NONE;
}

/* The value (a new reference), `miss` (borrowed) where the Python method must run, or NULL
 * with an exception. */
static PyObject *mp_hit(PyObject *self, PyObject *name, PyObject *init_fn, PyObject *init_args,
                        PyObject *miss) {
    PyObject *stack = NULL, *strict = NULL, *reserved = NULL, *children = NULL, *vars = NULL;
    PyObject *path = NULL, *rkey = NULL, *key = NULL, *result = miss;
    if (!PyUnicode_CheckExact(name)) return miss;
    const int ism = PyObject_IsInstance(self, mp_env[MP_MODULE]);
    if (ism <= 0) return ism < 0 ? NULL : miss;
    PyObject *scope = ct_py_attr(self, mp_str_scope); /* (the module's ModuleBase field) */
    if (scope == NULL) return NULL;
    if (scope == Py_None) {
        Py_DECREF(scope);
        return miss;
    }
    if (ph_get(mp_env[MP_PLAIN_SCOPES], (PyObject *)Py_TYPE(scope)) != Py_True) goto out;
    strict = ct_py_tls_getattr(mp_env[MP_STRICT], ph_names[N_RULES]);
    if (strict == NULL) goto error;
    if (strict != Py_None) goto out;
    /* the declaration rule: in setup(), or the module's @compact frame is on the stack */
    PyObject *in_setup = ct_py_attr(self, mp_str_in_setup);
    if (in_setup == NULL) goto error;
    Py_DECREF(in_setup);     /* (compared by identity only: True stays alive) */
    if (in_setup != Py_True) {
        stack = ct_py_tls_getattr(mp_env[MP_CTX], ph_names[N_STACK]);
        if (stack == NULL) goto error;
        if (!PyList_CheckExact(stack)) goto out;
        int found = 0;
        for (Py_ssize_t i = 0; !found && i < PyList_GET_SIZE(stack); i++) {
            PyObject *f = PyList_GET_ITEM(stack, i);
            if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) < 2 || PyTuple_GET_ITEM(f, 0) != self)
                continue;
            found = PyObject_IsTrue(PyTuple_GET_ITEM(f, 1));
            if (found < 0) goto error;
        }
        if (!found) goto out;
    }
    reserved = ct_py_attr(scope, ph_names[N_RESERVED]);
    children = reserved != NULL ? ct_py_attr(scope, ph_names[N_CHILDREN]) : NULL;
    vars = children != NULL ? ct_py_attr(scope, ph_names[N_VARIABLES]) : NULL;
    path = vars != NULL ? ct_py_attr(scope, ph_names[N_PATH]) : NULL;
    if (path == NULL) goto error;
    if (!PySet_CheckExact(reserved) || !PyDict_CheckExact(children) || !PyTuple_CheckExact(path))
        goto out;
    rkey = PyTuple_Pack(2, mp_str_params, name);
    if (rkey == NULL) goto error;
    int taken = PySet_Contains(reserved, rkey);
    if (taken == 0) taken = PySet_Contains(reserved, name);
    if (taken == 0) taken = PyDict_Contains(children, name);
    if (taken != 0) {
        if (taken < 0) goto error;
        goto out;
    }
    PyObject *d = ph_get(vars, mp_str_params);
    for (Py_ssize_t i = 0; d != NULL && i < PyTuple_GET_SIZE(path); i++)
        d = ph_get(d, PyTuple_GET_ITEM(path, i));
    PyObject *value = ph_get(d, name);
    if (value == NULL || (PyObject *)Py_TYPE(value) != mp_env[MP_ARRAY]) goto out;
    /* the shapes the initializer makes: its entry by identity, as _expected_shapes_cached */
    PyObject *fid = PyLong_FromVoidPtr(init_fn);
    key = fid != NULL ? PyTuple_Pack(2, fid, init_args) : NULL;
    Py_XDECREF(fid);
    if (key == NULL) goto error;
    PyObject *entry = PyDict_GetItemWithError(mp_env[MP_SHAPES_BY_ID], key);
    if (entry == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto error;
            PyErr_Clear(); /* (unhashable arguments: the Python method's long way) */
        }
        goto out;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
        PyTuple_GET_ITEM(entry, 0) != init_fn)
        goto out;
    PyObject *shapes = PyTuple_GET_ITEM(entry, 1); /* (a list of leaf shapes, or None) */
    if (shapes != Py_None) {
        PyObject *have = ((ct_py_array *)value)->shape;
        if (!PyList_CheckExact(shapes) || PyList_GET_SIZE(shapes) != 1 || have == NULL) goto out;
        const int same = PyObject_RichCompareBool(have, PyList_GET_ITEM(shapes, 0), Py_EQ);
        if (same <= 0) {
            if (same < 0) goto error;
            goto out; /* (the Python method raises ScopeParamShapeError) */
        }
    }
    Py_INCREF(value); /* (before the set's hash of rkey can run code) */
    if (PySet_Add(reserved, rkey) < 0) {
        Py_DECREF(value);
        goto error;
    }
    result = value;
    goto out;
error:
    result = NULL;
out:
    Py_DECREF(scope);
    Py_XDECREF(stack);
    Py_XDECREF(strict);
    Py_XDECREF(reserved);
    Py_XDECREF(children);
    Py_XDECREF(vars);
    Py_XDECREF(path);
    Py_XDECREF(rkey);
    Py_XDECREF(key);
    return result;
}

static PyObject *mp_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    pwa_object *f = (pwa_object *)self;
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n >= 3 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) &&
        mp_env[MP_ARRAY] != NULL) {
        static char miss_mark;
        PyObject *const MISS = (PyObject *)&miss_mark;
        PyObject *init_args = PyTuple_New(n - 3);
        if (init_args == NULL) return NULL;
        for (Py_ssize_t i = 3; i < n; i++) PyTuple_SET_ITEM(init_args, i - 3, Py_NewRef(args[i]));
        PyObject *r = mp_hit(args[0], args[1], args[2], init_args, MISS);
        Py_DECREF(init_args);
        if (r != MISS) return r;
    }
    return PyObject_Vectorcall(f->fallback, args, nargsf, kwnames);
}

static PyObject *mp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return fallback_new(type, args, kwds, "ModuleParam", mp_vectorcall);
}

/* As a function: itself on the class, a bound method on an instance. */
static PyObject *mp_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* pickle by reference, as functions are: the attribute __qualname__ of module __module__ */
static PyObject *mp_reduce(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyMethodDef mp_methods[] = {
    {"__reduce__", mp_reduce, METH_NOARGS, "Pickled by reference, as a function is."},
    {NULL, NULL, 0, NULL},
};

static PyObject *mp_repr(pwa_object *f) {
    return PyUnicode_FromFormat("<ctrainstate method Module.param (C hit path over %R)>",
                                f->fallback);
}

static PyGetSetDef mp_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot mp_slots[] = {
    {Py_tp_new, mp_new},
    {Py_tp_getset, mp_getset},
    {Py_tp_dealloc, pwa_dealloc},
    {Py_tp_traverse, pwa_traverse},
    {Py_tp_clear, pwa_clear},
    {Py_tp_repr, mp_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, mp_descr_get},
    {Py_tp_members, pwa_members},
    {Py_tp_methods, mp_methods},
    {Py_tp_doc, "ModuleParam(fallback)\n--\n\n"
                "nn.Module.param with the hit path of an existing parameter in C; every other "
                "call, and a miss, goes to `fallback` (the Python method). A method "
                "descriptor, as a function is."},
    {0, NULL},
};

static PyType_Spec mp_spec = {
    .name = "ctrainstate._C.ModuleParam",
    .basicsize = sizeof(pwa_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = mp_slots,
};

/* --- nn.Module.apply's common case --------------------------------------------------------
 * ModuleApply(fallback) is what nn.module puts in place of Module.apply: a method descriptor
 * whose call (self, variables, *args) without keywords runs ct_py_module_apply (py_module.c:
 * apply -> _run -> _clone_bound in C where their common case holds); every other call goes
 * to `fallback`, the Python method, with the same arguments. Its layout and everything but
 * the call are ModuleParam's. */
static PyObject *ma_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    pwa_object *f = (pwa_object *)self;
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n >= 2 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        static char miss_mark;
        PyObject *const MISS = (PyObject *)&miss_mark;
        PyObject *r = ct_py_module_apply(args[0], args + 1, n - 1, MISS);
        if (r != MISS) return r;
    }
    return PyObject_Vectorcall(f->fallback, args, nargsf, kwnames);
}

static PyObject *ma_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return fallback_new(type, args, kwds, "ModuleApply", ma_vectorcall);
}

static PyObject *ma_repr(pwa_object *f) {
    return PyUnicode_FromFormat("<ctrainstate method Module.apply (C common case over %R)>",
                                f->fallback);
}

static PyType_Slot ma_slots[] = {
    {Py_tp_new, ma_new},
    {Py_tp_getset, mp_getset},
    {Py_tp_dealloc, pwa_dealloc},
    {Py_tp_traverse, pwa_traverse},
    {Py_tp_clear, pwa_clear},
    {Py_tp_repr, ma_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, mp_descr_get},
    {Py_tp_members, pwa_members},
    {Py_tp_methods, mp_methods},
    {Py_tp_doc, "ModuleApply(fallback)\n--\n\n"
                "nn.Module.apply with its common case (no keyword arguments) in C; every "
                "other call goes to `fallback` (the Python method). A method descriptor, as "
                "a function is."},
    {0, NULL},
};

static PyType_Spec ma_spec = {
    .name = "ctrainstate._C.ModuleApply",
    .basicsize = sizeof(pwa_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = ma_slots,
};

static PyMethodDef rules_methods[] = {
    {"get_axis_rules", py_get_axis_rules, METH_NOARGS, get_axis_rules_doc},
    {"set_axis_rules", py_set_axis_rules, METH_O, set_axis_rules_doc},
    {"resolve_logical_axes", (PyCFunction)(void (*)(void))py_resolve,
     METH_VARARGS | METH_KEYWORDS, resolve_doc},
    {"_rules_set_unconstrained", py_set_unconstrained, METH_O, set_unconstrained_doc},
    {"param_hit_setup", py_param_hit_setup, METH_VARARGS,
     "param_hit_setup(ctx, plain_classes, module_type, checked, get_mesh, jit_tls, array_type, "
     "miss, long_path, mesh_tls=None, unset=None, strict=None, /)\n--\n\nThe objects "
     "param_hit reads (set once by ctrainstate.partitioning): mesh_tls and unset "
     "(sharding._mesh_tls, _UNSET) let it read the active mesh in C, strict (spmd._strict) "
     "lets ParamWithAxes take its hit path."},
    {"constraint_setup", py_constraint_setup, METH_VARARGS,
     "constraint_setup(targets, seen_equal, default_fallback, long_path, strict, jit_tls, "
     "array_type, /)\n--\n\nThe objects LogicalConstraint's hit path reads (set once by "
     "ctrainstate._src.nn.spmd)."},
    {"module_param_setup", py_module_param_setup, METH_VARARGS,
     "module_param_setup(module_type, ctx, strict, plain_scopes, shapes_by_id, array_type, "
     "/)\n--\n\nThe objects ModuleParam's hit path reads (set once by nn.module)."},
    {"param_hit_stats", py_param_hit_stats, METH_NOARGS,
     "param_hit_stats()\n--\n\nCounts since the process started: the keys param_hit built "
     "because its memo held none equal (keys_built) and the memo slots it refilled "
     "(keys_swapped). A repeated apply of a model whose declarations were all seen adds none."},
    {"param_hit", (PyCFunction)(void (*)(void))py_param_hit, METH_FASTCALL,
     "param_hit(name, init_fn, init_args, axes, /)\n--\n\n"
     "param_with_axes' hit path (see partitioning._CHECKED): the existing parameter's value, "
     "or the miss object where the Python path must run."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_rules(PyObject *m) {
    rules_key = PyUnicode_InternFromString(RULES_KEY);
    if (rules_key == NULL) return -1;
    PyObject *pwa = PyType_FromSpec(&pwa_spec);
    if (pwa == NULL || PyModule_AddObject(m, "ParamWithAxes", pwa) < 0) {
        Py_XDECREF(pwa);
        return -1;
    }
    PyObject *mp = PyType_FromSpec(&mp_spec);
    if (mp == NULL || PyModule_AddObject(m, "ModuleParam", mp) < 0) {
        Py_XDECREF(mp);
        return -1;
    }
    PyObject *ma = PyType_FromSpec(&ma_spec);
    if (ma == NULL || PyModule_AddObject(m, "ModuleApply", ma) < 0) {
        Py_XDECREF(ma);
        return -1;
    }
    PyObject *lc = PyType_FromSpec(&lc_spec);
    if (lc == NULL || PyModule_AddObject(m, "LogicalConstraint", lc) < 0) {
        Py_XDECREF(lc);
        return -1;
    }
    if (PyType_Ready(&AxisRulesType) < 0) return -1;
    if (PyModule_AddFunctions(m, rules_methods) < 0) return -1;
    Py_INCREF(&AxisRulesType);
    if (PyModule_AddObject(m, "axis_rules", (PyObject *)&AxisRulesType) < 0) {
        Py_DECREF(&AxisRulesType);
        return -1;
    }
    return 0;
}
