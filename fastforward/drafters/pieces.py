"""The pieces every trained drafter (EAGLE-3 :mod:`.eagle`, FastEagle :mod:`.fasteagle`, Falcon :mod:`.falcon`) is
built from, for training and decoding alike:

* **the target** a drafter belongs to: its fingerprint, its embedding and head rows, the decoder-layer shape a
  drafter config copies, and the one-line refusal of a drafter made for another target;
* **configs**: what every drafter config shares (:class:`DrafterConfig`), and the ``config.json`` of the drafters
  saved in fastforward's own headless layout (:class:`HeadlessConfig`);
* **modules** (training): RMSNorm, the attention and MLP blocks, a pre-norm Llama decoder layer, and
  :class:`DrafterModule` -- the frozen head and the draft vocabulary every drafter holds;
* **decode time**: the drafter's weights as the lean forward's linears (:func:`decode_linear_factory`), a decoder
  layer as the target's :class:`~fastforward.model.lean.LlamaLayer`, and the torch-op halves of a layer over rows.

RMSNorm and RoPE are the lean forward's own (:mod:`fastforward.model.layer_math`).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..model.layer_math import rms_norm, rope_cos_sin, rotary_heads, rotate
from ..model.lean import LlamaLayer
from .vocab import DraftVocab

__all__ = [  # with the lean forward's row-wise math, re-exported: a drafter imports its pieces from here
    "rms_norm", "rope_cos_sin", "rotary_heads", "rotate",
]

# ------------------------------------------------------------------------------------------------------------------
# The target
# ------------------------------------------------------------------------------------------------------------------


def target_fingerprint(target) -> str:
    """A short hash of the target's shape and a few embedding rows: equal for the same weights however they were
    loaded (GGUF, converted folder), different for another model."""
    cfg = target.config
    rows = target_embedding_rows(target, torch.arange(min(16, target.vocab_size))).to(torch.float16)
    h = hashlib.sha256(f"{cfg.num_hidden_layers}:{cfg.hidden_size}:{target.vocab_size}".encode())
    h.update(rows.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def target_meta(target, kind: str) -> dict:
    """The ``fastforward`` section of a new drafter's config: its kind and the target it is made for."""
    return {"kind": kind, "target": target.name, "target_fingerprint": target_fingerprint(target),
            "target_layers": target.config.num_hidden_layers}


def target_embedding_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """fp32 embedding rows of the target (its input embedding, whatever the backend stores)."""
    embed = getattr(target.backend, "embed", None)
    if embed is not None:
        return embed.rows(ids).float()
    return target.hf_model.get_input_embeddings()(ids).float().detach()


def target_final_norm(target) -> torch.Tensor | None:
    """The weight of the target's final norm (whatever the backend stores), or None where it has none to read."""
    norm = getattr(target.backend, "norm", None)
    if norm is not None:
        return norm.float()
    base = getattr(target.hf_model, "model", None)
    weight = getattr(getattr(base, "norm", None), "weight", None)
    return None if weight is None else weight.detach().float()


def target_head_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows of the target's LM head for the token ids ``ids`` (the frozen draft head)."""
    head = getattr(target.backend, "head", None)
    if head is not None:
        if hasattr(head, "rows"):
            return head.rows(ids).float()
        return head.dense()[ids].float()
    return target.hf_model.get_output_embeddings().weight[ids].float().detach()


LAYER_SHAPE = {"hidden_size": int, "intermediate_size": int, "num_attention_heads": int, "num_key_value_heads": int,
               "head_dim": int, "rms_norm_eps": float, "rope_theta": float, "vocab_size": int,
               "target_hidden_size": int}


def rope_theta_of(config) -> float:
    """The RoPE base of a target config: a GGUF config's ``rope_theta``, or an HF config's, which transformers now keeps
    in ``rope_parameters`` (per layer type for Gemma 3: the full-attention layers'); 10,000 when neither says."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict):
        params = params.get("full_attention", params)
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", None) or 10000.0)


def target_layer_shape(target) -> dict:
    """The fields of a drafter config that copy the target's decoder-layer shape (``LAYER_SHAPE``)."""
    c = target.config
    heads = c.num_attention_heads
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads": heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads, "rms_norm_eps": float(c.rms_norm_eps),
            "rope_theta": rope_theta_of(c), "vocab_size": target.vocab_size,
            "target_hidden_size": c.hidden_size}


