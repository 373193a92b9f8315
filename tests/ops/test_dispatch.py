"""The C dispatch of the common ops (_C.Primitive, csrc/python/py_dispatch.c): a call of a
planned kind runs without Python and gives the Python op's result bit for bit; everything
else runs the Python op."""
import math
import os
import re
import sys
import threading

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C
from ctrainstate._src.ops import ops as _ops
from conftest import run_python

UNARY = sorted(_ops._UNARY_PRIMS)
BINARY = sorted(_ops._BINARY_PRIMS)


def _mesh_sharding(spec):
    mesh = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))
    return cts.NamedSharding(mesh, cts.P(*spec))


def _bits(x):
    h = np.asarray(x)
    return h.tobytes(), h.dtype, h.shape


def _values(rng, shape, dtype=np.float32):
    v = rng.standard_normal(shape).astype(np.float32) * 3
    flat = v.reshape(-1)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.5, -2.5]
    flat[:min(len(specials), flat.size)] = specials[:flat.size]
    return v.astype(dtype) if np.dtype(dtype).kind == "f" else (v * 10).astype(dtype)


def _same(fast, slow):
    assert type(fast) is cts.Array and type(slow) is cts.Array
    assert _bits(fast) == _bits(slow)
    assert fast.sharding == slow.sharding and fast.shape == slow.shape
    assert [b[0] for b in fast._blocks] == [b[0] for b in slow._blocks]


def _run_fast(prim, *args):
    """prim(*args) twice (the first may plan); asserts the second ran from the C plan."""
    prim(*args)
    before = prim.cache_info()
    out = prim(*args)
    after = prim.cache_info()
    assert after["hits"] == before["hits"] + 1 and after["fallbacks"] == before["fallbacks"], (
        prim.__name__, before, after)
    return out


def _placements():
    yield "one device", None
    yield "2x4 mesh", _mesh_sharding(("x", "y"))


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_unary_c_path_equals_python_op(name, where):
    rng = np.random.default_rng(0)
    sh = dict(_placements())[where]
    x = cts.device_put(_values(rng, (8, 16)), sh)
    prim = getattr(_ops, name)
    assert isinstance(prim, _C.Primitive) and getattr(cnp, name, prim) is prim
    _same(_run_fast(prim, x), prim.__wrapped__(x))


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("case", ["same", "broadcast", "mesh", "mesh_broadcast"])
def test_binary_c_path_equals_python_op(name, case):
    rng = np.random.default_rng(1)
    if case == "same":
        a = cts.device_put(_values(rng, (4, 16)))
        b = cts.device_put(_values(rng, (4, 16)))
    elif case == "broadcast":
        a = cts.device_put(_values(rng, (4, 16)))
        b = cts.device_put(_values(rng, (16,)))
    elif case == "mesh":
        a = cts.device_put(_values(rng, (8, 16)), _mesh_sharding(("x", "y")))
        b = cts.device_put(_values(rng, (8, 16)), _mesh_sharding(("x", "y")))
    else:
        a = cts.device_put(_values(rng, (8, 16)), _mesh_sharding(("x", "y")))
        b = cts.device_put(_values(rng, (1, 16)), _mesh_sharding((None, "y")))
    prim = getattr(_ops, name)
    _same(_run_fast(prim, a, b), prim.__wrapped__(a, b))
    _same(_run_fast(prim, b, a), prim.__wrapped__(b, a))


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "maximum", "minimum"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32"])
def test_typed_binary_c_path_equals_python_op(name, dtype):
    rng = np.random.default_rng(2)
    dt = cnp.dtype(dtype) if hasattr(cnp, "dtype") else np.dtype(dtype)
    for sh in (None, _mesh_sharding(("x", "y"))):
        a = cnp.astype(cts.device_put(_values(rng, (8, 16)), sh), dt)
        b = cnp.astype(cts.device_put(_values(rng, (8, 16)), sh), dt)
        prim = getattr(_ops, name)
        fast = _run_fast(prim, a, b)
        assert fast.dtype == a.dtype
        _same(fast, prim.__wrapped__(a, b))


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "divide"])
@pytest.mark.parametrize("s", [2.5, -3, 1e-3, 7, 0.1, 1e30])
def test_scalar_operands_c_path_equals_python_op(name, s):
    rng = np.random.default_rng(3)
    x = cts.device_put(_values(rng, (4, 16)))
    prim = getattr(_ops, name)
    _same(_run_fast(prim, x, s), prim.__wrapped__(x, s))
    _same(_run_fast(prim, s, x), prim.__wrapped__(s, x))


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "maximum", "minimum"])
def test_int32_and_python_int_c_path_equals_python_op(name):
    """An int32 Array and a Python int, on either side, on one device and a 2x4 mesh: from
    the C plan (the typed kernel, the int converted at each call), int32 and the Python op's
    bits (wrapping at int32's ends, as jax); a float, or an int beyond int32, beside the same
    plan runs the Python op (jax's float32 promotion; its OverflowError)."""
    vals = np.array([[-2 ** 31, -7, -1, 0, 1, 5, 2 ** 31 - 1, 12345]] * 2, np.int32)
    prim = getattr(_ops, name)
    ref = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
           "maximum": np.maximum, "minimum": np.minimum}[name]
    for sh in (None, _mesh_sharding(("x", "y"))):
        x = cts.device_put(vals, sh)
        for s in (0, 3, -2, 2 ** 31 - 1, -2 ** 31):
            for args, want in (((x, s), (vals, np.int32(s))), ((s, x), (np.int32(s), vals))):
                fast = _run_fast(prim, *args)
                assert fast.dtype == np.int32 and fast.sharding == x.sharding
                _same(fast, prim.__wrapped__(*args))
                with np.errstate(over="ignore"):
                    np.testing.assert_array_equal(np.asarray(fast), ref(*want), err_msg=repr(s))
        before = prim.cache_info()
        out = prim(x, 1.5)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(out), ref(vals.astype(np.float32), np.float32(1.5)))
        assert prim.cache_info()["fallbacks"] == before["fallbacks"] + 1
        with pytest.raises(OverflowError):
            prim(x, 2 ** 31)


@pytest.mark.parametrize("case", [("multiply", 0.0), ("multiply", -0.0), ("divide", math.inf),
                                  ("divide", 0.0), ("divide", -0.0)])
def test_value_dependent_scalars_take_the_python_op(case):
    """x * 0.0 keeps NaN / inf * 0 = NaN (the multiply kernel, not a fill), x / inf is
    x * 0: the Python op's own path; x / 0.0 is x * inf (the C path)."""
    name, s = case
    x = cts.device_put(np.float32([1.0, np.inf, np.nan, -2.0, 0.0]))
    prim = getattr(_ops, name)
    out = prim(x, s)
    with np.errstate(all="ignore"):
        want = (np.float32([1.0, np.inf, np.nan, -2.0, 0.0]) * np.float32(s) if name == "multiply"
                else np.float32([1.0, np.inf, np.nan, -2.0, 0.0]) / np.float32(s))
    np.testing.assert_array_equal(np.asarray(out), want)
    assert np.signbit(np.asarray(out)).tolist() == np.signbit(want).tolist()


def test_huge_int_scalar_raises_as_the_python_op():
    x = cts.device_put(np.float32([1.0]))
    with pytest.raises(OverflowError):
        _ops.add.__wrapped__(x, 10 ** 400)
    with pytest.raises(OverflowError):
        x + 10 ** 400


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_sum_c_path_equals_python_op(where):
    rng = np.random.default_rng(4)
    sh = dict(_placements())[where]
    x = cts.device_put(rng.standard_normal((8, 16)).astype(np.float32), sh)
    for prim in (_ops.sum, cnp.sum):
        fast = _run_fast(prim, x)
        _same(fast, prim.__wrapped__(x))
        assert fast.shape == ()
        np.testing.assert_allclose(float(fast), float(np.asarray(x, np.float64).sum()), rtol=1e-5)
    s0 = cts.device_put(np.float32(2.5))
    _same(_run_fast(cnp.sum, s0), cnp.sum.__wrapped__(s0))


@pytest.mark.parametrize("case", ["one device", "batched a", "mesh: rows and columns",
                                  "mesh: K sharded (all-reduce)", "mesh: data x model"])
def test_matmul_c_path_equals_python_op(case):
    rng = np.random.default_rng(6)
    if case == "one device":
        a, b = rng.standard_normal((8, 16)), rng.standard_normal((16, 4))
        sa = sb = None
    elif case == "batched a":
        a, b = rng.standard_normal((2, 8, 16)), rng.standard_normal((16, 4))
        sa = sb = None
    elif case == "mesh: rows and columns":
        a, b = rng.standard_normal((8, 16)), rng.standard_normal((16, 8))
        sa, sb = _mesh_sharding(("x", None)), _mesh_sharding((None, "y"))
    elif case == "mesh: K sharded (all-reduce)":
        a, b = rng.standard_normal((8, 16)), rng.standard_normal((16, 8))
        sa, sb = _mesh_sharding((None, "y")), _mesh_sharding(("y", None))
    else:
        a, b = rng.standard_normal((8, 16)), rng.standard_normal((16, 8))
        sa, sb = _mesh_sharding(("x", "y")), _mesh_sharding(("y", None))
    a = cts.device_put(a.astype(np.float32), sa)
    b = cts.device_put(b.astype(np.float32), sb)
    prim = _ops.matmul
    fast = _run_fast(prim, a, b)
    _same(fast, prim.__wrapped__(a, b))
    _same(_run_fast(prim, a, b), a @ b)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(a) @ np.asarray(b), rtol=2e-5,
                               atol=1e-5)


@pytest.mark.parametrize("t", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("mesh", [False, True])
def test_transposed_gradient_products_c_path_equals_python_op(t, mesh):
    """The products of matmul's gradients (op(a) @ op(b), stored operands transposed in the
    GEMM) run from C plans with the bits of _matmul."""
    ta, tb = t
    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 8) if ta else (8, 16)).astype(np.float32)
    b = rng.standard_normal((4, 16) if tb else (16, 4)).astype(np.float32)
    if mesh:
        a = cts.device_put(a, _mesh_sharding(("y", "x") if ta else ("x", "y")))
        b = cts.device_put(b, _mesh_sharding((None, "y") if tb else ("y", None)))
    else:
        a, b = cts.device_put(a), cts.device_put(b)
    prim = _ops._MM_T[ta, tb]
    fast = _run_fast(prim, a, b)
    _same(fast, prim.__wrapped__(a, b))
    want = (np.asarray(a).T if ta else np.asarray(a)) @ (np.asarray(b).T if tb else np.asarray(b))
    np.testing.assert_allclose(np.asarray(fast), want, rtol=2e-5, atol=1e-5)


def test_matmul_precision_decides_per_call():
    """The C path runs float32 products only: precision=None is accepted as a keyword; a
    default_matmul_precision block or another precision= takes the Python op (TF32's
    rounding), on the same cached plan."""
    x = cts.device_put(np.array([[1 + 2.0 ** -12, 1.0]], np.float32))
    eye = cts.device_put(np.eye(2, dtype=np.float32))
    exact = _run_fast(cnp.matmul, x, eye)
    assert np.asarray(exact).tolist() == [[1 + 2.0 ** -12, 1.0]]
    before = cnp.matmul.cache_info()
    assert (cnp.matmul(x, eye, precision=None)).tolist() == exact.tolist()
    assert cnp.matmul.cache_info()["hits"] == before["hits"] + 1
    with cts.default_matmul_precision("tensorfloat32"):
        assert (x @ eye).tolist() == [[1.0, 1.0]]
    assert cnp.matmul(x, eye, precision="tensorfloat32").tolist() == [[1.0, 1.0]]
    assert cnp.matmul.cache_info()["fallbacks"] == before["fallbacks"] + 2
    assert (x @ eye).tolist() == exact.tolist()


