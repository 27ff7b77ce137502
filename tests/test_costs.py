import json
import time

import pytest
import torch

import fastforward as ff
from fastforward import costs, engine
from fastforward.costs import (
    CURVE_QS,
    AcceptanceEstimate,
    CostCurve,
    CostModel,
    LoadReading,
    best_chain_length,
    cost_model,
    curve_path,
    expected_tokens,
    machine_cost_curve,
    row_bucket,
    set_cost_model,
)
from fastforward.testing import tiny_target


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


def test_a_chain_in_a_shared_forward_pays_for_every_sequence_of_it():
    """With 7 other sequences in the forward a draft row must be far likelier than alone (on the Zen 4 EPYC's q8
    curve: alone a 0.45 agreement drafts, beside 7 others it does not; 0.95 still does), and the chosen k is the
    argmax of the whole forward's tokens per millisecond."""
    zen4 = CostCurve({1: 5.1, 2: 5.6, 4: 6.5, 8: 8.6, 16: 14.4})
    assert best_chain_length(0.45, 10, zen4) > 0
    assert best_chain_length(0.45, 10, zen4, others=7) == 0
    k = best_chain_length(0.95, 10, zen4, others=7)
    assert k > 0
    rates = [(7 + expected_tokens(0.95, j)) / zen4.t(8 + j) for j in range(11)]
    assert rates[k] == max(rates)
    assert best_chain_length(0.6, 10, zen4, others=0) == best_chain_length(0.6, 10, zen4)


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


# ----------------------------------------------------------------------------------------------------------------
# The live model
# ----------------------------------------------------------------------------------------------------------------

AFFINE = CostCurve({1: 10.0, 64: 10.0 + 2.5 * 63})  # a CPU's: 10 ms, 2.5 ms per extra row


def observed(model: CostModel, curve: CostCurve, qs, rounds: int = 3) -> CostModel:
    for _ in range(rounds):
        for q in qs:
            model.observe(q, curve.t(q) / 1e3)
    return model


def test_an_observed_q_costs_the_median_of_its_recent_timings():
    model = CostModel(CostCurve({1: 10.0, 32: 50.0}))
    for ms in (12.0, 12.5, 120.0, 11.5, 12.2):  # one forward slowed tenfold by something else
        model.observe(1, ms / 1e3)
    assert model.t(1) == pytest.approx(12.2)
    for _ in range(CostModel.WINDOW):
        model.observe(1, 0.020)
    assert model.t(1) == pytest.approx(20.0)  # only the last WINDOW timings count: it follows a drift


@pytest.mark.parametrize("factor", [0.7, 1.6, 1 / 30])
def test_a_prior_wrong_everywhere_is_corrected_by_a_few_steps_at_small_q(factor):
    """Observed only at q = 1..3, three times each: every q, 1 to 32, is then within 2% of the truth -- by the
    observed/prior ratio for a prior of the right shape (0.7x, 1.6x: trusted), from the observations' own line for
    one far off (30x too cheap: its shape is not trusted)."""
    prior = CostCurve({q: AFFINE.t(q) / factor for q in CURVE_QS})
    model = observed(CostModel(prior), AFFINE, (1, 2, 3))
    assert model.trusted == (factor > 0.5)
    for q in range(1, 33):
        assert model.t(q) == pytest.approx(AFFINE.t(q), rel=0.02), q


def test_a_flat_300_ms_prior_is_corrected_from_two_observed_q():
    """A curve measured under load (flat, 300 ms): after q = 1 and q = 11 were seen three times each, the model
    reads the truth everywhere; seen at one q alone, it guesses the steepest plausible line (t(1) = t(q)/q), which
    makes the proposers try small drafts -- and so shows them the small q."""
    model = CostModel(CostCurve({q: 300.0 for q in CURVE_QS}))
    observed(model, AFFINE, (11,))
    assert not model.trusted and model.t(1) == pytest.approx(AFFINE.t(11) / 11)
    assert best_chain_length(0.9, 10, model) < best_chain_length(0.9, 10, model.prior) == 10
    observed(model, AFFINE, (1,))
    for q in (1, 2, 5, 11, 16, 32):
        assert model.t(q) == pytest.approx(AFFINE.t(q), rel=1e-6), q


def test_the_level_corrects_the_prior_before_any_q_has_enough_timings():
    prior = CostCurve({q: AFFINE.t(q) * 1.5 for q in CURVE_QS})
    model = CostModel(prior)
    for q in (1, 2, 4):  # one timing each: no anchor yet, but the level (1/1.5) is known
        model.observe(q, AFFINE.t(q) / 1e3)
    assert model.t(8) == pytest.approx(AFFINE.t(8))


