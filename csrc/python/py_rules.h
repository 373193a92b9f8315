/*
 * py_rules.h — registers the logical-axis-rules bindings on ctrainstate._C:
 * get_axis_rules, set_axis_rules, axis_rules (context manager type),
 * resolve_logical_axes and _rules_set_unconstrained.
 */
#ifndef CT_PY_RULES_H
#define CT_PY_RULES_H

#include <Python.h>

int ct_py_init_rules(PyObject *module);

#endif /* CT_PY_RULES_H */
