"""FastEagle: a cascaded drafter drafts every depth of its tree in one pass; the target verifies a constrained
"backbone expansion" tree.

Source: *FastEagle: Cascaded Drafting for Accelerating Speculative Decoding* (arXiv 2509.20416). The drafter
(:mod:`fastforward.drafters.fasteagle`) is trained by ``fastforward train fasteagle``; one for the default model ships
with the package.

Each step:

1. **Draft (one pass).** The rows accepted in the last step (their target features come from the verification
   forward itself) run through the drafter's N layers, appended to each layer's KV cache; the last row's N outputs
   go through the head in one matmul: the distributions of depths 1..N. Drafted tokens never enter the drafter.
2. **Backbone expansion tree.** Depth i holds the top-k tokens of distribution i, all children of the backbone node
   (the top-1) of depth i - 1 (the root for depth 1): ``levels * k`` nodes + the root. ``k = 1`` is a chain. Unless
   ``fixed=True``, each step picks ``levels <= depth`` and ``k <= topk`` maximising expected tokens per millisecond,
   ``(1 + sum_i P(backbone reaches depth i - 1) * q_i(top-k)) / t(levels * k + 1)``, from the drafter's own
   probabilities and this machine's cost curve t -- an unsure drafter costs a small forward (or none).
3. **Verify** (the engine): greedy, or at T > 0 the lossless scheme for candidates without probabilities (sample the
   target at each node and walk to the child holding the sample).

**Back-off** (``backoff``, default 8; 0 = off): keeping the drafter's caches in step costs a pass over its N layers
every step, which a step that then drafts nothing does not earn back. After a step whose best choice was to draft
nothing, the proposer skips looking for 1, 2, 4, ... up to ``backoff`` steps; the accepted rows of skipped steps wait
and enter the drafter together at the next look (r rows cost about what one does). A draft that pays resets the
back-off; with ``backoff_on_loss`` (default on) one whose accepted tokens saved less than it cost backs off as an empty
look does (:mod:`fastforward.proposers._backoff`). The drafter's caches still hold accepted rows only, and the output
is unchanged (only which steps draft).
"""

from __future__ import annotations

import numpy as np
import torch

from ..costs import best_draft
from ..drafters.fasteagle import FastEagleRunner, load_fasteagle
from ..engine import DecodeState, Proposal, Proposer
from ..tree import DraftTree, TreeShape
from ..verify import target_probs
from . import register
from ._feature_drafter import FeatureDrafterProposer, calibrated_option, drafter_options, load_runner
from ._options import HEAD_VOCAB, MAX_TREE_NODES, PROMPT_WINDOW, Option, head_covers, max_nodes_option

#: the most tokens per depth and the most depths of the backbone expansion tree (levels x k + 1 nodes, also at most
#: max_nodes)
MAX_TOPK = 16
MAX_DEPTH = 64


def fasteagle_runner(target, drafter: str | None, weights: str, head_vocab: int = HEAD_VOCAB) -> FastEagleRunner:
    return load_runner("fasteagle", "fasteagle", target, drafter, weights, load_fasteagle, FastEagleRunner, head_vocab)


def backbone_tree(tokens: torch.Tensor, root: int, levels: int, k: int) -> DraftTree:
    """The constrained tree: ``tokens`` [levels, >= k] draft candidates per depth (best first) -> root + levels * k
    nodes, depth-major, each depth's nodes children of the previous depth's first (backbone) node."""
    depth = np.repeat(np.arange(levels), k)  # 0-based depth of each node
    parents = np.concatenate([[-1], np.where(depth == 0, 0, 1 + (depth - 1) * k)])
    shape = TreeShape.from_checked(torch.from_numpy(parents), torch.from_numpy(np.concatenate([[0], depth + 1])))
    return DraftTree(torch.cat([torch.tensor([root]), tokens[:levels, :k].reshape(-1)]), shape)


