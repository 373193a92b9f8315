"""optax's losses in ctrainstate.optim (optim/losses.py, optim/utils.py): each against a float64 numpy
reference written from optax's formula and against optax (recorded; live in the twins marked
`parity`), sharded inputs against one device, 16-bit dtypes, errors."""

import warnings

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
import ctrainstate.optim as optim


def _log_softmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def test_integer_labels_masked_class_gives_a_finite_loss_and_grad():
    # a -inf logit (a masked-out class) that is not the label: the loss is the finite
    # -log_softmax(z)[label] over the other classes (by hand: exp(-inf) = 0), and its
    # gradient softmax - onehot, 0 at the masked class. The label's logit used to be picked
    # by multiplying with the one-hot, so -inf * 0 made the loss and the gradient NaN.
    x = np.array([[0.0, -np.inf, 1.0, 2.0], [0.5, 0.25, -np.inf, -1.0]], np.float32)
    lab = np.array([2, 0])
    fin = np.where(np.isfinite(x), x, -1e30)
    want = -_log_softmax(fin, 1)[[0, 1], lab]
    got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x, lab))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    g = np.asarray(cts.grad(lambda v: cnp.sum(
        optim.softmax_cross_entropy_with_integer_labels(v, lab)))(cts.device_put(x)))
    want_g = np.exp(_log_softmax(fin, 1)) - np.eye(4, dtype=np.float32)[lab]
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)
    assert g[0, 1] == 0.0 and g[1, 2] == 0.0


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_integer_labels_on_the_logits_devices_select_there(monkeypatch, mesh_shape):
    """Logits every device holds whole (one device; replicated on a 2x4 mesh) and integer
    label Arrays on the same devices (int32, int8), the class axis last or first, a masked
    (-inf) class: the labels are read to the host to be checked, but nothing is copied from
    the host -- no one-hot is built there -- in the loss or in its value_and_grad; the loss
    and its gradient (softmax - onehot) are the float64 reference's; under jit, labels out
    of range still raise at every call."""
    from ctrainstate import _C
    sh = None if mesh_shape is None else cts.NamedSharding(cts.make_mesh(mesh_shape, ("a", "b")),
                                                           cts.P())
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    lab = rng.integers(0, 10, 6)
    x[np.arange(6), (lab + 3) % 10] = -np.inf
    fin = np.where(np.isfinite(x), x, -1e30)
    cases = []
    for dt in (np.int32, np.int8):
        cases.append((cts.device_put(x, sh), cts.device_put(lab.astype(dt), sh), -1,
                      -_log_softmax(fin, 1)[np.arange(6), lab],
                      np.exp(_log_softmax(fin, 1)) - np.eye(10, dtype=np.float32)[lab]))
    cases.append((cts.device_put(np.ascontiguousarray(x.T), sh),
                  cts.device_put(lab.astype(np.int32), sh), 0,
                  -_log_softmax(fin, 1)[np.arange(6), lab],
                  (np.exp(_log_softmax(fin, 1)) - np.eye(10, dtype=np.float32)[lab]).T))

    def run():
        out = []
        for xa, la, axis, _, _ in cases:
            def loss(v):
                return cnp.sum(optim.softmax_cross_entropy_with_integer_labels(v, la, axis=axis))
            out.append((optim.softmax_cross_entropy_with_integer_labels(xa, la, axis=axis),
                        cts.value_and_grad(loss)(xa)))
        return out
    run()   # (the constants are made at their first use)

    def refuse(*args):
        raise AssertionError("a block was copied from the host")
    with monkeypatch.context() as mp:
        mp.setattr(_C, "copy_from_host", refuse)
        got = run()
    for (xa, la, axis, want, want_g), (per, (total, g)) in zip(cases, got):
        np.testing.assert_allclose(np.asarray(per), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(total), want.sum(), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-7)
        assert g.sharding == xa.sharding and np.isfinite(np.asarray(g)).all()
    f = cts.jit(lambda v, la: optim.softmax_cross_entropy_with_integer_labels(v, la))
    xa = cases[0][0]
    np.testing.assert_allclose(np.asarray(f(xa, cases[0][1])), cases[0][3], rtol=1e-5, atol=1e-6)
    for bad in (10, -1):
        with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
            f(xa, cts.device_put(np.where(np.arange(6) == 2, bad, lab).astype(np.int32), sh))


@pytest.mark.parametrize("mesh_shape,names,spec", [((8,), ("x",), (None, "x")),
                                                   ((2, 4), ("data", "model"), ("data", "model"))])
