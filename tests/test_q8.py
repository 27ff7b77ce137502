"""The q8 arithmetic (llama.cpp's 8-bit activation blocks, integer block dot products): the native kernel bitwise
equal to the plain-PyTorch definition in fastforward/arithmetic.py, every row of a product of up to 150 rows bitwise
the row alone, activation rows quantised as llama.cpp does, the panel layout holding the file's bytes, and every
decoding method reproducing q8 AR token for token (greedy) and in distribution (sampling)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward import kernels
from fastforward.arithmetic import ACTIVATION_FORMAT, BLOCK, Q8_FORMATS, q8_matmul, quantize_activations
from fastforward.linear import PackedLinear, dequantize
from fastforward.testing import random_gguf_blocks, tiny_gguf_target

native = kernels.load_native()
needs_native = pytest.mark.skipif(native is None, reason="the native kernels are unavailable here")
FORMATS = sorted(Q8_FORMATS)
IDS = [Q8_FORMATS[f] for f in FORMATS]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values, NaN where the other has NaN (huge activations overflow fp16 scales, in llama.cpp too)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def width(fmt: int) -> int:
    return 512 if BLOCK[fmt] == 256 else 544  # 17 blocks of 32: an odd count too


def q8_linear(fmt: int, n_out: int = 45, seed: int = 0):
    data = random_gguf_blocks(fmt, n_out, width(fmt), seed=seed, scale=0.8 if BLOCK[fmt] == 256 else 0.05)
    return data, PackedLinear(data, fmt, width(fmt), native=native, arithmetic="q8")


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_kernel_is_bitwise_the_reference_definition(fmt):
    data, lin = q8_linear(fmt)  # 45 outputs: the last panel of 8 is padded
    x = torch.randn(23, width(fmt)) * torch.logspace(-3, 1, 23).unsqueeze(1)
    assert torch.equal(lin(x), q8_matmul(x, data, fmt, width(fmt)))


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_every_row_of_up_to_150_rows_is_bitwise_the_row_alone(fmt):
    _, lin = q8_linear(fmt, n_out=40, seed=fmt)
    x = torch.randn(150, width(fmt))
    alone = torch.cat([lin(x[i : i + 1]) for i in range(150)])
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 31, 48, 63, 64, 65, 100, 150):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    assert torch.equal(lin(x[37:129]), alone[37:129])  # rows keep their result wherever they sit in the call


@needs_native
def test_results_do_not_depend_on_the_thread_count():
    _, lin = q8_linear(12, n_out=256)
    x = torch.randn(9, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_panels_hold_the_files_bytes_and_rows_decode_exactly(fmt):
    data, lin = q8_linear(fmt, n_out=37)
    assert lin.data.shape[0] == 40 and lin.padded
    assert data.shape[1] <= lin.data.shape[1] <= data.shape[1] * 1.03  # bytes a row: K-quants' scales unpacked
    assert torch.equal(lin.file_layout(), data)
    ids = torch.tensor([0, 36, 5, 8, 8])
    assert torch.equal(lin.rows(ids), dequantize(data, fmt, width(fmt))[ids])


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("panels", [(3, 2, 5), (2, 4, 1), (6, 1)], ids=lambda p: "+".join(map(str, p)))
def test_a_concatenation_of_weights_is_their_outputs_side_by_side(fmt, panels):
    """q|k|v and gate|up run as one weight: its outputs are the parts' in order, bit for bit, whatever the parts'
    panel counts (where panels are laid out in pairs, a part with an odd count is not fused: None)."""
    parts = [q8_linear(fmt, n_out=8 * n, seed=i)[1] for i, n in enumerate(panels)]
    fused = PackedLinear.concat(parts)
    x = torch.randn(11, width(fmt))
    side_by_side = torch.cat([p(x) for p in parts], dim=1)
    if fused is None:
        assert fmt in getattr(native, "q8_panel_pairs", ()) and any(n % 2 for n in panels[:-1])
    else:
        assert all(torch.equal(fused(x[:m]), side_by_side[:m]) for m in (1, 2, 5, 8, 9, 11))
        assert torch.equal(fused.rows(torch.tensor([0, 8 * panels[0], fused.out_features - 1])),
                           torch.cat([p.dense() for p in parts])[[0, 8 * panels[0], fused.out_features - 1]])


def special_rows(k: int) -> torch.Tensor:
    """Activation rows that test the quantisers' corners: zeros, exact halves after scaling (ties), a negative
    largest magnitude, equal magnitudes of both signs (the first decides Q8_K's sign), tiny and huge values."""
    rows = torch.randn(8, k)
    rows[0] = 0.0
    rows[1] = torch.arange(k, dtype=torch.float32) % 255 - 127.0  # multiples of amax/127: many .5 ties after * id
    rows[1, ::64] = 127.0
    rows[2, 5] = -50.0
    rows[3, 7], rows[3, 9] = -7.0, 7.0
    rows[4] *= 1e-30
    rows[5] *= 1e30
    rows[6, :32] = 0.0
    rows[7] = (torch.arange(k) % 7 - 3).float() / 2  # halves
    return rows


@needs_native
@pytest.mark.parametrize("fmt", [2, 3, 12], ids=["Q8_0", "Q8_1", "Q8_K"])
def test_activation_rows_quantise_as_llama_cpp_does(fmt):
    x = torch.cat([special_rows(512), torch.randn(5, 512) * 3])
    ref = quantize_activations(x, ACTIVATION_FORMAT[fmt])
    q, d, extra = native.q8_quantize(x, fmt)
    nb = ref["d"].shape[1]
    assert torch.equal(q.long().reshape(ref["q"].shape), ref["q"])
    assert torch.equal(d, ref["d"])
    if fmt == 12:
        assert torch.equal(extra.long(), ref["bsums"])
    elif fmt == 3:
        assert torch.equal(extra, ref["s"])
    else:
        assert torch.equal(extra.long(), 8 * ref["sum"]) and nb == 16  # Q4_0's offset term: 8 * sum(q)
    assert int(ref["q"].abs().max()) <= 127


def test_activation_quantisers_follow_llama_cpp_by_hand():
    """A few values worked by hand from llama.cpp's quantize_row_q8_0 / q8_K: Q8_0 rounds half to even and keeps
    the fp16 of amax / 127; Q8_K scales by -127 / (the first element of largest magnitude)."""
    x = torch.zeros(1, 256)
    x[0, :4] = torch.tensor([2.0, -1.0, 0.5, 127 / 254])  # amax 2: id 63.5; 127/254 * 63.5 = 31.75 -> 32
    x[0, 32:34] = torch.tensor([-4.0, 4.0])
    a = quantize_activations(x, "Q8_0")
    assert a["q"][0, 0, :4].tolist() == [127, -64, 32, 32]  # -63.5 -> -64 and 31.75 -> 32; 0.5 * 63.5 = 31.75
    assert a["d"][0, 0].item() == torch.tensor(2.0 / 127).half().float().item()
    k = quantize_activations(x, "Q8_K")  # max = -4 (the first of largest magnitude): iscale = -127 / -4 = 31.75
    assert k["q"][0, 0, 32].item() == -127 and k["q"][0, 0, 33].item() == 127 and k["q"][0, 0, 0].item() == 64
    assert k["d"][0, 0].item() == pytest.approx(4.0 / 127)
    x[0, 32:34] = torch.tensor([4.0, -4.0])  # now +4 comes first: the max always maps to -127, so d changes sign
    k = quantize_activations(x, "Q8_K")
    assert k["q"][0, 0, 32].item() == -127 and k["q"][0, 0, 33].item() == 127 and k["q"][0, 0, 0].item() == -64
    assert k["d"][0, 0].item() == pytest.approx(-4.0 / 127)


@needs_native
@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(FORMATS), rows=st.integers(1, 40), seed=st.integers(0, 2**16),
       log_scale=st.floats(-6, 4))
