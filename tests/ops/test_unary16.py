"""Unary ops on bfloat16 / float16 Arrays run from a C plan as one kernel each (the typed
kernel: widened, the float32 formula, rounded back): the bits of the float32 op on the widened
values rounded back, with no Python below the public function; under value_and_grad the
Python path records them as before."""
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


def test_under_value_and_grad_the_python_path_records_them():
    x = cts.device_put(np.linspace(-2, 2, 64, dtype=np.float32)).astype(cnp.bfloat16)
    g = cts.grad(lambda v: cnp.sum(cnp.sin(v).astype(np.float32)))(x)
    # the Python path: sin in float32, its cotangent cos(x) * 1 in float32, rounded to bfloat16
    want = np.cos(np.asarray(x).astype(np.float32)).astype(cnp.bfloat16)
    assert g.dtype == cnp.bfloat16 and np.asarray(g).tobytes() == want.tobytes()


def test_a_jitted_16_bit_unary_op_is_a_step_of_the_program():
    x = cts.device_put(np.linspace(-2, 2, 16, dtype=np.float32)).astype(cnp.bfloat16)
    f = cts.jit(lambda v: cnp.exp(cnp.sin(v)))
    for v in (x, x * 2):
        assert np.asarray(f(v)).tobytes() == np.asarray(cnp.exp(cnp.sin(v))).tobytes()
    text = f.lower(x).as_text()
    assert text.count("[unary16]") == 2 and "op node" not in text, text
    assert f._programs.traces == 1
