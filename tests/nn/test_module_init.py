"""The C __init__ of nn.Module classes whose fields are plain (_C.ModuleInit, py_module.c):
it binds, stores and post-inits exactly as the generated Python __init__ it stands for
(kept as its ``_ct_slow``, where every call it does not bind goes), with no Python frame;
and the module state a method call resets is reused only where nothing else holds it."""
import dataclasses
import inspect
import weakref

import numpy as np
import pytest

from ctrainstate import _C, nn, random
from ctrainstate._src.nn import module as _module
from call_counts import python_frames

X = np.ones((2, 3), np.float32)
_made = []


def _counter():
    _made.append(1)
    return [len(_made)]


class Plain(nn.Module):
    a: int
    b: tuple = ("x", "y")
    c: list = dataclasses.field(default_factory=_counter)
    d: float = dataclasses.field(default=2.0, kw_only=True)
    e: dict = dataclasses.field(default_factory=dict, kw_only=True)
    hidden: int = dataclasses.field(default=7, init=False)
    hidden_f: list = dataclasses.field(default_factory=list, init=False)


# the dataclass Plain's fields make (its own fields, Flax's keyword `name` after them): what
# Plain's signature must read
_Twin = dataclasses.make_dataclass("_Twin", [
    (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory,
                                       init=f.init, kw_only=f.kw_only))
    for f in dataclasses.fields(Plain) if f.name not in ("name", "parent")] + [
    ("name", "str | None", dataclasses.field(default=None, kw_only=True))])


def _python_made(cls, *args, **kwargs):
    """An instance of cls made by the generated Python __init__ the C one stands for."""
    m = object.__new__(cls)
    cls.__init__._ct_slow(m, *args, **kwargs)
    return m


def test_plain_classes_get_the_c_init_with_the_dataclass_signature():
    assert type(Plain.__init__) is _C.ModuleInit and Plain.__init__._ct_generated
    assert type(nn.Dense.__init__) is _C.ModuleInit
    assert str(inspect.signature(Plain)) == str(inspect.signature(_Twin))
    assert str(inspect.signature(Plain.__init__)) == str(inspect.signature(_Twin.__init__))
    assert Plain.__init__.__name__ == "__init__"
    assert Plain.__init__.__qualname__ == Plain.__init__.__wrapped__.__qualname__
    assert "Plain.__init__" in repr(Plain.__init__)


@pytest.mark.parametrize("args, kwargs", [
    ((1,), {}), ((1, ("p",)), {}), ((1, ("p",), [9]), {}), ((), {"a": 3}),
    ((1,), {"d": 5.0, "e": {"k": 1}, "name": "n"}), ((1,), {"c": [4], "b": ()}),
    ((1,), {"c": dataclasses._HAS_DEFAULT_FACTORY}),     # (the sentinel: the factory runs)
])
def test_the_c_init_stores_what_the_python_init_stores(args, kwargs):
    got = Plain(*args, **kwargs)
    want = _python_made(Plain, *args, **kwargs)
    assert list(got.__dict__) == list(want.__dict__)       # the same entries, in order
    assert _module._module_state(got) == _module._module_state(want)
    factory_ran = len(args) < 3 and kwargs.get("c", dataclasses._HAS_DEFAULT_FACTORY) is \
        dataclasses._HAS_DEFAULT_FACTORY
    for k, v in want.__dict__.items():
        if k == "c" and factory_ran:
            assert got.c == [got.c[0]] and got.c is not want.c   # a factory call each
        else:
            assert got.__dict__[k] == v, k
    assert got.hidden == 7 and got.hidden_f == [] and got.hidden_f is not Plain(1).hidden_f
    assert got.e is not Plain(1).e


def test_default_factories_run_per_instance_in_field_order():
    order = []

    def f(tag):
        def make():
            order.append(tag)
            return [tag]
        return make

    class M(nn.Module):
        p: list = dataclasses.field(default_factory=f("p"))
        q: int = 1
        r: list = dataclasses.field(default_factory=f("r"), kw_only=True)
        s: list = dataclasses.field(default_factory=f("s"), init=False)

    m1, m2 = M(), M(q=2)
    assert order == ["p", "r", "s", "p", "r", "s"]
    assert m1.p == ["p"] and m1.p is not m2.p and m2.q == 2 and m1.s == ["s"]
    del order[:]
    assert M(r=[0]).r == [0] and order == ["p", "s"]     # a value passed: no factory call


@pytest.mark.parametrize("call", [
    lambda: Plain(),                          # missing a required argument
    lambda: Plain(1, (), [], 4),              # too many positional arguments
    lambda: Plain(1, z=3),                    # an unknown keyword
    lambda: Plain(1, a=2),                    # a value twice
    lambda: Plain(1, 2.0),                    # (binds: no error)
    lambda: Plain(1, parent=Plain(1)),        # parent other than None
    lambda: Plain(1, **{"d": 1.0, "name": 3}),   # the name check
])
def test_errors_are_the_python_inits(call):
    # the C init hands what it does not bind to the Python one: the same exception and text
    real = Plain.__init__
    try:
        try:
            call()
            got = None
        except TypeError as e:
            got = str(e)
        type.__setattr__(Plain, "__init__", real._ct_slow)
        try:
            call()
            want = None
        except TypeError as e:
            want = str(e)
    finally:
        type.__setattr__(Plain, "__init__", real)
    assert got == want


