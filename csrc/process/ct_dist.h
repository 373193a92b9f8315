/*
 * ct_dist.h — the process engine: collectives between the processes of a job, on host
 * buffers, carried by MPI.
 *
 * MPI is not linked: ct_dist_init loads the library with dlopen and resolves the few
 * functions and predefined handles it uses with dlsym, so that importing ctrainstate never
 * needs MPI. Supported: Open MPI (3.x, 4.x, 5.x: libmpi.so.40), whose handles (MPI_Comm,
 * MPI_Datatype, MPI_Op, MPI_Request) are pointers and whose predefined handles are the
 * addresses of global symbols (MPI_COMM_WORLD is &ompi_mpi_comm_world). MPICH and the
 * libraries on its ABI (Intel MPI, MVAPICH, Cray MPICH) use integer handles and are not
 * supported: loading one fails with an error that says so.
 *
 * Every collective is non-blocking MPI completed by polling MPI_Test(all) against a deadline
 * (ct_dist.c says which MPI calls carry which collective, and why all-reduce, all-gather and
 * reduce-scatter are written on point-to-point messages), so that a peer that died or never
 * arrives makes the others fail after `timeout_s` seconds instead of waiting forever (Open
 * MPI's blocking collectives never time out). MPI cannot cancel a started collective: after a
 * timeout, an MPI error or an interruption the engine is *broken*: the requests stay pending,
 * every later collective fails at once with the first failure's message, and
 * ct_dist_finalize skips MPI_Finalize (which would wait for the missing peer). The buffers of
 * the failed call must then stay allocated (MPI may still write them if anything progresses
 * MPI later); the bindings keep them alive.
 *
 * Reductions have one order: ((x_0 op x_1) op x_2) ... op x_{n-1} over processes 0..n-1,
 * whatever the size, so results are reproducible run to run and do not depend on MPI's
 * tuning.
 *
 * One engine per process, with two channels, each a duplicate of MPI_COMM_WORLD (so MPI code of
 * the user's, mpi4py, in the same process does not mix with ours): CT_DIST_MAIN carries every
 * collective, CT_DIST_CHECKPOINT the all-gathers of checkpoints committed in a background
 * thread. The collectives of one channel run one at a time (a mutex each; the caller needs no
 * lock, but every process must issue a channel's collectives in the same order, as MPI
 * requires); the two channels' collectives may run at once in two threads: their MPI calls
 * are serialised (MPI_THREAD_SERIALIZED is enough) and the waits interleave, so a background
 * checkpoint that waits for the other processes never holds up the training loop's
 * collectives, nor they it. Where MPI was initialised before ct_dist_init (mpi4py
 * imported first), the engine uses it and leaves MPI_Finalize to its owner. A forked child
 * of an initialised process cannot use MPI: its calls fail with CT_EDEVICE.
 */
#ifndef CT_DIST_H
#define CT_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "../core/ct_status.h"

/* Element types of the engine's reductions. float16 and bfloat16 are reduced in float32:
 * converted, reduced by MPI in float32, rounded once to the narrow type. */
typedef enum {
    CT_DIST_F32 = 0,
    CT_DIST_F64,
    CT_DIST_I32,
    CT_DIST_I64,
    CT_DIST_U32,
    CT_DIST_U64,
    CT_DIST_F16,
    CT_DIST_BF16,
    CT_DIST_NUM_DTYPES
} ct_dist_dtype;

typedef enum { CT_DIST_SUM = 0, CT_DIST_MAX, CT_DIST_MIN, CT_DIST_NUM_OPS } ct_dist_op;

/* The communicators (above): the training loop's, and a background checkpoint's. */
typedef enum { CT_DIST_MAIN = 0, CT_DIST_CHECKPOINT, CT_DIST_NUM_CHANNELS } ct_dist_channel;

/* Why the engine is broken (ct_dist_failure): none, a collective ran past its deadline, the
 * caller's poll callback asked to stop (Ctrl-C), or MPI returned an error. */
