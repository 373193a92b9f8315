"""Snippets a user ports from Flax / optax / JAX by changing imports.

Each test runs the ctrainstate version of a common snippet and checks it against the
value Flax/optax/JAX define: computed live when jax/flax/optax are installed (those
parts skip cleanly otherwise), and derived by hand (stated next to the assertion) in
every case.
"""
import numpy as np
import pytest
from conftest import flat_tree

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random


def _flax():
    return pytest.importorskip("flax.linen")


def _jax():
    return pytest.importorskip("jax")


# --- Module.init keeps no 'intermediates'; is_initializing ------------------------------------

def _sow_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            h = nn_mod.Dense(4)(x)
            self.sow("intermediates", "h", h)
            self.sow("intermediates", "init_flag", self.is_initializing())
            return h
    return M()


def test_init_does_not_keep_intermediates():
    x = np.ones((2, 3), np.float32)
    m = _sow_model(nn)
    v = m.init(random.PRNGKey(1), x)
    # Flax: init's default mutable is DenyList('intermediates')
    assert sorted(v) == ["params"]
    _, mut = m.apply(v, x, mutable=["intermediates"])
    assert len(mut["intermediates"]["h"]) == 1          # one call, one sown value
    assert mut["intermediates"]["init_flag"] == (False,)
    # explicit mutable=True keeps them, and is_initializing is True during init
    v_all = m.init(random.PRNGKey(1), x, mutable=True)
    assert v_all["intermediates"]["init_flag"] == (True,)
    _, v2 = m.init_with_output(random.PRNGKey(1), x)
    assert sorted(v2) == ["params"]
    assert m.apply(v, x, mutable=nn.DenyList("params"))[1].keys() == {"intermediates"}


def test_init_intermediates_match_flax():
    fnn = _flax()
    jax = _jax()
    x = np.ones((2, 3), np.float32)
    fv = _sow_model(fnn).init(jax.random.PRNGKey(1), x)
    cv = _sow_model(nn).init(random.PRNGKey(1), x)
    assert sorted(fv) == sorted(cv)
    _, fm = _sow_model(fnn).apply(fv, x, mutable=["intermediates"])
    _, cm = _sow_model(nn).apply(cv, x, mutable=["intermediates"])
    assert len(fm["intermediates"]["h"]) == len(cm["intermediates"]["h"])
    np.testing.assert_allclose(np.asarray(cm["intermediates"]["h"][0]),
                               np.asarray(fm["intermediates"]["h"][0]), rtol=1e-6)


# --- Arrays in a training loop: printing, formatting, comparing a loss -----------------------

def _loss_array(value=1.8136346):
    return cts.device_put(np.float32(value))


def test_scalar_array_prints_and_formats_like_its_value():
    loss = _loss_array(2.5)
    # jax: f"{loss:.4f}" -> '2.5000', str(loss) -> '2.5'
    assert f"{loss:.4f}" == "2.5000"
    assert f"{loss}" == "2.5" and str(loss) == "2.5"
    assert repr(loss).startswith("Array(2.5, dtype=float32")
    step = cts.device_put(np.int32(7))
    assert f"{step:03d}" == "007" and str(step) == "7"
    from ctrainstate.hf.cast import cast
    assert f"{cast(loss, 'bfloat16'):.1f}" == "2.5"          # 0-d bfloat16 casts and formats
    lr = cts.device_put(np.float32(0.9))                     # numpy's shortest digits, as jax
    assert str(lr) == f"{lr}" == "0.9" and repr(lr).startswith("Array(0.9, dtype=float32")
    x = cts.device_put(np.ones((2, 3), np.float32))
    assert f"{x}" == str(x) == "[[1. 1. 1.]\n [1. 1. 1.]]"   # jax: format(ndarray, "")
    with pytest.raises(TypeError, match="np.asarray"):
        f"{x:.2f}"


_BF16_VALUES = (0.1, 1.0, 12345.0, 1e10, 2.5e-8, -0.0, 1 / 3)


def test_scalar_bfloat16_prints_like_jax():
    from ctrainstate.hf.cast import cast
    # derived: jax prints a bfloat16 scalar as ml_dtypes does, with 6 significant digits
    # (%g): bfloat16(0.1) = 0.10009765625 -> 0.100098; 12345 rounds to 12352
    want = ["0.100098", "1", "12352", "9.99922e+09", "2.50293e-08", "-0", "0.333984"]
    got = [str(cast(cts.device_put(np.float32(v)), "bfloat16")) for v in _BF16_VALUES]
    assert got == want
    b = cast(cts.device_put(np.float32(0.1)), "bfloat16")
    assert repr(b) == "Array(0.100098, dtype=bfloat16)"
    assert f"{b}" == "0.100098" and f"{b:.3f}" == "0.100"
    assert str(cast(cts.device_put(np.float32(0.1)), "float16")) == "0.1"


def test_scalar_bfloat16_prints_match_jax():
    jnp = _jax().numpy
    from ctrainstate.hf.cast import cast
    for v in _BF16_VALUES:
        ours = cast(cts.device_put(np.float32(v)), "bfloat16")
        theirs = jnp.asarray(v, jnp.bfloat16)
        assert str(ours) == str(theirs)
        assert repr(ours) == repr(theirs)
        assert f"{ours:.4g}" == f"{theirs:.4g}"


def test_scalar_array_comparisons():
    loss, best = _loss_array(0.5), _loss_array(0.75)
    assert loss < best and best > loss and loss <= 0.5 and loss >= 0.5
    assert loss == 0.5 and loss != 0.25 and 1.0 > loss
    assert (loss == _loss_array(0.5)) and not (loss == best)
    assert (loss == "0.5") is False                  # not a number: identity, like Python
    x = cts.device_put(np.arange(4, dtype=np.float32))
    # elementwise comparisons give bool Arrays (jax); their truth value is ambiguous
    assert np.asarray(x == 3).tolist() == [False, False, False, True]
    assert np.asarray(loss < x).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x > 3)


def test_scalar_array_comparisons_match_jax():
    jax = _jax()
    import operator
    for op in (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne):
        for a, b in ((0.5, 0.75), (0.75, 0.5), (0.5, 0.5)):
            want = bool(op(jax.numpy.float32(a), jax.numpy.float32(b)))
            assert bool(op(_loss_array(a), _loss_array(b))) == want
            assert bool(op(_loss_array(a), b)) == want
    assert f"{jax.numpy.float32(2.5):.3f}" == f"{_loss_array(2.5):.3f}"


def test_array_host_conversions():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = cts.device_put(a, cts.NamedSharding(cts.make_mesh((2,), ("d",)), cts.P("d")))
    assert x.tolist() == a.tolist()
    assert float(np.mean(x)) == 2.5 and float(np.sum(x)) == 15.0   # numpy calls x.mean(dtype=, out=)
    h = x.astype(np.float16)
    assert h.dtype == np.float16 and h.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(h), a.astype(np.float16))
    assert x.astype(np.float32) is x
    c = x.copy()
    assert c is not x and c.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(c), a)
    np.testing.assert_array_equal(np.asarray(x[0]), a[0])  # basic indexing: tests/test_slicing.py
    with pytest.raises(TypeError, match="np.asarray"):
        list(x)
    with pytest.raises(TypeError, match="out="):
        np.sum(x, out=np.zeros(()))


# --- shardings -----------------------------------------------------------------------------

def _equiv_cases(Mesh, NS, P, SDS, devs):
    m24 = Mesh(np.array(devs[:8]).reshape(2, 4), ("data", "model"))
    m42 = Mesh(np.array(devs[:8]).reshape(4, 2), ("a", "b"))
    m8 = Mesh(np.array(devs[:8]), ("x",))
    m1 = Mesh(np.array(devs[:1]), ("x",))
    return [
        (NS(m24, P("data")), NS(m24, P("data", None)), 2),          # trailing None
        (NS(m24, P("data")), NS(m24, P("data", "model")), 2),
        (NS(m24, P(("data", "model"))), NS(m8, P("x")), 1),         # same devices, same order
        (NS(m24, P()), NS(m42, P()), 2),                            # replicated on 8 either way
        (NS(m24, P("model")), NS(m24, P(None, "model")), 2),
        (NS(m1, P("x")), SDS(devs[0]), 2),                          # one device
        (NS(m1, P()), SDS(devs[1]), 1),
    ]


def test_is_equivalent_to():
    got = [a.is_equivalent_to(b, nd) for a, b, nd in _equiv_cases(
        cts.Mesh, cts.NamedSharding, cts.P, cts.SingleDeviceSharding, cts.devices())]
    # derived: which cases put every element on the same devices
    assert got == [True, False, True, True, False, True, False]


def test_is_equivalent_to_matches_jax():
    jax = _jax()
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
    if jax.device_count() < 8:
        pytest.skip("needs 8 XLA CPU devices")
    want = [a.is_equivalent_to(b, nd) for a, b, nd in _equiv_cases(
        Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding, jax.devices())]
    got = [a.is_equivalent_to(b, nd) for a, b, nd in _equiv_cases(
        cts.Mesh, cts.NamedSharding, cts.P, cts.SingleDeviceSharding, cts.devices())]
    assert got == want


def test_device_process_index():
    # t5x's get_coords / bounds_from_last_device read device.process_index: every device
    # belongs to the one process, whose devices are exactly local_devices()
    devs = cts.devices()
    assert cts.process_count() == 1 and cts.process_index() == 0
    assert [d.process_index for d in devs] == [cts.process_index()] * cts.device_count()
    assert [d.host_id for d in devs] == [d.process_index for d in devs]
    assert [d for d in devs if d.process_index == cts.process_index()] == cts.local_devices()
    assert cts.local_devices(process_index=0) == cts.local_devices()
    with pytest.raises(ValueError, match="process_index 1"):
        cts.local_devices(process_index=1)
    assert len({d.id for d in devs}) == len(devs)
    from ctrainstate.t5x import partitioning as t5p
    coords = [t5p.get_coords(d) for d in devs]
    assert len(set(coords)) == len(devs) and {c[0] for c in coords} == {0}


