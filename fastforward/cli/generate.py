"""``fastforward generate`` and ``fastforward methods``."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import time

import fastforward as ff

from ..errors import UsageError
from ..model import DEFAULT_MODEL, DEFAULT_PASTA_MODEL
from ..proposers import available_methods
from ..request import DEFAULT_METHOD
from ..stats import draft_source_lines, pool_draft_sources
from .options import (
    add_batch_arguments,
    add_method_option_argument,
    add_model_arguments,
    model_load_kwargs,
    parse_options,
    positive_int,
)


def _prefill_progress(min_tokens: int = 1024):
    """A callback printing how far a long prompt has been read on stderr, one line rewritten in place -- when stderr
    is a terminal; ``None`` otherwise (a log or a pipe would get every rewrite as text)."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        terminal = False
    if not terminal:
        return None
    t0 = time.perf_counter()

    def report(done: int, total: int) -> None:
        if total < min_tokens:
            return
        end = "\n" if done == total else ""
        print(f"\rreading the prompt: {done}/{total} tokens ({time.perf_counter() - t0:.1f}s)", end=end,
              file=sys.stderr, flush=True)

    return report


class _DefaultModel(str):
    """``--model``'s default, told apart from the same name given on the command line."""


def add_arguments(p, name: str) -> None:
    if name == "methods":
        p.add_argument("--json", action="store_true", help="print as JSON")
        return
    p.add_argument("prompt", nargs="?", help="the user message (chat-templated unless --no-chat); '-' reads "
                   "standard input")
    p.add_argument("--prompts", metavar="FILE", help="decode every prompt of FILE together, several per forward "
                   "(one per line, or JSON lines: a string or {\"prompt\": ...}); each output equals its solo output")
    add_batch_arguments(p, "--prompts")
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"decoding method, see 'fastforward methods' (default: {DEFAULT_METHOD})")
    add_method_option_argument(p)
    add_model_arguments(p)
    p.set_defaults(model=_DefaultModel(DEFAULT_MODEL))
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="(default: %(default)s)")
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


def _method_text(m) -> str:
    """``fastforward methods``: a method's summary, then one line per option (its default, what it takes, what it
    does) and, for a number, what its upper bound is derived from."""
    lines = [f"{m.name:<12} {m.summary}",
             f"{'':<12} lossless: {'yes' if m.lossless else 'no'}"
             + (f"; from: {m.source}" if m.source and m.source != "-" else "")]
    if not m.schema:
        lines.append(f"{'':<12} options: none")
    for o in m.schema:
        lines += textwrap.wrap(f"{o.name}={o.default!r}: {o.range_text()}; {o.help}", 118,
                               initial_indent=" " * 13, subsequent_indent=" " * 17)
        if o.numeric:
            lines += textwrap.wrap(f"bound {o.high}: {o.bound}", 118, initial_indent=" " * 17,
                                   subsequent_indent=" " * 17)
    return "\n".join(lines)


def run(args, name: str) -> int:
    if name == "methods":
        methods = available_methods()
        if args.json:
            print(json.dumps({m.name: {"summary": m.summary, "lossless": m.lossless, "options": m.options(),
                                       "schema": {o.name: o.describe() for o in m.schema},
                                       "source": m.source} for m in methods.values()}, default=str, indent=1))
            return 0
        for m in methods.values():
            print(_method_text(m))
        return 0

    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give a prompt or --prompts FILE (one of them)")
    if args.prompts is None and (args.no_cut_drafts or args.batch_tokens is not None):
        raise UsageError("--no-cut-drafts and --batch-tokens apply to --prompts FILE (several sequences per forward)")
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=args.stop, chat=not args.no_chat, system=args.system,
        method_options=parse_options(args.option),
    )
    # Every check that does not need the model runs here, before the (slow) model load.
    if args.prompts is not None:
        ff.GenerationRequest("probe", args.method, **kwargs)  # every setting but the prompts, checked once
        located = read_prompts(args.prompts)
        labels = [f"{where}, prompt {n}" for n, (where, _) in enumerate(located, 1)]
        requests = [_request(prompt, args, kwargs, label) for label, (_, prompt) in zip(labels, located, strict=True)]
    else:
        requests = [ff.GenerationRequest(_read_prompt(args.prompt), args.method, **kwargs)]
    t_load = time.perf_counter()
    if args.method == "pasta" and isinstance(args.model, _DefaultModel):
        args.model = DEFAULT_PASTA_MODEL  # no --model given: the default model's PASTA adapter, shipped with it
    target = ff.load(args.model, **model_load_kwargs(args))
    load_seconds = time.perf_counter() - t_load
    if args.prompts is not None:
        _check_prompts_fit(target, requests, labels)
        results = _run_batch(target, requests, args)
    else:
        results = [_run_one(target, requests[0], args)]
    if args.stats:
        print(f"[{args.model}] loaded in {load_seconds:.2f}s (backend {target.backend_name}"
              f"{', ' + target.backend.matmul_kernel if target.backend_name == 'lean' else ''})", file=sys.stderr)
        for result in results:
            print(result.stats.summary(), file=sys.stderr)
            sources = pool_draft_sources([result.stats.method_stats])
            if sources:  # auto: which source drafted
                print("\n".join(draft_source_lines(sources)), file=sys.stderr)
    return 0


