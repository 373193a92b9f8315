"""Convolutions, window reductions, pooling and the batch/group/instance norms:
``lax.conv_general_dilated`` / ``conv_transpose`` / ``reduce_window``, ``nn.Conv``,
``nn.ConvTranspose``, ``nn.max_pool`` / ``avg_pool``, ``nn.BatchNorm`` / ``GroupNorm`` /
``InstanceNorm``.

Values are checked against a float64 numpy reference written from the definition (loops over
output positions), gradients through linearity (a convolution is linear in each operand, so
``<grad_x f, d> = f(d)`` for ``f(x) = <conv(x, w), g>``), and against ``jax.lax``,
``jax.grad``, ``flax.linen`` and optax with the same keys (conftest's ``jax_ref``: recorded
values, or live jax in the parity run).
"""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.lax as clax
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, nn, optim, random
from ctrainstate import train_state as ctrain_state
from conftest import flat_tree
from conv_ref import grown


# --- a numpy reference from the definition ---------------------------------------------

def ref_conv(x, w, strides, pads, lhs_dil, rhs_dil, groups=1):
    """x (N, S..., C), w (K..., C/groups, O): out[n, o, f] = sum_{k, c} xp[n, o*s + k*d, c] *
    w[k, c, f] over the input dilated by lhs_dil and padded by pads (negative crops)."""
    x = grown(x, pads, lhs_dil)
    w = np.asarray(w, np.float64)
    nsp = x.ndim - 2
    ks = w.shape[:nsp]
    cin_g, cout = w.shape[nsp], w.shape[nsp + 1]
    og = cout // groups
    out_sp = [(x.shape[1 + i] - ((ks[i] - 1) * rhs_dil[i] + 1)) // strides[i] + 1
              for i in range(nsp)]
    out = np.zeros((x.shape[0], *out_sp, cout))
    for o in np.ndindex(*out_sp):
        for k in np.ndindex(*ks):
            pos = tuple(o[i] * strides[i] + k[i] * rhs_dil[i] for i in range(nsp))
            xv = x[(slice(None),) + pos]                       # (N, C)
            for g in range(groups):
                out[(slice(None),) + o + (slice(g * og, (g + 1) * og),)] += (
                    xv[:, g * cin_g:(g + 1) * cin_g] @ w[k][:, g * og:(g + 1) * og])
    return out


def same_pads(in_sp, ks, strides, rhs_dil, lower=False):
    pads = []
    for n, k, s, d in zip(in_sp, ks, strides, rhs_dil):
        keff = (k - 1) * d + 1
        out = -(-n // s)
        total = max((out - 1) * s + keff - n, 0)
        lo = total // 2 if not lower else total - total // 2
        pads.append((lo, total - lo))
    return pads


# (name, x shape NHWC, w shape HWIO, strides, padding, lhs_dil, rhs_dil, groups)
CONV_CASES = [
    ("1d_valid", (2, 9, 3), (3, 3, 4), (1,), "VALID", (1,), (1,), 1),
    ("1d_same_stride", (2, 10, 3), (4, 3, 2), (3,), "SAME", (1,), (1,), 1),
    ("2d_same", (2, 7, 6, 3), (3, 3, 3, 4), (1, 1), "SAME", (1, 1), (1, 1), 1),
    ("2d_stride_same_lower", (2, 7, 6, 3), (2, 3, 3, 4), (2, 2), "SAME_LOWER", (1, 1), (1, 1), 1),
    ("2d_explicit_neg", (2, 7, 6, 3), (3, 2, 3, 4), (1, 2), ((2, -1), (0, 3)), (1, 1), (1, 1), 1),
    ("2d_dilations", (1, 6, 5, 2), (3, 2, 2, 3), (1, 1), ((1, 1), (2, 0)), (2, 1), (1, 2), 1),
    ("2d_groups", (2, 6, 5, 6), (3, 3, 2, 9), (1, 1), "SAME", (1, 1), (1, 1), 3),
    ("2d_depthwise", (1, 5, 5, 4), (3, 3, 1, 4), (2, 1), "VALID", (1, 1), (1, 1), 4),
    ("3d", (1, 4, 5, 3, 2), (2, 2, 2, 2, 3), (1, 2, 1), "SAME", (1, 1, 1), (1, 1, 1), 1),
]

_DN = {3: ("NHC", "HIO", "NHC"), 4: ("NHWC", "HWIO", "NHWC"), 5: ("NHWDC", "HWDIO", "NHWDC")}


def _case_arrays(case, seed=0):
    _, xs, ws, *_ = case
    rng = np.random.default_rng(seed)
    return rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)


def _pads_of(case):
    _, xs, ws, strides, padding, ldil, rdil, _ = case
    if isinstance(padding, str):
        return same_pads(xs[1:-1], ws[:-2], strides, rdil, padding == "SAME_LOWER") \
            if padding != "VALID" else [(0, 0)] * len(strides)
    return list(padding)


