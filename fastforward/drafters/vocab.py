"""A reduced draft vocabulary: the drafter predicts only the ``size`` target tokens most frequent in its training
data, through a frozen slice of the target's LM head (the full 49K-row head of the default model is 21% of its
weights, and on CPU its cost decides the drafting time).

The maps follow the EAGLE-3 / SpecForge convention, so checkpoints load in vLLM and SGLang unchanged:
``used`` = the chosen target ids sorted ascending; ``d2t[i] = used[i] - i`` (int64, ``target = draft + d2t[draft]``);
``t2d[j] = j in used`` (bool, over the target vocabulary).

**The head's rows by frequency** (FR-Spec's idea: Zhao et al. 2025, *FR-Spec: Accelerating Large-Vocabulary Language
Models via Frequency-Ranked Speculative Sampling*). A drafter folder may rank its draft tokens by how often they occur
in the target's own answers (``draft_vocab_frequency.json``, written by the trainers and by
``scripts/rank_draft_vocab.py``); at decode time the head can keep the ``head_vocab`` most frequent of them
(:meth:`DraftVocab.keep_most_frequent`): a head call reads that share of the head's weights. The target verifies
every draft, so which rows the head keeps changes how often drafts are right, never the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError

#: a drafter folder's ranking of its draft tokens, most frequent first
FREQUENCY_FILE = "draft_vocab_frequency.json"


def token_counts(sequences, vocab_size: int) -> torch.Tensor:
    """[vocab_size] how often each id occurs in ``sequences`` (lists of token ids)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.as_tensor(seq, dtype=torch.long), minlength=vocab_size)
    return counts


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [draft] int64 offsets
    t2d: torch.Tensor  # [vocab] bool

    def __post_init__(self):
        # tensors keep their device (the maps live where the ids they map are)
        tensor = isinstance(self.d2t, torch.Tensor) and isinstance(self.t2d, torch.Tensor)
        self.d2t = self.d2t.long() if tensor else torch.as_tensor(self.d2t, dtype=torch.long)
        self.t2d = self.t2d.bool() if tensor else torch.as_tensor(self.t2d, dtype=torch.bool)
        used = self.target_ids
        if int(self.t2d.sum()) != used.numel() or not bool(torch.equal(self.t2d.nonzero().flatten(), used)):
            raise UsageError("malformed draft vocabulary: t2d does not mark exactly the tokens d2t maps to")
        self._t2d_index = torch.full((self.t2d.numel(),), -1, dtype=torch.long, device=self.t2d.device)
        self._t2d_index[used] = torch.arange(used.numel(), device=self.t2d.device)

    @property
    def size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft] the target id of every draft id (ascending)."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def to(self, device) -> DraftVocab:
        """The same vocabulary with its maps on ``device`` (where the ids it maps are)."""
        return DraftVocab(self.d2t.to(device), self.t2d.to(device))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids, -1 where a token is outside the draft vocabulary."""
        return self._t2d_index[target_ids]

    @classmethod
    def from_target_ids(cls, ids, vocab_size: int) -> DraftVocab:
        used = torch.as_tensor(sorted(set(int(i) for i in ids)), dtype=torch.long)
        if used.numel() == 0 or int(used[-1]) >= vocab_size or int(used[0]) < 0:
            raise UsageError(f"draft vocabulary ids must be in [0, {vocab_size})")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(used - torch.arange(used.numel()), t2d)

    @classmethod
    def full(cls, vocab_size: int) -> DraftVocab:
        return cls.from_target_ids(range(vocab_size), vocab_size)

    @classmethod
    def most_frequent(cls, sequences, vocab_size: int, size: int, always=()) -> DraftVocab:
        """The ``size`` most frequent ids of ``sequences`` (ties by id), plus ``always`` (e.g. EOS); when the data
        uses fewer distinct ids, the rest is filled with the lowest unused ids."""
        if size <= 0 or size > vocab_size:
            raise UsageError(f"the draft vocabulary size must be in [1, {vocab_size}], got {size}")
        counts = token_counts(sequences, vocab_size)
        for t in always:
            counts[int(t)] = counts.max() + 1
        order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size))  # by count desc, then id
        return cls.from_target_ids(order[:size].tolist(), vocab_size)

    def coverage(self, sequences) -> float:
        """The fraction of the tokens of ``sequences`` that the draft vocabulary holds."""
        total = hit = 0
        for seq in sequences:
            s = torch.as_tensor(seq, dtype=torch.long)
            total += s.numel()
            hit += int(self.t2d[s].sum())
        return hit / max(total, 1)

    def frequency_order(self, sequences) -> list[int]:
        """The draft ids ordered by how often their target tokens occur in ``sequences`` (most frequent first, ties
        by id)."""
        draft_counts = token_counts(sequences, self.vocab_size)[self.target_ids]
        order = torch.argsort(-draft_counts * self.size + torch.arange(self.size))
        return order.tolist()

    def keep_most_frequent(self, order, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's rows to keep and the draft -> target offsets over them: the draft ids of the first ``n`` of
        ``order`` (:meth:`frequency_order`), ascending ([n] int64), and ``d2t`` of the smaller draft vocabulary they
        make (kept row i drafts target id ``i + d2t[i]``)."""
        keep = torch.as_tensor(sorted(order[:n]), dtype=torch.long)
        return keep, self.target_ids[keep] - torch.arange(keep.numel())


def write_frequency_order(folder, order: list[int], tokens: int, source: str) -> Path:
    """``draft_vocab_frequency.json`` in the drafter ``folder``: ``order`` (every draft id, most frequent first),
    counted over ``tokens`` tokens of ``source``."""
    path = Path(folder) / FREQUENCY_FILE
    path.write_text(json.dumps({"tokens_counted": int(tokens), "source": source,
                                "order": [int(i) for i in order]}) + "\n")
    return path


def read_frequency_order(folder, size: int) -> list[int] | None:
    """The drafter ``folder``'s ranking of its ``size`` draft ids (None when it has none); a one-line refusal when
    the file is not a ranking of exactly those ids."""
    path = Path(folder) / FREQUENCY_FILE
    if not path.is_file():
        return None
    try:
        order = json.loads(path.read_text())["order"]
        ok = isinstance(order, list) and len(order) == size and all(type(i) is int for i in order) and \
            sorted(order) == list(range(size))
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise UsageError(f"{path}: not a ranking of the drafter's {size} draft ids (a JSON object whose 'order' lists "
                         f"each of 0..{size - 1} once); remove it or write it again with scripts/rank_draft_vocab.py")
    return order
