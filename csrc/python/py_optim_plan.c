/*
 * py_optim_plan.c — ctrainstate._C.OptimPlan: a persistent fused optimizer step.
 *
 * An in-place step (TrainState.apply_gradients) updates the same param and state buffers
 * step after step; only the grads and a few per-step scalars (bias corrections, a
 * schedule's value) change. The Python layer builds a plan once, after a step it ran the
 * general way (python/ctrainstate/optim/base.py, `_build_fast_plan`): the stages, every
 * device's blocks with their param and state buffers, where each block's grads come from,
 * the state's Arrays (params first, then the optimizer state's leaves in tree order) and
 * which of them are step counters. Each later step is one call:
 *
 *   plan.step(arrays, grads, scalars, count) -> new arrays, or None
 *
 *   arrays   the list this plan returned last (the state being stepped holds it); any
 *            other list is an older state, whose Arrays were donated: DonatedBufferError
 *   grads    the grads' leaves in the params' order (a flat list)
 *   scalars  one sequence of floats per stage (this step's values)
 *   count    the counters' new value as a numpy int32 scalar (their host copy)
 *
 * Everything is checked before anything is written, in C, without calling Python: each
 * Array of `arrays` is neither donated nor deleted, each grads leaf is an Array of the
 * recorded global shape whose blocks lie on the recorded devices at the recorded starts,
 * with the recorded byte size and dtype. A grads tree placed otherwise (another sharding,
 * numpy leaves, a donated Array) returns None: the caller takes the general path, which
 * validates, reshards or raises with paths in its messages. The step then claims the
 * state (the same claim as the general path's `_claim`, so two threads never step one
 * state), pins every buffer, runs ct_optim_step with the GIL released, writes the counters
 * and hands every Array's buffers on to new Arrays (the old ones are marked donated), as
 * `Array._moved_all` does. No Python code runs between the kernel and the commit, so a
 * KeyboardInterrupt is seen either before the step (nothing changed) or after it.
 */
#include "py_optim.h"

#include <string.h>

#include "../core/ct_ops.h"

Py_ssize_t ct_py_plans_running;
uint64_t ct_py_plan_deletions;

typedef struct {
    PyObject_HEAD
    ct_opt_stage st[CT_OPT_MAX_STAGES];
    int nstages;
    ct_opt_group *groups;
    int ngroups, nleaves;
    Py_ssize_t nblocks;      /* all groups' blocks */
    int32_t *g_leaf, *g_blk; /* per block (groups in order): the grads leaf and its block */
    PyObject **g_dev;        /* per block: the device object of the grads block (strong) */
    PyObject **g_start;      /* per block: its start tuple (strong) */
    size_t *g_nbytes;
    int *g_dtype;
    PyObject **g_shape;      /* per leaf: the grads' global shape (strong) */
    Py_ssize_t *g_nblk;      /* per leaf: blocks of the grads Array */
    ct_py_pin_list refs;     /* the param and state buffers: references; pinned per step */
    PyObject *cur;           /* the Arrays of the latest step: params, then the state */
    Py_ssize_t nparams, narrays;
    Py_ssize_t *counters, ncounters; /* indices into cur of the int32 step counters */
    PyObject *claim_lock, *claimed;  /* optim.base's _CLAIM_LOCK and _CLAIMED */
    PyObject *lock_acquire, *lock_release; /* its bound acquire and release, looked up once */
    PyObject *prog;          /* the params' dict structure (prog_flatten), or NULL */
    PyObject *sprog;         /* the state's template (state_fill), or NULL */
    PyObject *stypes;        /* the tuple subclasses sprog may hold (a frozenset), or NULL */
    ct_optim_prepared *prep; /* the core's tables of the step (ct_optim_prepare) */
    int busy;
    uint64_t deletions_seen; /* ct_py_plan_deletions when no buffer of refs was deleted */
    int refs_plain;          /* refs hold references and plan_refs (pins undone, plan_init) */
    PyObject *weakreflist;
} optim_plan;

static void plan_clear_fields(optim_plan *p) {
    ct_optim_prepared_free(p->prep);
    p->prep = NULL;
    if (p->groups != NULL) {
        for (int i = 0; i < p->ngroups; i++) PyMem_Free(p->groups[i].blocks);
        PyMem_Free(p->groups);
        p->groups = NULL;
    }
    for (Py_ssize_t k = 0; k < p->nblocks; k++) {
        if (p->g_dev != NULL) Py_CLEAR(p->g_dev[k]);
        if (p->g_start != NULL) Py_CLEAR(p->g_start[k]);
    }
    if (p->g_shape != NULL)
        for (int i = 0; i < p->nleaves; i++) Py_CLEAR(p->g_shape[i]);
    PyMem_Free(p->g_leaf);
    PyMem_Free(p->g_blk);
    PyMem_Free(p->g_dev);
    PyMem_Free(p->g_start);
    PyMem_Free(p->g_nbytes);
    PyMem_Free(p->g_dtype);
    PyMem_Free(p->g_shape);
    PyMem_Free(p->g_nblk);
    PyMem_Free(p->counters);
    p->g_leaf = p->g_blk = NULL;
    p->g_dev = p->g_start = p->g_shape = NULL;
    p->g_nbytes = NULL;
    p->g_dtype = NULL;
    p->g_nblk = p->counters = NULL;
    p->nblocks = 0;
    if (p->refs_plain) /* ct_py_pin_release undoes pins */
        for (Py_ssize_t r = 0; r < p->refs.n; r++) {
            p->refs.v[r]->busy++;
            p->refs.v[r]->plan_refs--;
        }
    p->refs_plain = 0;
    ct_py_pin_release(&p->refs);
    Py_CLEAR(p->cur);
    Py_CLEAR(p->claim_lock);
    Py_CLEAR(p->lock_acquire);
    Py_CLEAR(p->lock_release);
    Py_CLEAR(p->claimed);
    Py_CLEAR(p->prog);
    Py_CLEAR(p->sprog);
    Py_CLEAR(p->stypes);
}

static void plan_dealloc(optim_plan *p) {
    PyObject_GC_UnTrack(p);
    if (p->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)p);
    plan_clear_fields(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static int plan_traverse(optim_plan *p, visitproc visit, void *arg) {
    Py_VISIT(p->cur);
    Py_VISIT(p->prog);
    Py_VISIT(p->sprog);
    Py_VISIT(p->stypes);
    Py_VISIT(p->claim_lock);
    Py_VISIT(p->lock_acquire);
    Py_VISIT(p->lock_release);
    Py_VISIT(p->claimed);
    return 0;
}

static int plan_tp_clear(optim_plan *p) {
    if (p->busy) return 0; /* (a step without the GIL holds the buffers: never while busy) */
    Py_CLEAR(p->cur);
    return 0;
}

/* The i-th block tuple (dev, buffer, start, replica) of Array a, or NULL (no exception). */
static PyObject *array_block(PyObject *a, Py_ssize_t i) {
    PyObject *bl = *ct_py_array_slot(a, CT_PY_A_BLOCKS);
    if (bl == NULL || !PyList_Check(bl) || i >= PyList_GET_SIZE(bl)) return NULL;
    PyObject *t = PyList_GET_ITEM(bl, i);
    return (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 4) ? t : NULL;
}

static int is_live_buffer(PyObject *o) {
    if (!Py_IS_TYPE(o, &ct_py_BufferType) || ((ct_py_buffer *)o)->deleted) return 0;
    ct_py_trace_touch(o, "an optimizer step"); /* (a traced parameter: not replayable) */
    return 1;
}

/* The params' structure when it is made of plain dicts only (the usual Flax params): a
 * "program", None for a leaf, else a tuple of (key, program) pairs in the treedef's (sorted)
 * key order. flatten / unflatten follow it with dict lookups, no sorting of keys. */
static int prog_flatten(PyObject *prog, PyObject *tree, PyObject **out, Py_ssize_t *i,
                        Py_ssize_t n) {
    if (prog == Py_None) {
        if (*i >= n) return 0;
        out[(*i)++] = tree; /* borrowed: the tree holds it while the step runs */
        return 1;
    }
    if (!PyDict_CheckExact(tree) || PyDict_GET_SIZE(tree) != PyTuple_GET_SIZE(prog)) return 0;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(prog); j++) {
        PyObject *kv = PyTuple_GET_ITEM(prog, j);
        PyObject *v = PyDict_GetItemWithError(tree, PyTuple_GET_ITEM(kv, 0));
        if (v == NULL) {
            PyErr_Clear();
            return 0;
        }
        if (!prog_flatten(PyTuple_GET_ITEM(kv, 1), v, out, i, n)) return 0;
    }
    return 1;
}

