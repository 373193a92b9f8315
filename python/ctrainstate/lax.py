"""The ``jax.lax`` names a sharded training script uses: ``with_sharding_constraint``,
``stop_gradient`` and ``Precision`` (the ``precision=`` of matrix products: DEFAULT and HIGHEST
are float32 here, HIGH is TF32; see :mod:`ctrainstate._precision`).

``with_sharding_constraint(x, shardings)`` reshards every Array of ``x`` to the given
sharding (eagerly: there is no compiler to hand a constraint to). ``shardings`` is a
``NamedSharding``, a ``SingleDeviceSharding``, a ``PartitionSpec`` (resolved against the
active ``with mesh:``), or a pytree of them that is a prefix of ``x``; anything else (a
bare ``Device``, a string) is a ``TypeError``, as in JAX. The reshard is differentiable: the cotangent goes
back to the input's sharding. numpy leaves are placed like Arrays.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate.lax import with_sharding_constraint
>>> mesh = cts.make_mesh((1,), ('data',))
>>> y = with_sharding_constraint(np.ones((4, 2), np.float32), cts.NamedSharding(mesh, cts.P('data')))
>>> y.sharding.spec
PartitionSpec('data',)
"""
from __future__ import annotations

import numpy as np

from . import tree_util
from ._abstract import ShapeDtypeStruct
from ._devices import Device
from .array import Array, device_put
from .sharding import NamedSharding, PartitionSpec, Sharding, get_mesh

from ._ops import stop_gradient  # noqa: E402,F401
from ._precision import Precision  # noqa: E402,F401

__all__ = ["with_sharding_constraint", "stop_gradient", "Precision"]


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, Sharding))


def _as_sharding(spec) -> Sharding:
    if isinstance(spec, Sharding):
        return spec
    if spec is not None and not isinstance(spec, PartitionSpec):
        hint = ""
        if isinstance(spec, Device):
            hint = f"; to place on one device, pass SingleDeviceSharding({spec!r})"
        # jax.lax.with_sharding_constraint raises a TypeError too
        raise TypeError(f"with_sharding_constraint: shardings must be Shardings, PartitionSpecs "
                        f"or None (or a pytree of them), got {type(spec).__name__} {spec!r}{hint}")
    mesh = get_mesh()
    if mesh is None:
        raise ValueError(
            f"with_sharding_constraint was given {spec!r} outside a mesh: a PartitionSpec "
            f"needs an active `with mesh:`; or pass NamedSharding(mesh, spec)")
    return NamedSharding(mesh, PartitionSpec() if spec is None else spec)


def with_sharding_constraint(x, shardings):
    """``x`` with every Array placed by ``shardings`` (see the module docstring)."""
    from ._ops import with_sharding

    def constrain(spec, sub):
        s = _as_sharding(spec)

        def one(leaf):
            if not isinstance(leaf, (Array, ShapeDtypeStruct, np.ndarray, np.generic, float, int)):
                return leaf
            dt = getattr(leaf, "dtype", None)
            if isinstance(leaf, float) or (dt is not None and np.dtype(dt) in (np.float32,
                                                                               np.float64)):
                return with_sharding(leaf, s)          # float32: differentiable
            return device_put(leaf, s)                 # ints, bools, 16-bit floats: placed
        return tree_util.tree_map(one, sub)

    try:
        return tree_util.tree_map(constrain, shardings, x, is_leaf=_is_spec_leaf)
    except ValueError as e:
        if "outside a mesh" in str(e):
            raise
        raise ValueError(f"with_sharding_constraint: the shardings tree is not a prefix of the "
                         f"values: {e}") from None
