"""jax.numpy's data-movement functions on (sharded) Arrays: ``take``, ``take_along_axis``,
``repeat``, ``tile``, ``flip``/``fliplr``/``flipud``, ``roll``, ``pad``, ``tril``/``triu``,
``eye``, ``diag``/``diagonal``, ``moveaxis``, ``swapaxes``, ``atleast_1d/2d/3d``, ``prod``.

Table-driven: every case runs the same call on ``numpy`` (the independent reference), on
``ctrainstate.numpy`` and on ``jax.numpy`` (jax's values recorded, conftest's ``jax_ref``); for
every stored dtype the bits moved equal numpy's; gradients equal jax.grad's and central finite
differences; on meshes (8,) and (2, 4) with sharded operands the values and gradients are those
of one device and the output shardings those documented in ``ctrainstate._src.ops.move``;
eval_shape; errors.
Out-of-range indices follow jax's defaults ("fill" for take / take_along_axis), checked
against a numpy construction of those rules and against jax's values."""
import doctest

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from conftest import without_host_copies

BF16 = cnp.bfloat16
DTYPES = [np.float32, BF16, np.float16, np.int32, np.uint32, np.bool_]
FLOATS = (np.float32, BF16, np.float16)
S3 = (8, 4, 6)      # divisible by the meshes' axes
O3 = (3, 5, 7)      # odd


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype == np.int32:
        return rng.integers(-1000, 1000, shape).astype(np.int32)
    if dtype == np.uint32:
        return rng.integers(0, 2**32 - 1, shape, dtype=np.uint32)
    h = rng.standard_normal(shape).astype(np.float32)
    if h.size > 2:  # bits that must survive a move: -0.0, inf, NaN
        flat = h.reshape(-1)
        flat[0], flat[1], flat[-1] = -0.0, np.inf, np.nan
    return h.astype(dtype)


def _bits(a):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return a
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same(got, want, what=""):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)


# (id, input shape, call(m, x) with m one of numpy / ctrainstate.numpy / jax.numpy); every
# index in range here, where numpy, jax and ctrainstate agree by definition
I = np.array
CASES = [
    ("take axis 1 dups", S3, lambda m, x: m.take(x, I([3, 0, 3, 1]), axis=1)),
    ("take axis -1 2-d idx neg", O3, lambda m, x: m.take(x, I([[6, -1], [0, -7]]), axis=-1)),
    ("take flat", O3, lambda m, x: m.take(x, I([0, 104, -105, 50]))),
    ("take int index", S3, lambda m, x: m.take(x, 2, axis=0)),
    ("take 1-d", (5,), lambda m, x: m.take(x, I([4, 4, 0]))),
    ("take 0-d", (), lambda m, x: m.take(x, I([0, 0]))),
    ("take clip", O3, lambda m, x: m.take(x, I([-9, 2, 40]), axis=1, mode="clip")),
    ("take wrap", O3, lambda m, x: m.take(x, I([-9, 2, 40, -1]), axis=2, mode="wrap")),
    ("take_along_axis -1", S3, lambda m, x: m.take_along_axis(
        x, (np.arange(64).reshape(8, 4, 2) * 7 % 12 - 6), axis=-1)),
    ("take_along_axis 0 broadcast", O3, lambda m, x: m.take_along_axis(
        x, I([[[2, 0, 1, 1, 0, 2, -3]], [[0, 0, 0, -1, 1, 1, 1]]]), axis=0)),
    ("take_along_axis 1 idx broadcast", O3, lambda m, x: m.take_along_axis(
        x, I([[[4], [-5]]]), axis=1)),
    ("take_along_axis None", O3, lambda m, x: m.take_along_axis(x, I([5, 0, 104, 5]), None)),
    ("take_along_axis 1-d", (5,), lambda m, x: m.take_along_axis(x, I([1, 4, -2]), 0)),
    ("repeat int axis 1", S3, lambda m, x: m.repeat(x, 3, axis=1)),
    ("repeat int axis -1", O3, lambda m, x: m.repeat(x, 2, axis=-1)),
    ("repeat flat", O3, lambda m, x: m.repeat(x, 2)),
    ("repeat counts", S3, lambda m, x: m.repeat(x, I([1, 0, 2, 3]), axis=1)),
    ("repeat zero", O3, lambda m, x: m.repeat(x, 0, axis=0)),
    ("repeat 0-d", (), lambda m, x: m.repeat(x, 3)),
    ("repeat 1-d counts", (5,), lambda m, x: m.repeat(x, I([2, 0, 1, 1, 3]))),
    ("tile 3", S3, lambda m, x: m.tile(x, (2, 1, 3))),
    ("tile int", O3, lambda m, x: m.tile(x, 2)),
    ("tile longer reps", O3, lambda m, x: m.tile(x, (2, 1, 1, 1))),
    ("tile 0-d", (), lambda m, x: m.tile(x, 3)),
    ("tile 1-d", (5,), lambda m, x: m.tile(x, (2, 2))),
    ("flip all", S3, lambda m, x: m.flip(x)),
    ("flip axes", O3, lambda m, x: m.flip(x, (0, 2))),
    ("flip -1", O3, lambda m, x: m.flip(x, -1)),
    ("flip 0-d", (), lambda m, x: m.flip(x)),
    ("fliplr", O3, lambda m, x: m.fliplr(x)),
    ("flipud", (5,), lambda m, x: m.flipud(x)),
    ("roll axis", S3, lambda m, x: m.roll(x, 3, axis=0)),
    ("roll two axes", O3, lambda m, x: m.roll(x, (4, -1), (0, 2))),
    ("roll same axis twice", O3, lambda m, x: m.roll(x, (1, 2), (1, 1))),
    ("roll flat", O3, lambda m, x: m.roll(x, 50)),
    ("roll 1-d negative", (5,), lambda m, x: m.roll(x, -11)),
    ("roll 0-d", (), lambda m, x: m.roll(x, 1)),
    ("pad constant", O3, lambda m, x: m.pad(x, 2)),
    ("pad constant pairs", S3, lambda m, x: m.pad(x, ((1, 2), (0, 0), (3, 1)),
                                                   constant_values=((1, 0), (0, 0), (1, 1)))),
    ("pad constant one pair", O3, lambda m, x: m.pad(x, (0, 3), constant_values=1)),
    ("pad edge", S3, lambda m, x: m.pad(x, ((0, 2), (1, 1), (3, 0)), mode="edge")),
    ("pad reflect wide", O3, lambda m, x: m.pad(x, ((4, 5), (0, 1), (9, 2)), mode="reflect")),
    ("pad symmetric wide", O3, lambda m, x: m.pad(x, ((4, 5), (6, 0), (1, 8)), mode="symmetric")),
    ("pad wrap wide", O3, lambda m, x: m.pad(x, ((4, 5), (1, 6), (0, 15)), mode="wrap")),
    ("pad 1-d", (5,), lambda m, x: m.pad(x, (3, 1), mode="reflect")),
    ("pad causal conv", S3, lambda m, x: m.pad(x, ((0, 0), (2, 0), (0, 0)))),
    ("tril", S3, lambda m, x: m.tril(x)),
    ("tril k", O3, lambda m, x: m.tril(x, 2)),
    ("triu k neg", O3, lambda m, x: m.triu(x, -1)),
    ("triu 2-d", (5, 3), lambda m, x: m.triu(x, 1)),
    ("diagonal", O3, lambda m, x: m.diagonal(x)),
    ("diagonal offset axes", O3, lambda m, x: m.diagonal(x, 2, -1, 1)),
    ("diagonal neg offset", S3, lambda m, x: m.diagonal(x, -1, 2, 0)),
    ("diagonal past the end", O3, lambda m, x: m.diagonal(x, 9, 1, 2)),
    ("diag of 2-d", (5, 3), lambda m, x: m.diag(x, -2)),
    ("diag of 1-d", (5,), lambda m, x: m.diag(x, 1)),
    ("diag of 1-d neg", (5,), lambda m, x: m.diag(x, -3)),
    ("moveaxis", S3, lambda m, x: m.moveaxis(x, 0, -1)),
    ("moveaxis seq", O3, lambda m, x: m.moveaxis(x, (0, 1), (-1, 0))),
    ("swapaxes", O3, lambda m, x: m.swapaxes(x, 0, -1)),
    ("atleast_1d 0-d", (), lambda m, x: m.atleast_1d(x)),
    ("atleast_2d 1-d", (5,), lambda m, x: m.atleast_2d(x)),
    ("atleast_2d 3-d", O3, lambda m, x: m.atleast_2d(x)),
    ("atleast_3d 0-d", (), lambda m, x: m.atleast_3d(x)),
    ("atleast_3d 1-d", (5,), lambda m, x: m.atleast_3d(x)),
    ("atleast_3d 2-d", (5, 3), lambda m, x: m.atleast_3d(x)),
]
IDS = [c[0] for c in CASES]

