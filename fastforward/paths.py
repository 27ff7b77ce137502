"""Where fastforward keeps and finds files: the cache, the shared data sets, and checks on output paths.

Every other module asks here; none builds these paths itself.

* ``cache_root()`` -- ``$FASTFORWARD_CACHE``, default ``~/.cache/fastforward``: built kernels, GGUF indexes and
  converted folders, tokenizers, measured cost curves, installed trees.
* ``data_root()`` -- ``$FASTFORWARD_DATA``, else a ``shared/data`` folder beside the source checkout (editable
  installs) or beside/above the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError

PACKAGE_DIR = Path(__file__).resolve().parent


def cache_root() -> Path:
    """The per-user cache folder (created on demand by whoever writes into it)."""
    return Path(os.environ.get("FASTFORWARD_CACHE") or Path.home() / ".cache" / "fastforward").expanduser()


def default_cache_root() -> Path:
    """The cache folder when ``$FASTFORWARD_CACHE`` is not set (a second place to look for built kernels)."""
    return Path.home() / ".cache" / "fastforward"


def costs_dir() -> Path:
    return cache_root() / "costs"


def trees_dir() -> Path:
    return cache_root() / "trees"


def kernels_dir() -> Path:
    return cache_root() / "kernels"


def _data_candidates() -> list[Path]:
    checkout = PACKAGE_DIR.parent  # the repository root for an editable install
    cwd = Path.cwd()
    return [checkout.parent / "shared" / "data", cwd / "shared" / "data", cwd.parent / "shared" / "data"]


def data_root(required: bool = False) -> Path:
    """Where the shared data sets live: ``$FASTFORWARD_DATA``, else the first ``shared/data`` folder found beside
    the checkout or the working directory. With ``required``, a missing folder is a one-line :class:`UsageError`."""
    env = os.environ.get("FASTFORWARD_DATA")
    if env:
        path = Path(env).expanduser()
        if required and not path.is_dir():
            raise UsageError(f"FASTFORWARD_DATA={env} is not a folder")
        return path
    candidates = _data_candidates()
    for path in candidates:
        if path.is_dir():
            return path
    if required:
        raise UsageError("no shared data folder found: set FASTFORWARD_DATA to the folder holding the data sets")
    return candidates[0]
