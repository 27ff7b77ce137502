"""The generated text, built incrementally: detokenizing, stop strings and streaming in work bounded per step.

Decoding the whole generation again after every step (to look for a stop string, or to find the new text to
stream) costs time proportional to its length, every step. The classes here decode only a short window of recent
tokens per step and look for stop strings only in a short tail of the text, yet give exactly the same text, the same
stopping token and the same streamed pieces as decoding everything each time.

* :class:`IncrementalDetokenizer` -- ``decode(ids)`` of a growing id sequence, one bounded window at a time.
* :class:`StopMatcher` -- on top of it: the first token that completes a stop string, the text cut before the stop
  string, and the text that may be shown while streaming (held back while it could still be the start of a stop
  string, or ends in an incomplete multi-byte character).

Assumption (true of byte-level BPE such as SmolLM2's, of SentencePiece/Metaspace decoders and of the test
tokenizers): decoding is concatenative at a point where the text so far ends with a complete character, up to
the decoder's leading-space handling at the start of a sequence -- which is why each window is decoded from a
*prefix offset* one chunk before the read offset, and only the difference is taken (as inference servers do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete (or invalid) UTF-8 sequence


class IncrementalDetokenizer:
    """``decode(ids)`` of a growing sequence of token ids, decoding a bounded window per :meth:`push`.

    Two offsets into the ids: the text of ``ids[:read]`` is *stable* (final: it ends with a complete character,
    so later tokens cannot change it), and ``prefix <= read`` is where the next window's decoding starts. A push
    decodes ``ids[prefix:]`` and takes what comes after the decoding of ``ids[prefix:read]``: that difference is the
    new text. If it ends with U+FFFD (a multi-byte character split across tokens) or is empty it stays *pending*;
    otherwise it becomes stable and the offsets move up (``prefix`` to the old ``read``, ``read`` to the end).

    For every prefix of the pushed ids, ``stable text + pending == decode(ids)``; the concatenation of everything
    :meth:`push` returned plus :meth:`flush` is ``decode(all ids)``. The window holds the last stable chunk's tokens
    plus the pending ones (a few tokens, except during a run of tokens whose text keeps ending in U+FFFD).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # the text of ids[:read] is stable
        self._prefix_chars = 0  # len(decode(ids[prefix:read]))
        self._pending = ""  # decode(ids) minus the stable text
        self._pieces: list[str] = []  # the stable text, in the pieces push returned
        self.stable_length = 0  # characters of stable text
        self.flushed = False

    # -- queries ---------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> str:
        """The text after the stable text: empty, or (usually) ending in an incomplete character."""
        return self._pending

    @property
    def text(self) -> str:
        """``decode(ids)`` of all ids pushed so far (joins the pieces: linear in the length; for the end)."""
        return "".join(self._pieces) + self._pending

    # -- updates -----------------------------------------------------------------------------------------------------
    def push(self, ids: Iterable[int]) -> str:
        """Append token ids; return the text that became stable (possibly empty)."""
        ids = list(ids)
        stable, pending = self._peek(ids)
        self._commit(ids, stable, pending)
        return stable

    def flush(self) -> str:
        """The pending text, as final (the sequence is complete); nothing may be pushed afterwards."""
        rest, self._pending = self._pending, ""
        if rest:
            self._pieces.append(rest)
            self.stable_length += len(rest)
        self.flushed = True
        return rest

    def _peek(self, ids: list[int]) -> tuple[str, str]:
        """(newly stable text, pending text) if ``ids`` were pushed; changes nothing."""
        if self.flushed:
            raise RuntimeError("IncrementalDetokenizer: push after flush")
        if not ids:
            return "", self._pending
        window = self._decode(self.ids[self._prefix :] + ids)
        new = window[self._prefix_chars :]
        if new and not new.endswith(REPLACEMENT):
            return new, ""
        return "", new

    def _commit(self, ids: list[int], stable: str, pending: str) -> None:
        """Push ``ids`` whose :meth:`_peek` gave ``(stable, pending)``."""
        self.ids.extend(ids)
        self._pending = pending
        if stable:
            end = len(self.ids)
            # The next window starts one chunk back: decoders that treat the first token specially (a leading
            # space dropped) do so identically in the window and in its prefix, and the difference is exact.
            self._prefix_chars = len(self._decode(self.ids[self._read : end]))
            self._prefix, self._read = self._read, end
            self._pieces.append(stable)
            self.stable_length += len(stable)


