"""The PASTA interpreter and the layout rule it shares with training.

* A hand-written PASTA-LANG answer teacher-forced through the interpreter feeds exactly the positions, slots and
  visibility :func:`pasta_layout` computes for it, and its logits equal one dense forward under the layout's mask;
  an answer the interpreter decodes itself gives back its own forwards through :func:`pasta_layout` (both ways).
* Visibility and positions of random annotated answers equal an independent statement of the rule (hypothesis).
* Without PASTA-LANG tokens the interpreter is autoregressive decoding, token for token (greedy and sampling).
* Forced promises: the forks decode in the same forwards as the main thread.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.errors import PastaSyntaxError, UsageError
from fastforward.model import TargetModel
from fastforward.pasta.interpreter import PastaMethod
from fastforward.pasta.language import add_pasta_tokens, parse_ids, thread_cap
from fastforward.pasta.layout import pasta_layout, thread_streams
from fastforward.testing import tiny_llama_hf, tiny_tokenizer_hf

EOS = 258


@pytest.fixture(scope="module")
def pasta_target():
    """A tiny random float64 Llama whose byte-level tokenizer has the PASTA-LANG tokens (ids 259..312)."""
    tokenizer = tiny_tokenizer_hf()
    add_pasta_tokens(tokenizer)
    hf = tiny_llama_hf(vocab_size=320, seed=1)
    hf.config.eos_token_id = EOS
    hf.generation_config.eos_token_id = EOS
    return TargetModel("tiny-pasta", hf, tokenizer, backend="lean")


def _enc(target, text):
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def _vocab(target):
    from fastforward.pasta.language import PastaVocab

    return PastaVocab.from_tokenizer(target.tokenizer)


def _run(target, prompt, force=None, max_new_tokens=200, **kw):
    proposer = PastaMethod(target, force=force, trace=True)
    gen = ff.stream(target, prompt, proposer, max_new_tokens=max_new_tokens, **kw)
    result = gen.run()
    return gen.sequence, result


def _forced(answer, streams):
    def force(thread, ordinal):
        stream = streams[thread]
        return answer[stream[ordinal]] if ordinal < len(stream) else None

    return force


def _check_trace_against_layout(target, prompt, run):
    """Every forward the interpreter ran equals pasta_layout's rows for its own answer; the logits equal one dense
    forward of the whole answer under the layout's mask and positions."""
    vocab = _vocab(target)
    layout = pasta_layout(prompt, run.annotated, vocab, [EOS])
    p = len(prompt)
    by_slot = {int(s): i for i, s in enumerate(layout.slot.tolist()) if s >= 0}
    assert len(run.trace) + 1 == layout.forwards == run.stats.target_forwards
    # one dense forward: the prompt, then the whole answer with the layout's mask over it
    cache = target.new_cache(layout.ids.numel() + 4)
    target.forward(layout.ids[:p], torch.arange(p), cache)
    cache.keep(range(p))
    dense = target.forward(layout.ids[p:], layout.positions[p:], cache, layout.mask[p:, p:]).logits
    for step, tr in enumerate(run.trace, start=1):
        logical = [by_slot[s] for s in tr["slots"]]
        assert [int(layout.step[i]) for i in logical] == [step] * len(logical)
        assert tr["tokens"] == layout.ids[logical].tolist()
        assert tr["positions"] == layout.positions[logical].tolist()
        # the row's mask over the uncommitted slots, as logical indices, plus the committed ones
        for r, i in enumerate(logical):
            seen = {by_slot[tr["committed"] + c] for c in torch.nonzero(tr["mask"][r]).flatten().tolist()}
            seen |= {by_slot[s] for s in range(tr["committed"])}
            expected = {j for j in range(p, layout.ids.numel()) if layout.mask[i, j] and layout.fed[j]}
            assert seen == expected, (step, r)
            torch.testing.assert_close(tr["logits"][r], dense[i - p], rtol=0, atol=1e-9)
    return layout


ANSWERS = [
    'ab<promise topic="x" tokens=1/><async>cde</async><promise topic="y" tokens=2/><async>fg</async>h<sync/>ij',
    '<promise topic="first" tokens=1/><async>one two</async>tail text',  # EOS as the implicit sync
    'a<promise topic="x" tokens=1/><async>long block here!</async><sync/>b<promise topic="z" tokens=3/>'
    '<async>q</async><promise topic="w" tokens=1/><async>rs</async><sync/>end',
    "plain sequential answer",
]


