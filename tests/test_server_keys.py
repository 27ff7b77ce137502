"""fastforward serve with API keys (``--api-key``, ``--api-key-file``) and per-client limits
(``--max-client-requests``, ``--max-client-waiting``).

With keys, every path but the page and ``/health`` answers an OpenAI-shaped 401 without a key, with a wrong one or
with a malformed ``Authorization`` header; the ``openai`` client with the key works; the key never shows in the
server's log (access log included), its error messages or its metrics. Over a client's limit the server answers an
OpenAI-shaped 429 with ``Retry-After``, and admits the client again once it is back under it. The command line
refuses bad keys and key files in one line, before the model loads.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import fastforward as ff  # noqa: E402
from fastforward.errors import UsageError  # noqa: E402
from fastforward.server import BackgroundServer, Limits, create_app  # noqa: E402
from fastforward.server.auth import APIKeys, load_keys  # noqa: E402
from fastforward.server.scheduler import check_client_limits  # noqa: E402
from fastforward.testing import tiny_hf_folder  # noqa: E402

MODEL = "tiny"
KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say something about caches, then repeat it."}]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("serve-keys") / "tiny")))


@pytest.fixture(scope="module")
def server(target):
    app = create_app(target, model_name=MODEL, max_batch_tokens=64, api_keys=KEYS,
                     limits=Limits(default_max_tokens=8, max_tokens=1000))
    with BackgroundServer(app, log_level="info") as url:
        yield url


def request(url, method, path, body=None, headers=None, source="127.0.0.1"):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    conn.putrequest(method, path, skip_accept_encoding=True)
    for name, value in (headers or {}).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            conn.putheader(name, v)
    data = None if body is None else body.encode()
    if data is not None:
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data)
    resp = conn.getresponse()
    text = resp.read().decode("utf-8")
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, text


def chat(**fields):
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields})


ROUTES = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None), ("POST", CHAT, chat()),
          ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "caches", "max_tokens": 4})),
          ("GET", "/v1/no-such-route", None), ("GET", "/metrics", None)]
BAD_AUTH = {"no header": None, "a wrong key": "Bearer sk-wrong", "another scheme": f"Basic {KEYS[0]}",
            "no scheme": KEYS[0], "an empty token": "Bearer ", "a key and more": f"Bearer {KEYS[0]} x",
            "a key with a suffix": f"Bearer {KEYS[0]}x", "a prefix of a key": f"Bearer {KEYS[0][:-1]}",
            "two headers": [f"Bearer {KEYS[0]}", f"Bearer {KEYS[1]}"]}


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("case", list(BAD_AUTH))
def test_every_route_needs_a_key(server, method, path, body, case):
    value = BAD_AUTH[case]
    status, headers, text = request(server, method, path, body, None if value is None else {"Authorization": value})
    assert status == 401, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert headers["www-authenticate"] == "Bearer"
    assert not any(key in text for key in KEYS) and "sk-wrong" not in text  # never echoed


@pytest.mark.parametrize("key", KEYS)
def test_each_key_opens_every_route(server, key):
    for method, path, body in ROUTES[:4] + ROUTES[5:]:
        status, _, text = request(server, method, path, body, {"Authorization": f"Bearer {key}"})
        assert status == 200, (path, text)
    assert request(server, "GET", "/v1/no-such-route", None, {"Authorization": f"bearer  {key}"})[0] == 404


def test_the_page_and_health_stay_open(server):
    assert request(server, "GET", "/health")[0] == 200
    status, _, page = request(server, "GET", "/")
    assert status == 200 and "<html" in page


def test_the_openai_client_with_the_key(server, target):
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=8)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == ref.text
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == ref.text
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        wrong.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)


def test_keys_are_never_logged_or_counted(server, caplog):
    # uvicorn sets its access logger's level at every server's start (another test's server may have left it at
    # WARNING): the access log is turned on here, not assumed
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.INFO, logger="uvicorn.access"):
        for key in (*KEYS, "sk-wrong-key-xyz"):
            request(server, "POST", CHAT, chat(temprature=1), {"Authorization": f"Bearer {key}"})
            request(server, "GET", "/v1/models", None, {"Authorization": f"Bearer {key}"})
        request(server, "GET", "/v1/models?api_key=sk-in-a-query", None)  # keys are taken from the header only
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "GET /v1/models" in logged  # the access log was captured
    for key in (*KEYS, "sk-wrong-key-xyz"):
        assert key not in logged
    _, _, metrics = request(server, "GET", "/metrics", None, {"Authorization": f"Bearer {KEYS[0]}"})
    assert 'code="401"' in metrics and not any(key in metrics for key in KEYS)


def test_keys_compare_every_key():
    keys = APIKeys(["a-key", "b-key", "c-key"])
    assert keys.client([b"Bearer c-key"]) == (3, "")
    assert keys.client([b"BEARER a-key"]) == (1, "")
    assert keys.client([b"Bearer a-keyx"])[0] is None and keys.client([b"Bearer"])[0] is None
    assert keys.client([])[1].startswith("no API key")


# -- the command line: bad keys and key files, before the model loads ------------------------------------------------
def test_load_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nsk-one\n\n  sk-two \r\nsk-one\n")
    assert load_keys(["sk-zero"], str(path)) == ("sk-zero", "sk-one", "sk-two")


@pytest.mark.parametrize("content,fragment", [
    (b"", "holds no key"), (b"# only a comment\n\n", "holds no key"), (b"sk-one\nsk two\n", "line 2"),
    (b"sk-\xc3\xa9\n", "line 1 holds a byte that is not ASCII"), (b"x" * 600 + b"\n", "longer than 512"),
    (b"ok\n\x01bad\n", "line 2"),
])
def test_bad_key_files_are_one_line_errors(tmp_path, content, fragment):
    path = tmp_path / "keys"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=fragment) as info:
        load_keys([], str(path))
    message = str(info.value)
    assert "\n" not in message and "sk two" not in message and "bad" not in message.split(":")[-1]


@pytest.mark.parametrize("argv,fragment", [
    (["serve", "--api-key-file", "/no/such/keys"], "--api-key-file /no/such/keys: no such file"),
    (["serve", "--api-key-file", "."], "not a regular file"),
    (["serve", "--api-key", ""], "--api-key (the first one) is empty"),
    (["serve", "--api-key", "ok", "--api-key", "has space"], "--api-key (the second one) holds a space"),
    (["serve", "--max-client-requests", "0"], "positive"),
    (["serve", "--max-client-waiting", "100"], "--max-client-waiting must be an integer in [1, 64]"),
    (["serve", "--max-client-requests", "1000"], "--max-client-requests must be an integer in [1, 80]"),
    (["serve-bench", "--api-key", "k"], "--api-key is for a server given with --url"),
    (["serve-bench", "--hostile-kinds", "row-hungry,nope"], "--hostile-kinds: unknown kind(s) nope"),
])
def test_serve_refuses_bad_keys_and_limits_before_loading(capsys, monkeypatch, argv, fragment):
    import fastforward

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(fastforward, "load", no_load)
    from fastforward.cli import main

    assert main([*argv, "--port", "0"] if argv[0] == "serve" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err
    assert "has space" not in err


def test_a_key_file_with_a_key_prints_no_key(tmp_path, capsys, monkeypatch):
    """The keys are read before the load; the start-up line counts them and never shows one."""
    import fastforward

    path = tmp_path / "keys"
    path.write_text("sk-secret-one\nsk-secret-two\n")

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(fastforward, "load", stop)
    from fastforward.cli import main

    assert main(["serve", "--api-key-file", str(path), "--port", "0"]) != 0
    out = capsys.readouterr()
    assert "Loaded" in out.err  # it got as far as the load
    assert "sk-secret" not in out.out + out.err


def test_client_limits_defaults_and_bounds():
    assert check_client_limits(16, 64, None, None) == (48, 32)
    assert check_client_limits(4, 1, None, None) == (5, 1)
    with pytest.raises(UsageError, match=r"--max-client-waiting must be an integer in \[1, 8\]"):
        check_client_limits(16, 8, None, 9)


# -- per-client limits -----------------------------------------------------------------------------------------------
def slowed(target, monkeypatch, seconds=0.02):
    forward_many = target.forward_many

    def slow_forward_many(*args, **kwargs):
        time.sleep(seconds)
        return forward_many(*args, **kwargs)

    monkeypatch.setattr(target, "forward_many", slow_forward_many)


def start_long(url, headers, max_tokens=200):
    """A streamed request that is decoding when this returns; (connection, response) to read it to the end."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", CHAT, body=chat(max_tokens=max_tokens, stream=True,
                                         messages=[{"role": "user", "content": "go"}]),
                 headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # its first event: it is decoding now
    return conn, resp


