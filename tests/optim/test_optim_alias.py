"""The optimizer factories (optim/alias.py): optax's signatures with type annotations,
hyper-parameters checked when an optimizer is built, adadelta's default learning rate."""
import inspect
import typing
import warnings

import numpy as np
import pytest

import ctrainstate.optim as optim
from ctrainstate.optim import alias
import ctrainstate as cts

try:
    import jax.numpy as jnp
    import optax
    HAVE_OPTAX = True
except Exception:   # pragma: no cover - the file runs without jax
    HAVE_OPTAX = False

needs_optax = pytest.mark.skipif(not HAVE_OPTAX, reason="needs optax")
FACTORIES = sorted(set(alias.__all__))


@pytest.mark.parametrize("name", FACTORIES)
def test_optimizer_factories_carry_type_annotations(name):
    f = getattr(optim, name)
    hints = typing.get_type_hints(f)
    missing = [p for p in inspect.signature(f).parameters if p not in hints]
    assert not missing, f"{name}: parameters without annotation: {missing}"
    assert hints["return"] is optim.GradientTransformationExtraArgs


# every numeric hyper-parameter of every factory: (factory, parameter)
_NOT_NUMBERS = {"mask", "weight_decay_mask", "trust_ratio_mask", "key", "seed", "mu_dtype",
                "accumulator_dtype", "dtype_momentum", "nesterov", "factored",
                "multiply_by_parameter_scale", "centered", "eps_in_sqrt", "bias_correction",
                "bias_correction_mu", "bias_correction_nu"}
NUMERIC = [(n, p) for n in FACTORIES for p in inspect.signature(getattr(optim, n)).parameters
           if p not in _NOT_NUMBERS]


