"""Speculative sampling with a draft model (``--method sps``) and the draft-model format and training
(``fastforward train draft-model``): greedy == AR, the sampling distribution (chi-square), the draft's KV cache kept in
step, refusals (tokenizer, target, options), save -> load round trip, and a training smoke run."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.drafters.draft_model import (
    choose_layers,
    draft_target,
    init_draft_model,
    load_draft_model,
    save_draft_model,
    target_probe,
)
from fastforward.drafters.pieces import DrafterLinear, target_head_rows
from fastforward.engine import GenerationStats, decode_steps
from fastforward.errors import UsageError
from fastforward.model import TargetModel
from fastforward.proposers import make_proposer
from fastforward.proposers.sps import DraftModelProposer, load_draft
from fastforward.testing import (
    TinyTokenizer,
    chi2_critical,
    exact_joint,
    pooled_chi2,
    tiny_gguf_target,
    tiny_hf_folder,
    tiny_llama_hf,
    tiny_target,
)
from fastforward.verify import SamplingConfig

VOCAB = 96  # the conftest tiny model's


def _perturb(model, std: float, seed: int = 0) -> None:
    """Add noise to a draft's own weights (not the shared embedding/head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.requires_grad and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def _draft_folder(target, path, layers=2, init="first", std=0.02, seed=0):
    lm, meta = init_draft_model(target, layers, init)
    _perturb(lm, std, seed)
    save_draft_model(lm, meta, path, target_probe(target))
    return path, lm, meta


@pytest.fixture(scope="module")
def other_draft():
    """A different random tiny model with the same vocabulary (and the same stand-in tokenizer)."""
    return tiny_target(seed=1, layers=1)


@pytest.fixture(scope="module")
def noisy_folder(tiny, tmp_path_factory):
    """A draft-model folder: the target's own layers, slightly perturbed (agrees often, not always)."""
    return str(_draft_folder(tiny, tmp_path_factory.mktemp("noisy"), layers=2, init="first", std=0.03)[0])


EXAMPLES = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------------------------------------------
# greedy: token for token the AR output; the draft cache stays in step
# ----------------------------------------------------------------------------------------------------------------


@EXAMPLES
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
       k=st.sampled_from([1, 2, 3, 5, 8, None]), budget=st.integers(1, 28),
       kind=st.sampled_from(["other", "noisy", "self"]))
def test_greedy_equals_ar(tiny, other_draft, noisy_folder, prompt, k, budget, kind):
    draft = {"other": other_draft, "noisy": noisy_folder, "self": tiny}[kind]
    ar = ff.generate(tiny, prompt, "ar", max_new_tokens=budget).token_ids
    options = {"draft": draft} if k is None else {"draft": draft, "k": k}
    out = ff.generate(tiny, prompt, "sps", max_new_tokens=budget, method_options=options)
    assert out.token_ids == ar
    stats = out.stats.method_stats
    if kind == "self" and k is not None:
        # the target drafting for itself through its own cache: every drafted token must be accepted, which it is
        # only if the draft cache holds exactly the sequence's keys/values at every step
        assert stats["accepted_tokens"] == stats["drafted_tokens"]


def test_noisy_draft_is_partly_accepted_and_cache_is_cropped(tiny, noisy_folder):
    prompt = [5, 17, 3, 88, 41]
    ar = ff.generate(tiny, prompt, "ar", max_new_tokens=40).token_ids
    out = ff.generate(tiny, prompt, "sps", max_new_tokens=40, method_options={"draft": noisy_folder, "k": 4})
    assert out.token_ids == ar
    s = out.stats.method_stats
    assert 0 < s["accepted_tokens"] < s["drafted_tokens"]  # both paths (accept, reject + crop) are exercised
    # one draft forward per drafted token plus the prompt: nothing is ever re-read
    assert s["draft_forwards"] == 1 + s["drafted_tokens"]
    assert set(s) >= {"acceptance_rate", "mean_draft_length", "draft_ms_per_forward", "alpha_estimate"}


