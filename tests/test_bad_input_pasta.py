"""Bad input to the PASTA commands (``pasta annotate/sample/evaluate/export``, ``train pasta-sft/pasta-bon``) and
``generate --method pasta``: one line on stderr, exit code 2, before any work (no model loads where the check needs
none); nothing the command did not write is changed. Everything runs on tiny models or none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

import fastforward as ff
import fastforward.model
from fastforward.errors import UsageError
from fastforward.jsonl import jsonl_records
from fastforward.model import DEFAULT_PASTA_MODEL, TargetModel
from fastforward.pasta.language import PASTA_TOKENS, add_pasta_tokens
from fastforward.paths import RUN_MARKER
from fastforward.testing import tiny_hf_folder, tiny_llama_hf, tiny_tokenizer_hf
from fastforward.train.pasta.bon import baseline_text, sample_record
from fastforward.train.pasta.judge import OpenAIJudge

NOT_UTF8 = b'{"prompt_ids": [1], "response_ids": [2]}\n\xff\xfe{"x": 1}\n'


class ModelLoadReached(UsageError):
    """Raised instead of loading a model: every check before the load passed."""


# --------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------------


def make_data_record(i: int, **fields) -> dict:
    return {"key": f"k{i}", "split": "train", "prompt": f"Question {i}?", "prompt_ids": [72, 105, 10 + i],
            "response_ids": [65, 66, 67, 258], **fields}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pasta-inputs")
    tiny = tiny_hf_folder(root / "tiny", max_positions=128)
    make_data = root / "make-data"  # a make-data folder: records with ids, no response text
    make_data.mkdir()
    write_jsonl(make_data / "responses.jsonl", [make_data_record(i) for i in range(3)])
    (root / "not-utf8.jsonl").write_bytes(NOT_UTF8)
    (root / "not-json.jsonl").write_text("not json at all\n")
    (root / "empty.jsonl").write_text("")
    write_jsonl(root / "string-ids.jsonl", [make_data_record(0), make_data_record(1, prompt_ids="abc")])
    write_jsonl(root / "prompts.jsonl", [{"prompt": "Say hi."}, {"prompt": "Question 0?"}])
    write_jsonl(root / "empty-turns.jsonl", [{"turns": []}])
    notes = root / "notes.json"  # somebody's file
    notes.write_text('{"mine": true}\n')
    return {"root": root, "tiny": str(tiny), "make_data": make_data, "notes": notes}


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model raises :class:`ModelLoadReached`: a case that must fail earlier fails the test."""

    def load(name, *a, **k):
        raise ModelLoadReached(f"model load reached ({name})")

    monkeypatch.setattr(ff, "load", load)
    monkeypatch.setattr(fastforward.model, "load", load)


def one_line_exit_2(capsys, *argv, match: str) -> str:
    code, out, err = run_cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err + out and "internal error" not in err
    assert "model load reached" not in lines[0], lines[0]
    assert match in lines[0], lines[0]
    return lines[0]


def reaches_model_load(capsys, *argv) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and "model load reached" in err, (code, out, err)


def sample_args(src, out, *extra):
    return ["pasta", "sample", src, out, "--model", "no-such-model", "--judge-model", "no-such-model", *extra]


def evaluate_args(prompts, *extra):
    return ["pasta", "evaluate", "--baseline", "no-such-model", "--models", "a=no-such-model", "--prompts", prompts,
            "--judge-model", "no-such-model", *extra]


# --------------------------------------------------------------------------------------------------------------
# 1. The one JSONL reader: not UTF-8, not JSON, torn last lines, the file's line numbers
# --------------------------------------------------------------------------------------------------------------


def test_jsonl_records_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(NOT_UTF8)
    with pytest.raises(UsageError, match=r"x.jsonl:2 is not UTF-8"):
        jsonl_records(path)


