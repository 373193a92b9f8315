/*
 * ct_dist.c — the process engine (ct_dist.h): Open MPI loaded with dlopen; all-reduce,
 * all-gather and reduce-scatter written on MPI's non-blocking point-to-point messages, polled
 * against a deadline; broadcast and barrier as MPI_Ibcast / MPI_Ibarrier.
 *
 * Hand-written, and why: MPI does the transport, but its collectives do not serve. Blocking
 * ones (MPI_Allreduce) never time out, so a dead peer hangs the others for ever; Open MPI's
 * non-blocking ones (libnbc: MPI_Iallgather, ...) measured 2-3x slower than the blocking ones
 * at 256 KiB - 2 MiB (benchmarks/bench_collectives.py); and MPI picks the order of a
 * reduction by message size and tuning, where ctrainstate needs one order. So:
 *   all-gather      each process sends its block to every other and receives theirs
 *                   (MPI_Isend / MPI_Irecv, in segments of CT_DIST_SEG bytes);
 *   reduce-scatter  each process receives its block of every other process's buffer and
 *                   reduces them in process order, ((x_0 op x_1) op x_2) ... op x_{n-1};
 *   all-reduce      up to CT_DIST_SMALL bytes: all-gather of the whole buffers, then the same
 *                   reduction locally (one round); above: reduce-scatter of n near-equal
 *                   blocks, then all-gather of the results. Every size reduces in process
 *                   order, so results do not depend on the size or the MPI's tuning.
 * Other dtypes reduce straight into the result (the first two terms in one pass), the
 * receive buffer kept from one collective to the next (no page faults of a fresh mmap per
 * call); float16 / bfloat16 are accumulated in float32 and rounded once; max / min propagate NaN;
 * integer sums wrap. Each receive's byte count is checked against what this process
 * expects, so processes that passed different shapes raise instead of leaving results
 * partly written.
 *
 * The waiting loop spins on MPI_Testall (Open MPI progresses messages inside MPI calls, as its
 * blocking calls do in their own loop) and every ~100 ms calls the caller's poll function (the
 * binding checks for Ctrl-C there). Where the node runs more of the job's processes than it
 * has CPUs, or the launcher does not say, it yields the CPU after the first few thousand
 * tests; otherwise it never does, as MPI's blocking collectives (Open MPI yields only when
 * oversubscribed): a yield hands the core to any other runnable task, and the peers then
 * wait for this process to be scheduled again (benchmarks/bench_collectives.py on a loaded
 * 2-core VM: all-gathers of 8-64 MiB below 0.9x MPI_Allgather's bandwidth about half as often).
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
#define CT_MPI_ERR_TRUNCATE 15
#define CT_MPI_ERR_IN_STATUS 18
#define CT_OMPI_STATUS_SIZE 24 /* Open MPI's MPI_Status: 3 public ints, _cancelled, size_t _ucount */

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
    int (*Ibcast)(void *, int, mpi_h, int, mpi_h, mpi_h *);
    int (*Ibarrier)(mpi_h, mpi_h *);
    int (*Testall)(int, mpi_h *, int *, void *);
    int (*Isend)(const void *, int, mpi_h, int, int, mpi_h, mpi_h *);
    int (*Irecv)(void *, int, mpi_h, int, int, mpi_h, mpi_h *);
    int (*Get_count)(const void *, mpi_h, int *);
    int (*Error_string)(int, char *, int *);
    int (*Get_library_version)(char *, int *);
    /* predefined handles: the addresses of Open MPI's global objects */
    mpi_h comm_world, errors_return;
    mpi_h t_u8, t_u16, t_u32, t_u64, t_byte;
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
    int rank, size, owns, level;
    int yield; /* the waiting loop yields the CPU (node_oversubscribed) */
    pid_t pid;
    ct_dist_failure_kind failure;
    char broken[CT_ERRMSG_MAX];
} g = {.lock = PTHREAD_MUTEX_INITIALIZER, .rank = -1, .size = -1, .level = -1};

/* The channels (ct_dist.h): a duplicate of MPI_COMM_WORLD each, with its own tag sequence. A
 * collective holds its channel's lock from start to end (one collective at a time per channel,
 * in the caller's order) and g.lock around its MPI calls only: the wait loop lets go of g.lock
 * between tests, so that a collective of the other channel, in another thread, starts and
 * progresses meanwhile (MPI_THREAD_SERIALIZED: MPI calls never overlap). Lock order: a
 * channel's lock, then g.lock. */
static struct {
    pthread_mutex_t lock;
    mpi_h comm;
    unsigned seq;
} g_ch[CT_DIST_NUM_CHANNELS] = {{.lock = PTHREAD_MUTEX_INITIALIZER},
                                {.lock = PTHREAD_MUTEX_INITIALIZER}};

/* The reductions' receive buffer kept between collectives, up to CT_DIST_KEEP bytes
 * (keep_scratch below); reductions run on CT_DIST_MAIN only, under its lock. */
