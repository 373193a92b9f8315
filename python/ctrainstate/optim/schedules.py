"""Learning-rate schedules (optax names and formulas): plain functions count -> float.

A schedule is evaluated once per step on the host (scalar math, never per
element) and its value handed to the fused kernel. Given an array of counts (to plot
or tabulate a schedule, as with optax) a schedule returns a float32 array of the
counts' shape, each value the one its count gives.

>>> import ctrainstate.optim as optim
>>> s = optim.linear_schedule(1.0, 0.0, transition_steps=4)
>>> [round(s(i), 3) for i in range(6)]
[1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
"""
from .._src.optim.schedules import *  # noqa: F401,F403
from .._src.optim.schedules import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