def test_hf_backend_target_and_gguf_target(tiny_hf, tmp_path):
    prompt = [4, 9, 33, 2]
    folder, _, _ = _draft_folder(tiny_hf, tmp_path / "hf-draft", layers=1, init="spread", std=0.02)
    ar = ff.generate(tiny_hf, prompt, "ar", max_new_tokens=16).token_ids
    assert ff.generate(tiny_hf, prompt, "sps", max_new_tokens=16,
                       method_options={"draft": str(folder), "k": 3}).token_ids == ar
    gguf, _ = tiny_gguf_target(tmp_path / "t.gguf", seed=2)
    folder, _, _ = _draft_folder(gguf, tmp_path / "gguf-draft", layers=2, init="first", std=0.0)
    draft = load_draft(gguf, str(folder))
    assert draft.backend.embed is gguf.backend.embed  # shared, packed
    # the head: the target's rows, as a drafter weight (Q4_0 on the integer kernel) when the kernels build
    head, rows = draft.backend.head, target_head_rows(gguf, torch.arange(gguf.vocab_size))
    if head is not gguf.backend.head:
        assert isinstance(head, DrafterLinear) and head.out_features == gguf.vocab_size
        assert (head.dense() - rows).abs().max() <= rows.abs().max() / 8  # Q4_0: 16 levels per block
    assert load_draft_model(folder, gguf, weights="fp32").backend.head is gguf.backend.head  # fp32: the target's own
    ar = ff.generate(gguf, prompt, "ar", max_new_tokens=16).token_ids
    out = ff.generate(gguf, prompt, "sps", max_new_tokens=16, method_options={"draft": str(folder), "k": 3})
    assert out.token_ids == ar and out.stats.method_stats["accepted_tokens"] > 0


def test_batch_of_sps_runs_equals_ar(tiny, noisy_folder):
    prompts = [[1, 2, 3], [50, 60], [7] * 9]
    results = ff.generate_batch(tiny, prompts, "sps", max_new_tokens=12,
                                method_options={"draft": noisy_folder, "k": 3})
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == ff.generate(tiny, p, "ar", max_new_tokens=12).token_ids