def read_layer_shape(raw: dict) -> dict:
    """``LAYER_SHAPE``'s fields from a drafter's config.json (KeyError / TypeError / ValueError when malformed)."""
    return {name: kind(raw[name]) for name, kind in LAYER_SHAPE.items()}


def architecture_of(raw: dict) -> str:
    """The first entry of a config's ``architectures`` list ("" when it is missing or not a list of names)."""
    archs = raw.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""


def check_drafter_target(cfg, target) -> None:
    """Refuse, in one line, a drafter config (``fastforward`` section, ``vocab_size``, ``target_hidden_size``,
    ``aux_layers``) made for another target than ``target``."""
    fp = cfg.fastforward.get("target_fingerprint")
    if fp and fp != target_fingerprint(target):
        raise UsageError(f"this drafter was trained for '{cfg.fastforward.get('target')}', not for "
                         f"'{target.name}' (target fingerprints differ)")
    c = target.config
    if cfg.vocab_size != target.vocab_size or cfg.target_hidden_size != c.hidden_size:
        raise UsageError(f"this drafter expects a target with vocab {cfg.vocab_size} and hidden size "
                         f"{cfg.target_hidden_size}; '{target.name}' has {target.vocab_size} and {c.hidden_size}")
    if cfg.hidden_size != c.hidden_size:  # the drafter reads the target's token embeddings
        raise UsageError(f"this drafter has hidden size {cfg.hidden_size}; it reads the token embeddings of "
                         f"'{target.name}', whose hidden size is {c.hidden_size}")
    if cfg.aux_layers and max(cfg.aux_layers) > c.num_hidden_layers:
        raise UsageError(f"the drafter taps layer {max(cfg.aux_layers)}; '{target.name}' has "
                         f"{c.num_hidden_layers} layers")


# ------------------------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class DrafterConfig:
    """The fields every drafter config starts with -- the target's decoder-layer shape (``LAYER_SHAPE``) and the draft
    vocabulary's size -- and what every config does alike. A subclass (a dataclass) adds its own fields, its
    ``aux_layers`` and its ``fastforward`` section."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int

    def check_target(self, target) -> None:
        """Refuse a drafter made for another target (one line)."""
        check_drafter_target(self, target)


@dataclass
class HeadlessConfig(DrafterConfig):
    """The ``config.json`` of a drafter in fastforward's own layout (saved without its head): ``architectures``
    naming it, then the dataclass's fields. A subclass names ``ARCHITECTURE`` and ``NAME`` and reads its own fields
    in :meth:`fields_of`."""

    ARCHITECTURE: ClassVar[str]
    NAME: ClassVar[str]  # in refusals: "not a {NAME} drafter", "malformed {NAME} config.json"

    def to_json(self) -> dict:
        out = {"architectures": [self.ARCHITECTURE]}
        out.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()})
        return out

    @classmethod
    def from_json(cls, raw: dict):
        if architecture_of(raw) != cls.ARCHITECTURE:
            raise UsageError(f"not a {cls.NAME} drafter: architectures is {raw.get('architectures')!r}, expected "
                             f"[{cls.ARCHITECTURE!r}]")
        cls.check_raw(raw)
        try:
            return cls(**read_layer_shape(raw), draft_vocab_size=int(raw["draft_vocab_size"]), **cls.fields_of(raw),
                       fastforward=dict(raw.get("fastforward") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed {cls.NAME} config.json: {exc!r}") from None

    @classmethod
    def check_raw(cls, raw: dict) -> None:
        """Refusals of a config.json beyond its fields (none by default)."""

    @classmethod
    def fields_of(cls, raw: dict) -> dict:
        """The subclass's own fields from a config.json (KeyError / TypeError / ValueError when malformed)."""
        return {}


