"""TR-Jacobi: tree-based, retrieval-augmented Jacobi decoding (Make Some Noise, section 3.3 and Appendix B).

Every forward verifies one static token tree rooted at the last accepted token:

* a **Jacobi tree** given as a Medusa-style choices list: a node ``[r1, ..., rd]`` sits at depth d and holds the
  rank-``rd`` candidate of the candidate table's depth-d row, ``cand[d-1, rd]`` (siblings differ by rank; the token
  depends only on (depth, rank), as in Medusa and MSN). Every root-to-leaf path is one Jacobi window, refined by the
  target in the same forward through tree attention;
* a **retrieval chain** of ``retrieval_len`` nodes under the root holding the prompt-lookup continuation of the
  current suffix (``ngram`` down to ``min_ngram`` tokens matched, most recent match; see ``proposers/pld.py``).

After verification the table is refilled the Jacobi way. Let the accepted path end at node ``p_a`` (depth a); the
bonus token now sits at depth a+1 and becomes the next root. Below ``p_a`` the proposer follows one precomputed
continuation ``c_1, c_2, ...`` (depths a+1, a+2, ...; into the tallest subtree, lowest ranks first; from the root
into the choices tree, from a retrieval node down the retrieval chain). The target's logits at ``c_j`` predict
depth a+1+j, i.e. depth j relative to the new root, so row ``j-1`` of the next table is the top-K of
``logits[c_j]``. ``c_1``'s own token was wrong (the bonus replaced it): that is exactly the noisy-prefix prediction
Jacobi decoding iterates on. Rows with no continuation left (the path was accepted to its end) are refilled with
*ahead noise*: tokens drawn from the preceding context (MSN 3.2), which is also how the table starts.

Static structure (shape, ancestor masks, gather index, continuations) is built once per tree. When the lookup finds
m < ``retrieval_len`` tokens, the proposal is the same tree with only the first m retrieval nodes (one precomputed
shape per m), so no forward slot is spent on junk. Per step: one prompt lookup, one gather into the tree, one top-K.

Trees: ``tree`` is a JSON file (``path`` or ``path:name`` for a file of named lists, or a tree written by
``fastforward build-tree``), a choices list, or ``"builtin"``. Without it the tree ``fastforward build-tree``
installed for this model on this machine is used if there is one, else :func:`builtin_choices`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..errors import UsageError
from ..model import MODEL_ALIASES
from ..paths import trees_dir
from ..tree import DraftTree, TreeShape, check_choices, load_choices, read_tree_file, tree_from_choices
from ..validation import MAX_PROPOSAL_ROWS, check_proposal_rows
from . import register
from ._options import Option, at_most, check_int
from .jacobi import INIT_MODES, init_tokens
from .pld import MAX_NGRAM, NGRAM_BOUND, NgramIndex

#: the longest prompt-lookup chain: longer continuations are rarely accepted whole, and every length gets a shape
MAX_RETRIEVAL_LEN = 256


def builtin_choices(depth: int = 2, width: int = 2) -> list[list[int]]:
    """The default tree when no measured one is installed: ranks 0..width-1 at depth 1 plus a rank-0 chain down
    to ``depth`` (defaults: ``[[0], [1], [0, 0]]``, at most 9 tokens per forward with the root and retrieval chain).

    Small on purpose. On a CPU a forward over q tokens costs much more than one over a single token (see
    ``fastforward profile``), and a plain (not noise-trained) model rarely gets Jacobi guesses right: measured on
    SmolLM2-135M (``trees/smollm2-135m-cpu.json``) the depth-1 rank-0 guess is right 7% of the time, rank 1 2.5%,
    and the greedy order of nodes begins ``[0], [1], [2], [4], [0, 0]``. ``fastforward build-tree`` measures what
    pays for the machine and model at hand and installs it as the default.
    """
    return [[r] for r in range(width)] + [[0] * d for d in range(2, depth + 1)]


def model_key(name: str) -> str:
    """A file-name-safe key for a model name (aliases folded: ``default`` and ``smollm2`` are ``smollm2-135m``)."""
    key = MODEL_ALIASES.get(str(name).lower(), str(name).lower())
    path = Path(str(name)).expanduser()
    if path.exists():
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        key = f"{path.name}-{digest}"
    return re.sub(r"[^a-z0-9._-]+", "-", key.lower()).strip("-") or "model"


def installed_tree_path(model_name: str) -> Path:
    """Where ``fastforward build-tree`` installs a model's machine-sized tree (the default ``tree`` of tr-jacobi)."""
    return trees_dir() / f"{model_key(model_name)}.json"


