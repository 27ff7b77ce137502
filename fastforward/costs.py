"""The machine's forward cost curve: measuring it, interpolating it, and sizing drafts from it.

A verification forward over q tokens costs t(q); drafting pays off only when the tokens it is expected to add per
forward outgrow t(q)/t(1). On GPUs t(q) is nearly flat up to dozens of tokens, so the papers draft generously; on
CPUs it is not, so fastforward sizes drafts from the curve measured on the machine itself
(:func:`measure_forward_costs`; ``fastforward profile`` prints it).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from . import kernels
from .errors import UsageError
from .model import _full_mask
from .paths import costs_dir

CURVE_QS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_QS = (1, 2, 4, 8, 16, 32, 64)


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
        qs = self._qs
        if q <= qs[0]:
            return self.ms[qs[0]]
        for lo, hi in zip(qs, qs[1:], strict=False):
            if q <= hi:
                return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (q - lo) / (hi - lo)
        lo, hi = qs[-2:] if len(qs) > 1 else (qs[0], qs[0])
        slope = (self.ms[hi] - self.ms[lo]) / (hi - lo) if hi > lo else 0.0
        return self.ms[hi] + slope * (q - hi)

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
# This machine's curve, cached
# ------------------------------------------------------------------------------------------------------------------


def _curve_path(target):
    backend = target.backend
    kernel = getattr(backend, "matmul_kernel", "mkl") if target.backend_name == "lean" else "hf"
    build = kernels.build_digest() if target.backend_name == "lean" else None  # a new kernel build measures anew
    key = "-".join(
        str(x) for x in (target.name, target.backend_name, kernel, build, torch.get_num_threads(), torch.__version__)
    )
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in key)
    return costs_dir() / f"{safe}.json"


CURVE_ATTEMPTS = 3


def machine_cost_curve(target, refresh: bool = False, announce: bool = True) -> CostCurve:
    """The target's cost curve on this machine: measured once (about a second) and cached on disk; ``refresh``
    measures it again; ``announce`` says so on stderr when it measures."""
    cached = getattr(target, "_cost_curve", None)
    if cached is not None and not refresh:
        return cached
    path = _curve_path(target)
    curve = None
    if path.is_file() and not refresh:
        try:
            ms = {int(k): float(v) for k, v in json.loads(path.read_text())["ms"].items()}
            curve = CostCurve(ms) if plausible_curve(ms) else None  # a distorted cache is measured again
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            curve = None
    if curve is None and announce:
        print(f"fastforward: measuring this machine's forward cost curve for {target.name} "
              f"({torch.get_num_threads()} threads; once, a few seconds; cached in {path.parent})", file=sys.stderr)
    if curve is None:
        kv = min(256, max(1, target.max_context - max(CURVE_QS) - 1))
        ms: dict = {}
        for _ in range(CURVE_ATTEMPTS):  # other load distorts a measurement; the fastest seen is the machine's cost
            again = measure_forward_costs(target, CURVE_QS, kv=kv, repeats=3)
            ms = {q: min(v, ms.get(q, v)) for q, v in again.items()}
            if plausible_curve(ms):
                break
        curve = CostCurve(ms)
        if plausible_curve(ms):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"ms": curve.ms, "kv": kv}))
            except OSError:
                pass
        elif announce:
            print("fastforward: the cost curve looks distorted by other load on this machine; used for this run, "
                  "not cached", file=sys.stderr)
    target._cost_curve = curve
    return curve


# ------------------------------------------------------------------------------------------------------------------
# Sizing drafts
# ------------------------------------------------------------------------------------------------------------------


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one forward emits with a k-token chain draft whose tokens are each accepted with probability alpha
    (given the previous one was): 1 + alpha + ... + alpha^k (the bonus token included)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_chain_length(alpha: float, max_k: int, curve: CostCurve) -> int:
    """The draft length k in 0..max_k that maximises expected tokens per unit of forward cost."""
    best_k, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = expected_tokens(alpha, k) / curve.ratio(k + 1)
        if rate > best_rate + 1e-9:
            best_k, best_rate = k, rate
    return best_k


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