@pytest.mark.parametrize("text", ["not json at all\n", "not json at all", "\n\nnot json at all"])
def test_jsonl_records_a_lone_bad_line_is_not_a_torn_line(tmp_path, text):
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=r"x.jsonl:\d is not a JSON record"):
        jsonl_records(path)


def test_jsonl_records_line_numbers_are_the_files(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n\n[1, 2]\n')
    with pytest.raises(UsageError, match=r"x.jsonl:4 is not a JSON object"):
        jsonl_records(path)
    path.write_text('{"a": 1}\n\n{"b": 2}\n')
    assert jsonl_records(path) == [(1, {"a": 1}), (3, {"b": 2})]


def test_jsonl_records_forgives_and_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "caf\xc3')  # killed mid-line, even mid-character
    assert jsonl_records(path) == [(1, {"a": 1})]
    assert jsonl_records(path, repair=True) == [(1, {"a": 1})]
    assert path.read_bytes() == b'{"a": 1}\n'
    path.write_text('{"a": 1}\nnot json\n{"c": 3}\n')  # a bad line in the middle is never forgiven
    with pytest.raises(UsageError, match=r"x.jsonl:2"):
        jsonl_records(path)


def test_jsonl_records_keeps_unicode_line_separators_inside_records(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"t": "a\u2028b\x1cc"}, ensure_ascii=False) + "\n")
    assert jsonl_records(path) == [(1, {"t": "a\u2028b\x1cc"})]


@pytest.mark.parametrize("method", ["pasta-sft", "pasta-bon"])
@pytest.mark.parametrize("data, match", [("not-utf8.jsonl", ":2 is not UTF-8"),
                                         ("not-json.jsonl", ":1 is not a JSON record")])
def test_train_pasta_bad_records(inputs, capsys, method, data, match):
    root = inputs["root"]
    extra = ["--lam", 1] if method == "pasta-bon" else []
    one_line_exit_2(capsys, "train", method, "--model", inputs["tiny"], "--data", root / data, "--out",
                    root / f"never-{method}", "--lora", 2, "--max-steps", 1, "--quiet", *extra, match=match)
    assert not (root / f"never-{method}").exists() or not any((root / f"never-{method}").iterdir())


@pytest.mark.parametrize("command", ["annotate", "sample", "evaluate-exclude"])
@pytest.mark.parametrize("data, match", [("not-utf8.jsonl", ":2 is not UTF-8"),
                                         ("not-json.jsonl", ":1 is not a JSON record")])
def test_pasta_commands_bad_records(inputs, capsys, no_load, command, data, match):
    root = inputs["root"]
    bad = root / data
    argv = {"annotate": ["pasta", "annotate", bad, root / "never.jsonl", "--model", inputs["tiny"]],
            "sample": sample_args(bad, root / "never.jsonl"),
            "evaluate-exclude": evaluate_args(root / "prompts.jsonl", "--exclude", bad)}[command]
    one_line_exit_2(capsys, *argv, match=match)


# --------------------------------------------------------------------------------------------------------------
# 2. pasta evaluate: prompts, reference answers, --exclude, --models, --out
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompts, match", [("not-json.jsonl", "not valid JSON"),
                                            ("not-utf8.jsonl", "codec can't decode"),
                                            ("empty-turns.jsonl", "'turns' must be a non-empty list"),
                                            ("empty.jsonl", "holds no prompts"),
                                            ("missing.jsonl", "no prompt file")])
def test_evaluate_bad_prompts(inputs, capsys, no_load, prompts, match):
    one_line_exit_2(capsys, *evaluate_args(inputs["root"] / prompts), match=match)


@pytest.mark.parametrize("reference", ["not json\n", '{"question_id": 1}\n', '{"question_id": 1, "choices": []}\n'])
def test_evaluate_bad_reference_answers_beside_the_prompts(tmp_path, capsys, no_load, reference):
    write_jsonl(tmp_path / "question.jsonl", [{"question_id": 1, "turns": ["Add 2 and 2."]}])
    (tmp_path / "reference_answer_gpt-4.jsonl").write_text(reference)
    one_line_exit_2(capsys, *evaluate_args(tmp_path / "question.jsonl"), match="reference_answer_gpt-4.jsonl")


