"""Attention (mirror of ``flax.linen.attention``): ``dot_product_attention_weights``,
``dot_product_attention``, ``MultiHeadDotProductAttention`` (alias ``MultiHeadAttention``),
``SelfAttention`` and the mask helpers ``make_attention_mask``, ``make_causal_mask``,
``combine_masks``.

The arithmetic is Flax's, op for op: the query divided by ``sqrt(depth)``, logits
``einsum('...qhd,...khd->...hqk')``, ``+ bias``, ``where(mask, logits, finfo(dtype).min)``,
softmax over the keys, dropout (keep ``uniform(rng, shape) < 1 - rate`` — jax's bernoulli,
so the same key drops the same weights as Flax — times ``1 / (1 - rate)``; with
``broadcast_dropout`` one mask of shape ``(1, ..., 1, q, k)`` shared by the batch and head
dimensions), then ``einsum('...hqk,...khd->...qhd')`` with the values. The layer's
submodules (``query``, ``key``, ``value``, ``out`` DenseGeneral, ``query_ln``/``key_ln``),
kernel shapes ``(in, heads, head_dim)`` / ``(heads, head_dim, out)`` and default
initializers are Flax's, so ``init`` with the same key gives the same parameters.

Sharding: the products run as batched matmuls whose batch dimensions are the batch and
head dimensions, so a batch sharded on ``data`` and heads sharded on ``model`` (kernels
declared with ``nn.with_logical_partitioning(init, ('embed', 'heads', 'kv'))`` under
``nn.logical_axis_rules``) need no communication until the output projection, which
all-reduces over ``model``. Every op is differentiable.

Masks built from host arrays (token ids, lengths) stay host numpy arrays here (Flax returns
jax arrays): they are small, and every op accepts them.

``MultiHeadDotProductAttention(decode=True)`` keeps Flax's autoregressive key/value cache (the
``'cache'`` collection, updated with :func:`ctrainstate.lax.dynamic_update_slice`, sharded
like the projected keys); see the class.

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> x = np.ones((2, 5, 8), np.float32)
>>> layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
>>> v = layer.init(random.PRNGKey(0), x)
>>> v['params']['query']['kernel'].shape, v['params']['out']['kernel'].shape
((8, 2, 4), (2, 4, 8))
>>> mask = nn.make_causal_mask(np.ones((2, 5)))
>>> mask.shape
(2, 1, 5, 5)
>>> layer.apply(v, x, mask=mask).shape
(2, 5, 8)
"""
from __future__ import annotations

import ml_dtypes
import functools
import inspect
import warnings
from typing import Any, Callable

import numpy as np

from .._src.base import dtypes as _dtypes
from .._src.ops import ops as _ops
from .._src.numpy_lax import lax as _lax
from .._src.numpy_lax import numpy as cnp
from .. import random as _random
from .._src.array.abstract import ShapeDtypeStruct
from .._src.array.array import Array
from .._src.array.sharding import NamedSharding, PartitionSpec
from . import initializers
from .activation import softmax
from .dtypes import canonicalize_dtype
from .linear import DenseGeneral, _check_dtype, default_kernel_init
from .._src.nn.module import Module, compact
from .normalization import LayerNorm
from .._src.nn.scope import ScopeVariableNotFoundError
from .stochastic import merge_param
from .._src.ops import elementwise as _elementwise

__all__ = ["dot_product_attention_weights", "dot_product_attention",
           "MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention",
           "make_attention_mask", "make_causal_mask", "combine_masks"]

def _big_neg(dtype) -> float:
    """Flax's ``big_neg``: ``jnp.finfo(dtype).min`` of the compute dtype."""
    return float(ml_dtypes.finfo(dtype).min)


def _compute_dtype(what: str, dtype, *xs):
    """Flax's ``promote_dtype(*xs, dtype=dtype)``'s dtype, checked (a float ctrainstate
    stores)."""
    try:
        return canonicalize_dtype(*xs, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}(dtype={dtype!r}): {e}") from None


def _einsum(sub: str, a, b, precision):
    """Two-operand einsum with Flax's ``...`` batch dims spelled out (ctrainstate's einsum
    takes explicit indices)."""
    nb = a.ndim - (len(sub.split(",")[0]) - 3)
    batch = "ABCDEFGHIJKLMNOP"[:nb]
    sub = sub.replace("...", batch)
    return cnp.einsum(sub, a, b, precision=precision)


def _is_abstract(*xs) -> bool:
    return any(isinstance(x, ShapeDtypeStruct) for x in xs)


