"""nn.recurrent (flax.linen.recurrent): each cell's step against its equations written out in
numpy from the cell's own parameters, RNN against a Python loop of the cell, seq_lengths /
reverse / keep_order by construction, gradients against finite differences, clear errors;
and the same parameters for the same key, outputs, carries and gradients as flax.linen 0.12.8
(flax's values through conftest's jax_ref: recorded in tests/data/recorded/test_recurrent.npz,
computed live in the parity run)."""
import doctest
import importlib

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random
from ctrainstate.nn.recurrent import flip_sequences

B, T, D, H = 2, 5, 3, 4          # batch, time, input features, hidden features (one shape)


def _x(shape=(B, T, D), seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _np(tree):
    return cts.tree_util.tree_map(np.asarray, tree)


def _sig(z):
    return 1.0 / (1.0 + np.exp(-z))


def _params(cell, x_step, seed=2, carry_seed=1):
    carry = cell.initialize_carry(random.PRNGKey(carry_seed), x_step.shape)
    v = cell.init(random.PRNGKey(seed), carry, x_step)
    return v, carry


def _random_carry(cell, x_step, seed=7):
    """A non-zero carry of the cell's structure (zeros would hide the recurrent terms)."""
    carry = cell.initialize_carry(random.PRNGKey(0), x_step.shape)
    rs = np.random.RandomState(seed)
    return cts.tree_util.tree_map(lambda c: rs.randn(*np.shape(c)).astype(np.float32), carry)


# --- one step against the equations (numpy, from the cell's own parameters) ---------------------

def _lstm_ref(p, carry, x):
    c, h = carry
    W = lambda n: np.asarray(p[n]["kernel"])  # noqa: E731
    b = lambda n: np.asarray(p[n]["bias"])    # noqa: E731
    i = _sig(x @ W("ii") + h @ W("hi") + b("hi"))
    f = _sig(x @ W("if") + h @ W("hf") + b("hf"))
    g = np.tanh(x @ W("ig") + h @ W("hg") + b("hg"))
    o = _sig(x @ W("io") + h @ W("ho") + b("ho"))
    c2 = f * c + i * g
    h2 = o * np.tanh(c2)
    return (c2, h2), h2


def _gru_ref(p, h, x):
    W = lambda n: np.asarray(p[n]["kernel"])  # noqa: E731
    b = lambda n: np.asarray(p[n]["bias"])    # noqa: E731
    r = _sig(x @ W("ir") + b("ir") + h @ W("hr"))
    z = _sig(x @ W("iz") + b("iz") + h @ W("hz"))
    n = np.tanh(x @ W("in") + b("in") + r * (h @ W("hn") + b("hn")))
    h2 = (1 - z) * n + z * h
    return h2, h2


def _simple_ref(p, h, x, residual=False):
    pre = x @ np.asarray(p["i"]["kernel"]) + np.asarray(p["i"]["bias"]) + h @ np.asarray(
        p["h"]["kernel"])
    h2 = np.tanh(pre + h if residual else pre)
    return h2, h2


def _mgu_ref(p, h, x, reset_gate=True):
    W = lambda n: np.asarray(p[n]["kernel"])  # noqa: E731
    b = lambda n: np.asarray(p[n]["bias"])    # noqa: E731
    f = _sig(x @ W("if") + b("if") + h @ W("hf"))
    hn = h @ W("hn") + (b("hn") if reset_gate else 0)
    n = np.tanh(x @ W("in") + b("in") + (f * hn if reset_gate else hn))
    h2 = (1 - f) * n + f * h
    return h2, h2


# non-default bias / gate initialisers so every parameter is non-trivial
_NZ = dict(bias_init=nn.initializers.normal(0.5))
CELLS = {
    "LSTMCell": (lambda: nn.LSTMCell(H, **_NZ), _lstm_ref),
    "OptimizedLSTMCell": (lambda: nn.OptimizedLSTMCell(H, **_NZ), _lstm_ref),
    "GRUCell": (lambda: nn.GRUCell(H, **_NZ), _gru_ref),
    "SimpleCell": (lambda: nn.SimpleCell(H, **_NZ), _simple_ref),
    "SimpleCell-residual": (lambda: nn.SimpleCell(H, residual=True, **_NZ),
                            lambda p, h, x: _simple_ref(p, h, x, residual=True)),
    "MGUCell": (lambda: nn.MGUCell(H, activation_bias_init=nn.initializers.normal(0.5)),
                _mgu_ref),
    "MGUCell-noreset": (lambda: nn.MGUCell(H, reset_gate=False),
                        lambda p, h, x: _mgu_ref(p, h, x, reset_gate=False)),
}


@pytest.mark.parametrize("name", list(CELLS))
def test_cell_step_equals_its_equations(name):
    make, ref = CELLS[name]
    cell = make()
    x = _x()[:, 0]
    v, _ = _params(cell, x)
    carry = _random_carry(cell, x)
    got = _np(cell.apply(v, carry, x))
    want = ref(_np(v["params"]), carry, x)
    np.testing.assert_allclose(np.concatenate([np.ravel(a) for a in cts.tree_util.tree_leaves(got)]),
                               np.concatenate([np.ravel(a) for a in cts.tree_util.tree_leaves(want)]),
                               rtol=1e-5, atol=1e-6)


PARAM_TREES = {
    "LSTMCell": {**{f"i{g}": {"kernel": (D, H)} for g in "ifgo"},
                 **{f"h{g}": {"kernel": (H, H), "bias": (H,)} for g in "ifgo"}},
    "GRUCell": {**{f"i{g}": {"kernel": (D, H), "bias": (H,)} for g in ("r", "z", "n")},
                "hr": {"kernel": (H, H)}, "hz": {"kernel": (H, H)},
                "hn": {"kernel": (H, H), "bias": (H,)}},
    "SimpleCell": {"i": {"kernel": (D, H), "bias": (H,)}, "h": {"kernel": (H, H)}},
    "MGUCell": {"if": {"kernel": (D, H), "bias": (H,)}, "in": {"kernel": (D, H), "bias": (H,)},
                "hf": {"kernel": (H, H)}, "hn": {"kernel": (H, H), "bias": (H,)}},
}
PARAM_TREES["OptimizedLSTMCell"] = PARAM_TREES["LSTMCell"]


@pytest.mark.parametrize("name", sorted(PARAM_TREES))
def test_param_tree_and_carry(name):
    cell = getattr(nn, name)(H)
    x = _x()[:, 0]
    v, carry = _params(cell, x)
    assert cts.tree_util.tree_map(np.shape, v["params"]) == PARAM_TREES[name]
    assert list(v) == ["params"]
    assert cell.num_feature_axes == 1
    shapes = [np.shape(c) for c in cts.tree_util.tree_leaves(carry)]
    assert shapes == [(B, H)] * (2 if "LSTM" in name else 1)
    assert all(not np.asarray(c).any() for c in cts.tree_util.tree_leaves(carry))
    # recurrent kernels are orthogonal, MGU's forget bias starts at one
    hk = np.asarray(v["params"]["hf" if "hf" in v["params"] else "h" if name == "SimpleCell"
                                else "hr"]["kernel"])
    np.testing.assert_allclose(hk @ hk.T, np.eye(H), atol=1e-5)
    if name == "MGUCell":
        assert np.asarray(v["params"]["if"]["bias"]).tolist() == [1.0] * H


def test_optimized_lstm_shares_lstm_params_and_outputs():
    x = _x()[:, 0]
    vl, _ = _params(nn.LSTMCell(H), x)
    vo, _ = _params(nn.OptimizedLSTMCell(H), x)
    for a, b in zip(cts.tree_util.tree_leaves(vl), cts.tree_util.tree_leaves(vo)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    carry = _random_carry(nn.LSTMCell(H), x)
    a = _np(nn.LSTMCell(H).apply(vl, carry, x))
    b = _np(nn.OptimizedLSTMCell(H).apply(vl, carry, x))
    np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6)


def test_initialize_carry_keys_and_shapes():
    init = nn.initializers.normal(1.0)
    cell = nn.LSTMCell(H, carry_init=init)
    c, h = cell.initialize_carry(random.PRNGKey(3), (7, 2, D))
    k1, k2 = random.split(random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(init(k1, (7, 2, H))))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(init(k2, (7, 2, H))))
    g = nn.GRUCell(H, carry_init=init).initialize_carry(random.PRNGKey(3), (D,))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(init(random.PRNGKey(3), (H,))))
    conv = nn.ConvLSTMCell(H, kernel_size=(3, 3))
    assert conv.num_feature_axes == 3
    assert [np.shape(a) for a in conv.initialize_carry(random.PRNGKey(0), (2, 6, 5, D))] == \
        [(2, 6, 5, H)] * 2