@pytest.mark.parametrize("axis", [0, 1, -1, (0,), (0, 1), (), None])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
@pytest.mark.parametrize("name", ["sum", "max"])
def test_reductions_over_axes_c_path_equals_python_op(name, axis, where):
    """sum's and max's axis and keepdims are static arguments of their plans (positional or
    keyword): the C plan gives the Python op's bits, shape and sharding, keepdims=True too
    (the reduced dims kept as size-1 unsharded ones); sum's dtype= and where= take the
    Python op."""
    rng = np.random.default_rng(8)
    sh = dict(_placements())[where]
    x = cts.device_put(_values(rng, (8, 16)), sh)
    ref = getattr(np, name)
    prims = (_ops.sum, cnp.sum) if name == "sum" else (_ops.max,)
    for prim in prims:
        assert isinstance(prim, _C.Primitive)
        _same(_run_fast(prim, x, axis), prim.__wrapped__(x, axis))
        prim(x, axis=axis)
        before = prim.cache_info()
        fast = prim(x, axis=axis)
        assert prim.cache_info()["hits"] == before["hits"] + 1
        _same(fast, prim.__wrapped__(x, axis=axis))
        for keep in (True, False):
            prim(x, axis=axis, keepdims=keep)
            before = prim.cache_info()
            kw = prim(x, axis=axis, keepdims=keep)
            assert prim.cache_info()["hits"] == before["hits"] + 1
            _same(kw, prim.__wrapped__(x, axis=axis, keepdims=keep))
            if prim is _ops.sum or prim is _ops.max:      # (cnp.sum's third is dtype)
                _same(_run_fast(prim, x, axis, keep), kw)
            with np.errstate(invalid="ignore"):
                want = ref(np.asarray(x), axis=axis, keepdims=keep)
            np.testing.assert_allclose(np.asarray(kw), want, rtol=1e-5, atol=1e-5)
            assert kw.shape == want.shape
        before = prim.cache_info()["fallbacks"]
        prim(x, axis=axis, keepdims=1)        # not a bool: the Python op (truthiness)
        assert prim.cache_info()["fallbacks"] == before + 1
    if name == "sum":
        before = cnp.sum.cache_info()["fallbacks"]
        cnp.sum(x, axis=axis, where=np.ones((8, 16), bool))
        cnp.sum(x, axis, np.float32)
        assert cnp.sum.cache_info()["fallbacks"] == before + 2
    with pytest.raises(ValueError):
        prims[0](x, axis=5)


def test_max_of_an_empty_dimension_raises_as_the_python_op():
    x = cts.device_put(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="zero-size"):
        _ops.max(x, axis=0, keepdims=True)
    np.testing.assert_array_equal(np.asarray(_ops.max(x, axis=1)), np.zeros((0,), np.float32))


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_max_gradient_on_the_c_path_splits_among_ties_as_the_python_op(keepdims, where):
    """max's C path records its own tape rule: the gradient of the Python op's (the maximum's
    cotangent split equally among the elements equal to it), bit for bit."""
    sh = dict(_placements())[where]
    v = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) % 5
    x = cts.device_put(v, sh)
    w = cts.device_put(np.linspace(-1, 1, 8, dtype=np.float32).reshape(8, 1), sh and
                       _mesh_sharding(("x", None)))

    def loss(f):
        return lambda x: cnp.sum(cnp.reshape(f(x, 1, keepdims), (8, 1)) * w)
    vf, gf = cts.value_and_grad(loss(_ops.max))(x)
    vs, gs = cts.value_and_grad(loss(_ops.max.__wrapped__))(x)
    assert float(vf) == float(vs)
    _same(gf, gs)
    # each row's maximum (4) appears 3 or 4 times: its cotangent w[i] split among them
    hits = (v == v.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(gf), hits / hits.sum(axis=1, keepdims=True) *
                               np.asarray(w), rtol=1e-6)


def test_static_arguments_are_keyed_by_type_and_value():
    x = cts.device_put(np.ones((2, 3), np.float32))
    _ops.sum.cache_clear()
    _ops.sum(x, 0), _ops.sum(x, (0,)), _ops.sum(x, axis=0), _ops.sum(x, 1)
    info = _ops.sum.cache_info()
    assert info["misses"] == 3 and info["hits"] == 1      # 0 and (0,) are two keys
    before = _ops.sum.cache_info()
    got = _ops.sum(x, [0])                  # a list of ints: keyed as its tuple (a plan hit)
    after = _ops.sum.cache_info()
    assert after["hits"] == before["hits"] + 1 and after["fallbacks"] == before["fallbacks"]
    _same(got, _ops.sum.__wrapped__(x, [0]))
    _same(_ops.reshape(x, [3, 2]), _ops.reshape.__wrapped__(x, (3, 2)))
    before = _ops.sum.cache_info()["fallbacks"]
    with pytest.raises(TypeError, match="axis entries must be ints"):
        _ops.sum(x, [0.0])                  # a list that is not of ints: the Python op's
    assert _ops.sum.cache_info()["fallbacks"] == before + 1
    with pytest.raises(ValueError):
        _ops.sum(x, [0, 0])                 # (planned as (0, 0): the op's error, as before)
    with pytest.raises(TypeError):
        _ops.sum(x, 0, axis=0)                             # given twice: the op's error
    with pytest.raises(ValueError, match="statics"):
        _C.Primitive("p", 1, print, print, None, None, (), ("a",), ())
    with pytest.raises(TypeError, match="statics"):
        _C.Primitive("p", 1, print, print, None, None, (), ("a",), ([0],))


def _python_calls(f):
    calls = []

    def prof(frame, event, arg):
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
    f()
    sys.setprofile(prof)
    try:
        f()
    finally:
        sys.setprofile(None)
    return [c for c in calls if "test_dispatch.py" not in c]


def test_no_python_runs_below_the_public_function_on_a_plan_hit():
    a = cts.device_put(np.ones((4, 16), np.float32))
    b = cts.device_put(np.ones((16,), np.float32))
    ab, bb = cnp.astype(a, cnp.bfloat16), cnp.astype(a, cnp.bfloat16)
    ai, bi = cnp.astype(a, np.int32), cnp.astype(a, np.int32)
    am = cts.device_put(np.ones((8, 16), np.float32), _mesh_sharding(("x", "y")))
    w = cts.device_put(np.ones((16, 4), np.float32))
    wm = cts.device_put(np.ones((16, 8), np.float32), _mesh_sharding(("y", None)))
    cases = {"a + b": lambda: a + b, "sin(a)": lambda: cnp.sin(a), "sum(a)": lambda: cnp.sum(a),
             "bf16 add": lambda: ab + bb, "int32 add": lambda: ai + bi,
             "mesh mul": lambda: am * am, "mesh sum": lambda: cnp.sum(am),
             "2.0 * a": lambda: 2.0 * a, "1 - a": lambda: 1 - a, "-a": lambda: -a,
             "maximum": lambda: cnp.maximum(a, b), "tanh": lambda: cnp.tanh(am),
             "sum(a, axis=0)": lambda: cnp.sum(a, axis=0), "mesh sum(axis=1)":
                 lambda: cnp.sum(am, 1),
             "a @ w": lambda: a @ w, "matmul(a, w, precision=None)":
                 lambda: cnp.matmul(a, w, precision=None), "mesh @": lambda: am @ wm,
             "a > b": lambda: a > b, "a > 0": lambda: a > 0, "0.5 <= a": lambda: 0.5 <= a,
             "int32 == 3": lambda: ai == 3, "bf16 <": lambda: ab < bb,
             "mesh != 1.0": lambda: am != 1.0, "greater_equal": lambda: cnp.greater_equal(a, b),
             "mask & mask": lambda: (a > 0) & (b < 2), "~mask": lambda: ~(a > b),
             "int32 ^": lambda: ai ^ bi, "logical_or": lambda: cnp.logical_or(a > 0, a < 1)}
    for name, f in cases.items():
        assert _python_calls(f) == [], name


def _loss_with(ops):
    """A loss of every primitive with a tape rule, written with ``ops[name]`` (the
    primitives, or their Python ops): broadcasting, scalars on both sides, a 2x4 mesh."""
    def loss(w, b):
        u = ops["multiply"](ops["add"](w, b), 0.5)                 # (8, 16) + (16,)
        u = ops["subtract"](2.0, ops["divide"](u, 3.0))
        u = ops["maximum"](ops["tanh"](u), ops["minimum"](ops["sin"](w), 0.25 + 0 * w))
        u = ops["add"](u, ops["divide"](1.5, ops["add"](ops["square"](w), 1.0)))
        v = ops["sigmoid"](ops["gelu"](u))
        for name in ("exp", "sqrt", "rsqrt", "log", "log1p", "expm1", "erf", "erfc", "abs",
                     "relu", "negative", "cos", "floor", "ceil", "trunc", "sign", "round"):
            arg = ops["add"](ops["abs"](v), 0.5) if name in ("sqrt", "rsqrt", "log") else v
            v = ops["add"](v, ops["multiply"](ops[name](arg), 0.01))
        k = cts.device_put(np.linspace(-1, 1, 16 * 4, dtype=np.float32).reshape(16, 4))
        rows = ops["sum"](ops["matmul"](ops["multiply"](v, v), k), axis=1)
        return ops["sum"](ops["multiply"](rows, ops["sum"](v, 0)[:8]))
    return loss


def test_the_c_path_records_on_the_tape_with_the_python_ops_gradients():
    """Under value_and_grad the primitives record their nodes in C; the value and the
    gradients are bit for bit those of the Python ops (their own records)."""
    rng = np.random.default_rng(5)
    for sh_w, sh_b in ((None, None), (_mesh_sharding(("x", "y")), _mesh_sharding(("y",)))):
        w = cts.device_put(rng.standard_normal((8, 16)).astype(np.float32), sh_w)
        b = cts.device_put(rng.standard_normal((16,)).astype(np.float32), sh_b)
        names = UNARY + BINARY + ["sum", "matmul"]
        prims = {n: getattr(_ops, n) for n in names}
        python = {n: p.__wrapped__ for n, p in prims.items()}
        before = {n: p.cache_info() for n, p in prims.items()}
        v1, g1 = cts.value_and_grad(_loss_with(prims), argnums=(0, 1))(w, b)
        after = {n: p.cache_info() for n, p in prims.items()}
        # every primitive ran from its plan at least once while the tape recorded
        hit = [n for n in names if after[n]["hits"] + after[n]["misses"] >
               before[n]["hits"] + before[n]["misses"]]
        assert sorted(hit) == sorted(names)
        v2, g2 = cts.value_and_grad(_loss_with(python), argnums=(0, 1))(w, b)
        assert _bits(v1) == _bits(v2)
        for x, y in zip(g1, g2):
            _same(x, y)
        assert np.isfinite(np.asarray(g1[0])).all() and np.abs(np.asarray(g1[0])).sum() > 0


