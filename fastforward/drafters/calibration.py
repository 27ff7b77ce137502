"""How often the target's greedy choice is a drafted token, as a function of the drafter's own probability for it.

A drafter trained with soft cross-entropy learns the target's next-token distribution p: its probability q(x)
estimates p(x). At temperature 0 the target accepts x when x is its *argmax*, which is likelier than p(x) whenever x
leads -- a token the target gives 0.4 is usually still its choice. On the default model's held-out responses, tokens
the shipped EAGLE-3 drafter gives 0.3-0.4 are the target's choice 52% of the time, 0.4-0.5 71%, 0.8-0.9 98%
(docs/drafters.md). Tree sizing (:func:`fastforward.proposers._rerank.best_size`) weighs each node by its chance of
acceptance, so with the raw q a greedy decode under-drafts.

:class:`GreedyCalibration` is the fix, fitted on held-out data and stored with the drafter (``config.json``,
``fastforward.greedy_calibration``; the servers ignore it): per drafting depth, a non-decreasing piecewise-linear
map from q to the observed rate at which a candidate with that q is the target's greedy token, given that its parent
was (teacher-forced: the path so far is the target's). ``eagle`` and ``fasteagle`` use it with ``calibrated=true``, at
temperature 0 only; when sampling, a node is accepted with the target's probability, which q already estimates. It
changes which tree is drafted, never what is accepted: the output is the target's either way.

Opt-in, because on this project's CPU it has not paid yet: with the shipped drafters, correct (higher) chances make
both methods draft more, and the extra drafter passes cost more than the few extra accepted tokens bring
(docs/drafters.md, "Greedy calibration").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError

CONFIG_KEY = "greedy_calibration"
FLOOR = 1e-6  # the smallest rate a map returns (its log stays finite)


@dataclass(frozen=True)
class GreedyCalibration:
    knots: tuple[tuple[float, ...], ...]  # per depth (1, 2, ...): drafter probabilities, ascending, from 0 to 1
    rates: tuple[tuple[float, ...], ...]  # per depth: the target's greedy-choice rate at each knot, non-decreasing
    samples: int = 0  # candidates it was fitted on

    def __post_init__(self):
        if not self.knots or len(self.knots) != len(self.rates):
            raise UsageError(f"{CONFIG_KEY}: needs one knots and one rates list per depth")
        for d, (x, y) in enumerate(zip(self.knots, self.rates, strict=True), start=1):
            ok = len(x) == len(y) >= 2 and x[0] == 0.0 and x[-1] == 1.0
            ok = ok and all(a < b for a, b in zip(x[:-1], x[1:], strict=True))
            ok = ok and all(a <= b for a, b in zip(y[:-1], y[1:], strict=True))
            ok = ok and all(0.0 <= v <= 1.0 for v in y)
            if not ok:
                raise UsageError(f"{CONFIG_KEY}: depth {d}'s table must have equally many knots (ascending from 0 "
                                 "to 1) and rates (non-decreasing, in [0, 1])")
        # the tables as tensors, once (the decode loop reads them every step)
        tables = [(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64))
                  for x, y in zip(self.knots, self.rates, strict=True)]
        object.__setattr__(self, "_tables", tables)

    @property
    def depths(self) -> int:
        return len(self.knots)

    def log_rate(self, log_q: torch.Tensor, depth: int) -> torch.Tensor:
        """log of the calibrated acceptance chance of candidates with log-probability ``log_q`` at ``depth`` (1 =
        the root's children; deeper than fitted uses the deepest table)."""
        x, y = self._tables[min(max(depth, 1), self.depths) - 1]
        q = log_q.double().exp().clamp(0.0, 1.0)
        hi = torch.searchsorted(x, q).clamp(1, x.numel() - 1)
        lo = hi - 1
        t = (q - x[lo]) / (x[hi] - x[lo])
        return (y[lo] + t * (y[hi] - y[lo])).clamp(min=FLOOR).log().to(log_q.dtype)

    def sibling_rates(self, probs: torch.Tensor, depth: int) -> torch.Tensor:
        """[..., k] calibrated acceptance chances of k siblings given as their drafter probabilities, best first:
        each mapped, then capped in rank order at what the better ones leave (siblings exclude each other: at most
        one of them is the target's token)."""
        rates = self.log_rate(probs.clamp(min=FLOOR).log(), depth).exp()
        return rates.cumsum(-1).clamp(max=1.0).diff(dim=-1, prepend=torch.zeros_like(rates[..., :1]))

    @classmethod
    def fit(cls, probs: list[torch.Tensor], hits: list[torch.Tensor], width: float = 0.05,
            min_count: int = 40) -> GreedyCalibration:
        """Per depth d, ``probs[d - 1]`` (drafter probabilities of candidates) and ``hits[d - 1]`` (whether each was
        the target's greedy token): bins of ``width`` in probability (finer below 0.05, where most candidates are;
        a bin with fewer than ``min_count`` candidates joins the next), their mean probability and hit rate made
        non-decreasing by pool-adjacent-violators (weighted by count), anchored at (0, 0) and (1, 1)."""
        edges = torch.cat([torch.tensor([0.0, 0.01, 0.02, 0.035]), torch.arange(0.05, 1.0, width, dtype=torch.float64),
                           torch.tensor([1.0 + 1e-9])]).double()
        knots, rates, total = [], [], 0
        for q, hit in zip(probs, hits, strict=True):
            q, hit = q.double().flatten(), hit.double().flatten()
            if q.numel() == 0:
                break
            total += q.numel()
            which = torch.bucketize(q, edges, right=True) - 1
            count = torch.bincount(which, minlength=edges.numel()).double()
            q_sum = torch.bincount(which, q, minlength=edges.numel())
            hit_sum = torch.bincount(which, hit, minlength=edges.numel())
            xs, ys, ws = [], [], []
            acc = [0.0, 0.0, 0.0]
            for i in range(edges.numel()):
                acc = [acc[0] + float(q_sum[i]), acc[1] + float(hit_sum[i]), acc[2] + float(count[i])]
                if acc[2] >= min_count:
                    xs.append(acc[0] / acc[2]), ys.append(acc[1] / acc[2]), ws.append(acc[2])
                    acc = [0.0, 0.0, 0.0]
            if acc[2] and ws:  # the leftover top candidates join the last bin
                xs[-1] = (xs[-1] * ws[-1] + acc[0]) / (ws[-1] + acc[2])
                ys[-1] = (ys[-1] * ws[-1] + acc[1]) / (ws[-1] + acc[2])
                ws[-1] += acc[2]
            elif acc[2]:
                xs, ys, ws = [acc[0] / acc[2]], [acc[1] / acc[2]], [acc[2]]
            xs, ys = _isotonic(xs, ys, ws)
            keep = [i for i in range(len(xs)) if 0.0 < xs[i] < 1.0 and (i == 0 or xs[i] > xs[i - 1])]
            knots.append(tuple([0.0] + [xs[i] for i in keep] + [1.0]))
            rates.append(tuple([0.0] + [min(1.0, max(0.0, ys[i])) for i in keep] + [1.0]))
        if not knots:
            raise UsageError("cannot calibrate a drafter on no held-out candidates")
        return cls(tuple(knots), tuple(rates), total)

    def as_dict(self) -> dict:
        return {"knots": [list(x) for x in self.knots], "rates": [list(y) for y in self.rates],
                "samples": self.samples}

    @classmethod
    def from_dict(cls, raw) -> GreedyCalibration:
        try:
            return cls(tuple(tuple(float(v) for v in x) for x in raw["knots"]),
                       tuple(tuple(float(v) for v in y) for y in raw["rates"]), int(raw.get("samples", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{CONFIG_KEY}: malformed ({exc})") from None


def _isotonic(xs: list[float], ys: list[float], ws: list[float]) -> tuple[list[float], list[float]]:
    """Pool adjacent violators: the weighted non-decreasing fit of ``ys``; pooled points share their weighted mean
    x and y."""
    blocks: list[list[float]] = []  # [sum w*x, sum w*y, sum w]
    for x, y, w in zip(xs, ys, ws, strict=True):
        blocks.append([w * x, w * y, w])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            b = blocks.pop()
            for i in range(3):
                blocks[-1][i] += b[i]
    return [b[0] / b[2] for b in blocks], [b[1] / b[2] for b in blocks]


def calibration_of(fastforward_section: dict | None) -> GreedyCalibration | None:
    """The calibration stored in a drafter config's ``fastforward`` section, if any."""
    if not isinstance(fastforward_section, dict):
        return None  # no section (or a malformed one, which the config's own reader refuses)
    raw = fastforward_section.get(CONFIG_KEY)
    return None if raw is None else GreedyCalibration.from_dict(raw)
