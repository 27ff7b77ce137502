"""fastforward.stopping against a naive reference that decodes everything every step.

The references below are the engine's stop-string check (``SequenceRun._emit``) and the streaming loop
(``Generation.__iter__`` / ``final_text`` / ``_held_back``) as they were before the incremental version: every step
they decode all generated tokens. The incremental classes must give the same stopping token, finish reason, text and
streamed pieces for random token sequences, random step sizes and random stop strings -- on the default model's real
byte-level BPE tokenizer, on a real HF byte-level tokenizer with one token per byte (so every multi-byte character
is split across tokens), on a Metaspace (SentencePiece-style) decoder, and on the tiny test tokenizer.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastforward.stopping import IncrementalDetokenizer, StopMatcher, cut_at_stop, held_back
from fastforward.testing import TinyTokenizer, tiny_tokenizer_hf

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! How's it going?",
    "naïve café résumé Ünïcödé ß ø å",
    "日本語のテキストと中文文本 한국어",
    "emoji 😀🚀👍🏽 and family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "Ελληνικά, русский, العربية",
    "stop here. STOP\n\nUser: again",
]


# -- tokenizers ------------------------------------------------------------------------------------------------------


class Tok:
    """A decode function plus the token ids worth drawing from and the EOS id."""

    def __init__(self, name, decode, pool, vocab, eos, encode=None):
        self.name, self.decode, self.pool, self.vocab, self.eos = name, decode, pool, vocab, eos
        self.encode = encode


def _smollm2() -> Tok:
    from fastforward.model import _gguf_tokenizer, packaged_gguf

    try:
        tok = _gguf_tokenizer(packaged_gguf("smollm2-135m"))
    except Exception as e:  # the packaged model is not installed
        pytest.skip(f"default model's tokenizer unavailable: {e}")
    pool = sorted({i for text in TEXTS for i in tok(text)["input_ids"]})
    return Tok("smollm2", lambda ids: tok.decode(ids, skip_special_tokens=True), pool, len(tok), 2,
               lambda text: tok(text)["input_ids"])


def _bytes_hf() -> Tok:
    tok = tiny_tokenizer_hf()
    pool = sorted({i for text in TEXTS for i in tok(text)["input_ids"]})
    return Tok("bytes-hf", lambda ids: tok.decode(ids, skip_special_tokens=True), pool, 259, 258,
               lambda text: tok(text)["input_ids"])


def _metaspace() -> Tok:
    """Words with SentencePiece's ``▁`` word-start marker; the decoder drops the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models

    words = ["▁the", "▁cat", "▁sat", "s", "at", "▁", "▁on", "mat", "▁.", ".", "▁日本", "語", "▁a", "b", "<eos>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<eos>"])
    ids = list(range(len(words)))
    return Tok("metaspace", lambda seq: tok.decode(seq, skip_special_tokens=True), ids, len(words), len(words) - 1)


def _tiny() -> Tok:
    tok = TinyTokenizer(96, eos_token_id=5)
    return Tok("tiny", tok.decode, list(range(20)), 96, 5)


MAKERS = {"smollm2": _smollm2, "bytes-hf": _bytes_hf, "metaspace": _metaspace, "tiny": _tiny}


@pytest.fixture(scope="module", params=list(MAKERS))
def tok(request) -> Tok:
    return MAKERS[request.param]()


def token_ids(tok: Tok, max_size=40):
    return st.lists(
        st.one_of(st.sampled_from(tok.pool), st.integers(0, tok.vocab - 1), st.just(tok.eos)), min_size=1,
        max_size=max_size,
    )


def chunks(data, ids):
    """Split ids into consecutive steps of random sizes (1..12 tokens, as accepted drafts are)."""
    steps, i = [], 0
    while i < len(ids):
        n = data.draw(st.integers(1, 12))
        steps.append(ids[i : i + n])
        i += n
    return steps


def stop_strings(data, tok, ids):
    """1-3 stop strings: mostly pieces of the text of some prefix of ``ids`` (so they are hit, often across token
    boundaries, sometimes with an incomplete character's U+FFFD), sometimes short arbitrary strings."""
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()) or len(ids) == 0:
            text = tok.decode(ids[: data.draw(st.integers(1, len(ids)))])
            if text:
                a = data.draw(st.integers(0, len(text) - 1))
                b = data.draw(st.integers(a + 1, min(len(text), a + 6)))
                stops.append(text[a:b])
                continue
        stops.append(data.draw(st.text(alphabet="at .\n日😀" + FFFD, min_size=1, max_size=4)))
    return stops


