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


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer_hf():
    """A real, self-contained HF fast tokenizer: byte-level (every UTF-8 text encodes, one token per byte, ids
    0-255), plus ``<|endoftext|>`` (256, pad), ``<|im_start|>`` (257) and ``<|im_end|>`` (258, EOS), and a
    ChatML-style chat template. Built in code; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable byte mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def tiny_hf_folder(path, *, max_positions=512, seed=0, hidden_size=64, layers=2, **kw):
    """Save a tiny random fp32 Llama and :func:`tiny_tokenizer_hf` as a local HF folder at ``path`` (a model
    ``fastforward.load(path)``, ``fastforward generate --model path`` and ``fastforward train`` accept); return it.

    The vocabulary is 260 (259 tokens, padded); ``<|im_end|>`` is the EOS of tokenizer, config and generation
    config. Extra keyword arguments go to :func:`tiny_llama_hf`.
    """
    from pathlib import Path

    from .model import _quiet_transformers

    _quiet_transformers()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer_hf()
    model = tiny_llama_hf(vocab_size=260, hidden_size=hidden_size, layers=layers, max_positions=max_positions,
                          seed=seed, dtype=torch.float32, **kw)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
