"""``fastforward bench``: question formats, method specs, the run loop (losslessness check, resume), aggregates,
reports and one-line errors -- all on tiny models."""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastforward.bench import (
    EngineRunner,
    MethodSpec,
    aggregate,
    first_divergence,
    geomean,
    load_questions,
    parse_spec,
    parse_specs,
    resolve_specs,
    run_bench,
    select_questions,
    write_report,
)
from fastforward.bench.report import render_markdown
from fastforward.bench.results import read_rows
from fastforward.cli import main
from fastforward.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def spec_bench_like(path: Path) -> Path:
    records = [
        {"question_id": 81, "category": "writing", "turns": ["t1 t2 t3 t4 t5", "t6 t7"]},
        {"question_id": 91, "category": "roleplay", "turns": ["t8 t9 t10", "t11"]},
        {"question_id": 161, "category": "translation", "turns": ["t12 t13 t14 t15 t12 t13"]},
        {"question_id": 162, "category": "translation", "turns": ["t16 t17 t18"]},
        {"question_id": 241, "category": "summarization", "turns": ["t19 t20 t21 t19 t20"]},
    ]
    return write_jsonl(path, records)


# ----------------------------------------------------------------------------------------------------------------
# Questions
# ----------------------------------------------------------------------------------------------------------------


def test_question_formats(tmp_path):
    qs = load_questions(spec_bench_like(tmp_path / "question.jsonl"))
    assert [q.category for q in qs] == ["mt_bench", "mt_bench", "translation", "translation", "summarization"]
    assert qs[0].subcategory == "writing" and qs[0].turns == ["t1 t2 t3 t4 t5", "t6 t7"]
    assert load_questions(tmp_path / "question.jsonl", fold_mt_bench=False)[0].category == "writing"

    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"}) + "\n")
    (q,) = load_questions(he)
    assert (q.question_id, q.category) == ("HumanEval/0", "humaneval")
    # the bench asks exactly what `fastforward eval --task humaneval` asks
    from fastforward.evaluate import humaneval_prompt
    assert q.turns == [humaneval_prompt({"prompt": "def f():\n"})] and "```python\ndef f():\n```" in q.turns[0]

    gsm = write_jsonl(tmp_path / "test.jsonl", [{"question": "1+1?", "answer": "#### 2"}] * 2)
    qs = load_questions(gsm)
    assert [q.question_id for q in qs] == ["0", "1"] and qs[0].category == "gsm8k"

    plain = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello"}, {"prompt": "bye", "category": "x"}])
    assert [q.category for q in load_questions(plain)] == [tmp_path.name, "x"]

    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Do it", "input": "now", "output": "ok"},
                                  {"instruction": "Again", "input": "", "output": "ok"}]))
    qs = load_questions(alpaca)
    assert [q.turns for q in qs] == [["Do it\n\nnow"], ["Again"]] and qs[0].category == "alpaca"

    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}]))
    assert load_questions(share)[0].turns == ["hi"]

    # two files sharing ids: the ids get the file's stem
    both = load_questions([tmp_path / "test.jsonl", tmp_path / "prompts.jsonl"])
    assert [q.question_id for q in both] == ["test:0", "test:1", "prompts:0", "prompts:1"]


def test_select_questions(tmp_path):
    qs = load_questions(spec_bench_like(tmp_path / "question.jsonl"))
    assert [q.question_id for q in select_questions(qs, per_category=1)] == ["81", "161", "241"]
    assert [q.question_id for q in select_questions(qs, limit=2)] == ["81", "161"]  # evenly spaced
    assert [q.question_id for q in select_questions(qs, limit=2, spread=False)] == ["81", "91"]
    assert [q.question_id for q in select_questions(qs, categories=["translation"])] == ["161", "162"]
    assert [q.question_id for q in select_questions(qs, categories=["roleplay"])] == ["91"]  # a subcategory
    with pytest.raises(UsageError, match="unknown category 'poetry'"):
        select_questions(qs, categories=["poetry"])
    # per-category counts: one default plus overrides, or overrides only (other categories left out)
    assert [q.question_id for q in select_questions(qs, per_category="1,translation=2")] == ["81", "161", "162",
                                                                                            "241"]
    assert [q.question_id for q in select_questions(qs, per_category="mt_bench=2")] == ["81", "91"]
    for bad, message in (("0", "positive"), ("x=y", "not N or CATEGORY=N"), ("=3", "no category name"),
                         ("poetry=2", "unknown category 'poetry'"), (",", "give N")):
        with pytest.raises(UsageError, match=message):
            select_questions(qs, per_category=bad)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ('{"turns": ["a"]}\n{"turns": [\n', "line 2: not valid JSON"),
        ('{"text": "a"}\n', "line 1: no question field"),
        ('{"turns": []}\n', "'turns' must be a non-empty list"),
        ("\n\n", "holds no questions"),
        ('{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n', "duplicate question id"),
    ],
)
def test_bad_question_files(tmp_path, content, message):
    path = tmp_path / "q.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message) as exc:
        load_questions(path)
    assert "\n" not in str(exc.value)


