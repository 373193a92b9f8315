"""ctrainstate.pmap and the collectives of its named axis (lax.psum, pmean, pmax, pmin,
all_gather, ppermute, axis_index): values and gradients (jax's transpose rules), in_axes /
out_axes / static arguments, the output layout (one slice per device), the thread-local
contexts inside the replicas, the errors, and run_clm_flax's data-parallel train step against
a single-device step and against jax.pmap (live, or its recorded values)."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import P, hf, lax, nn, optim, random

N = 4


def host(x):
    return np.asarray(x)


def _xla_devices(jax, n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} JAX CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")


X = np.arange(1, N + 1, dtype=np.float32)


# --- collectives ---------------------------------------------------------------------------------

def test_collective_values():
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3) - 4.0
    out = cts.pmap(lambda v: {"s": lax.psum(v, "i"), "m": lax.pmean(v, "i"),
                              "hi": lax.pmax(v, "i"), "lo": lax.pmin(v, "i"),
                              "g": lax.all_gather(v, "i"), "t": lax.all_gather(v, "i", tiled=True),
                              "g1": lax.all_gather(v, "i", axis=1), "k": lax.axis_index("i"),
                              "n": lax.psum(1, "i")}, axis_name="i")(x)
    for j in range(N):
        np.testing.assert_array_equal(host(out["s"])[j], x.sum(0))
        np.testing.assert_allclose(host(out["m"])[j], x.mean(0), rtol=1e-6)
        np.testing.assert_array_equal(host(out["hi"])[j], x.max(0))
        np.testing.assert_array_equal(host(out["lo"])[j], x.min(0))
        np.testing.assert_array_equal(host(out["g"])[j], x)
        np.testing.assert_array_equal(host(out["t"])[j], x.reshape(-1))
        np.testing.assert_array_equal(host(out["g1"])[j], x.T)
    assert host(out["k"]).tolist() == list(range(N)) and out["k"].dtype == np.int32
    assert host(out["n"]).tolist() == [N] * N
    # ppermute: a ring shift, and a partial permutation (no source: zeros, as jax)
    ring = [(j, (j + 1) % N) for j in range(N)]
    got = cts.pmap(lambda v: lax.ppermute(v, "i", ring), "i")(x)
    np.testing.assert_array_equal(host(got), np.roll(x, 1, axis=0))
    got = cts.pmap(lambda v: lax.ppermute(v, "i", [(0, 2)]), "i")(x)
    want = np.zeros_like(x)
    want[2] = x[0]
    np.testing.assert_array_equal(host(got), want)
    # trees, integer psum, pmean of ints is float32 (psum / n)
    xi = np.arange(N, dtype=np.int32)
    got = cts.pmap(lambda v: (lax.psum({"a": v, "b": [v * 2]}, "i"), lax.pmean(v, "i")), "i")(xi)
    assert got[0]["a"].dtype == np.int32 and host(got[0]["a"]).tolist() == [xi.sum()] * N
    assert host(got[0]["b"][0]).tolist() == [2 * xi.sum()] * N
    assert got[1].dtype == np.float32 and host(got[1]).tolist() == [xi.mean()] * N


def test_collective_gradients_follow_jax_transpose_rules():
    """jax's pmap transposes psum to psum (so d/dx psum(x) is the axis size on every replica),
    pmean to pmean, all_gather to a psum then the replica's slice, ppermute to the inverse
    permutation; pmax / pmin are not differentiated."""
    g = cts.pmap(cts.grad(lambda v: lax.psum(v, "i")), "i")(X)
    assert host(g).tolist() == [float(N)] * N
    g = cts.pmap(cts.grad(lambda v: lax.pmean(v, "i")), "i")(X)
    assert host(g).tolist() == [1.0] * N
    g = cts.pmap(cts.grad(lambda v: lax.psum(v * v, "i")), "i")(X)     # 2 x * N
    np.testing.assert_allclose(host(g), 2 * X * N)
    w = np.arange(N, dtype=np.float32)
    g = cts.pmap(cts.grad(lambda v: cnp.sum(lax.all_gather(v, "i") * w)), "i")(X)
    np.testing.assert_allclose(host(g), N * w)                       # sum over replicas of w[i]
    ring = [(j, (j + 1) % N) for j in range(N)]
    g = cts.pmap(cts.grad(lambda v: lax.ppermute(v, "i", ring) * (lax.axis_index("i") + 1.0)),
                 "i")(X)
    # replica j's x reaches j + 1, which scales it by j + 2
    np.testing.assert_allclose(host(g), (np.arange(N) + 1) % N + 1.0)
    # a psum inside the loss and a pmean of the grads, as a data-parallel step
    v2 = cts.pmap(cts.value_and_grad(lambda v: lax.pmean(cnp.sum(v * v), "i")), "i")
    val, g = v2(X[:, None] * np.ones((N, 2), np.float32))
    np.testing.assert_allclose(host(val), [2 * np.mean(X ** 2)] * N, rtol=1e-6)
    np.testing.assert_allclose(host(g), 2 * X[:, None] * np.ones((N, 2)), rtol=1e-6)


def _collectives_body(L, np_, ring):
    def f(v):
        k = L.axis_index("i").astype(np_.float32)
        y = np_.sin(v) * (k + 1.0)
        return (L.psum(y, "i"), L.pmean(y * y, "i"), L.pmax(y, "i"),
                L.all_gather(y, "i", axis=1), L.ppermute(y, "i", ring))
    return f


def _collectives_loss(L, np_):
    return lambda v: L.psum(np_.sum(np_.tanh(v) * L.all_gather(v, "i", tiled=True)[:3]), "i")


def _jax_collectives(jax, x, ring):
    _xla_devices(jax, N)
    return {"values": jax.pmap(_collectives_body(jax.lax, jax.numpy, ring), "i")(x),
            "grad": jax.pmap(jax.grad(_collectives_loss(jax.lax, jax.numpy)), "i")(x)}


def test_collectives_match_live_jax(jax_ref):
    x = (np.arange(N * 3, dtype=np.float32).reshape(N, 3) - 4.0) / 3.0
    ring = [(j, (j + 1) % N) for j in range(N)]
    want = jax_ref("jax.pmap", lambda jax: _jax_collectives(jax, x, ring))
    got = cts.pmap(_collectives_body(lax, cnp, ring), "i")(x)
    for w, g in zip(want["values"], got, strict=True):
        np.testing.assert_allclose(host(g), w, rtol=2e-6, atol=1e-7)
    got = cts.pmap(cts.grad(_collectives_loss(lax, cnp)), "i")(x)
    np.testing.assert_allclose(host(got), want["grad"], rtol=2e-6, atol=1e-6)


# --- pmap's arguments and layout -----------------------------------------------------------------

def test_in_axes_out_axes_static_and_keyword_arguments():
    a = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    b = np.arange(3 * N, dtype=np.float32).reshape(3, N)
    # broadcast (None), another mapped axis, a dict prefix
    out = cts.pmap(lambda u, s, v: u * s + v[0], in_axes=(0, None, 1))(a, 10.0, b)
    np.testing.assert_array_equal(host(out), a * 10.0 + b[0][:, None])
    out = cts.pmap(lambda t: t["p"] + t["q"], in_axes=({"p": 0, "q": None},))(
        {"p": a, "q": np.float32([1.0, 2.0])})
    np.testing.assert_array_equal(host(out), a + [1.0, 2.0])
    # keyword arguments are mapped over axis 0
    out = cts.pmap(lambda u, *, scale: u * scale)(a, scale=np.arange(N, dtype=np.float32))
    np.testing.assert_array_equal(host(out), a * np.arange(N)[:, None])
    # static arguments reach every replica unchanged (here a Python callable)
    out = cts.pmap(lambda u, fn: fn(u), static_broadcasted_argnums=1)(a, cnp.square)
    np.testing.assert_array_equal(host(out), a * a)
    # out_axes: 1 moves the mapped axis, None returns replica 0's (replicated) value
    out = cts.pmap(lambda u: u * 2.0, out_axes=1)(a)
    np.testing.assert_array_equal(host(out), (a * 2.0).T)
    out = cts.pmap(lambda u: (lax.psum(u, "i"), u), "i", out_axes=(None, 0))(a)
    np.testing.assert_array_equal(host(out[0]), a.sum(0))
    np.testing.assert_array_equal(host(out[1]), a)
    # no mapped argument: axis_size says how many replicas
    out = cts.pmap(lambda: lax.axis_index("i") * 3, "i", axis_size=3)()
    assert host(out).tolist() == [0, 3, 6]
    # the decorator form
    @cts.pmap
    def double(u):
        return u + u
    np.testing.assert_array_equal(host(double(a)), 2 * a)


def test_output_layout_one_slice_per_device_and_round_trip():
    devs = cts.local_devices()[:N]
    f = cts.pmap(lambda u: u * 2.0, "batch")
    out = f(np.arange(N * 3, dtype=np.float32).reshape(N, 3))
    assert out.sharding.spec == P("batch") and out.shape == (N, 3)
    assert list(out.sharding.mesh.devices) == devs
    for s in out.addressable_shards:
        j = devs.index(s.device)
        assert s.index[0] == slice(j, j + 1)
        np.testing.assert_array_equal(np.asarray(s.data), [[6.0 * j, 6.0 * j + 2, 6.0 * j + 4]])
    # the output goes back in (one device copy per slice), as does hf.replicate's layout
    again = f(out)
    np.testing.assert_array_equal(host(again), 4.0 * np.arange(N * 3).reshape(N, 3))
    r = hf.replicate({"w": np.float32([1.0, 2.0])}, devices=devs)
    got = cts.pmap(lambda t: t["w"] * (lax.axis_index("batch") + 1.0), "batch")(r)
    np.testing.assert_array_equal(host(got), np.outer(np.arange(1, N + 1), [1.0, 2.0]))
    # an Array laid out otherwise (replicated, or sharded along another dim) is sliced too
    mesh = cts.make_mesh((2,), ("x",))
    y = cts.device_put(np.arange(N * 2, dtype=np.float32).reshape(N, 2), cts.NamedSharding(mesh, P(None, "x")))
    np.testing.assert_array_equal(host(f(y)), 2.0 * np.arange(N * 2).reshape(N, 2))
    # the inputs stay valid (donate_argnums is accepted and changes nothing)
    a = cts.device_put(np.ones((N, 2), np.float32))
    cts.pmap(lambda u: u + 1.0, donate_argnums=0)(a)
    assert host(a).tolist() == [[1.0, 1.0]] * N
    # the same call twice: the same bits (replicas run in a fixed order)
    g = cts.pmap(lambda u: lax.pmean(cnp.sin(u) * 1.7, "i"), "i")
    xx = np.random.RandomState(0).randn(N, 33).astype(np.float32)
    assert host(g(xx)).tobytes() == host(g(xx)).tobytes()


def test_replicas_compute_on_their_device_with_the_callers_contexts():
    devs = cts.local_devices()[:N]
    seen = {}

    def f(u):
        k = int(host(lax.axis_index("i")))
        z = cnp.zeros(3)                    # no operand: created on the replica's device
        seen[k] = (u.devices(), z.devices(), nn.get_logical_axis_rules())
        return u + z.sum()

    rules = (("batch", "data"), ("embed", None))
    with nn.logical_axis_rules(rules):
        cts.pmap(f, "i")(np.zeros((N, 2), np.float32))
    for k in range(N):
        assert seen[k][0] == {devs[k]} and seen[k][1] == {devs[k]}
        assert seen[k][2] == rules


def test_errors_say_what_is_wrong():
    a = np.ones((N, 2), np.float32)
    with pytest.raises(NameError, match="unbound axis name: 'i'.*enclosing ctrainstate.pmap"):
        lax.psum(a, "i")
    with pytest.raises(NameError, match="unbound axis name: 'j'.*bound here: \\['i'\\]"):
        cts.pmap(lambda u: lax.psum(u, "j"), "i")(a)
    with pytest.raises(ValueError, match="inconsistent sizes for array axes to be mapped"):
        cts.pmap(lambda u, v: u + v)(a, np.ones((N + 1, 2), np.float32))
    n_dev = cts.local_device_count()
    with pytest.raises(ValueError, match=f"size {n_dev + 1} but only {n_dev} devices"):
        cts.pmap(lambda u: u)(np.ones((n_dev + 1,), np.float32))
    with pytest.raises(ValueError, match="rank should be at least 1"):
        cts.pmap(lambda u: u)(np.float32(1.0))
    with pytest.raises(ValueError, match="give axis_size="):
        cts.pmap(lambda: 1.0)()
    with pytest.raises(ValueError, match="tree prefix"):
        cts.pmap(lambda u, v: u, in_axes=(0,))(a, a)
    with pytest.raises(TypeError, match="an int or None"):
        cts.pmap(lambda u: u, in_axes="0")(a)
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        cts.pmap(lambda u: lax.psum(u, "i", axis_index_groups=[[0, 1], [2, 3]]), "i")(a)
    with pytest.raises(NotImplementedError, match="nested pmap"):
        cts.pmap(lambda u: cts.pmap(lambda w: w)(u[None]), "i")(a)
    with pytest.raises(NotImplementedError, match="take the gradient inside the mapped"):
        cts.grad(lambda u: cnp.sum(cts.pmap(lambda w: w * 2.0)(u)))(cts.device_put(a))
    with pytest.raises(ValueError, match="unique indices in \\[0, 4\\)"):
        cts.pmap(lambda u: lax.ppermute(u, "i", [(0, 1), (1, 1)]), "i")(a)
    with pytest.raises(TypeError, match="must be a function"):
        cts.pmap(3)


def test_a_failing_replica_stops_the_others_and_its_error_reaches_the_caller():
    calls = []

    def f(u):
        k = int(host(lax.axis_index("i")))
        calls.append(k)
        if k == 2:
            raise ValueError("bad batch on replica two")
        return lax.psum(u, "i") + lax.psum(u, "i")   # the others wait here, then stop

    with pytest.raises(ValueError, match="bad batch on replica two") as info:
        cts.pmap(f, "i")(np.ones((N, 2), np.float32))
    assert any("replica 2 of 4" in n for n in getattr(info.value, "__notes__", []))
    assert calls == [0, 1, 2]     # replicas run in turn: 3 never started, 0 and 1 stopped
    # the next pmap runs normally (no thread or state left behind)
    np.testing.assert_array_equal(host(cts.pmap(lambda u: lax.psum(u, "i"), "i")(X)),
                                  [X.sum()] * N)


def test_replicas_that_reach_different_collectives_are_an_error():
    def f(u):
        if int(host(lax.axis_index("i"))) == 0:    # a data-dependent branch around a collective
            return lax.psum(u, "i")
        return u

    with pytest.raises(RuntimeError, match="different collectives.*replica 0: psum.*replica 1: "
                                           "returned"):
        cts.pmap(f, "i")(np.ones((N, 2), np.float32))

    def g(u):
        if int(host(lax.axis_index("i"))) == 1:
            return lax.psum({"a": u}, "i")
        return lax.psum(u, "i")

    with pytest.raises(RuntimeError, match="different collectives"):
        cts.pmap(g, "i")(np.ones((N, 2), np.float32))


# --- run_clm_flax's data-parallel step ------------------------------------------------------------

def _mlp_of(m):
    """The same MLP with Dropout in ctrainstate.nn or flax.linen (``m``)."""
    class MLP(m.Module):
        @m.compact
        def __call__(self, x, train=False):
            x = m.relu(m.Dense(16)(x))
            x = m.Dropout(0.1, deterministic=not train)(x)
            return m.Dense(3)(x)
    return MLP()


def _batches(steps, n):
    rs = np.random.RandomState(0)
    return [{"x": rs.randn(2 * n, 5).astype(np.float32),
             "y": rs.randint(0, 3, 2 * n).astype(np.int32)} for _ in range(steps)]


def _clm_step(ct, train):
    def train_step(state, batch):
        dropout_rng, new_rng = ct.random.split(state.dropout_rng)

        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"], train=train,
                                    rngs={"dropout": dropout_rng})
            return ct.xent(logits, batch["y"]).mean()
        loss, grad = ct.value_and_grad(loss_fn)(state.params)
        grad = ct.lax.pmean(grad, "batch")
        new_state = state.apply_gradients(grads=grad, dropout_rng=new_rng)
        return new_state, ct.lax.pmean({"loss": loss}, axis_name="batch")
    return train_step


class _Ct:
    random, lax, value_and_grad = random, lax, staticmethod(cts.value_and_grad)
    xent = staticmethod(optim.softmax_cross_entropy_with_integer_labels)


def _ct_pmap_run(steps, train):
    model = _mlp_of(nn)
    rng, dropout_rng = random.split(random.PRNGKey(0))
    params = model.init(rng, np.ones((1, 5), np.float32))["params"]
    state = hf.TrainState.create(apply_fn=model.apply, params=params,
                                 tx=optim.adamw(1e-2, weight_decay=0.01), dropout_rng=dropout_rng)
    p_step = cts.pmap(_clm_step(_Ct, train), "batch", donate_argnums=(0,))
    state = state.replicate()
    losses = []
    for batch in _batches(steps, cts.local_device_count()):
        state, m = p_step(state, hf.shard(batch))
        losses.append(float(host(hf.unreplicate(m)["loss"])))
    return state, losses, (model, params)


def test_run_clm_flax_pmap_step_equals_one_step_on_the_global_batch():
    """Without dropout, the mean of the per-device gradients (equal per-device batches) is the
    gradient of the mean loss over the global batch: the pmapped run_clm_flax step and a plain
    step on the whole batch give the same params, on every replica."""
    n = cts.local_device_count()
    state, losses, (model, params) = _ct_pmap_run(3, train=False)
    assert host(state.step).tolist() == [3] * n
    ref = hf.TrainState.create(apply_fn=model.apply, params=params,
                               tx=optim.adamw(1e-2, weight_decay=0.01),
                               dropout_rng=random.PRNGKey(1))
    ref_losses = []
    for batch in _batches(3, n):
        def loss_fn(p):
            logits = ref.apply_fn({"params": p}, batch["x"])
            return optim.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        loss, grad = cts.value_and_grad(loss_fn)(ref.params)
        ref = ref.apply_gradients(grads=grad)
        ref_losses.append(float(host(loss)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    flat = dict(cts.tree_util.tree_leaves_with_path(state.params))
    flat_ref = dict(cts.tree_util.tree_leaves_with_path(ref.params))
    assert flat.keys() == flat_ref.keys()
    for k in flat:
        rep = host(flat[k])
        assert rep.shape[0] == n
        for j in range(n):       # every replica holds the same params
            np.testing.assert_allclose(rep[j], host(flat_ref[k]), rtol=2e-5, atol=1e-6)


def _jax_pmap_run(jax, flax_nn, optax, n, steps):
    """run_clm_flax's loop with jax.pmap / flax / optax: the losses, the params' leaves by
    path and the replicated dropout keys after `steps` steps."""
    from typing import Any

    from flax import jax_utils
    from flax.training import common_utils, train_state
    _xla_devices(jax, n)

    class JState(train_state.TrainState):
        dropout_rng: Any

        def replicate(self):
            return jax_utils.replicate(self).replace(
                dropout_rng=common_utils.shard_prng_key(self.dropout_rng))

    class _J:
        random, lax, value_and_grad = jax.random, jax.lax, staticmethod(jax.value_and_grad)
        xent = staticmethod(optax.softmax_cross_entropy_with_integer_labels)

    model = _mlp_of(flax_nn)
    rng, dropout_rng = jax.random.split(jax.random.PRNGKey(0))
    params = model.init(rng, np.ones((1, 5), np.float32))["params"]
    state = JState.create(apply_fn=model.apply, params=params,
                          tx=optax.adamw(1e-2, weight_decay=0.01), dropout_rng=dropout_rng)
    p_step = jax.pmap(_clm_step(_J, True), "batch", donate_argnums=(0,))
    state = state.replicate()
    losses = []
    for batch in _batches(steps, n):
        state, m = p_step(state, common_utils.shard(batch))
        losses.append(float(jax_utils.unreplicate(m)["loss"]))
    return {"losses": losses, "dropout_rng": state.dropout_rng,
            "params": [[jax.tree_util.keystr(k), w]
                       for k, w in jax.tree_util.tree_leaves_with_path(state.params)]}


def test_run_clm_flax_pmap_step_matches_jax_pmap(jax_ref):
    """The same script with jax.pmap / flax / optax: per-device dropout keys
    (shard_prng_key), pmean'd grads and loss; ctrainstate's keys and dropout masks are jax's,
    so the params after three steps agree to float32 rounding."""
    n = cts.local_device_count()
    want = jax_ref(f"jax.pmap-{n}-devices",
                   lambda jax, fnn, optax: _jax_pmap_run(jax, fnn, optax, n, 3))
    got, got_losses, _ = _ct_pmap_run(3, train=True)
    np.testing.assert_allclose(got_losses, want["losses"], rtol=1e-5)
    flat = dict((cts.tree_util.keystr(k), v) for k, v in cts.tree_util.tree_leaves_with_path(got.params))
    for k, w in want["params"]:
        np.testing.assert_allclose(host(flat[k]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(host(got.dropout_rng), want["dropout_rng"])


# --- norm layers with axis_name (Flax's distributed statistics) ---------------------------------

def test_batchnorm_axis_name_uses_the_global_batch_statistics():
    """BatchNorm(axis_name='batch') in a pmap: the pmean of equal-sized replicas' means is the
    mean of the global batch, so each replica's output is its slice of one BatchNorm over the
    whole batch, and every replica's updated averages are the global ones."""
    n = N
    x = np.random.RandomState(1).randn(n * 3, 5).astype(np.float32) * 2.0 + 0.5
    bn_g = nn.BatchNorm(use_running_average=False, momentum=0.9)
    v = bn_g.init(random.PRNGKey(0), x[:3])
    y_all, upd_all = bn_g.apply(v, x, mutable=["batch_stats"])
    bn = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name="batch")

    def step(variables, xb):
        return bn.apply(variables, xb, mutable=["batch_stats"])
    y, upd = cts.pmap(step, "batch", in_axes=(None, 0))(v, x.reshape(n, 3, 5))
    np.testing.assert_allclose(host(y).reshape(n * 3, 5), host(y_all), rtol=2e-5, atol=2e-6)
    for k in ("mean", "var"):
        got = host(upd["batch_stats"][k])
        for j in range(n):
            np.testing.assert_allclose(got[j], host(upd_all["batch_stats"][k]), rtol=2e-5,
                                       atol=1e-6)
    # without axis_name each replica normalises with its own slice's statistics instead
    y_local, _ = cts.pmap(lambda vv, xb: nn.BatchNorm(use_running_average=False).apply(
        vv, xb, mutable=["batch_stats"]), in_axes=(None, 0))(v, x.reshape(n, 3, 5))
    assert not np.allclose(host(y_local).reshape(n * 3, 5), host(y_all), atol=1e-3)


