"""Falcon: a semi-autoregressive drafter drafts k tokens per pass; the target verifies a tree built from k-token
blocks.

Source: Gao et al., *Falcon: Faster and Parallel Inference of Large Language Models through Enhanced
Semi-Autoregressive Drafting and Custom-Designed Decoding Tree* (AAAI 2025). The drafter
(:mod:`fastforward.drafters.falcon`) is trained by ``fastforward train falcon``; one for the default model ships with
the package.

Each step:

1. **First pass.** The last k committed rows (the last reads the bonus token, the root) form one block: its k outputs
   are the predicted features of the next k positions and, through the head, the distributions of depths 1..k. A
   block's k tokens come from one pass, so depth i + 1's candidates do not depend on depth i's choice: each of the
   ``topk`` candidates of depth i gets the ``topk`` of depth i + 1 as children (Medusa-style Cartesian blocks), each
   node scored by its path probability (the product of its tokens' draft probabilities).
2. **Later passes** (up to ``passes``). The frontier -- the deepest-block nodes the current best tree would keep, at
   most ``frontier`` of them -- each feeds its own block's tokens with the block's predicted features back as the
   next block, all frontiers in one drafter call under a tree mask (a row sees the committed rows, its own branch's
   earlier blocks and its own block); each drafts k more depths the same way. A pass whose frontier is empty is not
   run.
3. **Rerank** (:mod:`._rerank`): the tree is the top n - 1 candidates by path probability, n maximising expected
   tokens per millisecond on this machine's cost curve (or ``nodes=N`` fixed). ``topk=1, frontier=1`` drafts a chain
   (the "tree attention off" ablation).
4. **Verify** (the engine): greedy, or at T > 0 the lossless scheme for candidates without probabilities.
5. **Commit.** The target's final states of the accepted path (from the verification forward itself) and their next
   tokens become committed drafter rows. With back-off (``backoff``, default 8; 0 = off) a step whose best choice
   was to draft nothing makes the next 1, 2, 4, ... steps skip looking.
"""

from __future__ import annotations

import torch

from ..drafters.falcon import FalconRunner, load_falcon
from ..drafters.features import FINAL
from ..engine import DecodeState, Proposal, Proposer
from . import register
from ._feature_drafter import FeatureDrafterProposer, drafter_options, load_runner
from ._options import HEAD_VOCAB, MAX_TREE_NODES, PROMPT_WINDOW, Option, head_covers, max_nodes_option, nodes_option
from ._rerank import build_tree, rank

#: candidates per depth, drafter passes per step, and frontier nodes fed back per pass: a pass drafts k depths of
#: topk candidates for each frontier node, and the drafter's cache reserves passes x k x frontier rows
MAX_TOPK = 16
MAX_PASSES = 8
MAX_FRONTIER = 16


def falcon_runner(target, drafter: str | None, weights: str, head_vocab: int = HEAD_VOCAB) -> FalconRunner:
    return load_runner("falcon", "falcon", target, drafter, weights, load_falcon, FalconRunner, head_vocab)