/* A new dict presized for n entries (no resize while it is filled). */
static PyObject *dict_presized(Py_ssize_t n) {
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_NewPresized(n);
#else
    (void)n;
    return PyDict_New();
#endif
}

static PyObject *prog_unflatten(PyObject *prog, PyObject *leaves, Py_ssize_t *i) {
    if (prog == Py_None) return Py_NewRef(PyList_GET_ITEM(leaves, (*i)++));
    PyObject *d = dict_presized(PyTuple_GET_SIZE(prog));
    if (d == NULL) return NULL;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(prog); j++) {
        PyObject *kv = PyTuple_GET_ITEM(prog, j);
        PyObject *v = prog_unflatten(PyTuple_GET_ITEM(kv, 1), leaves, i);
        if (v == NULL || PyDict_SetItem(d, PyTuple_GET_ITEM(kv, 0), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

/* Whether prog is a well-formed program of n leaves (checked once, at set_structure). */
static Py_ssize_t prog_leaves(PyObject *prog) {
    if (prog == Py_None) return 1;
    if (!PyTuple_CheckExact(prog)) return -1;
    Py_ssize_t n = 0;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(prog); j++) {
        PyObject *kv = PyTuple_GET_ITEM(prog, j);
        if (!PyTuple_CheckExact(kv) || PyTuple_GET_SIZE(kv) != 2) return -1;
        Py_ssize_t m = prog_leaves(PyTuple_GET_ITEM(kv, 1));
        if (m < 0) return -1;
        n += m;
    }
    return n;
}

/* The optimizer state's structure as a template: the state tree with each leaf replaced by
 * its index (an exact int) in the state's part of the Arrays list, built from the treedef by
 * optim.base. Its nodes are plain dicts (rebuilt with the same keys in the same order), exact
 * tuples, None, and tuple subclasses listed in `types` (plain namedtuples, whose constructor
 * is tuple.__new__ with the items, checked by optim.base), so that filling it makes the tree
 * the treedef's unflatten would make, without calling Python code. */
static PyObject *state_fill(PyObject *t, PyObject *leaves, Py_ssize_t base) {
    if (PyLong_CheckExact(t))
        return Py_NewRef(PyList_GET_ITEM(leaves, base + PyLong_AsSsize_t(t)));
    if (t == Py_None) return Py_NewRef(Py_None);
    if (PyDict_CheckExact(t)) {
        PyObject *d = dict_presized(PyDict_GET_SIZE(t));
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (d != NULL && PyDict_Next(t, &pos, &k, &v)) {
            PyObject *x = state_fill(v, leaves, base);
            if (x == NULL || PyDict_SetItem(d, k, x) < 0) Py_CLEAR(d);
            Py_XDECREF(x);
        }
        return d;
    }
    /* a tuple, or a plain namedtuple (tuple_subtype_new copies the items: tuple.__new__) */
    const Py_ssize_t n = PyTuple_GET_SIZE(t);
    PyObject *items = PyTuple_New(n);
    for (Py_ssize_t j = 0; items != NULL && j < n; j++) {
        PyObject *x = state_fill(PyTuple_GET_ITEM(t, j), leaves, base);
        if (x == NULL) Py_CLEAR(items);
        else PyTuple_SET_ITEM(items, j, x);
    }
    if (items == NULL || PyTuple_CheckExact(t)) return items;
    PyObject *args = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (args == NULL) return NULL;
    PyObject *r = PyTuple_Type.tp_new(Py_TYPE(t), args, NULL);
    Py_DECREF(args);
    return r;
}

/* The number of leaves of a well-formed template whose tuple subclasses are in `types`, each
 * leaf index in [0, n) used once (seen[]), or -1. */
static Py_ssize_t state_check(PyObject *t, PyObject *types, char *seen, Py_ssize_t n, int depth) {
    if (depth > 64) return -1;
    if (PyLong_CheckExact(t)) {
        const Py_ssize_t i = PyLong_AsSsize_t(t);
        if (i < 0 || i >= n || seen[i]) {
            PyErr_Clear();
            return -1;
        }
        seen[i] = 1;
        return 1;
    }
    if (t == Py_None) return 0;
    Py_ssize_t m = 0;
    if (PyDict_CheckExact(t)) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(t, &pos, &k, &v)) {
            const Py_ssize_t c = state_check(v, types, seen, n, depth + 1);
            if (c < 0) return -1;
            m += c;
        }
        return m;
    }
    if (!PyTuple_Check(t)) return -1;
    if (!PyTuple_CheckExact(t)) {
        const int ok = PySet_Contains(types, (PyObject *)Py_TYPE(t));
        if (ok != 1) {
            PyErr_Clear();
            return -1;
        }
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(t); j++) {
        const Py_ssize_t c = state_check(PyTuple_GET_ITEM(t, j), types, seen, n, depth + 1);
        if (c < 0) return -1;
        m += c;
    }
    return m;
}

/* OptimPlan(stages, groups, order, nleaves, grads, arrays, nparams, counters, lock, claimed)
 *   stages  [(kind, scalars)]; groups: per device, block tuples as _C.optim_step takes them
 *   (their g: None); order: per group, (leaf, block) of each block; grads: this step's grads
 *   Arrays, one per leaf (what later grads must look like); arrays: the state's Arrays after
 *   this step; counters: indices into arrays of the int32 counters. */
