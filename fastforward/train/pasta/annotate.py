"""Annotating answers with PASTA-LANG without an external LLM.

The paper had Gemini 1.5 Flash annotate SlimOrca answers; nothing here can call such a model. The recipe instead:

1. **Candidates from structure.** The answer (the target's own, from ``fastforward make-data``) is cut into units:
   list items (with their indented continuation and sub-items), paragraphs, headings and fenced code blocks (a code
   block is one unit, never split, never a candidate). A *group* is a run of consecutive units of one kind -- the
   items of one list, or paragraphs (the answer's first unit excluded: the opening stays on the main thread). Each
   unit of a group with at least ``min_words`` words is a candidate async chunk; its siblings are the other
   candidates of its group.
2. **A likelihood test of independence.** The untouched target reads the *untagged* answer (it never saw a tag)
   at its true positions under (a) the causal mask and (b) the PASTA mask of the candidate annotation, stated on the
   untagged tokens: a chunk sees the text before its group's first chunk ... before itself on the main thread, and
   itself -- never a sibling; each token is predicted by its thread's previous token (a chunk's first token by the
   last main token before it: the analogue of the ``<async>`` row). A chunk stays async only if its mean per-token
   loss rises by at most ``threshold`` nats when its siblings are hidden -- exactly the independence the mask will
   impose at inference. A list item's marker (``2.``) is left out of the mean: at inference the fork sees the
   earlier promises, which carry the count, but the untagged text cannot show them.
3. **Syncs.** With the kept chunks async and no sync, the main-thread units after a group's first kept chunk are
   scored the same way; a ``<sync/>`` goes right before the first one whose mean loss rises by more than
   ``sync_threshold`` (it needs the blocks). Rules: a group's blocks are joined at the latest right before the next
   group's first block (groups never overlap), and the end of the answer is the implicit sync. Units after a
   mid-group sync are scored as if nothing were joined (conservative: it can only add syncs). A block that would
   run alongside nothing (the only one before its sync, the sync right after it) is left out.
4. **Tags.** ``<promise topic="T" tokens=N/>`` with T a bold lead-in, a heading, or the chunk's first words (at most
   ``topic_words``, default two: each topic token is a main-thread forward; characters the topic cannot hold
   removed) and N = max(1, round(len/10)) in the target's tokens; the annotation is parsed back and its stripped
   text must equal the answer exactly, else the record keeps no tags.
5. **A group must pay** (likelihood mode): a group of blocks is kept only if the answer's critical path, by the
   interpreter's own schedule, is at least ``min_saving`` forwards shorter with it than without it.

``mode="structure"`` is the APAR-like baseline: every candidate async, a sync right after each group, no model.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import PastaSyntaxError, UsageError
from ...jsonl import jsonl_records
from ...model.slots import shared
from ...pasta.language import ASYNC as ASYNC_TAG
from ...pasta.language import END_ASYNC as END_TAG
from ...pasta.language import MAX_TENS, PastaVocab, add_pasta_tokens, parse, parse_ids, promise_tag, thread_cap
from ...pasta.language import SYNC as SYNC_TAG
from ...pasta.layout import pasta_layout
from ...paths import check_output_file, owned_jsonl
from ..make_data import RESPONSES
from .methods import read_records

# Calibrated on SmolLM2-135M's own make-data answers (docs/pasta.md): hiding a chunk's siblings raises its mean
# per-token loss by a median 0.63 nats (quartiles 0.02 / 1.37) over 123 candidate chunks of 40 answers, so 0.1
# keeps little beyond each group's first chunk; 1.0 keeps about 63 % of the candidates (589 of 933 on 376 answers).
DEFAULT_THRESHOLD = 1.0  # nats: the most a chunk's mean loss may rise with its siblings hidden
DEFAULT_SYNC_THRESHOLD = 1.0  # nats: a main-thread unit rising more than this needs a sync before it
DEFAULT_MIN_WORDS = 5  # the paper's annotation prompt: "each <async> tag encompasses at least five words"
DEFAULT_TOPIC_WORDS = 2  # a topic is a short label: every topic token is a forward on the main thread
DEFAULT_MIN_SAVING = 1  # forwards a group of blocks must save on the critical path to stay async (likelihood mode)
MODES = ("likelihood", "structure")

_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+\S")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
_FENCE = re.compile(r"^\s*(```|~~~)")
_MARKER = re.compile(r"\s*(?:[-*+]|\d+[.)])\s+")
_BOLD = re.compile(r"^\s*(?:[-*+]|\d+[.)])?\s*\*\*([^*\n]{1,60})\*\*")


# ----------------------------------------------------------------------------------------------------------------
# Structure
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Unit:
    kind: str  # item | paragraph | heading | code
    start: int  # character offsets into the answer
    end: int  # end of its text (trailing blank lines excluded)
    indent: int = 0


def units_of(text: str) -> list[Unit]:
    """The answer's units (see the module docstring), in order."""
    lines = text.splitlines(keepends=True)
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    units: list[Unit] = []
    i, n = 0, len(lines)

    def end_of(j):  # the end of line j's text, without its line break
        return offsets[j] + len(lines[j].rstrip("\r\n"))

    while i < n:
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        if _FENCE.match(line):
            j = i + 1
            while j < n and not _FENCE.match(lines[j]):
                j += 1
            j = min(j, n - 1)
            units.append(Unit("code", offsets[i], end_of(j)))
            i = j + 1
            continue
        if _HEADING.match(line):
            units.append(Unit("heading", offsets[i], end_of(i)))
            i += 1
            continue
        m = _ITEM.match(line)
        if m:
            indent = len(m.group(1))
            j = i + 1
            while j < n and lines[j].strip():
                if _FENCE.match(lines[j]) or _HEADING.match(lines[j]):
                    break
                sub = _ITEM.match(lines[j])
                if sub and len(sub.group(1)) <= indent:
                    break
                j += 1
            # an indented continuation after a blank line (a sub-item, a nested code block) stays in the item
            while j < n and not lines[j].strip() and j + 1 < n and lines[j + 1].strip() and \
                    len(lines[j + 1]) - len(lines[j + 1].lstrip()) > indent and not _ITEM.match(lines[j + 1]):
                j += 1
                while j < n and lines[j].strip() and not (_ITEM.match(lines[j]) and
                                                          len(_ITEM.match(lines[j]).group(1)) <= indent):
                    j += 1
            units.append(Unit("item", offsets[i], end_of(j - 1), indent))
            i = j
            continue
        j = i + 1
        while j < n and lines[j].strip() and not (_ITEM.match(lines[j]) or _HEADING.match(lines[j])
                                                   or _FENCE.match(lines[j])):
            j += 1
        units.append(Unit("paragraph", offsets[i], end_of(j - 1)))
        i = j
    return units


