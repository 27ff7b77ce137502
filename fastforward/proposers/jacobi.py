"""Jacobi decoding (Santilli et al. 2023; CLLM, Kou et al. 2024, section 3.1 and Algorithm 3; MSN section 2.1).

Greedy decoding of the next n tokens is the fixed point of ``y_i = argmax p(y | x, y_<i)`` for i = 1..n. Jacobi
decoding starts from a guess for all n tokens and applies that update to every position at once (one target forward
over the window), until nothing changes. With a KV cache (CLLM Algorithm 3) each iteration commits the prefix that
is already fixed -- always at least one token -- keeps the KV of those tokens only, and re-feeds the unconverged
suffix. In this engine that is exactly a chain draft ``[root, guesses...]`` verified by the target: the accepted
guesses plus the bonus token are the newly fixed prefix, and the target's argmax at the positions after it is the
Jacobi update of the remaining guesses. Verification makes the method lossless, greedy and sampled alike (at
temperature > 0 the argmax guesses are just guesses; the verifier samples).

Block semantics (``blocks=True``, the default, as CLLM): the window is an n-token block ``y_1..y_n`` after the root
``y_0``. Each iteration feeds ``[root, guesses for the block positions still unfixed except y_n]`` (``y_n`` is the
argmax after ``y_{n-1}``, so it arrives as the bonus token of the iteration that fixes ``y_{n-1}``). The block
shrinks as it converges; a new block (fresh initial guesses) starts only when all n tokens are fixed.
``blocks=False`` is the sliding variant: always n-1 guesses, the Jacobi update padded with fresh initial tokens.

Statistics (``stats()``), following CLLM section 3.3 and Table 3:

* ``fast_forward``: tokens fixed by each iteration (target forward) = accepted guesses + the bonus token, so it
  includes the one token an iteration fixes even without fast-forwarding (as Table 3 counts). CLLM's
  ``fast_forward_cnt``. The counts sum to the generated tokens minus the prefill's token.
* ``stationary_tokens``: accepted guesses whose value was already in the window at the same position in the
  previous iteration -- predicted correctly while a token before them was still wrong (else they would have been
  accepted then), and unchanged until accepted. Reported in total and per block (Table 3 reports per n-token block).
  The last forward of a run is counted in ``fast_forward`` (the engine does not report its verdict to proposers, so
  its count is the tokens it emitted) but is not examined for stationary tokens.

Trajectories (``record_trajectory=True``, block mode): ``proposer.trajectories`` lists every block that converged,
as ``{"prefix_length", "prefix_ids", "states", "fixed_point"}``: ``prefix_ids`` are the tokens before the block
(prompt + generated, ending with the root), each state is the full n-token Jacobi iterate over the block's positions
(fixed tokens followed by the current guesses; ``states[0]`` is the initialisation, ``states[-1] == fixed_point``),
and ``fixed_point`` is the block's n tokens -- in greedy mode the AR continuation of ``prefix_ids``. This is the
data CLLM's consistency training consumes (prompt ids, trajectory ids, teacher output).
"""

from __future__ import annotations

import torch

from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..errors import UsageError
from ..tree import DraftTree, chain_shape
from ..validation import MAX_PROPOSAL_ROWS, check_proposal_rows
from ..verify import argmax_rows
from . import register
from ._options import Option

INIT_MODES = ("prompt", "noise", "pad")
_EMPTY = torch.zeros(0, dtype=torch.long)


def pad_token_id(target) -> int:
    """The id used for ``init='pad'``: the tokenizer's pad id, else the smallest EOS id, else 0."""
    pad = getattr(getattr(target, "tokenizer", None), "pad_token_id", None)
    if pad is not None:
        return int(pad)
    eos = getattr(target, "eos_token_ids", None)
    return int(min(eos)) if eos else 0


