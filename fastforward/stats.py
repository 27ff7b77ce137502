"""Decoding statistics, computed in one place: the per-run record (:class:`GenerationStats`) and the formulas every
report uses (the engine's results, the benchmark's rows, evaluation's summaries)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


def tau(new_tokens: int, forwards: int) -> float:
    """Mean tokens emitted per target forward, the prefill's forward and token included (AR = 1.00)."""
    return new_tokens / forwards if forwards else 0.0


def geomean(xs: Iterable[float]) -> float:
    """Geometric mean of the positive values (speedup ratios per question or prompt); NaN when there are none."""
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def tokens_per_s(new_tokens: int, seconds: float) -> float:
    return new_tokens / seconds if seconds > 0 else 0.0


def acceptance_by_depth(accepts: list[int], attempts: list[int]) -> list[float]:
    """Fraction of the steps whose proposal reached depth d that accepted a token there, per depth."""
    return [a / t if t else 0.0 for a, t in zip(accepts, attempts, strict=False)]


def sum_lists(lists: Iterable[list[int]]) -> list[int]:
    """Element-wise sums of lists of different lengths (per-depth counts of several runs)."""
    lists = list(lists)
    n = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(n)]


def totals(runs: Iterable[GenerationStats]) -> dict:
    """Tokens, forwards, wall time, tau and tokens/s over several runs (a multi-turn question, an eval set)."""
    runs = list(runs)
    tokens = sum(r.new_tokens for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    wall = sum(r.wall_time for r in runs)
    return {"new_tokens": tokens, "target_forwards": forwards, "wall_time": wall, "tau": tau(tokens, forwards),
            "tokens_per_s": tokens_per_s(tokens, wall)}


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt positions whose KV came from a prefix cache instead of the prefill
    new_tokens: int = 0
    target_forwards: int = 0  # including the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per forward (prefill = 1, AR = 1)
    depth_attempts: list[int] = field(default_factory=list)  # [d-1]: steps whose proposal reached depth d
    depth_accepts: list[int] = field(default_factory=list)  # [d-1]: steps that accepted a token at depth d
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0
    finish_reason: str = ""
    proposal_tokens: int = 0  # tokens scored by decode forwards (tree + aux)
    method_stats: dict = field(default_factory=dict)

    @property
    def decoding_steps(self) -> int:
        return self.target_forwards

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (the bonus token counts; AR = 1.00)."""
        return tau(self.new_tokens, self.target_forwards)

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.new_tokens, self.wall_time)

    @property
    def acceptance_by_depth(self) -> list[float]:
        return acceptance_by_depth(self.depth_accepts, self.depth_attempts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, tokens_per_s=self.tokens_per_s, acceptance_by_depth=self.acceptance_by_depth)
        return d

    def summary(self) -> str:
        alpha = " ".join(f"{a:.2f}" for a in self.acceptance_by_depth[:8])
        return (
            f"[{self.method}] {self.new_tokens} tokens in {self.wall_time:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.target_forwards} target forwards, tau {self.tau:.2f}, finish: {self.finish_reason}; "
            f"prefill {self.prefill_time:.2f}s, draft {self.draft_time:.2f}s, verify {self.verify_time:.2f}s"
            + (f"; acceptance by depth {alpha}" if alpha else "")
        )


# -- draft sources (``auto``: which source drafted, per run) -------------------------------------------------------

#: the counts a draft source reports per run (summed over runs by :func:`pool_draft_sources`)
SOURCE_COUNTS = ("asked", "drafted_steps", "accepted_tokens", "ms")


def draft_source_rates(counts: dict, steps: int) -> dict:
    """One source's counts (``asked``: steps it was asked; ``drafted_steps``: steps its nodes were verified;
    ``accepted_tokens``; ``ms``: its drafting time; ``attempts_by_depth`` / ``accepts_by_depth``) over ``steps``
    decoding steps, with what they give: the share of steps it drafted, its tau (tokens per step it drafted, the bonus
    token included), its acceptance by depth and its drafting ms per step."""
    drafted = counts["drafted_steps"]
    return {**counts,
            "share_of_steps": drafted / steps if steps else 0.0,
            "tau": (counts["accepted_tokens"] + drafted) / drafted if drafted else 0.0,
            "acceptance_by_depth": acceptance_by_depth(counts["accepts_by_depth"], counts["attempts_by_depth"]),
            "ms_per_step": counts["ms"] / steps if steps else 0.0}


def pool_draft_sources(method_stats: Iterable[dict]) -> dict | None:
    """The draft sources of several runs pooled: ``{"steps": n, "sources": {name: rates}}`` (see
    :func:`draft_source_rates`), or None when no run reports sources."""
    steps, counts = 0, {}
    for st in method_stats:
        if not st or "sources" not in st:
            continue
        steps += st["steps"]
        for name, c in st["sources"].items():
            acc = counts.setdefault(name, {k: 0 for k in SOURCE_COUNTS} | {"attempts_by_depth": [],
                                                                          "accepts_by_depth": []})
            for k in SOURCE_COUNTS:
                acc[k] += c[k]
            acc["attempts_by_depth"] = sum_lists([acc["attempts_by_depth"], c["attempts_by_depth"]])
            acc["accepts_by_depth"] = sum_lists([acc["accepts_by_depth"], c["accepts_by_depth"]])
            if c.get("failed"):
                acc["failed"] = c["failed"]
    if not counts:
        return None
    return {"steps": steps, "sources": {name: draft_source_rates(c, steps) for name, c in counts.items()}}


def draft_source_lines(pooled: dict) -> list[str]:
    """A few lines, one per source, of what :func:`pool_draft_sources` gives (``--stats``)."""
    out = []
    for name, s in pooled["sources"].items():
        depths = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"][:4]) or "-"
        out.append(f"  {name:9s} drafted {s['share_of_steps']:6.1%} of {pooled['steps']} steps, tau {s['tau']:.2f}, "
                   f"acceptance by depth {depths}, {s['ms_per_step']:.2f} ms a step"
                   + (f" (failed: {s['failed']})" if s.get("failed") else ""))
    return out