@dataclass
class Chunk:
    group: int
    start: int  # characters
    end: int
    tok_start: int = 0  # tokens of the answer
    tok_end: int = 0
    topic: str = ""


def candidate_groups(text: str, min_words: int = DEFAULT_MIN_WORDS,
                     topic_words: int = DEFAULT_TOPIC_WORDS) -> tuple[list[list[Chunk]], list[Unit]]:
    """Candidate async chunks grouped with their siblings (character spans), and the units."""
    units = units_of(text)
    groups: list[list[Unit]] = []
    for k, u in enumerate(units):
        if u.kind not in ("item", "paragraph") or (u.kind == "paragraph" and k == 0):
            continue
        prev = units[k - 1] if k else None
        same = prev is not None and prev.kind == u.kind and groups and groups[-1][-1] is prev and \
            (u.kind == "paragraph" or prev.indent == u.indent)
        if same:
            groups[-1].append(u)
        else:
            groups.append([u])
    out: list[list[Chunk]] = []
    for members in groups:
        chunks = []
        for k, u in enumerate(members):
            end = members[k + 1].start if k + 1 < len(members) else u.end  # separators go with the chunk before
            if len(text[u.start:u.end].split()) >= min_words:
                chunks.append(Chunk(len(out), u.start, end, topic=topic_of(text[u.start:u.end], topic_words)))
        if len(chunks) >= 2:
            for c in chunks:
                c.group = len(out)
            out.append(chunks)
    return out, units