# -- the naive references (the engine and Generation before the incremental version) --------------------------------


def reference_emit(decode, stops, steps, eos=(), max_new_tokens=10**9):
    """Per step (taken, finish reason); ends at the first reason. A copy of ``SequenceRun._emit``'s logic."""
    emitted, checked, out = [], 0, []
    for tokens in steps:
        taken, reason = [], ""
        for t in tokens:
            taken.append(t)
            if t in eos:
                reason = "eos"
                break
            if len(emitted) + len(taken) >= max_new_tokens:
                reason = "length"
                break
        if stops:
            start = max(0, checked - max(len(s) for s in stops))

            def hit(toks, start=start):
                text = decode(emitted + toks)
                return any(s in text[start:] for s in stops), text

            found, text = hit(taken)
            if found:
                first = next((j for j in range(1, len(taken)) if hit(taken[:j])[0]), len(taken))
                if first < len(taken) or not reason:
                    taken = taken[:first]
                    reason = "stop"
            checked = len(text)
        emitted.extend(taken)
        out.append((taken, reason))
        if reason:
            break
    return out


def reference_final_text(decode, ids, stops):
    text = decode(ids)
    for s in stops:
        cut = text.find(s)
        if cut >= 0:
            text = text[:cut]
    return text


def reference_held_back(text, stops):
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


def reference_stream(decode, stops, steps):
    """(per-step piece shown, or "" when nothing was; the final piece; the result text): ``Generation.__iter__``."""
    ids, shown, pieces = [], "", []
    for tokens in steps:
        ids.extend(tokens)
        text = reference_final_text(decode, ids, stops)
        piece = ""
        if not text.endswith(FFFD):
            text = reference_held_back(text, stops)
            if len(text) > len(shown) and text.startswith(shown):
                piece = text[len(shown) :]
                shown = text
        pieces.append(piece)
    text = reference_final_text(decode, ids, stops)
    final = text[len(shown) :] if len(text) > len(shown) and text.startswith(shown) else ""
    return pieces, final, text


# -- the incremental versions, used as the engine is meant to use them -----------------------------------------------


def incremental_emit(decode, stops, steps, eos=(), max_new_tokens=10**9):
    """The engine's emit with a :class:`StopMatcher` (the change proposed for ``SequenceRun._emit``)."""
    matcher = StopMatcher(decode, stops) if stops else None
    emitted, out = [], []
    for tokens in steps:
        taken, reason = [], ""
        for t in tokens:
            taken.append(t)
            if t in eos:
                reason = "eos"
                break
            if len(emitted) + len(taken) >= max_new_tokens:
                reason = "length"
                break
        if matcher is not None:
            first = matcher.feed(taken)
            if first is not None and (first < len(taken) or not reason):
                taken = taken[:first]
                reason = "stop"
        emitted.extend(taken)
        out.append((taken, reason))
        if reason:
            break
    return out


def incremental_stream(decode, stops, steps):
    matcher = StopMatcher(decode, stops)
    pieces = []
    for tokens in steps:
        matcher.feed(tokens)
        pieces.append(matcher.visible_delta())
    final = matcher.final_delta()
    return pieces, final, matcher.text()


# -- properties ------------------------------------------------------------------------------------------------------

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_detokenizer_pieces_add_up_to_the_full_decode(tok, data):
    ids = data.draw(token_ids(tok, 60))
    detok = IncrementalDetokenizer(tok.decode)
    text, done = "", []
    for step in chunks(data, ids):
        piece = detok.push(step)
        text += piece
        done += step
        assert detok.text == tok.decode(done)  # stable + pending is the full decode after every push
        assert text + detok.pending == tok.decode(done)
        assert not text.endswith(FFFD) or not text
    assert text + detok.flush() == tok.decode(ids)


@SETTINGS
@given(data=st.data())
def test_stopping_token_and_reason_equal_the_reference(tok, data):
    ids = data.draw(token_ids(tok))
    stops = stop_strings(data, tok, ids)
    steps = chunks(data, ids)
    eos = (tok.eos,) if data.draw(st.booleans()) else ()
    budget = data.draw(st.one_of(st.just(10**9), st.integers(1, len(ids) + 2)))
    want = reference_emit(tok.decode, stops, steps, eos, budget)
    assert incremental_emit(tok.decode, stops, steps, eos, budget) == want


