/*
 * check.h — the CHECK macro of the C tests: count a check, and on failure print
 * file:line and a printf-style message, then go on (main reports the totals).
 */
#ifndef CT_TEST_CHECK_H
#define CT_TEST_CHECK_H

#include <stdio.h>

static int failures = 0, checks = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        checks++;                                                          \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "%s:%d: FAIL: ", __FILE__, __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

#endif /* CT_TEST_CHECK_H */
