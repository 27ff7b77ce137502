"""TR-Jacobi (MSN) and the tree builder: static structure, table refill, greedy equality with AR, lossless
sampling, greedy tree construction, budget choice, the build-tree command."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward import cli
from fastforward.engine import DecodeState, GenerationStats, Proposal, StepResult, decode_steps
from fastforward.proposers import make_proposer
from fastforward.proposers.tr_jacobi import (
    TRJacobiProposer,
    build_template,
    builtin_choices,
    installed_tree_path,
    read_tree,
)
from fastforward.testing import TinyTokenizer, tiny_llama_hf, tiny_target
from fastforward.tree_builder import (
    Calibration,
    acceptance_rates,
    build_tree,
    calibration_choices,
    choose_budget,
    expected_tau,
    greedy_tree,
    interpolate_cost,
    replay_tau,
    save_tree,
    sweep_spread,
)
from fastforward.verify import SamplingConfig, Verdict, target_probs

PAPER_FILE = Path("/work/shared/reference/tree-choices.json")
PAPER = f"{PAPER_FILE}:medusa_mc_sim_7b_63"
needs_paper = pytest.mark.skipif(not PAPER_FILE.is_file(), reason="the reference tree file is not available")

EXAMPLES = settings(
    max_examples=int(os.environ.get("FF_EXAMPLES", 80)),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# A small tree as the builder makes it: greedy on hand-made acceptance rates (depth 3, ranks 0..2).
HAND_RATES = [[0.5, 0.3, 0.09], [0.4, 0.2, 0.05], [0.7, 0.1, 0.0]]
BUILT = greedy_tree(HAND_RATES, 7)[0]
# A rank-0 chain of depth 4 with a rank-1 sibling at every depth (8 nodes).
CHAIN_TOP2 = [[0] * (d - 1) + [r] for d in range(1, 5) for r in range(2)]


def _state(target, tokens, prompt_length=None):
    ids = torch.zeros(len(tokens) + 64, dtype=torch.long)
    ids[: len(tokens)] = torch.tensor(tokens)
    return DecodeState(target, ids, len(tokens), prompt_length or len(tokens), SamplingConfig(), random.Random(0),
                       None, 64)


_AR: dict = {}


def ar_tokens(target, prompt, n):
    key = (id(target), tuple(prompt), n)
    if key not in _AR:
        _AR[key] = ff.generate(target, list(prompt), "ar", max_new_tokens=n).token_ids
    return _AR[key]


prompts = st.one_of(
    st.lists(st.integers(0, 95), min_size=1, max_size=40),
    # repeated patterns so the retrieval chain matches and gets accepted
    st.builds(lambda pat, k: (pat * k)[:60], st.lists(st.integers(0, 95), min_size=1, max_size=6), st.integers(2, 8)),
)


# ----------------------------------------------------------------------------------------------------------------
# static structure
# ----------------------------------------------------------------------------------------------------------------


@needs_paper
def test_paper_tree_is_69_tokens_deep_5():
    t = build_template(read_tree(PAPER)[0], retrieval_len=5)
    assert len(t.shape) == 69 and t.size == 69 and t.shape.max_depth == 5
    assert (t.depth, t.width, t.base) == (4, 10, 64)
    # the retrieval chain hangs under the root, one node per depth 1..5
    assert t.shape.parents[64:].tolist() == [0, 64, 65, 66, 67]
    assert t.shape.depths[64:].tolist() == [1, 2, 3, 4, 5]
    # one precomputed shape per number of retrieved tokens, all prefixes of the full one
    assert [len(s) for s in t.shapes] == [64, 65, 66, 67, 68, 69]
    mc = build_template(read_tree(PAPER)[0], 0)
    assert len(mc.shape) == 64 and mc.shape.max_depth == 4


def test_gather_fills_nodes_from_table_and_retrieval(tiny):
    t = build_template(CHAIN_TOP2, retrieval_len=3)
    prop = TRJacobiProposer(t)
    prop.cand = torch.arange(100, 100 + t.depth * t.width).view(t.depth, t.width)
    state = _state(tiny, [5, 6, 7, 8, 5, 6, 7])  # lookup: "5 6 7" seen before -> continuation [8, 5, 6]
    tree = prop.propose(state).tree
    assert len(tree) == t.base + 3
    for i, path in enumerate(t.choices, start=1):
        assert int(tree.tokens[i]) == int(prop.cand[len(path) - 1, path[-1]])
    assert tree.tokens[0] == 7 and tree.tokens[t.base :].tolist() == [8, 5, 6]
    # no match: the retrieval nodes are left out instead of filled with junk
    tree = prop.propose(_state(tiny, [1, 2, 3, 4])).tree
    assert len(tree) == t.base and tree.shape is t.shapes[0]


def _fake_step(t, prop, state, path, n_nodes, vocab):
    """A StepResult whose node i has logits ranking tokens (i, i+1, i+2, ...) (mod vocab) first."""
    logits = torch.zeros(n_nodes, vocab, dtype=torch.float64)
    for i in range(n_nodes):
        logits[i, (i + torch.arange(vocab)) % vocab] = -torch.arange(vocab, dtype=torch.float64)
    tree = ff.DraftTree(torch.zeros(n_nodes, dtype=torch.long), t.shapes[n_nodes - t.base])
    return StepResult(Proposal(tree), logits, Verdict(path, 0), [0])


@pytest.mark.parametrize("path,rows_from", [
    ([0], [1, 3, 5, 7]),  # nothing accepted: the depth-1..4 nodes under the root predict depths 2..5 -> rows 0..3
    ([0, 1], [3, 5, 7]),  # [0] accepted: the bonus sits at depth 2; nodes at depths 2, 3, 4 predict new depths 1-3
    ([0, 2], []),  # [1] accepted, a leaf: nothing left below it, all rows are ahead noise
    ([0, 1, 3, 5], [7]),
    ([0, 9, 10], [11, 12, 13]),  # accepted along the retrieval chain: its remaining nodes refill the table
])
def test_refill_maps_logits_rows_to_depths(tiny, path, rows_from):
    """Row j of the next table = top-K of the logits at the (j+1)-th node below the accepted path's end."""
    t = build_template(CHAIN_TOP2, retrieval_len=5)  # nodes: [0] [1] [0,0] [0,1] [0,0,0] [0,0,1] ...
    assert [list(c) for c in t.choices[:4]] == [[0], [1], [0, 0], [0, 1]]
    prop = TRJacobiProposer(t)
    context = [40, 41, 42, 43, 44, 45]
    state = _state(tiny, context)
    prop.start(state, None, {})
    prop.observe(state, _fake_step(t, prop, state, path, t.size, tiny.vocab_size))
    for j, node in enumerate(rows_from):
        assert prop.cand[j].tolist() == [node, node + 1]
    for j in range(len(rows_from), t.depth):  # ahead noise: tokens of the context
        assert set(prop.cand[j].tolist()) <= set(context)


