"""``fastforward serve``: the OpenAI-compatible server (needs the ``serve`` extra)."""

from __future__ import annotations

import sys

from ..errors import UsageError
from .options import add_model_arguments, positive_int

SERVE_HINT = "install the server's dependencies with: pip install -e '.[serve]' (fastapi, uvicorn)"


def add_arguments(p, name: str) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the --model value)")
    p.add_argument("--method", default="ar", help="decoding method of requests that name none (default: ar)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=None, metavar="N",
                   help="rows per shared forward (default: sized from this machine's cost curve)")
    p.add_argument("--max-running", type=positive_int, default=16,
                   help="sequences decoding together (default: %(default)s)")
    p.add_argument("--max-waiting", type=positive_int, default=64,
                   help="requests queued beyond those; more get 429 (default: %(default)s)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of requests that give none (default: %(default)s)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096,
                   help="the largest max_tokens a request may ask for (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                   help="the largest request body; larger get 413 (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def run(args, name: str) -> int:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError:
        raise UsageError(f"'fastforward serve' needs fastapi and uvicorn: {SERVE_HINT}") from None
    from ..proposers import available_methods

    if args.method not in available_methods():
        raise UsageError(f"unknown method '{args.method}'; available: {', '.join(available_methods())}")
    import fastforward as ff

    from ..server import Limits, create_app, serve

    target = ff.load(args.model, backend=args.backend, threads=args.threads, weights=args.weights)
    limits = Limits(default_max_tokens=args.default_max_tokens, max_tokens=args.max_tokens_limit,
                    max_body_bytes=args.max_body_bytes)
    model_name = args.served_model_name or args.model
    app = create_app(target, model_name=model_name, default_method=args.method, limits=limits,
                     max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                     max_waiting=args.max_waiting)
    print(f"fastforward serve: {model_name} on http://{args.host}:{args.port} (page at /, OpenAI API at /v1, "
          f"{app.state.max_batch_tokens} rows per shared forward)", file=sys.stderr, flush=True)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
