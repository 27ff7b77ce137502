"""PASTA-LANG: the annotation language a PASTA model writes into its own answers, and its strict parser.

Three tags (the paper's, arXiv 2502.11517 §3)::

    <promise topic="TOPIC" tokens=N/>   a placeholder: a block of about 10*N tokens on TOPIC will be written
    <async>...</async>                  that block (right after its promise); decoded by a thread of its own
    <sync/>                             wait for every outstanding block; what follows may depend on them

Choices the paper leaves open (named here, and the same in the parser, the interpreter and training):

* **Tokens.** The fixed parts are added special tokens, appended after the tokenizer's vocabulary so no existing id
  changes: ``<promise topic="``, ``" tokens=N/>`` (one token per N in 1..:data:`MAX_TENS`, so the promise is
  complete, and its length known, the moment that token is chosen), ``<async>``, ``</async>``, ``<sync/>``. The
  topic stays ordinary text. Every fixed part is a string that ordinary text practically never contains, so adding
  them leaves the tokenization of plain text alone.
* **Written form.** Exactly ``<promise topic="T" tokens=N/>``: attributes in that order, the topic in double quotes,
  N an unquoted integer in 1..:data:`MAX_TENS` (Pred-10X: N counts tens of tokens), self-closing, no extra spaces.
  The topic is non-empty, one line, without ``"``, ``<`` or ``>``.
* **Blocks.** Every promise is followed immediately by exactly one ``<async>`` block, which is non-empty and
  contains no tag at all: no nesting.
* **Sync.** ``<sync/>`` needs at least one block since the previous sync (a sync with nothing to wait for is an
  error). The end of the answer (EOS, or the end of the text) is an implicit sync.
* **EOS.** Nothing follows EOS; EOS inside a promise or a block is an error.
* **Length cap.** A block holds at most :func:`thread_cap` (N) = 20*N + 10 tokens (checked on token ids; the
  interpreter closes a thread that reaches it).

:func:`parse` checks a text and returns a :class:`PastaDoc`; :func:`strip` gives the plain text;
:func:`parse_ids` checks token ids (the interpreter's output, training data) and returns where every block lies.
Every malformed input raises one :class:`~fastforward.errors.PastaSyntaxError` with a one-line message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import PastaSyntaxError

MAX_TENS = 50  # the largest promised length, in tens of tokens
OPEN = '<promise topic="'
ASYNC = "<async>"
END_ASYNC = "</async>"
SYNC = "<sync/>"


def close_tag(tens: int) -> str:
    """The fixed closing part of a promise promising ``tens`` tens of tokens."""
    return f'" tokens={tens}/>'


def thread_cap(tens: int) -> int:
    """The most content tokens a block promised as ``tens`` tens of tokens may hold (twice the promise + 10)."""
    return 20 * tens + 10


def promise_tag(topic: str, tens: int) -> str:
    return f"{OPEN}{topic}{close_tag(tens)}"


#: every added special token, in the order their ids are appended
PASTA_TOKENS = (OPEN, ASYNC, END_ASYNC, SYNC) + tuple(close_tag(n) for n in range(1, MAX_TENS + 1))


# ----------------------------------------------------------------------------------------------------------------
# The parsed form
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Promise:
    topic: str
    tens: int
    content: str  # the <async> block's text


@dataclass(frozen=True)
class Sync:
    pass


@dataclass
class PastaDoc:
    """An annotated answer: main-thread text, promises with their blocks, syncs, in logical order."""

    segments: list = field(default_factory=list)
    eos: str = ""  # the EOS text that ended it, if any

    def render(self) -> str:
        """The annotated text (``parse(doc.render()) == doc``)."""
        out = []
        for s in self.segments:
            if isinstance(s, Text):
                out.append(s.text)
            elif isinstance(s, Promise):
                out.append(f"{promise_tag(s.topic, s.tens)}{ASYNC}{s.content}{END_ASYNC}")
            else:
                out.append(SYNC)
        return "".join(out) + self.eos

    def plain(self) -> str:
        """The text without any tag or topic: what a reader sees."""
        return "".join(s.text if isinstance(s, Text) else s.content if isinstance(s, Promise) else ""
                       for s in self.segments)

    @property
    def promises(self) -> list[Promise]:
        return [s for s in self.segments if isinstance(s, Promise)]


# ----------------------------------------------------------------------------------------------------------------
# The grammar, over items from either lexer (text or token ids)
# ----------------------------------------------------------------------------------------------------------------

# item kinds
T_TEXT, T_OPEN, T_CLOSE, T_ASYNC, T_END, T_SYNC, T_EOS = range(7)
_NAMES = {T_OPEN: "<promise", T_CLOSE: "the promise's closing tokens=N/>", T_ASYNC: ASYNC, T_END: END_ASYNC,
          T_SYNC: SYNC, T_EOS: "EOS"}


@dataclass
class _Item:
    kind: int
    at: int  # where it starts (character or token index)
    end: int  # one past its end
    value: object = None  # text: the string (or None for ids); close: tens


@dataclass
class Block:
    """One promise and its block, as spans of the input (characters or token indices)."""

    open_at: int  # the promise's first item
    close_at: int  # the promise's closing item (tokens=N/>)
    tens: int
    topic: tuple[int, int]  # span of the topic text
    async_at: int  # the <async> item
    content: tuple[int, int]  # span of the content
    end_at: int  # the </async> item
    synced_at: int | None = None  # the <sync/> that joins it (None: the end of the answer)


@dataclass
class Structure:
    blocks: list[Block]
    syncs: list[int]  # where each <sync/> is
    eos_at: int | None  # where EOS is (None: no EOS)


def _fail(message: str, at: int, unit: str):
    raise PastaSyntaxError(f"PASTA-LANG: {message} (at {unit} {at})")


def _grammar(items: list[_Item], unit: str, check_topic=None, count=None) -> Structure:
    """Check the item sequence against the grammar; ``check_topic(span)`` may reject a topic's text,
    ``count(span)`` gives a block's length in tokens (to check the cap)."""
    blocks: list[Block] = []
    syncs: list[int] = []
    unsynced: list[Block] = []
    state = "main"  # main | topic | promised | block | after_eos
    cur: dict = {}
    eos_at = None
    for it in items:
        k = it.kind
        if state == "after_eos":
            if k == T_TEXT and it.value == "":
                continue
            _fail("text after EOS", it.at, unit)
        if state == "main":
            if k == T_TEXT:
                continue
            if k == T_OPEN:
                state, cur = "topic", {"open": it}
            elif k == T_SYNC:
                if not unsynced:
                    _fail("<sync/> with nothing to wait for (no <promise/> since the last sync)", it.at, unit)
                for b in unsynced:
                    b.synced_at = it.at
                unsynced = []
                syncs.append(it.at)
            elif k == T_EOS:
                state, eos_at = "after_eos", it.at
            elif k == T_ASYNC:
                _fail("<async> without a <promise/> right before it", it.at, unit)
            elif k == T_END:
                _fail("</async> without an open <async>", it.at, unit)
            elif k == T_CLOSE:
                _fail("tokens=N/> without an open <promise", it.at, unit)
        elif state == "topic":
            if k == T_TEXT and "topic" not in cur:
                cur["topic"] = it
            elif k == T_CLOSE:
                topic = cur.get("topic")
                if topic is None or topic.end == topic.at:
                    _fail("a <promise/> needs a non-empty topic", it.at, unit)
                if check_topic is not None:
                    check_topic((topic.at, topic.end))
                state, cur["close"] = "promised", it
            else:
                _fail(f"unterminated <promise tag: {_NAMES.get(k, 'text')} before its tokens=N/>",
                      it.at, unit)
        elif state == "promised":
            if k != T_ASYNC:
                _fail("a <promise/> must be followed immediately by its <async> block", it.at, unit)
            state, cur["async"] = "block", it
        elif state == "block":
            if k == T_TEXT and "content" not in cur:
                cur["content"] = it
            elif k == T_END:
                content = cur.get("content")
                if content is None or content.end == content.at:
                    _fail("empty <async> block", it.at, unit)
                tens = cur["close"].value
                if count is not None and count((content.at, content.end)) > thread_cap(tens):
                    _fail(f"<async> block of {count((content.at, content.end))} tokens exceeds the cap "
                          f"{thread_cap(tens)} for tokens={tens}", it.at, unit)
                block = Block(cur["open"].at, cur["close"].at, tens, (cur["topic"].at, cur["topic"].end),
                              cur["async"].at, (content.at, content.end), it.at)
                blocks.append(block)
                unsynced.append(block)
                state, cur = "main", {}
            elif k == T_EOS:
                _fail("EOS inside an <async> block", it.at, unit)
            else:
                _fail(f"{_NAMES[k]} inside an <async> block (tags do not nest)", it.at, unit)
    end = items[-1].end if items else 0
    if state == "topic":
        _fail("unterminated <promise tag", end, unit)
    if state == "promised":
        _fail("a <promise/> without its <async> block", end, unit)
    if state == "block":
        _fail("unterminated <async> block (no </async>)", end, unit)
    return Structure(blocks, syncs, eos_at)