def test_a_16_bit_op_records_by_its_vjp16_and_a_nested_tape_takes_the_python_op():
    x = cts.device_put(np.float32([0.5, -1.0, 2.0]))
    bf = cnp.astype(x, cnp.bfloat16)
    before = _ops.add.cache_info()["fallbacks"]
    v, g = cts.value_and_grad(lambda x: cnp.sum(cnp.astype(cnp.astype(x, cnp.bfloat16) + bf,
                                                           np.float32)))(x)
    assert _ops.add.cache_info()["fallbacks"] == before   # recorded in C (tests/ops/test_unary16.py)
    np.testing.assert_array_equal(np.asarray(g), [1.0, 1.0, 1.0])
    before = _ops.add.cache_info()["fallbacks"]
    _ops.add.vjp16 = None   # without a 16-bit rule: the Python op records it
    try:
        v, g = cts.value_and_grad(lambda x: cnp.sum(cnp.astype(cnp.astype(x, cnp.bfloat16) + bf,
                                                               np.float32)))(x)
    finally:
        _ops.add.vjp16 = _ops._rule16(_ops.add)
    assert _ops.add.cache_info()["fallbacks"] == before + 1
    np.testing.assert_array_equal(np.asarray(g), [1.0, 1.0, 1.0])

    def outer(x):
        from ctrainstate import lax
        inner = cts.grad(lambda y: cnp.sum(cnp.sin(y)))(lax.stop_gradient(x))
        return cnp.sum(cnp.sin(x)) + cnp.sum(inner)

    before = _ops.sin.cache_info()["fallbacks"]
    v, g = cts.value_and_grad(outer)(x)
    assert _ops.sin.cache_info()["fallbacks"] > before        # the inner tape has an outer
    h = np.float32([0.5, -1.0, 2.0])
    np.testing.assert_allclose(np.asarray(g), np.cos(h), rtol=1e-6)


def test_the_tape_is_per_thread():
    """A tape recording on one thread does not send another thread's ops to Python."""
    x = cts.device_put(np.float32([1.0, 2.0]))
    entered, release = threading.Event(), threading.Event()

    def f(x):
        entered.set()
        release.wait(10)
        return cnp.sum(x * x)

    t = threading.Thread(target=lambda: cts.value_and_grad(f)(x))
    t.start()
    assert entered.wait(10)
    try:
        _ops.exp(x)
        before = _ops.exp.cache_info()
        _ops.exp(x)
        assert _ops.exp.cache_info()["hits"] == before["hits"] + 1
    finally:
        release.set()
        t.join(10)


def test_donated_and_deleted_operands_raise_as_the_python_op():
    x = cts.device_put(np.float32([1.0, 2.0]))
    y = x + 1.0
    x._moved()
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        x + 1.0
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        cnp.sin(x)
    y.delete()
    with pytest.raises(cts.DonatedBufferError, match="deleted"):
        cnp.sum(y)


def test_other_operands_and_keywords_take_the_python_op():
    x = cts.device_put(np.float32([1.0, 2.0]))
    before = _ops.add.cache_info()["fallbacks"]
    assert (x + np.float32([1, 1])).tolist() == [2.0, 3.0]       # a numpy operand
    assert (x + True).tolist() == [2.0, 3.0]                      # a bool (jax: weak int)
    assert cnp.add(x, b=1.0).tolist() == [2.0, 3.0]                 # a keyword
    assert _ops.add.cache_info()["fallbacks"] == before + 3
    with pytest.raises(ValueError, match="broadcast"):
        x + cts.device_put(np.float32([1, 2, 3]))
    # mixed dtypes promote in the Python op
    z = x + cnp.astype(x, cnp.bfloat16)
    assert z.dtype == np.float32


def test_a_numpy_float_operand_is_placed_and_the_c_plan_runs_the_op():
    """A numpy float32 / float64 operand beside a float32 Array (a model applied to a numpy
    batch) is placed where the Array lives and the op runs on its C plan: the same bits and
    sharding as with the operand placed by hand, on one device and on a mesh, and, on one
    device, no Python op below the primitive (only the placing, device_put). Integer numpy
    operands keep the Python op (jax's promotion)."""
    rng = np.random.default_rng(3)
    a = cts.device_put(rng.standard_normal((8, 16)).astype(np.float32))
    am = cts.device_put(np.asarray(a), _mesh_sharding(("x", "y")))
    w = rng.standard_normal((16, 4)).astype(np.float32)
    bias = rng.standard_normal((16,))                                  # float64
    for x in (a, am):
        cases = [(lambda x=x: x @ w, lambda x=x: x @ cts.device_put(w, _replicated(x))),
                 (lambda x=x: w.T @ x.T, lambda x=x: cts.device_put(w.T, _replicated(x)) @ x.T),
                 (lambda x=x: x + bias, lambda x=x: x + cts.device_put(
                     bias.astype(np.float32), _replicated(x))),
                 (lambda x=x: cnp.matmul(x, w, precision=None),
                  lambda x=x: x @ cts.device_put(w, _replicated(x)))]
        for fast, ref in cases:
            got, want = fast(), ref()
            _same(got, want)
            assert got.sharding == want.sharding
            calls = _python_calls(fast)
            assert any(c.endswith(":_lift_host") for c in calls), calls
            if x is a:   # (on the mesh, a product that reshards runs the Python op either way)
                assert _op_calls(calls) == [], calls
    # the placed operand's sharding is one object per placement: the plan cache hits
    before = _ops.add.cache_info()
    for _ in range(3):
        a + bias
    after = _ops.add.cache_info()
    assert after["hits"] - before["hits"] == 3 and after["misses"] == before["misses"]
    ints = np.arange(16, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(a + ints), np.asarray(a) + ints.astype(np.float32))


def _op_calls(calls):
    """The calls of ops.py's functions, less the placing of a host operand."""
    return [c for c in calls if "/ops/ops.py:" in c and c.rsplit(":", 1)[1] not in
            ("call", "<lambda>", "_lift_host", "_place_of", "_sharding_for", "_id_cached",
             "<genexpr>")]


def _replicated(x):
    s = x.sharding
    return cts.NamedSharding(s.mesh, cts.P()) if isinstance(s, cts.NamedSharding) else s


def test_primitive_objects_look_like_the_functions_they_replace():
    import inspect
    p = cnp.sin
    assert p.__name__ == "sin" and repr(p) == "<ctrainstate primitive sin>"
    assert inspect.signature(p) == inspect.signature(p.__wrapped__)
    assert list(inspect.signature(p).parameters) == ["x"]
    assert cnp.sum.__doc__.startswith("``jnp.sum``")
    assert callable(p.__wrapped__) and p.planner is not None
    class Holder:
        f = cnp.sin
    assert Holder().f is cnp.sin       # not bound as a method, as a builtin function
    info = p.cache_info()
    assert set(info) == {"hits", "misses", "fallbacks", "entries", "size"}
    import copy
    import pickle
    for prim in (cnp.sin, cnp.add, cnp.sum, cnp.matmul, _ops.sum):
        assert pickle.loads(pickle.dumps(prim)) is prim     # by reference, as a function
        assert copy.deepcopy(prim) is prim


def test_a_planner_that_says_no_or_returns_a_bad_plan():
    calls = []

    def fallback(x):
        calls.append(x)
        return "python"

    no = _C.Primitive("no", 1, fallback, lambda x: None)
    x = cts.device_put(np.float32([1.0]))
    assert no(x) == "python" and no(x) == "python"
    assert no.cache_info()["misses"] == 1 and no.cache_info()["hits"] == 1

    bad = _C.Primitive("bad", 1, fallback, lambda x: (0, 1, 2))
    with pytest.raises(ValueError, match="bad plan"):
        bad(x)
    with pytest.raises(ValueError, match="nin"):
        _C.Primitive("p", 3, fallback, fallback)
    with pytest.raises(TypeError, match="callable"):
        _C.Primitive("p", 1, fallback, 3)
    with pytest.raises(TypeError, match="vjp"):
        _C.Primitive("p", 1, fallback, fallback, None, 3)
    with pytest.raises(TypeError):
        _C.dispatch_register(None, int, None, int, 1, 2, 3, 4, 5, 6)
    with pytest.raises(TypeError, match="classes"):
        _C.dispatch_register(None, 1, None, int, *[_ops.add] * 6)

    class NoSlots:   # the dispatcher reads a tape's fields at its __slots__' offsets
        def __init__(self):
            self.nodes, self.tracked, self.keep, self.outer = [], set(), [], ()
    with pytest.raises(TypeError, match="no __slots__ entry outer"):
        _C.dispatch_register(None, NoSlots, None, int, *[_ops.add] * 6)
    with pytest.raises(TypeError, match="10 arguments"):
        _C.dispatch_register(None)
    with pytest.raises(TypeError, match="10 arguments"):
        _C.dispatch_register_typed(_ops.add)
    with pytest.raises(TypeError, match="argument 2 is not callable"):
        _C.dispatch_register_typed(*[_ops.add] * 2, 3, *[_ops.add] * 7)


def test_equal_shardings_share_a_plan():
    """A new NamedSharding object equal to the planned one (a sharding constraint or a
    device_put makes one every step) hits the plan; a different layout does not."""
    mesh = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))
    x = cts.device_put(np.ones((8, 16), np.float32), cts.NamedSharding(mesh, cts.P("x", None)))
    _ops.exp(x)
    before = _ops.exp.cache_info()
    y = cts.device_put(np.ones((8, 16), np.float32), cts.NamedSharding(mesh, cts.P("x")))
    assert y.sharding is not x.sharding and y.sharding == x.sharding
    _same(_ops.exp(y), _ops.exp.__wrapped__(y))
    assert _ops.exp.cache_info()["hits"] == before["hits"] + 1
    z = cts.device_put(np.ones((8, 16), np.float32), cts.NamedSharding(mesh, cts.P(None, "y")))
    _same(_ops.exp(z), _ops.exp.__wrapped__(z))
    assert _ops.exp.cache_info()["misses"] == before["misses"] + 1
    other = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))  # another mesh object
    w = cts.device_put(np.ones((8, 16), np.float32), cts.NamedSharding(other, cts.P("x")))
    _same(_ops.exp(w), _ops.exp.__wrapped__(w))



@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 1)])
def test_size_one_mesh_axes_move_no_operand(mesh_shape):
    """A mesh axis of size 1 splits nothing: a replicated bias added to an Array split over
    such an axis already has the blocks it would be resharded to, so it is not copied and the
    op runs from the C plan; the result, its layout and the gradient are the Python op's.
    Over an axis of size 4 the bias is resharded (the C plan says no)."""
    n = mesh_shape[0] * mesh_shape[1]
    mesh = cts.Mesh(np.array(cts.devices()[:n]).reshape(mesh_shape), ("data", "model"))
    rng = np.random.default_rng(0)
    a = cts.device_put(_values(rng, (8, 16)), cts.NamedSharding(mesh, cts.P("data", "model")))
    b = cts.device_put(_values(rng, (16,)), cts.NamedSharding(mesh, cts.P(None)))
    for op in (_ops.add, _ops.multiply):
        _same(_run_fast(op, a, b), op.__wrapped__(a, b))
        _same(_run_fast(op, b, a), op.__wrapped__(b, a))
    assert _ops._stays(b, mesh, (("model",),))
    assert _ops._stays(b, mesh, (("data",),)) == (mesh_shape[0] == 1)
    fn = lambda a, b: cnp.sum(cnp.sin(a * b + b))   # noqa: E731
    loss, (ga, gb) = cts.value_and_grad(fn, argnums=(0, 1))(a, b)
    an, bn = np.asarray(a, np.float64), np.asarray(b, np.float64)
    want_b = (np.cos(an * bn + bn) * (an + 1)).sum(0)
    np.testing.assert_allclose(np.asarray(gb), want_b, rtol=1e-4, atol=1e-4)
    assert ga.sharding == a.sharding and gb.sharding.spec == b.sharding.spec
    # an axis of size 4: the Python op reshards the bias, the C plan says no
    wide = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("data", "model"))
    a4 = cts.device_put(np.asarray(a), cts.NamedSharding(wide, cts.P("data", "model")))
    b4 = cts.device_put(np.asarray(b), cts.NamedSharding(wide, cts.P(None)))
    assert not _ops._stays(b4, wide, (("model",),))
    np.testing.assert_array_equal(np.asarray(_ops.add(a4, b4)), np.asarray(a) + np.asarray(b))

