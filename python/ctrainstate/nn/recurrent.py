"""Recurrent layers (mirror of ``flax.linen.recurrent``): the cells ``LSTMCell``,
``OptimizedLSTMCell``, ``GRUCell``, ``SimpleCell``, ``MGUCell``, ``ConvLSTMCell``, the
sequence wrapper ``RNN`` and ``Bidirectional``.

A cell is a Module ``cell(carry, x) -> (carry, y)`` for one time step, with
``initialize_carry(rng, input_shape)`` and ``num_feature_axes``. Field names, defaults
(``recurrent_kernel_init`` is ``orthogonal()``), submodule names (``ii``, ``hf``, ...) and the
order in which they are created follow Flax, so the same key gives Flax's parameters (the
orthogonal kernels up to the rounding of numpy's QR against XLA's, ~1e-7) and the same
outputs.

``RNN`` runs a cell over the time axis with :func:`ctrainstate.nn.scan`'s function form, as
Flax does (``variable_broadcast='params'``, ``split_rngs={'params': False}``: one parameter set
shared by every step, created by the scan's first trace with Flax's key), so its parameters are
``{'cell': {...}}`` as Flax's. ctrainstate runs eagerly: the scan is a Python loop over the
steps, and ``unroll`` is accepted and ignored.

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> x = np.ones((2, 5, 3), np.float32)              # (batch, time, features)
>>> lstm = nn.RNN(nn.LSTMCell(4), return_carry=True)
>>> v = lstm.init(random.PRNGKey(0), x)
>>> sorted(v['params']['cell'])
['hf', 'hg', 'hi', 'ho', 'if', 'ig', 'ii', 'io']
>>> (c, h), y = lstm.apply(v, x)
>>> c.shape, h.shape, y.shape
((2, 4), (2, 4), (2, 5, 4))
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .._src.numpy_lax import numpy as cnp
from .. import random as _random
from ..core import FrozenDict
from .._src.base.tree_util import tree_flatten, tree_map
from . import initializers
from .conv import Conv
from .dtypes import promote_dtype
from .linear import Dense, default_kernel_init
from .._src.nn.lifted import scan as _scan
from .._src.nn.module import Module, compact, nowrap
from .._src.array.abstract import eval_shape

__all__ = ["RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell", "SimpleCell", "MGUCell",
           "ConvLSTMCell", "RNN", "Bidirectional", "flip_sequences", "DenseParams"]

sigmoid = cnp.sigmoid
tanh = cnp.tanh


# --- checks ----------------------------------------------------------------------------------

def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def _check_step(cell, carry_leaves, inputs, n_feat: int = 1):
    """A cell's (carry, inputs) checked before any parameter is made, so a bad call names the
    cell: inputs with the feature axes, carry leaves of one shape whose batch axes broadcast
    with the inputs' (Flax's cells broadcast them too)."""
    who = type(cell).__name__
    xs = _shape(inputs)
    if len(xs) < n_feat:
        raise ValueError(f"{who}: inputs of shape {xs} have no feature axis (a cell takes one "
                         f"time step: (*batch, features))")
    shapes = [_shape(c) for c in carry_leaves]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"{who}: the carry's arrays must have one shape, got {shapes}")
    s = shapes[0]
    if len(s) < n_feat:
        raise ValueError(f"{who}: a carry of shape {s} has no feature axis")
    bx, bc = xs[:len(xs) - n_feat], s[:len(s) - n_feat]
    try:
        np.broadcast_shapes(bx, bc)
    except ValueError:
        raise ValueError(f"{who}: the carry's batch shape {bc} (carry {s}) does not match the "
                         f"inputs' batch shape {bx} (inputs {xs}); make the carry with "
                         f"initialize_carry(rng, inputs.shape)") from None


def _carry_pair(cell, carry):
    if not isinstance(carry, (tuple, list)) or len(carry) != 2:
        raise TypeError(f"{type(cell).__name__}: the carry is a pair (c, h) made by "
                        f"initialize_carry, got {type(carry).__name__}"
                        + (f" of length {len(carry)}" if isinstance(carry, (tuple, list))
                           else ""))
    return carry


def _carry_array(cell, carry):
    if isinstance(carry, (tuple, list, dict)):
        raise TypeError(f"{type(cell).__name__}: the carry is one array (h) made by "
                        f"initialize_carry, got a {type(carry).__name__}")
    return carry


def _batch_of(cell, input_shape, n_feat: int = 1) -> tuple:
    s = tuple(int(d) for d in input_shape)
    if len(s) < n_feat:
        raise ValueError(f"{type(cell).__name__}.initialize_carry: input_shape {s} needs "
                         f"{n_feat} feature axis(es)")
    return s


# --- cells -------------------------------------------------------------------------------------

class RNNCellBase(Module):
    """RNN cell base class (Flax's): a cell is ``cell(carry, inputs) -> (carry, outputs)`` for
    one time step, with :meth:`initialize_carry` and :attr:`num_feature_axes`.

    >>> from ctrainstate import nn
    >>> issubclass(nn.LSTMCell, nn.RNNCellBase)
    True
    """

    @nowrap
    def initialize_carry(self, rng, input_shape: tuple):
        """The initial carry for inputs of shape ``input_shape`` (one time step)."""
        raise NotImplementedError

    @property
    def num_feature_axes(self) -> int:
        """The number of trailing feature axes of the cell's inputs."""
        raise NotImplementedError


class LSTMCell(RNNCellBase):
    r"""LSTM cell (Flax's ``LSTMCell``)::

        i = gate_fn(W_ii x + W_hi h + b_hi)
        f = gate_fn(W_if x + W_hf h + b_hf)
        g = activation_fn(W_ig x + W_hg h + b_hg)
        o = gate_fn(W_io x + W_ho h + b_ho)
        c' = f * c + i * g
        h' = o * activation_fn(c')

    The carry is ``(c, h)``; the output is ``h'``. Submodules ``ii, if, ig, io`` (``Dense``
    without bias, ``kernel_init``) and ``hi, hf, hg, ho`` (``Dense`` with bias,
    ``recurrent_kernel_init``, ``bias_init``), created in Flax's order ``ii, hi, if, hf, ...``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((2, 3), np.float32)
    >>> cell = nn.LSTMCell(features=4)
    >>> carry = cell.initialize_carry(random.PRNGKey(1), x.shape)
    >>> v = cell.init(random.PRNGKey(2), carry, x)
    >>> (c, h), y = cell.apply(v, carry, x)
    >>> v['params']['hi']['kernel'].shape, v['params']['ii']['kernel'].shape, y.shape
    ((4, 4), (3, 4), (2, 4))
    """

    features: int
    gate_fn: Callable = sigmoid
    activation_fn: Callable = tanh
    kernel_init: Callable = default_kernel_init
    recurrent_kernel_init: Callable = initializers.orthogonal()
    bias_init: Callable = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = np.float32
    carry_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, carry, inputs):
        c, h = _carry_pair(self, carry)
        _check_step(self, (c, h), inputs)
        hidden_features = _shape(h)[-1]
        dense_h = functools.partial(Dense, features=hidden_features, use_bias=True,
                                    kernel_init=self.recurrent_kernel_init,
                                    bias_init=self.bias_init, dtype=self.dtype,
                                    param_dtype=self.param_dtype)
        dense_i = functools.partial(Dense, features=hidden_features, use_bias=False,
                                    kernel_init=self.kernel_init, dtype=self.dtype,
                                    param_dtype=self.param_dtype)
        i = self.gate_fn(dense_i(name="ii")(inputs) + dense_h(name="hi")(h))
        f = self.gate_fn(dense_i(name="if")(inputs) + dense_h(name="hf")(h))
        g = self.activation_fn(dense_i(name="ig")(inputs) + dense_h(name="hg")(h))
        o = self.gate_fn(dense_i(name="io")(inputs) + dense_h(name="ho")(h))
        new_c = f * c + i * g
        new_h = o * self.activation_fn(new_c)
        return (new_c, new_h), new_h

    @nowrap
    def initialize_carry(self, rng, input_shape: tuple):
        """``(c, h)``, each ``carry_init(key, (*batch, features), param_dtype)`` with the two
        halves of ``random.split(rng)`` (Flax's)."""
        batch_dims = _batch_of(self, input_shape)[:-1]
        key1, key2 = _random.split(rng)
        mem_shape = batch_dims + (self.features,)
        return (self.carry_init(key1, mem_shape, self.param_dtype),
                self.carry_init(key2, mem_shape, self.param_dtype))

    @property
    def num_feature_axes(self) -> int:
        return 1


