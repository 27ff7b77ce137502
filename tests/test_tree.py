"""Draft trees: structure derived from parent pointers, choices lists, and their validation."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastforward import DraftTree, TreeShape, UsageError, load_choices, tree_from_choices
from fastforward.tree import chain_shape, check_choices

CHOICES_FILE = Path("/work/shared/reference/tree-choices.json")


def mask_from_ancestor_sets(sets):
    n = len(sets)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, anc in enumerate(sets):
        mask[i, sorted(anc)] = True
    return mask


# --------------------------------------------------------------------------------------------------------------
# Hand-built shapes
# --------------------------------------------------------------------------------------------------------------


def test_chain():
    shape = TreeShape([-1, 0, 1, 2])
    assert shape.depths.tolist() == [0, 1, 2, 3]
    assert shape.max_depth == 3
    assert torch.equal(shape.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert shape.is_chain
    assert shape.leaves.tolist() == [3]
    assert shape.paths.tolist() == [[0, 1, 2, 3]]
    assert shape.path_to(2) == [0, 1, 2]
    assert shape.path_to(0) == [0]
    assert shape.children(1).tolist() == [2]
    assert shape.children(3).tolist() == []


def test_branching_tree():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    #       |
    #       6
    shape = TreeShape([-1, 0, 0, 1, 1, 2, 4])
    assert len(shape) == 7
    assert shape.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert shape.max_depth == 3
    assert not shape.is_chain
    expected = mask_from_ancestor_sets(
        [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 4, 6}]
    )
    assert torch.equal(shape.ancestor_mask, expected)
    assert shape.leaves.tolist() == [3, 5, 6]
    assert shape.paths.tolist() == [[0, 1, 3, -1], [0, 2, 5, -1], [0, 1, 4, 6]]
    assert shape.path_to(6) == [0, 1, 4, 6]
    assert shape.path_to(5) == [0, 2, 5]
    assert shape.children(0).tolist() == [1, 2]
    assert shape.children(1).tolist() == [3, 4]
    assert shape.children(2).tolist() == [5]
    assert shape.children(6).tolist() == []


def test_depths_interleaved_in_index_order():
    # Node 3 (depth 1) comes after node 2 (depth 2): levels are not contiguous in index order.
    shape = TreeShape([-1, 0, 1, 0, 3, 2])
    assert shape.depths.tolist() == [0, 1, 2, 1, 2, 3]
    expected = mask_from_ancestor_sets([{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 3, 4}, {0, 1, 2, 5}])
    assert torch.equal(shape.ancestor_mask, expected)
    assert shape.leaves.tolist() == [4, 5]
    assert shape.paths.tolist() == [[0, 3, 4, -1], [0, 1, 2, 5]]
    assert shape.path_to(5) == [0, 1, 2, 5]


def test_star_tree():
    shape = TreeShape([-1, 0, 0, 0])
    assert shape.depths.tolist() == [0, 1, 1, 1]
    assert shape.paths.tolist() == [[0, 1], [0, 2], [0, 3]]
    expected = mask_from_ancestor_sets([{0}, {0, 1}, {0, 2}, {0, 3}])
    assert torch.equal(shape.ancestor_mask, expected)
    assert not shape.is_chain


def test_single_root():
    shape = TreeShape([-1])
    assert shape.depths.tolist() == [0]
    assert shape.max_depth == 0
    assert shape.ancestor_mask.tolist() == [[True]]
    assert shape.paths.tolist() == [[0]]
    assert shape.is_chain
    tree = DraftTree.single(42)
    assert tree.tokens.tolist() == [42] and len(tree) == 1


@pytest.mark.parametrize(
    "parents",
    [
        [],  # no root
        [0],  # root must have parent -1
        [-1, 1],  # a node may not be its own parent
        [-1, 0, 3, 1],  # parent after the child (not topological)
        [-1, 2, 0],  # parent after the child
        [-1, -1],  # a second root
        [-1, 0, -2],  # negative parent
        [[-1, 0]],  # not one-dimensional
    ],
)
def test_shape_rejects_bad_parents(parents):
    with pytest.raises(UsageError):
        TreeShape(torch.tensor(parents, dtype=torch.long))


def test_draft_tree_builders():
    tree = DraftTree.chain(5, [1, 2, 3])
    assert tree.tokens.tolist() == [5, 1, 2, 3]
    assert tree.shape.parents.tolist() == [-1, 0, 1, 2]
    assert tree.shape.is_chain
    assert chain_shape(4) is chain_shape(4)  # cached: a shape's derived buffers are computed once

    tree = DraftTree.from_parents([9, 8, 7], [-1, 0, 0])
    assert tree.tokens.dtype == torch.long
    assert tree.shape.children(0).tolist() == [1, 2]
    with pytest.raises(UsageError):
        DraftTree.from_parents([9, 8], [-1, 0, 0])


# --------------------------------------------------------------------------------------------------------------
# Property: derived buffers agree with walking the parent pointers
# --------------------------------------------------------------------------------------------------------------


@st.composite
def parent_lists(draw, max_nodes=20):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=60, deadline=None)
@given(parent_lists())
def test_shape_matches_parent_walk(parents):
    shape = TreeShape(parents)
    n = len(parents)

    def ancestors(i):
        out = [i]
        while parents[out[-1]] != -1:
            out.append(parents[out[-1]])
        return out[::-1]  # root first

    assert shape.depths.tolist() == [len(ancestors(i)) - 1 for i in range(n)]
    assert torch.equal(shape.ancestor_mask, mask_from_ancestor_sets([set(ancestors(i)) for i in range(n)]))
    leaves = [i for i in range(n) if i not in parents[1:]]
    assert shape.leaves.tolist() == leaves
    width = max(len(ancestors(i)) for i in range(n))
    assert shape.paths.tolist() == [ancestors(i) + [-1] * (width - len(ancestors(i))) for i in leaves]
    for i in range(n):
        assert shape.path_to(i) == ancestors(i)
        assert shape.children(i).tolist() == [j for j in range(1, n) if parents[j] == i]
    assert shape.is_chain == (parents == list(range(-1, n - 1)))


# --------------------------------------------------------------------------------------------------------------
# Choices lists
# --------------------------------------------------------------------------------------------------------------


def test_two_level_choices():
    # Given out of order and with a duplicate: the template is sorted by (depth, path) and deduplicated.
    tree = tree_from_choices([[1, 0], [0], [0, 1], [2], [1], [0, 0], [0]])
    assert tree.choices == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
    assert len(tree) == 7
    assert tree.shape.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    assert tree.node_depth.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree.node_rank.tolist() == [0, 0, 1, 2, 0, 1, 0]
    assert tree.shape.depths.tolist() == tree.node_depth.tolist()
    assert tree.shape.children(1).tolist() == [4, 5]
    assert tree.shape.path_to(6) == [0, 2, 6]


def test_choices_duplicates_dropped():
    tree = tree_from_choices([[0], [0], [0, 0], [0, 0], [1]])
    assert tree.choices == [(0,), (1,), (0, 0)]
    assert len(tree) == 4


@pytest.mark.parametrize(
    "choices",
    [
        [[0], [0, 1, 0]],  # [0, 1] is missing
        [[1, 0]],  # [1] is missing
        [[0], []],  # empty path
        [[0], [-1]],  # negative rank
    ],
)
def test_choices_rejects_bad_lists(choices):
    with pytest.raises(UsageError):
        tree_from_choices(choices)


BAD_CHOICES = [
    ([["a"]], "['a']"),  # a string rank
    ([1, 2], "1"),  # a rank, not a list of ranks
    ([[None]], "[None]"),
    ([[0.5]], "[0.5]"),  # int() would make it rank 0
    ([["0"]], "['0']"),
    ([[True]], "[True]"),  # a bool is an int to Python, not a rank
    ([[0], "0"], "'0'"),
    ([[0], []], "[]"),
    ([[0], [-1]], "[-1]"),
]


@pytest.mark.parametrize(("choices", "shown"), BAD_CHOICES, ids=[repr(c[0]) for c in BAD_CHOICES])
def test_bad_tree_choices_are_one_usage_error_from_a_list_and_a_file(tmp_path, choices, shown):
    with pytest.raises(UsageError) as info:
        tree_from_choices(choices)
    message = str(info.value)
    assert message.startswith(f"bad tree choice {shown} ") and "\n" not in message
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(choices))
    with pytest.raises(UsageError, match="bad tree choice") as info:
        load_choices(path)
    assert str(path) in str(info.value)


def test_check_choices_takes_tuples_and_names_the_source():
    assert check_choices(((0,), (1,), (0, 0))) == [[0], [1], [0, 0]]
    with pytest.raises(UsageError, match="a choices list is a list of lists"):
        check_choices("[[0]]", "tree.json")
    with pytest.raises(UsageError, match="in tree.json"):
        check_choices([[0], [1.0]], "tree.json")


def test_load_choices_plain_list(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps([[0], [1], [0, 0]]))
    assert load_choices(path) == [[0], [1], [0, 0]]
    assert len(tree_from_choices(load_choices(str(path)))) == 4


def test_load_choices_errors(tmp_path):
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"a": [[0]], "b": [[0], [1]]}))
    assert load_choices(named, "b") == [[0], [1]]
    with pytest.raises(UsageError, match="a, b"):
        load_choices(named)  # several trees: a name is needed
    with pytest.raises(UsageError, match="no tree 'c'"):
        load_choices(named, "c")
    with pytest.raises(UsageError):
        load_choices(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError):
        load_choices(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([0, 1]))
    with pytest.raises(UsageError):
        load_choices(wrong)


@pytest.mark.skipif(not CHOICES_FILE.is_file(), reason="shared reference tree-choices.json not available")
def test_reference_medusa_tree():
    choices = load_choices(CHOICES_FILE, "medusa_mc_sim_7b_63")
    assert len(choices) == 63
    tree = tree_from_choices(choices)
    assert len(tree) == 64  # root + 63
    assert tree.shape.max_depth == 4
    assert int(tree.node_depth.max()) == 4
    # every node's rank path leads back to the root through its parents
    for i, choice in enumerate(tree.choices, start=1):
        assert len(tree.shape.path_to(i)) == len(choice) + 1
        assert [tree.node_rank[j].item() for j in tree.shape.path_to(i)[1:]] == list(choice)


@pytest.mark.skipif(not CHOICES_FILE.is_file(), reason="shared reference tree-choices.json not available")
def test_reference_falcon_tree_has_a_duplicate():
    choices = load_choices(CHOICES_FILE, "falcon_kmask2_8layer_tree")
    assert len(choices) == 166
    tree = tree_from_choices(choices)
    assert len(tree) == 166  # 165 unique paths + the root
    assert tree.shape.max_depth == 8
