"""The skinny-GEMM kernel: agreement with torch, bitwise row independence, and the lean forward routed through it."""

import pytest
import torch

from fastforward import kernels
from fastforward.testing import tiny_target


@pytest.fixture(scope="module")
def skinny():
    fn = kernels.load_kernel()
    if fn is None:
        pytest.skip("the skinny-GEMM kernel is unavailable here")
    return fn


def _rel_err(out, x, w):
    ref = x.double() @ w.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("k", [1, 3, 17, 577, 1535])
@pytest.mark.parametrize("n", [1, 15, 33, 100, 200, 1000])
def test_matches_matmul(skinny, k, n):
    g = torch.Generator().manual_seed(k * 10007 + n)
    w = torch.randn(k, n, generator=g)
    for m in range(1, 34):
        x = torch.randn(m, k, generator=g)
        out = skinny(x, w)
        assert out.shape == (m, n) and out.dtype == torch.float32
        assert _rel_err(out, x, w) < 1e-5, (m, k, n)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (131, 49), (64, 3072)])
def test_rows_are_bitwise_independent(skinny, k, n):
    """Row m of a batch equals the same row computed alone, bit for bit, whatever the batch and thread count."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(k, n, generator=g)
    x = torch.randn(33, k, generator=g)
    alone = torch.cat([skinny(x[i : i + 1], w) for i in range(33)])
    for m in (2, 3, 5, 8, 9, 16, 17, 32, 33):
        assert torch.equal(skinny(x[:m], w), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(skinny(x, w), alone)
    finally:
        torch.set_num_threads(threads)


def test_inputs_and_errors(skinny):
    x = torch.randn(40, 6)
    w = torch.randn(40, 30)
    assert torch.equal(skinny(x.t(), w), skinny(x.t().contiguous(), w))  # non-contiguous x
    assert skinny(torch.randn(0, 40), w).shape == (0, 30)
    assert torch.equal(skinny(torch.randn(3, 0), torch.randn(0, 5)), torch.zeros(3, 5))
    with pytest.raises(RuntimeError):
        skinny(x.t().double(), w.double())
    with pytest.raises(RuntimeError):
        skinny(torch.randn(2, 39), w)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("FASTFORWARD_NO_KERNEL", "1")
    assert kernels.load_kernel() is None and kernels.kernel_name() is None


def test_float64_models_never_use_the_kernel(tiny):
    assert tiny.backend.skinny is None and tiny.backend.matmul_kernel == "mkl"


def test_lean_forward_with_and_without_the_kernel(skinny):
    """fp32 tiny model (odd widths exercise the kernel's remainders): the kernel's logits match torch's."""
    target = tiny_target(dtype=torch.float32, hidden_size=48, intermediate_size=100, vocab_size=97)
    lean = target.backend
    assert lean.skinny is not None and lean.matmul_kernel.startswith("skinny-")
    prompt = torch.tensor([3, 17, 42, 8, 91, 5, 60, 23, 11, 4, 77])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tokens, positions = torch.tensor([14, 7, 33, 2]), torch.tensor([11, 12, 12, 13])

    def run():
        cache = target.new_cache(64)
        first = target.forward(prompt, torch.arange(len(prompt)), cache).logits
        cache.keep(range(len(prompt)))
        return first, target.forward(tokens, positions, cache, tree).logits

    with_kernel = run()
    limit, lean.kernel_max_q = lean.kernel_max_q, 0  # route every matmul to torch
    try:
        without = run()
    finally:
        lean.kernel_max_q = limit
    for a, b in zip(with_kernel, without, strict=True):
        assert (a - b).abs().max().item() < 1e-4


def test_isa_choice_by_environment(monkeypatch, capsys):
    avx2 = {"avx2", "fma"}
    assert kernels.pick_isa(avx2 | {"avx512f"}, requested="") == "avx512"
    assert kernels.pick_isa(avx2 | {"avx512f"}, requested="avx2") == "avx2"
    assert kernels.pick_isa(avx2, requested="avx512-emulated") == "avx512-emulated"
    # a build the CPU cannot run, or a name that is not a build, is reported and the CPU's best is used
    assert kernels.pick_isa(avx2, requested="avx512") == "avx2"
    assert kernels.pick_isa(avx2, requested="sse9") == "avx2"
    err = capsys.readouterr().err
    assert "needs avx512f" in err and "is not one of avx512, avx2, avx512-emulated" in err
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.pick_isa(avx2 | {"avx512f"}) == "avx2"


KERNEL_TESTS = ["tests/test_quant.py", "tests/test_layer_ops.py", "tests/test_attention_options.py",
                "tests/test_kernels.py"]


@pytest.mark.skipif("avx512f" in kernels.cpu_flags(), reason="this CPU runs the AVX-512 build natively")
@pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="no AVX2 CPU to emulate AVX-512 on")
@pytest.mark.skipif(not __import__("pathlib").Path("/usr/include/simde/x86/avx512.h").is_file(),
                    reason="SIMDe's headers (Debian: libsimde-dev) are not installed, so the AVX-512 build cannot "
                           "be emulated here")
def test_avx512_code_path_under_emulation():
    """On a CPU without AVX-512 the AVX-512 source would otherwise never run: build it against SIMDe's portable
    intrinsics and run the kernel tests (exact block decoding, bitwise row and thread independence, tree
    attention rows equal alone, agreement with the dequantised models) on that build."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{kernels.ISA_ENV: "avx512-emulated"})
    isa = subprocess.run([sys.executable, "-c", "from fastforward import kernels; print(kernels.load_native().isa)"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert isa.stdout.strip() == "avx512-emulated", isa.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS,
                          "-k", "not under_emulation"], env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout, run.stdout[-500:]