def _norm_builds(m):   # axis_name=None for init: outside a pmap it is unbound in Flax too
    return [lambda a=None: m.BatchNorm(use_running_average=False, axis_name=a),
            lambda a=None: m.BatchNorm(use_running_average=False, axis_name=a,
                                       use_fast_variance=False),
            lambda a=None: m.LayerNorm(axis_name=a),
            lambda a=None: m.GroupNorm(num_groups=3, axis_name=a)]


def _flax_norm_pmap(jax, fnn, i, x):
    """Flax's i-th norm of _norm_builds: its init variables, and its output and updated
    batch_stats under jax.pmap."""
    _xla_devices(jax, N)
    make_fx = _norm_builds(fnn)[i]
    v = make_fx().init(jax.random.PRNGKey(0), x[0])
    want = jax.pmap(lambda xb: make_fx("batch").apply(v, xb, mutable=["batch_stats"]),
                    "batch")(x)
    return {"variables": v, "y": want[0], "batch_stats": dict(want[1].get("batch_stats", {}))}


def test_norms_with_axis_name_match_live_flax_pmap(jax_ref):
    x = np.random.RandomState(2).randn(N, 2, 3, 6).astype(np.float32) * 1.5 - 0.25
    for i, make_ct in enumerate(_norm_builds(nn)):
        want = jax_ref(f"norm{i}", lambda jax, fnn: _flax_norm_pmap(jax, fnn, i, x))
        v = want["variables"]
        got = cts.pmap(lambda xb: make_ct("batch").apply(v, xb, mutable=["batch_stats"]),
                       "batch")(x)
        np.testing.assert_allclose(host(got[0]), want["y"], rtol=2e-5, atol=2e-6)
        for k in want["batch_stats"]:
            np.testing.assert_allclose(host(got[1]["batch_stats"][k]), want["batch_stats"][k],
                                       rtol=2e-5, atol=1e-6)