# ----------------------------------------------------------------------------------------------------------------
# sampling: the first tokens are distributed as AR sampling's (chi-square)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=5, top_p=0.9)])
def test_sampling_distribution_chi_square(cfg):
    target = tiny_target(vocab_size=8, init_std=0.15, seed=1)
    draft = tiny_target(vocab_size=8, init_std=0.2, seed=7, layers=1)  # q != p: rejections and residuals happen
    prompt = [0, 1, 2, 3]
    samples = 1000
    exact = exact_joint(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    drafted = accepted = rejected = 0
    proposer = DraftModelProposer(draft, k=2)
    for seed in range(samples):
        stats = GenerationStats("sps")
        toks = [t for chunk in decode_steps(target, prompt, proposer, max_new_tokens=3, sampling=cfg, seed=seed,
                                            stats=stats) for t in chunk]
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        drafted += bool(stats.depth_attempts and stats.depth_attempts[0])
        accepted += sum(stats.depth_accepts)
        rejected += bool(stats.depth_attempts) and stats.depth_accepts[-1] == 0
    assert drafted == samples and accepted > 0.2 * samples and rejected > 0.05 * samples, (accepted, rejected)
    chi2, df = pooled_chi2(exact, counts)
    assert sum(counts.values()) == samples and set(counts) <= set(exact)
    assert df >= 20
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


def test_sampled_drafts_carry_their_probabilities(tiny, other_draft):
    proposer = make_proposer("sps", tiny, draft=other_draft, k=3)
    trees = []
    for _ in decode_steps(tiny, [3, 4, 5], proposer, max_new_tokens=10, sampling=SamplingConfig(0.7), seed=1,
                          observers=[lambda state, step: trees.append(step.proposal.tree)]):
        pass
    tree = trees[0]
    assert tree.draft_probs is not None and tree.draft_probs.shape == (len(tree), VOCAB)
    assert torch.allclose(tree.draft_probs[1:].sum(-1), torch.ones(len(tree) - 1, dtype=torch.float64))
    for i in range(1, len(tree)):
        assert tree.draft_probs[i, tree.tokens[i]] > 0  # each token was drawn from its row
    greedy = []
    for _ in decode_steps(tiny, [3, 4, 5], proposer, max_new_tokens=10,
                          observers=[lambda state, step: greedy.append(step.proposal.tree)]):
        pass
    assert greedy[0].draft_probs is None  # greedy drafts are point masses


# ----------------------------------------------------------------------------------------------------------------
# refusals: one line each
# ----------------------------------------------------------------------------------------------------------------


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_missing_draft_option_refused(tiny):
    with pytest.raises(UsageError) as e:
        ff.generate(tiny, [1, 2], "sps", max_new_tokens=4)
    assert "option draft is required" in _one_line(e)


@pytest.mark.parametrize("k", [0, -1, 33, 2.5, "x", True])
def test_bad_k_refused(tiny, other_draft, k):
    with pytest.raises(UsageError) as e:
        make_proposer("sps", tiny, draft=other_draft, k=k)
    assert "option k" in _one_line(e)


@pytest.mark.parametrize("draft", [123, "", "  "])
def test_bad_draft_value_refused(tiny, draft):
    with pytest.raises(UsageError) as e:
        make_proposer("sps", tiny, draft=draft)
    _one_line(e)


def test_missing_draft_path_refused(tiny, tmp_path):
    with pytest.raises(ff.FastForwardError) as e:
        make_proposer("sps", tiny, draft=str(tmp_path / "nowhere"))
    _one_line(e)


class ShiftedTokenizer(TinyTokenizer):
    """Same vocabulary size, other ids for the same text."""

    def __call__(self, text, add_special_tokens=True):
        ids = super().__call__(text, add_special_tokens)["input_ids"]
        return {"input_ids": [(i + 1) % self.vocab_size for i in ids]}


def test_tokenizer_mismatch_refused(tiny):
    small = tiny_target(vocab_size=64, seed=2, layers=1)
    with pytest.raises(UsageError) as e:
        make_proposer("sps", tiny, draft=small)
    msg = _one_line(e)
    assert "64" in msg and "96" in msg and "tokenizer" in msg
    shifted = TargetModel("shifted", tiny_llama_hf(seed=3, layers=1), ShiftedTokenizer(VOCAB), backend="lean")
    with pytest.raises(UsageError) as e:
        make_proposer("sps", tiny, draft=shifted)
    assert "shifted" in _one_line(e) and "tiny-llama" in str(e.value)


def test_tokenizer_mismatch_refused_from_the_cli(tmp_path, capsys):
    target = tiny_hf_folder(tmp_path / "target", max_positions=128)
    other = tiny_hf_folder(tmp_path / "other", max_positions=128, seed=1, layers=1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})  # id 259: still 260 rows, other vocab
    tok.save_pretrained(other)
    line = assert_one_line_error(capsys, "generate", "--model", target, "hi", "--method", "sps", "-o",
                                 f"draft={other}", "--max-new-tokens", 4)
    assert "tokenizer" in line and str(other) in line
    line = assert_one_line_error(capsys, "generate", "--model", target, "hi", "--method", "sps",
                                 "--max-new-tokens", 4)
    assert "draft" in line


def test_draft_model_for_another_target_refused(tiny, tmp_path):
    folder, _, _ = _draft_folder(tiny, tmp_path / "d", layers=1)
    same_shape = tiny_target(seed=5)  # same vocabulary and hidden size, another embedding
    with pytest.raises(UsageError) as e:
        load_draft_model(folder, same_shape)
    assert "draft model for target 'tiny-llama'" in _one_line(e)
    other_vocab = tiny_target(seed=0, vocab_size=80)
    with pytest.raises(UsageError) as e:
        make_proposer("sps", other_vocab, draft=str(folder))
    assert "vocabulary" in _one_line(e)


