"""A tiny chat model as a self-contained GGUF file, for tests that talk to a model through its chat template -- in
this process or in a child ``fastforward chat`` that loads it by path.

The file is a tiny random Llama with Q8_0 weights (the packed path: every row of a forward computed as alone, so
KV entries are reusable across turns), a byte-level GPT-2-style tokenizer (one token per byte, ids 0-255, plus
``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258 = EOS) and :data:`fastforward.testing.
TINY_CHAT_TEMPLATE`. Its output head scores only printable ASCII and EOS (every other row is zero, and the largest of
~95 random logits is positive), so a greedy answer is ASCII text whose bytes encode back to the same tokens: a turn's
prompt then starts with exactly the tokens of the turns before it.
"""

from __future__ import annotations

from unittest import mock

import torch

from fastforward import testing

#: the tokens the head may choose: printable ASCII and EOS (<|im_end|>)
ALLOWED = [*range(32, 127), 258]


def _chat_vocab(writer, vocab_size: int) -> None:
    from gguf import TokenType
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=testing._byte_of)
    merged = alphabet[0] + alphabet[1]  # one merge (gpt2 tokenizers need merges): two control bytes, never met
    tokens = alphabet + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", merged]
    types = [TokenType.NORMAL] * 256 + [TokenType.CONTROL] * 3 + [TokenType.NORMAL]
    assert len(tokens) == vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{alphabet[0]} {alphabet[1]}"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(256)
    writer.add_add_bos_token(False)
    writer.add_chat_template(testing.TINY_CHAT_TEMPLATE)


def write_tiny_chat_gguf(path, *, seed: int = 0, layers: int = 4, max_positions: int = 1024, eos: bool = True):
    """Write the tiny chat model (see the module docstring) to ``path``; returns the path. ``eos=False``: its head
    never chooses EOS (every answer runs to its token budget)."""
    model = testing.tiny_llama_hf(vocab_size=260, layers=layers, max_positions=max_positions, seed=seed,
                                  dtype=torch.float32)
    with torch.no_grad():
        keep = torch.zeros(260, dtype=torch.bool)
        keep[ALLOWED if eos else ALLOWED[:-1]] = True
        model.lm_head.weight[~keep] = 0.0
    with mock.patch.object(testing, "_add_byte_vocab", _chat_vocab):
        testing.write_hf_gguf(model, path, linear_type="Q8_0")
    return path
