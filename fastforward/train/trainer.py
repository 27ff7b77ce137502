"""The training loop shared by every training method (``fastforward train METHOD``, whose options are declared in
``fastforward/cli/train.py``: this module takes a :class:`TrainConfig`, not an argparse namespace).

A method supplies two things (see :class:`TrainingMethod`): ``collate`` (tokenized examples -> a batch, with the
number of loss tokens) and ``loss`` (model, batch -> the *sum* of the per-token losses). Everything else is here:

* the model: ``fastforward.load``'s HF model (alias, GGUF or local HF folder), fp32, fully fine-tuned or with LoRA
  adapters on every linear projection (``peft``, merged into the weights when saving, so every saved model is a plain
  HF folder that ``fastforward generate --model DIR`` and ``fastforward.load(DIR)`` read);
* an ``accelerate`` loop (``Accelerator``; ``accelerate launch fastforward train ...`` runs the same command data
  parallel over processes) with AdamW, a linear or cosine schedule with warmup, gradient accumulation (the loss is
  the mean over every loss token of the whole optimizer step, as one big batch would have it), gradient clipping,
  a tqdm progress bar and a per-step log (``OUT/train_log.jsonl``);
* a deterministic data order: micro-batch ``m`` of epoch ``e`` is a pure function of (seed, e, m), so a resumed run
  sees exactly the batches the uninterrupted run would have seen;
* checkpoints every ``--save-every`` steps (and on Ctrl-C) in ``OUT/checkpoints/step-NNNNNN``: the merged model
  (safetensors) + tokenizer, the LoRA adapter when training one, the optimizer/scheduler/RNG states
  (``accelerator.save_state``) and ``trainer_state.json``, written last into a temporary folder that is then renamed,
  so a checkpoint either exists whole or not at all. Re-running the same command resumes from the latest one.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import random
import shutil
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import fastforward as ff

from ..errors import UsageError
from ..interrupts import deferred_stops, raise_if_stopped
from ..paths import check_output_dir, mark_output_dir
from .data import check_heldout, encode_examples, parse_paths, read_examples, split_examples, subsample
from .launcher import check_launcher

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "fastforward_train.json"

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
        def positive(name, value):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")

        for name in ("epochs", "max_steps", "batch_size", "grad_accum", "max_length", "save_every", "limit",
                     "keep_checkpoints", "threads"):
            positive(name, getattr(self, name))
        if self.lora < 0:
            raise UsageError(f"--lora must be a positive rank, got {self.lora}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not 0.0 <= self.warmup < 1.0:
            raise UsageError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.schedule not in ("linear", "cosine", "constant"):
            raise UsageError(f"--schedule must be linear, cosine or constant, got '{self.schedule}'")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise UsageError("--weight-decay and --max-grad-norm must be >= 0")
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


def to_device(batch: dict, device) -> dict:
    """Move a batch's tensors to ``device`` (a no-op on CPU)."""
    return {k: (v.to(device) if hasattr(v, "to") and hasattr(v, "device") else v) for k, v in batch.items()}


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


def checkpoint_dirs(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with ``trainer_state.json``) under ``out``, oldest first."""
    root = out / CHECKPOINTS
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit() and (d / STATE_FILE).is_file():
                found.append((int(d.name[5:]), d))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    found = checkpoint_dirs(out)
    return found[-1][1] if found else None


def _merged_model(model, lora: bool):
    """A plain HF model with the adapters merged (a copy, so training continues undisturbed)."""
    if not lora:
        return model
    return copy.deepcopy(model).merge_and_unload()


def _save_hf(model, tokenizer, folder: Path, lora: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = _merged_model(model, lora)
        merged.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def save_checkpoint(accelerator, model, tokenizer, out: Path, step: int, state: dict, cfg: TrainConfig) -> Path:
    """Write ``out/checkpoints/step-NNNNNN`` atomically and prune old checkpoints; return its path."""
    root = out / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        _save_hf(unwrapped, tokenizer, tmp, bool(cfg.lora))
        if cfg.lora:
            unwrapped.save_pretrained(tmp / "adapter", save_embedding_layers=False)
    accelerator.save_state(str(tmp / "accelerate"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in checkpoint_dirs(out)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".step-*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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


def _log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _load_base(cfg: TrainConfig, resume: Path | None):
    """(HF model, tokenizer) in fp32: the checkpoint's merged weights for a resumed full fine-tune, else the base."""
    import torch

    source = str(resume) if (resume is not None and not cfg.lora) else cfg.model
    target = ff.load(source, backend="hf", dtype=torch.float32)
    return target.hf_model, target.tokenizer


