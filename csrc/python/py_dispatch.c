/*
 * py_dispatch.c — _C.Primitive: an op whose every call after the first of its kind runs in C.
 *
 * A primitive (ctrainstate.numpy.add, sin, sum, ..., and the Array's + - * / -) holds
 *   - the Python op (`fallback`): the general path, with every check, error message,
 *     resharding, dtype policy and autodiff rule;
 *   - a planner (Python): given operands, the plan of their kind — output shape, dtype,
 *     sharding and blocks, the kernel, the reduction and the all-reduce groups — or None
 *     when this kind of call has no C path;
 *   - a cache of plans keyed by the operands' (shape, dtype, sharding object), or for a
 *     Python scalar operand its side.
 * A call whose operands are live Arrays (and Python float / int scalars where the op takes
 * them), with no keyword arguments, on a thread with no autodiff tape recording, looks its
 * plan up, checks every block's buffer (type, device, not deleted), allocates the outputs,
 * runs the kernels (the GIL released above CT_DISPATCH_GIL_ELEMS elements, the buffers
 * pinned meanwhile) and the all-reduces, and returns the new Array: no Python code runs.
 * Anything else — another operand type, a keyword, a donated or deleted operand, an active
 * tape, a value-dependent case (x * 0.0) — calls the Python op, which decides and raises.
 * Both paths run the same kernels in the same order, so the results are the same bits.
 *
 *   Primitive(name, nin, fallback, planner, doc)   (nin: 1 or 2 operands)
 *   dispatch_register(tls, add, subtract, multiply, divide, negative)
 *       tls: the threading.local whose `tapes` stack says whether a tape records on this
 *       thread (ctrainstate._ops._tls); the five primitives behind the Array's operators.
 *
 * Plan tuples (the planner's result):
 *   (kind, op, out_shape, out_dtype, out_dtype_code, out_sharding, out_shard_shape,
 *    blocks, red_mask, groups, red_op)
 *   kind   K_UNARY (ct_op_unary op), K_BINARY (ct_op_binary op, float32), K_EWISE (ct_op_ewise
 *          op in the operands' dtype: two Arrays, one (a unary op: invert), or an Array and a
 *          Python scalar converted to its dtype at each call, on CPU devices), K_REDUCE (ct_op_reduce op over red_mask; a copy when
 *          0), K_SCALAR (an Array and a Python scalar: `op` is a S_* rule giving the affine or
 *          reciprocal kernel's constants from the scalar at each call), K_COPY (each block's
 *          bytes copied into an output block of another shape: a reshape that keeps every
 *          block; any dtype), K_BCAST (the first operand's block broadcast to the output block,
 *          any dtype the kernels have; a second operand, if any, only gives the plan's key),
 *          K_CONVERT (each block converted to the output's dtype, ct_op_convert), K_TRANSPOSE
 *          (each block's dimensions permuted, any dtype: the permutation packed 4 bits a
 *          dimension in the plan's first mnk field), K_UNARY16 (ct_op_unary_typed op on a 16-bit
 *          float Array: the bits of the Python path's convert / float32 op / round)
 *   blocks a list of (device, start, replica_id), the output's blocks in the operands' block
 *          order; groups: lists of block positions to all-reduce with red_op after the kernels.
 */
#include "ct_py.h"

#include <math.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

#include "../core/ct_ops.h"
#include "../core/ct_par.h"

enum { K_UNARY = 0, K_BINARY, K_EWISE, K_REDUCE, K_SCALAR, K_MATMUL, K_COPY, K_BCAST, K_CONVERT,
       K_TRANSPOSE, K_UNARY16, K_COUNT };
/* K_SCALAR rules: the constants of `array (op) s` / `s (op) array` */
enum { S_ADD = 0, S_SUB_R, S_SUB_L, S_MUL, S_DIV_R, S_DIV_L, S_COUNT };

#define NCACHE 32
#define MAXSTATIC 6
#define MAXB CT_MAX_DEVICES
/* Kernels on fewer elements than this (all blocks together) run with the GIL held: on tiny
 * arrays releasing and taking it back costs more than the kernel. */
#define CT_DISPATCH_GIL_ELEMS ((int64_t)1 << 15)

typedef struct {
    int used, fast;
    int busy; /* calls running from this plan: it is neither replaced nor cleared meanwhile
               * (a call releases the GIL around large kernels, and allocating may run a
               * garbage collection, whose finalizers may call primitives) */
    /* key: the operands' (shape, dtype, sharding); for a scalar operand the shape is NULL
     * and `side` says which (1: b is the scalar, 2: a is) */
    PyObject *ka_shape, *ka_dtype, *ka_sharding;
    PyObject *kb_shape, *kb_dtype, *kb_sharding;
    PyObject *kstatics; /* the static arguments (a tuple), or NULL */
    int side;
    /* plan */
    int kind, op, red_op, out_dt, out_ndim, nblk, ngroups;
    uint32_t red_mask;
    int64_t out_sdims[CT_MAX_NDIM];
    int64_t out_elems; /* elements of one output block */
    int64_t mnk[3];    /* K_MATMUL: one GEMM per block, (m x k) @ (k x n) */
    PyObject *out_shape, *out_dtype, *out_sharding, *out_shard_shape;
    /* per block (nblk of each): its device, start and replica id, its C device, and an
     * earlier block holding the same slice on another CPU device (a replica: the same inputs,
     * so the same result, copied instead of computed again), or -1 */
    PyObject **bdev, **bstart, **brid;
    ct_device **cdev;
    int *rep_of;
    int *gstart, *gpos; /* group g: gpos[gstart[g] .. gstart[g + 1]) */
    /* the one allocation that holds the arrays above, sized for this plan (NULL: none; a
     * copy of the entry owns a copy of it, see entry_copy_blocks) */
    void *bmem;
    int bm_nblk, bm_ng, bm_npos; /* what bmem was laid out for */
} plan_entry;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *name, *fallback, *planner, *doc, *dict;
    PyObject *vjp; /* the tape rule (g, out, *operands) -> cotangents of the Array operands;
                    * NULL: a recording tape sends calls to the fallback */
    PyObject *vjp16; /* the rule of a call on bfloat16 / float16 operands (its plan computes in
                      * float32 and rounds), or NULL: a recording tape sends those calls to the
                      * fallback */
    PyObject *none_kw; /* keyword names whose None value is the default (a tuple), or NULL */
    PyObject *statics, *defaults; /* static parameters after the operands (names, defaults) */
    int nin, nstatic;
    int nondiff; /* its results are never differentiable (a comparison's bools): a recording
                  * tape is not read, nothing is recorded, as in the Python op */
    int next; /* the cache entry replaced at the next miss */
    unsigned long long hits, misses, falls;
    plan_entry cache[NCACHE];
} prim;

static PyTypeObject *prim_type;
static PyObject *tape_tls;                 /* ctrainstate._ops._tls */
static PyObject *prec_tls;                 /* ctrainstate._precision._tls */
static PyObject *default_name, *process_name, *mesh_name, *norm_name;
static PyObject *named_sharding_type;      /* ctrainstate.sharding.NamedSharding */
static PyObject *tape_type;                /* ctrainstate._ops._Tape */
static PyObject *tapes_name, *outer_name, *tracked_name, *keep_name;
static PyTypeObject *node_vjp_type;
#define NSLOT 6
static PyObject *slot_prims[NSLOT];        /* add, subtract, multiply, divide, negative, matmul */
/* the comparisons by Py_LT .. Py_GE, then bitwise_and, bitwise_or, bitwise_xor, invert */
#define NTYPED 10
static PyObject *typed_prims[NTYPED];

static void entry_clear(plan_entry *e) {
    Py_CLEAR(e->ka_shape);
    Py_CLEAR(e->ka_dtype);
    Py_CLEAR(e->ka_sharding);
    Py_CLEAR(e->kb_shape);
    Py_CLEAR(e->kb_dtype);
    Py_CLEAR(e->kb_sharding);
    Py_CLEAR(e->kstatics);
    Py_CLEAR(e->out_shape);
    Py_CLEAR(e->out_dtype);
    Py_CLEAR(e->out_sharding);
    Py_CLEAR(e->out_shard_shape);
    for (int i = 0; i < e->nblk; i++) {
        Py_CLEAR(e->bdev[i]);
        Py_CLEAR(e->bstart[i]);
        Py_CLEAR(e->brid[i]);
    }
    PyMem_Free(e->bmem);
    e->bmem = NULL;
    e->bm_nblk = e->bm_ng = e->bm_npos = 0;
    e->bdev = e->bstart = e->brid = NULL;
    e->cdev = NULL;
    e->rep_of = e->gstart = e->gpos = NULL;
    e->used = e->fast = 0;
    e->nblk = e->ngroups = 0;
}

/* Point e's per-block arrays into mem: nblk blocks, ng groups, npos group positions (the
 * pointer arrays first, then the ints). Returns the bytes that layout needs; with mem NULL,
 * nothing is set. */
static size_t entry_layout(plan_entry *e, void *mem, int nblk, int ng, int npos) {
    const size_t n = (size_t)nblk;
    const size_t ptrs = n * (3 * sizeof(PyObject *) + sizeof(ct_device *));
    const size_t ints = n + (size_t)ng + 1 + (size_t)npos;
    if (mem != NULL) {
        e->bdev = (PyObject **)mem;
        e->bstart = e->bdev + n;
        e->brid = e->bstart + n;
        e->cdev = (ct_device **)(e->brid + n);
        e->rep_of = (int *)((char *)mem + ptrs);
        e->gstart = e->rep_of + n;
        e->gpos = e->gstart + ng + 1;
        e->bmem = mem;
        e->bm_nblk = nblk;
        e->bm_ng = ng;
        e->bm_npos = npos;
    }
    return ptrs + ints * sizeof(int);
}

/* After a memcpy of entry src into dst: dst's own copy of the per-block arrays (their
 * references are not taken here). -1 with MemoryError set (dst then has none). */
static int entry_copy_blocks(plan_entry *dst, const plan_entry *src) {
    dst->bmem = NULL;
    dst->bdev = dst->bstart = dst->brid = NULL;
    dst->cdev = NULL;
    dst->rep_of = dst->gstart = dst->gpos = NULL;
    if (src->bmem == NULL) return 0;
    const size_t size = entry_layout(dst, NULL, src->bm_nblk, src->bm_ng, src->bm_npos);
    void *m = PyMem_Malloc(size);
    if (m == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(m, src->bmem, size);
    entry_layout(dst, m, src->bm_nblk, src->bm_ng, src->bm_npos);
    return 0;
}

/* Attributes of the package's threading.local objects (the tape stack, the precision, the
 * mesh and module contexts), read at every primitive call. A threading.local keeps one
 * instance dict per thread (what `_tls.x = ...` writes); its attribute lookup finds that
 * dict through the thread's state on every call. Here each local's dict of the last thread
 * that asked is cached, keyed by that thread's state dict (held, so that no later thread's
 * can have its address): one dict lookup. A name not in it is the class's attribute (the
 * package's locals declare their defaults there). Their attributes are plain values: a
 * data descriptor of the class would be skipped. */
enum { TLS_SLOTS = 8 };
static struct {
    PyObject *local, *key, *dict; /* (all held) */
} tls_slots[TLS_SLOTS];
static int tls_next; /* the slot a new local takes when all are used */
static PyTypeObject *thread_local_type; /* _thread._local */
static PyObject *dict_name, *notifies_name;

/* A memo of the values read last (borrowed), for one thread at a time (the GIL's holder:
 * another thread's read refills it): valid while no attribute of a local that notifies its
 * writes has been set or deleted since, on any thread (`tls_version`, bumped by
 * _C.tls_changed()), for the thread state that filled it (a thread state's id is never
 * reused, where its address can be: a foreign thread's callbacks each get a new one). Only a
 * local whose class declares `_ct_notifies_writes = True` (ctrainstate's
 * base.threadlocal.NotifyingLocal: its instances' and its class's writes call tls_changed)
 * and that holds a slot (held, so that no other object takes its address) is memoised; a
 * slot given up bumps the version. A value so memoised is held by that thread's instance
 * dict or the class until a write replaces it, and a thread's dict goes only with its
 * thread state. */
enum { TLS_MEMO_BITS = 6, TLS_MEMO = 1 << TLS_MEMO_BITS };
static uint64_t tls_version = 1;
static struct {
    uint64_t tstate_id, version;
    struct { PyObject *local, *name, *value; } e[TLS_MEMO];
} tls_memo;

/* This thread's instance dict of `local` (borrowed), NULL without an exception if unknown
 * or `local` is not a threading.local (checked where it holds no slot yet). *held: whether
 * `local` holds a slot. */
static PyObject *tls_dict(PyObject *local, int *held) {
    *held = 0;
    PyObject *ts = PyThreadState_GetDict(); /* (borrowed) */
    if (ts == NULL) return NULL;
    int slot = -1;
    for (int i = 0; i < TLS_SLOTS; i++)
        if (tls_slots[i].local == local) {
            if (tls_slots[i].key == ts) {
                *held = 1;
                return tls_slots[i].dict;
            }
            slot = i;
            break;
        }
    if (slot < 0 && (thread_local_type == NULL || !PyObject_TypeCheck(local, thread_local_type)))
        return NULL;
    PyObject *d = PyObject_GetAttr(local, dict_name);
    if (d == NULL || !PyDict_CheckExact(d)) {
        Py_XDECREF(d);
        PyErr_Clear();
        return NULL;
    }
    if (slot < 0) {
        slot = tls_next;
        tls_next = (tls_next + 1) % TLS_SLOTS;
        if (tls_slots[slot].local != NULL) tls_version++; /* (memos of the local given up) */
        Py_XSETREF(tls_slots[slot].local, Py_NewRef(local));
    }
    Py_XSETREF(tls_slots[slot].key, Py_NewRef(ts));
    Py_XSETREF(tls_slots[slot].dict, d);
    *held = 1;
    return d;
}

PyObject *ct_py_tls_getattr(PyObject *local, PyObject *name) {
    const uint64_t tid = PyThreadState_GetID(PyThreadState_Get());
    if (tls_memo.tstate_id != tid || tls_memo.version != tls_version) {
        memset(tls_memo.e, 0, sizeof tls_memo.e);
        tls_memo.tstate_id = tid;
        tls_memo.version = tls_version;
    }
    /* (a multiplicative hash of both addresses: their low bits are alignment) */
    const size_t h = (size_t)((((uint64_t)(uintptr_t)local * 0x9E3779B97F4A7C15ull) ^
                               (uint64_t)(uintptr_t)name) * 0xFF51AFD7ED558CCDull >>
                              (64 - TLS_MEMO_BITS));
    if (tls_memo.e[h].local == local && tls_memo.e[h].name == name)
        return Py_NewRef(tls_memo.e[h].value);
    int held;
    PyObject *d = tls_dict(local, &held);
    if (d != NULL) {
        PyObject *v = PyDict_GetItemWithError(d, name);
        if (v == NULL) {
            if (PyErr_Occurred()) return NULL;
            v = _PyType_Lookup(Py_TYPE(local), name); /* (borrowed: the class's attribute) */
            if (v != NULL && Py_TYPE(v)->tp_descr_get != NULL) v = NULL;
        }
        if (v != NULL) {
            if (held && _PyType_Lookup(Py_TYPE(local), notifies_name) == Py_True) {
                tls_memo.e[h].local = local;
                tls_memo.e[h].name = name;
                tls_memo.e[h].value = v;
            }
            return Py_NewRef(v);
        }
    }
    return PyObject_GetAttr(local, name);
}

static PyObject *py_tls_changed(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    tls_version++;
    Py_RETURN_NONE;
}

/* The tape recording on this thread: ctrainstate._ops._tape(), the last entry of
 * `_tls.tapes` when that is a non-empty list. Returns 0 with *tape NULL (none) or a new
 * reference; 1 when the stack is something else (the Python op reads it); -1 on error. */
static int top_tape(PyObject **tape) {
    *tape = NULL;
    if (tape_tls == NULL) return 1; /* not registered: never take the C path */
    /* (the thread-local's class has `tapes = None`: a thread that never opened a tape
     * reads that, and no AttributeError is made) */
    PyObject *stack = ct_py_tls_getattr(tape_tls, tapes_name);
    if (stack == NULL) return -1;
    int rc = 0;
    if (stack == Py_None) {
    } else if (PyList_CheckExact(stack)) {
        const Py_ssize_t n = PyList_GET_SIZE(stack);
        PyObject *top = n > 0 ? PyList_GET_ITEM(stack, n - 1) : Py_None;
        if (top != Py_None) *tape = Py_NewRef(top);
    } else {
        rc = 1;
    }
    Py_DECREF(stack);
    return rc;
}

/* The calling thread's matrix-product precision for precision=None (_precision.
 * current_default()): its `default`, else the process's; -1 on error. */
static int current_precision(void) {
    if (prec_tls == NULL) return -1;
    PyObject *d = ct_py_tls_getattr(prec_tls, default_name);
    if (d == Py_None) {
        Py_DECREF(d);
        d = ct_py_tls_getattr(prec_tls, process_name);
    }
    if (d == NULL) return -1;
    long v = PyLong_Check(d) ? PyLong_AsLong(d) : -1;
    Py_DECREF(d);
    if (v == -1 && PyErr_Occurred()) return -1;
    return (int)v;
}

static int same_shape(PyObject *x, PyObject *y) {
    if (x == y) return 1;
    if (!PyTuple_CheckExact(x) || !PyTuple_CheckExact(y)) return 0;
    const Py_ssize_t n = PyTuple_GET_SIZE(x);
    if (PyTuple_GET_SIZE(y) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *u = PyTuple_GET_ITEM(x, i), *v = PyTuple_GET_ITEM(y, i);
        if (u == v) continue;
        if (!PyLong_CheckExact(u) || !PyLong_CheckExact(v)) return 0;
        int overflow_u, overflow_v;
        long long a = PyLong_AsLongLongAndOverflow(u, &overflow_u);
        long long b = PyLong_AsLongLongAndOverflow(v, &overflow_v);
        if (overflow_u || overflow_v || a != b) return 0;
    }
    return 1;
}

static int is_scalar(PyObject *o) { return PyFloat_CheckExact(o) || PyLong_CheckExact(o); }

/* The number of entries of a NamedSharding's `_norm` (per-dimension mesh axes) up to its
 * last non-empty one. */
static Py_ssize_t norm_len(PyObject *norm) {
    Py_ssize_t n = PyTuple_GET_SIZE(norm);
    while (n > 0) {
        PyObject *e = PyTuple_GET_ITEM(norm, n - 1);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 0) break;
        n--;
    }
    return n;
}

/* Pairs of distinct sharding objects same_layout compared, with the answer (held, so that
 * neither address can be another object's while it is here; shardings do not change): the
 * grads' shardings and the params' (equal specs written apart, P('model') and
 * P('model', None)), a plan's key and an operand's, compared again at every step. A full
 * table gives up its oldest pair. */
enum { SAME_PAIRS = 64 };
static struct { PyObject *s, *t; int same; } same_pairs[SAME_PAIRS];
static unsigned same_pairs_next;

static int same_layout_slow(PyObject *s, PyObject *t);

/* Whether two sharding objects lay an Array out the same way, so a plan made for one serves
 * the other: the same object, or two NamedShardings of the same mesh object whose
 * per-dimension mesh axes (`_norm`) are equal up to trailing unsharded dimensions (as
 * NamedSharding.__eq__). A sharding constraint, a device_put or a reshard back makes a new
 * but equal object every step. Compared without running Python code. */
static int same_layout(PyObject *s, PyObject *t) {
    if (s == t) return 1;
    for (int i = 0; i < SAME_PAIRS; i++)
        if ((same_pairs[i].s == s && same_pairs[i].t == t) ||
            (same_pairs[i].s == t && same_pairs[i].t == s))
            return same_pairs[i].same;
    const int same = same_layout_slow(s, t);
    const unsigned i = same_pairs_next++ % SAME_PAIRS;
    PyObject *old_s = same_pairs[i].s, *old_t = same_pairs[i].t;
    same_pairs[i].s = Py_NewRef(s);
    same_pairs[i].t = Py_NewRef(t);
    same_pairs[i].same = same;
    Py_XDECREF(old_s); /* (after the slot is rewritten: a dealloc may come back here) */
    Py_XDECREF(old_t);
    return same;
}

/* same_layout's comparison of two distinct objects. */
static int same_layout_slow(PyObject *s, PyObject *t) {
    if (Py_TYPE(s) != Py_TYPE(t) || named_sharding_type == NULL) return 0;
    if ((PyObject *)Py_TYPE(s) != named_sharding_type) {
        /* one device's sharding (SingleDeviceSharding): the same `device` object */
        PyObject *ds = PyObject_GenericGetDict(s, NULL), *dt = PyObject_GenericGetDict(t, NULL);
        PyObject *vs = ds != NULL ? PyDict_GetItemString(ds, "device") : NULL;
        PyObject *vt = dt != NULL ? PyDict_GetItemString(dt, "device") : NULL;
        const int same = vs != NULL && vs == vt && PyDict_GET_SIZE(ds) <= 2 && PyDict_GET_SIZE(dt) <= 2;
        Py_XDECREF(ds);
        Py_XDECREF(dt);
        PyErr_Clear();
        return same;
    }
    PyObject *ds = PyObject_GenericGetDict(s, NULL), *dt = PyObject_GenericGetDict(t, NULL);
    int same = 0;
    if (ds != NULL && dt != NULL) {
        PyObject *ms = PyDict_GetItemWithError(ds, mesh_name);
        PyObject *mt = ms != NULL ? PyDict_GetItemWithError(dt, mesh_name) : NULL;
        PyObject *ns = PyDict_GetItemWithError(ds, norm_name);
        PyObject *nt = PyDict_GetItemWithError(dt, norm_name);
        if (ms != NULL && ms == mt && ns != NULL && nt != NULL && PyTuple_CheckExact(ns) &&
            PyTuple_CheckExact(nt)) {
            const Py_ssize_t n = norm_len(ns);
            same = n == norm_len(nt);
            for (Py_ssize_t i = 0; same && i < n; i++) {
                int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(ns, i), PyTuple_GET_ITEM(nt, i),
                                                  Py_EQ);
                same = eq == 1;
            }
        }
    }
    Py_XDECREF(ds);
    Py_XDECREF(dt);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        same = 0;
    }
    return same;
}

/* Whether static argument values are the same: the same type and equal (True is not 1). */
static int same_static(PyObject *x, PyObject *y) {
    if (x == y) return 1;
    if (Py_TYPE(x) != Py_TYPE(y)) return 0;
    int eq = PyObject_RichCompareBool(x, y, Py_EQ);
    if (eq < 0) PyErr_Clear();
    return eq == 1;
}

static int statics_match(const plan_entry *e, PyObject *const *st, int n) {
    for (int j = 0; j < n; j++)
        if (!same_static(PyTuple_GET_ITEM(e->kstatics, j), st[j])) return 0;
    return 1;
}

static int key_match(const plan_entry *e, const ct_py_array *a, const ct_py_array *b, int side) {
    if (!e->used || e->side != side) return 0;
    if (e->ka_dtype != a->dtype || !same_shape(e->ka_shape, a->shape)) return 0;
    if (b != NULL && (e->kb_dtype != b->dtype || !same_shape(e->kb_shape, b->shape))) return 0;
    if (e->ka_sharding == a->sharding && (b == NULL || e->kb_sharding == b->sharding)) return 1;
    return same_layout(e->ka_sharding, a->sharding) &&
           (b == NULL || same_layout(e->kb_sharding, b->sharding));
}

static int as_int(PyObject *o, int *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "plan: value out of range");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static PyObject *plan_error(const char *what) {
    return PyErr_Format(PyExc_ValueError, "Primitive planner returned a bad plan: %s", what);
}

/* Fill e's plan from the planner's tuple (see the top of the file); -1 with an exception. */
/* e->rep_of: where blocks on CPU devices hold the same slice (the same start) of a plan that
 * computes each block from the operands' blocks on its device alone (no all-reduce groups:
 * with groups, blocks of one start are partial sums), the later ones copy the first's result.
 * Replicas hold equal data (every kernel is deterministic, and each replica's inputs are
 * replicas too), so the copy has the bits the kernel would compute. */
static int set_replicas(plan_entry *e) {
    for (int i = 0; i < e->nblk; i++) e->rep_of[i] = -1;
    if (e->ngroups != 0 || e->nblk < 2 || e->nblk > 256) return 0; /* (pairs compared once) */
    for (int i = 0; i < e->nblk; i++)
        if (e->cdev[i]->platform != CT_PLATFORM_CPU) return 0;
    for (int i = 1; i < e->nblk; i++)
        for (int j = 0; j < i; j++) {
            if (e->rep_of[j] >= 0) continue;
            int eq = PyObject_RichCompareBool(e->bstart[i], e->bstart[j], Py_EQ);
            if (eq < 0) return -1;
            if (eq) {
                e->rep_of[i] = j;
                break;
            }
        }
    return 0;
}

static int entry_set_plan(plan_entry *e, PyObject *t) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 12) {
        plan_error("not a 12-tuple");
        return -1;
    }
    int64_t mnk[3] = {0, 0, 0};
    if (ct_py_int64_seq(PyTuple_GET_ITEM(t, 11), mnk, 3, "plan extra") < 0) return -1;
    int kind, op, dt, red_op;
    if (as_int(PyTuple_GET_ITEM(t, 0), &kind) < 0 || as_int(PyTuple_GET_ITEM(t, 1), &op) < 0 ||
        as_int(PyTuple_GET_ITEM(t, 4), &dt) < 0 || as_int(PyTuple_GET_ITEM(t, 10), &red_op) < 0)
        return -1;
    if (kind < 0 || kind >= K_COUNT || dt < 0 || dt >= CT_NUM_DTYPES || red_op < 0 ||
        red_op >= CT_RED_COUNT || (kind == K_SCALAR && (op < 0 || op >= S_COUNT))) {
        plan_error("kind, dtype or reduction out of range");
        return -1;
    }
    PyObject *shard_shape = PyTuple_GET_ITEM(t, 6), *blocks = PyTuple_GET_ITEM(t, 7);
    int ndim = ct_py_int64_seq(shard_shape, e->out_sdims, CT_MAX_NDIM, "plan shard shape");
    if (ndim < 0) return -1;
    int64_t elems = 1;
    for (int d = 0; d < ndim; d++) {
        if (e->out_sdims[d] < 0) {
            plan_error("negative dimension");
            return -1;
        }
        elems *= e->out_sdims[d];
    }
    if (!PyList_Check(blocks) || PyList_GET_SIZE(blocks) < 1 || PyList_GET_SIZE(blocks) > MAXB) {
        plan_error("blocks");
        return -1;
    }
    unsigned long mask = PyLong_AsUnsignedLongMask(PyTuple_GET_ITEM(t, 8));
    if (mask == (unsigned long)-1 && PyErr_Occurred()) return -1;
    const int nblk = (int)PyList_GET_SIZE(blocks);
    /* all-reduce groups: counted first, to size the per-block arrays */
    PyObject *groups = PySequence_Fast(PyTuple_GET_ITEM(t, 9), "plan groups");
    if (groups == NULL) return -1;
    int ng = (int)PySequence_Fast_GET_SIZE(groups), npos = 0;
    if (ng > MAXB) {
        Py_DECREF(groups);
        plan_error("too many groups");
        return -1;
    }
    for (int g = 0; g < ng; g++) {
        PyObject *grp = PySequence_Fast(PySequence_Fast_GET_ITEM(groups, g), "plan group");
        Py_ssize_t len = grp != NULL ? PySequence_Fast_GET_SIZE(grp) : -1;
        Py_XDECREF(grp);
        if (len < 0 || len > MAXB - npos) {
            if (!PyErr_Occurred()) plan_error("group position");
            Py_DECREF(groups);
            return -1;
        }
        npos += (int)len;
    }
    /* (e was cleared: it holds no arrays yet) */
    void *mem = PyMem_Calloc(1, entry_layout(e, NULL, nblk, ng, npos));
    if (mem == NULL) {
        Py_DECREF(groups);
        PyErr_NoMemory();
        return -1;
    }
    entry_layout(e, mem, nblk, ng, npos);
    for (int i = 0; i < nblk; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 3) {
            Py_DECREF(groups);
            plan_error("a block is not (device, start, replica_id)");
            return -1;
        }
        PyObject *devid = PyObject_GetAttrString(PyTuple_GET_ITEM(b, 0), "id");
        if (devid == NULL) {
            Py_DECREF(groups);
            return -1;
        }
        int id;
        int r = as_int(devid, &id);
        Py_DECREF(devid);
        if (r < 0) {
            Py_DECREF(groups);
            return -1;
        }
        ct_device *cd = ct_device_by_id(id);
        if (cd == NULL) {
            Py_DECREF(groups);
            ct_py_raise(CT_EINVAL);
            return -1;
        }
        e->cdev[i] = cd;
    }
    int k = 0;
    for (int g = 0; g < ng; g++) {
        PyObject *grp = PySequence_Fast(PySequence_Fast_GET_ITEM(groups, g), "plan group");
        if (grp == NULL) {
            Py_DECREF(groups);
            return -1;
        }
        e->gstart[g] = k;
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(grp); j++) {
            int pos;
            if (as_int(PySequence_Fast_GET_ITEM(grp, j), &pos) < 0 || pos < 0 || pos >= nblk ||
                k >= npos) {
                if (!PyErr_Occurred()) plan_error("group position");
                Py_DECREF(grp);
                Py_DECREF(groups);
                return -1;
            }
            e->gpos[k++] = pos;
        }
        Py_DECREF(grp);
    }
    e->gstart[ng] = k;
    Py_DECREF(groups);
    /* commit */
    e->kind = kind;
    e->op = op;
    e->red_op = red_op;
    e->out_dt = dt;
    e->out_ndim = ndim;
    e->out_elems = elems;
    e->red_mask = (uint32_t)mask;
    memcpy(e->mnk, mnk, sizeof mnk);
    if (kind == K_MATMUL && (mnk[0] < 0 || mnk[1] < 0 || mnk[2] < 0 || mnk[0] * mnk[1] != elems)) {
        plan_error("matmul geometry");
        return -1;
    }
    e->ngroups = ng;
    e->nblk = nblk;
    for (int i = 0; i < nblk; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        e->bdev[i] = Py_NewRef(PyTuple_GET_ITEM(b, 0));
        e->bstart[i] = Py_NewRef(PyTuple_GET_ITEM(b, 1));
        e->brid[i] = Py_NewRef(PyTuple_GET_ITEM(b, 2));
    }
    e->out_shape = Py_NewRef(PyTuple_GET_ITEM(t, 2));
    e->out_dtype = Py_NewRef(PyTuple_GET_ITEM(t, 3));
    e->out_sharding = Py_NewRef(PyTuple_GET_ITEM(t, 5));
    e->out_shard_shape = Py_NewRef(shard_shape);
    if (set_replicas(e) < 0) return -1;
    e->fast = 1;
    return 0;
}

/* The cache entry for these operands, planned on a miss; NULL with an exception set, or
 * NULL without one when the planner said no (that answer is cached too). */
