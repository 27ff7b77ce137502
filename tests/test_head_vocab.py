"""The draft head's rows by frequency (``head_vocab``, FR-Spec's frequency-ranked head): the ranking against brute
force, the folder's ranking file and its refusals, the kept head's logits, and every feature drafter still equal to AR
whatever rows its head keeps."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.drafters.checkpoint import save_eagle3
from fastforward.drafters.eagle import Eagle3Drafter
from fastforward.drafters.falcon import FalconDrafter, save_falcon
from fastforward.drafters.fasteagle import FastEagleDrafter, save_fasteagle
from fastforward.drafters.vocab import FREQUENCY_FILE, DraftVocab, read_frequency_order, write_frequency_order
from fastforward.errors import UsageError
from fastforward.proposers import make_proposer
from fastforward.testing import tiny_target

VOCAB = 96
DRAFT = 64


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


def _vocab(seed: int = 0) -> DraftVocab:
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT]
    return DraftVocab.from_target_ids(ids, VOCAB)


def _randomised(drafter):
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    return drafter.eval()


def _save(kind: str, target, folder) -> None:
    torch.manual_seed(0)
    v = _vocab()
    if kind == "eagle":
        save_eagle3(_randomised(Eagle3Drafter.for_target(target, v, seed=0)), folder, dtype="float32")
    elif kind == "fasteagle":
        save_fasteagle(_randomised(FastEagleDrafter.for_target(target, v, 3, True, seed=0)), folder, dtype="float32")
    else:
        save_falcon(_randomised(FalconDrafter.for_target(target, v, 2, seed=0)), folder, dtype="float32")


@pytest.fixture(scope="module")
def ranked_dirs(target, tmp_path_factory):
    """Per drafter kind, a folder with a ranking of its draft ids (a random one: any ranking is lossless)."""
    dirs = {}
    for kind in ("eagle", "fasteagle", "falcon"):
        folder = tmp_path_factory.mktemp(f"ranked-{kind}")
        _save(kind, target, folder)
        order = list(range(DRAFT))
        random.Random(kind).shuffle(order)
        write_frequency_order(folder, order, 1000, "a test")
        dirs[kind] = folder
    return dirs


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=30), max_size=6),
       used=st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=VOCAB), n=st.integers(1, VOCAB))
def test_the_ranking_and_the_kept_rows_match_brute_force(seqs, used, n):
    vocab = DraftVocab.from_target_ids(sorted(used), VOCAB)
    order = vocab.frequency_order(seqs)
    target_ids = vocab.target_ids.tolist()
    count = {t: sum(s.count(t) for s in seqs) for t in target_ids}
    expected = sorted(range(vocab.size), key=lambda i: (-count[target_ids[i]], i))
    assert order == expected
    keep, d2t = vocab.keep_most_frequent(order, n)
    assert keep.tolist() == sorted(expected[:n])
    # the kept rows' draft ids map to their target ids: a DraftVocab of its own
    kept_targets = [target_ids[i] for i in keep.tolist()]
    assert (torch.arange(keep.numel()) + d2t).tolist() == kept_targets
    DraftVocab(d2t, torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, torch.tensor(kept_targets), True))


def test_the_ranking_file_round_trips_and_bad_ones_are_one_line_refusals(tmp_path):
    assert read_frequency_order(tmp_path, 4) is None
    write_frequency_order(tmp_path, [2, 0, 3, 1], 10, "a test")
    assert read_frequency_order(tmp_path, 4) == [2, 0, 3, 1]
    for bad in ('{"order": [0, 1, 1, 3]}', '{"order": [0, 1, 2]}', '{"order": [0, 1, 2, 3.0]}', '[0, 1, 2, 3]',
                'not json', '{"order": [0, 1, 2, true]}'):
        (tmp_path / FREQUENCY_FILE).write_text(bad)
        with pytest.raises(UsageError) as e:
            read_frequency_order(tmp_path, 4)
        assert "\n" not in str(e.value) and FREQUENCY_FILE in str(e.value)


@pytest.mark.parametrize("kind", ["eagle", "fasteagle", "falcon"])
def test_the_kept_head_gives_the_whole_heads_logits_of_its_rows(target, ranked_dirs, kind):
    folder = ranked_dirs[kind]
    whole = make_proposer(kind, target, drafter=str(folder), weights="fp32").shared
    kept = make_proposer(kind, target, drafter=str(folder), weights="fp32", head_vocab=10).shared
    assert whole.head_rows == DRAFT and kept.head_rows == 10
    order = read_frequency_order(folder, DRAFT)
    rows = torch.tensor(sorted(order[:10]))
    h = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(kept.head(h), whole.head(h)[:, rows], rtol=1e-5, atol=1e-5)  # a narrower GEMM
    assert torch.equal(kept.to_target(torch.arange(10)), whole.to_target(rows))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       kind=st.sampled_from(["eagle", "fasteagle", "falcon"]), head_vocab=st.sampled_from([0, 4, 7, 32, DRAFT, 10_000]),
       weights=st.sampled_from(["auto", "fp32"]))
def test_every_drafter_equals_ar_whatever_rows_its_head_keeps(target, ranked_dirs, prompt, kind, head_vocab,
                                                               weights):
    ar = ff.generate(target, prompt, "ar", max_new_tokens=20).token_ids
    out = ff.generate(target, prompt, kind, max_new_tokens=20,
                      method_options=dict(drafter=str(ranked_dirs[kind]), head_vocab=head_vocab, weights=weights))
    assert out.token_ids == ar
    assert out.stats.method_stats["head_rows"] == (head_vocab if 0 < head_vocab < DRAFT else DRAFT)


def test_a_drafter_without_a_ranking_keeps_its_whole_head(target, tmp_path):
    _save("eagle", target, tmp_path)
    out = ff.generate(target, [1, 2, 3], "eagle", max_new_tokens=8,
                      method_options=dict(drafter=str(tmp_path), head_vocab=8))
    assert out.stats.method_stats["head_rows"] == DRAFT
    bad = tmp_path / "bad"
    _save("eagle", target, bad)
    (bad / FREQUENCY_FILE).write_text(json.dumps({"order": [0, 0]}))
    with pytest.raises(UsageError):
        ff.generate(target, [1, 2, 3], "eagle", max_new_tokens=8, method_options=dict(drafter=str(bad), head_vocab=8))


@pytest.mark.parametrize("kind", ["eagle", "fasteagle", "falcon"])
def test_a_head_narrower_than_a_calls_top_k_is_refused_before_any_work(target, ranked_dirs, kind):
    with pytest.raises(UsageError) as e:
        make_proposer(kind, target, drafter=str(ranked_dirs[kind]), topk=3, head_vocab=2)
    assert "head_vocab (2)" in str(e.value) and "\n" not in str(e.value)
