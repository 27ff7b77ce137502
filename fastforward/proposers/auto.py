"""auto: every step, the draft that buys the most tokens per millisecond -- from the context, the datastore, the
trained drafter, or none.

Each method alone wins only where its source has something to say: prompt lookup where the answer copies the
context, REST where it repeats earlier answers, a trained drafter where the text is predictable but new, and no draft
where nothing is (a CPU pays for every row of a forward). ``auto`` asks every source the model has and verifies,
each step, the tree that maximises expected tokens per millisecond on this machine's live cost model:

* **Sources.** ``context``: the continuation of the latest earlier occurrence of the context's last n-gram (as
  ``pld``); ``datastore``: the trie of continuations of the context's longest suffix in a token store (as ``rest``: a
  make-data folder of the target's own answers, a JSONL of texts, or -- with ``learn`` -- the answers this process
  has given); ``drafter``: the trained EAGLE-3 drafter shipped (or given) for the model, its top-k tree over the
  target's own features (as ``eagle``).
* **The context first.** A step whose context has a continuation that pays (cut as ``pld`` cuts it, for the run's
  agreement rate of that n-gram length) drafts that chain and asks nothing else: a lookup of tens of microseconds,
  where merging the other sources' trees cost more than they added (measured: docs/methods.md). Otherwise the
  datastore (skipped a while after looks that did not pay, as ``rest`` does) and the drafter are asked:
* **Calibrated chances.** Each candidate node gets the chance that it lies on the target's path, from a table per
  source learned online (:class:`~fastforward.proposers.rest.ScoreCalibration`: by the source's key -- the n-gram
  length, the datastore match length -- the node's depth and its raw value -- the datastore share, the drafter's
  path probability; with a prior at the raw value itself). After every verification *every* source that made
  candidates learns from the target's tokens, whichever source drafted: a node at depth d whose parent lay on the
  target's path is counted as accepted or not as soon as the target's token at depth d is known. Tables are shared
  by the runs of a target (greedy and sampled runs apart), so a server or a benchmark keeps what it learned.
* **One tree of both.** Their candidates are merged into one trie (a node several sources propose counts
  once, at its best chance) and ranked; the tree is the top n - 1 under the root, n maximising
  ``(1 + sum of their chances) / t(n)`` on the live cost curve (:func:`~fastforward.costs.best_draft`, the one
  pricing of every draft). A draft of nothing is the option n = 1.
* **The drafter only when it pays.** The lookups cost microseconds; the drafter's pass costs a good part of a step.
  It is asked only when its expected extra tokens per extra millisecond (an average of what its drafts added over
  the best tree of the cheap sources, and of what they cost: its pass and the larger forward -- kept apart for steps
  where the cheap sources had a draft and where they had none) beat the rate the cheap tree already gets; else it
  is probed after 1, 2, 4, ... up to ``probe`` steps (the interval shared by the runs of a target), reset whenever
  a probe pays. A drafter that was
  not asked costs nothing that step: the target's features of the accepted rows wait, and go through it in one pass
  when it is next asked. A drafter that does not pay is set aside (no features tapped, no catch-up): for the rest of
  a run once a probe at the longest wait bought nothing, for the target's next ``SET_ASIDE_RUNS`` runs after such a
  run, and in every forward shared with other sequences, where its pass would delay them all.
* **Sharing a forward.** Beside other sequences a draft row has to pay for a step of all of them: the context's chain
  is priced so (:func:`~fastforward.costs.best_chain_length` with ``others``), and nothing else is asked.

Lossless whatever is drafted: the target verifies every token (greedy: its argmax; sampling: keyed draws, so a seeded
run returns the same samples as ``ar`` -- no source's draft carries draft probabilities).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..costs import AcceptanceEstimate, best_chain_length, best_draft, cost_model
from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..paths import made_data_dir
from ..stats import draft_source_rates
from ..tree import DraftTree, chain_shape
from ..verify import SamplingConfig
from . import register
from ._backoff import BackOff
from ._options import Option, max_nodes_option
from ._rerank import build_tree, rank
from .pld import NgramIndex
from .rest import BACKOFF_LIMIT, MATCH_WINDOW, ScoreCalibration, _trie, datastore_for

SOURCES = ("context", "datastore", "drafter")
CONTEXT, DATASTORE, DRAFTER = range(3)
MAX_DEPTH = 16
MAX_CANDIDATES = 1024
MAX_PROBE = 64
#: after a run whose drafter did not pay, this many of the target's next runs start without it (no features tapped,
#: no catch-up); the one after them probes it again
SET_ASIDE_RUNS = 8
CONTEXT_NGRAM = 3  # the longest n-gram of the context matched (as pld's default)


@dataclass
class Candidates:
    """One source's candidate nodes under the root, parents before children (numpy arrays of one length)."""

    source: int
    tokens: np.ndarray  # target token ids
    parents: np.ndarray  # index of the parent in these arrays; -1: the root
    depths: np.ndarray  # 1 = a child of the root
    raw: np.ndarray  # the uncalibrated value the source's calibration maps
    key: int  # the calibration's key (n-gram length, datastore match length; 1 for the drafter)
    scores: np.ndarray | None = None  # calibrated chance of lying on the target's path, never above the parent's