# prod: floats only, arithmetic (compared with a tolerance)
PROD_CASES = [
    ("prod all", O3, lambda m, x: m.prod(x)),
    ("prod axis 1", O3, lambda m, x: m.prod(x, axis=1)),
    ("prod axes keepdims", S3, lambda m, x: m.prod(x, axis=(0, -1), keepdims=True)),
    ("prod 1-d", (5,), lambda m, x: m.prod(x)),
    ("prod 0-d", (), lambda m, x: m.prod(x)),
    ("prod empty", (0, 3), lambda m, x: m.prod(x, axis=0)),
]


class _NumpyReference:
    """numpy, the reference, with numpy 2's ``pad(mode="wrap")`` on numpy 1.x too: a pad
    wider than the array repeats the whole array, as jax pads (numpy 1.x repeated only part of
    it there; pyproject allows numpy 1.24)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def pad(x, pad_width, mode="constant", **kwargs):
        if mode != "wrap":
            return np.pad(x, pad_width, mode=mode, **kwargs)
        for d, (b, e) in enumerate(np.broadcast_to(np.asarray(pad_width), (x.ndim, 2))):
            n = x.shape[d]
            start = -b % n            # the row the padded dimension starts with
            reps = [1] * x.ndim
            reps[d] = -(-(start + n + b + e) // n)
            x = np.take(np.tile(x, reps), np.arange(start, start + n + b + e), axis=d)
        return x


NP = _NumpyReference()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,shape,call", CASES, ids=IDS)
def test_values_equal_numpy_every_dtype(name, shape, call, dtype):
    h = _data(shape, dtype)
    want = call(NP, h)
    got = call(cnp, cts.device_put(h))
    _assert_same(got, want, name)


def test_host_operands_and_eye():
    h = _data(O3, np.float32)
    _assert_same(cnp.flip(h, 1), np.flip(h, 1), "host operand")
    idx = I([[4, 0], [-1, 2]])
    _assert_same(cnp.take(h, cts.device_put(idx.astype(np.int32)), axis=2), np.take(h, idx, axis=2),
                 "Array indices")
    _assert_same(cnp.repeat(h, cts.device_put(I([1, 0, 2], np.int32)), axis=0),
                 np.repeat(h, [1, 0, 2], axis=0), "Array repeats")
    for args, dt in [((3,), None), ((3, 5, 1), None), ((4, 2, -1), np.int32), ((2, 2, 5), np.bool_),
                     ((0,), None), ((3, None, 0), BF16)]:
        want = np.eye(*args, dtype=dt if dt is not None else np.float32)
        _assert_same(cnp.eye(*args, dtype=dt), want, f"eye{args}")


EYE_ARGS = [(3,), (3, 5, 1), (4, 2, -1)]


def test_jax_parity_values(jax_ref):
    inputs = {}   # case -> [(dtype, host operand)]
    for name, shape, call in CASES + PROD_CASES:
        dts = (np.float32, np.int32, BF16) if "prod" not in name else (np.float32,)
        inputs[name] = []
        for dt in dts:
            h = _data(shape, dt, seed=3)
            if "prod" in name:
                h = np.abs(h) + 0.5 if h.size > 2 else h
                h = np.where(np.isfinite(h), h, 1.5).astype(dt)
            inputs[name].append((dt, h))

    def jax_side(jax):
        jnp = jax.numpy
        out = {}
        for name, shape, call in CASES + PROD_CASES:
            # the dtypes of a case in one jax program (one XLA compile); data movement is
            # exact, so grouping does not change the bits jax produces
            hs = tuple(jnp.asarray(h) for _, h in inputs[name])
            out[name] = list(jax.jit(lambda vs, call=call: tuple(call(jnp, v) for v in vs))(hs))
        out["eye"] = [jnp.eye(*args) for args in EYE_ARGS]
        return out

    wants = jax_ref("jax", jax_side)
    for name, shape, call in CASES + PROD_CASES:
        for (dt, h), want in zip(inputs[name], wants[name], strict=True):
            got = np.asarray(call(cnp, cts.device_put(h)))
            if "prod" in name:
                np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, err_msg=name)
            else:
                _assert_same(got, want, f"{name} {np.dtype(dt).name}")
    for args, want in zip(EYE_ARGS, wants["eye"], strict=True):
        _assert_same(cnp.eye(*args), want, f"eye{args}")


@pytest.mark.parametrize("name,shape,call", PROD_CASES, ids=[c[0] for c in PROD_CASES])
def test_prod_values(name, shape, call):
    rng = np.random.default_rng(5)
    h = (rng.random(shape) + 0.5).astype(np.float32)
    if h.size > 3:
        h.reshape(-1)[2] = 0.0
    want = call(NP, h.astype(np.float64))
    got = call(cnp, cts.device_put(h))
    assert got.dtype == np.float32 and got.shape == np.shape(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, err_msg=name)
    for dt in (BF16, np.float16):  # computed in float32, rounded once
        g16 = call(cnp, cts.device_put(h.astype(dt)))
        assert g16.dtype == dt
        np.testing.assert_allclose(np.asarray(g16).astype(np.float32),
                                   call(NP, h.astype(dt).astype(np.float64)), rtol=1e-2)


@pytest.mark.parametrize("dt", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32,
                                np.bool_], ids=lambda d: np.dtype(d).name)
def test_prod_of_integers_wraps_in_jnp_sum_dtype(dt):
    """jnp.prod of ints and bools: bools, int8 and int16 multiply in int32, uint8 and uint16 in
    uint32, the 32-bit ints in their own dtype, wrapping (measured with jax 0.10); a reduced
    dimension sharded over the mesh gives the one-device values; an empty product is 1."""
    wide = {np.uint8: np.uint32, np.uint16: np.uint32, np.uint32: np.uint32}.get(dt, np.int32)
    rng = np.random.default_rng(6)
    h = rng.integers(0, 2, (4, 8)).astype(bool) if dt == np.bool_ else \
        rng.integers(-7, 12, (4, 8)).astype(dt)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P("data", "model")))
    for axis in (None, 0, 1, (0, 1)):
        for keepdims in (False, True):
            got = cnp.prod(x, axis=axis, keepdims=keepdims)
            want = np.prod(h.astype(np.int64), axis=axis, keepdims=keepdims).astype(wide)
            assert got.dtype == wide and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{axis} {keepdims}")
    empty = cnp.prod(cts.device_put(h[:0]), axis=0)
    assert empty.dtype == wide
    np.testing.assert_array_equal(np.asarray(empty), np.ones(8, wide))


# --- jax's out-of-range conventions ---------------------------------------------------------

def _np_take_fill(h, idx, axis, fill, wrap=True):
    """jax's take "fill" mode built with numpy: wrap [-n, 0), others read ``fill``."""
    n = h.shape[axis]
    w = np.where(idx < 0, idx + n, idx) if wrap else idx
    ok = (w >= 0) & (w < n)
    out = np.take(h, np.clip(w, 0, n - 1), axis=axis)
    okb = ok.reshape((1,) * axis + ok.shape + (1,) * (h.ndim - axis - 1))
    return np.where(okb, out, np.asarray(fill, h.dtype))


