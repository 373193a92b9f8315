"""Locally connected convolutions: ``lax.conv_general_dilated_patches``,
``lax.conv_general_dilated_local`` and ``nn.ConvLocal``.

Values are checked against a float64 numpy reference written from the definition (loops over
output positions and window offsets: patch feature ``c * prod(window) + offset``, jax's
order), gradients through linearity (the op is linear in each operand, so
``<grad_x f, d> = f(d)`` for ``f(x) = <local(x, w), g>``), and against ``jax.lax`` (patches bit
for bit), ``jax.grad`` and ``flax.linen.ConvLocal`` with the same keys (conftest's ``jax_ref``:
recorded values, or live jax in the parity run).
"""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.lax as clax
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, nn, random
from conv_ref import grown


# --- a numpy reference from the definition (channels last: x (N, S..., C)) -----------------

def ref_patches(x, ks, strides, pads, lhs_dil, rhs_dil):
    """out[n, o..., c * prod(ks) + flat(k)] = xp[n, o * s + k * d, c]."""
    xp = grown(x, pads, lhs_dil)
    nsp = len(ks)
    c = xp.shape[-1]
    out_sp = [(xp.shape[1 + i] - ((ks[i] - 1) * rhs_dil[i] + 1)) // strides[i] + 1
              for i in range(nsp)]
    kpos = int(np.prod(ks))
    out = np.zeros((xp.shape[0], *out_sp, c * kpos))
    for o in np.ndindex(*out_sp):
        for kf, k in enumerate(np.ndindex(*ks)):
            src = tuple(o[i] * strides[i] + k[i] * rhs_dil[i] for i in range(nsp))
            for ci in range(c):
                out[(slice(None),) + o + (ci * kpos + kf,)] = xp[(slice(None),) + src + (ci,)]
    return out


def ref_local(x, w, ks, strides, pads, lhs_dil, rhs_dil):
    """out[n, o, f] = sum_p patches[n, o, p] * w[o, p, f]."""
    p = ref_patches(x, ks, strides, pads, lhs_dil, rhs_dil)
    return np.einsum("n...p,...pf->n...f", p, np.asarray(w, np.float64))


def _same(in_sp, ks, strides, rhs_dil):
    pads = []
    for n, k, s, d in zip(in_sp, ks, strides, rhs_dil):
        keff = (k - 1) * d + 1
        out = -(-n // s)
        total = max((out - 1) * s + keff - n, 0)
        pads.append((total // 2, total - total // 2))
    return pads


# (name, x shape (N, S..., C), window, strides, padding, lhs_dil, rhs_dil)
CASES = [
    ("1d_valid", (2, 7, 3), (3,), (1,), "VALID", (1,), (1,)),
    ("1d_strided_dilated", (2, 11, 2), (3,), (2,), "SAME", (1,), (2,)),
    ("2d_same", (2, 6, 5, 3), (2, 3), (1, 1), "SAME", (1, 1), (1, 1)),
    ("2d_explicit_lhs_dil", (1, 4, 5, 2), (2, 2), (1, 2), ((1, 0), (2, -1)), (2, 1), (1, 1)),
    ("2d_strided_rhs_dil", (3, 9, 8, 2), (3, 2), (2, 3), ((0, 1), (1, 1)), (1, 1), (2, 1)),
    ("3d", (1, 4, 5, 3, 2), (2, 2, 2), (1, 2, 1), "VALID", (1, 1, 1), (1, 1, 1)),
]
_DN = {3: ("NHC", "HIO", "NHC"), 4: ("NHWC", "HWIO", "NHWC"), 5: ("NHWDC", "HWDIO", "NHWDC")}


def _pads(case):
    _, shape, ks, strides, padding, _, rdil = case
    if padding == "VALID":
        return [(0, 0)] * len(ks)
    if padding == "SAME":
        return _same(shape[1:-1], ks, strides, rdil)
    return [tuple(p) for p in padding]


def _arrays(case, features=4, seed=0):
    rng = np.random.default_rng(seed)
    _, shape, ks, strides, padding, ldil, rdil = case
    x = rng.standard_normal(shape).astype(np.float32)
    want = ref_patches(x, ks, strides, _pads(case), ldil, rdil)
    w = rng.standard_normal(want.shape[1:] + (features,)).astype(np.float32)
    return x, w, want


def _local(case, x, w, **kw):
    _, shape, ks, strides, padding, ldil, rdil = case
    return clax.conv_general_dilated_local(x, w, strides, padding, ks, lhs_dilation=ldil,
                                           rhs_dilation=rdil,
                                           dimension_numbers=_DN[len(shape)], **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_patches_and_local_match_the_definition_and_gradients_are_linear_adjoints(case):
    _, shape, ks, strides, padding, ldil, rdil = case
    x, w, want = _arrays(case)
    got = clax.conv_general_dilated_patches(x, ks, strides, padding, ldil, rdil,
                                            dimension_numbers=_DN[len(shape)])
    # the patches are copies of input elements (and zeros): exact
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))
    y = _local(case, x, w)
    ref = ref_local(x, w, ks, strides, _pads(case), ldil, rdil)
    assert y.shape == ref.shape
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)

    rng = np.random.default_rng(1)
    g = rng.standard_normal(ref.shape)

    def f(a, b):
        return cnp.sum(_local(case, a, b) * g.astype(np.float32))
    gx, gw = cts.grad(f, argnums=(0, 1))(x, w)
    dx = rng.standard_normal(x.shape)
    dw = rng.standard_normal(w.shape)
    # f is linear in each operand: <grad_x f, dx> = f(dx, w), <grad_w f, dw> = f(x, dw)
    fx = np.sum(ref_local(dx, w, ks, strides, _pads(case), ldil, rdil) * g)
    fw = np.sum(ref_local(x, dw, ks, strides, _pads(case), ldil, rdil) * g)
    np.testing.assert_allclose(np.sum(np.asarray(gx, np.float64) * dx), fx, rtol=1e-4,
                               atol=1e-3)
    np.testing.assert_allclose(np.sum(np.asarray(gw, np.float64) * dw), fw, rtol=1e-4,
                               atol=1e-3)


# layouts whose spatial letters come in other orders in the kernel spec than in the input's,
# and index tuples, where the kernel's spatial dimensions may also come in reverse order (the
# patch features follow the kernel's order of its dimensions)
LAYOUTS = [None, ("NHWC", "HWIO", "NHWC"), ("NWHC", "WHIO", "NCWH"), ("HNCW", "IWOH", "WCHN"),
           ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 2, 1)), ((0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 3, 2))]


