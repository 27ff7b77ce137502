"""The decode loop of the server: one thread owns the model and drives every live request together.

Requests arrive from the HTTP handlers (:meth:`Scheduler.submit`, which answers 429 when the waiting queue is
full) and wait in order. Between two steps the loop admits waiting requests while fewer than ``max_running``
decode (prompt ids and proposer are made here, in the thread that owns the model and the tokenizer), drops
the cancelled ones (their client went away), reads about one chunk of new prompts (:data:`PREFILL_CHUNK` tokens,
the shortest first: a long prompt is read over several rounds, never holding the others up for its whole
length), and runs one verification step of every running sequence through
:class:`~fastforward.engine.BatchDecoder`: the drafts of all of them packed into shared target forwards of at most
``max_batch_tokens`` rows. Each sequence decodes exactly as it would alone, so a greedy answer never depends on
who else is being served.

Bounds per request: the decode loop's CPU time is shared fairly. Each sequence's steps are charged to it (a round's
CPU time split by rows), and a sequence more than :data:`FAIR_SHARE_SECONDS` ahead of the least-served one
sits out rounds until the others catch up. A sequence whose steps are wide (a Jacobi window, a large tree, a long
draft) therefore gets about its share of the machine, not a forward per round on top of everyone's; and each
request ends (finish reason ``length``) once it has used
``max_request_seconds`` of wall time or ``max_request_cpu_seconds`` of the decode loop's CPU time (its prefill, and a
share of every step it was in, by rows). Output never depends on either: only when it comes.

Every request has a :class:`Ticket`, which holds its :class:`~fastforward.engine.Generation` once admitted (the
request, its run, its text streamer: the same object ``stream`` and ``generate_batch`` drive); the loop puts its
events -- ``start``, ``delta`` (text as it becomes stable,
optionally each token's text and how it came), ``done`` (finish reason, usage, statistics) or ``error`` (an
:class:`~fastforward.server.schemas.APIError`) -- on the ticket's asyncio queue, thread-safely.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback

from ..engine import PREFILL_CHUNK, BatchDecoder, Generation, Run
from ..errors import FastForwardError
from ..model.prefix_cache import prefix_cache_for
from ..stopping import IncrementalDetokenizer
from .metrics import Metrics
from .schemas import APIError, ParsedRequest, without_server_paths

log = logging.getLogger("fastforward.server")

#: how far (decode-loop CPU seconds) a sequence may run ahead of the least-served one before it sits out rounds:
#: large enough that ordinary sequences keep stepping together (sharing forwards), small against a wide step
FAIR_SHARE_SECONDS = 0.5

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "cancelled",
                  "wall budget": "length", "cpu budget": "length"}


class Ticket:
    """One request in the server: its parsed form, its generation (once admitted), its event queue, its timing,
    draft counts and CPU account."""

    def __init__(self, parsed: ParsedRequest, loop: asyncio.AbstractEventLoop):
        self.parsed = parsed
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.t_arrival = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.generation: Generation | None = None
        self.tracer: IncrementalDetokenizer | None = None
        self.last_accepted = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.done = False
        self.rows = 1  # rows of its last step in the target forward
        self.prompt_reading = None  # while its prompt is read: the generator of its chunks (BatchDecoder.add_in_chunks)
        self.served = 0.0  # decode-loop CPU seconds charged to it, counted from the least-served one's at admission
        self.cpu_seconds = 0.0  # decode-loop CPU time charged to it

    @property
    def run(self) -> Run | None:
        return None if self.generation is None else self.generation.sequence

    def cancel(self) -> None:
        """The client went away: the loop drops the sequence before its next step."""
        self.cancelled.set()

    def put(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutting down)
            pass

    def observe(self, state, step) -> None:
        """Step observer: what this step accepted, for the token colours and the draft counts."""
        self.last_accepted = step.verdict.accepted
        self.rows = step.proposal.size
        drafted = len(step.proposal.tree) - 1
        if drafted > 0:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted += step.verdict.accepted

    def stats(self, now: float) -> dict:
        """The per-request statistics the response carries under ``fastforward.stats``."""
        s = self.run.stats
        admit = self.t_admit or now
        return {
            "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens,
            "completion_tokens": s.new_tokens,
            "target_forwards": s.target_forwards,
            "tau": round(s.tau, 4),
            "acceptance_by_depth": [round(a, 4) for a in s.acceptance_by_depth],
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_draft_tokens": self.accepted,
            "draft_acceptance_rate": round(self.accepted / self.draft_tokens, 4) if self.draft_tokens else 0.0,
            "tokens_per_s": round(s.tokens_per_s, 2),
            "cpu_s": round(self.cpu_seconds, 4),
            "ended_by": self.run.reason if self.run.reason in ("wall budget", "cpu budget") else None,
            "time": {
                "queue_s": round(admit - self.t_arrival, 4),
                "prefill_s": round(s.prefill_time, 4),
                "draft_s": round(s.draft_time, 4),
                "verify_s": round(s.verify_time, 4),
                "decode_s": round(s.wall_time, 4),
                "ttft_s": None if self.t_first is None else round(self.t_first - self.t_arrival, 4),
                "total_s": round(now - self.t_arrival, 4),
            },
        }


def _positions_read(run: Run) -> int:
    """How many of the prompt's positions are in the run's cache (all of them once it is read, cache freed or not)."""
    if run.cache is None:
        return run.stats.prompt_tokens if run.finished or run.emitted else 0
    return run.cache.length


class Scheduler:
    """The decode thread and its queue (see the module docstring)."""

    def __init__(self, target, *, max_batch_tokens: int, max_running: int = 16, max_waiting: int = 64,
                 metrics: Metrics | None = None, prefix_cache_tokens: int = 0, max_request_seconds: float = 600.0,
                 max_request_cpu_seconds: float = 300.0):
        self.target = target
        self.max_batch_tokens = max_batch_tokens
        self.max_request_seconds, self.max_request_cpu_seconds = max_request_seconds, max_request_cpu_seconds
        # prompts' KV kept for later prompts that start the same way (a chat template's system prompt, earlier
        # turns): None when the backend cannot reuse prefixes exactly or the size is 0
        self.prefix_cache = prefix_cache_for(target, prefix_cache_tokens)
        self.max_running, self.max_waiting = max_running, max_waiting
        self.metrics = metrics or Metrics()
        self.batch = BatchDecoder(max_batch_tokens, on_forward=self.metrics.forward)
        self._pending: collections.deque[Ticket] = collections.deque()
        self._active: dict[int, Ticket] = {}  # id(run) -> ticket
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fastforward-decode", daemon=True)
        self.steps = 0

    # -- the HTTP side ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, parsed: ParsedRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        ticket = Ticket(parsed, loop)
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down")
            if len(self._pending) >= self.max_waiting:
                raise APIError(429, f"the server is busy: {len(self._pending)} requests are already waiting "
                                    f"(and {len(self._active)} decoding); retry later", code="queue_full")
            self._pending.append(ticket)
            self._cond.notify()
        self.metrics.queue(len(self._pending), len(self._active))
        return ticket

    # -- the decode thread -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
            self.round()
        with self._cond:
            pending = list(self._pending) + list(self._active.values())
            self._pending.clear()
        for ticket in pending:
            self._fail(ticket, APIError(503, "the server is shutting down"))

    def round(self) -> None:
        """One round of the decode loop (its thread calls it while there is work): admit what fits, drop the
        cancelled, read a chunk of new prompts, step the running sequences, end those over budget."""
        with self._cond:
            room = self.max_running - len(self._active)
            admit = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
        for ticket in admit:
            if ticket.cancelled.is_set():
                ticket.done = True
                continue
            waited = time.perf_counter() - ticket.t_arrival
            if waited > self.max_request_seconds:
                self._fail(ticket, APIError(503, f"the request waited {waited:.0f} s in the queue, past this "
                                                 f"server's {self.max_request_seconds:g} s per request; retry later"))
                continue
            self._admit(ticket)
        self._drop_cancelled()
        if self._reading():
            self._read_prompts()
        if len(self.batch):
            self._step()
        self._end_over_budget()
        self.metrics.queue(len(self._pending), len(self._active))

    def _reading(self) -> list[Ticket]:
        return [t for t in self._active.values() if t.prompt_reading is not None]

    def _decoding(self) -> list[Ticket]:
        return [t for t in self._active.values() if t.prompt_reading is None]

    def _read_prompts(self) -> None:
        """About :data:`~fastforward.engine.PREFILL_CHUNK` prompt tokens a round, a chunk at a time, of the prompts
        being read, the fewest tokens left first among the least-served (within :data:`FAIR_SHARE_SECONDS`): a
        long prompt is read between rounds of the others' steps instead of holding them all up, and a short one
        arriving behind it goes first. The CPU time is charged to each."""
        budget = PREFILL_CHUNK
        while budget > 0:
            reading = self._reading()
            if not reading:
                return
            least = min(t.served for t in reading)  # the fewest tokens left first, among the least-served
            ticket = min((t for t in reading if t.served <= least + FAIR_SHARE_SECONDS),
                         key=lambda t: t.run.stats.prompt_tokens - _positions_read(t.run))
            before = _positions_read(ticket.run)
            cpu_start = time.process_time()
            try:
                next(ticket.prompt_reading)
                tokens = None
            except StopIteration as end:
                tokens = end.value
            except Exception:
                log.error("prefill failed:\n%s", traceback.format_exc())
                self._fail(ticket, APIError(500, "internal error while reading the prompt (see the server log)"))
                continue
            spent = time.process_time() - cpu_start
            ticket.cpu_seconds += spent
            ticket.served += spent
            budget -= max(1, _positions_read(ticket.run) - before)
            if tokens is not None:
                ticket.prompt_reading = None
                self._prompt_read(ticket, tokens)

    def _step(self) -> None:
        """One round: a step of every running sequence but those sitting out (see the module docstring); the
        round's CPU time is charged to the sequences stepped, by their rows."""
        decoding = self._decoding()
        least = min((t.served for t in decoding), default=0.0)
        stepping = [t for t in decoding if t.served <= least + FAIR_SHARE_SECONDS]
        cpu_start = time.process_time()
        try:
            steps = self.batch.step([t.run for t in stepping])
        except Exception:  # a bug: fail the requests in flight, keep serving
            log.error("decode step failed:\n%s", traceback.format_exc())
            for ticket in list(self._active.values()):
                self._fail(ticket, APIError(500, "internal error while decoding (see the server log)"))
            self.batch.runs.clear()
            return
        self.steps += 1
        cpu = time.process_time() - cpu_start
        rows = sum(t.rows for t in stepping)
        for ticket in stepping:
            share = cpu * ticket.rows / rows
            ticket.cpu_seconds += share
            ticket.served += share
        for run, tokens in steps:
            ticket = self._active.get(id(run))
            if ticket is None:
                continue
            self._emit(ticket, tokens)
            if run.finished:
                self._finish(ticket)

    def _end_over_budget(self) -> None:
        now = time.perf_counter()
        for ticket in list(self._active.values()):
            if now - ticket.t_arrival > self.max_request_seconds:
                reason = "wall budget"
            elif ticket.cpu_seconds > self.max_request_cpu_seconds:
                reason = "cpu budget"
            else:
                continue
            log.info("a %s request ended after its %s (%.1f s, %.1f CPU s, %d tokens)", ticket.parsed.method,
                     reason, now - ticket.t_arrival, ticket.cpu_seconds, ticket.run.stats.new_tokens)
            self._stop_reading(ticket)
            self.batch.remove(ticket.run, reason)
            self._finish(ticket)

    def _admit(self, ticket: Ticket) -> None:
        ticket.t_admit = time.perf_counter()
        # it starts level with the least-served sequence: owed nothing for the time before it came
        ticket.served = min((t.served for t in self._active.values()), default=0.0)
        try:
            generation = ticket.parsed.generation.start(self.target, observers=(ticket.observe,),
                                                        prefix_cache=self.prefix_cache)
        except FastForwardError as exc:  # bad input, a launch option's file gone since, ...: no server path shown
            message = without_server_paths(str(exc))
            code = "context_length_exceeded" if "context" in message else None
            self._fail(ticket, APIError(400, message, code=code))
            return
        except Exception as exc:
            if type(exc).__module__.startswith("jinja2"):  # the chat template refused the messages
                self._fail(ticket, APIError(400, f"the model's chat template cannot format these messages: {exc}",
                                            param="messages"))
                return
            log.error("starting a request failed:\n%s", traceback.format_exc())
            self._fail(ticket, APIError(500, "internal error while starting the request (see the server log)"))
            return
        ticket.generation = generation
        run = generation.sequence
        if ticket.parsed.trace:
            ticket.tracer = IncrementalDetokenizer(self.target.decode)
        ticket.put("start", {"prompt_tokens": len(generation.prompt_ids)})
        self._active[id(run)] = ticket
        ticket.prompt_reading = self.batch.add_in_chunks(run)  # read a chunk a round (_read_prompts)

    def _prompt_read(self, ticket: Ticket, tokens: list[int]) -> None:
        """The prompt is in: its first token goes out, and it decodes from the next round."""
        if self.prefix_cache is not None:
            self.metrics.prefix_cache(self.prefix_cache)
        self._emit(ticket, tokens, depths=[0])
        if ticket.run.finished:
            self._finish(ticket)

    def _emit(self, ticket: Ticket, tokens: list[int], depths: list[int] | None = None) -> None:
        if not tokens:
            return
        if ticket.t_first is None:
            ticket.t_first = time.perf_counter()
        if depths is None:  # the accepted draft tokens at depths 1..a, then the target's own (bonus) token
            depths = list(range(1, ticket.last_accepted + 1)) + [0]
        ticket.generation.add(tokens)
        delta = ticket.generation.visible_delta()
        event = {"text": delta}
        if ticket.tracer is not None:
            event["pieces"] = [[ticket.tracer.push([tok]), d] for tok, d in zip(tokens, depths, strict=False)]
            stats = ticket.run.stats
            event["tau"] = round(stats.tau, 3)
            event["tokens"] = stats.new_tokens
        if delta or ticket.tracer is not None:
            ticket.put("delta", event)

    def _finish(self, ticket: Ticket) -> None:
        run = ticket.run
        self._active.pop(id(run), None)
        now = time.perf_counter()
        event = {"text": ticket.generation.final_delta(),
                 "finish_reason": FINISH_REASONS.get(run.reason, run.reason),
                 "usage": {"prompt_tokens": run.stats.prompt_tokens, "completion_tokens": run.stats.new_tokens,
                           "total_tokens": run.stats.prompt_tokens + run.stats.new_tokens,
                           "prompt_tokens_details": {"cached_tokens": run.stats.cached_prompt_tokens}},
                 "stats": ticket.stats(now), "token_ids": list(run.emitted)}
        if ticket.tracer is not None:
            rest = ticket.tracer.flush()
            event["pieces"] = [[rest, 0]] if rest else []
        ticket.done = True
        ticket.put("done", event)
        self._account(ticket, now, cancelled=False)

    def _account(self, ticket: Ticket, now: float, cancelled: bool) -> None:
        s = ticket.run.stats
        self.metrics.finished(
            ticket.parsed.method, prompt_tokens=s.prompt_tokens, completion_tokens=s.new_tokens,
            forwards=s.target_forwards, drafts=ticket.drafts, draft_tokens=ticket.draft_tokens,
            accepted_tokens=ticket.accepted, latency=now - ticket.t_arrival,
            ttft=None if ticket.t_first is None else ticket.t_first - ticket.t_arrival,
            queue_wait=(ticket.t_admit or now) - ticket.t_arrival, cancelled=cancelled)

    def _drop_cancelled(self) -> None:
        for key, ticket in list(self._active.items()):
            if ticket.cancelled.is_set():
                self._stop_reading(ticket)
                self.batch.remove(ticket.run)
                self._active.pop(key, None)
                ticket.done = True
                self._account(ticket, time.perf_counter(), cancelled=True)

    def _fail(self, ticket: Ticket, error: APIError) -> None:
        if ticket.run is not None:
            self._active.pop(id(ticket.run), None)
            self._stop_reading(ticket)
            self.batch.remove(ticket.run)
        ticket.done = True
        ticket.put("error", error)

    @staticmethod
    def _stop_reading(ticket: Ticket) -> None:
        if ticket.prompt_reading is not None:
            ticket.prompt_reading.close()
            ticket.prompt_reading = None
