"""The incremental n-gram index of prompt lookup decoding against the whole-context search it replaces."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.engine import Proposal
from fastforward.proposers.pld import NgramIndex, PromptLookupProposer, prompt_lookup_match
from fastforward.testing import tiny_target

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def same(got, want) -> bool:
    return got[0].tolist() == want[0].tolist() and got[1] == want[1]


@SETTINGS
@given(data=st.data(), alphabet=st.integers(1, 6), max_ngram=st.integers(1, 5), min_ngram=st.integers(1, 5),
       num_pred=st.integers(0, 12))
def test_index_equals_prompt_lookup_match_as_the_context_grows(data, alphabet, max_ngram, min_ngram, num_pred):
    """Random contexts (small alphabets: many repeats, periodic runs) grown in random chunks: at every size the
    index gives exactly the continuation and n that the unfold search over the whole context gives."""
    min_ngram = min(min_ngram, max_ngram)
    tokens = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=80))
    ids = torch.tensor(tokens, dtype=torch.long)
    index = NgramIndex(max_ngram, min_ngram)
    length = 0
    while length < len(tokens):
        length = min(len(tokens), length + data.draw(st.integers(1, 12)))
        context = ids[:length]
        index.sync(context)
        assert len(index) == length
        for k in {num_pred, 1, 10}:
            assert same(index.match(context, k), prompt_lookup_match(context, max_ngram, k, min_ngram))


def test_index_examples():
    index = NgramIndex(3, 1)
    ids = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3])
    index.sync(ids)
    cont, n = index.match(ids, 5)
    assert (cont.tolist(), n) == ([7, 1, 2, 3], 3)  # the most recent earlier [1, 2, 3]; runs into the tail
    index.sync(torch.tensor([5]))  # shorter: starts over
    assert len(index) == 1 and index.match(torch.tensor([5]), 5)[1] == 0
    periodic = torch.tensor([4, 5, 4, 5, 4])
    index.sync(periodic)
    assert index.match(periodic, 4)[0].tolist() == [5, 4]  # [4,5,4] ends at 3 of 5: its continuation is the tail


class CheckedPLD(PromptLookupProposer):
    """Asserts, at every proposal, that the index's lookup equals the whole-context reference."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.checked = 0

    def propose(self, state) -> Proposal | None:
        proposal = super().propose(state)
        k = min(self.num_pred_tokens, state.remaining - 1)
        if k > 0:
            assert same(self.index.match(state.tokens, k),
                        prompt_lookup_match(state.tokens, self.max_ngram, k, self.min_ngram))
            assert len(self.index) == state.length
            self.checked += 1
        return proposal


def test_proposer_index_follows_the_decode_state():
    target = tiny_target()
    prompt = [3, 4, 5, 6, 7, 8] * 3 + [11, 90, 2]
    want = ff.generate(target, prompt, "ar", max_new_tokens=48).token_ids
    for options in ({"max_ngram": 3, "min_ngram": 1}, {"max_ngram": 2, "min_ngram": 2}, {"max_ngram": 4}):
        proposer = CheckedPLD(num_pred_tokens=6, adaptive=False, **options)
        got = ff.generate(target, prompt, proposer, max_new_tokens=48)
        assert got.token_ids == want
        assert proposer.checked > 0
        # the proposer is reused: start() indexes the new run from scratch
        again = ff.generate(target, prompt[::-1], proposer, max_new_tokens=16)
        assert again.token_ids == ff.generate(target, prompt[::-1], "ar", max_new_tokens=16).token_ids
