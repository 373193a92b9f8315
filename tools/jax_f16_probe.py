"""Which float16 roundings does the installed jax's truncated_normal make?

    JAX_PLATFORMS=cpu python tools/jax_f16_probe.py

Why: on the GPU image (jax 0.11.2) ctrainstate's float16 truncated_normal (and so the
float16 variance-scaling initializers) differ in rare elements from the live jax on its CPU,
by one float16 ulp, while every recorded jax 0.10.2 vector (which CI checks) and every
float32 / bfloat16 value and float16 `normal` still match. jax's truncated_normal computes
the bounds a = erf(lower / sqrt2), b = erf(upper / sqrt2) in the dtype, then draws
u = max(a, f * (b - a) + a) for the unit float f, then returns sqrt2 * erf_inv(u), clipped.
In float16 it matters where XLA rounds: ctrainstate follows jax 0.10.2 (the division
rewritten as x * rnd16(1/sqrt2) and rounded before erf; each product and sum of the uniform
rounded to float16: "B0" and "U0" below).

This script evaluates every combination of the bound and uniform roundings listed below
with numpy float32 arithmetic and jax's own float32 erf / erf_inv, on the random bits
ctrainstate and jax share, and prints how many elements of the installed jax's float16
truncated_normal each combination reproduces (with jax 0.10.2: B0 + U0, all of them). It
changes nothing; `benchmarks/gpu_check.sh` runs it on the GPU image, so the next run says
which roundings jax 0.11.2 makes.

Answered on 2026-12-01 (stop 22) on a Sapphire Rapids VM with AVX512-FP16, jax 0.10.2: the
probe printed "best: B0 + U1" there (the float16 multiply and add of the uniform fused into
one rounding: XLA emits float16 instructions on such a CPU and LLVM contracts them into an
FMA), and "best: B0 + U0", ctrainstate's, with XLA_FLAGS=--xla_cpu_max_isa=AVX2. So the
difference comes from the host CPU, not the jax version; the parity tests cap XLA at AVX2 on
such hosts (tests/conftest.py). The first line below says whether this host has the feature.
"""
import sys

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except Exception as e:  # pragma: no cover - diagnostic script
    print(f"jax not importable ({e}): nothing to probe")
    sys.exit(0)

import ctrainstate.random as R

F16, F32 = np.float16, np.float32


def rnd16(x):
    return np.asarray(x, F32).astype(F16).astype(F32)


def unit16(bits):
    """jax's float16 unit float in [0, 1): the low 16 bits' top 10 under exponent 0."""
    h = ((bits & 0xFFFF) >> 6 | 0x3C00).astype(np.uint16)
    return h.view(F16).astype(F32) - F32(1.0)


def main():
    print(f"jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}, "
          f"backend {jax.default_backend()}")
    try:
        with open("/proc/cpuinfo") as fh:
            fp16 = any(ln.startswith("flags") and "avx512_fp16" in ln.split() for ln in fh)
    except OSError:
        fp16 = None
    import os
    print(f"host CPU has AVX512-FP16: {fp16}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    erf = jax.jit(lambda v: jax.lax.erf(v))
    erf_inv = jax.jit(lambda v: jax.lax.erf_inv(v))
    sqrt2 = rnd16(np.sqrt(2.0))
    rsqrt2 = rnd16(np.float32(0.707106769))

    @jax.jit
    def jax_bounds(lo, hi):   # truncated_normal's own lines, in one jitted computation
        s2 = np.array(np.sqrt(2), F16)
        lo, hi = jax.lax.convert_element_type(lo, F16), jax.lax.convert_element_type(hi, F16)
        return jax.lax.erf(lo / s2), jax.lax.erf(hi / s2)

    def erf16(v):
        return rnd16(np.asarray(erf(np.asarray(v, F32)), F32))
    # a = erf(lower / sqrt2) in float16: how the division and the erf are rounded
    bounds = {
        "B0 x*rnd16(1/sqrt2), rounded (ctrainstate)": lambda l: erf16(rnd16(l * rsqrt2)),
        "B1 x/rnd16(sqrt2), rounded": lambda l: erf16(rnd16(l / sqrt2)),
        "B2 x*rnd16(1/sqrt2), float32 into erf": lambda l: erf16(l * rsqrt2),
        "B3 x/rnd16(sqrt2), float32 into erf": lambda l: erf16(l / sqrt2),
    }
    # u = max(a, f * (b - a) + a) in float16: where the float16 roundings happen
    unis = {
        "U0 per op (ctrainstate)": lambda f, rg, a: rnd16(rnd16(f * rg) + a),
        "U1 float32 between": lambda f, rg, a: rnd16(f * rg + a),
        "U2 exact, one rounding": lambda f, rg, a: (f.astype(np.float64) * rg + a).astype(F16).astype(F32),
    }
    rng = np.random.default_rng(7)
    totals, jb_same = {}, 0
    n, trials = 1 << 16, 8
    for trial in range(trials):
        seed = int(rng.integers(0, 2 ** 31))
        lo, hi = sorted(rng.uniform(-3, 3, 2).tolist())
        key = jax.random.PRNGKey(seed)
        want = np.asarray(jax.random.truncated_normal(key, lo, hi, (n,), jnp.float16))
        ours = np.asarray(R.truncated_normal(np.asarray(key), lo, hi, (n,), F16))
        f = unit16(np.asarray(R.bits(np.asarray(key), (n,))))
        lo16, hi16 = rnd16(lo), rnd16(hi)
        ja, jb = (rnd16(np.asarray(v, F32)) for v in jax_bounds(lo, hi))
        lo_c = np.nextafter(F16(lo16), F16(np.inf)).astype(F32)
        hi_c = np.nextafter(F16(hi16), F16(-np.inf)).astype(F32)
        for bname, bfn in bounds.items():
            a, b = bfn(lo16), bfn(hi16)
            jb_same += bname.startswith("B0") and a == ja and b == jb
            rg = rnd16(b - a)
            for uname, ufn in unis.items():
                u = np.maximum(ufn(f, rg, a), a)
                x = rnd16(sqrt2 * rnd16(np.asarray(erf_inv(u.astype(F32)), F32)))
                x = np.minimum(np.maximum(x, lo_c), hi_c).astype(F16)
                same = int((x.view(np.uint16) == want.view(np.uint16)).sum())
                totals[(bname, uname)] = totals.get((bname, uname), 0) + same
        same_ours = int((ours.view(np.uint16) == want.view(np.uint16)).sum())
        totals[("ctrainstate.random", "")] = totals.get(("ctrainstate.random", ""), 0) + same_ours
        print(f"trial {trial}: lower {lo:+.4f} upper {hi:+.4f}: ctrainstate matches "
              f"{same_ours}/{n}; jax's jitted bounds (a, b) = ({ja:.6g}, {jb:.6g})")
    print(f"\njax's jitted float16 bounds equal B0's in {jb_same} of {trials} trials")
    print(f"elements of jax's float16 truncated_normal matched, of {trials * n}:")
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    for (bname, uname), same in ranked:
        print(f"  {bname:44s} {uname:26s} {same}")
    (bname, uname), same = next(kv for kv in ranked if kv[0][1])
    print(f"best: {bname.split()[0]} + {uname.split()[0]}, {same}/{trials * n} elements; "
          f"ctrainstate {totals[('ctrainstate.random', '')]}")


if __name__ == "__main__":
    main()
