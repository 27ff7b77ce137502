"""Training a draft model for ``--method sps`` (``fastforward train draft-model``; the folder it writes and its loader
are :mod:`fastforward.drafters.draft_model`): sequence-level distillation on ``fastforward make-data`` records: the
loss is the cross-entropy of the target's own greedy response tokens given the prompt and the response so far. An
``accelerate`` loop (the same under ``accelerate launch`` / ``ACCELERATE_USE_CPU=1 torchrun``) with AdamW, warmup
then a cosine (or linear/constant) schedule, gradient accumulation (the loss is the mean over every response token
of the step), gradient clipping, ``OUT/train_log.jsonl`` (loss, top-1 agreement with the target's token, lr),
checkpoints every ``--save-every`` steps in ``OUT/checkpoints/step-NNNNNN`` (the trainable weights in fp32 plus the
optimizer/scheduler/RNG states, written into a temporary folder that is then renamed), so re-running the same command
resumes where the last checkpoint left off, and a ``--max-minutes`` budget after which the run checkpoints, writes
the draft folder and stops (the same command continues it); at the end ``OUT/loss.png`` (loss and top-1 curves, when
matplotlib is installed) and ``OUT/fastforward_train.json`` (with held-out loss and top-1 agreement before and after
training). The records a run trains on are fixed when it starts (the first N lines of ``responses.jsonl``), so a
resumed run sees the same data even while ``make-data`` appends. A launcher whose processes did not join one group
is refused (:func:`fastforward.train.launcher.check_launcher`).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..drafters.draft_model import (
    MAX_SHIPPED_MB,
    WEIGHTS_FILE,
    choose_layers,
    folder_megabytes,
    init_draft_model,
    own_state,
    save_draft_model,
    target_probe,
    write_json,
)
from ..errors import UsageError
from ..interrupts import deferred_stops, raise_if_stopped

COMMAND = "train draft-model"
TRAINABLE_FILE = "draft_fp32.safetensors"  # a checkpoint's trainable weights, full precision
SUMMARY_FILE = "fastforward_train.json"


@dataclass
class DraftTrainConfig:
    data: str  # a make-data folder (OUT/responses.jsonl) or the responses.jsonl file
    out: str
    layers: int | None = None  # None: DEFAULT_LAYERS, or as many as init_layers lists
    init_layers: str = "spread"
    epochs: int = 1
    max_steps: int | None = None
    max_minutes: float | None = None
    lr: float = 3e-4
    batch_size: int = 4
    grad_accum: int = 4
    max_length: int = 512
    seed: int = 0
    limit: int | None = None
    save_every: int = 50
    keep_checkpoints: int = 1
    warmup: float = 0.03
    schedule: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_records: int = 32
    threads: int | None = None
    quiet: bool = False
    mixed_precision: str = "no"  # "bf16": forward and loss under bf16 autocast (fp32 weights and optimizer)

    def responses_file(self) -> Path:
        from .make_data import RESPONSES

        path = Path(self.data).expanduser()
        file = path / RESPONSES if path.is_dir() else path
        if not file.is_file() or file.name != RESPONSES:
            raise UsageError(f"--data {self.data}: no {RESPONSES} there (make it with 'fastforward make-data')")
        return file

    def validate(self) -> None:
        for name in ("epochs", "max_steps", "batch_size", "grad_accum", "save_every", "keep_checkpoints", "limit",
                     "threads", "layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        from .drafter_train import check_mixed_precision

        check_mixed_precision(self.mixed_precision)
        if not isinstance(self.eval_records, int) or self.eval_records < 0:
            raise UsageError(f"--eval-records must be an integer >= 0, got {self.eval_records}")
        if self.max_length < 2:
            raise UsageError(f"--max-length must be at least 2, got {self.max_length}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:
            raise UsageError(f"--max-minutes must be positive, got {self.max_minutes}")
        if not 0.0 <= self.warmup < 1.0:
            raise UsageError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.schedule not in ("linear", "cosine", "constant"):
            raise UsageError(f"--schedule must be linear, cosine or constant, got '{self.schedule}'")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise UsageError("--weight-decay and --max-grad-norm must be >= 0")
        self.responses_file()
        from ..paths import check_output_dir

        check_output_dir(self.out, COMMAND)

    def identity(self, target, layer_ids) -> dict:
        """The settings a resumed run must share with the run it resumes."""
        model = Path(str(target.name)).expanduser()
        return {
            "target": str(model.resolve()) if model.exists() else str(target.name),
            "data": str(self.responses_file().resolve()), "layers": list(layer_ids), "seed": self.seed,
            "limit": self.limit, "max_length": self.max_length, "batch_size": self.batch_size,
            "grad_accum": self.grad_accum, "lr": self.lr, "weight_decay": self.weight_decay,
            "schedule": self.schedule, "warmup": self.warmup, "max_grad_norm": self.max_grad_norm,
        }


@dataclass
class DraftTrainResult:
    out: str
    start_step: int
    steps: int
    total_steps: int
    loss: float | None
    seconds: float
    records: int
    layers: list
    megabytes: float
    heldout: dict
    stopped_by_budget: bool = False
    main_process: bool = True

    def report(self) -> str:
        ran = self.steps - self.start_step
        per = self.seconds / ran if ran else 0.0
        loss = "n/a" if self.loss is None else f"{self.loss:.4f}"
        held = ""
        if self.heldout.get("after"):
            before = self.heldout.get("before")
            after = self.heldout["after"]
            held = (f"; held-out top-1 {before['top1']:.3f} -> {after['top1']:.3f}" if before else
                    f"; held-out loss {after['loss']:.3f}, top-1 {after['top1']:.3f}")
        stop = "; stopped at the --max-minutes budget (re-run to continue)" if self.stopped_by_budget else ""
        return (f"saved draft model {self.out} ({len(self.layers)} layers from target layers {self.layers}, "
                f"{self.megabytes:.1f} MB fp16; step {self.steps}/{self.total_steps}, loss {loss}; {ran} steps in "
                f"{self.seconds:.1f}s, {per:.2f}s/step{held}{stop})")


class DraftLoss(torch.nn.Module):
    """The training objective around the draft LM: summed cross-entropy of the response tokens (and the number of
    them whose argmax is the target's token), the LM head applied to response positions only."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, labels):
        import torch.nn.functional as F

        h = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        targets = labels[:, 1:]
        keep = targets != -100
        rows = h[:, :-1][keep]
        logits = F.linear(rows, self.lm.lm_head.weight).float()
        wanted = targets[keep]
        loss = F.cross_entropy(logits, wanted, reduction="sum")
        correct = (logits.detach().argmax(-1) == wanted).sum()
        return loss, correct


def _encode(records: list[dict], max_length: int):
    from .data import Encoded

    encoded, dropped = [], 0
    for r in records:  # checked by read_training_records
        prompt, response = r["prompt_ids"], r["response_ids"]
        ids = (prompt + response)[:max_length]
        if len(ids) - len(prompt) < 1:
            dropped += 1
            continue
        encoded.append(Encoded(ids, len(prompt)))
    return encoded, dropped


@torch.no_grad()
def _evaluate(lm, encoded, batch_size: int) -> dict | None:
    """Mean loss and top-1 agreement over the response tokens of ``encoded`` (no gradients)."""
    from .trainer import pad_batch

    if not encoded:
        return None
    was_training = lm.training
    lm.eval()
    scorer = DraftLoss(lm)
    loss = correct = tokens = 0.0
    for i in range(0, len(encoded), batch_size):
        batch = pad_batch(encoded[i : i + batch_size], 0)
        s, c = scorer(batch["input_ids"], batch["attention_mask"], batch["labels"])
        loss += float(s)
        correct += float(c)
        tokens += batch["num_tokens"]
    lm.train(was_training)
    return {"loss": round(loss / max(tokens, 1), 5), "top1": round(correct / max(tokens, 1), 5),
            "tokens": int(tokens), "records": len(encoded)}


def _plot(log_path: Path, png: Path) -> bool:
    """The loss (and top-1 agreement) curve of ``train_log.jsonl`` as a PNG, with the drafters' plotting helper;
    False when it or matplotlib is unavailable."""
    try:
        from .drafter_train import plot_losses
    except ImportError:
        return False
    try:
        return bool(plot_losses(log_path, png, "train draft-model"))
    except (OSError, ValueError, ImportError):
        return False


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def train_draft_model(target, cfg: DraftTrainConfig) -> DraftTrainResult:
    """Train (or resume training) a draft model for ``target`` per ``cfg``; the folder is written to ``cfg.out``."""
    cfg.validate()
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from ..paths import mark_output_dir
    from .data import subsample
    from .drafter_train import mixed_precision_autocast
    from .launcher import check_launcher
    from .make_data import read_training_records
    from .trainer import (
        CHECKPOINTS,
        LOG_FILE,
        STATE_FILE,
        BatchSchedule,
        _trim_log,
        checkpoint_dirs,
        latest_checkpoint,
        pad_batch,
        prepare_training,
        to_device,
    )

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    accelerator = Accelerator()
    check_launcher(accelerator)  # a launcher whose processes did not join one group: refused, one line
    main = accelerator.is_main_process
    quiet = cfg.quiet or not main
    world = accelerator.num_processes

    layer_ids = choose_layers(getattr(target.config, "num_hidden_layers", 0), cfg.layers, cfg.init_layers)
    identity = cfg.identity(target, layer_ids)
    resume = latest_checkpoint(out)
    resume_state = None
    if resume is not None:
        resume_state = json.loads((resume / STATE_FILE).read_text())
        saved = resume_state.get("identity", {})
        diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        if diff:
            raise UsageError(f"{out} holds a run with different settings ({', '.join(diff)}); use another --out "
                             "to start anew")
        if resume_state.get("world_size") != world:
            raise UsageError(f"{resume} was written by {resume_state.get('world_size')} processes, this run has "
                             f"{world}; resume with the same number")

    # Data: the records of make-data (a resumed run takes exactly the lines its first run took).
    t_load = time.perf_counter()
    records = read_training_records(cfg.responses_file().parent, target.vocab_size)  # each checked
    n_lines = int(resume_state["data_lines"]) if resume_state else len(records)
    if len(records) < n_lines:
        raise UsageError(f"{cfg.responses_file()} has {len(records)} records, fewer than the {n_lines} the run in "
                         f"{out} trained on; use another --out")
    records = records[:n_lines]
    train_recs = [r for r in records if r.get("split", "train") == "train"]
    held_recs = [r for r in records if r.get("split") == "heldout"]
    train_recs = subsample(train_recs, cfg.limit, cfg.seed)
    encoded, dropped = _encode(train_recs, cfg.max_length)
    held_encoded, _ = _encode(held_recs[: cfg.eval_records], cfg.max_length)
    if not encoded:
        raise UsageError(f"no training record in {cfg.responses_file()} (split 'train', with response tokens "
                         f"within --max-length {cfg.max_length})")
    lengths = [len(e.input_ids) for e in encoded]
    schedule = BatchSchedule(len(encoded), cfg.batch_size * world, cfg.seed, lengths if cfg.batch_size > 1 else None)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * schedule.per_epoch / cfg.grad_accum)
    start_step = int(resume_state["step"]) if resume_state else 0
    if start_step > total_steps:
        raise UsageError(f"{resume} is at step {start_step}, past the {total_steps} steps asked for")

    # Model: the target's layers, its embedding and head shared and frozen.
    set_seed(cfg.seed)
    lm, meta = init_draft_model(target, len(layer_ids), ",".join(map(str, layer_ids)))
    meta["init"] = cfg.init_layers
    probe = target_probe(target)
    if resume is not None:
        lm.load_state_dict(load_file(str(resume / TRAINABLE_FILE)), strict=False)
    lm.train()
    heldout = dict(resume_state.get("heldout", {})) if resume_state else {}
    if main and not resume_state and held_encoded:
        heldout["before"] = _evaluate(lm, held_encoded, cfg.batch_size)
    model = DraftLoss(lm)
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler("constant_with_warmup" if cfg.schedule == "constant" else cfg.schedule, optimizer,
                              num_warmup_steps=round(cfg.warmup * total_steps), num_training_steps=total_steps)
    # The draft's weights are saved by save_checkpoint (without the shared embedding), not by accelerate.
    model, optimizer = prepare_training(accelerator, model, optimizer, scheduler, resume)

    _log(f"draft-model: {len(encoded)} training records ({len(held_recs)} held out, {dropped} without response "
         f"tokens within --max-length dropped), {total_steps} steps of {cfg.batch_size * cfg.grad_accum * world} "
         f"sequences ({total_steps * cfg.grad_accum / schedule.per_epoch:.2f} epochs); {len(layer_ids)} layers from "
         f"target layers {layer_ids} ({n_trainable / 1e6:.2f}M parameters trained, embedding and head shared), "
         f"lr {cfg.lr:g}; loaded in {time.perf_counter() - t_load:.1f}s"
         + (f"; resuming from step {start_step}" if resume is not None else ""), quiet)

    log_path = out / LOG_FILE
    if main:
        mark_output_dir(out, COMMAND)
        _trim_log(log_path, start_step)

    def state_at(step, loss):
        return {"step": step, "total_steps": total_steps, "loss": loss, "world_size": world, "method": "draft-model",
                "identity": identity, "config": asdict(cfg), "data_lines": n_lines, "records": len(encoded),
                "meta": meta, "heldout": heldout, "time": time.time()}

    def save_checkpoint(step, loss) -> None:
        root = out / CHECKPOINTS
        final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        if main:
            save_file({k: v.detach().contiguous() for k, v in own_state(lm).items()}, str(tmp / TRAINABLE_FILE))
        accelerator.save_state(str(tmp / "accelerate"))
        accelerator.wait_for_everyone()
        if main:
            (tmp / STATE_FILE).write_text(json.dumps(state_at(step, loss), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in checkpoint_dirs(out)[: -cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in root.glob(".step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        accelerator.wait_for_everyone()

    step = last_saved = start_step
    last_loss = resume_state.get("loss") if resume_state else None
    stopped = False
    deadline = None if cfg.max_minutes is None else time.perf_counter() + cfg.max_minutes * 60
    bar = tqdm(total=total_steps, initial=start_step, desc="train draft-model", unit="step", disable=quiet,
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    t0 = time.perf_counter()
    autocast = mixed_precision_autocast(accelerator.device.type, cfg.mixed_precision)
    try:
        with deferred_stops():
            while step < total_steps:
                t_step = time.perf_counter()
                batches = []
                for m in range(step * cfg.grad_accum, (step + 1) * cfg.grad_accum):
                    mine = schedule.batch(m)[accelerator.process_index :: world]
                    batches.append(to_device(pad_batch([encoded[i] for i in mine], 0), accelerator.device))
                local_tokens = torch.tensor(float(sum(b["num_tokens"] for b in batches)))
                total_tokens = float(accelerator.reduce(local_tokens, reduction="sum"))
                loss_sum = torch.zeros(())
                correct = torch.zeros(())
                for i, batch in enumerate(batches):
                    ctx = accelerator.no_sync(model) if i < len(batches) - 1 else nullcontext()
                    with ctx:
                        with autocast:
                            s, c = model(batch["input_ids"], batch["attention_mask"], batch["labels"])
                        # DDP averages gradients over processes: scale by world for the global token mean
                        accelerator.backward(s * (world / max(total_tokens, 1.0)))
                    loss_sum += s.detach().float()
                    correct += c.detach().float()
                if cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                last_loss = float(accelerator.reduce(loss_sum, reduction="sum")) / max(total_tokens, 1.0)
                top1 = float(accelerator.reduce(correct, reduction="sum")) / max(total_tokens, 1.0)
                dt = time.perf_counter() - t_step
                if main:
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": step, "loss": round(last_loss, 5), "acc": round(top1, 4), "lr": lr,
                                            "tokens": int(total_tokens), "seconds": round(dt, 3)}) + "\n")
                bar.set_postfix(loss=f"{last_loss:.4f}", top1=f"{top1:.3f}", lr=f"{lr:.2e}", s_step=f"{dt:.1f}",
                                refresh=False)
                bar.update(1)
                over = deadline is not None and time.perf_counter() > deadline
                over = bool(accelerator.reduce(torch.tensor(float(over)), reduction="sum") > 0)  # every process agrees
                if step % cfg.save_every == 0 or step == total_steps or over:
                    save_checkpoint(step, last_loss)
                    last_saved = step
                raise_if_stopped()  # a Ctrl-C or SIGTERM during the step stops here, the step kept
                if over and step < total_steps:
                    stopped = True
                    break
    except KeyboardInterrupt:
        bar.close()
        if step > last_saved:
            save_checkpoint(step, last_loss)
            last_saved = step
        kept = f"checkpoint at step {last_saved} in {out / CHECKPOINTS}" if last_saved else "no step finished"
        raise KeyboardInterrupt(f"{kept}; re-run the same command to resume") from None
    bar.close()
    seconds = time.perf_counter() - t0

    megabytes = 0.0
    if main:
        unwrapped = accelerator.unwrap_model(model).lm
        if held_encoded:
            heldout["after"] = _evaluate(unwrapped, held_encoded, cfg.batch_size)
        meta["trained"] = {"steps": step, "total_steps": total_steps, "loss": last_loss, "records": len(encoded),
                           "data": identity["data"]}
        save_draft_model(unwrapped, meta, out, probe)
        megabytes = folder_megabytes(out)
        _plot(out / LOG_FILE, out / "loss.png")
        summary = state_at(step, last_loss)
        summary.update(trainable_parameters=n_trainable, seconds_this_run=round(seconds, 2),
                       steps_this_run=step - start_step, megabytes_fp16=round(megabytes, 2),
                       stopped_by_budget=stopped)
        write_json(out / SUMMARY_FILE, summary)
        if megabytes > MAX_SHIPPED_MB:
            _log(f"note: {out / WEIGHTS_FILE} is {megabytes:.1f} MB, more than the {MAX_SHIPPED_MB:.0f} MB a shipped "
                 "drafter may weigh; fewer --layers make it smaller", cfg.quiet)
    accelerator.wait_for_everyone()
    return DraftTrainResult(str(out), start_step, step, total_steps, last_loss, seconds, len(encoded), layer_ids,
                            megabytes, heldout, stopped, main)


__all__ = ["DraftTrainConfig", "DraftTrainResult", "train_draft_model"]
