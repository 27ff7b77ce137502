"""``fastforward train eagle``: the EAGLE-3-style drafter (:mod:`fastforward.drafters.eagle`) trained with
training-time test on the target's own responses (``fastforward make-data``).

Loss (EAGLE-3's): at unrolled step k (k = 0 .. steps-1; step k >= 1 feeds the drafter's own step k-1 outputs back),
the soft cross-entropy between the target's next-token distribution restricted to the draft vocabulary (its final
state through the same frozen head rows) and the drafter's, over response positions whose target token is in the
draft vocabulary, weighted 0.8^k. Logged: ``acc{k}``, the drafter's top-1 agreement with the target at step k.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafters.checkpoint import save_eagle3
from ..drafters.eagle import Eagle3Drafter
from ..drafters.vocab import DraftVocab
from .drafter_train import DrafterMethod, soft_cross_entropy

DEFAULT_DRAFT_VOCAB = 16384
DEFAULT_TTT_STEPS = 5
STEP_WEIGHT = 0.8


class EagleTraining(DrafterMethod):
    name = "eagle"

    def __init__(self, draft_vocab: int = DEFAULT_DRAFT_VOCAB, ttt_steps: int = DEFAULT_TTT_STEPS):
        self.draft_vocab, self.ttt_steps = draft_vocab, ttt_steps
        self.embed = None
        self.vocab: DraftVocab | None = None

    def build(self, target, records, cfg):
        self.read_target(target, records, self.draft_vocab)
        return Eagle3Drafter.for_target(target, self.vocab, seed=cfg.seed)

    def loss(self, drafter, batch):
        ids, response = batch["ids"], batch["response"]
        B, T = ids.shape
        dev = ids.device
        inner = getattr(drafter, "module", drafter)
        head = inner.lm_head.weight  # frozen rows of the target's head
        steps = min(self.ttt_steps, T - 2)
        # labels: response tokens inside the draft vocabulary; the target's distribution for the token at p comes
        # from its final state at p - 1, computed once for every label (each step reads it at another row)
        draft_ids = self.vocab.to_draft(ids)  # [B, T], -1 outside the draft vocabulary
        label_ok = response & (draft_ids >= 0)
        label_ok[:, :2] = False
        teacher = (batch["final"][:, :-1][label_ok[:, 1:]] @ head.t()).softmax(-1)  # [n_labels, draft_vocab]
        where = torch.full((B, T), -1, dtype=torch.long, device=dev)
        where[label_ok] = torch.arange(teacher.shape[0], device=dev)
        selects, targets, labels = [], [], []
        for k in range(steps):
            shift = 2 + k  # at step k row j predicts x_{j+2+k}
            sel = torch.zeros(B, T, dtype=torch.bool, device=dev)
            sel[:, : T - shift] = label_ok[:, shift:]
            at = torch.full((B, T), -1, dtype=torch.long, device=dev)
            at[:, : T - shift] = where[:, shift:]
            lab = torch.full((B, T), -1, dtype=torch.long, device=dev)
            lab[:, : T - shift] = draft_ids[:, shift:]
            selects.append(sel)
            targets.append(teacher[at[sel]])
            labels.append(lab[sel])
        logits = drafter(batch["taps"], ids, self.embed, steps, selects)
        total = torch.zeros((), device=dev)
        metrics = {}
        for k, (lg, p, lab) in enumerate(zip(logits, targets, labels, strict=True)):
            if lab.numel() == 0:
                continue
            ce, metrics[f"acc{k}"] = soft_cross_entropy(lg, p, lab)
            total = total + STEP_WEIGHT**k * ce
        return total, metrics

    def save(self, drafter, folder: Path) -> None:
        save_eagle3(drafter, folder, dtype="float16")

    calibrates = True

    def heldout(self, drafter, target, records, store=None):
        return heldout_agreement(target, drafter, records, self.ttt_steps, store=store)


def heldout_agreement(target, drafter: Eagle3Drafter, records: list[dict], steps: int = 3, *, store=None,
                      topk: int = 4, max_length: int = 768) -> dict:
    """Teacher-forced agreement of an EAGLE-3 drafter with the target on ``records`` (e.g. the held-out split of
    ``make-data``), over response positions: ``top1[k]``, training-time-test step k's top-1 == the target's token
    (step k drafts depth k + 1 of a chain, reading its own earlier outputs and the path's true tokens); ``chain[k]``,
    steps 0..k all right at once -- the rate at which a chain draft reaches depth k + 1; ``calibration``, the
    :class:`~fastforward.drafters.calibration.GreedyCalibration` of each step's top-``topk`` candidates (as a dict).
    Features come from ``store`` (a :class:`~fastforward.drafters.features.FeatureStore`) or are computed."""
    from ..drafters.calibration import GreedyCalibration
    from ..drafters.eagle import target_embedding_rows
    from ..drafters.features import compute_features

    dev = next(drafter.parameters()).device  # scored where the drafter is
    embed = target_embedding_rows(target, torch.arange(target.vocab_size, device="cpu")).to(dev)
    vocab = drafter.vocab.to(dev)
    hits, joint, total = torch.zeros(steps, device=dev), torch.zeros(steps, device=dev), 0
    probs: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    found: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    for r in records:
        ids = torch.tensor(list(r["prompt_ids"]) + list(r["response_ids"]), device="cpu")[:max_length]
        P, T = len(r["prompt_ids"]), ids.numel()
        rows = T - 1 - steps - P + 1  # rows j >= P - 1 whose every step has a label (x_{j+2+k}, k < steps)
        if rows <= 0:
            continue
        feats = store.get(r) if store is not None else compute_features(target, ids)
        taps = feats["taps"][:T].reshape(1, T, -1).float().to(dev)
        ids = ids.to(dev)
        j = torch.arange(P - 1, P - 1 + rows, device=dev)
        select = []
        for _ in range(steps):
            sel = torch.zeros(1, T, dtype=torch.bool, device=dev)
            sel[0, j] = True
            select.append(sel)
        with torch.no_grad():
            logits = drafter.ttt_logits(taps, ids.unsqueeze(0), embed, steps, select)
        right = []
        for k, lg in enumerate(logits):
            top = lg.softmax(-1).topk(min(topk, lg.shape[-1]), dim=-1)
            hit = vocab.to_target(top.indices) == ids[j + 2 + k].unsqueeze(1)  # [rows, topk]
            probs[k].append(top.values.flatten().cpu())
            found[k].append(hit.flatten().cpu())
            right.append(hit[:, 0])
        right = torch.stack(right)  # [steps, rows]
        hits += right.sum(1)
        joint += right.int().cumprod(0).sum(1)
        total += rows
    calibration = GreedyCalibration.fit([torch.cat(p) for p in probs], [torch.cat(f) for f in found]) if total else None
    return {"positions": total, "top1": (hits / max(total, 1)).tolist(), "chain": (joint / max(total, 1)).tolist(),
            "calibration": calibration.as_dict() if calibration else None}

