"""jit / pjit: keywords as jax takes them, Array outputs, the "inside jit" flag."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P
from ctrainstate._src.base import trace_state as _trace_state


def test_jit_rejects_unknown_keywords_naming_them():
    with pytest.raises(TypeError, match="out_axis_resource"):
        cts.jit(lambda x: x, out_axis_resource=P())
    with pytest.raises(TypeError, match="in_shardingz"):
        cts.pjit(lambda x: x, in_shardingz=P())


def test_jit_accepts_jax_keywords_without_effect():
    f = cts.jit(lambda x: x + 1, donate_argnums=0, donate_argnames=("x",), keep_unused=True,
                device=None, backend="cpu", inline=True, abstracted_axes=None,
                compiler_options={})
    assert np.asarray(f(np.float32([1]))).tolist() == [2.0]
    with pytest.raises(TypeError, match="donate_argnums"):
        cts.jit(lambda x: x, donate_argnums="x")
    with pytest.raises(ValueError, match="backend"):
        cts.jit(lambda x: x, backend="tpu")


def test_jit_static_argnames_are_not_placed():
    seen = []

    def f(x, n):
        seen.append(type(n))
        return x * n

    g = cts.jit(f, static_argnames="n")
    assert np.asarray(g(np.float32([1, 2]), 3)).tolist() == [3.0, 6.0]
    assert np.asarray(g(np.float32([1, 2]), n=3)).tolist() == [3.0, 6.0]
    assert seen == [int, int]
    # given positionally, a static name is passed as it is even with in_shardings
    mesh = cts.make_mesh((2,), ("x",))
    with mesh:
        h = cts.pjit(lambda x, shape: x.reshape(shape), in_shardings=P(),
                     static_argnames="shape")
        assert h(np.zeros(4, np.float32), (2, 2)).shape == (2, 2)


def test_jit_static_argnames_and_argnums_errors():
    with pytest.raises(ValueError, match="'y'"):
        cts.jit(lambda x: x, static_argnames=["y"])
    with pytest.raises(ValueError, match="static_argnums"):
        cts.jit(lambda x: x, static_argnums=5)
    with pytest.raises(TypeError, match="static_argnums"):
        cts.jit(lambda x: x, static_argnums="a")
    # as in jax: **kwargs takes any static name, *args any position, and -1 the last one
    assert cts.jit(lambda x, **kw: x + kw["n"], static_argnames="n")(1.0, n=2).tolist() == 3.0
    cts.jit(lambda x, *a: x, static_argnums=5)
    assert cts.jit(lambda x, n: x * n, static_argnums=-1)(np.float32([2]), 3).tolist() == [6.0]


def test_jit_without_function_is_a_decorator():
    @cts.jit(static_argnums=1)
    def f(x, n):
        return x * n
    assert np.asarray(f(np.float32([2]), 2)).tolist() == [4.0]


def test_jit_returns_arrays_for_host_outputs():
    out = cts.jit(lambda a: (a * 2, np.float32(3), 1.5))(np.ones(2, np.float32))
    assert all(isinstance(o, cts.Array) for o in out)
    assert out[0].block_until_ready().sharding is not None
    assert out[1].dtype == np.float32 and out[2].dtype == np.float32
    mesh = cts.make_mesh((4,), ("x",))
    with mesh:   # placed as device_put places them: replicated over the active mesh
        y = cts.jit(lambda: np.arange(4, dtype=np.float32))()
    assert isinstance(y, cts.Array) and len(y.devices()) == 4
    assert cts.jit(lambda: "text")() == "text"


def test_jit_sets_in_jit_inside_the_call_only():
    seen = []
    f = cts.jit(lambda x: seen.append(_trace_state.in_jit()) or x)
    assert not _trace_state.in_jit()
    f(np.ones(1, np.float32))
    assert seen == [True] and not _trace_state.in_jit()

    def boom(x):
        seen.append(_trace_state.in_jit())
        raise KeyError("boom")
    with pytest.raises(KeyError):
        cts.pjit(boom)(1.0)
    assert seen[-1] is True and not _trace_state.in_jit()


def test_disable_jit_runs_jitted_functions_outside_jit_scope():
    seen = []
    f = cts.jit(lambda: seen.append(_trace_state.in_jit()))
    with cts.disable_jit():
        f()
        with cts.disable_jit(False):
            f()
        f()
    f()        # the traced program replays: the function itself does not run (as jax's cache)
    cts.disable_jit()(f)()
    assert seen == [False, True, False, False]
    assert cts.config.jax_disable_jit is False
