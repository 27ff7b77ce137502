"""Each method's speed projected onto larger models, from what it did on the default model and what a forward costs
at each size (both measured on this machine):

    fastforward bench --questions Q --methods ar,pld,rest,... --peers llama-cpp --out OUT_DIR/bench-default
    fastforward profile --json --q 1,2,4,8,16,32 --no-hf --llama-cpp > OUT_DIR/profile-default.json
    fastforward profile --json --q 1,2,4,8,16,32 --no-hf --llama-cpp --model FILE > OUT_DIR/profile-3b.json
    python scripts/project_speedups.py --bench OUT_DIR/bench-default/summary.json \\
        --default-profile OUT_DIR/profile-default.json --profile 3b=OUT_DIR/profile-3b.json [--profile ...]

How: on the default model each method decoded tau tokens per step, each step's target forward scored r rows
(``rows_per_step``) and a step took s ms (tau / decode tokens/s). The part of a step that is not the target forward,
o = s - t_default(r) (drafting, verification bookkeeping, Python), does not grow with the target; the forward does.
At a size whose curve is t_size: step = t_size(r) + o, so tokens/s = 1000 tau / (t_size(r) + o), compared with
llama.cpp's AR there, 1000 / t_llama.cpp,size(1). t(r) between measured row counts is interpolated linearly.
Assumed: tau and r stay what they were on the default model (the same drafts; a real larger model usually agrees
with itself at least as often, and the cost-aware draft sizing would cut r where rows cost more).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curve(profile: dict, who: str) -> dict[int, float]:
    ms = profile["ms"].get(who)
    if not ms:
        raise SystemExit(f"project_speedups: the profile has no '{who}' curve (run it with --llama-cpp)")
    return {int(q): float(v) for q, v in ms.items()}


def at(points: dict[int, float], rows: float) -> float:
    """t(rows), linear between the measured row counts (and beyond the last, along the last segment)."""
    qs = sorted(points)
    if rows <= qs[0]:
        return points[qs[0]]
    for a, b in zip(qs, qs[1:], strict=False):
        if rows <= b:
            return points[a] + (points[b] - points[a]) * (rows - a) / (b - a)
    a, b = qs[-2], qs[-1]
    return points[b] + (points[b] - points[a]) * (rows - b) / (b - a)


def project(summary: dict, default: dict, sizes: dict[str, dict]) -> list[dict]:
    base = curve(default, "engine")
    out = []
    for label, m in summary["methods"].items():
        if m.get("kind", "method") != "method" or not m.get("decode_tokens_per_s"):
            continue
        tau, rows = m["tau"], m.get("rows_per_step")
        if rows is None:
            if label != "ar":
                raise SystemExit(f"project_speedups: '{label}' has no rows_per_step in the bench summary (a bench "
                                 "run of this version records it)")
            rows = 1.0
        step = 1000 * tau / m["decode_tokens_per_s"]
        other = max(0.0, step - at(base, rows))
        row = {"method": label, "tau": tau, "rows_per_step": rows, "step_ms_default": step, "other_ms": other,
               "sizes": {}}
        for name, prof in sizes.items():
            ours, theirs = curve(prof, "engine"), curve(prof, "llama.cpp")
            tps = 1000 * tau / (at(ours, rows) + other)
            row["sizes"][name] = {"tokens_per_s": tps, "llama_cpp_ar_tokens_per_s": 1000 / theirs[min(theirs)],
                                  "vs_llama_cpp_ar": tps * theirs[min(theirs)] / 1000}
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="project_speedups.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, type=Path, help="summary.json of a bench run on the default model")
    p.add_argument("--default-profile", required=True, type=Path, help="profile --json of the default model")
    p.add_argument("--profile", action="append", default=[], metavar="NAME=FILE",
                   help="profile --json --llama-cpp of a larger model (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    sizes = {}
    for item in args.profile:
        name, sep, path = item.partition("=")
        if not sep or not name:
            p.error(f"--profile takes NAME=FILE, got '{item}'")
        sizes[name] = json.loads(Path(path).read_text())
    rows = project(json.loads(args.bench.read_text()), json.loads(args.default_profile.read_text()), sizes)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    names = list(sizes)
    print("| method | tau | rows / step | other ms / step | " + " | ".join(
        f"{n}: tok/s (× llama.cpp AR)" for n in names) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(names))
    for r in rows:
        cells = [f"{r['sizes'][n]['tokens_per_s']:.1f} ({r['sizes'][n]['vs_llama_cpp_ar']:.2f}×)" for n in names]
        print(f"| {r['method']} | {r['tau']:.2f} | {r['rows_per_step']:.2f} | {r['other_ms']:.2f} | "
              + " | ".join(cells) + " |")
    if names:
        print("llama.cpp AR tok/s: " + ", ".join(
            f"{n} {rows[0]['sizes'][n]['llama_cpp_ar_tokens_per_s']:.1f}" for n in names) if rows else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