def test_device_attributes_match_jax():
    jax = _jax()
    attrs = lambda d: (d.id, d.process_index, d.host_id, d.platform, d.device_kind)
    theirs, ours = jax.devices("cpu"), cts.devices("cpu")
    n = min(len(theirs), len(ours))
    assert n >= 1
    assert [attrs(d) for d in ours[:n]] == [attrs(d) for d in theirs[:n]]
    assert (cts.process_index(), cts.process_count()) == (jax.process_index(), jax.process_count())


# --- tree utilities ------------------------------------------------------------------------

_TREE = {"b": [1, (2, None)], "a": {"z": 4, "y": 5}}


def test_tree_namespace_and_reduce():
    from ctrainstate import tree, tree_util
    assert tree.map(lambda x: x * 10, _TREE) == {"b": [10, (20, None)], "a": {"z": 40, "y": 50}}
    assert tree.leaves(_TREE) == [5, 4, 1, 2]                 # dict keys sorted, None no leaf
    assert tree.reduce(lambda a, b: a + b, _TREE) == 12
    assert tree_util.tree_reduce(lambda a, b: a + b, _TREE, 100) == 112
    assert tree.all(tree.map(lambda x: x > 0, _TREE)) and not tree.all({"a": 0, "b": 1})
    assert tree.all({}) is True
    paths = [tree_util.keystr(p, simple=True, separator="/")
             for p, _ in tree.flatten_with_path(_TREE)[0]]
    assert paths == ["a/y", "a/z", "b/0", "b/1/0"]
    assert tree_util.keystr(tree.flatten_with_path({"a": [7]})[0][0][0]) == "['a'][0]"
    assert tree_util.keystr(tree.flatten_with_path({"a": [7]})[0][0][0], separator="/") == "['a']/[0]"


def test_tree_namespace_matches_jax():
    jax = _jax()
    from ctrainstate import tree, tree_util
    assert tree.leaves(_TREE) == jax.tree.leaves(_TREE)
    assert tree.reduce(lambda a, b: a * b, _TREE, 3) == jax.tree.reduce(lambda a, b: a * b, _TREE, 3)
    assert tree.all(_TREE) == jax.tree.all(_TREE)
    for simple in (False, True):
        for sep in ("", "/"):
            want = [jax.tree_util.keystr(p, simple=simple, separator=sep)
                    for p, _ in jax.tree_util.tree_flatten_with_path(_TREE)[0]]
            got = [tree_util.keystr(p, simple=simple, separator=sep)
                   for p, _ in tree_util.tree_flatten_with_path(_TREE)[0]]
            assert got == want


# --- jnp creation functions, minimum / clip / squeeze / std --------------------------------

def _creations(jnp):
    return {
        "ones": jnp.ones((1, 2)), "zeros_i": jnp.zeros(3, jnp.int32),
        "array_i": jnp.array([1, 2, 3]), "array_f": jnp.array([1.0, 2.0]),
        "asarray_f64": jnp.asarray(np.ones(2)), "arange": jnp.arange(5),
        "arange3": jnp.arange(1, 7, 2), "arange_f": jnp.arange(0.0, 1.0, 0.25),
        "linspace": jnp.linspace(0, 1, 5), "full_i": jnp.full((2,), 3),
        "full_f": jnp.full((2, 2), 0.5), "full_dt": jnp.full((2,), 1, jnp.float32),
        # a numpy scalar or array fill value keeps its dtype (64-bit narrowed to 32)
        "full_f16": jnp.full((2,), np.float16(1.5)), "full_u32": jnp.full((2,), np.uint32(3)),
        "full_f64": jnp.full((2,), np.float64(0.5)), "full_i64": jnp.full((2,), np.int64(3)),
        "full_b": jnp.full((2,), True), "full_bf16": jnp.full((1,), jnp.bfloat16(7)),
        "full_arr": jnp.full((2, 2), np.array([1.0, 2.0], np.float16)),
    }


def test_jnp_creation_functions():
    got = _creations(cnp)
    # derived: JAX without x64 — float32 by default, int32 for integers
    want = {"ones": ([[1.0, 1.0]], "float32"), "zeros_i": ([0, 0, 0], "int32"),
            "array_i": ([1, 2, 3], "int32"), "array_f": ([1.0, 2.0], "float32"),
            "asarray_f64": ([1.0, 1.0], "float32"), "arange": ([0, 1, 2, 3, 4], "int32"),
            "arange3": ([1, 3, 5], "int32"), "arange_f": ([0.0, 0.25, 0.5, 0.75], "float32"),
            "linspace": ([0.0, 0.25, 0.5, 0.75, 1.0], "float32"), "full_i": ([3, 3], "int32"),
            "full_f": ([[0.5, 0.5], [0.5, 0.5]], "float32"), "full_dt": ([1.0, 1.0], "float32"),
            "full_f16": ([1.5, 1.5], "float16"), "full_u32": ([3, 3], "uint32"),
            "full_f64": ([0.5, 0.5], "float32"), "full_i64": ([3, 3], "int32"),
            "full_b": ([True, True], "bool"), "full_bf16": ([7.0], "bfloat16"),
            "full_arr": ([[1.0, 2.0], [1.0, 2.0]], "float16")}
    for k, (vals, dt) in want.items():
        assert isinstance(got[k], cts.Array), k
        assert got[k].tolist() == vals and str(got[k].dtype) == dt, k
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    with mesh:                                            # replicated over the active mesh
        assert cnp.zeros((8, 4)).sharding == cts.NamedSharding(mesh, cts.P())
    s = cts.NamedSharding(mesh, cts.P("data"))
    assert cnp.ones((8, 4), device=s).sharding == s
    a = cnp.ones(3)
    assert cnp.asarray(a) is a and cnp.array(a) is not a
    assert cnp.float32(2.0) == 2.0 and str(np.dtype(cnp.bfloat16)) == "bfloat16"


def test_jnp_creation_matches_jax():
    jax = _jax()
    got, want = _creations(cnp), _creations(jax.numpy)
    for k in want:
        assert str(got[k].dtype) == str(want[k].dtype), k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_minimum_clip_squeeze_std_and_grads():
    x = cnp.array([-2.0, 0.5, 3.0, 1.0])
    assert cnp.minimum(x, 1.0).tolist() == [-2.0, 0.5, 1.0, 1.0]
    assert cnp.clip(x, -1.0, 1.0).tolist() == [-1.0, 0.5, 1.0, 1.0]
    assert cnp.clip(x, a_max=0.0).tolist() == [-2.0, 0.0, 0.0, 0.0]
    assert cnp.squeeze(cnp.ones((1, 3, 1))).shape == (3,)
    assert cnp.squeeze(cnp.ones((1, 3, 1)), axis=-1).shape == (1, 3)
    with pytest.raises(ValueError, match="not 1"):
        cnp.squeeze(cnp.ones((2, 3)), axis=0)
    np.testing.assert_allclose(float(cnp.std(x)), np.std([-2.0, 0.5, 3.0, 1.0]), rtol=1e-6)
    # d/dx sum(clip(x, -1, 1)) = 1 strictly inside, 0 outside; d/dy min(x, y) where y < x
    g = cts.grad(lambda v: cnp.sum(cnp.clip(v, -1.0, 1.0)))(cnp.array([-2.0, 0.5, 3.0]))
    assert g.tolist() == [0.0, 1.0, 0.0]
    ga, gb = cts.grad(lambda a, b: cnp.sum(cnp.minimum(a, b)), argnums=(0, 1))(
        cnp.array([1.0, 5.0]), cnp.array([2.0, 3.0]))
    assert ga.tolist() == [1.0, 0.0] and gb.tolist() == [0.0, 1.0]
    assert cts.eval_shape(lambda a: cnp.minimum(a, 0.0), cts.ShapeDtypeStruct((2, 3), np.float32)).shape == (2, 3)


def test_squeeze_axis_errors_like_jnp():
    assert cnp.squeeze(cnp.ones((1, 3, 1)), axis=(0, -1)).shape == (3,)
    assert cnp.squeeze(cnp.ones(()), axis=()).shape == ()
    for shape, axis in (((1, 3), 2), ((1, 3), -3), ((), 0), ((), -1)):
        with pytest.raises(ValueError, match="out of bounds"):
            cnp.squeeze(cnp.ones(shape), axis=axis)
    with pytest.raises(ValueError, match="repeated"):
        cnp.squeeze(cnp.ones((1, 1)), axis=(0, -2))


def test_squeeze_axis_errors_match_jnp():
    jnp = _jax().numpy
    for shape, axis in (((1, 3), 2), ((1, 3), -3), ((), 0), ((), -1), ((1, 1), (0, -2)),
                        ((2, 3), 0)):
        with pytest.raises(ValueError):
            jnp.squeeze(jnp.ones(shape), axis=axis)
        with pytest.raises(ValueError):
            cnp.squeeze(cnp.ones(shape), axis=axis)
    for shape, axis in (((1, 3, 1), (0, -1)), ((), ()), ((1, 3), -2), ((1, 1), None)):
        assert cnp.squeeze(cnp.ones(shape), axis=axis).shape == \
            jnp.squeeze(jnp.ones(shape), axis=axis).shape


# --- optax: losses, global_norm, schedules, stateless transforms ---------------------------

def _schedules(o):
    return {
        "pwi_lin": o.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01}),
        "pwi_cos": o.piecewise_interpolate_schedule("cosine", 2.0, {3: 0.5, 5: 0.0, 9: 3.0}),
        "pwi_none": o.piecewise_interpolate_schedule("linear", 0.3),
        "lin1c": o.linear_onecycle_schedule(20, 0.1),
        "cos1c": o.cosine_onecycle_schedule(17, 0.05, pct_start=0.2),
        "wconst": o.warmup_constant_schedule(0.0, 1.0, 4),
        "wexp": o.warmup_exponential_decay_schedule(0.0, 1.0, 3, 2, 0.5, transition_begin=1,
                                                    staircase=True, end_value=0.1),
        "sgdr": o.sgdr_schedule([
            dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=6),
            dict(init_value=0.1, peak_value=0.5, warmup_steps=1, decay_steps=5, end_value=0.05)]),
    }


