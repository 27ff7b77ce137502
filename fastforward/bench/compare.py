"""Comparing two benchmark runs' AR outputs: did a change of forward (weights storage, kernel, machine) change
what greedy decoding produces, and where it did, by how much did the two top logits differ?

``fastforward bench ... --out NEW --compare-ar OLD`` does it after the run (the logit gaps are recomputed with NEW's
forward over the prompt and OLD's tokens up to the divergence, as the losslessness check does) and writes
``ar-vs-<OLD>.md`` into NEW.
"""

from __future__ import annotations

from pathlib import Path

from .results import read_rows
from .runner import first_divergence, logit_gap, turn_prompt
from .spec import BASELINE


def ar_rows(out_dir: Path) -> dict[str, dict]:
    return {r["question_id"]: r for r in read_rows(Path(out_dir) / "results.jsonl")
            if r["label"] == BASELINE and not r.get("error") and r["repeat"] == 0}


def compare_ar(target, questions, new_dir: Path, old_dir: Path) -> dict:
    """Per question both runs answered: identical, or the first divergence and NEW's logit gap there."""
    new, old = ar_rows(new_dir), ar_rows(old_dir)
    texts = {q.question_id: q.turns for q in questions}
    shared = [q for q in new if q in old and q in texts]
    divergences = []
    for qid in shared:
        a, b = old[qid], new[qid]
        div = first_divergence(a["output_ids"], b["output_ids"])
        if div is None:
            continue
        entry = {"question_id": qid, "category": b["category"], **div}
        if div["ar_token"] is not None and div["token"] is not None:
            answers = [target.decode(t) for t in a["output_ids"][: div["turn"]]]
            prompt = turn_prompt(target, texts[qid][: div["turn"] + 1], answers)
            entry.update(logit_gap(target, prompt, a["output_ids"][div["turn"]], div["index"], div["token"]))
        divergences.append(entry)
    return {"questions": len(shared), "identical": len(shared) - len(divergences), "divergences": divergences}


def write_comparison(result: dict, new_dir: Path, old_dir: Path) -> Path:
    lines = [f"# AR outputs: `{new_dir}` vs `{old_dir}`", "",
             f"{result['identical']} of {result['questions']} questions token-identical.", ""]
    if result["divergences"]:
        lines += ["| question | category | turn | index | old token | new token | logit gap (new forward) |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for d in result["divergences"]:
            gap = f"{d['logit_gap']:.4f}" if "logit_gap" in d else "–"
            lines.append(f"| {d['question_id']} | {d['category']} | {d['turn']} | {d['index']} | {d['ar_token']} | "
                         f"{d['token']} | {gap} |")
    path = Path(new_dir) / f"ar-vs-{Path(old_dir).name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
