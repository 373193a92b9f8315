"""The numpy references' shared step for the convolution tests (test_conv_pool_norm,
test_conv_local): an input (N, S..., C) dilated and padded as a convolution reads it."""
import numpy as np


def grown(x, pads, lhs_dil):
    """``x`` in float64, dilated by ``lhs_dil`` (zeros between elements) along the spatial
    dimensions, then padded by ``pads`` ((low, high) per spatial dimension; negative crops)."""
    x = np.asarray(x, np.float64)
    for ax, d in enumerate(lhs_dil, start=1):
        if d > 1:
            shape = list(x.shape)
            shape[ax] = (shape[ax] - 1) * d + 1
            y = np.zeros(shape)
            idx = [slice(None)] * x.ndim
            idx[ax] = slice(None, None, d)
            y[tuple(idx)] = x
            x = y
    for ax, (lo, hi) in enumerate(pads, start=1):
        pw = [(0, 0)] * x.ndim
        pw[ax] = (max(lo, 0), max(hi, 0))
        x = np.pad(x, pw)
        idx = [slice(None)] * x.ndim
        idx[ax] = slice(-min(lo, 0), x.shape[ax] + min(hi, 0))
        x = x[tuple(idx)]
    return x
