"""Packed GGUF weights: exact block decoding, bitwise row independence, the tiny and the default model against
their dequantised fp32 selves, and every method's greedy output equal to AR's on the packed path."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward import kernels
from fastforward.linear import FORMAT_IDS, PACKED_FORMATS, PackedLinear, dequantize, quantize
from fastforward.model import TargetModel
from fastforward.testing import TinyTokenizer, random_gguf_blocks, tiny_gguf_target

pytestmark = pytest.mark.skipif(kernels.load_native() is None, reason="the native kernels are unavailable here")

def random_blocks(fmt: int, n_out: int, n_in: int, seed: int = 0) -> torch.Tensor:
    """Random packed rows of a format: random quants and sub-scales, sane fp16 block scales."""
    if fmt == FORMAT_IDS["BF16"]:
        rng = np.random.default_rng(seed)
        return quantize(torch.from_numpy(rng.normal(0, 0.1, size=(n_out, n_in)).astype(np.float32)), "BF16")
    return random_gguf_blocks(fmt, n_out, n_in, seed=seed, scale=0.8 if PACKED_FORMATS[fmt][1] == 256 else 0.05)


FORMATS = sorted(PACKED_FORMATS)


@pytest.mark.parametrize("fmt", FORMATS, ids=[PACKED_FORMATS[f][0] for f in FORMATS])
def test_rows_decode_to_exactly_the_reference_dequantisation(fmt):
    data = random_blocks(fmt, 37, 512)
    before = data.clone()
    lin = PackedLinear(data, fmt, 512, native=kernels.load_native())
    assert torch.equal(data, before)  # the caller's bytes are left alone (regrouped into a copy)
    assert torch.equal(lin.rows(torch.arange(37)), dequantize(data, fmt, 512))
    assert torch.equal(lin.file_layout(), data)  # the kernel's layout holds the same bytes, regrouped


def test_the_kernel_layout_puts_each_rows_block_scales_first():
    """Q4_1 rows (d, m, 16 quant bytes per block) in the kernel's layout: all of a row's (d, m) pairs, then all of
    its quant bytes, block by block."""
    data = random_blocks(3, 5, 96)  # 3 blocks of 20 bytes per row
    kernel = kernels.load_native().regroup_block_scales_(data.clone(), 3, 96, True)
    blocks = data.view(5, 3, 20)
    assert torch.equal(kernel[:, :12], blocks[:, :, :4].reshape(5, 12))
    assert torch.equal(kernel[:, 12:], blocks[:, :, 4:].reshape(5, 48))


@pytest.mark.parametrize("fmt", FORMATS, ids=[PACKED_FORMATS[f][0] for f in FORMATS])
def test_product_matches_dense_and_rows_are_bitwise_independent(fmt):
    k = 512 if PACKED_FORMATS[fmt][1] == 256 else 544
    lin = PackedLinear(random_blocks(fmt, 45, k, seed=fmt), fmt, k, native=kernels.load_native())
    x = torch.randn(61, k)
    dense = lin.dense()
    ref = x.double() @ dense.double().T
    out = lin(x)
    assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item() * 10
    alone = torch.cat([lin(x[i : i + 1]) for i in range(61)])
    for m in (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 48, 49, 61):
        assert torch.equal(lin(x[:m]), alone[:m]), m


@pytest.mark.parametrize("n_out", [300, 160])  # 160 outputs: the AMX kernel's tiled layout where the CPU has AMX
def test_results_do_not_depend_on_the_thread_count(n_out):
    lin = PackedLinear(random_blocks(3, n_out, 576), 3, 576, native=kernels.load_native())
    x = torch.randn(9, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_arguments_raise_clear_errors():
    native = kernels.load_native()
    data = random_blocks(3, 4, 64)
    with pytest.raises(RuntimeError, match="columns"):
        native.quant_mm(torch.randn(2, 32), data, 3, 64)
    with pytest.raises(RuntimeError, match="bytes"):
        native.quant_mm(torch.randn(2, 96), data, 3, 96)
    with pytest.raises(RuntimeError, match="unsupported"):
        native.quant_mm(torch.randn(2, 64), data, 10, 64)  # Q2_K: no packed kernel
    with pytest.raises(RuntimeError, match="out of range"):
        native.quant_rows(data, 3, 64, torch.tensor([4]))
    with pytest.raises(ValueError):
        PackedLinear(data[:, :-1], 3, 64, native=native)


@pytest.fixture(scope="module")
def tiny_packed(tmp_path_factory):
    """A tiny random GGUF (Q4_1 linears, tied Q8_0 embedding) on the packed path, and its fp32 twin."""
    packed, hf = tiny_gguf_target(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return packed, TargetModel("tiny-fp32", hf, TinyTokenizer(hf.config.vocab_size), backend="lean")


def test_tiny_gguf_matches_its_dequantised_fp32_model(tiny_packed):
    packed, fp32 = tiny_packed
    assert packed.backend.matmul_kernel.startswith("quant-")
    prompt = torch.tensor([3, 17, 42, 8, 91, 5, 60, 23, 11, 4, 77])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tokens, positions = torch.tensor([14, 7, 33, 2]), torch.tensor([11, 12, 12, 13])
    for target in tiny_packed:
        cache = target.new_cache(64)
        target.first = target.forward(prompt, torch.arange(len(prompt)), cache).logits
        cache.keep(range(len(prompt)))
        target.tree = target.forward(tokens, positions, cache, tree).logits
    assert (packed.first - fp32.first).abs().max().item() < 1e-4
    assert (packed.tree - fp32.tree).abs().max().item() < 1e-4
    with torch.no_grad():
        hf = fp32.hf_model(prompt[None]).logits[0]
    assert (packed.first - hf).abs().max().item() < 1e-4


def test_tiny_gguf_weights_equal_the_dequantised_state(tmp_path):
    from fastforward.testing import write_tiny_gguf

    path = tmp_path / "sep.gguf"
    state = write_tiny_gguf(path, tied=False, linear_type="Q8_0", embed_type="Q4_0", seed=3)
    packed, _ = tiny_gguf_target(tmp_path / "again.gguf", tied=False, linear_type="Q8_0", embed_type="Q4_0", seed=3)
    layer = packed.backend.layers[1]
    ref = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.qkv.dense(), ref)  # Q/K rows back in HF order
    assert torch.equal(packed.backend.head.dense(), state["lm_head.weight"])
    assert packed.backend.head is not packed.backend.embed


def test_mixed_format_layers_stay_packed(tmp_path):
    """A Q4_K_M-style file (attn_v and ffn_down in another format than their neighbours): each part stays packed
    and the forward matches the dequantised fp32 model."""
    from fastforward.linear import StackedLinear

    packed, hf = tiny_gguf_target(tmp_path / "mixed.gguf", types={"attn_v": "Q8_0", "ffn_up": "Q4_0"})
    fp32 = TargetModel("fp32", hf, TinyTokenizer(hf.config.vocab_size), backend="lean")
    layer = packed.backend.layers[0]
    assert isinstance(layer.qkv, StackedLinear) and isinstance(layer.gate_up, StackedLinear)
    assert all(isinstance(p, PackedLinear) for p in layer.qkv.parts + layer.gate_up.parts)
    ids = torch.tensor([3, 17, 42, 8, 91, 5])
    a = packed.forward(ids, torch.arange(6), packed.new_cache(8)).logits
    b = fp32.forward(ids, torch.arange(6), fp32.new_cache(8)).logits
    assert (a - b).abs().max().item() < 1e-4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=20),
    max_new=st.integers(1, 40),
    method=st.sampled_from(["jacobi", "pld", "lookahead", "tr-jacobi"]),
)
def test_every_method_equals_ar_on_the_packed_path(tiny_packed, prompt, max_new, method):
    packed, _ = tiny_packed
    ar = ff.generate(packed, prompt, "ar", max_new_tokens=max_new).token_ids
    assert ff.generate(packed, prompt, method, max_new_tokens=max_new).token_ids == ar


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_opt_in_weight_formats_for_hf_models_are_reproduced_exactly(tmp_path, weights):
    """--weights bf16/int8 on an HF folder: a different model (weights rounded), close to fp32, and every method
    reproduces it exactly."""
    from fastforward.testing import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "m")
    fp32 = ff.load(str(folder))
    target = ff.load(str(folder), weights=weights)
    assert target.backend.matmul_kernel.startswith("quant-")
    ids = torch.tensor([5, 9, 33, 17, 2, 41, 8])
    a = fp32.forward(ids, torch.arange(7), fp32.new_cache(16)).logits
    b = target.forward(ids, torch.arange(7), target.new_cache(16)).logits
    assert 0 < (a - b).abs().max().item() < 0.1 * a.abs().max().item()
    ar = ff.generate(target, ids.tolist(), "ar", max_new_tokens=24).token_ids
    for method in ("pld", "lookahead", "jacobi"):
        assert ff.generate(target, ids.tolist(), method, max_new_tokens=24).token_ids == ar


def test_weight_choices_are_checked(tmp_path):
    from fastforward.errors import UsageError

    with pytest.raises(UsageError, match="unknown --weights"):
        ff.load("smollm2-135m", weights="int4")


@pytest.mark.slow
def test_default_model_packed_matches_dequantised_fp32(default_exact):
    fp32 = ff.load(weights="fp32")
    assert default_exact.backend.matmul_kernel.startswith("quant-")
    assert default_exact.backend.weight_bytes < 110e6  # the file's packed size (96 MB), not fp32's 538 MB
    prompt = torch.tensor(default_exact.encode("Write a short story about a robot who learns to paint."))
    n = prompt.numel()
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    tokens, positions = torch.tensor([504, 3458, 30, 216, 1345]), n + torch.tensor([0, 1, 1, 2, 2])
    logits = []
    for target in (default_exact, fp32):
        cache = target.new_cache(n + 8)
        first = target.forward(prompt, torch.arange(n), cache).logits
        cache.keep(range(n))
        logits.append((first, target.forward(tokens, positions, cache, tree).logits))
    assert (logits[0][0] - logits[1][0]).abs().max().item() < 1e-4
    assert (logits[0][1] - logits[1][1]).abs().max().item() < 1e-4
    hf = fp32.hf_model.model.layers[0].self_attn
    qkv = torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight])
    assert torch.equal(default_exact.backend.layers[0].qkv.dense(), qkv)


def test_the_fused_stack_follows_every_change_of_the_layers(tmp_path):
    """The one-call stack of packed layers is kept between forwards and rebuilt when a layer's linear is set, a layer
    is replaced, or the ops change; a forward after each change is the forward of a model loaded with that change."""
    import dataclasses

    packed, _ = tiny_gguf_target(tmp_path / "tiny.gguf")
    backend = packed.backend
    if backend.ops is None or not hasattr(backend.ops, "PackedStack"):
        pytest.skip("no native layer ops here")
    prompt = torch.tensor([3, 17, 42, 8, 91, 5, 60])

    def logits():
        return packed.forward(prompt, torch.arange(7), packed.new_cache(16)).logits

    first = backend._packed_stack()
    assert first is not None and backend._packed_stack() is first  # kept
    before = logits()
    layers = backend.layers
    layers[0].down, layers[1].down = layers[1].down, layers[0].down  # same shapes: a different model
    assert backend._packed_stack() is not first
    assert not torch.equal(logits(), before)
    layers[0].down, layers[1].down = layers[1].down, layers[0].down
    assert torch.equal(logits(), before)
    layers[1] = dataclasses.replace(layers[1], gate_up=layers[0].gate_up)  # a layer replaced in the list
    assert backend._packed_stack() is not first
    again, _ = tiny_gguf_target(tmp_path / "again.gguf")
    again.backend.layers[1].gate_up = again.backend.layers[0].gate_up
    assert torch.equal(logits(), again.forward(prompt, torch.arange(7), again.new_cache(16)).logits)


def test_fused_packed_layer_is_bitwise_the_per_op_forward(tiny_packed):
    """One sequence over packed layers runs every layer in one native call (``ops.PackedStack``), or each layer as
    one (``ops.packed_layer``): logits, hidden states and the KV cache written are bitwise those of the per-op calls,
    for a prompt and for a tree step with its own write slots."""
    packed, _ = tiny_packed
    backend = packed.backend
    if backend.ops is None or not hasattr(backend.ops, "PackedStack"):
        pytest.skip("no native layer ops here")
    assert all(layer.packed_weights() is not None for layer in backend.layers)

    class Without:  # the same native ops without some of the fused calls
        def __init__(self, ops, *hidden):
            self.ops, self.hidden = ops, hidden

        def __getattr__(self, name):
            if name in self.hidden:
                raise AttributeError(name)
            return getattr(self.ops, name)

    calls = []
    stack_class = backend.ops.PackedStack

    class CountedStack(stack_class):
        def run(self, *args):
            calls.append(args[-1])
            return super().run(*args)

    prompt = torch.tensor([3, 17, 42, 8, 91, 5, 60])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tokens, positions = torch.tensor([14, 7, 33, 2]), torch.tensor([7, 8, 8, 9])
    runs, native = [], backend.ops
    stacked = Without(native)
    stacked.PackedStack = CountedStack
    try:
        for ops in (stacked, Without(native, "PackedStack"), Without(native, "PackedStack", "packed_layer")):
            backend.ops = ops
            cache = packed.new_cache(32)
            first = packed.forward(prompt, torch.arange(7), cache, hidden_layers=(0, 1, -1))
            cache.keep(range(7))
            step = packed.forward(tokens, positions, cache, tree, write_slots=torch.tensor([7, 9, 8, 10]))
            runs.append((first, step, cache.k.clone(), cache.v.clone()))
    finally:
        backend.ops = native
    assert calls == [[0, 1], []]  # the stack ran both forwards of the first run, with the layers tapped
    (f1, s1, k1, v1) = runs[0]
    for f2, s2, k2, v2 in runs[1:]:
        assert torch.equal(f1.logits, f2.logits) and torch.equal(s1.logits, s2.logits)
        assert all(torch.equal(f1.hidden[i], f2.hidden[i]) for i in (0, 1, -1))
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
