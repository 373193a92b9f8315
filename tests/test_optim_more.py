"""optax's losses and small transforms added to ctrainstate.optim: each loss against a float64
numpy reference written from optax's formula and against live optax (values and jax.grad),
sharded inputs against one device, 16-bit dtypes; each transform stepped against optax on
the same grads (functional update and TrainState.apply_gradients), its state structure and
its errors. The optax sides are recorded (tests/data/recorded; `jax_ref`), and compared live
in each test's twin marked `parity`."""
import warnings

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.optim as optim
from ctrainstate.train_state import TrainState

try:
    import jax
    import jax.numpy as jnp
    import optax
    HAVE_JAX = True
except Exception:   # pragma: no cover - the file runs without jax
    HAVE_JAX = False

needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="needs jax and optax")
f32 = np.float32
L = optim.losses

# --- inputs -------------------------------------------------------------------------------------

_rng = np.random.default_rng(0)
X = (_rng.normal(size=(8, 6)) * 3).astype(f32)              # logits / predictions / scores
Y = _rng.normal(size=(8, 6)).astype(f32)                    # targets
B = (_rng.random((8, 6)) > 0.5).astype(f32)                 # binary labels
PM = np.where(_rng.random((8, 6)) > 0.5, 1, -1).astype(f32)  # +-1 targets
LAB = _rng.integers(0, 6, size=8)
LAB2 = np.array([0, 1, 0, 1, 2, 2, 0, 1])                   # ntxent: every row has a positive


