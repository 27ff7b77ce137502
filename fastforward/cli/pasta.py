"""``fastforward pasta ...``: PASTA's tools -- ``annotate`` (PASTA-LANG annotations of make-data answers, without
an external LLM: :mod:`fastforward.pasta.annotate`)."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..pasta.annotate import (
    DEFAULT_MIN_WORDS,
    DEFAULT_SYNC_THRESHOLD,
    DEFAULT_THRESHOLD,
    MODES,
    annotate_file,
    check_annotate,
)
from .options import add_model_arguments, positive_int


def _nats(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{text}'") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (nats), got {text}")
    return value


def _add_annotate(p) -> None:
    p.add_argument("input", metavar="IN", help="make-data records: a make-data folder or its responses.jsonl")
    p.add_argument("output", metavar="OUT", help="annotated records (JSONL; the same command resumes it)")
    add_model_arguments(p)
    p.add_argument("--mode", default="likelihood", choices=MODES,
                   help="likelihood: structure candidates kept only if the target's loss on them barely rises with "
                        "their siblings hidden, syncs where later text needs them; structure: every candidate "
                        "async, a sync after each group (the APAR-like baseline) (default: %(default)s)")
    p.add_argument("--threshold", type=_nats, default=DEFAULT_THRESHOLD,
                   help="most a chunk's mean per-token loss may rise with its siblings hidden, in nats "
                        "(default: %(default)s)")
    p.add_argument("--sync-threshold", type=_nats, default=DEFAULT_SYNC_THRESHOLD,
                   help="a main-thread unit whose loss rises more than this without the blocks gets a <sync/> "
                        "before it, in nats (default: %(default)s)")
    p.add_argument("--min-words", type=positive_int, default=DEFAULT_MIN_WORDS,
                   help="fewest words of an async chunk (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N records only")


def _run_annotate(args) -> int:
    import fastforward as ff

    # the files and settings are checked before the model loads
    check_annotate(args.input, args.output, args.mode, args.threshold, args.sync_threshold, args.min_words)
    target = ff.load(args.model, backend=args.backend, threads=args.threads, weights=args.weights)
    counts = annotate_file(target, args.input, args.output, mode=args.mode, threshold=args.threshold,
                           sync_threshold=args.sync_threshold, min_words=args.min_words, limit=args.limit)
    print(f"saved {args.output}: {counts['annotated']} records annotated ({counts['with_tags']} with tags), "
          f"{counts['skipped']} already there")
    return 0


COMMANDS = {"annotate": ("annotate make-data answers with PASTA-LANG (no external LLM)", _add_annotate,
                         _run_annotate)}


def add_arguments(p, name: str) -> None:
    sub = p.add_subparsers(dest="pasta_command", metavar="COMMAND", parser_class=type(p))
    for command, (summary, add, _) in COMMANDS.items():
        cp = sub.add_parser(command, help=summary, description=summary)
        cp.set_defaults(_pasta_command=command)
        add(cp)


def run(args, name: str) -> int:
    command = getattr(args, "_pasta_command", None)
    if command is None:
        raise UsageError(f"give a pasta command: {', '.join(COMMANDS)} (see 'fastforward pasta --help')")
    return int(COMMANDS[command][2](args) or 0)