def _jax_layout(lax, layout):
    """layout as jax takes it: index tuples as its ConvDimensionNumbers (ctrainstate takes
    them as plain tuples)."""
    if layout is not None and not isinstance(layout[0], str):
        return lax.ConvDimensionNumbers(*layout)
    return layout


@pytest.mark.parametrize("layout", LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
def test_patches_bit_for_bit_and_local_with_gradients_match_live_jax(layout, jax_ref):
    rng = np.random.default_rng(2)
    fs, st, pad, ld, rd = (2, 3), (2, 1), ((1, 2), (0, 1)), (1, 2), (1, 2)
    # jax's reading of the layout: (lhs_spec, rhs_spec, out_spec)
    lhs_spec, rhs_spec, out_spec = jax_ref("dn", lambda lax: tuple(lax.conv_dimension_numbers(
        (1, 1, 1, 1), (1, 1) + fs, _jax_layout(lax, layout))))
    lhs_shape = [0] * 4
    lhs_shape[lhs_spec[0]], lhs_shape[lhs_spec[1]] = 2, 3
    lhs_shape[lhs_spec[2]], lhs_shape[lhs_spec[3]] = 7, 6
    lhs = rng.standard_normal(lhs_shape).astype(np.float32)

    def jpatches(jax):
        return jax.jit(lambda a: jax.lax.conv_general_dilated_patches(
            a, fs, st, pad, ld, rd, _jax_layout(jax.lax, layout)))(lhs)
    pj = jax_ref("patches", jpatches)
    pc = np.asarray(clax.conv_general_dilated_patches(lhs, fs, st, pad, ld, rd, layout))
    assert pc.shape == pj.shape
    np.testing.assert_array_equal(pc, pj)

    osp = [pj.shape[i] for i in out_spec[2:]]
    rshape = [0] * 4
    rshape[rhs_spec[0]], rshape[rhs_spec[1]] = 5, pj.shape[out_spec[1]]
    for i, d in enumerate(rhs_spec[2:]):
        rshape[d] = osp[i]
    rhs = rng.standard_normal(rshape).astype(np.float32)

    def jlocal(jax, a, b, **kw):
        return jax.lax.conv_general_dilated_local(a, b, st, pad, fs, ld, rd,
                                                  _jax_layout(jax.lax, layout), **kw)
    y_shape = jax_ref("y_shape", lambda jax: tuple(jax.eval_shape(
        lambda a, b: jlocal(jax, a, b), lhs, rhs).shape))
    g = rng.standard_normal(y_shape).astype(np.float32)

    def jax_side(jax):
        def jf(a, b):
            y = jlocal(jax, a, b, precision="highest")
            return jax.numpy.sum(jax.numpy.sin(y) * g), y
        (_, yj), gj = jax.jit(jax.value_and_grad(jf, argnums=(0, 1), has_aux=True))(lhs, rhs)
        return {"y": yj, "grads": gj}
    want = jax_ref("local", jax_side)

    def cf(a, b):
        y = clax.conv_general_dilated_local(a, b, st, pad, fs, ld, rd, layout)
        return cnp.sum(cnp.sin(y) * g), y
    (_, yc), gc = cts.value_and_grad(cf, argnums=(0, 1), has_aux=True)(lhs, rhs)
    np.testing.assert_allclose(np.asarray(yc), want["y"], rtol=1e-5, atol=1e-5)
    for a, b in zip(gc, want["grads"]):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5)