# ----------------------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------------------

_TAGLIKE = re.compile(r'<promise|</?async|<sync|" tokens=')
_ATTR = re.compile(r'\s*([A-Za-z_][\w-]*)\s*=\s*("[^"]*"|\'[^\']*\'|[^\s/>]+)')
_CLOSE_TEXT = re.compile(r'" tokens=(\d+)/>')


def _check_tens(raw: str, at: int) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", raw):
        _fail(f"tokens must be a positive integer (tens of tokens), got {raw!r}", at, "character")
    tens = int(raw)
    if not 1 <= tens <= MAX_TENS:
        _fail(f"tokens must be in 1..{MAX_TENS} (tens of tokens), got {tens}", at, "character")
    return tens


def _promise_error(text: str, i: int) -> None:
    """Explain why the promise tag at ``i`` is not exactly ``<promise topic="T" tokens=N/>``."""
    j = i + len("<promise")
    end = j
    while end < len(text) and text[end] not in "<>\n":
        end += 1
    if end >= len(text) or text[end] != ">":
        _fail("unterminated <promise tag (no closing />)", i, "character")
    body = text[j:end]
    if not body.endswith("/"):
        _fail("a <promise> tag must be self-closing (end with />)", i, "character")
    body = body[:-1]
    if body and not body[0].isspace():
        _fail(f"malformed <promise tag: {text[i:end + 1][:40]!r}", i, "character")
    attrs, pos = [], 0
    for m in _ATTR.finditer(body):
        if m.start() != pos:
            break
        attrs.append((m.group(1), m.group(2)))
        pos = m.end()
    if body[pos:].strip():
        _fail(f"malformed attributes in <promise/>: {body[pos:].strip()[:30]!r}", i, "character")
    names = [a for a, _ in attrs]
    for name in names:
        if name not in ("topic", "tokens"):
            _fail(f"unknown <promise/> attribute {name!r} (only topic and tokens)", i, "character")
        if names.count(name) > 1:
            _fail(f"duplicate <promise/> attribute {name!r}", i, "character")
    for name in ("topic", "tokens"):
        if name not in names:
            _fail(f"<promise/> is missing the {name} attribute", i, "character")
    values = dict(attrs)
    if not values["topic"].startswith('"'):
        _fail("the topic must be in double quotes", i, "character")
    raw = values["tokens"]
    if raw.startswith(("'", '"')):
        _fail(f"tokens must be an unquoted integer, got {raw}", i, "character")
    _check_tens(raw, i)
    if values["topic"] == '""':
        _fail("a <promise/> needs a non-empty topic", i, "character")
    if names != ["topic", "tokens"]:
        _fail("<promise/> attributes must come in the order topic, tokens", i, "character")
    _fail('write the promise exactly as <promise topic="T" tokens=N/> (one space, no space before />)', i,
          "character")


