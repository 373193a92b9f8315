/*
 * py_optim.h — the parsing shared by the fused optimizer's bindings: py_optim.c (one step
 * from Python tuples, `_C.optim_step`) and py_optim_plan.c (a persistent step plan,
 * `_C.OptimPlan`, built from the same tuples once and stepped many times).
 */
#ifndef CT_PY_OPTIM_H
#define CT_PY_OPTIM_H

#include "ct_py.h"

#include "../core/ct_optim.h"

/* Buffers pinned for a call (ct_py_pin: neither freed nor deleted while it runs). */
typedef struct {
    ct_py_buffer **v;
    Py_ssize_t n, cap;
} ct_py_pin_list;

/* Pin b and remember it; -1 with MemoryError. */
int ct_py_pin_add(ct_py_pin_list *pl, ct_py_buffer *b);
/* Unpin every buffer and free the list. */
void ct_py_pin_release(ct_py_pin_list *pl);

/* [(kind, scalars)] into st (at most CT_OPT_MAX_STAGES); -1 with an exception. */
int ct_py_optim_parse_stages(PyObject *seq, ct_opt_stage *st, int *nst);

/* A block tuple (p, g, out, slots, active, leaf, counts[, geom]) into b, its buffers pinned
 * into pl; g_override (or NULL) replaces the tuple's g. *dev: the group's device so far.
 * -1 with an exception. */
int ct_py_optim_parse_block(PyObject *t, PyObject *g_override, ct_opt_block *b, int nslots,
                            ct_py_pin_list *pl, ct_device **dev);

#endif /* CT_PY_OPTIM_H */
