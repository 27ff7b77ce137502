"""Where the tokens of PASTA's threads sit: the one rule for positions, KV-pool slots and visibility.

:class:`PastaSchedule` is that rule, step by step. The interpreter drives it with the model's choices;
:func:`pasta_layout` drives the very same class with the tokens of a finished annotated answer (teacher forcing,
no model) and reads off, in logical order, every token's position, what it sees, what its logits predict, and the
step that feeds it -- what the SFT collator trains on and what the metrics count. Training and inference therefore
share positions and masks by construction.

The rule (``N`` = a promise's ``tokens``, Pred-10X):

* **Main thread.** Decodes in order; its next token sits one position after its previous one, except right after a
  promise closing at position p: then at ``p + 1 + (10*N + 2)`` (the block's estimated length plus its two tags).
  It sees the prompt, its own tokens, and the blocks it has joined.
* **Fork.** When the main thread chooses a promise's closing token, a thread is forked. Its first token is the
  interpreter-inserted ``<async>`` at position p + 1, fed in the same forward as the promise itself; its tokens
  follow contiguously. It sees what the main thread saw at the fork (the promise included) and its own tokens;
  never a sibling block, never main tokens after its promise. It ends at ``</async>`` (the interpreter closes it
  at the cap :func:`~fastforward.pasta.language.thread_cap` (N)).
* **Sync.** A chosen ``<sync/>`` waits until every fork has chosen its ``</async>``; it is then fed in the same
  forward as the last ``</async>`` tokens and from then on the main thread sees every joined block. EOS is an
  implicit sync (nothing after it is decoded; forks still running finish their blocks).
* **One forward per step** over the newest token of every live thread, written to consecutive slots of one pool
  (interleaved while several threads run). A pool prefix every thread sees (no fork outstanding) is committed: the
  visibility masks only span the slots since the last point where every block was joined.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import PastaSyntaxError
from .language import PastaVocab, parse_ids, thread_cap

TOPIC_CAP = 16  # topic tokens; then only a promise's closing token may follow
TAG_SLACK = 2  # <async> and </async>, counted in the main thread's position jump


def jump_after_promise(tens: int) -> int:
    """Positions the main thread skips after a promise of ``tens`` tens of tokens (Pred-10X: 10*N + 2 tags)."""
    return 10 * tens + TAG_SLACK


@dataclass
class Thread:
    index: int  # 0 = main; k = the k-th fork, in the order of the promises
    next_pos: int  # position of the next token fed
    vis: torch.Tensor  # bool [pool capacity]: the pool slots this thread sees
    tokens: list[int] = field(default_factory=list)  # logical order (chosen and inserted)
    pending: int | None = None  # chosen (or inserted), not yet fed
    finished: bool = False  # fork: </async> chosen; main: EOS chosen (or nothing more to decode)
    tens: int = 0  # fork: the promise's N
    content: int = 0  # fork: content tokens chosen
    in_topic: bool = False  # main: inside <promise topic="...
    topic_len: int = 0
    forks: list = field(default_factory=list)  # main: the forks, in the order of its promises


@dataclass
class Rows:
    """One step's forward: the newest token of every live thread."""

    threads: list[Thread]
    tokens: list[int]
    positions: list[int]
    slots: list[int]  # pool slots (0 = the first slot after the prompt)
    committed: int  # pool slots before this are seen by every row (the committed prefix)
    mask: torch.Tensor  # bool [q, written - committed]: what each row sees among the uncommitted slots
    choose: list[bool]  # whether the row's logits choose its thread's next token

    @property
    def size(self) -> int:
        return len(self.tokens)


