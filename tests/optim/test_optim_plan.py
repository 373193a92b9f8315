"""The persistent in-place step (optim.base.FastPlan over _C.OptimPlan): after a first
general step, TrainState.apply_gradients (and t5x's OptaxWrapper) run each step as one C
call. These tests check that the plan is used, that it gives the general path's bits, that
it declines (and the general path decides) whenever the state or the grads are not what it
recorded, and that a step makes a constant number of Python calls."""
import threading

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import optim
from ctrainstate.optim import base
from ctrainstate._src.optim import base as _obase
from ctrainstate.train_state import TrainState
from call_counts import python_calls


def _mesh_params(rng):
    mesh = cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))
    shard = lambda *spec: cts.NamedSharding(mesh, cts.P(*spec))  # noqa: E731
    host = {"dense": {"kernel": rng.standard_normal((8, 12)).astype(np.float32),
                      "bias": rng.standard_normal(12).astype(np.float32)},
            "emb": rng.standard_normal((16, 4)).astype(np.float32),
            "scale": rng.standard_normal(()).astype(np.float32)}
    specs = {"dense": {"kernel": shard("x", "y"), "bias": shard("y")},
             "emb": shard(None, "x"), "scale": shard()}
    return host, specs


def _place(host, specs):
    return cts.tree_util.tree_map(lambda a, s: cts.device_put(a, s), host, specs)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in cts.tree_util.tree_leaves(tree)]


TXS = {
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "adam_schedule": lambda: optim.adam(optim.linear_schedule(0.1, 0.01, 5)),
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "rmsprop_bc": lambda: optim.chain(optim.scale_by_rms(bias_correction=True),
                                      optim.scale(-0.1)),
    "lion": lambda: optim.lion(1e-3),
    "adafactor": lambda: optim.adafactor(1e-2),
    "lamb": lambda: optim.lamb(1e-3),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)),
    "masked_decay": lambda: optim.chain(
        optim.scale_by_adam(),
        optim.add_decayed_weights(optim.exponential_decay(0.1, 2, 0.5),
                                  mask=lambda p: {k: k != "scale" for k in p}),
        optim.scale(-0.01)),
    "ema_amsgrad": lambda: optim.chain(optim.scale_by_amsgrad(), optim.ema(0.9),
                                       optim.scale(-0.1)),
    "adagrad": lambda: optim.adagrad(0.1),
}


