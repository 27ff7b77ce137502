"""EAGLE-3-style drafting: a one-layer drafter over the target's own features drafts a dynamic tree (EAGLE-2's
expand / rerank), the target verifies it.

Source: Li et al., *EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees* (2024) and *EAGLE-3:
Scaling up Inference Acceleration of Large Language Models via Training-Time Test* (2025). The drafter
(:mod:`fastforward.drafters.eagle`) is trained by ``fastforward train eagle``; a drafter for the default model ships
with the package.

Each step:

1. **Expand.** The root's children are the top-``topk`` tokens of the drafter's distribution after the last
   committed row. Then, depth by depth, the ``topk`` frontier nodes of highest *path* probability (the product of the
   draft probabilities along the path) each get one drafter row -- all of a depth's rows in one drafter call -- and
   each contributes its top-``topk`` children. Expansion stops at ``depth`` or when the best frontier path
   probability falls under ``min_prob``.
2. **Rerank.** The candidates are ranked by path probability (a parent always ranks before its children), and the
   tree is the top n - 1 of them under the root, where n maximises expected tokens per millisecond:
   ``(1 + sum of the n - 1 best path probabilities) / t(n)`` over this machine's cost curve t -- the draft's own
   confidence sizes the tree, so an unsure drafter costs a small forward and a sure one gets a deep chain.
   ``nodes=N`` fixes n instead. ``topk=1`` drafts a chain. With ``calibrated=true`` and a drafter folder holding
   a greedy calibration, greedy decoding uses calibrated acceptance chances in place of the draft probabilities
   (:mod:`fastforward.drafters.calibration`; opt-in: it has not paid on this project's CPU).

   **Priced calls** (``price_calls``, default on when the size is not fixed): each depth costs a drafter call, and
   a call is made only if the frontier it expands can pay it back -- their summed path probability (a bound on the
   tokens the new depth adds) times t(1) at least the measured ms of a call
   (:mod:`fastforward.proposers._call_cost`). A sure drafter still drafts deep; an unsure one stops after the
   depths it can pay for.
3. **Verify** (the engine): greedy, or at T > 0 the lossless scheme for candidates *without* probabilities (sample
   from the target at each node and walk to the child holding the sample). Top-k candidates are not i.i.d. samples
   of the drafter's distribution, so recursive rejection with the drafter's probabilities would not be exact. A
   chain (``topk=1``) at T > 0 is the exception: its tokens are sampled from the drafter, and verification rejects
   with their probabilities (:meth:`EagleProposer.start`).
4. **Commit.** The target's features of the accepted path (tapped in the verification forward itself) and the
   accepted tokens become committed drafter rows; the last row's output drafts the next step. Rows wait until the
   drafter next drafts and go through it together, so steps that draft nothing (a shared forward where no draft of
   this sequence pays, ``DecodeState.max_draft_depth`` = 0) cost no drafter pass.

**Back-off** (``backoff``, default 8; 0 = off; as ``fasteagle`` and ``falcon``): a look costs a drafter pass to commit
the accepted rows plus one over the root's distribution, which a step whose best tree is the root alone does not earn
back. After such a look the proposer skips looking for 1, 2, 4, ... up to ``backoff`` steps (their accepted rows wait
and are committed in one pass at the next look); a draft that pays resets it. With ``backoff_on_loss`` (default on)
a draft is judged by its verdict too: one whose accepted tokens saved less than it cost (the look's measured time and
the larger forward) backs off as an empty look does (:mod:`fastforward.proposers._backoff`). Only which steps draft
changes, never the output.
"""

from __future__ import annotations

import numpy as np
import torch

from ..drafters.calibration import FLOOR
from ..drafters.checkpoint import load_eagle3
from ..drafters.eagle import Eagle3Runner
from ..engine import DecodeState, Proposal, Proposer
from ..tree import DraftTree, TreeShape
from ..verify import target_probs
from . import register
from ._call_cost import DrafterCallCost
from ._feature_drafter import FeatureDrafterProposer, calibrated_option, drafter_options, load_runner
from ._options import HEAD_VOCAB, MAX_TREE_NODES, PROMPT_WINDOW, Option, head_covers, max_nodes_option, nodes_option
from ._rerank import build_tree, rank

#: the most children per expanded node, and the deepest tree: a step's candidate table holds topk + (depth - 1) x
#: topk^2 entries and takes depth drafter calls
MAX_TOPK = 16
MAX_DEPTH = 16


def drafter_runner(target, drafter: str | None, weights: str, head_vocab: int = HEAD_VOCAB) -> Eagle3Runner:
    return load_runner("eagle", "eagle3", target, drafter, weights, load_eagle3, Eagle3Runner, head_vocab)


