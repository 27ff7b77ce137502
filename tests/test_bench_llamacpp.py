"""The llama.cpp peers of ``fastforward bench`` (``llama-cpp``, ``llama-cpp-pld``).

Without llama-cpp-python installed: the one-line errors (package missing, model not GGUF, bad option), the agreement
record of a peer that is not token-exact, and the report's llama.cpp sections. With it (slow): a real run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli

from fastforward.bench import MethodSpec, load_questions, parse_specs, resolve_specs, run_bench
from fastforward.bench.methods import EngineRunner
from fastforward.bench.report import aggregate, render_markdown
from fastforward.bench.runner import agreement
from fastforward.errors import UsageError
from fastforward.testing import tiny_hf_folder, tiny_target


def write_questions(path: Path) -> Path:
    records = [
        {"question_id": 1, "category": "poems", "turns": ["t1 t2 t3 t4", "t5 t6"]},
        {"question_id": 2, "category": "translation", "turns": ["t7 t8 t9 t7 t8"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: the errors must come before it."""
    import fastforward

    monkeypatch.setattr(fastforward, "load", lambda *a, **kw: pytest.fail("the model must not be loaded"))


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    """A path that resolves as a GGUF model (never read: the checks stop before loading it)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


# ----------------------------------------------------------------------------------------------------------------
# One-line errors, before any work
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("peers", ["llama-cpp", "llama-cpp-pld", "hf-generate,llama-cpp-pld:num_pred_tokens=4"])
def test_missing_package_is_one_line_exit_2(tmp_path, capsys, monkeypatch, no_load, fake_gguf, peers):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    out = tmp_path / "out"
    line = assert_one_line_error(
        capsys, "bench", "--questions", write_questions(tmp_path / "q.jsonl"), "--model", fake_gguf,
        "--methods", "ar", "--peers", peers, "--out", out,
        match="llama-cpp peers need llama-cpp-python: pip install -e '.[llamacpp]'")
    assert "~8 min" in line
    assert not out.exists()  # no work done


def test_missing_package_in_python_api(tmp_path, monkeypatch, fake_gguf):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    target = tiny_target()
    target.name = str(fake_gguf)  # as if loaded from that file
    qs = load_questions(write_questions(tmp_path / "q.jsonl"))
    specs = resolve_specs(parse_specs(["ar"]), parse_specs(["llama-cpp"], "peer"))
    with pytest.raises(UsageError, match=r"need llama-cpp-python: pip install -e '\.\[llamacpp\]'"):
        run_bench(target, qs, specs, tmp_path / "out", max_new_tokens=4, warmup=0, progress=False)
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_non_gguf_model_is_refused_before_loading(tmp_path, capsys, no_load):
    model = tiny_hf_folder(tmp_path / "tiny-hf")
    out = tmp_path / "out"
    line = assert_one_line_error(
        capsys, "bench", "--questions", write_questions(tmp_path / "q.jsonl"), "--model", model,
        "--peers", "llama-cpp", "--out", out, match="llama-cpp peers need a .gguf model")
    assert "Hugging Face folder" in line
    assert not out.exists()


def test_non_gguf_target_is_refused_by_run_bench(tiny, tmp_path):
    # the tiny target is built in memory: its name resolves to no file at all
    qs = load_questions(write_questions(tmp_path / "q.jsonl"))
    for peer in ("llama-cpp", "llama-cpp-pld"):
        specs = resolve_specs(parse_specs(["ar"]), parse_specs([peer], "peer"))
        with pytest.raises(UsageError, match=r"llama-cpp peers need a \.gguf model.*'tiny-llama' is not one"):
            run_bench(tiny, qs, specs, tmp_path / "out", max_new_tokens=4, warmup=0, progress=False)
    assert not (tmp_path / "out" / "results.jsonl").exists()


@pytest.mark.parametrize("spec, message", [
    ("llama-cpp-pld:num_pred_tokens=0", "num_pred_tokens must be a positive integer, got 0"),
    ("llama-cpp-pld:max_ngram_size='x'", "max_ngram_size must be a positive integer"),
    ("llama-cpp:num_pred_tokens=3", "peer 'llama-cpp' has no option num_pred_tokens"),
])
def test_bad_peer_options(tmp_path, capsys, no_load, fake_gguf, spec, message):
    assert_one_line_error(capsys, "bench", "--questions", write_questions(tmp_path / "q.jsonl"), "--model", fake_gguf,
                          "--peers", spec, "--out", tmp_path / "out", match=message)


# ----------------------------------------------------------------------------------------------------------------
# Agreement instead of losslessness
# ----------------------------------------------------------------------------------------------------------------


def test_agreement():
    a = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 6]])
    assert (a["identical_prefix"], a["ar_tokens"], a["fraction"], a["identical_turns"], a["identical"]) == (
        6, 6, 1.0, 2, True)
    assert a["first_divergence"] is None
    a = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 7, 8]])
    assert (a["identical_prefix"], a["fraction"], a["identical_turns"], a["identical"]) == (5, 5 / 6, 1, False)
    assert (a["first_divergence"]["turn"], a["first_divergence"]["index"]) == (1, 1)
    # a later turn counts only while the earlier ones were identical (its prompt is AR's only then)
    a = agreement([[1, 2, 3, 4], [5, 6]], [[1, 9, 3, 4], [5, 6]])
    assert (a["identical_prefix"], a["identical_turns"]) == (1, 0)
    a = agreement([[1, 2, 3]], [[1, 2]])  # one output a prefix of the other
    assert (a["identical_prefix"], a["fraction"], a["identical"]) == (2, 2 / 3, False)


class InexactRunner:
    """Like a llama.cpp peer: AR's tokens with one changed, and ``exact = False``."""

    exact = False
    lossless = False

    def __init__(self, index: int):
        self.inner = EngineRunner(MethodSpec("ar", "ar"))
        self.index = index

    def generate(self, target, prompt_ids, **kw):
        out = self.inner.generate(target, prompt_ids, **kw)
        if len(out.token_ids) > self.index:
            out.token_ids[self.index] = (out.token_ids[self.index] + 1) % target.vocab_size
        return out