static int plan_init(optim_plan *self, PyObject *args, PyObject *kw) {
    PyObject *stages, *groups, *order, *grads, *arrays, *counters, *lock, *claimed;
    int nleaves;
    Py_ssize_t nparams;
    if (kw != NULL && PyDict_GET_SIZE(kw) != 0) {
        PyErr_SetString(PyExc_TypeError, "OptimPlan takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!O!iO!O!nO!OO!:OptimPlan", &stages, &PyList_Type, &groups,
                          &PyList_Type, &order, &nleaves, &PyList_Type, &grads, &PyList_Type,
                          &arrays, &nparams, &PyList_Type, &counters, &lock, &PySet_Type,
                          &claimed))
        return -1;
    if (self->groups != NULL || self->cur != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "OptimPlan is initialised once");
        return -1;
    }
    if (ct_py_array_type() == NULL) return -1;
    if (ct_py_optim_parse_stages(stages, self->st, &self->nstages) < 0) return -1;
    ct_status cs = ct_optim_check(self->st, self->nstages);
    if (cs != CT_OK) {
        ct_py_raise(cs);
        return -1;
    }
    int nslots = 0;
    for (int k = 0; k < self->nstages; k++) nslots += ct_opt_kind_nslots(self->st[k].kind);
    const Py_ssize_t ng = PyList_GET_SIZE(groups);
    if (PyList_GET_SIZE(order) != ng || PyList_GET_SIZE(grads) != nleaves || nleaves < 0 ||
        nparams != nleaves || PyList_GET_SIZE(arrays) < nparams) {
        PyErr_SetString(PyExc_ValueError, "OptimPlan: groups, order, grads and arrays disagree");
        return -1;
    }
    self->nleaves = nleaves;
    self->nparams = nparams;
    Py_ssize_t nb = 0;
    for (Py_ssize_t i = 0; i < ng; i++) {
        PyObject *gi = PyList_GET_ITEM(groups, i), *oi = PyList_GET_ITEM(order, i);
        if (!PyList_Check(gi) || !PyList_Check(oi) || PyList_GET_SIZE(gi) != PyList_GET_SIZE(oi)) {
            PyErr_SetString(PyExc_ValueError, "OptimPlan: a group and its order differ");
            return -1;
        }
        nb += PyList_GET_SIZE(gi);
    }
    self->groups = PyMem_Calloc((size_t)(ng > 0 ? ng : 1), sizeof *self->groups);
    self->g_leaf = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(int32_t));
    self->g_blk = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(int32_t));
    self->g_dev = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(PyObject *));
    self->g_start = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(PyObject *));
    self->g_nbytes = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(size_t));
    self->g_dtype = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(int));
    self->g_shape = PyMem_Calloc((size_t)(nleaves > 0 ? nleaves : 1), sizeof(PyObject *));
    self->g_nblk = PyMem_Calloc((size_t)(nleaves > 0 ? nleaves : 1), sizeof(Py_ssize_t));
    if (self->groups == NULL || self->g_leaf == NULL || self->g_blk == NULL ||
        self->g_dev == NULL || self->g_start == NULL || self->g_nbytes == NULL ||
        self->g_dtype == NULL || self->g_shape == NULL || self->g_nblk == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->ngroups = (int)ng;
    self->nblocks = nb;
    for (int i = 0; i < nleaves; i++) {
        PyObject *g = PyList_GET_ITEM(grads, i);
        if (!Py_IS_TYPE(g, ct_py_array_type())) {
            PyErr_Format(PyExc_TypeError, "OptimPlan: grads leaf %d is not an Array", i);
            return -1;
        }
        PyObject *shape = *ct_py_array_slot(g, CT_PY_A_SHAPE);
        PyObject *bl = *ct_py_array_slot(g, CT_PY_A_BLOCKS);
        if (shape == NULL || bl == NULL || !PyList_Check(bl)) {
            PyErr_Format(PyExc_TypeError, "OptimPlan: grads leaf %d is not set up", i);
            return -1;
        }
        self->g_shape[i] = Py_NewRef(shape);
        self->g_nblk[i] = PyList_GET_SIZE(bl);
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < ng; i++) {
        PyObject *gi = PyList_GET_ITEM(groups, i), *oi = PyList_GET_ITEM(order, i);
        const Py_ssize_t n = PyList_GET_SIZE(gi);
        self->groups[i].blocks = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(ct_opt_block));
        if (self->groups[i].blocks == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->groups[i].nblocks = (int)n;
        for (Py_ssize_t j = 0; j < n; j++, k++) {
            int leaf, blk;
            if (!PyArg_ParseTuple(PyList_GET_ITEM(oi, j), "ii:order", &leaf, &blk)) return -1;
            if (leaf < 0 || leaf >= nleaves || blk < 0 || blk >= self->g_nblk[leaf]) {
                PyErr_SetString(PyExc_ValueError, "OptimPlan: order names a missing grads block");
                return -1;
            }
            PyObject *t = array_block(PyList_GET_ITEM(grads, leaf), blk);
            if (t == NULL || !is_live_buffer(PyTuple_GET_ITEM(t, 1))) {
                PyErr_Format(PyExc_ValueError, "OptimPlan: grads leaf %d block %d is not live",
                             leaf, blk);
                return -1;
            }
            ct_py_buffer *gb = (ct_py_buffer *)PyTuple_GET_ITEM(t, 1);
            self->g_leaf[k] = leaf;
            self->g_blk[k] = blk;
            self->g_dev[k] = Py_NewRef(PyTuple_GET_ITEM(t, 0));
            self->g_start[k] = Py_NewRef(PyTuple_GET_ITEM(t, 2));
            self->g_nbytes[k] = gb->nbytes;
            self->g_dtype[k] = (int)gb->dtype;
            /* parse with the grads buffer (sizes checked against the param), then forget it:
             * the grads are pinned per step */
            const Py_ssize_t before = self->refs.n;
            if (ct_py_optim_parse_block(PyList_GET_ITEM(gi, j), (PyObject *)gb,
                                        &self->groups[i].blocks[j], nslots, &self->refs,
                                        &self->groups[i].dev) < 0)
                return -1;
            for (Py_ssize_t r = before; r < self->refs.n; r++) {
                if (self->refs.v[r] == gb) { /* drop the grads' pin, keep the rest */
                    ct_py_unpin(gb);
                    self->refs.v[r] = self->refs.v[--self->refs.n];
                    break;
                }
            }
        }
    }
    /* the core's tables, made once (the blocks' grads are set: they are checked too) */
    ct_status pst = ct_optim_prepare(self->st, self->nstages, self->groups, self->ngroups,
                                     nleaves, &self->prep);
    for (int i = 0; i < self->ngroups; i++)
        for (int j = 0; j < self->groups[i].nblocks; j++) self->groups[i].blocks[j].g = NULL;
    if (pst != CT_OK) {
        ct_py_raise(pst);
        return -1;
    }
    /* the buffers stay referenced but not pinned: delete() works between steps, not while a
     * plan steps (ct_py_plans_running); a step checks that none was deleted */
    for (Py_ssize_t r = 0; r < self->refs.n; r++) {
        self->refs.v[r]->busy--;
        self->refs.v[r]->plan_refs++;
    }
    self->refs_plain = 1;
    const Py_ssize_t na = PyList_GET_SIZE(arrays);
    for (Py_ssize_t i = 0; i < na; i++)
        if (!Py_IS_TYPE(PyList_GET_ITEM(arrays, i), ct_py_array_type())) {
            PyErr_Format(PyExc_TypeError, "OptimPlan: arrays[%zd] is not an Array", i);
            return -1;
        }
    const Py_ssize_t nc = PyList_GET_SIZE(counters);
    self->counters = PyMem_Calloc((size_t)(nc > 0 ? nc : 1), sizeof(Py_ssize_t));
    if (self->counters == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t c = 0; c < nc; c++) {
        Py_ssize_t ix = PyLong_AsSsize_t(PyList_GET_ITEM(counters, c));
        if (ix == -1 && PyErr_Occurred()) return -1;
        if (ix < nparams || ix >= na) {
            PyErr_SetString(PyExc_ValueError, "OptimPlan: a counter index is out of range");
            return -1;
        }
        PyObject *bl = *ct_py_array_slot(PyList_GET_ITEM(arrays, ix), CT_PY_A_BLOCKS);
        for (Py_ssize_t b = 0; bl != NULL && PyList_Check(bl) && b < PyList_GET_SIZE(bl); b++) {
            PyObject *t = array_block(PyList_GET_ITEM(arrays, ix), b);
            if (t == NULL || !is_live_buffer(PyTuple_GET_ITEM(t, 1)) ||
                ct_dtype_size(((ct_py_buffer *)PyTuple_GET_ITEM(t, 1))->dtype) != 4) {
                PyErr_SetString(PyExc_ValueError, "OptimPlan: a counter is not a live 4-byte Array");
                return -1;
            }
        }
        self->counters[c] = ix;
    }
    self->ncounters = nc;
    self->narrays = na;
    self->cur = Py_NewRef(arrays);
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire");
    PyObject *release = acquire != NULL ? PyObject_GetAttrString(lock, "release") : NULL;
    if (release == NULL || !PyCallable_Check(acquire) || !PyCallable_Check(release)) {
        Py_XDECREF(acquire);
        Py_XDECREF(release);
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "OptimPlan: the claim lock must be a lock (acquire() and "
                     "release()), got %.100s", Py_TYPE(lock)->tp_name);
        return -1;
    }
    Py_XSETREF(self->lock_acquire, acquire);
    Py_XSETREF(self->lock_release, release);
    self->claim_lock = Py_NewRef(lock);
    self->claimed = Py_NewRef(claimed);
    return 0;
}