#define CT_DIST_KEEP ((size_t)64 << 20)
static struct {
    void *p;
    size_t cap;
} g_keep;

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
        {&a.t_u8, "ompi_mpi_uint8_t"},          {&a.t_u16, "ompi_mpi_uint16_t"},
        {&a.t_u32, "ompi_mpi_uint32_t"},        {&a.t_u64, "ompi_mpi_uint64_t"},
        {&a.t_byte, "ompi_mpi_byte"},
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
        {(void **)&a.Ibcast, "MPI_Ibcast"},
        {(void **)&a.Ibarrier, "MPI_Ibarrier"},
        {(void **)&a.Testall, "MPI_Testall"},
        {(void **)&a.Isend, "MPI_Isend"},
        {(void **)&a.Irecv, "MPI_Irecv"},
        {(void **)&a.Get_count, "MPI_Get_count"},
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
        snprintf(g.version, sizeof g.version, "%.500s", ver);
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

/* A positive integer in environment variable `name`, else -1. */
static long env_count(const char *name) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return -1;
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    return errno == 0 && *end == '\0' && x > 0 ? x : -1;
}

/* Whether this node runs more processes of the job than it has CPUs online: Open MPI's own
 * verdict where mpirun gives it (OMPI_MCA_mpi_yield_when_idle, OMPI_MCA_mpi_oversubscribe),
 * else the launcher's count of processes on this node (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE,
 * MPICH's MPI_LOCALNRANKS) against the CPUs. Unknown: oversubscribed (the waits yield). */
static int node_oversubscribed(void) {
    const char *v = getenv("OMPI_MCA_mpi_yield_when_idle");
    if (v != NULL && *v != '\0')
        return strchr("1tTyY", v[0]) != NULL;
    v = getenv("OMPI_MCA_mpi_oversubscribe");
    if (v != NULL && *v != '\0')
        return strchr("1tTyY", v[0]) != NULL;
    long local = env_count("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (local < 0) local = env_count("MPI_LOCALNRANKS");
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return local < 0 || cpus < 1 || local > cpus;
}

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
    mpi_h comm = NULL, comm_ckpt = NULL;
    int rank = -1, size = -1;
    if (provided < CT_MPI_THREAD_SERIALIZED) {
        st = ct_set_error(CT_EDEVICE, "MPI provides thread level %d; ctrainstate.distributed "
                          "needs MPI_THREAD_SERIALIZED (2) or more%s", provided,
                          owns ? "" : " (MPI was initialised before, e.g. by mpi4py: initialise "
                          "it with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE)");
    } else if ((rc = a->Comm_dup(a->comm_world, &comm)) != 0 ||
               (rc = a->Comm_dup(a->comm_world, &comm_ckpt)) != 0) {
        st = mpi_fail(rc, "MPI_Comm_dup(MPI_COMM_WORLD)");
    } else if ((rc = a->Comm_set_errhandler(comm, a->errors_return)) != 0 ||
               (rc = a->Comm_set_errhandler(comm_ckpt, a->errors_return)) != 0) {
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
        if (comm_ckpt != NULL) a->Comm_free(&comm_ckpt);
        if (owns) {
            a->Finalize();
            g.mpi_finalized_here = 1;
        }
        goto out;
    }
    g_ch[CT_DIST_MAIN].comm = comm;
    g_ch[CT_DIST_CHECKPOINT].comm = comm_ckpt;
    for (int c = 0; c < CT_DIST_NUM_CHANNELS; c++) g_ch[c].seq = 0;
    g.rank = rank;
    g.size = size;
    g.owns = owns;
    g.level = provided;
    g.yield = node_oversubscribed();
    g.pid = getpid();
    g.failure = CT_DIST_FAIL_NONE;
    g.broken[0] = '\0';
    g.state = ST_READY;
out:
    pthread_mutex_unlock(&g.lock);
    return st;
}

