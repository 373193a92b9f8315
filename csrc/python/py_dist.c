/*
 * py_dist.c — bindings of the process engine (csrc/process/ct_dist.h): initialise and shut down
 * MPI, and the host collectives on numpy arrays.
 *
 * Argument checks and conversion only. The GIL is released while a collective waits; every
 * ~100 ms the waiting thread takes the GIL back to run Python's signal handlers, so Ctrl-C
 * stops a wait (KeyboardInterrupt). A collective that timed out raises TimeoutError. After a
 * timeout, an interruption or an MPI error, MPI may still write the call's buffers (a started
 * collective cannot be cancelled), so the call keeps a reference to its arrays for the rest of
 * the process's life.
 */
#include "ct_py.h"

#include <math.h>
#include <string.h>

#include "../process/ct_dist.h"

/* ---- arguments ---------------------------------------------------------------------- */

typedef struct {
    PyArrayObject *a;
    void *data;
    size_t count, itemsize, nbytes;
    int dtype; /* ct_dist_dtype, or -1 for a dtype that moves but does not reduce */
} host_arg;

static int dist_dtype_of(PyArrayObject *a) {
    PyArray_Descr *d = PyArray_DESCR(a);
    int size = (int)PyArray_ITEMSIZE(a);
    switch (d->kind) {
    case 'f':
        return size == 4 ? CT_DIST_F32 : size == 8 ? CT_DIST_F64 : size == 2 ? CT_DIST_F16 : -1;
    case 'i':
        return size == 4 ? CT_DIST_I32 : size == 8 ? CT_DIST_I64 : -1;
    case 'u':
        return size == 4 ? CT_DIST_U32 : size == 8 ? CT_DIST_U64 : -1;
    case 'V': {
        /* ml_dtypes' bfloat16 is a user-defined numpy type */
        PyObject *name = PyObject_GetAttrString((PyObject *)d, "name");
        int bf = -1;
        if (name != NULL && PyUnicode_Check(name))
            bf = PyUnicode_CompareWithASCIIString(name, "bfloat16") == 0 && size == 2;
        Py_XDECREF(name);
        PyErr_Clear();
        return bf == 1 ? CT_DIST_BF16 : -1;
    }
    default:
        return -1;
    }
}

/* A C-contiguous, aligned, native-order numpy array without Python objects (writable if
 * `out`). */
static int get_host(PyObject *obj, host_arg *h, const char *what, int out) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array, got %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyDataType_REFCHK(PyArray_DESCR(a))) {
        PyErr_Format(PyExc_TypeError, "%s: an array of Python objects cannot be sent to other "
                     "processes", what);
        return -1;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a) ||
        (out && !PyArray_ISWRITEABLE(a))) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous, aligned, native-order%s array",
                     what, out ? ", writeable" : "");
        return -1;
    }
    h->a = a;
    h->data = PyArray_DATA(a);
    h->count = (size_t)PyArray_SIZE(a);
    h->itemsize = (size_t)PyArray_ITEMSIZE(a);
    h->nbytes = h->count * h->itemsize;
    h->dtype = dist_dtype_of(a);
    return 0;
}

static int same_dtype(host_arg *x, host_arg *y, const char *what) {
    if (!PyArray_EquivTypes(PyArray_DESCR(x->a), PyArray_DESCR(y->a))) {
        PyErr_Format(PyExc_TypeError, "%s: send is %R and recv is %R; they must be the same",
                     what, (PyObject *)PyArray_DESCR(x->a), (PyObject *)PyArray_DESCR(y->a));
        return -1;
    }
    return 0;
}

static int reducible(host_arg *h, const char *what) {
    if (h->dtype < 0) {
        PyErr_Format(PyExc_TypeError, "%s: cannot reduce %R across processes (float32, float64, "
                     "float16, bfloat16, int32, int64, uint32 and uint64 can be)", what,
                     (PyObject *)PyArray_DESCR(h->a));
        return -1;
    }
    return 0;
}

static int overlap(const host_arg *x, const host_arg *y) {
    const char *a = x->data, *b = y->data;
    return x->nbytes > 0 && y->nbytes > 0 && a < b + y->nbytes && b < a + x->nbytes;
}

static int conv_op(PyObject *obj, void *out) {
    static const char *names[] = {"sum", "max", "min"};
    if (PyUnicode_Check(obj))
        for (int i = 0; i < CT_DIST_NUM_OPS; i++)
            if (PyUnicode_CompareWithASCIIString(obj, names[i]) == 0) {
                *(ct_dist_op *)out = (ct_dist_op)i;
                return 1;
            }
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "op must be 'sum', 'max' or 'min', got %R", obj);
    return 0;
}