def test_refill_ignores_nodes_missing_from_a_shortened_proposal(tiny):
    t = build_template(CHAIN_TOP2, retrieval_len=5)
    prop = TRJacobiProposer(t)
    state = _state(tiny, [40, 41, 42])
    prop.start(state, None, {})
    # only 2 retrieval tokens were proposed (nodes 9, 10); the accepted path ends at node 9
    prop.observe(state, _fake_step(t, prop, state, [0, 9], t.base + 2, tiny.vocab_size))
    assert prop.cand[0].tolist() == [10, 11]
    assert set(prop.cand[1:].flatten().tolist()) <= {40, 41, 42}


# ----------------------------------------------------------------------------------------------------------------
# greedy output == AR
# ----------------------------------------------------------------------------------------------------------------


def _check_greedy(target, prompt, n, seed, **options):
    got = ff.generate(target, list(prompt), "tr-jacobi", max_new_tokens=n, seed=seed, method_options=options)
    want = ar_tokens(target, prompt, n)
    if got.token_ids != want:
        first = next((i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=False)) if a != b), None)
        raise AssertionError(f"differs from AR at token {first}: {got.token_ids} != {want}")
    assert got.stats.tau >= 1.0
    return got


@needs_paper
@EXAMPLES
@given(prompt=prompts, n=st.integers(1, 64), seed=st.integers(0, 2**31), retrieval_len=st.sampled_from([0, 5]))
def test_greedy_equals_ar_paper_tree(tiny, prompt, n, seed, retrieval_len):
    _check_greedy(tiny, prompt, n, seed, tree=PAPER, retrieval_len=retrieval_len)


