"""REST (retrieval from a datastore, merged with the context's own match): greedy and seeded sampling equal AR, the
sampled distribution is the target's, the store's lookups and the trie against brute force, datastore files and
options checked with one-line errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.errors import UsageError
from fastforward.proposers import make_proposer
from fastforward.proposers.rest import CONTEXT_MODES, MATCH_WINDOW, ScoreCalibration, TokenStore, _trie, datastore_for
from fastforward.testing import chi2_critical, exact_joint, pooled_chi2, sampled_continuations, tiny_target
from fastforward.verify import SamplingConfig

EXAMPLES = settings(max_examples=int(os.environ.get("FF_EXAMPLES", 60)), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
VOCAB = 96  # the conftest tiny model


def write_datastore(path, sequences, **extra) -> str:
    with open(path, "w") as f:
        for i, seq in enumerate(sequences):
            f.write(json.dumps({"key": str(i), "response_ids": list(seq), **extra}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny_datastore(tiny, tmp_path_factory):
    """The tiny model's own greedy answers to a few prompts (so lookups find what it will say) and random noise."""
    g = torch.Generator().manual_seed(0)
    answers = [ff.generate(tiny, torch.randint(0, VOCAB, (6,), generator=g).tolist(), "ar", max_new_tokens=40).token_ids
               for _ in range(12)]
    noise = [torch.randint(0, VOCAB, (30,), generator=g).tolist() for _ in range(12)]
    return write_datastore(tmp_path_factory.mktemp("rest") / "store.jsonl", answers + noise)


prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
    st.builds(lambda pat, reps, tail: pat * reps + tail,
              st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), st.integers(2, 5),
              st.lists(st.integers(0, VOCAB - 1), max_size=3)),
)


# ----------------------------------------------------------------------------------------------------------------
# lossless
# ----------------------------------------------------------------------------------------------------------------


@EXAMPLES
@given(prompt=prompts, max_new=st.integers(1, 40), nodes=st.sampled_from([0, 2, 5, 12]),
       max_depth=st.integers(1, 8), candidates=st.sampled_from([1, 4, 64]), context=st.sampled_from(CONTEXT_MODES))
def test_rest_greedy_equals_ar(tiny, tiny_datastore, prompt, max_new, nodes, max_depth, candidates, context):
    options = dict(datastore=tiny_datastore, nodes=nodes, max_depth=max_depth, candidates=candidates,
                   context=context)
    got = ff.generate(tiny, list(prompt), "rest", max_new_tokens=max_new, method_options=options)
    assert got.token_ids == ff.generate(tiny, list(prompt), "ar", max_new_tokens=max_new).token_ids


def test_rest_drafts_from_the_datastore_and_is_exact(tiny, tiny_datastore):
    """A prompt that starts one of the stored answers: the datastore knows the continuation, so drafts are accepted
    (tau well above 1) without the context having anything to copy."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()  # the first prompt of the fixture
    want = ff.generate(tiny, prompt, "ar", max_new_tokens=40)
    got = ff.generate(tiny, prompt, "rest", max_new_tokens=40,
                      method_options=dict(datastore=tiny_datastore, nodes=6, context="off"))
    assert got.token_ids == want.token_ids
    assert got.stats.tau > 2.0
    assert got.stats.method_stats["steps_with_datastore_match"] > 0


def test_rest_seeded_sampling_equals_ar(tiny, tiny_datastore):
    """Drafts are guesses without probabilities (point masses): the verifier draws one target sample per visited
    node in sequence order, so REST reproduces AR's seeded samples token for token."""
    prompt = [3, 4, 5, 6, 7, 8] * 4
    for seed in range(6):
        kw = dict(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=seed)
        ar = ff.generate(tiny, prompt, "ar", **kw).token_ids
        for context in CONTEXT_MODES:
            options = dict(datastore=tiny_datastore, nodes=5, context=context)
            assert ff.generate(tiny, prompt, "rest", method_options=options, **kw).token_ids == ar


def test_rest_sampling_distribution_chi_square(tmp_path):
    target = tiny_target(vocab_size=8, init_std=0.15, seed=1)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    store = write_datastore(tmp_path / "s.jsonl", [[0, 1, 2, 3, 4, 5], [1, 2, 3, 3, 3], [2, 3, 4, 0, 1], [7, 6, 5]])
    cfg = SamplingConfig(1.0)
    samples = 3000
    exact = exact_joint(target, prompt, cfg)
    counts, drafted, accepted = sampled_continuations(
        target, prompt, lambda: make_proposer("rest", target, datastore=store, nodes=4, context="merge"), cfg, samples)
    assert drafted > 0.9 * samples and accepted > 0.03 * samples  # the drafted path is really exercised
    chi2, df = pooled_chi2(exact, counts)
    assert sum(counts.values()) == samples and set(counts) <= set(exact) and df >= 20
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


