"""A whole training step under jit: value_and_grad and TrainState.apply_gradients traced once and
replayed from C, the optimizer step one node of the program (optim.base.JitStep,
_C.trace_node); Python int arguments traced as int32 Arrays; argument trees keyed in C
(_C.flatten_spec, csrc/python/py_tree.c)."""
import collections

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import _C, optim
from ctrainstate.train_state import TrainState
from call_counts import python_calls


def _mesh():
    return cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))


def _setup(mesh, tx, seed=0):
    rng = np.random.default_rng(seed)
    put = lambda a, *spec: cts.device_put(
        a, None if mesh is None else cts.NamedSharding(mesh, cts.P(*spec)))
    params = {"l0": {"w": put(rng.standard_normal((2, 16)).astype(np.float32) * 0.5, None, "y"),
                     "b": put(np.zeros(16, np.float32), "y")},
              "l1": {"w": put(rng.standard_normal((16, 3)).astype(np.float32) * 0.5, "y", None),
                     "b": put(np.zeros(3, np.float32), None)}}
    x = put(rng.standard_normal((16, 2)).astype(np.float32), "x")
    t = put(rng.standard_normal((16, 3)).astype(np.float32), "x")
    return TrainState.create(apply_fn=None, params=params, tx=tx), x, t


def _train_step(state, x, t):
    def loss_fn(p):
        h = cnp.sin(x @ p["l0"]["w"] + p["l0"]["b"])
        return cnp.mean(cnp.square(h @ p["l1"]["w"] + p["l1"]["b"] - t))
    loss, g = cts.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), loss


def _bits(tree):
    return [np.asarray(a).tobytes() for a in cts.tree_util.tree_leaves(tree)]


def _run(step, state, x, t, n):
    losses = []
    for _ in range(n):
        state, loss = step(state, x, t)
        losses.append(np.asarray(loss).tobytes())
    return state, losses


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
@pytest.mark.parametrize("tx", ["adam", "adamw+schedule", "sgd momentum"])
def test_a_jitted_train_step_replays_with_the_eager_bits(where, tx):
    mesh = None if where == "one device" else _mesh()
    make = {"adam": lambda: optim.adam(1e-2),
            "adamw+schedule": lambda: optim.adamw(optim.linear_schedule(1e-2, 1e-3, 5),
                                                  weight_decay=0.1),
            "sgd momentum": lambda: optim.sgd(1e-2, momentum=0.9)}[tx]
    eager, e_losses = _run(_train_step, *_setup(mesh, make()), n=8)
    j = cts.jit(_train_step)
    jitted, j_losses = _run(j, *_setup(mesh, make()), n=8)
    assert j._programs.traces == 1                 # traced at the first call only
    assert j_losses == e_losses                    # the schedule follows the counter: no constant
    assert _bits(jitted.params) == _bits(eager.params)
    assert _bits(jitted.opt_state) == _bits(eager.opt_state)
    assert int(jitted.step) == int(eager.step) == 8
    for a, b in zip(cts.tree_util.tree_leaves(jitted.params),
                    cts.tree_util.tree_leaves(eager.params)):
        assert a.sharding == b.sharding


def test_the_program_holds_one_optimizer_node_and_the_old_state_is_donated():
    state, x, t = _setup(None, optim.adam(1e-2))
    j = cts.jit(_train_step)
    s1, _ = j(state, x, t)
    s2, _ = j(s1, x, t)
    text = j.lower(s2, x, t).as_text()   # (tracing runs the step: s2 is donated after it)
    assert text.count("optimizer_step[node]") == 1 and "not replayable" not in text
    with pytest.raises(cts.DonatedBufferError):   # as eagerly: the step updates in place
        np.asarray(s1.params["l0"]["w"])
    with pytest.raises(cts.DonatedBufferError):
        j(s1, x, t)