def test_over_the_client_limit_a_429_with_retry_after_then_admitted_again(target, monkeypatch):
    slowed(target, monkeypatch)
    app = create_app(target, model_name=MODEL, max_batch_tokens=64, api_keys=KEYS, max_client_requests=1,
                     limits=Limits(max_tokens=1000))
    first = {"Authorization": f"Bearer {KEYS[0]}"}
    with BackgroundServer(app) as url:
        conn, resp = start_long(url, first)
        status, headers, text = request(url, "POST", CHAT, chat(), first)
        assert status == 429, text
        error = json.loads(text)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "requests in flight" in error["message"] and KEYS[0] not in text
        retry = int(headers["retry-after"])
        assert 1 <= retry <= 60
        # another client (the other key) is not held back by the first one's limit
        assert request(url, "POST", CHAT, chat(), {"Authorization": f"Bearer {KEYS[1]}"})[0] == 200
        resp.read()  # the first request ends ...
        conn.close()
        time.sleep(retry)  # ... and after Retry-After the client is admitted again
        status, _, text = request(url, "POST", CHAT, chat(), first)
        assert status == 200, text
        # the openai client honours Retry-After by itself
        conn, resp = start_long(url, first, max_tokens=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[0], max_retries=3, timeout=120)
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("length", "stop")
        resp.read()
        conn.close()


