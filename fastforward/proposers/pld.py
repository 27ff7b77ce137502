"""Prompt lookup decoding (PLD): draft the tokens that followed the latest earlier occurrence of the last n-gram.

Source: Saxena, *Prompt Lookup Decoding* (2023), github.com/apoorvumang/prompt-lookup-decoding; the same idea
ships in Hugging Face ``generate(prompt_lookup_num_tokens=...)``.
"""

from __future__ import annotations

import torch

from ..costs import AcceptanceEstimate, best_chain_length, cost_model
from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..tree import DraftTree, chain_shape
from ..validation import MAX_PROPOSAL_ROWS, check_proposal_rows
from . import register
from ._options import Option, at_most

_EMPTY = torch.zeros(0, dtype=torch.long)
#: the longest n-gram a lookup matches (pld's max_ngram, tr-jacobi's ngram): :class:`NgramIndex` keeps every n-gram
#: of the context for each size n, so its memory per context token grows as the square of this (measured: 0.3 KB
#: per token at 3, 6 KB at 32 -- 49 MB for an 8,192-token context -- and 20 KB at 64)
MAX_NGRAM = 32
NGRAM_BOUND = (f"memory: the n-gram index keeps every n-gram of the context for each size up to this, about 6 KB "
               f"per context token at {MAX_NGRAM} (growing as its square)")


def prompt_lookup(tokens: torch.Tensor, max_ngram: int = 3, num_pred: int = 10, min_ngram: int = 1) -> torch.Tensor:
    """The continuation only; see :func:`prompt_lookup_match`."""
    return prompt_lookup_match(tokens, max_ngram, num_pred, min_ngram)[0]


def prompt_lookup_match(
    tokens: torch.Tensor, max_ngram: int = 3, num_pred: int = 10, min_ngram: int = 1
) -> tuple[torch.Tensor, int]:
    """The tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram.

    ``tokens`` is the whole context (prompt + generated, last token last). For n from ``max_ngram`` down to
    ``min_ngram`` the last n tokens are searched for in ``tokens`` (the trivial match at the very end excluded);
    the first n with a match wins, and up to ``num_pred`` tokens after the **most recent** match are returned.
    Returns the continuation and the n that matched; ``(empty, 0)`` when nothing matches.

    Why the most recent match: the reference PLD implementation takes the first (oldest) match, but recent
    context predicts the continuation better -- in code editing and multi-turn chat the latest copy of a phrase
    is the one the model is currently repeating or modifying, and during generation the model's own recent
    output (e.g. a loop it is in) is what it is about to produce again. The most recent match is also the only
    one whose continuation may run into the current tail, which handles periodic text of any period. Vectorised:
    one ``unfold`` + comparison per n, no Python loop over positions.

    This whole-context search is the reference; :class:`PromptLookupProposer` gets the same answer from an
    :class:`NgramIndex` updated with only the new tokens each step.
    """
    tokens = tokens.flatten()
    length = tokens.numel()
    if num_pred <= 0:
        return _EMPTY, 0
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        if n <= 0:
            break
        # windows starting at 0 .. length-n-1 (the window at length-n is the suffix itself: excluded)
        windows = tokens[: length - 1].unfold(0, n, 1)  # [length-n, n]
        hits = (windows == tokens[length - n :]).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1, 0]) + n
            return tokens[start : start + num_pred], n
    return _EMPTY, 0