def test_a_replayed_train_step_makes_a_few_python_calls():
    counts = []
    for width in (4, 64):   # more leaves and ops, the same Python calls
        rng = np.random.default_rng(0)
        params = {f"l{i}": {"w": cts.device_put(rng.standard_normal((width, width)).astype(
            np.float32) * 0.1), "b": cts.device_put(np.zeros(width, np.float32))}
            for i in range(3 if width == 4 else 6)}
        state = TrainState.create(apply_fn=None, params=params, tx=optim.adam(1e-3))
        x = cts.device_put(rng.standard_normal((8, width)).astype(np.float32))

        def step(state, x):
            def loss_fn(p):
                h = x
                for k in sorted(p):
                    h = cnp.tanh(h @ p[k]["w"] + p[k]["b"])
                return cnp.mean(cnp.square(h))
            loss, g = cts.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=g), loss
        j = cts.jit(step)
        for _ in range(3):
            state, _ = j(state, x)
        box = [state]

        def one():
            box[0], _ = j(box[0], x)
        counts.append(python_calls(one))
        assert j._programs.traces == 1
    assert counts[0] == counts[1] and counts[0] <= 20, counts


def test_a_state_not_passed_as_an_argument_is_not_replayed():
    state, x, t = _setup(None, optim.adam(1e-2))
    box = [state]

    def step(x, t):   # the state is closed over: the node would step a constant
        box[0], loss = _train_step(box[0], x, t)
        return loss
    j = cts.jit(step)
    ref_state, _ = _setup(None, optim.adam(1e-2))[0], None
    ref = []
    for _ in range(3):
        ref_state, loss = _train_step(ref_state, x, t)
        ref.append(float(loss))
    got = [float(j(x, t)) for _ in range(3)]
    assert got == ref
    assert "pass the train state as an argument" in j.lower(x, t).as_text()


def test_python_int_arguments_are_traced_as_int32():
    x = cts.device_put(np.float32([1.0, 2.0]))
    f = cts.jit(lambda x, n: x * n)
    np.testing.assert_array_equal(np.asarray(f(x, 2)), [2.0, 4.0])
    np.testing.assert_array_equal(np.asarray(f(x, 5)), [5.0, 10.0])
    assert f._programs.traces == 1 and f(x, 3).dtype == np.float32
    g = cts.jit(lambda n: n + 1)          # an int comes back as an int32 Array, as in jax
    r = g(41)
    assert type(r) is cts.Array and r.dtype == np.int32 and int(r) == 42
    big = cts.jit(lambda x, n: x + float(n))   # beyond int32: by value, as before
    assert np.asarray(big(x, 2 ** 40)).tobytes() == np.asarray(x + float(2 ** 40)).tobytes()
    assert np.asarray(big(x, 2 ** 41)).tobytes() == np.asarray(x + float(2 ** 41)).tobytes()
    assert big._programs.traces == 2
    h = cts.jit(lambda x, flag: x * 2.0 if flag else x)   # bools stay values of the key
    assert float(h(x, True)[0]) == 2.0 and float(h(x, False)[0]) == 1.0
    assert h._programs.traces == 2

    def loop(x, n):   # an int in Python control flow: a host read of a traced int32
        for _ in range(n):
            x = x * 2.0
        return x
    with pytest.raises(cts.errors.ConcretizationTypeError, match="static_argnums"):
        cts.jit(loop)(x, 2)
    j = cts.jit(loop, static_argnums=1)   # the fix the error names: one program per count
    assert float(j(x, 2)[0]) == 4.0 and float(j(x, 3)[0]) == 8.0 and j._programs.traces == 2


Pair = collections.namedtuple("Pair", "a b")