static int conv_timeout(PyObject *obj, void *out) {
    double t = PyFloat_AsDouble(obj);
    if (t == -1.0 && PyErr_Occurred()) return 0;
    if (!(t > 0)) {
        PyErr_Format(PyExc_ValueError, "timeout must be a positive number of seconds (inf: no "
                     "timeout), got %R", obj);
        return 0;
    }
    *(double *)out = t;
    return 1;
}

static int require_initialized(const char *what) {
    if (!ct_dist_initialized()) {
        PyErr_Format(PyExc_RuntimeError, "%s: ctrainstate.distributed is not initialized; call "
                     "ctrainstate.distributed.initialize() first", what);
        return -1;
    }
    return 0;
}

/* ---- waiting without the GIL -------------------------------------------------------- */

typedef struct {
    PyThreadState *ts;
} poll_ctx;

static int poll_signals(void *p) {
    poll_ctx *c = p;
    PyEval_RestoreThread(c->ts);
    int stop = PyErr_CheckSignals() < 0; /* the handler's exception stays set */
    c->ts = PyEval_SaveThread();
    return stop;
}

/* The exception for a failed collective. If this call broke the engine, its arrays are kept
 * alive (MPI may still write them) and a timeout raises TimeoutError, an interruption the
 * signal handler's exception. */
static PyObject *collective_failed(ct_status st, ct_dist_failure_kind before, PyObject *a,
                                   PyObject *b) {
    ct_dist_failure_kind now = ct_dist_failure();
    if (before == CT_DIST_FAIL_NONE && now != CT_DIST_FAIL_NONE) {
        Py_XINCREF(a); /* deliberately never released */
        Py_XINCREF(b);
        if (now == CT_DIST_FAIL_INTERRUPTED && PyErr_Occurred()) {
            ct_clear_error();
            return NULL;
        }
        if (now == CT_DIST_FAIL_TIMEOUT) {
            PyErr_SetString(PyExc_TimeoutError, ct_last_error());
            ct_clear_error();
            return NULL;
        }
    }
    return ct_py_raise(st);
}

#define CT_DIST_WAIT(call)                               \
    do {                                                 \
        poll_ctx pc_;                                    \
        pc_.ts = PyEval_SaveThread();                    \
        st = (call);                                     \
        PyEval_RestoreThread(pc_.ts);                    \
    } while (0)

/* ---- functions ---------------------------------------------------------------------- */

PyDoc_STRVAR(dist_initialize_doc,
             "dist_initialize($module, library, process_id, num_processes, /)\n--\n\n"
             "Load MPI (library: a path, or None to search libmpi.so.40 then libmpi.so), "
             "initialise it and check that the world is num_processes processes with this one "
             "as process_id (-1: unchecked). Returns (process_id, num_processes).");

static PyObject *py_dist_initialize(PyObject *self, PyObject *args) {
    (void)self;
    const char *library = NULL;
    int rank, size;
    if (!PyArg_ParseTuple(args, "zO&O&:dist_initialize", &library, ct_py_conv_int, &rank,
                          ct_py_conv_int, &size))
        return NULL;
    ct_status st;
    /* MPI_Init_thread waits for the launcher's other processes: without the GIL */
    Py_BEGIN_ALLOW_THREADS
    st = ct_dist_init(library, rank, size);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) return ct_py_raise(st);
    return Py_BuildValue("(ii)", ct_dist_rank(), ct_dist_size());
}

PyDoc_STRVAR(dist_shutdown_doc,
             "dist_shutdown($module, /)\n--\n\n"
             "Free the communicator and finalise MPI if dist_initialize initialised it (not when "
             "the engine is broken). Nothing when not initialised.");

static PyObject *py_dist_shutdown(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    ct_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ct_dist_finalize();
    Py_END_ALLOW_THREADS
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dist_info_doc,
             "dist_info($module, /)\n--\n\n"
             "The engine's state: a dict with initialized, process_id, num_processes, owns_mpi, "
             "thread_level, library, version and failure (None, 'timeout', 'interrupted' or "
             "'mpi').");

