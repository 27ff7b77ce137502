"""``fastforward collect-trajectories``: the Jacobi trajectories CLLM trains on (CLLM §3.2.1, Algorithm 1).

For every prompt the target decodes greedily with Jacobi decoding in n-token blocks (the ``jacobi`` proposer,
initialised from prompt tokens as CLLM does, watched by a ``JacobiTrajectories`` step observer). Every block that
converges gives one record: the tokens before it (prompt + the answer so far), every intermediate n-token state
and the fixed point, which in greedy mode is the AR continuation of that prefix. The full greedy answer is kept with
each record for the AR loss (eq. 6).

* ``--augment`` (§3.2.1 data augmentation): in every state except the fixed point, each *wrong* token (one that
  differs from the fixed point at that position) is replaced by the fixed point's token with probability
  ``--augment-prob`` (default 0.5), but never all of them (one stays wrong, chosen at random, so the state does not
  collapse into the fixed point). Correct tokens are never touched, and a wrong token only ever becomes the correct
  one. The original, unaugmented trajectory is the same whether or not ``--augment`` is on (separate random streams).
* Post-processing (§3.2.1): a prompt whose greedy answer repeats itself is dropped with all its blocks, by
  :func:`repetition_reason`: token level, the fraction of the answer's token ``--ngram``-grams (default 4) that
  already occurred earlier in it exceeds ``--max-ngram-repeat`` (default 0.4); sentence level, a sentence (text split
  at ``. ! ?`` and newlines, compared lower-cased with whitespace collapsed, at least 12 characters) occurs more than
  ``--max-sentence-repeats`` times (default 2).

Output (``--out DIR``, schema in ``docs/cllm.md``): ``trajectories.jsonl`` (one record per kept (prompt, block)),
``prompts.jsonl`` (one line per finished prompt: blocks, kept or why dropped) and ``meta.json`` (settings and
counts). Resumable: a prompt is done once its line is in ``prompts.jsonl``, written after its records; on restart,
records of unfinished prompts (a run killed mid-prompt) are removed and finished prompts are skipped, so a re-run
neither loses nor duplicates anything. Settings must match the interrupted run (``--limit`` may grow).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
import zlib
from pathlib import Path

import fastforward as ff

from ..bench.questions import load_question_file
from ..errors import UsageError
from ..paths import check_output_dir, mark_output_dir
from ..proposers.jacobi import JacobiTrajectories
from .trainer import seed_key

SCHEMA = "fastforward-cllm-trajectories/1"
TRAJECTORIES = "trajectories.jsonl"
PROMPTS = "prompts.jsonl"
META = "meta.json"

# Settings that must match for a run to resume (the rest -- --limit, --threads -- may change).
IDENTITY_KEYS = ("schema", "model", "prompts", "n_token", "max_new_tokens", "augment", "augment_prob", "seed",
                 "ngram", "max_ngram_repeat", "max_sentence_repeats")

MIN_SENTENCE_CHARS = 12
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")


# ------------------------------------------------------------------------------------------------------------------
# Pure functions: augmentation and the repetition filter
# ------------------------------------------------------------------------------------------------------------------


def augment_state(state: list[int], fixed_point: list[int], rng: random.Random, prob: float = 0.5) -> list[int]:
    """A copy of ``state`` where each position that differs from ``fixed_point`` is corrected (set to the fixed
    point's token) with probability ``prob``, keeping at least one wrong position wrong. Correct positions are never
    changed, so a state equal to the fixed point comes back unchanged."""
    if len(state) != len(fixed_point):
        raise ValueError("state and fixed point differ in length")
    wrong = [i for i, (a, b) in enumerate(zip(state, fixed_point, strict=True)) if a != b]
    fix = [i for i in wrong if rng.random() < prob]
    if wrong and len(fix) == len(wrong):
        fix.pop(rng.randrange(len(fix)))
    out = list(state)
    for i in fix:
        out[i] = fixed_point[i]
    return out


def augment_trajectory(states: list[list[int]], fixed_point: list[int], rng: random.Random,
                       prob: float = 0.5) -> list[list[int]]:
    """:func:`augment_state` on every state but the last (the fixed point, kept as is)."""
    return [augment_state(s, fixed_point, rng, prob) for s in states[:-1]] + [list(states[-1])]


def ngram_repeat_ratio(ids: list[int], n: int = 4) -> float:
    """The fraction of the ``n``-grams of ``ids`` that already occurred earlier in ``ids`` (0 for fewer than
    ``2n`` tokens)."""
    if len(ids) < 2 * n:
        return 0.0
    seen, repeats, total = set(), 0, 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        repeats += gram in seen
        seen.add(gram)
        total += 1
    return repeats / total


def max_sentence_count(text: str, min_chars: int = MIN_SENTENCE_CHARS) -> int:
    """How often the most frequent sentence of ``text`` (at least ``min_chars`` characters, compared lower-cased
    with whitespace collapsed) occurs in it (0 when there is none)."""
    counts: dict[str, int] = {}
    for part in _SENTENCE_SPLIT.split(text):
        s = " ".join(part.lower().split())
        if len(s) >= min_chars:
            counts[s] = counts.get(s, 0) + 1
    return max(counts.values(), default=0)


def repetition_reason(ids: list[int], text: str, *, ngram: int = 4, max_ngram_repeat: float = 0.4,
                      max_sentence_repeats: int = 2) -> str | None:
    """Why a generation counts as repetitive (``"token"`` or ``"sentence"``), or ``None`` when it is clean."""
    if ngram_repeat_ratio(ids, ngram) > max_ngram_repeat:
        return "token"
    if max_sentence_count(text) > max_sentence_repeats:
        return "sentence"
    return None


def prompt_seed(seed: int, prompt_id: str, stream: int = 0) -> int:
    """A per-prompt seed: a function of (``seed``, the prompt's id, ``stream``), independent of order and --limit."""
    return seed_key(seed, zlib.crc32(prompt_id.encode()), stream)


# ------------------------------------------------------------------------------------------------------------------
# Collecting one prompt
# ------------------------------------------------------------------------------------------------------------------


def collect_prompt(target, prompt_ids: list[int], *, n_token: int = 16, max_new_tokens: int = 256,
                   seed: int = 0) -> tuple[list[int], list[dict], dict]:
    """Greedy Jacobi decoding of one prompt: (answer ids, every converged block's trajectory, the generation's
    stats); the trajectories come from a step observer (:class:`~fastforward.proposers.jacobi.JacobiTrajectories`)."""
    recorder = JacobiTrajectories()
    result = ff.generate(target, list(prompt_ids), "jacobi", method_options={"n_tokens": n_token, "init": "prompt"},
                         max_new_tokens=max_new_tokens, seed=seed, observers=[recorder])
    return list(result.token_ids), list(recorder.trajectories), result.stats.method_stats


def block_records(prompt_id: str, prompt_ids: list[int], answer_ids: list[int], trajectories: list[dict], *,
                  augment_rng: random.Random | None = None, augment_prob: float = 0.5) -> list[dict]:
    """One record per converged block (see ``docs/cllm.md`` for the schema). Checks that each fixed point is the
    answer at the block's positions (greedy Jacobi decoding is lossless)."""
    p = len(prompt_ids)
    full = list(prompt_ids) + list(answer_ids)
    records = []
    for b, traj in enumerate(trajectories):
        start, fixed = int(traj["prefix_length"]), list(traj["fixed_point"])
        states = [list(s) for s in traj["states"]]
        if full[start : start + len(fixed)] != fixed or list(traj["prefix_ids"]) != full[:start] or states[-1] != fixed:
            raise RuntimeError(f"prompt {prompt_id} block {b}: the Jacobi fixed point is not the greedy answer")
        if augment_rng is not None:
            states = augment_trajectory(states, fixed, augment_rng, augment_prob)
        records.append({
            "prompt_id": prompt_id, "block": b, "n_token": len(fixed), "prompt_length": p, "prefix_length": start,
            "prompt_ids": list(prompt_ids), "answer_ids": list(answer_ids), "states": states, "fixed_point": fixed,
            "augmented": augment_rng is not None,
        })
    return records


# ------------------------------------------------------------------------------------------------------------------
# The output folder: resume bookkeeping
# ------------------------------------------------------------------------------------------------------------------


def _read_jsonl_lenient(path: Path) -> list[dict]:
    """Parsed lines of ``path``; a line that does not parse (cut by a kill) is skipped."""
    out = []
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and line.endswith("\n"):
                    out.append(rec)
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def recover(out: Path) -> dict[str, dict]:
    """Finished prompts (``prompt_id -> its prompts.jsonl line``); removes from ``trajectories.jsonl`` every record
    of an unfinished prompt and every partial line, so the folder holds exactly the finished prompts' records."""
    done = {}
    for rec in _read_jsonl_lenient(out / PROMPTS):
        if "prompt_id" in rec:
            done[str(rec["prompt_id"])] = rec
    _write_atomic(out / PROMPTS, "".join(json.dumps(r) + "\n" for r in done.values()))
    path = out / TRAJECTORIES
    if path.is_file():
        raw = path.read_text(encoding="utf-8")
        keep, changed = [], False
        for line in raw.splitlines(keepends=True):
            try:
                rec = json.loads(line)
                ok = line.endswith("\n") and str(rec.get("prompt_id")) in done
            except (json.JSONDecodeError, AttributeError):
                ok = False
            if ok:
                keep.append(line)
            else:
                changed = True
        if changed:
            _write_atomic(path, "".join(keep))
    return done


def _is_collection(out: Path) -> bool:
    """A collection written before output folders were marked: its meta.json names the schema."""
    try:
        return json.loads((out / META).read_text(encoding="utf-8")).get("schema") == SCHEMA
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def _identity(settings: dict) -> dict:
    return {k: settings.get(k) for k in IDENTITY_KEYS}


def _resolved(name: str) -> str:
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


# ------------------------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------------------------


def check_settings(n_token: int, max_new_tokens: int, limit: int | None, augment_prob: float, ngram: int,
                   max_ngram_repeat: float, max_sentence_repeats: int) -> None:
    if not isinstance(n_token, int) or n_token < 2:
        raise UsageError(f"--n-token must be an integer of at least 2, got {n_token}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= n_token:
        raise UsageError(f"--max-new-tokens must be larger than --n-token ({n_token}), got {max_new_tokens}")
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be a positive integer, got {limit}")
    if not 0.0 < augment_prob <= 1.0:
        raise UsageError(f"--augment-prob must be in (0, 1], got {augment_prob}")
    if ngram < 1:
        raise UsageError(f"--ngram must be a positive integer, got {ngram}")
    if not 0.0 <= max_ngram_repeat <= 1.0:
        raise UsageError(f"--max-ngram-repeat must be in [0, 1], got {max_ngram_repeat}")
    if max_sentence_repeats < 1:
        raise UsageError(f"--max-sentence-repeats must be a positive integer, got {max_sentence_repeats}")


def _check_saved_settings(meta_path: Path, settings: dict, out_dir: Path) -> None:
    """Refuse to add to a collection whose meta.json names other identity settings (an unreadable one: none)."""
    if not meta_path.is_file():
        return
    try:
        saved = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        saved = {}
    diff = sorted(k for k in IDENTITY_KEYS if saved.get(k) != settings.get(k))
    if diff:
        raise UsageError(f"{out_dir} holds trajectories collected with other settings ({', '.join(diff)}); "
                         "use another --out")


def _write_meta(meta_path: Path, settings: dict, questions: list, done: dict, finished: bool) -> dict:
    """meta.json: the settings and the counts over the prompts done so far (complete once ``finished`` with every
    prompt done); returns its contents."""
    lines = list(done.values())
    meta = dict(settings)
    meta.update(
        prompts_total=len(questions), prompts_done=len(lines),
        prompts_kept=sum(1 for r in lines if r.get("kept")),
        dropped_token_repetition=sum(1 for r in lines if r.get("dropped") == "token"),
        dropped_sentence_repetition=sum(1 for r in lines if r.get("dropped") == "sentence"),
        records=sum(int(r.get("records", 0)) for r in lines),
        blocks=sum(int(r.get("blocks", 0)) for r in lines),
        generated_tokens=sum(int(r.get("answer_tokens", 0)) for r in lines),
        complete=finished and all(q.question_id in done for q in questions), updated=time.time(),
    )
    _write_atomic(meta_path, json.dumps(meta, indent=1))
    return meta


def _collect_one(target, q, traj_f, done_f, *, n_token: int, max_new_tokens: int, seed: int, augment: bool,
                 augment_prob: float, ngram: int, max_ngram_repeat: float, max_sentence_repeats: int) -> dict:
    """One prompt: its greedy answer's trajectories, their block records appended to ``traj_f`` (none when the
    answer repeats itself), then its line appended to ``done_f``; returns that line."""
    prompt_ids = target.encode(q.turns[0])
    t0 = time.perf_counter()
    answer, trajs, stats = collect_prompt(target, prompt_ids, n_token=n_token, max_new_tokens=max_new_tokens,
                                          seed=prompt_seed(seed, q.question_id))
    reason = repetition_reason(answer, target.decode(answer), ngram=ngram, max_ngram_repeat=max_ngram_repeat,
                               max_sentence_repeats=max_sentence_repeats)
    records = []
    if reason is None:
        rng = random.Random(prompt_seed(seed, q.question_id, 1)) if augment else None
        records = block_records(q.question_id, prompt_ids, answer, trajs, augment_rng=rng, augment_prob=augment_prob)
    for rec in records:
        traj_f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    traj_f.flush()
    os.fsync(traj_f.fileno())
    line = {"prompt_id": q.question_id, "kept": reason is None, "dropped": reason,
            "blocks": len(trajs), "records": len(records), "answer_tokens": len(answer),
            "fast_forward_mean": stats.get("fast_forward_mean"),
            "stationary_per_block": stats.get("stationary_per_block"),
            "seconds": round(time.perf_counter() - t0, 3)}
    done_f.write(json.dumps(line) + "\n")
    done_f.flush()
    os.fsync(done_f.fileno())
    return line


def collect(model: str, prompts: str, out: str, *, n_token: int = 16, max_new_tokens: int = 256,
            augment: bool = False, augment_prob: float = 0.5, limit: int | None = None, seed: int = 0,
            ngram: int = 4, max_ngram_repeat: float = 0.4, max_sentence_repeats: int = 2,
            threads: int | None = None, quiet: bool = False) -> dict:
    """Collect (or resume collecting) trajectories into ``out``; return the meta.json contents."""
    check_settings(n_token, max_new_tokens, limit, augment_prob, ngram, max_ngram_repeat, max_sentence_repeats)
    out_dir = check_output_dir(out, "collect-trajectories", owned=_is_collection)
    questions = load_question_file(prompts)
    if limit is not None:
        questions = questions[:limit]
    settings = {
        "schema": SCHEMA, "model": _resolved(model), "prompts": _resolved(prompts), "n_token": n_token,
        "max_new_tokens": max_new_tokens, "augment": bool(augment), "augment_prob": augment_prob, "seed": seed,
        "ngram": ngram, "max_ngram_repeat": max_ngram_repeat, "max_sentence_repeats": max_sentence_repeats,
    }
    meta_path = out_dir / META
    _check_saved_settings(meta_path, settings, out_dir)
    target = ff.load(model, threads=threads)
    started = time.time()
    mark_output_dir(out_dir, "collect-trajectories")
    done = recover(out_dir)
    todo = [q for q in questions if q.question_id not in done]
    _write_meta(meta_path, settings, questions, done, False)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(questions), initial=len(questions) - len(todo), desc="collect-trajectories", unit="prompt",
               disable=quiet, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    try:
        with open(out_dir / TRAJECTORIES, "a", encoding="utf-8") as traj_f, \
                open(out_dir / PROMPTS, "a", encoding="utf-8") as done_f:
            for q in todo:
                done[q.question_id] = _collect_one(
                    target, q, traj_f, done_f, n_token=n_token, max_new_tokens=max_new_tokens, seed=seed,
                    augment=augment, augment_prob=augment_prob, ngram=ngram, max_ngram_repeat=max_ngram_repeat,
                    max_sentence_repeats=max_sentence_repeats)
                _write_meta(meta_path, settings, questions, done, False)
                bar.set_postfix(records=sum(int(r.get("records", 0)) for r in done.values()), refresh=False)
                bar.update(1)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{len(done)} of {len(questions)} prompts are done in {out_dir}; re-run the same "
                                "command to resume") from None
    finally:
        bar.close()
    meta = _write_meta(meta_path, settings, questions, done, True)
    meta["seconds_this_run"] = round(time.time() - started, 2)
    return meta
