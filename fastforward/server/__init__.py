"""``fastforward serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the ``serve`` extra).

:mod:`.schemas` checks request bodies into one :class:`~fastforward.request.GenerationRequest` and shapes errors;
:mod:`.scheduler` is the decode thread (continuous batching through the engine's shared forwards, a fair share of
it per request, the per-client limits); :mod:`.auth` the API keys; :mod:`.metrics` the Prometheus counters;
:mod:`.page` the page at ``/``; :mod:`.app` the endpoints. Nothing below the command layer imports this package.
The names below load :mod:`.app` (and FastAPI) when first used, so that the keys and limits can be checked without
it.
"""

__all__ = ["APIError", "BackgroundServer", "Limits", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("BackgroundServer", "create_app", "serve"):
        from . import app

        return getattr(app, name)
    if name in ("APIError", "Limits"):
        from . import schemas

        return getattr(schemas, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
