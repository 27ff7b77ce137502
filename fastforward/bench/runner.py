"""The benchmark loop: every question, every repeat, every method interleaved, one row each, resumable.

Noise control: one process; per question and repeat all methods run back to back (AR first), so slow drifts of
the machine hit every method alike; a warm-up generation per method before timing; a fixed, recorded thread count.

Losslessness: every row's tokens are compared with AR's tokens for the same question (at temperature 0). The
first divergence is located (turn, index, the two tokens) and the target's logit gap between the two tokens at
that position is recomputed with one plain forward over prompt + AR tokens: a gap within :data:`NEAR_TIE` of zero
is a floating-point near-tie (two kernels rounding differently), a large gap is a bug.

Peers that compute differently (llama.cpp quantises activations to 8 bits; runner attribute ``exact = False``) are
not checked: their row records ``agreement`` instead -- the prefix identical to AR's tokens, in tokens and as a
fraction of AR's length, and how many turns are identical.

Multi-turn questions: each turn is conditioned on the *same method's* previous answers, as Spec-Bench does. For a
lossless method they equal AR's; if a method diverges, its later turns see a different conversation, which is
reported through the first divergence (always in the earliest diverging turn, whose prompt is still AR's).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError
from ..stats import acceptance_by_depth, sum_lists, tau, tokens_per_s
from ..version import __version__
from .methods import effective_options, make_runner
from .peers import llama_cpp_system_info
from .questions import Question
from .report import write_report
from .results import RESULTS, ResultsWriter, read_rows, rewrite, row_key
from .spec import BASELINE, MethodSpec, TurnOutcome

#: |logit gap| at or below this (in logits) marks a divergence as a floating-point near-tie rather than a bug
NEAR_TIE = 1e-2

#: parameters that must match for rows to be mixed in one results file (the rest is recorded, not enforced)
FINGERPRINT = ("model", "backend", "dtype", "max_new_tokens", "temperature", "seed", "threads")


# ----------------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    """The commit of the fastforward checkout (``+dirty`` when its package source has changes), or ``unknown``."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        # uncommitted or untracked changes to the package's source make the commit "+dirty"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "fastforward"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict:
    import transformers

    software = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fastforward": __version__,
    }
    llama_cpp = sys.modules.get("llama_cpp")  # imported when a llama.cpp peer runs
    if llama_cpp is not None:
        software["llama-cpp-python"] = getattr(llama_cpp, "__version__", "unknown")
        software["llama_cpp_system_info"] = llama_cpp_system_info()  # its build's CPU features (AVX512, AMX...)
    return {
        "machine": {
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "arch": platform.machine(),
            "os": platform.platform(terse=True),
        },
        "software": software,
        "commit": git_commit(),
    }


# ----------------------------------------------------------------------------------------------------------------
# Prompts and the losslessness check
# ----------------------------------------------------------------------------------------------------------------


def turn_prompt(target, turns: list[str], answers: list[str]) -> list[int]:
    """Token ids for the last of ``turns``, after the earlier turns and their ``answers`` (chat template when the
    tokenizer has one, else the texts joined by blank lines)."""
    if getattr(target.tokenizer, "chat_template", None):
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return target.encode(messages)
    parts = []
    for i, turn in enumerate(turns):
        parts.append(turn)
        if i < len(answers):
            parts.append(answers[i])
    return target.encode("\n\n".join(parts), chat=False)


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """How far ``tokens`` (per turn) agrees with AR's ``reference``: the identical prefix over the concatenated turns
    (a later turn counts only while every earlier one was identical, as its prompt is then AR's), in tokens and as a
    fraction of AR's length, and the number of leading turns that are identical."""
    prefix = identical_turns = 0
    for ref, out in zip(reference, tokens, strict=False):
        if ref == out:
            prefix += len(ref)
            identical_turns += 1
            continue
        n = min(len(ref), len(out))
        prefix += next((i for i in range(n) if ref[i] != out[i]), n)
        break
    ar_tokens = sum(len(r) for r in reference)
    identical = identical_turns == len(reference) == len(tokens)
    return {
        "identical_prefix": prefix,
        "ar_tokens": ar_tokens,
        "fraction": prefix / ar_tokens if ar_tokens else float(identical),
        "identical_turns": identical_turns,
        "turns": len(reference),
        "identical": identical,
        "first_divergence": first_divergence(reference, tokens),
    }


