"""What a target forward takes and gives: :class:`ForwardRequest` (one sequence's new tokens, positions, cache and
tree mask) and :class:`ForwardOutput` (logits and requested hidden states), and the attention mask they imply."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [q, vocab] (or [1, vocab] when only the last row was asked for)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [q, hidden]


@dataclass
class ForwardRequest:
    """One sequence's part of a target forward: q new tokens at their positions, written into ``cache`` after its
    committed entries, seeing the whole committed prefix and each other per ``tree_mask`` ([q, q], None = causal)."""

    ids: torch.Tensor  # [q] int64
    positions: torch.Tensor  # [q] int64, absolute
    cache: object  # the sequence's KV cache (StaticKVCache / HFDynamicKVCache)
    tree_mask: torch.Tensor | None = None  # [q, q] bool

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


def _full_mask(q: int, prefix: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[q, prefix+q] boolean: every new token sees the whole prefix, and the new tokens per ``tree_mask``."""
    local = torch.ones(q, q, dtype=torch.bool).tril_() if tree_mask is None else tree_mask.to(torch.bool)
    return torch.cat([torch.ones(q, prefix, dtype=torch.bool), local], dim=1)