def _conv(case, x, w, **kw):
    _, xs, _, strides, padding, ldil, rdil, groups = case
    return clax.conv_general_dilated(x, w, strides, padding, lhs_dilation=ldil, rhs_dilation=rdil,
                                     dimension_numbers=_DN[len(xs)], feature_group_count=groups,
                                     **kw)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_matches_definition_and_its_gradients_are_linear_adjoints(case):
    x, w = _case_arrays(case)
    _, xs, _, strides, padding, ldil, rdil, groups = case
    want = ref_conv(x, w, strides, _pads_of(case), ldil, rdil, groups)
    got = _conv(case, x, w)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # f(x, w) = <conv(x, w), g> is linear in each operand: <grad_x f, d> = <conv(d, w), g>
    rng = np.random.default_rng(1)
    g = rng.standard_normal(want.shape).astype(np.float32)
    gx, gw = cts.grad(lambda a, b: cnp.sum(_conv(case, a, b) * g), argnums=(0, 1))(x, w)
    for _ in range(2):
        dx = rng.standard_normal(x.shape)
        dw = rng.standard_normal(w.shape)
        np.testing.assert_allclose(
            np.sum(np.asarray(gx, np.float64) * dx),
            np.sum(ref_conv(dx, w, strides, _pads_of(case), ldil, rdil, groups) * g),
            rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(
            np.sum(np.asarray(gw, np.float64) * dw),
            np.sum(ref_conv(x, dw, strides, _pads_of(case), ldil, rdil, groups) * g),
            rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_and_its_gradients_match_live_jax(case, jax_ref):
    x, w = _case_arrays(case, seed=2)
    _, xs, _, strides, padding, ldil, rdil, groups = case
    if isinstance(padding, str) and any(d > 1 for d in ldil):
        pytest.skip("string padding with lhs dilation raises in jax")
    got = np.asarray(_conv(case, x, w))
    # a cotangent of ctrainstate's output shape (assert_allclose below checks jax's)
    g = np.random.default_rng(3).standard_normal(got.shape).astype(np.float32)

    def jax_side(jax):
        def jconv(a, b):
            return jax.lax.conv_general_dilated(a, b, strides, padding, lhs_dilation=ldil,
                                                rhs_dilation=rdil,
                                                dimension_numbers=_DN[len(xs)],
                                                feature_group_count=groups)
        jg = jax.grad(lambda a, b: jax.numpy.sum(jconv(a, b) * g), argnums=(0, 1))(x, w)
        return {"y": jconv(x, w), "grads": jg}
    want = jax_ref("jax", jax_side)
    np.testing.assert_allclose(got, want["y"], rtol=1e-5, atol=1e-5)
    cg = cts.grad(lambda a, b: cnp.sum(_conv(case, a, b) * g), argnums=(0, 1))(x, w)
    for c, j in zip(cg, want["grads"]):
        np.testing.assert_allclose(np.asarray(c), j, rtol=1e-4, atol=2e-5)


def test_conv_dimension_numbers_layouts_match_the_channels_last_result():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 5, 3)).astype(np.float32)      # N H W C
    w = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)      # H W I O
    base = np.asarray(clax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                dimension_numbers=("NHWC", "HWIO", "NHWC")))
    # the same convolution with operands and output in other layouts
    xn = np.transpose(x, (0, 3, 1, 2))                              # NCHW
    wo = np.transpose(w, (3, 2, 0, 1))                              # OIHW
    y = clax.conv_general_dilated(xn, wo, (1, 1), "SAME")           # default NC.. / OI.. / NC..
    np.testing.assert_allclose(np.asarray(y), np.transpose(base, (0, 3, 1, 2)), rtol=1e-6,
                               atol=1e-6)
    xh = np.transpose(x, (1, 0, 2, 3))                              # HNWC
    ww = np.transpose(w, (1, 3, 0, 2))                              # WOHI
    y = clax.conv_general_dilated(xh, ww, (1, 1), "SAME",
                                  dimension_numbers=("HNWC", "WOHI", "CWNH"))
    np.testing.assert_allclose(np.asarray(y), np.transpose(base, (3, 2, 0, 1)), rtol=1e-6,
                               atol=1e-6)
    dn = clax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
    assert dn == ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
    y = clax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
    np.testing.assert_array_equal(np.asarray(y), base)


