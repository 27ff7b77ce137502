"""PASTA-LANG: the strict parser (one-line errors for every malformed case, never a traceback), round trips,
strip, the added special tokens, and the token-id grammar."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastforward.errors import PastaSyntaxError, UsageError
from fastforward.pasta.language import (
    ASYNC,
    END_ASYNC,
    MAX_TENS,
    OPEN,
    PASTA_TOKENS,
    SYNC,
    PastaDoc,
    PastaVocab,
    Promise,
    Sync,
    Text,
    add_pasta_tokens,
    close_tag,
    parse,
    parse_ids,
    promise_tag,
    strip,
    strip_ids,
    thread_cap,
)

GOOD = ('Intro.\n<promise topic="first item" tokens=2/><async>- one two three\n</async>'
        '<promise topic="b" tokens=1/><async>- four five</async><sync/>\nEnd.')

BAD = [  # (input, words the one-line message must contain)
    ('<async>x</async>', "without a <promise/>"),
    ('</async>', "without an open <async>"),
    ('<sync/>', "nothing to wait for"),
    ('a<promise topic="x" tokens=1/>b', "followed immediately"),
    ('<promise topic="x" tokens=1/>', "without its <async> block"),
    ('<promise topic="x" tokens=1/><async>abc', "unterminated <async>"),
    ('<promise topic="x" tokens=1/><async></async>', "empty <async>"),
    ('<promise topic="x"/><async>a</async>', "missing the tokens attribute"),
    ('<promise tokens=1/><async>a</async>', "missing the topic attribute"),
    ('<promise tokens=1 topic="x"/>', "order topic, tokens"),
    ('<promise topic="x" tokens=0/>', "positive integer"),
    ('<promise topic="x" tokens=-1/>', "positive integer"),
    ('<promise topic="x" tokens=2.5/>', "positive integer"),
    ('<promise topic="x" tokens=abc/>', "positive integer"),
    ('<promise topic="x" tokens=01/><async>a</async>', "positive integer"),
    (f'<promise topic="x" tokens={MAX_TENS + 1}/>', f"1..{MAX_TENS}"),
    ('<promise topic="x" tokens="2"/>', "unquoted integer"),
    ("<promise topic='x' tokens=2/>", "double quotes"),
    ('<promise topic="x" tokens=2>', "self-closing"),
    ('<promise topic="x" tokens=2 extra=1/>', "unknown <promise/> attribute 'extra'"),
    ('<promise topic="x" tokens=1 tokens=2/>', "duplicate"),
    ('<promise topic="x" tokens=2 />', "exactly"),
    ('<promise topic="x', "unterminated <promise"),
    ('<promise topic="x" tok', "unterminated <promise"),
    ('<promise', "unterminated <promise"),
    ('<promise topic="x" tokens=1/><async>a<sync/></async>', "do not nest"),
    ('<promise topic="x" tokens=1/><async>a<async>b</async>', "do not nest"),
    ('<promise topic="x" tokens=1/><async>a<promise topic="y" tokens=1/><async>b</async></async>', "do not nest"),
    ('<async topic="x">a</async>', "malformed <async>"),
    ('<sync>', "self-closing"),
    ('abc</async', "malformed </async>"),
    ('<promise topic="" tokens=1/><async>a</async>', "non-empty topic"),
    ('<promise topic="a\nb" tokens=1/><async>a</async>', "one line"),
    ('<promise topic=" x" tokens=1/><async>a</async>', "spaces"),
    ('text" tokens=3/>', "without an open <promise"),
    ('<promise topic="x" tokens=1/><async>a</async><sync/><sync/>', "nothing to wait for"),
]


@pytest.mark.parametrize(("text", "words"), BAD)
def test_malformed_inputs_give_one_line_errors(text, words):
    with pytest.raises(PastaSyntaxError) as info:
        parse(text)
    message = str(info.value)
    assert words in message, message
    assert "\n" not in message and message.startswith("PASTA-LANG: ") and "(at character " in message
    assert isinstance(info.value, UsageError)  # the CLI prints it as one line, exit code 2


def test_eos_rules():
    eos = "<|im_end|>"
    assert parse(f"abc{eos}", eos=eos) == PastaDoc([Text("abc")], eos)
    with pytest.raises(PastaSyntaxError, match="text after EOS"):
        parse(f"abc{eos}more", eos=eos)
    with pytest.raises(PastaSyntaxError, match="EOS inside an <async> block"):
        parse(f'<promise topic="x" tokens=1/><async>a{eos}', eos=eos)
    with pytest.raises(PastaSyntaxError, match="unterminated <promise"):
        parse(f'<promise topic="x{eos}', eos=eos)
    # EOS is an implicit sync: blocks outstanding at the end are fine
    doc = parse(f'<promise topic="x" tokens=1/><async>a b c</async>tail{eos}', eos=eos)
    assert doc.plain() == "a b ctail" and doc.render().endswith(eos)


def test_not_a_string():
    with pytest.raises(PastaSyntaxError, match="expected a string"):
        parse(None)


def test_parse_render_strip():
    doc = parse(GOOD)
    assert doc.segments == [Text("Intro.\n"), Promise("first item", 2, "- one two three\n"),
                            Promise("b", 1, "- four five"), Sync(), Text("\nEnd.")]
    assert doc.render() == GOOD
    assert strip(GOOD) == "Intro.\n- one two three\n- four five\nEnd."
    assert strip("plain text with < and > and \" quotes") == "plain text with < and > and \" quotes"


# -- property tests -------------------------------------------------------------------------------------------

_plain = st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=12)
_topic = st.text(st.characters(codec="utf-8", exclude_characters='"<>\n\r'), min_size=1, max_size=8).filter(
    lambda t: t.strip() == t and t.strip())
_content = st.text(st.characters(codec="utf-8", exclude_characters="<"), min_size=1, max_size=12).filter(
    lambda t: '" tokens=' not in t)


@st.composite
def documents(draw):
    segments, unsynced = [], 0
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "promise", "sync"]))
        if kind == "text":
            text = draw(_plain.filter(lambda t: '" tokens=' not in t))
            if text and not (segments and isinstance(segments[-1], Text)):
                segments.append(Text(text))
        elif kind == "promise":
            segments.append(Promise(draw(_topic), draw(st.integers(1, MAX_TENS)), draw(_content)))
            unsynced += 1
        elif unsynced:
            segments.append(Sync())
            unsynced = 0
    return PastaDoc(segments)


@given(documents())
@settings(max_examples=150, deadline=None)
def test_round_trip(doc):
    text = doc.render()
    assert parse(text) == doc
    assert strip(text) == doc.plain()


_alphabet = st.sampled_from(["<promise", ' topic="', '"', " tokens=", "1", "2", "0", "/>", ">", "<", "/",
                             ASYNC, END_ASYNC, SYNC, "<sync", "<async", "</async", OPEN, close_tag(3), "a", " ",
                             "\n", "x y", "'", "=", "<|im_end|>"])


@given(st.lists(_alphabet, max_size=14), st.booleans())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_never_a_traceback(parts, with_eos):
    text = "".join(parts)
    try:
        doc = parse(text, eos="<|im_end|>" if with_eos else None)
    except PastaSyntaxError as exc:
        assert "\n" not in str(exc)
        return
    # whatever parses renders back to itself
    assert doc.render() == text


@given(documents(), st.integers(0, 200), st.text(max_size=3))
@settings(max_examples=200, deadline=None)
def test_fuzz_mutations(doc, cut, insert):
    text = doc.render()
    cut = min(cut, len(text))
    mutated = text[:cut] + insert + text[cut + 1:]
    try:
        parse(mutated)
    except PastaSyntaxError:
        pass


# -- tokens -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from fastforward.testing import tiny_tokenizer_hf

    return tiny_tokenizer_hf()


def test_added_tokens_keep_existing_ids(tmp_path):
    from fastforward.testing import tiny_tokenizer_hf
    from fastforward.tokenizer import LightTokenizer

    tokenizer = tiny_tokenizer_hf()  # its own: the module's tokenizer may have the tokens already (any test order)
    plain = 'Some text with <br/> and a="b" tokens=3 or a/>b.'
    before = tokenizer(plain, add_special_tokens=False)["input_ids"]
    n = len(tokenizer)
    vocab = add_pasta_tokens(tokenizer)
    assert len(tokenizer) == n + len(PASTA_TOKENS)
    assert sorted(vocab.all_ids) == list(range(n, n + len(PASTA_TOKENS)))
    assert tokenizer(plain, add_special_tokens=False)["input_ids"] == before
    assert add_pasta_tokens(tokenizer) == vocab  # idempotent
    ids = tokenizer(GOOD, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == GOOD
    structure = parse_ids(ids, vocab)
    assert len(structure.blocks) == 2 and structure.syncs and structure.eos_at is None
    assert tokenizer.decode(strip_ids(ids, vocab)) == strip(GOOD)
    # the light tokenizer gains the same ids, and saves and reloads them
    tiny_tokenizer_hf().save_pretrained(tmp_path / "t")
    light = LightTokenizer.from_folder(tmp_path / "t")
    assert add_pasta_tokens(light) == vocab
    assert light(GOOD, add_special_tokens=False)["input_ids"] == ids
    light.save_pretrained(tmp_path / "saved")
    again = LightTokenizer.from_folder(tmp_path / "saved")
    assert PastaVocab.from_tokenizer(again) == vocab and again.chat_template == light.chat_template
    assert again.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)


def test_vocab_absent(tokenizer):
    from fastforward.testing import tiny_tokenizer_hf

    assert PastaVocab.from_tokenizer(tiny_tokenizer_hf()) is None
    assert strip_ids([1, 2, 3], None) == [1, 2, 3]


def test_ids_grammar_and_cap(tokenizer):
    vocab = add_pasta_tokens(tokenizer)
    eos = 258

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ok = enc(promise_tag("t", 1)) + [vocab.async_] + enc("x" * thread_cap(1)) + [vocab.end_async, eos]
    assert parse_ids(ok, vocab, [eos]).eos_at == len(ok) - 1
    too_long = enc(promise_tag("t", 1)) + [vocab.async_] + enc("x" * (thread_cap(1) + 1)) + [vocab.end_async]
    with pytest.raises(PastaSyntaxError, match="exceeds the cap"):
        parse_ids(too_long, vocab)
    with pytest.raises(PastaSyntaxError, match="text after EOS"):
        parse_ids(enc("ab") + [eos] + enc("c"), vocab, [eos])
    with pytest.raises(PastaSyntaxError, match="at token 0"):
        parse_ids([vocab.sync], vocab)