def test_flatten_spec_matches_only_the_same_structure():
    a = cts.device_put(np.ones(2, np.float32))
    state, _, _ = _setup(None, optim.adam(1e-2))
    tree = ((state, {"k": a, "p": Pair(a, None), "l": [a, 3]}), {"kw": 1.5})
    from ctrainstate._src.jit.jit import _checked_spec
    leaves = cts.tree_util.tree_leaves(tree)
    spec = _checked_spec(tree, leaves)
    assert spec is not None
    got = _C.flatten_spec(spec, tree)
    assert len(got) == len(leaves) and all(g is l for g, l in zip(got, leaves))
    back = _C.unflatten_spec(spec, got)
    assert cts.tree_util.tree_structure(back) == cts.tree_util.tree_structure(tree)
    assert type(back[0][0]) is TrainState and back[0][0].tx is state.tx
    # each of these differs from the spec in one node: no match (None), nothing raised
    other_tx = state.replace(tx=optim.adam(1e-2))
    for bad in [((state, {"k": a, "p": Pair(a, None), "l": [a, 3], "extra": a}), {"kw": 1.5}),
                ((state, {"k": a, "p": (a, None), "l": [a, 3]}), {"kw": 1.5}),
                ((state, {"k": a, "p": Pair(a, None), "l": (a, 3)}), {"kw": 1.5}),
                ((state, {"k": a, "p": Pair(a, a), "l": [a, 3]}), {"kw": 1.5}),
                ((state, {"k": np.ones(2), "p": Pair(a, None), "l": [a, 3]}), {"kw": 1.5}),
                ((other_tx, {"k": a, "p": Pair(a, None), "l": [a, 3]}), {"kw": 1.5}),
                ((state, {"k": a, "p": Pair(a, None), "l": [a, 3]}),)]:
        assert _C.flatten_spec(spec, bad) is None
    with pytest.raises(ValueError, match="leaves"):
        _C.unflatten_spec(spec, got[:-1])
    with pytest.raises(ValueError, match="not a spec"):
        _C.unflatten_spec(("nonsense",), [])
    assert _C.flatten_spec(("nonsense",), tree) is None


def test_a_call_with_another_structure_retraces_and_gives_the_right_values():
    f = cts.jit(lambda d: sum(cnp.sum(v) for v in d.values()))
    a = cts.device_put(np.ones(3, np.float32))
    assert float(f({"x": a})) == 3.0
    assert float(f({"x": a, "y": a * 2.0})) == 9.0
    assert float(f({"x": a * 3.0})) == 9.0
    assert float(f({"y": a})) == 3.0
    assert f._programs.traces == 3


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_memory_analysis_predicts_the_peak_a_replay_reaches(where):
    mesh = None if where == "one device" else _mesh()
    state, x, t = _setup(mesh, optim.adam(1e-2))
    j = cts.jit(_train_step)
    for _ in range(2):
        state, _ = j(state, x, t)
    traces = j._programs.traces
    ma = j.lower(state, x, t).compile().memory_analysis()   # the existing program: no trace
    assert j._programs.traces == traces
    devs = cts.devices()[:1 if mesh is None else 8]
    assert sorted(ma.per_device) == sorted(d.id for d in devs)
    n_params = sum(a.size for a in cts.tree_util.tree_leaves(state.params))
    # arguments: the state (params, mu, nu: 3 x n_params floats, the counters) and x, t
    one = ma.per_device[devs[0].id]
    assert one["argument_size_in_bytes"] > 0 and one["temp_size_in_bytes"] > 0
    if mesh is None:
        assert ma.argument_size_in_bytes == 4 * (3 * n_params + x.size + t.size) + 4 + 4
        assert ma.alias_size_in_bytes >= 4 * 3 * n_params   # the new state takes the old's buffers
    cts.reset_peak_memory_stats()
    before = {d.id: d.memory_stats()["bytes_in_use"] for d in devs}
    state, _ = j(state, x, t)
    for d in devs:
        p = ma.per_device[d.id]
        predicted = p["peak_size_in_bytes"] - p["argument_size_in_bytes"] - p["constant_size_in_bytes"]
        measured = d.memory_stats()["peak_bytes_in_use"] - before[d.id]
        assert abs(measured - predicted) <= 0.05 * predicted, (d.id, measured, predicted)