ct_status ct_dist_finalize(void) {
    for (int c = 0; c < CT_DIST_NUM_CHANNELS; c++) pthread_mutex_lock(&g_ch[c].lock);
    pthread_mutex_lock(&g.lock);
    ct_status st = CT_OK;
    if (g.state == ST_UNINIT) goto out;
    if (g.pid == getpid()) {
        if (g.state == ST_READY) {
            int rc = g.api.Comm_free(&g_ch[CT_DIST_CHECKPOINT].comm);
            if (rc == 0) rc = g.api.Comm_free(&g_ch[CT_DIST_MAIN].comm);
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
        if (g.state == ST_READY) { /* broken: MPI may still write into it; leaked */
            free(g_keep.p);
        }
        g_keep.p = NULL;
        g_keep.cap = 0;
    }
    g.state = ST_UNINIT;
    for (int c = 0; c < CT_DIST_NUM_CHANNELS; c++) g_ch[c].comm = NULL;
    g.rank = g.size = g.level = -1;
    g.owns = 0;
    g.failure = CT_DIST_FAIL_NONE;
out:
    pthread_mutex_unlock(&g.lock);
    for (int c = CT_DIST_NUM_CHANNELS - 1; c >= 0; c--) pthread_mutex_unlock(&g_ch[c].lock);
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
    ct_dist_channel ch;
    mpi_h comm;
} ct_wait;

/* Wait for `n` requests (MPI_Testall polled against the deadline, the poll function called
 * every ~100 ms). `status` receives n statuses (NULL: ignored). MPI_ERR_IN_STATUS is returned
 * as CT_OK with *in_status set, for the caller to read the statuses. */
static ct_status wait_reqs(ct_wait *w, mpi_h *reqs, int n, void *status, int *in_status) {
    const ct_mpi_api *a = &g.api;
    double next_poll = now_s() + 0.1;
    if (in_status != NULL) *in_status = 0;
    for (unsigned long spins = 1; n > 0; spins++) {
        int done = 0;
        int rc = a->Testall(n, reqs, &done, status);
        if (rc == CT_MPI_ERR_IN_STATUS && in_status != NULL) {
            *in_status = 1;
            return CT_OK;
        }
        if (rc != 0) return break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, w->what));
        if (done) return CT_OK;
        if ((spins & 63) == 0) {
            /* let a collective of the other channel run its MPI calls (another thread); the
             * poll function (which takes the GIL) runs without g.lock too */
            pthread_mutex_unlock(&g.lock);
            if (spins > 4096 && w->ch == CT_DIST_CHECKPOINT) {
                struct timespec nap = {0, 200000}; /* no hurry: leave the cores to training */
                nanosleep(&nap, NULL);
            } else if (g.yield && spins > 4096) { /* (an oversubscribed node: node_oversubscribed) */
                sched_yield();
            }
            double t = now_s();
            int stop = 0;
            if (w->poll != NULL && t >= next_poll) {
                next_poll = t + 0.1;
                stop = w->poll(w->ctx);
            }
            pthread_mutex_lock(&g.lock);
            if (g.state == ST_BROKEN)
                return ct_set_error(CT_EDEVICE, "%s: ctrainstate.distributed is unusable after a "
                                    "failure in another thread: %s", w->what, g.broken);
            if (stop)
                return break_engine(
                    CT_DIST_FAIL_INTERRUPTED,
                    ct_set_error(CT_EDEVICE, "%s on process %d of %d was interrupted; the "
                                 "collective cannot be cancelled: ctrainstate.distributed is "
                                 "unusable in this process from now on", w->what, g.rank,
                                 g.size));
            if (t >= w->deadline)
                return break_engine(
                    CT_DIST_FAIL_TIMEOUT,
                    ct_set_error(CT_EDEVICE, "%s on process %d of %d did not complete within its "
                                 "timeout of %g s: another process died, hangs or never issued "
                                 "it (every process must issue the same collectives in the same "
                                 "order). The collective cannot be cancelled: ctrainstate."
                                 "distributed is unusable in this process from now on; end the "
                                 "job", w->what, g.rank, g.size, w->timeout));
        }
    }
    return CT_OK;
}

static ct_status wait_request(ct_wait *w, mpi_h *req) { return wait_reqs(w, req, 1, NULL, NULL); }

/* Take the engine for one collective: lock, check the state. */
static ct_status enter(ct_wait *w, const char *what, double timeout_s, ct_dist_poll_fn poll,
                       void *ctx, ct_dist_channel ch) {
    if ((unsigned)ch >= CT_DIST_NUM_CHANNELS)
        return ct_set_error(CT_EINVAL, "%s: unknown channel %d", what, (int)ch);
    if (!(timeout_s > 0)) /* also NaN */
        return ct_set_error(CT_EINVAL, "%s: timeout must be a positive number of seconds "
                            "(inf: no timeout), got %g", what, timeout_s);
    w->what = what;
    w->timeout = timeout_s;
    w->poll = poll;
    w->ctx = ctx;
    w->start = now_s();
    w->deadline = isinf(timeout_s) ? INFINITY : w->start + timeout_s;
    w->ch = ch;
    pthread_mutex_lock(&g_ch[ch].lock);
    pthread_mutex_lock(&g.lock);
    w->comm = g_ch[ch].comm;
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
    if (st != CT_OK) {
        pthread_mutex_unlock(&g.lock);
        pthread_mutex_unlock(&g_ch[ch].lock);
    }
    return st;
}

static void leave(const ct_wait *w) {
    pthread_mutex_unlock(&g.lock);
    pthread_mutex_unlock(&g_ch[w->ch].lock);
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

/* ---- point-to-point rounds ----------------------------------------------------------- */

/* Messages are MPI_BYTE, at most CT_DIST_SEG bytes each (MPI counts are ints; the segment
 * also bounds the scratch memory of a reduction). */
#define CT_DIST_SEG ((size_t)32 << 20)

typedef struct {
    mpi_h *reqs;
    unsigned char *status;
    int *peer;     /* the process of each request */
    size_t *bytes; /* what a receive expects (SIZE_MAX for a send) */
    int n;
    mpi_h comm;
} ct_round;

static ct_status round_new(ct_round *r, int cap, const ct_wait *w) {
    const char *what = w->what;
    r->n = 0;
    r->comm = w->comm;
    r->reqs = calloc((size_t)cap, sizeof(mpi_h));
    r->status = calloc((size_t)cap, CT_OMPI_STATUS_SIZE);
    r->peer = calloc((size_t)cap, sizeof(int));
    r->bytes = calloc((size_t)cap, sizeof(size_t));
    if (r->reqs == NULL || r->status == NULL || r->peer == NULL || r->bytes == NULL)
        return ct_set_error(CT_EOOM, "%s: out of host memory for %d requests", what, cap);
    return CT_OK;
}

/* Free a round's arrays; after a failure MPI still owns the requests: they are leaked. */
static void round_free(ct_round *r, int failed) {
    if (failed && r->n > 0) return;
    free(r->reqs);
    free(r->status);
    free(r->peer);
    free(r->bytes);
}

static ct_status post(ct_round *r, int recv, void *buf, size_t bytes, int peer, int tag,
                      const char *what) {
    const ct_mpi_api *a = &g.api;
    mpi_h *req = &r->reqs[r->n];
    int rc = recv ? a->Irecv(buf, (int)bytes, a->t_byte, peer, tag, r->comm, req)
                  : a->Isend(buf, (int)bytes, a->t_byte, peer, tag, r->comm, req);
    if (rc != 0) return break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, recv ? "MPI_Irecv" : "MPI_Isend"));
    (void)what;
    r->peer[r->n] = peer;
    r->bytes[r->n] = recv ? bytes : SIZE_MAX;
    r->n++;
    return CT_OK;
}

