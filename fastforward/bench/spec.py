"""The benchmark's shared vocabulary, imported by every other bench module and importing none of them: what a method
spec is (:class:`MethodSpec`), what one generated turn reports (:class:`TurnOutcome`), and the reserved names (the
baseline label, the report's overall category)."""

from __future__ import annotations

from dataclasses import dataclass, field

BASELINE = "ar"  # the label (and method) every speedup is measured against; always run, first
OVERALL = "overall"  # the report's pseudo-category over all questions


@dataclass
class TurnOutcome:
    """One generated turn: the tokens and how they were obtained."""

    token_ids: list[int]
    wall_time: float  # seconds, prefill included (what Spec-Bench times)
    decoding_steps: int  # target forwards, prefill included
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per target forward
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    finish_reason: str = ""
    method_stats: dict = field(default_factory=dict)
    proposal_rows: int = 0  # rows the decoding steps' target forwards scored (drafts, roots, aux rows)


@dataclass
class MethodSpec:
    label: str  # the column name in the report
    method: str  # the registered method (or peer) name
    options: dict = field(default_factory=dict)
    kind: str = "method"  # "method" (our engine) or "peer" (another library)

    def describe(self) -> str:
        opts = ":".join(f"{k}={v}" for k, v in self.options.items())
        body = self.method + (f":{opts}" if opts else "")
        return body if self.label == self.method and not opts else f"{self.label}={body}"
