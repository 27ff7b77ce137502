"""Target models: loading, a lean tree-aware forward for the Llama family, an HF fallback, and KV caches.

Every decoding method talks to the target through one call::

    out = target.forward(token_ids, positions, cache, tree_mask)

``token_ids`` are q new tokens, ``positions`` their absolute positions, ``tree_mask`` a ``[q, q]`` boolean matrix
saying which of the new tokens each new token may attend to (``None`` = causal, a plain chain). Every new token
always sees the whole committed prefix in ``cache``. The new tokens' keys and values are written into the cache as
*pending* entries; ``cache.keep(indices)`` then commits the chosen ones (moving them into place) and drops the rest.

Two backends implement ``forward``:

* :class:`LeanLlama` -- a compact PyTorch forward for Llama-architecture models (Llama, SmolLM2, Qwen2, Mistral
  without sliding windows) over fused, pre-laid-out weights and a static pre-allocated cache. It exists because on
  CPUs the HF forward's cost for a handful of new tokens is dominated by overheads the decode loop cannot afford.
* :class:`HFForward` -- any Hugging Face causal LM driven through its public API (4D float mask, ``position_ids``,
  ``DynamicCache``). Slower, but works for every architecture.

The package, one module per concept: ``kv`` (KV caches), ``forward`` (a forward's request/output and masks),
``lean`` (the lean forward), ``hf`` (the HF backend, sliding windows), ``target`` (TargetModel), ``loading``
(aliases, HF folders, GGUF files), ``slots`` (what is built once per target and lives as long as it does).
"""

from .forward import ForwardOutput, ForwardRequest, _full_mask
from .hf import HFForward, sliding_window_of
from .kv import HFDynamicKVCache, StaticKVCache
from .lean import LeanLlama, LlamaLayer, rope_tables
from .loading import (
    DEFAULT_MODEL,
    DEFAULT_PASTA_MODEL,
    MODEL_ALIASES,
    PACKAGED_MODELS,
    SHIPPED_ADAPTERS,
    WEIGHT_CHOICES,
    _converted_gguf,
    _gguf_cache_dir,
    _gguf_tokenizer,
    _quiet_transformers,
    convert_gguf,
    from_hf,
    load,
    load_hf,
    packaged_gguf,
    resolve_model,
)
from .slots import shared
from .target import LEAN_ARCHITECTURES, TargetModel

__all__ = [
    "DEFAULT_MODEL", "DEFAULT_PASTA_MODEL", "SHIPPED_ADAPTERS",
    "LEAN_ARCHITECTURES", "MODEL_ALIASES", "PACKAGED_MODELS", "WEIGHT_CHOICES", "ForwardOutput",
    "ForwardRequest", "HFDynamicKVCache", "HFForward", "LeanLlama", "LlamaLayer", "StaticKVCache", "TargetModel",
    "convert_gguf", "from_hf", "load", "load_hf", "packaged_gguf", "resolve_model", "rope_tables", "shared",
    "sliding_window_of", "_converted_gguf", "_full_mask", "_gguf_cache_dir", "_gguf_tokenizer", "_quiet_transformers",
]
