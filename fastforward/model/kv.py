"""KV caches with pending entries: a forward writes its new tokens' keys and values after the committed ones;
``keep(indices)`` commits the accepted entries (moving them into place) and drops the rest."""

from __future__ import annotations

import torch

from ..errors import UsageError

#: how a lean model's KV cache stores keys and values (``LeanLlama.kv_precision``, ``load(kv_cache=...)``): 'fp32'
#: as computed (in the activations' dtype), or 'fp16' rounded to half precision (to nearest even) when written and
#: read back exactly -- llama.cpp's default, half the cache's bytes, and a (slightly) different model, which every
#: method then reproduces token for token
KV_PRECISIONS = ("fp32", "fp16")


class StaticKVCache:
    """A pre-allocated KV cache ``[layers, kv_heads, capacity, head_dim]`` with committed length ``length``.

    A forward writes its q new tokens at slots ``length .. length+q-1`` (pending). ``keep(indices)`` commits the
    pending entries at those indices (relative to ``length``, ascending) by moving them to the front of the
    pending area; everything after is dropped. ``crop(n)`` forgets all but the first n committed entries.
    ``dtype`` is the stored keys' and values' (float16 for an fp16 cache; what is stored is moved as it is).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype=torch.float32):
        self.k = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=dtype)
        self.length = 0
        self.capacity = capacity

    def keep(self, indices) -> None:
        if isinstance(indices, list) and indices and indices[-1] == len(indices) - 1:
            # ascending from >= 0 and ending at n - 1: exactly 0..n-1, already in place (every AR step, every chain
            # accepted whole): no tensor work
            if self.length + len(indices) > self.capacity:
                raise UsageError("KV cache capacity exceeded")
            self.length += len(indices)
            return
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = idx.numel()
        if n == 0:
            return
        if self.length + n > self.capacity:
            raise UsageError("KV cache capacity exceeded")
        # Entries already in place (the accepted path starts with the root, usually a run of 0,1,2,...) stay put.
        in_place = int((idx == torch.arange(n)).cumprod(0).sum())
        if in_place < n:
            src = idx[in_place:] + self.length
            dst = slice(self.length + in_place, self.length + n)
            self.k[:, :, dst] = self.k.index_select(2, src)
            self.v[:, :, dst] = self.v.index_select(2, src)
        self.length += n

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise UsageError(f"cannot crop a cache of {self.length} tokens to {n}")
        self.length = n


class HFDynamicKVCache:
    """The same keep/crop semantics over a transformers ``DynamicCache`` (for :class:`HFForward`)."""

    def __init__(self, capacity: int):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.length = 0
        self.capacity = capacity

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", True)]

    @torch.inference_mode()  # the layers' tensors are inference tensors (written by HFForward.forward)
    def keep(self, indices) -> None:
        """Commit the pending entries at ``indices`` (relative to ``length``, ascending): written in place at slots
        ``length .. length+n-1``, then the rest dropped by narrowing; the committed prefix is never copied."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = idx.numel()
        end = self.length + n
        in_place = int((idx == torch.arange(n)).cumprod(0).sum())  # a leading run 0,1,2,... is already there
        src = idx[in_place:] + self.length
        dst = torch.arange(self.length + in_place, end)
        for layer in self._layers():
            for name in ("keys", "values"):
                t = getattr(layer, name)
                if src.numel():
                    t.index_copy_(t.dim() - 2, dst, t.index_select(t.dim() - 2, src))
                setattr(layer, name, t.narrow(-2, 0, end))
        self.length = end

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise UsageError(f"cannot crop a cache of {self.length} tokens to {n}")
        for layer in self._layers():
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]
        self.length = n

    def drop_pending(self) -> None:
        self.crop(self.length)