@pytest.mark.parametrize("padding", ["SAME", "VALID", ((1, 2), (0, 1))])
@pytest.mark.parametrize("transpose_kernel", [False, True])
def test_conv_transpose_matches_live_jax(padding, transpose_kernel, jax_ref):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 5, 3)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    want = jax_ref("jax", lambda lax: lax.conv_transpose(x, w, (2, 2), padding,
                                                         transpose_kernel=transpose_kernel))
    got = clax.conv_transpose(x, w, (2, 2), padding, transpose_kernel=transpose_kernel)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_conv_transpose_is_the_input_gradient_of_a_strided_conv():
    # the adjoint of x -> conv(x, w, stride 2, VALID) applied to g is conv_transpose(g, w)
    # with transpose_kernel=True, cropped/padded to x's shape (VALID, k=3, s=2: exact size)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 7, 7, 2)).astype(np.float32)
    w = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    y = clax.conv_general_dilated(x, w, (2, 2), "VALID", dimension_numbers=dn)
    g = rng.standard_normal(y.shape).astype(np.float32)
    gx = cts.grad(lambda a: cnp.sum(clax.conv_general_dilated(a, w, (2, 2), "VALID",
                                                             dimension_numbers=dn) * g))(x)
    t = clax.conv_transpose(g, w, (2, 2), "VALID", dimension_numbers=dn, transpose_kernel=True)
    assert t.shape == x.shape
    np.testing.assert_allclose(np.asarray(t), np.asarray(gx), rtol=1e-5, atol=1e-5)


def test_conv_bad_inputs_raise_clear_errors():
    x = np.ones((1, 5, 5, 3), np.float32)
    w = np.ones((3, 3, 3, 4), np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    with pytest.raises(TypeError, match="same dtypes"):
        clax.conv_general_dilated(x, w.astype(cnp.bfloat16), (1, 1), "SAME", dimension_numbers=dn)
    with pytest.raises(ValueError, match=r"3 features.*input dimension is 2"):
        clax.conv_general_dilated(x, np.ones((3, 3, 2, 4), np.float32), (1, 1), "SAME",
                                  dimension_numbers=dn)
    with pytest.raises(ValueError, match="String padding is not implemented"):
        clax.conv_general_dilated(x, w, (1, 1), "SAME", lhs_dilation=(2, 2), dimension_numbers=dn)
    with pytest.raises(ValueError, match="'VALID', 'SAME' or 'SAME_LOWER'"):
        clax.conv_general_dilated(x, w, (1, 1), "FULL", dimension_numbers=dn)
    with pytest.raises(ValueError, match="2 spatial dimensions"):
        clax.conv_general_dilated(x, w, (1, 1), ((1, 1),), dimension_numbers=dn)
    with pytest.raises(ValueError, match="window_strides must have 2 entries"):
        clax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=dn)
    with pytest.raises(ValueError, match="window_strides entries must be >= 1"):
        clax.conv_general_dilated(x, w, (0, 1), "SAME", dimension_numbers=dn)
    with pytest.raises(TypeError, match="has no 'C' dimension"):
        clax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWX", "HWIO", "NHWC"))
    with pytest.raises(TypeError, match="same rank"):
        clax.conv_general_dilated(x, np.ones((3, 3, 3), np.float32), (1, 1), "SAME")
    with pytest.raises(TypeError, match="floating-point"):
        clax.conv_general_dilated(np.ones((1, 3, 5), np.int32), np.ones((2, 3, 2), np.int32),
                                  (1,), "SAME")
    with pytest.raises(NotImplementedError, match="batch_group_count"):
        clax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn, batch_group_count=2)
    with pytest.raises(ValueError, match="removes more than"):
        clax.conv_general_dilated(x, w, (1, 1), ((-3, -3), (0, 0)), dimension_numbers=dn)


