import pytest

from fastforward.costs import AcceptanceEstimate, CostCurve, best_chain_length, expected_tokens, machine_cost_curve


def test_curve_interpolates_and_is_monotone():
    c = CostCurve({1: 10.0, 4: 16.0, 8: 14.0, 16: 30.0})
    assert c.t(1) == 10 and c.t(2) == pytest.approx(12.0)
    assert c.t(8) == 16.0  # the noisy dip below t(4) is flattened
    assert c.t(12) == pytest.approx(23.0)
    assert c.t(32) == pytest.approx(30.0 + 14 / 8 * 16)  # extrapolates with the last slope
    assert c.ratio(16) == pytest.approx(3.0)


def test_expected_tokens_geometric():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_chain_length_follows_cost():
    flat = CostCurve.flat()
    assert best_chain_length(0.5, 10, flat) == 10  # free drafts: draft everything
    steep = CostCurve({1: 1.0, 2: 2.0, 32: 32.0})  # every token costs a full step: never draft
    assert best_chain_length(0.9, 10, steep) == 0
    cpu = CostCurve({1: 28.0, 2: 33.0, 4: 38.0, 8: 46.0, 16: 60.0})
    k_low, k_high = best_chain_length(0.3, 10, cpu), best_chain_length(0.9, 10, cpu)
    assert k_low < k_high
    # the chosen k really is the argmax of tokens per unit cost
    rates = [expected_tokens(0.9, k) / cpu.ratio(k + 1) for k in range(11)]
    assert rates[k_high] == max(rates)


def test_acceptance_estimate_learns_and_forgets():
    est = AcceptanceEstimate(prior=0.7, strength=2.0, decay=0.5)
    assert est.alpha == pytest.approx(0.7)
    for _ in range(5):
        est.update(proposed=4, accepted=0)
    assert est.alpha < 0.3
    low = est.alpha
    for _ in range(20):
        est.tick()
    assert est.alpha > low and est.alpha == pytest.approx(0.7, abs=0.01)  # drifts back: probed again later


def test_machine_cost_curve_cached(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny, "_cost_curve", None, raising=False)
    curve = machine_cost_curve(tiny)
    assert curve.t(1) > 0 and curve.t(32) >= curve.t(1)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    tiny._cost_curve = None
    again = machine_cost_curve(tiny)  # read back from disk, not re-measured
    assert again.ms == curve.ms


def test_a_curve_distorted_by_load_is_neither_trusted_nor_cached(tiny, tmp_path, monkeypatch):
    from fastforward import costs

    assert costs.plausible_curve({1: 10.0, 2: 14.0, 4: 17.0, 8: 26.0})
    assert not costs.plausible_curve({1: 66.8, 2: 141.1, 4: 338.2, 8: 339.0})  # 4 tokens at 5.1x one: load
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny, "_cost_curve", None, raising=False)
    path = costs._curve_path(tiny)
    path.parent.mkdir(parents=True)
    path.write_text('{"ms": {"1": 66.8, "2": 141.1, "4": 338.2}, "kv": 256}')
    calls = []

    def measure(target, qs, kv, repeats):  # every attempt distorted: the fastest of each q is kept, nothing cached
        calls.append(1)
        return {1: 10.0, 2: 30.0 - len(calls), 4: 60.0}

    monkeypatch.setattr(costs, "measure_forward_costs", measure)
    curve = costs.machine_cost_curve(tiny)
    assert len(calls) == costs.CURVE_ATTEMPTS and curve.ms[2] == 30.0 - costs.CURVE_ATTEMPTS  # the fastest seen
    assert "66.8" in path.read_text()  # the distorted file was not replaced by another distorted curve
    tiny._cost_curve = None
    monkeypatch.setattr(costs, "measure_forward_costs", lambda target, qs, kv, repeats: {1: 10.0, 2: 13.0, 4: 17.0})
    assert costs.machine_cost_curve(tiny).ms[2] == 13.0 and '"2": 13.0' in path.read_text()


def test_a_new_kernel_build_does_not_reuse_the_old_builds_curve(tiny, tmp_path, monkeypatch):
    from fastforward import costs, kernels

    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "build_digest", lambda: "aaaa")
    before = costs._curve_path(tiny)
    monkeypatch.setattr(kernels, "build_digest", lambda: "bbbb")
    assert costs._curve_path(tiny) != before
