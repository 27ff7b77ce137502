"""PASTA's metrics: critical path, theoretical speedup and parallelism, realized speedup, geometric means."""

from __future__ import annotations

import math

import pytest

from fastforward.model import TargetModel
from fastforward.pasta.interpreter import PastaMethod
from fastforward.pasta.language import add_pasta_tokens
from fastforward.pasta.metrics import critical_path, evaluate, theoretical
from fastforward.stats import geomean
from fastforward.testing import tiny_llama_hf, tiny_tokenizer_hf

EOS = 258


@pytest.fixture(scope="module")
def models():
    hf = tiny_llama_hf(vocab_size=320, seed=1)
    hf.config.eos_token_id = EOS
    hf.generation_config.eos_token_id = EOS
    tokenizer = tiny_tokenizer_hf()
    add_pasta_tokens(tokenizer)
    pasta = TargetModel("tiny-pasta", hf, tokenizer, backend="lean")
    baseline = TargetModel("tiny-base", hf, tiny_tokenizer_hf(), backend="lean")  # same weights, no PASTA tokens
    return baseline, pasta


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([1.0, 0.0, 4.0]) == pytest.approx(2.0)  # non-positive values left out
    assert math.isnan(geomean([]))


def test_critical_path_and_theoretical(models):
    _, pasta = models
    tok = pasta.tokenizer
    vocab = add_pasta_tokens(tok)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    plain = enc("just text") + [EOS]
    assert critical_path([1], plain, vocab, [EOS]) == len(plain)
    assert critical_path([1], enc("no eos"), None, [EOS]) == len(enc("no eos"))
    assert critical_path([1], enc("no eos"), vocab, [EOS]) == len(enc("no eos"))
    answer = enc('ab<promise topic="x" tokens=1/><async>cde</async><promise topic="y" tokens=2/><async>fg</async>'
                 'h<sync/>ij') + [EOS]
    # by hand: prefill; a, b, <promise, x, close+<async>, <promise|c, y|d, close+<async>|e, f|</async>|h,
    # g, </async>+<sync/>, i, j (EOS chosen from j's forward): 14 forwards
    assert critical_path([1, 2], answer, vocab, [EOS]) == 14
    got = theoretical([1, 2], answer, vocab, baseline_length=28, eos_ids=[EOS])
    assert got["theoretical_speedup"] == pytest.approx(2.0)
    assert got["plain_tokens"] == len(enc("abcdefghij")) + 1
    assert got["parallelism"] == pytest.approx(11 / 14)


def test_evaluate(models):
    baseline, pasta = models
    main = pasta.tokenizer('a<promise topic="x" tokens=1/><promise topic="y" tokens=1/><sync/>b',
                           add_special_tokens=False)["input_ids"] + [EOS]

    def proposer(target):
        if target is pasta:
            return PastaMethod(target, force=lambda k, o: main[o] if k == 0 and o < len(main) else None)
        return PastaMethod(target)

    prompts = [[1, 2, 3], [4, 5]]
    out = evaluate(baseline, pasta, prompts, max_new_tokens=60, proposer=proposer)
    summary = out["summary"]
    assert summary["prompts"] == 2 and summary["forks_per_answer"] == 2
    for row in out["prompts"]:
        assert row["forks"] == 2 and row["critical_path"] < row["annotated_tokens"]
        assert row["parallelism"] > 1.0 and row["realized_speedup"] > 0
        assert row["theoretical_speedup"] == pytest.approx(row["baseline_tokens"] / row["critical_path"])
    assert summary["theoretical_speedup"] == pytest.approx(geomean(r["theoretical_speedup"] for r in out["prompts"]))
    # a model against itself, plain: theoretical speedup and parallelism exactly 1
    same = evaluate(baseline, baseline, prompts[:1], max_new_tokens=20)
    assert same["summary"]["theoretical_speedup"] == pytest.approx(1.0)
    assert same["summary"]["parallelism"] == pytest.approx(1.0)