def test_kernel_equals_reference_on_any_rows(fmt, rows, seed, log_scale):
    g = torch.Generator().manual_seed(seed)
    data = random_gguf_blocks(fmt, 16, width(fmt), seed=seed, scale=0.8 if BLOCK[fmt] == 256 else 0.05)
    lin = PackedLinear(data, fmt, width(fmt), native=native, arithmetic="q8")
    x = torch.randn(rows, width(fmt), generator=g) * float(10.0**log_scale)
    assert same(lin(x), q8_matmul(x, data, fmt, width(fmt)))


# ---- models ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """A tiny random GGUF (Q4_1 linears, tied Q8_0 embedding) in the q8 arithmetic, and the same file exact."""
    folder = tmp_path_factory.mktemp("q8")
    q8, _ = tiny_gguf_target(folder / "tiny.gguf", arithmetic="q8")
    exact, _ = tiny_gguf_target(folder / "same.gguf", arithmetic="exact")
    return q8, exact


@needs_native
def test_the_q8_model_runs_the_integer_kernel_and_differs_from_exact(tiny_q8):
    q8, exact = tiny_q8
    assert q8.arithmetic == "q8" and q8.backend.matmul_kernel.startswith("q8-")
    assert exact.arithmetic == "exact"
    ids = torch.tensor([3, 17, 42, 8, 91, 5, 60])
    a = q8.forward(ids, torch.arange(7), q8.new_cache(8)).logits
    b = exact.forward(ids, torch.arange(7), exact.new_cache(8)).logits
    assert 0 < (a - b).abs().max().item() < 0.05 * b.abs().max().item()  # another model, close to the exact one


