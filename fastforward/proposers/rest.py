"""REST: draft what followed the context's longest suffix in a datastore of text, or in the context itself.

Source: He et al., *REST: Retrieval-Based Speculative Decoding* (NAACL 2024, arXiv 2311.08252): the longest suffix of
the context found in a datastore, the continuations that follow its occurrences, a trie of them by frequency, the
most frequent paths verified as a tree. (SuffixDecoding, Oliaro et al. 2024 -- vLLM's ``suffix`` -- searches the
request's own context and earlier outputs the same way.) Two sources:

* the **context** (prompt + generated): the continuation of the latest earlier occurrence of its last n-gram, as
  ``pld`` drafts it, sized as ``pld`` sizes it (its running acceptance rate per n against the cost curve);
* the **datastore**: token sequences, best the target's own answers (``fastforward make-data``'s records; the
  held-out split is left out) or any JSONL of texts. The continuations of the occurrences that match the most
  context tokens make a trie; a node's raw share is the fraction of them that pass through it, ``count / (M + 1)``.
  Raw shares overstate how often the target agrees, the more so the shorter the match and the deeper the node, so
  a node's score is the rate at which the target has accepted such nodes so far (:class:`ScoreCalibration`, by
  match length, depth and raw share; learned as requests run, shared by them, greedy and sampled ones apart).

With ``context="first"`` (the default) a step drafts the context's chain when it has one worth its rows, else the
datastore's tree; ``"merge"`` makes one tree of both (a node both propose takes the larger score: the chain's node
at depth d scores ``alpha^d``); ``"off"`` drafts from the datastore alone. A tree is the rerank of
:mod:`._rerank`: the best-scored nodes (a parent always before its children), as many as this machine's cost curve
pays for. Drafts never change what is generated: the target verifies every token.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from ..costs import AcceptanceEstimate, best_chain_length, cost_model
from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..errors import UsageError
from ..jsonl import jsonl_records
from ..paths import made_data_dir
from ..tree import DraftTree, chain_shape
from ..validation import token_ids_problem
from . import register
from ._backoff import BackOff
from ._options import MAX_TREE_NODES, Option, max_nodes_option, nodes_option
from ._rerank import best_size, build_tree, rank
from .pld import NgramIndex

NGRAMS = (3, 2, 1)  # the n-gram sizes looked up, longest first
KEY_BITS = 21  # bits per token in an n-gram key: vocabularies up to 2M tokens, three tokens in 63 bits
MATCH_WINDOW = 16  # how far back a match is measured (only the longest matches' continuations are counted)
SCAN = 4  # occurrences measured per continuation read (the latest ones)
SEPARATOR = -1  # between the store's sequences
CONTEXT_MODES = ("first", "merge", "off")  # how the context's own match joins the datastore's drafts
BACKOFF_LIMIT = 8  # at most this many steps without a datastore lookup after looks that did not pay
LEARN_LIMIT = 2_000_000  # the most tokens a datastore learns from finished generations (then it stops adding)


def _keys(windows: np.ndarray) -> np.ndarray:
    """int64 keys of n-grams ``[..., n]`` (n <= 3): the tokens packed KEY_BITS bits each."""
    key = np.zeros(windows.shape[:-1], dtype=np.int64)
    for j in range(windows.shape[-1]):
        key = (key << KEY_BITS) | windows[..., j].astype(np.int64)
    return key


class TokenStore:
    """Token sequences with the positions of every 1-, 2- and 3-gram, for suffix lookups.

    ``tokens`` holds the sequences one after another, each followed by a separator (-1). For each n, ``keys[n]``
    (sorted) and ``starts[n]`` list every n-gram that some token follows, by key and then position: ``starts`` is
    where its continuation begins. Adding sequences inserts their n-grams in place (the arrays stay sorted).
    """

    def __init__(self, vocab_size: int):
        if vocab_size >= 1 << KEY_BITS:
            raise UsageError(f"rest: vocabularies of up to {1 << KEY_BITS} tokens are supported, got {vocab_size}")
        self.vocab_size = vocab_size
        self.tokens = np.zeros(0, dtype=np.int32)
        self.keys = {n: np.zeros(0, dtype=np.int64) for n in NGRAMS}
        self.starts = {n: np.zeros(0, dtype=np.int64) for n in NGRAMS}
        self.sequences = 0
        self.learned = 0  # tokens added from finished generations (see RetrievalProposer.finish)
        # how far the target follows this store's drafts, learned as it runs: greedy requests (the target's argmax)
        # and sampled ones (its samples, which leave the drafts more often) apart
        self.calibrations = {True: ScoreCalibration(), False: ScoreCalibration()}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.tokens.size) - self.sequences  # without the separators

    def add(self, sequences) -> None:
        """Append token sequences (lists of ids; empty ones are skipped)."""
        parts = [np.asarray(list(s) + [SEPARATOR], dtype=np.int32) for s in sequences if len(s)]
        if not parts:
            return
        new = np.concatenate(parts)
        with self._lock:
            base = self.tokens.size
            tokens = np.concatenate([self.tokens, new])
            for n in NGRAMS:
                if new.size <= n:
                    continue
                # window j = new[j : j + n], followed by new[j + n]: kept when none of them is a separator
                windows = np.lib.stride_tricks.sliding_window_view(new[:-1], n)
                keep = (windows != SEPARATOR).all(1) & (new[n:] != SEPARATOR)
                keys, starts = _keys(windows[keep]), base + np.flatnonzero(keep) + n
                order = np.argsort(keys, kind="stable")  # by key, then position (positions ascend already)
                keys, starts = keys[order], starts[order]
                at = np.searchsorted(self.keys[n], keys, side="right")  # after the older occurrences of each key
                self.keys[n] = np.insert(self.keys[n], at, keys)
                self.starts[n] = np.insert(self.starts[n], at, starts)
            self.tokens = tokens
            self.sequences += len(parts)

    def learn(self, sequence) -> None:
        """Add a finished generation, until LEARN_LIMIT tokens have been learned (then nothing more is added)."""
        if len(sequence) and self.learned + len(sequence) <= LEARN_LIMIT:
            self.add([sequence])
            self.learned += len(sequence)

    def continuations(self, context: np.ndarray, limit: int, depth: int) -> tuple[np.ndarray, int]:
        """The tokens that follow the longest suffix of ``context`` (int array, last token last) in the store, and
        how many context tokens that suffix has: ``[M, depth]`` (M <= ``limit``, the latest occurrences first; -1
        past a sequence's end), from the occurrences that match the most context tokens (up to MATCH_WINDOW).
        Empty ``[0, depth]`` and 0 when not even the last token occurs."""
        with self._lock:
            tokens = self.tokens
            for n in NGRAMS:
                if context.size < n:
                    continue
                keys = self.keys[n]
                key = _keys(context[-n:].reshape(1, n))[0]
                lo, hi = np.searchsorted(keys, key, side="left"), np.searchsorted(keys, key, side="right")
                if hi > lo:  # the latest occurrences first, at most SCAN of them
                    starts = self.starts[n][max(lo, hi - SCAN * limit) : hi][::-1]
                    break
            else:
                return np.zeros((0, depth), dtype=np.int64), 0
        # how many context tokens before the n-gram also match, per occurrence: keep the longest matches
        back = min(MATCH_WINDOW - n, context.size - n)
        matched = n
        if back > 0:
            at = starts[:, None] - n - 1 - np.arange(back)  # store positions before the n-gram, nearest first
            want = context[-n - 1 - np.arange(back)]  # the context tokens there
            same = (tokens[np.maximum(at, 0)] == want) & (at >= 0)
            longest = np.cumprod(same, axis=1).sum(1)
            matched += int(longest.max())
            starts = starts[longest == longest.max()]
        starts = starts[:limit]
        at = np.minimum(starts[:, None] + np.arange(depth), tokens.size - 1)
        cont = tokens[at].astype(np.int64)
        return np.where(np.cumprod(cont != SEPARATOR, axis=1).astype(bool), cont, -1), matched


# ----------------------------------------------------------------------------------------------------------------
# Datastores: read once per target and file
# ----------------------------------------------------------------------------------------------------------------

_STORES_LOCK = threading.Lock()  # over every target's {(path, mtime, size) or None: TokenStore} (its resource slot)


def datastore_file(path) -> Path:
    """The JSONL file of a datastore: the file given, or a make-data folder's ``responses.jsonl``."""
    p = Path(str(path)).expanduser()
    if p.is_dir():
        p = p / "responses.jsonl"
    if not p.is_file():
        raise UsageError(f"rest: datastore {path} does not exist (give a make-data folder or a JSONL file)")
    return p


def read_datastore(target, path) -> list[list[int]]:
    """The token sequences of a datastore file: each record's ``response_ids`` (make-data's records; those of the
    held-out split are left out) or its ``text`` (tokenized without a chat template). A datastore only proposes,
    so one made with another model is allowed (it helps as far as the tokenizer is shared); ids outside this
    target's vocabulary are refused. One-line errors name the file and line."""
    file = datastore_file(path)
    sequences = []
    for line, rec in jsonl_records(file):
        if rec.get("split") == "heldout":
            continue
        if "response_ids" in rec:
            problem = token_ids_problem(rec["response_ids"], target.vocab_size, allow_empty=True)
            if problem:
                raise UsageError(f"rest: {file}:{line}: response_ids {problem}")
            sequences.append(rec["response_ids"])
        elif isinstance(rec.get("text"), str):
            sequences.append(target.tokenizer(rec["text"], add_special_tokens=False)["input_ids"])
        else:
            raise UsageError(f"rest: {file}:{line}: a datastore record needs response_ids (a list of token ids) or "
                             "text (a string)")
    if not any(sequences):
        raise UsageError(f"rest: datastore {file} holds no tokens")
    return sequences


def datastore_for(target, path) -> TokenStore:
    """The :class:`TokenStore` of ``path`` for ``target``: read and indexed once per process (re-read if the file
    changes), shared by every request. ``path`` None: the target's store of learned generations only (empty until
    requests with ``learn`` finish)."""
    if path is None:
        key = None
    else:
        file = datastore_file(path).resolve()
        stat = file.stat()
        key = (str(file), stat.st_mtime_ns, stat.st_size)
    stores = target.shared("rest datastores", dict)
    with _STORES_LOCK:
        if key not in stores:
            store = TokenStore(target.vocab_size)
            if key is not None:
                store.add(read_datastore(target, file))
                for old in [k for k in stores if k is not None and k[0] == key[0]]:
                    del stores[old]  # an older version of the file is not kept
            stores[key] = store
        return stores[key]


# ----------------------------------------------------------------------------------------------------------------
# Scores and the proposer
# ----------------------------------------------------------------------------------------------------------------


class ScoreCalibration:
    """The rate at which the target accepts a drafted datastore node, by how many context tokens the lookup matched,
    the node's depth and its raw share: a table of ``BINS`` raw-share bins per (match, depth) bucket, each the
    decayed count of accepted over drafted nodes with a prior of ``strength`` nodes at the raw share itself,
    interpolated between bin centres. (A node never scores above its parent: the proposer takes the running minimum
    down each path.) Shared by the requests that use one datastore."""

    MATCH_EDGES = np.array([1, 2, 3, 5, 9])  # matched context tokens: 1, 2, 3-4, 5-8, 9+
    DEPTH_EDGES = np.array([1, 2, 3, 5])  # depth buckets: 1, 2, 3-4, 5+
    BINS = 10
    BATCH = 8

    def __init__(self, strength: float = 0.5, decay: float = 0.999):
        self.strength, self.decay = strength, decay
        self.centres = (np.arange(self.BINS) + 0.5) / self.BINS
        self.accepted = np.zeros((self.MATCH_EDGES.size * self.DEPTH_EDGES.size, self.BINS))
        self.drafted = np.zeros_like(self.accepted)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()
        self._rates = self._table()

    def _table(self) -> np.ndarray:
        return (self.accepted + self.strength * self.centres) / (self.drafted + self.strength)

    def _bucket(self, matched, depth: np.ndarray) -> np.ndarray:
        m = np.searchsorted(self.MATCH_EDGES, matched, side="right") - 1
        return m * self.DEPTH_EDGES.size + np.searchsorted(self.DEPTH_EDGES, depth, side="right") - 1

    def __call__(self, raw: np.ndarray, depth: np.ndarray, matched: int) -> np.ndarray:
        """Calibrated scores of nodes with raw shares ``raw`` at depths ``depth`` (arrays of one shape), from a
        lookup that matched ``matched`` context tokens: the bucket's rates interpolated linearly between bin centres
        (flat beyond the outer centres); 0 where raw is 0."""
        bucket = self._bucket(matched, depth)
        x = np.clip(raw * self.BINS - 0.5, 0.0, self.BINS - 1.0)  # position among the centres
        lo = np.minimum(x.astype(np.int64), self.BINS - 2)
        frac = x - lo
        rates = self._rates
        out = rates[bucket, lo] * (1.0 - frac) + rates[bucket, lo + 1] * frac
        return np.where(raw > 0, out, 0.0)

    def update(self, raw: np.ndarray, depth: np.ndarray, matched: int, accepted: np.ndarray) -> None:
        """Count drafted datastore nodes (raw share > 0) and which of them the target accepted. Counted in batches
        of ``BATCH`` steps (a table a few steps old drafts as well; a step's bookkeeping costs less)."""
        keep = raw > 0
        cell = np.minimum((raw[keep] * self.BINS).astype(np.int64), self.BINS - 1)
        with self._lock:
            self._pending.append((self._bucket(matched, depth[keep]) * self.BINS + cell, accepted[keep]))
            if len(self._pending) < self.BATCH:
                return
            flat = np.concatenate([f for f, _ in self._pending])
            hits = np.concatenate([a for _, a in self._pending]).astype(np.float64)
            steps = len(self._pending)
            self._pending.clear()
            size = self.drafted.size
            decay = self.decay**steps
            self.drafted = self.drafted * decay + np.bincount(flat, minlength=size).reshape(self.drafted.shape)
            self.accepted = self.accepted * decay + np.bincount(flat, weights=hits, minlength=size).reshape(
                self.accepted.shape)
            self._rates = self._table()


class RetrievalProposer(Proposer):
    """Each step: the context's own match when it pays (``context="first"``), else the trie of the datastore's
    continuations of the context's longest suffix (merged with the context's match: ``"merge"``), scored, cut to
    what the cost curve pays for (or to ``nodes``)."""

    name = "rest"

    def __init__(self, store: TokenStore, max_depth: int = 8, candidates: int = 64, nodes: int = 0,
                 max_nodes: int = 24, context: str = "first", max_ngram: int = 3, learn: bool = False):
        self.store, self.learns_across_requests = store, learn
        self.max_depth, self.candidates, self.context = max_depth, candidates, context
        self.nodes, self.max_nodes = nodes, nodes or max_nodes
        self.index = NgramIndex(max_ngram, 1)
        self.costs = None  # this machine's cost model (live): prepare()
        self._reset()

    def _reset(self) -> None:
        self.estimates = {n: AcceptanceEstimate() for n in range(1, self.index.max_ngram + 1)}
        self.back_off = BackOff(BACKOFF_LIMIT)
        self.steps = self.from_store = self.from_context = self.drafted = 0
        self.pending = None

    def max_proposal_size(self) -> int:
        return self.max_nodes

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self._reset()
        self.index.reset()
        self.index.sync(state.tokens)
        if self.costs is None:
            self.prepare(state.target)

    def prepare(self, target) -> None:
        self.costs = cost_model(target)

    def _curve_ms(self) -> np.ndarray:
        """t(1..max_nodes) from the live cost model."""
        return self.costs.table(self.max_nodes, numpy=True)

    def propose(self, state: DecodeState) -> Proposal | None:
        self.pending = None
        for est in self.estimates.values():
            est.tick()
        depth = min(self.max_depth, state.remaining - 1)
        if state.max_draft_depth is not None:
            depth = min(depth, state.max_draft_depth)
        if depth <= 0:
            return None
        self.steps += 1
        tokens = state.tokens
        chain, chain_n = None, 0
        if self.context != "off":
            self.index.sync(tokens)
            chain, chain_n = self.index.match(tokens, depth)
        if chain_n and self.context == "first":  # the context's match, sized as pld sizes it, when it pays
            k = best_chain_length(self.estimates[chain_n].alpha, chain.numel(), self.costs)
            if k > 0:
                self.from_context += 1
                self.drafted += k
                self.pending = (chain_n, chain[:k].tolist(), np.zeros(k), np.arange(1, k + 1), 0)
                return Proposal(DraftTree(torch.cat([tokens[-1:], chain[:k]]), chain_shape(k + 1)))
            chain, chain_n = None, 0  # not worth its rows: the datastore alone
        if self.back_off.skipping():  # the datastore's recent looks drafted nothing, or nothing that paid
            return None
        self.back_off.looking()
        rows, matched = self.store.continuations(tokens[-MATCH_WINDOW:].numpy(), self.candidates, depth)
        store_rows = rows.shape[0]
        if chain_n:  # "merge": the chain joins the datastore's rows
            row = np.full((1, depth), -1, dtype=np.int64)
            row[0, : chain.numel()] = chain.numpy()
            rows = np.concatenate([rows, row])
        if rows.shape[0] == 0:
            return None
        trie = _trie(rows, store_rows)
        if trie is None:
            return None
        node_tokens, parents, depths, raw, chained, paths, begins_at = trie
        alpha = self.estimates[chain_n].alpha if chain_n else 0.0
        calibration = self.store.calibrations[state.sampling.greedy]
        scores = np.maximum(calibration(raw, depths, matched), np.where(chained, alpha ** depths, 0.0))
        # no node above its parent (so the ranking puts parents first): the running minimum down each row's path
        along = np.minimum.accumulate(np.where(paths >= 0, scores[paths], 1.0), axis=1)
        scores = along[begins_at, depths - 1]
        order = rank(scores, depths)
        limit = min(self.max_nodes, scores.size + 1)
        n = best_size(scores[order], self._curve_ms(), limit, self.nodes)
        if n <= 1:
            self.back_off.drafted_nothing()
            return None
        self.back_off.drafted(n)
        self.from_store += store_rows > 0
        self.from_context += chain_n > 0
        self.drafted += n - 1
        tree = build_tree(order[: n - 1], node_tokens, parents, depths, state.root)
        chosen = order[: n - 1][np.argsort(depths[order[: n - 1]], kind="stable")]  # tree node i + 1 = chosen[i]
        self.pending = (chain_n, chain.tolist() if chain_n else [], raw[chosen], depths[chosen], matched)
        return Proposal(tree)

    def observe(self, state: DecodeState, step: StepResult) -> None:
        self.index.sync(state.tokens)
        if self.pending is None:
            return
        chain_n, chain, raw, depths, matched = self.pending
        self.pending = None
        self.back_off.verdict(step.verdict.accepted, self._curve_ms())  # judges a datastore tree (a chain: no-op)
        target_tokens = step.new_tokens  # the target's tokens at depths 1, 2, ...: accepted ones, then its own
        if chain_n:
            known = min(len(chain), len(target_tokens))
            agree = next((i for i in range(known) if chain[i] != target_tokens[i]), known)
            self.estimates[chain_n].update(known, agree)
        if raw.any():  # datastore nodes were drafted: count which the target accepted (the engine may have cut
            n = len(step.proposal.tree) - 1  # the draft: only the nodes verified count)
            accepted = np.zeros(raw.size, dtype=bool)
            accepted[np.asarray(step.verdict.path[1:], dtype=np.int64) - 1] = True
            self.store.calibrations[state.sampling.greedy].update(raw[:n], depths[:n], matched, accepted[:n])

    def finish(self, state: DecodeState) -> None:
        if self.learns_across_requests:  # this generation joins the datastore for the requests after it
            self.store.learn(state.tokens[state.prompt_length :].tolist())

    def stats(self) -> dict:
        return {
            "lookups": self.steps,
            "steps_with_datastore_match": self.from_store,
            "steps_with_context_match": self.from_context,
            "mean_draft_nodes": self.drafted / self.steps if self.steps else 0.0,
            "alpha_by_ngram": {n: round(e.alpha, 3) for n, e in self.estimates.items()},
        }


def _trie(rows: np.ndarray, store_rows: int):
    """The trie of ``rows`` ``[R, D]`` (token ids, -1 = none; the first ``store_rows`` from the datastore, the rest
    the context's chain) as candidate nodes, depth by depth: (tokens, parents (-1 = the root; else an earlier
    index), depths, raw shares ``count / (store_rows + 1)`` of datastore rows, whether the chain passes, each
    sorted row's nodes ``[R, D]`` (-1 past its end), the row each node begins at), or None.
    Vectorised: the rows sorted, a node = a run of rows that share its prefix."""
    R, D = rows.shape
    order = np.lexsort(rows.T[::-1])  # by column 0, then 1, ...: the rows under a node are consecutive
    rows = rows[order]
    from_store = order < store_rows
    valid = np.cumprod(rows >= 0, axis=1).astype(bool)  # [R, D]: row r reaches depth d + 1
    differs = np.ones((R, D), dtype=bool)
    differs[1:] = rows[1:] != rows[:-1]
    first_diff = np.where(differs.any(1), differs.argmax(1), D)  # the first column where a row leaves the one above
    begins = (first_diff[:, None] <= np.arange(D)) & valid  # [R, D]: a node begins at row r, depth d + 1
    if not begins.any():
        return None
    per_depth = begins.sum(0)
    offset = np.concatenate([[0], np.cumsum(per_depth)[:-1]])
    node_of = np.cumsum(begins, axis=0) - 1 + offset  # [R, D]: the node holding row r at depth d + 1 (where valid)
    d_idx, r_idx = np.nonzero(begins.T)  # depth-major, so node ids ascend in this order
    n_nodes = int(per_depth.sum())
    flat = node_of[valid]
    counts = np.bincount(flat, weights=np.broadcast_to(from_store[:, None], (R, D))[valid].astype(np.float64),
                         minlength=n_nodes)
    chained = np.bincount(flat, weights=np.broadcast_to(~from_store[:, None], (R, D))[valid].astype(np.float64),
                          minlength=n_nodes) > 0
    parents = np.where(d_idx > 0, node_of[r_idx, np.maximum(d_idx - 1, 0)], -1)
    return (rows[r_idx, d_idx].astype(np.int64), parents.astype(np.int64), d_idx + 1, counts / (store_rows + 1),
            chained, np.where(valid, node_of, -1), r_idx)


#: the deepest draft, and the most continuations read per step: a step reads up to MAX_CANDIDATES x MAX_DEPTH tokens
MAX_DEPTH = 64
MAX_CANDIDATES = 4096
_READ_BOUND = (f"time and memory per step: a step reads up to candidates x max_depth tokens of the datastore "
               f"({MAX_CANDIDATES:,} x {MAX_DEPTH} = {MAX_CANDIDATES * MAX_DEPTH:,})")


def _none_needs_learn(method: str, options: dict) -> None:
    store = options["datastore"]
    if (store is None or str(store) == "none") and not options["learn"]:
        raise UsageError(f"{method}: datastore=none needs learn=True (a store of learned generations alone)")


@register(
    "rest",
    "REST: draft the continuations of the context's longest suffix in a datastore (and in the context), as a tree",
    source="He et al. 2024, REST: Retrieval-Based Speculative Decoding, arXiv 2311.08252",
    options=(
        Option("datastore", "path", "",
               help="a make-data folder or a JSONL file of records with response_ids or text (default: make-data's "
                    "output for this model, if written; none with learn=True: learned generations alone)"),
        Option("max_depth", "int", 8, 1, MAX_DEPTH, bound=_READ_BOUND + f"; a chain of it fills at most "
               f"{MAX_DEPTH} of a tree's {MAX_TREE_NODES} nodes", help="the deepest draft"),
        Option("candidates", "int", 64, 1, MAX_CANDIDATES, bound=_READ_BOUND,
               help="the most continuations read per step"),
        nodes_option(low=2),
        max_nodes_option(24),
        Option("context", "choice", "first", choices=CONTEXT_MODES,
               help="first: the context's own match when it has one worth drafting, else the datastore; merge: one "
                    "tree of both; off: the datastore alone"),
        Option("learn", "bool", False,
               help="each finished generation joins the datastore for the requests after it (up to "
                    f"{LEARN_LIMIT:,} tokens)"),
    ),
    checks=(_none_needs_learn,),
)
def rest(target, *, datastore: str = "", max_depth: int = 8, candidates: int = 64, nodes: int = 0,
         max_nodes: int = 24, context: str = "first", learn: bool = False) -> RetrievalProposer:
    """``datastore``: a make-data folder (the target's own answers; the held-out split is left out) or a JSONL file
    of records with ``response_ids`` or ``text`` (default: make-data's default output for this model, if written);
    ``max_depth``: the deepest draft; ``candidates``: the most continuations read per step; ``nodes``: a fixed size
    of the datastore's trees (root included; 0 = sized by this machine's cost curve, at most ``max_nodes``);
    ``context``: ``first`` = the context's own match (as ``pld``) when it has one worth drafting, else the
    datastore; ``merge`` = one tree of both; ``off`` = the datastore alone; ``learn``: each finished generation
    joins the datastore for the requests after it (SuffixDecoding's cache of earlier outputs, up to LEARN_LIMIT
    tokens per datastore; with ``datastore="none"``, a store of learned generations alone). The values are checked
    against the schema (:func:`~fastforward.proposers.make_proposer`)."""
    if datastore is None or str(datastore) == "none":  # with learn=True (the schema's check)
        datastore = None
    elif not str(datastore):  # make-data's default output for this model, when there is one
        datastore = made_data_dir(target.name)
        if not (datastore / "responses.jsonl").is_file():
            raise UsageError("rest: give a datastore: -o datastore=PATH (a 'fastforward make-data' folder, or a JSONL "
                             f"file of records with response_ids or text); without one, {datastore} is used once "
                             "'fastforward make-data' has written it (or datastore=none learn=True)")
    return RetrievalProposer(datastore_for(target, datastore), max_depth, candidates, nodes, max_nodes, context,
                             learn=learn)
