"""``fastforward train METHOD ...``: one sub-command per training method.

A method is a row of :data:`METHODS`: a one-line summary, a function adding its own options and a function running
it from the parsed arguments. The training itself is :mod:`fastforward.train` (a :class:`TrainConfig` and a
method object in, no argparse namespace).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UsageError
from ..train.cllm import CLLM, LOSSES, check_loss_settings, check_trajectories, trajectories_file
from ..train.msn import MSN
from ..train.run import MIXED_PRECISION
from ..train.trainer import DEFAULT_LORA_RANK, TrainConfig, report, train
from ..train.trajectories import META
from .options import add_model_argument, add_subcommands, add_threads_argument, finite_float, run_subcommand, seed

# ------------------------------------------------------------------------------------------------------------------
# Options every method shares
# ------------------------------------------------------------------------------------------------------------------


def add_training_arguments(p, data: bool = True) -> None:
    """The options every method shares. ``data=False`` leaves out ``--data`` and ``--heldout``, for a method that
    reads its own training set (it passes ``data`` and ``heldout`` to :func:`config_from_args`)."""
    add_model_argument(p, "base model")
    if data:
        p.add_argument("--data", required=True,
                       help="training file(s), comma-separated: alpaca-style .json/.jsonl, GSM8K .jsonl, "
                            "prompt/response")
    p.add_argument("--out", required=True,
                   help="output folder: the final model, checkpoints/ and train_log.jsonl; new, empty, or one an "
                        "earlier 'fastforward train' wrote (the same command resumes it)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps; overrides --epochs")
    p.add_argument("--lr", type=finite_float, default=None,
                   help="peak learning rate (default: 2e-4 with LoRA, 2e-5 with --full)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch and process (default: 4)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (default: 4)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per sequence, prompt included (default: 512)")
    p.add_argument("--no-group-by-length", dest="group_by_length", action="store_false",
                   help="batch sequences in random order instead of grouping similar lengths (less padding)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--lora", type=int, metavar="R", default=None,
                      help=f"train LoRA adapters of rank R on every linear projection (default: {DEFAULT_LORA_RANK})")
    kind.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    p.add_argument("--lora-alpha", type=finite_float, default=None, help="LoRA scaling numerator (default: 2 x rank)")
    p.add_argument("--seed", type=seed, default=0, help="data order, subsampling, noise and LoRA init (default: 0)")
    p.add_argument("--limit", type=int, default=None, help="train on a seeded random subset of N records")
    if data:
        p.add_argument("--heldout", type=finite_float, default=0.05,
                       help="fraction of records held out for 'fastforward eval --task nll' (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (default: %(default)s)")
    p.add_argument("--keep-checkpoints", type=int, default=1, help="checkpoints kept (default: %(default)s)")
    p.add_argument("--warmup", type=finite_float, default=0.05,
                   help="warmup fraction of the steps (default: %(default)s)")
    p.add_argument("--schedule", default="cosine", choices=["linear", "cosine", "constant"],
                   help="learning-rate schedule after warmup (default: %(default)s)")
    p.add_argument("--weight-decay", type=finite_float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--max-grad-norm", type=finite_float, default=1.0, help="gradient clipping, 0 = off (default: 1.0)")
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args, extra: dict | None = None, *, data: str | None = None,
                     heldout: float | None = None) -> TrainConfig:
    """The validated :class:`TrainConfig` of the shared options (``data``/``heldout`` given by a method that reads
    its own training set)."""
    if args.full and args.lora_alpha is not None:
        raise UsageError("--lora-alpha applies to LoRA training, not --full")
    lora = 0 if args.full else (DEFAULT_LORA_RANK if args.lora is None else args.lora)
    if args.lora is not None and args.lora <= 0:
        raise UsageError(f"--lora must be a positive rank, got {args.lora}")
    cfg = TrainConfig(
        model=args.model, data=args.data if data is None else data, out=args.out, epochs=args.epochs,
        max_steps=args.max_steps, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_length=args.max_length, group_by_length=args.group_by_length, lora=lora, lora_alpha=args.lora_alpha,
        seed=args.seed, limit=args.limit, heldout=args.heldout if heldout is None else heldout,
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, warmup=args.warmup,
        schedule=args.schedule, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        threads=args.threads, quiet=args.quiet, extra=dict(extra or {}),
    )
    cfg.validate()
    return cfg


def _train(cfg: TrainConfig, method) -> int:
    result = train(cfg, method)
    if result.main_process:
        print(report(result))
    return 0


# ------------------------------------------------------------------------------------------------------------------
# fastforward train msn
# ------------------------------------------------------------------------------------------------------------------


MSN_NOISE_LENGTH = 4


def add_msn_arguments(p) -> None:
    add_training_arguments(p)
    g = p.add_argument_group("noise")
    g.add_argument("--noise-length", type=int, default=None,
                   help=f"tokens per noise segment (default: {MSN_NOISE_LENGTH})")
    g.add_argument("--noise-location", default=None, choices=["random", "ppl"],
                   help="random segment, or the lowest-loss one under the current model (default: random)")
    g.add_argument("--no-noise", action="store_true", help="no noise: the plain SFT baseline, same code path")


def _msn_noise(args) -> tuple[int, str]:
    """(noise length, location) of ``train msn``; the noise options with --no-noise are refused, not ignored."""
    if args.no_noise:
        given = [flag for flag, value in (("--noise-length", args.noise_length),
                                          ("--noise-location", args.noise_location)) if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be combined with --no-noise")
    length = MSN_NOISE_LENGTH if args.noise_length is None else args.noise_length
    if length <= 0:
        raise UsageError(f"--noise-length must be a positive integer, got {length}")
    if length >= args.max_length:
        raise UsageError(f"--noise-length {length} leaves no room in --max-length {args.max_length}")
    return length, "none" if args.no_noise else (args.noise_location or "random")


def run_msn(args) -> int:
    noise_length, location = _msn_noise(args)
    args.noise_length = noise_length
    cfg = config_from_args(args, {"noise_length": args.noise_length, "noise_location": location})
    return _train(cfg, MSN(args.noise_length, location, cfg.seed))  # pad id 0: padding is masked out


# ------------------------------------------------------------------------------------------------------------------
# fastforward train cllm
# ------------------------------------------------------------------------------------------------------------------


def add_cllm_arguments(p) -> None:
    p.add_argument("--trajectories", required=True,
                   help="a 'fastforward collect-trajectories' output folder (or its trajectories.jsonl)")
    add_training_arguments(p, data=False)
    g = p.add_argument_group("consistency")
    g.add_argument("--loss", default="global", choices=LOSSES,
                   help="global (eq. 4: any state -> fixed point) or local (eq. 5: state -> next state) "
                        "(default: %(default)s)")
    g.add_argument("--ar-weight", type=finite_float, default=10.0,
                   help="w in eq. 7 (default: %(default)s, as official)")
    g.add_argument("--label-smoothing", type=finite_float, default=0.1,
                   help="label smoothing of the AR loss (default: %(default)s, as official)")
    g.add_argument("--no-mask", dest="mask", action="store_false",
                   help="also average the KL over the state's converged prefix (zero-KL positions)")


def _note_incomplete(path: Path, quiet: bool) -> None:
    """Say so (stderr) when the collection's meta.json reports unfinished prompts: training uses what is there."""
    try:
        meta = json.loads((path.parent / META).read_text())
    except (OSError, json.JSONDecodeError):
        return
    if not quiet and not meta.get("complete", True):
        print(f"note: the collection in {path.parent} is not complete ({meta.get('prompts_done')}/"
              f"{meta.get('prompts_total')} prompts); training on the {meta.get('records')} records it has",
              file=sys.stderr)


