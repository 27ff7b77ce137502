"""The PASTA-LANG interpreter: asynchronous decoding of one answer as concurrent threads of one sequence.

The main thread decodes; when it chooses a promise's closing token (``" tokens=N/>``) a fork starts from what the
main thread sees, with an interpreter-inserted ``<async>``, and writes the block while the main thread goes on
without seeing it (its positions jump ahead by the promised length); ``<sync/>`` waits for every fork and from
then on the main thread sees every block. Every step is **one forward** over the newest token of every live thread,
all in the sequence's one KV pool (explicit write slots and per-row visibility:
:class:`~fastforward.model.ForwardRequest`), so the threads of a step cost about what one token costs on this CPU.
Where tokens sit and what they see is :class:`~fastforward.pasta.layout.PastaSchedule` -- the same rule
:func:`~fastforward.pasta.layout.pasta_layout` gives training.

:class:`PastaMethod` is the method (what ``make_proposer("pasta", ...)`` returns): it proposes nothing, it builds a
:class:`PastaRun` per prompt -- a :class:`~fastforward.engine.Run` with the engine's three steps (``propose`` plans
the rows, ``forward_request`` is the pool forward, ``complete`` lets every thread choose), so ``generate``,
``stream``, ``generate_batch`` (several PASTA answers per forward) and the CLI run it like any method. The output
is the answer in logical order, tags and topics removed (streamed as it settles: a block's text comes out once it is
finished); the annotated ids are in ``stats.method_stats``. A model whose tokenizer has no PASTA-LANG tokens decodes
its main thread only: exactly autoregressive decoding.

Decoding is constrained to well-formed PASTA-LANG (a logits mask per thread state, never a Python loop over the
vocabulary): the main thread cannot open or close a block, nor sync with nothing outstanding, nor end inside a
topic; a fork cannot promise, sync or end the answer; a topic is one line of at most
:data:`~fastforward.pasta.layout.TOPIC_CAP` tokens; a block reaching its cap is closed.
"""

from __future__ import annotations

import time

import torch

from ..engine import Run
from ..errors import UsageError
from ..model import ForwardRequest
from ..model.slots import shared
from ..verify import next_token
from .language import PastaVocab
from .layout import PastaSchedule, Settler, Thread

TOPIC_FORBIDDEN = '"<>\n\r'  # characters a topic cannot hold (the written form's delimiters; one line)


def _topic_banned_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """The ids (below ``vocab_size``) whose text holds a character a topic cannot, kept with the tokenizer (its
    resource slot: :func:`fastforward.model.slots.shared`)."""
    def build() -> torch.Tensor:
        texts = tokenizer.batch_decode([[i] for i in range(min(vocab_size, len(tokenizer)))],
                                       skip_special_tokens=False)
        return torch.tensor([i for i, t in enumerate(texts) if any(c in t for c in TOPIC_FORBIDDEN)],
                            dtype=torch.long)

    return shared(tokenizer, ("pasta topic-banned ids", vocab_size), build)


