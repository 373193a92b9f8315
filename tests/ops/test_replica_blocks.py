"""Blocks that hold the same slice on several CPU devices (replicas) are computed once and
copied (plan_entry.rep_of, csrc/python/py_dispatch.c): every block of the result must be the
one-device result's slice, bit for bit, for each kind of plan that copies (elementwise,
scalar, broadcasting binary, reductions within a block, matmul without an all-reduce), and
plans with all-reduce groups (partial sums on the replicas) must still add them."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp


def _mesh():
    return cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))


def _check_blocks(out, ref, exact=True):
    """Each block is its slice of ref (bit for bit, or close where a kernel's blocking
    depends on the block's size: a matmul), and the replicas of a slice are equal."""
    ref = np.asarray(ref)
    first = {}
    for shard in out.addressable_shards:
        got = np.asarray(shard.data)
        want = np.ascontiguousarray(ref[shard.index])
        if exact:
            assert got.tobytes() == want.tobytes(), shard.device
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        key = str(shard.index)
        assert got.tobytes() == first.setdefault(key, got.tobytes()), shard.device


@pytest.mark.parametrize("op", ["sin", "scalar", "bias", "binary", "sum_rows", "matmul", "rowpar"])
def test_every_replica_block_is_the_one_device_result(op):
    mesh = _mesh()
    rng = np.random.default_rng(3)
    xh = rng.standard_normal((16, 8)).astype(np.float32)
    bh = rng.standard_normal((8,)).astype(np.float32)
    wh = rng.standard_normal((8, 12)).astype(np.float32)
    put = lambda a, *spec: cts.device_put(a, cts.NamedSharding(mesh, cts.P(*spec)))
    x, b = put(xh, "x", None), put(bh, None)          # replicated over y: 4 replicas a block
    w = put(wh, None, None)
    x1, b1, w1 = cts.device_put(xh), cts.device_put(bh), cts.device_put(wh)
    f = {"sin": lambda x, b, w: cnp.sin(x),
         "scalar": lambda x, b, w: x * 3.0 + 1.0,
         "bias": lambda x, b, w: x + b,
         "binary": lambda x, b, w: x * cnp.cos(x),
         "sum_rows": lambda x, b, w: cnp.sum(x, axis=1),
         "matmul": lambda x, b, w: x @ w,
         "rowpar": None}[op]
    if op == "rowpar":   # K sharded over y: partial sums on the y devices, all-reduced
        xs, ws = put(xh, "x", "y"), put(wh, "y", None)
        out = xs @ ws
        ref = np.asarray(out)   # every block must be the same full sum
        for shard in out.addressable_shards:
            assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(ref[shard.index]).tobytes()
        np.testing.assert_allclose(ref, xh @ wh, rtol=1e-5, atol=1e-5)
        return
    out = f(x, b, w)
    assert len(out.addressable_shards) == 8
    exact = op != "matmul"   # (a 8-row block's GEMM may round as the 16-row one does not)
    _check_blocks(out, f(x1, b1, w1), exact)
    _check_blocks(cts.jit(f)(x, b, w), f(x1, b1, w1), exact)   # through a replayed program
