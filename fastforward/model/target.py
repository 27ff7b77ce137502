"""The target model: tokenizer, text encoding/decoding, and the forward backend the decoders call."""

from __future__ import annotations

import sys

import torch

from ..errors import UsageError
from .forward import ForwardOutput, ForwardRequest
from .hf import HFForward, sliding_window_of
from .lean import LeanLlama, hf_lean_problem
from .slots import HasSlots

LEAN_ARCHITECTURES = {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text"}


class TargetModel(HasSlots):
    """A loaded causal LM: tokenizer, the forward backend the decoders use, and (for peers, training and the HF
    backend) the HF model -- made on first use when the target was built straight from a GGUF file.

    ``target.shared(key, build)`` holds what is built once per target and lives as long as it does (drafter runners,
    draft models, datastores, the cost model): :mod:`fastforward.model.slots`."""

    def __init__(self, name: str, hf_model, tokenizer, backend: str = "auto", small_q_max: int = 4,
                 weights: str = "fp32"):
        self.name = name
        self._hf_model = hf_model.eval()
        self._hf_loader = None
        self.tokenizer = tokenizer
        self.config = hf_model.config
        model_type = getattr(self.config, "model_type", "")
        window, every_layer = sliding_window_of(self.config)
        problem = None
        if model_type in LEAN_ARCHITECTURES:
            problem = hf_lean_problem(self.config, hf_model.dtype)
        lean_ok = model_type in LEAN_ARCHITECTURES and problem is None
        if backend == "auto":
            backend = "lean" if lean_ok else "hf"
            if problem is not None:
                print(f"fastforward: {name} runs on the HF backend (the lean forward does not run {problem})",
                      file=sys.stderr)
        if backend == "lean" and not lean_ok:
            if problem is not None:
                raise UsageError(f"the lean backend does not run {problem} ({model_type}); use the HF backend")
            raise UsageError(f"the lean backend supports {sorted(LEAN_ARCHITECTURES)}, not '{model_type}'")
        if backend not in ("lean", "hf"):
            raise UsageError(f"unknown backend '{backend}' (use auto, lean or hf)")
        self.backend_name = backend
        if weights != "fp32" and backend != "lean":
            raise UsageError(f"--weights {weights} needs the lean backend")
        self.backend = (LeanLlama.from_hf(hf_model, small_q_max, weights=weights) if backend == "lean"
                        else HFForward(hf_model, sliding_window=window if every_layer else None))
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.max_context = self.backend.max_positions
        if backend == "hf" and window is not None and not every_layer:
            # Some layers slide, others do not: exact only while the whole context fits the window.
            self.max_context = min(self.max_context, window)
        self.eos_token_ids = _eos_ids(hf_model, tokenizer)

    @classmethod
    def from_gguf(cls, name: str, gguf_model, tokenizer, native, hf_loader, arithmetic: str = "exact") -> TargetModel:
        """The lean forward straight over a GGUF file's packed weights, multiplied in ``arithmetic``;
        ``hf_loader()`` gives the HF model (the dequantised fp32 model) when something asks for it (peers,
        training)."""
        self = cls.__new__(cls)
        self.name = name
        self._hf_model = None
        self._hf_loader = hf_loader
        self.tokenizer = tokenizer
        self.config = _GGUFConfig(gguf_model)
        self.backend_name = "lean"
        self.backend = LeanLlama.from_gguf(gguf_model, native, arithmetic)
        self.vocab_size = self.backend.head.out_features
        self.max_context = self.backend.max_positions
        eos = {gguf_model.metadata.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)}
        self.eos_token_ids = {int(e) for e in eos if e is not None}
        return self

    @property
    def arithmetic(self) -> str:
        """'exact' or 'q8': how the target's matrix products are computed (:mod:`fastforward.arithmetic`), i.e.
        which model every method reproduces."""
        return getattr(self.backend, "arithmetic", "exact")

    @property
    def kv_precision(self) -> str:
        """'fp32' or 'fp16': how the lean forward's KV cache stores keys and values (part of the model every method
        reproduces); the HF backend's cache is 'fp32' here (its own dtype)."""
        return getattr(self.backend, "kv_precision", "fp32")

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype of the forward the decoders use."""
        return self.backend.dtype if self.backend_name == "lean" else self.hf_model.dtype

    @property
    def hf_model(self):
        if self._hf_model is None:
            self._hf_model = self._hf_loader().eval()
        return self._hf_model

    # The decoding primitives ------------------------------------------------------------------------------------
    def new_cache(self, capacity: int):
        return self.backend.new_cache(min(capacity, self.max_context))

    def forward(self, ids, positions, cache, tree_mask=None, hidden_layers=(), last_only=False,
                write_slots=None) -> ForwardOutput:
        """One forward over q new tokens (see :class:`~fastforward.model.forward.ForwardRequest` for the slots)."""
        if write_slots is None:
            return self.backend.forward(ids, positions, cache, tree_mask, hidden_layers, last_only)
        if self.backend_name != "lean":
            raise UsageError("explicit write slots need the lean backend")
        return self.backend.forward(ids, positions, cache, tree_mask, hidden_layers, last_only, write_slots)

    def forward_many(self, requests: list[ForwardRequest], hidden_layers=()) -> list[ForwardOutput]:
        """One forward over several sequences' new tokens (see :meth:`LeanLlama.forward_many`); backends that
        cannot share a forward run the sequences one after another. Outputs in the order of ``requests``."""
        many = getattr(self.backend, "forward_many", None)
        if many is not None:
            return many(requests, hidden_layers)
        return [self.forward(r.ids, r.positions, r.cache, r.tree_mask, hidden_layers, write_slots=r.write_slots)
                for r in requests]

    def batch_rows_limit(self) -> int:
        """Rows one shared forward may carry (0: the backend runs sequences one by one)."""
        limit = getattr(self.backend, "batch_rows_limit", None)
        return limit() if limit is not None else 0

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


class _GGUFConfig:
    """The HF-config attributes the package reads, from a GGUF file's hyper-parameters."""

    def __init__(self, gguf_model):
        hp = gguf_model.hparams
        self.model_type = gguf_model.architecture
        self.num_hidden_layers = hp["n_layers"]
        self.hidden_size = hp["hidden_size"]
        self.intermediate_size = hp["intermediate_size"]
        self.num_attention_heads = hp["n_heads"]
        self.num_key_value_heads = hp["n_kv_heads"]
        self.head_dim = hp["head_dim"]
        self.rms_norm_eps = hp["eps"]
        self.rope_theta = hp["rope_theta"]
        self.max_position_embeddings = hp["max_positions"]
        self.eos_token_id = gguf_model.metadata.get("eos_token_id")
        self.bos_token_id = gguf_model.metadata.get("bos_token_id")


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
