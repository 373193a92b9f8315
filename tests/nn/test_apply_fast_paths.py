"""The shortcuts `model.apply` takes on its hot path (module/field caches, skipped empty
setup(), cached constraint targets, NamedSharding equality): each gives what the long way
gives, its cache cannot go stale, and the error paths still raise."""
import ctypes
import dataclasses
import dis
import sys
import types

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import NamedSharding, P, nn, random
from ctrainstate._src.array.sharding import get_mesh, set_mesh
from ctrainstate._src.base.trace_state import in_jit, jit_scope
from ctrainstate._src.nn import module as _module
from ctrainstate.nn.scope import NameInUseError


def _mesh(names=("data", "model")):
    return cts.Mesh(np.array(cts.devices()[:1], dtype=object).reshape((1,) * len(names)), names)


# --- NamedSharding equality -------------------------------------------------------------------

def test_named_sharding_eq_same_mesh_and_equal_specs():
    m = _mesh()
    a = NamedSharding(m, P("data", None))
    assert a == a
    assert a == NamedSharding(m, P("data", None))
    assert a == NamedSharding(m, P("data"))             # trailing None: the same split
    assert NamedSharding(m, P("data")) == a
    assert NamedSharding(m, P(None, None)) == NamedSharding(m, P())
    assert NamedSharding(m, P("data", "model")) != NamedSharding(m, P("data"))
    assert NamedSharding(m, P("data")) != NamedSharding(m, P("data", "model"))
    assert NamedSharding(m, P(None, "model")) != NamedSharding(m, P())
    assert a != NamedSharding(m, P(None, "data"))
    assert a != NamedSharding(m, P("model"))
    assert (a == "x") is False


def test_named_sharding_eq_equal_meshes_that_are_different_objects():
    a = NamedSharding(_mesh(), P("data"))
    b = NamedSharding(_mesh(), P("data"))
    assert a.mesh is not b.mesh and a == b and hash(a) == hash(b)
    assert a != NamedSharding(_mesh(("x", "y")), P("x"))


# --- get_mesh / in_jit (read inline) ----------------------------------------------------------

def test_get_mesh_order_of_with_blocks_and_set_mesh():
    m1, m2 = _mesh(), _mesh(("x", "y"))
    assert get_mesh() is None
    with m1:
        assert get_mesh() is m1
        with set_mesh(m2):
            assert get_mesh() is m2           # the later of the two wins
            with m1:
                assert get_mesh() is m1
            assert get_mesh() is m2
        assert get_mesh() is m1
    assert get_mesh() is None


def test_in_jit_nests():
    assert not in_jit()
    with jit_scope():
        assert in_jit()
        with jit_scope():
            assert in_jit()
        assert in_jit()
    assert not in_jit()


def test_thread_local_defaults_in_a_fresh_thread():
    # the thread-local states read their class defaults on a thread that never set them
    # (no AttributeError raised and caught); what one thread sets another does not see
    import threading
    from ctrainstate.nn.scope import Scope, current_scope
    m = _mesh()
    seen = {}

    def other():
        seen["mesh"], seen["jit"], seen["scope"] = get_mesh(), in_jit(), current_scope()
        seen["module"], seen["capture"] = _module.current_module(), list(_module._capture_stack())
        with m, jit_scope(), Scope() as s:
            seen["inside"] = (get_mesh() is m, in_jit(), current_scope() is s)
        seen["after"] = (get_mesh(), in_jit(), current_scope())

    with set_mesh(_mesh(("x", "y"))), jit_scope(), Scope():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert get_mesh() is not None and in_jit() and current_scope() is not None
    assert (seen["mesh"], seen["jit"], seen["scope"], seen["module"]) == (None, False, None, None)
    assert seen["capture"] == [] and seen["inside"] == (True, True, True)
    assert seen["after"] == (None, False, None)


# --- per-class field info ---------------------------------------------------------------------

class _Base(nn.Module):
    a: int = 1

    @nn.compact
    def __call__(self, x):
        return x * self.a


