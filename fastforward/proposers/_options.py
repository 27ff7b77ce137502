"""Method options: parsed from ``KEY=VALUE`` strings (the CLI's ``-o``, the benchmark's method specs) and validated
(they also arrive from Python callers)."""

from __future__ import annotations

import ast

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


def parse_options(pairs: list[str] | None) -> dict:
    """Method options from ``KEY=VALUE`` strings (the CLI's ``-o``, the benchmark's method specs):
    ``["k=3", "tree=path.json"]`` -> ``{"k": 3, "tree": "path.json"}``. Values are Python literals when they parse
    as one, else strings; ``-`` in a key becomes ``_``."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"method option '{pair}' is not KEY=VALUE")
        try:
            options[key.replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key.replace("-", "_")] = value
    return options
