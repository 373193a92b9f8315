"""The implementation of :mod:`ctrainstate.testing` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as _np

from ..base import tree_util as _tu
from ..array.array import Array as _Array
from ..array.sharding import Mesh as _Mesh, NamedSharding as _NamedSharding
from ..array.sharding import PartitionSpec as _P, Sharding as _Sharding, get_mesh as _get_mesh
from ..nn.meta import Partitioned
from ..nn.spmd import logical_to_mesh_axes, LogicallyPartitioned

__all__ = ["assert_trees_all_close", "assert_trees_all_equal", "assert_shape",
           "assert_sharding", "assert_tree_shardings", "assert_mesh_invariant"]


def _host(x):
    return _np.asarray(x) if isinstance(x, _Array) or hasattr(x, "__array__") else x


def _path(p) -> str:
    return _tu.keystr(p, simple=True, separator="/") if p else ""


def _pairs(trees, who):
    """[(path, [leaf of each tree])] after checking that the trees have one structure."""
    if len(trees) < 2:
        raise ValueError(f"{who}: give at least two trees, got {len(trees)}")
    pl, td = _tu.tree_flatten_with_path(trees[0])
    others = []
    for i, t in enumerate(trees[1:], 1):
        try:
            others.append(_tu._flatten_up_to(td, t, check_aux=True))
        except ValueError as e:
            raise AssertionError(f"{who}: trees 0 and {i} differ in structure: {e}") from None
        if len(others[-1]) != len(pl) or _tu.tree_structure(t) != td:
            raise AssertionError(f"{who}: trees 0 and {i} differ in structure: "
                                 f"{td!r} against {_tu.tree_structure(t)!r}")
    return [(p, [x] + [o[k] for o in others]) for k, (p, x) in enumerate(pl)]


def _leaf_error(a, b, rtol, atol):
    """'' when leaves a and b agree (numerically when rtol/atol are given), else why not."""
    ha, hb = _host(a), _host(b)
    sa, sb = _np.shape(ha), _np.shape(hb)
    if sa != sb:
        return f"shapes {sa} and {sb}"
    if rtol is None:
        if isinstance(ha, _np.ndarray) or isinstance(hb, _np.ndarray):
            da, db = _np.asarray(ha).dtype, _np.asarray(hb).dtype
            if da != db:
                return f"dtypes {da} and {db}"
            x, y = _np.asarray(ha), _np.asarray(hb)
            same = (x == y) | ((x != x) & (y != y)) if x.dtype.kind in "fc" else x == y
            if not _np.all(same):
                bad = int(_np.size(same) - _np.count_nonzero(same))
                first = tuple(int(i) for i in _np.argwhere(~_np.asarray(same))[0])
                return (f"{bad} of {x.size} elements differ (first at index {first}: "
                        f"{x[first].item()!r} != {y[first].item()!r})")
            return ""
        return "" if ha == hb or (ha != ha and hb != hb) else f"{ha!r} != {hb!r}"
    try:
        x = _np.asarray(ha, _np.float64)
        y = _np.asarray(hb, _np.float64)
    except (TypeError, ValueError):
        return "" if ha == hb else f"{ha!r} != {hb!r} (not numbers)"
    with _np.errstate(all="ignore"):
        diff = _np.abs(x - y)
        ok = (diff <= atol + rtol * _np.abs(y)) | (x == y) | (_np.isnan(x) & _np.isnan(y))
    if _np.all(ok):
        return ""
    with _np.errstate(all="ignore"):
        rel = _np.where(y != 0, diff / _np.abs(y), _np.inf)
    bad = ~ok
    return (f"{int(_np.count_nonzero(bad))} of {x.size} elements differ beyond rtol={rtol}, "
            f"atol={atol}: max abs error {float(_np.max(diff[bad])):.6g}, max rel error "
            f"{float(_np.max(rel[bad])):.6g}")


def _compare(trees, rtol, atol, who):
    for p, leaves in _pairs(trees, who):
        for j in range(1, len(leaves)):
            err = _leaf_error(leaves[0], leaves[j], rtol, atol)
            if err:
                raise AssertionError(f"Trees 0 and {j} differ in leaves '{_path(p)}': {err}")


def assert_trees_all_close(*trees, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """Every tree has the first one's structure and leaves equal within
    ``|x - y| <= atol + rtol * |y|`` (NaN equals NaN). The message names the first leaf that
    differs, how many elements differ, and the largest absolute and relative errors.

    >>> assert_trees_all_close({'a': [1.0, 2.0]}, {'a': [1.0, 2.1]}, rtol=1e-3)
    Traceback (most recent call last):
    ...
    AssertionError: Trees 0 and 1 differ in leaves 'a/1': 1 of 1 elements differ beyond rtol=0.001, atol=0.0: max abs error 0.1, max rel error 0.047619
    """
    if rtol < 0 or atol < 0:
        raise ValueError(f"assert_trees_all_close: rtol and atol must be >= 0, got {rtol}, "
                         f"{atol}")
    _compare(trees, rtol, atol, "assert_trees_all_close")


def assert_trees_all_equal(*trees) -> None:
    """Every tree has the first one's structure, and its leaves the same shapes, dtypes and
    values (NaN equals NaN); Arrays are compared on the host.

    >>> import numpy as np
    >>> assert_trees_all_equal({'w': np.float32([1, 2])}, {'w': np.float32([1, 2])})
    """
    _compare(trees, None, None, "assert_trees_all_equal")


def _shape_ok(shape, want) -> bool:
    if Ellipsis in want:
        i = want.index(Ellipsis)
        head, tail = want[:i], want[i + 1:]
        return (len(shape) >= len(head) + len(tail) and _shape_ok(shape[:len(head)], head)
                and _shape_ok(shape[len(shape) - len(tail):], tail))
    return len(shape) == len(want) and all(w is None or w == s for s, w in zip(shape, want))


def assert_shape(inputs, expected_shapes) -> None:
    """``inputs`` (an array, or a list of arrays) have ``expected_shapes`` (one shape for all,
    or one per input); ``None`` in a shape matches any size and ``...`` any number of
    dimensions (chex.assert_shape).

    >>> import numpy as np
    >>> assert_shape([np.zeros((2, 3)), np.zeros((5, 3))], (None, 3))
    >>> assert_shape(np.zeros((2, 3)), (2, 4))
    Traceback (most recent call last):
    ...
    AssertionError: input 0 has shape (2, 3), expected (2, 4)
    """
    xs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    shapes = expected_shapes
    if isinstance(shapes, list):
        if len(shapes) != len(xs):
            raise AssertionError(f"{len(xs)} inputs but {len(shapes)} expected shapes")
    else:
        shapes = [shapes] * len(xs)
    for i, (x, want) in enumerate(zip(xs, shapes)):
        want = tuple(want)
        if not all(w is None or w is Ellipsis or isinstance(w, int) for w in want):
            raise TypeError(f"assert_shape: a shape holds ints, None and ..., got {want!r}")
        shape = tuple(_np.shape(x) if not hasattr(x, "shape") else x.shape)
        if not _shape_ok(shape, want):
            shown = "(" + ", ".join("..." if w is Ellipsis else repr(w) for w in want) + (
                ",)" if len(want) == 1 else ")")
            raise AssertionError(f"input {i} has shape {shape}, expected {shown}")


def _norm_spec(spec, ndim) -> tuple:
    """A spec as one entry per dimension: None or a tuple of mesh axis names."""
    out = []
    for e in tuple(spec)[:ndim]:
        if e is None:
            out.append(None)
        else:
            axes = (e,) if isinstance(e, str) else tuple(e)
            out.append(axes or None)
    return tuple(out + [None] * (ndim - len(out)))


def _want_sharding(x, spec_or_sharding, who):
    if isinstance(spec_or_sharding, _Sharding):
        return spec_or_sharding
    if isinstance(spec_or_sharding, (_P, tuple, list)) or spec_or_sharding is None:
        spec = spec_or_sharding if isinstance(spec_or_sharding, _P) else _P(
            *(spec_or_sharding or ()))
        mesh = _get_mesh()
        if mesh is None and isinstance(x.sharding, _NamedSharding):
            mesh = x.sharding.mesh
        if mesh is None:
            raise ValueError(f"{who}: a PartitionSpec needs a mesh: the Array is not on one "
                             f"and no mesh is active (use `with mesh:` or pass a Sharding)")
        return _NamedSharding(mesh, spec)
    raise TypeError(f"{who}: expected a PartitionSpec or a Sharding, got "
                    f"{type(spec_or_sharding).__name__}")


def assert_sharding(x, spec_or_sharding, *, path: str = "") -> None:
    """The Array ``x`` is placed by ``spec_or_sharding``: a ``Sharding``, or a
    ``PartitionSpec`` over the active mesh (else ``x``'s own mesh). Shardings that place
    every element on the same devices are equal here (``P('x')`` and ``P('x', None)``).

    >>> import numpy as np, ctrainstate as cts
    >>> mesh = cts.make_mesh((1,), ('x',))
    >>> a = cts.device_put(np.zeros((4, 2)), cts.NamedSharding(mesh, cts.P('x')))
    >>> assert_sharding(a, cts.P('x', None))
    """
    who = "assert_sharding"
    if not isinstance(x, _Array):
        raise AssertionError(f"{who}: {path + ' ' if path else ''}is a {type(x).__name__}, not "
                             f"a ctrainstate Array (it has no sharding)")
    want = _want_sharding(x, spec_or_sharding, who)
    got = x.sharding
    same = got == want
    if not same and isinstance(got, _NamedSharding) and isinstance(want, _NamedSharding):
        same = (got.mesh == want.mesh
                and _norm_spec(got.spec, x.ndim) == _norm_spec(want.spec, x.ndim))
    if not same:
        same = got.is_equivalent_to(want, x.ndim)
    if not same:
        where = f"'{path}' " if path else ""
        raise AssertionError(f"Array {where}of shape {x.shape} is sharded as {got}, expected "
                             f"{want}")


def _is_box(x) -> bool:
    return isinstance(x, Partitioned)


def _names_by_path(pl, axes):
    """The axis names of each (path, leaf) of ``pl`` looked up in ``axes`` by key path
    (``keystr``), or None when one is missing."""
    def is_names(x):
        return x is None or isinstance(x, _P) or (
            isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))
    ax, _ = _tu.tree_flatten_with_path(axes, is_leaf=is_names)
    by = {_tu.keystr(p): n for p, n in ax}
    out = []
    for p, _ in pl:
        k = _tu.keystr(p)
        if k not in by:
            return None
        out.append(by[k])
    return out


def assert_tree_shardings(tree, axes=None, rules=None, *, mesh: _Mesh | None = None) -> None:
    """Every Array of ``tree`` is sharded as its logical axis names resolve under ``rules``
    (default: the active ``axis_rules``) over ``mesh`` (default: the active mesh, else the
    leaf's own). The names come from ``tree``'s ``nn.LogicallyPartitioned`` /
    ``nn.Partitioned`` boxes (``init``'s output, boxed), or from ``axes``: a tree of
    ``PartitionSpec``s / name tuples with ``tree``'s structure (``get_axis_names`` of the
    ``params_axes`` collection). The message names the parameter path, its logical names,
    the sharding they resolve to and the one it has.

    >>> import numpy as np, ctrainstate as cts
    >>> mesh = cts.make_mesh((1,), ('model',))
    >>> w = cts.device_put(np.zeros((4, 2)), cts.NamedSharding(mesh, cts.P(None, 'model')))
    >>> assert_tree_shardings({'w': w}, {'w': cts.P('embed', 'mlp')}, (('mlp', 'model'),))
    """
    if axes is None:
        pl, _ = _tu.tree_flatten_with_path(tree, is_leaf=_is_box)
        items = []
        for p, leaf in pl:
            if isinstance(leaf, Partitioned):
                logical = isinstance(leaf, LogicallyPartitioned)
                items.append((p, leaf.value, tuple(leaf.names), logical,
                              getattr(leaf, "rules", None)))
        if not items:
            raise ValueError("assert_tree_shardings: the tree holds no nn.Partitioned boxes; "
                             "pass the logical axis names as `axes`")
    else:
        pl, td = _tu.tree_flatten_with_path(tree)
        try:
            names = _tu._flatten_up_to(td, axes)
        except ValueError as e:
            # the same paths in other containers (a FrozenDict of axes from get_axis_names
            # for a dict of params): paired by path
            names = _names_by_path(pl, axes)
            if names is None:
                raise ValueError(f"assert_tree_shardings: `axes` does not have the tree's "
                                 f"structure: {e}") from None
        items = [(p, v, None if n is None else tuple(n), True, None)
                 for (p, v), n in zip(pl, names)]
    for p, value, names, logical, box_rules in items:
        where = _path(p)
        if not isinstance(value, _Array):
            raise AssertionError(f"'{where}' is a {type(value).__name__}, not a ctrainstate "
                                 f"Array")
        if names is None:
            spec = _P()
        elif logical:
            spec = logical_to_mesh_axes(names, rules if rules is not None else box_rules)
        else:
            spec = _P(*names)
        m = mesh or _get_mesh() or (value.sharding.mesh if isinstance(
            value.sharding, _NamedSharding) else None)
        if m is None:
            raise ValueError(f"assert_tree_shardings: '{where}' is not on a mesh and none is "
                             f"active or given")
        try:
            assert_sharding(value, _NamedSharding(m, spec), path=where)
        except AssertionError:
            raise AssertionError(
                f"parameter '{where}' with logical axes {names} should be sharded as {spec} "
                f"(on mesh {dict(m.shape)}), but is {value.sharding}") from None


def assert_mesh_invariant(fn: Callable[[], Any], meshes: Sequence[_Mesh]) -> list:
    """Run ``fn()`` inside each mesh of ``meshes`` (``with mesh:``) and check that every run
    gives the same tree of values, bit for bit (ctrainstate's reductions have one order per
    shape, and random numbers depend on each element's global index only). Returns the runs'
    outputs.

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate import random
    >>> meshes = [cts.make_mesh((1,), ('x',)), cts.make_mesh((1, 1), ('x', 'y'))]
    >>> outs = assert_mesh_invariant(lambda: random.normal(random.PRNGKey(0), (4,)), meshes)
    >>> len(outs)
    2
    """
    meshes = list(meshes)
    if len(meshes) < 2:
        raise ValueError(f"assert_mesh_invariant: give at least two meshes, got {len(meshes)}")
    if not callable(fn):
        raise TypeError(f"assert_mesh_invariant: fn must be callable, got {type(fn).__name__}")
    outs = []
    for m in meshes:
        if not isinstance(m, _Mesh):
            raise TypeError(f"assert_mesh_invariant: expected Meshes, got {type(m).__name__}")
        with m:
            outs.append(fn())
    host = [_tu.tree_map(_host, o) for o in outs]
    for j in range(1, len(host)):
        try:
            assert_trees_all_equal(host[0], host[j])
        except AssertionError as e:
            raise AssertionError(f"results differ between mesh 0 {dict(meshes[0].shape)} and "
                                 f"mesh {j} {dict(meshes[j].shape)}: {e}") from None
    return outs


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
