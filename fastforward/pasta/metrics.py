"""PASTA's metrics (the paper's §5.1), as geometric means over prompts.

* **Theoretical speedup** of an answer: the baseline's answer length in tokens (the baseline model's own answer
  to the same prompt, EOS included: the forwards autoregressive decoding needs) over the PASTA answer's critical
  path -- the forwards the interpreter needs with one token per live thread per step (the prefill included), which
  is :func:`~fastforward.pasta.layout.pasta_layout`'s ``forwards``, the same schedule the interpreter runs.
* **Theoretical parallelism**: the PASTA answer's tokens without tags and topics (EOS included) over its critical
  path (1.0 for a plain answer).
* **Realized speedup**: wall time of the baseline model over that of the PASTA model, both decoded by the same
  interpreter (a model without PASTA-LANG tokens runs only its main thread), greedy, one sequence; every prompt is
  decoded twice and the second run is timed.

The statistics themselves (the geometric mean) live in :mod:`fastforward.stats`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import PastaSyntaxError
from ..stats import geomean
from .interpreter import PastaMethod
from .language import PastaVocab, strip_ids
from .layout import pasta_layout


def critical_path(prompt_ids, answer_ids, vocab: PastaVocab | None, eos_ids=()) -> int:
    """Forwards the interpreter needs to choose every token of this answer (the prefill included); a plain answer
    of n tokens takes n."""
    answer = list(answer_ids)
    if vocab is None:
        return max(1, len(answer))
    return pasta_layout(prompt_ids, answer, vocab, eos_ids).forwards


def theoretical(prompt_ids, answer_ids, vocab: PastaVocab | None, baseline_length: int, eos_ids=()) -> dict:
    """Theoretical speedup and parallelism of one PASTA answer (token ids, tags included) against a baseline
    answer of ``baseline_length`` tokens."""
    path = critical_path(prompt_ids, answer_ids, vocab, eos_ids)
    plain = len(strip_ids(list(answer_ids), vocab))
    return {"critical_path": path, "plain_tokens": plain, "baseline_tokens": baseline_length,
            "theoretical_speedup": baseline_length / path, "parallelism": plain / path}


def result_theoretical(target, prompt_ids, result, baseline_length: int) -> dict:
    """:func:`theoretical` of an interpreter result (its annotated ids); an answer cut by the token budget inside a
    block does not parse, and then the forwards the interpreter actually took are its critical path."""
    vocab = PastaVocab.from_tokenizer(target.tokenizer) if result.stats.method_stats.get("pasta_tokens") else None
    ids = list(result.stats.method_stats.get("annotated_ids", result.token_ids))
    try:
        return theoretical(prompt_ids, ids, vocab, baseline_length, target.eos_token_ids)
    except PastaSyntaxError:
        path = result.stats.target_forwards
        return {"critical_path": path, "plain_tokens": len(result.token_ids), "baseline_tokens": baseline_length,
                "theoretical_speedup": baseline_length / path, "parallelism": len(result.token_ids) / path}


@dataclass
class PromptMetrics:
    prompt: int
    baseline_tokens: int
    pasta_tokens: int  # plain tokens of the PASTA answer
    annotated_tokens: int
    forks: int
    critical_path: int
    baseline_seconds: float
    pasta_seconds: float
    theoretical_speedup: float
    parallelism: float
    realized_speedup: float
    finish_reason: str


def timed_decode(target, prompt_ids, proposer_factory, max_new_tokens: int, runs: int = 2):
    """Decode ``runs`` times (the paper: twice) with a fresh proposer each time; the last run's result (and its wall
    time)."""
    from ..engine import Generation

    result = None
    for _ in range(runs):
        gen = Generation(target, prompt_ids, proposer_factory(target), max_new_tokens=max_new_tokens)
        result = gen.run()
    return result


def evaluate(baseline, pasta, prompts: list[list[int]], *, max_new_tokens: int = 256, proposer=None,
             on_prompt=None) -> dict:
    """The three metrics of the PASTA model ``pasta`` against the baseline model ``baseline`` (TargetModels) on
    ``prompts`` (token ids, chat template applied). ``proposer(target)`` makes the interpreter's proposer (default
    :class:`PastaMethod`); ``on_prompt(PromptMetrics)`` is called after each prompt. Returns
    ``{"prompts": [...], "summary": {...}}`` with geometric means."""
    make = proposer or (lambda target: PastaMethod(target))
    rows = []
    for i, prompt in enumerate(prompts):
        base = timed_decode(baseline, prompt, make, max_new_tokens)
        fast = timed_decode(pasta, prompt, make, max_new_tokens)
        stats = fast.stats.method_stats
        annotated = stats.get("annotated_ids", fast.token_ids)
        theory = result_theoretical(pasta, prompt, fast, len(base.token_ids))
        row = PromptMetrics(i, len(base.token_ids), len(fast.token_ids), len(annotated), stats.get("forks", 0),
                            theory["critical_path"], base.stats.wall_time, fast.stats.wall_time,
                            theory["theoretical_speedup"], theory["parallelism"],
                            base.stats.wall_time / fast.stats.wall_time if fast.stats.wall_time > 0 else 0.0,
                            fast.finish_reason)
        rows.append(row)
        if on_prompt is not None:
            on_prompt(row)
    return {"prompts": [asdict(r) for r in rows], "summary": summarize(rows)}


def summarize(rows: list[PromptMetrics]) -> dict:
    """Geometric means over prompts (and the realized/theoretical ratio the paper's Fig. 4 compares)."""
    theo = geomean(r.theoretical_speedup for r in rows)
    real = geomean(r.realized_speedup for r in rows)
    return {"prompts": len(rows), "theoretical_speedup": theo, "realized_speedup": real,
            "parallelism": geomean(r.parallelism for r in rows), "realized_over_theoretical": real / theo,
            "forks_per_answer": sum(r.forks for r in rows) / len(rows) if rows else 0.0}
