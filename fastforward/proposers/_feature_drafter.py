"""The base of the proposers over a trained drafter that reads the target's own features (``eagle``, ``fasteagle``,
``falcon``): what they do alike, written once.

* **The drafter's runner**: shared per target and drafter folder (:func:`load_runner`, built once and kept in the
  target's resource slots); each sequence gets a fresh cache of its own (:meth:`start`).
* **Committing accepted rows**: the target's features of the accepted path (tapped in the verification forward
  itself, gathered by :meth:`_gathered_taps`) and the accepted tokens become committed drafter rows. They wait in
  ``pending`` until the drafter next drafts and go through it together (:meth:`_catch_up`), the prompt's rows too,
  so a step that drafts nothing (a shared forward where no draft of this sequence pays, back-off) costs no drafter pass.
* **The cost model**: fetched before the run's clock starts (:meth:`prepare`) unless the draft's size is fixed; a
  draft is priced as every draft is (:func:`~fastforward.costs.best_draft`: the tree sizes of :meth:`_tree_size`).
* **Back-off** (:mod:`._backoff`) and, at temperature 0, the drafter's calibrated acceptance rates when asked for.

A subclass says how its drafter reads rows (:meth:`_commit`), how many extra cache rows a sequence needs
(:meth:`_cache_reserve`), and drafts (``propose``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..costs import AcceptanceEstimate, best_chain_length, cost_model
from ..drafters import shipped_drafter
from ..drafters.calibration import calibration_of
from ..drafters.features import engine_layers
from ..drafters.pieces import DRAFTER_WEIGHTS
from ..drafters.vocab import read_frequency_order
from ..engine import DecodeState, Proposal, Proposer, StepResult
from ..errors import UsageError
from ..tree import DraftTree
from ..verify import sample
from ._backoff import BackOff
from ._options import (
    HEAD_VOCAB,
    PROMPT_WINDOW,
    Option,
    backoff_on_loss_option,
    backoff_option,
    drafter_option,
    head_vocab_option,
    prompt_window_option,
    weights_option,
)
from ._rerank import best_size


def drafter_folder(method: str, kind: str, target, drafter: str | None) -> Path:
    """``drafter`` as a folder, or the shipped drafter of ``kind`` for ``target`` (one-line refusals when there is
    none or the folder does not exist)."""
    if drafter is None:
        folder = shipped_drafter(target, kind)
        if folder is None:
            raise UsageError(f"{method}: no drafter ships for '{target.name}'; train one (fastforward train {method}) "
                             "and pass -o drafter=FOLDER")
        return folder
    folder = Path(str(drafter)).expanduser()
    if not folder.is_dir():
        raise UsageError(f"{method}: drafter folder not found: {folder}")
    return folder


def shared_runner(method: str, kind: str, target, drafter: str | None, variant: tuple, build):
    """``build(folder)`` once per (method, folder, ``variant`` -- the settings runners of one folder differ by) and
    target, kept in the target's resource slots (:mod:`fastforward.model.slots`): it lives as long as the target, and
    a new target never gets an old one's."""
    folder = drafter_folder(method, kind, target, drafter)
    return target.shared(("drafter runner", method, str(folder.resolve()), variant), lambda: build(folder))


def load_runner(method: str, kind: str, target, drafter: str | None, weights: str, load, runner_class,
                head_vocab: int = HEAD_VOCAB):
    """The target's shared decode-time ``runner_class`` over the drafter ``load(folder, target)`` reads (its weights
    read and packed once; see :func:`shared_runner`). ``head_vocab`` > 0: its head keeps the rows of the
    ``head_vocab`` most frequent draft tokens where the folder ranks them (:mod:`fastforward.drafters.vocab`);
    ``runner.head_rows`` says how many it kept."""

    def build(folder: Path):
        module = load(folder, target)
        vocab = module.vocab
        order = read_frequency_order(folder, vocab.size) if 0 < head_vocab < vocab.size else None
        kept = None if order is None else vocab.keep_most_frequent(order, head_vocab)
        runner = runner_class(module, target, capacity=64, weights=weights, head_rows=kept)
        runner.head_rows = vocab.size if kept is None else head_vocab
        return runner

    return shared_runner(method, kind, target, drafter, (weights, head_vocab), build)


def drafter_options(method: str, *own: Option, extra: tuple[Option, ...] = (),
                    prompt_window: int = PROMPT_WINDOW, head_vocab: int = HEAD_VOCAB) -> tuple[Option, ...]:
    """A feature drafter's options in the order they are listed: its drafter folder, the method's ``own`` (its
    draft's shape and size), back-off, the drafter's weights, ``extra``, back-off on loss, the prompt window and the
    head's rows (with the method's defaults)."""
    return (drafter_option(method), *own, backoff_option(), weights_option(DRAFTER_WEIGHTS), *extra,
            backoff_on_loss_option(), prompt_window_option(prompt_window), head_vocab_option(head_vocab))