def test_conv_on_a_mesh_keeps_the_batch_and_feature_shardings():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 6, 5, 3)).astype(np.float32)
    w = rng.standard_normal((3, 3, 3, 8)).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    want = np.asarray(clax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn))
    xs = cts.device_put(x, NamedSharding(mesh, P("data")))
    ws = cts.device_put(w, NamedSharding(mesh, P(None, None, None, "model")))
    y = clax.conv_general_dilated(xs, ws, (1, 1), "SAME", dimension_numbers=dn)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    assert y.sharding.spec[0] == "data" and y.sharding.spec[-1] == "model"
    g = rng.standard_normal(want.shape).astype(np.float32)

    def f(a, b):
        return cnp.sum(clax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dn) * g)
    g1 = cts.grad(f, argnums=(0, 1))(x, w)
    g8 = cts.grad(f, argnums=(0, 1))(xs, ws)
    for a, b in zip(g8, g1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert g8[1].sharding.spec[-1] == "model"


# --- reduce_window and pooling -------------------------------------------------------------

def ref_pool(x, window, strides, pads, init, op):
    x = np.pad(np.asarray(x, np.float64), pads, constant_values=init)
    out_sp = [(x.shape[d] - window[d]) // strides[d] + 1 for d in range(x.ndim)]
    out = np.empty(out_sp)
    for o in np.ndindex(*out_sp):
        sl = tuple(slice(o[d] * strides[d], o[d] * strides[d] + window[d]) for d in range(x.ndim))
        out[o] = op(x[sl])
    return out


@pytest.mark.parametrize("padding", ["VALID", "SAME", ((0, 0), (1, 1), (2, 0), (0, 0))])
@pytest.mark.parametrize("kind", ["max", "min", "add"])
def test_reduce_window_matches_definition(kind, padding):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 7, 6, 3)).astype(np.float32)
    window, strides = (1, 3, 2, 1), (1, 2, 2, 1)
    init, comp, op = {"max": (-np.inf, cnp.maximum, np.max), "min": (np.inf, cnp.minimum, np.min),
                      "add": (0.0, cnp.add, np.sum)}[kind]
    pads = (same_pads(x.shape, window, strides, (1,) * 4) if padding == "SAME"
            else [(0, 0)] * 4 if padding == "VALID" else padding)
    want = ref_pool(x, window, strides, pads, init, op)
    got = clax.reduce_window(x, init, comp, window, strides, padding)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_max_pool_gradient_goes_to_the_first_maximum_of_each_window():
    # windows of equal values (ReLU zeros): the whole cotangent goes to the window's first
    # element, as XLA's select_and_scatter with >= does
    x = np.zeros((1, 4, 4, 1), np.float32)
    x[0, 2, 3, 0] = 1.0
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32).reshape(1, 2, 2, 1)
    g = cts.grad(lambda a: cnp.sum(nn.max_pool(a, (2, 2), strides=(2, 2)) * w))(x)
    want = np.zeros((4, 4), np.float32)
    want[0, 0], want[0, 2], want[2, 0], want[2, 3] = 1.0, 2.0, 3.0, 4.0
    np.testing.assert_array_equal(np.asarray(g)[0, :, :, 0], want)


def test_max_pool_nan_values_and_gradients_follow_xla():
    # values: NaN wherever a window holds one. Gradient: XLA's selection keeps the current
    # element while `current >= candidate`, so a NaN on either side moves it on: in [1, NaN, 3]
    # the value is NaN and the gradient goes to the 3 (derived by hand from that rule)
    x = np.array([1.0, np.nan, 3.0, 2.0, 5.0, 5.0], np.float32).reshape(1, 6, 1)
    y = nn.max_pool(x, (3,), strides=(1,))
    np.testing.assert_array_equal(np.asarray(y).ravel(), [np.nan, np.nan, 5.0, 5.0])
    g = cts.grad(lambda a: cnp.sum(nn.max_pool(a, (3,), strides=(1,))))(x)
    #  windows [1,nan,3] -> 3, [nan,3,2] -> 3, [3,2,5] -> 5, [2,5,5] -> first 5
    np.testing.assert_array_equal(np.asarray(g).ravel(), [0.0, 0.0, 2.0, 0.0, 2.0, 0.0])


@pytest.mark.parametrize("window,strides", [((2,), (2,)), ((3,), (1,))])
def test_max_and_min_pool_with_nans_and_infs_match_live_flax(window, strides, jax_ref):
    x = np.array([1.0, np.nan, 3.0, 2.0, 5.0, 5.0, np.nan, np.nan, -np.inf, -np.inf],
                 np.float32).reshape(1, 10, 1)

    def flax_side(jax, fnn):
        out = {}
        for name in ("max_pool", "min_pool"):
            fpool = getattr(fnn.pooling, name)
            jg = jax.grad(lambda a: jax.numpy.sum(fpool(a, window, strides=strides)))(x)
            out[name] = {"y": fpool(x, window, strides=strides), "grad": jg}
        return out
    want = jax_ref("flax", flax_side)
    for name in ("max_pool", "min_pool"):
        cpool = getattr(nn.pooling, name)
        np.testing.assert_array_equal(np.asarray(cpool(x, window, strides=strides)),
                                      want[name]["y"])
        cg = cts.grad(lambda a: cnp.sum(cpool(a, window, strides=strides)))(x)
        np.testing.assert_array_equal(np.asarray(cg), want[name]["grad"])


def test_pooling_keeps_bfloat16():
    x = np.random.default_rng(14).standard_normal((2, 6, 6, 3)).astype(cnp.bfloat16)
    for pool in (nn.max_pool, nn.avg_pool):
        y = pool(x, (2, 2), strides=(2, 2))
        assert y.dtype == cnp.bfloat16
    want = x.astype(np.float32).reshape(2, 3, 2, 3, 2, 3).max(axis=(2, 4))
    np.testing.assert_array_equal(np.asarray(nn.max_pool(x, (2, 2), strides=(2, 2)), np.float32),
                                  want)


# (the pooling function of flax.linen.pooling / ctrainstate.nn.pooling, its keywords)
POOLS = [("max_pool", {}), ("avg_pool", {}), ("avg_pool", {"count_include_pad": False}),
         ("min_pool", {})]


