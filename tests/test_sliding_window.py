"""Sliding-window models are decoded exactly as their own ``generate()`` decodes them, past the window too."""

from __future__ import annotations

import pytest
import torch

import fastforward as ff
from fastforward.model import TargetModel, sliding_window_of
from fastforward.testing import TinyTokenizer


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **extra)
    return AutoModelForCausalLM.from_config(config).double().eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["lean", "hf"])
@pytest.mark.parametrize("method", ["ar", "pld", "tr-jacobi", "lookahead"])
def test_mistral_window_past_the_window_equals_hf_generate(method, backend):
    model = _tiny("mistral", sliding_window=8)
    assert sliding_window_of(model.config) == (8, True)
    target = TargetModel("tiny-mistral", model, TinyTokenizer(96), backend=backend)
    assert target.backend_name == backend and target.max_context == 256
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10]  # already longer than the window
    expected = _hf_greedy(model, prompt, 30)
    assert ff.generate(target, prompt, method, max_new_tokens=30).token_ids == expected


def test_window_ignored_would_differ():
    """The check above can fail: without the window the same model decodes differently."""
    model = _tiny("mistral", sliding_window=8)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10]
    full = TargetModel("full", model, TinyTokenizer(96), backend="hf")
    full.backend.sliding_window = None
    assert ff.generate(full, prompt, max_new_tokens=30).token_ids != _hf_greedy(model, prompt, 30)


def test_configs_without_an_active_window():
    qwen = _tiny("qwen2", sliding_window=8, use_sliding_window=False)
    assert sliding_window_of(qwen.config) == (None, False)
    target = TargetModel("tiny-qwen2", qwen, TinyTokenizer(96))
    assert target.backend_name == "lean"  # no window in force: the lean forward is exact


def test_some_layers_sliding_run_past_the_window_on_the_lean_forward():
    """Layers that slide beside layers that do not: the lean forward applies each layer's own window."""
    model = _tiny("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1)
    target = TargetModel("tiny-qwen2-swa", model, TinyTokenizer(96))
    assert target.backend_name == "lean" and target.max_context == 256
    assert [layer.window for layer in target.backend.layers] == [0, 8]
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10]
    assert ff.generate(target, prompt, "pld", max_new_tokens=20).token_ids == _hf_greedy(model, prompt, 20)


def test_some_layers_sliding_is_capped_at_the_window_on_hf():
    """On the HF backend, layers that slide beside layers that do not are exact only inside the window, so the
    context stops there."""
    model = _tiny("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1)
    window, every_layer = sliding_window_of(model.config)
    assert window == 8 and not every_layer
    target = TargetModel("tiny-qwen2-swa", model, TinyTokenizer(96), backend="hf")
    assert target.max_context == 8
    result = ff.generate(target, [1, 2, 3], max_new_tokens=20)
    assert result.finish_reason == "context" and len(result.token_ids) < 8
    with pytest.raises(ff.UsageError, match="context"):
        ff.generate(target, list(range(1, 12)), max_new_tokens=5)