def test_local_bad_inputs_raise_clear_errors():
    case = CASES[2]
    x, w, _ = _arrays(case)
    dn = _DN[4]
    with pytest.raises(ValueError, match=r"does not fit.*one kernel per output position"):
        clax.conv_general_dilated_local(x, w[:-1], (1, 1), "SAME", (2, 3), dimension_numbers=dn)
    with pytest.raises(ValueError, match=r"patches of 18 = 3 input features \* 6"):
        clax.conv_general_dilated_local(x, w[:, :, :-1], (1, 1), "SAME", (2, 3),
                                        dimension_numbers=dn)
    with pytest.raises(ValueError, match="one entry per spatial dimension"):
        clax.conv_general_dilated_patches(x, (2,), (1, 1), "SAME", dimension_numbers=dn)
    with pytest.raises(ValueError, match="filter_shape entries must be >= 1"):
        clax.conv_general_dilated_patches(x, (2, 0), (1, 1), "SAME", dimension_numbers=dn)
    with pytest.raises(TypeError, match="filter_shape must be a sequence of ints"):
        clax.conv_general_dilated_patches(x, (2, 1.5), (1, 1), "SAME", dimension_numbers=dn)
    with pytest.raises(TypeError, match="same dtypes"):
        clax.conv_general_dilated_local(x, w.astype(cnp.bfloat16), (1, 1), "SAME", (2, 3),
                                        dimension_numbers=dn)
    with pytest.raises(TypeError, match="floating-point operands only"):
        clax.conv_general_dilated_patches(x.astype(np.int32), (2, 3), (1, 1), "SAME",
                                          dimension_numbers=dn)
    with pytest.raises(ValueError, match="String padding is not implemented"):
        clax.conv_general_dilated_patches(x, (2, 3), (1, 1), "SAME", lhs_dilation=(2, 1),
                                          dimension_numbers=dn)


def test_local_on_a_mesh_keeps_the_batch_sharding():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    case = ("2d", (4, 6, 5, 3), (3, 3), (1, 1), "SAME", (1, 1), (1, 1))
    x, w, _ = _arrays(case, features=8, seed=7)
    want = np.asarray(_local(case, x, w))
    xs = cts.device_put(x, NamedSharding(mesh, P("data")))
    y = _local(case, xs, w)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    assert y.sharding.spec[0] == "data"
    g = np.random.default_rng(8).standard_normal(want.shape).astype(np.float32)

    def f(a, b):
        return cnp.sum(_local(case, a, b) * g)
    g1 = cts.grad(f, argnums=(0, 1))(x, w)
    g8 = cts.grad(f, argnums=(0, 1))(xs, w)
    for a, b in zip(g8, g1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# --- nn.ConvLocal --------------------------------------------------------------------------

MODULES = [
    ("1d_valid", dict(features=4, kernel_size=(3,), padding="VALID"), (2, 8, 3)),
    ("2d_same_strided", dict(features=3, kernel_size=(2, 3), strides=(2, 1)), (2, 7, 6, 2)),
    ("circular_dilated", dict(features=3, kernel_size=(2, 2), padding="CIRCULAR",
                              kernel_dilation=(1, 2)), (3, 5, 6, 2)),
    ("causal_batch_dims_no_bias", dict(features=2, kernel_size=3, padding="CAUSAL",
                                       use_bias=False), (4, 2, 9, 3)),
    ("explicit_input_dilation_no_batch", dict(features=2, kernel_size=(2, 2),
                                              padding=[(1, 0), (2, 1)],
                                              input_dilation=(2, 1)), (5, 5, 2)),
]


def _module_params(shapes):
    """Random parameters of the given shapes ({name: shape}, drawn in that order)."""
    rng = np.random.default_rng(4)
    return {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}


@pytest.mark.parametrize("name,kw,shape", MODULES, ids=[m[0] for m in MODULES])
def test_conv_local_module_matches_live_flax(name, kw, shape, jax_ref):
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)

    def flax_side(jax, fnn):
        fm = fnn.ConvLocal(**kw)
        fv = fm.init(jax.random.PRNGKey(3), x)["params"]
        params = _module_params({k: v.shape for k, v in fv.items()})

        def floss(p, a):
            return jax.numpy.sum(jax.numpy.sin(fm.apply({"params": p}, a)))
        fy = jax.jit(lambda p, a: fm.apply({"params": p}, a))(params, x)
        fg = jax.jit(jax.grad(floss, argnums=(0, 1)))(params, x)
        return {"params": fv, "y": fy, "grads": fg}
    want = jax_ref("flax", flax_side)
    fv = want["params"]
    cm = nn.ConvLocal(**kw)
    cv = cm.init(random.PRNGKey(3), x)["params"]
    assert sorted(cv) == sorted(fv)
    for k in fv:
        assert cv[k].shape == fv[k].shape, k
        np.testing.assert_array_equal(np.asarray(cv[k]), fv[k], err_msg=k)
    params = _module_params({k: v.shape for k, v in fv.items()})

    def closs(p, a):
        return cnp.sum(cnp.sin(cm.apply({"params": p}, a)))
    np.testing.assert_allclose(np.asarray(cm.apply({"params": params}, x)), want["y"],
                               rtol=2e-5, atol=2e-5)
    cg = cts.grad(closs, argnums=(0, 1))(params, x)
    fg = want["grads"]
    for k in params:
        np.testing.assert_allclose(np.asarray(cg[0][k]), fg[0][k], rtol=2e-5, atol=2e-5,
                                   err_msg=k)
    np.testing.assert_allclose(np.asarray(cg[1]), fg[1], rtol=2e-5, atol=2e-5)


