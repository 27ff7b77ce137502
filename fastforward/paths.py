"""Where fastforward keeps and finds files: the cache, the shared data sets, and checks on output paths.

Every other module asks here; none builds these paths itself.

* ``cache_root()`` -- ``$FASTFORWARD_CACHE``, default ``~/.cache/fastforward``: built kernels, GGUF indexes and
  converted folders, tokenizers, measured cost curves, installed trees.
* ``data_root()`` -- ``$FASTFORWARD_DATA``, else a ``shared/data`` folder beside the source checkout (editable
  installs) or beside/above the working directory.
* ``check_output_dir`` / ``check_output_file`` -- every command's output path, checked before any work: a folder must
  be absent, empty, or marked (:data:`RUN_MARKER`) as written by the same command; an existing file must be a regular
  file the same command wrote (:func:`owned_json`, :func:`owned_jsonl`: they read a bounded prefix, never a whole
  file); everything must be writable.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
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


def made_data_dir(model_name: str) -> Path:
    """Where ``fastforward make-data`` writes a model's responses by default (and where ``rest`` looks for them)."""
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(str(model_name)).name)
    return cache_root() / "data" / slug


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


# ------------------------------------------------------------------------------------------------------------------
# Output paths: every command checks its output folder or file here, before any work
# ------------------------------------------------------------------------------------------------------------------

RUN_MARKER = ".fastforward-run.json"  # written first into every output folder a command creates or adopts


def check_writable(path, flag: str) -> None:
    """A one-line :class:`UsageError` now, not after the work, when ``path`` (a folder or file about to be written)
    cannot be written: a temporary file is created and removed in ``path`` (an existing folder) or else in the
    nearest folder above it that exists (creating folders below a writable one succeeds)."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is not a folder")
    try:
        if path.is_file() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
        fd, probe = tempfile.mkstemp(prefix=".fastforward-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {folder} ({exc.strerror or exc})") from None


def read_marker(folder) -> dict | None:
    """The marker of an output folder (``{"command": ...}``), ``None`` without one, ``{}`` when unreadable."""
    marker = Path(folder) / RUN_MARKER
    if not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def check_output_dir(path, command: str, *, owned: Callable[[Path], bool] | None = None,
                     flag: str = "--out") -> Path:
    """The output folder of ``fastforward COMMAND``, checked before any work: it must be absent, empty, or one this
    command wrote before -- recognised by its :data:`RUN_MARKER` naming ``command``, or by ``owned(folder)`` for a
    folder written before markers existed -- and writable. Creates nothing; returns the expanded path."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out} exists and is not a folder")
    if out.is_dir():
        marker = read_marker(out)
        if marker is not None and marker.get("command") != command:
            other = f"'fastforward {marker['command']}'" if marker.get("command") else "another command"
            raise UsageError(f"{flag} {out} holds the output of {other}; give another folder")
        if marker is None and any(out.iterdir()) and not (owned is not None and owned(out)):
            raise UsageError(f"{flag} {out} holds files 'fastforward {command}' did not write; give a new or empty "
                             "folder (nothing in it was changed)")
    check_writable(out, flag)
    return out


def mark_output_dir(path, command: str) -> Path:
    """Create the output folder (checked by :func:`check_output_dir`) and write its marker, once; returns it."""
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_MARKER
    if read_marker(out) is None:
        tmp = out / f"{RUN_MARKER}.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        os.replace(tmp, marker)
    return out


def check_output_file(path, flag: str, *, owned: Callable[[Path], bool] | None = None) -> Path:
    """An output file, checked before any work: not a folder, in an existing writable folder, and -- when it
    exists and ``owned`` is given -- a file this command wrote before (``owned(file)``). Returns the expanded path."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UsageError(f"{flag} {file} is a folder; give a file name")
    if not file.parent.is_dir():
        what = "is not a folder" if file.parent.exists() else "does not exist"
        raise UsageError(f"{flag}: the folder {file.parent} {what}")
    if file.exists() and not file.is_file():  # a device, a FIFO, a socket (/dev/full, /dev/stdout on a terminal)
        raise UsageError(f"{flag} {file} exists and is not a regular file (a device, pipe or socket); "
                         "give a file name")
    if file.exists() and owned is not None and not owned(file):
        raise UsageError(f"{flag} {file} exists and was not written by fastforward; remove it or give another name")
    check_writable(file, flag)
    return file


# ------------------------------------------------------------------------------------------------------------------
# Ownership checks: whether an existing output file is one a command wrote, from a bounded prefix of it
# ------------------------------------------------------------------------------------------------------------------

OWNED_CHECK_BYTES = 64 * 1024  # an ownership check reads at most this much of a file (plus one byte)


def file_head(path, limit: int = OWNED_CHECK_BYTES) -> tuple[bytes, bool] | None:
    """The first ``limit`` bytes of the regular file ``path`` and whether they are the whole file; ``None`` when it is
    not a regular file or cannot be read. Reads at most ``limit + 1`` bytes and never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data[:limit], len(data) <= limit


def owned_json(path, check: Callable[[object], bool], first_key: str) -> bool:
    """Whether ``path`` holds the JSON a command wrote: parsed and ``check``-ed when the whole file is at most
    :data:`OWNED_CHECK_BYTES`; a longer file is recognised by how the command starts it -- an object whose first key
    is ``first_key`` -- without reading the rest."""
    head = file_head(path)
    if head is None:
        return False
    data, whole = head
    if not whole:
        return re.match(rb'\s*\{\s*"' + re.escape(first_key.encode()) + rb'"\s*:', data) is not None
    try:
        return bool(check(json.loads(data)))
    except (ValueError, RecursionError):  # not UTF-8, not JSON
        return False


def owned_jsonl(path, check: Callable[[dict], bool]) -> bool:
    """Whether ``path`` holds JSONL records a command wrote: every line in its first :data:`OWNED_CHECK_BYTES` a JSON
    object passing ``check`` (an empty file passes). A last line without its newline is judged only when it parses
    (a writer killed mid-line leaves one) or is all there is; a file longer than the prefix needs a whole line in it."""
    head = file_head(path)
    if head is None:
        return False
    data, whole = head
    *lines, tail = data.split(b"\n")  # the tail: a line cut by the limit, or torn by a writer killed mid-line
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except (ValueError, RecursionError):
        return False
    if whole and tail.strip():
        try:
            records.append(json.loads(tail))
        except (ValueError, RecursionError):
            if not records:  # nothing parsed at all: not a torn file, a wrong one
                return False
    if not whole and not records:
        return False
    return all(isinstance(record, dict) and check(record) for record in records)
