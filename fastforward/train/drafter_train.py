"""The training loop of drafters (``fastforward train eagle``, and the drafters that build on it): a small module
learns from the frozen target's features on the target's own responses (``fastforward make-data``).

What differs from :mod:`fastforward.train.trainer` (which fine-tunes the target itself): the trained weights are the
drafter's only; the target is loaded for its features, embedding and head, never trained; a batch is a set of
``make-data`` records with their features (stored bf16 in ``DATA/features/`` or computed on first use and stored).

Shared with it: an ``accelerate`` loop (``accelerate launch fastforward train eagle ...`` trains data-parallel
unchanged; a launcher whose processes did not join one group is refused), AdamW with warmup + cosine decay,
gradient clipping, a deterministic data order (micro-batch m of the run is a pure function of (seed, m), so a
resumed run sees the batches the uninterrupted one would have), checkpoints every ``save_every`` steps written
atomically (``OUT/checkpoints/step-NNNNNN``: drafter weights, optimizer/scheduler/RNG states, trainer state), a per-step
log ``OUT/train_log.jsonl``, a wall-clock budget (``max_minutes``: stop, checkpoint, and say so), and at the end the
drafter in its serving layout in ``OUT/`` plus ``OUT/loss.png``. Re-running the same command resumes.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..interrupts import deferred_stops, raise_if_stopped
from ..paths import check_output_dir, mark_output_dir
from .launcher import check_launcher
from .make_data import read_training_records

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "fastforward_train.json"
COMMAND = "train"
MIXED_PRECISION = ("no", "bf16")


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
IDENTITY_KEYS = ("model", "data", "method", "seed", "max_length", "batch_size", "grad_accum", "lr", "warmup",
                 "weight_decay", "max_grad_norm", "limit", "extra")


@dataclass
class DrafterTrainConfig:
    model: str
    data: str  # a make-data folder
    out: str
    method: str = "eagle"
    epochs: float = 1.0
    max_steps: int | None = None
    max_minutes: float | None = None
    lr: float = 3e-4
    batch_size: int = 4  # sequences per micro-batch and process
    grad_accum: int = 2
    max_length: int = 768
    warmup: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    save_every: int = 100
    seed: int = 0
    limit: int | None = None
    threads: int | None = None
    quiet: bool = False
    mixed_precision: str = "no"  # "bf16": the drafter's forward and loss under bf16 autocast (fp32 master weights)
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("batch_size", "grad_accum", "max_length", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise UsageError(f"--max-steps must be a positive integer, got {self.max_steps}")
        if not self.epochs > 0:
            raise UsageError(f"--epochs must be > 0, got {self.epochs}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise UsageError(f"--max-minutes must be > 0, got {self.max_minutes}")
        if not 0 <= self.warmup < 1:
            raise UsageError(f"--warmup must be in [0, 1), got {self.warmup}")
        check_mixed_precision(self.mixed_precision)
        if not Path(self.data).expanduser().is_dir():
            raise UsageError(f"--data {self.data}: not a folder (give a 'fastforward make-data' output folder)")
        if not (Path(self.data).expanduser() / "responses.jsonl").is_file():
            raise UsageError(f"--data {self.data} has no responses.jsonl (run 'fastforward make-data' first)")

    def identity(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in IDENTITY_KEYS}


class DrafterMethod:
    """What a drafter brings to the loop."""

    name = "drafter"

    def build(self, target, records: list[dict], cfg: DrafterTrainConfig):
        """A fresh drafter module (only its ``requires_grad`` parameters are trained)."""
        raise NotImplementedError

    def loss(self, drafter, batch: dict) -> tuple:
        """(mean loss to minimise, {metric: float}) of one micro-batch."""
        raise NotImplementedError

    def save(self, drafter, folder: Path) -> None:
        """The drafter in its serving layout."""
        raise NotImplementedError

    def read_target(self, target, records: list[dict], draft_vocab: int) -> None:
        """What drafters over the target's features share: ``self.vocab``, the ``draft_vocab`` most frequent tokens of
        the responses (EOS always in), and ``self.embed``, the target's frozen embedding [vocab, d]."""
        import torch

        from ..drafters.eagle import target_embedding_rows
        from ..drafters.vocab import DraftVocab

        self.vocab = DraftVocab.most_frequent([r["response_ids"] for r in records], target.vocab_size,
                                              min(draft_vocab, target.vocab_size), always=sorted(target.eos_token_ids))
        self.embed = target_embedding_rows(target, torch.arange(target.vocab_size))

    def evaluate(self, drafter, target, records: list[dict]) -> dict | None:
        """Optional: the trained drafter scored on held-out records (in the run's summary and printed)."""
        return None

    def load_weights(self, drafter, folder: Path) -> None:
        from safetensors.torch import load_file

        drafter.load_state_dict(load_file(str(folder / "drafter.safetensors")))


