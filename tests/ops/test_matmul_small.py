"""The CPU kernels for small products (csrc/backend/cpu/cpu_ops.c, gemm_small).

A product whose op(B) fits a 16 KiB tile (n rounded up to 16, times k, at most 4096 floats;
fewer than 8 columns only with k <= 64) skips the BLAS: each element of C is the float32 sum
over k *in order*, every product and every partial sum rounded (no FMA), times alpha, plus
beta * C when beta is not 0.

The expected bits are derived here independently: numpy float32 arithmetic, one rank-1
update at a time (``acc = acc + outer(a[:, p], b[p, :])``), which is exactly that sum. Each
data set is first checked to tell summation orders apart (the in-order float32 sum differs
from the float64 sum rounded once), so a kernel that summed in another order, or fused the
multiply-adds, would fail these tests. Because an element's sum depends on nothing but its
own row and column, any split of the rows or columns over devices gives the same bits.
"""
import os

import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import NamedSharding, P, _C
from ctrainstate._src.ops import ops as _ops


def in_order(a, b, alpha=1.0, beta=0.0, c=None):
    """alpha * (sum over p in order of a[:, p] * b[p, :], float32 at every step) + beta * c."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for p in range(a.shape[1]):
        acc = acc + np.outer(a[:, p], b[p, :]).astype(np.float32)
    out = np.float32(alpha) * acc
    if beta != 0.0:
        out = out + np.float32(beta) * np.asarray(c, np.float32)
    return out


def data(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def orders_differ(a, b):
    """Whether the in-order float32 sum differs somewhere from the float64 sum rounded once."""
    exact = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    return not np.array_equal(in_order(a, b), exact)


def run(a, b, ta=False, tb=False, alpha=1.0, beta=0.0, c=None, prec=0):
    """op(a) @ op(b) through op_matmul on one device (a stored (k, m) when ta, b (n, k) when tb)."""
    m = a.shape[1] if ta else a.shape[0]
    k = a.shape[0] if ta else a.shape[1]
    n = b.shape[0] if tb else b.shape[1]
    _ops._ensure_blas()   # registered, as a matmul through ops does: these sizes skip it anyway
    A, B = cnp.asarray(a), cnp.asarray(b)
    out = cnp.asarray(np.zeros((m, n), np.float32) if c is None else c)
    _C.op_matmul(_ops._bufs(A), _ops._bufs(B), _ops._bufs(out), 1, m, n, k, 0, 0, int(ta), int(tb),
                 alpha, beta, prec)
    return np.asarray(out)


# (m, k, n): padding of n, rows not a multiple of 4, a single row or column, k = 1, the tile's
# edge (16 * 256 and 64 * 64 floats), a narrow B (fewer than 8 columns: the kernel that runs
# down 16 rows at once) with k <= 64 and rows not a multiple of 16, many rows (the parallel
# loop, both kernels)
SHAPES = [(64, 16, 16), (64, 2, 16), (63, 16, 3), (1, 7, 5), (5, 1, 33), (13, 256, 16),
          (9, 64, 64), (7, 64, 1), (64, 16, 17), (4096, 16, 16), (3000, 3, 256), (37, 36, 100),
          (100, 64, 7), (5000, 33, 2), (17, 5, 8)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_small_product_sums_in_order(m, k, n, ta, tb):
    a, b = data((m, k), m + k), data((k, n), n + 7)
    if k >= 3:
        assert orders_differ(a, b), "data that cannot tell summation orders apart"
    got = run(a.T.copy() if ta else a, b.T.copy() if tb else b, ta, tb)
    np.testing.assert_array_equal(got, in_order(a, b))


def test_alpha_and_beta():
    a, b, c = data((10, 12, ), 1), data((12, 20), 2), data((10, 20), 3)
    np.testing.assert_array_equal(run(a, b, alpha=0.5, beta=2.0, c=c), in_order(a, b, 0.5, 2.0, c))
    # beta 0 never reads C: NaN there does not leak into the product
    nan_c = np.full((10, 20), np.nan, np.float32)
    np.testing.assert_array_equal(run(a, b, alpha=-3.0, c=nan_c), in_order(a, b, -3.0))


def test_nonfinite_inputs_propagate_per_element():
    a, b = data((8, 5), 4), data((5, 9), 5)
    a[2, 3] = np.inf
    b[1, 4] = np.nan
    got = run(a, b)
    with np.errstate(invalid="ignore"):
        want = in_order(a, b)
    np.testing.assert_array_equal(got, want)   # NaN in the same places (assert_array_equal)
    assert np.isnan(got[:, 4]).all() and np.isinf(got[2, np.arange(9) != 4]).all()


def test_bfloat16_precision_rounds_the_operands():
    """prec 2 (bfloat16 inputs): the same in-order sum of the operands rounded to bfloat16
    (ml_dtypes' conversion: nearest, ties to even)."""
    a, b = data((33, 24), 6), data((24, 20), 7)
    rnd = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
    want = in_order(rnd(a), rnd(b))
    assert not np.array_equal(want, in_order(a, b))
    np.testing.assert_array_equal(run(a, b, prec=2), want)
    np.testing.assert_array_equal(run(a.T.copy(), b.T.copy(), True, True, prec=2), want)


def test_matmul_and_its_gradient_use_it():
    """cnp.matmul and value_and_grad's products (op(a)^T g, g op(b)^T) give the in-order bits."""
    x, w = data((64, 16), 8), data((16, 12), 9)
    np.testing.assert_array_equal(np.asarray(cnp.matmul(x, w)), in_order(x, w))
    g = np.ones((64, 12), np.float32)
    _, (gx, gw) = cts.value_and_grad(lambda x, w: cnp.sum(cnp.matmul(x, w)), argnums=(0, 1))(
        cnp.asarray(x), cnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(gw), in_order(x.T, g))
    np.testing.assert_array_equal(np.asarray(gx), in_order(g, w.T))


@pytest.mark.parametrize("spec", [P("data", None), P(None, "model"), P("data", "model")])
def test_sharded_rows_or_columns_give_the_same_bits(spec):
    """Rows over "data" and columns over "model" (each shard's product is small too): the
    bits of the one-device product, which are the in-order sums."""
    mesh = cts.Mesh(np.array(cts.devices()[:8], dtype=object).reshape(2, 4), ("data", "model"))
    x, w = data((64, 16), 10), data((16, 32), 11)
    xs = cts.device_put(x, NamedSharding(mesh, P(spec[0], None)))
    ws = cts.device_put(w, NamedSharding(mesh, P(None, spec[1])))
    out = cnp.matmul(xs, ws)
    np.testing.assert_array_equal(np.asarray(out), in_order(x, w))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(cnp.matmul(x, w)))


