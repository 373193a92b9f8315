/*
 * ct_par.h — how many OpenMP threads a parallel region of the core or a CPU kernel gets.
 *
 * Every `#pragma omp parallel` in csrc/ takes its team size from here. libgomp's thread
 * pool does not survive fork(): in a child of a process whose pool was started, the first
 * region that asks for more than one thread waits for the parent's threads, which do not
 * exist there, and hangs. A region of one thread never touches the pool, so in such a child
 * (multiprocessing's fork start method, DataLoader workers, datasets.map(num_proc=...))
 * every region runs on one thread: slower, correct, never stuck. A child of a process that
 * never started the pool keeps all threads.
 */
#ifndef CT_PAR_H
#define CT_PAR_H

/* The most threads a region may use now: omp_get_max_threads(), or 1 in a forked child of
 * a process that had started the OpenMP pool. Records nothing. */
int ct_par_max_threads(void);

/* The team size for a region about to start with `n` threads (1 <= n <= ct_par_max_threads());
 * records that the pool is started when n > 1. Returns n. */
int ct_par_team(int n);

/* The team size for a region that goes parallel when `par` is true: ct_par_max_threads()
 * then, else 1 (so `num_threads(ct_par_threads(cond))` replaces `if (cond)`). */
int ct_par_threads(int par);

/* Whether this process is a forked child that runs every region on one thread. */
int ct_par_forked_single(void);

/* `for (int64_t var = 0; var < n; var++) { body }` on `nt` threads (an OpenMP parallel for,
 * static schedule) when nt > 1, else as a plain loop in this thread: libgomp makes and frees
 * a team for every region it enters, even a region of one thread (~150 ns, more than a
 * small array's whole kernel). The body must not hold a #pragma (it is a macro argument):
 * put such a body in a function. CT_PAR_FOR_SIMD: the same with `simd` on both loops. */
#include <stdint.h>
#define CT_PAR_FOR(nt, var, n, ...)                                                         \
    do {                                                                                   \
        const int ct_par_nt_ = (nt);                                                       \
        const int64_t ct_par_n_ = (n);                                                     \
        if (ct_par_nt_ > 1) {                                                              \
            _Pragma("omp parallel for schedule(static) num_threads(ct_par_nt_)")           \
            for (int64_t var = 0; var < ct_par_n_; var++) { __VA_ARGS__; }                 \
        } else {                                                                           \
            for (int64_t var = 0; var < ct_par_n_; var++) { __VA_ARGS__; }                 \
        }                                                                                  \
    } while (0)
#define CT_PAR_FOR_SIMD(nt, var, n, ...)                                                    \
    do {                                                                                   \
        const int ct_par_nt_ = (nt);                                                       \
        const int64_t ct_par_n_ = (n);                                                     \
        if (ct_par_nt_ > 1) {                                                              \
            _Pragma("omp parallel for simd schedule(static) num_threads(ct_par_nt_)")      \
            for (int64_t var = 0; var < ct_par_n_; var++) { __VA_ARGS__; }                 \
        } else {                                                                           \
            _Pragma("omp simd")                                                            \
            for (int64_t var = 0; var < ct_par_n_; var++) { __VA_ARGS__; }                 \
        }                                                                                  \
    } while (0)

#endif /* CT_PAR_H */