def test_broken_draft_folders_refused(tiny, tmp_path):
    folder, _, _ = _draft_folder(tiny, tmp_path / "d", layers=1)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UsageError) as e:
        load_draft_model(folder, tiny)
    _one_line(e)
    config = json.loads((folder / "config.json").read_text())
    config["fastforward_draft_model"]["format"] = "fastforward-draft-model/99"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as e:
        make_proposer("sps", tiny, draft=str(folder))
    assert "format" in _one_line(e)


# ----------------------------------------------------------------------------------------------------------------
# the format: layers chosen, round trip, sharing, reuse
# ----------------------------------------------------------------------------------------------------------------


def test_choose_layers():
    assert choose_layers(30, 4) == [0, 10, 19, 29]
    assert choose_layers(30, 4, "first") == [0, 1, 2, 3]
    assert choose_layers(30, None, "0,5,29") == [0, 5, 29]
    assert choose_layers(30, 1) == [0]
    assert choose_layers(30, None) == [0, 10, 19, 29]
    for bad in [(30, 0, "spread"), (30, 31, "spread"), (30, None, "3,1"), (30, None, "0,30"), (30, 2, "0,1,2"),
                (30, None, "zero")]:
        with pytest.raises(UsageError):
            choose_layers(*bad)


def test_save_load_round_trip_identical_logits(tiny, tmp_path):
    lm, meta = init_draft_model(tiny, 2, "spread")
    _perturb(lm, 0.05, seed=4)
    save_draft_model(lm, meta, tmp_path / "d", target_probe(tiny))
    loaded = load_draft_model(tmp_path / "d", tiny)
    # the in-memory model with its weights rounded as saved (fp16), wrapped the same way
    with torch.no_grad():
        for _name, p in lm.named_parameters():
            if p.requires_grad:
                p.copy_(p.to(torch.float16).to(p.dtype))
    reference = draft_target(lm.to(tiny.dtype).eval(), tiny, "reference")
    ids = torch.tensor([3, 14, 15, 92, 65, 35])
    a = loaded.forward(ids, torch.arange(6), loaded.new_cache(8)).logits
    b = reference.forward(ids, torch.arange(6), reference.new_cache(8)).logits
    assert torch.equal(a, b)
    with torch.no_grad():  # and both are the HF model's own forward
        hf = lm(input_ids=ids[None]).logits[0]
    assert torch.allclose(a, hf.to(a.dtype), atol=1e-6)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 2
    assert saved["fastforward_draft_model"]["layers_from_target"] == [0, 1]
    assert saved["fastforward_draft_model"]["shared_embedding"] is True
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in stored)  # the shared weights are not stored
    assert all(v.dtype == torch.float16 for v in stored.values())


def test_fp32_target_packs_the_draft_layers_and_shares_embedding(tmp_path):
    target = ff.load(str(tiny_hf_folder(tmp_path / "m", max_positions=128, layers=3)))
    folder, _, _ = _draft_folder(target, tmp_path / "d", layers=2, init="spread", std=0.0)
    draft = load_draft_model(folder, target)
    assert draft.backend.embed is target.backend.embed
    dense = load_draft_model(folder, target, weights="fp32")
    assert dense.backend.head is target.backend.head  # packed (Q4_0) in ``draft`` when the kernels build
    ids = torch.tensor([1, 2, 3, 4])
    a = draft.forward(ids, torch.arange(4), draft.new_cache(8)).logits
    b = dense.forward(ids, torch.arange(4), dense.new_cache(8)).logits
    # Q8_0 layers and a Q4_0 head on the integer kernel: close to the dense draft's logits, not equal
    assert bool((torch.nn.functional.cosine_similarity(a, b, dim=-1) > 0.98).all()) and not torch.equal(a, b)
    prompt = target.encode("hello there")
    ar = ff.generate(target, prompt, "ar", max_new_tokens=12).token_ids
    assert ff.generate(target, prompt, "sps", max_new_tokens=12,
                       method_options={"draft": str(folder), "k": 3}).token_ids == ar