def test_a_pinned_model_ignores_timings_and_tables_are_kept_until_the_estimate_moves():
    pinned = CostModel(AFFINE, learn=False)
    observed(pinned, CostCurve({1: 1.0, 64: 1.0}), (1, 2))
    assert pinned.t(2) == AFFINE.t(2) and pinned.forwards == 0
    model = observed(CostModel(AFFINE), AFFINE, (1, 2))
    table = model.table(8)
    assert model.table(8) is table and table.tolist() == pytest.approx([AFFINE.t(q) for q in range(1, 9)])
    assert model.table(8, numpy=True).tolist() == table.tolist()
    for _ in range(3):
        model.observe(1, AFFINE.t(1) * 1.01 / 1e3)  # within the tolerance: the same snapshot
    assert model.table(8) is table
    for _ in range(CostModel.WINDOW):
        model.observe(1, AFFINE.t(1) * 1.2 / 1e3)
    assert model.table(8) is not table and model.table(8)[0] == pytest.approx(AFFINE.t(1) * 1.2)


def test_an_update_is_constant_work():
    """Memory and work per forward do not grow with the generation: bounded windows, bucketed row counts, and an
    update of a few microseconds (generous bound for a busy machine)."""
    model = CostModel(AFFINE)
    n = 20_000
    t0 = time.perf_counter()
    for i in range(n):
        model.observe(1 + i % 700, 0.01)
    per_update = (time.perf_counter() - t0) / n
    assert per_update < 100e-6
    assert len(model._windows) <= 64 + 8 * 4 and all(len(w) <= CostModel.WINDOW for w in model._windows.values())
    assert [row_bucket(r) for r in (1, 64, 65, 70, 101, 700)] == [1, 64, 64, 72, 104, 704]


# ----------------------------------------------------------------------------------------------------------------
# The prior on disk: measured quietly, cached, replaced when contradicted
# ----------------------------------------------------------------------------------------------------------------


class StubMeter:
    """A LoadMeter whose reading is fixed: ``wait_share`` of the threads' time waiting for a CPU."""

    wait_share = 0.0

    def __init__(self, threads=None):
        self.reading = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reading = LoadReading(1.0, 1.0, self.wait_share, 1)


@pytest.fixture
def quiet(monkeypatch):
    """Every measurement reads as quiet, whatever else runs on the machine."""
    monkeypatch.setattr(costs, "LoadMeter", StubMeter)


@pytest.fixture
def fresh():
    """A tiny target with no cost model yet (no timings of other tests)."""
    return tiny_target()


