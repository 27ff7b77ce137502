"""The decode loop of the server: one thread owns the model and drives every live request together.

Requests arrive from the HTTP handlers (:meth:`Scheduler.submit`, which answers 429 with ``Retry-After`` when the
waiting queue is full or the client is over its limits: ``max_client_requests`` in flight, ``max_client_waiting``
waiting for a slot) and wait. Between two steps the loop admits waiting requests while fewer than ``max_running``
decode -- the oldest request of the client with the fewest decoding first, so one client's burst does not hold the
others back; prompt ids and proposer are made here, in the thread that owns the model and the tokenizer -- drops
the cancelled ones (their client went away), reads about one chunk of new prompts (the shortest first; while others
decode, a shared forward's rows, else :data:`PREFILL_CHUNK` tokens: a long prompt is read over many rounds, never
holding the others up for its whole length), and runs one verification step of every running sequence through
:class:`~fastforward.engine.BatchDecoder`: the drafts of all of them packed into shared target forwards of at most
``max_batch_tokens`` rows. Each sequence decodes exactly as it would alone, so a greedy answer never depends on
who else is being served.

**A fair share of the decode loop per request.** The loop's CPU time is charged to the requests it serves: each
prompt chunk to its request, and each step's time split between the requests in it -- each its own drafting (its
method's propose and observe time), the rest (the shared forwards, verification) by rows. A *long* request -- one
that asks for more than :data:`LONG_REQUEST_TOKENS` tokens (prompt and max_tokens) or has had more than
:data:`SHORT_REQUEST_SECONDS` of the loop -- counts its time :data:`LONG_REQUEST_FACTOR` times, and sits out rounds
(reading or decoding) while it is more than :data:`FAIR_SHARE_SECONDS` ahead of the least-served request, so that a
long answer, a long prompt or a slow drafter gets that much less than the short requests beside it (never none; all
of it alone). A short request never sits out: a long one behind catches up by stepping beside it, never by making it
wait.
And no sequence puts more than its share of a forward's rows in it -- a share of the requests in flight, stepping or
not (:func:`row_share`): its
draft or window is cut to that (the answer is the same: greedy verification keeps the target's tokens, sampling
draws keyed numbers), and a draft that may not be cut (drafts with draft probabilities: ``sps`` when sampling) is
verified in a forward of its own after the others'. A request whose steps are wide, whose drafting is slow or whose
prompt is long thus gets its share of the machine, and the others' steps stay about as long as they would be
without it. Each request also ends (finish reason ``length``) once it has used ``max_request_seconds`` of wall time
or ``max_request_cpu_seconds`` of the decode loop's CPU time (what it was charged). Output never depends on any of
it: only when it comes.

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
import math
import threading
import time
import traceback

from ..engine import PREFILL_CHUNK, BatchDecoder, Generation, Run
from ..errors import FastForwardError, UsageError
from ..model.prefix_cache import prefix_cache_for
from ..stopping import IncrementalDetokenizer
from .metrics import Metrics
from .schemas import APIError, ParsedRequest, without_server_paths

log = logging.getLogger("fastforward.server")

#: how far (decode-loop CPU seconds, weighted) a request may run ahead of the least-served one before it sits out
#: rounds: some rounds' worth, so that ordinary requests keep stepping together (sharing forwards) while one whose
#: steps cost more than theirs steps less often
FAIR_SHARE_SECONDS = 0.1
#: decode-loop CPU seconds a request is served at full weight (more than a short chat answer takes); beyond them
#: it is *long* and its time counts LONG_REQUEST_FACTOR times, so that a long request (thousands of tokens, a prompt
#: of thousands of words, slow drafting) gets that much less of the loop than the short requests beside it, never
#: none. CPU time, not wall time: other load on the machine does not make every request look long
SHORT_REQUEST_SECONDS = 1.0
LONG_REQUEST_FACTOR = 8.0
#: a request that asks for more tokens than this (its prompt and its max_tokens together) is long from the start:
#: the first chunks of a long prompt and the first steps of a 4,096-token answer do not come out of the short
#: requests' share either
LONG_REQUEST_TOKENS = 1024

#: with the log at DEBUG, a round longer than this (wall seconds) is logged with what took its time: whom it admitted,
#: whose prompt chunks it read, whom it stepped (rows, own drafting)
SLOW_ROUND_SECONDS = 0.05

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "cancelled",
                  "wall budget": "length", "cpu budget": "length"}


def _take(counts: collections.Counter, key: str) -> None:
    """One fewer of ``key`` (gone from ``counts`` at zero: the counters hold only clients with requests)."""
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


def check_client_limits(max_running: int, max_waiting: int, max_client_requests: int | None,
                        max_client_waiting: int | None) -> tuple[int, int]:
    """The per-client limits, checked (a one-line :class:`UsageError`), with their defaults: waiting for a slot,
    half of ``max_waiting`` (at least 1), so that one client cannot fill the queue; in flight, every slot and that
    (a client alone may use the whole server)."""
    for name, value in (("max_running", max_running), ("max_waiting", max_waiting)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    waiting = max(1, max_waiting // 2) if max_client_waiting is None else max_client_waiting
    requests = max_running + waiting if max_client_requests is None else max_client_requests
    for flag, value, high in (("--max-client-waiting", waiting, max_waiting),
                              ("--max-client-requests", requests, max_running + max_waiting)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise UsageError(f"{flag} must be an integer in [1, {high}], got {value!r}")
    return requests, waiting


class Ticket:
    """One request in the server: its parsed form, its generation (once admitted), its event queue, its timing,
    draft counts and CPU account."""

    def __init__(self, parsed: ParsedRequest, loop: asyncio.AbstractEventLoop, client: str = ""):
        self.parsed = parsed
        self.loop = loop
        self.client = client  # who sent it (an API key's number, else an address): the per-client limits count it
        self.admitted = False  # taken from the waiting queue (a slot of max_running)
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
        self.served = 0.0  # decode-loop CPU seconds charged to it (weighted), counted from the least-served one's
        # at admission: who sits out a round
        self.cpu_seconds = 0.0  # decode-loop CPU time charged to it: its prefill, its drafting, its part of forwards
        self.long = False  # long from the start (asks for more than LONG_REQUEST_TOKENS tokens)

    @property
    def run(self) -> Run | None:
        return None if self.generation is None else self.generation.sequence

    def is_long(self, short_seconds: float) -> bool:
        """Long: it asked for many tokens, or it has had more than ``short_seconds`` of the loop."""
        return self.long or self.cpu_seconds > short_seconds

    def charge(self, cpu: float, short_seconds: float, long_factor: float) -> None:
        """Charge it ``cpu`` seconds of the decode loop's CPU time: towards its budget, and towards its share at
        full weight up to ``short_seconds`` in all, ``long_factor`` times beyond."""
        short = 0.0 if self.long else max(0.0, min(cpu, short_seconds - self.cpu_seconds))
        self.cpu_seconds += cpu
        self.served += short + (cpu - short) * long_factor

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
            "draft_sources": s.method_stats.get("sources"),
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


def row_share(max_batch_tokens: int, sequences: int) -> int | None:
    """The most rows one of ``sequences`` sequences stepping together may put in the shared forward: an equal
    share of the forward's ``max_batch_tokens`` rows, at least its root (None, no cap, for one sequence alone)."""
    return None if sequences < 2 else max(1, max_batch_tokens // sequences)


def _positions_read(run: Run) -> int:
    """How many of the prompt's positions are in the run's cache (all of them once it is read, cache freed or not)."""
    if run.cache is None:
        return run.stats.prompt_tokens if run.finished or run.emitted else 0
    return run.cache.length


class Scheduler:
    """The decode thread and its queue (see the module docstring)."""

    def __init__(self, target, *, max_batch_tokens: int, max_running: int = 16, max_waiting: int = 64,
                 metrics: Metrics | None = None, prefix_cache_tokens: int = 0, max_request_seconds: float = 600.0,
                 max_request_cpu_seconds: float = 300.0, max_client_requests: int | None = None,
                 max_client_waiting: int | None = None):
        self.target = target
        self.max_client_requests, self.max_client_waiting = check_client_limits(
            max_running, max_waiting, max_client_requests, max_client_waiting)
        self.max_batch_tokens = max_batch_tokens
        self.max_request_seconds, self.max_request_cpu_seconds = max_request_seconds, max_request_cpu_seconds
        # prompts' KV kept for later prompts that start the same way (a chat template's system prompt, earlier
        # turns): None when the backend cannot reuse prefixes exactly or the size is 0
        self.prefix_cache = prefix_cache_for(target, prefix_cache_tokens)
        self.max_running, self.max_waiting = max_running, max_waiting
        self.metrics = metrics or Metrics()
        self.batch = BatchDecoder(max_batch_tokens, on_forward=self.metrics.forward)
        # prompt tokens a chunk reads while others decode: a shared forward's rows where the backend reads prompts
        # row-exactly (smaller chunks then write the same entries), else the engine's chunk
        exact = target.batch_rows_limit() >= PREFILL_CHUNK
        self.shared_prefill_chunk = min(PREFILL_CHUNK, max_batch_tokens) if exact else PREFILL_CHUNK
        self._pending: collections.deque[Ticket] = collections.deque()
        self._active: dict[int, Ticket] = {}  # id(run) -> ticket
        self._cond = threading.Condition()
        # per client (under _cond): requests waiting, requests holding a slot
        self._waiting_by: collections.Counter[str] = collections.Counter()
        self._running_by: collections.Counter[str] = collections.Counter()
        self._latency = None  # a running mean of recent requests' latency: what Retry-After says
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fastforward-decode", daemon=True)
        self.steps = 0
        self._parts: list[str] | None = None  # this round's parts while the log is at DEBUG (slow rounds)

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

    def submit(self, parsed: ParsedRequest, loop: asyncio.AbstractEventLoop, client: str = "") -> Ticket:
        """Queue a request of ``client``; a 429 (with ``Retry-After``) when the client already has
        ``max_client_requests`` in flight, or ``max_client_waiting`` waiting while no slot is free, or the queue is
        full."""
        ticket = Ticket(parsed, loop, client)
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down")
            waiting, running = self._waiting_by[client], self._running_by[client]
            if waiting + running >= self.max_client_requests:
                raise self._busy(f"this client already has {waiting + running} requests in flight ({running} "
                                 f"decoding), the most one client may have here ({self.max_client_requests}); retry "
                                 "once one has ended", "rate_limit_exceeded")
            slots_taken = sum(self._running_by.values()) + len(self._pending)
            if slots_taken >= self.max_running and waiting >= self.max_client_waiting:
                raise self._busy(f"this client already has {waiting} requests waiting for a slot, the most one "
                                 f"client may have waiting here ({self.max_client_waiting}); retry later",
                                 "rate_limit_exceeded")
            if len(self._pending) >= self.max_waiting:
                raise self._busy(f"the server is busy: {len(self._pending)} requests are already waiting "
                                 f"(and {len(self._active)} decoding); retry later", "queue_full")
            self._pending.append(ticket)
            self._waiting_by[client] += 1
            self._cond.notify()
        self.metrics.queue(len(self._pending), len(self._active))
        return ticket

    def _busy(self, message: str, code: str) -> APIError:
        """A 429 whose ``Retry-After`` is the recent requests' mean latency (1 to 60 s): about when a request in
        flight ends."""
        seconds = 1 if self._latency is None else min(60, max(1, math.ceil(self._latency)))
        return APIError(429, message, code=code, headers={"Retry-After": str(seconds)})

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
            admit = []
            for _ in range(min(self.max_running - len(self._active), len(self._pending))):
                # the client with the fewest requests decoding first, then the oldest request: a client's own
                # burst cannot keep the others' requests waiting
                ticket = min(self._pending, key=lambda t: self._running_by[t.client])
                self._pending.remove(ticket)
                _take(self._waiting_by, ticket.client)
                self._running_by[ticket.client] += 1
                ticket.admitted = True
                admit.append(ticket)
        t_round = time.perf_counter()
        self._parts = [] if log.isEnabledFor(logging.DEBUG) else None
        for ticket in admit:
            if ticket.cancelled.is_set():
                self._done(ticket)
                continue
            waited = time.perf_counter() - ticket.t_arrival
            if waited > self.max_request_seconds:
                self._fail(ticket, APIError(503, f"the request waited {waited:.0f} s in the queue, past this "
                                                 f"server's {self.max_request_seconds:g} s per request; retry later"))
                continue
            t0 = time.perf_counter()
            self._admit(ticket)
            self._note(f"admit {ticket.parsed.method} {time.perf_counter() - t0:.3f}s")
        self._drop_cancelled()
        if self._reading():
            self._read_prompts()
        if len(self.batch):
            self._step()
        self._end_over_budget()
        self.metrics.queue(len(self._pending), len(self._active))
        wall = time.perf_counter() - t_round
        if self._parts is not None and wall > SLOW_ROUND_SECONDS:
            log.debug("slow round %.3fs: %s", wall, "; ".join(self._parts))

    def _note(self, part: str) -> None:
        """A part of this round, for the slow-round log (DEBUG)."""
        if self._parts is not None:
            self._parts.append(part)

    def _reading(self) -> list[Ticket]:
        return [t for t in self._active.values() if t.prompt_reading is not None]

    def _decoding(self) -> list[Ticket]:
        return [t for t in self._active.values() if t.prompt_reading is None]

    def _eligible(self, tickets: list[Ticket]) -> list[Ticket]:
        """Those of ``tickets`` not sitting out this round: the short ones (never paused: a short request's whole
        cost is bounded by :data:`SHORT_REQUEST_SECONDS`), and the long ones within :data:`FAIR_SHARE_SECONDS` of
        the least-served request (reading its prompt or decoding). A long request behind the others catches up by
        stepping in every round beside them, never by making them wait."""
        least = self._level()
        return [t for t in tickets if t.served <= least + FAIR_SHARE_SECONDS or not t.is_long(SHORT_REQUEST_SECONDS)]

    def _level(self) -> float:
        """Where a request admitted now starts: level with the least-served request (owed nothing for the time
        before it came)."""
        return min((t.served for t in self._active.values()), default=0.0)

    def _charge(self, ticket: Ticket, cpu: float) -> None:
        ticket.charge(cpu, SHORT_REQUEST_SECONDS, LONG_REQUEST_FACTOR)

    def _read_prompts(self) -> None:
        """About one chunk of prompt tokens a round, of the prompts being read, the fewest tokens left first among
        those not sitting out: a long prompt is read between rounds of the others' steps instead of holding them all
        up, and a short one arriving behind it goes first. While others decode, a chunk is at most a shared forward's
        rows (``max_batch_tokens``, where the backend reads prompts row-exactly: the same entries in any chunks), so
        that a round with a chunk is not many times longer than one without; else :data:`PREFILL_CHUNK` tokens. Each
        chunk's time is charged to its request (the fair share, module docstring)."""
        chunk = self.shared_prefill_chunk if self._decoding() else PREFILL_CHUNK
        budget = chunk
        while budget > 0:
            reading = self._eligible(self._reading())
            if not reading:
                return
            ticket = min(reading, key=lambda t: t.run.stats.prompt_tokens - _positions_read(t.run))
            ticket.run.prefill_chunk = min(chunk, budget)
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
            cpu = time.process_time() - cpu_start
            self._charge(ticket, cpu)
            read = _positions_read(ticket.run) - before
            self._note(f"read {ticket.parsed.method} {read} tokens at {before} {cpu:.3f}cpu-s")
            budget -= max(1, read)
            if tokens is not None:
                ticket.prompt_reading = None
                self._prompt_read(ticket, tokens)

    def _step(self) -> None:
        """One round: a step of every running sequence but those sitting out, each with at most its share of the
        shared forward's rows (:func:`row_share`); the round's time is charged to the sequences stepped: each its
        own drafting, the rest (the forwards, verification) by rows (module docstring)."""
        stepping = self._eligible(self._decoding())
        if not stepping:
            return
        runs = [t.run for t in stepping]
        # a share of the requests in flight, not of those stepping: a request stepping alone while the others sit
        # out or read their prompts still puts only its share of rows in (its round stays short for them)
        share = row_share(self.max_batch_tokens, len(self._active))
        drafted = [t.run.stats.draft_time for t in stepping]
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        try:
            steps = self.batch.step(runs, None if share is None else [share] * len(runs))
        except Exception:  # a bug: fail the requests in flight, keep serving
            log.error("decode step failed:\n%s", traceback.format_exc())
            for ticket in list(self._active.values()):
                self._fail(ticket, APIError(500, "internal error while decoding (see the server log)"))
            self.batch.runs.clear()
            return
        self.steps += 1
        wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
        # each one's part of the round: its own drafting, and the rest by rows (wall times: their ratios hold under
        # other load on the machine), of the round's CPU time
        own = [max(0.0, t.run.stats.draft_time - d) for t, d in zip(stepping, drafted, strict=True)]
        rest = max(0.0, wall - sum(own))
        rows = sum(t.rows for t in stepping)
        for ticket, mine in zip(stepping, own, strict=True):
            part = (mine + rest * ticket.rows / rows) / wall if wall > 0 else 1 / len(stepping)
            self._charge(ticket, cpu * part)
        if self._parts is not None:
            self._note(f"step {wall:.3f}s of {len(stepping)}/{len(self._decoding())} (" + ", ".join(
                f"{t.parsed.method} {t.rows}r {m * 1e3:.0f}ms@{t.run.cache.length if t.run.cache else 0}"
                for t, m in zip(stepping, own, strict=True)) + ")")
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
        ticket.served = self._level()
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
        ticket.long = len(generation.prompt_ids) + ticket.parsed.generation.max_new_tokens > LONG_REQUEST_TOKENS
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
        self._done(ticket)
        ticket.put("done", event)
        self._account(ticket, now, cancelled=False)

    def _done(self, ticket: Ticket) -> None:
        """The ticket has its answer (or its client went away): its client's count goes down."""
        with self._cond:
            if not ticket.done:
                _take(self._running_by if ticket.admitted else self._waiting_by, ticket.client)
            ticket.done = True

    def _account(self, ticket: Ticket, now: float, cancelled: bool) -> None:
        s = ticket.run.stats
        if not cancelled:
            latency = now - ticket.t_arrival
            self._latency = latency if self._latency is None else 0.9 * self._latency + 0.1 * latency
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
                self._done(ticket)
                self._account(ticket, time.perf_counter(), cancelled=True)

    def _fail(self, ticket: Ticket, error: APIError) -> None:
        if ticket.run is not None:
            self._active.pop(id(ticket.run), None)
            self._stop_reading(ticket)
            self.batch.remove(ticket.run)
        self._done(ticket)
        ticket.put("error", error)

    @staticmethod
    def _stop_reading(ticket: Ticket) -> None:
        if ticket.prompt_reading is not None:
            ticket.prompt_reading.close()
            ticket.prompt_reading = None