def _float_operand(x, place=None, dtype=_dtypes.float32):
    """An attention operand (query/key/value) as an Array of the compute ``dtype``."""
    if not isinstance(x, Array):
        x = _ops._lift(x, place)
    return x if x.dtype == dtype else _ops.astype(x, dtype)


def _mask_operand(mask):
    """A mask as ``where`` takes it: a host array, or a float32 Array (nonzero = attend)."""
    if isinstance(mask, Array):
        return mask if mask.dtype == np.float32 else mask.astype(np.float32)
    return np.asarray(mask)


def _check_qk(query: Array, key: Array, what: str) -> None:
    if query.ndim != key.ndim:
        raise ValueError(f"{what}: q, k must have same rank; got query {query.shape} and key "
                         f"{key.shape}")
    if query.ndim < 3:
        raise ValueError(f"{what}: query and key need at least 3 dims [..., length, num_heads, "
                         f"depth]; got query {query.shape}")
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"{what}: q, k batch dims must match; got query {query.shape} and key "
                         f"{key.shape}")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"{what}: q, k num_heads must match; got query {query.shape} and key "
                         f"{key.shape}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{what}: q, k depths must match; got query {query.shape} and key "
                         f"{key.shape}")


def _broadcast_check(name, shape, target, what):
    try:
        out = np.broadcast_shapes(tuple(shape), tuple(target))
    except ValueError:
        out = None
    if out != tuple(target):
        raise ValueError(f"{what}: {name} of shape {tuple(shape)} does not broadcast to the "
                         f"attention weights' shape {tuple(target)} [batch..., num_heads, "
                         f"q_length, kv_length]")


def dot_product_attention_weights(query, key, bias=None, mask=None, broadcast_dropout: bool = True,
                                  dropout_rng=None, dropout_rate: float = 0.0,
                                  deterministic: bool = False, dtype=None, precision=None,
                                  module: Module | None = None,
                                  force_fp32_for_softmax: bool = False,
                                  einsum_dot_general=None, einsum=None):
    """Attention weights ``softmax(q k^T / sqrt(depth) + bias, masked)`` of shape
    ``[batch..., num_heads, q_length, kv_length]`` (``flax.linen.dot_product_attention_weights``).

    ``query``/``key``: ``[batch..., length, num_heads, depth]``. ``bias`` and ``mask``
    broadcast to the weights' shape; where ``mask`` is False (0) the logit becomes
    ``finfo(float32).min``. ``mask``/``bias`` may be host arrays (the common case: numpy
    bool masks) or Arrays (a bool mask Array is converted). Dropout (when ``deterministic``
    is False and ``dropout_rate > 0``) needs ``dropout_rng``. ``module``: sow the weights
    into its ``'intermediates'``. ``dtype``: the compute dtype (Flax's ``promote_dtype`` of
    query and key; 16-bit floats run per op in float32 and round back, see
    :mod:`ctrainstate._src.ops.ops`); ``force_fp32_for_softmax`` keeps float32 weights;
    ``einsum``: a callable used instead of the einsum (called with Flax's ``...``
    subscripts); ``einsum_dot_general`` is not supported.

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> q = np.ones((1, 2, 1, 4), np.float32)
    >>> w = nn.dot_product_attention_weights(q, q, mask=np.array([[[[1, 0], [1, 1]]]], bool))
    >>> np.asarray(w).round(3).tolist()
    [[[[1.0, 0.0], [0.5, 0.5]]]]
    """
    what = "dot_product_attention_weights"
    if (precision or einsum_dot_general) and einsum:
        raise ValueError("precision/einsum_dot_general and einsum are mutually exclusive. "
                         "Please specify only one of them.")
    if einsum_dot_general is not None:
        raise NotImplementedError(f"{what}: einsum_dot_general= is not supported (ctrainstate "
                                  f"has no dot_general); pass einsum= instead")
    dtype = _compute_dtype(what, dtype, query, key)
    abstract = _is_abstract(query, key)
    if not abstract:
        query = _float_operand(query, None, dtype)
        key = _float_operand(key, _ops._place_of(query), dtype)
    _check_qk(query, key, what)
    wshape = query.shape[:-3] + (query.shape[-2], query.shape[-3], key.shape[-3])
    if bias is not None:
        _broadcast_check("bias", np.shape(bias), wshape, what)
    if mask is not None:
        _broadcast_check("mask", np.shape(mask), wshape, what)
    soft32 = force_fp32_for_softmax and dtype != _dtypes.float32
    if abstract:    # eval_shape: the weights' shape only
        return ShapeDtypeStruct(wshape, _dtypes.float32 if soft32 else dtype)

    depth = query.shape[-1]
    # Flax: query / jnp.sqrt(depth).astype(dtype) -- a true division by the root in dtype
    query = cnp.divide(query, np.asarray(np.sqrt(np.float32(depth)), np.float32).astype(dtype))
    sub = "...qhd,...khd->...hqk"
    attn = einsum(sub, query, key) if einsum else _einsum(sub, query, key, precision)
    if bias is not None:
        if not isinstance(bias, Array):
            bias = _ops._lift(bias, _ops._place_of(attn))
        attn = cnp.add(attn, bias)
    if mask is not None:
        attn = cnp.where(_mask_operand(mask), attn, _big_neg(dtype))
    if soft32:     # Flax: softmax of the float32 logits, the weights stay float32
        attn = softmax(_ops.astype(attn, _dtypes.float32))
    else:
        attn = softmax(attn)
        if attn.dtype != dtype:
            attn = _ops.astype(attn, dtype)
    if module is not None:
        module.sow("intermediates", "attention_weights", attn)
    if not deterministic and dropout_rate > 0.0:
        attn = _attention_dropout(attn, key.ndim, float(dropout_rate), broadcast_dropout,
                                  dropout_rng, what, dtype)
    return attn