class PastaMethod:
    """The PASTA method: its settings, the constraint masks its runs share, and :meth:`new_run` (a
    :class:`PastaRun`). ``force(thread, ordinal)`` (tests, teacher forcing) may return the token a thread must take
    next instead of sampling (None: sample); ``trace`` keeps every forward's rows on the run (``run.trace``)."""

    name = "pasta"
    lossless = False
    learns_across_requests = False

    def __init__(self, target, max_forks: int = 8, force=None, trace: bool = False):
        tokenizer = target.tokenizer
        self.vocab = PastaVocab.from_tokenizer(tokenizer) if hasattr(tokenizer, "get_vocab") else None
        if self.vocab is not None and max(self.vocab.all_ids) >= target.vocab_size:
            self.vocab = None  # tokens the model cannot produce: it was never trained for PASTA-LANG
        self.max_forks = max_forks
        self.force = force
        self.trace = trace
        self.target = target
        self._masks: dict = {}

    def new_run(self, target, prompt_ids, **settings) -> PastaRun:
        """The run of one prompt (``settings``: :class:`~fastforward.engine.Run`'s)."""
        return PastaRun(target, prompt_ids, self, **settings)

    # -- the constraint masks --------------------------------------------------------------------------------------
    def topic_banned(self) -> torch.Tensor:
        """Ids whose text holds a character a topic cannot: decoding the whole vocabulary takes about half a
        second, so it is done once per tokenizer and vocabulary size, not once per request."""
        return _topic_banned_ids(self.target.tokenizer, self.target.vocab_size)

    def mask(self, key: tuple) -> tuple[str, torch.Tensor] | None:
        """("ban", ids) or ("only", ids) for a thread state (see ``PastaSchedule.constraint``)."""
        if key in self._masks:
            return self._masks[key]
        v, n = self.vocab, self.target.vocab_size
        eos = sorted(e for e in self.target.eos_token_ids if e < n)
        closes = sorted(v.close)
        if key[0] == "main":
            _, in_topic, empty, full, may_sync, may_fork = key
            if in_topic and full:
                rule = ("only", closes)
            elif in_topic:
                banned = [v.open, v.async_, v.end_async, v.sync, *eos, *self.topic_banned().tolist()]
                rule = ("ban", banned + (closes if empty else []))
            else:
                rule = ("ban", [v.async_, v.end_async, *closes] + ([] if may_sync else [v.sync])
                        + ([] if may_fork else [v.open]))
        else:
            _, empty, full = key
            if full:
                rule = ("only", [v.end_async])
            else:
                rule = ("ban", [v.open, v.async_, v.sync, *closes, *eos] + ([v.end_async] if empty else []))
        result = (rule[0], torch.tensor(sorted(set(rule[1])), dtype=torch.long))
        self._masks[key] = result
        return result


#: the former name of :class:`PastaMethod` (it was a proposer that never proposed)
PastaProposer = PastaMethod


