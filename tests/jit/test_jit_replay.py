"""jit's traced programs (_C.Program, csrc/python/py_dispatch.c): a function's primitive calls
recorded at the first call of a signature and replayed from C, with eager's bits; anything
else runs eagerly."""
import gc
import threading
import weakref

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C
from call_counts import python_calls


def _mesh():
    return cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))


def _mlp_params(rng, sh=None):
    shapes = [(2, 16), (16, 16), (16, 3)]
    put = lambda a, spec: cts.device_put(a, None if sh is None else cts.NamedSharding(sh, cts.P(*spec)))
    # column-parallel, row-parallel (a K all-reduce), replicated
    specs = [((None, "y"), ("y",)), (("y", None), (None,)), ((None, None), (None,))]
    return {f"l{i}": {"w": put(rng.standard_normal(s).astype(np.float32) * 0.5, specs[i][0]),
                      "b": put(rng.standard_normal(s[1:]).astype(np.float32) * 0.1, specs[i][1])}
            for i, s in enumerate(shapes)}


def _loss(p, x, t):
    h = x
    for i in range(3):
        y = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        h = y if i == 2 else cnp.sin(y * 3.0)
    return cnp.mean(cnp.square(h - t))


def _bits(tree):
    return [np.asarray(a).tobytes() for a in cts.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_a_replayed_value_and_grad_gives_the_eager_bits(where):
    rng = np.random.default_rng(0)
    mesh = None if where == "one device" else _mesh()
    p = _mlp_params(rng, mesh)
    put = lambda a: cts.device_put(a, None if mesh is None else cts.NamedSharding(mesh, cts.P("x")))
    x = put(rng.standard_normal((16, 2)).astype(np.float32))
    t = put(rng.standard_normal((16, 3)).astype(np.float32))
    vg = cts.value_and_grad(_loss)
    jvg = cts.jit(vg)
    eager = vg(p, x, t)
    first = jvg(p, x, t)      # traced (and run)
    again = jvg(p, x, t)      # replayed
    assert jvg._programs.traces == 1
    assert _bits(first) == _bits(eager) == _bits(again)
    for a, b in zip(cts.tree_util.tree_leaves(again[1]), cts.tree_util.tree_leaves(p)):
        assert a.sharding == b.sharding
    # new argument values replay the same program
    p2 = cts.tree_util.tree_map(lambda a: a * 2.0, p)
    assert _bits(jvg(p2, x, t)) == _bits(vg(p2, x, t)) and jvg._programs.traces == 1
    text = jvg.lower(p, x, t).as_text()
    assert "matmul" in text and "sin" in text and "not replayable" not in text


def test_a_replay_makes_a_few_python_calls_whatever_the_number_of_ops():
    x = cts.device_put(np.float32([0.5, 1.0, 1.5]))

    def chain(n):
        def f(x):
            for _ in range(n):
                x = cnp.sin(x) * 1.5 + 0.25
            return x
        return cts.jit(f)
    counts = []
    for n in (4, 64):
        f = chain(n)
        f(x)
        f(x)
        counts.append(python_calls(lambda: f(x)))
    assert counts[0] == counts[1] and counts[0] <= 20, counts


def test_new_shapes_dtypes_shardings_and_static_values_retrace():
    f = cts.jit(lambda x, k: cnp.sum(x * float(k)), static_argnums=1)
    a = cts.device_put(np.ones(4, np.float32))
    f(a, 2)
    f(a + 1.0, 2)
    assert f._programs.traces == 1
    f(cts.device_put(np.ones(5, np.float32)), 2)                       # shape
    f(a, 3)                                                             # static value
    f(cts.device_put(np.ones(4, np.float32), cts.NamedSharding(_mesh(), cts.P("y"))), 2)
    assert f._programs.traces == 4
    assert float(f(a, 3)) == 12.0 and float(f(a, 2)) == 8.0 and f._programs.traces == 4
    g = cts.jit(lambda x, s: x * s)                                    # a Python scalar argument
    np.testing.assert_array_equal(np.asarray(g(a, 2.0)), 2.0)
    np.testing.assert_array_equal(np.asarray(g(a, 3.0)), 3.0)          # its value is in the key
    assert g._programs.traces == 2


def test_a_host_read_of_a_traced_value_raises_as_in_jax():
    """float(), int(), bool() / `if`, np.asarray() and a Python loop count of a traced value
    raise ConcretizationTypeError (a TypeError) naming the fix, at every call (nothing
    half-traced is kept); the same function with the value static, or reading a constant it
    closes over, runs."""
    calls = []
    x = cts.device_put(np.float32([1.0, 2.0]))
    const = cts.device_put(np.float32(3.0))

    def host_float(x):
        calls.append(1)
        return cnp.sum(x) * float(cnp.sum(x))
    reads = [host_float,
             lambda x: x * 2.0 if cnp.sum(x) > 0 else x,                   # bool()
             lambda x: x * int(cnp.sum(x)),
             lambda x: x + np.asarray(x),
             lambda x: x * len(range(cnp.sum(x).astype(np.int32)))]       # __index__
    for fn in reads:
        f = cts.jit(fn)
        for _ in range(2):
            with pytest.raises(cts.errors.ConcretizationTypeError,
                               match=r"host read.*traced by jit.*static_argnums"):
                f(x)
        assert f._programs.traces == 0 or all(
            e[0].broken is not None for es in f._programs._cache.values() for e in es)
    assert len(calls) == 2
    assert isinstance(cts.errors.ConcretizationTypeError("x"), TypeError)
    # a value closed over (a constant of the program) may be read; a static argument too
    g = cts.jit(lambda x: x * float(const))
    assert np.asarray(g(x)).tolist() == [3.0, 6.0] and "not replayable" not in g.lower(x).as_text()
    s = cts.jit(lambda x, k: x * float(k), static_argnums=1)
    assert np.asarray(s(x, 2)).tolist() == [2.0, 4.0]

    g = cts.jit(lambda x: cnp.cumsum(x) * 2.0)          # an op without a C plan: a node
    np.testing.assert_array_equal(np.asarray(g(x)), [2.0, 6.0])
    np.testing.assert_array_equal(np.asarray(g(x * 2.0)), [4.0, 12.0])
    assert "cumsum[op node]" in g.lower(x).as_text() and g._programs.traces == 1

    h = cts.jit(lambda a: cnp.sum(a))                   # numpy arguments are placed and replay
    assert float(h(np.float32([1.0, 2.0]))) == 3.0
    assert float(h(np.float32([3.0, 2.0]))) == 5.0 and h._programs.traces == 1
    assert "sum" in h.lower(np.float32([1.0, 0.0])).as_text()
    k = cts.jit(lambda a: a)                            # other host objects run eagerly
    assert k([1, 2]) is not None and "list" not in k.lower(np.float32([1.0])).as_text()
    assert "Fraction" in k.lower(__import__("fractions").Fraction(1, 2)).as_text()


def test_side_effects_happen_when_tracing_only():
    seen = []

    def f(x):
        seen.append(x.shape)
        return x * 2.0
    j = cts.jit(f)
    x = cts.device_put(np.ones(3, np.float32))
    j(x)
    j(x)
    j(x)
    assert seen == [(3,)]


def test_nested_jit_inlines_and_grad_of_jit_differentiates():
    inner = cts.jit(lambda x: cnp.sin(x) * 2.0)
    outer = cts.jit(lambda x: cnp.sum(inner(x) + x))
    x = cts.device_put(np.float32([0.5, 1.0]))
    for _ in range(3):
        v = outer(x)
    assert outer._programs.traces == 1 and inner._programs.traces == 0
    np.testing.assert_allclose(float(v), np.sum(2 * np.sin([0.5, 1.0]) + [0.5, 1.0]), rtol=1e-6)
    f = cts.jit(lambda x: cnp.sum(cnp.sin(x)))
    f(x)
    f(x)
    for _ in range(2):   # a recording tape outside: the ops run (and record), not the replay
        np.testing.assert_allclose(np.asarray(cts.grad(f)(x)), np.cos([0.5, 1.0]), rtol=1e-6)


def test_constants_and_outputs():
    w = cts.device_put(np.float32([1.0, 2.0]))
    f = cts.jit(lambda x: (x * w, w, 3.0, None))
    x = cts.device_put(np.float32([2.0, 2.0]))
    f(x)
    a = f(x)
    b = f(x)
    np.testing.assert_array_equal(np.asarray(a[0]), [2.0, 4.0])
    assert a[1] is not w and a[1] is not b[1]          # a constant output comes back as a copy
    np.testing.assert_array_equal(np.asarray(b[1]), [1.0, 2.0])
    assert type(a[2]) is cts.Array and float(a[2]) == 3.0 and a[3] is None
    a[1]._moved()                                       # giving an output away
    np.testing.assert_array_equal(np.asarray(f(x)[1]), [1.0, 2.0])
    w._moved()                                          # a constant donated since the trace
    with pytest.raises(cts.DonatedBufferError):
        f(x)


def test_a_donated_argument_raises_as_eagerly():
    f = cts.jit(lambda x: x + 1.0)
    x = cts.device_put(np.float32([1.0]))
    f(x)
    f(x)
    x._moved()
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        f(x)


def test_unrequested_cotangents_are_not_computed():
    w = cts.device_put(np.ones((4, 3), np.float32))
    x = cts.device_put(np.ones((5, 4), np.float32))
    g = cts.jit(cts.grad(lambda w, x: cnp.sum(x @ w)))   # the gradient of w only
    text = g.lower(w, x).as_text()
    assert "_matmul_tn" in text and "_matmul_nt" not in text, text


def test_program_binding_errors():
    p = _C.Program()
    x = cts.device_put(np.float32([1.0]))
    with pytest.raises(TypeError):
        _C.trace_begin(p, [1.0])
    with pytest.raises(RuntimeError, match="record it first"):
        p.finish([])
    with pytest.raises(RuntimeError, match="not finished"):
        p.run([x])
    q = _C.Program()
    _C.trace_begin(q, [x])
    try:
        assert _C.trace_active()
        with pytest.raises(RuntimeError, match="already recording"):
            _C.trace_begin(_C.Program(), [x])
        y = x * 2.0
    finally:
        _C.trace_end()
    assert not _C.trace_active()
    q.finish([y])
    with pytest.raises(RuntimeError, match="record it first"):
        q.finish([y])
    with pytest.raises(RuntimeError, match="recorded before"):
        _C.trace_begin(q, [x])
    assert q.run([cts.device_put(np.float32([1.0, 2.0]))]) is None   # another shape
    np.testing.assert_array_equal(np.asarray(q.run([x + 1.0])[0]), [4.0])
    assert q.nsteps == 1 and q.broken is None


def test_another_thread_tracing_makes_this_call_eager():
    started, release = threading.Event(), threading.Event()

    def slow(x):
        started.set()
        release.wait(10)
        return x * 2.0
    f = cts.jit(slow)
    g = cts.jit(lambda x: x + 1.0)
    x = cts.device_put(np.float32([1.0]))
    t = threading.Thread(target=lambda: f(x))
    t.start()
    try:
        assert started.wait(10)
        np.testing.assert_array_equal(np.asarray(g(x)), [2.0])    # ran eagerly, not traced
        assert g._programs.traces == 0
    finally:
        release.set()
        t.join(10)
    assert f._programs.traces == 1


def test_donating_or_deleting_a_traced_value_is_not_replayed():
    x = cts.device_put(np.float32([1.0, 2.0]))
    f = cts.jit(lambda a: (a * 2.0)._moved())
    np.testing.assert_array_equal(np.asarray(f(x)), [2.0, 4.0])
    assert "donating" in f.lower(x).as_text()

    def drop(a):
        y = a * 2.0
        z = y + 1.0
        y.delete()
        return z
    g = cts.jit(drop)
    np.testing.assert_array_equal(np.asarray(g(x)), [3.0, 5.0])
    assert "deleting" in g.lower(x).as_text()


def test_a_trace_keeps_its_values_alive_until_it_ends():
    """A Buffer made during the trace (a constant from the host) could take the address of a
    freed intermediate's and be mistaken for it: the trace keeps every value alive until it
    ends, and lets them go then."""
    refs = []

    def f(x):
        y = x * 2.0
        refs.append(weakref.ref(y))
        del y
        gc.collect()
        refs.append(refs[0]() is not None)       # alive inside the trace
        c = cts.device_put(np.float32([5.0, 5.0]))
        return x + c
    j = cts.jit(f)
    x = cts.device_put(np.float32([1.0, 2.0]))
    np.testing.assert_array_equal(np.asarray(j(x)), [6.0, 7.0])
    gc.collect()
    assert refs[1] is True and refs[0]() is None  # kept while tracing, released after
    np.testing.assert_array_equal(np.asarray(j(x * 3.0)), [8.0, 11.0])
    assert j._programs.traces == 1


def test_control_flow_and_debug_prints_on_traced_values_run_eagerly(capsys):
    """lax.cond / switch / while_loop / fori_loop on a traced value, and debug.print of one,
    read it on purpose: the function is not replayed (as_text says why) and runs eagerly at
    every call, with the right branch and a print per call; a host read after them is a read
    of a concrete value."""
    from ctrainstate import lax
    x = cts.device_put(np.float32([1.0, -2.0]))
    fns = {
        "cond": lambda x: lax.cond(cnp.sum(x) > 0, lambda v: v * 2.0, lambda v: v - 1.0, x),
        "switch": lambda x: lax.switch((cnp.sum(x) > 0).astype(np.int32),
                                       [lambda v: v - 1.0, lambda v: v * 2.0], x),
        "while_loop": lambda x: lax.while_loop(lambda v: cnp.sum(v) < 10.0, lambda v: v + 4.0, x),
        "fori_loop": lambda x: lax.fori_loop(0, (cnp.sum(x) > 0).astype(np.int32) + 1,
                                             lambda i, v: v * 2.0, x),
    }
    want = {"cond": (lambda v: v * 2 if v.sum() > 0 else v - 1),
            "switch": (lambda v: v * 2 if v.sum() > 0 else v - 1),
            "while_loop": (lambda v: v + 4 * max(0, int(np.ceil((10 - v.sum()) / 8)))),
            "fori_loop": (lambda v: v * (4 if v.sum() > 0 else 2))}
    for name, fn in fns.items():
        f = cts.jit(fn)
        for v in (np.float32([1.0, -2.0]), np.float32([3.0, 1.0])):
            np.testing.assert_array_equal(np.asarray(f(cts.device_put(v))), want[name](v))
        assert f"lax.{name} on a traced value" in f.lower(x).as_text(), name

    def show(x):
        cts.debug.print("sum {}", cnp.sum(x))
        return x * float(cnp.sum(x))            # after the print: a concrete value
    g = cts.jit(show)
    g(x)
    g(x * 2.0)
    assert capsys.readouterr().out.split() == ["sum", "-1.0", "sum", "-2.0"]
    assert "debug.print" in g.lower(x).as_text()


def test_cpu_programs_have_no_cuda_graphs():
    """CUDA graphs are for runs of GPU steps (tests/gpu): a program on CPU devices has none,
    and set_graphs switches the setting either way with the same bits."""
    x = cts.device_put(np.linspace(-1, 1, 48, dtype=np.float32).reshape(6, 8))
    j = cts.jit(lambda a: cnp.tanh(a @ a.T) * 2.0 + 1.0)
    want = np.asarray(j(x))
    low = j.lower(x).compile()
    assert low.graph_stats() == [] and "CUDA graph" not in low.as_text()
    prog = low._prog
    for on in (False, True):
        prog.set_graphs(on)
        assert prog.graph_stats() == []
        assert np.asarray(j(x)).tobytes() == want.tobytes()
    with pytest.raises(RuntimeError, match="not finished"):
        _C.Program().graph_stats()