@pytest.mark.parametrize("linear_type", ["Q4_1", "Q5_0", "Q4_K"])
def test_native_q8_forward_matches_the_plain_pytorch_q8_model(tmp_path, monkeypatch, linear_type):
    """The model on the native kernels and layer ops against the same arithmetic in plain PyTorch (the reference
    product, torch's attention and norms): logits within 1e-4, for a prompt and a tree step."""
    if native is None:
        pytest.skip("the native kernels are unavailable here")
    size = {"hidden_size": 256, "intermediate_size": 256} if linear_type == "Q4_K" else {}
    fast, _ = tiny_gguf_target(tmp_path / "a.gguf", arithmetic="q8", linear_type=linear_type, **size)
    monkeypatch.setenv("FASTFORWARD_TORCH_OPS", "1")
    plain, _ = tiny_gguf_target(tmp_path / "b.gguf", arithmetic="q8", native=None, linear_type=linear_type, **size)
    assert plain.backend.ops is None
    assert plain.backend.matmul_kernel.startswith("q8-reference")
    prompt = torch.tensor([3, 17, 42, 8, 91, 5, 60, 23, 11])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out = []
    for target in (fast, plain):
        cache = target.new_cache(32)
        first = target.forward(prompt, torch.arange(9), cache).logits
        cache.keep(range(9))
        out.append((first, target.forward(torch.tensor([4, 7, 9]), torch.tensor([9, 10, 10]), cache, tree).logits))
    assert (out[0][0] - out[1][0]).abs().max().item() < 1e-4
    assert (out[0][1] - out[1][1]).abs().max().item() < 1e-4


@needs_native
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=20),
    max_new=st.integers(1, 40),
    method=st.sampled_from(["jacobi", "pld", "lookahead", "tr-jacobi"]),
)
def test_every_method_equals_q8_ar(tiny_q8, prompt, max_new, method):
    q8, _ = tiny_q8
    ar = ff.generate(q8, prompt, "ar", max_new_tokens=max_new).token_ids
    assert ff.generate(q8, prompt, method, max_new_tokens=max_new).token_ids == ar


@pytest.fixture(scope="module")
def tiny_q8_kquants(tmp_path_factory):
    """A tiny random GGUF of K-quants (Q4_K linears, a tied Q6_K embedding and head) in the q8 arithmetic: its drafts'
    verification rows go through the K-quants' several-row tiles, its decoding steps through the one-row ones."""
    q8, _ = tiny_gguf_target(tmp_path_factory.mktemp("q8k") / "tiny.gguf", arithmetic="q8", linear_type="Q4_K",
                             embed_type="Q6_K", hidden_size=256, intermediate_size=512, vocab_size=256)
    return q8


@needs_native
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=20),
    max_new=st.integers(1, 40),
    method=st.sampled_from(["jacobi", "pld", "lookahead", "tr-jacobi"]),
)
def test_every_method_equals_q8_ar_on_k_quants(tiny_q8_kquants, prompt, max_new, method):
    ar = ff.generate(tiny_q8_kquants, prompt, "ar", max_new_tokens=max_new).token_ids
    assert ff.generate(tiny_q8_kquants, prompt, method, max_new_tokens=max_new).token_ids == ar


@needs_native
def test_batched_sequences_equal_their_solo_q8_outputs(tiny_q8):
    q8, _ = tiny_q8
    prompts = [[1, 2, 3, 1, 2, 3], [5, 9, 33], [7] * 12]
    solo = [ff.generate(q8, p, "pld", max_new_tokens=24).token_ids for p in prompts]
    batch = ff.generate_batch(q8, prompts, "pld", max_new_tokens=24, max_batch_tokens=64)
    assert [r.token_ids for r in batch] == solo