# ----------------------------------------------------------------------------------------------------------------
# the store and the trie against brute force
# ----------------------------------------------------------------------------------------------------------------


def brute_continuations(sequences, context, limit, depth):
    """Every occurrence of the longest suffix of ``context`` (up to MATCH_WINDOW tokens) that some token follows,
    latest first, with the tokens after it (-1 past the sequence's end); and the suffix's length."""
    context = list(context)
    found = []  # (match length, global position, continuation)
    pos = 0
    for seq in sequences:
        for end in range(len(seq) - 1):  # the occurrence ends at `end`; seq[end + 1] follows it
            m = 0
            while m < min(MATCH_WINDOW, len(context), end + 1) and seq[end - m] == context[-1 - m]:
                m += 1
            if m:
                cont = seq[end + 1 : end + 1 + depth]
                found.append((m, pos + end, cont + [-1] * (depth - len(cont))))
        pos += len(seq) + 1
    if not found:
        return [], 0
    # the store looks up the longest n-gram (n <= 3) first, then keeps the longest matches among its occurrences
    n = min(3, max(m for m, _, _ in found))
    found = [f for f in found if f[0] >= n]
    best = max(m for m, _, _ in found)
    return [c for m, _, c in sorted(found, key=lambda f: -f[1]) if m == best][:limit], best


@settings(max_examples=150, deadline=None, derandomize=True)
@given(sequences=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=6),
       context=st.lists(st.integers(0, 5), min_size=1, max_size=20), depth=st.integers(1, 6),
       split=st.integers(0, 6))
def test_store_continuations_equal_brute_force(sequences, context, depth, split):
    store = TokenStore(vocab_size=6)
    store.add(sequences[:split])  # added in two calls: the insertion keeps the index sorted
    store.add(sequences[split:])
    rows, matched = store.continuations(np.array(context), limit=10**6, depth=depth)
    want, want_matched = brute_continuations(sequences, context, 10**6, depth)
    # the store scans the latest SCAN * limit occurrences of the n-gram; with an unbounded limit, all of them
    assert rows.tolist() == want and matched == want_matched
    assert len(store) == sum(len(s) for s in sequences)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(rows=st.lists(st.lists(st.integers(-1, 3), min_size=4, max_size=4), min_size=1, max_size=12),
       chain=st.booleans())
def test_trie_counts_parents_and_chain_equal_brute_force(rows, chain):
    rows = np.array([r[: next((i for i, t in enumerate(r) if t < 0), 4)] + [-1] * (4 - next(
        (i for i, t in enumerate(r) if t < 0), 4)) for r in rows])  # -1 only as a tail
    store_rows = rows.shape[0] - int(chain)
    out = _trie(rows, store_rows)
    prefixes = {}  # prefix -> (store count, chained)
    for r, row in enumerate(rows.tolist()):
        for d in range(4):
            if row[d] < 0:
                break
            c, ch = prefixes.get(tuple(row[: d + 1]), (0, False))
            prefixes[tuple(row[: d + 1])] = (c + (r < store_rows), ch or r >= store_rows)
    if not prefixes:
        assert out is None
        return
    tokens, parents, depths, raw, chained, _, _ = out
    paths = []
    for i in range(tokens.size):  # each node's path from its parents, which come earlier
        assert parents[i] < i
        paths.append((paths[parents[i]] if parents[i] >= 0 else ()) + (int(tokens[i]),))
        assert depths[i] == len(paths[i])
    assert sorted(paths) == sorted(prefixes) and len(set(paths)) == len(paths)
    for i, path in enumerate(paths):
        count, ch = prefixes[path]
        assert raw[i] == pytest.approx(count / (store_rows + 1)) and bool(chained[i]) == ch


