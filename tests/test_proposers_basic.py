"""Jacobi, prompt lookup and lookahead: greedy equality with AR, sampling distribution, statistics, options."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.model import TargetModel
from fastforward.proposers import make_proposer
from fastforward.proposers.jacobi import JacobiProposer, init_tokens
from fastforward.proposers.lookahead import LookaheadProposer, window_mask
from fastforward.proposers.pld import prompt_lookup
from fastforward.testing import (
    TinyTokenizer,
    chi2_critical,
    exact_joint,
    pooled_chi2,
    sampled_continuations,
    tiny_llama_hf,
    tiny_target,
)
from fastforward.verify import SamplingConfig

# FF_EXAMPLES=200 for the acceptance run; the default keeps the suite quick.
EXAMPLES = settings(
    max_examples=int(os.environ.get("FF_EXAMPLES", 60)),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
VOCAB = 96  # the conftest tiny model


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------

_AR: dict = {}


def ar_tokens(target, prompt, max_new_tokens) -> list[int]:
    key = (id(target), tuple(prompt), max_new_tokens)
    if key not in _AR:
        _AR[key] = ff.generate(target, list(prompt), "ar", max_new_tokens=max_new_tokens).token_ids
    return _AR[key]


def run(target, prompt, method, max_new_tokens, seed=0, **options) -> ff.GenerationResult:
    return ff.generate(target, list(prompt), method, max_new_tokens=max_new_tokens, seed=seed, method_options=options)


def map_model(next_token: dict[int, int], vocab: int = 16, default: int = 0, eos: int | None = None) -> TargetModel:
    """A Llama whose greedy next token is ``next_token.get(t, default)`` for the current token t, by construction:
    one-hot embeddings, attention and MLP outputs zeroed (the residual stream stays the embedding), and an LM head
    that maps token t's one-hot to a margin of 8 on its successor."""
    model = tiny_llama_hf(vocab_size=vocab, hidden_size=max(16, vocab), layers=1, heads=2, kv_heads=1,
                          intermediate_size=16, seed=0)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for t in range(vocab):
            head[next_token.get(t, default), t] = 1.0
    tok = TinyTokenizer(vocab, eos)
    if eos is not None:
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
    return TargetModel("map", model, tok, backend="lean")


def cycle_model(period: int, vocab: int = 16) -> TargetModel:
    """Greedy output cycles 1, 2, ..., period, 1, 2, ... (every other token leads into the cycle at 1)."""
    return map_model({t: t % period + 1 for t in range(1, period + 1)}, vocab, default=1)


prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
    st.builds(lambda pat, reps, tail: pat * reps + tail,
              st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), st.integers(2, 5),
              st.lists(st.integers(0, VOCAB - 1), max_size=3)),
)


# ----------------------------------------------------------------------------------------------------------------
# shared helpers for tr_jacobi: init_tokens and prompt_lookup
# ----------------------------------------------------------------------------------------------------------------


def test_prompt_lookup_prefers_longest_then_most_recent():
    t = torch.tensor([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 2, 3])
    assert prompt_lookup(t, 3, 10).tolist() == [9, 9, 7, 2, 3]  # 2-gram "2 3": latest earlier match at index 6
    t = torch.tensor([5, 6, 7, 0, 5, 6, 7, 1, 6, 7])
    assert prompt_lookup(t, 3, 2).tolist() == [1, 6]  # most recent "6 7" (index 5), not the first (index 1)
    assert prompt_lookup(torch.tensor([1, 2, 3]), 3, 10).numel() == 0  # no earlier occurrence
    assert prompt_lookup(torch.tensor([4]), 3, 10).numel() == 0
    assert prompt_lookup(torch.tensor([8, 1, 2, 9, 1, 2]), 2, 10, min_ngram=2).tolist() == [9, 1, 2]
    assert prompt_lookup(torch.tensor([8, 1, 2, 9, 3, 2]), 2, 10, min_ngram=2).numel() == 0  # 1-gram not tried


def test_prompt_lookup_matches_reference_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        got = prompt_lookup(t, 3, 5).tolist()
        want, seq = [], t.tolist()
        for n in range(min(3, len(seq) - 1), 0, -1):
            hits = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[-n:]]
            if hits:
                want = seq[hits[-1] + n : hits[-1] + n + 5]
                break
        assert got == want


