/*
 * ct_dist.c — the process engine (ct_dist.h): Open MPI loaded with dlopen, collectives as
 * non-blocking MPI polled against a deadline.
 *
 * MPI does the transport; this file only loads it, keeps one communicator, converts float16 /
 * bfloat16 to float32 for reductions, splits counts beyond MPI's int, and waits with a
 * deadline. The waiting loop spins on MPI_Test (Open MPI's non-blocking collectives progress
 * only inside MPI calls, as its blocking ones do inside their own wait loop), yields the CPU
 * after the first few thousand tests (other processes may share the cores), and every ~100 ms
 * calls the caller's poll function (the binding checks for Ctrl-C there).
 */
#include "ct_dist.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../core/ct_dtype.h"
#include "../core/ct_random_math.h" /* float16 / bfloat16 <-> float32 */

/* Open MPI's handles are pointers; MPI_IN_PLACE and MPI_STATUS_IGNORE as its mpi.h has them.
 * MPI_THREAD_SERIALIZED is 2 in every MPI. */
typedef void *mpi_h;
#define CT_MPI_IN_PLACE ((void *)1)
#define CT_MPI_THREAD_SERIALIZED 2
#define CT_MPI_MAX_ERROR_STRING 1024 /* Open MPI: 256; MPICH: 1024 */
#define CT_MPI_MAX_VERSION 8192      /* Open MPI: 256; MPICH: 8192 */

typedef struct {
    int (*Init_thread)(int *, char ***, int, int *);
    int (*Initialized)(int *);
    int (*Finalized)(int *);
    int (*Finalize)(void);
    int (*Query_thread)(int *);
    int (*Comm_dup)(mpi_h, mpi_h *);
    int (*Comm_free)(mpi_h *);
    int (*Comm_rank)(mpi_h, int *);
    int (*Comm_size)(mpi_h, int *);
    int (*Comm_set_errhandler)(mpi_h, mpi_h);
    int (*Iallreduce)(const void *, void *, int, mpi_h, mpi_h, mpi_h, mpi_h *);
    int (*Iallgather)(const void *, int, mpi_h, void *, int, mpi_h, mpi_h, mpi_h *);
    int (*Ireduce_scatter_block)(const void *, void *, int, mpi_h, mpi_h, mpi_h, mpi_h *);
    int (*Ibcast)(void *, int, mpi_h, int, mpi_h, mpi_h *);
    int (*Ibarrier)(mpi_h, mpi_h *);
    int (*Test)(mpi_h *, int *, void *);
    int (*Error_string)(int, char *, int *);
    int (*Get_library_version)(char *, int *);
    /* predefined handles: the addresses of Open MPI's global objects */
    mpi_h comm_world, errors_return;
    mpi_h t_float, t_double, t_int32, t_int64, t_uint32, t_uint64;
    mpi_h t_u8, t_u16, t_u32, t_u64;
    mpi_h op_sum, op_max, op_min;
} ct_mpi_api;

enum { ST_UNINIT = 0, ST_READY, ST_BROKEN };

static struct {
    pthread_mutex_t lock;
    int state;
    int mpi_finalized_here; /* this process called MPI_Finalize: MPI cannot start again */
    void *lib;
    ct_mpi_api api;
    char path[4096];
    char version[512];
    mpi_h comm;
    int rank, size, owns, level;
    pid_t pid;
    ct_dist_failure_kind failure;
    char broken[CT_ERRMSG_MAX];
} g = {.lock = PTHREAD_MUTEX_INITIALIZER, .rank = -1, .size = -1, .level = -1};

size_t ct_dist_dtype_size(ct_dist_dtype dt) {
    switch (dt) {
    case CT_DIST_F32: case CT_DIST_I32: case CT_DIST_U32: return 4;
    case CT_DIST_F64: case CT_DIST_I64: case CT_DIST_U64: return 8;
    case CT_DIST_F16: case CT_DIST_BF16: return 2;
    default: return 0;
    }
}