def test_evaluate_reads_mt_bench_references(tmp_path):
    from fastforward.train.pasta.evaluation import read_prompts

    write_jsonl(tmp_path / "question.jsonl", [{"question_id": 7, "turns": ["Add 2 and 2.", "And 3?"]}])
    write_jsonl(tmp_path / "reference_answer_gpt-4.jsonl", [{"question_id": 7, "choices": [{"turns": ["4"]}]}])
    assert read_prompts(str(tmp_path / "question.jsonl")) == [
        {"id": f"{tmp_path.name}/question:7", "prompt": "Add 2 and 2.", "reference": "4"}]


def test_evaluate_exclude_must_be_training_records(inputs, capsys, no_load):
    root = inputs["root"]
    one_line_exit_2(capsys, *evaluate_args(root / "prompts.jsonl", "--exclude", root / "empty-turns.jsonl"),
                    match="has no prompt")
    one_line_exit_2(capsys, *evaluate_args(root / "prompts.jsonl", "--exclude", root / "empty.jsonl"),
                    match="holds no records")
    everything = write_jsonl(root / "all-prompts.jsonl", [{"prompt": "Say hi."}, {"prompt": "Question 0?"}])
    one_line_exit_2(capsys, *evaluate_args(root / "prompts.jsonl", "--exclude", everything),
                    match="no prompts left")
    reaches_model_load(capsys, *evaluate_args(root / "prompts.jsonl", "--exclude", inputs["make_data"] /
                                              "responses.jsonl"))


def test_evaluate_model_names_once(inputs, capsys, no_load):
    argv = evaluate_args(inputs["root"] / "prompts.jsonl")
    argv[argv.index("--models") + 1] = "a=x,a=y"
    one_line_exit_2(capsys, *argv, match="names 'a' twice")


def test_evaluate_out_is_checked_first(inputs, capsys, no_load, tmp_path):
    prompts = inputs["root"] / "prompts.jsonl"
    one_line_exit_2(capsys, *evaluate_args(prompts, "--out", tmp_path), match="is a folder")
    notes = inputs["notes"]
    before = notes.read_bytes()
    one_line_exit_2(capsys, *evaluate_args(prompts, "--out", notes), match="not written by fastforward")
    assert notes.read_bytes() == before
    previous = tmp_path / "eval.json"
    previous.write_text(json.dumps({"models": {}, "baseline": []}))
    reaches_model_load(capsys, *evaluate_args(prompts, "--out", previous))


# --------------------------------------------------------------------------------------------------------------
# 3. pasta sample: the baseline text, the output path, a make-data folder, the judge URL
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pasta_target():
    tokenizer = tiny_tokenizer_hf()
    add_pasta_tokens(tokenizer)
    hf = tiny_llama_hf(vocab_size=320, seed=1, dtype=torch.float32)
    return TargetModel("tiny-pasta", hf, tokenizer, backend="lean")


class RecordingJudge:
    def __init__(self):
        self.baselines = []

    def compare(self, prompt, a_text, b_text, baseline_text=None, reference_text=None):
        self.baselines.append(b_text)
        return 0.5


def test_sample_decodes_the_baseline_of_a_make_data_record(pasta_target):
    record = make_data_record(0)  # ids only, no "response" text
    want = pasta_target.tokenizer.decode(record["response_ids"], skip_special_tokens=True)
    assert baseline_text(pasta_target, record) == want == "ABC"
    judge = RecordingJudge()
    samples = sample_record(pasta_target, judge, record, 2, max_new_tokens=6, seed=1)
    assert len(samples) == 2 and judge.baselines == ["ABC", "ABC"]
    assert baseline_text(pasta_target, dict(record, response="given")) == "given"


