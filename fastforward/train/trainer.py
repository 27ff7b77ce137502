"""The fine-tunes of the target itself (``fastforward train msn``, ``cllm``, ``pasta-sft``, ``pasta-bon``; their options
are declared in ``fastforward/cli/train.py``: this module takes a :class:`TrainConfig`, not an argparse namespace).

A method supplies two things (see :class:`TrainingMethod`): ``collate`` (tokenized examples -> a batch, with the
number of loss tokens) and ``loss`` (model, batch -> the *sum* of the per-token losses). This module adds what
fine-tuning the target needs:

* the model: ``fastforward.load``'s HF model (alias, GGUF or local HF folder), fp32, fully fine-tuned or with LoRA
  adapters on every linear projection (``peft``, merged into the weights when saving, so every saved model is a plain
  HF folder that ``fastforward generate --model DIR`` and ``fastforward.load(DIR)`` read);
* AdamW with a linear, cosine or constant schedule after warmup, and gradient accumulation (the loss is the mean
  over every loss token of the whole optimizer step, as one big batch would have it);
* a deterministic data order: micro-batch ``m`` of epoch ``e`` is a pure function of (seed, e, m), so a resumed run
  sees exactly the batches the uninterrupted run would have seen;
* its checkpoints' content: the merged model (safetensors) + tokenizer and the LoRA adapter when training one.

The rest -- the process group, resume, atomic checkpoints every ``--save-every`` steps and on Ctrl-C, the per-step
log ``OUT/train_log.jsonl``, the progress bar -- is the shared :class:`~fastforward.train.run.TrainingRun`.
Re-running the same command resumes from the latest checkpoint.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import fastforward as ff

from ..errors import UsageError
from ..paths import check_output_dir
from .data import check_heldout, encode_examples, parse_paths, read_examples, split_examples, subsample
from .run import (
    SUMMARY_FILE,
    TrainingRun,
    check_settings,
    latest_checkpoint,
    transformers_schedule,
    write_checkpoint,
)

DEFAULT_LORA_RANK = 16

# Settings that must match for a run to resume from a checkpoint (the rest -- max_steps, epochs, save_every,
# threads -- may change between the interrupted run and the resumed one).
IDENTITY_KEYS = (
    "model", "data", "seed", "limit", "heldout", "max_length", "batch_size", "grad_accum", "group_by_length", "lora",
    "lora_alpha", "lr", "weight_decay", "schedule", "warmup", "max_grad_norm",
)


@dataclass
class TrainConfig:
    model: str
    data: str
    out: str
    epochs: int = 1
    max_steps: int | None = None
    lr: float | None = None  # None: 2e-4 with LoRA, 2e-5 for full fine-tuning
    batch_size: int = 4
    grad_accum: int = 4
    max_length: int = 512
    lora: int = 0  # LoRA rank; 0 = full fine-tuning
    lora_alpha: float | None = None  # None: 2 * rank
    seed: int = 0
    limit: int | None = None
    heldout: float = 0.05
    group_by_length: bool = True
    save_every: int = 50
    keep_checkpoints: int = 1
    warmup: float = 0.05
    schedule: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    threads: int | None = None
    quiet: bool = False
    extra: dict = field(default_factory=dict)  # the method's own settings (recorded; part of the resume identity)

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 2e-4 if self.lora else 2e-5

    def identity(self) -> dict:
        d = {k: getattr(self, k) for k in IDENTITY_KEYS}
        d["lr"] = self.learning_rate
        d["data"] = ",".join(str(Path(p.strip()).expanduser().resolve()) for p in self.data.split(",") if p.strip())
        model_path = Path(self.model).expanduser()
        d["model"] = str(model_path.resolve()) if model_path.exists() else self.model
        d.update(self.extra)
        return d

    def validate(self) -> None:
        check_settings(self, ("epochs", "max_steps", "batch_size", "grad_accum", "max_length", "save_every", "limit",
                              "keep_checkpoints", "threads"))
        if self.lora < 0:
            raise UsageError(f"--lora must be a positive rank, got {self.lora}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.max_length < 2:
            raise UsageError(f"--max-length must be at least 2, got {self.max_length}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise UsageError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        check_heldout(self.heldout)
        parse_paths(self.data)
        if self.lora and importlib.util.find_spec("peft") is None:
            raise UsageError("LoRA training needs peft, which is not installed: pip install -e '.[train]' "
                             "(or train with --full)")
        # a new or empty folder, or one 'fastforward train' wrote (re-running resumes it); never someone else's
        check_output_dir(self.out, "train", owned=_is_train_folder)


# ------------------------------------------------------------------------------------------------------------------
# What a method provides, and helpers methods share
# ------------------------------------------------------------------------------------------------------------------


class TrainingMethod:
    """A training method: how examples become a batch, and the loss of a batch.

    ``collate(examples, key)`` gets a list of :class:`~fastforward.train.data.Encoded` and a unique integer ``key``
    for this micro-batch on this process (seed any randomness from it so that resumed runs repeat exactly); it
    returns a dict that includes ``num_tokens``, the number of loss terms. ``loss(model, batch)`` returns the *sum*
    of the per-token losses; the trainer divides by the step's total ``num_tokens`` over all micro-batches and
    processes.
    """

    name = "sft"

    def collate(self, examples, key: int) -> dict:
        raise NotImplementedError

    def loss(self, model, batch):
        raise NotImplementedError

    def stats(self) -> dict:
        """Method-specific counters for the run summary."""
        return {}

    # Optional hooks:
    # * ``load_records(cfg, tokenizer) -> (records, held_out, dropped)``: a method with its own training set; the
    #   records need ``input_ids`` (for length grouping) and are passed to ``collate`` as they are.
    # * ``prepare_model(model, tokenizer) -> (model, tokenizer)``: change the base before training (e.g. add
    #   tokens); called on every run, resumed ones included, so it must be idempotent.
    # * ``lora_options() -> dict``: extra ``peft.LoraConfig`` settings (e.g. ``trainable_token_indices``).
    # * ``param_groups(named_params, lr) -> list[dict]``: optimizer parameter groups (e.g. a learning rate of their
    #   own for new tokens' rows); the schedule scales every group's rate alike.


def pad_batch(examples, pad_id: int) -> dict:
    """Right-pad encoded examples: ``input_ids``, ``attention_mask``, ``labels`` (the clean tokens on response
    positions, -100 elsewhere), ``prompt_lens``, ``lengths``, ``num_tokens``."""
    import torch

    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    for b, e in enumerate(examples):
        t = torch.tensor(e.input_ids, dtype=torch.long)
        ids[b, : len(t)] = t
        mask[b, : len(t)] = 1
        labels[b, e.prompt_len : len(t)] = t[e.prompt_len :]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "prompt_lens": torch.tensor([e.prompt_len for e in examples], dtype=torch.long),
        "lengths": torch.tensor([len(e.input_ids) for e in examples], dtype=torch.long),
        "num_tokens": int((labels != -100).sum()),
    }


def token_losses(model, input_ids, attention_mask, labels):
    """Per-token cross-entropy ``[B, T]`` aligned with the tokens: entry ``j`` is the loss of predicting
    ``labels[:, j]`` from the inputs before ``j`` (0 where the label is -100, and in column 0).

    Only the positions from the batch's first label on go through the LM head (``logits_to_keep``): the prompt's
    logits are never needed, and with a 49k vocabulary they are a sizeable part of a small model's step."""
    import torch.nn.functional as F

    b, t = labels.shape
    has_label = (labels != -100).any(0).nonzero()
    start = max(int(has_label[0]) - 1, 0) if len(has_label) else 0  # the first position whose logits matter
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       logits_to_keep=t - start).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, start:]
    v = logits.shape[-1]
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, v).float(), labels[:, start + 1 :].reshape(-1), ignore_index=-100,
        reduction="none",
    ).view(b, t - start - 1)
    return F.pad(losses, (start + 1, 0))


