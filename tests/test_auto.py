"""``auto``: every source mix decodes exactly what AR decodes (greedy, seeded sampling, batches, interrupts, a
source that raises or drafts nothing), the sampled distribution is the target's, and the pieces it is made of (the
union trie, what a verification tells about each candidate, the tree choice, the drafter's gate) do what they say."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.costs import CostCurve
from fastforward.drafters.checkpoint import save_eagle3
from fastforward.drafters.eagle import Eagle3Drafter
from fastforward.drafters.vocab import DraftVocab
from fastforward.proposers import make_proposer
from fastforward.proposers.auto import (
    CONTEXT,
    DATASTORE,
    DRAFTER,
    SET_ASIDE_RUNS,
    AutoProposer,
    Candidates,
    DrafterAverages,
    DrafterGate,
    accepted_depth,
    choose,
    merge,
    monotone_down_paths,
    on_target_path,
)
from fastforward.testing import chi2_critical, exact_joint, pooled_chi2, sampled_continuations, tiny_target
from fastforward.verify import SamplingConfig

EXAMPLES = settings(max_examples=int(os.environ.get("FF_EXAMPLES", 40)), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
VOCAB = 96
#: a curve where a draft token costs a tenth of a step: every source drafts whatever this machine's own curve says
GENTLE = CostCurve({1: 10.0, 64: 73.0})


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:64]
    drafter = Eagle3Drafter.for_target(target, DraftVocab.from_target_ids(ids, VOCAB), seed=0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("drafter")
    save_eagle3(drafter, folder, dtype="float32")
    return str(folder)


@pytest.fixture(scope="module")
def datastore(target, tmp_path_factory):
    """The target's own greedy answers to a few prompts (lookups find what it will say) and random noise."""
    g = torch.Generator().manual_seed(0)
    answers = [ff.generate(target, torch.randint(0, VOCAB, (6,), generator=g).tolist(), "ar",
                           max_new_tokens=40).token_ids for _ in range(12)]
    noise = [torch.randint(0, VOCAB, (30,), generator=g).tolist() for _ in range(12)]
    path = tmp_path_factory.mktemp("store") / "store.jsonl"
    path.write_text("".join(json.dumps({"response_ids": s}) + "\n" for s in answers + noise))
    return str(path)


@pytest.fixture
def gentle(target, pin_costs):
    """The target on the gentle curve, with no memory of earlier tests' runs (the drafter's averages are shared
    by a target's runs: a drafter set aside by an earlier test would not be asked)."""
    pin_costs(target, GENTLE)
    forget_drafter_averages(target)
    return target


def forget_drafter_averages(target):
    """Empty the drafter averages a target's runs share (what earlier runs learned of the drafter's worth)."""
    for greedy in (True, False):
        target.set_shared(("auto drafter averages", greedy), None)


def fresh_auto(target, **options):
    """An ``auto`` proposer for a run that knows nothing of earlier runs: its drafter is never set aside for them."""
    forget_drafter_averages(target)
    return make_proposer("auto", target, **options)


def mixes(drafter_dir, datastore):
    """Every mix of the three sources (the context on or off, a datastore or none, a drafter or none)."""
    out = []
    for context in (True, False):
        for store in ("none", datastore):
            for drafter in ("none", drafter_dir):
                out.append(dict(context=context, datastore=store, drafter=drafter))
    return out


prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    st.builds(lambda pat, reps, tail: pat * reps + tail, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5),
              st.integers(2, 5), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
)


# ----------------------------------------------------------------------------------------------------------------
# lossless
# ----------------------------------------------------------------------------------------------------------------


@EXAMPLES
@given(prompt=prompts, max_new=st.integers(1, 40), mix=st.integers(0, 7), max_depth=st.integers(1, 12),
       max_nodes=st.sampled_from([2, 5, 24]), probe=st.sampled_from([1, 8]))