static PyObject *py_dist_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    static const char *fails[] = {NULL, "timeout", "interrupted", "mpi"};
    ct_dist_failure_kind f = ct_dist_failure();
    PyObject *failure = f == CT_DIST_FAIL_NONE ? Py_NewRef(Py_None)
                                               : PyUnicode_FromString(fails[f]);
    if (failure == NULL) return NULL;
    return Py_BuildValue("{s:O,s:i,s:i,s:O,s:i,s:s,s:s,s:N}",
                         "initialized", ct_dist_initialized() ? Py_True : Py_False,
                         "process_id", ct_dist_rank(), "num_processes", ct_dist_size(),
                         "owns_mpi", ct_dist_owns_mpi() ? Py_True : Py_False,
                         "thread_level", ct_dist_thread_level(), "library", ct_dist_library(),
                         "version", ct_dist_version(), "failure", failure);
}

PyDoc_STRVAR(dist_allreduce_doc,
             "dist_allreduce($module, send, recv, op, timeout, /)\n--\n\n"
             "recv = op ('sum', 'max', 'min') over every process of send, elementwise. Both "
             "C-contiguous numpy arrays of one dtype and size; recv may be send (in place). "
             "float16 and bfloat16 are reduced in float32 and rounded once.");

static PyObject *py_dist_allreduce(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *ro;
    ct_dist_op op;
    double timeout;
    if (!PyArg_ParseTuple(args, "OOO&O&:dist_allreduce", &so, &ro, conv_op, &op, conv_timeout,
                          &timeout))
        return NULL;
    host_arg s, r;
    if (get_host(so, &s, "allreduce: send", 0) < 0 || get_host(ro, &r, "allreduce: recv", 1) < 0 ||
        same_dtype(&s, &r, "allreduce") < 0 || reducible(&s, "allreduce") < 0)
        return NULL;
    if (s.count != r.count) {
        PyErr_Format(PyExc_ValueError, "allreduce: send has %zu elements and recv %zu; they must "
                     "be the same", s.count, r.count);
        return NULL;
    }
    if (s.data != r.data && overlap(&s, &r)) {
        PyErr_SetString(PyExc_ValueError, "allreduce: send and recv overlap without being the "
                        "same array");
        return NULL;
    }
    if (require_initialized("allreduce") < 0) return NULL;
    ct_dist_failure_kind before = ct_dist_failure();
    ct_status st;
    CT_DIST_WAIT(ct_dist_allreduce(s.data, r.data, s.count, (ct_dist_dtype)s.dtype, op, timeout,
                                   poll_signals, &pc_));
    if (st != CT_OK) return collective_failed(st, before, so, ro);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dist_allgather_doc,
             "dist_allgather($module, send, recv, timeout, channel=0, /)\n--\n\n"
             "recv[p * send.size + i] = send of process p [i]: recv holds send.size * "
             "num_processes elements of send's dtype (any dtype of 1, 2, 4, 8 or 16 bytes). "
             "channel 1 is the checkpoint channel (its own communicator, for a background "
             "thread's collectives; 0 carries every other collective).");

static PyObject *py_dist_allgather(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *ro;
    double timeout;
    int channel = CT_DIST_MAIN;
    if (!PyArg_ParseTuple(args, "OOO&|i:dist_allgather", &so, &ro, conv_timeout, &timeout,
                          &channel))
        return NULL;
    if (channel < 0 || channel >= CT_DIST_NUM_CHANNELS) {
        PyErr_Format(PyExc_ValueError, "allgather: channel must be 0 (main) or 1 (checkpoint), "
                     "got %d", channel);
        return NULL;
    }
    host_arg s, r;
    if (get_host(so, &s, "allgather: send", 0) < 0 || get_host(ro, &r, "allgather: recv", 1) < 0 ||
        same_dtype(&s, &r, "allgather") < 0)
        return NULL;
    if (overlap(&s, &r)) {
        PyErr_SetString(PyExc_ValueError, "allgather: send and recv overlap");
        return NULL;
    }
    if (require_initialized("allgather") < 0) return NULL;
    size_t n = (size_t)ct_dist_size();
    if (r.count != s.count * n) {
        PyErr_Format(PyExc_ValueError, "allgather: recv has %zu elements; it must have send's %zu "
                     "times the %zu processes", r.count, s.count, n);
        return NULL;
    }
    ct_dist_failure_kind before = ct_dist_failure();
    ct_status st;
    CT_DIST_WAIT(ct_dist_allgather_on((ct_dist_channel)channel, s.data, r.data, s.count,
                                      s.itemsize, timeout, poll_signals, &pc_));
    if (st != CT_OK) return collective_failed(st, before, so, ro);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dist_reduce_scatter_doc,
             "dist_reduce_scatter($module, send, recv, op, timeout, /)\n--\n\n"
             "recv[i] = op over every process of send[process_id * recv.size + i]: send holds "
             "recv.size * num_processes elements.");