typedef enum {
    CT_DIST_FAIL_NONE = 0,
    CT_DIST_FAIL_TIMEOUT,
    CT_DIST_FAIL_INTERRUPTED,
    CT_DIST_FAIL_MPI
} ct_dist_failure_kind;

/* Called about every 100 ms while a collective waits, on the waiting thread; nonzero stops the
 * wait (the engine is then broken, failure CT_DIST_FAIL_INTERRUPTED). May be NULL. */
typedef int (*ct_dist_poll_fn)(void *ctx);

size_t ct_dist_dtype_size(ct_dist_dtype dt);
const char *ct_dist_dtype_name(ct_dist_dtype dt);
const char *ct_dist_op_name(ct_dist_op op);

/* Load MPI (`library`: a path or soname; NULL or "" searches libmpi.so.40 then libmpi.so),
 * initialise it (MPI_THREAD_SERIALIZED at least) unless already initialised, and duplicate
 * MPI_COMM_WORLD once per channel. `expect_rank` / `expect_size` (-1: unchecked) are what the launcher's
 * environment or the caller said; a world that differs fails with CT_EINVAL naming both (e.g.
 * a process started without mpirun, which MPI makes a world of one). Fails with CT_EINVAL if
 * the engine is initialised, or if this process finalised MPI before (MPI cannot restart). */
ct_status ct_dist_init(const char *library, int expect_rank, int expect_size);

/* Free the communicator and, if ct_dist_init initialised MPI, MPI_Finalize (skipped when the
 * engine is broken or in a forked child). The engine is then uninitialised. No-op when it is
 * not initialised. */
ct_status ct_dist_finalize(void);

int ct_dist_initialized(void);     /* 1 between a successful init and finalize */
int ct_dist_rank(void);            /* this process's rank; -1 when not initialised */
int ct_dist_size(void);            /* processes in the world; -1 when not initialised */
int ct_dist_owns_mpi(void);        /* whether ct_dist_init called MPI_Init_thread */
int ct_dist_thread_level(void);    /* MPI's provided thread level (0..3); -1 if none */
const char *ct_dist_library(void); /* the path dlopen loaded ("" when none) */
const char *ct_dist_version(void); /* MPI_Get_library_version's first line ("" when none) */
ct_dist_failure_kind ct_dist_failure(void); /* why the engine is broken, or NONE */

/* Collectives over every process, each waiting at most `timeout_s` seconds (> 0; INFINITY
 * waits for ever). `count` counts elements of `dt` (reductions) or `elem_size`-byte elements
 * (moves; elem_size 1, 2, 4, 8 or 16). `send` may equal `recv` for allreduce (in place).
 *   allreduce:       recv[i] = op over processes of send[i], i < count
 *   allgather:       recv[p * count + i] = send of process p [i]
 *   reduce_scatter:  recv[i] = op over processes of send[rank * count + i], i < count
 *                    (send holds count * size elements)
 *   broadcast:       buf of every process = buf of process `root`
 *   barrier:         returns once every process has entered it */
ct_status ct_dist_allreduce(const void *send, void *recv, size_t count, ct_dist_dtype dt,
                            ct_dist_op op, double timeout_s, ct_dist_poll_fn poll, void *ctx);
ct_status ct_dist_allgather(const void *send, void *recv, size_t count, size_t elem_size,
                            double timeout_s, ct_dist_poll_fn poll, void *ctx);
/* ct_dist_allgather on channel `ch` (the others run on CT_DIST_MAIN). */
ct_status ct_dist_allgather_on(ct_dist_channel ch, const void *send, void *recv, size_t count,
                               size_t elem_size, double timeout_s, ct_dist_poll_fn poll,
                               void *ctx);
ct_status ct_dist_reduce_scatter(const void *send, void *recv, size_t count, ct_dist_dtype dt,
                                 ct_dist_op op, double timeout_s, ct_dist_poll_fn poll,
                                 void *ctx);
ct_status ct_dist_broadcast(void *buf, size_t count, size_t elem_size, int root,
                            double timeout_s, ct_dist_poll_fn poll, void *ctx);
ct_status ct_dist_barrier(double timeout_s, ct_dist_poll_fn poll, void *ctx);

#endif /* CT_DIST_H */
