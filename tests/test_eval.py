"""`fastforward eval`: GSM8K answer extraction, HumanEval program assembly and sandboxed execution, held-out NLL on a
tiny model (finite, deterministic, disjoint from training), and one-line usage errors."""

import gzip
import json
import math

import pytest
from cli_helpers import assert_one_line_error, run_cli

from fastforward.evaluate import (
    extract_code,
    extract_gsm8k_answer,
    gsm8k_gold,
    humaneval_program,
    network_namespace_available,
    run_program,
    same_number,
)
from fastforward.testing import tiny_hf_folder
from fastforward.train.data import data_root, read_examples, split_examples

PROBLEM = {
    "task_id": "Toy/0",
    "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs.\n'
              '    >>> total([1, 2])\n    3\n    """\n',
    "entry_point": "total",
    "test": "\n\ndef check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
}






@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), max_positions=512))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.json"
    recs = [{"instruction": f"Double {i}.", "input": "", "output": f"{i} * 2 = {2 * i}"} for i in range(400)]
    path.write_text(json.dumps(recs))
    return str(path)


# --------------------------------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("The total is $1,000.50.", "1000.50"),
        ("He ends with -5 dollars", "-5"),
        ("First 3, then 4, so the answer is 12.", "12"),
        ("Answer: #### 18. (not 20)", "18"),
        ("#### 7\nThen some 99 chatter #### 8 done", "8"),
        ("It costs .5 dollars", "0.5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_gsm8k_gold_and_comparison():
    assert gsm8k_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gsm8k_gold("... #### 1,600") == "1600"
    assert gsm8k_gold("#### -3") == "-3"
    assert same_number("18.0", "18") and same_number("1600", "1600")
    assert not same_number("17", "18") and not same_number(None, "18")


def test_gsm8k_gold_of_every_shared_test_record_parses():
    path = data_root() / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip("shared GSM8K data not present")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    golds = [gsm8k_gold(r["answer"]) for r in rows]
    assert len(golds) == 1319 and all(float(g) == float(g) for g in golds)
    # the reference solutions themselves score 100% through the same extractor
    assert all(same_number(extract_gsm8k_answer(r["answer"]), g) for r, g in zip(rows, golds, strict=True))


# --------------------------------------------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------------------------------------------


def test_extract_code():
    reply = "Here it is:\n```python\ndef total(xs):\n    return sum(xs)\n```\nDone."
    assert extract_code(reply, "total") == "def total(xs):\n    return sum(xs)\n"
    two = "```\nprint('usage')\n```\nand\n```py\ndef total(xs):\n    return 0\n```"
    assert extract_code(two, "total").startswith("def total")
    assert extract_code(two, None) == "print('usage')\n"
    unclosed = "```python\ndef total(xs):\n    return sum(xs)"
    assert extract_code(unclosed, "total") == "def total(xs):\n    return sum(xs)"
    assert extract_code("    return sum(xs)\n", "total") == "    return sum(xs)\n"


@pytest.mark.parametrize(
    "code",
    ["def total(xs: List[int]) -> int:\n    return sum(xs)\n", "    return sum(xs)\n"],
    ids=["whole-function", "body-continuation"],
)
def test_humaneval_correct_completion_passes(code):
    passed, detail = run_program(humaneval_program(PROBLEM, code), timeout=20)
    assert passed, detail


@pytest.mark.parametrize(
    "code, why",
    [
        ("def total(xs):\n    return len(xs)\n", "AssertionError"),
        ("def total(xs):\n    return sum(xs\n", "SyntaxError"),
        ("def total(xs):\n    import socket\n    socket.socket()\n    return sum(xs)\n", "blocked"),
        ("def total(xs):\n    import os\n    os.system('true')\n    return sum(xs)\n", "blocked"),
    ],
    ids=["wrong", "syntax", "socket", "system"],
)
def test_humaneval_wrong_completion_fails(code, why):
    passed, detail = run_program(humaneval_program(PROBLEM, code), timeout=20)
    assert not passed and why in detail, detail


def test_humaneval_timeout_kills_the_program():
    passed, detail = run_program(humaneval_program(PROBLEM, "def total(xs):\n    while True:\n        pass\n"),
                                 timeout=1.5)
    assert not passed and "timeout" in detail


def test_program_has_no_network_when_namespaces_are_available():
    if not network_namespace_available():
        pytest.skip("unshare -rn is not available here: only the in-process guard applies")
    probe = (
        "import _socket\n"  # below the guard: the raw socket module
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.settimeout(2)\n"
        "try:\n    s.connect(('1.1.1.1', 53))\nexcept OSError as e:\n    raise SystemExit(3)\n"
    )
    passed, detail = run_program(probe, timeout=10)
    assert not passed and "exit status 3" in detail


def test_canonical_solutions_pass():
    path = data_root() / "humaneval" / "HumanEval.jsonl.gz"
    if not path.is_file():
        pytest.skip("shared HumanEval data not present")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f][:3]
    for row in rows:
        passed, detail = run_program(humaneval_program(row, row["canonical_solution"]), timeout=20)
        assert passed, (row["task_id"], detail)
        passed, _ = run_program(humaneval_program(row, "    return None\n"), timeout=20)
        assert not passed, row["task_id"]