def test_cache_keeps_at_most_its_size_and_replans():
    x = [cts.device_put(np.ones((n,), np.float32)) for n in range(1, 40)]
    _ops.cos.cache_clear()
    for a in x:
        _ops.cos(a)
    info = _ops.cos.cache_info()
    assert info["entries"] == info["size"] and info["misses"] == len(x)
    for a in x:
        np.testing.assert_array_equal(np.asarray(_ops.cos(a)), np.cos(np.ones(a.shape, np.float32)))


def test_kernel_codes_are_read_from_C_not_copied():
    """The Python layer takes the kernels' enum values from _C.op_codes: no module-level
    ``A, B, ... = range(N)`` copies of a C enum anywhere in the package."""
    import ast
    import pathlib
    from ctrainstate._src.ops import elementwise as _elementwise
    from ctrainstate._src.ops import math_extra as _math_extra
    from ctrainstate._src.base import precision as _precision
    codes = _C.op_codes
    assert _ops.U_ERFC == codes["unary"]["ERFC"] and _ops.B_PICK == codes["binary"]["PICK"]
    assert _math_extra.U_SIGNBIT == codes["unary"]["SIGNBIT"]
    assert _elementwise.ISFINITE == codes["ewise"]["ISFINITE"]
    assert _precision.BF16 == codes["precision"]["BF16"]
    assert len(set(codes["unary"].values())) == len(codes["unary"])
    root = pathlib.Path(cts.__file__).parent
    copies = []
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                    and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", None) == "range"):
                copies.append(f"{path.relative_to(root)}:{node.lineno}")
    assert copies == []


def test_threads_replacing_plans_while_a_call_runs_without_the_gil():
    """A call on a large Array releases the GIL around its kernels; other threads planning
    many new kinds meanwhile do not replace or clear the plan it runs from."""
    big = cts.device_put(np.full((512, 256), 0.25, np.float32), _mesh_sharding(("x", "y")))
    want = np.asarray(_ops.exp.__wrapped__(big))      # the Python op, alone
    assert np.allclose(want, np.exp(0.25))
    smalls = [cts.device_put(np.ones((n,), np.float32)) for n in range(1, 41)]
    errors, stop = [], threading.Event()

    def churn():
        try:
            while not stop.is_set():
                for a in smalls:
                    _ops.exp(a)
                _ops.exp.cache_clear()
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    # a short switch interval: the threads interleave more often, and the main thread gets
    # the GIL back from the churning ones in well under the default 5 ms
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            out = _ops.exp(big)
            assert out.sharding == big.sharding and out.shape == big.shape
            np.testing.assert_array_equal(np.asarray(out), want)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        sys.setswitchinterval(interval)
    assert errors == []


# --- layout primitives: reshape, broadcast_to, the reductions' broadcast back ---------------

def _finite(rng, shape, dtype):
    v = rng.standard_normal(shape).astype(np.float32) * 30
    v.reshape(-1)[:2] = [-0.0, 0.0]
    return v.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, cnp.bfloat16, np.float16, np.int32, np.bool_])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_reshape_c_path_equals_python_op(dtype, where):
    """A reshape that keeps every block (any dtype: bytes are copied) runs from its plan; the
    result and its sharding are the Python op's."""
    rng = np.random.default_rng(7)
    sh = dict(_placements())[where]
    x = cts.device_put(_finite(rng, (8, 12), dtype), sh)
    # (on the mesh, 8 = 2 x 4 and 12 = 4 x 3 split along 'x' (2) and 'y' (4): blocks kept)
    for shape in ((8, 4, 3), (2, 4, 12), (8, 12, 1)):
        _same(_run_fast(_ops.reshape, x, shape), _ops.reshape.__wrapped__(x, shape))
    # -1 is resolved per call of the same static value
    _same(_run_fast(_ops.reshape, x, (8, -1, 3)), _ops.reshape.__wrapped__(x, (8, 4, 3)))


def test_reshape_that_gathers_or_keeps_the_shape_takes_the_python_op():
    x = cts.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), _mesh_sharding(("x", "y")))
    before = _ops.reshape.cache_info()
    y = _ops.reshape(x, (32,))            # ('x','y') both sharded in one group: gathered
    assert _ops.reshape(x, (8, 4)) is x  # the same shape: x itself, as the Python op
    assert _ops.reshape.cache_info()["fallbacks"] == before["fallbacks"] + 2
    np.testing.assert_array_equal(np.asarray(y), np.arange(32, dtype=np.float32))
    with pytest.raises(ValueError, match="cannot reshape"):
        _ops.reshape(x, (5, 7))
    with pytest.raises(ValueError, match="cannot reshape"):
        _ops.reshape(x, (5, 7))           # (a refused plan is cached: the same error again)


@pytest.mark.parametrize("dtype", [np.float32, cnp.bfloat16, np.int32])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_broadcast_to_c_path_equals_python_op(dtype, where):
    rng = np.random.default_rng(8)
    sh = dict(_placements())[where]
    x = cts.device_put(_finite(rng, (8, 1, 4), dtype),
                       None if sh is None else _mesh_sharding(("x", None, "y")))
    for shape in ((8, 6, 4), (3, 8, 5, 4)):
        fast = _run_fast(_ops.broadcast_to, x, shape)
        _same(fast, _ops.broadcast_to.__wrapped__(x, shape))
        np.testing.assert_array_equal(np.asarray(fast), np.broadcast_to(np.asarray(x), shape))


def test_broadcast_to_keeps_negative_zero_inf_and_nan():
    """A broadcast is a copy: -0.0 stays -0.0 on both paths (jnp.broadcast_to's bits)."""
    v = np.float32([-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5])
    for dt in (np.float32, cnp.bfloat16, np.float16):
        x = cts.device_put(v.astype(dt))
        for out in (_run_fast(_ops.broadcast_to, x, (3, 6)),
                    _ops.broadcast_to.__wrapped__(x, (3, 6))):
            h = np.asarray(out).astype(np.float32)
            assert np.signbit(h[:, 0]).all() and not np.signbit(h[:, 1]).any(), dt
            np.testing.assert_array_equal(h, np.broadcast_to(v, (3, 6)))


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)])
def test_the_cotangent_of_a_sum_is_laid_out_as_its_operand(axis):
    """sum's tape rule broadcasts the cotangent back in the operand's sharding from a plan
    (_broadcast_like), bit for bit the Python ops' gradient."""
    rng = np.random.default_rng(9)
    x = cts.device_put(_values(rng, (8, 16)), _mesh_sharding(("x", "y")))
    x = cts.device_put(np.nan_to_num(np.asarray(x), nan=1.0, posinf=2.0, neginf=-2.0),
                       x.sharding)

    def loss(ops):
        return lambda x: ops["sum"](ops["multiply"](ops["sum"](ops["sin"](x), axis=axis), 2.0))
    prims = {n: getattr(_ops, n) for n in ("sum", "multiply", "sin")}
    python = {n: p.__wrapped__ for n, p in prims.items()}
    cts.value_and_grad(loss(prims))(x)
    before = _ops._broadcast_like.cache_info()
    v1, g1 = cts.value_and_grad(loss(prims))(x)
    after = _ops._broadcast_like.cache_info()   # (the outer sum's too, but of a scalar)
    assert after["hits"] == before["hits"] + (1 if axis in (None, (0, 1)) else 2)
    assert after["fallbacks"] == before["fallbacks"]
    v2, g2 = cts.value_and_grad(loss(python))(x)
    _same(g1, g2)
    assert g1.sharding == x.sharding
    np.testing.assert_allclose(np.asarray(g1), 2 * np.cos(np.asarray(x)), rtol=1e-6)


def test_layout_primitives_record_on_the_tape():
    """reshape and broadcast_to record their nodes from C; the gradients are the Python ops'."""
    rng = np.random.default_rng(10)
    x = cts.device_put(rng.standard_normal((4, 6)).astype(np.float32))

    def loss(ops):
        def f(x):
            y = ops["broadcast_to"](ops["reshape"](x, (4, 1, 6)), (4, 3, 6))
            return ops["sum"](ops["multiply"](ops["sin"](y), ops["reshape"](y, (12, 6))[:4, None]))
        return f
    prims = {n: getattr(_ops, n) for n in ("broadcast_to", "reshape", "sum", "multiply", "sin")}
    python = {n: p.__wrapped__ for n, p in prims.items()}
    cts.value_and_grad(loss(prims))(x)
    before = {n: prims[n].cache_info()["hits"] for n in ("broadcast_to", "reshape")}
    v1, g1 = cts.value_and_grad(loss(prims))(x)
    assert all(prims[n].cache_info()["hits"] > before[n] for n in before)
    v2, g2 = cts.value_and_grad(loss(python))(x)
    assert _bits(v1) == _bits(v2)
    _same(g1, g2)


def test_tape_backward_validates_its_arguments():
    with pytest.raises(TypeError, match="tape_backward"):
        _C.tape_backward([], set(), {}, None)
    with pytest.raises(TypeError, match="not \\(out, inputs, vjp\\)"):
        x = cts.device_put(np.float32([1.0]))
        _C.tape_backward([(x, x)], {id(x)}, {id(x): x}, _ops._Group)


def test_tape_backward_adds_cotangents_of_an_input_read_twice_and_skips_untracked():
    x = cts.device_put(np.float32([1.0, 2.0]))
    c = cts.device_put(np.float32([5.0, 7.0]))
    y = x + 0.0
    # y = f(x, x, c): the vjp gives (g, 2g, g); x tracked, c not, a scalar input ignored
    node = (y, (x, x, c, 3.0), lambda g: (g, g * 2.0, g, g))
    cot = {id(y): cts.device_put(np.float32([1.0, 10.0]))}
    _C.tape_backward([node], {id(x), id(y)}, cot, _ops._Group)
    assert id(y) not in cot and id(c) not in cot
    np.testing.assert_array_equal(np.asarray(cot[id(x)]), [3.0, 30.0])


# --- derivative programs (_C.VjpProgram): tape rules run in C ---------------------------------

_PROGRAM_PRIMS = sorted(n for n in UNARY + BINARY + ["matmul"]
                        if isinstance(getattr(_ops, n).vjp, _C.VjpProgram))


def test_the_common_rules_are_programs():
    assert {"sin", "cos", "tanh", "exp", "log", "sqrt", "square", "sigmoid", "negative", "add",
            "subtract", "multiply", "divide", "matmul"} <= set(_PROGRAM_PRIMS)


def _program_cases(name, rng, sh):
    """(g, out, *operands) calls of the rule of primitive `name`: every case its program has."""
    prim = getattr(_ops, name)
    pos = lambda shape: cts.device_put(np.abs(rng.standard_normal(shape)).astype(np.float32) + 0.5,
                                       sh(len(shape)))
    if name == "matmul":
        pairs = [(pos((8, 16)), pos((16, 4)))]
    elif name in BINARY:
        a, b, bias = pos((8, 16)), pos((8, 16)), pos((16,))
        pairs = [(a, b), (a, bias), (bias, a), (a, 2.5), (3.0, a), (a, 2)]
    else:
        pairs = [(pos((8, 16)),)]
    for ops in pairs:
        out = prim(*ops)
        yield (cts.device_put(rng.standard_normal(out.shape).astype(np.float32),
                              out.sharding), out, *ops)


@pytest.mark.parametrize("name", _PROGRAM_PRIMS)
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_a_program_gives_its_python_rules_bits(name, where):
    rng = np.random.default_rng(11)
    m = _mesh_sharding(("x", "y"))
    sh = (lambda nd: None) if where == "one device" else (
        lambda nd: cts.NamedSharding(m.mesh, cts.P(*(("x", "y") if nd == 2 else ("y",)))))
    prog = getattr(_ops, name).vjp
    for call in _program_cases(name, rng, sh):
        fast, slow = prog(*call), prog.rule(*call)
        assert len(fast) == len(slow)
        for f, s in zip(fast, slow):
            assert (f is None) == (s is None)
            if f is not None:
                _same(f, s)


