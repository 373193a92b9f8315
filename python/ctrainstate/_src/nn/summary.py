"""The implementation of :mod:`ctrainstate.nn.summary` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from ..array.abstract import eval_shape
from ...core import FrozenDict
from .meta import AxisMetadata
from ..base.tree_util import tree_leaves
from ..base.hooks import upper as _upper

__all__ = ["tabulate"]


@dataclasses.dataclass
class _Call:
    index: int
    path: tuple
    module: Any
    method: str
    inputs: Any
    outputs: Any = None


class _Recorder:
    """Collects the module method calls of one ``init`` (see ``module._wrap_method``)."""

    def __init__(self):
        self.calls: list[_Call] = []

    def enter(self, module, method, args, kwargs):
        c = _Call(len(self.calls), tuple(module.path), module, method, _inputs(args, kwargs))
        self.calls.append(c)
        return c


def _inputs(args, kwargs):
    """Flax's ``_process_inputs``: one argument as itself, several as a tuple, keywords as a
    dict (after the positional ones)."""
    if args and kwargs:
        return (*args, kwargs)
    if args:
        return args[0] if len(args) == 1 else args
    if kwargs:
        return kwargs
    return ()


# --- rendering of values ----------------------------------------------------------------------

def _array_repr(x) -> str | None:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return None
    return f"{np.dtype(dtype).name}[{','.join(str(int(n)) for n in shape)}]"


def _value_lines(v, indent: int = 0) -> list[str]:
    """A value as the lines of Flax's yaml rendering: arrays as ``dtype[shape]``, mappings as
    ``key: value`` (nested ones indented), sequences as ``- item``."""
    pad = " " * indent
    if isinstance(v, AxisMetadata):
        # Flax: the boxed array, then its logical names (if any) as ``P(...)``
        names = getattr(v, "names", None)
        arr = _array_repr(v.value) or repr(v.value)
        return [pad + (f"{arr} P{tuple(names)}" if names is not None else arr)]
    if isinstance(v, (dict, FrozenDict)) or hasattr(v, "items") and callable(v.items):
        lines = []
        for k, x in v.items():
            sub = _value_lines(x, indent + 2)
            if len(sub) == 1 and not isinstance(x, (dict, list, tuple, FrozenDict)):
                lines.append(f"{pad}{k}: {sub[0].strip()}")
            elif not sub:
                lines.append(f"{pad}{k}: {{}}")
            else:
                lines.append(f"{pad}{k}:")
                lines.extend(sub)
        return lines
    if isinstance(v, (list, tuple)):
        lines = []
        for x in v:
            sub = _value_lines(x, indent + 2)
            if not sub:
                lines.append(f"{pad}- []")
            else:
                lines.append(f"{pad}- {sub[0].strip()}")
                lines.extend(sub[1:])
        return lines
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _value_lines({f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, indent)
    r = _array_repr(v)
    return [pad + (r if r is not None else repr(v))]


def _leaves(tree):
    return tree_leaves(tree)


def _size_and_bytes(tree) -> tuple[int, int]:
    size = nbytes = 0
    for x in _leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            n = int(np.prod(x.shape, dtype=np.int64))
            size += n
            nbytes += n * np.dtype(x.dtype).itemsize
    return size, nbytes


def _bytes_repr(num_bytes: int) -> str:
    """Flax's units: GB / MB / KB with one decimal above 1e9 / 1e6 / 1e3 bytes, else B."""
    if num_bytes > 1e9:
        return f"{num_bytes / 1e9:,.1f} GB"
    if num_bytes > 1e6:
        return f"{num_bytes / 1e6:,.1f} MB"
    if num_bytes > 1e3:
        return f"{num_bytes / 1e3:,.1f} KB"
    return f"{num_bytes:,} B"


def _size_repr(size: int, num_bytes: int) -> str:
    return f"{size:,} ({_bytes_repr(num_bytes)})" if size else ""


# --- the table ---------------------------------------------------------------------------------

def _path_vars(path, variables):
    out = {}
    for col, tree in variables.items():
        node = tree
        for name in path:
            if not hasattr(node, "keys") or name not in node:
                node = None
                break
            node = node[name]
        if node is not None:
            out[col] = dict(node) if hasattr(node, "keys") else node
    return out


def _own_vars(path, variables, all_paths):
    """The variables of the module at ``path`` without its submodules' (Flax's
    ``_get_module_variables``)."""
    own = _path_vars(path, variables)
    for col in own:
        if hasattr(own[col], "keys"):
            own[col] = {k: v for k, v in own[col].items() if path + (k,) not in all_paths}
    return own


def _rows(calls, variables, depth, show_repeated):
    all_paths = {c.path for c in calls}
    visited = set()
    rows = []
    for c in sorted(calls, key=lambda c: c.index):
        if c.path in visited or not hasattr(c.module, c.method):
            if not show_repeated:
                continue
            own = counted = {}
        elif depth is not None:
            if len(c.path) > depth:
                continue
            own = _own_vars(c.path, variables, all_paths)
            counted = _path_vars(c.path, variables) if len(c.path) == depth else own
        else:
            own = counted = _own_vars(c.path, variables, all_paths)
        visited.add(c.path)
        rows.append((c, own, counted))
    return rows


_RIGHT = "\x00"   # a cell that starts with this is right-justified (the footer's "Total")


def _fit(text, width):
    return text[1:].rjust(width) if text.startswith(_RIGHT) else text.ljust(width)