def test_more_schedules_derived_values():
    from ctrainstate import optim
    s = _schedules(optim)
    # optax's docstring: linear interpolation between the accumulated values 1, 0.1, 0.001
    assert [round(s["pwi_lin"](i), 6) for i in range(0, 11, 2)] == [1.0, 0.55, 0.1, 0.0505,
                                                                    0.001, 0.001]
    assert s["pwi_none"](0) == pytest.approx(0.3) and s["pwi_none"](100) == pytest.approx(0.3)
    # onecycle: peak/25 at 0, peak at int(0.3 * 20) = 6, peak/25 at 17, peak/25/1e4 at 20
    assert s["lin1c"](0) == pytest.approx(0.004) and s["lin1c"](6) == pytest.approx(0.1)
    assert s["lin1c"](17) == pytest.approx(0.004) and s["lin1c"](20) == pytest.approx(4e-7)
    assert s["cos1c"](3) == pytest.approx(0.05) and s["cos1c"](17) == pytest.approx(0.05 / 25 / 1e4)
    assert s["wconst"](2) == pytest.approx(0.5) and s["wconst"](50) == 1.0
    # sgdr: the second cycle starts at step 6 with its own warmup from 0.1
    assert s["sgdr"](6) == pytest.approx(0.1) and s["sgdr"](7) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="interpolate_type"):
        optim.piecewise_interpolate_schedule("quadratic", 1.0)


def test_more_schedules_match_optax():
    optax = pytest.importorskip("optax")
    from ctrainstate import optim
    want, got = _schedules(optax), _schedules(optim)
    for k in want:
        a = np.array([float(want[k](i)) for i in range(25)])
        b = np.array([float(got[k](i)) for i in range(25)])
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-12, err_msg=k)


def _loss_inputs():
    r = np.random.RandomState(0)
    return r.randn(4, 3).astype(np.float32), r.randn(4, 3).astype(np.float32)


def test_losses_global_norm_and_updates():
    from ctrainstate import optim
    p, t = _loss_inputs()
    np.testing.assert_allclose(np.asarray(optim.l2_loss(p, t)), 0.5 * (p - t) ** 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(optim.squared_error(p)), p ** 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(optim.losses.l2_loss(p)), 0.5 * p ** 2, rtol=1e-6)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    tree = {"a": cts.device_put(np.tile(p, (2, 4)), cts.NamedSharding(mesh, cts.P("data", "model"))),
            "b": t, "c": None}
    want = np.sqrt(np.sum(np.tile(p, (2, 4)).astype(np.float64) ** 2) + np.sum(t.astype(np.float64) ** 2))
    assert float(optim.global_norm(tree)) == pytest.approx(want, rel=1e-6)
    # differentiable: d/dw mean(l2_loss(w, 1)) = (w - 1) / n
    w = cts.device_put(p)
    loss, g = cts.value_and_grad(lambda v: cnp.mean(optim.l2_loss(v, np.ones_like(p))))(w)
    np.testing.assert_allclose(np.asarray(g), (p - 1) / p.size, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(optim.incremental_update({"x": p}, {"x": t}, 0.1)["x"]),
                               0.1 * p + 0.9 * t, rtol=1e-6)
    assert optim.periodic_update("new", "old", 4, 2) == "new"
    assert optim.periodic_update("new", "old", cts.device_put(np.int32(3)), 2) == "old"
    assert optim.safe_int32_increment(2**31 - 1) == 2**31 - 1


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_losses_and_global_norm_match_optax():
    optax = pytest.importorskip("optax")
    from ctrainstate import optim
    p, t = _loss_inputs()
    np.testing.assert_allclose(np.asarray(optim.l2_loss(p, t)), np.asarray(optax.l2_loss(p, t)),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(optim.squared_error(p, t)),
                               np.asarray(optax.squared_error(p, t)), rtol=1e-6)
    assert float(optim.global_norm({"p": p, "t": [t]})) == pytest.approx(
        float(optax.global_norm({"p": p, "t": [t]})), rel=1e-6)


def _stateless_chain(o, tmap):
    return o.chain(o.stateless_with_tree_map(lambda g, p: g + 0.01 * p),
                   o.stateless(lambda u, p: tmap(lambda x: x * 0.5, u)),
                   o.sgd(0.1, momentum=0.9))


def test_stateless_transforms_in_train_state(jax_ref):
    from ctrainstate import optim, tree_util
    from ctrainstate.train_state import TrainState
    p, g = _loss_inputs()
    s = TrainState.create(apply_fn=None, params={"w": p}, tx=_stateless_chain(optim, tree_util.tree_map))
    s = s.apply_gradients(grads={"w": g})
    # derived: u = 0.5 * (g + 0.01 p); momentum trace starts at 0, so the first update is -0.1 u
    np.testing.assert_allclose(np.asarray(s.params["w"]), p - 0.1 * 0.5 * (g + 0.01 * p), rtol=1e-6)
    def theirs(jax, optax):
        tx = _stateless_chain(optax, jax.tree_util.tree_map)
        st = tx.init({"w": p})
        return tx.update({"w": g}, st, {"w": p})[0]["w"]

    np.testing.assert_allclose(np.asarray(s.params["w"]), p + jax_ref("optax update", theirs),
                               rtol=1e-6)


# --- jax.lax.with_sharding_constraint, jax.device_get ----------------------------------------

def test_lax_with_sharding_constraint():
    from ctrainstate import lax
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    s = cts.NamedSharding(mesh, cts.P("data", "model"))
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = cts.device_put(a)
    y = lax.with_sharding_constraint(x, s)
    assert y.sharding == s and y.addressable_shards[5].index == (slice(4, 8), slice(1, 2))
    np.testing.assert_array_equal(np.asarray(y), a)
    with mesh:                                             # a PartitionSpec uses the active mesh
        t = cts.with_sharding_constraint({"a": x, "b": [x]}, {"a": cts.P("model"), "b": cts.P()})
    assert t["a"].sharding == cts.NamedSharding(mesh, cts.P("model"))
    assert t["b"][0].sharding == cts.NamedSharding(mesh, cts.P())
    with pytest.raises(ValueError, match="with mesh"):
        lax.with_sharding_constraint(x, cts.P("data"))
    ids = lax.with_sharding_constraint({"ids": np.arange(8, dtype=np.int32), "n": 3},
                                       {"ids": cts.NamedSharding(mesh, cts.P("data")),
                                        "n": cts.NamedSharding(mesh, cts.P())})
    assert ids["ids"].dtype == np.int32 and ids["ids"].sharding.spec == cts.P("data")
    assert ids["ids"].tolist() == list(range(8)) and int(ids["n"]) == 3
    # differentiable: the gradient comes back with the input's sharding
    g = cts.grad(lambda v: cnp.sum(cnp.square(lax.with_sharding_constraint(v, s))))(x)
    assert g.sharding == x.sharding
    np.testing.assert_allclose(np.asarray(g), 2 * a)


def test_with_sharding_constraint_device_and_single_device_sharding():
    from ctrainstate import lax
    from ctrainstate.sharding import SingleDeviceSharding
    mesh = cts.make_mesh((8,), ("x",))
    a = np.arange(8, dtype=np.float32)
    x = cts.device_put(a, cts.NamedSharding(mesh, cts.P("x")))
    # a SingleDeviceSharding places on that device (as in JAX); differentiable
    s3 = SingleDeviceSharding(cts.devices()[3])
    y = lax.with_sharding_constraint(x, s3)
    assert y.sharding == s3 and [sh.device.id for sh in y.addressable_shards] == [3]
    np.testing.assert_array_equal(np.asarray(y), a)
    g = cts.grad(lambda v: cnp.sum(cnp.square(lax.with_sharding_constraint(v, s3))))(x)
    assert g.sharding == x.sharding and np.asarray(g).tolist() == (2 * a).tolist()
    # a bare Device (or a string) is a TypeError naming it, as in JAX; not "outside a mesh"
    with mesh:
        with pytest.raises(TypeError, match=r"got Device CpuDevice.*SingleDeviceSharding\("):
            lax.with_sharding_constraint(x, cts.devices()[3])
    with pytest.raises(TypeError, match="got Device CpuDevice"):
        lax.with_sharding_constraint(x, cts.devices()[3])
    with pytest.raises(TypeError, match="got str"):
        lax.with_sharding_constraint(x, "x")


def test_with_sharding_constraint_device_matches_jax():
    jax = _jax()
    from jax.sharding import SingleDeviceSharding as JSDS
    y = jax.lax.with_sharding_constraint(jax.numpy.ones(8), JSDS(jax.devices()[3]))
    assert [d.id for d in y.devices()] == [3]
    with pytest.raises(TypeError):
        jax.lax.with_sharding_constraint(jax.numpy.ones(8), jax.devices()[3])


def test_device_get():
    x = cts.device_put(np.arange(3, dtype=np.float32))
    out = cts.device_get({"x": x, "n": 3, "h": np.ones(2)})
    assert isinstance(out["x"], np.ndarray) and out["x"].tolist() == [0.0, 1.0, 2.0]
    assert out["n"] == 3 and out["h"].tolist() == [1.0, 1.0]


# --- jax.random.randint, wrap_key_data -----------------------------------------------------

# recorded from jax 0.10.2 (jax.random.randint on CPU)
_RANDINT_JAX = [
    ((0, (6,), 0, 10, None), [9, 0, 2, 3, 1, 7]),
    ((42, (5,), -2**31, 2**31 - 1, None),
     [977810628, 1236381714, -1367112521, -1019495231, -1671904627]),
    ((1, (8,), 0, 256, np.uint8), [252, 175, 224, 105, 160, 172, 22, 149]),
]

_RANDINT_CASES = [((6,), 0, 10, None), ((1000,), -5, 5, None), ((3, 4), 0, 2**31 - 1, None),
                  ((50,), -2**31, 2**31 - 1, None), ((50,), 5, 5, None), ((50,), 7, 3, None),
                  ((100,), 0, 256, np.uint8), ((100,), -100, 100, np.int8),
                  ((100,), 0, 70000, np.int16), ((100,), 3, 1000, np.uint32), ((7,), 0, 1, None),
                  ((100,), 0, 65537, None), ((100,), 2.7, 9.9, None)]


