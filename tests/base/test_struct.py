"""``ctrainstate.struct`` (flax.struct): markers that code written for Flax tests for."""
from typing import Any

from ctrainstate import struct
from ctrainstate.train_state import TrainState
import dataclasses
import pytest
from ctrainstate import serialization
from ctrainstate import tree_util


def test_struct_dataclass_sets_flax_dataclass_marker():
    """flax.struct.dataclass sets ``_flax_dataclass`` on the class (libraries test for it to
    tell a struct from a plain dataclass); so does every PyTreeNode subclass."""
    @struct.dataclass
    class A:
        x: Any

    class B(struct.PyTreeNode):
        y: int = 0

    assert A._flax_dataclass is True and A(1)._flax_dataclass is True
    assert '_flax_dataclass' in B.__dict__ and B()._flax_dataclass is True
    assert '_flax_dataclass' in TrainState.__dict__
    assert struct.dataclass(A) is A   # decorating twice is a no-op, as in Flax


# --- flax.struct parity (found against live Flax): the parity tests compare with it (and skip
# without it), the others hold expectations derived by hand

def test_struct_dataclass_frozen_false_is_mutable():
    @struct.dataclass(frozen=False)
    class C:
        x: int

    c = C(1)
    c.x = 2            # Flax's struct.dataclass sets frozen=True only when not given
    assert c.x == 2 and tree_util.tree_leaves(c) == [2]

    @struct.dataclass
    class D:
        x: int
    with pytest.raises(dataclasses.FrozenInstanceError):
        D(1).x = 2


def test_pytree_node_passes_class_keywords_to_dataclass():
    class K(struct.PyTreeNode, kw_only=True):
        x: int
        y: int = struct.field(pytree_node=False, default=3)

    k = K(x=1)
    assert tree_util.tree_leaves(k) == [1] and k.y == 3
    with pytest.raises(TypeError):
        K(1)           # keyword-only


def test_struct_keywords_match_flax():
    fst = pytest.importorskip("flax.struct")
    for S in (fst, struct):
        class K(S.PyTreeNode, kw_only=True):
            x: int
        assert K(x=1).x == 1
        with pytest.raises(TypeError):
            K(1)

        @S.dataclass(frozen=False)
        class C:
            x: int
        c = C(1)
        c.x = 5
        assert c.x == 5


def test_struct_field_takes_metadata_none():
    # flax.struct.field(pytree_node=True, *, metadata=None, **kwargs): None raised TypeError
    f = struct.field(pytree_node=False, metadata=None)
    assert dict(f.metadata) == {"pytree_node": False}
    assert dict(struct.field(metadata={"x": 1}).metadata) == {"pytree_node": True, "x": 1}


def test_struct_unflatten_runs_post_init_like_flax():
    # jax.tree_util.register_dataclass (Flax's struct) rebuilds through __init__: attributes
    # that __post_init__ derives exist on tree_map's result too (they were missing)
    calls = []

    @struct.dataclass
    class A:
        x: Any
        tag: str = struct.field(pytree_node=False, default="t")

        def __post_init__(self):
            calls.append(self.x)
            object.__setattr__(self, "double", self.x * 2)

    a = A(1, "u")
    b = tree_util.tree_map(lambda v: v + 1, a)
    assert calls == [1, 2] and b.double == 4 and b.tag == "u" and b == A(2, "u")
    r = serialization.from_state_dict(a, {"x": 5})
    assert r.double == 10


def test_struct_post_init_on_unflatten_matches_flax():
    fst = pytest.importorskip("flax.struct")
    jtu = pytest.importorskip("jax.tree_util")
    for S, tu in ((fst, jtu), (struct, tree_util)):
        calls = []

        @S.dataclass
        class A:
            x: Any

            def __post_init__(self):
                calls.append(self.x)
        tu.tree_map(lambda v: v + 1, A(1))
        assert calls == [1, 2]


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def test_struct_dataclass():
    from typing import Any, Callable
    from ctrainstate import struct, tree_util

    @struct.dataclass
    class Model:
        params: Any
        apply_fn: Callable = struct.field(pytree_node=False)

    @struct.dataclass(kw_only=True)
    class Cfg:
        lr: float
        name: str = struct.field(pytree_node=False, default="x")

    class Node(struct.PyTreeNode):
        a: Any
        b: int = struct.field(pytree_node=False, default=3)

    m = Model({"w": 1.0}, print)
    assert tree_util.tree_leaves(m) == [1.0]
    m2 = tree_util.tree_map(lambda v: v * 2, m)
    assert m2.params == {"w": 2.0} and m2.apply_fn is print
    assert m.replace(params=0).params == 0
    with pytest.raises(Exception):
        m.params = 3                                     # frozen
    assert tree_util.tree_leaves(Cfg(lr=0.1)) == [0.1]
    with pytest.raises(TypeError):
        Cfg(0.1)                                         # kw_only
    assert tree_util.tree_leaves(Node([1, 2])) == [1, 2] and Node(1).b == 3
