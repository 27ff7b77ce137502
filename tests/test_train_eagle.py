"""``fastforward train eagle``: a training smoke run through the CLI (the serving layout written, the drafter decodes
for its target and output equals AR, the same command resumes, other settings refused, the time budget), and the
same command data-parallel under ``ACCELERATE_USE_CPU=1 torchrun`` with 2 processes."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli

import fastforward as ff
from fastforward.testing import tiny_hf_folder

REPO = Path(__file__).resolve().parents[1]


def _responses(path: Path, vocab: int, n: int = 12, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "responses.jsonl", "w") as f:
        for i in range(n):
            prompt = [rng.randrange(vocab - 4) for _ in range(rng.randrange(3, 10))]
            response = [rng.randrange(vocab - 4) for _ in range(rng.randrange(6, 16))]
            f.write(json.dumps({"key": f"k{i}", "source": "hand", "split": "heldout" if i % 5 == 0 else "train",
                                "prompt": "", "prompt_ids": prompt, "response_ids": response,
                                "finish_reason": "length"}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-eagle")
    model = tiny_hf_folder(root / "model", max_positions=128, layers=4)
    return model, _responses(root / "data", 256)


def test_train_eagle_smoke(setup, tmp_path, capsys):
    model, data = setup
    out = tmp_path / "out"
    common = ["train", "eagle", "--model", model, "--data", data, "--out", out, "--draft-vocab", 40, "--ttt-steps", 2,
              "--batch-size", 2, "--grad-accum", 1, "--save-every", 2, "--threads", 1, "--quiet"]
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 3)
    assert code == 0, err
    assert "step 3/3" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    assert {"acc0", "acc1"} <= set(log[0])
    assert (out / "checkpoints" / "step-000003" / "trainer_state.json").is_file()
    # scored on the held-out records: per-step top-1 and the chain rates (never above the steps' own)
    held = json.loads((out / "fastforward_train.json").read_text())["heldout"]
    assert held["positions"] > 0 and len(held["top1"]) == len(held["chain"]) == 2
    assert held["chain"][0] == held["top1"][0] and held["chain"][1] <= min(held["top1"])
    # the features were computed on first use and stored with the data
    assert len(list((data / "features").glob("*.safetensors"))) >= 6  # 3 steps x 2 sequences
    # the result drafts for its target, losslessly
    target = ff.load(str(model))
    prompt = [5, 6, 7, 8]
    got = ff.generate(target, prompt, "eagle", max_new_tokens=12, method_options={"drafter": str(out)})
    assert got.token_ids == ff.generate(target, prompt, "ar", max_new_tokens=12).token_ids
    # the same command with more steps resumes from the checkpoint
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 5)
    assert code == 0, err
    assert "step 5/5" in stdout
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    line = assert_one_line_error(capsys, *common, "--max-steps", 5, "--lr", 1e-3)
    assert "different settings" in line
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 9, "--max-minutes", 1e-6)
    assert code == 0, err
    assert "step 6/9" in stdout and "budget" in stdout


def test_train_eagle_bad_input(setup, tmp_path, capsys):
    model, data = setup
    line = assert_one_line_error(capsys, "train", "eagle", "--model", model, "--data", tmp_path / "nope", "--out",
                                 tmp_path / "o")
    assert "make-data" in line
    line = assert_one_line_error(capsys, "train", "eagle", "--model", model, "--data", data, "--out", tmp_path / "o",
                                 "--draft-vocab", 0)
    assert "--draft-vocab" in line


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed")
def test_train_eagle_data_parallel_under_torchrun(setup, tmp_path):
    model, data = setup
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="1")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "fastforward.cli", "train",
                           "eagle", "--model", str(model), "--data", str(data), "--out", str(out),
                           "--draft-vocab", "40", "--ttt-steps", "2", "--batch-size", "1", "--grad-accum", "1",
                           "--max-steps", "2", "--quiet"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon"])
def test_drafters_train_under_bf16_autocast(setup, tmp_path, capsys, method):
    """``--mixed-precision bf16``: the same loop under bf16 autocast (fp32 weights): finite losses, a drafter saved
    that decodes losslessly; an unknown precision is refused in one line."""
    model, data = setup
    out = tmp_path / method
    code, stdout, err = run_cli(capsys, "train", method, "--model", model, "--data", data, "--out", out,
                                "--draft-vocab", 40, "--batch-size", 2, "--grad-accum", 1, "--threads", 1, "--quiet",
                                "--max-steps", 2, "--mixed-precision", "bf16")
    assert code == 0, err
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["config"]["mixed_precision"] == "bf16"
    line = assert_one_line_error(capsys, "train", method, "--model", model, "--data", data, "--out", tmp_path / "x",
                                 "--mixed-precision", "fp8")
    assert "--mixed-precision" in line
    target = ff.load(str(model))
    got = ff.generate(target, [5, 6, 7, 8], method, max_new_tokens=10, method_options={"drafter": str(out)})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=10).token_ids
    # the draft ids ranked by their frequency in the training responses, beside the drafter (its head_vocab option)
    ranked = json.loads((out / "draft_vocab_frequency.json").read_text())
    assert sorted(ranked["order"]) == list(range(40)) and ranked["tokens_counted"] > 0
    got = ff.generate(target, [5, 6, 7, 8], method, max_new_tokens=10,
                      method_options={"drafter": str(out), "head_vocab": 8})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=10).token_ids
    assert got.stats.method_stats["head_rows"] == 8


def test_sigterm_stops_training_with_a_checkpoint(setup, tmp_path):
    """``kill`` (SIGTERM, as a batch scheduler sends before its deadline) stops training the way Ctrl-C does: a
    checkpoint at the step reached, exit code 143, one line saying how to resume; the same command then resumes."""
    import signal
    import time

    model, data = setup
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fastforward.cli", "train", "eagle", "--model", str(model), "--data", str(data),
           "--out", str(out), "--draft-vocab", "40", "--ttt-steps", "2", "--batch-size", "2", "--grad-accum", "1",
           "--threads", "1", "--save-every", "100000", "--max-steps", "100000", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "train_log.jsonl"
    deadline = time.time() + 120
    while (not log.exists() or len(log.read_text().splitlines()) < 3) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    # (a first run in a fresh cache also says it compiles the kernels)
    lines = [line for line in err.splitlines() if line.strip() and "compiling the native kernels" not in line]
    assert len(lines) == 1 and "terminated" in lines[0] and "re-run the same command" in lines[0], err
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    ckpt = sorted((out / "checkpoints").glob("step-*"))
    assert len(ckpt) == 1 and ckpt[0].name == f"step-{steps[-1]:06d}"  # nothing trained is lost
    done = subprocess.run(cmd[:-5] + ["--max-steps", str(steps[-1] + 1), "--quiet"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, steps[-1] + 2))


@pytest.mark.parametrize("kind", ["eagle", "fasteagle", "falcon"])
def test_the_final_scoring_reads_the_training_store_not_the_target(setup, tmp_path, capsys, monkeypatch, kind):
    """The held-out records' features were computed (and stored) when training first read them; the scoring at the
    end reads them there instead of running the target over every held-out record again."""
    import fastforward.drafters.features as features

    model, data = setup
    data_copy = tmp_path / "data"
    data_copy.mkdir()
    (data_copy / "responses.jsonl").write_text((data / "responses.jsonl").read_text())
    args = ["train", kind, "--model", model, "--data", data_copy, "--batch-size", 2, "--threads", 1, "--quiet",
            "--max-steps", 1, "--draft-vocab", 40]
    args += ["--ttt-steps", 2] if kind == "eagle" else ["--layers", 2] if kind == "fasteagle" else []
    code, _, err = run_cli(capsys, *args, "--out", tmp_path / "first")
    assert code == 0, err  # the first run stored the features it read: its batch's and the held-out records'
    stored = {p.name for p in (data_copy / "features").iterdir()}
    assert {"k0.safetensors", "k5.safetensors", "k10.safetensors"} <= stored

    def no_target(*a, **k):
        raise AssertionError("features computed again")

    monkeypatch.setattr(features, "compute_features", no_target)
    code, stdout, err = run_cli(capsys, *args, "--out", tmp_path / "second")
    assert code == 0, err
    summary = json.loads((tmp_path / "second" / "fastforward_train.json").read_text())
    assert summary["heldout"]["positions"] > 0
