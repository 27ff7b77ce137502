"""``fastforward train fasteagle``: the FastEagle cascade (:mod:`fastforward.drafters.fasteagle`) trained end to end
on the target's own responses (``fastforward make-data``), over the drafter loop (:mod:`.drafter_train`).

Loss (the paper's eqs. 3-6): ``L = sum_i w_i (alpha CE_i + beta SmoothL1_i)`` over the N layers, ``w_i = 0.9^(N-i)``
(deeper layers weigh more), ``alpha = 0.1``: soft cross-entropy between the target's next-token distribution over the
draft vocabulary (its final state through the same frozen head rows) and layer i's, ``beta = 1.0``: SmoothL1 between
h_i and the target's final state at j + i, **averaged** over the hidden dimension as EAGLE-1's code does (the paper
writes a sum, which would weigh it 576x more on the default model). Positions: those whose predicted token is a
response token (and, for the cross-entropy, in the draft vocabulary). One forward per batch: no teacher forcing,
each layer reads the previous one's output from the same pass. Logged: ``acc{i}``, layer i's top-1 agreement with
the target (i = 1..N).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.eagle import target_embedding_rows
from ..drafters.fasteagle import FastEagleDrafter, save_fasteagle
from ..drafters.vocab import DraftVocab
from .drafter_train import DrafterMethod, soft_cross_entropy

DEFAULT_LAYERS = 4
DEFAULT_DRAFT_VOCAB = 8192
CE_WEIGHT = 0.1  # alpha
FEATURE_WEIGHT = 1.0  # beta
DEPTH_DECAY = 0.9  # w_i = 0.9^(N - i)


class FastEagleTraining(DrafterMethod):
    name = "fasteagle"

    def __init__(self, layers: int = DEFAULT_LAYERS, draft_vocab: int = DEFAULT_DRAFT_VOCAB, cascade: bool = True,
                 ce_weight: float = CE_WEIGHT, feature_weight: float = FEATURE_WEIGHT):
        self.layers, self.draft_vocab, self.cascade = layers, draft_vocab, cascade
        self.ce_weight, self.feature_weight = ce_weight, feature_weight
        self.embed = None
        self.vocab: DraftVocab | None = None

    def build(self, target, records, cfg):
        self.read_target(target, records, self.draft_vocab)
        return FastEagleDrafter.for_target(target, self.vocab, self.layers, cascade=self.cascade, seed=cfg.seed)

    def loss(self, drafter, batch):
        ids, response, final = batch["ids"], batch["response"], batch["final"]
        B, T = ids.shape
        inner = getattr(drafter, "module", drafter)
        head = inner.lm_head.weight  # frozen rows of the target's head
        hs = drafter(batch["taps"], ids, self.embed)
        n = len(hs)
        total = torch.zeros((), device=ids.device)
        metrics = {}
        for i, h in enumerate(hs, start=1):
            rows = T - 1 - i  # row j predicts x_{j+1+i}, which must exist
            if rows <= 0:
                continue
            keep = response[:, 1 + i :]  # [B, rows]: the predicted token is a response token
            lab = self.vocab.to_draft(ids[:, 1 + i :])
            f_next = final[:, i : T - 1]  # the target's final state at j + i
            h = h[:, :rows]
            weight = DEPTH_DECAY ** (n - i)
            term = torch.zeros((), device=ids.device)
            if self.feature_weight and bool(keep.any()):
                term = term + self.feature_weight * F.smooth_l1_loss(h[keep], f_next[keep], reduction="none").mean()
            sel = keep & (lab >= 0)
            if bool(sel.any()):
                p = (f_next[sel] @ head.t()).softmax(-1)
                lg = inner.logits(h[sel])
                ce, metrics[f"acc{i}"] = soft_cross_entropy(lg, p, lab[sel])
                term = term + self.ce_weight * ce
            total = total + weight * term
        return total, metrics

    def save(self, drafter, folder: Path) -> None:
        save_fasteagle(drafter, folder, dtype="float16")

    calibrates = True

    def heldout(self, drafter, target, records, store=None):
        return heldout_agreement(target, drafter, records, store=store)

    def load_weights(self, drafter, folder: Path) -> None:
        from safetensors.torch import load_file

        drafter.load_state_dict(load_file(str(folder / "drafter.safetensors")))


def heldout_agreement(target, drafter: FastEagleDrafter, records: list[dict], max_length: int = 768, *,
                      store=None, topk: int = 4) -> dict:
    """Teacher-forced agreement of a drafter with the target on ``records`` (e.g. the held-out split of
    ``make-data``), over response positions: ``top1[i]``, layer i's top-1 == the target's token at depth i;
    ``chain[i]``, layers 1..i all right at once -- the rate at which a chain draft reaches depth i (what decoding can
    accept); ``calibration``, the :class:`~fastforward.drafters.calibration.GreedyCalibration` of each depth's
    top-``topk`` candidates where the backbone above them was right (as a dict). Features come from ``store`` or
    are computed."""
    from ..drafters.calibration import GreedyCalibration
    from ..drafters.features import compute_features

    dev = next(drafter.parameters()).device  # scored where the drafter is
    embed = target_embedding_rows(target, torch.arange(target.vocab_size, device="cpu")).to(dev)
    vocab = drafter.vocab.to(dev)
    n = drafter.cfg.num_layers
    hits, joint, total = torch.zeros(n, device=dev), torch.zeros(n, device=dev), 0
    probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    found: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for r in records:
        ids = torch.tensor(list(r["prompt_ids"]) + list(r["response_ids"]), device="cpu")[:max_length]
        P, T = len(r["prompt_ids"]), ids.numel()
        rows = T - 1 - n - P  # rows j >= P whose every depth has a label
        if rows <= 0:
            continue
        feats = store.get(r) if store is not None else compute_features(target, ids)
        taps = feats["taps"][:T].reshape(1, T, -1).float().to(dev)
        ids = ids.to(dev)
        with torch.no_grad():
            hs = drafter(taps, ids.unsqueeze(0), embed)
        j = torch.arange(P, P + rows, device=dev)
        right, backbone = [], torch.ones(rows, dtype=torch.bool, device=dev)
        for i, h in enumerate(hs, start=1):
            top = drafter.logits(h[0, j]).softmax(-1).topk(min(topk, drafter.cfg.draft_vocab_size), dim=-1)
            hit = vocab.to_target(top.indices) == ids[j + 1 + i].unsqueeze(1)  # [rows, topk]
            probs[i - 1].append(top.values[backbone].flatten().cpu())
            found[i - 1].append(hit[backbone].flatten().cpu())
            right.append(hit[:, 0])
            backbone = backbone & hit[:, 0]
        right = torch.stack(right)  # [n, rows]
        hits += right.sum(1)
        joint += right.int().cumprod(0).sum(1)
        total += rows
    calibration = None
    if total:
        keep = [torch.cat(p) for p in probs]
        depths = next((d for d, p in enumerate(keep) if p.numel() == 0), n)  # depths some backbone reached
        calibration = GreedyCalibration.fit(keep[:depths], [torch.cat(f) for f in found][:depths])
    return {"positions": total, "top1": (hits / max(total, 1)).tolist(), "chain": (joint / max(total, 1)).tolist(),
            "calibration": calibration.as_dict() if calibration else None}