class DenseParams(Module):
    """Flax's dummy module that only makes a ``Dense``'s parameters (``kernel``, ``bias``) and
    returns them, for :class:`OptimizedLSTMCell`.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> from ctrainstate.nn.recurrent import DenseParams
    >>> (k, b), v = DenseParams(3).init_with_output(random.PRNGKey(0), np.ones((1, 2), np.float32))
    >>> k.shape, b.shape
    ((2, 3), (3,))
    """

    features: int
    use_bias: bool = True
    param_dtype: Any = np.float32
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, inputs):
        k = self.param("kernel", self.kernel_init, (_shape(inputs)[-1], self.features),
                       self.param_dtype)
        b = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
             if self.use_bias else None)
        return k, b


class OptimizedLSTMCell(RNNCellBase):
    r"""LSTM cell that concatenates the four gates' kernels into one product per operand
    (Flax's ``OptimizedLSTMCell``): the same equations, submodule names and parameters as
    :class:`LSTMCell` (``DenseParams`` submodules, created in Flax's order ``ii, hi, if, hf,
    ...``), so the two cells' variables are interchangeable.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((2, 3), np.float32)
    >>> carry = nn.OptimizedLSTMCell(4).initialize_carry(random.PRNGKey(1), x.shape)
    >>> v = nn.OptimizedLSTMCell(4).init(random.PRNGKey(2), carry, x)
    >>> (c, h), y = nn.LSTMCell(4).apply(v, carry, x)
    >>> (c2, h2), y2 = nn.OptimizedLSTMCell(4).apply(v, carry, x)
    >>> bool(np.allclose(np.asarray(y), np.asarray(y2), atol=1e-6))
    True
    """

    features: int
    gate_fn: Callable = sigmoid
    activation_fn: Callable = tanh
    kernel_init: Callable = default_kernel_init
    recurrent_kernel_init: Callable = initializers.orthogonal()
    bias_init: Callable = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = np.float32
    carry_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, carry, inputs):
        c, h = _carry_pair(self, carry)
        _check_step(self, (c, h), inputs)
        hidden_features = _shape(h)[-1]

        def concat_dense(x, params, use_bias):
            kernels = [k for k, _ in params.values()]
            kernel = cnp.concatenate(kernels, axis=-1)
            bias = cnp.concatenate([b for _, b in params.values()], axis=-1) if use_bias else None
            x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
            y = cnp.dot(x, kernel)
            if use_bias:
                y = y + cnp.reshape(bias, (1,) * (len(_shape(y)) - 1) + (-1,))
            split = np.cumsum([_shape(k)[-1] for k in kernels[:-1]]).tolist()
            return dict(zip(params.keys(), cnp.split(y, split, axis=-1)))

        p_h, p_i = {}, {}
        for comp in ("i", "f", "g", "o"):
            p_i[comp] = DenseParams(features=hidden_features, use_bias=False,
                                    param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                    bias_init=self.bias_init, name=f"i{comp}")(inputs)
            p_h[comp] = DenseParams(features=hidden_features, use_bias=True,
                                    param_dtype=self.param_dtype,
                                    kernel_init=self.recurrent_kernel_init,
                                    bias_init=self.bias_init, name=f"h{comp}")(h)
        dh = concat_dense(h, p_h, True)
        di = concat_dense(inputs, p_i, False)
        i = self.gate_fn(dh["i"] + di["i"])
        f = self.gate_fn(dh["f"] + di["f"])
        g = self.activation_fn(dh["g"] + di["g"])
        o = self.gate_fn(dh["o"] + di["o"])
        new_c = f * c + i * g
        new_h = o * self.activation_fn(new_c)
        return (new_c, new_h), new_h

    initialize_carry = LSTMCell.initialize_carry
    num_feature_axes = LSTMCell.num_feature_axes


