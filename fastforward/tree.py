"""Draft trees: tokens plus parent pointers, and everything the verifier needs derived from them.

A :class:`DraftTree` always includes its root at index 0: the last accepted token, whose KV is not yet cached.
Every other node's parent has a smaller index (nodes are in topological order), so a single pass over depth
levels derives depths, the ancestor mask and root-to-leaf paths with tensor operations.
"""

from __future__ import annotations

import json
from dataclasses import InitVar, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from .errors import UsageError


@dataclass(eq=False)
class TreeShape:
    """The structure of a tree without its tokens: parent pointers (root = -1 at index 0) and derived buffers.

    Shapes are reused across steps by template-based proposers, so their buffers are computed once.
    """

    parents: torch.Tensor  # [n] long, parents[0] == -1
    #: the nodes' depths when the caller knows them already (a drafter that built the tree level by level): checked
    #: against the parents in one step instead of derived node by node
    known_depths: InitVar[torch.Tensor | None] = None

    def __post_init__(self, known_depths):
        self.parents = torch.as_tensor(self.parents, dtype=torch.long)
        p = self.parents
        if p.ndim != 1 or p.numel() == 0 or int(p[0]) != -1:
            raise UsageError("a tree needs its root at index 0 with parent -1")
        if p.numel() > 1 and not bool(((p[1:] >= 0) & (p[1:] < torch.arange(1, p.numel()))).all()):
            raise UsageError("every non-root node's parent must be an earlier node")
        if known_depths is not None:
            d = torch.as_tensor(known_depths, dtype=torch.long)
            if d.shape != p.shape or int(d[0]) != 0 or not bool((d[1:] == d[p[1:]] + 1).all()):
                raise UsageError("known_depths must be 0 at the root and one more than each node's parent's")
            self.__dict__["depths"] = d  # the cached property, filled

    @classmethod
    def from_checked(cls, parents: torch.Tensor, depths: torch.Tensor) -> TreeShape:
        """A shape whose builder has already checked, in its own arrays, what ``__init__`` would (the root at 0,
        every parent an earlier node, each depth one more than its parent's): built without checking again."""
        shape = cls.__new__(cls)
        shape.parents = parents
        shape.__dict__["depths"] = depths
        return shape

    def __len__(self) -> int:
        return self.parents.numel()

    @cached_property
    def depths(self) -> torch.Tensor:
        n = len(self)
        depth = torch.zeros(n, dtype=torch.long)
        for i in range(1, n):  # parents precede children; n is small (tens) and this runs once per shape
            depth[i] = depth[self.parents[i]] + 1
        return depth

    @cached_property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] is True when j is i or an ancestor of i (what node i may attend to)."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        depth = self.depths
        for d in range(1, self.max_depth + 1):
            level = (depth == d).nonzero().flatten()
            mask[level] |= mask[self.parents[level]]
        return mask

    @cached_property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(-1, len(self) - 1)).all())

    @cached_property
    def leaves(self) -> torch.Tensor:
        has_child = torch.zeros(len(self), dtype=torch.bool)
        has_child[self.parents[1:]] = True
        return (~has_child).nonzero().flatten()

    @cached_property
    def paths(self) -> torch.Tensor:
        """[leaves, max_depth+1] node indices of every root-to-leaf path, padded with -1."""
        anc = self.ancestor_mask[self.leaves]  # [leaves, n]
        order = self.depths.unsqueeze(0).expand_as(anc).masked_fill(~anc, 10**9)
        sorted_depth, idx = order.sort(dim=1)
        paths = idx[:, : self.max_depth + 1].clone()
        paths[sorted_depth[:, : self.max_depth + 1] == 10**9] = -1
        return paths

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        path = self.ancestor_mask[node].nonzero().flatten()
        return path[self.depths[path].argsort()].tolist()

    def children(self, node: int) -> torch.Tensor:
        return (self.parents == node).nonzero().flatten()


@dataclass(eq=False)
class DraftTree:
    """Candidate tokens to verify in one forward: ``tokens[0]`` is the root, ``shape.parents`` the structure.

    ``draft_probs`` optionally holds, for every non-root node, the proposer's full next-token distribution at its
    parent (the distribution the node was sampled from); verification then uses recursive rejection sampling.
    Without it the nodes are treated as deterministic guesses (point masses), which is exact for Jacobi,
    prompt lookup and other drafts that have no probabilities.
    """

    tokens: torch.Tensor
    shape: TreeShape
    draft_probs: torch.Tensor | None = None  # [n, vocab]; row 0 unused

    def __post_init__(self):
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dtype != torch.long:
            self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        if self.tokens.shape != self.shape.parents.shape:
            raise UsageError("a tree needs one token per node")

    def __len__(self) -> int:
        return self.tokens.numel()

    @classmethod
    def from_parents(cls, tokens, parents, draft_probs=None) -> DraftTree:
        return cls(torch.as_tensor(tokens), TreeShape(torch.as_tensor(parents)), draft_probs)

    @classmethod
    def chain(cls, root: int, drafts, draft_probs=None) -> DraftTree:
        drafts = torch.as_tensor(drafts, dtype=torch.long).flatten()
        tokens = torch.cat([torch.tensor([root]), drafts])
        return cls(tokens, chain_shape(tokens.numel()), draft_probs)

    @classmethod
    def single(cls, root: int) -> DraftTree:
        # from numpy: half of torch.tensor's ~30 us right after a forward streamed the weights (every plain step)
        return cls(torch.from_numpy(np.array([root], dtype=np.int64)), chain_shape(1))


