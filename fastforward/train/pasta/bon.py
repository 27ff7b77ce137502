"""PASTA's preference stage: one BoNBoN round (paper §4), on this machine's scale.

1. **Sample** (:func:`sample_record`): for each training prompt, ``n`` PASTA-LANG answers of the Pasta-SFT model,
   decoded *through the interpreter* at temperature 1 (the paper's T = 1) -- all ``n`` in one batched decode
   (:func:`fastforward.generate_batch`: one forward per step carries every live thread of every sample).
2. **Score**: ``score = theoretical speedup + λ · quality``. The theoretical speedup is the baseline answer's length
   (the untouched model's greedy answer from ``make-data``, EOS included) over the sample's critical path
   (:func:`~fastforward.pasta.metrics.theoretical`). The quality is the paper's confidence-weighted win/loss ratio
   of the sample against the baseline answer (and the reference answer when the record has one), with the
   confidences given by a judge (:mod:`fastforward.train.pasta.judge`: the proxy by default). Sampling stores both terms
   apart, so one sampling pass serves every λ.
3. **Pair**: the best-scoring sample is ``y+``, the worst ``y-`` (:func:`best_worst`); a prompt whose samples all
   score the same gives no pair.
4. **Loss** (:func:`bonbon_loss`): ``-α log p(y+) + (1 - α)(log p(y+)/p(y-) - log p0(y+)/p0(y-) - 1/β)²`` with
   α = 0.005, log-probabilities summed over the answer's rows under the PASTA masks, positions and targets
   (:func:`~fastforward.train.pasta.sft.pasta_batch`), and ``p0`` the Pasta-SFT model. **β is not given in the
   paper**; it is derived from BoNBoN's theory (:func:`bonbon_margin`): under the best-of-n distribution
   ``log πn(y)/π0(y) = log n + (n-1) log F(y)`` (F the score's CDF under π0), and for the best and worst of n
   samples ``E[log F]`` of the uniform order statistics are ``-1/n`` and ``-H_n``, so the expected log-ratio gap the
   pair should show is ``(n-1)(H_n - 1/n) = (n-1) H_{n-1}`` -- the target margin ``1/β`` (BoNBoN's code writes it
   ``1/(2β)``; the same number).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ...errors import UsageError
from ...pasta.language import PastaVocab
from ...pasta.metrics import result_theoretical
from .judge import quality as judge_quality
from .sft import pasta_token_losses

ALPHA = 0.005  # the paper's weight of the SFT term


def bonbon_margin(n: int) -> float:
    """The log-likelihood-ratio gap BoNBoN's theory predicts between the best and worst of ``n`` samples,
    ``(n-1) * H_{n-1}`` (25.46 for n = 10, 18.15 for n = 8, 5.50 for n = 4): PASTA's ``1/β``."""
    if not isinstance(n, int) or n < 2:
        raise UsageError(f"best-of-n needs n >= 2 samples per prompt, got {n}")
    return (n - 1) * sum(1.0 / k for k in range(1, n))


@dataclass
class Sample:
    """One sampled PASTA answer and its two score terms."""

    ids: list[int]  # the annotated answer (tags included, EOS when it ended)
    text: str  # the plain text a reader sees
    finish_reason: str
    critical_path: int
    theoretical_speedup: float
    parallelism: float
    quality: float  # the judge's win/loss ratio against the comparison answers

    def score(self, lam: float) -> float:
        return self.theoretical_speedup + lam * self.quality


def sample_record(target, judge, record: dict, n: int, *, temperature: float = 1.0, max_new_tokens: int = 384,
                  seed: int = 0) -> list[Sample]:
    """``n`` interpreter samples of ``target`` (a PASTA model) for one annotate/make-data ``record``
    (``prompt_ids``, the baseline answer ``response_ids``/``response``, optionally ``reference``), scored."""
    from ...api import generate_batch

    vocab = PastaVocab.from_tokenizer(target.tokenizer)
    if vocab is None:
        raise UsageError(f"{target.name} has no PASTA-LANG tokens: sample from a Pasta-SFT model")
    prompt = list(record["prompt_ids"])
    baseline_tokens = len(record["response_ids"])
    baseline = baseline_text(target, record)
    results = generate_batch(target, [prompt] * n, "pasta", max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=[seed * 1_000_003 + i for i in range(n)])
    samples = []
    for res in results:
        ids = list(res.stats.method_stats.get("annotated_ids", res.token_ids))
        theory = result_theoretical(target, prompt, res, baseline_tokens)
        quality = judge_quality(judge, prompt, res.text, baseline_text=baseline,
                                reference_text=record.get("reference"))
        samples.append(Sample(ids, res.text, res.finish_reason, theory["critical_path"],
                              theory["theoretical_speedup"], theory["parallelism"], quality))
    return samples


def baseline_text(target, record: dict) -> str:
    """The text of a record's baseline answer: its ``response`` (annotate output), else its ``response_ids`` decoded
    without special tokens (make-data records carry the ids only)."""
    if isinstance(record.get("response"), str):
        return record["response"]
    return target.tokenizer.decode(record["response_ids"], skip_special_tokens=True)


def best_worst(samples: list[Sample], lam: float) -> tuple[Sample, Sample] | None:
    """(y+, y-): the highest- and lowest-scoring samples (the first of equals); None when all scores tie."""
    if len(samples) < 2:
        return None
    scores = [s.score(lam) for s in samples]
    hi = max(range(len(samples)), key=lambda i: (scores[i], -i))
    lo = min(range(len(samples)), key=lambda i: (scores[i], i))
    if scores[hi] == scores[lo] or samples[hi].ids == samples[lo].ids:
        return None
    return samples[hi], samples[lo]


def sample_to_dict(s: Sample) -> dict:
    return asdict(s)


def sample_from_dict(d: dict) -> Sample:
    return Sample(**{k: d[k] for k in Sample.__dataclass_fields__})


def sequence_logprobs(model, batch: dict) -> torch.Tensor:
    """log p(answer | prompt) per row of a :func:`~fastforward.train.pasta.sft.pasta_batch`: the sum over its target
    rows."""
    return -pasta_token_losses(model, batch).sum(1)


def bonbon_loss(chosen, rejected, ref_chosen, ref_rejected, margin: float, alpha: float = ALPHA):
    """Per-pair BoNBoN loss (see the module docstring); all arguments are summed log-probabilities [B]."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    return -alpha * chosen + (1.0 - alpha) * (h - margin) ** 2


def check_lambda(lam: float) -> float:
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise UsageError(f"--lam must be a finite number >= 0, got {lam}")
    return float(lam)