class SimpleCell(RNNCellBase):
    r"""Elman cell (Flax's ``SimpleCell``): ``h' = activation_fn(W_i x + b_i + W_h h)``
    (``+ h`` inside the activation with ``residual=True``). Submodules ``i`` (``Dense`` with
    bias) and ``h`` (no bias, ``recurrent_kernel_init``); the carry and the output are ``h'``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((2, 3), np.float32)
    >>> carry = nn.SimpleCell(4).initialize_carry(random.PRNGKey(1), x.shape)
    >>> v = nn.SimpleCell(4).init(random.PRNGKey(2), carry, x)
    >>> sorted(v['params']), nn.SimpleCell(4).apply(v, carry, x)[1].shape
    (['h', 'i'], (2, 4))
    """

    features: int
    activation_fn: Callable = tanh
    kernel_init: Callable = default_kernel_init
    recurrent_kernel_init: Callable = initializers.orthogonal()
    bias_init: Callable = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = np.float32
    carry_init: Callable = initializers.zeros_init()
    residual: bool = False

    @compact
    def __call__(self, carry, inputs):
        carry = _carry_array(self, carry)
        _check_step(self, (carry,), inputs)
        hidden_features = _shape(carry)[-1]
        dense_h = functools.partial(Dense, features=hidden_features, use_bias=False,
                                    dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=self.recurrent_kernel_init)
        dense_i = functools.partial(Dense, features=hidden_features, use_bias=True,
                                    dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=self.kernel_init, bias_init=self.bias_init)
        new_carry = dense_i(name="i")(inputs) + dense_h(name="h")(carry)
        if self.residual:
            new_carry = new_carry + carry
        new_carry = self.activation_fn(new_carry)
        return new_carry, new_carry

    @nowrap
    def initialize_carry(self, rng, input_shape: tuple):
        """``carry_init(rng, (*batch, features), param_dtype)`` (Flax's)."""
        batch_dims = _batch_of(self, input_shape)[:-1]
        return self.carry_init(rng, batch_dims + (self.features,), self.param_dtype)

    @property
    def num_feature_axes(self) -> int:
        return 1


