"""Stopping a long command on Ctrl-C or SIGTERM without losing what it finished.

Commands stop on ``KeyboardInterrupt``: the command line routes SIGTERM (``kill``, a batch scheduler's notice,
``timeout``) through the same path as :class:`Terminated`, and each command keeps what it finished (a checkpoint,
flushed records, a partial report) before re-raising with a message saying where.

An exception raised from a signal handler lands on whatever Python line runs at that moment. Inside some native
calls (``torch.tensor`` of a nested list, for one) it is caught and turned into an unrelated ``ValueError``, and the
command's ``except KeyboardInterrupt`` never sees it. Training loops therefore *defer* the stop: inside
:func:`deferred_stops` a first Ctrl-C or SIGTERM only records the request, and the loop calls :func:`raise_if_stopped`
at a safe point (the end of a step). A second signal stops at once, as before.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is so that it stops as on Ctrl-C."""


_deferring = False
_pending: KeyboardInterrupt | None = None


def on_sigterm(signum, frame) -> None:
    """The command line's SIGTERM handler."""
    _stop(Terminated())


def _on_sigint(signum, frame) -> None:
    _stop(KeyboardInterrupt())


def _stop(exc: KeyboardInterrupt) -> None:
    global _pending
    if _deferring and _pending is None:
        _pending = exc  # the loop raises it at its next safe point
        return
    raise exc


def raise_if_stopped() -> None:
    """Raise the stop a signal requested inside :func:`deferred_stops`, if any (call where stopping is safe)."""
    global _pending
    if _pending is not None:
        exc, _pending = _pending, None
        raise exc


@contextmanager
def deferred_stops() -> Iterator[None]:
    """Within the block, a first Ctrl-C or SIGTERM waits for :func:`raise_if_stopped`; a second stops at once.

    Only the main thread receives signals; elsewhere (and nested) this changes nothing. SIGTERM is deferred only where
    :func:`on_sigterm` is its handler (the command line installs it); SIGINT while Python's default handler is in place.
    """
    global _deferring, _pending
    if threading.current_thread() is not threading.main_thread() or _deferring:
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    if before is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    _deferring, _pending = True, None
    try:
        yield
    finally:
        pending, _deferring, _pending = _pending, False, None
        if before is signal.default_int_handler:
            signal.signal(signal.SIGINT, before)
    if pending is not None:  # requested after the block's last safe point
        raise pending
