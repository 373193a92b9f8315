"""ctrainstate.numpy's utility, creation, NaN-reduction and order-statistic names
(ctrainstate/_src/numpy_lax/numpy_extra.py): values against numpy (an independent implementation) and,
jax (recorded; live in the twins marked `parity`: values and result dtypes); sharded operands against the
single-device result; gradients against jax.grad and against gradients derived by hand;
bad arguments raise clear errors (jax's error type where jax raises)."""
import contextlib
import warnings

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from recorded import dtype as rec_dtype


rng = np.random.default_rng(7)
# NaNs scattered in, one row entirely NaN, no two equal finite values in a row (no ties)
XN = rng.permutation(24).astype(np.float32).reshape(4, 6) * 0.5 - 5.0
XN[0, 1] = XN[2, 4] = XN[2, 0] = np.nan
XN[3, :] = np.nan
XG = XN[:3]                                       # no all-NaN row (finite gradients)
Y = (rng.permutation(30).astype(np.float32).reshape(5, 6) - 12.0) * 0.25   # distinct
YN = Y.copy()
YN[1, 2] = np.nan
I32 = rng.integers(-5, 6, (3, 4)).astype(np.int32)
B = I32 > 0
Q = np.array([0.0, 0.15, 0.5, 0.72, 1.0], np.float32)


def host(v):
    if isinstance(v, (tuple, list)):
        return [host(u) for u in v]
    return np.asarray(v)


def _jaxed(jnp, v):
    return jnp.asarray(v) if isinstance(v, np.ndarray) else v