const char *ct_dist_dtype_name(ct_dist_dtype dt) {
    static const char *names[] = {"float32", "float64", "int32", "int64", "uint32", "uint64",
                                  "float16", "bfloat16"};
    return (unsigned)dt < CT_DIST_NUM_DTYPES ? names[dt] : "invalid";
}

const char *ct_dist_op_name(ct_dist_op op) {
    static const char *names[] = {"sum", "max", "min"};
    return (unsigned)op < CT_DIST_NUM_OPS ? names[op] : "invalid";
}

/* ---- loading ------------------------------------------------------------------------- */

static const char *mpi_error_text(int rc, char *buf, size_t cap) {
    int len = 0;
    char tmp[CT_MPI_MAX_ERROR_STRING + 1] = {0};
    if (g.api.Error_string != NULL && g.api.Error_string(rc, tmp, &len) == 0) {
        snprintf(buf, cap, "%s (MPI error %d)", tmp, rc);
    } else {
        snprintf(buf, cap, "MPI error %d", rc);
    }
    return buf;
}

#define CT_MPI_PACKAGES                                                                     \
    "install Open MPI (Debian/Ubuntu: apt-get install libopenmpi3 openmpi-bin, or "          \
    "libopenmpi-dev) or set CTRAINSTATE_MPI_LIBRARY to the path of Open MPI's libmpi.so"

static ct_status load_library(const char *library) {
    if (g.lib != NULL) return CT_OK;
    const char *tries[3] = {NULL, NULL, NULL};
    int n = 0;
    if (library != NULL && library[0] != '\0') {
        tries[n++] = library;
    } else {
        tries[n++] = "libmpi.so.40"; /* Open MPI 3, 4, 5 */
        tries[n++] = "libmpi.so";
    }
    char why[1024] = {0};
    for (int i = 0; i < n; i++) {
        /* RTLD_GLOBAL: Open MPI's plugins (mca_*.so) resolve symbols of libmpi and
         * libopen-pal against the global scope */
        void *h = dlopen(tries[i], RTLD_NOW | RTLD_GLOBAL);
        if (h != NULL) {
            g.lib = h;
            Dl_info info;
            void *sym = dlsym(h, "MPI_Init_thread");
            if (sym != NULL && dladdr(sym, &info) != 0 && info.dli_fname != NULL)
                snprintf(g.path, sizeof g.path, "%s", info.dli_fname);
            else
                snprintf(g.path, sizeof g.path, "%s", tries[i]);
            return CT_OK;
        }
        const char *e = dlerror();
        size_t used = strlen(why);
        snprintf(why + used, sizeof why - used, "%s%s", used ? "; " : "", e ? e : tries[i]);
    }
    return ct_set_error(CT_EDEVICE,
                        "ctrainstate.distributed needs an MPI library and none could be loaded "
                        "(%s): " CT_MPI_PACKAGES, why);
}