class GRUCell(RNNCellBase):
    r"""GRU cell (Flax's ``GRUCell``)::

        r = gate_fn(W_ir x + b_ir + W_hr h)
        z = gate_fn(W_iz x + b_iz + W_hz h)
        n = activation_fn(W_in x + b_in + r * (W_hn h + b_hn))
        h' = (1 - z) * n + z * h

    Submodules ``ir, iz, in`` (``Dense`` with bias) and ``hr, hz`` (no bias), ``hn`` (with
    bias), in Flax's order ``ir, hr, iz, hz, in, hn``; the carry and the output are ``h'``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((2, 3), np.float32)
    >>> carry = nn.GRUCell(4).initialize_carry(random.PRNGKey(1), x.shape)
    >>> v = nn.GRUCell(4).init(random.PRNGKey(2), carry, x)
    >>> sorted(v['params']['hn']), sorted(v['params']['hr'])
    (['bias', 'kernel'], ['kernel'])
    """

    features: int
    gate_fn: Callable = sigmoid
    activation_fn: Callable = tanh
    kernel_init: Callable = default_kernel_init
    recurrent_kernel_init: Callable = initializers.orthogonal()
    bias_init: Callable = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = np.float32
    carry_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, carry, inputs):
        h = _carry_array(self, carry)
        _check_step(self, (h,), inputs)
        hidden_features = _shape(h)[-1]
        dense_h = functools.partial(Dense, features=hidden_features, use_bias=False,
                                    dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=self.recurrent_kernel_init,
                                    bias_init=self.bias_init)
        dense_i = functools.partial(Dense, features=hidden_features, use_bias=True,
                                    dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=self.kernel_init, bias_init=self.bias_init)
        r = self.gate_fn(dense_i(name="ir")(inputs) + dense_h(name="hr")(h))
        z = self.gate_fn(dense_i(name="iz")(inputs) + dense_h(name="hz")(h))
        n = self.activation_fn(dense_i(name="in")(inputs)
                               + r * dense_h(name="hn", use_bias=True)(h))
        new_h = (1.0 - z) * n + z * h
        return new_h, new_h

    initialize_carry = SimpleCell.initialize_carry
    num_feature_axes = SimpleCell.num_feature_axes


