"""The row-wise math of a Llama decoder layer in plain torch ops, written once: RMSNorm, the rotary embedding (its
tables and the rotation) and the split of a fused q|k|v projection into rotated heads. The lean forward's torch path
(:mod:`fastforward.model.lean`) and every drafter (:mod:`fastforward.drafters.pieces`) compute with these, so the
same inputs give the same bits in both."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (HF's rotate-half convention); ``cos``/``sin`` broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_cos_sin(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., head_dim]`` of the default (unscaled) rotary embedding at ``positions``, computed as
    transformers' ``LlamaRotaryEmbedding`` does (fp32 inverse frequencies times positions, duplicated halves)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
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
