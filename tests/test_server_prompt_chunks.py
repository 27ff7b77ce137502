"""The server's decode loop reads a long prompt a chunk a round, between steps of the sequences already decoding,
so one long prompt cannot hold every other request up for its whole length (issue 42, the load test's cause);
and what each request answers is what it answers alone.

The loop is driven here round by round (``Scheduler.round``), without its thread, on a tiny model whose context
(512) holds a prompt of two chunks (:data:`~fastforward.engine.PREFILL_CHUNK` = 256).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import fastforward as ff
from fastforward.engine import PREFILL_CHUNK, BatchDecoder
from fastforward.proposers import make_proposer
from fastforward.server.scheduler import Scheduler
from fastforward.server.schemas import Limits, parse
from fastforward.testing import tiny_hf_folder

MODEL = "tiny"
LONG_PROMPT = "the cache keeps what was read; " * 14  # 434 byte tokens: two chunks


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("prompt-chunks") / "tiny")))


def completion(prompt, max_tokens, method="ar"):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "fastforward": {"method": method}}
    return parse("completion", body, served=(MODEL,), default_method="ar", limits=Limits())


def test_the_long_prompt_spans_chunks(target):
    assert PREFILL_CHUNK < len(target.encode(LONG_PROMPT)) < 2 * PREFILL_CHUNK


@pytest.mark.parametrize("method", ["ar", "pld", "jacobi"])
def test_a_long_prompt_is_read_between_the_others_steps(target, method):
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(target, max_batch_tokens=64)
        short = scheduler.submit(completion("Say something short.", 30, method), loop)
        scheduler.round()  # the short prompt is read (one chunk) and decodes from the next round
        long = scheduler.submit(completion(LONG_PROMPT, 8, method), loop)
        decoded_while_reading = []
        for _ in range(200):
            if not (scheduler._active or scheduler._pending):
                break
            before = len(short.run.emitted)
            scheduler.round()
            if long.prompt_reading is not None:
                decoded_while_reading.append(len(short.run.emitted) - before)
        assert short.done and long.done
    finally:
        loop.close()
    assert decoded_while_reading and all(n > 0 for n in decoded_while_reading)  # it stepped between the chunks
    assert len(long.generation.prompt_ids) > PREFILL_CHUNK
    for ticket, n in ((short, 30), (long, 8)):
        alone = ff.generate(target, ticket.generation.prompt_ids, method, max_new_tokens=n)
        assert ticket.run.emitted == alone.token_ids


def test_a_short_prompt_behind_a_long_one_is_read_first(target):
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(target, max_batch_tokens=64)
        long = scheduler.submit(completion(LONG_PROMPT, 4), loop)
        short = scheduler.submit(completion("Hi.", 4), loop)
        scheduler.round()
        assert long.prompt_reading is not None  # one chunk of it read, the rest waits
        assert short.prompt_reading is None and short.run.emitted  # read whole in the same round: it went first
    finally:
        loop.close()


def test_prefill_in_chunks_beside_steps_changes_nothing(target):
    """Engine level: a run's prompt read a chunk at a time while another run steps."""
    prompts = [target.encode("Say something short."), target.encode(LONG_PROMPT)]
    runs = [make_proposer("ar", target).new_run(target, p, max_new_tokens=12, sampling=ff.SamplingConfig(), seed=None)
            for p in prompts]
    batch = BatchDecoder(64)
    batch.add(runs[0])
    reading = batch.add_in_chunks(runs[1])
    chunks = 0
    for progress in reading:
        chunks += 1
        assert progress[0] < progress[1]
        batch.step()
    assert chunks == 1
    while len(batch):
        batch.step()
    for run, prompt in zip(runs, prompts, strict=True):
        assert run.emitted == ff.generate(target, prompt, "ar", max_new_tokens=12).token_ids


def test_smaller_chunks_read_the_same_entries(packed):
    """Engine: a prompt read in chunks of any size (here 7, then 5 and 300 asked) on a row-exact backend writes
    bitwise the same cache entries and ends with the same logits as in PREFILL_CHUNK chunks."""
    from fastforward.engine import read_prompt_in_chunks, to_the_end

    prompt = torch.arange(3, 40) % 90 + 1
    outs, caches = [], []
    for sizes in ([PREFILL_CHUNK], [7], [5, 300]):
        cache = packed.new_cache(64)
        asked = iter(sizes * 20)
        out, _ = to_the_end(read_prompt_in_chunks(packed, prompt, cache, (), chunk=asked.__next__))
        outs.append(out.logits)
        caches.append(cache)
    for out, cache in zip(outs[1:], caches[1:], strict=True):
        assert torch.equal(out, outs[0])
        n = prompt.numel()
        assert cache.length == caches[0].length == n
        assert torch.equal(cache.k[..., :n, :], caches[0].k[..., :n, :])
        assert torch.equal(cache.v[..., :n, :], caches[0].v[..., :n, :])


def test_while_others_decode_a_prompt_is_read_a_shared_forward_at_a_time(packed):
    """Server, on a row-exact backend: beside a decoding request, a long prompt advances at most max_batch_tokens
    tokens a round; alone, a PREFILL_CHUNK a round. Every answer is what it is alone."""
    from fastforward.server.scheduler import _positions_read

    assert packed.batch_rows_limit() >= PREFILL_CHUNK
    long_prompt = [(7 * i) % 90 + 3 for i in range(300)]
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(packed, max_batch_tokens=16)
        short = scheduler.submit(completion([5, 6, 7, 8], 100), loop)
        scheduler.round()
        long = scheduler.submit(completion(long_prompt, 4), loop)
        scheduler.round()  # admitted: its first chunk is read
        beside = []
        while long.prompt_reading is not None:
            decoding, before = not short.run.finished, _positions_read(long.run)
            scheduler.round()
            if decoding:
                beside.append(_positions_read(long.run) - before)
        assert len(beside) >= 5 and max(beside) <= 16
        while scheduler._active or scheduler._pending:
            scheduler.round()
        alone = scheduler.submit(completion(long_prompt[1:], 4), loop)  # nothing else decodes
        scheduler.round()
        assert _positions_read(alone.run) == PREFILL_CHUNK
        while scheduler._active:
            scheduler.round()
    finally:
        loop.close()
    for ticket, n in ((short, 100), (long, 4), (alone, 4)):
        assert ticket.run.emitted == ff.generate(packed, ticket.generation.prompt_ids, "ar", max_new_tokens=n).token_ids
