/*
 * py_module.c — ctrainstate._C.module_call / ModuleMethod / module_bind_new: the common case
 * of an nn.Module method call and of a submodule's construction inside an @compact method, in
 * C.
 *
 * A model's apply runs every module method through nn.module's wrapper (the module's frame
 * pushed, its setup done, a new @compact call's names reset) and attaches every submodule
 * it constructs to its parent (a name, a child scope, the fields' adoption). In Python that
 * is most of a small model's host time besides the ops. These two functions do the same in
 * C for the common case and hand everything else to the Python functions they were set up
 * with (module_setup), which stay the reference: each C path first checks every condition
 * of its case, and only then changes state, so a call the C path declines reaches the
 * Python one unchanged (and raises, or handles the rare case, there). Hand-written for
 * speed: no library does this.
 *
 * module_call(fn, self, args, kwargs): nn.module._call_method's common case (see there):
 * `self` is bound, its setup is done or trivially done (no setup() to run, fields adopted),
 * no nn.tabulate recorder and no capture_intermediates filter is active; the frame is
 * pushed, a new @compact call resets the module's names and its scope's reservations, fn
 * runs, the frame is popped.
 *
 * ModuleMethod(fn): the wrapper nn.module puts in place of a user method, a C callable whose
 * call (self, *args, **kwargs) is module_call's without a Python frame (see below).
 *
 * module_bind_new(module, stack): nn.module._bind_new's common case: the innermost frame is
 * an @compact frame of a module whose class keeps Module._attach, whose scope is exactly a
 * ModuleScope and which is not in setup(); the name (given, or the next auto name) is free
 * (no submodule and no variable of the scope has it). Module._attach's work follows: the
 * child is named, parented and given its child scope (made as _new_child_scope makes it),
 * and its fields are marked adopted where they hold no module (scalars and tuples of
 * scalars, the class keeping Module._adopt_fields); otherwise nn.module._adopt_tail does
 * the rest.
 *
 * module_post_init(module, d): the end of nn.module's generated __init__ (Module.__post_init__'s
 * work, module_bind_new's where a module method runs) in one call.
 *
 * ModuleInit(...): that generated __init__ itself in C, the __init__ of a Module class whose
 * fields are plain: the arguments bound to the dataclass signature, the fields stored, the
 * post-init work done, without a Python frame; a call it does not bind (an argument error,
 * Flax's parent=) goes to the Python function (see below).
 *
 * copy_tree(tree): the copy of the caller's variables that apply and bind make.
 *
 * ModuleBase: nn.Module's base class, a module's own state (scope, parent, setup flags, the
 * names of its submodules, its children) in C fields read here at fixed offsets.
 *
 * module_release(holder): the end of an apply. A bound module tree is a cycle (parents hold
 * their children in `_children`, children their parent in `_parent`), so each apply left its
 * modules, scopes and their dicts to the cycle collector, whose collections then ran every
 * few applies. Where nothing outside the tree references it any more, the cycle is cut and
 * the tree is freed at once (see py_module_release).
 */
#include "ct_py.h"

#include <structmember.h>

enum { MS_CTX, MS_MODULE, MS_FRAME, MS_SCOPE, MS_ATTACH, MS_ADOPT_FIELDS, MS_SETUP, MS_TRY_SETUP,
       MS_PLAIN_INFO, MS_CALL_SLOW, MS_BIND_SLOW, MS_ADOPT_TAIL, MS_N };
static PyObject *ms_env[MS_N];
/* the offsets of the scope type's slots _variables, rngs, mutable, path, _reserved, _children,
 * root_rngs, rng_counters, initializing, adopted (module_setup finds them) */
enum { MS_SCOPE_N = 10 };
static Py_ssize_t ms_scope_off[MS_SCOPE_N];

#define MS_NAMES(X)                                                                         \
    X(stack) X(recorders) X(capture) X(_scope) X(_setup_done) X(_fields_adopted) X(setup)   \
    X(_try_setup) X(_attach) X(_ct_compact) X(_auto_counts) X(_field_names) X(_setup_names) \
    X(_call_names) X(_reserved) X(_setup_reserved) X(_in_setup) X(name) X(_parent)          \
    X(_children) X(_variables) X(rngs) X(mutable) X(path) X(root_rngs) X(rng_counters)      \
    X(initializing) X(adopted) X(_ct_plain_fields) X(__dataclass_fields__) X(__name__)   \
    X(_adopt_fields) X(__post_init__) X(__dict__) X(scopes) X(_ct_field_info)             \
    X(_run) X(_clone_bound) X(__call__)
#define MS_ENUM(n) S_##n,
enum { MS_NAMES(MS_ENUM) S_COUNT };
#define MS_STR(n) #n,
static const char *const ms_name_text[S_COUNT] = {MS_NAMES(MS_STR)};
static PyObject *ms_str[S_COUNT];
#define S(n) ms_str[S_##n]

/* --- ModuleBase: a module's own state in C fields -------------------------------------------
 * nn.Module's base class. What nn.module keeps for each module besides its fields (its scope,
 * parent, setup flags, the names of its submodules and declarations, its children) lives in
 * these fields instead of the instance __dict__, read and written as attributes `_scope`,
 * `_parent`, ... (member descriptors: a field never set reads as None) and here at fixed
 * offsets: a module made at every apply then stores only its dataclass fields in its dict. */
enum { MB_SCOPE, MB_PARENT, MB_SETUP_DONE, MB_IN_SETUP, MB_AUTO_COUNTS, MB_CALL_NAMES,
       MB_FIELD_NAMES, MB_SETUP_NAMES, MB_SETUP_RESERVED, MB_FIELDS_ADOPTED, MB_CHILDREN, MB_N };

typedef struct {
    PyObject_HEAD
    PyObject *st[MB_N];
} mb_object;

/* A module's state field i (borrowed; NULL where never set). `o` is an nn.Module. */
#define MB(o, i) (((mb_object *)(o))->st[i])

/* Field i of `o`, or `dflt` where never set (borrowed). */
static inline PyObject *mb_get(PyObject *o, int i, PyObject *dflt) {
    PyObject *v = MB(o, i);
    return v != NULL ? v : dflt;
}

/* Field i of `o` = v (a new reference taken; the old one released). */
static inline void mb_set(PyObject *o, int i, PyObject *v) {
    Py_XSETREF(MB(o, i), Py_NewRef(v));
}

static int mb_traverse(PyObject *o, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(o));
    for (int i = 0; i < MB_N; i++) Py_VISIT(MB(o, i));
    return 0;
}

static int mb_clear(PyObject *o) {
    for (int i = 0; i < MB_N; i++) Py_CLEAR(MB(o, i));
    return 0;
}

static void mb_dealloc(PyObject *o) {
    PyTypeObject *tp = Py_TYPE(o);
    PyObject_GC_UnTrack(o);
    mb_clear(o);
    tp->tp_free(o);
    Py_DECREF(tp);
}

#define MB_MEMBER(name, i, doc) \
    {name, T_OBJECT, offsetof(mb_object, st) + (i) * sizeof(PyObject *), 0, doc}
