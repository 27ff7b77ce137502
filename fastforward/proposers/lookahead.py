"""Lookahead decoding (Fu et al. 2024, "Break the sequential dependency of LLM inference using lookahead decoding").

Every step runs two branches in one target forward:

* **Lookahead branch** (aux tokens, never accepted): a 2D window of ``W`` columns x ``N-1`` levels holding the last
  ``N-1`` Jacobi iterations. Column ``i`` at level ``l`` sits at offset ``i + l`` after the root; level 0 of column 0
  is the root itself. A level-``l`` token in column ``i`` attends to the root, to level 0 of columns ``1..i`` and to
  levels ``1..l`` of its own column -- so its context is one token per offset, the diagonal-then-vertical path
  ``root, L0[1..i], L1[i], ..., Ll[i]`` (Lookahead's multi-level mask). The target's argmax at the top level gives a
  new level: one Jacobi iteration of the whole window. Each column read upwards plus its new token is an N-gram
  (``L0[i], L1[i], ..., L_{N-2}[i], new[i]``) that goes into the pool; then the window shifts down one level (the
  oldest level is dropped, level 0 moves one column left, as the root advances).
  Warm-up: level 0 starts with ``W+N-3`` random prompt tokens and the levels above fill one per step (each step
  drops the leftmost column), so after ``N-2`` steps the window holds ``N-1`` full levels.
* **Verification branch** (the draft tree): the pool maps a first token to up to ``G`` (N-1)-grams that followed it
  (LRU). The candidates keyed by the root are drafted as chains under the root, merged into a trie where they share
  prefixes. The verifier accepts the longest matching path (greedy) or samples it losslessly (point-mass drafts).

The pool is seeded with the prompt's N-grams and, after each step, with the N-grams ending at the newly emitted
tokens (as Lookahead's ``POOL_FROM_PROMPT``), besides the lookahead branch's N-grams.

**Size.** Spec-Bench's ``W=7, N=5, G=7`` puts up to 56 tokens in every forward (27 lookahead + 28 verification + the
root): nearly free on a GPU, where a forward over 56 tokens costs about what one over a single token costs, but not
on a CPU, where it costs several single-token forwards while the tokens gained per step rise only slowly with the
size (measured on SmolLM2-135M, AVX2, 2 cores: tau 1.83 at 7/5/7 against 1.40 at 1/3/2, and 0.23x against 0.86x
the speed of autoregressive decoding; ``docs/methods.md``). So options left at 0 are sized from this machine's cost
curve (:func:`size_for_curve`): the largest of :data:`SIZE_LADDER` whose largest forward costs at most
:data:`FLAT_ENOUGH` times a single-token forward, else the smallest. Options given explicitly are kept as given.
"""

from __future__ import annotations

import torch

from ..costs import CostCurve, CostModel, cost_model
from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..tree import DraftTree, TreeShape
from ..validation import MAX_PROPOSAL_ROWS, check_proposal_rows
from ..verify import argmax_rows
from . import register
from ._options import Option
from .jacobi import init_tokens

_SHAPE_CACHE_MAX = 4096

#: (window, ngram, guesses) from the papers' setting down to the smallest window that still iterates an N-gram of 3
SIZE_LADDER = ((7, 5, 7), (5, 4, 5), (3, 4, 3), (2, 3, 2), (1, 3, 2))
#: a forward of q tokens counts as nearly free when it costs at most this many single-token forwards
FLAT_ENOUGH = 1.3


def size_for_curve(curve: CostCurve | CostModel) -> tuple[int, int, int]:
    """The largest (window, ngram, guesses) of :data:`SIZE_LADDER` whose largest forward the cost curve prices at
    most :data:`FLAT_ENOUGH` single-token forwards; the smallest when none is (a CPU)."""
    for size in SIZE_LADDER:
        if curve.ratio(LookaheadProposer(*size).max_proposal_size()) <= FLAT_ENOUGH:
            return size
    return SIZE_LADDER[-1]


