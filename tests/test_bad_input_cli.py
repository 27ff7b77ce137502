"""Bad command-line input, for every command: one line on stderr, exit code 2, before any work (no model is loaded);
no command writes into a folder or over a file it did not write; a read-only output fails before the work; an
interrupted command keeps what it finished and says so in one line (exit 130).

Everything runs in-process on tiny models; nothing here loads the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import fill, one_line_exit_2, run_cli

import fastforward as ff
import fastforward.model
from fastforward.paths import RUN_MARKER
from fastforward.testing import tiny_hf_folder, write_tiny_gguf

REPO = Path(__file__).resolve().parents[1]
HUGE = "99999999999999999999"


# --------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Input files every case may name, as {placeholder: path}."""
    root = tmp_path_factory.mktemp("inputs")
    tiny = tiny_hf_folder(root / "tiny", max_positions=128)
    hfonly = root / "hfonly"  # an HF folder with config.json only: no tokenizer, no weights
    hfonly.mkdir()
    (hfonly / "config.json").write_text(json.dumps({"model_type": "llama"}))
    q = root / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"say {i} and {i + 1}"]}) + "\n"
                         for i in range(3)))
    gsm = root / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                           for i in range(3)))
    data = root / "train.json"
    data.write_text(json.dumps([{"instruction": f"Add {i} and 1.", "input": "", "output": f"{i + 1}"}
                                for i in range(12)]))
    traj = root / "traj"  # a trajectories folder (train cllm only needs it to exist for the checks below)
    traj.mkdir()
    (traj / "trajectories.jsonl").write_text("")
    (root / "prompts-bad-json.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    (root / "prompts-empty.txt").write_text("\n \n")
    (root / "prompts-mixed.jsonl").write_text('{"prompt": "ok"}\n{"prompt": [1, "a"]}\n')
    (root / "prompts-no-field.jsonl").write_text('{"text": "ok"}\n')
    foreign = root / "foreign"  # somebody's folder: no command of ours wrote it
    foreign.mkdir()
    (foreign / "config.json").write_text('{"mine": true}\n')
    (foreign / "report.md").write_text("# my notes\n")
    (foreign / "meta.json").write_text('{"mine": true}\n')
    other = root / "other-command"  # a folder 'fastforward train' wrote
    other.mkdir()
    (other / RUN_MARKER).write_text(json.dumps({"command": "train"}))
    notes = root / "notes.json"  # somebody's file
    notes.write_text('{"mine": true}\n')
    a_file = root / "a-file.txt"
    a_file.write_text("x\n")
    return {"{tiny}": str(tiny), "{hfonly}": str(hfonly), "{q}": str(q), "{gsm}": str(gsm), "{data}": str(data),
            "{traj}": str(traj), "{foreign}": str(foreign), "{other}": str(other), "{notes}": str(notes),
            "{file}": str(a_file), "{dir}": str(root)}


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, no model loaded
# --------------------------------------------------------------------------------------------------------------

OUT = "{dir}/never-written"
TRAIN = ["train", "msn", "--model", "{tiny}", "--data", "{data}", "--out", OUT, "--quiet"]
CLLM = ["train", "cllm", "--model", "{tiny}", "--trajectories", "{traj}", "--out", OUT, "--quiet"]
BENCH = ["bench", "--questions", "{q}", "--model", "{tiny}", "--out", OUT, "--no-progress"]
EVAL = ["eval", "--task", "gsm8k", "--model", "{tiny}", "--data", "{gsm}", "--quiet"]
NLL = ["eval", "--task", "nll", "--model", "{tiny}", "--data", "{data}"]
TREE = ["build-tree", "--model", "{tiny}", "--prompts", "{q}", "--out", "{dir}/tree.json"]
COLLECT = ["collect-trajectories", "--model", "{tiny}", "--prompts", "{q}", "--out", OUT, "--quiet"]
PROFILE = ["profile", "--model", "{tiny}"]

CASES = [
    # generate (the prompt and sampling checks are GenerationRequest's; the rest is the command line's)
    (["generate", "hi", "--model", "{tiny}", "--temperature", "nan"], "temperature"),
    (["generate", "hi", "--model", "{tiny}", "--temperature", "inf"], "temperature"),
    (["generate", "hi", "--model", "{tiny}", "--seed", HUGE], "seed"),
    (["generate", "caf\udce9", "--model", "{tiny}"], "not valid UTF-8"),
    (["generate", "hi", "--model", "{hfonly}"], "has no tokenizer"),
    (["generate", "hi", "--model", "{tiny}", "--stop", "\udcff"], "not valid UTF-8"),
    # bench
    (BENCH + ["--temperature", "nan"], "--temperature"),
    (BENCH + ["--temperature", "inf"], "--temperature"),
    (BENCH + ["--temperature", "-1"], "--temperature"),
    (BENCH + ["--seed", HUGE], "--seed"),
    (BENCH + ["--seed", "-1"], "--seed"),
    (BENCH + ["--max-new-tokens", "0"], "--max-new-tokens"),
    (BENCH + ["--max-new-tokens", "1e3"], "--max-new-tokens"),
    (BENCH + ["--repeats", "0"], "--repeats"),
    (BENCH + ["--warmup", "-1"], "--warmup"),
    (BENCH + ["--batch", "2", "--batch-tokens", "0"], "--batch-tokens"),
    (BENCH + ["--no-cut-drafts"], "apply to --batch"),
    (BENCH + ["--categories", "\udcff"], "not valid UTF-8"),
    (BENCH + ["--model", "{hfonly}"], "has no tokenizer"),
    (BENCH + ["--out", "{foreign}"], "did not write"),
    (BENCH + ["--out", "{other}"], "'fastforward train'"),
    (BENCH + ["--out", "{file}"], "not a folder"),
    (BENCH + ["--out", "{file}/sub"], "not a folder"),
    # eval
    (EVAL + ["--save", "{dir}"], "is a folder"),
    (EVAL + ["--save", "{dir}/missing/x.json"], "does not exist"),
    (EVAL + ["--save", "{notes}"], "not written by fastforward"),
    (EVAL + ["--limit", "-3"], "--limit"),
    (EVAL + ["--max-new-tokens", "0"], "--max-new-tokens"),
    (EVAL + ["--timeout", "inf"], "--timeout"),
    (EVAL + ["-o", "k=1"], "has no option k"),
    (EVAL + ["--method", "jacobi", "-o", "n_tokens=4000"], "n_tokens must be an integer in [2, 1024]"),
    (BENCH + ["--methods", "pld:max_ngram=1000000000"], "max_ngram must be an integer in [1, 32]"),
    (NLL + ["--heldout", "nan"], "--heldout"),
    # train
    (TRAIN + ["--lr", "nan"], "--lr"),
    (TRAIN + ["--lr", "inf"], "--lr"),
    (TRAIN + ["--seed", HUGE], "--seed"),
    (TRAIN + ["--warmup", "nan"], "--warmup"),
    (TRAIN + ["--weight-decay", "inf"], "--weight-decay"),
    (TRAIN + ["--max-grad-norm", "nan"], "--max-grad-norm"),
    (TRAIN + ["--lora-alpha", "-1"], "--lora-alpha"),
    (TRAIN + ["--heldout", "nan"], "--heldout"),
    (TRAIN + ["--model", "{hfonly}"], "has no tokenizer"),
    (TRAIN + ["--out", "{foreign}"], "did not write"),
    (TRAIN + ["--out", "{file}"], "not a folder"),
    (CLLM + ["--ar-weight", "nan"], "--ar-weight"),
    (CLLM + ["--out", "{foreign}"], "did not write"),
    # build-tree
    (TREE + ["--seed", HUGE], "--seed"),
    (TREE + ["--max-new-tokens", "0"], "--max-new-tokens"),
    (TREE + ["--out", "{dir}"], "is a folder"),
    (TREE + ["--out", "{notes}"], "not written by fastforward"),
    (TREE + ["--budget", "nan"], "--budget"),
    (TREE + ["--model", "{hfonly}"], "has no tokenizer"),
    # collect-trajectories
    (COLLECT + ["--seed", HUGE], "--seed"),
    (COLLECT + ["--max-new-tokens", "0"], "--max-new-tokens"),
    (COLLECT + ["--augment-prob", "nan"], "--augment-prob"),
    (COLLECT + ["--max-ngram-repeat", "inf"], "--max-ngram-repeat"),
    (COLLECT + ["--out", "{foreign}"], "did not write"),
    (COLLECT + ["--out", "{other}"], "'fastforward train'"),
    # profile
    (PROFILE + ["--kv", "0"], "--kv"),
    (PROFILE + ["--repeats", "nan"], "--repeats"),
    (PROFILE + ["--q", "0"], "--q"),
    (PROFILE + ["--q", "1,x"], "--q"),
    (PROFILE + ["--model", "{hfonly}"], "has no tokenizer"),
    # generate --prompts FILE: the file and each prompt checked before the model loads
    (["generate", "--prompts", "{dir}/prompts-bad-json.jsonl", "--model", "{tiny}"], "line 2: not JSON"),
    (["generate", "--prompts", "{dir}/prompts-empty.txt", "--model", "{tiny}"], "holds no prompt"),
    (["generate", "--prompts", "{dir}/prompts-mixed.jsonl", "--model", "{tiny}"], "prompt 2:"),
    (["generate", "--prompts", "{dir}/prompts-no-field.jsonl", "--model", "{tiny}"], "\"prompt\" field"),
    (["generate", "--prompts", "{dir}/no-such-file.txt", "--model", "{tiny}"], "cannot read --prompts"),
    (["generate", "hi", "--prompts", "{q}", "--model", "{tiny}"], "one of them"),
    (["generate", "--prompts", "{q}", "--model", "{tiny}", "--batch-tokens", "0"], "--batch-tokens"),
    (["generate", "hi", "--model", "{tiny}", "--no-cut-drafts"], "apply to --prompts"),
    # serve-bench --url: checked before anything is sent
    (["serve-bench", "--url", "not-a-url"], "not an http:// or https:// URL"),
    (["serve-bench", "--url", "ftp://127.0.0.1:9"], "not an http:// or https:// URL"),
    (["serve-bench", "--url", "http://"], "names no host"),
    (["serve-bench", "--url", "http://127.0.0.1:99999"], "the port must be in [1, 65535]"),
    (["serve-bench", "--url", "http://127.0.0.1:0"], "the port must be in [1, 65535]"),
    (["serve-bench", "--url", "http://127.0.0.1:http"], "not a valid URL"),
    (["serve-bench", "--url", "http://[::1"], "not a valid URL"),
    (["serve-bench", "--url", "http://127.0.0.1:9/v1"], "has a path"),
    (["serve-bench", "--url", "not-a-url", "--model", "m"], "not an http:// or https:// URL"),
    (["serve-bench", "--url", "http://127.0.0.1:99999", "--model", "m"], "the port must be in [1, 65535]"),
    # methods, and the command line itself
    (["methods", "--bogus"], "unrecognized arguments"),
    (["methods", "extra"], "unrecognized arguments"),
    (["\udcff"], "not valid UTF-8"),
]


@pytest.mark.parametrize("argv, match", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_before_any_work(files, no_load, capsys, argv, match):
    line = one_line_exit_2(capsys, fill(files, argv))
    assert match in line, line
    assert not Path(fill(files, [OUT])[0]).exists()


def test_enough_cases():
    assert len(CASES) >= 40
    assert {a[0] for a, _ in CASES} >= {"generate", "bench", "eval", "train", "build-tree", "collect-trajectories",
                                        "profile", "methods"}


def test_invalid_utf8_bytes_on_a_real_command_line(files, tmp_path):
    """Bytes that are not UTF-8 reach Python as lone surrogates; the command says so in one line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "fastforward.cli", "bench", "--questions", files["{q}"],
                           "--categories", b"\xff\xfe".decode("utf-8", "surrogateescape"),
                           "--out", str(tmp_path / "o")], env=env, capture_output=True, timeout=120)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "not valid UTF-8" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------------------------
# Broken models: one clear line
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--backend", "hf"]], ids=["lean", "hf"])
def test_truncated_gguf_is_one_line(tmp_path, monkeypatch, capsys, extra):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))
    good = tmp_path / "tiny.gguf"
    write_tiny_gguf(good)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[:3000])
    line = one_line_exit_2(capsys, ["generate", "hi", "--model", bad, *extra])
    assert "bad.gguf" in line and ("truncated" in line or "corrupt" in line), line


def test_hf_folder_without_tokenizer_or_weights(files, tmp_path, no_load, capsys):
    line = one_line_exit_2(capsys, ["generate", "hi", "--model", files["{hfonly}"]])
    assert "tokenizer.json" in line
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (weightless / name).write_bytes((Path(files["{tiny}"]) / name).read_bytes())
    assert "has no weights" in one_line_exit_2(capsys, ["generate", "hi", "--model", weightless])
    (weightless / "config.json").write_text("{not json")
    assert "config.json is not readable JSON" in one_line_exit_2(capsys, ["generate", "hi", "--model", weightless])


def test_a_model_folder_without_config_json_says_so(tmp_path, monkeypatch, capsys):
    """A folder given as --model without config.json said only "unknown model": it now names the folder and what an
    HF folder needs (or the GGUF file in it to give instead)."""
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "my-model"
    folder.mkdir()
    line = one_line_exit_2(capsys, ["generate", "hi", "--model", folder])
    assert "has no config.json" in line and str(folder) in line and "unknown model" not in line, line
    (folder / "model.safetensors").write_bytes(b"\x00")
    line = one_line_exit_2(capsys, ["generate", "hi", "--model", folder])
    assert "has no config.json" in line and "weights" in line, line
    write_tiny_gguf(folder / "tiny.gguf")
    line = one_line_exit_2(capsys, ["generate", "hi", "--model", folder])
    assert "tiny.gguf" in line and "give the .gguf file itself" in line, line


# --------------------------------------------------------------------------------------------------------------
# --method pasta: no progress bar on stderr
# --------------------------------------------------------------------------------------------------------------


def test_pasta_generation_on_a_log_prints_no_progress(monkeypatch, capsys):
    """A long prompt's "reading the prompt" line is rewritten in place on a terminal; on a log or a pipe (here:
    captured) every rewrite was text. Nothing is printed there now, for pasta as for ar."""
    import torch

    from fastforward.model import TargetModel
    from fastforward.pasta.language import add_pasta_tokens
    from fastforward.testing import tiny_llama_hf, tiny_tokenizer_hf

    tokenizer = tiny_tokenizer_hf()
    add_pasta_tokens(tokenizer)
    target = TargetModel("tiny-pasta", tiny_llama_hf(vocab_size=320, seed=1, dtype=torch.float32,
                                                     max_positions=2048), tokenizer, backend="lean")
    monkeypatch.setattr(ff, "load", lambda *a, **k: target)
    prompt = "word " * 300  # 1,500 tokens: a prefill of several chunks
    for method in ("pasta", "ar"):
        code, out, err = run_cli(capsys, "generate", prompt, "--method", method, "--model", "tiny-pasta",
                                 "--max-new-tokens", 8, "--no-stream")
        assert code == 0, err
        assert "\r" not in err and len(err.splitlines()) <= 1, (method, err[:500])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # on a terminal: the one line, rewritten in place
    for method in ("pasta", "ar"):
        code, out, err = run_cli(capsys, "generate", prompt, "--method", method, "--model", "tiny-pasta",
                                 "--max-new-tokens", 8, "--no-stream")
        assert code == 0, err
        assert err.startswith("\r") and err.endswith("\n") and err.count("\n") == 1, err
        assert all(part.startswith("reading the prompt") for part in err[1:].split("\r")), err


def test_gguf_conversion_prints_one_line_not_a_progress_bar(tmp_path, monkeypatch, capsys):
    """Converting a GGUF file (the first --method pasta run converts the default model) ran transformers' tqdm bar
    over its tensors: dozens of lines on a log. A log gets nothing now; a terminal one line saying what happens."""
    import torch
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from fastforward.model.loading import convert_gguf
    from fastforward.testing import tiny_llama_hf, tiny_tokenizer_hf

    def model_from_gguf(*args, **kwargs):  # what transformers does, bar included, without a real GGUF tokenizer
        for _ in gguf_utils.tqdm(range(272), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        return tiny_llama_hf(vocab_size=260, dtype=torch.float32)

    bar = gguf_utils.tqdm
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer_hf())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_gguf)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    convert_gguf(gguf, tmp_path / "converted")
    err = capsys.readouterr().err
    assert (tmp_path / "converted" / "config.json").is_file()
    assert err == "", err[:500]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    convert_gguf(gguf, tmp_path / "converted")
    err = capsys.readouterr().err
    assert "Converting" not in err and "\r" not in err and len(err.splitlines()) == 1, err[:500]
    assert err.startswith("fastforward: converting m.gguf"), err
    assert gguf_utils.tqdm is bar  # transformers' own bar is back as it was


# --------------------------------------------------------------------------------------------------------------
# Nothing is written over what a command did not write
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["bench", "train", "train-cllm", "collect-trajectories"])
def test_a_foreign_folder_keeps_its_bytes(files, tmp_path, no_load, capsys, command):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 7}\n')
    (folder / "report.md").write_text("# my report\n")
    (folder / "results.jsonl").write_text('{"not": "a bench row"}\n')
    (folder / "model.safetensors").write_bytes(b"\x00weights")
    before = snapshot(folder)
    argv = {"bench": BENCH, "train": TRAIN, "train-cllm": CLLM, "collect-trajectories": COLLECT}[command]
    line = one_line_exit_2(capsys, fill(files, [folder if a == OUT else a for a in argv]))
    assert "did not write" in line and str(folder) in line
    assert snapshot(folder) == before


def test_report_only_and_batch_refuse_a_foreign_folder(files, no_load, capsys):
    before = snapshot(Path(files["{foreign}"]))
    one_line_exit_2(capsys, ["bench", "--report-only", "--out", files["{foreign}"]])
    one_line_exit_2(capsys, ["bench", "--questions", files["{q}"], "--batch", "2", "--out", files["{foreign}"]])
    assert snapshot(Path(files["{foreign}"])) == before


def test_files_not_written_by_fastforward_keep_their_bytes(files, no_load, capsys):
    notes = Path(files["{notes}"])
    before = notes.read_bytes()
    one_line_exit_2(capsys, fill(files, [*EVAL, "--save", notes]))
    one_line_exit_2(capsys, ["build-tree", "--prompts", files["{q}"], "--out", notes])
    assert notes.read_bytes() == before


def test_bench_marks_its_folder_and_resumes_it(tiny, tmp_path, monkeypatch, capsys, files):
    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny)
    out = tmp_path / "out"
    argv = ["bench", "--questions", files["{q}"], "--model", "tiny-llama", "--methods", "ar", "--max-new-tokens", 4,
            "--warmup", 0, "--no-progress", "--out", out]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads((out / RUN_MARKER).read_text())["command"] == "bench"
    rows = (out / "results.jsonl").read_text()
    code, _, err = run_cli(capsys, *argv)  # its own folder: resumed (nothing left to measure)
    assert code == 0, err
    assert (out / "results.jsonl").read_text() == rows
    # an empty folder is fine too; a folder another command wrote is not
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, *argv[:-1], tmp_path / "empty")
    assert code == 0, err
    train_line = one_line_exit_2(capsys, fill(files, [*TRAIN[:6], "--out", out, "--quiet"]))
    assert "holds the output of 'fastforward bench'" in train_line


def special_files(tmp_path) -> list[Path]:
    """Paths that exist and are not regular files: a FIFO, a socket and /dev/full where this system has them."""
    import socket

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    found = [fifo]
    sock = tmp_path / "sock"
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(sock))
        found.append(sock)
    except (OSError, AttributeError):  # a path too long for a socket, or no AF_UNIX
        pass
    if Path("/dev/full").exists():
        found.append(Path("/dev/full"))
    return found


def test_an_output_that_is_not_a_regular_file_is_refused_unread(files, tmp_path, monkeypatch, no_load, capsys):
    """``--save /dev/full`` read the device whole (out of memory) and ``--save /dev/stdout`` (a pipe, a terminal)
    waited forever: an existing output that is not a regular file is refused, and never opened to see whose it is."""
    from fastforward.cli import eval as cli_eval
    from fastforward.cli import tree as cli_tree

    looked = []
    monkeypatch.setattr(cli_eval, "is_eval_file", lambda path: looked.append(path) or False)
    monkeypatch.setattr(cli_tree, "is_tree_file", lambda path: looked.append(path) or False)
    for special in special_files(tmp_path):
        for argv in ([*EVAL, "--save", special], [*TREE[:5], "--out", special]):
            line = one_line_exit_2(capsys, fill(files, argv))
            assert "is not a regular file" in line and str(special) in line, line
    assert not looked


def test_check_output_file_never_asks_whose_a_special_file_is(tmp_path):
    from fastforward.errors import UsageError
    from fastforward.paths import check_output_file

    looked = []
    for special in special_files(tmp_path):
        with pytest.raises(UsageError, match="is not a regular file") as info:
            check_output_file(special, "--out", owned=lambda path: looked.append(path) or False)
        assert "\n" not in str(info.value)
    assert not looked


def test_ownership_checks_read_a_bounded_prefix(tmp_path):
    """Whether an output file is one fastforward wrote is judged from its start: a huge file (here 64 MiB, sparse) is
    never read whole, and a long file in the command's own format is still recognised."""
    import tracemalloc

    from fastforward.evaluate import is_eval_file
    from fastforward.train.make_data import is_heldout_file
    from fastforward.train.pasta.annotate import check_records_output
    from fastforward.train.pasta.evaluation import is_evaluate_result
    from fastforward.tree import TREE_FORMAT
    from fastforward.tree_builder import is_tree_file

    def huge(name: str, start: str) -> Path:
        path = tmp_path / name
        with open(path, "wb") as f:
            f.write(start.encode())
            f.truncate(64 << 20)
        return path

    cases = [
        (is_eval_file, huge("eval.json", '{\n "task": "gsm8k",\n "model": "m",\n "samples": [')),
        (is_tree_file, huge("tree.json", f'{{\n  "format": "{TREE_FORMAT}",\n  "choices": [')),
        (is_evaluate_result, huge("pasta.json", '{\n "models": {\n')),
        (is_heldout_file, huge("heldout.jsonl", '{"id": "a", "category": "c", "prompt": "p"}\n{"id": ')),
    ]
    src = tmp_path / "responses.jsonl"
    src.write_text("")
    annotated = huge("annotated.jsonl", '{"pasta": "x"}\n{"pasta": ')
    for owned, path in cases:
        tracemalloc.start()
        try:
            assert owned(path), owned.__name__
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, (owned.__name__, peak)
    tracemalloc.start()
    try:
        assert check_records_output(annotated, src, "pasta") == annotated
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    # a long file in another shape is still somebody else's; a short one is still judged whole
    other = huge("other.json", '{"mine": true, "task": "x", "samples": [')
    assert not is_eval_file(other)
    short = tmp_path / "short.json"
    short.write_text('{"task": "gsm8k"}')
    assert not is_eval_file(short)
    short.write_text(json.dumps({"task": "gsm8k", "samples": []}, indent=1))
    assert is_eval_file(short)


# --------------------------------------------------------------------------------------------------------------
# serve-bench against a server that is not ours: one line, not an internal error
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def odd_server():
    """A loopback HTTP server answering like fastforward serve, except where ``odd_server.broken`` ({path: bytes})
    says otherwise; yields its URL-setting object."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    state = SimpleNamespace(broken={}, url="")
    answers = {"/v1/models": json.dumps({"data": [{"id": "fake"}]}).encode(),
               "/v1/chat/completions": json.dumps({"usage": {"completion_tokens": 1},
                                                   "fastforward": {"token_ids": [1]}}).encode(),
               "/metrics": b"fastforward_target_forwards_total 1\n"}

    class Handler(BaseHTTPRequestHandler):
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = state.broken.get(self.path, answers.get(self.path, b"{}"))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def test_serve_bench_against_a_server_whose_models_answer_is_not_json(odd_server, no_load, capsys):
    odd_server.broken["/v1/models"] = b"<html>not an API</html>"
    line = one_line_exit_2(capsys, ["serve-bench", "--url", odd_server.url, "--requests", 1, "--clients", 1])
    assert "names no model" in line and odd_server.url in line, line


def test_serve_bench_when_the_server_answers_garbage_midway_is_one_error_line(odd_server, no_load, capsys):
    odd_server.broken["/metrics"] = b"\xff\xfe not UTF-8"
    code, out, err = run_cli(capsys, "serve-bench", "--url", odd_server.url, "--methods", "ar", "--requests", 1,
                             "--clients", 1, "--max-tokens", 1)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert lines[-1].startswith("fastforward: error: --url " + odd_server.url), lines[-1]
    assert all(line.startswith("phase ") for line in lines[:-1]), err  # the progress lines before it only


# --------------------------------------------------------------------------------------------------------------
# Unwritable outputs fail before the work
# --------------------------------------------------------------------------------------------------------------


def unwritable(tmp_path) -> Path:
    """A folder this process cannot create files in (chmod for a normal user; /sys when running as root)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_text("")
    except OSError:
        return folder
    (folder / "probe").unlink()
    for candidate in (Path("/sys"), Path("/proc")):
        try:
            (candidate / "fastforward-probe").mkdir()
        except OSError:
            return candidate
        (candidate / "fastforward-probe").rmdir()
    pytest.skip("no unwritable folder available")


def test_read_only_outputs_fail_before_any_work(files, tmp_path, no_load, capsys):
    ro = unwritable(tmp_path)
    try:
        for argv in ([*BENCH[:-3], "--out", ro / "bench"], [*TRAIN[:6], "--out", ro / "train", "--quiet"],
                     [*COLLECT[:5], "--out", ro / "traj"], [*EVAL, "--save", ro / "eval.json"],
                     [*TREE[:5], "--out", ro / "tree.json"]):
            line = one_line_exit_2(capsys, fill(files, argv))
            assert "cannot write" in line, line
    finally:
        if ro.is_relative_to(tmp_path):
            ro.chmod(0o755)


def test_build_tree_install_into_an_unwritable_cache_fails_before_work(files, tmp_path, monkeypatch, no_load,
                                                                       capsys):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(unwritable(tmp_path) / "cache"))
    line = one_line_exit_2(capsys, ["build-tree", "--prompts", files["{q}"], "--out", tmp_path / "t.json",
                                    "--install"])
    assert "--install" in line and "cannot write" in line