# --- RNN: a Python loop of the cell -------------------------------------------------------------

def _loop(cell, params, carry, xs, time_axis):
    """The cell applied step by step along ``time_axis``: (carry history, stacked outputs)."""
    ys, carries = [], []
    for t in range(np.shape(xs)[time_axis]):
        carry, y = cell.apply({"params": params}, carry, np.take(xs, t, axis=time_axis))
        carries.append(_np(carry))
        ys.append(np.asarray(y))
    return carries, np.stack(ys, axis=time_axis)


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell"])
@pytest.mark.parametrize("time_major", [False, True])
def test_rnn_equals_loop_of_cell(name, time_major):
    x = _x()
    if time_major:
        x = np.swapaxes(x, 0, 1)
    rnn = nn.RNN(getattr(nn, name)(H, **_NZ), time_major=time_major, return_carry=True)
    v = rnn.init(random.PRNGKey(0), x)
    assert list(v["params"]) == ["cell"]
    cell = getattr(nn, name)(H, **_NZ)
    cellv, _ = _params(cell, x[0] if time_major else x[:, 0], seed=0)
    assert cts.tree_util.tree_map(np.shape, v["params"]["cell"]) == \
        cts.tree_util.tree_map(np.shape, cellv["params"])
    carry0 = _random_carry(cell, x[0] if time_major else x[:, 0])
    carry, y = rnn.apply(v, x, initial_carry=carry0)
    carries, ys = _loop(cell, v["params"]["cell"], carry0, x, 0 if time_major else 1)
    np.testing.assert_allclose(np.asarray(y), ys, rtol=1e-6, atol=1e-6)
    for a, b in zip(cts.tree_util.tree_leaves(_np(carry)), cts.tree_util.tree_leaves(carries[-1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the default carry is initialize_carry(random.key(0), step shape): zeros here
    y0 = rnn.apply(v, x, return_carry=False)
    _, ys0 = _loop(cell, v["params"]["cell"], cell.initialize_carry(random.key(0), x[:, 0].shape
                                                                    if not time_major else
                                                                    x[0].shape), x,
                   0 if time_major else 1)
    np.testing.assert_allclose(np.asarray(y0), ys0, rtol=1e-6, atol=1e-6)


def test_flip_sequences():
    x = np.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]], np.float32)
    lengths = np.array([1, 2, 3])
    want = [[1, 0, 0], [3, 2, 0], [6, 5, 4]]
    assert np.asarray(flip_sequences(x, lengths, 1, False)).tolist() == want
    assert np.asarray(flip_sequences(x.T, lengths, 1, True)).T.tolist() == want
    assert np.asarray(flip_sequences(x, None, 1, False)).tolist() == x[:, ::-1].tolist()
    # with a feature axis and two batch dims: each (b1, b2) row's valid part flipped in its
    # own length, and (Flax's index arithmetic) its padding part flipped in place too
    x3 = _x((2, 2, 4, 3))
    ls = np.array([[4, 1], [2, 3]])
    got = np.asarray(flip_sequences(x3, ls, 2, False))
    for i in range(2):
        for j in range(2):
            n = ls[i, j]
            np.testing.assert_array_equal(got[i, j, :n], x3[i, j, :n][::-1])
            np.testing.assert_array_equal(got[i, j, n:], x3[i, j, n:][::-1])