def soft_cross_entropy(logits, teacher, labels) -> tuple:
    """(mean soft cross-entropy of ``logits`` [n, V] against the teacher's probabilities [n, V], top-1 agreement with
    ``labels`` [n] as a float). The log-softmax runs in fp32 (also under bf16 autocast); the agreement reads the row
    maximum, cheaper on CPU than ``argmax`` (a tie counts as agreement)."""
    import torch

    log_q = logits.float().log_softmax(-1)
    ce = -(teacher * log_q).sum(-1).mean()
    with torch.no_grad():
        top1 = float((log_q.gather(1, labels.unsqueeze(1)).squeeze(1) >= log_q.max(-1).values).float().mean())
    return ce, top1


def _sequences(records: list[dict], max_length: int) -> list[dict]:
    seqs = []
    for r in records:
        ids = (list(r["prompt_ids"]) + list(r["response_ids"]))[:max_length]
        if len(ids) - len(r["prompt_ids"]) >= 2:
            seqs.append({"record": r, "ids": ids, "prompt_len": len(r["prompt_ids"])})
    return seqs


def collate(seqs: list[dict], store) -> dict:
    """Right-padded ids, taps, final states and a mask of response positions."""
    import torch

    T = max(len(s["ids"]) for s in seqs)
    B = len(seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.bool)
    taps = final = None
    for b, s in enumerate(seqs):
        n = len(s["ids"])
        ids[b, :n] = torch.tensor(s["ids"])
        response[b, s["prompt_len"] : n] = True
        feats = store.get(s["record"])
        t, f = feats["taps"][:n], feats["final"][:n]
        if taps is None:
            taps = torch.zeros(B, T, t.shape[1] * t.shape[2])
            final = torch.zeros(B, T, f.shape[1])
        taps[b, :n] = t.reshape(n, -1)
        final[b, :n] = f
    return {"ids": ids, "response": response, "taps": taps, "final": final,
            "lengths": torch.tensor([len(s["ids"]) for s in seqs]),
            "prompt_lens": torch.tensor([s["prompt_len"] for s in seqs])}


def checkpoint_dirs(out: Path) -> list[tuple[int, Path]]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step-") and (d / STATE_FILE).is_file():
            try:
                found.append((int(d.name[5:]), d))
            except ValueError:
                continue
    return sorted(found)