def test_inexact_runner_records_agreement_not_mismatches(tiny, tmp_path):
    qs = load_questions(write_questions(tmp_path / "q.jsonl"))
    specs = [MethodSpec("ar", "ar"), MethodSpec("llama-cpp", "llama-cpp", kind="peer"),
             MethodSpec("ar2", "ar")]
    rows = run_bench(tiny, qs, specs, tmp_path / "out", max_new_tokens=8, warmup=0, progress=False,
                     runners={"llama-cpp": InexactRunner(3)})
    by = {(r["question_id"], r["label"]): r for r in rows}
    for q in ("1", "2"):
        peer = by[(q, "llama-cpp")]
        assert peer["lossless"] is None and peer["first_divergence"] is None
        assert peer["lossless_claimed"] is False
        assert peer["agreement"]["identical_prefix"] == 3 and peer["agreement"]["identical_turns"] == 0
        assert peer["agreement"]["fraction"] == pytest.approx(3 / by[(q, "ar")]["new_tokens"])
        assert by[(q, "ar2")]["lossless"] is True and "agreement" not in by[(q, "ar2")]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    m = summary["methods"]["llama-cpp"]
    assert m["checked"] == 0 and m["mismatches"] == 0 and summary["mismatch_details"] == []
    assert m["agreement"]["identical_prefix_tokens"] == pytest.approx(3.0)
    assert m["agreement"]["identical_questions"] == 0 and m["agreement"]["turns"] == 3
    assert m["categories"]["poems"]["agreement"]["identical_prefix_fraction"] == pytest.approx(3 / 16)
    assert "speedup_vs_llama_cpp_geomean" in summary["methods"]["ar"]
    assert summary["methods"]["llama-cpp"]["speedup_vs_llama_cpp_geomean"] == pytest.approx(1.0)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Agreement with AR" in report and "## Against llama.cpp" in report
    assert "Every output is token-identical to AR's." in report  # the checked ones are
    assert "Not checked (other arithmetic" in report and "n/a (" in report