def _draw(title, header, body, footer, caption) -> str:
    """A boxed table: ``header`` and ``footer`` one cell per column, ``body`` rows of cells,
    each cell a string of one or more lines."""
    ncol = len(header)
    cells = [header] + body + [footer]
    widths = [max(len(line.lstrip(_RIGHT)) for row in cells for line in row[i].split("\n"))
              for i in range(ncol)]
    widths = [max(w, 1) for w in widths]

    def rule(left, mid, right, fill):
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def lines_of(row, bar):
        split = [cell.split("\n") for cell in row]
        height = max(len(s) for s in split)
        out = []
        for i in range(height):
            parts = [_fit(s[i] if i < len(s) else "", w) for s, w in zip(split, widths)]
            out.append(bar + bar.join(f" {p} " for p in parts) + bar)
        return out

    total = sum(widths) + 3 * ncol + 1
    out = [title.center(total).rstrip(), rule("┏", "┳", "┓", "━")]
    out += lines_of(header, "┃")
    out.append(rule("┡", "╇", "┩", "━"))
    for i, row in enumerate(body):
        if i:
            out.append(rule("├", "┼", "┤", "─"))
        out += lines_of(row, "│")
    out.append(rule("├", "┼", "┤", "─"))
    out += lines_of(footer, "│")
    out.append(rule("└", "┴", "┘", "─"))
    out += ["", caption.center(total).rstrip()]
    return "\n" + "\n".join(out) + "\n"


def _cell(v) -> str:
    """An inputs / outputs cell: empty for no value (``()`` or ``None``); quotes dropped, as
    Flax's yaml rendering drops them."""
    if v is None or (isinstance(v, tuple) and not v):
        return ""
    return "\n".join(_value_lines(v)).replace("'", "")


def _render(module, collections, rows) -> str:
    header = ["path", "module", "inputs", "outputs"] + list(collections)
    body = []
    totals = {col: [0, 0] for col in collections}
    for c, own, counted in rows:
        cols = []
        for col in collections:
            size, nbytes = _size_and_bytes(counted.get(col, {}))
            totals[col][0] += size
            totals[col][1] += nbytes
            text = ""
            if col in own:
                listed = "\n".join(_value_lines(own[col])).replace("'", "")
                if listed:
                    text = listed + "\n\n"
            cols.append(text + _size_repr(size, nbytes))
        method = "" if c.method in ("__call__", "<lambda>") else f" ({c.method})"
        body.append(["/".join(c.path), type(c.module).__name__ + method,
                     _cell(c.inputs),
                     _cell(c.outputs)]
                    + cols)
    footer = ["", "", "", _RIGHT + "Total"] + [_size_repr(*totals[col]) for col in collections]
    all_size = sum(t[0] for t in totals.values())
    all_bytes = sum(t[1] for t in totals.values())
    caption = f"Total Parameters: {_size_repr(all_size, all_bytes)}"
    return _draw(f"{type(module).__name__} Summary", header, body, footer, caption)


def _check_unsupported(console_kwargs, table_kwargs, column_kwargs, compute_flops,
                       compute_vjp_flops):
    if compute_flops or compute_vjp_flops:
        raise NotImplementedError("tabulate: compute_flops / compute_vjp_flops need XLA's cost "
                                  "analysis, which ctrainstate does not have")
    for name, v in (("console_kwargs", console_kwargs), ("table_kwargs", table_kwargs),
                    ("column_kwargs", column_kwargs)):
        if v:
            raise NotImplementedError(f"tabulate: {name} configures Flax's rich console; the "
                                      f"plain-text table here takes none (got {dict(v)!r})")


def tabulate(module, rngs, depth=None, show_repeated=False, mutable=None, console_kwargs=None,
             table_kwargs=None, column_kwargs=None, compute_flops=False,
             compute_vjp_flops=False, **kwargs):
    """``flax.linen.tabulate``: a function of ``module.init``'s arguments (after ``rngs``)
    that returns the summary table as a string (see the module docstring).

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))
    >>> text = nn.tabulate(MLP(), random.PRNGKey(0))(np.ones((16, 9), np.float32))
    >>> text.strip().splitlines()[-1].strip()
    'Total Parameters: 50 (200 B)'
    """
    _module = _upper('nn.module')
    _check_unsupported(console_kwargs, table_kwargs, column_kwargs, compute_flops,
                       compute_vjp_flops)
    if depth is not None and (not isinstance(depth, (int, np.integer)) or depth < 0):
        raise ValueError(f"tabulate: depth must be None or an int >= 0, got {depth!r}")
    if mutable is not None:
        kwargs["mutable"] = mutable

    def table_fn(*args, **fn_kwargs):
        def run(abstract):
            rec = _Recorder()
            with _module._recording(rec):
                if abstract:
                    v = eval_shape(lambda: module.init(rngs, *args, **fn_kwargs, **kwargs))
                else:
                    v = module.init(rngs, *args, **fn_kwargs, **kwargs)
            return rec, v
        try:
            rec, variables = run(True)
        except Exception:   # noqa: BLE001 - an op without an abstract rule: run init for real
            rec, variables = run(False)
        variables = {k: v for k, v in dict(variables).items()}
        rows = _rows(rec.calls, variables, depth, show_repeated)
        # 'params' first, then the other collections by name (Flax's order is a set's)
        cols = sorted(variables, key=lambda c: (c != "params", c))
        return _render(module, tuple(cols), rows)
    return table_fn


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
