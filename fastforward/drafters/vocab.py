"""A reduced draft vocabulary: the drafter predicts only the ``size`` target tokens most frequent in its training
data, through a frozen slice of the target's LM head (the full 49K-row head of the default model is 21% of its
weights, and on CPU its cost decides the drafting time).

The maps follow the EAGLE-3 / SpecForge convention, so checkpoints load in vLLM and SGLang unchanged:
``used`` = the chosen target ids sorted ascending; ``d2t[i] = used[i] - i`` (int64, ``target = draft + d2t[draft]``);
``t2d[j] = j in used`` (bool, over the target vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError


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
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for seq in sequences:
            counts += torch.bincount(torch.as_tensor(seq, dtype=torch.long), minlength=vocab_size)
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
