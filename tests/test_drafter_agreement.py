"""``fastforward eval --task agreement``: a drafter's held-out agreement with its target by depth, for every kind of
drafter, from the trainers' own scoring; and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

import fastforward as ff
from fastforward.drafters.checkpoint import save_eagle3
from fastforward.drafters.draft_model import init_draft_model, save_draft_model, target_probe
from fastforward.drafters.eagle import Eagle3Drafter
from fastforward.drafters.falcon import FalconDrafter, save_falcon
from fastforward.drafters.fasteagle import FastEagleDrafter, save_fasteagle
from fastforward.drafters.vocab import DraftVocab
from fastforward.testing import tiny_hf_folder, tiny_target
from fastforward.train.agreement import drafter_agreement

VOCAB = 96


def _greedy_records(target, folder, n: int = 6):
    """A make-data folder whose held-out records are the target's own greedy responses (every 3rd one in train)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    with open(folder / "responses.jsonl", "w") as f:
        for i in range(n):
            prompt = torch.randint(0, VOCAB, (5 + i,), generator=gen).tolist()
            response = ff.generate(target, prompt, "ar", max_new_tokens=12, chat=False).token_ids
            f.write(json.dumps({"key": f"k{i}", "source": "hand", "split": "train" if i % 3 == 2 else "heldout",
                                "prompt": "", "prompt_ids": prompt, "response_ids": response,
                                "finish_reason": "length"}) + "\n")
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    return _greedy_records(target, tmp_path_factory.mktemp("agreement") / "data")


def test_a_draft_model_of_all_the_targets_layers_always_agrees(target, data, tmp_path):
    whole, meta = init_draft_model(target, 4, "first")
    save_draft_model(whole, meta, tmp_path / "whole", target_probe(target))
    half, meta = init_draft_model(target, 2, "first")
    save_draft_model(half, meta, tmp_path / "half", target_probe(target))
    got = drafter_agreement(tmp_path / "whole", target, data)
    assert got["kind"] == "draft-model" and got["records"] == 4 and got["positions"] == 4 * 12
    assert got["top1"] == [1.0]
    assert drafter_agreement(tmp_path / "half", target, data)["top1"][0] < 1.0


@pytest.mark.parametrize("kind", ["eagle", "fasteagle", "falcon"])
def test_every_feature_drafter_kind_is_scored_by_depth(target, data, tmp_path, kind):
    vocab = DraftVocab.from_target_ids(range(0, VOCAB, 2), VOCAB)
    folder = tmp_path / kind
    if kind == "eagle":
        save_eagle3(Eagle3Drafter.for_target(target, vocab), folder, dtype="float32")
    elif kind == "fasteagle":
        save_fasteagle(FastEagleDrafter.for_target(target, vocab, 3), folder, dtype="float32")
    else:
        save_falcon(FalconDrafter.for_target(target, vocab, 2), folder, dtype="float32")
    got = drafter_agreement(folder, target, data, limit=3)
    assert got["kind"] == kind and got["records"] == 3 and got["positions"] > 0
    assert len(got["top1"]) == len(got["chain"]) >= 2
    assert all(0.0 <= v <= 1.0 for v in got["top1"] + got["chain"])
    assert all(a >= b for a, b in zip(got["chain"], got["chain"][1:], strict=False))  # a chain only thins out


def test_the_command_prints_the_depths_and_refuses_bad_input(tmp_path, capsys):
    model = tiny_hf_folder(tmp_path / "model", max_positions=128, layers=4)
    tiny = ff.load(str(model))
    data = _greedy_records(tiny, tmp_path / "data")
    folder = tmp_path / "eagle"
    save_eagle3(Eagle3Drafter.for_target(tiny, DraftVocab.from_target_ids(range(64), tiny.vocab_size)), folder,
                dtype="float32")
    code, out, err = run_cli(capsys, "eval", "--task", "agreement", "--model", model, "--drafter", folder, "--data",
                             data, "--threads", 1, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["kind"] == "eagle" and len(summary["top1"]) == 3 and summary["records"] == 4
    # the draft vocabulary holds ids 0..63: its coverage is the share of held-out response tokens below 64
    held = [r for r in map(json.loads, (data / "responses.jsonl").read_text().splitlines()) if r["split"] != "train"]
    tokens = [t for r in held for t in r["response_ids"]]
    assert summary["vocab_coverage"] == round(sum(t < 64 for t in tokens) / len(tokens), 4)
    assert max(summary["top1"]) <= summary["vocab_coverage"]
    code, out, err = run_cli(capsys, "eval", "--task", "agreement", "--model", model, "--drafter", folder, "--data",
                             data, "--threads", 1)
    assert code == 0 and "held-out top-1 agreement by depth" in out and "in the draft vocabulary" in out, err
    (tmp_path / "train-only").mkdir()
    (tmp_path / "train-only" / "responses.jsonl").write_text(
        (data / "responses.jsonl").read_text().splitlines()[2] + "\n")  # one train-split record
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    base = ["eval", "--task", "agreement", "--model", model]
    for argv, match in [
        (base + ["--data", data], "needs --drafter"),
        (base + ["--drafter", folder], "needs --drafter"),
        (base + ["--drafter", tmp_path / "nope", "--data", data], "no config.json"),
        (base + ["--drafter", tmp_path / "other", "--data", data], "not a drafter"),
        (base + ["--drafter", folder, "--data", tmp_path], "no responses.jsonl"),
        (base + ["--drafter", folder, "--data", tmp_path / "train-only"], "no held-out records"),
        (base + ["--drafter", folder, "--data", data, "--max-new-tokens", 8], "--max-new-tokens applies"),
        (["eval", "--task", "gsm8k", "--model", model, "--drafter", folder], "--drafter applies to --task agreement"),
    ]:
        line = assert_one_line_error(capsys, *argv)
        assert match in line, (argv, line)