# --- device_put_sharded / device_put_replicated / prefetch_to_device --------------------------

def test_device_put_sharded_replicated_and_prefetch_to_device():
    devs = cts.local_devices()[:N]
    shards = [{"x": np.full((2,), j, np.float32), "k": np.int32(j)} for j in range(N)]
    t = cts.device_put_sharded(shards, devs)
    assert t["x"].shape == (N, 2) and t["k"].shape == (N,) and t["k"].dtype == np.int32
    for s in t["x"].addressable_shards:          # each device holds exactly its shard
        j = devs.index(s.device)
        assert s.index[0] == slice(j, j + 1) and np.asarray(s.data).tolist() == [[j, j]]
    got = cts.pmap(lambda d: d["x"] * d["k"], "batch", devices=devs)(t)
    np.testing.assert_array_equal(host(got), [[j * j] * 2 for j in range(N)])
    r = cts.device_put_replicated({"w": np.float32([1.0, 2.0])}, devs)
    assert r["w"].shape == (N, 2) and host(r["w"]).tolist() == [[1.0, 2.0]] * N
    assert r["w"].sharding == t["x"].sharding
    with pytest.raises(ValueError, match="len\\(shards\\) = 2 must equal len\\(devices\\) = 4"):
        cts.device_put_sharded(shards[:2], devs)
    with pytest.raises(ValueError, match="different shapes or dtypes"):
        cts.device_put_sharded([np.ones(2)] * (N - 1) + [np.ones(3)], devs)
    with pytest.raises(ValueError, match="distinct"):
        cts.device_put_replicated(1.0, [devs[0], devs[0]])
    # prefetch_to_device: the same elements in order, placed `size` ahead of use
    pulled = []

    def source():
        for i in range(5):
            pulled.append(i)
            yield {"b": np.full((N, 3), i, np.float32)}

    it = hf.prefetch_to_device(source(), 2, devices=devs)
    first = next(it)
    assert pulled == [0, 1]           # two placed before the first is used
    second = next(it)
    assert pulled == [0, 1, 2]        # then one more each time one is taken
    assert first["b"].sharding == t["x"].sharding
    rest = [float(host(e["b"]).mean()) for e in it]
    assert [float(host(first["b"]).mean()), float(host(second["b"]).mean())] + rest == [
        0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="leading dimension of 4"):
        next(hf.prefetch_to_device(iter([{"b": np.ones((3, 2))}]), 1, devices=devs))