@pytest.mark.parametrize("name", sorted(TXS))
def test_plan_steps_equal_the_functional_steps(name, monkeypatch):
    # five steps on a 2x4 mesh: the first runs the general path and builds the plan, the
    # other four run from the plan alone (run_fused is not called), with the bits of optax's
    # functional form (tx.update + apply_updates) run side by side
    rng = np.random.default_rng(3)
    host, specs = _mesh_params(rng)
    grads = [_place(cts.tree_util.tree_map(
        lambda a: rng.standard_normal(a.shape).astype(np.float32), host), specs)
        for _ in range(5)]
    tx = TXS[name]()
    state = TrainState.create(apply_fn=None, params=_place(host, specs), tx=tx)
    params, opt_state = _place(host, specs), tx.init(_place(host, specs))
    calls = []
    real = base.run_fused
    monkeypatch.setattr("ctrainstate._src.train_state.train_state.run_fused",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for i, g in enumerate(grads):
        state = state.apply_gradients(grads=g)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optim.apply_updates(params, updates)
        assert _bits(state.params) == _bits(params), (name, i)
        assert _bits(state.opt_state) == _bits(opt_state), (name, i)
        assert state.step == i + 1
    assert len(calls) == 1, "the plan was not used after the first step"
    assert state.__dict__["_ct_plan"].fast is not None
    # the counters' host copies (no device read) match the device values
    for x in cts.tree_util.tree_leaves(state.opt_state):
        if x.dtype == np.int32 and x.shape == ():
            assert int(x._host_scalar) == int(np.asarray(x)) == 5


def test_no_plan_for_a_transform_that_does_not_say_how_its_scalars_follow():
    # apply_if_finite's gate reads the kernel's result each step: no plan, every step general
    tx = optim.apply_if_finite(optim.adam(0.1), 3)
    state = TrainState.create(apply_fn=None, params={"w": np.ones(4, np.float32)}, tx=tx)
    g = cts.device_put({"w": np.ones(4, np.float32)})
    for _ in range(3):
        state = state.apply_gradients(grads=g)
    assert state.__dict__["_ct_plan"].fast is None
    assert int(np.asarray(state.opt_state.notfinite_count)) == 0


def test_a_wrong_scalars_annotation_is_caught_when_the_plan_is_built():
    # a transform whose `at` disagrees with the scalars it computed this step gets no plan
    def fuse(state, ctx):
        c = ctx.count(state)
        st = base.Stage(base.SCALE, [0.5 * (c + 1)], active=ctx.snapshot(),
                        at=lambda c: [0.25 * (c + 1)])
        return [st], lambda advance=True: ctx.new_scalar(state, c + 1)
    tx = base.GradientTransformationExtraArgs(
        lambda p: base.scalar(0, np.int32, p), fuse=fuse)
    state = TrainState.create(apply_fn=None, params={"w": np.ones(2, np.float32)}, tx=tx)
    state = state.apply_gradients(grads=cts.device_put({"w": np.ones(2, np.float32)}))
    assert state.__dict__["_ct_plan"].fast is None


def _stepped(n=2, tx=None):
    state = TrainState.create(apply_fn=None, params={"a": np.ones(4, np.float32),
                                                     "b": np.ones((2, 3), np.float32)},
                              tx=tx or optim.adam(0.1))
    g = cts.device_put({"a": np.full(4, 0.5, np.float32), "b": np.full((2, 3), 0.5, np.float32)})
    for _ in range(n):
        state = state.apply_gradients(grads=g)
    return state, g


def test_an_old_state_is_donated_after_a_plan_step():
    s1, g = _stepped()
    s2 = s1.apply_gradients(grads=g)
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(s1.params["a"])
    with pytest.raises(cts.DonatedBufferError):
        np.asarray(s1.opt_state[0].mu["a"])
    with pytest.raises(cts.DonatedBufferError, match="donated"):
        s1.apply_gradients(grads=g)
    s2.apply_gradients(grads=g)   # the new one steps


def test_grads_placed_otherwise_take_the_general_path_with_the_same_bits():
    # numpy grads, grads on another sharding, bfloat16 grads: the plan declines, the
    # general path converts them; the results are the functional path's
    import ml_dtypes
    for kind in ("numpy", "resharded", "bf16"):
        s, g = _stepped()
        tx = optim.adam(0.1)
        p_ref = cts.device_put({k: np.asarray(v) for k, v in s.params.items()})
        o_ref = cts.tree_util.tree_map(lambda x: cts.device_put(np.asarray(x)), s.opt_state)
        h = {k: np.asarray(v) for k, v in g.items()}
        if kind == "numpy":
            g2 = h
        elif kind == "resharded":
            g2 = {k: cts.device_put(v, cts.devices()[1]) for k, v in h.items()}
        else:
            g2 = {k: v.astype(ml_dtypes.bfloat16) for k, v in h.items()}
        s = s.apply_gradients(grads=g2)
        u, o_ref = tx.update(g2, o_ref, p_ref)
        p_ref = optim.apply_updates(p_ref, u)
        assert _bits(s.params) == _bits(p_ref), kind
        assert _bits(s.opt_state) == _bits(o_ref), kind
        s = s.apply_gradients(grads=g)   # and back on the plan
        assert s.step == 4


def test_grads_of_another_structure_raise_the_general_paths_error():
    s, g = _stepped()
    with pytest.raises(ValueError, match=r"first difference at \['b'\]"):
        s.apply_gradients(grads={"a": g["a"]})
    with pytest.raises(ValueError, match=r"grads\['b'\] has shape"):
        s.apply_gradients(grads={"a": g["a"], "b": np.ones(6, np.float32)})
    s.apply_gradients(grads=g)   # nothing was donated by the failed calls


def test_params_borrowed_after_the_plan_was_built_are_not_written():
    s, g = _stepped()
    other = TrainState.create(apply_fn=None, params=s.params, tx=optim.sgd(0.1))
    before = _bits(other.params)
    s2 = s.apply_gradients(grads=g)
    assert _bits(other.params) == before   # copied on write, as the general path does
    assert _bits(s2.params) != before


def test_a_deleted_param_is_reported_by_the_general_path():
    s, g = _stepped()
    s.params["a"].delete()
    with pytest.raises(cts.DonatedBufferError):
        s.apply_gradients(grads=g)


def test_two_threads_stepping_one_state_one_is_refused():
    big = {f"w{i}": np.ones(1 << 16, np.float32) for i in range(16)}
    state = TrainState.create(apply_fn=None, params=big, tx=optim.adam(0.1))
    g = cts.device_put({k: np.ones_like(v) for k, v in big.items()})
    state = state.apply_gradients(grads=g).apply_gradients(grads=g)
    assert state.__dict__["_ct_plan"].fast is not None
    results, errors = [], []

    def run():
        try:
            results.append(state.apply_gradients(grads=g))
        except cts.DonatedBufferError as e:
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1 and len(errors) == 3
    assert results[0].step == 3
    # one update was applied: Adam's third step from ones with constant grads
    ref = TrainState.create(apply_fn=None, params=big, tx=optim.adam(0.1))
    for _ in range(3):
        ref = ref.apply_gradients(grads=g)
    assert _bits(results[0].params) == _bits(ref.params)


def test_fields_replaced_by_keyword_arguments_on_the_plan_path():
    class State(TrainState):
        rng: object = None
    state = State.create(apply_fn=None, params={"w": np.ones(3, np.float32)}, tx=optim.adam(0.1),
                         rng=0)
    g = cts.device_put({"w": np.ones(3, np.float32)})
    for i in range(1, 4):
        state = state.apply_gradients(grads=g, rng=i)
        assert state.rng == i and state.step == i and type(state) is State
    assert state.__dict__["_ct_plan"].fast is not None
    with pytest.raises(TypeError, match="not fields"):
        state.apply_gradients(grads=g, nope=1)


def test_keyword_fields_take_the_c_step_and_match_the_python_step(monkeypatch):
    # apply_gradients(grads=..., rng=...) on the plan path: the C step (state_step) replaces
    # the fields as the Python reference (_fast_step) does, on twin states
    class State(TrainState):
        rng: object = None

    def make():
        s = State.create(apply_fn=None, params={"w": np.ones(3, np.float32)},
                         tx=optim.adam(0.1), rng=0)
        g = cts.device_put({"w": np.full(3, 0.5, np.float32)})
        for i in range(2):
            s = s.apply_gradients(grads=g, rng=i)
        return s, g
    a, g = make()
    b, _ = make()
    fb = b.__dict__["_ct_plan"].fast
    b2 = b._fast_step(fb, b.__dict__, g, {"rng": 7})
    monkeypatch.setattr(State, "_fast_step", lambda *a: pytest.fail("the Python step ran"))
    a2 = a.apply_gradients(grads=g, rng=7)
    assert type(a2) is State and a2.rng == b2.rng == 7 and a2.step == b2.step == 3
    assert sorted(a2.__dict__) == sorted(b2.__dict__)
    assert _bits(a2.params) == _bits(b2.params) and _bits(a2.opt_state) == _bits(b2.opt_state)
    a3 = a2.apply_gradients(grads=g)                   # no keywords: rng kept
    assert a3.rng == 7 and a3.step == 4


def test_a_state_with_post_init_keeps_the_general_path():
    class State(TrainState):
        def __post_init__(self):
            object.__setattr__(self, "seen", getattr(self, "seen", 0) + 1)
    state = State.create(apply_fn=None, params={"w": np.ones(3, np.float32)}, tx=optim.adam(0.1))
    g = cts.device_put({"w": np.ones(3, np.float32)})
    for _ in range(3):
        state = state.apply_gradients(grads=g)
    assert "_ct_cur" not in state.__dict__ and state.step == 3


def test_t5x_optax_wrapper_uses_the_plan_and_checks_the_target():
    from ctrainstate.t5x import optimizers as topt
    params = {"w": np.ones(5, np.float32), "b": np.ones(2, np.float32)}
    g = cts.device_put({"w": np.full(5, 0.1, np.float32), "b": np.full(2, 0.2, np.float32)})
    opt = topt.OptaxWrapper(optim.adamw(1e-2, weight_decay=0.1)).create(params)
    tx = optim.adamw(1e-2, weight_decay=0.1)
    p_ref, o_ref = cts.device_put(params), tx.init(cts.device_put(params))
    for _ in range(4):
        opt = opt.apply_gradient(g)
        u, o_ref = tx.update(g, o_ref, p_ref)
        p_ref = optim.apply_updates(p_ref, u)
    assert "_ct_cur" in opt.state.__dict__
    assert _bits(opt.target) == _bits(p_ref)
    assert _bits(opt.state.param_states) == _bits(o_ref)
    # a target replaced by the caller: the plan declines, the general path steps the new one
    fresh = cts.device_put({"w": np.zeros(5, np.float32), "b": np.zeros(2, np.float32)})
    opt2 = opt.replace(target=fresh).apply_gradient(g)
    assert not np.array_equal(np.asarray(opt2.target["w"]), np.asarray(p_ref["w"]))


@pytest.mark.parametrize("leaves", [16, 1024])
def test_python_calls_per_plan_step_are_few_and_independent_of_the_leaves(leaves):
    params = {f"l{i:04d}": np.ones(4, np.float32) for i in range(leaves)}
    state = [TrainState.create(apply_fn=None, params=params,
                               tx=optim.adamw(1e-3, weight_decay=0.01))]
    g = cts.device_put({k: np.ones(4, np.float32) for k in params})
    for _ in range(3):
        state[0] = state[0].apply_gradients(grads=g)

    def step():
        state[0] = state[0].apply_gradients(grads=g)
    calls = python_calls(step)
    assert calls <= 30, calls
    assert state[0].step == 4
    # the general path makes hundreds (it walks the trees): the count measures the plan
    state[0].__dict__.pop("_ct_cur")
    assert python_calls(step) > 60


def test_dict_params_are_flattened_and_rebuilt_by_the_plan():
    # plain nested dicts: the C plan walks them itself; a grads tree with another key, a
    # missing key or another container declines to the general path (same errors as ever)
    from ctrainstate.core import FrozenDict
    params = {"b": {"y": np.ones(2, np.float32), "x": np.ones(3, np.float32)},
              "a": np.ones(4, np.float32)}
    state = TrainState.create(apply_fn=None, params=params, tx=optim.sgd(0.5))
    g = cts.device_put(cts.tree_util.tree_map(np.ones_like, params))
    state = state.apply_gradients(grads=g).apply_gradients(grads=g)
    fast = state.__dict__["_ct_plan"].fast
    assert fast.dicts
    s3 = state.apply_gradients(grads=g)
    assert list(s3.params) == ["a", "b"] and list(s3.params["b"]) == ["x", "y"]
    assert np.asarray(s3.params["b"]["x"]).tolist() == [-0.5] * 3
    with pytest.raises(ValueError, match="structure of params"):
        s3.apply_gradients(grads={"a": g["a"], "b": {"x": g["b"]["x"], "z": g["b"]["y"]}})
    with pytest.raises(ValueError, match="structure of params"):
        s3.apply_gradients(grads={"a": g["a"], "b": {"x": g["b"]["x"]}})
    with pytest.raises(ValueError, match="structure of params"):
        s3.apply_gradients(grads=FrozenDict(g))
    s4 = s3.apply_gradients(grads=g)
    assert np.asarray(s4.params["a"]).tolist() == [-1.0] * 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_plan_steps_of_16_bit_state_equal_the_general_steps(dtype):
    # 16-bit params, grads and moments are loaded and stored in their dtype by the kernel:
    # the plan runs them too, with the general in-place path's bits
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    rng = np.random.default_rng(6)
    params = {"w": rng.standard_normal((4, 8)).astype(dt), "b": rng.standard_normal(8).astype(dt)}
    grads = [cts.device_put({k: rng.standard_normal(v.shape).astype(dt)
                             for k, v in params.items()}) for _ in range(4)]
    runs = []
    for use_plan in (True, False):
        s = TrainState.create(apply_fn=None, params=params,
                              tx=optim.adamw(1e-2, weight_decay=0.1, mu_dtype=dt))
        for g in grads:
            if not use_plan:
                s.__dict__.pop("_ct_cur", None)
            s = s.apply_gradients(grads=g)
        assert (s.__dict__["_ct_plan"].fast is not None) and s.params["w"].dtype == dt
        runs.append(_bits((s.params, s.opt_state)))
    assert runs[0] == runs[1]


def _same_tree(a, b, path="state"):
    """a and b have the same nodes (exact types, dict keys in the same order) and the same
    leaf objects."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same_tree(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{path}[{i}]")
    else:
        assert a is b, path


@pytest.mark.parametrize("name", sorted(TXS))
def test_the_plan_builds_the_state_tree_unflatten_would(name):
    # the plan step builds the optimizer state's tree in C from its template: node for node
    # (types, key order) and leaf for leaf what the state's treedef unflattens
    rng = np.random.default_rng(5)
    host, specs = _mesh_params(rng)
    g = _place(cts.tree_util.tree_map(np.ones_like, host), specs)
    state = TrainState.create(apply_fn=None, params=_place(host, specs), tx=TXS[name]())
    for _ in range(3):
        state = state.apply_gradients(grads=g)
    fast = state.__dict__["_ct_plan"].fast
    assert fast.dicts and _obase._state_template(fast.sdef) is not None
    sdef = fast.sdef

    class NoUnflatten:            # the plan step must not need the treedef's unflatten
        def unflatten(self, leaves):
            raise AssertionError("unflatten called")
    fast.sdef = NoUnflatten()
    state = state.apply_gradients(grads=g)
    fast.sdef = sdef
    arrays = state.__dict__["_ct_cur"]
    _same_tree(state.opt_state, sdef.unflatten(arrays[fast.nparams:]))
    assert cts.tree_util.tree_structure(state.opt_state) == sdef


def test_state_template_only_for_nodes_built_without_python_code():
    import collections
    import typing
    from ctrainstate.core import FrozenDict

    class NT(typing.NamedTuple):
        a: int
        b: int

    class Sub(NT):                       # a subclass keeping the generated __new__
        pass

    class OwnNew(NT):
        def __new__(cls, a, b):
            return super().__new__(cls, a, b + 1)

    class OwnInit(NT):
        def __init__(self, *args):
            self.extra = 1

    assert _obase._plain_namedtuple(NT) and _obase._plain_namedtuple(Sub)
    assert _obase._plain_namedtuple(collections.namedtuple("P", "x y"))
    assert not _obase._plain_namedtuple(OwnNew) and not _obase._plain_namedtuple(OwnInit)
    assert not _obase._plain_namedtuple(tuple) and not _obase._plain_namedtuple(dict)
    spec = cts.tree_util.tree_structure
    t, types = _obase._state_template(spec(({"b": 1, "a": (2, None)}, NT(3, Sub(4, 5)), ())))
    assert t == ({"a": (0, None), "b": 1}, NT(2, Sub(3, 4)), ()) and types == {NT, Sub}
    assert type(t[1]) is NT and type(t[1].b) is Sub
    assert _obase._state_template(spec({"m": FrozenDict({"a": 1})})) is None   # registered node
    assert _obase._state_template(spec([NT(1, 2)])) is None                     # a list
    assert _obase._state_template(spec((OwnNew(1, 2),))) is None


def test_set_structure_checks_the_state_template():
    state, g = _stepped(3)
    fast = state.__dict__["_ct_plan"].fast
    plan, prog = fast.cplan, _obase._dict_program(fast.pdef)
    good, types = _obase._state_template(fast.sdef)
    n = fast.sdef.num_leaves

    def step(arrays):   # one plan step after the state's (its scalars and counter)
        c = fast.count
        fast.count += 1
        return plan.step_tree(arrays, g, [s if f is None else f(c) for s, f in fast.scalars],
                              np.int32(c + 1))
    r = step(state.__dict__["_ct_cur"])
    assert len(r) == 3      # (arrays, params, state): the template is set
    bad = [
        (0, types),                                    # n leaves, one given
        (tuple(range(n)) + (0,), types),              # an index twice
        (tuple(range(n - 1)) + (n,), types),          # an index out of range
        ([list(range(n))], types),                     # a list node
        (good, frozenset()),                           # a namedtuple type not listed
    ]
    for template, ts in bad:
        with pytest.raises(ValueError, match="template"):
            plan.set_structure(prog, template, ts)
    with pytest.raises(TypeError, match="set or frozenset"):
        plan.set_structure(prog, good, list(types))
    r = step(r[0])
    assert len(r) == 3 and type(r[2][0]) is type(good[0])   # the good template still set
    plan.set_structure(prog)                                  # none: (arrays, params)
    assert len(step(r[0])) == 2


def test_state_step_in_c_makes_the_state_fast_step_makes():
    # _C.state_step (TrainState.apply_gradients' plan step with FastPlan.step's dict branch)
    # against the Python reference (_fast_step) on two twin states: fields, bits, structure
    import signal
    from ctrainstate import _C
    a, g = _stepped(3)
    b, _ = _stepped(3)
    for _ in range(3):
        fa, fb = a.__dict__["_ct_plan"].fast, b.__dict__["_ct_plan"].fast
        assert fa.cplan.has_state_template
        a2 = _C.state_step(a, a.__dict__, fa, g, {})
        b2 = b._fast_step(fb, b.__dict__, g, {})
        assert type(a2) is type(b2) and a2.step == b2.step == a.step + 1
        assert sorted(a2.__dict__) == sorted(b2.__dict__)
        assert _bits(a2.params) == _bits(b2.params)
        assert _bits(a2.opt_state) == _bits(b2.opt_state)
        assert (cts.tree_util.tree_structure(a2.opt_state)
                == cts.tree_util.tree_structure(b2.opt_state))
        assert a2.apply_fn is a.apply_fn and a2.tx is a.tx
        assert a2.__dict__["_ct_plan"] is a.__dict__["_ct_plan"]
        with pytest.raises(cts.DonatedBufferError):
            np.asarray(a.params["a"])
        a, b = a2, b2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert fa.count == 6


def test_state_step_in_c_raises_ctrl_c_before_the_kernel_and_restores_on_errors(monkeypatch):
    # a SIGINT while a stage's scalar function runs (Python code, before the kernel) raises
    # KeyboardInterrupt there: nothing is written, the state stays usable; an error there
    # leaves the state as it was too. No handler is installed for the step.
    import signal
    state, g = _stepped(3)
    monkeypatch.setattr(TrainState, "_fast_step", lambda *a: pytest.fail("the Python step ran"))
    fast = state.__dict__["_ct_plan"].fast
    pairs = list(fast.scalars)
    s0, f0 = next((s, f) for s, f in pairs if f is not None)
    seen = []

    def interrupting(c):
        seen.append(signal.getsignal(signal.SIGINT))
        signal.raise_signal(signal.SIGINT)
        return f0(c)
    fast.scalars = [(s, interrupting if f is f0 else f) for s, f in pairs]
    before = np.asarray(state.params["a"]).copy()
    step = state.step
    with pytest.raises(KeyboardInterrupt):
        state.apply_gradients(grads=g)
    assert seen == [signal.default_int_handler]        # the step swapped no handler
    assert state.step == step                           # nothing written, nothing donated
    np.testing.assert_array_equal(np.asarray(state.params["a"]), before)

    def failing(c):
        raise ValueError("scalar failed")
    fast.scalars = [(s, failing if f is not None else f) for s, f in pairs]
    with pytest.raises(ValueError, match="scalar failed"):
        state.apply_gradients(grads=g)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    np.testing.assert_array_equal(np.asarray(state.params["a"]), before)   # not donated
    fast.scalars = pairs
    s2 = state.apply_gradients(grads=g)
    assert s2.step == step + 1 and s2.__dict__["_ct_plan"].fast is fast   # the C step again


def test_state_step_in_c_raises_ctrl_c_during_the_kernel_after_the_commit(monkeypatch):
    # a SIGINT that reaches the main thread after the kernel started is raised after the
    # commit, with the caller's state object become the new state. The probe signals the
    # main thread right after the kernel, from C (libc's raise() through ctypes runs no
    # bytecode and, unlike signal.raise_signal, runs no handler), so CPython only records
    # it there.
    import ctypes
    import functools
    import signal
    from ctrainstate import _C
    state, g = _stepped(3)
    monkeypatch.setattr(TrainState, "_fast_step", lambda *a: pytest.fail("the Python step ran"))
    before = np.asarray(state.params["a"]).copy()
    step = state.step
    _C.state_step_probe(functools.partial(getattr(ctypes.CDLL(None), "raise"),
                                          int(signal.SIGINT)))
    try:
        with pytest.raises(KeyboardInterrupt):
            state.apply_gradients(grads=g)
    finally:
        _C.state_step_probe(None)
    assert state.step == step + 1                      # the caller's object is the new state
    assert not np.array_equal(np.asarray(state.params["a"]), before)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    s2 = state.apply_gradients(grads=g)                # and it steps on
    assert s2.step == step + 2
    with pytest.raises(TypeError, match="callable or None"):
        _C.state_step_probe(3)


def test_state_step_argument_checks():
    from ctrainstate import _C
    with pytest.raises(TypeError, match="state_step"):
        _C.state_step(1, 2, 3)
    with pytest.raises(TypeError, match="state_step"):
        _C.state_step(1, [], 3, 4, {})
    with pytest.raises(TypeError, match="kwargs: a dict"):
        _C.state_step(1, {}, 3, 4, 5)
    with pytest.raises(TypeError, match="state_step"):
        _C.state_step(1, {}, 3, 4)
    with pytest.raises(TypeError, match="not callable"):
        _C.state_step_setup(1, [0], 7)