def _attention_dropout(attn: Array, key_ndim: int, rate: float, broadcast: bool, rng, what,
                       dtype=None):
    """Flax's dropout of the weights: ``attn * (keep / keep_prob)`` with ``keep =
    bernoulli(rng, keep_prob, shape)`` (``uniform < keep_prob``), one mask over the batch
    and head dims when ``broadcast``. Each device draws only its block of the mask."""
    if rng is None:
        raise ValueError(f"{what}: dropout (deterministic=False, dropout_rate={rate}) needs "
                         f"dropout_rng (a PRNG key); pass dropout_rng= or deterministic=True")
    keep_prob = 1.0 - rate
    if broadcast:
        shape = (1,) * (key_ndim - 2) + attn.shape[-2:]
    else:
        shape = attn.shape
    sharding = None
    if isinstance(attn.sharding, NamedSharding):
        spec = list(attn.sharding.spec) + [None] * (attn.ndim - len(attn.sharding.spec))
        if broadcast:
            spec = [None] * (attn.ndim - 2) + spec[-2:]
        sharding = NamedSharding(attn.sharding.mesh, PartitionSpec(*spec))
    u = _random.uniform(rng, tuple(shape), out_sharding=sharding)
    if not isinstance(u, Array):
        u = _ops._lift(u, _ops._place_of(attn))
    keep = _ops._binary_raw(_ops.B_GT, _ops._lift(keep_prob, _ops._place_of(u)), u)  # u < p
    # keep.astype(dtype) / asarray(keep_prob, dtype): the kept weights times that quotient,
    # computed (and rounded) in the compute dtype (also when force_fp32_for_softmax left the
    # weights float32, as in Flax)
    dt = np.dtype(dtype) if dtype is not None else attn.dtype
    scale = float(np.asarray(1.0, dt) / np.asarray(keep_prob, dt))
    return _ops._keep(cnp.multiply(attn, scale), keep)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                          dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                          dtype=None, precision=None, module: Module | None = None,
                          force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                          qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    """Dot-product attention (``flax.linen.dot_product_attention``): the weights of
    :func:`dot_product_attention_weights` applied to ``value``, ``einsum('...hqk,...khd->
    ...qhd')``. ``query``/``key``/``value``: ``[batch..., length, num_heads, depth]`` (``key``
    and ``value`` of the same length); the output is ``[batch..., q_length, num_heads,
    v_depth]``.

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> q = np.zeros((1, 1, 1, 2), np.float32)
    >>> v = np.array([[[[1.0, 2.0]], [[3.0, 4.0]]]], np.float32)     # two keys
    >>> np.asarray(nn.dot_product_attention(q, np.zeros((1, 2, 1, 2), np.float32), v)).tolist()
    [[[[2.0, 3.0]]]]
    """
    what = "dot_product_attention"
    if bool(qk_attn_weights_einsum) != bool(attn_weights_value_einsum):
        raise ValueError("qk_attn_weights_einsum and attn_weights_value_einsum must be "
                         "specified together.")
    if (precision or einsum_dot_general) and (qk_attn_weights_einsum or attn_weights_value_einsum):
        raise ValueError("precision/einsum_dot_general and qk_attn_weights_einsum/"
                         "attn_weights_value_einsum are mutually exclusive. Please specify only "
                         "one of them.")
    dtype = _compute_dtype(what, dtype, query, key, value)
    abstract = _is_abstract(query, key, value)
    if not abstract:
        query = _float_operand(query, None, dtype)
        place = _ops._place_of(query)
        key, value = _float_operand(key, place, dtype), _float_operand(value, place, dtype)
    if not key.ndim == query.ndim == value.ndim:
        raise ValueError(f"{what}: q, k, v must have same rank; got query {query.shape}, key "
                         f"{key.shape}, value {value.shape}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"{what}: q, k, v batch dims must match; got query {query.shape}, key "
                         f"{key.shape}, value {value.shape}")
    if not query.shape[-2] == key.shape[-2] == value.shape[-2]:
        raise ValueError(f"{what}: q, k, v num_heads must match; got query {query.shape}, key "
                         f"{key.shape}, value {value.shape}")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"{what}: k, v lengths must match; got key {key.shape}, value "
                         f"{value.shape}")
    attn = dot_product_attention_weights(
        query, key, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
        dtype, precision, module, force_fp32_for_softmax, einsum_dot_general=einsum_dot_general,
        einsum=qk_attn_weights_einsum)
    if abstract:    # eval_shape: [batch..., q_length, num_heads, v_depth]
        out_dt = canonicalize_dtype(attn, value)
        return ShapeDtypeStruct(query.shape[:-1] + (value.shape[-1],), out_dt)
    sub = "...hqk,...khd->...qhd"
    if attn_weights_value_einsum:
        return attn_weights_value_einsum(sub, attn, value)
    return _einsum(sub, attn, value, precision)


