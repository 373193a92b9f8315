/*
 * test_rules.c — table-driven tests of csrc/core/ct_rules.c (no Python).
 *
 * Build and run (also under ASan/UBSan):
 *   make -C tests/c test            (or see tests/c/Makefile)
 *
 * Each case is written in a small text notation:
 *   names:  space-separated; "-" is None, "~" is UNCONSTRAINED, "(p,q)" a
 *           verbatim tuple entry, anything else a logical name.
 *   rules:  "key=value" separated by spaces; key "-" is a None key; value "-"
 *           is None, "~" UNCONSTRAINED, "a,b" a tuple of mesh axes.
 *   expect: one token per dimension in the same value notation ("-" None),
 *           or "ERR:<message>" for an expected error.
 * The expected columns are the upstream facts L1-L20 and derived D1-D15 of
 * shared/reference/flax_partitioning.md (Flax 0.12.3+ column).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/core/ct_rules.h"

#define MAXT 32
#define MAXA 8

// --- a tiny interner: mesh-axis string -> atom (>= 1); "~" -> UNCONSTRAINED

static char atom_names[64][32];
static int natom_names;

static int32_t intern(const char *s) {
    if (strcmp(s, "~") == 0) return CT_RULES_ATOM_UNCONSTRAINED;
    for (int i = 0; i < natom_names; i++)
        if (strcmp(atom_names[i], s) == 0) return i + 1;
    snprintf(atom_names[natom_names], sizeof atom_names[0], "%s", s);
    return ++natom_names;
}

/* Split `s` on spaces into tokens (modifies a private copy). */
static int split(const char *s, char *store, size_t cap, char **tok) {
    snprintf(store, cap, "%s", s);
    int n = 0;
    for (char *p = strtok(store, " "); p && n < MAXT; p = strtok(NULL, " ")) tok[n++] = p;
    return n;
}

/* Atoms of a value token "a,b" / "(a,b)" / "x" / "-" / "~". */
static size_t value_atoms(const char *v, int32_t *atoms) {
    char buf[128];
    size_t n = 0;
    if (strcmp(v, "-") == 0) return 0;
    snprintf(buf, sizeof buf, "%s", v[0] == '(' ? v + 1 : v);
    char *close = strchr(buf, ')');
    if (close) *close = '\0';
    for (char *p = strtok(buf, ","); p && n < MAXA; p = strtok(NULL, ",")) atoms[n++] = intern(p);
    return n;
}

typedef struct {
    const char *id, *names, *rules, *expect;
} tcase;

static const char *R1 = "foo=data bar=model baz=-";
static const char *R2 = "foo=model bar=- baz=data";
static const char *T5X =
    "batch=data vocab=model mlp=model heads=model joined_kv=- kv=- embed=model "
    "embed=data relpos_buckets=- length=- layers=- stack=-";

