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

#endif /* CT_PAR_H */
