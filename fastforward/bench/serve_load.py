"""A bounded load test of ``fastforward serve`` on loopback (``fastforward serve-bench``): it stops by itself.

Two phases against one server, plain HTTP from threads (no client library in the way):

1. **one client**: one request per prompt, one after another (methods in rotation, streaming every other one);
   its greedy answers are the *solo answers* and its tokens/s the one-client throughput;
2. **C clients** at once, each sending R requests back to back: prompt ``(c + r) % P``, method
   ``(c + 2r) % M``, streaming every other one; every 8th request samples (temperature 0.8, a fixed seed) instead.

3. with ``hostile=N``: phase 2 again, with N requests of the hostile corpus (:mod:`fastforward.bench.hostile`, of
   the kinds ``hostile_kinds``) sent by four more clients, spread over the phase (none sent after it): each must
   get a 2xx or an OpenAI-shaped 4xx, and the honest requests' latency p95 and tokens/s are compared with phase
   2's, in all and per hostile kind (the honest requests that ran while a hostile request of that kind was in flight).

With ``keys`` (the server's API keys: ``fastforward serve-bench`` starts its server with one per client), every
client sends its own key: the server's per-client limits see C + 5 clients, as they would see C + 5 users.

Checked: no request failed, every greedy answer equals the solo answer of its prompt token for token (methods are
lossless and the shared forwards compute each row as alone), sampled requests with the same prompt, method and seed
agree. Reported: aggregate tokens/s of each phase and their ratio, latency p50/p95, time to first token p50/p95
(streaming requests), the server's rows per forward.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from ..errors import FastForwardError

PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "List three prime numbers greater than 50.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Give two tips for writing clear emails.",
    "Describe a cat to someone who has never seen one.",
    "What does HTTP stand for?",
    "Summarise the water cycle in three steps.",
    "Write a Python function that returns the square of a number.",
    "Name four planets of the solar system.",
    "Why is the sky blue? Keep it short.",
    "Translate 'good morning' into Spanish and German.",
    "Suggest a name for a coffee shop.",
    "What is 12 times 12? Explain the steps.",
    "Give a one-sentence definition of machine learning.",
    "Write a short motivational quote.",
    "What are the three states of matter?",
    "Describe how to boil an egg.",
    "Name two famous painters and one painting by each.",
    "What is the difference between weather and climate?",
    "Write a limerick about a programmer.",
    "How many days are in a leap year?",
    "Give three synonyms for 'happy'.",
    "Explain recursion to a child.",
    "What is photosynthesis? One paragraph.",
]

DEFAULT_METHODS = ("ar", "pld", "lookahead", "eagle", "sps", "jacobi", "tr-jacobi")


@dataclass
class Outcome:
    client: int
    index: int
    prompt: int
    method: str
    stream: bool
    sampled: bool
    ok: bool = False
    error: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None
    tau: float = 0.0
    start: float = 0.0  # perf_counter() when it was sent, and when its answer ended
    end: float = 0.0


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def send_hostile(url: str, request, timeout: float = 60.0, api_key: str | None = None) -> tuple[int, float, str]:
    """Send one :class:`~fastforward.bench.hostile.HostileRequest` (with ``api_key`` unless the request brings its
    own ``Authorization``): (status, seconds, problem); ``problem`` is empty when the answer is a 2xx or an
    OpenAI-shaped 4xx ({"error": {"message", "type", "param", "code"}}), a status 0 is a connection that failed."""
    conn = _connection(url, timeout)
    t0 = time.perf_counter()
    try:
        headers = {**(_auth(api_key) if request.keyed else {}), **request.headers}
        conn.putrequest(request.method, request.path, skip_host="Host" in headers, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(request.body)))
        conn.endheaders(request.body)
        resp = conn.getresponse()
        status, text = resp.status, resp.read()
    except Exception as exc:  # a connection reset for a body over the limit is a refusal too, but say so
        return 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    seconds = time.perf_counter() - t0
    if status >= 500:
        return status, seconds, f"HTTP {status}: {text[:200]!r}"
    if status >= 400:
        try:
            error = json.loads(text)["error"]
            assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        except Exception:
            return status, seconds, f"HTTP {status} without an OpenAI-shaped error: {text[:200]!r}"
    return status, seconds, ""


def _hostile_client(url: str, requests: list, gap: float, timeout: float, results: list, key: str | None,
                    stop: threading.Event) -> None:
    """Send ``requests`` one after another, ``gap`` seconds apart, until ``stop`` (the honest phase has ended: what
    is sent after it slows nobody who is measured)."""
    for request in requests:
        if stop.is_set():
            return
        start = time.perf_counter()
        status, seconds, problem = send_hostile(url, request, timeout, key)
        results.append({"name": request.name, "kind": request.kind, "status": status, "seconds": seconds,
                        "problem": problem, "start": start, "end": time.perf_counter()})
        stop.wait(gap)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _request(conn: http.client.HTTPConnection, model: str, prompt: str, method: str, *, stream: bool,
             max_tokens: int, sampled: bool, seed: int, timeout: float, outcome: Outcome,
             key: str | None = None) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8 if sampled else 0.0, "seed": seed,
            "fastforward": {"method": method, "token_ids": True}}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    t0 = outcome.start = time.perf_counter()
    conn.timeout = timeout
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **_auth(key)})
    resp = conn.getresponse()
    if resp.status != 200:
        outcome.error = f"HTTP {resp.status}: {resp.read().decode('utf-8', 'replace')[:300]}"
        return
    if not stream:
        record = json.loads(resp.read())
        final = record
    else:
        final = None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            record = json.loads(data)
            if "error" in record:
                outcome.error = record["error"].get("message", "error")
                resp.read()
                return
            choices = record.get("choices") or []
            if outcome.ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                outcome.ttft = time.perf_counter() - t0
            if not choices and "usage" in record:
                final = record
        resp.read()
    outcome.end = time.perf_counter()
    outcome.latency = outcome.end - t0
    if final is None:
        outcome.error = "the stream ended without the usage chunk"
        return
    ext = final.get("fastforward") or {}
    outcome.token_ids = ext.get("token_ids", [])
    outcome.tokens = final["usage"]["completion_tokens"]
    outcome.tau = (ext.get("stats") or {}).get("tau", 0.0)
    outcome.ok = True


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    """A connection to the server at ``url`` (http, or https)."""
    parsed = urlparse(url)
    kind = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    return kind(parsed.hostname, parsed.port, timeout=timeout)


def _client(url: str, model: str, jobs: list[Outcome], max_tokens: int, timeout: float,
            key: str | None = None) -> None:
    conn = _connection(url, timeout)
    for job in jobs:
        try:
            _request(conn, model, PROMPTS[job.prompt], job.method, stream=job.stream, max_tokens=max_tokens,
                     sampled=job.sampled, seed=1000 + job.prompt, timeout=timeout, outcome=job, key=key)
        except Exception as exc:  # a failure to report, not to crash the load test on
            job.error = f"{type(exc).__name__}: {exc}"
            conn.close()
            conn = _connection(url, timeout)
    conn.close()


def _key(keys: list[str] | None, client: int) -> str | None:
    """The API key of client number ``client`` (0: the one-client phase, the warm-up and /metrics; 1..C: phase 2's
    and 3's clients; then the hostile ones), the keys in turn; None without keys."""
    return keys[client % len(keys)] if keys else None


def _phase(url: str, model: str, plan: list[list[Outcome]], max_tokens: int, timeout: float,
           keys: list[str] | None = None, first_client: int = 0) -> float:
    threads = [threading.Thread(target=_client, args=(url, model, jobs, max_tokens, timeout,
                                                      _key(keys, first_client + i)), daemon=True)
               for i, jobs in enumerate(plan)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * max(1, len(plan[0])))
    return time.perf_counter() - t0


def _summary(outcomes: list[Outcome], wall: float, cpu_start=None, cpu_end=None) -> dict:
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in ok)
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    lat = [o.latency for o in ok]
    cpu = None if cpu_start is None or cpu_end is None else cpu_end - cpu_start
    return {"requests": len(outcomes), "failures": len(outcomes) - len(ok), "tokens": tokens,
            "server_cpu_s": _round(cpu), "tokens_per_cpu_s": _round(tokens / cpu) if cpu else None,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "latency_p50_s": _round(_percentile(lat, 0.5)), "latency_p95_s": _round(_percentile(lat, 0.95)),
            "ttft_p50_s": _round(_percentile(ttfts, 0.5)), "ttft_p95_s": _round(_percentile(ttfts, 0.95)),
            "mean_tau": _round(sum(o.tau for o in ok) / len(ok) if ok else None)}