static PyObject *donated(const char *msg) {
    PyErr_SetString(ct_py_DonatedBufferError, msg);
    return NULL;
}

static const char MSG_DONATED[] =
    "this train state's Arrays were donated: its params and optimizer state now belong to the "
    "state a previous apply_gradients returned; use that one";
static const char MSG_BUSY[] =
    "this train state is being stepped by another apply_gradients call (in another thread) or "
    "was stepped already: its params and optimizer state were donated to that step's result. "
    "Step each state once, from one thread, and use the state it returns";

/* Claim (add == 1) or release (add == 0) key in the claimed set under the lock. */
static int claim(optim_plan *self, PyObject *key, int add) {
    PyObject *r = PyObject_CallNoArgs(self->lock_acquire);
    if (r == NULL) return -1;
    Py_DECREF(r);
    int rc = 0;
    if (add) {
        rc = PySet_Contains(self->claimed, key);
        if (rc == 1) {
            donated(MSG_BUSY);
            rc = -1;
        } else if (rc == 0) {
            rc = PySet_Add(self->claimed, key);
        }
    } else {
        rc = PySet_Discard(self->claimed, key) < 0 ? -1 : 0;
    }
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    r = PyObject_CallNoArgs(self->lock_release);
    Py_XDECREF(r);
    if (et != NULL) {
        if (r == NULL) PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    return (r == NULL || rc < 0) ? -1 : 0;
}

static int set_scalars(optim_plan *self, PyObject *scalars) {
    if (!PyList_Check(scalars) || PyList_GET_SIZE(scalars) != self->nstages) {
        PyErr_Format(PyExc_ValueError, "OptimPlan.step: scalars must be a list of %d sequences",
                     self->nstages);
        return -1;
    }
    for (int k = 0; k < self->nstages; k++) {
        PyObject *f = PySequence_Fast(PyList_GET_ITEM(scalars, k), "stage scalars must be a sequence");
        if (f == NULL) return -1;
        const Py_ssize_t m = PySequence_Fast_GET_SIZE(f);
        if (m > CT_OPT_NSCALARS) {
            Py_DECREF(f);
            PyErr_Format(PyExc_ValueError, "stage %d has %zd scalars; at most %d", k, m,
                         CT_OPT_NSCALARS);
            return -1;
        }
        for (Py_ssize_t j = 0; j < CT_OPT_NSCALARS; j++) {
            double v = 0.0;
            if (j < m) {
                v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(f, j));
                if (v == -1.0 && PyErr_Occurred()) {
                    Py_DECREF(f);
                    return -1;
                }
            }
            self->st[k].s[j] = v;
        }
        Py_DECREF(f);
    }
    return 0;
}

/* The grads buffer of block k when grads leaf g_leaf[k] is placed as recorded, else NULL
 * (no exception): its device and start, byte size and dtype. */
static ct_py_buffer *grads_block(optim_plan *self, PyObject *grads, Py_ssize_t k) {
    PyObject *t = array_block(PyList_GET_ITEM(grads, self->g_leaf[k]), self->g_blk[k]);
    if (t == NULL || PyTuple_GET_ITEM(t, 0) != self->g_dev[k]) return NULL;
    PyObject *buf = PyTuple_GET_ITEM(t, 1), *start = PyTuple_GET_ITEM(t, 2);
    if (!is_live_buffer(buf)) return NULL;
    ct_py_buffer *b = (ct_py_buffer *)buf;
    if (b->nbytes != self->g_nbytes[k] || (int)b->dtype != self->g_dtype[k]) return NULL;
    if (start != self->g_start[k]) {
        int eq = PyTuple_CheckExact(start) ? PyObject_RichCompareBool(start, self->g_start[k], Py_EQ)
                                           : 0;
        if (eq != 1) {
            PyErr_Clear();
            return NULL;
        }
    }
    return b;
}

/* Whether every grads leaf is a live Array of the recorded shape and block count. */
static int grads_match(optim_plan *self, PyObject *grads) {
    PyTypeObject *at = ct_py_array_type();
    for (int i = 0; i < self->nleaves; i++) {
        PyObject *g = PyList_GET_ITEM(grads, i);
        if (!Py_IS_TYPE(g, at) || *ct_py_array_slot(g, CT_PY_A_DONATED) != Py_False) return 0;
        PyObject *shape = *ct_py_array_slot(g, CT_PY_A_SHAPE);
        if (shape != self->g_shape[i]) {
            if (shape == NULL || !PyTuple_CheckExact(shape)) return 0;
            int eq = PyObject_RichCompareBool(shape, self->g_shape[i], Py_EQ);
            if (eq != 1) {
                PyErr_Clear();
                return 0;
            }
        }
        PyObject *bl = *ct_py_array_slot(g, CT_PY_A_BLOCKS);
        if (bl == NULL || !PyList_Check(bl) || PyList_GET_SIZE(bl) != self->g_nblk[i]) return 0;
    }
    return 1;
}

/* Write value (4 bytes) into every element of each counter's buffers. */
static ct_status write_counters(optim_plan *self, PyObject *arrays, uint32_t bits) {
    float beta;
    memcpy(&beta, &bits, sizeof beta);
    for (Py_ssize_t c = 0; c < self->ncounters; c++) {
        PyObject *a = PyList_GET_ITEM(arrays, self->counters[c]);
        PyObject *bl = *ct_py_array_slot(a, CT_PY_A_BLOCKS);
        for (Py_ssize_t b = 0; b < PyList_GET_SIZE(bl); b++) {
            ct_py_buffer *buf = (ct_py_buffer *)PyTuple_GET_ITEM(PyList_GET_ITEM(bl, b), 1);
            ct_status st = ct_op_unary(buf->dev, CT_UN_AFFINE, 0.0f, beta,
                                       (int64_t)(buf->nbytes / 4), buf->data, buf->data);
            if (st != CT_OK) return st;
        }
    }
    return CT_OK;
}