def test_auto_greedy_equals_ar_for_every_source_mix(gentle, drafter_dir, datastore, prompt, max_new, mix, max_depth,
                                                    max_nodes, probe):
    options = dict(mixes(drafter_dir, datastore)[mix], max_depth=max_depth, max_nodes=max_nodes, probe=probe)
    got = ff.generate(gentle, list(prompt), "auto", max_new_tokens=max_new, method_options=options)
    assert got.token_ids == ff.generate(gentle, list(prompt), "ar", max_new_tokens=max_new).token_ids
    failed = {name: s["failed"] for name, s in got.stats.method_stats["sources"].items() if "failed" in s}
    assert not failed  # (a source that raises is dropped without changing the output: that must not hide a bug)


def test_auto_drafts_from_every_source_and_counts_them(gentle, drafter_dir, datastore):
    """A prompt that repeats itself (the context knows the continuation), one that starts a stored answer (the
    datastore does), and the drafter probed on the rest: each source is asked, the cheap ones draft and have accepted
    tokens, all equal AR."""
    g = torch.Generator().manual_seed(0)
    stored_start = torch.randint(0, VOCAB, (6,), generator=g).tolist()  # the datastore's first answer's prompt
    sources = {}
    for prompt in ([5, 9, 13, 2] * 4, stored_start, [1, 2, 3]):
        got = ff.generate(gentle, prompt, "auto", max_new_tokens=40,
                          method_options=dict(drafter=drafter_dir, datastore=datastore, probe=1))
        assert got.token_ids == ff.generate(gentle, prompt, "ar", max_new_tokens=40).token_ids
        for name, s in got.stats.method_stats["sources"].items():
            sources.setdefault(name, []).append(s)
    for name in ("context", "datastore", "drafter"):
        assert sum(s["asked"] for s in sources[name]) > 0, name
        assert all(s["asked"] >= s["drafted_steps"] for s in sources[name])
    for name in ("context", "datastore"):  # (the random drafter's nodes are priced out once its calibration has
        assert sum(s["drafted_steps"] for s in sources[name]) > 0, name  # seen them fail: the oracle test drafts)
    for name in ("context", "datastore"):  # (the random drafter is seldom right: see the oracle test below)
        assert sum(s["accepted_tokens"] for s in sources[name]) > 0, name


def test_a_drafter_that_knows_the_answer_is_asked_and_credited(gentle, drafter_dir, monkeypatch):
    """The drafter's source replaced by an oracle (the target's own continuation, three tokens deep): with neither
    context nor datastore to draft from, the gate keeps asking it, its drafts are accepted, and the stats credit
    them to it."""
    prompt = [40, 41, 42]
    want = ff.generate(gentle, prompt, "ar", max_new_tokens=40).token_ids

    def oracle(self, state, depth):
        done = state.generated
        nxt = np.asarray(want[done : done + min(depth, 3)], dtype=np.int64)
        if nxt.size == 0:
            return None
        return Candidates(DRAFTER, nxt, np.arange(-1, nxt.size - 1), np.arange(1, nxt.size + 1),
                          np.full(nxt.size, 0.9), 1)

    monkeypatch.setattr(AutoProposer, "_from_drafter", oracle)
    got = ff.generate(gentle, prompt, "auto", max_new_tokens=40,
                      method_options=dict(drafter=drafter_dir, datastore="none", context=False))
    assert got.token_ids == want
    drafter = got.stats.method_stats["sources"]["drafter"]
    assert drafter["asked"] > 0.8 * got.stats.target_forwards
    assert drafter["accepted_tokens"] > 20 and got.stats.tau > 2.5
    assert drafter["acceptance_by_depth"][0] > 0.9


