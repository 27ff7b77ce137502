"""The rerank's two array libraries (torch for the neural drafters, numpy for ``rest``) rank and size alike."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_helpers import native_or_skip

from fastforward.proposers._rerank import best_size, build_tree, rank

candidates = st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9, 1.0]), min_size=n, max_size=n),  # ties on purpose
    st.lists(st.integers(1, 6), min_size=n, max_size=n)))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(cand=candidates, curve_step=st.floats(0.0, 2.0), nodes=st.sampled_from([0, 0, 3]))
def test_torch_and_numpy_rank_and_size_alike(cand, curve_step, nodes):
    scores, depths = cand
    s_np, d_np = np.array(scores), np.array(depths, dtype=np.int64)
    s_t, d_t = torch.tensor(scores, dtype=torch.float64), torch.tensor(depths)
    order_np, order_t = rank(s_np, d_np), rank(s_t, d_t)
    assert order_np.tolist() == order_t.tolist()
    # parents first on ties: ascending depth among equal scores, then by index
    keys = [(-scores[i], depths[i], i) for i in order_np]
    assert keys == sorted(keys)
    limit = len(scores) + 1
    curve = 5.0 + curve_step * np.arange(limit)
    assert best_size(s_np[order_np], curve, limit, nodes) == best_size(s_t[order_t], torch.tensor(curve), limit,
                                                                         nodes)


def test_build_tree_from_either_library():
    tokens, parents, depths = [7, 8, 9, 10], [-1, 0, -1, 1], [1, 2, 1, 3]
    chosen = [1, 0, 3]
    for lib in (np.array, torch.tensor):
        tree = build_tree(lib(chosen), lib(tokens), lib(parents), lib(depths), root=5)
        assert tree.tokens.tolist() == [5, 7, 8, 10]
        assert tree.shape.parents.tolist() == [-1, 0, 1, 2]
        assert tree.shape.depths.tolist() == [0, 1, 2, 3]


def test_build_tree_refuses_a_parent_not_chosen_or_wrong_depths():
    import pytest

    from fastforward.errors import UsageError

    for lib in (np.array, torch.tensor):
        with pytest.raises(RuntimeError, match="parent was not chosen"):
            build_tree(lib([1]), lib([7, 8]), lib([-1, 0]), lib([1, 2]), root=5)  # node 1's parent 0 left out
    with pytest.raises(RuntimeError, match="depths disagree"):
        build_tree(np.array([0, 1]), np.array([7, 8]), np.array([-1, 0]), np.array([1, 3]), root=5)  # depth 3 != 2
    with pytest.raises(UsageError, match="known_depths"):
        build_tree(torch.tensor([0, 1]), torch.tensor([7, 8]), torch.tensor([-1, 0]), torch.tensor([1, 3]), root=5)


def _candidate_tree(draw_parents, qs):
    """Candidates that form trees under the root: candidate i's parent is an earlier candidate (or the root, -1) and
    its log score its parent's plus log q (q <= 1: a path's probability only falls with depth)."""
    parents, depths, scores = [], [], []
    for i, (up, q) in enumerate(zip(draw_parents, qs, strict=True)):
        up = up % (i + 1) - 1  # -1 (the root) or an earlier candidate
        parents.append(up)
        depths.append(1 if up < 0 else depths[up] + 1)
        scores.append(float(np.log(q)) + (0.0 if up < 0 else scores[up]))
    return np.array(scores), np.array(parents, dtype=np.int64), np.array(depths, dtype=np.int64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(n=st.integers(1, 40).flatmap(lambda n: st.tuples(
           st.lists(st.integers(0, 10**6), min_size=n, max_size=n),
           st.lists(st.sampled_from([1.0, 0.9, 0.5, 0.5, 0.25, 0.1, 1e-9]), min_size=n, max_size=n))),
       curve_step=st.floats(0.0, 2.0), nodes=st.sampled_from([0, 0, 0, 1, 3, 50]), room=st.integers(0, 45))
def test_the_native_rerank_builds_the_numpy_rerank_tree(n, curve_step, nodes, room):
    """``rerank_tree`` (one native call) keeps the tree the numpy rank, size and build_tree keep: the same size when
    fixed, else one with the best rate (equal rates up to the exponential's last bits may pick either), and for that
    size the same tokens, parents and depths."""
    native = native_or_skip("rerank_tree")
    scores, parents, depths = _candidate_tree(*n)
    tokens = np.arange(100, 100 + scores.size, dtype=np.int64)
    limit = min(scores.size + 1, room + 1)
    curve = 5.0 + curve_step * np.arange(limit)
    got_tokens, got_parents, got_depths = native.rerank_tree(scores, tokens, parents, depths,
                                                             () if nodes else curve, limit, nodes, 7)
    size = got_tokens.numel()
    order = rank(scores, depths)
    want = best_size(np.exp(scores[order]), curve, limit, nodes)
    if nodes:
        assert size == want
    else:
        gain = 1.0 + np.concatenate([[0.0], np.cumsum(np.exp(scores[order][: limit - 1]))])
        rates = gain / curve
        assert rates[size - 1] >= rates.max() * (1 - 1e-12)
    if size > 1:
        tree = build_tree(order[: size - 1], tokens, parents, depths, root=7)
        assert got_tokens.tolist() == tree.tokens.tolist()
        assert got_parents.tolist() == tree.shape.parents.tolist()
        assert got_depths.tolist() == tree.shape.depths.tolist()
    else:
        assert got_tokens.tolist() == [7] and got_parents.tolist() == [-1] and got_depths.tolist() == [0]


def test_the_native_rerank_refuses_a_parent_not_chosen():
    import pytest

    native = native_or_skip("rerank_tree")
    # candidate 1 (depth 2) outranks its parent 0: a score order no drafter gives
    with pytest.raises(RuntimeError, match="parent was not chosen"):
        native.rerank_tree([-2.0, -0.1], [7, 8], [-1, 0], [1, 2], (), 2, 2, 5)
    with pytest.raises(RuntimeError, match="limit must be"):
        native.rerank_tree([-0.1], [7], [-1], [1], [1.0], 3, 0, 5)