@pytest.mark.parametrize("text", ANSWERS)
def test_teacher_forced_answer_reproduces_the_layout(pasta_target, text):
    vocab = _vocab(pasta_target)
    prompt = _enc(pasta_target, "Q: why?")
    answer = _enc(pasta_target, text) + [EOS]
    main, forks = thread_streams(answer, vocab, [EOS])
    run, result = _run(pasta_target, prompt, _forced(answer, [main] + forks))
    assert run.annotated == answer and result.finish_reason == "eos"
    plain = [t for t in answer if not vocab.is_tag(t)]
    assert result.token_ids == [t for t in _strip_topics(answer, vocab)] and len(result.token_ids) <= len(plain)
    layout = _check_trace_against_layout(pasta_target, prompt, run)
    assert layout.blocks == len(forks)
    if not forks:  # a plain answer: one token per forward, causal, positions 0, 1, 2, ...
        assert layout.forwards == len(answer)
        n = layout.ids.numel()
        assert torch.equal(layout.positions, torch.arange(n))
        assert torch.equal(layout.mask, torch.ones(n, n, dtype=torch.bool).tril())
    else:
        assert layout.forwards < len(answer)


def _strip_topics(ids, vocab):
    from fastforward.pasta.language import strip_ids

    return strip_ids(ids, vocab)


def test_forced_promises_decode_forks_in_parallel(pasta_target):
    """The main thread is forced to promise two blocks and sync; the forks write freely (greedy), in the same
    forwards as the main thread and each other; the answer decoded gives back its own forwards via the layout."""
    vocab = _vocab(pasta_target)
    prompt = _enc(pasta_target, "List two things.")
    main_text = _enc(pasta_target, 'ok<promise topic="a" tokens=1/><promise topic="b" tokens=2/><sync/>done')
    main_text = main_text + [EOS]
    run, result = _run(pasta_target, prompt, lambda k, o: main_text[o] if k == 0 and o < len(main_text) else None)
    structure = parse_ids(run.annotated, vocab, [EOS])  # well-formed
    assert len(structure.blocks) == 2 and result.finish_reason == "eos"
    for block in structure.blocks:
        assert 1 <= block.content[1] - block.content[0] <= thread_cap(block.tens)
    widths = [len(tr["tokens"]) for tr in run.trace]
    assert max(widths) >= 2 and sum(w >= 2 for w in widths) >= 5  # forks ran alongside
    assert run.stats.target_forwards < len(run.annotated)
    assert any(set(tr["threads"]) >= {1, 2} for tr in run.trace)  # the two forks in one forward
    _check_trace_against_layout(pasta_target, prompt, run)


def test_free_decoding_is_well_formed_and_seeded(pasta_target):
    """Sampling on a model that emits tags at random: the constraints keep every answer well-formed; the same
    seed gives the same answer."""
    vocab = _vocab(pasta_target)
    prompt = _enc(pasta_target, "Hello")
    outs = []
    for seed in (0, 1, 2, 0):
        run, result = _run(pasta_target, prompt, max_new_tokens=120, temperature=1.0, seed=seed)
        if result.finish_reason == "eos":
            parse_ids(run.annotated, vocab, [EOS])
            _check_trace_against_layout(pasta_target, prompt, run)
        outs.append(result.token_ids)
    assert outs[0] == outs[3]


# -- visibility and positions, against an independent statement of the rule -------------------------------------

@st.composite
def answers(draw):
    """A random well-formed answer as token ids (text tokens are letters)."""
    from fastforward.testing import tiny_tokenizer_hf as _tok

    vocab = _VOCAB
    letters = st.integers(97, 122)
    ids, outstanding = [], 0
    for _ in range(draw(st.integers(0, 7))):
        kind = draw(st.sampled_from(["text", "promise", "promise", "sync"]))
        if kind == "text":
            ids += draw(st.lists(letters, min_size=1, max_size=4))
        elif kind == "promise":
            tens = draw(st.integers(1, 3))
            close = next(i for i, n in vocab.close.items() if n == tens)
            ids += [vocab.open] + draw(st.lists(letters, min_size=1, max_size=2)) + [close, vocab.async_]
            ids += draw(st.lists(letters, min_size=1, max_size=8)) + [vocab.end_async]
            outstanding += 1
        elif outstanding:
            ids.append(vocab.sync)
            outstanding = 0
    if draw(st.booleans()):
        ids.append(EOS)
    del _tok
    return ids


