"""The decode-time runner of a trained drafter, shared by every sequence that uses the same drafter folder (its
weights are read and packed once): the shipped drafter for the target unless a folder is given. Runners are kept in
the target's resource slots (:mod:`fastforward.model.slots`): they live as long as the target, and a new target never
gets an old one's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..drafters import shipped_drafter
from ..errors import UsageError


def drafter_folder(method: str, kind: str, target, drafter: str | None) -> Path:
    """``drafter`` as a folder, or the shipped drafter of ``kind`` for ``target`` (one-line refusals when there is
    none or the folder does not exist)."""
    if drafter is None:
        folder = shipped_drafter(target, kind)
        if folder is None:
            raise UsageError(f"{method}: no drafter ships for '{target.name}'; train one (fastforward train {method}) "
                             "and pass -o drafter=FOLDER")
        return folder
    folder = Path(str(drafter)).expanduser()
    if not folder.is_dir():
        raise UsageError(f"{method}: drafter folder not found: {folder}")
    return folder


def shared_runner(method: str, kind: str, target, drafter: str | None, weights: str, build: Callable[[Path], object]):
    """``build(folder)`` once per (method, folder, weights) and target (see :func:`drafter_folder`)."""
    folder = drafter_folder(method, kind, target, drafter)
    return target.shared(("drafter runner", method, str(folder.resolve()), weights), lambda: build(folder))


def load_runner(method: str, kind: str, target, drafter: str | None, weights: str, load, runner_class):
    """The target's shared ``runner_class`` over the drafter ``load(folder, target)`` reads (see
    :func:`shared_runner`)."""
    return shared_runner(method, kind, target, drafter, weights,
                         lambda folder: runner_class(load(folder, target), target, capacity=64, weights=weights))