def run_cllm(args) -> int:
    check_loss_settings(args.loss, args.ar_weight, args.label_smoothing)
    path = trajectories_file(args.trajectories)
    _note_incomplete(path, args.quiet)
    extra = {"loss": args.loss, "ar_weight": args.ar_weight, "label_smoothing": args.label_smoothing,
             "mask": args.mask}
    cfg = config_from_args(args, extra, data=str(path), heldout=0.0)
    check_trajectories(path, cfg.max_length)  # read and checked before the model loads
    return _train(cfg, CLLM(args.loss, args.ar_weight, args.label_smoothing, args.mask, cfg.seed))


# ------------------------------------------------------------------------------------------------------------------
# Drafters: fastforward train eagle (and the drafters built on its loop)
# ------------------------------------------------------------------------------------------------------------------


def add_drafter_arguments(p) -> None:
    """The options of every drafter training (:mod:`fastforward.train.drafter_train`)."""
    add_model_argument(p, "target model")
    p.add_argument("--data", required=True, help="a 'fastforward make-data' output folder (its train split)")
    p.add_argument("--out", required=True,
                   help="output folder: the drafter (serving layout), checkpoints/, train_log.jsonl, loss.png; new, "
                        "empty, or one an earlier run of the same command wrote (it resumes)")
    p.add_argument("--epochs", type=finite_float, default=1.0, help="passes over the data (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps; overrides --epochs")
    p.add_argument("--max-minutes", type=finite_float, default=None,
                   help="stop (with a checkpoint) after this many minutes of training; re-run to continue")
    p.add_argument("--lr", type=finite_float, default=3e-4, help="peak learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch and process (default: 4)")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step (default: 2)")
    p.add_argument("--max-length", type=int, default=768, help="tokens per sequence, prompt included (default: 768)")
    p.add_argument("--warmup", type=finite_float, default=0.03, help="warmup fraction (default: %(default)s)")
    p.add_argument("--weight-decay", type=finite_float, default=0.0, help="AdamW weight decay (default: 0)")
    p.add_argument("--max-grad-norm", type=finite_float, default=0.5, help="gradient clipping (default: 0.5)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="the first N training records only")
    p.add_argument("--seed", type=seed, default=0, help="initialisation and data order (default: 0)")
    p.add_argument("--features", choices=["auto", "store", "forward"], default="auto",
                   help="the target's features: store = the make-data folder's features/ (computed and stored where "
                        "missing); forward = the target's HF model on the training device, per batch, never stored; "
                        "auto = forward on a GPU, store on the CPU (default: auto)")
    p.add_argument("--eval-records", type=int, default=None,
                   help="held-out records scored at the end (default: all; 0: none)")
    add_mixed_precision_argument(p)
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_mixed_precision_argument(p) -> None:
    p.add_argument("--mixed-precision", choices=MIXED_PRECISION, default="no",
                   help="bf16: the forward and loss under bf16 autocast, fp32 weights and optimizer (about 2x faster "
                        "on CPUs with AMX; default: no)")


def drafter_config(args, method: str, extra: dict):
    from ..train.drafter_train import DrafterTrainConfig

    return DrafterTrainConfig(
        model=args.model, data=args.data, out=args.out, method=method, epochs=args.epochs, max_steps=args.max_steps,
        max_minutes=args.max_minutes, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_length=args.max_length, warmup=args.warmup, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, save_every=args.save_every, seed=args.seed, limit=args.limit,
        threads=args.threads, quiet=args.quiet, mixed_precision=args.mixed_precision, features=args.features,
        eval_records=args.eval_records, extra=extra)


def _train_drafter(cfg, method) -> int:
    from ..train.drafter_train import train_drafter

    summary = train_drafter(cfg, method)
    stopped = f"; {summary['stopped']}, re-run to continue" if summary["stopped"] else ""
    print(f"saved {cfg.out} (step {summary['step']}/{summary['total_steps']}, loss {summary['loss']:.4f}; "
          f"{summary['seconds_this_run']:.0f} s this run{stopped})")
    held = summary.get("heldout")
    if held:
        print(f"held-out agreement with the target over {held['positions']} response positions, by depth: top-1 "
              + " ".join(f"{v:.3f}" for v in held["top1"]) + "; chain (depths 1..i all right) "
              + " ".join(f"{v:.3f}" for v in held["chain"]))
    return 0


def add_eagle_arguments(p) -> None:
    from ..train.eagle import DEFAULT_DRAFT_VOCAB, DEFAULT_TTT_STEPS

    add_drafter_arguments(p)
    g = p.add_argument_group("eagle")
    g.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                   help="draft vocabulary: the N most frequent tokens of the data (default: %(default)s)")
    g.add_argument("--ttt-steps", type=int, default=DEFAULT_TTT_STEPS,
                   help="training-time test: unrolled drafting steps (default: %(default)s)")


