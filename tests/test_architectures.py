"""Architectures on the lean forward, each a tiny random model with its distinctive features on (Llama 3 and linear
rope scaling, Qwen2's QKV biases, Qwen3's q/k norms, Phi-3's fused projections, ...), from an HF folder and from GGUF
files written under llama.cpp's names and layout:

* exact arithmetic (F32 GGUF, HF folder): logits within 1e-4 of transformers' forward, greedy output identical to
  transformers' ``generate``, on the native layer ops and on the plain-torch path;
* q8 arithmetic (Q8_0 GGUF): every method equal to its own AR;
* the GGUF files load and evaluate in llama.cpp (where llama_cpp imports), its logits close to transformers'.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.gguf_file import read_gguf
from fastforward.kernels import load_native
from fastforward.model import TargetModel
from fastforward.model.lean import LeanLlama, lean_gguf_problem, native_options
from fastforward.testing import TinyTokenizer, tiny_tokenizer_hf, write_hf_gguf

VOCAB = 260
native = load_native()
needs_native = pytest.mark.skipif(native is None, reason="the native kernels are unavailable here")

#: name -> (HF model type, config settings): each architecture with its distinctive features on
ARCHS = {
    "llama3-rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                        "factor": 4.0}}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"sliding_window": None}),
    "phi3-window": ("phi3", {"sliding_window": 8}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    # Gemma: tied heads (llama.cpp's gemma2 has no output tensor); queries scaled by head_dim ** -0.5 (what llama.cpp
    # uses below the 27B models, whose query_pre_attn_scalar is head_dim too)
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", {"sliding_window": 8, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                      "factor": 8.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0}}}),
}
#: the sliding window (8) of the models that have one: llama.cpp applies Gemma's, not Mistral's or Phi-3's
WINDOWS = {"phi3-window": 8, "mistral-window": 8, "gemma2": 8, "gemma3": 8}
LLAMA_CPP_IGNORES_WINDOW = {"phi3-window", "mistral-window"}
PROMPT = [(i * 37 + 5) % 259 for i in range(40)]  # longer than Llama 3's original context here (32)


def build(name: str, seed: int = 0):
    """The tiny random fp32 HF model of an architecture: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, biases and
    norm weights random too (HF initialises them to 0 and 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = ARCHS[name]
    torch.manual_seed(seed)
    extra = {"tie_word_embeddings": False, **extra}
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in pname:
                p.normal_(1.0, 0.2)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (HF model, HF folder, F32 GGUF, Q8_0 GGUF, F16 GGUF, Q4_0 GGUF), built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            model = build(name)
            root = tmp_path_factory.mktemp(name)
            folder = root / "hf"
            model.save_pretrained(folder)
            tiny_tokenizer_hf().save_pretrained(folder)
            files = {t: root / f"{t}.gguf" for t in ("F32", "Q8_0", "F16", "Q4_0")}
            for t, path in files.items():
                write_hf_gguf(model, path, linear_type=t)
            cache[name] = (model, folder, *files.values())
        return cache[name]

    return get


def lean_target(made, name: str, source: str, path: str = "native"):
    """The exact lean target of ``name`` from its HF folder or F32 GGUF, on the native ops or the torch path."""
    model, folder, f32 = made(name)[:3]
    target = ff.load(str(folder)) if source == "hf" else ff.load(str(f32), arithmetic="exact")
    assert target.backend_name == "lean"
    target.eos_token_ids = set()  # decode the full length, as generate(min_new_tokens=n) does
    if path == "torch":
        target.backend.ops = None
    return target


@needs_native
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_exact_logits_match_transformers(made, name, source, path):
    model = made(name)[0]
    target = lean_target(made, name, source, path)
    ids = torch.tensor(PROMPT)
    got = target.forward(ids, torch.arange(len(PROMPT)), target.new_cache(64)).logits
    assert (got - hf_logits(model, PROMPT)).abs().max().item() < 1e-4
    # a tree step over the cached prefix: each row as decoded alone
    cache = target.new_cache(64)
    target.forward(ids[:30], torch.arange(30), cache)
    cache.keep(range(30))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    step = target.forward(ids[30:33], torch.tensor([30, 31, 31]), cache, tree).logits
    ref = hf_logits(model, PROMPT[:32])
    alt = hf_logits(model, PROMPT[:31] + [PROMPT[32]])
    assert (step[:2] - ref[30:32]).abs().max().item() < 1e-4
    assert (step[2] - alt[31]).abs().max().item() < 1e-4


@needs_native
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_greedy_equals_transformers_generate(made, name, source):
    model = made(name)[0]
    target = lean_target(made, name, source)
    prompt = PROMPT[:12]
    expected = hf_greedy(model, prompt, 24)
    for method in ("ar", "pld"):
        assert ff.generate(target, prompt, method, max_new_tokens=24).token_ids == expected, method


@needs_native
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_f16_gguf_is_the_model_with_fp16_weights(made, name):
    """An F16 file in the exact arithmetic: transformers' forward over the weights rounded to fp16 (norms and
    biases stay fp32, as llama.cpp's converter writes them)."""
    import copy

    model, f16 = made(name)[0], made(name)[4]
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    target = ff.load(str(f16), arithmetic="exact")
    got = target.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), target.new_cache(64)).logits
    assert (got - hf_logits(rounded, PROMPT)).abs().max().item() < 1e-4


_q8_targets: dict = {}