class Candidates:
    """The draft's candidate nodes so far (flat tensors, one entry per node) and, for the nodes ending a block, what
    a next pass needs: the block's tokens and which group of outputs holds the block's predicted features."""

    def __init__(self):
        self.tokens, self.scores, self.parents, self.depths = [], [], [], []
        self.size = 0

    def add_blocks(self, values: torch.Tensor, ids: torch.Tensor, parent: torch.Tensor, parent_score: torch.Tensor,
                   parent_depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass's blocks: ``values``/``ids`` [F, kk, w] (each block row's top-w probabilities / target ids) under
        ``parent`` [F] (candidate index, -1 = root) -> the block-end nodes: their indices [F, w^kk], path
        probabilities [F, w^kk] and block tokens [F, w^kk, kk]."""
        Fb, kk, w = values.shape
        prev = parent.unsqueeze(1)  # [F, n]: the previous level's nodes
        score = parent_score.unsqueeze(1).to(values.dtype)
        path = torch.zeros(Fb, 1, 0, dtype=torch.long)
        for i in range(kk):
            n = prev.shape[1]
            s = (score.unsqueeze(2) * values[:, i].unsqueeze(1)).reshape(Fb, n * w)
            tok = ids[:, i].unsqueeze(1).expand(Fb, n, w).reshape(Fb, n * w)
            idx = self.size + torch.arange(Fb * n * w).view(Fb, n * w)
            self.tokens.append(tok.reshape(-1))
            self.scores.append(s.reshape(-1))
            self.parents.append(prev.unsqueeze(2).expand(Fb, n, w).reshape(-1))
            self.depths.append((parent_depth.unsqueeze(1) + i + 1).expand(Fb, n * w).reshape(-1))
            self.size += Fb * n * w
            path = torch.cat([path.repeat_interleave(w, dim=1), tok.unsqueeze(2)], dim=2)
            prev, score = idx, s
        return prev, score, path

    def cat(self):
        return torch.cat(self.tokens), torch.cat(self.scores), torch.cat(self.parents), torch.cat(self.depths)


class FalconProposer(FeatureDrafterProposer):
    name = "falcon"
    hidden_layers = (FINAL,)

    def __init__(self, runner: FalconRunner, *, topk: int, passes: int, frontier: int, nodes: int, max_nodes: int,
                 backoff: int, backoff_on_loss: bool = True, prompt_window: int = PROMPT_WINDOW):
        super().__init__(runner, fixed=bool(nodes), backoff=backoff, backoff_on_loss=backoff_on_loss,
                         prompt_window=prompt_window)
        self.topk, self.passes, self.frontier = topk, passes, frontier
        self.nodes, self.max_nodes = nodes, max_nodes
        self._n = {"steps": 0, "looks": 0, "passes": 0, "draft_rows": 0, "nodes": 0}

    def _tap_layers(self, runner) -> tuple[int, ...]:
        return (FINAL,)  # the target's final (normed) states

    def _cache_reserve(self) -> int:
        return self.passes * self.shared.k * self.frontier + 8

    def _commit(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self.runner.commit(taps, tokens, positions)

    def _top(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block outputs [..., d] -> top-``topk`` probabilities and target ids [..., topk]."""
        values, ids = self.runner.top(out, self.topk)
        return values.double(), self.runner.to_target(ids)

    def _choose(self, cands: Candidates, state: DecodeState):
        tokens, scores, parents, depths = cands.cat()
        order = rank(scores, depths)
        n = self._tree_size(scores[order], state)
        return order[: n - 1], (tokens, scores, parents, depths)

    def propose(self, state: DecodeState) -> Proposal | None:
        self._n["steps"] += 1
        if state.remaining < 1 or state.max_draft_depth == 0 or self.back_off.skipping():
            self._n["nodes"] += 1
            return None
        self.back_off.looking()
        self._catch_up()
        self._n["looks"] += 1
        run = self.runner
        out = run.first_block()  # [k', d]
        kk = out.shape[0]
        values, ids = self._top(out)
        cands = Candidates()
        root = torch.tensor([-1])
        ends, end_scores, end_paths = cands.add_blocks(values.unsqueeze(0), ids.unsqueeze(0), root,
                                                       torch.ones(1, dtype=torch.float64), torch.zeros_like(root))
        # each block-end node's branch: the pass outputs holding its block's features (branch_out[branch]) and the
        # scratch rows of its earlier blocks (branch_rows[branch]); a pass's block-end nodes under one frontier node
        # share a branch
        branch_out, branch_rows = out.unsqueeze(0), [torch.zeros(0, dtype=torch.long)]  # [branches, kk, d]
        branch_of = [0] * ends.shape[1]
        ends, end_scores, end_paths = ends[0], end_scores[0], end_paths[0]
        self._n["passes"] += 1
        chosen, flat = self._choose(cands, state)
        for p in range(2, self.passes + 1):
            if kk < run.k or chosen.numel() == 0:
                break
            keep = torch.isin(ends, chosen)  # block-end nodes the current best tree keeps, best first
            picked = keep.nonzero().flatten()
            picked = picked[torch.sort(end_scores[picked], descending=True, stable=True).indices][: self.frontier]
            if picked.numel() == 0:
                break
            picked_branches = [branch_of[i] for i in picked.tolist()]
            sees = torch.zeros(picked.numel(), run.scratch, dtype=torch.bool)
            for b, branch in enumerate(picked_branches):
                sees[b, branch_rows[branch]] = True
            out, rows = run.extend(end_paths[picked], branch_out[picked_branches], run.length + (p - 2) * run.k,
                                   sees)
            self._n["passes"] += 1
            values, ids = self._top(out)  # [F, k, w]
            parent_depth = torch.full((picked.numel(),), (p - 1) * run.k, dtype=torch.long)
            new_ends, new_scores, new_paths = cands.add_blocks(values, ids, ends[picked], end_scores[picked],
                                                               parent_depth)
            per = new_ends.shape[1]
            branch_out = out  # [F, k, d]: frontier node b's new block-end nodes are branch b
            branch_rows = [torch.cat([branch_rows[branch], rows[b]]) for b, branch in enumerate(picked_branches)]
            branch_of = [b for b in range(picked.numel()) for _ in range(per)]
            ends, end_scores = new_ends.reshape(-1), new_scores.reshape(-1)
            end_paths = new_paths.reshape(-1, run.k)
            chosen, flat = self._choose(cands, state)
        tokens, _, parents, depths = flat
        n = chosen.numel() + 1
        self._n["nodes"] += n
        if n == 1:
            self.back_off.drafted_nothing()
            return None
        self.back_off.drafted(n)
        return Proposal(build_tree(chosen, tokens, parents, depths, state.root))

    def stats(self) -> dict:
        steps = max(self._n["steps"], 1)
        looks = max(self._n["looks"], 1)
        return {"mean_tree_nodes": self._n["nodes"] / steps, "looks_per_step": self._n["looks"] / steps,
                "passes_per_look": self._n["passes"] / looks, "draft_rows": self._n["draft_rows"],
                "head_rows": getattr(self.shared, "head_rows", None)}