def test_calibration_learns_per_bucket():
    cal = ScoreCalibration(strength=2.0, decay=1.0)
    raw = np.linspace(0.0, 1.0, 41)
    for depth in (1, 2, 3, 7):
        for matched in (1, 4, 12):
            before = cal(raw, np.full(raw.shape, depth), matched)
            assert before[0] == 0.0 and np.all(np.diff(before) >= -1e-12)
    # drafted nodes at raw 0.55, depth 1, after a 2-token match, never accepted: the rate there falls towards 0
    for _ in range(ScoreCalibration.BATCH):  # counted a batch of steps at a time
        cal.update(np.full(25, 0.55), np.ones(25, dtype=np.int64), 2, np.zeros(25, dtype=bool))
    after = cal(raw, np.ones(raw.shape, dtype=np.int64), 2)
    assert after[22] < 0.05 and after[0] == 0.0
    # another depth or match bucket is untouched
    assert cal(np.array([0.55]), np.array([5]), 2)[0] == pytest.approx(0.55, abs=0.05)
    assert cal(np.array([0.55]), np.array([1]), 9)[0] == pytest.approx(0.55, abs=0.05)


# ----------------------------------------------------------------------------------------------------------------
# datastore files and options
# ----------------------------------------------------------------------------------------------------------------


def test_datastore_skips_the_heldout_split_and_reads_text(tiny, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        json.dumps({"response_ids": [1, 2, 3], "split": "train"}),
        json.dumps({"response_ids": [4, 5, 6, 7], "split": "heldout"}),
        json.dumps({"text": "abc"}),
    ]) + "\n")
    store = datastore_for(tiny, path)
    assert len(store) == 3 + len(tiny.tokenizer("abc", add_special_tokens=False)["input_ids"])
    assert store.continuations(np.array([4, 5]), 10, 2)[0].size == 0  # the held-out answer is not in it
    assert datastore_for(tiny, path) is store  # read once per target and file
    folder = tmp_path / "made"
    folder.mkdir()
    write_datastore(folder / "responses.jsonl", [[9, 9, 8]])
    assert len(datastore_for(tiny, folder)) == 3  # a make-data folder: its responses.jsonl


@pytest.mark.parametrize("content,fragment", [
    ('{"response_ids": [1, 2, 999]}\n', "outside the target's vocabulary"),
    ('{"response_ids": [1, "a"]}\n', "integer token ids"),
    ('{"prompt": "x"}\n', "needs response_ids"),
    ('{"response_ids": []}\n', "holds no tokens"),
    ('[1, 2]\n', r"bad\.jsonl:1 is not a JSON object"),
    ('{"response_ids": [1]}\n{"response_ids": [1, 2], "split": "heldout"}\nnot json\n', r"bad\.jsonl:3 is not"),
])
def test_bad_datastore_files_are_one_line_errors(tiny, tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=fragment) as err:
        ff.generate(tiny, [1, 2, 3], "rest", max_new_tokens=4, method_options={"datastore": str(path)})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("options,fragment", [
    ({}, "give a datastore"),
    ({"datastore": "/nonexistent/store.jsonl"}, "does not exist"),
    ({"datastore": 3}, "must be a path"),
    ({"nodes": 1}, "nodes"),
    ({"nodes": -1}, "nodes"),
    ({"max_depth": 0}, "max_depth"),
    ({"candidates": 0}, "candidates"),
    ({"max_nodes": 1}, "max_nodes"),
    ({"context": "yes"}, "context"),
    ({"window": 3}, "window"),
])
def test_bad_options_raise_usage_error(tiny, tiny_datastore, options, fragment):
    options = {"datastore": tiny_datastore, **options} if "datastore" not in options and options else options
    with pytest.raises(UsageError, match=fragment):
        make_proposer("rest", tiny, **options)


def test_rest_in_a_batch_equals_solo_ar(packed, tmp_path):
    """Sequences of several methods in shared forwards, REST among them: each equals its solo AR output."""
    prompts = [[3, 4, 5, 3, 4, 5, 3], [9, 8, 7], [11, 12], [20, 21, 22, 23]]
    solo = [ff.generate(packed, p, "ar", max_new_tokens=16).token_ids for p in prompts]
    store = write_datastore(tmp_path / "s.jsonl", solo[:2] + [[1, 2, 3, 4]])  # two of the answers are known
    requests = [ff.GenerationRequest(p, m, max_new_tokens=16, method_options=o) for p, (m, o) in zip(prompts, [
        ("rest", {"datastore": store, "nodes": 4}), ("rest", {"datastore": store, "context": "merge"}),
        ("pld", {}), ("rest", {"datastore": store, "context": "off", "nodes": 3})], strict=True)]
    results = ff.generate_batch(packed, requests, max_batch_tokens=64)
    assert [r.token_ids for r in results] == solo


