"""Training data for drafters, made by the target itself (``fastforward make-data``).

FastEagle's recipe: drafters learn from the target's *own* greedy responses, not from a fixed dataset's answers, so
what they learn to predict is exactly what verification will accept. This module

* reads prompts from instruction/chat files (ShareGPT first turns, Alpaca-style, GSM8K; benchmark files refused),
  deduplicates them by text, interleaves the sources in a seeded order and marks a held-out split by a hash of the
  prompt (the same prompt is held out whatever it is mixed with);
* generates the target's greedy response to each with many sequences per forward
  (:func:`fastforward.api.generate_batch`), appending every finished record to ``OUT/responses.jsonl`` at once
  (flushed), so a run killed midway loses only the sequences still decoding; re-running the same command skips
  every prompt already in the file (a torn last line is dropped first) -- nothing lost, nothing duplicated;
* optionally (``features=True``) stores the target's features per token, bf16 safetensors in ``OUT/features/``
  (one file per record, written atomically), so several drafters train on one pass of the target
  (:mod:`fastforward.drafters.features` computes the same tensors on the fly when they are absent).

A record: ``{"key", "source", "split", "prompt", "prompt_ids", "response_ids", "finish_reason"}``; ``prompt_ids``
are exactly what inference feeds the target for that prompt (chat template + generation prompt), ``response_ids``
the target's greedy continuation (ending in EOS unless it hit ``max_new_tokens``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..paths import cache_root, check_output_dir, data_root, mark_output_dir
from .data import _raw_records, parse_paths

RESPONSES = "responses.jsonl"
FEATURES = "features"
MANIFEST = "make_data.json"
COMMAND = "make-data"

# The default prompt sources, relative to the shared data folder (never a benchmark's questions).
DEFAULT_SOURCES = (
    "sharegpt/ShareGPT_V3_filtered_1000.json",
    "alpaca/alpaca_en_demo.json",
    "codealpaca/code_alpaca_2k.json",
    "gsm8k/train.jsonl",
)
# Files whose prompts the benchmark or the evaluation uses: training on them would flatter every result.
BENCHMARK_FILES = ("question.jsonl", "test.jsonl", "HumanEval.jsonl.gz", "eagle_alpaca_question.jsonl")
DEFAULT_HELDOUT = 0.05
MAX_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.strip().encode()).hexdigest()[:24]

    def heldout(self, fraction: float) -> bool:
        return int(self.key[:12], 16) / 16**12 < fraction


def default_sources() -> list[Path]:
    root = data_root(required=True)
    return [root / s for s in DEFAULT_SOURCES]


def prompt_of(rec: dict, source: str) -> str | None:
    """The user prompt of one record: ShareGPT's first human turn, Alpaca's instruction (+ input), GSM8K's
    question, or a generic ``prompt``."""
    if not isinstance(rec, dict):
        raise UsageError(f"{source}: records must be JSON objects")
    if "conversations" in rec:
        turns = rec["conversations"] or []
        first = next((t for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
        return None if first is None else str(first.get("value", "")).strip() or None
    if "instruction" in rec:
        text = str(rec["instruction"]).strip()
        extra = str(rec.get("input") or "").strip()
        return (f"{text}\n\n{extra}" if extra else text) or None
    if "question" in rec:
        return str(rec["question"]).strip() or None
    if "prompt" in rec:
        return str(rec["prompt"]).strip() or None
    raise UsageError(f"{source}: unsupported record with keys {sorted(rec)[:8]}; expected conversations, "
                     "instruction, question or prompt")


def read_prompts(sources=None, *, seed: int = 0) -> list[Prompt]:
    """Deduplicated prompts of all sources, interleaved round-robin after a seeded shuffle of each (so any prefix of
    the list mixes every source in proportion)."""
    paths = default_sources() if sources is None else parse_paths(sources)
    for p in paths:
        if p.name in BENCHMARK_FILES:
            raise UsageError(f"{p} is a benchmark/evaluation file; drafters must not train on its prompts")
    per_source = []
    for p in paths:
        items = [t for t in (prompt_of(r, p.name) for r in _raw_records(p)) if t]
        random.Random(f"{seed}:{p.name}").shuffle(items)
        per_source.append([Prompt(t, p.name) for t in items])
    seen, out = set(), []
    for i in range(max((len(s) for s in per_source), default=0)):
        for items in per_source:
            if i < len(items) and items[i].key not in seen:
                seen.add(items[i].key)
                out.append(items[i])
    if not out:
        raise UsageError("no usable prompts in the data files")
    return out


def default_out(model_name: str) -> Path:
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(str(model_name)).name)
    return cache_root() / "data" / slug


def read_records(out: Path, repair: bool = False) -> list[dict]:
    """The records of ``out/responses.jsonl``; with ``repair``, a torn last line (a killed writer) is cut off."""
    path = Path(out) / RESPONSES
    if not path.exists():
        return []
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        if not repair:
            raw = raw[:end]
        else:
            with open(path, "r+b") as f:
                f.truncate(end)
            raw = raw[:end]
    records = []
    for n, line in enumerate(raw.decode().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise UsageError(f"{path}:{n} is not a JSON record; move the file away to start over") from None
    return records


def _check_manifest(out: Path, manifest: dict) -> None:
    path = out / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        for k in ("model", "max_new_tokens", "heldout", "method"):
            if old.get(k) != manifest.get(k):
                raise UsageError(f"{out} was made with {k}={old.get(k)!r}, not {manifest.get(k)!r}; use another --out "
                                 "or the same settings to resume")
    else:
        path.write_text(json.dumps(manifest, indent=2) + "\n")


def make_data(target, out, *, sources=None, limit: int | None = None, max_new_tokens: int = 256,
              heldout: float = DEFAULT_HELDOUT, seed: int = 0, max_active: int = 8, features: bool = False,
              method: str = "pld", log: Callable[[str], None] = print) -> dict:
    """Generate (or resume generating) the target's greedy responses into ``out``; returns a summary."""
    out = Path(out)
    check_output_dir(out, COMMAND)
    out.mkdir(parents=True, exist_ok=True)
    mark_output_dir(out, COMMAND)
    if not 0 <= heldout < 1:
        raise UsageError(f"--heldout must be in [0, 1), got {heldout}")
    prompts = read_prompts(sources, seed=seed)
    if limit is not None:
        prompts = prompts[:limit]
    _check_manifest(out, {"model": target.name, "max_new_tokens": max_new_tokens, "heldout": heldout,
                          "method": "greedy", "sources": [str(s) for s in (sources or DEFAULT_SOURCES)]})
    done = {r["key"] for r in read_records(out, repair=True)}
    todo = [p for p in prompts if p.key not in done]
    ids = {}
    for p in todo:
        pid = target.encode(p.text)
        if len(pid) <= MAX_PROMPT_TOKENS:
            ids[p.key] = pid
    todo = [p for p in todo if p.key in ids]
    log(f"make-data: {len(done)} records already in {out / RESPONSES}, {len(todo)} prompts to go")
    t0 = time.perf_counter()
    new_tokens = 0
    with open(out / RESPONSES, "a", encoding="utf-8") as f:
        chunk = max(1, max_active) * 8  # prompts per generate_batch call: bounded memory, steady progress lines

        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]

            def save(i, result, part=part):
                nonlocal new_tokens
                p = part[i]
                rec = {"key": p.key, "source": p.source, "split": "heldout" if p.heldout(heldout) else "train",
                       "prompt": p.text, "prompt_ids": ids[p.key], "response_ids": result.token_ids,
                       "finish_reason": result.finish_reason}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
                new_tokens += len(result.token_ids)

            from ..api import generate_batch

            generate_batch(target, [ids[p.key] for p in part], method, max_new_tokens=max_new_tokens,
                           max_active=max_active, on_result=save)
            dt = time.perf_counter() - t0
            log(f"make-data: {len(done) + start + len(part)}/{len(done) + len(todo)} prompts, {new_tokens} new "
                f"tokens in {dt:.0f} s ({new_tokens / max(dt, 1e-9):.1f} tok/s)")
    summary = {"records": len(read_records(out)), "new_tokens": new_tokens,
               "seconds": round(time.perf_counter() - t0, 1)}
    if features:
        from ..drafters.features import write_features

        summary["features"] = write_features(target, out, log=log)
    return summary