@SETTINGS
@given(data=st.data())
def test_streamed_pieces_and_text_equal_the_reference(tok, data):
    ids = data.draw(token_ids(tok))
    stops = stop_strings(data, tok, ids) if data.draw(st.integers(0, 4)) else []
    eos = (tok.eos,) if data.draw(st.booleans()) else ()
    # what the engine hands the streamer: steps truncated at EOS / the stop string, the run ending there
    steps = [taken for taken, _ in reference_emit(tok.decode, stops, chunks(data, ids), eos)]
    want = reference_stream(tok.decode, stops, steps)
    got = incremental_stream(tok.decode, stops, steps)
    assert got == want
    pieces, final, text = got
    assert "".join(pieces) + final == text


@pytest.mark.parametrize("stops", [["a"], ["xyz", "a"], ["a", "ab"], ["cd", "bc"], ["bc", "cd"]])
def test_cut_and_hold_back_match_the_engine_helpers(stops):
    for text in ["", "a", "xabcd", "bcdxa", "zzz", "abcdcd", "xy"]:
        cut = cut_at_stop(text, stops)
        assert (text if cut is None else text[:cut]) == reference_final_text(lambda t: t, text, stops)
        assert text[: len(text) - held_back(text, stops)] == reference_held_back(text, stops)


# -- examples --------------------------------------------------------------------------------------------------------


def test_stop_string_completed_by_the_very_first_token(tok):
    ids = [i for i in tok.pool if tok.decode([i]) and FFFD not in tok.decode([i])][:3]
    first_text = tok.decode(ids[:1])
    matcher = StopMatcher(tok.decode, [first_text])
    assert matcher.feed(ids) == 1
    assert matcher.text() == ""
    assert matcher.visible_delta() == "" and matcher.final_delta() == ""
    assert matcher.feed(ids) == 0  # stopped: nothing more is taken


def test_stop_string_spanning_split_multibyte_characters():
    tok = _bytes_hf()
    ids = list("ab 😀🚀 cd".encode())  # one token per byte: every emoji spans four tokens
    matcher = StopMatcher(tok.decode, ["😀🚀"])
    first = matcher.feed(ids)
    assert first == len("ab 😀🚀".encode())  # the last byte of the rocket completes the stop string
    assert matcher.text() == "ab "
    want = reference_emit(tok.decode, ["😀🚀"], [ids])
    assert want == [(ids[:first], "stop")]


def test_streaming_holds_back_a_possible_stop_string_start():
    tok = _tiny()
    matcher = StopMatcher(tok.decode, [" t3 t4 t9"])
    matcher.feed([1, 2])
    assert matcher.visible_delta() == " t1 t2"
    matcher.feed([3, 4])  # " t3 t4" may begin the stop string: held back
    assert matcher.visible_delta() == ""
    matcher.feed([7])
    assert matcher.visible_delta() == " t3 t4 t7"
    assert matcher.final_delta() == ""
    assert matcher.text() == " t1 t2 t3 t4 t7"


# -- bounded work per step -------------------------------------------------------------------------------------------


class CountingDecode:
    """A decode function that records how many token ids each call decoded."""

    def __init__(self, decode):
        self.inner, self.calls = decode, []

    def __call__(self, ids):
        self.calls.append(len(ids))
        return self.inner(ids)


def _long_ids(tok, n):
    """n ids of realistic text (the sample texts, multi-byte characters included, over and over)."""
    ids = tok.encode("\n".join(TEXTS) * (n // 10))
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("name", ["smollm2", "bytes-hf"])
def test_work_per_step_does_not_grow_with_the_generation(name):
    """Over 2,000 tokens, the ids decoded per step near the end are a small constant (not ~1,900), and ~4 per
    token overall: one token per step (the engine's stop check) and 7 per step (accepted drafts, streaming)."""
    tok = MAKERS[name]()
    ids = _long_ids(tok, 2000)
    counting = CountingDecode(tok.decode)
    matcher = StopMatcher(counting, ["never appears 123", "\n\nAssistant:"])
    per_token = []
    for t in ids:
        before = len(counting.calls)
        assert matcher.feed([t]) is None
        matcher.visible_delta()
        per_token.append(sum(counting.calls[before:]))
    assert max(per_token[1800:]) <= 32, max(per_token[1800:])
    assert sum(per_token) <= 8 * len(ids)
    assert matcher.text() == tok.decode(ids)

    counting.calls.clear()
    detok = IncrementalDetokenizer(counting)
    per_step = []
    for i in range(0, len(ids), 7):
        before = len(counting.calls)
        detok.push(ids[i : i + 7])
        per_step.append(sum(counting.calls[before:]))
    assert max(per_step[1800 // 7 :]) <= 128, max(per_step[1800 // 7 :])
    assert sum(per_step) <= 8 * len(ids)
    assert detok.text == tok.decode(ids)