static ct_status resolve(void) {
    ct_mpi_api a;
    memset(&a, 0, sizeof a);
    /* The predefined handles first: their absence is what tells a library of MPICH's ABI. */
    struct { mpi_h *slot; const char *name; } objs[] = {
        {&a.comm_world, "ompi_mpi_comm_world"}, {&a.errors_return, "ompi_mpi_errors_return"},
        {&a.t_float, "ompi_mpi_float"},         {&a.t_double, "ompi_mpi_double"},
        {&a.t_int32, "ompi_mpi_int32_t"},       {&a.t_int64, "ompi_mpi_int64_t"},
        {&a.t_uint32, "ompi_mpi_uint32_t"},     {&a.t_uint64, "ompi_mpi_uint64_t"},
        {&a.t_u8, "ompi_mpi_uint8_t"},          {&a.t_u16, "ompi_mpi_uint16_t"},
        {&a.op_sum, "ompi_mpi_op_sum"},         {&a.op_max, "ompi_mpi_op_max"},
        {&a.op_min, "ompi_mpi_op_min"},
    };
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) {
        *objs[i].slot = dlsym(g.lib, objs[i].name);
        if (*objs[i].slot == NULL)
            return ct_set_error(CT_EDEVICE,
                                "%s is not Open MPI (it has no symbol %s): ctrainstate.distributed "
                                "supports Open MPI only; MPICH and the MPIs on its ABI (Intel MPI, "
                                "MVAPICH, Cray MPICH) use integer handles, which it does not "
                                "support yet. " CT_MPI_PACKAGES,
                                g.path, objs[i].name);
    }
    a.t_u32 = a.t_uint32;
    a.t_u64 = a.t_uint64;
    struct { void **slot; const char *name; } fns[] = {
        {(void **)&a.Init_thread, "MPI_Init_thread"},
        {(void **)&a.Initialized, "MPI_Initialized"},
        {(void **)&a.Finalized, "MPI_Finalized"},
        {(void **)&a.Finalize, "MPI_Finalize"},
        {(void **)&a.Query_thread, "MPI_Query_thread"},
        {(void **)&a.Comm_dup, "MPI_Comm_dup"},
        {(void **)&a.Comm_free, "MPI_Comm_free"},
        {(void **)&a.Comm_rank, "MPI_Comm_rank"},
        {(void **)&a.Comm_size, "MPI_Comm_size"},
        {(void **)&a.Comm_set_errhandler, "MPI_Comm_set_errhandler"},
        {(void **)&a.Iallreduce, "MPI_Iallreduce"},
        {(void **)&a.Iallgather, "MPI_Iallgather"},
        {(void **)&a.Ireduce_scatter_block, "MPI_Ireduce_scatter_block"},
        {(void **)&a.Ibcast, "MPI_Ibcast"},
        {(void **)&a.Ibarrier, "MPI_Ibarrier"},
        {(void **)&a.Test, "MPI_Test"},
        {(void **)&a.Error_string, "MPI_Error_string"},
        {(void **)&a.Get_library_version, "MPI_Get_library_version"},
    };
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
        *fns[i].slot = dlsym(g.lib, fns[i].name);
        if (*fns[i].slot == NULL)
            return ct_set_error(CT_EDEVICE,
                                "%s has no %s: ctrainstate.distributed needs an MPI-3 library "
                                "(Open MPI 1.8 or later)", g.path, fns[i].name);
    }
    g.api = a;
    char ver[CT_MPI_MAX_VERSION + 1] = {0};
    int len = 0;
    if (a.Get_library_version(ver, &len) == 0) {
        ver[strcspn(ver, "\n,")] = '\0';
        snprintf(g.version, sizeof g.version, "%s", ver);
    }
    return CT_OK;
}

/* ---- state -------------------------------------------------------------------------- */

static ct_status mpi_fail(int rc, const char *what) {
    char text[CT_MPI_MAX_ERROR_STRING + 64];
    mpi_error_text(rc, text, sizeof text);
    return ct_set_error(CT_EDEVICE, "%s failed: %s", what, text);
}

/* Mark the engine broken with this thread's error (set just before). */
static ct_status break_engine(ct_dist_failure_kind kind, ct_status st) {
    g.state = ST_BROKEN;
    g.failure = kind;
    snprintf(g.broken, sizeof g.broken, "%s", ct_last_error());
    return st;
}

int ct_dist_initialized(void) { return g.state != ST_UNINIT; }
int ct_dist_rank(void) { return g.state != ST_UNINIT ? g.rank : -1; }
int ct_dist_size(void) { return g.state != ST_UNINIT ? g.size : -1; }
int ct_dist_owns_mpi(void) { return g.state != ST_UNINIT && g.owns; }
int ct_dist_thread_level(void) { return g.state != ST_UNINIT ? g.level : -1; }
const char *ct_dist_library(void) { return g.path; }
const char *ct_dist_version(void) { return g.version; }
ct_dist_failure_kind ct_dist_failure(void) { return g.state == ST_BROKEN ? g.failure : CT_DIST_FAIL_NONE; }