def run_eagle(args) -> int:
    from ..train.eagle import EagleTraining

    if args.draft_vocab <= 0 or args.ttt_steps <= 0:
        raise UsageError("--draft-vocab and --ttt-steps must be positive integers")
    cfg = drafter_config(args, "eagle", {"draft_vocab": args.draft_vocab, "ttt_steps": args.ttt_steps})
    return _train_drafter(cfg, EagleTraining(args.draft_vocab, args.ttt_steps))


def add_fasteagle_arguments(p) -> None:
    from ..train.fasteagle import CE_WEIGHT, DEFAULT_DRAFT_VOCAB, DEFAULT_LAYERS, FEATURE_WEIGHT

    add_drafter_arguments(p)
    g = p.add_argument_group("fasteagle")
    g.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                   help="N: cascaded decoder layers = drafted depths (default: %(default)s)")
    g.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                   help="draft vocabulary: the N most frequent tokens of the data (default: %(default)s)")
    g.add_argument("--ce-weight", type=finite_float, default=CE_WEIGHT,
                   help="alpha: weight of the soft cross-entropy (default: %(default)s)")
    g.add_argument("--feature-weight", type=finite_float, default=FEATURE_WEIGHT,
                   help="beta: weight of the SmoothL1 feature loss; 0 = the 'w/o feature loss' ablation "
                        "(default: %(default)s)")
    g.add_argument("--parallel", action="store_true",
                   help="the 'w/o cascade' ablation: layers 2..N each read layer 1's output instead of the previous "
                        "layer's")


