/*
 * ct_status.c — thread-local error message storage (see ct_status.h).
 */
#include "ct_status.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char tl_msg[CT_ERRMSG_MAX];
static _Thread_local ct_status tl_status = CT_OK;

ct_status ct_set_error(ct_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_msg, sizeof tl_msg, fmt, ap);
    va_end(ap);
    tl_status = st;
    return st;
}

const char *ct_last_error(void) { return tl_msg; }

ct_status ct_last_status(void) { return tl_status; }

void ct_clear_error(void) {
    tl_msg[0] = '\0';
    tl_status = CT_OK;
}
