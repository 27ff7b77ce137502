"""Step observers: what build-tree's calibration and CLLM's trajectory collection record comes from the steps."""

from __future__ import annotations

import fastforward as ff
from fastforward.proposers.jacobi import JacobiProposer, JacobiTrajectories


def test_observers_see_every_step_the_proposer_observes_and_the_last(tiny):
    seen = []
    result = ff.generate(tiny, [3, 4, 5], "pld", max_new_tokens=20, observers=[lambda state, step: seen.append(
        (state.generated, len(step.new_tokens)))])
    assert len(seen) == result.stats.target_forwards - 1  # every verification forward, the final one included
    assert seen[-1][0] == len(result.token_ids)


def test_trajectory_observer_equals_the_proposer_option(tiny):
    prompt = [3, 4, 5, 6, 7, 8, 3, 4]
    recorder = JacobiTrajectories()
    prop = JacobiProposer(n_tokens=5, record_trajectory=True)
    result = ff.generate(tiny, prompt, prop, max_new_tokens=43, seed=2, observers=[recorder])
    # the engine's observer also sees the final forward, which proposers never observe: at most one block more
    assert recorder.trajectories[: len(prop.trajectories)] == prop.trajectories
    assert len(recorder.trajectories) - len(prop.trajectories) in (0, 1)
    out = prompt + result.token_ids
    for traj in recorder.trajectories:
        p = traj["prefix_length"]
        assert traj["states"][-1] == traj["fixed_point"] == out[p : p + 5]