def _make_vocab():
    tokenizer = tiny_tokenizer_hf()
    return add_pasta_tokens(tokenizer)


_VOCAB = _make_vocab()


def _reference(prompt_len, ids, vocab):
    """Visibility and positions of an answer stated directly (not through the schedule)."""
    n = len(ids)
    structure = parse_ids(ids, vocab, [EOS])
    block_of = [-1] * n
    for k, b in enumerate(structure.blocks):
        for i in range(b.async_at, b.end_at + 1):
            block_of[i] = k
    syncs = structure.syncs
    positions, cur = [0] * n, prompt_len
    for i, t in enumerate(ids):
        if block_of[i] >= 0:
            b = structure.blocks[block_of[i]]
            positions[i] = positions[b.close_at] + 1 + (i - b.async_at)
            continue
        positions[i] = cur
        cur += 1 + (10 * vocab.close[t] + 2 if t in vocab.close else 0)

    def sees(i, j):
        if j == i:
            return True
        if j > i:
            return False
        ki, kj = block_of[i], block_of[j]
        if ids[i] == EOS:
            return True
        if ki < 0:  # a main-thread token
            if kj < 0:
                return True
            end = structure.blocks[kj].end_at
            return any(end < s <= i for s in syncs)
        b = structure.blocks[ki]
        if kj == ki:
            return True
        if kj < 0:
            return j <= b.close_at
        end = structure.blocks[kj].end_at
        return any(end < s < b.open_at for s in syncs)

    mask = torch.tensor([[sees(i, j) for j in range(n)] for i in range(n)], dtype=torch.bool).reshape(n, n)
    return torch.tensor(positions, dtype=torch.long), mask


@given(answers(), st.integers(1, 4))
@settings(max_examples=120, deadline=None)
def test_fork_visibility_and_positions(ids, prompt_len):
    vocab = _VOCAB
    layout = pasta_layout(list(range(1, prompt_len + 1)), ids, vocab, [EOS])
    p = prompt_len
    positions, mask = _reference(p, ids, vocab)
    assert torch.equal(layout.positions[p:], positions)
    assert torch.equal(layout.mask[p:, p:], mask)
    assert layout.mask[p:, :p].all() and torch.equal(layout.mask[:p, :p], torch.ones(p, p).tril().bool())
    assert not layout.mask[:p, p:].any()
    # targets: every fed answer token predicts its thread's next token
    main, forks = thread_streams(ids, vocab, [EOS])
    for stream in [main] + forks:
        for a, b in zip(stream, stream[1:], strict=False):
            assert int(layout.targets[p + a]) == ids[b]
    if ids:
        assert int(layout.targets[p - 1]) == ids[main[0]] if main else True
    # the critical path: never more forwards than tokens, exactly as many when there is no block
    assert layout.forwards <= max(1, len(ids))
    if not forks:
        assert layout.forwards == max(1, len(ids))


def test_layout_rejects_malformed_answers():
    vocab = _VOCAB
    with pytest.raises(PastaSyntaxError, match="without a <promise/>"):
        pasta_layout([1], [97, vocab.async_, 98, vocab.end_async], vocab, [EOS])
    with pytest.raises(PastaSyntaxError, match="prompt is empty"):
        pasta_layout([], [97], vocab, [EOS])


# -- plain decoding is autoregressive decoding ----------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}, {"temperature": 0.7, "top_k": 8,
                                                                           "seed": 11}])
def test_no_pasta_tokens_equals_ar(tiny, sampling):
    for prompt in ([1, 2, 3], [7, 8, 9, 10, 11]):
        ar = ff.generate(tiny, prompt, "ar", max_new_tokens=40, **sampling)
        pasta = ff.generate(tiny, prompt, "pasta", max_new_tokens=40, method_options={"plain": True}, **sampling)
        assert pasta.token_ids == ar.token_ids and pasta.text == ar.text
        assert pasta.finish_reason == ar.finish_reason
        assert pasta.stats.target_forwards == ar.stats.target_forwards


def test_no_pasta_tokens_equals_ar_with_eos_and_stops(tiny):
    from fastforward.testing import tiny_target

    target = tiny_target(eos_token_id=9)
    for prompt in ([1, 2, 3], [4, 5]):
        ar = ff.generate(target, prompt, "ar", max_new_tokens=60)
        pasta = ff.generate(target, prompt, "pasta", max_new_tokens=60, method_options={"plain": True})
        assert pasta.token_ids == ar.token_ids and pasta.finish_reason == ar.finish_reason
        stop = ar.text.split()[3] if len(ar.text.split()) > 3 else None
        if stop:
            a = ff.generate(target, prompt, "ar", max_new_tokens=60, stop=[stop])
            b = ff.generate(target, prompt, "pasta", max_new_tokens=60, stop=[stop], method_options={"plain": True})
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)