def monotone_down_paths(scores: np.ndarray, parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """``scores`` with no node above its parent (the running minimum down each path), depth by depth."""
    out = scores.copy()
    for d in range(2, int(depths.max(initial=0)) + 1):
        at = np.nonzero(depths == d)[0]
        out[at] = np.minimum(out[at], out[parents[at]])
    return out


def on_target_path(c: Candidates, target_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``c``'s nodes are known after a verification whose target tokens at depths 1, 2, ... are
    ``target_tokens`` (the accepted tokens, then the bonus token), and whether each lies on the target's path: a
    node is known when its parent is known to be off the path, or lies on it and the target's token at the node's
    depth is known."""
    m = target_tokens.size
    known = np.zeros(c.tokens.size, dtype=bool)
    on = np.zeros(c.tokens.size, dtype=bool)
    for d in range(1, int(c.depths.max(initial=0)) + 1):
        at = np.nonzero(c.depths == d)[0]
        if d == 1:
            parent_known, parent_on = np.ones(at.size, dtype=bool), np.ones(at.size, dtype=bool)
        else:
            parent_known, parent_on = known[c.parents[at]], on[c.parents[at]]
        if d <= m:
            hit = c.tokens[at] == target_tokens[d - 1]
            known[at] = parent_known
            on[at] = parent_on & hit
        else:
            known[at] = parent_known & ~parent_on
    return known, on


@dataclass
class MergedTree:
    """The union trie of several sources' candidates: per node its token, parent (-1: the root), depth, best
    chance, and which sources proposed it (bit i: source i)."""

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    scores: np.ndarray
    sources: np.ndarray

    @property
    def size(self) -> int:
        return int(self.tokens.size)


def merge(parts: list[Candidates], vocab_size: int) -> MergedTree:
    """One trie of ``parts`` (each already scored): nodes with the same path are one node, depth by depth. (Each
    source's own candidates are a trie already: one part is taken as it is.)"""
    if len(parts) == 1:
        p = parts[0]
        return MergedTree(p.tokens.astype(np.int64), p.parents.astype(np.int64), p.depths.astype(np.int64), p.scores,
                          np.full(p.tokens.size, 1 << p.source, dtype=np.int64))
    tokens = np.concatenate([p.tokens for p in parts]).astype(np.int64)
    depths = np.concatenate([p.depths for p in parts]).astype(np.int64)
    scores = np.concatenate([p.scores for p in parts])
    bits = np.concatenate([np.full(p.tokens.size, 1 << p.source, dtype=np.int64) for p in parts])
    offsets = np.cumsum([0] + [p.tokens.size for p in parts[:-1]])
    parents = np.concatenate([np.where(p.parents >= 0, p.parents + o, -1) for p, o in zip(parts, offsets,
                                                                                            strict=True)])
    merged_of = np.full(tokens.size, -1, dtype=np.int64)
    out_tokens, out_parents, out_depths, out_scores, out_bits = [], [], [], [], []
    n = 0
    for d in range(1, int(depths.max(initial=0)) + 1):
        at = np.nonzero(depths == d)[0]
        if at.size == 0:
            break
        up = np.where(parents[at] >= 0, merged_of[np.maximum(parents[at], 0)], -1)
        keys = (up + 1) * vocab_size + tokens[at]
        uniq, inverse = np.unique(keys, return_inverse=True)
        merged_of[at] = n + inverse
        best = np.zeros(uniq.size)
        np.maximum.at(best, inverse, scores[at])
        who = np.zeros(uniq.size, dtype=np.int64)
        np.bitwise_or.at(who, inverse, bits[at])
        out_tokens.append(uniq % vocab_size)
        out_parents.append(uniq // vocab_size - 1)
        out_depths.append(np.full(uniq.size, d, dtype=np.int64))
        out_scores.append(best)
        out_bits.append(who)
        n += uniq.size
    if not n:
        empty = np.zeros(0, dtype=np.int64)
        return MergedTree(empty, empty, empty, np.zeros(0), empty)
    return MergedTree(np.concatenate(out_tokens), np.concatenate(out_parents), np.concatenate(out_depths),
                      np.concatenate(out_scores), np.concatenate(out_bits))


@dataclass
class Choice:
    """A tree chosen from a merged trie: its nodes (indices into the trie, ranked), expected tokens and cost."""

    nodes: np.ndarray
    expected: float  # 1 + the chosen nodes' chances (the bonus token included)
    ms: float  # t(n) of its forward

    @property
    def rate(self) -> float:
        return self.expected / self.ms


def choose(tree: MergedTree, curve_ms: np.ndarray, limit: int) -> Choice:
    """The top n - 1 nodes of ``tree`` by chance, n (1..limit) maximising expected tokens per millisecond."""
    if tree.size == 0 or limit <= 1:
        return Choice(np.zeros(0, dtype=np.int64), 1.0, float(curve_ms[0]))
    order = rank(tree.scores, tree.depths)
    limit = min(limit, tree.size + 1)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(tree.scores[order[: limit - 1]], dtype=np.float64)])
    n = best_draft(gain, curve_ms[:limit]) + 1
    return Choice(order[: n - 1], float(gain[n - 1]), float(curve_ms[n - 1]))


def accepted_depth(tree: MergedTree, nodes: np.ndarray, target_tokens: np.ndarray) -> int:
    """How deep a tree of ``nodes`` (of ``tree``) would have been accepted, as far as ``target_tokens`` tell."""
    if nodes.size == 0:
        return 0
    part = Candidates(-1, tree.tokens, tree.parents, tree.depths, tree.scores, 0)
    known, on = on_target_path(part, target_tokens)
    chosen = np.zeros(tree.size, dtype=bool)
    chosen[nodes] = True
    hit = on & chosen & known
    return int(tree.depths[hit].max(initial=0))


class DrafterAverages:
    """What asking the drafter has bought, on average: the extra tokens its drafts added over the cheap sources'
    tree and the extra milliseconds they cost, apart for steps where the cheap sources had a draft and where they had
    none. Shared by the runs of a target (greedy and sampled apart), so a new request starts from what the earlier
    ones learned; the first start from an optimistic prior, so that the drafter is tried."""

    DECAY = 0.85  # weight of the old average at each drafter step

    def __init__(self, prior_gain: float = 0.6, prior_ms: float = 1.0):
        self.gain = {False: prior_gain, True: prior_gain}
        self.cost = {False: prior_ms, True: prior_ms}
        self.interval = 1  # steps between probes while the drafter does not pay (see DrafterGate)
        self.paid_lately = True  # False once a probe at the longest wait bought nothing (until one pays)
        self.runs_set_aside = 0  # runs started without the drafter since it last failed (see AutoProposer.new_run)

    def keeps_drafter(self) -> bool:
        """Whether a new run of the target takes the drafter: yes while it paid lately; otherwise every
        ``SET_ASIDE_RUNS + 1``-th run, to probe it again."""
        if self.paid_lately or self.runs_set_aside >= SET_ASIDE_RUNS:
            self.runs_set_aside = 0
            return True
        self.runs_set_aside += 1
        return False

    def rate(self, cheap_drafts: bool) -> float:
        return self.gain[cheap_drafts] / max(self.cost[cheap_drafts], 1e-3)

    def add(self, cheap_drafts: bool, extra_tokens: float, extra_ms: float) -> None:
        k = self.DECAY
        self.gain[cheap_drafts] = k * self.gain[cheap_drafts] + (1 - k) * extra_tokens
        self.cost[cheap_drafts] = k * self.cost[cheap_drafts] + (1 - k) * max(extra_ms, 1e-3)


class DrafterGate:
    """Whether a run asks the drafter this step (see the module docstring): when its average rate
    (:class:`DrafterAverages`) beats the cheap tree's, else after 1, 2, 4, ... ``probe`` steps (reset when a probe
    pays). The interval lives with the averages, shared by the runs of a target: a new request goes on backing off
    where the last one stopped, rather than probing again from 1."""

    def __init__(self, probe: int, averages: DrafterAverages | None = None):
        self.probe = probe
        self.averages = averages if averages is not None else DrafterAverages()
        self.waited = 0
        self.asked = self.probes = 0

    def ask(self, cheap_drafts: bool, cheap_rate: float) -> bool:
        self.waited += 1
        if self.averages.rate(cheap_drafts) > cheap_rate:
            self.asked += 1
            return True
        if self.waited >= min(self.averages.interval, self.probe):
            self.asked += 1
            self.probes += 1
            return True
        return False

    def outcome(self, cheap_drafts: bool, extra_tokens: float, extra_ms: float, cheap_rate: float) -> bool:
        """What asking bought: ``extra_tokens`` accepted beyond the cheap tree's, for ``extra_ms``. Returns False
        when it was a probe at the longest wait that bought nothing (the run then sets the drafter aside)."""
        self.waited = 0
        av = self.averages
        av.add(cheap_drafts, extra_tokens, extra_ms)
        if extra_tokens >= cheap_rate * extra_ms:
            av.interval, av.paid_lately = 1, True
            return True
        if av.interval >= self.probe:
            av.paid_lately = False
            return False
        av.interval = min(2 * av.interval, self.probe)
        return True


class SourceStats:
    """What one source did in a run: steps it was asked, its lookup time, steps its nodes were drafted, tokens
    accepted from its nodes, and per depth how often its drafted node there was accepted."""

    def __init__(self):
        self.asked = self.drafted = self.accepted = 0
        self.ms = 0.0
        self.failed = ""  # what the source raised, if it did (then it drafted nothing more in the run)
        self.attempts: list[int] = []
        self.accepts: list[int] = []

    def count(self, depths: list[int] | range, accepted_depth: int) -> None:
        """A step its nodes were drafted in: ``depths``, the distinct depths they lay at (ascending; a chain of k:
        ``range(1, k + 1)``), the target accepting the draft to ``accepted_depth``."""
        self.drafted += 1
        deepest = depths[-1]
        if len(self.attempts) < deepest:
            self.attempts += [0] * (deepest - len(self.attempts))
            self.accepts += [0] * (deepest - len(self.accepts))
        for d in depths:
            self.attempts[d - 1] += 1
            self.accepts[d - 1] += d <= accepted_depth
        self.accepted += min(accepted_depth, deepest)

    def as_dict(self, steps: int) -> dict:
        counts = {"asked": self.asked, "drafted_steps": self.drafted, "accepted_tokens": self.accepted,
                  "ms": round(self.ms, 3), "attempts_by_depth": list(self.attempts),
                  "accepts_by_depth": list(self.accepts)}
        rates = draft_source_rates(counts, steps)
        return {**rates, **({"failed": self.failed} if self.failed else {})}


class AutoProposer(Proposer):
    name = "auto"

    def __init__(self, target, *, drafter=None, store=None, max_depth: int = 10, max_nodes: int = 24,
                 candidates: int = 64, probe: int = 32, context: bool = True, learn: bool = False):
        self.drafter = drafter  # an EagleProposer driven for its candidates (or None)
        self.store = store  # a TokenStore (or None)
        self.has = (bool(context), store is not None, drafter is not None)  # the sources it was made with
        self.learns_across_requests = learn
        self.vocab_size = target.vocab_size
        self.max_depth, self.max_nodes, self.candidates = max_depth, max_nodes, candidates
        self.probe = probe
        self.context = NgramIndex(CONTEXT_NGRAM, 1) if context else None
        self.costs = None
        self.calibrations: dict = {}
        self.set_aside = ""  # why this run goes without the drafter ("": it does not)
        self._reset()

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers the drafter reads, while this run keeps it (a run without it taps nothing)."""
        return self.drafter.hidden_layers if self.live[DRAFTER] else ()

    def _reset(self) -> None:
        self.live = list(self.has)  # the sources this run still asks (one that raised is dropped)
        if self.set_aside:
            self.live[DRAFTER] = False
        # this run's rate of agreement of the context's chains with the target, per n-gram length (as pld's): a
        # context node's raw value is alpha^depth -- a run that copies its context agrees far more than the average
        self.context_alpha = {n: AcceptanceEstimate() for n in range(1, CONTEXT_NGRAM + 1)}
        self.gate = DrafterGate(self.probe)  # (its averages: the target's shared ones, from start())
        self.store_back_off = BackOff(BACKOFF_LIMIT)  # the datastore is skipped a while after looks that did not pay
        self.stats_by_source = [SourceStats() for _ in SOURCES]
        self.steps = self.undrafted = 0
        self.pending: tuple | None = None
        self.chain_pending: tuple[int, int] | None = None  # (n-gram length, chain length) of a context chain drafted

    # -- setup -----------------------------------------------------------------------------------------------------
    def new_run(self, target, prompt_ids: list[int], **settings):
        """A run; it goes without the drafter when the drafter did not pay in the target's latest runs (but for
        every ``SET_ASIDE_RUNS + 1``-th run, which probes it again): then it taps no features from the prefill on."""
        self.set_aside = ""
        if self.has[DRAFTER]:
            greedy = settings.get("sampling", SamplingConfig()).greedy
            if not target.shared(("auto drafter averages", greedy), DrafterAverages).keeps_drafter():
                self.set_aside = "it did not pay in the latest runs"
        self._reset()
        return super().new_run(target, prompt_ids, **settings)

    def max_proposal_size(self) -> int:
        return self.max_nodes

    def prepare(self, target) -> None:
        self.costs = cost_model(target)
        if self.drafter is not None:
            self.drafter.prepare(target)

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self._reset()
        if self.costs is None:
            self.prepare(state.target)
        greedy = state.sampling.greedy
        self.calibrations = {
            source: state.target.shared(("auto calibration", name, greedy), ScoreCalibration)
            for source, name in enumerate(SOURCES)}
        self.gate.averages = state.target.shared(("auto drafter averages", greedy), DrafterAverages)
        if self.has[CONTEXT]:
            self.context.reset()
            self.context.sync(state.tokens)
        if self.live[DRAFTER]:
            try:
                self.drafter.start(state, prefill_logits, hidden)
            except Exception as exc:  # noqa: BLE001 -- as in _timed: decode on without it
                self.stats_by_source[DRAFTER].failed = f"{type(exc).__name__}: {exc}"
                self._drop(DRAFTER)

    # -- the sources -----------------------------------------------------------------------------------------------
    def _scored(self, c: Candidates) -> Candidates:
        c.scores = monotone_down_paths(self.calibrations[c.source](c.raw, c.depths, c.key), c.parents, c.depths)
        return c

    def _from_datastore(self, state: DecodeState, depth: int) -> Candidates | None:
        rows, matched = self.store.continuations(state.tokens[-MATCH_WINDOW:].numpy(), self.candidates, depth)
        if rows.shape[0] == 0:
            return None
        trie = _trie(rows, rows.shape[0])
        if trie is None:
            return None
        tokens, parents, depths, raw = trie[:4]
        return Candidates(DATASTORE, tokens, parents, depths, raw, matched)

    def _from_drafter(self, state: DecodeState, depth: int) -> Candidates:
        d = self.drafter
        tok, score, parent, dep = d.expand(state, min(depth, d.depth), d._curve_ms(numpy=True))
        return Candidates(DRAFTER, (tok + d.runner.d2t.numpy()[tok]).astype(np.int64), parent, dep, np.exp(score), 1)

    def _timed(self, source: int, make, state: DecodeState, depth: int) -> tuple[Candidates | None, float]:
        """``make``'s scored candidates (None: nothing to draft) and the milliseconds it took. A source that raises
        drafts nothing from then on in this run (what it raised is in the stats): it never changes the output, as no
        draft does."""
        t0 = time.perf_counter()
        stats = self.stats_by_source[source]
        try:
            c = make(state, depth)
            if c is not None:
                c = self._scored(c)
        except Exception as exc:  # noqa: BLE001 -- any source failure: decode on without it
            stats.failed = f"{type(exc).__name__}: {exc}"
            self._drop(source)
            c = None
        ms = (time.perf_counter() - t0) * 1e3
        stats.asked += 1
        stats.ms += ms
        return c, ms

    def _drop(self, source: int) -> None:
        self.live[source] = False
        if source == DRAFTER:
            self.drafter.pending.clear()  # the forwards' features it kept for its catch-up

    def _set_drafter_aside(self, why: str) -> None:
        """Go on without the drafter for the rest of the run: no more features tapped, no catch-up."""
        self.set_aside = why
        self._drop(DRAFTER)

    def _context_match(self, state: DecodeState, depth: int) -> tuple[torch.Tensor, int] | None:
        """The continuation of the latest earlier occurrence of the context's last n-gram (at most ``depth``
        tokens) and that n; None without a match."""
        self.context.sync(state.tokens)
        chain, n = self.context.match(state.tokens, depth)
        return (chain, n) if n else None

    def _context_chain(self, state: DecodeState, depth: int) -> Proposal | None:
        """The fast path, first every step: the context's continuation (as ``pld``), cut to the length that pays on
        the live cost curve for this run's agreement rate of that n-gram length; None when there is none or none
        pays (then the datastore and the drafter are asked)."""
        t0 = time.perf_counter()
        stats = self.stats_by_source[CONTEXT]
        stats.asked += 1
        try:
            found = self._context_match(state, depth)
            chain, n = found if found is not None else (None, 0)
            k = best_chain_length(self.context_alpha[n].alpha, chain.numel(), self.costs,
                                  others=state.sequences_in_step - 1) if n else 0
        except Exception as exc:  # noqa: BLE001 -- as in _timed: decode on without it
            stats.failed = f"{type(exc).__name__}: {exc}"
            self._drop(CONTEXT)
            k = 0
        stats.ms += (time.perf_counter() - t0) * 1e3
        if k <= 0:
            return None
        self.chain_pending = (n, k)
        tokens = torch.cat([state.ids[state.length - 1 : state.length], chain[:k]])
        return Proposal(DraftTree(tokens, chain_shape(tokens.numel())))

    # -- a step ----------------------------------------------------------------------------------------------------
    def propose(self, state: DecodeState) -> Proposal | None:
        self.pending = self.chain_pending = None
        self.steps += 1
        if self.live[DRAFTER] and state.sequences_in_step > 1:  # its pass would delay every sequence of the step
            self._set_drafter_aside("a forward shared with other sequences")
        for estimate in self.context_alpha.values():
            estimate.tick()
        depth = min(self.max_depth, state.remaining - 1)
        if state.max_draft_depth is not None:
            depth = min(depth, state.max_draft_depth)
        if depth <= 0:
            self.undrafted += 1
            return None
        limit = min(self.max_nodes, state.remaining + 1)
        if self.live[CONTEXT]:
            chain = self._context_chain(state, min(depth, limit - 1))
            if chain is not None:
                return chain
        if state.sequences_in_step > 1:  # sharing a forward: only a likely chain pays for a step of all the sequences
            self.undrafted += 1
            return None
        curve_ms = self.costs.table(self.max_nodes, numpy=True)
        parts = []
        looked = self.live[DATASTORE] and not self.store_back_off.skipping()
        if looked:
            self.store_back_off.looking()
            c, _ = self._timed(DATASTORE, self._from_datastore, state, depth)
            if c is not None:
                parts.append(c)
        cheap = merge(parts, self.vocab_size) if parts else None
        cheap_choice = choose(cheap, curve_ms, limit) if cheap is not None else Choice(
            np.zeros(0, dtype=np.int64), 1.0, float(curve_ms[0]))
        cheap_drafts = cheap_choice.nodes.size > 0
        if looked:
            if cheap_drafts:
                self.store_back_off.drafted(cheap_choice.nodes.size + 1)
            else:
                self.store_back_off.drafted_nothing()
        tree, choice, drafter_ms = cheap, cheap_choice, None
        if self.live[DRAFTER] and self.gate.ask(cheap_drafts, cheap_choice.rate):
            c, drafter_ms = self._timed(DRAFTER, self._from_drafter, state, depth)
            if c is not None:
                parts.append(c)
                tree = merge(parts, self.vocab_size)
                choice = choose(tree, curve_ms, limit)
            else:
                drafter_ms = None
        self.pending = (parts, tree, choice, cheap, cheap_choice, cheap_drafts, drafter_ms)
        if choice.nodes.size == 0:
            self.undrafted += 1
            return None
        return Proposal(build_tree(choice.nodes, tree.tokens, tree.parents, tree.depths, state.root))

    def observe(self, state: DecodeState, step: StepResult) -> None:
        if self.live[CONTEXT]:
            self.context.sync(state.tokens)
        if self.live[DRAFTER]:
            try:
                self.drafter.observe(state, step)  # its accepted rows wait for its next pass
            except Exception as exc:  # noqa: BLE001 -- as in _timed: decode on without it
                self.stats_by_source[DRAFTER].failed = f"{type(exc).__name__}: {exc}"
                self._drop(DRAFTER)
        if self.chain_pending is not None:  # the context's chain: its agreement rate, as pld's
            n, k = self.chain_pending
            self.chain_pending = None
            k = min(k, len(step.proposal.tree) - 1)  # the engine may have cut it (KV room, a shared forward)
            self.context_alpha[n].update(k, step.verdict.accepted)
            if k > 0:
                self.stats_by_source[CONTEXT].count(range(1, k + 1), min(step.verdict.accepted, k))
            return
        if self.pending is None:
            return
        parts, tree, choice, cheap, cheap_choice, cheap_drafts, drafter_ms = self.pending
        self.pending = None
        target_tokens = np.asarray(step.new_tokens, dtype=np.int64)
        for c in parts:  # every source learns from the target's tokens, whichever drafted
            known, on = on_target_path(c, target_tokens)
            if known.any():
                self.calibrations[c.source].update(c.raw[known], c.depths[known], c.key, on[known])
        # the tree verified: the chosen nodes in tree order (by depth), as far as the engine kept them (KV room, a
        # shared forward's cut)
        nodes = choice.nodes[np.argsort(tree.depths[choice.nodes], kind="stable")][: len(step.proposal.tree) - 1] \
            if choice.nodes.size else choice.nodes
        if nodes.size:
            for source, stats in enumerate(self.stats_by_source):
                mine = nodes[(tree.sources[nodes] >> source) & 1 == 1]
                if mine.size:
                    stats.count(np.unique(tree.depths[mine]).tolist(), accepted_depth(tree, mine, target_tokens))
        cheap_accepted = accepted_depth(cheap, cheap_choice.nodes, target_tokens) if cheap_drafts else 0
        self.store_back_off.verdict(cheap_accepted, self.costs.table(self.max_nodes, numpy=True))
        if drafter_ms is not None:  # what asking the drafter bought over the cheap sources' own tree
            extra_ms = drafter_ms + choice.ms - cheap_choice.ms
            if not self.gate.outcome(cheap_drafts, step.verdict.accepted - cheap_accepted, extra_ms,
                                     cheap_choice.rate):
                self._set_drafter_aside("a probe at the longest wait bought nothing")

    def finish(self, state: DecodeState) -> None:
        if self.learns_across_requests and self.has[DATASTORE]:
            self.store.learn(state.tokens[state.prompt_length :].tolist())

    def stats(self) -> dict:
        steps = max(self.steps, 1)
        return {"sources": {name: s.as_dict(steps)
                            for name, s, has in zip(SOURCES, self.stats_by_source, self.has, strict=True) if has},
                "steps": self.steps, "steps_without_a_draft": self.undrafted,
                "drafter_probes": self.gate.probes,
                **({"drafter_set_aside": self.set_aside} if self.has[DRAFTER] and self.set_aside else {})}


def _drafter_for(target, drafter) -> object | None:
    """The EAGLE-3 proposer that drafts for ``auto`` (its runner shared per target), or None."""
    from .eagle import EagleProposer, drafter_runner

    if drafter == "none":
        return None
    if drafter is None:
        from ..drafters import shipped_drafter

        if shipped_drafter(target, "eagle3") is None:
            return None
        drafter = None
    runner = drafter_runner(target, drafter, "auto")
    return EagleProposer(runner, topk=4, depth=6, nodes=0, max_nodes=32, min_prob=0.05, backoff=0)


def _store_for(target, datastore, learn: bool):
    """The datastore ``auto`` drafts from: the one given, make-data's default output when written, or (``learn``)
    the target's store of learned answers; None without any."""
    if datastore == "none":
        return datastore_for(target, None) if learn else None
    if not datastore:
        default = made_data_dir(target.name)
        if (default / "responses.jsonl").is_file():
            return datastore_for(target, default)
        return datastore_for(target, None) if learn else None
    return datastore_for(target, datastore)