def first_divergence(reference: list[list[int]], tokens: list[list[int]]) -> dict | None:
    """Where ``tokens`` (per turn) first differs from ``reference``; ``None`` when identical. A token of ``None``
    means that sequence had ended (one output is a prefix of the other)."""
    for turn, (ref, out) in enumerate(zip(reference, tokens, strict=False)):
        if ref == out:
            continue
        n = min(len(ref), len(out))
        index = next((i for i in range(n) if ref[i] != out[i]), n)
        return {
            "turn": turn,
            "index": index,
            "ar_token": ref[index] if index < len(ref) else None,
            "token": out[index] if index < len(out) else None,
        }
    if len(reference) != len(tokens):
        return {"turn": min(len(reference), len(tokens)), "index": 0, "ar_token": None, "token": None}
    return None


@torch.inference_mode()
def logit_gap(target, prompt_ids: list[int], ar_tokens: list[int], index: int, token: int) -> dict:
    """The target's logits at the divergence, from one forward over prompt + AR's first ``index`` tokens."""
    ids = torch.tensor(list(prompt_ids) + list(ar_tokens[:index]), dtype=torch.long)
    cache = target.new_cache(ids.numel() + 1)
    logits = target.forward(ids, torch.arange(ids.numel()), cache, last_only=True).logits[-1].double()
    ar_token = ar_tokens[index]
    gap = float(logits[ar_token] - logits[token])
    top = int(logits.argmax())
    return {
        "logit_gap": gap,
        "ar_logit": float(logits[ar_token]),
        "token_logit": float(logits[token]),
        "argmax": top,
        "ar_is_argmax": top == ar_token,
        "near_tie": abs(gap) <= NEAR_TIE,
    }


# ----------------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------------


def make_row(question: Question, spec: MethodSpec, repeat: int, lossless_claimed: bool,
             turns: list[tuple[list[int], TurnOutcome]], target) -> dict:
    outs = [o for _, o in turns]
    new_tokens = sum(len(o.token_ids) for o in outs)
    wall = sum(o.wall_time for o in outs)
    steps = sum(o.decoding_steps for o in outs)
    attempts = sum_lists(o.depth_attempts for o in outs)
    accepts = sum_lists(o.depth_accepts for o in outs)
    return {
        "question_id": question.question_id,
        "category": question.category,
        "subcategory": question.subcategory,
        "source": question.source,
        "label": spec.label,
        "method": spec.method,
        "kind": spec.kind,
        "options": spec.options,
        "effective_options": effective_options(spec),
        "lossless_claimed": lossless_claimed,
        "repeat": repeat,
        # Spec-Bench's fields (summed / concatenated over turns)
        "new_tokens": new_tokens,
        "wall_time": wall,
        "decoding_steps": steps,
        "accept_lengths": [a for o in outs for a in o.accept_lengths],
        # ours
        "tau": tau(new_tokens, steps),
        "tokens_per_s": tokens_per_s(new_tokens, wall),
        "depth_attempts": attempts,
        "depth_accepts": accepts,
        "acceptance_by_depth": acceptance_by_depth(accepts, attempts),
        "prefill_time": sum(o.prefill_time for o in outs),
        "draft_time": sum(o.draft_time for o in outs),
        "verify_time": sum(o.verify_time for o in outs),
        "proposal_rows": sum(o.proposal_rows for o in outs),
        "turns": [
            {"prompt_tokens": len(p), "new_tokens": len(o.token_ids), "wall_time": o.wall_time,
             "prefill_time": o.prefill_time, "decoding_steps": o.decoding_steps, "finish_reason": o.finish_reason,
             "method_stats": o.method_stats}
            for p, o in turns
        ],
        "output_ids": [list(o.token_ids) for o in outs],
        "output": [target.decode(o.token_ids) for o in outs],
    }


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


