"""Integration on the default model (SmolLM2-135M-Instruct): the engine against Hugging Face itself."""

import random

import pytest
import torch

import fastforward as ff
from fastforward import DraftTree, Proposal, Proposer, TreeShape

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a KV cache, briefly, then say why they matter.",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_backend(default_model):
    """The same weights through the HF fallback forward."""
    return ff.from_hf(default_model.hf_model, default_model.tokenizer, name="hf", backend="hf")


def hf_greedy(model, prompt_ids, max_new_tokens):
    eos = sorted(model.eos_token_ids)
    with torch.inference_mode():
        out = model.hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_engine_ar_equals_hf_generate(default_exact, prompt):
    """In the exact arithmetic the packed forward computes the dequantised model's products, as HF does."""
    ids = default_exact.encode(prompt)
    assert len(ids) > 10  # chat-templated
    want = hf_greedy(default_exact, ids, 48)
    got = ff.generate(default_exact, ids, "ar", max_new_tokens=48)
    assert got.token_ids == want
    assert got.stats.tau == 1.0
    assert got.text.strip()


@pytest.fixture(scope="module")
def lean_fp32(default_model):
    """The lean forward over the dequantised fp32 weights (the default model runs them packed)."""
    return ff.from_hf(default_model.hf_model, default_model.tokenizer, name="fp32", backend="lean")


def test_lean_forward_equals_hf_forward(lean_fp32, hf_backend):
    ids = torch.tensor(lean_fp32.encode(PROMPTS[1]))
    pos = torch.arange(len(ids))
    a = lean_fp32.forward(ids, pos, lean_fp32.new_cache(256)).logits
    b = hf_backend.forward(ids, pos, hf_backend.new_cache(256)).logits
    assert a.shape == b.shape == (len(ids), lean_fp32.vocab_size)
    assert (a - b).abs().max() < TOL


def test_packed_forward_is_as_close_to_exact_as_hf(default_exact, hf_backend):
    """The packed forward (exact arithmetic) and HF's fp32 forward each within TOL of a float64 forward over the
    same weights (their own difference is the sum of two independent rounding errors of ~1e-4 each)."""
    import copy

    ids = torch.tensor(default_exact.encode(PROMPTS[1]))
    pos = torch.arange(len(ids))
    packed = default_exact.forward(ids, pos, default_exact.new_cache(256)).logits.double()
    hf = hf_backend.forward(ids, pos, hf_backend.new_cache(256)).logits.double()
    with torch.no_grad():
        exact = copy.deepcopy(default_exact.hf_model).double()(ids[None]).logits[0]
    assert packed.shape == exact.shape == (len(ids), default_exact.vocab_size)
    assert (packed - exact).abs().max() < TOL
    assert (hf - exact).abs().max() < TOL


def test_lean_tree_step_equals_hf(default_exact, hf_backend):
    ids = default_exact.encode(PROMPTS[0])
    prefix = torch.tensor(ids[:-1])
    rng = random.Random(0)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8]
    tokens = [ids[-1]] + [rng.randrange(default_exact.vocab_size) for _ in parents[1:]]
    shape = TreeShape(parents)
    outs = []
    for target in (default_exact, hf_backend):
        cache = target.new_cache(256)
        target.forward(prefix, torch.arange(len(prefix)), cache)
        cache.keep(range(len(prefix)))
        out = target.forward(torch.tensor(tokens), shape.depths + len(prefix), cache, shape.ancestor_mask,
                             hidden_layers=(5, -1))
        outs.append(out)
    assert (outs[0].logits - outs[1].logits).abs().max() < TOL
    for i in (5, -1):
        assert (outs[0].hidden[i] - outs[1].hidden[i]).abs().max() < TOL