FILLS = {np.float32: np.nan, BF16: np.nan, np.float16: np.nan, np.int32: -2**31,
         np.uint32: 2**32 - 1, np.bool_: True}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_take_out_of_range_fill_clip_wrap(dtype):
    h = _data(O3, dtype, seed=7)
    x = cts.device_put(h)
    idx = I([[0, 4, 5, -1], [-5, -6, 100, 2]])
    for axis in (1, -2):
        want = _np_take_fill(h, idx, 1, FILLS[dtype])
        _assert_same(cnp.take(x, idx, axis=axis), want, "fill default")
        _assert_same(cnp.take(x, idx, axis=axis, mode="fill"), want, "fill")
    _assert_same(cnp.take(x, idx, axis=1, fill_value=1), _np_take_fill(h, idx, 1, 1), "fill 1")
    _assert_same(cnp.take(x, idx, axis=1, mode="clip"), np.take(h, idx, axis=1, mode="clip"), "clip")
    _assert_same(cnp.take(x, idx, axis=1, mode="wrap"), np.take(h, idx, axis=1, mode="wrap"), "wrap")
    flat = I([104, 105, -106, -105])
    _assert_same(cnp.take(x, flat), _np_take_fill(h.reshape(-1), flat, 0, FILLS[dtype]), "flat")
    # take_along_axis: "fill" by default; "clip" wraps negatives first (unlike take's clip)
    ti = I([[[1, -2, 7, -8, 3]]])
    n = h.shape[2]
    w = np.where(ti < 0, ti + n, ti)
    want = np.where((w >= 0) & (w < n), np.take_along_axis(h[:1, :1], np.clip(w, 0, n - 1), 2),
                    np.asarray(FILLS[dtype], h.dtype))
    _assert_same(cnp.take_along_axis(x[:1, :1], ti, 2), want, "take_along_axis fill")
    _assert_same(cnp.take_along_axis(x[:1, :1], ti, 2, mode="clip"),
                 np.take_along_axis(h[:1, :1], np.clip(w, 0, n - 1), 2), "take_along_axis clip")
    nw = np.where((ti >= 0) & (ti < n), np.take_along_axis(h[:1, :1], np.clip(ti, 0, n - 1), 2),
                  np.asarray(FILLS[dtype], h.dtype))
    _assert_same(cnp.take_along_axis(x[:1, :1], ti, 2, wrap_negative_indices=False), nw,
                 "wrap_negative_indices=False")


def test_jax_parity_out_of_range_and_repeat_length(jax_ref):
    idx = I([[0, 4, 5, -1], [-5, -6, 100, 2]])
    ti = I([[[1, -2, 7, -8, 3]]]).repeat(3, 0)
    take_kws = ({}, {"mode": "fill"}, {"mode": "clip"}, {"mode": "wrap"}, {"fill_value": 0})
    tal_kws = ({}, {"mode": "clip"}, {"wrap_negative_indices": False}, {"fill_value": 1})
    totals = (0, 4, 9, 12)
    dts = (np.float32, np.int32, np.uint32, np.bool_, BF16)
    hs = [_data(O3, dt, seed=2) for dt in dts]

    def calls(m, x):
        """(what, value) of every call, in one order for both modules."""
        out = [(f"take {kw}", m.take(x, idx, axis=1, **kw)) for kw in take_kws]
        out.append(("take flat oob", m.take(x, I([104, 105, -106]))))
        out += [(f"tal {kw}", m.take_along_axis(x[:, :1], ti, 2, **kw)) for kw in tal_kws]
        out += [(f"repeat total {t}", m.repeat(x, I([2, 0, 1]), axis=0, total_repeat_length=t))
                for t in totals]
        out.append(("repeat int total", m.repeat(x, 2, axis=1, total_repeat_length=7)))
        return out

    def jax_side(jax):
        # each dtype's calls in one jax program (one XLA compile; data movement is exact, so
        # the bits are those of the calls made one by one)
        jnp = jax.numpy
        jax_values = jax.jit(lambda j: [v for _, v in calls(jnp, j)])
        return [jax_values(jnp.asarray(h)) for h in hs]

    wants = jax_ref("jax", jax_side)
    for dt, h, want_dt in zip(dts, hs, wants, strict=True):
        got_dt = calls(cnp, cts.device_put(h))
        assert len(got_dt) == len(want_dt)
        for (what, got), want in zip(got_dt, want_dt):
            _assert_same(got, want, f"{what} {np.dtype(dt).name}")


