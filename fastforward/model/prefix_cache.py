"""Prompt prefixes read once: the KV entries (and tapped hidden states) of recent prompts, reused by later prompts
that start the same way -- a chat template's system prompt, an earlier turn of the same conversation.

A prompt that shares its first m tokens with a kept one copies those m positions' keys and values into its fresh
cache and reads only the rest. That is *exactly* what reading the whole prompt gives: a position's key and value
depend only on the tokens up to it, and the lean backend computes every row of a forward as it would alone (the
matmuls' summation does not depend on the row count, attention visits keys in a fixed order), so the copied entries
are bitwise the ones a full prefill would write and the prompt's logits are bitwise the same. Backends without that
guarantee get no prefix cache (:func:`prefix_cache_for`).

Entries are whole prompts, least recently used evicted first, bounded by the tokens they hold (each token costs
``2 x layers x kv_heads x head_dim`` values of the cache's dtype: 46 KB for the default model, 23 KB with an fp16
cache). An entry is only reused by a cache of its own dtype (an fp16 cache's keys are another model's).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from .kv import StaticKVCache

#: prompt tokens a server keeps by default (46 KB each for the default model: ~380 MB)
DEFAULT_PREFIX_CACHE_TOKENS = 8192
#: the largest prefill a backend must compute row-exactly for prefixes to be reusable (engine.PREFILL_CHUNK)
REQUIRED_EXACT_ROWS = 256


@dataclass
class PrefixEntry:
    tokens: torch.Tensor  # [n] the prompt
    k: torch.Tensor  # [layers, kv_heads, n, head_dim]
    v: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, d]: the taps it was read with
    layers: frozenset = frozenset()  # the taps asked for when it was read (``hidden`` holds those the model has)


class PrefixCache:
    """An LRU of prompts' KV entries holding at most ``max_tokens`` tokens (see the module docstring)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()
        self._next = 0
        self.tokens = 0  # held now
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens found

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: torch.Tensor, hidden_layers=(), dtype: torch.dtype | None = None
               ) -> tuple[PrefixEntry | None, int]:
        """The kept entry sharing the longest prefix with ``prompt`` (and holding every tap in ``hidden_layers``;
        with ``dtype``, keys and values of that dtype), and how many positions of it to reuse: at most
        ``len(prompt) - 1``, so the prompt's last position is always computed (its logits choose the first token)."""
        n = prompt.numel()
        self.queries += n
        best, best_m = None, 0
        for key, entry in self._entries.items():
            if not set(hidden_layers) <= entry.layers or (dtype is not None and entry.k.dtype != dtype):
                continue
            m = min(entry.tokens.numel(), n - 1)
            if m <= best_m:
                continue
            same = entry.tokens[:m] == prompt[:m]
            m = m if bool(same.all()) else int(same.long().cumprod(0).sum())
            if m > best_m:
                best, best_m = key, m
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        self.hits += best_m
        return self._entries[best], best_m

    def restore(self, entry: PrefixEntry, m: int, cache: StaticKVCache) -> None:
        """Write the entry's first ``m`` positions into an empty ``cache`` and commit them."""
        cache.k[:, :, :m] = entry.k[:, :, :m]
        cache.v[:, :, :m] = entry.v[:, :, :m]
        cache.length = m

    def store(self, prompt: torch.Tensor, cache: StaticKVCache, hidden: dict[int, torch.Tensor],
              layers=None) -> None:
        """Keep ``prompt``'s entries (the cache's first ``len(prompt)`` positions, and its taps ``hidden``, read
        for the tap indices ``layers``: default its keys); an entry for the same tokens is replaced (their taps
        merged), the least recently used go while over ``max_tokens``."""
        n = prompt.numel()
        if n > self.max_tokens:
            return
        hidden = {layer: h[:n] for layer, h in hidden.items()}
        layers = frozenset(hidden if layers is None else layers)
        for key, entry in list(self._entries.items()):
            if entry.tokens.numel() == n and bool((entry.tokens == prompt).all()):
                hidden, layers = {**entry.hidden, **hidden}, entry.layers | layers
                self._drop(key)
        entry = PrefixEntry(prompt.clone(), cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone(),
                            {layer: h.clone() for layer, h in hidden.items()}, layers)
        self._entries[self._next] = entry
        self._next += 1
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= self._entries.pop(key).tokens.numel()


def prefix_cache_for(target, max_tokens: int) -> PrefixCache | None:
    """A prefix cache for ``target``, or None when it cannot reuse prefixes exactly (a backend that is not
    row-exact for whole prefill chunks, or a cache that is not a :class:`StaticKVCache`) or ``max_tokens`` is 0."""
    if max_tokens <= 0 or target.batch_rows_limit() < REQUIRED_EXACT_ROWS:
        return None
    if not isinstance(target.new_cache(1), StaticKVCache):
        return None
    return PrefixCache(max_tokens)
