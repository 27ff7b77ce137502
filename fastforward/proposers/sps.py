"""Speculative sampling with a draft model (SpS): a small LM sharing the target's tokenizer drafts a chain of tokens
autoregressively; the target verifies the chain in one forward.

Sources: Leviathan, Kalman & Matias, *Fast Inference from Transformers via Speculative Decoding* (ICML 2023,
arXiv:2211.17192); Chen et al., *Accelerating Large Language Model Decoding with Speculative Sampling*
(arXiv:2302.01318) -- the SpS baseline of FastEagle's Table 1.

* **The draft model** (``-o draft=PATH``): a fastforward draft-model folder (``fastforward train draft-model``; its
  embedding and head are the target's, see :mod:`fastforward.drafters.draft_model`), or any model
  :func:`fastforward.load` reads (an HF folder, a ``.gguf`` file, an alias) whose tokenizer is the target's (same
  vocabulary size, same vocabulary, same ids for a probe text; otherwise a one-line error naming both models). From
  Python, ``draft`` may also be a loaded :class:`~fastforward.model.TargetModel`. A path is loaded once per target
  and process and reused (the benchmark makes a proposer per prompt).
* **Its KV cache** (``draft.new_cache``) is kept in step with the sequence: each step feeds the draft only what it
  has not seen (the root and the tokens accepted since), then one token per drafted token; after verification the
  cache is cropped back to the drafted tokens that were accepted. No per-step work grows with the generation.
* **Greedy**: the draft's argmax chain, verified as point-mass guesses. **Temperature > 0**: each draft token is
  sampled from ``q = target_probs(draft logits)`` (the run's temperature/top-k/top-p and generator), and the ``q``
  rows go into ``DraftTree.draft_probs``, so verification is the lossless rejection scheme of the papers (accept
  ``x`` with ``min(1, p(x)/q(x))``, else sample the normalised residual ``max(p - q, 0)``).
* **Draft length** ``k``: by default chosen every step, 0..8, to maximise expected tokens per millisecond: expected
  tokens ``1 + a + ... + a^k`` from a running estimate of the acceptance rate ``a`` (as prompt lookup does), cost
  ``t(k+1)`` of the target's forward from this machine's cost model plus ``k`` draft forwards at the draft's own
  cost. A fixed k (the papers use 4-5) is right on a GPU, where verification is nearly free; on a CPU a
  full-vocabulary draft token costs a sizeable fraction of a target step and acceptance varies by prompt, so the
  best length varies too (0 -- plain decoding -- when the draft does not pay off). Greedy runs read the live cost
  models (:class:`~fastforward.costs.CostModel`: the cached curves corrected by the run's own timings; the output is
  the same whatever the length). Sampled runs read the cached curves alone, not the wall clock: their drafts carry
  draft probabilities, whose rejection draws depend on the length, so a seeded sampling run stays reproducible.
  ``-o k=N`` fixes it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .. import model
from ..costs import AcceptanceEstimate, best_chain_length, cost_model
from ..drafters import shipped_drafter
from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..errors import FastForwardError, UsageError
from ..model import TargetModel
from ..tree import DraftTree
from ..verify import argmax_rows, sample, target_probs
from . import register
from ._options import Option

K_MAX = 8  # the longest chain the adaptive length considers
FIXED_K_MAX = 32  # the longest fixed chain: k draft-model forwards per step, 1 + k rows per target forward
CHUNK = 256  # tokens per draft forward while reading the prompt
# A text both tokenizers must split into the same ids (letters, digits, code, accents, CJK, a chat special token).
PROBE_TEXT = "The quick brown fox jumps: 3.14159, print('hi')\n\tüber ñandú 日本語 <|im_end|> t1 t7 t42"


# ------------------------------------------------------------------------------------------------------------------
# The draft model
# ------------------------------------------------------------------------------------------------------------------


def _probe_ids(tokenizer) -> list[int]:
    return list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])


def check_same_tokenizer(target, draft, name: str) -> None:
    """Refuse (one line) a draft model whose tokenizer is not the target's."""
    def refuse(why):
        raise UsageError(f"sps: the draft model {name} does not share the tokenizer of the target {target.name} "
                         f"({why})")

    if draft.vocab_size != target.vocab_size:
        refuse(f"vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}")
    if draft.tokenizer is target.tokenizer:
        return
    mine, theirs = getattr(target.tokenizer, "get_vocab", None), getattr(draft.tokenizer, "get_vocab", None)
    if mine is not None and theirs is not None and mine() != theirs():
        refuse("the vocabularies differ")
    try:
        same = _probe_ids(target.tokenizer) == _probe_ids(draft.tokenizer)
    except Exception as exc:  # a tokenizer that cannot encode the probe text at all
        refuse(f"encoding a probe text failed: {exc}")
    if not same:
        refuse("they give different ids for the same text")