def test_pad_shard_unpad_evaluates_batches_of_any_size():
    """flax.jax_utils.pad_shard_unpad around a pmapped eval step: a batch that does not divide
    by the device count is zero-padded, evaluated, and cut back; per-example outputs equal
    the unmapped computation."""
    n = cts.local_device_count()
    w = np.random.RandomState(3).randn(3, 2).astype(np.float32)

    def eval_step(params, batch):
        logits = batch["x"] @ params["w"]
        return {"logits": logits, "pred": cnp.argmax(logits, axis=-1)}

    f = hf.pad_shard_unpad(cts.pmap(eval_step, "batch"))
    for b in (1, n - 1, n, 2 * n + 3):
        x = np.random.RandomState(b).randn(b, 3).astype(np.float32)
        out = f(hf.replicate({"w": w}), {"x": x})
        assert out["logits"].shape == (b, 2) and out["pred"].shape == (b,)
        np.testing.assert_allclose(out["logits"], x @ w, rtol=1e-5, atol=1e-6)
        assert out["pred"].tolist() == (x @ w).argmax(-1).tolist()
    # min_device_batch pads every device to at least that many rows
    seen = []
    g = hf.pad_shard_unpad(cts.pmap(lambda x: (seen.append(x.shape), x * 2.0)[1]),
                           static_argnums=())
    got = g(np.ones((5,), np.float32), min_device_batch=3)
    assert seen[-1] == (3,) and got.tolist() == [2.0] * 5
    # static_return: the outputs as the pmapped step returned them (a pmean'd metric)
    h = hf.pad_shard_unpad(cts.pmap(lambda p, x: lax.pmean(cnp.sum(x), "batch"), "batch"),
                           static_return=True)
    m = h(hf.replicate({"w": w}), np.ones((n,), np.float32))
    assert m.shape == (n,) and np.asarray(m).tolist() == [1.0] * n
    with pytest.raises(ValueError, match="inconsistent batch sizes \\[2, 3\\]"):
        f(hf.replicate({"w": w}), {"x": np.ones((2, 3), np.float32),
                                   "y": np.ones((3,), np.float32)})


