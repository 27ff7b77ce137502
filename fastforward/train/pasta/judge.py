"""A quality judge for PASTA's preference stage (BoNBoN: ``speedup + lambda * quality``) and its win-rate evaluation.

The paper asks Gemini which of two answers is better. Nothing here can call an external LLM, so the default judge is
a **proxy**, and what it supports are proxy claims only -- they are not comparable to AlpacaEval or the paper's
numbers. The proxy score of an answer ``y`` (plain, tag-stripped text) to a prompt ``x`` is::

    s(y) = mean log p(y | x) under the frozen ORIGINAL model   (fluency, and staying the model the user had)
         + ROUGE-L F1(y, baseline answer)                      (only when a baseline answer is given)
         + ROUGE-L F1(y, reference answer)                     (only when a reference exists)
         - w_rep * (1 - distinct-2(y))                         (repetition penalty; off by default, w_rep = 0)

and the paper's pairwise structure is kept: ``P(a > b) = sigmoid((s(a) - s(b)) / tau)`` is the confidence of a win
of ``a`` over ``b`` (``1 - P`` that of a loss), the same whichever order the two are given in. ``tau = 0.25``: the
score's parts each span about one unit (ROUGE-L in [0, 1]; mean log-probs of sensible answers differ by 0.1-1 nat),
so a difference of 0.1 gives 0.6 and one of 0.5 gives 0.88 -- judge-like confidences, neither coin flips nor
certainties. The quality of a sample (:func:`quality`) is the paper's confidence-weighted win/loss ratio against
the Baseline answer and the reference answer (:func:`win_loss_ratio`, ``eps = 0.1``, so two comparisons give a
ratio in about [0.05, 21]). A comparison answer is never also an anchor of its own comparison: it would match
itself with ROUGE-L 1 and be nearly unbeatable. The evaluation win rate (:func:`win_rate`) counts a win when
``P(M > B) > 0.5 + margin`` and a tie inside ``[0.5 - margin, 0.5 + margin]``; the default ``margin = 0.0`` makes a
tie an exactly undecided judgment (e.g. :class:`OpenAIJudge`'s two orders cancelling out).

:class:`OpenAIJudge` is the pluggable real judge: any OpenAI-compatible ``/v1/chat/completions`` endpoint, asked in
both orders. Both judges satisfy :class:`Judge` (``compare`` gives ``P(a better)``); a text prompt works for both.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ...errors import UsageError

DEFAULT_TAU = 0.25
DEFAULT_EPS = 0.1
DEFAULT_MARGIN = 0.0
_WORD = re.compile(r"[^\W_]+")


# --- ROUGE-L, distinct-n -----------------------------------------------------------------------------------------

def words(text: str) -> list[str]:
    """Lowercased alphanumeric word tokens (anything else separates words)."""
    return _WORD.findall(text.lower())


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, bit-parallel (one big-integer step per element of ``b``)."""
    masks: dict = {}
    for i, x in enumerate(a):
        masks[x] = masks.get(x, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for y in b:
        u = v & masks.get(y, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F1 (beta = 1, so symmetric) over :func:`words`. Both texts without words: 1.0 (identical);
    exactly one without words: 0.0."""
    wa, wb = words(a), words(b)
    if not wa and not wb:
        return 1.0
    lcs = lcs_length(wa, wb)
    return 0.0 if lcs == 0 else 2.0 * lcs / (len(wa) + len(wb))  # 2PR/(P+R) with P=lcs/|a|, R=lcs/|b|


def distinct_n(text: str, n: int = 2) -> float:
    """Distinct n-grams over all n-grams of :func:`words` (1.0 when there are fewer than ``n`` words)."""
    w = words(text)
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


# --- log-probabilities under the original model -------------------------------------------------------------------

def _hf(model):
    return model if isinstance(model, torch.nn.Module) else model.hf_model  # a TargetModel gives its HF model


def _check_pair(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> None:
    if not answer_ids:
        raise UsageError("mean_logprob needs a non-empty answer (there is no token to score)")
    if not prompt_ids:
        raise UsageError("mean_logprob needs a non-empty prompt (the first answer token is conditioned on it)")


@torch.no_grad()
def mean_logprobs(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 4) -> list[float]:
    """:func:`mean_logprob` of many ``(prompt_ids, answer_ids)`` pairs, right-padded batches with an attention
    mask (the padding follows every real token, so it changes nothing but rounding)."""
    hf = _hf(model)
    device = next(hf.parameters()).device
    out: list[float] = []
    for s in range(0, len(pairs), max(1, batch_size)):
        chunk = [(list(p), list(a)) for p, a in pairs[s:s + max(1, batch_size)]]
        for p, a in chunk:
            _check_pair(p, a)
        width = max(len(p) + len(a) for p, a in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (p, a) in enumerate(chunk):
            ids[r, :len(p) + len(a)] = torch.tensor(p + a)
            mask[r, :len(p) + len(a)] = 1
        logits = hf(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        for r, (p, a) in enumerate(chunk):
            rows = logits[r, len(p) - 1:len(p) + len(a) - 1].float()  # row t predicts token t+1
            logp = torch.log_softmax(rows, dim=-1).gather(-1, torch.tensor(a, device=device)[:, None])
            out.append(float(logp.mean()))
    return out


@torch.no_grad()
def mean_logprob(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """Mean over the answer's tokens of ``log p(token | prompt, earlier answer tokens)`` (natural log)."""
    _check_pair(prompt_ids, answer_ids)
    hf = _hf(model)
    device = next(hf.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=device)
    logits = hf(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(answer_ids, device=device)[:, None])
    return float(logp.mean())


# --- pairwise form, win/loss ratio, win rate ----------------------------------------------------------------------

def preference_prob(score_a: float, score_b: float, tau: float = DEFAULT_TAU) -> float:
    """``P(a > b) = sigmoid((s(a) - s(b)) / tau)``; ``P(a > b) + P(b > a) = 1``."""
    if not tau > 0:
        raise UsageError(f"tau must be positive, got {tau}")
    x = (score_a - score_b) / tau
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else 1.0 - 1.0 / (1.0 + math.exp(x))


def judgment(p_better: float) -> tuple[str, float]:
    """``(preference, confidence)`` from ``P(y > r)``: ``("win", p)``, ``("loss", 1 - p)`` or ``("tie", 0.5)``."""
    if p_better > 0.5:
        return "win", p_better
    return ("loss", 1.0 - p_better) if p_better < 0.5 else ("tie", 0.5)


def win_loss_ratio(judgments: Sequence[tuple[str, float]], eps: float = DEFAULT_EPS) -> float:
    """The paper's quality: ``(sum conf * [win] + eps) / (sum conf * [loss] + eps)``; a tie counts as neither."""
    wins = losses = 0.0
    for pref, conf in judgments:
        if pref not in ("win", "loss", "tie") or not 0.0 <= conf <= 1.0:
            raise UsageError(f"a judgment is ('win'|'loss'|'tie', confidence in [0, 1]), got {(pref, conf)!r}")
        wins += conf if pref == "win" else 0.0
        losses += conf if pref == "loss" else 0.0
    return (wins + eps) / (losses + eps)


@dataclass(frozen=True)
class WinRate:
    rate: float  # (wins + ties / 2) / n
    wins: int
    ties: int
    losses: int


def win_rate(p_better: Sequence[float], margin: float = DEFAULT_MARGIN) -> WinRate:
    """Win rate of M over the Baseline from per-prompt ``P(M > B)``: a win above ``0.5 + margin``, a loss below
    ``0.5 - margin``, a tie in between."""
    if not p_better:
        raise UsageError("win_rate needs at least one judgment")
    wins = sum(p > 0.5 + margin for p in p_better)
    losses = sum(p < 0.5 - margin for p in p_better)
    ties = len(p_better) - wins - losses
    return WinRate((wins + ties / 2) / len(p_better), wins, ties, losses)


# --- judges -------------------------------------------------------------------------------------------------------

class Judge(Protocol):
    def compare(self, prompt, a_text: str, b_text: str, baseline_text: str | None = None,
                reference_text: str | None = None) -> float:
        """P(answer a is better than answer b) for ``prompt``."""


def quality(judge: Judge, prompt, text: str, baseline_text: str, reference_text: str | None = None,
            eps: float = DEFAULT_EPS) -> float:
    """The paper's quality of a sample: :func:`win_loss_ratio` of its judgments against the Baseline answer and
    (when there is one) the reference answer; each comparison answer is left out of its own comparison's anchors."""
    probs = [judge.compare(prompt, text, baseline_text, None, reference_text)]
    if reference_text is not None:
        probs.append(judge.compare(prompt, text, reference_text, baseline_text, None))
    return win_loss_ratio([judgment(p) for p in probs], eps)


def judge_win_rate(judge: Judge, prompts: Sequence, answers: Sequence[str], baseline_answers: Sequence[str],
                   references: Sequence[str | None] | None = None, margin: float = DEFAULT_MARGIN) -> WinRate:
    """:func:`win_rate` of ``answers`` over ``baseline_answers`` (one per prompt), judged by ``judge``."""
    refs = list(references) if references is not None else [None] * len(prompts)
    if not len(prompts) == len(answers) == len(baseline_answers) == len(refs):
        raise UsageError("judge_win_rate needs one answer, one baseline answer (and one reference) per prompt")
    rows = zip(prompts, answers, baseline_answers, refs, strict=True)
    return win_rate([judge.compare(x, a, b, None, r) for x, a, b, r in rows], margin)


class ProxyJudge:
    """The proxy judge (see the module docstring); ``model`` is the frozen ORIGINAL model (HF or TargetModel)."""

    def __init__(self, model, tokenizer, tau: float = DEFAULT_TAU, w_logprob: float = 1.0, w_baseline: float = 1.0,
                 w_reference: float = 1.0, w_repetition: float = 0.0):
        if not tau > 0:
            raise UsageError(f"tau must be positive, got {tau}")
        self.model, self.tokenizer, self.tau = model, tokenizer, tau
        self.w_logprob, self.w_baseline, self.w_reference, self.w_repetition = w_logprob, w_baseline, w_reference, \
            w_repetition

    def _ids(self, prompt) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)

    def score(self, prompt_ids, text: str, baseline_text: str | None = None,
              reference_text: str | None = None) -> float:
        """``s(text)``: the proxy score of a plain answer (``prompt_ids`` may also be the prompt's text)."""
        answer = self.tokenizer.encode(text, add_special_tokens=False)
        s = self.w_logprob * mean_logprob(self.model, self._ids(prompt_ids), answer)
        if baseline_text is not None:
            s += self.w_baseline * rouge_l(text, baseline_text)
        if reference_text is not None:
            s += self.w_reference * rouge_l(text, reference_text)
        if self.w_repetition:
            s -= self.w_repetition * (1.0 - distinct_n(text, 2))
        return s

    def compare(self, prompt_ids, a_text: str, b_text: str, baseline_text: str | None = None,
                reference_text: str | None = None) -> float:
        """``P(a > b) = sigmoid((s(a) - s(b)) / tau)``, both scored against the same anchors."""
        s_a = self.score(prompt_ids, a_text, baseline_text, reference_text)
        s_b = self.score(prompt_ids, b_text, baseline_text, reference_text)
        return preference_prob(s_a, s_b, self.tau)


JUDGE_INSTRUCTION = (
    "You are a careful judge of answer quality. You will see a user's question and two answers, A and B. Decide "
    "which answer is better: more helpful, correct, complete and clear. Reply with one line only: the letter of "
    "the better answer (A or B), a space, and your confidence that it is the better one, a number between 0.5 "
    "and 1. For example: A 0.8"
)
_REPLY = re.compile(r"\s*\**([AB])\**[\s:,]+(1(?:\.0*)?|0?\.\d+|0)\s*\.?\s*")


def check_judge_url(url: str) -> str:
    """A judge endpoint's address, checked before any work: ``http://`` or ``https://`` and a host."""
    try:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    except ValueError:  # e.g. an unclosed [IPv6] bracket
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"the judge URL must be an http:// or https:// address (e.g. http://host:8000/v1), "
                         f"got {url!r}")
    return url