def test_one_client_cannot_fill_the_queue(target, monkeypatch):
    """One slot, four places in the queue, at most two of them one client's (no keys: clients by address): the
    third waiting request of 127.0.0.1 is a 429, while 127.0.0.2 still gets a place; all are answered."""
    slowed(target, monkeypatch)
    app = create_app(target, model_name=MODEL, max_batch_tokens=64, max_running=1, max_waiting=4,
                     max_client_requests=5, max_client_waiting=2, limits=Limits(max_tokens=1000))
    with BackgroundServer(app) as url:
        conn, resp = start_long(url, {})  # holds the one slot
        answers = []

        def wait_in_queue(source):
            answers.append(request(url, "POST", CHAT, chat(), {}, source)[0])

        threads = [threading.Thread(target=wait_in_queue, args=("127.0.0.1",)) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while app.state.scheduler.metrics.waiting < 2:
            assert time.monotonic() < deadline, "the two requests never queued"
            time.sleep(0.02)
        status, headers, text = request(url, "POST", CHAT, chat(), {})
        assert status == 429 and "waiting for a slot" in json.loads(text)["error"]["message"], text
        assert int(headers["retry-after"]) >= 1
        threads.append(threading.Thread(target=wait_in_queue, args=("127.0.0.2",)))
        threads[-1].start()
        while app.state.scheduler.metrics.waiting < 3:
            assert time.monotonic() < deadline, "the other address's request never queued"
            time.sleep(0.02)
        resp.read()
        conn.close()
        for t in threads:
            t.join(60)
        assert answers == [200, 200, 200]


def test_admission_takes_the_client_with_the_fewest_running(target):
    """The decode loop admits, among the waiting requests, one of the client with the fewest requests decoding:
    a client's burst does not keep another client's request waiting."""
    import asyncio

    from fastforward.server.scheduler import Scheduler
    from fastforward.server.schemas import parse

    def parsed():
        return parse("chat", json.loads(chat(max_tokens=50)), served=(MODEL,), default_method="ar", limits=Limits())

    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(target, max_batch_tokens=64, max_running=2, max_waiting=8, max_client_requests=8)
        burst = [scheduler.submit(parsed(), loop, client="a") for _ in range(4)]
        late = scheduler.submit(parsed(), loop, client="b")
        scheduler.round()
        assert burst[0].admitted and late.admitted and not burst[1].admitted
        assert scheduler._running_by == {"a": 1, "b": 1} and scheduler._waiting_by == {"a": 3}
        while scheduler._active or scheduler._pending:
            scheduler.round()
        assert all(t.done for t in [*burst, late]) and not scheduler._running_by and not scheduler._waiting_by
    finally:
        loop.close()


def test_the_load_test_sends_each_client_its_key(server):
    """serve-bench against a server with keys: every honest and hostile client sends its key (no failure: without
    one every request would be a 401), and the report names the kinds drawn."""
    from fastforward.bench.serve_load import run_load

    report = run_load(server, MODEL, clients=2, requests=2, max_tokens=4, methods=["ar", "pld"], hostile=12,
                      hostile_kinds=("malformed",), keys=list(KEYS), log=lambda message: None)
    assert report["failures"] == 0 and report["greedy_mismatches"] == 0
    hostile = report["hostile"]
    assert hostile["problems"] == 0 and hostile["kinds"] == ["malformed"]
    assert set(hostile["by_kind"]) == {"malformed", "none"}
