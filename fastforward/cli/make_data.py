"""``fastforward make-data``: the target's own greedy responses to training prompts, for drafters
(:func:`fastforward.train.make_data.make_data`)."""

from __future__ import annotations

from ..train.make_data import (
    DEFAULT_HELDOUT,
    DEFAULT_SOURCES,
    RESPONSES,
    check_make_data,
    default_out,
    make_data,
    write_heldout_prompts,
)
from .options import (
    add_model_arguments,
    int_between,
    max_new_tokens,
    model_load_kwargs,
    positive_int,
    seed,
    temperature,
)


def add_arguments(p, name: str) -> None:
    add_model_arguments(p)
    p.add_argument("--data", default=None,
                   help="prompt files, comma-separated (ShareGPT, Alpaca-style, GSM8K or 'prompt' records; default: "
                        + ", ".join(DEFAULT_SOURCES) + " from the shared data folder)")
    p.add_argument("--out", default=None,
                   help="output folder (default: the cache's data/<model>); the same command resumes it")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N prompts of the mixed order only")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=256,
                   help="response budget per prompt (default: %(default)s)")
    p.add_argument("--heldout", type=float, default=DEFAULT_HELDOUT,
                   help="fraction of prompts marked held out, by a hash of the prompt (default: %(default)s)")
    p.add_argument("--max-active", type=int_between(1, 1024), default=8,
                   help="sequences decoding together (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int_between(1, 4096), default=None,
                   help="rows of one shared forward (default: from this machine's cost curve); a large one (64) "
                        "makes more tokens per second when the forward's cost per row still falls there")
    p.add_argument("--method", choices=("pld", "ar"), default="pld",
                   help="how responses decode (the same tokens either way): pld (prompt lookup, default) or ar (one "
                        "token per step; faster when many sequences share each forward on a CPU where rows are "
                        "dear: 392 against 353 tokens/s with 64 at a time on the AVX2 EPYC)")
    p.add_argument("--features", action="store_true",
                   help="also store the target's features per token (bf16, OUT/features/) for drafter training")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0: greedy responses (default); above 0: one sampled response per prompt, seeded by the "
                        "prompt and --seed, kept beside the greedy ones in the same folder")
    p.add_argument("--seed", type=seed, default=0,
                   help="order of the mixed prompts, and the samples with --temperature (default: 0)")
    p.add_argument("--write-heldout", metavar="FILE", default=None,
                   help="only write the held-out prompts (never trained on) as a 'fastforward bench --questions' "
                        "file, by category (chat = ShareGPT, alpaca, code, gsm8k_train, summary, sql), and stop")


def run(args, name: str) -> int:
    import fastforward as ff

    if args.write_heldout:
        counts = write_heldout_prompts(args.write_heldout, args.data, heldout=args.heldout, seed=args.seed)
        print(f"saved {args.write_heldout}: " + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())))
        return 0

    # the inputs and --out are checked before the model loads
    check_make_data(args.out, sources=args.data, limit=args.limit, heldout=args.heldout, seed=args.seed)
    target = ff.load(args.model, **model_load_kwargs(args))
    out = args.out or default_out(target.name)
    summary = make_data(target, out, sources=args.data, limit=args.limit, max_new_tokens=args.max_new_tokens,
                        heldout=args.heldout, seed=args.seed, max_active=args.max_active, features=args.features,
                        max_batch_tokens=args.max_batch_tokens, temperature=args.temperature,
                        method=args.method)
    print(f"saved {out}/{RESPONSES}: {summary['records']} records ({summary['new_tokens']} new tokens in "
          f"{summary['seconds']} s)")
    return 0