def test_a_path_is_loaded_once_per_target(tiny, noisy_folder):
    a = load_draft(tiny, noisy_folder)
    assert load_draft(tiny, noisy_folder + "/") is a
    other = tiny_target(seed=0)
    assert load_draft(other, noisy_folder) is not a


def fixed_costs(target_curve, draft_ms: float):
    """The target's and the draft's cost models, pinned (no live timings): ``draft_ms`` per draft token."""
    from fastforward.costs import CostCurve, CostModel

    return CostModel(target_curve, learn=False), CostModel(CostCurve({1: draft_ms}), learn=False)


def test_adaptive_length_in_a_run(tiny):
    from fastforward.costs import CostCurve

    proposer = DraftModelProposer(tiny, None)  # the target drafting for itself: every token accepted
    proposer.costs, proposer.draft_costs = fixed_costs(CostCurve.flat(), 0.0)  # free drafts: the longest chain
    prompt = [9, 8, 7]
    out = ff.generate(tiny, prompt, proposer, max_new_tokens=30)
    assert out.token_ids == ff.generate(tiny, prompt, "ar", max_new_tokens=30).token_ids
    s = out.stats.method_stats
    assert s["k"] == "adaptive" and s["mean_draft_length"] >= 5 and s["accepted_tokens"] == s["drafted_tokens"]
    proposer = DraftModelProposer(tiny, None)
    proposer.costs, proposer.draft_costs = fixed_costs(CostCurve.flat(), 5.0)  # a draft token: 5 steps, no drafts
    out = ff.generate(tiny, prompt, proposer, max_new_tokens=10)
    assert out.stats.method_stats["drafts"] == 0 and out.stats.target_forwards == 10


def test_sampled_runs_size_drafts_from_the_cached_curves_alone(tiny):
    """Sampled drafts carry draft probabilities, whose rejection draws depend on the draft length: a sampled run
    sizes them from the cached curves (not the live timings), so a seeded run does not follow the clock; a greedy
    one reads the live cost models."""
    proposer = DraftModelProposer(tiny, None)
    ff.generate(tiny, [9, 8, 7], proposer, max_new_tokens=4, temperature=0.8, seed=1)
    assert proposer.curve is proposer.costs.prior and proposer.draft_curve is proposer.draft_costs.prior
    ff.generate(tiny, [9, 8, 7], proposer, max_new_tokens=4)
    assert proposer.curve is proposer.costs and proposer.draft_curve is proposer.draft_costs


def test_adaptive_length_tries_drafts_that_pay(tiny):
    from fastforward.costs import CostCurve
    from fastforward.proposers.sps import best_draft_length

    flat = CostCurve.flat()
    assert best_draft_length(0.9, 8, flat, 0.0) == 8  # free drafts, free verification: as long as allowed
    assert best_draft_length(0.9, 8, flat, 10.0) == 0  # each draft token costs 10 target steps: never
    cpu = CostCurve({1: 10.0, 2: 12.0, 4: 16.0, 8: 30.0})
    k = best_draft_length(0.8, 8, cpu, 2.0)
    assert 1 <= k < 8
    assert best_draft_length(0.3, 8, cpu, 2.0) <= k  # worse acceptance: shorter drafts


# ----------------------------------------------------------------------------------------------------------------
# training: a smoke run through the CLI, then decoding with its output, then a resumed run
# ----------------------------------------------------------------------------------------------------------------


def _responses(path, n=12, seed=0):
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "responses.jsonl", "w") as f:
        for i in range(n):
            prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 10))]
            response = [rng.randrange(256) for _ in range(rng.randrange(4, 16))] + [258]
            f.write(json.dumps({"key": str(i), "source": "hand", "split": "heldout" if i % 5 == 0 else "train",
                                "prompt": "", "prompt_ids": prompt, "response_ids": response,
                                "finish_reason": "eos"}) + "\n")
    return path


