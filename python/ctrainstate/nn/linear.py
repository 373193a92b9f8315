"""Layers: Dense, DenseGeneral, Einsum, Embed (mirror of ``flax.linen``; LayerNorm and RMSNorm are in
:mod:`ctrainstate.nn.normalization`).

Parameter names, shapes, default initializers and the order in which keys are
drawn follow Flax, so the same key gives the same parameters.
``DenseGeneral(kernel_axes=...)`` / ``Embed(embedding_axes=...)`` declare
logical axes with ``param_with_axes`` (t5x style): under ``with mesh,
axis_rules(rules):`` those parameters are born sharded.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .._src.base import dtypes as _dtypes
from .._src.numpy_lax import numpy as cnp
from .._src.ops.move import _int
from .._src.ops.node import op_node
from .._src.array.array import Array, device_put
from . import initializers
from .dtypes import _check_dtype, promote_dtype
from .._src.nn.module import Module, compact
from .._src.array.abstract import ShapeDtypeStruct
from .._src.base.precision import resolve_precision
from .._src.nn.module import _accepts_out_sharding, sharded_initializer
from .._src.nn.spmd import _replicate_uneven
from ..nn.stochastic import merge_param
from ..partitioning import param_with_axes
from .._src.array.sharding import NamedSharding, PartitionSpec

default_kernel_init = initializers.lecun_normal()

__all__ = ["Dense", "DenseGeneral", "Einsum", "Embed", "LayerNorm"]


def _in_features(x) -> int:
    if type(x) is Array:
        return x.shape[-1]
    return int(np.shape(x)[-1])


def _precision(module):
    """``module.precision``, checked now so a bad value names the module (the product
    resolves it again: ``None`` is the thread's default, see :mod:`ctrainstate._src.base.precision`)."""
    resolve_precision(module.precision, f"{type(module).__name__}(precision=...)")
    return module.precision


class Dense(Module):
    """``y = x @ kernel + bias`` with ``kernel`` of shape ``(in, features)``.

    ``dtype`` (Flax's): the computation's dtype -- inputs, kernel and bias are cast to it
    (``promote_dtype``) and the output has it, e.g. ``dtype=jnp.bfloat16`` for mixed
    precision with float32 parameters (``param_dtype``); ``None`` promotes the operands'
    dtypes. 16-bit products accumulate in float32 and round once (see
    :mod:`ctrainstate._src.ops.ops`).

    ``precision`` is the product's (``jnp.matmul``'s ``precision=``, Flax's field): ``None``
    (the thread's default: float32 unless ``default_matmul_precision`` says otherwise),
    ``'tensorfloat32'`` / ``Precision.HIGH``, ``'bfloat16'``, ``'float32'`` / ``HIGHEST``...;
    the gradient's products use it too.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> v = nn.Dense(3).init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    >>> v['params']['kernel'].shape, v['params']['bias'].shape
    ((2, 3), (3,))
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = np.float32
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, inputs):
        # (the fields' checks, skipped for the values that always pass them: a float32 layer
        # with the default precision and an int width, the common case at every apply)
        if self.dtype is not None or self.param_dtype is not np.float32:
            _check_dtype(self)
        precision = self.precision
        if precision is not None:
            precision = _precision(self)
        features = self.features
        if type(features) is not int or features < 0:
            if isinstance(features, (tuple, list)):
                raise TypeError(f"Dense: features must be an int, got {features!r} (several "
                                f"output dimensions: DenseGeneral)")
            (features,) = _features(features, "Dense")
        kernel = self.param("kernel", self.kernel_init, (_in_features(inputs), features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (features,), self.param_dtype)
                if self.use_bias else None)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = cnp.matmul(inputs, kernel, precision=precision)
        if bias is not None:
            y = y + bias
        return y


def _features(features, who):
    """``features`` as a tuple of non-negative ints (an int or a sequence of them; numpy
    integers too, bools and floats refused as Flax's shape checks refuse them)."""
    feats = (features,) if not isinstance(features, (tuple, list)) else tuple(features)
    out = tuple(_int(f, who, "features") for f in feats)
    if any(f < 0 for f in out):
        raise ValueError(f"{who}: features must be non-negative, got {features!r}")
    return out


def _batch_dims(batch_dims, ndim):
    """Flax's batch_dims check: the leading axes 0 .. k-1, each once, all inside the input."""
    dims = (batch_dims,) if not isinstance(batch_dims, (tuple, list)) else tuple(batch_dims)
    dims = tuple(_int(d, "DenseGeneral", "batch_dims") for d in dims)
    if dims and sorted(dims) != list(range(len(dims))):
        raise ValueError(f"DenseGeneral: batch_dims {batch_dims!r} must be consecutive leading "
                         f"dimensions starting from 0 (each once)")
    if len(dims) > ndim:
        raise ValueError(f"DenseGeneral: batch_dims {batch_dims!r} name more axes than the "
                         f"input's rank {ndim}")
    return tuple(sorted(dims))


def _canon(axes, ndim):
    """Input axes (an int or a sequence of ints, negatives from the end) in [0, ndim),
    sorted as Flax's ``_normalize_axes`` sorts them: the kernel's input axes follow the
    input's order whatever order ``axis`` names them in (``axis=(-1, -2)`` is ``(-2, -1)``)."""
    axes = (axes,) if not isinstance(axes, (tuple, list)) else tuple(axes)
    out = []
    for a in axes:
        a = _int(a, "DenseGeneral", "axis")
        if not -ndim <= a < ndim:
            raise ValueError(f"DenseGeneral: axis {a} is out of range for an input of rank "
                             f"{ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"DenseGeneral: repeated axis in {axes!r}")
    return tuple(sorted(out))


class DenseGeneral(Module):
    """Dense over several input axes and/or producing several feature axes (Flax's
    ``DenseGeneral``).

    ``axis``: input axes contracted (default the last); ``features``: an int or a
    tuple of output sizes. As in Flax, the kernel (and bias) initializer sees the
    flattened 2-d shape ``(prod(in), prod(features))``. ``kernel_axes``: logical
    axis names of the kernel (``len(axis) + len(features)`` names), declared with
    ``param_with_axes`` as in t5x's ``DenseGeneral`` (the bias takes the feature
    names). Multi-axis kernels are generated on the host and scattered; 2-d ones
    are generated in place on each device. ``precision`` and ``dtype``: as
    :class:`Dense`'s.

    ``batch_dims``: leading input axes ``(0, ..., k-1)`` with a kernel (and bias) of their
    own per index, as Flax's: the kernel is ``batch_shape + in_shape + features``, the bias
    ``batch_shape + features``, both initialised on Flax's flattened shapes
    ``(prod(batch) * prod(in), prod(features))`` and ``(prod(batch) * prod(features),)``;
    the output is ``batch_shape + other input axes + features``. With ``kernel_axes`` the
    names cover the kernel's axes in that order (the bias takes the batch and feature names).
    """

    features: Any
    axis: Any = -1
    batch_dims: Any = ()
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = np.float32
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()
    precision: Any = None
    kernel_axes: tuple = ()

    @compact
    def __call__(self, inputs):
        _check_dtype(self)
        precision = _precision(self)
        feats = _features(self.features, "DenseGeneral")
        nd = len(np.shape(inputs))
        bdims = _batch_dims(self.batch_dims, nd)
        axes = _canon(self.axis, nd)
        if set(axes) & set(bdims):
            raise ValueError(f"DenseGeneral: axis {self.axis!r} contracts batch dimension(s) "
                             f"{sorted(set(axes) & set(bdims))} of batch_dims "
                             f"{self.batch_dims!r}")
        # the parameters (Flax's shapes; initialisers see the flattened 2-d / 1-d forms)
        nb = len(bdims)
        batch_shape = tuple(np.shape(inputs)[:nb])
        in_shape = tuple(np.shape(inputs)[a] for a in axes)
        kshape = batch_shape + in_shape + feats
        flat = (math.prod(batch_shape) * math.prod(in_shape), math.prod(feats))
        names = tuple(self.kernel_axes)
        kernel = self._declare("kernel", _flat_init(self.kernel_init, flat), kshape, names or None)
        bias = None
        if self.use_bias:
            bias = self._declare("bias", _flat_init(self.bias_init,
                                                    (math.prod(batch_shape) * flat[1],)),
                                 batch_shape + feats,
                                 (names[:nb] + names[nb + len(axes):]) or None)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if bdims:
            return self._batched(inputs, kernel, bias, feats, nb, axes, precision)
        x = inputs
        keep = [d for d in range(nd) if d not in axes]
        if axes != tuple(range(nd - len(axes), nd)):
            x = cnp.transpose(x, keep + list(axes))
        batch_shape = tuple(np.shape(inputs)[d] for d in keep)
        x2 = cnp.reshape(x, batch_shape + (flat[0],)) if len(axes) != 1 else x
        k2 = cnp.reshape(kernel, flat) if kshape != flat else kernel
        y = cnp.matmul(x2, k2, precision=precision)
        if len(feats) != 1:
            y = cnp.reshape(y, batch_shape + feats)
        if bias is not None:
            y = y + bias
        return y

    @staticmethod
    def _batched(inputs, kernel, bias, feats, nb, axes, precision):
        """The batch_dims product: Flax's dot_general with batch dimensions, as an einsum."""
        shape = tuple(np.shape(inputs))
        nd = len(shape)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        if nd + len(feats) > len(letters):
            raise ValueError(f"DenseGeneral: rank {nd} input with {len(feats)} feature axes "
                             f"is more axes than this einsum can name ({len(letters)})")
        sx = letters[:nd]
        sf = letters[nd:nd + len(feats)]
        keep = [d for d in range(nb, nd) if d not in axes]
        sk = sx[:nb] + "".join(sx[a] for a in axes) + sf
        so = sx[:nb] + "".join(sx[d] for d in keep) + sf
        y = cnp.einsum(f"{sx},{sk}->{so}", inputs, kernel, precision=precision)
        if bias is not None:
            # Flax: the bias broadcast over the kept input axes (1s there)
            y = y + cnp.reshape(bias, shape[:nb] + (1,) * len(keep) + feats)
        return y

    def _declare(self, name, init, shape, axes):
        if axes:
            return param_with_axes(name, init, shape, self.param_dtype, axes=axes, module=self)
        return self.param(name, init, shape, self.param_dtype)


def _flat_init(init_fn, flat_shape):
    """Call ``init_fn`` on ``flat_shape`` and reshape to the requested shape (Flax's
    ``kernel_init_wrap``); in place on devices when no reshape is needed.

    A multi-axis parameter with a sharding is generated flat in the sharding that maps block
    for block onto the requested one (a sharded dimension leading its flattened group), so
    no device holds more than its block; otherwise on the host and scattered. An
    initializer boxed by ``with_partitioning`` / ``with_logical_partitioning`` gets its
    names applied to the requested (not the flat) shape, as Flax's ``replace_boxed`` does:
    under a mesh the parameter is born sharded as those names say."""
    boxing = getattr(init_fn, "_ct_boxing", None)

    def init(key, shape, dtype=np.float32, out_sharding=None):
        shape = tuple(shape)
        if boxing is not None:
            inner, box, born = boxing
            target = out_sharding if out_sharding is not None else born()
            return box(_flat_init(inner, flat_shape)(key, shape, dtype, out_sharding=target))
        out_sharding = _replicate_uneven(out_sharding, shape)   # under jit (see spmd)
        if shape == tuple(flat_shape):
            if out_sharding is not None and _accepts_out_sharding(init_fn):
                return init_fn(key, shape, dtype, out_sharding=out_sharding)
            v = init_fn(key, shape, dtype)
            return device_put(v, out_sharding) if out_sharding is not None else v
        flat_sharding = _flat_sharding(out_sharding, shape, tuple(flat_shape))
        if flat_sharding is not None:
            v = sharded_initializer(init_fn, flat_sharding)(key, tuple(flat_shape), dtype)
        else:
            v = init_fn(key, tuple(flat_shape), dtype)
        if isinstance(v, ShapeDtypeStruct):
            return ShapeDtypeStruct(shape, v.dtype, out_sharding)
        if isinstance(v, Array) and v.dtype == np.float32:
            v = cnp.reshape(v, shape)          # keeps a block-aligned sharding, no copy to one device
        else:
            v = np.reshape(np.asarray(v), shape)
        if out_sharding is not None:
            if getattr(v, "sharding", None) != out_sharding:
                return device_put(v, out_sharding)
            if v.sharding.spec != out_sharding.spec:   # same blocks, the spec as asked
                v = Array._create(v.shape, v.dtype, out_sharding, list(v._blocks))
        return v
    return init


def _flat_sharding(sharding, shape, flat_shape):
    """The sharding of the flat (2-d) initializer output whose blocks, reshaped, are the
    blocks of ``sharding`` on ``shape``; None when there is none (a sharded dimension not
    leading its flattened group, or not divisible) or no sharding is asked."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    dims = list(range(len(shape)))
    if len(flat_shape) == 1:
        groups = [dims]
    else:   # (prod(shape[:k]), prod(shape[k:])): the first such k
        ks = [k for k in range(len(shape) + 1) if math.prod(shape[:k]) == flat_shape[0]]
        if len(flat_shape) != 2 or not ks:
            return None
        groups = [dims[:ks[0]], dims[ks[0]:]]
    out = []
    for group in groups:
        if any(spec[d] is not None for d in group[1:]):
            return None
        entry = spec[group[0]] if group else None
        if entry is not None:
            axes = (entry,) if isinstance(entry, str) else tuple(entry)
            if shape[group[0]] % math.prod(sizes[a] for a in axes):
                return None
        out.append(entry)
    return NamedSharding(sharding.mesh, PartitionSpec(*out))


def _expand_ellipsis(eq: str, shapes) -> tuple:
    """``(lhs, rhs, out)`` of a two-operand explicit einsum with each ``...`` replaced by
    letters the equation does not use, as opt_einsum's ``parse_einsum_input`` does (the
    broadcast dimensions right-aligned; the output's ``...`` the longer operand's)."""
    ins, out = eq.split("->")
    ops = ins.split(",")
    unused = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    longest = 0
    res = []
    for term, shape in zip(ops, shapes):
        if "..." in term:
            n = len(shape) - (len(term) - 3)
            if n < 0:
                raise ValueError(f"Einsum: {eq!r} names more axes than the operand's rank "
                                 f"{len(shape)}")
            longest = max(longest, n)
            term = term.replace("...", "".join(unused[longest - n:longest]) if n else "")
        res.append(term)
    if "..." in out:
        out = out.replace("...", "".join(unused[:longest]))
    return res[0], res[1], out


class Einsum(Module):
    """A learnable einsum with the input (``flax.linen.Einsum``): ``y = einsum(einsum_str,
    inputs, kernel) + bias`` with ``kernel`` of the field ``shape``.

    ``einsum_str`` is given here or at call time (not both, Flax's ``merge_param``), explicit
    (``'->'``) with exactly two operands, the input first. The kernel's initializer sees
    ``shape`` itself (no flattening, unlike :class:`DenseGeneral`); the bias, declared after the
    kernel, has one axis per output letter that names a kernel axis, in the output's order
    (``'abc,cde->abde'`` with ``shape=(5, 6, 7)``: a bias ``(6, 7)``). ``...`` stands for the
    input's leading axes. ``dtype``, ``param_dtype``, ``precision``, ``kernel_init``,
    ``bias_init`` are :class:`Dense`'s; ``promote_dtype`` (Flax's field) is applied to
    ``(inputs, kernel, bias)``; ``preferred_element_type`` is accepted and must be ``None``
    (16-bit products accumulate in float32 anyway). The product is
    :func:`ctrainstate.numpy.einsum`'s: an index of one operand only must appear in the output.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> layer = nn.Einsum((5, 6, 7), 'abc,cde->abde')
    >>> v = layer.init(random.PRNGKey(0), np.ones((3, 4, 5), np.float32))
    >>> v['params']['kernel'].shape, v['params']['bias'].shape
    ((5, 6, 7), (6, 7))
    >>> layer.apply(v, np.ones((3, 4, 5), np.float32)).shape
    (3, 4, 6, 7)
    """

    shape: Any
    einsum_str: Any = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = np.float32
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()
    promote_dtype: Callable = promote_dtype
    preferred_element_type: Any = None

    @compact
    def __call__(self, inputs, einsum_str=None):
        _check_dtype(self)
        precision = _precision(self)
        if self.preferred_element_type is not None:
            raise NotImplementedError("Einsum(preferred_element_type=...): not supported "
                                      "(16-bit products accumulate in float32 already)")
        eq = merge_param("einsum_str", self.einsum_str, einsum_str)
        eq = eq.replace(" ", "")
        if "->" not in eq:
            raise ValueError('`einsum_str` equation must be explicit and include "->".')
        if eq.count(",") != 1:
            raise ValueError(f"`einsum_str` equation must have exactly two operands and "
                             f"therefore, exactly one comma character, instead of "
                             f"{eq.count(',')}")
        shape = tuple(_int(d, "Einsum", "shape") for d in
                      (self.shape if isinstance(self.shape, (tuple, list)) else (self.shape,)))
        kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        lhs, rhs, out = _expand_ellipsis(eq, (tuple(np.shape(inputs)), shape))
        if len(rhs) != len(shape):
            raise ValueError(f"Einsum: the kernel term {rhs!r} of {eq!r} has {len(rhs)} axes, "
                             f"but shape {shape} has {len(shape)}")
        bias = None
        if self.use_bias:
            pos = {c: i for i, c in enumerate(rhs)}
            bias_shape = [shape[pos[c]] for c in out if c in pos]
            bcast = [shape[pos[c]] if c in pos else 1 for c in out]
            bias = self.param("bias", self.bias_init, tuple(bias_shape), self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = cnp.einsum(f"{lhs},{rhs}->{out}", inputs, kernel, precision=precision)
        if bias is not None:
            y = y + cnp.reshape(bias, tuple(bcast))
        return y


@op_node("embed")
def _embed_lookup(embedding, inputs, n: int):
    """``embedding[inputs]`` for integer ids in ``[-n, n)`` (Embed's lookup): the ids read on
    the host and checked, the rows gathered (take_rows). Under jit one op node, so the ids are
    read at each replay, not at the trace."""
    idx = np.asarray(inputs)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"Embed expects integer inputs, got {idx.dtype}")
    # Flax reads jnp.take(embedding, ids, axis=0): an id in [-n, 0) counts from the end,
    # as in numpy; with one row Flax compares ids with 0, so only 0 is a row. Flax returns
    # NaN rows for the other ids without a word; here they are an error.
    lo = -n if n > 1 else 0
    if idx.size and (idx.min() < lo or idx.max() >= n):
        bad = idx[(idx < lo) | (idx >= n)]
        raise ValueError(f"Embed: ids must be in [{lo}, {n}) for num_embeddings={n} (a "
                         f"negative id counts from the end), got {bad.size} outside, e.g. "
                         f"{bad.reshape(-1)[0]} (ids span [{idx.min()}, {idx.max()}])")
    if idx.size and idx.min() < 0:    # (in int64: int8 ids + n would wrap)
        idx = np.where(idx < 0, idx.astype(np.int64) + n, idx)
    return cnp.take_rows(embedding, idx)


class Embed(Module):
    """Embedding lookup: ``embedding[inputs]`` with ``embedding`` of shape
    ``(num_embeddings, features)``; ``attend(query)`` is ``query @ embedding.T``.
    Ids are integers in ``[-num_embeddings, num_embeddings)``, a negative one counting from
    the end as in Flax (``jnp.take``); an id outside raises ``ValueError`` where Flax would
    return a row of NaN.
    ``dtype`` (Flax's): the table is cast to it before the lookup (and, with the query, in
    ``attend``); ``None`` keeps ``param_dtype``. A 16-bit table is converted to float32 for
    the row gather on each device (one float32 copy of each device's block per call)."""

    num_embeddings: int
    features: int
    dtype: Any = None
    param_dtype: Any = np.float32
    embedding_init: Callable = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    embedding_axes: tuple = ()

    def setup(self):
        _check_dtype(self)
        shape = (self.num_embeddings, self.features)
        if self.embedding_axes:
            self.embedding = param_with_axes("embedding", self.embedding_init, shape,
                                             self.param_dtype, axes=tuple(self.embedding_axes),
                                             module=self)
        else:
            self.embedding = self.param("embedding", self.embedding_init, shape, self.param_dtype)

    def __call__(self, inputs):
        _check_dtype(self)
        if isinstance(inputs, ShapeDtypeStruct):     # eval_shape: ids without values
            if not np.issubdtype(np.dtype(inputs.dtype), np.integer):
                raise TypeError(f"Embed expects integer inputs, got {inputs.dtype}")
            embedding, = promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
            return ShapeDtypeStruct(tuple(inputs.shape) + (self.features,), embedding.dtype)
        embedding, = promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return _embed_lookup(embedding, inputs, self.num_embeddings)

    def attend(self, query):
        _check_dtype(self)
        query, embedding = promote_dtype(query, self.embedding, dtype=self.dtype)
        return cnp.matmul(query, cnp.transpose(embedding))


# LayerNorm lives with RMSNorm in normalization.py; still importable from here
from .normalization import LayerNorm  # noqa: E402,F401


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