def topic_of(chunk: str, max_words: int = DEFAULT_TOPIC_WORDS) -> str:
    """A topic of at most ``max_words`` words: a bold lead-in, else the chunk's first words."""
    m = _BOLD.match(chunk)
    words_from = m.group(1) if m else re.sub(r"^\s*(?:[-*+]|\d+[.)])\s+", "", chunk)
    words = [re.sub(r"[\"<>*`#_\[\]()]", "", w) for w in words_from.split()]
    words = [w.strip(".,:;!?") for w in words if w.strip(".,:;!?")][:max_words]
    topic = " ".join(words).strip()
    return topic or "part"


# ----------------------------------------------------------------------------------------------------------------
# The likelihood test
# ----------------------------------------------------------------------------------------------------------------


def token_bounds(tokenizer, ids: list[int]) -> list[int]:
    """Character offset where each token starts (and the end), or -1 where a token boundary is not a character
    boundary (a multi-byte character split across tokens)."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    bounds = []
    for i in range(len(ids) + 1):
        prefix = tokenizer.decode(ids[:i], skip_special_tokens=True)
        bounds.append(len(prefix) if full.startswith(prefix) and "\ufffd" not in prefix[-1:] else -1)
    return bounds


def tagless_mask(n: int, blocks: list[tuple[int, int]], syncs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The PASTA mask on an untagged answer of n tokens whose token spans ``blocks`` are async and with syncs
    before the token indices ``syncs``: ``mask[i, j]`` (i sees j) and ``pred[i]`` (the row whose logits predict
    token i: its thread's previous token; -1 = the prompt's last row)."""
    thread = torch.zeros(n, dtype=torch.long)  # 0 = main, k+1 = block k
    start = torch.zeros(len(blocks) + 1, dtype=torch.long)  # [k+1]: block k's first token
    joined = torch.full((len(blocks) + 1,), n + 1, dtype=torch.long)  # [k+1]: the sync that joins block k
    for k, (a, b) in enumerate(blocks):
        thread[a:b] = k + 1
        start[k + 1] = a
        later = [s for s in syncs if s >= b]
        if later:
            joined[k + 1] = min(later)
    idx = torch.arange(n)
    # what a row has "seen" on the main thread: a main row up to itself, a block's rows up to the block's promise
    time = torch.where(thread > 0, start[thread], idx)
    main_col = (thread == 0)[None, :] & (idx[None, :] <= time[:, None])
    joined_col = (thread > 0)[None, :] & (joined[thread][None, :] <= time[:, None])  # synced before the row
    same = thread[:, None] == thread[None, :]
    mask = (idx[None, :] <= idx[:, None]) & (same | main_col | joined_col)
    pred = torch.full((n,), -1, dtype=torch.long)
    last = {0: -1}
    for i in range(n):
        t = int(thread[i])
        if t not in last:  # a block's first token: the last main token before it
            last[t] = last[0]
        pred[i] = last[t]
        last[t] = i
    return mask, pred


