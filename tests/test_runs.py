"""Each method builds its own run behind the engine's one run protocol, and every request goes through one
:class:`~fastforward.engine.Generation` (request, run, text streamer, result)."""

import pytest

import fastforward as ff
from fastforward.engine import BatchDecoder, Generation, Run, SequenceRun, decode_batch, run_steps
from fastforward.pasta.interpreter import PastaMethod, PastaRun
from fastforward.proposers import make_proposer
from fastforward.verify import SamplingConfig

SETTINGS = dict(max_new_tokens=12, sampling=SamplingConfig(), seed=0)


def test_each_method_builds_its_own_run(tiny):
    ar = make_proposer("pld", tiny).new_run(tiny, [3, 4, 5], **SETTINGS)
    assert type(ar) is SequenceRun and isinstance(ar, Run)
    pasta = make_proposer("pasta", tiny, plain=True)
    assert isinstance(pasta, PastaMethod) and not hasattr(pasta, "propose")  # it builds a run, it proposes nothing
    run = pasta.new_run(tiny, [3, 4, 5], **SETTINGS)
    assert type(run) is PastaRun and isinstance(run, Run)
    assert "__new__" not in vars(SequenceRun)


@pytest.mark.parametrize("method", ["ar", "pld", "pasta"])
def test_every_run_kind_decodes_through_the_same_protocol(tiny, method):
    options = {"plain": True} if method == "pasta" else {}
    alone = ff.generate(tiny, [3, 4, 5], "ar", max_new_tokens=12).token_ids
    run = make_proposer(method, tiny, **options).new_run(tiny, [3, 4, 5], **SETTINGS)
    assert [t for tokens in run_steps(run) for t in tokens] == run.emitted == alone
    assert run.finished and run.cache is None


def test_decode_batch_is_a_loop_over_batch_decoder(tiny):
    prompts = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]
    alone = [ff.generate(tiny, p, "ar", max_new_tokens=12).token_ids for p in prompts]
    for max_active in (None, 1, 2):
        runs = [make_proposer("pld", tiny).new_run(tiny, p, **SETTINGS) for p in prompts]
        got = [[] for _ in prompts]
        for i, tokens in decode_batch(runs, 64, max_active):
            got[i] += tokens
        assert got == alone == [r.emitted for r in runs]
    batch = BatchDecoder(64)
    runs = [make_proposer("ar", tiny).new_run(tiny, p, **SETTINGS) for p in prompts]
    for run in runs:
        batch.add(run)
    while len(batch):
        batch.step()
    assert [r.emitted for r in runs] == alone


def test_one_generation_object_for_every_path(tiny):
    request = ff.GenerationRequest([3, 4, 5], "pld", max_new_tokens=16, stop=["t9"])
    streamed = ff.stream(tiny, request)
    assert isinstance(streamed, Generation) and streamed.request is request
    text = "".join(streamed)
    # driven step by step, as generate_batch and the server drive it
    driven = request.start(tiny)
    pieces = []
    for tokens in run_steps(driven.sequence):
        driven.add(tokens)
        pieces.append(driven.visible_delta())
    pieces.append(driven.final_delta())
    result = driven.finish()
    assert "".join(pieces) == text == result.text == streamed.result.text
    assert result.token_ids == streamed.result.token_ids == driven.sequence.emitted
    batch = ff.generate_batch(tiny, [request, request], max_batch_tokens=32)
    assert [r.text for r in batch] == [text, text]
