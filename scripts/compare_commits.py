"""Every method's speed at two commits, measured in one run: ``fastforward bench`` of each commit on the same
questions, in the order old, new, new, old over two halves of the questions (so a drift of the machine during the run
weighs on both commits alike).

    python scripts/compare_commits.py OLD NEW --questions DATA_DIR/spec_bench/question.jsonl --per-category 4 \\
        --out OUT_DIR/compare [-- BENCH ARGS ...]

Each commit is checked out as a detached worktree under ``OUT_DIR/trees`` and run with its own code (``PYTHONPATH``);
the questions are chosen once, by the new commit's loader, and split into two files. Printed: per method, tokens/s at
each commit (tokens over wall time, both halves together) and new / old, and whether every method's output matched
``ar``'s at both. The bench runs and the worktrees stay under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worktree(ref: str, root: Path) -> Path:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", ref + "^{commit}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    path = root / commit[:12]
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path


def split_questions(tree: Path, args, out: Path) -> list[Path]:
    """The questions bench would pick with ``--per-category``, as two JSONL files (alternate questions)."""
    code = ("import json, sys; from fastforward.bench.questions import load_questions, select_questions;"
            "qs = select_questions(load_questions(sys.argv[1]), per_category=int(sys.argv[2]));"
            "print(json.dumps([q.to_dict() for q in qs]))")
    records = json.loads(subprocess.run([sys.executable, "-c", code, args.questions, str(args.per_category)],
                                        check=True, capture_output=True, text=True,
                                        env={**os.environ, "PYTHONPATH": str(tree)}).stdout)
    halves = [out / "questions-a.jsonl", out / "questions-b.jsonl"]
    for i, path in enumerate(halves):
        path.write_text("".join(json.dumps(r) + "\n" for r in records[i::2]))
    return halves


def bench(tree: Path, questions: Path, out: Path, extra: list[str]) -> dict:
    if not (out / "summary.json").exists():
        cmd = [sys.executable, "-m", "fastforward.cli", "bench", "--questions", str(questions), "--out", str(out),
               "--no-progress", *extra]
        print("running:", " ".join(cmd), f"(PYTHONPATH={tree})", flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
    return json.loads((out / "summary.json").read_text())["methods"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--questions", required=True)
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--out", required=True, type=Path)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # after --: arguments for fastforward bench
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {name: worktree(ref, args.out / "trees") for name, ref in (("old", args.old), ("new", args.new))}
    halves = split_questions(trees["new"], args, args.out)
    runs = {}
    for name, half in (("old", 0), ("new", 0), ("new", 1), ("old", 1)):
        runs[name, half] = bench(trees[name], halves[half], args.out / f"{name}-{half}", extra)
    print(f"\n{'method':<12}{'old tok/s':>11}{'new tok/s':>11}{'new/old':>9}  outputs equal to ar (old, new)")
    for method in runs["new", 0]:
        speed, equal = {}, {}
        for name in ("old", "new"):
            rows = [runs[name, h].get(method) for h in (0, 1)]
            if None in rows:
                break
            speed[name] = sum(r["new_tokens"] for r in rows) / sum(r["wall_time"] for r in rows)
            equal[name] = sum(r.get("mismatches", 0) for r in rows) == 0
        if len(speed) == 2:
            print(f"{method:<12}{speed['old']:>11.1f}{speed['new']:>11.1f}{speed['new'] / speed['old']:>9.3f}  "
                  f"{equal['old']}, {equal['new']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
