"""CLLM consistency training (Kou et al., ICML'24, §3.2.2, Algorithm 2): ``fastforward train cllm``.

The data are Jacobi trajectories from ``fastforward collect-trajectories``: per record a prefix ``x`` (prompt + the
answer before the block), the block's n-token states ``y^(0) .. y^(K) = y*`` and the target's full greedy answer
``l``. Each micro-batch draws, per record, one state with a seeded generator and computes

* **global consistency** (``--loss global``, eq. 4; the default): ``sum_i KL(q_sg(. | x, y*_<i) || q(. | x, y_<i))``
  with ``y`` drawn uniformly from the states before the fixed point; the teacher ``q_sg`` is the model itself with
  gradients stopped (its logits at the block positions of the clean ``prompt + answer`` sequence, which contains
  ``x, y*``, so the AR forward doubles as the teacher forward, as in the official code);
* **local consistency** (``--loss local``, eq. 5): the same with ``(y, teacher) = (y^(j), y^(j+1))``, ``j`` uniform,
  the teacher a separate no-grad forward on ``x, y^(j+1)``;
* **AR loss** (eq. 6): causal-LM cross-entropy on the target's own greedy answer ``l`` given the prompt, with label
  smoothing ``--label-smoothing`` (default 0.1, as the official code);
* total (eq. 7): ``L = L_consistency + w * L_AR`` with ``w = --ar-weight`` (default 10, the official setting).

Positions ``i`` whose input is identical for student and teacher (``y_<i == teacher_<i``: the converged prefix of the
state) have a KL of exactly zero; they are masked out by default (``--no-mask`` keeps them), as the official code
masks the already-converged prefix. Normalisation, as the official code at its batch size 1: per record the KL is
averaged over the unmasked positions (0 when none is left) and the AR loss over the answer tokens; the trainer
averages records over the optimizer step (each record is one "loss token").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..jsonl import jsonl_records
from .data import subsample
from .trainer import pad_batch, seed_key
from .trajectories import TRAJECTORIES

LOSSES = ("global", "local")


@dataclass
class CLLMRecord:
    """One (prompt, block) training record. ``input_ids`` = prompt + greedy answer (truncated to --max-length), the
    AR loss covering ``input_ids[prompt_len:]``; the block sits at positions ``prefix_length ..
    prefix_length + n - 1`` of it, where it equals ``fixed_point``."""

    input_ids: list[int]
    prompt_len: int
    prefix_length: int
    states: list[list[int]]
    fixed_point: list[int]

    @property
    def n(self) -> int:
        return len(self.fixed_point)


# ------------------------------------------------------------------------------------------------------------------
# Pure loss functions
# ------------------------------------------------------------------------------------------------------------------


def converged_prefix_mask(states, teachers, valid=None):
    """``[B, n]`` bool: the positions to train. Position ``i`` predicts block token ``i`` from ``states[:, :i]``; it
    is left out when ``states[:, :i] == teachers[:, :i]`` (same input as the teacher, so a KL of zero), i.e. for
    ``i <=`` the first index where they differ."""
    import torch

    diff = (states != teachers).long()
    if valid is not None:
        diff = diff * valid.long()
    before = torch.cumsum(diff, dim=1) - diff  # mismatches strictly before position i
    keep = before > 0
    return keep if valid is None else keep & valid.bool()


def consistency_kl(student_logits, teacher_logits, include):
    """Per-record consistency loss ``[B]``: forward ``KL(softmax(teacher) || softmax(student))`` at each block
    position, averaged over the positions in ``include`` (``[B, n]`` bool; 0 for a record with none). The teacher's
    logits are detached (stop-gradient)."""
    import torch

    lt = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    ls = torch.log_softmax(student_logits.float(), dim=-1)
    kl = (lt.exp() * (lt - ls)).sum(-1)  # [B, n]
    inc = include.to(kl.dtype)
    return (kl * inc).sum(1) / inc.sum(1).clamp(min=1.0)


def ar_loss(logits, labels, label_smoothing: float = 0.0):
    """Per-record AR loss ``[B]``: mean (label-smoothed) cross-entropy of ``labels[:, 1:]`` given ``logits[:, :-1]``
    (-100 labels ignored; 0 for a record without labels)."""
    import torch.nn.functional as F

    b, t, v = logits.shape
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), labels[:, 1:].reshape(-1), ignore_index=-100,
                         reduction="none", label_smoothing=label_smoothing).view(b, t - 1)
    count = (labels[:, 1:] != -100).sum(1).clamp(min=1)
    return ce.sum(1) / count


def _logits_from(model, input_ids, attention_mask, start: int):
    """Logits for positions ``start ..`` of the batch (``[B, T - start, V]``), computing the LM head only there."""
    t = input_ids.shape[1]
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                     logits_to_keep=t - start).logits
    except TypeError:  # a model without logits_to_keep
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, start:]


def _block_logits(logits, start: int, block_starts, n: int):
    """``[B, n, V]``: the logits that predict block tokens 0..n-1 (at positions ``block_start - 1 + i``), from logits
    that begin at position ``start``."""
    import torch

    idx = block_starts.view(-1, 1) - 1 + torch.arange(n, device=block_starts.device).view(1, -1) - start
    idx = idx.clamp(0, logits.shape[1] - 1)
    return logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------


def trajectories_file(spec: str) -> Path:
    """The trajectories.jsonl of a collection folder (or the file itself); a one-line error when missing."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TRAJECTORIES
    if not path.is_file():
        raise UsageError(f"no trajectories at {spec} (expected {TRAJECTORIES}; run 'fastforward collect-trajectories')")
    return path