static PyMemberDef mb_members[] = {
    MB_MEMBER("_scope", MB_SCOPE, "the scope of a bound module (None: unbound)"),
    MB_MEMBER("_parent", MB_PARENT, "the module this one is a submodule of"),
    MB_MEMBER("_setup_done", MB_SETUP_DONE, "whether setup() ran"),
    MB_MEMBER("_in_setup", MB_IN_SETUP, "whether setup() runs now"),
    MB_MEMBER("_auto_counts", MB_AUTO_COUNTS, "class name -> submodules auto-named so far"),
    MB_MEMBER("_call_names", MB_CALL_NAMES, "names of submodules taken in this call"),
    MB_MEMBER("_field_names", MB_FIELD_NAMES, "names of the submodules held by fields"),
    MB_MEMBER("_setup_names", MB_SETUP_NAMES, "names of the submodules setup() defined"),
    MB_MEMBER("_setup_reserved", MB_SETUP_RESERVED, "setup()'s variable reservations"),
    MB_MEMBER("_fields_adopted", MB_FIELDS_ADOPTED, "whether the fields' modules are bound"),
    MB_MEMBER("_children", MB_CHILDREN, "name -> bound submodule"),
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot mb_slots[] = {
    {Py_tp_dealloc, mb_dealloc},
    {Py_tp_traverse, mb_traverse},
    {Py_tp_clear, mb_clear},
    {Py_tp_members, mb_members},
    {Py_tp_doc, "The base class of nn.Module: a module's own state (its scope, parent, setup "
                "flags, submodule names and children) in C fields, read and written as the "
                "attributes _scope, _parent, ...; a field never set reads as None."},
    {0, NULL},
};

static PyType_Spec mb_spec = {
    .name = "ctrainstate._C.ModuleBase",
    .basicsize = sizeof(mb_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = mb_slots,
};

static PyTypeObject *mb_type;

static PyObject *py_module_setup(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *env[MS_N];
    if (!PyArg_ParseTuple(args, "OO!O!O!OOOOOOOO:module_setup", &env[MS_CTX], &PyType_Type,
                          &env[MS_MODULE], &PyType_Type, &env[MS_FRAME], &PyType_Type,
                          &env[MS_SCOPE], &env[MS_ATTACH], &env[MS_ADOPT_FIELDS], &env[MS_SETUP],
                          &env[MS_TRY_SETUP], &env[MS_PLAIN_INFO], &env[MS_CALL_SLOW],
                          &env[MS_BIND_SLOW], &env[MS_ADOPT_TAIL]))
        return NULL;
    if (mb_type == NULL || !PyType_IsSubtype((PyTypeObject *)env[MS_MODULE], mb_type))
        return PyErr_Format(PyExc_TypeError, "module_setup: the module type must subclass "
                            "ModuleBase");
    if (!PyType_IsSubtype((PyTypeObject *)env[MS_FRAME], &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "module_setup: the frame type must subclass tuple");
    for (int i = 0; i < S_COUNT; i++)
        if (ms_str[i] == NULL && (ms_str[i] = PyUnicode_InternFromString(ms_name_text[i])) == NULL)
            return NULL;
    /* the scope type's slots, where ms_scope_new stores a new scope's attributes */
    static const int slot_names[MS_SCOPE_N] = {S__variables, S_rngs, S_mutable, S_path,
                                               S__reserved, S__children, S_root_rngs,
                                               S_rng_counters, S_initializing, S_adopted};
    Py_ssize_t off[MS_SCOPE_N];
    for (int i = 0; i < MS_SCOPE_N; i++) {
        PyObject *descr = _PyType_Lookup((PyTypeObject *)env[MS_SCOPE], ms_str[slot_names[i]]);
        const PyMemberDef *md = descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)
                                    ? ((PyMemberDescrObject *)descr)->d_member : NULL;
        if (md == NULL || md->type != T_OBJECT_EX || (md->flags & READONLY) ||
            !PyType_IsSubtype((PyTypeObject *)env[MS_SCOPE], PyDescr_TYPE(descr)))
            return PyErr_Format(PyExc_TypeError, "module_setup: the scope type must have a "
                                "slot '%U'", ms_str[slot_names[i]]);
        off[i] = md->offset;
    }
    for (int i = 0; i < MS_SCOPE_N; i++) ms_scope_off[i] = off[i];
    for (int i = 0; i < MS_N; i++) Py_XSETREF(ms_env[i], Py_NewRef(env[i]));
    Py_RETURN_NONE;
}

/* The instance dict of `obj` (borrowed), or NULL without an exception where it has none. */
static PyObject *ms_dict(PyObject *obj) {
    PyObject **p = _PyObject_GetDictPtr(obj);
    if (p == NULL) return NULL;
    if (*p == NULL) {
        /* (a managed dict not made yet: the generic getter makes it) */
        PyObject *d = PyObject_GenericGetDict(obj, NULL);
        if (d == NULL) {
            PyErr_Clear();
            return NULL;
        }
        Py_DECREF(d);
    }
    return *p != NULL && PyDict_CheckExact(*p) ? *p : NULL;
}

/* The instance dict `d` of a module just made (borrowed), replaced by a new combined dict
 * presized for `n` entries where it is an empty split dict (the one CPython makes from an
 * instance's inline values). Python code reads a module's fields from its instance dict, and
 * CPython 3.11 specializes that read (LOAD_ATTR_WITH_HINT) only on a combined dict: on a split
 * one each read takes the generic path, about twice as long. NULL with an exception. */
static PyObject *ms_combined_dict(PyObject *obj, PyObject *d, Py_ssize_t n) {
    if (PyDict_GET_SIZE(d) != 0 || ((PyDictObject *)d)->ma_values == NULL) return d;
#if PY_VERSION_HEX < 0x030D0000
    PyObject *nd = _PyDict_NewPresized(n);
#else
    (void)n;
    PyObject *nd = PyDict_New();
#endif
    if (nd == NULL) return NULL;
    const int rc = PyObject_GenericSetDict(obj, nd, NULL);
    Py_DECREF(nd);
    return rc < 0 ? NULL : ms_dict(obj);
}

/* d[key], borrowed; NULL (no exception) when absent. Keys are interned strings. */
static PyObject *ms_get(PyObject *d, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) PyErr_Clear();
    return v;
}

/* State field i of module `o` (borrowed) where it is an object of exactly type `type` that
 * nothing but `o` holds, so that emptying and refilling it in place is what storing a new one
 * there would be, as nobody else can see the difference; else NULL (no exception). */
static PyObject *mb_own(PyObject *o, int i, PyTypeObject *type) {
    PyObject *v = MB(o, i);
    return v != NULL && Py_IS_TYPE(v, type) && Py_REFCNT(v) == 1 ? v : NULL;
}

/* The class attribute `name` of type(obj) as the MRO finds it (borrowed, may be NULL). */
static PyObject *ms_class_attr(PyObject *obj, PyObject *name) {
    return _PyType_Lookup(Py_TYPE(obj), name);
}

/* getattr(fn, name, False), a new reference (NULL with an exception): a function's own
 * attribute read from its __dict__. */
static PyObject *ms_fn_attr(PyObject *fn, PyObject *name) {
    PyObject *v;
    if (PyFunction_Check(fn)) {
        PyObject *d = ((PyFunctionObject *)fn)->func_dict;
        v = d != NULL ? PyDict_GetItemWithError(d, name) : NULL;
        if (v == NULL && PyErr_Occurred()) return NULL;
        return Py_NewRef(v != NULL ? v : Py_False);
    }
    if (_PyObject_LookupAttr(fn, name, &v) < 0) return NULL;
    return v != NULL ? v : Py_NewRef(Py_False);
}

/* The thread's module context (nn.module._ctx, a threading.local): its attributes `stack`,
 * `recorders` and `capture` (new references in *stack, *rec, *cap; rec and cap may be
 * NULL where not wanted), read through ct_py_tls_getattr. 0, or -1 with an exception. */
static int ms_ctx_state(PyObject **stack, PyObject **rec, PyObject **cap) {
    *stack = NULL;
    if (rec != NULL) *rec = NULL;
    if (cap != NULL) *cap = NULL;
    PyObject *names[3] = {S(stack), S(recorders), S(capture)};
    PyObject **out[3] = {stack, rec, cap};
    for (int i = 0; i < 3; i++) {
        if (out[i] == NULL) continue;
        *out[i] = ct_py_tls_getattr(ms_env[MS_CTX], names[i]);
        if (*out[i] == NULL) {
            for (int j = 0; j < i; j++)
                if (out[j] != NULL) Py_CLEAR(*out[j]);
            return -1;
        }
    }
    return 0;
}

/* The auto names of submodules (`Dense_0`, `Dense_1`, ...), made once: class name ->
 * list of its names so far, the first MS_AUTO_NAMES numbers (interned); the table is
 * emptied when it holds MS_AUTO_CLASSES class names. */
#define MS_AUTO_NAMES 256
#define MS_AUTO_CLASSES 4096
static PyObject *ms_auto_table;

/* f"{cls_name}_{n}", a new reference (NULL with an exception). */
static PyObject *ms_auto_name(PyObject *cls_name, Py_ssize_t n) {
    if (n >= MS_AUTO_NAMES || !PyUnicode_CheckExact(cls_name))
        return PyUnicode_FromFormat("%U_%zd", cls_name, n);
    if (ms_auto_table == NULL && (ms_auto_table = PyDict_New()) == NULL) return NULL;
    PyObject *names = PyDict_GetItemWithError(ms_auto_table, cls_name);
    if (names == NULL) {
        if (PyErr_Occurred()) return NULL;
        if (PyDict_GET_SIZE(ms_auto_table) >= MS_AUTO_CLASSES) PyDict_Clear(ms_auto_table);
        names = PyList_New(0);
        const int rc = names == NULL ? -1 : PyDict_SetItem(ms_auto_table, cls_name, names);
        Py_XDECREF(names);   /* (the table holds it) */
        if (rc < 0) return NULL;
    }
    if (!PyList_CheckExact(names)) return PyUnicode_FromFormat("%U_%zd", cls_name, n);
    while (PyList_GET_SIZE(names) <= n) {
        PyObject *name = PyUnicode_FromFormat("%U_%zd", cls_name, PyList_GET_SIZE(names));
        if (name == NULL) return NULL;
        PyUnicode_InternInPlace(&name);
        const int rc = PyList_Append(names, name);
        Py_DECREF(name);
        if (rc < 0) return NULL;
    }
    return Py_NewRef(PyList_GET_ITEM(names, n));
}

/* Remove the last item of `list` (list.pop() without the result), keeping any exception. */
static void ms_pop(PyObject *list) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    const Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > 0 && PyList_SetSlice(list, n - 1, n, NULL) < 0) PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* fn(self, *args, **kwargs) */
static PyObject *ms_call(PyObject *fn, PyObject *self, PyObject *args, PyObject *kwargs) {
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0) {
        PyObject *small[8];
        PyObject **argv = n < 7 ? small : PyMem_New(PyObject *, n + 2);
        if (argv == NULL) return PyErr_NoMemory();
        argv[1] = self;
        for (Py_ssize_t i = 0; i < n; i++) argv[i + 2] = PyTuple_GET_ITEM(args, i);
        PyObject *r = PyObject_Vectorcall(fn, argv + 1, (size_t)(n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                          NULL);
        if (argv != small) PyMem_Free(argv);
        return r;
    }
    PyObject *all = PyTuple_New(n + 1);
    if (all == NULL) return NULL;
    PyTuple_SET_ITEM(all, 0, Py_NewRef(self));
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(all, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *r = PyObject_Call(fn, all, kwargs);
    Py_DECREF(all);
    return r;
}

/* Whether `obj` is an nn.Module; raises TypeError naming `what` where it is not. */
static int ms_check_module(PyObject *obj, const char *what) {
    const int r = PyObject_IsInstance(obj, ms_env[MS_MODULE]);
    if (r == 0)
        PyErr_Format(PyExc_TypeError, "%s must be an nn.Module, got %.100s", what,
                     Py_TYPE(obj)->tp_name);
    return r == 1 ? 0 : -1;
}

static PyObject *ms_call_slow(PyObject *fn, PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *a[4] = {fn, self, args, kwargs};
    return PyObject_Vectorcall(ms_env[MS_CALL_SLOW], a, 4, NULL);
}

static int ms_is_scalar(PyObject *v) {
    PyTypeObject *t = Py_TYPE(v);
    return t == &PyLong_Type || t == &PyFloat_Type || t == &PyComplex_Type ||
           t == &PyUnicode_Type || t == &PyBytes_Type || t == &PyBool_Type || v == Py_None;
}

/* Whether adopting the fields of `obj` (a module whose fields are not adopted yet) would only
 * mark them adopted: its class keeps Module._adopt_fields and every field but name holds a
 * scalar, a tuple of scalars or another value that is no module, dict, list or tuple (no
 * module inside; _freeze_attr keeps it), as nn.module's _adopt_tail checks, with the class's field names from _plain_fields_info (stored on the
 * class as _ct_plain_fields; computed there where missing or stale). 1, 0 or -1. */
static int ms_plain_fields(PyObject *obj, PyObject *d) {
    if (ms_class_attr(obj, S(_adopt_fields)) != ms_env[MS_ADOPT_FIELDS]) return 0;
    PyTypeObject *cls = Py_TYPE(obj);
    PyObject *info = PyDict_GetItemWithError(cls->tp_dict, S(_ct_plain_fields));
    if (info == NULL && PyErr_Occurred()) return -1;
    PyObject *dc_fields = ms_class_attr(obj, S(__dataclass_fields__));
    if (info == NULL || !PyTuple_CheckExact(info) || PyTuple_GET_SIZE(info) != 2 ||
        PyTuple_GET_ITEM(info, 0) != dc_fields) {
        PyObject *made = PyObject_CallOneArg(ms_env[MS_PLAIN_INFO], (PyObject *)cls);
        if (made == NULL) return -1;
        Py_DECREF(made);
        info = PyDict_GetItemWithError(cls->tp_dict, S(_ct_plain_fields));
        if (info == NULL && PyErr_Occurred()) return -1;
        if (info == NULL || !PyTuple_CheckExact(info) || PyTuple_GET_SIZE(info) != 2) return 0;
    }
    PyObject *fields = PyTuple_GET_ITEM(info, 1);
    if (!PyTuple_CheckExact(fields)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(fields, i));
        if (v == NULL) return PyErr_Occurred() ? -1 : 0;
        if (ms_is_scalar(v)) continue;
        if (PyTuple_CheckExact(v)) {
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(v); j++)
                if (!ms_is_scalar(PyTuple_GET_ITEM(v, j))) return 0;
            continue;
        }
        /* any other value but a module, dict, list or tuple (an initializer function, a
         * dtype, an activation): _adopt finds no module in it and _freeze_attr returns it */
        if (PyDict_Check(v) || PyList_Check(v) || PyTuple_Check(v)) return 0;
        const int r = PyObject_IsInstance(v, ms_env[MS_MODULE]);
        if (r != 0) return r < 0 ? -1 : 0;
    }
    return 1;
}