class PastaRun(Run):
    """One PASTA answer in flight: the engine's three steps over a :class:`PastaSchedule`. Its rows are threads of
    the answer, not drafts: a shared step never cuts them (the :class:`~fastforward.engine.Run` defaults)."""

    def __init__(self, target, prompt_ids, method: PastaMethod, **settings):
        super().__init__(target, prompt_ids, method.name, **settings)
        self.method = method
        if target.backend_name != "lean":
            raise UsageError("method pasta needs the lean backend (threads share one KV pool with explicit slots)")
        self.schedule: PastaSchedule | None = None
        self.settler: Settler | None = None
        self.annotated: list[int] = []  # the settled answer with its tags, in logical order
        self.trace = [] if method.trace else None
        self._rows = None
        self._in_topic = False

    # -- the three steps -------------------------------------------------------------------------------------------
    def prefill_steps(self):
        target, n_prompt = self.target, self.state.prompt_length
        capacity = min(target.max_context, n_prompt + self.max_new_tokens + 2)
        out = yield from self._read_prompt(capacity)
        self.schedule = PastaSchedule(self.method.vocab, n_prompt, capacity - n_prompt, target.eos_token_ids,
                                      self.method.max_forks)
        self.settler = Settler(self.schedule)
        self._choose(self.schedule.main, out.logits[-1])
        return self._settle()

    def propose(self):
        t0 = time.perf_counter()
        rows = self.schedule.plan()
        if rows is None:  # pragma: no cover - a run with nothing to feed has finished
            raise RuntimeError("pasta: nothing to decode in an unfinished run")
        start = self.state.prompt_length + rows.committed
        if start > self.cache.length:  # a prefix every thread sees: commit it (entries already in place)
            self.cache.keep(range(start - self.cache.length))
        self._rows = rows
        self.stats.draft_time += time.perf_counter() - t0
        return rows

    def forward_request(self) -> ForwardRequest:
        rows, base = self._rows, self.state.prompt_length
        return ForwardRequest(torch.tensor(rows.tokens, dtype=torch.long),
                              torch.tensor(rows.positions, dtype=torch.long), self.cache, rows.mask,
                              torch.tensor(rows.slots, dtype=torch.long) + base)

    def complete(self, out, forward_seconds: float) -> list[int]:
        t0 = time.perf_counter()
        rows, stats = self._rows, self.stats
        if self.trace is not None:
            self.trace.append({"tokens": list(rows.tokens), "positions": list(rows.positions),
                               "slots": list(rows.slots), "committed": rows.committed, "mask": rows.mask.clone(),
                               "threads": [t.index for t in rows.threads], "logits": out.logits.clone()})
        for i, (thread, choose) in enumerate(zip(rows.threads, rows.choose, strict=True)):
            if choose:
                self._choose(thread, out.logits[i])
        stats.target_forwards += 1
        stats.proposal_tokens += rows.size
        stats.verify_time += forward_seconds + (time.perf_counter() - t0)
        self._rows = None
        taken = self._settle()
        stats.wall_time = time.perf_counter() - self._t_start
        return taken

    # -- choosing and emitting -------------------------------------------------------------------------------------
    def _choose(self, thread: Thread, logits: torch.Tensor) -> None:
        method = self.method
        token = method.force(thread.index, len(thread.tokens)) if method.force is not None else None
        if token is None:
            if method.vocab is not None:
                kind, ids = method.mask(self.schedule.constraint(thread))
                if kind == "ban":
                    logits = logits.index_fill(0, ids, float("-inf"))
                else:
                    logits = torch.full_like(logits, float("-inf")).index_copy_(0, ids, logits.index_select(0, ids))
            # keyed by the thread's own token index (the main thread's, as for AR: a plain answer samples like ar);
            # threads apart by 2**32 positions, so no two tokens of a run share a uniform
            key = self.state.prompt_length + len(thread.tokens) + (thread.index << 32)
            token = next_token(logits, self.sampling, self.state.generator, self.state.keyed, key)
        self.schedule.choose(thread, int(token))

    def _plain(self, tokens: list[int]) -> list[int]:
        v = self.method.vocab
        if v is None:
            return tokens
        out = []
        for t in tokens:
            if t == v.open:
                self._in_topic = True
            elif t in v.close:
                self._in_topic = False
            elif not self._in_topic and not v.is_tag(t):
                out.append(t)
        return out

    def _settle(self) -> list[int]:
        """Emit what has settled in logical order (plain), decide whether the run ends; returns the new tokens."""
        s, limit = self.schedule, self.target.max_context
        reason = ""
        if s.done:
            reason = "eos"
        elif s.generated >= self.max_new_tokens:
            reason = "length"
        elif any(t.pending is not None and t.next_pos + 2 >= limit for t in s.threads):
            reason = "context"
        annotated = self.settler.advance(final=bool(reason))
        plain = self._plain(annotated)
        if self.stop_matcher is not None and plain:
            first = self.stop_matcher.feed(plain)
            if first is not None and (first < len(plain) or not reason):
                plain = plain[:first]
                reason = "stop"
        self.annotated.extend(annotated)
        self.emitted.extend(plain)
        self.stats.new_tokens = len(self.emitted)
        self.stats.accept_lengths.append(len(plain))
        self.reason = reason
        if reason:
            self._finish()
        return plain

    def _finish(self) -> None:
        super()._finish()
        s = self.schedule
        if s is None:
            return
        eos = self.target.eos_token_ids
        shown = [t for t in self.annotated if t not in eos]
        self.stats.method_stats = {
            "pasta_tokens": self.method.vocab is not None,
            "forks": len(s.main.forks),
            "decode_forwards": s.steps,
            "generated_tokens": s.generated,
            "annotated_ids": list(self.annotated),
            "annotated": self.target.tokenizer.decode(shown, skip_special_tokens=False)
            if self.method.vocab is not None else "",
        }