# (id, call(m, *inputs), inputs, numpy override or None); m is numpy, ctrainstate.numpy or
# jax.numpy. The numpy override computes the same quantity where numpy's own function has
# other conventions (said in a comment).
CASES = [
    # creation (all arguments Python values)
    ("empty", lambda m: m.empty((2, 3)), (), lambda: np.zeros((2, 3), np.float32)),
    ("empty_like", lambda m, x: m.empty_like(x), (I32,), lambda x: np.zeros_like(x)),
    ("identity", lambda m: m.identity(3, dtype=m.int32), (), None),
    ("tri", lambda m: m.tri(3, 4, 1), (), lambda: np.tri(3, 4, 1, np.float32)),
    ("triu_indices", lambda m: m.triu_indices(3, 1, 4), (), None),
    ("tril_indices", lambda m: m.tril_indices(4, -1), (), None),
    ("triu_indices_from", lambda m, x: m.triu_indices_from(x), (I32,), None),
    ("tril_indices_from", lambda m, x: m.tril_indices_from(x, 1), (I32,), None),
    ("indices", lambda m: m.indices((2, 3)), (), None),
    ("indices_sparse", lambda m: m.indices((2, 3), sparse=True), (), None),
    ("meshgrid_xy", lambda m, a, b: m.meshgrid(a, b), (Y[0, :3], Y[1]), None),
    ("meshgrid_ij", lambda m, a, b, c: m.meshgrid(a, b, c, indexing="ij"),
     (Y[0, :3], Y[1, :2], I32[0]), None),
    ("meshgrid_sparse", lambda m, a, b: m.meshgrid(a, b, sparse=True), (Y[0, :3], Y[1]), None),
    ("logspace", lambda m: m.logspace(0.0, 2.0, 5), (), None),
    ("logspace_base", lambda m: m.logspace(1.0, 3.0, 3, base=2.0, endpoint=False), (), None),
    ("logspace_int", lambda m: m.logspace(0, 3, 4, dtype=m.int32), (), None),
    ("geomspace", lambda m: m.geomspace(1.0, 1000.0, 4), (), None),
    ("geomspace_neg", lambda m: m.geomspace(-2.0, -32.0, 5), (), None),
    ("copy", lambda m, x: m.copy(x), (Y,), None),
    # comparison and utilities
    ("array_equal", lambda m, x: m.array_equal(x, x), (Y,), None),
    ("array_equal_nan", lambda m, x: m.array_equal(x, x), (XN,), None),
    ("array_equal_nan_t", lambda m, x: m.array_equal(x, x, equal_nan=True), (XN,), None),
    ("array_equal_shape", lambda m, x: m.array_equal(x, x[:1]), (Y,), None),
    ("array_equiv", lambda m, x: m.array_equiv(x[:1], m.concatenate([x[:1], x[:1]])), (Y,), None),
    ("array_equiv_no", lambda m, x: m.array_equiv(x, x[:, :2]), (Y,), None),
    ("broadcast_arrays", lambda m, x, y: m.broadcast_arrays(x[:, :1], y[0]), (Y, I32), None),
    ("absolute", lambda m, x: m.absolute(x), (I32,), None),
    ("fabs", lambda m, x: m.fabs(x), (I32,), lambda x: np.abs(x).astype(np.float32)),
    ("positive", lambda m, x: m.positive(x), (I32,), None),
    ("true_divide", lambda m, x: m.true_divide(x, 4), (I32,),
     lambda x: (x / 4).astype(np.float32)),
    ("count_nonzero", lambda m, x: m.count_nonzero(x), (XN,), None),
    ("count_nonzero_ax", lambda m, x: m.count_nonzero(x, axis=1, keepdims=True), (I32,), None),
    ("nan_to_num", lambda m, x: m.nan_to_num(x), (np.array([1.5, np.nan, np.inf, -np.inf],
                                                          np.float32),), None),
    ("nan_to_num_args", lambda m, x: m.nan_to_num(x, nan=7.0, posinf=8.0, neginf=-9.0),
     (np.array([1.5, np.nan, np.inf, -np.inf], np.float32),), None),
    ("nan_to_num_int", lambda m, x: m.nan_to_num(x), (I32,), None),
    ("isin", lambda m, x: m.isin(x, np.array([0, 3, -5], np.int32)), (I32,), None),
    ("isin_invert", lambda m, x: m.isin(x, np.array([0, 3, -5], np.int32), invert=True),
     (I32,), None),
    ("select", lambda m, x, i: m.select([i > 2, i < 0], [x[:3, :4], x[:3, :4] * 2.0], -1.0),
     (Y, I32), None),
    ("select_int", lambda m, i: m.select([i > 2, i < 0], [i, -i]), (I32,), None),
    ("trace", lambda m, x: m.trace(x), (Y,), None),
    ("trace_off", lambda m, x: m.trace(x, offset=1), (I32,), None),
    ("ptp", lambda m, x: m.ptp(x, axis=1), (Y,), None),
    ("ptp_int", lambda m, x: m.ptp(x), (I32,), None),
    ("average", lambda m, x: m.average(x, axis=0), (I32,), None),
    ("average_w", lambda m, x: m.average(x, axis=1, weights=np.arange(1, 7, dtype=np.float32)),
     (Y,), None),
    ("average_w_ret", lambda m, x: m.average(x, weights=np.abs(x) + 1.0, returned=True),
     (Y,), None),
    ("cross3", lambda m, x: m.cross(x[:, :3], x[:, 3:]), (Y,), None),
    ("cross2", lambda m, x: m.cross(x[:, :2], x[:, 2:4]), (Y,), None),
    ("cross23", lambda m, x: m.cross(x[:, :2], x[:, 3:]), (Y,), None),
    ("cross_axis", lambda m, x: m.cross(x[:3, :2], x[:3, 2:4], axisa=0, axisb=0), (Y,), None),
    ("kron", lambda m, x, i: m.kron(x[:2, :3], i[:2, :2]), (Y, I32), None),
    ("kron_1d", lambda m, x: m.kron(x[0, :3], x[:2, :2]), (Y,), None),
    ("rot90", lambda m, x: m.rot90(x), (I32,), None),
    ("rot90_k", lambda m, x: [m.rot90(x, k) for k in (-1, 2, 3, 4)], (I32,), None),
    ("rot90_axes", lambda m, x: m.rot90(x.reshape(5, 3, 2), axes=(2, 0)), (Y,), None),
    ("column_stack", lambda m, x: m.column_stack([x[0], x[1], x[:, :2]]), (Y[:, :5],), None),
    ("dstack", lambda m, x: m.dstack([x, x]), (I32,), None),
    ("hsplit", lambda m, x: m.hsplit(x, 2), (Y,), None),
    ("hsplit_1d", lambda m, x: m.hsplit(x[0], [1, 4]), (Y,), None),
    ("vsplit", lambda m, x: m.vsplit(x, [2]), (Y,), None),
    ("append", lambda m, x: m.append(x, 1.5), (I32,), None),
    ("append_ax", lambda m, x: m.append(x, x[:1], axis=0), (Y,), None),
    ("append_mixed", lambda m, x, i: m.append(i, x[0]), (Y, I32), None),
    # NaN-skipping reductions
    ("nansum", lambda m, x: m.nansum(x, axis=1), (XN,), None),
    ("nansum_all", lambda m, x: m.nansum(x), (XN,), None),
    ("nansum_int", lambda m, x: m.nansum(x, axis=0), (I32,), None),
    ("nansum_bool", lambda m, x: m.nansum(x), (B,), None),
    ("nansum_where", lambda m, x: m.nansum(x, axis=0, where=x > -2, initial=1.0), (XN,), None),
    ("nanmean", lambda m, x: m.nanmean(x, axis=1), (XN,), None),
    ("nanmean_k", lambda m, x: m.nanmean(x, axis=0, keepdims=True), (XN,), None),
    ("nanmean_int", lambda m, x: m.nanmean(x), (I32,), None),
    ("nanmax", lambda m, x: m.nanmax(x, axis=1), (XN,), None),
    ("nanmax_all", lambda m, x: m.nanmax(x), (XN,), None),
    ("nanmax_int", lambda m, x: m.nanmax(x, axis=1), (I32,), None),
    ("nanmin", lambda m, x: m.nanmin(x, axis=0), (XN,), None),
    ("nanmin_init", lambda m, x: m.nanmin(x, axis=1, initial=-1.0), (XN,), None),
    ("nanprod", lambda m, x: m.nanprod(x * 0.25, axis=1), (XN,), None),
    ("nanvar", lambda m, x: m.nanvar(x, axis=1), (XN,), None),
    ("nanvar_ddof", lambda m, x: m.nanvar(x, axis=0, ddof=1), (XN,), None),
    ("nanvar_ddof_all", lambda m, x: m.nanvar(x, ddof=5), (XN[:, :1],), None),
    ("nanstd", lambda m, x: m.nanstd(x, axis=1, keepdims=True), (XN,), None),
    ("nanstd_int", lambda m, x: m.nanstd(x), (I32,), None),
    ("nanargmax", lambda m, x: m.nanargmax(x, axis=1), (XN,),
     # numpy raises on an all-NaN slice; jax gives -1
     lambda x: np.where(np.isnan(x).all(1), -1,
                        np.argmax(np.where(np.isnan(x), -np.inf, x), 1)).astype(np.int32)),
    ("nanargmin", lambda m, x: m.nanargmin(x, axis=0), (XG,), None),
    ("nanargmax_flat", lambda m, x: m.nanargmax(x), (XN,), None),
    ("nanargmin_int", lambda m, x: m.nanargmin(x, axis=1, keepdims=True), (I32,),
     lambda x: np.argmin(x, 1, keepdims=True).astype(np.int32)),
    ("nancumsum", lambda m, x: m.nancumsum(x, axis=1), (XN,), None),
    ("nancumsum_flat", lambda m, x: m.nancumsum(x), (XN,), None),
    ("nancumprod", lambda m, x: m.nancumprod(x * 0.5, axis=0), (XN,), None),
    ("nancumsum_bool", lambda m, x: m.nancumsum(x, axis=1), (B,), None),
    # order statistics
    ("median", lambda m, x: m.median(x), (Y,), None),
    ("median_ax", lambda m, x: m.median(x, axis=1), (Y,), None),
    ("median_odd_k", lambda m, x: m.median(x, axis=0, keepdims=True), (Y,), None),
    ("median_nan", lambda m, x: m.median(x, axis=1), (YN,), None),
    ("median_int", lambda m, x: m.median(x, axis=1), (I32,), None),
    ("quantile", lambda m, x: m.quantile(x, Q, axis=1), (Y,), None),
    ("quantile_s", lambda m, x: m.quantile(x, 0.3), (Y,), None),
    ("quantile_tuple", lambda m, x: m.quantile(x.reshape(5, 2, 3), Q, axis=(0, 2)), (Y,), None),
    ("quantile_tuple_k", lambda m, x: m.quantile(x.reshape(5, 2, 3), Q[1:3], axis=(0, 2),
                                                 keepdims=True), (Y,), None),
    ("quantile_none_k", lambda m, x: m.quantile(x, 0.72, keepdims=True), (Y,), None),
    ("quantile_k", lambda m, x: m.quantile(x, Q, axis=0, keepdims=True), (Y,), None),
    ("quantile_nan", lambda m, x: m.quantile(x, Q, axis=1), (YN,), None),
] + [
    (f"quantile_{meth}", (lambda meth: lambda m, x: m.quantile(x, Q, axis=1, method=meth))(meth),
     (Y,), None) for meth in ("lower", "higher", "midpoint", "nearest", "inverted_cdf")
] + [
    ("percentile", lambda m, x: m.percentile(x, np.array([10.0, 50.0, 95.0]), axis=0), (Y,), None),
    ("searchsorted", lambda m, a, v: m.searchsorted(a, v), (np.sort(Y[0]), Y[1]), None),
    ("searchsorted_r", lambda m, a: m.searchsorted(a, a, side="right"),
     (np.array([1, 2, 2, 3], np.int32),), None),
    ("searchsorted_nan", lambda m, a, v: m.searchsorted(a, v),
     (np.array([-1.0, 0.0, 2.0, np.nan], np.float32), np.array([np.nan, -0.0, 3.0], np.float32)),
     None),
    ("searchsorted_sorter", lambda m, a: m.searchsorted(a, 2.1, sorter=np.argsort(a)),
     (Y[2],), None),
    ("nonzero", lambda m, x: m.nonzero(x), (I32,), None),
    ("nonzero_size", lambda m, x: m.nonzero(x, size=12, fill_value=-1), (I32,),
     lambda x: [np.concatenate([i, -np.ones(12 - len(i), np.int64)]) for i in np.nonzero(x)]),
    ("nonzero_trunc", lambda m, x: m.nonzero(x, size=2), (I32,),
     lambda x: [i[:2] for i in np.nonzero(x)]),
    ("argwhere", lambda m, x: m.argwhere(x), (XN,), None),
    ("argwhere_size", lambda m, x: m.argwhere(x, size=20, fill_value=9), (I32,),
     lambda x: np.concatenate([np.argwhere(x), np.full((20 - np.count_nonzero(x), 2), 9)])),
    ("argwhere_0d", lambda m: m.argwhere(np.float32(3)), (), None),
    ("flatnonzero", lambda m, x: m.flatnonzero(x), (B,), None),
    ("flatnonzero_size", lambda m, x: m.flatnonzero(x, size=3), (B,),
     lambda x: np.flatnonzero(x)[:3]),
    ("where1", lambda m, x: m.where(x), (B,), None),
    ("where3", lambda m, x, b: m.where(b, x[:3, :4], -x[:3, :4]), (Y, B), None),
]