class OpenAIJudge:
    """An OpenAI-compatible chat-completions judge, asked in both orders (A/B, then B/A) to cancel position bias;
    sends :data:`JUDGE_INSTRUCTION` as the system message and parses a reply like ``A 0.8`` or ``B 0.65``."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0):
        base = check_judge_url(base_url).rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model, self.api_key, self.timeout = model, api_key, timeout

    def _ask(self, prompt_text: str, first: str, second: str) -> float:
        """P(first better) from one request."""
        user = f"Question:\n{prompt_text}\n\nAnswer A:\n{first}\n\nAnswer B:\n{second}"
        body = {"model": self.model, "temperature": 0, "max_tokens": 10,
                "messages": [{"role": "system", "content": JUDGE_INSTRUCTION}, {"role": "user", "content": user}]}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                reply = json.loads(resp.read().decode())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            raise UsageError(f"the judge at {self.url} answered HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UsageError(f"cannot reach the judge at {self.url}: {getattr(e, 'reason', e)}") from None
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise UsageError(f"the judge at {self.url} sent no chat completion ({type(e).__name__})") from None
        m = _REPLY.fullmatch(reply) if isinstance(reply, str) else None
        if m is None:
            raise UsageError(f"the judge at {self.url} replied {str(reply)[:60]!r}, expected e.g. 'A 0.8' or 'B 0.65'")
        conf = float(m.group(2))
        return conf if m.group(1) == "A" else 1.0 - conf

    def compare(self, prompt_text: str, a_text: str, b_text: str, baseline_text: str | None = None,
                reference_text: str | None = None) -> float:
        """P(a better): the mean of both orders. The anchors are a proxy device and are ignored here."""
        return 0.5 * (self._ask(prompt_text, a_text, b_text) + 1.0 - self._ask(prompt_text, b_text, a_text))