def read_tree(spec) -> tuple[list[list[int]], dict]:
    """(choices, metadata) from a tree spec: a choices list, ``"builtin"``, ``path``, or ``path:name``.

    A file may hold a plain choices list, an object of named lists (name one with ``path:name``), or a tree
    written by ``fastforward build-tree`` (an object with ``choices`` and metadata).
    """
    if isinstance(spec, (list, tuple)):
        return check_choices(spec, "tr-jacobi option tree"), {"source": "list"}
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"tree must be a JSON file path, 'path:name', 'builtin' or a choices list, got {spec!r}")
    if spec == "builtin":
        return builtin_choices(), {"source": "builtin"}
    path, name = spec, None
    if not Path(spec).expanduser().is_file() and ":" in spec:
        path, _, name = spec.rpartition(":")
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"tree file {file} does not exist")
    data = read_tree_file(file)
    if isinstance(data, dict) and isinstance(data.get("choices"), list) and name is None:
        meta = {k: v for k, v in data.items() if k != "choices"}
        meta["source"] = str(file)
        return check_choices(data["choices"], str(file)), meta
    return load_choices(file, name), {"source": spec}


@dataclass(eq=False)
class TRJacobiTemplate:
    """Everything static about a TR-Jacobi tree, computed once.

    Node order: the root, the choices tree's nodes (sorted by depth, then ranks), then the retrieval chain. Tokens
    are gathered from a flat buffer ``[root, cand[0, :], ..., cand[D-1, :], retrieval[0:R]]``.
    """

    choices: list[tuple[int, ...]]
    depth: int  # D: rows of the candidate table (the choices tree's depth)
    width: int  # K: columns of the candidate table (max rank + 1)
    retrieval_len: int  # R
    base: int  # nodes before the retrieval chain (root + choices)
    shapes: list[TreeShape]  # [m] the tree with the first m retrieval nodes, m = 0..R
    gathers: list[torch.Tensor]  # [m] flat-buffer index of every node of shapes[m]
    continuation: list[torch.Tensor]  # [node] the nodes below it whose logits refill table rows 0, 1, ...

    @property
    def size(self) -> int:
        return self.base + self.retrieval_len

    @property
    def shape(self) -> TreeShape:
        return self.shapes[-1]


def build_template(choices, retrieval_len: int = 5, max_context: int | None = None) -> TRJacobiTemplate:
    """The combined tree (choices tree + retrieval chain under the root) and its gather/refill indices; refused
    (one-line :class:`UsageError`) when it would put more tokens in a forward than
    :func:`~fastforward.validation.check_proposal_rows` allows for a model of context ``max_context``."""
    check_int("tr-jacobi", "retrieval_len", retrieval_len, 0, MAX_RETRIEVAL_LEN)
    ct = tree_from_choices(choices)
    if len(ct) == 1 and retrieval_len == 0:
        raise UsageError("an empty tree without a retrieval chain proposes nothing")
    n_c = len(ct)
    check_proposal_rows("tr-jacobi", n_c + retrieval_len,
                        f"a tree of {n_c - 1} choices and retrieval_len {retrieval_len}", max_context)
    depth = int(ct.node_depth.max()) if n_c > 1 else 0
    width = int(ct.node_rank.max()) + 1 if n_c > 1 else 1
    if width > MAX_PROPOSAL_ROWS:  # the candidate table holds `width` candidates per depth
        raise UsageError(f"tr-jacobi: the tree's ranks go up to {width - 1}; at most {MAX_PROPOSAL_ROWS - 1} "
                         "are allowed")
    parents = ct.shape.parents.tolist() + [0 if j == 0 else n_c + j - 1 for j in range(retrieval_len)]
    gather = [0] + [1 + (int(d) - 1) * width + int(r) for d, r in zip(ct.node_depth[1:], ct.node_rank[1:], strict=True)]
    gather += [1 + depth * width + j for j in range(retrieval_len)]
    gather_t = torch.tensor(gather, dtype=torch.long)
    shapes = [TreeShape(torch.tensor(parents[: n_c + m])) for m in range(retrieval_len + 1)]
    gathers = [gather_t[: n_c + m] for m in range(retrieval_len + 1)]

    # Continuations: from every node, descend into the child with the tallest subtree (ties: the earliest node,
    # i.e. the lowest ranks). The root descends into the choices tree (the Jacobi windows, whose rows the table
    # holds) and into the retrieval chain only when there is no choices tree. Nodes come after their parents, so
    # heights fill in one reverse pass over the (tens of) nodes, once per tree.
    n = len(parents)
    height = [0] * n
    best_child = [-1] * n
    for v in range(n - 1, 0, -1):
        p = parents[v]
        if p == 0 and v >= n_c and n_c > 1:
            continue
        if height[v] + 1 > height[p] or (height[v] + 1 == height[p] and v < best_child[p]):
            height[p] = height[v] + 1
            best_child[p] = v
    continuation = []
    for v in range(n):
        chain, c = [], best_child[v]
        while c >= 0 and len(chain) < depth:
            chain.append(c)
            c = best_child[c]
        continuation.append(torch.tensor(chain, dtype=torch.long))
    return TRJacobiTemplate(ct.choices, depth, width, retrieval_len, n_c, shapes, gathers, continuation)


