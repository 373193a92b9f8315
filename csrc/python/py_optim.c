/*
 * py_optim.c — ctrainstate._C.optim_step / optim_reference: one fused
 * optimizer step over the blocks of every device.
 *
 * The Python layer (ctrainstate.optim) compiles a transform chain into stage
 * tuples and lists every device's blocks; this file converts them once per
 * call into the core's ct_opt_stage / ct_opt_group arrays, pins the buffers
 * (a pinned buffer refuses delete()), releases the GIL and runs
 * ct_optim_step. Over params that span processes (`procs`) it runs
 * ct_optim_step_procs, whose exchanges go through the MPI engine (ct_dist):
 * waiting at most the timeout, stopped by Ctrl-C. No math here.
 */
#include "ct_py.h"

#include <string.h>

#include "py_optim.h"

#include <math.h>

#include "../process/ct_dist.h"

int ct_py_optim_parse_stages(PyObject *seq, ct_opt_stage *st, int *nst) {
    PyObject *fast = PySequence_Fast(seq, "stages must be a sequence");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > CT_OPT_MAX_STAGES) {
        PyErr_Format(PyExc_ValueError, "optimizer has %zd stages; at most %d are supported", n,
                     CT_OPT_MAX_STAGES);
        goto fail;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, k), *scal;
        int kind;
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError, "stage %zd must be a (kind, scalars) tuple, got %.100s",
                         k, Py_TYPE(item)->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(item, "iO:stage", &kind, &scal)) goto fail;
        memset(&st[k], 0, sizeof st[k]);
        st[k].kind = kind;
        PyObject *sf = PySequence_Fast(scal, "stage scalars must be a sequence");
        if (sf == NULL) goto fail;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(sf);
        if (m > CT_OPT_NSCALARS) {
            Py_DECREF(sf);
            PyErr_Format(PyExc_ValueError, "stage %zd has %zd scalars; at most %d", k, m, CT_OPT_NSCALARS);
            goto fail;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            st[k].s[j] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(sf, j));
            if (st[k].s[j] == -1.0 && PyErr_Occurred()) {
                Py_DECREF(sf);
                goto fail;
            }
        }
        Py_DECREF(sf);
    }
    *nst = (int)n;
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}

int ct_py_pin_add(ct_py_pin_list *pl, ct_py_buffer *b) {
    if (pl->n == pl->cap) {
        Py_ssize_t cap = pl->cap ? 2 * pl->cap : 64;
        ct_py_buffer **v = PyMem_Realloc(pl->v, (size_t)cap * sizeof *v);
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        pl->v = v;
        pl->cap = cap;
    }
    pl->v[pl->n++] = b;
    ct_py_pin(b);
    return 0;
}

void ct_py_pin_release(ct_py_pin_list *pl) {
    for (Py_ssize_t i = 0; i < pl->n; i++) ct_py_unpin(pl->v[i]);
    PyMem_Free(pl->v);
    pl->v = NULL;
    pl->n = pl->cap = 0;
}

/* A float32, bfloat16 or float16 buffer of n elements (n < 0: any, returned), or NULL
 * with an exception; *dt: its dtype. *dev: the device of the group so far (NULL: none
 * yet); a buffer on another GPU device than the group's is refused, and GPU buffers only
 * where allowed (*dev is NULL for the reference, which reads host memory). */
