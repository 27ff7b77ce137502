"""Hostile input to ``fastforward generate`` and ``fastforward serve``: one line on stderr, exit code 2, before any
work -- no model loaded where the model is not needed to tell, and no prompt decoded when one prompt of a
``--prompts`` file cannot be.

Everything runs in-process on a tiny model built in code; nothing here loads the default model."""

from __future__ import annotations

import json
import socket

import pytest
from cli_helpers import one_line_exit_2

import fastforward as ff
import fastforward.model
from fastforward.cli.options import usable_cpus
from fastforward.testing import tiny_hf_folder

CONTEXT = 64  # the tiny model's context, in tokens


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_hf_folder(tmp_path_factory.mktemp("tiny") / "tiny", max_positions=CONTEXT))


@pytest.fixture
def no_decoding(monkeypatch):
    """Decoding fails the test (loading the model is allowed): the error must come before any prompt is decoded."""

    def decode(*a, **k):
        raise AssertionError("a prompt was decoded")

    monkeypatch.setattr(ff, "generate_batch", decode)
    monkeypatch.setattr(ff, "stream", decode)


def write(tmp_path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------------------------------------------
# generate: refused before the model loads
# --------------------------------------------------------------------------------------------------------------

GENERATE_CASES = [
    (["-o", "k=1", "-o", "k=2"], "given twice"),
    (["--method", "pld", "-o", "num-pred-tokens=1", "-o", "num_pred_tokens=2"], "num_pred_tokens is given twice"),
    (["-o", "=1"], "not KEY=VALUE"),
    (["-o", "k"], "not KEY=VALUE"),
    (["--threads", str(usable_cpus() + 1)], "--threads: must be at most"),
    (["--threads", "0"], "--threads"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--temperature", "1e-9"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--seed", "-1"], "seed"),
    (["--stop", ""], "stop strings"),
    (["--method", "AR"], "unknown method 'AR'"),
]


@pytest.mark.parametrize("extra, match", GENERATE_CASES, ids=[" ".join(e) for e, _ in GENERATE_CASES])
def test_generate_flags_refused_before_loading(tiny_folder, no_load, capsys, extra, match):
    line = one_line_exit_2(capsys, "generate", "hi", "--model", tiny_folder, *extra)
    assert match in line, line


def test_whitespace_prompt_is_refused(tiny_folder, no_load, capsys):
    assert "the prompt is empty" in one_line_exit_2(capsys, "generate", " \n\t ", "--model", tiny_folder)


# --------------------------------------------------------------------------------------------------------------
# generate --prompts FILE: every odd file, refused by its line before the model loads
# --------------------------------------------------------------------------------------------------------------

PROMPT_FILES = [
    ("blank-lines.jsonl", '{"prompt": "ok"}\n\n\n{"prompt": \n', "line 4: not JSON"),
    ("wrong-type.jsonl", '"ok"\n5\n', "line 2, prompt 2: prompt must be"),
    ("no-content.jsonl", '{"prompt": [{"role": "user"}]}\n', "needs a string 'content'"),
    ("bad-role.jsonl", '{"prompt": [{"role": 5, "content": "x"}]}\n', "needs a non-empty string 'role'"),
    ("empty-list.jsonl", '{"prompt": []}\n', "the prompt is empty"),
    ("null.jsonl", '{"prompt": null}\n', "got None"),
    ("bools.jsonl", '{"prompt": [true, false]}\n', "prompt lists must hold"),
    ("blank-prompt.jsonl", '"ok"\n{"prompt": "  "}\n', "line 2, prompt 2: the prompt is empty"),
    ("setting.jsonl", '{"prompt": "ok", "max_new_tokens": 5}\n', "per-prompt settings are not supported"),
    ("not-utf8.txt", b"hello\n\xff\xfe bad\n", "not valid UTF-8"),
    ("empty.txt", "", "holds no prompt"),
]


@pytest.mark.parametrize("name, content, match", PROMPT_FILES, ids=[name for name, _, _ in PROMPT_FILES])
def test_prompts_file_refused_before_loading(tiny_folder, tmp_path, no_load, capsys, name, content, match):
    path = write(tmp_path, name, content)
    line = one_line_exit_2(capsys, "generate", "--prompts", path, "--model", tiny_folder)
    assert match in line and name in line, line


def test_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    from fastforward.cli.generate import read_prompts

    text = write(tmp_path, "bom.txt", "\ufefffirst\nsecond\n".encode("utf-8"))
    assert [p for _, p in read_prompts(text)] == ["first", "second"]
    jsonl = write(tmp_path, "bom.jsonl", '\ufeff{"prompt": "first"}\n'.encode("utf-8"))
    assert [p for _, p in read_prompts(jsonl)] == ["first"]  # read as JSON, not as the text '{"prompt": ...}'


@pytest.mark.parametrize("bad, match", [
    ("word " * 200, "the model's context is"),
    (json.dumps({"prompt": [1, 99999]}), "out of range"),
], ids=["longer-than-context", "token-id-out-of-range"])
def test_prompt_that_does_not_fit_is_refused_by_its_line_before_any_decoding(tiny_folder, tmp_path, no_decoding,
                                                                             capsys, bad, match):
    """A bad prompt among good ones: refused (naming its line) before any prompt is decoded, so no work is lost."""
    if bad.startswith("{"):
        content = '"good one"\n\n"another"\n' + bad + "\n"
    else:
        content = "good one\n\nanother\n" + bad + "\n"
    path = write(tmp_path, "prompts.txt", content)
    line = one_line_exit_2(capsys, "generate", "--prompts", path, "--model", tiny_folder, "--batch-tokens", "8",
                           "--max-new-tokens", "2")
    assert "line 4, prompt 3:" in line and match in line, line


# --------------------------------------------------------------------------------------------------------------
# serve: flags refused before the model loads
# --------------------------------------------------------------------------------------------------------------

SERVE_CASES = [
    (["--port", "-1"], "--port"),
    (["--port", "70000"], "--port"),
    (["--port", "abc"], "--port"),
    (["--host", ""], "--host is empty"),
    (["--host", "bad..host"], "--host bad..host"),
    (["--served-model-name", " "], "--served-model-name is empty"),
    (["--default-max-tokens", "5000", "--max-tokens-limit", "4096"], "above --max-tokens-limit"),
    (["--max-running", "0"], "--max-running"),
    (["--max-waiting", "0"], "--max-waiting"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--threads", str(usable_cpus() + 1)], "--threads"),
    (["--method", "bogus"], "unknown method"),
    (["--method", "pld", "-o", "warp=9"], "no option"),
    (["--method", "pld", "-o", "k=1", "-o", "k=2"], "given twice"),
    (["--method", "pld", "-o", "max_ngram=1000000000"], "pld: option max_ngram must be an integer in [1, 32]"),
    (["--method", "jacobi", "-o", "n_tokens=4000"], "jacobi: option n_tokens must be an integer in [2, 1024]"),
    (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("extra, match", SERVE_CASES, ids=[" ".join(e) for e, _ in SERVE_CASES])
def test_serve_flags_refused_before_loading(tiny_folder, no_load, capsys, extra, match):
    line = one_line_exit_2(capsys, "serve", "--model", tiny_folder, *extra)
    assert match in line, line


def test_serve_refuses_a_port_in_use_before_loading(tiny_folder, no_load, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line_exit_2(capsys, "serve", "--model", tiny_folder, "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line, line