/* The fields of a module marked adopted (what _adopt_fields does where ms_plain_fields
 * holds): 0, or -1 with an exception. */
static int ms_mark_adopted(PyObject *obj) {
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) return -1;
    mb_set(obj, MB_FIELDS_ADOPTED, Py_True);
    mb_set(obj, MB_FIELD_NAMES, empty);
    Py_DECREF(empty);
    return 0;
}

/* The common case of a method call up to fn's call: its conditions checked, then the
 * module's state changed and its frame pushed. 1 with *stack_out the frame stack (a new
 * reference: the caller calls fn, then pops the frame with ms_pop), 0 where the Python path
 * must run (nothing changed), -1 with an exception. `self` is an nn.Module. */
static int ms_enter(PyObject *fn, PyObject *self, PyObject **stack_out) {
    PyObject *stack = NULL, *rec = NULL, *cap = NULL, *reserved = NULL, *frame = NULL;
    PyObject *compact = NULL, *scope = NULL;
    int status = -1;
    PyObject *d = ms_dict(self);
    if (d == NULL) goto slow;
    PyObject *sc = MB(self, MB_SCOPE);
    PyObject *done = MB(self, MB_SETUP_DONE);
    if (sc == NULL || sc == Py_None || done == NULL) goto slow;
    scope = Py_NewRef(sc);   /* (held: its attributes are read below) */
    int adopt = 0;
    if (done != Py_True) {
        /* _try_setup where there is nothing to set up: fields adopted (or holding no module),
         * no setup() of the class's own or in the instance */
        PyObject *adopted = MB(self, MB_FIELDS_ADOPTED);
        if (done != Py_False || adopted == NULL ||
            ms_class_attr(self, S(setup)) != ms_env[MS_SETUP] || ms_get(d, S(setup)) != NULL ||
            ms_class_attr(self, S(_try_setup)) != ms_env[MS_TRY_SETUP])
            goto slow;
        if (adopted != Py_True) {
            adopt = ms_plain_fields(self, d);
            if (adopt < 0) goto error;
            if (!adopt) goto slow;
        }
    }
    compact = ms_fn_attr(fn, S(_ct_compact));
    const int is_compact = compact != NULL ? PyObject_IsTrue(compact) : -1;
    if (is_compact < 0) goto error;
    if (ms_ctx_state(&stack, &rec, &cap) < 0) goto error;
    if (!PyList_CheckExact(stack) || (rec != Py_None && PyObject_IsTrue(rec) != 0)) goto slow;
    if (cap != Py_None) {
        if (!PyList_CheckExact(cap)) goto slow;
        const Py_ssize_t nc = PyList_GET_SIZE(cap);
        if (nc > 0 && PyList_GET_ITEM(cap, nc - 1) != Py_None) goto slow;
    }
    reserved = ct_py_attr(scope, S(_reserved));
    if (reserved == NULL) goto error;
    if (!PySet_CheckExact(reserved)) goto slow;
    int fresh = 0;
    if (is_compact) {
        fresh = 1;
        for (Py_ssize_t i = 0; fresh && i < PyList_GET_SIZE(stack); i++) {
            PyObject *f = PyList_GET_ITEM(stack, i);
            if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) < 1) goto slow;
            fresh = PyTuple_GET_ITEM(f, 0) != self;
        }
    }
    PyObject *field_names = NULL, *setup_names = NULL, *setup_reserved = NULL;
    if (fresh) {
        field_names = MB(self, MB_FIELD_NAMES);
        setup_names = MB(self, MB_SETUP_NAMES);
        setup_reserved = MB(self, MB_SETUP_RESERVED);
        if (field_names == NULL || setup_names == NULL || setup_reserved == NULL ||
            !PyTuple_CheckExact(field_names) || !PySet_CheckExact(setup_names) ||
            !PySet_CheckExact(setup_reserved))
            goto slow;
    }
    /* every condition holds: the state changes from here */
    if (adopt && ms_mark_adopted(self) < 0) goto error;
    if (done != Py_True) {
        /* self._setup_reserved = set(reserved) */
        mb_set(self, MB_SETUP_DONE, Py_True);
        PyObject *r = mb_own(self, MB_SETUP_RESERVED, &PySet_Type);
        int rc;
        if (r != NULL) {
            rc = (PySet_GET_SIZE(r) > 0 && PySet_Clear(r) < 0) || _PySet_Update(r, reserved) < 0;
        } else {
            r = PySet_New(reserved);
            rc = r == NULL;
            if (!rc) Py_XSETREF(MB(self, MB_SETUP_RESERVED), r);
        }
        if (rc) goto error;
        if (fresh) setup_reserved = MB(self, MB_SETUP_RESERVED);
    }
    if (fresh) {
        /* a new call of this module: auto names restart, its names may be declared again:
         * self._auto_counts = {}, self._call_names = set(field_names) | setup_names */
        PyObject *counts = mb_own(self, MB_AUTO_COUNTS, &PyDict_Type);
        int rc = 0;
        if (counts != NULL) {
            PyDict_Clear(counts);
        } else {
            counts = PyDict_New();
            rc = counts == NULL;
            if (!rc) Py_XSETREF(MB(self, MB_AUTO_COUNTS), counts);
        }
        PyObject *names = rc ? NULL : mb_own(self, MB_CALL_NAMES, &PySet_Type);
        if (rc) {
        } else if (names != NULL) {
            rc = (PySet_GET_SIZE(names) > 0 && PySet_Clear(names) < 0) ||
                 (PyTuple_GET_SIZE(field_names) > 0 && _PySet_Update(names, field_names) < 0);
        } else {
            names = PySet_New(field_names);
            rc = names == NULL;
            if (!rc) Py_XSETREF(MB(self, MB_CALL_NAMES), names);   /* (self holds it) */
        }
        if (!rc && PySet_GET_SIZE(setup_names) > 0)
            rc = _PySet_Update(names, setup_names) < 0;
        if (rc || PySet_Clear(reserved) < 0) goto error;
        if (PySet_GET_SIZE(setup_reserved) > 0 && _PySet_Update(reserved, setup_reserved) < 0)
            goto error;
    }
    PyTypeObject *ft = (PyTypeObject *)ms_env[MS_FRAME];
    frame = ft->tp_alloc(ft, 2);    /* _Frame(self, fn._ct_compact), as tuple.__new__ makes it */
    if (frame == NULL) goto error;
    PyTuple_SET_ITEM(frame, 0, Py_NewRef(self));
    PyTuple_SET_ITEM(frame, 1, Py_NewRef(compact));
    if (PyList_Append(stack, frame) < 0) goto error;
    *stack_out = Py_NewRef(stack);
    status = 1;
    goto done;