def test_seq_lengths_reverse_keep_order_by_construction():
    x = _x()
    lengths = np.array([5, 2])
    cell = nn.GRUCell(H, **_NZ)
    rnn = nn.RNN(cell, return_carry=True)
    v = rnn.init(random.PRNGKey(0), x)
    p = v["params"]["cell"]
    carry0 = _random_carry(cell, x[:, 0])

    # forward: outputs are the plain loop's (padding not zeroed), the carry the last valid one's
    carry, y = rnn.apply(v, x, initial_carry=carry0, seq_lengths=lengths)
    carries, ys = _loop(cell, p, carry0, x, 1)
    np.testing.assert_allclose(np.asarray(y), ys, rtol=1e-6, atol=1e-6)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(carry)[b], carries[n - 1][b], rtol=1e-6, atol=1e-6)

    # reverse: each sequence's valid part reversed, padding kept at the end (itself reversed,
    # as Flax's flip_sequences does)
    xr = x.copy()
    for b, n in enumerate(lengths):
        xr[b, :n] = x[b, :n][::-1]
        xr[b, n:] = x[b, n:][::-1]
    carry_r, y_r = rnn.apply(v, x, initial_carry=carry0, seq_lengths=lengths, reverse=True)
    carries_r, ys_r = _loop(cell, p, carry0, xr, 1)
    np.testing.assert_allclose(np.asarray(y_r), ys_r, rtol=1e-6, atol=1e-6)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(carry_r)[b], carries_r[n - 1][b], rtol=1e-6,
                                   atol=1e-6)
    # keep_order: the reversed run's outputs put back in the inputs' order, per sequence
    y_k = np.asarray(rnn.apply(v, x, initial_carry=carry0, seq_lengths=lengths, reverse=True,
                               keep_order=True)[1])
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(y_k[b, :n], ys_r[b, :n][::-1], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y_k[b, n:], ys_r[b, n:][::-1], rtol=1e-6, atol=1e-6)
    # without seq_lengths, reverse is a plain flip of the time axis
    y_f = np.asarray(rnn.apply(v, x, initial_carry=carry0, reverse=True)[1])
    np.testing.assert_allclose(y_f, _loop(cell, p, carry0, x[:, ::-1], 1)[1], rtol=1e-6,
                               atol=1e-6)
    # the fields do what the call's overrides do
    y_fk = np.asarray(nn.RNN(cell, reverse=True, keep_order=True).apply(
        v, x, initial_carry=carry0, seq_lengths=lengths))
    np.testing.assert_array_equal(y_fk, y_k)