# ------------------------------------------------------------------------------------------------------------------
# Modules (training)
# ------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """The q, k, v and o projections of a target-shaped attention block over ``d_in``-wide rows."""

    def __init__(self, cfg, d_in: int):
        super().__init__()
        hd = cfg.head_dim
        self.q_proj = nn.Linear(d_in, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d_in, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d_in, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Llama decoder layer (the target's shape), causal over the positions of a batch of sequences."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] at the positions of ``cos``/``sin`` [T, hd] -> [B, T, d]; causal, or ``mask`` (True = may attend,
        broadcastable to [B, 1, T, T]) when given (Falcon's relaxed-causal block mask)."""
        cfg, a = self.cfg, self.self_attn
        B, T, _ = x.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        y = self.input_layernorm(x)
        q = rotate(a.q_proj(y).view(B, T, nh, hd).transpose(1, 2), cos, sin)  # [B, nh, T, hd]
        k = rotate(a.k_proj(y).view(B, T, nkv, hd).transpose(1, 2), cos, sin)  # [B, nkv, T, hd]
        v = a.v_proj(y).view(B, T, nkv, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=nh != nkv)  # [B, nh, T, hd]
        h = x + a.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))
        return h + self.mlp(self.post_attention_layernorm(h))


def init_layer(attn: Attention, mlp: MLP, zero_down: bool = True) -> None:
    """A fresh layer's start (inside ``torch.no_grad()``): its input projections random (std 0.02, from the seeded
    generator, in this order), its attention output at zero and, with ``zero_down``, its MLP output too -- so the
    untrained layer passes its residual input through."""
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        nn.init.normal_(lin.weight, std=0.02)
    attn.o_proj.weight.zero_()
    if zero_down:
        mlp.down_proj.weight.zero_()
    else:
        nn.init.normal_(mlp.down_proj.weight, std=0.02)


def pass_last_tap(fc: nn.Linear, d: int, d_target: int) -> None:
    """A fresh fusion ``fc`` (taps -> d; inside ``torch.no_grad()``) that passes the last tap through when the widths
    match, else random (std 0.02)."""
    fc.weight.zero_()
    if d == d_target:
        fc.weight[:, -d_target:] = torch.eye(d)
    else:
        nn.init.normal_(fc.weight, std=0.02)