def test_memory_analysis_of_a_function_that_runs_eagerly_raises():
    state, x, t = _setup(None, optim.adam(1e-2))
    box = [state]

    def step(x, t):   # the state is closed over: not replayable, it runs eagerly
        box[0], loss = _train_step(box[0], x, t)
        return loss
    f = cts.jit(step)
    f(x, t)
    with pytest.raises(RuntimeError, match="not replayable.*train state as an argument"):
        f.lower(x, t).compile().memory_analysis()


def test_step_times_time_each_step_of_the_replays():
    x = cts.device_put(np.ones((64, 64), np.float32))
    f = cts.jit(lambda x: cnp.sin(x @ x) * 2.0)
    f(x)
    prog = f._programs.program([x], {})[0]
    assert prog.step_times == []
    assert prog.chains == [(1, 2)]   # sin and the product run fused: timed as one step
    prog.set_fusion(False)
    prog.set_timing(True)
    for _ in range(3):
        f(x)
    times = prog.step_times
    assert [name for _, name, _ in times] == ["matmul", "sin", "multiply"]
    assert all(us > 0 for _, _, us in times)
    prog.set_timing(False)
    assert prog.step_times == []


def test_numpy_arguments_are_placed_at_each_call_and_replay():
    f = cts.jit(lambda x, y: cnp.sum(x * y))
    a = np.float32([1.0, 2.0, 3.0])
    b = np.float32([4.0, 5.0, 6.0])
    assert float(f(a, b)) == 32.0
    assert float(f(a * 2.0, b)) == 64.0          # new values: the same program, replayed
    assert float(f(a, cts.device_put(b))) == 32.0  # an Array in the same place: the same key
    assert f._programs.traces == 1
    assert float(f(np.float32([1.0, 2.0]), np.float32([1.0, 1.0]))) == 3.0   # new shape
    assert float(f(a.astype(np.float16), b)) == 32.0                           # new dtype
    assert f._programs.traces == 3
    g = cts.jit(lambda x, s: x * s)              # a numpy scalar is a 0-d Array, as in jax
    out = g(cts.device_put(a), np.float32(3.0))
    assert out.dtype == np.float32 and np.asarray(out).tolist() == [3.0, 6.0, 9.0]


@pytest.mark.parametrize("where", ["one device", "2x4 mesh"])
def test_fused_chains_give_the_unfused_bits(where):
    mesh = None if where == "one device" else _mesh()
    rng = np.random.default_rng(5)
    put = lambda a, *spec: cts.device_put(
        a, None if mesh is None else cts.NamedSharding(mesh, cts.P(*spec)))
    x = put(rng.standard_normal((32, 16)).astype(np.float32), "x", "y")
    b = put(rng.standard_normal((16,)).astype(np.float32), "y")
    y = put(rng.standard_normal((32, 16)).astype(np.float32), "x", "y")

    def f(x, b, y):   # chains: (x + b) * 3 -> tanh -> - y -> exp; 2 / (.) * y; sum
        h = cnp.exp(cnp.tanh((x + b) * 3.0) - y)
        g = 2.0 / (h + 1.0) * y
        return cnp.sum(g), h
    j = cts.jit(f)
    j(x, b, y)
    prog = j._programs.program([x, b, y], {})[0]
    assert prog.chains and max(n for _, n in prog.chains) >= 4
    fused = j(x, b, y)
    prog.set_fusion(False)
    unfused = j(x, b, y)
    eager = f(x, b, y)
    for a, u, e in zip(fused, unfused, eager):
        assert np.asarray(a).tobytes() == np.asarray(u).tobytes() == np.asarray(e).tobytes()
        assert a.sharding == e.sharding
    # fused, the chain's intermediates are never allocated: the predicted peak is lower
    prog.set_fusion(True)
    lo = j.lower(x, b, y).compile().memory_analysis().temp_size_in_bytes
    prog.set_fusion(False)
    hi = j.lower(x, b, y).compile().memory_analysis().temp_size_in_bytes
    assert lo < hi


@pytest.mark.parametrize("where,shape", [("one device", (1031, 96)),
                                         ("one device", (3, 40000)),
                                         ("2x4 mesh", (2048, 64))])