class PastaSchedule:
    """The threads of one PASTA decode and the rule above. ``choose(thread, token)`` records a thread's choice;
    ``plan()`` gives the next forward's :class:`Rows` (None when nothing is left to feed)."""

    def __init__(self, vocab: PastaVocab, prompt_length: int, capacity: int, eos_ids=(), max_forks: int = 8):
        self.vocab = vocab
        self.capacity = capacity  # pool slots
        self.eos = set(eos_ids)
        self.max_forks = max_forks
        self.main = Thread(0, prompt_length, torch.zeros(capacity, dtype=torch.bool))
        self.outstanding: list[Thread] = []  # forks not yet joined by a sync
        self.written = 0
        self.committed = 0
        self.steps = 0  # forwards planned (the prefill not counted)
        self.generated = 0  # tokens chosen or inserted, all threads
        # per pool slot: (thread index, ordinal in the thread's tokens, position, step)
        self.slot_thread: list[int] = []
        self.slot_ordinal: list[int] = []
        self.slot_position: list[int] = []
        self.slot_step: list[int] = []

    @property
    def threads(self) -> list[Thread]:
        return [self.main, *self.main.forks]

    @property
    def live_forks(self) -> list[Thread]:
        return [f for f in self.outstanding if not f.finished]

    @property
    def done(self) -> bool:
        return self.main.finished and not self.live_forks

    # -- choices ---------------------------------------------------------------------------------------------------
    def choose(self, thread: Thread, token: int) -> None:
        """Record ``token`` as ``thread``'s next token."""
        v = self.vocab
        thread.tokens.append(token)
        self.generated += 1
        if thread.index == 0:
            if token in self.eos:
                thread.finished = True  # EOS is never fed: an implicit sync, then the end
                return
            if v is not None:
                if token == v.open:
                    thread.in_topic, thread.topic_len = True, 0
                elif token in v.close:
                    thread.in_topic = False
                elif thread.in_topic:
                    thread.topic_len += 1
            thread.pending = token
            return
        if token == v.end_async:
            thread.finished = True
            # its </async> is fed only if the main thread will go on to see it
            thread.pending = None if self.main.finished else token
        else:
            thread.content += 1
            thread.pending = token

    def finish_main(self) -> None:
        """The main thread stops here (nothing more to decode: a teacher-forced answer without EOS)."""
        self.main.finished = True
        self.main.pending = None
        for f in self.outstanding:
            if f.finished:
                f.pending = None

    def constraint(self, thread: Thread) -> tuple:
        """What ``thread`` may choose next, as a small hashable key (the interpreter maps it to a logits mask):
        ("main", in topic, topic empty, topic full, may sync, may fork) or ("fork", empty, at the cap)."""
        if thread.index == 0:
            return ("main", thread.in_topic, thread.topic_len == 0, thread.topic_len >= TOPIC_CAP,
                    bool(self.outstanding), len(self.live_forks) < self.max_forks)
        return ("fork", thread.content == 0, thread.content >= thread_cap(thread.tens))

    # -- steps -----------------------------------------------------------------------------------------------------
    def _alloc(self, thread: Thread, token: int, rows: Rows, choose: bool) -> None:
        slot = self.written
        if slot >= self.capacity:
            raise PastaSyntaxError("PASTA: the KV pool is full (the answer is longer than the budget)")
        self.written += 1
        thread.vis[slot] = True
        position = thread.next_pos
        thread.next_pos += 1
        self.slot_thread.append(thread.index)
        self.slot_ordinal.append(len(thread.tokens) - 1)  # the fed token is always the thread's newest
        self.slot_position.append(position)
        self.slot_step.append(self.steps)
        rows.threads.append(thread)
        rows.tokens.append(token)
        rows.positions.append(position)
        rows.slots.append(slot)
        rows.choose.append(choose)

    def plan(self) -> Rows | None:
        """The next forward: every live thread's pending token (a sync only once every fork has chosen its
        ``</async>``); None when there is nothing to feed."""
        main, v = self.main, self.vocab
        if not self.outstanding:
            self.committed = self.written  # the main thread sees every slot, and so will any later fork
        rows = Rows([], [], [], [], self.committed, torch.empty(0), [])
        for f in self.outstanding:
            if f.pending is not None:
                token, f.pending = f.pending, None
                self._alloc(f, token, rows, choose=token != v.end_async)
                # a fork's </async>: fed so the main thread can see it after the join; its logits choose nothing
        token = main.pending
        if token is not None and not (v is not None and token == v.sync and self.live_forks):
            main.pending = None
            if v is not None and token == v.sync:
                for f in self.outstanding:  # the join: every block becomes visible to the main thread
                    main.vis |= f.vis
                self.outstanding = []
            self._alloc(main, token, rows, choose=True)
            if v is not None and token in v.close:
                tens = v.close[token]
                main.next_pos += jump_after_promise(tens)
                fork = Thread(len(main.forks) + 1, main.next_pos - jump_after_promise(tens), main.vis.clone(),
                              tens=tens)
                fork.tokens.append(v.async_)  # interpreter-inserted, fed in this same forward
                self.generated += 1
                main.forks.append(fork)
                self.outstanding.append(fork)
                self._alloc(fork, v.async_, rows, choose=True)
        if not rows.tokens:
            return None
        self.steps += 1
        rows.mask = torch.stack([t.vis[self.committed:self.written] for t in rows.threads])
        return rows

    # -- output ----------------------------------------------------------------------------------------------------
    def assembled(self) -> list[int]:
        """Every thread's tokens in logical order: each block right after its promise."""
        out, forks = [], iter(self.main.forks)
        close = self.vocab.close if self.vocab is not None else {}
        for t in self.main.tokens:
            out.append(t)
            if t in close:
                fork = next(forks, None)
                if fork is not None:
                    out.extend(fork.tokens)
        return out