@EXAMPLES
@given(prompt=prompts, n=st.integers(1, 64), seed=st.integers(0, 2**31), retrieval_len=st.integers(0, 6),
       min_ngram=st.integers(1, 3), tree=st.sampled_from(["built", "builtin", "chain-top2", "root-only"]))
def test_greedy_equals_ar_small_trees(tiny, prompt, n, seed, retrieval_len, min_ngram, tree):
    choices = {"built": [list(c) for c in BUILT], "builtin": "builtin", "chain-top2": CHAIN_TOP2, "root-only": []}[tree]
    if tree == "root-only" and retrieval_len == 0:
        retrieval_len = 1
    _check_greedy(tiny, prompt, n, seed, tree=choices, retrieval_len=retrieval_len, min_ngram=min_ngram)


def test_greedy_equals_ar_at_the_context_limit():
    """Near the end of the context the engine shortens proposals; the refill must cope."""
    target = tiny_target(max_positions=48)
    for seed in range(4):
        prompt = [3, 4, 5] * 4
        got = ff.generate(target, prompt, "tr-jacobi", max_new_tokens=100, seed=seed,
                          method_options={"tree": CHAIN_TOP2})
        want = ff.generate(target, prompt, "ar", max_new_tokens=100).token_ids
        assert got.token_ids == want and got.finish_reason == "context"


def cycle_target(period: int = 5, vocab: int = 16) -> ff.TargetModel:
    """A Llama whose greedy continuation of token t is t+1 (mod period) by construction: one-hot embeddings, the
    attention and MLP outputs zeroed so the residual stream stays the embedding, an LM head mapping t to t+1."""
    model = tiny_llama_hf(vocab_size=vocab, hidden_size=vocab, layers=1, heads=2, kv_heads=1, intermediate_size=8)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, dtype=model.dtype))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        head[(torch.arange(vocab) + 1) % period, torch.arange(vocab)] = 1.0
    return ff.TargetModel("cycle", model, TinyTokenizer(vocab), backend="lean")


def test_accepts_from_table_and_retrieval(tiny):
    """Both sources really get accepted (so the equality tests above are not vacuous)."""
    cyc = cycle_target()
    res = ff.generate(cyc, [0, 1, 2], "tr-jacobi", max_new_tokens=60, method_options={"tree": "builtin"})
    assert res.token_ids == ff.generate(cyc, [0, 1, 2], "ar", max_new_tokens=60).token_ids
    assert res.token_ids[:7] == [3, 4, 0, 1, 2, 3, 4]
    assert res.stats.tau > 3 and res.stats.method_stats["accepted_from_retrieval"] > 40
    tree_accepts = 0
    for prompt in ([1, 2, 3], list(range(30))):
        res = _check_greedy(tiny, prompt, 100, 0, tree="builtin", retrieval_len=0)
        tree_accepts += res.stats.method_stats["accepted_from_tree"]
        assert res.stats.method_stats["accepted_from_retrieval"] == 0
    assert tree_accepts > 5