def train(cfg: TrainConfig, method: TrainingMethod) -> TrainResult:
    """Train ``method`` per ``cfg``; resume from the latest checkpoint in ``cfg.out`` when there is one."""
    cfg.validate()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm


    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    accelerator = Accelerator()
    check_launcher(accelerator)  # a launcher whose processes did not join one group: refused, one line
    main = accelerator.is_main_process
    quiet = cfg.quiet or not main

    # Resume?
    resume = latest_checkpoint(out)
    resume_state = None
    if resume is not None:
        resume_state = json.loads((resume / STATE_FILE).read_text())
        saved = resume_state.get("identity", {})
        mine = cfg.identity()
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if diff:
            raise UsageError(
                f"{out} holds a run with different settings ({', '.join(diff)}); use another --out to start anew"
            )
        if resume_state.get("world_size") != accelerator.num_processes:
            raise UsageError(
                f"{resume} was written by {resume_state.get('world_size')} processes, this run has "
                f"{accelerator.num_processes}; resume with the same number"
            )

    # Data: read, split, subsample, tokenize (fast; the same on every process).
    t_load = time.perf_counter()
    load_records = getattr(method, "load_records", None)
    if load_records is None:
        train_ex, held = split_examples(read_examples(cfg.data), cfg.heldout)
        if not train_ex:
            raise UsageError(f"every record of {cfg.data} is held out; lower --heldout")
        train_ex = subsample(train_ex, cfg.limit, cfg.seed)
    model, tokenizer = _load_base(cfg, resume)
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
    if resume_state and resume_state.get("records") not in (None, len(encoded)):
        raise UsageError(
            f"{resume} was trained on {resume_state['records']} records, the data now gives {len(encoded)}; "
            "use another --out"
        )
    world = accelerator.num_processes
    lengths = [len(e.input_ids) for e in encoded] if cfg.group_by_length else None
    schedule = BatchSchedule(len(encoded), cfg.batch_size * world, cfg.seed, lengths)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * schedule.per_epoch / cfg.grad_accum)
    start_step = int(resume_state["step"]) if resume_state else 0
    if start_step > total_steps:
        raise UsageError(f"{resume} is at step {start_step}, past the {total_steps} steps asked for")

    # Model: LoRA or full, fp32.
    set_seed(cfg.seed)
    model = model.float()
    model.train()
    if cfg.lora:
        from peft import LoraConfig, PeftModel, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if resume is not None:
                model = PeftModel.from_pretrained(model, resume / "adapter", is_trainable=True)
            else:
                lora_cfg = LoraConfig(
                    r=cfg.lora, lora_alpha=cfg.lora_alpha or 2 * cfg.lora, lora_dropout=0.0,
                    target_modules="all-linear", task_type="CAUSAL_LM",
                    **(method.lora_options() if hasattr(method, "lora_options") else {}),
                )
                model = get_peft_model(model, lora_cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in model.parameters())
    groups = params
    if hasattr(method, "param_groups"):
        groups = method.param_groups([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                     cfg.learning_rate)
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    from transformers import get_scheduler

    scheduler = get_scheduler(
        "constant_with_warmup" if cfg.schedule == "constant" else cfg.schedule, optimizer,
        num_warmup_steps=round(cfg.warmup * total_steps), num_training_steps=total_steps,
    )
    # The model's weights are saved as an HF folder (and adapter) by save_checkpoint, not by accelerate.
    model, optimizer = prepare_training(accelerator, model, optimizer, scheduler, resume)

    kind = f"LoRA r={cfg.lora}" if cfg.lora else "full fine-tuning"
    _log(
        f"{method.name}: {len(encoded)} training records ({n_held} held out, {dropped} longer than "
        f"--max-length dropped), {total_steps} steps of {cfg.batch_size * cfg.grad_accum * world} sequences "
        f"({total_steps * cfg.grad_accum / schedule.per_epoch:.2f} epochs); {kind} "
        f"({n_trainable / 1e6:.2f}M of {n_total / 1e6:.2f}M parameters trained), lr {cfg.learning_rate:g}; "
        f"loaded in {time.perf_counter() - t_load:.1f}s"
        + (f"; resuming from step {start_step}" if resume is not None else ""),
        cfg.quiet or not main,
    )

    identity = cfg.identity()
    log_path = out / LOG_FILE
    if main:
        mark_output_dir(out, "train")
        _trim_log(log_path, start_step)

    def state_at(step, loss):
        return {
            "step": step, "total_steps": total_steps, "micro_batches": step * cfg.grad_accum, "loss": loss,
            "world_size": world, "method": method.name, "identity": identity, "config": asdict(cfg),
            "records": len(encoded), "time": time.time(),
        }

    step = start_step
    last_saved = start_step
    last_loss = resume_state.get("loss") if resume_state else None
    bar = tqdm(total=total_steps, initial=start_step, desc=f"train {method.name}", unit="step", disable=quiet,
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    t0 = time.perf_counter()
    try:
        with deferred_stops():
            while step < total_steps:
                t_step = time.perf_counter()
                batches = []
                for m in range(step * cfg.grad_accum, (step + 1) * cfg.grad_accum):
                    idx = schedule.batch(m)
                    mine = idx[accelerator.process_index :: world]
                    batch = method.collate([encoded[i] for i in mine], m * world + accelerator.process_index)
                    batches.append(to_device(batch, accelerator.device))
                local_tokens = torch.tensor(float(sum(b["num_tokens"] for b in batches)))
                total_tokens = float(accelerator.reduce(local_tokens, reduction="sum"))
                loss_sum = torch.zeros(())
                for i, batch in enumerate(batches):
                    sync = i == len(batches) - 1
                    ctx = nullcontext() if sync else accelerator.no_sync(model)
                    with ctx:
                        s = method.loss(model, batch)
                        # DDP averages gradients over processes, so scale by world to get the global token mean.
                        accelerator.backward(s * (world / max(total_tokens, 1.0)))
                    loss_sum += s.detach().float()
                if cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                lr = scheduler.get_last_lr()[0]  # the rate this step used
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                last_loss = float(accelerator.reduce(loss_sum, reduction="sum")) / max(total_tokens, 1.0)
                dt = time.perf_counter() - t_step
                if main:
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": step, "loss": round(last_loss, 5), "lr": lr,
                                            "tokens": int(total_tokens), "seconds": round(dt, 3)}) + "\n")
                bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}", s_step=f"{dt:.1f}", refresh=False)
                bar.update(1)
                if step % cfg.save_every == 0 or step == total_steps:
                    save_checkpoint(accelerator, model, tokenizer, out, step, state_at(step, last_loss), cfg)
                    last_saved = step
                raise_if_stopped()  # a Ctrl-C or SIGTERM during the step stops here, the step kept
    except KeyboardInterrupt:
        bar.close()
        if step > last_saved:
            save_checkpoint(accelerator, model, tokenizer, out, step, state_at(step, last_loss), cfg)
            last_saved = step
        kept = f"checkpoint at step {last_saved} in {out / CHECKPOINTS}" if last_saved else "no step finished"
        raise KeyboardInterrupt(f"{kept}; re-run the same command to resume") from None
    bar.close()
    seconds = time.perf_counter() - t0

    # The final model: a plain HF folder in --out.
    if main:
        unwrapped = accelerator.unwrap_model(model)
        _save_hf(unwrapped, tokenizer, out, bool(cfg.lora))
        if cfg.lora:
            # the adapter alone, next to the merged model
            unwrapped.save_pretrained(out / "adapter", save_embedding_layers=False)
        summary = state_at(step, last_loss)
        summary.update(
            method_stats=method.stats(), trainable_parameters=n_trainable, seconds_this_run=round(seconds, 2),
            steps_this_run=step - start_step, heldout_records=n_held, dropped_records=dropped,
        )
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    accelerator.wait_for_everyone()
    return TrainResult(str(out), start_step, step, total_steps, last_loss, seconds, len(encoded), main)