static plan_entry *lookup(prim *p, ct_py_array *a, ct_py_array *b, int side, PyObject *const *args) {
    for (int i = 0; i < NCACHE; i++) {
        plan_entry *e = &p->cache[i];
        if (key_match(e, a, b, side) && statics_match(e, args + p->nin, p->nstatic)) {
            p->hits++;
            return e->fast ? e : NULL;
        }
    }
    p->misses++;
    PyObject *kst = PyTuple_New(p->nstatic);
    if (kst == NULL) return NULL;
    for (int j = 0; j < p->nstatic; j++) PyTuple_SET_ITEM(kst, j, Py_NewRef(args[p->nin + j]));
    PyObject *plan = PyObject_Vectorcall(p->planner, args, (size_t)(p->nin + p->nstatic), NULL);
    if (plan == NULL) {
        Py_DECREF(kst);
        return NULL;
    }
    if (plan == NULL) return NULL;
    plan_entry *e = NULL; /* the next entry no call is running from */
    for (int t = 0; t < NCACHE && e == NULL; t++) {
        plan_entry *c = &p->cache[(p->next + t) % NCACHE];
        if (c->busy == 0) e = c;
    }
    if (e == NULL) { /* every plan in use (threads): this call is the Python op's */
        Py_DECREF(plan);
        Py_DECREF(kst);
        return NULL;
    }
    p->next = (int)(e - p->cache + 1) % NCACHE;
    entry_clear(e);
    if (plan != Py_None && entry_set_plan(e, plan) < 0) {
        Py_DECREF(plan);
        Py_DECREF(kst);
        entry_clear(e);
        return NULL;
    }
    Py_DECREF(plan);
    e->kstatics = kst;
    e->ka_shape = Py_NewRef(a->shape);
    e->ka_dtype = Py_NewRef(a->dtype);
    e->ka_sharding = Py_NewRef(a->sharding);
    if (b != NULL) {
        e->kb_shape = Py_NewRef(b->shape);
        e->kb_dtype = Py_NewRef(b->dtype);
        e->kb_sharding = Py_NewRef(b->sharding);
    }
    e->side = side;
    e->used = 1;
    return e->fast ? e : NULL;
}

/* The n live buffers of Array x's blocks on the plan's devices; 0, or 1 when x does not fit
 * (the Python op decides). */
static int operand_buffers(const ct_py_array *x, const plan_entry *e, ct_py_buffer **out) {
    PyObject *bl = x->blocks;
    if (bl == NULL || !PyList_CheckExact(bl) || PyList_GET_SIZE(bl) != e->nblk) return 1;
    for (int i = 0; i < e->nblk; i++) {
        PyObject *t = PyList_GET_ITEM(bl, i);
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 4) return 1;
        PyObject *b = PyTuple_GET_ITEM(t, 1);
        if (!Py_IS_TYPE(b, &ct_py_BufferType)) return 1;
        ct_py_buffer *buf = (ct_py_buffer *)b;
        if (buf->deleted || buf->dev != e->cdev[i]) return 1;
        out[i] = buf;
    }
    return 0;
}

static int64_t nelem(const ct_py_buffer *b) { return (int64_t)(b->nbytes / ct_dtype_size(b->dtype)); }

/* The kernels of one block (alpha, beta: K_SCALAR's constants; K_MATMUL: alpha unused, the
 * precision code in `prec`). */
static ct_status run_block(const plan_entry *e, int i, ct_py_buffer *x, ct_py_buffer *y,
                           ct_py_buffer *o, float alpha, float beta, int prec) {
    ct_device *dev = e->cdev[i];
    int64_t sa[CT_MAX_NDIM], sb[CT_MAX_NDIM];
    ct_status st;
    switch (e->kind) {
    case K_UNARY:
    case K_SCALAR:
        return ct_op_unary(dev, e->op == S_DIV_L && e->kind == K_SCALAR ? CT_UN_RDIV :
                                e->kind == K_SCALAR ? CT_UN_AFFINE : e->op,
                           alpha, beta, nelem(o), x->data, o->data);
    case K_BINARY:
    case K_EWISE:
        st = ct_broadcast_strides(o->ndim, o->shape, x->ndim, x->shape, sa);
        if (e->kind == K_EWISE && y == NULL) /* a unary typed op (invert): b reads a */
            return st != CT_OK ? st : ct_op_ewise(dev, e->op, (int)x->dtype, o->ndim, o->shape,
                                                  o->data, x->data, sa, NULL, NULL);
        if (st == CT_OK) st = ct_broadcast_strides(o->ndim, o->shape, y->ndim, y->shape, sb);
        if (st != CT_OK) return st;
        if (e->kind == K_BINARY)
            return ct_op_binary(dev, e->op, o->ndim, o->shape, o->data, x->data, sa, y->data, sb);
        return ct_op_ewise(dev, e->op, (int)x->dtype, o->ndim, o->shape, o->data, x->data, sa,
                           y->data, sb);
    case K_REDUCE:
        if (e->red_mask == 0)
            return ct_op_unary(dev, CT_UN_AFFINE, 1.0f, 0.0f, nelem(o), x->data, o->data);
        return ct_op_reduce(dev, e->op, x->ndim, x->shape, e->red_mask, x->data, o->data);
    case K_COPY: { /* a reshape: the same elements in the same order */
        int64_t nbytes = (int64_t)o->nbytes, one = 1;
        return dev->backend->copy_block(dev, dev, 1, &nbytes, 1, o->data, &one, x->data, &one);
    }
    case K_BCAST: /* max(v, v) is v, bit for bit (ct_ops_math.h, ct_ewise_math.h): with x
                   * broadcast on both sides the kernel is a broadcasting copy */
        st = ct_broadcast_strides(o->ndim, o->shape, x->ndim, x->shape, sa);
        if (st != CT_OK) return st;
        if (x->dtype == CT_F32)
            return ct_op_binary(dev, CT_BIN_MAX, o->ndim, o->shape, o->data, x->data, sa, x->data, sa);
        return ct_op_ewise(dev, CT_EW_MAX, (int)x->dtype, o->ndim, o->shape, o->data, x->data, sa,
                           x->data, sa);
    case K_CONVERT:
        return ct_op_convert(dev, nelem(x), (int)x->dtype, x->data, e->out_dt, o->data);
    case K_UNARY16:
        return ct_op_unary_typed(dev, e->op, alpha, beta, nelem(o), (int)o->dtype, x->data, o->data);
    case K_TRANSPOSE: {
        int perm[CT_MAX_NDIM];
        for (int d = 0; d < x->ndim; d++) perm[d] = (int)((e->mnk[0] >> (4 * d)) & 15);
        return ct_op_transpose(dev, x->ndim, x->shape, perm, ct_dtype_size(x->dtype), x->data,
                               o->data);
    }
    case K_MATMUL: { /* op: bit 0 transposes the stored a (k x m), bit 1 the stored b (n x k) */
        const int64_t m = e->mnk[0], n = e->mnk[1], k = e->mnk[2];
        const int ta = e->op & 1, tb = (e->op >> 1) & 1;
        return ct_op_gemm(dev, ta, tb, m, n, k, 1.0f, x->data, ta ? m : k, y->data, tb ? k : n,
                          0.0f, o->data, n, prec);
    }
    }
    return ct_set_error(CT_EINVAL, "dispatch: unknown plan kind");
}

/* The kernels of every block, then the all-reduces. */
static ct_status run_plan(const plan_entry *e, ct_py_buffer **xs, ct_py_buffer **ys,
                          ct_py_buffer **os, float alpha, float beta, int prec) {
    ct_status st = CT_OK;
    for (int i = 0; i < e->nblk && st == CT_OK; i++) {
        const int r = e->rep_of[i];
        if (r >= 0 && os[r]->nbytes == os[i]->nbytes) /* a replica: the same bits, copied */
            memcpy(os[i]->data, os[r]->data, os[i]->nbytes);
        else
            st = run_block(e, i, xs[i], ys != NULL ? ys[i] : NULL, os[i], alpha, beta, prec);
    }
    for (int g = 0; g < e->ngroups && st == CT_OK; g++) {
        ct_device *devs[MAXB];
        float *bufs[MAXB];
        int n = 0;
        for (int k = e->gstart[g]; k < e->gstart[g + 1]; k++, n++) {
            devs[n] = os[e->gpos[k]]->dev;
            bufs[n] = os[e->gpos[k]]->data;
        }
        if (n > 1) st = ct_op_allreduce(devs, bufs, n, e->out_elems, e->red_op);
    }
    return st;
}

/* The affine (or reciprocal) constants of `a (op) s` / `s (op) a`, as the Python op computes
 * them (in double, then rounded to float); 1 when this value takes the Python op's other
 * path (a product with 0, a quotient by inf), -1 on error. */
static int scalar_consts(int rule, PyObject *s, float *alpha, float *beta) {
    double v = PyFloat_AsDouble(s);
    if (v == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 1; /* the Python op raises its own error */
    }
    switch (rule) {
    case S_ADD: *alpha = 1.0f; *beta = (float)v; return 0;
    case S_SUB_R: *alpha = 1.0f; *beta = (float)(-v); return 0;
    case S_SUB_L: *alpha = -1.0f; *beta = (float)v; return 0;
    case S_MUL:
        if (v == 0.0) return 1;
        *alpha = (float)v;
        *beta = -0.0f;
        return 0;
    case S_DIV_R: {
        double t = v != 0.0 ? 1.0 / v : copysign(INFINITY, v);
        if (t == 0.0) return 1;
        *alpha = (float)t;
        *beta = -0.0f;
        return 0;
    }
    case S_DIV_L: *alpha = (float)v; *beta = 0.0f; return 0;
    }
    return 1;
}

/* A typed elementwise op's Python scalar operand, converted as the Python op converts it
 * (jax's weak types): beside a float32 Array a float (rounded to nearest) or an int of at
 * most 2^24 in magnitude (exact); beside an int32 Array an int in its range. 1 (no
 * exception) for any other scalar or dtype: the Python op runs (it promotes, wraps or
 * raises). */
typedef union {
    float f;
    int32_t i;
} ew_scalar;

static int ew_scalar_value(PyObject *s, ct_dtype dt, ew_scalar *out) {
    if (PyFloat_CheckExact(s)) {
        if (dt != CT_F32) return 1;
        out->f = (float)PyFloat_AS_DOUBLE(s);
        return 0;
    }
    if (!PyLong_CheckExact(s)) return 1;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(s, &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 1;
    }
    if (dt == CT_F32 && v >= -(1LL << 24) && v <= (1LL << 24)) {
        out->f = (float)v;
        return 0;
    }
    if (dt == CT_I32 && v >= INT32_MIN && v <= INT32_MAX) {
        out->i = (int32_t)v;
        return 0;
    }
    return 1;
}

/* The vjp of a node the C path records: calling it with the output's cotangent g runs the
 * primitive's tape rule, rule(g, out, *operands). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *rule, *out, *args; /* args: the call's operands (Arrays and scalars) */
} node_vjp;

static PyObject *node_vjp_call(PyObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    node_vjp *v = (node_vjp *)self;
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 1)
        return PyErr_Format(PyExc_TypeError, "a tape node's vjp takes one cotangent");
    PyObject *call[2 + 2 + MAXSTATIC];
    const Py_ssize_t n = PyTuple_GET_SIZE(v->args);
    call[0] = args[0];
    call[1] = v->out;
    for (Py_ssize_t i = 0; i < n; i++) call[2 + i] = PyTuple_GET_ITEM(v->args, i);
    return PyObject_Vectorcall(v->rule, call, (size_t)(2 + n), NULL);
}

static int node_vjp_traverse(node_vjp *v, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(v));
    Py_VISIT(v->rule);
    Py_VISIT(v->out);
    Py_VISIT(v->args);
    return 0;
}

static int node_vjp_clear(node_vjp *v) {
    Py_CLEAR(v->rule);
    Py_CLEAR(v->out);
    Py_CLEAR(v->args);
    return 0;
}

static void node_vjp_dealloc(node_vjp *v) {
    PyObject_GC_UnTrack(v);
    node_vjp_clear(v);
    PyTypeObject *tp = Py_TYPE(v);
    tp->tp_free((PyObject *)v);
    Py_DECREF(tp);
}

static PyMemberDef node_vjp_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(node_vjp, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot node_vjp_slots[] = {
    {Py_tp_dealloc, node_vjp_dealloc},
    {Py_tp_traverse, node_vjp_traverse},
    {Py_tp_clear, node_vjp_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, node_vjp_members},
    {0, NULL},
};

static PyType_Spec node_vjp_spec = {
    .name = "ctrainstate._C.NodeVjp",
    .basicsize = sizeof(node_vjp),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = node_vjp_slots,
};

/* --- derivative programs ----------------------------------------------------------------
 * A primitive's tape rule as data: VjpProgram(cases, rule, unbroadcast, flags) is called as the
 * rule is, (g, out, *operands), and runs, for the operands' case (0: all Arrays; 1: an Array
 * and a Python scalar; 2: a scalar and an Array), that case's program — or `rule` (Python)
 * when the case has none, when a tape records on this thread (a nested differentiation:
 * the rule decides what it records), or when a flag's condition fails. A program is
 * (steps, outs): registers 0 = g, 1 = out, 2 and 3 = the operands (None for a one-operand
 * primitive; a call with static arguments takes the rule); each
 * step (f, arg, ...) calls f on registers (ints) and constants (floats) and appends the result
 * as the next register; outs names the register of each Array operand's cotangent, in order
 * (None: no cotangent). In case 0 a cotangent whose shape is not its operand's goes through
 * unbroadcast(cotangent, shape), as the Python rules do. The steps call the same primitives
 * in the same order as the Python rule, so both give the same bits. */
enum { VP_MAXREG = 12, VP_FLAG_2D = 1 /* every Array operand has rank 2 */,
       VP_FLAG_SUM = 2 /* the rule of a sum (vp_sum): no programs */ };

/* The primitives the backward pass's C rules call (vjp_register): sum, reshape and
 * _broadcast_like of ctrainstate._src.ops.ops, or NULL before registration (the Python rules
 * run). */
static PyObject *bw_sum, *bw_reshape, *bw_bcast_like;
static PyObject *call_notape(PyObject *f, PyObject *const *args, size_t nargs);

/* _unbroadcast(g, shape) of ops.py (its caller knows g's shape is not `shape`): g summed over
 * its leading dimensions and those where `shape` has 1 and g not, by the sum primitive, then
 * reshaped to `shape` if the sum's shape is not it: the same primitive calls, so the same
 * bits. `ub` (the Python function) takes shapes that are not tuples of ints. */
static PyObject *unbroadcast_c(PyObject *g, PyObject *shape, PyObject *ub) {
    PyObject *gshape = ((ct_py_array *)g)->shape;
    const Py_ssize_t gn = PyTuple_CheckExact(gshape) ? PyTuple_GET_SIZE(gshape) : -1;
    const Py_ssize_t n = PyTuple_CheckExact(shape) ? PyTuple_GET_SIZE(shape) : -1;
    int ok = bw_sum != NULL && bw_reshape != NULL && gn >= 0 && n >= 0 && n <= gn;
    Py_ssize_t nax = gn - n;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *s = PyTuple_GET_ITEM(shape, i), *t = PyTuple_GET_ITEM(gshape, gn - n + i);
        ok = PyLong_CheckExact(s) && PyLong_CheckExact(t);
        if (ok) {
            int o1, o2;
            const long sv = PyLong_AsLongAndOverflow(s, &o1), tv = PyLong_AsLongAndOverflow(t, &o2);
            ok = !o1 && !o2 && !(sv == -1 && PyErr_Occurred()) && !(tv == -1 && PyErr_Occurred());
            nax += ok && sv == 1 && tv != 1;
        }
    }
    if (!ok) {
        PyErr_Clear();
        PyObject *args[2] = {g, shape};
        return PyObject_Vectorcall(ub, args, 2, NULL);
    }
    PyObject *axes = PyTuple_New(nax);
    if (axes == NULL) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t d = 0; d < gn; d++) {
        int take = d < gn - n;
        if (!take) {
            const long sv = PyLong_AsLong(PyTuple_GET_ITEM(shape, d - (gn - n)));
            const long tv = PyLong_AsLong(PyTuple_GET_ITEM(gshape, d));
            take = sv == 1 && tv != 1;
        }
        if (take) {
            PyObject *v = PyLong_FromSsize_t(d);
            if (v == NULL) {
                Py_DECREF(axes);
                return NULL;
            }
            PyTuple_SET_ITEM(axes, k++, v);
        }
    }
    PyObject *args[3] = {g, axes, Py_False};
    PyObject *r = call_notape(bw_sum, args, 3);
    Py_DECREF(axes);
    if (r == NULL) return NULL;
    PyTypeObject *at = ct_py_array_type();
    PyObject *rs = at != NULL && Py_IS_TYPE(r, at) ? Py_NewRef(((ct_py_array *)r)->shape)
                                                   : PyObject_GetAttrString(r, "shape");
    const int eq = rs != NULL ? PyObject_RichCompareBool(rs, shape, Py_EQ) : -1;
    Py_XDECREF(rs);
    if (eq != 0) {
        if (eq < 0) Py_CLEAR(r);
        return r;
    }
    PyObject *rargs[2] = {r, shape};
    PyObject *out = call_notape(bw_reshape, rargs, 2);
    Py_DECREF(r);
    return out;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *cases, *rule, *unbroadcast;
    int flags;
} vjp_program;

static PyTypeObject *vjp_program_type;

/* want: bit j set for each output j the caller uses (~0u: all); the others are None, and the
 * steps only they need do not run. */
static PyObject *vp_run(PyObject *prog, PyObject **regs, int nreg, PyObject *const *ops, int nops,
                        int unbroadcast, PyObject *ub, unsigned want) {
    PyObject *steps = PyTuple_GET_ITEM(prog, 0), *outs = PyTuple_GET_ITEM(prog, 1);
    PyObject *made[VP_MAXREG];
    int nmade = 0, n = nreg;
    PyObject *res = NULL;
    unsigned run = ~0u; /* the steps to run: bit k */
    if (want != ~0u) {  /* the registers the wanted outputs read, back through the steps */
        unsigned need = 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(outs) && j < 32; j++) {
            PyObject *o = PyTuple_GET_ITEM(outs, j);
            const long r = (want >> j & 1u) && o != Py_None ? PyLong_AsLong(o) : -1;
            if (r >= 0 && r < VP_MAXREG) need |= 1u << r;
        }
        run = 0;
        for (Py_ssize_t k = PyTuple_GET_SIZE(steps) - 1; k >= 0; k--) {
            if (!(need >> (nreg + k) & 1u)) continue;
            run |= 1u << k;
            PyObject *st = PyTuple_GET_ITEM(steps, k);
            for (Py_ssize_t j = 1; j < PyTuple_GET_SIZE(st); j++) {
                PyObject *a = PyTuple_GET_ITEM(st, j);
                const long r = PyLong_CheckExact(a) ? PyLong_AsLong(a) : -1;
                if (r >= 0 && r < VP_MAXREG) need |= 1u << r;
            }
        }
        PyErr_Clear(); /* (registers are small ints: vp_check_program) */
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(steps); k++) {
        if (!(run >> k & 1u)) { /* no wanted output reads it */
            regs[n++] = Py_None;
            continue;
        }
        PyObject *st = PyTuple_GET_ITEM(steps, k);
        PyObject *call[4];
        const Py_ssize_t na = PyTuple_GET_SIZE(st) - 1;
        for (Py_ssize_t j = 0; j < na; j++) {
            PyObject *a = PyTuple_GET_ITEM(st, j + 1);
            if (PyLong_CheckExact(a)) {
                long r = PyLong_AsLong(a);
                if (r < 0 || r >= n) {
                    PyErr_SetString(PyExc_ValueError, "VjpProgram: a register out of range");
                    goto done;
                }
                call[j] = regs[r];
            } else {
                call[j] = a;
            }
        }
        PyObject *v = call_notape(PyTuple_GET_ITEM(st, 0), call, (size_t)na);
        if (v == NULL) goto done;
        regs[n++] = made[nmade++] = v;
    }
    res = PyTuple_New(PyTuple_GET_SIZE(outs));
    if (res == NULL) goto done;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(outs); j++) {
        PyObject *o = PyTuple_GET_ITEM(outs, j), *v = Py_None;
        if (o != Py_None && (j >= 32 || (want >> j & 1u))) {
            long r = PyLong_AsLong(o);
            if (r < 0 || r >= n) {
                PyErr_SetString(PyExc_ValueError, "VjpProgram: an output register out of range");
                Py_CLEAR(res);
                goto done;
            }
            v = regs[r];
        }
        Py_INCREF(v);
        if (unbroadcast && v != Py_None && j < nops) { /* the cotangent of operand j */
            PyTypeObject *at = ct_py_array_type();
            if (at != NULL && Py_IS_TYPE(v, at) && Py_IS_TYPE(ops[j], at)) {
                PyObject *want = ((ct_py_array *)ops[j])->shape;
                int eq = PyObject_RichCompareBool(((ct_py_array *)v)->shape, want, Py_EQ);
                if (eq == 0) Py_SETREF(v, unbroadcast_c(v, want, ub));
                if (eq < 0 || v == NULL) {
                    Py_XDECREF(v);
                    Py_CLEAR(res);
                    goto done;
                }
            }
        }
        PyTuple_SET_ITEM(res, j, v);
    }
done:
    for (int i = 0; i < nmade; i++) Py_DECREF(made[i]);
    return res;
}

/* VP_FLAG_SUM: _vjp_sum(g, out, x, axis=None, ...) of ops.py in C, for an Array x and an axis
 * that is None, an int or a tuple or list of ints (in range, no repeats): g (when any axis is
 * summed) reshaped to x's shape with 1 for each summed dimension (the reshape primitive), then
 * broadcast like x (_broadcast_like: x's shape and sharding). The Python rule runs for
 * anything else (it raises the errors), under a recording tape, or before vjp_register. */
static PyObject *vp_sum(vjp_program *vp, PyObject *const *args, size_t nargsf, int notape) {
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    PyObject *xs = Py_IS_TYPE(args[2], at) ? ((ct_py_array *)args[2])->shape : NULL;
    const Py_ssize_t nd = xs != NULL && PyTuple_CheckExact(xs) ? PyTuple_GET_SIZE(xs) : -1;
    int use_rule = bw_reshape == NULL || bw_bcast_like == NULL || nd < 0 || nd > 63;
    uint64_t mask = 0;
    PyObject *axis = n > 3 ? args[3] : Py_None;
    if (!use_rule && axis == Py_None) {
        mask = (((uint64_t)1) << nd) - 1;
    } else if (!use_rule) {
        const int one = PyLong_CheckExact(axis);
        if (!one && !PyTuple_CheckExact(axis) && !PyList_CheckExact(axis)) use_rule = 1;
        const Py_ssize_t na = use_rule ? 0 : one ? 1 : PySequence_Fast_GET_SIZE(axis);
        for (Py_ssize_t k = 0; k < na && !use_rule; k++) {
            PyObject *a = one ? axis : PySequence_Fast_GET_ITEM(axis, k);
            int over = 0;
            long v = PyLong_CheckExact(a) ? PyLong_AsLongAndOverflow(a, &over) : 0;
            if (!PyLong_CheckExact(a) || over || (v == -1 && PyErr_Occurred()) || v < -nd || v >= nd) {
                PyErr_Clear();
                use_rule = 1;
                break;
            }
            if (v < 0) v += nd;
            if (mask & ((uint64_t)1 << v)) use_rule = 1; /* a repeated axis: the rule raises */
            mask |= (uint64_t)1 << v;
        }
    }
    if (!use_rule && !notape) { /* a tape recording on this thread: the rule decides */
        PyObject *tape;
        int tr = top_tape(&tape);
        if (tr < 0) return NULL;
        use_rule = tr != 0 || tape != NULL;
        Py_XDECREF(tape);
    }
    if (use_rule) return PyObject_Vectorcall(vp->rule, args, nargsf, NULL);
    if (mask == 0) return PyTuple_Pack(1, args[0]); /* (a scalar's sum, or over no axis) */
    PyObject *keep = PyTuple_New(nd);
    if (keep == NULL) return NULL;
    for (Py_ssize_t d = 0; d < nd; d++) {
        PyObject *v = mask & ((uint64_t)1 << d) ? PyLong_FromLong(1) : Py_NewRef(PyTuple_GET_ITEM(xs, d));
        if (v == NULL) {
            Py_DECREF(keep);
            return NULL;
        }
        PyTuple_SET_ITEM(keep, d, v);
    }
    PyObject *rargs[2] = {args[0], keep};
    PyObject *r = call_notape(bw_reshape, rargs, 2);
    Py_DECREF(keep);
    if (r == NULL) return NULL;
    PyObject *bargs[2] = {r, args[2]};
    PyObject *b = call_notape(bw_bcast_like, bargs, 2);
    Py_DECREF(r);
    if (b == NULL) return NULL;
    PyObject *res = PyTuple_New(1);
    if (res == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    PyTuple_SET_ITEM(res, 0, b);
    return res;
}

/* The call of a derivative program; `notape`: the caller knows no tape records on this
 * thread (call_notape's condition). */
static PyObject *vp_invoke(vjp_program *vp, PyObject *const *args, size_t nargsf, int notape,
                           unsigned want) {
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n < 3) return PyErr_Format(PyExc_TypeError, "a derivative program takes (g, out, *operands)");
    if (vp->flags & VP_FLAG_SUM) return vp_sum(vp, args, nargsf, notape);
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    /* the case: which operands are Arrays (operands: args[2], and args[3] for two) */
    const int nops = (int)PyTuple_GET_SIZE(vp->cases) > 1 ? 2 : 1;
    if (n < 2 + nops) return PyErr_Format(PyExc_TypeError, "a derivative program: too few operands");
    int c = 0;
    if (nops == 2) {
        const int a_arr = Py_IS_TYPE(args[2], at), b_arr = Py_IS_TYPE(args[3], at);
        c = a_arr && b_arr ? 0 : a_arr ? 1 : b_arr ? 2 : -1;
    } else if (!Py_IS_TYPE(args[2], at)) {
        c = -1;
    }
    PyObject *prog = c >= 0 && c < PyTuple_GET_SIZE(vp->cases) ? PyTuple_GET_ITEM(vp->cases, c)
                                                              : Py_None;
    int use_rule = prog == Py_None;
    if (!use_rule && (vp->flags & VP_FLAG_2D)) {
        for (int j = 0; j < nops && !use_rule; j++) {
            PyObject *x = args[2 + j];
            use_rule = Py_IS_TYPE(x, at) &&
                       (!PyTuple_Check(((ct_py_array *)x)->shape) ||
                        PyTuple_GET_SIZE(((ct_py_array *)x)->shape) != 2);
        }
    }
    if (!use_rule && !notape) { /* a tape recording on this thread: the rule decides */
        PyObject *tape;
        int tr = top_tape(&tape);
        if (tr < 0) return NULL;
        use_rule = tr != 0 || tape != NULL;
        Py_XDECREF(tape);
    }
    if (use_rule || n > 4) return PyObject_Vectorcall(vp->rule, args, nargsf, NULL);
    PyObject *regs[VP_MAXREG];
    for (Py_ssize_t i = 0; i < 4; i++) regs[i] = i < n ? args[i] : Py_None; /* steps from 4 */
    /* the Array operands, in order, as the node's inputs are */
    PyObject *arrs[2];
    int narr = 0;
    for (int j = 0; j < nops; j++)
        if (Py_IS_TYPE(args[2 + j], at)) arrs[narr++] = args[2 + j];
    return vp_run(prog, regs, 4, arrs, narr, c == 0 && nops == 2, vp->unbroadcast, want);
}

static PyObject *vp_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames != NULL)
        return PyErr_Format(PyExc_TypeError, "a derivative program takes (g, out, *operands)");
    return vp_invoke((vjp_program *)self, args, nargsf, 0, ~0u);
}

static int vp_check_program(PyObject *prog) {
    if (prog == Py_None) return 0;
    if (!PyTuple_Check(prog) || PyTuple_GET_SIZE(prog) != 2 ||
        !PyTuple_Check(PyTuple_GET_ITEM(prog, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(prog, 1)))
        goto bad;
    PyObject *steps = PyTuple_GET_ITEM(prog, 0);
    if (PyTuple_GET_SIZE(steps) > VP_MAXREG - 4) goto bad;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(steps); k++) {
        PyObject *st = PyTuple_GET_ITEM(steps, k);
        if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) < 1 || PyTuple_GET_SIZE(st) > 5 ||
            !PyCallable_Check(PyTuple_GET_ITEM(st, 0)))
            goto bad;
        for (Py_ssize_t j = 1; j < PyTuple_GET_SIZE(st); j++) {
            PyObject *a = PyTuple_GET_ITEM(st, j);
            if (!PyLong_CheckExact(a) && !PyFloat_CheckExact(a)) goto bad;
        }
    }
    PyObject *outs = PyTuple_GET_ITEM(prog, 1);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(outs); j++) {
        PyObject *o = PyTuple_GET_ITEM(outs, j);
        if (o != Py_None && !PyLong_CheckExact(o)) goto bad;
    }
    return 0;
bad:
    PyErr_SetString(PyExc_TypeError,
                    "VjpProgram: a program is ((step, ...), (out register or None, ...)), a step "
                    "(callable, register int or float constant, ...) with at most 4 arguments");
    return -1;
}

static PyObject *vp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *cases, *rule, *ub;
    int flags = 0;
    static char *kw[] = {"cases", "rule", "unbroadcast", "flags", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|i:VjpProgram", kw, &cases, &rule, &ub, &flags))
        return NULL;
    if (!PyTuple_Check(cases) || PyTuple_GET_SIZE(cases) < 1 || PyTuple_GET_SIZE(cases) > 3)
        return PyErr_Format(PyExc_TypeError, "VjpProgram: cases is a tuple of 1 (one operand) or "
                                             "3 (two operands: arrays, array-scalar, scalar-array)");
    if (PyTuple_GET_SIZE(cases) == 2)
        return PyErr_Format(PyExc_TypeError, "VjpProgram: two cases (give 1 or 3)");
    if (!PyCallable_Check(rule) || !PyCallable_Check(ub))
        return PyErr_Format(PyExc_TypeError, "VjpProgram: rule and unbroadcast must be callable");
    if (flags & ~(VP_FLAG_2D | VP_FLAG_SUM))
        return PyErr_Format(PyExc_ValueError, "VjpProgram: unknown flags");
    if ((flags & VP_FLAG_SUM) && (PyTuple_GET_SIZE(cases) != 1 || PyTuple_GET_ITEM(cases, 0) != Py_None))
        return PyErr_Format(PyExc_ValueError, "VjpProgram: a sum's rule (flag 2) has cases (None,)");
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(cases); i++)
        if (vp_check_program(PyTuple_GET_ITEM(cases, i)) < 0) return NULL;
    vjp_program *vp = (vjp_program *)type->tp_alloc(type, 0);
    if (vp == NULL) return NULL;
    vp->vectorcall = vp_call;
    vp->cases = Py_NewRef(cases);
    vp->rule = Py_NewRef(rule);
    vp->unbroadcast = Py_NewRef(ub);
    vp->flags = flags;
    return (PyObject *)vp;
}

static int vp_traverse(vjp_program *v, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(v));
    Py_VISIT(v->cases);
    Py_VISIT(v->rule);
    Py_VISIT(v->unbroadcast);
    return 0;
}

static int vp_clear(vjp_program *v) {
    Py_CLEAR(v->cases);
    Py_CLEAR(v->rule);
    Py_CLEAR(v->unbroadcast);
    return 0;
}

static void vp_dealloc(vjp_program *v) {
    PyObject_GC_UnTrack(v);
    vp_clear(v);
    PyTypeObject *tp = Py_TYPE(v);
    tp->tp_free((PyObject *)v);
    Py_DECREF(tp);
}