@dataclass
class Scorer:
    """Per-token losses of one answer under a mask, with the untouched target (lean forward, true positions)."""

    target: object
    prompt_ids: list[int]
    answer_ids: list[int]
    _prompt_cache: object = None
    _last: torch.Tensor | None = None
    calls: int = 0

    def _prefix(self):
        if self._prompt_cache is None:
            target, p = self.target, len(self.prompt_ids)
            cache = target.new_cache(p + len(self.answer_ids) + 1)
            ids = torch.tensor(self.prompt_ids, dtype=torch.long)
            out = None
            for s in range(0, p, 256):
                e = min(p, s + 256)
                out = target.forward(ids[s:e], torch.arange(s, e), cache, last_only=True)
                cache.keep(range(e - s))
            self._prompt_cache, self._last = cache, out.logits[-1]
        return self._prompt_cache

    def losses(self, mask: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        cache = self._prefix()
        p, n = len(self.prompt_ids), len(self.answer_ids)
        ids = torch.tensor(self.answer_ids, dtype=torch.long)
        out = self.target.forward(ids, torch.arange(p, p + n), cache, mask)  # pending entries, never kept
        self.calls += 1
        logits = torch.cat([self._last[None], out.logits.to(self._last.dtype)])  # row 0 = the prompt's last
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -logp[pred + 1, ids]


# ----------------------------------------------------------------------------------------------------------------
# Annotating one answer
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Annotation:
    text: str  # the answer with tags (== the answer when nothing was kept)
    candidates: int
    kept: int
    syncs: int
    rises: list = field(default_factory=list)  # per candidate: the loss rise (likelihood mode)


def _snap(bounds: list[int], char: int, up: bool) -> int | None:
    """The token index whose start is the nearest clean boundary at or after (up) / at or before ``char``."""
    ok = [(i, b) for i, b in enumerate(bounds) if b >= 0]
    if up:
        return next((i for i, b in ok if b >= char), None)
    return next((i for i, b in reversed(ok) if b <= char), None)


def render(text: str, chunks: list[Chunk], syncs: list[int], token_len) -> str:
    """The annotated text: each chunk as a promise and its block at its place, a sync before each character
    offset in ``syncs``."""
    events = sorted([(c.start, 1, c) for c in chunks] + [(s, 0, None) for s in syncs], key=lambda e: (e[0], e[1]))
    out, pos = [], 0
    for at, kind, c in events:
        out.append(text[pos:at])
        if kind == 0:
            out.append(SYNC_TAG)
            pos = at
        else:
            tens = max(1, round(token_len(c) / 10))
            out.append(f"{promise_tag(c.topic, tens)}{ASYNC_TAG}{text[c.start:c.end]}{END_TAG}")
            pos = c.end
    out.append(text[pos:])
    return "".join(out)


def _drop_useless(kept: list[Chunk], sync_tokens: list[int], n: int) -> tuple[list[Chunk], list[int]]:
    """Leave out a block that runs alongside nothing: the only block before its sync, with no main-thread token
    between its end and that sync (the main thread would just wait for it)."""
    out_chunks, out_syncs, prev = [], [], -1
    for s in sorted(set(sync_tokens)) + [n + 1]:
        run = [c for c in kept if prev <= c.tok_start and c.tok_end <= s]
        lone = len(run) == 1 and (s == run[0].tok_end or (s > n and run[0].tok_end == n))
        if not lone:
            out_chunks += run
            if run and s <= n:
                out_syncs.append(s)
        prev = s
    return out_chunks, out_syncs


def _grown(tokenizer) -> tuple[object, PastaVocab]:
    """A copy of ``tokenizer`` with the PASTA-LANG tokens added, and its vocab: made once per tokenizer and kept in
    its resource slot (:func:`fastforward.model.slots.shared`)."""
    def build():
        grown = copy.deepcopy(tokenizer)
        return grown, add_pasta_tokens(grown)

    return shared(tokenizer, "pasta grown tokenizer", build)


def _joined_syncs(chunks: list[Chunk], syncs: list[int]) -> list[int]:
    """The syncs (character offsets) that still join a block once some groups are left out."""
    out, prev = [], -1
    for s in sorted(syncs):
        if any(prev < c.end <= s for c in chunks):
            out.append(s)
            prev = s
    return out


def _groups_that_pay(tokenizer, prompt_ids, text: str, kept: list[Chunk], syncs: list[int], token_len,
                     min_saving: int) -> tuple[list[Chunk], list[int]]:
    """Keep a group of blocks only if it shortens the answer's critical path by at least ``min_saving`` forwards:
    a promise costs its tag, topic and closing token on the main thread and a sync one more, so short blocks can
    cost more forwards than they save. Measured exactly (the interpreter's schedule, ``pasta_layout``) with and
    without each group, greedily in answer order."""
    grown, vocab = _grown(tokenizer)

    def path(chunks, joins):
        ids = grown(render(text, chunks, joins, token_len), add_special_tokens=False)["input_ids"]
        return pasta_layout(list(prompt_ids), ids, vocab, ()).forwards

    current = path(kept, syncs)
    for g in sorted({c.group for c in kept}):
        without = [c for c in kept if c.group != g]
        joins = _joined_syncs(without, syncs)
        shorter = path(without, joins)
        if shorter - current < min_saving:
            kept, syncs, current = without, joins, shorter
    return kept, syncs


def _snapped_chunks(groups: list[list[Chunk]], bounds: list[int], text: str, min_words: int) -> list[Chunk]:
    """The candidate chunks snapped inward to token boundaries (their token span set on each), those that end up
    too short or too long for a block left out."""
    chunks: list[Chunk] = []
    for group in groups:
        for c in group:
            a, b = _snap(bounds, c.start, up=True), _snap(bounds, c.end, up=False)
            if a is None or b is None or b - a < 2 or b - a > thread_cap(MAX_TENS) - 10:
                continue
            c.tok_start, c.tok_end, c.start, c.end = a, b, bounds[a], bounds[b]
            if c.end > c.start and len(text[c.start:c.end].split()) >= min_words:
                chunks.append(c)
    return chunks


def _groups_of_two(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    """The chunks by group, only the groups that still have two or more."""
    by_group: dict[int, list[Chunk]] = {}
    for c in chunks:
        by_group.setdefault(c.group, []).append(c)
    return {g: cs for g, cs in by_group.items() if len(cs) >= 2}


def _unmarked_start(text: str, bounds: list[int], c: Chunk) -> int:
    """The chunk's first token after a list item's marker ("2."): at inference the fork sees the earlier promises,
    which carry the count, but the untagged text cannot show them, so the marker is left out of its score."""
    m = _MARKER.match(text, c.start)
    a = c.tok_start
    if m is not None:
        a = next((i for i in range(c.tok_start, c.tok_end) if bounds[i] >= m.end()), c.tok_end)
    if a >= c.tok_end:
        a = c.tok_start
    return a


def _keep_by_rise(scorer, causal: torch.Tensor, text: str, bounds: list[int], candidates: list[Chunk],
                  group_ends: list[int], n: int, threshold: float) -> tuple[list[Chunk], list[float]]:
    """(a) every candidate async, each group joined right after it (``group_ends``): each chunk loses only its
    siblings; the chunks whose mean loss rises by at most ``threshold`` are kept. Returns them and every rise."""
    blocks = [(c.tok_start, c.tok_end) for c in candidates]
    hidden = scorer.losses(*tagless_mask(n, blocks, group_ends))
    kept, rises = [], []
    for c in candidates:
        a = _unmarked_start(text, bounds, c)
        rise = float(hidden[a:c.tok_end].mean() - causal[a:c.tok_end].mean())
        rises.append(rise)
        if rise <= threshold:
            kept.append(c)
    return kept, rises


def _sync_tokens(scorer, causal: torch.Tensor, kept: list[Chunk], units: list[Unit], bounds: list[int],
                 starts: dict, n: int, sync_threshold: float) -> list[int]:
    """(b) the kept chunks async, groups joined right before the next group's first block, none at the end: each
    group's sync moves up to the first main-thread unit after its first block whose mean loss rises by more than
    ``sync_threshold``."""
    kept_groups = sorted({c.group for c in kept})
    sync_tokens: list[int] = []
    if not kept:
        return sync_tokens
    next_start = {g: (starts[kept_groups[k + 1]] if k + 1 < len(kept_groups) else n)
                  for k, g in enumerate(kept_groups)}
    first_kept = {g: min(c.tok_start for c in kept if c.group == g) for g in kept_groups}
    forced = [next_start[g] for g in kept_groups if next_start[g] < n]
    blocks = [(c.tok_start, c.tok_end) for c in kept]
    alone = scorer.losses(*tagless_mask(n, blocks, forced))
    in_block = torch.zeros(n, dtype=torch.bool)
    for a, b in blocks:
        in_block[a:b] = True
    for g in kept_groups:
        chosen = next_start[g] if next_start[g] < n else None
        for u in units:  # the main-thread units between this group's first block and the next group
            a, b = _snap(bounds, u.start, up=True), _snap(bounds, u.end, up=False)
            if a is None or b is None or b <= a or a < first_kept[g] or a >= next_start[g]:
                continue
            main = ~in_block[a:b]
            if not main.any():
                continue
            rise = float(alone[a:b][main].mean() - causal[a:b][main].mean())
            if rise > sync_threshold:
                chosen = a
                break
        if chosen is not None:
            sync_tokens.append(chosen)
    return sync_tokens


def _checked_annotation(text: str, kept: list[Chunk], syncs: list[int], token_len, candidates: int,
                        rises: list[float]) -> Annotation:
    """The annotated answer, if it parses back to the plain answer; else (or with nothing kept) the plain one."""
    if not kept:
        return Annotation(text, candidates, 0, 0, rises)
    annotated = render(text, kept, syncs, token_len)
    try:
        doc = parse(annotated)
    except PastaSyntaxError:
        return Annotation(text, candidates, 0, 0, rises)
    if doc.plain() != text:  # pragma: no cover - render keeps every character by construction
        return Annotation(text, candidates, 0, 0, rises)
    return Annotation(annotated, candidates, len(kept), annotated.count(SYNC_TAG), rises)


def annotate_answer(target, prompt_ids, answer_ids, *, mode: str = "likelihood",
                    threshold: float = DEFAULT_THRESHOLD, sync_threshold: float = DEFAULT_SYNC_THRESHOLD,
                    min_words: int = DEFAULT_MIN_WORDS, topic_words: int = DEFAULT_TOPIC_WORDS,
                    min_saving: int | None = DEFAULT_MIN_SAVING) -> Annotation:
    """The PASTA-LANG annotation of one answer (token ids, EOS excluded) by the recipe of the module docstring.
    ``min_saving`` (likelihood mode; None: off) drops every group of blocks that saves fewer forwards."""
    tokenizer = target.tokenizer
    answer_ids = [int(t) for t in answer_ids]
    text = tokenizer.decode(answer_ids, skip_special_tokens=True)
    groups, units = candidate_groups(text, min_words, topic_words)
    if not groups:
        return Annotation(text, 0, 0, 0)
    bounds = token_bounds(tokenizer, answer_ids)
    by_group = _groups_of_two(_snapped_chunks(groups, bounds, text, min_words))
    candidates = [c for g in sorted(by_group) for c in by_group[g]]
    if not candidates:
        return Annotation(text, 0, 0, 0)
    n = len(answer_ids)
    group_ids = sorted(by_group)
    # the token where each group ends (its last chunk's end) and where the next one starts
    ends = {g: by_group[g][-1].tok_end for g in group_ids}
    starts = {g: by_group[g][0].tok_start for g in group_ids}
    rises: list[float] = []
    if mode == "structure":
        kept = candidates
        sync_tokens = [ends[g] for g in group_ids if ends[g] < n]
    else:
        scorer = Scorer(target, list(prompt_ids), answer_ids)
        causal = scorer.losses(*tagless_mask(n, [], []))
        kept, rises = _keep_by_rise(scorer, causal, text, bounds, candidates, [ends[g] for g in group_ids], n,
                                    threshold)
        sync_tokens = _sync_tokens(scorer, causal, kept, units, bounds, starts, n, sync_threshold)
    sync_tokens = sorted({t for t in sync_tokens if any(c.tok_end <= t for c in kept)})
    kept, sync_tokens = _drop_useless(kept, sync_tokens, n)
    syncs = [bounds[t] for t in sync_tokens]
    token_len = lambda c: c.tok_end - c.tok_start  # noqa: E731
    if kept and mode == "likelihood" and min_saving is not None:
        kept, syncs = _groups_that_pay(tokenizer, prompt_ids, text, kept, syncs, token_len, min_saving)
    return _checked_annotation(text, kept, syncs, token_len, len(candidates), rises)


def annotated_ids(tokenizer, text: str, vocab: PastaVocab) -> list[int]:
    """The annotated answer as token ids (the tags as their special tokens), checked with the token grammar."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    parse_ids(ids, vocab)
    return ids


# ----------------------------------------------------------------------------------------------------------------
# Files: make-data records in, annotated records out (append-only, resumable)
# ----------------------------------------------------------------------------------------------------------------


MAKE_DATA_KEYS = ("prompt_ids", "response_ids")


def make_data_file(src) -> Path:
    """The file of make-data records a command reads: a make-data folder's ``responses.jsonl``, or the file given."""
    src = Path(src).expanduser()
    if src.is_dir():
        src = src / RESPONSES
    if not src.is_file():
        raise UsageError(f"{src} does not exist (give a make-data folder or its responses.jsonl)")
    return src


def read_make_data(src: Path) -> list[dict]:
    """The records of ``src`` (:func:`make_data_file`), each with ``prompt_ids`` and ``response_ids`` lists of
    token ids; a malformed record or an empty file is a one-line :class:`UsageError` naming the file (and line)."""
    return read_records([src], MAKE_DATA_KEYS, "a make-data record (prompt_ids, response_ids)")


def check_records_output(out, src: Path, key: str) -> Path:
    """The JSONL output of a resumable pasta command, checked before any work: a file in an existing writable folder,
    not the input ``src``, and -- when it exists -- one the command wrote, every record carrying ``key``, so that
    appending to it never mixes into somebody else's file."""
    out = Path(out).expanduser()
    if out.is_file() and out.samefile(src):
        raise UsageError("the output must not be the input file")
    return check_output_file(out, "OUT", owned=lambda file: _every_record_has(file, key))


def _every_record_has(path: Path, key: str) -> bool:
    """Every record in a bounded prefix of ``path`` carries ``key`` (:func:`~fastforward.paths.owned_jsonl`)."""
    return owned_jsonl(path, lambda record: key in record)


def check_annotate(src, out, mode: str, threshold: float, sync_threshold: float, min_words: int,
                   topic_words: int = DEFAULT_TOPIC_WORDS, min_saving: int | None = DEFAULT_MIN_SAVING
                   ) -> tuple[Path, Path]:
    """The input file (a make-data folder or its responses.jsonl) and the output file, checked before the model
    loads."""
    src = make_data_file(src)
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    for name, value in (("threshold", threshold), ("sync threshold", sync_threshold)):
        if not isinstance(value, (int, float)) or value != value or value < 0:
            raise UsageError(f"the {name} must be a number >= 0 (nats), got {value!r}")
    if not isinstance(min_words, int) or min_words < 1:
        raise UsageError(f"min_words must be a positive integer, got {min_words!r}")
    if not isinstance(topic_words, int) or isinstance(topic_words, bool) or topic_words < 1:
        raise UsageError(f"topic_words must be a positive integer, got {topic_words!r}")
    if min_saving is not None and (not isinstance(min_saving, int) or isinstance(min_saving, bool)):
        raise UsageError(f"min_saving must be an integer number of forwards, got {min_saving!r}")
    out = check_records_output(out, src, "pasta")
    read_make_data(src)  # every record checked now, not after the model loaded
    return src, out


def annotate_file(target, src, out, *, mode: str = "likelihood", threshold: float = DEFAULT_THRESHOLD,
                  sync_threshold: float = DEFAULT_SYNC_THRESHOLD, min_words: int = DEFAULT_MIN_WORDS,
                  topic_words: int = DEFAULT_TOPIC_WORDS, min_saving: int | None = DEFAULT_MIN_SAVING,
                  limit: int | None = None, log=print) -> dict:
    """Annotate every make-data record of ``src`` into ``out`` (JSONL, one record per line, flushed as written);
    records already in ``out`` (by key) are skipped, so a killed run resumes where it stopped. Each record keeps
    the input's fields and adds ``response`` (the answer's text), ``pasta`` (annotated; equal to ``response`` when
    nothing was kept), ``pasta_candidates``, ``pasta_kept``, ``pasta_syncs``, ``pasta_mode``."""
    src, out = check_annotate(src, out, mode, threshold, sync_threshold, min_words, topic_words, min_saving)
    records = read_make_data(src)
    if limit is not None:
        records = records[:limit]
    done = {r.get("key") for _, r in jsonl_records(out, repair=True)} if out.exists() else set()
    eos = target.eos_token_ids
    counts = {"records": len(records), "skipped": 0, "annotated": 0, "with_tags": 0}
    with open(out, "a", encoding="utf-8") as f:
        for k, rec in enumerate(records):
            if rec.get("key") in done:
                counts["skipped"] += 1
                continue
            answer = [t for t in rec["response_ids"] if t not in eos]
            ann = annotate_answer(target, rec["prompt_ids"], answer, mode=mode, threshold=threshold,
                                  sync_threshold=sync_threshold, min_words=min_words, topic_words=topic_words,
                                  min_saving=min_saving)
            row = dict(rec)
            plain = target.tokenizer.decode(answer, skip_special_tokens=True)
            row.update(response=plain, pasta=ann.text, pasta_candidates=ann.candidates, pasta_kept=ann.kept,
                       pasta_syncs=ann.syncs, pasta_mode=mode, pasta_rises=[round(r, 4) for r in ann.rises])
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            counts["annotated"] += 1
            counts["with_tags"] += int(ann.kept > 0)
            if log is not None and (counts["annotated"] % 10 == 0 or k + 1 == len(records)):
                log(f"[pasta annotate] {k + 1}/{len(records)}: {counts['with_tags']} of {counts['annotated']} "
                    "annotated this run have tags")
    return counts
