"""One training run: what every ``fastforward train METHOD`` loop shares, written once.

A method -- the fine-tunes of the target itself (:mod:`.trainer`: ``msn``, ``cllm``, ``pasta-sft``, ``pasta-bon``),
the drafters over the target's features (:mod:`.drafter_train`: ``eagle``, ``fasteagle``, ``falcon``) and the draft
model (:mod:`.draft_model`) -- brings its data, its model, the loss of a step and its save format.
:class:`TrainingRun` does the rest:

* the process group: an ``accelerate`` ``Accelerator`` (``accelerate launch`` / ``ACCELERATE_USE_CPU=1 torchrun``
  run the same command data parallel), and a launcher whose processes did not join one group refused in one line
  (:func:`~fastforward.train.launcher.check_launcher`);
* resume: the latest complete checkpoint in ``OUT/checkpoints`` and its ``trainer_state.json``; a run whose settings
  (the method's *identity*) or number of processes differ from the checkpoint's is refused in one line;
* checkpoints (:func:`write_checkpoint`): ``OUT/checkpoints/step-NNNNNN`` with the method's weights, accelerate's
  optimizer/scheduler/RNG states and ``trainer_state.json``, written last into a temporary folder that is then
  renamed, so a checkpoint exists whole or not at all; older ones pruned;
* the loop (:meth:`TrainingRun.train`): the optimizer step (gradient clipping, the schedule), the per-step log
  ``OUT/train_log.jsonl`` (trimmed back to the checkpoint on resume), progress (a tqdm bar, or a line every 10 steps),
  a checkpoint every ``save_every`` steps, at the last step and at the ``--max-minutes`` budget (every process
  agreeing), and Ctrl-C or SIGTERM deferred to the end of a step (:mod:`fastforward.interrupts`): the step is kept,
  checkpointed, and the run stops with one line saying how to resume.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..interrupts import deferred_stops, raise_if_stopped
from ..paths import mark_output_dir
from .launcher import check_launcher

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "fastforward_train.json"
MIXED_PRECISION = ("no", "bf16")
SCHEDULES = ("linear", "cosine", "constant")
PROGRESS_LINE_EVERY = 10  # steps between two progress lines (progress="lines")


# ------------------------------------------------------------------------------------------------------------------
# Settings every method checks alike
# ------------------------------------------------------------------------------------------------------------------


def check_settings(cfg, positive_ints) -> None:
    """The settings every method's config shares, each refused in one line naming its flag: ``positive_ints`` (the
    names of fields that are None or a positive integer), the warmup fraction, the schedule (when the config has
    one), weight decay and gradient clipping, and the mixed precision (when the config has one)."""
    for name in positive_ints:
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not 0.0 <= cfg.warmup < 1.0:
        raise UsageError(f"--warmup is a fraction of the steps in [0, 1), got {cfg.warmup}")
    schedule = getattr(cfg, "schedule", SCHEDULES[1])
    if schedule not in SCHEDULES:
        raise UsageError(f"--schedule must be linear, cosine or constant, got '{schedule}'")
    if cfg.weight_decay < 0 or cfg.max_grad_norm < 0:
        raise UsageError("--weight-decay and --max-grad-norm must be >= 0")
    check_mixed_precision(getattr(cfg, "mixed_precision", MIXED_PRECISION[0]))


def check_mixed_precision(value: str) -> None:
    if value not in MIXED_PRECISION:
        raise UsageError(f"--mixed-precision must be one of {', '.join(MIXED_PRECISION)}, got {value!r}")


def mixed_precision_autocast(device_type: str, mixed_precision: str):
    """The context a training forward and loss run in: bf16 autocast for ``"bf16"`` (weights, gradients and the
    optimizer stay fp32; on CPUs with AMX or AVX512-BF16 a step takes about half the time), else a no-op. Our own
    context rather than ``Accelerator(mixed_precision=...)``, whose process-wide state cannot change between two
    trainings in one process."""
    import torch

    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16")


def transformers_schedule(optimizer, schedule: str, warmup: float, total_steps: int):
    """transformers' learning-rate schedule ``schedule`` (linear, cosine, or constant after warmup) over
    ``total_steps``, warming up over the ``warmup`` fraction of them."""
    from transformers import get_scheduler

    return get_scheduler("constant_with_warmup" if schedule == "constant" else schedule, optimizer,
                         num_warmup_steps=round(warmup * total_steps), num_training_steps=total_steps)


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints and the log
# ------------------------------------------------------------------------------------------------------------------


def checkpoint_dirs(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with ``trainer_state.json``) under ``out``, oldest first."""
    root = Path(out) / CHECKPOINTS
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit() and (d / STATE_FILE).is_file():
                found.append((int(d.name[5:]), d))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    found = checkpoint_dirs(out)
    return found[-1][1] if found else None