def test_integer_labels_masked_class_on_meshes(monkeypatch, mesh_shape, names, spec):
    """The class axis sharded: every shard's one-hot selection drops the -inf of the others.
    The one-hot is compared on the devices, each its own block: the only bytes copied from
    the host are the labels' (as int32), and the gradient keeps the logits' sharding."""
    from ctrainstate import _C
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    lab = rng.integers(0, 16, 8)
    x[np.arange(8), (lab + 5) % 16] = -np.inf
    fin = np.where(np.isfinite(x), x, -1e30)
    want = -_log_softmax(fin, 1)[np.arange(8), lab]
    want_g = np.exp(_log_softmax(fin, 1)) - np.eye(16, dtype=np.float32)[lab]
    a = cts.device_put(x, cts.NamedSharding(cts.make_mesh(mesh_shape, names), cts.P(*spec)))

    def run():
        loss = optim.softmax_cross_entropy_with_integer_labels(a, lab)
        g = cts.grad(lambda v: cnp.sum(optim.softmax_cross_entropy_with_integer_labels(v, lab)))(a)
        return loss, g
    run()   # (the class positions' constants are made at their first use)
    copied = []
    real = _C.copy_from_host

    def counting(dst, src, *args):
        copied.append(np.asarray(src).nbytes)
        return real(dst, src, *args)
    with monkeypatch.context() as mp:
        mp.setattr(_C, "copy_from_host", counting)
        loss, g = run()
    assert copied and max(copied) <= lab.size * 4, copied
    np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-7)
    assert g.sharding == a.sharding


def test_integer_labels_tuple_axis():
    # optax: the class axes (in the order given) are flattened row-major and the label
    # indexes that flat axis. By hand: move the class axes last in that order, reshape.
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    for axis, bshape in (((2, 3), (2, 3)), ((3, 2), (2, 3)), ((-1, 1), (2, 4))):
        cls = [a % 4 for a in axis]
        batch = [d for d in range(4) if d not in cls]
        n = int(np.prod([x.shape[a] for a in cls]))
        lab = rng.integers(0, n, bshape)
        flat = x.transpose(batch + cls).reshape(bshape + (n,))
        want = -np.take_along_axis(_log_softmax(flat, -1), lab[..., None], -1)[..., 0]
        got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x, lab, axis=axis))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(axis))
    with pytest.raises(ValueError, match=r"\[0, 20\)"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.full((2, 3), 20), axis=(2, 3))
    with pytest.raises(ValueError, match="distinct"):
        optim.softmax_cross_entropy_with_integer_labels(x, np.zeros((2, 3), int), axis=(2, -2))


def test_integer_labels_masked_class_and_tuple_axis_match_optax(jax_ref):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    x[0, 1, 2, 3] = -np.inf
    x[1, 2, 0, 0] = -np.inf
    for axis, lab in (((2, 3), rng.integers(0, 20, (2, 3))), ((3, 2), rng.integers(0, 20, (2, 3))),
                      (-1, rng.integers(0, 5, (2, 3, 4))), (1, rng.integers(0, 3, (2, 4, 5)))):
        want, want_g = jax_ref(str(axis), lambda jax: (
            __import__("optax").softmax_cross_entropy_with_integer_labels(x, lab, axis=axis),
            jax.grad(lambda v: __import__("optax").softmax_cross_entropy_with_integer_labels(
                v, lab, axis=axis).sum())(x)))
        got = np.asarray(optim.softmax_cross_entropy_with_integer_labels(x, lab, axis=axis))
        # the two -inf logits sit in the rows of at most two losses; they are inf only where
        # one is that row's label
        assert np.isfinite(want).sum() >= want.size - 2
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(axis))
        got_g = np.asarray(cts.grad(lambda v: cnp.sum(
            optim.softmax_cross_entropy_with_integer_labels(v, lab, axis=axis)))(cts.device_put(x)))
        np.testing.assert_allclose(got_g, want_g, rtol=1e-5, atol=1e-7, err_msg=str(axis))


@pytest.mark.parametrize("fn", ["squared_error", "l2_loss"])
def test_regression_losses_refuse_broadcasting_targets(fn):
    # optax checks shapes equal (ValueError "Shape mismatch"); broadcasting silently gave a
    # loss of another shape (e.g. (2, 3) predictions against (3,) targets)
    p = np.arange(6, dtype=np.float32).reshape(2, 3)
    f = getattr(optim, fn)
    with pytest.raises(ValueError, match=r"Shape mismatch: got \(2, 3\) and \(3,\)"):
        f(p, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="Shape mismatch"):
        f(p, np.float32(1.0))
    with pytest.raises(ValueError, match="Shape mismatch"):
        getattr(optim.losses, fn)(cts.device_put(p), cts.device_put(np.ones((3, 2), np.float32)))
    scale = 0.5 if fn == "l2_loss" else 1.0
    np.testing.assert_allclose(np.asarray(f(p, np.ones((2, 3), np.float32))), scale * (p - 1) ** 2)


@pytest.mark.parametrize("fn", ["squared_error", "l2_loss"])
def test_regression_losses_shape_check_matches_optax(fn):
    optax = pytest.importorskip("optax")
    p = np.arange(6, dtype=np.float32).reshape(2, 3)
    for t in (np.ones(3, np.float32), np.float32(1.0)):
        with pytest.raises(ValueError, match="Shape mismatch"):
            getattr(optax, fn)(p, t)
        with pytest.raises(ValueError, match="Shape mismatch"):
            getattr(optim, fn)(p, t)


# --- each loss against a float64 numpy reference written from optax's formula and against optax
# (recorded; live in the twins marked `parity`: values and jax.grad), sharded inputs against one
# device, 16-bit dtypes, errors

try:
    import jax
    import jax.numpy as jnp
    import optax
    HAVE_JAX = True
except Exception:   # pragma: no cover - the file runs without jax
    HAVE_JAX = False


f32 = np.float32


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


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

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