static void *float_buffer(PyObject *obj, int64_t *n, const char *what, ct_py_pin_list *pl,
                          ct_device **dev, uint8_t *dt) {
    ct_py_buffer *b = ct_py_buffer_check(obj, what);
    if (b == NULL) return NULL;
    if (b->dtype != CT_F32 && b->dtype != CT_BF16 && b->dtype != CT_F16) {
        PyErr_Format(PyExc_TypeError, "%s must be float32, bfloat16 or float16, got %s", what,
                     ct_dtype_name(b->dtype));
        return NULL;
    }
    if (b->dev->platform != CT_PLATFORM_CPU) {
        if (dev == NULL) {
            PyErr_Format(PyExc_ValueError, "%s: the optimizer reference runs on CPU buffers only", what);
            return NULL;
        }
    }
    if (dev != NULL) {
        if (*dev == NULL) {
            *dev = b->dev;
        } else if (*dev != b->dev && (b->dev->platform != CT_PLATFORM_CPU ||
                                      (*dev)->platform != CT_PLATFORM_CPU)) {
            char a[64], c[64];
            ct_device_name(b->dev, a, sizeof a);
            ct_device_name(*dev, c, sizeof c);
            PyErr_Format(PyExc_ValueError, "%s is on %s, but its device group is on %s", what, a, c);
            return NULL;
        }
    }
    int64_t m = (int64_t)(b->nbytes / ct_dtype_size(b->dtype));
    if (*n >= 0 && m != *n) {
        PyErr_Format(PyExc_ValueError, "%s has %lld elements, expected %lld", what, (long long)m,
                     (long long)*n);
        return NULL;
    }
    *n = m;
    if (ct_py_pin_add(pl, b) < 0) return NULL;
    *dt = (uint8_t)b->dtype;
    return b->data;
}

static int parse_dims(PyObject *seq, int64_t *out, int ndim, const char *what) {
    PyObject *f = PySequence_Fast(seq, "factored geometry: shapes must be sequences");
    if (f == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(f) != ndim) {
        PyErr_Format(PyExc_ValueError, "factored geometry: %s has %zd dims, expected %d", what,
                     PySequence_Fast_GET_SIZE(f), ndim);
        Py_DECREF(f);
        return -1;
    }
    for (int d = 0; d < ndim; d++) {
        out[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(f, d));
        if (out[d] == -1 && PyErr_Occurred()) {
            Py_DECREF(f);
            return -1;
        }
    }
    Py_DECREF(f);
    return 0;
}

/* geometry tuple: (d0, d1, shape, start, block_shape), or None */
static int parse_geom(PyObject *t, ct_opt_geom *g) {
    memset(g, 0, sizeof *g);
    if (t == Py_None) return 0;
    int d0, d1;
    PyObject *shape, *start, *bshape;
    if (!PyTuple_Check(t)) {
        PyErr_Format(PyExc_TypeError,
                     "factored geometry must be None or a (d0, d1, shape, start, block_shape) "
                     "tuple, got %.100s", Py_TYPE(t)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(t, "iiOOO:factored geometry", &d0, &d1, &shape, &start, &bshape))
        return -1;
    Py_ssize_t nd = PyObject_Length(shape);
    if (nd < 0) return -1;
    if (nd < 2 || nd > CT_OPT_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "factored geometry: rank %zd (2 to %d supported)", nd,
                     CT_OPT_MAX_DIMS);
        return -1;
    }
    g->ndim = (int)nd;
    g->d0 = d0;
    g->d1 = d1;
    if (parse_dims(shape, g->shape, g->ndim, "shape") < 0 ||
        parse_dims(start, g->start, g->ndim, "start") < 0 ||
        parse_dims(bshape, g->bshape, g->ndim, "block shape") < 0)
        return -1;
    return 0;
}

