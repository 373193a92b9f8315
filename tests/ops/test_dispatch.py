"""The C dispatch of the common ops (_C.Primitive, csrc/python/py_dispatch.c): a call of a
planned kind runs without Python and gives the Python op's result bit for bit; everything
else runs the Python op."""
import math
import sys
import threading

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C
from ctrainstate._src.ops import ops as _ops

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
    cases = {"a + b": lambda: a + b, "sin(a)": lambda: cnp.sin(a), "sum(a)": lambda: cnp.sum(a),
             "bf16 add": lambda: ab + bb, "int32 add": lambda: ai + bi,
             "mesh mul": lambda: am * am, "mesh sum": lambda: cnp.sum(am),
             "2.0 * a": lambda: 2.0 * a, "1 - a": lambda: 1 - a, "-a": lambda: -a,
             "maximum": lambda: cnp.maximum(a, b), "tanh": lambda: cnp.tanh(am)}
    for name, f in cases.items():
        assert _python_calls(f) == [], name


def test_a_recording_tape_takes_the_python_op_and_gradients_stay_right():
    x = cts.device_put(np.float32([0.5, -1.0, 2.0]))

    def loss(x):
        return cnp.sum(cnp.sin(x) * x + 2.0 * x)

    before = _ops.sin.cache_info()["fallbacks"]
    v, g = cts.value_and_grad(loss)(x)
    assert _ops.sin.cache_info()["fallbacks"] > before
    h = np.float32([0.5, -1.0, 2.0])
    np.testing.assert_allclose(float(v), float(np.sum(np.sin(h) * h + 2 * h)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), np.cos(h) * h + np.sin(h) + 2, rtol=1e-6)


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
    with pytest.raises(TypeError):
        _C.dispatch_register(None, 1, 2, 3, 4, 5)
    with pytest.raises(TypeError, match="6 arguments"):
        _C.dispatch_register(None)


def test_cache_keeps_at_most_its_size_and_replans():
    x = [cts.device_put(np.ones((n,), np.float32)) for n in range(1, 12)]
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