def test_init_tokens_modes(tiny):
    prompt = [5, 6, 7, 8]
    state = _state(tiny, prompt, generated=[40, 41, 42])
    assert set(init_tokens(state, 50, "prompt").tolist()) <= set(prompt)
    noise = init_tokens(state, 200, "noise").tolist()
    assert set(noise) <= set(prompt + [40, 41, 42]) and set(noise) & {40, 41, 42}
    assert init_tokens(state, 3, "pad").tolist() == [0, 0, 0]  # no pad, no EOS: 0
    assert init_tokens(state, 0, "noise").numel() == 0
    a = init_tokens(_state(tiny, prompt, seed=3), 10, "prompt")
    b = init_tokens(_state(tiny, prompt, seed=3), 10, "prompt")
    assert torch.equal(a, b)  # seeded by state.rng
    with pytest.raises(ff.UsageError):
        init_tokens(state, 3, "zeros")


def _state(target, prompt, generated=(), seed=0):
    import random

    from fastforward.engine import DecodeState

    ids = torch.tensor(list(prompt) + list(generated) + [0] * 8)
    return DecodeState(target, ids, len(prompt) + len(generated), len(prompt), SamplingConfig(), random.Random(seed),
                       None, 16)


# ----------------------------------------------------------------------------------------------------------------
# greedy output == AR, token for token
# ----------------------------------------------------------------------------------------------------------------


@EXAMPLES
@given(prompt=prompts, max_new=st.integers(1, 40), seed=st.integers(0, 2**16),
       n_tokens=st.integers(2, 16), init=st.sampled_from(["prompt", "noise", "pad"]), blocks=st.booleans())
def test_jacobi_greedy_equals_ar(tiny, prompt, max_new, seed, n_tokens, init, blocks):
    res = run(tiny, prompt, "jacobi", max_new, seed, n_tokens=n_tokens, init=init, blocks=blocks)
    assert res.token_ids == ar_tokens(tiny, prompt, max_new)


@EXAMPLES
@given(prompt=prompts, max_new=st.integers(1, 40), max_ngram=st.integers(1, 4), min_ngram=st.integers(1, 4),
       num_pred=st.integers(1, 12))
def test_pld_greedy_equals_ar(tiny, prompt, max_new, max_ngram, min_ngram, num_pred):
    min_ngram = min(min_ngram, max_ngram)
    res = run(tiny, prompt, "pld", max_new, max_ngram=max_ngram, min_ngram=min_ngram, num_pred_tokens=num_pred)
    assert res.token_ids == ar_tokens(tiny, prompt, max_new)


@EXAMPLES
@given(prompt=prompts, max_new=st.integers(1, 40), seed=st.integers(0, 2**16), window=st.integers(1, 8),
       ngram=st.integers(2, 6), guesses=st.integers(1, 8))
def test_lookahead_greedy_equals_ar(tiny, prompt, max_new, seed, window, ngram, guesses):
    res = run(tiny, prompt, "lookahead", max_new, seed, window=window, ngram=ngram, guesses=guesses)
    assert res.token_ids == ar_tokens(tiny, prompt, max_new)


@pytest.mark.parametrize("method", ["jacobi", "pld", "lookahead"])
def test_greedy_equals_ar_with_eos_and_hf_backend(method, tiny_hf):
    eos_target = tiny_target(eos_token_id=7)
    for target in (eos_target, tiny_hf):
        for prompt in ([3, 4, 5, 6, 7, 8] * 3, [11, 90, 2], [60] * 10):
            want = ar_tokens(target, prompt, 64)
            assert run(target, prompt, method, 64, seed=1).token_ids == want