class TRJacobiProposer(Proposer):
    """Proposes the template tree filled from the candidate table and the prompt-lookup continuation."""

    name = "tr-jacobi"

    def __init__(self, template: TRJacobiTemplate, *, ngram: int = 3, min_ngram: int = 1, init: str = "noise",
                 tree_source: str = ""):
        self.t = template
        self.ngram = ngram
        self.min_ngram = min_ngram
        self.init = init
        self.tree_source = tree_source
        self.cand = torch.zeros(template.depth, template.width, dtype=torch.long)
        self._dk = template.depth * template.width
        self._buf = torch.zeros(1 + self._dk + template.retrieval_len, dtype=torch.long)
        self._k = template.width
        self.index = NgramIndex(ngram, min_ngram)  # the lookup, updated with new tokens only (as pld's)
        self._reset_stats()

    def _reset_stats(self):
        self._steps = self._retrieval_steps = self._retrieval_tokens = 0
        self._from_tree = self._from_retrieval = self._noise_rows = 0

    def max_proposal_size(self) -> int:
        return self.t.size

    def _noise(self, state: DecodeState, rows: int, cols: int) -> torch.Tensor:
        return init_tokens(state, rows * cols, self.init).view(rows, cols)

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self._reset_stats()
        self._k = min(self.t.width, state.target.vocab_size)
        self.index.reset()
        self.index.sync(state.tokens)
        if self._dk:
            self.cand = self._noise(state, self.t.depth, self.t.width)

    def propose(self, state: DecodeState) -> Proposal:
        t = self.t
        retrieved = None
        m = 0
        if t.retrieval_len:
            self.index.sync(state.tokens)  # reads only the tokens accepted since the last step
            retrieved = self.index.match(state.tokens, t.retrieval_len)[0]
            m = retrieved.numel()
        buf = self._buf
        buf[0] = state.root
        buf[1 : 1 + self._dk] = self.cand.view(-1)
        if m:
            buf[1 + self._dk : 1 + self._dk + m] = retrieved
        self._steps += 1
        self._retrieval_steps += m > 0
        self._retrieval_tokens += m
        # for step observers (build-tree's calibration): the candidate table and the retrieval chain behind the draft
        info = {"root_position": state.root_position, "candidates": self.cand.clone(),
                "retrieval": buf[1 + self._dk : 1 + self._dk + m].clone()}
        return Proposal(DraftTree(buf[t.gathers[m]], t.shapes[m]), info=info)

    def observe(self, state: DecodeState, step: StepResult) -> None:
        t = self.t
        last = step.verdict.path[-1]
        if last >= t.base:
            self._from_retrieval += step.verdict.accepted
        else:
            self._from_tree += step.verdict.accepted
        if not self._dk:
            return
        cont = t.continuation[last]
        n = len(step.proposal.tree)
        if cont.numel() and int(cont[-1]) >= n:  # a shortened proposal (no lookup match, or the KV room ran out)
            cont = cont[cont < n]
        m = cont.numel()
        k = self._k
        if m:
            self.cand[:m, :k] = step.logits[cont].topk(k, dim=-1).indices
            if k < t.width:  # a vocabulary smaller than the table
                self.cand[:m, k:] = self._noise(state, m, t.width - k)
        if m < t.depth:
            self.cand[m:] = self._noise(state, t.depth - m, t.width)
            self._noise_rows += t.depth - m

    def stats(self) -> dict:
        steps = max(self._steps, 1)
        return {
            "tree": self.tree_source,
            "tree_tokens": self.t.size,
            "choices_nodes": self.t.base - 1,
            "retrieval_hit_rate": self._retrieval_steps / steps,
            "mean_retrieval_tokens": self._retrieval_tokens / steps,
            "accepted_from_tree": self._from_tree,
            "accepted_from_retrieval": self._from_retrieval,
            "noise_rows_per_step": self._noise_rows / steps,
        }


