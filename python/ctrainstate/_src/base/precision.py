"""Matrix-product precision: ``lax.Precision``, the ``precision=`` argument of matmul / dot /
einsum / ``nn.Dense``, and ``default_matmul_precision``.

A float32 product runs in one of three modes (the backend's ``CT_PREC_*`` codes):

======================  ==========================================================  ======
mode                    what is multiplied                                          code
======================  ==========================================================  ======
``'float32'``           the float32 operands as they are                            0
``'tensorfloat32'``     each operand element rounded to TF32 (10 mantissa bits,     1
                        float32's exponent range), float32 accumulation
``'bfloat16'``          each operand element rounded to bfloat16 (7 mantissa        2
                        bits), float32 accumulation
======================  ==========================================================  ======

Rounding is to nearest, ties to even (a NaN stays a NaN, inf stays inf, a finite value past
the largest representable one becomes inf). On CPU devices the rounding is emulated exactly
and the product runs on the float32 kernel; on GPUs cuBLAS runs it on tensor cores
(``CUBLAS_COMPUTE_32F_FAST_TF32`` / ``_FAST_16BF``), whose conversion of the inputs is not
documented, so GPU results agree with the CPU ones to the precision's rounding error, not bit
for bit.

How a ``precision=`` value maps onto a mode:

==========================================================  =========================
``precision=``                                              mode
==========================================================  =========================
``None``                                                    the thread's default (below)
``Precision.DEFAULT``, ``'default'``, ``'fastest'``         ``'float32'``
``Precision.HIGH``, ``'high'``, ``'tensorfloat32'``,        ``'tensorfloat32'``
``'bfloat16_3x'``
``Precision.HIGHEST``, ``'highest'``, ``'float32'``         ``'float32'``
``'bfloat16'``                                              ``'bfloat16'``
``'F32_F32_F32'``, ``'TF32_TF32_F32'``, ``'BF16_BF16_F32'``  float32, TF32, bfloat16
``(lhs, rhs)`` pair of the above                            their mode, when both agree
==========================================================  =========================

The thread's default is ``'float32'`` unless a ``with default_matmul_precision(name):`` block
says otherwise; as in jax, it applies to ``precision=None`` only, an explicit precision wins.

Differences from jax, on purpose:

* ``Precision.DEFAULT`` (and ``None`` outside a ``default_matmul_precision`` block) is full
  float32 on every backend, so results do not change with the device. jax's DEFAULT lets a
  GPU use TF32 (on A100/H100 its float32 matmuls are TF32 unless asked otherwise) and a TPU
  use one bfloat16 pass. Ask for ``'tensorfloat32'`` / ``HIGH`` to get TF32 here.
* The *string* ``'bfloat16'`` asks for bfloat16 inputs; in jax it is an alias of DEFAULT
  (which no GPU runs in bfloat16). ``Precision('bfloat16')`` is still ``Precision.DEFAULT``,
  as in jax: the enum cannot tell the two apart, so pass the string.
* ``Precision.HIGH`` is TF32 (jax on GPU: TF32 as well; on TPU: three bfloat16 passes).
* A pair whose two entries give different modes raises ``ValueError`` (both operands of a
  product are rounded the same way); jax's CPU ignores the precision altogether.

>>> import numpy as np, ctrainstate as cts, ctrainstate.numpy as cnp
>>> x = np.array([[1 + 2.0 ** -12]], np.float32)                # not a TF32 number
>>> one = np.ones((1, 1), np.float32)
>>> np.asarray(cnp.matmul(x, one)).tolist()
[[1.000244140625]]
>>> np.asarray(cnp.matmul(x, one, precision='tensorfloat32')).tolist()
[[1.0]]
>>> with cts.default_matmul_precision('tensorfloat32'):
...     np.asarray(cts.device_put(x) @ one).tolist()
[[1.0]]
"""
from __future__ import annotations

import contextlib
import enum

from ... import _C
from .threadlocal import NotifyingLocal

__all__ = ["Precision", "default_matmul_precision", "resolve_precision"]

F32, TF32, BF16 = (_C.op_codes["precision"][n] for n in ("F32", "TF32", "BF16"))  # CT_PREC_*
_MODE_NAMES = {F32: "float32", TF32: "tensorfloat32", BF16: "bfloat16"}


