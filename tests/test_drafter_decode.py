"""What the trained drafters' decode-time runners share (fastforward/drafters/pieces.py): the top-k of draft-vocabulary
rows, and the drafter weights on the native integer kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_helpers import native_or_skip

from fastforward.drafters.pieces import DrafterLinear, decode_linear_factory, top_k_rows
from fastforward.linear import DenseLinear


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), blocks=st.integers(1, 12), block=st.sampled_from([1, 64, 512, 2048]),
       extra=st.integers(0, 3),
       k=st.integers(1, 6), levels=st.sampled_from([3, 50, 10**6]), seed=st.integers(0, 2**31 - 1))
def test_top_k_rows_finds_topk_values(rows, blocks, block, extra, k, levels, seed):
    """The k largest values of every row, best first, and columns holding them -- whatever the block size, the
    number of blocks (fewer than k included), a width that is no multiple of it, rows small enough for plain
    ``topk``, and ties (``levels`` distinct values: many ties at 3)."""
    g = torch.Generator().manual_seed(seed)
    V = blocks * block + extra
    k = min(k, V)
    x = torch.randint(0, levels, (rows, V), generator=g).float() / levels
    values, cols = top_k_rows(x, k, block=block)
    want = x.topk(k, dim=-1).values
    assert torch.equal(values, want) and torch.equal(x.gather(1, cols), values)
    assert all(len(set(r)) == k for r in cols.tolist())  # k distinct columns per row


def test_top_k_rows_of_a_draft_vocabulary_row():
    x = torch.randn(5, 16384, generator=torch.Generator().manual_seed(0))
    values, cols = top_k_rows(x, 4)
    want = x.topk(4, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(cols, want.indices)  # no ties: the same columns


def _native():
    return native_or_skip("log_softmax_topk")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), V=st.integers(1, 300), k=st.integers(1, 16), levels=st.sampled_from([2, 7, 10**6]),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_native_log_softmax_topk_is_the_top_k_of_the_log_softmax(rows, V, k, levels, scale, seed):
    """The native top-k of a head's log-softmax: the k largest values of ``log_softmax`` (to fp32 rounding: its
    exp is the kernels' own), best first, equal values by ascending column -- any width (tails of 1-7 columns
    included), ties, k up to the width."""
    native = _native()
    g = torch.Generator().manual_seed(seed)
    k = min(k, V)
    x = (torch.randint(0, levels, (rows, V), generator=g).float() / levels - 0.5) * scale
    values, cols = native.log_softmax_topk(x, k)
    want = x.double().log_softmax(-1)
    top = x.topk(k, dim=-1).values
    assert torch.equal(x.gather(1, cols), top)  # the k largest, best first
    assert torch.allclose(values.double(), want.gather(1, cols), atol=1e-5, rtol=1e-5)
    for r in range(rows):  # equal values: the lower column first; k distinct columns
        pairs = list(zip((-x[r, cols[r]]).tolist(), cols[r].tolist(), strict=True))
        assert pairs == sorted(pairs) and len(set(cols[r].tolist())) == k


def test_native_log_softmax_topk_of_draft_vocabulary_rows():
    """16,384 columns (the shipped drafter's head): the same columns as ``topk`` of ``log_softmax``, values to
    fp32 rounding; a NaN never enters; a bad k is refused in one line."""
    native = _native()
    x = torch.randn(4, 16384, generator=torch.Generator().manual_seed(1)) * 4
    x[2, 5] = float("nan")
    values, cols = native.log_softmax_topk(x, 8)
    finite = x.clone()
    finite[2, 5] = -float("inf")
    want = finite.topk(8, dim=-1)
    assert torch.equal(cols, want.indices)
    ref = x[[0, 1, 3]].log_softmax(-1).gather(1, cols[[0, 1, 3]])
    assert torch.allclose(values[[0, 1, 3]], ref, atol=1e-5)
    with pytest.raises(RuntimeError, match="k must be in"):
        native.log_softmax_topk(x, 0)


@pytest.mark.parametrize("weights", ["auto", "q4_0", "q8_0"])
def test_packed_drafter_weights_run_on_the_integer_kernel(weights):
    """A packed drafter weight is multiplied by the integer (q8) kernel: close to the fp32 product of its rounded
    weights (activations rounded to 8 bits), each row what it is alone."""
    linear = decode_linear_factory(weights)
    if linear.layer_ops is None:
        pytest.skip("the native kernels did not build on this machine")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=g) * 0.05
    lin = linear(w)
    assert isinstance(lin, DrafterLinear) and lin.few.arithmetic == "q8"
    assert lin.format_name == ("Q8_0" if weights == "q8_0" else "Q4_0")
    x = torch.randn(5, 96, generator=g)
    y = lin(x)
    ref = x @ lin.dense().T
    assert float((y - ref).abs().max()) < 0.02 * float(ref.abs().max())
    assert torch.equal(lin(x[2:3]), y[2:3])  # rows of the integer kernel are independent of the call's other rows
    assert lin.for_rows(1) is lin.few


def test_fp32_drafter_weights_stay_dense():
    w = torch.randn(16, 64)
    lin = decode_linear_factory("fp32")(w)
    assert isinstance(lin, DenseLinear) and torch.equal(lin.dense(), w)


@settings(max_examples=40, deadline=None)
@given(entries=st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=5),
       n_taps=st.integers(1, 3), d=st.sampled_from([1, 8, 24]), double=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_native_gather_of_waiting_rows_is_torchs(entries, n_taps, d, double, seed):
    """``gather_tap_rows`` -- a feature drafter's waiting rows in one native call -- equals the torch indexing it
    replaces: each entry's rows (a prefix as a range, or any rows as a list) of its taps side by side, the entries
    one after another, in the sources' dtype; a row out of range is refused."""
    native = native_or_skip("gather_tap_rows")
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    sources, rows = [], []
    for n, prefix in entries:
        sources.append([torch.randn(n, d, generator=g, dtype=dtype) for _ in range(n_taps)])
        r = int(torch.randint(1, n + 1, (1,), generator=g))
        rows.append(range(r) if prefix else torch.randint(0, n, (r,), generator=g).tolist())
    got = native.gather_tap_rows([s for entry in sources for s in entry], rows, n_taps)
    want = torch.cat([torch.cat([s[list(r)] for s in entry], dim=1) for entry, r in zip(sources, rows, strict=True)])
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        native.gather_tap_rows(sources[0], [[entries[0][0]]], n_taps)
