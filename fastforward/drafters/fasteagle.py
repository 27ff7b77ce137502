"""FastEagle: a cascade of N decoder layers over the target's fused features that drafts N depths in one pass.
Training (:mod:`fastforward.train.fasteagle`) and inference (:mod:`fastforward.proposers.fasteagle`) both import
this module.

Source: *FastEagle: Cascaded Drafting for Accelerating Speculative Decoding* (arXiv 2509.20416; no public code).

Shapes (the default model: d = 576, 9 query / 3 KV heads of 64, MLP 1536, 30 layers; N = ``num_layers``):

* ``fc``: the three taps (inputs of target layers 2, L//2, L-3) ``[3 d_t] -> [d]``: the fused feature ``g_j``;
* ``fc_in``: ``[e_norm(e(x_{j+1})) ; g_norm(g_j)]`` ``[2d] -> [d]`` (with a bias, as EAGLE-1's input FC);
* ``layers[i]``: target-shaped pre-norm Llama decoder layers, each with its own weights, causal over positions, RoPE
  at absolute positions. **Cascade** (the method): ``h_1 = L_1(fc_in(.))``, ``h_i = L_i(h_{i-1})``. **Parallel** (the
  paper's "w/o cascade" ablation): ``h_i = L_i(h_1)`` for i >= 2 -- every deeper layer is fed the input layer's
  output, so each depth is two layers deep;
* readout: ``h_i`` through the frozen (sliced) LM head, with no norm: ``h_i`` is trained towards the target's
  *post-norm* final state ``f_{j+i}`` (the feature loss), which is what the head reads.

Alignment: row j reads ``(g_j, e(x_{j+1}))``; layer i at row j gives the distribution of ``x_{j+1+i}``. At decode
time the last committed row is the last position whose target features are known, and its token is the bonus token
(the tree's root): one pass gives the distributions of depths 1..N. Drafted tokens are never fed back, so each
layer's KV cache holds accepted positions only and never rolls back.

Folder layout (``fastforward``'s own; serving engines have no FastEagle architecture): ``config.json``
(``architectures: ["FastEagleDrafter"]``, a ``fastforward`` section naming the target by fingerprint) and
``model.safetensors`` without the head -- its rows are the target's, rebuilt from ``d2t`` at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .calibration import calibration_of
from .checkpoint import load_headless, save_headless
from .features import default_aux_layers
from .pieces import (
    DecoderLayer,
    DrafterModule,
    DrafterRunner,
    HeadlessConfig,
    RMSNorm,
    decode_layer,
    init_layer,
    pass_last_tap,
    rope_cos_sin,
    target_final_norm,
    target_layer_shape,
    target_meta,
)
from .vocab import DraftVocab

ARCHITECTURE = "FastEagleDrafter"


@dataclass
class FastEagleConfig(HeadlessConfig):
    num_layers: int  # N: layers = drafted depths
    cascade: bool = True  # False: the "w/o cascade" ablation (h_i = L_i(h_1))
    aux_layers: tuple = ()
    fastforward: dict = field(default_factory=dict)  # {"kind", "target", "target_fingerprint", "target_layers"}

    ARCHITECTURE = ARCHITECTURE
    NAME = "FastEagle"

    @classmethod
    def for_target(cls, target, draft_vocab_size: int, num_layers: int, cascade: bool = True) -> FastEagleConfig:
        return cls(**target_layer_shape(target), draft_vocab_size=draft_vocab_size, num_layers=num_layers,
                   cascade=cascade, aux_layers=default_aux_layers(target.config.num_hidden_layers),
                   fastforward=target_meta(target, "fasteagle"))

    @classmethod
    def check_raw(cls, raw: dict) -> None:
        calibration_of(raw.get("fastforward"))  # a malformed calibration is refused at load, in one line

    @classmethod
    def fields_of(cls, raw: dict) -> dict:
        return {"num_layers": int(raw["num_layers"]), "cascade": bool(raw.get("cascade", True)),
                "aux_layers": tuple(int(a) for a in raw["aux_layers"])}


class FastEagleDrafter(DrafterModule):
    """The trainable drafter (``lm_head`` is a frozen slice of the target's head, not saved)."""

    def __init__(self, cfg: FastEagleConfig, vocab: DraftVocab):
        super().__init__(cfg, vocab)
        if cfg.num_layers < 1:
            raise UsageError(f"a FastEagle drafter needs at least one layer, got {cfg.num_layers}")
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, d, bias=False)
        self.e_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.g_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fc_in = nn.Linear(2 * d, d, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.add_head(vocab)

    @classmethod
    def for_target(cls, target, vocab: DraftVocab, num_layers: int, cascade: bool = True,
                   seed: int = 0) -> FastEagleDrafter:
        """A fresh drafter: head rows copied from the target; ``fc`` passing the last tap through, ``g_norm`` at the
        target's final norm and ``fc_in`` passing that through (so every h_i starts as the target's final norm of
        its layer L-3 input: a start near the feature loss's target), the e-block of ``fc_in`` and the layers'
        input projections random (seeded), their output projections (``o_proj``, ``down_proj``) at zero."""
        torch.manual_seed(seed)
        drafter = cls(FastEagleConfig.for_target(target, vocab.size, num_layers, cascade), vocab)
        drafter.load_head(target)
        with torch.no_grad():
            d = drafter.cfg.hidden_size
            pass_last_tap(drafter.fc, d, drafter.cfg.target_hidden_size)
            norm = target_final_norm(target)
            if norm is not None:
                drafter.g_norm.weight.copy_(norm)
            nn.init.normal_(drafter.fc_in.weight, std=0.02)
            drafter.fc_in.weight[:, d:] = torch.eye(d)
            drafter.fc_in.bias.zero_()
            for layer in drafter.layers:
                init_layer(layer.self_attn, layer.mlp)
        return drafter

    def input_rows(self, taps: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """taps [..., n_taps * d_t], next-token embeddings [..., d] -> the first layer's input [..., d]."""
        return self.fc_in(torch.cat([self.e_norm(emb), self.g_norm(self.fc(taps))], dim=-1))

    def forward(self, taps: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor) -> list[torch.Tensor]:
        """``taps`` [B, T, n_taps * d_t], ``ids`` [B, T] (right-padded), ``embed`` [vocab, d] (frozen) -> N outputs
        h_i [B, T, d]; h_i at row j is trained towards the target's final state at j + i."""
        B, T = ids.shape
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]  # row j reads x_{j+1}
        x = self.input_rows(taps, F.embedding(nxt, embed))
        cos, sin = rope_cos_sin(self.cfg.head_dim, self.cfg.rope_theta, torch.arange(T, device=ids.device))
        outs = []
        h = x
        for i, layer in enumerate(self.layers):
            src = h if (self.cfg.cascade or i <= 1) else outs[0]
            h = layer(src, cos, sin)
            outs.append(h)
        return outs

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


# -- the folder ------------------------------------------------------------------------------------------------------


def save_fasteagle(drafter: FastEagleDrafter, folder, dtype: str = "float16") -> Path:
    """Write ``drafter`` into ``folder`` (created), without the frozen head; files replaced atomically."""
    return save_headless(drafter, folder, dtype)


def load_fasteagle(folder, target) -> FastEagleDrafter:
    """A FastEagle drafter from ``folder`` (fp32), checked to belong to ``target`` (one-line refusals)."""
    return load_headless(folder, target, "a FastEagle", FastEagleConfig.from_json, FastEagleDrafter)


# -- decode time -----------------------------------------------------------------------------------------------------


class FastEagleRunner(DrafterRunner):
    """The drafter at decode time: its weights as the lean forward's linears (packed ``Q4_0`` blocks through the native
    kernel when it builds -- the drafter only proposes, so rounding never changes the output), and one KV cache per
    layer holding committed (accepted) rows only."""

    def __init__(self, drafter: FastEagleDrafter, target, capacity: int, weights: str = "auto",
                 head_rows=None):
        linear = self.setup(drafter, target, weights, head_rows)
        self.ops = linear.layer_ops  # the target's native layer ops, or None: plain torch ops
        self.fc = linear(drafter.fc.weight)
        self.fc_in = linear(drafter.fc_in.weight)
        self.fc_in_bias = drafter.fc_in.bias.detach().float()
        self.e_norm = drafter.e_norm.weight.detach().float()
        self.g_norm = drafter.g_norm.weight.detach().float()
        # the target's layer pieces: weights as linears, its half-steps
        self.layers = [decode_layer(linear, layer) for layer in drafter.layers]
        self._alloc(capacity)
        self.length = 0
        self.native = self._native_cascade()

    def _native_cascade(self):
        """The native :class:`CascadeDrafter` over this drafter's packed weights (the fusion, the input projection,
        the cascaded layers, the head), which commits a call's rows and gives every depth's top-k in one call; None
        where the kernels did not build, a weight is not packed for the integer kernel, or the layers do not cascade
        (the "w/o cascade" ablation: the runner's own path)."""
        from .pieces import DrafterLinear

        linears = (self.fc, self.fc_in, self.head, *(lin for w in self.layers for lin in (w.qkv, w.o, w.gate_up,
                                                                                           w.down)))
        if self.ops is None or not hasattr(self.ops, "CascadeDrafter") or not self.cfg.cascade or \
                not all(isinstance(lin, DrafterLinear) and lin.few.data is not None and not lin.few.padded
                        for lin in linears):
            return None
        # the weights kept for another kernel too (AMX's tiles, which larger calls take); none elsewhere
        self._tiled = [lin for lin in linears if lin.many is not None]
        few = [lin.few for lin in linears]
        return self.ops.CascadeDrafter(few[0].data, few[0].kernel_fmt, few[1].data, few[1].kernel_fmt,
                                       self.fc_in_bias, self.e_norm, self.g_norm, [f.data for f in few[3:]],
                                       [f.kernel_fmt for f in few[3:]], [w.in_norm for w in self.layers],
                                       [w.post_norm for w in self.layers], few[2].data, few[2].kernel_fmt, self.eps,
                                       self.cfg.num_attention_heads, self.cfg.num_key_value_heads)

    def _native_for(self, rows: int):
        """:attr:`native` when a call of ``rows`` rows runs every weight on the integer kernel it holds (on a CPU
        with AMX, larger calls take the tile kernel's copies: the runner's own path), else None."""
        if self.native is None or any(lin.for_rows(rows) is not lin.few for lin in self._tiled):
            return None
        return self.native

    def _alloc(self, capacity: int, keep: int = 0) -> None:
        cfg = self.cfg
        k = torch.zeros(cfg.num_layers, cfg.num_key_value_heads, capacity, cfg.head_dim)
        v = torch.zeros_like(k)
        if keep:
            k[:, :, :keep] = self.k[:, :, :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        self.k, self.v = k, v  # [N, nkv, capacity, hd]
        self.rope(capacity)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def empty(self, capacity: int) -> None:
        self._alloc(capacity)
        self.length = 0

    def commit(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append committed rows -- target taps [r, n_taps, d_t], next tokens [r], positions [r] -- through every
        layer (causal, in chunks); returns the last row's outputs h_1..h_N [N, d]."""
        out = None
        for a in range(0, tokens.numel(), 256):
            b = min(tokens.numel(), a + 256)
            out = self._rows(taps[a:b], tokens[a:b], positions[a:b])
        return out

    def commit_top(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`commit`, then with ``k`` > 0 :meth:`top` of every depth: (h_1..h_N [N, d], probabilities [N, k],
        draft ids [N, k]; else None, None) -- the fusion, the layers and the head in one native call per chunk where
        it can run (the same values). Committed positions ascend."""
        n = tokens.numel()
        if self._native_for(min(256, n)) is None:  # the largest chunk's (a smaller one's kernel is no other)
            h = self.commit(taps, tokens, positions)
            return (h, *self.top(h, k)) if k > 0 else (h, None, None)
        end, last = self.length + n, int(positions[-1])
        if end > self.capacity or last >= self.cos.shape[0]:
            self._alloc(max(2 * self.capacity, end, last + 1), keep=self.length)
        taps = taps.reshape(n, -1)
        if taps.dtype != torch.float32:
            taps = taps.float()
        for a in range(0, n, 256):  # a decoding step's rows in one chunk: the tensors as they are (no slices)
            b = min(n, a + 256)
            whole = a == 0 and b == n
            h, values, ids = self.native.run(taps if whole else taps[a:b],
                                             self.embed(tokens if whole else tokens[a:b]), self.cos, self.sin,
                                             positions if whole else positions[a:b], self.k, self.v, self.length,
                                             k if b == n else 0)
            self.length += b - a
        return (h, values.exp(), ids) if k > 0 else (h, None, None)

    def _rows(self, taps, tokens, positions) -> torch.Tensor:
        cfg = self.cfg
        r = tokens.numel()
        start, end = self.length, self.length + r
        if end > self.capacity or int(positions.max()) >= self.cos.shape[0]:
            self._alloc(max(2 * self.capacity, end, int(positions.max()) + 1), keep=self.length)
        g = self.fc(taps.reshape(r, -1).float().contiguous())
        if self.ops is not None:
            ops, eps = self.ops, self.eps
            x = torch.cat([ops.rms_norm(self.embed(tokens).contiguous(), self.e_norm, eps),
                           ops.rms_norm(g, self.g_norm, eps)], dim=-1)
            return self._layers_native(self.fc_in(x) + self.fc_in_bias, positions, start, end)
        x = torch.cat([self.norm(self.embed(tokens), self.e_norm), self.norm(g, self.g_norm)], dim=-1)
        x = self.fc_in(x.contiguous()) + self.fc_in_bias
        cos, sin = self.cos[positions], self.sin[positions]
        causal = torch.ones(r, end, dtype=torch.bool).tril(start)  # [r, end]: committed rows + causal new rows
        last = []
        h = x
        first = None
        for i, w in enumerate(self.layers):
            src = h if (cfg.cascade or i <= 1) else first
            q, self.k[i, :, start:end], self.v[i, :, start:end] = self.heads(w, self.norm(src, w.in_norm), cos, sin)
            h = self.finish(w, src, q, self.k[i, :, :end], self.v[i, :, :end], causal)
            if i == 0:
                first = h
            last.append(h[-1])
        self.length = end
        return torch.stack(last)

    def _layers_native(self, x: torch.Tensor, positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The N layers of :meth:`_rows` through the native layer ops (each layer one native call when its weights
        are packed; causal over the new rows after the committed ones): the last row's outputs h_1..h_N [N, d]. The
        last layer takes only the last row past its attention (the others' keys and values are all it needs)."""
        ops, cfg, eps = self.ops, self.cfg, self.eps
        positions = positions.to(torch.long).contiguous()
        n = len(self.layers)
        last = torch.empty(n, x.shape[1])
        h = x.contiguous()  # the residual stream, updated in place layer after layer
        normed = ops.rms_norm(h, self.layers[0].in_norm, eps)
        first = None
        for i, w in enumerate(self.layers):
            if not cfg.cascade and i >= 1:  # the "w/o cascade" ablation: layers 2.. read layer 1's output
                if i == 1:
                    first = h.clone()
                else:
                    h = first.clone()
                    normed = ops.rms_norm(h, w.in_norm, eps)
            chained = cfg.cascade and i + 1 < n  # the next layer reads this one's output, normed by its in_norm
            next_norm = self.layers[i + 1].in_norm if chained or (i == 0 and n > 1) else w.post_norm
            out = self.native_layer(w, h, normed, next_norm, positions, self.k, self.v, i, start, None, None,
                                    last_only=i + 1 == n)
            normed = out
            last[i] = h[-1]
        self.length = end
        return last

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, draft_vocab] next-token logits of depths 1..N (one head matmul)."""
        return self.head(h.contiguous())

    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, draft_vocab] next-token probabilities of depths 1..N."""
        return self.logits(h).softmax(-1)

    def top(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens after each row of ``h`` [..., d]: their probabilities and draft ids
        [..., k], best first."""
        values, ids = self.top_of_logits(self.logits(h.reshape(-1, h.shape[-1])), k, log=False)
        return values.view(*h.shape[:-1], k), ids.view(*h.shape[:-1], k)


def parameter_count(cfg: FastEagleConfig) -> int:
    """Trained parameters (the frozen head excluded)."""
    d, kv, mlp = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    layer = d * q * 2 + 2 * d * kv + 3 * d * mlp + 2 * d
    return len(cfg.aux_layers) * cfg.target_hidden_size * d + 2 * d * d + d + 2 * d + cfg.num_layers * layer