@register("falcon", "Falcon: a semi-autoregressive drafter drafts k tokens per pass, verified as a tree of k-blocks",
          source="Gao et al., AAAI 2025",
          options=drafter_options(
              "falcon",
              Option("topk", "int", 4, 1, MAX_TOPK, help="candidates per depth of a block (1 with frontier 1: a chain)",
                     bound=f"candidates per pass: a frontier node's k-block holds topk^k of them (Cartesian); "
                           f"past {MAX_TOPK} per depth they are more than the largest tree ({MAX_TREE_NODES} nodes) "
                           "can keep"),
              Option("passes", "int", 2, 1, MAX_PASSES, help="the most drafter passes per step (each drafts k depths)",
                     bound=f"drafter calls per step, and the drafter's cache reserve (passes x k x frontier rows); "
                           f"{MAX_PASSES} passes draft deeper than drafts are accepted"),
              Option("frontier", "int", 4, 1, MAX_FRONTIER,
                     help="the deepest-block nodes fed back per later pass",
                     bound=f"rows per drafter call (frontier x k) and the drafter's cache reserve; "
                           f"{MAX_FRONTIER} x topk {MAX_TOPK} candidates fill the largest tree "
                           f"({MAX_TREE_NODES} nodes)"),
              nodes_option(),
              max_nodes_option(32),
          ), checks=(head_covers(),))
def falcon(target, *, drafter: str | None = None, topk: int = 4, passes: int = 2, frontier: int = 4, nodes: int = 0,
           max_nodes: int = 32, backoff: int = 8, weights: str = "auto", backoff_on_loss: bool = True,
           prompt_window: int = PROMPT_WINDOW,
           head_vocab: int = HEAD_VOCAB) -> Proposer:
    """The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`)."""
    runner = falcon_runner(target, drafter, weights, head_vocab)
    return FalconProposer(runner, topk=topk, passes=passes, frontier=frontier, nodes=nodes, max_nodes=max_nodes,
                          backoff=backoff, backoff_on_loss=backoff_on_loss, prompt_window=prompt_window)
