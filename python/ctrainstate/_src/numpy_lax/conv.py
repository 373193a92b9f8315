"""Convolutions and window reductions: ``lax.conv_general_dilated``, ``lax.conv``,
``lax.conv_transpose``, ``lax.conv_general_dilated_patches`` / ``_local`` and
``lax.reduce_window`` (the ops under ``flax.linen.Conv``, ``ConvLocal``, ``ConvTranspose``
and the pooling functions), composed from differentiable Array ops.

A convolution is computed as patches times kernel (im2col): the input is moved to
``(batch, spatial..., features)``, dilated (``lhs_dilation``: zeros between elements) and
padded (negative padding crops), then for every kernel offset a strided slice of it is
taken; the slices joined along the features form the patches ``(batch, out spatial...,
kernel positions * in features)``, and one matrix product with the kernel reshaped to
``(kernel positions * in features, out features)`` gives the output (grouped convolutions:
one product per group, an ``einsum``). Every step is an Array op on the tape, so the
gradients with respect to the input and the kernel are the transposed convolutions jax's
rules give, and the product runs on the BLAS (CPU) or cuBLAS (GPU) with the ``precision=``
of the matrix products (see :mod:`ctrainstate._src.base.precision`). The patches hold each input
element once per kernel position that reads it: about ``prod(kernel) / prod(strides)``
times the input, the price of one large product instead of many small ones. A locally
connected convolution stacks the same slices in jax's patch order (input feature first) and
multiplies each output position's patches by its own kernel (a batched product).

A batch dimension sharded over mesh axes (data parallelism) stays sharded; a kernel
sharded on its output features (``nn.with_partitioning(..., (None, None, None, 'model'))``)
gives an output sharded on its features; the padded spatial dimensions come out unsharded
(``cnp.pad``'s rule).

``reduce_window`` folds ``computation`` over the window positions in row-major order,
starting from ``init_value`` (padding and base-dilation holes hold ``init_value``, as in
XLA). For ``max`` / ``min`` with the identity init (``-inf`` / ``+inf``) one element of each
window is selected by XLA's ``select_and_scatter`` rule (the kept element stays while it is
``>=`` the next, so the first of tied maxima; a NaN on either side moves the selection on)
and the gradient goes to it alone, as in jax; the value is NaN where the window holds one. A
generic two-argument ``computation`` is applied as given (its own gradient).
"""
from __future__ import annotations

import operator as _op
import math
import operator

import numpy as np

from ..base import dtypes as _dtypes
from . import numpy as cnp
from ..array.array import Array
from ..ops.move import flip, pad
from ..base.precision import resolve_precision
from ..ops.slicing import concatenate, stack
from ..base.hooks import upper as _upper

__all__ = ["conv_general_dilated", "conv_general_dilated_local",
           "conv_general_dilated_patches", "conv", "conv_with_general_padding", "conv_transpose",
           "conv_dimension_numbers", "ConvDimensionNumbers", "padtype_to_pads",
           "reduce_window"]


def _is_float(dt) -> bool:
    return np.dtype(dt) in (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16)


class ConvDimensionNumbers(tuple):
    """``(lhs_spec, rhs_spec, out_spec)``, each a tuple of dimension indices: lhs and out
    ``(batch, feature, spatial...)``, rhs ``(out feature, in feature, spatial...)``
    (``jax.lax.ConvDimensionNumbers``)."""

    def __new__(cls, lhs_spec, rhs_spec, out_spec):
        return super().__new__(cls, (tuple(lhs_spec), tuple(rhs_spec), tuple(out_spec)))

    lhs_spec = property(lambda self: self[0])
    rhs_spec = property(lambda self: self[1])
    out_spec = property(lambda self: self[2])

    def __repr__(self):
        return (f"ConvDimensionNumbers(lhs_spec={self[0]}, rhs_spec={self[1]}, "
                f"out_spec={self[2]})")


