"""The KV cache as a pool of slots: explicit write slots and visibility over slots written earlier.

Two threads of one sequence share a prompt; their tokens interleave in one cache, each seeing the prompt and its
own slots only. Each thread's logits must be those of decoding it alone on a cache of its own -- bitwise on the
native path (each row's attention depends only on its own keys, in order), within float tolerance on torch ops.
"""

from __future__ import annotations

import pytest
import torch

from fastforward.errors import UsageError
from fastforward.model import ForwardRequest
from fastforward.testing import tiny_gguf_target


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    target, _ = tiny_gguf_target(tmp_path_factory.mktemp("pool") / "tiny.gguf", seed=11)
    return target


def _alone(target, prefix, thread):
    """Logits of every token of ``thread`` decoded one at a time after ``prefix`` on a cache of its own."""
    cache = target.new_cache(64)
    target.forward(torch.tensor(prefix), torch.arange(len(prefix)), cache, last_only=True)
    cache.keep(range(len(prefix)))
    rows = []
    for t in thread:
        out = target.forward(torch.tensor([t]), torch.tensor([cache.length]), cache)
        cache.keep([0])
        rows.append(out.logits[0])
    return torch.stack(rows)


def _interleaved(target, prefix, a, b):
    """Threads a and b (equal length) decoded together, one token each per forward, interleaved slots after the
    shared prefix: a's k-th token at slot P+2k, b's at P+2k+1. Returns (a's logits, b's logits)."""
    p = len(prefix)
    cache = target.new_cache(64)
    target.forward(torch.tensor(prefix), torch.arange(p), cache, last_only=True)
    cache.keep(range(p))
    rows_a, rows_b = [], []
    for k in range(len(a)):
        width = 2 * k + 2
        visible = torch.zeros(2, width, dtype=torch.bool)
        visible[0, 0:width:2] = True  # a sees its own slots P, P+2, ..., P+2k
        visible[1, 1:width:2] = True  # b sees P+1, P+3, ..., P+2k+1
        slots = torch.tensor([p + 2 * k, p + 2 * k + 1])
        out = target.forward(torch.tensor([a[k], b[k]]), torch.tensor([p + k, p + k]), cache, visible,
                             write_slots=slots)
        rows_a.append(out.logits[0])
        rows_b.append(out.logits[1])
    return torch.stack(rows_a), torch.stack(rows_b)


def test_threads_in_one_pool_equal_each_thread_alone_native(packed):
    if packed.backend.ops is None:
        pytest.skip("the native layer ops are not available")
    prefix, a, b = [5, 6, 7, 8, 9], [11, 12, 13, 14], [21, 22, 23, 24]
    got_a, got_b = _interleaved(packed, prefix, a, b)
    assert torch.equal(got_a, _alone(packed, prefix, a))
    assert torch.equal(got_b, _alone(packed, prefix, b))


def test_threads_in_one_pool_equal_each_thread_alone_torch_ops(tiny):
    prefix, a, b = [5, 6, 7, 8, 9], [11, 12, 13, 14], [21, 22, 23, 24]
    got_a, got_b = _interleaved(tiny, prefix, a, b)
    torch.testing.assert_close(got_a, _alone(tiny, prefix, a), rtol=0, atol=1e-9)
    torch.testing.assert_close(got_b, _alone(tiny, prefix, b), rtol=0, atol=1e-9)
    # and the threads really differ (the check above could not pass by seeing the wrong slots)
    assert not torch.allclose(got_a, got_b)


def test_pool_requests_in_a_shared_forward(packed):
    """Slot-pool requests of two sequences in one forward_many: each equals its own forward."""
    if packed.backend.ops is None or packed.batch_rows_limit() <= 0:
        pytest.skip("no shared forward")
    caches = []
    for prefix in ([5, 6, 7], [9, 10]):
        cache = packed.new_cache(32)
        packed.forward(torch.tensor(prefix), torch.arange(len(prefix)), cache, last_only=True)
        cache.keep(range(len(prefix)))
        caches.append(cache)
    visible = torch.tensor([[True, False, True]])  # one new token seeing slot start and slot start+2 (itself)
    reqs = [ForwardRequest(torch.tensor([4]), torch.tensor([c.length]), c, visible, torch.tensor([c.length + 2]))
            for c in caches]
    # slot start (seen, never written here) holds whatever was there: zeros in a fresh cache, the same for both
    together = packed.forward_many(reqs)
    for r, out in zip(reqs, together, strict=True):
        alone = packed.forward(r.ids, r.positions, r.cache, r.tree_mask, write_slots=r.write_slots)
        assert torch.equal(out.logits, alone.logits)


@pytest.mark.parametrize(
    ("visible", "slots", "words"),
    [
        (torch.ones(2, 2, dtype=torch.bool), torch.tensor([3, 3]), "distinct"),
        (torch.ones(2, 2, dtype=torch.bool), torch.tensor([1, 4]), "committed length"),
        (torch.ones(2, 80, dtype=torch.bool), None, "capacity"),
        (None, torch.tensor([3, 4]), "tree_mask"),
        (torch.ones(3, 2, dtype=torch.bool), None, "tree_mask"),
    ],
)
def test_bad_slot_requests(tiny, visible, slots, words):
    cache = tiny.new_cache(64)
    tiny.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache)
    cache.keep(range(3))
    with pytest.raises((ValueError, UsageError), match=words):
        tiny.forward(torch.tensor([4, 5]), torch.tensor([3, 4]), cache, visible, write_slots=slots)
