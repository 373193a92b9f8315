# Stubs for the optimizer part of ctrainstate._C (csrc/python/py_optim.c); merged into _C.pyi.
from typing import Sequence, Any

from ._C import Buffer

# block: (params or None, grads, updates-out or None, state slots, active stage bits, leaf, counts)
_Block = tuple[Buffer | None, Buffer, Buffer | None, Sequence[Buffer | None], int, int, bool]

def optim_step(stages: Sequence[tuple[int, Sequence[float]]], groups: Sequence[Sequence[_Block]],
               nleaves: int, /) -> list[float]: ...
def optim_reference(stages: Sequence[tuple[int, Sequence[float]]], block: _Block, /) -> None: ...
