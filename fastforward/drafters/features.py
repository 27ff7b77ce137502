"""The target's features a drafter reads: hidden states tapped inside the target, and its final normed state.

**Taps.** An EAGLE-3-style drafter reads the residual stream *entering* three target layers, ``(2, L//2, L-3)`` for an
``L``-layer target -- HF ``output_hidden_states[2]``, ``[L//2]``, ``[L-3]`` (index 0 = the embeddings), the layers vLLM
and SGLang capture by default (``hidden_states[2], [15], [27]`` for the 30-layer default model). The engine's forward
reports ``hidden[i]`` = the residual stream *leaving* layer ``i``, so tap ``k`` is ``hidden[k - 1]``
(:func:`engine_layers`). ``FINAL`` (-1) is the final normed state (FastEagle's and Falcon's regression target).

**Storage.** ``make-data --features`` (or training, on first use) stores per record ``OUT/features/<key>.safetensors``
with ``taps`` ``[T, n_taps, hidden]`` and ``final`` ``[T, hidden]`` in bf16 (T = prompt + response tokens), written to
a temporary name and renamed, so a file is whole or absent. :class:`FeatureStore` reads them, computing (and caching)
any that are missing -- training also works without a stored pass.

**On an accelerator** (:class:`ForwardFeatures`) the features are computed per training batch by the target's HF
model on the device and never stored: one batched forward there costs less than reading them from disk (about
4.6 KB per token at bf16: 11 GB for 2.4 M tokens of the default model). That model multiplies the dequantised
weights in floating point (the ``exact`` arithmetic; TF32 products on a GPU), so its features differ from the ``q8``
engine's (by about 6% in the final state of the default model, where q8 rounds every activation row to 8 bits); a
drafter only proposes, and what it trains on changes its acceptance, never the output.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

FINAL = -1
FEATURES_DIR = "features"
CHUNK = 256  # tokens per forward while computing features


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
    """The layers whose *inputs* an EAGLE-3 drafter reads, in HF ``hidden_states`` indexing: ``(2, L//2, L-3)``
    (kept inside ``1 .. L-1`` for the tiny models of tests)."""
    return tuple(min(max(k, 1), max(n_layers - 1, 1)) for k in (2, n_layers // 2, n_layers - 3))


def engine_layers(aux_layers) -> tuple[int, ...]:
    """``hidden_layers`` to ask the engine's forward for: the input of layer k is the output of layer k - 1."""
    return tuple(int(k) - 1 for k in aux_layers)


@torch.inference_mode()
def compute_features(target, ids, aux_layers=None) -> dict[str, torch.Tensor]:
    """``taps`` ``[T, len(aux), hidden]`` and ``final`` ``[T, hidden]`` (fp32) of the token ids ``ids``, computed by the
    target's decoding forward in chunks over one KV cache (the same numbers the engine gives at decode time)."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    aux = default_aux_layers(target.config.num_hidden_layers) if aux_layers is None else tuple(aux_layers)
    layers = engine_layers(aux) + (FINAL,)
    cache = target.new_cache(ids.numel() + 1)
    taps, final = [], []
    for start in range(0, ids.numel(), CHUNK):
        end = min(ids.numel(), start + CHUNK)
        out = target.forward(ids[start:end], torch.arange(start, end), cache, hidden_layers=layers, last_only=True)
        cache.keep(range(end - start))
        taps.append(torch.stack([out.hidden[k] for k in engine_layers(aux)], dim=1).float())
        final.append(out.hidden[FINAL].float())
    return {"taps": torch.cat(taps), "final": torch.cat(final)}


class ForwardFeatures:
    """Features computed by a copy of the target's HF model on ``device`` (fp32), per batch, never stored."""

    def __init__(self, target, device, *, aux_layers=None):
        import copy

        self.device = torch.device(device)
        self.aux = default_aux_layers(target.config.num_hidden_layers) if aux_layers is None else tuple(aux_layers)
        if self.device.type == "cuda":  # TF32 products: ~1e-3 relative, far inside the q8/exact gap
            torch.backends.cuda.matmul.allow_tf32 = True
        model = copy.deepcopy(target.hf_model).float().to(self.device).eval()
        self.base = getattr(model, "model", model)  # the decoder stack without the LM head (not needed here)

    @torch.no_grad()  # not inference_mode: the drafter's autograd saves these tensors for its backward
    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` [B, T] right-padded -> ``taps`` [B, T, n_taps * hidden], ``final`` [B, T, hidden] (fp32, on the
        device). Right padding needs no mask: a causal model's real rows never see the padding after them."""
        out = self.base(input_ids=ids.to(self.device), output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[k] for k in self.aux], dim=-1)  # [k] = the input of layer k
        return taps.float(), out.last_hidden_state.float()  # last_hidden_state: after the final norm

    def get(self, record: dict) -> dict[str, torch.Tensor]:
        """One record's features as :meth:`FeatureStore.get` gives them (on the CPU)."""
        ids = torch.tensor(list(record["prompt_ids"]) + list(record["response_ids"]), device=self.device)[None]
        taps, final = self.batch(ids)
        T = ids.shape[1]
        return {"taps": taps[0].view(T, len(self.aux), -1).cpu(), "final": final[0].cpu()}


class FeatureStore:
    """Per-record features of a ``make-data`` folder: read from ``OUT/features/`` when stored, else computed with
    ``target`` (and stored when ``write``)."""

    def __init__(self, folder, target=None, *, aux_layers=None, write: bool = True):
        self.dir = Path(folder) / FEATURES_DIR
        self.target, self.aux_layers, self.write = target, aux_layers, write

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, feats: dict[str, torch.Tensor]) -> None:
        """Store features (bf16), atomically."""
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in feats.items()}, str(tmp))
        os.replace(tmp, path)

    def get(self, record: dict) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.path(record["key"])
        ids = list(record["prompt_ids"]) + list(record["response_ids"])
        if path.is_file():
            feats = load_file(str(path))
            if feats["taps"].shape[0] == len(ids):
                return {k: v.float() for k, v in feats.items()}
        if self.target is None:
            raise FileNotFoundError(f"no stored features for record {record['key']} and no target to compute them")
        feats = compute_features(self.target, ids, self.aux_layers)
        if self.write:
            self.put(record["key"], feats)
        return feats