def _lex_text(text: str, eos: str | None) -> list[_Item]:
    items: list[_Item] = []
    pos, n = 0, len(text)

    def add_text(a, b):
        if b > a:
            items.append(_Item(T_TEXT, a, b, text[a:b]))

    eos_at = text.find(eos) if eos else -1
    limit = eos_at if eos_at >= 0 else n
    scan = 0  # where to look for the next tag (text from ``pos`` on is not taken yet)
    while scan < limit:
        m = _TAGLIKE.search(text, scan, limit)
        if m is None:
            break
        i = m.start()
        scan = i + 1
        if m.group() == '" tokens=':
            c = _CLOSE_TEXT.match(text, i)
            if c is None:
                continue  # ordinary text
            add_text(pos, i)
            items.append(_Item(T_CLOSE, i, c.end(), _check_tens(c.group(1), i)))
            pos = scan = c.end()
            continue
        add_text(pos, i)
        if text.startswith(OPEN, i):
            j = i + len(OPEN)
            q = text.find('"', j, limit)
            if q < 0:
                _fail("unterminated <promise tag (no closing quote)", i, "character")
            if any(ch in text[j:q] for ch in "\n<>"):
                _fail("a topic must be one line without '\"', '<' or '>'", i, "character")
            c = _CLOSE_TEXT.match(text, q)
            if c is None:
                _promise_error(text, i)
            items.append(_Item(T_OPEN, i, j))
            items.append(_Item(T_TEXT, j, q, text[j:q]))
            items.append(_Item(T_CLOSE, q, c.end(), _check_tens(c.group(1), q)))
            pos = scan = c.end()
        elif m.group() == "<promise":
            _promise_error(text, i)
        elif m.group() == "<async":
            if not text.startswith(ASYNC, i):
                _fail("malformed <async> tag (write <async>; the topic goes on the <promise/>)", i, "character")
            items.append(_Item(T_ASYNC, i, i + len(ASYNC)))
            pos = scan = i + len(ASYNC)
        elif m.group() == "</async":
            if not text.startswith(END_ASYNC, i):
                _fail("malformed </async> tag", i, "character")
            items.append(_Item(T_END, i, i + len(END_ASYNC)))
            pos = scan = i + len(END_ASYNC)
        else:  # <sync
            if not text.startswith(SYNC, i):
                _fail("malformed <sync/> tag (it is self-closing: <sync/>)", i, "character")
            items.append(_Item(T_SYNC, i, i + len(SYNC)))
            pos = scan = i + len(SYNC)
    add_text(pos, limit)
    if eos_at >= 0:
        items.append(_Item(T_EOS, eos_at, eos_at + len(eos)))
        rest = eos_at + len(eos)
        if rest < n:
            items.append(_Item(T_TEXT, rest, n, text[rest:]))
    return items