# jax 0.10.2 raises TypeError in its eq for operands that do not broadcast (its array_equiv
# catches only ValueError); numpy and ctrainstate answer False
JAX_FAILS = {"array_equiv_no"}


def _np_value(name, call, inputs, override):
    return host(override(*inputs) if override is not None else call(np, *inputs))


def _check_value(got, want, name, f16=False):
    got, want = host(got), host(want)
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), name
        for g, w in zip(got, want):
            _check_value(g, w, name)
        return
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if want.dtype.kind in "biu" and got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=2e-6, atol=1e-6, equal_nan=True, err_msg=name)


def _dtypes_of(v):
    if isinstance(v, (tuple, list)):
        return [d for u in v for d in _dtypes_of(u)]
    return [np.dtype(v.dtype)]


@pytest.mark.parametrize("name,call,inputs,override", CASES, ids=[c[0] for c in CASES])
def test_values_match_numpy(name, call, inputs, override):
    got = call(cnp, *inputs)
    _check_value(got, _np_value(name, call, inputs, override), name)


def _jax_value(jax, call, inputs):
    """jax's value of a case: the call compiled as one program (one XLA compile instead of one
    per primitive run eagerly), or run eagerly where jit cannot take it (shapes that depend on
    values, non-array inputs)."""
    jnp = jax.numpy
    args = [_jaxed(jnp, v) for v in inputs]
    if all(isinstance(a, jax.Array) for a in args):
        try:
            return jax.jit(lambda *a: call(jnp, *a))(*args)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError,
                TypeError, ValueError, NotImplementedError):
            pass
    return call(jnp, *args)


def test_values_and_dtypes_match_jax(jax_ref):
    for name, call, inputs, _ in CASES:
        if name in JAX_FAILS:
            continue
        got = call(cnp, *inputs)
        want = jax_ref(name, lambda jax: _jax_value(jax, call, inputs))
        _check_value(got, want, name)
        assert _dtypes_of(got) == _dtypes_of(want), (name, _dtypes_of(got), _dtypes_of(want))


# --- 16-bit floats ------------------------------------------------------------------------------