/* Wait for every request of the round (polling MPI_Testall against the deadline); then
 * check that each receive got the bytes it expected: a process that passed another shape or
 * dtype is reported instead of leaving a result partly unwritten. */
static ct_status round_wait(ct_wait *w, ct_round *r) {
    const ct_mpi_api *a = &g.api;
    int in_status = 0;
    CT_TRY(wait_reqs(w, r->reqs, r->n, r->status, &in_status));
    for (int i = 0; in_status && i < r->n; i++) {
        int err = *(int *)(r->status + (size_t)i * CT_OMPI_STATUS_SIZE + 2 * sizeof(int));
        if (err == 0) continue;
        char text[CT_MPI_MAX_ERROR_STRING + 64];
        mpi_error_text(err, text, sizeof text);
        return break_engine(
            CT_DIST_FAIL_MPI,
            ct_set_error(CT_EDEVICE, "%s on process %d of %d: the message %s process %d "
                         "failed: %s%s", w->what, g.rank, g.size,
                         r->bytes[i] == SIZE_MAX ? "to" : "from", r->peer[i], text,
                         err == CT_MPI_ERR_TRUNCATE
                             ? " (it sent more than this process expected: the processes "
                               "passed different shapes or dtypes)" : ""));
    }
    if (in_status)
        return break_engine(CT_DIST_FAIL_MPI,
                            ct_set_error(CT_EDEVICE, "%s: MPI_ERR_IN_STATUS", w->what));
    for (int i = 0; i < r->n; i++) {
        if (r->bytes[i] == SIZE_MAX) continue;
        int got = -1;
        a->Get_count(r->status + (size_t)i * CT_OMPI_STATUS_SIZE, a->t_byte, &got);
        if (got < 0 || (size_t)got != r->bytes[i])
            return break_engine(
                CT_DIST_FAIL_MPI,
                ct_set_error(CT_EDEVICE, "%s on process %d of %d: process %d sent %d bytes where "
                             "%zu were expected: the processes passed different shapes or dtypes",
                             w->what, g.rank, g.size, r->peer[i], got, r->bytes[i]));
    }
    r->n = 0;
    return CT_OK;
}

/* Tags: the collective's kind in the low bits, a sequence number above (every process counts
 * its collectives alike), so that processes in different collectives do not match. */
enum { TAG_ALLGATHER = 1, TAG_REDUCE_SCATTER = 2, TAG_ALLREDUCE_SMALL = 3, TAG_ALLREDUCE_RS = 4,
       TAG_ALLREDUCE_AG = 5 };
static int next_tag(const ct_wait *w, int kind) {
    unsigned seq = ++g_ch[w->ch].seq;
    return (int)((seq & 0xfffu) << 3) | kind; /* < 32768, MPI's least MPI_TAG_UB */
}

static size_t seg_len(size_t len, size_t k, size_t seg) {
    return len > k * seg ? (len - k * seg < seg ? len - k * seg : seg) : 0;
}

/* Allgather of byte blocks of (possibly) different lengths: process q's `len[q]` bytes land at
 * `out + off[q]`; this process's come from `mine` (copied unless already in place). Every
 * message is posted at once (segments of CT_DIST_SEG bytes: MPI counts are ints), and this
 * process's block is copied while they fly, as MPI_Allgather does: one wait, no step between
 * segments at which a process waits for a peer that is not running. */
