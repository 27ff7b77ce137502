"""What a target forward takes and gives: :class:`ForwardRequest` (one sequence's new tokens, positions, cache and
tree mask) and :class:`ForwardOutput` (logits and requested hidden states), and the attention mask they imply."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UsageError


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [q, vocab] (or [1, vocab] when only the last row was asked for)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [q, hidden]


@dataclass
class ForwardRequest:
    """One sequence's part of a target forward over its KV cache, a pool of slots.

    The q new tokens sit at ``positions``; their keys and values are written to ``write_slots`` (default: right
    after the cache's committed entries, ``length .. length+q-1``). Every new token sees the committed slots
    ``0 .. length-1``; ``tree_mask`` ``[q, W]`` says which of the slots ``length .. length+W-1`` each one sees
    besides: with W = q and the default write slots it is the tree mask over the new tokens (None = causal);
    wider, it also names slots written by earlier forwards that only some rows see -- threads of one sequence that
    share a prefix and each see their own slots."""

    ids: torch.Tensor  # [q] int64
    positions: torch.Tensor  # [q] int64, absolute
    cache: object  # the sequence's KV cache (StaticKVCache / HFDynamicKVCache)
    tree_mask: torch.Tensor | None = None  # [q, W] bool
    write_slots: torch.Tensor | None = None  # [q] int64, each in [length, capacity), distinct

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


def _full_mask(q: int, prefix: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[q, prefix+W] boolean: every new token sees the whole prefix, and the slots after it per ``tree_mask``
    ([q, W]; None = causal over the q new tokens)."""
    local = torch.ones(q, q, dtype=torch.bool).tril_() if tree_mask is None else tree_mask.to(torch.bool)
    return torch.cat([torch.ones(q, prefix, dtype=torch.bool), local], dim=1)


def check_slots(request: ForwardRequest) -> int:
    """The end of the slots a request touches (its mask's width and its write slots), checked against the cache."""
    cache, q = request.cache, request.size
    start = cache.length
    end = start + q
    if request.tree_mask is not None:
        if request.tree_mask.dim() != 2 or request.tree_mask.shape[0] != q:
            raise ValueError(f"tree_mask must be [q={q}, W], got {tuple(request.tree_mask.shape)}")
        end = max(end if request.write_slots is None else start, start + request.tree_mask.shape[1])
    if request.write_slots is not None:
        slots = request.write_slots
        if slots.shape != (q,) or (q and (int(slots.min()) < start or slots.unique().numel() != q)):
            raise ValueError(f"write_slots must be {q} distinct slots >= the committed length {start}")
        if request.tree_mask is None:
            raise ValueError("write_slots need a tree_mask saying what each new token sees")
        end = max(end, int(slots.max()) + 1 if q else start)
    if end > cache.capacity:
        raise UsageError(f"KV cache capacity {cache.capacity} exceeded ({end} tokens)")
    return end
