"""The caches behind a repeated `model.apply`: param_with_axes' table of checked declarations
(partitioning._CHECKED), the logical constraint's targets (spmd._TARGETS) and the
initializer keys (scope._plain_fn_key). A declaration found in them does what the long way
does; whatever the long way reads that is not in their keys makes a miss; errors still raise
on every call."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import NamedSharding, P, nn, random
from ctrainstate import partitioning as nn_partitioning
from ctrainstate._src.base.trace_state import jit_scope
from ctrainstate._src.nn import spmd
from ctrainstate._src.nn.scope import NameInUseError, ScopeParamShapeError, _plain_fn_key
from call_counts import python_frames

RULES = (("batch", "data"), ("hidden", "model"))


def _mesh(shape=(1, 1), names=("data", "model")):
    n = int(np.prod(shape))
    return cts.Mesh(np.array(cts.devices()[:n], dtype=object).reshape(shape), names)


def _uniform(bound):
    def init(key, shape, dtype=np.float32, out_sharding=None):
        return random.uniform(key, shape, dtype, -bound, bound, out_sharding=out_sharding)
    return init


class Layer(nn.Module):
    features: int
    axes: tuple = ("feature", "hidden")

    @nn.compact
    def __call__(self, x):
        k = nn_partitioning.param_with_axes("kernel", _uniform(0.5), (x.shape[-1], self.features),
                                            axes=self.axes)
        b = nn_partitioning.param_with_axes("bias", _uniform(0.1), (self.features,),
                                            axes=self.axes[1:])
        y = x @ k + b
        return nn_partitioning.with_sharding_constraint(y, ("batch", self.axes[1]))


def _init(model, x, mesh, rules=RULES):
    with mesh, nn_partitioning.axis_rules(rules):
        xs = cts.device_put(x, NamedSharding(mesh, P("data", None)))
        return xs, model.init(random.PRNGKey(0), xs)


# --- partitioning._CHECKED ------------------------------------------------------------------

def test_repeated_apply_gives_the_same_values_and_shardings():
    mesh = _mesh()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    xs, v = _init(Layer(8), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        outs = [Layer(8).apply(v, xs) for _ in range(3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(outs[0]))
        assert o.sharding == outs[0].sharding == NamedSharding(mesh, P("data", "model"))


def test_cached_declaration_still_checks_the_shape_of_other_params():
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Layer(8), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        Layer(8).apply(v, xs)
        Layer(8).apply(v, xs)                         # cached now
        wrong = {"params": dict(v["params"], bias=np.zeros((5,), np.float32))}
        with pytest.raises(ScopeParamShapeError, match='"bias"'):
            Layer(8).apply(wrong, xs)                 # another shape: another key
        with pytest.raises(ScopeParamShapeError, match='"kernel"'):
            Layer(6).apply(v, xs)                     # another declaration: another key
        Layer(8).apply(v, xs)


def test_cached_declaration_reshards_a_param_placed_otherwise():
    """The last sharding seen equal to the target is remembered per declaration: a param
    Array placed differently (here replicated instead of split over 'model') is still
    constrained."""
    mesh = _mesh((1, 2)) if len(cts.devices()) >= 2 else _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Layer(8), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        Layer(8).apply(v, xs)
        Layer(8).apply(v, xs)
        seen = []
        real = spmd._constrain_to

        def spy(a, target):
            out = real(a, target)
            seen.append((a.sharding, out.sharding, target))
            return out
        spmd._constrain_to = spy
        try:
            moved = {"params": {k: cts.device_put(np.asarray(a), NamedSharding(mesh, P()))
                                for k, a in v["params"].items()}}
            Layer(8).apply(moved, xs)
        finally:
            spmd._constrain_to = real
    kernel = [s for s in seen if s[2].spec == P(None, "model")]
    assert kernel, seen                                 # the new Array was constrained
    assert kernel[0][1] == NamedSharding(mesh, P(None, "model"))


def test_cached_declaration_keeps_the_declaration_rule():
    class Helper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn_partitioning.param_with_axes("w", _uniform(0.5), (x.shape[-1],),
                                                   axes=("hidden",))

        def not_compact(self, x):
            return nn_partitioning.param_with_axes("w", _uniform(0.5), (x.shape[-1],),
                                                   axes=("hidden",), module=self)

    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Helper(), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        Helper().apply(v, xs)
        Helper().apply(v, xs)
        with pytest.raises(ValueError, match="must be initialized in `setup\\(\\)`"):
            Helper().apply(v, xs, method="not_compact")


def test_cached_declaration_keeps_name_collisions():
    class Twice(nn.Module):
        twice: bool = False

        @nn.compact
        def __call__(self, x):
            w = nn_partitioning.param_with_axes("w", _uniform(0.5), (x.shape[-1],),
                                                axes=("hidden",))
            if self.twice:
                nn_partitioning.param_with_axes("w", _uniform(0.5), (x.shape[-1],),
                                                axes=("hidden",))
            return w

    class SubNamedW(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = nn_partitioning.param_with_axes("w", _uniform(0.5), (x.shape[-1],),
                                                axes=("hidden",))
            nn.Dense(2, name="w")
            return w

    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Twice(), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        Twice().apply(v, xs)
        Twice().apply(v, xs)
        with pytest.raises(NameInUseError, match='"w" is already in use'):
            Twice(twice=True).apply(v, xs)
        with pytest.raises(NameInUseError, match='Could not create submodule "w"'):
            SubNamedW().apply(v, xs)


def test_cached_declaration_still_sows_axes_where_mutable():
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Layer(8), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        Layer(8).apply(v, xs)
        _, new = Layer(8).apply({"params": v["params"]}, xs, mutable=["params_axes"])
    assert new["params_axes"] == v["params_axes"]


def test_cached_declaration_misses_on_other_rules_mesh_and_jit():
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Layer(8), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        Layer(8).apply(v, xs)
    other_rules = (("batch", "data"), ("hidden", None))
    with mesh, nn_partitioning.axis_rules(other_rules):
        out = Layer(8).apply(v, xs)
    assert out.sharding == NamedSharding(mesh, P("data", None))
    # strict rules: the unmatched name raises on every call, cached or not
    with mesh, nn_partitioning.axis_rules(RULES, strict=True):
        for _ in range(2):
            with pytest.raises(ValueError, match="feature"):
                Layer(8).apply(v, xs)
    mesh2 = _mesh()
    with mesh2, nn_partitioning.axis_rules(RULES):
        assert Layer(8).apply(v, xs).sharding == NamedSharding(mesh2, P("data", "model"))
    assert any(e[0] is mesh2 for e in spmd._TARGETS.values())   # its own entry
    with mesh, nn_partitioning.axis_rules(RULES), jit_scope():
        Layer(8).apply(v, xs)


# --- spmd._TARGETS ----------------------------------------------------------------------------

def _arr(mesh, spec=P()):
    return cts.device_put(np.arange(8, dtype=np.float32).reshape(2, 4), NamedSharding(mesh, spec))


def _python_calls(fn):
    """The Python functions (file, name) entered while ``fn()`` runs."""
    return python_frames(fn)


def test_cached_declaration_is_found_in_c():
    """A repeated apply finds each declaration in C (py_rules.c's param_hit, called by the
    C object param_with_axes is, ParamWithAxes): no Python frame of param_with_axes or of
    the long way (the key, the declaration's effects) runs; a declaration the C path does
    not cover (keyword arguments to the initializer) takes the Python path."""
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Layer(8), x, mesh)
    long_way = {"_checked_key", "_checked_declaration", "_plain_fn_key", "_born_sharding"}
    with mesh, nn_partitioning.axis_rules(RULES):
        ref = np.asarray(Layer(8).apply(v, xs))   # declarations checked and stored
        Layer(8).apply(v, xs)                      # their sharding seen equal to the target
        calls = _python_calls(lambda: Layer(8).apply(v, xs))
        assert any(name == "__call__" for _, name in calls)      # (the profile sees the call)
        assert not [c for c in calls if c[1] in long_way | {"param_with_axes"}], calls

        class KwLayer(nn.Module):
            @nn.compact
            def __call__(self, x):
                k = nn_partitioning.param_with_axes("kernel", _uniform(0.5), (4, 8),
                                                    np.float32, axes=("feature", "hidden"))
                b = nn_partitioning.param_with_axes("bias", _uniform(0.1), shape=(8,),
                                                    axes=("hidden",))
                return x @ k + b
        KwLayer().apply(v, xs)
        KwLayer().apply(v, xs)
        calls = _python_calls(lambda: KwLayer().apply(v, xs))
        assert [c for c in calls if c[1] == "_checked_declaration"], calls   # the positional dtype
        assert [c for c in calls if c[1] == "param_with_axes"], calls        # (the fallback)
        np.testing.assert_array_equal(np.asarray(KwLayer().apply(v, xs)), ref)


class Stack(nn.Module):
    """``depth`` identical layers: their declarations share one _CHECKED key (same
    initializer, shape, axes), each parameter with its own sharding object."""
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = cts.numpy.tanh(Layer(4, axes=("hidden", "hidden2"))(x))
        return x


@pytest.mark.parametrize("depth, in_c", [(2, True), (12, True), (40, False)])
def test_repeated_layers_are_found_in_c(depth, in_c):
    """Layers whose declarations share a key (a stack of equal layers, as a transformer's
    blocks) stay on the C path at every apply: the entry remembers each parameter's sharding
    object seen equal to the target, not only the last one, so they do not evict one another
    (up to partitioning._SEEN_MAX of them; more take the Python path, with the same
    values)."""
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    rules = RULES + (("hidden2", None),)
    xs, v = _init(Stack(depth), x, mesh, rules)
    kernels = [v["params"][f"Layer_{i}"]["kernel"] for i in range(depth)]
    assert len({id(k.sharding) for k in kernels}) == depth        # one object per parameter
    long_way = {"_checked_key", "_checked_declaration", "_plain_fn_key", "_born_sharding"}
    with mesh, nn_partitioning.axis_rules(rules):
        ref = np.asarray(Stack(depth).apply(v, xs))
        Stack(depth).apply(v, xs)
        calls = _python_calls(lambda: Stack(depth).apply(v, xs))
        slow = [c for c in calls if c[1] == "_checked_declaration"]
        assert (depth <= nn_partitioning._SEEN_MAX) == in_c
        if in_c:
            assert not [c for c in calls if c[1] in long_way], calls
        else:
            assert slow     # more parameters per key than the entry remembers
        np.testing.assert_array_equal(np.asarray(Stack(depth).apply(v, xs)), ref)


def test_constraint_target_cached_per_rules_fallback_and_mesh():
    m = _mesh((1, 2)) if len(cts.devices()) >= 2 else _mesh()
    a = _arr(m)
    wlc = nn_partitioning.with_sharding_constraint
    with m:
        for _ in range(2):
            assert wlc(a, ("batch", "hidden"), rules=RULES).sharding == \
                NamedSharding(m, P("data", "model"))
            assert wlc(a, ("batch", "hidden"), rules=(("hidden", "data"),)).sharding == \
                NamedSharding(m, P(None, "data"))
            assert wlc(a, ("batch", "nope"), rules=RULES,
                       fallback=nn_partitioning.RulesFallback.NO_CONSTRAINT) is a
            with pytest.raises(ValueError, match="did not match a rule"):
                wlc(a, ("batch", "nope"), rules=RULES,
                    fallback=nn_partitioning.RulesFallback.RAISE_ERROR)
            with pytest.raises(ValueError, match="more than once"):
                wlc(a, ("batch", "batch"), rules=RULES)
            # rules in lists (unhashable): the long way, same result
            assert wlc(a, ("batch", "hidden"), rules=[["batch", "data"], ["hidden", "model"]]
                       ).sharding == NamedSharding(m, P("data", "model"))
    m2 = _mesh((1, 2)) if len(cts.devices()) >= 2 else _mesh()
    with m2:
        assert wlc(a, ("batch", "hidden"), rules=RULES).sharding == \
            NamedSharding(m2, P("data", "model"))
    assert any(e[0] is m2 for e in spmd._TARGETS.values())
    # no mesh: the value as it is, resolution errors still raised
    assert wlc(a, ("batch", "hidden"), rules=RULES) is a
    with pytest.raises(ValueError, match="more than once"):
        wlc(a, ("batch", "batch"), rules=RULES)


def test_constraint_target_unconstrained_takes_the_long_way():
    if len(cts.devices()) < 2:
        pytest.skip("needs 2 devices")
    m = _mesh((1, 2))
    a = _arr(m, P(None, "model"))
    unc = P.UNCONSTRAINED
    with m:
        for _ in range(2):
            out = nn_partitioning.with_sharding_constraint(a, ("batch", unc), rules=RULES)
            assert out.sharding == NamedSharding(m, P("data", "model"))   # kept its split


def test_constraint_target_strict_rules_not_cached():
    m = _mesh()
    a = _arr(m)
    with m, nn_partitioning.axis_rules(RULES):
        nn_partitioning.with_sharding_constraint(a, ("batch", "typo"))   # fills the table
    with m, nn_partitioning.axis_rules(RULES, strict=True):
        with pytest.raises(ValueError, match="typo"):
            nn_partitioning.with_sharding_constraint(a, ("batch", "typo"))


# --- scope._plain_fn_key ----------------------------------------------------------------------

def test_plain_fn_key_tells_apart_what_the_initializer_computes():
    assert _plain_fn_key(_uniform(0.5)) == _plain_fn_key(_uniform(0.5))
    assert _plain_fn_key(_uniform(0.5)) != _plain_fn_key(_uniform(0.25))
    assert _plain_fn_key(_uniform(1)) != _plain_fn_key(_uniform(1.0))      # int vs float
    assert _plain_fn_key(_uniform(True)) != _plain_fn_key(_uniform(1))     # bool vs int

    def with_default(dtype):
        def init(key, shape, dtype=dtype, scale=1):
            return np.zeros(shape, dtype) * scale
        return init

    assert _plain_fn_key(with_default(np.float32)) == _plain_fn_key(with_default(np.float32))
    assert _plain_fn_key(with_default(np.float32)) != _plain_fn_key(with_default(np.float16))
    assert _plain_fn_key(with_default(np.dtype("float32"))) != \
        _plain_fn_key(with_default(np.float32))
    with pytest.raises(TypeError):
        _plain_fn_key(with_default([1]))            # not a plain value: no key
    with pytest.raises(TypeError):
        _plain_fn_key(_uniform(np.ones(2)))


def test_constraint_target_entry_of_a_reused_mesh_id_is_not_used():
    """An entry is keyed by id(mesh) and keeps its mesh: one whose mesh is not the active one
    (an id reused after the mesh it was made for was freed) is recomputed, not used."""
    if len(cts.devices()) < 2:
        pytest.skip("needs 2 devices")
    m, other = _mesh((1, 2)), _mesh((2, 1))
    a = _arr(m)
    spec = ("batch", "hidden")
    spmd._TARGETS[(spec, RULES, spmd._DEFAULT_FALLBACK, id(m))] = (
        other, NamedSharding(other, P("data", None)))
    with m:
        out = nn_partitioning.with_sharding_constraint(a, spec, rules=RULES)
    assert out.sharding == NamedSharding(m, P("data", "model"))


def test_c_memo_of_a_call_site_follows_what_it_declares():
    """param_hit keeps, per call site, the last key it found (py_rules.c's memo): a call whose
    initializer closes over another value, or whose axes differ, is not taken for it (the
    long way keys it), and equal values found in other objects are."""
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)

    class Site(nn.Module):
        bound: float
        axes: tuple = ("feature", "hidden")

        @nn.compact
        def __call__(self, x):
            k = nn_partitioning.param_with_axes("kernel", _uniform(self.bound), (4, 8),
                                                axes=self.axes)
            return x @ k

    xs, v = _init(Site(0.5), x, mesh)
    long_way = {"_checked_key", "_born_sharding"}

    def runs_long_way(model, rules=RULES):
        with mesh, nn_partitioning.axis_rules(rules):
            calls = _python_calls(lambda: model.apply(v, xs))
        return bool([c for c in calls if c[1] in long_way])

    for _ in range(2):
        runs_long_way(Site(0.5))
    assert not runs_long_way(Site(0.5))
    assert runs_long_way(Site(0.25))                    # another closed-over value
    runs_long_way(Site(0.25))
    assert not runs_long_way(Site(0.25))
    assert not runs_long_way(Site(float("0.5")))        # an equal float, another object
    assert runs_long_way(Site(0.5, axes=("embed", "hidden")))   # other axes, the same sharding
    runs_long_way(Site(0.5, axes=("embed", "hidden")))
    assert not runs_long_way(Site(0.5, axes=("embed", "hidden")))
    assert not runs_long_way(Site(0.5))
    # equal rules in other objects: the same key
    assert not runs_long_way(Site(0.5), rules=tuple(tuple(r) for r in RULES))
    assert runs_long_way(Site(0.5), rules=(("batch", "data"), ("hidden", None)))
    with mesh, nn_partitioning.axis_rules(RULES):
        np.testing.assert_array_equal(np.asarray(Site(0.5).apply(v, xs)),
                                      np.asarray(Site(0.25).apply(v, xs)))


def test_constraint_of_an_equal_sharding_remembered_per_target():
    """An Array whose sharding equals the constraint's target without being it (here: a spec
    without the trailing None) is returned as it is, and the pair is remembered
    (spmd._SEEN_EQUAL); another sharding is still moved."""
    m = _mesh()
    spec = ("batch", "feature")                       # -> P('data', None)
    a = _arr(m, P("data"))
    with m:
        target = spmd._constraint_target(spec, RULES, spmd.RulesFallback.AXIS_IS_UNSHARDED, m)
        assert a.sharding is not target and a.sharding == target
        for _ in range(2):
            assert nn_partitioning.with_sharding_constraint(a, spec, rules=RULES) is a
        assert spmd._SEEN_EQUAL[id(target)][0] is target
        assert spmd._SEEN_EQUAL[id(target)][1] == (a.sharding,)
        assert spmd._SEEN_EQUAL[id(target)][1][0] is a.sharding
        # a second equal sharding object is remembered beside the first (repeated layers'
        # activations, each an op's output sharding): neither evicts the other
        c = _arr(m, P("data", None))
        assert c.sharding is not a.sharding and c.sharding is not target
        with nn_partitioning.axis_rules(RULES):
            for _ in range(2):
                assert nn_partitioning.with_sharding_constraint(c, spec) is c
                assert nn_partitioning.with_sharding_constraint(a, spec) is a
        seen = spmd._SEEN_EQUAL[id(target)][1]
        assert any(s is a.sharding for s in seen) and any(s is c.sharding for s in seen)
        if len(cts.devices()) >= 2:
            b = _arr(_mesh((1, 2)), P("data"))       # equal specs, another mesh: moved
            out = nn_partitioning.with_sharding_constraint(b, spec, rules=RULES)
            assert out is not b and out.sharding == target


def test_param_with_axes_object_falls_back_to_the_python_function():
    """param_with_axes is a _C.ParamWithAxes: its hit path runs in C, every other call (the
    module passed, other keyword arguments, axes not a tuple, strict rules, a miss) runs the
    Python function with the same arguments, so the same errors and values; it keeps the
    function's name, docstring and signature."""
    import inspect
    from ctrainstate import _C
    pwa = nn_partitioning.param_with_axes
    assert type(pwa) is _C.ParamWithAxes and pwa.__name__ == "param_with_axes"
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(pwa)) is pwa and copy.deepcopy(pwa) is pwa   # by name
    assert "axes" in inspect.signature(pwa).parameters and "logical axes" in pwa.__doc__
    with pytest.raises(TypeError, match="callable"):
        _C.ParamWithAxes(3)
    seen = []

    def fallback(*args, **kwargs):
        seen.append((args, kwargs))
        return "python"
    f = _C.ParamWithAxes(fallback)
    assert f("w", _uniform(0.5), (2, 2), axes=("a", "b")) == "python"      # no module: a miss
    assert f("w", _uniform(0.5), axes=["a"]) == "python"                    # axes not a tuple
    assert f("w", _uniform(0.5), (2,), axes=("a",), module=None) == "python"  # another keyword
    assert f() == "python" and f("w") == "python"
    assert [s[1] for s in seen] == [{"axes": ("a", "b")}, {"axes": ["a"]},
                                    {"axes": ("a",), "module": None}, {}, {}]
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)
    xs, v = _init(Layer(8), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        ref = np.asarray(Layer(8).apply(v, xs))
        Layer(8).apply(v, xs)
    # strict rules: the Python function, whose strict path names a missing rule
    with mesh, nn_partitioning.axis_rules((("batch", "data"),), strict=True):
        with pytest.raises(ValueError, match="hidden"):
            Layer(8).apply(v, xs)
    with mesh, nn_partitioning.axis_rules(RULES):
        np.testing.assert_array_equal(np.asarray(Layer(8).apply(v, xs)), ref)


def test_logical_constraint_hit_path_runs_in_c():
    """with_sharding_constraint(x, spec) of an Array already placed as the spec resolves is
    answered in C (_C.LogicalConstraint): x itself, no Python frame of the function; a value
    placed otherwise, keyword arguments, strict rules and jit run the Python function, with
    its results."""
    import sys
    from ctrainstate import _C
    wlc = nn_partitioning.with_sharding_constraint
    assert type(wlc) is _C.LogicalConstraint and wlc.__name__ == "with_logical_constraint"
    import pickle
    assert pickle.loads(pickle.dumps(wlc)) is wlc
    with pytest.raises(TypeError, match="callable"):
        _C.LogicalConstraint(None)
    m = _mesh((1, 2)) if len(cts.devices()) >= 2 else _mesh()
    want = NamedSharding(m, P("data", "model"))
    a = _arr(m)                               # replicated: the constraint reshards it
    with m, nn_partitioning.axis_rules(RULES):
        b = wlc(a, ("batch", "hidden"))
        assert b is not a and b.sharding == want
        assert wlc(b, ("batch", "hidden")) is b                     # target stored, b placed so
        seen = []
        sys.setprofile(lambda f, e, arg: seen.append(f.f_code.co_name) if e == "call" else None)
        try:
            same = wlc(b, ("batch", "hidden"))
        finally:
            sys.setprofile(None)
        assert same is b and seen == [], seen
        c = wlc(a, ("batch", "hidden"))                             # other placement: reshards
        assert c is not a and c.sharding == want
        np.testing.assert_array_equal(np.asarray(c), np.asarray(a))
        assert wlc(b, ("batch", "hidden"), rules=RULES) is b        # keywords: the function
        assert wlc(b, None) is b
        with jit_scope():                                           # under jit: the function
            assert wlc(b, ("batch", "hidden")).sharding == want
    with m, nn_partitioning.axis_rules((("batch", "data"),), strict=True):
        with pytest.raises(ValueError, match="hidden"):
            wlc(b, ("batch", "hidden"))
    assert wlc(b, ("batch", "hidden")) is b                          # no rules: unchanged


def test_logical_constraint_memo_matches_spec_rules_and_mesh():
    """The C hit path remembers the _TARGETS entries it found: an equal spec (a new tuple of
    the same names) with the same rules and mesh takes the entry with no Python frame, even
    once _TARGETS was cleared; other rules, another spec or another mesh are not answered by
    it."""
    import sys
    wlc = nn_partitioning.with_sharding_constraint
    two = len(cts.devices()) >= 2
    m = _mesh((1, 2)) if two else _mesh()
    a = _arr(m)
    with m, nn_partitioning.axis_rules(RULES):
        b = wlc(a, ("batch", "hidden"))
        assert wlc(b, ("batch", "hidden")) is b
        spmd._TARGETS.clear()
        seen = []
        sys.setprofile(lambda f, e, arg: seen.append(f.f_code.co_name) if e == "call" else None)
        try:
            spec = tuple(["batch", "".join(["hid", "den"])])   # equal, not the same objects
            same = wlc(b, spec)
        finally:
            sys.setprofile(None)
        assert same is b and seen == [], seen
        assert not spmd._TARGETS                  # answered by the memo, not the dict
        c = wlc(b, ("hidden", "batch"))           # another spec: its own target
        assert c.sharding == NamedSharding(m, P("model", "data"))
    other = (("batch", "model"), ("hidden", "data"))
    with m, nn_partitioning.axis_rules(other):    # other rules: not the memo's entry
        d = wlc(b, ("batch", "hidden"))
        assert d.sharding == NamedSharding(m, P("model", "data"))
    if two:   # another mesh (its devices in the other order): its own target, resharded
        m2 = cts.Mesh(np.array(cts.devices()[1::-1], dtype=object).reshape(1, 2),
                      ("data", "model"))
        with m2, nn_partitioning.axis_rules(RULES):
            e = wlc(b, ("batch", "hidden"))
            assert e is not b and e.sharding == NamedSharding(m2, P("data", "model"))
            np.testing.assert_array_equal(np.asarray(e), np.asarray(a))


def test_c_memo_keeps_every_declaration_of_a_deep_model():
    """The memo finds each of 48 declarations' keys again on the next apply: none is built
    again nor swapped in (param_hit_stats). A direct-mapped memo of 64 slots, picked by the
    process's string hashes, let two declarations of a model evict each other at every call
    (for 48 declarations, nearly always)."""
    from ctrainstate import _C
    mesh = _mesh()
    x = np.ones((2, 4), np.float32)

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(24):
                x = Layer(4)(x)
            return x

    xs, v = _init(Deep(), x, mesh)
    with mesh, nn_partitioning.axis_rules(RULES):
        first = Deep().apply(v, xs)
        Deep().apply(v, xs)
        before = _C.param_hit_stats()
        for _ in range(3):
            out = Deep().apply(v, xs)
        after = _C.param_hit_stats()
    assert after == before
    np.testing.assert_array_equal(np.asarray(out), np.asarray(first))