def _round(x):
    return None if x is None else round(x, 3)


def _metric(url: str, name: str, key: str | None = None) -> float | None:
    conn = _connection(url, 30)
    conn.request("GET", "/metrics", headers=_auth(key))
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system, all threads) the process ``pid`` has used so far (Linux), else None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _warm_up(url: str, model: str, methods: list[str], timeout: float, key: str | None = None) -> None:
    """Every method once (drafters load on first use); a failure stops the load test."""
    for m in methods:
        warm = Outcome(-1, 0, 0, m, False, False)
        _client(url, model, [warm], 4, timeout, key)
        if not warm.ok:
            raise FastForwardError(f"the warm-up request with method {m} failed: {warm.error}")


def _forward_rows(url: str, key: str | None = None) -> tuple[float | None, float | None]:
    """The server's target forwards so far and the rows they computed (from /metrics)."""
    return (_metric(url, "fastforward_target_forwards_total", key),
            _metric(url, "fastforward_forward_rows_sum", key))


def _per_forward(f0, r0, f1, r1):
    """Rows per target forward between two readings of :func:`_forward_rows` (None without a forward)."""
    if None in (f0, r0, f1, r1) or f1 == f0:
        return None
    return round((r1 - r0) / (f1 - f0), 2)


def _many_plan(clients: int, requests: int, n_prompts: int, methods: list[str]) -> list[list[Outcome]]:
    """Phase 2's requests, per client: prompt ``(c + r) % P``, method ``(c + 2r) % M``, streaming every other
    one, every 8th sampled."""
    plan = []
    for c in range(clients):
        jobs = []
        for r in range(requests):
            p = (c + r) % n_prompts
            jobs.append(Outcome(c, r, p, methods[(c + 2 * r) % len(methods)], (c + r) % 2 == 0, r % 8 == 7))
        plan.append(jobs)
    return plan