class MultiHeadDotProductAttention(Module):
    """Multi-head dot-product attention (``flax.linen.MultiHeadDotProductAttention``).

    Projects ``inputs_q`` to queries and ``inputs_k``/``inputs_v`` to keys and values with
    the DenseGeneral submodules ``query``, ``key``, ``value`` (kernels ``(in, num_heads,
    head_dim)``, ``head_dim = qkv_features // num_heads``), runs ``attention_fn``
    (:func:`dot_product_attention`) and projects back with ``out`` (kernel ``(num_heads,
    head_dim, out_features)``). Fields, defaults (``kernel_init``: lecun_normal, Flax's
    default; ``bias_init``: zeros; ``out_kernel_init``/``out_bias_init`` default to those)
    and the call ``(inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
    deterministic=None, dropout_rng=None, sow_weights=False)`` are Flax's: ``inputs_k``
    defaults to ``inputs_q`` and ``inputs_v`` to ``inputs_k``; ``deterministic`` is needed
    (here or at call time, not both) only when ``dropout_rate > 0``; the dropout key is
    ``dropout_rng`` or ``make_rng('dropout')``. ``normalize_qk`` adds LayerNorms
    ``query_ln``/``key_ln`` without bias.

    A ``kernel_init`` boxed by ``nn.with_logical_partitioning(init, ('embed', 'heads',
    'kv'))`` (and ``out_kernel_init`` with ``('heads', 'kv', 'embed')``) gives kernels born
    sharded as the active ``nn.logical_axis_rules`` say.

    ``decode=True`` is Flax's autoregressive cache, in the ``'cache'`` collection:
    ``cached_key``/``cached_value`` (zeros of the projected keys'/values' shape and dtype,
    ``[batch..., max_length, num_heads, head_dim]``) and ``cache_index`` (an int32 scalar)
    are created when the cache is absent and mutable -- ``init`` on full-length inputs (or
    ``apply(..., mutable=['cache'])``), which otherwise runs the layer as without ``decode``.
    Then each ``apply({'params': ..., 'cache': ...}, x, mutable=['cache'])`` takes one
    position (``inputs_q`` of length 1, else ``ValueError('Autoregressive cache shape error,
    expected query shape ... instead got ...')``): its key and value are written at
    ``cache_index`` (``lax.dynamic_update_slice``, whose clamping makes a call past
    ``max_length`` overwrite the last position, as in Flax), the index advances by one, and
    the query attends to positions ``<= cache_index`` (``combine_masks`` with ``mask``). A
    cache that is absent and immutable raises Flax's ``'Tried to access "cached_key" from
    collection "cache" ... but the collection is empty.'`` (a ``ScopeVariableNotFoundError``);
    one that is present but immutable, ``'Cannot update variable "cached_key" ... because
    collection "cache" is immutable.'`` (``ValueError``). Parameters and RNG streams are
    those of ``decode=False``. The cache is born with the projected key's sharding (batch
    over ``data`` and heads over ``model`` when the inputs and kernels are so sharded; the
    index is replicated), and a step copies the new position into each device's own block of
    it: no device gathers the cache. ``cache_index`` is read back to the host once a step
    (ctrainstate runs eagerly; it also builds the host mask).

    Not supported: the ``*_dot_general`` / ``*_einsum_cls`` hooks. ``precision`` goes to the
    projections and both attention products; ``dtype`` (Flax's mixed precision) to the
    projections and the attention (``param_dtype`` is the parameters'); the cache holds the
    projected keys and values in that dtype.

    >>> import numpy as np
    >>> from ctrainstate import nn, random
    >>> q, kv = np.ones((4, 3, 5), np.float32), np.ones((4, 7, 6), np.float32)
    >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, dropout_rate=0.1)
    >>> v = layer.init(random.PRNGKey(0), q, kv, deterministic=True)
    >>> v['params']['key']['kernel'].shape                     # (in, heads, head_dim)
    (6, 2, 4)
    >>> layer.apply(v, q, kv, deterministic=False, rngs={'dropout': random.PRNGKey(1)}).shape
    (4, 3, 5)

    Decoding one position at a time:

    >>> dec = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, decode=True)
    >>> x = np.ones((4, 6, 5), np.float32)                   # max_length 6
    >>> v = dec.init(random.PRNGKey(0), x)
    >>> v['cache']['cached_key'].shape, int(v['cache']['cache_index'])
    ((4, 6, 2, 4), 0)
    >>> y, upd = dec.apply({'params': v['params'], 'cache': v['cache']}, x[:, :1],
    ...                    mutable=['cache'])
    >>> y.shape, int(upd['cache']['cache_index'])
    ((4, 1, 5), 1)
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = np.float32
    qkv_features: Any = None
    out_features: Any = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: Any = None
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    out_kernel_init: Any = None
    bias_init: Callable = initializers.zeros_init()
    out_bias_init: Any = None
    use_bias: bool = True
    attention_fn: Callable = dot_product_attention
    decode: bool = False
    normalize_qk: bool = False
    force_fp32_for_softmax: bool = False

    @compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
                 deterministic=None, dropout_rng=None, sow_weights: bool = False):
        name = type(self).__name__
        _check_dtype(self)
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError(
                    "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None. "
                    "If `inputs_kv` is not None, both `inputs_k` and `inputs_v` must be None. "
                    "We recommend using `inputs_k` and `inputs_v` args, since `inputs_kv` will "
                    "be deprecated soon.")
            inputs_k = inputs_v = inputs_kv
            warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and "
                          "inputs_v instead.", DeprecationWarning)
        else:
            if inputs_k is None:
                if inputs_v is not None:
                    raise ValueError(
                        "`inputs_k` cannot be None if `inputs_v` is not None. To have both "
                        "`inputs_k` and `inputs_v` be the same value, pass in the value to "
                        "`inputs_k` and leave `inputs_v` as None.")
                inputs_k = inputs_q
            if inputs_v is None:
                inputs_v = inputs_k
            elif np.shape(inputs_v)[-1] == np.shape(inputs_v)[-2]:
                warnings.warn(
                    f"You are passing an array of shape {tuple(np.shape(inputs_v))} to the "
                    f"`inputs_v` arg, when you may have intended to pass it to the `mask` arg. "
                    f"The signature is `__call__(inputs_q, inputs_k=None, inputs_v=None, *, "
                    f"inputs_kv=None, mask=None, deterministic=None)`.", DeprecationWarning)
        for arg, x in (("inputs_q", inputs_q), ("inputs_k", inputs_k), ("inputs_v", inputs_v)):
            if len(np.shape(x)) < 2:
                raise ValueError(f"{name}: {arg} must be [batch..., length, features], got "
                                 f"shape {tuple(np.shape(x))}")
        if np.shape(inputs_k)[:-1] != np.shape(inputs_v)[:-1]:
            raise ValueError(f"{name}: inputs_k {tuple(np.shape(inputs_k))} and inputs_v "
                             f"{tuple(np.shape(inputs_v))} must have the same batch dims and "
                             f"length")
        if np.shape(inputs_q)[:-2] != np.shape(inputs_k)[:-2]:
            raise ValueError(f"{name}: inputs_q {tuple(np.shape(inputs_q))} and inputs_k "
                             f"{tuple(np.shape(inputs_k))} must have the same batch dims")
        features = self.out_features or np.shape(inputs_q)[-1]
        qkv_features = self.qkv_features or np.shape(inputs_q)[-1]
        if qkv_features % self.num_heads != 0:
            raise ValueError(f"{name}: Memory dimension ({qkv_features}) must be divisible by "
                             f"number of heads ({self.num_heads}).")
        head_dim = qkv_features // self.num_heads

        dense = functools.partial(
            DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
            features=(self.num_heads, head_dim), kernel_init=self.kernel_init,
            bias_init=self.bias_init, use_bias=self.use_bias, precision=self.precision)
        # [batch..., length, num_heads, head_dim]
        query = dense(name="query")(inputs_q)
        key = dense(name="key")(inputs_k)
        value = dense(name="value")(inputs_v)
        if self.normalize_qk:
            # QK normalisation (ViT-22B, arxiv.org/abs/2302.05442), as Flax: no bias
            query = LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                              param_dtype=self.param_dtype)(query)
            key = LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                            param_dtype=self.param_dtype)(key)

        if self.decode:   # fast autoregressive decoding: one position a call, keys/values cached
            key, value, mask = self._decode_step(query, key, value, mask)

        if self.dropout_rate > 0.0:   # `deterministic` is required only with dropout
            m_deterministic = merge_param("deterministic", self.deterministic, deterministic)
            if not m_deterministic and dropout_rng is None:
                dropout_rng = self.make_rng("dropout")
        else:
            m_deterministic = True

        attn_kwargs = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                           broadcast_dropout=self.broadcast_dropout,
                           deterministic=m_deterministic, dtype=self.dtype,
                           precision=self.precision,
                           force_fp32_for_softmax=self.force_fp32_for_softmax)
        try:   # a custom attention_fn gets the keyword arguments it declares (as Flax)
            params = inspect.signature(self.attention_fn).parameters
            attn_kwargs = {k: v for k, v in attn_kwargs.items() if k in params}
        except (TypeError, ValueError):
            pass
        if sow_weights:
            x = self.attention_fn(query, key, value, **attn_kwargs, module=self)
        else:
            x = self.attention_fn(query, key, value, **attn_kwargs)
        return DenseGeneral(
            features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
            dtype=self.dtype, param_dtype=self.param_dtype, name="out", precision=self.precision)(x)

    def _decode_step(self, query, key, value, mask):
        """Flax's ``decode=True`` block: create the ``'cache'`` variables (zeros of the
        projected key's/value's shape and dtype, and ``cache_index``), or, when they exist,
        write this call's key/value at ``cache_index``, advance it and mask the positions
        not yet written. Returns the key, value and mask the attention uses."""
        name = type(self).__name__
        # Flax detects initialisation by the absence of the cache
        is_initialized = self.has_variable("cache", "cached_key")
        if not is_initialized and not self.is_mutable_collection("cache"):
            scope = self._need_scope("variable")
            if not scope.variables().get("cache"):   # Flax: ScopeCollectionNotFound
                raise _CacheCollectionNotFound("cache", "cached_key", scope.path_text, name)
        cached_key = self.variable("cache", "cached_key", _cache_zeros, key)
        cached_value = self.variable("cache", "cached_value", _cache_zeros, value)
        cache_index = self.variable("cache", "cache_index", _cache_index0, key)
        if not is_initialized:
            return key, value, mask
        *batch_dims, max_length, num_heads, depth_per_head = cached_key.value.shape
        # shape check of the cached keys against the query
        expected_shape = tuple(batch_dims) + (1, num_heads, depth_per_head)
        if expected_shape != tuple(query.shape):
            raise ValueError(f"Autoregressive cache shape error, expected query shape "
                             f"{expected_shape} instead got {tuple(query.shape)}.")
        # the new one-position keys/values go in at cache_index (read once to the host:
        # ctrainstate runs eagerly, and the index also builds the host mask below)
        old_index = cache_index.value
        abstract = _is_abstract(query, key, value, old_index, cached_key.value)
        cur_index = None if abstract else int(np.asarray(old_index))
        indices = (0,) * len(batch_dims) + (cur_index if cur_index is not None else old_index,
                                           0, 0)
        key = _lax.dynamic_update_slice(cached_key.value, key, indices)
        value = _lax.dynamic_update_slice(cached_value.value, value, indices)
        cached_key.value = key
        cached_value.value = value
        cache_index.value = _cache_index_next(old_index, cur_index, key)
        # causal mask for cached decoder self-attention: the single query position attends
        # to the positions generated and cached so far, not the remaining zeros
        cshape = tuple(batch_dims) + (1, 1, max_length)
        if abstract:
            causal = ShapeDtypeStruct(cshape, _dtypes.float32)
            if mask is None:
                return key, value, causal
            mshape = tuple(np.shape(mask))
            if len(mshape) != len(cshape):
                raise ValueError(f"combine_masks: masks must have same rank: "
                                 f"{(len(mshape), len(cshape))}")
            return key, value, ShapeDtypeStruct(np.broadcast_shapes(mshape, cshape),
                                                _dtypes.float32)
        causal = np.broadcast_to(np.arange(max_length) <= cur_index, cshape)
        return key, value, combine_masks(mask, causal)


class _CacheCollectionNotFound(ScopeVariableNotFoundError):
    """``flax.errors.ScopeCollectionNotFound`` for the decoding cache: ``decode=True`` was
    applied without a ``'cache'`` collection and without ``mutable=['cache']``."""

    def __init__(self, col, name, scope_path, layer):
        KeyError.__init__(
            self, f'Tried to access "{name}" from collection "{col}" in "{scope_path}" but the '
                  f'collection is empty. ({layer}(decode=True) needs the cache: create it with '
                  f'variables = model.init(key, inputs) on full-length inputs, or '
                  f'model.apply(variables, inputs, mutable=["cache"]), then decode one position '
                  f'a call with model.apply({{"params": ..., "cache": ...}}, inputs, '
                  f'mutable=["cache"]).)')


def _cache_zeros(x):
    """Flax's ``jnp.zeros(x.shape, x.dtype)`` for ``cached_key``/``cached_value``, born with
    ``x``'s sharding (each device writes zeros into its own block; a ShapeDtypeStruct
    inside ``eval_shape``)."""
    return cnp.zeros_like(x)


def _index_sharding(like):
    """Replicated where ``like`` (the projected key) lives: over its mesh, or its device."""
    s = getattr(like, "sharding", None)
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, PartitionSpec())
    return s   # a SingleDeviceSharding, or None (device_put's default placement)


def _cache_index0(like):
    """Flax's ``jnp.array(0, dtype=jnp.int32)``, placed replicated with the key."""
    return cnp.array(0, dtype=_dtypes.int32, device=_index_sharding(like))