def test_default_tree_is_installed_one_else_builtin(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    prop = make_proposer("tr-jacobi", tiny)
    assert prop.tree_source == "builtin" and prop.t.base == 1 + len(builtin_choices())
    path = installed_tree_path(tiny.name)
    save_tree({"format": "fastforward-tree/1", "choices": [[0], [0, 0], [1]], "nodes": 3}, path)
    prop = make_proposer("tr-jacobi", tiny)
    assert prop.tree_source == str(path) and prop.t.base == 4


@pytest.mark.parametrize("options,fragment", [
    ({"tree": "/nonexistent/tree.json"}, "does not exist"),
    ({"tree": f"{PAPER_FILE}:no_such_tree"}, "no_such_tree"),
    ({"tree": [[0, 1]]}, "parent"),
    ({"tree": 3}, "tree must be"),
    ({"retrieval_len": -1}, "retrieval_len"),
    ({"ngram": 0}, "ngram"),
    ({"min_ngram": 4}, "min_ngram"),
    ({"init": "zeros"}, "init"),
    ({"tree": [], "retrieval_len": 0}, "proposes nothing"),
    ({"retrieval_len": 100000}, "retrieval_len must be an integer in \\[0, 256\\]"),
    ({"tree": [["a"]]}, "bad tree choice \\['a'\\]"),
    ({"tree": [1, 2]}, "bad tree choice 1 "),
    ({"tree": [[None]]}, "bad tree choice"),
    ({"tree": [[0.5]]}, "bad tree choice"),
    ({"tree": [["0"]]}, "bad tree choice"),
    ({"tree": [[True]]}, "bad tree choice"),
    ({"tree": [[10**9]]}, "ranks go up to 1000000000"),
    ({"tree": [[0] * d for d in range(1, 600)]}, "at most 512"),  # 600 tokens: more than the context (512)
])
def test_bad_options(tiny, options, fragment):
    if PAPER_FILE.name in str(options.get("tree", "")) and not PAPER_FILE.is_file():
        pytest.skip("the reference tree file is not available")
    with pytest.raises(ff.UsageError, match=fragment) as info:
        make_proposer("tr-jacobi", tiny, **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [
    [[0], ["a"]],  # a plain choices list
    {"small": [[0], [0.5]]},  # named lists (picked with path:name)
    {"format": "fastforward-tree/1", "choices": [[0], [True]], "greedy_order": [], "tau_by_nodes": []},  # built
], ids=["plain", "named", "built"])
def test_bad_choices_in_a_tree_file(tiny, tmp_path, data):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(data))
    spec = f"{path}:small" if "small" in data else str(path)
    with pytest.raises(ff.UsageError, match="bad tree choice") as info:
        make_proposer("tr-jacobi", tiny, tree=spec)
    assert str(path) in str(info.value)


def test_longest_retrieval_chain_still_equals_ar(tiny):
    _check_greedy(tiny, [1, 2, 3, 1, 2, 3, 1, 2], 24, 0, tree="builtin", retrieval_len=256)


# ----------------------------------------------------------------------------------------------------------------
# sampling stays lossless (point-mass verifier)
# ----------------------------------------------------------------------------------------------------------------

CHI2_CRITICAL_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # alpha = 0.001


def _exact_marginals(target, prompt, cfg, steps):
    """Exact AR distribution of each of the first ``steps`` generated tokens (by enumerating prefixes)."""
    joint = {(): 1.0}
    marginals = []
    for _ in range(steps):
        nxt = {}
        for seq, p in joint.items():
            ids = torch.tensor(list(prompt) + list(seq))
            logits = target.forward(ids, torch.arange(ids.numel()), target.new_cache(ids.numel() + 1)).logits[-1]
            for tok, q in enumerate(target_probs(logits, cfg).tolist()):
                nxt[seq + (tok,)] = p * q
        joint = nxt
        m = [0.0] * target.vocab_size
        for seq, p in joint.items():
            m[seq[-1]] += p
        marginals.append(m)
    return marginals


def _chi2(observed, expected_probs, n):
    """Pearson chi-square with cells of expected count < 5 pooled; returns (chi2, degrees of freedom)."""
    chi2, cells, pool_e, pool_o = 0.0, 0, 0.0, 0
    for o, p in zip(observed, expected_probs, strict=True):
        e = p * n
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + o
        else:
            chi2, cells = chi2 + (o - e) ** 2 / e, cells + 1
    if pool_e > 0:
        chi2, cells = chi2 + (pool_o - pool_e) ** 2 / pool_e, cells + 1
    return chi2, cells - 1


@pytest.mark.parametrize("tree", ["builtin", pytest.param(PAPER, marks=needs_paper)])
def test_sampling_chi_square(tree):
    target = tiny_target(vocab_size=8, init_std=0.15, seed=1)
    cfg = SamplingConfig(temperature=1.0)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1]
    samples, steps = 2000, 3
    exact = _exact_marginals(target, prompt, cfg, steps)
    counts = [[0] * 8 for _ in range(steps)]
    prop = make_proposer("tr-jacobi", target, tree=tree)
    accepted = 0
    for seed in range(samples):
        stats = GenerationStats("tr-jacobi")
        toks = [t for chunk in decode_steps(target, prompt, prop, max_new_tokens=steps, sampling=cfg, seed=seed,
                                            stats=stats) for t in chunk]
        for i, tok in enumerate(toks):
            counts[i][tok] += 1
        accepted += sum(stats.depth_accepts)
    assert accepted > 0.3 * samples  # drafted tokens really were accepted
    for i in range(steps):
        chi2, df = _chi2(counts[i], exact[i], samples)
        assert 1 <= df <= 7
        assert chi2 < CHI2_CRITICAL_001[df], f"token {i + 1}: chi2 {chi2:.1f}, df {df}"