class MGUCell(RNNCellBase):
    r"""Minimal gated unit (Flax's ``MGUCell``, arXiv:1603.09420)::

        f = gate_fn(W_if x + b_if + W_hf h)
        n = activation_fn(W_in x + b_in + f * (W_hn h + b_hn))   # reset_gate=True
        n = activation_fn(W_in x + b_in + W_hn h)                # reset_gate=False
        h' = (1 - f) * n + f * h

    ``b_if`` starts at ``forget_bias_init`` (ones), ``b_in`` / ``b_hn`` at
    ``activation_bias_init`` (zeros). Submodules in Flax's order ``if, hf, hn, in``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((2, 3), np.float32)
    >>> carry = nn.MGUCell(4).initialize_carry(random.PRNGKey(1), x.shape)
    >>> v = nn.MGUCell(4).init(random.PRNGKey(2), carry, x)
    >>> np.asarray(v['params']['if']['bias']).tolist()
    [1.0, 1.0, 1.0, 1.0]
    """

    features: int
    gate_fn: Callable = sigmoid
    activation_fn: Callable = tanh
    kernel_init: Callable = default_kernel_init
    recurrent_kernel_init: Callable = initializers.orthogonal()
    forget_bias_init: Callable = initializers.ones_init()
    activation_bias_init: Callable = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = np.float32
    carry_init: Callable = initializers.zeros_init()
    reset_gate: bool = True

    @compact
    def __call__(self, carry, inputs):
        h = _carry_array(self, carry)
        _check_step(self, (h,), inputs)
        hidden_features = _shape(h)[-1]
        dense_h = functools.partial(Dense, features=hidden_features, use_bias=False,
                                    dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=self.recurrent_kernel_init,
                                    bias_init=self.activation_bias_init)
        dense_i = functools.partial(Dense, features=hidden_features, use_bias=True,
                                    dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=self.kernel_init)
        f = self.gate_fn(dense_i(name="if", bias_init=self.forget_bias_init)(inputs)
                         + dense_h(name="hf")(h))
        x = dense_h(name="hn", use_bias=self.reset_gate)(h)
        if self.reset_gate:
            x = x * f
        n = self.activation_fn(dense_i(name="in", bias_init=self.activation_bias_init)(inputs)
                               + x)
        new_h = (1.0 - f) * n + f * h
        return new_h, new_h

    initialize_carry = SimpleCell.initialize_carry
    num_feature_axes = SimpleCell.num_feature_axes


class ConvLSTMCell(RNNCellBase):
    r"""Convolutional LSTM cell (Flax's ``ConvLSTMCell``, Shi et al. 2015): the LSTM's
    products are convolutions ``ih`` (of the input) and ``hh`` (of ``h``), each a
    :class:`~ctrainstate.nn.Conv` with ``4 * features`` outputs split as ``i, g, f, o``; the
    forget gate is ``sigmoid(f + 1)``. Inputs are ``(*batch, *spatial, features)``;
    ``num_feature_axes`` is ``len(kernel_size) + 1``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((3, 5, 5, 2), np.float32)           # (batch, height, width, features)
    >>> cell = nn.ConvLSTMCell(features=4, kernel_size=(2, 2))
    >>> carry = cell.initialize_carry(random.PRNGKey(1), x.shape)
    >>> v = cell.init(random.PRNGKey(2), carry, x)
    >>> v['params']['ih']['kernel'].shape, cell.apply(v, carry, x)[1].shape
    ((2, 2, 2, 16), (3, 5, 5, 4))
    """

    features: int
    kernel_size: Sequence[int]
    strides: Any = None
    padding: Any = "SAME"
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = np.float32
    carry_init: Callable = initializers.zeros_init()

    @compact
    def __call__(self, carry, inputs):
        c, h = _carry_pair(self, carry)
        _check_step(self, (c, h), inputs, self.num_feature_axes)
        strides = 1 if self.strides is None else self.strides
        conv = functools.partial(Conv, features=4 * self.features, kernel_size=self.kernel_size,
                                 strides=strides, padding=self.padding, use_bias=self.use_bias,
                                 dtype=self.dtype, param_dtype=self.param_dtype)
        gates = conv(name="ih")(inputs) + conv(name="hh")(h)
        i, g, f, o = cnp.split(gates, 4, axis=-1)
        f = sigmoid(f + 1)
        new_c = f * c + sigmoid(i) * cnp.tanh(g)
        new_h = sigmoid(o) * cnp.tanh(new_c)
        return (new_c, new_h), new_h

    @nowrap
    def initialize_carry(self, rng, input_shape: tuple):
        """``(c, h)`` of shape ``(*batch, *spatial, features)`` (Flax's)."""
        n = self.num_feature_axes
        s = _batch_of(self, input_shape, n)
        signal_dims, batch_dims = s[len(s) - n:-1], s[:len(s) - n]
        key1, key2 = _random.split(rng)
        mem_shape = batch_dims + signal_dims + (self.features,)
        return (self.carry_init(key1, mem_shape, self.param_dtype),
                self.carry_init(key2, mem_shape, self.param_dtype))

    @property
    def num_feature_axes(self) -> int:
        return len(self.kernel_size) + 1