def run_fasteagle(args) -> int:
    from ..train.fasteagle import FastEagleTraining

    if args.layers <= 0 or args.draft_vocab <= 0:
        raise UsageError("--layers and --draft-vocab must be positive integers")
    if args.ce_weight < 0 or args.feature_weight < 0 or args.ce_weight + args.feature_weight == 0:
        raise UsageError("--ce-weight and --feature-weight must be >= 0 and not both 0")
    extra = {"layers": args.layers, "draft_vocab": args.draft_vocab, "ce_weight": args.ce_weight,
             "feature_weight": args.feature_weight, "cascade": not args.parallel}
    cfg = drafter_config(args, "fasteagle", extra)
    return _train_drafter(cfg, FastEagleTraining(args.layers, args.draft_vocab, cascade=not args.parallel,
                                                 ce_weight=args.ce_weight, feature_weight=args.feature_weight))


def add_falcon_arguments(p) -> None:
    from ..train.falcon import CSGD_FORMS, DEFAULT_BLOCK, DEFAULT_CSGD, DEFAULT_DRAFT_VOCAB

    add_drafter_arguments(p)
    g = p.add_argument_group("falcon")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK,
                   help="k: tokens drafted per pass (default: %(default)s)")
    g.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                   help="draft vocabulary: the N most frequent tokens of the data (default: %(default)s)")
    g.add_argument("--csgd", choices=CSGD_FORMS, default=DEFAULT_CSGD,
                   help="glancing distillation: 'two-pass' (each block's second pass over the true rows before it, "
                        "the decode-time situation), 'sequence' (one pass over the drafter's own predictions), 'off' "
                        "(the 'w/o CSGD' ablation: teacher forcing) (default: %(default)s)")


def run_falcon(args) -> int:
    from ..train.falcon import FalconTraining

    if not 1 <= args.block_size <= 8:
        raise UsageError(f"--block-size must be an integer in 1..8, got {args.block_size}")
    if args.draft_vocab <= 0:
        raise UsageError("--draft-vocab must be a positive integer")
    extra = {"block_size": args.block_size, "draft_vocab": args.draft_vocab, "csgd": args.csgd}
    cfg = drafter_config(args, "falcon", extra)
    return _train_drafter(cfg, FalconTraining(args.block_size, args.draft_vocab, csgd=args.csgd))


# ------------------------------------------------------------------------------------------------------------------
# fastforward train draft-model
# ------------------------------------------------------------------------------------------------------------------


