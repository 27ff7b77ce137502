"""Pricing drafts in shared forwards: the tree cut, the choice of depths, and the engine using them without
changing any output."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.costs import CostCurve
from fastforward.draft_budget import PRIOR, DraftBudget, DraftLevels, cut_to_depth, depth_gains, levels_of
from fastforward.engine import BatchDecoder, Proposer, SequenceRun
from fastforward.errors import InputTypeError
from fastforward.proposers import make_proposer
from fastforward.tree import DraftTree
from fastforward.verify import SamplingConfig


@st.composite
def trees(draw):
    n = draw(st.integers(1, 24))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    return DraftTree.from_parents(tokens, parents)


@settings(max_examples=80, deadline=None)
@given(tree=trees(), depth=st.integers(0, 8))
def test_cut_to_depth_keeps_exactly_the_shallow_paths(tree, depth):
    cut = cut_to_depth(tree, depth)
    old_depths = tree.shape.depths
    assert len(cut) == int((old_depths <= depth).sum())
    assert int(cut.shape.depths.max()) <= depth
    # every kept node has the same root-to-node token path as before, in the same order
    kept = (old_depths <= depth).nonzero().flatten().tolist()
    for new, old in enumerate(kept):
        assert tree.tokens[tree.shape.path_to(old)].tolist() == cut.tokens[cut.shape.path_to(new)].tolist()


def test_levels_of_counts_nodes_per_depth_and_prices_aux_with_the_deepest():
    tree = DraftTree.from_parents([1, 2, 3, 4, 5], [-1, 0, 0, 1, 3])  # depths 0 1 1 2 3
    lv = levels_of(tree, aux_rows=6, gains=[0.9, 0.5, 0.2, 0.1])
    assert lv.rows == [2, 1, 1 + 6] and lv.gains == [0.9, 0.5, 0.2]
    alone = levels_of(DraftTree.single(7), aux_rows=5, gains=[])
    assert alone.rows == [5] and alone.gains == [0.0]


def test_depth_gains_prior_and_history():
    assert depth_gains([], [], 3) == [PRIOR, PRIOR**2, PRIOR**3]
    g = depth_gains([100, 100], [90, 10], 3)
    assert g[0] == pytest.approx((90 + 2 * PRIOR) / 102) and g[1] == pytest.approx((10 + 2 * PRIOR**2) / 102)
    assert g == sorted(g, reverse=True)  # never rising with depth
    assert depth_gains([10], [10], 2)[1] <= depth_gains([10], [10], 2)[0]


FIXED_COST = CostCurve({1: 11.0, 2: 12.0, 64: 74.0})  # 10 ms per forward + 1 ms per row


def test_a_draft_worth_its_row_alone_is_cut_in_a_full_forward():
    budget = DraftBudget(FIXED_COST, 64)
    draft = DraftLevels([1, 1], [0.5, 0.3])
    assert budget.choose(1, 1.0, [draft]) == [2]  # a sequence of its own: 1.8 tokens / 13 ms beats 1 / 11
    assert budget.choose(16, 16.0, [draft]) == [0]  # with 15 others: 16.5 / 27 is below 16 / 26


def test_a_flat_curve_keeps_every_level_that_gains():
    budget = DraftBudget(CostCurve.flat(), 64)
    drafts = [DraftLevels([1, 3, 9], [0.9, 0.4, 0.1]), DraftLevels([4], [0.0])]
    assert budget.choose(8, 8.0, drafts) == [3, 0]


@settings(max_examples=60, deadline=None)
@given(gains=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), others=st.integers(1, 30))
def test_more_company_never_means_deeper_drafts(gains, others):
    gains = sorted(gains, reverse=True)
    budget = DraftBudget(FIXED_COST, 64)
    draft = DraftLevels([1] * len(gains), gains)
    alone = budget.choose(1, 1.0, [draft])[0]
    crowded = budget.choose(1 + others, 1.0 + others, [draft])[0]
    assert crowded <= alone


# -- the engine --------------------------------------------------------------------------------------------------


PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [3, 1, 4, 1, 5, 9, 2, 6], [20, 21, 20, 21, 22]]


def _decode(target, methods, budget, sampling=SamplingConfig(), seed=None, n=20, rows=64):
    runs = [SequenceRun(target, p, make_proposer(m, target), max_new_tokens=n, sampling=sampling, seed=seed)
            for p, m in zip(PROMPTS, methods, strict=True)]
    batch = BatchDecoder(rows, cut_drafts=budget is not None)
    batch.budget = budget
    for run in runs:
        batch.add(run)
    while len(batch):
        batch.step()
    return runs


def test_steep_curve_cuts_greedy_drafts_without_changing_outputs(packed):
    methods = ["jacobi", "lookahead", "tr-jacobi", "jacobi"]
    expensive = DraftBudget(CostCurve({1: 1.0, 64: 64.0}), 64)  # a row costs what a sequence does: no draft pays
    cut = _decode(packed, methods, expensive)
    whole = _decode(packed, methods, None)
    for p, a, b in zip(PROMPTS, cut, whole, strict=True):
        solo = ff.generate(packed, p, "ar", max_new_tokens=20)
        assert a.emitted == b.emitted == solo.token_ids
    # every shared step of the cut runs verified the root alone; uncut, the drafts were there
    assert all(r.stats.proposal_tokens == r.stats.target_forwards - 1 for r in cut)
    assert sum(r.stats.proposal_tokens for r in whole) > sum(r.stats.target_forwards - 1 for r in whole)


def test_flat_curve_keeps_drafts_as_proposed(packed, pin_costs):
    methods = ["jacobi", "jacobi", "tr-jacobi", "pld"]
    pin_costs(packed, CostCurve.flat())  # pld sizes its drafts alike in both decodes (live timings would differ)
    # one forward, any size; seeded, so Jacobi's initial guesses are the same in both
    flat = _decode(packed, methods, DraftBudget(CostCurve.flat(), 4096), seed=0, rows=4096)
    whole = _decode(packed, methods, None, seed=0, rows=4096)
    for a, b in zip(flat, whole, strict=True):
        assert a.emitted == b.emitted
        assert a.stats.proposal_tokens == b.stats.proposal_tokens


def test_sampled_runs_are_cut_and_keep_their_samples(packed):
    sampling = SamplingConfig(temperature=1.0)
    methods = ["jacobi", "tr-jacobi", "jacobi", "lookahead"]
    expensive = DraftBudget(CostCurve({1: 1.0, 64: 64.0}), 64)
    shared = _decode(packed, methods, expensive, sampling=sampling, seed=3)
    for p, m, run in zip(PROMPTS, methods, shared, strict=True):
        alone = ff.generate(packed, p, m, max_new_tokens=20, temperature=1.0, seed=3)
        ar = ff.generate(packed, p, "ar", max_new_tokens=20, temperature=1.0, seed=3)
        assert run.emitted == alone.token_ids == ar.token_ids  # keyed draws: the same samples at any draft size
        assert run.stats.proposal_tokens == run.stats.target_forwards - 1  # cut to the root: no draft pays
        assert alone.stats.proposal_tokens > alone.stats.target_forwards - 1  # alone, they drafted


def test_drafts_with_probabilities_are_never_cut(packed):
    draft = packed  # the target as its own draft model: every draft carries its probabilities when sampling
    runs = [SequenceRun(packed, p, make_proposer("sps", packed, draft=draft, k=3), max_new_tokens=12,
                        sampling=SamplingConfig(temperature=1.0), seed=5) for p in PROMPTS[:2]]
    batch = BatchDecoder(64)
    batch.budget = DraftBudget(CostCurve({1: 1.0, 64: 64.0}), 64)
    for run in runs:
        batch.add(run)
    while len(batch):
        batch.step()
    for p, run in zip(PROMPTS, runs, strict=False):
        alone = ff.generate(packed, p, "sps", max_new_tokens=12, temperature=1.0, seed=5,
                            method_options={"draft": draft, "k": 3})
        assert run.emitted == alone.token_ids
        assert run.stats.proposal_tokens == alone.stats.proposal_tokens


class _Spy(Proposer):
    name = "spy"

    def __init__(self):
        self.seen = []

    def propose(self, state):
        self.seen.append(state.max_draft_depth)
        return None


def test_proposers_hear_the_depth_worth_drafting_only_when_sharing(packed):
    expensive = DraftBudget(CostCurve({1: 1.0, 64: 64.0}), 64)
    spies = [_Spy(), _Spy()]
    runs = [SequenceRun(packed, p, s, max_new_tokens=n, sampling=SamplingConfig(), seed=None)
            for p, s, n in zip(PROMPTS, spies, [3, 8], strict=False)]
    batch = BatchDecoder(64)
    batch.budget = expensive
    for run in runs:
        batch.add(run)
    while len(batch):
        batch.step()
    shared_steps = runs[0].stats.target_forwards - 1
    assert spies[0].seen == [0] * shared_steps
    assert spies[1].seen[:shared_steps] == [0] * shared_steps
    assert spies[1].seen[shared_steps:] and all(d is None for d in spies[1].seen[shared_steps:])  # alone again


def test_generate_batch_checks_cut_drafts(packed):
    with pytest.raises(InputTypeError, match="cut_drafts"):
        ff.generate_batch(packed, [[1, 2, 3]], cut_drafts="yes")
    out = ff.generate_batch(packed, [[1, 2, 3], [4, 5, 6]], "jacobi", max_new_tokens=6, cut_drafts=False)
    assert [r.token_ids for r in out] == [ff.generate(packed, p, "ar", max_new_tokens=6).token_ids
                                          for p in ([1, 2, 3], [4, 5, 6])]


def test_generate_prompts_cli_with_and_without_cut_drafts(packed, tmp_path, monkeypatch, capsys):
    import json

    from fastforward import cli

    monkeypatch.setattr(ff, "load", lambda *a, **k: packed)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [5, 6, 7, 5, 6, 7, 5][: 3 + i]}) + "\n" for i in range(3)))
    outputs = []
    for extra in ([], ["--no-cut-drafts"]):
        rc = cli.main(["generate", "--prompts", str(prompts), "--model", "tiny", "--method", "jacobi",
                       "--max-new-tokens", "6", "--json", "--no-stream", *extra])
        assert rc == 0
        outputs.append([json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines() if line])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
