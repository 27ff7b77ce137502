"""``fastforward build-tree``: measure, build and size a TR-Jacobi tree for a model on this machine
(the work is :mod:`fastforward.tree_builder`'s).

Calibration prompts come from question files (Spec-Bench / MT-Bench ``turns``, ``prompt``, ``question``,
``instruction`` records; see ``fastforward/bench/questions.py``). From each category (or, with ``--limit``, from the
whole list) evenly spaced questions are taken starting at index ``--offset`` (default 11): on Spec-Bench's
80-question categories, ``--per-category 2`` takes indices 11 and 51 (4 takes 11, 31, 51, 71), never among the
first 8 of a category nor at the multiples of 10 or 20 the benchmark's evenly spaced selection picks (its
``--per-category 4`` and ``8``), so calibration and benchmark prompts are disjoint
(:func:`fastforward.tree_builder.select_calibration`).

The tree is written to ``--out`` only; ``--install`` also makes it this model's default ``tr-jacobi`` tree (in the
fastforward cache), which every later ``tr-jacobi`` run without ``-o tree=...`` then uses.

``--from TREE`` re-sizes a tree built earlier: its measured acceptance (``greedy_order``, ``tau_by_nodes``) is kept
and only the cost curve is measured again, for when the engine or the machine changed.
"""

from __future__ import annotations

import argparse
import sys

import fastforward as ff

from ..bench.questions import load_questions
from ..errors import UsageError
from ..paths import check_output_file, check_writable
from ..proposers.tr_jacobi import installed_tree_path, model_key
from ..tree import read_tree_file
from ..tree_builder import (
    build_tree,
    cost_qs,
    is_tree_file,
    measure_costs,
    save_tree,
    select_calibration,
    size_tree,
)
from .options import add_model_arguments, max_new_tokens, model_load_kwargs, seed

CALIBRATION_DEFAULTS = {"max_nodes": 64, "offset": 11, "max_new_tokens": 128, "width": 10, "depth": 5,
                        "retrieval_len": 5, "seed": 0}
CALIBRATION_FLAGS = {"--max-nodes": "max_nodes", "--per-category": "per_category", "--limit": "limit",
                     "--offset": "offset", "--max-new-tokens": "max_new_tokens", "--width": "width",
                     "--depth": "depth", "--retrieval-len": "retrieval_len", "--seed": "seed"}


def add_arguments(p, name: str) -> None:
    p.add_argument("--prompts", nargs="+", metavar="FILE", help="calibration question files (jsonl/json)")
    p.add_argument("--from", dest="from_tree", metavar="TREE",
                   help="instead of calibrating, re-size a tree built earlier: keep its measured acceptance, "
                        "measure only this machine's cost curve again (after an engine or machine change)")
    p.add_argument("--out", required=True,
                   help="where to write the tree JSON (a new file, or a tree an earlier build-tree wrote); use it "
                        "with -o tree=FILE, or --install it")
    add_model_arguments(p)
    p.add_argument("--max-nodes", type=int, default=None,
                   help=f"largest tree considered (default: {CALIBRATION_DEFAULTS['max_nodes']})")
    p.add_argument("--budget", default="auto",
                   help="tree nodes: 'auto' (best predicted speedup on this machine's cost curve) or N")
    p.add_argument("--per-category", type=int, default=None, help="calibration prompts per category")
    p.add_argument("--limit", type=int, default=None, help="calibration prompts overall (default: 12)")
    p.add_argument("--offset", type=int, default=None, help="index of the first pick in a category (default: 11)")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=None,
                   help="tokens generated per prompt (default: 128)")
    p.add_argument("--width", type=int, default=None, help="candidates per depth measured (default: 10)")
    p.add_argument("--depth", type=int, default=None, help="depths measured (default: 5)")
    p.add_argument("--retrieval-len", type=int, default=None, help="retrieval chain length (default: 5)")
    p.add_argument("--kv", type=int, default=300, help="KV length for the cost curve (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per q (default: %(default)s)")
    p.add_argument("--seed", type=seed, default=None, help="seed of the table's noise (default: 0)")
    p.add_argument("--install", action="store_true",
                   help="also install the tree as this model's default tr-jacobi tree (in the fastforward cache), "
                        "used by every later tr-jacobi run without -o tree=...; without it, only --out is written")
    p.add_argument("--no-install", action="store_true", help=argparse.SUPPRESS)  # the old default; now implied


def _check_kv(kv: int, qs: list[int], target) -> None:
    """The cost curve's forwards must fit the model's context (checked after the load, before any measuring)."""
    if kv + max(qs) > target.max_context:
        raise UsageError(f"--kv {kv} plus the largest tree ({max(qs)} tokens) exceeds the model's context "
                         f"{target.max_context}; lower --kv or --max-nodes")