static PyMemberDef vp_members[] = {
    {"cases", T_OBJECT, offsetof(vjp_program, cases), READONLY, "The programs, per operand case."},
    {"rule", T_OBJECT, offsetof(vjp_program, rule), READONLY, "The Python rule it stands for."},
    {"flags", T_INT, offsetof(vjp_program, flags), READONLY,
     "1: every Array operand of rank 2; 2: a sum's rule, in C (no programs)."},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(vjp_program, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot vp_slots[] = {
    {Py_tp_new, vp_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, vp_traverse},
    {Py_tp_clear, vp_clear},
    {Py_tp_dealloc, vp_dealloc},
    {Py_tp_members, vp_members},
    {Py_tp_doc, "VjpProgram(cases, rule, unbroadcast, flags=0)\n--\n\n"
                "A primitive's tape rule as a program of primitive calls, run in C: see "
                "csrc/python/py_dispatch.c."},
    {0, NULL},
};

static PyType_Spec vp_spec = {
    .name = "ctrainstate._C.VjpProgram",
    .basicsize = sizeof(vjp_program),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = vp_slots,
};

/* A plain _Tape's containers, read from its slots (all held: tape_view_clear), where the C
 * path may record on it: a tape of no enclosing differentiated call (an op of a nested
 * value_and_grad is checked by the Python op), its `tracked` a set and `keep` and `nodes`
 * lists. 1 yes, 0 no, -1 error. `tape` is set when the view holds them. */
typedef struct {
    PyObject *tape, *tracked, *keep, *nodes;
} tape_view;

/* The offsets of _Tape's slots (its __slots__' member descriptors, found by dispatch_register),
 * in the order outer, tracked, keep, nodes. */
enum { TS_OUTER, TS_TRACKED, TS_KEEP, TS_NODES, TS_COUNT };
static Py_ssize_t tape_slot_offset[TS_COUNT];

static PyObject *tape_slot(PyObject *tape, int s) {
    return *(PyObject **)((char *)tape + tape_slot_offset[s]);
}

static int tape_view_get(PyObject *tape, tape_view *tv) {
    tv->tape = tv->tracked = tv->keep = tv->nodes = NULL;
    if ((PyObject *)Py_TYPE(tape) != tape_type) return 0;
    PyObject *outer = tape_slot(tape, TS_OUTER), *tracked = tape_slot(tape, TS_TRACKED),
             *keep = tape_slot(tape, TS_KEEP), *nodes = tape_slot(tape, TS_NODES);
    /* (a slot never set is NULL) */
    if (outer == NULL || !PyTuple_CheckExact(outer) || PyTuple_GET_SIZE(outer) != 0 ||
        tracked == NULL || !PySet_Check(tracked) || keep == NULL || !PyList_Check(keep) ||
        nodes == NULL || !PyList_Check(nodes))
        return 0;
    /* (held: a planner's Python code runs before record reads them) */
    tv->tape = Py_NewRef(tape);
    tv->tracked = Py_NewRef(tracked);
    tv->keep = Py_NewRef(keep);
    tv->nodes = Py_NewRef(nodes);
    return 1;
}

static void tape_view_clear(tape_view *tv) {
    Py_CLEAR(tv->tape);
    Py_CLEAR(tv->tracked);
    Py_CLEAR(tv->keep);
    Py_CLEAR(tv->nodes);
}

/* 1 if id(x) is in the tape's tracked set, 0 if not, -1 on error. */
static int is_tracked(PyObject *tracked, PyObject *x) {
    PyObject *id = ct_py_idkey(x);
    if (id == NULL) return -1;
    int r = PySet_Contains(tracked, id);
    Py_DECREF(id);
    return r;
}

/* As _ops._record: the node (out, inputs, vjp) on the tape (tv) and out tracked. */
static int record(prim *p, PyObject *rule, const tape_view *tv, PyObject *out, PyObject *const *args,
                  PyObject *a, PyObject *b) {
    PyObject *id = NULL, *inputs = NULL, *node = NULL;
    node_vjp *v = NULL;
    int rc = -1;
    id = ct_py_idkey(out);
    inputs = b != NULL ? PyTuple_Pack(2, a, b) : PyTuple_Pack(1, a);
    v = PyObject_GC_New(node_vjp, node_vjp_type); /* (it takes a reference to the type) */
    if (v != NULL) v->rule = v->out = v->args = NULL;
    if (id == NULL || inputs == NULL || v == NULL) goto out;
    v->vectorcall = node_vjp_call;
    v->rule = Py_NewRef(rule);
    v->out = Py_NewRef(out);
    v->args = PyTuple_New(p->nin + p->nstatic);
    if (v->args == NULL) goto out;
    for (int i = 0; i < p->nin + p->nstatic; i++) PyTuple_SET_ITEM(v->args, i, Py_NewRef(args[i]));
    PyObject_GC_Track(v);
    node = PyTuple_Pack(3, out, inputs, (PyObject *)v);
    if (node == NULL || PySet_Add(tv->tracked, id) < 0 || PyList_Append(tv->keep, out) < 0 ||
        PyList_Append(tv->nodes, node) < 0)
        goto out;
    rc = 0;
out:
    Py_XDECREF(id);
    Py_XDECREF(inputs);
    Py_XDECREF((PyObject *)v);
    Py_XDECREF(node);
    return rc;
}

static PyObject *fast_run(prim *p, ct_py_array *a, ct_py_array *b, PyObject *scalar, int side,
                          PyObject *const *args, int track);
typedef struct program program;
/* A CUDA graph capture is under way (segment_capture): kernels keep the GIL, so that no other
 * thread queues work on a capturing stream (it would land in the graph). */
static int capturing;
static program *recorder; /* the program recording on recorder_thread, or NULL */
static int trace_note(prim *p, const plan_entry *e, ct_py_array *a, ct_py_array *b,
                      PyObject *scalar, PyObject *res);

/* Whether Array x (a result of the C path) holds bfloat16 or float16 blocks. */
static int array_is16(PyObject *x) {
    PyObject *bl = ((ct_py_array *)x)->blocks;
    if (bl == NULL || !PyList_CheckExact(bl) || PyList_GET_SIZE(bl) == 0) return 0;
    PyObject *t = PyList_GET_ITEM(bl, 0);
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 4) return 0;
    PyObject *b = PyTuple_GET_ITEM(t, 1);
    if (!Py_IS_TYPE(b, &ct_py_BufferType)) return 0;
    const ct_dtype dt = ((ct_py_buffer *)b)->dtype;
    return dt == CT_BF16 || dt == CT_F16;
}

/* The C path; NULL without an exception when the call is the Python op's. `notape`: the
 * caller knows no tape records on this thread (see call_notape), so top_tape is not read. */
static PyObject *fast_call(prim *p, PyObject *const *args, int notape) {
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) {
        PyErr_Clear();
        return NULL;
    }
    ct_py_array *a, *b = NULL;
    PyObject *scalar = NULL;
    int side = 0;
    if (p->nin == 1) {
        if (!Py_IS_TYPE(args[0], at)) return NULL;
        a = (ct_py_array *)args[0];
    } else if (Py_IS_TYPE(args[0], at)) {
        a = (ct_py_array *)args[0];
        if (Py_IS_TYPE(args[1], at)) b = (ct_py_array *)args[1];
        else if (is_scalar(args[1])) scalar = args[1], side = 1;
        else return NULL;
    } else if (Py_IS_TYPE(args[1], at) && is_scalar(args[0])) {
        a = (ct_py_array *)args[1];
        scalar = args[0];
        side = 2;
    } else {
        return NULL;
    }
    if (a->donated != Py_False || (b != NULL && b->donated != Py_False)) return NULL;
    PyObject *tape = NULL;
    int tr = notape || p->nondiff ? 0 : top_tape(&tape);
    if (tr != 0) {
        if (tr < 0) PyErr_Clear();
        return NULL;
    }
    /* with a tape recording: the C path records the node itself when the primitive has a
     * tape rule and the tape is a plain one; otherwise the Python op runs */
    int track = 0;
    tape_view tv = {NULL, NULL, NULL, NULL};
    if (tape != NULL) {
        int ok = p->vjp != NULL ? tape_view_get(tape, &tv) : 0;
        Py_DECREF(tape); /* (tv holds what record needs) */
        if (ok > 0) {
            track = is_tracked(tv.tracked, (PyObject *)a);
            if (track == 0 && b != NULL) track = is_tracked(tv.tracked, (PyObject *)b);
        } else {
            track = -1;
        }
        if (track <= 0) tape_view_clear(&tv); /* none tracked: nothing to record, as without a tape */
        if (track < 0) {
            PyErr_Clear();
            return NULL;
        }
    }
    if (track && p->vjp16 != NULL) track = 2; /* (a 16-bit call may record too) */
    PyObject *res = fast_run(p, a, b, scalar, side, args, track);
    if (res != NULL && tv.tape != NULL &&
        record(p, p->vjp16 != NULL && array_is16(res) ? p->vjp16 : p->vjp, &tv, res, args, (PyObject *)a,
               (PyObject *)b) < 0)
        Py_CLEAR(res);
    tape_view_clear(&tv);
    return res;
}

/* The plan and kernels of fast_call; NULL without an exception: the Python op's call. */
static PyObject *run_entry(plan_entry *e, ct_py_array *a, ct_py_array *b, PyObject *scalar,
                           int track);

/* A replayed step's operands and result in a program's arena (plan_memory): each operand's
 * block buffers (NULL: the Array's own), the result's (NULL: a new Array is made). */
typedef struct {
    ct_py_buffer **xa, **xb, **out;
} arena_io;

static PyObject *run_entry_in(plan_entry *e, ct_py_array *a, ct_py_array *b, PyObject *scalar,
                              int track, const arena_io *io);

static PyObject *fast_run(prim *p, ct_py_array *a, ct_py_array *b, PyObject *scalar, int side,
                          PyObject *const *args, int track) {
    plan_entry *e = lookup(p, a, b, side, args);
    if (e == NULL) return NULL; /* the planner's exception, if any, propagates */
    e->busy++;
    PyObject *res = run_entry(e, a, b, scalar, track);
    e->busy--;
    if (res != NULL && recorder != NULL && trace_note(p, e, a, b, scalar, res) < 0) Py_CLEAR(res);
    return res;
}

/* The call from plan e (held busy by the caller). */
static PyObject *run_entry(plan_entry *e, ct_py_array *a, ct_py_array *b, PyObject *scalar,
                           int track) {
    return run_entry_in(e, a, b, scalar, track, NULL);
}

/* run_entry, with operands or the result in an arena (io, or NULL): a result written there
 * returns None (a new reference), not an Array. */
static PyObject *run_entry_in(plan_entry *e, ct_py_array *a, ct_py_array *b, PyObject *scalar,
                              int track, const arena_io *io) {
    int has_b = b != NULL || (io != NULL && io->xb != NULL);
    /* integer and boolean ops record in Python; 16-bit float ones in C with the primitive's
     * vjp16 (track 2), else in Python */
    if (track && (e->kind == K_EWISE || e->kind == K_UNARY16) &&
        (track != 2 || (e->out_dt != CT_BF16 && e->out_dt != CT_F16)))
        return NULL;
    float alpha = 0.0f, beta = 0.0f;
    /* K_EWISE beside a Python scalar (`x > 0`): the scalar as a one-element host operand of
     * the Array's dtype, broadcast (CPU devices; not in a program being recorded, which
     * keeps no scalar: the Python op runs there) */
    ct_py_buffer sbuf;
    ew_scalar sval;
    const int ew_s = e->kind == K_EWISE && scalar != NULL;
    if (e->kind == K_SCALAR) {
        if (scalar == NULL) return NULL;
        int r = scalar_consts(e->op, scalar, &alpha, &beta);
        if (r != 0) return NULL; /* (an error stays set and propagates) */
    } else if (ew_s) {
        if (io != NULL || recorder != NULL || has_b || (e->side != 1 && e->side != 2)) return NULL;
    } else if (scalar != NULL ||
               (e->kind != K_BCAST &&
                (e->kind == K_BINARY || (e->kind == K_EWISE && e->op < CT_EW_NOT) ||
                 e->kind == K_MATMUL) != has_b)) {
        return NULL;
    }
    ct_py_buffer *xs[MAXB], *ys[MAXB], *os[MAXB];
    if (io != NULL && io->xa != NULL) memcpy(xs, io->xa, (size_t)e->nblk * sizeof *xs);
    else if (a == NULL || operand_buffers(a, e, xs) != 0) return NULL;
    if (io != NULL && io->xb != NULL) memcpy(ys, io->xb, (size_t)e->nblk * sizeof *ys);
    else if (b != NULL && operand_buffers(b, e, ys) != 0) return NULL;
    if (ew_s) {
        if (ew_scalar_value(scalar, xs[0]->dtype, &sval) != 0) return NULL;
        memset(&sbuf, 0, sizeof sbuf);
        sbuf.dtype = xs[0]->dtype;
        sbuf.data = &sval;
        sbuf.nbytes = ct_dtype_size(xs[0]->dtype);
        for (int i = 0; i < e->nblk; i++) {
            if (e->cdev[i]->platform != CT_PLATFORM_CPU) return NULL;
            if (e->side == 1) {
                ys[i] = &sbuf;
            } else {
                ys[i] = xs[i];
                xs[i] = &sbuf;
            }
        }
        has_b = 1;
    }
    int prec = 0;
    if (e->kind == K_MATMUL) { /* the product's precision: float32 only on this path */
        prec = current_precision();
        if (prec != CT_PREC_F32) {
            if (prec < 0) PyErr_Clear();
            return NULL;
        }
        for (int i = 0; i < e->nblk; i++)
            if (nelem(xs[i]) != e->mnk[0] * e->mnk[2] || nelem(ys[i]) != e->mnk[2] * e->mnk[1])
                return NULL;
    }
    for (int i = 0; i < e->nblk; i++) { /* the kernels' operand dtypes and sizes */
        if (e->kind == K_CONVERT) {
            if (nelem(xs[i]) != e->out_elems) return NULL;
        } else if (e->kind == K_COPY || e->kind == K_BCAST || e->kind == K_TRANSPOSE) {
            /* (K_BCAST's b: the key only) */
            if ((int)xs[i]->dtype != e->out_dt) return NULL;
            if ((e->kind == K_COPY || e->kind == K_TRANSPOSE) && nelem(xs[i]) != e->out_elems)
                return NULL;
            if (e->kind == K_TRANSPOSE && xs[i]->ndim != e->out_ndim) return NULL;
            if (e->kind == K_BCAST && xs[i]->dtype != CT_F32 &&
                !ct_ewise_supported(CT_EW_MAX, (int)xs[i]->dtype))
                return NULL;
        } else if (e->kind == K_EWISE) {
            if (has_b ? ys[i]->dtype != xs[i]->dtype : nelem(xs[i]) != e->out_elems) return NULL;
        } else if (e->kind == K_UNARY16) {
            if ((int)xs[i]->dtype != e->out_dt || nelem(xs[i]) != e->out_elems) return NULL;
        } else if (xs[i]->dtype != CT_F32 || (has_b && ys[i]->dtype != CT_F32)) {
            return NULL;
        }
        if ((e->kind == K_UNARY || e->kind == K_SCALAR) && nelem(xs[i]) != e->out_elems)
            return NULL;
    }
    int made = 0;
    PyObject *blocks = NULL;
    if (io != NULL && io->out != NULL) { /* (the arena's: nothing to allocate or release) */
        memcpy(os, io->out, (size_t)e->nblk * sizeof *os);
    } else {
        for (; made < e->nblk; made++) {
            os[made] = ct_py_buffer_alloc(e->cdev[made], e->out_ndim, e->out_sdims,
                                          (ct_dtype)e->out_dt);
            if (os[made] == NULL) break;
        }
        if (made < e->nblk) goto fail;
    }
    ct_status st;
    const int64_t work = e->out_elems * e->nblk * (e->kind == K_MATMUL ? e->mnk[2] : 1);
    if (work < CT_DISPATCH_GIL_ELEMS || capturing) {
        st = run_plan(e, xs, has_b ? ys : NULL, os, alpha, beta, prec);
    } else { /* pinned: another thread may drop or delete the operands meanwhile */
        for (int i = 0; i < e->nblk; i++) { /* (a scalar's host operand is this frame's) */
            if (xs[i] != &sbuf) ct_py_pin(xs[i]);
            if (has_b && ys[i] != &sbuf) ct_py_pin(ys[i]);
        }
        Py_BEGIN_ALLOW_THREADS
        st = run_plan(e, xs, has_b ? ys : NULL, os, alpha, beta, prec);
        Py_END_ALLOW_THREADS
        for (int i = 0; i < e->nblk; i++) {
            if (xs[i] != &sbuf) ct_py_unpin(xs[i]);
            if (has_b && ys[i] != &sbuf) ct_py_unpin(ys[i]);
        }
    }
    if (st != CT_OK) {
        ct_py_raise(st);
        goto fail;
    }
    if (io != NULL && io->out != NULL) return Py_NewRef(Py_None);
    blocks = PyList_New(e->nblk);
    if (blocks == NULL) goto fail;
    for (int i = 0; i < e->nblk; i++) {
        PyObject *t = PyTuple_New(4);
        if (t == NULL) goto fail;
        PyTuple_SET_ITEM(t, 0, Py_NewRef(e->bdev[i]));
        PyTuple_SET_ITEM(t, 1, (PyObject *)os[i]); /* the reference moves into the tuple */
        PyTuple_SET_ITEM(t, 2, Py_NewRef(e->bstart[i]));
        PyTuple_SET_ITEM(t, 3, Py_NewRef(e->brid[i]));
        os[i] = NULL;
        PyList_SET_ITEM(blocks, i, t);
    }
    return ct_py_array_new(Py_NewRef(e->out_shape), Py_NewRef(e->out_dtype),
                           Py_NewRef(e->out_sharding), blocks, Py_NewRef(e->out_shard_shape));
fail:
    Py_XDECREF(blocks);
    for (int i = 0; i < made; i++) Py_XDECREF(os[i]);
    return NULL;
}

/* Whether the keywords of a call are only those the primitive accepts with the value None
 * (their default: matmul's precision=None). */
static int none_keywords(const prim *p, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames == NULL) return 1;
    if (p->none_kw == NULL) return 0;
    const Py_ssize_t npos = PyVectorcall_NARGS(nargsf), nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (args[npos + i] != Py_None) return 0;
        int found = PySequence_Contains(p->none_kw, PyTuple_GET_ITEM(kwnames, i));
        if (found != 1) {
            if (found < 0) PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* A static argument the plans can key on: None, a bool, an int, a tuple of ints or a numpy dtype. */
static int static_value(PyObject *v) {
    if (v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyArray_DescrCheck(v)) return 1;
    if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) > 32) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v); i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(v, i))) return 0;
    return 1;
}

/* A list of at most 32 ints as the tuple of them (a new reference): a static given as a list
 * (`reshape(x, [16, 1])`, `sum(x, axis=[0])`, what Flax's norm layers pass) keys the plans as
 * its tuple does; every op reads such a list as that tuple. NULL, without an exception, for
 * anything else (and on MemoryError: the Python op runs). */
static PyObject *static_from_list(PyObject *v) {
    if (!PyList_CheckExact(v) || PyList_GET_SIZE(v) > 32) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(v, i))) return NULL;
    PyObject *t = PyList_AsTuple(v);
    if (t == NULL) PyErr_Clear();
    return t;
}

/* The operands and static arguments of a call, in order, into bound[]: positional ones,
 * then keywords naming a static parameter, then the defaults; keywords in none_kw must be
 * None. A static given as a list of ints is bound as its tuple, a new reference kept in
 * owned[] (*nowned of them), which the caller releases whatever this returns. 0 when the
 * call binds that way, -1 when it is the Python op's. */
static int bind(const prim *p, PyObject *const *args, size_t nargsf, PyObject *kwnames,
                PyObject **bound, PyObject **owned, int *nowned) {
    const Py_ssize_t npos = PyVectorcall_NARGS(nargsf);
    if (npos < p->nin || npos > p->nin + p->nstatic) return -1;
    for (Py_ssize_t i = 0; i < npos; i++) bound[i] = args[i];
    for (int j = (int)(npos - p->nin); j < p->nstatic; j++) bound[p->nin + j] = NULL;
    if (kwnames != NULL) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, k), *v = args[npos + k];
            int j = 0;
            for (; j < p->nstatic; j++)
                if (PyUnicode_Compare(PyTuple_GET_ITEM(p->statics, j), name) == 0) break;
            if (j < p->nstatic) {
                if (bound[p->nin + j] != NULL) return -1; /* given twice: the op raises */
                bound[p->nin + j] = v;
                continue;
            }
            if (v != Py_None || p->none_kw == NULL) return -1;
            int found = PySequence_Contains(p->none_kw, name);
            if (found != 1) {
                if (found < 0) PyErr_Clear();
                return -1;
            }
        }
    }
    for (int j = 0; j < p->nstatic; j++) {
        if (bound[p->nin + j] == NULL) bound[p->nin + j] = PyTuple_GET_ITEM(p->defaults, j);
        if (!static_value(bound[p->nin + j])) {
            PyObject *t = static_from_list(bound[p->nin + j]);
            if (t == NULL) return -1;
            owned[(*nowned)++] = t;
            bound[p->nin + j] = t;
        }
    }
    return 0;
}

static PyObject *prim_call(prim *p, PyObject *const *args, size_t nargsf, PyObject *kwnames,
                           int notape) {
    PyObject *bound[2 + MAXSTATIC], *owned[MAXSTATIC];
    int nowned = 0;
    if (p->nstatic == 0 ? (PyVectorcall_NARGS(nargsf) == (Py_ssize_t)p->nin &&
                           none_keywords(p, args, nargsf, kwnames))
                        : bind(p, args, nargsf, kwnames, bound, owned, &nowned) == 0) {
        PyObject *r = fast_call(p, p->nstatic == 0 ? args : bound, notape);
        for (int i = 0; i < nowned; i++) Py_DECREF(owned[i]);
        if (r != NULL || PyErr_Occurred()) return r;
    } else {
        for (int i = 0; i < nowned; i++) Py_DECREF(owned[i]);
    }
    p->falls++;
    return PyObject_Vectorcall(p->fallback, args, nargsf, kwnames);
}

static PyObject *prim_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    return prim_call((prim *)self, args, nargsf, kwnames, 0);
}

/* f(*args) where the caller has read this thread's tape stack and found no tape recording
 * (top_tape: 0 and NULL) since when only calls that returned have run (Python code that
 * pushes a tape pops it before it returns: _no_tape, value_and_grad, pmap's reduction): a
 * primitive then skips reading the stack again. The backward pass's C rules call through
 * this. */
static PyObject *call_notape(PyObject *f, PyObject *const *args, size_t nargs) {
    if (Py_IS_TYPE(f, prim_type)) return prim_call((prim *)f, args, nargs, NULL, 1);
    return PyObject_Vectorcall(f, args, nargs, NULL);
}

static PyObject *prim_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "nin", "fallback", "planner", "doc", "vjp", "none_keywords",
                             "statics", "defaults", NULL};
    PyObject *name, *fallback, *planner, *doc = Py_None, *vjp = Py_None, *none_kw = NULL;
    PyObject *statics = NULL, *defaults = NULL;
    int nin;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "UiOO|OOO!O!O!:Primitive", kwlist, &name, &nin,
                                     &fallback, &planner, &doc, &vjp, &PyTuple_Type, &none_kw,
                                     &PyTuple_Type, &statics, &PyTuple_Type, &defaults))
        return NULL;
    const Py_ssize_t nst = statics != NULL ? PyTuple_GET_SIZE(statics) : 0;
    if (nst > MAXSTATIC || (defaults != NULL ? PyTuple_GET_SIZE(defaults) : 0) != nst)
        return PyErr_Format(PyExc_ValueError,
                            "Primitive: at most %d statics, each with a default", MAXSTATIC);
    for (Py_ssize_t j = 0; j < nst; j++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(statics, j)) ||
            !static_value(PyTuple_GET_ITEM(defaults, j)))
            return PyErr_Format(PyExc_TypeError,
                                "Primitive: statics are names, defaults None, bools, ints or "
                                "tuples of ints");
    if (vjp != Py_None && !PyCallable_Check(vjp))
        return PyErr_Format(PyExc_TypeError, "Primitive: vjp must be callable or None");
    if (nin != 1 && nin != 2)
        return PyErr_Format(PyExc_ValueError, "Primitive: nin must be 1 or 2, got %d", nin);
    if (!PyCallable_Check(fallback) || !PyCallable_Check(planner))
        return PyErr_Format(PyExc_TypeError, "Primitive: fallback and planner must be callable");
    prim *p = (prim *)type->tp_alloc(type, 0);
    if (p == NULL) return NULL;
    p->vectorcall = prim_vectorcall;
    p->name = Py_NewRef(name);
    p->fallback = Py_NewRef(fallback);
    p->planner = Py_NewRef(planner);
    p->doc = Py_NewRef(doc);
    p->vjp = vjp != Py_None ? Py_NewRef(vjp) : NULL;
    p->none_kw = none_kw != NULL && PyTuple_GET_SIZE(none_kw) > 0 ? Py_NewRef(none_kw) : NULL;
    p->nin = nin;
    p->nstatic = (int)nst;
    p->statics = nst > 0 ? Py_NewRef(statics) : NULL;
    p->defaults = nst > 0 ? Py_NewRef(defaults) : NULL;
    return (PyObject *)p;
}

static void prim_clear_cache(prim *p) {
    for (int i = 0; i < NCACHE; i++)
        if (p->cache[i].busy == 0) entry_clear(&p->cache[i]); /* (one in use stays) */
    p->next = 0;
}

static int prim_traverse(prim *p, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(p));
    Py_VISIT(p->fallback);
    Py_VISIT(p->planner);
    Py_VISIT(p->vjp);
    Py_VISIT(p->vjp16);
    Py_VISIT(p->dict);
    return 0;
}

static int prim_clear(prim *p) {
    Py_CLEAR(p->fallback);
    Py_CLEAR(p->planner);
    Py_CLEAR(p->vjp);
    Py_CLEAR(p->vjp16);
    Py_CLEAR(p->dict);
    prim_clear_cache(p);
    return 0;
}

static void prim_dealloc(prim *p) {
    PyObject_GC_UnTrack(p);
    prim_clear(p);
    Py_CLEAR(p->name);
    Py_CLEAR(p->doc);
    Py_CLEAR(p->none_kw);
    Py_CLEAR(p->statics);
    Py_CLEAR(p->defaults);
    PyTypeObject *tp = Py_TYPE(p);
    tp->tp_free((PyObject *)p);
    Py_DECREF(tp);
}

static PyObject *prim_repr(prim *p) { return PyUnicode_FromFormat("<ctrainstate primitive %U>", p->name); }

static PyObject *prim_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)obj;
    (void)type;
    return Py_NewRef(self); /* as a builtin function: not bound when set on a class */
}

static PyObject *prim_cache_info(prim *p, PyObject *noargs) {
    (void)noargs;
    int used = 0;
    for (int i = 0; i < NCACHE; i++) used += p->cache[i].used;
    return Py_BuildValue("{sKsKsKsisi}", "hits", p->hits, "misses", p->misses, "fallbacks", p->falls,
                         "entries", used, "size", NCACHE);
}

static PyObject *prim_cache_clear(prim *p, PyObject *noargs) {
    (void)noargs;
    prim_clear_cache(p);
    p->hits = p->misses = p->falls = 0;
    Py_RETURN_NONE;
}

static PyObject *prim_get_doc(prim *p, void *c) {
    (void)c;
    return Py_NewRef(p->doc);
}

static int prim_set_doc(prim *p, PyObject *v, void *c) {
    (void)c;
    Py_XSETREF(p->doc, Py_NewRef(v != NULL ? v : Py_None));
    return 0;
}

static PyObject *prim_get_name(prim *p, void *c) {
    (void)c;
    return Py_NewRef(p->name);
}

static PyObject *prim_get_wrapped(prim *p, void *c) {
    (void)c;
    return Py_NewRef(p->fallback);
}

/* Pickled (and copied) by reference, as a function: its name in its module. */
static PyObject *prim_reduce(prim *p, PyObject *noargs) {
    (void)noargs;
    return Py_NewRef(p->name);
}

static PyMethodDef prim_methods[] = {
    {"__reduce__", (PyCFunction)prim_reduce, METH_NOARGS,
     "__reduce__($self, /)\n--\n\nBy reference: the primitive's name in its module."},
    {"cache_info", (PyCFunction)prim_cache_info, METH_NOARGS,
     "cache_info($self, /)\n--\n\nPlan-cache counters: hits, misses (planned), fallbacks (calls "
     "that ran the Python op), entries, size."},
    {"cache_clear", (PyCFunction)prim_cache_clear, METH_NOARGS,
     "cache_clear($self, /)\n--\n\nDrop every cached plan and reset the counters."},
    {NULL, NULL, 0, NULL},
};

/* A primitive's tape rules (vjp, vjp16): a callable or None; `c` is the field's offset. The
 * vjp is set once the primitives its program calls exist (a rule may call the primitive). */
static PyObject *prim_get_rule(prim *p, void *c) {
    PyObject *r = *(PyObject **)((char *)p + (size_t)c);
    return Py_NewRef(r != NULL ? r : Py_None);
}

static int prim_set_rule(prim *p, PyObject *v, void *c) {
    if (v == NULL || (v != Py_None && !PyCallable_Check(v))) {
        PyErr_Format(PyExc_TypeError, "a primitive's %s is a callable or None",
                     (size_t)c == offsetof(prim, vjp) ? "vjp" : "vjp16");
        return -1;
    }
    Py_XSETREF(*(PyObject **)((char *)p + (size_t)c), v == Py_None ? NULL : Py_NewRef(v));
    return 0;
}

