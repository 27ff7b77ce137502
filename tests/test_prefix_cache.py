"""Prompt prefixes read once: reused KV entries are bitwise what a full prefill writes, outputs are unchanged, and
the cache keeps, finds and evicts what it should."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.engine import SequenceRun, read_prompt, run_steps
from fastforward.model.kv import StaticKVCache
from fastforward.model.prefix_cache import PrefixCache, prefix_cache_for
from fastforward.proposers import make_proposer
from fastforward.verify import SamplingConfig


def _filled(tokens: list[int]) -> StaticKVCache:
    cache = StaticKVCache(2, 1, 4, 64)
    n = len(tokens)
    cache.k[:, :, :n] = torch.tensor(tokens, dtype=torch.float32).view(1, 1, n, 1)
    cache.v[:, :, :n] = -cache.k[:, :, :n]
    cache.length = n
    return cache


def test_lookup_finds_the_longest_shared_prefix_and_never_the_last_position():
    pc = PrefixCache(max_tokens=100)
    for toks in ([1, 2, 3, 4, 5], [1, 2, 9, 9], [7, 7, 7]):
        pc.store(torch.tensor(toks), _filled(toks), {})
    entry, m = pc.lookup(torch.tensor([1, 2, 3, 4, 8, 8]))
    assert m == 4 and entry.tokens.tolist() == [1, 2, 3, 4, 5]
    entry, m = pc.lookup(torch.tensor([1, 2, 3, 4, 5]))  # the whole prompt is kept: all but its last position
    assert m == 4
    assert pc.lookup(torch.tensor([8, 1, 2]))[0] is None
    target = StaticKVCache(2, 1, 4, 64)
    pc.restore(entry, 3, target)
    assert target.length == 3 and target.k[0, 0, :3, 0].tolist() == [1.0, 2.0, 3.0]


def test_entries_need_the_taps_asked_for_and_are_evicted_least_recently_used():
    pc = PrefixCache(max_tokens=8)
    pc.store(torch.tensor([1, 2, 3]), _filled([1, 2, 3]), {})
    assert pc.lookup(torch.tensor([1, 2, 3, 4]), hidden_layers=(2,))[0] is None  # no taps kept for it
    pc.store(torch.tensor([1, 2, 3]), _filled([1, 2, 3]), {2: torch.ones(3, 5)})  # replaces, same tokens
    assert len(pc) == 1 and pc.tokens == 3
    assert pc.lookup(torch.tensor([1, 2, 3, 4]), hidden_layers=(2,))[1] == 3
    pc.store(torch.tensor([5, 6, 7]), _filled([5, 6, 7]), {})
    pc.lookup(torch.tensor([1, 2, 9]))  # [1, 2, 3] is now the most recently used
    pc.store(torch.tensor([8, 8, 8]), _filled([8, 8, 8]), {})  # 9 tokens > 8: the least recently used goes
    assert pc.tokens == 6 and pc.lookup(torch.tensor([5, 6, 0]))[0] is None
    pc.store(torch.arange(20), _filled(list(range(20))), {})  # larger than the whole cache: not kept
    assert pc.tokens == 6
    assert pc.hits > 0 and pc.queries > pc.hits


def test_reused_prefix_is_bitwise_a_full_prefill(packed):
    layers = (0, 1, 5)  # 5: a tap index this 2-layer model does not have
    first = torch.tensor([3, 9, 4, 7, 1, 1, 5, 8, 2, 6])
    second = torch.cat([first[:7], torch.tensor([11, 12, 13, 14])])
    pc = prefix_cache_for(packed, 1000)
    assert pc is not None
    read_prompt(packed, first, packed.new_cache(32), layers, prefix_cache=pc)
    cached = packed.new_cache(32)
    out, reused = read_prompt(packed, second, cached, layers, prefix_cache=pc)
    plain = packed.new_cache(32)
    ref, none = read_prompt(packed, second, plain, layers)
    assert reused == 7 and none == 0
    assert torch.equal(out.logits, ref.logits)
    n = second.numel()
    assert torch.equal(cached.k[:, :, :n], plain.k[:, :, :n]) and torch.equal(cached.v[:, :, :n], plain.v[:, :, :n])
    assert out.hidden.keys() == ref.hidden.keys() and ref.hidden
    for layer in ref.hidden:
        assert torch.equal(out.hidden[layer], ref.hidden[layer])


prompts = st.lists(st.integers(1, 95), min_size=2, max_size=20)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shared=prompts, tails=st.lists(st.lists(st.integers(1, 95), min_size=1, max_size=6), min_size=2, max_size=4),
       method=st.sampled_from(["ar", "pld", "jacobi", "lookahead"]))
def test_outputs_with_a_prefix_cache_equal_ar(packed, shared, tails, method):
    pc = prefix_cache_for(packed, 4096)
    for tail in tails:
        ids = shared + tail
        run = SequenceRun(packed, ids, make_proposer(method, packed), max_new_tokens=12, sampling=SamplingConfig(),
                          seed=0, prefix_cache=pc)
        for _ in run_steps(run):
            pass
        assert run.emitted == ff.generate(packed, ids, "ar", max_new_tokens=12).token_ids
    assert pc.hits >= len(shared) * (len(tails) - 1) - len(tails)  # later prompts found the shared part


def test_backends_that_are_not_row_exact_get_no_prefix_cache(tiny):
    assert prefix_cache_for(tiny, 1000) is None  # the float64 reference model runs sequences one by one


def test_server_reports_cached_prompt_tokens(packed):
    openai = pytest.importorskip("openai")
    from fastforward.server import BackgroundServer, create_app

    app = create_app(packed, model_name="tiny", max_batch_tokens=64, prefix_cache_tokens=1000)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        second = client.completions.create(model="tiny", prompt=prompt[:6] + [40, 41], max_tokens=4, temperature=0)
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 6
    assert "fastforward_prefix_cache_hits_total 6" in metrics.splitlines()
    solo = ff.generate(packed, prompt[:6] + [40, 41], "ar", max_new_tokens=4)
    assert second.choices[0].text == solo.text