def test_machine_cost_curve_cached(fresh, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    curve = machine_cost_curve(fresh)
    assert curve.t(1) > 0 and curve.t(32) >= curve.t(1)
    files = list((tmp_path / "costs").glob("*.json"))
    assert files == [curve_path(fresh)]
    set_cost_model(fresh, None)
    again = machine_cost_curve(fresh)  # read back from disk, not re-measured
    assert again.ms == curve.ms and cost_model(fresh).prior is again


def test_a_curve_distorted_by_load_is_neither_trusted_nor_cached(fresh, tmp_path, monkeypatch, quiet):
    assert costs.plausible_curve({1: 10.0, 2: 14.0, 4: 17.0, 8: 26.0})
    assert not costs.plausible_curve({1: 66.8, 2: 141.1, 4: 338.2, 8: 339.0})  # 4 tokens at 5.1x one: load
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    path = curve_path(fresh)
    path.parent.mkdir(parents=True)
    path.write_text('{"ms": {"1": 66.8, "2": 141.1, "4": 338.2}, "kv": 256}')
    calls = []

    def measure(target, qs, kv, repeats):  # every attempt distorted: the fastest of each q is kept, nothing cached
        calls.append(1)
        return {1: 10.0, 2: 30.0 - len(calls), 4: 60.0}

    monkeypatch.setattr(costs, "measure_forward_costs", measure)
    curve = machine_cost_curve(fresh)
    assert len(calls) == costs.CURVE_ATTEMPTS and curve.ms[2] == 30.0 - costs.CURVE_ATTEMPTS  # the fastest seen
    assert "66.8" in path.read_text()  # the distorted file was not replaced by another distorted curve
    set_cost_model(fresh, None)
    monkeypatch.setattr(costs, "measure_forward_costs", lambda target, qs, kv, repeats: {1: 10.0, 2: 13.0, 4: 17.0})
    assert machine_cost_curve(fresh).ms[2] == 13.0 and '"2": 13.0' in path.read_text()


def test_a_curve_measured_under_load_is_used_but_never_stored(fresh, tmp_path, monkeypatch, capsys):
    """Every attempt's threads waited for a CPU 40% of their time: the run gets the fastest of them, the cache
    nothing. Once an attempt runs quietly, its curve alone is stored (not mixed with the loaded ones)."""
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    monkeypatch.setattr(StubMeter, "wait_share", 0.4)
    monkeypatch.setattr(costs, "LoadMeter", StubMeter)
    calls = []

    def measure(target, qs, kv, repeats):
        calls.append(1)
        return {1: 40.0 - len(calls), 2: 50.0, 4: 60.0}

    monkeypatch.setattr(costs, "measure_forward_costs", measure)
    curve = machine_cost_curve(fresh)
    assert len(calls) == costs.CURVE_ATTEMPTS and curve.ms[1] == 40.0 - costs.CURVE_ATTEMPTS
    assert not curve_path(fresh).exists() and "measured under other load" in capsys.readouterr().err
    set_cost_model(fresh, None)
    readings = iter([0.4, 0.0])  # the first attempt loaded, the second quiet

    class Meter(StubMeter):
        def __exit__(self, *exc):
            self.reading = LoadReading(1.0, 1.0, next(readings), 1)

    monkeypatch.setattr(costs, "LoadMeter", Meter)
    calls.clear()
    machine_cost_curve(fresh)
    assert len(calls) == 2 and json.loads(curve_path(fresh).read_text())["ms"]["1"] == 38.0


def test_the_load_rule():
    assert not LoadReading(wall=1.0, cpu=2.0, wait=0.1, threads=2).loaded  # waited 5% of the time
    assert LoadReading(wall=1.0, cpu=1.0, wait=0.9, threads=2).loaded  # 45%
    assert LoadReading(wall=1.0, cpu=0.8, wait=None, threads=2).loaded  # no schedstat: 40% of the CPU time
    assert not LoadReading(wall=1.0, cpu=1.9, wait=None, threads=2).loaded
    with costs.LoadMeter(threads=1) as meter:
        sum(i * i for i in range(200_000))
    reading = meter.reading
    assert reading.wall > 0 and reading.cpu > 0 and (reading.wait is None or reading.wait >= 0)


def test_a_new_kernel_build_does_not_reuse_the_old_builds_curve(tiny, tmp_path, monkeypatch):
    from fastforward import kernels

    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "build_digest", lambda: "aaaa")
    before = curve_path(tiny)
    monkeypatch.setattr(kernels, "build_digest", lambda: "bbbb")
    assert curve_path(tiny) != before


def test_each_kv_cache_precision_has_its_own_curve(tmp_path, monkeypatch):
    """An fp16 cache reads half the bytes, so its curve is another curve."""
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    target = tiny_target(dtype=torch.float32)
    before = curve_path(target)
    target.backend.kv_precision = "fp16"
    assert curve_path(target) != before


def write_curve(target, ms: dict) -> str:
    path = curve_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"ms": ms, "kv": 256})
    path.write_text(text)
    return text


def test_a_cached_curve_that_live_timings_contradict_is_removed(fresh, tmp_path, monkeypatch, capsys):
    """The cached t(1) is ten times what the forwards take: after a full window of timings the file goes (the next
    process measures again); before that, and for a file measured again meanwhile, nothing is removed."""
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    write_curve(fresh, {q: 10.0 * AFFINE.t(q) for q in CURVE_QS})
    model = cost_model(fresh)
    for i in range(CostModel.LEVEL_WINDOW - 1):
        model.observe(1 + i % 3, AFFINE.t(1 + i % 3) / 1e3)
    assert curve_path(fresh).is_file() and not model.contradicted
    model.observe(1, AFFINE.t(1) / 1e3)
    assert model.contradicted and not curve_path(fresh).exists()
    assert "contradict the cached cost curve" in capsys.readouterr().err
    assert model.t(1) == pytest.approx(AFFINE.t(1))  # the run goes on with its live estimate

    set_cost_model(fresh, None)
    write_curve(fresh, {q: 10.0 * AFFINE.t(q) for q in CURVE_QS})
    model = cost_model(fresh)
    newer = write_curve(fresh, {q: AFFINE.t(q) for q in CURVE_QS})  # another process measured it meanwhile
    observed(model, AFFINE, (1, 2, 3, 4), rounds=4)
    assert model.contradicted and curve_path(fresh).read_text() == newer


