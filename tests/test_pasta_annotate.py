"""Annotation without an external LLM: structure candidates, the tagless PASTA mask (equal to the interpreter's
rule), the likelihood test, stripped text == the original (property-based), resumable files, the CLI's refusals."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastforward.model import TargetModel
from fastforward.pasta.language import PastaVocab, add_pasta_tokens, parse, parse_ids
from fastforward.pasta.layout import pasta_layout
from fastforward.testing import tiny_llama_hf, tiny_tokenizer_hf
from fastforward.train.pasta.annotate import (
    annotate_answer,
    annotate_file,
    candidate_groups,
    tagless_mask,
    units_of,
)
from tests.cli_helpers import assert_one_line_error

EOS = 258
LIST_ANSWER = ("Here are three tips for better sleep:\n\n"
               "1. Keep a regular schedule every single day of the week.\n"
               "2. Avoid screens for an hour before you go to bed.\n"
               "3. Keep the bedroom cool, dark and quiet at night.\n\n"
               "Following these tips will help you sleep better.")
CODE_ANSWER = ("Use a loop:\n\n```python\nfor i in range(3):\n    print(i)\n\n\nprint('done')\n```\n\n"
               "This prints the numbers zero to two and then done.\n\n"
               "Loops like this one are the most common way to repeat work.")


@pytest.fixture(scope="module")
def target():
    tokenizer = tiny_tokenizer_hf()
    add_pasta_tokens(tokenizer)
    hf = tiny_llama_hf(vocab_size=320, seed=2, dtype=torch.float32)
    hf.config.eos_token_id = EOS
    hf.generation_config.eos_token_id = EOS
    return TargetModel("tiny-pasta", hf, tokenizer, backend="lean")


def _ids(target, text):
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_units_and_candidates():
    kinds = [u.kind for u in units_of(LIST_ANSWER)]
    assert kinds == ["paragraph", "item", "item", "item", "paragraph"]
    groups, _ = candidate_groups(LIST_ANSWER)
    assert len(groups) == 1 and len(groups[0]) == 3
    chunks = [LIST_ANSWER[c.start:c.end] for c in groups[0]]
    assert chunks[0].startswith("1. Keep") and chunks[0].endswith("\n") and chunks[2].endswith("night.")
    assert [c.topic for c in groups[0]] == ["Keep a", "Avoid screens", "Keep the"]  # short labels by default
    groups3, _ = candidate_groups(LIST_ANSWER, topic_words=3)
    assert [c.topic for c in groups3[0]] == ["Keep a regular", "Avoid screens for", "Keep the bedroom"]
    # a code block is one unit, never split, never a candidate; the first paragraph stays on the main thread
    units = units_of(CODE_ANSWER)
    assert [u.kind for u in units] == ["paragraph", "code", "paragraph", "paragraph"]
    assert "print('done')" in CODE_ANSWER[units[1].start:units[1].end]
    groups, _ = candidate_groups(CODE_ANSWER)
    assert len(groups) == 1 and all("```" not in CODE_ANSWER[c.start:c.end] for c in groups[0])
    # short items (< 5 words) are not candidates; a bold lead-in is the topic
    groups, _ = candidate_groups("Intro.\n- a b\n- c d\n")
    assert groups == []
    groups, _ = candidate_groups("Intro.\n- **Speed**: it is fast and it is light.\n- **Cost**: it is cheap to run "
                                 "all day.\n")
    assert [c.topic for c in groups[0]] == ["Speed", "Cost"]


def test_structure_mode_is_the_apar_baseline(target):
    answer = _ids(target, LIST_ANSWER)
    ann = annotate_answer(target, _ids(target, "Q?"), answer, mode="structure")
    assert ann.kept == ann.candidates == 3 and ann.syncs == 1
    assert parse(ann.text).plain() == LIST_ANSWER
    assert ann.text.count("<promise") == 3 and "<sync/>\n\nFollowing" in ann.text
    parse_ids(_ids(target, ann.text), PastaVocab.from_tokenizer(target.tokenizer))


def test_likelihood_mode_thresholds(target):
    answer, prompt = _ids(target, LIST_ANSWER), _ids(target, "Q?")
    everything = annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=1e9)
    assert everything.kept == 3 and everything.syncs == 0  # nothing needs a sync: EOS joins
    assert len(everything.rises) == 3
    nothing = annotate_answer(target, prompt, answer, threshold=0.0, sync_threshold=0.0)
    assert nothing.kept == sum(r <= 0 for r in nothing.rises)
    strict_sync = annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=-1.0)
    assert strict_sync.syncs == 1 and parse(strict_sync.text).plain() == LIST_ANSWER


def test_a_group_stays_async_only_if_it_shortens_the_critical_path(target):
    answer, prompt = _ids(target, LIST_ANSWER), _ids(target, "Q?")
    vocab = PastaVocab.from_tokenizer(target.tokenizer)
    free = annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=1e9, min_saving=None)
    assert free.kept == 3
    path = pasta_layout(prompt, _ids(target, free.text), vocab, ()).forwards
    saving = len(answer) - path  # a plain answer of n tokens takes n forwards
    assert saving > 0
    assert annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=1e9, min_saving=saving).kept == 3
    too_much = annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=1e9, min_saving=saving + 1)
    assert too_much.kept == 0 and too_much.text == LIST_ANSWER
    # long topics cost main-thread forwards: the same blocks save less with three-word topics than with one
    one = annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=1e9, min_saving=None, topic_words=1)
    three = annotate_answer(target, prompt, answer, threshold=1e9, sync_threshold=1e9, min_saving=None,
                            topic_words=3)
    assert pasta_layout(prompt, _ids(target, one.text), vocab, ()).forwards < \
        pasta_layout(prompt, _ids(target, three.text), vocab, ()).forwards


# -- the tagless mask is the interpreter's rule with the tags taken out -------------------------------------------


@st.composite
def tagged_answers(draw):
    vocab = _VOCAB
    letters = st.integers(97, 122)
    ids, outstanding = [], 0
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["text", "promise", "promise", "sync"]))
        if kind == "text":
            ids += draw(st.lists(letters, min_size=1, max_size=4))
        elif kind == "promise":
            tens = draw(st.integers(1, 3))
            close = next(i for i, n in vocab.close.items() if n == tens)
            ids += [vocab.open] + draw(st.lists(letters, min_size=1, max_size=2)) + [close, vocab.async_]
            ids += draw(st.lists(letters, min_size=1, max_size=6)) + [vocab.end_async]
            outstanding += 1
        elif outstanding:
            ids.append(vocab.sync)
            outstanding = 0
    return ids


_VOCAB = add_pasta_tokens(tiny_tokenizer_hf())


@given(tagged_answers())
@settings(max_examples=150, deadline=None)
def test_tagless_mask_is_the_layout_without_tags(ids):
    vocab = _VOCAB
    layout = pasta_layout([1, 2], ids, vocab, [EOS])
    structure = parse_ids(ids, vocab, [EOS])
    topic = set()
    for b in structure.blocks:
        topic.update(range(b.topic[0], b.topic[1]))
    keep = [i for i, t in enumerate(ids) if not vocab.is_tag(t) and i not in topic]
    new_index = {i: k for k, i in enumerate(keep)}
    blocks = [(new_index[b.content[0]], new_index[b.content[1] - 1] + 1) for b in structure.blocks]
    syncs = [sum(1 for i in keep if i < s) for s in structure.syncs]
    mask, pred = tagless_mask(len(keep), blocks, syncs)
    rows = torch.tensor([2 + i for i in keep], dtype=torch.long)
    assert torch.equal(mask, layout.mask[rows][:, rows])
    # each token is predicted by its thread's previous token (a block's first: the main token before it)
    for k in range(len(keep)):
        assert pred[k] < k


# -- stripped text == the original, whatever the answer -----------------------------------------------------------

_word = st.text(st.sampled_from("abcdefgh"), min_size=1, max_size=6)
_words = st.lists(_word, min_size=1, max_size=9).map(" ".join)


@st.composite
def markdown(draw):
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["para", "list", "code", "heading"]))
        if kind == "para":
            parts.append(draw(_words) + draw(st.sampled_from([".", "", " é."])))
        elif kind == "list":
            marker = draw(st.sampled_from(["-", "*", "1."]))
            parts.append("\n".join(f"{marker} {draw(_words)}" for _ in range(draw(st.integers(1, 4)))))
        elif kind == "code":
            parts.append(f"```\n{draw(_words)}\n\n{draw(_words)}\n```")
        else:
            parts.append(f"## {draw(_words)}")
    sep = draw(st.sampled_from(["\n", "\n\n"]))
    return sep.join(parts) + draw(st.sampled_from(["", "\n"]))


@given(markdown(), st.sampled_from(["structure", "likelihood"]), st.floats(0, 2), st.floats(0, 2))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
def test_stripped_annotation_equals_the_answer(target, text, mode, threshold, sync_threshold):
    answer = _ids(target, text)
    ann = annotate_answer(target, [1, 2, 3], answer, mode=mode, threshold=threshold, sync_threshold=sync_threshold,
                          min_words=2)
    original = target.tokenizer.decode(answer, skip_special_tokens=True)
    assert parse(ann.text).plain() == original
    if ann.kept:
        parse_ids(_ids(target, ann.text), PastaVocab.from_tokenizer(target.tokenizer))
        for promise in parse(ann.text).promises:  # never a piece of a code block
            assert promise.content.count("```") % 2 == 0


# -- files --------------------------------------------------------------------------------------------------------


def _records(target, n):
    texts = [LIST_ANSWER, CODE_ANSWER, "Just one line.", LIST_ANSWER.replace("tips", "ideas")]
    return [{"key": f"k{i}", "prompt_ids": _ids(target, f"question {i}"),
             "response_ids": _ids(target, texts[i % len(texts)]) + [EOS], "finish_reason": "eos"}
            for i in range(n)]


def test_annotate_file_resumes(target, tmp_path):
    src = tmp_path / "responses.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _records(target, 4)))
    whole = tmp_path / "whole.jsonl"
    counts = annotate_file(target, tmp_path, whole, mode="structure", log=None)
    assert counts == {"records": 4, "skipped": 0, "annotated": 4, "with_tags": 3}
    part = tmp_path / "part.jsonl"
    annotate_file(target, src, part, mode="structure", limit=2, log=None)
    with open(part, "a") as f:
        f.write('{"key": "k2", "torn')  # a writer killed mid-line
    counts = annotate_file(target, src, part, mode="structure", log=None)
    assert counts["skipped"] == 2 and counts["annotated"] == 2
    assert part.read_text() == whole.read_text()
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["key"] for r in rows] == ["k0", "k1", "k2", "k3"]
    for r in rows:
        assert parse(r["pasta"]).plain() == r["response"]


def test_cli_refusals_before_the_model_loads(capsys, tmp_path):
    assert_one_line_error(capsys, "pasta", "annotate", tmp_path / "missing.jsonl", tmp_path / "out.jsonl",
                          "--model", "/nonexistent/model", match="does not exist")
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    assert_one_line_error(capsys, "pasta", "annotate", src, src, "--model", "/nonexistent", match="must not be")
    assert_one_line_error(capsys, "pasta", "annotate", src, tmp_path / "o.jsonl", "--threshold", "-1")
    assert_one_line_error(capsys, "pasta", "annotate", src, tmp_path / "o.jsonl", "--topic-words", "0")
    assert_one_line_error(capsys, "pasta", "annotate", src, tmp_path / "o.jsonl", "--min-saving", "many",
                          match="or 'off'")
    assert_one_line_error(capsys, "pasta", match="give a pasta command")


def test_a_block_alongside_nothing_is_left_out():
    from fastforward.train.pasta.annotate import Chunk, _drop_useless

    a, b, c = Chunk(0, 0, 0, 5, 10), Chunk(0, 0, 0, 10, 15), Chunk(1, 0, 0, 20, 25)
    # two blocks joined together: kept; a lone block with its sync right after it: dropped with its sync
    assert _drop_useless([a, b, c], [15, 25], 30) == ([a, b], [15])
    # a lone block with main text before its sync: kept
    assert _drop_useless([c], [27], 30) == ([c], [27])
    # a lone block ending the answer (EOS joins it at once): dropped; with text after it: kept
    assert _drop_useless([c], [], 25) == ([], [])
    assert _drop_useless([c], [], 30) == ([c], [])
    # a sync right before the next group's first block belongs to the earlier run
    assert _drop_useless([a, b, c], [20], 30) == ([a, b, c], [20])