def test_randint_recorded_and_properties():
    for (seed, shape, lo, hi, dt), want in _RANDINT_JAX:
        got = random.randint(random.PRNGKey(seed), shape, lo, hi, dt)
        assert got.tolist() == want
    x = random.randint(random.PRNGKey(3), (2000,), -5, 5)
    assert x.dtype == np.int32 and x.min() == -5 and x.max() == 4
    assert (random.randint(random.PRNGKey(3), (9,), 7, 3) == 7).all()     # empty span: minval
    u = random.randint(random.PRNGKey(3), (4000,), 0, 256, np.uint8)      # maxval one past uint8
    assert u.dtype == np.uint8 and u.max() == 255
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    s = cts.NamedSharding(mesh, cts.P("data"))
    sh = random.randint(random.PRNGKey(0), (8, 2), 0, 10, out_sharding=s)
    assert sh.sharding == s
    np.testing.assert_array_equal(np.asarray(sh), random.randint(random.PRNGKey(0), (8, 2), 0, 10))
    with pytest.raises(ValueError, match="scalar"):
        random.randint(random.PRNGKey(0), (2,), np.zeros(2, np.int32), 5)
    assert random.wrap_key_data(np.array([1, 2], np.uint32)).tolist() == [1, 2]


def test_randint_matches_jax():
    jax = _jax()
    for shape, lo, hi, dt in _RANDINT_CASES:
        for seed in (0, 42):
            want = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, lo, hi,
                                                 dt if dt else int))
            got = random.randint(random.PRNGKey(seed), shape, lo, hi, dt)
            assert got.dtype == want.dtype, (shape, lo, hi, dt)
            np.testing.assert_array_equal(got, want, err_msg=str((shape, lo, hi, dt, seed)))


# --- nn.Dropout ------------------------------------------------------------------------------

def _dropout_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x, train: bool):
            x = nn_mod.Dense(16)(x)
            x = nn_mod.Dropout(0.3, deterministic=not train)(x)
            x = nn_mod.relu(x)
            x = nn_mod.Dropout(rate=0.5, broadcast_dims=(0,))(x, deterministic=not train)
            return nn_mod.Dense(2)(x)
    return M()


def test_dropout_mask_and_scaling():
    x = np.arange(1, 41, dtype=np.float32).reshape(8, 5)
    k = random.PRNGKey(3)
    d = nn.Dropout(0.25)
    y = np.asarray(d.apply({}, x, deterministic=False, rng=k))
    # derived: Flax keeps element i iff uniform(rng, shape)[i] < 1 - rate, and scales by 1/keep
    keep = random.uniform(k, x.shape) < 0.75
    np.testing.assert_allclose(y, np.where(keep, x / 0.75, 0.0), rtol=1e-6)
    assert np.asarray(d.apply({}, x, deterministic=True)).tolist() == x.tolist()
    assert np.asarray(nn.Dropout(1.0).apply({}, x, deterministic=False)).max() == 0.0
    yb = np.asarray(nn.Dropout(0.5, broadcast_dims=(0,)).apply(
        {}, x, deterministic=False, rngs={"dropout": k}))
    assert ((yb == 0).all(axis=0) | (yb != 0).all(axis=0)).all()    # one mask value per column
    with pytest.raises(ValueError, match="deterministic"):
        nn.Dropout(0.1).apply({}, x)
    with pytest.raises(ValueError, match="dropout"):
        nn.Dropout(0.1).apply({}, x, deterministic=False)


def test_dropout_sharded_grads_and_train_step():
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    m = _dropout_model(nn)
    v = m.init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x, train=True)
    y1 = np.asarray(m.apply(v, x, train=True, rngs={"dropout": random.PRNGKey(5)}))
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    xs = cts.device_put(x, cts.NamedSharding(mesh, cts.P("data", None)))
    with mesh:
        ys = m.apply(v, xs, train=True, rngs={"dropout": random.PRNGKey(5)})
    np.testing.assert_allclose(np.asarray(ys), y1, rtol=1e-5, atol=1e-6)  # same mask on any mesh
    state = TrainState.create(apply_fn=m.apply, params=v["params"], tx=optim.sgd(0.1))
    loss_fn = lambda p: cnp.mean(cnp.square(state.apply_fn(
        {"params": p}, x, train=True, rngs={"dropout": random.PRNGKey(5)})))
    loss, g = cts.value_and_grad(loss_fn)(state.params)
    np.testing.assert_allclose(float(loss), np.mean(y1 ** 2), rtol=1e-5)
    state = state.apply_gradients(grads=g)
    assert state.step == 1