# ------------------------------------------------------------------------------------------------------------------
# Data order
# ------------------------------------------------------------------------------------------------------------------


class BatchSchedule:
    """Global micro-batches of ``size`` example indices: epoch ``e`` is a seeded permutation, wrapped around at the
    end so every micro-batch is full. Micro-batch ``m`` is a pure function of (n, size, seed, lengths, m).

    With ``lengths`` (and ``size > 1``), batches are grouped by length to cut padding: the permutation is cut into
    chunks of ``group`` micro-batches, each chunk is sorted by length and split into micro-batches, and their order
    within the chunk is shuffled (so a step's micro-batches are not ordered by length)."""

    def __init__(self, n: int, size: int, seed: int, lengths=None, group: int = 32):
        self.n, self.size, self.seed = n, size, seed
        self.lengths = list(lengths) if lengths is not None and size > 1 else None
        self.group = group
        self.per_epoch = math.ceil(n / size)
        self._epoch, self._batches = None, None

    def batch(self, m: int) -> list[int]:
        epoch, j = divmod(m, self.per_epoch)
        if epoch != self._epoch:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            order = list(range(self.n))
            rng.shuffle(order)
            order += order[: self.per_epoch * self.size - self.n]
            batches = []
            chunk = self.size * self.group if self.lengths else len(order)
            for c in range(0, len(order), chunk):
                part = order[c : c + chunk]
                if self.lengths:
                    part = sorted(part, key=lambda i: self.lengths[i])
                group = [part[i : i + self.size] for i in range(0, len(part), self.size)]
                if self.lengths:
                    rng.shuffle(group)
                batches += group
            self._batches = batches
            self._epoch = epoch
        return self._batches[j]


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------------------------