static ct_status gather_blocks(ct_wait *w, int tag, const void *mine, char *out,
                               const size_t *off, const size_t *len) {
    int n = g.size, me = g.rank;
    int copy = mine != out + off[me] && len[me] > 0;
    size_t most = 0;
    for (int q = 0; q < n; q++) most = len[q] > most ? len[q] : most;
    size_t segs = (most + CT_DIST_SEG - 1) / CT_DIST_SEG;
    if (n == 1 || segs == 0) {
        if (copy) memcpy(out + off[me], mine, len[me]);
        return CT_OK;
    }
    if (segs > (size_t)INT_MAX / (2 * (size_t)(n - 1)))
        return ct_set_error(CT_EINVAL, "%s: %zu bytes per process is too many to gather",
                            w->what, most);
    ct_round r;
    ct_status st = round_new(&r, (int)(2 * (size_t)(n - 1) * segs), w);
    /* receives first, then sends in ring order from the next process on, so that every
     * process does not send to process 0 first; a peer's segments in order (MPI matches
     * messages of one sender and tag in the order they were posted) */
    for (int i = 1; i < n && st == CT_OK; i++) {
        int q = (me - i + n) % n;
        for (size_t k = 0; st == CT_OK && k < segs; k++) {
            size_t b = seg_len(len[q], k, CT_DIST_SEG);
            if (b) st = post(&r, 1, out + off[q] + k * CT_DIST_SEG, b, q, tag, w->what);
        }
    }
    for (int i = 1; i < n && st == CT_OK; i++) {
        for (size_t k = 0; st == CT_OK && k < segs; k++) {
            size_t b = seg_len(len[me], k, CT_DIST_SEG);
            if (b) st = post(&r, 0, (char *)mine + k * CT_DIST_SEG, b, (me + i) % n, tag, w->what);
        }
    }
    if (st == CT_OK && copy) memcpy(out + off[me], mine, len[me]);
    if (st == CT_OK) st = round_wait(w, &r);
    round_free(&r, st != CT_OK);
    return st;
}

/* ---- reductions, in one order: ((x_0 op x_1) op x_2) ... op x_{n-1} ------------------- */

/* acc = x (first) or acc = acc op x, elementwise; acc is float32 for float16 / bfloat16. Max
 * and min propagate NaN, as jax's do; integer sums wrap. */
static void accumulate(ct_dist_dtype dt, ct_dist_op op, void *acc, const void *x, size_t n,
                       int first) {
    if (dt == CT_DIST_F16 || dt == CT_DIST_BF16) {
        float *a = acc;
        const uint16_t *h = x;
        for (size_t i = 0; i < n; i++) {
            float v = dt == CT_DIST_F16 ? ct_rm_f16_to_f32(h[i]) : ct_rm_bf16_to_f32(h[i]);
            if (first) a[i] = v;
            else if (op == CT_DIST_SUM) a[i] = a[i] + v;
            else if (op == CT_DIST_MAX) a[i] = (a[i] > v || a[i] != a[i]) ? a[i] : v;
            else a[i] = (a[i] < v || a[i] != a[i]) ? a[i] : v;
        }
        return;
    }
    if (first) {
        memcpy(acc, x, n * ct_dist_dtype_size(dt));
        return;
    }
#define CT_RED(T, U, FLOAT)                                                                 \
    do {                                                                                   \
        T *a = acc;                                                                        \
        const T *b = x;                                                                    \
        if (op == CT_DIST_SUM)                                                             \
            for (size_t i = 0; i < n; i++) a[i] = (T)((U)a[i] + (U)b[i]);                  \
        else if (op == CT_DIST_MAX)                                                        \
            for (size_t i = 0; i < n; i++)                                                 \
                a[i] = (a[i] > b[i] || (FLOAT && a[i] != a[i])) ? a[i] : b[i];             \
        else                                                                               \
            for (size_t i = 0; i < n; i++)                                                 \
                a[i] = (a[i] < b[i] || (FLOAT && a[i] != a[i])) ? a[i] : b[i];             \
    } while (0)
    switch (dt) {
    case CT_DIST_F32: CT_RED(float, float, 1); break;
    case CT_DIST_F64: CT_RED(double, double, 1); break;
    case CT_DIST_I32: CT_RED(int32_t, uint32_t, 0); break;
    case CT_DIST_I64: CT_RED(int64_t, uint64_t, 0); break;
    case CT_DIST_U32: CT_RED(uint32_t, uint32_t, 0); break;
    case CT_DIST_U64: CT_RED(uint64_t, uint64_t, 0); break;
    default: break;
    }
#undef CT_RED
}

static int narrow(ct_dist_dtype dt) { return dt == CT_DIST_F16 || dt == CT_DIST_BF16; }

/* out = x0 op x1 elementwise for the dtypes that are accumulated in their own type (not
 * float16 / bfloat16): the first two terms of ((x_0 op x_1) op x_2) ... in one pass, the same
 * expressions as accumulate(). `out` may be x0 or x1. */
static void combine(ct_dist_dtype dt, ct_dist_op op, void *out, const void *x0, const void *x1,
                    size_t n) {
#define CT_RED3(T, U, FLOAT)                                                                \
    do {                                                                                   \
        T *o = out;                                                                        \
        const T *a = x0, *b = x1;                                                          \
        if (op == CT_DIST_SUM)                                                             \
            for (size_t i = 0; i < n; i++) o[i] = (T)((U)a[i] + (U)b[i]);                  \
        else if (op == CT_DIST_MAX)                                                        \
            for (size_t i = 0; i < n; i++)                                                 \
                o[i] = (a[i] > b[i] || (FLOAT && a[i] != a[i])) ? a[i] : b[i];             \
        else                                                                               \
            for (size_t i = 0; i < n; i++)                                                 \
                o[i] = (a[i] < b[i] || (FLOAT && a[i] != a[i])) ? a[i] : b[i];             \
    } while (0)
    switch (dt) {
    case CT_DIST_F32: CT_RED3(float, float, 1); break;
    case CT_DIST_F64: CT_RED3(double, double, 1); break;
    case CT_DIST_I32: CT_RED3(int32_t, uint32_t, 0); break;
    case CT_DIST_I64: CT_RED3(int64_t, uint64_t, 0); break;
    case CT_DIST_U32: CT_RED3(uint32_t, uint32_t, 0); break;
    case CT_DIST_U64: CT_RED3(uint64_t, uint64_t, 0); break;
    default: break;
    }
#undef CT_RED3
}