def test_larger_products_still_take_the_blas_path():
    """Past the tile (k * 16 > 4096) the product is the BLAS's: within float32 accumulation
    error of the float64 product (its order is the library's)."""
    a, b = data((40, 300), 12), data((300, 16), 13)
    got = run(a, b)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = 300 * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(got - exact) <= bound)


def test_gemm_small_names_the_products_of_the_small_kernel():
    """``_C.gemm_small(n, k)``, the kernel's own test (op(B) k x n): every shape above, none
    past the tile or a narrow B with k > 64; bad sizes raise."""
    for _, k, n in SHAPES:
        assert _C.gemm_small(n, k), (n, k)
    for n, k in [(16, 300), (17, 256), (256, 256), (7, 65), (1, 65), (4097, 1), (16, 0)]:
        assert not _C.gemm_small(n, k), (n, k)
    with pytest.raises(ValueError, match="negative size"):
        _C.gemm_small(-1, 4)
    with pytest.raises(TypeError):
        _C.gemm_small(4)


_SCIPY_ONLY_WHEN_NEEDED = """
import sys
import numpy as np
import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C

def loss(w, x):
    return cnp.sum(cnp.tanh(x @ w) @ w.T)

x = cts.device_put(np.ones((64, 16), np.float32))
w = cts.device_put(np.full((16, 16), 0.1, np.float32))
for _ in range(2):   # a product, its gradient, and the C dispatch's plan hit
    v, g = cts.value_and_grad(loss)(w, x)
    float(v)
print("small", "scipy.linalg" in sys.modules, _C.has_blas())
big = cts.device_put(np.ones((64, 300), np.float32))
got = np.asarray(big @ cts.device_put(np.ones((300, 16), np.float32)))
assert (got == 300).all()
print("large", "scipy.linalg" in sys.modules, _C.has_blas())
"""


def test_small_products_do_not_load_the_blas(tmp_path):
    """A process whose products all fit the small kernel never imports scipy.linalg (a
    quarter of a second) or registers its sgemm; its first larger product does both, before
    it runs (the BLAS computes it)."""
    import subprocess
    import sys
    pytest.importorskip("scipy.linalg")
    env = dict(os.environ, CTRAINSTATE_NUM_CPU_DEVICES="1")
    env.pop("CTRAINSTATE_NO_BLAS", None)
    r = subprocess.run([sys.executable, "-c", _SCIPY_ONLY_WHEN_NEEDED], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["small False False", "large True True"], r.stdout
