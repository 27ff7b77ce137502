"""The rerank's two array libraries (torch for the neural drafters, numpy for ``rest``) rank and size alike."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