def _is_train_folder(out: Path) -> bool:
    """A training output written before output folders were marked: a checkpoint or the run summary."""
    return latest_checkpoint(out) is not None or (out / SUMMARY_FILE).is_file()


def _merged_model(model, lora: bool):
    """A plain HF model with the adapters merged (a copy, so training continues undisturbed)."""
    if not lora:
        return model
    return copy.deepcopy(model).merge_and_unload()


def _save_hf(model, tokenizer, folder: Path, lora: bool) -> None:
    """The model as a plain HF folder (adapters merged) with its tokenizer, and with LoRA the adapter alone in
    ``folder/adapter``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = _merged_model(model, lora)
        merged.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if lora:
        model.save_pretrained(folder / "adapter", save_embedding_layers=False)


def save_checkpoint(accelerator, model, tokenizer, out: Path, step: int, state: dict, cfg: TrainConfig) -> Path:
    """Write ``out/checkpoints/step-NNNNNN`` atomically (the merged model, tokenizer and adapter, accelerate's states,
    ``trainer_state.json``) and prune old checkpoints; return its path."""
    unwrapped = accelerator.unwrap_model(model)
    return write_checkpoint(accelerator, out, step, state, cfg.keep_checkpoints,
                            lambda folder: _save_hf(unwrapped, tokenizer, folder, bool(cfg.lora)))


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: str
    start_step: int
    steps: int
    total_steps: int
    loss: float | None
    seconds: float
    records: int
    main_process: bool = True

    def steps_line(self) -> str:
        """Where the run got and how fast: ``step S/T, loss L; N steps in Xs, Ys/step``."""
        ran = self.steps - self.start_step
        per = self.seconds / ran if ran else 0.0
        loss = "n/a" if self.loss is None else f"{self.loss:.4f}"
        return f"step {self.steps}/{self.total_steps}, loss {loss}; {ran} steps in {self.seconds:.1f}s, {per:.2f}s/step"


def _load_base(cfg: TrainConfig, resume: Path | None):
    """(HF model, tokenizer) in fp32: the checkpoint's merged weights for a resumed full fine-tune, else the base."""
    import torch

    source = str(resume) if (resume is not None and not cfg.lora) else cfg.model
    target = ff.load(source, backend="hf", dtype=torch.float32)
    return target.hf_model, target.tokenizer


def _load(cfg: TrainConfig, method: TrainingMethod, run: TrainingRun):
    """(encoded training records, records held out, records dropped, model, tokenizer): the data read, split and
    subsampled (before the model loads: a bad file fails fast), the base model loaded and prepared by the method,
    then the records tokenized (or the method's own records)."""
    load_records = getattr(method, "load_records", None)
    if load_records is None:
        train_ex, held = split_examples(read_examples(cfg.data), cfg.heldout)
        if not train_ex:
            raise UsageError(f"every record of {cfg.data} is held out; lower --heldout")
        train_ex = subsample(train_ex, cfg.limit, cfg.seed)
    model, tokenizer = _load_base(cfg, run.resume)
    prepare_model = getattr(method, "prepare_model", None)
    if prepare_model is not None:
        model, tokenizer = prepare_model(model, tokenizer)
    if load_records is None:
        encoded, dropped = encode_examples(tokenizer, train_ex, cfg.max_length)
        n_held = len(held)
    else:
        encoded, n_held, dropped = load_records(cfg, tokenizer)
    if not encoded:
        raise UsageError(f"no record fits --max-length {cfg.max_length}")
    if run.state and run.state.get("records") not in (None, len(encoded)):
        raise UsageError(
            f"{run.resume} was trained on {run.state['records']} records, the data now gives {len(encoded)}; "
            "use another --out"
        )
    return encoded, n_held, dropped, model, tokenizer


