"""The task quality of a model, shared by every training method (the ``fastforward eval`` command,
``fastforward/cli/eval.py``, runs these).

* ``--task nll`` -- mean negative log-likelihood per response token over the *held-out* records of ``--data``
  (the split ``fastforward train`` uses, so they were never trained on), chat-templated exactly as in training,
  teacher-forced, fp32. Lower is better; ``ppl = exp(nll)``.
* ``--task gsm8k`` -- accuracy on GSM8K test questions: greedy generation (``fastforward.generate``), the answer is
  the number after the last ``####`` in the output, else its last number, compared numerically with the number
  after ``####`` in the gold answer.
* ``--task humaneval`` -- pass@1 (greedy, one sample) on HumanEval: the chat model is asked to complete the function,
  the code is taken from its first fenced block (or the whole reply), and ``prompt + code + test +
  check(entry_point)`` runs in a separate Python process with a timeout. See :func:`run_program` for what that
  process can and cannot do -- it is *not* a security sandbox.

Generation is greedy, so results are reproducible; any lossless ``--method`` gives the same outputs as ``ar``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fastforward as ff

from .bench.questions import humaneval_prompt  # the eval and the bench share the prompt
from .errors import UsageError
from .paths import data_root, owned_json
from .stats import totals
from .train.data import encode_examples, located_records, read_examples, split_examples, text_field
from .train.msn import apply_ahead_noise, random_starts

TASKS = ("nll", "gsm8k", "humaneval", "agreement")
DEFAULT_MAX_NEW_TOKENS = {"gsm8k": 256, "humaneval": 512}
DEFAULT_FILES = {"gsm8k": "gsm8k/test.jsonl", "humaneval": "humaneval/HumanEval.jsonl.gz"}


# ------------------------------------------------------------------------------------------------------------------
# GSM8K answers
# ------------------------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _normalize_number(s: str) -> str:
    s = s.replace(",", "").strip()
    if s.startswith("."):
        s = "0" + s
    if s.startswith("-."):
        s = "-0" + s[1:]
    return s


def gsm8k_gold(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference answer."""
    tail = answer.rsplit("####", 1)[-1]
    m = _NUMBER.search(tail)
    if m is None:
        raise UsageError(f"GSM8K answer without a final number: {answer[-80:]!r}")
    return _normalize_number(m.group())


def extract_gsm8k_answer(text: str) -> str | None:
    """The model's final answer: the first number after the last ``####``, else the last number in the text."""
    if "####" in text:
        m = _NUMBER.search(text.rsplit("####", 1)[-1])
        if m:
            return _normalize_number(m.group())
    found = _NUMBER.findall(text)
    return _normalize_number(found[-1]) if found else None


def same_number(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return math.isclose(float(a), float(b), rel_tol=0.0, abs_tol=1e-6)
    except ValueError:
        return a == b


# ------------------------------------------------------------------------------------------------------------------
# HumanEval programs
# ------------------------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a chat reply: the first fenced block that defines ``entry_point`` (else the first fenced block;
    an unclosed fence runs to the end), or the whole reply when there is no fence."""
    blocks = [m.group(2) for m in _FENCE.finditer(text)]
    if not blocks:
        return text
    if entry_point:
        for b in blocks:
            if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", b):
                return b
    return blocks[0]


def humaneval_program(problem: dict, code: str) -> str:
    """``prompt + code + test + check(entry_point)``. When the code defines the function itself it follows the
    prompt (which supplies imports and helpers; the prompt's docstring-only stub is then redefined); otherwise it
    is taken as the body that continues the prompt."""
    entry = problem["entry_point"]
    if re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", code):
        body = problem["prompt"] + "\n" + code
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


# Run before the program, inside the child: no sockets, no process spawning, no file deletion. A speed bump against
# accidents, not a security boundary (see run_program).
_GUARD = """
import os, runpy, shutil, socket, subprocess, sys
def _blocked(*a, **k):
    raise PermissionError("blocked by fastforward eval")
socket.socket = socket.create_connection = socket.socketpair = _blocked
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
for _name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execvp", "kill", "killpg", "remove",
              "unlink", "rmdir", "removedirs", "rename", "replace", "truncate", "putenv", "chmod", "chown"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
shutil.rmtree = shutil.move = _blocked
path = sys.argv[1]
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
"""


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` works here (unprivileged user + network namespaces)."""
    exe = shutil.which("unshare")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit_resources(timeout: float):
    def apply():
        import resource

        cpu = int(math.ceil(timeout)) + 1
        for res, value in (
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_AS, 4 << 30),
            (resource.RLIMIT_FSIZE, 16 << 20),
            (resource.RLIMIT_CORE, 0),
        ):
            try:
                resource.setrlimit(res, (value, value))
            except (ValueError, OSError):
                pass

    return apply


