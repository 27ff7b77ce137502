"""Instruction/response data shared by every training method and by ``fastforward eval --task nll``.

Records are read by path (a comma-separated list of files is allowed) in these formats:

* Alpaca style (``.json`` array or ``.jsonl``): ``instruction`` [+ ``input``] -> ``output``
* GSM8K (``.jsonl``): ``question`` -> ``answer`` (the ``<<48/2=24>>`` calculator annotations are removed; the final
  ``#### N`` line is kept, so a trained model ends its answers the way the GSM8K scorer reads them)
* generic: ``prompt`` -> ``response`` (or ``completion``)

``.gz`` files are read transparently. Each record becomes one chat turn (user = instruction [+ "\\n\\n" + input],
assistant = response) formatted with the model's chat template; the loss covers the response tokens only.

The held-out split is a pure function of a record's text (a hash), not of a seed, the file order or ``--limit``:
the same record is held out whichever files it is mixed with, duplicated records land on the same side, and
``fastforward eval --task nll --data F`` scores exactly the records ``fastforward train ... --data F`` never saw
(given the same ``--heldout`` fraction).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..paths import data_root  # noqa: F401  (re-exported for older imports)

DEFAULT_HELDOUT = 0.05

_CALC_ANNOTATION = re.compile(r"<<[^<>]*>>")


@dataclass(frozen=True)
class Example:
    """One instruction/response pair (text), with the file it came from."""

    prompt: str
    response: str
    source: str = ""

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.prompt}\x00{self.response}".encode()).hexdigest()


@dataclass
class Encoded:
    """A tokenized example: ``input_ids`` = prompt tokens then response tokens; the loss covers
    ``input_ids[prompt_len:]``."""

    input_ids: list[int]
    prompt_len: int

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


# ------------------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------------------


def parse_paths(spec) -> list[Path]:
    """``"a.json,b.jsonl"`` (or a list) -> existing paths; a missing file is a one-line :class:`UsageError`."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or [])
    paths = [Path(str(s).strip()).expanduser() for s in items if str(s).strip()]
    if not paths:
        raise UsageError("no data file given")
    for p in paths:
        if not p.is_file():
            raise UsageError(f"data file not found: {p}")
    return paths


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _jsonl_records(path: Path, f) -> list[tuple[str, object]]:
    records = []
    for n, line in enumerate(f, 1):
        if line.strip():
            try:
                records.append((f"{path} line {n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                why = f"{exc.msg}, column {exc.colno}"
                raise UsageError(f"cannot read {path} line {n}: not valid JSON ({why})") from None
    return records


def located_records(path: Path) -> list[tuple[str, object]]:
    """The raw records of one data file, each with where it is (``"f.jsonl line 3"``, ``"f.json record 2"``) for
    the messages about it; an unreadable file or a line that is not JSON is a one-line :class:`UsageError`."""
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    try:
        with _open_text(path) as f:
            if name.endswith(".jsonl"):
                return _jsonl_records(path, f)
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    if isinstance(data, dict):  # {"data": [...]} or similar: the first list value
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise UsageError(f"{path}: expected a JSON array of records (or a .jsonl file)")
    return [(f"{path} record {n}", rec) for n, rec in enumerate(data, 1)]


def _json_type(value) -> str:
    """What a JSON value is, in JSON's words (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def text_field(rec: dict, key: str, where: str, *, optional: bool = False) -> str:
    """``rec[key]`` as text: a string, else a one-line :class:`UsageError` naming ``where`` (an ``optional`` field
    may also be absent or null: then "")."""
    value = rec.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise UsageError(f"{where}: field '{key}' must be a string, got {_json_type(value)}")
    return value


def to_example(rec: dict, source: str = "", where: str = "") -> Example | None:
    """One raw record -> :class:`Example` (``None`` if it has the right keys but an empty side); ``where`` (default
    ``source``) names the record in messages."""
    where = where or source
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: records must be JSON objects")
    if "instruction" in rec and "output" in rec:
        prompt = text_field(rec, "instruction", where).strip()
        extra = text_field(rec, "input", where, optional=True).strip()
        if extra:
            prompt = f"{prompt}\n\n{extra}"
        response = text_field(rec, "output", where)
    elif "question" in rec and "answer" in rec:
        prompt = text_field(rec, "question", where).strip()
        response = _CALC_ANNOTATION.sub("", text_field(rec, "answer", where))
    elif "prompt" in rec and ("response" in rec or "completion" in rec):
        prompt = text_field(rec, "prompt", where).strip()
        response = text_field(rec, "response" if "response" in rec else "completion", where)
    else:
        raise UsageError(
            f"{where}: unsupported record with keys {sorted(rec)[:8]}; expected instruction/input/output, "
            "question/answer or prompt/response"
        )
    response = response.strip()
    if not prompt or not response:
        return None
    return Example(prompt, response, source)


def read_examples(spec) -> list[Example]:
    """All usable records of the files in ``spec`` (comma-separated string or list), in file order."""
    examples = []
    for path in parse_paths(spec):
        for where, rec in located_records(path):
            ex = to_example(rec, path.name, where)
            if ex is not None:
                examples.append(ex)
    if not examples:
        raise UsageError(f"no usable records in {spec}")
    return examples


# ------------------------------------------------------------------------------------------------------------------
# Splitting and subsampling
# ------------------------------------------------------------------------------------------------------------------


def check_heldout(fraction: float) -> float:
    if not 0.0 <= fraction < 1.0:
        raise UsageError(f"--heldout must be in [0, 1), got {fraction}")
    return fraction


def is_heldout(ex: Example, fraction: float) -> bool:
    """Whether ``ex`` belongs to the held-out split (a fixed hash of its text, so independent of any seed)."""
    return int(ex.key[:16], 16) / 2**64 < fraction


def split_examples(examples: list[Example], heldout: float = DEFAULT_HELDOUT) -> tuple[list[Example], list[Example]]:
    """(train, held-out), both in their original order."""
    check_heldout(heldout)
    train, held = [], []
    for ex in examples:
        (held if is_heldout(ex, heldout) else train).append(ex)
    return train, held


def subsample(examples: list, limit: int | None, seed: int) -> list:
    """A seeded random subset of ``limit`` items (all when ``limit`` is None or larger), in the original order."""
    if limit is None or limit >= len(examples):
        return list(examples)
    if limit <= 0:
        raise UsageError(f"--limit must be a positive integer, got {limit}")
    keep = sorted(random.Random(seed).sample(range(len(examples)), limit))
    return [examples[i] for i in keep]


# ------------------------------------------------------------------------------------------------------------------
# Tokenizing
# ------------------------------------------------------------------------------------------------------------------


def _eos_id(tokenizer) -> int | None:
    return getattr(tokenizer, "eos_token_id", None)


def prompt_and_response_ids(tokenizer, ex: Example, system: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the prompt exactly as :meth:`fastforward.TargetModel.encode` builds it at inference (chat
    template + generation prompt), and of the response as the template continues it, up to and including EOS."""
    eos = _eos_id(tokenizer)
    if getattr(tokenizer, "chat_template", None):
        user = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ex.prompt}]
        prompt_text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": ex.response}], tokenize=False
        )
        if full_text.startswith(prompt_text):
            response_text = full_text[len(prompt_text):]
        else:  # a template that rewrites earlier turns: fall back to the plain response
            response_text = ex.response
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(ex.prompt + "\n", add_special_tokens=True)["input_ids"]
        response_text = ex.response
    response_ids = list(tokenizer(response_text, add_special_tokens=False)["input_ids"])
    if eos is not None:
        if eos in response_ids:  # drop what the template puts after the turn's end (usually a newline)
            last = len(response_ids) - 1 - response_ids[::-1].index(eos)
            response_ids = response_ids[: last + 1]
        else:
            response_ids.append(eos)
    return list(prompt_ids), response_ids


def encode_example(tokenizer, ex: Example, max_length: int, system: str | None = None) -> Encoded | None:
    """Prompt + response ids truncated to ``max_length`` tokens; ``None`` when no response token fits."""
    prompt_ids, response_ids = prompt_and_response_ids(tokenizer, ex, system)
    ids = (prompt_ids + response_ids)[:max_length]
    if len(prompt_ids) >= len(ids):
        return None
    return Encoded(ids, len(prompt_ids))


def encode_examples(tokenizer, examples: list[Example], max_length: int) -> tuple[list[Encoded], int]:
    """(encoded examples, number dropped because the prompt alone fills ``max_length``)."""
    if max_length < 2:
        raise UsageError(f"--max-length must be at least 2, got {max_length}")
    out, dropped = [], 0
    for ex in examples:
        enc = encode_example(tokenizer, ex, max_length)
        if enc is None:
            dropped += 1
        else:
            out.append(enc)
    return out, dropped
