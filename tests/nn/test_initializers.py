"""ctrainstate.nn.initializers: jax parity (recorded and live) and mesh invariance."""
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


@pytest.mark.parametrize("name", NAMES)
def test_parity_named(name, jax_ref):
    for dt in DTYPES:
        for shape in [(17, 33), (3, 3, 5, 7), (1, 9)]:
            seed = len(shape) * 31 + shape[-1]
            got = getattr(I, name)()(R.PRNGKey(seed), shape, dt)
            want = jax_ref(f"{dt.name}{shape}", lambda jax: getattr(jax.nn.initializers, name)()(
                jax.random.PRNGKey(seed), shape, dt))
            assert got.dtype == want.dtype and (raw(got) == raw(want)).all(), (name, dt, shape)


def _parametrised(I):
    return [I.normal(0.3), I.uniform(2.5), I.truncated_normal(0.7, lower=-1.0, upper=3.0),
            I.variance_scaling(0.7, "fan_geo_avg", "normal", in_axis=0, out_axis=(1, 2)),
            I.constant(3.0), I.zeros, I.ones]


def test_parity_parametrised(jax_ref):
    k = R.PRNGKey(4)
    theirs = jax_ref("values", lambda jax: [
        [init(jax.random.PRNGKey(4), (5, 6, 7), dt) for dt in DTYPES]
        for init in _parametrised(jax.nn.initializers)])
    for mine, want in zip(_parametrised(I), theirs):
        for dt, w in zip(DTYPES, want):
            got = mine(k, (5, 6, 7), dt)
            assert got.dtype == w.dtype and (raw(got) == raw(w)).all()
    got = I.orthogonal()(k, (6, 5))
    want = jax_ref("orthogonal", lambda jax: jax.nn.initializers.orthogonal()(
        jax.random.PRNGKey(4), (6, 5)))
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