def add_draft_model_arguments(p) -> None:
    from ..drafters.draft_model import DEFAULT_LAYERS, INIT_CHOICES
    from .options import nonnegative_int, positive_float, positive_int

    add_model_argument(p, "target model (the draft model shares its tokenizer, embedding and head)")
    p.add_argument("--data", required=True,
                   help="a 'fastforward make-data' output folder (or its responses.jsonl): the target's own greedy "
                        "responses; the train split is trained on, up to --eval-records held-out records score it")
    p.add_argument("--out", required=True,
                   help="output folder: the draft model (config.json + fp16 model.safetensors, without the shared "
                        "embedding), checkpoints/, train_log.jsonl, loss.png; new, empty, or one an earlier run of "
                        "this command wrote (the same command resumes it)")
    g = p.add_argument_group("draft model")
    g.add_argument("--layers", type=positive_int, default=None,
                   help=f"decoder layers (default: {DEFAULT_LAYERS}, or as many as --init-layers lists)")
    g.add_argument("--draft-vocab", type=nonnegative_int, default=8192,
                   help="the target ids the draft may propose at decode time: the N most frequent of the training "
                        "responses (its head multiplies only their rows); 0, or the target's vocabulary size or "
                        "more, = every id (default: %(default)s)")
    g.add_argument("--init-layers", default="spread", metavar="|".join(INIT_CHOICES) + "|I,J,...",
                   help="target layers copied into the draft model: evenly spaced from the first to the last "
                        "(spread), the first ones (first), or a list of indices (default: spread)")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=positive_int, default=1, help="passes over the data (default: %(default)s)")
    t.add_argument("--max-steps", type=positive_int, default=None, help="optimizer steps; overrides --epochs")
    t.add_argument("--max-minutes", type=positive_float, default=None,
                   help="stop after this many minutes of training (checkpoint + draft model written); re-run the "
                        "same command to continue")
    t.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate (default: %(default)s)")
    t.add_argument("--batch-size", type=positive_int, default=4,
                   help="sequences per micro-batch and process (default: %(default)s)")
    t.add_argument("--grad-accum", type=positive_int, default=4,
                   help="micro-batches per optimizer step (default: %(default)s)")
    t.add_argument("--max-length", type=positive_int, default=512,
                   help="tokens per sequence, prompt included (default: %(default)s)")
    t.add_argument("--warmup", type=finite_float, default=0.03, help="warmup fraction of the steps (default: 0.03)")
    t.add_argument("--schedule", default="cosine", choices=["linear", "cosine", "constant"],
                   help="learning-rate schedule after warmup (default: %(default)s)")
    t.add_argument("--weight-decay", type=finite_float, default=0.0, help="AdamW weight decay (default: 0)")
    t.add_argument("--max-grad-norm", type=finite_float, default=1.0,
                   help="gradient clipping, 0 = off (default: %(default)s)")
    t.add_argument("--seed", type=seed, default=0, help="data order and subsampling (default: 0)")
    t.add_argument("--limit", type=positive_int, default=None, help="train on a seeded random subset of N records")
    t.add_argument("--save-every", type=positive_int, default=50, help="checkpoint every N steps (default: 50)")
    t.add_argument("--keep-checkpoints", type=positive_int, default=1, help="checkpoints kept (default: 1)")
    t.add_argument("--eval-records", type=nonnegative_int, default=32,
                   help="held-out records scored before and after training (default: %(default)s)")
    add_mixed_precision_argument(t)
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_draft_model(args) -> int:
    import fastforward as ff

    from ..train.draft_model import DraftTrainConfig, train_draft_model

    cfg = DraftTrainConfig(
        data=args.data, out=args.out, layers=args.layers, init_layers=args.init_layers, epochs=args.epochs,
        max_steps=args.max_steps, max_minutes=args.max_minutes, lr=args.lr, batch_size=args.batch_size,
        grad_accum=args.grad_accum, max_length=args.max_length, seed=args.seed, limit=args.limit,
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, warmup=args.warmup,
        schedule=args.schedule, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        eval_records=args.eval_records, threads=args.threads, quiet=args.quiet,
        mixed_precision=args.mixed_precision, draft_vocab=args.draft_vocab,
    )
    cfg.validate()  # before loading anything
    target = ff.load(args.model, threads=args.threads)
    result = train_draft_model(target, cfg)
    if result.main_process:
        print(result.report())
    return 0