# --- gradients -----------------------------------------------------------------------------

GRAD_CASES = [c for c in CASES] + [
    ("take fill oob", O3, lambda m, x: m.take(x, I([[0, 9, -1], [-6, 2, 2]]), axis=1)),
    ("take_along_axis fill oob", O3, lambda m, x: m.take_along_axis(
        x, I([[[1, -2, 7, -8, 3, 3]]]), 2)),
] + PROD_CASES


def _grad_input(shape, name, seed=4):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal(shape).astype(np.float32)
    if "prod" in name:
        h = (rng.random(shape) + 0.5).astype(np.float32)
        if h.size > 3:
            h.reshape(-1)[1] = 0.0   # a zero factor: the others' product flows to it
    return h


@pytest.mark.parametrize("name,shape,call", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients_match_finite_differences(name, shape, call):
    h = _grad_input(shape, name)
    out = call(cnp, cts.device_put(h))
    rng = np.random.default_rng(1)
    w = rng.standard_normal(out.shape).astype(np.float32)
    keep = ~np.isnan(np.asarray(call(cnp, cts.device_put(np.ones(shape, np.float32)))))
    w = np.where(keep, w, 0.0).astype(np.float32)   # fills (NaN) carry no gradient

    def loss(v):
        y = call(cnp, v)
        return cnp.sum(cnp.where(keep, y, 0.0) * w)
    g = np.asarray(cts.grad(loss)(cts.device_put(h)), np.float64)
    assert g.shape == h.shape

    try:
        call(NP, h)
        numpy_ref = True    # the loss in float64 through numpy (independent, exact)
    except IndexError:
        numpy_ref = False   # jax's out-of-range reads: through ctrainstate, float32

    def f64(v):
        y = call(NP, v) if numpy_ref else call(cnp, cts.device_put(v.astype(np.float32)))
        return float(np.sum(np.where(keep, np.asarray(y, np.float64), 0.0) * w))
    eps = 1e-3 if numpy_ref else 1e-1
    for k in range(3):
        d = np.random.default_rng(10 + k).standard_normal(shape)
        fd = (f64(h + eps * d) - f64(h - eps * d)) / (2 * eps)
        np.testing.assert_allclose(np.sum(g * d), fd, rtol=2e-3, atol=2e-3, err_msg=name)


def _jax_grad_weights(out_shape):
    """The cotangent test_gradients_match_jax weighs a case's output with."""
    return np.random.default_rng(2).standard_normal(out_shape).astype(np.float32)


def test_gradients_match_jax(jax_ref):
    def jax_side(jax):
        jnp = jax.numpy
        out = {}
        for name, shape, call in GRAD_CASES:
            out_shape = jax.eval_shape(lambda v, call=call: call(jnp, v),
                                       _grad_input(shape, name)).shape
            w = _jax_grad_weights(out_shape)

            def side(v, call=call, w=w, prod="prod" in name):
                # one jax program per case: the fills' mask (NaN outputs carry no gradient)
                # and the gradient; jax compiling its side is most of this test's time
                keep = jnp.ones(out_shape, bool) if prod else ~jnp.isnan(call(jnp, v))
                return keep, jax.grad(lambda u: jnp.sum(jnp.where(keep, call(jnp, u), 0.0) * w))(v)

            keep, gj = jax.jit(side)(jnp.asarray(_grad_input(shape, name)))
            out[name] = {"out_shape": tuple(out_shape), "keep": keep, "grad": gj}
        return out

    wants = jax_ref("jax", jax_side)
    for name, shape, call in GRAD_CASES:
        h = _grad_input(shape, name)
        want = wants[name]
        keep, w = want["keep"], _jax_grad_weights(want["out_shape"])
        g = cts.grad(lambda v: cnp.sum(cnp.where(keep, call(cnp, v), 0.0) * w))(cts.device_put(h))
        np.testing.assert_allclose(np.asarray(g), want["grad"], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_16bit_gradients_keep_the_dtype(dtype):
    h = _grad_input(S3, "x").astype(dtype)
    for name, shape, call in CASES:
        if shape != S3:
            continue
        out = call(cnp, cts.device_put(h))
        assert out.dtype == dtype, name
        w = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
        g = cts.grad(lambda v: cnp.sum(call(cnp, v).astype(np.float32) * w))(cts.device_put(h))
        assert g.dtype == dtype, name
        g32 = cts.grad(lambda v: cnp.sum(call(cnp, v) * w))(cts.device_put(h.astype(np.float32)))
        np.testing.assert_allclose(np.asarray(g).astype(np.float32),
                                   np.asarray(g32.astype(dtype)).astype(np.float32),
                                   rtol=2e-2, atol=5e-2, err_msg=name)


# --- meshes ----------------------------------------------------------------------------------

MESHES = [((8,), ("x",)), ((2, 4), ("data", "model"))]


def _specs(names, ndim):
    if ndim == 0:
        return [cts.P()]
    if len(names) == 1:
        return [cts.P(), cts.P("x")] if ndim >= 1 else [cts.P()]
    return {1: [cts.P(("data", "model"))], 2: [cts.P("data", "model")],
            3: [cts.P("data", "model"), cts.P("model", None, "data"), cts.P(None, "data")]}[ndim]


def _mesh_shape(shape):
    """A shape of the case's rank whose dimensions the meshes divide (8 or 4 or 2)."""
    return {0: (), 1: (8,), 2: (8, 4), 3: S3}[len(shape)]


def _axes_of(spec):
    return [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_meshes_same_values_and_gradients_as_one_device(mesh_shape, names):
    mesh = cts.make_mesh(mesh_shape, names)
    for name, shape, call in CASES + PROD_CASES:
        if "prod empty" in name:
            continue
        shape = _mesh_shape(shape)
        try:
            call(NP, np.zeros(shape, np.float32))
        except (ValueError, IndexError):
            continue   # an index that only fits the odd shape
        h = _grad_input(shape, name)
        one = call(cnp, cts.device_put(h))
        w = np.random.default_rng(3).standard_normal(one.shape).astype(np.float32)
        g1 = cts.grad(lambda v: cnp.sum(call(cnp, v) * w))(cts.device_put(h))
        for spec in _specs(names, len(shape)):
            s = cts.NamedSharding(mesh, spec)
            x = cts.device_put(h, s)
            y = call(cnp, x)
            if "prod" in name:
                np.testing.assert_allclose(np.asarray(y), np.asarray(one), rtol=1e-6)
            else:
                _assert_same(y, one, f"{name} {spec}")
            if isinstance(y.sharding, cts.NamedSharding):   # no mesh axis from nowhere
                used = _axes_of(y.sharding.spec)
                assert set(used) <= set(_axes_of(spec)) and len(used) == len(set(used)), (name, spec)
            g = cts.grad(lambda v: cnp.sum(call(cnp, v) * w))(x)
            assert g.sharding == x.sharding, (name, spec)
            np.testing.assert_allclose(np.asarray(g), np.asarray(g1), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name} {spec}")
            for dt in (np.int32, BF16):   # other dtypes on the mesh: the one-device bits
                if "prod" in name and dt == np.int32:
                    continue
                hd = _data(shape, dt, seed=9)
                yd = call(cnp, cts.device_put(hd, s))
                if "prod" in name:
                    np.testing.assert_allclose(np.asarray(yd).astype(np.float32),
                                               np.asarray(call(cnp, cts.device_put(hd))).astype(np.float32))
                else:
                    _assert_same(yd, call(NP, hd), f"{name} {spec} {np.dtype(dt).name}")


def _spec(a):
    return tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))


# the output shardings documented in ctrainstate._src.ops.move, for x of shape (8, 4, 6) laid out
# P('data', 'model') on the (2, 4) mesh
D, M = "data", "model"
LAYOUTS = [
    (lambda x: cnp.take(x, I([3, 0]), axis=1), (D, None, None)),   # the axis: unsharded
    (lambda x: cnp.take(x, I([3, 0]), axis=2), (D, M, None)),
    (lambda x: cnp.take(x, I([[3, 0]]), axis=0), (None, None, M, None)),
    (lambda x: cnp.take_along_axis(x, np.zeros((8, 4, 1), int), -1), (None, None, None)),
    (lambda x: cnp.repeat(x, 2, axis=1), (D, M, None)),            # int count: kept
    (lambda x: cnp.repeat(x, 3, axis=0), (D, M, None)),
    (lambda x: cnp.repeat(x, I([1, 2, 0, 1]), axis=1), (D, None, None)),
    (lambda x: cnp.tile(x, (1, 1, 2)), (D, M, None)),
    (lambda x: cnp.tile(x, (2, 1, 1)), (None, M, None)),
    (lambda x: cnp.flip(x, 2), (D, M, None)),
    (lambda x: cnp.flip(x, 0), (None, M, None)),
    (lambda x: cnp.roll(x, 1, 2), (D, M, None)),
    (lambda x: cnp.roll(x, 1, 1), (D, None, None)),
    (lambda x: cnp.pad(x, ((0, 0), (0, 0), (2, 1))), (D, M, None)),
    (lambda x: cnp.pad(x, ((1, 0), (0, 0), (0, 0)), mode="edge"), (None, M, None)),
    (lambda x: cnp.tril(x), (D, M, None)),                         # a select: nothing moves
    (lambda x: cnp.triu(x.astype(np.int32), 1), (D, None, None)),  # ints: a gather
    (lambda x: cnp.diagonal(x, 0, 1, 2), (D, None)),
    (lambda x: cnp.moveaxis(x, 0, -1), (M, None, D)),
    (lambda x: cnp.swapaxes(x, 0, 1), (M, D, None)),
    (lambda x: cnp.atleast_3d(x[0]), (M, None, None)),
    (lambda x: cnp.prod(x, axis=2), (D, M)),
]


def test_output_shardings_as_documented():
    mesh = cts.make_mesh((2, 4), (D, M))
    x = cts.device_put(_data(S3, np.float32), cts.NamedSharding(mesh, cts.P(D, M)))
    for k, (f, want) in enumerate(LAYOUTS):
        assert _spec(f(x)) == want, k


def test_tril_mask_is_placed_with_the_operand_blocks(mem_baseline):
    """A (64, 64) float32 operand sharded 8 ways: each device holds a 2 KiB block; tril's mask
    (the same size) is placed as the operand, so no device ever holds the 16 KiB whole one."""
    mesh = cts.make_mesh((2, 4), (D, M))
    h = _data((64, 64), np.float32)
    x = cts.device_put(h, cts.NamedSharding(mesh, cts.P(D, M)))
    y = cnp.tril(x, -3)
    _assert_same(y, np.tril(h, -3))
    assert _spec(y) == (D, M)
    assert all(s.data.shape == (32, 16) for s in y.addressable_shards)


def test_usage_patterns():
    """What ported Flax / HF code writes: GQA's repeat of kv heads, the label
    log-probabilities of a loss, a causal mask, a causal conv's left pad."""
    mesh = cts.make_mesh((2, 4), (D, M))
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 5, 4, 3)).astype(np.float32)       # (B, T, kv heads, D)
    kx = cts.device_put(k, cts.NamedSharding(mesh, cts.P(D, None, M)))
    r = cnp.repeat(kx, 2, axis=2)
    _assert_same(r, np.repeat(k, 2, axis=2))
    assert _spec(r) == (D, None, M, None)                           # heads stay sharded
    logp = rng.standard_normal((2, 5, 8)).astype(np.float32)
    labels = rng.integers(0, 8, (2, 5))
    lx = cts.device_put(logp, cts.NamedSharding(mesh, cts.P(D, None, M)))
    picked = cnp.take_along_axis(lx, labels[..., None], -1)
    _assert_same(picked, logp[np.arange(2)[:, None], np.arange(5)[None, :], labels][..., None])
    g = cts.grad(lambda v: cnp.sum(cnp.take_along_axis(v, labels[..., None], -1)))(lx)
    onehot = (np.arange(8) == labels[..., None]).astype(np.float32)
    _assert_same(g, onehot)
    assert g.sharding == lx.sharding
    _assert_same(cnp.tril(cnp.ones((5, 5))), np.tril(np.ones((5, 5), np.float32)))
    c = cnp.pad(cts.device_put(k), ((0, 0), (2, 0), (0, 0), (0, 0)))
    _assert_same(c, np.concatenate([np.zeros((2, 2, 4, 3), np.float32), k], 1))


