"""The HTTP face of ``fastforward serve``: OpenAI-compatible endpoints over the :class:`Scheduler`.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events ending
in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text) and the page at ``/``. Every error is
OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 bad input (a ``Host`` the server was
not started for included), 401 no or a wrong API key (when the server has keys, :mod:`.auth`), 404 unknown model,
method or route, 413 body too large, 415 a body not sent as JSON, 429 the queue or the client's share of it full
(with ``Retry-After``), 500 a bug (never a traceback in the body; the log has it).

Requests a web page makes a browser send are kept out (see docs/serving.md, Security): the ``Host`` header must name
the server (loopback names unless ``allowed_hosts`` says more: DNS rebinding), generation endpoints take only
``Content-Type: application/json`` (a page's form or ``text/plain`` post, which needs no preflight), and no CORS
header is sent unless ``cors_origins`` names the origins that may call the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import DEFAULT_METHOD, batch_token_budget
from ..model.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS
from ..proposers import available_methods, make_proposer
from ..version import __version__
from .auth import APIKeys, needs_key
from .metrics import Metrics
from .page import PAGE
from .scheduler import Scheduler
from .schemas import IGNORED_FIELDS_HEADER, APIError, Limits, ParsedRequest, parse, without_server_paths

log = logging.getLogger("fastforward.server")

#: the ``Host`` names a server answers by default: this machine's loopback names
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: the endpoints ``/metrics`` counts by name; any other path is counted as ``other``
ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")

#: how often (seconds) a non-streaming request asks whether its client is still connected
DISCONNECT_CHECK_SECONDS = 0.25


def _json_safe(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _public(value):
    """``value`` as JSON a client may see: every string without the server's paths (a launch option's file, a
    statistic naming the tree or draft model used)."""
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_public(v) for v in value]
    value = _json_safe(value)
    return without_server_paths(value) if isinstance(value, str) else value


def host_name(host_header: str) -> str:
    """The name in a ``Host`` header, lower-cased, without its port: ``[::1]:8000`` -> ``::1``."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def metrics_endpoint(path: str) -> str:
    """The ``endpoint`` label of ``path`` in ``/metrics``: a known route, or ``other`` (a label per random path
    would grow the metrics without bound)."""
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class ServerState:
    """What the handlers share, kept on ``app.state.server``: the model and the names it is served under, the
    launch settings (default method, launch options, limits, answered hosts), the metrics and the scheduler.
    Building it checks the settings (see :func:`create_app`)."""

    def __init__(self, target, *, model_name: str, default_method: str, limits: Limits | None,
                 max_batch_tokens: int | None, max_running: int, max_waiting: int, aliases: tuple[str, ...],
                 prefix_cache_tokens: int, default_options: dict | None, method_options: dict[str, dict] | None,
                 allowed_hosts: tuple[str, ...], api_keys: tuple[str, ...] = (),
                 max_client_requests: int | None = None, max_client_waiting: int | None = None):
        self.target, self.model_name, self.default_method = target, model_name, default_method
        self.keys = APIKeys(api_keys) if api_keys else None
        self.limits = limits or Limits()
        self.hosts = {h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *allowed_hosts)}
        self.any_host = "*" in self.hosts
        self.methods = available_methods()
        if default_method not in self.methods:
            raise ValueError(f"unknown default method '{default_method}'")
        self.default_options = dict(default_options or {})
        launch_options = {m: dict(o) for m, o in (method_options or {}).items()}
        unknown = sorted(set(launch_options) - set(self.methods))
        if unknown:
            raise ValueError(f"method_options names unknown method(s) {', '.join(unknown)}")
        launch_options[default_method] = {**launch_options.get(default_method, {}), **self.default_options}
        for method, options in launch_options.items():
            make_proposer(method, target, **options)
        self.launch_options = launch_options
        self.served = (model_name, *[a for a in aliases if a != model_name])
        self.metrics = Metrics()
        self.max_batch_tokens = max_batch_tokens or batch_token_budget(target)
        self.scheduler = Scheduler(target, max_batch_tokens=self.max_batch_tokens, max_running=max_running,
                                   max_waiting=max_waiting, metrics=self.metrics,
                                   prefix_cache_tokens=prefix_cache_tokens,
                                   max_request_seconds=self.limits.max_request_seconds,
                                   max_request_cpu_seconds=self.limits.max_request_cpu_seconds,
                                   max_client_requests=max_client_requests, max_client_waiting=max_client_waiting)
        self.created = int(time.time())

    def error_response(self, exc: APIError, endpoint: str | None = None) -> JSONResponse:
        if endpoint:
            self.metrics.request(metrics_endpoint(endpoint), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    def model_card(self, name: str) -> dict:
        methods = {m.name: {"summary": m.summary, "lossless": m.lossless,
                            "options": {k: _json_safe(v) for k, v in m.options().items()},
                            "schema": {o.name: {k: _json_safe(v) for k, v in o.describe().items()} for o in m.schema}}
                   for m in self.methods.values()}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "fastforward",
                "max_model_len": self.target.max_context,
                "fastforward": {"default_method": self.default_method,
                                "default_options": _public(self.default_options),
                                "launch_options": _public({m: o for m, o in self.launch_options.items() if o}),
                                "max_batch_tokens": self.max_batch_tokens, "methods": methods,
                                "machine": self.machine_facts()}}

    def machine_facts(self) -> dict:
        """What this machine gets with the served model (:func:`fastforward.machine_facts.facts`, as ``fastforward
        info`` shows it, without cache folders or server paths; llama.cpp is never imported here), read at most
        once a minute."""
        from ..machine_facts import facts

        now = time.monotonic()
        cached = getattr(self, "_machine_facts", None)
        if cached is None or now - cached[0] > 60:
            cached = self._machine_facts = (now, _public(facts(self.target, import_llama_cpp=False, folders=False)))
        return cached[1]


