# Type stubs for the logical-axis-rules part of ctrainstate._C (csrc/python/py_rules.c).
# The lead merges these into _C.pyi.
from types import TracebackType
from typing import Any, Sequence

LogicalRules = Sequence[tuple[Any, Any]]

def get_axis_rules() -> Any:
    """This thread's rules exactly as set; () if never set."""

def set_axis_rules(rules: Any, /) -> None:
    """Store ``rules`` for this thread (no copy, no validation)."""

def resolve_logical_axes(names: Sequence[Any] | None, rules: LogicalRules | None = None,
                         unassigned: Any = None) -> list[Any] | None:
    """Resolve names to mesh values (Flax 0.12.3+); ``unassigned`` fills unmatched names."""

def _rules_set_unconstrained(obj: Any, /) -> None:
    """Register the PartitionSpec.UNCONSTRAINED singleton."""

class axis_rules:
    """Context manager installing thread-local rules; restores the previous ones on exit."""
    rules: Any
    def __init__(self, rules: Any) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool: ...