def _cache_index_next(old, cur, like):
    """``cache_index + 1`` (int32, in ``old``'s placement): computed on the host from the
    value already read (ctrainstate ops compute in floats only)."""
    if cur is None:      # eval_shape
        return ShapeDtypeStruct((), _dtypes.int32, getattr(old, "sharding", None))
    sharding = old.sharding if isinstance(old, Array) else _index_sharding(like)
    return cnp.array(np.int32(cur + 1), dtype=_dtypes.int32, device=sharding)


class MultiHeadAttention(MultiHeadDotProductAttention):
    """Alias of :class:`MultiHeadDotProductAttention` (``flax.linen.MultiHeadAttention``);
    auto-named ``MultiHeadAttention_N``, which changes parameter paths and RNG streams."""


class SelfAttention(MultiHeadDotProductAttention):
    """Self-attention (``flax.linen.SelfAttention``, deprecated there in favour of
    ``MultiHeadDotProductAttention(...)(inputs_q)``): ``__call__(inputs_q, mask=None,
    deterministic=None, dropout_rng=None, sow_weights=False)``, warning as Flax does."""

    @compact
    def __call__(self, inputs_q, mask=None, deterministic=None, dropout_rng=None,  # type: ignore[override]
                 sow_weights: bool = False):
        warnings.warn("SelfAttention will be deprecated soon. Use "
                      "`MultiHeadDotProductAttention.__call__(inputs_q)` instead.",
                      DeprecationWarning)
        return super().__call__(inputs_q, mask=mask, deterministic=deterministic,
                                dropout_rng=dropout_rng, sow_weights=sow_weights)


