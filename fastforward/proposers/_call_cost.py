"""The measured cost of one drafter call, for drafters that call their network once per tree depth (``eagle``).

A depth's call is worth making only if the candidates it adds can bring back its time: at most the summed path
probability of the frontier nodes it expands (greedy accepts at most one path, so that sum bounds the tokens the new
depth adds), each token worth about one target step t(1). The cost is measured as the proposer runs (a moving
average of wall milliseconds), so the rule follows the machine, the drafter's size and the thread count without
tuning. Only which trees are drafted changes, never the output.
"""

from __future__ import annotations

import time


class DrafterCallCost:
    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.ms: float | None = None  # moving average of one call's wall time; None until the first call
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self) -> None:
        ms = (time.perf_counter() - self._started) * 1e3
        self.ms = ms if self.ms is None else self.ms + self.smoothing * (ms - self.ms)

    def pays(self, frontier_mass: float, token_ms: float) -> bool:
        """Whether a call expanding frontier nodes of summed path probability ``frontier_mass`` can pay for itself
        when a token costs ``token_ms`` (always, until a call has been timed)."""
        return self.ms is None or frontier_mass * token_ms >= self.ms