def test_a_program_defers_to_its_rule_under_a_tape_and_for_other_ranks():
    seen = []

    def rule(g, out, a, b):
        seen.append((a.ndim, b.ndim))
        return _ops.matmul.vjp.rule(g, out, a, b)
    prog = _C.VjpProgram(_ops.matmul.vjp.cases, rule, _ops._unbroadcast, 1)
    a3 = cts.device_put(np.ones((2, 4, 3), np.float32))
    a2 = cts.device_put(np.ones((4, 3), np.float32))
    b = cts.device_put(np.ones((3, 5), np.float32))
    prog(_ops.matmul(a3, b), _ops.matmul(a3, b), a3, b)      # rank 3: the rule
    assert seen == [(3, 2)]
    prog(_ops.matmul(a2, b), _ops.matmul(a2, b), a2, b)      # rank 2: the program
    assert seen == [(3, 2)]
    cts.value_and_grad(lambda x: (prog(x, x, a2, b), cnp.sum(x))[1])(a2 @ b)  # a tape records
    assert seen == [(3, 2), (2, 2)]


def test_vjp_program_validates_and_reports_bad_registers():
    rule = lambda *a: a
    with pytest.raises(TypeError, match="cases"):
        _C.VjpProgram([], rule, rule)
    with pytest.raises(TypeError, match="two cases"):
        _C.VjpProgram((None, None), rule, rule)
    with pytest.raises(TypeError, match="a program is"):
        _C.VjpProgram((((("not callable", 0),), (4,)),), rule, rule)
    with pytest.raises(TypeError, match="a program is"):
        _C.VjpProgram((((((_ops.sin, "x"),), (4,))),), rule, rule)
    with pytest.raises(TypeError, match="callable"):
        _C.VjpProgram(((((), (0,))),), None, rule)
    with pytest.raises(ValueError, match="flags"):
        _C.VjpProgram(((((), (0,))),), rule, rule, 4)
    with pytest.raises(ValueError, match="sum's rule"):
        _C.VjpProgram(((((), (0,))),), rule, rule, 2)     # (a sum's rule has no programs)
    x = cts.device_put(np.float32([1.0]))
    bad = _C.VjpProgram(((((_ops.sin, 9),), (4,)),), rule, rule)
    with pytest.raises(ValueError, match="register out of range"):
        bad(x, x, x)
    bad_out = _C.VjpProgram((((), (7,)),), rule, rule)
    with pytest.raises(ValueError, match="output register"):
        bad_out(x, x, x)
    with pytest.raises(TypeError, match="takes"):
        bad_out(x, x)
    with pytest.raises(TypeError, match="callable or None"):
        _ops.sin.vjp = 3


# --- transpose and conversions -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, cnp.bfloat16, np.int32, np.bool_])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_transpose_c_path_equals_python_op(dtype, where):
    rng = np.random.default_rng(12)
    sh = None if where == "one device" else _mesh_sharding(("x", None, "y"))
    x = cts.device_put(_finite(rng, (4, 3, 8), dtype), sh)
    for axes in (None, (2, 0, 1), (0, 1, 2), (1, 2, 0)):
        fast = _run_fast(_ops.transpose, x, axes)
        _same(fast, _ops.transpose.__wrapped__(x, axes))
        np.testing.assert_array_equal(np.asarray(fast), np.transpose(np.asarray(x), axes))
    with pytest.raises(ValueError, match="permutation"):
        _ops.transpose(x, (0, 0, 1))     # (the planner says no; the Python op raises)


@pytest.mark.parametrize("src,dst", [(np.float32, cnp.bfloat16), (np.float32, np.float16),
                                     (cnp.bfloat16, np.float32), (np.float32, np.int32),
                                     (np.int32, np.float32), (np.float32, np.bool_)])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_conversions_c_path_equals_python_op(src, dst, where):
    """astype runs a C plan per block (the dtype a static argument); the bits and the
    sharding are the Python op's (jax's roundings: ct_convert_math.h)."""
    rng = np.random.default_rng(13)
    sh = None if where == "one device" else _mesh_sharding(("x", "y"))
    v = _values(rng, (8, 16)) if np.dtype(src).kind == "f" else _finite(rng, (8, 16), src)
    x = cts.device_put(np.nan_to_num(v, nan=0.0).astype(src) if np.dtype(src).kind != "f"
                       else v.astype(src), sh)
    d = np.dtype(dst)
    fast = _run_fast(_ops._convert_to, x, d)
    _same(fast, _ops._convert_to.__wrapped__(x, d))
    assert cnp.astype(x, dst).dtype == d
    before = _ops._convert_to.cache_info()["hits"]
    cnp.astype(x, dst)
    assert _ops._convert_to.cache_info()["hits"] == before + 1    # astype goes through it


def test_conversions_and_transposes_record_on_the_tape():
    rng = np.random.default_rng(14)
    x = cts.device_put(rng.standard_normal((4, 8)).astype(np.float32), _mesh_sharding(("x", "y")))

    def loss(x):
        y = cnp.astype(cnp.transpose(x) * 3.0, cnp.bfloat16)
        return cnp.sum(cnp.astype(cnp.sin(cnp.astype(y, np.float32)), np.float32))
    cts.value_and_grad(loss)(x)
    before = (_ops.transpose.cache_info()["hits"], _ops._convert_to.cache_info()["hits"])
    v, g = cts.value_and_grad(loss)(x)
    assert _ops.transpose.cache_info()["hits"] > before[0]
    assert _ops._convert_to.cache_info()["hits"] > before[1]
    xb = np.asarray(x).T * 3.0
    yb = np.asarray(cts.device_put(xb.astype(np.float32)).astype(cnp.bfloat16)).astype(np.float32)
    # the cotangent crosses the bfloat16 value as a bfloat16 (rounded), as in jax
    cb = np.cos(yb).astype(np.float32).astype(cnp.bfloat16).astype(np.float32)
    np.testing.assert_allclose(np.asarray(g), (3.0 * cb).T, rtol=1e-6)
    assert g.sharding == x.sharding


# --- the backward pass's C rules: un-broadcasting, sum's rule, the seed and zeros ----------------

def _blocks_meta(x):
    return [(b[0], b[1].shape, b[2], b[3]) for b in x._blocks]


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_unbroadcast_in_c_gives_the_python_rules_bits(where):
    rng = np.random.default_rng(5)
    m = _mesh_sharding(("x", "y"))

    def sh(shape):   # the last two dimensions on ("x", "y") where not of size 1
        if where == "one device":
            return None
        spec = [None] * len(shape)
        for d, name in zip(range(len(shape) - 1, -1, -1), ("y", "x")):
            spec[d] = name if shape[d] > 1 else None
        return cts.NamedSharding(m.mesh, cts.P(*spec))
    put = lambda shape: cts.device_put(rng.standard_normal(shape).astype(np.float32) + 0.5,
                                       sh(shape))
    shapes = [((8, 16), (16,)), ((8, 16), (1, 16)), ((8, 16), (8, 1)), ((2, 8, 16), (16,)),
              ((2, 8, 16), (8, 1)), ((2, 8, 16), (1, 1, 16)), ((8, 16), ()), ((2, 8, 16), (2, 1, 1))]
    for big, small in shapes:
        for name in ("add", "subtract", "multiply", "divide"):
            prim = getattr(_ops, name)
            for a, b in ((put(big), put(small)), (put(small), put(big))):
                out = prim(a, b)
                g = cts.device_put(rng.standard_normal(out.shape).astype(np.float32), out.sharding)
                fast, slow = prim.vjp(g, out, a, b), prim.vjp.rule(g, out, a, b)
                for f, s, x in zip(fast, slow, (a, b)):
                    _same(f, s)
                    assert f.shape == x.shape


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sums_rule_in_c_gives_the_python_rules_bits(where, dtype):
    rng = np.random.default_rng(6)
    m = _mesh_sharding(("x", "y"))
    sh = None if where == "one device" else cts.NamedSharding(m.mesh, cts.P("x", "y"))
    x = cts.device_put(rng.standard_normal((8, 16)).astype(np.float32), sh)
    if dtype == "bfloat16":
        x = cnp.astype(x, cnp.bfloat16)
    assert _ops.sum.vjp.flags == 2 and cnp.sum.vjp.flags == 2
    for axis in (None, 0, 1, -1, (0, 1), (1, 0), [0], (), (-2,)):
        for keep in (False, True):
            out = _ops.sum(x, axis=axis, keepdims=keep)
            g = cts.device_put(rng.standard_normal(out.shape).astype(np.float32), out.sharding)
            if dtype == "bfloat16":
                g = cnp.astype(g, cnp.bfloat16)
            for fast, slow in ((_ops.sum.vjp(g, out, x, axis, keep),
                                _ops.sum.vjp.rule(g, out, x, axis, keep)),
                               (cnp.sum.vjp(g, out, x, axis, None, None, keep),
                                cnp.sum.vjp.rule(g, out, x, axis, None, None, keep))):
                assert len(fast) == len(slow) == 1
                _same(fast[0], slow[0])
                assert _blocks_meta(fast[0]) == _blocks_meta(slow[0])
    s = _ops.sum(x)
    for bad in ((0, 0), 2, -3, 1.0, "x"):      # the rule's errors
        with pytest.raises((ValueError, TypeError)) as fast_err:
            _ops.sum.vjp(s, s, x, bad)
        with pytest.raises(type(fast_err.value)):
            _ops.sum.vjp.rule(s, s, x, bad)


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_filled_like_in_c_is_the_python_ones(where):
    m = _mesh_sharding(("x", "y"))
    for sh in ((None,) if where == "one device" else
               (cts.NamedSharding(m.mesh, cts.P("x", "y")), cts.NamedSharding(m.mesh, cts.P()),
                cts.NamedSharding(m.mesh, cts.P(None, "y")))):
        for shape in ((8, 16), (), (4, 8, 2)):
            if shape == () and sh is not None and sh.spec != cts.P():
                continue
            x = cts.device_put(np.ones(shape, np.float32), sh)
            for v in (1.0, 0.0, -0.0, 2.5):
                fast, slow = _C.filled_like(x, v), _ops._filled_like(x, v)
                _same(fast, slow)
                assert _blocks_meta(fast) == _blocks_meta(slow)
                assert fast._shard_shape == slow._shard_shape and fast.dtype == slow.dtype
                assert all(fb[1] is not xb[1] for fb, xb in zip(fast._blocks, x._blocks))
    assert _C.filled_like(cnp.astype(x, cnp.bfloat16), 1.0) is None    # the Python function's
    assert _C.filled_like(np.ones(3, np.float32), 1.0) is None
    with pytest.raises(TypeError):
        _C.filled_like(x, 1)


def test_no_python_rule_runs_in_a_small_models_backward():
    rng = np.random.default_rng(7)
    dev = lambda *s: cts.device_put(rng.standard_normal(s).astype(np.float32))
    x, t = dev(64, 16), dev(64, 16)
    p = {"w": [dev(16, 16), dev(16, 16)], "b": [dev(16), dev(16)], "unused": dev(16, 4)}

    def loss(p):
        h = x
        for w, b in zip(p["w"], p["b"]):
            h = cnp.sin(h @ w + b)
        return cnp.mean(cnp.square(h - t)) + cnp.sum(cnp.sum(h, axis=0))
    vag = cts.value_and_grad(loss)
    calls = _python_calls(lambda: vag(p))
    names = {c.rsplit(":", 1)[1] for c in calls}
    assert not names & {"_unbroadcast", "_vjp_sum", "_broadcast_like", "_filled_like",
                        "rule", "_rule_sum", "zeros_like", "_put"}, sorted(names)
    v, g = vag(p)
    np.testing.assert_array_equal(np.asarray(g["unused"]), np.zeros((16, 4), np.float32))


