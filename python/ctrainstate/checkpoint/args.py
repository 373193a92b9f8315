"""orbax's ``args`` names for :class:`~ctrainstate.checkpoint.CheckpointManager`:
``save(step, args=args.StandardSave(state))``, ``restore(step, args=args.StandardRestore(target))``.

>>> from ctrainstate.checkpoint import args
>>> args.StandardSave({'a': 1}).item
{'a': 1}
"""
from .manager import PyTreeRestore, PyTreeSave, StandardRestore, StandardSave

__all__ = ["StandardSave", "StandardRestore", "PyTreeSave", "PyTreeRestore"]


from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
