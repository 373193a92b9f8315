"""ctrainstate.nn.initializers: live jax parity and mesh invariance."""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import random as R
from ctrainstate.nn import initializers as I

NAMES = ["lecun_normal", "lecun_uniform", "glorot_normal", "glorot_uniform", "xavier_normal",
         "xavier_uniform", "he_normal", "he_uniform", "kaiming_normal", "kaiming_uniform"]
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def raw(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parity
@pytest.mark.parametrize("name", NAMES)
def test_parity_named(name):
    jax = pytest.importorskip("jax")
    J = jax.nn.initializers
    for dt in DTYPES:
        for shape in [(17, 33), (3, 3, 5, 7), (1, 9)]:
            k = jax.random.PRNGKey(len(shape) * 31 + shape[-1])
            got = getattr(I, name)()(np.asarray(k), shape, dt)
            want = np.asarray(getattr(J, name)()(k, shape, dt))
            assert (raw(got) == raw(want)).all(), (name, dt, shape)


@pytest.mark.parity
def test_parity_parametrised():
    jax = pytest.importorskip("jax")
    J = jax.nn.initializers
    k = jax.random.PRNGKey(4)
    pairs = [(I.normal(0.3), J.normal(0.3)), (I.uniform(2.5), J.uniform(2.5)),
             (I.truncated_normal(0.7, lower=-1.0, upper=3.0),
              J.truncated_normal(0.7, lower=-1.0, upper=3.0)),
             (I.variance_scaling(0.7, "fan_geo_avg", "normal", in_axis=0, out_axis=(1, 2)),
              J.variance_scaling(0.7, "fan_geo_avg", "normal", in_axis=0, out_axis=(1, 2))),
             (I.constant(3.0), J.constant(3.0)), (I.zeros, J.zeros), (I.ones, J.ones)]
    for mine, theirs in pairs:
        for dt in DTYPES:
            got, want = mine(np.asarray(k), (5, 6, 7), dt), np.asarray(theirs(k, (5, 6, 7), dt))
            assert (raw(got) == raw(want)).all()
    got = I.orthogonal()(np.asarray(k), (6, 5))
    want = np.asarray(J.orthogonal()(k, (6, 5)))
    np.testing.assert_allclose(got, want, atol=1e-5)  # QR: rounding differs, not bitwise


def test_errors():
    with pytest.raises(ValueError):
        I.lecun_normal()(R.PRNGKey(0), (5,))
    with pytest.raises(ValueError):
        I.variance_scaling(1.0, "fan_bad", "normal")
    with pytest.raises(ValueError):
        I.orthogonal()(R.PRNGKey(0), (5,))


@pytest.mark.parametrize("mesh_shape,names", [((1,), ("x",)), ((8,), ("x",)),
                                              ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))])
def test_mesh_invariance(mesh_shape, names):
    if cts.device_count() < int(np.prod(mesh_shape)):
        pytest.skip("needs more CPU devices (CTRAINSTATE_NUM_CPU_DEVICES=8)")
    mesh = cts.make_mesh(mesh_shape, names)
    P = cts.P
    specs = [P(), P(names[0]), P(None, names[-1]), P(tuple(names))]
    if len(names) == 2:
        specs.append(P(names[1], names[0]))
    key = R.PRNGKey(11)
    inits = [I.lecun_normal(), I.glorot_uniform(), I.he_normal(dtype=ml_dtypes.bfloat16),
             I.normal(0.02), I.zeros, I.constant(0.5), I.orthogonal()]
    for spec in specs:
        s = cts.NamedSharding(mesh, spec)
        for init in inits:
            a = init(key, (16, 8))
            b = init(key, (16, 8), out_sharding=s)
            assert isinstance(b, cts.Array) and (raw(np.asarray(b)) == raw(a)).all(), spec
