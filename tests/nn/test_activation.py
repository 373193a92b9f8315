"""jax.nn's activations in ctrainstate.nn (nn/activation.py): values against float64 numpy references
written from their definitions and against jax (recorded; live in the twins marked `parity`),
gradients against central finite differences and jax.grad, the kinks, 16-bit inputs."""

import math

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn
from float_checks import assert_ulps as _assert_ulps, ord_f32 as _ord


def _jax():
    return pytest.importorskip("jax")


_ACT_X = np.array([-3.0, -0.5, 0.25, 2.0], np.float32)


def test_activations_derived():
    x = _ACT_X.astype(np.float64)
    np.testing.assert_allclose(np.asarray(nn.silu(_ACT_X)), x / (1 + np.exp(-x)), rtol=1e-6)
    assert nn.swish is nn.silu
    np.testing.assert_allclose(np.asarray(nn.leaky_relu(_ACT_X)), np.where(x >= 0, x, 0.01 * x),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.leaky_relu(_ACT_X, negative_slope=0.2)),
                               np.where(x >= 0, x, 0.2 * x), rtol=1e-6)
    assert nn.one_hot(np.array([0, 2, 5, -1]), 3).tolist() == [
        [1, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert nn.one_hot(np.array([[1]]), 2, axis=0).shape == (2, 1, 1)
    # d silu / dx = s + x s (1 - s)
    g = cts.grad(lambda v: cnp.sum(nn.silu(v)))(cts.device_put(_ACT_X))
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(np.asarray(g), s + x * s * (1 - s), rtol=1e-5)


def test_one_hot_of_label_arrays_compares_on_a_c_plan():
    """one_hot of an integer Array: numpy's values (out-of-range labels a zero row, narrow and
    uint32 labels, the new axis elsewhere), the labels' sharding kept with the class axis
    unsharded, and from the second call on the compare with the kept iota runs from its C
    plan (on one device and on a 2x4 mesh); the iota of a jit trace is the program's."""
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    ln = np.array([1, 3, 0, 2, -1, 5, 4, 0], np.int64)
    for dt in (np.int32, np.uint8, np.uint32, np.int16):
        h = (ln % 5).astype(dt) if np.dtype(dt).kind == "u" else ln.astype(dt)
        for sh in (None, cts.NamedSharding(mesh, cts.P("data"))):
            lab = cts.device_put(h, sh)
            want = (h.astype(np.int64)[:, None] == np.arange(5)).astype(np.float32)
            nn.one_hot(lab, 5)
            before = cnp.equal.cache_info()["hits"]
            out = nn.one_hot(lab, 5)
            assert cnp.equal.cache_info()["hits"] == before + 1, (dt, sh)
            np.testing.assert_array_equal(np.asarray(out), want)
            if sh is not None:
                assert tuple(out.sharding.spec) + (None,) * (2 - len(out.sharding.spec)) == \
                    ("data", None)
            np.testing.assert_array_equal(np.asarray(nn.one_hot(lab, 5, axis=0)), want.T)
    f = cts.jit(lambda v: nn.one_hot(v, 4) * 2.0)
    for v in ([0, 3, 9], [2, 2, 1]):
        a = np.array(v, np.int32)
        np.testing.assert_array_equal(np.asarray(f(cts.device_put(a))),
                                      2.0 * (a[:, None] == np.arange(4)))


def test_activations_match_jax():
    jax = _jax()
    np.testing.assert_allclose(np.asarray(nn.silu(_ACT_X)), np.asarray(jax.nn.silu(_ACT_X)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.leaky_relu(_ACT_X, 0.1)),
                               np.asarray(jax.nn.leaky_relu(_ACT_X, 0.1)), rtol=1e-6)
    labels = np.array([[0, 3], [2, 7]])
    for axis in (-1, 0, 1):
        np.testing.assert_array_equal(np.asarray(nn.one_hot(labels, 4, axis=axis)),
                                      np.asarray(jax.nn.one_hot(labels, 4, axis=axis)))


# --- the activations built on the float functions (softplus ... standardize,
# gelu(approximate=False)): values against float64 numpy, gradients against finite differences and
# jax (recorded; live in each test's twin marked `parity`: `jax_ref`)

_vec_erfc = np.vectorize(math.erfc)
_RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _own_rng(twin_seed):
    """Each test draws its inputs from a stream of its own: the same in its recorded and live
    twins (jax's side is recorded for those inputs), whichever tests ran before."""
    global _RNG
    _RNG = np.random.default_rng(twin_seed)


def _grad(f, x):
    return np.asarray(cts.grad(lambda v: cnp.sum(f(v)))(x))


def _fd(f, x, h):
    """Central differences of our own f in float64 arithmetic on the float32 outputs."""
    up = np.asarray(f(x + h), np.float64)
    dn = np.asarray(f(x - h), np.float64)
    return (up - dn) / (2 * h)


_SA, _SS = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _elu64(x, a=1.0):
    return np.where(x > 0, x, a * np.expm1(np.minimum(x, 0)))


# name: (ours, float64 reference, jax.nn name, kwargs, ulps vs reference (relative),
#        float64 derivative)
_ACT = {
    "softplus": (nn.softplus, lambda x: np.logaddexp(x, 0), "softplus", {}, 4,
                 lambda x: 1 / (1 + np.exp(-x))),
    "log_sigmoid": (nn.log_sigmoid, lambda x: -np.logaddexp(0, -x), "log_sigmoid", {}, 4,
                    lambda x: 1 / (1 + np.exp(x))),
    "elu": (nn.elu, _elu64, "elu", {}, 4, lambda x: np.where(x > 0, 1.0, np.exp(x))),
    "elu_a2": (lambda x: nn.elu(x, 2.0), lambda x: _elu64(x, 2.0), "elu", {"alpha": 2.0}, 4,
               lambda x: np.where(x > 0, 1.0, 2.0 * np.exp(x))),
    "celu": (lambda x: nn.celu(x, 1.5),
             lambda x: np.maximum(x, 0) + 1.5 * np.expm1(np.minimum(x, 0) / 1.5), "celu",
             {"alpha": 1.5}, 4, lambda x: np.where(x > 0, 1.0, np.exp(x / 1.5))),
    "selu": (nn.selu, lambda x: _SS * _elu64(x, _SA), "selu", {}, 4,
             lambda x: _SS * np.where(x > 0, 1.0, _SA * np.exp(x))),
    "relu6": (nn.relu6, lambda x: np.clip(x, 0, 6), "relu6", {}, 0,
              lambda x: ((x > 0) & (x < 6)).astype(np.float64)),
    "hard_tanh": (nn.hard_tanh, lambda x: np.clip(x, -1, 1), "hard_tanh", {}, 0,
                  lambda x: ((x >= -1) & (x <= 1)).astype(np.float64)),
    "hard_sigmoid": (nn.hard_sigmoid, lambda x: np.clip(x + 3, 0, 6) / 6, "hard_sigmoid", {}, 2,
                     lambda x: ((x > -3) & (x < 3)) / 6.0),
    "hard_silu": (nn.hard_silu, lambda x: x * np.clip(x + 3, 0, 6) / 6, "hard_silu", {}, 3,
                  lambda x: np.clip(x + 3, 0, 6) / 6 + x * ((x > -3) & (x < 3)) / 6.0),
    "silu": (nn.silu, lambda x: x / (1 + np.exp(-x)), "silu", {}, 4,
             lambda x: 1 / (1 + np.exp(-x)) * (1 + x * (1 - 1 / (1 + np.exp(-x))))),
    "gelu_exact": (lambda x: nn.gelu(x, approximate=False),
                   # erfc at the float32 argument -x * f32(sqrt(1/2)) that jax's formula
                   # evaluates (for x near -11 that rounding alone moves the result ~1e-5)
                   lambda x: 0.5 * x * _vec_erfc(
                       ((-x).astype(np.float32) * np.float32(np.sqrt(0.5))).astype(np.float64)),
                   "gelu",
                   {"approximate": False}, 6,
                   lambda x: 0.5 * _vec_erfc(-x / np.sqrt(2))
                   + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi)),
}


def _act_inputs():
    x = np.r_[_RNG.uniform(-12, 12, 600), [-30, -6, -3, -1, 0, 1, 3, 6, 30, 1e-6, -1e-6]]
    return x.astype(np.float32)


@pytest.mark.parametrize("name", sorted(_ACT))
def test_activation_values(name, jax_ref):
    ours, ref, jname, kw, n_ulp, _ = _ACT[name]
    x = _act_inputs()
    got = np.asarray(ours(x))
    want = ref(x.astype(np.float64)).astype(np.float32)
    _assert_ulps(got, want, n_ulp, name)
    xs = np.r_[x, [np.inf, -np.inf, np.nan]].astype(np.float32)
    jw = jax_ref("values", lambda jax: getattr(jax.nn, jname)(xs, **kw))
    # XLA's erfc is less accurate in the far tail (see _UNARY["erfc"]): gelu's exact form
    # inherits it for x < -8
    n_jax = 64 if name == "gelu_exact" else n_ulp + 2
    _assert_ulps(np.asarray(ours(xs)), jw, n_jax, name + " vs jax")


@pytest.mark.parametrize("name", sorted(_ACT))
def test_activation_gradients(name, jax_ref):
    ours, _, jname, kw, _, deriv = _ACT[name]
    x = _act_inputs()
    kinks = {-3.0, -1.0, 0.0, 1.0, 3.0, 6.0}
    smooth = x[[all(abs(float(v) - k) > 2e-2 for k in kinks) for v in x]]
    g = _grad(ours, smooth)
    np.testing.assert_allclose(g, deriv(smooth.astype(np.float64)), rtol=2e-6, atol=1e-7)
    fd = _fd(ours, smooth, np.float32(1e-2))
    np.testing.assert_allclose(g, fd, rtol=1e-2, atol=2e-3)
    gj = jax_ref("grad", lambda jax: jax.grad(lambda v: getattr(jax.nn, jname)(v, **kw).sum())(x))
    np.testing.assert_allclose(_grad(ours, x), gj, rtol=2e-6, atol=1e-7)


def test_gradients_at_the_kinks_match_jax(jax_ref):
    """jax's choices, measured with jax 0.10.2 (and required without jax: these literals are
    those measurements): relu6' is 0 at 0 and 6; hard_tanh' is 1 at -1 and 1; hard_sigmoid'
    is 0 at -3 and 3; elu' (alpha 1) and celu' are 1 at 0."""
    cases = [(nn.relu6, [0.0, 6.0], [0.0, 0.0], "relu6", {}),
             (nn.hard_tanh, [-1.0, 1.0], [1.0, 1.0], "hard_tanh", {}),
             (nn.hard_sigmoid, [-3.0, 3.0], [0.0, 0.0], "hard_sigmoid", {}),
             (nn.elu, [0.0, -0.0], [1.0, 1.0], "elu", {}),
             (lambda v: nn.celu(v, 2.0), [0.0], [1.0], "celu", {"alpha": 2.0})]
    for f, x, want, jname, kw in cases:
        x = np.array(x, np.float32)
        assert _grad(f, x).tolist() == want, jname
        gj = jax_ref(jname, lambda jax: jax.grad(lambda v: getattr(jax.nn, jname)(v, **kw).sum())(x))
        assert np.asarray(gj).tolist() == want, jname


def test_glu_and_standardize(jax_ref):
    x = _RNG.standard_normal((3, 4, 6)).astype(np.float32)
    x64 = x.astype(np.float64)
    for axis in (-1, 1):
        a, b = np.split(x64, 2, axis=axis)
        _assert_ulps(np.asarray(nn.glu(x, axis=axis)), (a / (1 + np.exp(-b))).astype(np.float32),
                     4, "glu")
    with pytest.raises(ValueError, match="odd size"):
        nn.glu(x[..., :5])
    for alg in ("fast", "stable"):
        m = x64.mean(-1, keepdims=True)
        want = (x64 - m) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(np.asarray(nn.standardize(x, algorithm=alg)), want,
                                   rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="unknown algorithm"):
        nn.standardize(x, algorithm="exact")
    with pytest.raises(NotImplementedError, match="where"):
        nn.standardize(x, where=np.ones(x.shape, bool))
    gx = np.asarray(cts.grad(lambda v: cnp.sum(nn.glu(v) * 2.0))(x))
    a, b = np.split(x64, 2, axis=-1)
    sb = 1 / (1 + np.exp(-b))
    np.testing.assert_allclose(gx, np.concatenate([2 * sb, 2 * a * sb * (1 - sb)], -1),
                               rtol=1e-5, atol=1e-6)
    _assert_ulps(np.asarray(nn.glu(x)), jax_ref("glu", lambda jax: jax.nn.glu(x)), 2, "glu vs jax")
    np.testing.assert_allclose(gx, jax_ref("grad glu", lambda jax: jax.grad(
        lambda v: (jax.nn.glu(v) * 2.0).sum())(x)), rtol=1e-6, atol=1e-7)
    for alg in ("fast", "stable"):
        np.testing.assert_allclose(np.asarray(nn.standardize(x, algorithm=alg)),
                                   jax_ref(f"standardize {alg}", lambda jax: jax.nn.standardize(
                                       x, algorithm=alg)), rtol=1e-5, atol=1e-5)
        w = np.asarray(x * 0.5 + 1.0)
        ours = np.asarray(cts.grad(lambda v: cnp.sum(nn.standardize(v, algorithm=alg) * w))(x))
        # (the gradient is what is left of a sum that cancels: about 1e-5 everywhere, whose
        # last bits differ between CPU models in jax too, so the recording is held to 1e-6)
        theirs = jax_ref(f"grad standardize {alg}", lambda jax: jax.grad(
            lambda v: (jax.nn.standardize(v, algorithm=alg) * w).sum())(x), atol=1e-6)
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
