"""Unary ops on bfloat16 / float16 Arrays run from a C plan as one kernel each (the typed
kernel: widened, the float32 formula, rounded back): the bits of the float32 op on the widened
values rounded back, with no Python below the public function; under value_and_grad the
C path records them too (the primitive's vjp16), with the cotangents of the Python path's
float32 policy."""
import sys

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn

OPS = {**{n: getattr(cnp, n) for n in ("sin", "cos", "tanh", "exp", "log", "sqrt", "negative",
                                        "abs", "square", "log1p", "expm1", "reciprocal", "sign",
                                        "floor", "ceil")},
       "relu": nn.relu, "gelu": nn.gelu, "sigmoid": nn.sigmoid}


@pytest.mark.parametrize("dtype", [cnp.bfloat16, cnp.float16])
def test_typed_unary_kernel_gives_the_float32_ops_bits_rounded(dtype):
    rng = np.random.default_rng(3)
    # 5003 elements: chunks of the CPU kernel and a partial last one; inf, nan, -0.0 included
    v = (rng.standard_normal(5003) * 4).astype(np.float32)
    v[:4] = [np.inf, -np.inf, np.nan, -0.0]
    for mesh in (None, cts.Mesh(np.array(cts.devices()[:4], dtype=object), ("x",))):
        x = cts.device_put(v[:5000] if mesh is not None else v,
                           None if mesh is None else cts.NamedSharding(mesh, cts.P("x"))).astype(dtype)
        for name, f in OPS.items():
            got, ref = f(x), f(x.astype(np.float32)).astype(dtype)
            assert got.dtype == dtype and got.sharding == x.sharding, name
            assert np.asarray(got).tobytes() == np.asarray(ref).tobytes(), (dtype, name)


def test_a_16_bit_unary_op_runs_from_c():
    x = cts.device_put(np.linspace(-2, 2, 16, dtype=np.float32)).astype(cnp.bfloat16)
    cnp.sin(x), cnp.exp(x)               # the plans, made once
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name)
                   if event == "call" else None)
    try:
        cnp.sin(x)
        cnp.exp(x)
    finally:
        sys.setprofile(None)
    assert calls == [], calls


def test_under_value_and_grad_they_record_the_float32_policys_cotangents():
    x = cts.device_put(np.linspace(-2, 2, 64, dtype=np.float32)).astype(cnp.bfloat16)
    falls = cnp.sin.cache_info()["fallbacks"]
    g = cts.grad(lambda v: cnp.sum(cnp.sin(v).astype(np.float32)))(x)
    assert cnp.sin.cache_info()["fallbacks"] == falls   # recorded by the C path (no Python op)
    # sin in float32, its cotangent cos(x) * 1 in float32, rounded to bfloat16
    want = np.cos(np.asarray(x).astype(np.float32)).astype(cnp.bfloat16)
    assert g.dtype == cnp.bfloat16 and np.asarray(g).tobytes() == want.tobytes()


def _python_path_grad(f, x):
    """grad(f)(x) recorded by the Python ops: inside an enclosing value_and_grad the C path
    declines (the tape is nested), and each 16-bit op runs the float32 policy (its operands
    converted to float32, the float32 op, the result converted back), recorded node by node."""
    box = {}

    def outer(y):
        box["g"] = cts.grad(f)(x)
        return cnp.sum(y)
    cts.grad(outer)(cts.device_put(np.float32(1.0)))
    return box["g"]


@pytest.mark.parametrize("dtype", [cnp.bfloat16, cnp.float16])
def test_16_bit_gradients_recorded_in_c_have_the_python_paths_bits(dtype):
    """Unary and binary ops on 16-bit Arrays recorded by the C path (one node each, the
    primitive's vjp16) give the cotangents the Python path's three nodes give, bit for bit:
    every unary primitive, and the binary ones with a broadcast operand, on one device and on a
    mesh."""
    rng = np.random.default_rng(8)
    ops = {**OPS, "add": None, "subtract": None, "multiply": None, "divide": None,
           "maximum": None, "minimum": None}
    for mesh in (None, cts.Mesh(np.array(cts.devices()[:4], dtype=object), ("x",))):
        put = (lambda a, *s: cts.device_put(a)) if mesh is None else \
            (lambda a, *s: cts.device_put(a, cts.NamedSharding(mesh, cts.P(*s))))
        x = put((rng.random((8, 16)) * 3 + 0.2).astype(np.float32), "x", None).astype(dtype)
        b = put((rng.standard_normal(16) + 2).astype(np.float32), None).astype(dtype)
        w = put(rng.standard_normal((8, 16)).astype(np.float32), "x", None)
        for name, f in ops.items():
            if f is None:
                op = getattr(cnp, name)
                fn = lambda v, bb, op=op: cnp.sum(op(v, bb).astype(np.float32) * w)  # noqa: E731
                got = cts.grad(fn, argnums=(0, 1))(x, b)
                want = _python_path_grad(lambda v, fn=fn: fn(v, b), x), \
                    _python_path_grad(lambda bb, fn=fn: fn(x, bb), b)
            else:
                fn = lambda v, f=f: cnp.sum(f(v * 1.5).astype(np.float32) * w)  # noqa: E731
                got, want = (cts.grad(fn)(x),), (_python_path_grad(fn, x),)
            for gv, wv in zip(got, want):
                assert gv.dtype == wv.dtype == dtype, name
                assert np.asarray(gv).tobytes() == np.asarray(wv).tobytes(), (name, mesh)


def test_a_jitted_16_bit_unary_op_is_a_step_of_the_program():
    x = cts.device_put(np.linspace(-2, 2, 16, dtype=np.float32)).astype(cnp.bfloat16)
    f = cts.jit(lambda v: cnp.exp(cnp.sin(v)))
    for v in (x, x * 2):
        assert np.asarray(f(v)).tobytes() == np.asarray(cnp.exp(cnp.sin(v))).tobytes()
    text = f.lower(x).as_text()
    assert text.count("[unary16]") == 2 and "op node" not in text, text
    assert f._programs.traces == 1
