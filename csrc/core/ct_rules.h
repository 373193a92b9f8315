/*
 * ct_rules.h — logical-to-mesh axis rule resolution (Flax logical_to_mesh_axes).
 *
 * Pure C over an encoded input; the bindings convert Python objects once.
 *
 * Encoding
 *   A *dimension* of the logical spec is either a logical name (a Python str,
 *   given as UTF-8 bytes) that the rules may assign, or any other object
 *   (None, PartitionSpec.UNCONSTRAINED, a tuple, ...) that is kept verbatim and
 *   never assigned. A verbatim dimension still occupies the mesh axes among its
 *   pytree leaves (Flax's "already used" test looks at every leaf of the
 *   partial result).
 *   A *rule* is (key, mesh value). The key is a logical name or a non-string
 *   object; a non-string key can never assign a dimension. The mesh value is
 *   described by its leaves as *atoms*: small integers the caller interns
 *   (equal leaves get equal atoms). A None value has no leaves. The atom
 *   CT_RULES_ATOM_UNCONSTRAINED stands for PartitionSpec.UNCONSTRAINED.
 *
 * Semantics (Flax 0.12.3+, flax/linen/spmd.py)
 *   1. A logical name that occurs more than once is an error (non-name
 *      dimensions may repeat).
 *   2. Rules are walked in order; a rule whose key equals a name assigns that
 *      name's dimension iff the dimension is still unassigned and none of the
 *      rule's mesh atoms is used by any dimension (assigned or verbatim).
 *      UNCONSTRAINED atoms of the *new* value are ignored by that test, so
 *      (name, None) and (name, UNCONSTRAINED) always claim a free dimension,
 *      and a tuple value is all-or-nothing.
 *   3. Dimensions left unassigned are reported as CT_RULES_UNASSIGNED.
 */
#ifndef CT_RULES_H
#define CT_RULES_H

#include <stddef.h>
#include <stdint.h>

#include "ct_status.h"

/* Reserved atom: PartitionSpec.UNCONSTRAINED. Callers intern other leaves >= 1. */
#define CT_RULES_ATOM_UNCONSTRAINED 0

/* Per-dimension results of ct_rules_resolve (values >= 0 are rule indices). */
#define CT_RULES_UNASSIGNED (-1)
#define CT_RULES_VERBATIM (-2)

typedef struct {
    int is_name;            /* 1: a logical name; 0: kept verbatim */
    const char *name;       /* UTF-8 bytes of the name (is_name) */
    size_t name_len;
    const int32_t *atoms;   /* mesh-axis atoms occupied (verbatim dims only) */
    size_t natoms;
} ct_rules_dim;

typedef struct {
    int key_is_name;        /* 0: the key is not a string and never matches */
    const char *key;        /* UTF-8 bytes of the key (key_is_name) */
    size_t key_len;
    const int32_t *atoms;   /* leaves of the mesh value (None -> none) */
    size_t natoms;
} ct_rule;

/* Check step 1 only. On a duplicate: CT_EINVAL with the message
 * "Unsupported: Dimensions ('foo',) occur more than once in array names."
 * (the names quoted the way Python's repr quotes a str, first-seen order). */
ct_status ct_rules_check_duplicates(const ct_rules_dim *dims, size_t ndims);

/* Resolve `ndims` dimensions against `nrules` rules (steps 1-3). out[i] is a
 * rule index, CT_RULES_UNASSIGNED or CT_RULES_VERBATIM. On error `out` is left
 * untouched. */
ct_status ct_rules_resolve(const ct_rules_dim *dims, size_t ndims,
                           const ct_rule *rules, size_t nrules, int32_t *out);

/* Append a Python-style repr of a UTF-8 string to buf (always NUL-terminated,
 * truncated to cap). Returns the length the full repr would have. */
size_t ct_rules_repr_str(char *buf, size_t cap, const char *s, size_t len);

#endif /* CT_RULES_H */