# --------------------------------------------------------------------------------------------------------------
# build-tree installs only when asked
# --------------------------------------------------------------------------------------------------------------


def test_build_tree_installs_only_with_install(tiny, files, tmp_path, monkeypatch, capsys):
    from fastforward.proposers.tr_jacobi import installed_tree_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("FASTFORWARD_CACHE", str(cache))
    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny)
    costs = {q: 10.0 + q for q in range(1, 80)}
    monkeypatch.setattr("fastforward.tree_builder.measure_forward_costs", lambda *a, **k: dict(costs))
    argv = ["build-tree", "--model", "tiny-llama", "--prompts", files["{q}"], "--limit", 2, "--offset", 0,
            "--max-new-tokens", 16, "--width", 3, "--depth", 3, "--out", tmp_path / "t.json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert (tmp_path / "t.json").is_file()
    assert not installed_tree_path("tiny-llama").exists() and not (cache / "trees").exists()
    assert "not installed" in out and "--install" in out
    code, out, err = run_cli(capsys, *argv, "--install")  # its own tree at --out: rewritten; installed
    assert code == 0, err
    assert json.loads(installed_tree_path("tiny-llama").read_text()) == json.loads((tmp_path / "t.json").read_text())


def test_build_tree_help_names_install(capsys):
    code, out, _ = run_cli(capsys, "build-tree", "--help")
    assert code == 0 and "--install" in out and "--no-install" not in out


# --------------------------------------------------------------------------------------------------------------
# Missing extras: matplotlib (plots) and peft (LoRA)
# --------------------------------------------------------------------------------------------------------------


def test_bench_writes_its_report_without_matplotlib(tiny, files, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny)
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` raises ImportError
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "bench", "--questions", files["{q}"], "--methods", "ar,pld",
                                "--max-new-tokens", 4, "--warmup", 0, "--no-progress", "--out", out)
    assert code == 0, err
    assert (out / "report.md").is_file() and (out / "summary.json").is_file()
    assert not list(out.glob("*.png"))
    notes = [line for line in err.splitlines() if "matplotlib" in line]
    assert len(notes) == 1 and "pip install" in notes[0] and "[bench]" in notes[0]
    assert "report.md" in stdout


def test_lora_training_without_peft_fails_before_work(files, monkeypatch, no_load, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)
    line = one_line_exit_2(capsys, fill(files, TRAIN))
    assert "peft" in line and "[train]" in line and "--full" in line


# --------------------------------------------------------------------------------------------------------------
# Ctrl-C keeps what was finished; one line, exit 130
# --------------------------------------------------------------------------------------------------------------


def test_ctrl_c_in_eval_saves_the_items_scored(files, tmp_path, monkeypatch, capsys):
    import fastforward.evaluate as evaluate

    real = evaluate._generate
    calls = []

    def interrupted_on_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(evaluate, "_generate", interrupted_on_second)
    save = tmp_path / "g.json"
    code, out, err = run_cli(capsys, "eval", "--task", "gsm8k", "--model", files["{tiny}"], "--data", files["{gsm}"],
                             "--max-new-tokens", 4, "--quiet", "--save", save)
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fastforward: interrupted") and "1 of 3 items" in lines[0]
    saved = json.loads(save.read_text())
    assert saved["n"] == 1 and len(saved["samples"]) == 1 and saved["interrupted"] == "1 of 3 items"
    assert out.startswith("gsm8k accuracy")
    # the partial file is the command's own: a re-run may replace it
    monkeypatch.setattr(evaluate, "_generate", real)
    code, _, err = run_cli(capsys, "eval", "--task", "gsm8k", "--model", files["{tiny}"], "--data", files["{gsm}"],
                           "--max-new-tokens", 4, "--quiet", "--save", save)
    assert code == 0, err
    assert json.loads(save.read_text())["n"] == 3


def test_ctrl_c_in_bench_keeps_the_rows_in_one_line(tiny, files, tmp_path, monkeypatch, capsys):
    import fastforward.bench.runner as runner

    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny)
    real = runner.turn_prompt
    calls = []

    def interrupted_on_fourth(*a, **k):  # the first call makes the warm-up prompt
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "turn_prompt", interrupted_on_fourth)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "bench", "--questions", files["{q}"], "--methods", "ar", "--max-new-tokens", 4,
                           "--warmup", 0, "--no-progress", "--out", out)
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("fastforward bench: 3 q")]
    assert len(lines) == 1 and "2 of 3 runs measured" in lines[0] and "resume" in lines[0], err
    assert len((out / "results.jsonl").read_text().splitlines()) == 2


def test_ctrl_c_in_train_keeps_a_checkpoint_in_one_line(files, tmp_path, monkeypatch, capsys):
    from fastforward.train.msn import MSN

    real = MSN.loss
    calls = []

    def interrupted_in_step_3(self, model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, model, batch)

    monkeypatch.setattr(MSN, "loss", interrupted_in_step_3)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "msn", "--model", files["{tiny}"], "--data", files["{data}"], "--out", out,
                           "--batch-size", 2, "--grad-accum", 1, "--max-steps", 4, "--save-every", 10, "--full",
                           "--max-length", 32, "--threads", 1, "--quiet")
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "checkpoint at step 2" in lines[0] and "resume" in lines[0], err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    assert json.loads((out / RUN_MARKER).read_text())["command"] == "train"