static PyObject *step_core(optim_plan *self, PyObject *arrays, PyObject *grads,
                           PyObject *scalars, PyObject *count, PyObject *params);

static PyObject *plan_step(optim_plan *self, PyObject *args) {
    PyObject *arrays, *grads, *scalars, *count, *params = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!OO|O:step", &PyList_Type, &arrays, &PyList_Type, &grads,
                          &scalars, &count, &params))
        return NULL;
    return step_core(self, arrays, grads, scalars, count, params);
}

/* A new list of the leaves of tree by the plan's program, or NULL (no exception) when the
 * tree does not have that structure. */
static PyObject *prog_leaves_list(optim_plan *self, PyObject *tree) {
    const Py_ssize_t n = self->nparams;
    PyObject **tmp = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *tmp);
    if (tmp == NULL) return PyErr_NoMemory();
    Py_ssize_t i = 0;
    PyObject *out = NULL;
    if (prog_flatten(self->prog, tree, tmp, &i, n) && i == n && (out = PyList_New(n)) != NULL)
        for (Py_ssize_t j = 0; j < n; j++) PyList_SET_ITEM(out, j, Py_NewRef(tmp[j]));
    PyMem_Free(tmp);
    return out;
}

/* step_tree(arrays, grads, scalars, count, params=None): step with the grads (and params)
 * given as trees of the plan's dict structure (set_structure); returns (arrays, params tree)
 * or None (another structure: nothing done). */
static PyObject *step_tree(optim_plan *self, PyObject *arrays, PyObject *gtree,
                           PyObject *scalars, PyObject *count, PyObject *ptree);

static PyObject *plan_step_tree(optim_plan *self, PyObject *args) {
    PyObject *arrays, *gtree, *scalars, *count, *ptree = Py_None;
    if (!PyArg_ParseTuple(args, "O!OOO|O:step_tree", &PyList_Type, &arrays, &gtree, &scalars,
                          &count, &ptree))
        return NULL;
    return step_tree(self, arrays, gtree, scalars, count, ptree);
}