@pytest.mark.parametrize("method,options", [
    ("jacobi", {"n_tokens": 8}),
    ("pld", {}),
    ("lookahead", {}),
])
def test_default_and_paper_options_equal_ar_on_cycling_model(method, options, pin_costs):
    """On a model whose AR output cycles, the retrieval methods must accept drafts (tau > 1) and stay exact. Their
    default sizes follow the cost curve: pinned to one where a draft token costs a tenth of a step (the machine's
    own, measured under load, may price the drafts out)."""
    from fastforward.costs import CostCurve

    target = cycle_model(5)
    pin_costs(target, CostCurve({1: 10.0, 64: 73.0}))
    prompt = [3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    want = ar_tokens(target, prompt, 60)
    assert want[:6] == [3, 4, 5, 1, 2, 3]
    res = run(target, prompt, method, 60, **options)
    assert res.token_ids == want
    if method != "jacobi":  # Jacobi on a last-token model only fixes one token per forward (guesses never help)
        assert res.stats.tau > 2.0


def test_jacobi_accepts_on_constant_model():
    """A model that always predicts token 2: after one Jacobi iteration every guess is right."""
    target = map_model({}, default=2)
    res = run(target, [5, 6, 7], "jacobi", 64, n_tokens=8)
    assert res.token_ids == [2] * 64
    assert res.stats.tau > 3.0
    assert res.stats.method_stats["fast_forward_mean"] > 3.0


# ----------------------------------------------------------------------------------------------------------------
# Jacobi statistics and trajectories
# ----------------------------------------------------------------------------------------------------------------


def test_jacobi_stats_and_trajectory_by_construction():
    """X -> R -> B -> C -> A -> A ...; initial guesses are the pad P (-> A). With n = 4 the first block runs:
    [R P P P] fixes B; [B A A] fixes C (A at position 3 is already right, behind the wrong A at 2);
    [C A] accepts that A -- a stationary token -- and fixes y4 = A. The second block ([A P P P], then [A A A])
    has no stationary token; its last forward ends the run, so the engine does not report it to the proposer."""
    X, R, B, C, A, P = 9, 10, 11, 12, 13, 14
    target = map_model({X: R, R: B, B: C, C: A, A: A}, default=A, eos=P)
    prop = make_proposer("jacobi", target, n_tokens=4, init="pad", record_trajectory=True)
    res = ff.generate(target, [X], prop, max_new_tokens=9)
    assert res.token_ids == [R, B, C, A, A, A, A, A, A]
    s = res.stats.method_stats
    assert s["fast_forward"] == [1, 1, 2, 1, 3] and s["iterations"] == 5
    assert s["stationary_tokens"] == 1 and s["blocks_completed"] == 1
    (traj,) = prop.trajectories
    assert traj["prefix_ids"] == [X, R] and traj["prefix_length"] == 2
    assert traj["states"] == [[P, P, P, P], [B, A, A, A], [B, C, A, A], [B, C, A, A]]
    assert traj["fixed_point"] == [B, C, A, A]


@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("n_tokens,init,max_new", [(4, "prompt", 37), (16, "noise", 50), (2, "pad", 9)])
def test_jacobi_fast_forward_sums_to_emitted_tokens(tiny, blocks, n_tokens, init, max_new):
    for prompt in ([3, 4, 5, 6, 7, 8] * 3, [1, 2]):
        res = run(tiny, prompt, "jacobi", max_new, seed=5, n_tokens=n_tokens, init=init, blocks=blocks)
        s = res.stats.method_stats
        assert sum(s["fast_forward"]) == len(res.token_ids) - 1
        assert s["iterations"] == res.stats.target_forwards - 1
        assert 0 <= s["stationary_tokens"] <= sum(s["fast_forward"]) - s["iterations"]
    cyc = run(map_model({}, default=2), [1], "jacobi", 40, n_tokens=8, blocks=blocks)
    assert sum(cyc.stats.method_stats["fast_forward"]) == 39


@pytest.mark.parametrize("target_name", ["tiny", "cycle"])
def test_jacobi_trajectories_end_in_ar_continuation(tiny, target_name):
    target = tiny if target_name == "tiny" else cycle_model(3)
    prompt = [3, 4, 5, 6, 7, 8, 3, 4]
    n = 5
    prop = JacobiProposer(n_tokens=n, record_trajectory=True)
    res = ff.generate(target, prompt, prop, max_new_tokens=43, seed=2)
    out = prompt + res.token_ids
    assert len(prop.trajectories) == res.stats.method_stats["blocks_completed"] >= 8
    for traj in prop.trajectories:
        p = traj["prefix_length"]
        assert traj["prefix_ids"] == out[:p]
        assert all(len(s) == n for s in traj["states"])
        assert traj["states"][-1] == traj["fixed_point"] == out[p : p + n]
        assert traj["fixed_point"] == ar_tokens(target, traj["prefix_ids"], n)
        for a, b in zip(traj["states"], traj["states"][1:], strict=False):  # the fixed prefix only grows
            fixed = next((i for i in range(n) if a[i] != traj["fixed_point"][i]), n)
            assert b[:fixed] == a[:fixed]


# ----------------------------------------------------------------------------------------------------------------
# lookahead: the window mask and the verification trie
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width,levels", [(6, 4), (3, 1), (1, 2), (8, 3)])
def test_lookahead_window_mask_gives_one_token_per_offset(width, levels):
    mask, depth = window_mask(width, levels)
    for a in range(mask.shape[0]):
        seen = sorted(depth[mask[a]].tolist())
        assert seen == list(range(1, int(depth[a]) + 1))  # plus the root at offset 0
        assert mask[a, a]


class _Recording(LookaheadProposer):
    def propose(self, state):
        prop = super().propose(state)
        self.record = (state.tokens.clone(), prop)
        return prop

    def observe(self, state, step):
        self.steps_seen.append((*self.record, step.logits.clone()))
        super().observe(state, step)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_lookahead_aux_logits_equal_plain_forward_over_their_context(tiny, tiny_hf, backend):
    """Every lookahead token's logits must equal a plain causal forward over the sequence it claims to extend."""
    target = tiny if backend == "lean" else tiny_hf
    prop = _Recording(window=4, ngram=4, guesses=3)
    prop.steps_seen = []
    prompt = [3, 4, 5, 6, 7, 8] * 2
    ff.generate(target, prompt, prop, max_new_tokens=6, seed=0)
    assert len(prop.steps_seen) >= 4  # past the warm-up
    for prefix, proposal, logits in prop.steps_seen:
        n = len(proposal.tree)
        aux = proposal.aux_tokens
        for a in range(aux.numel()):
            ctx = proposal.aux_mask[a, n:]
            order = proposal.aux_depths[ctx].argsort()
            seq = torch.cat([prefix, aux[ctx][order]])
            cache = target.new_cache(seq.numel() + 1)
            ref = target.forward(seq, torch.arange(seq.numel()), cache).logits[-1]
            torch.testing.assert_close(logits[n + a], ref, rtol=1e-6, atol=1e-6)
        # tree nodes as well: each one continues the prefix with its path
        for node in range(n):
            path = proposal.tree.shape.path_to(node)
            seq = torch.cat([prefix, proposal.tree.tokens[path[1:]]])
            ref = target.forward(seq, torch.arange(seq.numel()), target.new_cache(seq.numel() + 1)).logits[-1]
            torch.testing.assert_close(logits[node], ref, rtol=1e-6, atol=1e-6)


def test_lookahead_trie_shares_prefixes_and_pool_is_lru():
    prop = LookaheadProposer(window=2, ngram=4, guesses=3)
    prop._add([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 9, 9, 9]])  # capacity 3: [1, 2, 3, 4] dropped
    assert prop.pool[1] == [(2, 3, 5), (2, 6, 7), (9, 9, 9)]
    prop._add([[1, 2, 3, 5]])  # refresh: most recent last
    assert prop.pool[1] == [(2, 6, 7), (9, 9, 9), (2, 3, 5)]
    tree = prop._trie(1, prop.pool[1][::-1], depth=3)
    assert tree.tokens.tolist() == [1, 2, 3, 5, 9, 9, 9, 6, 7]  # most recent first; "2" shared
    assert tree.shape.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5, 1, 7]
    assert prop._trie(1, prop.pool[1][::-1], depth=1).tokens.tolist() == [1, 2, 9]
    assert prop.max_proposal_size() == 1 + 3 * 3 + (2 - 1) + 2 * 2  # root + G(N-1) + the steady window


