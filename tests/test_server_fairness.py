"""A fair share of the decode loop per request: a heavy request beside light ones does not make their shared forwards
longer than their share allows, nor take more than its share of the loop's time; every answer stays what it is
alone. Rows and forwards are counted (a spy on the target's ``forward_many``), never wall time; the time shares are
checked on the scheduler's own accounting with charges the test chooses.
"""

from __future__ import annotations

import asyncio

import pytest

import fastforward as ff
from fastforward.costs import CostCurve
from fastforward.draft_budget import DraftBudget
from fastforward.engine import BatchDecoder, SequenceRun
from fastforward.proposers import make_proposer
from fastforward.server import scheduler as scheduling
from fastforward.server.scheduler import Scheduler, Ticket, row_share
from fastforward.server.schemas import Limits, parse
from fastforward.testing import tiny_hf_folder
from fastforward.verify import SamplingConfig

REPEAT = [5, 6, 7, 8] * 6  # a prompt whose continuation prompt lookup can draft


def spy_forwards(monkeypatch, target):
    """Every forward of ``target``: a list of (cache, rows) per sequence in it."""
    forwards = []
    original = target.forward_many

    def spy(requests, *args, **kwargs):
        forwards.append([(r.cache, r.ids.numel()) for r in requests])
        return original(requests, *args, **kwargs)

    monkeypatch.setattr(target, "forward_many", spy)
    return forwards


def _runs(target, specs, sampling=SamplingConfig(), seed=None):
    return [SequenceRun(target, prompt, make_proposer(method, target, **options), max_new_tokens=n,
                        sampling=sampling, seed=seed) for prompt, method, options, n in specs]


HEAVY_AND_LIGHT = [
    (REPEAT, "pld", {"num_pred_tokens": 60, "adaptive": False}, 30),  # long drafts, accepted where it repeats
    ([9, 10, 11] * 5, "jacobi", {"n_tokens": 48}, 30),  # a window of 48 rows
    ([3, 1, 4, 1, 5, 9, 2, 6], "lookahead", {"window": 8, "ngram": 4, "guesses": 8}, 30),  # a window as aux rows
    ([20, 21, 20, 21, 22], "ar", {}, 30),
    ([7, 7, 8, 9], "ar", {}, 30),
]


def _decode(target, runs, caps, budget=None):
    batch = BatchDecoder(4096, cut_drafts=budget is not None)
    batch.budget = budget
    for run in runs:
        batch.add(run)
    while len(batch):
        live = list(batch.runs)
        batch.step(live, None if caps is None else [caps] * len(live))
    return runs


def test_row_caps_cut_each_draft_to_its_share_and_change_nothing(packed, monkeypatch):
    """Engine: with every draft kept by the pricing (a flat curve), the caps alone bound each sequence's rows in the
    shared forward; uncapped, the heavy drafts fill it. Every answer is the solo AR answer."""
    flat = DraftBudget(CostCurve.flat(), 4096)
    forwards = spy_forwards(monkeypatch, packed)
    capped = _decode(packed, _runs(packed, HEAVY_AND_LIGHT), 3, flat)
    capped_forwards, forwards[:] = list(forwards), []
    whole = _decode(packed, _runs(packed, HEAVY_AND_LIGHT), None, flat)
    for (prompt, _, _, n), a, b in zip(HEAVY_AND_LIGHT, capped, whole, strict=True):
        assert a.emitted == b.emitted == ff.generate(packed, prompt, "ar", max_new_tokens=n).token_ids
    shared = [f for f in capped_forwards if len(f) > 1]
    assert shared and all(rows <= 3 for f in shared for _, rows in f)
    assert max(rows for f in forwards if len(f) > 1 for _, rows in f) > 20  # uncapped: the long windows and drafts