def _take_along_reference(h, idx, axis, mode=None, fill_value=None, wrap=True):
    """numpy's take_along_axis under jax's rules: negative entries wrap (``wrap``), then
    "clip" clamps, "fill" (None) reads ``fill_value`` (NaN / the int's end / True) out of
    range; also the flat position of every read element in ``h`` (-1: none)."""
    n = h.shape[axis]
    w = np.where(idx < 0, idx + n, idx) if wrap else idx
    ok = np.ones(w.shape, bool) if mode == "clip" else (w >= 0) & (w < n)
    wc = np.clip(w, 0, n - 1)
    vals = np.take_along_axis(h, wc, axis)
    coords = list(np.indices(vals.shape))
    coords[axis] = np.broadcast_to(wc, vals.shape)
    coords = [np.where(np.array(h.shape)[d] == 1, 0, c) for d, c in enumerate(coords)]
    pos = np.where(np.broadcast_to(ok, vals.shape), np.ravel_multi_index(coords, h.shape), -1)
    if mode != "clip":
        fill = _fill_of(h.dtype) if fill_value is None else fill_value
        vals = np.where(np.broadcast_to(ok, vals.shape), vals, np.asarray(fill, h.dtype))
    return vals.astype(h.dtype), pos


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_take_of_an_array_whole_on_each_device_runs_on_the_devices(monkeypatch, mesh_shape):
    """take of an Array that every device holds whole (one device; replicated on a mesh) with
    integer Array indices there, modes "fill" (a given fill value too) and "clip", along
    every axis and flattened, for every stored dtype and the index dtypes int8 / uint16 /
    int32: no block is copied to or from the host; the values are numpy's under jax's rules
    (fill: negative entries in range wrap, others read the fill; clip: clamped, negative
    ones to 0); the result is placed as ``a``; the gradient adds the cotangent at the rows
    read, none for entries out of range in mode "fill"."""
    sh = None if mesh_shape is None else cts.NamedSharding(cts.make_mesh(mesh_shape, (D, M)),
                                                           cts.P())
    rng = np.random.default_rng(12)
    shape = (3, 5, 4)
    cases = []   # (dtype, shape, index host array, axis, keywords)
    for dt in DTYPES + [np.int8, np.uint16]:
        cases.append((dt, shape, rng.integers(-7, 7, (2, 3)).astype(np.int32), 1, {}))
    cases += [
        (np.float32, shape, rng.integers(-5, 6, (4,)).astype(np.int8), 0, {"mode": "clip"}),
        (np.float32, shape, rng.integers(0, 7, (3, 2)).astype(np.uint16), 2, {"fill_value": -1.5}),
        (np.int32, shape, rng.integers(-9, 9, (5,)).astype(np.int32), 2, {"mode": "clip"}),
        (np.float32, shape, rng.integers(-70, 70, (6,)).astype(np.int32), None, {})]
    arrays = _placed_cases(cases, sh, rng)

    def run():
        return [cnp.take(x, i, axis=axis, **kw) for x, i, axis, kw in arrays]
    got = without_host_copies(monkeypatch, run)

    def reference(h, hi, axis, kw):
        if axis is None:
            h, axis = h.reshape(-1), 0
        n = h.shape[axis]
        if kw.get("mode") == "clip":
            return np.take(h, np.clip(hi, 0, n - 1), axis), np.ones(hi.shape, bool), axis
        w = np.where(hi < 0, hi + n, hi)
        ok = (w >= 0) & (w < n)
        vals = np.take(h, np.clip(w, 0, n - 1), axis)
        at = (1,) * axis + hi.shape + (1,) * (h.ndim - axis - 1)
        fill = np.asarray(_fill_of(h.dtype) if "fill_value" not in kw else kw["fill_value"])
        return np.where(ok.reshape(at), vals, fill.astype(h.dtype)), ok, axis
    for (x, i, axis, kw), out in zip(arrays, got):
        want, _, _ = reference(np.asarray(x), np.asarray(i).astype(np.int64), axis, kw)
        _assert_same(out, want, f"{x.dtype} {axis} {np.asarray(i).dtype} {kw}")
        assert out.sharding == (sh or x.sharding)
    for x, i, axis, kw in arrays:
        if x.dtype != np.float32:
            continue
        h, hi = np.asarray(x), np.asarray(i).astype(np.int64)
        flat = h.reshape(-1) if axis is None else h
        _, ok, ax = reference(h, hi, axis, kw)
        n = flat.shape[ax]
        w = np.clip(hi if kw.get("mode") == "clip" else np.where(hi < 0, hi + n, hi), 0, n - 1)
        c = rng.standard_normal(np.take(flat, w, ax).shape).astype(np.float32)
        g = cts.grad(lambda v: cnp.sum(cnp.take(v, i, axis=axis, **kw) * cts.device_put(c, sh)))(x)
        lead, q = int(np.prod(flat.shape[:ax])), int(np.prod(flat.shape[ax + 1:]))
        want = np.zeros((n, lead, q), np.float32)
        cc = c.reshape(lead, hi.size, q).transpose(1, 0, 2)
        np.add.at(want, w.reshape(-1)[ok.reshape(-1)], cc[ok.reshape(-1)])
        np.testing.assert_allclose(np.asarray(g).reshape(lead, n, q), want.transpose(1, 0, 2),
                                   rtol=1e-6, atol=0, err_msg=f"{axis} {kw}")