def _spec_perms(specs, ndim):
    """jax's ``conv_general_permutations`` for three layout strings, checked."""
    if len(specs) != 3 or not all(isinstance(s, str) for s in specs):
        raise TypeError(f"conv: dimension_numbers as strings must be three strings "
                        f"(lhs, rhs, out), e.g. ('NHWC', 'HWIO', 'NHWC'); got {specs!r}")
    lhs, rhs, out = specs
    for name, s, pair in (("lhs", lhs, "NC"), ("rhs", rhs, "OI"), ("out", out, "NC")):
        if len(s) != ndim:
            raise TypeError(f"conv: {name} layout {s!r} has {len(s)} letters for operands of "
                            f"rank {ndim}")
        if len(set(s)) != len(s):
            raise TypeError(f"conv: {name} layout {s!r} repeats a letter")
        for c in pair:
            if c not in s:
                raise TypeError(f"conv: {name} layout {s!r} has no {c!r} dimension")
    sp_rhs = [c for c in rhs if c not in "OI"]
    for name, s, pair in (("lhs", lhs, "NC"), ("out", out, "NC")):
        sp = sorted(c for c in s if c not in pair)
        if sp != sorted(sp_rhs):
            raise TypeError(f"conv: the spatial letters of {name} layout {s!r} differ from "
                            f"the kernel's ({rhs!r})")

    def perm(s, pair):
        rest = sorted((i for i, c in enumerate(s) if c not in pair),
                      key=lambda i: rhs.index(s[i]))
        return (s.index(pair[0]), s.index(pair[1])) + tuple(rest)

    return ConvDimensionNumbers(perm(lhs, "NC"), perm(rhs, "OI"), perm(out, "NC"))


def conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers) -> ConvDimensionNumbers:
    """``jax.lax.conv_dimension_numbers``: ``None`` (``NC...``, ``OI...``, ``NC...``), three
    layout strings such as ``('NHWC', 'HWIO', 'NHWC')``, or a :class:`ConvDimensionNumbers`
    / triple of index tuples, as :class:`ConvDimensionNumbers`."""
    nd = len(lhs_shape)
    if len(rhs_shape) != nd:
        raise TypeError(f"conv: lhs and rhs must have the same rank, got shapes "
                        f"{tuple(lhs_shape)} and {tuple(rhs_shape)}")
    if nd < 2:
        raise TypeError(f"conv: operands must have rank >= 2 (batch and feature "
                        f"dimensions), got shape {tuple(lhs_shape)}")
    if dimension_numbers is None:
        iota = tuple(range(nd))
        return ConvDimensionNumbers(iota, iota, iota)
    if isinstance(dimension_numbers, (tuple, list)) and len(dimension_numbers) == 3 and \
            all(isinstance(s, str) for s in dimension_numbers):
        return _spec_perms(tuple(dimension_numbers), nd)
    try:
        specs = tuple(tuple(operator.index(i) for i in s) for s in dimension_numbers)
    except TypeError:
        raise TypeError(f"conv: dimension_numbers must be None, three layout strings or "
                        f"three tuples of dimension indices, got {dimension_numbers!r}") \
            from None
    if len(specs) != 3 or any(sorted(s) != list(range(nd)) for s in specs):
        raise TypeError(f"conv: each of the three dimension-number tuples must be a "
                        f"permutation of range({nd}), got {dimension_numbers!r}")
    return ConvDimensionNumbers(*specs)


def _ints(v, n, what, *, minimum=1):
    if v is None:
        return (1,) * n
    try:
        t = tuple(operator.index(i) for i in v)
    except TypeError:
        raise TypeError(f"conv: {what} must be a sequence of {n} ints, got {v!r}") from None
    if len(t) != n:
        raise ValueError(f"conv: {what} must have {n} entries (one per spatial dimension), "
                         f"got {t}")
    if any(i < minimum for i in t):
        raise ValueError(f"conv: {what} entries must be >= {minimum}, got {t}")
    return t