class Precision(enum.Enum):
    """``jax.lax.Precision``: DEFAULT, HIGH, HIGHEST (string aliases as in jax).

    In ctrainstate DEFAULT and HIGHEST are float32 and HIGH is TF32 (see
    :mod:`ctrainstate._src.base.precision` for the table and how it differs from jax).

    >>> from ctrainstate.lax import Precision
    >>> Precision('tensorfloat32'), Precision.HIGHEST
    (Precision.HIGH, Precision.HIGHEST)
    """

    DEFAULT = 0
    HIGH = 1
    HIGHEST = 2

    @classmethod
    def _missing_(cls, value):
        return _PRECISION_STRINGS.get(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __str__(self) -> str:
        return self.name


# jax's aliases (jax._src.lax.lax._precision_strings)
_PRECISION_STRINGS = {
    "highest": Precision.HIGHEST, "float32": Precision.HIGHEST,
    "high": Precision.HIGH, "bfloat16_3x": Precision.HIGH, "tensorfloat32": Precision.HIGH,
    "default": Precision.DEFAULT, "bfloat16": Precision.DEFAULT, "fastest": Precision.DEFAULT,
}

_ENUM_MODE = {Precision.DEFAULT: F32, Precision.HIGH: TF32, Precision.HIGHEST: F32}

# strings, checked before the enum aliases: 'bfloat16' is bfloat16 here, not DEFAULT
_STRING_MODE = {
    "default": F32, "fastest": F32, "highest": F32, "float32": F32,
    "high": TF32, "tensorfloat32": TF32, "bfloat16_3x": TF32,
    "bfloat16": BF16,
    # jax.lax.DotAlgorithmPreset names with a matching mode
    "F32_F32_F32": F32, "TF32_TF32_F32": TF32, "BF16_BF16_F32": BF16,
}

_ACCEPTED = ("None, ctrainstate.lax.Precision.DEFAULT / HIGH / HIGHEST, one of the strings "
             + ", ".join(repr(s) for s in _STRING_MODE)
             + ", or a pair (lhs, rhs) of these that give the same mode")

class _PrecisionLocal(NotifyingLocal):
    """This thread's ``default`` mode code (None: follow the process default ``process``, a
    class attribute, set by :func:`set_process_default`). Both are attributes so that the C
    dispatcher (py_dispatch.c) reads the effective mode without running Python."""

    default = None
    process = F32


_tls = _PrecisionLocal()


def _one(p, what):
    if isinstance(p, str):
        mode = _STRING_MODE.get(p)
        if mode is None:
            raise ValueError(f"{what}: unknown precision {p!r}; accepted: {_ACCEPTED}")
        return mode
    if isinstance(p, Precision):
        return _ENUM_MODE[p]
    if isinstance(p, enum.Enum):
        # jax's own lax.Precision / lax.DotAlgorithmPreset, by name (a ported script may still
        # pass jax.lax.Precision.HIGHEST)
        cls = type(p).__name__
        if cls == "Precision" and p.name in Precision.__members__:
            return _ENUM_MODE[Precision[p.name]]
        if cls == "DotAlgorithmPreset" and p.name in _STRING_MODE:
            return _STRING_MODE[p.name]
    raise ValueError(f"{what}: unsupported precision {p!r}; accepted: {_ACCEPTED}")


def resolve_precision(precision, what: str = "precision") -> int:
    """The mode code (0 float32, 1 TF32, 2 bfloat16) of a ``precision=`` value, resolved now
    (``None``: the calling thread's default). Raises ``ValueError`` naming the accepted values.

    >>> resolve_precision('tensorfloat32'), resolve_precision(Precision.HIGHEST)
    (1, 0)
    """
    if precision is None:
        return current_default()
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2:
            raise ValueError(f"{what}: a precision pair has two entries (lhs, rhs), got "
                             f"{precision!r}; accepted: {_ACCEPTED}")
        ml, mr = (_one(p, what) if p is not None else resolve_precision(None)
                  for p in precision)
        if ml != mr:
            raise ValueError(
                f"{what}: the pair {precision!r} asks for {_MODE_NAMES[ml]} on the lhs and "
                f"{_MODE_NAMES[mr]} on the rhs; ctrainstate rounds both operands of a product "
                f"the same way: pass one precision")
        return ml
    return _one(precision, what)


def mode_name(code: int) -> str:
    """'float32', 'tensorfloat32' or 'bfloat16'."""
    return _MODE_NAMES[code]


# The process-wide default (``config.update("jax_default_matmul_precision", ...)``), under
# every thread's ``default_matmul_precision`` blocks: _PrecisionLocal.process.


def current_default() -> int:
    """The calling thread's default mode code (what ``precision=None`` resolves to now)."""
    d = _tls.default
    return _PrecisionLocal.process if d is None else d


def set_process_default(name) -> None:
    """The process-wide default for ``precision=None`` (``None``: float32), as jax's
    ``jax_default_matmul_precision`` option; ``default_matmul_precision`` blocks override it."""
    _PrecisionLocal.process = F32 if name is None else _one(name, "jax_default_matmul_precision")


def process_default_name():
    """The name set by :func:`set_process_default` (None for float32, the default)."""
    p = _PrecisionLocal.process
    return None if p == F32 else _MODE_NAMES[p]


@contextlib.contextmanager
def default_mode(code: int):
    """Internal: run a block with the thread's default mode set to ``code`` (a checkpointed
    function run again for the backward pass gets the default its first run had)."""
    prev = _tls.__dict__.get("default")    # None: the thread follows the process default
    _tls.default = code
    try:
        yield
    finally:
        if prev is None:
            if "default" in _tls.__dict__:   # (deleted as an attribute: see threadlocal)
                del _tls.default
        else:
            _tls.default = prev


@contextlib.contextmanager
def default_matmul_precision(name):
    """``jax.default_matmul_precision``: inside the block, matrix products of this thread
    called with ``precision=None`` (``@``, ``cnp.matmul`` / ``dot`` / ``einsum``,
    ``nn.Dense`` without ``precision=``) use ``name``'s mode: ``'float32'`` / ``'highest'``,
    ``'tensorfloat32'`` / ``'high'``, ``'bfloat16'``, ``'default'`` (float32 here), or a
    matching ``DotAlgorithmPreset`` name; ``None`` restores float32. Thread-local; blocks nest.
    A product's gradient uses the precision its forward pass was called with, wherever the
    backward pass runs, and a ``checkpoint``-ed function run again for the backward pass
    gets the default its first run had.

    >>> import numpy as np, ctrainstate as cts
    >>> x = np.array([[1 + 2.0 ** -9]], np.float32)
    >>> with cts.default_matmul_precision('bfloat16'):
    ...     np.asarray(cts.device_put(x) @ np.ones((1, 1), np.float32)).tolist()
    [[1.0]]
    """
    if name is None:
        mode = F32
    elif isinstance(name, (str, Precision)):
        mode = _one(name, "default_matmul_precision")
    else:
        raise ValueError(f"default_matmul_precision: expected None or a precision name, got "
                         f"{name!r}; accepted: {_ACCEPTED}")
    with default_mode(mode):
        yield