ct_status ct_dist_init(const char *library, int expect_rank, int expect_size) {
    if (expect_size == 0 || expect_size < -1 || expect_rank < -1 ||
        (expect_size > 0 && expect_rank >= expect_size))
        return ct_set_error(CT_EINVAL, "process %d of %d: expected a rank in [0, size) and a "
                            "size >= 1 (-1: not checked)", expect_rank, expect_size);
    pthread_mutex_lock(&g.lock);
    ct_status st = CT_OK;
    if (g.state != ST_UNINIT) {
        st = ct_set_error(CT_EDEVICE, "ctrainstate.distributed is already initialized (process "
                          "%d of %d); call shutdown() first", g.rank, g.size);
        goto out;
    }
    if (g.mpi_finalized_here) {
        st = ct_set_error(CT_EDEVICE, "MPI was finalized in this process by shutdown(), and MPI "
                          "cannot be initialized twice in one process: start a new process");
        goto out;
    }
    if ((st = load_library(library)) != CT_OK || (st = resolve()) != CT_OK) goto out;
    const ct_mpi_api *a = &g.api;
    int inited = 0, fin = 0, rc;
    if ((rc = a->Finalized(&fin)) != 0) { st = mpi_fail(rc, "MPI_Finalized"); goto out; }
    if (fin) {
        st = ct_set_error(CT_EDEVICE, "MPI was already finalized in this process (by other code "
                          "than ctrainstate); it cannot be initialized again");
        goto out;
    }
    if ((rc = a->Initialized(&inited)) != 0) { st = mpi_fail(rc, "MPI_Initialized"); goto out; }
    int provided = -1, owns = 0;
    if (!inited) {
        rc = a->Init_thread(NULL, NULL, CT_MPI_THREAD_SERIALIZED, &provided);
        if (rc != 0) { st = mpi_fail(rc, "MPI_Init_thread"); goto out; }
        owns = 1;
    } else if ((rc = a->Query_thread(&provided)) != 0) {
        st = mpi_fail(rc, "MPI_Query_thread");
        goto out;
    }
    mpi_h comm = NULL;
    int rank = -1, size = -1;
    if (provided < CT_MPI_THREAD_SERIALIZED) {
        st = ct_set_error(CT_EDEVICE, "MPI provides thread level %d; ctrainstate.distributed "
                          "needs MPI_THREAD_SERIALIZED (2) or more%s", provided,
                          owns ? "" : " (MPI was initialised before, e.g. by mpi4py: initialise "
                          "it with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE)");
    } else if ((rc = a->Comm_dup(a->comm_world, &comm)) != 0) {
        st = mpi_fail(rc, "MPI_Comm_dup(MPI_COMM_WORLD)");
    } else if ((rc = a->Comm_set_errhandler(comm, a->errors_return)) != 0) {
        st = mpi_fail(rc, "MPI_Comm_set_errhandler");
    } else if ((rc = a->Comm_rank(comm, &rank)) != 0 || (rc = a->Comm_size(comm, &size)) != 0) {
        st = mpi_fail(rc, "MPI_Comm_rank / MPI_Comm_size");
    } else if ((expect_size > 0 && size != expect_size) || (expect_rank >= 0 && rank != expect_rank)) {
        st = ct_set_error(CT_EINVAL,
                          "MPI started a world of %d process%s with this one as process %d, but "
                          "process %d of %d was expected%s", size, size == 1 ? "" : "es", rank,
                          expect_rank, expect_size,
                          size == 1 && expect_size > 1
                              ? ": a process started without an MPI launcher is a world of one; "
                                "start every process with mpirun -n N or srun --mpi=pmix"
                              : "");
    }
    if (st != CT_OK) {
        /* leave nothing half made: no communicator, and MPI finalised if this call started it
         * (a process that failed here cannot initialise MPI again either way) */
        if (comm != NULL) a->Comm_free(&comm);
        if (owns) {
            a->Finalize();
            g.mpi_finalized_here = 1;
        }
        goto out;
    }
    g.comm = comm;
    g.rank = rank;
    g.size = size;
    g.owns = owns;
    g.level = provided;
    g.pid = getpid();
    g.failure = CT_DIST_FAIL_NONE;
    g.broken[0] = '\0';
    g.state = ST_READY;
out:
    pthread_mutex_unlock(&g.lock);
    return st;
}

