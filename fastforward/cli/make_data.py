"""``fastforward make-data``: the target's own greedy responses to training prompts, for drafters
(:func:`fastforward.train.make_data.make_data`)."""

from __future__ import annotations

from ..train.make_data import DEFAULT_HELDOUT, DEFAULT_SOURCES, RESPONSES, default_out, make_data
from .options import add_model_arguments, max_new_tokens, positive_int, seed


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
    p.add_argument("--max-active", type=positive_int, default=8,
                   help="sequences decoding together (default: %(default)s)")
    p.add_argument("--features", action="store_true",
                   help="also store the target's features per token (bf16, OUT/features/) for drafter training")
    p.add_argument("--seed", type=seed, default=0, help="order of the mixed prompts (default: 0)")


def run(args, name: str) -> int:
    import fastforward as ff

    target = ff.load(args.model, backend=args.backend, threads=args.threads, weights=args.weights)
    out = args.out or default_out(target.name)
    summary = make_data(target, out, sources=args.data, limit=args.limit, max_new_tokens=args.max_new_tokens,
                        heldout=args.heldout, seed=args.seed, max_active=args.max_active, features=args.features)
    print(f"saved {out}/{RESPONSES}: {summary['records']} records ({summary['new_tokens']} new tokens in "
          f"{summary['seconds']} s)")
    return 0
