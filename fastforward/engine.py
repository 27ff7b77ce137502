"""The decode loop: one engine, many methods.

A decoding method builds the run of each prompt (:class:`Method`, ``method.new_run(target, prompt_ids, ...)``); every
run speaks the same small protocol (:class:`Run`: ``prefill``, then steps of ``propose`` / a target forward over
``forward_request`` / ``complete`` until ``finished``; ``cancel`` at any time). Two kinds of run exist:

* :class:`SequenceRun`, draft-then-verify, built by every :class:`Proposer`. Each step the proposer proposes a
  :class:`~fastforward.tree.DraftTree` rooted at the last accepted token (plus, optionally, auxiliary tokens it wants
  the target to score without verifying them, as lookahead decoding does). The target scores everything in one
  forward under a tree mask, the verifier keeps the longest acceptable path, the KV cache keeps that path, and the
  proposer observes the outcome.
* :class:`~fastforward.pasta.interpreter.PastaRun`, PASTA's asynchronous threads of one answer.

:func:`decode_steps` drives one run, :class:`BatchDecoder` several at once through shared forwards while admitting
and dropping runs between steps (a server), :func:`decode_batch` a list of runs through a :class:`BatchDecoder`;
:class:`Generation` is one request in flight, from its run to its text and result.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .costs import cost_model, observe_forward
from .draft_budget import DraftBudget, DraftLevels, cut_to_depth, depth_gains, levels_of
from .errors import UsageError
from .model import ForwardOutput, ForwardRequest, TargetModel
from .stats import GenerationStats
from .stopping import StopMatcher, cut_at_stop
from .tree import DraftTree, TreeShape
from .validation import check_max_new_tokens, check_observers, check_stop
from .verify import PositionKeyedUniforms, SamplingConfig, Verdict, next_token, verify


@dataclass
class Proposal:
    """What a proposer asks the target to score in one forward.

    ``tree`` holds the candidates (root first). ``aux_tokens`` are extra tokens scored in the same forward but never
    accepted (lookahead's Jacobi window); ``aux_depths`` give their positions relative to the root, and
    ``aux_mask`` ``[a, len(tree) + a]`` says which tree nodes and aux tokens each aux token attends to.
    ``info`` is what the method tells step observers about this draft (e.g. TR-Jacobi's candidate table, which
    ``build-tree``'s calibration records); the engine never reads it.
    """

    tree: DraftTree
    aux_tokens: torch.Tensor | None = None
    aux_depths: torch.Tensor | None = None
    aux_mask: torch.Tensor | None = None
    info: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.tree) + (0 if self.aux_tokens is None else self.aux_tokens.numel())


@dataclass
class DecodeState:
    """What proposers may read: the token sequence so far and the decoding context."""

    target: TargetModel
    ids: torch.Tensor  # [capacity] all token ids: prompt, then generated; ids[length-1] is the root
    length: int
    prompt_length: int
    sampling: SamplingConfig
    rng: random.Random
    generator: torch.Generator | None
    max_new_tokens: int
    #: in a step shared with other sequences, the deepest draft worth its rows there (None: alone, no limit).
    #: Proposers with a costly drafter skip or shorten their work by it; the engine cuts deeper drafts anyway.
    max_draft_depth: int | None = None
    #: how many sequences share this step's forwards (1: alone). A proposer's own pass (a drafter's) delays every one
    #: of them, so proposers with a costly drafter may skip it when sharing.
    sequences_in_step: int = 1
    #: sampling: the uniform number of each sequence position (see :mod:`fastforward.verify`, "Keyed draws")
    keyed: PositionKeyedUniforms | None = None

    def __post_init__(self):
        # numpy's view of ids (the same memory): reading one id through it costs ~7 us right after a forward
        # streamed the weights, through the tensor ~23 (torch's dispatch)
        self._ids_view = self.ids.numpy()

    @property
    def root(self) -> int:
        return int(self._ids_view[self.length - 1])

    @property
    def root_position(self) -> int:
        return self.length - 1

    @property
    def tokens(self) -> torch.Tensor:
        return self.ids[: self.length]

    @property
    def generated(self) -> int:
        return self.length - self.prompt_length

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated


@dataclass
class StepResult:
    """What a proposer observes after a verification forward."""

    proposal: Proposal
    logits: torch.Tensor  # [size, vocab]: the target's logits for every tree node, then every aux token
    verdict: Verdict
    new_tokens: list[int]  # accepted draft tokens + the bonus token
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class Proposer:
    """Base class of every decoding method; on its own it proposes nothing, which is autoregressive decoding."""

    name = "ar"
    lossless = True
    #: layers whose hidden states the proposer wants from every target forward (see ``TargetModel.forward``)
    hidden_layers: tuple[int, ...] = ()
    #: whether it learns from finished requests for later ones (``finish``): a benchmark refuses such a method, as
    #: its questions' answers (and the warm-up's) would draft for one another
    learns_across_requests = False
    #: whether its drafts carry draft probabilities when sampling (verified by recursive rejection, which draws
    #: from the run's generator: such a draft must not be cut, or a seeded answer would depend on the batch)
    drafts_with_probabilities = False

    def new_run(self, target: TargetModel, prompt_ids: list[int], **settings) -> SequenceRun:
        """The run of one prompt with this method: draft-then-verify (:class:`SequenceRun`; ``settings`` are its
        keyword arguments)."""
        return SequenceRun(target, prompt_ids, self, **settings)

    def max_proposal_size(self) -> int:
        """An upper bound on ``Proposal.size`` (reserved in the KV cache)."""
        return 1

    def prepare(self, target: TargetModel) -> None:
        """Called once per run before its clock starts: one-time work the method needs from the target, such as
        this machine's cost model (:func:`fastforward.costs.cost_model`, measured on first use), which is then
        never counted as drafting time."""

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        """Called once after the prompt is processed and the first token chosen."""

    def propose(self, state: DecodeState) -> Proposal | None:
        """The next proposal; ``None`` means just the root (one autoregressive step)."""
        return None

    def observe(self, state: DecodeState, step: StepResult) -> None:
        """Called after each verification, with the state already advanced by ``step.new_tokens``."""

    def finish(self, state: DecodeState) -> None:
        """Called once when the run ends (finished or cancelled): ``state.tokens`` is the prompt and what was
        emitted. For methods that learn across requests."""

    def stats(self) -> dict:
        """Method-specific statistics for the run report."""
        return {}


class Method(Protocol):
    """A decoding method as the engine sees it: what the registry's factories return
    (:func:`~fastforward.proposers.make_proposer`). It builds the run of each prompt; every :class:`Proposer` is
    one (its run is :class:`SequenceRun`), and a method that is not draft-then-verify brings its own kind of
    :class:`Run` (PASTA's :class:`~fastforward.pasta.interpreter.PastaMethod`)."""

    name: str
    lossless: bool
    #: see :attr:`Proposer.learns_across_requests`
    learns_across_requests: bool

    def new_run(self, target: TargetModel, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingConfig,
                seed: int | None, stops=(), stats: GenerationStats | None = None, on_prefill=None, observers=(),
                prefix_cache=None) -> Run:
        """The run of ``prompt_ids`` (see :class:`Run` for the settings)."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    prompt_ids: list[int]

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


def _fit(proposal: Proposal, room: int) -> Proposal:
    """Shrink a proposal that does not fit the remaining KV room: keep a prefix of tree nodes, drop aux tokens."""
    if proposal.size <= room:
        return proposal
    n = max(1, min(room, len(proposal.tree)))
    tree = proposal.tree
    probs = None if tree.draft_probs is None else tree.draft_probs[:n]
    return Proposal(DraftTree(tree.tokens[:n], TreeShape(tree.shape.parents[:n]), probs), info=proposal.info)


def _full_mask(proposal: Proposal) -> torch.Tensor | None:
    tree = proposal.tree
    if proposal.aux_tokens is None:
        return None if tree.shape.is_chain else tree.shape.ancestor_mask
    n, a = len(tree), proposal.aux_tokens.numel()
    mask = torch.zeros(n + a, n + a, dtype=torch.bool)
    mask[:n, :n] = tree.shape.ancestor_mask
    mask[n:] = proposal.aux_mask
    return mask


PREFILL_CHUNK = 256  # prompt tokens per prefill forward: bounded activations, and progress to report


def read_prompt(target, prompt, cache, hidden_layers, on_prefill=None,
                prefix_cache=None) -> tuple[ForwardOutput, int]:
    """The prompt's KV in chunks of :data:`PREFILL_CHUNK` tokens; returns the last position's logits and every prompt
    token's requested hidden states, and how many prompt positions came from the ``prefix_cache``: the longest kept
    prefix of the prompt is copied in instead of read (bitwise the same entries), and the prompt is kept for later
    ones. ``on_prefill(done, total)`` is called after each chunk."""
    return to_the_end(read_prompt_in_chunks(target, prompt, cache, hidden_layers, on_prefill, prefix_cache))


def read_prompt_in_chunks(target, prompt, cache, hidden_layers, on_prefill=None, prefix_cache=None, chunk=None):
    """:func:`read_prompt` a chunk at a time: a generator that yields ``(positions read, prompt length)`` after each
    chunk's forward and returns what :func:`read_prompt` returns (a server interleaves other work between chunks).
    ``chunk``: a callable asked before each chunk how many tokens it reads (at most :data:`PREFILL_CHUNK`, the
    default): on a backend that computes that many rows exactly as alone (``batch_rows_limit``), the entries are the
    same whatever the chunks."""
    n = prompt.numel()
    hidden: dict[int, list] = {}
    begin = 0
    if prefix_cache is not None:
        entry, begin = prefix_cache.lookup(prompt, hidden_layers, cache.k.dtype)
        if entry is not None:
            prefix_cache.restore(entry, begin, cache)
            for layer in hidden_layers:
                if layer in entry.hidden:  # (a tap index the model does not have is absent in both)
                    hidden[layer] = [entry.hidden[layer][:begin]]
    out = None
    start = begin
    while start < n:
        end = min(n, start + (PREFILL_CHUNK if chunk is None else max(1, min(PREFILL_CHUNK, chunk()))))
        out = target.forward(prompt[start:end], torch.arange(start, end), cache, hidden_layers=hidden_layers,
                             last_only=True)
        cache.keep(range(end - start))
        for layer, h in out.hidden.items():
            hidden.setdefault(layer, []).append(h)
        if on_prefill is not None:
            on_prefill(end, n)
        if end < n:
            yield end, n
        start = end
    if len(hidden) and any(len(parts) > 1 for parts in hidden.values()):
        out = ForwardOutput(out.logits, {layer: torch.cat(parts) for layer, parts in hidden.items()})
    if prefix_cache is not None:
        prefix_cache.store(prompt, cache, out.hidden, hidden_layers)
    return out, begin


def to_the_end(steps: Generator):
    """Run a generator of steps to its end; returns its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


class Run:
    """One sequence being decoded: the protocol the engine drives, and what every run holds.

    The engine calls :meth:`prefill` once (or drives :meth:`prefill_steps`, a chunk of the prompt at a time), then
    steps of three calls until :attr:`finished` -- :meth:`propose` (this step's rows, anything with a ``size``), a
    target forward over :meth:`forward_request` (alone, or together with other runs'), :meth:`complete` (the emitted
    tokens) -- and :meth:`cancel` at any time. In a shared forward a run
    may let its drafts be cut to their worth there (:attr:`draft_negotiable`, :meth:`draft_levels`,
    :meth:`cut_draft`); the defaults here say no. A run's output does not depend on which other runs share its
    forwards: every row of a forward is computed as alone.

    Every run holds the checked prompt and its ids (``ids``: prompt, then generated), what its method may read
    (``state``: the sampling RNG and keyed draws among them), the stop matcher, the tokens it emitted, its finish
    reason (``reason``; empty while running), its statistics and its KV cache (``cache``, freed when it ends).
    Two kinds exist: :class:`SequenceRun` (draft-then-verify) and
    :class:`~fastforward.pasta.interpreter.PastaRun`; a :class:`Method` builds its own (``method.new_run``).
    """

    #: layers whose hidden states the run wants from every target forward (see ``TargetModel.forward``)
    hidden_layers: tuple[int, ...] = ()
    #: prompt tokens its prefill reads in its next chunk (at most PREFILL_CHUNK; a server reading prompts between
    #: decode steps may make it smaller where the backend is row-exact, see :func:`read_prompt_in_chunks`)
    prefill_chunk: int = PREFILL_CHUNK

    def __init__(self, target: TargetModel, prompt_ids: list[int], name: str, *, max_new_tokens: int,
                 sampling: SamplingConfig, seed: int | None, stops=(), stats: GenerationStats | None = None,
                 on_prefill=None, observers=(), prefix_cache=None):
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise UsageError("the prompt is empty")
        if n_prompt >= target.max_context:
            raise UsageError(f"the prompt has {n_prompt} tokens; the model's context is {target.max_context}")
        self.target, self.sampling = target, sampling
        self.max_new_tokens, self.stops, self.on_prefill = max_new_tokens, tuple(stops), on_prefill
        self.observers = check_observers(observers)
        self.prefix_cache = prefix_cache  # a model.prefix_cache.PrefixCache shared by runs of the same target
        self.stats = stats if stats is not None else GenerationStats(name)
        self.stats.prompt_tokens = n_prompt
        self.prompt_ids = list(prompt_ids)
        # [prompt + generated + 1]; never more than the context holds, whatever max_new_tokens says
        self.ids = torch.zeros(min(n_prompt + max_new_tokens, target.max_context) + 1, dtype=torch.long)
        self.ids[:n_prompt] = torch.as_tensor(prompt_ids, dtype=torch.long)
        self._ids_view = self.ids.numpy()  # the same memory, written per step without building a tensor
        generator = keyed = None
        if not sampling.greedy:
            seed_value = seed if seed is not None else random.randrange(2**63)
            generator = torch.Generator().manual_seed(seed_value)
            keyed = PositionKeyedUniforms(seed_value)
        self.state = DecodeState(target, self.ids, n_prompt, n_prompt, sampling, random.Random(seed), generator,
                                 max_new_tokens, keyed=keyed)
        self.eos = target.eos_token_ids
        self.emitted: list[int] = []
        self.reason = ""
        self.cache = None
        # stop strings: looked for in a tail of the text, decoded a few tokens at a time (None: no stop strings)
        self.stop_matcher = StopMatcher(target.decode, self.stops) if self.stops else None
        self._t_start = 0.0

    @property
    def finished(self) -> bool:
        return bool(self.reason)

    # -- the protocol ----------------------------------------------------------------------------------------------
    def prefill(self) -> list[int]:
        """Read the prompt into a fresh KV cache and choose the first token(s); returns the emitted tokens."""
        return to_the_end(self.prefill_steps())

    def prefill_steps(self) -> Generator[tuple[int, int], None, list[int]]:
        """:meth:`prefill` as a generator: yields ``(positions read, prompt length)`` between the prompt's chunks
        and returns the emitted tokens. Nothing it computes depends on what runs between two chunks."""
        raise NotImplementedError

    def propose(self):
        """This step's rows (anything with a ``size``: the rows it puts in the forward)."""
        raise NotImplementedError

    def forward_request(self) -> ForwardRequest:
        """The target forward this step needs."""
        raise NotImplementedError

    def complete(self, out: ForwardOutput, forward_seconds: float) -> list[int]:
        """Take this step's logits; returns the emitted tokens."""
        raise NotImplementedError

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop here (a cancelled request; a server's budget spent): finish reason ``reason`` unless already
        finished; frees the cache."""
        if not self.finished:
            self.reason = reason
            self._finish()

    @property
    def draft_negotiable(self) -> bool:
        """Whether a shared step may shorten this run's drafts without changing its answer."""
        return False

    def draft_levels(self) -> DraftLevels | None:
        """This step's draft level by level, or None when it may not be cut."""
        return None

    def cut_draft(self, depth: int) -> int:
        """Keep this step's draft no deeper than ``depth``; returns the size of what this step forwards."""
        raise NotImplementedError

    # -- for the kinds of run --------------------------------------------------------------------------------------
    def _read_prompt(self, capacity: int, hidden_layers=()) -> Generator[tuple[int, int], None, ForwardOutput]:
        """Start the clock, make a KV cache of ``capacity`` positions and read the prompt into it
        (:func:`read_prompt_in_chunks`, whose steps it passes on); the prefill's statistics are kept (its time is
        the chunks' own, not what ran between them)."""
        target, stats, n_prompt = self.target, self.stats, self.state.prompt_length
        self._t_start = t0 = time.perf_counter()
        self.cache = target.new_cache(capacity)
        chunks = read_prompt_in_chunks(target, self.ids[:n_prompt], self.cache, hidden_layers, self.on_prefill,
                                       self.prefix_cache, lambda: self.prefill_chunk)
        stats.prefill_time = 0.0
        while True:
            try:
                progress = next(chunks)
            except StopIteration as end:
                out, stats.cached_prompt_tokens = end.value
                break
            stats.prefill_time += time.perf_counter() - t0
            yield progress
            t0 = time.perf_counter()
        stats.target_forwards = 1
        stats.prefill_time += time.perf_counter() - t0
        return out

    def _finish(self) -> None:
        self.stats.finish_reason = self.reason
        self.stats.wall_time = time.perf_counter() - self._t_start if self._t_start else 0.0
        self.cache = None  # free the KV memory as soon as the run ends


class SequenceRun(Run):
    """Draft-then-verify: one sequence decoded by a :class:`Proposer`.

    :meth:`propose` is the proposer's draft, fitted to the cache; :meth:`complete` verifies it against the target's
    logits, keeps the accepted path in the cache, emits, and lets the proposer observe.
    """

    def __init__(self, target: TargetModel, prompt_ids: list[int], proposer: Proposer, **settings):
        super().__init__(target, prompt_ids, proposer.name, **settings)
        self.proposer = proposer
        self._proposal: Proposal | None = None
        proposer.prepare(target)  # before any clock: a first measurement of the cost curve is not drafting time

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.proposer.hidden_layers

    # -- emitting ----------------------------------------------------------------------------------------------
    def _emit(self, tokens: list[int]) -> list[int]:
        """Append tokens, truncated exactly where one-token-at-a-time decoding would have stopped (EOS, the token
        budget, a stop string, the context limit); set the finish reason; return what was taken."""
        state, target = self.state, self.target
        taken = []
        reason = ""
        for t in tokens:
            taken.append(t)
            if t in self.eos:
                reason = "eos"
                break
            if len(self.emitted) + len(taken) >= self.max_new_tokens:
                reason = "length"
                break
            if state.length + len(taken) + 1 >= target.max_context:
                break  # "context", unless a stop string ends here too (checked first, as AR would)
        if self.stop_matcher is not None:
            # the first token that completes a stop string ends the run (AR would have stopped there)
            first = self.stop_matcher.feed(taken)
            if first is not None and (first < len(taken) or not reason):
                taken = taken[:first]
                reason = "stop"
        self.emitted.extend(taken)
        self._ids_view[state.length : state.length + len(taken)] = taken  # numpy's view of self.ids: no tensor
        state.length += len(taken)
        if not reason and state.length + 1 >= target.max_context:
            reason = "context"
        self.reason = reason
        self.stats.new_tokens = len(self.emitted)
        return taken

    def _finish(self) -> None:
        super()._finish()
        self.stats.method_stats = self.proposer.stats()
        self.proposer.finish(self.state)  # after the timing: what a method learns for later requests is not this one's

    # -- the three steps -----------------------------------------------------------------------------------------
    def prefill_steps(self) -> Generator[tuple[int, int], None, list[int]]:
        """Read the prompt into a fresh KV cache (a chunk per step) and choose the first token; returns the emitted
        token(s)."""
        target, stats, n_prompt = self.target, self.stats, self.state.prompt_length
        capacity = min(target.max_context, n_prompt + self.max_new_tokens + self.proposer.max_proposal_size() + 1)
        out = yield from self._read_prompt(capacity, self.proposer.hidden_layers)
        first = next_token(out.logits[-1], self.sampling, self.state.generator, self.state.keyed, n_prompt)
        taken = self._emit([first])
        stats.accept_lengths.append(len(taken))
        t0 = time.perf_counter()
        self.proposer.start(self.state, out.logits, out.hidden)
        stats.draft_time += time.perf_counter() - t0
        if self.finished:
            self._finish()
        return taken

    def propose(self) -> Proposal:
        """The proposer's draft for this step (just the root when it has none), fitted to the KV room."""
        t0 = time.perf_counter()
        state = self.state
        proposal = self.proposer.propose(state)
        if proposal is None:
            proposal = Proposal(DraftTree.single(state.root))
        elif proposal.tree.tokens.tolist()[0] != state.root:  # tolist: a few us; a tensor's item: ~25 right now
            raise RuntimeError(f"proposer '{self.proposer.name}' proposed a tree whose root is not the last token")
        room = min(self.cache.capacity - self.cache.length, self.target.max_context - state.root_position)
        self._proposal = _fit(proposal, room)
        self.stats.draft_time += time.perf_counter() - t0
        return self._proposal

    @property
    def draft_negotiable(self) -> bool:
        """Whether a shared step may shorten this run's drafts without changing its answer: greedy runs, and
        sampled ones whose drafts are guesses (keyed draws: the same samples whatever was drafted)."""
        return self.sampling.greedy or not self.proposer.drafts_with_probabilities

    def draft_levels(self) -> DraftLevels | None:
        """This step's draft level by level (rows, expected tokens from this run's acceptance history), or None
        when it may not be cut (see :attr:`draft_negotiable`) or there is nothing to cut."""
        proposal = self._proposal
        if not self.draft_negotiable or proposal is None or proposal.size == 1 or \
                proposal.tree.draft_probs is not None:
            return None
        depth = proposal.tree.shape.max_depth
        gains = depth_gains(self.stats.depth_attempts, self.stats.depth_accepts, depth)
        aux = 0 if proposal.aux_tokens is None else proposal.aux_tokens.numel()
        return levels_of(proposal.tree, aux, gains)

    def cut_draft(self, depth: int) -> int:
        """Keep this step's draft nodes no deeper than ``depth`` (aux tokens only when every level stays); returns
        the proposal's size."""
        proposal = self._proposal
        if depth < max(proposal.tree.shape.max_depth, int(proposal.aux_tokens is not None)):
            self._proposal = proposal = Proposal(cut_to_depth(proposal.tree, depth), info=proposal.info)
        return proposal.size

    def forward_request(self) -> ForwardRequest:
        """The target forward this step needs: the proposal's tokens at their positions, under its tree mask."""
        proposal = self._proposal
        tree = proposal.tree
        depths, tokens = tree.shape.depths, tree.tokens
        if proposal.aux_tokens is not None:
            depths = torch.cat([depths, proposal.aux_depths])
            tokens = torch.cat([tokens, proposal.aux_tokens])
        return ForwardRequest(tokens, depths + self.state.root_position, self.cache, _full_mask(proposal))

    def complete(self, out: ForwardOutput, forward_seconds: float) -> list[int]:
        """Verify the proposal against the target's logits, keep the accepted path, emit, let the proposer
        observe; returns the emitted tokens."""
        t0 = time.perf_counter()
        stats, proposal, tree = self.stats, self._proposal, self._proposal.tree
        verdict = verify(tree, out.logits, self.sampling, self.state.generator, self.state.keyed,
                         self.state.root_position)
        self.cache.keep(verdict.path)
        t1 = time.perf_counter()
        stats.verify_time += forward_seconds + (t1 - t0)
        path = verdict.path
        if len(path) == 1:
            new = [verdict.bonus]
        else:
            drafted = tree.tokens.tolist()
            new = [drafted[i] for i in path[1:]] + [verdict.bonus]
        max_depth = tree.shape.max_depth
        if len(stats.depth_attempts) < max_depth:
            grow = max_depth - len(stats.depth_attempts)
            stats.depth_attempts += [0] * grow
            stats.depth_accepts += [0] * grow
        for d in range(max_depth):
            stats.depth_attempts[d] += 1
            stats.depth_accepts[d] += int(verdict.accepted > d)
        stats.target_forwards += 1
        stats.proposal_tokens += proposal.size
        step = StepResult(proposal, out.logits, verdict, new, dict(out.hidden))
        taken = self._emit(new)
        stats.accept_lengths.append(len(taken))
        for observer in self.observers:
            observer(self.state, step)
        if not self.finished:
            self.proposer.observe(self.state, step)
        stats.draft_time += time.perf_counter() - t1
        stats.wall_time = time.perf_counter() - self._t_start
        self._proposal = None
        if self.finished:
            self._finish()
        return taken


def decode_steps(
    target: TargetModel,
    prompt_ids: list[int],
    proposer: Method,
    *,
    max_new_tokens: int = 256,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | None = None,
    stop: list[str] | str | None = None,
    stats: GenerationStats | None = None,
    on_prefill=None,
    observers=(),
) -> Iterator[list[int]]:
    """Run the decode loop, yielding the list of newly emitted token ids after every target forward.

    Statistics accumulate in ``stats`` (pass your own to read them while or after iterating). Bad arguments raise
    here, before the first step, not when iteration starts.
    """
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    run = proposer.new_run(target, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                           stops=check_stop(stop), stats=stats, on_prefill=on_prefill, observers=observers)
    return run_steps(run)


#: the clock that times verification forwards (a test may put a deterministic one in its place)
forward_clock = time.perf_counter


def timed_forward(target: TargetModel, requests: list[ForwardRequest], hidden_layers) -> tuple[list, float]:
    """One verification forward over ``requests``: (outputs, seconds). Its time and rows go to the target's cost
    model (:func:`fastforward.costs.observe_forward`), which the methods size their drafts from."""
    t0 = forward_clock()
    outs = target.forward_many(requests, hidden_layers)
    seconds = forward_clock() - t0
    observe_forward(target, sum(r.size for r in requests), seconds)
    return outs, seconds


def run_steps(run: Run) -> Iterator[list[int]]:
    """Drive ``run`` alone to its end, yielding what each of its forwards emitted (the prefill's first)."""
    yield run.prefill()
    while not run.finished:
        run.propose()
        outs, seconds = timed_forward(run.target, [run.forward_request()], run.hidden_layers)
        yield run.complete(outs[0], seconds)


def decode_batch(runs: list[Run], max_batch_tokens: int, max_active: int | None = None,
                 cut_drafts: bool = True) -> Iterator[tuple[int, list[int]]]:
    """Decode several sequences together, yielding ``(index of the run, its newly emitted tokens)`` as they come.

    At most ``max_active`` runs decode at once (all when None); the others wait in order and start (prefill) as
    soon as one finishes -- continuous batching, through a :class:`BatchDecoder` (which says how the runs share
    their forwards). Each run completes exactly as alone.
    """
    batch = BatchDecoder(max_batch_tokens, cut_drafts=cut_drafts)
    index = {id(run): i for i, run in enumerate(runs)}
    waiting = deque(range(len(runs)))
    while waiting or len(batch):
        while waiting and (max_active is None or len(batch) < max_active):
            i = waiting.popleft()
            yield i, batch.add(runs[i])
        for run, tokens in batch.steps():
            yield index[id(run)], tokens


def draft_budget_for(target: TargetModel, max_batch_tokens: int) -> DraftBudget | None:
    """The draft pricing of shared forwards on this machine (None where a forward carries one sequence)."""
    if max_batch_tokens < 2 or target.batch_rows_limit() < 2:
        return None
    return DraftBudget(cost_model(target), max_batch_tokens)  # live: reads the forwards' timings as they come


PLANNED_DEPTH = 8  # the deepest draft a shared step plans for before the proposals are known


def _announce_draft_depths(runs: list[Run], budget: DraftBudget | None, caps: list[int | None] | None) -> None:
    """Before proposing: tell each run how deep a one-node-per-level draft of its could be worth going in
    this shared step (from its acceptance history; at most ``caps[i] - 1`` deep where its rows are capped), so that
    drafters with a cost of their own can skip work."""
    plans, who = [], []
    for i, run in enumerate(runs):
        run.state.max_draft_depth = None
        if run.draft_negotiable:
            if caps is not None and caps[i] is not None:
                run.state.max_draft_depth = max(0, caps[i] - 1)
            if budget is not None:
                stats = run.stats
                plans.append(DraftLevels([1] * PLANNED_DEPTH,
                                         depth_gains(stats.depth_attempts, stats.depth_accepts, PLANNED_DEPTH)))
                who.append(run)
    if not who:
        return
    for run, depth in zip(who, budget.choose(len(runs), float(len(runs)), plans), strict=True):
        cap = run.state.max_draft_depth
        run.state.max_draft_depth = depth if cap is None else min(depth, cap)


def _cap_rows(runs: list[Run], sizes: list[int], caps: list[int | None]) -> list[int]:
    """Cut each run's draft to at most ``caps[i]`` rows (whole depth levels; the root always stays) where it may be
    cut; returns the proposals' sizes after the cut (a draft that may not be cut keeps its size)."""
    sizes = list(sizes)
    for i, (run, cap) in enumerate(zip(runs, caps, strict=True)):
        if cap is None or sizes[i] <= cap:
            continue
        levels = run.draft_levels()
        if levels is None:
            continue
        depth, rows = 0, 1
        while depth < len(levels.rows) and rows + levels.rows[depth] <= cap:
            rows += levels.rows[depth]
            depth += 1
        sizes[i] = run.cut_draft(depth)
    return sizes


def _cut_drafts(runs: list[Run], sizes: list[int], budget: DraftBudget) -> list[int]:
    """Cut the runs' drafts to the depths that maximise the shared step's expected tokens per ms; returns
    the proposals' sizes after the cut."""
    fixed_rows, fixed_tokens = 0, float(len(runs))  # every run gains its root's next token
    cuttable, levels = [], []
    for i, run in enumerate(runs):
        lv = run.draft_levels()
        if lv is None:
            fixed_rows += sizes[i]
        else:
            fixed_rows += 1
            cuttable.append(i)
            levels.append(lv)
    if not cuttable:
        return sizes
    sizes = list(sizes)
    for i, depth in zip(cuttable, budget.choose(fixed_rows, fixed_tokens, levels), strict=True):
        sizes[i] = runs[i].cut_draft(depth)
    return sizes


def shared_step(runs: list[Run], max_batch_tokens: int, on_forward=None, budget: DraftBudget | None = None,
                row_caps: list[int | None] | None = None) -> Iterator[tuple[int, list[int]]]:
    """One verification step of every run in ``runs`` (none finished), through shared forwards: yields
    ``(index in runs, newly emitted tokens)``. With a ``budget`` and more than one run, drafts are first cut
    to their worth in the shared forward; with ``row_caps`` (one per run, None: no cap; a run stepping alone is
    capped too, when the others it shares the machine with sit this step out), each
    draft that may be cut is then cut to at most its cap of rows (a share of the forward: the output is the same),
    and a proposal still over its cap (drafts with draft probabilities) gets a forward of its own, after the others'.
    Proposals are packed in order into forwards of at most ``max_batch_tokens`` rows (a larger one gets a forward
    of its own). ``on_forward(sequences, rows, seconds)`` is called after every forward."""
    shared = budget is not None and len(runs) > 1
    if row_caps is not None and len(row_caps) != len(runs):
        raise UsageError(f"row_caps has {len(row_caps)} entries for {len(runs)} runs")
    for run in runs:
        run.state.sequences_in_step = len(runs)
    if shared or row_caps is not None:
        _announce_draft_depths(runs, budget if shared else None, row_caps)
    else:
        for run in runs:
            run.state.max_draft_depth = None
    sizes = [run.propose().size for run in runs]
    if shared:
        sizes = _cut_drafts(runs, sizes, budget)
    own = set()
    if row_caps is not None:
        sizes = _cap_rows(runs, sizes, row_caps)
        own = {i for i, cap in enumerate(row_caps) if cap is not None and sizes[i] > cap}
    groups: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if i in own:
            continue
        if groups and used + size <= max_batch_tokens:
            groups[-1].append(i)
            used += size
        else:
            groups.append([i])
            used = size
    groups += [[i] for i in sorted(own)]
    for group in groups:
        hidden_layers = sorted(set().union(*(runs[i].hidden_layers for i in group)))
        target = runs[group[0]].target
        outs, seconds = timed_forward(target, [runs[i].forward_request() for i in group], hidden_layers)
        if on_forward is not None:
            on_forward(len(group), sum(sizes[i] for i in group), seconds)
        for i, out in zip(group, outs, strict=True):
            yield i, runs[i].complete(out, seconds)


class BatchDecoder:
    """Sequences decoded together and admitted continuously: :meth:`add` prefills a run, which then joins the next
    :meth:`step`; :meth:`step` advances every active run by one verification step through shared forwards of at
    most ``max_batch_tokens`` rows and drops the runs that finished; :meth:`remove` drops a run at any time between
    steps (a cancelled request).

    Each step every active run proposes what it would alone; with ``cut_drafts`` the runs' drafts are then cut to
    what they are worth in the shared forward (:mod:`fastforward.draft_budget`; the output is the same, only the
    speed changes); the proposals are packed in order into forwards of at most ``max_batch_tokens`` rows (a proposal
    larger than that gets a forward of its own); each forward carries every packed sequence's root and draft nodes
    (a sequence sees only its own cache and nodes), and each run completes from its slice of the logits. Each run's
    output is what it gives alone, whatever joins or leaves around it."""

    def __init__(self, max_batch_tokens: int, on_forward=None, cut_drafts: bool = True):
        if not isinstance(max_batch_tokens, int) or isinstance(max_batch_tokens, bool) or max_batch_tokens <= 0:
            raise UsageError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
        self.max_batch_tokens = max_batch_tokens
        self.on_forward = on_forward
        self.cut_drafts = cut_drafts
        self.budget: DraftBudget | None = None
        self.runs: list[Run] = []

    def __len__(self) -> int:
        return len(self.runs)

    def add(self, run: Run) -> list[int]:
        """Prefill ``run`` (its first token is returned) and let it join the next step unless it already ended."""
        return to_the_end(self.add_in_chunks(run))

    def add_in_chunks(self, run: Run) -> Generator[tuple[int, int], None, list[int]]:
        """:meth:`add` as a generator of the prompt's chunks (:meth:`Run.prefill_steps`): steps of the runs
        already in may go on between two chunks; the run joins once its prompt is read."""
        taken = yield from run.prefill_steps()
        if not run.finished:
            self.runs.append(run)
        return taken

    def remove(self, run: Run, reason: str = "cancelled") -> None:
        """Drop ``run`` (finished or not); an unfinished run ends with ``reason`` and its KV memory is freed."""
        if run in self.runs:
            self.runs.remove(run)
        run.cancel(reason)

    def steps(self, runs: list[Run] | None = None,
              row_caps: list[int | None] | None = None) -> Iterator[tuple[Run, list[int]]]:
        """One step of every active run (or of ``runs``, some of them), yielding ``(run, newly emitted tokens)`` as
        each forward completes; once it is exhausted, finished runs have left. ``row_caps``: the most rows each of
        ``runs`` may put in the shared forward (see :func:`shared_step`)."""
        runs = list(self.runs if runs is None else runs)
        if not runs:
            return
        if self.cut_drafts and self.budget is None and len(runs) > 1:
            self.budget = draft_budget_for(runs[0].target, self.max_batch_tokens)
        for i, tokens in shared_step(runs, self.max_batch_tokens, self.on_forward, self.budget, row_caps):
            yield runs[i], tokens
        self.runs = [run for run in self.runs if not run.finished]

    def step(self, runs: list[Run] | None = None,
             row_caps: list[int | None] | None = None) -> list[tuple[Run, list[int]]]:
        """One step of every active run (or of ``runs``, some of them): ``[(run, newly emitted tokens), ...]``;
        finished runs leave."""
        return list(self.steps(runs, row_caps))


class Generation:
    """One request in flight, from its run to its text: the request (a
    :class:`~fastforward.request.GenerationRequest`, when it was built from one: ``request.start(target)``), the
    run its method built (``sequence``), the text streamer (a :class:`~fastforward.stopping.StopMatcher`: the run's
    own when there are stop strings), the token ids so far and, once done, the :class:`GenerationResult`.

    Alone, iterate it for text deltas (``stream``) or :meth:`run` it to the end (``generate``). Driven with others
    (a batch, the server), hand it each step's tokens (:meth:`add`), ask for the text that may be shown
    (:meth:`visible_delta`, :meth:`final_delta`) and, once its run has ended, :meth:`finish` it. Arguments are
    checked here, before any model work."""

    def __init__(self, target: TargetModel, prompt_ids, proposer: Method, stop=None, *, max_new_tokens: int = 256,
                 sampling: SamplingConfig = SamplingConfig(), seed: int | None = None, on_prefill=None,
                 observers=(), prefix_cache=None, request=None):
        self.target = target
        self.request = request
        self.prompt_ids = list(prompt_ids)
        self.stats = GenerationStats(proposer.name)
        self.stop = check_stop(stop)
        self.sequence = proposer.new_run(target, self.prompt_ids, max_new_tokens=check_max_new_tokens(max_new_tokens),
                                         sampling=sampling, seed=seed, stops=self.stop, stats=self.stats,
                                         on_prefill=on_prefill, observers=observers, prefix_cache=prefix_cache)
        self._steps = run_steps(self.sequence)
        self.token_ids: list[int] = []
        self.result: GenerationResult | None = None
        # the text: the run's own matcher (fed in its steps) when there are stop strings; else ours, fed here
        self.text = self.sequence.stop_matcher
        self._own_text = self.text is None
        if self._own_text:
            self.text = StopMatcher(target.decode)
        self._fed = 0  # token ids fed to our own matcher
        self._streamed = False  # whether the text was asked for while running

    @staticmethod
    def final_text(target: TargetModel, token_ids: list[int], stops) -> str:
        """The text of ``token_ids``, cut before the first stop string."""
        text = target.decode(token_ids)
        cut = cut_at_stop(text, stops)
        return text if cut is None else text[:cut]

    # -- driven step by step ---------------------------------------------------------------------------------------
    def add(self, tokens: list[int]) -> None:
        """The tokens one step of the run emitted."""
        self.token_ids.extend(tokens)

    def _catch_up(self) -> None:
        self._streamed = True
        if self._own_text and self._fed < len(self.token_ids):
            self.text.feed(self.token_ids[self._fed :])
            self._fed = len(self.token_ids)

    def visible_delta(self) -> str:
        """The text that may be shown now and was not yet (held back: an incomplete character, a possible stop
        string's start)."""
        self._catch_up()
        return self.text.visible_delta()

    def final_delta(self) -> str:
        """Once the run has ended: the text not shown yet."""
        self._catch_up()
        return self.text.final_delta()

    def finish(self) -> GenerationResult:
        """The result, once the run has ended: the text (cut before the first stop string), the token ids, the
        statistics."""
        text = self.text.text() if self._streamed else self._text()
        self.result = GenerationResult(text, self.token_ids, self.stats, self.prompt_ids)
        return self.result

    def _text(self) -> str:
        return self.final_text(self.target, self.token_ids, self.stop)

    # -- alone -------------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        for tokens in self._steps:
            self.add(tokens)
            delta = self.visible_delta()
            if delta:
                yield delta
        delta = self.final_delta()
        if delta:
            yield delta
        self.finish()

    def partial_result(self, reason: str = "interrupted") -> GenerationResult:
        """What was produced so far, as a result (after an interruption); ``finish_reason`` is ``reason``."""
        if not self.stats.finish_reason:
            self.stats.finish_reason = reason
        self.result = GenerationResult(self._text(), list(self.token_ids), self.stats, self.prompt_ids)
        return self.result

    def run(self) -> GenerationResult:
        for tokens in self._steps:
            self.add(tokens)
        return self.finish()
