"""Hostile requests for ``fastforward serve``: the corpus the load test (``serve-bench --hostile N``) interleaves with
honest traffic and the fuzz test starts from.

Each entry is one HTTP request a careless or hostile client could send: option values at and beyond every bound of
every method's schema, wrong JSON types in every field, paths on the server where a file or a model could be named,
unknown fields, bodies nested deep or grown large, bytes that are not JSON or not UTF-8, a ``Host`` the server was
not started for, a body a web page posts as a form. A server must answer each with a 2xx or an OpenAI-shaped 4xx,
quickly, and go on answering honest requests as before. The corpus is built in a fixed order and sampled with a
seed, so a run can be repeated.

Each request has a *kind* (:data:`KINDS`), by which the load test reports how much the honest requests that ran
beside requests of that kind were slowed, so that a regression names its cause: ``row-hungry`` (valid requests of
the methods at their widest drafts and windows, 4,096 tokens each), ``longest-outputs`` (valid requests for the
most tokens a request may ask), ``long-prompts`` (valid prompts of thousands of words) -- these three are the
*heavy* kinds: valid, and as costly as the bounds allow -- and ``malformed`` (everything else: refusals, and valid
requests of a few tokens at the options' bounds).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from urllib.parse import quote

from ..proposers import available_methods

#: the kinds of hostile request, the heavy (valid, most expensive) ones first
HEAVY_KINDS = ("row-hungry", "longest-outputs", "long-prompts")
KINDS = (*HEAVY_KINDS, "malformed")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON_HEADERS = {"Content-Type": "application/json"}

#: values a path option or ``model`` could name on the server
SERVER_PATHS = ("/etc/passwd", "/proc/self/environ", "~/.ssh/id_rsa", "../../../../etc/shadow", "/root",
                "/tmp/x.gguf", "builtin", "none", "C:\\Windows\\win.ini", "file:///etc/passwd", "", " ")
#: values of the wrong kind for any field
ODD_VALUES = (None, True, -1, 0, 10**10, -(10**10), 2**70, 1.5, 1e308, float("nan"), float("inf"), "", "x" * 300,
              "1", [], [1, 2], {}, {"a": {"b": [None]}})


@dataclass
class HostileRequest:
    """One request: what it tries (``name``) and what goes on the wire."""

    name: str
    path: str = CHAT
    body: bytes = b""
    method: str = "POST"
    headers: dict = field(default_factory=lambda: dict(JSON_HEADERS))
    expect: tuple[int, ...] = ()  # the statuses a server must answer, where only some are right
    heavy: bool = False  # valid, and as costly as the bounds allow: every draw of the corpus includes these
    kind: str = "malformed"  # one of KINDS
    keyed: bool = True  # sent with the client's API key (when it has one); False: as the request's headers say


def _body(served: str, **fields) -> bytes:
    body = {"model": served, "messages": [{"role": "user", "content": "Hello, who are you?"}], "max_tokens": 8}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not _DROP}, allow_nan=True).encode()


_DROP = object()


def _option_values(option) -> list[tuple[str, object]]:
    """(label, value) pairs at and beyond ``option``'s bounds, and of the wrong kinds."""
    out: list[tuple[str, object]] = []
    if option.numeric:
        kind = int if option.kind == "int" else float
        low, high = kind(option.low), kind(option.high)
        if high is not None:
            out += [("at its upper bound", high), ("above its upper bound", high + 1), ("far above", high * 1000)]
        if low is not None:
            below = low - 1
            while below in option.special:  # 0 of "[1, 1023] or 0" is allowed
                below -= 1
            out += [("at its lower bound", low), ("below its lower bound", below)]
        out += [("10**10", 10**10), ("negative", -(10**10)), ("a string", "7"), ("a float", 2.5), ("null", None)]
    elif option.kind == "path":
        out += [(f"the path {p!r}", p) for p in SERVER_PATHS]
        out += [("a nested list", [[["x"]]]), ("a list of numbers", [[10**9], [-1]])]
    elif option.kind == "bool":
        out += [("a string", "yes"), ("a number", 2)]
    else:
        out += [("an unknown choice", "nope"), ("a number", 7), ("a list", ["prompt"])]
    return out


