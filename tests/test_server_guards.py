"""fastforward serve: requests a browser sends for a web page, metrics that cannot grow, budgets per request, and
the body fields the server ignores (issue 42, items 3, 4 and 6).

The reproductions of the issue, each against a server on a tiny model in this process: a page on another site can
neither reach the loopback server by rebinding its name (the ``Host`` check) nor post a body that needs no
preflight (``text/plain``, forms: 415), and gets no CORS header unless the operator names its origin; 300 random
model names add no metrics series; a request past its CPU or wall budget ends with ``finish_reason: "length"``
while the server keeps serving; unknown body fields are ignored and listed in a header.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import uuid

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import fastforward as ff  # noqa: E402
from fastforward.server import BackgroundServer, Limits, create_app  # noqa: E402
from fastforward.server.app import host_name, metrics_endpoint  # noqa: E402
from fastforward.testing import tiny_hf_folder  # noqa: E402

MODEL = "tiny"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say something about caches, then repeat it."}]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("serve-guards") / "tiny")))


def make_app(target, **kw):
    kw.setdefault("limits", Limits(default_max_tokens=16, max_tokens=1000, max_body_bytes=64 * 1024))
    return create_app(target, model_name=MODEL, max_batch_tokens=64, **kw)


@pytest.fixture(scope="module")
def server(target):
    with BackgroundServer(make_app(target)) as url:
        yield url


def request(url, method, path, body=None, headers=None):
    """(status, headers, text); ``headers`` replace the defaults (``Host`` included when given)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = dict(headers or {})
    skip_host = "Host" in headers
    conn.putrequest(method, path, skip_host=skip_host, skip_accept_encoding=True)
    for name, value in headers.items():
        conn.putheader(name, value)
    data = body.encode() if isinstance(body, str) else body
    if data is not None:
        conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data)
    resp = conn.getresponse()
    text = resp.read().decode("utf-8")
    conn.close()
    return resp.status, dict(resp.getheaders()), text


def chat(**fields):
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields})


def openai_error(text, status_code=None):
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in text
    return error


# -- Host: DNS rebinding ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,method,body", [("/", "GET", None), ("/v1/models", "GET", None),
                                              ("/metrics", "GET", None), (CHAT, "POST", chat())])
def test_a_host_the_server_was_not_started_for_is_refused(server, path, method, body):
    """Issue: no Host check, so a page that rebinds its own name to 127.0.0.1 reads the answers."""
    status, _, text = request(server, method, path, body, {"Host": "attacker.example:8000", **JSON})
    assert status == 400, text
    error = openai_error(text)
    assert error["code"] == "host_not_allowed" and "'attacker.example:8000'" in error["message"]
    assert "--allowed-hosts" in error["message"]


def test_loopback_names_are_answered(server):
    port = server.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.1"):
        status, _, text = request(server, "POST", CHAT, chat(), {"Host": host, **JSON})
        assert status == 200, (host, text)


