"""Flax-parity regressions in ``ctrainstate.nn`` found by running the same module code through
flax.linen and ctrainstate.nn. Each behaviour is checked by hand (the expectation derived in the
test) and, when flax is installed, against live flax."""
import numpy as np
import pytest

from ctrainstate import nn, random


def _flax():
    return pytest.importorskip("flax.linen")


def _jnp():
    return pytest.importorskip("jax.numpy")


# --- DenseGeneral: axis given out of order -------------------------------------------------

def test_dense_general_axis_out_of_order_is_sorted_like_flax():
    # Flax's _normalize_axes sorts the contracted axes, so axis=(-1, -2) on a (2, 3, 4) input
    # is axis (1, 2): a kernel (3, 4, 5) indexed in the input's order, y = einsum('bij,ijf->bf').
    x = np.random.RandomState(0).randn(2, 3, 4).astype(np.float32)
    m = nn.DenseGeneral(5, axis=(-1, -2), bias_init=nn.initializers.normal(1.0))
    v = m.init(random.PRNGKey(0), x)
    k = np.asarray(v["params"]["kernel"])
    b = np.asarray(v["params"]["bias"])
    assert k.shape == (3, 4, 5)
    # the same parameters as axis=(1, 2) (same key, same flattened init shape)
    v12 = nn.DenseGeneral(5, axis=(1, 2), bias_init=nn.initializers.normal(1.0)).init(
        random.PRNGKey(0), x)
    np.testing.assert_array_equal(k, np.asarray(v12["params"]["kernel"]))
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), np.einsum("bij,ijf->bf", x, k) + b,
                               rtol=1e-5, atol=1e-5)


def test_dense_general_axis_out_of_order_matches_flax():
    fnn, jnp = _flax(), _jnp()
    x = np.random.RandomState(1).randn(2, 3, 4, 2).astype(np.float32)
    for axis, bdims in (((-1, -2), ()), ((3, 1), ()), ((3, 2), (0,))):
        key = random.PRNGKey(3)
        v = nn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims).init(key, x)
        fm = fnn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims)
        fv = fm.init(jnp.asarray(key), jnp.asarray(x))
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(np.asarray(v["params"][name]),
                                          np.asarray(fv["params"][name]), err_msg=f"{axis} {name}")
        np.testing.assert_allclose(
            np.asarray(nn.DenseGeneral((2, 3), axis=axis, batch_dims=bdims).apply(v, x)),
            np.asarray(fm.apply(fv, jnp.asarray(x))), rtol=1e-5, atol=1e-5, err_msg=str(axis))


# --- a variable and a submodule with one name -----------------------------------------------

