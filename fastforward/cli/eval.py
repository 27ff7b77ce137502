"""``fastforward eval``: the task quality of a model (held-out NLL, GSM8K accuracy, HumanEval pass@1) and a trained
drafter's held-out agreement with it by depth; the tasks themselves are :mod:`fastforward.evaluate`'s and
:mod:`fastforward.train.agreement`'s."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import fastforward as ff

from ..errors import UsageError
from ..evaluate import (
    DEFAULT_MAX_NEW_TOKENS,
    TASKS,
    EvalInterrupted,
    compare_samples,
    eval_gsm8k,
    eval_humaneval,
    eval_nll,
    heldout_examples,
    is_eval_file,
    load_comparison,
    load_gsm8k,
    load_humaneval,
    summary_line,
    task_file,
)
from ..paths import check_output_file
from ..request import check_method
from ..train.data import check_heldout, parse_paths
from .options import (
    add_method_option_argument,
    add_model_arguments,
    finite_float,
    max_new_tokens,
    parse_options,
    positive_float,
    positive_int,
)

NLL_DEFAULTS = {"heldout": 0.05, "max_length": 512, "noise_length": 4}
HUMANEVAL_TIMEOUT = 10.0
NLL_FLAGS = {"--heldout": "heldout", "--max-length": "max_length", "--noise-length": "noise_length"}
GENERATION_FLAGS = {"--method": "method", "-o": "option", "--max-new-tokens": "max_new_tokens",
                    "--timeout": "timeout", "--compare": "compare"}


def add_arguments(p, name: str) -> None:
    p.add_argument("--task", required=True, choices=TASKS, help="what to measure")
    add_model_arguments(p)
    p.add_argument("--drafter", default=None,
                   help="agreement: the drafter folder to score (EAGLE-3, FastEagle, Falcon or draft model)")
    p.add_argument("--data", default=None,
                   help="nll: the training data file(s) whose held-out split to score (required); agreement: the "
                        "'fastforward make-data' folder whose held-out records to score (required); gsm8k/humaneval: "
                        "the test file (default: shared/data/gsm8k/test.jsonl, "
                        "shared/data/humaneval/HumanEval.jsonl.gz)")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N items")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=None,
                   help="generation budget (default: gsm8k 256, humaneval 512)")
    p.add_argument("--method", default=None, help="decoding method for generation tasks (default: ar)")
    add_method_option_argument(p, "a method option (repeatable)")
    p.add_argument("--heldout", type=finite_float, default=None,
                   help=f"nll: held-out fraction, as given to 'fastforward train' (default: {NLL_DEFAULTS['heldout']})")
    p.add_argument("--max-length", type=int, default=None,
                   help=f"nll: tokens per record, as given to 'fastforward train' "
                        f"(default: {NLL_DEFAULTS['max_length']})")
    p.add_argument("--timeout", type=positive_float, default=None,
                   help=f"humaneval: seconds per program (default: {HUMANEVAL_TIMEOUT:g})")
    p.add_argument("--noise-length", type=int, default=None,
                   help="nll: also score the predictions made from one seeded ahead-noise segment of this many "
                        "response tokens per record, as 'fastforward train msn' trains them "
                        f"(0 = off; default: {NLL_DEFAULTS['noise_length']})")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--save", metavar="FILE", default=None,
                   help="write the summary and every sample's result as JSON (a new file, or one an earlier "
                        "'--save' wrote; on Ctrl-C, the items scored so far)")
    p.add_argument("--compare", metavar="FILE", default=None,
                   help="gsm8k/humaneval: a '--save' file of another model (or method) on the same task; reports how "
                        "many samples got the same answer and the identical text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _only_for(args, flags: dict, tasks: str) -> None:
    """Options (``{flag: dest}``) that apply to other tasks only: given here, they are refused, not ignored."""
    given = [flag for flag, dest in flags.items() if getattr(args, dest) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --task {tasks}, "
                         f"not {args.task}")


def _check_nll(args) -> list:
    """The nll options filled in and checked, and the held-out records read, before the model loads."""
    _only_for(args, GENERATION_FLAGS, "gsm8k or humaneval")
    for dest, value in NLL_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if not args.data:
        raise UsageError("--task nll needs --data FILE[,FILE] (the training data whose held-out split to score)")
    parse_paths(args.data)
    check_heldout(args.heldout)
    if args.max_length < 2:
        raise UsageError(f"--max-length must be at least 2, got {args.max_length}")
    if args.noise_length < 0:
        raise UsageError(f"--noise-length must be 0 (off) or positive, got {args.noise_length}")
    return heldout_examples(args.data, args.heldout, args.limit)


def _check_agreement(args) -> None:
    """The agreement options checked, before the model loads."""
    from ..train.agreement import drafter_kind, heldout_records

    _only_for(args, {**GENERATION_FLAGS, **NLL_FLAGS}, "gsm8k, humaneval or nll")
    if not args.drafter or not args.data:
        raise UsageError("--task agreement needs --drafter FOLDER and --data MAKE_DATA_FOLDER")
    drafter_kind(args.drafter)
    heldout_records(args.data, args.limit)


def _check_generation(args, options: dict) -> tuple[Path, list]:
    """The generation options filled in and checked, and the task's records read, before the model loads."""
    _only_for(args, NLL_FLAGS, "nll")
    if args.task == "gsm8k" and args.timeout is not None:
        raise UsageError("--timeout applies to --task humaneval, not gsm8k")
    if args.data == "":
        raise UsageError("--data is empty: give the test file, or leave --data out for the shared data set's")
    args.method = args.method or "ar"
    args.timeout = HUMANEVAL_TIMEOUT if args.timeout is None else args.timeout
    check_method(args.method, options)  # the name and the options' names, as every request is checked
    path = task_file(args.task, args.data)
    rows = (load_gsm8k if args.task == "gsm8k" else load_humaneval)(path, args.limit)
    if not rows:
        raise UsageError(f"no {args.task} records in {path}")
    if args.max_new_tokens is None:
        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS[args.task]
    return path, rows