@pytest.mark.parametrize("context", [True, False], ids=["all-sources", "datastore-and-drafter"])
@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=4, top_p=0.9)])
def test_auto_sampling_matches_the_target_distribution(tmp_path, pin_costs, cfg, context):
    """chi-square of 3-token continuations against the exact joint distribution, with every source on -- the context
    (a repeating prompt: its chain comes first), a datastore of the prompt's continuations, and a drafter -- and with
    the context off (the datastore's and the drafter's merged tree)."""
    target = tiny_target(vocab_size=8, init_std=0.15, seed=1, layers=4)
    pin_costs(target, GENTLE)
    drafter = Eagle3Drafter.for_target(target, DraftVocab.full(8), seed=2)
    save_eagle3(drafter, tmp_path, dtype="float32")
    store = tmp_path / "store.jsonl"
    store.write_text("".join(json.dumps({"response_ids": [0, 1, 2, 3, 4, 5, 6, 7][i:] + [0, 1, 2]}) + "\n"
                             for i in range(8)))
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    samples = 2500
    counts, drafted, accepted = sampled_continuations(
        target, prompt, lambda: fresh_auto(target, drafter=str(tmp_path), datastore=str(store), probe=1,
                                           context=context),
        cfg, samples)
    # the drafted path is really exercised (the context's chain of a random model is mostly rejected)
    assert drafted > 0.9 * samples and accepted > (0.03 if context else 0.1) * samples
    chi2, df = pooled_chi2(exact_joint(target, prompt, cfg), counts)
    assert df >= 10
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


def test_seeded_sampling_returns_the_samples_of_ar(gentle, drafter_dir, datastore):
    """No source's draft carries draft probabilities: keyed draws give a seeded run ar's samples."""
    for seed in range(6):
        prompt = [3, 7, 11, 3, 7, 11, 3]
        want = ff.generate(gentle, prompt, "ar", max_new_tokens=30, temperature=1.0, seed=seed).token_ids
        got = ff.generate(gentle, prompt, "auto", max_new_tokens=30, temperature=1.0, seed=seed,
                          method_options=dict(drafter=drafter_dir, datastore=datastore, probe=1))
        assert got.token_ids == want


def test_batches_of_every_mix_equal_solo_ar(packed, pin_costs, tmp_path):
    """Several sequences per forward, each with its own source mix (the draft budget cuts their trees): each
    sequence's tokens are its solo AR's."""
    pin_costs(packed, GENTLE)
    vocab = packed.vocab_size
    g = torch.Generator().manual_seed(4)
    store = tmp_path / "store.jsonl"
    store.write_text("".join(json.dumps({"response_ids": torch.randint(0, vocab, (30,), generator=g).tolist()}) + "\n"
                             for _ in range(6)))
    drafter = Eagle3Drafter.for_target(packed, DraftVocab.full(vocab), seed=1)
    save_eagle3(drafter, tmp_path / "drafter", dtype="float32")
    prompts = [[1, 2, 3, 1, 2, 3, 1], torch.randint(0, vocab, (9,), generator=g).tolist(), [7] * 5, [4, 8, 15, 16],
               [9, 9, 2, 9, 9]]
    mixes = [dict(datastore=str(store), drafter="none"), dict(datastore="none", drafter=str(tmp_path / "drafter")),
             None, dict(datastore=str(store), drafter=str(tmp_path / "drafter"), probe=1),
             dict(context=False, datastore="none", drafter="none")]
    requests = [ff.GenerationRequest(p, "ar" if m is None else "auto", max_new_tokens=24, method_options=m or {})
                for p, m in zip(prompts, mixes, strict=True)]
    results = ff.generate_batch(packed, requests)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == ff.generate(packed, prompt, "ar", max_new_tokens=24).token_ids


def test_an_interrupted_generation_keeps_a_prefix_of_ar(gentle, drafter_dir):
    """Ctrl-C in the middle (here raised by a step observer, after the third verification): what was produced is
    kept, and it is what AR produces."""
    want = ff.generate(gentle, [2, 4, 6, 2, 4, 6], "ar", max_new_tokens=40).token_ids
    steps = []

    def interrupt(state, step):
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt

    gen = ff.stream(gentle, [2, 4, 6, 2, 4, 6], "auto", max_new_tokens=40, observers=[interrupt],
                    method_options={"drafter": drafter_dir})
    with pytest.raises(KeyboardInterrupt):
        for _ in gen:
            pass
    part = gen.partial_result()
    assert 0 < len(part.token_ids) < 40 and part.token_ids == want[: len(part.token_ids)]