def _load_named_draft(draft: str) -> TargetModel:
    """:func:`fastforward.load` of a draft model given by path or name; a failure is one line naming the draft (a
    broken file of the draft must not read as a broken target)."""
    try:
        return model.load(draft)  # looked up at call time, like every caller of fastforward.load
    except FastForwardError as exc:
        raise type(exc)(f"sps: option draft: {exc}") from None
    except Exception as exc:  # a truncated or corrupt file: transformers, safetensors and gguf raise their own kinds
        raise UsageError(f"sps: cannot load the draft model '{draft}': its files are truncated, corrupt or of a kind "
                         f"it cannot read ({type(exc).__name__}: {exc})") from None


def load_draft(target, draft) -> TargetModel:
    """The draft model ``draft`` (a path/alias or a loaded TargetModel) for ``target``, checked; paths are loaded once
    per target and process."""
    if isinstance(draft, TargetModel):
        check_same_tokenizer(target, draft, repr(draft.name))
        return draft
    if not isinstance(draft, (str, os.PathLike)) or not str(draft).strip():
        raise UsageError(f"sps: option draft must be a path or a model name, got {draft!r}")
    path = Path(draft).expanduser()
    key = str(path.resolve()) if path.exists() else str(draft).strip().lower()
    return target.shared(("sps draft model", key), lambda: _loaded_draft(target, draft, path))


def _loaded_draft(target, draft, path: Path) -> TargetModel:
    from ..drafters.draft_model import is_draft_model, load_draft_model

    if is_draft_model(path):
        return load_draft_model(path, target)
    model = _load_named_draft(str(draft))
    check_same_tokenizer(target, model, repr(str(draft)))
    return model


# ------------------------------------------------------------------------------------------------------------------
# The proposer
# ------------------------------------------------------------------------------------------------------------------


def best_draft_length(alpha: float, max_k: int, target_curve, draft_ms: float) -> int:
    """The k in 0..max_k maximising expected tokens per millisecond: ``(1 + a + ... + a^k) / (t(k+1) + k d)``, with
    ``t`` the target's cost curve and ``d`` one draft forward's cost (k = 0: one plain step, ``1 / t(1)``); priced
    as every draft is (:func:`~fastforward.costs.best_chain_length`)."""
    return best_chain_length(alpha, max_k, target_curve, draft_ms)