def test_sampled_keyed_drafts_are_capped_and_keep_their_samples(packed):
    sampling = SamplingConfig(temperature=1.0)
    specs = [(REPEAT, "pld", {"num_pred_tokens": 30, "adaptive": False}, 20), ([9, 10, 11] * 5, "jacobi",
                                                                                 {"n_tokens": 32}, 20)]
    runs = _decode(packed, _runs(packed, specs, sampling, seed=4), 2)
    for (prompt, method, options, n), run in zip(specs, runs, strict=True):
        alone = ff.generate(packed, prompt, method, max_new_tokens=n, temperature=1.0, seed=4,
                            method_options=options)
        assert run.emitted == alone.token_ids


def test_drafts_with_probabilities_over_the_cap_get_a_forward_of_their_own(packed, monkeypatch):
    """sps when sampling may not be cut (its rejection draws as many numbers as it drafted): over its share, it is
    verified in a forward of its own after the others', whose forward keeps their share; its samples are those it
    draws alone."""
    sampling = SamplingConfig(temperature=1.0)
    sps = SequenceRun(packed, REPEAT, make_proposer("sps", packed, draft=packed, k=6), max_new_tokens=12,
                      sampling=sampling, seed=5)
    light = _runs(packed, [([20, 21, 20, 21, 22], "ar", {}, 30), ([7, 7, 8, 9], "ar", {}, 30)])
    forwards = spy_forwards(monkeypatch, packed)
    _decode(packed, [sps, *light], 2)
    alone = ff.generate(packed, REPEAT, "sps", max_new_tokens=12, temperature=1.0, seed=5,
                        method_options={"draft": packed, "k": 6})
    assert sps.emitted == alone.token_ids
    assert [7] in [[rows for _, rows in f] for f in forwards]  # its whole draft (6) and its root, alone
    assert all(rows <= 2 for f in forwards if len(f) > 1 for _, rows in f)  # the others' shared forwards


def test_row_share():
    assert row_share(16, 1) is None  # alone: as it decodes alone
    assert row_share(16, 2) == 8 and row_share(16, 5) == 3 and row_share(16, 16) == 1 and row_share(16, 40) == 1


# -- the server's decode loop ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("fairness") / "tiny")))


def _parsed(prompt, method="ar", options=None, max_tokens=24):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "fastforward": {"method": method, "options": options or {}}}
    return parse("completion", body, served=("tiny",), default_method="ar", limits=Limits())


HEAVY_REQUESTS = [("jacobi", {"n_tokens": 300}, "Count the caches: one, two, three,"),
                  ("pld", {"num_pred_tokens": 200, "adaptive": False}, "the cache, the cache, the cache, " * 4)]


def _serve(target, requests, forwards, max_batch_tokens=16):
    """Run ``requests`` ((prompt, method, options, max_tokens), all arriving together) through the decode loop
    round by round; returns the tickets and, per round in which every request decoded, the rows of its decode
    forwards (``forwards``: the spy's list)."""
    loop = asyncio.new_event_loop()
    rounds = []
    try:
        scheduler = Scheduler(target, max_batch_tokens=max_batch_tokens)
        tickets = [scheduler.submit(_parsed(p, m, o, n), loop) for p, m, o, n in requests]
        for _ in range(3000):
            if not (scheduler._active or scheduler._pending):
                break
            before = len(forwards)
            decoding = [t.run is not None and not t.run.finished and t.prompt_reading is None for t in tickets]
            scheduler.round()
            if all(decoding):  # every request decoded in this round
                rounds.append(sum(rows for f in forwards[before:] for _, rows in f))
        assert all(t.done for t in tickets)
        return tickets, rounds
    finally:
        loop.close()