def _server(request: Request) -> ServerState:
    return request.app.state.server


class _HostGuard:
    """An ASGI middleware around the app: a ``Host`` the server was not started for is refused before anything
    else (a page on another site that rebinds its name to this address -- DNS rebinding -- sends its own name)."""

    def __init__(self, app, server: ServerState):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        server = self.server
        if scope["type"] == "http" and not server.any_host:
            header = dict(scope.get("headers") or ()).get(b"host")
            header = None if header is None else header.decode("latin-1")
            if header is None or host_name(header) not in server.hosts:
                shown = "none" if header is None else repr(header[:80])
                response = server.error_response(APIError(
                    400, f"Host header {shown} is not one this server answers ({', '.join(sorted(server.hosts))}); "
                         "start it with --allowed-hosts NAME to add the name clients use", param="Host",
                    code="host_not_allowed"), scope.get("path", ""))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _KeyGuard:
    """An ASGI middleware inside the ``Host`` check and CORS (a preflight carries no key): with API keys, a path
    other than the page and ``/health`` needs ``Authorization: Bearer KEY`` (else a 401); the request then carries
    the number of its key (``scope["fastforward.client"]``), by which the per-client limits count it."""

    def __init__(self, app, server: ServerState):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        keys = self.server.keys
        if scope["type"] == "http" and keys is not None and needs_key(scope.get("path", "")):
            number, problem = keys.client([v for k, v in scope.get("headers") or () if k == b"authorization"])
            if number is None:
                response = self.server.error_response(APIError(
                    401, f"{problem}; this server needs an API key (Authorization: Bearer KEY)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), scope.get("path", ""))
                await response(scope, receive, send)
                return
            scope["fastforward.client"] = f"key {number}"
        await self.app(scope, receive, send)


def client_of(request: Request) -> str:
    """Who sent ``request``, for the per-client limits: the number of its API key when the server has keys, else
    its address (the proxy's ``X-Forwarded-For`` client behind a trusted proxy, as uvicorn reads it)."""
    client = request.scope.get("fastforward.client")
    if client:
        return client
    return f"address {request.client.host}" if request.client else "address unknown"


def create_app(target, *, model_name: str, default_method: str = DEFAULT_METHOD, limits: Limits | None = None,
               max_batch_tokens: int | None = None, max_running: int = 16, max_waiting: int = 64,
               aliases: tuple[str, ...] = (), prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
               default_options: dict | None = None, method_options: dict[str, dict] | None = None,
               allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
               api_keys: tuple[str, ...] = (), max_client_requests: int | None = None,
               max_client_waiting: int | None = None) -> FastAPI:
    """The server's app for a loaded ``target``; the decode thread starts and stops with the app. ``default_options``
    are options of ``default_method`` and ``method_options`` (method -> options) those of any method, applied under
    a request's own: the server's files (trees, drafters, draft models, datastores) are named here, at launch, as a
    request may not name one. Each is checked by building that method's proposer once (a bad value is a
    :class:`UsageError` before the server listens). ``allowed_hosts``: ``Host`` names answered beside the loopback
    ones (``*``: any); ``cors_origins``: the origins whose pages may call the API (none: no CORS); ``api_keys``: the
    keys a request must carry (none: no authentication; :mod:`.auth`); ``max_client_requests`` and
    ``max_client_waiting``: what one client may have in flight and waiting (see :class:`Scheduler`)."""
    server = ServerState(target, model_name=model_name, default_method=default_method, limits=limits,
                         max_batch_tokens=max_batch_tokens, max_running=max_running, max_waiting=max_waiting,
                         aliases=aliases, prefix_cache_tokens=prefix_cache_tokens, default_options=default_options,
                         method_options=method_options, allowed_hosts=allowed_hosts, api_keys=tuple(api_keys),
                         max_client_requests=max_client_requests, max_client_waiting=max_client_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    app = FastAPI(title="fastforward", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.state.scheduler, app.state.metrics = server.scheduler, server.metrics
    app.state.max_batch_tokens = server.max_batch_tokens
    app.add_middleware(_KeyGuard, server=server)  # innermost: inside CORS (preflights carry no key) and Host
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "Authorization"], max_age=600)
    app.add_middleware(_HostGuard, server=server)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _bug)
    app.include_router(router)
    return app


# -- errors ------------------------------------------------------------------------------------------------------------
async def _api_error(request: Request, exc: APIError):
    return _server(request).error_response(exc, request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException):
    message = {404: f"no such endpoint: {request.method} {request.url.path[:200]}",
               405: f"method {request.method} is not allowed on {request.url.path[:200]}"}.get(
                   exc.status_code, str(exc.detail))
    _server(request).metrics.request(metrics_endpoint(request.url.path), exc.status_code)
    return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)