@pytest.mark.parametrize("source", [CONTEXT, DATASTORE, DRAFTER])
def test_a_source_that_raises_or_drafts_nothing_never_changes_the_output(gentle, drafter_dir, datastore, source,
                                                                         monkeypatch):
    prompt = [5, 9, 13, 2, 5, 9, 13]
    want = ff.generate(gentle, prompt, "auto", max_new_tokens=30,
                       method_options=dict(drafter=drafter_dir, datastore=datastore, probe=1)).token_ids
    assert want == ff.generate(gentle, prompt, "ar", max_new_tokens=30).token_ids
    maker = {CONTEXT: "_context_match", DATASTORE: "_from_datastore", DRAFTER: "_from_drafter"}[source]
    calls = []

    def raises(self, state, depth):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a broken source")
        return getattr(AutoProposer, "_real_" + maker)(self, state, depth)

    monkeypatch.setattr(AutoProposer, "_real_" + maker, getattr(AutoProposer, maker), raising=False)
    monkeypatch.setattr(AutoProposer, maker, raises)
    real_outcome = DrafterGate.outcome  # (the random drafter never pays: keep asking it all the same)
    monkeypatch.setattr(DrafterGate, "outcome", lambda gate, *args: real_outcome(gate, *args) or True)
    forget_drafter_averages(gentle)  # (the first run may have set its drafter aside for the next ones)
    got = ff.generate(gentle, prompt, "auto", max_new_tokens=30,
                      method_options=dict(drafter=drafter_dir, datastore=datastore, probe=1))
    assert got.token_ids == want
    name = ("context", "datastore", "drafter")[source]
    assert got.stats.method_stats["sources"][name]["failed"] == "RuntimeError: a broken source"
    assert len(calls) == 2  # dropped for the rest of the run
    monkeypatch.setattr(AutoProposer, maker, lambda self, state, depth: None)  # drafts nothing
    got = ff.generate(gentle, prompt, "auto", max_new_tokens=30,
                      method_options=dict(drafter=drafter_dir, datastore=datastore, probe=1))
    assert got.token_ids == want and got.stats.method_stats["sources"][name]["drafted_steps"] == 0


def test_options_are_checked_before_any_work(target, no_load):
    for options, fragment in ((dict(max_depth=0), "max_depth"), (dict(probe=10**6), "probe"),
                              (dict(learn="yes"), "learn"), (dict(drafter=3), "drafter")):
        with pytest.raises(ff.UsageError, match=fragment):
            ff.generate(target, [1, 2], "auto", max_new_tokens=2, method_options=options)
    with pytest.raises(ff.UsageError, match="datastore"):
        ff.generate(target, [1, 2], "auto", max_new_tokens=2, method_options={"datastore": "/no/such/file"})
    with pytest.raises(ff.UsageError, match="drafter folder not found"):
        ff.generate(target, [1, 2], "auto", max_new_tokens=2, method_options={"drafter": "/no/such/folder"})


def test_learned_answers_draft_for_later_requests(gentle):
    """With learn, a finished generation joins the datastore: the same prompt again drafts from it."""
    opts = {"datastore": "none", "learn": True, "context": False, "drafter": "none"}
    prompt = [17, 3, 88, 41]
    first = ff.generate(gentle, prompt, "auto", max_new_tokens=40, method_options=opts)
    second = ff.generate(gentle, prompt, "auto", max_new_tokens=40, method_options=opts)
    assert first.token_ids == second.token_ids
    assert second.stats.method_stats["sources"]["datastore"]["accepted_tokens"] > 0
    assert second.stats.tau > first.stats.tau


# ----------------------------------------------------------------------------------------------------------------
# the pieces
# ----------------------------------------------------------------------------------------------------------------


def chain(source, tokens, scores, key=1):
    k = len(tokens)
    return Candidates(source, np.asarray(tokens, dtype=np.int64), np.arange(-1, k - 1), np.arange(1, k + 1),
                      np.full(k, 0.5), key, np.asarray(scores, dtype=np.float64))


