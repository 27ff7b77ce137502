"""Per-target resource slots: built once, kept for the target's life, never handed to another target."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import pytest

from fastforward.costs import CostCurve, CostModel, cost_model, set_cost_model
from fastforward.model import TargetModel
from fastforward.model.slots import shared
from fastforward.proposers._feature_drafter import shared_runner


class Resource:
    """Something a build makes (weakly referenceable, so a test can see it go)."""


def bare_target() -> TargetModel:
    """A TargetModel with nothing loaded: enough to hold resources."""
    return TargetModel.__new__(TargetModel)


def test_a_resource_is_built_once_per_key_and_replaced_on_request():
    target = bare_target()
    built = []

    def build():
        built.append(Resource())
        return built[-1]

    first = target.shared("a", build)
    assert target.shared("a", build) is first and len(built) == 1
    other = target.shared(("b", 1), build)
    assert other is not first and len(built) == 2
    assert target.set_shared("a", None) is first  # emptied: the next ask builds again
    assert target.shared("a", build) is built[-1] and len(built) == 3
    replacement = Resource()
    assert target.set_shared("a", replacement) is built[-1] and target.shared("a", build) is replacement


def test_a_failed_build_leaves_the_slot_empty():
    target = bare_target()

    def broken():
        raise ValueError("no")

    with pytest.raises(ValueError):
        target.shared("x", broken)
    assert target.shared("x", Resource) is not None


def test_threads_asking_together_build_once():
    target = bare_target()
    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.05)
        return Resource()

    got = []
    threads = [threading.Thread(target=lambda: got.append(target.shared("slow", slow_build))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in got}) == 1


def test_a_new_target_never_gets_an_old_ones_runner(tmp_path):
    """A runner lives as long as its target, and a target made later -- even at the freed one's address, so with
    its id -- builds its own."""
    built = []

    def build(folder):
        built.append(Resource())
        return built[-1]

    old = bare_target()
    runner = shared_runner("eagle", "eagle3", old, str(tmp_path), "fp32", build)
    assert shared_runner("eagle", "eagle3", old, str(tmp_path), "fp32", build) is runner  # once per target
    old_id, gone = id(old), weakref.ref(runner)
    del old, runner
    built.clear()
    kept, new = [], bare_target()
    for _ in range(1000):  # CPython hands a freed object's memory to a later one of its size: look for it
        if id(new) == old_id:
            break  # (a registry keyed by id(target) handed this one the dead target's runner)
        kept.append(new)
        new = bare_target()
    gc.collect()
    assert gone() is None  # the runner went with its target
    fresh = shared_runner("eagle", "eagle3", new, str(tmp_path), "fp32", build)
    assert len(built) == 1 and fresh is built[0]  # built for the new target, whatever its id


def test_copies_share_resources_and_deep_copies_do_not():
    target = bare_target()
    resource = target.shared("r", Resource)
    assert copy.copy(target).shared("r", Resource) is resource
    assert copy.deepcopy(target).shared("r", Resource) is not resource


def test_an_object_that_cannot_hold_resources_builds_every_time():
    assert shared(3, "k", Resource) is not shared(3, "k", Resource)


def test_the_cost_model_lives_in_the_targets_slot():
    target = bare_target()
    model = CostModel(CostCurve.flat(), learn=False)
    assert set_cost_model(target, model) is None
    assert target.shared("cost model", CostModel) is model and cost_model(target) is model
    assert set_cost_model(target, None) is model
