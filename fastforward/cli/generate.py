"""``fastforward generate`` and ``fastforward methods``."""

from __future__ import annotations

import json
import sys
import time

import fastforward as ff

from ..errors import UsageError
from ..proposers import available_methods
from .options import add_method_option_argument, add_model_arguments, parse_options


def _prefill_progress(min_tokens: int = 1024):
    """A callback printing how far a long prompt has been read (on stderr, one line rewritten in place)."""
    t0 = time.perf_counter()

    def report(done: int, total: int) -> None:
        if total < min_tokens:
            return
        end = "\n" if done == total else ""
        print(f"\rreading the prompt: {done}/{total} tokens ({time.perf_counter() - t0:.1f}s)", end=end,
              file=sys.stderr, flush=True)

    return report


def add_arguments(p, name: str) -> None:
    if name == "methods":
        p.add_argument("--json", action="store_true", help="print as JSON")
        return
    p.add_argument("prompt", help="the user message (chat-templated unless --no-chat); '-' reads standard input")
    p.add_argument("--method", default="ar", help="decoding method, see 'fastforward methods' (default: ar)")
    add_method_option_argument(p)
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling and random draft initialisation")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--no-stream", action="store_true", help="print the answer when complete instead of streaming")
    p.add_argument("--stats", action="store_true", help="print run statistics to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")


def run(args, name: str) -> int:
    if name == "methods":
        methods = available_methods()
        if args.json:
            print(json.dumps({m.name: {"summary": m.summary, "lossless": m.lossless, "options": m.options(),
                                       "source": m.source} for m in methods.values()}, default=str, indent=1))
            return 0
        for m in methods.values():
            opts = ", ".join(f"{k}={v!r}" for k, v in m.options().items()) or "-"
            print(f"{m.name:<12} {m.summary}\n{'':<12} lossless: {'yes' if m.lossless else 'no'}; options: {opts}"
                  + (f"; from: {m.source}" if m.source and m.source != '-' else ""))
        return 0

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    options = parse_options(args.option)
    methods = available_methods()
    if args.method not in methods:  # before the (slow) model load
        raise UsageError(f"unknown method '{args.method}'; available: {', '.join(methods)}")
    # Validate everything that does not need the model before the (slow) model load.
    ff.SamplingConfig(args.temperature, args.top_k, args.top_p)
    unknown = sorted(set(options) - set(methods[args.method].options()))
    if unknown:
        known = ", ".join(methods[args.method].options()) or "none"
        raise UsageError(f"method '{args.method}' has no option {', '.join(unknown)} (its options: {known})")
    if args.stop and any(not s for s in args.stop):
        raise UsageError("stop strings must be non-empty")
    if args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    t_load = time.perf_counter()
    target = ff.load(args.model, backend=args.backend, threads=args.threads, weights=args.weights)
    load_seconds = time.perf_counter() - t_load
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=args.stop, chat=not args.no_chat, system=args.system, method_options=options,
        on_prefill=_prefill_progress(),
    )
    if args.no_stream or args.json:
        result = ff.generate(target, prompt, args.method, **kwargs)
        if args.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
        else:
            print(result.text)
    else:
        gen = ff.stream(target, prompt, args.method, **kwargs)
        for delta in gen:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        result = gen.result
    if args.stats:
        print(f"[{args.model}] loaded in {load_seconds:.2f}s (backend {target.backend_name}"
              f"{', ' + target.backend.matmul_kernel if target.backend_name == 'lean' else ''})", file=sys.stderr)
        print(result.stats.summary(), file=sys.stderr)
    return 0
