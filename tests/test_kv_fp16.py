"""fp16 KV caches (``kv_cache="fp16"``, llama.cpp's default): keys and values rounded to half precision when written,
read back exactly. A (slightly) different model: close to the fp32-cache one, and every method reproduces *its* AR
token for token -- on the packed q8 path and on dense fp32 weights; batches equal solo, reused prompt prefixes equal
a full prefill, the plain-torch forward stores the same rounding; the choice is checked at load.
(The attention kernel's own fp16 tests are in tests/test_layer_ops.py.)"""

from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward import kernels
from fastforward.engine import read_prompt
from fastforward.errors import UsageError
from fastforward.machine import forward_read_bytes
from fastforward.model.prefix_cache import prefix_cache_for
from fastforward.testing import tiny_gguf_target, tiny_target

pytestmark = pytest.mark.skipif(kernels.load_native() is None, reason="the native kernels are unavailable here")

METHODS = ["jacobi", "pld", "lookahead", "tr-jacobi"]


def _fp16(target):
    target.backend.kv_precision = "fp16"
    return target


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """fp16-cache targets: a tiny GGUF in the q8 arithmetic (packed weights, one native call per layer), the same
    file in the exact arithmetic, and a tiny fp32 HF Llama (dense weights on the skinny kernel); each also with an
    fp32 cache ('...-fp32')."""
    folder = tmp_path_factory.mktemp("kvf16")
    out = {}
    for cache in ("", "-fp32"):
        for arithmetic in ("q8", "exact"):
            target, _ = tiny_gguf_target(folder / f"{arithmetic}{cache}.gguf", arithmetic=arithmetic, seed=5)
            out[arithmetic + cache] = target
        out["dense" + cache] = tiny_target(dtype=torch.float32, seed=3)
    for name in ("q8", "exact", "dense"):
        _fp16(out[name])
    return out


def _prompt_logits(target, ids):
    cache = target.new_cache(ids.numel() + 4)
    return target.forward(ids, torch.arange(ids.numel()), cache).logits, cache


# How far the fp16-cache model's logits may be from the fp32-cache one's, relative to the largest: fp16's precision
# (2^-11) in the exact arithmetic; in q8 the 8-bit activation blocks turn a small change of an input into a whole
# quantisation step now and then (the q8 model itself is ~5% from the exact one: tests/test_q8.py).
CLOSE = {"exact": 5e-3, "dense": 5e-3, "q8": 0.05}


@pytest.mark.parametrize("which", ["q8", "exact", "dense"])
def test_fp16_cache_is_another_model_close_to_the_fp32_one(targets, which):
    fp16, fp32 = targets[which], targets[which + "-fp32"]
    assert fp16.kv_precision == "fp16" and fp32.kv_precision == "fp32"
    ids = torch.tensor([3, 17, 42, 8, 91, 5, 60, 23, 11, 4])
    a, cache16 = _prompt_logits(fp16, ids)
    b, cache32 = _prompt_logits(fp32, ids)
    assert cache16.k.dtype == cache16.v.dtype == torch.float16 and cache32.k.dtype == torch.float32
    assert 0 < (a - b).abs().max().item() < CLOSE[which] * b.abs().max().item()
    # layer 0's keys and values depend on the tokens alone: the fp16 cache holds the fp32 ones rounded, bit for bit
    n = ids.numel()
    assert torch.equal(cache16.k[0, :, :n], cache32.k[0, :, :n].half())
    assert torch.equal(cache16.v[0, :, :n], cache32.v[0, :, :n].half())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.sampled_from(["q8", "exact", "dense"]),
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=20),
    max_new=st.integers(1, 40),
    method=st.sampled_from(METHODS),
)
def test_every_method_equals_its_fp16_ar(targets, which, prompt, max_new, method):
    target = targets[which]
    ar = ff.generate(target, prompt, "ar", max_new_tokens=max_new).token_ids
    assert ff.generate(target, prompt, method, max_new_tokens=max_new).token_ids == ar


@pytest.mark.parametrize("which", ["q8", "dense"])
def test_batched_sequences_equal_their_solo_fp16_outputs(targets, which):
    target = targets[which]
    prompts = [[1, 2, 3, 1, 2, 3], [5, 9, 33], [7] * 12, [40, 41, 42, 43, 40, 41]]
    methods = ["pld", "ar", "jacobi", "lookahead"]
    solo = [ff.generate(target, p, "ar", max_new_tokens=24).token_ids for p in prompts]
    batch = ff.generate_batch(target, prompts, methods, max_new_tokens=24, max_batch_tokens=64)
    assert [r.token_ids for r in batch] == solo