@pytest.mark.parametrize("method,options,prompt", HEAVY_REQUESTS, ids=[h[0] for h in HEAVY_REQUESTS])
def test_a_heavy_request_keeps_the_light_ones_rounds_to_their_share(tiny, monkeypatch, pin_costs, method, options,
                                                                   prompt):
    """Three light requests and a heavy one (a 300-row Jacobi window; 200-token prompt-lookup drafts), on a machine
    where rows look free (a flat cost curve: the draft pricing keeps every draft, as it keeps drafts that are
    accepted): while all four decode, no round of the decode loop -- what each light request waits for between two
    of its tokens -- computes more than the light ones' rows (one each) and the heavy one's share of the 16-row
    forward (4); without the row shares the heavy request fills the forward. Every answer is the one it gets
    alone."""
    pin_costs(tiny, CostCurve.flat())
    light = [(f"Question {i}: what is a cache?", "ar", {}, 24) for i in range(3)]
    requests = [*light, (prompt, method, options, 80)]
    forwards = spy_forwards(monkeypatch, tiny)
    tickets, rounds = _serve(tiny, requests, forwards)
    assert rounds and max(rounds) <= 3 + row_share(16, 4)
    for (_, m, _, n), ticket in zip(requests, tickets, strict=True):
        alone = ff.generate(tiny, ticket.generation.prompt_ids, "ar", max_new_tokens=n)
        assert ticket.run.emitted == alone.token_ids, m
    # the same without the row shares: the heavy request's rows come on top of the light ones'
    forwards[:] = []
    monkeypatch.setattr(scheduling, "row_share", lambda max_batch_tokens, sequences: None)
    _, rounds = _serve(tiny, requests, forwards)
    assert max(rounds) > 3 + row_share(16, 4)


def test_a_heavy_request_stepping_while_another_reads_its_prompt_keeps_to_its_share(tiny, monkeypatch, pin_costs):
    """A 300-row Jacobi window decoding while a light request's long prompt is read in chunks: the heavy one steps
    without the other (which is not decoding yet), and still puts at most its share of the forward's rows (of the
    two requests in flight: 8 of 16) in each of those rounds -- the light one's first token waits for rounds that
    stay short. Its answer is the one it gets alone."""
    pin_costs(tiny, CostCurve.flat())
    forwards = spy_forwards(monkeypatch, tiny)
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(tiny, max_batch_tokens=16)
        heavy = scheduler.submit(_parsed("Count the caches: one, two, three,", "jacobi", {"n_tokens": 300}, 80), loop)
        for _ in range(50):  # until it decodes
            scheduler.round()
            if heavy.prompt_reading is None and heavy.run is not None:
                break
        light = scheduler.submit(_parsed("cache " * 60 + "what is a cache?", "ar", {}, 8), loop)
        heavy_rows_while_reading = []
        for _ in range(3000):
            if not (scheduler._active or scheduler._pending):
                break
            reading = not light.done and (light.run is None or light.prompt_reading is not None)  # not decoding
            before = len(forwards)
            scheduler.round()
            if reading:
                heavy_rows_while_reading += [rows for f in forwards[before:] for cache, rows in f
                                             if cache is heavy.run.cache]
        assert heavy.done and light.done
        assert heavy_rows_while_reading and max(heavy_rows_while_reading) <= row_share(16, 2)
        alone = ff.generate(tiny, heavy.generation.prompt_ids, "ar", max_new_tokens=80)
        assert heavy.run.emitted == alone.token_ids
    finally:
        loop.close()


# -- the time shares, on the scheduler's own accounting --------------------------------------------------------------
class _Clients:
    """Tickets in a scheduler's ``_active`` table (no model work): what each round costs each is the test's choice."""

    def __init__(self, target):
        self.scheduler = Scheduler(target, max_batch_tokens=16)
        self.next = 0

    def add(self) -> Ticket:
        ticket = Ticket(None, None)
        ticket.served = self.scheduler._level()
        self.scheduler._active[self.next] = ticket
        self.next += 1
        return ticket

    def remove(self, ticket: Ticket) -> None:
        del self.scheduler._active[next(k for k, t in self.scheduler._active.items() if t is ticket)]

    def round(self, cost) -> list[Ticket]:
        stepping = self.scheduler._eligible(list(self.scheduler._active.values()))
        for ticket in stepping:
            self.scheduler._charge(ticket, cost(ticket))
        return stepping


