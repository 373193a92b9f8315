"""``ctrainstate.scipy``: the parts of ``jax.scipy`` ctrainstate has (:mod:`.special`)."""
from . import special  # noqa: F401

__all__ = ["special"]