# --- sequences -----------------------------------------------------------------------------

def _lengths(seq_lengths, batch_dims: tuple, max_steps: int, who: str) -> np.ndarray:
    """``seq_lengths`` as a host int array of shape ``batch_dims``, each in [0, max_steps]."""
    sl = np.asarray(seq_lengths)
    if sl.dtype.kind not in "iu":
        raise TypeError(f"{who}: seq_lengths must be integers, got dtype {sl.dtype}")
    if tuple(sl.shape) != tuple(batch_dims):
        raise ValueError(f"{who}: seq_lengths of shape {tuple(sl.shape)} must have the inputs' "
                         f"batch shape {tuple(batch_dims)}")
    if sl.size and (sl.min() < 0 or sl.max() > max_steps):
        raise ValueError(f"{who}: seq_lengths must lie in [0, {max_steps}] (the time axis' "
                         f"length), got values in [{sl.min()}, {sl.max()}]")
    return sl.astype(np.int64)


def flip_sequences(inputs, seq_lengths, num_batch_dims: int, time_major: bool):
    """``inputs`` reversed along the time axis, each sequence within its own length (padding
    stays at the end), as Flax's ``flip_sequences``: with lengths ``[1, 2, 3]``, rows
    ``[1,0,0], [2,3,0], [4,5,6]`` become ``[1,0,0], [3,2,0], [6,5,4]``. As in Flax (its index
    ``(T - 1 - t + length) % T``), the padding steps are reversed among themselves too, so
    flipping twice is the identity. Differentiable in ``inputs``; ``seq_lengths`` must be
    concrete (host values).

    >>> import numpy as np
    >>> from ctrainstate.nn.recurrent import flip_sequences
    >>> x = np.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]], np.float32)
    >>> np.asarray(flip_sequences(x, np.array([1, 2, 3]), 1, False)).tolist()
    [[1.0, 0.0, 0.0], [3.0, 2.0, 0.0], [6.0, 5.0, 4.0]]
    """
    time_axis = 0 if time_major else num_batch_dims
    shape = _shape(inputs)
    max_steps = shape[time_axis]
    if seq_lengths is None:
        return cnp.flip(inputs, axis=time_axis)
    sl = np.expand_dims(np.asarray(seq_lengths).astype(np.int64), axis=time_axis)
    idxs = np.arange(max_steps - 1, -1, -1)
    if time_major:
        idxs = idxs.reshape([max_steps] + [1] * num_batch_dims)
    else:
        idxs = idxs.reshape([1] * num_batch_dims + [max_steps])
    idxs = (idxs + sl) % max_steps
    idxs = idxs.reshape(list(idxs.shape) + [1] * (len(shape) - idxs.ndim))
    idxs = np.broadcast_to(idxs, shape)
    return cnp.take_along_axis(inputs, np.ascontiguousarray(idxs.astype(np.int32)),
                               axis=time_axis)


def _select_last_carry(carries, seq_lengths: np.ndarray):
    """The carry of each sequence's last valid step from the stacked carries ``(time, *batch,
    ...)``: Flax's ``x[seq_lengths - 1, arange(batch)]`` (a length of 0 picks the last step,
    index -1, as Flax's does), for any number of batch dimensions."""
    last = seq_lengths - 1

    def pick(x):
        shape = _shape(x)
        n = shape[0]
        idx = (last % n).reshape((1,) + last.shape + (1,) * (len(shape) - 1 - last.ndim))
        idx = np.broadcast_to(idx, (1,) + shape[1:]).astype(np.int32)
        return cnp.take_along_axis(x, np.ascontiguousarray(idx), axis=0)[0]
    return tree_map(pick, carries)


