"""Drafter training off the CPU: the losses create every tensor where their batch is, the features computed per batch
by the target's HF model equal the stored ones, ``--features forward`` trains without storing any, and -- where a
GPU is present -- ``fastforward train eagle|fasteagle|falcon`` runs there and the drafter it saves decodes losslessly
on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_helpers import run_cli
from test_train_eagle import _responses

import fastforward as ff
from fastforward.drafters.features import ForwardFeatures, compute_features
from fastforward.testing import tiny_hf_folder
from fastforward.train.drafter_train import _sequences, collate
from fastforward.train.eagle import EagleTraining
from fastforward.train.falcon import FalconTraining
from fastforward.train.fasteagle import FastEagleTraining

METHODS = {"eagle": lambda: EagleTraining(draft_vocab=40, ttt_steps=3), "fasteagle": lambda: FastEagleTraining(
    draft_vocab=40), "falcon": lambda: FalconTraining(draft_vocab=40)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-on-accelerator")
    model = tiny_hf_folder(root / "model", max_positions=128, layers=4)
    data = _responses(root / "data", 256)
    records = [json.loads(line) for line in (data / "responses.jsonl").read_text().splitlines()]
    return model, data, ff.load(str(model)), records


class _Cfg:
    seed = 0


@pytest.mark.parametrize("name", sorted(METHODS))
def test_losses_make_no_tensor_off_their_batch_device(setup, name, monkeypatch):
    """A tensor a loss creates without naming a device lands on the default device -- on a GPU run not where the
    batch is. With the default device set to ``meta`` such a tensor cannot mix with the (CPU) batch, so the same loss
    computed again proves that every tensor follows the batch."""
    _, data, target, records = setup
    method = METHODS[name]()
    drafter = method.build(target, records, _Cfg)
    batch = collate(_sequences(records[:3], 768), ForwardFeatures(target, "cpu"))
    batch.update(seed=5, epoch=0, epochs=2)
    torch.manual_seed(1)  # Falcon's LSTM dropout
    expected, _ = method.loss(drafter, batch)
    torch.manual_seed(1)
    torch.set_default_device("meta")
    try:
        again, _ = method.loss(drafter, batch)
    finally:
        torch.set_default_device("cpu")
    assert again.device.type == "cpu" and torch.allclose(again.detach(), expected.detach())
    # the held-out scoring too (it runs where the drafter is; the calibration it fits is CPU code over CPU tensors)
    from fastforward.drafters.calibration import GreedyCalibration

    fit = GreedyCalibration.fit.__func__

    def fit_on_the_cpu(cls, *args, **kwargs):
        with torch.device("cpu"):
            return fit(cls, *args, **kwargs)

    monkeypatch.setattr(GreedyCalibration, "fit", classmethod(fit_on_the_cpu))
    held = records[:4]
    features = ForwardFeatures(target, "cpu")
    store = _Precomputed({r["key"]: features.get(r) for r in held})
    expected = method.heldout(drafter, target, held, store)
    torch.set_default_device("meta")
    try:
        again = method.heldout(drafter, target, held, store)
    finally:
        torch.set_default_device("cpu")
    assert again == expected and again["positions"] > 0


class _Precomputed:
    def __init__(self, feats):
        self.feats = feats

    def get(self, record):
        return self.feats[record["key"]]


def test_forward_features_equal_the_decoding_forwards(setup):
    """The per-batch features (one padded forward of the HF model) equal the decoding forward's, record by record."""
    _, _, target, records = setup
    forward = ForwardFeatures(target, "cpu")
    seqs = _sequences(records[:4], 768)
    batch = collate(seqs, forward)
    for b, s in enumerate(seqs):
        n = len(s["ids"])
        want = compute_features(target, s["ids"])
        assert torch.allclose(batch["taps"][b, :n], want["taps"].reshape(n, -1), atol=1e-4)
        assert torch.allclose(batch["final"][b, :n], want["final"], atol=1e-4)
        one = forward.get(s["record"])
        assert one["taps"].shape == want["taps"].shape and torch.allclose(one["taps"], want["taps"], atol=1e-4)


def features_stored(data) -> dict:
    """The files under a make-data folder's ``features/`` with their sizes and modification times."""
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted((data / "features").rglob("*"))
            if f.is_file()}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_training_on_forward_features_stores_none(setup, tmp_path, capsys, name):
    model, data, target, _ = setup
    out = tmp_path / name
    stored = features_stored(data)  # (another test of this module may have stored some: in any order, none added)
    code, stdout, err = run_cli(capsys, "train", name, "--model", model, "--data", data, "--out", out,
                                "--draft-vocab", 40, "--batch-size", 2, "--grad-accum", 1, "--threads", 1,
                                "--max-steps", 2, "--features", "forward")
    assert code == 0, err
    assert "features from the target on cpu" in err
    assert features_stored(data) == stored
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    assert json.loads((out / "fastforward_train.json").read_text())["heldout"]["positions"] > 0
    got = ff.generate(target, [5, 6, 7, 8], name, max_new_tokens=10, method_options={"drafter": str(out)})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=10).token_ids


def test_eval_records_bounds_the_final_scoring(setup, tmp_path, capsys):
    from cli_helpers import assert_one_line_error

    model, data, _, _ = setup
    common = ["train", "eagle", "--model", model, "--data", data, "--draft-vocab", 40, "--batch-size", 2,
              "--grad-accum", 1, "--threads", 1, "--quiet", "--max-steps", 1]
    code, _, err = run_cli(capsys, *common, "--out", tmp_path / "none", "--eval-records", 0)
    assert code == 0, err
    assert "heldout" not in json.loads((tmp_path / "none" / "fastforward_train.json").read_text())
    code, _, err = run_cli(capsys, *common, "--out", tmp_path / "one", "--eval-records", 1)
    assert code == 0, err
    one = json.loads((tmp_path / "one" / "fastforward_train.json").read_text())["heldout"]["positions"]
    code, _, err = run_cli(capsys, *common, "--out", tmp_path / "all")
    assert code == 0, err
    assert 0 < one < json.loads((tmp_path / "all" / "fastforward_train.json").read_text())["heldout"]["positions"]
    for bad in (["--eval-records", -1], ["--features", "disk"]):
        line = assert_one_line_error(capsys, *common, "--out", tmp_path / "bad", *bad)
        assert bad[0] in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(METHODS))
def test_trains_on_a_gpu(setup, tmp_path, capsys, name):
    """On a GPU the same command trains there (features from the target on the GPU, under bf16 autocast) and the
    drafter it saves decodes on the CPU, losslessly."""
    model, data, target, _ = setup
    out = tmp_path / name
    code, stdout, err = run_cli(capsys, "train", name, "--model", model, "--data", data, "--out", out,
                                "--draft-vocab", 40, "--batch-size", 2, "--grad-accum", 1, "--max-steps", 3,
                                "--mixed-precision", "bf16")
    assert code == 0, err
    assert "features from the target on cuda" in err and not (data / "features").exists()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    got = ff.generate(target, [5, 6, 7, 8], name, max_new_tokens=10, method_options={"drafter": str(out)})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=10).token_ids