/* out = ((x[0] op x[1]) op x[2]) ... op x[n-1] (n >= 2, a dtype accumulated in its own type),
 * written straight into `out`, which may be x[0] but no other term. */
static void reduce_into(ct_dist_dtype dt, ct_dist_op op, void *out, const char *const *x,
                        int n, size_t count) {
    combine(dt, op, out, x[0], x[1], count);
    for (int p = 2; p < n; p++) accumulate(dt, op, out, x[p], count, 0);
}

/* out = acc, rounded once to float16 / bfloat16 where the dtype is one of them. */
static void finish(ct_dist_dtype dt, const void *acc, void *out, size_t n) {
    if (!narrow(dt)) {
        if (acc != out) memcpy(out, acc, n * ct_dist_dtype_size(dt));
        return;
    }
    const float *a = acc;
    uint16_t *y = out;
    for (size_t i = 0; i < n; i++)
        y[i] = dt == CT_DIST_F16 ? ct_rm_f32_to_f16(a[i]) : ct_rm_f32_to_bf16(a[i]);
}

static size_t acc_size(ct_dist_dtype dt) { return narrow(dt) ? sizeof(float) : ct_dist_dtype_size(dt); }

static void *scratch(size_t bytes, const char *what) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL)
        ct_set_error(CT_EOOM, "%s: could not allocate %zu bytes of host memory", what, bytes);
    return p;
}

/* The receive buffer of a reduction, kept from one collective to the next (they run one at a
 * time, under g.lock) up to CT_DIST_KEEP bytes: a fresh malloc of MiBs is a fresh mmap whose
 * pages fault on first touch, on every call (measured: a 64 MiB all-reduce of 2 processes
 * 1.5-2x slower). Larger ones are allocated per call (keep_free frees them). g_keep (above)
 * holds it; ct_dist_finalize frees it, unless the engine broke: MPI may still write into it. */

static void *keep_scratch(size_t bytes, const char *what) {
    if (bytes > CT_DIST_KEEP) return scratch(bytes, what);
    if (bytes == 0) bytes = 1;
    if (g_keep.cap < bytes) {
        void *p = scratch(bytes, what);
        if (p == NULL) return NULL;
        free(g_keep.p);
        g_keep.p = p;
        g_keep.cap = bytes;
    }
    return g_keep.p;
}

/* Release a keep_scratch buffer after a collective: only those allocated per call. */
static void keep_free(void *p) {
    if (p != g_keep.p) free(p);
}

/* Reduce-scatter of element blocks: process q's result, the reduction of every process's
 * `send[off[q] .. off[q] + len[q])`, lands at `out` of process q. Segment by segment: the
 * process receives its block's segment from every other process, sends theirs, and reduces
 * in process order: straight into `out` where the dtype allows it, `out` does not overlap
 * `send` and this process's segment has at least `direct_min` bytes, else through an
 * accumulator copied to `out`. */
static ct_status reduce_blocks(ct_wait *w, int tag, const char *send, char *out,
                               const size_t *off, const size_t *len, ct_dist_dtype dt,
                               ct_dist_op op, size_t direct_min) {
    int n = g.size, me = g.rank;
    size_t es = ct_dist_dtype_size(dt), seg = CT_DIST_SEG / es, most = 0;
    for (int q = 0; q < n; q++) most = len[q] > most ? len[q] : most;
    size_t mine = len[me] < seg ? len[me] : seg;
    char *tmp = keep_scratch((size_t)(n - 1) * mine * es, w->what);
    /* wide dtypes reduce straight into `out` (no accumulator, no copy), unless `out` overlaps
     * the send buffer (an all-reduce in place), whose terms it would overwrite */
    size_t send_bytes = (off[n - 1] + len[n - 1]) * es;
    int direct = n >= 2 && !narrow(dt) && mine * es >= direct_min &&
                 (out + len[me] * es <= send || send + send_bytes <= out);
    void *acc = direct ? NULL : scratch(mine * acc_size(dt), w->what);
    const char **xs = direct ? calloc((size_t)n, sizeof *xs) : NULL;
    ct_round r = {0};
    ct_status st = (tmp == NULL || (direct ? xs == NULL : acc == NULL))
                       ? ct_set_error(CT_EOOM, "%s: out of host memory", w->what)
                       : round_new(&r, 2 * n, w);
    size_t rounds = (most + seg - 1) / seg;
    for (size_t k = 0; st == CT_OK && k < rounds; k++) {
        size_t m = seg_len(len[me], k, seg);
        for (int i = 1; i < n && st == CT_OK && m; i++) {
            int q = (me - i + n) % n;
            st = post(&r, 1, tmp + (size_t)(q < me ? q : q - 1) * mine * es, m * es, q, tag,
                      w->what);
        }
        for (int i = 1; i < n && st == CT_OK; i++) {
            int q = (me + i) % n;
            size_t b = seg_len(len[q], k, seg);
            if (b) st = post(&r, 0, (char *)send + (off[q] + k * seg) * es, b * es, q, tag, w->what);
        }
        if (st == CT_OK) st = round_wait(w, &r);
        if (st != CT_OK || m == 0) continue;
        if (direct) {
            for (int p = 0; p < n; p++)
                xs[p] = p == me ? send + (off[me] + k * seg) * es
                                : tmp + (size_t)(p < me ? p : p - 1) * mine * es;
            reduce_into(dt, op, out + k * seg * es, xs, n, m);
            continue;
        }
        for (int p = 0; p < n; p++) {
            const char *x = p == me ? send + (off[me] + k * seg) * es
                                    : tmp + (size_t)(p < me ? p : p - 1) * mine * es;
            accumulate(dt, op, acc, x, m, p == 0);
        }
        finish(dt, acc, out + k * seg * es, m);
    }
    int failed = st != CT_OK && ct_dist_failure() != CT_DIST_FAIL_NONE;
    round_free(&r, failed);
    if (!failed) { /* after a failure MPI may still write tmp */
        keep_free(tmp);
    }
    free(acc);
    free(xs);
    return st;
}