slow:
    if (PyErr_Occurred()) goto error;
    status = 0;
    goto done;
error:
    status = -1;
done:
    Py_XDECREF(stack);
    Py_XDECREF(rec);
    Py_XDECREF(cap);
    Py_XDECREF(reserved);
    Py_XDECREF(frame);
    Py_XDECREF(compact);
    Py_XDECREF(scope);
    return status;
}

static PyObject *py_module_call(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    (void)mod;
    if (n != 4 || !PyTuple_CheckExact(a[2]) || !PyDict_Check(a[3]))
        return PyErr_Format(PyExc_TypeError, "module_call(fn, self, args: tuple, kwargs: dict)");
    if (ms_env[MS_CTX] == NULL) return PyErr_Format(PyExc_RuntimeError, "module_setup first");
    PyObject *fn = a[0], *self = a[1], *args = a[2], *kwargs = a[3];
    if (ms_check_module(self, "module_call: self") < 0) return NULL;
    PyObject *stack = NULL;
    const int entered = ms_enter(fn, self, &stack);
    if (entered <= 0) return entered < 0 ? NULL : ms_call_slow(fn, self, args, kwargs);
    PyObject *out = ms_call(fn, self, args, kwargs);
    ms_pop(stack);
    Py_DECREF(stack);
    return out;
}

/* --- ModuleMethod: a module method wrapper whose call is C ---------------------------------
 * ModuleMethod(fn) is what nn.module._wrap_method makes of a user method: calling it with
 * (self, *args, **kwargs) is module_call(fn, self, args, kwargs), without the Python frame of
 * a wrapper function, the args tuple and the kwargs dict: the common case (ms_enter) calls fn
 * with the caller's argument vector as it came, the rest goes to nn.module._call_method as
 * module_call's does. It is a method descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR), as functions
 * are: `module(x)` (type slot __call__) and `module.method(x)` where the attribute lookup is
 * the generic one call it with self prepended, without a bound-method object; __get__ gives
 * the bound method otherwise (a Module class with a setup() has __getattr__) and itself on
 * the class. It carries a __dict__ for what functools.update_wrapper copies (__name__, __qualname__,
 * __doc__, __module__, __wrapped__, the function's own attributes such as _ct_compact), is
 * pickled by reference (its __qualname__ in its __module__), as functions are, and supports
 * weak references. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn;
    PyObject *dict;
    PyObject *weakrefs;
} mm_object;

static PyObject *mm_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    PyObject *fn = ((mm_object *)callable)->fn;
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n < 1) {
        PyObject *qn = PyObject_GetAttrString(callable, "__qualname__");
        if (qn == NULL) PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%S() missing 1 required positional argument: 'self'",
                     qn != NULL ? qn : Py_None);
        Py_XDECREF(qn);
        return NULL;
    }
    if (ms_env[MS_CTX] == NULL) return PyErr_Format(PyExc_RuntimeError, "module_setup first");
    PyObject *self = args[0];
    if (ms_check_module(self, "a module method's self") < 0) return NULL;
    PyObject *stack = NULL;
    const int entered = ms_enter(fn, self, &stack);
    if (entered < 0) return NULL;
    if (entered) {
        /* (the vector as given: self first, then the arguments; the offset flag kept) */
        PyObject *out = PyObject_Vectorcall(fn, args, nargsf, kwnames);
        ms_pop(stack);
        Py_DECREF(stack);
        return out;
    }
    /* the Python path: _call_method(fn, self, args, kwargs) */
    const Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *rest = PyTuple_New(n - 1);
    PyObject *kwargs = rest != NULL ? PyDict_New() : NULL;
    PyObject *out = NULL;
    if (kwargs == NULL) goto out;
    for (Py_ssize_t i = 1; i < n; i++) PyTuple_SET_ITEM(rest, i - 1, Py_NewRef(args[i]));
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) goto out;
    out = ms_call_slow(fn, self, rest, kwargs);
out:
    Py_XDECREF(rest);
    Py_XDECREF(kwargs);
    return out;
}

static PyObject *mm_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "O:ModuleMethod", &fn)) return NULL;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) > 0)
        return PyErr_Format(PyExc_TypeError, "ModuleMethod takes no keyword arguments");
    if (!PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "ModuleMethod: the method must be callable, got "
                            "%.100s", Py_TYPE(fn)->tp_name);
    mm_object *m = (mm_object *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->vectorcall = mm_vectorcall;
    m->fn = Py_NewRef(fn);
    return (PyObject *)m;
}

static int mm_traverse(mm_object *m, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(m));
    Py_VISIT(m->fn);
    Py_VISIT(m->dict);
    return 0;
}

static int mm_clear(mm_object *m) {
    Py_CLEAR(m->fn);
    Py_CLEAR(m->dict);
    return 0;
}

static void mm_dealloc(mm_object *m) {
    PyTypeObject *tp = Py_TYPE(m);
    PyObject_GC_UnTrack(m);
    if (m->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)m);
    mm_clear(m);
    tp->tp_free((PyObject *)m);
    Py_DECREF(tp);
}