def test_sample_output_is_checked_first(inputs, capsys, no_load, tmp_path):
    src = inputs["make_data"] / "responses.jsonl"
    one_line_exit_2(capsys, *sample_args(src, tmp_path), match="is a folder")
    notes = inputs["notes"]
    before = notes.read_bytes()
    one_line_exit_2(capsys, *sample_args(src, notes), match="not written by fastforward")
    assert notes.read_bytes() == before
    one_line_exit_2(capsys, *sample_args(src, src), match="must not be the input")
    one_line_exit_2(capsys, *sample_args(inputs["make_data"], src), match="must not be the input")
    previous = write_jsonl(tmp_path / "samples.jsonl", [{"key": "k9", "prompt_ids": [1], "samples": []}])
    reaches_model_load(capsys, *sample_args(src, previous))


def test_sample_reads_a_make_data_folder(inputs, capsys, no_load, tmp_path):
    reaches_model_load(capsys, *sample_args(inputs["make_data"], tmp_path / "s.jsonl"))


def test_sample_bad_records(inputs, capsys, no_load, tmp_path):
    root = inputs["root"]
    one_line_exit_2(capsys, *sample_args(root / "string-ids.jsonl", tmp_path / "s.jsonl"),
                    match="string-ids.jsonl:2: prompt_ids must be a list of token ids")
    one_line_exit_2(capsys, *sample_args(root / "empty.jsonl", tmp_path / "s.jsonl"), match="holds no records")


@pytest.mark.parametrize("url", ["notaurl", "ftp://host/v1", "http://", "http://[::1"])
def test_judge_url_is_checked_first(inputs, capsys, no_load, tmp_path, url):
    src = inputs["make_data"]
    one_line_exit_2(capsys, *sample_args(src, tmp_path / "s.jsonl", "--judge-url", url), match="http://")
    one_line_exit_2(capsys, *evaluate_args(inputs["root"] / "prompts.jsonl", "--judge-url", url), match="http://")
    with pytest.raises(UsageError, match="http:// or https://"):
        OpenAIJudge(url, "judge")


def test_judge_url_accepts_http_addresses():
    assert OpenAIJudge("https://host:8000/v1/", "judge").url == "https://host:8000/v1/chat/completions"


# --------------------------------------------------------------------------------------------------------------
# 4. pasta export
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def export_inputs(inputs, tmp_path):
    from safetensors.torch import save_file

    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8, "r": 4}))
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{module}.lora_A.weight": torch.ones(4, 64), f"{module}.lora_B.weight": torch.zeros(64, 4)},
              str(stage / "adapter_model.safetensors"))
    merged = tmp_path / "merged"
    merged.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(260 + len(PASTA_TOKENS), 64)},
              str(merged / "model.safetensors"))
    return {"stage": stage, "merged": merged, "base": inputs["tiny"]}


def export_args(x, out, *extra):
    return ["pasta", "export", "--base", x["base"], "--stages", x["stage"], "--model", x["merged"], "--out", out,
            *extra]


def test_export_writes_a_marked_folder_and_rewrites_only_its_own(export_inputs, capsys, tmp_path):
    out = tmp_path / "adapter"
    code, stdout, err = run_cli(capsys, *export_args(export_inputs, out))
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == {RUN_MARKER, "adapter.json", "adapter.safetensors"}
    assert json.loads((out / "adapter.json").read_text())["stages"] == [{"scaling": 2.0, "modules": 1}]
    code, _, err = run_cli(capsys, *export_args(export_inputs, out))  # its own output: written again
    assert code == 0, err


def test_export_refuses_folders_and_files_it_did_not_write(export_inputs, capsys, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "adapter.json").write_text('{"mine": true}\n')
    one_line_exit_2(capsys, *export_args(export_inputs, mine), match="did not write")
    assert (mine / "adapter.json").read_text() == '{"mine": true}\n' and len(list(mine.iterdir())) == 1
    a_file = tmp_path / "a-file"
    a_file.write_text("x\n")
    one_line_exit_2(capsys, *export_args(export_inputs, a_file), match="not a folder")
    assert a_file.read_text() == "x\n"