def _placed_cases(cases, sh, rng):
    """(operand, indices, axis, keywords) of each (dtype, shape, host indices, axis,
    keywords), both placed with ``sh``: the operand of _data (int8 / uint16: random ints)."""
    return [(cts.device_put(rng.integers(0, 200, shape).astype(dt) if dt in (np.int8, np.uint16)
                            else _data(shape, dt, seed=k), sh), cts.device_put(idx, sh), axis, kw)
            for k, (dt, shape, idx, axis, kw) in enumerate(cases)]


def _fill_of(dtype):
    """jax's default fill of an out-of-range read: NaN, the int's end, True."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    if dtype.kind in "iu":
        return np.iinfo(dtype).min if dtype.kind == "i" else np.iinfo(dtype).max
    return np.nan


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_take_along_axis_of_an_array_whole_on_each_device_runs_on_the_devices(monkeypatch,
                                                                            mesh_shape):
    """take_along_axis of an Array that every device holds whole (one device; replicated on a
    mesh) with integer Array indices there: the positions are computed and the elements read
    on the devices -- no block is copied to or from the host -- for every stored dtype, the
    index dtypes int8 / uint16 / int32, each mode, negative and out-of-range entries, a given
    fill value, dimensions of size 1 broadcasting on either side, and axis None; the values
    are numpy's under jax's rules, the result is placed as the operand, and the gradient
    scatter-adds the cotangent to the positions read (duplicates adding, out-of-range
    entries passing none), as numpy's add.at does."""
    sh = None if mesh_shape is None else cts.NamedSharding(cts.make_mesh(mesh_shape, (D, M)),
                                                           cts.P())
    rng = np.random.default_rng(11)
    cases = []   # (arr dtype, arr shape, index host array, axis, keywords)
    for dt in DTYPES + [np.int8, np.uint16]:
        cases.append((dt, (4, 6), rng.integers(-8, 9, (4, 3)).astype(np.int32), 1, {}))
    cases += [
        (np.float32, (4, 6), rng.integers(-8, 9, (4, 3)).astype(np.int8), 1, {"mode": "clip"}),
        (np.float32, (4, 6), rng.integers(0, 9, (1, 6)).astype(np.uint16), 0,
         {"fill_value": -2.5}),
        (np.float32, (4, 1, 5), rng.integers(-5, 5, (4, 3, 2)).astype(np.int32), 2,
         {"wrap_negative_indices": False}),
        (np.int32, (3, 5), rng.integers(-6, 6, (3, 5)).astype(np.int32), 0, {"fill_value": 7}),
        (np.float32, (2, 3, 4), rng.integers(-30, 30, (10,)).astype(np.int32), None, {}),
    ]
    arrays = _placed_cases(cases, sh, rng)

    def run():
        return [cnp.take_along_axis(x, i, axis=axis, **kw) for x, i, axis, kw in arrays]
    got = without_host_copies(monkeypatch, run)
    for (x, i, axis, kw), out in zip(arrays, got):
        h, hi = np.asarray(x), np.asarray(i)
        if axis is None:
            h, axis = h.reshape(-1), 0
        want, _ = _take_along_reference(h, hi.astype(np.int64), axis, kw.get("mode"),
                                        kw.get("fill_value"), kw.get("wrap_negative_indices", True))
        _assert_same(out, want, f"{x.dtype} {x.shape} {hi.dtype} {kw}")
        assert out.sharding == (sh or x.sharding)
    for x, i, axis, kw in arrays:
        if x.dtype != np.float32 or axis is None:
            continue
        h, hi = np.asarray(x), np.asarray(i).astype(np.int64)
        _, pos = _take_along_reference(h, hi, axis, kw.get("mode"), kw.get("fill_value"),
                                       kw.get("wrap_negative_indices", True))
        c = rng.standard_normal(pos.shape).astype(np.float32)
        g = cts.grad(lambda v: cnp.sum(cnp.take_along_axis(v, i, axis=axis, **kw)
                                       * cts.device_put(c, sh)))(x)
        want = np.zeros(h.size, np.float32)
        np.add.at(want, pos[pos >= 0], c[pos >= 0])
        np.testing.assert_allclose(np.asarray(g), want.reshape(h.shape), rtol=1e-6, atol=0,
                                   err_msg=str(kw))