/* ---- collectives -------------------------------------------------------------------- */

/* All-reduces of at most this many bytes gather every process's whole buffer (one round)
 * and reduce it locally; larger ones reduce-scatter, then all-gather (each process sends and
 * receives 2 (n - 1) / n of the buffer). Both reduce in process order: same results. */
#define CT_DIST_SMALL ((size_t)64 << 10)
/* A large all-reduce reduces its block straight into recv from this many bytes of block on,
 * below through an accumulator then copied: measured with benchmarks/bench_collectives.py
 * (2 processes, 2-core VM), the copy was faster for blocks up to 512 KiB (1 MiB all-reduce:
 * 86 us against 122 us) and slower from 1 MiB (64 MiB all-reduce: 19-38 ms against 5.6-15
 * ms). A reduce-scatter was faster reducing straight into recv at every size. */
#define CT_DIST_DIRECT_MIN ((size_t)1 << 20)

ct_status ct_dist_allreduce(const void *send, void *recv, size_t count, ct_dist_dtype dt,
                            ct_dist_op op, double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    CT_TRY(check_reduce(dt, op, "allreduce"));
    if (count > 0 && (send == NULL || recv == NULL))
        return ct_set_error(CT_EINVAL, "allreduce: NULL buffer");
    ct_wait w;
    CT_TRY(enter(&w, "allreduce", timeout_s, poll, ctx, CT_DIST_MAIN));
    int n = g.size;
    size_t es = ct_dist_dtype_size(dt), bytes = count * es;
    size_t *off = calloc((size_t)n, sizeof(size_t)), *len = calloc((size_t)n, sizeof(size_t));
    ct_status st = CT_OK;
    if (off == NULL || len == NULL) {
        st = ct_set_error(CT_EOOM, "allreduce: out of host memory");
    } else if (bytes <= CT_DIST_SMALL || n == 1) {
        int tag = next_tag(&w, TAG_ALLREDUCE_SMALL);
        /* every process's buffer lands in `all` (this one's copied), so wide dtypes reduce
         * straight into recv even in place */
        int direct = n >= 2 && !narrow(dt);
        char *all = keep_scratch((size_t)n * bytes, "allreduce");
        void *acc = direct ? NULL : scratch(count * acc_size(dt), "allreduce");
        const char **xs = direct ? calloc((size_t)n, sizeof *xs) : NULL;
        if (all == NULL || (direct ? xs == NULL : acc == NULL))
            st = ct_set_error(CT_EOOM, "allreduce: out of host memory");
        for (int q = 0; q < n; q++) {
            off[q] = (size_t)q * bytes;
            len[q] = bytes;
        }
        if (st == CT_OK) st = gather_blocks(&w, tag, send, all, off, len);
        if (st == CT_OK && direct) {
            for (int p = 0; p < n; p++) xs[p] = all + off[p];
            reduce_into(dt, op, recv, xs, n, count);
        } else if (st == CT_OK) {
            for (int p = 0; p < n; p++) accumulate(dt, op, acc, all + off[p], count, p == 0);
            finish(dt, acc, recv, count);
        }
        if (st == CT_OK || ct_dist_failure() == CT_DIST_FAIL_NONE) keep_free(all);
        free(acc);
        free(xs);
    } else {
        for (int q = 0; q < n; q++) {
            off[q] = count * (size_t)q / (size_t)n;
            len[q] = count * (size_t)(q + 1) / (size_t)n - off[q];
        }
        int tag = next_tag(&w, TAG_ALLREDUCE_RS);
        st = reduce_blocks(&w, tag, send, (char *)recv + off[g.rank] * es, off, len, dt, op,
                           CT_DIST_DIRECT_MIN);
        if (st == CT_OK) {
            for (int q = 0; q < n; q++) {
                off[q] *= es;
                len[q] *= es;
            }
            tag = next_tag(&w, TAG_ALLREDUCE_AG);
            st = gather_blocks(&w, tag, (char *)recv + off[g.rank], recv, off, len);
        }
    }
    free(off);
    free(len);
    leave(&w);
    return st;
}