# ----------------------------------------------------------------------------------------------------------------
# The report: ratios against llama.cpp and time to first token
# ----------------------------------------------------------------------------------------------------------------


def _row(q, label, wall, tokens=10, cat="a", prefill=0.0, turns=1, kind="method", agree=None):
    row = {"question_id": q, "label": label, "method": label, "kind": kind, "options": {}, "category": cat,
           "repeat": 0, "new_tokens": tokens, "wall_time": wall, "decoding_steps": tokens, "depth_attempts": [],
           "depth_accepts": [], "lossless": None if agree else True, "first_divergence": None,
           "prefill_time": prefill, "turns": [{}] * turns, "parameters": {"max_new_tokens": 10}, "timestamp": "t"}
    if agree is not None:
        row["agreement"] = {"identical_prefix": agree, "ar_tokens": 10, "fraction": agree / 10,
                            "identical_turns": int(agree == 10), "turns": 1, "identical": agree == 10}
    return row


def test_report_against_llama_cpp_and_ttft():
    rows = [
        _row("1", "ar", 1.0, prefill=0.1), _row("1", "pld", 0.5, prefill=0.1),
        _row("1", "llama-cpp", 0.8, prefill=0.3, kind="peer", agree=10),
        _row("2", "ar", 1.0, cat="b", prefill=0.4, turns=2), _row("2", "pld", 0.4, cat="b", prefill=0.4, turns=2),
        _row("2", "llama-cpp", 2.0, cat="b", prefill=0.6, turns=2, kind="peer", agree=5),
        _row("1", "hf-generate", 2.0, kind="peer"), _row("2", "hf-generate", 2.0, cat="b", kind="peer"),
    ]
    s = aggregate(rows)
    ar, pld, lc = (s["methods"][k] for k in ("ar", "pld", "llama-cpp"))
    # geometric mean over questions of tokens/s ratios to llama-cpp: ar 0.8 and 2.0; pld 1.6 and 5.0
    assert ar["speedup_vs_llama_cpp_geomean"] == pytest.approx(math.sqrt(0.8 * 2.0))
    assert pld["speedup_vs_llama_cpp_geomean"] == pytest.approx(math.sqrt(1.6 * 5.0))
    assert pld["categories"]["b"]["speedup_vs_llama_cpp_geomean"] == pytest.approx(5.0)
    assert lc["speedup_vs_llama_cpp_geomean"] == pytest.approx(1.0)
    assert ar["speedup_vs_hf_generate_geomean"] == pytest.approx(2.0)  # the hf-generate comparison still works
    # time to first token: per turn, then mean over questions
    assert ar["ttft"] == pytest.approx((0.1 + 0.2) / 2) and ar["categories"]["b"]["ttft"] == pytest.approx(0.2)
    assert lc["ttft"] == pytest.approx((0.3 + 0.3) / 2)
    assert s["methods"]["hf-generate"]["ttft"] is None  # not measured
    assert lc["agreement"]["identical_prefix_fraction"] == pytest.approx(0.75)
    assert (lc["agreement"]["identical_questions"], lc["agreement"]["identical_turns"]) == (1, 1)
    assert lc["checked"] == 0 and lc["mismatches"] == 0 and "agreement" not in ar
    md = render_markdown(s, [])
    assert "## Against llama.cpp" in md and "## Against Hugging Face transformers" in md
    assert "| `pld` | 1.60× | 5.00× | 2.83× |" in md
    assert "## Time to first token per category (ms)" in md and "| `ar` | 100 | 200 | 150 |" in md
    assert "hf-generate` |" not in md.split("## Time to first token")[1].split("##")[0]
    assert "| `llama-cpp` | 100.0% | 50.0% | 75.0% | 7.5 | 1/2 | 1/2 |" in md
    assert "n/a (75.0% agreement)" in md


