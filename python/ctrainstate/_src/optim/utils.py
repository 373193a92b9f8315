"""The implementation of :mod:`ctrainstate.optim.utils` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import numpy as np
from typing import Any, Callable

from ..ops import ops as _ops
from ..ops.node import op_node
from ..ops.move import _gather_along
from ..ops.slicing import _device_index, _whole
from ..base.tree_util import tree_leaves, tree_map
from .base import EmptyState, GradientTransformation, GradientTransformationExtraArgs
from ..numpy_lax import numpy as cnp
from ...nn.activation import _iota, log_softmax
from ..base.tree_util import register_pytree_node

__all__ = ["l2_loss", "squared_error", "softmax_cross_entropy",
           "softmax_cross_entropy_with_integer_labels", "global_norm", "incremental_update", "periodic_update",
           "stateless", "stateless_with_tree_map", "Params", "Updates", "OptState", "Schedule",
           "ScalarOrSchedule", "tree_map_params", "safe_norm", "safe_root_mean_squares"]

Params = Any
Updates = Any
OptState = Any
Schedule = Callable[[Any], Any]
ScalarOrSchedule = Any


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def squared_error(predictions, targets=None):
    """Elementwise ``(predictions - targets) ** 2`` (``targets=None``: zeros). As optax,
    ``targets`` must have the shape of ``predictions`` (no broadcasting: a ValueError)."""
    if targets is not None and _shape(predictions) != _shape(targets):
        raise ValueError(f"Shape mismatch: got {_shape(predictions)} and {_shape(targets)}.")
    d = predictions if targets is None else _ops.subtract(predictions, targets)
    return _ops.square(d)


def l2_loss(predictions, targets=None):
    """Elementwise ``0.5 * (predictions - targets) ** 2``, optax's convention (no mean);
    ``targets`` of another shape than ``predictions`` raise ValueError, as in optax."""
    return _ops.multiply(squared_error(predictions, targets), 0.5)


def softmax_cross_entropy(logits, labels, axis=-1, where=None):
    """``-sum(labels * log_softmax(logits), axis)`` (optax's, stable: the log-softmax is
    shifted by the maximum). ``labels`` are probabilities of ``logits``' shape; over a class
    dimension sharded on mesh axes the reductions end in all-reduces over them."""
    if where is not None:
        raise NotImplementedError("softmax_cross_entropy: where= is not supported; weight the "
                                  "per-example losses instead")
    return _ops.negative(_ops.sum(_ops.multiply(labels, log_softmax(logits, axis=axis)), axis=axis))


def softmax_cross_entropy_with_integer_labels(logits, labels, axis=-1, where=None):
    """optax's: ``log(sum(exp(z))) - z[label]`` with ``z = logits - max(logits)`` (the maximum
    a constant for the gradient). ``labels`` are integers of ``logits``' shape without the
    class ``axis``, each in ``[0, num_classes)`` (a label outside it raises ValueError: optax
    would silently return a meaningless loss). ``axis`` may be a tuple of class axes, as in
    optax: a label is then the row-major index into those axes taken in the order given.

    The label's logit is selected, not multiplied, so a ``-inf`` logit of another class (a
    masked-out class) leaves the loss finite, as optax's gather does. The labels are read to
    the host to be checked. Logits that every device holds whole (one device, or replicated)
    with one class axis: the label's logit is read on the devices (the labels placed there
    first unless they are an integer Array there already), and its cotangent is a one-hot of
    the labels made there. Otherwise (sharded logits, several class axes) it is selected by a
    one-hot laid out as the logits, which each device compares for its own block (the labels
    placed as the batch dimensions); over a sharded class dimension the sums end in
    all-reduces."""
    if where is not None:
        raise NotImplementedError("softmax_cross_entropy_with_integer_labels: where= is not "
                                  "supported; weight the per-example losses instead")
    logits = _ops._lift(logits)
    if logits.ndim == 0:
        raise ValueError("softmax_cross_entropy_with_integer_labels: logits need a class axis")
    if isinstance(axis, (tuple, list)):
        cls = tuple(_ops._axes(a, logits.ndim)[0] for a in axis)   # in the order given
        if not cls or len(set(cls)) != len(cls):
            raise ValueError(f"softmax_cross_entropy_with_integer_labels: axis {axis!r} needs "
                             f"one or more distinct class axes")
    else:
        cls = _ops._axes(axis, logits.ndim)
    z = _ops.subtract(logits, _ops.stop_gradient(_ops.max(logits, axis=cls, keepdims=True)))
    picked = _label_logits(labels, z, cls, axis)
    return _ops.subtract(_ops.log(_ops.sum(_ops.exp(z), axis=cls)), picked)


def _checked_labels(labels, z, cls, axis):
    """(the labels read to the host, checked against ``z``'s shape and class count, the batch
    dimensions of ``z``)."""
    lab = np.asarray(labels)
    if not np.issubdtype(lab.dtype, np.integer):
        raise TypeError(f"softmax_cross_entropy_with_integer_labels: labels must be integers, "
                        f"got {lab.dtype}")
    batch = tuple(d for d in range(z.ndim) if d not in cls)
    want = tuple(z.shape[d] for d in batch)
    if lab.shape != want:
        raise ValueError(f"softmax_cross_entropy_with_integer_labels: labels of shape "
                         f"{lab.shape} for logits of shape {z.shape} (axis {axis}); "
                         f"expected {want}")
    n = int(np.prod([z.shape[d] for d in cls]))
    if lab.size and (lab.min() < 0 or lab.max() >= n):
        raise ValueError(f"softmax_cross_entropy_with_integer_labels: labels must be in "
                         f"[0, {n}); got values in [{lab.min()}, {lab.max()}]")
    return lab, batch


def _label_logits_of(labels, z, cls, axis):
    """The labels checked and ``z``'s entry at each (batch dims): read on the devices where
    ``z`` is whole there and has one class axis, else selected by a one-hot laid out as ``z``
    and compared on the devices. Under jit, one op node: the labels are read at each call."""
    lab, batch = _checked_labels(labels, z, cls, axis)
    place = _ops._place_of(z)
    if len(cls) == 1 and _whole(z):
        c = cls[0]
        if not _device_index(labels, place):
            labels = _ops._lift_any(lab.astype(np.int32), place)
        elif labels.dtype != np.int32:
            labels = _ops._convert_to(labels, np.dtype(np.int32))
        at = tuple(1 if d == c else s for d, s in enumerate(z.shape))
        labels = _ops.reshape(labels, at)
        with _ops._no_tape():   # (the labels are in range: checked above)
            picked = _ops.reshape(_gather_along(z, labels, c, at), lab.shape)

        def vjp(g):   # g at each label's entry: a one-hot of the labels made on the devices
            iota = _iota(z.shape[c], np.int32, z)
            if c != z.ndim - 1:
                iota = _ops.reshape(iota, tuple(z.shape[c] if d == c else 1
                                                for d in range(z.ndim)))
            hit = _ops._convert_to(labels == iota, np.dtype(np.float32))
            return (_ops.multiply(hit, _ops.reshape(g, at)),)
        return _ops._record(picked, (z,), vjp)
    # a one-hot compared on the devices, laid out as z: the labels (placed as z's batch
    # dimensions) against each class position's flat index (a kept constant placed as z's
    # class dimensions), so each device compares its own block
    norm = _ops._axes_of(z)
    lab_at = [z.shape[d] if d in batch else 1 for d in range(z.ndim)]
    labd = _ops.device_put(np.ascontiguousarray(lab.astype(np.int32).reshape(lab_at)),
                           _ops._sharding_for(place, [norm[d] if d in batch else ()
                                                      for d in range(z.ndim)]))
    shapes = (tuple(z.shape), tuple(cls), tuple(tuple(norm[d]) for d in cls))
    flat = _ops.kept_constant(_CLASS_INDEX, 64, (id(place),) + shapes, place, _class_index,
                              shapes)
    return _ops.sum(_ops._keep(z, _ops._convert_to(labd == flat, np.dtype(np.float32))),
                    axis=cls)


_CLASS_INDEX: dict = {}


def _class_index(shapes, place):
    """The int32 row-major flat index over the class dimensions ``cls`` (in that order) of
    every class position of a ``shape`` Array, size 1 along its other dimensions, placed as
    the class dimensions' mesh axes ``cnorm``."""
    shape, cls, cnorm = shapes
    idx = np.zeros([shape[d] if d in cls else 1 for d in range(len(shape))], np.int64)
    stride = 1
    for d in reversed(cls):
        k = np.arange(shape[d], dtype=np.int64) * stride
        idx = idx + k.reshape([-1 if e == d else 1 for e in range(len(shape))])
        stride *= shape[d]
    norm = [()] * len(shape)
    for d, axes in zip(cls, cnorm):
        norm[d] = axes
    return _ops.device_put(idx.astype(np.int32), _ops._sharding_for(place, norm))