def test_sampling_same_seed_same_tokens_as_ar(tiny):
    """The point-mass verifier draws one target sample per visited node in sequence order, so a lossless
    proposer reproduces AR sampling token for token under the same seed."""
    prompt = [3, 4, 5, 6, 7, 8] * 4
    for seed in range(6):
        kw = dict(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=seed)
        want = ff.generate(tiny, prompt, "ar", **kw).token_ids
        assert ff.generate(tiny, prompt, "tr-jacobi", method_options={"tree": "builtin"}, **kw).token_ids == want


# ----------------------------------------------------------------------------------------------------------------
# tree builder
# ----------------------------------------------------------------------------------------------------------------


def test_greedy_tree_on_hand_made_rates():
    nodes, probs = greedy_tree(HAND_RATES, 7)
    # path probabilities: [0] .5, [1] .3, [0,0] .2, [0,0,0] .14, [1,0] .12, [0,1] .1, [2] .09, then [1,0,0] .084
    assert nodes == [(0,), (1,), (0, 0), (0, 0, 0), (1, 0), (0, 1), (2,)]
    assert probs == pytest.approx([0.5, 0.3, 0.2, 0.14, 0.12, 0.1, 0.09])
    assert greedy_tree(HAND_RATES, 8)[0][-1] == (1, 0, 0)
    assert expected_tau(HAND_RATES, nodes) == pytest.approx(1 + sum(probs))
    # every prefix is a tree (parents first), and smaller budgets are prefixes
    for i, node in enumerate(nodes):
        assert len(node) == 1 or node[:-1] in nodes[:i]
    assert greedy_tree(HAND_RATES, 3)[0] == nodes[:3]
    # nodes that can never be accepted are not added
    assert greedy_tree([[0.5, 0.0], [0.0, 0.0]], 10)[0] == [(0,)]
    assert greedy_tree(HAND_RATES, 2, max_depth=1)[0] == [(0,), (1,)]


def test_choose_budget_is_argmax_of_tau_over_cost():
    taus = [1.0, 1.5, 1.8, 1.9, 2.0, 2.05]
    costs = {1: 10.0, 2: 10.0, 4: 12.0, 8: 20.0}  # extra_tokens=1 -> q = n + 1
    n, speedups = choose_budget(taus, costs, extra_tokens=1)
    brute = [taus[k] * 10.0 / interpolate_cost(costs, k + 1) for k in range(len(taus))]
    assert speedups == pytest.approx(brute)
    assert speedups[2] == pytest.approx(1.8 * 10 / 11)  # q = 3: halfway between 10 and 12 ms
    assert n == 2 == max(range(1, len(taus)), key=lambda k: brute[k])
    # a flat cost curve favours the largest tree; a steep one the smallest
    assert choose_budget(taus, {1: 10.0, 64: 10.0}, 1)[0] == 5
    assert choose_budget(taus, {1: 10.0, 2: 100.0, 8: 1000.0}, 1)[0] == 1
    # a varying retrieval chain: the cost is the mean over its lengths (here 1 or 3 extra tokens, equally often)
    _, mixed = choose_budget(taus, costs, {1: 1, 3: 1})
    assert mixed[1] == pytest.approx(1.5 * 10 / ((10.0 + 12.0) / 2))


def test_sweep_spread():
    assert sweep_spread([{1: 10.0, 2: 20.0, 4: 40.0}, {1: 11.0, 2: 30.0, 4: 40.0}]) == pytest.approx(0.1)


def test_interpolate_cost():
    costs = {"1": 10.0, "4": 16.0, "8": 20.0}
    assert interpolate_cost(costs, 1) == 10.0 and interpolate_cost(costs, 0.5) == 10.0
    assert interpolate_cost(costs, 2) == pytest.approx(12.0)
    assert interpolate_cost(costs, 12) == pytest.approx(24.0)  # extrapolated from the last segment