def _build(name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        f = getattr(optim, name)
        if "learning_rate" not in kw and name not in ("adafactor", "adadelta"):
            kw["learning_rate"] = 0.1
        return f(**kw)


@pytest.mark.parametrize("name, param", NUMERIC)
def test_hyperparameters_are_validated_when_the_optimizer_is_built(name, param):
    """A string where a number belongs fails when the optimizer is built, naming the
    argument (it used to build, and fail at the first step inside float())."""
    with pytest.raises(TypeError, match=param if param != "learning_rate" else "learning_rate"):
        _build(name, **{param: "x"})


def test_adam_of_an_empty_string_is_refused_when_built():
    with pytest.raises(TypeError, match="learning_rate must be a number or a schedule"):
        optim.adam("")
    with pytest.raises(TypeError, match="b1"):
        optim.adam(1e-3, b1=None)


def test_negative_rates_build_and_step_as_optax_does():
    """optax rejects no negative hyper-parameter when building (a negative learning rate
    ascends): neither does ctrainstate."""
    p = {"w": np.linspace(-1, 1, 4).astype(np.float32)}
    g = {"w": np.array([0.5, -1.0, 2.0, 0.0], np.float32)}
    up, _ = optim.adam(0.1).update(g, optim.adam(0.1).init(p), p)
    down, _ = optim.adam(-0.1).update(g, optim.adam(-0.1).init(p), p)
    np.testing.assert_allclose(np.asarray(down["w"]), -np.asarray(up["w"]), rtol=1e-6)
    for tx in (optim.sgd(-1.0, momentum=-0.5), optim.adamw(0.1, weight_decay=-1.0),
               optim.rmsprop(0.1, decay=-0.1), optim.lion(-0.1)):
        tx.update(g, tx.init(p), p)


def _adadelta_ref(g_steps, rho=0.9, eps=1e-6):
    """optax.scale_by_adadelta in float64 (learning_rate=None: not negated)."""
    e_g = e_x = 0.0
    out = []
    for g in g_steps:
        g = g.astype(np.float64)
        e_g = (1 - rho) * g * g + rho * e_g
        u = np.sqrt(e_x + eps) / np.sqrt(e_g + eps) * g
        e_x = (1 - rho) * u * u + rho * e_x
        out.append(u)
    return out


def test_adadelta_default_learning_rate_none_runs_unscaled():
    tx = optim.adadelta()
    p = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
    gs = [np.array([2.0, -4.0, 6.0], np.float32), np.array([1.0, 1.0, -1.0], np.float32)]
    state = tx.init(p)
    for g, want in zip(gs, _adadelta_ref(gs)):
        u, state = tx.update({"w": g}, state, p)
        np.testing.assert_allclose(np.asarray(u["w"]), want, rtol=1e-5)


def _optax_adadelta(p, grads):
    theirs = optax.adadelta()
    t = theirs.init(jnp.asarray(p))
    out = []
    for g in grads:
        v, t = theirs.update(jnp.asarray(g), t, jnp.asarray(p))
        out.append(v)
    return out


def test_adadelta_default_learning_rate_none_matches_optax(jax_ref):
    p = np.array([1.0, 2.0, 3.0], np.float32)
    grads = (np.array([2.0, -4.0, 6.0], np.float32), np.array([1.0, 1.0, -1.0], np.float32))
    ours = optim.adadelta()
    s = ours.init({"w": p})
    for g, v in zip(grads, jax_ref("updates", lambda jax: _optax_adadelta(p, grads))):
        u, s = ours.update({"w": g}, s, {"w": p})
        np.testing.assert_allclose(np.asarray(u["w"]), v, rtol=1e-6)


# --- optax 0.2.8's adadelta, novograd, rprop, adan, optimistic gradient, normalize_by_update_norm,
# scale_by_param_block_norm and distance-over-gradients: float64 references of optax's rules,
# sharded == unsharded, errors, and (with optax) live parity of updates and states

f32 = np.float32
STEPS = 4
_rng = np.random.default_rng(0)
P0 = {"a": _rng.normal(size=(4, 8)).astype(f32),
      "b": {"c": _rng.normal(size=(8,)).astype(f32), "d": _rng.normal(size=(2, 4, 2)).astype(f32)}}


def _grads(i):
    r = np.random.default_rng(100 + i)
    g = cts.tree_util.tree_map(lambda p: r.normal(size=p.shape).astype(f32), P0)
    if i == 2:   # a sign flip of some entries for rprop, repeated grads elsewhere
        g["a"][0] = -g["a"][0]
        g["b"]["c"][:3] = 0.0
    return g


def _leaves(t):
    return cts.tree_util.tree_leaves(t)


def _np(t):
    return cts.tree_util.tree_map(lambda x: np.asarray(x), t)


def _run(tx, params=None, steps=STEPS):
    """Updates of each step (params moved by them) and the final state."""
    params = cts.device_put(P0) if params is None else params
    state = tx.init(params)
    ups = []
    for i in range(steps):
        u, state = tx.update(_grads(i), state, params)
        ups.append(_np(u))
        params = optim.apply_updates(params, u)
    return ups, state


def ref_adadelta(rho=0.9, eps=1e-6, lr=1.0):
    def run(steps=STEPS):
        P = [p.astype(np.float64) for p in _leaves(P0)]
        eg = [np.zeros_like(p) for p in P]
        ex = [np.zeros_like(p) for p in P]
        out = []
        for i in range(steps):
            us = []
            for k, g in enumerate(_leaves(_grads(i))):
                eg[k] = (1 - rho) * g.astype(np.float64) ** 2 + rho * eg[k]
                u = np.sqrt(ex[k] + eps) / np.sqrt(eg[k] + eps) * g
                ex[k] = (1 - rho) * u ** 2 + rho * ex[k]
                us.append(-lr * u)
            out.append(us)
        return out, {"e_g": eg, "e_x": ex}
    return run


def ref_novograd(b1=0.9, b2=0.25, eps=1e-6, eps_root=0.0, wd=0.0, lr=0.1):
    def run(steps=STEPS):
        P = [p.astype(np.float64) for p in _leaves(P0)]
        mu = [np.zeros_like(p) for p in P]
        nu = [0.0 for _ in P]
        out = []
        for i in range(steps):
            us = []
            for k, g in enumerate(_leaves(_grads(i))):
                g = g.astype(np.float64)
                n2 = float(np.sum(g * g))
                nu[k] = n2 if i == 0 else (1 - b2) * n2 + b2 * nu[k]
                add = g / (np.sqrt(nu[k] + eps_root) + eps) + wd * P[k]
                mu[k] = add if i == 0 else b1 * mu[k] + add
                us.append(-lr * mu[k])
            P = [p + u for p, u in zip(P, us)]
            out.append(us)
        return out, {"mu": mu, "nu": nu, "count": steps}
    return run


def ref_rprop(lr=0.1, em=0.5, ep=1.2, lo=1e-6, hi=50.0):
    def run(steps=STEPS):
        st = [np.full(p.shape, lr) for p in _leaves(P0)]
        prev = [np.zeros(p.shape) for p in _leaves(P0)]
        out = []
        for i in range(steps):
            us = []
            for k, g in enumerate(_leaves(_grads(i))):
                g = g.astype(np.float64)
                s = g * prev[k]
                st[k] = np.where(s == 0, st[k], np.clip(st[k] * np.where(s > 0, ep, em), lo, hi))
                new_prev = np.where(s < 0, 0.0, st[k] * np.sign(g))
                us.append(-np.where(s < 0, 0.0, prev[k]))
                prev[k] = new_prev
            out.append(us)
        return out, {"step_sizes": st, "prev_updates": prev}
    return run


def ref_adan(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8, wd=0.0, lr=0.1):
    def run(steps=STEPS):
        P = [p.astype(np.float64) for p in _leaves(P0)]
        m, v, n, gp = ([np.zeros_like(p) for p in P] for _ in range(4))
        out = []
        for i in range(steps):
            us = []
            t = i + 1
            for k, g in enumerate(_leaves(_grads(i))):
                g = g.astype(np.float64)
                d = np.zeros_like(g) if i == 0 else g - gp[k]
                m[k] = (1 - b1) * g + b1 * m[k]
                v[k] = (1 - b2) * d + b2 * v[k]
                n[k] = (1 - b3) * (g + (1 - b2) * d) ** 2 + b3 * n[k]
                u = (m[k] / (1 - b1 ** t) + (1 - b2) * v[k] / (1 - b2 ** t)) / (
                    np.sqrt(n[k] / (1 - b3 ** t) + eps_root) + eps)
                us.append(-lr * (u + wd * P[k]))
                gp[k] = g
            P = [p + u for p, u in zip(P, us)]
            out.append(us)
        return out, {"m": m, "v": v, "n": n, "g": gp, "t": steps}
    return run


def ref_ogd(lr=0.1, alpha=1.0, beta=1.0):
    def run(steps=STEPS):
        prev = None
        out = []
        for i in range(steps):
            gs = [g.astype(np.float64) for g in _leaves(_grads(i))]
            pr = gs if prev is None else prev
            out.append([-lr * ((alpha + beta) * g - beta * p) for g, p in zip(gs, pr)])
            prev = gs
        return out, {"previous_gradient": prev}
    return run


def ref_normalize(scale_factor=1.0, eps=1e-6):
    def run(steps=STEPS):
        out = []
        for i in range(steps):
            gs = [g.astype(np.float64) for g in _leaves(_grads(i))]
            nrm = (np.sqrt(sum(np.sum(g * g) for g in gs)) + eps) / scale_factor
            out.append([g / nrm for g in gs])
        return out, {}
    return run


def ref_block_norm(min_scale=1e-3, lr=0.1):
    def run(steps=STEPS):
        P = [p.astype(np.float64) for p in _leaves(P0)]
        out = []
        for i in range(steps):
            us = [-lr * g * max(np.linalg.norm(p.ravel()), min_scale)
                  for g, p in zip(_leaves(_grads(i)), P)]
            P = [p + u for p, u in zip(P, us)]
            out.append(us)
        return out, {}
    return run


def ref_dog(reps_rel=1e-6, eps=1e-8, global_scale=1.0, lr=0.1):
    def run(steps=STEPS):
        P = [p.astype(np.float64) for p in _leaves(P0)]
        P00 = [p.copy() for p in P]
        d = [reps_rel * (1 + np.linalg.norm(p.ravel())) for p in P]
        sos = [0.0 for _ in P]
        out = []
        for i in range(steps):
            us = []
            for k, g in enumerate(_leaves(_grads(i))):
                d[k] = max(d[k], np.linalg.norm((P[k] - P00[k]).ravel()))
                sos[k] += float(np.sum(g.astype(np.float64) ** 2))
                us.append(-lr * global_scale * d[k] / np.sqrt(sos[k] + eps) * g)
            P = [p + u for p, u in zip(P, us)]
            out.append(us)
        return out, {"max_dist": d, "grad_sum_of_squares": sos}
    return run


# name: (ctrainstate/optax builder, float64 reference, state-type name of the first state)
CASES = {
    "adadelta": (lambda o: o.adadelta(1.0), ref_adadelta(), "ScaleByAdaDeltaState"),
    "adadelta_wd": (lambda o: o.adadelta(0.5, rho=0.8, eps=1e-4, weight_decay=0.0),
                    ref_adadelta(rho=0.8, eps=1e-4, lr=0.5), None),
    "novograd": (lambda o: o.novograd(0.1), ref_novograd(), "ScaleByNovogradState"),
    "novograd_wd": (lambda o: o.novograd(0.1, b1=0.8, b2=0.5, eps_root=1e-3, weight_decay=0.1),
                    ref_novograd(b1=0.8, b2=0.5, eps_root=1e-3, wd=0.1), None),
    "rprop": (lambda o: o.rprop(0.1), ref_rprop(), "ScaleByRpropState"),
    "rprop_clip": (lambda o: o.rprop(0.1, eta_minus=0.3, eta_plus=2.0, min_step_size=0.05,
                                     max_step_size=0.25),
                   ref_rprop(em=0.3, ep=2.0, lo=0.05, hi=0.25), None),
    "adan": (lambda o: o.adan(0.1), ref_adan(), "ScaleByAdanState"),
    "adan_wd": (lambda o: o.adan(0.1, b1=0.9, b2=0.8, b3=0.95, eps_root=0.0, weight_decay=0.1),
                ref_adan(b1=0.9, b2=0.8, b3=0.95, eps_root=0.0, wd=0.1), None),
    "ogd": (lambda o: o.optimistic_gradient_descent(0.1), ref_ogd(),
            "ScaleByOptimisticGradientState"),
    "ogd_ab": (lambda o: o.optimistic_gradient_descent(0.1, alpha=0.5, beta=2.0),
               ref_ogd(alpha=0.5, beta=2.0), None),
    "normalize": (lambda o: o.normalize_by_update_norm(), ref_normalize(), "EmptyState"),
    "normalize_sf": (lambda o: o.normalize_by_update_norm(scale_factor=-0.5, eps=0.1),
                     ref_normalize(-0.5, 0.1), None),
    "block_norm": (lambda o: o.chain(o.scale_by_param_block_norm(), o.sgd(0.1)),
                   ref_block_norm(), None),
    "dog": (lambda o: o.chain(o.scale_by_distance_over_gradients(), o.sgd(0.1)), ref_dog(), None),
    "dog_scaled": (lambda o: o.chain(o.scale_by_distance_over_gradients(
        reps_rel=1e-2, eps=1e-4, global_scale=2.0), o.sgd(1.0)),   # lr * scale > 1: max_dist grows
        ref_dog(reps_rel=1e-2, eps=1e-4, global_scale=2.0, lr=1.0), None),
}


def _states(state):
    """The NamedTuple states inside a (chain's) state, in order."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return [state]
    if isinstance(state, tuple):
        return [s for x in state for s in _states(x)]
    return []


def _first_state(state, field=None):
    """The first state (with ``field``, if given) of a chain's state."""
    return next(s for s in _states(state) if field is None or field in s._fields)


@pytest.mark.parametrize("name", sorted(CASES))
def test_updates_match_float64_reference(name):
    make, ref, state_name = CASES[name]
    ups, state = _run(make(optim))
    want, want_state = ref()
    for step, (got, exp) in enumerate(zip(ups, want)):
        for x, y in zip(_leaves(got), exp):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6, err_msg=f"{name} step {step}")
    if state_name is not None:
        assert state_name in [type(s).__name__ for s in _states(state)]
    for field, exp in want_state.items():
        got = getattr(_first_state(state, field), field)
        if isinstance(exp, int):
            assert int(np.asarray(got)) == exp
            continue
        for x, y in zip(_leaves(got), exp):
            np.testing.assert_allclose(np.asarray(x, np.float64).ravel(),
                                       np.asarray(y, np.float64).ravel(), rtol=2e-5, atol=1e-6,
                                       err_msg=f"{name} state.{field}")


