"""An EAGLE-3-style drafter: one decoder layer over the target's fused features, read out through a frozen slice of
the target's LM head. Training (:mod:`fastforward.train.eagle`) and inference (:mod:`fastforward.proposers.eagle`)
both import this module.

Shapes (the default model: hidden d = 576, 9 query / 3 KV heads of 64, MLP 1536, 30 layers):

* ``fc``: the three taps ``[3 d_target] -> [d]`` (the fused feature ``g_j`` of target position j);
* ``midlayer``: a Llama decoder layer whose attention reads ``[input_layernorm(e) ; hidden_norm(g)]`` (``2d``), where
  ``e`` is the target's embedding of the next token; the residual is ``g`` itself (taken before ``hidden_norm``,
  vLLM's ``norm_before_residual = False``); output ``h`` (pre-norm);
* ``norm`` + ``lm_head`` ``[draft_vocab, d]`` (frozen rows of the target's head) -> logits over the draft vocabulary.

Alignment: row j reads ``(g_j, e(x_{j+1}))`` at position j and predicts ``x_{j+2}``. At decode time the drafter's KV
cache holds one row per committed pair; a draft node at depth m reads (its parent row's output ``h``, its own token)
at position ``root + m - 1`` -- the drafter feeds its own output back instead of a target feature, which training
imitates ("training-time test", :meth:`Eagle3Drafter.ttt_logits`): step k re-runs every position with the previous
step's outputs and the tokens k further on, attending to the step-0 keys of positions <= j and to its own keys of
steps 1..k (the path it drafted), at positions j + k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .calibration import calibration_of
from .features import default_aux_layers
from .pieces import (
    MLP,
    Attention,
    DrafterConfig,
    DrafterModule,
    DrafterRunner,
    RMSNorm,
    architecture_of,
    decode_layer,
    init_layer,
    pass_last_tap,
    rope_cos_sin,
    rotate,
    target_embedding_rows,  # noqa: F401 - re-exported: callers outside the drafters import it from here
    target_final_norm,
    target_fingerprint,  # noqa: F401 - re-exported, as target_embedding_rows
    target_layer_shape,
    target_meta,
)
from .vocab import DraftVocab

ARCHITECTURE = "LlamaForCausalLMEagle3"
KNOWN_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")


@dataclass
class Eagle3Config(DrafterConfig):
    max_position_embeddings: int
    aux_layers: tuple = ()  # HF hidden_states indices (the inputs of these target layers)
    fastforward: dict = field(default_factory=dict)  # {"target": name, "target_fingerprint": ...}

    @classmethod
    def for_target(cls, target, draft_vocab_size: int) -> Eagle3Config:
        c = target.config
        return cls(
            **target_layer_shape(target), draft_vocab_size=draft_vocab_size,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
            aux_layers=default_aux_layers(c.num_hidden_layers), fastforward=target_meta(target, "eagle3"),
        )

    def to_hf(self) -> dict:
        """The native EAGLE-3 ``config.json`` (what vLLM's ``eagle3`` and SGLang's ``EAGLE3`` read). The aux layer ids
        are left out when they are the engines' default, which both then agree on."""
        out = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False,
            "norm_before_residual": False, "torch_dtype": "float16",
        }
        layers = self.fastforward.get("target_layers")
        if layers is None or tuple(self.aux_layers) != default_aux_layers(layers):
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
        if self.fastforward:
            out["fastforward"] = dict(self.fastforward)
        return out

    @classmethod
    def from_hf(cls, cfg: dict, target=None) -> Eagle3Config:
        arch = architecture_of(cfg)
        if arch not in KNOWN_ARCHITECTURES:
            raise UsageError(f"not an EAGLE-3 drafter: architectures is {cfg.get('architectures')!r}, expected "
                             f"{ARCHITECTURE}")
        if cfg.get("norm_before_residual", False):
            raise UsageError("EAGLE-3 drafters with norm_before_residual = true are not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            ff = dict(cfg.get("fastforward") or {})
            layers = ff.get("target_layers") or (target.config.num_hidden_layers if target is not None else None)
            aux = cfg.get("eagle_aux_hidden_state_layer_ids")
            if aux is None:
                if layers is None:
                    raise UsageError("the drafter names no aux layers and no target to take the default from")
                aux = default_aux_layers(int(layers))
            vocab = int(cfg["vocab_size"])
            calibration_of(ff)  # a malformed calibration is refused at load, in one line
            return cls(
                hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]), num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), vocab_size=vocab,
                draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
                target_hidden_size=int(cfg.get("target_hidden_size") or hidden), aux_layers=tuple(int(a) for a in aux),
                fastforward=ff,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed EAGLE-3 config.json: {exc}") from None

    def as_dict(self) -> dict:
        return asdict(self)


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.mlp = MLP(cfg)