def parse(text: str, eos: str | None = None) -> PastaDoc:
    """The annotated answer ``text`` as a :class:`PastaDoc`; a :class:`PastaSyntaxError` when malformed.
    ``eos``: the EOS string (e.g. ``<|im_end|>``) if the text may contain it; nothing may follow it."""
    if not isinstance(text, str):
        raise PastaSyntaxError(f"PASTA-LANG: expected a string, got {type(text).__name__}")
    items = _lex_text(text, eos)

    def check_topic(span):
        topic = text[span[0]:span[1]]
        if topic.strip() != topic or not topic.strip():
            _fail("a topic must not start or end with spaces", span[0], "character")

    structure = _grammar(items, "character", check_topic)
    doc = PastaDoc()
    blocks = {b.open_at: b for b in structure.blocks}
    syncs = set(structure.syncs)
    skip_until = -1
    for it in items:
        if it.at < skip_until:
            continue
        if it.kind == T_EOS:
            doc.eos = eos
            break
        if it.at in blocks:
            b = blocks[it.at]
            doc.segments.append(Promise(text[b.topic[0]:b.topic[1]], b.tens, text[b.content[0]:b.content[1]]))
            skip_until = b.end_at + 1
        elif it.kind == T_SYNC and it.at in syncs:
            doc.segments.append(Sync())
        elif it.kind == T_TEXT:
            doc.segments.append(Text(it.value))
    return doc