def calibrated_option() -> Option:
    return Option("calibrated", "bool", False,
                  help="at temperature 0, map draft probabilities to greedy acceptance rates (the drafter's map)")


class FeatureDrafterProposer(Proposer):
    """See the module docstring. ``fixed``: the draft's size does not follow the cost model (no cost model, no
    back-off); ``calibrated``: at temperature 0, the drafter's calibrated greedy-acceptance rates (if its folder has
    a map) in place of its probabilities; ``prompt_window``: the prompt's last tokens the drafter reads (0: all)."""

    #: whether committed rows count as ``draft_rows`` in the stats (else the subclass counts its drafting rows)
    counts_committed_rows = True
    #: whether its chains (``topk=1``) sample their drafts at temperature > 0 (:meth:`_sampled_chain`)
    samples_chains = False

    def __init__(self, runner, *, fixed: bool, backoff: int, backoff_on_loss: bool = True, calibrated: bool = False,
                 prompt_window: int = PROMPT_WINDOW):
        self.shared = runner
        self.prompt_window = prompt_window
        self.fixed_size = fixed
        self.hidden_layers = self._tap_layers(runner)
        # at temperature 0, draft probabilities mapped to greedy acceptance rates (if the drafter has a map)
        self.calibration = calibration_of(runner.cfg.fastforward) if calibrated else None
        self.greedy_map = None
        self.backoff = 0 if fixed else backoff  # a fixed size always drafts
        self.backoff_on_loss = backoff_on_loss
        self.back_off = BackOff(self.backoff, backoff_on_loss)
        self.runner = None  # this sequence's: start()
        self.costs = None  # this machine's cost model (live), unless the size is fixed: prepare()
        # accepted rows not yet given to the drafter: (the forward's hidden states, the accepted rows of them -- a
        # list or a range --, the first row's position p, the number of rows r: positions p .. p + r - 1, whose next
        # tokens are the run's ids p + 1 .. p + r, read at the catch-up -- an emitted token never changes)
        self.pending: list[tuple[dict, list[int] | range, int, int]] = []
        # the native gather of the waiting rows' taps, where the kernels built (else torch's indexing)
        ops = getattr(runner, "ops", None)
        self._gather_tap_rows = getattr(ops, "gather_tap_rows", None)
        self._ids: torch.Tensor | None = None  # the run's token ids (DecodeState.ids): start()

    # -- what a subclass says -----------------------------------------------------------------------------------
    def _tap_layers(self, runner) -> tuple[int, ...]:
        """The target layers whose inputs the drafter reads (the engine taps them in every forward)."""
        return engine_layers(runner.cfg.aux_layers)


    def _cache_reserve(self) -> int:
        """Cache rows a sequence needs beyond its prompt and new tokens."""
        return 8

    def _commit(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed rows to this sequence's runner."""
        raise NotImplementedError

    # -- the run ------------------------------------------------------------------------------------------------
    def max_proposal_size(self) -> int:
        return self.nodes or self.max_nodes

    def prepare(self, target) -> None:
        if not self.fixed_size:
            self.costs = cost_model(target)

    def start(self, state: DecodeState, prefill_logits: torch.Tensor, hidden: dict) -> None:
        n = state.prompt_length
        self.runner = self.shared.fresh(n + state.max_new_tokens + self._cache_reserve())
        self.pending.clear()
        self.greedy_map = self.calibration if state.sampling.greedy else None
        # A chain (topk=1) at temperature > 0 samples its drafts from the drafter (see _sampled_chain); its length
        # then follows nothing measured on the clock (the cached cost curve, the acceptance seen so far; no back-off
        # on measured loss), so a seeded run draws the same tokens every time.
        self.drafts_with_probabilities = self.samples_chains and self.topk == 1 and not state.sampling.greedy
        self.estimate = AcceptanceEstimate()
        self.back_off = BackOff(self.backoff, self.backoff_on_loss and not self.drafts_with_probabilities)
        if not self.fixed_size and self.costs is None:
            self.prepare(state.target)
        # the prompt's rows (its last prompt_window) wait for the drafter's first pass like any accepted rows
        # (_catch_up): a run that never drafts (set aside, or stepping where no draft pays) never pays for them
        self._ids = state.ids
        first = max(0, n - self.prompt_window) if self.prompt_window else 0
        self.pending.append((hidden, range(first, n), first, n - first))

    def observe(self, state: DecodeState, step: StepResult) -> None:
        if self.drafts_with_probabilities and len(step.proposal.tree) > 1:
            self.estimate.update(len(step.proposal.tree) - 1, step.verdict.accepted)
        path = step.verdict.path
        r = len(path)
        root_pos = state.length - len(step.new_tokens) - 1  # the previous root's position
        # the features, tokens and positions are gathered when the drafter next drafts (_catch_up): a step it skips
        # costs no copy (the forward's hidden states are its own, never written again)
        self.pending.append((step.hidden, path, root_pos, r))
        if self.counts_committed_rows:
            self._n["draft_rows"] += r
        if self.back_off.awaiting_verdict:
            self.back_off.verdict(step.verdict.accepted, self._curve_ms())

    # -- sampled chains -------------------------------------------------------------------------------------------
    def _sampled_chain_length(self, room: int) -> int:
        """How many tokens a sampling run's chain drafts (0..room): the best length for the acceptance seen so far
        on the cached cost curve (``room`` with a fixed size)."""
        self.estimate.tick()
        prior = None if self.costs is None else self.costs.prior
        return room if prior is None else best_chain_length(self.estimate.alpha, room, prior)

    def _sampled_chain(self, state: DecodeState, k: int, next_q) -> Proposal:
        """A chain of ``k`` tokens, token d sampled from ``next_q(d, x)`` -- the drafter's [draft_vocab]
        probabilities under the run's temperature, top-k and top-p, given the draft id ``x`` sampled before it (None
        for d = 0; a drafter may ignore it: any distribution fixed before the draw will do) -- handed to
        verification with those probabilities: the target accepts a token with probability min(1, p/q) and
        otherwise samples the residual, so the output is distributed as AR's, and a token is accepted with
        probability sum(min(p, q)) -- near 1 where the drafter matches the target -- rather than p(guess)."""
        run = self.runner
        tokens, qs, x = [], [], None
        for d in range(k):
            q = next_q(d, x)
            x = sample(q, state.generator)
            tokens.append(x)
            qs.append(q)
        probs = torch.zeros(k + 1, state.target.vocab_size, dtype=qs[0].dtype)
        probs[1:, run.to_target(torch.arange(qs[0].numel()))] = torch.stack(qs)
        self.back_off.drafted(k + 1)
        return Proposal(DraftTree.chain(state.root, run.to_target(torch.tensor(tokens)), probs))

    def _catch_up(self) -> None:
        """Give the drafter the accepted rows that wait (one pass over all of them)."""
        if self.pending:
            pending, ids = self.pending, self._ids
            taps = self._gathered_taps(pending)
            if all(a[2] + a[3] == b[2] for a, b in zip(pending, pending[1:], strict=False)):  # one run (usual)
                first, end = pending[0][2], pending[-1][2] + pending[-1][3]
                # a view: emitted ids never change, and the commit reads them now
                tokens, positions = ids[first + 1 : end + 1], torch.arange(first, end)
            else:
                tokens = torch.cat([ids[p + 1 : p + 1 + r] for _, _, p, r in pending])
                positions = torch.cat([torch.arange(p, p + r) for _, _, p, r in pending])
            pending.clear()
            self._commit(taps, tokens, positions)

    def _gathered_taps(self, pending: list) -> torch.Tensor:
        """The drafter's input features of the waiting rows, in order: [R, n_taps * d_t], each row's taps side by
        side (one native call where the kernels built; the same values either way)."""
        layers = self.hidden_layers
        if self._gather_tap_rows is not None:
            return self._gather_tap_rows([hidden[layer] for hidden, _, _, _ in pending for layer in layers],
                                         [rows for _, rows, _, _ in pending], len(layers))
        parts = []
        for hidden, rows, _, _ in pending:
            index = slice(rows.start, rows.stop) if isinstance(rows, range) else torch.as_tensor(rows)
            parts.append(torch.cat([hidden[layer][index] for layer in layers], dim=1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- sizing -------------------------------------------------------------------------------------------------
    def _curve_ms(self, numpy: bool = False) -> torch.Tensor | np.ndarray | None:
        """t(1..max_proposal_size) from the live cost model (None for a fixed size); a numpy array with ``numpy``."""
        return None if self.costs is None else self.costs.table(self.max_proposal_size(), numpy=numpy)

    def _tree_size(self, ranked_probs: torch.Tensor | np.ndarray, state: DecodeState) -> int:
        """The rerank's tree size n (root included) for candidates' path probabilities, ranked (a torch tensor or a
        numpy array): ``nodes`` when fixed, else the n the cost model prices best (:func:`._rerank.best_size`)."""
        numpy = isinstance(ranked_probs, np.ndarray)
        limit = self._size_limit(ranked_probs.size if numpy else ranked_probs.numel(), state)
        return best_size(ranked_probs, self._curve_ms(numpy), limit, self.nodes)

    def _size_limit(self, candidates: int, state: DecodeState) -> int:
        """The largest tree (root included) that ``candidates`` ranked candidates can make in this step."""
        return min(self.max_proposal_size(), candidates + 1, state.remaining + 1)