async def _bug(request: Request, exc: Exception):
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    _server(request).metrics.request(metrics_endpoint(request.url.path), 500)
    return JSONResponse(APIError(500, "internal server error (see the server log)").body(), status_code=500)


router = APIRouter()


# -- informational endpoints -------------------------------------------------------------------------------------------
@router.get("/", response_class=HTMLResponse)
async def page():
    return HTMLResponse(PAGE)


@router.get("/health")
async def health(request: Request):
    server = _server(request)
    if not server.scheduler.alive:
        return JSONResponse({"status": "error", "message": "the decode loop is not running"}, status_code=503)
    return {"status": "ok", "model": server.model_name}


@router.get("/metrics")
async def prometheus(request: Request):
    return PlainTextResponse(_server(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request):
    server = _server(request)
    return {"object": "list", "data": [server.model_card(name) for name in server.served]}


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str):
    server = _server(request)
    if name not in server.served:
        raise APIError(404, f"the model '{name[:100]}' does not exist here; this server serves: "
                            f"{', '.join(server.served)}", param="model", code="model_not_found")
    return server.model_card(name)


# -- generation --------------------------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, "chat", "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, "completion", "/v1/completions")


async def read_json(request: Request, limits: Limits):
    """The request's body as JSON: sent as ``application/json``, at most ``limits.max_body_bytes``, UTF-8."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = repr(media_type[:80]) if media_type else "none"
        raise APIError(415, f"Content-Type must be application/json, got {shown}", param="Content-Type",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
        raise APIError(413, f"the request body is {length} bytes; this server takes at most "
                            f"{limits.max_body_bytes}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise APIError(413, f"the request body is larger than {limits.max_body_bytes} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                            f"{exc.colno}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


async def generate(request: Request, kind: str, endpoint: str):
    """A completion (``kind`` "completion") or chat completion ("chat"): parsed, queued, answered as a stream of
    server-sent events or as one JSON body."""
    server = _server(request)
    body = await read_json(request, server.limits)
    parsed = parse(kind, body, served=server.served, default_method=server.default_method, limits=server.limits,
                   launch_options=server.launch_options)
    ticket = server.scheduler.submit(parsed, asyncio.get_running_loop(), client=client_of(request))
    try:
        kind_, payload = await ticket.queue.get()
    except asyncio.CancelledError:
        ticket.cancel()
        raise
    if kind_ == "error":
        return server.error_response(payload, endpoint)
    server.metrics.request(endpoint, 200)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    headers = {}
    if parsed.ignored_fields:  # ignored as OpenAI's servers do, but said
        headers[IGNORED_FIELDS_HEADER] = ", ".join(parsed.ignored_fields)
        log.info("%s %s: ignored body field(s) %s", endpoint, rid, ", ".join(parsed.ignored_fields))
    if parsed.stream:
        return StreamingResponse(_sse(ticket, parsed, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    answer = await _collect(request, ticket, parsed, rid)
    return JSONResponse(answer, headers=headers) if isinstance(answer, dict) else answer


def _extension(parsed: ParsedRequest, done: dict) -> dict:
    """The ``fastforward`` object of an answer: method, options, statistics (and token ids when asked)."""
    ext = {"method": parsed.method, "options": _public(parsed.options), "stats": _public(done["stats"])}
    if parsed.token_ids:
        ext["token_ids"] = done["token_ids"]
    return ext


async def _collect(request: Request, ticket, parsed: ParsedRequest, rid: str):
    """The whole answer of a non-streaming request. Whether its client is still there is asked every
    :data:`DISCONNECT_CHECK_SECONDS` (while text keeps coming too): a client that went away has its sequence
    dropped (counted as cancelled), as a streaming one has."""
    parts = []
    next_check = time.monotonic() + DISCONNECT_CHECK_SECONDS
    while True:
        try:
            kind, payload = await asyncio.wait_for(ticket.queue.get(), DISCONNECT_CHECK_SECONDS)
        except TimeoutError:
            kind, payload = None, None
        except asyncio.CancelledError:
            ticket.cancel()
            raise
        if kind not in ("done", "error") and time.monotonic() >= next_check:
            if await request.is_disconnected():
                ticket.cancel()
                return Response(status_code=499)
            next_check = time.monotonic() + DISCONNECT_CHECK_SECONDS
        if kind == "delta":
            parts.append(payload["text"])
        elif kind == "error":
            return _server(request).error_response(payload)
        elif kind == "done":
            parts.append(payload["text"])
            return _answer(parsed, rid, "".join(parts), payload)


def _answer(parsed: ParsedRequest, rid: str, text: str, done: dict) -> dict:
    """The JSON body of a non-streaming answer with ``text``."""
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": done["finish_reason"]}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done["finish_reason"]}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": parsed.model, "choices": [choice],
            "usage": done["usage"], "fastforward": _extension(parsed, done)}


class _Chunks:
    """The server-sent events of one streamed answer, as OpenAI shapes them."""

    def __init__(self, parsed: ParsedRequest, rid: str):
        self.parsed, self.rid = parsed, rid
        self.created = int(time.time())
        self.chat = parsed.kind == "chat"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def __call__(self, text: str | None = None, finish: str | None = None, first: bool = False, extra=None,
                 choices: bool = True) -> str:
        record = {"id": self.rid, "object": self.object, "created": self.created, "model": self.parsed.model}
        if choices:
            if self.chat:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                record["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            else:
                record["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        else:
            record["choices"] = []
        if extra:
            record.update(extra)
        return f"data: {json.dumps(record)}\n\n"


async def _sse(ticket, parsed: ParsedRequest, rid: str):
    """A streamed answer: its events as the ticket's queue gives them, ending in ``data: [DONE]``; a client that
    goes away has its sequence dropped."""
    chunk = _Chunks(parsed, rid)
    ended = False
    try:
        if chunk.chat:
            yield chunk(first=True)
        while True:
            kind, payload = await ticket.queue.get()
            if kind == "delta":
                extra = None
                if parsed.trace:
                    extra = {"fastforward": {"pieces": payload["pieces"], "tau": payload["tau"],
                                             "tokens": payload["tokens"]}}
                if payload["text"] or extra:
                    yield chunk(payload["text"], extra=extra)
            elif kind == "error":
                ended = True
                yield f"data: {json.dumps(payload.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            elif kind == "done":
                ended = True
                if payload["text"] or (parsed.trace and payload.get("pieces")):
                    extra = {"fastforward": {"pieces": payload["pieces"]}} if parsed.trace else None
                    yield chunk(payload["text"], extra=extra)
                ext = {"fastforward": _extension(parsed, payload)}
                yield chunk(None if chunk.chat else "", finish=payload["finish_reason"], extra=ext)
                if parsed.include_usage:
                    yield chunk(choices=False, extra={"usage": payload["usage"], **ext})
                yield "data: [DONE]\n\n"
                return
    finally:
        if not ended:  # the client went away (or the server stops): drop the sequence
            ticket.cancel()


# ----------------------------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------------------------


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted; the server's own log (``fastforward.server``: requests ended by
    their budgets, ignored body fields, errors, at DEBUG the slow rounds of the decode loop) at ``log_level`` beside
    uvicorn's, on standard error."""
    import uvicorn

    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(log_level.upper())
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class BackgroundServer:
    """``app`` served by uvicorn in a thread on a free loopback port (tests, the page's browser test):
    ``with BackgroundServer(app) as url: ...``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
