"""The machine's forward cost curve, and sizing drafts from it.

A verification forward over q tokens costs t(q); drafting pays off only when the tokens it is expected to add per
forward outgrow t(q)/t(1). On GPUs t(q) is nearly flat up to dozens of tokens, so the papers draft generously; on
CPUs it is not, so fastforward sizes drafts from the curve measured on the machine itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

CURVE_QS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class CostCurve:
    """Milliseconds per target forward by number of new tokens q (interpolated linearly, monotone in q)."""

    ms: dict[int, float]

    def __post_init__(self):
        qs = sorted(int(q) for q in self.ms)
        if not qs or qs[0] != 1:
            raise ValueError("a cost curve needs t(1)")
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
        return self.t(q) / self.ms[1]

    @classmethod
    def flat(cls) -> CostCurve:
        """An accelerator-like curve (every q costs the same): what the papers' settings assume."""
        return cls({1: 1.0, 64: 1.0})


def _curve_path(target):
    from .paths import costs_dir

    backend = target.backend
    kernel = getattr(backend, "matmul_kernel", "mkl") if target.backend_name == "lean" else "hf"
    key = "-".join(
        str(x) for x in (target.name, target.backend_name, kernel, torch.get_num_threads(), torch.__version__)
    )
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in key)
    return costs_dir() / f"{safe}.json"


def machine_cost_curve(target, refresh: bool = False) -> CostCurve:
    """The target's cost curve on this machine: measured once (about a second) and cached on disk."""
    cached = getattr(target, "_cost_curve", None)
    if cached is not None and not refresh:
        return cached
    path = _curve_path(target)
    curve = None
    if path.is_file() and not refresh:
        try:
            curve = CostCurve({int(k): v for k, v in json.loads(path.read_text())["ms"].items()})
        except (OSError, ValueError, KeyError):
            curve = None
    if curve is None:
        import sys

        from .profile import measure_forward_costs

        print(f"fastforward: measuring this machine's forward cost curve for {target.name} "
              f"({torch.get_num_threads()} threads; once, a few seconds; cached in {path.parent})", file=sys.stderr)

        kv = min(256, max(1, target.max_context - max(CURVE_QS) - 1))
        curve = CostCurve(measure_forward_costs(target, CURVE_QS, kv=kv, repeats=3))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"ms": curve.ms, "kv": kv}))
        except OSError:
            pass
    target._cost_curve = curve
    return curve


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