def run_program(program: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run ``program`` in a fresh Python process; ``(passed, detail)``, passed = exit status 0 within ``timeout``.

    The child runs ``python -I -B`` (isolated: no user site, no PYTHON* variables) in an empty temporary working
    directory that is deleted afterwards, with a minimal environment (no proxy variables, HOME = that directory),
    stdin closed, its own session (the whole process group is killed on timeout), and resource limits (CPU time,
    4 GiB address space, 16 MiB files, no core dumps). Where ``unshare -rn`` works, it runs in new user and network
    namespaces: no network interface but a down loopback, so no network at all. A guard disables sockets,
    subprocesses, ``os.fork``/``kill`` and file deletion in the child before the program starts.

    Not a security sandbox: the program still runs as the current user and can read (and write, by ``open``) any
    file that user can. Evaluate untrusted models inside a container or VM.
    """
    with tempfile.TemporaryDirectory(prefix="ff-eval-") as d:
        path = Path(d) / "program.py"
        path.write_text(program)
        cmd = [sys.executable, "-I", "-B", "-c", _GUARD, str(path)]
        if network_namespace_available():
            cmd = [shutil.which("unshare"), "-rn"] + cmd
        env = {"PATH": "/usr/bin:/bin", "HOME": d, "TMPDIR": d, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(
            cmd, cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_limit_resources(timeout),
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.communicate()
            return False, f"timeout after {timeout:g}s"
    if proc.returncode == 0:
        return True, "passed"
    lines = [line for line in err.decode(errors="replace").strip().splitlines() if line.strip()]
    return False, (lines[-1] if lines else f"exit status {proc.returncode}")[:300]


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------


def task_file(task: str, data: str | None) -> Path:
    """The test file of a generation task: ``data``, else the shared data set's (``FASTFORWARD_DATA``)."""
    path = Path(data).expanduser() if data else data_root() / DEFAULT_FILES[task]
    if not path.is_file():
        hint = "" if data else " (give --data PATH or set FASTFORWARD_DATA)"
        raise UsageError(f"{task} data not found: {path}{hint}")
    return path


def _task_records(path: Path, limit: int | None) -> list[tuple[str, dict]]:
    """(where, record) of the first ``limit`` records of a task file (.jsonl, .jsonl.gz or a .json array), each a
    JSON object; anything else is a one-line :class:`UsageError` naming the file and line."""
    located = located_records(path)[:limit]
    for where, rec in located:
        if not isinstance(rec, dict):
            raise UsageError(f"{where}: records must be JSON objects")
    return located


def _gsm8k_row(where: str, rec: dict) -> dict:
    """A GSM8K record with a text question and an answer ending in ``#### NUMBER`` (checked before any work)."""
    text_field(rec, "question", where)
    answer = text_field(rec, "answer", where)
    try:
        gsm8k_gold(answer)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return rec


HUMANEVAL_FIELDS = ("task_id", "prompt", "test", "entry_point")


def _humaneval_row(where: str, rec: dict) -> dict:
    """A HumanEval record whose fields :data:`HUMANEVAL_FIELDS` are all text."""
    for key in HUMANEVAL_FIELDS:
        text_field(rec, key, where)
    return rec


def load_gsm8k(path: Path, limit: int | None = None) -> list[dict]:
    return [_gsm8k_row(where, rec) for where, rec in _task_records(path, limit)]


def load_humaneval(path: Path, limit: int | None = None) -> list[dict]:
    return [_humaneval_row(where, rec) for where, rec in _task_records(path, limit)]


def heldout_examples(data: str, heldout: float, limit: int | None = None) -> list:
    """The first ``limit`` held-out records of the training data ``data`` (read and checked before any work); none
    is a one-line :class:`UsageError`."""
    _, held = split_examples(read_examples(data), heldout)
    if not held:
        raise UsageError(f"no held-out records in {data} (raise --heldout)")
    return held[:limit]


# ------------------------------------------------------------------------------------------------------------------
# The tasks
# ------------------------------------------------------------------------------------------------------------------


def response_nll(hf_model, encoded, noise_length: int = 0, seed: int = 0) -> dict:
    """Teacher-forced response NLL, one record at a time (no padding, so the numbers do not depend on batching).

    Returns ``total`` (summed NLL), ``count`` (response tokens), ``per`` (per-record mean NLL), ``correct`` (top-1
    hits). With ``noise_length`` L > 0 it also measures what MSN trains: one seeded segment of L response tokens is
    replaced by ahead noise (as in ``fastforward train msn``), and the L predictions made *from* noisy inputs (each
    one's own input token is noise) are scored against the clean labels -- ``noisy_nll``/``noisy_correct``, next to
    ``clean_nll``/``clean_correct`` at the same positions of the clean forward, over ``noisy_count`` predictions.
    """
    import torch
    import torch.nn.functional as F

    out = {"total": 0.0, "count": 0, "per": [], "correct": 0,
           "noisy_nll": 0.0, "noisy_correct": 0, "clean_nll": 0.0, "clean_correct": 0, "noisy_count": 0}
    generator = torch.Generator().manual_seed(seed)
    hf_model.eval()
    with torch.inference_mode():
        for e in encoded:
            ids = torch.tensor([e.input_ids], dtype=torch.long)
            logits = hf_model(input_ids=ids, use_cache=False).logits[0].float()
            p, n = e.prompt_len, len(e.input_ids)
            nll = F.cross_entropy(logits[p - 1 : -1], ids[0, p:], reduction="sum").item()
            out["total"] += nll
            out["count"] += n - p
            out["per"].append(nll / (n - p))
            out["correct"] += int((logits[p - 1 : -1].argmax(-1) == ids[0, p:]).sum())
            if noise_length <= 0:
                continue
            start = int(random_starts(torch.tensor([p]), torch.tensor([n]), noise_length, generator)[0])
            if start < 0:
                continue
            noisy = apply_ahead_noise(ids, torch.tensor([start]), noise_length, generator)
            noisy_logits = hf_model(input_ids=noisy, use_cache=False).logits[0].float()
            span = slice(start, start + noise_length)
            labels = ids[0, start + 1 : start + noise_length + 1]
            for key, lg in (("noisy", noisy_logits[span]), ("clean", logits[span])):
                out[f"{key}_nll"] += F.cross_entropy(lg, labels, reduction="sum").item()
                out[f"{key}_correct"] += int((lg.argmax(-1) == labels).sum())
            out["noisy_count"] += noise_length
    return out


def eval_nll(target, data: str, *, heldout: float, max_length: int, limit: int | None, noise_length: int = 4,
             held: list | None = None) -> dict:
    """Held-out NLL of ``data`` (``held``: its :func:`heldout_examples`, when already read)."""
    held = heldout_examples(data, heldout, limit) if held is None else held
    encoded, dropped = encode_examples(target.tokenizer, held, max_length)
    if not encoded:
        raise UsageError(f"no held-out record fits --max-length {max_length}")
    r = response_nll(target.hf_model, encoded, noise_length)
    nll = r["total"] / r["count"]
    result = {
        "nll": nll, "ppl": math.exp(nll), "accuracy": r["correct"] / r["count"], "tokens": r["count"],
        "records": len(encoded), "dropped": dropped, "heldout": heldout, "max_length": max_length,
    }
    if r["noisy_count"]:
        k = r["noisy_count"]
        result["ahead_noise"] = {
            "noise_length": noise_length, "predictions": k,
            "noisy_accuracy": r["noisy_correct"] / k, "noisy_nll": r["noisy_nll"] / k,
            "clean_accuracy": r["clean_correct"] / k, "clean_nll": r["clean_nll"] / k,
        }
    result["samples"] = [{"index": i, "nll": v} for i, v in enumerate(r["per"])]
    return result


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation task after some items were scored: ``result`` is the task's result over those
    items (the same fields as a whole run's, ``n`` counting only them)."""

    def __init__(self, result: dict):
        super().__init__()
        self.result = result


@contextlib.contextmanager
def _keep_on_interrupt(samples: list, result):
    """A Ctrl-C inside the block becomes :class:`EvalInterrupted` with ``result()`` when ``samples`` holds any."""
    try:
        yield
    except KeyboardInterrupt:
        if not samples:
            raise
        raise EvalInterrupted(result()) from None


def is_eval_file(path) -> bool:
    """Whether ``path`` is a ``fastforward eval --save`` file (a JSON object with ``task`` and ``samples``; a long
    one by its start, ``{"task": ...``: :func:`~fastforward.paths.owned_json` reads a bounded prefix)."""
    return owned_json(path, lambda saved: isinstance(saved, dict) and "task" in saved
                      and isinstance(saved.get("samples"), list), "task")


def _generate(target, prompt, method: str, max_new_tokens: int, options: dict):
    return ff.generate(target, prompt, method, max_new_tokens=max_new_tokens, method_options=options)


def _generation_stats(results) -> dict:
    t = totals(r.stats for r in results)
    return {"new_tokens": t["new_tokens"], "tau": t["tau"], "tokens_per_s": t["tokens_per_s"]}


def eval_gsm8k(target, rows, *, method: str = "ar", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS["gsm8k"],
               options: dict | None = None, progress=iter) -> dict:
    """Accuracy on GSM8K records (``question``/``answer``), generating with ``method``; ``progress`` wraps the
    iteration over the records (e.g. a progress bar)."""
    samples, results = [], []

    def result() -> dict:
        correct = sum(s["correct"] for s in samples)
        return {"accuracy": correct / len(samples), "correct": correct, "n": len(samples),
                **_generation_stats(results), "samples": samples}

    with _keep_on_interrupt(samples, result):
        for i, row in enumerate(progress(rows)):
            res = _generate(target, row["question"], method, max_new_tokens, dict(options or {}))
            gold = gsm8k_gold(row["answer"])
            pred = extract_gsm8k_answer(res.text)
            samples.append({"index": i, "gold": gold, "pred": pred, "correct": same_number(pred, gold),
                            "output": res.text})
            results.append(res)
    return result()


def eval_humaneval(target, rows, *, method: str = "ar", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS["humaneval"],
                   options: dict | None = None, timeout: float = 10.0, progress=iter) -> dict:
    """pass@1 on HumanEval records, generating with ``method``; each program runs with ``timeout`` seconds
    (:func:`run_program`)."""
    samples, results = [], []

    def result() -> dict:
        passed = sum(s["passed"] for s in samples)
        return {"pass@1": passed / len(samples), "passed": passed, "n": len(samples),
                "network_isolated": network_namespace_available(), **_generation_stats(results), "samples": samples}

    with _keep_on_interrupt(samples, result):
        for row in progress(rows):
            res = _generate(target, humaneval_prompt(row), method, max_new_tokens, dict(options or {}))
            code = extract_code(res.text, row["entry_point"])
            passed, detail = run_program(humaneval_program(row, code), timeout=timeout)
            samples.append({"task_id": row["task_id"], "passed": passed, "detail": detail, "output": res.text})
            results.append(res)
    return result()


# ------------------------------------------------------------------------------------------------------------------
# Comparing with an earlier run, and the summary line
# ------------------------------------------------------------------------------------------------------------------


def _sample_key(task: str, sample: dict):
    return sample.get("task_id") if task == "humaneval" else sample.get("index")


def load_comparison(path: str, task: str) -> dict:
    """The samples of a previous ``--save`` file, keyed by item (GSM8K index / HumanEval task id)."""
    p = Path(path).expanduser()
    try:
        saved = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"--compare: {p} does not exist") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--compare: {p} is not a 'fastforward eval --save' file ({e})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("samples"), list):
        raise UsageError(f"--compare: {p} is not a 'fastforward eval --save' file (no samples)")
    if not all(isinstance(s, dict) for s in saved["samples"]):
        raise UsageError(f"--compare: {p} is not a 'fastforward eval --save' file (a sample is not a JSON object)")
    if saved.get("task") != task:
        raise UsageError(f"--compare: {p} holds task '{saved.get('task')}', not '{task}'")
    return {"model": saved.get("model"), "method": saved.get("method"),
            "samples": {_sample_key(task, s): s for s in saved["samples"]}}