def _greedy_mismatches(outcomes: list[Outcome], reference: dict) -> list[Outcome]:
    """The greedy requests whose tokens differ from the solo answer of their prompt."""
    return [o for o in outcomes if o.ok and not o.sampled and o.token_ids != reference.get(o.prompt)]


def _sampled_groups(outcomes: list[Outcome]) -> dict[tuple, set]:
    """The sampled answers (as token tuples) per prompt and method: one seed, so each group should hold one."""
    groups: dict[tuple, set] = {}
    for o in outcomes:
        if o.ok and o.sampled:
            groups.setdefault((o.prompt, o.method), set()).add(tuple(o.token_ids))
    return groups


def _ratio(x, y):
    return round(x / y, 3) if x and y else None


def _by_kind(results: list[dict], outcomes3: list[Outcome], many: dict, kinds) -> dict:
    """Per hostile kind: its requests, and the honest requests of phase 3 it was the main company of -- for each
    honest request, the kind with the most hostile requests in flight on average while it was (their overlap with it
    over its latency), none when no hostile request overlapped it -- how many, their latency p95 and its ratio to
    phase 2's p95; and how many requests of the kind were in flight beside an honest request on average. A
    regression shows in the kind it follows."""
    ok = [o for o in outcomes3 if o.ok and o.end > o.start]
    exposure = {kind: [] for kind in kinds}
    for o in ok:
        for kind in kinds:
            overlap = sum(max(0.0, min(o.end, r["end"]) - max(o.start, r["start"])) for r in results
                          if r["kind"] == kind)
            exposure[kind].append(overlap / (o.end - o.start))
    main = [max(kinds, key=lambda k, i=i: exposure[k][i]) if any(exposure[k][i] for k in kinds) else None
            for i in range(len(ok))]
    out = {}
    for kind in (*kinds, None):
        latencies = [o.latency for o, m in zip(ok, main, strict=True) if m == kind]
        p95 = _percentile(latencies, 0.95)
        out["none" if kind is None else kind] = {
            "hostile_requests": sum(1 for r in results if r["kind"] == kind), "honest_beside": len(latencies),
            "mean_in_flight": _round(sum(exposure[kind]) / len(ok)) if kind is not None and ok else None,
            "latency_p95_s": _round(p95), "latency_p95_ratio": _ratio(p95, many["latency_p95_s"])}
    return out