def padtype_to_pads(in_shape, window_shape, window_strides, padding):
    """``jax.lax.padtype_to_pads``: ``'VALID'``, ``'SAME'`` or ``'SAME_LOWER'`` (any case) as
    one ``(low, high)`` pair per dimension. ``SAME`` keeps ``ceil(in / stride)`` outputs,
    the odd element of the padding going after (``SAME_LOWER``: before)."""
    if not isinstance(padding, str) or padding.upper() not in ("VALID", "SAME", "SAME_LOWER"):
        raise ValueError(f"padding {padding!r}: expected 'VALID', 'SAME' or 'SAME_LOWER', or "
                         f"a sequence of (low, high) pairs")
    p = padding.upper()
    if p == "VALID":
        return [(0, 0)] * len(in_shape)
    pads = []
    for n, k, s in zip(in_shape, window_shape, window_strides):
        out = -(-int(n) // int(s))
        total = max((out - 1) * int(s) + int(k) - int(n), 0)
        lo = total // 2 if p == "SAME" else total - total // 2
        pads.append((lo, total - lo))
    return pads


def _explicit_pads(padding, n, what):
    try:
        pads = tuple((operator.index(lo), operator.index(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: padding must be a string or a sequence of (low, high) "
                         f"int pairs, got {padding!r}") from None
    if len(pads) != n:
        raise ValueError(f"{what}: padding has {len(pads)} (low, high) pairs for {n} "
                         f"spatial dimensions")
    return pads


def _permuted(x, perm):
    """``transpose(x, perm)``, or ``x`` itself for the identity (transposes copy)."""
    return x if tuple(perm) == tuple(range(x.ndim)) else cnp.transpose(x, perm)


def _dilate(x, axis, d, fill):
    """``d - 1`` copies of ``fill`` between consecutive elements along ``axis``."""
    n = x.shape[axis]
    if d == 1 or n <= 1:
        return x
    y = cnp.expand_dims(x, axis + 1)
    pw = [(0, 0)] * y.ndim
    pw[axis + 1] = (0, d - 1)
    y = pad(y, pw, constant_values=fill)
    shape = list(x.shape)
    shape[axis] = n * d
    y = cnp.reshape(y, tuple(shape))
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(0, (n - 1) * d + 1)
    return y[tuple(idx)]


def _pad_crop(x, axes, pads, fill):
    """``x`` padded with ``fill`` by ``(lo, hi)`` on each of ``axes``; negative amounts crop."""
    grow = [(0, 0)] * x.ndim
    crop = [slice(None)] * x.ndim
    any_grow = any_crop = False
    for ax, (lo, hi) in zip(axes, pads):
        grow[ax] = (max(lo, 0), max(hi, 0))
        any_grow |= lo > 0 or hi > 0
        if lo < 0 or hi < 0:
            n = x.shape[ax] + max(lo, 0) + max(hi, 0)
            start, stop = -min(lo, 0), n + min(hi, 0)
            if stop < start:
                raise ValueError(f"padding {pads}: the negative padding removes more than "
                                 f"the {x.shape[ax]} elements of dimension {ax}")
            crop[ax] = slice(start, stop)
            any_crop = True
    if any_grow:
        x = pad(x, grow, constant_values=fill)
    if any_crop:
        x = x[tuple(crop)]
    return x


def _windows(x, axes, window, strides, wdil, out):
    """For each window offset (row-major), the strided slice of ``x`` it reads: the list
    of slices of shape ``x.shape`` with ``out[i]`` along ``axes[i]``."""
    slices = []
    for offs in np.ndindex(*window):
        idx = [slice(None)] * x.ndim
        for ax, o, s, d, m in zip(axes, offs, strides, wdil, out):
            start = o * d
            idx[ax] = slice(start, start + (m - 1) * s + 1, s)
        slices.append(x[tuple(idx)])
    return slices


def _out_sizes(sizes, window, strides, wdil):
    out = []
    for n, k, s, d in zip(sizes, window, strides, wdil):
        keff = (k - 1) * d + 1
        out.append(max(0, (n - keff) // s + 1) if n >= keff else 0)
    return out


def _check_operands(lhs, rhs, what):
    lhs, rhs = cnp.asarray(lhs), cnp.asarray(rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{what} requires arguments to have the same dtypes, "
                        f"got {lhs.dtype} and {rhs.dtype}")
    if not _is_float(lhs.dtype):
        raise TypeError(f"{what}: floating-point operands only, got {lhs.dtype}")
    return lhs, rhs


def _prepared(lhs, lperm, ksp, window_strides, padding, lhs_dilation, rhs_dilation,
              preferred_element_type, what):
    """The common start of the convolutions: ``(x, strides, rdil, out, out_dtype)`` with
    ``x`` the input moved to ``(N, spatial..., C)``, dilated, padded (or cropped) and cast to
    ``preferred_element_type``; ``out`` the output's spatial sizes."""
    nsp = lhs.ndim - 2
    strides = _ints(window_strides, nsp, "window_strides")
    ldil = _ints(lhs_dilation, nsp, "lhs_dilation")
    rdil = _ints(rhs_dilation, nsp, "rhs_dilation")
    if isinstance(padding, str):
        if any(d != 1 for d in ldil):
            raise ValueError("String padding is not implemented for transposed convolution "
                             "using this op (lhs_dilation > 1). Please either exactly specify "
                             "the required padding or use conv_transpose.")
        keff = [(k - 1) * d + 1 for k, d in zip(ksp, rdil)]
        pads = padtype_to_pads([lhs.shape[i] for i in lperm[2:]], keff, strides, padding)
    else:
        pads = _explicit_pads(padding, nsp, what)
    out_dtype = lhs.dtype
    if preferred_element_type is not None:
        pe = _dtypes.canonicalize(preferred_element_type)
        if not _is_float(pe):
            raise TypeError(f"{what}: preferred_element_type must be a float dtype, got "
                            f"{preferred_element_type!r}")
        if pe != lhs.dtype:
            lhs, out_dtype = cnp.astype(lhs, pe), pe
    x = _permuted(lhs, (lperm[0],) + tuple(lperm[2:]) + (lperm[1],))
    sp_axes = tuple(range(1, nsp + 1))
    for ax, d in zip(sp_axes, ldil):
        x = _dilate(x, ax, d, 0.0)
    x = _pad_crop(x, sp_axes, pads, 0.0)
    out = _out_sizes([x.shape[a] for a in sp_axes], ksp, strides, rdil)
    return x, strides, rdil, out, out_dtype


def _to_out_layout(y, operm):
    """``y`` as ``(N, spatial..., C)`` with each logical dimension moved where ``operm``
    (the output spec) puts it."""
    nsp = y.ndim - 2
    logical = {operm[0]: 0, operm[1]: nsp + 1}
    for i, p in enumerate(operm[2:]):
        logical[p] = 1 + i
    return _permuted(y, tuple(logical[p] for p in range(y.ndim)))


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                         batch_group_count=1, precision=None, preferred_element_type=None):
    """``jax.lax.conv_general_dilated``: an n-d convolution (cross-correlation, as XLA's).

    ``window_strides``: one int per spatial dimension; ``padding``: ``'VALID'``,
    ``'SAME'``, ``'SAME_LOWER'`` or one ``(low, high)`` pair per spatial dimension (negative
    crops); ``lhs_dilation`` (zeros between input elements: a transposed convolution; with a
    string padding jax raises and so does this) and ``rhs_dilation`` (atrous);
    ``dimension_numbers``: ``None`` (``NC...``/``OI...``/``NC...``), layout strings such as
    ``('NHWC', 'HWIO', 'NHWC')`` or :class:`ConvDimensionNumbers`; ``feature_group_count``
    (grouped / depthwise); ``precision`` as :func:`ctrainstate.numpy.matmul`'s;
    ``preferred_element_type`` ``None`` or a float dtype the output is computed in
    (``float32`` with 16-bit operands: a float32 result). ``batch_group_count`` other than
    1 raises ``NotImplementedError``. Floating-point operands of one dtype (jax raises a
    ``TypeError`` for mixed dtypes, as here). Differentiable in both operands; see the
    module docstring for how it is computed and sharded.

    >>> import numpy as np, ctrainstate.lax as lax
    >>> x = np.arange(5, dtype=np.float32).reshape(1, 1, 5)       # N C W
    >>> w = np.array([[[1.0, 0.0, -1.0]]], np.float32)              # O I W
    >>> np.asarray(lax.conv_general_dilated(x, w, (1,), 'VALID')).tolist()
    [[[-2.0, -2.0, -2.0]]]
    """
    if int(batch_group_count) != 1:
        raise NotImplementedError("conv_general_dilated: batch_group_count != 1 is not "
                                  "supported")
    lhs, rhs = _check_operands(lhs, rhs, "conv_general_dilated")
    dn = conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    try:
        groups = operator.index(feature_group_count)
    except TypeError:
        raise TypeError(f"conv: feature_group_count must be an int, got "
                        f"{feature_group_count!r}") from None
    lperm, rperm, operm = dn
    cin, cout = lhs.shape[lperm[1]], rhs.shape[rperm[0]]
    kin = rhs.shape[rperm[1]]
    ksp = [rhs.shape[i] for i in rperm[2:]]
    if groups < 1:
        raise ValueError(f"conv: feature_group_count must be >= 1, got {groups}")
    if cin != kin * groups:
        raise ValueError(f"conv: the input has {cin} features but the kernel's input "
                         f"dimension is {kin} with feature_group_count={groups} (expected "
                         f"{cin} = {kin} * {groups}); lhs {lhs.shape}, rhs {rhs.shape}")
    if cout % groups:
        raise ValueError(f"conv: the kernel's {cout} output features are not a multiple of "
                         f"feature_group_count={groups}")
    x, strides, rdil, out, out_dtype = _prepared(
        lhs, lperm, ksp, window_strides, padding, lhs_dilation, rhs_dilation,
        preferred_element_type, "conv_general_dilated")
    if out_dtype != rhs.dtype:
        rhs = cnp.astype(rhs, out_dtype)
    # rhs as (spatial..., I, O)
    w = _permuted(rhs, tuple(rperm[2:]) + (rperm[1], rperm[0]))
    sp_axes = tuple(range(1, x.ndim - 1))
    n = x.shape[0]
    kpos = math.prod(ksp)
    if n == 0 or cout == 0 or any(m == 0 for m in out) or kpos * kin == 0:
        y = cnp.zeros((n,) + tuple(out) + (cout,), out_dtype)
    else:
        wins = _windows(x, sp_axes, ksp, strides, rdil, out)
        # joined along the features: (N, out..., kpos * C) in (position, feature) order,
        # the row-major flattening of the kernel's (spatial..., I): no stack, no reshape copy
        patches = concatenate(wins, axis=-1) if kpos > 1 else wins[0]
        if groups == 1:
            y = cnp.matmul(patches, cnp.reshape(w, (kpos * kin, cout)), precision=precision)
        else:
            og = cout // groups
            m = math.prod(out)
            patches = cnp.reshape(patches, (n, m, kpos, groups, kin))
            wk = cnp.reshape(w, (kpos, kin, groups, og))
            y = cnp.einsum("nmkgc,kcgo->nmgo", patches, wk, precision=precision)
            y = cnp.reshape(y, (n,) + tuple(out) + (cout,))
    return _to_out_layout(y, operm)


def _filter_specs(lhs, filter_shape, dimension_numbers, what):
    """``(dn, ksp, order)`` for the patch functions: the dimension numbers of a kernel of
    shape ``(1, 1) + filter_shape`` (jax's), the window size of each spatial dimension, and
    the spatial dimensions in the order the kernel lays them out (the order the patches'
    feature dimension flattens them in)."""
    try:
        fs = tuple(operator.index(k) for k in filter_shape)
    except TypeError:
        raise TypeError(f"{what}: filter_shape must be a sequence of ints, got "
                        f"{filter_shape!r}") from None
    if len(fs) != lhs.ndim - 2:
        raise ValueError(f"{what}: filter_shape {fs} must have one entry per spatial "
                         f"dimension of the {lhs.ndim}-d input ({lhs.ndim - 2})")
    if any(k < 1 for k in fs):
        raise ValueError(f"{what}: filter_shape entries must be >= 1, got {fs}")
    dn = conv_dimension_numbers(lhs.shape, (1, 1) + fs, dimension_numbers)
    rsp = list(dn[1][2:])
    # the kernel's spatial dimensions hold filter_shape in the order they appear in it
    rank = {p: r for r, p in enumerate(sorted(rsp))}
    ksp = [fs[rank[p]] for p in rsp]
    order = sorted(range(len(rsp)), key=lambda i: rsp[i])
    return dn, ksp, order


def _patches(lhs, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation,
             dimension_numbers, preferred_element_type, what):
    """``(patches as (N, out spatial..., C * prod(filter_shape)), dn)``: the features in
    jax's order, the input feature first, then the window offset, row-major over the
    kernel's spatial dimensions in the order the kernel spec lists them."""
    dn, ksp, order = _filter_specs(lhs, filter_shape, dimension_numbers, what)
    lperm = dn[0]
    x, strides, rdil, out, out_dtype = _prepared(
        lhs, lperm, ksp, window_strides, padding, lhs_dilation, rhs_dilation,
        preferred_element_type, what)
    n, c = x.shape[0], x.shape[-1]
    kpos = math.prod(ksp)
    if n == 0 or c == 0 or any(m == 0 for m in out):
        return cnp.zeros((n,) + tuple(out) + (c * kpos,), out_dtype), dn
    nsp = len(ksp)
    wins = _windows(x, tuple(range(1, nsp + 1)), ksp, strides, rdil, out)
    if kpos == 1:
        return wins[0], dn
    p = stack(wins, axis=-1)                    # (N, out..., C, kpos): spatial-index order
    base = 1 + nsp + 1                          # the first offset axis
    p = cnp.reshape(p, (n,) + tuple(out) + (c,) + tuple(ksp))
    perm = tuple(range(base)) + tuple(base + i for i in order)
    p = _permuted(p, perm)
    return cnp.reshape(p, (n,) + tuple(out) + (c * kpos,)), dn


def conv_general_dilated_patches(lhs, filter_shape, window_strides, padding,
                                 lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                                 precision=None, preferred_element_type=None):
    """``jax.lax.conv_general_dilated_patches``: the patches a convolution with a kernel of
    spatial shape ``filter_shape`` reads, as the output's feature dimension (size
    ``C * prod(filter_shape)``, ordered as jax's: the input feature, then the offset in the
    window, row-major over the kernel spec's spatial letters, e.g. ``'cHW'`` for
    ``'OIHW'``). Arguments as :func:`conv_general_dilated`'s (``filter_shape`` in the order of
    the kernel spec's spatial dimensions); the patches are slices of the (dilated, padded)
    input, copied exactly. ``precision`` is accepted for jax's signature and checked.

    >>> import numpy as np, ctrainstate.lax as lax
    >>> x = np.arange(4, dtype=np.float32).reshape(1, 1, 4)       # N C W
    >>> np.asarray(lax.conv_general_dilated_patches(x, (2,), (1,), 'VALID'))[0].tolist()
    [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]
    """
    resolve_precision(precision, "conv_general_dilated_patches")
    lhs = cnp.asarray(lhs)
    if not _is_float(lhs.dtype):
        raise TypeError(f"conv_general_dilated_patches: floating-point operands only, got "
                        f"{lhs.dtype}")
    p, dn = _patches(lhs, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation,
                     dimension_numbers, preferred_element_type, "conv_general_dilated_patches")
    return _to_out_layout(p, dn[2])


def conv_general_dilated_local(lhs, rhs, window_strides, padding, filter_shape,
                               lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                               precision=None):
    """``jax.lax.conv_general_dilated_local``: a locally connected (unshared) convolution,
    a separate kernel at every output position (``flax.linen.ConvLocal``).

    ``rhs``'s spatial dimensions are the output's positions and its ``I`` dimension is the
    patch of :func:`conv_general_dilated_patches` (``C * prod(filter_shape)``, input feature
    first); with ``('NHWC', 'HWIO', 'NHWC')`` it is ``(out H, out W, C * kH * kW, O)``. Other
    arguments as :func:`conv_general_dilated`'s; ``precision`` applies to the product of the
    patches and the kernel. Differentiable in both operands.

    >>> import numpy as np, ctrainstate.lax as lax
    >>> x = np.arange(4, dtype=np.float32).reshape(1, 1, 4)       # N C W
    >>> w = np.array([[[1.0, 1.0, 1.0], [0.0, 1.0, -1.0]]], np.float32)  # O I W
    >>> np.asarray(lax.conv_general_dilated_local(x, w, (1,), 'VALID', (2,))).tolist()
    [[[0.0, 3.0, -1.0]]]
    """
    what = "conv_general_dilated_local"
    lhs, rhs = _check_operands(lhs, rhs, what)
    if rhs.ndim != lhs.ndim:
        raise TypeError(f"{what}: lhs and rhs must have the same rank, got shapes "
                        f"{lhs.shape} and {rhs.shape}")
    p, dn = _patches(lhs, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation,
                     dimension_numbers, None, what)
    rperm, operm = dn[1], dn[2]
    out = tuple(p.shape[1:-1])
    psize = int(p.shape[-1])
    w = _permuted(rhs, tuple(rperm[2:]) + (rperm[1], rperm[0]))   # (out..., I, O)
    if tuple(w.shape[:-2]) != out or int(w.shape[-2]) != psize:
        raise ValueError(
            f"{what}: the kernel of shape {rhs.shape} does not fit: with dimension numbers "
            f"{dn} it must hold one kernel per output position {out} (its spatial "
            f"dimensions) and patches of {psize} = {int(lhs.shape[dn[0][1]])} input "
            f"features * {math.prod(int(k) for k in filter_shape)} window positions (its I "
            f"dimension); it has spatial {tuple(w.shape[:-2])} and I {int(w.shape[-2])}")
    n, cout, m = int(p.shape[0]), int(w.shape[-1]), math.prod(out)
    if n == 0 or cout == 0 or m == 0 or psize == 0:
        y = cnp.zeros((n,) + out + (cout,), lhs.dtype)
    else:
        y = cnp.einsum("nmp,mpo->nmo", cnp.reshape(p, (n, m, psize)),
                       cnp.reshape(w, (m, psize, cout)), precision=precision)
        y = cnp.reshape(y, (n,) + out + (cout,))
    return _to_out_layout(y, operm)


def conv(lhs, rhs, window_strides, padding, precision=None, preferred_element_type=None):
    """``jax.lax.conv``: :func:`conv_general_dilated` with ``NC...`` / ``OI...`` layouts and no
    dilation."""
    return conv_general_dilated(lhs, rhs, window_strides, padding, precision=precision,
                                preferred_element_type=preferred_element_type)


def conv_with_general_padding(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                              precision=None, preferred_element_type=None):
    """``jax.lax.conv_with_general_padding``: :func:`conv_general_dilated` with ``NC...`` /
    ``OI...`` layouts."""
    return conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
                                rhs_dilation=rhs_dilation, precision=precision,
                                preferred_element_type=preferred_element_type)


def _conv_transpose_padding(k, s, padding):
    """(before, after) padding of one dimension of a transposed convolution (jax's rule)."""
    if padding == "SAME":
        pad_len = k + s - 2
        pad_a = k - 1 if s > k - 1 else int(math.ceil(pad_len / 2))
    elif padding == "VALID":
        pad_len = k + s - 2 + max(k - s, 0)
        pad_a = k - 1
    else:
        raise ValueError(f"conv_transpose: invalid padding mode {padding!r}")
    return pad_a, pad_len - pad_a


_TRANSPOSE_DEFAULT_DN = {2: ("NC", "IO", "NC"), 3: ("NHC", "HIO", "NHC"),
                         4: ("NHWC", "HWIO", "NHWC"), 5: ("NHWDC", "HWDIO", "NHWDC")}


def conv_transpose(lhs, rhs, strides, padding, rhs_dilation=None, dimension_numbers=None,
                   transpose_kernel: bool = False, precision=None, preferred_element_type=None):
    """``jax.lax.conv_transpose``: the convolution with ``lhs_dilation=strides`` (a
    fractionally strided convolution). ``padding``: ``'SAME'`` / ``'VALID'`` (jax's
    transposed padding: ``SAME`` gives ``in * stride`` outputs) or explicit ``(low, high)``
    pairs applied to the dilated input; ``dimension_numbers`` default to channels-last
    (``NHWC`` / ``HWIO`` for 2-d); ``transpose_kernel=True`` flips the kernel's spatial
    dimensions and swaps its in/out features (the gradient of a forward convolution)."""
    lhs, rhs = cnp.asarray(lhs), cnp.asarray(rhs)
    nd = lhs.ndim
    if rhs.ndim != nd or nd < 2:
        raise TypeError(f"conv_transpose: operands of the same rank >= 2 expected, got "
                        f"shapes {lhs.shape} and {rhs.shape}")
    if dimension_numbers is None:
        if nd not in _TRANSPOSE_DEFAULT_DN:
            raise ValueError("conv_transpose: no default dimension_numbers for rank "
                             f"{nd} operands; pass dimension_numbers")
        dimension_numbers = _TRANSPOSE_DEFAULT_DN[nd]
    dn = conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    nsp = nd - 2
    strides = _ints(strides, nsp, "strides")
    rdil = _ints(rhs_dilation, nsp, "rhs_dilation")
    ksp = [rhs.shape[i] for i in dn.rhs_spec[2:]]
    keff = [(k - 1) * d + 1 for k, d in zip(ksp, rdil)]
    if isinstance(padding, str):
        if padding not in ("SAME", "VALID"):
            raise ValueError(f"conv_transpose: padding {padding!r}: expected 'SAME', 'VALID' "
                             f"or (low, high) pairs")
        pads = [_conv_transpose_padding(k, s, padding) for k, s in zip(keff, strides)]
    else:
        pads = _explicit_pads(padding, nsp, "conv_transpose")
    if transpose_kernel:
        rhs = flip(rhs, axis=tuple(dn.rhs_spec[2:]))
        perm = list(range(nd))
        o, i = dn.rhs_spec[0], dn.rhs_spec[1]
        perm[o], perm[i] = perm[i], perm[o]
        rhs = cnp.transpose(rhs, tuple(perm))
    return conv_general_dilated(lhs, rhs, (1,) * nsp, pads, lhs_dilation=strides,
                                rhs_dilation=rdil, dimension_numbers=dn, precision=precision,
                                preferred_element_type=preferred_element_type)


# --- reduce_window ------------------------------------------------------------------------

def _reducer_kind(computation):
    """'add', 'max', 'min' or 'mul' for the known monoid functions, else None."""
    _lax = _upper('lax')
    for mod, names in ((cnp, {"add": "add", "maximum": "max", "minimum": "min",
                              "multiply": "mul"}),
                       (_lax, {"add": "add", "max": "max", "min": "min", "mul": "mul"})):
        for name, kind in names.items():
            if getattr(mod, name, None) is computation:
                return kind
    return {id(_op.add): "add", id(_op.mul): "mul"}.get(id(computation))


def reduce_window(operand, init_value, computation, window_dimensions, window_strides,
                  padding, base_dilation=None, window_dilation=None):
    """``jax.lax.reduce_window``: ``computation`` folded over each window of ``operand``.

    ``window_dimensions`` / ``window_strides`` / ``base_dilation`` / ``window_dilation``: one
    int per dimension of ``operand``; ``padding``: ``'VALID'``, ``'SAME'`` or one ``(low,
    high)`` pair per dimension (padding and base-dilation holes hold ``init_value``).
    ``computation``: a two-argument function of Arrays (``lax.add``, ``lax.max``,
    ``lax.min``, ``cnp.add``, ``cnp.maximum``, ...). The fold starts from ``init_value`` and
    takes the window positions in row-major order. ``max`` / ``min`` with the identity
    ``init_value`` (``-inf`` / ``+inf``) route the gradient to one element per window, jax's
    (see the module docstring); their value is NaN where the window holds a NaN. Pytrees of
    operands are not supported.

    >>> import numpy as np, ctrainstate.lax as lax, ctrainstate.numpy as cnp
    >>> x = np.array([1.0, 3.0, 2.0, 5.0], np.float32)
    >>> np.asarray(lax.reduce_window(x, -np.inf, cnp.maximum, (2,), (2,), 'VALID')).tolist()
    [3.0, 5.0]
    """
    if isinstance(operand, (tuple, list)):
        raise NotImplementedError("reduce_window: pytrees of operands are not supported; "
                                  "reduce one array at a time")
    x = cnp.asarray(operand)
    nd = x.ndim
    try:
        window = tuple(operator.index(i) for i in window_dimensions)
        strides = tuple(operator.index(i) for i in window_strides)
    except TypeError:
        raise TypeError(f"reduce_window: window_dimensions and window_strides must be "
                        f"sequences of ints, got {window_dimensions!r}, "
                        f"{window_strides!r}") from None
    if len(window) != nd or len(strides) != nd:
        raise ValueError(f"reduce_window: window_dimensions {window} and window_strides "
                         f"{strides} must have one entry per dimension of the operand "
                         f"(rank {nd}, shape {x.shape})")
    if any(w < 1 for w in window) or any(s < 1 for s in strides):
        raise ValueError(f"reduce_window: window dimensions and strides must be >= 1, got "
                         f"{window} and {strides}")
    bdil = _ints(base_dilation, nd, "base_dilation") if base_dilation is not None \
        else (1,) * nd
    wdil = _ints(window_dilation, nd, "window_dilation") if window_dilation is not None \
        else (1,) * nd
    init = np.asarray(init_value.__array__() if isinstance(init_value, Array)
                      else init_value)
    if init.shape != ():
        raise TypeError(f"reduce_window: init_value must be a scalar, got shape {init.shape}")
    if not callable(computation):
        raise TypeError(f"reduce_window: computation must be a function, got "
                        f"{computation!r}")
    fill = float(init) if _is_float(x.dtype) else init.item()
    axes = tuple(range(nd))
    for ax, d in zip(axes, bdil):
        x = _dilate(x, ax, d, fill)
    if isinstance(padding, str):
        keff = [(k - 1) * d + 1 for k, d in zip(window, wdil)]
        pads = padtype_to_pads(x.shape, keff, strides, padding)
    else:
        pads = _explicit_pads(padding, nd, "reduce_window")
    x = _pad_crop(x, axes, pads, fill)
    out = _out_sizes(x.shape, window, strides, wdil)
    kind = _reducer_kind(computation)
    initv = np.asarray(init, dtype=x.dtype)
    if any(m == 0 for m in out):
        return cnp.zeros(tuple(out), x.dtype)
    wins = _windows(x, axes, window, strides, wdil, out)
    identity = {"max": -np.inf, "min": np.inf}.get(kind)
    if kind in ("max", "min") and _is_float(x.dtype) and float(init) == identity:
        # XLA's select_and_scatter: the kept element stays while `kept >= candidate` (`<=`
        # for min), so ties keep the first and a NaN on either side moves the selection on;
        # `where` passes the gradient to the selected element only. The value is the
        # window's NaN-propagating max: NaN where any element is NaN, added as a constant
        # so the gradient still reaches the selected element, as in jax.
        keep = cnp.greater_equal if kind == "max" else cnp.less_equal
        sel, nan = wins[0], cnp.isnan(wins[0])
        for s in wins[1:]:
            sel = cnp.where(keep(sel, s), sel, s)
            nan = cnp.logical_or(nan, cnp.isnan(s))
        dt = sel.dtype
        return cnp.add(sel, cnp.where(nan, np.asarray(np.nan, dt), np.asarray(0.0, dt)))
    acc = None
    for s in wins:
        acc = computation(initv, s) if acc is None else computation(acc, s)
    return acc