/* As a function: itself on the class, a bound method on an instance. */
static PyObject *mm_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* pickle by reference, as functions are: the attribute __qualname__ of module __module__ */
static PyObject *mm_reduce(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyObject *mm_repr(mm_object *m) {
    PyObject *qn = PyObject_GetAttrString((PyObject *)m, "__qualname__");
    if (qn == NULL) {
        PyErr_Clear();
        return PyUnicode_FromFormat("<ctrainstate module method of %R>", m->fn);
    }
    PyObject *r = PyUnicode_FromFormat("<ctrainstate module method %S>", qn);
    Py_DECREF(qn);
    return r;
}

static PyMethodDef mm_methods[] = {
    {"__reduce__", mm_reduce, METH_NOARGS, "Pickled by reference, as a function is."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef mm_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(mm_object, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(mm_object, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(mm_object, weakrefs), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef mm_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot mm_slots[] = {
    {Py_tp_new, mm_new},
    {Py_tp_getset, mm_getset},
    {Py_tp_dealloc, mm_dealloc},
    {Py_tp_traverse, mm_traverse},
    {Py_tp_clear, mm_clear},
    {Py_tp_repr, mm_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, mm_descr_get},
    {Py_tp_members, mm_members},
    {Py_tp_methods, mm_methods},
    {Py_tp_doc, "ModuleMethod(fn)\n--\n\n"
                "An nn.Module method: calling it with (self, *args, **kwargs) runs "
                "fn(self, *args, **kwargs) with the module's frame active, as "
                "module_call(fn, self, args, kwargs) (the common case in C, the rest in "
                "nn.module._call_method). A method descriptor, as a function is."},
    {0, NULL},
};

static PyType_Spec mm_spec = {
    .name = "ctrainstate._C.ModuleMethod",
    .basicsize = sizeof(mm_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = mm_slots,
};

/* dict.fromkeys(keys, value) of a dict `keys` (a new dict). */
static PyObject *ms_fromkeys(PyObject *keys, PyObject *value) {
    PyObject *r = PyDict_New();
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (r != NULL && PyDict_Next(keys, &pos, &k, &v))
        if (PyDict_SetItem(r, k, value) < 0) Py_CLEAR(r);
    return r;
}

/* A new ModuleScope made as nn.module makes one (object.__new__, then its slots set as
 * nn.module._scope_made sets them): v[] holds _variables, rngs, mutable, path, _reserved, _children,
 * root_rngs, rng_counters, initializing, adopted (each non-NULL). A new reference, or NULL with
 * an exception. */
static PyObject *ms_scope_new(PyObject *const v[MS_SCOPE_N]) {
    PyTypeObject *st = (PyTypeObject *)ms_env[MS_SCOPE];
    PyObject *empty = PyTuple_New(0);
    PyObject *scope = empty != NULL ? PyBaseObject_Type.tp_new(st, empty, NULL) : NULL;
    Py_XDECREF(empty);
    if (scope == NULL) return NULL;
    for (int i = 0; i < MS_SCOPE_N; i++)   /* (the slots of a new object: all unset) */
        *(PyObject **)((char *)scope + ms_scope_off[i]) = Py_NewRef(v[i]);
    return scope;
}

/* _new_child_scope(scope, name) for a ModuleScope `scope` (see nn.module): a new reference. */
static PyObject *ms_new_child_scope(PyObject *scope, PyObject *scope_children, PyObject *name) {
    PyObject *vars = NULL, *root = NULL, *mutable = NULL, *path = NULL, *init = NULL;
    PyObject *adopted = NULL, *child = NULL, *newpath = NULL, *tail = NULL, *rngs = NULL;
    PyObject *counters = NULL, *reserved = NULL, *children = NULL, *result = NULL;
    vars = ct_py_attr(scope, S(_variables));
    root = vars != NULL ? ct_py_attr(scope, S(root_rngs)) : NULL;
    mutable = root != NULL ? ct_py_attr(scope, S(mutable)) : NULL;
    path = mutable != NULL ? ct_py_attr(scope, S(path)) : NULL;
    init = path != NULL ? ct_py_attr(scope, S(initializing)) : NULL;
    adopted = init != NULL ? ct_py_attr(scope, S(adopted)) : NULL;
    if (adopted == NULL) goto out;
    if (!PyDict_Check(root)) {
        PyErr_Format(PyExc_TypeError, "ModuleScope.root_rngs must be a dict");
        goto out;
    }
    const int has_root = PyDict_GET_SIZE(root) > 0;
    PyObject *own_root = has_root ? PyDict_Copy(root) : PyDict_New();
    Py_SETREF(root, own_root);
    if (root == NULL) goto out;
    rngs = ms_fromkeys(root, Py_None);
    PyObject *zero = rngs != NULL ? PyLong_FromLong(0) : NULL;
    counters = zero != NULL ? ms_fromkeys(root, zero) : NULL;
    Py_XDECREF(zero);
    tail = counters != NULL ? PyTuple_Pack(1, name) : NULL;
    newpath = tail != NULL ? PySequence_Concat(path, tail) : NULL;
    reserved = newpath != NULL ? PySet_New(NULL) : NULL;
    children = reserved != NULL ? PyDict_New() : NULL;
    if (children == NULL) goto out;
    PyObject *const v[10] = {vars, rngs, mutable, newpath, reserved, children, root, counters,
                             init, adopted};
    child = ms_scope_new(v);
    if (child == NULL || PyDict_SetItem(scope_children, name, child) < 0) goto out;
    result = Py_NewRef(child);
out:
    Py_XDECREF(vars);
    Py_XDECREF(root);
    Py_XDECREF(mutable);
    Py_XDECREF(path);
    Py_XDECREF(init);
    Py_XDECREF(adopted);
    Py_XDECREF(child);
    Py_XDECREF(newpath);
    Py_XDECREF(tail);
    Py_XDECREF(rngs);
    Py_XDECREF(counters);
    Py_XDECREF(reserved);
    Py_XDECREF(children);
    return result;
}

/* Whether `reserved` (an exact set) holds a variable named `name`: (collection, name). 1, 0
 * or -1. */
static int ms_variable_named(PyObject *reserved, PyObject *name) {
    Py_ssize_t pos = 0;
    PyObject *k;
    Py_hash_t h;
    while (_PySet_NextEntry(reserved, &pos, &k, &h)) {
        if (!PyTuple_Check(k)) continue;
        if (PyTuple_GET_SIZE(k) < 2) return 1;   /* (the Python check decides, and raises) */
        const int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(k, 1), name, Py_EQ);
        if (eq != 0) return eq;
    }
    return 0;
}

static PyObject *ms_bind_slow(PyObject *module, PyObject *stack) {
    PyObject *a[2] = {module, stack};
    return PyObject_Vectorcall(ms_env[MS_BIND_SLOW], a, 2, NULL);
}

static PyObject *py_module_bind_new(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    (void)mod;
    if (n != 2 || !PyList_Check(a[1]) || PyList_GET_SIZE(a[1]) == 0)
        return PyErr_Format(PyExc_TypeError, "module_bind_new(module, stack: a list, not empty)");
    if (ms_env[MS_CTX] == NULL) return PyErr_Format(PyExc_RuntimeError, "module_setup first");
    PyObject *child = a[0], *stack = a[1];
    PyObject *name = NULL, *cls_name = NULL, *reserved = NULL, *pchildren = NULL;
    PyObject *scope = NULL, *result = NULL;
    PyObject *frame = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1);
    if (ms_check_module(child, "module_bind_new: module") < 0) return NULL;
    if (!PyTuple_Check(frame) || PyTuple_GET_SIZE(frame) != 2)
        return PyErr_Format(PyExc_TypeError, "module_bind_new: the stack's frames must be "
                            "(module, compact) tuples");
    PyObject *parent = PyTuple_GET_ITEM(frame, 0);
    if (ms_check_module(parent, "module_bind_new: a frame's module") < 0) return NULL;
    if (PyTuple_GET_ITEM(frame, 1) != Py_True) goto slow;
    PyObject *pd = ms_dict(parent), *cd = ms_dict(child);
    if (pd == NULL || cd == NULL || ms_class_attr(parent, S(_attach)) != ms_env[MS_ATTACH])
        goto slow;
    PyObject *pscope = MB(parent, MB_SCOPE), *call_names = MB(parent, MB_CALL_NAMES);
    PyObject *counts = MB(parent, MB_AUTO_COUNTS), *pkids = MB(parent, MB_CHILDREN);
    PyObject *given = ms_get(cd, S(name)), *adopted = MB(child, MB_FIELDS_ADOPTED);
    if (pscope == NULL || (PyObject *)Py_TYPE(pscope) != ms_env[MS_SCOPE] || call_names == NULL ||
        !PySet_CheckExact(call_names) || counts == NULL || !PyDict_CheckExact(counts) ||
        pkids == NULL || !PyDict_CheckExact(pkids) || MB(parent, MB_IN_SETUP) != Py_False ||
        given == NULL || adopted == NULL)
        goto slow;
    Py_ssize_t auto_n = -1;
    if (given == Py_None) {
        cls_name = Py_IS_TYPE(Py_TYPE(child), &PyType_Type)
                       ? PyType_GetName(Py_TYPE(child))   /* (type.__name__) */
                       : PyObject_GetAttr((PyObject *)Py_TYPE(child), S(__name__));
        if (cls_name == NULL) goto error;
        PyObject *c = PyDict_GetItemWithError(counts, cls_name);
        if (c == NULL && PyErr_Occurred()) goto error;
        if (c != NULL && !PyLong_CheckExact(c)) goto slow;
        auto_n = c != NULL ? PyLong_AsSsize_t(c) : 0;
        if (auto_n < 0) goto slow;    /* (an overflow, or a count the Python path handles) */
        name = ms_auto_name(cls_name, auto_n);
        if (name == NULL) goto error;
    } else if (PyUnicode_CheckExact(given)) {
        name = Py_NewRef(given);
    } else {
        goto slow;
    }
    const int used = PySet_Contains(call_names, name);
    if (used != 0) goto slow_or_error;
    reserved = ct_py_attr(pscope, S(_reserved));
    pchildren = reserved != NULL ? ct_py_attr(pscope, S(_children)) : NULL;
    if (pchildren == NULL) goto error;
    if (!PySet_CheckExact(reserved) || !PyDict_CheckExact(pchildren)) goto slow;
    if (PySet_GET_SIZE(reserved) > 0) {
        const int clash = ms_variable_named(reserved, name);
        if (clash != 0) goto slow_or_error;
    }
    /* the child's fields: marked adopted here where none can hold a module */
    int plain_fields = 0;
    if (adopted != Py_True) {
        plain_fields = ms_plain_fields(child, cd);
        if (plain_fields < 0) goto error;
    }
    /* every condition holds: Module._attach's changes, in its order */
    if (auto_n >= 0) {
        PyObject *next = PyLong_FromSsize_t(auto_n + 1);
        const int rc = next == NULL || PyDict_SetItem(counts, cls_name, next) < 0;
        Py_XDECREF(next);
        if (rc) goto error;
    }
    if (PySet_Add(call_names, name) < 0 || PyDict_SetItem(cd, S(name), name) < 0) goto error;
    mb_set(child, MB_PARENT, parent);
    int fresh_scope = 0;
    scope = PyDict_GetItemWithError(pchildren, name);
    if (scope != NULL) {
        Py_INCREF(scope);
    } else {
        if (PyErr_Occurred()) goto error;
        fresh_scope = 1;
        scope = ms_new_child_scope(pscope, pchildren, name);
        if (scope == NULL) goto error;
    }
    if (fresh_scope == 0) { /* (a scope made just now has nothing reserved to clear) */
        PyObject *sres = ct_py_attr(scope, S(_reserved));
        if (sres == NULL) goto error;
        int rc = PySet_Check(sres) ? PySet_Clear(sres) : -2;
        if (rc == -2) {
            PyObject *r = PyObject_CallMethod(sres, "clear", NULL);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(sres);
        if (rc < 0) goto error;
    }
    mb_set(child, MB_SCOPE, scope);
    if (PyDict_SetItem(pkids, name, child) < 0) goto error;
    if (adopted == Py_True) {
        result = Py_NewRef(Py_None);
    } else if (plain_fields) {
        if (ms_mark_adopted(child) < 0) goto error;
        result = Py_NewRef(Py_None);
    } else {
        result = PyObject_CallOneArg(ms_env[MS_ADOPT_TAIL], child);
    }
    goto done;
slow_or_error:
    if (PyErr_Occurred()) goto error;
slow:
    if (PyErr_Occurred()) goto error;
    result = ms_bind_slow(child, stack);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(name);
    Py_XDECREF(cls_name);
    Py_XDECREF(reserved);
    Py_XDECREF(pchildren);
    Py_XDECREF(scope);
    return result;
}


/* copy_tree(tree): nn.module._copy_tree's result: `tree` with every dict in it copied, at any
 * depth, into a plain dict (a dict subclass's items as its items() gives them), every other
 * value kept as it is; a tree that is not a dict is returned as it is. What apply and bind
 * copy the caller's variables with. */
static PyObject *ms_copy_tree(PyObject *d) {
    if (!PyDict_Check(d)) return Py_NewRef(d);
    if (Py_EnterRecursiveCall(" in copy_tree")) return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL) goto error;
    if (PyDict_CheckExact(d)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(d, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);   /* (held: a copy below may run code that changes d) */
            PyObject *c = ms_copy_tree(v);
            const int rc = c == NULL ? -1 : PyDict_SetItem(out, k, c);
            Py_XDECREF(c);
            Py_DECREF(k);
            Py_DECREF(v);
            if (rc < 0) goto error;
        }
    } else {
        PyObject *items = PyObject_CallMethod(d, "items", NULL);
        PyObject *it = items != NULL ? PyObject_GetIter(items) : NULL;
        Py_XDECREF(items);
        if (it == NULL) goto error;
        PyObject *item;
        while ((item = PyIter_Next(it)) != NULL) {
            PyObject *pair = PySequence_Tuple(item);
            Py_DECREF(item);
            if (pair != NULL && PyTuple_GET_SIZE(pair) != 2) {
                PyErr_Format(PyExc_ValueError, "copy_tree: %.100s.items() must give (key, "
                             "value) pairs", Py_TYPE(d)->tp_name);
                Py_CLEAR(pair);
            }
            PyObject *c = pair != NULL ? ms_copy_tree(PyTuple_GET_ITEM(pair, 1)) : NULL;
            const int rc = c == NULL ? -1 : PyDict_SetItem(out, PyTuple_GET_ITEM(pair, 0), c);
            Py_XDECREF(c);
            Py_XDECREF(pair);
            if (rc < 0) break;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) goto error;
    }
    Py_LeaveRecursiveCall();
    return out;
error:
    Py_LeaveRecursiveCall();
    Py_XDECREF(out);
    return NULL;
}

static PyObject *py_copy_tree(PyObject *mod, PyObject *tree) {
    (void)mod;
    return ms_copy_tree(tree);
}

/* Module.__post_init__'s work for `self`, an nn.Module whose __dict__ `d` holds its fields:
 * its own state (its ModuleBase fields, set as __post_init__ sets them), the name check, the attach
 * (module_bind_new) where a module method runs. None, or NULL with an exception. */
static PyObject *ms_post_init(PyObject *self, PyObject *d) {
    PyObject *v[9] = {PyDict_New(), PySet_New(NULL), PyTuple_New(0), PySet_New(NULL),
                      PySet_New(NULL), PyDict_New(), NULL, NULL, NULL};
    PyObject *result = NULL;
    for (int i = 0; i < 6; i++)
        if (v[i] == NULL) goto out;
    /* _scope, _parent, _setup_done, _in_setup, _auto_counts, _call_names, _field_names,
     * _setup_names, _setup_reserved, _fields_adopted, _children: Module.__post_init__'s */
    PyObject *const init[MB_N] = {Py_None, Py_None, Py_False, Py_False, v[0], v[1], v[2],
                                  v[3], v[4], Py_False, v[5]};
    for (int i = 0; i < MB_N; i++) mb_set(self, i, init[i]);
    PyObject *name = ms_get(d, S(name));
    if (name == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, S(name));
        goto out;
    }
    if (name != Py_None && !PyUnicode_Check(name)) {
        v[6] = PyType_GetName(Py_TYPE(self));
        if (v[6] != NULL)
            PyErr_Format(PyExc_TypeError, "%U: name must be a string, got %R", v[6], name);
        goto out;
    }
    if (ms_ctx_state(&v[7], NULL, NULL) < 0) goto out;
    if (PyList_Check(v[7]) ? PyList_GET_SIZE(v[7]) > 0 : PyObject_IsTrue(v[7]) != 0) {
        if (PyErr_Occurred()) goto out;
        PyObject *args[2] = {self, v[7]};
        result = py_module_bind_new(NULL, args, 2);
    } else {
        result = Py_NewRef(Py_None);
    }
out:
    for (int i = 0; i < 9; i++) Py_XDECREF(v[i]);
    return result;
}

/* module_post_init(module, d): the end of nn.module's generated Python __init__ of a Module
 * class keeping Module.__post_init__ (nn.module._generated_init), `d` the module's __dict__
 * with its fields stored: ms_post_init, its arguments checked. */
static PyObject *py_module_post_init(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    (void)mod;
    if (n != 2 || !PyDict_CheckExact(a[1]))
        return PyErr_Format(PyExc_TypeError, "module_post_init(module, d: its __dict__)");
    if (ms_env[MS_CTX] == NULL) return PyErr_Format(PyExc_RuntimeError, "module_setup first");
    PyObject *self = a[0], *d = a[1];
    if (ms_check_module(self, "module_post_init: module") < 0) return NULL;
    if (ms_dict(self) != d)
        return PyErr_Format(PyExc_TypeError, "module_post_init: d must be the module's __dict__");
    return ms_post_init(self, d);
}

/* --- ModuleInit: a Module class's __init__ in C ---------------------------------------------
 * ModuleInit(slow, params, npos, defaults, stores, missing, factory, post_init) is the
 * __init__ nn.module gives a Module class whose fields are plain (_generated_init): calling it
 * with (self, *args, **kwargs) does what `slow`, the Python __init__ generated for the class
 * (the reference), does, without its frame and the argument tuple and dict:
 *   - the arguments are bound to `params` (names: the first `npos` positional-or-keyword,
 *     the rest keyword-only, as the dataclass signature has them); a parameter not passed
 *     takes its entry of `defaults` (`factory`, dataclasses' _HAS_DEFAULT_FACTORY, for a
 *     field with a default factory; `missing`, dataclasses.MISSING, where it is required);
 *   - the fields are stored into the instance __dict__ in field order, `stores` holding per
 *     field (name, index of its parameter or -1 for a field not in __init__, default or
 *     `missing`, default factory or `missing`): a factory runs where its parameter holds
 *     `factory`, a field not in __init__ takes its factory's value or its default;
 *   - where type(self) keeps `post_init` (Module.__post_init__), its work is ms_post_init's,
 *     else self.__post_init__() runs.
 * Every call that is not this common case (too many positional arguments, an unknown,
 * repeated or non-string keyword, a required argument missing, Flax's `parent=`, a self that
 * is no nn.Module) goes to `slow` with its arguments as they came, so its errors and its
 * parent= handling are those of a Python function with the dataclass signature. A method
 * descriptor as a function is (itself on the class, a bound method on an instance), with a
 * __dict__ for what functools.update_wrapper copies (so inspect.signature follows
 * __wrapped__ to the dataclass __init__). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *slow, *params, *defaults, *stores, *missing, *factory, *post_init;
    Py_ssize_t npos;
    PyObject *dict;
    PyObject *weakrefs;
} mi_object;

#define MI_SMALL 16

static PyObject *mi_call_slow(mi_object *m, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames) {
    return PyObject_Vectorcall(m->slow, args, nargsf, kwnames);
}

static PyObject *mi_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    mi_object *m = (mi_object *)callable;
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    const Py_ssize_t np = PyTuple_GET_SIZE(m->params);
    const Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (n < 1 || n - 1 > m->npos || ms_env[MS_CTX] == NULL)
        return mi_call_slow(m, args, nargsf, kwnames);
    PyObject *self = args[0];
    if (Py_TYPE(self) == (PyTypeObject *)ms_env[MS_MODULE] ||
        !PyType_IsSubtype(Py_TYPE(self), (PyTypeObject *)ms_env[MS_MODULE]))
        return mi_call_slow(m, args, nargsf, kwnames);
    PyObject *small[MI_SMALL];
    PyObject **vals = np <= MI_SMALL ? small : PyMem_New(PyObject *, np);
    if (vals == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    int slow = 0;
    for (Py_ssize_t i = 0; i < np; i++) vals[i] = i < n - 1 ? args[1 + i] : NULL;
    for (Py_ssize_t k = 0; k < nkw && !slow; k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t j = 0;
        while (j < np && PyTuple_GET_ITEM(m->params, j) != kw) j++;
        if (j == np && PyUnicode_CheckExact(kw)) {
            for (j = 0; j < np; j++) {
                const int eq = PyUnicode_Compare(PyTuple_GET_ITEM(m->params, j), kw);
                if (eq == 0) break;
                if (eq == -1 && PyErr_Occurred()) goto done;
            }
        }
        if (j == np || vals[j] != NULL) slow = 1;   /* (unknown, parent=, or given twice) */
        else vals[j] = args[n + k];
    }
    for (Py_ssize_t j = 0; j < np && !slow; j++) {
        if (vals[j] != NULL) continue;
        vals[j] = PyTuple_GET_ITEM(m->defaults, j);
        if (vals[j] == m->missing) slow = 1;       /* (a required argument not passed) */
    }
    PyObject *d = slow ? NULL : ms_dict(self);
    if (d == NULL) {
        if (PyErr_Occurred()) goto done;
        result = mi_call_slow(m, args, nargsf, kwnames);
        goto done;
    }
    /* the fields (the post-init state is in the ModuleBase fields) */
    d = ms_combined_dict(self, d, PyTuple_GET_SIZE(m->stores) + 1);
    if (d == NULL) goto done;
    /* the arguments bind: the fields are stored, in field order */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(m->stores); i++) {
        PyObject *st = PyTuple_GET_ITEM(m->stores, i);
        PyObject *name = PyTuple_GET_ITEM(st, 0);
        const Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 1));
        PyObject *dflt = PyTuple_GET_ITEM(st, 2), *fac = PyTuple_GET_ITEM(st, 3);
        PyObject *v;
        if (j >= 0 && j < np) {
            v = vals[j];
            v = fac != m->missing && v == m->factory ? PyObject_CallNoArgs(fac) : Py_NewRef(v);
        } else if (fac != m->missing) {
            v = PyObject_CallNoArgs(fac);
        } else {
            v = Py_NewRef(dflt);
        }
        const int rc = v == NULL ? -1 : PyDict_SetItem(d, name, v);
        Py_XDECREF(v);
        if (rc < 0) goto done;
    }
    PyObject *post = _PyType_Lookup(Py_TYPE(self), S(__post_init__));
    if (post != m->post_init) {
        result = PyObject_CallMethodNoArgs(self, S(__post_init__));
        if (result != NULL) Py_SETREF(result, Py_NewRef(Py_None));
        goto done;
    }
    result = ms_post_init(self, d);