@pytest.mark.parametrize("padding", ["VALID", "SAME", ((1, 1), (0, 1))])
def test_pooling_and_its_gradients_match_live_flax(padding, jax_ref):
    rng = np.random.default_rng(9)
    x = np.maximum(rng.standard_normal((2, 7, 6, 3)), 0).astype(np.float32)   # ties at 0
    got, gs = [], []
    for name, kw in POOLS:
        got.append(np.asarray(getattr(nn.pooling, name)(x, (3, 2), strides=(2, 1),
                                                         padding=padding, **kw)))
        # a cotangent of ctrainstate's output shape (assert_allclose below checks flax's)
        gs.append(rng.standard_normal(got[-1].shape).astype(np.float32))

    def flax_side(jax, fnn):
        out = []
        for (name, kw), g in zip(POOLS, gs):
            def f(a):
                return getattr(fnn.pooling, name)(a, (3, 2), strides=(2, 1), padding=padding,
                                                  **kw)
            out.append({"y": f(x), "grad": jax.grad(lambda a: jax.numpy.sum(f(a) * g))(x)})
        return {"pools": out, "unbatched": fnn.max_pool(x[0], (2, 2))}
    want = jax_ref("flax", flax_side)
    for (name, kw), g, y, w in zip(POOLS, gs, got, want["pools"]):
        np.testing.assert_allclose(y, w["y"], rtol=1e-6, atol=1e-6)
        cg = cts.grad(lambda a: cnp.sum(getattr(nn.pooling, name)(
            a, (3, 2), strides=(2, 1), padding=padding, **kw) * g))(x)
        np.testing.assert_allclose(np.asarray(cg), w["grad"], rtol=1e-5, atol=1e-6)
    # no batch dimension: added and removed
    np.testing.assert_array_equal(np.asarray(nn.max_pool(x[0], (2, 2))), want["unbatched"])


def test_reduce_window_generic_computation_and_errors():
    x = np.arange(1.0, 7.0, dtype=np.float32)
    y = clax.reduce_window(x, 1.0, cnp.multiply, (2,), (2,), "VALID")
    np.testing.assert_array_equal(np.asarray(y), [2.0, 12.0, 30.0])
    y = clax.reduce_window(x, 0.0, lambda a, b: a + 2.0 * b, (3,), (3,), "VALID")
    np.testing.assert_array_equal(np.asarray(y), [12.0, 30.0])
    with pytest.raises(ValueError, match="one entry per dimension"):
        clax.reduce_window(x, 0.0, cnp.add, (2, 2), (1, 1), "VALID")
    with pytest.raises(ValueError, match=">= 1"):
        clax.reduce_window(x, 0.0, cnp.add, (0,), (1,), "VALID")
    with pytest.raises(TypeError, match="computation must be a function"):
        clax.reduce_window(x, 0.0, "add", (2,), (1,), "VALID")
    with pytest.raises(ValueError, match="one \\(low, high\\) pair per window dimension"):
        nn.max_pool(np.ones((1, 4, 4, 1), np.float32), (2, 2), padding=((1, 1),))


# --- Conv / ConvTranspose modules -------------------------------------------------------

CONV_MODULES = [
    ("same", dict(features=4, kernel_size=(3, 3))),
    ("valid_stride", dict(features=4, kernel_size=(3, 3), padding="VALID", strides=2)),
    ("circular_dilated", dict(features=4, kernel_size=(3, 3), padding="CIRCULAR",
                              kernel_dilation=2)),
    ("reflect", dict(features=4, kernel_size=(3, 2), padding="REFLECT")),
    ("int_pairs", dict(features=4, kernel_size=(3, 3), padding=((1, 2), 0))),
    ("input_dilation", dict(features=4, kernel_size=(3, 3), padding=1, input_dilation=(2, 1),
                            strides=(1, 2))),
    ("groups", dict(features=6, kernel_size=(3, 3), feature_group_count=3)),
    ("no_bias", dict(features=4, kernel_size=(3, 3), use_bias=False)),
]
CONVT_MODULES = [
    ("same", dict(features=4, kernel_size=(3, 3))),
    ("stride2", dict(features=4, kernel_size=(3, 3), strides=(2, 2))),
    ("valid", dict(features=4, kernel_size=(3, 3), strides=(2, 1), padding="VALID")),
    ("circular", dict(features=4, kernel_size=(3, 3), strides=2, padding="CIRCULAR")),
    ("circular_tk", dict(features=4, kernel_size=(3, 3), strides=2, padding="CIRCULAR",
                         transpose_kernel=True)),
    ("pairs_dilated", dict(features=4, kernel_size=(3, 3), padding=((1, 0), (2, 1)),
                           kernel_dilation=(1, 2))),
]


def _x2():
    return np.random.default_rng(10).standard_normal((2, 9, 8, 3)).astype(np.float32)


