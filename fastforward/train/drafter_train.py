"""The training of drafters over the target's features (``fastforward train eagle``, and the drafters that build on it):
a small module learns from the frozen target's features on the target's own responses (``fastforward make-data``).

What differs from :mod:`fastforward.train.trainer` (which fine-tunes the target itself): the trained weights are the
drafter's only; the target is loaded for its features, embedding and head, never trained; a batch is a set of
``make-data`` records with their features (stored bf16 in ``DATA/features/`` or computed on first use and stored).
A method (:class:`DrafterMethod`) builds the drafter, gives the loss of a micro-batch and saves the drafter in its
serving layout; this module adds AdamW with warmup + cosine decay and a deterministic data order (micro-batch m of the
run is a pure function of (seed, m), so a resumed run sees the batches the uninterrupted one would have).

The rest is the shared :class:`~fastforward.train.run.TrainingRun`: the process group (``accelerate launch
fastforward train eagle ...`` trains data-parallel unchanged; a launcher whose processes did not join one group is
refused), gradient clipping, checkpoints every ``save_every`` steps written atomically (``OUT/checkpoints/step-NNNNNN``:
drafter weights, optimizer/scheduler/RNG states, trainer state), a per-step log ``OUT/train_log.jsonl``, a
wall-clock budget (``max_minutes``: stop, checkpoint, and say so). At the end the drafter in its serving layout in
``OUT/`` plus ``OUT/loss.png``. Re-running the same command resumes.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..paths import check_output_dir
from .make_data import read_training_records
from .run import TrainingRun, check_settings, mixed_precision_autocast

COMMAND = "train"
IDENTITY_KEYS = ("model", "data", "method", "seed", "max_length", "batch_size", "grad_accum", "lr", "warmup",
                 "weight_decay", "max_grad_norm", "limit", "extra")
#: where a batch's target features come from: ``store`` -- the make-data folder's ``features/`` (computed with the
#: target's decoding forward and stored where missing); ``forward`` -- the target's HF model on the training device,
#: per batch, never stored (:class:`~fastforward.drafters.features.ForwardFeatures`); ``auto`` -- ``forward`` on an
#: accelerator, ``store`` on the CPU
FEATURE_SOURCES = ("auto", "store", "forward")
ORDER_WINDOW = 16  # micro-batches sorted by length together (less padding, still random across windows)


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
    features: str = "auto"  # FEATURE_SOURCES
    eval_records: int | None = None  # held-out records scored at the end (None: all of them, 0: none)
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        check_settings(self, ("batch_size", "grad_accum", "max_length", "save_every", "max_steps"))
        if not self.epochs > 0:
            raise UsageError(f"--epochs must be > 0, got {self.epochs}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if self.eval_records is not None and (isinstance(self.eval_records, bool) or not isinstance(
                self.eval_records, int) or self.eval_records < 0):
            raise UsageError(f"--eval-records must be an integer >= 0, got {self.eval_records!r}")
        if self.features not in FEATURE_SOURCES:
            raise UsageError(f"--features must be one of {', '.join(FEATURE_SOURCES)}, got {self.features!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise UsageError(f"--max-minutes must be > 0, got {self.max_minutes}")
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

        responses = [r["response_ids"] for r in records]
        self.vocab = DraftVocab.most_frequent(responses, target.vocab_size, min(draft_vocab, target.vocab_size),
                                              always=sorted(target.eos_token_ids))
        # the draft ids by frequency in the same responses, saved beside the drafter (its head's head_vocab option)
        self.frequency = (self.vocab.frequency_order(responses), sum(len(r) for r in responses), len(records))
        self.embed = target_embedding_rows(target, torch.arange(target.vocab_size))

    def to(self, device) -> None:
        """Put what the loss reads besides the batch and the drafter -- the frozen embedding and the vocabulary's
        maps -- on ``device`` (the training device; the drafter keeps its own vocabulary for saving and scoring)."""
        if getattr(self, "embed", None) is not None:
            self.embed = self.embed.to(device)
        if getattr(self, "vocab", None) is not None:
            self.vocab = self.vocab.to(device)

    #: whether the held-out run's greedy calibration is saved with the drafter (:mod:`fastforward.drafters.calibration`)
    calibrates = False

    def heldout(self, drafter, target, records: list[dict], store=None) -> dict | None:
        """Optional: this kind of drafter's agreement with the target on held-out records (their features from
        ``store``, a :class:`~fastforward.drafters.features.FeatureStore`, when given)."""
        return None

    def evaluate(self, drafter, target, records: list[dict], store=None) -> dict | None:
        """The trained drafter scored on held-out records (in the run's summary and printed), and with
        :attr:`calibrates` its greedy calibration kept in its config to be saved with it. ``store``: where the
        records' features are (the training's own store: computed once, not again at every scoring)."""
        if not records:
            return None
        drafter.eval()
        held = self.heldout(drafter, target, records, store)
        if held is not None and self.calibrates:
            from ..drafters.calibration import CONFIG_KEY

            drafter.cfg.fastforward[CONFIG_KEY] = held["calibration"]
        return held

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


def collate(seqs: list[dict], store, device=None) -> dict:
    """Right-padded ids, taps, final states and a mask of response positions, on ``device`` (default: the CPU, or
    where :class:`~fastforward.drafters.features.ForwardFeatures` computes the features)."""
    import torch

    from ..drafters.features import ForwardFeatures
    from .run import to_device

    T = max(len(s["ids"]) for s in seqs)
    B = len(seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s["ids"])
        ids[b, :n] = torch.tensor(s["ids"])
        response[b, s["prompt_len"] : n] = True
    batch = {"ids": ids, "response": response, "lengths": torch.tensor([len(s["ids"]) for s in seqs]),
             "prompt_lens": torch.tensor([s["prompt_len"] for s in seqs])}
    if isinstance(store, ForwardFeatures):  # computed where the ids go
        batch = to_device(batch, store.device if device is None else device)
        batch["taps"], batch["final"] = store.batch(batch["ids"])
        return batch
    taps = final = None
    for b, s in enumerate(seqs):
        n = len(s["ids"])
        feats = store.get(s["record"])
        t, f = feats["taps"][:n], feats["final"][:n]
        if taps is None:
            taps = torch.zeros(B, T, t.shape[1] * t.shape[2])
            final = torch.zeros(B, T, f.shape[1])
        taps[b, :n] = t.reshape(n, -1)
        final[b, :n] = f
    batch["taps"], batch["final"] = taps, final
    return batch if device is None else to_device(batch, device)


def warmup_cosine(warmup: float, total: int):
    """The learning-rate factor at each step: linear warmup over the ``warmup`` fraction of ``total`` steps, then a
    cosine decay to a tenth of the peak."""
    warm = max(1, round(warmup * total))

    def lr_at(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm)))) * 0.9 + 0.1

    return lr_at


class DataOrder:
    """Which sequences micro-batch ``m`` takes: epoch e is a seeded permutation and micro-batch m takes the next
    ``batch_size * world`` sequences of it, each window of :data:`ORDER_WINDOW` micro-batches sorted by length (less
    padding, still random across windows); this process keeps its share."""

    def __init__(self, seqs: list[dict], batch_size: int, seed: int, world: int, rank: int):
        self.seqs, self.size, self.seed, self.world, self.rank = seqs, batch_size * world, seed, world, rank
        self.per_epoch = math.ceil(len(seqs) / self.size)

    def indices(self, m: int) -> list[int]:
        epoch, pos = divmod(m, self.per_epoch)
        order = list(range(len(self.seqs)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        w0 = (pos // ORDER_WINDOW) * ORDER_WINDOW * self.size
        window = sorted(order[w0 : w0 + ORDER_WINDOW * self.size], key=lambda i: len(self.seqs[i]["ids"]))
        k = (pos % ORDER_WINDOW) * self.size
        chosen = window[k : k + self.size] or order[: self.size]
        return chosen[self.rank :: self.world]


def _read_sequences(cfg: DrafterTrainConfig, target) -> tuple[list[dict], list[dict], list[dict]]:
    """(training records, held-out records, training sequences) of the make-data folder, each record checked."""
    records = read_training_records(cfg.data, target.vocab_size)  # each checked, before any training
    train_recs = [r for r in records if r.get("split") == "train"]
    held_recs = [r for r in records if r.get("split") != "train"]
    if cfg.limit:
        train_recs = train_recs[: cfg.limit]
    seqs = _sequences(train_recs, cfg.max_length)
    if not seqs:
        raise UsageError(f"no training records in {cfg.data}")
    return train_recs, held_recs, seqs


def _step_function(run: TrainingRun, cfg: DrafterTrainConfig, method: DrafterMethod, drafter, order: DataOrder,
                   store, total: int):
    """The forward and backward passes of one optimizer step: the mean loss of its micro-batches (each under the
    run's autocast), their mean metrics (this process's), the loss averaged over the processes."""
    import torch

    autocast = mixed_precision_autocast(run.accelerator.device.type, cfg.mixed_precision)
    epochs = math.ceil(total * cfg.grad_accum / order.per_epoch)

    def step_fn(step: int):
        metrics_sum: dict[str, float] = {}
        loss_sum = 0.0
        for m in range(step * cfg.grad_accum, (step + 1) * cfg.grad_accum):
            batch = collate([order.seqs[i] for i in order.indices(m)], store, run.accelerator.device)
            # where the run is, for losses with a schedule or randomness of their own (a pure function of m)
            batch.update(seed=random.Random(f"{cfg.seed}:{m}").getrandbits(62), epoch=m // order.per_epoch,
                         epochs=epochs)
            with autocast:
                loss, metrics = method.loss(drafter, batch)
            run.accelerator.backward(loss / cfg.grad_accum)
            loss_sum += float(loss.detach()) / cfg.grad_accum
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v / cfg.grad_accum
        return float(run.accelerator.reduce(torch.tensor(loss_sum), reduction="mean")), metrics_sum, None

    return step_fn


def train_drafter(cfg: DrafterTrainConfig, method: DrafterMethod, log=None) -> dict:
    """Train (or resume training) a drafter per ``cfg``; returns the run's summary."""
    cfg.validate()
    import torch
    from accelerate.utils import set_seed

    import fastforward as ff

    from ..drafters.features import FeatureStore, ForwardFeatures

    check_output_dir(cfg.out, COMMAND)
    run = TrainingRun(cfg.out, COMMAND, cfg.identity(), quiet=cfg.quiet, threads=cfg.threads, log=log)
    t_load = time.perf_counter()
    target = ff.load(cfg.model)
    train_recs, held_recs, seqs = _read_sequences(cfg, target)
    set_seed(cfg.seed)
    drafter = method.build(target, train_recs, cfg)
    if run.resume is not None:
        method.load_weights(drafter, run.resume)
    device = run.accelerator.device
    forward = cfg.features == "forward" or (cfg.features == "auto" and device.type != "cpu")
    store = ForwardFeatures(target, device) if forward else FeatureStore(cfg.data, target, write=run.main)
    params = [p for p in drafter.parameters() if p.requires_grad]
    order = DataOrder(seqs, cfg.batch_size, cfg.seed, run.world, run.rank)
    total = cfg.max_steps or math.ceil(cfg.epochs * order.per_epoch / cfg.grad_accum)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup, total))
    drafter = run.prepare(drafter, optimizer, scheduler, params, cfg.max_grad_norm)
    method.to(device)
    run.say(f"{method.name}: {len(seqs)} training sequences ({len(held_recs)} records held out), {total} steps of "
            f"{cfg.batch_size * cfg.grad_accum * run.world} sequences ({total * cfg.grad_accum / order.per_epoch:.2f} "
            f"epochs), {sum(p.numel() for p in params) / 1e6:.2f}M parameters trained, lr {cfg.lr:g}, "
            f"{'bf16 autocast' if cfg.mixed_precision == 'bf16' else 'fp32'} on {device}, features from "
            f"{'the target on ' + str(device) if forward else cfg.data}; loaded in "
            f"{time.perf_counter() - t_load:.1f}s" + (f"; resuming from step {run.start_step}" if run.resume else ""))

    def save(step: int, loss: float | None) -> None:
        from safetensors.torch import save_file

        def weights(folder: Path) -> None:
            state = run.accelerator.unwrap_model(drafter).state_dict()
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(folder / "drafter.safetensors"))

        run.checkpoint(step, run.state_at(step, total, loss, identity=cfg.identity(), config=asdict(cfg)), weights)

    step_fn = _step_function(run, cfg, method, drafter, order, store, total)
    done = run.train(total, step_fn, save, save_every=cfg.save_every, max_minutes=cfg.max_minutes, progress="lines")
    stopped = f"stopped at the {cfg.max_minutes:g}-minute budget" if done.stopped_by_budget else ""
    summary = {"method": method.name, "step": done.step, "total_steps": total, "loss": done.loss,
               "seconds_this_run": round(done.seconds, 1), "stopped": stopped, "sequences": len(seqs),
               "config": asdict(cfg)}
    if run.main:
        if done.step == run.start_step and run.summary_file.is_file():  # a finished run re-run: keep it, re-score
            summary = json.loads(run.summary_file.read_text())
        # scored (where it trained) before it is saved: a method may keep what the scoring fits with the drafter
        # (eagle's calibration)
        trained = run.accelerator.unwrap_model(drafter)
        scored = held_recs if cfg.eval_records is None else held_recs[: cfg.eval_records]
        held = method.evaluate(trained, target, scored, store)
        if held is not None:
            summary["heldout"] = held
        method.save(trained.cpu(), run.out)
        if getattr(method, "frequency", None) is not None:
            from ..drafters.vocab import write_frequency_order

            order, tokens, n = method.frequency
            write_frequency_order(run.out, order, tokens, f"the response tokens of the {n} records it trained on")
        run.plot_losses(f"train {method.name}")
        run.summary_file.write_text(json.dumps(summary, indent=1) + "\n")
    run.accelerator.wait_for_everyone()
    return summary