@pytest.mark.parametrize("kind", ["array", "tuple", "dict"])
def test_value_and_grad_of_a_bare_array_keeps_its_structure_after_the_first_call(kind):
    """A differentiated argument's structure is remembered at the first call (_remember_spec)
    and flattened in C at the next: for a lone Array too, whose check once compared Array
    values (an elementwise comparison, ambiguous truth) and so was never kept: every call
    then ran optree and that comparison again."""
    rng = np.random.default_rng(3)
    x = cts.device_put(rng.standard_normal((8, 4)).astype(np.float32))
    arg = {"array": x, "tuple": (x, x), "dict": {"b": x, "a": [x]}}[kind]
    vag = cts.value_and_grad(lambda a: sum(cnp.sum(cnp.sin(v)) for v in
                                           cts.tree_util.tree_leaves(a)))
    v1, g1 = vag(arg)
    names = {c.rsplit(":", 1)[1] for c in _python_calls(lambda: vag(arg))}
    assert not names & {"_remember_spec", "_spec_tree", "_compare", "tree_flatten"}, sorted(names)
    v2, g2 = vag(arg)
    assert float(v1) == float(v2)
    for a, b in zip(cts.tree_util.tree_leaves(g1), cts.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.cos(np.asarray(x)), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert type(g2) is type(arg)


def test_vjp_register_checks_its_arguments():
    with pytest.raises(TypeError, match="3 arguments"):
        _C.vjp_register(_ops.sum, _ops.reshape)
    with pytest.raises(TypeError, match="not callable"):
        _C.vjp_register(_ops.sum, 3, _ops._broadcast_like)
    _C.vjp_register(_ops.sum, _ops.reshape, _ops._broadcast_like)   # (what ops.py registers)


def test_the_backward_pass_skips_the_cotangents_of_untracked_inputs():
    rng = np.random.default_rng(8)
    dev = lambda *s: cts.device_put(rng.standard_normal(s).astype(np.float32))
    x, t, w = dev(8, 4), dev(8, 3), dev(4, 3)
    g_of_x = _ops._MM_T[(False, True)]      # g @ w^T: the data's cotangent
    calls = lambda p: (lambda i: i["hits"] + i["misses"] + i["fallbacks"])(p.cache_info())
    f = cts.value_and_grad(lambda w: cnp.sum(cnp.square(x @ w - t)))
    f(w)
    before, negs = calls(g_of_x), calls(_ops.negative)
    v, g = f(w)
    assert calls(g_of_x) == before and calls(_ops.negative) == negs   # none for x, t
    want = 2 * np.asarray(x).T @ (np.asarray(x) @ np.asarray(w) - np.asarray(t))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-5)
    # both operands differentiated: both products run
    v2, (gx, gw) = cts.value_and_grad(lambda x, w: cnp.sum(cnp.square(x @ w - t)),
                                      argnums=(0, 1))(x, w)
    assert calls(g_of_x) == before + 1
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(g))


def test_max_min_kernels_keep_their_formula_in_every_broadcast_form():
    # (x > y || x != x) ? x : y and (x < y || x != x) ? x : y, bit for bit: NaN payloads,
    # signed zeros, each operand dense or broadcast along rows, both broadcast (one value per row)
    vals = np.array([np.nan, -np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf], np.float32)
    vals = np.concatenate([vals, np.frombuffer(np.uint32([0x7fc00001, 0xffc12345]).tobytes(),
                                               np.float32)])
    x = np.repeat(vals[:, None], len(vals), 1)        # (10, 10): x[i, j] = vals[i]
    y = x.T.copy()                                     # y[i, j] = vals[j]

    def want(op, a, b):
        a, b = np.broadcast_arrays(a, b)
        pick = ((a > b) if op == "maximum" else (a < b)) | np.isnan(a)
        return np.where(pick, a, b)
    for op in ("maximum", "minimum"):
        for a, b in ((x, y), (x, y[:1]), (x[:, :1], y), (x[:, :1], y[:, :1] * 0 + vals[3]),
                     (x[:, :1], np.full((10, 1), np.nan, np.float32))):
            got = getattr(_ops, op)(cts.device_put(a), cts.device_put(b))
            if got.shape != np.broadcast_shapes(a.shape, b.shape):
                got = _ops.broadcast_to(got, np.broadcast_shapes(a.shape, b.shape))
            assert np.asarray(got).tobytes() == want(op, a, b).astype(np.float32).tobytes(), op
    # the broadcasting copy (max(v, v)) of a sum's cotangent: the value in every element
    s = cts.device_put(vals[:1].reshape(1, 1))
    like = cts.device_put(np.zeros((64, 16), np.float32))
    out = np.asarray(_ops._broadcast_like(s, like))
    assert out.tobytes() == np.full((64, 16), vals[0], np.float32).tobytes()


def test_each_thread_reads_its_own_tape_stack_as_threads_come_and_go():
    """The C path's read of this thread's tape stack (cached per thread state) follows the
    calling thread: threads that record interleaved with ones that do not, threads that end
    and new ones (which may reuse a thread state's memory), pmap's reassigned stack."""
    x = cts.device_put(np.float32([1.0, 2.0, 3.0]))
    f = cts.value_and_grad(lambda x: cnp.sum(cnp.sin(x) * x))
    want = np.asarray(f(x)[1])
    errors = []

    def vag(n):
        try:
            for _ in range(n):
                g = np.asarray(f(x)[1])
                if g.tobytes() != want.tobytes():
                    errors.append(g)
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    for _ in range(20):          # one after another: thread states come and go
        t = threading.Thread(target=vag, args=(3,))
        t.start()
        t.join(10)
        vag(1)
        assert cnp.sin(x) is not None and _ops._tape() is None
    # interleaved: a thread in the middle of a recording while others compute and record
    entered, release = threading.Event(), threading.Event()

    def held(x):
        entered.set()
        release.wait(10)
        return cnp.sum(cnp.sin(x) * x)
    out = []
    t = threading.Thread(target=lambda: out.append(np.asarray(cts.value_and_grad(held)(x)[1])))
    t.start()
    assert entered.wait(10)
    try:
        others = [threading.Thread(target=vag, args=(5,)) for _ in range(3)]
        for o in others:
            o.start()
        vag(5)
        _ops.exp(x)
        before = _ops.exp.cache_info()["hits"]
        _ops.exp(x)                               # not recorded: runs from its plan
        assert _ops.exp.cache_info()["hits"] == before + 1
        for o in others:
            o.join(10)
    finally:
        release.set()
        t.join(10)
    assert not errors, errors[:3]
    assert out and out[0].tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["maximum", "minimum"])
@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
@pytest.mark.parametrize("s", [0.0, -0.0, 1.5, 3, -2, math.inf])
def test_maximum_and_minimum_with_a_python_scalar_take_the_two_array_plan(name, where, s):
    """x (op) s for a Python scalar s: the scalar's 0-d Array is kept (ops._CONSTS), so the
    call runs the two-Array C plan: the Python op's bits, shape, sharding and gradient (split
    at ties), scalar on either side; a NaN scalar and a jit trace take the Python op."""
    rng = np.random.default_rng(11)
    sh = dict(_placements())[where]
    v = _values(rng, (8, 16))
    v[1, :4] = [s, s, -s, s]                         # ties with the scalar
    x = cts.device_put(v, sh)
    prim = getattr(_ops, name)
    slow = getattr(_ops, "_binary")
    op = _ops.B_MAX if name == "maximum" else _ops.B_MIN
    da, db = (_ops._d_max_a, _ops._d_max_b) if name == "maximum" else (_ops._d_max_b,
                                                                       _ops._d_max_a)
    for args in ((x, s), (s, x)):
        prim(*args)
        names = {c.rsplit(":", 1)[1] for c in _python_calls(lambda: prim(*args))}
        assert not names & {"_binary", "_lift", "device_put", "_binary_raw"}, sorted(names)
        fast = prim(*args)
        _same(fast, slow(op, *args, da, db))
        with np.errstate(invalid="ignore"):
            want = getattr(np, name)(*(np.float32(a) if not isinstance(a, cts.Array)
                                       else np.asarray(a) for a in args))
        np.testing.assert_array_equal(np.asarray(fast), want)
        f = lambda y: cnp.sum(prim(*((y, s) if args[0] is x else (s, y))) * 1.5)  # noqa: E731
        g_fast = cts.grad(f)(x)
        g_slow = cts.grad(lambda y: cnp.sum(slow(op, *((y, s) if args[0] is x else (s, y)),
                                                 da, db) * 1.5))(x)
        _same(g_fast, g_slow)


def test_a_kept_constant_is_reused_until_deleted_or_its_placement_changes():
    """kept_constant: the same Array at every hit; one deleted (or donated) anyway, or a
    placement that is not the one it was made for, is made again; a full cache is emptied."""
    made = []

    def make(arg, place):
        made.append(arg)
        return _ops._lift_any(np.float32(arg), place)
    cache = {}
    place = _ops._place_of(cts.device_put(np.float32(0)))
    a = _ops.kept_constant(cache, 2, ("k", id(place)), place, make, 1.0)
    assert _ops.kept_constant(cache, 2, ("k", id(place)), place, make, 1.0) is a
    a.delete()
    b = _ops.kept_constant(cache, 2, ("k", id(place)), place, make, 1.0)
    assert b is not a and not b.is_deleted() and float(np.asarray(b)) == 1.0
    other = _mesh_sharding(("x", "y")).mesh
    c = _ops.kept_constant(cache, 2, ("k", id(place)), other, make, 1.0)
    assert c is not b and _ops._place_of(c) is other
    _ops.kept_constant(cache, 2, ("j",), place, make, 2.0)
    _ops.kept_constant(cache, 2, ("i",), place, make, 3.0)   # full: emptied, then kept
    assert list(cache) == [("i",)] and made == [1.0, 1.0, 1.0, 2.0, 3.0]


def test_scalar_constants_are_not_kept_for_nan_or_inside_a_trace():
    x = cts.device_put(np.float32([1.0, np.nan, -3.0]))
    n = len(_ops._CONSTS)
    out = _ops.maximum(x, float("nan"))
    assert np.isnan(np.asarray(out)).all() and len(_ops._CONSTS) == n
    # under jit: the op runs as a node of the program (eagerly, outside the recording, at
    # the trace and at every replay), so a constant it keeps is no value of the program
    _ops._CONSTS.clear()
    f = cts.jit(lambda y: _ops.maximum(y * 2.0, 0.25))
    for k in range(3):
        y = cts.device_put(np.float32([1.0, -3.0, 0.1]) * (k - 1))
        np.testing.assert_array_equal(np.asarray(f(y)), np.maximum(np.asarray(y) * 2,
                                                                   np.float32(0.25)))
        np.testing.assert_array_equal(np.asarray(_ops.maximum(y, 0.25)),
                                      np.maximum(np.asarray(y), np.float32(0.25)))
    with pytest.raises(OverflowError):
        _ops.maximum(x, 10 ** 400)


# --- comparisons: C primitives (bools), also the Array's < <= == != > >= --------------------

_CMP = {"less": np.less, "less_equal": np.less_equal, "equal": np.equal,
        "not_equal": np.not_equal, "greater": np.greater, "greater_equal": np.greater_equal}
_CMP_OPS = {"less": lambda x, y: x < y, "less_equal": lambda x, y: x <= y,
            "equal": lambda x, y: x == y, "not_equal": lambda x, y: x != y,
            "greater": lambda x, y: x > y, "greater_equal": lambda x, y: x >= y}


