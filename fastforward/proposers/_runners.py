"""The decode-time runner of a trained drafter, shared by every sequence that uses the same drafter folder (its
weights are read and packed once): the shipped drafter for the target unless a folder is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..drafters import shipped_drafter
from ..errors import UsageError

_RUNNERS: dict = {}  # (method, drafter folder, weights, id(target)) -> runner


def shared_runner(method: str, kind: str, target, drafter: str | None, weights: str, build: Callable[[Path], object]):
    """``build(folder)`` once per (method, folder, weights, target): ``folder`` is ``drafter`` or the shipped drafter
    of ``kind`` for ``target`` (one-line refusals when there is none or the folder does not exist)."""
    if drafter is None:
        folder = shipped_drafter(target, kind)
        if folder is None:
            raise UsageError(f"{method}: no drafter ships for '{target.name}'; train one (fastforward train {method}) "
                             "and pass -o drafter=FOLDER")
    else:
        folder = Path(str(drafter)).expanduser()
        if not folder.is_dir():
            raise UsageError(f"{method}: drafter folder not found: {folder}")
    key = (method, str(folder.resolve()), weights, id(target))
    if key not in _RUNNERS:
        _RUNNERS[key] = build(folder)
    return _RUNNERS[key]