LOWP_CASES = [
    ("nansum", lambda m, x: m.nansum(x, axis=1)),
    ("nanmean", lambda m, x: m.nanmean(x, axis=1)),
    ("nanmax", lambda m, x: m.nanmax(x, axis=0)),
    ("nanvar", lambda m, x: m.nanvar(x, axis=1)),
    ("nancumsum", lambda m, x: m.nancumsum(x, axis=1)),
    # m.multiply, not `x * np.inf`: numpy's product of a bfloat16 array and a Python float is
    # float32 with ml_dtypes < 0.7 and bfloat16 from 0.7 on; ctrainstate's is bfloat16 (jax's)
    ("nan_to_num", lambda m, x: m.nan_to_num(m.multiply(x, np.inf))),
    ("median", lambda m, x: m.median(x, axis=1)),
    ("quantile", lambda m, x: m.quantile(x, 0.3, axis=0)),
    ("ptp", lambda m, x: m.ptp(x)),
    ("fabs", lambda m, x: m.fabs(x)),
]


@pytest.mark.parametrize("dt", [cnp.bfloat16, cnp.float16], ids=["bf16", "f16"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy's all-NaN-slice warnings
def test_16bit_floats_keep_their_dtype(dt, jax_ref):
    x = XN.astype(np.dtype(dt))
    ref = XN.astype(np.float64)
    for name, call in LOWP_CASES:
        got = call(cnp, x)
        assert got.dtype == np.dtype(dt), name
        want = call(np, ref) if name != "nan_to_num" else None
        if want is not None:
            np.testing.assert_allclose(np.asarray(got).astype(np.float64), want, rtol=2e-2,
                                       atol=2e-2, equal_nan=True, err_msg=name)
    # posinf / neginf defaults are the 16-bit dtype's finite extremes
    got = np.asarray(cnp.nan_to_num(np.array([np.inf, -np.inf, np.nan], np.dtype(dt))))
    fi = np.finfo(np.dtype(dt)) if dt == cnp.float16 else cnp.finfo(dt)
    assert got.astype(np.float64).tolist() == [float(fi.max), float(fi.min), 0.0]
    for name, call in LOWP_CASES:
        want = jax_ref(name, lambda jnp: call(jnp, jnp.asarray(x)))
        got = call(cnp, x)
        assert got.dtype == want.dtype, name
        np.testing.assert_allclose(np.asarray(got).astype(np.float64),
                                   np.asarray(want).astype(np.float64), rtol=1e-2,
                                   atol=1e-2, equal_nan=True, err_msg=name)


# --- dtypes and introspection ---------------------------------------------------------------

DTS = [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
       np.int64, cnp.bfloat16, np.float16, np.float32, np.float64, np.complex64, np.complex128,
       int, float, complex]


def _np_lub(a, b):
    """jax's lattice join rebuilt independently: the smallest common type by (kind, bits), with
    jax's rules written out (unsigned and signed meet at the next wider signed integer, 64-bit
    ints meet floats at the weak float; bfloat16 with float16 is float32; Python types are weak:
    they take the other operand's kind and width when that kind is at least theirs)."""
    order = {"b": 0, "i": 1, "f": 2, "c": 3}

    def info(t):
        if t in (int, float, complex):
            return ({int: "i", float: "f", complex: "c"}[t], None, True)
        d = np.dtype(t)
        if d == np.dtype(cnp.bfloat16):
            return ("f", "bf", False)
        k = {"b": "b", "u": "u", "i": "i", "f": "f", "c": "c"}[d.kind]
        return (k, d.itemsize * 8, False)
    (ka, _, weak_a), (kb, _, weak_b) = info(a), info(b)
    if weak_a or weak_b:
        if weak_a and weak_b:
            k = max(ka, kb, key=order.get)
            return np.dtype({"i": np.int64, "f": np.float64, "c": np.complex128}[k])
        (kw, _, _), strong = (info(a), b) if weak_a else (info(b), a)
        ks = info(strong)[0]
        ks_ord = order.get("i" if ks == "u" else ks)
        if ks_ord >= order[kw]:
            return np.dtype(strong)
        if kw == "c" and ks == "f":    # a float meets weak complex at the complex of its width
            return np.dtype(np.complex128 if np.dtype(strong) == np.float64 else np.complex64)
        return np.dtype({"i": np.int64, "f": np.float64, "c": np.complex128}[kw]) \
            if kw != "i" else np.dtype(np.int64)
    da, db = np.dtype(a), np.dtype(b)
    if {da, db} == {np.dtype(cnp.bfloat16), np.dtype(np.float16)}:
        return np.dtype(np.float32)
    if np.dtype(cnp.bfloat16) in (da, db):
        other = db if da == np.dtype(cnp.bfloat16) else da
        if other.kind in "biu" or other == np.dtype(cnp.bfloat16):
            return np.dtype(cnp.bfloat16)
        return np.result_type(other, np.float32) if other.kind == "f" else \
            np.result_type(other, np.complex64)
    if {da.kind, db.kind} >= {"u", "i"} or da.kind in "iu" and db.kind in "iu":
        if "u" in (da.kind, db.kind) and "i" in (da.kind, db.kind):
            u, s = (da, db) if da.kind == "u" else (db, da)
            if u.itemsize == 8:
                return np.dtype(np.float64)
            if u.itemsize == 4 and s.itemsize <= 4:   # jax without x64: no int64 from 32 bits
                return np.dtype(np.int32)
            return np.dtype(f"int{max(2 * u.itemsize, s.itemsize) * 8}")
    if (da.kind in "iu" and da.itemsize == 8 and db.kind in "fc") or \
            (db.kind in "iu" and db.itemsize == 8 and da.kind in "fc"):
        f = db if da.kind in "iu" else da
        return f
    if da.kind in "biu" and db.kind in "fc":
        return db
    if db.kind in "biu" and da.kind in "fc":
        return da
    return np.result_type(da, db)


def test_promote_types_is_jax_lattice(jax_ref):
    theirs = jax_ref("promote_types", lambda jnp: [[np.dtype(jnp.promote_types(a, b)).name
                                                    for b in DTS] for a in DTS])
    for a, row in zip(DTS, theirs, strict=True):
        for b, want in zip(DTS, row, strict=True):
            got = cnp.promote_types(a, b)
            assert got == _np_lub(a, b), (a, b, got, _np_lub(a, b))
            assert got == cnp.promote_types(b, a)
            assert got == rec_dtype(want), (a, b, got, want)
    # the brief's examples, by name
    assert cnp.promote_types(cnp.bfloat16, cnp.float16) == np.float32
    assert cnp.promote_types(cnp.int32, cnp.float32) == np.float32
    assert cnp.promote_types(cnp.uint32, cnp.int32) == np.int32   # (x64 off)
    with pytest.raises(TypeError, match="promote_types"):
        cnp.promote_types(np.dtype("U3"), np.int32)


def _jax_introspection(jnp):
    return {"finfo": [[float(jnp.finfo(t).max), float(jnp.finfo(t).tiny)]
                      for t in (cnp.bfloat16, np.float16, np.float32)],
            "can_cast": [bool(jnp.can_cast(a, b)) for a, b in _CASTS],
            "issubdtype": [[bool(jnp.issubdtype(t, k)) for k in _SUBDTYPES] for t in DTS[:-3]],
            "isdtype": [[bool(jnp.isdtype(t, k)) for k in _KINDS] for t in DTS[:-3]]}


_CASTS = ((np.int32, np.float32), (cnp.bfloat16, np.float16), (np.uint8, np.int8))
_SUBDTYPES = (np.floating, np.integer, np.inexact, np.number, np.signedinteger)
_KINDS = ("bool", "signed integer", "unsigned integer", "integral", "real floating",
          "complex floating", "numeric")


def test_dtype_introspection(jax_ref):
    assert cnp.finfo(cnp.bfloat16).eps == 2.0 ** -7 and cnp.finfo(cnp.bfloat16).bits == 16
    assert float(cnp.finfo(np.float16).max) == 65504.0
    x = cts.device_put(np.ones(2, np.float32))
    assert cnp.finfo(x).dtype == np.float32 and cnp.finfo("float32").eps == np.finfo(np.float32).eps
    assert cnp.iinfo(cnp.int32).min == -2 ** 31 and cnp.iinfo(np.uint32).max == 2 ** 32 - 1
    assert cnp.iinfo(cts.device_put(I32)).bits == 32
    with pytest.raises(ValueError):
        cnp.finfo(np.int32)
    with pytest.raises(ValueError):
        cnp.iinfo(np.float32)
    assert cnp.dtype("bfloat16") == np.dtype(cnp.bfloat16) and cnp.dtype(cnp.int32) == np.int32
    assert cnp.can_cast(np.int16, np.float32) and not cnp.can_cast(np.float32, np.int32)
    assert cnp.can_cast(x, np.float64) and cnp.can_cast(np.int32, np.int8, "unsafe")
    assert cnp.issubdtype(cnp.bfloat16, np.floating) and cnp.issubdtype(cnp.bfloat16, np.inexact)
    assert not cnp.issubdtype(cnp.bfloat16, np.integer)
    assert cnp.issubdtype(np.int32, np.integer) and not cnp.issubdtype(np.int32, np.floating)
    assert cnp.issubdtype(cnp.float32, np.float32) and not cnp.issubdtype(np.float32, np.float16)
    assert cnp.issubdtype(np.floating, np.inexact)
    assert cnp.isdtype(cnp.bfloat16, "real floating") and cnp.isdtype(np.int32, ("bool", "integral"))
    assert not cnp.isdtype(np.uint32, "signed integer") and cnp.isdtype(np.bool_, np.bool_)
    assert cnp.isdtype(cnp.float16, "numeric") and not cnp.isdtype(np.bool_, "numeric")
    with pytest.raises(ValueError, match="kind"):
        cnp.isdtype(np.int32, "integer")
    xs = cts.device_put(Y)
    assert (cnp.ndim(xs), cnp.shape(xs), cnp.size(xs), cnp.size(xs, 1)) == (2, (5, 6), 30, 6)
    assert (cnp.ndim([[1, 2]]), cnp.shape([[1, 2]]), cnp.size(3.0)) == (2, (1, 2), 1)
    theirs = jax_ref("introspection", _jax_introspection)
    for t, (mx, tiny) in zip((cnp.bfloat16, np.float16, np.float32), theirs["finfo"], strict=True):
        assert float(cnp.finfo(t).max) == mx and float(cnp.finfo(t).tiny) == tiny
    assert [bool(cnp.can_cast(a, b)) for a, b in _CASTS] == theirs["can_cast"]
    for t, sub, kinds in zip(DTS[:-3], theirs["issubdtype"], theirs["isdtype"], strict=True):
        assert [bool(cnp.issubdtype(t, k)) for k in _SUBDTYPES] == sub, t
        assert [bool(cnp.isdtype(t, k)) for k in _KINDS] == kinds, t
    assert cnp.broadcast_shapes((2, 1), (3,), 1) == (2, 3)
    with pytest.raises(ValueError, match="Incompatible shapes"):
        cnp.broadcast_shapes((2,), (3,))


# --- sharded operands -----------------------------------------------------------------------

SHARDED = [
    ("nansum", lambda x: cnp.nansum(x, axis=1)),
    ("nansum_all", lambda x: cnp.nansum(x)),
    ("nanmean", lambda x: cnp.nanmean(x, axis=0)),
    ("nanmax", lambda x: cnp.nanmax(x, axis=1)),
    ("nanmin", lambda x: cnp.nanmin(x)),
    ("nanvar", lambda x: cnp.nanvar(x, axis=1)),
    ("nanstd", lambda x: cnp.nanstd(x, axis=0)),
    ("nanprod", lambda x: cnp.nanprod(x * 0.5, axis=0)),
    ("nanargmax", lambda x: cnp.nanargmax(x, axis=1)),
    ("nanargmin", lambda x: cnp.nanargmin(x, axis=0)),
    ("nancumsum", lambda x: cnp.nancumsum(x, axis=1)),
    ("nancumprod", lambda x: cnp.nancumprod(x * 0.5, axis=0)),
    ("nan_to_num", lambda x: cnp.nan_to_num(x)),
    ("count_nonzero", lambda x: cnp.count_nonzero(x, axis=0)),
    ("median", lambda x: cnp.median(x, axis=1)),
    ("quantile", lambda x: cnp.quantile(x, Q, axis=0)),
    ("ptp", lambda x: cnp.ptp(cnp.nan_to_num(x), axis=1)),
    ("average", lambda x: cnp.average(cnp.nan_to_num(x), axis=1, weights=np.arange(8.0) + 1)),
    ("trace", lambda x: cnp.trace(cnp.nan_to_num(x))),
    ("rot90", lambda x: cnp.rot90(x)),
    ("kron", lambda x: cnp.kron(x[:2, :2], x)),
    ("cross", lambda x: cnp.cross(x[:, :3], x[:, 3:6])),
    ("isin", lambda x: cnp.isin(x, np.array([0.5, 1.0], np.float32))),
    ("array_equal", lambda x: cnp.array_equal(x, x, equal_nan=True)),
    ("nonzero", lambda x: cnp.nonzero(cnp.nan_to_num(x) > 0)),
    ("argwhere", lambda x: cnp.argwhere(cnp.isnan(x))),
    ("searchsorted", lambda x: cnp.searchsorted(np.array([-1.0, 0.0, 1.0], np.float32), x)),
    ("append", lambda x: cnp.append(x, x[:1], axis=0)),
]


@pytest.mark.parametrize("mesh_shape,names,spec", [((8,), ("x",), (None, "x")),
                                                  ((2, 4), ("a", "b"), ("a", "b")),
                                                  ((4, 2), ("a", "b"), ("a", "b"))])
def test_sharded_operands_give_the_single_device_result(mesh_shape, names, spec):
    if cts.device_count() < 8:
        pytest.skip("needs 8 CPU devices")
    mesh = cts.make_mesh(mesh_shape, names)
    h = ((rng.permutation(64).astype(np.float32) - 30) * 0.125).reshape(8, 8)
    h[1, 3] = h[5, 5] = h[6, 0] = np.nan
    h[7, :] = np.nan
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P(*spec)))
    single = cts.device_put(h)
    for name, f in SHARDED:
        got, want = f(x), f(single)
        _check_value(host(got) if not isinstance(got, tuple) else host(list(got)),
                     host(want) if not isinstance(want, tuple) else host(list(want)), name)
    # a reduction over a sharded axis ends in the all-reduce: the result stays on the mesh
    r = cnp.nansum(x, axis=1)
    assert r.sharding.mesh is mesh