def _concatenate(a, b):
    """Concatenates two arrays along the last axis (Bidirectional's default ``merge_fn``)."""
    return cnp.concatenate([a, b], axis=-1)


class RNN(Module):
    """Runs a cell over a sequence (Flax's ``RNN``), with :func:`ctrainstate.nn.scan`.

    Inputs are ``(*batch, time, *features)`` (``time_major=False``, the default) or ``(time,
    *batch, *features)``; ``features`` is the cell's ``num_feature_axes`` trailing axes. The
    output has the same layout with the cell's outputs; ``return_carry=True`` returns ``(carry,
    outputs)``. The call's keyword arguments are Flax's: ``initial_carry`` (default
    ``cell.initialize_carry(init_key or random.key(0), input_shape)``), ``init_key``,
    ``seq_lengths`` (an int array of the batch shape: steps at and after a sequence's length
    are padding; outputs there are not zeroed, and with ``return_carry`` the carry is that of the
    last valid step), and ``return_carry``, ``time_major``, ``reverse``, ``keep_order``
    overriding the fields.

    ``reverse=True`` processes each sequence from its last valid step to its first (padding
    stays at the end) and returns the outputs in that order, or in the inputs' order with
    ``keep_order=True``. ``variable_axes``, ``variable_broadcast='params'``,
    ``variable_carry``, ``split_rngs={'params': False}`` are passed to ``nn.scan`` as Flax
    passes them; ``unroll`` is accepted (nothing is compiled). ``seq_lengths`` must be host
    values (they pick the steps), in ``[0, time]``; other lengths are a ``ValueError``.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> x = np.ones((3, 6, 2), np.float32)              # (batch, time, features)
    >>> rnn = nn.RNN(nn.GRUCell(5))
    >>> v = rnn.init(random.PRNGKey(0), x)
    >>> rnn.apply(v, x, seq_lengths=np.array([6, 2, 4])).shape
    (3, 6, 5)
    """

    cell: Any
    time_major: bool = False
    return_carry: bool = False
    reverse: bool = False
    keep_order: bool = False
    unroll: int = 1
    variable_axes: Mapping = FrozenDict()
    variable_broadcast: Any = "params"
    variable_carry: Any = False
    split_rngs: Mapping = FrozenDict({"params": False})

    def __call__(self, inputs, *, initial_carry=None, init_key=None, seq_lengths=None,
                 return_carry=None, time_major=None, reverse=None, keep_order=None):
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order
        who = f"RNN({type(self.cell).__name__})"

        shape = _shape(inputs)
        n_feat = self.cell.num_feature_axes
        if len(shape) < n_feat + 1:
            raise ValueError(f"{who}: inputs of shape {shape} need a time axis and {n_feat} "
                             f"feature axis(es): {'(time, *batch, ' if time_major else '(*batch, time, '}"
                             f"*features)")
        time_axis = 0 if time_major else len(shape) - (n_feat + 1)
        batch_dims = shape[1:len(shape) - n_feat] if time_major else shape[:time_axis]
        n_steps = shape[time_axis]
        if n_steps < 1:
            raise ValueError(f"{who}: the time axis ({time_axis}) of inputs {shape} is empty")
        if seq_lengths is not None:
            seq_lengths = _lengths(seq_lengths, batch_dims, n_steps, who)

        if reverse:
            inputs = tree_map(lambda x: flip_sequences(x, seq_lengths, len(batch_dims),
                                                       time_major), inputs)
        input_shape = shape[:time_axis] + shape[time_axis + 1:]
        if initial_carry is None:
            if init_key is None:
                init_key = _random.key(0)
            carry = self.cell.initialize_carry(init_key, input_shape)
        else:
            carry = initial_carry
            _check_initial_carry(self.cell, carry, input_shape, who)

        slice_carry = seq_lengths is not None and return_carry

        def scan_fn(cell, carry, x):
            carry, y = cell(carry, x)
            if slice_carry:
                return carry, (carry, y)
            return carry, y

        scan = _scan(scan_fn, in_axes=time_axis,
                     out_axes=(0, time_axis) if slice_carry else time_axis,
                     unroll=self.unroll, variable_axes=self.variable_axes,
                     variable_broadcast=self.variable_broadcast,
                     variable_carry=self.variable_carry, split_rngs=self.split_rngs)
        scan_output = scan(self.cell, carry, inputs)

        if slice_carry:
            _, (carries, outputs) = scan_output
            carry = _select_last_carry(carries, seq_lengths)
        else:
            carry, outputs = scan_output

        if reverse and keep_order:
            outputs = tree_map(lambda x: flip_sequences(x, seq_lengths, len(batch_dims),
                                                        time_major), outputs)
        return (carry, outputs) if return_carry else outputs


