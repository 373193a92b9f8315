"""Assertions for tests of sharded models (chex's names where chex has them).

Each raises ``AssertionError`` with a message that names the tree path, the shapes or the
shardings that differ, and the size of a numerical difference, so a failing pytest says what
is wrong without a debugger.

* :func:`assert_trees_all_close` / :func:`assert_trees_all_equal`: trees of Arrays, numpy
  arrays or numbers with the same structure and values (Arrays are read to the host).
* :func:`assert_shape`: an array's shape, or a list of arrays' shapes (``None`` and ``...``
  as wildcards, as in chex).
* :func:`assert_sharding`: an Array placed by a ``PartitionSpec`` (over its own mesh, or the
  active one) or a ``Sharding``.
* :func:`assert_tree_shardings`: every leaf sharded as its logical axis names resolve under
  the axis rules (a boxed tree from ``init``, or values and their axis names).
* :func:`assert_mesh_invariant`: a function gives bit-identical results on several meshes.

>>> import numpy as np, ctrainstate as cts
>>> from ctrainstate import testing
>>> testing.assert_trees_all_close({'w': np.ones(3)}, {'w': np.ones(3) + 1e-9})
>>> testing.assert_trees_all_equal([1, 2], [1, 3])
Traceback (most recent call last):
...
AssertionError: Trees 0 and 1 differ in leaves '1': 2 != 3
"""
from ._src.testing.testing import *  # noqa: F401,F403
from ._src.testing.testing import __all__  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