def expected_tokens(top_probs: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """``top_probs`` [N, K] (each depth's top-K probabilities, best first) -> [N, K]: expected tokens per step (the
    bonus included) of the tree with ``levels = n + 1`` and ``k = c + 1``: the backbone reaches depth i - 1 with
    probability prod_{l < i} q_l(top-1), and then one of depth i's k candidates is right with probability
    sum_{c < k} q_i(c). A torch tensor or a numpy array, as given."""
    if isinstance(top_probs, np.ndarray):
        reach = np.concatenate([[1.0], np.cumprod(top_probs[:-1, 0])])  # [N]
        return 1.0 + np.cumsum(reach[:, None] * np.cumsum(top_probs, axis=1), axis=0)
    reach = torch.cat([torch.ones(1, dtype=top_probs.dtype), top_probs[:-1, 0].cumprod(0)])  # [N]
    per_depth = reach.unsqueeze(1) * top_probs.cumsum(1)  # [N, K]
    return 1.0 + per_depth.cumsum(0)


class FastEagleProposer(FeatureDrafterProposer):
    name = "fasteagle"
    samples_chains = True  # at T > 0 a chain samples depth i from layer i's distribution (one pass, as greedy)

    def __init__(self, runner: FastEagleRunner, *, topk: int, depth: int, fixed: bool, max_nodes: int,
                 backoff: int, calibrated: bool = False, backoff_on_loss: bool = True,
                 prompt_window: int = PROMPT_WINDOW):
        super().__init__(runner, fixed=fixed, backoff=backoff, backoff_on_loss=backoff_on_loss, calibrated=calibrated,
                         prompt_window=prompt_window)
        self.topk, self.depth, self.fixed, self.max_nodes = topk, min(depth, runner.cfg.num_layers), fixed, max_nodes
        self.last_h: torch.Tensor | None = None
        self.top_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # every depth's top-k after last_h: [N, k]
        # the best backbone tree in one native call, where the kernels built (else numpy: the same tree)
        self._backbone_draft = getattr(getattr(runner, "ops", None), "backbone_draft", None)
        self._n = {"steps": 0, "looks": 0, "draft_rows": 0, "nodes": 0, "levels": 0, "k": 0}

    def max_proposal_size(self) -> int:
        return min(self.max_nodes, self.depth * self.topk + 1)

    def _commit(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        # every depth's top-k comes with the commit (a sampled chain reads the whole distributions instead)
        k = 0 if self.drafts_with_probabilities else self.topk
        self.last_h, probs, ids = self.runner.commit_top(taps, tokens, positions, k)
        self.top_rows = None if probs is None else (probs, ids)

    def propose(self, state: DecodeState) -> Proposal | None:
        run = self.runner
        room = min(self.depth, state.remaining)
        self._n["steps"] += 1
        if state.max_draft_depth is not None:  # sharing a forward: deeper drafts would be cut
            room = min(room, state.max_draft_depth)
        if room < 1 or self.back_off.skipping():
            self._n["nodes"] += 1
            return None
        self.back_off.looking()
        if self.drafts_with_probabilities:
            return self._sampled_chain_proposal(state, room)
        self._catch_up()
        self._n["looks"] += 1
        top_probs, top_ids = (t[:room] for t in self.top_rows)  # [levels, topk]: from the commit's head matmul
        limit = self.max_proposal_size()
        tree = None
        if self.fixed:
            levels, k = room, self.topk
            while levels * k + 1 > limit and levels > 1:
                levels -= 1
        elif self._backbone_draft is not None and self.greedy_map is None:  # the same choice in one native call
            tokens, parents, depths, levels, k = self._backbone_draft(top_probs, top_ids, run.d2t,
                                                                      self._curve_ms(numpy=True)[:limit], limit,
                                                                      state.root)
            tree = DraftTree(tokens, TreeShape.from_checked(parents, depths))
        else:
            levels, k = self._best_shape(top_probs.double(), room, limit)
        self._n["levels"] += levels
        self._n["k"] += k
        if levels == 0:
            self._n["nodes"] += 1
            self.back_off.drafted_nothing()
            return None
        if tree is None:
            tree = backbone_tree(run.to_target(top_ids), state.root, levels, k)
        self.back_off.drafted(len(tree))
        self._n["nodes"] += len(tree)
        return Proposal(tree)

    def _sampled_chain_proposal(self, state: DecodeState, room: int) -> Proposal | None:
        """A sampling run's chain (:meth:`~._feature_drafter.FeatureDrafterProposer._sampled_chain`): depth i
        sampled from layer i's distribution, all of them from the one pass."""
        k = self._sampled_chain_length(room)
        if k == 0:
            self._n["nodes"] += 1
            self.back_off.drafted_nothing()
            return None
        self._catch_up()
        self._n["looks"] += 1
        self._n["levels"] += k
        self._n["k"] += 1
        self._n["nodes"] += k + 1
        q = target_probs(self.runner.probs(self.last_h[:k]).log(), state.sampling)  # [k, draft_vocab]
        return self._sampled_chain(state, k, lambda d, _x: q[d])

    def _best_shape(self, top_probs: torch.Tensor, room: int, limit: int) -> tuple[int, int]:
        """(levels, k) of the backbone tree the cost model prices best (:func:`~fastforward.costs.best_draft`), from
        each depth's top-K draft probabilities ``top_probs`` [room, K]; (0, 0) when drafting nothing is best."""
        # a few numbers: numpy does these small operations several times faster than torch
        curve_ms = self._curve_ms(numpy=True)
        gain = expected_tokens(self._chances(top_probs).numpy())  # [levels, K]
        nodes = np.arange(1, room + 1)[:, None] * np.arange(1, self.topk + 1) + 1  # [levels, K]
        # option 0 is drafting nothing (one plain step), then every (levels, k), level-major
        tokens = np.concatenate([[1.0], gain.reshape(-1)])
        ms = np.concatenate([curve_ms[:1], curve_ms[np.minimum(nodes - 1, limit - 1)].reshape(-1)])
        allowed = np.concatenate([[True], (nodes <= limit).reshape(-1)])
        best = best_draft(tokens, ms, allowed)
        return (0, 0) if best == 0 else ((best - 1) // self.topk + 1, (best - 1) % self.topk + 1)

    def _chances(self, top_probs: torch.Tensor) -> torch.Tensor:
        """[levels, K] chances that the target accepts each candidate given the backbone above it: at temperature 0
        the drafter's calibrated greedy-acceptance rates when it has a map (in rank order, each at most what the
        better ones leave: the candidates exclude each other), else its probabilities."""
        if self.greedy_map is None:
            return top_probs
        return torch.stack([self.greedy_map.sibling_rates(row, d) for d, row in enumerate(top_probs, 1)])

    def stats(self) -> dict:
        steps = max(self._n["steps"], 1)
        looks = max(self._n["looks"], 1)
        return {"mean_tree_nodes": self._n["nodes"] / steps, "looks_per_step": self._n["looks"] / steps,
                "mean_levels_per_look": self._n["levels"] / looks, "mean_k_per_look": self._n["k"] / looks,
                "draft_rows": self._n["draft_rows"],
                "head_rows": getattr(self.shared, "head_rows", None)}


@register("fasteagle", "FastEagle: a cascaded drafter drafts the whole tree in one pass (backbone expansion tree)",
          source="FastEagle, arXiv 2509.20416",
          options=drafter_options(
              "fasteagle",
              Option("topk", "int", 3, 1, MAX_TOPK, help="the most tokens per depth (1: a chain)",
                     bound=f"rows per forward: the tree has depth x topk + 1 nodes, at most max_nodes "
                           f"({MAX_TREE_NODES}); {MAX_TOPK} x {MAX_TREE_NODES // MAX_TOPK} fills it"),
              Option("depth", "int", 16, 1, MAX_DEPTH, help="the most depths drafted (and no more than the drafter's "
                     "layers)",
                     bound=f"rows per forward: depth x topk + 1 nodes, at most max_nodes ({MAX_TREE_NODES}); a "
                           f"chain of {MAX_DEPTH} is deeper than drafts are accepted"),
              Option("fixed", "bool", False, help="always the full tree (else sized each step by the cost curve)"),
              max_nodes_option(32),
              extra=(calibrated_option(),),
          ), checks=(head_covers(),))
def fasteagle(target, *, drafter: str | None = None, topk: int = 3, depth: int = 16, fixed: bool = False,
              max_nodes: int = 32, backoff: int = 8, weights: str = "auto", calibrated: bool = False,
              backoff_on_loss: bool = True, prompt_window: int = PROMPT_WINDOW,
              head_vocab: int = HEAD_VOCAB) -> Proposer:
    """The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`)."""
    runner = fasteagle_runner(target, drafter, weights, head_vocab)
    return FastEagleProposer(runner, topk=topk, depth=depth, fixed=fixed, max_nodes=max_nodes, backoff=backoff,
                             calibrated=calibrated, backoff_on_loss=backoff_on_loss, prompt_window=prompt_window)