ct_status ct_dist_finalize(void) {
    pthread_mutex_lock(&g.lock);
    ct_status st = CT_OK;
    if (g.state == ST_UNINIT) goto out;
    if (g.pid == getpid()) {
        if (g.state == ST_READY) {
            int rc = g.api.Comm_free(&g.comm);
            if (rc == 0 && g.owns) {
                rc = g.api.Finalize();
                g.mpi_finalized_here = 1;
                if (rc != 0) st = mpi_fail(rc, "MPI_Finalize");
            } else if (rc != 0) {
                st = mpi_fail(rc, "MPI_Comm_free");
            }
        } else if (g.owns) {
            /* broken: MPI_Finalize would wait for the missing peer; MPI stays initialised
             * and cannot be used, nor started again */
            g.mpi_finalized_here = 1;
        }
    }
    g.state = ST_UNINIT;
    g.comm = NULL;
    g.rank = g.size = g.level = -1;
    g.owns = 0;
    g.failure = CT_DIST_FAIL_NONE;
out:
    pthread_mutex_unlock(&g.lock);
    return st;
}

/* ---- waiting ------------------------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    const char *what;
    double start, deadline, timeout;
    ct_dist_poll_fn poll;
    void *ctx;
} ct_wait;

static ct_status wait_request(ct_wait *w, mpi_h *req) {
    const ct_mpi_api *a = &g.api;
    double next_poll = w->start + 0.1;
    for (unsigned long spins = 1;; spins++) {
        int done = 0;
        int rc = a->Test(req, &done, NULL);
        if (rc != 0) return break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, w->what));
        if (done) return CT_OK;
        if ((spins & 63) == 0) {
            double t = now_s();
            if (t >= w->deadline)
                return break_engine(
                    CT_DIST_FAIL_TIMEOUT,
                    ct_set_error(CT_EDEVICE, "%s on process %d of %d did not complete within its "
                                 "timeout of %g s: another process died, hangs or never issued "
                                 "it (every process must issue the same collectives in the same "
                                 "order). The collective cannot be cancelled: ctrainstate."
                                 "distributed is unusable in this process from now on; end the "
                                 "job", w->what, g.rank, g.size, w->timeout));
            if (w->poll != NULL && t >= next_poll) {
                next_poll = t + 0.1;
                if (w->poll(w->ctx))
                    return break_engine(
                        CT_DIST_FAIL_INTERRUPTED,
                        ct_set_error(CT_EDEVICE, "%s on process %d of %d was interrupted; the "
                                     "collective cannot be cancelled: ctrainstate.distributed is "
                                     "unusable in this process from now on", w->what, g.rank,
                                     g.size));
            }
            if (spins > 4096) sched_yield();
        }
    }
}

/* Take the engine for one collective: lock, check the state. */
static ct_status enter(ct_wait *w, const char *what, double timeout_s, ct_dist_poll_fn poll,
                       void *ctx) {
    if (!(timeout_s > 0)) /* also NaN */
        return ct_set_error(CT_EINVAL, "%s: timeout must be a positive number of seconds "
                            "(inf: no timeout), got %g", what, timeout_s);
    w->what = what;
    w->timeout = timeout_s;
    w->poll = poll;
    w->ctx = ctx;
    w->start = now_s();
    w->deadline = isinf(timeout_s) ? INFINITY : w->start + timeout_s;
    pthread_mutex_lock(&g.lock);
    ct_status st = CT_OK;
    if (g.state == ST_UNINIT)
        st = ct_set_error(CT_EDEVICE, "%s: ctrainstate.distributed is not initialized; call "
                          "ctrainstate.distributed.initialize() first", what);
    else if (g.pid != getpid())
        st = ct_set_error(CT_EDEVICE, "%s: MPI was initialized by process %ld; this forked child "
                          "(%ld) cannot use it", what, (long)g.pid, (long)getpid());
    else if (g.state == ST_BROKEN)
        st = ct_set_error(CT_EDEVICE, "%s: ctrainstate.distributed is unusable after an earlier "
                          "failure: %s", what, g.broken);
    if (st != CT_OK) pthread_mutex_unlock(&g.lock);
    return st;
}