def _token_ids(value, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"'{key}' must be a list of token ids")
    return list(value)


def _record(path, lineno: int, rec: dict, max_length: int) -> CLLMRecord | None:
    """One trajectory record, checked (``None`` when prefix + block do not fit ``max_length``)."""
    try:
        prompt, answer = _token_ids(rec["prompt_ids"], "prompt_ids"), _token_ids(rec["answer_ids"], "answer_ids")
        fixed = _token_ids(rec["fixed_point"], "fixed_point")
        start = rec["prefix_length"]
        if not isinstance(start, int) or isinstance(start, bool) or not isinstance(rec["states"], list):
            raise TypeError("'prefix_length' must be an integer and 'states' a list")
        states = [_token_ids(s, "states") for s in rec["states"]]
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path} line {lineno}: not a trajectory record ({type(exc).__name__}: {exc})") from None
    full = prompt + answer
    if (not fixed or not states or any(len(s) != len(fixed) for s in states)
            or full[start : start + len(fixed)] != fixed or start <= len(prompt) - 1):
        raise UsageError(f"{path} line {lineno}: inconsistent record (the fixed point must be the answer "
                         "at prefix_length, every state n tokens long)")
    if start + len(fixed) > max_length:
        return None
    return CLLMRecord(full[:max_length], len(prompt), start, states, fixed)


def read_records(path, max_length: int) -> tuple[list[CLLMRecord], int]:
    """(records, number dropped because prefix + block do not fit ``max_length``) from a trajectories.jsonl: the
    file is read as fastforward's record files are (:func:`fastforward.jsonl.jsonl_records`)."""
    parsed = [_record(path, n, rec, max_length) for n, rec in jsonl_records(path)]
    records = [r for r in parsed if r is not None]
    return records, len(parsed) - len(records)


def check_trajectories(path, max_length: int) -> tuple[list[CLLMRecord], int]:
    """:func:`read_records`, with no record that fits ``max_length`` a one-line :class:`UsageError` (the command
    calls it before the model loads, the training method again when it reads its data)."""
    records, dropped = read_records(path, max_length)
    if not records and dropped:
        raise UsageError(f"no trajectory record fits --max-length {max_length}")
    if not records:
        raise UsageError(f"{path} holds no trajectory records")
    return records, dropped


# ------------------------------------------------------------------------------------------------------------------
# The training method
# ------------------------------------------------------------------------------------------------------------------