def run(args, name: str) -> int:
    options = parse_options(args.option)
    rows = held = None
    if args.task != "agreement" and args.drafter is not None:
        raise UsageError(f"--drafter applies to --task agreement, not {args.task}")
    if args.task == "nll":
        held = _check_nll(args)
    elif args.task == "agreement":
        _check_agreement(args)
    else:
        path, rows = _check_generation(args, options)
    reference = None
    if args.compare:
        reference = load_comparison(args.compare, args.task)
    if args.save:
        check_output_file(args.save, "--save", owned=is_eval_file)  # before the work, not after it

    t0 = time.perf_counter()
    backend = "hf" if args.task == "nll" and args.backend == "auto" else args.backend
    target = ff.load(args.model, backend=backend, threads=args.threads, weights=args.weights)

    def progress(items):
        from tqdm.auto import tqdm

        return tqdm(items, desc=f"eval {args.task}", unit="item", disable=args.quiet, file=sys.stderr,
                    dynamic_ncols=True, mininterval=1.0)

    interrupted = False
    try:
        if args.task == "agreement":
            from ..train.agreement import drafter_agreement

            result = drafter_agreement(args.drafter, target, args.data, limit=args.limit)
        elif args.task == "nll":
            result = eval_nll(target, args.data, heldout=args.heldout, max_length=args.max_length, limit=args.limit,
                              noise_length=args.noise_length, held=held)
        elif args.task == "gsm8k":
            result = eval_gsm8k(target, rows, method=args.method, max_new_tokens=args.max_new_tokens,
                                options=options, progress=progress)
        else:
            result = eval_humaneval(target, rows, method=args.method, max_new_tokens=args.max_new_tokens,
                                    options=options, timeout=args.timeout, progress=progress)
    except EvalInterrupted as exc:  # Ctrl-C: report (and --save) the items scored so far, then exit 130
        result, interrupted = exc.result, True
    seconds = time.perf_counter() - t0
    summary = {"task": args.task, "model": args.model, "seconds": round(seconds, 2)}
    if args.task not in ("nll", "agreement"):
        summary.update(method=args.method, max_new_tokens=args.max_new_tokens, data=str(path))
    else:
        summary["data"] = args.data
    if args.task == "agreement":
        summary["drafter"] = args.drafter
    summary.update({k: v for k, v in result.items() if k != "samples"})
    if interrupted:
        summary["interrupted"] = f"{result['n']} of {len(rows)} items"
    if reference is not None:
        summary["agreement"] = compare_samples(args.task, result["samples"], reference)
    if args.save:
        Path(args.save).expanduser().write_text(json.dumps({**summary, "samples": result.get("samples", [])}, indent=1))
    if args.json:
        print(json.dumps(summary))
    else:
        print(summary_line(summary))
    if interrupted:
        raise KeyboardInterrupt(f"the summary above covers the {summary['interrupted']} scored before it"
                                + (f"; saved in {args.save}" if args.save else ""))
    return 0
