"""``fastforward collect-trajectories``: the Jacobi trajectories CLLM trains on (the collection is
:func:`fastforward.train.trajectories.collect`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..train.trajectories import TRAJECTORIES, collect
from .options import add_model_argument, add_threads_argument, finite_float, max_new_tokens, seed

AUGMENT_PROB = 0.5


def add_arguments(p, name: str) -> None:
    add_model_argument(p, "target model")
    p.add_argument("--prompts", required=True,
                   help="prompt file: .jsonl with 'question' (GSM8K), 'turns' (first turn used) or 'prompt', or "
                        "alpaca .json/.jsonl ('instruction' [+ 'input'])")
    p.add_argument("--out", required=True,
                   help="output folder: trajectories.jsonl, prompts.jsonl, meta.json; new, empty, or one an earlier "
                        "collect-trajectories wrote (the same command resumes it)")
    p.add_argument("--n-token", type=int, default=16, help="Jacobi block size n (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=256,
                   help="answer budget per prompt, N in Algorithm 1 (default: %(default)s)")
    p.add_argument("--augment", action="store_true",
                   help="randomly correct wrong tokens of intermediate states (CLLM §3.2.1 data augmentation)")
    p.add_argument("--augment-prob", type=finite_float, default=None,
                   help=f"with --augment, the chance that each wrong token is corrected (default: {AUGMENT_PROB})")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of the file only")
    p.add_argument("--seed", type=seed, default=0, help="block initialisation and augmentation (default: 0)")
    g = p.add_argument_group("repetition filter (post-processing)")
    g.add_argument("--ngram", type=int, default=4, help="token n-gram size of the token-level rule (default: 4)")
    g.add_argument("--max-ngram-repeat", type=finite_float, default=0.4,
                   help="drop an answer whose fraction of repeated n-grams exceeds this (default: %(default)s)")
    g.add_argument("--max-sentence-repeats", type=int, default=2,
                   help="drop an answer in which a sentence occurs more often than this (default: %(default)s)")
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def augment_prob(args) -> float:
    """``--augment-prob``: only with ``--augment`` (given alone it would be ignored, so it is refused)."""
    if args.augment_prob is not None and not args.augment:
        raise UsageError("--augment-prob applies with --augment only")
    return AUGMENT_PROB if args.augment_prob is None else args.augment_prob


def run(args, name: str) -> int:
    meta = collect(
        args.model, args.prompts, args.out, n_token=args.n_token, max_new_tokens=args.max_new_tokens,
        augment=args.augment, augment_prob=augment_prob(args), limit=args.limit, seed=args.seed, ngram=args.ngram,
        max_ngram_repeat=args.max_ngram_repeat, max_sentence_repeats=args.max_sentence_repeats,
        threads=args.threads, quiet=args.quiet,
    )
    dropped = meta["dropped_token_repetition"] + meta["dropped_sentence_repetition"]
    print(
        f"saved {Path(args.out).expanduser() / TRAJECTORIES}: {meta['records']} records from "
        f"{meta['prompts_kept']} prompts ({dropped} dropped as repetitive; {meta['prompts_done']}/"
        f"{meta['prompts_total']} prompts done, {meta['seconds_this_run']:.1f}s this run)"
    )
    return 0