def _check_module_against_flax(jax_ref, key, build, x, atol=2e-6):
    """build(m) (m: flax.linen or ctrainstate.nn) initialised with the same key: the same
    variables, and the same output."""
    def flax_side(jax, fnn):
        fv = build(fnn).init(jax.random.PRNGKey(3), x)
        return {"vars": flat_tree(fv), "y": build(fnn).apply(fv, x)}
    want = jax_ref(key, flax_side)
    fl = want["vars"]
    cv = build(nn).init(random.PRNGKey(3), x)
    cl = {k: np.asarray(a) for k, a in flat_tree(cv).items()}
    assert sorted(cl) == sorted(fl)
    for k in fl:
        np.testing.assert_array_equal(cl[k], fl[k], err_msg=k)
    np.testing.assert_allclose(np.asarray(build(nn).apply(cv, x)), want["y"], rtol=1e-5,
                               atol=atol)


@pytest.mark.parametrize("name,kw", CONV_MODULES, ids=[c[0] for c in CONV_MODULES])
def test_conv_module_matches_live_flax(name, kw, jax_ref):
    _check_module_against_flax(jax_ref, "flax", lambda m: m.Conv(**kw), _x2())


@pytest.mark.parametrize("name,kw", CONVT_MODULES, ids=[c[0] for c in CONVT_MODULES])
def test_conv_transpose_module_matches_live_flax(name, kw, jax_ref):
    _check_module_against_flax(jax_ref, "flax", lambda m: m.ConvTranspose(**kw), _x2())


def test_conv_module_batch_dims_and_causal_padding_match_live_flax(jax_ref):
    x = np.random.default_rng(11).standard_normal((2, 3, 7, 5)).astype(np.float32)
    _check_module_against_flax(jax_ref, "causal", lambda m: m.Conv(4, 3, padding="CAUSAL"), x)
    _check_module_against_flax(jax_ref, "unbatched", lambda m: m.Conv(4, (3, 3)),
                               _x2()[0])   # no batch dimension


def test_conv_module_output_is_the_lax_conv_of_its_params():
    x = _x2()
    m = nn.Conv(features=4, kernel_size=(3, 2), strides=(2, 1), padding="SAME")
    v = m.init(random.PRNGKey(0), x)
    k, b = (np.asarray(v["params"][n]) for n in ("kernel", "bias"))
    assert k.shape == (3, 2, 3, 4) and b.shape == (4,)
    want = ref_conv(x, k, (2, 1), same_pads((9, 8), (3, 2), (2, 1), (1, 1)), (1, 1), (1, 1)) + b
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), want, rtol=1e-5, atol=1e-5)


def test_conv_module_bfloat16_dtype_matches_flax(jax_ref):
    x = _x2()
    cm = nn.Conv(4, (3, 3), dtype=cnp.bfloat16)
    v = cm.init(random.PRNGKey(0), x)
    y = cm.apply(v, x)
    assert y.dtype == cnp.bfloat16
    # flax's module with the same (ctrainstate's) parameters, as numpy arrays
    v_np = cts.tree_util.tree_map(np.asarray, v)
    fy = jax_ref("flax", lambda jnp, fnn: fnn.Conv(4, (3, 3), dtype=jnp.bfloat16).apply(v_np, x))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(fy, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_conv_module_kernel_born_sharded_and_errors():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    m = nn.Conv(8, (3, 3), kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                           (None, None, None, "model")))
    x = _x2()
    with mesh:
        v = m.init(random.PRNGKey(0), x)
    kernel = nn.unbox(v["params"])["kernel"]
    assert kernel.sharding.spec == P(None, None, None, "model")
    plain = nn.Conv(8, (3, 3)).init(random.PRNGKey(0), x)["params"]["kernel"]
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(plain))
    with pytest.raises(ValueError, match="Invalid padding format"):
        nn.Conv(4, (3, 3), padding=((1, 2, 3), 0)).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="Causal padding is only implemented for 1D"):
        nn.Conv(4, (3, 3), padding="CAUSAL").init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="not divisible by feature_group_count"):
        nn.Conv(4, (3, 3), feature_group_count=2).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="Mask needs to have the same shape"):
        nn.Conv(4, (3, 3), mask=np.ones((3, 3, 3, 5), np.float32)).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="fewer dimensions"):
        nn.Conv(4, (3, 3)).init(random.PRNGKey(0), np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="strides"):
        nn.Conv(4, (3, 3), strides=(1, 2, 3)).init(random.PRNGKey(0), x)


def test_masked_conv_zeroes_the_masked_taps():
    x = _x2()
    mask = np.zeros((3, 3, 3, 4), np.float32)
    mask[1, 1] = 1.0      # the centre tap only: a 1x1 convolution
    m = nn.Conv(4, (3, 3), mask=mask, use_bias=False)
    v = m.init(random.PRNGKey(0), x)
    centre = np.asarray(v["params"]["kernel"])[1, 1]
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), x @ centre, rtol=1e-5, atol=1e-5)


