"""Throughput of many sequences per forward: the same prompts decoded B at a time, for several B and methods.

For each method and batch size B the questions' first turns are decoded with :func:`fastforward.generate_batch`
(greedy), at most B at once: the next prompt starts as soon as a sequence finishes (continuous batching, as a
server runs). Reported per (method, B): aggregate tokens per second over all prompts (prefills included), mean and
max per-sequence latency (from the start of its prefill to its last token), and whether every sequence's tokens
equal its solo AR output (greedy: they must, for every method and B).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..api import generate_batch


@dataclass
class BatchRow:
    method: str
    batch: int
    sequences: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    latency_mean_s: float
    latency_max_s: float
    identical_to_ar: bool


def run_batch_throughput(target, prompts: list[list[int]], methods: list[str], batch_sizes: list[int],
                         max_new_tokens: int, max_batch_tokens: int | None = None, progress=None,
                         cut_drafts: bool = True) -> list[BatchRow]:
    """One row per (method, batch size); ``prompts`` are token ids. AR at B = 1 runs first: the reference.
    ``cut_drafts``: see :func:`fastforward.generate_batch`."""
    rows = []
    reference: list[list[int]] | None = None
    methods = ["ar"] + [m for m in methods if m != "ar"]
    for method in methods:
        for b in sorted(set(batch_sizes) | {1}):
            t0 = time.perf_counter()
            results = generate_batch(target, prompts, method, max_new_tokens=max_new_tokens,
                                     max_batch_tokens=max_batch_tokens, max_active=b, cut_drafts=cut_drafts)
            wall = time.perf_counter() - t0
            outputs = [r.token_ids for r in results]
            latencies = [r.stats.wall_time for r in results]
            tokens = sum(len(o) for o in outputs)
            if reference is None:
                reference = outputs
            row = BatchRow(method, b, len(prompts), tokens, wall, tokens / wall, statistics.mean(latencies),
                           max(latencies), outputs == reference)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_batch_table(rows: list[BatchRow]) -> str:
    """A markdown table, with each row's throughput as a ratio to the same method's B = 1."""
    base = {r.method: r.tokens_per_s for r in rows if r.batch == 1}
    lines = ["| method | B | tokens | tok/s (all sequences) | × B=1 | latency mean s | latency max s | = solo AR |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.tokens_per_s / base[r.method]:.2f}×" if r.method in base else "-"
        lines.append(f"| {r.method} | {r.batch} | {r.new_tokens} | {r.tokens_per_s:.1f} | {ratio} | "
                     f"{r.latency_mean_s:.2f} | {r.latency_max_s:.2f} | {'yes' if r.identical_to_ar else 'NO'} |")
    return "\n".join(lines)


def write_batch_results(rows: list[BatchRow], out_dir: Path, meta: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "batch.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    path = out_dir / "batch.md"
    path.write_text(format_batch_table(rows) + "\n")
    return path