def test_no_host_header_is_refused(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and b"host_not_allowed" in body


def test_allowed_hosts_extend_the_loopback_names(target):
    with BackgroundServer(make_app(target, allowed_hosts=("my-box.lan",))) as url:
        assert request(url, "POST", CHAT, chat(), {"Host": "my-box.lan:8000", **JSON})[0] == 200
        assert request(url, "POST", CHAT, chat(), {"Host": "other.lan", **JSON})[0] == 400
    with BackgroundServer(make_app(target, allowed_hosts=("*",))) as url:
        assert request(url, "GET", "/v1/models", None, {"Host": "anything.example"})[0] == 200


def test_host_name():
    assert host_name("LocalHost:8000") == "localhost" and host_name("[::1]:80") == "::1"
    assert host_name("::1") == "::1" and host_name("example.com") == "example.com"


# -- Content-Type: posts a page can send without a preflight ------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_generation_takes_only_json_bodies(server, content_type):
    """Issue: text/plain bodies were accepted, so any web page could post them cross-origin."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, _, text = request(server, "POST", CHAT, chat(), headers)
    assert status == 415, text
    error = openai_error(text)
    assert error["code"] == "unsupported_media_type" and "must be application/json" in error["message"]


def test_json_with_a_charset_is_json(server):
    status, _, text = request(server, "POST", CHAT, chat(), {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, text


# -- CORS ------------------------------------------------------------------------------------------------------------
def preflight(url, origin):
    return request(url, "OPTIONS", CHAT, None, {"Origin": origin, "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "content-type"})


def test_no_cors_unless_asked(server):
    status, headers, _ = preflight(server, "https://evil.example")
    assert status >= 400 and not any(h.lower().startswith("access-control") for h in headers)
    _, headers, _ = request(server, "POST", CHAT, chat(), {"Origin": "https://evil.example", **JSON})
    assert not any(h.lower().startswith("access-control") for h in headers)


def test_cors_origin_given_at_launch(target):
    with BackgroundServer(make_app(target, cors_origins=("https://app.example",))) as url:
        status, headers, _ = preflight(url, "https://app.example")
        assert status == 200 and headers.get("access-control-allow-origin") == "https://app.example"
        _, headers, _ = preflight(url, "https://evil.example")
        assert headers.get("access-control-allow-origin") != "https://evil.example"
        status, headers, _ = request(url, "POST", CHAT, chat(), {"Origin": "https://app.example", **JSON})
        assert status == 200 and headers.get("access-control-allow-origin") == "https://app.example"


# -- metrics ---------------------------------------------------------------------------------------------------------
def series(url):
    _, _, text = request(url, "GET", "/metrics")
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_label_only_known_endpoints(server):
    """Issue: 300 GETs of /v1/models/<random> made 302 new fastforward_http_requests_total series."""
    before = series(server)
    for _ in range(300):
        assert request(server, "GET", f"/v1/models/{uuid.uuid4().hex}")[0] == 404
        request(server, "POST", f"/v1/{uuid.uuid4().hex}", "{}", JSON)
    new = series(server) - before
    assert len(new) <= 2, new
    assert all(re.search(r'endpoint="(/v1/models/\{model\}|other)"', s) for s in new), new


def test_metrics_endpoint():
    assert metrics_endpoint("/v1/chat/completions") == "/v1/chat/completions"
    assert metrics_endpoint("/v1/models/x") == "/v1/models/{model}" and metrics_endpoint("/x") == "other"


# -- budgets per request ---------------------------------------------------------------------------------------------
def test_a_request_past_its_cpu_budget_ends_with_length(target):
    app = make_app(target, limits=Limits(max_tokens=1000, max_request_cpu_seconds=1e-6))
    with BackgroundServer(app) as url:
        for method in ("ar", "jacobi"):
            status, _, text = request(url, "POST", CHAT, chat(max_tokens=200, fastforward={"method": method}),
                                      JSON)
            answer = json.loads(text)
            assert status == 200, text
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["fastforward"]["stats"]["ended_by"] == "cpu budget"
            assert answer["usage"]["completion_tokens"] < 200


def test_a_request_past_its_wall_budget_ends_and_the_server_keeps_serving(target):
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=8)
    app = make_app(target, limits=Limits(max_tokens=1000, max_request_seconds=0.3))
    with BackgroundServer(app) as url:
        status, _, text = request(url, "POST", CHAT, chat(max_tokens=1000, fastforward={
            "method": "jacobi", "options": {"n_tokens": 200}}), JSON)
        answer = json.loads(text)
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length", text
        assert answer["fastforward"]["stats"]["ended_by"] == "wall budget"
        status, _, text = request(url, "POST", CHAT, chat(max_tokens=8), JSON)
        assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == ref.text


def test_a_large_step_sits_out_rounds_and_changes_nothing(target):
    """A Jacobi window of 300 rows (more than the 64 rows of a shared forward) steps once per 5 rounds beside an AR
    request; both answer what they answer alone."""
    from concurrent.futures import ThreadPoolExecutor

    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=24)
    with BackgroundServer(make_app(target)) as url:
        bodies = [chat(max_tokens=24, fastforward={"method": "jacobi", "options": {"n_tokens": 300},
                                                    "token_ids": True}),
                  chat(max_tokens=24, fastforward={"token_ids": True})]
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda b: request(url, "POST", CHAT, b, JSON), bodies))
    for status, _, text in answers:
        assert status == 200, text
        assert json.loads(text)["fastforward"]["token_ids"] == ref.token_ids


# -- unknown body fields ---------------------------------------------------------------------------------------------
def test_unknown_body_fields_are_ignored_and_listed(server, caplog):
    """Issue: the server silently ignored unknown body fields. It still ignores them (as OpenAI's servers do) and
    lists them in the X-FastForward-Ignored-Fields header and the log."""
    for stream in (False, True):
        status, headers, text = request(server, "POST", CHAT, chat(stream=stream, temprature=0.5, user="u1"), JSON)
        assert status == 200, text
        assert headers["x-fastforward-ignored-fields"] == "temprature, user"
    status, headers, _ = request(server, "POST", CHAT, chat(), JSON)
    assert status == 200 and "x-fastforward-ignored-fields" not in headers


def test_many_or_odd_unknown_fields_make_a_safe_header(server):
    fields = {f"f{i:02d}": i for i in range(40)} | {"bad\nname,é": 1}
    status, headers, text = request(server, "POST", CHAT, chat(**fields), JSON)
    assert status == 200, text
    listed = headers["x-fastforward-ignored-fields"]
    assert listed.endswith("+25 more") and listed.isascii() and "\n" not in listed
