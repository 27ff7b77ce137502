"""Bad input to the training-data commands (``train``, ``make-data``) and to method options (``bench --methods``,
``generate -o draft=``): one line on stderr, exit code 2, before any training step or question; nothing overwritten
that the command did not write.

Everything runs in-process on tiny random models built here; nothing loads the default model."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_one_line_error

import fastforward as ff
from fastforward.errors import UsageError
from fastforward.testing import tiny_hf_folder, write_tiny_make_data
from fastforward.train.make_data import is_heldout_file, read_training_records

VOCAB = 260  # tiny_hf_folder's vocabulary
DRAFTER_TRAINERS = ["eagle", "falcon", "fasteagle", "draft-model"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("model") / "tiny", max_positions=128, layers=4)


def make_data_with(folder, line: int = 2, **fields):
    """A tiny ``make-data`` folder whose record on ``line`` has ``fields`` replaced."""
    write_tiny_make_data(folder, records=6)
    path = folder / "responses.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    records[line - 1].update(fields)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def train_drafter_argv(method, model, data, out):
    return ["train", method, "--model", model, "--data", data, "--out", out, "--max-steps", 1, "--batch-size", 1,
            "--grad-accum", 1, "--threads", 1, "--quiet"]


def write_lines(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --------------------------------------------------------------------------------------------------------------
# Findings 1 and 2: every drafter trainer checks make-data records the same way, before training
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", DRAFTER_TRAINERS)
def test_drafter_trainers_refuse_prompt_ids_that_are_not_token_lists(method, model, tmp_path, capsys):
    data = make_data_with(tmp_path / "data", prompt_ids="abc")
    out = tmp_path / "out"
    line = assert_one_line_error(capsys, *train_drafter_argv(method, model, data, out))
    assert "responses.jsonl line 2: prompt_ids must be a non-empty list of token ids" in line
    assert not out.exists()  # refused before any training step


@pytest.mark.parametrize("method", DRAFTER_TRAINERS)
def test_drafter_trainers_refuse_token_ids_outside_the_vocabulary(method, model, tmp_path, capsys):
    data = make_data_with(tmp_path / "data", line=3, response_ids=[5, 99999999])
    out = tmp_path / "out"
    line = assert_one_line_error(capsys, *train_drafter_argv(method, model, data, out))
    assert "responses.jsonl line 3: response_ids has token id 99999999 outside the target's vocabulary of 260" in line
    assert not out.exists()


@pytest.mark.parametrize("fields, match", [
    ({"prompt_ids": []}, "prompt_ids must be a non-empty list"),
    ({"prompt_ids": None}, "prompt_ids must be a non-empty list"),
    ({"response_ids": [1, 2.5]}, "response_ids must hold integer token ids, not 2.5"),
    ({"response_ids": [1, True]}, "response_ids must hold integer token ids, not true"),
    ({"response_ids": [-1]}, "token id -1 outside"),
    ({"response_ids": "12"}, "response_ids must be a non-empty list"),
    ({"key": "../../escape"}, "'key' must be a name"),
    ({"key": 7}, "'key' must be a name"),
])
def test_read_training_records_checks_every_field(tmp_path, fields, match):
    data = make_data_with(tmp_path / "data", **fields)
    with pytest.raises(UsageError, match=match) as err:
        read_training_records(data, VOCAB)
    assert "responses.jsonl line 2" in str(err.value) and "\n" not in str(err.value)


def test_read_training_records_accepts_a_good_folder(tmp_path):
    data = write_tiny_make_data(tmp_path / "data", records=4)
    assert len(read_training_records(data, VOCAB)) == 4


# --------------------------------------------------------------------------------------------------------------
# Findings 3 and 4: instruction/response files (train msn and every text-data method)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("record, field", [
    ({"prompt": 5, "response": "fine"}, "prompt"),
    ({"prompt": "hi", "response": None}, "response"),
    ({"instruction": "Add.", "output": None}, "output"),
    ({"instruction": "Add.", "input": 3, "output": "4"}, "input"),
    ({"question": ["a"], "answer": "#### 1"}, "question"),
])
def test_train_msn_refuses_fields_that_are_not_text(model, tmp_path, capsys, record, field):
    data = write_lines(tmp_path / "f.jsonl", json.dumps({"prompt": "ok", "response": "fine"}), json.dumps(record))
    out = tmp_path / "out"
    line = assert_one_line_error(capsys, "train", "msn", "--model", model, "--data", data, "--out", out,
                                 "--max-steps", 1, "--quiet")
    assert f"f.jsonl line 2: field '{field}' must be a string" in line
    assert not out.exists()


def test_a_json_array_record_is_named_by_its_position(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"instruction": "x", "output": "y"}, {"instruction": "x",
                                                                                        "output": 1}]))
    with pytest.raises(UsageError, match=r"a\.json record 2: field 'output' must be a string, got the number 1"):
        ff.train.data.read_examples(str(tmp_path / "a.json"))


def test_a_line_that_is_not_json_is_named_by_its_file_line(model, tmp_path, capsys):
    data = write_lines(tmp_path / "badline3.jsonl", json.dumps({"prompt": "a", "response": "b"}), "",
                       '{"prompt": "c", "response": ', json.dumps({"prompt": "d", "response": "e"}))
    line = assert_one_line_error(capsys, "train", "msn", "--model", model, "--data", data, "--out", tmp_path / "o",
                                 "--max-steps", 1, "--quiet")
    assert "badline3.jsonl line 3: not valid JSON (" in line


def test_make_data_refuses_prompts_that_are_not_text(tmp_path, capsys):
    prompts = write_lines(tmp_path / "prompts.jsonl", json.dumps({"prompt": "ok"}), json.dumps({"prompt": None}))
    line = assert_one_line_error(capsys, "make-data", "--data", prompts, "--write-heldout", tmp_path / "h.jsonl")
    assert "prompts.jsonl line 2: field 'prompt' must be a string, got null" in line


# --------------------------------------------------------------------------------------------------------------
# Finding 5: make-data --write-heldout never overwrites a file it did not write
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def prompts(tmp_path):
    return write_lines(tmp_path / "prompts.jsonl", *(json.dumps({"prompt": f"Say {i}."}) for i in range(20)))


def test_write_heldout_refuses_a_users_file(prompts, tmp_path, capsys):
    mine = tmp_path / "existing_file.jsonl"
    mine.write_text('{"my": "notes"}\n')
    line = assert_one_line_error(capsys, "make-data", "--data", prompts, "--write-heldout", mine, "--heldout", 0.5)
    assert "--write-heldout" in line and "was not written by fastforward" in line
    assert mine.read_text() == '{"my": "notes"}\n'


def test_write_heldout_rewrites_its_own_file(prompts, tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    for fraction in (0.5, 0.8):  # the second run replaces the file the first one wrote
        code = ff.cli.main(["make-data", "--data", str(prompts), "--write-heldout", str(held), "--heldout",
                            str(fraction)])
        assert code == 0, capsys.readouterr().err
        assert is_heldout_file(held)
    rows = [json.loads(x) for x in held.read_text().splitlines()]
    assert rows and all(set(r) == {"id", "category", "prompt"} for r in rows)


def test_write_heldout_checks_the_fraction_before_writing(prompts, tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    assert_one_line_error(capsys, "make-data", "--data", prompts, "--write-heldout", held, "--heldout", 5,
                          match="--heldout must be in [0, 1)")
    assert not held.exists()


# --------------------------------------------------------------------------------------------------------------
# Finding 6: bench checks every method spec's options before any question runs
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, match", [
    ("eagle:drafter=/nonexistent", "drafter folder not found: /nonexistent"),
    ("fasteagle:topk=0", "option topk must be an integer"),
    ("pld:max_ngram=abc", "option max_ngram must be an integer"),
])
def test_bench_checks_method_options_before_any_question(model, tmp_path, capsys, monkeypatch, spec, match):
    import fastforward.cli.bench as bench_cli

    def no_run(*a, **k):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(bench_cli, "run_bench", no_run)
    questions = write_lines(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "c", "turns": ["hi"]}))
    out = tmp_path / "out"
    line = assert_one_line_error(capsys, "bench", "--questions", questions, "--model", model, "--methods",
                                 f"ar,{spec}", "--max-new-tokens", 4, "--out", out, "--no-progress", "--threads", 1)
    assert f"--methods {spec.split(':')[0]}: " in line and match in line
    assert not out.exists()


# --------------------------------------------------------------------------------------------------------------
# Finding 7: a broken draft model is named as the draft, not as the target
# --------------------------------------------------------------------------------------------------------------


def test_a_corrupt_draft_model_is_blamed_not_the_target(model, tmp_path, capsys):
    broken = tiny_hf_folder(tmp_path / "broken_ckpt", max_positions=128, seed=1)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = assert_one_line_error(capsys, "generate", "--model", model, "--method", "sps", "-o", f"draft={broken}",
                                 "--max-new-tokens", 4, "hi")
    assert f"cannot load the draft model '{broken}'" in line and "truncated, corrupt" in line
    assert f"cannot load the model '{model}'" not in line