# --------------------------------------------------------------------------------------------------------------
# End to end on a tiny model
# --------------------------------------------------------------------------------------------------------------


def test_nll_is_finite_deterministic_and_held_out(tiny_folder, data_file, capsys):
    argv = ["eval", "--task", "nll", "--model", tiny_folder, "--data", data_file, "--limit", 8, "--max-length", 64,
            "--quiet"]
    code, out1, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    code, out2, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    r1, r2 = json.loads(out1), json.loads(out2)
    assert r1["nll"] == r2["nll"] and math.isfinite(r1["nll"]) and r1["nll"] > 0
    assert r1["records"] == 8 and r1["tokens"] > 8
    assert math.log(256) * 0.5 < r1["nll"] < math.log(260) * 3  # a random model: about uniform over the vocabulary
    # the held-out records are exactly those training never sees
    train, held = split_examples(read_examples(data_file), 0.05)
    assert len(held) >= 8 and not {e.key for e in train} & {e.key for e in held}
    noise = r1["ahead_noise"]  # on by default: L=4 predictions from noisy inputs per record
    assert noise["noise_length"] == 4 and noise["predictions"] == 4 * 8 and 0 <= noise["noisy_accuracy"] <= 1
    code, out, err = run_cli(capsys, *argv)  # the one-line summary
    assert code == 0 and out.count("\n") == 1 and out.startswith("nll ") and "ahead-noised" in out


class _StubLM:
    """A stand-in causal LM over a vocabulary of 50. ``mode="oracle"`` knows the clean sequence and predicts its next
    token whatever the inputs (a perfect denoiser); ``mode="bigram"`` predicts the clean successor of its *own input*
    token (perfect on clean inputs, fooled by noise)."""

    def __init__(self, clean, mode):
        self.clean, self.mode = clean, mode
        self.successor = {a: b for a, b in zip(clean, clean[1:], strict=False)}

    def eval(self):
        return self

    def __call__(self, input_ids, use_cache=False):
        import types

        import torch

        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), 50)
        for j, tok in enumerate(ids[:-1]):
            want = self.clean[j + 1] if self.mode == "oracle" else self.successor.get(tok, 0)
            logits[0, j, want] = 10.0
        return types.SimpleNamespace(logits=logits)


def test_ahead_noise_scores_predictions_from_noisy_inputs():
    from fastforward.evaluate import response_nll
    from fastforward.train.data import Encoded

    clean = [1, 2, 3] + list(range(10, 40))  # 3 prompt tokens, 30 distinct response tokens
    enc = [Encoded(input_ids=clean, prompt_len=3)]
    oracle = response_nll(_StubLM(clean, "oracle"), enc, noise_length=4, seed=0)
    bigram = response_nll(_StubLM(clean, "bigram"), enc, noise_length=4, seed=0)
    for r in (oracle, bigram):
        assert r["count"] == 30 and r["correct"] == 30 and r["noisy_count"] == 4 and r["clean_correct"] == 4
    assert oracle["noisy_correct"] == 4  # a perfect denoiser is not fooled
    # ahead noise copies strictly earlier tokens; with all tokens distinct each noisy input's clean successor is
    # never the label, so the input-following bigram model misses all 4
    assert bigram["noisy_correct"] == 0 and bigram["noisy_nll"] > bigram["clean_nll"]
    assert response_nll(_StubLM(clean, "bigram"), enc, noise_length=4, seed=0) == bigram  # seeded: same noise
    assert response_nll(_StubLM(clean, "bigram"), enc, noise_length=0)["noisy_count"] == 0