def _clash_models(nn_mod, ones, zeros):
    class ParamThenModule(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            self.param("Dense_0", ones, (3,))
            return nn_mod.Dense(2)(x)

    class ModuleThenParam(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            y = nn_mod.Dense(2)(x)
            self.param("Dense_0", ones, (3,))
            return y

    class StatThenModule(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            self.variable("stats", "inner", zeros)
            return nn_mod.Dense(2, name="inner")(x)

    class SetupClash(nn_mod.Module):
        def setup(self):
            self.d = nn_mod.Dense(2)
            self.w = self.param("d", ones, (3,))

        def __call__(self, x):
            return self.d(x)

    return [ParamThenModule(), ModuleThenParam(), StatThenModule(), SetupClash()]


def test_variable_and_submodule_sharing_a_name_is_refused():
    # Flax reserves a name for one submodule or for variables (one per collection): a param
    # named like a submodule would read (or overwrite) the submodule's whole subtree.
    x = np.ones((2, 3), np.float32)
    zeros = lambda: np.zeros((), np.float32)
    for m in _clash_models(nn, nn.initializers.ones, zeros):
        with pytest.raises(ValueError, match="Dense_0|inner|\"d\""):
            m.init(random.PRNGKey(0), x)


def test_variables_sharing_a_name_across_collections_is_allowed():
    # Flax allows one name in several collections (a param and a batch stat 'mean')
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("mean", nn.initializers.ones, (3,))
            s = self.variable("stats", "mean", lambda: np.full((3,), 2.0, np.float32))
            return x * w + s.value

    v = M().init(random.PRNGKey(0), np.ones((2, 3), np.float32))
    assert sorted(v) == ["params", "stats"]
    np.testing.assert_array_equal(np.asarray(M().apply(v, np.ones((2, 3), np.float32))),
                                  np.full((2, 3), 3.0, np.float32))


def test_variable_and_submodule_sharing_a_name_matches_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    x = np.ones((2, 3), np.float32)
    fl = _clash_models(fnn, fnn.initializers.ones, lambda: jnp.zeros(()))
    ct = _clash_models(nn, nn.initializers.ones, lambda: np.zeros((), np.float32))
    for fm, cm in zip(fl, ct):
        from flax.errors import NameInUseError as FlaxNameInUse
        with pytest.raises(FlaxNameInUse):
            fm.init(jax.random.PRNGKey(0), jnp.asarray(x))
        with pytest.raises(nn.scope.NameInUseError):
            cm.init(random.PRNGKey(0), x)


# --- Module.variables of a submodule ----------------------------------------------------------

def _variables_model(nn_mod, zeros):
    class Inner(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            return nn_mod.Dense(2)(x)

    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            self.variable("stats", "c", zeros)
            a = Inner()
            a(x)
            b = nn_mod.Dense(3)
            b(x)
            return a.variables, b.variables, self.variables

    class S(nn_mod.Module):
        def setup(self):
            self.enc = nn_mod.Dense(4)

        def __call__(self, x):
            return self.enc(x)

    return M(), S()


def _shapes(tree):
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: _shapes(v) for k, v in tree.items()}
    return tuple(np.shape(tree))


def test_submodule_variables_are_its_own_subtree():
    # Flax's Module.variables is the module's scope's view: a child sees its own params
    # (relative to its path), not the root's; collections it has nothing in are left out.
    x = np.ones((2, 3), np.float32)
    m, s = _variables_model(nn, lambda: np.zeros((), np.float32))
    v = m.init(random.PRNGKey(0), x)
    va, vb, vroot = m.apply(v, x)
    assert _shapes(va) == {"params": {"Dense_0": {"kernel": (3, 2), "bias": (2,)}}}
    assert _shapes(vb) == {"params": {"kernel": (3, 3), "bias": (3,)}}
    assert sorted(vroot) == ["params", "stats"]
    sv = s.init(random.PRNGKey(0), x)
    bound = s.bind(sv)
    assert _shapes(bound.enc.variables) == {"params": {"kernel": (3, 4), "bias": (4,)}}
    np.testing.assert_array_equal(np.asarray(bound.enc.variables["params"]["kernel"]),
                                  np.asarray(sv["params"]["enc"]["kernel"]))


def test_submodule_variables_match_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    x = np.ones((2, 3), np.float32)
    fm, fs = _variables_model(fnn, lambda: jnp.zeros(()))
    cm, cs = _variables_model(nn, lambda: np.zeros((), np.float32))
    fv = fm.init(jax.random.PRNGKey(0), jnp.asarray(x))
    cv = cm.init(random.PRNGKey(0), x)
    assert [_shapes(t) for t in cm.apply(cv, x)] == [_shapes(t) for t in fm.apply(fv, jnp.asarray(x))]
    fsv = fs.init(jax.random.PRNGKey(0), jnp.asarray(x))
    csv = cs.init(random.PRNGKey(0), x)
    assert _shapes(cs.bind(csv).enc.variables) == _shapes(fs.bind(fsv).enc.variables)


# --- apply with parameters of the wrong shape -------------------------------------------------

def test_existing_param_of_the_wrong_shape_is_refused():
    # Flax compares each existing parameter with the shape its initializer would make
    # (ScopeParamShapeError): Dense(4) applied to Dense(1)'s params must not silently return a
    # (2, 1) output, and an Embed / LayerNorm of other sizes must say which parameter differs.
    x = np.ones((2, 3), np.float32)
    v1 = nn.Dense(1).init(random.PRNGKey(0), x)
    with pytest.raises(nn.scope.ScopeParamShapeError,
                       match=r'"kernel" in "/".*shape \(3, 4\).*shape \(3, 1\)'):
        nn.Dense(4).apply(v1, x)
    with pytest.raises(ValueError, match=r'"embedding".*\(20, 8\).*\(10, 8\)'):
        nn.Embed(20, 8).apply(nn.Embed(10, 8).init(random.PRNGKey(0), np.array([0])),
                              np.array([1]))

    class Net(nn.Module):
        feats: int

        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(nn.Dense(self.feats)(x))

    v = Net(3).init(random.PRNGKey(0), x)
    v["params"]["Dense_0"]["kernel"] = np.ones((3, 1), np.float32)   # a wrong checkpoint entry
    v["params"]["Dense_0"]["bias"] = np.ones((1,), np.float32)
    with pytest.raises(ValueError, match=r'"kernel" in "/Dense_0"'):
        Net(3).apply(v, x)
    # the right shapes in another dtype pass (Flax checks shapes only)
    half = {"params": {k: np.asarray(a).astype(np.float16) for k, a in v1["params"].items()}}
    assert np.shape(nn.Dense(1).apply(half, x)) == (2, 1)


def test_param_shape_check_keys_closures_by_what_they_compute(monkeypatch):
    """The shape check runs each initializer abstractly once per distinct declaration: a
    closure made anew at every call (as examples/siren.py does) is keyed by its code and the
    values it closes over, so a second apply reruns nothing, and a closure over another size
    is another key, whose mismatch is still caught."""
    from ctrainstate._src.nn import scope as S

    def sized_zeros(n):   # a new closure per call; its shape comes from the closed-over n
        def init(key):
            return np.zeros((n,), np.float32)
        return init

    class Net(nn.Module):
        n: int

        @nn.compact
        def __call__(self, x):
            return x * self.param("w", sized_zeros(self.n)).sum()

    calls = []
    real = S._expected_shapes
    monkeypatch.setattr(S, "_expected_shapes", lambda *a: calls.append(1) or real(*a))
    S._SHAPES_CACHE.clear()
    x = np.ones((2,), np.float32)
    v3 = Net(3).init(random.PRNGKey(0), x)
    Net(3).apply(v3, x)
    first = len(calls)
    assert first == 1                     # computed once for this declaration ...
    Net(3).apply(v3, x)
    assert len(calls) == first            # ... and not again for the same one
    with pytest.raises(S.ScopeParamShapeError, match=r'"w".*shape \(5,\).*shape \(3,\)'):
        Net(5).apply(v3, x)               # the closure over 5 is another key
    assert len(calls) == first + 1

    class Holder:                         # hashed by identity: still keyed, per object
        def __init__(self, n):
            self.n = n

    def init_from(h):
        return lambda key: np.zeros((h.n,), np.float32)

    class Net2(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("w", init_from(Holder(2))).sum()

    v = Net2().init(random.PRNGKey(0), x)
    Net2().apply(v, x)                    # a new Holder per call: a new key, still right


def test_existing_param_of_the_wrong_shape_matches_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    from flax.errors import ScopeParamShapeError as FlaxShapeError
    x = np.ones((2, 3), np.float32)
    x5 = np.ones((2, 5), np.float32)
    cases = [(lambda m: m.Dense(1), lambda m: m.Dense(4), x, x),
             (lambda m: m.LayerNorm(), lambda m: m.LayerNorm(), x, x5),   # 3 features vs 5
             (lambda m: m.DenseGeneral((2, 2)), lambda m: m.DenseGeneral((2, 3)), x, x)]
    for make_init, make_apply, xi, xa in cases:
        fv = make_init(fnn).init(jax.random.PRNGKey(0), jnp.asarray(xi))
        with pytest.raises(FlaxShapeError) as fe:
            make_apply(fnn).apply(fv, jnp.asarray(xa))
        cv = make_init(nn).init(random.PRNGKey(0), xi)
        with pytest.raises(nn.scope.ScopeParamShapeError) as ce:
            make_apply(nn).apply(cv, xa)
        # the same sentence (Flax appends a link to its docs)
        assert str(fe.value).startswith(str(ce.value))


# --- parent=None, clone, copy, unbind, get/put_variable, has_rng -------------------------------

def _free_module_models(nn_mod):
    class W(nn_mod.Module):
        inner: nn_mod.Module

        @nn_mod.compact
        def __call__(self, x):
            return self.inner(x)

    class CompactFree(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            # parent=None: a free module, adopted by W as 'inner' (not this module's Dense_0)
            return W(nn_mod.Dense(3, parent=None))(x) + W(nn_mod.Dense(3))(x)

    class SetupFree(nn_mod.Module):
        def setup(self):
            self.w = W(nn_mod.Dense(3, parent=None))
            self.e = nn_mod.Dense(3, parent=None)

        def __call__(self, x):
            return self.w(x) + self.e(x)

    class Copies(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            d = nn_mod.Dense(3)
            y = d(x)
            y = y + d.copy(features=3)(x)              # a new submodule: Dense_1
            return y + d.copy(name="named")(x)

    return [CompactFree(), SetupFree(), Copies()]


def _param_paths(tree, prefix=()):
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) or hasattr(v, "items"):
            out += _param_paths(v, prefix + (k,))
        else:
            out.append("/".join(prefix + (k,)))
    return sorted(out)


def test_parent_none_copy_and_clone_name_modules_as_flax():
    # Flax's parent=None makes a free module: passed to W it is adopted as W's 'inner'
    # (params W_0/inner) where an attached one stays the creator's Dense_0; in setup it is
    # adopted under the attribute's name. copy() inside @compact is a new auto-named submodule.
    x = np.ones((2, 3), np.float32)
    compact_free, setup_free, copies = _free_module_models(nn)
    assert _param_paths(compact_free.init(random.PRNGKey(0), x)["params"]) == [
        "Dense_0/bias", "Dense_0/kernel", "W_0/inner/bias", "W_0/inner/kernel"]
    assert _param_paths(setup_free.init(random.PRNGKey(0), x)["params"]) == [
        "e/bias", "e/kernel", "w/inner/bias", "w/inner/kernel"]
    assert _param_paths(copies.init(random.PRNGKey(0), x)["params"]) == [
        "Dense_0/bias", "Dense_0/kernel", "Dense_1/bias", "Dense_1/kernel", "named/bias",
        "named/kernel"]
    d = nn.Dense(3, use_bias=False, name="d")
    c = d.clone(features=4)
    assert (c.features, c.use_bias, c.name, c.scope, c.parent) == (4, False, "d", None, None)
    with pytest.raises(TypeError):
        nn.Dense(3).clone(foo=1)
    with pytest.raises(TypeError, match="parent"):
        nn.Dense(3, parent=object())


def test_unbind_get_put_variable_and_has_rng():
    x = np.ones((2, 3), np.float32)

    class Enc(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class AE(nn.Module):
        def setup(self):
            self.encoder = Enc()
            self.decoder = nn.Dense(3)

        def __call__(self, x):
            return self.decoder(self.encoder(x))

    v = AE().init(random.PRNGKey(0), x)
    enc, ev = AE().bind(v).encoder.unbind()
    assert enc.scope is None and enc.name is None
    assert _param_paths(ev["params"]) == ["Dense_0/bias", "Dense_0/kernel"]
    k = np.asarray(v["params"]["encoder"]["Dense_0"]["kernel"])
    b = np.asarray(v["params"]["encoder"]["Dense_0"]["bias"])
    np.testing.assert_allclose(np.asarray(enc.apply(ev, x)), x @ k + b, rtol=1e-6)
    with pytest.raises(ValueError, match="not bound"):
        Enc().unbind()

    class S(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.put_variable("state", "a", 1.0)
            return (self.get_variable("state", "a"), self.get_variable("state", "b", 7),
                    self.has_rng("dropout"), self.has_rng("params"))

    out, state = S().apply({}, x, mutable=["state"], rngs={"dropout": random.PRNGKey(1)})
    assert out == (1.0, 7, True, False) and state == {"state": {"a": 1.0}}
    with pytest.raises(ValueError, match="immutable"):
        S().apply({}, x)


def test_parent_none_copy_clone_unbind_match_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    x = np.ones((2, 3), np.float32)
    for fm, cm in zip(_free_module_models(fnn), _free_module_models(nn)):
        fv = fm.init(jax.random.PRNGKey(0), jnp.asarray(x))
        cv = cm.init(random.PRNGKey(0), x)
        assert _param_paths(cv["params"]) == _param_paths(fv["params"])
        np.testing.assert_allclose(np.asarray(cm.apply(cv, x)),
                                   np.asarray(fm.apply(fv, jnp.asarray(x))), rtol=1e-5, atol=1e-6)
    fc, cc = fnn.Dense(3, name="d").clone(features=4), nn.Dense(3, name="d").clone(features=4)
    assert (cc.features, cc.name, cc.parent) == (fc.features, fc.name, fc.parent)


# --- submodules created in a helper method that an @compact method calls -----------------------

def _helper_model(nn_mod):
    class M(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            x = self.block(x)
            return self.block(x) + self._private(x) + nn_mod.Dense(3)(x)

        def block(self, x):          # a public (wrapped) method that is not @compact
            return nn_mod.Dense(3)(x)

        def _private(self, x):
            return nn_mod.Dense(3, name="p")(x)

    return M()


def test_helper_method_called_from_compact_creates_submodules():
    # Flax: while a module is in its @compact method, a helper method of the same module may
    # create submodules; they take the module's auto names in creation order
    x = np.ones((2, 3), np.float32)
    m = _helper_model(nn)
    v = m.init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["Dense_0", "Dense_1", "Dense_2", "p"]
    p = {k: (np.asarray(d["kernel"]), np.asarray(d["bias"])) for k, d in v["params"].items()}
    lin = lambda name, h: h @ p[name][0] + p[name][1]   # noqa: E731
    h1 = lin("Dense_0", x)     # both block() calls: Dense_0 then Dense_1
    want = lin("Dense_1", h1) + lin("p", h1) + lin("Dense_2", h1)
    np.testing.assert_allclose(np.asarray(m.apply(v, x)), want, rtol=1e-5, atol=1e-6)
    # called on its own (not from the compact method) it is an error, as in Flax
    with pytest.raises(RuntimeError, match="unbound"):
        m.apply(v, x, method="block")


def _init_both(make):
    """The model ``make(lib)`` initialised by flax and by ctrainstate on ones((2, 3)); the
    param paths and kernels must be the same. Returns (flax variables, ours, x)."""
    fnn, jnp = _flax(), _jnp()
    import jax
    x = np.ones((2, 3), np.float32)
    fv = make(fnn).init(jax.random.PRNGKey(0), jnp.asarray(x))
    cv = make(nn).init(random.PRNGKey(0), x)
    assert _param_paths(cv["params"]) == _param_paths(fv["params"])
    for k in fv["params"]:
        np.testing.assert_array_equal(np.asarray(cv["params"][k]["kernel"]),
                                      np.asarray(fv["params"][k]["kernel"]))
    return fv, cv, x


def test_helper_method_called_from_compact_matches_flax():
    fnn, jnp = _flax(), _jnp()
    fv, cv, x = _init_both(_helper_model)
    np.testing.assert_allclose(np.asarray(_helper_model(nn).apply(cv, x)),
                               np.asarray(_helper_model(fnn).apply(fv, jnp.asarray(x))),
                               rtol=1e-5, atol=1e-6)


# --- names and filters of the wrong type ---------------------------------------------------

def test_non_string_variable_name_and_bad_mutable_filter_are_refused():
    # Flax: 'The type of scope ... should be string' (TypeError) and InvalidFilterError; here a
    # TypeError naming the value, before anything runs (an int key in the params tree would
    # break checkpoints later; mutable=3 crashed with 'int is not iterable')
    x = np.ones((2, 3), np.float32)

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.param(3, nn.initializers.ones, (2,))

    with pytest.raises(TypeError, match="strings, got 3"):
        M().init(random.PRNGKey(0), x)
    v = nn.Dense(2).init(random.PRNGKey(0), x)
    for bad in (3, ["params", 1], nn.DenyList(4)):
        with pytest.raises(TypeError, match="mutable must be"):
            nn.Dense(2).apply(v, x, mutable=bad)
    with pytest.raises(TypeError, match="mutable must be"):
        nn.Dense(2).init(random.PRNGKey(0), x, mutable=2.5)
    # the valid kinds still work
    for ok in (True, False, "params", ["params"], ("params", "stats"), nn.DenyList("x")):
        nn.Dense(2).apply(v, x, mutable=ok)


# --- nn.nowrap and the initializer aliases of flax.linen ----------------------------------------

def _nowrap_model(nn_mod):
    class M(nn_mod.Module):
        width: int = 3

        @nn_mod.nowrap
        def make(self, n):
            return nn_mod.Dense(n * self.width, use_bias=False)

        def setup(self):
            self.first = self.make(1)
            self.rest = [self.make(2), self.make(1)]

        def __call__(self, x):
            for layer in [self.first, *self.rest]:
                x = layer(x)
            return x

    return M()


def test_nowrap_helper_builds_submodules_for_its_caller():
    x = np.ones((2, 3), np.float32)
    m = _nowrap_model(nn)
    v = m.init(random.PRNGKey(0), x)
    # named by the setup() attributes they are assigned to (the helper adds no level)
    assert _param_paths(v["params"]) == ["first/kernel", "rest_0/kernel", "rest_1/kernel"]
    assert np.shape(v["params"]["rest_0"]["kernel"]) == (3, 6)
    assert not getattr(type(m).make, "_ct_wrapped", False)
    # flax.linen's top-level initializer names
    assert np.asarray(nn.zeros(None, (2,))).tolist() == [0.0, 0.0]
    assert np.asarray(nn.ones_init()(None, (1, 2))).tolist() == [[1.0, 1.0]]
    assert np.asarray(nn.zeros_init()(None, (1,))).tolist() == [0.0]


def test_nowrap_helper_matches_flax():
    _init_both(_nowrap_model)


# --- a bound module's attributes are frozen as Flax freezes them ------------------------------

def _frozen_attr_model(nn_mod):
    class M(nn_mod.Module):
        feats: list
        layers: list = None

        def setup(self):
            self.sizes = [1, 2]
            self.table = {"a": nn_mod.Dense(2)}
            self.blocks = [nn_mod.Dense(2)]
            self.cfg = {"k": [1]}

        def __call__(self, x):
            # Flax-valid code: tuple concatenation and hashing of the frozen attributes
            shape = self.sizes + (3,)
            key = hash((self.feats, self.sizes))
            return ([type(a).__name__ for a in (self.feats, self.layers, self.sizes, self.table,
                                                self.blocks, self.cfg, self.cfg["k"])],
                    shape, isinstance(key, int), self.table["a"](x) + self.blocks[0](x))

    return M([4, 5], [nn_mod.Dense(2)])


def test_bound_module_attributes_are_frozen():
    # Flax's _freeze_attr: a bound module's fields and its setup() attributes have lists as
    # tuples and dicts as FrozenDicts (nested), so Flax code may concatenate or hash them
    x = np.ones((2, 3), np.float32)
    m = _frozen_attr_model(nn)
    (types, shape, hashed, _), v = m.init_with_output(random.PRNGKey(0), x)
    assert types == ["tuple", "tuple", "tuple", "FrozenDict", "tuple", "FrozenDict", "tuple"]
    assert shape == (1, 2, 3) and hashed
    assert _param_paths(v["params"]) == ["blocks_0/bias", "blocks_0/kernel", "table_a/bias",
                                         "table_a/kernel"]
    assert type(m.feats) is list       # the user's (unbound) instance is left as it was

    class Mut(nn.Module):
        def setup(self):
            self.cfg = {"k": 1}

        def __call__(self, x):
            self.cfg["k"] = 2
            return x

    with pytest.raises(TypeError, match="immutable"):
        Mut().init(random.PRNGKey(0), x)


def test_bound_module_attributes_are_frozen_like_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    x = np.ones((2, 3), np.float32)
    (ft, fs, fh, fo), fv = _frozen_attr_model(fnn).init_with_output(jax.random.PRNGKey(0),
                                                                     jnp.asarray(x))
    (ct, cs, ch, co), cv = _frozen_attr_model(nn).init_with_output(random.PRNGKey(0), x)
    assert (ct, cs, ch) == (ft, fs, fh)
    assert _param_paths(cv["params"]) == _param_paths(fv["params"])
    np.testing.assert_allclose(np.asarray(co), np.asarray(fo), rtol=1e-6)


# --- an @compact submodule named like one setup() defined ------------------------------------

def _setup_compact_clash(nn_mod):
    class M(nn_mod.Module):
        def setup(self):
            self.d = nn_mod.Dense(3)

        @nn_mod.compact
        def __call__(self, x):
            return self.d(x) + nn_mod.Dense(3, name="d")(x)

    return M()


def test_compact_submodule_may_not_reuse_a_setup_name():
    # Flax reserves setup()'s names for the module's lifetime: a compact Dense(name='d') next
    # to setup's self.d is a NameInUseError (it silently shared d's parameters here)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(nn.scope.NameInUseError, match='"d"'):
        _setup_compact_clash(nn).init(random.PRNGKey(0), x)

    class Ok(nn.Module):          # setup + compact with distinct names still works, twice
        def setup(self):
            self.d = nn.Dense(3)

        @nn.compact
        def __call__(self, x):
            return self.d(x) + nn.Dense(3)(x)

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            m = Ok()
            return m(m(x))

    v = Twice().init(random.PRNGKey(0), x)
    assert _param_paths(v["params"]) == ["Ok_0/Dense_0/bias", "Ok_0/Dense_0/kernel",
                                         "Ok_0/d/bias", "Ok_0/d/kernel"]


def test_compact_submodule_may_not_reuse_a_setup_name_like_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    from flax.errors import NameInUseError as FlaxNameInUse
    x = np.ones((2, 3), np.float32)
    with pytest.raises(FlaxNameInUse):
        _setup_compact_clash(fnn).init(jax.random.PRNGKey(0), jnp.asarray(x))
    with pytest.raises(nn.scope.NameInUseError):
        _setup_compact_clash(nn).init(random.PRNGKey(0), x)


def _setup_param_clash(nn_mod):
    class M(nn_mod.Module):
        def setup(self):
            self.w = self.param("w", nn_mod.initializers.ones, (3,))

        @nn_mod.compact
        def __call__(self, x):
            return x * self.w + self.param("w", nn_mod.initializers.zeros, (3,))

    return M()


def test_compact_param_may_not_reuse_a_setup_param_name():
    # the same for a param: setup()'s 'w' stays reserved when the compact method starts
    # (the second declaration silently returned setup's 'w' here)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(nn.scope.NameInUseError, match='"w"'):
        _setup_param_clash(nn).init(random.PRNGKey(0), x)


def test_compact_param_may_not_reuse_a_setup_param_name_like_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    from flax.errors import NameInUseError as FlaxNameInUse
    with pytest.raises(FlaxNameInUse):
        _setup_param_clash(fnn).init(jax.random.PRNGKey(0), jnp.ones((2, 3)))


# --- a setup() submodule re-created by a later call of its @compact parent ---------------------

def _recreated_setup_models(nn_mod):
    class M(nn_mod.Module):
        def setup(self):
            self.w = self.param("w", nn_mod.initializers.normal(1.0), (8,))
            self.drop = nn_mod.Dropout(0.5, deterministic=False)

        def __call__(self, x):
            return self.drop(x * self.w)

    class P(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            return M()(x) + nn_mod.Dense(8)(x)

    class Q(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, x):
            p = P()
            return p(p(x))

    class E(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, ids):
            return nn_mod.Embed(5, 8)(ids)       # Embed is a setup() module

    class Twice(nn_mod.Module):
        @nn_mod.compact
        def __call__(self, ids):
            e = E()
            return e(ids) + e(ids)

    return Q(), Twice()


def test_setup_submodule_recreated_by_a_second_parent_call():
    # Flax: each call of a compact module re-creates its submodules with fresh scopes (same
    # names, same variables). A setup() submodule (nn.Embed among them) re-created by the second
    # call raised NameInUseError here ('Name "embedding" is already in use').
    x = np.ones((2, 8), np.float32)
    ids = np.array([[1, 2, 3]])
    q, twice = _recreated_setup_models(nn)
    v = q.init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x)
    assert _param_paths(v["params"]) == ["P_0/Dense_0/bias", "P_0/Dense_0/kernel", "P_0/M_0/w"]
    q.apply(v, x, rngs={"dropout": random.PRNGKey(2)})
    tv = twice.init(random.PRNGKey(0), ids)
    table = np.asarray(tv["params"]["E_0"]["Embed_0"]["embedding"])
    np.testing.assert_array_equal(np.asarray(twice.apply(tv, ids)), 2 * table[ids])


def test_setup_submodule_recreated_by_a_second_parent_call_matches_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    x = np.ones((2, 8), np.float32)
    ids = np.array([[1, 2, 3]])
    (fq, ftw), (cq, ctw) = _recreated_setup_models(fnn), _recreated_setup_models(nn)
    fv = fq.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
                 jnp.asarray(x))
    cv = cq.init({"params": random.PRNGKey(0), "dropout": random.PRNGKey(1)}, x)
    np.testing.assert_array_equal(np.asarray(cv["params"]["P_0"]["M_0"]["w"]),
                                  np.asarray(fv["params"]["P_0"]["M_0"]["w"]))
    # the same dropout masks (the re-created module draws its keys as Flax's does)
    np.testing.assert_allclose(
        np.asarray(cq.apply(cv, x, rngs={"dropout": random.PRNGKey(2)})),
        np.asarray(fq.apply(fv, jnp.asarray(x), rngs={"dropout": jax.random.PRNGKey(2)})),
        rtol=1e-5, atol=1e-6)
    ftv = ftw.init(jax.random.PRNGKey(0), jnp.asarray(ids))
    ctv = ctw.init(random.PRNGKey(0), ids)
    np.testing.assert_allclose(np.asarray(ctw.apply(ctv, ids)),
                               np.asarray(ftw.apply(ftv, jnp.asarray(ids))), rtol=1e-6)


# --- setup() may not overwrite a field -------------------------------------------------------

def _field_in_setup_models(nn_mod):
    class Features(nn_mod.Module):
        features: int = 2

        def setup(self):
            self.features = 5          # the Dense below would silently get 5 features
            self.d = nn_mod.Dense(self.features)

        def __call__(self, x):
            return self.d(x)

    class Name(nn_mod.Module):
        def setup(self):
            self.name = "renamed"

        def __call__(self, x):
            return x

    return [Features(), Name()]


def test_setting_a_field_in_setup_is_refused():
    # Flax's SetAttributeInModuleSetupError ("Module construction attributes are frozen.")
    x = np.ones((2, 3), np.float32)
    for m in _field_in_setup_models(nn):
        with pytest.raises(AttributeError, match="construction attributes are frozen"):
            m.init(random.PRNGKey(0), x)


def test_setting_a_field_in_setup_is_refused_like_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    from flax.errors import SetAttributeInModuleSetupError
    for m in _field_in_setup_models(fnn):
        with pytest.raises(SetAttributeInModuleSetupError):
            m.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))


# --- variables declared outside setup() and @compact -------------------------------------------

def _declare_outside_models(nn_mod):
    class Param(nn_mod.Module):
        def __call__(self, x):                 # not @compact
            return x * self.param("w", nn_mod.initializers.ones, (3,))

    class Var(nn_mod.Module):
        def setup(self):
            self.d = nn_mod.Dense(3)

        def __call__(self, x):
            self.variable("stats", "n", lambda: 0)
            return self.d(x)

    return [Param(), Var()]


def test_declaring_outside_setup_or_compact_is_refused():
    # Flax: 'Parameters/Variables must be initialized in `setup()` or in a method wrapped in
    # `@compact`'. Here such a param was created, and a second call of the module then failed
    # with a NameInUseError that did not say why.
    x = np.ones((2, 3), np.float32)
    for m in _declare_outside_models(nn):
        with pytest.raises(ValueError, match="must be initialized in `setup\\(\\)` or in a "
                                             "method wrapped in `@compact`"):
            m.init(random.PRNGKey(0), x)

    class Helper(nn.Module):             # a helper called from @compact (or setup) may declare
        def setup(self):
            self.a = self.make("a")

        def make(self, name):
            return self.param(name, nn.initializers.ones, (3,))

        @nn.compact
        def __call__(self, x):
            return x * self.a * self.make("b")

    v = Helper().init(random.PRNGKey(0), x)
    assert sorted(v["params"]) == ["a", "b"]


def test_declaring_outside_setup_or_compact_is_refused_like_flax():
    fnn, jnp = _flax(), _jnp()
    import jax
    for m in _declare_outside_models(fnn):
        with pytest.raises(ValueError, match="must be initialized in `setup\\(\\)`"):
            m.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))


def test_submodule_created_in_a_plain_method_says_where_it_must_be_defined():
    # Flax: AssignSubModuleError 'Submodule Dense must be defined in `setup()` or in a method
    # wrapped in `@compact`'; the hint here said to call it through .init/.apply
    class M(nn.Module):
        def __call__(self, x):
            return nn.Dense(2)(x)

    x = np.ones((2, 3), np.float32)
    with pytest.raises(RuntimeError, match="must be defined in `setup\\(\\)` or in a method "
                                           "wrapped in `@compact`.*method of M"):
        M().init(random.PRNGKey(0), x)

    class Nested(nn.Module):             # such a module can still be run on its own
        def __call__(self, x):
            d = nn.Dense(2)
            return d.apply(d.init(random.PRNGKey(0), x), x)

    assert np.shape(Nested().apply({}, x)) == (2, 2)


def test_dropout_of_integers_is_a_clear_type_error():
    # Flax raises a TypeError from lax.select (int32 inputs against the float32 kept / keep);
    # here the same type, with a message that says what to do. Floats of every dtype pass.
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    with pytest.raises(TypeError, match="inputs must be a floating-point array, got int32"):
        nn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": random.PRNGKey(0)})
    import ml_dtypes
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        y = nn.Dropout(0.5, deterministic=False).apply({}, np.ones((2, 3), dt),
                                                       rngs={"dropout": random.PRNGKey(0)})
        assert np.dtype(y.dtype) == np.dtype(dt)
    # deterministic or rate 0 returns the input untouched, as Flax (no dtype check there)
    assert nn.Dropout(0.5, deterministic=True).apply({}, x) is x


def test_dropout_of_integers_fails_in_flax_too():
    jax = pytest.importorskip("jax")
    fnn = _flax()
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    with pytest.raises(TypeError):
        fnn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": jax.random.PRNGKey(0)})


# --- equality and hashing (Flax's dataclass semantics) --------------------------------------

def _equality_table(m, init_fn):
    """The comparisons Flax users rely on, for the module library ``m`` (flax.linen or
    ctrainstate.nn); ``init_fn(module, x)`` runs ``init`` so compact submodules are seen."""
    out = {
        "same_fields": m.Dense(3) == m.Dense(3),
        "same_fields_hash": hash(m.Dense(3)) == hash(m.Dense(3)),
        "other_field": m.Dense(3) == m.Dense(4),
        "other_field_ne": m.Dense(3) != m.Dense(4),
        "other_name": m.Dense(3) == m.Dense(3, name="x"),
        "other_class": m.Dense(3) == m.DenseGeneral(3),
        "not_a_module": m.Dense(3) == 3,
        "clone": m.Dense(3, use_bias=False).clone() == m.Dense(3, use_bias=False),
        "clone_update": m.Dense(3).clone(features=4) == m.Dense(4),
        "nested": m.Sequential([m.Dense(3), m.relu]) == m.Sequential([m.Dense(3), m.relu]),
        "dict_key": {m.Dense(3): "a"}.get(m.Dense(3)),
    }
    seen = {}

    class Two(m.Module):
        @m.compact
        def __call__(self, x):
            d1, d2 = m.Dense(3), m.Dense(3)
            seen["siblings"] = d1 == d2          # named Dense_0 and Dense_1
            seen["self"] = d1 == d1
            return d1(x) + d2(x)
    init_fn(Two(), np.ones((1, 2), np.float32))
    out.update(seen)
    try:
        hash(m.Sequential([m.Dense(3)]))        # a list field
        out["unhashable"] = "hashed"
    except TypeError:
        out["unhashable"] = "TypeError"
    return out


def test_modules_compare_by_fields_name_and_parent():
    got = _equality_table(nn, lambda mod, x: mod.init(random.PRNGKey(0), x))
    assert got == {"same_fields": True, "same_fields_hash": True, "other_field": False,
                   "other_field_ne": True, "other_name": False, "other_class": False,
                   "not_a_module": False, "clone": True, "clone_update": True, "nested": True,
                   "dict_key": "a", "siblings": False, "self": True, "unhashable": "TypeError"}
    with pytest.raises(TypeError, match=r"Failed to hash Sequential: .*layers \(list\)"):
        hash(nn.Sequential([nn.Dense(3)]))
    # a bound module's wrappers of one parent are distinct, and comparing them terminates
    # (the parent counts by identity: its fields hold the children that point back to it)
    class Wrap(nn.Module):
        layers: tuple

        @nn.compact
        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
    seen = {}

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            a, b = Wrap((nn.Dense(3),)), Wrap((nn.Dense(3),))
            y = a(x) + b(x)
            seen["wrappers"] = (a == b, a.layers[0] == b.layers[0], a == a)
            return y
    Outer().init(random.PRNGKey(0), np.ones((1, 2), np.float32))
    assert seen["wrappers"] == (False, False, True)


def test_module_equality_matches_flax():
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    want = _equality_table(fnn, lambda mod, x: mod.init(jax.random.PRNGKey(0), x))
    got = _equality_table(nn, lambda mod, x: mod.init(random.PRNGKey(0), x))
    assert got == want