def plot_losses(log_path: Path, png: Path, title: str) -> bool:
    """The loss curve (and step accuracies when logged) of ``train_log.jsonl`` as a PNG; False without matplotlib."""
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
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def train_drafter(cfg: DrafterTrainConfig, method: DrafterMethod, log=None) -> dict:
    """Train (or resume training) a drafter per ``cfg``; returns the run's summary."""
    cfg.validate()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import fastforward as ff

    from ..drafters.features import FeatureStore
    from .trainer import prepare_training

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    check_output_dir(out, COMMAND)
    accelerator = Accelerator()
    check_launcher(accelerator)
    main = accelerator.is_main_process
    world, rank = accelerator.num_processes, accelerator.process_index

    def say(msg: str) -> None:
        if main and not cfg.quiet:
            (log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)

    resume = checkpoint_dirs(out)[-1][1] if checkpoint_dirs(out) else None
    state = json.loads((resume / STATE_FILE).read_text()) if resume else None
    if state is not None:
        diff = sorted(k for k, v in cfg.identity().items() if state["identity"].get(k) != v)
        if diff:
            raise UsageError(f"{out} holds a run with different settings ({', '.join(diff)}); use another --out")
        if state.get("world_size") != world:
            raise UsageError(f"{resume} was written by {state.get('world_size')} processes, this run has {world}")

    t_load = time.perf_counter()
    target = ff.load(cfg.model)
    records = read_training_records(cfg.data, target.vocab_size)  # each checked, before any training
    train_recs = [r for r in records if r.get("split") == "train"]
    held_recs = [r for r in records if r.get("split") != "train"]
    if cfg.limit:
        train_recs = train_recs[: cfg.limit]
    seqs = _sequences(train_recs, cfg.max_length)
    if not seqs:
        raise UsageError(f"no training records in {cfg.data}")
    set_seed(cfg.seed)
    drafter = method.build(target, train_recs, cfg)
    if resume is not None:
        method.load_weights(drafter, resume)
    store = FeatureStore(cfg.data, target, write=main)
    params = [p for p in drafter.parameters() if p.requires_grad]
    per_epoch = math.ceil(len(seqs) / (cfg.batch_size * world))
    total = cfg.max_steps or math.ceil(cfg.epochs * per_epoch / cfg.grad_accum)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warm = max(1, round(cfg.warmup * total))

    def lr_at(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm)))) * 0.9 + 0.1

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    drafter, optimizer = prepare_training(accelerator, drafter, optimizer, scheduler, resume)
    start = int(state["step"]) if state else 0
    n_train = sum(p.numel() for p in params)
    say(f"{method.name}: {len(seqs)} training sequences ({len(held_recs)} records held out), {total} steps of "
        f"{cfg.batch_size * cfg.grad_accum * world} sequences ({total * cfg.grad_accum / per_epoch:.2f} epochs), "
        f"{n_train / 1e6:.2f}M parameters trained, lr {cfg.lr:g}, "
        f"{'bf16 autocast' if cfg.mixed_precision == 'bf16' else 'fp32'}; loaded in {time.perf_counter() - t_load:.1f}s"
        + (f"; resuming from step {start}" if resume else ""))
    if main:
        mark_output_dir(out, COMMAND)
        _trim_log(out / LOG_FILE, start)

    # data order: epoch e is a seeded permutation; micro-batch m takes the next batch_size * world sequences
    def batch_indices(m: int) -> list[int]:
        size = cfg.batch_size * world
        epoch, pos = divmod(m, per_epoch)
        order = list(range(len(seqs)))
        random.Random(f"{cfg.seed}:{epoch}").shuffle(order)
        # sort each window of 16 batches by length: less padding, still random across windows
        w0 = (pos // 16) * 16 * size
        window = sorted(order[w0 : w0 + 16 * size], key=lambda i: len(seqs[i]["ids"]))
        k = (pos % 16) * size
        chosen = window[k : k + size] or order[:size]
        return chosen[rank::world]

    def save(step: int, loss: float | None) -> None:
        root = out / CHECKPOINTS
        tmp, final = root / f".step-{step:06d}.tmp", root / f"step-{step:06d}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp / "accelerate"))
        if main:
            from safetensors.torch import save_file

            unwrapped = accelerator.unwrap_model(drafter)
            save_file({k: v.detach().contiguous() for k, v in unwrapped.state_dict().items()},
                      str(tmp / "drafter.safetensors"))
            (tmp / STATE_FILE).write_text(json.dumps({"step": step, "total_steps": total, "loss": loss,
                                                      "world_size": world, "identity": cfg.identity(),
                                                      "config": asdict(cfg), "time": time.time()}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in checkpoint_dirs(out)[:-1]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    autocast = mixed_precision_autocast(accelerator.device.type, cfg.mixed_precision)
    step, last_loss, last_saved = start, (state or {}).get("loss"), start
    t0 = time.perf_counter()
    stopped = ""
    try:
        with deferred_stops():
            while step < total:
                t_step = time.perf_counter()
                metrics_sum: dict[str, float] = {}
                loss_sum = 0.0
                for m in range(step * cfg.grad_accum, (step + 1) * cfg.grad_accum):
                    batch = collate([seqs[i] for i in batch_indices(m)], store)
                    # where the run is, for losses with a schedule or randomness of their own (a pure function of m)
                    batch.update(seed=random.Random(f"{cfg.seed}:{m}").getrandbits(62), epoch=m // per_epoch,
                                 epochs=math.ceil(total * cfg.grad_accum / per_epoch))
                    with autocast:
                        loss, metrics = method.loss(drafter, batch)
                    accelerator.backward(loss / cfg.grad_accum)
                    loss_sum += float(loss.detach()) / cfg.grad_accum
                    for k, v in metrics.items():
                        metrics_sum[k] = metrics_sum.get(k, 0.0) + v / cfg.grad_accum
                if cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                last_loss = float(accelerator.reduce(torch.tensor(loss_sum), reduction="mean"))
                dt = time.perf_counter() - t_step
                if main:
                    row = {"step": step, "loss": round(last_loss, 5), "lr": lr, "seconds": round(dt, 3)}
                    row.update({k: round(v, 4) for k, v in metrics_sum.items()})
                    with open(out / LOG_FILE, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    if step % 10 == 0 or step == total:
                        accs = " ".join(f"{k}={v:.3f}" for k, v in metrics_sum.items())
                        say(f"step {step}/{total} loss {last_loss:.4f} {accs} lr {lr:.2e} ({dt:.1f} s/step, "
                            f"{(time.perf_counter() - t0) / 60:.1f} min)")
                if step % cfg.save_every == 0 or step == total:
                    save(step, last_loss)
                    last_saved = step
                raise_if_stopped()  # a Ctrl-C or SIGTERM during the step stops here, the step kept
                if cfg.max_minutes and (time.perf_counter() - t0) / 60 >= cfg.max_minutes and step < total:
                    stopped = f"stopped at the {cfg.max_minutes:g}-minute budget"
                    break
    except KeyboardInterrupt:
        if step > last_saved:
            save(step, last_loss)
        raise KeyboardInterrupt(f"checkpoint at step {step} in {out / CHECKPOINTS}; re-run the same command to "
                                "resume") from None
    if step > last_saved:
        save(step, last_loss)
    seconds = time.perf_counter() - t0
    summary = {"method": method.name, "step": step, "total_steps": total, "loss": last_loss,
               "seconds_this_run": round(seconds, 1), "stopped": stopped, "sequences": len(seqs),
               "config": asdict(cfg)}
    if main:
        if step == start and (out / SUMMARY_FILE).is_file():  # a finished run re-run: keep its record, re-score
            summary = json.loads((out / SUMMARY_FILE).read_text())
        # scored before it is saved: a method may keep what the scoring fits with the drafter (eagle's calibration)
        held = method.evaluate(accelerator.unwrap_model(drafter), target, held_recs)
        if held is not None:
            summary["heldout"] = held
        method.save(accelerator.unwrap_model(drafter), out)
        plot_losses(out / LOG_FILE, out / "loss.png", f"train {method.name}")
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    accelerator.wait_for_everyone()
    return summary


def _trim_log(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(k + "\n" for k in keep))