/* block tuple: (p, g, out, slots, active, leaf, counts[, geom]) */
int ct_py_optim_parse_block(PyObject *t, PyObject *g_override, ct_opt_block *b, int nslots,
                            ct_py_pin_list *pl, ct_device **dev) {
    PyObject *p, *g, *out, *slots, *geom = Py_None;
    uint32_t active;
    int leaf, counts;
    if (!PyTuple_Check(t)) {
        PyErr_Format(PyExc_TypeError,
                     "an optimizer block must be a (params, grads, updates, slots, active, leaf, "
                     "counts[, geometry]) tuple, got %.100s", Py_TYPE(t)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(t, "OOOOO&ip|O:block", &p, &g, &out, &slots, ct_py_conv_u32, &active,
                          &leaf, &counts, &geom))
        return -1;
    memset(b, 0, sizeof *b);
    int64_t n = -1;
    if (g_override != NULL) g = g_override;
    if ((b->g = float_buffer(g, &n, "grads block", pl, dev, &b->g_dt)) == NULL) return -1;
    if (p != Py_None && (b->p = float_buffer(p, &n, "params block", pl, dev, &b->p_dt)) == NULL)
        return -1;
    if (out != Py_None &&
        (b->out = float_buffer(out, &n, "updates block", pl, dev, &b->out_dt)) == NULL)
        return -1;
    if (parse_geom(geom, &b->geom) < 0) return -1;
    PyObject *sf = PySequence_Fast(slots, "block slots must be a sequence");
    if (sf == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(sf) != nslots) {
        PyErr_Format(PyExc_ValueError, "block has %zd state arrays, the stages need %d",
                     PySequence_Fast_GET_SIZE(sf), nslots);
        Py_DECREF(sf);
        return -1;
    }
    for (int q = 0; q < nslots; q++) {
        PyObject *s = PySequence_Fast_GET_ITEM(sf, q);
        if (s == Py_None) continue;
        int64_t m = -1; /* sizes are checked by the core (factored statistics differ) */
        if ((b->slot[q] = float_buffer(s, &m, "optimizer state block", pl, dev, &b->slot_dt[q])) ==
            NULL) {
            Py_DECREF(sf);
            return -1;
        }
        b->slot_n[q] = m;
    }
    Py_DECREF(sf);
    b->n = n;
    b->active = active;
    b->leaf = leaf;
    b->counts = counts;
    return 0;
}

/* Another process's block (a step across processes): (n, active, leaf, counts[, geom]), no
 * buffers. */
static int parse_remote_block(PyObject *t, ct_opt_block *b) {
    PyObject *geom = Py_None;
    long long n;
    uint32_t active;
    int leaf, counts;
    if (!PyTuple_Check(t)) {
        PyErr_Format(PyExc_TypeError, "another process's optimizer block must be an (n, active, "
                     "leaf, counts[, geometry]) tuple, got %.100s", Py_TYPE(t)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(t, "LO&ip|O:remote block", &n, ct_py_conv_u32, &active, &leaf, &counts,
                          &geom))
        return -1;
    memset(b, 0, sizeof *b);
    if (parse_geom(geom, &b->geom) < 0) return -1;
    b->n = (int64_t)n;
    b->active = active;
    b->leaf = leaf;
    b->counts = counts;
    b->g_dt = b->p_dt = b->out_dt = CT_F32;
    return 0;
}

/* ---- exchanges of a step across processes (ct_opt_procs), through the MPI engine ----- */

typedef struct {
    PyThreadState *ts; /* the step's thread, its GIL released */
    double timeout;
} xchg_ctx;

static int xchg_poll(void *p) { /* Ctrl-C stops a waiting exchange */
    xchg_ctx *c = p;
    PyEval_RestoreThread(c->ts);
    int stop = PyErr_CheckSignals() < 0; /* the handler's exception stays set */
    c->ts = PyEval_SaveThread();
    return stop;
}

static ct_status xchg_allgather(void *ctx, const double *send, double *recv, size_t n) {
    xchg_ctx *c = ctx;
    const int np = ct_dist_size();
    if (np < 1)
        return ct_set_error(CT_EINVAL, "optimizer: a step across processes needs "
                            "ctrainstate.distributed.initialize()");
    /* buffers of the engine's own: after a failed collective MPI may still write them, so
     * they are then never freed */
    double *s = malloc(n * sizeof *s), *r = malloc((size_t)np * n * sizeof *r);
    if (s == NULL || r == NULL) {
        free(s);
        free(r);
        return ct_set_error(CT_EOOM, "optimizer: out of host memory for an exchange");
    }
    memcpy(s, send, n * sizeof *s);
    ct_status st = ct_dist_allgather(s, r, n, sizeof(double), c->timeout, xchg_poll, c);
    if (st != CT_OK && ct_dist_failure() != CT_DIST_FAIL_NONE) return st; /* s, r kept */
    if (st == CT_OK) memcpy(recv, r, (size_t)np * n * sizeof *r);
    free(s);
    free(r);
    return st;
}

/* procs: None, or (rank, nproc, [process of each group], timeout). */
static int parse_procs(PyObject *obj, Py_ssize_t ng, ct_opt_procs *pr, int **gp, xchg_ctx *xc) {
    PyObject *lst;
    *gp = NULL;
    if (!PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "procs must be None or a (rank, nproc, group_procs, "
                     "timeout) tuple, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    memset(pr, 0, sizeof *pr);
    if (!PyArg_ParseTuple(obj, "iiOd:procs", &pr->rank, &pr->nproc, &lst, &xc->timeout)) return -1;
    if (pr->nproc < 1 || pr->rank < 0 || pr->rank >= pr->nproc) {
        PyErr_Format(PyExc_ValueError, "procs: process %d of %d", pr->rank, pr->nproc);
        return -1;
    }
    if (!(xc->timeout > 0)) {
        PyErr_Format(PyExc_ValueError, "procs: timeout must be positive, got %g", xc->timeout);
        return -1;
    }
    PyObject *f = PySequence_Fast(lst, "procs: group_procs must be a sequence");
    if (f == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(f) != ng) {
        PyErr_Format(PyExc_ValueError, "procs: %zd group processes for %zd groups",
                     PySequence_Fast_GET_SIZE(f), ng);
        Py_DECREF(f);
        return -1;
    }
    *gp = PyMem_Calloc((size_t)(ng > 0 ? ng : 1), sizeof **gp);
    if (*gp == NULL) {
        Py_DECREF(f);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < ng; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(f, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(f);
            return -1;
        }
        if (v < 0 || v >= pr->nproc) {
            PyErr_Format(PyExc_ValueError, "procs: group %zd on process %ld of %d", i, v, pr->nproc);
            Py_DECREF(f);
            return -1;
        }
        (*gp)[i] = (int)v;
    }
    Py_DECREF(f);
    pr->group_proc = *gp;
    pr->allgather = xchg_allgather;
    pr->ctx = xc;
    return 0;
}

static void free_groups(ct_opt_group *gr, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyMem_Free(gr[i].blocks);
    PyMem_Free(gr);
}

static PyObject *py_optim_step(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *stages_obj, *groups_obj, *grads_obj = Py_None, *procs_obj = Py_None;
    int nleaves;
    if (!PyArg_ParseTuple(args, "OOi|OO:optim_step", &stages_obj, &groups_obj, &nleaves,
                          &grads_obj, &procs_obj))
        return NULL;
    ct_opt_stage st[CT_OPT_MAX_STAGES];
    int nst = 0;
    if (ct_py_optim_parse_stages(stages_obj, st, &nst) < 0) return NULL;
    ct_status cs = ct_optim_check(st, nst);
    if (cs != CT_OK) return ct_py_raise(cs);
    int nslots = 0;
    for (int k = 0; k < nst; k++) nslots += ct_opt_kind_nslots(st[k].kind);

    PyObject *gf = PySequence_Fast(groups_obj, "groups must be a sequence");
    if (gf == NULL) return NULL;
    Py_ssize_t ng = PySequence_Fast_GET_SIZE(gf);
    ct_opt_group *gr = PyMem_Calloc((size_t)(ng > 0 ? ng : 1), sizeof *gr);
    ct_py_pin_list pl = {0};
    PyObject *result = NULL, *gdf = NULL;
    ct_opt_procs procs, *pr = NULL;
    xchg_ctx xc = {NULL, 0.0};
    int *gproc = NULL;
    if (gr == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (procs_obj != Py_None) {
        if (parse_procs(procs_obj, ng, &procs, &gproc, &xc) < 0) goto done;
        pr = &procs;
    }
    if (grads_obj != Py_None) {
        gdf = PySequence_Fast(grads_obj, "grads must be a sequence (one per group)");
        if (gdf == NULL) goto done;
        if (PySequence_Fast_GET_SIZE(gdf) != ng) {
            PyErr_Format(PyExc_ValueError, "grads has %zd groups, expected %zd",
                         PySequence_Fast_GET_SIZE(gdf), ng);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < ng; i++) {
        PyObject *bf = PySequence_Fast(PySequence_Fast_GET_ITEM(gf, i), "a group must be a sequence");
        if (bf == NULL) goto done;
        Py_ssize_t nb = PySequence_Fast_GET_SIZE(bf);
        PyObject *ggf = NULL; /* this group's grads, one per block */
        const int remote = pr != NULL && gproc[i] != pr->rank;
        if (gdf != NULL && !remote) {
            ggf = PySequence_Fast(PySequence_Fast_GET_ITEM(gdf, i), "grads of a group must be a sequence");
            if (ggf == NULL) {
                Py_DECREF(bf);
                goto done;
            }
            if (PySequence_Fast_GET_SIZE(ggf) != nb) {
                PyErr_Format(PyExc_ValueError, "grads of group %zd has %zd blocks, expected %zd", i,
                             PySequence_Fast_GET_SIZE(ggf), nb);
                Py_DECREF(ggf);
                Py_DECREF(bf);
                goto done;
            }
        }
        gr[i].blocks = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(ct_opt_block));
        gr[i].nblocks = (int)nb;
        if (gr[i].blocks == NULL) {
            Py_XDECREF(ggf);
            Py_DECREF(bf);
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t j = 0; j < nb; j++) {
            if (remote) {
                if (parse_remote_block(PySequence_Fast_GET_ITEM(bf, j), &gr[i].blocks[j]) < 0) {
                    Py_DECREF(bf);
                    goto done;
                }
                continue;
            }
            if (ct_py_optim_parse_block(PySequence_Fast_GET_ITEM(bf, j),
                            ggf != NULL ? PySequence_Fast_GET_ITEM(ggf, j) : NULL,
                            &gr[i].blocks[j], nslots, &pl, &gr[i].dev) < 0) {
                Py_XDECREF(ggf);
                Py_DECREF(bf);
                goto done;
            }
        }
        Py_XDECREF(ggf);
        Py_DECREF(bf);
    }
    if (pr == NULL) {
        Py_BEGIN_ALLOW_THREADS
        cs = ct_optim_step(st, nst, gr, (int)ng, nleaves);
        Py_END_ALLOW_THREADS
    } else {
        const ct_dist_failure_kind before = ct_dist_failure();
        xc.ts = PyEval_SaveThread();
        cs = ct_optim_step_procs(st, nst, gr, (int)ng, nleaves, pr);
        PyEval_RestoreThread(xc.ts);
        const ct_dist_failure_kind now = ct_dist_failure();
        if (cs != CT_OK && before == CT_DIST_FAIL_NONE && now != CT_DIST_FAIL_NONE) {
            if (now == CT_DIST_FAIL_INTERRUPTED && PyErr_Occurred()) { /* Ctrl-C's exception */
                ct_clear_error();
                goto done;
            }
            if (now == CT_DIST_FAIL_TIMEOUT) {
                PyErr_SetString(PyExc_TimeoutError, ct_last_error());
                ct_clear_error();
                goto done;
            }
        }
    }
    if (cs != CT_OK) {
        ct_py_raise(cs);
        goto done;
    }
    result = PyList_New(nst);
    if (result == NULL) goto done;
    for (int k = 0; k < nst; k++) {
        PyObject *v = PyFloat_FromDouble(st[k].result);
        if (v == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, v);
    }
done:
    ct_py_pin_release(&pl);
    PyMem_Free(gproc);
    if (gr != NULL) free_groups(gr, ng);
    Py_XDECREF(gdf);
    Py_DECREF(gf);
    return result;
}

static PyObject *py_optim_reference(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *stages_obj, *block_obj;
    if (!PyArg_ParseTuple(args, "OO:optim_reference", &stages_obj, &block_obj)) return NULL;
    ct_opt_stage st[CT_OPT_MAX_STAGES];
    int nst = 0;
    if (ct_py_optim_parse_stages(stages_obj, st, &nst) < 0) return NULL;
    ct_status cs = ct_optim_check(st, nst);
    if (cs != CT_OK) return ct_py_raise(cs);
    int nslots = 0;
    for (int k = 0; k < nst; k++) nslots += ct_opt_kind_nslots(st[k].kind);
    ct_py_pin_list pl = {0};
    ct_opt_block b;
    if (ct_py_optim_parse_block(block_obj, NULL, &b, nslots, &pl, NULL) < 0) {
        ct_py_pin_release(&pl);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    cs = ct_optim_reference(st, nst, &b);
    Py_END_ALLOW_THREADS
    ct_py_pin_release(&pl);
    if (cs != CT_OK) return ct_py_raise(cs);
    Py_RETURN_NONE;
}

/* 1 - decay**t in float32: powf, then a float32 subtraction (no contraction with it). */
static double bias_correction(double decay, double t) {
    volatile float p = powf((float)decay, (float)t);
    return (double)(1.0f - p);
}

/* f32_bias_correction(decay, t): 1 - decay**t computed in float32 (powf, then a float32
 * subtraction), as numpy's float32 scalars compute it; a Python float. */
static PyObject *py_f32_bias_correction(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2) return PyErr_Format(PyExc_TypeError, "f32_bias_correction(decay, t)");
    const double d = PyFloat_AsDouble(args[0]);
    if (d == -1.0 && PyErr_Occurred()) return NULL;
    const double t = PyFloat_AsDouble(args[1]);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    return PyFloat_FromDouble(bias_correction(d, t));
}

/* adam_scalars(b1, b2, eps, eps_root, mode, c): optim.transforms' two-moment stage scalars for
 * the step whose count reads c before it, where the stage's mode is the constant `mode`: with
 * t = min(int(c) + 1, 2**31 - 1), [b1, b2, eps, eps_root, bc(b1, t), bc(b2, t), mode,
 * bc(b1, min(t + 1, 2**31 - 1))], bc f32_bias_correction. A new list. */
static PyObject *py_adam_scalars(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 6)
        return PyErr_Format(PyExc_TypeError, "adam_scalars(b1, b2, eps, eps_root, mode, c)");
    const double b1 = PyFloat_AsDouble(args[0]);
    if (b1 == -1.0 && PyErr_Occurred()) return NULL;
    const double b2 = PyFloat_AsDouble(args[1]);
    if (b2 == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *ci = PyNumber_Long(args[5]);   /* int(c) */
    if (ci == NULL) return NULL;
    int overflow = 0;
    long long c = PyLong_AsLongLongAndOverflow(ci, &overflow);
    Py_DECREF(ci);
    if (c == -1 && PyErr_Occurred()) return NULL;
    const long long imax = 2147483647LL;
    /* min(c + 1, imax), overflow included (a huge c gives imax; a hugely negative one, no
     * count a state holds, a t far below) */
    long long t = overflow > 0 || c >= imax ? imax : overflow < 0 ? -imax : c + 1;
    const long long t2 = t >= imax ? imax : t + 1;
    PyObject *out = PyList_New(8);
    if (out == NULL) return NULL;
    PyObject *const keep[4] = {args[0], args[1], args[2], args[3]};
    for (int i = 0; i < 4; i++) PyList_SET_ITEM(out, i, Py_NewRef(keep[i]));
    PyObject *v[4] = {PyFloat_FromDouble(bias_correction(b1, (double)t)),
                      PyFloat_FromDouble(bias_correction(b2, (double)t)), Py_NewRef(args[4]),
                      PyFloat_FromDouble(bias_correction(b1, (double)t2))};
    int ok = 1;
    for (int i = 0; i < 4; i++) {
        ok &= v[i] != NULL;
        PyList_SET_ITEM(out, 4 + i, v[i] != NULL ? v[i] : Py_NewRef(Py_None));
    }
    if (!ok) Py_CLEAR(out);
    return out;
}

static PyMethodDef optim_methods[] = {
    {"adam_scalars", (PyCFunction)(void (*)(void))py_adam_scalars, METH_FASTCALL,
     "adam_scalars(b1, b2, eps, eps_root, mode, c, /)\n--\n\n"
     "The two-moment stage's scalars for the step after count c, with a constant mode: [b1, "
     "b2, eps, eps_root, bc(b1, t), bc(b2, t), mode, bc(b1, t + 1)], t = int(c) + 1 (both "
     "capped at 2**31 - 1), bc f32_bias_correction."},
    {"f32_bias_correction", (PyCFunction)(void (*)(void))py_f32_bias_correction, METH_FASTCALL,
     "f32_bias_correction(decay, t, /)\n--\n\n1 - decay**t in float32 (powf), as numpy's "
     "float32 scalars compute it: optax's bias correction."},
    {"optim_step", py_optim_step, METH_VARARGS,
     "optim_step(stages, groups, nleaves, grads=None, procs=None, /)\n--\n\n"
     "Run one fused optimizer step (GIL released); each group on one device, all groups on CPU\n"
     "devices (the OpenMP driver) or all on GPU devices (the CUDA kernel). stages: [(kind, scalars)]; groups: one list\n"
     "per device of block tuples (p, g, out, slots, active, leaf, counts[, geom]) of float32,\n"
     "bfloat16 or float16 buffers (each loaded and stored in its dtype); geom, for\n"
     "factored (adafactor) leaves: (d0, d1, shape, start, block_shape). grads: one list per\n"
     "group of grads buffers, one per block, replacing the blocks' g (a cached plan). p += u in place when\n"
     "out is None, else u is written to out. State slots are updated in place. Returns the\n"
     "per-stage results (global norm, finite flag).\n"
     "procs: None, or (rank, nproc, group_procs, timeout) for params that span processes:\n"
     "groups are the one-process step's (every process's devices, in its order), group i\n"
     "on process group_procs[i]; another process's blocks are (n, active, leaf, counts[, geom])\n"
     "tuples (no buffers; grads lists of such groups are ignored). The reductions' partials are\n"
     "exchanged through the MPI engine (waiting at most timeout seconds) and combined in the\n"
     "one-process order."},
    {"optim_reference", py_optim_reference, METH_VARARGS,
     "optim_reference(stages, block, /)\n--\n\n"
     "The plain one-element-at-a-time reference of a step on one block (elementwise stages only)."},
    {NULL, NULL, 0, NULL},
};

/* _C.optim_kinds ({name: code}, the ct_opt_kind enum) and _C.optim_nslots (state slots per
 * kind, by code): the Python layer reads the stage kinds from here instead of copying them. */
static int add_kinds(PyObject *m) {
    static const struct { const char *name; int kind; } kinds[] = {
        {"SCALE", CT_OPT_SCALE}, {"ADAM", CT_OPT_ADAM}, {"DECAY", CT_OPT_DECAY},
        {"TRACE", CT_OPT_TRACE}, {"LION", CT_OPT_LION}, {"RMS", CT_OPT_RMS},
        {"RSS", CT_OPT_RSS}, {"CLIP", CT_OPT_CLIP}, {"GLOBAL_NORM", CT_OPT_GLOBAL_NORM},
        {"TRUST_RATIO", CT_OPT_TRUST_RATIO}, {"FINITE_GATE", CT_OPT_FINITE_GATE},
        {"EMA", CT_OPT_EMA}, {"FACTORED", CT_OPT_FACTORED}, {"BLOCK_RMS", CT_OPT_BLOCK_RMS},
        {"PARAM_RMS", CT_OPT_PARAM_RMS}, {"ZERO", CT_OPT_ZERO}, {"BELIEF", CT_OPT_BELIEF},
        {"YOGI", CT_OPT_YOGI}, {"STDDEV", CT_OPT_STDDEV}, {"ACCUM", CT_OPT_ACCUM},
        {"ADAMAX", CT_OPT_ADAMAX}, {"AMSGRAD", CT_OPT_AMSGRAD},
    };
    _Static_assert(sizeof kinds / sizeof kinds[0] == CT_OPT_NUM_KINDS,
                   "every ct_opt_kind has a name here");
    PyObject *d = PyDict_New(), *ns = PyTuple_New(CT_OPT_NUM_KINDS);
    int rc = -1;
    if (d == NULL || ns == NULL) goto out;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        PyObject *v = PyLong_FromLong(kinds[i].kind);
        if (v == NULL || PyDict_SetItemString(d, kinds[i].name, v) < 0) {
            Py_XDECREF(v);
            goto out;
        }
        Py_DECREF(v);
    }
    for (int k = 0; k < CT_OPT_NUM_KINDS; k++) {
        PyObject *v = PyLong_FromLong(ct_opt_kind_nslots(k));
        if (v == NULL) goto out;
        PyTuple_SET_ITEM(ns, k, v);
    }
    rc = (PyModule_AddObjectRef(m, "optim_kinds", d) < 0 ||
          PyModule_AddObjectRef(m, "optim_nslots", ns) < 0) ? -1 : 0;
out:
    Py_XDECREF(d);
    Py_XDECREF(ns);
    return rc;
}

int ct_py_init_optim(PyObject *m) {
    if (add_kinds(m) < 0) return -1;
    return PyModule_AddFunctions(m, optim_methods);
}