static PyObject *step_tree(optim_plan *self, PyObject *arrays, PyObject *gtree,
                           PyObject *scalars, PyObject *count, PyObject *ptree) {
    if (self->prog == NULL)
        return PyErr_Format(PyExc_RuntimeError, "OptimPlan.step_tree: no structure was set");
    PyObject *g = prog_leaves_list(self, gtree);
    if (g == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *p = Py_None;
    if (ptree != Py_None && (p = prog_leaves_list(self, ptree)) == NULL) {
        Py_DECREF(g);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *new = step_core(self, arrays, g, scalars, count, p);
    Py_DECREF(g);
    if (p != Py_None) Py_DECREF(p);
    if (new == NULL || new == Py_None) return new;
    Py_ssize_t i = 0;
    PyObject *tree = prog_unflatten(self->prog, new, &i);
    /* (NULL for memory only: the step is committed; its Arrays are in the plan) */
    PyObject *state = tree != NULL && self->sprog != NULL
                          ? state_fill(self->sprog, new, self->nparams) : NULL;
    PyObject *r = tree == NULL || (self->sprog != NULL && state == NULL) ? NULL
                  : state != NULL ? PyTuple_Pack(3, new, tree, state)
                                  : PyTuple_Pack(2, new, tree);
    Py_DECREF(new);
    Py_XDECREF(tree);
    Py_XDECREF(state);
    return r;
}

/* step_list(values, scalars, count): the step of a jitted program's node (TrainState.
 * apply_gradients under jit): `values` holds the state's Arrays (identical to the plan's
 * current ones, in its order) followed by the grads' leaves. Returns the new Arrays (the
 * plan's new current list) or None (another state or grads: nothing done). */
static PyObject *plan_step_list(optim_plan *self, PyObject *args) {
    PyObject *values, *scalars, *count;
    if (!PyArg_ParseTuple(args, "O!OO:step_list", &PyList_Type, &values, &scalars, &count))
        return NULL;
    if (self->cur == NULL) return PyErr_Format(PyExc_RuntimeError, "OptimPlan is not initialised");
    const Py_ssize_t na = PyList_GET_SIZE(self->cur);
    if (PyList_GET_SIZE(values) != na + self->nleaves) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < na; i++)
        if (PyList_GET_ITEM(values, i) != PyList_GET_ITEM(self->cur, i)) Py_RETURN_NONE;
    PyObject *grads = PyList_GetSlice(values, na, na + self->nleaves);
    if (grads == NULL) return NULL;
    PyObject *cur = Py_NewRef(self->cur); /* (step_core replaces self->cur) */
    PyObject *r = step_core(self, cur, grads, scalars, count, Py_None);
    Py_DECREF(cur);
    Py_DECREF(grads);
    return r;
}

static PyObject *plan_set_structure(optim_plan *self, PyObject *args) {
    PyObject *prog, *sprog = Py_None, *types = Py_None;
    if (!PyArg_ParseTuple(args, "O|OO:set_structure", &prog, &sprog, &types)) return NULL;
    if (prog_leaves(prog) != self->nparams || prog == Py_None)
        return PyErr_Format(PyExc_ValueError, "OptimPlan.set_structure: not a dict structure "
                            "of %zd leaves", self->nparams);
    if (sprog != Py_None) {
        if (self->cur == NULL)
            return PyErr_Format(PyExc_RuntimeError, "OptimPlan is not initialised");
        const Py_ssize_t n = self->narrays - self->nparams;
        if (!PyAnySet_CheckExact(types))
            return PyErr_Format(PyExc_TypeError, "OptimPlan.set_structure: the state's tuple "
                                "types must be a set or frozenset");
        char *seen = PyMem_Calloc((size_t)(n > 0 ? n : 1), 1);
        if (seen == NULL) return PyErr_NoMemory();
        const Py_ssize_t m = state_check(sprog, types, seen, n, 0);
        PyMem_Free(seen);
        if (m != n)
            return PyErr_Format(PyExc_ValueError, "OptimPlan.set_structure: the state's "
                                "template must hold each of the %zd state leaf indices once, "
                                "in dicts, tuples, None and the given tuple types", n);
    }
    Py_XSETREF(self->prog, Py_NewRef(prog));
    Py_XSETREF(self->sprog, sprog != Py_None ? Py_NewRef(sprog) : NULL);
    Py_XSETREF(self->stypes, sprog != Py_None ? Py_NewRef(types) : NULL);
    Py_RETURN_NONE;
}

static PyObject *step_core(optim_plan *self, PyObject *arrays, PyObject *grads,
                           PyObject *scalars, PyObject *count, PyObject *params) {
    if (self->cur == NULL) return PyErr_Format(PyExc_RuntimeError, "OptimPlan is not initialised");
    if (self->busy) return donated(MSG_BUSY);
    if (arrays != self->cur) { /* an earlier state: donated, or a plan it does not own */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(arrays); i++) {
            PyObject *a = PyList_GET_ITEM(arrays, i);
            if (Py_IS_TYPE(a, ct_py_array_type()) &&
                *ct_py_array_slot(a, CT_PY_A_DONATED) == Py_True)
                return donated(MSG_DONATED);
        }
        Py_RETURN_NONE;
    }
    /* every check, nothing changed yet (the list is the plan's own, but it is a Python list:
     * checked as anything else) */
    const Py_ssize_t na = PyList_GET_SIZE(arrays);
    PyTypeObject *at = ct_py_array_type();
    if (at == NULL) return NULL;
    if (na != self->narrays) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *a = PyList_GET_ITEM(arrays, i);
        if (!Py_IS_TYPE(a, at) || *ct_py_array_slot(a, CT_PY_A_DONATED) != Py_False ||
            *ct_py_array_slot(a, CT_PY_A_BASE) != Py_None)
            Py_RETURN_NONE; /* the general path raises for it */
    }
    for (Py_ssize_t c = 0; c < self->ncounters; c++) {
        PyObject *a = PyList_GET_ITEM(arrays, self->counters[c]);
        PyObject *bl = *ct_py_array_slot(a, CT_PY_A_BLOCKS);
        if (bl == NULL || !PyList_Check(bl)) Py_RETURN_NONE;
        for (Py_ssize_t b = 0; b < PyList_GET_SIZE(bl); b++) {
            PyObject *t = array_block(a, b);
            if (t == NULL || !is_live_buffer(PyTuple_GET_ITEM(t, 1)) ||
                ct_dtype_size(((ct_py_buffer *)PyTuple_GET_ITEM(t, 1))->dtype) != 4)
                Py_RETURN_NONE;
        }
    }
    if (params != Py_None) { /* params given apart from the state (t5x): these very Arrays */
        if (!PyList_Check(params) || PyList_GET_SIZE(params) != self->nparams) Py_RETURN_NONE;
        for (Py_ssize_t i = 0; i < self->nparams; i++)
            if (PyList_GET_ITEM(params, i) != PyList_GET_ITEM(arrays, i)) Py_RETURN_NONE;
    }
    if (PyList_GET_SIZE(grads) != self->nleaves || !grads_match(self, grads)) Py_RETURN_NONE;
    ct_py_buffer **gb = PyMem_Malloc((size_t)(self->nblocks > 0 ? self->nblocks : 1) * sizeof *gb);
    if (gb == NULL) return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < self->nblocks; k++)
        if ((gb[k] = grads_block(self, grads, k)) == NULL) {
            PyMem_Free(gb);
            Py_RETURN_NONE;
        }
    long long cv = PyLong_AsLongLong(count);
    if ((cv == -1 && PyErr_Occurred()) || set_scalars(self, scalars) < 0) {
        PyMem_Free(gb);
        return NULL;
    }
    if (cv < INT32_MIN || cv > INT32_MAX) {
        PyMem_Free(gb);
        return PyErr_Format(PyExc_OverflowError, "OptimPlan.step: count %lld is not an int32", cv);
    }
    /* claim: the key of the general path's _claim (its first Array's block list) */
    PyObject *key = na > 0 ? PyLong_FromVoidPtr(*ct_py_array_slot(PyList_GET_ITEM(arrays, 0),
                                                                   CT_PY_A_BLOCKS))
                           : NULL;
    if (na > 0 && (key == NULL || claim(self, key, 1) < 0)) {
        Py_XDECREF(key);
        PyMem_Free(gb);
        return NULL;
    }
    /* the plan's own buffers: referenced, and not deletable while it steps (plan_refs,
     * ct_py_plans_running); a deleted one sends the step to the general path, which raises */
    ct_py_buffer **refs = self->refs.v;
    for (Py_ssize_t r = 0; self->deletions_seen != ct_py_plan_deletions && r < self->refs.n; r++) {
        if (refs[r]->deleted) {
            PyMem_Free(gb);
            if (key != NULL) {
                if (claim(self, key, 0) < 0) PyErr_Clear();
                Py_DECREF(key);
            }
            Py_RETURN_NONE;
        }
    }
    self->deletions_seen = ct_py_plan_deletions; /* (none of its own is deleted) */
    for (Py_ssize_t k = 0; k < self->nblocks; k++) ct_py_pin(gb[k]);
    Py_ssize_t k = 0;
    for (int i = 0; i < self->ngroups; i++)
        for (int j = 0; j < self->groups[i].nblocks; j++, k++)
            self->groups[i].blocks[j].g = (const float *)gb[k]->data;
    self->busy = 1;
    ct_py_plans_running++;
    ct_status cs;
    Py_INCREF(self);
    Py_BEGIN_ALLOW_THREADS
    cs = ct_optim_run(self->prep, self->st, self->nstages);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    ct_py_plans_running--;
    for (Py_ssize_t b = 0; b < self->nblocks; b++) ct_py_unpin(gb[b]);
    for (int i = 0; i < self->ngroups; i++)
        for (int j = 0; j < self->groups[i].nblocks; j++) self->groups[i].blocks[j].g = NULL;
    PyMem_Free(gb);
    PyObject *out = NULL;
    if (cs != CT_OK) {
        ct_py_raise(cs);
        goto done;
    }
    /* commit: the counters, then the Arrays handed on (cannot fail but for memory) */
    uint32_t bits = (uint32_t)(int32_t)cv;
    cs = write_counters(self, arrays, bits);
    if (cs != CT_OK) {
        ct_py_raise(cs);
        goto done;
    }
    Py_ssize_t bad;
    out = ct_py_move_arrays(&PyList_GET_ITEM(arrays, 0), na, &bad);
    if (out == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "OptimPlan.step: Array %zd could not be moved", bad);
        goto done;
    }
    for (Py_ssize_t c = 0; c < self->ncounters; c++) {
        PyObject **hs = ct_py_array_slot(PyList_GET_ITEM(out, self->counters[c]),
                                         CT_PY_A_HOST_SCALAR);
        Py_XSETREF(*hs, Py_NewRef(count));
    }
    Py_SETREF(self->cur, Py_NewRef(out));
done:
    if (key != NULL) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (claim(self, key, 0) < 0) { /* (only a failing lock: the step stays committed) */
            PyErr_Clear();
        }
        if (et != NULL) PyErr_Restore(et, ev, tb);
        Py_DECREF(key);
    }
    Py_DECREF(self);
    return out;
}

static PyObject *plan_get_arrays(optim_plan *self, void *closure) {
    (void)closure;
    if (self->cur == NULL) Py_RETURN_NONE;
    return Py_NewRef(self->cur);
}

static PyObject *plan_get_nblocks(optim_plan *self, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(self->nblocks);
}