def test_train_draft_model_smoke(tmp_path, capsys):
    model = tiny_hf_folder(tmp_path / "model", max_positions=128, layers=3)
    data = _responses(tmp_path / "data")
    out = tmp_path / "out"
    common = ["train", "draft-model", "--model", model, "--data", data, "--out", out, "--layers", 2,
              "--batch-size", 2, "--grad-accum", 2, "--save-every", 2, "--threads", 1, "--quiet"]
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 3)
    assert code == 0, err
    assert "saved draft model" in stdout and "step 3/3" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["fastforward_draft_model"]["layers_from_target"] == [0, 2]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    assert (out / "checkpoints" / "step-000003" / "trainer_state.json").is_file()
    # the result drafts for its target
    code, stdout, err = run_cli(capsys, "generate", "--model", model, "hello", "--method", "sps", "-o",
                                f"draft={out}", "-o", "k=2", "--max-new-tokens", 6, "--threads", 1)
    assert code == 0, err
    # the same command with more steps resumes from the checkpoint
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 5)
    assert code == 0, err
    assert "step 5/5" in stdout and "2 steps in" in stdout
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    # other settings in the same folder: refused in one line
    line = assert_one_line_error(capsys, *common, "--max-steps", 5, "--lr", 1e-3)
    assert "different settings" in line
    # a time budget: the run stops after the step that crossed it, with a checkpoint and a usable draft model
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 8, "--max-minutes", 1e-6)
    assert code == 0, err
    assert "step 6/8" in stdout and "--max-minutes budget" in stdout
    assert (out / "checkpoints" / "step-000006").is_dir() and (out / "model.safetensors").is_file()


def test_train_draft_model_under_bf16_autocast(tmp_path, capsys):
    """``--mixed-precision bf16``: finite losses, the setting recorded, a draft model that drafts losslessly; an
    unknown precision refused in one line."""
    model = tiny_hf_folder(tmp_path / "model", max_positions=128, layers=3)
    data = _responses(tmp_path / "data")
    out = tmp_path / "out"
    common = ["train", "draft-model", "--model", model, "--data", data, "--layers", 2, "--batch-size", 2,
              "--grad-accum", 1, "--threads", 1, "--quiet"]
    code, stdout, err = run_cli(capsys, *common, "--out", out, "--max-steps", 2, "--mixed-precision", "bf16")
    assert code == 0, err
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["config"]["mixed_precision"] == "bf16"
    assert "--mixed-precision" in assert_one_line_error(capsys, *common, "--out", tmp_path / "x",
                                                         "--mixed-precision", "fp8")
    target = ff.load(str(model))
    got = ff.generate(target, [5, 6, 7, 8], "sps", max_new_tokens=10, method_options={"draft": str(out), "k": 2})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=10).token_ids


def test_train_draft_model_bad_input(tmp_path, capsys):
    model = tiny_hf_folder(tmp_path / "model", max_positions=128)
    data = _responses(tmp_path / "data", n=3)
    base = ["train", "draft-model", "--model", model, "--out", tmp_path / "o", "--threads", 1, "--quiet"]
    assert "make-data" in assert_one_line_error(capsys, *base, "--data", tmp_path / "nothing")
    assert_one_line_error(capsys, *base, "--data", data, "--layers", 7)  # the target has 2
    assert_one_line_error(capsys, *base, "--data", data, "--init-layers", "5,1")
    assert_one_line_error(capsys, *base, "--data", data, "--max-minutes", "-1")


# ----------------------------------------------------------------------------------------------------------------
# the draft vocabulary: the head over the ids the draft may propose
# ----------------------------------------------------------------------------------------------------------------