done:
    if (vals != small) PyMem_Free(vals);
    return result;
}

static PyObject *mi_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *slow, *params, *defaults, *stores, *missing, *factory, *post_init;
    Py_ssize_t npos;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) > 0)
        return PyErr_Format(PyExc_TypeError, "ModuleInit takes no keyword arguments");
    if (!PyArg_ParseTuple(args, "OO!nO!O!OOO:ModuleInit", &slow, &PyTuple_Type, &params, &npos,
                          &PyTuple_Type, &defaults, &PyTuple_Type, &stores, &missing, &factory,
                          &post_init))
        return NULL;
    if (!PyCallable_Check(slow))
        return PyErr_Format(PyExc_TypeError, "ModuleInit: slow must be callable, got %.100s",
                            Py_TYPE(slow)->tp_name);
    const Py_ssize_t np = PyTuple_GET_SIZE(params);
    if (npos < 0 || npos > np)
        return PyErr_Format(PyExc_ValueError, "ModuleInit: npos must be in [0, %zd], got %zd",
                            np, npos);
    if (PyTuple_GET_SIZE(defaults) != np)
        return PyErr_Format(PyExc_ValueError, "ModuleInit: %zd defaults for %zd parameters",
                            PyTuple_GET_SIZE(defaults), np);
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *p = PyTuple_GET_ITEM(params, i);
        if (!PyUnicode_CheckExact(p))
            return PyErr_Format(PyExc_TypeError, "ModuleInit: parameter names must be str, "
                                "got %.100s", Py_TYPE(p)->tp_name);
    }
    PyObject *names = PyTuple_New(np);   /* (the names interned, as keyword names are) */
    if (names == NULL) return NULL;
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *p = Py_NewRef(PyTuple_GET_ITEM(params, i));
        PyUnicode_InternInPlace(&p);
        PyTuple_SET_ITEM(names, i, p);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(stores); i++) {
        PyObject *st = PyTuple_GET_ITEM(stores, i);
        Py_ssize_t j = -2;
        if (PyTuple_CheckExact(st) && PyTuple_GET_SIZE(st) == 4 &&
            PyUnicode_CheckExact(PyTuple_GET_ITEM(st, 0)) &&
            PyLong_CheckExact(PyTuple_GET_ITEM(st, 1))) {
            j = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 1));
            if (j == -1 && PyErr_Occurred()) {
                Py_DECREF(names);
                return NULL;
            }
        }
        if (j < -1 || j >= np) {
            Py_DECREF(names);
            return PyErr_Format(PyExc_ValueError, "ModuleInit: stores[%zd] must be (name, "
                                "parameter index in [-1, %zd), default, factory)", i, np);
        }
    }
    mi_object *m = (mi_object *)type->tp_alloc(type, 0);
    if (m == NULL) {
        Py_DECREF(names);
        return NULL;
    }
    m->vectorcall = mi_vectorcall;
    m->slow = Py_NewRef(slow);
    m->params = names;
    m->npos = npos;
    m->defaults = Py_NewRef(defaults);
    m->stores = Py_NewRef(stores);
    m->missing = Py_NewRef(missing);
    m->factory = Py_NewRef(factory);
    m->post_init = Py_NewRef(post_init);
    return (PyObject *)m;
}

