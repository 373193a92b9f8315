"""Float32 ulp checks shared by the float function tests (tests/ops, tests/nn)."""
import numpy as np


def ord_f32(a):
    """Each float32 as an integer on one ordered line (adjacent floats differ by 1; +0.0 and
    -0.0 are both 0)."""
    i = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def assert_ulps(got, want, n, what=""):
    """``got`` within ``n`` ulps of ``want`` (float32) elementwise; NaN where ``want`` is NaN;
    +0.0 and -0.0 count as equal."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), (what, got[np.isnan(got) != nan])
    d = np.abs(ord_f32(got[~nan]) - ord_f32(want[~nan]))
    if d.size:
        i = int(np.argmax(d))
        assert d[i] <= n, (what, f"{d[i]} ulps at x-index {i}: got {got[~nan][i]!r}, "
                                 f"want {want[~nan][i]!r}")