def _softmax64(z):
    z = z.astype(np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


PROBS = _softmax64(Y).astype(f32)
PROBS[0, 1] = 0.0                                           # a zero target (KL's where)
PROBS /= PROBS.sum(-1, keepdims=True)
LOGP = np.log(_softmax64(X)).astype(f32)
LOGT = np.log(_softmax64(Y)).astype(f32)


# --- float64 references from optax's formulas ---------------------------------------------------

def _d(a):
    return np.asarray(a, np.float64)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def ref_sbce(x, y):
    x, y = _d(x), _d(y)
    return -y * _log_sigmoid(x) - (1 - y) * _log_sigmoid(-x)


def ref_focal(x, y, alpha=None, gamma=2.0):
    x, y = _d(x), _d(y)
    p = 1 / (1 + np.exp(-x))
    p_t = p * y + (1 - p) * (1 - y)
    loss = ref_sbce(x, y) * (1 - p_t) ** gamma
    return loss if alpha is None else (alpha * y + (1 - alpha) * (1 - y)) * loss


def ref_huber(p, t, delta=1.0):
    e = np.abs(_d(p) - _d(t))
    return np.where(e <= delta, 0.5 * e ** 2, 0.5 * delta ** 2 + delta * (e - delta))


def ref_log_cosh(p, t):
    return np.log(np.cosh(_d(p) - _d(t)))


def ref_mc_hinge(s, lab):
    s = _d(s)
    oh = np.eye(s.shape[-1])[lab]
    return (s + 1 - oh).max(-1) - (s * oh).sum(-1)


def ref_mc_perceptron(s, lab):
    s = _d(s)
    return s.max(-1) - s[np.arange(len(lab)), lab]


def ref_kl(lp, t):
    lp, t = _d(lp), _d(t)
    return (t * (np.where(t == 0, 0, np.log(np.where(t == 0, 1, t))) - lp)).sum(-1)


def ref_cos(a, b, epsilon=0.0):
    a, b = _d(a), _d(b)
    na = np.sqrt(np.maximum((a * a).sum(-1, keepdims=True), epsilon))
    nb = np.sqrt(np.maximum((b * b).sum(-1, keepdims=True), epsilon))
    return ((a / na) * (b / nb)).sum(-1)


def ref_safe_ce(x, y):
    x, y = _d(x), _d(y)
    ls = x - x.max(-1, keepdims=True)
    ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
    return -np.where(y != 0, y * ls, 0).sum(-1)


def ref_poly(x, y, epsilon=2.0):
    p = _softmax64(x)
    return ref_safe_ce(x, y) + epsilon * (_d(y) * (1 - p)).sum(-1)


def ref_triplet(a, p, n, norm_degree=2, margin=1.0, eps=1e-6):
    a, p, n = _d(a), _d(p), _d(n)
    dp = ((a - p) ** norm_degree).sum(-1) + eps
    dn = ((a - n) ** norm_degree).sum(-1) + eps
    return np.maximum(dp ** (1 / norm_degree) - dn ** (1 / norm_degree) + margin, 0)


def ref_ntxent(e, lab, temperature=0.07):
    e = _d(e)
    n = e.shape[0]
    u = e / np.sqrt(np.maximum((e * e).sum(-1, keepdims=True), np.finfo(np.float32).eps))
    s = u @ u.T / temperature
    same = lab[:, None] == lab[None, :]
    pos = same & ~np.eye(n, dtype=bool)
    total = 0.0
    for i in range(n):
        neg = np.exp(s[i][~same[i]]).sum()
        for j in np.nonzero(pos[i])[0]:
            total += -(s[i, j] - np.log(neg + np.exp(s[i, j])))
    return total / pos.sum()


# name: (our args, their kwargs, float64 reference, differentiated argument)
CASES = {
    "sigmoid_binary_cross_entropy": ((X, B), {}, ref_sbce, 0),
    "sigmoid_focal_loss": ((X, B), {"alpha": 0.25}, lambda x, y, **k: ref_focal(x, y, **k), 0),
    "sigmoid_focal_loss/soft": ((X, PROBS), {"gamma": 1.5}, lambda x, y, **k: ref_focal(x, y, **k), 0),
    "huber_loss": ((X, Y), {"delta": 1.5}, lambda p, t, **k: ref_huber(p, t, **k), 0),
    "log_cosh": ((X, Y), {}, ref_log_cosh, 0),
    "hinge_loss": ((X, PM), {}, lambda p, t: np.maximum(0, 1 - _d(p) * _d(t)), 0),
    "perceptron_loss": ((X, PM), {}, lambda p, t: np.maximum(0, -_d(p) * _d(t)), 0),
    "multiclass_hinge_loss": ((X, LAB), {}, ref_mc_hinge, 0),
    "multiclass_perceptron_loss": ((X, LAB), {}, ref_mc_perceptron, 0),
    "kl_divergence": ((LOGP, PROBS), {}, ref_kl, 0),
    "kl_divergence_with_log_targets": ((LOGP, LOGT), {},
                                       lambda lp, lt: (np.exp(_d(lt)) * (_d(lt) - _d(lp))).sum(-1), 0),
    "generalized_kl_divergence": ((LOGP, PROBS), {},
                                  lambda lp, t: ref_kl(lp, t) + (np.exp(_d(lp)) - _d(t)).sum(-1), 0),
    "cosine_similarity": ((X, Y), {}, ref_cos, 0),
    "cosine_distance": ((X, Y), {"epsilon": 0.1}, lambda a, b, **k: 1 - ref_cos(a, b, **k), 0),
    "smooth_labels": ((PROBS, 0.1), {}, lambda y, a: (1 - a) * _d(y) + a / y.shape[-1], 0),
    "safe_softmax_cross_entropy": ((X, PROBS), {}, ref_safe_ce, 0),
    "poly_loss_cross_entropy": ((X, PROBS), {"epsilon": 1.5}, lambda x, y, **k: ref_poly(x, y, **k), 0),
    "triplet_margin_loss": ((X, Y, B), {"margin": 2.0}, lambda a, p, n, **k: ref_triplet(a, p, n, **k), 0),
    "triplet_margin_loss/p3": ((np.abs(X) + 10, np.abs(Y), B), {"norm_degree": 3},
                               lambda a, p, n, **k: ref_triplet(a, p, n, **k), 0),
    "ntxent": ((X, LAB2), {"temperature": 0.5}, lambda e, lab, **k: ref_ntxent(e, lab, **k), 0),
}


def _fn(name):
    return name.split("/")[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_matches_float64_reference(case):
    args, kw, ref, _ = CASES[case]
    ours = np.asarray(getattr(optim, _fn(case))(*args, **kw))
    want = ref(*args, **kw)
    assert ours.dtype == np.float32 and ours.shape == np.shape(want)
    np.testing.assert_allclose(ours, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_value_and_grad_match_optax(case, jax_ref):
    args, kw, _, argnum = CASES[case]
    name = _fn(case)
    ours_f = getattr(optim.losses, name)
    ours = np.asarray(ours_f(*args, **kw))

    def loss(f, conv):
        def g(a):
            xs = [conv(x) if isinstance(x, np.ndarray) else x for x in args]
            xs[argnum] = a
            return f(*xs, **kw).sum()
        return g

    def theirs_f(jax):
        f = getattr(optax.losses, name)
        return (f(*[jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args], **kw),
                jax.grad(loss(f, jnp.asarray))(jnp.asarray(args[argnum])))

    theirs, gr = jax_ref("value, grad", theirs_f)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    g = np.asarray(cts.grad(loss(ours_f, lambda x: x))(cts.device_put(args[argnum])))
    np.testing.assert_allclose(g, gr, rtol=1e-5, atol=1e-6)


# edge points where a naive formula's gradient differs from optax's (ties of max/min/abs,
# saturated sigmoids, -inf logits with zero labels, zero KL targets)
EDGES = [
    ("huber_loss", (np.array([0, 1, -1, 1.5, -3], f32), np.zeros(5, f32)), {}, 0),
    ("log_cosh", (np.array([0, 100, -100, 0.5], f32), np.zeros(4, f32)), {}, 0),
    ("hinge_loss", (np.array([1, 0.5, -1, 2], f32), np.array([1, 1, -1, -1], f32)), {}, 0),
    ("perceptron_loss", (np.array([0, 0.5, -1], f32), np.array([1, 1, 1], f32)), {}, 0),
    ("multiclass_hinge_loss", (np.array([[1, 2, 2], [0, 0, 0], [3, 1, 1]], f32),
                               np.array([0, 1, 0])), {}, 0),
    ("multiclass_perceptron_loss", (np.array([[1, 2, 2], [0, 0, 0]], f32), np.array([0, 1])), {}, 0),
    ("sigmoid_binary_cross_entropy", (np.array([-100, 100, 0, 50, -50], f32),
                                      np.array([1, 0, 1, 1, 0], f32)), {}, 0),
    ("sigmoid_focal_loss", (np.array([-100, 100, 0, 50, -50], f32),
                            np.array([1, 0, 1, 1, 0], f32)), {}, 0),
    ("safe_softmax_cross_entropy", (np.array([[-np.inf, 1, 2], [0, 0, 0]], f32),
                                    np.array([[0, .5, .5], [1, 0, 0]], f32)), {}, 0),
    ("safe_softmax_cross_entropy", (np.array([[-np.inf, 1, 2], [0, 0, 0]], f32),
                                    np.array([[0, .5, .5], [1, 0, 0]], f32)), {}, 1),
    ("kl_divergence", (np.log(np.array([[.2, .3, .5]], f32)), np.array([[.5, .5, 0]], f32)), {}, 1),
    ("triplet_margin_loss", (np.ones((2, 3), f32), np.ones((2, 3), f32), np.zeros((2, 3), f32)),
     {"margin": 0.0, "eps": 0.0}, 0),
]


@pytest.mark.parametrize("i", range(len(EDGES)))
def test_loss_gradients_at_edges_match_optax(i, jax_ref):
    name, args, kw, argnum = EDGES[i]

    def loss(f, conv):
        def g(a):
            xs = [conv(x) for x in args]
            xs[argnum] = a
            return f(*xs, **kw).sum()
        return g
    ours = np.asarray(getattr(optim.losses, name)(*args, **kw))
    theirs, gr = jax_ref("value, grad", lambda jax: (
        getattr(optax.losses, name)(*map(jnp.asarray, args), **kw),
        jax.grad(loss(getattr(optax.losses, name), jnp.asarray))(jnp.asarray(args[argnum]))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    g = np.asarray(cts.grad(loss(getattr(optim.losses, name), lambda x: x))(
        cts.device_put(args[argnum])))
    np.testing.assert_allclose(g, gr, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["sigmoid_focal_loss", "huber_loss", "multiclass_hinge_loss",
                                  "kl_divergence", "cosine_similarity", "poly_loss_cross_entropy",
                                  "safe_softmax_cross_entropy", "triplet_margin_loss", "ntxent"])
def test_loss_on_sharded_inputs_equals_one_device(case):
    args, kw, _, argnum = CASES[case]
    mesh = cts.make_mesh((4, 2), ("b", "c"))
    name = _fn(case)
    f = getattr(optim, name)

    def place(a, sharded):
        if not (isinstance(a, np.ndarray) and a.dtype == f32 and a.ndim == 2):
            return a
        spec = cts.P("b", "c") if sharded else cts.P()
        return cts.device_put(a, cts.NamedSharding(mesh, spec))
    one = np.asarray(f(*[cts.device_put(a) if isinstance(a, np.ndarray) and a.dtype == f32 else a
                         for a in args], **kw))
    sharded_args = [place(a, True) for a in args]
    out = f(*sharded_args, **kw)
    np.testing.assert_allclose(np.asarray(out), one, rtol=1e-6, atol=1e-6)

    def loss(a):
        xs = list(sharded_args)
        xs[argnum] = a
        return f(*xs, **kw).sum()
    g = cts.grad(loss)(sharded_args[argnum])
    assert g.sharding == sharded_args[argnum].sharding

    def loss1(a):
        xs = [cts.device_put(x) if isinstance(x, np.ndarray) and x.dtype == f32 else x
              for x in args]
        xs[argnum] = a
        return f(*xs, **kw).sum()
    g1 = cts.grad(loss1)(cts.device_put(args[argnum]))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g1), rtol=1e-5, atol=1e-6)


BF16_CASES = ["sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "huber_loss", "log_cosh",
              "hinge_loss", "multiclass_hinge_loss", "kl_divergence", "cosine_similarity",
              "safe_softmax_cross_entropy", "poly_loss_cross_entropy", "smooth_labels",
              "triplet_margin_loss"]


@pytest.mark.parametrize("name", BF16_CASES)
def test_loss_bfloat16_inputs_keep_bfloat16(name, jax_ref):
    args, kw, ref, _ = CASES[name]
    bf = cts.numpy.bfloat16
    a16 = [a.astype(bf) if isinstance(a, np.ndarray) and a.dtype == f32 else a for a in args]
    if name.startswith("sigmoid"):   # float32 labels are cast to the logits' dtype (optax)
        a16[1] = args[1]
    out = getattr(optim, name)(*a16, **kw)
    assert out.dtype == bf
    want = ref(*[np.asarray(a, np.float64) if isinstance(a, np.ndarray) and a.dtype == bf else a
                 for a in a16], **kw)
    np.testing.assert_allclose(np.asarray(out, f32), want, rtol=2e-2,
                               atol=2e-2 * max(1.0, np.abs(want).max()))
    if name != "multiclass_hinge_loss":   # optax keeps bfloat16 too
        assert jax_ref("optax dtype", lambda jax: str(getattr(optax.losses, name)(
            *[jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in a16], **kw).dtype)) \
            == "bfloat16"


def test_loss_errors():
    with pytest.raises(ValueError, match="Shape mismatch"):
        optim.huber_loss(X, Y[:, :3])
    with pytest.raises(ValueError, match="Shape mismatch"):
        optim.log_cosh(X, Y[:1])
    with pytest.raises(ValueError, match="Shape mismatch"):
        optim.hinge_loss(X, PM[0])
    with pytest.raises(ValueError, match="Shape mismatch"):
        optim.losses.perceptron_loss(X, PM[0])
    with pytest.raises(TypeError, match="floating-point"):
        optim.sigmoid_binary_cross_entropy(np.ones(3, np.int32), np.ones(3, f32))
    with pytest.raises(TypeError, match="floating-point"):
        optim.kl_divergence(LOGP, np.ones((8, 6), np.int32))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 6\)"):
        optim.losses.multiclass_hinge_loss(X, np.full(8, 6))
    with pytest.raises(ValueError, match="expected"):
        optim.losses.multiclass_perceptron_loss(X, LAB[:4])
    with pytest.raises(TypeError, match="integers"):
        optim.losses.multiclass_hinge_loss(X, LAB.astype(f32))
    with pytest.raises(ValueError, match="same leading dimension"):
        optim.ntxent(X, LAB2[:4])
    with pytest.raises(NotImplementedError, match="where="):
        optim.kl_divergence(LOGP, PROBS, where=np.ones((8, 6), bool))
    with pytest.raises(DeprecationWarning, match="generalized_kl_divergence"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optim.convex_kl_divergence(LOGP, PROBS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_allclose(np.asarray(optim.convex_kl_divergence(LOGP, PROBS)),
                                   np.asarray(optim.losses.generalized_kl_divergence(LOGP, PROBS)))


# --- transforms ---------------------------------------------------------------------------------

P0 = {"a": np.abs(_rng.normal(size=(4, 3))).astype(f32) * 0.1,
      "b": {"c": _rng.normal(size=(5,)).astype(f32), "d": _rng.normal(size=(2, 2, 2)).astype(f32)}}
STEPS = 5


def _grads(i):
    r = np.random.default_rng(100 + i)
    g = cts.tree_util.tree_map(lambda p: r.normal(size=p.shape).astype(f32), P0)
    if i == 2:
        g["b"]["c"][1] = np.nan   # a NaN grad (zero_nans, and NaN propagation elsewhere)
    return g


def _np(tree):
    return cts.tree_util.tree_map(lambda x: np.asarray(x, f32), tree)


def _run_ours(tx, steps=STEPS, params=None, grads=_grads):
    params = cts.device_put(P0) if params is None else params
    state = tx.init(params)
    for i in range(steps):
        u, state = tx.update(grads(i), state, params)
        params = optim.apply_updates(params, u)
    return _np(params), state


def _run_optax(tx, steps=STEPS, params=None, grads=_grads):
    params = jax.tree.map(jnp.asarray, P0) if params is None else params
    state = tx.init(params)
    for i in range(steps):
        u, state = tx.update(jax.tree.map(jnp.asarray, grads(i)), state, params)
        params = optax.apply_updates(params, u)
    return _np(params), state


def _close(a, lb, rtol=1e-5):
    """ours (a tree) against optax's leaves (recorded, or jax.tree.leaves of its tree)."""
    la = cts.tree_util.tree_leaves(a)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        y = np.asarray(y, f32)
        # optax's relative bound (tests/optim/test_optim_parity.py): single float32 roundings of
        # the fused kernel and XLA differ, adam's steps scale them up to ~1e-6 of the leaf
        scale = np.nanmax(np.abs(y)) if y.size and np.isfinite(y).any() else 1.0
        np.testing.assert_allclose(np.asarray(x, f32), y, rtol=rtol, atol=rtol * max(scale, 0.1))


def _fields(state):
    """The state's NamedTuple names and fields, recursively (tuples of states included)."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return (type(state).__name__, tuple((f, _fields(getattr(state, f)))
                                            for f in state._fields))
    if isinstance(state, tuple):
        return tuple(_fields(s) for s in state)
    return None


TX_CASES = {
    "zero_nans": lambda o: o.chain(o.zero_nans(), o.sgd(0.1)),
    "apply_every": lambda o: o.chain(o.apply_every(2), o.sgd(0.1)),
    "apply_every3": lambda o: o.chain(o.zero_nans(), o.apply_every(3), o.adam(0.1)),
    "keep_params_nonnegative": lambda o: o.chain(o.zero_nans(), o.sgd(0.3),
                                                  o.keep_params_nonnegative()),
    "centralize": lambda o: o.chain(o.zero_nans(), o.centralize(), o.sgd(0.1)),
    "scale_by_sign": lambda o: o.chain(o.scale_by_sign(), o.scale(-0.01)),
    "sign_sgd": lambda o: o.sign_sgd(0.01),
    "signum": lambda o: o.chain(o.zero_nans(), o.signum(0.01, beta=0.8)),
    "nadam": lambda o: o.chain(o.zero_nans(), o.nadam(0.01)),
    "nadamw": lambda o: o.chain(o.zero_nans(), o.nadamw(0.01, weight_decay=0.1)),
    "adamaxw": lambda o: o.chain(o.zero_nans(), o.adamaxw(0.01, weight_decay=0.1)),
    "conditionally_mask": lambda o: o.chain(o.zero_nans(), o.conditionally_mask(
        o.adam(0.1), lambda step: step % 2 == 1)),
    "conditionally_mask_unfused": lambda o: o.conditionally_mask(
        o.chain(o.zero_nans(), o.sgd(0.1)), lambda step: step >= 2),
    "with_extra_args_support": lambda o: o.with_extra_args_support(
        o.chain(o.zero_nans(), o.adamw(0.01))),
}


def _optax_result(params, state):
    """optax's params and state as recorded: leaves, and the state's structure (_fields)."""
    return {"params": jax.tree.leaves(params), "fields": _fields(state),
            "state": jax.tree.leaves(state)}


@pytest.mark.parametrize("name", sorted(TX_CASES))
def test_transform_steps_match_optax(name, jax_ref):
    ours_p, ours_s = _run_ours(TX_CASES[name](optim))
    theirs = jax_ref("steps", lambda jax: _optax_result(*_run_optax(TX_CASES[name](optax))))
    _close(ours_p, theirs["params"])
    assert _fields(ours_s) == theirs["fields"]
    _close(ours_s, theirs["state"])


@pytest.mark.parametrize("name", sorted(TX_CASES))
def test_transform_train_state_equals_functional(name):
    tx = TX_CASES[name](optim)
    want, _ = _run_ours(tx)
    ts = TrainState.create(apply_fn=None, params=cts.device_put(P0), tx=tx)
    for i in range(STEPS):
        ts = ts.apply_gradients(grads=_grads(i))
    _close_np(_np(ts.params), want)


def _close_np(a, b):
    for x, y in zip(cts.tree_util.tree_leaves(a), cts.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_transforms_without_jax_hand_computed():
    # apply_every(2): zeros, then the sum of two steps' grads
    tx = optim.apply_every(2)
    p = {"w": np.zeros(2, f32)}
    st = tx.init(p)
    assert type(st).__name__ == "ApplyEvery" and st._fields == ("count", "grad_acc")
    u1, st = tx.update({"w": np.array([1., 2.], f32)}, st, p)
    u2, st = tx.update({"w": np.array([3., 5.], f32)}, st, p)
    u3, st = tx.update({"w": np.array([1., 1.], f32)}, st, p)
    assert np.asarray(u1["w"]).tolist() == [0, 0] and np.asarray(u2["w"]).tolist() == [4, 7]
    assert np.asarray(u3["w"]).tolist() == [0, 0] and int(np.asarray(st.count)) == 1
    # keep_params_nonnegative: p + u < 0 -> -p
    u, _ = optim.keep_params_nonnegative().update(
        {"w": np.array([-2., 1., -0.5], f32)}, optim.EmptyState(), {"w": np.array([1., 0., 1.], f32)})
    assert np.asarray(u["w"]).tolist() == [-1., 1., -0.5]
    # centralize: rows minus their mean; vectors unchanged
    g = np.arange(6, dtype=f32).reshape(2, 3)
    u, _ = optim.centralize().update({"m": g, "v": g[0]}, optim.EmptyState())
    np.testing.assert_array_equal(np.asarray(u["m"]), g - g.mean(1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(u["v"]), g[0])
    # sign and zero_nans
    u, st = optim.zero_nans().update({"w": np.array([np.nan, -np.inf, 2.], f32)},
                                     optim.zero_nans().init({"w": np.zeros(3, f32)}))
    assert np.asarray(u["w"]).tolist() == [0., -np.inf, 2.] and bool(np.asarray(st.found_nan["w"]))
    u, _ = optim.scale_by_sign().update({"w": np.array([-3., 0., 0.5, np.nan], f32)}, None)
    out = np.asarray(u["w"])
    assert out[:3].tolist() == [-1., 0., 1.] and np.isnan(out[3])


def test_zero_nans_state_per_leaf():
    tx = optim.zero_nans()
    st = tx.init(cts.device_put(P0))
    assert type(st).__name__ == "ZeroNansState" and st._fields == ("found_nan",)
    assert cts.tree_util.tree_structure(st.found_nan) == cts.tree_util.tree_structure(P0)
    _, st = tx.update(_grads(2), st)
    assert [bool(np.asarray(x)) for x in cts.tree_util.tree_leaves(st.found_nan)] == [False, True, False]


def test_sharded_transforms_equal_one_device():
    mesh = cts.make_mesh((2, 4), ("i", "j"))
    specs = {"a": cts.P("j", None), "b": {"c": cts.P(), "d": cts.P("i", None, None)}}
    placed = cts.tree_util.tree_map(lambda x, s: cts.device_put(x, cts.NamedSharding(mesh, s)),
                                    P0, specs, is_leaf=lambda x: isinstance(x, cts.PartitionSpec))
    for name in ("centralize", "signum", "conditionally_mask", "keep_params_nonnegative"):
        tx = TX_CASES[name](optim)
        want, _ = _run_ours(tx)
        got, _ = _run_ours(tx, params=cts.tree_util.tree_map(lambda x: x, placed))
        _close_np(got, want)


def _optax_lookahead(reset):
    """optax's lookahead: the state's structure, then each step's params and state leaves."""
    theirs_tx = optax.lookahead(optax.adam(0.1), sync_period=2, slow_step_size=0.5,
                                reset_state=reset)
    q = optax.LookaheadParams.init_synced({"a": jnp.asarray(P0["a"])})
    t = theirs_tx.init(q)
    out = {"fields": _fields(t), "steps": []}
    for i in range(STEPS):
        v, t = theirs_tx.update({"a": jnp.asarray(_grads(i)["a"])}, t, q)
        q = optax.apply_updates(q, v)
        out["steps"].append((jax.tree.leaves(q), jax.tree.leaves(t)))
    return out


def test_lookahead_matches_optax(jax_ref):
    for reset in (False, True):
        ours_tx = optim.lookahead(optim.adam(0.1), sync_period=2, slow_step_size=0.5,
                                  reset_state=reset)
        theirs = jax_ref(f"reset={reset}", lambda jax: _optax_lookahead(reset))
        p = optim.LookaheadParams.init_synced(cts.device_put({"a": P0["a"]}))
        s = ours_tx.init(p)
        assert _fields(s) == theirs["fields"]
        for i in range(STEPS):
            g = {"a": _grads(i)["a"]}
            u, s = ours_tx.update(g, s, p)
            p = optim.apply_updates(p, u)
            assert isinstance(p, optim.LookaheadParams)
            q, t = theirs["steps"][i]
            _close(p, q)
            _close(s, t)


def test_lookahead_train_state_and_errors():
    tx = optim.lookahead(optim.sgd(0.5), sync_period=2, slow_step_size=0.5)
    params = optim.LookaheadParams.init_synced({"w": np.ones(2, f32)})
    ts = TrainState.create(apply_fn=None, params=params, tx=tx)
    for _ in range(2):
        ts = ts.apply_gradients(grads={"w": np.ones(2, f32)})
    # fast: 1 - .5 = .5, .5 - .5 = 0; then sync: slow = 1 + .5 * (0 - 1) = .5, fast = slow
    assert np.asarray(ts.params.slow["w"]).tolist() == [0.5, 0.5]
    assert np.asarray(ts.params.fast["w"]).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="Synchronization period"):
        optim.lookahead(optim.sgd(0.1), sync_period=0, slow_step_size=0.5)
    with pytest.raises(ValueError, match="LookaheadParams"):
        tx.update({"w": np.ones(2, f32)}, tx.init(params), {"w": np.ones(2, f32)})


def test_tree_map_params_matches_optax(jax_ref):
    for i, make in enumerate((lambda o: o.adam(0.1),
                              lambda o: o.chain(o.apply_every(2), o.signum(0.1)),
                              lambda o: o.zero_nans())):
        ours = optim.tree_map_params(make(optim), lambda p, s: ("spec", s), make(optim).init(
            cts.device_put(P0)), {"a": 1, "b": {"c": 2, "d": 3}},
            transform_non_params=lambda v: None)

        def theirs_f(jax):
            t = optax.tree_map_params(make(optax), lambda p, s: ("spec", s), make(optax).init(
                jax.tree.map(jnp.asarray, P0)), {"a": 1, "b": {"c": 2, "d": 3}},
                transform_non_params=lambda v: None)
            return {"fields": _fields(t), "leaves": jax.tree.leaves(t)}

        theirs = jax_ref(i, theirs_f)
        assert _fields(ours) == theirs["fields"]
        assert cts.tree_util.tree_leaves(ours) == theirs["leaves"]


def test_tree_map_params_without_jax():
    st = optim.adam(0.1).init(cts.device_put(P0))
    out = optim.tree_map_params(optim.adam(0.1), lambda p: p.shape, st,
                                transform_non_params=lambda v: "count")
    assert out[0].mu == {"a": (4, 3), "b": {"c": (5,), "d": (2, 2, 2)}}
    assert out[0].count == "count" and out[0].nu == out[0].mu
    with pytest.raises(TypeError, match="initable"):
        optim.tree_map_params(3, lambda p: p, st)


def test_safe_norm_and_rms_match_optax(jax_ref):
    x = np.array([[3., 4.], [0., 0.]], f32)
    for i, args in enumerate([(1.0,), (6.0,), (0.5, None, 1, True)]):
        ours = optim.safe_norm(x, *args)
        theirs, gr = jax_ref(f"safe_norm {i}", lambda jax: (
            optax.safe_norm(jnp.asarray(x), *args),
            jax.grad(lambda a: jnp.sum(optax.safe_norm(a, *args)))(jnp.asarray(x))))
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)
        g = cts.grad(lambda a: cts.numpy.sum(optim.safe_norm(a, *args)))(cts.device_put(x))
        np.testing.assert_allclose(np.asarray(g), gr, rtol=1e-6, atol=1e-7)
    for i, (m, v) in enumerate(((1.0, x), (5.0, x), (0.0, np.zeros((2, 2), f32)))):
            ours = optim.safe_root_mean_squares(v, m)
            theirs, gr = jax_ref(f"rms {i}", lambda jax: (
                optax.safe_root_mean_squares(jnp.asarray(v), m),
                jax.grad(lambda a: optax.safe_root_mean_squares(a, m))(jnp.asarray(v))))
            np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)
            g = cts.grad(lambda a: optim.safe_root_mean_squares(a, m))(cts.device_put(v))
            np.testing.assert_allclose(np.asarray(g), gr, rtol=1e-6, atol=1e-7)


def test_safe_norm_gradient_is_zero_not_nan_below_min():
    g = cts.grad(lambda a: optim.safe_norm(a, 1e-3))(cts.device_put(np.zeros(3, f32)))
    assert np.asarray(g).tolist() == [0., 0., 0.]
    assert float(optim.safe_norm(np.array([3., 4.], f32), 1.0)) == 5.0


def test_transform_errors_and_fusion():
    with pytest.raises(ValueError, match="k >= 1"):
        optim.apply_every(0)
    with pytest.raises(TypeError, match="int"):
        optim.apply_every(2.5)
    with pytest.raises(ValueError, match="params"):
        optim.keep_params_nonnegative().update({"w": np.ones(2, f32)}, optim.EmptyState())
    with pytest.raises(TypeError, match="should_transform_fn"):
        optim.conditionally_mask(optim.sgd(0.1), 3)
    with pytest.raises(ValueError, match="bool scalar"):
        tx = optim.conditionally_mask(optim.sgd(0.1), lambda s: np.ones(2, bool))
        tx.update({"w": np.ones(2, f32)}, tx.init({"w": np.ones(2, f32)}))
    with pytest.raises(TypeError, match="ApplyEvery"):
        optim.apply_every(2).update({"w": np.ones(2, f32)}, optim.EmptyState())
    with pytest.raises(TypeError, match="GradientTransformation"):
        optim.with_extra_args_support(3)
    # fusable inner transforms stay fused; the sign transforms cannot be
    assert optim.conditionally_mask(optim.adam(0.1), lambda s: True).fusable
    assert optim.with_extra_args_support(optim.adam(0.1)).fusable
    assert optim.nadamw(0.1).fusable and optim.adamaxw(0.1).fusable
    assert not optim.sign_sgd(0.1).fusable
    # extra args are ignored by with_extra_args_support, forwarded by conditionally_mask
    p = {"w": np.ones(2, f32)}
    tx = optim.with_extra_args_support(optim.sgd(1.0))
    u, _ = tx.update(p, tx.init(p), p, loss=3.0)
    assert np.asarray(u["w"]).tolist() == [-1., -1.]
    tx = optim.conditionally_mask(optim.sgd(1.0), lambda step, loss: loss > 1.0,
                                  forward_extra_args=True)
    st = tx.init(p)
    u, st = tx.update(p, st, p, loss=0.5)
    assert np.asarray(u["w"]).tolist() == [0., 0.]
    u, st = tx.update(p, st, p, loss=2.0)
    assert np.asarray(u["w"]).tolist() == [-1., -1.] and int(np.asarray(st.step)) == 2


def test_every_new_name_is_exported_and_documented(jax_ref):
    names = ["sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "huber_loss", "log_cosh",
             "hinge_loss", "kl_divergence", "convex_kl_divergence", "cosine_similarity",
             "cosine_distance", "smooth_labels", "safe_softmax_cross_entropy", "ntxent",
             "zero_nans", "ZeroNansState", "apply_every", "ApplyEvery",
             "keep_params_nonnegative", "NonNegativeParamsState", "centralize", "scale_by_sign",
             "sign_sgd", "signum", "nadam", "nadamw", "adamaxw", "tree_map_params", "safe_norm",
             "safe_root_mean_squares", "with_extra_args_support", "conditionally_mask",
             "ConditionallyMaskState", "lookahead", "LookaheadState", "LookaheadParams",
             "generalized_kl_divergence"]
    for n in names:
        assert n in optim.__all__, n
        assert getattr(optim, n).__doc__, n
    losses = ["multiclass_hinge_loss", "perceptron_loss", "multiclass_perceptron_loss",
              "kl_divergence_with_log_targets", "poly_loss_cross_entropy", "triplet_margin_loss"]
    for n in losses:
        assert getattr(optim.losses, n).__doc__, n
    # optax's names, all of them
    assert jax_ref("missing from optax", lambda jax: [n for n in names if not hasattr(optax, n)]
                   + [n for n in losses if not hasattr(optax.losses, n)]) == []