static PyGetSetDef prim_getset[] = {
    {"vjp16", (getter)prim_get_rule, (setter)prim_set_rule,
     "The tape rule of a call on bfloat16 / float16 operands, which its plan runs as one kernel\n"
     "(widened, the float32 op, rounded): (g, out, *operands) -> cotangents, as the Python op's\n"
     "float32 policy records them; or None (a recording tape sends such calls to the Python op).",
     (void *)offsetof(prim, vjp16)},
    {"vjp", (getter)prim_get_rule, (setter)prim_set_rule,
     "The tape rule (g, out, *operands) -> cotangents of the Array operands, or None (a\n"
     "recording tape then sends calls to the Python op).", (void *)offsetof(prim, vjp)},
    {"__doc__", (getter)prim_get_doc, (setter)prim_set_doc, NULL, NULL},
    {"__name__", (getter)prim_get_name, NULL, NULL, NULL},
    {"__qualname__", (getter)prim_get_name, NULL, NULL, NULL},
    {"__wrapped__", (getter)prim_get_wrapped, NULL, "The Python op (the general path).", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef prim_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(prim, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(prim, dict), READONLY, NULL},
    {"planner", T_OBJECT, offsetof(prim, planner), READONLY, "The planner (Python)."},
    {"nondiff", T_INT, offsetof(prim, nondiff), 0,
     "Nonzero: its results are never differentiable (comparisons); a recording autodiff tape\n"
     "is not read and nothing is recorded, as in its Python op."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot prim_slots[] = {
    {Py_tp_new, prim_new},
    {Py_tp_dealloc, prim_dealloc},
    {Py_tp_traverse, prim_traverse},
    {Py_tp_clear, prim_clear},
    {Py_tp_repr, prim_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, prim_get},
    {Py_tp_methods, prim_methods},
    {Py_tp_getset, prim_getset},
    {Py_tp_members, prim_members},
    {0, NULL},
};

static PyType_Spec prim_spec = {
    .name = "ctrainstate._C.Primitive",
    .basicsize = sizeof(prim),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = prim_slots,
};

/* The Array's operators: the registered primitive, or (before registration) TypeError. */
static PyObject *slot_call(int k, PyObject *const *args, size_t n) {
    PyObject *f = slot_prims[k];
    if (f == NULL)
        return PyErr_Format(PyExc_RuntimeError, "ctrainstate ops are not loaded yet");
    return PyObject_Vectorcall(f, args, n, NULL);
}

PyObject *ct_py_array_nb_add(PyObject *a, PyObject *b) {
    PyObject *args[2] = {a, b};
    return slot_call(0, args, 2);
}
PyObject *ct_py_array_nb_subtract(PyObject *a, PyObject *b) {
    PyObject *args[2] = {a, b};
    return slot_call(1, args, 2);
}
PyObject *ct_py_array_nb_multiply(PyObject *a, PyObject *b) {
    PyObject *args[2] = {a, b};
    return slot_call(2, args, 2);
}
PyObject *ct_py_array_nb_true_divide(PyObject *a, PyObject *b) {
    PyObject *args[2] = {a, b};
    return slot_call(3, args, 2);
}
PyObject *ct_py_array_nb_negative(PyObject *a) {
    PyObject *args[1] = {a};
    return slot_call(4, args, 1);
}
PyObject *ct_py_array_nb_matmul(PyObject *a, PyObject *b) {
    PyObject *args[2] = {a, b};
    return slot_call(5, args, 2);
}

/* The Array's comparison operators: the registered comparison primitive for an Array, a
 * Python number or a numpy array / scalar on the other side (the primitive's Python op
 * handles every case its plans do not), NotImplemented for anything else (Python then tries
 * the other operand, or compares identities for == and !=). */
PyObject *ct_py_array_richcompare(PyObject *a, PyObject *b, int op) {
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    PyObject *f = op >= Py_LT && op <= Py_GE ? typed_prims[op] : NULL;
    if (f == NULL || !(PyObject_TypeCheck(b, at) || PyFloat_Check(b) || PyLong_Check(b) ||
                       PyArray_Check(b) || PyArray_IsScalar(b, Generic)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *args[2] = {a, b};
    return PyObject_Vectorcall(f, args, 2, NULL);
}

/* The Array's & | ^ (either operand the Array) and ~: the registered primitive, whose Python
 * op handles (and refuses) every other operand. */
static PyObject *typed_call(int k, PyObject *a, PyObject *b) {
    PyObject *f = typed_prims[k];
    if (f == NULL)
        return PyErr_Format(PyExc_RuntimeError, "ctrainstate ops are not loaded yet");
    PyObject *args[2] = {a, b};
    return PyObject_Vectorcall(f, args, b != NULL ? 2 : 1, NULL);
}
PyObject *ct_py_array_nb_and(PyObject *a, PyObject *b) { return typed_call(6, a, b); }
PyObject *ct_py_array_nb_or(PyObject *a, PyObject *b) { return typed_call(7, a, b); }
PyObject *ct_py_array_nb_xor(PyObject *a, PyObject *b) { return typed_call(8, a, b); }
PyObject *ct_py_array_nb_invert(PyObject *a) { return typed_call(9, a, NULL); }

static PyObject *py_dispatch_register_typed(PyObject *self, PyObject *const *args,
                                            Py_ssize_t n) {
    (void)self;
    if (n != NTYPED)
        return PyErr_Format(PyExc_TypeError,
                            "dispatch_register_typed takes %d arguments (%zd given)", NTYPED, n);
    for (int i = 0; i < NTYPED; i++)
        if (!PyCallable_Check(args[i]))
            return PyErr_Format(PyExc_TypeError,
                                "dispatch_register_typed: argument %d is not callable", i);
    for (int i = 0; i < NTYPED; i++) Py_XSETREF(typed_prims[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

static PyObject *py_dispatch_register(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 4 + NSLOT)
        return PyErr_Format(PyExc_TypeError, "dispatch_register takes %d arguments (%zd given)",
                            4 + NSLOT, n);
    if (!PyType_Check(args[1]) || !PyType_Check(args[3]))
        return PyErr_Format(PyExc_TypeError,
                            "dispatch_register: the tape type and the sharding type must be classes");
    for (int i = 4; i < 4 + NSLOT; i++)
        if (!PyCallable_Check(args[i]))
            return PyErr_Format(PyExc_TypeError, "dispatch_register: argument %d is not callable", i);
    static const char *const slot_names[TS_COUNT] = {"outer", "tracked", "keep", "nodes"};
    Py_ssize_t offsets[TS_COUNT];
    for (int i = 0; i < TS_COUNT; i++) {
        PyObject *d = PyDict_GetItemString(((PyTypeObject *)args[1])->tp_dict, slot_names[i]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX)
            return PyErr_Format(PyExc_TypeError,
                                "dispatch_register: the tape type has no __slots__ entry %s",
                                slot_names[i]);
        offsets[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    memcpy(tape_slot_offset, offsets, sizeof offsets);
    Py_XSETREF(tape_tls, Py_NewRef(args[0]));
    Py_XSETREF(tape_type, Py_NewRef(args[1]));
    Py_XSETREF(prec_tls, Py_NewRef(args[2]));
    Py_XSETREF(named_sharding_type, Py_NewRef(args[3]));
    for (int i = 0; i < NSLOT; i++) Py_XSETREF(slot_prims[i], Py_NewRef(args[i + 4]));
    Py_RETURN_NONE;
}

/* --- the backward pass ------------------------------------------------------------------ */

/* cot.pop(key) as a new reference, NULL without an exception when absent. */
static PyObject *dict_pop(PyObject *cot, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(cot, key);
    if (v == NULL) return NULL;
    Py_INCREF(v);
    if (PyDict_DelItem(cot, key) < 0) Py_CLEAR(v);
    return v;
}

/* cot[key] = value, or cot[key] + value (the add primitive) when cot has key already. */
static int accumulate(PyObject *cot, PyObject *key, PyObject *value, int notape) {
    PyObject *prev = PyDict_GetItemWithError(cot, key);
    if (prev == NULL) return PyErr_Occurred() ? -1 : PyDict_SetItem(cot, key, value);
    if (slot_prims[0] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tape_backward: dispatch_register was not called");
        return -1;
    }
    PyObject *args[2] = {prev, value};
    Py_INCREF(prev); /* (the addition may run Python code that changes cot) */
    PyObject *sum = notape ? call_notape(slot_prims[0], args, 2)
                           : PyObject_Vectorcall(slot_prims[0], args, 2, NULL);
    Py_DECREF(prev);
    if (sum == NULL) return -1;
    int rc = PyDict_SetItem(cot, key, sum);
    Py_DECREF(sum);
    return rc;
}

/* One (out, inputs, vjp) node: its output's cotangent through vjp into those of its tracked
 * Array inputs. */
static int backward_node(PyObject *node, PyObject *tracked, PyObject *cot, PyTypeObject *at,
                         int notape) {
    if (!PyTuple_CheckExact(node) || PyTuple_GET_SIZE(node) != 3 ||
        !PyTuple_Check(PyTuple_GET_ITEM(node, 1))) {
        PyErr_SetString(PyExc_TypeError, "tape_backward: a node is not (out, inputs, vjp)");
        return -1;
    }
    PyObject *key = ct_py_idkey(PyTuple_GET_ITEM(node, 0));
    if (key == NULL) return -1;
    PyObject *g = dict_pop(cot, key);
    Py_DECREF(key);
    if (g == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *inputs = PyTuple_GET_ITEM(node, 1);
    const Py_ssize_t nin = PyTuple_GET_SIZE(inputs);
    PyObject *vjp = PyTuple_GET_ITEM(node, 2), *gs = NULL, *seq = NULL;
    PyObject *keys[4] = {NULL, NULL, NULL, NULL}; /* the tracked Array inputs' ids (known) */
    int known = 0, rc = -1;
    node_vjp *nv = (node_vjp *)vjp;
    if (notape && nin <= 4 && Py_IS_TYPE(vjp, node_vjp_type) && nv->rule != NULL &&
        nv->args != NULL && nv->out != NULL && Py_IS_TYPE(nv->rule, vjp_program_type) &&
        PyTuple_GET_SIZE(nv->args) <= 2 + MAXSTATIC) {
        /* node_vjp_call's call of a derivative program, the tape stack known empty; it
         * computes only the cotangents of tracked inputs (an input's is its program output of
         * the same position: a matmul by a batch of data, `y - target`) */
        known = 1;
        unsigned want = 0;
        for (Py_ssize_t j = 0; j < nin; j++) {
            PyObject *x = PyTuple_GET_ITEM(inputs, j);
            if (!Py_IS_TYPE(x, at)) continue;
            PyObject *k = ct_py_idkey(x);
            const int in = k != NULL ? PySet_Contains(tracked, k) : -1;
            if (in < 0) {
                Py_XDECREF(k);
                goto done;
            }
            if (in) {
                keys[j] = k;
                want |= 1u << j;
            } else {
                Py_DECREF(k);
            }
        }
        if (want == (1u << nin) - 1u) want = ~0u;
        PyObject *call[2 + 2 + MAXSTATIC];
        const Py_ssize_t na = PyTuple_GET_SIZE(nv->args);
        call[0] = g;
        call[1] = nv->out;
        for (Py_ssize_t i = 0; i < na; i++) call[2 + i] = PyTuple_GET_ITEM(nv->args, i);
        gs = vp_invoke((vjp_program *)nv->rule, call, (size_t)(2 + na), 1, want);
    } else {
        gs = PyObject_CallOneArg(vjp, g);
    }
    Py_CLEAR(g); /* (no longer needed: its buffers go as soon as nothing else holds them) */
    if (gs == NULL) goto done;
    seq = PySequence_Fast(gs, "tape_backward: a vjp returns a sequence of cotangents");
    if (seq == NULL) goto done;
    Py_ssize_t n = nin;
    if (PySequence_Fast_GET_SIZE(seq) < n) n = PySequence_Fast_GET_SIZE(seq);
    rc = 0;
    for (Py_ssize_t j = 0; j < n && rc == 0; j++) {
        PyObject *x = PyTuple_GET_ITEM(inputs, j), *gx = PySequence_Fast_GET_ITEM(seq, j);
        if (gx == Py_None || !Py_IS_TYPE(x, at)) continue;
        if (known) {
            if (keys[j] != NULL) rc = accumulate(cot, keys[j], gx, notape);
            continue;
        }
        PyObject *kx = ct_py_idkey(x);
        if (kx == NULL) {
            rc = -1;
            break;
        }
        int in = PySet_Contains(tracked, kx);
        if (in < 0) rc = -1;
        else if (in) rc = accumulate(cot, kx, gx, notape);
        Py_DECREF(kx);
    }
done:
    Py_XDECREF(g);
    Py_XDECREF(gs);
    Py_XDECREF(seq);
    for (int j = 0; j < 4; j++) Py_XDECREF(keys[j]);
    return rc;
}

/* A group node (outs, inputs, vjp attributes): vjp(output cotangents, the inputs' so far)
 * gives the inputs' new cotangents, which replace theirs. */
static int backward_group(PyObject *node, PyObject *cot) {
    PyObject *outs = PyObject_GetAttrString(node, "outs");
    PyObject *inputs = outs ? PyObject_GetAttrString(node, "inputs") : NULL;
    PyObject *vjp = inputs ? PyObject_GetAttrString(node, "vjp") : NULL;
    PyObject *gs = NULL, *prevs = NULL, *news = NULL, *seq = NULL;
    int rc = -1, any = 0;
    if (vjp == NULL) goto done;
    if (!PyTuple_Check(outs) || !PyTuple_Check(inputs)) {
        PyErr_SetString(PyExc_TypeError, "tape_backward: a group's outs and inputs are tuples");
        goto done;
    }
    gs = PyList_New(PyTuple_GET_SIZE(outs));
    if (gs == NULL) goto done;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(outs); j++) {
        PyObject *k = ct_py_idkey(PyTuple_GET_ITEM(outs, j));
        if (k == NULL) goto done;
        PyObject *g = dict_pop(cot, k);
        Py_DECREF(k);
        if (g == NULL && PyErr_Occurred()) goto done;
        any |= g != NULL;
        PyList_SET_ITEM(gs, j, g != NULL ? g : Py_NewRef(Py_None));
    }
    if (!any) {
        rc = 0;
        goto done;
    }
    prevs = PyList_New(PyTuple_GET_SIZE(inputs));
    if (prevs == NULL) goto done;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(inputs); j++) {
        PyObject *k = ct_py_idkey(PyTuple_GET_ITEM(inputs, j));
        if (k == NULL) goto done;
        PyObject *v = PyDict_GetItemWithError(cot, k);
        Py_DECREF(k);
        if (v == NULL && PyErr_Occurred()) goto done;
        PyList_SET_ITEM(prevs, j, Py_NewRef(v != NULL ? v : Py_None));
    }
    news = PyObject_CallFunctionObjArgs(vjp, gs, prevs, NULL);
    if (news == NULL) goto done;
    seq = PySequence_Fast(news, "tape_backward: a group's vjp returns a sequence");
    if (seq == NULL) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(inputs);
    if (PySequence_Fast_GET_SIZE(seq) < n) n = PySequence_Fast_GET_SIZE(seq);
    rc = 0;
    for (Py_ssize_t j = 0; j < n && rc == 0; j++) {
        PyObject *gx = PySequence_Fast_GET_ITEM(seq, j);
        if (gx == Py_None) continue;
        PyObject *k = ct_py_idkey(PyTuple_GET_ITEM(inputs, j));
        rc = k == NULL ? -1 : PyDict_SetItem(cot, k, gx);
        Py_XDECREF(k);
    }
done:
    Py_XDECREF(outs);
    Py_XDECREF(inputs);
    Py_XDECREF(vjp);
    Py_XDECREF(gs);
    Py_XDECREF(prevs);
    Py_XDECREF(news);
    Py_XDECREF(seq);
    return rc;
}

static PyObject *py_tape_backward(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 4)
        return PyErr_Format(PyExc_TypeError, "tape_backward takes 4 arguments (%zd given)", n);
    PyObject *nodes = args[0], *tracked = args[1], *cot = args[2], *group = args[3];
    if (!PyList_Check(nodes) || !PyAnySet_Check(tracked) || !PyDict_Check(cot) ||
        !PyType_Check(group))
        return PyErr_Format(PyExc_TypeError,
                            "tape_backward(nodes: list, tracked: set, cot: dict, group_type)");
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    /* no tape recording on this thread now: none while the loop runs either (the vjps' Python
     * code pops what it pushes before it returns), so the C rules skip reading the stack */
    PyObject *tape;
    const int tr = top_tape(&tape);
    if (tr < 0) return NULL;
    const int notape = tr == 0 && tape == NULL;
    Py_XDECREF(tape);
    for (Py_ssize_t i = PyList_GET_SIZE(nodes) - 1; i >= 0; i--) {
        if (i >= PyList_GET_SIZE(nodes)) { /* (a vjp shortened the list) */
            i = PyList_GET_SIZE(nodes);
            continue;
        }
        PyObject *node = Py_NewRef(PyList_GET_ITEM(nodes, i));
        int rc = Py_IS_TYPE(node, (PyTypeObject *)group) ? backward_group(node, cot)
                                                          : backward_node(node, tracked, cot, at, notape);
        Py_DECREF(node);
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* _filled_like(x, value) of ops.py for an Array x of float32 blocks: a new float32 buffer per
 * block of x (its device and block shape), every element set by the affine kernel with alpha 0
 * (beta stored without reading the buffer), in an Array of x's shape, dtype, sharding, block
 * starts and replica ids. NULL without an exception when x is anything else (the Python
 * function runs), NULL with one on an error. */
static PyObject *filled_like_c(PyObject *x, float value) {
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    if (!Py_IS_TYPE(x, at)) return NULL;
    ct_py_array *a = (ct_py_array *)x;
    PyObject *bl = a->blocks;
    if (bl == NULL || !PyList_CheckExact(bl) || a->shape == NULL || a->dtype == NULL ||
        a->sharding == NULL)
        return NULL;
    const Py_ssize_t nb = PyList_GET_SIZE(bl);
    if (nb == 0 || nb > MAXB) return NULL;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *t = PyList_GET_ITEM(bl, i);
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 4 ||
            !Py_IS_TYPE(PyTuple_GET_ITEM(t, 1), &ct_py_BufferType))
            return NULL;
        const ct_py_buffer *b = (const ct_py_buffer *)PyTuple_GET_ITEM(t, 1);
        if (b->dtype != CT_F32 || b->dev == NULL) return NULL;
        total += nelem(b);
    }
    PyObject *blocks = PyList_New(nb);
    if (blocks == NULL) return NULL;
    ct_py_buffer *made[MAXB];
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *t = PyList_GET_ITEM(bl, i);
        const ct_py_buffer *b = (const ct_py_buffer *)PyTuple_GET_ITEM(t, 1);
        ct_py_buffer *nbuf = ct_py_buffer_alloc(b->dev, b->ndim, b->shape, CT_F32);
        PyObject *nt = nbuf != NULL ? PyTuple_New(4) : NULL;
        if (nt == NULL) {
            Py_XDECREF((PyObject *)nbuf);
            Py_DECREF(blocks);
            return NULL;
        }
        ct_py_trace_touch(nbuf, "op_unary output"); /* (as _C.op_unary does) */
        made[i] = nbuf;
        PyTuple_SET_ITEM(nt, 0, Py_NewRef(PyTuple_GET_ITEM(t, 0)));
        PyTuple_SET_ITEM(nt, 1, (PyObject *)nbuf);
        PyTuple_SET_ITEM(nt, 2, Py_NewRef(PyTuple_GET_ITEM(t, 2)));
        PyTuple_SET_ITEM(nt, 3, Py_NewRef(PyTuple_GET_ITEM(t, 3)));
        PyList_SET_ITEM(blocks, i, nt);
    }
    ct_status st = CT_OK;
    /* (the buffers are new: no other thread can reach them while the GIL is released) */
    if (total >= CT_DISPATCH_GIL_ELEMS && !capturing) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < nb && st == CT_OK; i++)
            st = ct_op_unary(made[i]->dev, CT_UN_AFFINE, 0.0f, value, nelem(made[i]),
                             made[i]->data, made[i]->data);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < nb && st == CT_OK; i++)
            st = ct_op_unary(made[i]->dev, CT_UN_AFFINE, 0.0f, value, nelem(made[i]),
                             made[i]->data, made[i]->data);
    }
    if (st != CT_OK) {
        Py_DECREF(blocks);
        ct_py_raise(st);
        return NULL;
    }
    return ct_py_array_new(Py_NewRef(a->shape), Py_NewRef(a->dtype), Py_NewRef(a->sharding), blocks,
                           Py_XNewRef(a->shard_shape));
}

/* filled_like(x, value): filled_like_c, or None where the Python function must run. */
static PyObject *py_filled_like(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2 || !PyFloat_CheckExact(args[1]))
        return PyErr_Format(PyExc_TypeError, "filled_like(x: Array, value: float)");
    PyObject *r = filled_like_c(args[0], (float)PyFloat_AS_DOUBLE(args[1]));
    if (r == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return r;
}

/* vjp_register(sum, reshape, broadcast_like): the primitives the C rules of the backward pass
 * call (unbroadcast_c, vp_sum). */
static PyObject *py_vjp_register(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 3) return PyErr_Format(PyExc_TypeError, "vjp_register takes 3 arguments (%zd given)", n);
    for (int i = 0; i < 3; i++)
        if (!PyCallable_Check(args[i]))
            return PyErr_Format(PyExc_TypeError, "vjp_register: argument %d is not callable", i);
    Py_XSETREF(bw_sum, Py_NewRef(args[0]));
    Py_XSETREF(bw_reshape, Py_NewRef(args[1]));
    Py_XSETREF(bw_bcast_like, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* value_and_grad's per-call bookkeeping of its differentiated leaves, in C (the Python
 * wrapper in ops.py takes the general path for anything else):
 *
 * grad_track(leaves, tape, floats) -> list | None: for leaves that are all Arrays of a dtype
 * in `floats` (a set) and alive, a new Array object over each one's buffers (so one Array
 * passed twice gets two slots, and a closed-over original stays a constant), each tracked on
 * `tape` (id in tape.tracked, the object in tape.keep). None, with nothing tracked, when a
 * leaf is anything else or the tape has enclosing tapes (the Python path raises or lifts).
 *
 * grad_collect(leaves, cot, zeros=False) -> (grads, nfix): each leaf's cotangent cot[id(leaf)]
 * where it has the leaf's layout; with `zeros`, where it has none and the leaf has float32
 * blocks, zeros_like(leaf) (filled_like_c); None for the rest (nfix counts them: the Python
 * path makes zeros or reshards). */
static PyObject *py_grad_track(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 3 || !PyList_Check(args[0]) || !PyAnySet_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "grad_track(leaves: list, tape, floats: set)");
    PyObject *leaves = args[0], *tape = args[1], *floats = args[2];
    if (tape_type == NULL || (PyObject *)Py_TYPE(tape) != tape_type)
        Py_RETURN_NONE; /* (another kind of tape: the Python path) */
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    PyObject *outer = PyObject_GetAttr(tape, outer_name);
    if (outer == NULL) return NULL;
    const int nested = !PyTuple_CheckExact(outer) || PyTuple_GET_SIZE(outer) != 0;
    Py_DECREF(outer);
    const Py_ssize_t m = PyList_GET_SIZE(leaves);
    if (nested) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < m; i++) { /* everything checked before anything is tracked */
        ct_py_array *x = (ct_py_array *)PyList_GET_ITEM(leaves, i);
        if (!Py_IS_TYPE((PyObject *)x, at) || x->donated != Py_False || x->blocks == NULL ||
            !PyList_Check(x->blocks) || x->dtype == NULL)
            Py_RETURN_NONE;
        const int isf = PySet_Contains(floats, x->dtype);
        if (isf < 0) return NULL;
        if (!isf) Py_RETURN_NONE;
        if (ct_py_array_check_alive((PyObject *)x) < 0) {
            PyErr_Clear(); /* (the Python path raises it with the same message) */
            Py_RETURN_NONE;
        }
    }
    PyObject *tracked = PyObject_GetAttr(tape, tracked_name);
    PyObject *keep = tracked != NULL ? PyObject_GetAttr(tape, keep_name) : NULL;
    PyObject *out = keep != NULL ? PyList_New(m) : NULL;
    if (out != NULL && (!PySet_Check(tracked) || !PyList_Check(keep))) {
        PyErr_SetString(PyExc_TypeError, "grad_track: a tape's tracked/keep changed type");
        Py_CLEAR(out);
    }
    for (Py_ssize_t i = 0; out != NULL && i < m; i++) {
        ct_py_array *x = (ct_py_array *)PyList_GET_ITEM(leaves, i);
        PyObject *blocks = PyList_GetSlice(x->blocks, 0, PyList_GET_SIZE(x->blocks));
        PyObject *y = blocks != NULL
            ? ct_py_array_new(Py_NewRef(x->shape), Py_NewRef(x->dtype), Py_NewRef(x->sharding),
                              blocks, Py_XNewRef(x->shard_shape))
            : NULL;
        PyObject *id = y != NULL ? ct_py_idkey(y) : NULL;
        const int rc = id != NULL && PySet_Add(tracked, id) == 0 && PyList_Append(keep, y) == 0;
        Py_XDECREF(id);
        if (!rc) {
            Py_XDECREF(y);
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, y);
    }
    Py_XDECREF(tracked);
    Py_XDECREF(keep);
    return out;
}

static PyObject *py_grad_collect(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n < 2 || n > 3 || !PyList_Check(args[0]) || !PyDict_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "grad_collect(leaves: list, cot: dict, zeros=False)");
    PyObject *leaves = args[0], *cot = args[1];
    const int zeros = n > 2 ? PyObject_IsTrue(args[2]) : 0;
    if (zeros < 0) return NULL;
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    const Py_ssize_t m = PyList_GET_SIZE(leaves);
    PyObject *out = PyList_New(m);
    long nfix = 0;
    for (Py_ssize_t i = 0; out != NULL && i < m; i++) {
        PyObject *x = PyList_GET_ITEM(leaves, i);
        PyObject *id = ct_py_idkey(x);
        PyObject *g = id != NULL ? PyDict_GetItemWithError(cot, id) : NULL;
        Py_XDECREF(id);
        if (g == NULL && PyErr_Occurred()) {
            Py_CLEAR(out);
            break;
        }
        PyObject *z = NULL;
        if (g != NULL && Py_IS_TYPE(g, at) && Py_IS_TYPE(x, at) &&
            same_layout(((ct_py_array *)g)->sharding, ((ct_py_array *)x)->sharding)) {
            PyList_SET_ITEM(out, i, Py_NewRef(g));
        } else if (g == NULL && zeros && (z = filled_like_c(x, 0.0f)) != NULL) {
            PyList_SET_ITEM(out, i, z); /* (zeros_like(x): no cotangent reached x) */
        } else if (PyErr_Occurred()) {
            Py_CLEAR(out);
            break;
        } else {
            PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
            nfix++;
        }
    }
    if (out == NULL) return NULL;
    return Py_BuildValue("(Nl)", out, nfix);
}

/* --- programs: a function's primitive calls recorded once, replayed from C -------------------
 * ctrainstate.jit traces a function by running it once with a program recording: every
 * primitive call that runs from a plan appends a step (a copy of the plan, its operand values,
 * a scalar operand). Values are the arguments, constants (Arrays that exist before the trace,
 * or are made during it from nothing traced: a seed of ones) and the steps' results, told
 * apart by their first block's Buffer. Anything else that touches a traced buffer — a kernel
 * called by a Python op, a host read (float(x), np.asarray), a copy, an optimizer step in
 * place — marks the program broken (ct_py_trace_touch, from ct_py_buffer_check): such a
 * function runs eagerly on every call. While recording, the program keeps the arguments and
 * every step's result alive (a freed Buffer's address, reused by a new one, would alias a
 * traced value), so a trace holds its intermediates until it ends. A finished program
 * replays its steps for new
 * arguments of the same shapes, dtypes and shardings: per step the plan's kernels (run_entry,
 * as the dispatcher runs them), each intermediate released after its last use. */
enum { V_ARG = 0, V_CONST, V_STEP };

typedef struct {
    plan_entry e;     /* a copy of the plan; its references are owned (a node: zeroed) */
    PyObject *name;   /* the primitive's name (a node: its kind, e.g. "optimizer_step") */
    PyObject *scalar; /* K_SCALAR's Python scalar, or NULL */
    int a, b, out;    /* operand values (b: -1) and the result's (a node: -1 each) */
    PyObject *fn;     /* a node (trace_node): the callable run on replay, else NULL */
    int nin, nout;    /* a node: its input and output values, in io[0..nin+nout) */
    int pure;         /* a node that makes new outputs (an op without a C plan), not one that
                       * updates its inputs in place (an optimizer step) */
    int *io;
    int *alias;       /* a pure node: per output, the input value whose buffers it returned as
                       * they were at the trace (its memory is that input's), else -1 */
    PyObject *scratch; /* a pure node: ((device id, bytes, kept), ...): the most it allocated
                        * above what was in use when it started, and what it still held after
                        * besides its outputs, measured at the trace; or NULL */
    int dead;         /* (finish: a step whose result reaches no output) */
    int chain;        /* the first step of a fused chain: its length (>= 2), else 0 */
    int chain_side;   /* a later step of a chain: which operand is the previous result (0: a) */
} pstep;

struct program {
    PyObject_HEAD
    int nargs, nsteps, scap, nvals, vcap, finished, nouts;
    pstep *steps;
    int *vkind, *vref, *last_use, *out_vals;
    PyObject **vobj;  /* V_CONST: the Array; else NULL */
    PyObject **vmeta; /* (shape, dtype, sharding) of each value */
    PyObject **arg_sh; /* per argument: a sharding object found equal to its recorded one at
                        * an earlier run (so the same object again needs no comparison), or
                        * NULL */
    PyObject *out_objs; /* per output: a non-Array leaf, or None where out_vals names a value */
    PyObject *broken; /* why the function cannot be replayed (str), or NULL */
    PyObject *broken_at; /* the Python stack's last frames where it broke (str), or NULL */
    PyObject *bufmap; /* while recording: id(first buffer) -> value */
    PyObject *traced; /* while recording: ids of the arguments' and the steps' buffers */
    PyObject *keep;   /* while recording: the arguments and results, alive so that no new
                       * Buffer takes the address of one of theirs (the maps' keys) */
    unsigned long thread;
    int fuse;         /* whether chains run fused (set_fusion; on by default) */
    int tile;         /* whether a fused chain runs tiled on CPU devices (set_fusion; on) */
    double *step_ns;  /* with timing on (set_timing): nanoseconds spent in each step so far */
    long long timed_runs;
    /* The static memory plan (plan_memory): values that only plain steps and chains make and
     * read (no node, not an output) live in one arena per device, allocated once a run, at
     * offsets that values whose lifetimes do not overlap share. */
    int planned, plan_fuse;   /* a plan exists, made for this fusion setting */
    unsigned char *internal;  /* per value: in the arenas */
    int *vfirst;              /* per internal value: its first block's index in views / boff */
    int nviews;
    ct_py_buffer **views;     /* per block of an internal value: a Buffer on the arena */
    int64_t *boff;            /* per block: its offset in the arena */
    int *barena;              /* per block: its arena */
    int *blive;               /* per block: the first and last step it is live (2 ints) */
    int narenas;
    ct_device **arena_dev;    /* per arena: its device */
    int64_t *arena_bytes;     /* per arena: its size */
    void **arena_mem;         /* per arena, while a run holds it: the memory */
    int arena_busy;           /* a run holds the arenas (another, meanwhile, runs without) */
    int arena_first, arena_last; /* the steps a run holds the arenas over (from the first
                                  * value in them made to the last read) */
    /* CUDA graphs (graph_plan): runs of steps on GPU devices captured once per device and
     * relaunched. With any, the arenas stay allocated between runs (arena_held), so that the
     * graphs' addresses in them stay valid. */
    int graphs;               /* replays use graphs (set_graphs; on unless
                               * CTRAINSTATE_CUDA_GRAPHS=0 at the trace) */
    int nsegs;
    struct gseg *segs;
    int *seg_at;              /* per step: the segment that starts there, or -1 */
    int arena_held;           /* arena_mem holds the arenas between runs */
};

static PyTypeObject *program_type;

/* Where the Python code was when the program broke: the innermost frames of the stack (file,
 * line, function), as text, or NULL. Read once per trace, when it breaks. */
static PyObject *traceback_mod; /* (imported at module init: no import runs at a break) */

static PyObject *break_site(void) {
    if (traceback_mod == NULL) return NULL;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    /* the garbage collector off meanwhile: the caller may hold borrowed references that a
     * collection's finalizers could drop */
    const int gc_was = PyGC_Disable();
    PyObject *r = NULL, *mod = Py_NewRef(traceback_mod);
    PyObject *lines = PyObject_CallMethod(mod, "format_stack", NULL);
    if (lines != NULL && PyList_Check(lines)) {
        const Py_ssize_t n = PyList_GET_SIZE(lines), lo = n > 6 ? n - 6 : 0;
        PyObject *tail = PyList_GetSlice(lines, lo, n), *sep = PyUnicode_FromString("");
        r = tail != NULL && sep != NULL ? PyUnicode_Join(sep, tail) : NULL;
        Py_XDECREF(tail);
        Py_XDECREF(sep);
    }
    Py_XDECREF(lines);
    Py_XDECREF(mod);
    PyErr_Clear();
    if (gc_was) PyGC_Enable();
    PyErr_Restore(et, ev, tb);
    return r;
}

static void program_break(program *pr, const char *why) {
    if (pr->broken != NULL) return;
    pr->broken = PyUnicode_FromString(why);
    if (pr->broken == NULL) {
        PyErr_Clear();
        return;
    }
    Py_XSETREF(pr->broken_at, break_site());
}

void ct_py_trace_touch(const void *buffer, const char *what) {
    program *pr = recorder;
    if (pr == NULL || pr->broken != NULL || pr->traced == NULL ||
        pr->thread != PyThread_get_thread_ident())
        return;
    PyObject *et, *ev, *etb; /* (a pending exception, if any, is kept) */
    PyErr_Fetch(&et, &ev, &etb);
    PyObject *k = PyLong_FromVoidPtr((void *)buffer);
    int in = k != NULL ? PySet_Contains(pr->traced, k) : -1;
    Py_XDECREF(k);
    if (in != 0) {
        char why[200];
        snprintf(why, sizeof why, "%s of a traced value (only primitive calls with C plans are recorded)",
                 what != NULL ? what : "a kernel");
        program_break(pr, in > 0 ? why : "a buffer could not be checked");
    }
    PyErr_Clear();
    PyErr_Restore(et, ev, etb);
}