def test_lookahead_pool_seeded_from_prompt():
    target = cycle_model(4)
    prop = make_proposer("lookahead", target, ngram=3)
    res = ff.generate(target, [1, 2, 3, 4, 1, 2], prop, max_new_tokens=2)
    assert res.token_ids == [3, 4]
    assert prop.pool[1] == [(2, 3)] and prop.pool[4] == [(1, 2)]


# ----------------------------------------------------------------------------------------------------------------
# sampling: the tokens after a drafted step are distributed as the target's
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab():
    return tiny_target(vocab_size=8, init_std=0.15, seed=1)


@pytest.mark.parametrize("method,options,cfg", [
    ("jacobi", {"n_tokens": 4, "init": "noise"}, SamplingConfig(1.0)),
    # fixed draft lengths: adaptive PLD cuts drafts by this machine's measured cost curve, and under other load it
    # may draft nothing, which would leave the drafted path untested (the guard below) rather than wrong
    ("pld", {"max_ngram": 2, "adaptive": False}, SamplingConfig(1.0)),
    ("lookahead", {"window": 3, "ngram": 3, "guesses": 4}, SamplingConfig(0.8, top_p=0.95)),
])
def test_sampling_distribution_chi_square(tiny_vocab, method, options, cfg):
    target = tiny_vocab
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    samples = 3000
    exact = exact_joint(target, prompt, cfg)
    counts, drafted, accepted = sampled_continuations(target, prompt, lambda: make_proposer(method, target, **options),
                                                      cfg, samples)
    assert drafted > 0.9 * samples and accepted > 0.03 * samples  # the drafted path is really exercised
    chi2, df = pooled_chi2(exact, counts)
    assert sum(counts.values()) == samples and set(counts) <= set(exact)
    assert df >= 20
    assert chi2 < chi2_critical(df), f"{method}: chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