# ----------------------------------------------------------------------------------------------------------------
# Method specs
# ----------------------------------------------------------------------------------------------------------------


def test_method_specs():
    assert parse_spec("ar") == MethodSpec("ar", "ar", {})
    s = parse_spec("tr-jacobi-69=tr-jacobi:tree=trees/x.json:k=10:sizes=[1,2]")
    assert (s.label, s.method, s.options) == ("tr-jacobi-69", "tr-jacobi", {"tree": "trees/x.json", "k": 10,
                                                                              "sizes": [1, 2]})
    assert s.describe() == "tr-jacobi-69=tr-jacobi:tree=trees/x.json:k=10:sizes=[1, 2]"
    specs = parse_specs(["ar,x=ar:a=[1,2],y=ar", "z=ar"])
    assert [s.label for s in specs] == ["ar", "x", "y", "z"] and specs[1].options == {"a": [1, 2]}
    # ar is always first, even when not asked for; peers come last
    resolved = resolve_specs(parse_specs(["ar2=ar"]), parse_specs(["hf-pld:prompt_lookup_num_tokens=5"], "peer"))
    assert [(s.label, s.kind) for s in resolved] == [("ar", "method"), ("ar2", "method"), ("hf-pld", "peer")]
    from fastforward.bench.methods import apply_option_flags

    apply_option_flags(resolved, ["hf-pld.prompt_lookup_num_tokens=7"])
    assert resolved[2].options == {"prompt_lookup_num_tokens": 7}
    for bad, message in [
        (["nosuch"], "unknown method 'nosuch'"),
        (["hf-generate"], "it is a peer"),
        (["ar:k=3"], "method 'ar' has no option k"),
        (["ar=ar:k=1"], "has no option k"),
        (["x=ar,x=ar"], "used twice"),
        (["bad label=ar"], "not a valid label"),
    ]:
        with pytest.raises(UsageError, match=message):
            resolve_specs(parse_specs(bad), [])
    with pytest.raises(UsageError, match="unknown peer 'vllm'"):
        resolve_specs([], parse_specs(["vllm"], "peer"))
    with pytest.raises(UsageError, match="no method labelled 'q'"):
        apply_option_flags(resolved, ["q.k=1"])


# ----------------------------------------------------------------------------------------------------------------
# The run loop
# ----------------------------------------------------------------------------------------------------------------


class CorruptingRunner:
    """A deliberately broken method: AR's output with token ``index`` of turn ``turn`` replaced."""

    lossless = True

    def __init__(self, index: int, turn: int = 0):
        self.inner = EngineRunner(MethodSpec("ar", "ar"))
        self.index, self.turn, self.calls = index, turn, 0

    def generate(self, target, prompt_ids, **kw):
        self.calls += 1
        out = self.inner.generate(target, prompt_ids, **kw)
        # which turn this is: first-turn prompts here are under 12 tokens, second-turn prompts hold a 12-token answer
        turn = 0 if len(prompt_ids) < 12 else 1
        if turn == self.turn and len(out.token_ids) > self.index:
            out.token_ids[self.index] = (out.token_ids[self.index] + 1) % target.vocab_size
        return out


