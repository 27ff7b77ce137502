"""Rerank: the tree a drafter with per-node path probabilities proposes (EAGLE-2's rerank, shared by ``eagle`` and
``falcon``).

Candidates are nodes under the root with a *path probability* (the product of draft probabilities along the path,
an estimate of the chance the target accepts the node). Ranked by it, a parent always precedes its children (its
probability is at least theirs; ties put shallower first), so every prefix of the ranking is a tree. The tree is
the top n - 1 under the root, where n maximises expected tokens per millisecond ``(1 + sum of the n - 1 best path
probabilities) / t(n)`` on this machine's cost curve t -- or a fixed n.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeShape


def rank(scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Candidate indices by path probability, descending; shallower first on ties."""
    order = torch.sort(depths, stable=True).indices
    return order[torch.sort(scores[order], descending=True, stable=True).indices]


def best_size(probs: torch.Tensor, curve_ms: torch.Tensor | None, limit: int, nodes: int = 0) -> int:
    """n (root included, 1..limit) for ranked path probabilities ``probs`` [>= limit - 1]: ``nodes`` when fixed, else
    the n maximising ``(1 + sum of the first n - 1) / t(n)`` (``curve_ms[n - 1]`` = t(n))."""
    if nodes:
        return min(nodes, limit)
    gain = 1.0 + torch.cat([torch.zeros(1, dtype=torch.float64), probs[: limit - 1].double().cumsum(0)])
    return int((gain / curve_ms[:limit]).argmax()) + 1


def build_tree(chosen: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
               root: int) -> DraftTree:
    """The tree of the ``chosen`` candidates (closed under parents; -1 = the root) with target-id ``tokens``."""
    chosen = chosen[torch.sort(depths[chosen], stable=True).indices]  # parents before children
    index = torch.full((tokens.numel(),), -1, dtype=torch.long)
    index[chosen] = torch.arange(1, chosen.numel() + 1)
    tree_parents = torch.cat([torch.tensor([-1]), torch.where(parents[chosen] < 0, 0, index[parents[chosen]])])
    if bool((tree_parents[1:] < 0).any()):
        raise RuntimeError("rerank: a chosen node's parent was not chosen")
    return DraftTree(torch.cat([torch.tensor([root]), tokens[chosen]]), TreeShape(tree_parents))