def test_state_structures_and_dtypes():
    p = cts.device_put(P0)
    st = optim.scale_by_novograd().init(p)
    assert st._fields == ("count", "mu", "nu")
    assert all(np.asarray(n).shape == () and n.dtype == np.float32 for n in _leaves(st.nu))
    st = optim.scale_by_adan().init(p)
    assert st._fields == ("m", "v", "n", "g", "t") and st.t.dtype == np.int32
    st = optim.scale_by_optimistic_gradient().init(p)
    assert st._fields == ("is_initial_step", "previous_gradient")
    assert np.asarray(st.is_initial_step).dtype == np.bool_ and bool(np.asarray(st.is_initial_step))
    st = optim.scale_by_distance_over_gradients().init(p)
    assert st._fields == ("max_dist", "grad_sum_of_squares", "init_params")
    assert all(np.asarray(s).shape == (1,) for s in _leaves(st.grad_sum_of_squares))
    assert optim.ScaleByAdaDeltaState._fields == ("e_g", "e_x")
    assert optim.ScaleByRpropState._fields == ("step_sizes", "prev_updates")
    for n in ("adadelta", "novograd", "rprop", "adan", "optimistic_gradient_descent",
              "optimistic_adam", "scale_by_adadelta", "scale_by_novograd", "scale_by_rprop",
              "scale_by_adan", "scale_by_optimistic_gradient", "normalize_by_update_norm",
              "scale_by_param_block_norm", "scale_by_distance_over_gradients",
              "ScaleByAdanState", "ScaleByDistanceOverGradientsState"):
        assert n in optim.__all__, n


