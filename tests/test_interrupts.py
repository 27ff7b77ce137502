"""Deferred stops: inside a training loop a first Ctrl-C or SIGTERM waits for the end of the step (a signal's
exception raised inside some native calls would be turned into an unrelated error); a second stops at once."""

from __future__ import annotations

import signal

import pytest

from fastforward.interrupts import Terminated, deferred_stops, on_sigterm, raise_if_stopped


def signal_self(signum: int) -> None:
    """Send ``signum`` to this thread and run its Python handler before returning: ``signal.raise_signal`` delivers it
    to the calling thread and checks for handlers at once. (``os.kill`` to the process may land on another thread --
    torch's, OpenMP's or a test server's, once earlier tests started them -- and the main thread's handler then runs
    at some later line.)"""
    signal.raise_signal(signum)


@pytest.fixture
def sigterm_routed():
    # Ctrl-C as an interactive Python has it, whatever this process inherited (a job started in the background by a
    # shell without job control starts with SIGINT ignored, and Python then leaves it ignored)
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.signal(signal.SIGTERM, on_sigterm)
    yield
    signal.signal(signal.SIGTERM, before)
    signal.signal(signal.SIGINT, before_int)


def test_a_first_sigterm_waits_for_the_safe_point(sigterm_routed):
    reached = []
    with pytest.raises(Terminated):
        with deferred_stops():
            signal_self(signal.SIGTERM)
            reached.append("rest of the step")
            raise_if_stopped()
            reached.append("next step")
    assert reached == ["rest of the step"]


def test_a_second_signal_stops_at_once(sigterm_routed):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_stops():
            signal_self(signal.SIGTERM)
            signal_self(signal.SIGINT)
            reached.append("after the second")
    assert reached == []


def test_a_stop_after_the_last_safe_point_is_raised_on_leaving(sigterm_routed):
    with pytest.raises(Terminated):
        with deferred_stops():
            raise_if_stopped()
            signal_self(signal.SIGTERM)
    raise_if_stopped()  # nothing left pending


def test_ctrl_c_is_deferred_too_and_handlers_are_restored(sigterm_routed):
    with pytest.raises(KeyboardInterrupt):
        with deferred_stops():
            signal_self(signal.SIGINT)
            raise_if_stopped()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(Terminated):  # outside the block a signal raises where it lands, as before
        signal_self(signal.SIGTERM)
        raise AssertionError("not reached")
