"""A minimal variable scope: collections, RNG streams, mutability, ``param``/``variable``/``sow``.

This is the smallest object that ``param_with_axes`` and ``variable_with_axes``
need, and the base the Module system builds on. It follows Flax's scope rules:

* variables live in ``{collection: {name: value}}`` dicts, nested by the scope path;
* ``param(name, init_fn, *args)`` returns the existing value, or, when the
  ``'params'`` collection is mutable, calls ``init_fn(make_rng('params'), *args)``
  and stores the result (boxes are stored, the unboxed value is returned);
* ``variable(col, name, init_fn, *args)`` does the same without an RNG;
* ``sow(col, name, value, reduce_fn, init_fn)`` stores ``reduce_fn(old_or_init, value)``
  only when the collection is mutable, and returns whether it did;
* ``with scope:`` makes it the *current* scope, found by :func:`current_scope`.

>>> import numpy as np
>>> from ctrainstate.nn.scope import Scope
>>> s = Scope(rngs={'params': lambda: 0}, mutable=True)
>>> s.param('w', lambda key, shape: np.zeros(shape), (2, 3)).shape
(2, 3)
>>> s.push('Dense_0').param('b', lambda key: 1.0)
1.0
>>> sorted(s.variables()['params'])
['Dense_0', 'w']
"""
from .._src.nn.scope import *  # noqa: F401,F403
from .._src.nn.scope import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
