"""The decode loop: one engine, many proposers.

Each step a :class:`Proposer` proposes a :class:`~fastforward.tree.DraftTree` rooted at the last accepted token
(plus, optionally, auxiliary tokens it wants the target to score without verifying them, as lookahead decoding
does). The target scores everything in one forward under a tree mask, the verifier keeps the longest acceptable
path, the KV cache keeps that path, and the proposer observes the outcome.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from .errors import UsageError
from .model import ForwardOutput, TargetModel
from .tree import DraftTree
from .verify import SamplingConfig, Verdict, next_token, verify


@dataclass
class Proposal:
    """What a proposer asks the target to score in one forward.

    ``tree`` holds the candidates (root first). ``aux_tokens`` are extra tokens scored in the same forward but never
    accepted (lookahead's Jacobi window); ``aux_depths`` give their positions relative to the root, and
    ``aux_mask`` ``[a, len(tree) + a]`` says which tree nodes and aux tokens each aux token attends to.
    """

    tree: DraftTree
    aux_tokens: torch.Tensor | None = None
    aux_depths: torch.Tensor | None = None
    aux_mask: torch.Tensor | None = None

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

    @property
    def root(self) -> int:
        return int(self.ids[self.length - 1])

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

    def max_proposal_size(self) -> int:
        """An upper bound on ``Proposal.size`` (reserved in the KV cache)."""
        return 1

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        """Called once after the prompt is processed and the first token chosen."""

    def propose(self, state: DecodeState) -> Proposal | None:
        """The next proposal; ``None`` means just the root (one autoregressive step)."""
        return None

    def observe(self, state: DecodeState, step: StepResult) -> None:
        """Called after each verification, with the state already advanced by ``step.new_tokens``."""

    def stats(self) -> dict:
        """Method-specific statistics for the run report."""
        return {}


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # including the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per forward (prefill = 1, AR = 1)
    depth_attempts: list[int] = field(default_factory=list)  # [d-1]: steps whose proposal reached depth d
    depth_accepts: list[int] = field(default_factory=list)  # [d-1]: steps that accepted a token at depth d
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0
    finish_reason: str = ""
    proposal_tokens: int = 0  # tokens scored by decode forwards (tree + aux)
    method_stats: dict = field(default_factory=dict)

    @property
    def decoding_steps(self) -> int:
        return self.target_forwards

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (the bonus token counts; AR = 1.00)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_attempts, strict=True)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, tokens_per_s=self.tokens_per_s, acceptance_by_depth=self.acceptance_by_depth)
        return d

    def summary(self) -> str:
        alpha = " ".join(f"{a:.2f}" for a in self.acceptance_by_depth[:8])
        return (
            f"[{self.method}] {self.new_tokens} tokens in {self.wall_time:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.target_forwards} target forwards, tau {self.tau:.2f}, finish: {self.finish_reason}; "
            f"prefill {self.prefill_time:.2f}s, draft {self.draft_time:.2f}s, verify {self.verify_time:.2f}s"
            + (f"; acceptance by depth {alpha}" if alpha else "")
        )


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    prompt_ids: list[int]

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


def _validate(max_new_tokens, stop) -> list[str]:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise UsageError("stop strings must be non-empty strings")
    return stops


def _fit(proposal: Proposal, room: int) -> Proposal:
    """Shrink a proposal that does not fit the remaining KV room: keep a prefix of tree nodes, drop aux tokens."""
    if proposal.size <= room:
        return proposal
    n = max(1, min(room, len(proposal.tree)))
    tree = proposal.tree
    from .tree import TreeShape

    probs = None if tree.draft_probs is None else tree.draft_probs[:n]
    return Proposal(DraftTree(tree.tokens[:n], TreeShape(tree.shape.parents[:n]), probs))


def _full_mask(proposal: Proposal) -> torch.Tensor | None:
    tree = proposal.tree
    if proposal.aux_tokens is None:
        return None if tree.shape.is_chain else tree.shape.ancestor_mask
    n, a = len(tree), proposal.aux_tokens.numel()
    mask = torch.zeros(n + a, n + a, dtype=torch.bool)
    mask[:n, :n] = tree.shape.ancestor_mask
    mask[n:] = proposal.aux_mask
    return mask


def decode_steps(
    target: TargetModel,
    prompt_ids: list[int],
    proposer: Proposer,
    *,
    max_new_tokens: int = 256,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | None = None,
    stop: list[str] | str | None = None,
    stats: GenerationStats | None = None,
    on_prefill=None,
) -> Iterator[list[int]]:
    """Run the decode loop, yielding the list of newly emitted token ids after every target forward.

    Statistics accumulate in ``stats`` (pass your own to read them while or after iterating). Bad arguments raise
    here, before the first step, not when iteration starts.
    """
    stops = _validate(max_new_tokens, stop)
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise UsageError("the prompt is empty")
    if n_prompt >= target.max_context:
        raise UsageError(f"the prompt has {n_prompt} tokens; the model's context is {target.max_context}")
    return _decode_steps(target, prompt_ids, proposer, max_new_tokens, sampling, seed, stops, stats, on_prefill)


PREFILL_CHUNK = 256  # prompt tokens per prefill forward: bounded activations, and progress to report


def _prefill(target, prompt, cache, hidden_layers, on_prefill=None) -> ForwardOutput:
    """The prompt's KV in chunks of :data:`PREFILL_CHUNK` tokens; the last position's logits and every prompt
    token's requested hidden states. ``on_prefill(done, total)`` is called after each chunk."""
    n = prompt.numel()
    hidden: dict[int, list] = {}
    out = None
    for start in range(0, n, PREFILL_CHUNK):
        end = min(n, start + PREFILL_CHUNK)
        out = target.forward(prompt[start:end], torch.arange(start, end), cache, hidden_layers=hidden_layers,
                             last_only=True)
        cache.keep(range(end - start))
        for layer, h in out.hidden.items():
            hidden.setdefault(layer, []).append(h)
        if on_prefill is not None:
            on_prefill(end, n)
    if len(hidden) and n > PREFILL_CHUNK:
        out = ForwardOutput(out.logits, {layer: torch.cat(parts) for layer, parts in hidden.items()})
    return out


def _decode_steps(target, prompt_ids, proposer, max_new_tokens, sampling, seed, stops, stats, on_prefill=None):
    n_prompt = len(prompt_ids)
    stats = stats if stats is not None else GenerationStats(proposer.name)
    stats.prompt_tokens = n_prompt
    t_start = time.perf_counter()
    capacity = min(target.max_context, n_prompt + max_new_tokens + proposer.max_proposal_size() + 1)
    cache = target.new_cache(capacity)
    ids = torch.zeros(n_prompt + max_new_tokens + 1, dtype=torch.long)
    ids[:n_prompt] = torch.as_tensor(prompt_ids, dtype=torch.long)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**63))
    state = DecodeState(
        target, ids, n_prompt, n_prompt, sampling, random.Random(seed), generator, max_new_tokens
    )
    eos = target.eos_token_ids
    emitted: list[int] = []
    text_len_checked = 0

    def emit(tokens: list[int]) -> tuple[list[int], str]:
        """Append tokens, truncated exactly where one-token-at-a-time decoding would have stopped (EOS, the token
        budget, a stop string, the context limit); return what was taken and a finish reason."""
        nonlocal text_len_checked
        taken = []
        reason = ""
        for t in tokens:
            taken.append(t)
            if t in eos:
                reason = "eos"
                break
            if len(emitted) + len(taken) >= max_new_tokens:
                reason = "length"
                break
            if state.length + len(taken) + 1 >= target.max_context:
                break  # "context", unless a stop string ends here too (checked first, as AR would)
        if stops:
            start = max(0, text_len_checked - max(len(s) for s in stops))

            def hit(toks) -> tuple[bool, str]:
                text = target.decode(emitted + toks)
                return any(s in text[start:] for s in stops), text

            found, text = hit(taken)
            if found:
                # the first token that completes a stop string ends the run (AR would have stopped there)
                first = next((j for j in range(1, len(taken)) if hit(taken[:j])[0]), len(taken))
                if first < len(taken) or not reason:
                    taken = taken[:first]
                    reason = "stop"
            text_len_checked = len(text)
        emitted.extend(taken)
        ids[state.length : state.length + len(taken)] = torch.tensor(taken)
        state.length += len(taken)
        if not reason and state.length + 1 >= target.max_context:
            reason = "context"
        return taken, reason

    # Prefill: the prompt's KV, and the first token from its last position.
    out = _prefill(target, ids[:n_prompt], cache, proposer.hidden_layers, on_prefill)
    first = next_token(out.logits[-1], sampling, generator)
    stats.target_forwards = 1
    stats.prefill_time = time.perf_counter() - t_start
    taken, reason = emit([first])
    stats.accept_lengths.append(len(taken))
    stats.new_tokens = len(emitted)
    t0 = time.perf_counter()
    proposer.start(state, out.logits, out.hidden)
    stats.draft_time += time.perf_counter() - t0
    yield taken

    while not reason:
        t0 = time.perf_counter()
        proposal = proposer.propose(state) or Proposal(DraftTree.single(state.root))
        if int(proposal.tree.tokens[0]) != state.root:
            raise RuntimeError(f"proposer '{proposer.name}' proposed a tree whose root is not the last token")
        proposal = _fit(proposal, min(cache.capacity - cache.length, target.max_context - state.root_position))
        t1 = time.perf_counter()
        tree = proposal.tree
        depths = tree.shape.depths
        tokens = tree.tokens
        if proposal.aux_tokens is not None:
            depths = torch.cat([depths, proposal.aux_depths])
            tokens = torch.cat([tokens, proposal.aux_tokens])
        out = target.forward(
            tokens, depths + state.root_position, cache, _full_mask(proposal), proposer.hidden_layers
        )
        verdict = verify(tree, out.logits, sampling, generator)
        cache.keep(verdict.path)
        t2 = time.perf_counter()
        new = tree.tokens[verdict.path[1:]].tolist() + [verdict.bonus]
        max_depth = tree.shape.max_depth
        if len(stats.depth_attempts) < max_depth:
            grow = max_depth - len(stats.depth_attempts)
            stats.depth_attempts += [0] * grow
            stats.depth_accepts += [0] * grow
        for d in range(max_depth):
            stats.depth_attempts[d] += 1
            stats.depth_accepts[d] += int(verdict.accepted > d)
        taken, reason = emit(new)
        stats.target_forwards += 1
        stats.proposal_tokens += proposal.size
        stats.accept_lengths.append(len(taken))
        stats.new_tokens = len(emitted)
        if not reason:
            hidden = {k: v for k, v in out.hidden.items()}
            proposer.observe(state, StepResult(proposal, out.logits, verdict, new, hidden))
        t3 = time.perf_counter()
        stats.draft_time += (t1 - t0) + (t3 - t2)
        stats.verify_time += t2 - t1
        stats.wall_time = time.perf_counter() - t_start
        yield taken
    stats.finish_reason = reason
    stats.wall_time = time.perf_counter() - t_start
    stats.method_stats = proposer.stats()