def write_checkpoint(accelerator, out: Path, step: int, state: dict, keep: int, write_weights) -> Path:
    """Write ``out/checkpoints/step-NNNNNN`` atomically -- ``write_weights(folder)`` (on the main process), then
    accelerate's states, then ``trainer_state.json`` -- keep the newest ``keep`` checkpoints; return its path."""
    root = Path(out) / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    main = accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if main:
        write_weights(tmp)
    accelerator.save_state(str(tmp / "accelerate"))
    accelerator.wait_for_everyone()
    if main:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in checkpoint_dirs(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".step-*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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


def trim_log(path: Path, step: int) -> None:
    """Drop log lines past ``step`` (steps an interrupted run did after its last checkpoint) and unreadable ones."""
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


def plot_losses(log_path: Path, png: Path, title: str) -> bool:
    """The loss curve (and step accuracies when logged) of ``train_log.jsonl`` as a PNG; False without matplotlib
    or when the plot cannot be written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not rows:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 50)

    def smooth(v):
        return [sum(v[max(0, i - window + 1) : i + 1]) / len(v[max(0, i - window + 1) : i + 1]) for i in range(len(v))]

    ax[0].plot(steps, smooth([r["loss"] for r in rows]))
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("training loss")
    ax[0].set_title(title)
    accs = sorted({k for r in rows for k in r if k.startswith("acc")})
    for k in accs:
        ax[1].plot(steps, smooth([r.get(k, float("nan")) for r in rows]), label=k)
    if accs:
        ax[1].legend(fontsize=7)
        ax[1].set_xlabel("step")
        ax[1].set_ylabel("top-1 agreement with the target")
    fig.tight_layout()
    try:
        fig.savefig(png, dpi=110)
    except (OSError, ValueError):
        return False
    finally:
        plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------------


def to_device(batch: dict, device) -> dict:
    """Move a batch's tensors to ``device`` (a no-op on CPU)."""
    return {k: (v.to(device) if hasattr(v, "to") and hasattr(v, "device") else v) for k, v in batch.items()}


@dataclass
class Steps:
    """Where :meth:`TrainingRun.train` left off."""

    step: int
    loss: float | None
    seconds: float
    stopped_by_budget: bool = False


class _Progress:
    """A tqdm bar (``"bar"``) or a line every :data:`PROGRESS_LINE_EVERY` steps (``"lines"``), on the main process
    unless the run is quiet."""

    def __init__(self, run: TrainingRun, style: str, total: int, desc: str):
        self.run, self.total, self.bar = run, total, None
        if style == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=run.start_step, desc=desc, unit="step", disable=run.quiet,
                            file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def update(self, step: int, loss: float, metrics: dict, lr: float, dt: float, minutes: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", **{k: f"{v:.3f}" for k, v in metrics.items()}, lr=f"{lr:.2e}",
                                 s_step=f"{dt:.1f}", refresh=False)
            self.bar.update(1)
        elif step % PROGRESS_LINE_EVERY == 0 or step == self.total:
            accs = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
            self.run.say(f"step {step}/{self.total} loss {loss:.4f} {accs} lr {lr:.2e} ({dt:.1f} s/step, "
                         f"{minutes:.1f} min)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TrainingRun:
    """One run of a training method into the output folder ``out`` (see the module docstring).

    Built before the method loads anything: it starts the process group and finds the checkpoint to resume from
    (:attr:`resume`, its state :attr:`state`, :attr:`start_step`), refusing one written with other settings than
    ``identity`` or by another number of processes. The method then builds its model and optimizer, hands them to
    :meth:`prepare`, and calls :meth:`train` with the loss of one step and the writer of its checkpoints.
    ``command`` marks the output folder as that command's (:func:`~fastforward.paths.mark_output_dir`)."""

    def __init__(self, out, command: str, identity: dict, *, quiet: bool = False, threads: int | None = None,
                 log=None):
        import torch
        from accelerate import Accelerator

        if threads:
            torch.set_num_threads(threads)
        self.out = Path(out).expanduser()
        self.command = command
        self.accelerator = Accelerator()
        check_launcher(self.accelerator)  # a launcher whose processes did not join one group: refused, one line
        self.main = self.accelerator.is_main_process
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.quiet = quiet or not self.main
        self._log = log
        self.resume = latest_checkpoint(self.out)
        self.state = json.loads((self.resume / STATE_FILE).read_text()) if self.resume is not None else None
        if self.state is not None:
            self._check_resume(identity)

    def _check_resume(self, identity: dict) -> None:
        saved = self.state.get("identity", {})
        diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        if diff:
            raise UsageError(f"{self.out} holds a run with different settings ({', '.join(diff)}); use another --out "
                             "to start anew")
        if self.state.get("world_size") != self.world:
            raise UsageError(f"{self.resume} was written by {self.state.get('world_size')} processes, this run has "
                             f"{self.world}; resume with the same number")

    @property
    def start_step(self) -> int:
        return int(self.state["step"]) if self.state else 0

    def say(self, msg: str) -> None:
        """A line on stderr (or to the ``log`` callback), from the main process unless the run is quiet."""
        if not self.quiet:
            (self._log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)

    def check_total(self, total_steps: int) -> None:
        """Refuse to resume a checkpoint past the steps asked for."""
        if self.start_step > total_steps:
            raise UsageError(f"{self.resume} is at step {self.start_step}, past the {total_steps} steps asked for")

    def state_at(self, step: int, total_steps: int, loss: float | None, **extra) -> dict:
        """A checkpoint's ``trainer_state.json``: the step, the loss, the number of processes, the method's own
        entries (its identity and config among them) and the time."""
        return {"step": step, "total_steps": total_steps, "loss": loss, "world_size": self.world, **extra,
                "time": time.time()}

    @property
    def summary_file(self) -> Path:
        """``OUT/fastforward_train.json``: the run's summary, written by the method at the end."""
        return self.out / SUMMARY_FILE

    def plot_losses(self, title: str) -> bool:
        """``OUT/loss.png``: the curves of the run's log (:func:`plot_losses`)."""
        return plot_losses(self.out / LOG_FILE, self.out / "loss.png", title)

    def checkpoint(self, step: int, state: dict, write_weights, keep: int = 1) -> Path:
        return write_checkpoint(self.accelerator, self.out, step, state, keep, write_weights)

    def prepare(self, model, optimizer, scheduler, params, max_grad_norm: float):
        """Prepare ``model`` and ``optimizer`` for the process group and restore a resumed run's optimizer, schedule
        and RNG states (:func:`prepare_training`); ``params`` are clipped to ``max_grad_norm`` (0: no clipping)
        before each optimizer step. Returns the prepared model."""
        model, self.optimizer = prepare_training(self.accelerator, model, optimizer, scheduler, self.resume)
        self.scheduler, self.params, self.max_grad_norm = scheduler, params, max_grad_norm
        return model

    def micro_batches(self, step: int, grad_accum: int, schedule, examples, collate) -> list[dict]:
        """This process's share of the ``grad_accum`` micro-batches of optimizer step ``step``: micro-batch ``m`` is
        ``schedule.batch(m)`` (global example indices), split over the processes, ``collate(examples, key)``'d with
        a key unique to (m, process), on the device."""
        batches = []
        for m in range(step * grad_accum, (step + 1) * grad_accum):
            mine = schedule.batch(m)[self.rank :: self.world]
            batch = collate([examples[i] for i in mine], m * self.world + self.rank)
            batches.append(to_device(batch, self.accelerator.device))
        return batches

    def token_mean_step(self, model, batches: list[dict], loss_fn) -> tuple[float, dict, int]:
        """Forward and backward of one optimizer step whose loss is the mean over every loss token of the step, on
        every process, as one big batch would have it. ``loss_fn(batch)`` returns (the *sum* of the batch's
        per-token losses, {name: a count to average over the same tokens}); each batch holds ``num_tokens``.
        Returns (the step's mean loss, {name: count / tokens}, the step's tokens), all over every process."""
        import torch

        acc = self.accelerator
        local_tokens = torch.tensor(float(sum(b["num_tokens"] for b in batches)))
        total_tokens = float(acc.reduce(local_tokens, reduction="sum"))
        tokens = max(total_tokens, 1.0)
        loss_sum = torch.zeros(())
        counts: dict = {}
        for i, batch in enumerate(batches):
            with acc.no_sync(model) if i < len(batches) - 1 else nullcontext():
                s, batch_counts = loss_fn(batch)
                # DDP averages gradients over processes, so scale by world to get the global token mean.
                acc.backward(s * (self.world / tokens))
            loss_sum += s.detach().float()
            for k, v in batch_counts.items():
                counts[k] = counts.get(k, 0.0) + v.detach().float()
        loss = float(acc.reduce(loss_sum, reduction="sum")) / tokens
        metrics = {k: float(acc.reduce(v, reduction="sum")) / tokens for k, v in counts.items()}
        return loss, metrics, int(total_tokens)

    def _optimizer_step(self) -> float:
        """Clip, step the optimizer and the schedule; the learning rate the step used."""
        if self.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def _log_step(self, step: int, loss: float, metrics: dict, lr: float, tokens: int | None, dt: float) -> None:
        if not self.main:
            return
        row = {"step": step, "loss": round(loss, 5), **{k: round(v, 4) for k, v in metrics.items()}, "lr": lr}
        if tokens is not None:
            row["tokens"] = tokens
        row["seconds"] = round(dt, 3)
        with open(self.out / LOG_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _over_budget(self, t0: float, max_minutes: float | None) -> bool:
        """Past the time budget, as every process agrees (each stops at the same step)."""
        if max_minutes is None:
            return False
        import torch

        over = float((time.perf_counter() - t0) / 60 >= max_minutes)
        return bool(self.accelerator.reduce(torch.tensor(over), reduction="sum") > 0)

    def train(self, total_steps: int, step_fn, save, *, save_every: int, max_minutes: float | None = None,
              progress: str = "bar", desc: str = "train") -> Steps:
        """Run optimizer steps from :attr:`start_step` to ``total_steps``. ``step_fn(step)`` does the forward and
        backward passes of step ``step`` (0-based) and returns (its loss over every process, {metric: value} for
        the log and progress, its tokens or None); ``save(step, loss)`` writes a checkpoint (with
        :meth:`checkpoint`). Stops early at the ``max_minutes`` budget (checkpointed); on Ctrl-C or SIGTERM
        keeps the step under way, checkpoints it and raises ``KeyboardInterrupt`` with the line to show."""
        if self.main:
            mark_output_dir(self.out, self.command)
            trim_log(self.out / LOG_FILE, self.start_step)
        step = last_saved = self.start_step
        loss = self.state.get("loss") if self.state else None
        bar = _Progress(self, progress, total_steps, desc)
        t0 = time.perf_counter()
        stopped = False
        try:
            with deferred_stops():
                while step < total_steps:
                    t_step = time.perf_counter()
                    loss, metrics, tokens = step_fn(step)
                    lr = self._optimizer_step()
                    step += 1
                    dt = time.perf_counter() - t_step
                    self._log_step(step, loss, metrics, lr, tokens, dt)
                    bar.update(step, loss, metrics, lr, dt, (time.perf_counter() - t0) / 60)
                    over = self._over_budget(t0, max_minutes)
                    if step % save_every == 0 or step == total_steps or over:
                        save(step, loss)
                        last_saved = step
                    raise_if_stopped()  # a Ctrl-C or SIGTERM during the step stops here, the step kept
                    if over and step < total_steps:
                        stopped = True
                        break
        except KeyboardInterrupt:
            bar.close()
            if step > last_saved:
                save(step, loss)
                last_saved = step
            kept = f"checkpoint at step {last_saved} in {self.out / CHECKPOINTS}" if last_saved else "no step finished"
            raise KeyboardInterrupt(f"{kept}; re-run the same command to resume") from None
        bar.close()
        return Steps(step, loss, time.perf_counter() - t0, stopped)


__all__ = [
    "CHECKPOINTS", "LOG_FILE", "MIXED_PRECISION", "STATE_FILE", "SUMMARY_FILE", "Steps", "TrainingRun",
    "check_mixed_precision", "check_settings", "checkpoint_dirs",
    "latest_checkpoint", "mixed_precision_autocast", "plot_losses", "prepare_training", "to_device",
    "transformers_schedule", "trim_log", "write_checkpoint",
]
