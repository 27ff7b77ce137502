"""Pricing draft rows when several sequences share a target forward.

Alone, a sequence's draft pays when the tokens it is expected to add outgrow what its rows add to the forward's
cost: each method sizes its own drafts for that (or drafts a fixed shape). In a shared forward the same row is worth
much less: the forward already carries every other sequence's root, so on a CPU, where a forward's cost grows with
its rows, one more row costs nearly what one more *sequence* costs, and a draft token must be almost certain to
pay. (With t(1) = 11 ms and t(16) = 45 ms, sixteen roots give a token per 2.8 ms and a 17th row costs ~2.3 ms: a
draft row pays only when it is accepted ~85% of the time; alone the bar is ~30%.)

:class:`DraftBudget` keeps, for each sequence of a shared step, the depth its draft is cut to so that the
step's expected tokens per millisecond is highest: depth level by level, each level's gain is the probability that
the sequence accepts a token that deep (its own acceptance history at that depth, with a prior for depths it has not
tried), its price the rows the level adds on this machine's cost model (:class:`~fastforward.costs.CostModel`,
which follows the forwards' own timings; or a fixed :class:`~fastforward.costs.CostCurve`).
Cutting a draft never changes the output, only how many tokens a step gains: greedy verification keeps the
target's own tokens whatever was drafted, and sampling draws the token of each position with a uniform number keyed
by (seed, position) (:mod:`fastforward.verify`), so a seeded answer is the same samples at any draft size. The one
exception keeps its drafts whole: drafts *with* draft probabilities (``sps`` when sampling), whose recursive
rejection draws from the run's generator as many numbers as the draft asks for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .costs import CostCurve, CostModel, best_draft
from .tree import DraftTree, TreeShape

#: the prior for the chance of accepting a token at depth d (1-based) a sequence has no history at: PRIOR ** d,
#: worth PRIOR_WEIGHT steps of history
PRIOR, PRIOR_WEIGHT = 0.5, 2.0


@dataclass
class DraftLevels:
    """What one sequence's draft offers, level by level: ``rows[d]`` extra forward rows and ``gains[d]`` expected
    extra tokens of keeping depth d + 1 (given depths 1..d are kept)."""

    rows: list[int]
    gains: list[float]


def depth_gains(attempts: list[int], accepts: list[int], depth: int) -> list[float]:
    """Expected tokens of each depth 1..``depth``: the fraction of this sequence's steps that drafted that deep and
    accepted a token there, smoothed towards ``PRIOR ** d``; never rising with depth."""
    gains, last = [], 1.0
    for d in range(depth):
        tried = attempts[d] if d < len(attempts) else 0
        hit = accepts[d] if d < len(accepts) else 0
        g = (hit + PRIOR_WEIGHT * PRIOR ** (d + 1)) / (tried + PRIOR_WEIGHT)
        last = min(last, g)
        gains.append(last)
    return gains


def levels_of(tree: DraftTree, aux_rows: int, gains: list[float]) -> DraftLevels:
    """A proposal's levels: nodes per depth (the aux tokens, which gain nothing themselves, priced with the deepest
    level: they go when any level does)."""
    depths = tree.shape.depths
    rows = torch.bincount(depths, minlength=tree.shape.max_depth + 1)[1:].tolist()
    if not rows:  # aux tokens alone (a window still filling): a level that gains nothing now
        return DraftLevels([aux_rows], [0.0])
    rows[-1] += aux_rows
    return DraftLevels(rows, gains[: len(rows)])


def cut_to_depth(tree: DraftTree, depth: int) -> DraftTree:
    """The tree's nodes no deeper than ``depth`` (parents precede children, so the kept nodes stay in order)."""
    keep = tree.shape.depths <= depth
    if bool(keep.all()):
        return tree
    index = torch.cumsum(keep.long(), 0) - 1  # old node -> new node
    parents = tree.shape.parents[keep]
    parents = torch.where(parents >= 0, index[parents.clamp(min=0)], parents)
    probs = None if tree.draft_probs is None else tree.draft_probs[keep]
    return DraftTree(tree.tokens[keep], TreeShape(parents), probs)


class DraftBudget:
    """Chooses how deep each sequence of a shared step drafts (see the module docstring)."""

    def __init__(self, curve: CostCurve | CostModel, max_batch_tokens: int):
        self.curve = curve
        self.max_batch_tokens = max_batch_tokens

    def cost(self, rows: int) -> float:
        """Milliseconds of the forwards that carry ``rows`` rows (packed into forwards of at most
        ``max_batch_tokens`` rows)."""
        forwards = max(1, math.ceil(rows / self.max_batch_tokens))
        return forwards * self.curve.t(rows / forwards)

    def choose(self, fixed_rows: int, fixed_tokens: float, drafts: list[DraftLevels]) -> list[int]:
        """The depth each of ``drafts`` keeps, maximising expected tokens per millisecond of the step, given rows
        and tokens that are not negotiable (roots, sampled sequences' drafts). Greedy: add the level that raises
        the rate most while one does."""
        depth = [0] * len(drafts)
        rows = fixed_rows
        tokens = fixed_tokens
        while True:
            # as it stands, or one of the drafts a level deeper: priced as every draft is (costs.best_draft)
            options = [(i, draft.gains[depth[i]], draft.rows[depth[i]]) for i, draft in enumerate(drafts)
                       if depth[i] < len(draft.rows)]
            best = best_draft([tokens] + [tokens + gain for _, gain, _ in options],
                              [self.cost(rows)] + [self.cost(rows + extra) for _, _, extra in options])
            if best == 0:
                return depth
            i, gain, extra = options[best - 1]
            rows += extra
            tokens += gain
            depth[i] += 1
