"""scripts/drafting_phases.py: a drafting step's time split into the drafter's calls, on a tiny model and drafter."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import fastforward as ff
from fastforward.drafters.checkpoint import save_eagle3
from fastforward.drafters.eagle import Eagle3Drafter
from fastforward.drafters.vocab import DraftVocab
from fastforward.kernels import load_native
from fastforward.testing import tiny_hf_folder

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "drafting_phases.py"


def _script():
    spec = importlib.util.spec_from_file_location("drafting_phases", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("phases")
    model = tiny_hf_folder(root / "model", layers=4)
    target = ff.load(str(model))
    vocab = DraftVocab.from_target_ids(torch.arange(64), target.vocab_size)
    drafter = Eagle3Drafter.for_target(target, vocab, seed=1)
    save_eagle3(drafter, root / "drafter", dtype="float32")
    questions = root / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                                 enumerate([("qa", "what is a cat"), ("qa", "hello there"), ("math", "one two")])))
    return model, root / "drafter", questions


def test_phases_of_a_drafter_and_of_ar(setup, capsys):
    model, drafter, questions = setup
    rc = _script().main(["--questions", str(questions), "--model", str(model), "--max-new-tokens", "12",
                         "--threads", "1", "--cpu-time",
                         "--methods", f"ar,tree=eagle:drafter={drafter}:nodes=4:min_prob=0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "2 questions, 12 new tokens, 1 threads, CPU ms" in out  # one per category
    ar, tree = out.split("\ntree: ")
    assert "\nar: " in ar and "\n  commit" not in ar and "of ar's forward per step" in tree
    for phase in ("commit", "layer", "other"):  # a fixed tree of 4: every step drafts
        assert f"\n  {phase}" in tree
    # the head and its top-k are phases of their own unless the native calls run them inside commit and layer
    assert ("\n  head" in tree) == ("\n  top-k" in tree) == (load_native() is None)
    assert "start " in tree and "propose " in tree and "observe " in tree


def test_categories_and_bad_numbers(setup, capsys):
    model, _, questions = setup
    assert _script().main(["--questions", str(questions), "--model", str(model), "--max-new-tokens", "4",
                           "--categories", "math", "--methods", "ar", "--threads", "1"]) == 0
    assert "1 questions" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _script().main(["--questions", str(questions), "--model", str(model), "--max-new-tokens", "0"])