def _placed():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    specs = {"a": cts.P("data", "model"), "b": {"c": cts.P("model"), "d": cts.P(None, "model")}}
    return cts.tree_util.tree_map(lambda x, s: cts.device_put(x, cts.NamedSharding(mesh, s)),
                                  P0, specs, is_leaf=lambda x: isinstance(x, cts.PartitionSpec))


@pytest.mark.parametrize("name", ["adadelta", "novograd_wd", "rprop", "adan_wd", "ogd",
                                  "normalize", "block_norm", "dog"])
def test_sharded_equals_unsharded(name):
    tx = CASES[name][0](optim)
    want, _ = _run(tx)
    placed = _placed()
    got, state = _run(tx, params=placed)
    for a, b in zip(got, want):
        for x, y in zip(_leaves(a), _leaves(b)):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    # the moments stay sharded like the params
    big = [x for x in _leaves(state) if getattr(x, "shape", ()) == (4, 8)]
    for x in big:
        assert x.sharding.spec == cts.P("data", "model"), (name, x.sharding)


def test_optimistic_adam_warns_and_chains():
    with pytest.warns(DeprecationWarning):
        tx = optim.optimistic_adam(0.1)
    st = tx.init(cts.device_put(P0))
    assert [type(s).__name__ for s in st] == ["ScaleByAdamState", "ScaleByOptimisticGradientState",
                                              "EmptyState"]


