"""The lean forward: Llama-architecture decoders (Llama with linear / Llama 3 rope scaling, SmolLM2, Qwen2, Qwen3's
q/k norms, Phi-3's fused projections, Mistral's sliding window, Gemma 2 / 3) over fused weights
(:mod:`fastforward.linear`: fp32, or GGUF blocks kept packed) and a static KV cache, with the native layer ops
(RMSNorm, RoPE + KV write + tree attention, SiLU*mul) or plain torch ops. Every row of a forward is computed exactly
as alone, so a tree verification (and a forward shared by several sequences) gives each token the logits of decoding
it on its own. Layers with options beyond Llama's (sliding windows, soft-caps, query scales, Gemma's norms and GeGLU)
run on the native ops where the kernel takes them, else on the torch path, whose attention goes row by row over
each row's visible keys (:func:`rowwise_attention`)."""

from __future__ import annotations

import inspect
import operator
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..gguf_file import linear_from_tensor, unpermute_rows, vector
from ..kernels import load_native
from ..linear import FORMAT_IDS, DenseLinear, PackedLinear, concat_linears, format_names, packed_kernel_name, quantize
from ..machine import release_freed_memory
from .forward import ForwardOutput, ForwardRequest, _full_mask, check_slots
from .kv import KV_PRECISIONS, StaticKVCache
from .layer_math import rms_norm, rope_cos_sin, rope_inv_freq, rotary_heads

#: how many times any :class:`LlamaLayer`'s field has been set (construction included): a model's fused stack of its
#: layers (``LeanLlama._packed_stack``) is rebuilt when it moved, without comparing every layer's every field
_layer_edits = 0


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
    # Attention options (the native kernel's keywords, and rowwise_attention on the torch path); the defaults are
    # plain Llama attention. window > 0: a sliding window (a key at position k is seen from position p only if
    # p - k < window; the cache's committed slots must hold positions 0..length-1 in order); softcap > 0: scores
    # capped to softcap * tanh(s / softcap) (Gemma 2); scale > 0: the query scale instead of 1/sqrt(head_dim).
    window: int = 0
    softcap: float = 0.0
    scale: float = 0.0
    #: Qwen3's per-head RMSNorm of q and k ([head_dim] each, applied before RoPE), with its epsilon and the head
    #: counts that split the fused q|k|v rows
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6
    heads: tuple[int, int, int] | None = None  # (n_heads, n_kv_heads, head_dim), with q_norm / k_norm
    #: Gemma's norms of the attention and MLP outputs (before their residual adds)
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    #: the MLP's activation: 'silu' (SwiGLU) or 'gelu_tanh' (Gemma's GeGLU)
    act: str = "silu"
    #: the layer's own rope tables (Gemma 3's local layers), else the model's
    rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def __setattr__(self, name, value):
        global _layer_edits
        object.__setattr__(self, name, value)
        _layer_edits += 1

    @property
    def plain(self) -> bool:
        """A Llama layer as the native layer ops have always run it (none of the options above)."""
        return self.plain_attention and self.llama_shaped

    @property
    def plain_attention(self) -> bool:
        """No attention option set: the layer's attention is Llama's."""
        return not (self.window or self.softcap or self.scale)

    @property
    def llama_shaped(self) -> bool:
        """Llama's layer around the attention: no output norms, SwiGLU, the model's rope tables."""
        return self.attn_out_norm is None and self.mlp_out_norm is None and self.act == "silu" and self.rope is None

    def attention_options(self) -> dict:
        """The keyword arguments of the native ``attention`` / ``attention_many`` / ``packed_layer`` calls."""
        return {"window": int(self.window), "softcap": float(self.softcap), "scale": float(self.scale)}

    # The layer's two halves as reusable pieces (native layer ops ``ops``): a drafter built from the same parts
    # (an EAGLE-style decoder layer over its own KV cache) calls them as the target does.

    def project_qkv(self, h: torch.Tensor, ops=None) -> torch.Tensor:
        """[T, hidden] normed states -> [T, (n_heads + 2 n_kv_heads) head_dim] (q and k per-head normed when the
        layer has q/k norms: row-wise, by the native ``ops.rms_norm`` when given)."""
        qkv = self.qkv(h)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        if self.q_norm is not None:
            qkv = self.norm_qk(qkv, ops)
        return qkv

    def norm_qk(self, qkv: torch.Tensor, ops=None) -> torch.Tensor:
        """The q and k parts of fused rows RMS-normed per head (Qwen3, Gemma 3), v as it is; every row alone."""
        nh, nkv, d = self.heads
        t = qkv.shape[0]
        norm = rms_norm if ops is None else ops.rms_norm
        q = norm(qkv[:, : nh * d].reshape(t * nh, d).contiguous(), self.q_norm, self.qk_eps).view(t, nh * d)
        k = norm(qkv[:, nh * d : (nh + nkv) * d].reshape(t * nkv, d).contiguous(), self.k_norm,
                 self.qk_eps).view(t, nkv * d)
        return torch.cat([q, k, qkv[:, (nh + nkv) * d :]], dim=1)

    def attention_output(self, o: torch.Tensor) -> torch.Tensor:
        """[T, n_heads head_dim] attention values -> [T, hidden] (the o projection)."""
        o = self.o(o)
        return o if self.bo is None else o + self.bo

    def mlp(self, h: torch.Tensor, ops) -> torch.Tensor:
        """[T, hidden] normed states -> [T, hidden]: down(silu(gate) * up), or down(gelu_tanh(gate) * up)."""
        gu = self.gate_up(h)
        return self.down(ops.silu_mul(gu) if self.act == "silu" else ops.gelu_tanh_mul(gu))

    def packed_weights(self) -> tuple | None:
        """(data, fmt) of qkv, o, gate|up and down, flattened, when all four are packed GGUF weights on the native
        kernel and the layer has no biases and no q/k norms (what ``ops.packed_layer`` runs in one call); else None."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        cached = self.__dict__.get("_packed")
        if cached is not None and all(a is b for a, b in zip(cached[0], linears, strict=True)):
            return cached[1]
        ok = self.bqkv is None and self.bo is None and self.q_norm is None and self.llama_shaped and all(
            isinstance(lin, PackedLinear) and lin.data is not None and lin.native is not None and not lin.padded
            for lin in linears)
        args = tuple(v for lin in linears for v in (lin.data, lin.kernel_fmt)) if ok else None
        self.__dict__["_packed"] = (linears, args)
        return args


def rope_tables(head_dim: int, theta: float, max_positions: int,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[max_positions, head_dim]`` of the rotary embedding at positions 0..max_positions-1
    (:func:`~fastforward.model.layer_math.rope_cos_sin`): default frequencies, or ``inv_freq``."""
    cos, sin = rope_cos_sin(head_dim, theta, torch.arange(max_positions), inv_freq)
    return cos.contiguous(), sin.contiguous()