def _hostile_report(results: list[dict], honest3: dict, many: dict, outcomes3: list[Outcome] = (),
                    kinds=(), planned: int | None = None) -> dict:
    """Phase 3's hostile requests (those sent before the honest phase ended, of ``planned``): their statuses, the
    problems, the slowest, and the honest requests' latency p95 and tokens/s against phase 2's, in all and per
    hostile kind."""
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    problems = [r for r in results if r["problem"]]
    return {
        "requests": len(results), "planned": len(results) if planned is None else planned, "kinds": list(kinds),
        "by_status": dict(sorted(statuses.items())),
        "problems": len(problems), "problem_examples": [f"{r['name']}: {r['problem']}" for r in problems[:5]],
        "slowest_s": _round(max((r["seconds"] for r in results), default=None)),
        "slowest": max(results, key=lambda r: r["seconds"])["name"] if results else None,
        "honest": honest3, "latency_p95_ratio": _ratio(honest3["latency_p95_s"], many["latency_p95_s"]),
        "tokens_per_s_ratio": _ratio(honest3["tokens_per_s"], many["tokens_per_s"]),
        "by_kind": _by_kind(results, list(outcomes3), many, kinds)}


def _hostile_phase(url: str, model: str, plan: list[list[Outcome]], many: dict, many_wall: float, *,
                   hostile: int, hostile_seed: int, max_tokens: int, timeout: float, log,
                   server_pid: int | None, kinds=None, keys: list[str] | None = None) -> tuple[list[Outcome], dict]:
    """Phase 3: phase 2's requests again with ``hostile`` hostile requests (of ``kinds``) from four more clients
    spread over about phase 2's time; returns the honest outcomes and the hostile report."""
    from .hostile import KINDS, hostile_requests

    kinds = tuple(kinds or KINDS)
    plan3 = [[Outcome(o.client, o.index, o.prompt, o.method, o.stream, o.sampled) for o in jobs] for jobs in plan]
    corpus = hostile_requests(model, hostile, hostile_seed, kinds)
    shares = [corpus[i::4] for i in range(4)]
    gap = many_wall / max(1, len(shares[0]))  # spread over about the time phase 2 took
    results: list[dict] = []
    stop = threading.Event()
    # a hostile request may take the server's whole wall budget (its --request-timeout, by default this timeout):
    # its answer is awaited a minute past it
    threads = [threading.Thread(target=_hostile_client, args=(url, share, gap, timeout + 60, results,
                                                              _key(keys, 1 + len(plan) + i), stop), daemon=True)
               for i, share in enumerate(shares) if share]
    log(f"phase 3: phase 2 again with {hostile} hostile requests ({', '.join(kinds)}) interleaved ...")
    for t in threads:
        t.start()
    cpu3 = cpu_seconds(server_pid)
    wall3 = _phase(url, model, plan3, max_tokens, timeout, keys, 1)
    cpu4 = cpu_seconds(server_pid)
    outcomes3 = [o for jobs in plan3 for o in jobs]
    honest3 = _summary(outcomes3, wall3, cpu3, cpu4)
    stop.set()  # the honest phase is over: no more hostile requests are sent, those in flight are awaited
    log(f"  {honest3}")
    log(f"  honest p95 {_fmt(_ratio(honest3['latency_p95_s'], many['latency_p95_s']))}x and tok/s "
        f"{_fmt(_ratio(honest3['tokens_per_s'], many['tokens_per_s']))}x phase 2's; waiting for the hostile "
        f"requests still in flight ({len(results)} of {len(corpus)} answered) ...")
    for t in threads:
        t.join(timeout + 60)
    return outcomes3, _hostile_report(results, honest3, many, outcomes3, kinds, planned=len(corpus))


