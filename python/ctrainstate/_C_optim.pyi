# Stubs for the optimizer part of ctrainstate._C (csrc/python/py_optim.c); merged into _C.pyi.
from typing import Sequence, Any

from ._C import Buffer

# block: (params or None, grads (None when passed in `grads`), updates-out or None, state slots,
#         active stage bits, leaf, counts[, factored geometry (d0, d1, shape, start, block_shape)])
_Geom = tuple[int, int, Sequence[int], Sequence[int], Sequence[int]] | None
_Block = (tuple[Buffer | None, Buffer | None, Buffer | None, Sequence[Buffer | None], int, int, bool]
          | tuple[Buffer | None, Buffer | None, Buffer | None, Sequence[Buffer | None], int, int, bool,
                  _Geom])

def optim_step(stages: Sequence[tuple[int, Sequence[float]]], groups: Sequence[Sequence[_Block]],
               nleaves: int, grads: Sequence[Sequence[Buffer]] | None = None, /) -> list[float]: ...
def optim_reference(stages: Sequence[tuple[int, Sequence[float]]], block: _Block, /) -> None: ...
