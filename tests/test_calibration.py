"""Greedy calibration of drafter probabilities (``fastforward.drafters.calibration``): the fit, its stored form and
refusals, the ``fastforward calibrate`` command, and that a calibrated ``eagle`` drafts differently yet decodes
exactly AR's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.costs import CostCurve
from fastforward.drafters.calibration import CONFIG_KEY, GreedyCalibration, calibration_of
from fastforward.drafters.checkpoint import load_eagle3, save_eagle3
from fastforward.drafters.eagle import Eagle3Drafter
from fastforward.drafters.vocab import DraftVocab
from fastforward.errors import UsageError
from fastforward.testing import tiny_target

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


def _drafter(target, seed=0):
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:64]
    drafter = Eagle3Drafter.for_target(target, DraftVocab.from_target_ids(ids, VOCAB), seed=seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    return drafter


# a map that calls every candidate with q >= 0.02 a near-certain hit: drafts as deep and wide as allowed
EAGER = GreedyCalibration(((0.0, 0.02, 1.0),), ((0.0, 0.95, 1.0),), 10)


def _plain_and_eager(drafter, save, tmp_path_factory, name):
    """Two folders of one drafter: without a calibration, and with EAGER's."""
    plain, eager = tmp_path_factory.mktemp(f"{name}-plain"), tmp_path_factory.mktemp(f"{name}-eager")
    save(drafter, plain, dtype="float32")
    drafter.cfg.fastforward[CONFIG_KEY] = EAGER.as_dict()
    save(drafter, eager, dtype="float32")
    return plain, eager


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    return _plain_and_eager(_drafter(target), save_eagle3, tmp_path_factory, "eagle")


def test_fit_recovers_a_monotone_map_and_round_trips():
    g = torch.Generator().manual_seed(0)
    q = torch.rand(20000, generator=g)
    hit = torch.rand(20000, generator=g) < q.sqrt()  # the target's choice more often than q says
    cal = GreedyCalibration.fit([q, q[:5000]], [hit, hit[:5000]])
    assert cal.depths == 2 and cal.samples == 25000
    x = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    got = cal.log_rate(x.log(), 1).exp()
    assert (got - x.sqrt()).abs().max() < 0.06
    assert bool((got[1:] >= got[:-1]).all())
    assert torch.equal(cal.log_rate(x.log(), 5), cal.log_rate(x.log(), 2))  # deeper: the deepest table
    again = GreedyCalibration.from_dict(json.loads(json.dumps(cal.as_dict())))
    assert again == cal


def test_fit_is_non_decreasing_on_noisy_data():
    q = torch.tensor([0.1] * 50 + [0.3] * 50 + [0.5] * 50)
    hit = torch.tensor([True] * 40 + [False] * 10 + [True] * 5 + [False] * 45 + [True] * 30 + [False] * 20)
    cal = GreedyCalibration.fit([q], [hit], min_count=10)
    assert all(a <= b for a, b in zip(cal.rates[0][:-1], cal.rates[0][1:], strict=True))


@pytest.mark.parametrize("raw", [
    {"knots": [[0.0, 1.0]]},  # no rates
    {"knots": [[0.0, 0.5, 1.0]], "rates": [[0.0, 1.0]]},  # lengths differ
    {"knots": [[0.0, 0.6, 0.5, 1.0]], "rates": [[0.0, 0.1, 0.2, 1.0]]},  # not ascending
    {"knots": [[0.0, 0.5, 1.0]], "rates": [[0.0, 0.9, 0.5]]},  # decreasing
    {"knots": [[0.1, 0.5, 1.0]], "rates": [[0.0, 0.5, 1.0]]},  # not from 0
    {"knots": [[0.0, 0.5, 1.0]], "rates": [[0.0, 1.5, 1.5]]},  # above 1
    {"knots": [], "rates": []},
    {"knots": "x", "rates": "y"},
])
def test_malformed_calibrations_are_refused(raw):
    with pytest.raises(UsageError):
        calibration_of({CONFIG_KEY: raw})


def test_a_drafter_with_a_malformed_calibration_is_refused_at_load(target, folders, tmp_path):
    plain, _ = folders
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((plain / name).read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["fastforward"][CONFIG_KEY] = {"knots": [[0.0, 1.0]], "rates": [[0.5, 0.1]]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=CONFIG_KEY):
        load_eagle3(tmp_path, target)


@settings(max_examples=25, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), topk=st.integers(1, 4),
       depth=st.integers(1, 5))
def test_calibrated_eagle_greedy_equals_ar(target, folders, prompt, topk, depth):
    _, eager = folders
    ar = ff.generate(target, prompt, "ar", max_new_tokens=20).token_ids
    out = ff.generate(target, prompt, "eagle", max_new_tokens=20,
                      method_options=dict(drafter=str(eager), topk=topk, depth=depth, min_prob=0.0, calibrated=True))
    assert out.token_ids == ar


def test_calibration_changes_the_trees_not_the_output(target, folders, pin_costs):
    """On a cost curve where a draft token costs a third of a step, the eager map drafts larger trees than the raw
    probabilities of a random drafter; without ``calibrated=true`` it is ignored; the tokens are AR's in every case."""
    pin_costs(target, CostCurve({1: 3.0, 64: 66.0}))
    plain, eager = folders
    prompt = [3, 14, 15, 9, 26]
    ar = ff.generate(target, prompt, "ar", max_new_tokens=24).token_ids
    nodes = {}
    for name, folder, extra in (("plain", plain, {"calibrated": True}), ("eager", eager, {"calibrated": True}),
                                ("off", eager, {})):  # off by default
        out = ff.generate(target, prompt, "eagle", max_new_tokens=24,
                          method_options=dict(drafter=str(folder), backoff=0, **extra))
        assert out.token_ids == ar
        nodes[name] = out.stats.method_stats["mean_tree_nodes"]
    assert nodes["eager"] > nodes["plain"] and nodes["off"] == nodes["plain"]