def paths_of(tree, nodes=None):
    """{path of tokens: node} of a merged tree."""
    nodes = range(tree.size) if nodes is None else nodes
    out = {}
    for i in nodes:
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out[tuple(reversed(path))] = i
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(parts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=1, max_size=4))
def test_merge_is_the_union_trie_at_each_node_best_chance(parts):
    cands = [chain(i % 3, toks, [0.9 ** (d + 1) * (1 - 0.1 * i) for d in range(len(toks))])
             for i, toks in enumerate(parts)]
    tree = merge(cands, 5)
    want: dict = {}
    for c in cands:
        for d in range(len(c.tokens)):
            path = tuple(c.tokens[: d + 1].tolist())
            score, bits = want.get(path, (0.0, 0))
            want[path] = (max(score, c.scores[d]), bits | (1 << c.source))
    got = paths_of(tree)
    assert set(got) == set(want)
    for path, i in got.items():
        assert tree.scores[i] == pytest.approx(want[path][0]) and tree.sources[i] == want[path][1]
        assert tree.depths[i] == len(path)
        assert tree.parents[i] < i  # parents before children


def test_what_a_verification_tells_about_each_candidate():
    # the tree: a-b-c, a-d, e; the target said a, b, x (accepted a and b, then its own x)
    c = Candidates(0, np.array([1, 2, 3, 4, 5]), np.array([-1, 0, 1, 0, -1]), np.array([1, 2, 3, 2, 1]),
                   np.ones(5), 1)
    known, on = on_target_path(c, np.array([1, 2, 9]))
    assert known.tolist() == [True, True, True, True, True]
    assert on.tolist() == [True, True, False, False, False]
    known, on = on_target_path(c, np.array([1]))  # only depth 1 known: a lies on the path, its children unknown
    assert known.tolist() == [True, False, False, False, True]
    assert on.tolist() == [True, False, False, False, False]


def test_scores_never_rise_down_a_path_and_the_choice_prices_every_size():
    scores = monotone_down_paths(np.array([0.5, 0.9, 0.4, 0.8]), np.array([-1, 0, 1, -1]), np.array([1, 2, 3, 1]))
    assert scores.tolist() == [0.5, 0.5, 0.4, 0.8]
    tree = merge([chain(CONTEXT, [1, 2, 3], [0.9, 0.8, 0.1])], 8)
    flat = np.array([10.0, 10.1, 10.2, 10.3])
    steep = np.array([10.0, 20.0, 30.0, 40.0])
    assert choose(tree, flat, 4).nodes.size == 3  # every node pays where rows are nearly free
    assert choose(tree, steep, 4).nodes.size == 0  # none where a row costs a step
    medium = np.array([10.0, 12.0, 14.0, 25.0])
    pick = choose(tree, medium, 4)
    assert pick.nodes.size == 2 and pick.expected == pytest.approx(2.7) and pick.ms == 14.0
    assert accepted_depth(tree, pick.nodes, np.array([1, 2, 7])) == 2
    assert accepted_depth(tree, pick.nodes[:1], np.array([1, 2, 7])) == 1


def test_the_drafter_gate_asks_when_its_rate_beats_the_cheap_tree_and_probes_otherwise():
    gate = DrafterGate(probe=4, averages=DrafterAverages(prior_gain=0.5, prior_ms=1.0))  # 0.5 tokens per ms
    assert gate.ask(False, cheap_rate=0.1)  # a plain step gets 0.1 tokens per ms: worth asking
    gate.outcome(False, extra_tokens=0.0, extra_ms=2.0, cheap_rate=0.1)  # it bought nothing: wait 2 steps
    asked = []
    for _ in range(20):  # the cheap tree is far better now: probed after 2, then every 4 steps (the limit)
        asked.append(gate.ask(False, cheap_rate=1.0))
        if asked[-1]:
            gate.outcome(False, 0.0, 2.0, 1.0)
    assert np.nonzero(asked)[0].tolist() == [1, 5, 9, 13, 17]
    assert gate.ask(True, cheap_rate=0.4)  # steps where the cheap sources draft keep their own average (the prior)
    next_run = DrafterGate(probe=4, averages=gate.averages)  # a later run of the target backs off where it stopped
    assert not any(next_run.ask(False, cheap_rate=1.0) for _ in range(3)) and next_run.ask(False, cheap_rate=1.0)
    gate.outcome(False, extra_tokens=5.0, extra_ms=1.0, cheap_rate=1.0)  # a probe that paid: asked again at once
    assert gate.averages.interval == 1