class NgramIndex:
    """:func:`prompt_lookup_match` kept up to date as the context grows, in work per new token, not per context.

    For each n in ``min_ngram..max_ngram`` a dict maps every n-gram of the context to the end (exclusive) of its
    most recent occurrence that ends before the last token -- exactly the occurrences the unfold search looks at
    (the suffix itself, ending at the last token, is registered only once another token follows it). Growing the
    context by k tokens costs k dict updates per n; a lookup, one dict probe per n.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(max(self.min_ngram, 1),
                                                                                  self.max_ngram + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens) -> None:
        """Append tokens to the indexed context."""
        tokens = self.tokens
        first_end = len(tokens)  # ends registered so far: <= len(tokens) - 1
        tokens.extend(int(t) for t in new_tokens)
        for end in range(max(first_end, 1), len(tokens)):  # n-grams ending before the (new) last token
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end

    def sync(self, tokens: torch.Tensor) -> None:
        """Index ``tokens`` (the whole context), assuming the indexed part is its prefix: only the new tail is read.
        A shorter context than the one indexed starts over."""
        length = tokens.numel()
        if length < len(self.tokens):
            self.reset()
        if length > len(self.tokens):
            self.extend(tokens[len(self.tokens) :].tolist())

    def match(self, tokens: torch.Tensor, num_pred: int) -> tuple[torch.Tensor, int]:
        """:func:`prompt_lookup_match` ``(tokens, max_ngram, num_pred, min_ngram)`` for the indexed ``tokens``."""
        tokens = tokens.flatten()
        length = len(self.tokens)
        if num_pred <= 0:
            return _EMPTY, 0
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            if n <= 0:
                break
            end = self.ends[n].get(tuple(self.tokens[length - n :]))
            if end is not None:
                return tokens[end : end + num_pred], n
        return _EMPTY, 0


class PromptLookupProposer(Proposer):
    """Each step: the continuation of the latest earlier match of the context's last n-gram, as a chain draft.

    With ``adaptive`` (the default) the draft is cut to the length that maximises expected tokens per unit of
    forward cost: the acceptance rate of matches of each n-gram size is tracked as the run goes
    (:class:`~fastforward.costs.AcceptanceEstimate`) and weighed against this machine's cost model
    (:class:`~fastforward.costs.CostModel`: the cached curve corrected by the run's own forward timings). On a CPU,
    where a 10-token verification costs about twice a 1-token step, this is what keeps prompt lookup from being
    slower than plain decoding.
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, num_pred_tokens: int = 10, min_ngram: int = 1, adaptive: bool = True):
        self.max_ngram = max_ngram
        self.num_pred_tokens = num_pred_tokens
        self.min_ngram = min_ngram
        self.adaptive = adaptive
        self.costs = None
        self.index = NgramIndex(max_ngram, min_ngram)
        self._reset()

    def _reset(self) -> None:
        self.steps = self.hits = self.drafted = self.skipped = 0
        self.estimates = {n: AcceptanceEstimate() for n in range(self.min_ngram, self.max_ngram + 1)}
        self.pending: tuple[int, int] | None = None

    def max_proposal_size(self) -> int:
        return 1 + self.num_pred_tokens

    def prepare(self, target) -> None:
        if self.adaptive:
            self.costs = cost_model(target)

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self._reset()
        self.index.reset()
        self.index.sync(state.tokens)  # the prompt and the first token
        if self.adaptive and self.costs is None:
            self.prepare(state.target)

    def propose(self, state: DecodeState) -> Proposal | None:
        self.pending = None
        for est in self.estimates.values():
            est.tick()
        k = min(self.num_pred_tokens, state.remaining - 1)
        if k <= 0:
            return None
        self.steps += 1
        self.index.sync(state.tokens)  # a no-op when observe kept it up to date
        cont, n = self.index.match(state.tokens, k)
        if cont.numel() == 0:
            return None
        self.hits += 1
        if self.adaptive:
            k = best_chain_length(self.estimates[n].alpha, cont.numel(), self.costs)
            if k == 0:
                self.skipped += 1
                return None
            cont = cont[:k]
        self.pending = (n, cont.numel())
        self.drafted += cont.numel()
        tokens = torch.cat([state.ids[state.length - 1 : state.length], cont])
        return Proposal(DraftTree(tokens, chain_shape(tokens.numel())))

    def observe(self, state: DecodeState, step: StepResult) -> None:
        self.index.sync(state.tokens)  # the tokens just accepted
        if self.pending is not None:
            n, k = self.pending
            k = min(k, len(step.proposal.tree) - 1)  # the engine may have cut the draft (KV room, shared forward)
            self.estimates[n].update(k, step.verdict.accepted)
            self.pending = None

    def stats(self) -> dict:
        return {
            "lookups": self.steps,
            "hits": self.hits,
            "hit_rate": self.hits / self.steps if self.steps else 0.0,
            "mean_draft_length": self.drafted / (self.hits - self.skipped) if self.hits > self.skipped else 0.0,
            "matches_not_drafted": self.skipped,
            "alpha_by_ngram": {n: round(e.alpha, 3) for n, e in self.estimates.items()},
        }


@register(
    "pld",
    "prompt lookup decoding: draft what followed the last n-gram's latest earlier occurrence in the context",
    source="Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding (also HF prompt_lookup_num_tokens)",
    options=(
        Option("max_ngram", "int", 3, 1, MAX_NGRAM, bound=NGRAM_BOUND,
               help="the longest n-gram matched, tried first (PLD repo: 3; HF: 2)"),
        Option("num_pred_tokens", "int", 10, 1, MAX_PROPOSAL_ROWS - 1,
               help="the most tokens drafted after a match (PLD repo: 10)",
               bound=f"rows per forward: the draft and the token before it (the engine's cap, "
                     f"{MAX_PROPOSAL_ROWS:,}, and the model's context)"),
        Option("min_ngram", "int", 1, 1, MAX_NGRAM, bound="as max_ngram's (and at most max_ngram itself)",
               help="the shortest n-gram matched (at most max_ngram)"),
        Option("adaptive", "bool", True,
               help="cut each draft to the length the cost curve and the running acceptance rate favour "
                    "(False: always the full match, as the PLD repo)"),
    ),
    checks=(at_most("min_ngram", "max_ngram"),),
)
def pld(
    target, *, max_ngram: int = 3, num_pred_tokens: int = 10, min_ngram: int = 1, adaptive: bool = True
) -> PromptLookupProposer:
    """``max_ngram``/``min_ngram``: the n-gram sizes tried, longest first (PLD repo: 3..1; HF: 2..1);
    ``num_pred_tokens``: the most tokens drafted after a match (PLD repo: 10); ``adaptive``: cut each draft to
    the length this machine's cost curve and the running acceptance rate favour (False = always the full match,
    as the PLD repo). The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`);
    here, the draft's rows against the model's context."""
    check_proposal_rows("pld", 1 + num_pred_tokens, f"num_pred_tokens {num_pred_tokens}", target.max_context)
    return PromptLookupProposer(max_ngram, num_pred_tokens, min_ngram, adaptive)
