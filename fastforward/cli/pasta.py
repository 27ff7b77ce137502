"""``fastforward pasta ...``: PASTA's tools -- ``annotate`` (PASTA-LANG annotations of make-data answers, without
an external LLM: :mod:`fastforward.train.pasta.annotate`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..train.pasta.annotate import (
    DEFAULT_MIN_SAVING,
    DEFAULT_MIN_WORDS,
    DEFAULT_SYNC_THRESHOLD,
    DEFAULT_THRESHOLD,
    DEFAULT_TOPIC_WORDS,
    MODES,
    annotate_file,
    check_annotate,
)
from .options import (
    add_model_arguments,
    add_subcommands,
    model_load_kwargs,
    positive_int,
    run_subcommand,
    thread_count,
)


def _nats(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{text}'") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (nats), got {text}")
    return value


def _forwards_or_off(text: str) -> int | None:
    if text.strip().lower() == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a whole number of forwards or 'off', got '{text}'") from None


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
    p.add_argument("--topic-words", type=positive_int, default=DEFAULT_TOPIC_WORDS,
                   help="most words of a promise's topic; each topic token is a forward on the main thread "
                        "(default: %(default)s)")
    p.add_argument("--min-saving", type=_forwards_or_off, default=DEFAULT_MIN_SAVING,
                   help="likelihood mode: a group of blocks stays async only if it shortens the critical path by "
                        "at least this many forwards; 'off' keeps every group (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N records only")


def _run_annotate(args) -> int:
    import fastforward as ff

    # the files and settings are checked before the model loads
    check_annotate(args.input, args.output, args.mode, args.threshold, args.sync_threshold, args.min_words,
                   args.topic_words, args.min_saving)
    target = ff.load(args.model, **model_load_kwargs(args))
    counts = annotate_file(target, args.input, args.output, mode=args.mode, threshold=args.threshold,
                           sync_threshold=args.sync_threshold, min_words=args.min_words,
                           topic_words=args.topic_words, min_saving=args.min_saving, limit=args.limit)
    print(f"saved {args.output}: {counts['annotated']} records annotated ({counts['with_tags']} with tags), "
          f"{counts['skipped']} already there")
    return 0


def _judge_url(text: str) -> str:
    from ..train.pasta.judge import check_judge_url

    try:
        return check_judge_url(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_judge(p) -> None:
    g = p.add_argument_group("judge")
    g.add_argument("--judge-model", default="smollm2-135m",
                   help="the proxy judge's frozen original model: alias, HF folder or .gguf (default: %(default)s)")
    g.add_argument("--judge-url", default=None, type=_judge_url,
                   help="use an OpenAI-compatible chat endpoint as the judge instead (e.g. http://host:8000/v1)")
    g.add_argument("--judge-name", default="judge", help="the model name sent to --judge-url (default: %(default)s)")


def _judge(args, tokenizer_source=None):
    from ..train.pasta.judge import OpenAIJudge, ProxyJudge

    if args.judge_url:
        return OpenAIJudge(args.judge_url, args.judge_name)
    import torch

    import fastforward as ff

    original = ff.load(args.judge_model, backend="hf", dtype=torch.float32)
    return ProxyJudge(original.hf_model, original.tokenizer)


def _add_sample(p) -> None:
    p.add_argument("input", metavar="IN", help="'fastforward pasta annotate' (or make-data) records: the prompts, "
                                               "their baseline answers; the held-out split is skipped")
    p.add_argument("output", metavar="OUT", help="samples per prompt (JSONL; the same command resumes it)")
    add_model_arguments(p)
    p.add_argument("--n", type=positive_int, default=8, help="samples per prompt (default: %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=64,
                   help="prompts, a seeded random subset of the training split (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: the paper's 1.0)")
    p.add_argument("--max-new-tokens", type=positive_int, default=384, help="per sample (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt subset and sampling seeds (default: %(default)s)")
    _add_judge(p)


def _run_sample(args) -> int:
    import json
    import random
    import sys

    import fastforward as ff

    from ..jsonl import jsonl_records
    from ..train.pasta.annotate import check_records_output, make_data_file, read_make_data
    from ..train.pasta.bon import baseline_text, sample_record, sample_to_dict

    if args.n < 2:
        raise UsageError(f"--n must be at least 2 (a best and a worst sample), got {args.n}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0 for sampling, got {args.temperature}")
    src = make_data_file(args.input)
    out = check_records_output(args.output, src, "samples")
    records = [r for r in read_make_data(src) if r.get("split", "train") != "heldout"]
    if not records:
        raise UsageError(f"{src} holds only held-out records: nothing to sample")
    random.Random(args.seed).shuffle(records)
    records = records[: args.prompts]
    done = {r.get("key") for _, r in jsonl_records(out, repair=True)} if out.exists() else set()
    target = ff.load(args.model, backend="lean", threads=args.threads, weights=args.weights)
    judge = _judge(args)
    written = 0
    for i, rec in enumerate(records):
        key = rec.get("key", str(i))
        if key in done:
            continue
        samples = sample_record(target, judge, rec, args.n, temperature=args.temperature,
                                max_new_tokens=args.max_new_tokens, seed=args.seed * 100_003 + i)
        row = {"key": key, "prompt_ids": rec["prompt_ids"], "response": baseline_text(target, rec),
               "baseline_tokens": len(rec["response_ids"]), "samples": [sample_to_dict(s) for s in samples]}
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        written += 1
        best = max(s.theoretical_speedup for s in samples)
        print(f"[pasta sample] {len(done) + written}/{len(records)}: best theoretical speedup {best:.2f}",
              file=sys.stderr, flush=True)
    print(f"saved {out}: {written} prompts sampled ({args.n} each), {len(done)} already there")
    return 0


def _add_evaluate(p) -> None:
    p.add_argument("--baseline", default="smollm2-135m", help="the Baseline model (default: %(default)s)")
    p.add_argument("--models", required=True,
                   help="PASTA models to compare, comma-separated NAME=MODEL (alias, HF folder)")
    p.add_argument("--prompts", required=True,
                   help="held-apart prompt files, comma-separated (MT-Bench question.jsonl, EAGLE alpaca "
                        "questions, or JSONL with 'prompt')")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N prompts")
    p.add_argument("--exclude", default=None,
                   help="training records (make-data or annotated JSONL, comma-separated): prompts among them are "
                        "left out, so the evaluation is held apart")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per answer (default: %(default)s)")
    p.add_argument("--runs", type=positive_int, default=2,
                   help="decodes per answer, the last one timed (default: the paper's %(default)s)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads")
    p.add_argument("--weights", default="fp32", choices=["fp32", "int8"],
                   help="weight storage of every model, the Baseline included (a GGUF Baseline is read from its "
                        "dequantised HF folder), so all run alike (default: %(default)s)")
    p.add_argument("--out", default=None, help="write every row and the summary to this JSON file")
    _add_judge(p)


def _model_pairs(spec: str) -> dict[str, str]:
    """``--models NAME=MODEL,...`` as {name: model}; every name once."""
    pairs = [[part.strip() for part in m.split("=", 1)] for m in spec.split(",") if m.strip()]
    if not pairs or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise UsageError(f"--models takes NAME=MODEL pairs, got '{spec}'")
    names = [name for name, _ in pairs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise UsageError(f"--models names '{twice}' twice; give every model its own name")
    return dict(pairs)


def _run_evaluate(args) -> int:
    import json
    import sys

    import fastforward as ff

    from ..paths import check_output_file
    from ..train.pasta.evaluation import evaluate_models, is_evaluate_result, leave_out, read_prompts, table

    pairs = _model_pairs(args.models)
    out = check_output_file(args.out, "--out", owned=is_evaluate_result) if args.out else None
    prompts = read_prompts(args.prompts)
    if args.exclude:
        prompts, dropped = leave_out(prompts, args.exclude)
        if not prompts:
            raise UsageError(f"no prompts left to evaluate: every one is among the --exclude records {args.exclude}")
        print(f"[pasta evaluate] {len(dropped)} prompts left out (in the training records): "
              f"{', '.join(p['id'] for p in dropped) or 'none'}", file=sys.stderr)
    prompts = prompts[: args.limit]
    baseline_source = args.baseline
    if args.weights == "int8":
        from ..model.loading import _converted_gguf, _gguf_cache_dir, resolve_model

        kind, path = resolve_model(args.baseline)
        if kind == "gguf":
            _converted_gguf(path)  # the dequantised HF folder, made once
            baseline_source = str(_gguf_cache_dir(path))
    baseline = ff.load(baseline_source, backend="lean", threads=args.threads, weights=args.weights)
    models = {name: ff.load(path, backend="lean", threads=args.threads, weights=args.weights)
              for name, path in pairs.items()}
    judge = _judge(args)

    def progress(name, item, row, p, result, annotated):
        print(f"[pasta evaluate] {item['id']} {name}: theoretical {row.theoretical_speedup:.2f}x realized "
              f"{row.realized_speedup:.2f}x forks {row.forks} P(better) {p:.2f}", file=sys.stderr, flush=True)

    result = evaluate_models(baseline, models, prompts, judge, max_new_tokens=args.max_new_tokens, runs=args.runs,
                             on_prompt=progress)
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 0


def _add_export(p) -> None:
    p.add_argument("--base", required=True, help="the base model the training started from (an alias)")
    p.add_argument("--stages", required=True,
                   help="the LoRA adapter folders, comma-separated in training order (OUT/adapter of each "
                        "'fastforward train pasta-sft/pasta-bon --lora R')")
    p.add_argument("--model", required=True, help="the last stage's merged model folder (its new tokens' rows)")
    p.add_argument("--out", required=True, help="the adapter folder to write")
    p.add_argument("--training", default=None, help="a text file recording how it was trained (TRAINING.md)")


def _read_training(path: str | None) -> str:
    """The text of ``--training`` (empty without one)."""
    if not path:
        return ""
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read --training {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--training {path} is not UTF-8 text (byte {exc.start})") from None


def _run_export(args) -> int:
    from ..model.adapters import adapter_tensors, is_adapter_folder, write_adapter
    from ..model.loading import resolve_model
    from ..pasta.language import PASTA_TOKENS
    from ..paths import check_output_dir, mark_output_dir

    out = check_output_dir(args.out, "pasta export", owned=is_adapter_folder)
    resolve_model(args.base)  # the base must be one 'fastforward' loads: the adapter is applied over it
    stages = [str(Path(s.strip()).expanduser()) for s in args.stages.split(",") if s.strip()]
    for s in stages:
        if not (Path(s) / "adapter_config.json").is_file():
            raise UsageError(f"{s} is not a LoRA adapter folder (no adapter_config.json)")
    model = Path(args.model).expanduser()
    if not (model / "model.safetensors").is_file():
        raise UsageError(f"{model} is not a model folder (no model.safetensors)")
    training = _read_training(args.training)
    tensors, meta = adapter_tensors(stages, str(model), list(PASTA_TOKENS))  # everything read before writing
    info = {"base": args.base, "added_tokens": list(PASTA_TOKENS), "stages": meta}
    write_adapter(mark_output_dir(out, "pasta export"), tensors, info, training)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"saved {out} ({size:.1f} MB)")
    return 0


COMMANDS = {
    "annotate": ("annotate make-data answers with PASTA-LANG (no external LLM)", _add_annotate, _run_annotate),
    "sample": ("BoN samples: n PASTA answers per prompt through the interpreter, scored (speedup, quality)",
               _add_sample, _run_sample),
    "evaluate": ("PASTA models vs a Baseline on held-apart prompts: theoretical/realized speedup, parallelism, "
                 "judge win rate", _add_evaluate, _run_evaluate),
    "export": ("write a shippable adapter (fp16 LoRA stages + the PASTA tokens' rows) over a base model",
               _add_export, _run_export),
}


def add_arguments(p, name: str) -> None:
    add_subcommands(p, COMMANDS, "pasta_command", "COMMAND")


def run(args, name: str) -> int:
    return run_subcommand(args, COMMANDS, "pasta_command", "pasta command", "pasta")