def _check_existing(rows: list[dict], parameters: dict, plan_keys: set, specs: dict, force: bool, path: Path):
    """Rows to keep, or a one-line error when the file holds incompatible results and ``--force`` is not given."""
    keep = []
    for row in rows:
        old = row.get("parameters", {})
        diff = [k for k in FINGERPRINT if old.get(k) != parameters.get(k)]
        if diff:
            if not force:
                k = diff[0]
                raise UsageError(
                    f"{path} holds results measured with {k}={old.get(k)!r} (this run: {parameters.get(k)!r}); "
                    "rerun with --force to discard them, or use another --out"
                )
            continue
        key = row_key(row)
        if key in plan_keys:
            spec = specs[key[1]]
            options = effective_options(spec)
            if row.get("method") != spec.method or row.get("effective_options", options) != options:
                if not force:
                    raise UsageError(
                        f"{path} holds '{key[1]}' results measured as {row.get('method')} with options "
                        f"{row.get('effective_options')} (this run: {spec.method} {options}); rerun with --force "
                        "to re-measure, or use another label"
                    )
                continue
            if force or row.get("error"):  # re-measured (a run that failed is retried)
                continue
        keep.append(row)
    return keep


def precheck(out_dir, parameters: dict, force: bool) -> None:
    """Refuse early (before a model load) to add to a results file measured with other known parameters."""
    if force:
        return
    path = Path(out_dir) / RESULTS
    for row in read_rows(path, warn=False):
        old = row.get("parameters", {})
        for k, v in parameters.items():
            if k in FINGERPRINT and old.get(k) != v:
                raise UsageError(
                    f"{path} holds results measured with {k}={old.get(k)!r} (this run: {v!r}); "
                    "rerun with --force to discard them, or use another --out"
                )


def _check_arguments(questions: list[Question], specs: list[MethodSpec], repeats: int, max_new_tokens: int,
                     temperature: float) -> None:
    """Refuse settings that cannot make a benchmark."""
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {repeats}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    if not questions:
        raise UsageError("no questions selected")
    if not specs or specs[0].label != BASELINE:
        raise UsageError("the first method must be the autoregressive baseline 'ar'")


def _make_runners(target, specs: list[MethodSpec], runners: dict | None) -> dict:
    """Each spec's runner (one given in ``runners`` wins), each checked against the target before any work."""
    runners = dict(runners or {})
    for spec in specs:
        if spec.label not in runners:
            runners[spec.label] = make_runner(spec)
    for spec in specs:  # what a runner needs from the target (llama.cpp: a GGUF file), checked before any work
        requirement = getattr(runners[spec.label], "check", None)
        if requirement is not None:
            requirement(target)
    return runners


def _parameters(target, *, max_new_tokens: int, temperature: float, seed: int | None, threads: int, repeats: int,
                warmup: int) -> dict:
    """The run's parameters, recorded in every row (those in :data:`FINGERPRINT` must match to mix rows)."""
    return {
        "model": target.name,
        "backend": target.backend_name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "matmul": getattr(target.backend, "matmul_kernel", "hf"),
        "arithmetic": target.arithmetic,
        "kv_cache": target.kv_precision,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "threads": threads,
        "repeats": repeats,
        "warmup": warmup,
    }


def _kept_rows(path: Path, parameters: dict, plan_keys: set, by_label: dict, force: bool) -> list[dict]:
    """The rows of the results file this run keeps; the file rewritten with only them when some are dropped."""
    existing = read_rows(path)
    kept = _check_existing(existing, parameters, plan_keys, by_label, force, path)
    if len(kept) != len(existing) or len(existing) != _count_lines(path):
        rewrite(path, kept)  # drops superseded rows (and duplicates); only with --force or after a crash
    return kept