def test_tiled_chains_give_the_step_by_step_bits(where, shape):
    """A chain on a CPU device large enough to tile (each thread runs every step on its tile of
    rows: a partial last tile, one row per tile, broadcast operands, a scalar on the left)
    gives the bits of the untiled chain, of the unfused steps and of the eager ops."""
    from chain_checks import assert_chain_bits
    mesh = None if where == "one device" else _mesh()
    assert_chain_bits(lambda a, *spec: cts.device_put(
        a, None if mesh is None else cts.NamedSharding(mesh, cts.P(*spec))), shape)


def test_donated_arguments_are_given_up_and_raise_afterwards():
    f = cts.jit(lambda x, y: cnp.sin(x) * y + 1.0, donate_argnums=0)
    for _ in range(3):   # traced, then replayed: each call donates its x
        x = cts.device_put(np.full(8, 0.5, np.float32))
        y = cts.device_put(np.full(8, 2.0, np.float32))
        out = f(x, y)
        np.testing.assert_array_equal(np.asarray(out), np.sin(np.float32(0.5)) * 2.0 + 1.0)
        assert x.is_deleted() and not y.is_deleted()
        with pytest.raises(cts.DonatedBufferError):
            np.asarray(x)
    assert f._programs.traces == 1
    ident = cts.jit(lambda x: x, donate_argnums=0)   # returned: the output is the argument
    x = cts.device_put(np.ones(3, np.float32))
    for _ in range(2):
        r = ident(x)
        assert np.asarray(r).tolist() == [1.0, 1.0, 1.0] and not x.is_deleted()
    g = cts.jit(lambda x, *, y: x * y, donate_argnames="y")   # by name
    x = cts.device_put(np.ones(3, np.float32))
    for _ in range(2):
        y = cts.device_put(np.full(3, 3.0, np.float32))
        assert np.asarray(g(x, y=y)).tolist() == [3.0, 3.0, 3.0]
        assert y.is_deleted() and not x.is_deleted()
    with pytest.raises(ValueError, match="both static and donated"):
        cts.jit(lambda x, n: x * n, static_argnums=1, donate_argnums=1)


def test_donation_lowers_the_peak_as_memory_analysis_predicts():
    n = 1 << 16
    def f(x, y):
        h = cnp.sin(x) * y   # x and y are last read here
        return cnp.sum(cnp.exp(h) + h)
    for donate in ((), (0, 1)):
        j = cts.jit(f, donate_argnums=donate)
        mk = lambda: (cts.device_put(np.full(n, 0.5, np.float32)),
                      cts.device_put(np.full(n, 0.25, np.float32)))
        j(*mk())
        x, y = mk()
        ma = j.lower(x, y).compile().memory_analysis()
        dev = cts.devices()[0]
        cts.reset_peak_memory_stats()
        before = dev.memory_stats()["bytes_in_use"]
        j(x, y)
        measured = dev.memory_stats()["peak_bytes_in_use"] - before
        p = ma.per_device[dev.id]
        predicted = p["peak_size_in_bytes"] - p["argument_size_in_bytes"] - p["constant_size_in_bytes"]
        assert abs(measured - predicted) <= 0.05 * abs(predicted) + 64, (donate, measured, predicted)
        if donate:
            assert measured < undonated and x.is_deleted() and y.is_deleted()
        else:
            undonated = measured


def test_random_draws_follow_keys_passed_as_arguments():
    from ctrainstate import random
    x = cts.device_put(np.zeros(4, np.float32))
    f = cts.jit(lambda key, x: x + random.normal(key, (4,)))
    k1, k2 = random.PRNGKey(1), random.PRNGKey(2)
    a, b, a2 = f(k1, x), f(k2, x), f(k1, x)
    assert np.asarray(a).tobytes() != np.asarray(b).tobytes()         # not a constant
    assert np.asarray(a).tobytes() == np.asarray(a2).tobytes()
    assert np.asarray(a).tobytes() == np.asarray(x + random.normal(k1, (4,))).tobytes()