_CHAINS: dict[int, TreeShape] = {}


def chain_shape(n: int) -> TreeShape:
    """A chain of n nodes (root plus n-1 drafts); shapes are cached because every step reuses them."""
    shape = _CHAINS.get(n)
    if shape is None:
        shape = _CHAINS[n] = TreeShape(torch.arange(-1, n - 1))
    return shape


# ----------------------------------------------------------------------------------------------------------------
# Choices lists (Medusa-style): each entry is a root-to-node path of top-k ranks, e.g. [0, 1] = the 2nd-ranked
# candidate under the 1st-ranked candidate at depth 1.
# ----------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class ChoicesTree:
    """A tree template from a choices list: its shape plus each node's (depth, rank) for filling in tokens."""

    choices: list[tuple[int, ...]]
    shape: TreeShape
    node_depth: torch.Tensor  # [n] depth of each node (root 0)
    node_rank: torch.Tensor  # [n] rank at its depth (root 0)

    def __len__(self) -> int:
        return len(self.shape)


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_choices(choices, source: str = "the tree") -> list[list[int]]:
    """``choices`` as a list of lists of ranks, else a one-line :class:`UsageError`: the one check of a choices
    list, wherever it comes from (a tree file, the ``tree`` option, :func:`tree_from_choices`). Every entry is a
    non-empty list (or tuple) of integer ranks >= 0 -- not bools, floats or strings, which ``int()`` would quietly
    turn into ranks."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
        raise UsageError(f"{source}: a choices list is a list of lists of ranks, got {type(choices).__name__}")
    for choice in choices:
        if not isinstance(choice, (list, tuple)) or not choice or not all(_is_rank(r) for r in choice):
            shown = repr(choice if not isinstance(choice, tuple) else list(choice))
            if len(shown) > 60:
                shown = shown[:57] + "..."
            raise UsageError(f"bad tree choice {shown} in {source}: each choice is a non-empty list of integer "
                             "ranks >= 0")
    return [list(choice) for choice in choices]


def tree_from_choices(choices) -> ChoicesTree:
    """Build a tree template from a choices list (checked by :func:`check_choices`). Duplicates are dropped;
    missing ancestors are an error."""
    unique: list[tuple[int, ...]] = []
    seen = set()
    for c in check_choices(choices):
        t = tuple(c)
        if t not in seen:
            seen.add(t)
            unique.append(t)
    unique.sort(key=lambda t: (len(t), t))
    index = {(): 0}
    parents = [-1]
    for i, t in enumerate(unique, start=1):
        if t[:-1] not in index:
            raise UsageError(f"tree choice {list(t)} has no parent {list(t[:-1])} in the list")
        index[t] = i
        parents.append(index[t[:-1]])
    depth = torch.tensor([0] + [len(t) for t in unique])
    rank = torch.tensor([0] + [t[-1] for t in unique])
    return ChoicesTree(unique, TreeShape(torch.tensor(parents)), depth, rank)


TREE_FORMAT = "fastforward-tree/1"  # the format tag of a tree file written by fastforward build-tree
BUILT_TREE_KEYS = ("choices", "greedy_order", "tau_by_nodes")


def read_tree_file(path) -> dict | list:
    """The JSON of a tree file: a built tree (an object tagged :data:`TREE_FORMAT`, with ``choices``), an object
    of named choices lists, or a bare choices list. A tagged file of another format version is refused."""
    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read tree file {file}: {exc}") from None
    if isinstance(data, dict) and "format" in data and data["format"] != TREE_FORMAT:
        raise UsageError(f"{file} is a tree file of format {data['format']!r}; this version reads {TREE_FORMAT}")
    return data


def is_built_tree(data) -> bool:
    """Whether parsed tree-file JSON is a tree ``fastforward build-tree`` wrote."""
    return isinstance(data, dict) and all(k in data for k in BUILT_TREE_KEYS)


def write_tree_file(data: dict, path) -> Path:
    """Write a built tree as JSON (tagged :data:`TREE_FORMAT`, one top-level key per line, lists on one line),
    atomically: a reader never sees half a file."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": TREE_FORMAT, **{k: v for k, v in data.items() if k != "format"}}
    text = "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def load_choices(path, name: str | None = None) -> list[list[int]]:
    """Read a choices list from JSON: either a list of paths, or an object of named lists (pick ``name``)."""
    data = read_tree_file(path)
    if is_built_tree(data) and name is None:
        data = data["choices"]
    if isinstance(data, dict):
        if name is None:
            raise UsageError(f"{path} holds several trees; name one of: {', '.join(sorted(data))}")
        if name not in data:
            raise UsageError(f"{path} has no tree '{name}'; it has: {', '.join(sorted(data))}")
        data = data[name]
    return check_choices(data, str(path))