@pytest.mark.parametrize("name", sorted(_CMP))
def test_comparisons_on_the_c_path_are_numpys_and_the_python_ops(name):
    """Every comparison, as a function and as the operator, on the C path (plan hits counted)
    against numpy and against the Python op (``__wrapped__``): two Arrays of each dtype
    (broadcasting, a 2x4 mesh), and a float32 / int32 Array beside Python scalars on either
    side, including the ones the C path converts (floats, ints up to 2^24 beside float32,
    int32 ints) and those it leaves to the Python op (2^24 + 1, an int beyond int32, a float
    beside int32: jax promotes those)."""
    rng = np.random.default_rng(7)
    prim, ref, op = getattr(cnp, name), _CMP[name], _CMP_OPS[name]
    assert type(prim) is _C.Primitive and prim.nondiff
    xf = rng.standard_normal((4, 8)).astype(np.float32)
    xf[0, :4] = [np.nan, np.inf, -0.0, 0.0]
    yf = xf.copy()
    yf[1] = rng.standard_normal(8).astype(np.float32)
    arrays = [(xf, yf), (xf, yf[0]), (rng.integers(-3, 3, (4, 8)).astype(np.int32),
                                       rng.integers(-3, 3, (8,)).astype(np.int32)),
              (rng.integers(0, 2, (4, 8)).astype(bool), rng.integers(0, 2, (4, 8)).astype(bool)),
              (xf.astype(cnp.bfloat16), yf.astype(cnp.bfloat16)),
              (rng.integers(0, 255, (4, 8)).astype(np.uint8), rng.integers(0, 255, (4, 8)).astype(np.uint8))]
    before = prim.cache_info()["hits"]
    for xn, yn in arrays:
        for sh in (None, _mesh_sharding(("x", "y"))):
            x = cts.device_put(xn, sh)
            y = cts.device_put(yn, sh if yn.ndim == 2 else None)
            with np.errstate(invalid="ignore"):   # (NaN against bfloat16's NaN)
                want = ref(xn, yn)
            for got in (prim(x, y), op(x, y), prim.__wrapped__(x, y)):
                assert got.dtype == np.bool_ and got.shape == want.shape
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{xn.dtype} {sh}")
    assert prim.cache_info()["hits"] > before
    x = cts.device_put(xf)
    xi = cts.device_put(np.array([-2 ** 31, -5, 0, 7, 2 ** 31 - 1], np.int32))
    f32_scalars = [0, 3, -1, 0.5, -0.0, 1e40, float("nan"), float("inf"), 2 ** 24, -2 ** 24,
                   2 ** 24 + 1, 2 ** 40, 0.1]
    for s in f32_scalars:
        for got, want in ((op(x, s), ref(xf, np.float32(s))), (op(s, x), ref(np.float32(s), xf)),
                          (prim(x, s), ref(xf, np.float32(s)))):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=repr(s))
            assert got.dtype == np.bool_
    xin = np.asarray(xi)
    for s in (0, -5, 7, 2 ** 31 - 1, -2 ** 31, 2.5, -0.5):
        want_dt = np.float32 if isinstance(s, float) else np.int32
        for got, want in ((op(xi, s), ref(xin.astype(want_dt), want_dt(s))),
                          (op(s, xi), ref(want_dt(s), xin.astype(want_dt)))):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=repr(s))
    with pytest.raises(OverflowError):   # jax raises for a Python int beyond int32
        op(xi, 2 ** 31)


def test_comparison_operators_of_other_types():
    """The Array's comparison slot: numpy arrays and scalars compare (the Python op lifts
    them); any other type gets NotImplemented (== / != then compare identities, < raises),
    and Arrays hash by identity."""
    x = cts.device_put(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(x < np.float32(2)), [True, True, False, False])
    np.testing.assert_array_equal(np.asarray(x == np.array([0, 9, 2, 9], np.float32)),
                                  [True, False, True, False])
    np.testing.assert_array_equal(np.asarray(x >= True), [False, True, True, True])
    assert (x == "a") is False and (x != None) is True  # noqa: E711
    assert x.__eq__("a") is NotImplemented
    with pytest.raises(TypeError):
        x < "a"  # noqa: B015
    assert hash(x) == object.__hash__(x) and {x: 1}[x] == 1


def test_comparisons_are_not_recorded_and_run_in_c_under_a_tape():
    """Inside value_and_grad a comparison runs from its plan (nondiff: the tape is not
    read), records nothing, and the gradient of a where over it (whose picks record their
    nodes from C) is the expected one."""
    w = cts.device_put(np.linspace(-1, 1, 16, dtype=np.float32))
    before = cnp.greater.cache_info()
    picks = _ops._pick.cache_info()   # where's select: two picks, from their C plans too

    def loss(v):
        m = v > 0.25
        assert m.dtype == np.bool_
        return cnp.sum(cnp.where(m, v * v, 3.0 * v))

    val, g = cts.value_and_grad(loss)(w)
    after = cnp.greater.cache_info()
    assert after["hits"] + after["misses"] > before["hits"] + before["misses"]
    assert _ops._pick.cache_info()["hits"] + _ops._pick.cache_info()["misses"] > \
        picks["hits"] + picks["misses"]
    wn = np.asarray(w)
    np.testing.assert_allclose(np.asarray(g), np.where(wn > 0.25, 2 * wn, 3.0), rtol=1e-6)
    np.testing.assert_allclose(float(val), np.sum(np.where(wn > 0.25, wn * wn, 3 * wn)),
                               rtol=1e-5)


def test_comparison_with_a_scalar_inside_jit_is_the_python_ops_node():
    """Under a jit trace a comparison with a Python scalar runs the Python op (a recorded
    program keeps no scalar); the jitted function gives the eager values, for new inputs
    too."""
    f = cts.jit(lambda v, u: cnp.where(v > 0.5, v, u) + (u >= v))
    rng = np.random.default_rng(3)
    for _ in range(3):
        vn, un = rng.standard_normal((2, 8)).astype(np.float32)
        v, u = cts.device_put(vn), cts.device_put(un)
        want = np.where(vn > 0.5, vn, un) + (un >= vn)
        np.testing.assert_array_equal(np.asarray(f(v, u)), want)


_BITS = {"bitwise_and": (np.bitwise_and, lambda x, y: x & y),
         "bitwise_or": (np.bitwise_or, lambda x, y: x | y),
         "bitwise_xor": (np.bitwise_xor, lambda x, y: x ^ y),
         "logical_and": (np.logical_and, None), "logical_or": (np.logical_or, None),
         "logical_xor": (np.logical_xor, None)}


@pytest.mark.parametrize("name", sorted(_BITS))
def test_bitwise_and_logical_ops_on_the_c_path(name):
    """& | ^ (and the functions) of two int / bool Arrays of one dtype, and the logical ops of
    two bool Arrays, run from C plans (hits counted) with numpy's values and the Python
    op's, broadcasting and on a 2x4 mesh; the other operands take the Python op (which
    refuses floats for the bitwise ops, converts ints to bools for the logical ones)."""
    rng = np.random.default_rng(11)
    prim, (ref, op) = getattr(cnp, name), _BITS[name]
    assert type(prim) is _C.Primitive and prim.nondiff
    logical = name.startswith("logical")
    pairs = [(rng.integers(0, 2, (4, 8)).astype(bool), rng.integers(0, 2, (8,)).astype(bool))]
    if not logical:
        pairs += [(rng.integers(-9, 9, (4, 8)).astype(np.int32),
                   rng.integers(-9, 9, (4, 8)).astype(np.int32)),
                  (rng.integers(0, 255, (4, 8)).astype(np.uint8),
                   rng.integers(0, 255, (8,)).astype(np.uint8))]
    before = prim.cache_info()["hits"]
    for xn, yn in pairs:
        for sh in (None, _mesh_sharding(("x", "y"))):
            x = cts.device_put(xn, sh)
            y = cts.device_put(yn, sh if yn.ndim == 2 else None)
            outs = [prim(x, y), prim(x, y), prim.__wrapped__(x, y)] + (
                [op(x, y), op(y, x)] if op else [])
            for got in outs:
                assert got.dtype == ref(xn, yn).dtype
                np.testing.assert_array_equal(np.asarray(got), ref(xn, yn))
    assert prim.cache_info()["hits"] > before
    xi = cts.device_put(np.array([0, 3, -2], np.int32))
    if logical:   # ints as bools: the Python op
        np.testing.assert_array_equal(np.asarray(prim(xi, xi > 0)), ref([0, 3, -2], [0, 1, 0]))
    else:
        with pytest.raises(TypeError, match="does not accept dtype float32"):
            prim(cts.device_put(np.ones(3, np.float32)), xi)
        np.testing.assert_array_equal(np.asarray(prim(xi, 6)), ref(np.array([0, 3, -2]), 6))


def test_invert_and_logical_not_on_the_c_path():
    """~ / invert of int and bool Arrays, logical_not of bool ones: C plans (one kernel,
    unary), numpy's values; a float Array: invert refuses, logical_not is ``x == 0``."""
    rng = np.random.default_rng(2)
    for xn in (rng.integers(-9, 9, (4, 8)).astype(np.int32), rng.integers(0, 2, (4, 8)).astype(bool),
               rng.integers(0, 255, (4, 8)).astype(np.uint8)):
        for sh in (None, _mesh_sharding(("x", "y"))):
            x = cts.device_put(xn, sh)
            before = cnp.invert.cache_info()["hits"]
            for got in (~x, ~x, cnp.invert(x), cnp.bitwise_not(x)):
                assert got.dtype == xn.dtype and got.sharding == x.sharding
                np.testing.assert_array_equal(np.asarray(got), np.invert(xn))
            assert cnp.invert.cache_info()["hits"] > before
            if xn.dtype == bool:
                np.testing.assert_array_equal(np.asarray(cnp.logical_not(x)), ~xn)
    assert cnp.invert.nondiff and cnp.logical_not.nondiff
    with pytest.raises(TypeError, match="does not accept dtype float32"):
        ~cts.device_put(np.ones(3, np.float32))
    np.testing.assert_array_equal(
        np.asarray(cnp.logical_not(cts.device_put(np.array([0.0, 2.0, np.nan], np.float32)))),
        [True, False, False])


@pytest.mark.parametrize("mesh", [False, True])
def test_where_runs_its_picks_from_c_plans_with_the_python_ops_bits(monkeypatch, mesh):
    """where's select (two picks and an add) on the C path: numpy's where bit for bit (a -0.0,
    an inf, a NaN in either branch; Python numbers as branches; broadcasting), and under
    value_and_grad the value and gradients of the Python picks (their own tape records)."""
    sh = _mesh_sharding(("x", "y")) if mesh else None
    xn = np.array([[1.0, -0.0, 0.0, np.inf], [np.nan, -2.0, 3.0, -np.inf]] * 4, np.float32)
    yn = np.array([0.5, -0.0, np.nan, 2.0], np.float32)
    x = cts.device_put(xn, sh)
    y = cts.device_put(yn)
    m = x > 0.5
    mn = np.asarray(m)
    before = _ops._pick.cache_info()["hits"]
    for args, want in (((m, x, y), np.where(mn, xn, yn)), ((m, x, 0.0), np.where(mn, xn, 0.0)),
                       ((m, -0.0, x), np.where(mn, -0.0, xn)), ((m, 2, y), np.where(mn, 2.0, yn)),
                       ((m, x, -1e9), np.where(mn, xn, np.float32(-1e9)))):
        for _ in range(2):
            got = cnp.where(*args)
            assert got.dtype == np.float32
            assert np.asarray(got).tobytes() == want.astype(np.float32).tobytes()
    assert _ops._pick.cache_info()["hits"] > before

    def loss(a, b):
        return cnp.sum(cnp.where(a > 0.5, a * b, -1.5) + cnp.where(b < 1.0, 0.25, a))

    rng = np.random.default_rng(4)
    an = rng.standard_normal((8, 4)).astype(np.float32)
    a, b = cts.device_put(an, sh), cts.device_put(rng.standard_normal(4).astype(np.float32))
    v1, g1 = cts.value_and_grad(loss, argnums=(0, 1))(a, b)
    monkeypatch.setattr(_ops, "_pick", _ops._pick.__wrapped__)   # the Python picks
    v2, g2 = cts.value_and_grad(loss, argnums=(0, 1))(a, b)
    assert _bits(v1) == _bits(v2)
    for p, q in zip(g1, g2):
        _same(p, q)
    assert np.abs(np.asarray(g1[0])).sum() > 0 and np.abs(np.asarray(g1[1])).sum() > 0


