"""The CPU transcendental kernels (csrc/backend/cpu/cpu_vmath.h) give the bits of their formulas
whichever clone the loader picked (baseline SSE, AVX2 or AVX-512: cpu_ops.c's target_clones,
FP contraction off): each formula is evaluated here again, operation by operation, in numpy
float32 (IEEE, no fused multiply-add), and the results must be equal bit for bit. Also the
float32 bias correction of the optimizers (_C.f32_bias_correction) against numpy's float32
scalars."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C

f = np.float32


def _bits_to_f(u):
    return np.asarray(u, np.uint32).view(np.float32)


def _sincos(x, want_cos):
    with np.errstate(all="ignore"):
        magic = f(12582912.0)
        jf = (x * f(0.636619772367581343) + magic) - magic
        r = ((x - jf * f(1.5703125)) - jf * f(4.837512969970703125e-4)) - jf * f(7.549789954891882e-8)
        j = jf.astype(np.int32) + want_cos
        z = r * r
        s = ((f(-1.9515295891e-4) * z + f(8.3321608736e-3)) * z - f(1.6666654611e-1)) * z * r + r
        c = (((f(2.443315711809948e-5) * z - f(1.388731625493765e-3)) * z + f(4.166664568298827e-2))
             * z * z - f(0.5) * z + f(1.0))
        odd = (0 - (j.astype(np.uint32) & 1)).astype(np.uint32)
        sb, cb = s.view(np.uint32), c.view(np.uint32)
        bits = sb ^ ((sb ^ cb) & odd)
        bits ^= (j.astype(np.uint32) & 2) << 30
        out = _bits_to_f(bits)
        big = ~(np.abs(x) < f(8192.0))   # libm's full range reduction there
        out[big] = (np.cos if want_cos else np.sin)(x[big].astype(np.float64)).astype(np.float32)
    return out, big


def _exp_core(x):
    magic = f(12582912.0)
    n = (x * f(1.44269504088896341) + magic) - magic
    r = (x - n * f(0.693359375)) - n * f(-2.12194440e-4)
    z = r * r
    p = (((((f(1.9875691500e-4) * r + f(1.3981999507e-3)) * r + f(8.3334519073e-3)) * r
           + f(4.1665795894e-2)) * r + f(1.6666665459e-1)) * r + f(5.0000001201e-1))
    e = p * z + r + f(1.0)
    ni = n.astype(np.int32)
    n1 = ni >> 1
    n2 = ni - n1
    return e * _bits_to_f(((n1 + 127).astype(np.uint32) << 23)) * _bits_to_f(((n2 + 127).astype(np.uint32) << 23))


def _exp(x):
    with np.errstate(all="ignore"):
        hi, lo = f(88.7228317), f(-103.972084)
        xc = np.where(x < lo, lo, np.where(x > hi, hi, x))
        out = _exp_core(xc)
        out = np.where(x > hi, f(np.inf), out)
        out = np.where(x < lo, f(0.0), out)
        return np.where(x != x, x, out)


def _tanh(x):
    with np.errstate(all="ignore"):
        ax = np.abs(x)
        z = x * x
        small = (((((f(-5.70498872745e-3) * z + f(2.06390887954e-2)) * z - f(5.37397155531e-2)) * z
                   + f(1.33314422036e-1)) * z - f(3.33332819422e-1)) * z * x + x)
        e = _exp_core(f(2.0) * np.where(ax < f(10.0), ax, f(10.0)))
        big = f(1.0) - f(2.0) / (e + f(1.0))
        big = np.where(x < f(0.0), -big, big)
        out = np.where(ax < f(0.625), np.copysign(small, x), big)
        return np.where(x != x, x, out)


def _inputs():
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal(1 << 18).astype(np.float32) * s for s in (0.5, 3.0, 40.0, 3000.0)]
    parts.append(np.float32([0.0, -0.0, 1e-40, -1e-40, 8191.9, -8191.9, 88.0, 89.0, -103.0,
                             -104.0, 0.625, -0.625, 9.99, 10.01, 1e30, -1e30]))
    return np.concatenate(parts)


@pytest.mark.parametrize("name", ["sin", "cos", "exp", "tanh"])
def test_the_kernels_give_their_formulas_bits(name):
    x = _inputs()
    got = np.asarray(getattr(cnp, name)(cts.device_put(x)))
    if name in ("sin", "cos"):
        want, libm = _sincos(x, name == "cos")
        keep = ~libm   # (libm's own rounding where the kernel defers to it: compared loosely)
        np.testing.assert_allclose(got[libm], want[libm], rtol=1e-6, atol=1e-6)
        assert got[keep].tobytes() == want[keep].tobytes()
    else:
        want = (_exp if name == "exp" else _tanh)(x)
        assert got.tobytes() == want.tobytes()


def test_the_kernels_give_the_same_bits_across_threads_and_block_tails():
    # above the parallel threshold, and an odd length: the blocks' tails
    x = _inputs()[: (1 << 18) + 37]
    a = cts.device_put(x)
    want, _ = _sincos(x, False)
    assert np.asarray(cnp.sin(a)).tobytes() == want.tobytes()


def test_f32_bias_correction_is_numpys_float32():
    for d in (0.9, 0.999, 0.95, 0.5, 0.0, 1.0, 0.123456789):
        for t in list(range(0, 300)) + [10 ** 5, 10 ** 7, 2 ** 31 - 1]:
            want = f(1) - f(d) ** f(t)
            assert f(_C.f32_bias_correction(d, t)).tobytes() == want.tobytes(), (d, t)
    with pytest.raises(TypeError):
        _C.f32_bias_correction("0.9", 1)