def init_tokens(state: DecodeState, k: int, mode: str = "noise") -> torch.Tensor:
    """``k`` initial guesses (a ``[k]`` long tensor) for Jacobi-style drafting.

    * ``"prompt"`` -- tokens drawn uniformly (with replacement) from the prompt, as CLLM initialises its blocks;
    * ``"noise"`` -- MSN *ahead noise* (Make Some Noise, section 3.2): tokens drawn uniformly from the preceding
      context, prompt + generated so far;
    * ``"pad"`` -- the pad (else EOS) token repeated.

    Randomness comes from ``state.rng`` (seeded per generation), so runs with a seed are reproducible.
    """
    if k <= 0:
        return _EMPTY
    if mode == "pad":
        return torch.full((k,), pad_token_id(state.target), dtype=torch.long)
    if mode == "prompt":
        pool = state.ids[: state.prompt_length]
    elif mode == "noise":
        pool = state.ids[: state.length]
    else:
        raise UsageError(f"init must be one of {', '.join(INIT_MODES)}, got '{mode}'")
    g = torch.Generator().manual_seed(state.rng.getrandbits(63))
    return pool[torch.randint(pool.numel(), (k,), generator=g)]


class JacobiTrajectories:
    """A step observer collecting every converged block's Jacobi trajectory (block mode), for CLLM training.

    Each of the jacobi proposer's steps carries the block it refines in ``Proposal.info`` (``block_start``,
    ``block_size``, ``iterate`` = the guesses being verified). A trajectory is ``prefix_length``/``prefix_ids`` (the
    context before the block), ``states`` (the iterate of every step, then the fixed point) and ``fixed_point`` (the
    block's final tokens, which equal the AR continuation). Pass it as ``observers=[...]`` to a generation, or use
    the proposer's ``record_trajectory`` option."""

    def __init__(self):
        self.trajectories: list[dict] = []
        self._block: dict | None = None

    def __call__(self, state: DecodeState, step: StepResult) -> None:
        info = step.proposal.info
        if "block_start" not in info:
            return
        base, n = info["block_start"], info["block_size"]
        if self._block is None or self._block["prefix_length"] != base:
            self._block = {"prefix_length": base, "prefix_ids": state.ids[:base].tolist(), "states": []}
        self._block["states"].append(info["iterate"].tolist())
        if state.length - base >= n:  # this step fixed the block's last token: converged
            fixed = state.ids[base : base + n].tolist()
            self._block["states"].append(fixed)
            self._block["fixed_point"] = fixed
            self.trajectories.append(self._block)
            self._block = None