def _called(fn):
    """(fn(), the names of the Python functions its call entered, in order)."""
    names = []

    def prof(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, names


def _fast_path(op):
    """The float32 fast path (ops._fast_f32) inside public op ``op``, under its primitive,
    op-node and power wrappers."""
    f = op
    while getattr(getattr(f, "__code__", None), "co_name", None) != "fast":
        f = f.__wrapped__
    return f


def _fast_cases(name, x, y, m, ids):
    """Calls of op ``name`` whose operands each of its three wrappers passes through."""
    if name == "where":
        return [(m, x, y), (m, x, 0.5), (m, 2.0, y), (m, x, 0), (m, 1, 0.5),
                (np.asarray(m), x, y)]
    if name == "take_rows":
        return [(x, ids)]
    if name == "broadcast_to":
        return [(x, (3, 4, 4)), (2.5, (3,))]
    if name in ("sum", "max", "min", "mean"):
        return [(x,), (x, 0), (x, (0, 1)), (x, None, True)]
    if name == "matmul":
        return [(x, y)]
    if name in _ops._POLICY_BINARY:
        return [(x, y), (x, 2.0), (3, y), (1.5, 2)]
    return [(x,), (-0.75,)]


def test_the_float32_fast_path_of_every_wrapped_op_passes_only_what_its_wrappers_pass():
    """Each op under the 16-bit dtype policy, integer dispatch and abstract-value wrappers
    calls its float32 implementation straight away when every data operand is a float32
    Array or a Python number, the other positional operands are not ShapeDtypeStructs
    (where's condition, take_rows' ids, an axis) and the keywords are plain: no wrapper's
    frame runs before it, and the result is the wrapped op's bit for bit. Operands that a
    wrapper acts on still reach it: integer results of Python ints alone (where,
    broadcast_to, positional or by keyword), integer and 16-bit Arrays, ShapeDtypeStructs."""
    rng = np.random.default_rng(11)
    x = cts.device_put(rng.standard_normal((4, 4)).astype(np.float32))
    y = cts.device_put(np.abs(rng.standard_normal((4, 4))).astype(np.float32) + 0.5)
    m = x > 0.25
    ids = cts.device_put(np.array([3, 0, 3], np.int32))
    assert set(_ops._F32_IMPL) >= {"where", "take_rows", "add", "sum", "broadcast_to"}
    for name, impl in _ops._F32_IMPL.items():
        inner = impl.__code__.co_name
        fast = _fast_path(getattr(_ops, name))
        for args in _fast_cases(name, x, y, m, ids):
            got, names = _called(lambda: fast(*args))
            assert names[1:3] == ["fast", inner], (name, args, names)
            want = fast.__wrapped__(*args)      # the three wrappers, then the same op
            assert _bits(got) == _bits(want), (name, args)
        kw = {"sum": ((x,), {"axis": 1, "keepdims": True}), "mean": ((x,), {"axis": (0, 1)}),
              "where": ((m, x), {"y": 0})}.get(name)
        if kw:
            got, names = _called(lambda: fast(*kw[0], **kw[1]))
            assert names[1:3] == ["fast", inner]
            assert _bits(got) == _bits(fast.__wrapped__(*kw[0], **kw[1]))
    # what the wrappers act on still reaches them
    where, bcast = _fast_path(_ops.where), _fast_path(_ops.broadcast_to)
    xi = cts.device_put(np.array([[1, -2], [3, 4]], np.int32))
    xb = x.astype(cnp.bfloat16)
    sds = cts.ShapeDtypeStruct((4, 4), np.float32)
    for fn, args, kwargs, dtype in (
            (where, (m, 1, 0), {}, np.int32), (where, (m,), {"x": 1, "y": 0}, np.int32),
            (where, (m, xb, xb), {}, cnp.bfloat16),
            (bcast, (1, (3,)), {}, np.int32), (bcast, (1,), {"shape": (3,)}, np.int32),
            (bcast, (True, (2,)), {}, np.bool_),
            (_fast_path(_ops.add), (xi, xi), {}, np.int32),
            (_fast_path(_ops.sin), (xb,), {}, cnp.bfloat16)):
        got, names = _called(lambda: fn(*args, **kwargs))
        assert names[1:3] == ["fast", "wrapped"], (fn, args, names)
        assert got.dtype == dtype and _bits(got) == _bits(fn.__wrapped__(*args, **kwargs))
    for fn, args in ((where, (sds, x, y)), (where, (m, sds, 0.0)),
                     (_fast_path(_ops.sum), (sds,))):
        got = fn(*args)
        assert type(got) is cts.ShapeDtypeStruct and got.dtype == np.float32, (fn, args)
    # ctrainstate.numpy.where is the op's (its fast path included)
    got, names = _called(lambda: cnp.where(m, x, -0.0))
    assert names[1:5] == ["where", "_o", "fast", "where"] and "wrapped" not in names
    assert _bits(got) == _bits(where.__wrapped__(m, x, -0.0))


@pytest.mark.parametrize("mesh", [False, True])
def test_matrix_times_vector_runs_the_2d_products_plan_with_the_python_ops_bits(mesh):
    """``a @ v`` with a 1-d ``v`` (and precision=None) is the (K, 1) product's primitive,
    reshaped, ``v @ a`` the (1, K) one's (the Python product ``_matmul`` does not run):
    values, gradients (value_and_grad) and, under default_matmul_precision, the thread's
    precision are the Python product's bit for bit; a mismatch names the operands' shapes."""
    rng = np.random.default_rng(7)

    def slow(x, y, prec=None):   # the vector as a matrix through the Python product
        prec = _ops._resolve_precision(None, "matmul") if prec is None else prec
        if x.ndim == 1:
            return _ops.reshape(_ops._matmul(_ops.reshape(x, (1, x.shape[0])), y, False, False,
                                             prec), y.shape[:-2] + (y.shape[-1],))
        return _ops.reshape(_ops._matmul(x, _ops.reshape(y, (y.shape[0], 1)), False, False,
                                         prec), x.shape[:-1])

    sh = _mesh_sharding(("x", None)) if mesh else None
    cases = [(rng.standard_normal((8, 16)).astype(np.float32), (16,)),
             (rng.standard_normal((2, 4, 5)).astype(np.float32), (5,))]
    for an, vshape in cases[:1]:   # v @ a: the vector first (a's columns sharded)
        a = cts.device_put(an, _mesh_sharding((None, "x")) if mesh else None)
        v = cts.device_put(rng.standard_normal(an.shape[0]).astype(np.float32),
                           _mesh_sharding((None,)) if mesh else None)
        w = cts.device_put(rng.standard_normal(an.shape[1]).astype(np.float32))
        want = slow(v, a)
        got, names = _called(lambda: v @ a)
        _same(got, want)
        assert "_matmul" not in names, names
        _same(cnp.matmul(v, a), want)
        v1, g1 = cts.value_and_grad(lambda x, y: cnp.sum((x @ y) * w), argnums=(0, 1))(v, a)
        v2, g2 = cts.value_and_grad(lambda x, y: cnp.sum(slow(x, y, 0) * w),
                                    argnums=(0, 1))(v, a)
        assert _bits(v1) == _bits(v2)
        for p, q in zip(g1, g2):
            _same(p, q)
    for an, vshape in cases:
        a = cts.device_put(an, sh if an.ndim == 2 else None)
        v = cts.device_put(rng.standard_normal(vshape).astype(np.float32),
                           _mesh_sharding((None,)) if mesh and an.ndim == 2 else None)
        w = cts.device_put(rng.standard_normal(an.shape[:-1]).astype(np.float32))
        _same(a @ v, slow(a, v))
        _same(cnp.matmul(a, v), slow(a, v))
        with cts.default_matmul_precision("bfloat16"):
            _same(a @ v, slow(a, v))
            assert _bits(a @ v) != _bits(slow(a, v, 0))   # (bfloat16 applied)

        def loss(x, y):
            return cnp.sum((x @ y) * w)

        v1, g1 = cts.value_and_grad(loss, argnums=(0, 1))(a, v)
        names = _called(lambda: a @ v)[1]
        assert "_matmul" not in names, names
        # the Python product's own path for the vector (reshapes and _matmul's node)
        v2, g2 = cts.value_and_grad(lambda x, y: cnp.sum(slow(x, y) * w), argnums=(0, 1))(a, v)
        assert _bits(v1) == _bits(v2)
        for p, q in zip(g1, g2):
            _same(p, q)
    a0, bad = cts.device_put(cases[0][0]), cts.device_put(np.ones(15, np.float32))
    for x, y in ((a0, bad), (bad, a0.T)):
        with pytest.raises(ValueError, match=r"contracting dimensions differ: "
                           + re.escape(f"{x.shape} @ {y.shape}")):
            x @ y
        with pytest.raises(ValueError, match=re.escape(f"{x.shape} @ {y.shape}")):
            _ops._matmul_nd(x, y, 1)

# --- the plan caches' size ---------------------------------------------------------------------
# A primitive keeps its plans in a fixed cache of entries; an entry's per-block arrays (device,
# start, replica of each block, the all-reduce groups) are sized for the plan's blocks, not for
# the largest device count (4096): sized for that, each Primitive would be megabytes of zeroed
# memory touched at import, and each step of a jit trace would copy an entry of that size.

def test_a_primitive_does_not_embed_arrays_for_every_possible_device():
    assert type(cnp.add) is _C.Primitive
    # 32 entries of a few hundred bytes (4096 devices' arrays inline: 5.8 MB)
    assert _C.Primitive.__basicsize__ < 64 * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.skipif(os.environ.get("CTRAINSTATE_SANITIZED") == "1",
                    reason="ASan's shadow memory and quarantine change the process's RSS")
def test_importing_the_package_takes_little_memory():
    code = (
        "import numpy\n"
        "def rss():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmRSS:'):\n"
        "            return int(line.split()[1]) // 1024\n"
        "before = rss()\n"
        "import ctrainstate, ctrainstate.numpy as cnp, ctrainstate.nn\n"
        "print(rss() - before)\n")
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    grown = int(r.stdout.split()[-1])
    # (about 20 MB on x86-64 Linux; per-device arrays in every cache entry: over 300 MB)
    assert grown < 100, f"import ctrainstate grew the RSS by {grown} MB"


def test_plans_on_meshes_and_their_jit_copies_run_after_the_cache_turns_over():
    # more distinct shapes than a primitive's 32 cache entries, on a mesh (blocks, replicas)
    # and under jit (each traced step owns a copy of its entry's per-block arrays): entries
    # are replaced and freed while traced copies stay in use
    mesh = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("data", "model"))
    sh = cts.NamedSharding(mesh, cts.PartitionSpec("data", None))

    @cts.jit
    def f(x, y):
        return cnp.tanh(x * y + x) - y

    outs = []
    for n in range(1, 41):
        x = cts.device_put(np.linspace(-1, 1, 2 * n * 3, dtype=np.float32).reshape(2 * n, 3), sh)
        y = cts.device_put(np.full((2 * n, 3), 0.5, np.float32), sh)
        outs.append((f(x, y), np.tanh(np.asarray(x) * 0.5 + np.asarray(x)) - 0.5))
        outs.append((f(x, y), np.tanh(np.asarray(x) * 0.5 + np.asarray(x)) - 0.5))
    for got, want in outs:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