def _calibration(hits, retrieval):
    hits = torch.tensor(hits, dtype=torch.bool)
    return Calibration(hits, torch.ones(hits.shape[:2], dtype=torch.bool), torch.tensor(retrieval))


def test_acceptance_rates_count_only_steps_with_a_correct_prefix():
    # 4 steps, depth 2, ranks 0..1
    cal = _calibration([
        [[1, 0], [1, 0]],  # depth 1 rank 0 right, depth 2 rank 0 right
        [[0, 1], [0, 1]],  # rank 1 right at both
        [[0, 0], [1, 0]],  # depth 1 wrong: depth 2 not counted
        [[1, 0], [0, 0]],
    ], [0, 0, 0, 0])
    rates = acceptance_rates(cal)
    assert rates[0].tolist() == pytest.approx([0.5, 0.25])
    assert rates[1].tolist() == pytest.approx([1 / 3, 1 / 3])


def test_replay_tau():
    cal = _calibration([
        [[1, 0], [1, 0]],
        [[0, 1], [0, 0]],
        [[0, 0], [0, 0]],
    ], [0, 0, 2])
    nodes = [(0,), (0, 0), (1,)]
    # n=0: retrieval only (0, 0, 2); n=1: [0] right at step 0; n=2: [0,0] too; n=3: [1] at step 1
    assert replay_tau(cal, nodes) == pytest.approx([1 + 2 / 3, 2, 1 + 4 / 3, 1 + 5 / 3])


def test_build_tree_end_to_end(tiny, tmp_path):
    prompts = [[i, i + 1, i + 2, i + 3] * 3 for i in range(3)]
    costs = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 20.0, 32: 30.0, 64: 50.0, 70: 55.0}
    data = build_tree(tiny, prompts, max_nodes=12, max_new_tokens=40, width=4, depth=3, costs=costs)
    assert data["nodes"] == len(data["choices"]) >= 1
    assert data["choices"] == data["greedy_order"][: data["nodes"]]
    assert len(data["tau_by_nodes"]) == len(data["greedy_order"]) + 1
    assert data["predicted_speedup"] == max(data["speedup_by_nodes"][1:])
    assert data["tokens_per_forward"] == data["nodes"] + 6
    assert len(data["acceptance_rates"]) == 3 and len(data["acceptance_rates"][0]) == 4
    path = save_tree(data, tmp_path / "t.json")
    assert json.loads(path.read_text())["choices"] == data["choices"]
    choices, meta = read_tree(str(path))
    assert choices == data["choices"] and meta["nodes"] == data["nodes"]
    _check_greedy(tiny, prompts[0], 40, 0, tree=str(path))
    fixed = build_tree(tiny, prompts, max_nodes=12, budget=3, max_new_tokens=20, width=4, depth=3, costs=costs)
    assert fixed["nodes"] == min(3, len(fixed["greedy_order"]))


def test_calibration_tree_is_a_full_comb():
    t = build_template(calibration_choices(3, 4), retrieval_len=5)
    assert (t.depth, t.width, t.base) == (4, 3, 13)
    assert all(len(t.continuation[i]) == min(4, 4 - int(t.shape.depths[i])) for i in range(t.base))


# ----------------------------------------------------------------------------------------------------------------
# the build-tree command
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"t{i} t{i + 1}"]})
                              for i in range(4)) + "\n")
    return path