def _record_cost_curve(target, env: dict) -> None:
    """The cost curve the methods size their drafts with, measured afresh for this run (a benchmark runs on a quiet
    machine; a cached curve may have been measured under load), into ``env`` to be recorded with every row."""
    from ..costs import machine_cost_curve

    env["machine"]["cost_curve_ms"] = {str(q): round(v, 3) for q, v in
                                       machine_cost_curve(target, refresh=True, announce=False).ms.items()}


def _ar_references(kept: list[dict]) -> dict[str, dict]:
    """AR's row per question (its earliest repeat): the reference of the losslessness check."""
    reference: dict[str, dict] = {}
    for row in sorted(kept, key=lambda r: r["repeat"]):
        if row["label"] == BASELINE and row["question_id"] not in reference:
            reference[row["question_id"]] = row
    return reference


def _warm_up(target, pending: list, runners: dict, warmup: int, generate: dict) -> None:
    """``warmup`` generations per method still to run, on the first pending question's first turn (excluded from
    timing and from the results)."""
    q0 = pending[0][0]
    prompt0 = turn_prompt(target, q0.turns[:1], [])
    labels_pending = list(dict.fromkeys(s.label for _, _, s in pending))
    for label in labels_pending:
        for _ in range(warmup):  # excluded from timing and from the results
            runners[label].generate(target, prompt0, **generate)


@dataclass
class _Run:
    """What every measurement of one :func:`run_bench` call shares."""

    target: object
    writer: ResultsWriter
    reference: dict[str, dict]  # AR's row per question
    check: bool  # temperature 0: outputs are compared with AR's
    generate: dict  # max_new_tokens, temperature, seed
    env: dict
    threads: int
    parameters: dict
    command: str

    def append(self, row: dict) -> None:
        """Stamp ``row`` with the run's environment and parameters and append it to the results file."""
        _stamp(row, self.env, self.threads, self.parameters, self.command)
        self.writer.append(row)


def _check_row(target, q: Question, row: dict, ref: dict | None, runner) -> None:
    """``row``'s verdict against AR's row ``ref``: lossless and the first divergence (with the target's logit gap
    there), or for a runner with other arithmetic its agreement with AR."""
    if not getattr(runner, "exact", True):
        # other arithmetic (llama.cpp's 8-bit activations): how far it agrees, not a losslessness verdict
        row["lossless"], row["first_divergence"] = None, None
        row["agreement"] = agreement(ref["output_ids"], row["output_ids"])
        return
    div = first_divergence(ref["output_ids"], row["output_ids"])
    row["lossless"] = div is None
    if div is not None and div["ar_token"] is not None and div["token"] is not None:
        ref_turns = ref["output_ids"]
        prompt = turn_prompt(target, q.turns[: div["turn"] + 1], ref["output"][: div["turn"]])
        div.update(logit_gap(target, prompt, ref_turns[div["turn"]], div["index"], div["token"]))
        div["ar_text"] = target.decode([div["ar_token"]])
        div["text"] = target.decode([div["token"]])
    row["first_divergence"] = div


