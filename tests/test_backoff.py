"""The drafters' back-off: which steps look, never what is decoded (the methods' own tests check the output)."""

import torch

from fastforward.proposers._backoff import BackOff

CURVE = torch.tensor([6.0, 7.5, 9.0, 10.5])  # t(1..4) ms


def _draft(back_off: BackOff, nodes: int, look_ms: float) -> None:
    back_off.looking()
    back_off._look_start -= look_ms / 1e3  # as if the look took look_ms
    back_off.drafted(nodes)


def _skipped(back_off: BackOff) -> int:
    n = 0
    while back_off.skipping():
        n += 1
    return n


def test_empty_looks_back_off_doubling_up_to_the_limit():
    b = BackOff(8)
    skips = []
    for _ in range(6):
        b.drafted_nothing()
        skips.append(_skipped(b))
    assert skips == [1, 2, 4, 8, 8, 8]
    assert _skipped(BackOff(0)) == 0


def test_a_draft_that_paid_resets_and_one_that_lost_backs_off():
    b = BackOff(8)
    b.drafted_nothing()
    b.drafted_nothing()
    assert _skipped(b) == 2
    # 2 nodes, 1 ms look: cost 1 + (7.5 - 6) = 2.5 ms; one accepted token saves 6 ms -> paid, reset
    _draft(b, 2, 1.0)
    b.verdict(1, CURVE)
    assert b.idle == 0 and _skipped(b) == 0
    # the same draft rejected: it lost 2.5 ms -> backs off like an empty look
    _draft(b, 2, 1.0)
    b.verdict(0, CURVE)
    assert _skipped(b) == 1
    # 4 nodes, a 10 ms look: cost 14.5 ms; 2 accepted tokens save 12 ms -> lost
    _draft(b, 4, 10.0)
    b.verdict(2, CURVE)
    assert _skipped(b) == 2
    # a verdict without an open draft (a step that did not look) changes nothing
    b.verdict(0, CURVE)
    assert _skipped(b) == 0


def test_without_on_loss_any_draft_resets():
    b = BackOff(8, on_loss=False)
    b.drafted_nothing()
    assert _skipped(b) == 1
    _draft(b, 4, 10.0)
    b.verdict(0, CURVE)
    assert b.idle == 0 and _skipped(b) == 0