def test_bidirectional_is_forward_and_backward_concatenated():
    x = _x()
    lengths = np.array([3, 5])
    fwd, bwd = nn.RNN(nn.GRUCell(H, **_NZ)), nn.RNN(nn.LSTMCell(3, **_NZ))
    bi = nn.Bidirectional(fwd, bwd, return_carry=True)
    v = bi.init(random.PRNGKey(1), x)
    assert sorted(v["params"]) == ["backward_rnn", "forward_rnn"]
    (cf, cb), y = bi.apply(v, x, seq_lengths=lengths)
    cf2, yf = fwd.apply({"params": v["params"]["forward_rnn"]}, x, seq_lengths=lengths,
                        return_carry=True)
    cb2, yb = bwd.apply({"params": v["params"]["backward_rnn"]}, x, seq_lengths=lengths,
                        return_carry=True, reverse=True, keep_order=True)
    np.testing.assert_array_equal(np.asarray(y), np.concatenate([np.asarray(yf),
                                                                 np.asarray(yb)], -1))
    np.testing.assert_array_equal(np.asarray(cf), np.asarray(cf2))
    for a, b in zip(cts.tree_util.tree_leaves(cb), cts.tree_util.tree_leaves(cb2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # merge_fn; the same RNN twice shares its parameters (warned)
    summed = nn.Bidirectional(fwd, nn.RNN(nn.GRUCell(H)), merge_fn=lambda a, b: a + b)
    assert summed.apply(summed.init(random.PRNGKey(0), x), x).shape == (B, T, H)
    with pytest.warns(UserWarning, match="share parameters"):
        shared = nn.Bidirectional(fwd, fwd)
        vs = shared.init(random.PRNGKey(0), x)
    assert list(vs["params"]) == ["forward_rnn"]


def test_conv_lstm_rnn_shapes():
    x = _x((2, 3, 5, 4, D))                       # (batch, time, h, w, features)
    rnn = nn.RNN(nn.ConvLSTMCell(H, kernel_size=(3, 3)), return_carry=True)
    v = rnn.init(random.PRNGKey(0), x)
    assert cts.tree_util.tree_map(np.shape, v["params"]["cell"]) == {
        "ih": {"kernel": (3, 3, D, 4 * H), "bias": (4 * H,)},
        "hh": {"kernel": (3, 3, H, 4 * H), "bias": (4 * H,)}}
    (c, h), y = rnn.apply(v, x)
    assert np.shape(c) == (2, 5, 4, H) and np.shape(y) == (2, 3, 5, 4, H)


# --- gradients -----------------------------------------------------------------------------

def test_gradients_match_finite_differences():
    x = _x((1, 3, 2))
    w = _x((1, 3, 2), seed=5)
    rnn = nn.RNN(nn.LSTMCell(2, **_NZ), return_carry=True)
    v = rnn.init(random.PRNGKey(0), x)

    def loss(p, x):
        (c, h), y = rnn.apply({"params": p}, x, seq_lengths=np.array([2]), reverse=True,
                              keep_order=True)
        return cnp.sum(y * w) + cnp.sum(c * c)

    gp, gx = cts.grad(loss, argnums=(0, 1))(v["params"], x)
    flat, tdef = cts.tree_util.tree_flatten(_np(v["params"]))
    gflat = [np.asarray(g) for g in cts.tree_util.tree_leaves(gp)]
    assert all(np.isfinite(g).all() for g in gflat) and np.isfinite(np.asarray(gx)).all()
    eps = 1e-2

    def f(leaves, xx):
        return float(np.asarray(loss(cts.tree_util.tree_unflatten(tdef, leaves), xx)))

    for k, leaf in enumerate(flat):
        for idx in [(0,) * leaf.ndim, tuple(d - 1 for d in leaf.shape)]:
            up = [a.copy() for a in flat]
            dn = [a.copy() for a in flat]
            up[k][idx] += eps
            dn[k][idx] -= eps
            fd = (f(up, x) - f(dn, x)) / (2 * eps)
            assert abs(fd - gflat[k][idx]) <= 2e-3 + 2e-2 * abs(fd), (k, idx, fd, gflat[k][idx])
    gx = np.asarray(gx)
    for idx in [(0, 0, 0), (0, 1, 1), (0, 2, 0)]:
        up, dn = x.copy(), x.copy()
        up[idx] += eps
        dn[idx] -= eps
        fd = (f(flat, up) - f(flat, dn)) / (2 * eps)
        assert abs(fd - gx[idx]) <= 2e-3 + 2e-2 * abs(fd), (idx, fd, gx[idx])
    # the carry is the last valid step's: the padding step (2 of a length-2 sequence) does not
    # reach it, while the padding outputs (not zeroed) do reach the loss above
    gc = np.asarray(cts.grad(lambda xx: cnp.sum(rnn.apply(v, xx, seq_lengths=np.array([2]))[0][0]
                                                ** 2))(x))
    assert np.all(gc[0, 2] == 0) and np.any(gc[0, :2] != 0) and np.any(gx[0, 2] != 0)


# --- errors --------------------------------------------------------------------------------

def test_errors():
    x = _x()
    rnn = nn.RNN(nn.LSTMCell(H))
    v = rnn.init(random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="need a time axis"):
        rnn.init(random.PRNGKey(0), np.ones((D,), np.float32))
    with pytest.raises(ValueError, match="time axis .* is empty"):
        rnn.init(random.PRNGKey(0), np.ones((B, 0, D), np.float32))
    with pytest.raises(ValueError, match="initial_carry has shapes"):
        rnn.apply(v, x, initial_carry=(np.zeros((B, H + 1), np.float32),) * 2)
    with pytest.raises(TypeError, match="initial_carry has the structure"):
        rnn.apply(v, x, initial_carry=np.zeros((B, H), np.float32))
    with pytest.raises(ValueError, match="seq_lengths of shape"):
        rnn.apply(v, x, seq_lengths=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"seq_lengths must lie in \[0, 5\]"):
        rnn.apply(v, x, seq_lengths=np.array([6, 2]))
    with pytest.raises(TypeError, match="seq_lengths must be integers"):
        rnn.apply(v, x, seq_lengths=np.array([1.0, 2.0]))
    cell = nn.LSTMCell(H)
    xs = x[:, 0]
    with pytest.raises(TypeError, match=r"LSTMCell: the carry is a pair \(c, h\)"):
        cell.init(random.PRNGKey(0), np.zeros((B, H), np.float32), xs)
    with pytest.raises(ValueError, match="LSTMCell: the carry's batch shape"):
        cell.init(random.PRNGKey(0), (np.zeros((3, H), np.float32),) * 2, xs)
    with pytest.raises(ValueError, match="carry's arrays must have one shape"):
        cell.init(random.PRNGKey(0), (np.zeros((B, H), np.float32),
                                      np.zeros((B, H + 1), np.float32)), xs)
    with pytest.raises(TypeError, match="GRUCell: the carry is one array"):
        nn.GRUCell(H).init(random.PRNGKey(0), (np.zeros((B, H), np.float32),) * 2, xs)
    with pytest.raises(ValueError, match="have no feature axis"):
        nn.GRUCell(H).init(random.PRNGKey(0), np.zeros((H,), np.float32), np.float32(1.0))
    with pytest.raises(TypeError, match="initial_carry is a pair"):
        nn.Bidirectional(rnn, nn.RNN(nn.GRUCell(H))).init(
            random.PRNGKey(0), x, initial_carry=np.zeros((B, H), np.float32))
    with pytest.raises(NotImplementedError):
        nn.RNNCellBase().initialize_carry(random.PRNGKey(0), (B, D))


def test_doctests():
    res = doctest.testmod(importlib.import_module("ctrainstate.nn.recurrent"),
                          optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


# --- parity with flax.linen (flax's values through jax_ref) ------------------------------------

def _flax_leaves(jax, tree):
    """A flax tree as [(jax's key path, leaf)], what _assert_trees_close compares with."""
    return [(jax.tree_util.keystr(p), np.asarray(a))
            for p, a in jax.tree_util.tree_leaves_with_path(tree)]


def _assert_trees_close(ours, ref, atol, what):
    """ours (a ctrainstate tree) against ref (_flax_leaves of flax's): the same key paths and
    shapes, and values within atol times the larger of 1 and the leaf's largest magnitude."""
    mine = [(cts.tree_util.keystr(p), np.asarray(a))
            for p, a in cts.tree_util.tree_leaves_with_path(ours)]
    assert [p for p, _ in mine] == [p for p, _ in ref], what
    for (p, a), (_, b) in zip(mine, ref):
        assert a.shape == b.shape, (what, p)
        np.testing.assert_allclose(a, b, rtol=0, atol=atol * max(1.0, float(np.abs(b).max())),
                                   err_msg=f"{what} {p}")


FLAX_CELLS = {
    "LSTMCell": {}, "OptimizedLSTMCell": {}, "GRUCell": {}, "SimpleCell": {"residual": True},
    "MGUCell": {}, "MGUCell-noreset": {"reset_gate": False},
}


@pytest.mark.parametrize("name", list(FLAX_CELLS))
def test_flax_parity_cell_and_rnn(name, jax_ref):
    kw = FLAX_CELLS[name]
    cls = name.split("-")[0]
    x = _x()
    lengths = np.array([5, 2])
    w = _x((B, T, H), seed=3)
    ccell = getattr(nn, cls)(H, **kw)
    carry = _random_carry(ccell, x[:, 0])

    def run(np_, tree_util, apply, p, x):
        fw = apply({"params": p}, x, seq_lengths=lengths)
        bw = apply({"params": p}, x, seq_lengths=lengths, reverse=True, keep_order=True)
        loss = np_.sum(fw[1] * w) + np_.sum(bw[1] * w ** 2) + sum(
            np_.sum(c) for c in tree_util.tree_leaves((fw[0], bw[0])))
        return loss, (fw, bw)

    def flax_side(jax, fnn):
        fcell = getattr(fnn, cls)(H, **kw)
        fcarry = fcell.initialize_carry(jax.random.key(1), x[:, 0].shape)
        fv = jax.jit(fcell.init)(jax.random.PRNGKey(2), fcarry, x[:, 0])
        step = jax.jit(fcell.apply)(fv, carry, x[:, 0])
        frnn = fnn.RNN(getattr(fnn, cls)(H, **kw), return_carry=True)
        rv = jax.jit(frnn.init)(jax.random.PRNGKey(3), x)
        floss = jax.jit(jax.value_and_grad(
            lambda p, x: run(jax.numpy, jax.tree_util, frnn.apply, p, x), argnums=(0, 1),
            has_aux=True))
        (fl, fout), fg = floss(rv["params"], x)
        return {"carry": _flax_leaves(jax, fcarry), "params": _flax_leaves(jax, fv),
                "step": _flax_leaves(jax, step), "rnn_params": _flax_leaves(jax, rv),
                "out": _flax_leaves(jax, fout), "loss": float(fl), "grads": _flax_leaves(jax, fg)}

    want = jax_ref("flax", flax_side)

    # the cell alone: parameters for the same key, one step
    ccarry = ccell.initialize_carry(random.PRNGKey(1), x[:, 0].shape)
    _assert_trees_close(ccarry, want["carry"], 0, f"{name} carry")
    cv = ccell.init(random.PRNGKey(2), ccarry, x[:, 0])
    _assert_trees_close(cv, want["params"], 1e-6, f"{name} params")
    _assert_trees_close(ccell.apply(cv, carry, x[:, 0]), want["step"], 1e-5, f"{name} step")

    # RNN: parameters, outputs and carries forward / reversed with seq_lengths, gradients
    crnn = nn.RNN(getattr(nn, cls)(H, **kw), return_carry=True)
    cv = crnn.init(random.PRNGKey(3), x)
    _assert_trees_close(cv, want["rnn_params"], 1e-6, f"RNN({name}) params")
    (cl, cout), cg = cts.value_and_grad(lambda p, x: run(cnp, cts.tree_util, crnn.apply, p, x),
                                        argnums=(0, 1), has_aux=True)(cv["params"], x)
    _assert_trees_close(cout, want["out"], 1e-5, f"RNN({name}) outputs and carries")
    np.testing.assert_allclose(float(np.asarray(cl)), want["loss"], rtol=1e-5)
    _assert_trees_close(cg, want["grads"], 1e-5, f"RNN({name}) gradients")


def test_flax_parity_bidirectional_and_conv_lstm(jax_ref):
    x = _x()
    lengths = np.array([3, 5])
    xc = _x((2, 3, 5, 4, D))

    def flax_side(jax, fnn):
        fb = fnn.Bidirectional(fnn.RNN(fnn.GRUCell(H)), fnn.RNN(fnn.LSTMCell(3), time_major=True),
                               return_carry=True)
        fv = jax.jit(fb.init)(jax.random.PRNGKey(4), x)
        fy = jax.jit(lambda v, x: fb.apply(v, x, seq_lengths=lengths))(fv, x)
        fr = fnn.RNN(fnn.ConvLSTMCell(H, kernel_size=(3, 3)), return_carry=True)
        frv = jax.jit(fr.init)(jax.random.PRNGKey(5), xc)
        return {"bi_params": _flax_leaves(jax, fv), "bi_out": _flax_leaves(jax, fy),
                "conv_params": _flax_leaves(jax, frv),
                "conv_out": _flax_leaves(jax, jax.jit(fr.apply)(frv, xc))}

    want = jax_ref("flax", flax_side)
    cb = nn.Bidirectional(nn.RNN(nn.GRUCell(H)), nn.RNN(nn.LSTMCell(3), time_major=True),
                          return_carry=True)
    cv = cb.init(random.PRNGKey(4), x)
    _assert_trees_close(cv, want["bi_params"], 1e-6, "Bidirectional params")
    _assert_trees_close(cb.apply(cv, x, seq_lengths=lengths), want["bi_out"], 1e-5,
                        "Bidirectional outputs")

    cr = nn.RNN(nn.ConvLSTMCell(H, kernel_size=(3, 3)), return_carry=True)
    cv = cr.init(random.PRNGKey(5), xc)
    _assert_trees_close(cv, want["conv_params"], 1e-6, "ConvLSTM params")
    _assert_trees_close(cr.apply(cv, xc), want["conv_out"], 1e-5, "ConvLSTM outputs")
