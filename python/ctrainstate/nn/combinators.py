"""``nn.Sequential`` (mirror of ``flax.linen.Sequential``).

>>> import numpy as np
>>> from ctrainstate import nn, random
>>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
>>> v = model.init(random.PRNGKey(0), np.ones((1, 3), np.float32))
>>> sorted(v['params'])
['layers_0', 'layers_2']
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .._src.nn.module import Module

__all__ = ["Sequential"]


class Sequential(Module):
    """Call ``layers`` in order, each on the previous output (a tuple output is passed as
    positional arguments, a dict as keyword arguments). Modules among the layers are
    named ``layers_<index>``, as in Flax."""

    layers: Sequence[Callable[..., Any]]

    def __call__(self, *args, **kwargs):
        if not self.layers:
            raise ValueError(f"Empty Sequential module {self.name}.")
        out = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            if isinstance(out, tuple):
                out = layer(*out)
            elif isinstance(out, dict):
                out = layer(**out)
            else:
                out = layer(out)
        return out


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