static PyMethodDef plan_methods[] = {
    {"step_tree", (PyCFunction)plan_step_tree, METH_VARARGS,
     "step_tree(arrays, grads, scalars, count, params=None, /)\n--\n\n"
     "step() with the grads (and params) as trees of the structure set_structure gave;\n"
     "returns (arrays, params tree), (arrays, params tree, state tree) where a state\n"
     "template was set, or None when a tree has another structure."},
    {"step_list", (PyCFunction)plan_step_list, METH_VARARGS,
     "step_list($self, values, scalars, count, /)\n--\n\nA step of the state whose Arrays "
     "(this plan's current ones) lead `values`, followed by the grads' leaves: the new Arrays, "
     "or None (nothing done)."},
    {"set_structure", (PyCFunction)plan_set_structure, METH_VARARGS,
     "set_structure(program, state=None, types=None, /)\n--\n\n"
     "The params' structure when it is plain dicts: None for a leaf, else a tuple of\n"
     "(key, program) pairs in the params' (sorted) key order. state: the optimizer state's\n"
     "template (its tree, each leaf replaced by its index among the state's Arrays; nodes:\n"
     "dicts, tuples, None and the tuple subclasses in the set `types`, built by\n"
     "tuple.__new__), or None; with it step_tree also returns the state tree."},
    {"step", (PyCFunction)plan_step, METH_VARARGS,
     "step(arrays, grads, scalars, count, params=None, /)\n--\n\n"
     "One in-place step. arrays: the list the plan returned last (another list: its Arrays\n"
     "were donated, DonatedBufferError); grads: the grads' leaves in the params' order;\n"
     "scalars: one sequence per stage; count: the counters' new value (a numpy int32);\n"
     "params: the params' leaves when given apart from the state (they must be arrays').\n"
     "Returns the new Arrays (the given ones are donated), or None when the grads or the\n"
     "state are not as the plan recorded (nothing changed: take the general path)."},
    {NULL, NULL, 0, NULL},
};

static PyObject *plan_get_has_state_template(optim_plan *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->sprog != NULL);
}

static PyGetSetDef plan_getset[] = {
    {"arrays", (getter)plan_get_arrays, NULL, "the Arrays of the latest step", NULL},
    {"has_state_template", (getter)plan_get_has_state_template, NULL,
     "whether set_structure gave a state template (step_tree then builds the state tree)",
     NULL},
    {"nblocks", (getter)plan_get_nblocks, NULL, "blocks of the kernel (all devices)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject OptimPlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ctrainstate._C.OptimPlan",
    .tp_basicsize = sizeof(optim_plan),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "OptimPlan(stages, groups, order, nleaves, grads, arrays, nparams, counters, "
              "lock, claimed)\n--\n\nA persistent in-place fused optimizer step (see "
              "csrc/python/py_optim_plan.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)plan_init,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_traverse = (traverseproc)plan_traverse,
    .tp_clear = (inquiry)plan_tp_clear,
    .tp_methods = plan_methods,
    .tp_getset = plan_getset,
    .tp_weaklistoffset = offsetof(optim_plan, weakreflist),
};

/* --- TrainState.apply_gradients' plan step in one call ---------------------------------------
 * state_step(state, d, fast, grads, kwargs): train_state.TrainState._fast_step (the state's
 * copy with the stepped fields and the fields `kwargs`, a dict, replaces) with
 * optim.base.FastPlan.step's branch for params of plain dicts whose plan builds the state
 * tree (`fast.dicts`, a state template set), in C: only the stages' scalar functions (Python)
 * are called. `d` is the state's __dict__; the caller checked that the plan is the state's
 * and the names in `kwargs` (fields, none of step, params, opt_state). Returns the new state,
 * None where the plan declines (nothing changed: the general path runs), or NULL with an
 * exception. The Python methods stay the reference.
 *
 * Ctrl-C needs no handler of its own here (the Python paths swap SIGINT's handler, two
 * sigaction calls per step, which cost more than a small model's whole step on some
 * kernels): CPython's C-level handler only records a signal, and its Python handler runs
 * where bytecode runs or PyErr_CheckSignals is called. A Ctrl-C during the scalar functions
 * is raised there, before anything is written; one after them is raised by the check just
 * before the kernel, with nothing written either. From that check to the commit only C code
 * runs (the cycle collector is paused, so no finalizer runs Python code in between), and a
 * Ctrl-C in that window is raised by the check after the commit, once this state object has
 * become the new state (train_state._adopt), as the Python paths' guard does. */
enum { SS_ADOPT, SS_EPOCH, SS_INT32, SS_N };
static PyObject *ss_env[SS_N];
/* state_step_probe's callable (tests): called with no argument between the kernel and the
 * commit's check, where only C code runs (a C callable keeps it so) */
static PyObject *ss_probe;

static PyObject *py_state_step_probe(PyObject *mod, PyObject *f) {
    (void)mod;
    if (f != Py_None && !PyCallable_Check(f))
        return PyErr_Format(PyExc_TypeError, "state_step_probe(f): f must be callable or None");
    Py_XSETREF(ss_probe, f == Py_None ? NULL : Py_NewRef(f));
    Py_RETURN_NONE;
}
#define SS_NAMES(X) X(epoch) X(count) X(scalars) X(cplan) X(_ct_cur) X(params) X(opt_state) \
    X(step)
#define SS_ENUM(n) SS_S_##n,
enum { SS_NAMES(SS_ENUM) SS_S_COUNT };
#define SS_STR(n) #n,
static const char *const ss_name_text[SS_S_COUNT] = {SS_NAMES(SS_STR)};
static PyObject *ss_str[SS_S_COUNT];
static PyObject *ss_one;   /* the int 1 */
#define SSS(n) ss_str[SS_S_##n]

static PyObject *py_state_step_setup(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *env[SS_N];
    if (!PyArg_ParseTuple(args, "OO!O:state_step_setup", &env[SS_ADOPT], &PyList_Type,
                          &env[SS_EPOCH], &env[SS_INT32]))
        return NULL;
    for (int i = 0; i < SS_N; i++)
        if (i != SS_EPOCH && !PyCallable_Check(env[i]))
            return PyErr_Format(PyExc_TypeError, "state_step_setup: argument %d is not callable",
                                i + 1);
    for (int i = 0; i < SS_S_COUNT; i++)
        if (ss_str[i] == NULL && (ss_str[i] = PyUnicode_InternFromString(ss_name_text[i])) == NULL)
            return NULL;
    if (ss_one == NULL && (ss_one = PyLong_FromLong(1)) == NULL) return NULL;
    for (int i = 0; i < SS_N; i++) Py_XSETREF(ss_env[i], Py_NewRef(env[i]));
    Py_RETURN_NONE;
}

/* FastPlan.step's plain-dict branch: (arrays, params, opt_state) from the plan, None where it
 * declines, NULL with an exception. */
static PyObject *ss_plan_step(PyObject *fast, PyObject *arrays, PyObject *grads) {
    PyObject *epoch = PyObject_GetAttr(fast, SSS(epoch));
    if (epoch == NULL) return NULL;
    PyObject *now = PyList_GET_SIZE(ss_env[SS_EPOCH]) > 0 ? PyList_GET_ITEM(ss_env[SS_EPOCH], 0)
                                                         : Py_None;
    int same = PyObject_RichCompareBool(epoch, now, Py_EQ);
    Py_DECREF(epoch);
    if (same <= 0) return same < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *c = PyObject_GetAttr(fast, SSS(count));
    PyObject *pairs = c != NULL ? PyObject_GetAttr(fast, SSS(scalars)) : NULL;
    PyObject *plan = pairs != NULL ? PyObject_GetAttr(fast, SSS(cplan)) : NULL;
    PyObject *scalars = NULL, *count = NULL, *r = NULL, *next = NULL;
    if (plan == NULL) goto out;
    if (!PyObject_TypeCheck(plan, &OptimPlanType) || !PyList_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError, "state_step: not a FastPlan");
        goto out;
    }
    if (c != Py_None) {   /* c < _INT32_MAX - 1, else the Python path decides (it declines) */
        int overflow = 0;
        const long long cv = PyLong_Check(c) ? PyLong_AsLongLongAndOverflow(c, &overflow) : -1;
        if (cv == -1 && PyErr_Occurred()) goto out;
        if (!PyLong_Check(c) || overflow || cv >= 2147483647LL - 1) {
            r = Py_NewRef(Py_None);
            goto out;
        }
    }
    const Py_ssize_t n = PyList_GET_SIZE(pairs);
    scalars = PyList_New(n);
    for (Py_ssize_t i = 0; scalars != NULL && i < n; i++) {   /* s if f is None else f(c) */
        PyObject *sf = PyList_GET_ITEM(pairs, i);
        if (!PyTuple_Check(sf) || PyTuple_GET_SIZE(sf) != 2) {
            PyErr_SetString(PyExc_TypeError, "state_step: FastPlan.scalars holds (s, f) pairs");
            Py_CLEAR(scalars);
            break;
        }
        PyObject *f = PyTuple_GET_ITEM(sf, 1);
        PyObject *v = f == Py_None || c == Py_None ? Py_NewRef(PyTuple_GET_ITEM(sf, 0))
                                                   : PyObject_CallOneArg(f, c);
        if (v == NULL) Py_CLEAR(scalars);
        else PyList_SET_ITEM(scalars, i, v);
    }
    if (scalars == NULL) goto out;
    if (c == Py_None) {
        count = PyLong_FromLong(0);
    } else {
        next = PyNumber_Add(c, ss_one);
        count = next != NULL ? PyObject_CallOneArg(ss_env[SS_INT32], next) : NULL;
    }
    if (count == NULL) goto out;
    /* a Ctrl-C recorded since the scalar functions ran: raised now, before the kernel */
    if (PyErr_CheckSignals() < 0) goto out;
    r = step_tree((optim_plan *)plan, arrays, grads, scalars, count, Py_None);
    if (r == NULL || r == Py_None) goto out;
    if (c != Py_None && PyObject_SetAttr(fast, SSS(count), next) < 0) Py_CLEAR(r);
    if (r != NULL && PyTuple_GET_SIZE(r) != 3) {   /* (no state template: set_structure's) */
        PyErr_SetString(PyExc_RuntimeError, "state_step: the plan has no state template");
        Py_CLEAR(r);
    }
out:
    Py_XDECREF(c);
    Py_XDECREF(pairs);
    Py_XDECREF(plan);
    Py_XDECREF(scalars);
    Py_XDECREF(count);
    Py_XDECREF(next);
    return r;
}