@register(
    "auto",
    "every step the draft that buys the most tokens per millisecond: the context, the datastore, the trained "
    "drafter, or none",
    source="fastforward; sources as pld (Saxena 2023), REST (He et al. 2024), EAGLE-2/3 (Li et al. 2024/2025)",
    options=(
        Option("drafter", "path", None,
               help="a 'fastforward train eagle' drafter folder (default: the EAGLE-3 drafter shipped for the model, "
                    "if any); none: no drafter"),
        Option("datastore", "path", "",
               help="a make-data folder or a JSONL file of records with response_ids or text (default: make-data's "
                    "output for this model, if written); none: no datastore"),
        Option("learn", "bool", False,
               help="each finished generation joins the datastore for the requests after it (a server's answers)"),
        Option("context", "bool", True, help="draft from the context's own n-gram matches (as pld)"),
        Option("max_depth", "int", 10, 1, MAX_DEPTH, bound="drafter calls and datastore reads per step",
               help="the deepest draft"),
        max_nodes_option(24),
        Option("candidates", "int", 64, 1, MAX_CANDIDATES, bound="datastore continuations read per step",
               help="the most datastore continuations read per step"),
        Option("probe", "int", 32, 1, MAX_PROBE, bound="steps between drafter probes",
               help="the longest wait, in steps, before the drafter is asked again when it has not paid; a probe "
                    "at that wait that buys nothing sets it aside for the rest of the run"),
    ),
)
def auto(target, *, drafter: str | None = None, datastore: str = "", learn: bool = False, context: bool = True,
         max_depth: int = 10, max_nodes: int = 24, candidates: int = 64, probe: int = 32) -> AutoProposer:
    """The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`); a drafter folder or
    datastore that does not load is a one-line error."""
    drafter = None if drafter is None else str(drafter)
    datastore = "" if datastore is None else str(datastore)
    return AutoProposer(target, drafter=_drafter_for(target, drafter), store=_store_for(target, datastore, learn),
                        max_depth=max_depth, max_nodes=max_nodes, candidates=candidates, probe=probe,
                        context=context, learn=learn)
