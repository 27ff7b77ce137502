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

import math
import time
from dataclasses import asdict, dataclass, field
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
from ..paths import check_output_dir
from .data import Encoded, subsample
from .make_data import RESPONSES, read_training_records
from .run import TrainingRun, check_settings, mixed_precision_autocast, transformers_schedule
from .trainer import BatchSchedule, TrainResult, pad_batch

COMMAND = "train draft-model"
TRAINABLE_FILE = "draft_fp32.safetensors"  # a checkpoint's trainable weights, full precision


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
    draft_vocab: int = 8192  # the target ids the draft may propose at decode time: the N most frequent (0: all)

    def responses_file(self) -> Path:
        path = Path(self.data).expanduser()
        file = path / RESPONSES if path.is_dir() else path
        if not file.is_file() or file.name != RESPONSES:
            raise UsageError(f"--data {self.data}: no {RESPONSES} there (make it with 'fastforward make-data')")
        return file

    def validate(self) -> None:
        check_settings(self, ("epochs", "max_steps", "batch_size", "grad_accum", "save_every", "keep_checkpoints",
                              "limit", "threads", "layers"))
        if not isinstance(self.eval_records, int) or self.eval_records < 0:
            raise UsageError(f"--eval-records must be an integer >= 0, got {self.eval_records}")
        if not isinstance(self.draft_vocab, int) or isinstance(self.draft_vocab, bool) or self.draft_vocab < 0:
            raise UsageError(f"--draft-vocab must be an integer >= 0, got {self.draft_vocab}")
        if self.max_length < 2:
            raise UsageError(f"--max-length must be at least 2, got {self.max_length}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:
            raise UsageError(f"--max-minutes must be positive, got {self.max_minutes}")
        self.responses_file()
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
class DraftTrainResult(TrainResult):
    """A draft-model run: a :class:`~fastforward.train.trainer.TrainResult` with the draft's layers and size, its
    held-out scores (``before`` and ``after`` training) and whether the time budget stopped it."""

    layers: list = field(default_factory=list)
    megabytes: float = 0.0
    heldout: dict = field(default_factory=dict)
    stopped_by_budget: bool = False

    def report(self) -> str:
        held = ""
        if self.heldout.get("after"):
            before = self.heldout.get("before")
            after = self.heldout["after"]
            held = (f"; held-out top-1 {before['top1']:.3f} -> {after['top1']:.3f}" if before else
                    f"; held-out loss {after['loss']:.3f}, top-1 {after['top1']:.3f}")
        stop = "; stopped at the --max-minutes budget (re-run to continue)" if self.stopped_by_budget else ""
        return (f"saved draft model {self.out} ({len(self.layers)} layers from target layers {self.layers}, "
                f"{self.megabytes:.1f} MB fp16; {self.steps_line()}{held}{stop})")


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


def _read_records(cfg: DraftTrainConfig, target, run: TrainingRun):
    """(encoded training records, encoded held-out records to score, the records' lines, records held out, records
    dropped): the make-data records (a resumed run takes exactly the lines its first run took), checked."""
    records = read_training_records(cfg.responses_file().parent, target.vocab_size)  # each checked
    n_lines = int(run.state["data_lines"]) if run.state else len(records)
    if len(records) < n_lines:
        raise UsageError(f"{cfg.responses_file()} has {len(records)} records, fewer than the {n_lines} the run in "
                         f"{run.out} trained on; use another --out")
    records = records[:n_lines]
    train_recs = [r for r in records if r.get("split", "train") == "train"]
    held_recs = [r for r in records if r.get("split") == "heldout"]
    train_recs = subsample(train_recs, cfg.limit, cfg.seed)
    encoded, dropped = _encode(train_recs, cfg.max_length)
    held_encoded, _ = _encode(held_recs[: cfg.eval_records], cfg.max_length)
    if not encoded:
        raise UsageError(f"no training record in {cfg.responses_file()} (split 'train', with response tokens "
                         f"within --max-length {cfg.max_length})")
    return encoded, held_encoded, n_lines, len(held_recs), dropped


def _draft_to_train(cfg: DraftTrainConfig, target, layer_ids: list[int], run: TrainingRun):
    """(the draft LM in training mode, its metadata): the target's layers ``layer_ids``, its embedding and head
    shared and frozen; a resumed run's trainable weights from its checkpoint."""
    from safetensors.torch import load_file

    lm, meta = init_draft_model(target, len(layer_ids), ",".join(map(str, layer_ids)))
    meta["init"] = cfg.init_layers
    if run.resume is not None:
        lm.load_state_dict(load_file(str(run.resume / TRAINABLE_FILE)), strict=False)
    lm.train()
    return lm, meta


def _draft_vocab(encoded, target, size: int):
    """The ``size`` most frequent target ids of the training responses (EOS always in), or None for every id."""
    if not size or size >= target.vocab_size:
        return None
    from ..drafters.vocab import DraftVocab

    vocab = DraftVocab.most_frequent([e.input_ids[e.prompt_len :] for e in encoded], target.vocab_size, size,
                                     always=sorted(target.eos_token_ids))
    return vocab.target_ids


def _save_draft(run: TrainingRun, lm, meta: dict, probe, summary: dict, draft_vocab=None) -> float:
    """The draft folder in ``--out`` (and ``loss.png``, the run summary); its size in MB."""
    save_draft_model(lm, meta, run.out, probe, draft_vocab)
    megabytes = folder_megabytes(run.out)
    run.plot_losses("train draft-model")
    summary["megabytes_fp16"] = round(megabytes, 2)
    write_json(run.summary_file, summary)
    if megabytes > MAX_SHIPPED_MB:
        run.say(f"note: {run.out / WEIGHTS_FILE} is {megabytes:.1f} MB, more than the {MAX_SHIPPED_MB:.0f} MB a "
                "shipped drafter may weigh; fewer --layers make it smaller")
    return megabytes


def train_draft_model(target, cfg: DraftTrainConfig) -> DraftTrainResult:
    """Train (or resume training) a draft model for ``target`` per ``cfg``; the folder is written to ``cfg.out``."""
    cfg.validate()
    from accelerate.utils import set_seed
    from safetensors.torch import save_file

    layer_ids = choose_layers(getattr(target.config, "num_hidden_layers", 0), cfg.layers, cfg.init_layers)
    identity = cfg.identity(target, layer_ids)
    run = TrainingRun(cfg.out, COMMAND, identity, quiet=cfg.quiet, threads=cfg.threads)
    t_load = time.perf_counter()
    encoded, held_encoded, n_lines, n_held, dropped = _read_records(cfg, target, run)
    lengths = [len(e.input_ids) for e in encoded] if cfg.batch_size > 1 else None
    schedule = BatchSchedule(len(encoded), cfg.batch_size * run.world, cfg.seed, lengths)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * schedule.per_epoch / cfg.grad_accum)
    run.check_total(total_steps)

    set_seed(cfg.seed)
    lm, meta = _draft_to_train(cfg, target, layer_ids, run)
    heldout = dict(run.state.get("heldout", {})) if run.state else {}
    if run.main and not run.state and held_encoded:
        heldout["before"] = _evaluate(lm, held_encoded, cfg.batch_size)
    params = [p for p in lm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = transformers_schedule(optimizer, cfg.schedule, cfg.warmup, total_steps)
    # The draft's weights are saved by save() (without the shared embedding), not by accelerate.
    model = run.prepare(DraftLoss(lm), optimizer, scheduler, params, cfg.max_grad_norm)
    n_trainable = sum(p.numel() for p in params)
    run.say(f"draft-model: {len(encoded)} training records ({n_held} held out, {dropped} without response tokens "
            f"within --max-length dropped), {total_steps} steps of {cfg.batch_size * cfg.grad_accum * run.world} "
            f"sequences ({total_steps * cfg.grad_accum / schedule.per_epoch:.2f} epochs); {len(layer_ids)} layers "
            f"from target layers {layer_ids} ({n_trainable / 1e6:.2f}M parameters trained, embedding and head "
            f"shared), lr {cfg.lr:g}; loaded in {time.perf_counter() - t_load:.1f}s"
            + (f"; resuming from step {run.start_step}" if run.resume is not None else ""))
    config = asdict(cfg)

    def state_at(step, loss):
        return run.state_at(step, total_steps, loss, method="draft-model", identity=identity, config=config,
                            data_lines=n_lines, records=len(encoded), meta=meta, heldout=heldout)

    def save(step, loss):
        own = {k: v.detach().contiguous() for k, v in own_state(lm).items()}
        run.checkpoint(step, state_at(step, loss), lambda folder: save_file(own, str(folder / TRAINABLE_FILE)),
                       keep=cfg.keep_checkpoints)

    autocast = mixed_precision_autocast(run.accelerator.device.type, cfg.mixed_precision)

    def loss_fn(batch):
        with autocast:
            s, correct = model(batch["input_ids"], batch["attention_mask"], batch["labels"])
        return s, {"acc": correct}

    def step_fn(step):
        batches = run.micro_batches(step, cfg.grad_accum, schedule, encoded, lambda examples, _: pad_batch(examples, 0))
        return run.token_mean_step(model, batches, loss_fn)

    done = run.train(total_steps, step_fn, save, save_every=cfg.save_every, max_minutes=cfg.max_minutes,
                     desc="train draft-model")
    megabytes = 0.0
    if run.main:
        unwrapped = run.accelerator.unwrap_model(model).lm
        if held_encoded:
            heldout["after"] = _evaluate(unwrapped, held_encoded, cfg.batch_size)
        meta["trained"] = {"steps": done.step, "total_steps": total_steps, "loss": done.loss, "records": len(encoded),
                           "data": identity["data"]}
        summary = state_at(done.step, done.loss)
        summary.update(trainable_parameters=n_trainable, seconds_this_run=round(done.seconds, 2),
                       steps_this_run=done.step - run.start_step, stopped_by_budget=done.stopped_by_budget)
        megabytes = _save_draft(run, unwrapped, meta, target_probe(target), summary,
                                _draft_vocab(encoded, target, cfg.draft_vocab))
    run.accelerator.wait_for_everyone()
    return DraftTrainResult(str(run.out), run.start_step, done.step, total_steps, done.loss, done.seconds, len(encoded),
                            run.main, layers=layer_ids, megabytes=megabytes, heldout=heldout,
                            stopped_by_budget=done.stopped_by_budget)


__all__ = ["DraftTrainConfig", "DraftTrainResult", "train_draft_model"]