_label_logits = op_node("softmax_cross_entropy.label_logits")(_label_logits_of)


def global_norm(updates):
    """``sqrt`` of the sum of squares of every leaf: a 0-d Array (each global element counted
    once, whatever the sharding)."""
    leaves = [x for x in tree_leaves(updates) if x is not None]
    if not leaves:
        return _ops._lift(0.0)
    total = None
    for x in leaves:
        s = _ops.sum(_ops.square(x))
        total = s if total is None else _ops.add(total, s)
    return _ops.sqrt(total)


def incremental_update(new_tensors, old_tensors, step_size):
    """``step_size * new + (1 - step_size) * old`` leaf by leaf (Polyak averaging of target
    networks)."""
    a = float(step_size)
    return tree_map(lambda new, old: _ops.add(_ops.multiply(new, a), _ops.multiply(old, 1.0 - a)),
                    new_tensors, old_tensors)


def periodic_update(new_tensors, old_tensors, steps, update_period: int):
    """``new_tensors`` when ``steps`` is a multiple of ``update_period``, else ``old_tensors``."""
    return new_tensors if int(steps) % int(update_period) == 0 else old_tensors


def stateless(f: Callable) -> GradientTransformation:
    """A transform with no state: ``update(updates, state, params)`` returns
    ``f(updates, params)``."""
    def update(updates, state, params=None, **extra_args):
        return f(updates, params), EmptyState()
    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def stateless_with_tree_map(f: Callable) -> GradientTransformation:
    """Like :func:`stateless`, with ``f(g, p)`` applied leaf by leaf (``p`` is None without
    params)."""
    def apply(updates, params):
        if params is None:
            return tree_map(lambda g: f(g, None), updates)
        return tree_map(f, updates, params)
    return stateless(apply)


