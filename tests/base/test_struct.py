"""``ctrainstate.struct`` (flax.struct): markers that code written for Flax tests for."""
from typing import Any

from ctrainstate import struct
from ctrainstate.train_state import TrainState


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
