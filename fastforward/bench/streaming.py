"""Time per streamed step over a long generation with a stop string: the work of each step must not grow with
the length of the text already generated (stop strings and streaming are incremental, see
:mod:`fastforward.stopping`); only attention over the growing cache does, as in any decoder."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..api import stream


@dataclass
class StreamStepTimes:
    tokens: int  # tokens generated in all
    finish_reason: str
    at: dict[int, float]  # token count -> median ms per step around it
    text_ms_at: dict[int, float]  # token count -> median ms per step spent outside the target forward


def stream_step_times(target, prompt, max_new_tokens: int, stop: str, method: str = "ar",
                      marks: tuple[int, ...] = (100, 1900), window: int = 50, chat: bool = False) -> StreamStepTimes:
    """Stream ``max_new_tokens`` tokens with ``stop`` (a string that should not occur) and report the median wall
    time per step over the ``window`` steps around each mark, and how much of it was spent outside the target
    forward (drafting, verifying, the stop check, detokenising, streaming)."""
    ticks: list[tuple[int, float, float]] = []  # (tokens so far, time, forward seconds so far) after each step

    def tick(state, step):
        ticks.append((state.generated, time.perf_counter(), gen.stats.verify_time))

    gen = stream(target, prompt, method, max_new_tokens=max_new_tokens, stop=stop, chat=chat, observers=[tick])
    for _delta in gen:
        pass
    at, text_at = {}, {}
    steps = [(b[0], b[1] - a[1], (b[1] - a[1]) - (b[2] - a[2])) for a, b in zip(ticks, ticks[1:], strict=False)]
    for mark in marks:
        near = [s for s in steps if mark - window // 2 <= s[0] <= mark + window // 2]
        if near:
            at[mark] = statistics.median(s[1] for s in near) * 1000
            text_at[mark] = statistics.median(s[2] for s in near) * 1000
    return StreamStepTimes(len(gen.token_ids), gen.stats.finish_reason, at, text_at)
