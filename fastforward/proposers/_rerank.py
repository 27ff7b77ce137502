"""Rerank: the tree a drafter with per-node path probabilities proposes (EAGLE-2's rerank, shared by ``eagle``,
``falcon`` and ``rest``).

Candidates are nodes under the root with a *path probability* (the product of draft probabilities along the path,
an estimate of the chance the target accepts the node). Ranked by it, a parent always precedes its children (its
probability is at least theirs; ties put shallower first), so every prefix of the ranking is a tree. The tree is
the top n - 1 under the root, where n maximises expected tokens per millisecond ``(1 + sum of the n - 1 best path
probabilities) / t(n)`` on this machine's cost curve t -- or a fixed n.
"""

from __future__ import annotations

import numpy as np
import torch

from ..costs import best_draft
from ..tree import DraftTree, TreeShape

# A draft has tens of candidates, and each call here is one of the small operations a decode step pays for in full.
# ``rank`` and ``best_size`` work in the caller's array library -- torch tensors (the neural drafters, whose steps keep
# torch's code paths warm) or numpy arrays (``rest``, which works in numpy) -- with the same result either way
# (tests/test_rerank.py); so does ``build_tree``.


def rank(scores, depths):
    """Candidate indices by path probability, descending; shallower first on ties (then by index)."""
    if isinstance(scores, np.ndarray):
        return np.lexsort((depths, -scores))
    order = torch.sort(depths, stable=True).indices
    return order[torch.sort(scores[order], descending=True, stable=True).indices]


def best_size(probs, curve_ms, limit: int, nodes: int = 0) -> int:
    """n (root included, 1..limit) for ranked path probabilities ``probs`` [>= limit - 1]: ``nodes`` when fixed, else
    the n maximising ``(1 + sum of the first n - 1) / t(n)`` (``curve_ms[n - 1]`` = t(n), the same library), priced
    as every draft is (:func:`~fastforward.costs.best_draft`)."""
    if nodes:
        return min(nodes, limit)
    if isinstance(probs, np.ndarray):
        gain = 1.0 + np.concatenate([[0.0], np.cumsum(probs[: limit - 1], dtype=np.float64)])
    else:
        gain = 1.0 + torch.cat([torch.zeros(1, dtype=torch.float64), probs[: limit - 1].double().cumsum(0)])
    return best_draft(gain, curve_ms[:limit]) + 1


def build_tree(chosen, tokens, parents, depths, root: int) -> DraftTree:
    """The tree of the ``chosen`` candidates (closed under parents; -1 = the root) with target-id ``tokens``; its
    depths are known, so the shape does not derive them node by node."""
    if isinstance(chosen, np.ndarray):
        chosen = chosen[np.argsort(depths[chosen], kind="stable")]  # parents before children
        index = np.full(parents.size, -1, dtype=np.int64)
        index[chosen] = np.arange(1, chosen.size + 1)
        up = parents[chosen]
        tree_parents = np.concatenate([[-1], np.where(up < 0, 0, index[np.maximum(up, 0)])])
        tree_depths = np.concatenate([[0], depths[chosen]]).astype(np.int64)
        # what TreeShape checks, here in numpy: parents chosen and earlier (depth-sorted), depths one more than theirs
        ok = (tree_parents[1:] >= 0).all() and (tree_parents[1:] < np.arange(1, tree_parents.size)).all() and \
            (tree_depths[1:] == tree_depths[tree_parents[1:]] + 1).all()
        if not ok:
            raise RuntimeError("rerank: a chosen node's parent was not chosen, or the depths disagree with it")
        tokens = torch.from_numpy(np.concatenate([[root], tokens[chosen]]).astype(np.int64))
        return DraftTree(tokens, TreeShape.from_checked(torch.from_numpy(tree_parents), torch.from_numpy(tree_depths)))
    else:
        chosen = chosen[torch.sort(depths[chosen], stable=True).indices]  # parents before children
        index = torch.full((tokens.numel(),), -1, dtype=torch.long)
        index[chosen] = torch.arange(1, chosen.numel() + 1)
        tree_parents = torch.cat([torch.tensor([-1]), torch.where(parents[chosen] < 0, 0, index[parents[chosen]])])
        tree_depths = torch.cat([torch.zeros(1, dtype=torch.long), depths[chosen]])
        tree_tokens = torch.cat([torch.tensor([root]), tokens[chosen]])
    if bool((tree_parents[1:] < 0).any()):
        raise RuntimeError("rerank: a chosen node's parent was not chosen")
    return DraftTree(tree_tokens, TreeShape(tree_parents, known_depths=tree_depths))