static void leave(void) { pthread_mutex_unlock(&g.lock); }

static mpi_h mpi_type(ct_dist_dtype dt) {
    switch (dt) {
    case CT_DIST_F32: case CT_DIST_F16: case CT_DIST_BF16: return g.api.t_float;
    case CT_DIST_F64: return g.api.t_double;
    case CT_DIST_I32: return g.api.t_int32;
    case CT_DIST_I64: return g.api.t_int64;
    case CT_DIST_U32: return g.api.t_uint32;
    case CT_DIST_U64: return g.api.t_uint64;
    default: return NULL;
    }
}

static mpi_h mpi_op(ct_dist_op op) {
    return op == CT_DIST_SUM ? g.api.op_sum : op == CT_DIST_MAX ? g.api.op_max : g.api.op_min;
}

/* The MPI type of `elem_size`-byte elements for moves, and how many of them one element is. */
static ct_status move_type(size_t elem_size, mpi_h *type, size_t *per, const char *what) {
    switch (elem_size) {
    case 1: *type = g.api.t_u8; *per = 1; return CT_OK;
    case 2: *type = g.api.t_u16; *per = 1; return CT_OK;
    case 4: *type = g.api.t_u32; *per = 1; return CT_OK;
    case 8: *type = g.api.t_u64; *per = 1; return CT_OK;
    case 16: *type = g.api.t_u64; *per = 2; return CT_OK;
    default:
        return ct_set_error(CT_EINVAL, "%s: elements of %zu bytes are not supported (1, 2, 4, 8 "
                            "or 16)", what, elem_size);
    }
}

static ct_status check_reduce(ct_dist_dtype dt, ct_dist_op op, const char *what) {
    if ((unsigned)dt >= CT_DIST_NUM_DTYPES)
        return ct_set_error(CT_EINVAL, "%s: unknown dtype code %d", what, (int)dt);
    if ((unsigned)op >= CT_DIST_NUM_OPS)
        return ct_set_error(CT_EINVAL, "%s: unknown reduction code %d", what, (int)op);
    return CT_OK;
}

static int narrow(ct_dist_dtype dt) { return dt == CT_DIST_F16 || dt == CT_DIST_BF16; }

static void widen(ct_dist_dtype dt, const uint16_t *x, float *y, size_t n) {
    if (dt == CT_DIST_F16)
        for (size_t i = 0; i < n; i++) y[i] = ct_rm_f16_to_f32(x[i]);
    else
        for (size_t i = 0; i < n; i++) y[i] = ct_rm_bf16_to_f32(x[i]);
}

static void shorten(ct_dist_dtype dt, const float *x, uint16_t *y, size_t n) {
    if (dt == CT_DIST_F16)
        for (size_t i = 0; i < n; i++) y[i] = ct_rm_f32_to_f16(x[i]);
    else
        for (size_t i = 0; i < n; i++) y[i] = ct_rm_f32_to_bf16(x[i]);
}

