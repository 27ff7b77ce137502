"""Hostile drafter folders (EAGLE-3, FastEagle, Falcon, draft model): every broken folder is refused before any
decoding with one UsageError line naming the folder; a good folder keeps decoding exactly what "ar" decodes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import assert_one_line_error
from safetensors.torch import load_file, save_file

import fastforward as ff
from fastforward.drafters.checkpoint import save_eagle3
from fastforward.drafters.draft_model import init_draft_model, save_draft_model, target_probe
from fastforward.drafters.eagle import Eagle3Drafter
from fastforward.drafters.falcon import FalconDrafter, save_falcon
from fastforward.drafters.fasteagle import FastEagleDrafter, save_fasteagle
from fastforward.drafters.vocab import DraftVocab
from fastforward.errors import UsageError
from fastforward.testing import tiny_hf_folder, tiny_target

VOCAB = 96
OPTION = {"eagle": "drafter", "fasteagle": "drafter", "falcon": "drafter", "sps": "draft"}


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def good(target, tmp_path_factory):
    """A good folder of each kind."""
    root = tmp_path_factory.mktemp("good")
    vocab = DraftVocab.from_target_ids(range(0, VOCAB, 2), VOCAB)
    save_eagle3(Eagle3Drafter.for_target(target, vocab), root / "eagle", dtype="float32")
    save_fasteagle(FastEagleDrafter.for_target(target, vocab, 2), root / "fasteagle", dtype="float32")
    save_falcon(FalconDrafter.for_target(target, vocab, 2), root / "falcon", dtype="float32")
    lm, meta = init_draft_model(target, 2, "first")
    save_draft_model(lm, meta, root / "sps", target_probe(target))
    return root


def _copy(good, method, tmp_path):
    folder = tmp_path / method
    shutil.copytree(good / method, folder)
    return folder


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, **changes):
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(changes)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _refused(target, method, folder, *match):
    with pytest.raises(UsageError) as info:
        ff.generate(target, [1, 2, 3], method, method_options={OPTION[method]: str(folder)}, max_new_tokens=4)
    msg = str(info.value)
    assert "\n" not in msg and str(folder) in msg, msg
    for m in match:
        assert m in msg, msg
    return msg


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon", "sps"])
def test_good_folders_decode_exactly_what_ar_decodes(target, good, method):
    ar = ff.generate(target, [1, 2, 3], "ar", max_new_tokens=8).token_ids
    out = ff.generate(target, [1, 2, 3], method, method_options={OPTION[method]: str(good / method)},
                      max_new_tokens=8)
    assert out.token_ids == ar


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon"])
@pytest.mark.parametrize("case", ["not json", "a list", "no config", "no weights", "junk weights"])
def test_unreadable_folders_are_refused(target, good, tmp_path, method, case):
    folder = _copy(good, method, tmp_path)
    if case == "not json":
        (folder / "config.json").write_text("{oops")
    elif case == "a list":
        (folder / "config.json").write_text("[1, 2]")
    elif case == "no config":
        (folder / "config.json").unlink()
    elif case == "no weights":
        (folder / "model.safetensors").unlink()
    else:
        (folder / "model.safetensors").write_bytes(b"junk" * 10)
    _refused(target, method, folder)


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon"])
@pytest.mark.parametrize("changes, match", [
    ({"architectures": 5}, "architectures"),
    ({"draft_vocab_size": "abc"}, "abc"),
    ({"draft_vocab_size": -5}, "draft_vocab_size"),
    ({"draft_vocab_size": 10**6}, "draft_vocab_size"),
    ({"hidden_size": 32}, "hidden size 32"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"intermediate_size": 10**9}, "gate_proj"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 7}, "head_dim"),
    ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"vocab_size": 50}, ""),
    ({"target_hidden_size": 32}, "hidden size 32"),
    ({"fastforward": "abc"}, "config.json"),
])
def test_bad_configs_are_refused(target, good, tmp_path, method, changes, match):
    folder = _copy(good, method, tmp_path)
    _edit_config(folder, **changes)
    _refused(target, method, folder, match)


@pytest.mark.parametrize("method, changes, match", [
    ("eagle", {"eagle_aux_hidden_state_layer_ids": [-1, 1, 2]}, "tap layer"),
    ("fasteagle", {"aux_layers": [-1, 1, 2]}, "tap layer"),
    ("fasteagle", {"num_layers": 0}, "num_layers"),
    ("fasteagle", {"num_layers": 10**8}, "num_layers"),
    ("falcon", {"block_size": 0}, "block_size"),
    ("falcon", {"block_size": 10**6}, "block_size"),
])
def test_bad_format_specific_configs_are_refused(target, good, tmp_path, method, changes, match):
    folder = _copy(good, method, tmp_path)
    _edit_config(folder, **changes)
    _refused(target, method, folder, match)


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon"])
@pytest.mark.parametrize("case, match", [
    ("d2t out of range", "outside"), ("d2t negative", "outside"), ("d2t float", "d2t"), ("d2t 2-D", "d2t"),
    ("t2d short", "t2d"), ("t2d missing", "t2d"), ("weight wrong shape", "shape"), ("weight int", "floating"),
    ("weight nan", "NaN"),
])
def test_bad_tensors_are_refused(target, good, tmp_path, method, case, match):
    folder = _copy(good, method, tmp_path)
    t = load_file(str(folder / "model.safetensors"))
    weight = next(k for k in sorted(t) if k.endswith(".weight") and t[k].dim() == 2)
    if case == "d2t out of range":
        _edit_tensors(folder, d2t=t["d2t"] + VOCAB)
    elif case == "d2t negative":
        _edit_tensors(folder, d2t=t["d2t"] - VOCAB)
    elif case == "d2t float":
        _edit_tensors(folder, d2t=t["d2t"].float() + 0.5)
    elif case == "d2t 2-D":
        _edit_tensors(folder, d2t=t["d2t"][None])
    elif case == "t2d short":
        _edit_tensors(folder, t2d=t["t2d"][:10])
    elif case == "t2d missing":
        t.pop("t2d")
        save_file(t, str(folder / "model.safetensors"))
    elif case == "weight wrong shape":
        _edit_tensors(folder, **{weight: torch.zeros(2, 2)})
    elif case == "weight int":
        _edit_tensors(folder, **{weight: t[weight].to(torch.int32)})
    else:
        _edit_tensors(folder, **{weight: torch.full_like(t[weight], float("nan"))})
    _refused(target, method, folder, match)


@pytest.mark.parametrize("method", ["eagle", "fasteagle", "falcon", "sps"])
def test_a_folder_for_another_target_is_refused(good, method):
    other = tiny_target(layers=4, vocab_size=VOCAB, seed=4)
    _refused(other, method, good / method)


@pytest.mark.parametrize("changes, tensor, match", [
    ({"hidden_size": 32}, None, "hidden_size"),
    ({"num_attention_heads": 0}, None, "HF config"),
    ({"intermediate_size": 10**9}, None, "shape"),
    (None, "q_proj", "shape"),
    ({"fastforward_draft_model": "meta"}, None, ""),
])
def test_bad_draft_model_folders_are_refused(target, good, tmp_path, changes, tensor, match):
    folder = _copy(good, "sps", tmp_path)
    if changes == {"fastforward_draft_model": "meta"}:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["fastforward_draft_model"]["target_vocab_size"] = "abc"
        (folder / "config.json").write_text(json.dumps(cfg))
    elif changes:
        _edit_config(folder, **changes)
    if tensor:
        t = load_file(str(folder / "model.safetensors"))
        _edit_tensors(folder, **{next(k for k in t if tensor in k): torch.zeros(2, 2)})
    _refused(target, "sps", folder, match)


def test_the_cli_refuses_a_bad_drafter_in_one_line(good, tmp_path, capsys):
    model = tiny_hf_folder(tmp_path / "model", layers=4)
    folder = _copy(good, "eagle", tmp_path)
    _edit_config(folder, draft_vocab_size="abc")
    assert_one_line_error(capsys, "generate", "--model", model, "--method", "eagle", "-o", f"drafter={folder}",
                          "--max-new-tokens", "4", "hi", match=str(folder))