# --- norms ----------------------------------------------------------------------------------

def _xn():
    return (np.random.default_rng(12).standard_normal((4, 5, 6)) * 3 + 1).astype(np.float32)


def test_batch_norm_train_and_eval_against_the_formula():
    x = _xn()
    bn = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)
    v = bn.init(random.PRNGKey(0), x)
    assert sorted(v) == ["batch_stats", "params"]
    np.testing.assert_array_equal(np.asarray(v["batch_stats"]["mean"]), np.zeros(6))
    np.testing.assert_array_equal(np.asarray(v["batch_stats"]["var"]), np.ones(6))
    y, upd = bn.apply(v, x, mutable=["batch_stats"])
    x64 = x.astype(np.float64)
    mu, var = x64.mean(axis=(0, 1)), x64.var(axis=(0, 1))
    np.testing.assert_allclose(np.asarray(y), (x64 - mu) / np.sqrt(var + 1e-5), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(upd["batch_stats"]["mean"]), 0.1 * mu, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(upd["batch_stats"]["var"]), 0.9 + 0.1 * var, rtol=1e-5)
    # evaluation: the stored statistics, whatever the batch
    ev = {"params": v["params"], "batch_stats": upd["batch_stats"]}
    y2 = nn.BatchNorm(use_running_average=True).apply(ev, x[:1])
    rm, rv = (np.asarray(upd["batch_stats"][k], np.float64) for k in ("mean", "var"))
    np.testing.assert_allclose(np.asarray(y2), (x64[:1] - rm) / np.sqrt(rv + 1e-5), rtol=1e-4,
                               atol=1e-5)
    # the call argument overrides an unset field (Flax's merge_param); both set is an error
    y3 = nn.BatchNorm().apply(ev, x[:1], use_running_average=True)
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y2))
    with pytest.raises(ValueError, match="use_running_average"):
        nn.BatchNorm(use_running_average=True).apply(ev, x, use_running_average=False)
    with pytest.raises(ValueError, match='collection "batch_stats" is immutable'):
        bn.apply(v, x)
    with pytest.raises(NameError, match="axis_name='batch'.*enclosing ctrainstate.pmap"):
        nn.BatchNorm(use_running_average=False, axis_name="batch").init(random.PRNGKey(0), x)
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        nn.BatchNorm(use_running_average=False, axis_index_groups=[[0]]).init(
            random.PRNGKey(0), x)


def test_norms_match_live_flax(jax_ref):
    x = _xn()
    for i, build in enumerate((
            lambda m: m.GroupNorm(num_groups=3),
            lambda m: m.GroupNorm(num_groups=None, group_size=2),
            lambda m: m.GroupNorm(num_groups=2, reduction_axes=(-1,)),
            lambda m: m.InstanceNorm(), lambda m: m.InstanceNorm(feature_axes=(1, 2)),
            lambda m: m.BatchNorm(use_running_average=True),
            lambda m: m.BatchNorm(use_running_average=True, axis=(1,)))):
        _check_module_against_flax(jax_ref, f"norm{i}", build, x, atol=3e-6)

    def train_bn(m):
        return m.BatchNorm(use_running_average=False, momentum=0.8, use_fast_variance=False)

    def flax_side(jax, fnn):
        fb = train_bn(fnn)
        fy, fu = fb.apply(fb.init(jax.random.PRNGKey(0), x), x, mutable=["batch_stats"])
        return {"y": fy, "batch_stats": fu["batch_stats"]}
    want = jax_ref("batch_norm_train", flax_side)
    cb = train_bn(nn)
    cv = cb.init(random.PRNGKey(0), x)
    cy, cu = cb.apply(cv, x, mutable=["batch_stats"])
    np.testing.assert_allclose(np.asarray(cy), want["y"], rtol=1e-5, atol=2e-6)
    for k in ("mean", "var"):
        np.testing.assert_allclose(np.asarray(cu["batch_stats"][k]), want["batch_stats"][k],
                                   rtol=1e-6, atol=1e-7)


def test_group_norm_against_the_formula_and_errors():
    x = _xn()
    y = nn.GroupNorm(num_groups=3, use_bias=False, use_scale=False).apply({}, x)
    g = x.astype(np.float64).reshape(4, 5, 3, 2)
    mu = g.mean(axis=(1, 3), keepdims=True)
    var = g.var(axis=(1, 3), keepdims=True)
    np.testing.assert_allclose(np.asarray(y), ((g - mu) / np.sqrt(var + 1e-6)).reshape(x.shape),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="does not divide the number of channels"):
        nn.GroupNorm(num_groups=4).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="Either `num_groups` or `group_size`"):
        nn.GroupNorm(num_groups=3, group_size=2).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="not multiple of the group size"):
        nn.GroupNorm(num_groups=None, group_size=4).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="must include the final dimension"):
        nn.GroupNorm(num_groups=3, reduction_axes=(1,)).init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="cannot include the leading dimension"):
        nn.InstanceNorm(feature_axes=0).init(random.PRNGKey(0), x)


