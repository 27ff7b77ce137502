"""The HTTP face of ``fastforward serve``: OpenAI-compatible endpoints over the :class:`Scheduler`.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events ending
in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text) and the page at ``/``. Every error is
OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 bad input (a ``Host`` the server was
not started for included), 404 unknown model, method or route, 413 body too large, 415 a body not sent as JSON,
429 queue full, 500 a bug (never a traceback in the body; the log has it).

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

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import batch_token_budget
from ..model.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS
from ..proposers import available_methods, make_proposer
from ..version import __version__
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


class _Guard:
    """An ASGI middleware around the app: ``check(scope, receive, send, app)`` answers itself or calls ``app``."""

    def __init__(self, app, check):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        await self.check(scope, receive, send, self.app)


def create_app(target, *, model_name: str, default_method: str = "ar", limits: Limits | None = None,
               max_batch_tokens: int | None = None, max_running: int = 16, max_waiting: int = 64,
               aliases: tuple[str, ...] = (), prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
               default_options: dict | None = None, method_options: dict[str, dict] | None = None,
               allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = ()) -> FastAPI:
    """The server's app for a loaded ``target``; the decode thread starts and stops with the app. ``default_options``
    are options of ``default_method`` and ``method_options`` (method -> options) those of any method, applied under
    a request's own: the server's files (trees, drafters, draft models, datastores) are named here, at launch, as a
    request may not name one. Each is checked by building that method's proposer once (a bad value is a
    :class:`UsageError` before the server listens). ``allowed_hosts``: ``Host`` names answered beside the loopback
    ones (``*``: any); ``cors_origins``: the origins whose pages may call the API (none: no CORS)."""
    limits = limits or Limits()
    hosts = {h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *allowed_hosts)}
    any_host = "*" in hosts
    methods = available_methods()
    if default_method not in methods:
        raise ValueError(f"unknown default method '{default_method}'")
    default_options = dict(default_options or {})
    launch_options = {m: dict(o) for m, o in (method_options or {}).items()}
    unknown = sorted(set(launch_options) - set(methods))
    if unknown:
        raise ValueError(f"method_options names unknown method(s) {', '.join(unknown)}")
    launch_options[default_method] = {**launch_options.get(default_method, {}), **default_options}
    for method, options in launch_options.items():
        make_proposer(method, target, **options)
    served = (model_name, *[a for a in aliases if a != model_name])
    metrics = Metrics()
    budget = max_batch_tokens or batch_token_budget(target)
    scheduler = Scheduler(target, max_batch_tokens=budget, max_running=max_running, max_waiting=max_waiting,
                          metrics=metrics, prefix_cache_tokens=prefix_cache_tokens,
                          max_request_seconds=limits.max_request_seconds,
                          max_request_cpu_seconds=limits.max_request_cpu_seconds)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="fastforward", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.max_batch_tokens = scheduler, metrics, budget
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "Authorization"], max_age=600)

    def error_response(exc: APIError, endpoint: str | None = None) -> JSONResponse:
        if endpoint:
            metrics.request(metrics_endpoint(endpoint), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def only_named_hosts(scope, receive, send, app_):
        """A ``Host`` the server was not started for is refused before anything else: a page on another site that
        rebinds its name to this address (DNS rebinding) sends its own name."""
        if scope["type"] == "http" and not any_host:
            header = dict(scope.get("headers") or ()).get(b"host")
            header = None if header is None else header.decode("latin-1")
            if header is None or host_name(header) not in hosts:
                shown = "none" if header is None else repr(header[:80])
                response = error_response(APIError(
                    400, f"Host header {shown} is not one this server answers ({', '.join(sorted(hosts))}); start "
                         "it with --allowed-hosts NAME to add the name clients use", param="Host",
                    code="host_not_allowed"), scope.get("path", ""))
                await response(scope, receive, send)
                return
        await app_(scope, receive, send)

    app.add_middleware(_Guard, check=only_named_hosts)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no such endpoint: {request.method} {request.url.path[:200]}",
                   405: f"method {request.method} is not allowed on {request.url.path[:200]}"}.get(
                       exc.status_code, str(exc.detail))
        metrics.request(metrics_endpoint(request.url.path), exc.status_code)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        metrics.request(metrics_endpoint(request.url.path), 500)
        return JSONResponse(APIError(500, "internal server error (see the server log)").body(), status_code=500)

    # -- informational endpoints -----------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "error", "message": "the decode loop is not running"}, status_code=503)
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "fastforward",
                "max_model_len": target.max_context,
                "fastforward": {"default_method": default_method,
                                "default_options": _public(default_options),
                                "launch_options": _public({m: o for m, o in launch_options.items() if o}),
                                "max_batch_tokens": budget,
                                "methods": {m.name: {"summary": m.summary, "lossless": m.lossless,
                                                     "options": {k: _json_safe(v) for k, v in m.options().items()},
                                                     "schema": {o.name: {k: _json_safe(v) for k, v in
                                                                         o.describe().items()} for o in m.schema}}
                                            for m in methods.values()}}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in served]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in served:
            raise APIError(404, f"the model '{name[:100]}' does not exist here; this server serves: "
                                f"{', '.join(served)}", param="model", code="model_not_found")
        return model_card(name)

    # -- generation --------------------------------------------------------------------------------------------------
    async def read_json(request: Request):
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
        body = await read_json(request)
        parsed = parse(kind, body, served=served, default_method=default_method, limits=limits,
                       launch_options=launch_options)
        ticket = scheduler.submit(parsed, asyncio.get_running_loop())
        try:
            kind_, payload = await ticket.queue.get()
        except asyncio.CancelledError:
            ticket.cancel()
            raise
        if kind_ == "error":
            return error_response(payload, endpoint)
        metrics.request(endpoint, 200)
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

    def extension(parsed: ParsedRequest, done: dict) -> dict:
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
                return error_response(payload)
            elif kind == "done":
                parts.append(payload["text"])
                text = "".join(parts)
                if parsed.kind == "chat":
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                              "finish_reason": payload["finish_reason"]}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": payload["finish_reason"]}
                    obj = "text_completion"
                return {"id": rid, "object": obj, "created": int(time.time()), "model": parsed.model,
                        "choices": [choice], "usage": payload["usage"],
                        "fastforward": extension(parsed, payload)}

    async def _sse(ticket, parsed: ParsedRequest, rid: str):
        created_at = int(time.time())
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None = None, finish: str | None = None, first: bool = False, extra=None,
                  choices: bool = True) -> str:
            record = {"id": rid, "object": obj, "created": created_at, "model": parsed.model}
            if choices:
                if chat:
                    delta = {"role": "assistant", "content": ""} if first else \
                        ({} if text is None else {"content": text})
                    record["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
                else:
                    record["choices"] = [{"index": 0, "text": text or "", "logprobs": None,
                                          "finish_reason": finish}]
            else:
                record["choices"] = []
            if extra:
                record.update(extra)
            return f"data: {json.dumps(record)}\n\n"

        ended = False
        try:
            if chat:
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
                    ext = {"fastforward": extension(parsed, payload)}
                    yield chunk(None if chat else "", finish=payload["finish_reason"], extra=ext)
                    if parsed.include_usage:
                        yield chunk(choices=False, extra={"usage": payload["usage"], **ext})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not ended:  # the client went away (or the server stops): drop the sequence
                ticket.cancel()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion", "/v1/completions")

    return app


# ----------------------------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------------------------


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

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