def test_gsm8k_and_humaneval_run_end_to_end(tiny_folder, tmp_path, capsys):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                           for i in range(2)))
    code, out, err = run_cli(capsys, "eval", "--task", "gsm8k", "--model", tiny_folder, "--data", gsm,
                             "--max-new-tokens", 8, "--json", "--quiet", "--save", tmp_path / "g.json")
    assert code == 0, err
    r = json.loads(out)
    assert r["n"] == 2 and 0.0 <= r["accuracy"] <= 1.0 and r["method"] == "ar"
    assert len(json.loads((tmp_path / "g.json").read_text())["samples"]) == 2
    # --compare: the same model and method against itself agrees on everything
    code, out, err = run_cli(capsys, "eval", "--task", "gsm8k", "--model", tiny_folder, "--data", gsm,
                             "--max-new-tokens", 8, "--quiet", "--method", "jacobi", "--compare", tmp_path / "g.json")
    assert code == 0, err
    assert "same answer 2/2, identical text 2/2" in out
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps(PROBLEM) + "\n")
    code, out, err = run_cli(capsys, "eval", "--task", "humaneval", "--model", tiny_folder, "--data", he,
                             "--max-new-tokens", 8, "--quiet")
    assert code == 0, err
    assert out.startswith("humaneval pass@1 0.000 (0/1)")


def test_compare_counts_same_answers_and_texts():
    from fastforward.evaluate import compare_samples

    ref = {"model": "base", "method": "ar", "samples": {
        0: {"index": 0, "pred": "3", "output": "so 3"}, 1: {"index": 1, "pred": "4.0", "output": "4.0"},
        2: {"index": 2, "pred": None, "output": "?"}, 9: {"index": 9, "pred": "1", "output": "1"}}}
    mine = [{"index": 0, "pred": "3", "output": "so 3"}, {"index": 1, "pred": "4", "output": "4"},
            {"index": 2, "pred": "5", "output": "5"}, {"index": 3, "pred": "7", "output": "7"}]
    a = compare_samples("gsm8k", mine, ref)
    assert (a["n"], a["same_answer"], a["same_output"]) == (3, 2, 1)
    he_ref = {"model": "b", "method": "ar", "samples": {"H/0": {"task_id": "H/0", "passed": True, "output": "x"},
                                                         "H/1": {"task_id": "H/1", "passed": False, "output": "y"}}}
    a = compare_samples("humaneval", [{"task_id": "H/0", "passed": True, "output": "z"},
                                      {"task_id": "H/1", "passed": True, "output": "y"}], he_ref)
    assert (a["n"], a["same_answer"], a["same_output"]) == (2, 1, 1)


def test_usage_errors(tiny_folder, data_file, tmp_path, capsys):
    (tmp_path / "nll.json").write_text(json.dumps({"task": "nll", "samples": []}))
    gsm = tmp_path / "gsm.jsonl"  # its own file: the shared data need not exist beside a fresh clone
    gsm.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    gsm8k = ("eval", "--task", "gsm8k", "--model", tiny_folder, "--data", gsm)
    assert_one_line_error(capsys, *gsm8k, "--compare", tmp_path / "none.json", match="does not exist")
    assert_one_line_error(capsys, *gsm8k, "--compare", tmp_path / "nll.json", match="holds task 'nll'")
    assert_one_line_error(capsys, *gsm8k, "--save", tmp_path / "no" / "x.json", match="does not exist")
    assert_one_line_error(capsys, "eval", "--task", "bleu", "--model", tiny_folder, match="invalid choice")
    assert_one_line_error(capsys, "eval", "--task", "nll", "--model", tiny_folder, match="--data")
    assert_one_line_error(capsys, "eval", "--task", "nll", "--model", tiny_folder, "--data", tmp_path / "x.json",
                          match="not found")
    assert_one_line_error(capsys, "eval", "--task", "gsm8k", "--model", tiny_folder, "--data", tmp_path / "x.jsonl",
                          match="not found")
    assert_one_line_error(capsys, "eval", "--task", "gsm8k", "--model", tiny_folder, "--limit", 0, match="--limit")
    assert_one_line_error(capsys, "eval", "--task", "humaneval", "--model", tiny_folder, "--method", "nope",
                          match="unknown method")
    assert_one_line_error(capsys, "eval", "--task", "nll", "--model", tiny_folder, "--data", data_file,
                          "--heldout", 2, match="--heldout")
    assert_one_line_error(capsys, "eval", "--task", "nll", "--model", tiny_folder, "--data", data_file,
                          "--noise-length", -1, match="--noise-length")
