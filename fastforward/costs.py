"""What a target forward costs on this machine, t(q) for q new tokens, and sizing drafts from it.

A verification forward over q tokens costs t(q); drafting pays off only when the tokens it is expected to add per
forward outgrow t(q)/t(1). On GPUs t(q) is nearly flat up to dozens of tokens, so the papers draft generously; on
CPUs it is not, so fastforward sizes drafts from what forwards cost on the machine itself. ``fastforward profile``
prints the curve.

**The cost model** (:class:`CostModel`; one per target, :func:`cost_model`, the one place it is attached) is what
every proposer and the batch draft budget read:

* **The prior**: the curve measured once per machine, model, kernel build, thread count and torch version
  (:func:`measure_forward_costs` over :data:`CURVE_QS` on a :data:`CURVE_KV`-token cache, a few seconds) and cached
  in ``$FASTFORWARD_CACHE/costs/`` (:func:`curve_path`). The engine asks for it before a run's clock starts
  (``Proposer.prepare``), so the measurement is never counted as drafting time.
* **Never stored under load**: each measuring attempt runs inside a :class:`LoadMeter`, which reads how long the
  process's threads waited for a CPU (Linux's run-queue wait, ``/proc/self/task/*/schedstat``). An attempt whose
  threads waited more than :data:`LOADED_WAIT_SHARE` of their time (without schedstat: whose process got less than
  :data:`MIN_CPU_SHARE` of its threads' CPU time) ran under other load; it is taken again, up to
  :data:`CURVE_ATTEMPTS` times. A curve with no quiet attempt behind it, or one that grows faster than linearly
  (:func:`plausible_curve`), is used for the run and not stored.
* **Live timings**: the engine reports every verification forward's wall time and rows (:func:`observe_forward`,
  O(1): a few microseconds). Per row count q the model keeps the last :data:`CostModel.WINDOW` timings; from
  :data:`CostModel.MIN_SAMPLES` on, their median (robust to a stray slow forward) is t(q) -- an *anchor*. The cached
  curve is only the starting prior.
* **Unobserved q**: the prior times the observed/prior ratio of the nearest anchors (interpolated between two,
  the nearest one's beyond them); before any anchor, the prior times the median observed/prior ratio of the last
  forwards (the *level*). When that level is more than :data:`CostModel.TRUST` times off the prior, the prior's
  shape is not trusted either (a curve measured under load is too flat: load inflates one token's forward most), and
  the curve comes from the anchors alone: piecewise linear between them, linear beyond, and below the smallest one
  along the two smallest (never cheaper per token than the smallest: t(1) >= t(q)/q). A prior that is wrong
  everywhere is so corrected after a few forwards at a few q: drafting more than pays shows the large q, a
  pessimistic guess makes the proposers try small ones.
* **A contradicted cache**: once a full window of :data:`CostModel.LEVEL_WINDOW` forwards puts the level below
  1/TRUST (the forwards more than TRUST times faster than the cached curve: it was measured under load), the cached
  file the prior came from is removed (only if it still holds what was read), with a note on stderr; the next
  process that needs the curve measures it again, under the load rule above. Forwards slower than the curve (load of
  the moment, a long cache) leave the file alone. Either way the running process goes on with its live estimate.
* **The cache length** is not a key of the model, by measurement (default model, 2 threads, AMD EPYC with AVX2;
  docs/history.md, "The forward and its kernels"): from a 256- to a 2,048-token cache the attention part lifts t(1) by
  65% and t(16) by 87%, but the ratios that size drafts move less (t(8)/t(1) 2.36 -> 2.52, t(4)/t(1) 1.39 -> 1.62)
  and the draft length pld picks for an acceptance rate of 0.3 ... 0.99 by at most one (two at 0.9). The level
  moves; the window of recent timings per q follows it as the cache grows, at no cost per step.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import kernels
from .errors import UsageError
from .model import _full_mask
from .paths import costs_dir

CURVE_QS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_QS = (1, 2, 4, 8, 16, 32, 64)
CURVE_KV = 256  # the cache length the prior is measured on
CURVE_ATTEMPTS = 3
#: an attempt ran under other load when its threads waited for a CPU more than this share of their time
LOADED_WAIT_SHARE = 0.10
#: without schedstat: an attempt ran under other load when the process got less than this share of its threads' time
MIN_CPU_SHARE = 0.6


@dataclass
class CostCurve:
    """Milliseconds per target forward by number of new tokens q (keys may be ints or their strings, as JSON gives
    them back): piecewise linear between the measured points, monotone in q, the smallest point's cost below it and
    a linear extrapolation from the last two points beyond the largest. The one interpolation of cost curves in the
    package (draft sizing here, tree budgets in :mod:`fastforward.tree_builder`)."""

    ms: dict[int, float]

    def __post_init__(self):
        qs = sorted(int(q) for q in self.ms)
        if not qs:
            raise UsageError("an empty cost curve")
        running = 0.0
        clean = {}
        for q in qs:  # a larger forward never costs less: remove measurement noise that says otherwise
            running = max(running, float(self.ms[q] if q in self.ms else self.ms[str(q)]))
            clean[q] = running
        self.ms = clean
        self._qs = qs

    def t(self, q: float) -> float:
        qs, ms = self._qs, self.ms
        if q <= qs[0]:
            return ms[qs[0]]
        i = bisect.bisect_left(qs, q)
        if i < len(qs):
            lo, hi = qs[i - 1], qs[i]
            return ms[lo] + (ms[hi] - ms[lo]) * (q - lo) / (hi - lo)
        lo, hi = qs[-2:] if len(qs) > 1 else (qs[0], qs[0])
        slope = (ms[hi] - ms[lo]) / (hi - lo) if hi > lo else 0.0
        return ms[hi] + slope * (q - hi)

    def ratio(self, q: float) -> float:
        """t(q) / t(1)."""
        return self.t(q) / self.t(1)

    @classmethod
    def flat(cls) -> CostCurve:
        """An accelerator-like curve (every q costs the same): what the papers' settings assume."""
        return cls({1: 1.0, 64: 1.0})