class CLLM:
    """The ``cllm`` training method for :func:`fastforward.train.trainer.train`."""

    name = "cllm"

    def __init__(self, loss: str = "global", ar_weight: float = 10.0, label_smoothing: float = 0.1,
                 mask: bool = True, seed: int = 0, pad_id: int = 0):
        check_loss_settings(loss, ar_weight, label_smoothing)
        self.kind = loss
        self.ar_weight = float(ar_weight)
        self.label_smoothing = float(label_smoothing)
        self.mask = mask
        self.seed = seed
        self.pad_id = pad_id
        self._sums = {"records": 0, "consistency": 0.0, "ar": 0.0, "positions": 0, "trained_positions": 0}

    # The trainer reads the training set through this (instead of --data's instruction/response records).
    def load_records(self, cfg, tokenizer):
        records, dropped = check_trajectories(cfg.data, cfg.max_length)
        return subsample(records, cfg.limit, cfg.seed), 0, dropped

    def collate(self, examples, key: int) -> dict:
        import torch

        g = torch.Generator().manual_seed(seed_key(self.seed, key))
        batch = pad_batch(examples, self.pad_id)  # the clean prompt + answer sequences, labels on the answer
        b, n = len(examples), max(e.n for e in examples)
        width = max(e.prefix_length + e.n for e in examples)
        student = torch.full((b, width), self.pad_id, dtype=torch.long)
        teacher = torch.full((b, width), self.pad_id, dtype=torch.long)
        smask = torch.zeros((b, width), dtype=torch.long)
        s_block = torch.full((b, n), self.pad_id, dtype=torch.long)
        t_block = torch.full((b, n), self.pad_id, dtype=torch.long)
        valid = torch.zeros((b, n), dtype=torch.bool)
        picked = []
        for r, e in enumerate(examples):
            k = len(e.states)
            j = int(torch.randint(max(k - 1, 1), (1,), generator=g))
            state = e.states[j]
            target = e.fixed_point if self.kind == "global" else e.states[min(j + 1, k - 1)]
            prefix = e.input_ids[: e.prefix_length]
            length = e.prefix_length + e.n
            student[r, :length] = torch.tensor(prefix + state)
            teacher[r, :length] = torch.tensor(prefix + target)
            smask[r, :length] = 1
            s_block[r, : e.n] = torch.tensor(state)
            t_block[r, : e.n] = torch.tensor(target)
            valid[r, : e.n] = True
            picked.append(j)
        include = converged_prefix_mask(s_block, t_block, valid) if self.mask else valid
        batch.update(
            student_ids=student, teacher_ids=teacher, student_mask=smask, include=include, valid=valid,
            block_starts=torch.tensor([e.prefix_length for e in examples], dtype=torch.long), n_block=n,
            state_index=torch.tensor(picked, dtype=torch.long), num_tokens=b,
        )
        return batch

    def loss(self, model, batch):
        import torch
        import torch.nn.functional as F

        starts = batch["block_starts"]
        b, n = len(starts), batch["n_block"]
        need_ar = self.ar_weight > 0
        first = max(int(starts.min()) - 1, 0)  # the first position whose logits the student needs
        student_ids, student_mask = batch["student_ids"], batch["student_mask"]
        ar = torch.zeros(b)
        teacher_logits = None
        if need_ar or self.kind == "global":
            # One forward over [clean prompt + answer rows; student rows] (the student rows are never longer): the
            # AR loss and the global teacher come from the clean rows, the consistency input from the student rows.
            clean_ids, clean_mask = batch["input_ids"], batch["attention_mask"]
            width = clean_ids.shape[1]
            pad = width - student_ids.shape[1]
            if pad < 0:
                raise RuntimeError("a student row is longer than its clean prompt + answer row")
            ids = torch.cat([clean_ids, F.pad(student_ids, (0, pad), value=self.pad_id)])
            mask = torch.cat([clean_mask, F.pad(student_mask, (0, pad), value=0)])
            if need_ar:
                first = min(first, max(int(batch["prompt_lens"].min()) - 1, 0))
            logits = _logits_from(model, ids, mask, first)
            clean, s_all = logits[:b], logits[b:]
            if need_ar:
                ar = ar_loss(clean, batch["labels"][:, first:], self.label_smoothing)
            if self.kind == "global":
                teacher_logits = _block_logits(clean, first, starts, n).detach()
        else:
            s_all = _logits_from(model, student_ids, student_mask, first)
        if teacher_logits is None:  # local: the next state is the teacher, stop-gradient
            with torch.no_grad():
                t_first = max(int(starts.min()) - 1, 0)
                t_all = _logits_from(model, batch["teacher_ids"], student_mask, t_first)
                teacher_logits = _block_logits(t_all, t_first, starts, n)
        student_logits = _block_logits(s_all, first, starts, n)
        cons = consistency_kl(student_logits, teacher_logits, batch["include"])
        self._sums["records"] += b
        self._sums["consistency"] += float(cons.detach().sum())
        self._sums["ar"] += float(ar.detach().sum())
        self._sums["positions"] += int(batch["valid"].sum())
        self._sums["trained_positions"] += int(batch["include"].sum())
        return (cons + self.ar_weight * ar.to(cons.dtype)).sum()

    def stats(self) -> dict:
        s = self._sums
        r = max(s["records"], 1)
        return {
            "loss": self.kind, "ar_weight": self.ar_weight, "label_smoothing": self.label_smoothing,
            "mask_converged": self.mask, "records_seen": s["records"],
            "mean_consistency": s["consistency"] / r, "mean_ar": s["ar"] / r,
            "trained_position_fraction": s["trained_positions"] / max(s["positions"], 1),
        }


def check_loss_settings(loss: str, ar_weight: float, label_smoothing: float) -> None:
    if loss not in LOSSES:
        raise UsageError(f"--loss must be global or local, got '{loss}'")
    if not ar_weight >= 0:
        raise UsageError(f"--ar-weight must be >= 0, got {ar_weight}")
    if not 0.0 <= label_smoothing < 1.0:
        raise UsageError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