int ct_py_trace_host_read(const void *buffer, const char *what) {
    program *pr = recorder;
    /* (a program that cannot be replayed anyway, trace_break: the function runs eagerly, and
     * its host reads are reads of concrete values) */
    if (pr == NULL || pr->traced == NULL || pr->broken != NULL ||
        pr->thread != PyThread_get_thread_ident())
        return 0;
    PyObject *k = PyLong_FromVoidPtr((void *)buffer);
    const int in = k != NULL ? PySet_Contains(pr->traced, k) : -1;
    Py_XDECREF(k);
    if (in <= 0) return in;
    PyErr_Format(ct_py_ConcretizationTypeError,
                 "%s of a value traced by jit: while tracing, a value computed from the jitted "
                 "function's arguments is not known on the host (as in jax: "
                 "ConcretizationTypeError). Mark the argument static (static_argnums / "
                 "static_argnames), compute with ops instead of Python control flow (cnp.where, "
                 "lax.cond, lax.fori_loop), or read the value outside the jitted function.",
                 what != NULL ? what : "a host read");
    return -1;
}

static int grow_values(program *pr) {
    if (pr->nvals < pr->vcap) return 0;
    int cap = pr->vcap ? 2 * pr->vcap : 16;
    int *k = PyMem_Realloc(pr->vkind, cap * sizeof(int));
    if (k) pr->vkind = k;
    int *r = k ? PyMem_Realloc(pr->vref, cap * sizeof(int)) : NULL;
    if (r) pr->vref = r;
    PyObject **o = r ? PyMem_Realloc(pr->vobj, cap * sizeof(PyObject *)) : NULL;
    if (o) pr->vobj = o;
    PyObject **m = o ? PyMem_Realloc(pr->vmeta, cap * sizeof(PyObject *)) : NULL;
    if (m) pr->vmeta = m;
    if (m == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pr->vcap = cap;
    return 0;
}

/* The first block's Buffer of Array x (borrowed), or NULL. */
static PyObject *first_buffer(ct_py_array *x) {
    if (x->blocks == NULL || !PyList_Check(x->blocks) || PyList_GET_SIZE(x->blocks) < 1) return NULL;
    PyObject *t = PyList_GET_ITEM(x->blocks, 0);
    return PyTuple_Check(t) && PyTuple_GET_SIZE(t) >= 2 ? PyTuple_GET_ITEM(t, 1) : NULL;
}

/* ((device id, bytes), ...) of Array x's blocks (memory_plan). */
static PyObject *block_bytes(ct_py_array *x) {
    const Py_ssize_t n = PyList_GET_SIZE(x->blocks);
    PyObject *r = PyTuple_New(n);
    for (Py_ssize_t i = 0; r != NULL && i < n; i++) {
        PyObject *t = PyList_GET_ITEM(x->blocks, i);
        PyObject *b = PyTuple_Check(t) && PyTuple_GET_SIZE(t) >= 2 ? PyTuple_GET_ITEM(t, 1) : NULL;
        PyObject *e = b != NULL && Py_IS_TYPE(b, &ct_py_BufferType)
            ? Py_BuildValue("(in)", ((ct_py_buffer *)b)->dev->id, (Py_ssize_t)((ct_py_buffer *)b)->nbytes)
            : Py_BuildValue("(in)", -1, (Py_ssize_t)0);
        if (e == NULL) Py_CLEAR(r);
        else PyTuple_SET_ITEM(r, i, e);
    }
    return r;
}

/* A new value of Array x (kind, ref, the Array for a constant), mapped by its first buffer;
 * with its buffers traced unless it is a constant. */
static int add_value(program *pr, ct_py_array *x, int kind, int ref) {
    PyObject *buf = first_buffer(x);
    if (buf == NULL) {
        program_break(pr, "an Array without blocks");
        return -2;
    }
    if (grow_values(pr) < 0) return -1;
    PyObject *bytes = block_bytes(x);
    PyObject *meta = bytes != NULL ? PyTuple_Pack(4, x->shape, x->dtype, x->sharding, bytes) : NULL;
    Py_XDECREF(bytes);
    PyObject *key = meta ? PyLong_FromVoidPtr(buf) : NULL;
    PyObject *idx = key ? PyLong_FromLong(pr->nvals) : NULL;
    int rc = idx ? PyDict_SetItem(pr->bufmap, key, idx) : -1;
    for (Py_ssize_t i = 0; rc == 0 && kind != V_CONST && i < PyList_GET_SIZE(x->blocks); i++) {
        PyObject *t = PyList_GET_ITEM(x->blocks, i);
        PyObject *k = PyTuple_Check(t) && PyTuple_GET_SIZE(t) >= 2
                          ? PyLong_FromVoidPtr(PyTuple_GET_ITEM(t, 1)) : NULL;
        rc = k != NULL ? PySet_Add(pr->traced, k) : -1;
        Py_XDECREF(k);
    }
    Py_XDECREF(key);
    Py_XDECREF(idx);
    if (rc == 0 && kind != V_CONST) rc = PyList_Append(pr->keep, (PyObject *)x);
    if (rc < 0) {
        Py_XDECREF(meta);
        return -1;
    }
    const int v = pr->nvals++;
    pr->vkind[v] = kind;
    pr->vref[v] = ref;
    pr->vobj[v] = kind == V_CONST ? Py_NewRef((PyObject *)x) : NULL;
    pr->vmeta[v] = meta;
    return v;
}

/* Whether Array x has the metadata `meta` (shape, dtype, sharding) records. */
static int meta_match(PyObject *meta, ct_py_array *x) {
    if (x->shape == NULL || x->dtype == NULL || x->sharding == NULL) return 0;
    /* (shapes: tuples of ints, compared as C integers; anything else by Python's ==) */
    PyObject *ms = PyTuple_GET_ITEM(meta, 0);
    int eq = same_shape(ms, x->shape);
    if (!eq && (!PyTuple_CheckExact(ms) || !PyTuple_CheckExact(x->shape))) {
        eq = PyObject_RichCompareBool(ms, x->shape, Py_EQ);
        if (eq < 0) PyErr_Clear();
    }
    if (eq <= 0) return 0;
    if (PyTuple_GET_ITEM(meta, 1) != x->dtype) {
        eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(meta, 1), x->dtype, Py_EQ);
        if (eq <= 0) {
            PyErr_Clear();
            return 0;
        }
    }
    return same_layout(PyTuple_GET_ITEM(meta, 2), x->sharding);
}

/* meta_match for argument i of a run: a sharding object seen equal at an earlier run is
 * not compared again (shardings are immutable), only the shape and dtype. */
static int arg_match(program *pr, int i, ct_py_array *x) {
    PyObject *meta = pr->vmeta[i];
    if (pr->arg_sh != NULL && x->sharding != NULL && pr->arg_sh[i] == x->sharding &&
        x->shape != NULL && same_shape(PyTuple_GET_ITEM(meta, 0), x->shape) &&
        PyTuple_GET_ITEM(meta, 1) == x->dtype)
        return 1;
    if (!meta_match(meta, x)) return 0;
    if (pr->arg_sh == NULL) {
        pr->arg_sh = PyMem_Calloc(pr->nargs > 0 ? pr->nargs : 1, sizeof(PyObject *));
        if (pr->arg_sh == NULL) return 1; /* (no cache: compared every time) */
    }
    Py_XSETREF(pr->arg_sh[i], Py_NewRef(x->sharding));
    return 1;
}

/* The value of an operand or output x: known by its first buffer, or a new constant.
 * -1 with an exception; -2 when it broke the program. */
static int value_of(program *pr, ct_py_array *x) {
    PyObject *buf = first_buffer(x);
    if (buf == NULL) {
        program_break(pr, "an Array without blocks");
        return -2;
    }
    PyObject *key = PyLong_FromVoidPtr(buf);
    if (key == NULL) return -1;
    PyObject *idx = PyDict_GetItemWithError(pr->bufmap, key);
    if (idx != NULL) {
        Py_DECREF(key);
        const int v = (int)PyLong_AsLong(idx);
        if (!meta_match(pr->vmeta[v], x)) {
            program_break(pr, "an Array over a traced value's buffers with another shape, "
                              "dtype or sharding (a view)");
            return -2;
        }
        return v;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    /* a constant, unless it shares a traced buffer */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(x->blocks); i++) {
        PyObject *t = PyList_GET_ITEM(x->blocks, i);
        PyObject *k = PyTuple_Check(t) && PyTuple_GET_SIZE(t) >= 2
                          ? PyLong_FromVoidPtr(PyTuple_GET_ITEM(t, 1)) : NULL;
        int in = k != NULL ? PySet_Contains(pr->traced, k) : -1;
        Py_XDECREF(k);
        if (in != 0) {
            Py_DECREF(key);
            if (in < 0) return -1;
            program_break(pr, "an Array sharing a traced value's buffers");
            return -2;
        }
    }
    Py_DECREF(key);
    return add_value(pr, x, V_CONST, 0);
}

static int grow_steps(program *pr) {
    if (pr->nsteps < pr->scap) return 0;
    int cap = pr->scap ? 2 * pr->scap : 16;
    pstep *st = PyMem_Realloc(pr->steps, cap * sizeof(pstep));
    if (st == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pr->steps = st;
    pr->scap = cap;
    return 0;
}

static int trace_note(prim *p, const plan_entry *e, ct_py_array *a, ct_py_array *b,
                      PyObject *scalar, PyObject *res) {
    program *pr = recorder;
    if (pr->broken != NULL || pr->thread != PyThread_get_thread_ident()) return 0;
    int va = value_of(pr, a);
    int vb = va >= 0 && b != NULL ? value_of(pr, b) : -1;
    if (va == -1 || (b != NULL && vb == -1)) return -1;
    if (va == -2 || (b != NULL && vb == -2)) return 0;
    if (grow_steps(pr) < 0) return -1;
    plan_entry copy;
    memcpy(&copy, e, sizeof copy);
    if (entry_copy_blocks(&copy, e) < 0) return -1;
    const int vo = add_value(pr, (ct_py_array *)res, V_STEP, pr->nsteps);
    if (vo == -1 || vo == -2) {
        PyMem_Free(copy.bmem);
        return vo == -1 ? -1 : 0;
    }
    pstep *st = &pr->steps[pr->nsteps++];
    memcpy(&st->e, &copy, sizeof copy);
    st->e.ka_shape = st->e.ka_dtype = st->e.ka_sharding = NULL; /* (the key is the cache's) */
    st->e.kb_shape = st->e.kb_dtype = st->e.kb_sharding = st->e.kstatics = NULL;
    st->e.busy = 0;
    Py_XINCREF(st->e.out_shape);
    Py_XINCREF(st->e.out_dtype);
    Py_XINCREF(st->e.out_sharding);
    Py_XINCREF(st->e.out_shard_shape);
    for (int i = 0; i < st->e.nblk; i++) {
        Py_XINCREF(st->e.bdev[i]);
        Py_XINCREF(st->e.bstart[i]);
        Py_XINCREF(st->e.brid[i]);
    }
    st->name = Py_NewRef(p->name);
    st->scalar = Py_XNewRef(scalar);
    st->a = va;
    st->b = vb;
    st->out = vo;
    st->fn = NULL;
    st->io = NULL;
    st->alias = NULL;
    st->scratch = NULL;
    st->nin = st->nout = 0;
    st->dead = 0;
    return 0;
}

static PyObject *program_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0))
        return PyErr_Format(PyExc_TypeError, "Program() takes no arguments");
    program *pr = (program *)type->tp_alloc(type, 0);
    if (pr != NULL) { /* (tp_alloc zeroes every other field) */
        const char *g = getenv("CTRAINSTATE_CUDA_GRAPHS");
        pr->fuse = pr->tile = 1;
        pr->graphs = g == NULL || strcmp(g, "0") != 0;
    }
    return (PyObject *)pr;
}

static void program_free_values(program *pr) {
    for (int v = 0; v < pr->nvals; v++) {
        Py_CLEAR(pr->vobj[v]);
        Py_CLEAR(pr->vmeta[v]);
    }
    if (pr->arg_sh != NULL)
        for (int i = 0; i < pr->nargs; i++) Py_CLEAR(pr->arg_sh[i]);
    PyMem_Free(pr->arg_sh);
    pr->arg_sh = NULL;
}

static void step_clear(pstep *st) {
    entry_clear(&st->e);
    Py_CLEAR(st->scratch);
    Py_CLEAR(st->name);
    Py_CLEAR(st->scalar);
    Py_CLEAR(st->fn);
    PyMem_Free(st->io);
    PyMem_Free(st->alias);
    st->io = NULL;
    st->alias = NULL;
}

static void plan_free(program *pr);

static int program_clear(program *pr) {
    plan_free(pr);
    for (int k = 0; k < pr->nsteps; k++) step_clear(&pr->steps[k]);
    pr->nsteps = 0;
    program_free_values(pr);
    pr->nvals = 0;
    Py_CLEAR(pr->out_objs);
    Py_CLEAR(pr->broken);
    Py_CLEAR(pr->broken_at);
    Py_CLEAR(pr->bufmap);
    Py_CLEAR(pr->traced);
    Py_CLEAR(pr->keep);
    return 0;
}

static int program_traverse(program *pr, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(pr));
    for (int k = 0; k < pr->nsteps; k++) Py_VISIT(pr->steps[k].fn);
    for (int v = 0; v < pr->nvals; v++) Py_VISIT(pr->vobj[v]);
    if (pr->arg_sh != NULL)
        for (int i = 0; i < pr->nargs; i++) Py_VISIT(pr->arg_sh[i]);
    Py_VISIT(pr->out_objs);
    Py_VISIT(pr->bufmap);
    Py_VISIT(pr->traced);
    Py_VISIT(pr->keep);
    return 0;
}

static void program_dealloc(program *pr) {
    PyObject_GC_UnTrack(pr);
    if (recorder == pr) recorder = NULL;
    program_clear(pr);
    PyMem_Free(pr->steps);
    PyMem_Free(pr->vkind);
    PyMem_Free(pr->vref);
    PyMem_Free(pr->vobj);
    PyMem_Free(pr->vmeta);
    PyMem_Free(pr->last_use);
    PyMem_Free(pr->out_vals);
    PyMem_Free(pr->step_ns);
    PyTypeObject *tp = Py_TYPE(pr);
    tp->tp_free((PyObject *)pr);
    Py_DECREF(tp);
}

/* trace_begin(program, args): record on this thread; args are the Arrays the function's
 * arguments flatten to (the values a replay takes, in this order). */
static PyObject *py_trace_begin(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2 || !Py_IS_TYPE(args[0], program_type) || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "trace_begin(program: Program, args: list)");
    program *pr = (program *)args[0];
    if (recorder != NULL)
        return PyErr_Format(PyExc_RuntimeError, "trace_begin: a program is already recording");
    if (pr->finished || pr->nsteps || pr->nvals || pr->bufmap)
        return PyErr_Format(PyExc_RuntimeError, "trace_begin: the program was recorded before");
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[1]); i++)
        if (!Py_IS_TYPE(PyList_GET_ITEM(args[1], i), at))
            return PyErr_Format(PyExc_TypeError, "trace_begin: argument %zd is not an Array", i);
    pr->bufmap = PyDict_New();
    pr->traced = PySet_New(NULL);
    pr->keep = PyList_New(0);
    if (pr->bufmap == NULL || pr->traced == NULL || pr->keep == NULL) return NULL;
    pr->nargs = (int)PyList_GET_SIZE(args[1]);
    for (int i = 0; i < pr->nargs; i++) {
        PyObject *x = PyList_GET_ITEM(args[1], i);
        PyObject *buf = first_buffer((ct_py_array *)x);
        PyObject *key = buf != NULL ? PyLong_FromVoidPtr(buf) : NULL;
        int seen = key != NULL ? PyDict_Contains(pr->bufmap, key) : -1;
        Py_XDECREF(key);
        if (seen < 0) return NULL;
        if (seen) program_break(pr, "one Array passed as two arguments");
        if (add_value(pr, (ct_py_array *)x, V_ARG, i) == -1) return NULL;
    }
    pr->thread = PyThread_get_thread_ident();
    recorder = pr;
    Py_RETURN_NONE;
}

/* trace_node(name, fn, ins, pure=False): fn(ins) (a list of Arrays in, a list of Arrays out),
 * run with the recording paused; while a program records on this thread, the call becomes one
 * step of it that replays by calling fn again with that step's input Arrays. Without `pure`:
 * an optimizer step that updates its inputs in place (TrainState.apply_gradients under jit);
 * an input the trace does not know (an Array made outside the traced function) breaks the
 * program, since the step would change it in place on every replay. With `pure`: an op
 * without a C plan (a gather, a random draw from a key Array: python/ctrainstate/_src/ops/
 * node.py) that makes new outputs from its inputs, constants included; it is dropped when no
 * output is used, and its outputs are new memory in the memory plan. Host reads inside fn
 * are the op computing on concrete values and do not break the program. */
static PyObject *py_trace_node(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n < 3 || n > 4 || !PyUnicode_Check(args[0]) || !PyCallable_Check(args[1]) ||
        !PyList_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "trace_node(name: str, fn: callable, ins: list, "
                                             "pure: bool = False)");
    PyObject *fn = args[1], *ins = args[2];
    const int pure = n == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (pure < 0) return NULL;
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    const Py_ssize_t nin = PyList_GET_SIZE(ins);
    program *pr = recorder;
    if (pr != NULL && pr->thread != PyThread_get_thread_ident()) pr = NULL;
    program *paused = pr;
    if (pr != NULL && pr->broken != NULL) pr = NULL;
    int *io = NULL;
    if (pr != NULL) {
        io = PyMem_Calloc(nin > 0 ? (size_t)nin : 1, sizeof(int));
        if (io == NULL) return PyErr_NoMemory();
        for (Py_ssize_t i = 0; pr != NULL && i < nin; i++) {
            PyObject *x = PyList_GET_ITEM(ins, i);
            if (!Py_IS_TYPE(x, at)) {
                program_break(pr, pure ? "a node's input that is not an Array"
                                       : "a step in place on a value that is not an Array");
                pr = NULL;
                break;
            }
            int v = value_of(pr, (ct_py_array *)x);
            if (v == -1) {
                PyMem_Free(io);
                return NULL;
            }
            if (v >= 0 && pr->vkind[v] == V_CONST && !pure)
                program_break(pr, "a step in place (an optimizer step) on an Array that is not an "
                                  "argument of the jitted function nor computed in it: pass the "
                                  "train state as an argument");
            if (v < 0 || pr->broken != NULL) pr = NULL;
            else io[i] = v;
        }
    }
    if (paused != NULL) recorder = NULL; /* fn's own calls are not steps */
    /* a pure node's own allocations (its outputs, and the temporaries of its Python code):
     * each device's peak restarted at what is in use, read after, and restored */
    enum { MAXDEV = 256 };
    size_t used0[MAXDEV], peak0[MAXDEV];
    ct_device *devs[MAXDEV];
    int ndev = 0;
    if (pure && pr != NULL) {
        for (int pl = 0; pl < CT_NUM_PLATFORMS; pl++) {
            const int c = ct_device_count((ct_platform)pl);
            for (int i = 0; i < c && ndev < MAXDEV; i++) {
                ct_device *d = ct_device_get((ct_platform)pl, i);
                if (d == NULL) continue;
                devs[ndev] = d;
                used0[ndev] = atomic_load(&d->bytes_in_use);
                peak0[ndev] = atomic_exchange(&d->peak_bytes_in_use, used0[ndev]);
                ndev++;
            }
        }
        ct_clear_error();
    }
    /* (the cyclic GC paused meanwhile: a collection that freed other Arrays during fn would
     * lower what is in use below the restarted peak and hide that much of fn's temporaries) */
    const int gc_was = ndev > 0 ? PyGC_Disable() : 0;
    PyObject *outs = PyObject_CallOneArg(fn, ins);
    if (gc_was) PyGC_Enable();
    if (paused != NULL) recorder = paused;
    PyObject *scratch = NULL;
    if (ndev > 0) {
        int nz = 0;
        size_t extra[MAXDEV], kept[MAXDEV], outb[MAXDEV] = {0};
        /* what it keeps besides its outputs (a differentiated op's tape: residuals that live
         * until its backward node) */
        for (Py_ssize_t j = 0; outs != NULL && PyList_Check(outs) && j < PyList_GET_SIZE(outs); j++) {
            ct_py_array *y = (ct_py_array *)PyList_GET_ITEM(outs, j);
            if (!Py_IS_TYPE((PyObject *)y, at) || y->blocks == NULL || !PyList_Check(y->blocks))
                continue;
            for (Py_ssize_t q = 0; q < PyList_GET_SIZE(y->blocks); q++) {
                PyObject *t = PyList_GET_ITEM(y->blocks, q);
                PyObject *b = PyTuple_Check(t) && PyTuple_GET_SIZE(t) >= 2 ? PyTuple_GET_ITEM(t, 1) : NULL;
                if (b == NULL || !Py_IS_TYPE(b, &ct_py_BufferType)) continue;
                for (int i = 0; i < ndev; i++)
                    if (devs[i] == ((ct_py_buffer *)b)->dev) outb[i] += ((ct_py_buffer *)b)->nbytes;
            }
        }
        for (int i = 0; i < ndev; i++) {
            const size_t p1 = atomic_load(&devs[i]->peak_bytes_in_use);
            const size_t u1 = atomic_load(&devs[i]->bytes_in_use);
            extra[i] = p1 > used0[i] ? p1 - used0[i] : 0;
            kept[i] = u1 > used0[i] + outb[i] ? u1 - used0[i] - outb[i] : 0;
            nz += extra[i] > 0 || kept[i] > 0;
            size_t cur = p1; /* the peak as it would have been: the larger of both */
            while (peak0[i] > cur &&
                   !atomic_compare_exchange_weak(&devs[i]->peak_bytes_in_use, &cur, peak0[i])) {
            }
        }
        scratch = outs != NULL ? PyTuple_New(nz) : NULL;
        for (int i = 0, j = 0; scratch != NULL && i < ndev; i++) {
            if (extra[i] == 0 && kept[i] == 0) continue;
            PyObject *e = Py_BuildValue("(inn)", devs[i]->id, (Py_ssize_t)extra[i],
                                        (Py_ssize_t)kept[i]);
            if (e == NULL) {
                Py_CLEAR(scratch);
                break;
            }
            PyTuple_SET_ITEM(scratch, j++, e);
        }
        if (outs != NULL && scratch == NULL) {
            Py_DECREF(outs);
            PyMem_Free(io);
            return NULL;
        }
    }
    if (outs == NULL || pr == NULL) {
        PyMem_Free(io);
        Py_XDECREF(scratch);
        return outs;
    }
    if (!PyList_Check(outs)) {
        PyMem_Free(io);
        Py_XDECREF(scratch);
        Py_DECREF(outs);
        return PyErr_Format(PyExc_TypeError, "trace_node: fn must return a list of Arrays");
    }
    const Py_ssize_t nout = PyList_GET_SIZE(outs);
    int *io2 = PyMem_Realloc(io, (size_t)(nin + nout > 0 ? nin + nout : 1) * sizeof(int));
    if (io2 == NULL || grow_steps(pr) < 0) {
        PyMem_Free(io2 != NULL ? io2 : io);
        Py_XDECREF(scratch);
        Py_DECREF(outs);
        return io2 == NULL ? PyErr_NoMemory() : NULL;
    }
    io = io2;
    int *alias = pure ? PyMem_Malloc((size_t)(nout > 0 ? nout : 1) * sizeof(int)) : NULL;
    if (pure && alias == NULL) {
        PyMem_Free(io);
        Py_XDECREF(scratch);
        Py_DECREF(outs);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t j = 0; j < nout; j++) {
        PyObject *y = PyList_GET_ITEM(outs, j);
        if (alias != NULL) { /* an output over an input's buffers (a vjp passing g through) */
            alias[j] = -1;
            PyObject *yb = Py_IS_TYPE(y, at) ? first_buffer((ct_py_array *)y) : NULL;
            for (Py_ssize_t i = 0; yb != NULL && i < nin && alias[j] < 0; i++) {
                PyObject *x = PyList_GET_ITEM(ins, i);
                if (Py_IS_TYPE(x, at) && first_buffer((ct_py_array *)x) == yb) alias[j] = io[i];
            }
        }
        int v = Py_IS_TYPE(y, at) ? add_value(pr, (ct_py_array *)y, V_STEP, pr->nsteps) : -2;
        if (v == -1) {
            PyMem_Free(io);
            PyMem_Free(alias);
            Py_XDECREF(scratch);
            Py_DECREF(outs);
            return NULL;
        }
        if (v == -2) {
            program_break(pr, pure ? "a node that returned something other than Arrays"
                                   : "a step in place that returned something other than Arrays");
            PyMem_Free(io);
            PyMem_Free(alias);
            Py_XDECREF(scratch);
            return outs;
        }
        io[nin + j] = v;
    }
    pstep *st = &pr->steps[pr->nsteps++];
    memset(st, 0, sizeof *st);
    st->name = Py_NewRef(args[0]);
    st->fn = Py_NewRef(fn);
    st->a = st->b = st->out = -1;
    st->nin = (int)nin;
    st->nout = (int)nout;
    st->io = io;
    st->alias = alias;
    st->pure = pure;
    st->scratch = scratch;
    return outs;
}

/* A new 0-d int32 Array of value v placed as `tmpl` (a 0-d int32 Array on one device). */
static PyObject *int_array(ct_py_array *tmpl, int32_t v) {
    PyObject *t0 = PyList_GET_ITEM(tmpl->blocks, 0);
    ct_py_buffer *tb = (ct_py_buffer *)PyTuple_GET_ITEM(t0, 1);
    ct_py_buffer *b = ct_py_buffer_alloc(tb->dev, 0, NULL, CT_I32);
    if (b == NULL) return NULL;
    const int64_t one = 1, st = 4;
    ct_status cs = b->dev->backend->copy_block(b->dev, NULL, 1, &one, 4, b->data, &st, &v, &st);
    if (cs != CT_OK) {
        Py_DECREF(b);
        return ct_py_raise(cs);
    }
    PyObject *t = PyTuple_Pack(4, PyTuple_GET_ITEM(t0, 0), (PyObject *)b, PyTuple_GET_ITEM(t0, 2),
                               PyTuple_GET_ITEM(t0, 3));
    Py_DECREF(b);
    PyObject *bl = t != NULL ? PyList_New(1) : NULL;
    if (bl == NULL) {
        Py_XDECREF(t);
        return NULL;
    }
    PyList_SET_ITEM(bl, 0, t);
    return ct_py_array_new(Py_NewRef(tmpl->shape), Py_NewRef(tmpl->dtype), Py_NewRef(tmpl->sharding),
                           bl, Py_NewRef(tmpl->shard_shape));
}

/* split_args(leaves, int_template=None): a jitted call's argument leaves as (the Arrays, in
 * order; the rest of the key: None for an Array, (type, value) for None / bool / int / float /
 * str; the leaves the function is traced with, or None when they are `leaves`), or (None, the
 * name of the first other leaf's type, None) when the call cannot be replayed. With
 * int_template (a 0-d int32 Array on one device), a Python int in the int32 range becomes a
 * new int32 Array placed as the template (its key part None: traced, as jax traces a Python
 * int as a weakly typed int32), so that a counter passed as an int (TrainState.step) does not
 * make a new program per value. */
static PyObject *py_split_args(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2 || !PyList_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "split_args(leaves: list, int_template=None)");
    PyObject *leaves = args[0];
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    ct_py_array *tmpl = NULL;
    if (nargs == 2 && args[1] != Py_None) {
        ct_py_array *t = (ct_py_array *)args[1];
        if (!Py_IS_TYPE(args[1], at) || !PyList_Check(t->blocks) ||
            PyList_GET_SIZE(t->blocks) != 1 || !PyTuple_Check(t->shape) ||
            PyTuple_GET_SIZE(t->shape) != 0 || ((ct_py_buffer *)PyTuple_GET_ITEM(
                PyList_GET_ITEM(t->blocks, 0), 1))->dtype != CT_I32)
            return PyErr_Format(PyExc_TypeError, "split_args: int_template must be a 0-d int32 "
                                                 "Array on one device");
        tmpl = t;
    }
    const Py_ssize_t n = PyList_GET_SIZE(leaves);
    PyObject *arrays = PyList_New(0), *parts = PyTuple_New(n), *traced = NULL;
    if (arrays == NULL || parts == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(leaves, i), *part;
        int overflow = 0;
        long long v = tmpl != NULL && PyLong_CheckExact(x) ? PyLong_AsLongLongAndOverflow(x, &overflow)
                                                          : 0;
        if (v == -1 && PyErr_Occurred()) goto fail;
        if (Py_IS_TYPE(x, at)) {
            if (PyList_Append(arrays, x) < 0) goto fail;
            part = Py_NewRef(Py_None);
        } else if (tmpl != NULL && PyLong_CheckExact(x) && !overflow && v >= INT32_MIN &&
                   v <= INT32_MAX) {
            PyObject *a = int_array(tmpl, (int32_t)v);
            if (a == NULL) goto fail;
            if (traced == NULL && (traced = PyList_GetSlice(leaves, 0, n)) == NULL) {
                Py_DECREF(a);
                goto fail;
            }
            PyList_SetItem(traced, i, Py_NewRef(a)); /* (steals; the old item released) */
            int rc = PyList_Append(arrays, a);
            Py_DECREF(a);
            if (rc < 0) goto fail;
            part = Py_NewRef(Py_None);
        } else if (x == Py_None || PyBool_Check(x) || PyLong_CheckExact(x) ||
                   PyFloat_CheckExact(x) || PyUnicode_CheckExact(x)) {
            part = PyTuple_Pack(2, (PyObject *)Py_TYPE(x), x);
            if (part == NULL) goto fail;
        } else {
            Py_DECREF(arrays);
            Py_DECREF(parts);
            Py_XDECREF(traced);
            return Py_BuildValue("(OsO)", Py_None, Py_TYPE(x)->tp_name, Py_None);
        }
        PyTuple_SET_ITEM(parts, i, part);
    }
    PyObject *r = PyTuple_Pack(3, arrays, parts, traced != NULL ? traced : Py_None);
    Py_DECREF(arrays);
    Py_DECREF(parts);
    Py_XDECREF(traced);
    return r;
fail:
    Py_XDECREF(arrays);
    Py_XDECREF(parts);
    Py_XDECREF(traced);
    return NULL;
}

/* int_like(template, value): a new 0-d int32 Array of `value` placed as `template`. */
static PyObject *py_int_like(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    ct_py_array *t = nargs == 2 && Py_IS_TYPE(args[0], at) ? (ct_py_array *)args[0] : NULL;
    if (t == NULL || !PyList_Check(t->blocks) || PyList_GET_SIZE(t->blocks) != 1 ||
        !PyTuple_Check(t->shape) || PyTuple_GET_SIZE(t->shape) != 0 ||
        ((ct_py_buffer *)PyTuple_GET_ITEM(PyList_GET_ITEM(t->blocks, 0), 1))->dtype != CT_I32 ||
        !PyLong_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "int_like(template: a 0-d int32 Array on one "
                                             "device, value: int)");
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (overflow || v < INT32_MIN || v > INT32_MAX)
        return PyErr_Format(PyExc_OverflowError, "int_like: %R is not an int32", args[1]);
    return int_array(t, (int32_t)v);
}

static PyObject *py_trace_end(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    recorder = NULL;
    Py_RETURN_NONE;
}