def _check_initial_carry(cell, carry, input_shape, who):
    """A given ``initial_carry`` against the structure and shapes ``initialize_carry`` makes
    (skipped for a cell without ``initialize_carry``)."""
    try:
        want = eval_shape(lambda: cell.initialize_carry(_random.key(0), input_shape))
    except NotImplementedError:
        return
    lw, tw = tree_flatten(want)
    lg, tg = tree_flatten(carry)
    if tw != tg:
        raise TypeError(f"{who}: initial_carry has the structure {tg}; the cell's carry for "
                        f"inputs of step shape {tuple(input_shape)} is {tw}")
    for a, b in zip(lw, lg):
        if _shape(a) != _shape(b):
            raise ValueError(f"{who}: initial_carry has shapes {[_shape(x) for x in lg]}; the "
                             f"cell's carry for inputs of step shape {tuple(input_shape)} has "
                             f"{[_shape(x) for x in lw]}")


class Bidirectional(Module):
    """Runs ``forward_rnn`` over the sequence and ``backward_rnn`` over it reversed (each
    sequence within its ``seq_lengths``, ``keep_order=True`` so the outputs align), and merges
    the two outputs with ``merge_fn`` (default: concatenated on the last axis), as Flax's
    ``Bidirectional``. ``initial_carry`` is a pair (forward, backward); ``init_key`` is split in
    two; ``return_carry=True`` returns ``((carry_forward, carry_backward), outputs)``. Passing
    the same RNN instance twice shares its parameters (warned, as Flax logs it).

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> layer = nn.Bidirectional(nn.RNN(nn.GRUCell(4)), nn.RNN(nn.GRUCell(4)))
    >>> x = np.ones((2, 3), np.float32)                 # (time, features), no batch
    >>> v = layer.init(random.PRNGKey(0), x)
    >>> sorted(v['params']), layer.apply(v, x).shape
    (['backward_rnn', 'forward_rnn'], (2, 8))
    """

    forward_rnn: Any
    backward_rnn: Any
    merge_fn: Callable = _concatenate
    time_major: bool = False
    return_carry: bool = False

    def __call__(self, inputs, *, initial_carry=None, init_key=None, seq_lengths=None,
                 return_carry=None, time_major=None, reverse=None, keep_order=None):
        time_major = self.time_major if time_major is None else time_major
        return_carry = self.return_carry if return_carry is None else return_carry
        if init_key is not None:
            key_forward, key_backward = _random.split(init_key)
        else:
            key_forward = key_backward = None
        if initial_carry is not None:
            if not isinstance(initial_carry, (tuple, list)) or len(initial_carry) != 2:
                raise TypeError("Bidirectional: initial_carry is a pair (forward carry, "
                                "backward carry)")
            initial_carry_forward, initial_carry_backward = initial_carry
        else:
            initial_carry_forward = initial_carry_backward = None
        if self.forward_rnn is self.backward_rnn:
            warnings.warn("forward_rnn and backward_rnn is the same object, so they will share "
                          "parameters.", stacklevel=2)
        carry_forward, outputs_forward = self.forward_rnn(
            inputs, initial_carry=initial_carry_forward, init_key=key_forward,
            seq_lengths=seq_lengths, return_carry=True, time_major=time_major, reverse=False)
        carry_backward, outputs_backward = self.backward_rnn(
            inputs, initial_carry=initial_carry_backward, init_key=key_backward,
            seq_lengths=seq_lengths, return_carry=True, time_major=time_major, reverse=True,
            keep_order=True)
        carry = (carry_forward, carry_backward)
        outputs = tree_map(self.merge_fn, outputs_forward, outputs_backward)
        return (carry, outputs) if return_carry else outputs



from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
