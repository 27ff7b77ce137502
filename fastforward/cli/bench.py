"""``fastforward bench``: measure decoding methods side by side on question files (the harness is
:mod:`fastforward.bench`).

Method specs: ``[LABEL=]METHOD[:KEY=VALUE[:KEY=VALUE...]]``, comma-separated, e.g.
``--methods ar,pld,pld-long=pld:num_pred_tokens=20,tr-jacobi-69=tr-jacobi:tree=trees/msn69.json``.
``--method-option LABEL.KEY=VALUE`` sets an option too (for values holding ``:`` or ``,``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import fastforward as ff

from ..bench.compare import compare_ar, write_comparison
from ..bench.methods import apply_option_flags, check_spec_on, parse_specs, resolve_specs
from ..bench.peers import check_peers
from ..bench.questions import load_questions, select_questions
from ..bench.report import write_report
from ..bench.results import is_bench_folder, require_results
from ..bench.runner import precheck, run_bench
from ..errors import UsageError
from ..paths import check_output_dir, mark_output_dir
from ..proposers import available_methods
from .options import (
    add_batch_arguments,
    add_model_arguments,
    max_new_tokens,
    model_load_kwargs,
    nonnegative_int,
    positive_int,
    seed,
    temperature,
)


def add_arguments(p, name: str) -> None:
    p.add_argument("--questions", action="append", metavar="PATH",
                   help="question file (.jsonl, .jsonl.gz, .json): Spec-Bench/MT-Bench, HumanEval, GSM8K, plain "
                        "prompts, Alpaca; repeatable or comma-separated")
    p.add_argument("--categories", default=None, help="comma-separated categories (or MT-Bench subcategories)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--per-category", default=None, metavar="N",
                     help="N questions from each category; CATEGORY=M sets one category's count (e.g. "
                          "'4,humaneval=40'; with only CATEGORY=M entries the other categories are left out)")
    sel.add_argument("--limit", type=int, default=None, metavar="N", help="N questions in all")
    p.add_argument("--select", choices=["spread", "first"], default="spread",
                   help="which N: evenly spaced through each category (default) or the first N")
    p.add_argument("--mt-bench-subcategories", action="store_true",
                   help="keep MT-Bench's 8 categories instead of folding them into 'mt_bench' as Spec-Bench does")
    p.add_argument("--methods", action="append", metavar="SPECS",
                   help="comma-separated [LABEL=]METHOD[:KEY=VALUE...]; 'all' = every registered method (the "
                        "default); 'ar' is always run, as the baseline")
    p.add_argument("-o", "--method-option", action="append", metavar="LABEL.KEY=VALUE",
                   help="an option of the method with that label (repeatable)")
    p.add_argument("--peers", default=None, metavar="PEERS",
                   help="also run other libraries on the same prompts: hf-generate, hf-pld, llama-cpp, "
                        "llama-cpp-pld (comma-separated, same spec syntax; llama-cpp needs a .gguf model and "
                        "llama-cpp-python)")
    add_model_arguments(p, threads_help="torch threads, fixed for the run and recorded (default: torch's choice, "
                                        "recorded)",
                        weights_help="weight storage (see fastforward generate --help; default: auto)")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=256, help="(default: %(default)s)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0 = greedy (default); > 0 samples and skips the losslessness check")
    p.add_argument("--seed", type=seed, default=0, help="seed for sampling and random draft initialisation "
                                                        "(default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=1, help="timed runs per question and method (default: 1)")
    p.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="untimed warm-up generations per method (default: 1)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="output folder: new, empty, or one an earlier 'fastforward bench' wrote (resumed) "
                        "(default: %(default)s)")
    p.add_argument("--force", action="store_true", help="re-measure what DIR/results.jsonl already holds")
    p.add_argument("--compare-ar", default=None, metavar="DIR",
                   help="after the run, compare its AR outputs with those of an earlier run in DIR (another commit, "
                        "--weights or machine): identical questions, and each first divergence with its logit gap")
    p.add_argument("--report-only", action="store_true",
                   help="only regenerate summary.json, report.md and plots from DIR/results.jsonl")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--batch", default=None, metavar="B[,B...]",
                   help="throughput mode: decode the questions' first turns B at a time, several sequences per "
                        "forward, for each B (B=1 always runs, as the reference) and each method (default ar,pld); "
                        "writes DIR/batch.md and DIR/batch.json")
    add_batch_arguments(p, "--batch")


def _split(values: list[str] | None) -> list[str]:
    return [x.strip() for v in values or [] for x in v.split(",") if x.strip()]


def canonical_command(args, specs, peers) -> str:
    """The command line that reproduces this run (every effective setting spelled out)."""
    parts = ["fastforward", "bench"]
    for q in _split(args.questions):
        parts += ["--questions", q]
    if args.categories:
        parts += ["--categories", args.categories]
    if args.per_category is not None:
        parts += ["--per-category", str(args.per_category)]
    if args.limit is not None:
        parts += ["--limit", str(args.limit)]
    if args.select != "spread":
        parts += ["--select", args.select]
    if args.mt_bench_subcategories:
        parts.append("--mt-bench-subcategories")
    parts += ["--methods", ",".join(s.describe() for s in specs)]
    if peers:
        parts += ["--peers", ",".join(s.describe() for s in peers)]
    parts += ["--model", args.model]
    if args.backend != "auto":
        parts += ["--backend", args.backend]
    if args.weights != "auto":
        parts += ["--weights", args.weights]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    parts += ["--max-new-tokens", str(args.max_new_tokens), "--temperature", f"{args.temperature:g}",
              "--seed", str(args.seed), "--repeats", str(args.repeats)]
    if args.warmup != 1:
        parts += ["--warmup", str(args.warmup)]
    parts += ["--out", args.out]
    return shlex.join(parts)


def _print_overall(summary: dict, out_dir: Path) -> None:
    vs_llama = any(m.get("speedup_vs_llama_cpp_geomean") is not None for m in summary["methods"].values())
    extra = f" {'vs llama.cpp e2e':>16} {'decode':>6}" if vs_llama else ""
    print(f"{'method':<20} {'tok/s':>8} {'decode':>8} {'ttft ms':>8} {'geomean':>8} {'arith':>8} {'total':>8} "
          f"{'tau':>6} {'draft ms':>8} {'mismatch':>8}{extra}")
    for label, m in summary["methods"].items():
        def f(x, nd=2):
            return "-" if x is None else f"{x:.{nd}f}"

        draft_ms = "-" if m["kind"] == "peer" else f(m.get("draft_ms_per_step"))  # drafting per decoding step
        mism = "n/a" if not m["checked"] else str(m["mismatches"])
        if not m["checked"] and m.get("agreement"):  # a peer with other arithmetic: its agreement with AR
            mism = f"~{m['agreement']['identical_prefix_fraction']:.0%}"
        ttft = None if m.get("ttft") is None else 1000 * m["ttft"]
        e2e, decode = m.get("speedup_vs_llama_cpp_geomean"), m.get("speedup_vs_llama_cpp_decode_geomean")
        against = f" {f(e2e):>16} {f(decode):>6}" if vs_llama else ""
        print(f"{label:<20} {f(m['tokens_per_s'], 1):>8} {f(m.get('decode_tokens_per_s'), 1):>8} {f(ttft, 0):>8} "
              f"{f(m['speedup_geomean']):>8} {f(m['speedup_arith']):>8} {f(m['speedup_total']):>8} {f(m['tau']):>6} "
              f"{draft_ms:>8} {mism:>8}{against}")
    print(f"report: {out_dir / 'report.md'}")


def run(args, name: str) -> int:
    out_dir = Path(args.out).expanduser()
    if args.report_only:
        rows = require_results(out_dir)
        check_output_dir(out_dir, "bench", owned=is_bench_folder)
        summary = write_report(out_dir, rows)
        _print_overall(summary, out_dir)
        return 0

    # Everything that can be wrong with the input is checked before the (slow) model load.
    if args.batch is None and (args.no_cut_drafts or args.batch_tokens is not None):
        raise UsageError("--no-cut-drafts and --batch-tokens apply to --batch (several sequences per forward)")
    if not args.questions:
        raise UsageError("give at least one --questions file")
    if args.compare_ar and not (Path(args.compare_ar) / "results.jsonl").is_file():
        raise UsageError(f"--compare-ar: no results.jsonl in {args.compare_ar}")
    methods = []
    from_all = set()  # labels 'all' added: dropped later when they cannot run on this model (no trained drafter)
    for spec in parse_specs(args.methods or (["ar,pld"] if args.batch is not None else ["all"])):
        if spec.label == spec.method == "all" and not spec.options:  # every registered method, defaults
            added = [s for s in parse_specs([",".join(available_methods())])
                     if s.label not in {m.label for m in methods}]
            from_all |= {s.label for s in added}
            methods += added
        else:
            methods.append(spec)
    peers = parse_specs([args.peers] if args.peers else [], kind="peer")
    apply_option_flags(methods + peers, args.method_option)
    specs = resolve_specs(methods, peers)
    check_peers(peers, args.model)  # llama.cpp peers: a GGUF model and llama-cpp-python, before any work
    questions = load_questions(_split(args.questions), fold_mt_bench=not args.mt_bench_subcategories)
    questions = select_questions(questions, _split([args.categories]) if args.categories else None,
                                 args.per_category, args.limit, spread=args.select == "spread")
    known = {"model": args.model, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
             "seed": args.seed}
    if args.threads is not None:
        known["threads"] = args.threads
    check_output_dir(out_dir, "bench", owned=is_bench_folder)  # never writes into a folder it did not write
    if args.batch is not None:
        return _run_batch_mode(args, [s for s in specs if s.kind == "method"], questions, out_dir)
    precheck(out_dir, known, args.force)
    target = ff.load(args.model, **model_load_kwargs(args))
    specs = _runnable(specs, target, optional=from_all)  # every method's option values, before any question
    mark_output_dir(out_dir, "bench")
    command = canonical_command(args, [s for s in specs if s.kind == "method"], [s for s in specs if s.kind == "peer"])
    print(f"fastforward bench: {len(questions)} questions x {len(specs)} methods x {args.repeats} repeat(s) "
          f"-> {out_dir / 'results.jsonl'}", file=sys.stderr)
    run_bench(target, questions, specs, out_dir, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              seed=args.seed, repeats=args.repeats, warmup=args.warmup, force=args.force,
              progress=not args.no_progress, command=command, report=False)
    summary = write_report(out_dir, require_results(out_dir))
    _print_overall(summary, out_dir)
    if args.compare_ar:
        result = compare_ar(target, questions, out_dir, Path(args.compare_ar))
        path = write_comparison(result, out_dir, Path(args.compare_ar))
        print(f"AR outputs vs {args.compare_ar}: {result['identical']}/{result['questions']} questions identical "
              f"({path})", file=sys.stderr)
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--batch takes comma-separated positive integers, got '{text}'") from None
    if not sizes or any(b < 1 for b in sizes):
        raise UsageError(f"--batch takes comma-separated positive integers, got '{text}'")
    return sorted(set(sizes) | {1})


def _run_batch_mode(args, specs, questions, out_dir: Path) -> int:
    """``--batch``: aggregate throughput and per-sequence latency of B sequences per forward."""
    from ..bench.batch import format_batch_table, run_batch_throughput, write_batch_results
    from ..bench.runner import turn_prompt

    sizes = _batch_sizes(args.batch)
    if args.temperature != 0:
        raise UsageError("--batch measures greedy decoding (--temperature 0)")
    if any(s.options for s in specs):
        raise UsageError("--batch runs methods with their default options")
    target = ff.load(args.model, **model_load_kwargs(args))
    _runnable(specs, target)
    mark_output_dir(out_dir, "bench")
    prompts = [turn_prompt(target, q.turns[:1], []) for q in questions]
    print(f"fastforward bench --batch: {len(prompts)} prompts x {len(specs)} methods x B in {sizes}, "
          f"rows per forward {args.batch_tokens or ff.batch_token_budget(target)}", file=sys.stderr)

    def progress(row):
        print(f"  {row.method} B={row.batch}: {row.tokens_per_s:.1f} tok/s, latency mean {row.latency_mean_s:.2f}s",
              file=sys.stderr)

    rows = run_batch_throughput(target, prompts, [s.method for s in specs], sizes, args.max_new_tokens,
                                args.batch_tokens, progress=progress, cut_drafts=not args.no_cut_drafts)
    meta = {"command": shlex.join(["fastforward", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 else "",
            "model": args.model, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
            "cut_drafts": not args.no_cut_drafts,
            "questions": [q.question_id for q in questions], "matmul": getattr(target.backend, "matmul_kernel", "")}
    path = write_batch_results(rows, out_dir, meta)
    print(format_batch_table(rows))
    print(f"report: {path}")
    return 0


def _runnable(specs, target, optional=frozenset()) -> list:
    """``specs`` with every method's options checked on ``target`` (:func:`check_spec_on`): a bad one is a one-line
    error, except for labels in ``optional`` (methods 'all' added, e.g. a trained-drafter method with no drafter
    shipped for this model), which are left out and said so on stderr."""
    kept = []
    for spec in specs:
        try:
            check_spec_on(spec, target)
        except UsageError as exc:
            if spec.label not in optional:
                raise
            print(f"fastforward bench: leaving out '{spec.label}': {exc}", file=sys.stderr)
            continue
        kept.append(spec)
    return kept
