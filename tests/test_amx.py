"""The AMX kernel (``kernels/amx_gemm.cpp``): the tiled layout holds the file's bytes, rows decode to exactly the
reference dequantisation, products match the dequantised fp32 product, rows are bitwise independent of the other
rows in the call (and of the thread count: tests/test_quant.py), and ``FASTFORWARD_NO_AMX=1`` keeps the multiply-add
kernel."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastforward import kernels
from fastforward.linear import AMX_FORMATS, PACKED_FORMATS, PackedLinear, amx_in_use, dequantize
from tests.test_quant import random_blocks

NATIVE = kernels.load_native()
pytestmark = pytest.mark.skipif(not amx_in_use(NATIVE), reason="no AMX on this CPU (or FASTFORWARD_NO_AMX is set)")
IDS = [PACKED_FORMATS[f][0] for f in AMX_FORMATS]


@pytest.mark.parametrize("fmt", AMX_FORMATS, ids=IDS)
def test_tiled_layout_holds_the_files_bytes_and_rows_decode_exactly(fmt):
    data = random_blocks(fmt, 48, 576, seed=fmt)
    lin = PackedLinear(data, fmt, 576, native=NATIVE)
    assert lin.kernel_fmt == NATIVE.TILED_FORMAT_BASE + fmt and lin.data.shape == data.shape
    assert not torch.equal(lin.data, data)  # regrouped
    assert torch.equal(lin.file_layout(), data)
    assert torch.equal(lin.rows(torch.tensor([0, 15, 16, 47, 3])), dequantize(data, fmt, 576)[[0, 15, 16, 47, 3]])


@pytest.mark.parametrize("fmt", AMX_FORMATS, ids=IDS)
@pytest.mark.parametrize("n_out", [16, 48, 96])  # one group, an odd count of groups (a pair with one), pairs
def test_product_matches_dense_and_rows_are_bitwise_independent(fmt, n_out):
    k = 544
    lin = PackedLinear(random_blocks(fmt, n_out, k, seed=fmt + n_out), fmt, k, native=NATIVE)
    assert lin.kernel_fmt != fmt
    n = 150  # up to two tall passes of four 16-row blocks and a remainder
    x = torch.randn(n, k)
    ref = x.double() @ lin.dense().double().T
    out = lin(x)
    # the same bound as the multiply-add kernel's test: a sum of exact products, in another order
    assert (out.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(n)])
    assert torch.equal(out, alone)
    for m in (1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 40, 48, 63, 64, 65, 79, 96, 128, 129):
        assert torch.equal(lin(x[:m]), alone[:m]), m
        assert torch.equal(lin(x[n - m :]), alone[n - m :]), m


@pytest.mark.parametrize("fmt", AMX_FORMATS, ids=IDS)
@pytest.mark.parametrize("k", [32, 64, 96])  # one, two and three weight blocks per row: the ring's smallest cases
def test_tall_products_of_short_rows_are_the_rows_alone(fmt, k):
    lin = PackedLinear(random_blocks(fmt, 48, k, seed=fmt + k), fmt, k, native=NATIVE)
    x = torch.randn(100, k)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(100)])
    for m in (32, 48, 64, 100):
        assert torch.equal(lin(x[:m]), alone[:m]), m


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(AMX_FORMATS), rows=st.lists(st.integers(0, 19), min_size=1, max_size=80),
       scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_any_row_subset_gives_the_rows_alone(fmt, rows, scale):
    """Row i of any batch of rows (repeats, any order, any magnitude; up to 80 rows: tall calls too) is bitwise row
    i computed alone."""
    lin = PackedLinear(random_blocks(fmt, 32, 256, seed=fmt), fmt, 256, native=NATIVE)
    pool = torch.randn(20, 256, generator=torch.Generator().manual_seed(len(rows))) * scale
    out = lin(pool[rows])
    for j, r in enumerate(rows):
        assert torch.equal(out[j], lin(pool[r : r + 1])[0])


def test_a_lone_product_is_within_fp32_rounding_across_the_range():
    """Values across the fp32 range (0, tiny, huge): with one nonzero activation, each output is d * q * x within
    two roundings (the three bf16 pieces' exact products summed in fp32) -- the pieces lose nothing."""
    n_out, k = 16, 32
    lin = PackedLinear(random_blocks(8, n_out, k, seed=1), 8, k, native=NATIVE)  # Q8_0: w = d * q exactly
    dense = lin.dense()
    values = [0.0, 1.0, -3.1415927, 1.2345678e-7, 6.02e23, -1.0e-30, 0.1 + 2 ** -20]
    x = torch.zeros(len(values), k)
    x[:, 5] = torch.tensor(values)
    exact = x.double() @ dense.double().T
    assert ((lin(x).double() - exact).abs() <= exact.abs() * 2.0 ** -22).all()


def test_no_amx_env_keeps_the_multiply_add_kernel(monkeypatch):
    monkeypatch.setenv("FASTFORWARD_NO_AMX", "1")
    data = random_blocks(3, 32, 64)
    lin = PackedLinear(data, 3, 64, native=NATIVE)
    assert lin.kernel_fmt == 3


def test_a_tiled_weight_is_refused_where_it_cannot_be():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        NATIVE.amx_tile_(random_blocks(3, 20, 64), 3, 64)
    with pytest.raises(RuntimeError, match="no tiled layout"):
        NATIVE.amx_tile_(random_blocks(12, 16, 256), 12, 256)
    lin = PackedLinear(random_blocks(3, 16, 64), 3, 64, native=NATIVE)
    with pytest.raises(RuntimeError, match="columns"):
        lin(torch.randn(2, 32))


@pytest.mark.parametrize("fmt", AMX_FORMATS, ids=IDS)
def test_a_draft_linear_takes_the_multiply_add_kernel_for_few_rows_and_amx_for_more(fmt):
    """A drafter's weight is kept in both layouts: up to ``few_rows`` rows go to the multiply-add kernel, more to
    the AMX tiles; either way the product is the dequantised weight's (to fp32 summation order)."""
    from fastforward.linear import DraftLinear

    data = random_blocks(fmt, 48, 96)
    lin = DraftLinear(data.clone(), fmt, 96, native=NATIVE, few_rows=3)
    assert lin.few.kernel_fmt == fmt and lin.many.kernel_fmt == NATIVE.TILED_FORMAT_BASE + fmt
    w = dequantize(data, fmt, 96)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        y = lin(x)
        assert torch.equal(y, (lin.few if rows <= 3 else lin.many)(x))
        assert torch.allclose(y, x @ w.T, atol=1e-4, rtol=1e-5)
    assert lin.nbytes == 2 * data.numel()
