"""GradientTransformation, optax-structured empty states, and the fused step.

Every transform is a :class:`GradientTransformation` with optax's ``init`` and
``update``. Elementwise transforms (and the reductions clip_by_global_norm,
scale_by_trust_ratio, apply_if_finite) also know how to *fuse*: they describe
themselves as stages of ``ctrainstate._C.optim_step`` (see
csrc/core/ct_optim.h), so a whole chain runs as one pass per device over all
leaves, in C, with the GIL released.

Two entry points run the fused kernel:

* ``tx.update(updates, state, params)`` — functional, like optax: the state
  is copied first, updates are written to new Arrays, nothing is donated.
* ``TrainState.apply_gradients`` — in place: params and optimizer state are
  updated in their buffers and the old state's Arrays are marked donated. Arrays
  the caller still holds (the params given to ``TrainState.create``, see
  :func:`mark_borrowed`) are copied first instead (copy on write), and a step
  claims its buffers before the kernel (:func:`_claim`), so the same state is
  never stepped twice at once.

The kernel computes in float32. bfloat16 / float16 params, grads, updates and state are
loaded and stored by the kernel in their own dtypes: each is widened to float32 in
registers, and what the step writes is rounded once to the array's dtype (optax's
``mu_dtype`` state, 16-bit params updated as ``(p + u).astype(p.dtype)``).
"""
from .._src.optim.base import *  # noqa: F401,F403
from .._src.optim.base import __all__  # noqa: F401
# names the module had outside __all__, kept importable
from .._src.optim.base import (ACCUM, ADAM, ADAMAX, AMSGRAD, BELIEF, BLOCK_RMS, CLIP, CONST, DECAY,
                               EMA, FACTORED, FINITE_GATE, FastPlan, FuseContext, GLOBAL_NORM, LION,
                               NSLOTS, PARAM_RMS, Plan, RMS, RSS, SCALE, STDDEV, Stage, TRACE,
                               TRUST_RATIO, YOGI, ZERO, call_update, check_grads, copy_array,
                               full_like, is_borrowed, mark_borrowed, read_scalar, rewrap,
                               run_fused, scalar, to_array, zeros_like)  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