static const tcase cases[] = {
    {"L1", "foo bar", NULL, "data model"},
    {"L3", "foo bar", NULL, "model -"}, /* R2 */
    {"L4", "foo foo baz", NULL,
     "ERR:Unsupported: Dimensions ('foo',) occur more than once in array names."},
    {"L5", "foo bar baz", "foo=model bar=model baz=data", "model - data"},
    {"L6", "bar foo baz", "foo=model bar=model baz=data", "- model data"},
    {"L7", "baz bar foo", "foo=model bar=model baz=data", "data - model"},
    {"L8", "baz bar foo unassigned", "foo=model bar=model baz=data", "data - model -"},
    {"L9", "a b", "a=model,data b=data", "model,data -"},
    {"L10", "a b", "a=model,replica b=data", "model,replica data"},
    {"L11", "a b", "a=model,replica b=data,model", "model,replica -"},
    {"L12", "a b c", "a=model,replica b=model", "model,replica - -"},
    {"L13", "a b c", "", "- - -"},
    {"L14", "a b", "a=- a=model", "- -"},
    {"L15", "baz bar foo", "baz=data bar=- foo=model foo=data", "data - model"},
    {"L16", "baz ~ foo", "baz=data foo=model,emb", "data ~ model,emb"},
    {"L17", "foo ~ ~ - -", NULL, "data ~ ~ - -"}, /* R1 */
    {"L18", "foo bad bar baz", "foo=- bad=- bar=~ baz=~", "- - ~ ~"},
    {"L19", "batch length heads features", "batch=X features=X heads=Y batch=Z", "X - Y -"},
    {"L20", "batch length embed", NULL, "data - model"}, /* T5X */
    {"D1", "embed mlp", NULL, "data model"},             /* T5X */
    {"D2", "mlp embed", NULL, "model data"},             /* T5X */
    {"D3", "batch length heads kv", NULL, "data - model -"}, /* T5X */
    {"D4", "- foo", NULL, "- data"},                     /* R1 */
    {"D5", "", NULL, ""},                                /* R1 */
    {"D7", "a b", "a=model b=model,data", "model -"},
    {"D8", "foo bar", "bar=data foo=data", "- data"},
    {"D9", "foo", "foo=data,model", "data,model"},
    {"D10", "- - foo", NULL, "- - data"},                /* R1 */
    {"D14", "- x", "-=data x=model", "- model"},
    {"D15", "(p,q) foo", NULL, "(p,q) data"},            /* R1 */
    /* derived from the "already used" test over verbatim leaves */
    {"V1", "(p,q) foo", "foo=p foo=r", "(p,q) r"},
    {"V2", "foo bar foo2", "foo=~ bar=~ foo2=x", "~ ~ x"},
    {"V3", "a b c", "a=x,y b=y c=x", "x,y - -"},
    {"E2", "a b a b c", "", "ERR:Unsupported: Dimensions ('a', 'b') occur more than once in array names."},
    {"E3", "it's it's", "", "ERR:Unsupported: Dimensions (\"it's\",) occur more than once in array names."},
};

/* Which table a case uses when its rules column is NULL. */
static const char *default_rules(const char *id) {
    if (strcmp(id, "L3") == 0) return R2;
    if (strcmp(id, "L20") == 0 || strcmp(id, "D1") == 0 || strcmp(id, "D2") == 0 ||
        strcmp(id, "D3") == 0)
        return T5X;
    return R1;
}