class CountingRunner(EngineRunner):
    def __init__(self, spec):
        super().__init__(spec)
        self.calls = 0

    def generate(self, *a, **kw):
        self.calls += 1
        return super().generate(*a, **kw)


def test_broken_method_is_reported_as_mismatch(tiny, tmp_path):
    qs = load_questions(spec_bench_like(tmp_path / "question.jsonl"))[:3]
    specs = [MethodSpec("ar", "ar"), MethodSpec("broken", "broken"), MethodSpec("broken-t2", "broken")]
    runners = {"broken": CorruptingRunner(5), "broken-t2": CorruptingRunner(3, turn=1)}
    rows = run_bench(tiny, qs, specs, tmp_path / "out", max_new_tokens=12, warmup=0, progress=False,
                     runners=runners)
    by = {(r["question_id"], r["label"]): r for r in rows}
    for q in qs:
        assert by[(q.question_id, "ar")]["lossless"] is True
        row = by[(q.question_id, "broken")]
        div = row["first_divergence"]
        ar_tok = by[(q.question_id, "ar")]["output_ids"][0][5]
        assert row["lossless"] is False
        assert (div["turn"], div["index"], div["ar_token"]) == (0, 5, ar_tok)
        assert div["token"] == (ar_tok + 1) % tiny.vocab_size
        # AR's token is the target's argmax there; a corrupted token is not a near-tie in float64
        assert div["ar_is_argmax"] and div["logit_gap"] > 0.01 and div["near_tie"] is False
    # the two-turn questions: a divergence in the second turn is located there
    for qid in ("81", "91"):
        div = by[(qid, "broken-t2")]["first_divergence"]
        assert (div["turn"], div["index"]) == (1, 3)
        assert div["logit_gap"] > 0.01
    assert by[("161", "broken-t2")]["lossless"] is True
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["methods"]["broken"]["mismatches"] == 3
    assert summary["methods"]["broken-t2"]["mismatches"] == 2
    assert summary["methods"]["ar"]["mismatches"] == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Losslessness" in report and "`broken`" in report


def test_rows_fields_peers_and_lossless(tiny, tmp_path):
    qs = load_questions(spec_bench_like(tmp_path / "question.jsonl"))[1:3]
    specs = resolve_specs(parse_specs(["ar2=ar"]), parse_specs(["hf-generate,hf-pld"], "peer"))
    rows = run_bench(tiny, qs, specs, tmp_path / "out", max_new_tokens=10, repeats=2, warmup=1, progress=False,
                     command="fastforward bench ...")
    assert len(rows) == 2 * 4 * 2
    for row in rows:
        assert row["lossless"] is True, row["label"]
        for key in ("new_tokens", "wall_time", "decoding_steps", "accept_lengths", "tau", "tokens_per_s",
                    "acceptance_by_depth", "machine", "software", "commit", "threads", "parameters", "command",
                    "options", "output_ids"):
            assert key in row, key
        assert row["parameters"]["max_new_tokens"] == 10 and row["threads"] == torch.get_num_threads()
        assert row["parameters"]["arithmetic"] == "exact" and row["parameters"]["kv_cache"] == "fp32"
    assert "arithmetic exact, KV cache fp32" in (tmp_path / "out" / "report.md").read_text()
    ar = [r for r in rows if r["label"] == "ar" and r["question_id"] == "91"][0]
    assert len(ar["output_ids"]) == 2 and ar["new_tokens"] == 20 and ar["decoding_steps"] == 20
    assert ar["tau"] == 1.0 and ar["accept_lengths"] == [1] * 20
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for label in ("ar", "ar2", "hf-generate", "hf-pld"):
        m = summary["methods"][label]
        for key in ("speedup_geomean", "speedup_arith", "speedup_total", "tau", "tokens_per_s", "mismatches"):
            assert m[key] is not None, (label, key)
        assert set(m["categories"]) == {"mt_bench", "translation"}
        assert "speedup_vs_hf_generate_geomean" in m
    assert summary["methods"]["ar"]["speedup_geomean"] == pytest.approx(1.0)
    assert (tmp_path / "out" / "speedup_by_category.png").stat().st_size > 1000