def safe_norm(x, min_norm, ord=None, axis=None, keepdims=False):  # noqa: A002 - optax's name
    """``maximum(linalg.norm(x, ord, axis), min_norm)`` with a gradient of 0, not NaN, where
    the norm is at most ``min_norm`` (optax.safe_norm: ``x`` is replaced by ones there before
    the norm that is differentiated)."""
    x = _ops._lift(x) if not hasattr(x, "_blocks") else x
    norm = cnp.linalg.norm(x, ord=ord, axis=axis, keepdims=True)
    x = _ops.where(norm <= min_norm, _ops.ones_like(x), x)
    masked_norm = cnp.linalg.norm(x, ord=ord, axis=axis, keepdims=keepdims)
    small = _ops.reshape(norm, masked_norm.shape) <= min_norm   # optax's squeeze
    return _ops.where(small, min_norm, masked_norm)


def safe_root_mean_squares(x, min_rms):
    """``maximum(sqrt(mean(x**2)), min_rms)`` with a gradient of 0, not NaN, where the RMS is
    at most ``min_rms`` (optax.safe_root_mean_squares)."""
    x = _ops._lift(x) if not hasattr(x, "_blocks") else x
    rms = _ops.sqrt(_ops.mean(_ops.square(x)))
    small = rms <= min_rms
    x = _ops.where(small, _ops.ones_like(x), x)
    return _ops.where(small, min_rms, _ops.sqrt(_ops.mean(_ops.square(x))))


class _ParamsPlaceholder:
    """Stands in for the params in ``tree_map_params``: a pytree node without children, so
    an ``init`` maps over it to itself (optax's _ParamsPlaceholder)."""


def _register_placeholder():
    register_pytree_node(_ParamsPlaceholder, lambda _: ((), None),
                         lambda aux, children: _ParamsPlaceholder())


_register_placeholder()


def tree_map_params(initable, f, state, /, *rest, transform_non_params=None, is_leaf=None):
    """Apply ``f`` to every params-shaped tree inside an optimizer state
    (optax.tree_map_params), e.g. to build the state's PartitionSpecs from the params'.
    ``initable``: a GradientTransformation (or any object with ``init``) or an init
    function; it is called on a placeholder to find where the params-shaped trees are.
    ``rest``: trees like the params given to ``f`` too; ``transform_non_params``: applied
    to the other leaves (counts, ...)."""
    placeholder = _ParamsPlaceholder()
    init = initable.init if hasattr(initable, "init") else initable
    if not callable(init):
        raise TypeError(f"tree_map_params: initable must be a GradientTransformation or an "
                        f"init function, got {type(initable).__name__}")
    with_placeholders = init(placeholder)

    def map_params(maybe_placeholder, value):
        if isinstance(maybe_placeholder, _ParamsPlaceholder):
            return tree_map(f, value, *rest, is_leaf=is_leaf)
        if transform_non_params is not None:
            return transform_non_params(value)
        return value
    return tree_map(map_params, with_placeholders, state,
                    is_leaf=lambda v: isinstance(v, _ParamsPlaceholder))


# 16-bit float logits: computed in float32, the loss rounded once to their dtype
# (ctrainstate._src.ops.ops's dtype policy)
softmax_cross_entropy = _ops._with_dtype_policy(softmax_cross_entropy, (0, 1))
softmax_cross_entropy_with_integer_labels = _ops._with_dtype_policy(
    softmax_cross_entropy_with_integer_labels, (0,))


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