def test_tree_proposer_equals_ar_on_default_model(default_model):
    """Drafted trees (half right, half wrong) through the engine give AR's tokens on the real model too."""
    ids = default_model.encode(PROMPTS[2])
    want = ff.generate(default_model, ids, "ar", max_new_tokens=40)

    class HalfRight(Proposer):
        name = "half-right"

        def __init__(self):
            self.rng = random.Random(1)

        def max_proposal_size(self):
            return 7

        def propose(self, state):
            g = state.generated
            truth = want.token_ids[g : g + 3]
            noise = [self.rng.randrange(default_model.vocab_size) for _ in range(3)]
            tokens = [state.root] + truth + noise
            parents = [-1] + [0, 1, 2][: len(truth)] + [0, 0, 1]
            parents = parents[: len(tokens)]
            return Proposal(DraftTree.from_parents(tokens[: len(parents)], parents))

    got = ff.generate(default_model, ids, HalfRight(), max_new_tokens=40)
    assert got.token_ids == want.token_ids
    assert got.stats.target_forwards < want.stats.target_forwards


def test_second_load_reads_the_cached_conversion(default_model, monkeypatch):
    """After the first load converted the GGUF file, later loads read the cached safetensors and never convert
    again (how long that takes is reported by `fastforward generate --stats`, not asserted here)."""
    import fastforward.model.loading as model_module

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(model_module, "convert_gguf", no_conversion)
    again = ff.load()
    assert again.backend_name == "lean"
    assert again.vocab_size == default_model.vocab_size


def test_first_load_converts_to_a_plain_trainable_model(tmp_path, monkeypatch):
    """The very first load (empty cache) returns the same kind of model as later loads: not flagged as quantised,
    so `.float()` and training work on a fresh machine (they once failed only there)."""
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    first = ff.load(backend="hf")
    assert any(tmp_path.iterdir())
    assert not getattr(first.hf_model, "is_quantized", False)
    assert first.hf_model.float() is first.hf_model


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon", "sps"])
def test_shipped_drafters_equal_ar_on_default_model(default_model, method):
    """The drafters that ship for the default model load, draft, and leave the greedy output AR's."""
    for prompt in PROMPTS[:2]:
        ids = default_model.encode(prompt)
        want = ff.generate(default_model, ids, "ar", max_new_tokens=40)
        got = ff.generate(default_model, ids, method, max_new_tokens=40)
        assert got.token_ids == want.token_ids, prompt


def test_shipped_pasta_model_decodes_with_forks_and_valid_annotations(default_model):
    """The shipped PASTA adapter over the default model (merged once into a cached folder): the alias loads, the
    interpreter decodes it, and every answer it writes parses (its annotated ids obey PASTA-LANG's grammar)."""
    from fastforward.pasta.language import PastaVocab, parse_ids

    model = ff.load("smollm2-135m-pasta")
    vocab = PastaVocab.from_tokenizer(model.tokenizer)
    assert vocab is not None and max(vocab.all_ids) < model.vocab_size
    forks = 0
    prompts = ["Give me three tips for staying healthy.", "List four ways to save money, with a short reason each."]
    for prompt in prompts:
        got = ff.generate(model, prompt, "pasta", max_new_tokens=160)
        ids = got.stats.method_stats["annotated_ids"]
        if got.finish_reason == "eos":
            parse_ids(ids, vocab, model.eos_token_ids)
        forks += got.stats.method_stats["forks"]
        assert got.text.strip()
    assert forks > 0  # the shipped model does write promises on list-shaped prompts


@pytest.mark.parametrize("method", ["pld", "lookahead", "eagle"])
def test_seeded_sampling_gives_ar_tokens_on_default_model(default_model, method):
    """Keyed draws: with a seed, a method whose drafts are guesses samples exactly AR's tokens on the real model."""
    ids = default_model.encode(PROMPTS[0])
    want = ff.generate(default_model, ids, "ar", max_new_tokens=40, temperature=0.8, seed=3)
    got = ff.generate(default_model, ids, method, max_new_tokens=40, temperature=0.8, seed=3)
    assert got.token_ids == want.token_ids
