"""Tiny randomly initialised models for tests (no downloads), usable by fastforward's tests and by users' own."""

from __future__ import annotations

import torch

from .model import TargetModel


class TinyTokenizer:
    """A stand-in tokenizer: token i is the word ``t{i}``; no chat template; optional EOS id."""

    chat_template = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def __call__(self, text, add_special_tokens=True):
        ids = [int(w[1:]) % self.vocab_size for w in text.split() if w.startswith("t") and w[1:].isdigit()]
        return {"input_ids": ids or [1]}

    def decode(self, ids, skip_special_tokens=True):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(f" t{i}" for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def tiny_llama_hf(vocab_size=96, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                  max_positions=512, seed=0, dtype=torch.float64, init_std=0.3, model_type="llama"):
    """A tiny random HF Llama (or Qwen2) causal LM. A large init std keeps logits far from ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate_size, max_position_embeddings=max_positions,
        initializer_range=init_std, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model


def tiny_target(backend="lean", eos_token_id=None, **kw) -> TargetModel:
    """A :class:`TargetModel` over a tiny random Llama; float64 by default so argmax ties never decide a test."""
    model = tiny_llama_hf(**kw)
    tok = TinyTokenizer(model.config.vocab_size, eos_token_id)
    if eos_token_id is not None:
        model.config.eos_token_id = eos_token_id
        model.generation_config.eos_token_id = eos_token_id
    return TargetModel("tiny-llama", model, tok, backend=backend)