# --- gradients ------------------------------------------------------------------------------

GRADS = [
    ("nansum", lambda m, x: m.nansum(x, axis=1)),
    ("nansum_where", lambda m, x: m.nansum(x, where=x > -2.0)),
    ("nanmean", lambda m, x: m.nanmean(x, axis=1)),
    ("nanmax", lambda m, x: m.nanmax(x, axis=1)),
    ("nanmin", lambda m, x: m.nanmin(x, axis=0)),
    ("nanprod", lambda m, x: m.nanprod(x * 0.5, axis=1)),
    ("nanvar", lambda m, x: m.nanvar(x, axis=1)),
    ("nanstd", lambda m, x: m.nanstd(x, axis=1, ddof=1)),
    ("nancumsum", lambda m, x: m.nancumsum(x, axis=1)),
    ("nancumprod", lambda m, x: m.nancumprod(x * 0.5, axis=1)),
    ("nan_to_num", lambda m, x: m.nan_to_num(x * 3.0)),
    ("median", lambda m, x: m.median(m.nan_to_num(x), axis=1)),
    ("median_all", lambda m, x: m.median(m.nan_to_num(x))),
    ("quantile", lambda m, x: m.quantile(m.nan_to_num(x), Q, axis=1)),
    ("quantile_mid", lambda m, x: m.quantile(m.nan_to_num(x), Q, axis=0, method="midpoint")),
    ("percentile", lambda m, x: m.percentile(m.nan_to_num(x), 37.0)),
    ("average", lambda m, x: m.average(m.nan_to_num(x), axis=1,
                                       weights=np.arange(1.0, 7.0, dtype=np.float32))),
    ("average_wgrad", lambda m, x: m.average(np.ones((3, 6), np.float32),
                                             weights=m.nan_to_num(x) ** 2 + 1.0)),
    ("cross", lambda m, x: m.cross(m.nan_to_num(x)[:, :3], m.nan_to_num(x)[:, 3:])),
    ("kron", lambda m, x: m.kron(m.nan_to_num(x)[:2, :2], m.nan_to_num(x))),
    ("trace", lambda m, x: m.trace(m.nan_to_num(x), offset=1)),
    ("ptp", lambda m, x: m.ptp(m.nan_to_num(x), axis=1)),
    ("select", lambda m, x: m.select([x > 0, x < -3], [x, x * x], 1.0)),
    ("meshgrid", lambda m, x: m.meshgrid(m.nan_to_num(x)[0], m.nan_to_num(x)[1])[1]),
    ("copy", lambda m, x: m.copy(x) * 2.0),
    ("rot90", lambda m, x: m.rot90(x, 3)),
    ("column_stack", lambda m, x: m.column_stack([x[0], x[1]])),
    ("append", lambda m, x: m.append(x, x[:1] * 2.0, axis=0)),
    ("broadcast_arrays", lambda m, x: m.broadcast_arrays(x[:, :1], x)[0]),
    ("where3", lambda m, x: m.where(x > 0, x, -2.0 * x)),
]


