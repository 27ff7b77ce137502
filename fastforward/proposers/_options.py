"""Validation of method options (they arrive from Python callers and from the CLI's ``-o key=value``)."""

from __future__ import annotations

from ..errors import UsageError


def check_int(method: str, name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``, else a one-line :class:`UsageError`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UsageError(f"{method}: option {name} must be an integer {bound}, got {value!r}")
    return value


def check_bool(method: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{method}: option {name} must be True or False, got {value!r}")
    return value


def check_choice(method: str, name: str, value, choices) -> str:
    if value not in choices:
        raise UsageError(f"{method}: option {name} must be one of {', '.join(choices)}, got {value!r}")
    return value
