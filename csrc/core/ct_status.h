/*
 * ct_status.h — status codes and the thread-local error message of the C core.
 *
 * Every fallible core function returns a ct_status. On failure it has already
 * called ct_set_error() exactly once, at the point of failure, with a message
 * that says what is wrong and where; callers propagate the status unchanged.
 * The bindings turn (status, message) into a Python exception:
 *   CT_EINVAL    -> ValueError
 *   CT_ETYPE     -> TypeError
 *   CT_EOOM      -> ctrainstate.ResourceExhaustedError
 *   CT_EDONATED  -> ctrainstate.DonatedBufferError
 *   CT_EDEVICE   -> RuntimeError
 * The core never aborts and never asserts on user input.
 */
#ifndef CT_STATUS_H
#define CT_STATUS_H

#include <stddef.h>

typedef enum {
    CT_OK = 0,
    CT_EINVAL = 1,   /* bad value: spec, rule, shape, mesh */
    CT_ETYPE = 2,    /* wrong kind of argument */
    CT_EOOM = 3,     /* resource exhausted on a device */
    CT_EDEVICE = 4,  /* device / runtime failure */
    CT_EDONATED = 5  /* buffer was donated or deleted */
} ct_status;

#define CT_ERRMSG_MAX 1024

/* Record the error for this thread and return `st` (so `return ct_set_error(...)` works). */
ct_status ct_set_error(ct_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* The message of the last error on this thread ("" if none). */
const char *ct_last_error(void);

/* The status of the last error on this thread (CT_OK if none). */
ct_status ct_last_status(void);

/* Forget the last error on this thread. */
void ct_clear_error(void);

/* Propagate a failing status from a call. */
#define CT_TRY(expr)                          \
    do {                                      \
        ct_status ct_try_st_ = (expr);        \
        if (ct_try_st_ != CT_OK) return ct_try_st_; \
    } while (0)

#endif /* CT_STATUS_H */