/* Counts per MPI call: MPI counts are ints; float16 / bfloat16 chunks also bound the float32
 * scratch buffer (64 MiB). */
#define CT_DIST_CHUNK ((size_t)1 << 30)
#define CT_DIST_NARROW_CHUNK ((size_t)1 << 24)

static void *scratch(size_t bytes, const char *what) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL)
        ct_set_error(CT_EOOM, "%s: could not allocate %zu bytes of host memory for the float32 "
                     "copy of a float16/bfloat16 reduction", what, bytes);
    return p;
}

/* ---- collectives -------------------------------------------------------------------- */

ct_status ct_dist_allreduce(const void *send, void *recv, size_t count, ct_dist_dtype dt,
                            ct_dist_op op, double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    CT_TRY(check_reduce(dt, op, "allreduce"));
    if (count > 0 && (send == NULL || recv == NULL))
        return ct_set_error(CT_EINVAL, "allreduce: NULL buffer");
    ct_wait w;
    CT_TRY(enter(&w, "allreduce", timeout_s, poll, ctx));
    const ct_mpi_api *a = &g.api;
    ct_status st = CT_OK;
    size_t es = ct_dist_dtype_size(dt);
    if (!narrow(dt)) {
        for (size_t off = 0; off < count && st == CT_OK; off += CT_DIST_CHUNK) {
            size_t n = count - off < CT_DIST_CHUNK ? count - off : CT_DIST_CHUNK;
            const char *s = (const char *)send + off * es;
            char *r = (char *)recv + off * es;
            mpi_h req = NULL;
            int rc = a->Iallreduce(s == r ? CT_MPI_IN_PLACE : s, r, (int)n, mpi_type(dt),
                                   mpi_op(op), g.comm, &req);
            st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Iallreduce"))
                         : wait_request(&w, &req);
        }
        if (count == 0) {
            /* every process still takes part, so that collectives stay matched */
            mpi_h req = NULL;
            int rc = a->Iallreduce(CT_MPI_IN_PLACE, recv, 0, mpi_type(dt), mpi_op(op), g.comm, &req);
            st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Iallreduce"))
                         : wait_request(&w, &req);
        }
    } else {
        size_t cap = count < CT_DIST_NARROW_CHUNK ? count : CT_DIST_NARROW_CHUNK;
        float *tmp = scratch(cap * sizeof(float), "allreduce");
        if (tmp == NULL) st = CT_EOOM;
        for (size_t off = 0; st == CT_OK && (off < count || (count == 0 && off == 0));
             off += CT_DIST_NARROW_CHUNK) {
            size_t n = count - off < CT_DIST_NARROW_CHUNK ? count - off : CT_DIST_NARROW_CHUNK;
            widen(dt, (const uint16_t *)send + off, tmp, n);
            mpi_h req = NULL;
            int rc = a->Iallreduce(CT_MPI_IN_PLACE, tmp, (int)n, a->t_float, mpi_op(op), g.comm,
                                   &req);
            st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Iallreduce"))
                         : wait_request(&w, &req);
            if (st == CT_OK) shorten(dt, tmp, (uint16_t *)recv + off, n);
            if (count == 0) break;
        }
        /* after a failure the pending request may still write tmp: it is not freed */
        if (st == CT_OK || ct_dist_failure() == CT_DIST_FAIL_NONE) free(tmp);
    }
    leave();
    return st;
}

ct_status ct_dist_allgather(const void *send, void *recv, size_t count, size_t elem_size,
                            double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    mpi_h type = NULL;
    size_t per = 1;
    CT_TRY(move_type(elem_size, &type, &per, "allgather"));
    if (count > 0 && (send == NULL || recv == NULL))
        return ct_set_error(CT_EINVAL, "allgather: NULL buffer");
    if (count * per > (size_t)INT_MAX)
        return ct_set_error(CT_EINVAL, "allgather: %zu elements per process; at most %d are "
                            "supported in one call", count, INT_MAX / (int)per);
    ct_wait w;
    CT_TRY(enter(&w, "allgather", timeout_s, poll, ctx));
    mpi_h req = NULL;
    int n = (int)(count * per);
    int rc = g.api.Iallgather(send, n, type, recv, n, type, g.comm, &req);
    ct_status st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Iallgather"))
                           : wait_request(&w, &req);
    leave();
    return st;
}

