"""The PASTA miniature's evaluation: several models against one Baseline on held-apart prompts.

For each prompt, the Baseline and every PASTA model decode it greedily through the same interpreter
(:class:`~fastforward.pasta.interpreter.PastaProposer`; the Baseline has no PASTA-LANG tokens, so it runs its main
thread only -- exactly ``ar``), the models interleaved prompt by prompt so that slow drift of the machine hits all
alike. Per model: the paper's §5.1 metrics (:mod:`fastforward.pasta.metrics`: theoretical speedup, realized speedup,
parallelism, as geometric means) and the judge's win rate against the Baseline's answer
(:func:`fastforward.train.pasta.judge.win_rate`: P(model ≻ Baseline) per prompt; wins + ties/2 over prompts).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ...bench.questions import parse_question_record, read_question_records
from ...errors import UsageError
from ...pasta.interpreter import PastaProposer
from ...pasta.metrics import PromptMetrics, result_theoretical, summarize, timed_decode
from ...paths import file_head, owned_json
from .judge import win_rate

REFERENCE_FILE = "reference_answer_gpt-4.jsonl"  # MT-Bench's GPT-4 reference answers, beside its questions


def read_prompts(spec: str) -> list[dict]:
    """Held-apart prompts: ``mt_bench`` question files (first turns), EAGLE-style alpaca question files
    (``turns``), or JSONL with ``prompt``; several comma-separated, taken in turn (one from each file, then the next
    from each...), so that a ``--limit`` keeps the mix. Each as ``{"id", "prompt", "reference"}``. Files are read
    and checked as ``fastforward bench`` reads its questions: a bad file or record is a one-line :class:`UsageError`."""
    files = [_file_prompts(Path(path.strip()).expanduser()) for path in spec.split(",") if path.strip()]
    if not files:
        raise UsageError("--prompts names no file")
    mixed = []
    for i in range(max(len(f) for f in files)):
        mixed += [f[i] for f in files if i < len(f)]
    return mixed


def _file_prompts(path: Path) -> list[dict]:
    if not path.is_file():
        raise UsageError(f"no prompt file {path}")
    refs = _gpt4_references(path.with_name(REFERENCE_FILE))
    prompts = []
    for n, record in read_question_records(path):
        where = f"{path} record {n}" if path.suffix == ".json" else f"{path} line {n}"
        qid, _, _, turns = parse_question_record(record, where, "", fold_mt_bench=False)
        qid = n - 1 if qid is None else qid
        ref = refs.get(qid) or record.get("reference")
        if isinstance(ref, list):  # MT-Bench's short gold answers, one per turn
            ref = ref[0] if ref else None
        prompts.append({"id": f"{path.parent.name}/{path.stem}:{qid}", "prompt": turns[0],
                        "reference": ref if isinstance(ref, str) else None})
    if not prompts:
        raise UsageError(f"{path} holds no prompts")
    return prompts


def _gpt4_references(path: Path) -> dict:
    """MT-Bench's GPT-4 reference answers (math, reasoning, coding) by question id; none without the file."""
    if not path.is_file():
        return {}
    refs = {}
    for n, record in read_question_records(path):
        try:
            qid, answer = record["question_id"], record["choices"][0]["turns"][0]
            if not isinstance(answer, str):
                raise TypeError
            refs[qid] = answer
        except (KeyError, IndexError, TypeError):
            raise UsageError(f"{path} line {n} is not an MT-Bench reference answer "
                             "(question_id, choices[0].turns[0])") from None
    return refs