def test_report_gives_every_ratio_end_to_end_and_decode_only():
    """Decode only: tokens after each turn's first over the time after it (per-turn counts when the row has them,
    else one first token per turn). ar: 9 tokens in 0.9 s and 8 in 0.6 s; llama-cpp: 9 in 0.5 s and 8 in 1.4 s."""
    rows = [
        _row("1", "ar", 1.0, prefill=0.1), _row("1", "llama-cpp", 0.8, prefill=0.3, kind="peer", agree=10),
        _row("2", "ar", 1.0, cat="b", prefill=0.4, turns=2),
        _row("2", "llama-cpp", 2.0, cat="b", prefill=0.6, turns=2, kind="peer", agree=5),
    ]
    rows[2]["turns"] = [{"new_tokens": 6}, {"new_tokens": 4}]  # 5 + 3 tokens after the first of each turn
    s = aggregate(rows)
    ar, lc = s["methods"]["ar"], s["methods"]["llama-cpp"]
    assert ar["speedup_vs_llama_cpp_geomean"] == pytest.approx(math.sqrt(0.8 * 2.0))  # end to end, as before
    decode = math.sqrt((9 / 0.9) / (9 / 0.5) * (8 / 0.6) / (8 / 1.4))
    assert ar["speedup_vs_llama_cpp_decode_geomean"] == pytest.approx(decode)
    assert ar["categories"]["b"]["speedup_vs_llama_cpp_decode_geomean"] == pytest.approx((8 / 0.6) / (8 / 1.4))
    assert lc["speedup_vs_llama_cpp_decode_geomean"] == pytest.approx(1.0)
    assert ar["decode_tokens_per_s"] == pytest.approx(17 / 1.5) and lc["decode_tokens_per_s"] == pytest.approx(17 / 1.9)
    assert ar["speedup_decode_geomean"] == pytest.approx(1.0)
    # time to first token apart: llama-cpp's mean (0.3 + 0.3) / 2 over ar's (0.1 + 0.2) / 2
    assert ar["ttft_speedup_vs_llama_cpp"] == pytest.approx(0.3 / 0.15)
    assert ar["categories"]["a"]["ttft_speedup_vs_llama_cpp"] == pytest.approx(3.0)
    for key in ("speedup_vs_llama_cpp_decode_geomean", "ttft_speedup_vs_llama_cpp", "decode_tokens_per_s"):
        assert key in s["definitions"]
    md = render_markdown(s, [])
    section = md.split("## Against llama.cpp")[1].split("\n## ")[0]
    assert "**End to end**" in section and "**Decode only**" in section and "**Time to first token**" in section
    assert f"| `ar` | {(9 / 0.9) / (9 / 0.5):.2f}× | {(8 / 0.6) / (8 / 1.4):.2f}× | {decode:.2f}× |" in section
    assert "| `ar` | 3.00× | 1.50× | 2.00× |" in section  # TTFT: per category, then overall
    assert "decode tokens/s" in md.split("## Overall")[1] and "TTFT ms" in md.split("## Overall")[1]


def test_report_without_time_to_first_token_has_no_decode_numbers():
    """Rows that did not measure the first token (prefill_time 0, e.g. old runs of a peer): no decode-only ratio,
    '–' in the tables, and the report still renders."""
    s = aggregate([_row("1", "ar", 1.0), _row("1", "llama-cpp", 0.8, kind="peer", agree=10)])
    ar = s["methods"]["ar"]
    assert ar["speedup_vs_llama_cpp_geomean"] == pytest.approx(0.8)
    assert ar["speedup_vs_llama_cpp_decode_geomean"] is None and ar["decode_tokens_per_s"] is None
    assert ar["ttft_speedup_vs_llama_cpp"] is None
    md = render_markdown(s, [])
    assert "**End to end**" in md and "**Decode only**" not in md