@pytest.mark.parametrize("broken, match", [
    ({"adapter_config.json": "{}"}, "not a LoRA adapter's config"),
    ({"adapter_config.json": "not json"}, "not readable JSON"),
    ({"adapter_config.json": '{"lora_alpha": 8, "r": 0}'}, "r > 0"),
    ({"adapter_model.safetensors": "junk junk junk junk"}, "not a readable safetensors file"),
])
def test_export_bad_stage_writes_nothing(export_inputs, capsys, tmp_path, broken, match):
    for name, text in broken.items():
        (export_inputs["stage"] / name).write_text(text)
    out = tmp_path / "adapter"
    one_line_exit_2(capsys, *export_args(export_inputs, out), match=match)
    assert not out.exists()


def test_export_bad_merged_model_writes_nothing(export_inputs, capsys, tmp_path):
    (export_inputs["merged"] / "model.safetensors").write_bytes(b"\x00" * 64)
    out = tmp_path / "adapter"
    one_line_exit_2(capsys, *export_args(export_inputs, out), match="not a readable safetensors file")
    assert not out.exists()


def test_export_bad_training_and_base(export_inputs, capsys, tmp_path):
    out = tmp_path / "adapter"
    one_line_exit_2(capsys, *export_args(export_inputs, out, "--training", "/nonexistent.md"),
                    match="cannot read --training")
    (tmp_path / "t.md").write_bytes(b"\xff\xfe")
    one_line_exit_2(capsys, *export_args(export_inputs, out, "--training", tmp_path / "t.md"), match="UTF-8")
    x = dict(export_inputs, base="no-such-model")
    one_line_exit_2(capsys, *export_args(x, out), match="unknown model 'no-such-model'")
    assert not out.exists()


# --------------------------------------------------------------------------------------------------------------
# 5. pasta annotate: malformed make-data records, no records
# --------------------------------------------------------------------------------------------------------------


def test_annotate_refuses_malformed_and_empty_inputs(inputs, capsys, no_load, tmp_path):
    root = inputs["root"]
    out = tmp_path / "o.jsonl"
    one_line_exit_2(capsys, "pasta", "annotate", root / "string-ids.jsonl", out, "--model", inputs["tiny"],
                    match="string-ids.jsonl:2: prompt_ids must be a list of token ids")
    one_line_exit_2(capsys, "pasta", "annotate", root / "empty.jsonl", out, "--model", inputs["tiny"],
                    match="holds no records")
    one_line_exit_2(capsys, "pasta", "annotate", inputs["make_data"], inputs["notes"], "--model", inputs["tiny"],
                    match="not written by fastforward")
    assert not out.exists()


# --------------------------------------------------------------------------------------------------------------
# 6. generate --method pasta: the model the user names is the model that runs
# --------------------------------------------------------------------------------------------------------------


def test_generate_pasta_keeps_an_explicit_model(inputs, capsys):
    one_line_exit_2(capsys, "generate", "hi", "--method", "pasta", "--model", inputs["tiny"],
                    "--max-new-tokens", 4, match="has no PASTA-LANG tokens")
    code, out, err = run_cli(capsys, "generate", "hi", "--method", "pasta", "--model", inputs["tiny"],
                             "--max-new-tokens", 4, "-o", "plain=True", "--no-stream")
    assert code == 0, err


def test_generate_pasta_default_model_is_the_pasta_adapter(capsys, no_load):
    code, _, err = run_cli(capsys, "generate", "hi", "--method", "pasta")
    assert code == 2 and f"model load reached ({DEFAULT_PASTA_MODEL})" in err, err
    code, _, err = run_cli(capsys, "generate", "hi", "--method", "pasta", "--model", "smollm2-135m")
    assert code == 2 and "model load reached (smollm2-135m)" in err, err