# --- eval_shape ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,shape,call", CASES + PROD_CASES, ids=IDS + [c[0] for c in PROD_CASES])
def test_eval_shape(name, shape, call):
    for dt in (np.float32, np.int32) if "prod" not in name else (np.float32, BF16):
        h = np.zeros(shape, dt)
        want = call(NP, h)
        out = cts.eval_shape(lambda v: call(cnp, v), h)
        assert isinstance(out, cts.ShapeDtypeStruct), name
        assert out.shape == np.shape(want) and out.dtype == np.dtype(dt), (name, out)


def test_eval_shape_with_abstract_indices_and_eye():
    out = cts.eval_shape(lambda x, i: cnp.take(x, i, axis=1), np.zeros((3, 5, 2), np.float32),
                         np.zeros((4, 6), np.int32))
    assert out.shape == (3, 4, 6, 2)
    out = cts.eval_shape(lambda x, i: cnp.take_along_axis(x, i, axis=1),
                         np.zeros((3, 5, 2), np.int32), np.zeros((3, 7, 1), np.int32))
    assert out.shape == (3, 7, 2) and out.dtype == np.int32
    out = cts.eval_shape(lambda x, r: cnp.repeat(x, r, axis=0, total_repeat_length=6),
                         np.zeros((3, 2), np.float32), np.zeros((3,), np.int32))
    assert out.shape == (6, 2)
    with pytest.raises(ValueError, match="total_repeat_length"):
        cts.eval_shape(lambda x, r: cnp.repeat(x, r), np.zeros(3, np.float32), np.zeros(3, np.int32))
    out = cts.eval_shape(lambda: cnp.eye(3, 4, dtype=np.int32))
    assert out.shape == (3, 4) and out.dtype == np.int32


# --- errors ------------------------------------------------------------------------------------