def test_batch_norm_over_a_sharded_batch_equals_one_device():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = _xn()
    bn = nn.BatchNorm(use_running_average=False)
    v = bn.init(random.PRNGKey(0), x)
    y1, u1 = bn.apply(v, x, mutable=["batch_stats"])
    xs = cts.device_put(x, NamedSharding(mesh, P("data")))
    y8, u8 = bn.apply(v, xs, mutable=["batch_stats"])
    np.testing.assert_allclose(np.asarray(y8), np.asarray(y1), rtol=1e-6, atol=1e-6)
    for k in ("mean", "var"):
        np.testing.assert_allclose(np.asarray(u8["batch_stats"][k]),
                                   np.asarray(u1["batch_stats"][k]), rtol=1e-6, atol=1e-7)


# --- a small CNN trained with TrainState, as the Flax ImageNet example does ---------------

def _cnn(m):
    class CNN(m.Module):
        @m.compact
        def __call__(self, x, train: bool):
            # no bias before the norm (as Flax's ResNet): its gradient is zero up to rounding
            # noise, which Adam's normalisation would turn into steps of either sign
            x = m.Conv(8, (3, 3), use_bias=False)(x)
            x = m.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = m.relu(x)
            x = m.max_pool(x, (2, 2), strides=(2, 2))
            x = m.Conv(4, (3, 3), strides=(2, 2), padding="VALID")(x)
            x = m.avg_pool(x, (1, 1))
            x = x.reshape((x.shape[0], -1))
            return m.Dense(3)(x)
    return CNN()


def test_cnn_with_batch_stats_trains_like_flax_and_optax(jax_ref):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((6, 10, 10, 2)).astype(np.float32)
    labels = rng.integers(0, 3, 6)
    onehot = np.eye(3, dtype=np.float32)[labels]

    def flax_side(jax, fnn, optax):
        from flax.training import train_state as ftrain_state
        jnp = jax.numpy

        class FState(ftrain_state.TrainState):
            batch_stats: dict

        fm = _cnn(fnn)
        fv = fm.init(jax.random.PRNGKey(0), x, train=False)
        fs = FState.create(apply_fn=fm.apply, params=fv["params"], tx=optax.adam(1e-2),
                           batch_stats=fv["batch_stats"])

        def floss(p, bs):
            logits, upd = fs.apply_fn({"params": p, "batch_stats": bs}, x, train=True,
                                      mutable=["batch_stats"])
            return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, -1)), upd
        losses = []
        for _ in range(4):
            (fl, fu), fg = jax.value_and_grad(floss, has_aux=True)(fs.params, fs.batch_stats)
            losses.append(fl)
            fs = fs.apply_gradients(grads=fg).replace(batch_stats=fu["batch_stats"])
        ev = fm.apply({"params": fs.params, "batch_stats": fs.batch_stats}, x, train=False)
        return {"losses": losses, "batch_stats": fs.batch_stats["BatchNorm_0"], "eval": ev}
    want = jax_ref("flax", flax_side)

    class CState(ctrain_state.TrainState):
        batch_stats: dict

    cm = _cnn(nn)
    cv = cm.init(random.PRNGKey(0), x, train=False)
    cs = CState.create(apply_fn=cm.apply, params=cv["params"], tx=optim.adam(1e-2),
                       batch_stats=cv["batch_stats"])

    def closs(p, bs):
        logits, upd = cs.apply_fn({"params": p, "batch_stats": bs}, x, train=True,
                                  mutable=["batch_stats"])
        return -cnp.mean(cnp.sum(nn.log_softmax(logits) * onehot, -1)), upd

    for step in range(4):
        (cl, cu), cg = cts.value_and_grad(closs, has_aux=True)(cs.params, cs.batch_stats)
        np.testing.assert_allclose(float(cl), float(want["losses"][step]), rtol=2e-5,
                                   err_msg=f"step {step}")
        cs = cs.apply_gradients(grads=cg).replace(batch_stats=cu["batch_stats"])
    for k in ("mean", "var"):
        np.testing.assert_allclose(np.asarray(cs.batch_stats["BatchNorm_0"][k]),
                                   want["batch_stats"][k], rtol=1e-4, atol=1e-5)
    ev_c = cm.apply({"params": cs.params, "batch_stats": cs.batch_stats}, x, train=False)
    np.testing.assert_allclose(np.asarray(ev_c), want["eval"], rtol=1e-3, atol=1e-4)
