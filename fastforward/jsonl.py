"""JSON Lines files: the one reader of the record files the commands write and read back (make-data's responses,
PASTA's annotations and samples), with the file's own line numbers in its one-line errors and the torn last line of
a killed writer forgiven."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UsageError


def jsonl_records(path, *, repair: bool = False) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of the JSONL file ``path``: the one reader of the record files
    fastforward writes. Bytes that are not UTF-8, or a line that is not a JSON object, are a one-line
    :class:`UsageError` naming the file and line -- except a last line without its newline that does not parse (a
    writer killed mid-line), skipped when lines before it parsed, and with ``repair`` cut off the file, so that
    appending resumes cleanly."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    end = raw.rfind(b"\n") + 1
    records = [(n, _json_object(path, n, line)) for n, line in enumerate(raw[:end].split(b"\n"), 1)
               if line.strip()]
    tail, n = raw[end:], raw.count(b"\n", 0, end) + 1
    if tail.strip():
        try:
            records.append((n, _json_object(path, n, tail)))
        except UsageError:
            if not records:  # nothing before it parsed: not a torn file, a wrong one
                raise
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(end)
            return records
    if tail and repair:  # a complete last record without its newline: end the line before appending after it
        with open(path, "ab") as f:
            f.write(b"\n")
    return records


def _json_object(path: Path, line_number: int, line: bytes) -> dict:
    where = f"{path}:{line_number}"
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where} is not UTF-8 text (byte {exc.start} of the line)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where} is not a JSON record ({exc.msg})") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where} is not a JSON object")
    return record