/* The new state: a copy of `state` (object.__new__ of its class, its __dict__ d copied) with
 * _ct_cur, params, opt_state from r, step + 1 and the fields of `kwargs`. */
static PyObject *ss_new_state(PyObject *state, PyObject *d, PyObject *r, PyObject *kwargs) {
    PyObject *empty = PyTuple_New(0);
    PyObject *new = empty != NULL ? PyBaseObject_Type.tp_new(Py_TYPE(state), empty, NULL) : NULL;
    Py_XDECREF(empty);
    PyObject *nd = new != NULL ? PyDict_New() : NULL;
    PyObject *step = nd != NULL ? PyObject_GetAttr(state, SSS(step)) : NULL;
    PyObject *next = step != NULL ? PyNumber_Add(step, ss_one) : NULL;
    int rc = next == NULL || PyDict_Update(nd, d) < 0 ||
             PyDict_SetItem(nd, SSS(_ct_cur), PyTuple_GET_ITEM(r, 0)) < 0 ||
             PyDict_SetItem(nd, SSS(params), PyTuple_GET_ITEM(r, 1)) < 0 ||
             PyDict_SetItem(nd, SSS(opt_state), PyTuple_GET_ITEM(r, 2)) < 0 ||
             PyDict_SetItem(nd, SSS(step), next) < 0 ||
             (PyDict_GET_SIZE(kwargs) > 0 && PyDict_Update(nd, kwargs) < 0) ||
             PyObject_GenericSetDict(new, nd, NULL) < 0;
    Py_XDECREF(nd);
    Py_XDECREF(step);
    Py_XDECREF(next);
    if (rc) Py_CLEAR(new);
    return new;
}

static PyObject *py_state_step(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    (void)mod;
    if (n != 5 || !PyDict_Check(a[1]) || !PyDict_CheckExact(a[4]))
        return PyErr_Format(PyExc_TypeError, "state_step(state, d: its __dict__, fast, grads, "
                            "kwargs: a dict)");
    if (ss_env[SS_ADOPT] == NULL)
        return PyErr_Format(PyExc_RuntimeError, "state_step_setup first");
    PyObject *state = a[0], *d = a[1], *fast = a[2], *grads = a[3], *kwargs = a[4];
    PyObject *cur = PyDict_GetItemWithError(d, SSS(_ct_cur));
    if (cur == NULL && PyErr_Occurred()) return NULL;
    if (cur == NULL || !PyList_CheckExact(cur))
        return PyErr_Format(PyExc_TypeError, "state_step: d must be the __dict__ of a state "
                            "a plan step made (its _ct_cur a list)");
    Py_INCREF(cur);
    PyObject *new = NULL;
    const int gc_on = PyGC_Disable();   /* (see the header: until the commit's check) */
    PyObject *r = ss_plan_step(fast, cur, grads);
    if (r != NULL && r != Py_None && ss_probe != NULL) {
        PyObject *x = PyObject_CallNoArgs(ss_probe);
        if (x == NULL) PyErr_WriteUnraisable(ss_probe);
        Py_XDECREF(x);
    }
    if (r != NULL && r != Py_None) new = ss_new_state(state, d, r, kwargs);
    if (r != NULL && r != Py_None && new != NULL && PyErr_CheckSignals() < 0) {
        /* a Ctrl-C during the step, raised once it is committed: this state object, whose
         * Arrays the step donated, becomes the new state first */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *ad[2] = {state, new};
        PyObject *x = PyObject_Vectorcall(ss_env[SS_ADOPT], ad, 2, NULL);
        Py_XDECREF(x);
        if (x == NULL) _PyErr_ChainExceptions(et, ev, tb);
        else PyErr_Restore(et, ev, tb);
        Py_CLEAR(new);
    }
    if (gc_on) PyGC_Enable();
    Py_DECREF(cur);
    if (r == Py_None) return r;   /* the plan declined: nothing changed */
    Py_XDECREF(r);
    return new;
}

static PyMethodDef state_step_methods[] = {
    {"state_step_setup", py_state_step_setup, METH_VARARGS,
     "state_step_setup(adopt, borrow_epoch, int32, /)\n--\n\n"
     "The objects state_step reads (set once by train_state)."},
    {"state_step_probe", py_state_step_probe, METH_O,
     "state_step_probe(f, /)\n--\n\n"
     "For tests: state_step calls f() after its kernel, where only C code runs up to the "
     "commit (None: no call)."},
    {"state_step", (PyCFunction)(void (*)(void))py_state_step, METH_FASTCALL,
     "state_step(state, d, fast, grads, kwargs, /)\n--\n\n"
     "TrainState._fast_step with FastPlan.step's plain-dict branch in one call: the new state, "
     "or None where the plan declines (nothing changed)."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_optim_plan(PyObject *m) {
    if (PyType_Ready(&OptimPlanType) < 0) return -1;
    if (PyModule_AddFunctions(m, state_step_methods) < 0) return -1;
    return PyModule_AddObjectRef(m, "OptimPlan", (PyObject *)&OptimPlanType);
}