def test_llama_cpp_system_info_is_recorded_and_reported(monkeypatch):
    """The runner's environment records llama.cpp's system_info when llama_cpp is imported; the summary takes the
    newest row's and report.md prints it; rows from before it was recorded have none."""
    from fastforward.bench.runner import environment

    class FakeLlamaCpp:
        __version__ = "9.9"

        @staticmethod
        def llama_print_system_info():
            return b"CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 | "

    monkeypatch.setitem(sys.modules, "llama_cpp", FakeLlamaCpp)
    env = environment()
    assert env["software"]["llama_cpp_system_info"] == "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    rows = [_row("1", "ar", 1.0), _row("1", "llama-cpp", 0.8, kind="peer", agree=10)]
    for r in rows:
        r["software"] = env["software"]
    s = aggregate(rows)
    assert s["environment"]["llama_cpp_system_info"].startswith("CPU : AVX2 = 1")
    md = render_markdown(s, [])
    assert "- llama.cpp system_info: `CPU : AVX2 = 1 | AVX512 = 1" in md
    assert "llama_cpp_system_info" not in md.split("- software:")[1].split("\n")[0]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert "llama_cpp_system_info" not in environment()["software"]
    assert aggregate([_row("1", "ar", 1.0)])["environment"]["llama_cpp_system_info"] is None


def test_report_without_llama_cpp_has_no_llama_sections():
    s = aggregate([_row("1", "ar", 1.0), _row("1", "pld", 0.5)])
    assert "speedup_vs_llama_cpp_geomean" not in s["methods"]["ar"]
    md = render_markdown(s, [])
    assert "llama.cpp" not in md and "Agreement" not in md


# ----------------------------------------------------------------------------------------------------------------
# For real (llama-cpp-python installed, default model)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_cpp_peers_for_real(tmp_path, capsys):
    llama_cpp = pytest.importorskip("llama_cpp")
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Write one sentence about the sea."]}) + "\n"
        + json.dumps({"question_id": 2, "category": "qa", "turns": ["What is the capital of France?",
                                                                    "And of Italy?"]}) + "\n")
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "bench", "--questions", questions, "--methods", "ar",
                                "--peers", "llama-cpp,llama-cpp-pld:num_pred_tokens=6", "--max-new-tokens", "16",
                                "--warmup", "1", "--no-progress", "--out", out)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["question_id"], r["label"]) for r in rows) == [
        (q, m) for q in ("1", "2") for m in ("ar", "llama-cpp", "llama-cpp-pld")]
    for r in rows:
        assert not r.get("error"), r.get("error")
        assert r["software"]["llama-cpp-python"] == llama_cpp.__version__
        assert 0 < r["new_tokens"] <= 16 * len(r["turns"])
        if r["label"] == "ar":
            assert r["lossless"] is True
            continue
        assert r["kind"] == "peer" and r["lossless"] is None and r["first_divergence"] is None
        a = r["agreement"]
        assert 0 <= a["identical_prefix"] <= a["ar_tokens"] and 0.0 <= a["fraction"] <= 1.0
        assert r["prefill_time"] > 0 and r["wall_time"] > r["prefill_time"]
        if r["label"] == "llama-cpp":  # one eval per token (the prefill gives the first)
            assert r["decoding_steps"] == r["new_tokens"]
        else:
            assert 1 <= r["decoding_steps"] <= r["new_tokens"]
            assert r["effective_options"] == {"num_pred_tokens": 6, "max_ngram_size": 2}
    summary = json.loads((out / "summary.json").read_text())
    for label in ("llama-cpp", "llama-cpp-pld"):
        m = summary["methods"][label]
        assert m["mismatches"] == 0 and m["checked"] == 0 and m["errors"] == 0
        assert m["agreement"]["questions"] == 2 and m["agreement"]["turns"] == 3
        assert m["ttft"] > 0 and m["tokens_per_s"] > 0
    assert summary["mismatch_details"] == []
    assert summary["methods"]["ar"]["speedup_vs_llama_cpp_geomean"] > 0
    assert summary["methods"]["ar"]["speedup_vs_llama_cpp_decode_geomean"] > 0
    assert summary["methods"]["ar"]["ttft_speedup_vs_llama_cpp"] > 0
    info = llama_cpp.llama_print_system_info().decode()
    assert summary["environment"]["llama_cpp_system_info"] == " ".join(info.split())
    assert all(r["software"]["llama_cpp_system_info"] == " ".join(info.split()) for r in rows)
    report = (out / "report.md").read_text()
    assert "- llama.cpp system_info: `" in report and "**Decode only**" in report
    assert "## Against llama.cpp" in report and "## Agreement with AR" in report
    assert "## Time to first token per category (ms)" in report
    assert "llama-cpp" in stdout