static int mi_traverse(mi_object *m, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(m));
    Py_VISIT(m->slow);
    Py_VISIT(m->params);
    Py_VISIT(m->defaults);
    Py_VISIT(m->stores);
    Py_VISIT(m->missing);
    Py_VISIT(m->factory);
    Py_VISIT(m->post_init);
    Py_VISIT(m->dict);
    return 0;
}

static int mi_clear(mi_object *m) {
    Py_CLEAR(m->slow);
    Py_CLEAR(m->params);
    Py_CLEAR(m->defaults);
    Py_CLEAR(m->stores);
    Py_CLEAR(m->missing);
    Py_CLEAR(m->factory);
    Py_CLEAR(m->post_init);
    Py_CLEAR(m->dict);
    return 0;
}

static void mi_dealloc(mi_object *m) {
    PyTypeObject *tp = Py_TYPE(m);
    PyObject_GC_UnTrack(m);
    if (m->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)m);
    mi_clear(m);
    tp->tp_free((PyObject *)m);
    Py_DECREF(tp);
}

static PyObject *mi_repr(mi_object *m) {
    PyObject *qn = PyObject_GetAttrString((PyObject *)m, "__qualname__");
    if (qn == NULL) {
        PyErr_Clear();
        return PyUnicode_FromFormat("<ctrainstate module __init__ of %R>", m->slow);
    }
    PyObject *r = PyUnicode_FromFormat("<ctrainstate module __init__ %S>", qn);
    Py_DECREF(qn);
    return r;
}

