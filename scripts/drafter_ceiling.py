"""What a drafter must reach on this machine: the speedup over AR a chain drafter of a given acceptance would give,
from the step costs the benchmark measured for fixed chains of 1, 2, 3 ... drafted tokens.

    chains="c1=eagle:topk=1:nodes=2:backoff=0,c2=eagle:topk=1:nodes=3:backoff=0,c3=eagle:topk=1:nodes=4:backoff=0"
    fastforward bench --questions Q --per-category 2 --categories mt_bench,qa,math_reasoning \\
        --methods "ar,$chains" --threads 2 --out OUT_DIR/bench-chains
    python scripts/drafter_ceiling.py --bench OUT_DIR/bench-chains/summary.json [--target 1.6]

A step of a chain of d drafted tokens costs what the benchmark measured for it (drafting + verification ms per
step; with a fixed size and no back-off the drafter drafts every step, so the cost does not depend on how good it
is); AR's step likewise. A drafter whose draft at depth k is accepted with probability a (given depth k - 1 was)
makes tau = 1 + a + a^2 + ... + a^d tokens per step, so its speedup over AR is

    tau(a, d) * AR step / chain-d step.

Printed: the step costs, the speedup at a few acceptance rates, the ceiling (a = 1: every draft right), and the
smallest constant acceptance at which some chain reaches ``--target``. A tree at the same number of rows can only
add what its siblings catch when the first choice misses: at the acceptance a 1.6x speedup needs (near 0.8) that
is little, so the chain's figure is the one to read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def chain_steps(summary: dict) -> tuple[float, dict[int, float]]:
    """(AR's ms per step, {drafted tokens d: ms per step}) from a bench summary whose methods include fixed chains
    (``topk=1``, ``nodes=d+1``)."""
    methods = summary["methods"]
    ar = methods["ar"]
    ar_step = ar["draft_ms_per_step"] + ar["verify_ms_per_step"]
    chains = {}
    for m in methods.values():
        opts = m.get("options") or {}
        if opts.get("topk") == 1 and opts.get("nodes", 0) >= 2:
            chains[opts["nodes"] - 1] = m["draft_ms_per_step"] + m["verify_ms_per_step"]
    if not chains:
        raise SystemExit("drafter_ceiling: the summary has no fixed chain (a method with topk=1 and nodes >= 2)")
    return ar_step, dict(sorted(chains.items()))


def tau(a: float, d: int) -> float:
    return sum(a**i for i in range(d + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="a fastforward bench summary.json with fixed chains")
    ap.add_argument("--target", type=float, default=1.6, help="the speedup to reach (default: 1.6)")
    args = ap.parse_args()
    ar_step, chains = chain_steps(json.loads(args.bench.read_text()))
    rates = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    print(f"AR: {ar_step:.2f} ms per step")
    print("| drafted tokens | ms per step | " + " | ".join(f"a = {a:.1f}" for a in rates) + " |")
    print("|---:|---:|" + "---:|" * len(rates))
    for d, step in chains.items():
        print(f"| {d} | {step:.2f} | " + " | ".join(f"{tau(a, d) * ar_step / step:.2f}x" for a in rates) + " |")
    for i in range(1, 101):
        a = i / 100
        best = max(chains, key=lambda d: tau(a, d) / chains[d])
        if tau(a, best) * ar_step / chains[best] >= args.target:
            print(f"{args.target}x needs an acceptance of at least {a:.2f} at every depth (a chain of {best})")
            break
    else:
        print(f"no acceptance reaches {args.target}x with these chains")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