@pytest.mark.parametrize("argv,fragment", [
    (["--prompts", "/nonexistent.jsonl"], "does not exist"),
    (["--budget", "lots"], "--budget"),
    (["--budget", "99"], "--budget must be in 1..64"),
    (["--max-nodes", "0"], "--max-nodes"),
    (["--limit", "0"], "--limit"),
    (["--per-category", "1", "--limit", "2"], "not both"),
    (["--out", "/nonexistent-dir/t.json"], "does not exist"),
    (["--retrieval-len", "-1"], "--retrieval-len"),
    (["--from", "/nonexistent.json"], "--prompts (calibrate"),
    (["--bad-json"], "not valid JSON"),
    (["--no-field"], "no question field"),
    (["--from-only", "/nonexistent.json"], "cannot read"),
])
def test_build_tree_bad_input_one_line_errors(argv, fragment, questions_file, tmp_path, capsys):
    args = ["build-tree", "--prompts", str(questions_file), "--out", str(tmp_path / "t.json")]
    if argv == ["--bad-json"]:
        (tmp_path / "bad.jsonl").write_text("{not json\n")
        argv = ["--prompts", str(tmp_path / "bad.jsonl")]
    elif argv[0] == "--from-only":
        args = ["build-tree", "--from", argv[1], "--out", str(tmp_path / "t.json")]
        argv = []
    elif argv == ["--no-field"]:
        (tmp_path / "nf.jsonl").write_text('{"foo": 1}\n')
        argv = ["--prompts", str(tmp_path / "nf.jsonl")]
    assert cli.main(args + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastforward: error:") and fragment in err


def test_build_tree_missing_arguments_is_a_usage_error(capsys):
    try:
        rc = cli.main(["build-tree", "--out", "x.json"])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompts" in err


def test_build_tree_from_resizes_with_a_new_cost_curve(tiny, questions_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny)
    built = build_tree(tiny, [[1, 2, 3, 1, 2, 3]], max_nodes=8, max_new_tokens=40, width=4, depth=3,
                       costs={1: 10.0, 64: 10.0})  # free forwards: the largest tree wins
    built["model"] = "tiny-llama"
    assert built["nodes"] > 1
    src = save_tree(built, tmp_path / "built.json")
    steep = {q: 10.0 * q for q in range(1, 80)}  # every token costs a forward: the smallest tree wins
    monkeypatch.setattr("fastforward.tree_builder.measure_forward_costs", lambda *a, **k: dict(steep))
    out = tmp_path / "resized.json"
    assert cli.main(["build-tree", "--model", "tiny-llama", "--from", str(src), "--out", str(out), "--no-install"]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["nodes"] == 1 and data["choices"] == built["greedy_order"][:1]
    assert data["greedy_order"] == built["greedy_order"] and data["tau_by_nodes"] == built["tau_by_nodes"]
    assert data["resized_from"] == str(src) and len(data["cost_sweeps_ms"]) == 2
    assert not installed_tree_path("tiny-llama").exists()
    # a tree of another model, or not a built tree at all, is refused in one line
    bad = tmp_path / "plain.json"
    bad.write_text("[[0], [1]]")
    for path, fragment in ((src, "calibrated on 'tiny-llama'"), (bad, "not a tree written by")):
        rc = cli.main(["build-tree", "--model", "other", "--from", str(path), "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and fragment in err


def test_build_tree_command_writes_and_installs(tiny, questions_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny)
    costs = {q: 10.0 + q for q in (1, 2, 4, 8, 16, 32, 64, 70)}
    monkeypatch.setattr("fastforward.tree_builder.measure_forward_costs", lambda *a, **k: dict(costs))
    out = tmp_path / "tree.json"
    rc = cli.main(["build-tree", "--model", "tiny-llama", "--prompts", str(questions_file), "--out", str(out),
                   "--limit", "2", "--offset", "1", "--max-new-tokens", "24", "--width", "3", "--depth", "3",
                   "--install"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["calibration"]["questions"] == ["c:1", "c:3"] and data["model"] == "tiny-llama"
    assert data["cost_curve_ms"] == {str(q): t for q, t in costs.items()}
    assert json.loads(installed_tree_path("tiny-llama").read_text()) == data
    assert "predicted tau" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------
# the default model
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_paper
def test_default_model_greedy_equals_ar(default_model):
    for prompt in ["Write a Python function that reverses a list.",
                   "Summarize: the cat sat on the mat. The cat sat on the mat again, then slept on the mat."]:
        ids = default_model.encode(prompt)
        want = ff.generate(default_model, ids, "ar", max_new_tokens=48).token_ids
        for tree in (PAPER, "builtin"):
            got = ff.generate(default_model, ids, "tr-jacobi", max_new_tokens=48, method_options={"tree": tree})
            assert got.token_ids == want


def test_chi2_table_matches_wilson_hilferty():
    """The fixed critical values above are the chi-square 0.999 quantiles (checked against an approximation)."""
    for df, crit in CHI2_CRITICAL_001.items():
        z = 3.0902
        wh = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        assert abs(wh - crit) / crit < 0.05
