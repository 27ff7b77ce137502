"""``fastforward serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the ``serve`` extra).

:mod:`.schemas` checks request bodies into one :class:`~fastforward.request.GenerationRequest` and shapes errors;
:mod:`.scheduler` is the decode thread (continuous batching through the engine's shared forwards); :mod:`.metrics`
the Prometheus counters; :mod:`.page` the page at ``/``; :mod:`.app` the endpoints. Nothing below the command
layer imports this package.
"""

from .app import BackgroundServer, create_app, serve
from .schemas import APIError, Limits

__all__ = ["APIError", "BackgroundServer", "Limits", "create_app", "serve"]