def window_layout(width: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(level, column) of every lookahead token: level 0 holds columns ``1..width`` (column 0 is the root), each
    level above holds columns ``0..width``; returned as two ``[a]`` long tensors in input order."""
    lv = [torch.zeros(width, dtype=torch.long)] + [torch.full((width + 1,), lvl) for lvl in range(1, levels)]
    col = [torch.arange(1, width + 1)] + [torch.arange(width + 1) for _ in range(1, levels)]
    return torch.cat(lv), torch.cat(col)


def window_mask(width: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookahead branch's ``[a, a]`` attention mask among its own tokens, and their depths (offsets after the
    root). Token b is visible to token a when b is on level 0 at a column <= a's, or on a level in ``1..level(a)``
    of a's own column. Every token additionally sees the root (added by the caller)."""
    lv, col = window_layout(width, levels)
    a_lv, a_col = lv.unsqueeze(1), col.unsqueeze(1)
    b_lv, b_col = lv.unsqueeze(0), col.unsqueeze(0)
    mask = ((b_lv == 0) & (b_col <= a_col)) | ((b_lv >= 1) & (b_col == a_col) & (b_lv <= a_lv))
    return mask, lv + col


class LookaheadProposer(Proposer):
    """Lookahead decoding; see the module docstring."""

    name = "lookahead"

    def __init__(self, window: int = 7, ngram: int = 5, guesses: int = 7, sized_by_curve: bool = False):
        self.W, self.N, self.G = window, ngram, guesses
        self.sized_by_curve = sized_by_curve
        self._masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._shapes: dict[tuple, TreeShape] = {}
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[torch.Tensor] = []
        self.steps = self.verify_steps = self.hit_steps = 0

    # sizes -----------------------------------------------------------------------------------------------------
    def _aux_count(self, filled: int) -> int:
        width = self.W - 1 + (self.N - 1 - filled)  # level-0 width while `filled` levels are filled
        return width + (filled - 1) * (width + 1)

    def max_proposal_size(self) -> int:
        return 1 + self.G * (self.N - 1) + max(self._aux_count(f) for f in range(1, self.N))

    # the n-gram pool ---------------------------------------------------------------------------------------------
    def _add(self, ngrams: list[list[int]]) -> None:
        """Insert N-grams (key = first token, value = the rest); per key at most G, least recently used dropped."""
        for gram in ngrams:
            key, value = gram[0], tuple(gram[1:])
            entries = self.pool.get(key)
            if entries is None:
                self.pool[key] = [value]
            elif value in entries:
                entries.remove(value)
                entries.append(value)
            else:
                entries.append(value)
                if len(entries) > self.G:
                    del entries[0]

    def _add_text(self, tokens: torch.Tensor) -> None:
        if tokens.numel() >= self.N:
            self._add(tokens.unfold(0, self.N, 1).tolist())

    # the decode loop ---------------------------------------------------------------------------------------------
    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self.pool = {}
        self._add_text(state.tokens)
        self.levels = [init_tokens(state, self.W + self.N - 3, "prompt")]
        self.steps = self.verify_steps = self.hit_steps = 0

    def _mask(self, filled: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._masks.get(filled)
        if got is None:
            got = self._masks[filled] = window_mask(self.levels[0].numel(), filled)
        return got

    def _trie(self, root: int, candidates: list[tuple[int, ...]], depth: int) -> DraftTree:
        """Candidates (most recent first) as chains under the root, sharing common prefixes."""
        tokens, parents, index = [root], [-1], {}
        for cand in candidates:
            parent = 0
            for d in range(min(depth, len(cand))):
                key = cand[: d + 1]
                node = index.get(key)
                if node is None:
                    node = index[key] = len(tokens)
                    tokens.append(cand[d])
                    parents.append(parent)
                parent = node
        key = tuple(parents)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= _SHAPE_CACHE_MAX:
                self._shapes.clear()
            shape = self._shapes[key] = TreeShape(torch.tensor(parents))
        return DraftTree(torch.tensor(tokens), shape)

    def propose(self, state: DecodeState) -> Proposal | None:
        if state.remaining <= 1:
            return None
        self.steps += 1
        root = state.root
        candidates = self.pool.get(root)
        if candidates:
            self.verify_steps += 1
            tree = self._trie(root, candidates[::-1], state.remaining - 1)
        else:
            tree = DraftTree.single(root)
        filled = len(self.levels)
        aux_aux, depths = self._mask(filled)
        aux = torch.cat(self.levels)
        n, a = len(tree), aux.numel()
        mask = torch.zeros(a, n + a, dtype=torch.bool)
        mask[:, 0] = True
        mask[:, n:] = aux_aux
        return Proposal(tree, aux, depths, mask)

    def observe(self, state: DecodeState, step: StepResult) -> None:
        proposal = step.proposal
        if proposal.aux_tokens is None:  # an autoregressive step (or the engine dropped the branch): nothing to do
            self._add_text(state.tokens[-(self.N - 1 + len(step.new_tokens)) :])
            return
        self.hit_steps += int(step.verdict.accepted > 0)
        n = len(proposal.tree)
        filled = len(self.levels)
        width = self.levels[0].numel()
        # The top level's next Jacobi iterate, one per column 0..width (column 0 of level 0 is the root).
        top_rows = step.logits[n + proposal.aux_tokens.numel() - (width + 1) :] if filled > 1 else None
        if top_rows is None:
            top_rows = torch.cat([step.logits[:1], step.logits[n : n + width]])
        new = argmax_rows(top_rows)
        if filled == self.N - 1:
            root = proposal.tree.tokens[:1]
            columns = [torch.cat([root, self.levels[0]])] + self.levels[1:] + [new]
            self._add(torch.stack(columns, 1).tolist())
            stack = self.levels[1:] + [new]
            self.levels = [stack[0][1:]] + stack[1:]
        else:  # warm-up: shift every level one column left and add the new level on top
            self.levels = [lvl[1:] for lvl in self.levels] + [new[1:]]
        self._add_text(state.tokens[-(self.N - 1 + len(step.new_tokens)) :])

    def stats(self) -> dict:
        return {
            "window": self.W,
            "ngram": self.N,
            "guesses": self.G,
            "sized_by_cost_curve": self.sized_by_curve,
            "steps": self.steps,
            "steps_with_candidates": self.verify_steps,
            "steps_accepting": self.hit_steps,
            "pool_keys": len(self.pool),
            "pool_ngrams": sum(len(v) for v in self.pool.values()),
        }


def _rows(window: int, ngram: int, guesses: int) -> int:
    """The most tokens a lookahead forward holds (:meth:`LookaheadProposer.max_proposal_size`)."""
    return LookaheadProposer(window, ngram, guesses).max_proposal_size()


def _largest(rows_of) -> int:
    """The largest v >= 1 with ``rows_of(v)`` within :data:`MAX_PROPOSAL_ROWS` (rows grow with v)."""
    v = 1
    while rows_of(v + 1) <= MAX_PROPOSAL_ROWS:
        v += 1
    return v


#: each size's largest value that fits :data:`MAX_PROPOSAL_ROWS` with the other two at their smallest (window 1,
#: ngram 2, guesses 1); together they must fit too (:func:`_check_rows`)
MAX_WINDOW = _largest(lambda w: _rows(w, 2, 1))
MAX_NGRAM = _largest(lambda n: _rows(1, n + 1, 1)) + 1
MAX_GUESSES = _largest(lambda g: _rows(1, 2, g))
_ROWS_BOUND = (f"rows per forward: the three together put about (ngram - 1) x (window + guesses) tokens in a forward "
               f"(more for a narrow window), at most the engine's {MAX_PROPOSAL_ROWS:,} and the model's context; "
               "the bound is with the other two at their smallest")


def _check_rows(method: str, options: dict) -> None:
    """The three sizes together within :data:`MAX_PROPOSAL_ROWS`, before the model is loaded; a size left at 0 counts
    as the smallest the cost curve may give it (the model's context is checked by the factory)."""
    smallest = dict(zip(("window", "ngram", "guesses"), SIZE_LADDER[-1], strict=True))
    w, n, g = (options[k] or smallest[k] for k in ("window", "ngram", "guesses"))
    check_proposal_rows(method, _rows(w, n, g), f"window {w}, ngram {n} and guesses {g}")


@register(
    "lookahead",
    "lookahead decoding: a Jacobi window feeds an n-gram pool whose candidates are verified in the same forward "
    "(options at 0: sized from this machine's cost curve)",
    source="Fu et al. 2024 (arXiv 2402.02057); Spec-Bench's W=7 N=5 G=7 where forwards are nearly free",
    options=(
        Option("window", "int", 0, 1, MAX_WINDOW, special=(0,), bound=_ROWS_BOUND,
               help="W: Jacobi window columns (0 = sized by this machine's cost curve)"),
        Option("ngram", "int", 0, 2, MAX_NGRAM, special=(0,), bound=_ROWS_BOUND,
               help="N: n-gram size; N-1 window levels, drafts of N-1 tokens (0 = sized by the cost curve)"),
        Option("guesses", "int", 0, 1, MAX_GUESSES, special=(0,), bound=_ROWS_BOUND,
               help="G: n-grams kept per first token and verified per step (0 = sized by the cost curve)"),
    ),
    checks=(_check_rows,),
)
def lookahead(target, *, window: int = 0, ngram: int = 0, guesses: int = 0) -> LookaheadProposer:
    """``window`` W: Jacobi window columns; ``ngram`` N: n-gram size (N-1 window levels, drafts of N-1 tokens);
    ``guesses`` G: n-grams kept per first token and verified per step. 0 (the default): sized from this machine's
    cost curve (:func:`size_for_curve`; 7 / 5 / 7 where forwards are nearly free). A size whose forwards would
    hold more than :data:`~fastforward.validation.MAX_PROPOSAL_ROWS` tokens (or the model's context) is refused:
    by the schema before the model is loaded, and here against the model's context."""
    sized = not (window and ngram and guesses)
    if sized:
        auto_w, auto_n, auto_g = size_for_curve(cost_model(target))  # built before any run's clock starts
        window, ngram, guesses = window or auto_w, ngram or auto_n, guesses or auto_g
    proposer = LookaheadProposer(window, ngram, guesses, sized_by_curve=sized)
    check_proposal_rows("lookahead", proposer.max_proposal_size(),
                        f"window {window}, ngram {ngram} and guesses {guesses}", target.max_context)
    return proposer