def resolve_tree(target, tree) -> tuple[list[list[int]], str]:
    """(choices, description) for the ``tree`` option; ``None`` = this model's installed tree, else builtin."""
    if tree is None:
        path = installed_tree_path(getattr(target, "name", "model"))
        if path.is_file():
            choices, _ = read_tree(str(path))
            return choices, str(path)
        return builtin_choices(), "builtin"
    choices, meta = read_tree(tree)
    return choices, str(meta.get("source", tree))


@register(
    "tr-jacobi",
    "MSN's TR-Jacobi: a Jacobi token tree (Medusa-style choices) plus a prompt-lookup retrieval chain, one forward",
    source="Make Some Noise (Wang et al., EMNLP 2024) §3.3, App. B",
    options=(
        Option("tree", "path", None, accepts=(list, tuple),
               help="a tree JSON file (path:name picks a named list; a 'fastforward build-tree' output works), a "
                    "choices list, or 'builtin' (default: the tree built for this model on this machine, else "
                    "builtin)"),
        Option("retrieval_len", "int", 5, 0, MAX_RETRIEVAL_LEN, help="prompt-lookup chain length (0 = none)",
               bound=f"rows per forward with the tree (at most the engine's {MAX_PROPOSAL_ROWS:,} and the model's "
                     "context), and one precomputed tree shape per length"),
        Option("ngram", "int", 3, 1, MAX_NGRAM, bound=NGRAM_BOUND,
               help="the longest suffix n-gram the lookup matches (MSN: 3)"),
        Option("min_ngram", "int", 1, 1, MAX_NGRAM, bound="as ngram's (and at most ngram itself)",
               help="the shortest suffix n-gram the lookup matches (at most ngram; MSN: 3, the default backs off)"),
        Option("init", "choice", "noise", choices=INIT_MODES,
               help="how empty table rows are filled: MSN ahead noise, prompt tokens, or the pad token"),
    ),
    checks=(at_most("min_ngram", "ngram"),),
)
def tr_jacobi(target, *, tree=None, retrieval_len: int = 5, ngram: int = 3, min_ngram: int = 1,
              init: str = "noise") -> Proposer:
    """``tree``: JSON path (``path:name`` picks a named list; a ``fastforward build-tree`` output works), a choices
    list, or ``"builtin"``; default: the tree built for this model on this machine, else the builtin one.
    ``retrieval_len``: prompt-lookup chain length (0 = none, at most :data:`MAX_RETRIEVAL_LEN`).
    ``ngram``/``min_ngram``: longest and shortest suffix n-gram the lookup matches (MSN uses 3 only; the default
    backs off like PLD). ``init``: how empty table rows are filled: ``noise`` (MSN ahead noise), ``prompt`` or
    ``pad``. The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`); here, the
    tree and the forward's rows against the model's context."""
    choices, source = resolve_tree(target, tree)
    template = build_template(choices, retrieval_len, target.max_context)
    return TRJacobiProposer(template, ngram=ngram, min_ngram=min_ngram, init=init, tree_source=source)