class _Sub(_Base):
    b: int = 2


def _names(cls):
    return tuple(f.name for f in dataclasses.fields(cls))


def test_field_info_per_class_not_inherited():
    assert _module._field_info(_Base)[1] == _names(_Base) == ("a", "name")
    assert _module._field_info(_Sub)[1] == _names(_Sub)        # not the parent's entry
    assert set(_names(_Sub)) == {"a", "b", "name"}
    assert _module._field_info(_Base)[1] == ("a", "name")
    assert repr(_Sub(3, 4)) == "_Sub(a=3, b=4)"
    assert _Sub(3, 4) == _Sub(3, 4) and _Sub(3, 4) != _Sub(3, 5)


def test_field_info_follows_a_new_dataclass_fields_dict():
    class M(nn.Module):
        a: int = 1

    assert _module._field_info(M)[1] == ("a", "name")
    # a class whose fields change (decorated again with a new field) gets a new entry
    M.__annotations__["c"] = int
    M.c = 5
    dataclasses.dataclass(M, eq=False, repr=False)
    assert _module._field_info(M)[1] == _names(M) and "c" in _names(M)


def test_field_info_of_a_non_dataclass_raises_as_dataclasses_fields():
    with pytest.raises(TypeError):
        _module._field_info(nn.Module)


def test_field_info_init_false_fields_left_out_of_copies():
    class M(nn.Module):
        a: int = 1
        k: int = dataclasses.field(default=7, init=False)

    info = _module._field_info(M)
    assert info[1] == _names(M) and set(info[1]) == {"a", "k", "name"}
    assert set(info[2]) == {"a", "name"}
    assert M(3).copy().a == 3


# --- field adoption shortcuts -----------------------------------------------------------------

class _Holder(nn.Module):
    inner: object = None
    axes: tuple = ("a", "b")
    table: object = None

    @nn.compact
    def __call__(self, x):
        if isinstance(self.inner, (tuple, list)):
            for m in self.inner:
                x = m(x)
            return x
        return self.inner(x) if self.inner is not None else x


def test_adopt_fields_still_finds_modules_in_containers():
    x = np.ones((1, 3), np.float32)
    for inner in (nn.Dense(2), [nn.Dense(2)], (nn.Dense(2), nn.Dense(2))):
        v = _Holder(inner).init(random.PRNGKey(0), x)
        want = ["inner"] if isinstance(inner, nn.Module) else \
            [f"inner_{i}" for i in range(len(inner))]
        assert sorted(v["params"]) == want


def test_adopt_fields_freezes_lists_and_dicts_keeps_plain_tuples():
    seen = {}

    class M(nn.Module):
        axes: object = None
        table: object = None

        @nn.compact
        def __call__(self, x):
            seen["axes"], seen["table"] = self.axes, self.table
            return x

    x = np.ones((1, 3), np.float32)
    axes = ("a", "b")
    M(axes, {"k": [1, 2]}).init(random.PRNGKey(0), x)
    assert seen["axes"] == axes and type(seen["axes"]) is tuple
    assert seen["table"] == {"k": (1, 2)} and type(seen["table"]["k"]) is tuple
    M(["a", "b"], None).init(random.PRNGKey(0), x)
    assert seen["axes"] == ("a", "b") and type(seen["axes"]) is tuple   # a list is frozen
    M(("a", ["b"]), None).init(random.PRNGKey(0), x)
    assert seen["axes"] == ("a", ("b",))     # a tuple holding a list: frozen inside


# --- setup() skipped only when there is none ---------------------------------------------------