static PyObject *py_dist_reduce_scatter(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *ro;
    ct_dist_op op;
    double timeout;
    if (!PyArg_ParseTuple(args, "OOO&O&:dist_reduce_scatter", &so, &ro, conv_op, &op,
                          conv_timeout, &timeout))
        return NULL;
    host_arg s, r;
    if (get_host(so, &s, "reduce_scatter: send", 0) < 0 ||
        get_host(ro, &r, "reduce_scatter: recv", 1) < 0 ||
        same_dtype(&s, &r, "reduce_scatter") < 0 || reducible(&s, "reduce_scatter") < 0)
        return NULL;
    if (overlap(&s, &r)) {
        PyErr_SetString(PyExc_ValueError, "reduce_scatter: send and recv overlap");
        return NULL;
    }
    if (require_initialized("reduce_scatter") < 0) return NULL;
    size_t n = (size_t)ct_dist_size();
    if (s.count != r.count * n) {
        PyErr_Format(PyExc_ValueError, "reduce_scatter: send has %zu elements; it must have recv's "
                     "%zu times the %zu processes", s.count, r.count, n);
        return NULL;
    }
    ct_dist_failure_kind before = ct_dist_failure();
    ct_status st;
    CT_DIST_WAIT(ct_dist_reduce_scatter(s.data, r.data, r.count, (ct_dist_dtype)s.dtype, op,
                                        timeout, poll_signals, &pc_));
    if (st != CT_OK) return collective_failed(st, before, so, ro);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dist_broadcast_doc,
             "dist_broadcast($module, buf, root, timeout, /)\n--\n\n"
             "buf of every process = buf of process root (in place; any dtype of 1, 2, 4, 8 or "
             "16 bytes).");

static PyObject *py_dist_broadcast(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bo;
    int root;
    double timeout;
    if (!PyArg_ParseTuple(args, "OO&O&:dist_broadcast", &bo, ct_py_conv_int, &root, conv_timeout,
                          &timeout))
        return NULL;
    host_arg b;
    if (get_host(bo, &b, "broadcast: buf", 1) < 0) return NULL;
    if (require_initialized("broadcast") < 0) return NULL;
    if (root < 0 || root >= ct_dist_size()) {
        PyErr_Format(PyExc_ValueError, "broadcast: root %d is not a process (there are %d)", root,
                     ct_dist_size());
        return NULL;
    }
    ct_dist_failure_kind before = ct_dist_failure();
    ct_status st;
    CT_DIST_WAIT(ct_dist_broadcast(b.data, b.count, b.itemsize, root, timeout, poll_signals, &pc_));
    if (st != CT_OK) return collective_failed(st, before, bo, NULL);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dist_barrier_doc,
             "dist_barrier($module, timeout, /)\n--\n\n"
             "Return once every process has entered the barrier.");

static PyObject *py_dist_barrier(PyObject *self, PyObject *args) {
    (void)self;
    double timeout;
    if (!PyArg_ParseTuple(args, "O&:dist_barrier", conv_timeout, &timeout)) return NULL;
    if (require_initialized("barrier") < 0) return NULL;
    ct_dist_failure_kind before = ct_dist_failure();
    ct_status st;
    CT_DIST_WAIT(ct_dist_barrier(timeout, poll_signals, &pc_));
    if (st != CT_OK) return collective_failed(st, before, NULL, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef dist_methods[] = {
    {"dist_initialize", py_dist_initialize, METH_VARARGS, dist_initialize_doc},
    {"dist_shutdown", py_dist_shutdown, METH_NOARGS, dist_shutdown_doc},
    {"dist_info", py_dist_info, METH_NOARGS, dist_info_doc},
    {"dist_allreduce", py_dist_allreduce, METH_VARARGS, dist_allreduce_doc},
    {"dist_allgather", py_dist_allgather, METH_VARARGS, dist_allgather_doc},
    {"dist_reduce_scatter", py_dist_reduce_scatter, METH_VARARGS, dist_reduce_scatter_doc},
    {"dist_broadcast", py_dist_broadcast, METH_VARARGS, dist_broadcast_doc},
    {"dist_barrier", py_dist_barrier, METH_VARARGS, dist_barrier_doc},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_dist(PyObject *m) {
    return PyModule_AddFunctions(m, dist_methods);
}