ct_status ct_dist_reduce_scatter(const void *send, void *recv, size_t count, ct_dist_dtype dt,
                                 ct_dist_op op, double timeout_s, ct_dist_poll_fn poll,
                                 void *ctx) {
    CT_TRY(check_reduce(dt, op, "reduce_scatter"));
    if (count > 0 && (send == NULL || recv == NULL))
        return ct_set_error(CT_EINVAL, "reduce_scatter: NULL buffer");
    if (count > (size_t)INT_MAX)
        return ct_set_error(CT_EINVAL, "reduce_scatter: %zu elements per process; at most %d "
                            "are supported in one call", count, INT_MAX);
    ct_wait w;
    CT_TRY(enter(&w, "reduce_scatter", timeout_s, poll, ctx));
    const ct_mpi_api *a = &g.api;
    ct_status st = CT_OK;
    mpi_h req = NULL;
    if (!narrow(dt)) {
        int rc = a->Ireduce_scatter_block(send, recv, (int)count, mpi_type(dt), mpi_op(op),
                                          g.comm, &req);
        st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Ireduce_scatter_block"))
                     : wait_request(&w, &req);
    } else {
        size_t total = count * (size_t)g.size;
        float *tmp = scratch((total + count) * sizeof(float), "reduce_scatter");
        if (tmp == NULL) {
            st = CT_EOOM;
        } else {
            widen(dt, send, tmp, total);
            int rc = a->Ireduce_scatter_block(tmp, tmp + total, (int)count, a->t_float,
                                              mpi_op(op), g.comm, &req);
            st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Ireduce_scatter_block"))
                         : wait_request(&w, &req);
            if (st == CT_OK) shorten(dt, tmp + total, recv, count);
            if (st == CT_OK || ct_dist_failure() == CT_DIST_FAIL_NONE) free(tmp);
        }
    }
    leave();
    return st;
}

ct_status ct_dist_broadcast(void *buf, size_t count, size_t elem_size, int root,
                            double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    mpi_h type = NULL;
    size_t per = 1;
    CT_TRY(move_type(elem_size, &type, &per, "broadcast"));
    if (count > 0 && buf == NULL) return ct_set_error(CT_EINVAL, "broadcast: NULL buffer");
    ct_wait w;
    CT_TRY(enter(&w, "broadcast", timeout_s, poll, ctx));
    ct_status st = CT_OK;
    if (root < 0 || root >= g.size) {
        st = ct_set_error(CT_EINVAL, "broadcast: root %d is not a process (there are %d)", root,
                          g.size);
        leave();
        return st;
    }
    size_t total = count * per;
    size_t off = 0;
    do {
        size_t n = total - off < CT_DIST_CHUNK ? total - off : CT_DIST_CHUNK;
        mpi_h req = NULL;
        int rc = g.api.Ibcast((char *)buf + off * (elem_size / per), (int)n, type, root, g.comm,
                              &req);
        st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Ibcast"))
                     : wait_request(&w, &req);
        off += n;
    } while (st == CT_OK && off < total);
    leave();
    return st;
}

ct_status ct_dist_barrier(double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    ct_wait w;
    CT_TRY(enter(&w, "barrier", timeout_s, poll, ctx));
    mpi_h req = NULL;
    int rc = g.api.Ibarrier(g.comm, &req);
    ct_status st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Ibarrier"))
                           : wait_request(&w, &req);
    leave();
    return st;
}