def prepare_training(accelerator, model, optimizer, scheduler, resume: Path | None):
    """``accelerator.prepare`` the model and optimizer, checkpoint the scheduler with accelerate's state (the loop saves
    the weights itself, so accelerate saves none), and restore a resumed run's state from ``resume/accelerate``,
    re-deriving the learning rate from the schedule (the number of steps may have changed). Returns (model,
    optimizer)."""
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.register_save_state_pre_hook(lambda models, weights, d: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, d: models.clear())
    if resume is not None:
        accelerator.load_state(str(Path(resume) / "accelerate"))
        pairs = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        lrs = [base * lam(scheduler.last_epoch) for base, lam in pairs]
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs
    return model, optimizer

def _trim_log(path: Path, step: int) -> None:
    """Drop log lines past ``step`` (steps an interrupted run did after its last checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    path.write_text("".join(k + "\n" for k in keep))


def report(result: TrainResult) -> str:
    ran = result.steps - result.start_step
    per = result.seconds / ran if ran else 0.0
    loss = "n/a" if result.loss is None else f"{result.loss:.4f}"
    return (
        f"saved {result.out} (step {result.steps}/{result.total_steps}, loss {loss}; "
        f"{ran} steps in {result.seconds:.1f}s, {per:.2f}s/step)"
    )


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