def compare_samples(task: str, samples: list[dict], reference: dict) -> dict:
    """Agreement with a reference run on the items both hold: the same answer (GSM8K: the same extracted number;
    HumanEval: the same pass/fail verdict) and the identical output text."""
    ref = reference["samples"]
    both = [(s, ref[_sample_key(task, s)]) for s in samples if _sample_key(task, s) in ref]
    if task == "gsm8k":
        same_answer = sum(same_number(a.get("pred"), b.get("pred")) or (a.get("pred") is None and b.get("pred") is None)
                          for a, b in both)
    else:
        same_answer = sum(a.get("passed") == b.get("passed") for a, b in both)
    return {"reference_model": reference.get("model"), "reference_method": reference.get("method"), "n": len(both),
            "same_answer": same_answer, "same_output": sum(a.get("output") == b.get("output") for a, b in both)}


def summary_line(s: dict) -> str:
    if s["task"] == "nll":
        head = (f"nll {s['nll']:.4f} (ppl {s['ppl']:.2f}, top-1 {s['accuracy']:.3f}) over {s['tokens']} response "
                f"tokens of {s['records']} held-out records")
        if s.get("ahead_noise"):
            a = s["ahead_noise"]
            head += (f"; from ahead-noised inputs (L={a['noise_length']}, {a['predictions']} predictions): top-1 "
                     f"{a['noisy_accuracy']:.3f} (clean {a['clean_accuracy']:.3f}), nll {a['noisy_nll']:.3f} "
                     f"(clean {a['clean_nll']:.3f})")
    elif s["task"] == "agreement":
        head = (f"{s['kind']} drafter {s['drafter']}: held-out top-1 agreement by depth "
                + " / ".join(f"{v:.3f}" for v in s["top1"])
                + (", chain " + " / ".join(f"{v:.3f}" for v in s["chain"]) if s.get("chain") else "")
                + f" ({s['positions']} response positions of {s['records']} held-out records"
                + (f"; {s['vocab_coverage']:.3f} of their response tokens in the draft vocabulary"
                   if s.get("vocab_coverage") is not None else "") + ")")
    elif s["task"] == "gsm8k":
        head = f"gsm8k accuracy {s['accuracy']:.3f} ({s['correct']}/{s['n']})"
    else:
        head = f"humaneval pass@1 {s['pass@1']:.3f} ({s['passed']}/{s['n']})"
    tail = f"; model {s['model']}"
    if s["task"] not in ("nll", "agreement"):
        tail += f", method {s['method']} (tau {s['tau']:.2f}, {s['tokens_per_s']:.1f} tok/s)"
    agree = ""
    if s.get("agreement"):
        a = s["agreement"]
        what = "answer" if s["task"] == "gsm8k" else "verdict"
        agree = (f"; vs {a['reference_model']}: same {what} {a['same_answer']}/{a['n']}, identical text "
                 f"{a['same_output']}/{a['n']}")
    return f"{head}{tail}{agree}; {s['seconds']:.1f}s"
