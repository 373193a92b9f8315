"""The optimizer factories (optim/alias.py): optax's signatures with type annotations,
hyper-parameters checked when an optimizer is built, adadelta's default learning rate."""
import inspect
import typing
import warnings

import numpy as np
import pytest

import ctrainstate.optim as optim
from ctrainstate.optim import alias

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