def run_load(url: str, model: str, *, clients: int = 16, requests: int = 25, max_tokens: int = 64,
             methods=DEFAULT_METHODS, timeout: float = 600.0, log=print, server_pid: int | None = None,
             hostile: int = 0, hostile_seed: int = 0, hostile_kinds=None, keys: list[str] | None = None) -> dict:
    """The phases against the server at ``url`` serving ``model``; returns the report (see the module doc).
    With the server's ``server_pid`` (a local process), each phase also reports the server's CPU seconds and tokens
    per CPU second: a measure of batching that other load on the machine does not distort as much as wall time.
    ``hostile_kinds``: the kinds of hostile request (default: all); ``keys``: API keys, the clients' in turn."""
    methods = list(methods)
    n_prompts = min(len(PROMPTS), max(requests, 1))
    key0 = _key(keys, 0)
    _warm_up(url, model, methods, timeout, key0)
    solo = [Outcome(0, i, i, methods[i % len(methods)], bool(i % 2), False) for i in range(n_prompts)]
    log(f"phase 1: 1 client x {n_prompts} requests (greedy, methods in rotation) ...")
    counts0 = _forward_rows(url, key0)
    cpu0 = cpu_seconds(server_pid)
    solo_wall = _phase(url, model, [solo], max_tokens, timeout, keys, 0)
    cpu1 = cpu_seconds(server_pid)
    counts1 = _forward_rows(url, key0)
    one = _summary(solo, solo_wall, cpu0, cpu1)
    log(f"  {one}")
    plan = _many_plan(clients, requests, n_prompts, methods)
    log(f"phase 2: {clients} clients x {requests} requests (mixed methods, streaming and not) ...")
    many_wall = _phase(url, model, plan, max_tokens, timeout, keys, 1)
    cpu2 = cpu_seconds(server_pid)
    counts2 = _forward_rows(url, key0)
    outcomes = [o for jobs in plan for o in jobs]
    many = _summary(outcomes, many_wall, cpu1, cpu2)
    log(f"  {many}")
    # checks
    reference = {o.prompt: o.token_ids for o in solo if o.ok}
    mismatches = _greedy_mismatches(outcomes, reference)
    groups = _sampled_groups(outcomes)
    sampled_disagree = [k for k, v in groups.items() if len(v) > 1]
    failures = [o for o in solo + outcomes if not o.ok]
    outcomes3: list[Outcome] = []
    if hostile:
        outcomes3, hostile_report = _hostile_phase(url, model, plan, many, many_wall, hostile=hostile,
                                                   hostile_seed=hostile_seed, max_tokens=max_tokens,
                                                   timeout=timeout, log=log, server_pid=server_pid,
                                                   kinds=hostile_kinds, keys=keys)
        mismatches += _greedy_mismatches(outcomes3, reference)
        failures += [o for o in outcomes3 if not o.ok]

    report = {
        "model": model, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
        "methods": methods, "one_client": one, "many_clients": many,
        "speedup_tokens_per_s": round(many["tokens_per_s"] / one["tokens_per_s"], 2) if one["tokens_per_s"] else None,
        "speedup_tokens_per_cpu_s": round(many["tokens_per_cpu_s"] / one["tokens_per_cpu_s"], 2)
        if one["tokens_per_cpu_s"] and many["tokens_per_cpu_s"] else None,
        "rows_per_forward_one_client": _per_forward(*counts0, *counts1),
        "rows_per_forward_many_clients": _per_forward(*counts1, *counts2),
        "failures": len(failures), "failure_examples": [f"{o.method}: {o.error}" for o in failures[:5]],
        "greedy_checked": sum(1 for o in outcomes if o.ok and not o.sampled) + sum(
            1 for o in outcomes3 if o.ok and not o.sampled),
        "greedy_mismatches": len(mismatches),
        "mismatch_examples": [asdict(o) | {"token_ids": o.token_ids[:16]} for o in mismatches[:3]],
        "sampled_groups": len(groups), "sampled_disagreements": len(sampled_disagree),
        "per_method_tau": {m: _round(sum(o.tau for o in outcomes if o.ok and o.method == m) /
                                     max(1, sum(1 for o in outcomes if o.ok and o.method == m))) for m in methods},
    }
    if hostile:
        report["hostile"] = hostile_report
    return report


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra_args=(), threads: int | None = None, log=print,
                 startup_timeout: float = 600.0) -> subprocess.Popen:
    """``fastforward serve`` in a child process (its own interpreter: the load clients never share its GIL); returns
    once ``/health`` answers."""
    cmd = [sys.executable, "-m", "fastforward.cli", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *extra_args]
    if threads:
        cmd += ["--threads", str(threads)]
    log("starting: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            raise FastForwardError(f"the server exited with code {proc.returncode} before answering (its error is "
                                   "above)")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise FastForwardError(f"the server did not answer /health within {startup_timeout:.0f} s")
        time.sleep(0.5)


def format_report(r: dict) -> str:
    one, many = r["one_client"], r["many_clients"]
    lines = [
        f"model {r['model']}: {r['clients']} clients x {r['requests_per_client']} requests, max_tokens "
        f"{r['max_tokens']}, methods {', '.join(r['methods'])}",
        f"{'':<12}{'requests':>9}{'fail':>6}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'lat p50':>9}{'lat p95':>9}"
        f"{'ttft p50':>10}{'ttft p95':>10}",
    ]
    for name, s in (("1 client", one), (f"{r['clients']} clients", many)):
        lines.append(f"{name:<12}{s['requests']:>9}{s['failures']:>6}{s['tokens']:>8}{s['wall_s']:>9}"
                     f"{s['tokens_per_s']:>9}{_fmt(s['latency_p50_s']):>9}{_fmt(s['latency_p95_s']):>9}"
                     f"{_fmt(s['ttft_p50_s']):>10}{_fmt(s['ttft_p95_s']):>10}")
    lines += [
        f"server CPU seconds: {one['server_cpu_s']} (1 client), {many['server_cpu_s']} ({r['clients']} clients); "
        f"tokens per server CPU second: {one['tokens_per_cpu_s']} vs {many['tokens_per_cpu_s']} "
        f"({r['speedup_tokens_per_cpu_s']}x)",
        f"aggregate tokens/s, {r['clients']} clients vs 1: {r['speedup_tokens_per_s']}x; rows per shared forward: "
        f"{r['rows_per_forward_one_client']} (1 client) vs {r['rows_per_forward_many_clients']} "
        f"({r['clients']} clients)",
        f"failures: {r['failures']}; greedy answers equal to the solo answer: "
        f"{r['greedy_checked'] - r['greedy_mismatches']}/{r['greedy_checked']}; seeded sampled groups that "
        f"disagree: {r['sampled_disagreements']}/{r['sampled_groups']}",
        "tau by method (many clients): " + ", ".join(f"{m} {t}" for m, t in r["per_method_tau"].items()),
    ]
    h = r.get("hostile")
    if h:
        s = h["honest"]
        lines += [
            f"with {h['requests']} hostile requests interleaved" + (
                f" (of {h['planned']}: the rest were not sent, the honest phase had ended)"
                if h.get("planned", h["requests"]) > h["requests"] else "")
            + f" ({', '.join(h.get('kinds') or ())}): honest requests "
            f"{s['requests']}, failures {s['failures']}, tok/s {s['tokens_per_s']} "
            f"({_fmt(h.get('tokens_per_s_ratio'))}x the tok/s without them), latency p50 {_fmt(s['latency_p50_s'])} "
            f"p95 {_fmt(s['latency_p95_s'])} ({_fmt(h['latency_p95_ratio'])}x the p95 without them)",
            "honest p95 by the hostile kind beside them: " + "; ".join(
                f"{kind} {_fmt(k['latency_p95_ratio'])}x ({k['honest_beside']} honest, {k['hostile_requests']} "
                f"hostile" + (f", {_fmt(k['mean_in_flight'])} in flight" if k["mean_in_flight"] is not None else "")
                + ")" for kind, k in (h.get("by_kind") or {}).items()),
            "hostile answers by status: " + ", ".join(f"{k}: {v}" for k, v in h["by_status"].items())
            + f"; not a 2xx or an OpenAI-shaped 4xx: {h['problems']}; slowest {_fmt(h['slowest_s'])} s "
              f"({h['slowest']})",
        ]
        lines += [f"  {p}" for p in h["problem_examples"]]
    return "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"
