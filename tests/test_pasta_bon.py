"""PASTA's preference stage and evaluation: BoNBoN's margin and loss, the best/worst pair, and the whole chain on a
tiny random model (pasta-sft -> pasta sample -> pasta-bon -> pasta evaluate) through the command line."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from fastforward.pasta.language import PastaVocab, promise_tag
from fastforward.testing import tiny_hf_folder, tiny_tokenizer_hf
from fastforward.train.pasta.bon import Sample, best_worst, bonbon_loss, bonbon_margin


def test_margin_is_bonbons_best_worst_gap():
    assert bonbon_margin(2) == pytest.approx(1.0)
    assert bonbon_margin(4) == pytest.approx(5.5)
    assert bonbon_margin(8) == pytest.approx(18.15, abs=5e-3)
    assert bonbon_margin(10) == pytest.approx(25.46, abs=5e-3)
    # Monte Carlo check of the theory: E[(n-1)(log U_(n) - log U_(1))] for n uniform draws
    g = torch.Generator().manual_seed(0)
    u = torch.rand(200_000, 6, generator=g)
    gap = (5 * (u.max(1).values.log() - u.min(1).values.log())).mean()
    assert float(gap) == pytest.approx(bonbon_margin(6), rel=0.02)


def _s(speed, quality, ids):
    return Sample(ids, "", "eos", 1, speed, 1.0, quality)


def test_best_worst_follows_lambda():
    a, b, c = _s(2.0, 0.1, [1]), _s(1.0, 1.0, [2]), _s(1.5, 0.5, [3])
    assert best_worst([a, b, c], lam=0.0) == (a, b)  # speed only
    assert best_worst([a, b, c], lam=8.0) == (b, a)  # quality dominates
    assert best_worst([a, a], lam=1.0) is None  # nothing to prefer
    assert best_worst([a], lam=1.0) is None


def test_loss_at_the_reference_is_the_squared_margin():
    c, r = torch.tensor([-10.0, -20.0]), torch.tensor([-12.0, -15.0])
    loss = bonbon_loss(c, r, c, r, margin=5.5, alpha=0.005)
    assert torch.allclose(loss, 0.005 * -c + 0.995 * 5.5 ** 2)
    # moving the gap to the margin zeroes the preference term
    loss = bonbon_loss(c + 5.5, r, c, r, margin=5.5, alpha=0.0)
    assert torch.allclose(loss, torch.zeros(2))


ANSWER = (
    "Two tips:\n" + promise_tag("Sleep", 1) + "<async>1. Sleep well every night.\n</async>"
    + promise_tag("Eat", 1) + "<async>2. Eat more greens daily.</async><sync/>\nDone."
)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("pasta-chain")
    base = str(tiny_hf_folder(root / "base", max_positions=512))
    tok = tiny_tokenizer_hf()
    rows = []
    for i, q in enumerate(["Give tips.", "Name two fruits.", "Say hi.", "List colors."]):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        response = f"Plain answer number {i}."
        rows.append({"key": f"k{i}", "prompt_ids": prompt, "pasta": ANSWER, "response": response,
                     "response_ids": tok.encode(response) + [258], "finish_reason": "eos", "split": "train"})
    data = root / "pasta.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, base, data


def test_sft_sample_bon_evaluate(chain, capsys):
    root, base, data = chain
    common = ["--batch-size", "2", "--grad-accum", "1", "--max-length", "256", "--threads", "1", "--quiet",
              "--lora", "4", "--lr", "1e-2"]
    sft = root / "sft"
    code, _, err = run_cli(capsys, "train", "pasta-sft", "--model", base, "--data", data, "--out", sft,
                           "--max-steps", 2, *common)
    assert code == 0, err
    samples = root / "samples.jsonl"
    args = ["pasta", "sample", data, samples, "--model", sft, "--judge-model", base, "--n", 3, "--prompts", 3,
            "--max-new-tokens", 24, "--threads", 1]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["samples"]) == 3 for r in rows)
    s = rows[0]["samples"][0]
    assert s["critical_path"] >= 1 and s["quality"] > 0 and s["theoretical_speedup"] > 0
    code, out, err = run_cli(capsys, *args)  # resumed: nothing left to do
    assert code == 0 and "0 prompts sampled" in out and "3 already there" in out
    bon = root / "bon"
    code, out, err = run_cli(capsys, "train", "pasta-bon", "--model", sft, "--data", samples, "--out", bon,
                             "--max-steps", 1, "--lam", 1, *common)
    assert code == 0, err
    stats = json.loads((bon / "fastforward_train.json").read_text())["method_stats"]
    assert stats["margin"] == pytest.approx(3.0) and stats["pairs"] >= 1
    # the first step's policy is the reference (adapters start at zero): the log-ratio gap is exactly 0
    assert stats["mean_log_ratio_gap_last"] == pytest.approx(0.0, abs=1e-3)
    # the shipped form: both LoRA stages and the new rows over the base reproduce the final model
    adapter = root / "adapter"
    code, out, err = run_cli(capsys, "pasta", "export", "--base", base, "--stages", f"{sft}/adapter,{bon}/adapter",
                             "--model", bon, "--out", adapter)
    assert code == 0, err
    import fastforward as ff
    from fastforward.model.adapters import build_adapted_model

    plain = ff.load(base, backend="hf")
    model, tokenizer = build_adapted_model(plain.hf_model, plain.tokenizer, adapter)
    final = ff.load(str(bon), backend="hf")
    assert tokenizer.get_vocab() == final.tokenizer.get_vocab()
    ids = torch.tensor([final.tokenizer.encode("Give tips.") + [PastaVocab.from_tokenizer(tokenizer).open]])
    with torch.no_grad():
        got, want = model(ids).logits, final.hf_model(ids).logits
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ["Give tips.", "Say hi."]))
    result = root / "eval.json"
    code, out, err = run_cli(capsys, "pasta", "evaluate", "--baseline", base, "--models", f"sft={sft},bon={bon}",
                             "--prompts", prompts, "--max-new-tokens", 16, "--runs", 1, "--judge-model", base,
                             "--out", result, "--threads", 1)
    assert code == 0, err
    assert "| sft |" in out and "| bon |" in out
    got = json.loads(result.read_text())
    for name in ("sft", "bon"):
        r = got["models"][name]
        assert len(r["prompts"]) == 2 and 0.0 <= r["win_rate"]["rate"] <= 1.0
        assert r["summary"]["theoretical_speedup"] > 0 and r["summary"]["realized_speedup"] > 0


def test_refusals(chain, capsys, tmp_path):
    root, base, data = chain
    assert_one_line_error(capsys, "pasta", "sample", data, tmp_path / "s.jsonl", "--model", base, "--n", 1,
                          match="--n")
    assert_one_line_error(capsys, "pasta", "evaluate", "--models", "nonsense", "--prompts", data, match="NAME=MODEL")
    assert_one_line_error(capsys, "train", "pasta-bon", "--model", base, "--data", data, "--out", tmp_path / "b",
                          "--lam", "-1", match="--lam")
    # a model without PASTA-LANG tokens cannot be sampled from
    assert_one_line_error(capsys, "pasta", "sample", data, tmp_path / "s.jsonl", "--model", base,
                          "--judge-model", base, "--prompts", 1, match="PASTA-LANG")


def test_unparsable_samples_are_left_out_of_the_pair(chain, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from fastforward.train.pasta.methods import PastaBoN

    root, base, data = chain
    tok = tiny_tokenizer_hf()
    method = PastaBoN(lam=1.0)
    method.prepare_model(AutoModelForCausalLM.from_pretrained(base), tok)
    v = method.vocab
    good = tok.encode(ANSWER, add_special_tokens=False)
    close = next(t for t, n in v.close.items() if n == 1)
    broken = [65, v.open, 66, close, v.async_, 67, v.open, 68]  # a promise inside a block: a cut sample
    shorter = tok.encode("Short.", add_special_tokens=False)

    def sample(ids, speed):
        return {"ids": ids, "text": "", "finish_reason": "eos", "critical_path": 1, "theoretical_speedup": speed,
                "parallelism": 1.0, "quality": 0.1}

    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"key": "a", "prompt_ids": [1, 2, 3],
                                "samples": [sample(broken, 9.0), sample(good, 2.0), sample(shorter, 1.0)]}) + "\n")
    cfg = SimpleNamespace(data=str(path), lora=4, limit=None, seed=0, max_length=512)
    examples, _, _ = method.load_records(cfg, tok)
    assert method.counts["unparsable_samples"] == 1
    assert examples[0].input_ids[3:] == good and examples[0].rejected == shorter  # not the broken best