def cut_at_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where ``text`` is cut for ``stops``, or None if it contains none: each stop string in turn cuts the text
    before its first occurrence (a later stop string only counts if it lies wholly before the cuts so far)."""
    limit = len(text)
    for s in stops:
        at = text.find(s, 0, limit)  # wholly inside text[:limit]
        if at >= 0:
            limit = at
    return limit if limit < len(text) else None  # an occurrence starts before the end: stops are non-empty


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may be the start of a stop string (the longest such tail)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class StopMatcher:
    """The generated text with stop strings: which token completes a stop string, the text cut before it, and the
    pieces to show while streaming -- looking only at a tail of the text each step.

    Feed it the generated tokens (after the prompt) as they are accepted. Text is compared in a *window*: the last
    ``2 * longest stop`` characters of the stable text before this feed, the newly stable text and the pending
    text. That suffices because the text before never contained a stop string (else the run would have stopped),
    so a new occurrence must end in the new text; and the stable text never changes.

    Equivalent, for every sequence of feeds, to decoding all tokens each time:

    * :meth:`feed` returns the first j such that ``decode(tokens so far + tokens[:j])`` contains a stop string;
    * :meth:`text` is ``decode(all tokens)`` cut before the stop string (:func:`cut_at_stop`);
    * :meth:`visible_delta` after each feed and :meth:`final_delta` at the end give exactly the pieces a streamer
      showing ``cut text`` minus its held-back tail (:func:`held_back`), skipping steps whose cut text ends with
      U+FFFD, would show.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self.detokenizer = IncrementalDetokenizer(decode)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._keep = max(2 * self._longest, 1)  # stable characters kept for the window
        self._tail = ""  # the last <= _keep characters of the stable text
        self.cut: int | None = None  # the text's length once cut before a stop string
        self._before_cut = ""  # the (at most longest-stop) characters before the cut
        self._shown = 0  # characters given out by visible_delta / final_delta
        self._reader = _PieceReader(self.detokenizer._pieces)

    @property
    def stopped(self) -> bool:
        """A stop string has been found (the text is cut at :attr:`cut`)."""
        return self.cut is not None

    # -- feeding ---------------------------------------------------------------------------------------------------
    def feed(self, tokens: Sequence[int]) -> int | None:
        """Append ``tokens`` up to the first one that completes a stop string and return its 1-based position in
        ``tokens`` (the tokens after it are not appended); None if none does (all appended). After a stop string
        was found, nothing more is appended and 0 is returned."""
        tokens = list(tokens)
        if self.stopped:
            return 0
        peek = self.detokenizer._peek(tokens)
        if not self.stops or self._find(*peek) is None:
            self._append(tokens, *peek)
            return None
        first = len(tokens)
        for j in range(1, len(tokens)):  # the first token after which a stop string shows
            shorter = self.detokenizer._peek(tokens[:j])
            if self._find(*shorter) is not None:
                first, peek = j, shorter
                break
        window, offset = self._window(*peek)
        cut = offset + cut_at_stop(window, self.stops)
        self._before_cut = window[max(0, cut - offset - self._longest) : cut - offset]
        self._append(tokens[:first], *peek)
        self.cut = cut
        return first

    def _window(self, stable: str, pending: str) -> tuple[str, int]:
        """(the text from ``offset`` on, offset) after a push that would give ``(stable, pending)``."""
        return self._tail + stable + pending, self.detokenizer.stable_length - len(self._tail)

    def _find(self, stable: str, pending: str) -> int | None:
        """The cut position (absolute) if the text after such a push contains a stop string."""
        window, offset = self._window(stable, pending)
        at = cut_at_stop(window, self.stops)
        return None if at is None else offset + at

    def _append(self, tokens: list[int], stable: str, pending: str) -> None:
        self.detokenizer._commit(tokens, stable, pending)
        if stable:
            self._tail = (self._tail + stable)[-self._keep :]

    # -- text ------------------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Characters of the (cut) text so far."""
        full = self.detokenizer.stable_length + len(self.detokenizer.pending)
        return full if self.cut is None else self.cut

    def text(self) -> str:
        """The whole text, cut before the stop string (linear in its length: for the end of a run)."""
        text = self.detokenizer.text
        return text if self.cut is None else text[: self.cut]

    def _recent(self, end: int, n: int) -> str:
        """The (at most) ``n`` characters of the text before absolute position ``end``."""
        if end == self.cut:
            before = self._before_cut
        else:  # the end of the uncut text: the kept tail of the stable text covers it
            window, offset = self._window("", self.detokenizer.pending)
            before = window[: end - offset]
        return before[max(0, len(before) - n) :]

    def _take(self, end: int) -> str:
        """The text from what was shown up to ``end``; marks it shown."""
        stable_len = self.detokenizer.stable_length
        parts = []
        if self._shown < stable_len:
            parts.append(self._reader.read(self._shown, min(end, stable_len)))
        if end > stable_len:
            parts.append(self.detokenizer.pending[max(self._shown, stable_len) - stable_len : end - stable_len])
        self._shown = end
        return "".join(parts)

    def visible_delta(self) -> str:
        """The text that may be shown now and was not yet: nothing while the (cut) text ends with an incomplete
        character; otherwise up to the (cut) text's end minus a tail that could be the start of a stop string."""
        end = self.length
        if end == 0 or self._recent(end, 1) == REPLACEMENT:
            return ""
        end -= held_back(self._recent(end, max(self._longest - 1, 0)), self.stops)
        return self._take(end) if end > self._shown else ""

    def final_delta(self) -> str:
        """At the end of the run: everything of the (cut) text not shown yet."""
        end = self.length
        return self._take(end) if end > self._shown else ""


class _PieceReader:
    """Reads consecutive ranges of the concatenation of a growing list of strings without joining them."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self._index = 0  # piece under the cursor
        self._start = 0  # absolute position of that piece's first character

    def read(self, start: int, end: int) -> str:
        """Characters ``start:end`` of the concatenation; ``start`` must not be before the previous read's start."""
        pieces = self.pieces
        while self._index < len(pieces) and self._start + len(pieces[self._index]) <= start:
            self._start += len(pieces[self._index])
            self._index += 1
        out, index, pos = [], self._index, self._start
        while pos < end and index < len(pieces):
            piece = pieces[index]
            out.append(piece[max(0, start - pos) : end - pos])
            pos += len(piece)
            index += 1
        return "".join(out)