class JacobiProposer(Proposer):
    """Jacobi decoding over an n-token window; see the module docstring for semantics and statistics."""

    name = "jacobi"

    def __init__(self, n_tokens: int = 16, init: str = "prompt", blocks: bool = True, record_trajectory: bool = False):
        self.n = n_tokens
        self.init = init
        self.blocks = blocks
        self.record_trajectory = record_trajectory
        self._recorder = JacobiTrajectories()
        self._reset()

    @property
    def trajectories(self) -> list[dict]:
        """With ``record_trajectory``: the trajectories of the blocks this run completed (and observed)."""
        return self._recorder.trajectories

    def _reset(self) -> None:
        self._state: DecodeState | None = None
        self.iterate = _EMPTY  # the current guesses (block mode: the whole block, fixed tokens included)
        self.base = 0  # absolute position of iterate[0]
        self._prev = _EMPTY  # tokens fed last iteration at positions root+1, root+2, ... (for stationary tokens)
        self.fast_forward: list[int] = []
        self.stationary = 0
        self.blocks_started = 0
        self.blocks_completed = 0

    def max_proposal_size(self) -> int:
        return self.n

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        self._reset()
        self._recorder = JacobiTrajectories()
        self._state = state
        self._new_window(state)

    def _new_window(self, state: DecodeState) -> None:
        self.base = state.length  # the position after the root
        self.iterate = init_tokens(state, self.n if self.blocks else self.n - 1, self.init)
        self._prev = _EMPTY
        self.blocks_started += 1

    def propose(self, state: DecodeState) -> Proposal | None:
        fixed = state.length - self.base  # block tokens already fixed (0 in sliding mode)
        m = min(self.n - 1 - fixed, state.remaining - 1)
        info = {"block_start": self.base, "block_size": self.n, "iterate": self.iterate.clone()} if self.blocks \
            else {}
        if m <= 0:
            return Proposal(DraftTree.single(state.root), info=info)
        tokens = torch.cat([state.ids[state.length - 1 : state.length], self.iterate[fixed : fixed + m]])
        return Proposal(DraftTree(tokens, chain_shape(m + 1)), info=info)

    def observe(self, state: DecodeState, step: StepResult) -> None:
        if self.record_trajectory:
            self._recorder(state, step)
        tree = step.proposal.tree
        m = len(tree) - 1
        k = step.verdict.accepted
        e = len(step.new_tokens)
        self.fast_forward.append(e)
        if k and self._prev.numel():
            prev = self._prev[:k]
            self.stationary += int((tree.tokens[1 : 1 + prev.numel()] == prev).sum())
        self._prev = tree.tokens[k + 2 :]
        # The Jacobi update: the target's argmax after every node past the accepted prefix guesses the next token.
        preds = argmax_rows(step.logits[k + 1 : m + 1])
        if not self.blocks:
            self.iterate = torch.cat([preds, init_tokens(state, self.n - 1 - preds.numel(), self.init)])
            self.base = state.length
            return
        fixed = state.length - e - self.base  # before this step
        now = fixed + e
        self.iterate[fixed:now] = torch.as_tensor(step.new_tokens, dtype=torch.long)
        self.iterate[now : now + preds.numel()] = preds
        if now >= self.n:
            self.blocks_completed += 1
            self._new_window(state)

    def stats(self) -> dict:
        ff = list(self.fast_forward)
        if self._state is not None:
            last = self._state.generated - 1 - sum(ff)  # the final forward, which proposers do not observe
            if last > 0:
                ff.append(last)
        stats = {
            "n_tokens": self.n,
            "blocks": self.blocks,
            "iterations": len(ff),
            "fast_forward_mean": sum(ff) / len(ff) if ff else 0.0,
            "fast_forward": ff,
            "stationary_tokens": self.stationary,
        }
        if self.blocks:
            stats.update(
                blocks_started=self.blocks_started,
                blocks_completed=self.blocks_completed,
                stationary_per_block=self.stationary / self.blocks_started if self.blocks_started else 0.0,
            )
        return stats


def _trajectories_need_blocks(method: str, options: dict) -> None:
    if options["record_trajectory"] and not options["blocks"]:
        raise UsageError("jacobi: record_trajectory needs blocks=True (trajectories are per n-token block)")


@register(
    "jacobi",
    "Jacobi decoding: refine an n-token window in place until it converges (CLLM block semantics)",
    source="CLLM (Kou et al. 2024) section 3.1, Algorithm 3; Santilli et al. 2023; MSN section 2.1",
    options=(
        Option("n_tokens", "int", 16, 2, MAX_PROPOSAL_ROWS, help="window size, all in every forward (CLLM: 16)",
               bound=f"rows per forward: the window is the forward (the engine's cap, {MAX_PROPOSAL_ROWS:,}, and the "
                     "model's context)"),
        Option("init", "choice", "prompt", choices=INIT_MODES,
               help="how a window starts: prompt tokens, MSN ahead noise, or the pad token"),
        Option("blocks", "bool", True, help="CLLM block semantics (else a sliding window)"),
        Option("record_trajectory", "bool", False, help="keep every block's Jacobi trajectory (needs blocks)"),
    ),
    checks=(_trajectories_need_blocks,),
)
def jacobi(target, *, n_tokens: int = 16, init: str = "prompt", blocks: bool = True,
           record_trajectory: bool = False) -> JacobiProposer:
    """``n_tokens``: window size (CLLM: 16); ``init``: prompt | noise | pad; ``blocks``: CLLM block semantics
    (else a sliding window); ``record_trajectory``: keep every block's Jacobi trajectory (block mode only). The
    values are checked against the schema (:func:`~fastforward.proposers.make_proposer`); here, the window against
    the model's context."""
    check_proposal_rows("jacobi", n_tokens, f"n_tokens {n_tokens}", target.max_context)
    return JacobiProposer(n_tokens, init, blocks, record_trajectory)