#: rope scaling types whose tables are fixed (not recomputed from the sequence length): HF folders take them from
#: the model's own rotary module
STATIC_HF_ROPE_TYPES = ("default", "linear", "llama3")
#: GGUF files: llama.cpp's linear scaling (``rope.scaling.factor``); Llama 3's factors come as ``rope_freqs.weight``
GGUF_ROPE_SCALING = ("none", "", "linear")


def hf_rope_types(config) -> set[str]:
    """The rope types of an HF config (transformers' ``rope_parameters``, per layer type for Gemma 3; or the older
    ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    if not params:
        return {"default"}
    groups = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
    return {str(g.get("rope_type", g.get("type", "default")) or "default") for g in groups}


def lean_gguf_problem(model) -> str | None:
    """Why the lean forward cannot run a GGUF file exactly (a rope scaling it does not compute, partial rotary
    dimensions), or None."""
    hp, t = model.hparams, model.tensors
    if hp["rope_scaling"] not in GGUF_ROPE_SCALING:
        return f"rope scaling '{hp['rope_scaling']}'"
    if any(name.startswith("rope_factors_") for name in t):
        return "long/short rope factors (longrope)"
    if hp.get("rope_dim", hp["head_dim"]) != hp["head_dim"]:
        return f"partial rotary dimensions ({hp['rope_dim']} of {hp['head_dim']})"
    return None


def hf_lean_problem(config, dtype=torch.float32) -> str | None:
    """Why the lean forward cannot run an HF config exactly (a rope type whose tables depend on the sequence
    length, or that it does not know; partial rotary dimensions; Gemma in a dtype other than fp32), or None."""
    if getattr(config, "model_type", "") in GEMMA_TYPES and dtype != torch.float32:
        return f"Gemma in {dtype} (its norms compute in fp32)"
    unknown = sorted(hf_rope_types(config) - set(STATIC_HF_ROPE_TYPES))
    if unknown:
        return f"rope type '{unknown[0]}'"
    if _hf_activation(config) not in ("silu", "gelu_tanh"):
        return f"activation '{_hf_activation(config)}'"
    partial = getattr(config, "partial_rotary_factor", None)
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", partial) if isinstance(params, dict) else partial
    if partial not in (None, 1, 1.0):
        return f"partial rotary factor {partial}"
    return None


#: HF model types with Gemma's layer: (1 + w) norms, four per layer, GeGLU, scaled embeddings
GEMMA_TYPES = ("gemma2", "gemma3_text")


def _hf_window(config) -> tuple[int | None, bool]:
    from .hf import sliding_window_of

    return sliding_window_of(config)


def _hf_activation(config) -> str:
    """'silu' or 'gelu_tanh' (Gemma's ``gelu_pytorch_tanh``); another activation is a problem."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)


def _hf_layer_parts(layer):
    """(q|k|v weight, its bias or None, gate|up weight) of an HF decoder layer: separate projections (Llama, Qwen,
    Mistral) or fused ones (Phi-3's ``qkv_proj`` and ``gate_up_proj``, gate first)."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        wqkv, bqkv = attn.qkv_proj.weight, attn.qkv_proj.bias
    else:
        wqkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0)
        bqkv = None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias,
                                                                 attn.v_proj.bias], 0)
    if hasattr(mlp, "gate_up_proj"):
        wgu = mlp.gate_up_proj.weight
    else:
        wgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
    return wqkv, (None if bqkv is None else bqkv.detach()), wgu


def gguf_inv_freq(model) -> torch.Tensor:
    """A GGUF file's rotary inverse frequencies as llama.cpp computes them: the default ones divided by
    ``rope_freqs.weight`` (Llama 3's frequency factors, which llama.cpp's converter writes) and by
    ``rope.scaling.factor`` under linear scaling."""
    hp, t = model.hparams, model.tensors
    inv = rope_inv_freq(hp["head_dim"], hp["rope_theta"])
    if "rope_freqs.weight" in t:
        factors = vector(t["rope_freqs.weight"])
        if factors.numel() != inv.numel():
            raise UsageError(f"{model.path}: rope_freqs.weight has {factors.numel()} factors, the heads need "
                             f"{inv.numel()}")
        inv = inv / factors
    if hp["rope_scaling"] == "linear":
        inv = inv / hp.get("rope_scale_factor", 1.0)
    return inv


def rowwise_attention(qh, keys, values, mask, q_pos, key_pos, layer: LlamaLayer) -> torch.Tensor:
    """Attention of each query row over exactly the keys it sees (its mask, and the layer's window: key positions
    within ``window`` of the query's), scores scaled by ``layer.scale`` (default ``head_dim ** -0.5``) and
    soft-capped by ``layer.softcap`` as transformers' eager attention does; ``qh`` [nh, q, d], ``keys``/``values``
    [nkv, K, d], ``mask`` [q, K] or None (all K), ``q_pos`` [q], ``key_pos`` [K]. Each row is computed on its own
    visible keys in slot order, so it is bitwise the same alone, in a tree or beside other rows. -> [nh, q, d]"""
    nh, q, d = qh.shape
    groups = nh // keys.shape[0]
    scale = layer.scale or d ** -0.5
    out = torch.empty_like(qh)
    for i in range(q):
        seen = torch.ones(keys.shape[1], dtype=torch.bool) if mask is None else mask[i]
        if layer.window:
            seen = seen & (q_pos[i] - key_pos < layer.window)
        idx = seen.nonzero().squeeze(1)
        k = keys.index_select(1, idx).repeat_interleave(groups, 0)  # [nh, n, d]
        v = values.index_select(1, idx).repeat_interleave(groups, 0)
        scores = torch.matmul(qh[:, i : i + 1], k.transpose(1, 2)) * scale  # [nh, 1, n]
        if layer.softcap:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        # in fp32 at least (as transformers' eager attention; float64 models keep float64)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(qh.dtype, torch.float32)).to(qh.dtype)
        out[:, i : i + 1] = torch.matmul(probs, v)
    return out


def gguf_sliding_layers(model) -> list[bool]:
    """Which layers of a GGUF file attend over ``attention.sliding_window`` only, as llama.cpp decides: every layer
    (Mistral-style, Phi-3) unless Gemma's local / global alternation applies -- Gemma 2 every other layer from the
    first, Gemma 3 by ``attention.sliding_window_pattern`` (a period n: n - 1 local layers then a global one; or a
    list of booleans), by default 6."""
    hp = model.hparams
    n = hp["n_layers"]
    if not hp.get("sliding_window"):
        return [False] * n
    pattern = hp.get("sliding_window_pattern")
    if model.architecture == "gemma2" and pattern is None:
        pattern = 2
    elif model.architecture == "gemma3" and pattern is None:
        pattern = 6
    if pattern is None:
        return [True] * n
    if isinstance(pattern, list):
        return [bool(pattern[i % len(pattern)]) for i in range(n)]
    pattern = int(pattern)
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]


def native_options(ops) -> bool:
    """Whether the native layer ops take the attention options (window, softcap, scale) and GeGLU."""
    return hasattr(ops, "gelu_tanh_mul")


class LeanLlama:
    """A compact forward for Llama-architecture decoders over fused weights and a :class:`StaticKVCache`.

    Weights are :mod:`fastforward.linear` objects: fp32 for HF folders (the skinny-GEMM kernel for a few rows, MKL
    beyond), or GGUF blocks kept packed and multiplied by the native quantised kernel. ``matmul_kernel`` names
    what runs. Build it with :meth:`from_hf` or :meth:`from_gguf`.
    """

    def __init__(self, *, n_heads, n_kv_heads, head_dim, hidden_size, intermediate_size, eps, embed, head, norm,
                 layers: list[LlamaLayer], cos, sin, matmul_kernel: str, dtype=torch.float32,
                 arithmetic: str = "exact", kv_precision: str = "fp32", embed_scale: float | None = None,
                 final_softcap: float | None = None):
        self.n_layers = len(layers)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.hidden_size, self.intermediate_size, self.eps = hidden_size, intermediate_size, eps
        self.embed, self.head, self.norm, self.layers = embed, head, norm, layers
        self.cos, self.sin = cos, sin
        self.max_positions = cos.shape[0]
        self.matmul_kernel = matmul_kernel
        self.dtype = dtype
        #: 'exact' (fp32 activations times the dequantised weights) or 'q8' (llama.cpp's integer arithmetic for the
        #: packed GGUF weights): see :mod:`fastforward.arithmetic`
        self.arithmetic = arithmetic
        self.kv_precision = kv_precision
        # The native layer ops (RMSNorm, RoPE + KV write + tree attention, SiLU*mul) for fp32: a few calls per
        # layer instead of ~25 small torch ops, and every row computed exactly as alone (see kernels/layer_ops.cpp).
        self.ops = None
        #: Gemma: the embeddings times sqrt(hidden) (in the activations' dtype, as HF casts it), the logits
        #: soft-capped as ``cap * tanh(logits / cap)``
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=dtype)
        self.final_softcap = final_softcap
        #: options beyond Llama's layer (windows, soft-caps, query scales, Gemma's norms, GeGLU, per-layer rope):
        #: the native layer ops run them when the kernel takes the attention options, else every forward takes the
        #: torch path; there attention goes row by row over each row's visible keys (:func:`rowwise_attention`)
        self.has_options = not all(layer.plain for layer in layers) or embed_scale is not None or \
            final_softcap is not None
        if dtype == torch.float32 and os.environ.get("FASTFORWARD_TORCH_OPS", "") in ("", "0"):
            native = load_native()
            self.ops = native if native is not None and hasattr(native, "attention") else None
            # the options need the native attention's window / softcap / scale and gelu_tanh_mul
            if self.ops is not None and self.has_options and not native_options(self.ops):
                self.ops = None

    @classmethod
    def from_hf(cls, hf_model, small_q_max: int = 4, kernel_max_q: int = 128, weights: str = "fp32") -> LeanLlama:
        """From an HF model; ``weights`` 'bf16' or 'int8' (Q8_0: int8 with an fp16 scale per 32 weights) store its
        linear weights that way -- a different model, which every method then reproduces exactly."""
        cfg = hf_model.config
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        inner = hf_model.model
        dtype = inner.embed_tokens.weight.dtype
        # The skinny kernel reads each weight once however many rows there are and computes every row exactly as
        # alone; fp32 only. Longer prefills stay on MKL all the same.
        native = None
        if dtype == torch.float32 and (kernel_max_q > 0 or weights != "fp32"):
            native = load_native()
        packed_format = {"bf16": "BF16", "int8": "Q8_0"}.get(weights)
        if packed_format is not None and (native is None or dtype != torch.float32):
            raise UsageError(f"--weights {weights} needs fp32 activations and the native kernels")

        def dense(w):
            if packed_format is not None:
                return PackedLinear(quantize(w, packed_format), FORMAT_IDS[packed_format], w.shape[1], native=native,
                                    owned=True)
            return DenseLinear(w.detach(), native=native, kernel_max_q=kernel_max_q, small_q_max=small_q_max)

        problem = hf_lean_problem(cfg, dtype)
        if problem is not None:
            raise UsageError(f"the lean forward does not compute {problem} exactly; use the HF backend")
        n_kv_heads = getattr(cfg, "num_key_value_heads", None) or n_heads
        gemma = cfg.model_type in GEMMA_TYPES
        max_pos = int(getattr(cfg, "max_position_embeddings", 4096))
        dummy = torch.zeros(1, 1, head_dim, dtype=dtype)
        positions = torch.arange(max_pos).unsqueeze(0)
        layer_types = getattr(cfg, "layer_types", None) or []
        per_type_rope = "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters

        def norm(module):  # Gemma's RMSNorm multiplies by (1 + w), in fp32
            w = module.weight.detach()
            return 1.0 + w.float() if gemma else w

        window, every_layer = _hf_window(cfg)
        layers = []
        with torch.no_grad():
            tables = {}
            if per_type_rope:  # Gemma 3: local and global layers rotate with their own frequencies
                for kind in sorted(set(layer_types)):
                    c, s_ = inner.rotary_emb(dummy, positions, kind)
                    tables[kind] = (c[0].contiguous(), s_[0].contiguous())
            for i, layer in enumerate(inner.layers):
                attn, mlp = layer.self_attn, layer.mlp
                wqkv, bqkv, wgu = _hf_layer_parts(layer)
                q_norm = getattr(attn, "q_norm", None)
                kind = layer_types[i] if i < len(layer_types) else None
                slides = window is not None and (every_layer or kind == "sliding_attention")
                layers.append(LlamaLayer(
                    in_norm=norm(layer.input_layernorm),
                    post_norm=norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
                    attn_out_norm=norm(layer.post_attention_layernorm) if gemma else None,
                    mlp_out_norm=norm(layer.post_feedforward_layernorm) if gemma else None,
                    act=_hf_activation(cfg),
                    window=window if slides else 0,
                    softcap=(getattr(cfg, "attn_logit_softcapping", None) or 0.0) if gemma else 0.0,
                    scale=cfg.query_pre_attn_scalar ** -0.5 if gemma else 0.0,
                    rope=tables.get(kind) if per_type_rope else None,
                    qkv=dense(wqkv),
                    o=dense(attn.o_proj.weight),
                    gate_up=dense(wgu),
                    down=dense(mlp.down_proj.weight),
                    bqkv=bqkv,
                    bo=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                    q_norm=None if q_norm is None else norm(q_norm),
                    k_norm=None if q_norm is None else norm(attn.k_norm),
                    qk_eps=cfg.rms_norm_eps,
                    heads=(n_heads, n_kv_heads, head_dim),
                ))
            embed = dense(inner.embed_tokens.weight)
            head_w = hf_model.get_output_embeddings().weight
            head = embed if head_w is inner.embed_tokens.weight else dense(head_w)  # tied: one copy
            # RoPE tables from the model's own rotary module, so every rope variant (scaling types) is honoured.
            if per_type_rope:
                cos, sin = tables.get("full_attention", next(iter(tables.values())))
            else:
                cos, sin = (c[0].contiguous() for c in inner.rotary_emb(dummy, positions))
        return cls(
            n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, eps=cfg.rms_norm_eps,
            embed=embed, head=head, norm=norm(inner.norm), layers=layers, cos=cos, sin=sin,
            embed_scale=cfg.hidden_size ** 0.5 if gemma else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            matmul_kernel=(f"quant-{packed_kernel_name(native)} ({packed_format})" if packed_format else
                           f"skinny-{native.isa}" if native is not None else "mkl"), dtype=dtype,
        )

    @classmethod
    def from_gguf(cls, model, native, arithmetic: str = "exact") -> LeanLlama:
        """From a :class:`~fastforward.gguf_file.GGUFModel`: quantised weights stay packed (``native`` given, or
        ``arithmetic='q8'``), multiplied in ``arithmetic`` ('exact' or 'q8')."""
        hp, t = model.hparams, model.tensors
        problem = lean_gguf_problem(model)
        if problem is not None:
            raise UsageError(f"the direct GGUF path does not run {problem}")
        # llama.cpp permutes Q/K rows for llama only (qwen2/qwen3/phi3 GGUFs keep HF's order: NeoX-style rope).
        pq, pk = (hp["n_heads"], hp["n_kv_heads"]) if model.architecture == "llama" else (None, None)
        nh, nkv, d = hp["n_heads"], hp["n_kv_heads"], hp["head_dim"]
        arch, n_layers = model.architecture, hp["n_layers"]
        gemma = arch in ("gemma2", "gemma3")
        sliding = gguf_sliding_layers(model)
        cos, sin = rope_tables(d, hp["rope_theta"], hp["max_positions"], gguf_inv_freq(model))
        local_rope = None
        if arch == "gemma3":  # local layers: their own base, unscaled (llama.cpp's rope.freq_base_swa, else 10000)
            local_rope = rope_tables(d, float(hp.get("rope_theta_swa") or 10000.0), hp["max_positions"])
        scale = 0.0
        if gemma:  # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B models
            big = (arch == "gemma2" and n_layers == 46) or (arch == "gemma3" and n_layers == 62)
            scale = (hp["hidden_size"] / nh if big else d) ** -0.5

        def lin(name, permute=None):
            return linear_from_tensor(t[name], native=native, permute_heads=permute, arithmetic=arithmetic)

        def bias(name, permute=None):
            if name not in t:
                return None
            v = vector(t[name])
            return v if permute is None else v[unpermute_rows(v.numel(), permute)]

        def norm(name):
            return vector(t[name]) if name in t else None

        layers = []
        for i in range(hp["n_layers"]):
            p = f"blk.{i}."
            if p + "attn_qkv.weight" in t:  # Phi-3: q|k|v in one tensor, HF's row order
                qkv, bqkv = lin(p + "attn_qkv.weight"), bias(p + "attn_qkv.bias")
            else:
                bq, bk, bv = bias(p + "attn_q.bias", pq), bias(p + "attn_k.bias", pk), bias(p + "attn_v.bias")
                qkv = concat_linears([lin(p + "attn_q.weight", pq), lin(p + "attn_k.weight", pk),
                                      lin(p + "attn_v.weight")])
                bqkv = None if bq is None else torch.cat([bq, bk, bv])
            if p + "ffn_gate.weight" in t:
                gate_up = concat_linears([lin(p + "ffn_gate.weight"), lin(p + "ffn_up.weight")])
            else:  # Phi-3: ffn_up holds gate|up (gate first, llama.cpp's fused SwiGLU)
                gate_up = lin(p + "ffn_up.weight")
            layers.append(LlamaLayer(
                in_norm=vector(t[p + "attn_norm.weight"]),  # Gemma's (1 + w): the converter wrote 1 + w
                post_norm=vector(t[p + "ffn_norm.weight"]),
                attn_out_norm=norm(p + "post_attention_norm.weight"),  # Gemma
                mlp_out_norm=norm(p + "post_ffw_norm.weight"),
                act="gelu_tanh" if gemma else "silu",
                window=int(hp["sliding_window"]) if sliding[i] else 0,
                softcap=float(hp["attn_softcap"]) if gemma and hp.get("attn_softcap") else 0.0,
                scale=scale,
                rope=local_rope if sliding[i] and local_rope is not None else None,
                qkv=qkv,
                o=lin(p + "attn_output.weight"),
                gate_up=gate_up,
                down=lin(p + "ffn_down.weight"),
                bqkv=bqkv,
                bo=bias(p + "attn_output.bias"),
                q_norm=norm(p + "attn_q_norm.weight"),  # Qwen3
                k_norm=norm(p + "attn_k_norm.weight"),
                qk_eps=hp["eps"],
                heads=(nh, nkv, d),
            ))
            release_freed_memory()  # the layer's read buffers: back to the system, not kept by the allocator
        embed = lin("token_embd.weight")
        head = lin("output.weight") if "output.weight" in t else embed  # tied: the embedding, packed
        release_freed_memory()
        kinds = sorted(set().union(*(format_names(x) for layer in layers for x in (layer.qkv, layer.o, layer.gate_up,
                                                                            layer.down)), format_names(head)))
        if arithmetic == "q8":
            kernel = f"q8-{native.q8_dot}" if native is not None else "q8-reference"
        else:
            kernel = f"quant-{packed_kernel_name(native)}" if native is not None else "mkl (dequantised)"
        return cls(
            n_heads=hp["n_heads"], n_kv_heads=hp["n_kv_heads"], head_dim=hp["head_dim"],
            hidden_size=hp["hidden_size"], intermediate_size=hp["intermediate_size"], eps=hp["eps"],
            embed=embed, head=head, norm=vector(t["output_norm.weight"]), layers=layers, cos=cos, sin=sin,
            embed_scale=hp["hidden_size"] ** 0.5 if gemma else None,
            final_softcap=float(hp["final_softcap"]) if gemma and hp.get("final_softcap") else None,
            matmul_kernel=kernel if native is None and arithmetic != "q8" else f"{kernel} ({'/'.join(kinds)})",
            arithmetic=arithmetic,
        )

    def _linears(self) -> list:
        return [self.embed, self.head] + [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up,
                                                                           layer.down)]

    def matmul_weights(self) -> list:
        """The weights one forward multiplies, each once: every layer's qkv, o, gate|up and down, then the head
        (the embedding only where it is the head: a lookup is no product); a stacked weight as its parts."""
        found = {}
        for lin in [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]:
            for part in getattr(lin, "parts", [lin]):
                found[id(part)] = part
        return list(found.values())

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

    @property
    def kv_precision(self) -> str:
        """How the KV caches of :meth:`new_cache` store keys and values (:data:`~fastforward.model.kv.KV_PRECISIONS`):
        'fp32' as computed, 'fp16' rounded to half precision when written (fp32 activations only). Part of the
        model's arithmetic: set it before decoding, not between a sequence's forwards."""
        return self._kv_precision

    @kv_precision.setter
    def kv_precision(self, value: str) -> None:
        if value not in KV_PRECISIONS:
            raise UsageError(f"unknown KV cache precision '{value}' (use {', '.join(KV_PRECISIONS)})")
        if value == "fp16" and self.dtype != torch.float32:
            raise UsageError(f"an fp16 KV cache needs fp32 activations, not {self.dtype}")
        self._kv_precision = value

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the keys and values a new cache stores."""
        return torch.float16 if self._kv_precision == "fp16" else self.dtype

    def new_cache(self, capacity: int) -> StaticKVCache:
        return StaticKVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.kv_dtype)

    @torch.inference_mode()
    def forward(self, ids, positions, cache: StaticKVCache, tree_mask=None, hidden_layers=(), last_only=False,
                write_slots=None):
        """Logits (and requested hidden states) of q new tokens; see :class:`ForwardRequest` for the slots."""
        request = ForwardRequest(ids, positions, cache, tree_mask, write_slots)
        end = check_slots(request)  # the slots touched: [0, end)
        if self.ops is not None:
            return self._forward_native([request], hidden_layers, last_only)[0]
        q = ids.shape[0]
        start = cache.length
        slots = torch.arange(start, start + q) if write_slots is None else write_slots.to(torch.long)
        nh, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        x = self.embed.rows(ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        cos = self.cos[positions].unsqueeze(0)  # [1, q, d]
        sin = self.sin[positions].unsqueeze(0)
        windowed = any(layer.window for layer in self.layers)
        mask = None if q == 1 and tree_mask is None and not windowed else _full_mask(q, start, tree_mask)
        if mask is not None and mask.shape[1] < end:  # write slots past the mask's width: nobody sees them
            mask = torch.cat([mask, torch.zeros(q, end - mask.shape[1], dtype=torch.bool)], dim=1)
        options = self.has_options or not all(layer.plain_attention for layer in self.layers)
        # A forward whose every row's logits are read (a decoding step: AR's one row, a draft tree's rows) attends
        # row by row, so that each row is bitwise what it gives alone; a prefill chunk (last_only) may batch.
        every_row_alone = options or not last_only
        key_pos = None
        if every_row_alone:  # each key slot's position: the committed ones' own, this forward's from ``positions``
            key_pos = torch.arange(end)
            key_pos[slots] = positions.to(torch.long)
            written = torch.zeros(end, dtype=torch.bool)
            written[:start] = True
            written[slots] = True
            visible = torch.ones(q, end, dtype=torch.bool) if mask is None else mask
            windows = [layer.window for layer in self.layers if layer.window]
            if windows and bool((visible & ~written).any()) and \
                    int(positions.max()) - start >= min(windows):
                raise UsageError("a sliding window over slots written by earlier forwards (a slot pool wider than "
                                 "the window) is not supported")
        wanted = set(hidden_layers)
        hidden = {}
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.in_norm, self.eps)
            qkv = layer.project_qkv(h)
            if layer.rope is not None:
                qh, kh, vh = rotary_heads(qkv, nh, nkv, d, layer.rope[0][positions].unsqueeze(0),
                                          layer.rope[1][positions].unsqueeze(0))
            else:
                qh, kh, vh = rotary_heads(qkv, nh, nkv, d, cos, sin)
            # [nkv, q, d] into the write slots; an fp16 cache stores them rounded to nearest even
            cache.k[i][:, slots] = kh.to(cache.k.dtype)
            cache.v[i][:, slots] = vh.to(cache.v.dtype)
            keys, values = cache.k[i, :, :end], cache.v[i, :, :end]
            if keys.dtype != qh.dtype:  # read back exactly, attention in the activations' dtype
                keys, values = keys.to(qh.dtype), values.to(qh.dtype)
            if every_row_alone or not layer.plain_attention:
                o = rowwise_attention(qh, keys, values, mask, positions.to(torch.long), key_pos, layer)
            else:
                o = F.scaled_dot_product_attention(
                    qh.unsqueeze(0),
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    attn_mask=mask,
                    enable_gqa=nh != nkv,
                )[0]
            o = layer.o(o.transpose(0, 1).reshape(q, nh * d))
            if layer.bo is not None:
                o = o + layer.bo
            if layer.attn_out_norm is not None:
                o = rms_norm(o, layer.attn_out_norm, self.eps)
            x = x + o
            h = rms_norm(x, layer.post_norm, self.eps)
            gate, up = layer.gate_up(h).split(self.intermediate_size, dim=-1)
            act = F.silu(gate) if layer.act == "silu" else F.gelu(gate, approximate="tanh")
            m = layer.down(act * up)
            if layer.mlp_out_norm is not None:
                m = rms_norm(m, layer.mlp_out_norm, self.eps)
            x = x + m
            if i in wanted:
                hidden[i] = x.clone()
        if -1 in wanted:  # the final normed states of every new token, like the other layers' (and HF's)
            x = rms_norm(x, self.norm, self.eps)
            hidden[-1] = x.clone()
            if last_only:
                x = x[-1:]
        else:
            if last_only:
                x = x[-1:]
            x = rms_norm(x, self.norm, self.eps)
        logits = self.head(x)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return ForwardOutput(logits, hidden)

    def _packed_stack(self):
        """The native ``PackedStack`` of every layer when each runs as one ``packed_layer`` call (packed weights,
        Llama-shaped), else None. Built once and rebuilt when the ops, the final norm or a layer changes (a layer
        replaced, or any layer's field set: ``_layer_edits``). Checked every forward: a few identity tests (comparing
        every layer's every linear cost ~57 µs a forward on the default model right after its weights streamed)."""
        key, layers = (self.ops, self.norm, _layer_edits), tuple(self.layers)
        cached = self.__dict__.get("_stack")
        if cached is not None and cached[0][0] is key[0] and cached[0][1] is key[1] and cached[0][2] == key[2] and \
                len(cached[1]) == len(layers) and all(map(operator.is_, cached[1], layers)):
            return cached[2]
        packs = [layer.packed_weights() for layer in self.layers]
        stack = None
        if packs and all(p is not None for p in packs) and hasattr(self.ops, "PackedStack"):
            options = [layer.attention_options() for layer in self.layers]
            stack = self.ops.PackedStack(
                [w for p in packs for w in p[0::2]], [f for p in packs for f in p[1::2]],
                [layer.post_norm for layer in self.layers],
                [layer.in_norm for layer in self.layers[1:]] + [self.norm],
                [o["window"] for o in options], [o["softcap"] for o in options], [o["scale"] for o in options],
                self.eps, self.n_heads, self.n_kv_heads)
        self.__dict__["_stack"] = (key, layers, stack)
        return stack

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
            return [self.forward(r.ids, r.positions, r.cache, r.tree_mask, hidden_layers, write_slots=r.write_slots)
                    for r in requests]
        for r in requests:
            check_slots(r)
        return self._forward_native(requests, hidden_layers, last_only=False)

    def _forward_native(self, requests: list[ForwardRequest], hidden_layers, last_only):
        """The forward in native layer ops: per layer RMSNorm (fused with the residual add), qkv, attention (RoPE, KV
        write, tree attention; per sequence), o, RMSNorm, gate|up, SiLU*mul, down. Rows of all sequences are
        stacked ([T, hidden], T = total new tokens) for the matmuls and the row-wise ops. One sequence over packed
        layers runs each layer as one native call (``ops.packed_layer``: the same ops in the same order)."""
        ops, eps = self.ops, self.eps
        bounds, row = [], 0
        for r in requests:
            bounds.append((row, row + r.size))
            row += r.size
        starts = [r.cache.length for r in requests]
        # (each tensor call costs ~10 us right after a forward streamed the weights, even one that changes nothing)
        positions = [r.positions if r.positions.dtype == torch.long else r.positions.to(torch.long) for r in requests]
        visible = [None if r.tree_mask is None else r.tree_mask.to(torch.bool).contiguous() for r in requests]
        wanted = set(hidden_layers)
        hidden = {}
        ids = requests[0].ids if len(requests) == 1 else torch.cat([r.ids for r in requests])
        x = self.embed.rows(ids)  # [T, hidden], the residual stream (updated in place by add_rms_norm)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        h = ops.rms_norm(x, self.layers[0].in_norm, eps)
        fused = len(requests) == 1 and hasattr(ops, "packed_layer")
        # Several sequences: their attention in one native call per layer (row starts, k and v caches, write slots).
        many = ([a for a, _ in bounds] + [row], [r.cache.k for r in requests], [r.cache.v for r in requests],
                [r.write_slots for r in requests]) if len(requests) > 1 and hasattr(ops, "attention_many") else None
        stack = self._packed_stack() if fused else None
        if stack is not None:  # every layer in one native call: the same packed_layer calls as the loop below
            r = requests[0]
            taps = sorted(i for i in wanted if 0 <= i < len(self.layers)) if wanted else []
            h, copies = stack.run(x, h, self.cos, self.sin, positions[0], r.cache.k, r.cache.v, starts[0], visible[0],
                                  r.write_slots, taps)
            if taps:
                hidden.update(zip(taps, copies, strict=True))
        for i, layer in enumerate(self.layers if stack is None else ()):
            next_norm = self.norm if i + 1 == len(self.layers) else self.layers[i + 1].in_norm
            packed = layer.packed_weights() if fused else None
            options = {} if layer.plain_attention else layer.attention_options()
            cos, sin = layer.rope if layer.rope is not None else (self.cos, self.sin)
            if packed is not None:  # the whole layer in one native call, bitwise the same as the calls below
                r = requests[0]
                h = ops.packed_layer(x, h, *packed, layer.post_norm, next_norm, eps, cos, sin, positions[0],
                                     r.cache.k, r.cache.v, i, starts[0], visible[0], self.n_heads, self.n_kv_heads,
                                     r.write_slots, **options)
            else:
                qkv = layer.project_qkv(h, ops)  # [T, (nh + 2 nkv) d]
                if many is not None:  # every sequence over its own cache, in one call: [T, nh d]
                    attn = ops.attention_many(qkv, many[0], cos, sin, positions, many[1], many[2], i,
                                              starts, visible, self.n_heads, self.n_kv_heads, many[3], **options)
                else:
                    parts = [ops.attention(qkv[a:b], cos, sin, positions[j], requests[j].cache.k[i],
                                           requests[j].cache.v[i], starts[j], visible[j], self.n_heads,
                                           self.n_kv_heads, requests[j].write_slots, **options)
                             for j, (a, b) in enumerate(bounds)]  # each [q_j, nh d]: every sequence over its own cache
                    attn = parts[0] if len(parts) == 1 else torch.cat(parts)
                o = layer.attention_output(attn)  # [T, hidden]
                if layer.attn_out_norm is not None:  # Gemma: the attention output normed before the residual add
                    o = ops.rms_norm(o, layer.attn_out_norm, eps)
                h = ops.add_rms_norm(x, o, layer.post_norm, eps)  # x += attention output
                down = layer.mlp(h, ops)  # [T, hidden]
                if layer.mlp_out_norm is not None:
                    down = ops.rms_norm(down, layer.mlp_out_norm, eps)
                h = ops.add_rms_norm(x, down, next_norm, eps)  # x += mlp output
            if i in wanted:
                hidden[i] = x.clone()
        if -1 in wanted:  # the final normed states of every new token, like the other layers' (and HF's)
            hidden[-1] = h.clone()
        if last_only:
            h = h[-1:]
        logits = self.head(h.contiguous())
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if len(requests) == 1:
            return [ForwardOutput(logits, hidden)]
        return [ForwardOutput(logits[a:b], {k: v[a:b] for k, v in hidden.items()}) for a, b in bounds]