def test_dropout_matches_flax():
    fnn, jax = _flax(), _jax()
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    fv = _dropout_model(fnn).init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
                                  x, train=True)
    cv = _dropout_model(nn).init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)},
                                 x, train=True)
    for a, b in zip(jax.tree_util.tree_leaves(fv["params"]), cts.tree_util.tree_leaves(cv["params"])):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    fo = _dropout_model(fnn).apply(fv, x, train=True, rngs={"dropout": jax.random.PRNGKey(5)})
    co = _dropout_model(nn).apply(cv, x, train=True, rngs={"dropout": random.PRNGKey(5)})
    np.testing.assert_allclose(np.asarray(co), np.asarray(fo), rtol=1e-5, atol=1e-6)
    loss = lambda apply, p, k, jnp: jnp.mean(jnp.square(apply({"params": p}, x, train=True,
                                                               rngs={"dropout": k})))
    gf = jax.grad(lambda p: loss(_dropout_model(fnn).apply, p, jax.random.PRNGKey(5), jax.numpy))(
        fv["params"])
    gc = cts.grad(lambda p: loss(_dropout_model(nn).apply, p, random.PRNGKey(5), cnp))(cv["params"])
    for a, b in zip(jax.tree_util.tree_leaves(gf), cts.tree_util.tree_leaves(gc)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


_NONFINITE = np.tile(np.array([np.inf, -np.inf, np.nan, -2.0, 0.0, 3.0, -0.0, 1e30], np.float32),
                     16).reshape(8, 16)


@pytest.mark.parametrize("bd", [(), (0,)])
def test_dropout_selects_dropped_are_zero_even_for_inf_nan(bd):
    x, k = _NONFINITE, random.PRNGKey(15)
    # derived: Flax's lax.select(mask, x / keep, 0): dropped elements are exactly 0, kept ones
    # x / keep (inf and NaN included)
    shape = (1, 16) if bd == (0,) else (8, 16)
    keep = np.broadcast_to(np.asarray(random.uniform(k, shape)) < 0.5, x.shape)
    want = np.where(keep, x / np.float32(0.5), np.float32(0.0))
    for f in (np.isnan, np.isposinf, np.isneginf):       # each kept somewhere and dropped somewhere
        assert (keep & f(x)).any() and (~keep & f(x)).any()
    d = nn.Dropout(0.5, broadcast_dims=bd, deterministic=False)
    np.testing.assert_array_equal(np.asarray(d.apply({}, x, rng=k)), want)
    mesh = cts.make_mesh((2, 4), ("d", "m"))
    xs = cts.device_put(x, cts.NamedSharding(mesh, cts.P("d", "m")))
    ys = d.apply({}, xs, rng=k)
    assert ys.sharding.spec == cts.P("d", "m")
    np.testing.assert_array_equal(np.asarray(ys), want)
    # the gradient is the same selection of g / keep
    w = cts.device_put(np.random.RandomState(0).randn(8, 16).astype(np.float32),
                       cts.NamedSharding(mesh, cts.P("d", "m")))
    g = cts.grad(lambda v: cnp.sum(cnp.square(d.apply({}, v, rng=k))))(w)
    assert g.sharding == w.sharding
    np.testing.assert_allclose(np.asarray(g), np.where(keep, 2 * np.asarray(w) / 0.25, 0.0),
                               rtol=1e-6)
    # rate 1: zeros_like, whatever the input
    z = nn.Dropout(1.0, deterministic=False).apply({}, x)
    assert np.asarray(z).tolist() == [[0.0] * 16] * 8


@pytest.mark.parametrize("bd", [(), (0,)])
def test_dropout_inf_nan_matches_flax(bd):
    fnn, jax = _flax(), _jax()
    x = _NONFINITE
    fo = fnn.Dropout(0.5, broadcast_dims=bd, deterministic=False).apply(
        {}, x, rngs={"dropout": jax.random.PRNGKey(15)})
    co = nn.Dropout(0.5, broadcast_dims=bd, deterministic=False).apply(
        {}, x, rngs={"dropout": random.PRNGKey(15)})
    np.testing.assert_array_equal(np.asarray(co), np.asarray(fo))
    np.testing.assert_array_equal(
        np.asarray(nn.Dropout(1.0, deterministic=False).apply({}, x)),
        np.asarray(fnn.Dropout(1.0, deterministic=False).apply({}, x)))
    w = np.random.RandomState(0).randn(8, 16).astype(np.float32)
    gf = jax.grad(lambda v: jax.numpy.sum(jax.numpy.square(fnn.Dropout(
        0.5, broadcast_dims=bd, deterministic=False).apply({}, v, rngs={"dropout": jax.random.PRNGKey(15)}))))(w)
    gc = cts.grad(lambda v: cnp.sum(cnp.square(nn.Dropout(
        0.5, broadcast_dims=bd, deterministic=False).apply({}, v, rngs={"dropout": random.PRNGKey(15)}))))(
        cts.device_put(w))
    np.testing.assert_allclose(np.asarray(gc), np.asarray(gf), rtol=1e-6)


# --- flax.struct, flax.traverse_util -------------------------------------------------------

def test_struct_dataclass():
    from typing import Any, Callable
    from ctrainstate import struct, tree_util

    @struct.dataclass
    class Model:
        params: Any
        apply_fn: Callable = struct.field(pytree_node=False)

    @struct.dataclass(kw_only=True)
    class Cfg:
        lr: float
        name: str = struct.field(pytree_node=False, default="x")

    class Node(struct.PyTreeNode):
        a: Any
        b: int = struct.field(pytree_node=False, default=3)

    m = Model({"w": 1.0}, print)
    assert tree_util.tree_leaves(m) == [1.0]
    m2 = tree_util.tree_map(lambda v: v * 2, m)
    assert m2.params == {"w": 2.0} and m2.apply_fn is print
    assert m.replace(params=0).params == 0
    with pytest.raises(Exception):
        m.params = 3                                     # frozen
    assert tree_util.tree_leaves(Cfg(lr=0.1)) == [0.1]
    with pytest.raises(TypeError):
        Cfg(0.1)                                         # kw_only
    assert tree_util.tree_leaves(Node([1, 2])) == [1, 2] and Node(1).b == 3


def _hf_decay_mask(traverse_util):
    def decay_mask_fn(params):
        flat = traverse_util.flatten_dict(params)
        ln = {p[-2:] for name in ("layernorm", "layer_norm", "ln") for p in flat
              if name in "".join(p).lower()}
        return traverse_util.unflatten_dict(
            {p: (p[-1] != "bias" and p[-2:] not in ln) for p in flat})
    return decay_mask_fn


_TU_PARAMS = {"dense": {"kernel": 1, "bias": 2}, "ln_f": {"scale": 3, "bias": 4},
              "h": {"0": {"mlp": {"kernel": 5}}}, "empty": {}}


def test_traverse_util():
    from ctrainstate import traverse_util as tu
    flat = tu.flatten_dict(_TU_PARAMS)
    assert flat == {("dense", "kernel"): 1, ("dense", "bias"): 2, ("ln_f", "scale"): 3,
                    ("ln_f", "bias"): 4, ("h", "0", "mlp", "kernel"): 5}
    assert tu.flatten_dict(_TU_PARAMS, sep="/")["h/0/mlp/kernel"] == 5
    kept = tu.flatten_dict(_TU_PARAMS, keep_empty_nodes=True)
    assert kept[("empty",)] is tu.empty_node and tu.unflatten_dict(kept) == _TU_PARAMS
    assert tu.unflatten_dict({"a/b": 1, "c": 2}, sep="/") == {"a": {"b": 1}, "c": 2}
    assert tu.flatten_dict({"a": {"b": 1}}, is_leaf=lambda p, x: p == ("a",)) == {("a",): {"b": 1}}
    assert tu.path_aware_map(lambda p, x: "/".join(p), {"a": {"b": 1}, "c": 2}) == \
        {"a": {"b": "a/b"}, "c": "c"}
    assert _hf_decay_mask(tu)(_TU_PARAMS) == {
        "dense": {"kernel": True, "bias": False}, "ln_f": {"scale": False, "bias": False},
        "h": {"0": {"mlp": {"kernel": True}}}}


def test_traverse_util_matches_flax():
    ftu = pytest.importorskip("flax.traverse_util")
    from ctrainstate import traverse_util as tu
    for kw in ({}, {"sep": "/"}, {"keep_empty_nodes": True}):
        want = ftu.flatten_dict(_TU_PARAMS, **kw)
        got = tu.flatten_dict(_TU_PARAMS, **kw)
        assert list(got) == list(want)
        assert [type(v).__name__ for v in got.values()] == [type(v).__name__ for v in want.values()]
    assert _hf_decay_mask(tu)(_TU_PARAMS) == _hf_decay_mask(ftu)(_TU_PARAMS)
    f = lambda p, x: len(p) * 10 + (x if isinstance(x, int) else 0)
    assert tu.path_aware_map(f, _TU_PARAMS) == ftu.path_aware_map(f, _TU_PARAMS)


# --- apply(method=model.encode), bind ------------------------------------------------------

def _autoencoder(nn_mod):
    class AE(nn_mod.Module):
        def setup(self):
            self.enc = nn_mod.Dense(3)
            self.dec = nn_mod.Dense(5)

        def encode(self, x):
            return self.enc(x)

        def decode(self, z):
            return self.dec(z)

        def __call__(self, x):
            return self.decode(self.encode(x))
    return AE()


def test_apply_with_bound_method_and_bind():
    x = np.random.RandomState(0).randn(2, 5).astype(np.float32)
    m = _autoencoder(nn)
    v = m.init(random.PRNGKey(0), x)
    z_str = np.asarray(m.apply(v, x, method="encode"))
    # Flax's docs write method=model.encode (a method of the unbound module)
    np.testing.assert_array_equal(np.asarray(m.apply(v, x, method=m.encode)), z_str)
    np.testing.assert_array_equal(np.asarray(m.apply(v, x, method=type(m).encode)), z_str)
    # derived: encode is the Dense 'enc', x @ kernel + bias
    p = v["params"]["enc"]
    np.testing.assert_allclose(z_str, x @ np.asarray(p["kernel"]) + np.asarray(p["bias"]), rtol=1e-5)
    assert sorted(m.init(random.PRNGKey(0), x, method=m.encode)["params"]) == ["enc"]
    b = m.bind(v)
    np.testing.assert_array_equal(np.asarray(b.encode(x)), z_str)
    np.testing.assert_allclose(np.asarray(b(x)), np.asarray(m.apply(v, x)), rtol=1e-6)
    with pytest.raises(TypeError, match="dict"):
        m.bind([1])


def test_apply_with_bound_method_matches_flax():
    fnn, jax = _flax(), _jax()
    x = np.random.RandomState(0).randn(2, 5).astype(np.float32)
    fm, cm = _autoencoder(fnn), _autoencoder(nn)
    fv, cv = fm.init(jax.random.PRNGKey(0), x), cm.init(random.PRNGKey(0), x)
    np.testing.assert_allclose(np.asarray(cm.apply(cv, x, method=cm.encode)),
                               np.asarray(fm.apply(fv, x, method=fm.encode)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cm.bind(cv).encode(x)),
                               np.asarray(fm.bind(fv).encode(x)), rtol=1e-5)


# --- jax.set_mesh ------------------------------------------------------------------------------

def test_set_mesh_context_and_setter():
    from ctrainstate import partitioning as nn_partitioning
    m = cts.make_mesh((2, 4), ("data", "model"))
    m2 = cts.make_mesh((8,), ("x",))
    assert cts.get_mesh() is None
    with cts.set_mesh(m) as entered:
        assert entered is m and cts.get_mesh() is m
        x = cts.device_put(np.ones((8, 4), np.float32), cts.P("data"))   # a spec on the set mesh
        assert x.sharding == cts.NamedSharding(m, cts.P("data"))
        with nn_partitioning.axis_rules((("batch", "data"),)):
            y = nn_partitioning.with_sharding_constraint(cts.device_put(np.ones((8, 2), np.float32)),
                                                         ("batch", None))
        assert y.sharding == cts.NamedSharding(m, cts.P("data", None))
        with cts.set_mesh(m2):
            assert cts.get_mesh() is m2
        assert cts.get_mesh() is m
        with cts.set_mesh(None):
            assert cts.get_mesh() is None
    assert cts.get_mesh() is None
    cts.set_mesh(m)                      # the setter form stays until replaced
    try:
        assert cts.get_mesh() is m
    finally:
        cts.set_mesh(None)
    assert cts.get_mesh() is None
    with pytest.raises(TypeError):
        cts.set_mesh("data")


def _set_mesh_sequence(make_mesh, set_mesh, current):
    """Mesh axis names seen along a sequence of setter / with-block uses (ctrainstate or JAX)."""
    a, b = make_mesh((8,), ("x",)), make_mesh((2, 4), ("d", "m"))
    seen = []
    for _ in range(1000):
        set_mesh(a)                     # the setter replaces; it does not stack
    seen.append(current())
    set_mesh(None)
    seen.append(current())
    with a:
        set_mesh(b)                     # inside a `with mesh:` block: no error at its exit
        seen.append(current())
    seen.append(current())              # the setter's mesh stays after the block
    set_mesh(a)
    with set_mesh(b):
        seen.append(current())
        set_mesh(None)
        seen.append(current())
    seen.append(current())              # the value before `with set_mesh(b)` is back
    set_mesh(None)
    seen.append(current())
    return seen


_SET_MESH_SEEN = [("x",), (), ("d", "m"), ("d", "m"), ("d", "m"), (), ("x",), ()]


def test_set_mesh_setter_replaces_and_nests_with_mesh_blocks():
    from ctrainstate._src.array import sharding
    names = lambda: tuple(cts.get_mesh().axis_names) if cts.get_mesh() is not None else ()
    try:
        assert _set_mesh_sequence(cts.make_mesh, cts.set_mesh, names) == _SET_MESH_SEEN
        assert sharding._mesh_stack() == []          # 1000 setter calls left nothing behind
        m = cts.make_mesh((2, 4), ("d", "m"))
        with cts.make_mesh((8,), ("x",)):
            cts.set_mesh(m)
            x = cts.device_put(np.ones((8, 4), np.float32), cts.P("d"))   # on the set mesh
        assert x.sharding == cts.NamedSharding(m, cts.P("d"))
    finally:
        cts.set_mesh(None)


def test_set_mesh_sequence_matches_jax():
    jax = _jax()
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    import warnings
    names = lambda: tuple(jax.sharding.get_abstract_mesh().axis_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)       # jax's `with mesh:`
        try:
            assert _set_mesh_sequence(jax.make_mesh, jax.set_mesh, names) == _SET_MESH_SEEN
        finally:
            jax.set_mesh(None)


def test_device_put_partition_spec_on_active_mesh():
    m = cts.make_mesh((2, 4), ("data", "model"))
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    with pytest.raises(ValueError, match="no active mesh"):
        cts.device_put(a, cts.P("data"))
    with m:
        x = cts.device_put(a, cts.P("data", "model"))
        t = cts.device_put({"a": a, "b": a}, {"a": cts.P(), "b": cts.P("model")})
    assert x.sharding == cts.NamedSharding(m, cts.P("data", "model"))
    assert t["a"].sharding == cts.NamedSharding(m, cts.P())
    assert t["b"].sharding == cts.NamedSharding(m, cts.P("model"))
    np.testing.assert_array_equal(np.asarray(t["b"]), a)


# --- mixed precision: dtype= is the computation's dtype (values: test_mixed_precision.py) ----

@pytest.mark.parametrize("make", [
    lambda dt: nn.Dense(4, dtype=dt), lambda dt: nn.DenseGeneral((2, 2), dtype=dt),
    lambda dt: nn.LayerNorm(dtype=dt)])
def test_layers_compute_in_their_dtype_and_refuse_non_float_dtypes(make):
    x = np.ones((2, 3), np.float32)
    v = make(cnp.bfloat16).init(random.PRNGKey(0), x)
    assert {str(p.dtype) for p in flat_tree(v["params"]).values()} == {"float32"}   # param_dtype
    assert make(cnp.bfloat16).apply(v, x).dtype == cnp.bfloat16
    assert make(np.float16).apply(v, x).dtype == np.float16
    assert make(None).apply(v, x).dtype == np.float32
    with pytest.raises(TypeError, match=r"dtype=.*int32.*expected float32, bfloat16 or float16"):
        make(np.int32).init(random.PRNGKey(0), x)


def test_embed_dtype():
    ids = np.array([[1, 2]], np.int32)
    e = nn.Embed(5, 3, dtype=np.float16)
    v = e.init(random.PRNGKey(0), ids)
    out = e.apply(v, ids)
    assert out.dtype == np.float16 and v["params"]["embedding"].dtype == np.float32
    want = np.asarray(v["params"]["embedding"]).astype(np.float16)[[1, 2]]
    np.testing.assert_array_equal(np.asarray(out)[0], want)
    with pytest.raises(TypeError, match="param_dtype=.*expected float32"):
        nn.Embed(5, 3, param_dtype=np.int32).init(random.PRNGKey(0), ids)


# --- flax.serialization: state dicts and msgpack bytes --------------------------------------

def _ser_params():
    r = np.random.RandomState(0)
    return {"dense": {"kernel": r.randn(4, 8).astype(np.float32), "bias": np.zeros(8, np.float32)},
            "ln": {"scale": np.ones(8, np.float32)}}


def _ser_grads():
    r = np.random.RandomState(1)
    return {k: {n: r.randn(*v.shape).astype(np.float32) for n, v in d.items()}
            for k, d in _ser_params().items()}


def _ct_state(mesh):
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    p = _ser_params()
    params = {"dense": {"kernel": cts.device_put(p["dense"]["kernel"],
                                                 cts.NamedSharding(mesh, cts.P("data", "model"))),
                        "bias": cts.device_put(p["dense"]["bias"], cts.NamedSharding(mesh, cts.P("model")))},
              "ln": {"scale": p["ln"]["scale"]}}
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    return TrainState.create(apply_fn=None, params=params, tx=tx)


def test_serialization_roundtrip_keeps_shardings():
    pytest.importorskip("msgpack")
    from ctrainstate import serialization
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    s = _ct_state(mesh).apply_gradients(grads=_ser_grads())
    sd = serialization.to_state_dict(s)
    assert sorted(sd) == ["opt_state", "params", "step"]
    assert sorted(sd["opt_state"]["1"]["0"]) == ["count", "mu", "nu"] and sd["opt_state"]["0"] == {}
    data = serialization.to_bytes(s)
    target = _ct_state(mesh)                            # a fresh state as the template
    r = serialization.from_bytes(target, data)
    assert r.step == 1
    for a, b in zip(cts.tree_util.tree_leaves(s), cts.tree_util.tree_leaves(r)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    k = r.params["dense"]["kernel"]
    assert k.sharding == cts.NamedSharding(mesh, cts.P("data", "model"))
    assert r.opt_state[1][0].mu["dense"]["bias"].sharding == cts.NamedSharding(mesh, cts.P("model"))
    kval = np.asarray(k)
    r2 = r.apply_gradients(grads=_ser_grads())           # the restored state trains
    assert r2.step == 2
    # an abstract target (eval_shape) restores born sharded
    abstract = cts.eval_shape(lambda: _ct_state(mesh))
    r3 = serialization.from_bytes(abstract, data)
    assert r3.params["dense"]["kernel"].sharding == k.sharding
    np.testing.assert_array_equal(np.asarray(r3.params["dense"]["kernel"]), kval)
    with pytest.raises(ValueError):
        serialization.from_bytes({"w": cts.device_put(np.zeros(3, np.float32))},
                                 serialization.to_bytes({"w": np.zeros(4, np.float32)}))


def test_serialization_chunks_big_arrays(monkeypatch):
    pytest.importorskip("msgpack")
    from ctrainstate import serialization
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)   # 16 float32 per chunk
    a = np.arange(40, dtype=np.float32).reshape(5, 8)
    import msgpack
    tree = msgpack.unpackb(serialization.msgpack_serialize({"a": a}), raw=False,
                           strict_map_key=False, ext_hook=serialization._unpack_ext)
    # Flax's layout: a marker, the shape as {'0': 5, '1': 8}, flat chunks of 16 elements
    assert tree["a"]["__msgpack_chunked_array__"] is True
    assert tree["a"]["shape"] == {"0": 5, "1": 8}
    assert [c.size for c in tree["a"]["chunks"].values()] == [16, 16, 8]
    np.testing.assert_array_equal(serialization.msgpack_restore(
        serialization.msgpack_serialize({"a": a}))["a"], a)


def test_serialization_interoperates_with_flax(monkeypatch):
    pytest.importorskip("msgpack")
    fser = pytest.importorskip("flax.serialization")
    optax = pytest.importorskip("optax")
    from flax.training import train_state as fts
    from ctrainstate import serialization
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    fs = fts.TrainState.create(apply_fn=None, params=_ser_params(), tx=tx)
    fs = fs.apply_gradients(grads=_ser_grads())
    r = serialization.from_bytes(_ct_state(mesh), fser.to_bytes(fs))       # Flax -> ctrainstate
    assert r.step == 1
    for a, b in zip(cts.tree_util.tree_leaves((fs.params, fs.opt_state)),
                    cts.tree_util.tree_leaves((r.params, r.opt_state))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    assert r.params["dense"]["kernel"].sharding.spec == cts.P("data", "model")
    cs = _ct_state(mesh).apply_gradients(grads=_ser_grads())
    rf = fser.from_bytes(fs, serialization.to_bytes(cs))                   # ctrainstate -> Flax
    for a, b in zip(cts.tree_util.tree_leaves((cs.params, cs.opt_state)),
                    cts.tree_util.tree_leaves((rf.params, rf.opt_state))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    # chunked arrays: written by one, read by the other
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
    monkeypatch.setattr(fser, "MAX_CHUNK_SIZE", 64)
    a = np.arange(40, dtype=np.float32).reshape(5, 8)
    np.testing.assert_array_equal(fser.msgpack_restore(serialization.msgpack_serialize({"a": a}))["a"], a)
    np.testing.assert_array_equal(serialization.msgpack_restore(fser.msgpack_serialize({"a": a}))["a"], a)
    vals = {"f": np.float32(1.5), "i": np.arange(3, dtype=np.int32), "s": "x", "n": 2,
            "b": np.ones(2, cnp.bfloat16)}
    back = fser.msgpack_restore(serialization.msgpack_serialize(vals))
    assert back["f"] == np.float32(1.5) and back["s"] == "x" and back["n"] == 2
    assert str(back["b"].dtype) == "bfloat16" and back["i"].tolist() == [0, 1, 2]


# --- submodules passed as attributes; nn.Sequential ------------------------------------------

def _wrapper_model(nn_mod):
    from typing import Any

    class W(nn_mod.Module):
        inner: Any
        blocks: Any = ()
        table: Any = None

        @nn_mod.compact
        def __call__(self, x):
            y = self.inner(x)
            for b in self.blocks:
                y = b(y)
            if self.table:
                y = self.table["a"](y)
            return nn_mod.Dense(2)(y)
    return W(nn_mod.Dense(3, name="foo"), (nn_mod.Dense(3), nn_mod.Dense(3)),
             {"a": nn_mod.Dense(3)})


def _seq_model(nn_mod):
    return nn_mod.Sequential([nn_mod.Dense(4), nn_mod.relu, nn_mod.Dense(2)])


def test_module_attributes_are_adopted():
    x = np.ones((2, 3), np.float32)
    m = _wrapper_model(nn)
    v = m.init(random.PRNGKey(0), x)
    # Flax names them after the attribute (the module's own name= does not count)
    assert sorted(v["params"]) == ["Dense_0", "blocks_0", "blocks_1", "inner", "table_a"]
    y = m.apply(v, x)
    p = cts.tree_util.tree_map(np.asarray, v["params"])
    h = x @ p["inner"]["kernel"] + p["inner"]["bias"]
    for name in ("blocks_0", "blocks_1", "table_a"):
        h = h @ p[name]["kernel"] + p[name]["bias"]
    np.testing.assert_allclose(np.asarray(y), h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"],
                               rtol=1e-5)
    assert m.inner.scope is None                # the user's instance stays unbound
    assert sorted(m.init(random.PRNGKey(1), x)["params"]) == sorted(v["params"])   # reusable
    s = _seq_model(nn)
    sv = s.init(random.PRNGKey(0), x)
    assert sorted(sv["params"]) == ["layers_0", "layers_2"]
    sp = cts.tree_util.tree_map(np.asarray, sv["params"])
    want = np.maximum(x @ sp["layers_0"]["kernel"] + sp["layers_0"]["bias"], 0)
    want = want @ sp["layers_2"]["kernel"] + sp["layers_2"]["bias"]
    np.testing.assert_allclose(np.asarray(s.apply(sv, x)), want, rtol=1e-5)
    with pytest.raises(ValueError, match="Empty Sequential"):
        nn.Sequential([]).init(random.PRNGKey(0), x)


def test_module_attributes_match_flax():
    fnn, jax = _flax(), _jax()
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    for make in (_wrapper_model, _seq_model):
        fv = make(fnn).init(jax.random.PRNGKey(0), x)
        cv = make(nn).init(random.PRNGKey(0), x)
        fl = jax.tree_util.tree_flatten_with_path(fv["params"])[0]
        cl = cts.tree_util.tree_flatten_with_path(cv["params"])[0]
        assert [jax.tree_util.keystr(k) for k, _ in fl] == [cts.tree_util.keystr(k) for k, _ in cl]
        for (_, a), (_, b) in zip(fl, cl):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        np.testing.assert_allclose(np.asarray(make(nn).apply(cv, x)),
                                   np.asarray(make(fnn).apply(fv, x)), rtol=1e-5, atol=1e-6)


def _shared_models(nn_mod):
    """Models where one module instance appears twice (Flax: one submodule, one parameter set,
    named at its first place)."""
    from typing import Any

    class W(nn_mod.Module):
        a: Any
        b: Any

        @nn_mod.compact
        def __call__(self, x):
            return self.b(self.a(x))

    class L(nn_mod.Module):
        blocks: Any

        @nn_mod.compact
        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    d, e, f = nn_mod.Dense(3), nn_mod.Dense(3), nn_mod.Dense(3)
    # list entries are adopted in the order of their keys as strings: '10' < '2'
    many = [nn_mod.Dense(3) for _ in range(2)] + [f] + [nn_mod.Dense(3) for _ in range(7)] + [f]
    return {"seq": nn_mod.Sequential([d, d]), "fields": W(e, e), "list": L(many)}


def test_shared_module_instance_is_one_submodule():
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    models = _shared_models(nn)
    v = models["seq"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["layers_0"]                 # not layers_1: the weights are tied
    p = cts.tree_util.tree_map(np.asarray, v["params"]["layers_0"])
    h = x @ p["kernel"] + p["bias"]
    np.testing.assert_allclose(np.asarray(models["seq"].apply(v, x)), h @ p["kernel"] + p["bias"],
                               rtol=1e-5, atol=1e-6)
    v = models["fields"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["a"]
    assert sorted(models["list"].init(random.PRNGKey(0), x)["params"]) == \
        ["blocks_0", "blocks_1", "blocks_10", "blocks_3", "blocks_4", "blocks_5", "blocks_6",
         "blocks_7", "blocks_8", "blocks_9"]


def _assert_models_match_flax(fm, cm, x, jax):
    """Each pair of models (Flax's fm[k], ours cm[k]): the same parameter paths and values from
    the same key, and the same outputs."""
    for k in fm:
        fv = fm[k].init(jax.random.PRNGKey(0), x)
        cv = cm[k].init(random.PRNGKey(0), x)
        fl = jax.tree_util.tree_flatten_with_path(fv["params"])[0]
        cl = cts.tree_util.tree_flatten_with_path(cv["params"])[0]
        assert [jax.tree_util.keystr(p) for p, _ in fl] == [cts.tree_util.keystr(p) for p, _ in cl], k
        for (_, a), (_, b) in zip(fl, cl):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        np.testing.assert_allclose(np.asarray(cm[k].apply(cv, x)), np.asarray(fm[k].apply(fv, x)),
                                   rtol=1e-5, atol=1e-6)


def test_shared_module_instance_matches_flax():
    fnn, jax = _flax(), _jax()
    x = np.random.RandomState(0).randn(2, 3).astype(np.float32)
    fm, cm = _shared_models(fnn), _shared_models(nn)
    _assert_models_match_flax(fm, cm, x, jax)


def _nested_container_models(nn_mod):
    from typing import Any

    class N(nn_mod.Module):
        blocks: Any

        @nn_mod.compact
        def __call__(self, x):
            for grp in self.blocks:
                for b in grp:
                    x = b(x)
            return x

    class S(nn_mod.Module):
        def setup(self):
            self.d = {"a": nn_mod.Dense(3), "b": [nn_mod.Dense(3), {"c": nn_mod.Dense(2)}]}

        def __call__(self, x):
            return self.d["b"][1]["c"](self.d["b"][0](self.d["a"](x)))

    return {"nested": N(((nn_mod.Dense(2),), (nn_mod.Dense(3),))), "setup_dict": S()}


def test_nested_module_containers_are_adopted():
    x = np.random.RandomState(1).randn(2, 3).astype(np.float32)
    models = _nested_container_models(nn)
    v = models["nested"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["blocks_0_0", "blocks_1_0"]
    p = cts.tree_util.tree_map(np.asarray, v["params"])
    assert p["blocks_0_0"]["kernel"].shape == (3, 2) and p["blocks_1_0"]["kernel"].shape == (2, 3)
    h = x @ p["blocks_0_0"]["kernel"] + p["blocks_0_0"]["bias"]
    np.testing.assert_allclose(np.asarray(models["nested"].apply(v, x)),
                               h @ p["blocks_1_0"]["kernel"] + p["blocks_1_0"]["bias"], rtol=1e-5)
    v = models["setup_dict"].init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["d_a", "d_b_0", "d_b_1_c"]
    assert models["setup_dict"].apply(v, x).shape == (2, 2)


def test_nested_module_containers_match_flax():
    fnn, jax = _flax(), _jax()
    x = np.random.RandomState(1).randn(2, 3).astype(np.float32)
    fm, cm = _nested_container_models(fnn), _nested_container_models(nn)
    _assert_models_match_flax(fm, cm, x, jax)


# --- activations: silu/swish, leaky_relu, one_hot -----------------------------------------------

_ACT_X = np.array([-3.0, -0.5, 0.25, 2.0], np.float32)


def test_activations_derived():
    x = _ACT_X.astype(np.float64)
    np.testing.assert_allclose(np.asarray(nn.silu(_ACT_X)), x / (1 + np.exp(-x)), rtol=1e-6)
    assert nn.swish is nn.silu
    np.testing.assert_allclose(np.asarray(nn.leaky_relu(_ACT_X)), np.where(x >= 0, x, 0.01 * x),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.leaky_relu(_ACT_X, negative_slope=0.2)),
                               np.where(x >= 0, x, 0.2 * x), rtol=1e-6)
    assert nn.one_hot(np.array([0, 2, 5, -1]), 3).tolist() == [
        [1, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert nn.one_hot(np.array([[1]]), 2, axis=0).shape == (2, 1, 1)
    # d silu / dx = s + x s (1 - s)
    g = cts.grad(lambda v: cnp.sum(nn.silu(v)))(cts.device_put(_ACT_X))
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(np.asarray(g), s + x * s * (1 - s), rtol=1e-5)


def test_activations_match_jax():
    jax = _jax()
    np.testing.assert_allclose(np.asarray(nn.silu(_ACT_X)), np.asarray(jax.nn.silu(_ACT_X)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.leaky_relu(_ACT_X, 0.1)),
                               np.asarray(jax.nn.leaky_relu(_ACT_X, 0.1)), rtol=1e-6)
    labels = np.array([[0, 3], [2, 7]])
    for axis in (-1, 0, 1):
        np.testing.assert_array_equal(np.asarray(nn.one_hot(labels, 4, axis=axis)),
                                      np.asarray(jax.nn.one_hot(labels, 4, axis=axis)))


# --- flax.core FrozenDict / freeze / unfreeze ---------------------------------------------------

def test_frozen_dict_basics():
    from ctrainstate.core import FrozenDict, copy, freeze, pop, pretty_repr, unfreeze
    f = freeze({"b": {"x": 1}, "a": 2})
    assert isinstance(f["b"], FrozenDict) and f == {"b": {"x": 1}, "a": 2}
    with pytest.raises(TypeError, match="immutable"):
        f["a"] = 3
    with pytest.raises(TypeError, match="immutable"):
        f["b"]["x"] = 3
    rest, a = f.pop("a")
    assert a == 2 and isinstance(rest, FrozenDict) and dict(rest) == {"b": {"x": 1}}
    u = unfreeze(f)
    assert type(u) is dict and type(u["b"]) is dict and u == f
    u["b"]["x"] = 5                                      # a copy: f is untouched
    assert f["b"]["x"] == 1
    assert copy(f, {"c": 3})["c"] == 3 and isinstance(copy(f, {"c": 3}), FrozenDict)
    assert pop({"a": 1, "b": 2}, "a") == ({"b": 2}, 1)
    assert hash(freeze({"a": 1})) == hash(freeze({"a": 1}))
    # a pytree node with sorted keys, rebuilt as a FrozenDict
    leaves, td = cts.tree_util.tree_flatten(f)
    assert leaves == [2, 1]
    assert isinstance(cts.tree_util.tree_map(lambda v: v * 10, f), FrozenDict)
    assert [cts.tree_util.keystr(p) for p, _ in cts.tree_util.tree_flatten_with_path(f)[0]] == \
        ["['a']", "['b']['x']"]
    assert pretty_repr({"a": {"b": 1}}) == "{\n    a: {\n        b: 1,\n    },\n}"


def test_frozen_params_train():
    from ctrainstate import optim
    from ctrainstate.core import FrozenDict, freeze
    from ctrainstate.train_state import TrainState
    p = freeze({"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float32)})
    tx = optim.adamw(0.1, weight_decay=0.1, mask=freeze({"w": True, "b": False}))
    s = TrainState.create(apply_fn=None, params=p, tx=tx)
    assert isinstance(s.params, FrozenDict)
    s = s.apply_gradients(grads=freeze({"w": np.ones((2, 2), np.float32),
                                        "b": np.ones(2, np.float32)}))
    assert isinstance(s.params, FrozenDict) and s.step == 1
    # adam's first step is -lr * sign(g) (up to eps); the decay applies to w only
    np.testing.assert_allclose(np.asarray(s.params["b"]), [-0.1, -0.1], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s.params["w"]), 1 - 0.1 * (1 + 0.1), rtol=1e-5)


def test_frozen_dict_matches_flax():
    fcore = pytest.importorskip("flax.core")
    jax = _jax()
    from ctrainstate import core
    d = {"b": {"x": 1, "y": {}}, "a": 2}
    assert repr(core.freeze(d)) == repr(fcore.freeze(d))
    assert core.unfreeze(core.freeze(d)) == fcore.unfreeze(fcore.freeze(d))
    for key in ("a", "b"):
        rest, val = core.freeze(d).pop(key)
        frest, fval = fcore.freeze(d).pop(key)
        assert repr(val) == repr(fval)
        assert type(rest).__name__ == type(frest).__name__ == "FrozenDict"
        assert repr(rest) == repr(frest) and list(rest) == list(frest)
        assert core.unfreeze(rest) == fcore.unfreeze(frest)
        assert rest == core.freeze({k: v for k, v in d.items() if k != key})   # hand-derived
    with pytest.raises(KeyError):
        fcore.freeze(d).pop("zz")
    with pytest.raises(KeyError):
        core.freeze(d).pop("zz")
    assert repr(core.copy(core.freeze(d), {"c": 3})) == repr(fcore.copy(fcore.freeze(d), {"c": 3}))
    fl = jax.tree_util.tree_flatten_with_path(fcore.freeze(d))[0]
    cl = cts.tree_util.tree_flatten_with_path(core.freeze(d))[0]
    assert [jax.tree_util.keystr(k) for k, _ in fl] == [cts.tree_util.keystr(k) for k, _ in cl]


def test_permutation_of_an_array_narrows_like_jax(jax_ref):
    x = np.arange(10) * 2                        # int64 on the host
    out = random.permutation(random.PRNGKey(42), x)
    assert out.dtype == np.int32                  # JAX without x64
    assert sorted(out.tolist()) == sorted(x.tolist())
    assert random.permutation(random.PRNGKey(0), np.ones(3)).dtype == np.float32
    want = jax_ref("permutation", lambda jax: jax.random.permutation(jax.random.PRNGKey(42), x))
    assert want.dtype == out.dtype
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name", ["adamw", "lamb", "add_decayed_weights"])
def test_update_without_params_says_to_pass_them(name):
    from ctrainstate import optim
    tx = {"adamw": lambda: optim.adamw(1e-3), "lamb": lambda: optim.lamb(1e-3),
          "add_decayed_weights": lambda: optim.add_decayed_weights(1e-4)}[name]()
    p = {"w": np.ones(3, np.float32)}
    st = tx.init(p)
    # optax raises a ValueError too ("...requires the current value of parameters...")
    with pytest.raises(ValueError, match=r"tx.update\(updates, state, params\)"):
        tx.update({"w": np.ones(3, np.float32)}, st)
    u, _ = tx.update({"w": np.ones(3, np.float32)}, st, p)      # with params it runs
    assert np.isfinite(np.asarray(u["w"])).all()


# --- jnp.zeros_like & co over params trees; 1-d dot; einsum arity ------------------------------

def test_zeros_like_over_param_trees():
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    s = cts.NamedSharding(mesh, cts.P("a", "b"))
    tree = {"np": np.ones((4, 3), np.float32), "sharded": cts.device_put(np.ones((8, 4), np.float32), s),
            "int": cts.device_put(np.arange(3, dtype=np.int32)), "py": 3}
    z = cts.tree_util.tree_map(cnp.zeros_like, tree)        # e.g. a gradient accumulator
    assert z["np"].shape == (4, 3) and z["np"].dtype == np.float32 and z["np"].tolist() == [[0.0] * 3] * 4
    assert z["sharded"].sharding == s and float(np.asarray(z["sharded"]).sum()) == 0.0
    assert z["int"].dtype == np.int32 and z["int"].tolist() == [0, 0, 0]      # dtype kept
    assert int(z["py"]) == 0
    o = cnp.ones_like(tree["int"], dtype=np.float32)
    assert o.dtype == np.float32 and o.tolist() == [1.0, 1.0, 1.0]
    f = cnp.full_like(tree["sharded"], 2.5, dtype=cnp.bfloat16)
    assert f.sharding == s and str(f.dtype) == "bfloat16"
    assert np.asarray(f).astype(np.float32).tolist() == [[2.5] * 4] * 8
    assert cnp.zeros_like(tree["np"], shape=(2,)).tolist() == [0.0, 0.0]
    assert cts.eval_shape(cnp.zeros_like, cts.ShapeDtypeStruct((2, 3), np.float32)).shape == (2, 3)


def test_zeros_like_of_shape_dtype_struct_and_array_fill():
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    s = cts.NamedSharding(mesh, cts.P("a", "b"))
    # a ShapeDtypeStruct gives an Array (jnp does), placed by its sharding when it has one
    z = cnp.zeros_like(cts.ShapeDtypeStruct((8, 4), np.int32, s))
    assert isinstance(z, cts.Array) and z.sharding == s and z.dtype == np.int32
    assert np.asarray(z).tolist() == [[0] * 4] * 8
    o = cnp.ones_like(cts.ShapeDtypeStruct((2, 3), np.float32))
    assert isinstance(o, cts.Array) and o.tolist() == [[1.0] * 3] * 2
    f = cnp.full_like(cts.ShapeDtypeStruct((2,), cnp.bfloat16), 2.5)
    assert isinstance(f, cts.Array) and str(f.dtype) == "bfloat16"
    # inside eval_shape it stays abstract
    sd = cts.eval_shape(cnp.zeros_like, cts.ShapeDtypeStruct((8, 4), np.float32, s))
    assert isinstance(sd, cts.ShapeDtypeStruct) and sd.shape == (8, 4) and sd.sharding == s
    # an array fill value broadcasts to the shape, on every device's block
    x = cts.device_put(np.ones((8, 4), np.float32), s)
    g = cnp.full_like(x, np.array([1.0, 2.0, 3.0, 4.0]))
    assert g.sharding == s and np.asarray(g).tolist() == [[1.0, 2.0, 3.0, 4.0]] * 8
    col = np.arange(8, dtype=np.float32).reshape(8, 1)
    assert np.asarray(cnp.full_like(x, col)).tolist() == np.broadcast_to(col, (8, 4)).tolist()
    assert cnp.full_like(cnp.ones((2, 2)), np.array([1.0, 2.0])).tolist() == [[1.0, 2.0]] * 2
    assert cnp.full_like(np.ones((2, 2), np.int32), 2.7).tolist() == [[2, 2]] * 2
    with pytest.raises(ValueError):
        cnp.full_like(x, np.array([1.0, 2.0, 3.0]))      # does not broadcast to (8, 4)


def test_zeros_like_matches_jax():
    jax = _jax()
    jnp = jax.numpy
    from jax.sharding import NamedSharding as JNS, PartitionSpec as JP
    mesh = cts.make_mesh((2, 4), ("a", "b"))
    jmesh = jax.make_mesh((2, 4), ("a", "b"))
    host = {"f32": np.ones((8, 4), np.float32), "i32": np.arange(32, dtype=np.int32).reshape(8, 4),
            "u32": np.arange(8, dtype=np.uint32), "bool": np.ones(8, bool),
            "f16": np.ones((8, 2), np.float16), "f64": np.ones(2), "i64": np.arange(3)}
    specs = {"f32": ("a", "b"), "i32": ("a",), "u32": ("b",), "bool": ("a",), "f16": (None, "a")}
    cases = []
    for k, a in host.items():
        cases.append((a, a))                                         # numpy inputs
        cases.append((cts.device_put(a), jnp.asarray(a)))            # single-device Arrays
        if k in specs:                                               # sharded Arrays
            cases.append((cts.device_put(a, cts.NamedSharding(mesh, cts.P(*specs[k]))),
                          jax.device_put(a, JNS(jmesh, JP(*specs[k])))))
    for ours, theirs in cases:
        for fn, args in (("zeros_like", ()), ("ones_like", ()), ("full_like", (3,)),
                         ("full_like", (np.float32(2.5),))):
            want = getattr(jnp, fn)(theirs, *args)
            got = getattr(cnp, fn)(ours, *args)
            assert isinstance(got, cts.Array), (fn, ours)
            assert str(got.dtype) == str(want.dtype), (fn, ours, got.dtype, want.dtype)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            if isinstance(want.sharding, JNS):
                assert tuple(got.sharding.spec) == tuple(want.sharding.spec), (fn, ours)
        for dt in (jnp.float32, jnp.int32, jnp.bool_):
            want = jnp.zeros_like(theirs, dtype=dt)
            got = cnp.zeros_like(ours, dtype=dt)
            assert str(got.dtype) == str(want.dtype)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # ShapeDtypeStructs: an Array, with the struct's sharding
    sds = jax.ShapeDtypeStruct((8, 4), jnp.int32, sharding=JNS(jmesh, JP("a")))
    want = jnp.zeros_like(sds)
    got = cnp.zeros_like(cts.ShapeDtypeStruct((8, 4), np.int32, cts.NamedSharding(mesh, cts.P("a"))))
    assert type(want).__name__ == "ArrayImpl" and isinstance(got, cts.Array)
    assert str(got.dtype) == str(want.dtype) and tuple(got.sharding.spec) == tuple(want.sharding.spec)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # an array fill value broadcasts
    fill = np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(cnp.full_like(cts.device_put(host["f32"]), fill)),
                                  np.asarray(jnp.full_like(host["f32"], fill)))


def test_dot_of_vectors_and_einsum_arity():
    a = cnp.array([1.0, 2.0, 3.0])
    d = cnp.dot(a, a)
    assert d.shape == () and float(d) == 14.0
    assert cts.grad(lambda v: cnp.dot(v, v))(a).tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="contracting"):
        cnp.dot(a, cnp.ones(2))
    with pytest.raises(NotImplementedError, match="two operands"):
        cnp.einsum("ij,jk,kl->il", np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
                   np.ones((4, 5), np.float32))


def test_to_bytes_takes_jax_arrays_with_flax_s_bytes():
    """Params that came out of a jax/Flax model (jax Arrays, 0-d included) serialize to the
    same bytes as flax.serialization.to_bytes; they raised TypeError."""
    jnp = pytest.importorskip("jax.numpy")
    fser = pytest.importorskip("flax.serialization")
    from ctrainstate import serialization as cser
    t = {"w": jnp.ones(3), "b": jnp.bfloat16(1.5), "s": jnp.float32(2.0),
         "m": jnp.arange(4).reshape(2, 2), "n": np.float32(3.0)}
    assert cser.to_bytes(t) == fser.to_bytes(t)
    back = cser.msgpack_restore(cser.to_bytes(t))
    np.testing.assert_array_equal(back["m"], [[0, 1], [2, 3]])