def _cotangent(shape):
    return np.asarray(np.random.default_rng(3).standard_normal(shape), np.float32)


def _loss(m, call, r_of):
    def f(x):
        y = call(m, x)
        return m.sum(m.where(m.isnan(y), 0.0, y) * r_of(y.shape))
    return f


def test_gradients_by_hand():
    """Gradients derived from the definitions: nansum passes 1 to the finite elements and 0 to
    the NaNs; nanmean 1 / count; nanmax one-hot at the maximum; median of an even count splits
    one half to each middle element (x sorted per row, hand-indexed)."""
    x = cts.device_put(XG)
    fin = ~np.isnan(XG)
    g = np.asarray(cts.grad(lambda v: cnp.sum(cnp.nansum(v, axis=1)))(x))
    np.testing.assert_array_equal(g, fin.astype(np.float32))
    g = np.asarray(cts.grad(lambda v: cnp.sum(cnp.nanmean(v, axis=1)))(x))
    np.testing.assert_allclose(g, fin / fin.sum(1, keepdims=True), rtol=1e-6)
    g = np.asarray(cts.grad(lambda v: cnp.sum(cnp.nanmax(v, axis=1)))(x))
    want = np.zeros_like(XG)
    want[np.arange(3), np.nanargmax(XG, 1)] = 1
    np.testing.assert_array_equal(g, want)
    g = np.asarray(cts.grad(lambda v: cnp.sum(cnp.median(v, axis=1)))(cts.device_put(Y)))
    order = np.argsort(Y, 1)
    want = np.zeros_like(Y)
    want[np.arange(5), order[:, 2]] = want[np.arange(5), order[:, 3]] = 0.5
    np.testing.assert_array_equal(g, want)