class DrafterModule(nn.Module):
    """What every trainable drafter holds besides its layers: its config, the frozen head (the target's head rows of
    the draft vocabulary) and the draft vocabulary's maps as buffers ``d2t`` / ``t2d``. A subclass builds its layers
    after ``super().__init__`` and calls :meth:`add_head` last: modules draw their random start in the order they are
    built."""

    def __init__(self, cfg, vocab: DraftVocab):
        super().__init__()
        if vocab.size != cfg.draft_vocab_size or vocab.vocab_size != cfg.vocab_size:
            raise UsageError("the draft vocabulary does not match the drafter's config")
        self.cfg = cfg

    def add_head(self, vocab: DraftVocab) -> None:
        self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # a frozen slice of the target's head
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    def load_head(self, target) -> None:
        """The head's rows copied from the target's head."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head_rows(target, self.vocab.target_ids))


# ------------------------------------------------------------------------------------------------------------------
# Decode time
# ------------------------------------------------------------------------------------------------------------------

# ``weights=`` choices of a drafter at decode time: packed blocks the native kernels multiply, or fp32.
DRAFTER_WEIGHTS = ("auto", "q8_0", "q4_0", "fp32")
AUTO_DRAFTER_FORMAT = "Q4_0"  # what ``auto`` packs when the native kernels build (docs/drafters.md: as accepted as
# Q8_0, and a drafter call reads half the bytes)
# With AMX, calls of more rows than this take the bf16 tile kernel instead of the integer one (the target's profile on
# the AMX Xeon: q8 on VNNI 9.1 ms against 14.5 for the tiles at 4 rows, 13.4 against 12.6 at 8; docs/drafters.md).
AMX_FROM_ROWS = 9


class DrafterLinear:
    """A drafter weight packed (``Q4_0`` or ``Q8_0`` blocks), multiplied by the native **integer** kernel: each call's
    activation rows rounded to 8-bit blocks, integer block dots (the ``q8`` arithmetic, on VNNI where the CPU has it)
    -- about four times faster than fp32 activations times the decoded weights at a drafter's 1-16 rows, and as good
    a drafter: it only proposes, and the target's verification decides every token. With AMX the weight is also kept
    in the bf16 tile kernel's layout, which calls of ``AMX_FROM_ROWS`` rows or more take.

    :meth:`for_rows` names the :class:`~fastforward.linear.PackedLinear` a call of that many rows runs, so that a
    layer of such weights can run as one native call (``ops.packed_layer``)."""

    def __init__(self, data: torch.Tensor, fmt: int, in_features: int, *, native):
        from ..linear import PackedLinear, amx_in_use

        self.few = PackedLinear(data.clone(), fmt, in_features, native=native, owned=True, arithmetic="q8")
        self.many = None
        if amx_in_use(native) and data.shape[0] % 16 == 0:
            many = PackedLinear(data, fmt, in_features, native=native, owned=True)
            self.many = many if many.kernel_fmt != fmt else None
        self.out_features, self.in_features = self.few.out_features, in_features
        self.format_name = self.few.format_name

    def for_rows(self, rows: int):
        return self.few if self.many is None or rows < AMX_FROM_ROWS else self.many

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.for_rows(x.shape[0])(x)

    def dense(self) -> torch.Tensor:
        return self.few.dense()

    @property
    def nbytes(self) -> int:
        return self.few.nbytes + (0 if self.many is None else self.many.nbytes)


def decode_linear_factory(weights: str):
    """``linear(w [out, in]) -> callable``: a drafter weight as the lean forward's linear at decode time -- packed
    ``Q8_0`` or ``Q4_0`` blocks through the native integer kernel (``auto``: ``AUTO_DRAFTER_FORMAT`` when the kernels
    build; :class:`DrafterLinear`) or fp32 (``fp32``: the drafter's own numbers, what the tests compare with its
    training module). A drafter only proposes, so this rounding never changes the output."""
    from ..kernels import load_native
    from ..linear import FORMAT_IDS, DenseLinear, quantize

    if weights not in DRAFTER_WEIGHTS:
        raise UsageError(f"drafter weights must be one of {', '.join(DRAFTER_WEIGHTS)}, got {weights!r}")
    native = None
    try:
        native = load_native() if weights != "fp32" else None
    except Exception:  # noqa: BLE001 - no compiler: the plain path
        native = None
    if native is not None and not hasattr(native, "q8_pack"):
        native = None  # a native module without the integer kernel: the plain path
    if weights != "auto" and weights != "fp32" and native is None:
        raise UsageError(f"drafter weights {weights} need the native kernels, which did not build on this machine")
    packed = AUTO_DRAFTER_FORMAT if weights == "auto" else weights.upper()

    def linear(w: torch.Tensor):
        w = w.detach().float().contiguous()
        if native is not None and w.shape[1] % 32 == 0:
            return DrafterLinear(quantize(w, packed), FORMAT_IDS[packed], w.shape[1], native=native)
        return DenseLinear(w)

    linear.layer_ops = native if native is not None and hasattr(native, "attention") else None
    return linear


def decode_layer(linear, layer) -> LlamaLayer:
    """A drafter's decoder layer (``input_layernorm``, ``post_attention_layernorm``, ``self_attn``, ``mlp``) as the
    target's layer pieces: its weights as ``linear``s, fused q|k|v and gate|up."""
    a, m = layer.self_attn, layer.mlp
    return LlamaLayer(in_norm=layer.input_layernorm.weight.detach().float(),
                      post_norm=layer.post_attention_layernorm.weight.detach().float(),
                      qkv=linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                      o=linear(a.o_proj.weight),
                      gate_up=linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                      down=linear(m.down_proj.weight))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of rows' queries ``q`` [nh, r, hd] over cached keys and values ``k``, ``v`` [nkv, n, hd] where
    ``mask`` [r, n] allows (grouped heads when nkv < nh) -> [nh, r, hd]."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                          enable_gqa=q.shape[0] != k.shape[0])[0]