/* trace_break(reason, x=None): the program recording on this thread (if any) cannot be
 * replayed, for `reason` — when x is None, or x is an Array over traced buffers. Returns
 * whether it broke it. For what reads traced values on purpose and runs eagerly instead (lax
 * control flow on a traced predicate, debug.print of a traced value). */
static PyObject *py_trace_break(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n < 1 || n > 2 || !PyUnicode_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "trace_break(reason: str, x=None)");
    program *pr = recorder;
    if (pr == NULL || pr->traced == NULL || pr->thread != PyThread_get_thread_ident())
        Py_RETURN_FALSE;
    if (n == 2 && args[1] != Py_None) {
        PyTypeObject *at = ct_py_array_type();
        if (at == NULL) return NULL;
        if (!Py_IS_TYPE(args[1], at)) Py_RETURN_FALSE;
        PyObject *buf = first_buffer((ct_py_array *)args[1]);
        if (buf == NULL) Py_RETURN_FALSE;
        PyObject *k = PyLong_FromVoidPtr(buf);
        const int in = k != NULL ? PySet_Contains(pr->traced, k) : -1;
        Py_XDECREF(k);
        if (in < 0) return NULL;
        if (!in) Py_RETURN_FALSE;
    }
    const char *why = PyUnicode_AsUTF8(args[0]);
    if (why == NULL) return NULL;
    program_break(pr, why);
    Py_RETURN_TRUE;
}

static PyObject *py_trace_active(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyBool_FromLong(recorder != NULL && recorder->thread == PyThread_get_thread_ident());
}

/* --- fused chains ---------------------------------------------------------------------------
 * Consecutive elementwise float32 steps (unary, scalar, binary) where each result is read only
 * by the next step, on the same blocks, run as one chain: the first step writes the last
 * step's output buffers, every later step updates them in place (the other operand of a
 * binary step read as before), so the intermediates are never allocated. Each kernel is the
 * one the unfused step runs, on the same elements in the same order: the same bits. */
#define MAX_CHAIN 16

static int is_ewise_f32(const pstep *st) {
    return st->fn == NULL &&
           (st->e.kind == K_UNARY || st->e.kind == K_SCALAR || st->e.kind == K_BINARY) &&
           st->e.ngroups == 0 && st->e.out_dt == CT_F32;
}

/* Whether step q (= p + 1) can continue a chain through step p; *side: q's operand that is
 * p's result. */
static int chainable(const program *pr, int p, int q, int *side) {
    const pstep *sp = &pr->steps[p], *sq = &pr->steps[q];
    if (!is_ewise_f32(sp) || !is_ewise_f32(sq)) return 0;
    const int v = sp->out;
    if (pr->vkind[v] != V_STEP || pr->last_use[v] != q || (sq->a == v && sq->b == v)) return 0;
    if (sq->a == v) *side = 0;
    else if (sq->b == v && sq->e.kind == K_BINARY) *side = 1;
    else return 0;
    const plan_entry *ep = &sp->e, *eq = &sq->e;
    if (ep->nblk != eq->nblk || ep->out_elems != eq->out_elems || ep->out_ndim != eq->out_ndim)
        return 0;
    for (int d = 0; d < ep->out_ndim; d++)
        if (ep->out_sdims[d] != eq->out_sdims[d]) return 0;
    for (int i = 0; i < ep->nblk; i++)
        if (ep->cdev[i] != eq->cdev[i] || ep->rep_of[i] != eq->rep_of[i]) return 0;
    return 1;
}

static void find_chains(program *pr) {
    for (int k = 0; k < pr->nsteps; k++) pr->steps[k].chain = pr->steps[k].chain_side = 0;
    for (int k = 0; k < pr->nsteps;) {
        int len = 1, side;
        while (k + len < pr->nsteps && len < MAX_CHAIN && chainable(pr, k + len - 1, k + len, &side))
            pr->steps[k + len++].chain_side = side;
        if (len >= 2) pr->steps[k].chain = len;
        k += len;
    }
}

/* The non-chained operand of chain step st (a later step: the one that is not the previous
 * result; the first step: a, then b through *second). */
static int chain_other(const pstep *st, int first) {
    if (first) return st->a;
    return st->chain_side == 0 ? st->b : st->a;
}

/* Rows [r0, r1) (along dimension 0 of the output block o) of a chain step's kernel: the same
 * kernel run_block calls, on that part of the elements (a unary or scalar step: the elements
 * of those rows; a binary step: those rows of the output and the matching rows of each
 * operand, by its broadcast strides). */
static ct_status run_rows(const plan_entry *e, ct_device *dev, const ct_py_buffer *x,
                          const ct_py_buffer *y, ct_py_buffer *o, int64_t r0, int64_t r1,
                          float alpha, float beta) {
    const int64_t inner = o->ndim > 0 && o->shape[0] > 0 ? nelem(o) / o->shape[0] : 1;
    float *out = (float *)o->data + r0 * inner;
    if (e->kind == K_UNARY || e->kind == K_SCALAR)
        return ct_op_unary(dev, e->op == S_DIV_L && e->kind == K_SCALAR ? CT_UN_RDIV :
                                e->kind == K_SCALAR ? CT_UN_AFFINE : e->op,
                           alpha, beta, (r1 - r0) * inner, (const float *)x->data + r0 * inner, out);
    int64_t sa[CT_MAX_NDIM], sb[CT_MAX_NDIM], shape[CT_MAX_NDIM];
    ct_status st = ct_broadcast_strides(o->ndim, o->shape, x->ndim, x->shape, sa);
    if (st == CT_OK) st = ct_broadcast_strides(o->ndim, o->shape, y->ndim, y->shape, sb);
    if (st != CT_OK) return st;
    memcpy(shape, o->shape, (size_t)o->ndim * sizeof *shape);
    shape[0] = r1 - r0;
    return ct_op_binary(dev, e->op, o->ndim, shape, out, (const float *)x->data + r0 * sa[0], sa,
                        (const float *)y->data + r0 * sb[0], sb);
}

/* A chain's elements per tile on a CPU device: each thread takes tiles of rows and runs every
 * step of the chain on its tile before the next, so the tile stays in cache between steps
 * (one pass over memory instead of one per step). At most the kernels' own parallel threshold,
 * so the kernels run single-threaded inside the chain's parallel loop. */
#define CHAIN_TILE 16384

/* Block i of a chain on a CPU device, tiled (see CHAIN_TILE); CT_EINVAL-free kernels set
 * their error on the thread that fails, so a failed tile is reported by running the block
 * again step by step on this thread. Returns 1 when the block does not tile (the caller runs
 * it step by step). */
static int chain_block_tiled(const program *pr, int k0, int len, int i, ct_py_buffer **ops,
                             ct_py_buffer **os, const float *alpha, const float *beta,
                             ct_status *cst) {
    const pstep *head = &pr->steps[k0];
    const int nblk = head->e.nblk;
    ct_py_buffer *o = os[i];
    ct_device *dev = head->e.cdev[i];
    if (dev->platform != CT_PLATFORM_CPU || o->ndim < 1) return 1;
    const int64_t rows = o->shape[0], total = nelem(o);
    const int64_t inner = rows > 0 ? total / rows : 0;
    if (rows < 2 || inner <= 0 || total < 2 * CHAIN_TILE) return 1;
    const int64_t trows = inner >= CHAIN_TILE ? 1 : CHAIN_TILE / inner;
    const int64_t ntiles = (rows + trows - 1) / trows;
    int failed = 0;
    CT_PAR_FOR(ct_par_threads(1), t, ntiles, {
        const int64_t r0 = t * trows, r1 = r0 + trows < rows ? r0 + trows : rows;
        ct_status ts = run_rows(&head->e, dev, ops[i], head->b >= 0 ? ops[(size_t)nblk + i] : NULL,
                                o, r0, r1, alpha[0], beta[0]);
        for (int j = 1; j < len && ts == CT_OK; j++) {
            const pstep *st = &pr->steps[k0 + j];
            const ct_py_buffer *other = st->e.kind == K_BINARY ? ops[(size_t)(j + 1) * nblk + i] : NULL;
            ts = st->chain_side == 0 ? run_rows(&st->e, dev, o, other, o, r0, r1, alpha[j], beta[j])
                                     : run_rows(&st->e, dev, other, o, o, r0, r1, alpha[j], beta[j]);
        }
        if (ts != CT_OK) {
            _Pragma("omp atomic write")
            failed = 1;
        }
    });
    *cst = CT_OK;
    return failed; /* (a failure: run again step by step, which reports it here) */
}

/* Block i of a chain as one kernel of its device's backend (ct_op_chain: a GPU), the steps
 * described by their ops, constants and other operands. Returns 1 when the block does not fit
 * a chain kernel (rank, steps; the caller runs the steps one by one), else 0 with *cst. */
static int chain_block_kernel(const program *pr, int k0, int len, int i, ct_py_buffer **ops,
                              ct_py_buffer **os, const float *alpha, const float *beta,
                              ct_status *cst) {
    const pstep *head = &pr->steps[k0];
    const int nblk = head->e.nblk;
    ct_py_buffer *o = os[i];
    *cst = CT_OK;
    if (o->ndim < 1 || o->ndim > CT_CHAIN_NDIM || len > CT_CHAIN_MAX) return 1;
    ct_chain_step steps[CT_CHAIN_MAX];
    int64_t as[CT_MAX_NDIM], tmp[CT_MAX_NDIM];
    memset(steps, 0, sizeof steps);
    for (int j = 0; j < len; j++) {
        const pstep *st = &pr->steps[k0 + j];
        ct_chain_step *cs = &steps[j];
        if (st->e.kind == K_BINARY) {
            const ct_py_buffer *other = j == 0 ? ops[(size_t)nblk + i] : ops[(size_t)(j + 1) * nblk + i];
            cs->binary = 1;
            cs->op = st->e.op;
            cs->side = j == 0 ? 0 : st->chain_side;
            cs->other = (const float *)other->data;
            *cst = ct_broadcast_strides(o->ndim, o->shape, other->ndim, other->shape, tmp);
            if (*cst != CT_OK) return 0;
            memcpy(cs->strides, tmp, (size_t)o->ndim * sizeof *tmp);
        } else {
            cs->op = st->e.op == S_DIV_L && st->e.kind == K_SCALAR ? CT_UN_RDIV :
                     st->e.kind == K_SCALAR ? CT_UN_AFFINE : st->e.op;
            cs->alpha = alpha[j];
            cs->beta = beta[j];
        }
    }
    if (head->e.kind == K_BINARY) {
        *cst = ct_broadcast_strides(o->ndim, o->shape, ops[i]->ndim, ops[i]->shape, as);
        if (*cst != CT_OK) return 0;
    } else { /* a unary head reads its operand element for element */
        if (nelem(ops[i]) != nelem(o)) return 1;
        int64_t stride = 1;
        for (int d = o->ndim - 1; d >= 0; d--) {
            as[d] = stride;
            stride *= o->shape[d];
        }
    }
    *cst = ct_op_chain(head->e.cdev[i], o->ndim, o->shape, (const float *)ops[i]->data, as, len,
                       steps, (float *)o->data);
    return 0;
}

/* The kernels of a chain, block by block (no Python: may run without the GIL). */
static ct_status chain_kernels(const program *pr, int k0, int len, ct_py_buffer **ops,
                               ct_py_buffer **os, const float *alpha, const float *beta) {
    const pstep *head = &pr->steps[k0];
    const int nblk = head->e.nblk;
    ct_status cst = CT_OK;
    for (int i = 0; i < nblk && cst == CT_OK; i++) {
        const int r = head->e.rep_of[i];
        if (r >= 0 && os[r]->nbytes == os[i]->nbytes) { /* a replica: the same bits, copied */
            memcpy(os[i]->data, os[r]->data, os[i]->nbytes);
            continue;
        }
        if (pr->tile && chain_block_tiled(pr, k0, len, i, ops, os, alpha, beta, &cst) == 0)
            continue;
        if (pr->tile && head->e.cdev[i]->backend->chain != NULL) {
            const int r2 = chain_block_kernel(pr, k0, len, i, ops, os, alpha, beta, &cst);
            if (r2 == 0 || cst != CT_OK) continue;
        }
        cst = run_block(&head->e, i, ops[i], head->b >= 0 ? ops[(size_t)nblk + i] : NULL, os[i],
                        alpha[0], beta[0], 0);
        for (int j = 1; j < len && cst == CT_OK; j++) {
            const pstep *st = &pr->steps[k0 + j];
            ct_py_buffer *other = st->e.kind == K_BINARY ? ops[(size_t)(j + 1) * nblk + i] : NULL;
            cst = st->chain_side == 0 ? run_block(&st->e, i, os[i], other, os[i], alpha[j], beta[j], 0)
                                      : run_block(&st->e, i, other, os[i], os[i], alpha[j], beta[j], 0);
        }
    }
    return cst;
}

/* The chain of steps k0 .. k0 + len - 1 on operand rows `ops` (see run_chain) into the
 * result's blocks `os`: its constants, then its kernels (without the GIL when large, the
 * operands pinned). 0, or -1 with an exception. */
static int chain_run_bufs(const program *pr, int k0, int len, ct_py_buffer **ops,
                          ct_py_buffer **os) {
    const int nblk = pr->steps[k0].e.nblk;
    float alpha[MAX_CHAIN], beta[MAX_CHAIN];
    for (int j = 0; j < len; j++) {
        const pstep *st = &pr->steps[k0 + j];
        alpha[j] = beta[j] = 0.0f;
        if (st->e.kind == K_SCALAR &&
            (st->scalar == NULL || scalar_consts(st->e.op, st->scalar, &alpha[j], &beta[j]) != 0)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U) of the "
                                                "traced program no longer runs from its plan",
                                                k0 + j, st->name);
            return -1;
        }
    }
    ct_status cst;
    const int64_t work = pr->steps[k0].e.out_elems * nblk * len;
    if (work < CT_DISPATCH_GIL_ELEMS || capturing) {
        cst = chain_kernels(pr, k0, len, ops, os, alpha, beta);
    } else { /* pinned: another thread may drop or delete the operands meanwhile */
        for (size_t q = 0; q < (size_t)(len + 1) * (size_t)nblk; q++)
            if (ops[q] != NULL) ct_py_pin(ops[q]);
        Py_BEGIN_ALLOW_THREADS
        cst = chain_kernels(pr, k0, len, ops, os, alpha, beta);
        Py_END_ALLOW_THREADS
        for (size_t q = 0; q < (size_t)(len + 1) * (size_t)nblk; q++)
            if (ops[q] != NULL) ct_py_unpin(ops[q]);
    }
    if (cst != CT_OK) {
        ct_py_raise(cst);
        return -1;
    }
    return 0;
}

/* Run the chain of steps k0 .. k0 + len - 1 (see above); its result is the last step's value.
 * 0, or -1 with an exception. */
static int run_chain(program *pr, int k0, int len, PyObject **vals, int arena) {
    const pstep *tail = &pr->steps[k0 + len - 1];
    const plan_entry *et = &tail->e;
    const int nblk = et->nblk;
    ct_py_buffer **ops = PyMem_Calloc((size_t)(len + 1) * (size_t)(nblk > 0 ? nblk : 1),
                                      sizeof *ops);
    ct_py_buffer **os = PyMem_Calloc((size_t)(nblk > 0 ? nblk : 1), sizeof *os);
    PyObject *blocks = NULL;
    int made = 0, rc = -1;
    if (ops == NULL || os == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    /* operands: row 0 the head's a, row 1 the head's b (if any), row j + 1 step j's other */
    for (int j = 0; j < len; j++) {
        const pstep *st = &pr->steps[k0 + j];
        for (int r = 0; r < 2; r++) {
            const int v = j == 0 ? (r == 0 ? st->a : st->b) : (r == 0 ? chain_other(st, 0) : -1);
            if (v < 0 || (j > 0 && st->e.kind != K_BINARY)) continue;
            ct_py_buffer **row = &ops[(size_t)(j == 0 ? r : j + 1) * (size_t)nblk];
            if (arena && pr->internal[v]) {
                memcpy(row, &pr->views[pr->vfirst[v]], (size_t)nblk * sizeof *row);
            } else if (vals[v] == NULL ||
                       operand_buffers((ct_py_array *)vals[v], &st->e, row) != 0) {
                if (vals[v] != NULL && ct_py_array_check_alive(vals[v]) < 0) goto out;
                PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U) of the traced program no "
                             "longer runs from its plan", k0 + j, st->name);
                goto out;
            }
            for (int i = 0; i < nblk; i++)
                if (row[i]->dtype != CT_F32 ||
                    (st->e.kind != K_BINARY && nelem(row[i]) != st->e.out_elems)) {
                    PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U): an operand of another "
                                 "dtype or size than at the trace", k0 + j, st->name);
                    goto out;
                }
        }
    }
    const int in_arena = arena && pr->internal[tail->out];
    if (in_arena) /* (the arena's: nothing to allocate or release) */
        memcpy(os, &pr->views[pr->vfirst[tail->out]], (size_t)nblk * sizeof *os);
    for (; !in_arena && made < nblk; made++) {
        os[made] = ct_py_buffer_alloc(et->cdev[made], et->out_ndim, et->out_sdims, CT_F32);
        if (os[made] == NULL) goto out;
    }
    if (chain_run_bufs(pr, k0, len, ops, os) < 0) goto out;
    if (in_arena) goto release;
    blocks = PyList_New(nblk);
    if (blocks == NULL) goto out;
    for (int i = 0; i < nblk; i++) {
        PyObject *t = PyTuple_New(4);
        if (t == NULL) goto out;
        PyTuple_SET_ITEM(t, 0, Py_NewRef(et->bdev[i]));
        PyTuple_SET_ITEM(t, 1, (PyObject *)os[i]);
        PyTuple_SET_ITEM(t, 2, Py_NewRef(et->bstart[i]));
        PyTuple_SET_ITEM(t, 3, Py_NewRef(et->brid[i]));
        os[i] = NULL;
        PyList_SET_ITEM(blocks, i, t);
    }
    PyObject *y = ct_py_array_new(Py_NewRef(et->out_shape), Py_NewRef(et->out_dtype),
                                  Py_NewRef(et->out_sharding), blocks, Py_NewRef(et->out_shard_shape));
    blocks = NULL;
    if (y == NULL) goto out;
    Py_XSETREF(vals[tail->out], y);
release:
    /* the operands whose last use is in the chain: released now */
    for (int j = 0; j < len; j++) {
        const pstep *st = &pr->steps[k0 + j];
        const int vs[2] = {j == 0 ? st->a : chain_other(st, 0), j == 0 ? st->b : -1};
        for (int r = 0; r < 2; r++) {
            const int v = vs[r];
            if (v >= 0 && pr->vkind[v] == V_STEP && pr->last_use[v] >= k0 &&
                pr->last_use[v] < k0 + len)
                Py_CLEAR(vals[v]);
        }
    }
    rc = 0;
out:
    Py_XDECREF(blocks);
    if (os != NULL)
        for (int i = 0; i < made; i++) Py_XDECREF(os[i]);
    PyMem_Free(os);
    PyMem_Free(ops);
    return rc;
}

/* Whether step k runs inside a fused chain that starts before it. */
static int chain_inner(const program *pr, int k) {
    for (int j = k - 1; j >= 0 && j >= k - MAX_CHAIN; j--)
        if (pr->steps[j].chain >= 2) return j + pr->steps[j].chain > k;
    return 0;
}

/* program.finish(outputs): the function's output leaves (Arrays become values, anything else
 * is returned as it is), then the values' last uses. */
static PyObject *program_finish(program *pr, PyObject *outs) {
    if (pr->finished || pr->bufmap == NULL || recorder == pr)
        return PyErr_Format(PyExc_RuntimeError, "Program.finish: record it first (trace_begin, "
                                                "the function, trace_end), once");
    if (!PyList_Check(outs)) return PyErr_Format(PyExc_TypeError, "Program.finish takes a list");
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    const int n = (int)PyList_GET_SIZE(outs);
    pr->out_vals = PyMem_Calloc(n > 0 ? n : 1, sizeof(int));
    pr->out_objs = PyList_New(n);
    if (pr->out_vals == NULL || pr->out_objs == NULL) return PyErr_NoMemory();
    pr->nouts = n;
    for (int j = 0; j < n; j++) {
        PyObject *x = PyList_GET_ITEM(outs, j);
        pr->out_vals[j] = -1;
        if (Py_IS_TYPE(x, at)) {
            int v = pr->broken == NULL ? value_of(pr, (ct_py_array *)x) : -2;
            if (v == -1) return NULL;
            pr->out_vals[j] = v;
            PyList_SET_ITEM(pr->out_objs, j, Py_NewRef(Py_None));
        } else {
            PyList_SET_ITEM(pr->out_objs, j, Py_NewRef(x));
        }
    }
    pr->last_use = PyMem_Malloc((pr->nvals > 0 ? pr->nvals : 1) * sizeof(int));
    if (pr->last_use == NULL) return PyErr_NoMemory();
    /* dead steps (their results reach no output: a cotangent nobody asked for) are dropped */
    for (int v = 0; v < pr->nvals; v++) pr->last_use[v] = 0;
    for (int j = 0; j < n; j++)
        if (pr->out_vals[j] >= 0) pr->last_use[pr->out_vals[j]] = 1;
    int kept = 0;
    for (int k = pr->nsteps - 1; k >= 0; k--) {
        pstep *st = &pr->steps[k];
        if (st->fn != NULL && st->pure) { /* kept where an output is used */
            int used = 0;
            for (int j = 0; j < st->nout; j++) used |= pr->last_use[st->io[st->nin + j]];
            if (!used) {
                step_clear(st);
                st->dead = 1;
                continue;
            }
        }
        if (st->fn != NULL) { /* (a node in place changes its inputs: always kept) */
            kept++;
            for (int i = 0; i < st->nin; i++) pr->last_use[st->io[i]] = 1;
            continue;
        }
        if (!pr->last_use[st->out]) {
            step_clear(st);
            st->dead = 1;
            continue;
        }
        kept++;
        pr->last_use[st->a] = 1;
        if (st->b >= 0) pr->last_use[st->b] = 1;
    }
    int w = 0;
    for (int k = 0; k < pr->nsteps; k++)
        if (!pr->steps[k].dead) pr->steps[w++] = pr->steps[k];
    pr->nsteps = kept;
    for (int v = 0; v < pr->nvals; v++) {
        if (!pr->last_use[v] && pr->vkind[v] == V_CONST) Py_CLEAR(pr->vobj[v]); /* unused */
        pr->last_use[v] = -1;
    }
    for (int k = 0; k < pr->nsteps; k++) {
        pstep *st = &pr->steps[k];
        if (st->fn != NULL) {
            for (int i = 0; i < st->nin; i++) pr->last_use[st->io[i]] = k;
            continue;
        }
        pr->last_use[st->a] = k;
        if (st->b >= 0) pr->last_use[st->b] = k;
    }
    for (int j = 0; j < n; j++)
        if (pr->out_vals[j] >= 0) pr->last_use[pr->out_vals[j]] = INT32_MAX;
    if (pr->broken == NULL) find_chains(pr);
    Py_CLEAR(pr->bufmap);
    Py_CLEAR(pr->traced);
    Py_CLEAR(pr->keep);
    pr->finished = 1;
    if (pr->broken != NULL) { /* nothing to replay: drop the steps and constants */
        PyObject *why = pr->broken, *at = pr->broken_at;
        pr->broken = pr->broken_at = NULL;
        program_clear(pr);
        pr->broken = why;
        pr->broken_at = at;
    }
    Py_RETURN_NONE;
}

/* --- the static memory plan -------------------------------------------------------------
 * plan_memory lays out the internal values (see `program`) of each device in one arena. A
 * value is live from the step (or fused chain) that makes it to the end of the step or chain
 * that reads it last, both included (a kernel never writes over what it reads). The values
 * are placed in decreasing size, each at the lowest offset where it overlaps no placed value
 * live at the same time (best fit by size, as XLA's heap simulator's global decreasing-size
 * order): the arena is about the most bytes ever live at once. A run allocates each arena
 * once and points the values' Buffers into it; memory_plan reports the arenas, so
 * memory_analysis counts what the run allocates. */
/* Offsets in an arena are multiples of 64 bytes on CPU devices (a cache line: no two
 * values share one), 256 on others (a GPU kernel's loads stay aligned, as cudaMalloc's). */
static int64_t arena_align(const ct_device *dev) { return dev->platform == CT_PLATFORM_CPU ? 64 : 256; }

typedef struct {
    int j;           /* index in views / boff / barena */
    int arena;
    int64_t size;    /* aligned */
    int first, last; /* live over steps first..last */
} mblock;

static int cmp_mblock(const void *x, const void *y) {
    const mblock *a = x, *b = y;
    if (a->arena != b->arena) return a->arena < b->arena ? -1 : 1;
    if (a->size != b->size) return a->size > b->size ? -1 : 1;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    return a->j < b->j ? -1 : a->j > b->j;
}

typedef struct {
    int64_t off, end;
} mspan;

static int cmp_mspan(const void *x, const void *y) {
    const mspan *a = x, *b = y;
    return a->off < b->off ? -1 : a->off > b->off;
}

/* A run of steps replayed as one CUDA graph per device (graph_plan): plain steps and fused
 * chains whose blocks are all on GPU devices of a backend with graphs, with no all-reduce
 * between devices. A run allocates the values it makes that leave it (read by a node or
 * after, or outputs) before its kernels, then launches the graphs when every buffer the
 * kernels use is where it was at the capture; otherwise it captures them again (the
 * backend updates the graphs in place). */
#define GRAPH_CACHE 4 /* graphs kept per segment, for as many sets of addresses: a loop whose
                       * new state is made while the old one is alive alternates two */
typedef struct {
    void **exec;              /* per device: the graph, or NULL before its first capture */
    void **sig;               /* the addresses of the buffers the captured kernels use */
    int nsig;
    unsigned long long used;  /* when it was last launched (0: never) */
} gentry;

#define GRAPH_STAGE_BYTES 4096 /* a small value leaving a segment (a loss) is staged */

/* A small value that leaves a segment: the graphs write it into buffers of their own (held
 * with them), copied into a new Array after each launch. Such values' new blocks (a loss the
 * caller still holds while the next step runs) would otherwise come at other addresses at
 * each run, and so would the graphs' arguments. */
typedef struct {
    int v, k;           /* the value, and the step that makes it */
    ct_py_buffer **b;   /* per block (allocated at the first run) */
} gstage;

typedef struct gseg {
    int k0, k1;        /* its steps, k0 .. k1 - 1 */
    int ndev;
    ct_device **dev;   /* its devices */
    int nstage;
    gstage *stage;
    gentry ent[GRAPH_CACHE];
    unsigned long long clock;
    int matmul;        /* it has a matmul step (the precision is checked at each run) */
    int off;           /* a capture failed: its steps run one by one from then on */
    long long captures, updates, launches;
} gseg;

static void graphs_free(program *pr);
static int graph_plan(program *pr);

static void plan_free(program *pr) {
    graphs_free(pr);
    if (pr->arena_held) { /* (no run holds them: plan_free runs only then) */
        for (int a = 0; a < pr->narenas; a++)
            if (pr->arena_mem[a] != NULL)
                ct_device_free(pr->arena_dev[a], pr->arena_mem[a], (size_t)pr->arena_bytes[a]);
        pr->arena_held = 0;
    }
    for (int j = 0; j < pr->nviews; j++) Py_XDECREF(pr->views[j]);
    PyMem_Free(pr->views);
    PyMem_Free(pr->internal);
    PyMem_Free(pr->vfirst);
    PyMem_Free(pr->boff);
    PyMem_Free(pr->barena);
    PyMem_Free(pr->blive);
    pr->blive = NULL;
    PyMem_Free(pr->arena_dev);
    PyMem_Free(pr->arena_bytes);
    PyMem_Free(pr->arena_mem);
    pr->views = NULL;
    pr->internal = NULL;
    pr->vfirst = pr->barena = NULL;
    pr->boff = pr->arena_bytes = NULL;
    pr->arena_dev = NULL;
    pr->arena_mem = NULL;
    pr->nviews = pr->narenas = 0;
    pr->planned = 0;
}

/* The step whose plan entry makes value v's blocks in a run: a plain step's own, a fused
 * chain's last (the chain's first step runs it); -1 for anything else. */
static int producer_step(const program *pr, int k) {
    const pstep *st = &pr->steps[k];
    if (st->fn != NULL) return -1;
    if (pr->fuse && st->chain >= 2) return k + st->chain - 1;
    if (pr->fuse && k > 0 && chain_inner(pr, k)) return -1; /* (updated in place) */
    return k;
}