def _positive(value, flag: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {value}")


def _read_built_tree(path: str) -> dict:
    data = read_tree_file(path)
    need = ("greedy_order", "tau_by_nodes", "tau_rates_only_by_nodes", "retrieval_len")
    if not isinstance(data, dict) or any(k not in data for k in need):
        raise UsageError(f"--from: {path} is not a tree written by 'fastforward build-tree'")
    return data


def _calibration_flags(args) -> None:
    """With --from, the calibration options are refused (the acceptance is the built tree's), not ignored; without
    it, the ones not given take their defaults."""
    given = [flag for flag, dest in CALIBRATION_FLAGS.items() if getattr(args, dest) is not None]
    if args.from_tree is not None and given:
        raise UsageError(f"{', '.join(given)} calibrate{'s' if len(given) == 1 else ''} a new tree; --from re-sizes "
                         "a built one with its own acceptance (leave them out, or drop --from)")
    for dest, value in CALIBRATION_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def _validate(args) -> tuple[int | str, list]:
    if args.install and args.no_install:
        raise UsageError("give --install or --no-install, not both")
    if (args.prompts is None) == (args.from_tree is None):
        raise UsageError("give --prompts (calibrate and build a tree) or --from TREE (re-size a built tree)")
    _calibration_flags(args)
    for value, flag in ((args.max_nodes, "--max-nodes"), (args.per_category, "--per-category"),
                        (args.limit, "--limit"), (args.max_new_tokens, "--max-new-tokens"), (args.width, "--width"),
                        (args.depth, "--depth"), (args.kv, "--kv"), (args.repeats, "--repeats")):
        _positive(value, flag)
    if args.retrieval_len < 0:
        raise UsageError(f"--retrieval-len must be >= 0, got {args.retrieval_len}")
    if args.offset < 0:
        raise UsageError(f"--offset must be >= 0, got {args.offset}")
    if args.per_category is not None and args.limit is not None:
        raise UsageError("give --per-category or --limit, not both")
    budget: int | str = args.budget
    if budget != "auto":
        try:
            budget = int(budget)
        except ValueError:
            raise UsageError(f"--budget takes 'auto' or a number of nodes, got '{args.budget}'") from None
        if not 1 <= budget <= args.max_nodes:
            raise UsageError(f"--budget must be in 1..{args.max_nodes} (--max-nodes), got {budget}")
    check_output_file(args.out, "--out", owned=is_tree_file)
    if args.install:
        check_writable(installed_tree_path(args.model), "--install")
    if args.from_tree is not None:
        return budget, [_read_built_tree(args.from_tree)]
    questions = load_questions(args.prompts)
    return budget, select_calibration(questions, args.per_category, args.limit, args.offset)


def run(args, name: str) -> int:
    budget, questions = _validate(args)  # everything checkable before the (slow) model load

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.from_tree is not None:
        built = questions[0]
        if model_key(str(built.get("model", ""))) != model_key(args.model):
            raise UsageError(f"--from: that tree was calibrated on '{built.get('model')}', not '{args.model}'")
        target = ff.load(args.model, **model_load_kwargs(args))
        qs = cost_qs(len(built["greedy_order"]), int(built["retrieval_len"]))
        _check_kv(args.kv, qs, target)
        costs, sweeps = measure_costs(target, qs, args.kv, args.repeats, 2, progress)
        data = size_tree(built, costs, budget, sweeps, args.kv, target)
        data["resized_from"] = str(args.from_tree)
    else:
        target = ff.load(args.model, **model_load_kwargs(args))
        _check_kv(args.kv, cost_qs(args.max_nodes, args.retrieval_len), target)
        progress(f"{len(questions)} calibration prompts: "
                 + ", ".join(f"{q.category}:{q.question_id}" for q in questions))
        prompts = [target.encode(q.turns[0]) for q in questions]
        data = build_tree(
            target, prompts, max_nodes=args.max_nodes, budget=budget, width=args.width, depth=args.depth,
            retrieval_len=args.retrieval_len, max_new_tokens=args.max_new_tokens, seed=args.seed, kv=args.kv,
            repeats=args.repeats, progress=progress,
        )
        data["model"] = args.model
        data["calibration"]["files"] = [str(p) for p in args.prompts]
        data["calibration"]["questions"] = [f"{q.category}:{q.question_id}" for q in questions]
    out = save_tree(data, args.out)
    print(f"wrote {out}: {data['nodes']} nodes ({data['tokens_per_forward']} tokens per forward with root and "
          f"retrieval), predicted tau {data['predicted_tau']:.2f}, predicted speedup {data['predicted_speedup']:.2f}x")
    print(f"predicted tau by tree nodes: {data['tau_by_nodes'][:9]}; the retrieval chain alone (0 nodes) would "
          f"give tau {data['tau_by_nodes'][0]:.2f}, speedup {data['speedup_by_nodes'][0]:.2f}x")
    spread = data.get("cost_sweep_spread")
    if spread is not None and spread > 0.2:
        progress(f"warning: the cost sweeps disagree by {spread:.0%} (median over q): other processes competed for "
                 "the CPU, so the budget may be off; re-size later on a quiet machine with --from")
    print("cost curve (ms): " + ", ".join(f"q={q}: {t}" for q, t in data["cost_curve_ms"].items()))
    if args.install:
        installed = save_tree(data, installed_tree_path(args.model))
        print(f"installed as the default tr-jacobi tree for {args.model}: {installed}")
    else:
        print(f"not installed: use it with -o tree={out}, or re-run with --install to make it the default")
    return 0