@needs_native
def test_sampling_on_q8_keeps_the_targets_distribution(tmp_path):
    """chi-square of 3-token continuations at T = 1 under prompt lookup against the q8 target's exact joint."""
    from fastforward.testing import chi2_critical, exact_joint, pooled_chi2
    from fastforward.verify import SamplingConfig

    target, _ = tiny_gguf_target(tmp_path / "v.gguf", arithmetic="q8", vocab_size=8, init_std=0.1, seed=4)
    cfg = SamplingConfig(1.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    exact = exact_joint(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    accepted = 0
    samples = 2000
    for seed in range(samples):
        res = ff.generate(target, prompt, "pld", max_new_tokens=3, temperature=1.0, seed=seed,
                          method_options={"adaptive": False})
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        accepted += sum(res.stats.depth_accepts)
    assert accepted > 0.05 * samples  # drafts were really verified
    chi2, df = pooled_chi2(exact, counts)
    assert df >= 15
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


def test_arithmetic_choices_are_checked(tmp_path):
    from fastforward.errors import UsageError
    from fastforward.testing import tiny_hf_folder

    with pytest.raises(UsageError, match="unknown --arithmetic"):
        ff.load("smollm2-135m", arithmetic="int4")
    folder = tiny_hf_folder(tmp_path / "m")
    with pytest.raises(UsageError, match="GGUF quantised weights"):
        ff.load(str(folder), arithmetic="q8")
    with pytest.raises(UsageError, match="cannot be combined"):
        ff.load("smollm2-135m", arithmetic="q8", weights="fp32")


@pytest.mark.slow
@needs_native
def test_default_model_runs_q8_by_default_and_methods_reproduce_it(default_model):
    assert default_model.arithmetic == "q8"
    assert default_model.backend.matmul_kernel.startswith("q8-")
    assert default_model.backend.weight_bytes < 110e6  # panels hold the file's bytes
    prompt = "List the first ten prime numbers, then list them again in reverse order."
    ar = ff.generate(default_model, prompt, "ar", max_new_tokens=64).token_ids
    for method in ("pld", "lookahead", "tr-jacobi"):
        assert ff.generate(default_model, prompt, method, max_new_tokens=64).token_ids == ar, method


def test_reference_handles_every_format_without_native():
    rng = np.random.default_rng(1)
    for fmt in FORMATS:
        data = random_gguf_blocks(fmt, 8, width(fmt), seed=int(rng.integers(1 << 16)))
        x = torch.randn(3, width(fmt))
        y = q8_matmul(x, data, fmt, width(fmt))
        ref = x.double() @ dequantize(data, fmt, width(fmt)).double().T
        assert (y.double() - ref).abs().max().item() < 0.05 * ref.abs().max().item() + 1e-6


@pytest.mark.parametrize("embed_type", ["Q8_0", "Q6_K"])
def test_large_weights_packed_in_slices_are_the_same_model(tmp_path, monkeypatch, embed_type):
    """A weight with more rows than Q8_PACK_ROWS is read and packed a slice at a time (never held in two layouts at
    once while loading): the packed bytes and every logit are those of packing it whole."""
    from fastforward import gguf_file

    if kernels.load_native() is None:
        pytest.skip("needs the native kernels")
    kw = dict(vocab_size=256 if embed_type == "Q6_K" else 96, hidden_size=256 if embed_type == "Q6_K" else 64,
              intermediate_size=512, embed_type=embed_type, linear_type="Q4_0")
    whole, _ = tiny_gguf_target(tmp_path / "whole.gguf", arithmetic="q8", **kw)
    monkeypatch.setattr(gguf_file, "Q8_PACK_ROWS", 16)
    sliced, _ = tiny_gguf_target(tmp_path / "sliced.gguf", arithmetic="q8", **kw)
    a, b = whole.backend, sliced.backend
    assert torch.equal(a.embed.data, b.embed.data) and a.embed.kernel_fmt == b.embed.kernel_fmt
    assert torch.equal(a.layers[0].down.data, b.layers[0].down.data)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    out_a = whole.forward(ids, torch.arange(8), whole.new_cache(16)).logits
    out_b = sliced.forward(ids, torch.arange(8), sliced.new_cache(16)).logits
    assert torch.equal(out_a, out_b)