def test_resume_force_and_config_mismatch(tiny, tmp_path):
    path = spec_bench_like(tmp_path / "question.jsonl")
    qs = load_questions(path)
    out = tmp_path / "out"
    specs = [MethodSpec("ar", "ar"), MethodSpec("ar2", "ar")]

    def go(questions, force=False, max_new_tokens=6, repeats=1):
        runners = {s.label: CountingRunner(s) for s in specs}
        rows = run_bench(tiny, questions, specs, out, max_new_tokens=max_new_tokens, warmup=0, progress=False,
                         runners=runners, force=force, repeats=repeats, report=False)
        return rows, sum(r.calls for r in runners.values())

    rows, calls = go(qs[2:4])
    assert len(rows) == 4 and calls == 4
    rows, calls = go(qs[2:])  # one new question: only its runs are measured
    assert len(rows) == 6 and calls == 2
    rows, calls = go(qs[2:], repeats=2)  # a second repeat of everything
    assert len(rows) == 12 and calls == 6
    rows, calls = go(qs[2:], repeats=2)  # nothing left to do
    assert len(rows) == 12 and calls == 0
    rows, calls = go(qs[2:3], force=True)  # re-measures what it is asked for, keeps the rest
    assert len(rows) == 12 and calls == 2
    with pytest.raises(UsageError, match="max_new_tokens=6 .* --force"):
        go(qs[2:], max_new_tokens=7)
    specs[1] = MethodSpec("ar2", "ar", {"x": 1})
    with pytest.raises(UsageError, match="'ar2' results measured as ar with options"):
        go(qs[2:3])


def test_partial_last_line_is_repaired(tiny, tmp_path):
    qs = load_questions(spec_bench_like(tmp_path / "question.jsonl"))[2:4]
    out = tmp_path / "out"
    specs = [MethodSpec("ar", "ar")]
    run_bench(tiny, qs[:1], specs, out, max_new_tokens=4, warmup=0, progress=False, report=False)
    with open(out / "results.jsonl", "a") as f:
        f.write('{"question_id": "162", "label": "ar", "rep')  # killed mid-write
    rows = run_bench(tiny, qs, specs, out, max_new_tokens=4, warmup=0, progress=False, report=False)
    assert sorted(r["question_id"] for r in rows) == ["161", "162"]
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)


class FailingRunner(EngineRunner):
    """Fails on prompts that start with token 16 (question 162)."""

    def generate(self, target, prompt_ids, **kw):
        if prompt_ids[0] == 16:
            raise RuntimeError("boom")
        return super().generate(target, prompt_ids, **kw)


