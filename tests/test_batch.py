"""Many sequences per forward: each sequence's output equals what it gets alone.

The packed tiny GGUF target (fp32, native kernels) runs the shared forward for real; the float64 tiny target runs
sequences one by one behind the same interface. Greedy: token-identical to solo AR; seeded sampling: the same
samples as the same seed alone.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.errors import UsageError
from fastforward.model import LeanLlama

METHODS = ["ar", "pld", "jacobi", "lookahead", "tr-jacobi"]


@pytest.fixture
def forward_sizes(monkeypatch):
    """Records the number of sequences in every shared forward."""
    sizes = []
    original = LeanLlama.forward_many

    def spy(self, requests, hidden_layers=()):
        sizes.append(len(requests))
        return original(self, requests, hidden_layers)

    monkeypatch.setattr(LeanLlama, "forward_many", spy)
    return sizes


prompt_ids = st.lists(st.integers(1, 95), min_size=1, max_size=24)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(prompt_ids, st.sampled_from(METHODS), st.integers(1, 24)), min_size=1, max_size=8),
       budget=st.sampled_from([1, 8, 64, 512]))
def test_batch_greedy_equals_solo_ar(packed, batch, budget):
    prompts = [p for p, _, _ in batch]
    methods = [m for _, m, _ in batch]
    # one max_new_tokens for the call; per-sequence lengths through requests
    requests = [ff.GenerationRequest(p, m, max_new_tokens=n) for p, m, n in batch]
    results = ff.generate_batch(packed, requests, max_batch_tokens=budget)
    for (p, m, n), result in zip(batch, results, strict=True):
        solo = ff.generate(packed, p, "ar", max_new_tokens=n)
        assert result.token_ids == solo.token_ids, (m, p)
    assert len(results) == len(prompts) == len(methods)


def test_batch_shares_forwards(packed, forward_sizes):
    prompts = [[3, 4, 5, 3, 4, 5, 3], [9, 8, 7], [11, 12], [20, 21, 22, 23]]
    results = ff.generate_batch(packed, prompts, ["ar", "pld", "jacobi", "ar"], max_new_tokens=12,
                                max_batch_tokens=256)
    assert max(forward_sizes) == 4  # one forward carried every sequence
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == ff.generate(packed, prompt, max_new_tokens=12).token_ids


def test_batch_budget_splits_forwards(packed, forward_sizes):
    prompts = [[3, 4, 5], [9, 8, 7], [11, 12]]
    results = ff.generate_batch(packed, prompts, max_new_tokens=6, max_batch_tokens=1)
    assert max(forward_sizes) == 1
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == ff.generate(packed, prompt, max_new_tokens=6).token_ids


@pytest.mark.parametrize("method", ["ar", "pld", "lookahead"])
def test_batch_seeded_sampling_equals_solo(packed, method):
    prompts = [[5, 6, 7, 5, 6], [30, 31], [40, 41, 42, 43]]
    seeds = [1, 2, 3]
    results = ff.generate_batch(packed, prompts, method, max_new_tokens=16, temperature=1.0, top_k=20,
                                seed=seeds)
    for prompt, seed, result in zip(prompts, seeds, results, strict=True):
        solo = ff.generate(packed, prompt, method, max_new_tokens=16, temperature=1.0, top_k=20, seed=seed)
        assert result.token_ids == solo.token_ids


def test_batch_one_by_one_backend_equals_solo(tiny):
    """float64 weights: no row-exact shared forward, the sequences run one by one behind the same call."""
    assert tiny.batch_rows_limit() == 0
    prompts = [[1, 2, 3], [4, 5, 6, 4, 5], [7]]
    results = ff.generate_batch(tiny, prompts, ["pld", "tr-jacobi", "ar"], max_new_tokens=10)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == ff.generate(tiny, prompt, max_new_tokens=10).token_ids


def test_batch_stop_and_eos_per_sequence(packed):
    prompts = [[3, 4, 5], [9, 8, 7]]
    solo = [ff.generate(packed, p, max_new_tokens=10) for p in prompts]
    stop = packed.decode(solo[0].token_ids[2:4])
    results = ff.generate_batch(packed, prompts, max_new_tokens=10, stop=stop)
    for prompt, result in zip(prompts, results, strict=True):
        alone = ff.generate(packed, prompt, max_new_tokens=10, stop=stop)
        assert (result.token_ids, result.text, result.finish_reason) == \
            (alone.token_ids, alone.text, alone.finish_reason)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error"),
    [
        ("one prompt", {}, TypeError),
        ([], {}, UsageError),
        ([[1, 2], None], {}, TypeError),
        ([[1, 2]], {"method": ["ar", "pld"]}, UsageError),
        ([[1, 2]], {"seed": [1, 2]}, UsageError),
        ([[1, 2]], {"max_batch_tokens": 0}, UsageError),
        ([[1, 2]], {"max_active": 0}, UsageError),
        ([[1, 2]], {"method": "nope"}, UsageError),
        ([[1, 2]], {"on_tokens": 3}, TypeError),
        ([[1, 2], [10**9]], {}, UsageError),
    ],
)
def test_batch_bad_input(tiny, prompts, kwargs, error):
    with pytest.raises(error):
        ff.generate_batch(tiny, prompts, **kwargs)


def test_continuous_batching_keeps_at_most_max_active(packed, forward_sizes):
    prompts = [[3 + i, 4, 5, 3 + i] for i in range(6)]
    lengths = [3, 9, 5, 12, 4, 7]
    requests = [ff.GenerationRequest(p, "pld" if i % 2 else "ar", max_new_tokens=n)
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    results = ff.generate_batch(packed, requests, max_active=3, max_batch_tokens=512)
    assert max(forward_sizes) == 3  # never more than three sequences in flight
    for prompt, n, result in zip(prompts, lengths, results, strict=True):
        assert result.token_ids == ff.generate(packed, prompt, max_new_tokens=n).token_ids