class DraftModelProposer(Proposer):
    """Each step: a chain of ``k`` tokens from the draft model, with their draft probabilities when sampling."""

    name = "sps"
    drafts_with_probabilities = True

    def __init__(self, draft: TargetModel, k: int | None = None):
        self.draft = draft
        self.fixed_k = k
        self.k_max = K_MAX if k is None else k
        self.costs = self.draft_costs = None  # the target's and the draft's cost models: prepare()
        self.curve = self.draft_curve = None  # what this run sizes with: the live models, or their priors
        self._reset()

    def _reset(self) -> None:
        self.cache = None
        self.seen = 0  # tokens of the sequence whose keys/values the draft cache holds (committed)
        self.pending: tuple[int, list[int]] | None = None
        self.estimate = AcceptanceEstimate()
        self.steps = self.drafts = self.drafted = self.accepted = self.forwards = self.skipped = 0
        self.draft_seconds = 0.0

    def max_proposal_size(self) -> int:
        return 1 + self.k_max

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Feed ``ids`` at positions ``start..`` into the draft cache (committed); the last position's logits."""
        t0 = time.perf_counter()
        out = self.draft.forward(ids, torch.arange(start, start + ids.numel()), self.cache, last_only=True)
        self.cache.keep(range(ids.numel()))
        self.seen = start + ids.numel()
        self.forwards += 1
        seconds = time.perf_counter() - t0
        self.draft_seconds += seconds
        if ids.numel() == 1 and self.draft_costs is not None:  # a drafting call: the draft's t(1), live
            self.draft_costs.observe(1, seconds)
        return out.logits[-1]

    def _catch_up(self, state: DecodeState, end: int) -> torch.Tensor | None:
        """Feed the sequence's tokens ``seen .. end-1`` (in chunks); the logits after the last one."""
        logits = None
        while self.seen < end:
            stop = min(end, self.seen + CHUNK)
            logits = self._forward(state.ids[self.seen : stop], self.seen)
        return logits

    def prepare(self, target) -> None:
        if self.fixed_k is None and self.costs is None:
            self.costs, self.draft_costs = cost_model(target), cost_model(self.draft)

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self._reset()
        capacity = min(self.draft.max_context, state.prompt_length + state.max_new_tokens + self.k_max + 1)
        self.cache = self.draft.new_cache(capacity)
        if self.fixed_k is None:
            self.prepare(state.target)
            live = state.sampling.greedy  # sampled drafts carry probabilities: their length must not follow the clock
            self.curve = self.costs if live else self.costs.prior
            self.draft_curve = self.draft_costs if live else self.draft_costs.prior
        if state.length - 1 <= self.cache.capacity:
            self._catch_up(state, state.length - 1)  # the prompt; the root waits for the first draft

    def _length(self, state: DecodeState) -> int:
        k = min(self.k_max, state.remaining - 1, self.cache.capacity - state.length + 1)
        if state.max_draft_depth is not None:  # sharing a forward: deeper drafts would be cut
            k = min(k, state.max_draft_depth)
        if k <= 0 or self.fixed_k is not None:
            return max(k, 0)
        return best_draft_length(self.estimate.alpha, k, self.curve, self.draft_curve.t(1))

    def propose(self, state: DecodeState) -> Proposal | None:
        self.pending = None
        self.estimate.tick()
        self.steps += 1
        k = self._length(state)
        if k <= 0:
            self.skipped += 1
            return None
        length = state.length
        logits = self._catch_up(state, length)  # the root and whatever was accepted since the last draft
        sampling, greedy = state.sampling, state.sampling.greedy
        tokens: list[int] = []
        rows = []
        for i in range(k):
            if greedy:
                x = int(argmax_rows(logits.reshape(1, -1))[0])
            else:
                q = target_probs(logits, sampling)
                x = sample(q, state.generator)
                rows.append(q)
            tokens.append(x)
            if i + 1 < k:
                logits = self._forward(torch.tensor([x]), length + i)
        probs = None
        if rows:
            probs = torch.zeros(k + 1, rows[0].numel(), dtype=rows[0].dtype)
            probs[1:] = torch.stack(rows)
        self.pending = (length, tokens)
        self.drafts += 1
        return Proposal(DraftTree.chain(state.root, tokens, probs))

    def observe(self, state: DecodeState, step: StepResult) -> None:
        if self.pending is None:
            return
        base, tokens = self.pending
        self.pending = None
        proposed = len(step.proposal.tree) - 1  # the engine may have cut the chain to the KV room left
        accepted = step.verdict.accepted
        self.estimate.update(proposed, accepted)
        self.drafted += proposed
        self.accepted += accepted
        # The draft cache holds tokens[:-1] at positions base..; keep those that are now the sequence's, never the
        # new root (its logits start the next draft).
        limit = min(len(tokens) - 1, state.length - 1 - base)
        ok = 0
        while ok < limit and int(state.ids[base + ok]) == tokens[ok]:
            ok += 1
        self.cache.crop(base + ok)
        self.seen = base + ok

    def stats(self) -> dict:
        return {
            "draft_model": str(self.draft.name),
            "draft_layers": int(getattr(self.draft.config, "num_hidden_layers", 0)),
            "k": "adaptive" if self.fixed_k is None else self.fixed_k,
            "steps": self.steps,
            "drafts": self.drafts,
            "steps_without_draft": self.skipped,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "mean_draft_length": round(self.drafted / self.drafts, 3) if self.drafts else 0.0,
            "alpha_estimate": round(self.estimate.alpha, 3),
            "draft_forwards": self.forwards,
            "draft_ms_per_forward": round(1000 * self.draft_seconds / self.forwards, 3) if self.forwards else 0.0,
            "draft_ms_total": round(1000 * self.draft_seconds, 1),
        }


@register(
    "sps",
    "speculative sampling with a draft model sharing the target's tokenizer (-o draft=PATH): its chain verified "
    "with its own probabilities",
    source="Leviathan et al. 2023 (arXiv:2211.17192); Chen et al. 2023 (arXiv:2302.01318)",
    options=(
        Option("draft", "path", None, accepts=(TargetModel,),
               help="the draft model: a 'fastforward train draft-model' folder, an HF folder, a .gguf file or an "
                    "alias sharing the target's tokenizer (default: the one shipped for the target, if one ships)"),
        Option("k", "int", None, 1, FIXED_K_MAX, special=(None,),
               help=f"tokens drafted per step (None: chosen each step from the cost curves and the running "
                    f"acceptance rate, up to {K_MAX})",
               bound=f"time per step: k draft-model forwards one after another (1 + k rows per target forward); "
                     f"{FIXED_K_MAX} is four times the longest chain the adaptive length considers"),
    ),
)
def sps(target, *, draft=None, k=None) -> DraftModelProposer:
    """``draft``: the draft model -- a 'fastforward train draft-model' folder, an HF folder, a .gguf file or an
    alias sharing the target's tokenizer (default: the draft model shipped for this target, if one ships); ``k``:
    tokens drafted per step (default: chosen each step from this machine's cost curves and the running acceptance
    rate, up to 8)."""
    if draft is None:
        draft = shipped_drafter(target, "draft-model")
        if draft is None:
            raise UsageError(f"sps: option draft is required (no draft model ships for '{target.name}'): -o draft=PATH "
                             "(a 'fastforward train draft-model' folder, an HF folder, a .gguf file or a model alias "
                             "sharing the target's tokenizer)")
    return DraftModelProposer(load_draft(target, draft), k)