@pytest.mark.parametrize("method,options", [
    ("jacobi", {"n_tokens": 6}),
    ("jacobi", {"blocks": False, "init": "noise"}),
    ("pld", {}),
    ("lookahead", {"window": 4, "ngram": 3}),
])
def test_sampling_same_seed_same_tokens_as_ar(tiny, method, options):
    """The point-mass verifier draws one target sample per visited node from the run's generator, in sequence
    order, so a correct proposer reproduces AR sampling token for token under the same seed (a much sharper check
    than the chi-square test, valid as long as the verifier keeps that scheme for deterministic drafts)."""
    prompt = [3, 4, 5, 6, 7, 8] * 4
    for seed in range(6):
        kw = dict(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=seed)
        ar = ff.generate(tiny, prompt, "ar", **kw).token_ids
        assert ff.generate(tiny, prompt, method, method_options=options, **kw).token_ids == ar


# ----------------------------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,options,fragment", [
    ("jacobi", {"n_tokens": 1}, "n_tokens"),
    ("jacobi", {"n_tokens": "8"}, "n_tokens"),
    ("jacobi", {"n_tokens": True}, "n_tokens"),
    ("jacobi", {"init": "zeros"}, "init"),
    ("jacobi", {"blocks": 1}, "blocks"),
    ("jacobi", {"record_trajectory": True, "blocks": False}, "record_trajectory"),
    ("pld", {"max_ngram": 0}, "max_ngram"),
    ("pld", {"min_ngram": 4}, "min_ngram"),
    ("pld", {"num_pred_tokens": 0}, "num_pred_tokens"),
    ("lookahead", {"window": -1}, "window"),
    ("lookahead", {"ngram": 1}, "ngram"),
    ("lookahead", {"guesses": 2.5}, "guesses"),
    ("lookahead", {"level": 5}, "level"),
])
def test_bad_options_raise_usage_error(tiny, method, options, fragment):
    with pytest.raises(ff.UsageError) as err:
        make_proposer(method, tiny, **options)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg


def test_methods_registered_with_defaults():
    methods = ff.available_methods()
    assert methods["jacobi"].options() == {"n_tokens": 16, "init": "prompt", "blocks": True,
                                           "record_trajectory": False}
    assert methods["pld"].options() == {"max_ngram": 3, "num_pred_tokens": 10, "min_ngram": 1, "adaptive": True}
    assert methods["lookahead"].options() == {"window": 0, "ngram": 0, "guesses": 0}  # 0: sized by the cost curve


def test_lookahead_sized_by_the_cost_curve(tiny, pin_costs):
    """Options left at 0 follow the machine's cost curve: the papers' 7/5/7 where forwards are nearly free, the
    smallest window where they are not; options given are kept."""
    from fastforward.costs import CostCurve
    from fastforward.proposers.lookahead import SIZE_LADDER, size_for_curve

    steep = CostCurve({1: 10.0, 8: 26.0, 16: 45.0, 64: 150.0})  # a CPU's (t(8) = 2.6 t(1))
    assert size_for_curve(CostCurve.flat()) == (7, 5, 7)
    assert size_for_curve(steep) == SIZE_LADDER[-1]
    assert size_for_curve(CostCurve({1: 10.0, 32: 12.5, 64: 20.0})) == (5, 4, 5)  # 30 rows nearly free, 56 not
    pin_costs(tiny, steep)
    prop = make_proposer("lookahead", tiny)
    assert (prop.W, prop.N, prop.G) == SIZE_LADDER[-1] and prop.stats()["sized_by_cost_curve"]
    prop = make_proposer("lookahead", tiny, guesses=5)
    assert (prop.W, prop.N, prop.G) == (1, 3, 5)
    prop = make_proposer("lookahead", tiny, window=7, ngram=5, guesses=7)
    assert (prop.W, prop.N, prop.G) == (7, 5, 7) and not prop.stats()["sized_by_cost_curve"]