def q8_target(made, name, fmt="Q8_0"):
    if (name, fmt) not in _q8_targets:
        target = ff.load(str(made(name)[3 if fmt == "Q8_0" else 5]), arithmetic="q8")
        assert target.backend_name == "lean" and target.arithmetic == "q8"
        target.eos_token_ids = set()
        _q8_targets[name, fmt] = target
    return _q8_targets[name, fmt]


@needs_native
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", sorted(ARCHS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16), max_new=st.integers(1, 30),
       method=st.sampled_from(["jacobi", "pld", "lookahead", "tr-jacobi"]))
def test_q8_every_method_equals_its_ar(made, name, fmt, prompt, max_new, method):
    target = q8_target(made, name, fmt)
    ar = ff.generate(target, prompt, "ar", max_new_tokens=max_new).token_ids
    assert ff.generate(target, prompt, method, max_new_tokens=max_new).token_ids == ar


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_gguf_loads_in_llama_cpp(made, name):
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    model, _, f32, q8 = made(name)[:4]
    ids = PROMPT[: WINDOWS[name] if name in LLAMA_CPP_IGNORES_WINDOW else 12]
    for path in (f32, q8):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
        llm.eval(ids)
        scores = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
        assert torch.isfinite(scores).all()
        if path == f32:  # llama.cpp's own arithmetic (fp16 KV cache) over the same weights: close
            assert (scores - hf_logits(model, ids)).abs().max().item() < 0.1
        llm.close()


@needs_native
def test_qwen3_layers_skip_the_fused_packed_layer(made):
    """A layer with q/k norms runs in separate calls (the fused packed layer has no norm step); Llama's still fuse."""
    qwen3 = q8_target(made, "qwen3").backend
    assert all(layer.q_norm is not None and layer.packed_weights() is None for layer in qwen3.layers)
    llama = q8_target(made, "llama3-rope").backend
    if hasattr(native, "packed_layer"):
        assert all(layer.packed_weights() is not None for layer in llama.layers)


@needs_native
def test_without_rope_freqs_the_llama3_gguf_would_differ(made, tmp_path):
    """The Llama 3 check can fail: the same file read without its frequency factors gives other logits."""
    model, _, f32 = made("llama3-rope")[:3]
    g = read_gguf(f32)
    del g.tensors["rope_freqs.weight"]
    plain = LeanLlama.from_gguf(g, native)
    got = plain.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), plain.new_cache(64)).logits
    assert (got - hf_logits(model, PROMPT)).abs().max().item() > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64},
])
def test_other_rope_types_run_on_hf_with_a_notice_or_are_refused_on_lean(rope, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, rope_parameters=rope, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config).eval()
    target = TargetModel("scaled", model, TinyTokenizer(96))
    assert target.backend_name == "hf"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and rope["rope_type"] in err[0] and "HF backend" in err[0]
    with pytest.raises(ff.UsageError, match=rope["rope_type"]):
        TargetModel("scaled", model, TinyTokenizer(96), backend="lean")


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_windowed_models_run_on_the_lean_forward_past_their_window(made, name):
    """Past the window the lean forward is the model's own (checked against transformers above); reading the files
    without the window would differ, so the window is what the checks above test."""
    model, _, f32 = made(name)[:3]
    g = read_gguf(f32)
    assert g.hparams["sliding_window"] == WINDOWS[name] and len(PROMPT) > WINDOWS[name]
    g.hparams["sliding_window"] = None
    plain = LeanLlama.from_gguf(g, native)
    got = plain.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), plain.new_cache(64)).logits
    assert (got - hf_logits(model, PROMPT)).abs().max().item() > 1e-2


def test_gguf_problems_are_named(made):
    g = read_gguf(made("llama-linear-rope")[2])
    assert g.hparams["rope_scaling"] == "linear" and g.hparams["rope_scale_factor"] == 4.0
    assert lean_gguf_problem(g) is None
    g.hparams["rope_scaling"] = "yarn"
    assert "yarn" in lean_gguf_problem(g)
    with pytest.raises(ff.UsageError, match="yarn"):
        LeanLlama.from_gguf(g, native)
    g.hparams["rope_scaling"] = "none"
    g.hparams["rope_dim"] = 8
    assert "partial rotary" in lean_gguf_problem(g)


@needs_native
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window", "qwen2", "llama3-rope"])
def test_rows_with_attention_options_are_bitwise_the_rows_alone(made, name, path):
    """Models with attention options (windows, soft-caps, Gemma's layer) run the native ops where the kernel takes
    the options, else the torch path, its attention row by row over each row's visible keys: on both, a chunk of
    rows past the window gives every row the bits it gets decoded alone."""
    target = q8_target(made, name)
    backend = target.backend
    assert backend.has_options or name in ("qwen2", "llama3-rope")  # plain layers: a decoding step too
    assert backend.ops is None or native_options(backend.ops)
    ops = backend.ops
    if path == "torch":
        backend.ops = None
    try:
        ids = torch.tensor(PROMPT[:20])
        cache = target.new_cache(32)
        target.forward(ids[:10], torch.arange(10), cache)
        cache.keep(range(10))
        chunk = target.forward(ids[10:], torch.arange(10, 20), cache).logits
        alone = []
        cache.crop(10)
        for i in range(10, 20):
            alone.append(target.forward(ids[i : i + 1], torch.tensor([i]), cache).logits[0])
            cache.keep([0])
        assert torch.equal(chunk, torch.stack(alone))
    finally:
        backend.ops = ops
