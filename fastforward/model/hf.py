"""Any Hugging Face causal LM as a target backend, through its public forward (4D float mask, explicit
``position_ids``, ``DynamicCache``): slower than the lean forward, but every architecture works."""

from __future__ import annotations

import torch

from ..errors import UsageError
from .forward import ForwardOutput, _full_mask
from .kv import HFDynamicKVCache


def sliding_window_of(config) -> tuple[int | None, bool]:
    """(window, every layer slides) of an HF config; ``(None, False)`` when attention is global everywhere.

    Mistral-style ``sliding_window`` (Mistral, Phi-3: every layer); Qwen2's only with ``use_sliding_window``;
    per-layer ``layer_types`` (Gemma2/3, Qwen2's ``max_window_layers``) say which layers slide."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None, False
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
        if not any(sliding):
            return None, False
        return int(window), all(sliding)
    return int(window), getattr(config, "model_type", "") in ("mistral", "phi3")


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
        if tree_mask is not None and tuple(tree_mask.shape) != (q, q):
            raise UsageError("the HF backend takes a [q, q] tree mask over the new tokens only (no slot pool)")
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
