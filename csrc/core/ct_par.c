/*
 * ct_par.c — OpenMP team sizes that survive fork() (ct_par.h).
 */
#include "ct_par.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>

static atomic_int pool_started;  /* a region of > 1 thread ran in this process or a parent */
static atomic_int forked_single; /* this is a forked child of such a process */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void) {
    if (atomic_load_explicit(&pool_started, memory_order_relaxed))
        atomic_store_explicit(&forked_single, 1, memory_order_relaxed);
}

static void register_atfork(void) { (void)pthread_atfork(NULL, NULL, on_fork_child); }

int ct_par_max_threads(void) {
    if (atomic_load_explicit(&forked_single, memory_order_relaxed)) return 1;
    return omp_get_max_threads();
}

int ct_par_team(int n) {
    if (n <= 1) return 1;
    if (!atomic_load_explicit(&pool_started, memory_order_relaxed)) {
        /* the handler is in place before the first thread of the pool exists */
        pthread_once(&atfork_once, register_atfork);
        atomic_store_explicit(&pool_started, 1, memory_order_relaxed);
    }
    return n;
}

int ct_par_threads(int par) { return ct_par_team(par ? ct_par_max_threads() : 1); }

int ct_par_forked_single(void) {
    return atomic_load_explicit(&forked_single, memory_order_relaxed);
}