class Generation:
    """A streaming generation: iterate for text deltas; ``.result`` holds the full result once done."""

    def __init__(self, target: TargetModel, prompt_ids, proposer: Proposer, stop=None, **kw):
        self.target = target
        self.prompt_ids = list(prompt_ids)
        self.stats = GenerationStats(proposer.name)
        self.stop = _validate(kw.get("max_new_tokens", 256), stop)
        self._steps = decode_steps(target, self.prompt_ids, proposer, stop=stop, stats=self.stats, **kw)
        self.token_ids: list[int] = []
        self.result: GenerationResult | None = None

    def _text(self) -> str:
        text = self.target.decode(self.token_ids)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    def _held_back(self, text: str) -> str:
        """``text`` minus a tail that may be the start of a stop string (shown only once it is known not to be)."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]

    def __iter__(self) -> Iterator[str]:
        shown = ""
        for tokens in self._steps:
            self.token_ids.extend(tokens)
            text = self._text()
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                continue
            text = self._held_back(text)
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown) :]
                shown = text
        text = self._text()
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown) :]
        self.result = GenerationResult(text, self.token_ids, self.stats, self.prompt_ids)

    def run(self) -> GenerationResult:
        for tokens in self._steps:
            self.token_ids.extend(tokens)
        self.result = GenerationResult(self._text(), self.token_ids, self.stats, self.prompt_ids)
        return self.result