X = np.zeros((3, 4), np.float32)
ERRORS = [
    (lambda: cnp.take(X, I([0]), axis=2), ValueError, r"take: axis 2 is out of bounds .*\(3, 4\)"),
    (lambda: cnp.take(X, I([0.5])), TypeError, "take: indices must have an integer dtype"),
    (lambda: cnp.take(X, I([0]), axis=1.0), TypeError, "take: axis must be an int"),
    (lambda: cnp.take(X, I([0]), mode="raise"), ValueError, "take: mode 'raise' is not supported"),
    (lambda: cnp.take(X, I([0]), mode="promise_in_bounds"), ValueError, "take: mode"),
    (lambda: cnp.take_along_axis(X, I([0]), 1), ValueError,
     r"take_along_axis: .*same number of dimensions.*\(1,\).*\(3, 4\)"),
    (lambda: cnp.take_along_axis(X, I([[0, 1]]), 0), ValueError,
     r"take_along_axis: indices of shape \(1, 2\) do not broadcast .*\(3, 4\)"),
    (lambda: cnp.take_along_axis(X, I([[0]]), -3), ValueError, "take_along_axis: axis -3"),
    (lambda: cnp.take_along_axis(X, I([[0]]), 1, mode="wrap"), ValueError, "take_along_axis: mode"),
    (lambda: cnp.repeat(X, -1), ValueError, "repeat: repeats must be non-negative"),
    (lambda: cnp.repeat(X, I([1, 2]), axis=0), ValueError, r"repeat: 2 repeats .* size 3 .*\(3, 4\)"),
    (lambda: cnp.repeat(X, 1.5), TypeError, "repeat: repeats must be an int"),
    (lambda: cnp.repeat(X, 2, axis=5), ValueError, "repeat: axis 5 is out of bounds"),
    (lambda: cnp.tile(X, (2, -1)), ValueError, "tile: reps must be non-negative"),
    (lambda: cnp.tile(X, 1.5), TypeError, "tile: reps must be an int"),
    (lambda: cnp.flip(X, 2), ValueError, r"flip: axis 2 is out of bounds .*\(3, 4\)"),
    (lambda: cnp.flip(X, (0, -2)), ValueError, "flip: repeated axis"),
    (lambda: cnp.fliplr(np.zeros(3)), ValueError, r"fliplr: .*at least 2-d.*\(3,\)"),
    (lambda: cnp.flipud(np.float32(1)), ValueError, "flipud: m must be at least 1-d"),
    (lambda: cnp.roll(X, 1, axis=3), ValueError, "roll: axis 3 is out of bounds"),
    (lambda: cnp.roll(X, (1, 2), axis=(0, 1, 1)), ValueError, "roll: shift .* do not broadcast"),
    (lambda: cnp.roll(X, 1.5), TypeError, "roll: shift must be an int"),
    (lambda: cnp.pad(X, -1), ValueError, "pad: pad widths must be non-negative"),
    (lambda: cnp.pad(X, ((1, 2), (1, 2), (1, 1))), ValueError,
     r"pad: pad_width of shape \(3, 2\) for an array of dimension 2 \(shape \(3, 4\)\)"),
    (lambda: cnp.pad(X, 1.5), TypeError, "pad: pad_width must hold ints"),
    (lambda: cnp.pad(X, 1, mode="mean"), ValueError, "pad: mode 'mean' is not supported"),
    (lambda: cnp.pad(X, 1, mode="linear_ramp"), ValueError, "pad: mode 'linear_ramp'"),
    (lambda: cnp.pad(X, 1, mode="reflect", reflect_type="odd"), ValueError, "pad: reflect_type"),
    (lambda: cnp.pad(X, 1, mode="edge", constant_values=3), ValueError,
     "pad: unsupported keyword argument 'constant_values' for mode 'edge'"),
    (lambda: cnp.pad(X, 1, constant_values=(1, 2, 3)), ValueError, r"pad: constant_values of shape \(3,\)"),
    (lambda: cnp.pad(np.zeros((0, 2)), 1, mode="edge"), ValueError, "pad: cannot apply 'edge'"),
    (lambda: cnp.tril(np.zeros(3)), ValueError, r"tril: m must be at least 2-d, got shape \(3,\)"),
    (lambda: cnp.triu(X, 1.5), TypeError, "triu: k must be an int"),
    (lambda: cnp.eye(-1), ValueError, "eye: negative dimensions"),
    (lambda: cnp.eye(2.5), TypeError, "eye: N must be an int"),
    (lambda: cnp.diagonal(X, 0, 0, 0), ValueError, "diagonal: axis1 and axis2 must differ"),
    (lambda: cnp.diagonal(X, 0, 0, 2), ValueError, r"diagonal: axis2 2 is out of bounds .*\(3, 4\)"),
    (lambda: cnp.diagonal(np.zeros(3), 0), ValueError, "diagonal: a must be at least 2-d"),
    (lambda: cnp.diag(np.zeros((2, 2, 2))), ValueError, r"diag: v must be 1-d or 2-d.*\(2, 2, 2\)"),
    (lambda: cnp.moveaxis(X, (0, 1), 0), ValueError, "moveaxis: source .* same number"),
    (lambda: cnp.moveaxis(X, 0, 2), ValueError, "moveaxis: destination 2 is out of bounds"),
    (lambda: cnp.moveaxis(X, (0, 0), (0, 1)), ValueError, "moveaxis: repeated axis"),
    (lambda: cnp.swapaxes(X, 0, -3), ValueError, "swapaxes: axis2 -3 is out of bounds"),
    (lambda: cnp.prod(np.zeros(3, np.complex64)), TypeError, "prod: .*dtype complex64"),
    (lambda: cnp.prod(X, axis=2), ValueError, "prod: axis 2 is out of bounds"),
    (lambda: cnp.take("abc", I([0])), TypeError, "take: argument 'a' must be an array"),
]


@pytest.mark.parametrize("k", range(len(ERRORS)))
def test_errors(k):
    call, exc, match = ERRORS[k]
    with pytest.raises(exc, match=match):
        call()


def test_errors_in_eval_shape_too():
    with pytest.raises(ValueError, match="pad: pad widths must be non-negative"):
        cts.eval_shape(lambda v: cnp.pad(v, -1), X)
    with pytest.raises(ValueError, match="flip: axis 2"):
        cts.eval_shape(lambda v: cnp.flip(v, 2), X)


def test_exported_and_documented():
    from ctrainstate._src.ops import move as _move
    for name in _move.__all__:
        assert getattr(cnp, name) is getattr(_move, name), name
        assert name in cnp.__all__, name
        doc = getattr(cnp, name).__doc__
        assert doc and ">>>" in doc, name
    res = doctest.testmod(_move, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 20


def test_edge_cases_as_jax():
    """Cases where jax raises or answers and an earlier version did the opposite."""
    with pytest.raises(IndexError, match="take: cannot take a non-empty selection"):
        cnp.take(np.zeros((0, 3), np.float32), [0], axis=0)
    assert np.asarray(cnp.take(np.zeros((0, 3), np.float32), np.zeros(0, np.int32),
                               axis=0)).shape == (0, 3)
    with pytest.raises(ValueError, match="indices must be 1-d when axis is None"):
        cnp.take_along_axis(np.float32(2.5), np.int32(0), axis=None)
    with pytest.raises(ValueError, match="indices must be 1-d when axis is None"):
        cnp.take_along_axis(np.arange(3, dtype=np.float32), np.array([[0]]), axis=None)
    for w in (1.0, [(1.0, 2.0)]):
        with pytest.raises(TypeError, match="pad_width must hold ints"):
            cnp.pad(np.ones(3, np.float32), w)
    # a 0-d array repeats as a 1-d one, whatever the axis (numpy's np.repeat agrees on axis 0)
    for axis in (None, 0, 1):
        got = np.asarray(cnp.repeat(np.float32(2.5), 3, axis=axis))
        np.testing.assert_array_equal(got, np.repeat(np.float32(2.5), 3))
    # products over an empty contracted dimension are zeros (numpy's answer)
    a, b = np.ones((2, 0), np.float32), np.ones((0, 3), np.float32)
    np.testing.assert_array_equal(np.asarray(cnp.tensordot(a, b, axes=1)), np.tensordot(a, b, 1))
    np.testing.assert_array_equal(np.asarray(cnp.matmul(cts.device_put(a), cts.device_put(b))),
                                  a @ b)
    assert float(np.asarray(cnp.vdot(np.ones(0, np.float32), np.ones(0, np.float32)))) == 0.0
