"""The row-wise math of a Llama decoder layer in plain torch ops, written once: RMSNorm, the rotary embedding (its
tables and the rotation), the split of a fused q|k|v projection into rotated heads, and attention with the native
kernel's options (sliding window, logit soft-capping, query scale). The lean forward's torch path
(:mod:`fastforward.model.lean`) and every drafter (:mod:`fastforward.drafters.pieces`) compute with these, so the
same inputs give the same bits in both."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (HF's rotate-half convention); ``cos``/``sin`` broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The default rotary embedding's fp32 inverse frequencies ``[head_dim / 2]``, as transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(head_dim: int, theta: float, positions: torch.Tensor,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., head_dim]`` of the rotary embedding at ``positions``, computed as transformers'
    ``LlamaRotaryEmbedding`` does (fp32 inverse frequencies times positions, duplicated halves): the default
    (unscaled) frequencies, or ``inv_freq`` when given (a scaled rope's)."""
    inv = rope_inv_freq(head_dim, theta, positions.device) if inv_freq is None else inv_freq.to(positions.device)
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotary_heads(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection ``[r, (n_heads + 2 n_kv_heads) head_dim]`` -> q ``[n_heads, r, head_dim]`` and k, v
    ``[n_kv_heads, r, head_dim]``, q and k rotated by ``cos``/``sin`` (broadcast over heads)."""
    r = qkv.shape[0]
    nh, nkv, hd = n_heads, n_kv_heads, head_dim
    q = rotate(qkv[:, : nh * hd].view(r, nh, hd).transpose(0, 1), cos, sin)
    k = rotate(qkv[:, nh * hd : (nh + nkv) * hd].view(r, nkv, hd).transpose(0, 1), cos, sin)
    v = qkv[:, (nh + nkv) * hd :].view(r, nkv, hd).transpose(0, 1)
    return q, k, v


def window_mask(q_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool ``[q, n]``: query i may see key j under a sliding window of ``window`` positions (0 = no window: all
    True). transformers' convention (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``),
    as Mistral, Phi-3 and Gemma 2/3's local layers apply it: a key at position k is seen from position p only if
    ``p - k < window``. The native kernel's ``window`` is the same rule."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if window == 0:
        return torch.ones(q_positions.shape[0], key_positions.shape[0], dtype=torch.bool)
    return (q_positions.view(-1, 1) - key_positions.view(1, -1)) < window


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float = 0.0,
           softcap: float = 0.0) -> torch.Tensor:
    """Attention of q ``[n_heads, r, d]`` over k, v ``[n_kv_heads, n, d]`` (GQA: query head h reads kv head
    ``h // (n_heads // n_kv_heads)``) under a bool ``mask`` ``[r, n]`` (None: every key), in q's dtype: the torch
    counterpart of the native kernel's options. ``scale`` multiplies the scores (0: ``1/sqrt(d)``); ``softcap`` > 0
    caps them to ``softcap * tanh(s / softcap)`` after the scale, before the softmax (Gemma 2). A row that sees no
    key gives zeros. Without softcap this is exactly the lean forward's ``F.scaled_dot_product_attention`` call."""
    if not (math.isfinite(scale) and scale >= 0.0):
        raise ValueError(f"scale must be finite and >= 0, got {scale}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be finite and >= 0, got {softcap}")
    nh, nkv = q.shape[0], k.shape[0]
    if softcap == 0.0:
        return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                              scale=scale or None, enable_gqa=nh != nkv)[0]
    if nh != nkv:
        k, v = k.repeat_interleave(nh // nkv, dim=0), v.repeat_interleave(nh // nkv, dim=0)
    s = (q @ k.transpose(-1, -2)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = torch.where(mask.any(-1, keepdim=True), p, torch.zeros((), dtype=p.dtype))
    return p @ v
