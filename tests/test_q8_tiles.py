"""The q8 products on integer tiles (AMX-INT8): the tile kernel, run on the hardware where this CPU has AMX and on
the C++ emulation of the tile instructions everywhere, is bitwise the reference and the vector kernel, every row
bitwise the row alone, whatever the rows (1-64 and beyond), threads, or output count."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastforward import kernels
from fastforward.arithmetic import BLOCK, Q8_FORMATS, q8_matmul
from fastforward.linear import PackedLinear
from fastforward.testing import random_gguf_blocks

native = kernels.load_native()
pytestmark = pytest.mark.skipif(native is None or not hasattr(native, "q8_mm_path"),
                                reason="the native kernels are unavailable here")
FORMATS = sorted(Q8_FORMATS)
IDS = [Q8_FORMATS[f] for f in FORMATS]
# The tile kernel on this machine's hardware too, where it has AMX-INT8.
PATHS = ["emulated-tiles"] + (["tiles"] if native is not None and native.q8_amx_ready() else [])


def width(fmt: int) -> int:
    return 512 if BLOCK[fmt] == 256 else 544  # 17 blocks of 32


def weight(fmt: int, n_out: int, seed: int = 0):
    data = random_gguf_blocks(fmt, n_out, width(fmt), seed=seed, scale=0.8 if BLOCK[fmt] == 256 else 0.05)
    return data, PackedLinear(data, fmt, width(fmt), native=native, arithmetic="q8")


def product(lin, x, path):
    out = native.q8_mm_path(x, lin.data, lin.kernel_fmt, lin.in_features, path)
    return out[:, : lin.out_features]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_tiles_are_bitwise_the_reference_and_the_vector_kernel(fmt, path):
    """45 outputs: six panels of 8, the last padded (three pairs); 37: five panels, the last one alone."""
    for n_out in (45, 37):
        data, lin = weight(fmt, n_out, seed=fmt + n_out)
        x = torch.randn(23, width(fmt)) * torch.logspace(-3, 1, 23).unsqueeze(1)
        tiles = product(lin, x, path)
        assert torch.equal(tiles, q8_matmul(x, data, fmt, width(fmt)))
        assert torch.equal(tiles, product(lin, x, "vector"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_every_row_of_1_to_70_rows_on_tiles_is_bitwise_the_row_alone(fmt, path):
    _, lin = weight(fmt, 40, seed=fmt)
    x = torch.randn(70, width(fmt))
    alone = torch.cat([product(lin, x[i : i + 1], "vector") for i in range(70)])
    for m in (1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 70):
        assert torch.equal(product(lin, x[:m], path), alone[:m]), m
    assert torch.equal(product(lin, x[13:60], path), alone[13:60])  # rows keep their result wherever they sit


@pytest.mark.parametrize("path", PATHS)
def test_tiles_do_not_depend_on_the_thread_count(path):
    threads = torch.get_num_threads()
    for fmt in (3, 12, 14):
        _, lin = weight(fmt, 88, seed=3)
        x = torch.randn(21, width(fmt))
        try:
            torch.set_num_threads(1)
            one = product(lin, x, path)
            torch.set_num_threads(2)
            two = product(lin, x, path)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)
        assert torch.equal(one, product(lin, x, "vector"))


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(FORMATS), rows=st.integers(1, 64), n_out=st.integers(1, 40), seed=st.integers(0, 2**16),
       log_scale=st.floats(-6, 4))
def test_emulated_tiles_equal_the_reference_on_any_shape(fmt, rows, n_out, seed, log_scale):
    g = torch.Generator().manual_seed(seed)
    data, lin = weight(fmt, n_out, seed=seed)
    x = torch.randn(rows, width(fmt), generator=g) * float(10.0**log_scale)
    tiles = product(lin, x, "emulated-tiles")
    ref = q8_matmul(x, data, fmt, width(fmt))
    nan = ref.isnan()  # huge activations overflow fp16 scales (in llama.cpp too)
    assert torch.equal(tiles.isnan(), nan) and torch.equal(tiles[~nan], ref[~nan])


def test_the_path_of_a_call_is_named_and_bad_paths_are_refused():
    _, lin = weight(2, 16)
    x = torch.randn(3, width(2))
    with pytest.raises(RuntimeError, match="path must be"):
        native.q8_mm_path(x, lin.data, lin.kernel_fmt, lin.in_features, "fast")
    vector = f"q8-{native.q8_dot}"
    if native.q8_amx_ready():
        rows = native.q8_tile_min_rows()
        assert native.q8_kernel_path(1) == (vector if rows != 1 else "q8-amx-int8")
        assert native.q8_kernel_path(64) == ("q8-amx-int8" if 0 < rows <= 64 else vector)
    else:
        assert native.q8_kernel_path(1) == native.q8_kernel_path(64) == vector
        with pytest.raises(RuntimeError, match="no AMX-INT8"):
            native.q8_mm_path(x, lin.data, lin.kernel_fmt, lin.in_features, "tiles")
    assert torch.equal(native.q8_mm_path(x, lin.data, lin.kernel_fmt, lin.in_features, "auto"),
                       native.quant_mm(x, lin.data, lin.kernel_fmt, lin.in_features))
