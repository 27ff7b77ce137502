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

from ..tree import DraftTree, TreeShape

# A draft has tens of candidates: the work here is a handful of calls on small arrays, done in numpy (each call
# costs a fraction of a small torch op's, and the decode step pays every one of them). Inputs may be torch tensors
# or numpy arrays.


def _np(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def rank(scores, depths) -> torch.Tensor:
    """Candidate indices by path probability, descending; shallower first on ties (then by index)."""
    return torch.from_numpy(np.lexsort((_np(depths), -_np(scores))))


def best_size(probs, curve_ms, limit: int, nodes: int = 0) -> int:
    """n (root included, 1..limit) for ranked path probabilities ``probs`` [>= limit - 1]: ``nodes`` when fixed, else
    the n maximising ``(1 + sum of the first n - 1) / t(n)`` (``curve_ms[n - 1]`` = t(n))."""
    if nodes:
        return min(nodes, limit)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(_np(probs)[: limit - 1], dtype=np.float64)])
    return int(np.argmax(gain / _np(curve_ms)[:limit])) + 1


def build_tree(chosen, tokens, parents, depths, root: int) -> DraftTree:
    """The tree of the ``chosen`` candidates (closed under parents; -1 = the root) with target-id ``tokens``."""
    chosen, parents, depths = _np(chosen), _np(parents), _np(depths)
    chosen = chosen[np.argsort(depths[chosen], kind="stable")]  # parents before children
    index = np.full(parents.size, -1, dtype=np.int64)
    index[chosen] = np.arange(1, chosen.size + 1)
    up = parents[chosen]
    tree_parents = np.concatenate([[-1], np.where(up < 0, 0, index[np.maximum(up, 0)])])
    if (tree_parents[1:] < 0).any():
        raise RuntimeError("rerank: a chosen node's parent was not chosen")
    shape = TreeShape(torch.from_numpy(tree_parents), known_depths=torch.from_numpy(
        np.concatenate([[0], depths[chosen]]).astype(np.int64)))
    tokens = np.concatenate([[root], _np(tokens)[chosen]]).astype(np.int64)
    return DraftTree(torch.from_numpy(tokens), shape)