def test_gradients_match_jax(jax_ref):
    for name, call in GRADS:
        shapes = {}

        def r_of(s, _shapes=shapes):
            return _shapes.setdefault(tuple(s), _cotangent(tuple(s)))
        g = np.asarray(cts.grad(_loss(cnp, call, r_of))(cts.device_put(XG)))
        # one compiled program per case (the eager jax.grad compiles each primitive)
        want = jax_ref(name, lambda jax, jnp: jax.jit(jax.grad(_loss(jnp, call, r_of)))(
            jnp.asarray(XG)))
        np.testing.assert_allclose(g, want, rtol=2e-5, atol=2e-6, err_msg=name)
        # at the NaNs exactly jax's value (0 for the NaN-skipping reductions)
        np.testing.assert_array_equal(g[np.isnan(XG)], want[np.isnan(XG)], err_msg=name)


# --- errors ---------------------------------------------------------------------------------

ERRORS = [
    # (call, error type, message fragment); jax raises the same type where it raises
    (lambda m: m.meshgrid(np.ones((2, 2)), np.ones(3)), ValueError, "1D"),
    (lambda m: m.meshgrid(np.ones(2), indexing="yx"), ValueError, "indexing"),
    (lambda m: m.select([np.array([True])], [np.ones(1), np.ones(1)]), ValueError, "length"),
    (lambda m: m.select([], []), ValueError, "non-empty"),
    (lambda m: m.cross(np.ones(4), np.ones(3)), ValueError, "2 or 3"),
    (lambda m: m.rot90(np.ones(3)), ValueError, "ndim"),
    (lambda m: m.rot90(np.ones((2, 2)), axes=(1, 1)), ValueError, "different"),
    (lambda m: m.ptp(np.array([True, False])), TypeError, "bool"),
    (lambda m: m.average(np.ones((2, 3)), weights=np.ones(3)), ValueError, "Axis must be"),
    (lambda m: m.average(np.ones((2, 3)), axis=1, weights=np.ones(2)), ValueError, "weights"),
    (lambda m: m.append(np.ones((2, 2)), np.ones(3), axis=0), TypeError, "dimensions"),
    (lambda m: m.nanmax(np.ones(2), where=np.array([True, False])), ValueError, "initial"),
    (lambda m: m.quantile(np.ones(3), 0.5, method="hazen"), ValueError, "method"),
    (lambda m: m.quantile(np.ones(3), np.ones((2, 2)) * 0.5), ValueError, "rank"),
    (lambda m: m.quantile(np.ones(3), 0.5, overwrite_input=True), ValueError, "overwrite"),
    (lambda m: m.median(np.ones(0)), TypeError, None),
    (lambda m: m.searchsorted(np.ones((2, 2)), 1.0), ValueError, "1-dimensional"),
    (lambda m: m.searchsorted(np.ones(2), 1.0, side="mid"), ValueError, "side"),
    (lambda m: m.nonzero(np.float32(3)), ValueError, "0d"),
    (lambda m: m.where(np.array([True]), 1.0), TypeError, None),
    (lambda m: m.where(np.array([True]), 1.0, 2.0, size=2), ValueError, "size"),
    (lambda m: m.isdtype(np.int32, "foo"), ValueError, "kind"),
    (lambda m: m.broadcast_shapes((2,), (3,)), ValueError, "Incompatible"),
    (lambda m: m.finfo(np.int32), ValueError, None),
    (lambda m: m.hsplit(np.ones((2, 3)), 2), ValueError, None),
]

# jax is silent (or answers) here; ctrainstate raises a clear error
OUR_ERRORS = [
    (lambda: cnp.quantile(np.ones(3, np.float32), 1.5), ValueError, r"range \[0, 1\]"),
    (lambda: cnp.percentile(np.ones(3, np.float32), -1.0), ValueError, r"range \[0, 1\]"),
    (lambda: cnp.geomspace(0.0, 10.0, 3), ValueError, "zero"),
    (lambda: cnp.vsplit(np.ones(4, np.float32), 2), ValueError, "2 or more"),
    (lambda: cnp.nonzero(np.ones(3), size=-1), ValueError, "size"),
    (lambda: cnp.nonzero(np.ones((2, 2)), size=3, fill_value=(1, 2, 3)), ValueError, "fill_value"),
    (lambda: cnp.select([np.array([1, 0])], [np.ones(2)]), TypeError, "bool"),
    (lambda: cnp.nansum(np.ones(2), where=np.array([1, 0])), TypeError, "bool mask"),
    (lambda: cnp.searchsorted(np.ones(3), 1.0, sorter=np.ones(2, np.int32)), ValueError, "sorter"),
    (lambda: cnp.quantile(np.ones(3), 0.5, method="inverted_cdf", weights=np.ones(3)),
     NotImplementedError, "weights"),
    (lambda: cnp.tri(-1), ValueError, "negative"),
    (lambda: cnp.indices((2.5,)), TypeError, "integers"),
]