def _trainable(cfg: TrainConfig, method: TrainingMethod, model, resume: Path | None):
    """The model to train, fp32: itself (full fine-tuning), or with LoRA adapters -- new, or the checkpoint's."""
    model = model.float()
    model.train()
    if not cfg.lora:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if resume is not None:
            return PeftModel.from_pretrained(model, resume / "adapter", is_trainable=True)
        lora_cfg = LoraConfig(
            r=cfg.lora, lora_alpha=cfg.lora_alpha or 2 * cfg.lora, lora_dropout=0.0, target_modules="all-linear",
            task_type="CAUSAL_LM", **(method.lora_options() if hasattr(method, "lora_options") else {}),
        )
        return get_peft_model(model, lora_cfg)


def _optimizer(cfg: TrainConfig, method: TrainingMethod, model, total_steps: int):
    """(trainable parameters, AdamW over them -- in the method's parameter groups when it has some --, schedule)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = params
    if hasattr(method, "param_groups"):
        groups = method.param_groups([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                     cfg.learning_rate)
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return params, optimizer, transformers_schedule(optimizer, cfg.schedule, cfg.warmup, total_steps)


def train(cfg: TrainConfig, method: TrainingMethod) -> TrainResult:
    """Train ``method`` per ``cfg``; resume from the latest checkpoint in ``cfg.out`` when there is one."""
    cfg.validate()
    from accelerate.utils import set_seed

    run = TrainingRun(cfg.out, "train", cfg.identity(), quiet=cfg.quiet, threads=cfg.threads)
    t_load = time.perf_counter()
    encoded, n_held, dropped, model, tokenizer = _load(cfg, method, run)
    world = run.world
    lengths = [len(e.input_ids) for e in encoded] if cfg.group_by_length else None
    schedule = BatchSchedule(len(encoded), cfg.batch_size * world, cfg.seed, lengths)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * schedule.per_epoch / cfg.grad_accum)
    run.check_total(total_steps)

    set_seed(cfg.seed)
    model = _trainable(cfg, method, model, run.resume)
    params, optimizer, scheduler = _optimizer(cfg, method, model, total_steps)
    n_trainable = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in model.parameters())
    # The model's weights are saved as an HF folder (and adapter) by save_checkpoint, not by accelerate.
    model = run.prepare(model, optimizer, scheduler, params, cfg.max_grad_norm)

    kind = f"LoRA r={cfg.lora}" if cfg.lora else "full fine-tuning"
    run.say(
        f"{method.name}: {len(encoded)} training records ({n_held} held out, {dropped} longer than "
        f"--max-length dropped), {total_steps} steps of {cfg.batch_size * cfg.grad_accum * world} sequences "
        f"({total_steps * cfg.grad_accum / schedule.per_epoch:.2f} epochs); {kind} "
        f"({n_trainable / 1e6:.2f}M of {n_total / 1e6:.2f}M parameters trained), lr {cfg.learning_rate:g}; "
        f"loaded in {time.perf_counter() - t_load:.1f}s"
        + (f"; resuming from step {run.start_step}" if run.resume is not None else "")
    )
    identity, config = cfg.identity(), asdict(cfg)

    def state_at(step, loss):
        return run.state_at(step, total_steps, loss, micro_batches=step * cfg.grad_accum, method=method.name,
                            identity=identity, config=config, records=len(encoded))

    def step_fn(step):
        batches = run.micro_batches(step, cfg.grad_accum, schedule, encoded, method.collate)
        return run.token_mean_step(model, batches, lambda batch: (method.loss(model, batch), {}))

    def save(step, loss):
        save_checkpoint(run.accelerator, model, tokenizer, run.out, step, state_at(step, loss), cfg)

    done = run.train(total_steps, step_fn, save, save_every=cfg.save_every, desc=f"train {method.name}")
    if run.main:  # the final model: a plain HF folder in --out
        _save_hf(run.accelerator.unwrap_model(model), tokenizer, run.out, bool(cfg.lora))
        summary = state_at(done.step, done.loss)
        summary.update(
            method_stats=method.stats(), trainable_parameters=n_trainable, seconds_this_run=round(done.seconds, 2),
            steps_this_run=done.step - run.start_step, heldout_records=n_held, dropped_records=dropped,
        )
        (run.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    run.accelerator.wait_for_everyone()
    return TrainResult(str(run.out), run.start_step, done.step, total_steps, done.loss, done.seconds, len(encoded),
                       run.main)


def report(result: TrainResult) -> str:
    return f"saved {result.out} ({result.steps_line()})"


def seed_key(*parts: int) -> int:
    """A 63-bit seed from integers (for per-micro-batch generators)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


__all__ = [
    "BatchSchedule", "TrainConfig", "TrainResult", "TrainingMethod", "seed_key", "latest_checkpoint", "pad_batch",
    "report", "save_checkpoint", "token_losses", "train",
]