def test_psum_scatter_values_gradients_and_live_jax(jax_ref):
    x = np.arange(N * N * 2, dtype=np.float32).reshape(N, N, 2) - 7.0   # replica j: x[j]
    total = x.sum(0)                                                    # (N, 2)
    got = cts.pmap(lambda v: lax.psum_scatter(v, "i"), "i")(x)
    np.testing.assert_array_equal(host(got), total)                     # replica j: row j
    xt = np.arange(N * 2 * N, dtype=np.float32).reshape(N, 2 * N) / 4.0
    got = cts.pmap(lambda v: lax.psum_scatter(v, "i", scatter_dimension=0, tiled=True), "i")(xt)
    np.testing.assert_array_equal(host(got), xt.sum(0).reshape(N, 2))
    got = cts.pmap(lambda v: lax.psum_scatter(v, "i", scatter_dimension=1), "i")(
        np.swapaxes(x, 1, 2))
    np.testing.assert_array_equal(host(got), total)
    # the transpose is an all_gather: d/dx_j sum_i w_i . out_i = [w_0, ..., w_{N-1}]
    w = np.arange(1, N + 1, dtype=np.float32)
    g = cts.pmap(cts.grad(lambda v: cnp.sum(lax.psum_scatter(v, "i")
                                            * (lax.axis_index("i") + 1.0))), "i")(x)
    np.testing.assert_array_equal(host(g), np.broadcast_to(w[None, :, None], x.shape))
    with pytest.raises(ValueError, match="has size 3; it must be the axis size 4"):
        cts.pmap(lambda v: lax.psum_scatter(v, "i"), "i")(np.ones((N, 3), np.float32))
    with pytest.raises(ValueError, match="must be a multiple of the axis size 4"):
        cts.pmap(lambda v: lax.psum_scatter(v, "i", tiled=True), "i")(np.ones((N, 6), np.float32))
    cases = (({}, x), ({"tiled": True}, xt), ({"scatter_dimension": 1}, np.swapaxes(x, 1, 2)))

    def theirs(jax):
        _xla_devices(jax, N)
        jl = jax.lax
        out = [jax.pmap(lambda v: jl.psum_scatter(jax.numpy.sin(v), "i", **kw), "i")(arr)
               for kw, arr in cases]
        return out + [jax.pmap(jax.grad(lambda v: jax.numpy.sum(
            jl.psum_scatter(v * v, "i") * (jl.axis_index("i") + 1.0))), "i")(x)]

    wants = jax_ref("jax.pmap", theirs)
    for (kw, arr), want in zip(cases, wants[:3], strict=True):
        got = cts.pmap(lambda v: lax.psum_scatter(cnp.sin(v), "i", **kw), "i")(arr)
        np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-6)
    got = cts.pmap(cts.grad(lambda v: cnp.sum(
        lax.psum_scatter(v * v, "i") * (lax.axis_index("i") + 1.0))), "i")(x)
    np.testing.assert_allclose(host(got), wants[3], rtol=1e-6)