def test_forwards_slower_than_the_cache_follow_live_timings_and_keep_the_file(fresh, tmp_path, monkeypatch):
    """Forwards three times slower than the cached curve (a busy moment, a long cache) are followed live, but say
    nothing against a curve measured quietly: the file stays."""
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    write_curve(fresh, {q: AFFINE.t(q) / 3 for q in CURVE_QS})
    model = observed(cost_model(fresh), AFFINE, (1, 2, 3, 4), rounds=8)
    assert not model.trusted and not model.contradicted and curve_path(fresh).is_file()
    assert model.t(1) == pytest.approx(AFFINE.t(1))


def test_timings_agreeing_with_the_cache_leave_it_alone(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    write_curve(fresh, {q: 1.3 * AFFINE.t(q) for q in CURVE_QS})  # 30% off: load of the moment, not a wrong cache
    model = observed(cost_model(fresh), AFFINE, (1, 2, 3, 4), rounds=8)
    assert model.trusted and not model.contradicted and curve_path(fresh).is_file()


# ----------------------------------------------------------------------------------------------------------------
# Through the engine
# ----------------------------------------------------------------------------------------------------------------


def test_every_verification_forward_reaches_the_cost_model(fresh):
    out = ff.generate(fresh, [5, 6, 7, 8] * 4, "ar", max_new_tokens=12)
    model = costs._model_of(fresh)
    assert model.forwards == out.stats.target_forwards - 1  # every step; not the prompt's forward
    assert set(model._windows) == {1}


def test_the_first_measurement_is_not_drafting_time(fresh, monkeypatch, quiet):
    """A first pld run measures the curve (here a stand-in taking 1.5 s) before its clock starts: neither its
    drafting time nor its wall time holds the measurement."""

    def slow_measurement(target, qs, kv, repeats):
        time.sleep(1.5)
        return {q: 1.0 + 0.1 * q for q in qs}

    monkeypatch.setattr(costs, "measure_forward_costs", slow_measurement)
    out = ff.generate(fresh, [5, 6, 7, 8] * 4, "pld", max_new_tokens=16)
    assert curve_path(fresh).is_file()  # it was measured (and stored) by this run
    assert out.stats.draft_time < 0.75 and out.stats.wall_time < 0.75


def test_the_batch_draft_budget_reads_the_live_model(packed):
    assert engine.draft_budget_for(packed, 64).curve is cost_model(packed)


class FakeClock:
    """A clock that moves only when a forward runs, by what the true curve says it costs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_wrong_cached_curve_gives_way_to_live_timings_within_32_steps(default_model, tmp_path, monkeypatch,
                                                                        request):
    """Acceptance: a deliberately wrong cached curve (flat at 300 ms) whose draft lengths follow live timings
    within 32 steps. The default model counts (a repetitive answer: pld finds a match nearly every step); the
    forwards' times come from a deterministic clock (t(q) = 10 ms + 2.5 ms per extra row, a CPU's), so the test
    cannot flake on a busy machine. From the 32nd forward on, every draft length pld chooses is within one of what
    it would choose on the true timings (with the same acceptance estimate and match); on the cached curve alone
    it would draft every match whole."""
    from fastforward.proposers import pld

    target = default_model
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    previous = set_cost_model(target, CostModel())  # no timings of other tests: the prior comes from disk
    request.addfinalizer(lambda: set_cost_model(target, previous))
    write_curve(target, {q: 300.0 for q in CURVE_QS})
    clock = FakeClock()
    monkeypatch.setattr(engine, "forward_clock", clock)
    forward_many = target.forward_many

    def timed_forward_many(requests, hidden_layers=()):
        clock.now += AFFINE.t(sum(r.size for r in requests)) / 1e3
        return forward_many(requests, hidden_layers)

    monkeypatch.setattr(target, "forward_many", timed_forward_many)
    choices = []  # (forwards so far, chosen k, k on the true timings, k on the cached curve)
    choose = pld.best_chain_length

    def recording(alpha, max_k, curve):
        k = choose(alpha, max_k, curve)
        model = costs._model_of(target)
        choices.append((model.forwards, k, choose(alpha, max_k, AFFINE), choose(alpha, max_k, model.prior)))
        return k

    monkeypatch.setattr(pld, "best_chain_length", recording)
    out = ff.generate(target, "Count from 1 to 60, separated by commas.", "pld", max_new_tokens=160)
    late = [c for c in choices if c[0] >= 32]
    assert len(late) >= 8 and out.stats.target_forwards > 40
    assert all(abs(k - ideal) <= 1 for _, k, ideal, _ in late), late
    assert any(abs(k - ideal) > 1 for _, k, ideal, _ in choices[:4])  # it starts from the wrong curve
    assert any(abs(cached - ideal) > 1 for _, _, ideal, cached in late)  # the cached curve alone would not follow