def test_batch_and_stream(pasta_target):
    prompts = [_enc(pasta_target, "one"), _enc(pasta_target, "two two")]
    solo = [ff.generate(pasta_target, p, "pasta", max_new_tokens=50, temperature=1.0, seed=3) for p in prompts]
    together = ff.generate_batch(pasta_target, prompts, "pasta", max_new_tokens=50, temperature=1.0, seed=3)
    assert [r.token_ids for r in together] == [r.token_ids for r in solo]
    text = "".join(ff.stream(pasta_target, prompts[0], "pasta", max_new_tokens=50, temperature=1.0, seed=3))
    assert text == solo[0].text


def test_refusals(tiny, tiny_hf):
    with pytest.raises(UsageError, match="max_forks"):
        ff.generate(tiny, [1, 2], "pasta", method_options={"max_forks": 0})
    with pytest.raises(UsageError, match="lean backend"):
        ff.generate(tiny_hf, [1, 2], "pasta")
    with pytest.raises(UsageError, match="no PASTA-LANG tokens"):
        ff.generate(tiny, [1, 2], "pasta")


def test_sft_batch_is_what_the_interpreter_computes(pasta_target):
    """The HF model (what training runs) on a pasta_batch of two teacher-forced answers gives, at every row the
    interpreter feeds, the interpreter's logits, and its targets are the tokens the interpreter chose there."""
    from fastforward.train.pasta.sft import pasta_batch, pasta_token_losses

    vocab = _vocab(pasta_target)
    hf = pasta_target.hf_model
    examples, runs = [], []
    for prompt_text, text in (("Q: why?", ANSWERS[0]), ("Hi", ANSWERS[2])):
        prompt = _enc(pasta_target, prompt_text)
        answer = _enc(pasta_target, text) + [EOS]
        main, forks = thread_streams(answer, vocab, [EOS])
        run, _ = _run(pasta_target, prompt, _forced(answer, [main] + forks))
        examples.append((prompt, answer))
        runs.append(run)
    batch = pasta_batch(examples, vocab, [EOS], pad_id=0, dtype=torch.float64)
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                    attention_mask=batch["attention_mask"], use_cache=False).logits
    for k, ((prompt, answer), run) in enumerate(zip(examples, runs, strict=True)):
        layout = pasta_layout(prompt, answer, vocab, [EOS])
        by_slot = {int(s): i for i, s in enumerate(layout.slot.tolist()) if s >= 0}
        for tr in run.trace:
            for r, s in enumerate(tr["slots"]):
                i = by_slot[s]
                torch.testing.assert_close(logits[k, i], tr["logits"][r].to(logits.dtype), rtol=0, atol=1e-4)
                target = int(batch["targets"][k, i])
                assert target == (-100 if tr["tokens"][r] == vocab.end_async else int(layout.targets[i]))
        p = len(prompt)
        assert int(batch["targets"][k, p - 1]) == answer[0]
        assert (batch["targets"][k, :p - 1] == -100).all()
    losses = pasta_token_losses(hf, batch)
    assert losses.shape == batch["targets"].shape and bool((losses[batch["targets"] == -100] == 0).all())
    assert batch["num_tokens"] == int((batch["targets"] != -100).sum()) > 0


def test_topic_banned_ids_are_decoded_once_per_tokenizer(pasta_target, monkeypatch):
    """Decoding the whole vocabulary costs about half a second on a real model: one request pays it, not each."""
    from fastforward.pasta.interpreter import TOPIC_FORBIDDEN, PastaMethod

    tokenizer = pasta_target.tokenizer
    calls = []
    real = type(tokenizer).batch_decode
    monkeypatch.setattr(type(tokenizer), "batch_decode", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    first = PastaMethod(pasta_target).topic_banned()
    second = PastaMethod(pasta_target).topic_banned()
    assert len(calls) <= 1 and torch.equal(first, second)
    texts = [tokenizer.decode([i]) for i in range(pasta_target.vocab_size)]
    assert first.tolist() == [i for i, t in enumerate(texts) if any(c in t for c in TOPIC_FORBIDDEN)]
    assert any(t == '"' for t in texts) and texts.index('"') in first.tolist()
