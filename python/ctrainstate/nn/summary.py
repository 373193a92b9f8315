"""``nn.tabulate`` and ``Module.tabulate`` (mirror of ``flax.linen.summary``): a table of the
module calls one ``init`` makes, with their inputs, outputs and variables, and the parameter
counts Flax reports.

The rows are Flax's: one per module method call in call order (a parent before the
submodules it calls), ``path`` (the submodule names joined by ``/``; empty for the root),
``module`` (the class, with ``(method)`` for a method other than ``__call__``), ``inputs`` and
``outputs`` (as ``dtype[shape]``), then one column per variable collection: the variables
the module owns itself (not its submodules') and their count and size, ``N (B bytes)``.
A path called again is shown once (``show_repeated=True`` shows every call, with no
variables). With ``depth=d`` the rows deeper than ``d`` are left out and a row at depth ``d``
counts its submodules' variables too. The footer has each collection's total and the
caption ``Total Parameters: N (B)`` summed over every collection, Flax's numbers and units.

``init`` runs under :func:`ctrainstate.eval_shape`, so nothing is computed or allocated
(as Flax does with ``jax.eval_shape``); a model with an op that has no abstract rule there
(the convolutions, GroupNorm, BatchNorm in training mode) is initialised for real instead
(an error it raises then is the model's own). The table is drawn with box characters as plain text
(Flax draws it with ``rich``, which ctrainstate does not need); ``console_kwargs``,
``table_kwargs`` and ``column_kwargs`` are accepted for Flax's signature and must be empty or
``None``; ``compute_flops`` / ``compute_vjp_flops`` are not supported (a
``NotImplementedError``).
"""
from .._src.nn.summary import *  # noqa: F401,F403
from .._src.nn.summary import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