class Eagle3Drafter(DrafterModule):
    """The trainable drafter (its ``state_dict`` keys are the EAGLE-3 layout's, plus ``d2t``/``t2d`` buffers)."""

    def __init__(self, cfg: Eagle3Config, vocab: DraftVocab):
        super().__init__(cfg, vocab)
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, d, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.add_head(vocab)

    @classmethod
    def for_target(cls, target, vocab: DraftVocab, seed: int = 0) -> Eagle3Drafter:
        """A fresh drafter for ``target``: the head rows copied from the target; ``fc`` passing the last tap through
        (g = the residual stream entering layer L-3, the tap nearest the output) and the layer's output projections
        (``o_proj``, ``down_proj``) at zero, so the untrained drafter reads the target's own late state; its final
        norm at a tenth of the target's, so its first distributions are flat rather than confidently wrong (a
        random or logit-lens start costs more than uniform cross-entropy, which slows the first hundred steps);
        the other layer weights random (seeded)."""
        torch.manual_seed(seed)
        drafter = cls(Eagle3Config.for_target(target, vocab.size), vocab)
        drafter.load_head(target)
        with torch.no_grad():
            norm = target_final_norm(target)
            if norm is not None:
                drafter.norm.weight.copy_(norm)
            init_layer(drafter.midlayer.self_attn, drafter.midlayer.mlp)
            pass_last_tap(drafter.fc, drafter.cfg.hidden_size, drafter.cfg.target_hidden_size)
            drafter.norm.weight.mul_(0.1)
        return drafter

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    # -- the pieces both training and inference use ----------------------------------------------------------------
    def layer_input(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """[..., 2d] = [input_layernorm(e) ; hidden_norm(g)]."""
        m = self.midlayer
        return torch.cat([m.input_layernorm(emb), m.hidden_norm(feat)], dim=-1)

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer's output h from its residual input g and the attention values [..., nh hd]."""
        m = self.midlayer
        h = feat + m.self_attn.o_proj(attn_out)
        return h + m.mlp(m.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # -- training ---------------------------------------------------------------------------------------------------
    def forward(self, taps, ids, embed, steps, select=None):
        return self.ttt_logits(taps, ids, embed, steps, select)

    def ttt_logits(self, taps: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor, steps: int,
                   select: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Training-time test over a batch: ``taps`` [B, T, n_taps * d_t], ``ids`` [B, T] (right-padded),
        ``embed`` [vocab, d] (frozen). Returns ``steps`` logits [B, T, draft_vocab]; at step k row j predicts
        ``x_{j+2+k}`` (rows whose target falls outside the sequence are garbage, masked by the loss).

        With ``select`` (one [B, T] bool mask per step), step k's logits are only those of the selected rows,
        [n_k, draft_vocab], in row-major order -- the head is most of the cost, and prompt rows need none. Step 0
        runs every row (all are attention context); steps k >= 1 run, per sequence, only the window of rows that
        some step >= 1 selects (row j of step k reads row j of step k - 1 and nothing else of it), gathered into
        [B, W] -- about the response's length instead of the padded sequence's."""
        cfg = self.cfg
        B, T = ids.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = nh // nkv
        attn = self.midlayer.self_attn
        feat = self.fc(taps)  # [B, T, d]
        scale = 1.0 / math.sqrt(hd)
        key_pos = torch.arange(T, device=ids.device)
        rows = key_pos.expand(B, T)  # [B, W]: the sequence row each computed row is (step 0: all of them)
        k0 = v0 = None
        diag_k, diag_v = [], []
        out = []
        for k in range(steps):
            if k == 1 and select is not None:
                rows = later_rows_window(select[1:], T)
                feat = feat.gather(1, rows.unsqueeze(-1).expand(-1, -1, feat.shape[-1]))  # step 0's outputs there
            W = rows.shape[1]
            nxt_at = rows + 1 + k  # row j reads x_{j+1+k}
            nxt = ids.gather(1, nxt_at.clamp(max=T - 1)).masked_fill(nxt_at >= T, 0)
            x = self.layer_input(F.embedding(nxt, embed), feat)  # [B, W, 2d]
            cos, sin = (c.unsqueeze(1) for c in rope_cos_sin(hd, cfg.rope_theta, rows + k))  # positions j + k
            q = rotate(attn.q_proj(x).view(B, W, nh, hd).transpose(1, 2), cos, sin)  # [B, nh, W, hd]
            kk = rotate(attn.k_proj(x).view(B, W, nkv, hd).transpose(1, 2), cos, sin)  # [B, nkv, W, hd]
            vv = attn.v_proj(x).view(B, W, nkv, hd).transpose(1, 2)
            if k == 0:
                k0, v0 = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)  # [B, nh, T, hd]
            else:
                diag_k.append(kk.repeat_interleave(g, 1))
                diag_v.append(vv.repeat_interleave(g, 1))
            scores = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, W, T]: the context of positions <= j
            scores = scores.masked_fill((key_pos > rows.unsqueeze(-1)).unsqueeze(1), float("-inf"))
            extra = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]  # each [B, nh, W, 1]: its own path
            probs = torch.cat([scores, *extra], dim=-1).softmax(-1)
            o = probs[..., :T] @ v0
            for m, dv in enumerate(diag_v):
                o = o + probs[..., T + m : T + m + 1] * dv
            h = self.finish(feat, o.transpose(1, 2).reshape(B, W, nh * hd))
            if select is None:
                out.append(self.logits(h))
            else:
                sel = select[k].gather(1, rows)
                if k and int(sel.sum()) != int(select[k].sum()):
                    raise ValueError("a selected row lies outside the window of rows computed after step 0")
                out.append(self.logits(h[sel]))
            feat = h  # the next step reads this step's output at the same row
        return out


def later_rows_window(later_selects: list[torch.Tensor], T: int) -> torch.Tensor:
    """[B, W] row indices: per sequence, the contiguous rows from the first to the last one any of
    ``later_selects`` ([B, T] bool each) selects, left-aligned; W is the widest such window (>= 1). A narrower
    sequence's window runs on past its last selected row (clamped to T - 1 only where it would leave the
    sequence: then it starts earlier), so no row repeats inside a window."""
    need = torch.stack(later_selects).any(0)
    B = need.shape[0]
    any_row = need.any(1)
    pos = torch.arange(T, device=need.device).expand(B, T)
    first = torch.where(need, pos, T).min(1).values
    last = torch.where(need, pos, -1).max(1).values
    W = int((last - first + 1)[any_row].max()) if bool(any_row.any()) else 1
    start = torch.where(any_row, first, 0).clamp(max=T - W)
    return start.unsqueeze(1) + torch.arange(W, device=need.device)


class Eagle3Runner(DrafterRunner):
    """The drafter at decode time: the weights as the lean forward's linears (fp32, or packed blocks the native
    kernel multiplies, ``Q4_0`` by default -- the drafter only proposes, so its rounding never changes the output),
    its own KV cache of committed rows, and draft rows written after them and dropped after each proposal. With the
    native kernels, the row-wise ops are the target's native layer ops (RMSNorm, RoPE + KV write + masked attention,
    SiLU*mul), which spare the ~20 small torch ops a drafter row otherwise costs."""

    def __init__(self, drafter: Eagle3Drafter, target, capacity: int, weights: str = "auto",
                 head_rows=None):
        linear = self.setup(drafter, target, weights, head_rows)
        cfg = self.cfg
        self.ops = linear.layer_ops  # None: plain torch ops
        self.fc = linear(drafter.fc.weight)
        # the target's layer pieces (in_norm normalises the embedding half; the feature half has its own norm)
        self.layer = decode_layer(linear, drafter.midlayer)
        self.hidden_norm = drafter.midlayer.hidden_norm.weight.detach().float()
        self.final_norm = drafter.norm.weight.detach().float()
        nkv, hd = cfg.num_key_value_heads, cfg.head_dim
        self.k = torch.zeros(nkv, capacity, hd)
        self.v = torch.zeros(nkv, capacity, hd)
        self.length = 0  # committed rows
        self.rope(capacity + 64)
        self.native = self._native_layer_head(drafter)

    def _native_layer_head(self, drafter: Eagle3Drafter):
        """The native :class:`DraftLayerHead` over this drafter's packed weights (the fusion, the layer, the head),
        which runs a call's rows and their top-k in one call; None where the kernels did not build or a weight is
        not packed for the integer kernel."""
        from .pieces import DrafterLinear

        self.expands_natively = False
        linears = (self.fc, self.layer.qkv, self.layer.o, self.layer.gate_up, self.layer.down, self.head)
        if self.ops is None or not hasattr(self.ops, "DraftLayerHead") or \
                not all(isinstance(lin, DrafterLinear) and lin.few.data is not None and not lin.few.padded
                        for lin in linears):
            return None
        # the weights kept for another kernel too (AMX's tiles, which larger calls take); none elsewhere
        self._tiled = [lin for lin in linears if lin.many is not None]
        few = [lin.few for lin in linears]
        native = self.ops.DraftLayerHead(few[0].data, few[0].kernel_fmt, self.layer.in_norm, self.hidden_norm,
                                         [f.data for f in few[1:5]], [f.kernel_fmt for f in few[1:5]],
                                         self.layer.post_norm, self.final_norm, few[5].data, few[5].kernel_fmt,
                                         self.eps, self.cfg.num_attention_heads, self.cfg.num_key_value_heads)
        # the target's embedding, for the native expansion (which looks its draft tokens up itself) where it is one
        # the kernels read: packed rows or a dense table
        from ..linear import DenseLinear, PackedLinear

        embed = getattr(self.target.backend, "embed", None)
        if isinstance(embed, PackedLinear) and embed.native is not None and embed._dense is None and \
                embed.in_features == self.cfg.hidden_size:
            native.set_embedding(embed.data, embed.kernel_fmt)
            self.expands_natively = True
        elif isinstance(embed, DenseLinear) and embed.w_out_in.dtype in (torch.float32, torch.float64) and \
                embed.w_out_in.shape[1] == self.cfg.hidden_size:
            native.set_embedding(embed.w_out_in.float(), -1)  # an fp64 table's fp32 copy: what .float() of its rows is
            self.expands_natively = True
        return native

    def _native_for(self, rows: int):
        """:attr:`native` when a call of ``rows`` rows runs every weight on the integer kernel it holds (on a CPU
        with AMX, larger calls take the tile kernel's copies: the runner's own path), else None."""
        if self.native is None or any(lin.for_rows(rows) is not lin.few for lin in self._tiled):
            return None
        return self.native

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def empty(self, capacity: int) -> None:
        self.k = torch.zeros(self.k.shape[0], capacity, self.k.shape[2])
        self.v = torch.zeros_like(self.k)
        self.length = 0
        if self.cos.shape[0] < capacity + 64:
            self.rope(capacity + 64)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[r, n_taps, d_t] target taps -> [r, d] fused features."""
        return self.fc(taps.reshape(taps.shape[0], -1).float().contiguous())

    def rows(self, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slot: int,
             visible: torch.Tensor | None) -> torch.Tensor:
        """Run r rows (features [r, d], target token ids [r], positions [r]) writing their KV at slots
        ``slot .. slot+r-1``; each sees the committed rows and the slots ``length .. slot+r-1`` that ``visible``
        [r, slot + r - length] names (None: causal over the r rows, with slot == length). Returns h [r, d]."""
        if self.ops is not None:
            return self._rows_native(feat, tokens, positions, slot, visible)
        r = tokens.numel()
        x = torch.cat([self.norm(self.embed(tokens), self.layer.in_norm), self.norm(feat, self.hidden_norm)], dim=-1)
        end = slot + r
        if end > self.capacity or int(positions.max()) >= self.cos.shape[0]:
            self._grow(max(end, int(positions.max()) + 1))
        # q [nh, r, hd]; k and v into the cache
        q, self.k[:, slot:end], self.v[:, slot:end] = self.heads(self.layer, x, self.cos[positions],
                                                                 self.sin[positions])
        if visible is None:
            visible = self._causal_visible(r, slot)
        mask = torch.cat([torch.ones(r, self.length, dtype=torch.bool), visible], dim=1)  # [r, end]
        return self.finish(self.layer, feat, q, self.k[:, :end], self.v[:, :end], mask)

    def _causal_visible(self, r: int, slot: int) -> torch.Tensor:
        """[r, slot + r - length]: r rows at ``slot..`` causal among themselves, blind to slots ``length..slot-1``."""
        local = torch.ones(r, r, dtype=torch.bool).tril()
        if slot == self.length:
            return local
        return torch.cat([torch.zeros(r, slot - self.length, dtype=torch.bool), local], dim=1)

    def _rows_native(self, feat, tokens, positions, slot, visible, last_only: bool = False) -> torch.Tensor:
        """:meth:`rows` through the native layer ops (same computation, the target's kernels; the layer in one native
        call when its weights are packed). ``last_only``: the layer's output of the last row alone [1, d] (every
        row's keys and values are written)."""
        ops, eps = self.ops, self.eps
        r = tokens.numel()
        end = slot + r
        if end > self.capacity or int(positions.max()) >= self.cos.shape[0]:
            self._grow(max(end, int(positions.max()) + 1))
        h = feat.float().contiguous().clone()  # the residual stream (the fused feature), updated in place
        x = torch.cat([ops.rms_norm(self.embed(tokens).contiguous(), self.layer.in_norm, eps),
                       ops.rms_norm(h, self.hidden_norm, eps)], dim=-1)  # [r, 2d]
        write = None
        if visible is None and slot != self.length:  # causal after slots it does not see (the kernel's default
            visible = self._causal_visible(r, slot)  # is causal right after the committed rows)
        if visible is not None:
            visible = visible.contiguous()
            write = torch.arange(slot, end)
        self.native_layer(self.layer, h, x, self.final_norm, positions.to(torch.long).contiguous(),
                          self.k.unsqueeze(0), self.v.unsqueeze(0), 0, self.length, visible, write, last_only)
        return h[-1:] if last_only else h

    def commit(self, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               last_only: bool = False) -> torch.Tensor:
        """Append committed rows (in chunks, causal); returns their outputs h [r, d], or with ``last_only`` the last
        row's alone [1, d] (the other rows then go no further than their keys and values)."""
        outs = []
        n = tokens.numel()
        for a in range(0, n, 256):
            b = min(n, a + 256)
            if last_only and self.ops is not None:
                if b == n:  # the chunks before the last one only write their keys and values
                    outs.append(self._rows_native(feat[a:b], tokens[a:b], positions[a:b], self.length, None, True))
                else:
                    self._rows_native(feat[a:b], tokens[a:b], positions[a:b], self.length, None, True)
            else:
                outs.append(self.rows(feat[a:b], tokens[a:b], positions[a:b], self.length, None))
            self.length += b - a
        if last_only:
            return outs[-1][-1:]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def rows_top(self, feat: torch.Tensor, pick: list[int], tokens: torch.Tensor, positions: torch.Tensor,
                 last_position: int, slot: int, visible: torch.Tensor | None,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`rows` over the rows ``pick`` of ``feat`` (a list of row indices; [] for all of them, in order),
        then :meth:`top` of their outputs: (h [r, d], log-probabilities [r, k], draft ids [r, k]), in one native call
        where it can run (the same values). ``last_position``: the largest of ``positions``."""
        r = tokens.numel()
        native = self._native_for(r)
        if native is None:
            h = self.rows(feat[torch.as_tensor(pick)] if pick else feat, tokens, positions, slot, visible)
            return (h, *self.top(h, k))
        end = slot + r
        if end > self.capacity or last_position >= self.cos.shape[0]:
            self._grow(max(end, last_position + 1))
        if visible is None and slot != self.length:
            visible = self._causal_visible(r, slot)
        write = None if slot == self.length else torch.arange(slot, end)
        return native.run(feat, False, pick, self._embedded(tokens), self.cos, self.sin, positions, self.k, self.v,
                          self.length, visible, write, False, k)

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the native call reads for ``tokens``: the ids themselves where it holds the target's embedding, else
        their embedding rows."""
        return tokens if self.expands_natively else self.embed(tokens)

    def expand(self, root_values: torch.Tensor, root_ids: torch.Tensor, last_h: torch.Tensor, k: int, depth: int,
               min_prob: float, token_ms: float, call_ms: float | None, smoothing: float,
               root_position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[float]] | None:
        """EAGLE-2's expansion of a step's draft in one native call (the proposer's ``expand`` loop, the same
        candidates): (draft ids, log path scores, parents, depths) as numpy arrays and [rows, calls, unpaid stops,
        call ms]; None where it cannot run (no native layer, an embedding the kernels do not read, or calls of
        ``k`` rows that take the tile kernel). ``token_ms`` > 0 prices each depth's call against ``call_ms`` (the
        moving average of a call's wall time, updated with ``smoothing``; None: not measured yet)."""
        if not getattr(self, "expands_natively", False) or self._native_for(k) is None:
            return None
        need = self.length + k * max(depth - 1, 0)
        if need > self.capacity or root_position + depth >= self.cos.shape[0]:
            self._grow(max(need, root_position + depth + 1))
        out = self.native.expand(root_values, root_ids, last_h, self.d2t, k, depth, min_prob, token_ms,
                                 -1.0 if call_ms is None else call_ms, smoothing, self.cos, self.sin, self.k, self.v,
                                 self.length, root_position)
        return (*(t.numpy() for t in out[:4]), out[4])

    def commit_top(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Append committed rows from their target taps [r, n_taps * d_t] (fused here): the last row's output h
        [1, d] and, with ``k`` > 0, :meth:`top` of it ([1, k] each; else None, None) -- the fusion, every chunk's
        layer and the head in one native call per chunk where it can run (the same values as :meth:`fuse`,
        :meth:`commit` and :meth:`top`)."""
        n = tokens.numel()
        if self._native_for(min(256, n)) is None:  # the largest chunk's (a smaller one's kernel is no other)
            h = self.commit(self.fuse(taps), tokens, positions, last_only=True)
            return (h, *self.top(h, k)) if k > 0 else (h, None, None)
        last = int(positions[-1])
        if self.length + n > self.capacity or last >= self.cos.shape[0]:
            self._grow(max(self.length + n, last + 1))
        taps = taps.reshape(n, -1)
        if taps.dtype != torch.float32:
            taps = taps.float()
        for a in range(0, n, 256):  # a decoding step's rows in one chunk: the tensors as they are (no slices)
            b = min(n, a + 256)
            whole = a == 0 and b == n
            h, values, ids = self.native.run(taps if whole else taps[a:b], True, [],
                                             self._embedded(tokens if whole else tokens[a:b]), self.cos, self.sin,
                                             positions if whole else positions[a:b], self.k, self.v, self.length,
                                             None, None, True, k if b == n else 0)
            self.length += b - a
        return (h, values, ids) if k > 0 else (h, None, None)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[r, draft_vocab] logits of the next token."""
        h = h.float().contiguous()
        normed = self.norm(h, self.final_norm) if self.ops is None else self.ops.rms_norm(h, self.final_norm, self.eps)
        return self.head(normed.contiguous())

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        """[r, draft_vocab] log-probabilities of the next token."""
        return self.logits(h).log_softmax(-1)

    def top(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens after each row of ``h`` [r, d]: their log-probabilities and draft ids
        [r, k], best first."""
        return self.top_of_logits(self.logits(h), k)

    def _grow(self, end: int) -> None:
        cap = max(end, 2 * self.capacity)
        k = torch.zeros(self.k.shape[0], cap, self.k.shape[2])
        v = torch.zeros_like(k)
        k[:, : self.capacity] = self.k
        v[:, : self.capacity] = self.v
        self.k, self.v = k, v
        if self.cos.shape[0] < cap + 64:
            self.rope(cap + 64)