def test_a_drafter_that_does_not_pay_is_set_aside_for_the_next_runs(gentle, drafter_dir, monkeypatch):
    """The random drafter buys nothing: once a probe at the longest wait has shown it, the run goes on without it, the
    next SET_ASIDE_RUNS runs start without it -- no features tapped from any forward, the prefill's included -- and
    the one after them probes it again; every run equals AR."""
    import fastforward.engine as engine

    taps = []  # the layers tapped by each forward: the prefill's, then each step's
    real_forward, real_prefill = engine.timed_forward, engine.read_prompt_in_chunks
    monkeypatch.setattr(engine, "timed_forward",
                        lambda target, requests, layers: taps.append(tuple(layers)) or real_forward(target, requests,
                                                                                                   layers))
    monkeypatch.setattr(engine, "read_prompt_in_chunks",
                        lambda target, prompt, cache, layers, *args: taps.append(tuple(layers)) or real_prefill(
                            target, prompt, cache, layers, *args))
    options = dict(drafter=drafter_dir, datastore="none", context=False, probe=2)
    prompt = [40, 41, 42]
    want = ff.generate(gentle, prompt, "ar", max_new_tokens=30).token_ids
    taps.clear()
    first = ff.generate(gentle, prompt, "auto", max_new_tokens=30, method_options=options)
    assert first.token_ids == want
    stats = first.stats.method_stats
    assert stats["sources"]["drafter"]["asked"] >= 2 and "longest wait" in stats["drafter_set_aside"]
    assert taps[0] and not taps[-1]  # tapped while it kept the drafter, not after
    for _ in range(SET_ASIDE_RUNS):
        taps.clear()
        got = ff.generate(gentle, prompt, "auto", max_new_tokens=30, method_options=options)
        assert got.token_ids == want and got.stats.method_stats["sources"]["drafter"]["asked"] == 0
        assert got.stats.method_stats["drafter_set_aside"] == "it did not pay in the latest runs"
        assert taps and not any(taps)
    probe = ff.generate(gentle, prompt, "auto", max_new_tokens=30, method_options=options)
    assert probe.token_ids == want and probe.stats.method_stats["sources"]["drafter"]["asked"] >= 1
    sampled = ff.generate(gentle, prompt, "auto", max_new_tokens=30, temperature=1.0, seed=0, method_options=options)
    assert sampled.stats.method_stats["sources"]["drafter"]["asked"] >= 1  # sampled runs keep averages of their own


def test_a_forward_shared_with_other_sequences_sets_the_drafter_aside(gentle, drafter_dir):
    """Its pass would delay every sequence of the step: in a batch the drafter is never asked, and each sequence
    still decodes what it decodes alone."""
    prompts = [[40, 41, 42], [7, 8, 9, 10], [3, 3, 3]]
    requests = [ff.GenerationRequest(p, "auto", max_new_tokens=24,
                                     method_options=dict(drafter=drafter_dir, datastore="none", probe=1))
                for p in prompts]
    for prompt, result in zip(prompts, ff.generate_batch(gentle, requests), strict=True):
        assert result.token_ids == ff.generate(gentle, prompt, "ar", max_new_tokens=24).token_ids
        assert result.stats.method_stats["sources"]["drafter"]["asked"] == 0
        assert result.stats.method_stats["drafter_set_aside"] == "a forward shared with other sequences"


def test_a_run_takes_the_drafter_while_it_paid_lately_else_every_ninth():
    averages = DrafterAverages()
    assert all(averages.keeps_drafter() for _ in range(3))
    averages.paid_lately = False
    kept = [averages.keeps_drafter() for _ in range(2 * (SET_ASIDE_RUNS + 1))]
    assert np.nonzero(kept)[0].tolist() == [SET_ASIDE_RUNS, 2 * SET_ASIDE_RUNS + 1]
