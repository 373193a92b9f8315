/*
 * ct_rules.c — logical-to-mesh axis rule resolution (see ct_rules.h).
 *
 * Sizes are tiny (a spec has a handful of dimensions, a rule table a few dozen
 * rows), so everything is a linear scan and nothing is allocated: the set of
 * used mesh atoms is recomputed from the partial result for every candidate
 * rule, which keeps the state to the `out` array alone.
 */
#include "ct_rules.h"

#include <stdio.h>
#include <string.h>

// ---------------------------------------------------------------------------
// helpers

static int same_name(const char *a, size_t alen, const char *b, size_t blen) {
    return alen == blen && (alen == 0 || memcmp(a, b, alen) == 0);
}

/* Is `atom` among the leaves already present in the partial result? */
static int atom_in_use(int32_t atom, const ct_rules_dim *dims, size_t ndims,
                       const ct_rule *rules, const int32_t *out) {
    for (size_t i = 0; i < ndims; i++) {
        const int32_t *atoms = NULL;
        size_t n = 0;
        if (out[i] >= 0) {
            atoms = rules[out[i]].atoms;
            n = rules[out[i]].natoms;
        } else if (out[i] == CT_RULES_VERBATIM) {
            atoms = dims[i].atoms;
            n = dims[i].natoms;
        }
        for (size_t k = 0; k < n; k++)
            if (atoms[k] == atom) return 1;
    }
    return 0;
}

/* Flax's _mesh_assignment_free: no leaf of the new value (ignoring
 * UNCONSTRAINED; None has no leaves) may already be used. */
static int assignment_free(const ct_rule *r, const ct_rules_dim *dims, size_t ndims,
                           const ct_rule *rules, const int32_t *out) {
    for (size_t k = 0; k < r->natoms; k++) {
        if (r->atoms[k] == CT_RULES_ATOM_UNCONSTRAINED) continue;
        if (atom_in_use(r->atoms[k], dims, ndims, rules, out)) return 0;
    }
    return 1;
}

// ---------------------------------------------------------------------------
// Python-style repr of a str (for error messages)

static void put(char *buf, size_t cap, size_t *n, char c) {
    if (*n + 1 < cap) buf[*n] = c;
    (*n)++;
}

size_t ct_rules_repr_str(char *buf, size_t cap, const char *s, size_t len) {
    /* Python picks single quotes unless the text has a ' and no ". */
    int has_sq = memchr(s, '\'', len) != NULL, has_dq = memchr(s, '"', len) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    static const char hex[] = "0123456789abcdef";
    size_t n = 0;
    put(buf, cap, &n, q);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        unsigned cp = 0;
        int esc = 0;
        if (c == '\\' || c == (unsigned char)q) {
            put(buf, cap, &n, '\\');
            put(buf, cap, &n, (char)c);
            continue;
        }
        if (c == '\n' || c == '\r' || c == '\t') {
            put(buf, cap, &n, '\\');
            put(buf, cap, &n, c == '\n' ? 'n' : c == '\r' ? 'r' : 't');
            continue;
        }
        if (c < 0x20 || c == 0x7f) {
            esc = 1;
            cp = c;
        } else if (c == 0xc2 && i + 1 < len) {
            /* U+0080..U+00A0 and U+00AD are not printable: Python writes \xhh. */
            unsigned char d = (unsigned char)s[i + 1];
            if ((d >= 0x80 && d <= 0xa0) || d == 0xad) {
                esc = 1;
                cp = d;
                i++;
            }
        }
        if (esc) {
            put(buf, cap, &n, '\\');
            put(buf, cap, &n, 'x');
            put(buf, cap, &n, hex[(cp >> 4) & 0xf]);
            put(buf, cap, &n, hex[cp & 0xf]);
        } else {
            put(buf, cap, &n, (char)c);
        }
    }
    put(buf, cap, &n, q);
    if (cap) buf[n < cap ? n : cap - 1] = '\0';
    return n;
}

// ---------------------------------------------------------------------------
// public API

ct_status ct_rules_check_duplicates(const ct_rules_dim *dims, size_t ndims) {
    char msg[CT_ERRMSG_MAX];
    size_t n = 0, ndup = 0;
    const char *head = "Unsupported: Dimensions (";
    if (dims == NULL && ndims > 0)
        return ct_set_error(CT_EINVAL, "ct_rules_check_duplicates: dims is NULL");
    for (size_t i = 0; i < ndims; i++) {
        if (!dims[i].is_name) continue;
        int first = 1, repeated = 0;
        for (size_t j = 0; j < ndims && first; j++) {
            if (j == i || !dims[j].is_name) continue;
            if (!same_name(dims[i].name, dims[i].name_len, dims[j].name, dims[j].name_len))
                continue;
            if (j < i) first = 0; else repeated = 1;
        }
        if (!first || !repeated) continue;
        if (ndup == 0) n = (size_t)snprintf(msg, sizeof msg, "%s", head);
        else if (n < sizeof msg) n += (size_t)snprintf(msg + n, sizeof msg - n, ", ");
        if (n < sizeof msg)
            n += ct_rules_repr_str(msg + n, sizeof msg - n, dims[i].name, dims[i].name_len);
        ndup++;
    }
    if (ndup == 0) return CT_OK;
    if (n < sizeof msg)
        snprintf(msg + n, sizeof msg - n, "%s) occur more than once in array names.",
                 ndup == 1 ? "," : "");
    return ct_set_error(CT_EINVAL, "%s", msg);
}

ct_status ct_rules_resolve(const ct_rules_dim *dims, size_t ndims,
                           const ct_rule *rules, size_t nrules, int32_t *out) {
    if ((ndims > 0 && (dims == NULL || out == NULL)) || (nrules > 0 && rules == NULL))
        return ct_set_error(CT_EINVAL, "ct_rules_resolve: NULL array with a nonzero count");
    if (ndims > (size_t)INT32_MAX || nrules > (size_t)INT32_MAX)
        return ct_set_error(CT_EINVAL, "ct_rules_resolve: too many dimensions or rules");
    CT_TRY(ct_rules_check_duplicates(dims, ndims));

    for (size_t i = 0; i < ndims; i++)
        out[i] = dims[i].is_name ? CT_RULES_UNASSIGNED : CT_RULES_VERBATIM;

    for (size_t r = 0; r < nrules; r++) {
        const ct_rule *rule = &rules[r];
        if (!rule->key_is_name) continue;  /* matches only kept-verbatim dims */
        size_t pos = ndims;
        for (size_t i = 0; i < ndims; i++) {
            if (dims[i].is_name &&
                same_name(rule->key, rule->key_len, dims[i].name, dims[i].name_len)) {
                pos = i;
                break;
            }
        }
        if (pos == ndims || out[pos] != CT_RULES_UNASSIGNED) continue;
        if (assignment_free(rule, dims, ndims, rules, out)) out[pos] = (int32_t)r;
    }
    return CT_OK;
}
