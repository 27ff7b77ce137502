"""fastforward serve under generated requests (issue 42, item 5): every body hypothesis makes -- fields of every JSON
type, nested, large, option values at and beyond each bound, paths, unknown fields -- and every request of the
hostile corpus gets a 2xx or an OpenAI-shaped 4xx within a time bound, never a 500; afterwards the server answers a
greedy request exactly as before. Bounded: the examples, the tokens a request may ask for, and its wall time.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastforward as ff  # noqa: E402
from fastforward.bench.hostile import SERVER_PATHS, HostileRequest, corpus  # noqa: E402
from fastforward.bench.serve_load import send_hostile  # noqa: E402
from fastforward.server import BackgroundServer, Limits, create_app  # noqa: E402
from fastforward.testing import tiny_hf_folder  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Say something about caches, then repeat it."}]
#: the most a request may take here: its own wall budget (2 s) and the time the others in flight take
SECONDS_PER_REQUEST = 30.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("serve-fuzz") / "tiny")))


@pytest.fixture(scope="module")
def server(target):
    app = create_app(target, model_name=MODEL, max_batch_tokens=64,
                     limits=Limits(default_max_tokens=8, max_tokens=32, max_body_bytes=256 * 1024,
                                   max_request_seconds=2.0))
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def greedy(target):
    return ff.generate(target, MESSAGES, "ar", max_new_tokens=12).text


def ask_greedy(url):
    status, _, problem = send_hostile(url, HostileRequest("greedy", body=json.dumps(
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}).encode()))
    return status, problem


def answered(url, request: HostileRequest):
    status, seconds, problem = send_hostile(url, request, timeout=SECONDS_PER_REQUEST + 30)
    assert not problem, (request.name, problem)
    assert status < 500 and seconds < SECONDS_PER_REQUEST, (request.name, status, seconds)
    assert not request.expect or status in request.expect, (request.name, status, request.expect)
    return status


def test_every_request_of_the_hostile_corpus(server, target, greedy):
    statuses = {}
    for request in corpus(MODEL):
        status = answered(server, request)
        statuses[status] = statuses.get(status, 0) + 1
    assert set(statuses) <= {200, 400, 404, 405, 413, 415}, statuses
    assert statuses[400] > 500  # the corpus is mostly refusals
    after = send_hostile(server, HostileRequest("greedy", body=json.dumps(
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}).encode()))
    assert after[0] == 200 and not after[2]
    _check_greedy(server, greedy)


def _check_greedy(url, text):
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}),
        headers={"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    conn.close()
    assert answer["choices"][0]["message"]["content"] == text


# -- generated bodies ------------------------------------------------------------------------------------------------
def _option_values():
    out = []
    for info in ff.available_methods().values():
        for option in info.schema:
            if option.numeric:
                cast = int if option.kind == "int" else float
                values = st.sampled_from([cast(option.low), cast(option.high), cast(option.high) + 1,
                                          cast(option.low) - 1]) | st.integers(-(2**40), 2**40)
            elif option.kind == "path":
                values = st.sampled_from(SERVER_PATHS) | st.lists(st.lists(st.integers(-3, 10**6), max_size=3),
                                                                  max_size=4)
            else:
                values = st.sampled_from(list(option.choices or ()) + [True, False, "nope", 3])
            out.append(st.fixed_dictionaries({"method": st.just(info.name),
                                               "options": st.fixed_dictionaries({option.name: values})}))
    return st.one_of(out)


json_leaf = st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) \
    | st.text(max_size=40)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 3]),
                                 "content": st.text(max_size=200) | json_value})
FIELDS = {
    "model": st.sampled_from([MODEL, MODEL, "other", "/etc/passwd", ""]) | json_value,
    "messages": st.lists(message, max_size=4) | json_value,
    "prompt": st.text(max_size=100) | st.lists(st.integers(-5, 2000), max_size=20) | json_value,
    "max_tokens": st.integers(-2, 40) | json_value,
    "temperature": st.floats(-1, 3) | json_value,
    "top_p": st.floats(-0.5, 1.5) | json_value,
    "top_k": st.integers(-2, 10**6) | json_value,
    "seed": st.integers(-(2**70), 2**70) | json_value,
    "stop": st.lists(st.text(max_size=5), max_size=6) | st.text(max_size=5) | json_value,
    "stream": st.booleans() | json_value,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_value,
    "n": st.integers(0, 3) | json_value,
    "fastforward": _option_values() | json_value,
    "unknown_field": json_value,
}
body = st.fixed_dictionaries({}, optional=FIELDS)
request = st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=request)
def test_generated_request_bodies(server, request):
    path, fields = request
    status = answered(server, HostileRequest("generated", path=path,
                                             body=json.dumps(fields, allow_nan=True).encode()))
    assert status in (200, 400, 404, 413, 415)


def test_the_server_answers_as_before_after_the_fuzzing(server, greedy):
    """Runs after the generated bodies (the tests of a file run in order)."""
    t0 = time.perf_counter()
    _check_greedy(server, greedy)
    assert time.perf_counter() - t0 < SECONDS_PER_REQUEST
