"""Falcon: a semi-autoregressive drafter -- one pass drafts a block of k tokens. Training
(:mod:`fastforward.train.falcon`, CSGD) and inference (:mod:`fastforward.proposers.falcon`, the k-block tree) both
import this module.

Source: Gao et al., *Falcon: Faster and Parallel Inference of Large Language Models through Enhanced
Semi-Autoregressive Drafting and Custom-Designed Decoding Tree* (AAAI 2025). Its public code does not run as released;
the paper is the specification and the code a hint (``docs/falcon.md`` lists where we follow which).

Shapes (the default model: d = 576, 9 query / 3 KV heads of 64, MLP 1536; k = ``block_size``):

* row j reads ``[e(x_{j+1}) ; f_j]`` ``[2d]``: the target's (frozen) embedding of the next token and the target's
  final normed state at j (the paper's order: embedding first);
* ``lstm``: two LSTM layers 2d -> d -> d applied **per position** (each position its own length-1 sequence from a zero
  state), as the released code runs ``nn.LSTM`` on ``[1, T, 2d]`` without ``batch_first``. From a zero state the
  forget gate and the hidden-to-hidden weights multiply zero, so they are not stored: layer l is
  ``i, g, o = W_l x + b_l``; ``c = sigmoid(i) * tanh(g)``; ``h = sigmoid(o) * tanh(c)``. Per position keeps tree
  drafting possible (a recurrent state would have to follow every branch);
* ``layer``: one target-shaped pre-norm Llama decoder layer under the **relaxed-causal block mask**
  (:func:`block_mask`): a row sees every row before its k-block and every row inside it;
* readout: the layer's output (no norm) is the predicted final state ``f_{j+k}``; through the frozen (sliced) LM head
  it gives the distribution of ``x_{j+k+1}``.

Alignment (the k-shift): row j predicts ``f_{j+k}``. At decode time the last k committed rows form one block -- the
last one reads the bonus token -- and their k outputs are the features (and tokens) of the next k positions; feeding
each output back with its own drafted token as the next block drafts k more (``m`` passes per draft).

Folder layout (``fastforward``'s own): ``config.json`` (``architectures: ["FalconDrafter"]``, a ``fastforward``
section naming the target by fingerprint) and ``model.safetensors`` without the head (its rows are the target's,
rebuilt from ``d2t`` at load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .checkpoint import load_headless, save_headless
from .pieces import (
    DecoderLayer,
    DrafterModule,
    DrafterRunner,
    HeadlessConfig,
    decode_layer,
    init_layer,
    rope_cos_sin,
    target_layer_shape,
    target_meta,
)
from .vocab import DraftVocab

ARCHITECTURE = "FalconDrafter"


@dataclass
class FalconConfig(HeadlessConfig):
    block_size: int  # k: tokens drafted per pass
    lstm_dropout: float = 0.1
    fastforward: dict = field(default_factory=dict)  # {"kind", "target", "target_fingerprint", "target_layers"}

    ARCHITECTURE = ARCHITECTURE
    NAME = "Falcon"

    @classmethod
    def for_target(cls, target, draft_vocab_size: int, block_size: int) -> FalconConfig:
        return cls(**target_layer_shape(target), draft_vocab_size=draft_vocab_size, block_size=block_size,
                   fastforward=target_meta(target, "falcon"))

    @classmethod
    def fields_of(cls, raw: dict) -> dict:
        return {"block_size": int(raw["block_size"]), "lstm_dropout": float(raw.get("lstm_dropout", 0.1))}

    @property
    def aux_layers(self) -> tuple:  # Falcon reads no taps (only the final state)
        return ()


def block_mask(length: int, k: int, device=None) -> torch.Tensor:
    """The relaxed-causal mask [length, length] (True = may attend): row i sees every row j with
    ``j < (i // k + 1) * k`` -- everything before its k-block and all of the block (blocks start at row 0)."""
    rows = torch.arange(length, device=device)
    end = (rows.div(k, rounding_mode="floor") + 1) * k  # [length]: one past the row's block
    return rows.unsqueeze(0) < end.unsqueeze(1)


def lstm_cell(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One LSTM layer from a zero state: ``i, g, o = x W^T + b`` -> ``sigmoid(o) * tanh(sigmoid(i) * tanh(g))``."""
    i, g, o = F.linear(x, w, b).chunk(3, dim=-1)
    return torch.sigmoid(o) * torch.tanh(torch.sigmoid(i) * torch.tanh(g))


class PositionwiseLSTM(nn.Module):
    """Two LSTM layers, 2d -> d -> d, each position from a zero state (the released code's effective computation);
    only the input-to-hidden weights of the input, cell and output gates are live, so only they are stored."""

    def __init__(self, d_in: int, d: int, dropout: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(3 * d, d_in))
        self.b1 = nn.Parameter(torch.zeros(3 * d))
        self.w2 = nn.Parameter(torch.empty(3 * d, d))
        self.b2 = nn.Parameter(torch.zeros(3 * d))
        self.dropout = dropout
        bound = d**-0.5  # nn.LSTM's init: U(-1/sqrt(hidden), 1/sqrt(hidden))
        for p in (self.w1, self.b1, self.w2, self.b2):
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = lstm_cell(x, self.w1, self.b1)
        h = F.dropout(h, self.dropout, self.training)  # nn.LSTM's dropout between layers
        return lstm_cell(h, self.w2, self.b2)


class FalconDrafter(DrafterModule):
    """The trainable drafter (``lm_head`` is a frozen slice of the target's head, not saved)."""

    def __init__(self, cfg: FalconConfig, vocab: DraftVocab):
        super().__init__(cfg, vocab)
        d = cfg.hidden_size
        self.lstm = PositionwiseLSTM(d + cfg.target_hidden_size, d, cfg.lstm_dropout)
        self.layer = DecoderLayer(cfg)
        self.add_head(vocab)

    @classmethod
    def for_target(cls, target, vocab: DraftVocab, block_size: int = 2, seed: int = 0) -> FalconDrafter:
        """A fresh drafter: head rows copied from the target; the LSTM at ``nn.LSTM``'s init, the layer's input
        projections random (seeded), its output projections (``o_proj``, ``down_proj``) at zero."""
        if block_size < 1:
            raise UsageError(f"a Falcon drafter needs block_size >= 1, got {block_size}")
        torch.manual_seed(seed)
        drafter = cls(FalconConfig.for_target(target, vocab.size, block_size), vocab)
        drafter.load_head(target)
        with torch.no_grad():
            init_layer(drafter.layer.self_attn, drafter.layer.mlp, zero_down=False)
        return drafter

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``emb`` [B, T, d] (rows' next-token embeddings), ``feat`` [B, T, d_t] (rows' final states), ``mask``
        (True = may attend; [T, T] or [B, 1, T, T]) -> predicted final states f_{j+k} [B, T, d]. ``positions``
        [T] (RoPE) default to 0..T-1."""
        T = emb.shape[1]
        x = self.lstm(torch.cat([emb, feat], dim=-1))
        pos = torch.arange(T, device=emb.device) if positions is None else positions
        cos, sin = rope_cos_sin(self.cfg.head_dim, self.cfg.rope_theta, pos)
        return self.layer(x, cos, sin, mask)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def training_mask(lengths: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[B, 1, T, T]: the block mask with each sequence's padding keys hidden (rows are right-padded)."""
    keys = torch.arange(T, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, T]
    return (block_mask(T, k, lengths.device).unsqueeze(0) & keys.unsqueeze(1)).unsqueeze(1)


# -- the folder ------------------------------------------------------------------------------------------------------


def save_falcon(drafter: FalconDrafter, folder, dtype: str = "float16") -> Path:
    """Write ``drafter`` into ``folder`` (created), without the frozen head; files replaced atomically."""
    return save_headless(drafter, folder, dtype)


def load_falcon(folder, target) -> FalconDrafter:
    """A Falcon drafter from ``folder`` (fp32), checked to belong to ``target`` (one-line refusals)."""
    return load_headless(folder, target, "a Falcon", FalconConfig.from_json, FalconDrafter)


# -- decode time -----------------------------------------------------------------------------------------------------


class FalconRunner(DrafterRunner):
    """The drafter at decode time: its weights as the lean forward's linears (``Q4_0`` blocks through the native
    kernel when it builds -- the drafter only proposes, so rounding never changes the output), a KV cache of
    committed rows, and a scratch area after them for the rows of the current draft's later passes (dropped at the
    next draft).

    With one decoder layer a row's K/V depend only on the row's own input, not on the mask, so a committed row's K/V
    stay valid whichever block it later belongs to: the first pass of a draft only re-reads the last k committed rows
    as queries."""

    def __init__(self, drafter: FalconDrafter, target, capacity: int, weights: str = "auto",
                 head_rows=None):
        linear = self.setup(drafter, target, weights, head_rows)
        self.k = drafter.cfg.block_size
        lstm = drafter.lstm
        self.w1, self.b1 = linear(lstm.w1), lstm.b1.detach().float()
        self.w2, self.b2 = linear(lstm.w2), lstm.b2.detach().float()
        self.layer = decode_layer(linear, drafter.layer)
        self.ops = linear.layer_ops  # the target's native layer ops, or None: plain torch ops
        self.length = 0  # committed rows
        self.scratch = 0  # rows of the current draft's later passes, after the committed ones
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        cfg = self.cfg
        keep = self.length + self.scratch if hasattr(self, "kc") else 0
        k = torch.zeros(cfg.num_key_value_heads, capacity, cfg.head_dim)
        v = torch.zeros_like(k)
        q = torch.zeros(cfg.num_attention_heads, capacity, cfg.head_dim)
        x = torch.zeros(capacity, cfg.hidden_size)
        pos = torch.zeros(capacity, dtype=torch.long)
        if keep:
            k[:, :keep], v[:, :keep] = self.kc[:, :keep], self.vc[:, :keep]
            q[:, :keep], x[:keep], pos[:keep] = self.qc[:, :keep], self.x[:keep], self.pos[:keep]
        # [nkv, capacity, hd] x2; the committed rows' queries [nh, capacity, hd], layer inputs [capacity, d] and
        # positions [capacity], which a first pass re-reads
        self.kc, self.vc, self.qc, self.x, self.pos = k, v, q, x, pos
        self.rope(capacity)

    @property
    def capacity(self) -> int:
        return self.kc.shape[1]

    def empty(self, capacity: int) -> None:
        self.length = self.scratch = 0
        self._alloc(capacity)

    def _ensure(self, end: int) -> None:
        if end > self.capacity:
            self._alloc(max(2 * self.capacity, end))

    def _inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Rows' LSTM outputs: next tokens [r] (target ids), final states [r, d_t] -> [r, d]."""
        x = torch.cat([self.embed(tokens), feats.float()], dim=-1).contiguous()
        h = lstm_cell_packed(x, self.w1, self.b1)
        return lstm_cell_packed(h, self.w2, self.b2)

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """[r, d] at ``positions`` -> q [nh, r, hd], k and v [nkv, r, hd]."""
        return self.heads(self.layer, self.norm(x, self.layer.in_norm), self.cos[positions], self.sin[positions])

    def _attend(self, x: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The layer's output for rows ``x`` [r, d] with queries ``q``, over cache rows ``[0, mask.shape[1])``."""
        end = mask.shape[1]
        return self.finish(self.layer, x, q, self.kc[:, :end], self.vc[:, :end], mask)

    def commit(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed rows -- target final states [r, d_t], next tokens [r], positions [r] -- to the cache
        (their queries and K/V; their outputs are computed when they form a block). Drops the scratch rows."""
        self.scratch = 0
        r = tokens.numel()
        if r == 0:
            return
        start, end = self.length, self.length + r
        self._ensure(max(end, int(positions.max()) + 1))
        x = self._inputs(tokens, feats)
        q, k, v = self._project(x, positions)
        self.x[start:end], self.qc[:, start:end], self.kc[:, start:end], self.vc[:, start:end] = x, q, k, v
        self.pos[start:end] = positions
        self.length = end

    def first_block(self) -> torch.Tensor:
        """The first pass of a draft: the last min(k, length) committed rows as one block (each sees every committed
        row) -> their outputs [k', d], the predicted final states of the next k' positions."""
        self.scratch = 0
        n = min(self.k, self.length)
        a = self.length - n
        if self.ops is not None:  # the block's rows again, their keys and values rewritten in place
            return self._layer_native(self.x[a : self.length].clone(), self.pos[a : self.length], a,
                                      torch.ones(n, n, dtype=torch.bool), torch.arange(a, self.length))
        return self._attend(self.x[a : self.length], self.qc[:, a : self.length],
                            torch.ones(n, self.length, dtype=torch.bool))

    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, sees: torch.Tensor) -> torch.Tensor:
        """A later pass over F branches at once: branch b's block is rows ``(tokens[b, i], feats[b, i])`` at positions
        ``start + i`` (i < k'); each row sees every committed row, the scratch rows ``sees[b]`` [F, scratch] (its
        branch's earlier blocks) and its own block. The rows go to scratch (returned indices) -> outputs [F, k', d],
        and the scratch row indices [F, k'] of the new rows."""
        Fb, kk = tokens.shape
        r = Fb * kk
        base = self.length + self.scratch
        self._ensure(max(base + r, start + kk))
        positions = (start + torch.arange(kk)).repeat(Fb)
        x = self._inputs(tokens.reshape(-1), feats.reshape(r, -1))
        own = torch.arange(Fb).repeat_interleave(kk)  # [r]: each row's branch
        if self.ops is not None:  # the rows see every committed row, and what ``visible`` names after them
            visible = torch.zeros(r, self.scratch + r, dtype=torch.bool)
            if self.scratch:
                visible[:, : self.scratch] = sees[own]
            visible[:, self.scratch :] = own.unsqueeze(1) == own.unsqueeze(0)
            out = self._layer_native(x, positions, self.length, visible, torch.arange(base, base + r))
        else:
            q, k, v = self._project(x, positions)
            self.kc[:, base : base + r], self.vc[:, base : base + r] = k, v
            mask = torch.zeros(r, base + r, dtype=torch.bool)
            mask[:, : self.length] = True
            if self.scratch:
                mask[:, self.length : base] = sees[own]
            mask[:, base:] = own.unsqueeze(1) == own.unsqueeze(0)
            out = self._attend(x, q, mask)
        new_rows = (self.scratch + torch.arange(r)).view(Fb, kk)
        self.scratch += r
        return out.view(Fb, kk, -1), new_rows

    def _layer_native(self, h: torch.Tensor, positions: torch.Tensor, start: int, visible: torch.Tensor,
                      write: torch.Tensor) -> torch.Tensor:
        """The layer through the native layer ops for rows with inputs ``h`` [r, d] (updated in place and returned)
        at ``positions``, their keys and values written to cache slots ``write``; each row sees the first ``start``
        slots and those after them that ``visible`` [r, W] names."""
        normed = self.ops.rms_norm(h, self.layer.in_norm, self.eps)
        self.native_layer(self.layer, h, normed, self.layer.post_norm, positions.to(torch.long).contiguous(),
                          self.kc.unsqueeze(0), self.vc.unsqueeze(0), 0, start, visible.contiguous(), write)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[r, d] -> [r, draft_vocab] next-token logits (one head matmul)."""
        return self.head(h.contiguous())

    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., draft_vocab] next-token probabilities."""
        shape = h.shape[:-1]
        return self.logits(h.reshape(-1, h.shape[-1])).softmax(-1).view(*shape, -1)

    def top(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens after each row of ``h`` [..., d]: their probabilities and draft ids
        [..., k], best first."""
        values, ids = self.top_of_logits(self.logits(h.reshape(-1, h.shape[-1])), k, log=False)
        return values.view(*h.shape[:-1], k), ids.view(*h.shape[:-1], k)


def lstm_cell_packed(x: torch.Tensor, w, b: torch.Tensor) -> torch.Tensor:
    """:func:`lstm_cell` with a decode-time linear ``w``."""
    i, g, o = (w(x) + b).chunk(3, dim=-1)
    return torch.sigmoid(o) * torch.tanh(torch.sigmoid(i) * torch.tanh(g))


def parameter_count(cfg: FalconConfig) -> int:
    """Trained parameters (the frozen head excluded)."""
    d, kv, mlp = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    lstm = 3 * d * (d + cfg.target_hidden_size) + 3 * d * d + 6 * d
    return lstm + d * q * 2 + 2 * d * kv + 3 * d * mlp + 2 * d