#: valid requests as costly as the bounds allow, by kind: a long prompt, the widest draft of each method, the most
#: tokens
HEAVY = (
    ("long-prompts", "a 3,000-word prompt", {"messages": [{"role": "user", "content": "word " * 3000}]}),
    ("long-prompts", "a 6,000-word prompt", {"messages": [{"role": "user", "content": "word " * 6000}]}),
    ("row-hungry", "jacobi at its widest, 4,096 tokens", {"max_tokens": 4096, "fastforward": {
        "method": "jacobi", "options": {"n_tokens": 1024}}}),
    ("row-hungry", "pld at its longest drafts, 4,096 tokens", {"max_tokens": 4096, "fastforward": {
        "method": "pld", "options": {"max_ngram": 32, "num_pred_tokens": 1023, "adaptive": False}},
        "messages": [{"role": "user", "content": "Repeat this forever: the cat sat on the mat. " * 20}]}),
    ("row-hungry", "rest reading the most, 4,096 tokens", {"max_tokens": 4096, "fastforward": {
        "method": "rest", "options": {"candidates": 4096, "max_depth": 64, "nodes": 256}}}),
    ("row-hungry", "tr-jacobi at its longest chain, 4,096 tokens", {"max_tokens": 4096, "fastforward": {
        "method": "tr-jacobi", "options": {"retrieval_len": 256, "ngram": 32}}}),
    ("row-hungry", "lookahead at its widest window, 4,096 tokens", {"max_tokens": 4096, "fastforward": {
        "method": "lookahead", "options": {"window": 500, "ngram": 2, "guesses": 500}}}),
    ("row-hungry", "sps sampling its longest drafts (never cut), 4,096 tokens", {
        "max_tokens": 4096, "temperature": 0.8, "seed": 7, "fastforward": {"method": "sps", "options": {"k": 32}}}),
    ("longest-outputs", "ar, the longest answer, 4,096 tokens", {"max_tokens": 4096, "fastforward": {
        "method": "ar"}, "messages": [{"role": "user", "content": "Count from 1 to 5000, one number a line."}]}),
)