# ------------------------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------------------------


def _time_forward(target, cache, q: int, kv: int, repeats: int, hf: bool) -> float:
    ids = torch.randint(0, target.vocab_size, (q,))
    pos = torch.arange(kv, kv + q)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        if hf:
            _hf_forward(target, cache, ids, pos)
        else:
            target.forward(ids, pos, cache)
        if i >= 2:  # warm-up excluded
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _hf_forward(target, cache, ids, pos):
    """HF's own forward as users call it (``model(...)`` with a DynamicCache), cropping back after each call."""
    q, kv = ids.numel(), pos[0].item()
    allowed = _full_mask(q, kv, None)
    mask = torch.zeros(1, 1, q, kv + q).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        target.hf_model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, past_key_values=cache,
                        use_cache=True)
    cache.crop(-q)  # transformers 5.x: a negative count of tokens to remove


def _prefilled_cache(target, kv: int, capacity: int, hf: bool):
    ids = torch.randint(0, target.vocab_size, (kv,))
    if hf:
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.inference_mode():
            target.hf_model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        return cache
    cache = target.new_cache(capacity)
    target.forward(ids, torch.arange(kv), cache, last_only=True)
    cache.keep(range(kv))
    return cache


def measure_forward_costs(target, qs=DEFAULT_QS, kv: int = 300, repeats: int = 7, hf: bool = False) -> dict:
    """Median milliseconds of one forward over q new tokens on a kv-token cache, for each q (interleaved sweeps).
    ``hf=True`` times HF's own ``model(...)`` instead of the target's forward."""
    qs = sorted(set(int(q) for q in qs))
    if not qs or qs[0] < 1:
        raise ValueError("q values must be >= 1")
    if kv + qs[-1] > target.max_context:
        raise ValueError(f"kv + q = {kv + qs[-1]} exceeds the model's context {target.max_context}")
    cache = _prefilled_cache(target, kv, kv + qs[-1] + 1, hf)
    samples = {q: [] for q in qs}
    rounds = 3  # interleave q values so slow drifts (thermal, other processes) hit all of them alike
    for _ in range(rounds):
        for q in qs:
            samples[q].append(_time_forward(target, cache, q, kv, max(1, repeats // rounds + 1), hf))
    return {q: statistics.median(v) for q, v in samples.items()}


def plausible_curve(ms: dict) -> bool:
    """False for a curve other load on the machine has distorted: a forward over q tokens costing more than q times
    the one over the fewest (plus 25% and half a millisecond of timer noise) -- a batched forward reads the weights
    once, so its cost grows at most linearly in the tokens."""
    qs = sorted(ms)
    q0 = qs[0]
    return all(ms[q] <= 1.25 * ms[q0] * q / q0 + 0.5 for q in qs[1:])


# ------------------------------------------------------------------------------------------------------------------
# Other load while measuring
# ------------------------------------------------------------------------------------------------------------------


def _run_queue_wait_ns() -> int | None:
    """Nanoseconds this process's threads have waited for a CPU so far (Linux schedstat), None where unknown."""
    total = 0
    try:
        entries = list(os.scandir("/proc/self/task"))
    except OSError:
        return None
    for entry in entries:
        try:
            with open(f"/proc/self/task/{entry.name}/schedstat") as f:
                total += int(f.read().split()[1])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        except (OSError, ValueError, IndexError):
            return None
    return total


@dataclass
class LoadReading:
    """How a block of work shared the CPUs: its wall seconds, the process's CPU seconds, the seconds its threads
    waited for a CPU (None without schedstat) and the threads it was meant to keep busy."""

    wall: float
    cpu: float
    wait: float | None
    threads: int

    @property
    def wait_share(self) -> float | None:
        return None if self.wait is None else self.wait / max(self.wall * self.threads, 1e-9)

    @property
    def cpu_share(self) -> float:
        return self.cpu / max(self.wall * self.threads, 1e-9)

    @property
    def loaded(self) -> bool:
        """Whether other work held the CPUs (the rule of the module docstring)."""
        if self.wait is not None:
            return self.wait_share > LOADED_WAIT_SHARE
        return self.cpu_share < MIN_CPU_SHARE


class LoadMeter:
    """``with LoadMeter() as meter: ...`` then ``meter.reading``: whether other work shared the CPUs meanwhile."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or torch.get_num_threads()
        self.reading: LoadReading | None = None

    def __enter__(self) -> LoadMeter:
        self._start = (time.perf_counter(), time.process_time(), _run_queue_wait_ns())
        return self

    def __exit__(self, *exc) -> None:
        wall0, cpu0, wait0 = self._start
        wait1 = _run_queue_wait_ns()
        wait = None if wait0 is None or wait1 is None else (wait1 - wait0) / 1e9
        self.reading = LoadReading(time.perf_counter() - wall0, time.process_time() - cpu0, wait, self.threads)


# ------------------------------------------------------------------------------------------------------------------
# The live model
# ------------------------------------------------------------------------------------------------------------------


def row_bucket(rows: int) -> int:
    """The q a forward over ``rows`` rows is filed under: exact up to 64, then eight buckets per doubling (a
    server's shared forwards take any size; the model keeps a bounded number of row counts)."""
    if rows <= 64:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return max(64, round(rows / step) * step)


def _median(values) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def _interpolated(qs: list[int], values: list[float], q: int) -> float:
    """``values`` (at sorted ``qs``) at q: linear between the two around it, the nearest one's beyond them."""
    i = bisect.bisect_left(qs, q)
    if i == 0:
        return values[0]
    if i == len(qs):
        return values[-1]
    lo, hi = qs[i - 1], qs[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (q - lo) / (hi - lo)


def _scaled_prior(prior: CostCurve, anchors: dict, level: float | None) -> CostCurve:
    """The prior corrected by the anchors' observed/prior ratios (by the level before any anchor)."""
    if not anchors:
        s = 1.0 if level is None else level
        return CostCurve({q: v * s for q, v in prior.ms.items()})
    qs = sorted(anchors)
    ratios = [anchors[q] / prior.t(q) for q in qs]
    points = {q: prior.t(q) * _interpolated(qs, ratios, q) for q in prior.ms}
    points.update(anchors)
    return CostCurve(points)


def _from_anchors(anchors: dict) -> CostCurve:
    """A curve from the anchors alone (the prior's shape not trusted): piecewise linear, linear beyond the largest,
    and t(1) along the two smallest, never below the smallest's cost per token nor above its cost."""
    qs = sorted(anchors)
    points = dict(anchors)
    q0, t0 = qs[0], anchors[qs[0]]
    if q0 > 1:
        guess = t0 / q0
        if len(qs) > 1:
            guess = t0 - (anchors[qs[1]] - t0) / (qs[1] - q0) * (q0 - 1)
        points[1] = min(t0, max(t0 / q0, guess))
    return CostCurve(points)


class CostModel:
    """t(q) of one target on this machine: the prior curve corrected by the run's own forward timings (see the
    module docstring). Reads like a :class:`CostCurve` (:meth:`t`, :meth:`ratio`, :attr:`ms`), from a snapshot
    rebuilt only when an estimate moved by more than :data:`TOLERANCE`; :meth:`table` gives t(1..n) as an array.
    ``learn=False`` pins it to the prior (tests, fixed budgets)."""

    WINDOW = 9  # recent timings kept per row count
    MIN_SAMPLES = 3  # timings a row count needs before its median counts (an anchor)
    LEVEL_WINDOW = 16  # recent observed/prior ratios, all row counts together
    TOLERANCE = 0.03  # an estimate that moved less than this leaves the snapshot as it is
    TRUST = 2.0  # the prior is contradicted when recent timings run more than this factor away from it

    def __init__(self, prior: CostCurve | None = None, *, learn: bool = True):
        self.prior: CostCurve | None = None
        self.learn = learn
        self.forwards = 0  # forwards observed
        self.contradicted = False  # set once a full window of timings contradicted the prior
        self.source: Path | None = None  # the cached file the prior was read from (or written to)
        self._source_text: str | None = None
        self._windows: dict[int, deque] = {}
        self._anchors: dict[int, float] = {}  # q -> median of its window, once it has MIN_SAMPLES timings
        self._ratios: deque = deque(maxlen=self.LEVEL_WINDOW)
        self._prior_at: dict[int, float] = {}  # q -> prior t(q), for the observed q
        self._level: float | None = None
        self._used: tuple[dict, float | None] = ({}, None)  # the anchors and level of the current snapshot
        self._curve: CostCurve | None = None
        self._tables: dict = {}
        if prior is not None:
            self.set_prior(prior)

    # -- the prior ----------------------------------------------------------------------------------------------
    def set_prior(self, prior: CostCurve, source: Path | None = None, source_text: str | None = None) -> None:
        """Start from ``prior`` (read from ``source``, whose text was ``source_text``: removed if contradicted);
        timings seen before it arrived count towards the level too."""
        self.prior, self.source, self._source_text = prior, source, source_text
        self.contradicted = False
        self._prior_at = {}
        self._ratios.clear()
        for q, window in self._windows.items():
            self._ratios.extend(ms / prior.t(q) for ms in window)
        self._level = _median(self._ratios) if len(self._ratios) >= self.MIN_SAMPLES else None
        self._curve = None

    @property
    def trusted(self) -> bool:
        """Whether the prior's shape is used (the level, once known, is within [1/TRUST, TRUST])."""
        level = self._level
        return self.prior is not None and (level is None or 1 / self.TRUST <= level <= self.TRUST)

    # -- live timings -------------------------------------------------------------------------------------------
    def observe(self, rows: int, seconds: float) -> None:
        """One forward over ``rows`` rows took ``seconds``. O(1): a few microseconds."""
        if not self.learn or rows < 1 or not seconds > 0:
            return
        ms = seconds * 1e3
        q = row_bucket(rows)
        window = self._windows.get(q)
        if window is None:
            window = self._windows[q] = deque(maxlen=self.WINDOW)
        window.append(ms)
        self.forwards += 1
        used_anchors, used_level = self._used
        if len(window) >= self.MIN_SAMPLES:
            self._anchors[q] = median = _median(window)
            if not _close(median, used_anchors.get(q), self.TOLERANCE):
                self._curve = None
        if self.prior is not None:
            prior_ms = self._prior_at.get(q)
            if prior_ms is None:
                prior_ms = self._prior_at[q] = self.prior.t(q)
            self._ratios.append(ms / prior_ms)
            if len(self._ratios) >= self.MIN_SAMPLES:
                was_trusted = self.trusted
                self._level = _median(self._ratios)
                if self.trusted != was_trusted or (not self._anchors and
                                                   not _close(self._level, used_level, self.TOLERANCE)):
                    self._curve = None
                # Only a prior slower than the forwards is wrong in itself (measured under load); forwards slower
                # than the prior are this moment's load or a longer cache, which live timings already follow.
                if len(self._ratios) == self.LEVEL_WINDOW and self._level < 1 / self.TRUST and not self.contradicted:
                    self._contradict()

    def _contradict(self) -> None:
        """A full window of timings contradicts the prior: remove the cached file it came from (if it still holds
        what was read), so that the next process measures the curve again."""
        self.contradicted = True
        path, text = self.source, self._source_text
        if path is None or text is None:
            return
        try:
            if path.read_text() != text:
                return  # measured again meanwhile
            path.unlink()
        except OSError:
            return
        print(f"fastforward: this run's forward timings contradict the cached cost curve (t(1) {self.prior.t(1):.1f} "
              f"ms cached, {self.t(1):.1f} ms now, {self.forwards} forwards); removed {path} -- it is measured again "
              "when next needed", file=sys.stderr)

    # -- reading ------------------------------------------------------------------------------------------------
    def curve(self) -> CostCurve:
        """The current estimate of t(q) as a curve (rebuilt only when an estimate moved)."""
        if self._curve is None:
            self._curve = self._build()
            self._used = (dict(self._anchors), self._level)
            self._tables = {}
        return self._curve

    def _build(self) -> CostCurve:
        if self.trusted:
            return _scaled_prior(self.prior, self._anchors, self._level)
        if self._anchors:
            return _from_anchors(self._anchors)
        if self.prior is not None:
            return _scaled_prior(self.prior, {}, self._level)
        return CostCurve.flat()

    def t(self, q: float) -> float:
        return self.curve().t(q)

    def ratio(self, q: float) -> float:
        """t(q) / t(1)."""
        return self.curve().ratio(q)

    @property
    def ms(self) -> dict[int, float]:
        return self.curve().ms

    def table(self, n: int, numpy: bool = False):
        """t(1), ..., t(n) as a float64 torch tensor (a numpy array with ``numpy``), kept until the estimate moves;
        callers must not write into it."""
        curve = self.curve()
        got = self._tables.get((n, numpy))
        if got is None:
            values = [curve.t(q) for q in range(1, n + 1)]
            got = np.array(values, dtype=np.float64) if numpy else torch.tensor(values, dtype=torch.float64)
            self._tables[(n, numpy)] = got
        return got


def _close(value: float, reference: float | None, tolerance: float) -> bool:
    return reference is not None and abs(value - reference) <= tolerance * reference


# ------------------------------------------------------------------------------------------------------------------
# One model per target; the prior cached on disk
# ------------------------------------------------------------------------------------------------------------------

SLOT = "cost model"  # the target's resource slot (:mod:`fastforward.model.slots`) that holds its CostModel


def curve_path(target) -> Path:
    """The cached prior's file: one per model, backend, matmul kernel (its arithmetic), KV cache precision, kernel
    build, thread count and torch version."""
    backend = target.backend
    kernel = getattr(backend, "matmul_kernel", "mkl") if target.backend_name == "lean" else "hf"
    build = kernels.build_digest() if target.backend_name == "lean" else None  # a new kernel build measures anew
    kv = getattr(target, "kv_precision", "fp32")
    key = "-".join(
        str(x) for x in (target.name, target.backend_name, kernel, kv, build, torch.get_num_threads(),
                         torch.__version__)
    )
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in key)
    return costs_dir() / f"{safe}.json"


def _model_of(target) -> CostModel:
    return target.shared(SLOT, CostModel)


def cost_model(target, announce: bool = True) -> CostModel:
    """The target's cost model, its prior read from the cache or measured (once per machine, model and build;
    ``announce`` says so on stderr when it measures). Call it before timing anything: it may take seconds."""
    model = _model_of(target)
    if model.prior is None:
        model.set_prior(*_cached_or_measured(target, announce))
    return model


def observe_forward(target, rows: int, seconds: float) -> None:
    """A verification forward of ``target`` over ``rows`` rows took ``seconds``: the engine's report (O(1))."""
    _model_of(target).observe(rows, seconds)


def set_cost_model(target, model: CostModel | None) -> CostModel | None:
    """Attach ``model`` to ``target`` (None: detach); returns the one attached before (tests pin a curve so)."""
    return target.set_shared(SLOT, model)


def machine_cost_curve(target, refresh: bool = False, announce: bool = True) -> CostCurve:
    """The target's prior curve on this machine: read from the cache, or measured (a few seconds) and cached when
    the machine was quiet; ``refresh`` measures it again and makes it the cost model's prior."""
    if not refresh:
        return cost_model(target, announce).prior
    curve, path, text = _measured(target, curve_path(target), announce)
    _model_of(target).set_prior(curve, path, text)
    return curve


def _read_cached(path: Path) -> tuple[CostCurve, str] | None:
    """The cached curve at ``path`` and the file's text, or None when it is missing, unreadable or implausible."""
    try:
        text = path.read_text()
        ms = {int(k): float(v) for k, v in json.loads(text)["ms"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return (CostCurve(ms), text) if ms and plausible_curve(ms) else None  # a distorted cache is measured again


def _cached_or_measured(target, announce: bool) -> tuple[CostCurve, Path, str | None]:
    path = curve_path(target)
    cached = _read_cached(path)
    if cached is not None:
        return cached[0], path, cached[1]
    return _measured(target, path, announce)


def _measured(target, path: Path, announce: bool) -> tuple[CostCurve, Path, str | None]:
    """Measure the curve (up to :data:`CURVE_ATTEMPTS` attempts until one runs quietly and plausibly) and store it
    when one did; returns (curve, path, the stored text or None)."""
    if announce:
        print(f"fastforward: measuring this machine's forward cost curve for {target.name} "
              f"({torch.get_num_threads()} threads; once, a few seconds; cached in {path.parent})", file=sys.stderr)
    # the row counts a forward of this model can take after at least one cached token (a tiny test model's context
    # may be shorter than the largest)
    qs = tuple(q for q in CURVE_QS if q + 2 <= target.max_context) or (1,)
    kv = min(CURVE_KV, max(1, target.max_context - max(qs) - 1))
    ms: dict = {}
    quiet: LoadReading | None = None
    worst: LoadReading | None = None
    for _ in range(CURVE_ATTEMPTS):
        with LoadMeter() as meter:
            again = measure_forward_costs(target, qs, kv=kv, repeats=3)
        reading = meter.reading
        if reading.loaded:
            worst = reading
            if quiet is None:  # the fastest seen of loaded attempts, until a quiet one replaces them
                ms = {q: min(v, ms.get(q, v)) for q, v in again.items()}
        else:
            ms = again if quiet is None else {q: min(v, ms.get(q, v)) for q, v in again.items()}
            quiet = reading
            if plausible_curve(ms):
                break
    curve = CostCurve(ms)
    if quiet is None or not plausible_curve(ms):
        if announce:
            why = "grows faster than linearly" if quiet is not None else \
                f"was measured under other load ({_describe(worst)})"
            print(f"fastforward: the cost curve {why}; used for this run, not cached", file=sys.stderr)
        return curve, path, None
    text = json.dumps({"ms": curve.ms, "kv": kv, "wait_share": quiet.wait_share, "cpu_share": quiet.cpu_share})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        return curve, path, None
    return curve, path, text


def _describe(reading: LoadReading) -> str:
    if reading.wait_share is not None:
        return f"its threads waited for a CPU {reading.wait_share:.0%} of the time"
    return f"the process got {reading.cpu_share:.0%} of its threads' CPU time"


# ------------------------------------------------------------------------------------------------------------------
# Sizing drafts: the one place a draft is priced
# ------------------------------------------------------------------------------------------------------------------

#: how much better a larger draft's rate must be to be chosen over a smaller one, for methods whose options are
#: estimates that may tie to rounding (a chain's geometric series): one part in 10^9
NEAR_TIE = 1e-9


def best_draft(tokens, ms, allowed=None, near_tie: float = 0.0) -> int:
    """Which of a method's draft options to make: every method that sizes its draft from the cost model (``pld``,
    ``rest``, ``sps``, ``eagle``, ``falcon``, ``fasteagle``) lists the shapes it could draft and asks here; the
    shapes differ, the pricing does not.

    Option i is expected to emit ``tokens[i]`` tokens (the bonus token included) for ``ms[i]`` milliseconds: t(q) of
    the forward that verifies it (q its rows) on this machine's cost model, plus what making it costs where the
    method pays for that (``sps``: the draft model's forwards). Options are listed smallest first; the first is
    drafting nothing, one plain step (1 token for t(1)). The chosen option has the most tokens per millisecond, the
    smallest of equals -- or, with ``near_tie``, each larger option must beat the best smaller one by more than
    that share; ``allowed`` (bools like ``tokens``) leaves out options the method may not draft. ``tokens``, ``ms``
    and ``allowed``: float64 torch tensors, numpy arrays or lists (a few options: plain floats are the fastest);
    the index of the chosen option. (The unit of ``tokens`` may be scaled, as ``tree_builder`` prices speedups.)"""
    if isinstance(tokens, torch.Tensor):
        rates = tokens / ms
        if allowed is not None:
            rates = torch.where(allowed, rates, -1.0)
        return int(rates.argmax()) if not near_tie else _first_clear_best(rates.tolist(), near_tie)
    if isinstance(tokens, np.ndarray):
        rates = tokens / np.asarray(ms, dtype=np.float64)
        if allowed is not None:
            rates = np.where(allowed, rates, -1.0)
        return int(np.argmax(rates)) if not near_tie else _first_clear_best(rates.tolist(), near_tie)
    rates = [t / m for t, m in zip(tokens, ms, strict=True)]
    if allowed is not None:
        rates = [r if ok else -1.0 for r, ok in zip(rates, allowed, strict=True)]
    return max(range(len(rates)), key=rates.__getitem__) if not near_tie else _first_clear_best(rates, near_tie)


def _first_clear_best(rates: list[float], near_tie: float) -> int:
    """Walking up from the smallest option, each next one is taken only if it beats the best so far by more than
    ``near_tie`` (relative)."""
    best = 0
    for i in range(1, len(rates)):
        if rates[i] > rates[best] * (1.0 + near_tie):
            best = i
    return best


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one forward emits with a k-token chain draft whose tokens are each accepted with probability alpha
    (given the previous one was): 1 + alpha + ... + alpha^k (the bonus token included)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_chain_length(alpha: float, max_k: int, curve, draft_ms: float = 0.0, others: int = 0) -> int:
    """The draft length k in 0..max_k that maximises expected tokens per millisecond (:func:`best_draft`) of a
    chain whose tokens are each accepted with probability ``alpha``: ``(1 + alpha + ... + alpha^k) / (t(k+1) +
    k draft_ms)``, with ``curve`` the target's cost (a :class:`CostCurve` or a :class:`CostModel`) and ``draft_ms``
    what drafting one token costs (0: a lookup). ``others``: the other sequences sharing the forward, a root row and
    a token each -- ``(others + 1 + alpha + ... + alpha^k) / (t(others + k + 1) + k draft_ms)``: a draft row then
    has to pay for a step of all of them (on a CPU it must be far likelier than alone)."""
    ks = range(max_k + 1)
    return best_draft([others + expected_tokens(alpha, k) for k in ks],
                      [curve.t(others + k + 1) + k * draft_ms for k in ks], near_tie=NEAR_TIE)


class AcceptanceEstimate:
    """A running estimate of the per-token acceptance rate of a draft source, forgetting old evidence.

    The prior is optimistic on purpose: a new source gets tried before evidence decides its draft length.
    Each proposal of k tokens of which ``a`` were accepted is a+1 Bernoulli trials under the geometric model
    (a successes, then one failure unless all k were accepted). Evidence decays by ``decay`` every step, also on
    steps without a proposal, so a source that was switched off drifts back to the prior and gets probed again.
    """

    def __init__(self, prior: float = 0.7, strength: float = 2.0, decay: float = 0.95):
        self.prior, self.strength, self.decay = prior, strength, decay
        self.successes = 0.0
        self.failures = 0.0

    @property
    def alpha(self) -> float:
        a = self.successes + self.prior * self.strength
        return a / (self.successes + self.failures + self.strength)

    def tick(self) -> None:
        self.successes *= self.decay
        self.failures *= self.decay

    def update(self, proposed: int, accepted: int) -> None:
        self.successes += accepted
        self.failures += int(accepted < proposed)