def test_conv_local_module_is_the_local_product_of_its_params():
    x = np.random.default_rng(5).standard_normal((2, 9, 8, 3)).astype(np.float32)
    m = nn.ConvLocal(features=4, kernel_size=(3, 2), strides=(2, 1), padding="SAME",
                     bias_init=nn.initializers.normal(1.0))
    v = m.init(random.PRNGKey(0), x)
    k, b = (np.asarray(v["params"][n]) for n in ("kernel", "bias"))
    # ceil(9 / 2) x 8 output positions, patches of 3 * 2 * 3
    assert k.shape == (5, 8, 18, 4) and b.shape == (5, 8, 4)
    pads = _same((9, 8), (3, 2), (2, 1), (1, 1))
    want = ref_local(x, k, (3, 2), (2, 1), pads, (1, 1), (1, 1)) + b
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), want, rtol=1e-5, atol=1e-5)
    # lecun_normal: variance_scaling's fan-in of a (5, 8, 18, 4) kernel is the receptive
    # field (the 40 output positions) times the 18 patch features, as in Flax
    assert np.std(k) == pytest.approx(1.0 / np.sqrt(40 * 18), rel=0.05)


def test_conv_local_module_errors_and_sharded_kernel():
    x = np.random.default_rng(6).standard_normal((2, 6, 6, 4)).astype(np.float32)
    key = random.PRNGKey(0)
    with pytest.raises(NotImplementedError, match="feature_group_count != 1"):
        nn.ConvLocal(4, (3, 3), feature_group_count=2).init(key, x)
    with pytest.raises(ValueError, match="Mask needs to have the same shape"):
        nn.ConvLocal(4, (3, 3), mask=np.ones((3, 3, 4, 4), np.float32)).init(key, x)
    with pytest.raises(ValueError, match="string padding 'SAME' is not implemented with "
                                         "input_dilation"):
        nn.ConvLocal(4, (3, 3), input_dilation=2).init(key, x)
    with pytest.raises(ValueError, match="Causal padding is only implemented for 1D"):
        nn.ConvLocal(4, (3, 3), padding="CAUSAL").init(key, x)
    # a mask of the kernel's shape multiplies it
    mask = np.zeros((6, 6, 36, 2), np.float32)
    mask[..., 0] = 1.0
    m = nn.ConvLocal(2, (3, 3), mask=mask, use_bias=False)
    v = m.init(key, x)
    y = np.asarray(m.apply(v, x))
    assert np.all(y[..., 1] == 0.0) and np.any(y[..., 0] != 0.0)
    # a kernel sharded on its output positions is born sharded, with the same values
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    sm = nn.ConvLocal(8, (3, 3), kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), ("data", None, None, "model")))
    with mesh:
        sv = sm.init(key, x)
    kernel = nn.unbox(sv["params"])["kernel"]
    assert kernel.sharding.spec == P("data", None, None, "model")
    plain = nn.ConvLocal(8, (3, 3)).init(key, x)["params"]["kernel"]
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(plain))
    with mesh:
        np.testing.assert_allclose(np.asarray(sm.apply(sv, x)),
                                   np.asarray(nn.ConvLocal(8, (3, 3)).apply(
                                       {"params": {"kernel": plain,
                                                   "bias": sv["params"]["bias"]}}, x)),
                                   rtol=1e-5, atol=1e-5)
