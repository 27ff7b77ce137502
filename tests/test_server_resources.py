"""fastforward serve: the server's files are the operator's choice, never a request's (issue 42, item 2).

A request may not name a file -- a tree, a drafter, a draft model, a datastore -- nor a model: it gets a 400 (a 404
for a model the server does not serve) before the path is touched, and no error or answer shows the server's files
or its paths. The reproductions of the issue, each against a server on a tiny model; the server answers a greedy
request as before afterwards.
"""

from __future__ import annotations

import builtins
import http.client
import io
import json
import os
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import fastforward as ff  # noqa: E402
from fastforward.server import BackgroundServer, Limits, create_app  # noqa: E402
from fastforward.testing import tiny_hf_folder  # noqa: E402

MODEL = "tiny"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say something about caches, then repeat it."}]
SECRET = "TOP-SECRET-VALUE-42"


def raw(url, method, path, body=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body.encode("utf-8"), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode("utf-8")
    conn.close()
    return resp.status, text


def chat(**fields):
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("serve-resources") / "tiny")


@pytest.fixture(scope="module")
def target(folder):
    return ff.load(str(folder))


@pytest.fixture(scope="module")
def server(target):
    app = create_app(target, model_name=MODEL, max_batch_tokens=64,
                     limits=Limits(default_max_tokens=16, max_tokens=1000, max_body_bytes=64 * 1024))
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture
def secrets(tmp_path):
    """A folder of server files a request must not reach: a tree, a datastore, a drafter, a draft model."""
    root = tmp_path / "server-secrets"
    root.mkdir()
    (root / "tree.json").write_text(json.dumps([[SECRET]]))
    (root / "store.jsonl").write_text(json.dumps({"text": SECRET}) + "\n")
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text(json.dumps({"secret": SECRET}))
    (root / "draft.gguf").write_bytes(b"GGUF" + SECRET.encode())
    return root


@pytest.fixture
def untouched(monkeypatch, secrets):
    """Fails the test if the server stats or opens anything under ``secrets`` (the server runs in this process)."""
    touched = []
    marker = str(secrets)

    def watch(name, real):
        def wrapper(path, *args, **kwargs):
            if marker in os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else False:
                touched.append((name, os.fsdecode(path)))
            return real(path, *args, **kwargs)
        return wrapper

    for module, name in ((os, "stat"), (os, "lstat"), (os, "open"), (os, "listdir"), (os, "scandir"),
                         (builtins, "open"), (io, "open")):
        monkeypatch.setattr(module, name, watch(name, getattr(module, name)))
    yield touched
    monkeypatch.undo()
    assert touched == [], f"the server touched the request's path: {touched}"


def refused(server, method, options):
    got, text = raw(server, "POST", CHAT, chat(fastforward={"method": method, "options": options}))
    assert got == 400, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "fastforward.options"
    assert SECRET not in text and "Traceback" not in text
    return error["message"]


def test_tree_file_is_neither_read_nor_echoed(server, secrets, untouched):
    """Issue: tree=<any .json on the server> answered 400 bad tree choice 'TOP-SECRET-VALUE-42'."""
    path = secrets / "tree.json"
    for tree in (str(path), f"{path}:name"):
        message = refused(server, "tr-jacobi", {"tree": tree})
        assert str(secrets) not in message
        assert "tr-jacobi: option 'tree' names a file; the server's files are chosen at launch" in message
        assert "fastforward serve --method tr-jacobi -o tree=" in message


def test_tree_as_a_choices_list_still_allowed(server, target):
    """A choices list names no file: a request may still give one."""
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=8)
    got, text = raw(server, "POST", CHAT, chat(max_tokens=8, fastforward={
        "method": "tr-jacobi", "options": {"tree": [[0], [1], [0, 0]]}}))
    assert got == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == ref.text


def test_rest_datastore_file_is_refused(server, secrets, untouched):
    """Issue: rest with datastore=<any JSONL> was accepted, its statistics revealing what the file holds."""
    for store in (str(secrets / "store.jsonl"), str(secrets), "none"):
        message = refused(server, "rest", {"datastore": store, "learn": True})
        assert "rest: option 'datastore' names a file" in message and str(secrets) not in message


def test_drafter_paths_all_get_the_same_answer(server, secrets, untouched):
    """Issue: drafter paths (/root, /proc/<pid>/environ) told the client whether a file exists and its format."""
    paths = [str(secrets / "drafter"), str(secrets / "no-such-drafter"), "/root", f"/proc/{os.getpid()}/environ"]
    for method in ("eagle", "falcon", "fasteagle"):
        messages = {refused(server, method, {"drafter": p}) for p in paths}
        assert len(messages) == 1, messages
        (message,) = messages
        assert f"{method}: option 'drafter' names a file" in message and "/" not in message.split("(")[0]


def test_sps_draft_gguf_loads_nothing(server, secrets, untouched, monkeypatch):
    """Issue: sps with draft=<a .gguf path> loaded a second model: 12.9 s with every client stalled."""
    import fastforward.proposers.sps as sps

    def no_load(*args, **kwargs):
        raise AssertionError("a request made the server load a model")

    monkeypatch.setattr(sps, "load_draft", no_load)
    monkeypatch.setattr(ff, "load", no_load)
    for draft in (str(secrets / "draft.gguf"), str(secrets / "missing.gguf"), "smollm2-135m"):
        start = time.monotonic()
        message = refused(server, "sps", {"draft": draft, "k": 2})
        assert time.monotonic() - start < 2
        assert "sps: option 'draft' names a file; the server's files are chosen at launch" in message


def test_model_must_be_the_served_one(server, folder, monkeypatch):
    """A request's model names what the server serves; a path to another model is a 404, nothing loaded."""
    def no_load(*args, **kwargs):
        raise AssertionError("a request made the server load a model")

    monkeypatch.setattr(ff, "load", no_load)
    for model in (str(folder), "smollm2-135m", "/root"):
        got, text = raw(server, "POST", CHAT, chat(model=model))
        assert got == 404, text
        assert json.loads(text)["error"]["code"] == "model_not_found"


def test_rest_default_datastore_error_shows_no_server_path(server, target):
    """Issue: the rest error showed the server's absolute cache path (make-data's output for the model)."""
    from fastforward.paths import made_data_dir

    got, text = raw(server, "POST", CHAT, chat(fastforward={"method": "rest"}))
    assert got == 400, text
    message = json.loads(text)["error"]["message"]
    assert "rest: give a datastore" in message
    assert str(made_data_dir(target.name)) not in text and os.path.expanduser("~") not in text


def test_greedy_answer_unchanged_after_the_refusals(server, target, secrets):
    for method, options in (("tr-jacobi", {"tree": str(secrets / "tree.json")}),
                            ("rest", {"datastore": str(secrets / "store.jsonl")}),
                            ("eagle", {"drafter": "/root"}), ("sps", {"draft": str(secrets / "draft.gguf")})):
        raw(server, "POST", CHAT, chat(fastforward={"method": method, "options": options}))
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=12)
    got, text = raw(server, "POST", CHAT, chat(max_tokens=12))
    assert got == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == ref.text
