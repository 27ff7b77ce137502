"""``fastforward serve``: the OpenAI-compatible server (needs the ``serve`` extra)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile

from ..api import DEFAULT_METHOD
from ..bench.serve_load import DEFAULT_METHODS
from ..errors import FastForwardError, UsageError
from ..model import DEFAULT_MODEL
from ..model.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS
from .options import (
    add_method_option_argument,
    add_model_arguments,
    model_load_kwargs,
    nonnegative_int,
    parse_options,
    positive_float,
    positive_int,
    thread_count,
)

MAX_REQUEST_SECONDS = 86400
MAX_HOSTILE = 10_000
SERVE_HINT = "install the server's dependencies with: pip install -e '.[serve]' (fastapi, uvicorn)"


def add_arguments(p, name: str) -> None:
    if name == "serve-bench":
        _add_bench_arguments(p)
        return
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the --model value)")
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help="decoding method of requests that name none (default: %(default)s; the server's auto learns "
                        "from the answers it gives, unless -o auto.learn=False)")
    add_method_option_argument(p, help="an option of --method, or of any method as METHOD.KEY=VALUE, for the "
                                       "requests that use it (under their own options): the server's files are "
                                       "named here, as a request may not name one; e.g. --method rest -o "
                                       "datastore=DIR -o sps.draft=FOLDER (repeatable)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=None, metavar="N",
                   help="rows per shared forward (default: sized from this machine's cost curve)")
    p.add_argument("--max-running", type=positive_int, default=16,
                   help="sequences decoding together (default: %(default)s)")
    p.add_argument("--max-waiting", type=positive_int, default=64,
                   help="requests queued beyond those; more get 429 (default: %(default)s)")
    p.add_argument("--max-client-requests", type=positive_int, default=None, metavar="N",
                   help="requests one client (an API key, else an address) may have in flight, decoding or waiting; "
                        "more get 429 with Retry-After (default: --max-running plus --max-client-waiting)")
    p.add_argument("--max-client-waiting", type=positive_int, default=None, metavar="N",
                   help="of those, requests one client may have waiting for a slot, so that no client can fill the "
                        "queue (default: half of --max-waiting)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="an API key clients must send (Authorization: Bearer KEY) on every path but / and /health "
                        "(repeatable; default: none, no authentication)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="a file of API keys, one a line (blank lines and # comments skipped), beside any --api-key")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of requests that give none (default: %(default)s)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096,
                   help="the largest max_tokens a request may ask for (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                   help="the largest request body; larger get 413 (default: %(default)s)")
    p.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="wall time a request may take, queueing included; then it ends with finish_reason 'length' "
                        "(default: %(default)s)")
    p.add_argument("--request-cpu-seconds", type=positive_float, default=300.0, metavar="SECONDS",
                   help="decode-loop CPU time a request may use; then it ends with finish_reason 'length' "
                        "(default: %(default)s)")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="Host header names answered beside the loopback ones, comma-separated: the names clients "
                        "(or a reverse proxy) reach this server by; '*' answers any (default: loopback only)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin (https://app.example) whose web pages may call the API (repeatable; default: "
                        "none, no CORS headers)")
    p.add_argument("--prefix-cache-tokens", type=nonnegative_int, default=DEFAULT_PREFIX_CACHE_TOKENS, metavar="N",
                   help="prompt tokens whose KV is kept so that later prompts starting the same way (a system "
                        "prompt, earlier turns) skip reading them; 0 = off (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _add_bench_arguments(p) -> None:
    p.add_argument("--url", default=None, help="an already running server (default: start one on a free loopback "
                   "port with --model and stop it at the end)")
    p.add_argument("--model", default=None, help="the model to serve (default: smollm2-135m), or with --url the "
                   "model id to request (default: the server's first)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads of the started server")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an argument for the started server (repeatable), e.g. --server-arg=--max-running=8")
    p.add_argument("--clients", type=positive_int, default=16, help="concurrent clients (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=25, help="requests per client (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="methods in rotation, comma-separated (default: %(default)s)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds one request may take (default: "
                   "%(default)s)")
    p.add_argument("--hostile", type=nonnegative_int, default=0, metavar="N",
                   help="run the many-clients phase again with N requests of the hostile corpus interleaved (bad "
                        "options, paths, wrong types, oversized bodies, foreign Host headers, the costliest valid "
                        f"requests), at most {MAX_HOSTILE}; each must get a 2xx or an OpenAI-shaped 4xx (default: 0, "
                        "no such phase)")
    p.add_argument("--hostile-kinds", default=None, metavar="KINDS",
                   help="the kinds of hostile request, comma-separated: row-hungry, longest-outputs, long-prompts "
                        "(the valid, most expensive ones), malformed (default: all)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --url: the API key the server wants (default: none; a started server gets one key "
                        "per client)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report as JSON to FILE")


def _check_url(url: str) -> str:
    """``--url`` of serve-bench, checked before anything is sent: http or https, a host, a port in [1, 65535] when
    given, no path beyond ``/`` (the server's root, not an API path); returns it as ``scheme://host[:port]``."""
    from urllib.parse import urlsplit

    example = "give the server's address, such as http://127.0.0.1:8000"
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # a ValueError when not a number or out of range
    except ValueError as exc:
        problem = "the port must be in [1, 65535]" if "out of range" in str(exc) else f"not a valid URL ({exc})"
        raise UsageError(f"--url {url!r}: {problem}; {example}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageError(f"--url {url!r} is not an http:// or https:// URL; {example}")
    if not parts.hostname:
        raise UsageError(f"--url {url!r} names no host; {example}")
    if port == 0:
        raise UsageError(f"--url {url!r}: the port must be in [1, 65535]; {example}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise UsageError(f"--url {url!r} has a path; {example} (serve-bench adds /v1/... itself)")
    return f"{parts.scheme.lower()}://{parts.netloc}"


def _run_bench(args) -> int:
    import json
    import urllib.request

    from ..bench.serve_load import format_report, free_port, run_load, start_server
    from ..proposers import available_methods

    if args.url is not None:
        args.url = _check_url(args.url)
    if args.hostile > MAX_HOSTILE:
        raise UsageError(f"--hostile must be at most {MAX_HOSTILE}, got {args.hostile}")
    kinds = _hostile_kinds(args.hostile_kinds)
    if args.api_key is not None:
        if args.url is None:
            raise UsageError("--api-key is for a server given with --url (a started server gets its own keys)")
        from ..server.auth import load_keys

        load_keys([args.api_key])
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in available_methods()]
    if not methods or unknown:
        raise UsageError(f"--methods: unknown method(s) {', '.join(unknown) or '(none given)'}; available: "
                         f"{', '.join(available_methods())}")
    proc = None
    url = args.url
    model = args.model
    keys = None if args.api_key is None else [args.api_key]
    key_dir = tempfile.TemporaryDirectory(prefix="fastforward-serve-bench-")
    try:
        if url is None:
            try:
                import fastapi  # noqa: F401
                import uvicorn  # noqa: F401
            except ModuleNotFoundError:
                raise UsageError(f"'fastforward serve-bench' starts a server, which needs fastapi and uvicorn: "
                                 f"{SERVE_HINT}") from None
            model = model or DEFAULT_MODEL
            port = free_port()
            # one key per client (the one-client phase, C clients, four hostile ones), in a file only this user
            # reads: the server's per-client limits see each client as one user; no key on a command line
            keys = [secrets.token_urlsafe(24) for _ in range(args.clients + 5)]
            key_file = os.path.join(key_dir.name, "keys")
            with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="ascii") as f:
                f.write("\n".join(keys) + "\n")
            proc = start_server(model, port, ["--api-key-file", key_file, *args.server_arg], args.threads,
                                log=lambda m: print(m, file=sys.stderr, flush=True))
            url = f"http://127.0.0.1:{port}"
        url = url.rstrip("/")
        if model is None:
            try:
                request = urllib.request.Request(url + "/v1/models", headers=(
                    {"Authorization": f"Bearer {keys[0]}"} if keys else {}))
                with urllib.request.urlopen(request, timeout=30) as r:
                    model = json.loads(r.read())["data"][0]["id"]
            except OSError as exc:
                raise UsageError(f"--url {url}: no server answers there ({exc})") from None
            except (ValueError, LookupError, TypeError):
                raise FastForwardError(f"--url {url}: the answer to GET /v1/models names no model; is it a "
                                       "fastforward (OpenAI-compatible) server? (or give --model)") from None
        report = run_load(url, model, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens,
                          methods=methods, timeout=args.timeout, log=lambda m: print(m, file=sys.stderr, flush=True),
                          server_pid=None if proc is None else proc.pid, hostile=args.hostile,
                          hostile_kinds=kinds, keys=keys)
    except FastForwardError:
        raise
    except (OSError, ValueError) as exc:  # the server went away, or answered what a server of ours does not
        where = f"--url {url}" if args.url is not None else f"the server at {url}"
        raise FastForwardError(f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:
                proc.kill()
        key_dir.cleanup()
    print(format_report(report))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    ok = report["failures"] == 0 and report["greedy_mismatches"] == 0 and report["sampled_disagreements"] == 0 \
        and not report.get("hostile", {}).get("problems")
    return 0 if ok else 1


def _hostile_kinds(text: str | None) -> tuple[str, ...]:
    """``--hostile-kinds`` as kinds of :mod:`fastforward.bench.hostile`, checked."""
    from ..bench.hostile import KINDS

    if text is None:
        return KINDS
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise UsageError(f"--hostile-kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; known: "
                         f"{', '.join(KINDS)}")
    return kinds


SERVER_METHOD_DEFAULTS = {"auto": {"learn": True}}
"""Options a server gives a method unless ``-o`` says otherwise: ``auto`` drafts from the answers it already gave
(a long-running process sees many requests alike)."""


def launch_options(pairs: list[str] | None, default_method: str) -> dict[str, dict]:
    """``-o KEY=VALUE`` (an option of ``default_method``) and ``-o METHOD.KEY=VALUE`` (an option of METHOD), as
    method -> options; each method's names are checked here, their values once the model is loaded."""
    from ..proposers import available_methods, check_method_options

    methods = available_methods()
    grouped: dict[str, list[str]] = {}
    for pair in pairs or []:
        key = pair.split("=", 1)[0]
        method, dot, rest = key.partition(".")
        if dot and method in methods:
            grouped.setdefault(method, []).append(pair[len(method) + 1:])
        elif dot and method not in methods and "/" not in key:
            raise UsageError(f"-o {pair}: '{method}' is not a method (METHOD.KEY=VALUE); available: "
                             f"{', '.join(methods)}")
        else:
            grouped.setdefault(default_method, []).append(pair)
    options = {method: parse_options(group) for method, group in grouped.items()}
    for method, defaults in SERVER_METHOD_DEFAULTS.items():
        options[method] = {**defaults, **options.get(method, {})}
    for method, opts in options.items():
        check_method_options(method, opts)
    return options


def allowed_hosts(text: str, host: str) -> tuple[str, ...]:
    """``--allowed-hosts`` as names, plus the ``--host`` address itself when it is one address (not a wildcard)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name != "*" and not all(c.isalnum() or c in ".-_:[]" for c in name):
            raise UsageError(f"--allowed-hosts: '{name}' is not a host name (letters, digits, '.', '-', ':' or '*')")
    if host not in ("0.0.0.0", "::", ""):
        names.append(host)
    return tuple(names)


def _check_serve_arguments(args) -> None:
    """Everything about ``serve``'s flags that can be refused before the (slow) model load (the API keys and the
    per-client limits are checked later, after the check that the server's packages are there, still before it)."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not args.host.strip():
        raise UsageError("--host is empty; give an address such as 127.0.0.1 (this machine only) or 0.0.0.0 (all)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name is empty: clients could not name the model")
    if args.default_max_tokens > args.max_tokens_limit:
        raise UsageError(f"--default-max-tokens {args.default_max_tokens} is above --max-tokens-limit "
                         f"{args.max_tokens_limit}")
    for flag, value in (("--request-timeout", args.request_timeout), ("--request-cpu-seconds",
                                                                       args.request_cpu_seconds)):
        if value > MAX_REQUEST_SECONDS:
            raise UsageError(f"{flag} must be at most {MAX_REQUEST_SECONDS} (a day), got {value:g}")
    for origin in args.cors_origin:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and "/" not in origin.split("://", 1)[1]):
            raise UsageError(f"--cors-origin {origin}: an origin is scheme://host[:port] (no path), or '*'")
    _check_can_listen(args.host, args.port)


def _check_can_listen(host: str, port: int) -> None:
    """The address resolves and the port is free, found out by binding it for a moment (the server binds it again
    once the model is loaded)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"--host {host}: not an address this machine can listen on ({exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a TIME_WAIT port is free
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run(args, name: str) -> int:
    if name == "serve-bench":
        return _run_bench(args)
    _check_serve_arguments(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError:
        raise UsageError(f"'fastforward serve' needs fastapi and uvicorn: {SERVE_HINT}") from None
    from ..proposers import available_methods
    from ..server.auth import load_keys
    from ..server.scheduler import check_client_limits

    if args.method not in available_methods():
        raise UsageError(f"unknown method '{args.method}'; available: {', '.join(available_methods())}")
    method_options = launch_options(args.option, args.method)  # the names now; the values once it is loaded
    api_keys = load_keys(args.api_key, args.api_key_file)
    check_client_limits(args.max_running, args.max_waiting, args.max_client_requests, args.max_client_waiting)
    hosts = allowed_hosts(args.allowed_hosts, args.host)
    import fastforward as ff

    from ..server import Limits, create_app, serve

    target = ff.load(args.model, **model_load_kwargs(args))
    limits = Limits(default_max_tokens=args.default_max_tokens, max_tokens=args.max_tokens_limit,
                    max_body_bytes=args.max_body_bytes, max_request_seconds=args.request_timeout,
                    max_request_cpu_seconds=args.request_cpu_seconds)
    model_name = args.served_model_name or args.model
    app = create_app(target, model_name=model_name, default_method=args.method, limits=limits,
                     max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                     max_waiting=args.max_waiting, prefix_cache_tokens=args.prefix_cache_tokens,
                     method_options=method_options, allowed_hosts=hosts,
                     cors_origins=tuple(args.cors_origin), api_keys=api_keys,
                     max_client_requests=args.max_client_requests, max_client_waiting=args.max_client_waiting)
    keys = f"{len(api_keys)} API key{'s' if len(api_keys) != 1 else ''}" if api_keys else "no API key"
    print(f"fastforward serve: {model_name} on http://{args.host}:{args.port} (page at /, OpenAI API at /v1, "
          f"{app.state.max_batch_tokens} rows per shared forward, {keys})", file=sys.stderr, flush=True)
    if not api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        print("fastforward serve: no API key: whoever reaches this address can generate; give --api-key or "
              "--api-key-file", file=sys.stderr, flush=True)
    if args.host in ("0.0.0.0", "::") and not args.allowed_hosts:
        print("fastforward serve: listening on every address, but answering only requests sent to a loopback name "
              "(Host: localhost, 127.0.0.1, [::1]); give --allowed-hosts with the names clients use",
              file=sys.stderr, flush=True)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
