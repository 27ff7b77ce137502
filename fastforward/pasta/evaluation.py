"""The PASTA miniature's evaluation: several models against one Baseline on held-apart prompts.

For each prompt, the Baseline and every PASTA model decode it greedily through the same interpreter
(:class:`~fastforward.pasta.interpreter.PastaProposer`; the Baseline has no PASTA-LANG tokens, so it runs its main
thread only -- exactly ``ar``), the models interleaved prompt by prompt so that slow drift of the machine hits all
alike. Per model: the paper's §5.1 metrics (:mod:`fastforward.pasta.metrics`: theoretical speedup, realized speedup,
parallelism, as geometric means) and the judge's win rate against the Baseline's answer
(:func:`fastforward.pasta.judge.win_rate`: P(model ≻ Baseline) per prompt; wins + ties/2 over prompts).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..errors import UsageError
from .interpreter import PastaProposer
from .judge import win_rate
from .metrics import PromptMetrics, result_theoretical, summarize, timed_decode


def read_prompts(spec: str) -> list[dict]:
    """Held-apart prompts: ``mt_bench`` question files (first turns), EAGLE-style alpaca question files
    (``turns``), or JSONL with ``prompt``; several comma-separated, taken in turn (one from each file, then the next
    from each...), so that a ``--limit`` keeps the mix. Each as ``{"id", "prompt", "reference"}``."""
    files = []
    for path in [p.strip() for p in spec.split(",") if p.strip()]:
        p = Path(path).expanduser()
        if not p.is_file():
            raise UsageError(f"no prompt file {path}")
        prompts, refs = [], {}
        ref_file = p.with_name("reference_answer_gpt-4.jsonl")
        if ref_file.is_file():  # MT-Bench's GPT-4 reference answers (math, reasoning, coding)
            for line in ref_file.read_text().splitlines():
                r = json.loads(line)
                refs[r["question_id"]] = r["choices"][0]["turns"][0]
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            r = json.loads(line)
            text = r["turns"][0] if "turns" in r else r.get("prompt") or r.get("instruction")
            if not isinstance(text, str) or not text.strip():
                raise UsageError(f"{path}:{i + 1} has no prompt (turns, prompt or instruction)")
            qid = r.get("question_id", r.get("id", i))
            ref = refs.get(qid) or r.get("reference")
            if isinstance(ref, list):  # MT-Bench's short gold answers, one per turn
                ref = ref[0] if ref else None
            prompts.append({"id": f"{p.parent.name}/{p.stem}:{qid}", "prompt": text, "reference": ref})
        files.append(prompts)
    mixed = []
    for i in range(max((len(f) for f in files), default=0)):
        mixed += [f[i] for f in files if i < len(f)]
    return mixed


def evaluate_models(baseline, models: dict, prompts: list[dict], judge, *, max_new_tokens: int = 256,
                    runs: int = 2, on_prompt=None) -> dict:
    """``baseline`` and ``models`` (name -> TargetModel) on ``prompts`` (:func:`read_prompts`); ``judge`` a
    :class:`~fastforward.pasta.judge.Judge` (its ``compare(prompt, a, b, baseline_text, reference_text)``).
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


__all__ = ["evaluate_models", "read_prompts", "table"]