class Settler:
    """The logical order's settled prefix, incrementally: main tokens up to the first promise whose block is still
    being written, each finished block right after its promise (amortised O(new tokens) per step)."""

    def __init__(self, schedule: PastaSchedule):
        self.schedule = schedule
        self.cursor = 0  # main tokens settled
        self.forks_seen = 0

    def advance(self, final: bool = False) -> list[int]:
        s = self.schedule
        main, close = s.main, (s.vocab.close if s.vocab is not None else {})
        out = []
        while self.cursor < len(main.tokens):
            t = main.tokens[self.cursor]
            if t in close:
                fork = main.forks[self.forks_seen] if self.forks_seen < len(main.forks) else None
                if (fork is None or not fork.finished) and not final:
                    break  # its block is not written yet (or its fork not even started)
                out.append(t)
                if fork is not None:
                    out.extend(fork.tokens)
                    self.forks_seen += 1
            else:
                out.append(t)
            self.cursor += 1
        return out


# ----------------------------------------------------------------------------------------------------------------
# The layout of a whole annotated answer (for training and metrics)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PastaLayout:
    """A teacher-forced annotated answer, in logical order (prompt first; N = prompt + answer tokens).

    ``positions[i]`` the position id of token i; ``mask[i, j]`` whether token i sees token j; ``targets[i]`` the
    token row i's logits predict (its thread's next token; -1: none); ``fed[i]`` whether the interpreter feeds
    token i (EOS and a block's last ``</async>`` after EOS are only chosen); ``step[i]`` the forward that feeds it
    (0 = prefill); ``slot[i]`` its pool slot (-1 for the prompt and unfed tokens); ``forwards`` the forwards it
    takes to choose every answer token (the prefill included: the critical path in steps; a plain answer of n
    tokens takes n)."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    fed: torch.Tensor
    step: torch.Tensor
    slot: torch.Tensor
    prompt_length: int
    forwards: int
    blocks: int


def thread_streams(ids: list[int], vocab: PastaVocab, eos_ids=()):
    """Logical indices (into the answer) of the main thread's tokens and of each fork's (``<async>`` .. ``</async>``),
    after checking the answer's grammar."""
    structure = parse_ids(ids, vocab, eos_ids)
    in_block = torch.zeros(len(ids), dtype=torch.bool)
    forks = []
    for b in structure.blocks:
        in_block[b.async_at:b.end_at + 1] = True
        forks.append(list(range(b.async_at, b.end_at + 1)))
    main = torch.nonzero(~in_block).flatten().tolist()
    return main, forks