/* The plan for the current fusion setting (see above). 0, or -1 with an exception. */
static int plan_memory(program *pr) {
    plan_free(pr);
    const int nv = pr->nvals > 0 ? pr->nvals : 1, ns = pr->nsteps > 0 ? pr->nsteps : 1;
    int *vstep = PyMem_Malloc((size_t)nv * sizeof(int));
    int *grp_start = PyMem_Malloc((size_t)ns * sizeof(int)), *grp_end = PyMem_Malloc((size_t)ns * sizeof(int));
    unsigned char *by_node = PyMem_Calloc((size_t)nv, 1);
    mblock *blk = NULL;
    mspan *spans = NULL;
    int rc = -1, nblocks = 0;
    pr->internal = PyMem_Calloc((size_t)nv, 1);
    pr->vfirst = PyMem_Malloc((size_t)nv * sizeof(int));
    if (vstep == NULL || grp_start == NULL || grp_end == NULL || by_node == NULL ||
        pr->internal == NULL || pr->vfirst == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (int v = 0; v < pr->nvals; v++) vstep[v] = pr->vfirst[v] = -1;
    for (int k = 0; k < pr->nsteps; k++) grp_start[k] = grp_end[k] = k;
    for (int k = 0; k < pr->nsteps; k++) {
        const pstep *st = &pr->steps[k];
        if (st->fn != NULL) {
            for (int i = 0; i < st->nin + st->nout; i++) by_node[st->io[i]] = 1;
            continue;
        }
        const int p = producer_step(pr, k);
        if (p >= 0) vstep[pr->steps[p].out] = p;
        if (p > k) /* a fused chain k..p: one group */
            for (int q = k; q <= p; q++) {
                grp_start[q] = k;
                grp_end[q] = p;
            }
    }
    for (int v = 0; v < pr->nvals; v++) {
        if (pr->vkind[v] != V_STEP || vstep[v] < 0 || by_node[v] || pr->last_use[v] < 0 ||
            pr->last_use[v] == INT32_MAX)
            continue;
        pr->internal[v] = 1;
        pr->vfirst[v] = nblocks;
        nblocks += pr->steps[vstep[v]].e.nblk;
    }
    const size_t nb = (size_t)(nblocks > 0 ? nblocks : 1);
    pr->views = PyMem_Calloc(nb, sizeof *pr->views);
    pr->boff = PyMem_Calloc(nb, sizeof *pr->boff);
    pr->barena = PyMem_Calloc(nb, sizeof *pr->barena);
    pr->blive = PyMem_Calloc(2 * nb, sizeof *pr->blive);
    pr->arena_dev = PyMem_Calloc(CT_MAX_DEVICES, sizeof *pr->arena_dev);
    pr->arena_bytes = PyMem_Calloc(CT_MAX_DEVICES, sizeof *pr->arena_bytes);
    pr->arena_mem = PyMem_Calloc(CT_MAX_DEVICES, sizeof *pr->arena_mem);
    blk = PyMem_Calloc(nb, sizeof *blk);
    spans = PyMem_Calloc(nb, sizeof *spans);
    if (pr->views == NULL || pr->boff == NULL || pr->barena == NULL || pr->blive == NULL || pr->arena_dev == NULL ||
        pr->arena_bytes == NULL || pr->arena_mem == NULL || blk == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    pr->nviews = nblocks; /* (Buffers made below; NULL until then) */
    for (int v = 0; v < pr->nvals; v++) {
        if (!pr->internal[v]) continue;
        const int p = vstep[v];
        const plan_entry *e = &pr->steps[p].e;
        for (int i = 0; i < e->nblk; i++) {
            int a = 0;
            while (a < pr->narenas && pr->arena_dev[a] != e->cdev[i]) a++;
            if (a == pr->narenas) {
                if (a == CT_MAX_DEVICES) {
                    PyErr_SetString(PyExc_RuntimeError, "jit: more devices than arenas");
                    goto out;
                }
                pr->arena_dev[pr->narenas++] = e->cdev[i];
            }
            ct_py_buffer *b = ct_py_buffer_borrowed(e->cdev[i], e->out_ndim, e->out_sdims,
                                                    (ct_dtype)e->out_dt);
            if (b == NULL) goto out;
            b->deleted = 1; /* (until a run points it into its arena) */
            const int j = pr->vfirst[v] + i;
            pr->views[j] = b;
            pr->barena[j] = a;
            const int64_t al = arena_align(e->cdev[i]);
            const int64_t n = ((int64_t)b->nbytes + al - 1) / al * al;
            blk[j] = (mblock){j, a, n > 0 ? n : al, grp_start[p], grp_end[pr->last_use[v]]};
            pr->blive[2 * j] = blk[j].first;
            pr->blive[2 * j + 1] = blk[j].last;
        }
    }
    pr->arena_first = INT32_MAX;
    pr->arena_last = -1;
    for (int j = 0; j < nblocks; j++) {
        if (blk[j].first < pr->arena_first) pr->arena_first = blk[j].first;
        if (blk[j].last > pr->arena_last) pr->arena_last = blk[j].last;
    }
    qsort(blk, (size_t)nblocks, sizeof *blk, cmp_mblock);
    for (int x = 0; x < nblocks; x++) {
        /* the placed blocks of this arena live at the same time: the lowest gap past them */
        int n = 0;
        for (int y = x - 1; y >= 0 && blk[y].arena == blk[x].arena; y--)
            if (blk[y].first <= blk[x].last && blk[x].first <= blk[y].last)
                spans[n++] = (mspan){pr->boff[blk[y].j], pr->boff[blk[y].j] + blk[y].size};
        qsort(spans, (size_t)n, sizeof *spans, cmp_mspan);
        int64_t off = 0;
        for (int t = 0; t < n; t++) {
            if (spans[t].off >= off + blk[x].size) break; /* fits below this one */
            if (spans[t].end > off) off = spans[t].end;
        }
        pr->boff[blk[x].j] = off;
        if (off + blk[x].size > pr->arena_bytes[blk[x].arena])
            pr->arena_bytes[blk[x].arena] = off + blk[x].size;
    }
    pr->planned = 1;
    pr->plan_fuse = pr->fuse;
    rc = graph_plan(pr);
out:
    PyMem_Free(blk);
    PyMem_Free(spans);
    PyMem_Free(vstep);
    PyMem_Free(grp_start);
    PyMem_Free(grp_end);
    PyMem_Free(by_node);
    if (rc < 0) {
        if (pr->views == NULL) pr->nviews = 0;
        plan_free(pr);
    }
    return rc;
}

/* A finished, replayable program's memory plan for the current fusion setting, made now if
 * there is none (unless a run on another thread holds the arenas): 1 when it is there, 0
 * when not now, -1 with an exception (`who`, the method: for an unfinished or broken
 * program; NULL: not checked). */
static int plan_current(program *pr, const char *who) {
    if (who != NULL && (!pr->finished || pr->broken != NULL)) {
        PyErr_Format(PyExc_RuntimeError, "Program.%s: %s", who,
                     pr->broken != NULL ? "the program is broken" : "not finished");
        return -1;
    }
    if ((!pr->planned || pr->plan_fuse != pr->fuse) && !pr->arena_busy && plan_memory(pr) < 0)
        return -1;
    return pr->planned && pr->plan_fuse == pr->fuse;
}

/* Allocates the arenas for a run (which reserved them: arena_busy) and points the internal
 * values' Buffers into them: 1, or -1 with an exception (out of memory). */
static int arenas_take(program *pr) {
    for (int a = 0; a < pr->narenas; a++) {
        pr->arena_mem[a] = NULL;
        if (pr->arena_bytes[a] == 0) continue;
        ct_status st = ct_device_alloc(pr->arena_dev[a], (size_t)pr->arena_bytes[a], &pr->arena_mem[a]);
        if (st != CT_OK) {
            for (int b = 0; b < a; b++)
                if (pr->arena_mem[b] != NULL)
                    ct_device_free(pr->arena_dev[b], pr->arena_mem[b], (size_t)pr->arena_bytes[b]);
            ct_py_raise(st);
            return -1;
        }
    }
    for (int j = 0; j < pr->nviews; j++) {
        ct_py_buffer *b = pr->views[j];
        b->data = (char *)pr->arena_mem[pr->barena[j]] + pr->boff[j];
        b->deleted = 0;
    }
    return 1;
}

static void arenas_give_back(program *pr) {
    for (int j = 0; j < pr->nviews; j++) {
        pr->views[j]->data = NULL;
        pr->views[j]->deleted = 1;
    }
    for (int a = 0; a < pr->narenas; a++) {
        if (pr->arena_mem[a] != NULL)
            ct_device_free(pr->arena_dev[a], pr->arena_mem[a], (size_t)pr->arena_bytes[a]);
        pr->arena_mem[a] = NULL;
    }
}

/* --- CUDA graphs ------------------------------------------------------------------------
 * graph_plan finds the segments (see gseg); run_segment runs one. A graph replays the
 * addresses of its capture, so a run first puts every buffer its kernels will use in place:
 * the arenas (held between runs), the operands from outside the segment (arguments,
 * constants, nodes' results, earlier steps' values), and new blocks for the values leaving it.
 * When the addresses are those of the capture, the graphs are launched; in a training loop
 * whose state is updated in place (an optimizer node) and whose inputs and outputs are freed
 * before the next step, the pool hands back the same blocks, so the graphs are launched as
 * they are. Otherwise the steps are captured again with the new addresses. */

static void graphs_free(program *pr) {
    for (int s = 0; s < pr->nsegs; s++) {
        gseg *g = &pr->segs[s];
        for (int c = 0; c < GRAPH_CACHE; c++) {
            gentry *en = &g->ent[c];
            for (int d = 0; d < g->ndev; d++)
                if (en->exec != NULL && en->exec[d] != NULL)
                    g->dev[d]->backend->graph_free(g->dev[d], en->exec[d]);
            PyMem_Free(en->exec);
            PyMem_Free(en->sig);
        }
        for (int t = 0; t < g->nstage; t++) {
            for (int i = 0; g->stage[t].b != NULL && i < pr->steps[g->stage[t].k].e.nblk; i++)
                Py_XDECREF((PyObject *)g->stage[t].b[i]);
            PyMem_Free(g->stage[t].b);
        }
        PyMem_Free(g->stage);
        PyMem_Free(g->dev);
    }
    PyMem_Free(pr->segs);
    PyMem_Free(pr->seg_at);
    pr->segs = NULL;
    pr->seg_at = NULL;
    pr->nsegs = 0;
}

/* Steps in one unit from step k: a fused chain's length, else 1. */
static int unit_len(const program *pr, int k) {
    const pstep *st = &pr->steps[k];
    return pr->fuse && st->chain >= 2 ? st->chain : 1;
}

/* Whether step k may be in a graph: a plain step whose blocks are all on GPU devices of a
 * backend with graphs, with no all-reduce between devices. */
static int step_graphable(const program *pr, int k) {
    const pstep *st = &pr->steps[k];
    const plan_entry *e = &st->e;
    if (st->fn != NULL || e->nblk < 1) return 0;
    for (int i = 0; i < e->nblk; i++)
        if (e->cdev[i]->platform != CT_PLATFORM_GPU || e->cdev[i]->backend->graph_begin == NULL)
            return 0;
    for (int g = 0; g < e->ngroups; g++)
        if (e->gstart[g + 1] - e->gstart[g] > 1) return 0;
    return 1;
}

/* The segments for the current fusion setting (none with graphs off): runs of at least two
 * graphable units. 0, or -1 with an exception. */
static int graph_plan(program *pr) {
    graphs_free(pr);
    if (!pr->graphs || pr->nsteps < 2) return 0;
    pr->seg_at = PyMem_Malloc((size_t)pr->nsteps * sizeof(int));
    pr->segs = PyMem_Calloc((size_t)pr->nsteps, sizeof(gseg));
    if (pr->seg_at == NULL || pr->segs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int k = 0; k < pr->nsteps; k++) pr->seg_at[k] = -1;
    for (int k = 0; k < pr->nsteps;) {
        int end = k, units = 0;
        while (end < pr->nsteps) {
            const int n = unit_len(pr, end);
            int ok = 1;
            for (int q = end; q < end + n && ok; q++) ok = step_graphable(pr, q);
            if (!ok) break;
            end += n;
            units++;
        }
        if (units >= 2) {
            gseg *g = &pr->segs[pr->nsegs];
            g->k0 = k;
            g->k1 = end;
            int most = 0; /* (at most this many devices) */
            for (int q = k; q < end; q++) most += pr->steps[q].e.nblk;
            pr->nsegs++; /* (freed by graphs_free from here on) */
            g->dev = PyMem_Calloc((size_t)most, sizeof *g->dev);
            int ok = g->dev != NULL;
            for (int c = 0; c < GRAPH_CACHE; c++) {
                g->ent[c].exec = PyMem_Calloc((size_t)most, sizeof *g->ent[c].exec);
                ok &= g->ent[c].exec != NULL;
            }
            if (!ok) {
                PyErr_NoMemory();
                return -1;
            }
            g->stage = PyMem_Calloc((size_t)(end - k), sizeof *g->stage);
            if (g->stage == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            for (int q = k; q < end; q += unit_len(pr, q)) {
                const int t = q + unit_len(pr, q) - 1, v = pr->steps[t].out;
                const plan_entry *e = &pr->steps[t].e;
                const int64_t bytes = e->out_elems * (int64_t)ct_dtype_size((ct_dtype)e->out_dt);
                if (!pr->internal[v] && bytes <= GRAPH_STAGE_BYTES)
                    g->stage[g->nstage++] = (gstage){v, t, NULL};
            }
            for (int q = k; q < end; q++) {
                const plan_entry *e = &pr->steps[q].e;
                g->matmul |= e->kind == K_MATMUL;
                for (int i = 0; i < e->nblk; i++) {
                    int d = 0;
                    while (d < g->ndev && g->dev[d] != e->cdev[i]) d++;
                    if (d == g->ndev) g->dev[g->ndev++] = e->cdev[i];
                }
            }
            pr->seg_at[k] = pr->nsegs - 1;
        }
        k = end > k ? end : k + unit_len(pr, k);
    }
    return 0;
}

/* A new Array for the result of plan e, its blocks allocated (the kernels write them later). */
static PyObject *new_result(const plan_entry *e) {
    PyObject *blocks = PyList_New(e->nblk);
    if (blocks == NULL) return NULL;
    for (int i = 0; i < e->nblk; i++) {
        ct_py_buffer *b = ct_py_buffer_alloc(e->cdev[i], e->out_ndim, e->out_sdims, (ct_dtype)e->out_dt);
        PyObject *t = b != NULL ? PyTuple_New(4) : NULL;
        if (t == NULL) {
            Py_XDECREF((PyObject *)b);
            Py_DECREF(blocks);
            return NULL;
        }
        PyTuple_SET_ITEM(t, 0, Py_NewRef(e->bdev[i]));
        PyTuple_SET_ITEM(t, 1, (PyObject *)b);
        PyTuple_SET_ITEM(t, 2, Py_NewRef(e->bstart[i]));
        PyTuple_SET_ITEM(t, 3, Py_NewRef(e->brid[i]));
        PyList_SET_ITEM(blocks, i, t);
    }
    return ct_py_array_new(Py_NewRef(e->out_shape), Py_NewRef(e->out_dtype),
                           Py_NewRef(e->out_sharding), blocks, Py_NewRef(e->out_shard_shape));
}

/* Value v's blocks for plan e into row: segment g's own (staged values), the arena's
 * (internal values), else its Array's.
 * 0, or -1 with an exception naming step k. */
static int value_blocks(const program *pr, const gseg *g, PyObject **vals, int v,
                        const plan_entry *e, int k, ct_py_buffer **row) {
    for (int t = 0; t < g->nstage; t++)
        if (g->stage[t].v == v) {
            memcpy(row, g->stage[t].b, (size_t)e->nblk * sizeof *row);
            return 0;
        }
    if (pr->internal[v]) {
        memcpy(row, &pr->views[pr->vfirst[v]], (size_t)e->nblk * sizeof *row);
        return 0;
    }
    if (vals[v] != NULL && operand_buffers((ct_py_array *)vals[v], e, row) == 0) return 0;
    if (vals[v] != NULL && ct_py_array_check_alive(vals[v]) < 0) return -1;
    PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U) of the traced program no longer runs "
                 "from its plan", k, pr->steps[k].name);
    return -1;
}

/* The buffers of segment g's units, per unit the rows of run_chain's operands (a plain step:
 * a, then b) and then the result's, each row nblk long (rows a unit does not read: NULL);
 * a result leaving the segment is made here (new_result, into vals). *n: how many (a first
 * call, with bufs NULL, only counts). 0, or -1 with an exception. */
static int segment_buffers(program *pr, const gseg *g, PyObject **vals, ct_py_buffer **bufs,
                           size_t *n) {
    size_t o = 0;
    for (int k = g->k0; k < g->k1; k += unit_len(pr, k)) {
        const int len = unit_len(pr, k);
        const pstep *head = &pr->steps[k], *tail = &pr->steps[k + len - 1];
        const int nblk = head->e.nblk;
        for (int j = 0; j < len; j++) { /* operand rows: as run_chain orders them */
            const pstep *st = &pr->steps[k + j];
            for (int q = 0; q < 2; q++) {
                const int v = j == 0 ? (q == 0 ? st->a : st->b) : (q == 0 ? chain_other(st, 0) : -1);
                if (j > 0 && q == 1) continue;
                ct_py_buffer **row = bufs != NULL ? &bufs[o] : NULL;
                o += (size_t)nblk;
                if (row == NULL) continue;
                if (v < 0 || (j > 0 && st->e.kind != K_BINARY)) {
                    memset(row, 0, (size_t)nblk * sizeof *row);
                    continue;
                }
                if (value_blocks(pr, g, vals, v, &st->e, k + j, row) < 0) return -1;
            }
        }
        ct_py_buffer **row = bufs != NULL ? &bufs[o] : NULL;
        o += (size_t)nblk;
        if (row == NULL) continue;
        const int out = tail->out;
        if (!pr->internal[out]) { /* (leaves the segment: a new Array now) */
            PyObject *y = new_result(&tail->e);
            if (y == NULL) return -1;
            Py_XSETREF(vals[out], y);
        }
        if (value_blocks(pr, g, vals, out, &tail->e, k + len - 1, row) < 0) return -1;
    }
    *n = o;
    return 0;
}

/* Segment g's kernels, queued unit by unit on the buffers segment_buffers gave. 0, or -1 with
 * an exception. */
static int segment_kernels(program *pr, const gseg *g, ct_py_buffer **bufs) {
    size_t o = 0;
    for (int k = g->k0; k < g->k1; k += unit_len(pr, k)) {
        const int len = unit_len(pr, k);
        pstep *st = &pr->steps[k];
        const size_t nblk = (size_t)st->e.nblk;
        if (len >= 2) { /* (rows 0 .. len: run_chain's operand rows, as it lays them out) */
            if (chain_run_bufs(pr, k, len, &bufs[o], &bufs[o + (size_t)(len + 1) * nblk]) < 0)
                return -1;
            o += (size_t)(len + 2) * nblk;
            continue;
        }
        arena_io io = {&bufs[o], st->b >= 0 ? &bufs[o + nblk] : NULL, &bufs[o + 2 * nblk]};
        PyObject *y = run_entry_in(&st->e, NULL, NULL, st->scalar, 0, &io);
        if (y == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U) of the traced program no "
                             "longer runs from its plan (another matmul precision than at the "
                             "trace?)", k, st->name);
            return -1;
        }
        Py_DECREF(y);
        o += 3 * nblk;
    }
    return 0;
}

/* Capture segment g's kernels as one graph per device (made or updated): 0, or 1 when the
 * capture failed (nothing captured, no exception: the caller runs the kernels itself). */
static int segment_capture(program *pr, gseg *g, ct_py_buffer **bufs, void **exec) {
    int begun = 0, rc = 0;
    for (; begun < g->ndev; begun++)
        if (g->dev[begun]->backend->graph_begin(g->dev[begun]) != CT_OK) break;
    /* (a kernel that fails while captured fails again when run: the caller reports it then) */
    capturing = 1;
    if (begun < g->ndev || segment_kernels(pr, g, bufs) < 0) rc = 1;
    capturing = 0;
    int updated_all = 1;
    for (int d = 0; d < begun; d++) {
        int updated = 0;
        const ct_status st = g->dev[d]->backend->graph_end(g->dev[d], rc == 0, &exec[d], &updated);
        if (st != CT_OK && rc == 0) rc = 1;
        updated_all &= updated;
    }
    if (rc > 0) {
        PyErr_Clear();
        ct_clear_error();
        return 1;
    }
    if (updated_all) g->updates++;
    else g->captures++;
    return 0;
}

/* Run segment g (see above): its results into vals, its operands last read in it released.
 * 0, or -1 with an exception. */
static int run_segment(program *pr, gseg *g, PyObject **vals) {
    if (g->matmul) {
        const int prec = current_precision();
        if (prec != CT_PREC_F32) {
            if (prec >= 0 || !PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "jit: step %d of the traced program no longer "
                             "runs from its plan (another matmul precision than at the trace?)",
                             g->k0);
            return -1;
        }
    }
    for (int t = 0; t < g->nstage; t++) { /* (the first run: the staged values' buffers) */
        gstage *sv = &g->stage[t];
        const plan_entry *e = &pr->steps[sv->k].e;
        if (sv->b != NULL) continue;
        sv->b = PyMem_Calloc((size_t)e->nblk, sizeof *sv->b);
        if (sv->b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (int i = 0; i < e->nblk; i++) {
            sv->b[i] = ct_py_buffer_alloc(e->cdev[i], e->out_ndim, e->out_sdims, (ct_dtype)e->out_dt);
            if (sv->b[i] == NULL) {
                for (int j = 0; j < i; j++) Py_DECREF((PyObject *)sv->b[j]);
                PyMem_Free(sv->b);
                sv->b = NULL;
                return -1;
            }
        }
    }
    size_t n = 0;
    int rc = -1;
    if (segment_buffers(pr, g, vals, NULL, &n) < 0) return -1;
    ct_py_buffer **bufs = PyMem_Calloc(n + 1, sizeof *bufs);
    void **sig = PyMem_Malloc((n + 1) * sizeof *sig);
    if (bufs == NULL || sig == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (segment_buffers(pr, g, vals, bufs, &n) < 0) goto out;
    int nsig = 0;
    for (size_t q = 0; q < n; q++)
        if (bufs[q] != NULL) sig[nsig++] = bufs[q]->data;
    gentry *en = NULL, *oldest = &g->ent[0];
    for (int c = 0; c < GRAPH_CACHE && en == NULL; c++) {
        gentry *e = &g->ent[c];
        if (e->used < oldest->used) oldest = e;
        if (e->used == 0 || e->nsig != nsig || memcmp(sig, e->sig, (size_t)nsig * sizeof *sig) != 0)
            continue;
        en = e;
        for (int d = 0; d < g->ndev; d++)
            if (e->exec[d] == NULL) en = NULL;
    }
    if (en == NULL) { /* (captured again: into the graphs launched longest ago) */
        en = oldest;
        en->used = 0;
        if (segment_capture(pr, g, bufs, en->exec) > 0) { /* (the capture failed: kernel by kernel, now and from now on) */
            g->off = 1;
            if (segment_kernels(pr, g, bufs) < 0) goto out;
            goto release;
        }
        PyMem_Free(en->sig);
        en->sig = sig;
        en->nsig = nsig;
        sig = NULL;
    }
    en->used = ++g->clock;
    for (int d = 0; d < g->ndev; d++) {
        const ct_status st = g->dev[d]->backend->graph_launch(g->dev[d], en->exec[d]);
        if (st != CT_OK) {
            ct_py_raise(st);
            goto out;
        }
    }
    g->launches++;
release:
    /* the staged values into their Arrays (queued on each device's stream, after the graph) */
    for (int t = 0; t < g->nstage; t++) {
        const gstage *sv = &g->stage[t];
        const plan_entry *e = &pr->steps[sv->k].e;
        ct_py_buffer *dst[MAXB];
        if (operand_buffers((ct_py_array *)vals[sv->v], e, dst) != 0) {
            PyErr_Format(PyExc_RuntimeError, "jit: step %d of the traced program: its result "
                         "lost its blocks", sv->k);
            goto out;
        }
        for (int i = 0; i < e->nblk; i++) {
            int64_t nbytes = (int64_t)dst[i]->nbytes, one = 1;
            const ct_status st = e->cdev[i]->backend->copy_block(
                e->cdev[i], e->cdev[i], 1, &nbytes, 1, dst[i]->data, &one, sv->b[i]->data, &one);
            if (st != CT_OK) {
                ct_py_raise(st);
                goto out;
            }
        }
    }
    /* the operands read for the last time in the segment (queued frees: after the graphs) */
    for (int k = g->k0; k < g->k1; k++) {
        const pstep *st = &pr->steps[k];
        const int vs[2] = {st->a, st->b};
        for (int q = 0; q < 2; q++) {
            const int v = vs[q];
            if (v >= 0 && pr->vkind[v] == V_STEP && pr->last_use[v] >= g->k0 &&
                pr->last_use[v] < g->k1 && !pr->internal[v])
                Py_CLEAR(vals[v]);
        }
    }
    rc = 0;
out:
    PyMem_Free(bufs);
    PyMem_Free(sig);
    return rc;
}

/* Step k, a node: its callable on a list of its input Arrays, which returns the output Arrays
 * (checked against the recorded shapes, dtypes and shardings); inputs at their last use are
 * released. 0, or -1 with an exception. */
static int run_node(program *pr, pstep *st, int k, PyObject **vals) {
    PyObject *ins = PyList_New(st->nin);
    if (ins == NULL) return -1;
    for (int i = 0; i < st->nin; i++) PyList_SET_ITEM(ins, i, Py_NewRef(vals[st->io[i]]));
    PyObject *outs = PyObject_CallOneArg(st->fn, ins);
    Py_DECREF(ins);
    if (outs == NULL) return -1;
    PyTypeObject *at = ct_py_array_type();
    if (!PyList_Check(outs) || PyList_GET_SIZE(outs) != st->nout) {
        PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U) of the traced program returned "
                     "%zd values, not the %d of the trace", k, st->name,
                     PyList_Check(outs) ? PyList_GET_SIZE(outs) : (Py_ssize_t)-1, st->nout);
        Py_DECREF(outs);
        return -1;
    }
    for (int j = 0; j < st->nout; j++) {
        PyObject *y = PyList_GET_ITEM(outs, j);
        const int v = st->io[st->nin + j];
        if (!Py_IS_TYPE(y, at) || !meta_match(pr->vmeta[v], (ct_py_array *)y)) {
            PyErr_Format(PyExc_RuntimeError, "jit: step %d (%U) of the traced program returned "
                         "an output %d of another type, shape, dtype or sharding than at the "
                         "trace", k, st->name, j);
            Py_DECREF(outs);
            return -1;
        }
    }
    for (int j = 0; j < st->nout; j++) {
        const int v = st->io[st->nin + j];
        /* (an output nothing reads, of a node kept for its others: released at once) */
        if (st->pure && pr->last_use[v] < k) Py_CLEAR(vals[v]);
        else Py_XSETREF(vals[v], Py_NewRef(PyList_GET_ITEM(outs, j)));
    }
    Py_DECREF(outs);
    for (int i = 0; i < st->nin; i++) {
        const int v = st->io[i];
        if (pr->last_use[v] == k && pr->vkind[v] == V_STEP) Py_CLEAR(vals[v]);
    }
    return 0;
}

/* program.run(args): the outputs for new arguments (a list), or None when an argument's
 * shape, dtype or sharding is not the recorded one. */
static PyObject *run_impl(program *pr, PyObject *args, PyObject *donate);

static PyObject *program_run(program *pr, PyObject *args) { return run_impl(pr, args, NULL); }

/* run_donating(args, donate): run(args), then the arguments at the positions `donate` (a
 * tuple of ints) are donated: each is given up at its last use in the program (its buffers
 * freed there, unless something else still holds them), and the caller's Array raises
 * DonatedBufferError afterwards, as jax.jit(donate_argnums=...) makes it. An argument that is
 * also an output is not donated. */
static PyObject *program_run_donating(program *pr, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyTuple_Check(a[1]))
        return PyErr_Format(PyExc_TypeError, "run_donating(args: list, donate: tuple of ints)");
    return run_impl(pr, a[0], a[1]);
}

static PyObject *delete_name;

/* Give up Array x (a donated argument): its buffers freed now (Array.delete: all or none; a
 * numpy view of one keeps them all), x marked donated. */
static void give_up(PyObject *x) {
    if (x == NULL || ((ct_py_array *)x)->donated != Py_False) return;
    PyObject *et, *ev, *tb; /* (nothing pending is lost) */
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(x, delete_name);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    Py_XSETREF(((ct_py_array *)x)->donated, Py_NewRef(Py_True));
    PyErr_Restore(et, ev, tb);
}

typedef struct {
    int last, v;
} donated_val;

static int cmp_donated(const void *x, const void *y) {
    const donated_val *a = x, *b = y;
    return (a->last > b->last) - (a->last < b->last);
}

static PyObject *run_impl(program *pr, PyObject *args, PyObject *donate) {
    if (!pr->finished || pr->broken != NULL)
        return PyErr_Format(PyExc_RuntimeError, "Program.run: %s",
                            pr->broken != NULL ? "the program is broken" : "not finished");
    if (!PyList_Check(args)) return PyErr_Format(PyExc_TypeError, "Program.run takes a list");
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    if (PyList_GET_SIZE(args) != pr->nargs) Py_RETURN_NONE;
    for (int i = 0; i < pr->nargs; i++) {
        PyObject *x = PyList_GET_ITEM(args, i);
        if (!Py_IS_TYPE(x, at) || !arg_match(pr, i, (ct_py_array *)x)) Py_RETURN_NONE;
    }
    for (int i = 0; i < pr->nargs; i++)
        if (ct_py_array_check_alive(PyList_GET_ITEM(args, i)) < 0) return NULL;
    PyObject **vals = PyMem_Calloc(pr->nvals > 0 ? pr->nvals : 1, sizeof(PyObject *));
    if (vals == NULL) return PyErr_NoMemory();
    PyObject *res = NULL;
    for (int v = 0; v < pr->nvals; v++) {
        if (pr->vkind[v] == V_ARG) vals[v] = Py_NewRef(PyList_GET_ITEM(args, pr->vref[v]));
        else if (pr->vkind[v] == V_CONST) vals[v] = Py_XNewRef(pr->vobj[v]);
    }
    /* donated arguments, by their last use (-1: unused, given up at once) */
    donated_val *dv = NULL;
    Py_ssize_t nd = 0, di = 0;
    if (donate != NULL && PyTuple_GET_SIZE(donate) > 0) {
        dv = PyMem_Calloc((size_t)PyTuple_GET_SIZE(donate), sizeof *dv);
        if (dv == NULL) {
            PyMem_Free(vals);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(donate); j++) {
            long i = PyLong_AsLong(PyTuple_GET_ITEM(donate, j));
            if (i == -1 && PyErr_Occurred()) {
                PyMem_Free(dv);
                PyMem_Free(vals);
                return NULL;
            }
            if (i < 0 || i >= pr->nargs || pr->last_use[i] == INT32_MAX) continue; /* (an output) */
            dv[nd].last = pr->last_use[i];
            dv[nd++].v = (int)i; /* (argument i is value i) */
        }
        qsort(dv, (size_t)nd, sizeof *dv, cmp_donated);
        for (; di < nd && dv[di].last < 0; di++) give_up(vals[dv[di].v]);
    }
    /* the static memory plan: made at the first run (and again for another fusion setting,
     * unless a run on another thread holds the arenas: this one then runs without) */
    int arena = 0;      /* this run holds the arenas now */
    int with_arena = 0; /* it takes them (at step arena_first; given back after arena_last) */
    int mine = plan_current(pr, NULL); /* the arenas and graphs are this run's */
    if (mine < 0) {
        mine = 0;
        goto done;
    }
    mine = mine && !pr->arena_busy;
    if (mine) pr->arena_busy = 1; /* (reserved: a run on another thread runs without) */
    with_arena = mine && pr->nviews > 0;
    const int graphs = mine && pr->nsegs > 0;
    if (graphs && with_arena && !pr->arena_held) { /* (held from now on: the graphs' addresses) */
        if (arenas_take(pr) < 0) goto done;
        pr->arena_held = 1;
    }
    if (graphs && with_arena) arena = 1;
    struct timespec t0, t1;
    if (pr->step_ns != NULL) {
        pr->timed_runs++;
        clock_gettime(CLOCK_MONOTONIC, &t0);
    }
    for (int k = 0; k < pr->nsteps; k++) {
        pstep *st = &pr->steps[k];
        if (with_arena && !pr->arena_held && k == pr->arena_first) {
            if (arenas_take(pr) < 0) goto done;
            arena = 1;
        }
        if (arena && !pr->arena_held && k > pr->arena_last) { /* (every value read for the last time) */
            arenas_give_back(pr);
            arena = 0;
        }
        if (pr->step_ns != NULL && k > 0) { /* (step k - 1 ended here) */
            clock_gettime(CLOCK_MONOTONIC, &t1);
            pr->step_ns[k - 1] += (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
            t0 = t1;
        }
        if (st->fn != NULL) {
            if (run_node(pr, st, k, vals) < 0) goto done;
            for (; di < nd && dv[di].last <= k; di++) give_up(vals[dv[di].v]);
            continue;
        }
        if (graphs && pr->seg_at[k] >= 0 && !pr->segs[pr->seg_at[k]].off) {
            gseg *g = &pr->segs[pr->seg_at[k]];
            if (run_segment(pr, g, vals) < 0) goto done;
            k = g->k1 - 1; /* (timed as its last step) */
            for (; di < nd && dv[di].last <= k; di++) give_up(vals[dv[di].v]);
            continue;
        }
        if (st->chain >= 2 && pr->fuse) {
            if (run_chain(pr, k, st->chain, vals, arena) < 0) goto done;
            k += st->chain - 1; /* (timed as the chain's last step) */
            for (; di < nd && dv[di].last <= k; di++) give_up(vals[dv[di].v]);
            continue;
        }
        arena_io io = {NULL, NULL, NULL};
        if (arena) {
            if (pr->internal[st->a]) io.xa = &pr->views[pr->vfirst[st->a]];
            if (st->b >= 0 && pr->internal[st->b]) io.xb = &pr->views[pr->vfirst[st->b]];
            if (pr->internal[st->out]) io.out = &pr->views[pr->vfirst[st->out]];
        }
        PyObject *y = run_entry_in(&st->e, io.xa != NULL ? NULL : (ct_py_array *)vals[st->a],
                                   st->b >= 0 && io.xb == NULL ? (ct_py_array *)vals[st->b] : NULL,
                                   st->scalar, 0,
                                   io.xa != NULL || io.xb != NULL || io.out != NULL ? &io : NULL);
        if (y == NULL) {
            if (!PyErr_Occurred()) {
                if (pr->vkind[st->a] == V_CONST || (st->b >= 0 && pr->vkind[st->b] == V_CONST))
                    ct_py_array_check_alive(vals[pr->vkind[st->a] == V_CONST ? st->a : st->b]);
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_RuntimeError,
                                 "jit: step %d (%U) of the traced program no longer runs from its "
                                 "plan (another matmul precision than at the trace?)", k, st->name);
            }
            goto done;
        }
        if (io.out != NULL) Py_DECREF(y); /* (None: the result is in the arena) */
        else vals[st->out] = y;
        if (pr->last_use[st->a] == k && pr->vkind[st->a] == V_STEP) Py_CLEAR(vals[st->a]);
        if (st->b >= 0 && pr->last_use[st->b] == k && pr->vkind[st->b] == V_STEP)
            Py_CLEAR(vals[st->b]);
        for (; di < nd && dv[di].last <= k; di++) give_up(vals[dv[di].v]);
    }
    for (; di < nd; di++) give_up(vals[dv[di].v]); /* (after a chain or a node at the end) */
    if (pr->step_ns != NULL && pr->nsteps > 0) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        pr->step_ns[pr->nsteps - 1] +=
            (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    }
    res = PyList_New(pr->nouts);
    if (res == NULL) goto done;
    for (int j = 0; j < pr->nouts; j++) {
        const int v = pr->out_vals[j];
        PyObject *o = v >= 0 ? vals[v] : PyList_GET_ITEM(pr->out_objs, j);
        /* a constant comes back as a copy, as each call of a jitted function returns new
         * Arrays (one given away, e.g. donated, must not take the program's with it) */
        o = v >= 0 && pr->vkind[v] == V_CONST ? PyObject_CallMethod(o, "copy", NULL)
                                               : Py_NewRef(o != NULL ? o : Py_None);
        if (o == NULL) {
            Py_CLEAR(res);
            goto done;
        }
        PyList_SET_ITEM(res, j, o);
    }
done:
    if (arena && !pr->arena_held) arenas_give_back(pr);
    if (mine) pr->arena_busy = 0;
    for (int v = 0; v < pr->nvals; v++) Py_XDECREF(vals[v]);
    PyMem_Free(vals);
    PyMem_Free(dv);
    return res;
}