def test_errors():
    p = cts.device_put(P0)
    with pytest.raises(TypeError, match="learning_rate must be a number, not a schedule"):
        optim.rprop(lambda c: 0.1)
    with pytest.raises(TypeError, match="scale_by_adan: b1"):
        optim.scale_by_adan(b1="0.9")
    with pytest.raises(TypeError, match="alpha"):
        optim.scale_by_optimistic_gradient(alpha=[1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="does not support learning rate schedules"):
            optim.optimistic_adam(lambda c: 0.1)
    for tx in (optim.novograd(0.1), optim.scale_by_param_block_norm(),
               optim.scale_by_distance_over_gradients()):
        st = tx.init(p)
        with pytest.raises(ValueError, match="needs params"):
            tx.update(_grads(0), st)
    with pytest.raises(TypeError, match="expected its state ScaleByAdanState"):
        optim.scale_by_adan().update(_grads(0), optim.scale_by_rprop(0.1).init(p))
    with pytest.raises(ValueError, match="param_dtype"):
        optim.scale_by_distance_over_gradients(param_dtype=np.int32)


def _fields(state):
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return (type(state).__name__, tuple((f, _fields(getattr(state, f))) for f in state._fields))
    if isinstance(state, tuple):
        return tuple(_fields(s) for s in state)
    return None


PARITY = sorted(CASES) + ["optimistic_adam"]


@pytest.mark.parametrize("name", PARITY)
def test_matches_optax(name, jax_ref):
    if name == "optimistic_adam":
        def make(o):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return o.optimistic_adam(0.1, optimism=0.05)
    else:
        make = CASES[name][0]
    # optimistic_adam's first stage is the existing fused nesterov scale_by_adam, whose float32
    # roundings differ from XLA's by up to ~1e-5 relative (test_optim_transforms.py's nadam bound)
    rtol = 1e-5 if name == "optimistic_adam" else 1e-6
    ours, ours_state = _run(make(optim))

    def run_optax(jax):
        optax = pytest.importorskip("optax")
        jnp = jax.numpy
        tx = make(optax)
        params = jax.tree.map(jnp.asarray, P0)
        state = tx.init(params)
        updates = []
        for i in range(STEPS):
            u, state = tx.update(jax.tree.map(jnp.asarray, _grads(i)), state, params)
            updates.append(jax.tree.leaves(u))
            params = optax.apply_updates(params, u)
        return {"updates": updates, "fields": _fields(state), "state": jax.tree.leaves(state)}

    theirs = jax_ref("optax", run_optax)
    for a, b in zip(ours, theirs["updates"], strict=True):
        for x, y in zip(_leaves(a), b, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * max(np.abs(y).max(), 1e-3))
    assert _fields(ours_state) == theirs["fields"]
    for x, y in zip(_leaves(ours_state), theirs["state"], strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * max(np.abs(y).max(), 1e-3))
