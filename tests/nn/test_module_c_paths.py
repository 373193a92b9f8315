"""The C paths of nn.Module method calls and submodule attach (csrc/python/py_module.c:
_C.module_call, _C.ModuleMethod, _C.module_bind_new): each leaves what the Python reference
(nn.module._call_method, _bind_new, Module._attach) leaves, the cases it declines reach the
Python path unchanged, and its arguments are checked."""
import collections
import copy
import functools
import inspect
import pickle
import weakref

import numpy as np
import pytest

from ctrainstate import _C, nn, random
from ctrainstate._src.nn import module as _module
from ctrainstate.nn.scope import NameInUseError
from call_counts import python_frames

X = np.ones((2, 3), np.float32)


def _python_wrap_method(fn):
    """nn.module._wrap_method with a Python wrapper calling the Python reference
    (_call_method) instead of a _C.ModuleMethod."""
    if getattr(fn, "_ct_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        return _module._call_method(fn, self, args, kwargs)
    wrapped._ct_wrapped = True
    return wrapped


def _python_paths(monkeypatch):
    """Route module method calls and submodule attach through the Python reference instead
    of C, for classes defined afterwards."""
    monkeypatch.setattr(_module, "_wrap_method", _python_wrap_method)
    monkeypatch.setattr(_module, "_module_bind_new", _module._bind_new)
    # (the generated __init__'s end: Module.__post_init__, whose attach is _bind_new)
    monkeypatch.setattr(_module, "_module_post_init",
                        lambda self, d: _module.Module.__post_init__(self))


def _make_classes():
    class Leaf(nn.Module):
        features: int
        axes: tuple = ("a", "b")

        @nn.compact
        def __call__(self, x, scale=1.0):
            w = self.param("w", nn.initializers.ones, (x.shape[-1], self.features))
            return (x @ w) * scale

    class Tree(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = Leaf(4)(x)
            x = Leaf(3, name="named")(x, scale=2.0)
            return Leaf(2)(x) + Leaf(2)(x)

    return Leaf, Tree


def _tree_state(module):
    """Every module's own state and its scope's, below and including ``module``: names,
    key order, values (scopes and parents by path)."""
    out = []

    def norm(v):
        if isinstance(v, nn.Module):
            return ("module", v.scope.path if v.scope is not None else None)
        if isinstance(v, _module.ModuleScope):
            return ("scope", v.path)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, (set, frozenset)):
            return sorted(map(repr, v))
        if isinstance(v, np.ndarray) or hasattr(v, "shape"):
            return np.asarray(v).tolist()
        return v

    def walk(m):
        d = {**m.__dict__, **_module._module_state(m)}
        out.append((type(m).__name__, list(d), {k: norm(v) for k, v in d.items()}))
        sd = _module._scope_state(m.scope)
        out.append(("scope", list(sd), {k: norm(v) for k, v in sd.items()
                                         if k not in ("_variables", "adopted")}))
        for c in d["_children"].values():
            walk(c)

    walk(module)
    return out


class _WithSetup(nn.Module):
    """A module with setup(): its calls take the Python path."""

    def setup(self):
        self.d = nn.Dense(2)

    def __call__(self, x):
        return self.d(x)


def _bound_after_apply(model, variables, **kw):
    captured = {}
    cls = type(model)
    orig = cls.__call__

    def spy(self, *a, **k):
        captured["m"] = self
        return orig(self, *a, **k)

    cls.__call__ = spy
    try:
        out = model.apply(variables, X, **kw)
    finally:
        cls.__call__ = orig
    return out, captured["m"]


@pytest.mark.parametrize("rngs", [False, True])
def test_c_paths_leave_the_python_paths_state(monkeypatch, rngs):
    Leaf, Tree = _make_classes()
    v = Tree().init(random.PRNGKey(0), X)
    kw = {"rngs": {"dropout": random.PRNGKey(1)}} if rngs else {}
    out_c, m_c = _bound_after_apply(Tree(), v, **kw)
    state_c = _tree_state(m_c)
    _python_paths(monkeypatch)
    Leaf, Tree = _make_classes()          # (their __init__ now calls the Python _bind_new)
    v_py = Tree().init(random.PRNGKey(0), X)
    out_py, m_py = _bound_after_apply(Tree(), v_py, **kw)
    assert np.array_equal(np.asarray(out_c), np.asarray(out_py))
    assert _tree_state(m_py) == state_c
    assert list(m_c.scope._children) == ["Leaf_0", "named", "Leaf_1", "Leaf_2"]


def test_init_through_c_paths_matches_python(monkeypatch):
    Leaf, Tree = _make_classes()
    a = Tree().init(random.PRNGKey(3), X)
    _python_paths(monkeypatch)
    Leaf, Tree = _make_classes()
    b = Tree().init(random.PRNGKey(3), X)
    assert list(a["params"]) == list(b["params"])
    for k in a["params"]:
        assert np.array_equal(np.asarray(a["params"][k]["w"]), np.asarray(b["params"][k]["w"]))


def test_frame_popped_and_state_kept_when_the_method_raises():
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            nn.Dense(2)(x)
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        Bad().init(random.PRNGKey(0), X)
    assert _module._ctx.stack == []


def test_frame_holds_the_methods_compact_value():
    seen = []

    class M(nn.Module):
        def __call__(self, x):
            seen.append(tuple(_module._ctx.stack[-1]))
            return x

    def marked(self, x):
        seen.append(tuple(_module._ctx.stack[-1]))
        return x
    marked._ct_compact = 1          # truthy, not a bool: kept as it is, as in Python
    M.other = _module._wrap_method(marked)
    m = M()
    m.apply({}, X)
    m.apply({}, X, method="other")
    assert [f[1] for f in seen] == [False, 1]


def test_declined_cases_reach_the_python_paths():
    calls = []

    class OwnAttach(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

        def _attach(self, child, name):      # a class of its own: _attach is not Module's
            calls.append(name)
            return super()._attach(child, name)

    class Holder(nn.Module):
        inner: nn.Module

        @nn.compact
        def __call__(self, x):
            return self.inner(x) + nn.Dense(2)(x)

    v = OwnAttach().init(random.PRNGKey(0), X)
    assert calls == [None] and list(v["params"]) == ["Dense_0"]
    assert list(_WithSetup().init(random.PRNGKey(0), X)["params"]) == ["d"]
    assert list(Holder(nn.Dense(2)).init(random.PRNGKey(0), X)["params"]) == ["inner", "Dense_0"]
    # capture_intermediates and tabulate: the Python path, with their effects
    _, st = nn.Dense(2).apply(nn.Dense(2).init(random.PRNGKey(0), X), X,
                              capture_intermediates=True)
    assert list(st["intermediates"]) == ["__call__"]
    assert "Dense_0" in OwnAttach().tabulate(random.PRNGKey(0), X)


def test_name_clashes_raise_as_in_python():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            nn.Dense(2, name="d")(x)
            return nn.Dense(2, name="d")(x)

    class LikeParam(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.param("d", nn.initializers.ones, (1,))
            return nn.Dense(2, name="d")(x)

    with pytest.raises(NameInUseError, match='submodule named "d" already exists'):
        Twice().init(random.PRNGKey(0), X)
    with pytest.raises(NameInUseError, match='a variable .* is named "d"'):
        LikeParam().init(random.PRNGKey(0), X)
    assert _module._ctx.stack == []


def test_unbound_and_orphan_calls_raise():
    with pytest.raises(RuntimeError, match="unbound"):
        nn.Dense(2)(X)

    class Orphan(nn.Module):
        def make(self):
            return nn.Dense(2)

        def __call__(self, x):
            return self.make()(x)

    with pytest.raises(RuntimeError, match="created in another method of Orphan"):
        Orphan().init(random.PRNGKey(0), X)


def test_module_call_checks_its_arguments():
    with pytest.raises(TypeError, match="module_call"):
        _C.module_call(len, object(), (), {})
    with pytest.raises(TypeError, match="module_call"):
        _C.module_call(len, nn.Dense(2), [], {})
    with pytest.raises(TypeError, match="module_call"):
        _C.module_call(len, nn.Dense(2), (), None)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        _C.module_call(len, 3, (), {})
    with pytest.raises(RuntimeError, match="unbound"):      # the Python path's error
        _C.module_call(len, nn.Dense(2), (), {})


# --- ModuleMethod: the method wrapper ------------------------------------------------------

class _Doc(nn.Module):
    """A module with a documented method besides __call__."""
    features: int = 2

    @nn.compact
    def __call__(self, x, *, scale=1.0):
        """Dense, scaled."""
        return nn.Dense(self.features)(x) * scale

    def double(self, x):
        return 2 * self(x)


def test_module_method_is_a_c_method_carrying_what_wraps_copies():
    f = _Doc.__call__
    assert type(f) is _C.ModuleMethod and f._ct_wrapped and f._ct_compact
    raw = f.__wrapped__
    assert inspect.isfunction(raw) and not hasattr(raw, "_ct_wrapped")
    assert (f.__name__, f.__qualname__, f.__module__, f.__doc__) == (
        "__call__", "_Doc.__call__", __name__, "Dense, scaled.")
    assert f.__annotations__ == raw.__annotations__
    assert str(inspect.signature(f)) == "(self, x, *, scale=1.0)"
    assert str(inspect.signature(_Doc().__call__)) == "(x, *, scale=1.0)"
    assert "_Doc.__call__" in repr(f)
    # a descriptor as a function is: itself on the class, a bound method on an instance
    assert _Doc.__dict__["__call__"] is f and f.__get__(None, _Doc) is f
    m = _Doc()
    assert m.double.__func__ is _Doc.double and m.double.__self__ is m
    # pickled and deep-copied by reference; weak references work
    assert pickle.loads(pickle.dumps(f)) is f
    assert copy.deepcopy(f) is f and copy.copy(f) is f
    assert weakref.ref(f)() is f
    # a method wrapped again stays as it is
    assert _module._wrap_method(f) is f


def test_module_method_calls_match_the_python_wrapper():
    v = _Doc().init(random.PRNGKey(0), X)
    ref = _python_wrap_method(_Doc.__call__.__wrapped__)
    want = np.asarray(_Doc().apply(v, X, scale=3.0, method=ref))
    assert np.array_equal(np.asarray(_Doc().apply(v, X, scale=3.0)), want)
    assert np.array_equal(np.asarray(_Doc().apply(v, X, method="double")), 2 * np.asarray(
        _Doc().apply(v, X)))
    assert np.array_equal(np.asarray(_Doc().bind(v).double(X)), 2 * np.asarray(
        _Doc().apply(v, X)))
    # the unbound form, and a bound method passed as `method`
    assert np.array_equal(np.asarray(_Doc().apply(
        v, X, method=lambda m, x: _Doc.__call__(m, x, scale=3.0))), want)
    assert np.array_equal(np.asarray(_Doc().apply(v, X, method=_Doc().double)), 2 * np.asarray(
        _Doc().apply(v, X)))


def test_module_method_makes_no_python_frame():
    """An apply of a two-layer nn.Dense model enters no Python frame of a method wrapper:
    the three method calls are the _C.ModuleMethod's, the methods' own frames only."""
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.Dense(4)(x))

    v = MLP().init(random.PRNGKey(0), X)
    MLP().apply(v, X)
    seen = python_frames(lambda: MLP().apply(v, X))
    assert [n for f, n in seen if n == "__call__" and f.endswith("linear.py")] == ["__call__"] * 2
    assert not [c for c in seen if c[0] == _module.__file__ and c[1] in ("wrapped",
                                                                         "_call_method")], seen


def test_module_method_declined_calls_reach_the_python_path_with_their_arguments():
    got = []

    def call_slow(fn, self, args, kwargs):
        got.append((fn, type(self).__name__, args, dict(kwargs)))
        return _module._call_method(fn, self, args, kwargs)

    class WithSetup(nn.Module):
        def setup(self):
            self.d = nn.Dense(2)

        def __call__(self, x, *, scale=1.0):
            return self.d(x) * scale

    v = WithSetup().init(random.PRNGKey(0), X)
    want = np.asarray(WithSetup().apply(v, X, scale=2.0))
    _setup_c(call_slow, _module._bind_new, _module._adopt_tail)
    try:
        out = WithSetup().apply(v, X, scale=2.0)       # setup() to run: the Python path
    finally:
        _setup_c(_module._call_method, _module._bind_new, _module._adopt_tail)
    assert np.array_equal(np.asarray(out), want)
    assert got[0][0] is WithSetup.__call__.__wrapped__
    assert got[0][1:] == ("WithSetup", (X,), {"scale": 2.0})


def test_lifted_transforms_take_a_wrapped_method():
    """nn.remat and nn.jit over a module class's method (a _C.ModuleMethod), as over the
    function it wraps."""
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(nn.Dense.__call__)(nn.Dense(2), x) + nn.jit(
                _Doc.__call__)(_Doc(), x)

    v = Outer().init(random.PRNGKey(0), X)
    assert sorted(v["params"]) == ["Dense_0", "_Doc_0"]
    d = v["params"]["Dense_0"]
    want = X @ np.asarray(d["kernel"]) + np.asarray(d["bias"])
    got = np.asarray(Outer().apply(v, X)) - np.asarray(_Doc().apply(
        {"params": v["params"]["_Doc_0"]}, X))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_module_method_checks_its_arguments():
    with pytest.raises(TypeError, match="callable"):
        _C.ModuleMethod(3)
    with pytest.raises(TypeError, match="keyword"):
        _C.ModuleMethod(len, x=1)
    with pytest.raises(TypeError):
        _C.ModuleMethod()
    with pytest.raises(TypeError, match=r"_Doc.__call__\(\) missing 1 required positional "
                                        r"argument: 'self'"):
        _Doc.__call__()
    with pytest.raises(TypeError, match="must be an nn.Module, got int"):
        _Doc.__call__(3, X)
    with pytest.raises(RuntimeError, match="unbound"):      # the Python path's error
        _Doc()(X)
    bare = _C.ModuleMethod(lambda self: self)               # no wraps: no names to show
    assert "module method" in repr(bare)
    with pytest.raises(TypeError, match="missing 1 required"):
        bare()
    assert _module._ctx.stack == []


def test_module_bind_new_checks_its_arguments():
    d = nn.Dense(2)
    for bad in ([], (), None, "x"):
        with pytest.raises(TypeError, match="module_bind_new"):
            _C.module_bind_new(d, bad)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        _C.module_bind_new(3, [(d, True)])
    with pytest.raises(TypeError, match="must be an nn.Module"):
        _C.module_bind_new(d, [(None, True)])
    with pytest.raises(TypeError, match=r"\(module, compact\) tuples"):
        _C.module_bind_new(d, [("a",)])
    with pytest.raises(TypeError, match=r"\(module, compact\) tuples"):
        _C.module_bind_new(d, [None])
    # a frame of an unbound parent: the Python path's error (no scope to attach to)
    with pytest.raises(AttributeError):
        _C.module_bind_new(d, [(nn.Dense(3), True)])


# --- module_post_init: the end of the generated __init__ ------------------------------------

def test_generated_init_ends_in_module_post_init():
    """The generated __init__ of a plain Module class does Module.__post_init__'s work in
    one C call (its state is the Python path's: test_c_paths_leave_the_python_paths_state)."""
    Leaf, _ = _make_classes()
    assert Leaf.__init__._ct_generated and type(Leaf.__init__) is _C.ModuleInit
    assert Leaf.__init__._ct_slow.__globals__["__ct_post_init_c"] is _C.module_post_init
    free = Leaf(3)
    ref = object.__new__(Leaf)
    ref.__dict__.update(features=3, axes=("a", "b"), name=None)
    _module.Module.__post_init__(ref)
    assert list(free.__dict__) == list(ref.__dict__)
    assert {k: v for k, v in free.__dict__.items()} == ref.__dict__
    assert _module._module_state(free) == _module._module_state(ref)
    assert free._call_names is not Leaf(3)._call_names  # its own


def test_module_post_init_name_check_and_arguments():
    Leaf, _ = _make_classes()
    for bad in (3, b"x", ("a",)):
        with pytest.raises(TypeError, match=rf"^Leaf: name must be a string, got {bad!r}".replace(
                "(", r"\(").replace(")", r"\)")):
            Leaf(2, name=bad)

    class Maker(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Leaf(2, name=7)(x)

    with pytest.raises(TypeError, match="Leaf: name must be a string, got 7"):
        Maker().init(random.PRNGKey(0), X)
    assert _module._ctx.stack == []
    d = Leaf(2)
    with pytest.raises(TypeError, match="module_post_init"):
        _C.module_post_init(d)
    with pytest.raises(TypeError, match="module_post_init"):
        _C.module_post_init(d, None)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        _C.module_post_init(3, {})
    with pytest.raises(TypeError, match="the module's __dict__"):
        _C.module_post_init(d, dict(d.__dict__))


# --- copy_tree: the variables apply and bind copy ---------------------------------------------

def test_copy_tree_matches_the_python_reference():
    import collections
    from ctrainstate.core import FrozenDict
    leaf = np.ones(2)
    od = collections.OrderedDict(a=1, b={"c": leaf})
    od.move_to_end("a")                      # its items() order is not the dict's own
    trees = [{"params": {"D_0": {"kernel": leaf, "bias": 2}, "x": 3}, "stats": {}},
             FrozenDict({"params": FrozenDict({"k": leaf})}), od, {"a": {"b": {"c": {"d": {}}}}},
             {}, leaf, 3, None, [{"a": 1}]]
    def same(a, b):     # equal structure, identical leaves
        if isinstance(a, dict):
            return type(a) is type(b) and list(a) == list(b) and all(
                same(a[k], b[k]) for k in a)
        return a is b

    for t in trees:
        got, want = _C.copy_tree(t), _module._copy_tree(t)
        assert same(got, want)
        if isinstance(t, dict):
            assert type(got) is dict and got is not t
        else:
            assert got is t
    got = _C.copy_tree(od)
    assert list(got) == ["b", "a"] and got["b"]["c"] is leaf and got["b"] is not od["b"]
    got = _C.copy_tree(trees[0])
    assert got["params"]["D_0"] is not trees[0]["params"]["D_0"]
    assert got["params"]["D_0"]["kernel"] is leaf
    deep = {}
    for _ in range(100000):
        deep = {"a": deep}
    with pytest.raises(RecursionError):
        _C.copy_tree(deep)

    class Pairs(dict):
        def items(self):
            return [(1, 2, 3)]

    with pytest.raises(ValueError, match="pairs"):
        _C.copy_tree(Pairs(a=1))


def test_apply_copies_the_variables_in_c():
    """apply runs no Python frame of _copy_tree, and what it writes (a mutable collection)
    never reaches the caller's dicts."""
    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x):
            c = self.variable("stats", "n", lambda: 0)
            c.value = c.value + 1
            return nn.Dense(2)(x)

    v = Counter().init(random.PRNGKey(0), X)
    before = {k: dict(t) for k, t in v.items()}
    out = []
    seen = [name for _, name in python_frames(
        lambda: Counter().apply(v, X, mutable=["stats"]), out)]
    _, new = out[0]
    assert "_copy_tree" not in seen and "apply" in seen
    assert new["stats"]["n"] == v["stats"]["n"] + 1
    assert {k: dict(t) for k, t in v.items()} == before
    b = Counter().bind(v, mutable=["stats"])
    b(X)
    assert {k: dict(t) for k, t in v.items()} == before


def _setup_c(call_slow, bind_slow, adopt_tail):
    _C.module_setup(_module._ctx, _module.Module, _module._Frame, _module.ModuleScope,
                    _module.Module._attach, _module.Module._adopt_fields, _module._base_setup,
                    _module._base_try_setup, _module._plain_fields_info, call_slow, bind_slow,
                    adopt_tail)


def test_common_case_stays_in_c_and_the_rest_goes_to_python():
    counts = {"call": 0, "bind": 0, "tail": 0}

    def count(key, fn):
        def f(*a):
            counts[key] += 1
            return fn(*a)
        return f

    Leaf, Tree = _make_classes()

    class Holder(nn.Module):
        inner: nn.Module

        @nn.compact
        def __call__(self, x):
            return self.inner(x)

    v = Tree().init(random.PRNGKey(0), X)
    vs = _WithSetup().init(random.PRNGKey(0), X)
    _setup_c(count("call", _module._call_method), count("bind", _module._bind_new),
             count("tail", _module._adopt_tail))
    try:
        Tree().apply(v, X)
        assert counts == {"call": 0, "bind": 0, "tail": 0}
        _WithSetup().apply(vs, X)          # setup() to run: the Python call path
        assert counts["call"] == 1 and counts["bind"] == 1    # (attached in setup)
        Holder(nn.Dense(2)).init(random.PRNGKey(0), X)   # a field holding a module
        assert counts["tail"] == 0        # (a root's fields are adopted by _try_setup)

        class Outer(nn.Module):
            @nn.compact
            def __call__(self, x):
                return Holder(nn.Dense(2))(x)

        Outer().init(random.PRNGKey(0), X)
        # Holder (a field holding a module); not the Dense made in Outer's method (its
        # initializer fields are functions, its dtype fields None: no module inside)
        assert counts["tail"] == 1

        class Keyed(nn.Module):
            table: object

            @nn.compact
            def __call__(self, x):
                return x

        class Outer2(nn.Module):
            @nn.compact
            def __call__(self, x):
                return Keyed({"a": 1})(Keyed([1])(Keyed(_Pair(1, 2))(x)))

        Outer2().init(random.PRNGKey(0), X)   # a dict, a list, a namedtuple: _adopt_fields
        assert counts["tail"] == 4
    finally:
        _setup_c(_module._call_method, _module._bind_new, _module._adopt_tail)


_Pair = collections.namedtuple("_Pair", "a b")


def test_fields_without_modules_are_kept_as_they_are():
    """A submodule whose fields hold functions, dtypes or other values with no module inside
    is bound on the C path; its fields keep their objects (a namedtuple keeps its type)."""
    init = nn.initializers.normal(0.5)
    seen = {}

    class Probe(nn.Module):
        fn: object
        dtype: object
        pair: object

        @nn.compact
        def __call__(self, x):
            seen.update(fn=self.fn, dtype=self.dtype, pair=self.pair)
            return nn.Dense(2, kernel_init=self.fn)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Probe(init, np.float32, _Pair(1, (2,)))(x)

    v = Outer().init(random.PRNGKey(0), X)
    Outer().apply(v, X)
    assert seen["fn"] is init and seen["dtype"] is np.float32
    assert type(seen["pair"]) is _Pair and seen["pair"] == (1, (2,))


# --- module_release: the end of an apply -----------------------------------------------------

def test_apply_leaves_no_cyclic_garbage():
    import gc
    Leaf, Tree = _make_classes()
    v = Tree().init(random.PRNGKey(0), X)
    m = Tree()
    m.apply(v, X)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            m.apply(v, X)
            m.init(random.PRNGKey(0), X)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []             # (the modules, scopes and their dicts: about 50 per apply)


def test_release_keeps_trees_something_else_references():
    Leaf, Tree = _make_classes()
    v = Tree().init(random.PRNGKey(0), X)
    kept = []

    class Keeps(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = Leaf(2)
            kept.append(d)
            return d(x)

    class ReturnsSelf(nn.Module):
        @nn.compact
        def __call__(self, x):
            Leaf(2)(x)
            return self

    Keeps().init(random.PRNGKey(0), X)
    assert kept[0].parent is not None and type(kept[0].parent).__name__ == "Keeps"
    m = ReturnsSelf().init_with_output(random.PRNGKey(0), X)[0]
    child = m.scope and m._children["Leaf_0"]
    assert child.parent is m
    # a bound module the caller holds: its tree stays linked
    out, bound = _bound_after_apply(Tree(), v)
    assert all(c.parent is bound for c in bound._children.values())


def test_module_release_cuts_only_private_trees():
    Leaf, Tree = _make_classes()
    v = Tree().init(random.PRNGKey(0), X)
    _, bound = _bound_after_apply(Tree(), v)
    kids = list(bound._children.values())
    assert _C.module_release([bound]) is False        # `bound` and `kids` reference it
    del kids
    holder = [bound]
    del bound
    assert _C.module_release(holder) is True
    assert all(c.parent is None for c in holder[0]._children.values())
    for bad in (None, [], [1, 2], (holder[0],)):
        with pytest.raises(TypeError, match="module_release"):
            _C.module_release(bad)
    assert _C.module_release([3]) is False and _C.module_release([nn.Dense(2)]) is True


def test_only_classes_with_a_setup_read_attributes_through_getattr():
    """A class attribute __getattr__ makes CPython read every attribute of an instance the
    generic slow way, so only classes that can define attributes lazily in setup() get
    Module's (a subclass adding setup() included); without one, a missing attribute raises
    the same AttributeError, bound or not."""
    class Plain(nn.Module):
        features: int = 2

        @nn.compact
        def __call__(self, x):
            assert self.features == 2
            with pytest.raises(AttributeError, match="'Plain' object has no attribute 'nope'"):
                self.nope
            return x

    class WithSetup(Plain):
        def setup(self):
            self.scale = 3.0

        def __call__(self, x):
            return x * self.scale

    class Child(WithSetup):
        pass

    assert not hasattr(Plain, "__getattr__") and not hasattr(nn.Module, "__getattr__")
    assert WithSetup.__getattr__ is Child.__getattr__ is _module._lazy_setup_getattr
    Plain().apply({}, X)
    with pytest.raises(AttributeError, match="'Plain' object has no attribute 'nope'"):
        Plain().nope
    # the attribute setup() defines is made on first access, before any method call
    for cls in (WithSetup, Child):
        bound = cls().bind({})
        assert bound.scale == 3.0
        np.testing.assert_array_equal(cls().apply({}, X), X * 3.0)
        with pytest.raises(AttributeError, match=f"'{cls.__name__}' object has no attribute 'nope'"):
            cls().bind({}).nope


# --- a module's own state in its ModuleBase fields ---------------------------------------------

class _Identity(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


class _Sized(nn.Module):
    width: int = 3
    tag: str = "t"

    @nn.compact
    def __call__(self, x):
        return _Identity()(x) * self.width


def test_module_state_lives_in_the_c_fields_not_the_instance_dict():
    members = [k for k, v in vars(_C.ModuleBase).items()
               if type(v).__name__ == "member_descriptor"]
    assert members == list(_module._STATE_NAMES)
    m = _Sized(4)
    assert list(m.__dict__) == ["width", "tag", "name"]          # the fields only
    assert _module._module_state(m) == {
        "_scope": None, "_parent": None, "_setup_done": False, "_in_setup": False,
        "_auto_counts": {}, "_call_names": set(), "_field_names": (), "_setup_names": set(),
        "_setup_reserved": set(), "_fields_adopted": False, "_children": {}}
    bound = _Sized(4).bind({})
    bound(X)
    child = bound._children["_Identity_0"]
    assert child._parent is bound and child._scope.path == ("_Identity_0",)
    assert "_scope" not in child.__dict__ and "_parent" not in child.__dict__


def test_module_state_reads_none_before_post_init():
    made = []

    class Own(nn.Module):
        width: int = 1

        def __init__(self, width=1):
            made.append((self._scope, self._in_setup, self._children))  # before __post_init__
            self.width = width              # through Module.__setattr__, with no state yet
            self.name = None
            self.__post_init__()

    m = Own(5)
    assert made == [(None, None, None)] and m.width == 5 and m._children == {}
    assert object.__new__(Own)._scope is None and object.__new__(Own)._setup_done is None


def test_modules_copy_and_pickle_with_their_state():
    m = _Sized(4, "a", name="s")
    for clone in (copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        c = clone(m)
        assert type(c) is _Sized and c is not m
        assert c.__dict__ == m.__dict__
        assert _module._module_state(c) == _module._module_state(m)
        assert clone is copy.copy or c._call_names is not m._call_names
        v = c.init(random.PRNGKey(0), X)            # a working module
        np.testing.assert_array_equal(np.asarray(c.apply(v, X)), X * 4)


def test_module_setup_refuses_types_without_the_c_layout():
    """module_setup checks what the C paths read at fixed offsets: the module type derives
    from ModuleBase, the scope type has the ten slots ms_scope_new fills. A refused call
    changes nothing: the model still runs."""
    args = [_module._ctx, _module.Module, _module._Frame, _module.ModuleScope,
            _module.Module._attach, _module.Module._adopt_fields, _module._base_setup,
            _module._base_try_setup, _module._plain_fields_info, _module._call_method,
            _module._bind_new, _module._adopt_tail]

    class PlainModule:          # no ModuleBase fields
        pass

    class DictScope:            # the attributes, but in an instance dict
        pass

    class PartScope(_module.Scope):     # Scope's slots, not ModuleScope's
        pass

    for i, bad, what in ((1, PlainModule, "ModuleBase"), (3, DictScope, "slot '_variables'"),
                         (3, PartScope, "slot 'root_rngs'")):
        a = list(args)
        a[i] = bad
        with pytest.raises(TypeError, match=what):
            _C.module_setup(*a)
    v = _Sized(2).init(random.PRNGKey(0), X)
    np.testing.assert_array_equal(np.asarray(_Sized(2).apply(v, X)), X * 2)
