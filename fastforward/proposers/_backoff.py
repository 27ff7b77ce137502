"""Back-off for drafters that keep caches in step (``eagle``, ``fasteagle``, ``falcon``) and for ``rest``'s datastore
lookups: keeping a drafter's cache current (or looking up the datastore) costs time every step, which a step that
then drafts nothing does not earn back. After a look whose best
choice was to draft nothing, skip looking for 1, 2, 4, ... up to ``limit`` steps (the proposer commits the skipped
steps' accepted rows together at the next look: r rows cost about what one does). A draft that paid for itself
resets it.

With ``on_loss`` (the default), a draft is judged by its verdict too: each accepted draft token saved a target step,
t(1); the draft cost the look's wall time (measured) and the larger forward, t(n) - t(1) for a tree of n nodes. A
draft that saved less than it cost backs off as an empty look does -- a drafter that is often wrong in a stretch of
text stops paying for looks there. Only which steps draft changes, never the output."""

from __future__ import annotations

import time


class BackOff:
    def __init__(self, limit: int, on_loss: bool = True):
        self.limit = limit
        self.on_loss = on_loss
        self.skip = 0  # steps left to skip looking
        self.idle = 0  # consecutive looks that drafted nothing (or whose draft did not pay)
        self._look_start = 0.0
        self._open: tuple[int, float] | None = None  # (tree nodes, look ms) of a draft awaiting its verdict

    def skipping(self) -> bool:
        """True (and count the step) while steps are left to skip."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def looking(self) -> None:
        """A look starts: its wall time from here to :meth:`drafted` is what the draft cost to make."""
        self._open = None  # a draft never verified (its generation ended) is not judged by another's verdict
        self._look_start = time.perf_counter()

    def drafted(self, nodes: int) -> None:
        """The look drafted a tree of ``nodes`` (root included): judged by its verdict when ``on_loss``, else it
        resets the back-off now."""
        if self.on_loss and self.limit and nodes > 1:
            self._open = (nodes, (time.perf_counter() - self._look_start) * 1e3)
        else:
            self.idle = 0

    def drafted_nothing(self) -> None:
        if self.limit:
            self.skip = min(2**self.idle, self.limit)
            self.idle += 1

    @property
    def awaiting_verdict(self) -> bool:
        """Whether a draft waits for :meth:`verdict` (else the verdict changes nothing)."""
        return self._open is not None

    def verdict(self, accepted: int, curve_ms) -> None:
        """The number of draft tokens the target accepted from the last draft (``curve_ms[n - 1]`` = t(n), a 1-D
        tensor or array)."""
        if self._open is None:
            return
        nodes, look_ms = self._open
        self._open = None
        t1 = float(curve_ms[0])
        cost = look_ms + float(curve_ms[min(nodes, len(curve_ms)) - 1]) - t1
        if accepted * t1 >= cost:
            self.idle = 0
        else:
            self.drafted_nothing()
