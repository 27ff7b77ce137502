"""``results.jsonl``: one row per (question, method label, repeat), appended as each finishes.

Appends are one ``write`` of a whole line followed by ``fsync``, so a killed run leaves at most one partial last
line; :func:`repair` cuts it off before the next run appends. Rows are keyed by :func:`row_key`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import UsageError

RESULTS = "results.jsonl"


def row_key(row: dict) -> tuple[str, str, int]:
    return str(row["question_id"]), str(row["label"]), int(row["repeat"])


def read_rows(path: Path, warn: bool = True) -> list[dict]:
    """The rows of a results file; a partial last line (a run killed mid-write) and broken lines are skipped.
    A key that appears twice keeps its last row."""
    if not path.is_file():
        return []
    rows: dict[tuple, dict] = {}
    broken = 0
    with open(path, encoding="utf-8", errors="replace") as f:  # bytes that are not UTF-8: replaced, never a crash
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows[row_key(row)] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                broken += 1
    if broken and warn:
        print(f"fastforward bench: skipped {broken} unreadable line(s) in {path}", file=sys.stderr)
    return list(rows.values())


def repair(path: Path) -> None:
    """Cut a partial last line (no trailing newline) left by a run killed while writing."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        f.truncate(cut)


def rewrite(path: Path, rows: list[dict]) -> None:
    """Replace the file's content atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ResultsWriter:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        repair(path)

    def append(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def is_bench_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a benchmark's output (a results file with rows, or a --batch result): the test for
    folders written before output folders were marked (:func:`fastforward.paths.check_output_dir`)."""
    try:
        if read_rows(Path(folder) / RESULTS, warn=False):
            return True
    except OSError:
        return False
    try:
        batch = json.loads((Path(folder) / "batch.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(batch, dict) and {"meta", "rows"} <= set(batch)


def require_results(out_dir: Path) -> list[dict]:
    path = out_dir / RESULTS
    if not path.exists():
        raise UsageError(f"{path} does not exist; run the benchmark first")
    rows = read_rows(path)
    if not rows:
        raise UsageError(f"{path} holds no results")
    return rows
