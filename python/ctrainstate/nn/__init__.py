"""ctrainstate.nn (initializers only on this branch; the rest of nn/ is owned elsewhere)."""
from . import initializers