static const char *const kind_names[] = {"unary", "binary", "ewise",  "reduce",
                                                "scalar", "matmul", "copy", "bcast",
                                                "convert", "transpose", "unary16"};
_Static_assert(sizeof kind_names / sizeof kind_names[0] == K_COUNT, "a name for every plan kind");

/* "%o, ... = name(%i, ...)  [n in, m out]" for a node step. */
static PyObject *node_text(const pstep *st) {
    PyObject *parts = PyList_New(0), *sep = PyUnicode_FromString(", "), *r = NULL;
    PyObject *lhs = NULL, *rhs = NULL;
    if (parts == NULL || sep == NULL) goto out;
    for (int half = 0; half < 2; half++) {
        const int lo = half ? 0 : st->nin, n = half ? st->nin : st->nout;
        if (PyList_SetSlice(parts, 0, PyList_GET_SIZE(parts), NULL) < 0) goto out;
        for (int i = 0; i < n; i++) {
            PyObject *t = PyUnicode_FromFormat("%%%d", st->io[lo + i]);
            if (t == NULL || PyList_Append(parts, t) < 0) {
                Py_XDECREF(t);
                goto out;
            }
            Py_DECREF(t);
        }
        PyObject *j = PyUnicode_Join(sep, parts);
        if (j == NULL) goto out;
        if (half) rhs = j;
        else lhs = j;
    }
    r = PyUnicode_FromFormat("%U = %U[%s] %U  (%d inputs, %d outputs)", lhs, st->name,
                             st->pure ? "op node" : "node", rhs, st->nin, st->nout);
out:
    Py_XDECREF(parts);
    Py_XDECREF(sep);
    Py_XDECREF(lhs);
    Py_XDECREF(rhs);
    return r;
}

/* The program as text: one line per step. */
static PyObject *program_as_text(program *pr, PyObject *noargs) {
    (void)noargs;
    if (pr->broken != NULL)
        return pr->broken_at != NULL
                   ? PyUnicode_FromFormat("# not replayable: %U\n# where it broke (the innermost "
                                          "frames last):\n%U", pr->broken, pr->broken_at)
                   : PyUnicode_FromFormat("# not replayable: %U\n", pr->broken);
    PyObject *lines = PyList_New(0);
    if (lines == NULL) return NULL;
    for (int k = 0; k < pr->nsteps; k++) {
        pstep *st = &pr->steps[k];
        PyObject *line = st->fn != NULL ? node_text(st)
            : st->b >= 0
            ? PyUnicode_FromFormat("%%%d = %U[%s] %%%d, %%%d  -> %R %S", st->out, st->name,
                                   kind_names[st->e.kind], st->a, st->b, st->e.out_shape,
                                   st->e.out_dtype)
            : st->scalar != NULL
            ? PyUnicode_FromFormat("%%%d = %U[%s] %%%d, %R  -> %R %S", st->out, st->name,
                                   kind_names[st->e.kind], st->a, st->scalar, st->e.out_shape,
                                   st->e.out_dtype)
            : PyUnicode_FromFormat("%%%d = %U[%s] %%%d  -> %R %S", st->out, st->name,
                                   kind_names[st->e.kind], st->a, st->e.out_shape, st->e.out_dtype);
        if (line == NULL || PyList_Append(lines, line) < 0) {
            Py_XDECREF(line);
            Py_DECREF(lines);
            return NULL;
        }
        Py_DECREF(line);
    }
    PyObject *sep = PyUnicode_FromString("\n");
    PyObject *body = sep ? PyUnicode_Join(sep, lines) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(lines);
    if (body == NULL) return NULL;
    int nconst = 0, nchains = 0;
    for (int v = 0; v < pr->nvals; v++) nconst += pr->vkind[v] == V_CONST;
    for (int k = 0; k < pr->nsteps; k++) nchains += pr->steps[k].chain >= 2;
    /* the static memory plan, in one line */
    const int planned = plan_current(pr, NULL);
    if (planned < 0) {
        Py_DECREF(body);
        return NULL;
    }
    int ninternal = 0;
    long long most = 0;
    for (int v = 0; planned && v < pr->nvals; v++) ninternal += pr->internal[v];
    for (int a = 0; planned && a < pr->narenas; a++)
        if (pr->arena_bytes[a] > most) most = pr->arena_bytes[a];
    PyObject *plan = ninternal > 0
        ? PyUnicode_FromFormat("# static memory plan: %d values in one arena per device (at most "
                               "%lld bytes), held over steps %d..%d%s\n", ninternal, most,
                               pr->arena_first, pr->arena_last,
                               planned && pr->nsegs > 0 ? " and between runs (CUDA graphs)" : "")
        : PyUnicode_FromString("");
    PyObject *graphs = PyUnicode_FromString("");
    for (int g = 0; planned && graphs != NULL && g < pr->nsegs; g++) {
        const gseg *sg = &pr->segs[g];
        PyObject *line = PyUnicode_FromFormat("# CUDA graph: steps %d..%d, one per device on %d "
                                              "device%s%s\n", sg->k0, sg->k1 - 1, sg->ndev,
                                              sg->ndev == 1 ? "" : "s",
                                              sg->off ? " (its capture failed: run step by step)" : "");
        PyObject *joined = line != NULL ? PyUnicode_Concat(graphs, line) : NULL;
        Py_XDECREF(line);
        Py_SETREF(graphs, joined);
    }
    PyObject *t = plan == NULL || graphs == NULL ? NULL
        : PyUnicode_FromFormat("# %d arguments (%%0..%%%d), %d constants, %d steps, %d fused "
                               "elementwise chains\n%U%U%U\n", pr->nargs, pr->nargs - 1, nconst,
                               pr->nsteps, nchains, plan, graphs, body);
    Py_XDECREF(plan);
    Py_XDECREF(graphs);
    Py_DECREF(body);
    return t;
}

/* arena_layout(): the static memory plan, [(value, device id, offset, bytes, first step,
 * last step)] per block of each value in the arenas (what tests check the plan by). */
static PyObject *program_arena_layout(program *pr, PyObject *noargs) {
    (void)noargs;
    const int planned = plan_current(pr, "arena_layout");
    if (planned < 0) return NULL;
    PyObject *out = PyList_New(0);
    for (int v = 0; out != NULL && planned && v < pr->nvals; v++) {
        if (!pr->internal[v]) continue;
        int end = pr->nviews; /* (blocks are numbered value by value: up to the next value's) */
        for (int u = v + 1; u < pr->nvals && end == pr->nviews; u++)
            if (pr->internal[u]) end = pr->vfirst[u];
        for (int j = pr->vfirst[v]; out != NULL && j < end; j++) {
            PyObject *t = Py_BuildValue("(iinnii)", v, pr->arena_dev[pr->barena[j]]->id,
                                        (Py_ssize_t)pr->boff[j], (Py_ssize_t)pr->views[j]->nbytes,
                                        pr->blive[2 * j], pr->blive[2 * j + 1]);
            if (t == NULL || PyList_Append(out, t) < 0) Py_CLEAR(out);
            Py_XDECREF(t);
        }
    }
    return out;
}

/* memory_plan(): what a replay holds, for memory_analysis (python/ctrainstate/_src/jit/jit.py):
 * (values, steps, outputs, arenas): arenas (first step, last step, ((device id, bytes), ...)):
 * held from before the first step to after the last (-1, -1, (): none); values [(kind
 * 'arg'/'const'/'step'/'arena' (a step's, in the arenas), ((device id, bytes), ...),
 * last use: a step index, -1 never read, or None for an output)], steps [(input values,
 * output values, whether the step is a node whose outputs take over its inputs' buffers,
 * an op node's ((device id, bytes, kept), ...): allocated at most while it ran, held after
 * besides its outputs (until its first output's last use); or None, and ((output value, input
 * value), ...): a pure node's outputs that are its inputs' buffers (their memory is that
 * input's))],
 * outputs: the output values (-1: not an Array). */
static PyObject *program_memory_plan(program *pr, PyObject *noargs) {
    (void)noargs;
    const int planned = plan_current(pr, "memory_plan");
    if (planned < 0) return NULL;
    static const char *const kinds[] = {"arg", "const", "step"};
    PyObject *vals = PyList_New(pr->nvals), *steps = PyList_New(pr->nsteps),
             *outs = PyList_New(pr->nouts), *arenas = NULL;
    if (vals == NULL || steps == NULL || outs == NULL) goto fail;
    for (int v = 0; v < pr->nvals; v++) {
        PyObject *lu = pr->last_use[v] == INT32_MAX ? Py_NewRef(Py_None)
                                                    : PyLong_FromLong(pr->last_use[v]);
        PyObject *t = lu != NULL ? Py_BuildValue("(sON)",
                                                 planned && pr->internal[v] ? "arena" : kinds[pr->vkind[v]],
                                                 PyTuple_GET_ITEM(pr->vmeta[v], 3), lu)
                                 : NULL;
        if (t == NULL) goto fail;
        PyList_SET_ITEM(vals, v, t);
    }
    for (int k = 0; k < pr->nsteps; k++) {
        pstep *st = &pr->steps[k];
        PyObject *t;
        if (st->fn != NULL) {
            PyObject *in = PyTuple_New(st->nin), *out = PyTuple_New(st->nout);
            if (in == NULL || out == NULL) {
                Py_XDECREF(in);
                Py_XDECREF(out);
                goto fail;
            }
            int bad = 0;
            for (int i = 0; i < st->nin + st->nout; i++) {
                PyObject *o = PyLong_FromLong(st->io[i]);
                bad |= o == NULL;
                if (i < st->nin) PyTuple_SET_ITEM(in, i, o != NULL ? o : Py_NewRef(Py_None));
                else PyTuple_SET_ITEM(out, i - st->nin, o != NULL ? o : Py_NewRef(Py_None));
            }
            if (bad) {
                Py_DECREF(in);
                Py_DECREF(out);
                goto fail;
            }
            int na = 0;
            for (int j = 0; st->alias != NULL && j < st->nout; j++) na += st->alias[j] >= 0;
            PyObject *al = PyTuple_New(na);
            for (int j = 0, q = 0; al != NULL && st->alias != NULL && j < st->nout; j++) {
                if (st->alias[j] < 0) continue;
                PyObject *pair = Py_BuildValue("(ii)", st->io[st->nin + j], st->alias[j]);
                if (pair == NULL) Py_CLEAR(al);
                else PyTuple_SET_ITEM(al, q++, pair);
            }
            if (al == NULL) {
                Py_DECREF(in);
                Py_DECREF(out);
                goto fail;
            }
            t = Py_BuildValue("(NNOON)", in, out, st->pure ? Py_False : Py_True,
                              st->scratch != NULL ? st->scratch : Py_None, al);
        } else if (st->chain >= 2 && pr->fuse) { /* a fused chain: its first makes the last's result */
            const int out = pr->steps[k + st->chain - 1].out;
            t = st->b >= 0 ? Py_BuildValue("((ii)(i)OO())", st->a, st->b, out, Py_False, Py_None)
                           : Py_BuildValue("((i)(i)OO())", st->a, out, Py_False, Py_None);
        } else if (pr->fuse && k > 0 && chain_inner(pr, k)) { /* later steps: in place */
            const int other = st->e.kind == K_BINARY ? chain_other(st, 0) : -1;
            t = other >= 0 ? Py_BuildValue("((i)()OO())", other, Py_False, Py_None)
                           : Py_BuildValue("(()()OO())", Py_False, Py_None);
        } else {
            t = st->b >= 0 ? Py_BuildValue("((ii)(i)OO())", st->a, st->b, st->out, Py_False, Py_None)
                           : Py_BuildValue("((i)(i)OO())", st->a, st->out, Py_False, Py_None);
        }
        if (t == NULL) goto fail;
        PyList_SET_ITEM(steps, k, t);
    }
    for (int j = 0; j < pr->nouts; j++) {
        PyObject *o = PyLong_FromLong(pr->out_vals[j]);
        if (o == NULL) goto fail;
        PyList_SET_ITEM(outs, j, o);
    }
    const int na = planned && pr->nviews > 0 ? pr->narenas : 0;
    PyObject *sizes = PyTuple_New(na);
    if (sizes == NULL) goto fail;
    for (int a = 0; a < na; a++) {
        PyObject *t = Py_BuildValue("(iL)", pr->arena_dev[a]->id, (long long)pr->arena_bytes[a]);
        if (t == NULL) {
            Py_DECREF(sizes);
            goto fail;
        }
        PyTuple_SET_ITEM(sizes, a, t);
    }
    arenas = Py_BuildValue("(iiN)", na ? pr->arena_first : -1, na ? pr->arena_last : -1, sizes);
    if (arenas == NULL) goto fail;
    return Py_BuildValue("(NNNN)", vals, steps, outs, arenas);
fail:
    Py_XDECREF(vals);
    Py_XDECREF(steps);
    Py_XDECREF(outs);
    Py_XDECREF(arenas);
    return NULL;
}

/* matches(args): whether run(args) would replay this program (the argument Arrays' count,
 * shapes, dtypes and shardings are the recorded ones); runs nothing. */
static PyObject *program_matches(program *pr, PyObject *args) {
    if (!PyList_Check(args)) return PyErr_Format(PyExc_TypeError, "Program.matches takes a list");
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    if (!pr->finished || PyList_GET_SIZE(args) != pr->nargs || pr->vmeta == NULL ||
        pr->broken != NULL)
        Py_RETURN_FALSE;
    for (int i = 0; i < pr->nargs; i++) {
        PyObject *x = PyList_GET_ITEM(args, i);
        if (!Py_IS_TYPE(x, at) || !arg_match(pr, i, (ct_py_array *)x)) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* set_fusion(on): run the fused chains as chains (the default) or step by step. */
static PyObject *program_set_fusion(program *pr, PyObject *args) {
    int on, tiled = 1;
    if (!PyArg_ParseTuple(args, "p|p:set_fusion", &on, &tiled)) return NULL;
    pr->fuse = on;
    pr->tile = tiled;
    Py_RETURN_NONE;
}

/* set_graphs(on): replay runs of GPU steps as CUDA graphs (the default unless
 * CTRAINSTATE_CUDA_GRAPHS=0) or kernel by kernel; the graphs and the arenas held for them are
 * released now (made again at the next run). */
static PyObject *program_set_graphs(program *pr, PyObject *on) {
    const int v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    if (pr->arena_busy)
        return PyErr_Format(PyExc_RuntimeError, "Program.set_graphs: a run on another thread "
                            "holds the program's arenas");
    pr->graphs = v;
    if (pr->planned) plan_free(pr);
    Py_RETURN_NONE;
}

/* graph_stats(): per segment (first step, last step, devices, captures, updates in place,
 * launches, whether its capture failed). */
static PyObject *program_graph_stats(program *pr, PyObject *noargs) {
    (void)noargs;
    if (plan_current(pr, "graph_stats") < 0) return NULL;
    PyObject *r = PyList_New(pr->nsegs);
    for (int g = 0; r != NULL && g < pr->nsegs; g++) {
        const gseg *sg = &pr->segs[g];
        PyObject *t = Py_BuildValue("(iiiLLLO)", sg->k0, sg->k1 - 1, sg->ndev, sg->captures,
                                    sg->updates, sg->launches, sg->off ? Py_True : Py_False);
        if (t == NULL) Py_CLEAR(r);
        else PyList_SET_ITEM(r, g, t);
    }
    return r;
}

/* chains: [(first step, length)] of the fused chains. */
static PyObject *program_get_chains(program *pr, void *c) {
    (void)c;
    PyObject *out = PyList_New(0);
    for (int k = 0; out != NULL && k < pr->nsteps; k++) {
        if (pr->steps[k].chain < 2) continue;
        PyObject *t = Py_BuildValue("(ii)", k, pr->steps[k].chain);
        if (t == NULL || PyList_Append(out, t) < 0) Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

/* set_timing(on): time every step of later runs (step_times), or stop and forget. */
static PyObject *program_set_timing(program *pr, PyObject *on) {
    int v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    PyMem_Free(pr->step_ns);
    pr->step_ns = NULL;
    pr->timed_runs = 0;
    if (v && pr->finished && pr->broken == NULL) {
        pr->step_ns = PyMem_Calloc(pr->nsteps > 0 ? (size_t)pr->nsteps : 1, sizeof(double));
        if (pr->step_ns == NULL) return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

/* step_times: [(step index, name, mean microseconds per run)] since set_timing(True). */
static PyObject *program_get_step_times(program *pr, void *c) {
    (void)c;
    PyObject *out = PyList_New(0);
    if (out == NULL || pr->step_ns == NULL || pr->timed_runs == 0) return out;
    for (int k = 0; k < pr->nsteps; k++) {
        PyObject *t = Py_BuildValue("(iOd)", k, pr->steps[k].name,
                                    pr->step_ns[k] / 1e3 / (double)pr->timed_runs);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
    }
    return out;
}

static PyObject *program_get_broken(program *pr, void *c) {
    (void)c;
    return Py_NewRef(pr->broken != NULL ? pr->broken : Py_None);
}

static PyObject *program_get_nsteps(program *pr, void *c) {
    (void)c;
    return PyLong_FromLong(pr->nsteps);
}

static PyMethodDef program_methods[] = {
    {"finish", (PyCFunction)program_finish, METH_O,
     "finish($self, outputs, /)\n--\n\nEnd the recording with the function's output leaves."},
    {"run", (PyCFunction)program_run, METH_O,
     "run($self, args, /)\n--\n\nThe outputs for new argument Arrays, or None when one does not "
     "have the recorded shape, dtype and sharding."},
    {"run_donating", (PyCFunction)(void (*)(void))program_run_donating, METH_FASTCALL,
     "run_donating($self, args, donate, /)\n--\n\nrun(args), the arguments at the positions "
     "`donate` given up at their last use (their Arrays donated afterwards)."},
    {"matches", (PyCFunction)program_matches, METH_O,
     "matches($self, args, /)\n--\n\nWhether run(args) would replay this program (runs nothing)."},
    {"arena_layout", (PyCFunction)program_arena_layout, METH_NOARGS,
     "arena_layout($self, /)\n--\n\nThe static memory plan: [(value, device id, offset, bytes, "
     "first step, last step)] for each block of the values that live in the arenas."},
    {"memory_plan", (PyCFunction)program_memory_plan, METH_NOARGS,
     "memory_plan($self, /)\n--\n\n(values, steps, outputs): every value's kind, bytes per device "
     "and last use, each step's input and output values, the outputs (for memory_analysis)."},
    {"set_fusion", (PyCFunction)program_set_fusion, METH_VARARGS,
     "set_fusion($self, on, tiled=True, /)\n--\n\nRun the fused elementwise chains as chains "
     "(the default) or step by step; a chain on a CPU device tiled (each thread runs every step "
     "on its tile of rows before the next tile: one pass over memory) or step after step over "
     "the whole block. The same bits every way."},
    {"set_graphs", (PyCFunction)program_set_graphs, METH_O,
     "set_graphs($self, on, /)\n--\n\nReplay runs of steps on GPU devices as CUDA graphs (the "
     "default unless CTRAINSTATE_CUDA_GRAPHS=0) or kernel by kernel. The same bits either way."},
    {"graph_stats", (PyCFunction)program_graph_stats, METH_NOARGS,
     "graph_stats($self, /)\n--\n\n[(first step, last step, devices, captures, updates, "
     "launches, capture failed)] per run of steps replayed as CUDA graphs."},
    {"set_timing", (PyCFunction)program_set_timing, METH_O,
     "set_timing($self, on, /)\n--\n\nTime each step of later runs (step_times), or stop."},
    {"as_text", (PyCFunction)program_as_text, METH_NOARGS,
     "as_text($self, /)\n--\n\nThe steps, one per line, or why the function is not replayable."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef program_getset[] = {
    {"broken", (getter)program_get_broken, NULL,
     "Why the traced function cannot be replayed (it then runs eagerly), or None.", NULL},
    {"nsteps", (getter)program_get_nsteps, NULL, "The number of recorded steps.", NULL},
    {"chains", (getter)program_get_chains, NULL,
     "[(first step, length)] of the chains of elementwise steps that run fused.", NULL},
    {"step_times", (getter)program_get_step_times, NULL,
     "[(step, name, mean microseconds per run)] of the runs since set_timing(True).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot program_slots[] = {
    {Py_tp_new, program_new},
    {Py_tp_dealloc, program_dealloc},
    {Py_tp_traverse, program_traverse},
    {Py_tp_clear, program_clear},
    {Py_tp_methods, program_methods},
    {Py_tp_getset, program_getset},
    {Py_tp_doc, "Program()\n--\n\nA traced function's primitive calls, replayed from C "
                "(ctrainstate.jit; csrc/python/py_dispatch.c)."},
    {0, NULL},
};

static PyType_Spec program_spec = {
    .name = "ctrainstate._C.Program",
    .basicsize = sizeof(program),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = program_slots,
};

static PyMethodDef dispatch_methods[] = {
    {"dispatch_register_typed", (PyCFunction)(void (*)(void))py_dispatch_register_typed,
     METH_FASTCALL,
     "dispatch_register_typed(less, less_equal, equal, not_equal, greater, greater_equal,\n"
     "                        bitwise_and, bitwise_or, bitwise_xor, invert, /)\n--\n\n"
     "Register the primitives behind the Array's < <= == != > >= (each called with the Array\n"
     "and the other operand), & | ^ (the operands in order) and ~."},
    {"tls_changed", py_tls_changed, METH_NOARGS,
     "tls_changed()\n--\n\n"
     "Tell the C readers of the package's thread-locals that an attribute of one was set or\n"
     "deleted (on any thread, or on its class): their memo of the values read is dropped.\n"
     "base.threadlocal.NotifyingLocal calls it on every write."},
    {"dispatch_register", (PyCFunction)(void (*)(void))py_dispatch_register, METH_FASTCALL,
     "dispatch_register(tls, tape_type, precision_tls, named_sharding, add, subtract,\n"
     "                  multiply, divide, negative, matmul, /)\n--\n\n"
     "Register the thread-local holding the autodiff tape stack (`tapes`), the tape class the\n"
     "C path records on, the thread-local of the matmul precision (`default`, `process`), the\n"
     "NamedSharding class (equal ones share plans), and the primitives behind the Array's\n"
     "+ - * / @ and unary -."},
    {"trace_begin", (PyCFunction)(void (*)(void))py_trace_begin, METH_FASTCALL,
     "trace_begin(program, args, /)\n--\n\nRecord the primitive calls of this thread into "
     "`program`; `args`: the traced function's argument Arrays, in the order run() takes them."},
    {"trace_end", py_trace_end, METH_NOARGS, "trace_end()\n--\n\nStop recording."},
    {"split_args", (PyCFunction)(void (*)(void))py_split_args, METH_FASTCALL,
     "split_args(leaves, int_template=None, /)\n--\n\nA jitted call's argument leaves as "
     "(Arrays, key parts, the leaves to trace with or None), or (None, the type name of a leaf "
     "that is neither an Array nor None/bool/int/float/str, None); with int_template, ints in "
     "the int32 range become int32 Arrays placed as it."},
    {"trace_node", (PyCFunction)(void (*)(void))py_trace_node, METH_FASTCALL,
     "trace_node(name, fn, ins, pure=False, /)\n--\n\nfn(ins) (Arrays in, Arrays out) with the "
     "recording paused; while a program records on this thread, one step of it that calls fn "
     "again on replay: a step in place, such as an optimizer's, or with `pure` an op that makes "
     "new outputs (dropped when no output is used; its outputs counted as new memory)."},
    {"int_like", (PyCFunction)(void (*)(void))py_int_like, METH_FASTCALL,
     "int_like(template, value, /)\n--\n\nA new 0-d int32 Array of `value` placed as "
     "`template` (a 0-d int32 Array on one device)."},
    {"trace_break", (PyCFunction)(void (*)(void))py_trace_break, METH_FASTCALL,
     "trace_break(reason, x=None, /)\n--\n\nMark the program recording on this thread as not "
     "replayable (when x is None or an Array over traced buffers); whether it did."},
    {"trace_active", py_trace_active, METH_NOARGS,
     "trace_active()\n--\n\nWhether a program records on this thread."},
    {"grad_track", (PyCFunction)(void (*)(void))py_grad_track, METH_FASTCALL,
     "grad_track(leaves, tape, floats, /)\n--\n\n"
     "value_and_grad's differentiated leaves as new Arrays over their buffers, tracked on the "
     "tape; None (nothing tracked) where the Python path must run."},
    {"grad_collect", (PyCFunction)(void (*)(void))py_grad_collect, METH_FASTCALL,
     "grad_collect(leaves, cot, zeros=False, /)\n--\n\n"
     "(each leaf's cotangent where it has the leaf's layout, else None; how many are None); "
     "with `zeros`, a leaf of float32 blocks without a cotangent gets zeros of its layout."},
    {"filled_like", (PyCFunction)(void (*)(void))py_filled_like, METH_FASTCALL,
     "filled_like(x, value, /)\n--\n\n"
     "ops._filled_like(x, value) in C for an Array of float32 blocks: new buffers of x's "
     "layout, every element `value`; None for anything else (the Python function's)."},
    {"vjp_register", (PyCFunction)(void (*)(void))py_vjp_register, METH_FASTCALL,
     "vjp_register(sum, reshape, broadcast_like, /)\n--\n\n"
     "The primitives the backward pass's C rules call (un-broadcasting a cotangent, sum's "
     "rule)."},
    {"tape_backward", (PyCFunction)(void (*)(void))py_tape_backward, METH_FASTCALL,
     "tape_backward(nodes, tracked, cot, group_type, /)\n--\n\n"
     "The backward pass over a tape's nodes, last to first: each (out, inputs, vjp) node takes\n"
     "cot[id(out)] (popped; a node without one is skipped), calls vjp on it, and adds each\n"
     "cotangent of a tracked Array input (id in `tracked`) into cot[id(input)] with the add\n"
     "primitive; a group_type node (outs, inputs, vjp) calls vjp(output cotangents, the inputs'\n"
     "so far) and stores the inputs' new ones. `cot` (id -> Array) is updated in place."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_dispatch(PyObject *m) {
    tapes_name = PyUnicode_InternFromString("tapes");
    outer_name = PyUnicode_InternFromString("outer");
    tracked_name = PyUnicode_InternFromString("tracked");
    keep_name = PyUnicode_InternFromString("keep");
    default_name = PyUnicode_InternFromString("default");
    process_name = PyUnicode_InternFromString("process");
    mesh_name = PyUnicode_InternFromString("mesh");
    norm_name = PyUnicode_InternFromString("_norm");
    delete_name = PyUnicode_InternFromString("delete");
    dict_name = PyUnicode_InternFromString("__dict__");
    notifies_name = PyUnicode_InternFromString("_ct_notifies_writes");
    if (delete_name == NULL || dict_name == NULL || notifies_name == NULL) return -1;
    PyObject *thread_mod = PyImport_ImportModule("_thread");
    thread_local_type = thread_mod != NULL
        ? (PyTypeObject *)PyObject_GetAttrString(thread_mod, "_local") : NULL;
    Py_XDECREF(thread_mod);
    if (thread_local_type == NULL) return -1;
    if (!PyType_Check(thread_local_type)) {
        PyErr_SetString(PyExc_TypeError, "_thread._local is not a type");
        return -1;
    }
    traceback_mod = PyImport_ImportModule("traceback");
    if (traceback_mod == NULL) return -1;
    if (!tapes_name || !outer_name || !tracked_name || !keep_name ||
        !default_name || !process_name || !mesh_name || !norm_name)
        return -1;
    PyObject *pgt = PyType_FromSpec(&program_spec);
    if (pgt == NULL || PyModule_AddObjectRef(m, "Program", pgt) < 0) return -1;
    program_type = (PyTypeObject *)pgt;
    PyObject *vpt = PyType_FromSpec(&vp_spec);
    if (vpt == NULL || PyModule_AddObjectRef(m, "VjpProgram", vpt) < 0) return -1;
    vjp_program_type = (PyTypeObject *)vpt;
    node_vjp_type = (PyTypeObject *)PyType_FromSpec(&node_vjp_spec);
    if (node_vjp_type == NULL) return -1;
    if (PyModule_AddFunctions(m, dispatch_methods) < 0) return -1;
    PyObject *t = PyType_FromSpec(&prim_spec);
    if (t == NULL) return -1;
    prim_type = (PyTypeObject *)t;
    if (PyModule_AddObjectRef(m, "Primitive", t) < 0) return -1;
    PyObject *kinds = Py_BuildValue("{sisisisisisisisisisisi}", "UNARY", K_UNARY, "BINARY", K_BINARY,
                                    "EWISE", K_EWISE, "REDUCE", K_REDUCE, "SCALAR", K_SCALAR,
                                    "MATMUL", K_MATMUL, "COPY", K_COPY, "BCAST", K_BCAST,
                                    "CONVERT", K_CONVERT, "TRANSPOSE", K_TRANSPOSE, "UNARY16", K_UNARY16);
    if (kinds == NULL || PyModule_AddObject(m, "dispatch_kinds", kinds) < 0) {
        Py_XDECREF(kinds);
        return -1;
    }
    PyObject *rules = Py_BuildValue("{sisisisisisi}", "ADD", S_ADD, "SUB_R", S_SUB_R, "SUB_L",
                                    S_SUB_L, "MUL", S_MUL, "DIV_R", S_DIV_R, "DIV_L", S_DIV_L);
    if (rules == NULL || PyModule_AddObject(m, "dispatch_scalar_rules", rules) < 0) {
        Py_XDECREF(rules);
        return -1;
    }
    return 0;
}