def test_reused_prefix_is_bitwise_a_full_prefill_and_never_crosses_precisions(targets):
    fp16, fp32 = targets["q8"], targets["q8-fp32"]
    first = torch.tensor([3, 9, 4, 7, 1, 1, 5, 8, 2, 6])
    second = torch.cat([first[:7], torch.tensor([11, 12, 13, 14])])
    pc = prefix_cache_for(fp16, 1000)
    assert pc is not None
    read_prompt(fp16, first, fp16.new_cache(32), (), prefix_cache=pc)
    cached = fp16.new_cache(32)
    out, reused = read_prompt(fp16, second, cached, (), prefix_cache=pc)
    plain = fp16.new_cache(32)
    ref, _ = read_prompt(fp16, second, plain, ())
    assert reused == 7 and torch.equal(out.logits, ref.logits)
    n = second.numel()
    assert torch.equal(cached.k[:, :, :n], plain.k[:, :, :n]) and torch.equal(cached.v[:, :, :n], plain.v[:, :, :n])
    # an fp32 cache finds no fp16 entry to reuse (their keys are another model's), and the other way round: its
    # entry for `second` (replacing the fp16 one) is passed over for the fp16 entry of `first`
    assert read_prompt(fp32, second, fp32.new_cache(32), (), prefix_cache=pc)[1] == 0
    assert read_prompt(fp16, torch.cat([second, torch.tensor([1])]), fp16.new_cache(32), (), prefix_cache=pc)[1] == 7


def test_plain_torch_forward_stores_the_same_rounding(targets, tmp_path, monkeypatch):
    """The forward in plain torch ops (no native layer ops) over an fp16 cache: the cache holds fp16 values, the
    logits are the native forward's within float tolerance, for a prompt and a tree step."""
    monkeypatch.setenv("FASTFORWARD_TORCH_OPS", "1")
    plain = _fp16(tiny_gguf_target(tmp_path / "a.gguf", arithmetic="q8", native=None, seed=5)[0])
    assert plain.backend.ops is None
    fast = targets["q8"]
    prompt = torch.tensor([3, 17, 42, 8, 91, 5, 60, 23, 11])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out, caches = [], []
    for target in (fast, plain):
        cache = target.new_cache(32)
        first = target.forward(prompt, torch.arange(9), cache).logits
        cache.keep(range(9))
        out.append((first, target.forward(torch.tensor([4, 7, 9]), torch.tensor([9, 10, 10]), cache, tree).logits))
        caches.append(cache)
    assert caches[1].k.dtype == torch.float16
    assert (out[0][0] - out[1][0]).abs().max().item() < 1e-3
    assert (out[0][1] - out[1][1]).abs().max().item() < 1e-3
    # what the plain forward stored is representable in fp16 and close to the native forward's
    assert (caches[0].k[:, :, :12].float() - caches[1].k[:, :, :12].float()).abs().max().item() < 1e-2
    ar = ff.generate(plain, [5, 9, 33, 5, 9], "ar", max_new_tokens=12).token_ids
    assert ff.generate(plain, [5, 9, 33, 5, 9], "pld", max_new_tokens=12).token_ids == ar


def test_the_choice_at_load_and_on_the_command_line(tmp_path, default_model, default_exact):
    from fastforward.cli.options import add_model_arguments, model_load_kwargs
    from fastforward.testing import tiny_hf_folder

    folder = str(tiny_hf_folder(tmp_path / "m"))
    target = ff.load(folder, kv_cache="fp16")
    assert target.kv_precision == "fp16" and target.new_cache(8).k.dtype == torch.float16
    assert ff.load(folder).new_cache(8).k.dtype == torch.float32  # auto: an HF folder (exact) keeps fp32
    if default_model.arithmetic == "q8":  # auto: llama.cpp's pairing, fp16 with the q8 arithmetic
        assert default_model.kv_precision == "fp16" and default_model.new_cache(8).k.dtype == torch.float16
    assert default_exact.kv_precision == "fp32"  # and fp32 with the exact one
    with pytest.raises(UsageError, match="unknown --kv-cache"):
        ff.load(folder, kv_cache="int8")
    with pytest.raises(UsageError, match="--backend hf"):
        ff.load(folder, backend="hf", kv_cache="fp16")
    with pytest.raises(UsageError, match="dtype other than fp32"):
        ff.load(folder, dtype=torch.float64, kv_cache="fp16")
    with pytest.raises(UsageError, match="fp32 activations"):
        tiny_target().backend.kv_precision = "fp16"  # float64
    with pytest.raises(UsageError, match="unknown KV cache precision"):
        target.backend.kv_precision = "bf16"
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert model_load_kwargs(parser.parse_args(["--kv-cache", "fp16"]))["kv_cache"] == "fp16"
    assert model_load_kwargs(parser.parse_args([]))["kv_cache"] == "auto"


def test_bytes_read_count_the_half_size_cache(targets):
    fp16, fp32 = targets["q8"].backend, targets["q8-fp32"].backend
    a, b = forward_read_bytes(fp16, q=1, kv=100), forward_read_bytes(fp32, q=1, kv=100)
    assert 2 * a["kv_cache"] == b["kv_cache"] and a["weights"] == b["weights"]
