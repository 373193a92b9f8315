"""``flax.core``'s dict helpers: ``FrozenDict``, ``freeze``, ``unfreeze``, ``copy``, ``pop``,
``pretty_repr`` (and ``DenyList``).

``FrozenDict`` is an immutable dict (a ``dict`` subclass, so code that checks for dicts
accepts it; nested dicts are frozen too) and a pytree node with sorted keys, as in Flax.
``unfreeze`` returns plain nested dicts (a copy of the structure; leaves are shared).
ctrainstate's ``init`` returns plain dicts, as current Flax does, so ``freeze``/``unfreeze``
calls in a ported script are only needed where the script relies on them.

>>> from ctrainstate.core import freeze, unfreeze
>>> f = freeze({'a': {'b': 1}, 'c': 2})
>>> type(f['a']).__name__, f == {'a': {'b': 1}, 'c': 2}
('FrozenDict', True)
>>> rest, c = f.pop('c')
>>> c, unfreeze(rest)
(2, {'a': {'b': 1}})
"""
from ._src.core.frozen_dict import *  # noqa: F401,F403
from ._src.core.frozen_dict import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from ._src.core.frozen_dict import FrozenDictImmutableError  # noqa: F401

from ._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