def _measure_one(run: _Run, q: Question, r: int, spec: MethodSpec, runner, bar) -> None:
    """One question, one repeat, one method: its row appended to the results (a failure recorded as an error row,
    except for AR or with ``FASTFORWARD_DEBUG``)."""
    target = run.target
    turns: list[tuple[list[int], TurnOutcome]] = []
    answers: list[str] = []
    try:
        for t in range(len(q.turns)):
            prompt_ids = turn_prompt(target, q.turns[: t + 1], answers)
            outcome = runner.generate(target, prompt_ids, **run.generate)
            turns.append((prompt_ids, outcome))
            answers.append(target.decode(outcome.token_ids))
    except Exception as exc:  # one failing run must not cost a long benchmark: record it, go on
        if os.environ.get("FASTFORWARD_DEBUG") or spec.label == BASELINE:
            raise
        error = f"{type(exc).__name__}: {exc}"
        (bar.write if bar is not None else print)(
            f"fastforward bench: {spec.label} failed on question {q.question_id}: {error}", file=sys.stderr)
        row = make_row(q, spec, r, bool(getattr(runner, "lossless", True)), turns, target)
        row.update(error=error, lossless=None, first_divergence=None)
        run.append(row)
        return
    row = make_row(q, spec, r, bool(getattr(runner, "lossless", True)), turns, target)
    ref = run.reference.get(q.question_id)
    if spec.label == BASELINE and ref is None:
        run.reference[q.question_id] = ref = row
    if not run.check or ref is None:
        row["lossless"], row["first_divergence"] = None, None
    else:
        _check_row(target, q, row, ref, runner)
    run.append(row)


def _measure_all(run: _Run, pending: list, runners: dict, progress: bool, path: Path) -> None:
    """Every pending (question, repeat, method) in turn, with a progress bar; an interrupt says how far it got."""
    bar = None
    if progress and pending:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), desc="bench", unit="run", smoothing=0.0, file=sys.stderr, dynamic_ncols=True)
    finished = 0
    try:
        for q, r, spec in pending:
            if bar is not None:
                bar.set_postfix_str(f"q {q.question_id} {spec.label}", refresh=False)
            _measure_one(run, q, r, spec, runners[spec.label], bar)
            finished += 1
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        raise KeyboardInterrupt(f"{finished} of {len(pending)} runs measured, in {path}; run the same command again "
                                "to resume") from None
    finally:
        if bar is not None:
            bar.close()


def run_bench(
    target,
    questions: list[Question],
    specs: list[MethodSpec],
    out_dir,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int | None = 0,
    repeats: int = 1,
    warmup: int = 1,
    force: bool = False,
    progress: bool = True,
    runners: dict | None = None,
    command: str = "",
    report: bool = True,
) -> list[dict]:
    """Measure ``specs`` on ``questions`` into ``out_dir/results.jsonl`` (resuming what is there); returns all rows.

    ``runners`` maps labels to objects with ``generate(target, prompt_ids, *, max_new_tokens, temperature, seed)
    -> TurnOutcome`` (and optionally ``lossless``), replacing the runner the spec would get.
    """
    _check_arguments(questions, specs, repeats, max_new_tokens, temperature)
    out_dir = Path(out_dir)
    path = out_dir / RESULTS
    runners = _make_runners(target, specs, runners)

    threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # fixed for the whole run (recorded in every row)
    env = environment()
    parameters = _parameters(target, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                             threads=threads, repeats=repeats, warmup=warmup)
    by_label = {s.label: s for s in specs}
    plan = [(q, r, s) for q in questions for r in range(repeats) for s in specs]
    plan_keys = {(q.question_id, s.label, r) for q, r, s in plan}
    writer = ResultsWriter(path)
    kept = _kept_rows(path, parameters, plan_keys, by_label, force)
    done = {row_key(r) for r in kept if not r.get("error")}
    pending = [(q, r, s) for q, r, s in plan if (q.question_id, s.label, r) not in done]
    if pending and isinstance(env.get("machine"), dict):
        _record_cost_curve(target, env)

    generate = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    run = _Run(target, writer, _ar_references(kept), temperature == 0, generate, env, threads, parameters, command)
    if pending:
        _warm_up(target, pending, runners, warmup, generate)
    _measure_all(run, pending, runners, progress, path)
    rows = read_rows(path)
    if report:
        write_report(out_dir, rows)
    return rows


def _stamp(row: dict, env: dict, threads: int, parameters: dict, command: str) -> None:
    row.update(
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=env["machine"], software=env["software"], commit=env["commit"], threads=threads,
        parameters=parameters, command=command,
    )


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())