def test_rest_finds_make_data_default_output(tiny, tmp_path, monkeypatch):
    """Without a datastore option, make-data's default output for the model is used when it exists."""
    from fastforward.paths import made_data_dir

    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    with pytest.raises(UsageError, match="give a datastore"):
        make_proposer("rest", tiny)
    folder = made_data_dir(tiny.name)
    folder.mkdir(parents=True)
    write_datastore(folder / "responses.jsonl", [[5, 6, 7, 8]])
    assert len(make_proposer("rest", tiny).store) == 4


@pytest.mark.parametrize("options,content,fragment", [
    ([], None, "give a datastore"),
    (["-o", "datastore=/nonexistent/folder"], None, "does not exist"),
    (["-o", "datastore={store}"], '{"response_ids": [1, 2]}\n{"text": 5}\n', "store.jsonl:2: a datastore record"),
    (["-o", "datastore={store}", "-o", "context=both"], '{"response_ids": [1, 2]}\n', "context must be one of"),
])
def test_cli_refuses_bad_datastores_in_one_line(tmp_path, monkeypatch, capsys, options, content, fragment):
    from cli_helpers import one_line_exit_2

    from fastforward.testing import tiny_hf_folder

    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))  # no make-data output to fall back on
    folder = str(tiny_hf_folder(tmp_path / "tiny"))
    store = tmp_path / "store.jsonl"
    if content is not None:
        store.write_text(content)
    options = [o.format(store=store) for o in options]
    line = one_line_exit_2(capsys, "generate", "hi", "--model", folder, "--method", "rest", *options)
    assert fragment in line, line


def test_learned_generations_draft_for_later_requests(tmp_path):
    """learn=True: a finished generation joins the datastore, so the same question again is drafted from it (far
    more tokens per forward), and both answers are AR's; learn=False adds nothing."""
    from fastforward.proposers import rest as rest_module

    target = tiny_target(backend="lean", seed=3)  # its own store registry entry: no other test's generations
    prompt = [5, 17, 42, 8, 13]
    want = ff.generate(target, prompt, "ar", max_new_tokens=40).token_ids
    opts = {"datastore": "none", "learn": True, "context": "off", "nodes": 6}
    first = ff.generate(target, prompt, "rest", max_new_tokens=40, method_options=opts)
    second = ff.generate(target, prompt, "rest", max_new_tokens=40, method_options=opts)
    assert first.token_ids == second.token_ids == want
    assert first.stats.method_stats["steps_with_datastore_match"] == 0  # the store was empty
    assert second.stats.tau > 2.0 and second.stats.tau > first.stats.tau
    assert len(rest_module.datastore_for(target, None)) == 2 * len(want)
    # a datastore file learns too, and only with learn=True
    path = write_datastore(tmp_path / "s.jsonl", [[1, 2, 3]])
    store = rest_module.datastore_for(target, path)
    ff.generate(target, prompt, "rest", max_new_tokens=40, method_options={"datastore": path})
    assert len(store) == 3
    ff.generate(target, prompt, "rest", max_new_tokens=40, method_options={"datastore": path, "learn": True})
    assert len(store) == 3 + len(want)


def test_learning_stops_at_the_limit(monkeypatch):
    from fastforward.proposers import rest as rest_module

    monkeypatch.setattr(rest_module, "LEARN_LIMIT", 10)
    store = TokenStore(vocab_size=50)
    store.learn([1, 2, 3, 4, 5, 6])
    store.learn([7, 8, 9, 10, 11])  # would pass the limit: not added
    store.learn([12, 13, 14, 15])
    assert len(store) == 10 and store.learned == 10


def test_datastore_none_needs_learning(tiny):
    with pytest.raises(UsageError, match="needs learn=True"):
        make_proposer("rest", tiny, datastore="none")
    with pytest.raises(UsageError, match="learn"):
        make_proposer("rest", tiny, datastore="none", learn="yes")


def test_the_benchmark_refuses_a_learning_method(tiny, tiny_datastore):
    from fastforward.bench.methods import check_spec_on, parse_spec

    spec = parse_spec(f"rl=rest:datastore={tiny_datastore}:learn=True")
    with pytest.raises(UsageError, match="learns from earlier requests"):
        check_spec_on(spec, tiny)
    check_spec_on(parse_spec(f"r=rest:datastore={tiny_datastore}"), tiny)  # without learning: fine
