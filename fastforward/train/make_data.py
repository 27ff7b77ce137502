"""Training data for drafters, made by the target itself (``fastforward make-data``).

FastEagle's recipe: drafters learn from the target's *own* greedy responses, not from a fixed dataset's answers, so
what they learn to predict is exactly what verification will accept. This module

* reads prompts from instruction/chat files (ShareGPT first turns, Alpaca-style, GSM8K, XSum articles to summarise,
  Spider questions with their tables; benchmark files refused),
  deduplicates them by text, interleaves the sources in a seeded order and marks a held-out split by a hash of the
  prompt (the same prompt is held out whatever it is mixed with);
* generates the target's greedy response to each (or, with a temperature, one sampled response, kept beside the
  greedy one under its own key) with many sequences per forward
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
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine import Proposer
from ..errors import UsageError
from ..jsonl import jsonl_records
from ..paths import check_output_dir, check_output_file, data_root, made_data_dir, mark_output_dir, owned_jsonl
from ..validation import check_sampling, token_ids_problem
from .data import check_heldout, located_records, parse_paths, text_field

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
    "xsum/XSum-test.jsonl",
    "spider/dev.json",
)
# Files whose prompts the benchmark or the evaluation uses: training on them would flatter every result.
BENCHMARK_FILES = ("question.jsonl", "test.jsonl", "HumanEval.jsonl.gz", "eagle_alpaca_question.jsonl")
DEFAULT_HELDOUT = 0.05
MAX_PROMPT_TOKENS = 512
RECORD_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")  # a record's key names its features file


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


SUMMARY_REQUEST = "Summarize the following article in one sentence.\n\n"


def spider_schemas(path: Path) -> dict[str, str]:
    """Spider's schemas by database (``tables.json`` beside a Spider question file), one line per database:
    ``table(column, ...); ...``; empty when there is no such file."""
    tables = Path(path).with_name("tables.json")
    if not tables.is_file():
        return {}
    out = {}
    for where, db in located_records(tables):
        if not isinstance(db, dict) or not isinstance(db.get("db_id"), str):
            raise UsageError(f"{where}: a Spider schema needs a 'db_id'")
        names = db.get("table_names_original") or []
        cols: list[list[str]] = [[] for _ in names]
        for t, c in db.get("column_names_original") or []:
            if isinstance(t, int) and 0 <= t < len(cols):
                cols[t].append(str(c))
        out[db["db_id"]] = "; ".join(f"{n}({', '.join(c)})" for n, c in zip(names, cols, strict=True))
    return out


def prompt_of(rec: dict, where: str, schemas: dict | None = None) -> str | None:
    """The user prompt of one record: ShareGPT's first human turn, Alpaca's instruction (+ input), an XSum
    ``document`` to summarise, a Spider ``question`` with its database's schema (``schemas``, by ``db_id``), GSM8K's
    question, or a generic ``prompt``; a field that is not text is a one-line :class:`UsageError` naming ``where``."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: records must be JSON objects")
    if "document" in rec:
        text = text_field(rec, "document", where).strip()
        return SUMMARY_REQUEST + text if text else None
    if "db_id" in rec and "question" in rec:
        question = text_field(rec, "question", where).strip()
        schema = (schemas or {}).get(rec["db_id"])
        tables = f"Tables: {schema}\n" if schema else f"Database: {rec['db_id']}\n"
        return f"Write an SQL query for this question.\n{tables}Question: {question}" if question else None
    if "conversations" in rec:
        turns = rec["conversations"] or []
        if not isinstance(turns, list):
            raise UsageError(f"{where}: field 'conversations' must be a list of turns")
        first = next((t for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
        return None if first is None else text_field(first, "value", f"{where}, first user turn").strip() or None
    if "instruction" in rec:
        text = text_field(rec, "instruction", where).strip()
        extra = text_field(rec, "input", where, optional=True).strip()
        return (f"{text}\n\n{extra}" if extra else text) or None
    for key in ("question", "prompt"):
        if key in rec:
            return text_field(rec, key, where).strip() or None
    raise UsageError(f"{where}: unsupported record with keys {sorted(rec)[:8]}; expected conversations, "
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
        schemas = spider_schemas(p)
        items = [t for t in (prompt_of(rec, where, schemas) for where, rec in located_records(p)) if t]
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


SOURCE_CATEGORIES = {"ShareGPT": "chat", "alpaca": "alpaca", "code_alpaca": "code", "train.jsonl": "gsm8k_train",
                     "XSum": "summary", "dev.json": "sql"}


def category_of(source: str) -> str:
    """A benchmark category for a prompt source file: ShareGPT first turns are 'chat', and so on."""
    for key, cat in SOURCE_CATEGORIES.items():
        if source.startswith(key) or source == key:
            return cat
    return Path(source).stem


HELDOUT_QUESTION_KEYS = {"id", "category", "prompt"}  # a line of a --write-heldout file


def is_heldout_file(path) -> bool:
    """Whether ``path`` is a file :func:`write_heldout_prompts` wrote (empty, or every line a question with exactly
    its keys, judged on a bounded prefix: :func:`~fastforward.paths.owned_jsonl`), so writing it again loses nothing
    of the user's."""
    return owned_jsonl(path, lambda q: set(q) == HELDOUT_QUESTION_KEYS)


def write_heldout_prompts(path, sources=None, *, heldout: float = DEFAULT_HELDOUT, seed: int = 0) -> dict:
    """Write the held-out prompts of ``sources`` (the ones ``make_data`` marks held out and drafters never train on)
    as a question file ``fastforward bench --questions`` reads (``id``, ``category``, ``prompt``); returns the counts
    per category. Everything is checked before the file is written; an existing file is replaced only when an
    earlier call wrote it (:func:`is_heldout_file`)."""
    out = check_output_file(path, "--write-heldout", owned=is_heldout_file)
    check_heldout(heldout)
    held = [p for p in read_prompts(sources, seed=seed) if p.heldout(heldout)]
    counts: dict[str, int] = {}
    with open(out, "w", encoding="utf-8") as f:
        for p in held:
            cat = category_of(p.source)
            counts[cat] = counts.get(cat, 0) + 1
            f.write(json.dumps({"id": p.key, "category": cat, "prompt": p.text}, ensure_ascii=False) + "\n")
    return counts


def default_out(model_name: str) -> Path:
    return made_data_dir(model_name)


def _numbered_records(out: Path, repair: bool = False) -> list[tuple[int, object]]:
    """(line number, record) of each line of ``out/responses.jsonl`` (none when it does not exist yet); with
    ``repair``, a torn last line (a killed writer) is cut off the file (without, it is only skipped)."""
    path = Path(out) / RESPONSES
    return jsonl_records(path, repair=repair) if path.exists() else []


def read_records(out: Path, repair: bool = False) -> list[dict]:
    """The records of ``out/responses.jsonl``; with ``repair``, a torn last line (a killed writer) is cut off."""
    return [rec for _, rec in _numbered_records(out, repair)]


def check_training_record(rec, where: str, vocab_size: int) -> None:
    """One ``make-data`` record a drafter trains on, checked before any training: a JSON object with a ``key`` (a
    plain file name: features are stored under it) and ``prompt_ids``/``response_ids``, non-empty lists of token
    ids inside the target's vocabulary. Else a one-line :class:`UsageError` naming ``where``."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: not a JSON object")
    key = rec.get("key")
    if not isinstance(key, str) or not RECORD_KEY.fullmatch(key):
        raise UsageError(f"{where}: 'key' must be a name of letters, digits, '-', '_' and '.', got {json.dumps(key)}")
    for field in ("prompt_ids", "response_ids"):
        problem = token_ids_problem(rec.get(field), vocab_size)
        if problem:
            raise UsageError(f"{where}: {field} {problem} (make the folder with 'fastforward make-data')")


def read_training_records(out, vocab_size: int) -> list[dict]:
    """The records of a ``make-data`` folder, each checked for a drafter of a ``vocab_size``-token target
    (:func:`check_training_record`): the one check every drafter trainer runs before it trains."""
    path = Path(out).expanduser() / RESPONSES
    numbered = _numbered_records(Path(out).expanduser())
    for n, rec in numbered:
        check_training_record(rec, f"{path} line {n}", vocab_size)
    return [rec for _, rec in numbered]


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


def check_make_data(out=None, *, sources=None, limit: int | None = None, heldout: float = DEFAULT_HELDOUT,
                    seed: int = 0) -> list[Prompt]:
    """The checks of :func:`make_data` that need no model, before any work (the command line runs them before
    loading the model): the output folder, ``limit``, ``heldout`` and the prompt files. Creates nothing; returns the
    prompts (the first ``limit``)."""
    if out is not None:
        check_output_dir(out, COMMAND)
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise UsageError(f"--limit must be a positive integer, got {limit}")
    check_heldout(heldout)
    prompts = read_prompts(sources, seed=seed)
    return prompts if limit is None else prompts[:limit]


class FeatureRecorder(Proposer):
    """Wraps a proposer to record the target's features of every token as the generation computes them: the
    prompt's from the prefill (``start``), each step's accepted path from the verification forward (as a step
    observer, so the last step is recorded too). The last token, which no forward reads, gets zeros (no training
    row uses it)."""

    def __init__(self, inner, aux_layers):
        from ..drafters.features import FINAL, engine_layers

        self.inner = inner
        self.taps = engine_layers(aux_layers)
        self.layers = self.taps + (FINAL,)
        self.name, self.lossless = inner.name, inner.lossless
        self.hidden_layers = tuple(sorted(set(inner.hidden_layers) | set(self.layers)))
        self.parts: list[dict] = []

    def max_proposal_size(self):
        return self.inner.max_proposal_size()

    def prepare(self, target):
        self.inner.prepare(target)

    def start(self, state, prefill_logits, hidden):
        self.parts = [{k: hidden[k].float() for k in self.layers}]
        self.inner.start(state, prefill_logits, hidden)

    def propose(self, state):
        return self.inner.propose(state)

    def observe(self, state, step):
        self.inner.observe(state, step)

    def stats(self):
        return self.inner.stats()

    def __call__(self, state, step):  # the step observer
        path = torch.as_tensor(step.verdict.path)
        self.parts.append({k: step.hidden[k][path].float() for k in self.layers})

    def features(self, total: int) -> dict:
        rows = {k: torch.cat([p[k] for p in self.parts]) for k in self.layers}
        taps = torch.stack([rows[k] for k in self.taps], dim=1)
        final = rows[self.layers[-1]]
        out = {"taps": torch.zeros(total, *taps.shape[1:]), "final": torch.zeros(total, final.shape[1])}
        n = min(total, taps.shape[0])
        out["taps"][:n], out["final"][:n] = taps[:n], final[:n]
        return out


def record_key(prompt: Prompt, temperature: float, seed: int) -> str:
    """A record's key (and its features file's name): the prompt's for its greedy response, with the temperature
    and seed appended for a sampled one (``<key>-t1-s0``), so one folder holds both."""
    return prompt.key if temperature == 0 else f"{prompt.key}-t{temperature:g}-s{seed}"


def sample_seed(prompt: Prompt, seed: int) -> int:
    """The sampling seed of ``prompt``'s sampled response: from the prompt and ``seed`` only (not its place in a
    batch), so a resumed run draws the same response."""
    return int(hashlib.sha256(f"{seed}:{prompt.key}".encode()).hexdigest()[:15], 16)


def _lock(out: Path):
    """An exclusive lock on ``out`` held while this process writes there (released when the process ends)."""
    import fcntl

    handle = open(out / ".make_data.lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise UsageError(f"another 'fastforward make-data' is writing {out}; wait for it or stop it first") from None
    return handle


def make_data(target, out, *, sources=None, limit: int | None = None, max_new_tokens: int = 256,
              heldout: float = DEFAULT_HELDOUT, seed: int = 0, max_active: int = 8, features: bool = False,
              method: str = "pld", max_batch_tokens: int | None = None, temperature: float = 0.0,
              log: Callable[[str], None] = print) -> dict:
    """Generate (or resume generating) the target's responses into ``out``: greedy, or with ``temperature`` > 0 one
    sampled response per prompt (seeded by the prompt and ``seed``, so a resumed or re-batched run draws the same
    samples), kept beside the greedy ones under their own keys; returns a summary."""
    out = Path(out).expanduser()
    sampling = check_sampling(temperature, 0, 1.0)
    prompts = check_make_data(out, sources=sources, limit=limit, heldout=heldout, seed=seed)
    mark_output_dir(out, COMMAND)
    lock = _lock(out)  # one writer per folder: two would both generate the prompts neither had finished
    try:
        names = DEFAULT_SOURCES if sources is None else parse_paths(sources)
        _check_manifest(out, {"model": target.name, "max_new_tokens": max_new_tokens, "heldout": heldout,
                              "method": "greedy", "sources": [str(s) for s in names]})
        done = {r["key"] for r in read_records(out, repair=True)}
        todo = [p for p in prompts if record_key(p, sampling.temperature, seed) not in done]
        ids = {}
        for p in todo:
            pid = target.encode(p.text)
            if len(pid) <= MAX_PROMPT_TOKENS:
                ids[p.key] = pid
        todo = [p for p in todo if p.key in ids]
        what = "greedy" if sampling.greedy else f"sampled at temperature {sampling.temperature:g} (seed {seed})"
        log(f"make-data: {len(done)} records already in {out / RESPONSES}, {len(todo)} prompts to go, {what}")
        t0 = time.perf_counter()
        new_tokens = 0
        store = None
        if features:
            from ..drafters.features import FeatureStore, default_aux_layers

            store = FeatureStore(out, target)
            aux = default_aux_layers(target.config.num_hidden_layers)
        with open(out / RESPONSES, "a", encoding="utf-8") as f:
            chunk = max(1, max_active) * 8  # prompts per generate_batch call: bounded memory, steady progress lines

            for start in range(0, len(todo), chunk):
                part = todo[start : start + chunk]
                from ..proposers import make_proposer

                recorders = [FeatureRecorder(make_proposer(method, target), aux) for _ in part] if features else None

                def save(i, result, part=part, recorders=recorders):
                    nonlocal new_tokens
                    p = part[i]
                    key = record_key(p, sampling.temperature, seed)
                    if recorders is not None:  # the features first: a record in the file always has its features
                        store.put(key, recorders[i].features(len(ids[p.key]) + len(result.token_ids)))
                        recorders[i].parts = []
                    rec = {"key": key, "source": p.source, "split": "heldout" if p.heldout(heldout) else "train",
                           "prompt": p.text, "prompt_ids": ids[p.key], "response_ids": result.token_ids,
                           "finish_reason": result.finish_reason}
                    if not sampling.greedy:
                        rec.update(temperature=sampling.temperature, seed=sample_seed(p, seed))
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                    new_tokens += len(result.token_ids)

                from ..api import generate_batch

                try:
                    generate_batch(target, [ids[p.key] for p in part], recorders or method,
                                   max_new_tokens=max_new_tokens, max_active=max_active, on_result=save,
                                   temperature=sampling.temperature,
                                   seed=None if sampling.greedy else [sample_seed(p, seed) for p in part],
                                   max_batch_tokens=max_batch_tokens,
                                   observers=[(r,) for r in recorders] if recorders else None)
                except KeyboardInterrupt:  # every finished record is on disk; say so in one line
                    kept = len(read_records(out))
                    raise KeyboardInterrupt(f"{kept} records kept in {out / RESPONSES}; re-run the same command to "
                                            "resume") from None
                dt = time.perf_counter() - t0
                log(f"make-data: {len(done) + start + len(part)}/{len(done) + len(todo)} prompts, {new_tokens} new "
                    f"tokens in {dt:.0f} s ({new_tokens / max(dt, 1e-9):.1f} tok/s)")
        summary = {"records": len(read_records(out)), "new_tokens": new_tokens,
                   "seconds": round(time.perf_counter() - t0, 1)}
        if features:  # records made by an earlier run without --features
            summary["features_computed"] = write_features(target, out, log=log)
        return summary
    finally:
        lock.close()


def write_features(target, folder, *, log=print) -> int:
    """Store the features of every record of a ``make-data`` folder that has none yet (records made by a run
    without ``--features``); returns how many were computed."""
    from ..drafters.features import FeatureStore

    store = FeatureStore(folder, target)
    records = [r for r in read_records(folder) if not store.has(r["key"])]
    for n, rec in enumerate(records, 1):
        store.get(rec)
        if n % 50 == 0 or n == len(records):
            log(f"features: {n}/{len(records)} records computed")
    return len(records)