def test_failed_run_is_recorded_reported_and_retried(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("FASTFORWARD_DEBUG", raising=False)
    qs = load_questions(spec_bench_like(tmp_path / "question.jsonl"))[2:4]
    out = tmp_path / "out"
    specs = [MethodSpec("ar", "ar"), MethodSpec("m", "ar")]
    rows = run_bench(tiny, qs, specs, out, max_new_tokens=4, warmup=0, progress=False,
                     runners={"m": FailingRunner(specs[1])})
    failed = [r for r in rows if r.get("error")]
    assert [(r["question_id"], r["label"], r["error"]) for r in failed] == [("162", "m", "RuntimeError: boom")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["m"]["errors"] == 1 and summary["methods"]["m"]["questions"] == 1
    assert "## Failed runs" in (out / "report.md").read_text()
    rows = run_bench(tiny, qs, specs, out, max_new_tokens=4, warmup=0, progress=False)  # retried, now fine
    assert not any(r.get("error") for r in rows)
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_first_divergence():
    assert first_divergence([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_divergence([[1, 2, 3], [4]], [[1, 2, 3], [4, 5]]) == {"turn": 1, "index": 1, "ar_token": None,
                                                                       "token": 5}
    assert first_divergence([[1, 2, 3]], [[1, 9, 3]]) == {"turn": 0, "index": 1, "ar_token": 2, "token": 9}
    assert first_divergence([[1, 2, 3]], [[1, 2]])["ar_token"] == 3


# ----------------------------------------------------------------------------------------------------------------
# Aggregates
# ----------------------------------------------------------------------------------------------------------------


def _row(q, label, wall, tokens=10, cat="a", steps=None, repeat=0, lossless=True, attempts=(), accepts=()):
    return {"question_id": q, "label": label, "method": label, "kind": "method", "options": {}, "category": cat,
            "repeat": repeat, "new_tokens": tokens, "wall_time": wall, "decoding_steps": steps or tokens,
            "depth_attempts": list(attempts), "depth_accepts": list(accepts), "lossless": lossless,
            "first_divergence": None if lossless else {"turn": 0, "index": 2, "near_tie": True},
            "draft_time": 0.07, "verify_time": 0.2, "parameters": {"max_new_tokens": 10}, "timestamp": "t",
            "proposal_rows": 3 * ((steps or tokens) - 1)}  # three rows a decoding step (one turn: one prefill)


def test_aggregates_math():
    rows = [
        _row("1", "ar", 1.0), _row("1", "m", 0.5, steps=4, attempts=[4, 2], accepts=[3, 1]),  # ratio 2
        _row("2", "ar", 1.0, cat="b"), _row("2", "m", 2.0, cat="b", steps=6, lossless=False),  # ratio 0.5
        _row("3", "ar", 3.0, cat="b"), _row("3", "m", 1.0, cat="b", steps=5, attempts=[2], accepts=[2]),  # 3
        # repeats: the median of 1.0, 1.5, 5.0 is 1.5 (the fastest 1.0)
        _row("4", "ar", 1.5, tokens=20, cat="b"),
        _row("4", "m", 1.0, tokens=20, cat="b", steps=10), _row("4", "m", 5.0, tokens=20, cat="b", steps=10,
                                                              repeat=1),
        _row("4", "m", 1.5, tokens=20, cat="b", steps=10, repeat=2),
    ]
    s = aggregate(rows)
    m = s["methods"]["m"]
    ratios = [2.0, 0.5, 3.0, 1.0]
    assert m["speedup_arith"] == pytest.approx(sum(ratios) / 4)
    assert m["speedup_geomean"] == pytest.approx((2.0 * 0.5 * 3.0 * 1.0) ** 0.25)
    # total throughput: (10+10+10+20 tokens / 0.5+2+1+1.5 s) / (50 tokens / 1+1+3+1.5 s)
    assert m["speedup_total"] == pytest.approx((50 / 5.0) / (50 / 6.5))
    # Spec-Bench: mean tokens/s over mean AR tokens/s
    assert m["speedup_specbench"] == pytest.approx((20 + 5 + 10 + 20 / 1.5) / 4 / ((10 + 10 + 10 / 3 + 20 / 1.5) / 4))
    assert m["speedup_geomean_min"] == pytest.approx((2.0 * 0.5 * 3.0 * 1.5) ** 0.25)
    # tau pooled over every row: (10+10+10+60 tokens) / (4+6+5+30 forwards)
    assert m["tau"] == pytest.approx(90 / 45)
    assert m["acceptance_by_depth"] == pytest.approx([5 / 6, 1 / 2])
    assert m["tokens_per_s"] == pytest.approx(50 / 5.0)
    assert (m["mismatches"], m["mismatches_near_tie"]) == (1, 1)
    assert m["draft_ms_per_step"] == pytest.approx(1e3 * 0.07 * 6 / 45)  # 0.07 s of drafting in each of 6 rows
    assert m["verify_ms_per_step"] == pytest.approx(1e3 * 0.2 * 6 / 45)
    assert m["rows_per_step"] == pytest.approx(3.0)
    md = render_markdown(s, [])
    assert "| drafting ms / step | verify ms / step |" in md
    # per category too: drafting per step and acceptance by depth, for the methods that draft
    a = m["categories"]["a"]
    alphas = " / ".join(f"{x:.2f}" for x in a["acceptance_by_depth"][:3])
    assert f"| `m` | {a['draft_ms_per_step']:.2f} |" in md.split("## Drafting ms per step per category")[1]
    assert f"| `m` | {alphas} |" in md.split("## Acceptance at depths 1 / 2 / 3 per category")[1]
    assert "| `ar` |" not in md.split("## Drafting ms per step per category")[1].split("##")[0]
    b = m["categories"]["b"]
    assert b["questions"] == 3 and b["speedup_geomean"] == pytest.approx((0.5 * 3.0 * 1.0) ** (1 / 3))
    assert m["categories"]["a"]["speedup_arith"] == pytest.approx(2.0)
    assert s["methods"]["ar"]["speedup_geomean"] == pytest.approx(1.0)
    assert math.isclose(geomean([1, 4]), 2.0)


def test_jacobi_statistics_are_pooled_per_category():
    def jac(q, cat, ff, stationary, blocks):
        r = _row(q, "jacobi", 1.0, tokens=sum(ff), cat=cat, steps=len(ff))
        r["turns"] = [{"method_stats": {"fast_forward": ff, "stationary_tokens": stationary,
                                         "blocks_started": blocks}}]
        return r

    rows = [_row("1", "ar", 1.0), _row("2", "ar", 1.0, cat="b"), _row("3", "ar", 1.0, cat="b"),
            jac("1", "a", [1, 3, 2], 2, 1), jac("2", "b", [1, 1], 0, 1), jac("3", "b", [4, 1, 1, 2], 3, 2)]
    s = aggregate(rows)
    j = s["methods"]["jacobi"]
    assert j["jacobi"] == {"iterations": 9, "fast_forward_per_iteration": pytest.approx(16 / 9),
                           "stationary_per_block": pytest.approx(5 / 4), "blocks": 4}
    assert j["categories"]["b"]["jacobi"]["fast_forward_per_iteration"] == pytest.approx(10 / 6)
    assert j["categories"]["a"]["jacobi"]["stationary_per_block"] == pytest.approx(2.0)
    assert "jacobi" not in s["methods"]["ar"]
    md = render_markdown(s, [])
    assert "## Jacobi iterations" in md and "`jacobi` fast-forwarded / iteration | 2.00 | 1.67 | 1.78 |" in md


def test_report_only_regenerates(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    rows = [_row("1", "ar", 1.0), _row("1", "m", 0.5, attempts=[4, 2], accepts=[3, 1], steps=5),
            _row("2", "ar", 1.0, cat="b"), _row("2", "m", 0.4, cat="b", steps=5)]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "--report-only", "--out", str(out)]) == 0
    for name in ("summary.json", "report.md", "speedup_by_category.png", "acceptance_by_depth.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["m"]["speedup_geomean"] == pytest.approx(math.sqrt(2.0 * 2.5))
    assert "report.md" in capsys.readouterr().out
    write_report(out, read_rows(out / "results.jsonl"), plots=False)


# ----------------------------------------------------------------------------------------------------------------
# The command line: bad input, and a run killed midway then resumed
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--questions", "{tmp}/missing.jsonl"], "missing.jsonl does not exist"),
        (["--questions", "{tmp}/broken.jsonl"], "broken.jsonl line 1: not valid JSON"),
        (["--questions", "{tmp}/q.jsonl", "--methods", "ar,warp"], "unknown method 'warp'"),
        (["--questions", "{tmp}/q.jsonl", "--peers", "vllm"], "unknown peer 'vllm'"),
        (["--questions", "{tmp}/q.jsonl", "--categories", "poetry"], "unknown category 'poetry'"),
        (["--questions", "{tmp}/empty.jsonl"], "holds no questions"),
        (["--questions", "{tmp}/q.jsonl", "--limit", "0"], "--limit must be a positive integer"),
        (["--questions", "{tmp}/q.jsonl", "-o", "zz.k=1"], "no method labelled 'zz'"),
        (["--report-only", "--out", "{tmp}/nothing"], "does not exist; run the benchmark first"),
        ([], "give at least one --questions file"),
    ],
)
def test_cli_bad_input_one_line(tmp_path, capsys, monkeypatch, extra, message):
    import fastforward

    def no_load(*a, **kw):
        raise AssertionError("the model must not be loaded for bad input")

    monkeypatch.setattr(fastforward, "load", no_load)
    spec_bench_like(tmp_path / "q.jsonl")
    (tmp_path / "broken.jsonl").write_text("{nope\n")
    (tmp_path / "empty.jsonl").write_text("")
    argv = ["bench", "--out", str(tmp_path / "out")] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("fastforward: error: ")


def test_cli_in_process(tiny, tmp_path, capsys, monkeypatch):
    import fastforward

    monkeypatch.setattr(fastforward, "load", lambda *a, **kw: tiny)
    out = tmp_path / "out"
    argv = ["bench", "--questions", str(spec_bench_like(tmp_path / "q.jsonl")), "--categories", "translation,writing",
            "--per-category", "1", "--methods", "ar2=ar", "--peers", "hf-generate", "--max-new-tokens", "5",
            "--warmup", "0", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    rows = read_rows(out / "results.jsonl")
    assert sorted({(r["question_id"], r["label"]) for r in rows}) == [
        (q, m) for q in ("161", "81") for m in ("ar", "ar2", "hf-generate")]
    assert rows[0]["command"].startswith("fastforward bench --questions ")
    assert "--methods ar,ar2=ar --peers hf-generate" in rows[0]["command"]
    stdout = capsys.readouterr().out
    assert "hf-generate" in stdout and "report.md" in stdout


def test_cli_refuses_other_settings_before_loading(tmp_path, capsys, monkeypatch):
    import fastforward

    monkeypatch.setattr(fastforward, "load", lambda *a, **kw: pytest.fail("the model must not be loaded"))
    out = tmp_path / "out"
    out.mkdir()
    row = _row("81", "ar", 1.0)
    row["parameters"] = {"model": "smollm2-135m", "max_new_tokens": 32, "temperature": 0.0, "seed": 0}
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["bench", "--questions", str(spec_bench_like(tmp_path / "q.jsonl")), "--max-new-tokens", "64",
            "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "max_new_tokens=32 (this run: 64); rerun with --force" in err and err.count("\n") == 1


def make_tiny_hf_folder(path: Path, vocab: int = 64) -> Path:
    """A tiny random Llama saved as a Hugging Face folder, with a real (word-level) tokenizer file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastforward.testing import tiny_llama_hf

    model = tiny_llama_hf(vocab_size=vocab, dtype=torch.float32)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return path


@pytest.mark.slow
def test_kill_midway_and_resume(tmp_path):
    """Ctrl-C a run, then kill -9 the resumed run, then finish it: every (question, method, repeat) is in
    results.jsonl exactly once."""
    model_dir = make_tiny_hf_folder(tmp_path / "tiny-model")
    records = [{"question_id": i, "category": ["a", "b", "c"][i % 3], "turns": [f"t{i % 60 + 1} t{i % 7 + 2} t3"]}
               for i in range(40)]
    questions = write_jsonl(tmp_path / "q.jsonl", records)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fastforward.cli", "bench", "--questions", str(questions), "--methods", "ar,ar2=ar",
           "--peers", "hf-generate", "--model", str(model_dir), "--max-new-tokens", "48", "--repeats", "2",
           "--threads", "1", "--warmup", "0", "--no-progress", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results = out / "results.jsonl"
    expected = 40 * 3 * 2

    def lines() -> int:
        return len(results.read_text().splitlines()) if results.exists() else 0

    def start_and_stop(sig, after_rows):
        # A child of a shell's background job inherits SIGINT ignored (and Python then keeps it ignored), which
        # would turn the Ctrl-C below into a no-op; give the child the default disposition a terminal user has.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 120
        while lines() < after_rows and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be stopped: {proc.communicate()}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err

    rc, err = start_and_stop(signal.SIGINT, 10)  # Ctrl-C
    assert rc == 130 and "run the same command again to resume" in err
    first = lines()
    assert 10 <= first < expected
    rc, err = start_and_stop(signal.SIGTERM, first + 10)  # kill (a scheduler's notice): stops as Ctrl-C does
    assert rc == 143 and "terminated" in err and "run the same command again to resume" in err
    assert "Traceback" not in err, err
    second = lines()
    assert second >= first + 10
    rc, _ = start_and_stop(signal.SIGKILL, second + 10)  # kill -9
    assert rc == -signal.SIGKILL
    assert lines() >= second + 10
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    keys = [(r["question_id"], r["label"], r["repeat"]) for r in rows]
    assert len(keys) == expected and len(set(keys)) == expected
    assert all(r["lossless"] for r in rows)
    assert (out / "report.md").exists() and (out / "summary.json").exists()