def residual_mlp(layer: LlamaLayer, residual: torch.Tensor, attn: torch.Tensor, eps: float) -> torch.Tensor:
    """The second half of a decoder layer in torch ops: ``h = residual + o(attn)`` (``attn`` [nh, r, hd]), then
    ``h + down(silu(gate) * up)`` over ``post_norm(h)``."""
    h = residual + layer.o(attn.transpose(0, 1).reshape(residual.shape[0], -1).contiguous())
    gate, up = layer.gate_up(rms_norm(h, layer.post_norm, eps)).chunk(2, dim=-1)
    return h + layer.down((F.silu(gate) * up).contiguous())


def top_k_rows(x: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` [r, V] and their columns, best first (``torch.topk``'s answer up
    to the order of equal values). Found through the blocks of ``block`` columns with the ``k`` largest maxima --
    every one of the k largest values lies in such a block -- so that only ``k * block`` columns are ranked: over a
    draft vocabulary of 8,192-16,384 columns a third of the time of ``topk`` over whole rows (one row of 8,192 or
    fewer: ``topk``, which is faster there)."""
    r, V = x.shape
    if V % block or V // block <= k or r * V <= 8192:
        best = x.topk(k, dim=-1)
        return best.values, best.indices
    blocks = x.view(r, V // block, block).amax(-1).topk(k, dim=-1).indices  # [r, k]
    cols = (blocks.unsqueeze(-1) * block + torch.arange(block)).view(r, k * block)
    best = x.gather(1, cols).topk(k, dim=-1)
    return best.values, cols.gather(1, best.indices)


class DrafterRunner:
    """What the decode-time runners share: the drafter's config and target, its head as a linear, its draft ->
    target id map, and the torch-op steps of a decoder layer over rows (the native layer ops are the runners' own).
    A subclass calls :meth:`setup` first and builds its other weights with the ``linear`` it returns."""

    def setup(self, drafter: DrafterModule, target, weights: str, head_rows=None):
        """``head_rows``: None (the whole head), or (the draft ids whose head rows are kept, ascending; the draft ->
        target offsets over them) from :meth:`~fastforward.drafters.vocab.DraftVocab.keep_most_frequent`: the
        runner's draft ids are then indices into the kept rows."""
        self.cfg, self.target = drafter.cfg, target
        linear = decode_linear_factory(weights)
        if head_rows is None:
            self.head = linear(drafter.lm_head.weight)
            self.d2t = drafter.d2t.clone()
        else:
            keep, d2t = head_rows
            self.head = linear(drafter.lm_head.weight.detach()[keep].contiguous())
            self.d2t = d2t.clone()
        self.eps = drafter.cfg.rms_norm_eps
        # the native top-k of a head's log-softmax (one pass over each row, no row written), where it built
        self._log_softmax_topk = getattr(linear.layer_ops, "log_softmax_topk", None)
        return linear

    def top_of_logits(self, logits: torch.Tensor, k: int, log: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens of each row of the head's ``logits`` [r, V]: their log-probabilities
        (``log``) or probabilities, and draft ids [r, k], best first -- natively without the rows' softmax where the
        kernels built, else :func:`top_k_rows` of it."""
        if self._log_softmax_topk is not None and logits.dtype == torch.float32 and k <= min(64, logits.shape[-1]):
            values, ids = self._log_softmax_topk(logits, k)
            return (values if log else values.exp()), ids
        return top_k_rows(logits.log_softmax(-1) if log else logits.softmax(-1), k)

    def fresh(self, capacity: int):
        """A runner sharing these weights with an empty cache of its own (one per sequence)."""
        other = copy.copy(self)
        other.empty(capacity)
        return other

    def empty(self, capacity: int) -> None:
        """Drop every row: an empty cache with room for ``capacity`` rows (the subclass's own)."""
        raise NotImplementedError

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's (fp32) embedding rows of ``tokens``."""
        return target_embedding_rows(self.target, tokens)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def rope(self, positions: int) -> None:
        """RoPE tables ``self.cos``, ``self.sin`` for positions 0..positions-1."""
        self.cos, self.sin = rope_cos_sin(self.cfg.head_dim, self.cfg.rope_theta, torch.arange(positions))

    def heads(self, layer: LlamaLayer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rows' normed inputs [r, d_in] -> q [nh, r, hd], k and v [nkv, r, hd] through ``layer``'s fused q|k|v,
        rotated by ``cos``/``sin`` [r, hd]."""
        cfg = self.cfg
        return rotary_heads(layer.qkv(normed.contiguous()), cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cos, sin)

    def finish(self, layer: LlamaLayer, residual: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The rest of ``layer`` for rows with queries ``q`` and residual input ``residual`` [r, d]: attention over
        ``keys``/``values`` [nkv, n, hd] where ``mask`` [r, n] allows, the o projection, the MLP."""
        return residual_mlp(layer, residual, attend(q, keys, values, mask), self.eps)

    def native_layer(self, layer: LlamaLayer, x: torch.Tensor, normed: torch.Tensor, next_norm: torch.Tensor,
                     positions: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, index: int, start: int,
                     visible: torch.Tensor | None, write: torch.Tensor | None, last_only: bool = False) -> torch.Tensor:
        """One decoder layer through the native layer ops (``self.ops``) over r rows: ``x`` [r, d] is the residual
        stream (updated in place), ``normed`` [r, d_in] the layer's normed input, at ``positions`` [r] (int64). The
        rows' keys and values go to cache slots ``write`` (None: ``start ..``) of layer ``index`` of ``k_all`` /
        ``v_all`` [layers, nkv, capacity, hd]; each row attends to the first ``start`` slots and to the slots after
        them that ``visible`` [r, W] names (None: causal). Returns ``next_norm`` of ``x`` after the layer.

        Packed weights run the whole layer as one native call (``ops.packed_layer``). With ``last_only`` only the
        last row goes on past the attention (every row's keys and values are still written): x's other rows are
        left as they were, and the result is that row's alone [1, d] -- what committing rows needs when only the
        last one's output is read."""
        ops, cfg, eps = self.ops, self.cfg, self.eps
        rows = x.shape[0]
        packed = None if last_only and rows > 1 else self._packed_layer(layer, rows)
        if packed is not None:
            return ops.packed_layer(x, normed, *packed, layer.post_norm, next_norm, eps, self.cos, self.sin, positions,
                                    k_all, v_all, index, start, visible, cfg.num_attention_heads,
                                    cfg.num_key_value_heads, write)
        attn = ops.attention(layer.qkv(normed), self.cos, self.sin, positions, k_all[index], v_all[index], start,
                             visible, cfg.num_attention_heads, cfg.num_key_value_heads, write)
        if last_only:
            x, attn = x[-1:], attn[-1:]
        h = ops.add_rms_norm(x, layer.o(attn), layer.post_norm, eps)
        return ops.add_rms_norm(x, layer.mlp(h, ops), next_norm, eps)

    def _packed_layer(self, layer: LlamaLayer, rows: int) -> tuple | None:
        """(data, format) of ``layer``'s qkv, o, gate|up and down for a call of ``rows`` rows, flattened, when all
        four are :class:`DrafterLinear` weights ``ops.packed_layer`` can run; else None (cached per layer and
        kernel)."""
        linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if not all(isinstance(lin, DrafterLinear) for lin in linears):
            return None
        parts = [lin.for_rows(rows) for lin in linears]
        key = tuple(id(p) for p in parts)
        cache = layer.__dict__.setdefault("_drafter_packed", {})
        if key not in cache:
            ok = hasattr(self.ops, "packed_layer") and all(p.data is not None and not p.padded for p in parts)
            cache[key] = tuple(v for p in parts for v in (p.data, p.kernel_fmt)) if ok else None
        return cache[key]
