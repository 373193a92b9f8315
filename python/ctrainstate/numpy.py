"""``ctrainstate.numpy``: array ops on (sharded) Arrays, differentiable.

The names follow ``jax.numpy``. Operands may be Arrays, numpy arrays or Python
scalars (placed replicated on the Arrays' mesh). Sharding propagation, the
collectives it implies and the autodiff rules are described in
:mod:`ctrainstate._ops`. Arithmetic is float32.

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> x = cts.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))
>>> np.asarray(cnp.sum(x * 2.0, axis=0)).tolist()
[6.0, 10.0, 14.0]
"""
from ._ops import (  # noqa: F401
    abs,
    add,
    broadcast_to,
    cos,
    divide,
    dot,
    einsum,
    exp,
    expand_dims,
    gelu,
    log,
    matmul,
    maximum,
    mean,
    multiply,
    negative,
    ones_like,
    power,
    relu,
    reshape,
    rsqrt,
    sigmoid,
    sin,
    sqrt,
    square,
    subtract,
    sum,
    tanh,
    transpose,
    with_sharding,
    zeros_like,
)


def var(x, axis=None, keepdims: bool = False):
    """Variance (population, like ``jnp.var``)."""
    m = mean(x, axis=axis, keepdims=True)
    return mean(square(subtract(x, m)), axis=axis, keepdims=keepdims)


__all__ = [
    "abs", "add", "broadcast_to", "cos", "divide", "dot", "einsum", "exp", "expand_dims", "gelu",
    "log", "matmul", "maximum", "mean", "multiply", "negative", "ones_like", "power", "relu",
    "reshape", "rsqrt", "sigmoid", "sin", "sqrt", "square", "subtract", "sum", "tanh",
    "transpose", "var", "with_sharding", "zeros_like",
]