# ------------------------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------------------------

# method -> (summary, add its arguments, run it)
# ------------------------------------------------------------------------------------------------------------------
# fastforward train pasta-sft
# ------------------------------------------------------------------------------------------------------------------


def add_pasta_token_lr(p, default) -> None:
    p.add_argument("--token-lr", type=finite_float, default=default,
                   help="learning rate of the PASTA-LANG tokens' embedding rows with LoRA (default: %(default)s)")


def _token_lr(args) -> float:
    if not args.token_lr > 0:
        raise UsageError(f"--token-lr must be positive, got {args.token_lr}")
    return args.token_lr


def add_pasta_sft_arguments(p) -> None:
    from ..train.pasta.methods import DEFAULT_TOKEN_LR

    add_training_arguments(p)
    add_pasta_token_lr(p, DEFAULT_TOKEN_LR)


def run_pasta_sft(args) -> int:
    from ..train.pasta.methods import PastaSFT

    cfg = config_from_args(args, {"token_lr": _token_lr(args)})
    return _train(cfg, PastaSFT(args.token_lr))


def add_pasta_bon_arguments(p) -> None:
    add_training_arguments(p)
    p.add_argument("--lam", type=finite_float, default=1.0,
                   help="λ in score = theoretical speedup + λ * quality (default: %(default)s)")
    p.add_argument("--alpha", type=finite_float, default=0.005,
                   help="weight of the SFT term of the BoNBoN loss (default: the paper's %(default)s)")
    add_pasta_token_lr(p, 1e-3)


def run_pasta_bon(args) -> int:
    from ..train.pasta.bon import check_lambda
    from ..train.pasta.methods import PastaBoN

    lam = check_lambda(args.lam)
    if not 0.0 <= args.alpha <= 1.0:
        raise UsageError(f"--alpha must be in [0, 1], got {args.alpha}")
    cfg = config_from_args(args, {"lam": lam, "alpha": args.alpha, "token_lr": _token_lr(args)})
    return _train(cfg, PastaBoN(lam, args.alpha, args.token_lr))


METHODS = {
    "msn": ("MSN noisy SFT: ahead noise in one response segment per sample (--no-noise = plain SFT)",
            add_msn_arguments, run_msn),
    "cllm": ("CLLM consistency training on Jacobi trajectories (collect them with 'fastforward collect-trajectories')",
             add_cllm_arguments, run_cllm),
    "eagle": ("an EAGLE-3-style drafter (training-time test) on 'fastforward make-data' output; loads in vLLM/SGLang",
              add_eagle_arguments, run_eagle),
    "falcon": ("a Falcon semi-autoregressive drafter (k tokens per pass) trained with CSGD on 'fastforward make-data' "
               "output", add_falcon_arguments, run_falcon),
    "fasteagle": ("a FastEagle cascaded drafter (N layers draft N depths in one pass) on 'fastforward make-data' "
                  "output", add_fasteagle_arguments, run_fasteagle),
    "pasta-sft": ("PASTA's SFT on 'fastforward pasta annotate' output: PASTA attention mask, Pred-10X positions, "
                  "promise targets; adds the PASTA-LANG tokens", add_pasta_sft_arguments, run_pasta_sft),
    "pasta-bon": ("one BoNBoN round for PASTA on 'fastforward pasta sample' output: best/worst of n by theoretical "
                  "speedup + λ * quality (LoRA)", add_pasta_bon_arguments, run_pasta_bon),
    "draft-model": ("a small draft model for --method sps: a few of the target's layers, its embedding and head "
                    "shared, distilled on 'fastforward make-data' output", add_draft_model_arguments,
                    run_draft_model),
}


def add_arguments(p, name: str) -> None:
    add_subcommands(p, METHODS, "train_method", "METHOD")


def run(args, name: str) -> int:
    return run_subcommand(args, METHODS, "train_method", "training method", "train")