def strip(text: str, eos: str | None = None) -> str:
    """The plain text of an annotated answer (checked first: malformed input raises)."""
    return parse(text, eos).plain()


# ----------------------------------------------------------------------------------------------------------------
# Token ids
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PastaVocab:
    """The ids of PASTA-LANG's special tokens in one tokenizer."""

    open: int
    async_: int
    end_async: int
    sync: int
    close: dict  # token id -> tens

    @classmethod
    def from_tokenizer(cls, tokenizer) -> PastaVocab | None:
        """The ids in ``tokenizer``, or None when it has no PASTA-LANG tokens (a model never trained for it)."""
        vocab = tokenizer.get_vocab()
        if not all(t in vocab for t in PASTA_TOKENS):
            return None
        return cls(vocab[OPEN], vocab[ASYNC], vocab[END_ASYNC], vocab[SYNC],
                   {vocab[close_tag(n)]: n for n in range(1, MAX_TENS + 1)})

    @property
    def all_ids(self) -> list[int]:
        return [self.open, self.async_, self.end_async, self.sync, *self.close]

    def is_tag(self, token: int) -> bool:
        return token in (self.open, self.async_, self.end_async, self.sync) or token in self.close


def add_pasta_tokens(tokenizer) -> PastaVocab:
    """Add PASTA-LANG's fixed parts to ``tokenizer`` as special tokens (appended: existing ids do not change);
    tokens already there are kept. Works on fastforward's light tokenizer and on transformers' tokenizers."""
    from tokenizers import AddedToken

    have = tokenizer.get_vocab()
    new = [AddedToken(t, special=True, normalized=False) for t in PASTA_TOKENS if t not in have]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    vocab = PastaVocab.from_tokenizer(tokenizer)
    if vocab is None:  # pragma: no cover - a tokenizer that silently refuses added tokens
        raise PastaSyntaxError("the tokenizer did not take the PASTA-LANG tokens")
    return vocab


def _lex_ids(ids: list[int], vocab: PastaVocab, eos_ids) -> list[_Item]:
    items: list[_Item] = []
    start = None
    kinds = {vocab.open: T_OPEN, vocab.async_: T_ASYNC, vocab.end_async: T_END, vocab.sync: T_SYNC}
    for i, t in enumerate(ids):
        kind = T_EOS if t in eos_ids else kinds.get(t, T_CLOSE if t in vocab.close else T_TEXT)
        if kind == T_TEXT:
            if start is None:
                start = i
            continue
        if start is not None:
            items.append(_Item(T_TEXT, start, i))
            start = None
        items.append(_Item(kind, i, i + 1, vocab.close.get(t)))
    if start is not None:
        items.append(_Item(T_TEXT, start, len(ids)))
    return items


def parse_ids(ids, vocab: PastaVocab, eos_ids=()) -> Structure:
    """Check an annotated answer given as token ids (prompt excluded) and return its blocks and syncs (as token
    indices). The same grammar as :func:`parse`, plus the length cap of every block."""
    ids = [int(t) for t in ids]
    items = _lex_ids(ids, vocab, set(eos_ids))
    return _grammar(items, "token", count=lambda span: span[1] - span[0])


def strip_ids(ids, vocab: PastaVocab | None) -> list[int]:
    """The ids without PASTA-LANG tags and topics (lenient: for possibly truncated interpreter output)."""
    if vocab is None:
        return list(ids)
    out, in_topic = [], False
    for t in ids:
        if t == vocab.open:
            in_topic = True
        elif t in vocab.close:
            in_topic = False
        elif not in_topic and not vocab.is_tag(t):
            out.append(t)
    return out