class EagleProposer(FeatureDrafterProposer):
    name = "eagle"
    counts_committed_rows = False  # draft_rows: the rows of its drafter calls
    samples_chains = True

    def __init__(self, runner: Eagle3Runner, *, topk: int, depth: int, nodes: int, max_nodes: int,
                 min_prob: float, backoff: int = 0, calibrated: bool = False, price_calls: bool = True,
                 backoff_on_loss: bool = True, prompt_window: int = PROMPT_WINDOW):
        super().__init__(runner, fixed=bool(nodes), backoff=backoff, backoff_on_loss=backoff_on_loss,
                         calibrated=calibrated, prompt_window=prompt_window)
        self.topk, self.depth, self.nodes, self.max_nodes, self.min_prob = topk, depth, nodes, max_nodes, min_prob
        self.last_h: torch.Tensor | None = None
        self.root_top: tuple[torch.Tensor, torch.Tensor] | None = None  # the top-k after last_h: [1, k] each
        # the rerank and its tree in one native call, where the kernels built (else numpy: the same tree)
        self._rerank_tree = getattr(getattr(runner, "ops", None), "rerank_tree", None)
        self.call_cost = DrafterCallCost() if price_calls and not nodes else None  # a fixed size expands fully
        self._n = {"steps": 0, "draft_rows": 0, "draft_calls": 0, "nodes": 0, "skipped": 0, "unpaid_stops": 0}

    def _cache_reserve(self) -> int:
        return self.depth + 8

    def _sampled_chain_proposal(self, state: DecodeState, depth: int) -> Proposal | None:
        """A sampling run's chain (:meth:`~._feature_drafter.FeatureDrafterProposer._sampled_chain`): each token
        from the drafter's row after the one sampled before it."""
        run = self.runner
        k = self._sampled_chain_length(depth)
        self._n["steps"] += 1
        self._n["nodes"] += k + 1
        if k == 0:
            self.back_off.drafted_nothing()
            return None
        self._catch_up()
        h = self.last_h

        def next_q(d: int, x: int | None) -> torch.Tensor:
            nonlocal h
            if d:  # the row of the token just sampled, at the next position, seeing the chain's rows before it
                h = run.rows(h, run.to_target(torch.tensor([x])), torch.tensor([state.root_position + d - 1]),
                             run.length + d - 1, torch.ones(1, d, dtype=torch.bool))
                self._n["draft_rows"] += 1
                self._n["draft_calls"] += 1
            return target_probs(run.log_probs(h)[0], state.sampling)

        return self._sampled_chain(state, k, next_q)

    def _commit(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        # the root's top-k comes with the last row (a sampled chain reads the whole distribution instead)
        k = 0 if self.drafts_with_probabilities else self.topk
        self.last_h, values, ids = self.runner.commit_top(taps, tokens, positions, k)
        self.root_top = None if values is None else (values, ids)

    def propose(self, state: DecodeState) -> Proposal | None:
        depth = self.depth if state.max_draft_depth is None else min(self.depth, state.max_draft_depth)
        # no deeper than the tree can reach: a chain of n - 1 drafts under the root at most
        depth = min(depth, self.nodes - 1 if self.nodes else self.max_nodes - 1, state.remaining)
        if depth < 1 or self.back_off.skipping():  # no draft worth its rows in a shared forward, or backing off
            self._n["steps"] += 1
            self._n["nodes"] += 1
            self._n["skipped"] += depth >= 1
            return None
        self.back_off.looking()
        if self.drafts_with_probabilities:
            return self._sampled_chain_proposal(state, depth)
        return self._tree_proposal(*self.expand(state, depth, self._curve_ms(numpy=True)), state)

    def expand(self, state: DecodeState, depth: int, curve_ms) -> tuple[np.ndarray, ...]:
        """Step 1 of the module docstring (the accepted rows committed first): the candidates of every depth up to
        ``depth``, depth after depth, as numpy arrays [c] of draft ids, log path scores (float64), global parent
        indices (-1: the root) and depths (``curve_ms``: t(1..) for the priced calls, or None). The bookkeeping
        between drafter calls is a few numbers per depth, kept in numpy (a torch operation on a tiny tensor costs
        several times more)."""
        run, k = self.runner, self.topk
        root_pos = state.root_position
        self._catch_up()
        if self.greedy_map is None:  # the whole loop in one native call where it can run (the same candidates)
            cost = self.call_cost
            priced = cost is not None and depth > 1
            out = run.expand(*self.root_top, self.last_h, k, depth, self.min_prob,
                             float(curve_ms[0]) if priced else 0.0, cost.ms if priced else None,
                             cost.smoothing if priced else 0.0, root_pos)
            if out is not None:
                *candidates, (rows, calls, unpaid, call_ms) = out
                if priced and calls:
                    cost.ms = call_ms
                self._n["draft_rows"] += int(rows)
                self._n["draft_calls"] += int(calls)
                self._n["unpaid_stops"] += int(unpaid)
                return tuple(candidates)
        values, ids = (t.numpy() for t in self.root_top)  # [1, k]
        cand_tok = [ids[0]]  # per depth: draft ids [c_d]
        cand_score = [self._chance_np(values[0], 1)]  # log chance of acceptance of the path
        cand_parent = [np.full(k, -1, dtype=np.int64)]  # global candidate index of the parent (-1: root)
        src_h, src_row = self.last_h, np.zeros(k, dtype=np.int64)  # the h each candidate's row reads: row of src_h
        max_rows = k * (depth - 1)
        sees = np.zeros((max_rows, max_rows), dtype=bool)  # ancestor-or-self among draft rows
        row_of = np.full(k + (depth - 1) * k * k, -1, dtype=np.int64)  # candidate -> its draft row
        n_rows = 0
        offset = 0  # global index of the first candidate of the current depth
        d2t = run.d2t.numpy()  # draft id -> target id offset (the runner's to_target, in numpy)
        for d in range(2, depth + 1):
            scores = cand_score[-1]
            r = min(k, scores.size)
            sel = np.argsort(-scores, kind="stable")[:r]  # local indices at depth d-1, best first
            best = scores[sel]
            chances = np.exp(best.astype(np.float64))
            if chances[0] < self.min_prob:
                break
            if self.call_cost is not None and not self.call_cost.pays(float(chances.sum()), float(curve_ms[0])):
                self._n["unpaid_stops"] += 1
                break
            glob = sel + offset  # global candidate indices
            parents = cand_parent[-1][sel]
            # each new row sees its parent's row and that row's ancestors (depth-1 nodes: only the committed rows),
            # and itself
            new = slice(n_rows, n_rows + r)
            inner = parents >= 0
            if inner.any():
                sees[new][inner, :n_rows] = sees[row_of[parents[inner]], :n_rows]
            sees[new, new] = np.eye(r, dtype=bool)
            row_of[glob] = np.arange(n_rows, n_rows + r)
            if self.call_cost is not None:
                self.call_cost.start()
            draft_ids = cand_tok[-1][sel]
            position = root_pos + d - 2
            visible = torch.from_numpy(np.ascontiguousarray(sees[new, : n_rows + r]))
            h, values, ids = run.rows_top(src_h, src_row[sel].tolist(), torch.from_numpy(draft_ids + d2t[draft_ids]),
                                          torch.full((r,), position, dtype=torch.long), position,
                                          run.length + n_rows, visible, k)
            values, ids = values.numpy(), ids.numpy()  # [r, k]
            if self.call_cost is not None:
                self.call_cost.stop()
            n_rows += r
            self._n["draft_rows"] += r
            self._n["draft_calls"] += 1
            offset += cand_tok[-1].size
            cand_tok.append(ids.reshape(-1))
            cand_score.append((best[:, None] + self._chance_np(values, d)).reshape(-1))
            cand_parent.append(np.repeat(glob, k))
            src_h, src_row = h, np.repeat(np.arange(r), k)
        if len(cand_tok) == 1:
            return cand_tok[0], cand_score[0].astype(np.float64), cand_parent[0], np.ones(k, dtype=np.int64)
        depths = np.repeat(np.arange(1, len(cand_tok) + 1), [t.size for t in cand_tok])
        return (np.concatenate(cand_tok), np.concatenate(cand_score).astype(np.float64), np.concatenate(cand_parent),
                depths)

    def _tree_proposal(self, draft_ids: np.ndarray, scores: np.ndarray, parents: np.ndarray, depths: np.ndarray,
                       state: DecodeState) -> Proposal | None:
        """The step's tree from the candidates of every depth (draft ids, log path scores, parents, depths, as
        :meth:`expand` gives them): the best-ranked candidates, as many as :meth:`_tree_size` chooses (None when
        that is the root alone) -- in one native call where the kernels built (the same tree)."""
        if self.topk == 1:  # a chain: already ranked (a path's probability only falls with depth), no rerank
            return self._chain_proposal(draft_ids, scores, state)
        tokens = draft_ids + self.runner.d2t.numpy()[draft_ids]  # the runner's to_target, in numpy
        if self._rerank_tree is not None:
            limit = self._size_limit(scores.size, state)
            curve = () if self.nodes else self._curve_ms(numpy=True)[:limit]
            tree_tokens, tree_parents, tree_depths = self._rerank_tree(scores, tokens, parents, depths, curve, limit,
                                                                       self.nodes, state.root)
            if not self._counted(tree_tokens.numel()):
                return None
            return Proposal(DraftTree(tree_tokens, TreeShape.from_checked(tree_parents, tree_depths)))
        # a step's candidates are tens of numbers: numpy does the rerank's small operations several times faster
        # than torch, with the same result (tests/test_rerank.py)
        order = rank(scores, depths)
        n = self._tree_size(np.exp(scores[order]), state)
        if not self._counted(n):
            return None
        return Proposal(build_tree(order[: n - 1], tokens, parents, depths, state.root))

    def _chain_proposal(self, draft_ids: np.ndarray, scores: np.ndarray, state: DecodeState) -> Proposal | None:
        """:meth:`_tree_proposal` of a chain (``topk=1``: one candidate per depth, in rank order): its first n - 1
        drafts, n sized as for any tree."""
        n = self._tree_size(np.exp(scores), state)
        if not self._counted(n):
            return None
        return Proposal(DraftTree.chain(state.root, self.runner.to_target(torch.from_numpy(draft_ids[: n - 1]))))

    def _counted(self, n: int) -> bool:
        """Count a step whose tree has ``n`` nodes (root included) in the stats and the back-off; False when that
        is the root alone (nothing drafted)."""
        self._n["steps"] += 1
        self._n["nodes"] += n
        if n == 1:
            self.back_off.drafted_nothing()
            return False
        self.back_off.drafted(n)
        return True

    def _chance_np(self, log_q: np.ndarray, depth: int) -> np.ndarray:
        """:meth:`_chance` of a numpy array."""
        return log_q if self.greedy_map is None else self._chance(torch.from_numpy(log_q), depth).numpy()

    def _chance(self, log_q: torch.Tensor, depth: int) -> torch.Tensor:
        """log chance that the target accepts each of a node's top-k children (``log_q`` [..., k], best first) given
        the node: at temperature 0 the drafter's calibrated greedy-acceptance rates when it has a map (siblings
        capped at what the better ones leave), else its probabilities."""
        if self.greedy_map is None:
            return log_q
        return self.greedy_map.sibling_rates(log_q.exp(), depth).clamp(min=FLOOR).log()

    def stats(self) -> dict:
        steps = max(self._n["steps"], 1)
        return {"draft_calls_per_step": self._n["draft_calls"] / steps, "draft_rows": self._n["draft_rows"],
                "mean_tree_nodes": self._n["nodes"] / steps, "steps_backed_off": self._n["skipped"],
                "expansions_not_worth_a_call": self._n["unpaid_stops"],
                "head_rows": getattr(self.shared, "head_rows", None)}


@register("eagle", "EAGLE-3-style drafter over the target's features, dynamic tree (EAGLE-2)",
          source="Li et al. 2024/2025, EAGLE-2 / EAGLE-3",
          options=drafter_options(
              "eagle",
              Option("topk", "int", 4, 1, MAX_TOPK, help="children per expanded node (1: a chain)",
                     bound=f"rows per drafter call (topk per level) and candidates per level (topk^2: "
                           f"{MAX_TOPK ** 2} at {MAX_TOPK}, the nodes of the largest tree, {MAX_TREE_NODES})"),
              Option("depth", "int", 6, 1, MAX_DEPTH, help="the deepest draft level",
                     bound=f"drafter calls per step (one per level) and the drafter's cache reserve; "
                           f"{MAX_DEPTH} levels are deeper than drafts are accepted"),
              nodes_option(),
              max_nodes_option(32),
              Option("min_prob", "float", 0.05, 0, 1, high_open=True, bound="a probability",
                     help="expansion stops when the best frontier path probability falls under this"),
              extra=(calibrated_option(),
                     Option("price_calls", "bool", True,
                            help="a depth's drafter call is made only if its frontier can pay it back (when the size "
                                 "is not fixed)")),
          ), checks=(head_covers(),))
def eagle(target, *, drafter: str | None = None, topk: int = 4, depth: int = 6, nodes: int = 0, max_nodes: int = 32,
          min_prob: float = 0.05, backoff: int = 8, weights: str = "auto", calibrated: bool = False,
          price_calls: bool = True, backoff_on_loss: bool = True, prompt_window: int = PROMPT_WINDOW,
          head_vocab: int = HEAD_VOCAB) -> Proposer:
    """The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`)."""
    runner = drafter_runner(target, drafter, weights, head_vocab)
    return EagleProposer(runner, topk=topk, depth=depth, nodes=nodes, max_nodes=max_nodes, min_prob=float(min_prob),
                         backoff=backoff, calibrated=calibrated, price_calls=price_calls,
                         backoff_on_loss=backoff_on_loss, prompt_window=prompt_window)