def test_a_draft_vocabulary_keeps_sampling_exact():
    """A draft whose head covers 5 of the target's 8 tokens never proposes the other 3; the target still samples
    them (through the rejection residual) exactly as often as AR sampling does (chi-square)."""
    from fastforward.drafters.draft_model import DraftVocabHead

    cfg = SamplingConfig(1.0)
    target = tiny_target(vocab_size=8, init_std=0.15, seed=1)
    draft = tiny_target(vocab_size=8, init_std=0.2, seed=7, layers=1)
    ids = torch.tensor([0, 2, 3, 5, 7])
    draft.backend.head = DraftVocabHead(draft, ids, "fp32")
    assert torch.isinf(draft.forward(torch.tensor([1, 2]), torch.arange(2), draft.new_cache(8)).logits[:, [1, 4, 6]]
                       ).all()
    prompt = [0, 1, 2, 3]
    samples = 1000
    exact = exact_joint(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    proposer = DraftModelProposer(draft, k=2)
    outside = 0
    for seed in range(samples):
        toks = [t for chunk in decode_steps(target, prompt, proposer, max_new_tokens=3, sampling=cfg, seed=seed)
                for t in chunk]
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        outside += any(t in (1, 4, 6) for t in toks)
    assert outside > 0.1 * samples  # tokens the draft cannot propose still come out, through the residual
    chi2, df = pooled_chi2(exact, counts)
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


def test_a_draft_vocabulary_round_trips_and_decodes_ar(tmp_path):
    """A folder with a draft vocabulary: the loaded draft's head is the vocabulary's rows (every other logit -inf),
    greedy sps decodes AR's tokens; ids outside the target's vocabulary are refused in one line."""
    from safetensors.torch import load_file, save_file

    from fastforward.drafters.draft_model import DRAFT_VOCAB_KEY, DraftVocabHead

    gguf, _ = tiny_gguf_target(tmp_path / "t.gguf", seed=2)
    lm, meta = init_draft_model(gguf, 2, "first")
    ids = torch.arange(0, gguf.vocab_size, 2)
    folder = save_draft_model(lm, meta, tmp_path / "d", target_probe(gguf), draft_vocab=ids.flip(0))
    assert torch.equal(load_file(str(folder / "model.safetensors"))[DRAFT_VOCAB_KEY], ids)  # stored sorted
    draft = load_draft(gguf, str(folder))
    assert isinstance(draft.backend.head, DraftVocabHead) and torch.equal(draft.backend.head.ids, ids)
    logits = draft.forward(torch.tensor([3, 5]), torch.arange(2), draft.new_cache(8)).logits
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    for prompt in ([4, 9, 33, 2], [7], [1, 2, 3, 4, 5, 6]):
        ar = ff.generate(gguf, prompt, "ar", max_new_tokens=16).token_ids
        out = ff.generate(gguf, prompt, "sps", max_new_tokens=16, method_options={"draft": str(folder), "k": 3})
        assert out.token_ids == ar
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[DRAFT_VOCAB_KEY] = torch.tensor([0, 5, gguf.vocab_size])
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UsageError) as e:
        load_draft_model(folder, gguf)
    assert DRAFT_VOCAB_KEY in _one_line(e)


def test_training_stores_the_most_frequent_response_ids(tmp_path, capsys):
    from safetensors.torch import load_file

    from fastforward.drafters.draft_model import DRAFT_VOCAB_KEY

    model = tiny_hf_folder(tmp_path / "model", max_positions=128, layers=3)
    data = _responses(tmp_path / "data")
    for size, out in ((20, tmp_path / "small"), (0, tmp_path / "all")):
        code, _, err = run_cli(capsys, "train", "draft-model", "--model", model, "--data", data, "--out", out,
                               "--layers", 1, "--batch-size", 2, "--max-steps", 1, "--threads", 1, "--quiet",
                               "--draft-vocab", size)
        assert code == 0, err
    stored = load_file(str(tmp_path / "small" / "model.safetensors"))[DRAFT_VOCAB_KEY]
    counts = torch.zeros(1000, dtype=torch.long)
    for line in (data / "responses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            counts[torch.tensor(rec["response_ids"])] += 1
    assert stored.numel() >= 20 and bool((stored[1:] > stored[:-1]).all())
    top = set(counts.topk(10).indices.tolist())  # the most frequent ones are all in
    assert top <= set(stored.tolist())
    assert DRAFT_VOCAB_KEY not in load_file(str(tmp_path / "all" / "model.safetensors"))
    line = assert_one_line_error(capsys, "train", "draft-model", "--model", model, "--data", data, "--out",
                                 tmp_path / "bad", "--draft-vocab", -1)
    assert "--draft-vocab" in line