# --- masks ---------------------------------------------------------------------------------

# pairwise functions make_attention_mask runs on devices besides multiply (by jnp's names)
_PAIRWISE = {"equal", "not_equal", "greater", "greater_equal", "less", "less_equal",
             "logical_and", "logical_or"}


def _is_multiply(fn) -> bool:
    return fn is np.multiply or fn is cnp.multiply or fn is _ops.multiply or \
        getattr(fn, "__name__", None) == "multiply"


def make_attention_mask(query_input, key_input, pairwise_fn: Callable = np.multiply,
                        extra_batch_dims: int = 0, dtype=np.float32):
    """``pairwise_fn(query_input[..., :, None], key_input[..., None, :])`` with a heads
    dimension: ``[batch..., len_q]``, ``[batch..., len_kv]`` -> ``[batch..., 1, len_q,
    len_kv]`` as ``dtype`` (``flax.linen.make_attention_mask``); ``extra_batch_dims``
    leading size-1 dims are added.

    Host inputs (numpy arrays, the usual padding masks ``tokens > 0``) give a numpy array
    (``dtype`` as jax canonicalises it: float64 -> float32). Arrays run on their devices
    with ``pairwise_fn`` multiply, a comparison (``equal``, ``greater_equal``, ...: jnp's or
    ctrainstate.numpy's, e.g. segment ids compared) or ``logical_and`` / ``logical_or``, and
    give a float32 Array (or ``dtype``, converted block by block).

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> tokens = np.array([[5, 7, 0]])
    >>> nn.make_attention_mask(tokens > 0, tokens > 0)[0, 0].tolist()
    [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    """
    dt = _dtypes.canonicalize(dtype)
    if isinstance(query_input, Array) or isinstance(key_input, Array):
        name = getattr(pairwise_fn, "__name__", None)
        if not _is_multiply(pairwise_fn) and name not in _PAIRWISE:
            raise TypeError(
                f"make_attention_mask on ctrainstate Arrays: pairwise_fn {name or pairwise_fn!r} "
                f"cannot run on devices (multiply, the comparisons and logical_and / logical_or "
                f"can: {sorted(_PAIRWISE)}); build the mask from host arrays, e.g. "
                f"make_attention_mask(np.asarray(q), np.asarray(k), ...)")
        if not _is_multiply(pairwise_fn):   # a comparison (segment ids, positions): any dtypes
            place = next(_ops._place_of(v) for v in (query_input, key_input) if isinstance(v, Array))
            q, k = (v if isinstance(v, Array) else _ops._lift_any(v, place)
                    for v in (query_input, key_input))
            mask = getattr(_elementwise, name)(cnp.expand_dims(q, -1), cnp.expand_dims(k, -2))
            mask = cnp.expand_dims(mask.astype(np.float32), -3)
            mask = cnp.reshape(mask, (1,) * int(extra_batch_dims) + mask.shape)
            return mask if dt == np.float32 else mask.astype(dt)
        q = _float_operand(query_input) if isinstance(query_input, Array) else None
        place = _ops._place_of(q) if q is not None else None
        k = _float_operand(key_input, place)
        q = q if q is not None else _float_operand(query_input, _ops._place_of(k))
        mask = cnp.multiply(cnp.expand_dims(q, -1), cnp.expand_dims(k, -2))
        mask = cnp.expand_dims(mask, -3)
        mask = cnp.reshape(mask, (1,) * int(extra_batch_dims) + mask.shape)
        return mask if dt == np.float32 else mask.astype(dt)
    mask = pairwise_fn(np.expand_dims(np.asarray(query_input), -1),
                       np.expand_dims(np.asarray(key_input), -2))
    mask = np.expand_dims(np.asarray(mask), -3)
    mask = np.expand_dims(mask, tuple(range(int(extra_batch_dims))))
    return mask.astype(dt)


