"""Bad input to the tool commands (eval, profile, build-tree, collect-trajectories, calibrate, train msn/cllm): one
line on stderr, exit code 2, before any work -- no model is loaded -- and options that do not apply to the chosen
mode are refused rather than silently ignored.

Everything runs in-process on a tiny random model folder; nothing here loads the default model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_helpers import fill, one_line_exit_2, run_cli

import fastforward as ff
import fastforward.model
from fastforward.testing import tiny_hf_folder, write_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Input files the cases name, as {placeholder: path}."""
    root = tmp_path_factory.mktemp("tools")
    tiny_hf_folder(root / "tiny", max_positions=128)

    def write(name: str, data) -> None:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)

    write("gsm.jsonl", "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                               for i in range(3)))
    write("q.jsonl", "".join(json.dumps({"question_id": i, "category": "c", "turns": [f"say {i}"]}) + "\n"
                             for i in range(3)))
    write("train.json", json.dumps([{"instruction": f"Add {i} and 1.", "input": "", "output": f"{i + 1}"}
                                    for i in range(12)]))
    write("binary.jsonl", b"\xff\xfe{}\n")
    write("empty.jsonl", "")
    write("list.jsonl", "[1, 2]\n")
    write("gsm-types.jsonl", '{"question": 1, "answer": 2}\n')
    write("gsm-no-number.jsonl", '{"question": "q?", "answer": "no final number"}\n')
    write("humaneval-types.jsonl", '{"task_id": 1, "prompt": null, "test": "t", "entry_point": "f"}\n')
    write("compare-samples.json", '{"task": "gsm8k", "samples": [1, 2]}')
    write("tree.json", '{"a": 1}')
    write("traj-wrong/trajectories.jsonl", '{"prompt_ids": [1], "answer_ids": "abc"}\n')
    write("traj-shape/trajectories.jsonl", '{"x": 1}\n')
    return {"{tiny}": str(root / "tiny"), "{dir}": str(root)}


OUT = "{dir}/never-written"
GSM = ["eval", "--task", "gsm8k", "--model", "{tiny}", "--quiet"]
HUMANEVAL = ["eval", "--task", "humaneval", "--model", "{tiny}", "--quiet"]
NLL = ["eval", "--task", "nll", "--model", "{tiny}", "--data", "{dir}/train.json"]
PROFILE = ["profile", "--model", "{tiny}"]
TREE = ["build-tree", "--model", "{tiny}", "--prompts", "{dir}/q.jsonl", "--out", "{dir}/tree-out.json"]
FROM = ["build-tree", "--model", "{tiny}", "--from", "{dir}/tree.json", "--out", "{dir}/tree-out.json"]
COLLECT = ["collect-trajectories", "--model", "{tiny}", "--prompts", "{dir}/q.jsonl", "--out", OUT, "--quiet"]
MSN = ["train", "msn", "--model", "{tiny}", "--data", "{dir}/train.json", "--out", OUT, "--quiet"]
CLLM = ["train", "cllm", "--model", "{tiny}", "--out", OUT, "--quiet", "--trajectories"]

CASES = [
    # eval: task files read and checked before the model loads
    (GSM + ["--data", "{dir}/gsm-types.jsonl"], "field 'question' must be a string"),
    (GSM + ["--data", "{dir}/gsm-no-number.jsonl"], "line 1: GSM8K answer without a final number"),
    (GSM + ["--data", "{dir}/list.jsonl"], "records must be JSON objects"),
    (GSM + ["--data", "{dir}/binary.jsonl"], "cannot read"),
    (GSM + ["--data", "{dir}/empty.jsonl"], "no gsm8k records"),
    (GSM + ["--data", ""], "--data is empty"),
    (HUMANEVAL + ["--data", "{dir}/humaneval-types.jsonl"], "field 'task_id' must be a string"),
    (GSM + ["--data", "{dir}/gsm.jsonl", "--compare", "{dir}/compare-samples.json"], "not a JSON object"),
    (NLL[:-1] + ["{dir}/binary.jsonl"], "cannot read"),
    (NLL[:-1] + ["{dir}/empty.jsonl"], "no usable records"),
    (NLL + ["--heldout", "0"], "no held-out records"),
    # eval: options of the other tasks are refused, not ignored
    (GSM + ["--data", "{dir}/gsm.jsonl", "--heldout", "0.5"], "--heldout applies to --task nll"),
    (GSM + ["--data", "{dir}/gsm.jsonl", "--max-length", "64"], "--max-length applies to --task nll"),
    (GSM + ["--data", "{dir}/gsm.jsonl", "--noise-length", "2"], "--noise-length applies to --task nll"),
    (GSM + ["--data", "{dir}/gsm.jsonl", "--timeout", "5"], "--timeout applies to --task humaneval"),
    (NLL + ["--method", "jacobi"], "--method applies to --task gsm8k or humaneval"),
    (NLL + ["-o", "k=1"], "-o applies"),
    (NLL + ["--max-new-tokens", "8"], "--max-new-tokens applies"),
    (NLL + ["--timeout", "5"], "--timeout applies"),
    (NLL + ["--compare", "{dir}/compare-samples.json"], "--compare applies"),
    # profile
    (PROFILE + ["--q", "1,1,2"], "twice"),
    (PROFILE + ["--stream", "500", "--q", "1,2"], "cannot be combined with --stream"),
    (PROFILE + ["--stream", "500", "--kv", "10"], "--kv cannot be combined"),
    (PROFILE + ["--stream", "500", "--repeats", "3"], "--repeats cannot be combined"),
    (PROFILE + ["--stream", "500", "--no-hf"], "--no-hf cannot be combined"),
    (PROFILE + ["--stream", "500", "--llama-cpp"], "--llama-cpp cannot be combined"),
    (PROFILE + ["--method", "jacobi"], "--method applies to --stream only"),
    (PROFILE + ["--prompt", "hi"], "--prompt applies to --stream only"),
    (PROFILE + ["--stop", "x"], "--stop applies to --stream only"),
    (PROFILE + ["--stream", "1e3"], "--stream"),
    (PROFILE + ["--context", "512", "--q", "1,2"], "--q cannot be combined with --context"),
    (PROFILE + ["--context", "512", "--kv", "10"], "--kv cannot be combined with --context"),
    (PROFILE + ["--context", "512", "--stream", "500"], "--context cannot be combined with --stream"),
    (PROFILE + ["--context", "0"], "--context values must be in [1, 131072]"),
    (PROFILE + ["--context", "200000"], "--context values must be in [1, 131072]"),
    (PROFILE + ["--context", "8,8"], "at most 8 distinct"),
    (PROFILE + ["--context", "1,2,3,4,5,6,7,8,9"], "at most 8 distinct"),
    (PROFILE + ["--context", "4k"], "comma-separated integers"),
    # build-tree
    (TREE + ["--install", "--no-install"], "not both"),
    (FROM + ["--width", "3"], "--width calibrates a new tree"),
    (FROM + ["--per-category", "2", "--seed", "1"], "--per-category, --seed calibrate"),
    (FROM + ["--max-new-tokens", "16"], "--max-new-tokens"),
    # collect-trajectories
    (COLLECT + ["--augment-prob", "0.3"], "--augment-prob applies with --augment only"),
    # train msn: flags about the run, not the data
    (MSN + ["--no-noise", "--noise-length", "8"], "cannot be combined with --no-noise"),
    (MSN + ["--no-noise", "--noise-location", "ppl"], "cannot be combined with --no-noise"),
    (MSN + ["--noise-length", "600"], "leaves no room in --max-length"),
    (MSN + ["--full", "--lora-alpha", "4"], "--lora-alpha applies to LoRA training"),
    (MSN + ["--lora", "0"], "--lora"),
    (MSN + ["--lr", "-1"], "--lr"),
    (MSN + ["--epochs", "0"], "--epochs"),
    (MSN + ["--max-steps", "abc"], "--max-steps"),
    (MSN + ["--save-every", "0"], "--save-every"),
    (MSN + ["--out", "{dir}/q.jsonl"], "not a folder"),
    # train cllm: the trajectories read and checked before the model loads
    (CLLM + ["{dir}/empty.jsonl"], "holds no trajectory records"),
    (CLLM + ["{dir}/binary.jsonl"], "not UTF-8"),
    (CLLM + ["{dir}/traj-wrong"], "not a trajectory record"),
    (CLLM + ["{dir}/traj-shape"], "not a trajectory record"),
]


@pytest.mark.parametrize("argv, match", CASES, ids=[" ".join(a[:2] + a[-2:]) for a, _ in CASES])
def test_tool_bad_input_is_one_line_exit_2_before_any_work(files, no_load, capsys, argv, match):
    line = one_line_exit_2(capsys, fill(files, argv))
    assert match in line, line
    assert not Path(fill(files, [OUT])[0]).exists()


def test_tool_cases_cover_every_command():
    assert len(CASES) >= 40
    assert {a[0] for a, _ in CASES} >= {"eval", "profile", "build-tree", "collect-trajectories", "train"}


def test_profile_llama_cpp_without_the_package_fails_before_work(files, tmp_path, monkeypatch, no_load, capsys):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    line = one_line_exit_2(capsys, ["profile", "--model", str(gguf), "--llama-cpp"])
    assert "llama-cpp-python" in line, line


def test_eval_tasks_still_take_their_own_defaults(files, tmp_path, monkeypatch, capsys):
    """The options left out take the documented defaults (they are only None until the task is known)."""
    seen = {}

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ff, "load", stop)
    from fastforward.cli import eval as cli_eval

    real = cli_eval._check_nll

    def spy(args):
        held = real(args)
        seen.update(heldout=args.heldout, max_length=args.max_length, noise_length=args.noise_length)
        return held

    monkeypatch.setattr(cli_eval, "_check_nll", spy)
    data = tmp_path / "many.json"  # enough records for the default held-out fraction to hold some
    data.write_text(json.dumps([{"instruction": f"Add {i} and 1.", "output": f"{i + 1}"} for i in range(200)]))
    code, _, err = run_cli(capsys, *fill(files, NLL[:-1]), data)
    assert code == 130, err
    assert seen == cli_eval.NLL_DEFAULTS