@pytest.mark.parametrize("call,err,match", ERRORS, ids=[f"jax{i}" for i in range(len(ERRORS))])
def test_errors_as_jax(call, err, match, jax_ref):
    with pytest.raises(err, match=match):
        call(cnp)

    def jax_error(jnp):   # the class names of what jax raises (None: it raises nothing)
        try:
            call(jnp)
        except Exception as e:   # noqa: BLE001 - its type is compared
            return [c.__name__ for c in type(e).__mro__]
        return None
    assert err.__name__ in (jax_ref("error", jax_error) or []), "jax raises another type"


@pytest.mark.parametrize("call,err,match", OUR_ERRORS,
                         ids=[f"ours{i}" for i in range(len(OUR_ERRORS))])
def test_errors_where_jax_is_silent(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_where_one_argument_and_docstrings():
    idx = cnp.where(cts.device_put(I32) > 0)
    assert isinstance(idx, tuple) and all(i.dtype == np.int32 for i in idx)
    np.testing.assert_array_equal(np.stack([np.asarray(i) for i in idx]), np.stack(np.nonzero(I32 > 0)))
    from ctrainstate._src.numpy_lax import numpy_extra as _numpy_extra
    for n in _numpy_extra.__all__:
        f = getattr(cnp, n)
        assert f is getattr(_numpy_extra, n), n
        if callable(f) and n != "dtype":
            assert f.__doc__ and f.__doc__.strip(), n
    assert "nansum" in cnp.__all__ and "quantile" in cnp.__all__


def test_docstring_examples_run():
    import doctest
    from ctrainstate._src.numpy_lax import numpy_extra as _numpy_extra
    res = doctest.testmod(_numpy_extra, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 10 and res.failed == 0, res


# --- nanquantile / nanpercentile / nanmedian ----------------------------------------------------

def _with_nans(seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(4, 5, 6).astype(np.float32)
    x[rs.rand(4, 5, 6) < 0.3] = np.nan
    x[0, 0, :] = np.nan            # a slice of NaNs only
    return x


@pytest.mark.parametrize("method", ["linear", "lower", "higher", "midpoint"])
def test_nanquantile_matches_numpy(method):
    x = _with_nans()
    for axis in (None, 0, 2, (0, 2), -1):
        for q in (0.3, np.float32([0.0, 0.25, 0.5, 1.0])):
            with _quiet():
                want = np.nanquantile(x.astype(np.float64), q, axis=axis, method=method)
            got = host(cnp.nanquantile(x, q, axis=axis, method=method))
            assert got.shape == np.shape(want) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, equal_nan=True)
    got = cnp.nanquantile(cts.device_put(x), 0.5, axis=1, keepdims=True, method=method)
    assert got.shape == (4, 1, 6)
    with _quiet():
        want = np.nanquantile(x.astype(np.float64), 0.5, axis=1, keepdims=True, method=method)
    np.testing.assert_allclose(host(got), want, rtol=2e-6, atol=1e-6, equal_nan=True)


@contextlib.contextmanager
def _quiet():
    """numpy warns "All-NaN slice encountered" for the slice of NaNs only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_nanmedian_nanpercentile_gradient_and_errors():
    x = _with_nans(1)
    with _quiet():
        np.testing.assert_allclose(host(cnp.nanmedian(x, axis=2)), np.nanmedian(x, axis=2),
                                   rtol=1e-6, equal_nan=True)
        np.testing.assert_allclose(host(cnp.nanpercentile(x, [10.0, 90.0], axis=0)),
                                   np.nanpercentile(x.astype(np.float64), [10.0, 90.0], axis=0),
                                   rtol=2e-6, atol=1e-6, equal_nan=True)
    # the gradient goes to the order statistics used: the two middle non-NaN values
    row = np.float32([4.0, np.nan, 1.0, 3.0, np.nan, 2.0])
    g = cts.grad(lambda v: cnp.nanmedian(v))(cts.device_put(row))
    assert host(g).tolist() == [0.0, 0.0, 0.0, 0.5, 0.0, 0.5]
    assert np.isnan(host(cnp.nanmedian(np.full(3, np.nan, np.float32))))
    with pytest.raises(ValueError, match="quantiles must be in the range"):
        cnp.nanquantile(row, 1.5)
    with pytest.raises(ValueError, match="method can only be"):
        cnp.nanquantile(row, 0.5, method="cubic")
    with pytest.raises(ValueError, match="does not support overwrite_input"):
        cnp.nanmedian(row, overwrite_input=True)


def test_nanquantile_matches_jax(jax_ref):
    x = _with_nans(2)
    for method in ("linear", "lower", "higher", "midpoint", "nearest", "inverted_cdf"):
        for axis in (None, 1, (0, 2)):
            for qi, q in enumerate((0.3, np.float32([0.0, 0.5, 0.75, 1.0]))):
                want = jax_ref(f"{method} {axis} q{qi}",
                               lambda jnp: jnp.nanquantile(x, q, axis=axis, method=method))
                got = host(cnp.nanquantile(x, q, axis=axis, method=method))
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True,
                                           err_msg=f"{method} {axis} {q}")
    np.testing.assert_allclose(host(cnp.nanmedian(x, axis=0)),
                               jax_ref("nanmedian", lambda jnp: jnp.nanmedian(x, axis=0)),
                               rtol=1e-6, equal_nan=True)