def make_causal_mask(x, extra_batch_dims: int = 0, dtype=np.float32):
    """Causal mask for self-attention (``flax.linen.make_causal_mask``): ``x`` of shape
    ``[batch..., len]`` gives ``[batch..., 1, len, len]``, 1 where the key position is not
    after the query position. Only ``x``'s shape is read, so the result is always a host
    numpy array (an Array ``x`` is not gathered).

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> nn.make_causal_mask(np.ones((1, 3)))[0, 0].tolist()
    [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    """
    shape = tuple(np.shape(x)) if not isinstance(x, Array) else tuple(x.shape)
    if not shape:
        raise ValueError("make_causal_mask: x must have at least one dim [batch..., len], got a "
                         "scalar")
    idxs = np.broadcast_to(np.arange(shape[-1], dtype=np.int32), shape)
    return make_attention_mask(idxs, idxs, np.greater_equal, extra_batch_dims=extra_batch_dims,
                               dtype=dtype)


def combine_masks(*masks, dtype=np.float32):
    """Logical and of the masks that are not None, as ``dtype`` (``flax.linen.combine_masks``);
    None when none is given. The masks must have the same rank (they broadcast). Host masks
    give a numpy array; if any is an Array the result is an Array (float32, or ``dtype``).

    >>> import numpy as np
    >>> from ctrainstate import nn
    >>> nn.combine_masks(np.array([[1, 1, 0]]), None, np.array([[0, 1, 1]])).tolist()
    [[0.0, 1.0, 0.0]]
    """
    ms = [m for m in masks if m is not None]
    if not ms:
        return None
    ranks = tuple(len(np.shape(m)) if not isinstance(m, Array) else m.ndim for m in ms)
    if len(set(ranks)) != 1:
        raise ValueError(f"combine_masks: masks must have same rank: {ranks}")
    dt = _dtypes.canonicalize(dtype)
    if not any(isinstance(m, Array) for m in ms):
        mask = np.asarray(ms[0])
        for other in ms[1:]:
            mask = np.logical_and(mask, np.asarray(other))
        return np.asarray(mask).astype(dt)
    place = next(_ops._place_of(m) for m in ms if isinstance(m, Array))
    out = None
    for m in ms:
        # 1.0 where set (nonzero), else 0.0
        f = cnp.where(_mask_operand(m), _ops._lift(1.0, place), 0.0)
        out = f if out is None else cnp.multiply(out, f)
    return out if dt == np.float32 else out.astype(dt)


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