ct_status ct_dist_allgather(const void *send, void *recv, size_t count, size_t elem_size,
                            double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    return ct_dist_allgather_on(CT_DIST_MAIN, send, recv, count, elem_size, timeout_s, poll, ctx);
}

ct_status ct_dist_allgather_on(ct_dist_channel ch, const void *send, void *recv, size_t count,
                               size_t elem_size, double timeout_s, ct_dist_poll_fn poll,
                               void *ctx) {
    if (elem_size == 0 || elem_size > 16 || (elem_size & (elem_size - 1)) != 0)
        return ct_set_error(CT_EINVAL, "allgather: elements of %zu bytes are not supported (1, "
                            "2, 4, 8 or 16)", elem_size);
    if (count > 0 && (send == NULL || recv == NULL))
        return ct_set_error(CT_EINVAL, "allgather: NULL buffer");
    ct_wait w;
    CT_TRY(enter(&w, ch == CT_DIST_CHECKPOINT ? "allgather (checkpoint channel)" : "allgather", timeout_s, poll, ctx, ch));
    int n = g.size;
    size_t bytes = count * elem_size;
    size_t *off = calloc((size_t)n, sizeof(size_t)), *len = calloc((size_t)n, sizeof(size_t));
    ct_status st;
    if (off == NULL || len == NULL) {
        st = ct_set_error(CT_EOOM, "allgather: out of host memory");
    } else {
        for (int q = 0; q < n; q++) {
            off[q] = (size_t)q * bytes;
            len[q] = bytes;
        }
        st = gather_blocks(&w, next_tag(&w, TAG_ALLGATHER), send, recv, off, len);
    }
    free(off);
    free(len);
    leave(&w);
    return st;
}

ct_status ct_dist_reduce_scatter(const void *send, void *recv, size_t count, ct_dist_dtype dt,
                                 ct_dist_op op, double timeout_s, ct_dist_poll_fn poll,
                                 void *ctx) {
    CT_TRY(check_reduce(dt, op, "reduce_scatter"));
    if (count > 0 && (send == NULL || recv == NULL))
        return ct_set_error(CT_EINVAL, "reduce_scatter: NULL buffer");
    ct_wait w;
    CT_TRY(enter(&w, "reduce_scatter", timeout_s, poll, ctx, CT_DIST_MAIN));
    int n = g.size;
    size_t *off = calloc((size_t)n, sizeof(size_t)), *len = calloc((size_t)n, sizeof(size_t));
    ct_status st;
    if (off == NULL || len == NULL) {
        st = ct_set_error(CT_EOOM, "reduce_scatter: out of host memory");
    } else {
        for (int q = 0; q < n; q++) {
            off[q] = (size_t)q * count;
            len[q] = count;
        }
        st = reduce_blocks(&w, next_tag(&w, TAG_REDUCE_SCATTER), send, recv, off, len, dt, op, 0);
    }
    free(off);
    free(len);
    leave(&w);
    return st;
}

/* Counts of one MPI_Ibcast (MPI counts are ints). */
#define CT_DIST_CHUNK ((size_t)1 << 30)

ct_status ct_dist_broadcast(void *buf, size_t count, size_t elem_size, int root,
                            double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    mpi_h type = NULL;
    size_t per = 1;
    CT_TRY(move_type(elem_size, &type, &per, "broadcast"));
    if (count > 0 && buf == NULL) return ct_set_error(CT_EINVAL, "broadcast: NULL buffer");
    ct_wait w;
    CT_TRY(enter(&w, "broadcast", timeout_s, poll, ctx, CT_DIST_MAIN));
    ct_status st = CT_OK;
    if (root < 0 || root >= g.size) {
        st = ct_set_error(CT_EINVAL, "broadcast: root %d is not a process (there are %d)", root,
                          g.size);
        leave(&w);
        return st;
    }
    size_t total = count * per;
    size_t off = 0;
    do {
        size_t n = total - off < CT_DIST_CHUNK ? total - off : CT_DIST_CHUNK;
        mpi_h req = NULL;
        int rc = g.api.Ibcast((char *)buf + off * (elem_size / per), (int)n, type, root, w.comm,
                              &req);
        st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Ibcast"))
                     : wait_request(&w, &req);
        off += n;
    } while (st == CT_OK && off < total);
    leave(&w);
    return st;
}

ct_status ct_dist_barrier(double timeout_s, ct_dist_poll_fn poll, void *ctx) {
    ct_wait w;
    CT_TRY(enter(&w, "barrier", timeout_s, poll, ctx, CT_DIST_MAIN));
    mpi_h req = NULL;
    int rc = g.api.Ibarrier(w.comm, &req);
    ct_status st = rc != 0 ? break_engine(CT_DIST_FAIL_MPI, mpi_fail(rc, "MPI_Ibarrier"))
                           : wait_request(&w, &req);
    leave(&w);
    return st;
}