def test_sampling_ignores_the_calibration(target, folders, pin_costs):
    pin_costs(target, CostCurve({1: 3.0, 64: 66.0}))  # both runs price trees alike (live timings would differ)
    plain, eager = folders
    kw = dict(max_new_tokens=16, temperature=1.0, seed=7)
    a = ff.generate(target, [1, 2, 3], "eagle", method_options=dict(drafter=str(plain), backoff=0), **kw)
    b = ff.generate(target, [1, 2, 3], "eagle", method_options=dict(drafter=str(eager), backoff=0, calibrated=True),
                    **kw)
    assert a.token_ids == b.token_ids
    assert a.stats.method_stats["mean_tree_nodes"] == b.stats.method_stats["mean_tree_nodes"]


def test_calibrate_command(capsys, tmp_path):
    from test_train_eagle import _responses

    from fastforward.testing import tiny_hf_folder

    model = tiny_hf_folder(tmp_path / "model", max_positions=128, layers=4)
    data = _responses(tmp_path / "data", 256, n=15)
    out = tmp_path / "drafter"
    code, _, err = run_cli(capsys, "train", "eagle", "--model", model, "--data", data, "--out", out, "--draft-vocab",
                           40, "--ttt-steps", 2, "--batch-size", 2, "--max-steps", 2, "--threads", 1, "--quiet")
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert calibration_of(cfg["fastforward"]).depths == 2  # training fits one on its held-out records
    del cfg["fastforward"][CONFIG_KEY]
    (out / "config.json").write_text(json.dumps(cfg))
    code, stdout, err = run_cli(capsys, "calibrate", "--model", model, "--drafter", out, "--data", data, "--threads", 1)
    assert code == 0, err
    assert "calibrated" in stdout and "depth 3" in stdout
    assert calibration_of(json.loads((out / "config.json").read_text())["fastforward"]).depths == 3
    line = assert_one_line_error(capsys, "calibrate", "--model", model, "--drafter", tmp_path / "nope", "--data", data)
    assert "no config.json" in line
    line = assert_one_line_error(capsys, "calibrate", "--model", model, "--drafter", out, "--data", tmp_path)
    assert "no responses.jsonl" in line


def _fasteagle(target, seed=0):
    from fastforward.drafters.fasteagle import FastEagleDrafter

    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:64]
    drafter = FastEagleDrafter.for_target(target, DraftVocab.from_target_ids(ids, VOCAB), 3, True, seed=seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    return drafter


@pytest.fixture(scope="module")
def fasteagle_folders(target, tmp_path_factory):
    from fastforward.drafters.fasteagle import save_fasteagle

    return _plain_and_eager(_fasteagle(target), save_fasteagle, tmp_path_factory, "fasteagle")


def test_calibrated_fasteagle_drafts_more_and_decodes_ar(target, fasteagle_folders, pin_costs):
    pin_costs(target, CostCurve({1: 3.0, 64: 66.0}))
    plain, eager = fasteagle_folders
    nodes = {}
    for prompt in ([3, 14, 15, 9, 26], [7], [50, 51, 52, 53, 54, 55, 56, 57]):
        ar = ff.generate(target, prompt, "ar", max_new_tokens=24).token_ids
        for name, folder, extra in (("plain", plain, {"calibrated": True}), ("eager", eager, {"calibrated": True}),
                                    ("off", eager, {})):  # off by default
            out = ff.generate(target, prompt, "fasteagle", max_new_tokens=24,
                              method_options=dict(drafter=str(folder), backoff=0, **extra))
            assert out.token_ids == ar
            nodes[name] = nodes.get(name, 0) + out.stats.method_stats["mean_tree_nodes"]
    assert nodes["eager"] > nodes["plain"] and nodes["off"] == nodes["plain"]


def test_calibrate_command_on_a_fasteagle_drafter_and_refusals(target, tmp_path, capsys):
    from fastforward.drafters.fasteagle import FastEagleDrafter, save_fasteagle
    from fastforward.testing import tiny_hf_folder, write_tiny_make_data

    model = tiny_hf_folder(tmp_path / "model", max_positions=128, layers=4)
    data = write_tiny_make_data(tmp_path / "data", records=10, vocab=VOCAB)
    tiny = ff.load(str(model))
    ids = torch.arange(64)
    folder = tmp_path / "fe"
    save_fasteagle(FastEagleDrafter.for_target(tiny, DraftVocab.from_target_ids(ids, tiny.vocab_size), 3, True),
                   folder, dtype="float32")
    code, stdout, err = run_cli(capsys, "calibrate", "--model", model, "--drafter", folder, "--data", data,
                                "--threads", 1)
    assert code == 0, err
    assert calibration_of(json.loads((folder / "config.json").read_text())["fastforward"]).depths >= 1
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["FalconDrafter"]}))
    line = assert_one_line_error(capsys, "calibrate", "--model", model, "--drafter", tmp_path / "other", "--data",
                                 data)
    assert "EAGLE-3 and FastEagle" in line


def test_siblings_share_at_most_certainty():
    rates = EAGER.sibling_rates(torch.tensor([[0.5, 0.3, 0.1], [0.01, 0.005, 0.001]], dtype=torch.float64), 1)
    assert torch.allclose(rates[0], torch.tensor([0.95 + 0.05 * 0.48 / 0.98, 0.05 - 0.05 * 0.48 / 0.98, 0.0],
                                                 dtype=torch.float64))
    assert float(rates[0].sum()) == pytest.approx(1.0) and bool((rates[1] < 0.95).all())