def test_a_request_whose_steps_cost_ten_times_more_steps_far_less_often_once_it_is_long(tiny):
    """Light requests of 64 rounds each (replaced as they end) and one whose rounds cost ten times theirs: the light
    ones step in every round; the costly one too while it is short (its first SHORT_REQUEST_SECONDS: a short request
    never sits out), then -- its time counting LONG_REQUEST_FACTOR times -- in about one round in ten times that."""
    clients = _Clients(tiny)
    heavy = clients.add()
    light = {clients.add(): 0 for _ in range(4)}
    heavy_steps = []
    for _ in range(8000):
        stepped = clients.round(lambda t: 0.010 if t is heavy else 0.001)
        heavy_steps.append(heavy in stepped)
        for ticket in list(light):
            assert ticket in stepped  # a light request steps in every round
            light[ticket] += 1
            if light[ticket] == 64:
                clients.remove(ticket)
                del light[ticket]
                light[clients.add()] = 0
    short_rounds = round(scheduling.SHORT_REQUEST_SECONDS / 0.010)
    assert all(heavy_steps[:short_rounds])
    expected = 4000 / (10 * scheduling.LONG_REQUEST_FACTOR)  # the last 4,000 rounds
    assert 0.6 * expected < sum(heavy_steps[-4000:]) < 1.6 * expected


def test_a_long_request_gets_a_fraction_of_the_short_ones_share(tiny):
    """Light requests of 64 rounds each, replaced as they end (new ones start level with the least-served), beside
    one request costing the same per round: past SHORT_REQUEST_SECONDS of the loop it is long, and steps in about
    one round in LONG_REQUEST_FACTOR; never in none."""
    clients = _Clients(tiny)
    long = clients.add()
    light = {clients.add(): 0 for _ in range(4)}
    steps_long = rounds = 0
    for _ in range(8000):
        stepped = clients.round(lambda t: 0.002)
        if long.cpu_seconds > scheduling.SHORT_REQUEST_SECONDS:
            rounds += 1
            steps_long += long in stepped
        for ticket in list(light):
            light[ticket] += ticket in stepped
            if light[ticket] == 64:  # answered: the client sends the next one
                clients.remove(ticket)
                del light[ticket]
                light[clients.add()] = 0
    factor = scheduling.LONG_REQUEST_FACTOR
    assert rounds > 1000
    assert 0.6 * rounds / factor < steps_long < 1.6 * rounds / factor


def test_charges_weigh_past_the_short_request_seconds():
    ticket = Ticket(None, None)
    ticket.charge(0.2, 0.25, 4.0)
    assert ticket.served == pytest.approx(0.2) and ticket.cpu_seconds == pytest.approx(0.2)
    ticket.charge(0.1, 0.25, 4.0)  # 0.05 at full weight, 0.05 four times
    assert ticket.served == pytest.approx(0.45) and ticket.cpu_seconds == pytest.approx(0.3)
    asking = Ticket(None, None)
    asking.long = True  # it asked for more than LONG_REQUEST_TOKENS tokens: long from the start
    asking.charge(0.1, 0.25, 4.0)
    assert asking.served == pytest.approx(0.4)


@pytest.mark.parametrize("prompt_words,max_tokens,long", [(5, 64, False), (5, 950, False), (5, 1100, True),
                                                          (80, 600, True)])
def test_requests_asking_for_many_tokens_are_long_from_the_start(tiny, prompt_words, max_tokens, long):
    """More than LONG_REQUEST_TOKENS tokens asked for, prompt (a byte a token here) and max_tokens together."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(tiny, max_batch_tokens=16)
        prompt = " ".join(["cache"] * prompt_words)
        ticket = scheduler.submit(parse("completion", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens},
                                        served=("tiny",), default_method="ar", limits=Limits(max_tokens=4096)), loop)
        scheduler.round()
        assert ticket.long is long
        ticket.cancel()
        scheduler.round()
    finally:
        loop.close()