def _complete_unfed(mask: torch.Tensor, positions: torch.Tensor, fed: torch.Tensor, p: int, main_idx: list[int],
                    fork_idx: list[list[int]], main_next_pos: int) -> None:
    """The rows of the tokens chosen but never fed (EOS; a ``</async>`` chosen after EOS), for completeness: what
    they would see and their position (EOS: the implicit sync, after everything before it; a fork's token: after
    the fork's previous one)."""
    main_set = set(main_idx)
    for i in torch.nonzero(~fed).flatten().tolist():
        j = i - p
        if j in main_set:
            mask[i, :i + 1] = True  # EOS: the implicit sync sees everything before it
            positions[i] = main_next_pos
        else:
            k = next(k for k, s in enumerate(fork_idx) if j in s)
            prev = p + fork_idx[k][fork_idx[k].index(j) - 1]
            mask[i] = mask[prev]
            mask[i, i] = True
            positions[i] = positions[prev] + 1


def pasta_layout(prompt_ids, answer_ids, vocab: PastaVocab, eos_ids=(), max_forks: int = 1 << 30) -> PastaLayout:
    """Positions, visibility, targets and steps of ``prompt_ids + answer_ids`` exactly as the interpreter decodes
    them (see the module docstring); a :class:`PastaSyntaxError` when the answer is malformed."""
    prompt = [int(t) for t in prompt_ids]
    answer = [int(t) for t in answer_ids]
    if not prompt:
        raise PastaSyntaxError("PASTA: the prompt is empty")
    p, n = len(prompt), len(prompt) + len(answer)
    main_idx, fork_idx = thread_streams(answer, vocab, eos_ids)
    schedule = PastaSchedule(vocab, p, max(1, len(answer)), eos_ids, max_forks)
    streams = [main_idx] + fork_idx
    taken = [0] * len(streams)  # tokens of each stream given to the schedule
    targets = torch.full((n,), -1, dtype=torch.long)
    step = torch.full((n,), -1, dtype=torch.long)
    slot_of = torch.full((n,), -1, dtype=torch.long)
    positions = torch.zeros(n, dtype=torch.long)
    positions[:p] = torch.arange(p)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril_()
    step[:p] = 0
    slot_logical: list[int] = []  # pool slot -> logical index
    last_choice = [0]  # the forward that chose the last answer token

    def give(thread: Thread, source_row: int | None) -> None:
        k = thread.index
        if taken[k] >= len(streams[k]):
            if k == 0:
                schedule.finish_main()
            return
        i = streams[k][taken[k]]
        taken[k] += 1
        if source_row is not None:
            targets[source_row] = answer[i]
            last_choice[0] = max(last_choice[0], int(step[source_row]))
        schedule.choose(thread, answer[i])

    if answer:
        give(schedule.main, p - 1)
    else:
        schedule.finish_main()
    while True:
        rows = schedule.plan()
        if rows is None:
            break
        for thread, slot in zip(rows.threads, rows.slots, strict=True):
            k = thread.index  # the thread's ordinal tells which of its stream's tokens was fed
            ordinal = schedule.slot_ordinal[slot]
            if k == 0:
                logical = p + streams[0][ordinal]
            else:
                logical = p + streams[k][ordinal]
                if ordinal == 0:
                    taken[k] = max(taken[k], 1)  # the inserted <async> is the stream's first token
            slot_logical.append(logical)
            slot_of[logical] = slot
            positions[logical] = schedule.slot_position[slot]
            step[logical] = schedule.steps
        seen = torch.tensor(slot_logical, dtype=torch.long)
        for r, slot in enumerate(rows.slots):
            logical = slot_logical[slot]
            mask[logical, :p] = True
            cols = seen[rows.committed:][rows.mask[r]]
            mask[logical, cols] = True
            mask[logical, seen[:rows.committed]] = True
        for thread, choose, slot in zip(rows.threads, rows.choose, rows.slots, strict=True):
            if choose:
                give(thread, slot_logical[slot])
    fed = slot_of >= 0
    fed[:p] = True
    _complete_unfed(mask, positions, fed, p, main_idx, fork_idx, schedule.main.next_pos)
    return PastaLayout(torch.tensor(prompt + answer, dtype=torch.long), positions, mask, targets, fed, step, slot_of,
                       p, last_choice[0] + 1, len(fork_idx))