def test_error_messages_name_the_class_and_argument():
    with pytest.raises(TypeError, match=r"Plain.__init__\(\) missing 1 required positional "
                                        r"argument: 'a'"):
        Plain()
    with pytest.raises(TypeError, match=r"takes from 2 to 4 positional arguments but 5"):
        Plain(1, (), [], 4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        Plain(1, z=3)
    with pytest.raises(TypeError, match="multiple values for argument 'a'"):
        Plain(1, a=2)
    with pytest.raises(TypeError, match="only parent=None"):
        Plain(1, parent=Plain(1))
    with pytest.raises(TypeError, match="Plain: name must be a string, got 3"):
        Plain(1, name=3)


def test_parent_none_inside_a_compact_method_makes_a_free_module():
    seen = {}

    class Leaf(nn.Module):
        f: int = 2

        @nn.compact
        def __call__(self, x):
            return x * self.f

    class Root(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen["free"] = Leaf(5, parent=None)
            seen["bound"] = Leaf(3)
            return seen["bound"](x)

    np.testing.assert_array_equal(np.asarray(Root().apply({}, X)), 3 * X)
    assert seen["free"].scope is None and seen["free"].parent is None
    assert seen["bound"].name == "Leaf_0" and seen["bound"].scope is not None


def test_a_user_post_init_and_a_subclass_init_run():
    seen = []

    class A(nn.Module):
        a: int = 1

        def __post_init__(self):
            seen.append(("A", self.a))
            super().__post_init__()

    class B(nn.Module):
        a: int = 1

    class C(B):
        def __init__(self, a=1, name=None):
            seen.append(("C.__init__", a))
            super().__init__(a, name=name)

    assert type(A.__init__) is _C.ModuleInit and type(B.__init__) is _C.ModuleInit
    assert A(4).scope is None and seen == [("A", 4)]
    c = C(5)
    assert seen[-1] == ("C.__init__", 5) and c.a == 5 and c.scope is None
    assert list(c.__dict__) == list(_python_made(B, 5).__dict__)


def test_init_argument_checks():
    ok = (lambda self: None, ("a",), 1, (dataclasses.MISSING,), (("a", 0, 1, 2),),
          dataclasses.MISSING, object(), _module.Module.__post_init__)
    _C.ModuleInit(*ok)
    for i, bad, err in [(0, 3, TypeError), (1, ["a"], TypeError), (1, (3,), TypeError),
                        (2, 2, ValueError), (2, -1, ValueError), (3, (), ValueError),
                        (4, (("a", 1, 1, 2),), ValueError), (4, (("a",),), ValueError),
                        (4, ((3, 0, 1, 2),), ValueError)]:
        args = list(ok)
        args[i] = bad
        with pytest.raises(err):
            _C.ModuleInit(*args)
    init = _C.ModuleInit(*ok)
    with pytest.raises(TypeError):
        init()                     # no self: the slow function's error
    assert init(object()) is None   # a self that is no module: the slow function runs


def test_constructing_a_module_runs_no_python_frame():
    class Leaf(nn.Module):
        features: int
        axes: tuple = ("a", "b")
        first: bool = False

    # (the one frame: the lambda itself)
    assert python_frames(lambda: Leaf(3, ("c", "d"), first=True)) == [(__file__, "<lambda>")]

    class Root(nn.Module):
        @nn.compact
        def __call__(self, x):
            frames.extend(python_frames(lambda: Leaf(4)))
            return x

    frames = []
    Root().apply({}, X)       # (the first: the class's field info is computed, once)
    del frames[:]
    Root().apply({}, X)
    assert frames == [(__file__, "<lambda>")]


class _Identity(nn.Module):
    """A submodule that returns its input (the auto-name and call-state tests below)."""

    @nn.compact
    def __call__(self, x):
        return x


def test_auto_names_are_made_once():
    names = []

    class Root(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                m = _Identity()
                names.append(m.name)
            return x

    Root().apply({}, X)
    Root().apply({}, X)
    assert [n for n in names] == ["_Identity_0", "_Identity_1", "_Identity_2"] * 2
    assert all(a is b for a, b in zip(names[:3], names[3:]))


def test_call_state_held_elsewhere_is_replaced_not_changed():
    class Root(nn.Module):
        @nn.compact
        def __call__(self, x):
            return _Identity()(_Identity()(x))

    bound = Root().bind({})

    class _State:       # the module's own state (its ModuleBase fields), read live
        def __getitem__(self, k):
            return getattr(bound, k)

    d = _State()
    held = {k: d[k] for k in ("_call_names", "_auto_counts", "_setup_reserved")}
    before = {k: type(v)(v) for k, v in held.items()}
    bound(X)
    for k, v in held.items():
        assert v == before[k] and d[k] is not v, k      # a new object, the held one as it was
    assert d["_auto_counts"] == {"_Identity": 2} and d["_call_names"] == {"_Identity_0",
                                                                           "_Identity_1"}
    del held, before, v
    call_names = weakref.ref(d["_call_names"])     # (a weak reference: not a holder)
    bound(X)
    # nothing else holds it: the same set, emptied and refilled
    assert call_names() is d["_call_names"] and d["_call_names"] == {"_Identity_0",
                                                                      "_Identity_1"}
    assert d["_auto_counts"] == {"_Identity": 2}
