"""ravel / outer / inner / vdot / tensordot and linalg.norm (_linalg.py, numpy.py): values against numpy
and jax (recorded in tests/data/recorded, live in each test's twin marked `parity`: `jax_ref`),
gradients against central finite differences, errors."""

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp


_RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _own_rng(twin_seed):
    """Each test draws its inputs from a stream of its own: the same in its recorded and live
    twins (jax's side is recorded for those inputs), whichever tests ran before."""
    global _RNG
    _RNG = np.random.default_rng(twin_seed)


def test_products_against_numpy_and_jax(jax_ref):
    a = _RNG.standard_normal((2, 3, 4)).astype(np.float32)
    b = _RNG.standard_normal((4, 3, 5)).astype(np.float32)
    b64 = b.astype(np.float64)
    cases = [
        (lambda m, p, q: m.ravel(p), (a, a)),
        (lambda m, p, q: m.outer(p[0], q[:, 0]), (a, b)),
        (lambda m, p, q: m.inner(p, p), (a, a)),
        (lambda m, p, q: m.inner(p, 2.0), (a, a)),
        (lambda m, p, q: m.vdot(p, p), (a, a)),
        (lambda m, p, q: m.tensordot(p, q, ([1, 2], [1, 0])), (a, b)),
        (lambda m, p, q: m.tensordot(p[0], q[:, 0], 1), (a, b)),
        (lambda m, p, q: m.tensordot(p[0, 0], q[0, 0], 0), (a, b)),
        (lambda m, p, q: m.tensordot(p, q, (2, 0)), (a, b)),
    ]
    for f, (p, q) in cases:
        got = np.asarray(f(cnp, p, q))
        want = f(np, p.astype(np.float64), q.astype(np.float64))
        assert got.shape == np.shape(want)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="contracted dimensions differ"):
        cnp.tensordot(a, b, ([0], [0]))
    with pytest.raises(ValueError, match="elements"):
        cnp.vdot(a, b)
    # gradients: tensordot's against numpy's formula
    g = np.asarray(cts.grad(lambda p: cnp.sum(cnp.tensordot(p, b, ([1, 2], [1, 0]))))(a))
    np.testing.assert_allclose(g, np.broadcast_to(b64.sum(axis=2).T, a.shape), rtol=1e-5, atol=1e-5)
    for i, (f, (p, q)) in enumerate(cases):
        np.testing.assert_allclose(np.asarray(f(cnp, p, q)), jax_ref(
            i, lambda jax: f(jax.numpy, p, q)), rtol=2e-6, atol=2e-6)


_NORMS = [(None, None), (2, 0), (1, 1), (np.inf, -1), (-np.inf, 0), (0, 1), (3, -1),
          (0.5, 0), ("fro", (0, 1)), (None, (1, 2)), (1, (0, 2)), (-1, (1, 0)),
          (np.inf, (0, 1)), (-np.inf, (2, 1))]


@pytest.mark.parametrize("ord_,axis", _NORMS, ids=str)
def test_linalg_norm(ord_, axis, jax_ref):
    x = _RNG.standard_normal((3, 4, 5)).astype(np.float32)
    x[0, 0, 0] = 0.0
    kw = {} if axis is None else {"axis": axis}
    want = np.linalg.norm(x.astype(np.float64), ord=ord_, **kw)
    got = cnp.linalg.norm(x, ord=ord_, **kw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-6)
    kd = cnp.linalg.norm(x, ord=ord_, keepdims=True, **kw)
    assert kd.shape == np.linalg.norm(x, ord=ord_, keepdims=True, **kw).shape
    g = np.asarray(cts.grad(lambda v: cnp.sum(cnp.linalg.norm(v, ord=ord_, **kw)))(x))
    np.testing.assert_allclose(np.asarray(got), jax_ref(
        "norm", lambda jax: jax.numpy.linalg.norm(x, ord=ord_, **kw)), rtol=3e-6)
    gj = jax_ref("grad", lambda jax: jax.grad(
        lambda v: jax.numpy.linalg.norm(v, ord=ord_, **kw).sum())(x))
    np.testing.assert_allclose(g, gj, rtol=2e-5, atol=1e-6)


def test_linalg_norm_errors_and_fd_gradient():
    x = _RNG.standard_normal((3, 4)).astype(np.float32)
    for o in ("nuc", 2, -2):
        with pytest.raises(NotImplementedError, match="singular values"):
            cnp.linalg.norm(x, ord=o)
    with pytest.raises(ValueError, match="improper number of axes"):
        cnp.linalg.norm(np.ones((2, 2, 2), np.float32), ord=1)
    with pytest.raises(ValueError, match="invalid order"):
        cnp.linalg.norm(x[0], ord="fro")
    with pytest.raises(ValueError, match="out of bounds"):
        cnp.linalg.norm(x, axis=3)
    g = np.asarray(cts.grad(lambda v: cnp.linalg.norm(v))(x))
    np.testing.assert_allclose(g, _fd_tree(lambda v: cnp.linalg.norm(v), x), rtol=1e-2, atol=1e-3)


def _fd_tree(f, x, h=1e-2):
    out = np.zeros(x.shape)
    for i in np.ndindex(x.shape):
        e = np.zeros(x.shape, np.float32)
        e[i] = h
        out[i] = (float(np.asarray(f(x + e))) - float(np.asarray(f(x - e)))) / (2 * h)
    return out