def corpus(model: str) -> list[HostileRequest]:
    """Every hostile request, in a fixed order (``model`` is the id the server serves)."""
    reqs: list[HostileRequest] = []
    add = reqs.append
    for kind, name, fields in HEAVY:
        add(HostileRequest(name, body=_body(model, **fields), heavy=True, kind=kind))
    # every option of every method, at and beyond its bounds
    for info in available_methods().values():
        for option in info.schema:
            for label, value in _option_values(option):
                refused = "above" in label or "below" in label or "names the path" in label
                add(HostileRequest(f"{info.name}.{option.name} {label}", body=_body(
                    model, fastforward={"method": info.name, "options": {option.name: value}}),
                    expect=(400,) if refused else ()))
        add(HostileRequest(f"{info.name} with an unknown option", body=_body(
            model, fastforward={"method": info.name, "options": {"warp": 1}})))
    # every field with values of the wrong kind
    for name in ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                 "seed", "stop", "stream", "stream_options", "n", "logprobs", "response_format", "fastforward"):
        for value in ODD_VALUES:
            add(HostileRequest(f"{name} = {str(value)[:20]}", body=_body(model, **{name: value})))
    # names of things on the server
    for p in SERVER_PATHS:
        add(HostileRequest(f"model {p!r}", body=_body(model, model=p), expect=(400, 404)))
        add(HostileRequest(f"GET /v1/models/{p}", path="/v1/models/" + quote(p.lstrip("/")), method="GET",
                           body=b"", expect=(404,)))
    # shapes and sizes
    add(HostileRequest("deeply nested body", body=b"[" * 200_000 + b"]" * 200_000))
    add(HostileRequest("deeply nested option", body=_body(model, fastforward={
        "method": "pld", "options": {"max_ngram": json.loads("[" * 500 + "]" * 500)}})))
    add(HostileRequest("a thousand unknown fields", body=_body(model, **{f"field{i}": i for i in range(1000)})))
    add(HostileRequest("a thousand messages", body=_body(model, messages=[{"role": "user", "content": "hi"}] * 1000)))
    add(HostileRequest("a prompt longer than the context", body=_body(
        model, messages=[{"role": "user", "content": "word " * 60_000}])))
    add(HostileRequest("a body over the size limit", body=_body(model, messages=[
        {"role": "user", "content": "y" * (2 << 20)}]), expect=(413,)))
    add(HostileRequest("max_tokens at a million", body=_body(model, max_tokens=1_000_000)))
    add(HostileRequest("stop: a thousand strings", body=_body(model, stop=["a"] * 1000)))
    add(HostileRequest("stop: one long string", body=_body(model, stop="z" * 100_000)))
    add(HostileRequest("control characters", body=_body(model, messages=[
        {"role": "user", "content": "\x00\x01\x1b[31m\u202e\ufeff"}])))
    add(HostileRequest("completion with negative token ids", path=COMPLETIONS, body=_body(
        model, messages=_DROP, prompt=[-1, -2, 2**40])))
    add(HostileRequest("completion with a huge token list", path=COMPLETIONS, body=_body(
        model, messages=_DROP, prompt=list(range(50_000)))))
    # bytes that are not what they claim
    add(HostileRequest("not JSON", body=b"{'model': 1"))
    add(HostileRequest("not UTF-8", body=b'{"model": "\xff\xfe"}'))
    add(HostileRequest("empty body", body=b""))
    add(HostileRequest("NaN temperature", body=b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                               b'"temperature": NaN}' % model.encode()))
    # keys: no key, a wrong one, another scheme (a 401 from a server with keys; what the body asks otherwise)
    add(HostileRequest("no API key", body=_body(model), keyed=False))
    add(HostileRequest("a wrong API key", body=_body(model), keyed=False,
                       headers={**JSON_HEADERS, "Authorization": "Bearer sk-not-a-key-of-this-server"}))
    add(HostileRequest("an Authorization header of another scheme", body=_body(model), keyed=False,
                       headers={**JSON_HEADERS, "Authorization": "Basic dXNlcjpwYXNz"}))
    add(HostileRequest("an empty Bearer token", body=_body(model), keyed=False,
                       headers={**JSON_HEADERS, "Authorization": "Bearer "}))
    # what a web page can make a browser send
    add(HostileRequest("a form post", body=b"model=x&messages=hi",
                       headers={"Content-Type": "application/x-www-form-urlencoded"}, expect=(415,)))
    add(HostileRequest("a text/plain post", body=_body(model), headers={"Content-Type": "text/plain"},
                       expect=(415,)))
    add(HostileRequest("no Content-Type", body=_body(model), headers={}, expect=(415,)))
    add(HostileRequest("a rebound Host", body=_body(model), headers={**JSON_HEADERS, "Host": "attacker.example"},
                       expect=(400,)))
    add(HostileRequest("a rebound Host reading /v1/models", path="/v1/models", method="GET",
                       headers={"Host": "attacker.example:8000"}, expect=(400,)))
    # routes and verbs
    add(HostileRequest("an unknown route", path="/v1/engines/x/completions", body=_body(model)))
    add(HostileRequest("a long path", path="/" + "a" * 4000, method="GET", body=b""))
    add(HostileRequest("DELETE a model", path="/v1/models/" + model, method="DELETE", body=b""))
    add(HostileRequest("PUT the chat endpoint", method="PUT", body=_body(model)))
    return reqs


def hostile_requests(model: str, count: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[HostileRequest]:
    """``count`` requests of ``kinds`` drawn from :func:`corpus` with ``seed``, in shuffled order: the heavy ones
    always (as many as fit), the others each once before any repeats (with heavy kinds only: the heavy ones again)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown hostile kind(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(KINDS)}")
    every = [r for r in corpus(model) if r.kind in kinds]
    rng = random.Random(seed)
    heavy = [r for r in every if r.heavy][:count]
    light = [r for r in every if not r.heavy] or heavy
    out: list[HostileRequest] = []
    while len(out) < count - len(heavy):
        batch = list(light)
        rng.shuffle(batch)
        out += batch[:count - len(heavy) - len(out)]
    out += heavy
    rng.shuffle(out)
    return out