static int run_case(const tcase *c) {
    char nstore[512], rstore[512], estore[512];
    char *ntok[MAXT], *rtok[MAXT], *etok[MAXT];
    char keybuf[MAXT][64];
    int32_t datoms[MAXT][MAXA], ratoms[MAXT][MAXA];
    const char *rvals[MAXT];
    ct_rules_dim dims[MAXT];
    ct_rule rules[MAXT];
    int32_t out[MAXT];

    int nd = split(c->names, nstore, sizeof nstore, ntok);
    int nr = split(c->rules ? c->rules : default_rules(c->id), rstore, sizeof rstore, rtok);
    memset(dims, 0, sizeof dims);
    memset(rules, 0, sizeof rules);
    for (int i = 0; i < nd; i++) {
        const char *t = ntok[i];
        if (strcmp(t, "-") == 0 || strcmp(t, "~") == 0 || t[0] == '(') {
            dims[i].is_name = 0;
            dims[i].natoms = value_atoms(t, datoms[i]);
            dims[i].atoms = datoms[i];
        } else {
            dims[i].is_name = 1;
            dims[i].name = t;
            dims[i].name_len = strlen(t);
        }
    }
    for (int r = 0; r < nr; r++) {
        char *eq = strchr(rtok[r], '=');
        if (!eq) { fprintf(stderr, "%s: bad rule %s\n", c->id, rtok[r]); return 1; }
        *eq = '\0';
        snprintf(keybuf[r], sizeof keybuf[r], "%s", rtok[r]);
        rvals[r] = eq + 1;
        rules[r].key_is_name = strcmp(keybuf[r], "-") != 0 && strcmp(keybuf[r], "~") != 0;
        rules[r].key = keybuf[r];
        rules[r].key_len = strlen(keybuf[r]);
        rules[r].natoms = value_atoms(rvals[r], ratoms[r]);
        rules[r].atoms = ratoms[r];
    }

    ct_clear_error();
    ct_status st = ct_rules_resolve(dims, (size_t)nd, rules, (size_t)nr, out);
    if (strncmp(c->expect, "ERR:", 4) == 0) {
        if (st != CT_EINVAL || strcmp(ct_last_error(), c->expect + 4) != 0) {
            fprintf(stderr, "FAIL %s: expected error \"%s\", got status %d \"%s\"\n", c->id,
                    c->expect + 4, st, ct_last_error());
            return 1;
        }
        return 0;
    }
    if (st != CT_OK) {
        fprintf(stderr, "FAIL %s: unexpected error %s\n", c->id, ct_last_error());
        return 1;
    }
    int ne = split(c->expect, estore, sizeof estore, etok);
    if (ne != nd) { fprintf(stderr, "FAIL %s: bad expectation\n", c->id); return 1; }
    for (int i = 0; i < nd; i++) {
        const char *got = out[i] >= 0 ? rvals[out[i]]
                          : out[i] == CT_RULES_VERBATIM ? ntok[i] : "-";
        if (strcmp(got, etok[i]) != 0) {
            fprintf(stderr, "FAIL %s: dim %d expected %s got %s\n", c->id, i, etok[i], got);
            return 1;
        }
    }
    return 0;
}

static int test_repr(void) {
    struct { const char *in, *want; } t[] = {
        {"foo", "'foo'"}, {"it's", "\"it's\""}, {"a'b\"c", "'a\\'b\"c'"},
        {"x\\y", "'x\\\\y'"}, {"t\tn\n", "'t\\tn\\n'"}, {"\x01", "'\\x01'"},
        {"\xc3\xa9", "'\xc3\xa9'"}, {"\xc2\xa0", "'\\xa0'"}, {"", "''"},
    };
    int fails = 0;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        char buf[64];
        ct_rules_repr_str(buf, sizeof buf, t[i].in, strlen(t[i].in));
        if (strcmp(buf, t[i].want) != 0) {
            fprintf(stderr, "FAIL repr %zu: want %s got %s\n", i, t[i].want, buf);
            fails++;
        }
    }
    /* truncation keeps the buffer terminated and reports the full length */
    char small[4];
    size_t full = ct_rules_repr_str(small, sizeof small, "abcdef", 6);
    if (full != 8 || strlen(small) != 3) { fprintf(stderr, "FAIL repr truncation\n"); fails++; }
    return fails;
}

static int test_bad_input(void) {
    int32_t out[1];
    ct_rules_dim d = {1, "a", 1, NULL, 0};
    int fails = 0;
    if (ct_rules_resolve(NULL, 1, NULL, 0, out) != CT_EINVAL) fails++;
    if (ct_rules_resolve(&d, 1, NULL, 2, out) != CT_EINVAL) fails++;
    if (ct_rules_resolve(&d, 1, NULL, 0, out) != CT_OK || out[0] != CT_RULES_UNASSIGNED) fails++;
    if (fails) fprintf(stderr, "FAIL bad-input checks\n");
    return fails;
}

int main(void) {
    int fails = 0;
    size_t n = sizeof cases / sizeof cases[0];
    for (size_t i = 0; i < n; i++) fails += run_case(&cases[i]);
    fails += test_repr();
    fails += test_bad_input();
    if (fails) {
        fprintf(stderr, "%d failure(s)\n", fails);
        return 1;
    }
    printf("test_rules: %zu resolution cases, repr and input checks passed\n", n);
    return 0;
}