def _read_prompt(prompt: str) -> str:
    if prompt != "-":
        return prompt
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise UsageError(f"standard input is not valid UTF-8 text (byte {exc.start})") from None


def _request(prompt, args, kwargs: dict, label: str):
    """The request for one prompt of ``--prompts``; a bad prompt's error names it by ``label`` (file, line)."""
    try:
        return ff.GenerationRequest(prompt, args.method, **kwargs)
    except UsageError as exc:
        raise UsageError(f"--prompts {label}: {exc}") from None


def _check_prompts_fit(target, requests, labels) -> None:
    """Every prompt checked against the loaded model (token ids in its vocabulary, length within its context)
    before any is decoded, so that a bad prompt late in the file is refused by its line before any work, not met
    half-way through the batch."""
    for request, label in zip(requests, labels, strict=True):
        try:
            request.prompt_ids(target)
        except UsageError as exc:
            raise UsageError(f"--prompts {label}: {exc}") from None


#: fields of a JSON-lines record that ask for a per-prompt setting (GenerationRequest's, but the prompt): refused,
#: since every prompt of the file is decoded with the command line's settings
PER_PROMPT_SETTINGS = frozenset(f.name for f in dataclasses.fields(ff.GenerationRequest) if f.init) - {"prompt"}


def read_prompts(path: str) -> list[tuple[str, object]]:
    """Prompts from a file, each as ``(where, prompt)`` -- ``where`` names the file and the line, for errors: JSON
    lines (each a string, or an object with "prompt" -- text, chat messages or token ids), else one prompt per
    non-empty line. A UTF-8 byte-order mark is skipped."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [(f"{path} line {n}", line.rstrip("\n")) for n, line in enumerate(f, 1)]
    except OSError as exc:
        raise UsageError(f"cannot read --prompts {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--prompts {path} is not valid UTF-8 text (byte {exc.start})") from None
    lines = [(where, line) for where, line in lines if line.strip()]
    if not lines:
        raise UsageError(f"--prompts {path} holds no prompt")
    if not lines[0][1].lstrip().startswith(("{", '"')):
        return lines
    return [(where, _json_prompt(where, line)) for where, line in lines]


def _json_prompt(where: str, line: str):
    """The prompt of one JSON line: the line's string, or its object's "prompt"."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--prompts {where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        return record
    if "prompt" not in record:
        raise UsageError(f"--prompts {where}: an object needs a \"prompt\" field")
    settings = sorted(PER_PROMPT_SETTINGS & set(record))
    if settings:
        raise UsageError(f"--prompts {where}: per-prompt settings are not supported ({', '.join(settings)}); "
                         "give them as command-line options, for every prompt")
    return record["prompt"]


def _run_one(target, request, args):
    gen = ff.stream(target, request, on_prefill=_prefill_progress())
    streaming = not (args.no_stream or args.json)
    try:
        if streaming:
            for delta in gen:
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return gen.result
        result = gen.run()
    except KeyboardInterrupt:
        # keep what was produced: the text so far (streaming already showed it), then the interruption
        partial = gen.partial_result("interrupted")
        if streaming:
            sys.stdout.write("\n")
        else:
            _print_result(partial, args)
        raise
    _print_result(result, args)
    return result


def _print_result(result, args, index: int | None = None) -> None:
    if args.json:
        record = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}
        if index is not None:
            record = {"index": index, **record}
        print(json.dumps(record), flush=True)
    else:
        if index is not None:
            print(f"--- [{index}] ---")
        print(result.text, flush=True)


def _run_batch(target, requests, args):
    partial: dict[int, list[int]] = {}

    def collect(i, tokens):
        partial.setdefault(i, []).extend(tokens)

    try:
        results = ff.generate_batch(target, requests, max_batch_tokens=args.batch_tokens, on_tokens=collect,
                                    cut_drafts=not args.no_cut_drafts)
    except KeyboardInterrupt:
        for i in range(len(requests)):  # keep what each sequence had produced
            text = target.decode(partial.get(i, []))
            if args.json:
                print(json.dumps({"index": i, "text": text, "token_ids": partial.get(i, []), "interrupted": True}))
            else:
                print(f"--- [{i}] (interrupted) ---\n{text}")
        raise
    for i, result in enumerate(results):
        _print_result(result, args, index=i)
    return results