def leave_out(prompts: list[dict], exclude: str) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): ``prompts`` split by whether their text is the ``prompt`` of a training record in
    ``exclude`` (make-data or annotated JSONL files, comma-separated)."""
    from .methods import read_records

    seen = {str(r["prompt"]).strip()
            for r in read_records(exclude, ("prompt",), "a training record (make-data or 'pasta annotate' output)")}
    kept = [p for p in prompts if p["prompt"].strip() not in seen]
    return kept, [p for p in prompts if p["prompt"].strip() in seen]


def is_evaluate_result(path) -> bool:
    """Whether ``path`` is empty or holds an :func:`evaluate_models` result (what ``pasta evaluate --out`` writes; a
    long one by its start: :func:`~fastforward.paths.owned_json` reads a bounded prefix)."""
    head = file_head(path)
    if head is not None and head[1] and not head[0].strip():
        return True
    return owned_json(path, lambda data: isinstance(data, dict) and set(data) == {"models", "baseline"}, "models")


def evaluate_models(baseline, models: dict, prompts: list[dict], judge, *, max_new_tokens: int = 256,
                    runs: int = 2, on_prompt=None) -> dict:
    """``baseline`` and ``models`` (name -> TargetModel) on ``prompts`` (:func:`read_prompts`); ``judge`` a
    :class:`~fastforward.train.pasta.judge.Judge` (its ``compare(prompt, a, b, baseline_text, reference_text)``).
    Every model first decodes a few tokens untimed (a warm-up); then each answer is decoded ``runs`` times and the
    last run timed. Returns ``{"models": {name: {"summary", "win_rate", "prompts"}}, "baseline": [...]}``."""
    make = PastaProposer
    if prompts:  # one short decode per model first, so that no model's first timed answer pays one-time costs
        for target in (baseline, *models.values()):
            timed_decode(target, target.encode(prompts[0]["prompt"], chat=True), make, 16, 1)
    rows = {name: [] for name in models}
    probs = {name: [] for name in models}
    base_rows = []
    for k, item in enumerate(prompts):
        prompt_ids = baseline.encode(item["prompt"], chat=True)
        base = timed_decode(baseline, prompt_ids, make, max_new_tokens, runs)
        base_rows.append({"id": item["id"], "tokens": len(base.token_ids), "seconds": base.stats.wall_time,
                          "text": base.text})
        for name, target in models.items():
            ids = target.encode(item["prompt"], chat=True)
            fast = timed_decode(target, ids, make, max_new_tokens, runs)
            stats = fast.stats.method_stats
            annotated = stats.get("annotated_ids", fast.token_ids)
            theory = result_theoretical(target, ids, fast, len(base.token_ids))
            realized = base.stats.wall_time / fast.stats.wall_time if fast.stats.wall_time > 0 else 0.0
            row = PromptMetrics(k, len(base.token_ids), len(fast.token_ids), len(annotated), stats.get("forks", 0),
                                theory["critical_path"], base.stats.wall_time, fast.stats.wall_time,
                                theory["theoretical_speedup"], theory["parallelism"], realized, fast.finish_reason)
            p = judge.compare(prompt_ids, fast.text, base.text, None, item.get("reference"))
            rows[name].append(row)
            probs[name].append(p)
            if on_prompt is not None:
                on_prompt(name, item, row, p, fast, stats.get("annotated", ""))
    out = {"models": {}, "baseline": base_rows}
    for name in models:
        wr = win_rate(probs[name])
        out["models"][name] = {
            "summary": summarize(rows[name]),
            "win_rate": asdict(wr),
            "prompts": [dict(asdict(r), p_better=p) for r, p in zip(rows[name], probs[name], strict=True)],
        }
    return out


def table(result: dict) -> str:
    """A markdown table of :func:`evaluate_models`' summary."""
    lines = ["| model | theoretical speedup | realized speedup | realized / theoretical | parallelism | forks per "
             "answer | proxy win rate vs Baseline (W/T/L) |", "|---|---|---|---|---|---|---|"]
    for name, r in result["models"].items():
        s, w = r["summary"], r["win_rate"]
        lines.append(f"| {name} | {s['theoretical_speedup']:.2f}x | {s['realized_speedup']:.2f}x | "
                     f"{s['realized_over_theoretical']:.2f} | {s['parallelism']:.2f} | {s['forks_per_answer']:.2f} | "
                     f"{100 * w['rate']:.1f}% ({w['wins']}/{w['ties']}/{w['losses']}) |")
    return "\n".join(lines)


__all__ = ["evaluate_models", "is_evaluate_result", "leave_out", "read_prompts", "table"]