static PyMemberDef mi_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(mi_object, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(mi_object, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(mi_object, weakrefs), READONLY, NULL},
    {"_ct_slow", T_OBJECT, offsetof(mi_object, slow), READONLY,
     "the generated Python __init__ this one declines to"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef mi_methods[] = {
    {"__reduce__", mm_reduce, METH_NOARGS, "Pickled by reference, as a function is."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mi_slots[] = {
    {Py_tp_new, mi_new},
    {Py_tp_getset, mm_getset},
    {Py_tp_dealloc, mi_dealloc},
    {Py_tp_traverse, mi_traverse},
    {Py_tp_clear, mi_clear},
    {Py_tp_repr, mi_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, mm_descr_get},
    {Py_tp_members, mi_members},
    {Py_tp_methods, mi_methods},
    {Py_tp_doc, "ModuleInit(slow, params, npos, defaults, stores, missing, factory, "
                "post_init)\n--\n\n"
                "The __init__ of an nn.Module class whose fields are plain: binds its "
                "arguments to the dataclass parameters, stores the fields in the instance "
                "__dict__ and does Module.__post_init__'s work, in C; every other call "
                "(an argument error, parent=) goes to slow, the generated Python __init__. A "
                "method descriptor, as a function is."},
    {0, NULL},
};

static PyType_Spec mi_spec = {
    .name = "ctrainstate._C.ModuleInit",
    .basicsize = sizeof(mi_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = mi_slots,
};

/* module_release: see the header. The tree is the modules reachable through `_children`
 * dicts. A module's references from the tree itself are its entry in its parent's
 * `_children` (for the root: `holder`'s item) and its children's `_parent`; where every
 * module's reference count is exactly that, nothing else can reach any of them (the tree's
 * links are the only way in), so cutting the `_parent` links changes nothing anyone can
 * observe, and frees the tree by reference counting instead of leaving it to the cycle
 * collector. Anything else (another reference, a dict subclass, a tree deeper than
 * MS_RELEASE_DEPTH) leaves the tree as it is. */
#define MS_RELEASE_DEPTH 64

/* 1 when every module of the tree under `m` is referenced by the tree only, 0 when not. */
static int ms_tree_private(PyObject *m, int depth) {
    if (depth > MS_RELEASE_DEPTH) return 0;
    PyObject *kids = MB(m, MB_CHILDREN);
    if (kids == NULL || !PyDict_CheckExact(kids)) return 0;
    Py_ssize_t internal = 1, pos = 0;
    PyObject *k, *c;
    while (PyDict_Next(kids, &pos, &k, &c)) {
        if (!PyObject_TypeCheck(c, mb_type) || MB(c, MB_PARENT) != m) return 0;
        internal++;
    }
    if (Py_REFCNT(m) != internal) return 0;
    pos = 0;
    while (PyDict_Next(kids, &pos, &k, &c))
        if (!ms_tree_private(c, depth + 1)) return 0;
    return 1;
}

/* Set `_parent` = None in every module of the tree under `m` but `m`. */
static int ms_cut_parents(PyObject *m) {
    PyObject *kids = MB(m, MB_CHILDREN);
    Py_ssize_t pos = 0;
    PyObject *k, *c;
    while (PyDict_Next(kids, &pos, &k, &c)) {
        if (ms_cut_parents(c) < 0) return -1;
        mb_set(c, MB_PARENT, Py_None);
    }
    return 0;
}

static PyObject *py_module_release(PyObject *mod, PyObject *holder) {
    (void)mod;
    if (ms_env[MS_CTX] == NULL) return PyErr_Format(PyExc_RuntimeError, "module_setup first");
    if (!PyList_CheckExact(holder) || PyList_GET_SIZE(holder) != 1)
        return PyErr_Format(PyExc_TypeError, "module_release(holder): a list of one module");
    PyObject *root = PyList_GET_ITEM(holder, 0);
    const int ism = PyObject_IsInstance(root, ms_env[MS_MODULE]);
    if (ism < 0) return NULL;
    if (!ism || !ms_tree_private(root, 0)) Py_RETURN_FALSE;
    /* (the walk above read dicts only: the tree is as it was checked) */
    if (ms_cut_parents(root) < 0) return NULL;
    Py_RETURN_TRUE;
}

/* --- Module.apply's common case -----------------------------------------------------------
 * module_apply(self, variables, *args): nn.module's Module.apply -> _run -> _clone_bound for
 * a call without keywords (rngs, method, mutable, capture_intermediates at their defaults, no
 * keyword argument to the method) in C: `variables` a plain dict, the class keeping
 * Module._run and Module._clone_bound, its field info cached (nn.module._field_info), no
 * module method running on this thread (an empty frame stack), the thread's capture stack and
 * scope stack made already. The variables are copied (copy_tree), the root ModuleScope made
 * (the attributes of _run's, in its order), the module cloned by its class with its fields,
 * bound to the scope, its __call__ run with the scope and capture stacks pushed as _run
 * pushes them, and the bound tree released (module_release). Every other call goes to
 * nn.module's Python apply (set by module_apply_setup), which stays the reference. */
enum { MA_SCOPE_TLS, MA_RUN, MA_CLONE, MA_N };
static PyObject *ma_env[MA_N];

static PyObject *py_module_apply_setup(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *env[MA_N];
    if (!PyArg_ParseTuple(args, "OOO:module_apply_setup", &env[MA_SCOPE_TLS], &env[MA_RUN],
                          &env[MA_CLONE]))
        return NULL;
    if (ms_env[MS_CTX] == NULL) return PyErr_Format(PyExc_RuntimeError, "module_setup first");
    for (int i = 0; i < MA_N; i++) Py_XSETREF(ma_env[i], Py_NewRef(env[i]));
    Py_RETURN_NONE;
}

/* The root ModuleScope of an apply without rngs (nn.module.Module._run's): a new reference. */
static PyObject *ma_root_scope(PyObject *variables) {
    /* rngs, path, _reserved, _children, root_rngs, rng_counters, adopted: new, empty */
    PyObject *e[7] = {PyDict_New(), PyTuple_New(0), PySet_New(NULL), PyDict_New(), PyDict_New(),
                      PyDict_New(), PyDict_New()};
    PyObject *scope = NULL;
    int ok = 1;
    for (int i = 0; i < 7; i++) ok &= e[i] != NULL;
    if (ok) {
        PyObject *const v[10] = {variables, e[0], Py_False, e[1], e[2], e[3], e[4], e[5],
                                 Py_False, e[6]};
        scope = ms_scope_new(v);
    }
    for (int i = 0; i < 7; i++) Py_XDECREF(e[i]);
    return scope;
}

/* Pop the last item of a list that the call pushed (it may have been replaced meanwhile:
 * as list.pop(), whatever is last). */
static void ma_pop(PyObject *list) {
    const Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > 0) PyList_SetSlice(list, n - 1, n, NULL);
}

PyObject *ct_py_module_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *miss) {
    if (ms_env[MS_CTX] == NULL || ma_env[MA_RUN] == NULL || nargs < 1 ||
        !PyDict_CheckExact(args[0]))
        return miss;
    PyTypeObject *cls = Py_TYPE(self);
    if (!PyType_IsSubtype(cls, (PyTypeObject *)ms_env[MS_MODULE]) ||
        _PyType_Lookup(cls, S(_run)) != ma_env[MA_RUN] ||
        _PyType_Lookup(cls, S(_clone_bound)) != ma_env[MA_CLONE])
        return miss;
    /* the class's own _field_info entry, made for its current fields dict */
    PyObject *info = cls->tp_dict != NULL ? PyDict_GetItemWithError(cls->tp_dict,
                                                                    S(_ct_field_info)) : NULL;
    if (info == NULL) return PyErr_Occurred() ? NULL : miss;
    PyObject *fields = _PyType_Lookup(cls, S(__dataclass_fields__));
    if (!PyTuple_CheckExact(info) || PyTuple_GET_SIZE(info) != 3 || fields == NULL ||
        PyTuple_GET_ITEM(info, 0) != fields || !PyTuple_CheckExact(PyTuple_GET_ITEM(info, 1)))
        return miss;
    Py_INCREF(info);   /* (held: the class's entry may be replaced while Python code runs) */
    PyObject *names = PyTuple_GET_ITEM(info, 1);
    PyObject *stack = NULL, *cap = NULL, *scopes = NULL, *result = miss;
    PyObject *vs = NULL, *scope = NULL, *bound = NULL, *fn = NULL, *out = NULL;
    PyObject *small[16], **vals = NULL;
    const Py_ssize_t nf = PyTuple_GET_SIZE(names);
    Py_ssize_t got = 0;
    if (ms_ctx_state(&stack, NULL, &cap) < 0) goto error;
    scopes = ct_py_tls_getattr(ma_env[MA_SCOPE_TLS], S(scopes));
    if (scopes == NULL) goto error;
    if (!PyList_CheckExact(stack) || PyList_GET_SIZE(stack) != 0 || !PyList_CheckExact(cap) ||
        !PyList_CheckExact(scopes))
        goto out;
    /* every condition holds: _run's work from here */
    vals = nf <= 16 ? small : PyMem_New(PyObject *, nf);
    if (vals == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    vs = ms_copy_tree(args[0]);
    scope = vs != NULL ? ma_root_scope(vs) : NULL;
    if (scope == NULL) goto error;
    for (; got < nf; got++) {   /* {n: getattr(self, n) for n in the field names} */
        vals[got] = PyObject_GetAttr(self, PyTuple_GET_ITEM(names, got));
        if (vals[got] == NULL) goto error;
    }
    bound = PyObject_Vectorcall((PyObject *)cls, vals, 0, nf > 0 ? names : NULL);
    if (bound == NULL) goto error;
    if (!PyObject_TypeCheck(bound, mb_type)) {
        PyErr_Format(PyExc_TypeError, "%.100s() made a %.100s, not an nn.Module", cls->tp_name,
                     Py_TYPE(bound)->tp_name);
        goto error;
    }
    mb_set(bound, MB_SCOPE, scope);
    fn = PyObject_GetAttr((PyObject *)Py_TYPE(bound), S(__call__));
    if (fn == NULL || PyList_Append(cap, Py_None) < 0) goto error;
    if (PyList_Append(scopes, scope) < 0) {
        ma_pop(cap);
        goto error;
    }
    {
        PyObject *a[17], **call = nargs <= 16 ? a : PyMem_New(PyObject *, nargs);
        if (call == NULL) {
            PyErr_NoMemory();
        } else {
            call[0] = bound;
            for (Py_ssize_t i = 1; i < nargs; i++) call[i] = args[i];
            out = PyObject_Vectorcall(fn, call, (size_t)nargs, NULL);
            if (call != a) PyMem_Free(call);
        }
    }
    /* (finally:) */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    ma_pop(scopes);
    ma_pop(cap);
    PyErr_Restore(et, ev, tb);
    if (out == NULL) goto error;
    /* holder = [bound]; del bound; _module_release(holder) */
    PyObject *holder = PyList_New(1);
    if (holder == NULL) goto error;
    PyList_SET_ITEM(holder, 0, bound);
    bound = NULL;
    PyObject *r = py_module_release(NULL, holder);
    Py_DECREF(holder);
    if (r == NULL) goto error;
    Py_DECREF(r);
    result = out;
    out = NULL;
    goto out;
error:
    result = NULL;
out:
    for (Py_ssize_t i = 0; i < got; i++) Py_DECREF(vals[i]);
    if (vals != NULL && vals != small) PyMem_Free(vals);
    Py_XDECREF(stack);
    Py_XDECREF(cap);
    Py_XDECREF(scopes);
    Py_XDECREF(vs);
    Py_XDECREF(scope);
    Py_XDECREF(bound);
    Py_XDECREF(fn);
    Py_XDECREF(out);
    Py_DECREF(info);
    return result;
}

static PyMethodDef module_methods[] = {
    {"module_setup", py_module_setup, METH_VARARGS,
     "module_setup(ctx, module_type, frame_type, scope_type, base_attach, base_adopt_fields, "
     "base_setup, base_try_setup, plain_fields_info, call_slow, bind_slow, adopt_tail, /)\n--\n\n"
     "The objects module_call and module_bind_new read (set once by nn.module)."},
    {"module_call", (PyCFunction)(void (*)(void))py_module_call, METH_FASTCALL,
     "module_call(fn, self, args, kwargs, /)\n--\n\n"
     "A module method call, fn(self, *args, **kwargs), with the module's frame active (nn.module"
     "._call_method's common case in C; the rest goes to it)."},
    {"module_bind_new", (PyCFunction)(void (*)(void))py_module_bind_new, METH_FASTCALL,
     "module_bind_new(module, stack, /)\n--\n\n"
     "Attach a module just constructed while a module method runs (nn.module._bind_new's "
     "common case in C; the rest goes to it)."},
    {"module_post_init", (PyCFunction)(void (*)(void))py_module_post_init, METH_FASTCALL,
     "module_post_init(module, d, /)\n--\n\n"
     "Module.__post_init__'s work for a module whose __dict__ d holds its fields (the end of "
     "nn.module's generated __init__): its state, the name check, and module_bind_new's "
     "attach where a module method runs."},
    {"copy_tree", py_copy_tree, METH_O,
     "copy_tree(tree, /)\n--\n\n"
     "tree with every dict in it copied into a plain dict, at any depth (a dict subclass's "
     "items as its items() gives them), other values kept as they are (nn.module._copy_tree)."},
    {"module_apply_setup", py_module_apply_setup, METH_VARARGS,
     "module_apply_setup(scope_tls, base_run, base_clone_bound, /)\n--\n\n"
     "The objects ModuleApply's common case reads (set once by nn.module, after module_setup)."},
    {"module_release", py_module_release, METH_O,
     "module_release(holder, /)\n--\n\n"
     "Cut the child-to-parent links of the module tree under holder[0] (a list of one module) "
     "where nothing but holder and the tree's own links references its modules, so that it is "
     "freed by reference counting; True when cut, False when left as it is."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_module(PyObject *m) {
    mb_type = (PyTypeObject *)PyType_FromSpec(&mb_spec);   /* (kept here and in m) */
    if (mb_type == NULL || PyModule_AddObjectRef(m, "ModuleBase", (PyObject *)mb_type) < 0) {
        Py_CLEAR(mb_type);
        return -1;
    }
    PyObject *mm = PyType_FromSpec(&mm_spec);
    if (mm == NULL || PyModule_AddObject(m, "ModuleMethod", mm) < 0) {
        Py_XDECREF(mm);
        return -1;
    }
    PyObject *mi = PyType_FromSpec(&mi_spec);
    if (mi == NULL || PyModule_AddObject(m, "ModuleInit", mi) < 0) {
        Py_XDECREF(mi);
        return -1;
    }
    return PyModule_AddFunctions(m, module_methods);
}
