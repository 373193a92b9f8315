"""ctrainstate's dtype names (jnp.float32(x), jnp.bfloat16(x), ...) as jax.numpy's: checked against live
jax when it is importable and otherwise against a numpy computation."""

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp


def _mesh_sharding(spec):
    return cts.NamedSharding(cts.make_mesh((2, 4), ("data", "model")), cts.P(*spec))


def test_dtype_names_convert_arrays():
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    a = cts.device_put(x, _mesh_sharding((("data", "model"), None)))
    m = cnp.float32(a > 2)
    assert isinstance(m, cts.Array) and m.dtype == np.float32 and m.sharding == a.sharding
    np.testing.assert_array_equal(np.asarray(m), (x > 2).astype(np.float32))
    i = cnp.int32(a * 1.5)
    assert isinstance(i, cts.Array) and i.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(i), (x * 1.5).astype(np.int32))   # truncation
    assert cnp.bfloat16(a).dtype == cnp.bfloat16 and cnp.bool_(a).dtype == np.bool_
    # d/dv sum(float32(v) * 2) = 2 (through the conversion, as jax)
    g = cts.grad(lambda v: cnp.sum(cnp.bfloat16(v).astype(cnp.float32) * 2.0))(x)
    assert np.asarray(g).tolist() == np.full((8, 1), 2.0).tolist()
    assert float(cnp.float32(2.5)) == 2.5 and isinstance(cnp.float32(2.5), cts.Array)
    # still dtypes, equal to numpy's types
    assert np.dtype(cnp.bfloat16) == np.dtype("bfloat16") and cnp.float32 == np.float32
    assert np.zeros(2, cnp.float16).dtype == np.float16 and a.dtype == cnp.float32
    assert {np.int32: "i"}[cnp.int32] == "i" and isinstance(np.float32(1), cnp.float32)
    assert cnp.zeros(2, cnp.int32).dtype == np.int32 and a.astype(cnp.bfloat16).dtype == cnp.bfloat16


def test_dtype_names_parity():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    for name in ("float32", "float16", "bfloat16", "int32", "uint32", "bool_"):
        want, got = getattr(jnp, name)(x), getattr(cnp, name)(x)
        assert isinstance(got, cts.Array) and got.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want = jax.grad(lambda v: jnp.sum(jnp.float16(v) * 3.0).astype(jnp.float32))(x)
    got = cts.grad(lambda v: cnp.sum(cnp.float16(v) * 3.0).astype(cnp.float32))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