def test_setup_still_runs_when_defined_and_skipped_when_not():
    calls = []

    class WithSetup(nn.Module):
        def setup(self):
            calls.append("setup")
            self.d = nn.Dense(2)

        def __call__(self, x):
            return self.d(x)

    class WithoutSetup(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    x = np.ones((1, 3), np.float32)
    class Inherits(WithSetup):      # an inherited setup() is a setup()
        pass

    v = WithSetup().init(random.PRNGKey(0), x)
    WithSetup().apply(v, x)
    assert calls == ["setup", "setup"]      # once per init / apply: never skipped
    Inherits().apply(v, x)
    assert calls == ["setup"] * 3
    v2 = WithoutSetup().init(random.PRNGKey(0), x)
    np.testing.assert_array_equal(np.asarray(WithoutSetup().apply(v2, x)),
                                  np.asarray(WithoutSetup().apply(v2, x)))


def test_setup_skipped_module_keeps_its_setup_reservations_rule():
    """A module without setup() reserves nothing before its call: a compact module may
    declare a parameter of any name, once per call, and twice still raises."""
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.param("w", nn.initializers.ones, (3,))
            self.param("w", nn.initializers.ones, (3,))
            return x

    with pytest.raises(NameInUseError, match='"w" is already in use'):
        Twice().init(random.PRNGKey(0), np.ones((3,), np.float32))


# --- the storing __init__ (a frozen twin's dataclass __init__) ----------------------------------

def test_storing_init_keeps_the_dataclass_signature_and_semantics():
    import inspect

    class M(nn.Module):
        a: int
        b: tuple = (1, 2)
        c: list = dataclasses.field(default_factory=list)
        d: int = dataclasses.field(default=4, init=False)
        e: float = dataclasses.field(default=0.5, kw_only=True)

    class Sub(M):
        f: str = "x"

    for cls in (M, Sub):
        assert not cls.__dataclass_params__.frozen           # the class itself is not frozen
        params = list(inspect.signature(cls).parameters)
        assert params == [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only] \
            + [f.name for f in dataclasses.fields(cls) if f.init and f.kw_only]
    m1, m2 = M(1), M(2, e=1.5)
    assert (m1.a, m1.b, m1.d, m1.e, m2.e) == (1, (1, 2), 4, 0.5, 1.5)
    assert m1.c == [] and m1.c is not m2.c                   # a factory per instance
    assert Sub(1, f="y").f == "y" and Sub(1).name is None and Sub(1, name="n").name == "n"
    m1.a = 7                                                 # an unbound module may be set
    assert m1.a == 7
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'a'"):
        M()
    with pytest.raises(TypeError, match="unexpected keyword argument 'd'"):
        M(1, d=3)
    with pytest.raises(TypeError, match="only parent=None"):
        M(1, parent=m2)


def test_storing_init_runs_a_user_post_init_and_initvars_keep_the_generated_init():
    seen = []

    class P(nn.Module):
        a: int = 1

        def __post_init__(self):
            seen.append(self.a)
            super().__post_init__()

    class IV(nn.Module):
        a: int = 1
        scale: dataclasses.InitVar[int] = 2

        def __post_init__(self, scale):
            object.__setattr__(self, "scaled", self.a * scale)
            super().__post_init__()

    assert P(3).a == 3 and seen == [3]
    assert IV(3, 4).scaled == 12 and IV(3).scaled == 6


def test_storing_init_bound_modules_still_frozen():
    class M(nn.Module):
        a: int = 1

        @nn.compact
        def __call__(self, x):
            self.a = 2
            return x

    with pytest.raises(AttributeError, match="frozen"):
        M().init(random.PRNGKey(0), np.ones((2,), np.float32))


def test_generated_init_is_used_where_it_mirrors_the_class():
    def generated(cls):
        return getattr(cls.__init__, "_ct_generated", False)

    def stores_directly(cls):                          # the twin's, under _accept_parent
        code = cls.__init__.__wrapped__.__code__
        return "__dataclass_builtins_object__" in code.co_names + code.co_freevars

    class M(nn.Module):
        a: int = 1
        c: list = dataclasses.field(default_factory=list)

    class IV(nn.Module):
        scale: dataclasses.InitVar[int] = 2

        def __post_init__(self, scale):
            super().__post_init__()

    class _Desc:                                       # a descriptor-typed field
        def __set_name__(self, owner, name):
            self.attr = "_" + name

        def __get__(self, obj, owner=None):
            return 5 if obj is None else getattr(obj, self.attr) * 10

        def __set__(self, obj, value):
            object.__setattr__(obj, self.attr, value)

    class D(nn.Module):
        v: int = _Desc()

    assert generated(M) and generated(nn.Dense)
    assert not generated(IV) and not stores_directly(IV)
    assert not generated(D) and stores_directly(D)     # the twin calls the descriptor
    assert D(3).v == 30 and D().v == 50


def test_generated_init_fields_named_like_builtins_and_its_own_names():
    class M(nn.Module):
        type: str = "relu"
        dict: int = 2
        set: tuple = ()
        stack: int = 3
        isinstance: int = 4

        @nn.compact
        def __call__(self, x):
            return x * self.dict

    m = M("gelu", 5, (1,))
    assert (m.type, m.dict, m.set, m.stack, m.isinstance) == ("gelu", 5, (1,), 3, 4)
    assert getattr(M.__init__, "_ct_generated", False)
    x = np.ones((2,), np.float32)
    np.testing.assert_array_equal(np.asarray(M().apply({}, x)), 2 * x)


def test_generated_init_runs_the_post_init_of_the_instance_class():
    # the inline Module.__post_init__ only stands for the instance's own class keeping it: a
    # subclass with its own __init__ (which calls the generated one) and __post_init__, or a
    # __post_init__ set on the class afterwards, runs
    seen = []

    class A(nn.Module):
        a: int = 1

    class B(A):
        def __init__(self, a=1, name=None):
            super().__init__(a, name=name)

        def __post_init__(self):
            seen.append(("B", self.a))
            super().__post_init__()

    assert getattr(A.__init__, "_ct_generated", False)
    b = B(4)
    assert seen == [("B", 4)] and b.a == 4 and b.scope is None and b.parent is None

    class C(nn.Module):
        a: int = 1

    def post(self):
        seen.append(("C", self.a))
        nn.Module.__post_init__(self)

    C.__post_init__ = post
    try:
        c = C(7)
    finally:
        del C.__post_init__
    assert seen[-1] == ("C", 7) and c.scope is None
    C(8)
    assert seen[-1] == ("C", 7)


def test_generated_init_parent_none_and_binding():
    class Leaf(nn.Module):
        f: int = 2

        @nn.compact
        def __call__(self, x):
            return x * self.f

    free = {}

    class Root(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = Leaf(3)
            free["m"] = Leaf(5, parent=None)
            assert a.name == "Leaf_0" and a.parent is self and a.scope is not None
            assert free["m"].scope is None and free["m"].parent is None
            return a(x)

    x = np.ones((2,), np.float32)
    np.testing.assert_array_equal(np.asarray(Root().apply({}, x)), 3 * x)
    assert free["m"].name is None and free["m"].f == 5
    with pytest.raises(TypeError, match="name must be a string"):
        Leaf(name=3)
    with pytest.raises(TypeError, match="only parent=None"):
        Leaf(parent=Leaf())

def test_module_scope_push_builds_what_the_constructor_builds():
    # ModuleScope.push makes its child without the __init__ calls: the same attributes (an
    # attribute added to Scope.__init__ or ModuleScope.__init__ and not to push fails here)
    root = _module.ModuleScope({"params": {}}, {"params": np.zeros(2, np.uint32)}, "params")
    root.initializing = True
    child = root.push("Dense_0")
    made = _module.ModuleScope(root._variables, root.root_rngs, root.mutable, ("Dense_0",))
    made.initializing, made.adopted = root.initializing, root.adopted
    assert type(child) is _module.ModuleScope and root.push("Dense_0") is child
    attrs = _module._scope_state
    assert len(attrs(made)) == 10 and list(attrs(child)) == list(attrs(made))
    for k, v in attrs(made).items():
        got = attrs(child)[k]
        if k in ("_variables", "adopted"):
            assert got is v                                   # shared with the parent
        elif k == "root_rngs":
            assert got is not root.root_rngs and list(got) == list(v)   # a copy per scope
            assert all(got[n] is v[n] for n in v)
        else:
            assert type(got) is type(v) and got == v
    assert child.path == ("Dense_0",) and child.push("x").path == ("Dense_0", "x")


# --- Module.param's shape check by initializer identity ----------------------------------------

@pytest.mark.parametrize("path", ["C", "Python"])
def test_param_shape_check_finds_a_module_initializer_by_identity(path, monkeypatch):
    """An existing parameter's declaration (nn.Dense's self.param at every apply) takes the
    short path: in C (_C.ModuleParam) no Python frame at all, and with the Python method
    module._existing_param: no scope.param, reserve or shape-check frames. The initializer,
    the same object at every apply (a field default), is found by identity
    (scope._SHAPES_BY_ID) without building its key (_fn_key) again; a parameter of the wrong
    shape still raises, the cache warm or not, an initializer made anew per call is still
    checked, and a name declared twice still raises."""
    import sys
    from ctrainstate.nn.scope import ScopeParamShapeError
    if path == "Python":
        monkeypatch.setattr(_module.Module, "param", _module._python_param)
    x = np.ones((2, 3), np.float32)
    model = nn.Dense(4)
    v = model.init(random.PRNGKey(0), x)
    model.apply(v, x)
    model.apply(v, x)
    seen = []
    sys.setprofile(lambda frame, event, arg: seen.append(frame.f_code.co_name)
                   if event == "call" else None)
    try:
        y = model.apply(v, x)
    finally:
        sys.setprofile(None)
    if path == "C":
        assert not {"param", "_existing_param", "_need_scope", "_check_declaring",
                    "_expected_shapes_cached", "unbox"} & set(seen), seen
    else:
        assert "_existing_param" in seen, seen      # the existing parameter's short path
    assert not {"_fn_key", "_check_param_shape", "_placing", "reserve"} & set(seen), seen
    np.testing.assert_allclose(np.asarray(y), x @ np.asarray(v["params"]["kernel"]) +
                               np.asarray(v["params"]["bias"]), rtol=1e-6)
    bad = {"params": {"kernel": cts.device_put(np.ones((3, 5), np.float32)),
                      "bias": v["params"]["bias"]}}
    with pytest.raises(ScopeParamShapeError, match="kernel"):
        model.apply(bad, x)

    class PerCall(nn.Module):
        n: int

        @nn.compact
        def __call__(self, x):
            def init(key, shape):         # a new function object at every call
                return np.zeros(shape, np.float32)
            return x @ self.param("w", init, (x.shape[-1], self.n))
    vp = PerCall(2).init(random.PRNGKey(0), x)
    for _ in range(3):
        PerCall(2).apply(vp, x)
    with pytest.raises(ScopeParamShapeError, match="w"):
        PerCall(5).apply(vp, x)

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.zeros_init(), (x.shape[-1], 2))
            return x @ w + self.param("w", nn.initializers.zeros_init(), (x.shape[-1], 2))
    with pytest.raises(NameInUseError, match="w"):
        Twice().apply(vp, x)



def test_module_param_in_c_answers_what_the_python_method_answers(monkeypatch):
    """_C.ModuleParam (Module.param) returns the existing parameter object and reserves its
    name as the Python method does; a call it does not take (keywords, strict rules, an
    unbound module, a mis-shaped parameter) reaches the Python method with its arguments and
    raises or creates there."""
    import inspect
    from ctrainstate import _C
    from ctrainstate.nn import logical_axis_rules
    from ctrainstate.nn.scope import ScopeParamShapeError
    assert type(_module.Module.__dict__["param"]) is _C.ModuleParam
    assert inspect.signature(_module.Module.param) == inspect.signature(_module._python_param)
    assert _module.Module.param.__doc__ == _module._python_param.__doc__
    calls = []

    def spy(self, *args, **kwargs):
        calls.append((args[0], tuple(sorted(kwargs))))
        return _module._python_param(self, *args, **kwargs)
    monkeypatch.setattr(_module.Module, "param", _C.ModuleParam(spy))
    init = nn.initializers.lecun_normal()
    got = {}

    class M(nn.Module):
        kw: bool = False

        @nn.compact
        def __call__(self, x):
            k = (self.param("k", init, (3, 4), unbox=True) if self.kw else
                 self.param("k", init, (3, 4)))
            got["k"] = k
            got["reserved"] = set(self.scope._reserved)
            return x @ k
    x = np.ones((2, 3), np.float32)
    v = M().init(random.PRNGKey(0), x)
    M().apply(v, x)          # (the Python method notes the scope class as plain)
    calls.clear()
    for _ in range(2):
        M().apply(v, x)
    assert calls == [] and got["k"] is v["params"]["k"]
    assert got["reserved"] == {("params", "k")}
    M(kw=True).apply(v, x)
    assert calls == [("k", ("unbox",))]
    calls.clear()
    with pytest.raises(ScopeParamShapeError, match="k"):
        M().apply({"params": {"k": cts.device_put(np.ones((3, 5), np.float32))}}, x)
    assert calls == [("k", ())]
    calls.clear()
    with logical_axis_rules((("a", None),), strict=True):
        M().apply(v, x)
    assert calls == [("k", ())]
    calls.clear()
    with pytest.raises(RuntimeError, match="unbound"):
        M().param("k", init, (3, 4))
    assert calls == [("k", ())]
    with pytest.raises(TypeError):
        _C.ModuleParam(3)
    with pytest.raises(TypeError):
        _C.module_param_setup(1, 2, 3, 4, 5, 6)


def _split(d):
    """Whether the dict `d` is split (its values apart from its keys, the form CPython makes
    an instance dict in from the instance's inline values): PyDictObject.ma_values, read
    at its offset in CPython 3.11 and 3.12 (after the object header, ma_used,
    ma_version_tag and ma_keys)."""
    return ctypes.c_void_p.from_address(id(d) + 40).value is not None


@pytest.mark.skipif(not (3, 11) <= sys.version_info[:2] <= (3, 12),
                    reason="reads CPython 3.11/3.12's dict layout and specialized bytecode")
def test_module_made_by_the_c_init_keeps_a_combined_instance_dict():
    """A module made by its class's C __init__ (ModuleInit) keeps its fields in a combined
    instance dict, not in the split dict CPython makes from an instance's inline values: on a
    split dict CPython 3.11 reads attributes the generic way, about twice as long; on a
    combined one the read below specializes to LOAD_ATTR_WITH_HINT."""
    class M(nn.Module):
        width: int = 3
        scale: float = 2.0

    def read(m):
        return m.width

    assert getattr(M.__init__, "_ct_generated", False)
    assert _split(object.__new__(M).__dict__)          # what CPython makes (the control)
    for m in (M(width=4), M(), M(5, 1.0)):
        assert not _split(m.__dict__) and m.width == m.__dict__["width"]
        assert (m.width, m.scale) == (m.__dict__["width"], m.__dict__["scale"])
    f = types.FunctionType(read.__code__, read.__globals__)   # fresh bytecode
    ms = [M(width=i) for i in range(200)]
    assert [f(m) for m in ms] == list(range(200))
    assert {i.opname for i in dis.get_instructions(f, adaptive=True)
            if i.opname.startswith("LOAD_ATTR")} == {"LOAD_ATTR_WITH_HINT"}

    # bound children made during an apply too
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            inner = M(width=2)
            seen.append(_split(inner.__dict__))
            return x * inner.width

    seen = []
    assert float(Outer().apply({}, cts.numpy.ones(()))) == 2.0
    assert seen == [False]


def test_module_apply_in_c_answers_what_the_python_method_answers(monkeypatch):
    """_C.ModuleApply (Module.apply) without keywords gives the Python method's output, with
    no Python frame of apply, _run or _clone_bound; it leaves the thread's scope and capture
    stacks as they were (also when the model raises) and frees the bound tree. A call it does
    not take (keywords, variables that are not a plain dict, an apply inside a module method,
    a class with its own _run or _clone_bound) reaches the Python method with its arguments."""
    import gc
    import inspect
    import weakref
    from ctrainstate import _C
    from ctrainstate._src.nn.scope import _stack as scope_tls
    from call_counts import python_frames
    assert type(_module.Module.__dict__["apply"]) is _C.ModuleApply
    assert inspect.signature(_module.Module.apply) == inspect.signature(_module._python_apply)
    assert _module.Module.apply.__doc__ == _module._python_apply.__doc__
    calls = []

    def spy(self, *args, **kwargs):
        calls.append(tuple(sorted(kwargs)))
        return _module._python_apply(self, *args, **kwargs)
    monkeypatch.setattr(_module.Module, "apply", _C.ModuleApply(spy))
    seen = {}

    class Inner(nn.Module):
        feats: int

        @nn.compact
        def __call__(self, x, scale=1.0):
            seen["scope"] = self.scope
            return nn.Dense(self.feats, name="d")(x) * scale

    class Outer(nn.Module):
        feats: int = 3
        fail: bool = False

        @nn.compact
        def __call__(self, x, scale=1.0):
            if self.fail:
                raise ValueError("model failed")
            seen["ref"] = weakref.ref(self)
            return Inner(self.feats)(x, scale)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    v = Outer().init(random.PRNGKey(1), x)
    ref = np.asarray(_module._python_apply(Outer(), v, x, 2.0))
    Outer().apply(v, x)                       # (the first apply may take the Python method)
    calls.clear()
    gc.disable()
    try:
        frames = python_frames(lambda: seen.setdefault("out", Outer().apply(v, x, 2.0)))
    finally:
        gc.enable()
    assert calls == [] and np.array_equal(np.asarray(seen["out"]), ref)
    names = {f for _, f in frames}
    assert not names & {"apply", "_run", "_clone_bound", "_field_info"}, names
    # the variables were copied (the caller's dicts are not the scope's), the tree freed
    # without the cycle collector
    assert seen["scope"]._variables["params"] is not v["params"]
    assert seen["ref"]() is None
    assert scope_tls.scopes == [] and _module._ctx.capture == [] and _module._ctx.stack == []
    # a model that raises: the same exception, the stacks popped
    with pytest.raises(ValueError, match="model failed"):
        Outer(fail=True).apply(v, x)
    assert scope_tls.scopes == [] and _module._ctx.capture == [] and calls == []
    # calls the C path does not take
    out, state = Outer().apply(v, x, mutable=["intermediates"])
    assert calls == [("mutable",)] and np.array_equal(np.asarray(out), np.asarray(
        _module._python_apply(Outer(), v, x)))
    calls.clear()
    Outer().apply(v, x, scale=2.0)
    assert calls == [("scale",)]
    calls.clear()
    with pytest.raises(TypeError, match="variables must be a dict"):
        Outer().apply([v], x)
    assert calls == [()]
    calls.clear()
    from ctrainstate.core import FrozenDict
    assert np.array_equal(np.asarray(Outer().apply(FrozenDict(v), x, 2.0)), ref)
    assert calls == [()]
    calls.clear()

    class Caller(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Outer().apply(v, x, 2.0)      # a module method is running
    assert np.array_equal(np.asarray(Caller().apply({}, x)), ref)
    assert calls == [(), ()]
    calls.clear()

    class OwnRun(Outer):
        def _run(self, *args, **kwargs):
            seen["own_run"] = True
            return super()._run(*args, **kwargs)
    assert np.array_equal(np.asarray(OwnRun().apply(v, x, 2.0)), ref)
    assert calls == [()] and seen["own_run"]
    with pytest.raises(TypeError):
        _C.ModuleApply(3)
    with pytest.raises(TypeError):
        _C.module_apply_setup(1, 2)
