"""``fastforward train falcon``: the semi-autoregressive Falcon drafter (:mod:`fastforward.drafters.falcon`) trained
with **Coupled Sequential Glancing Distillation** (CSGD, the paper's §3.2) on the target's own responses
(``fastforward make-data``), over the drafter loop (:mod:`.drafter_train`).

Every micro-batch (rows j read ``[e(x_{j+1}); f_j]`` and predict ``f_{j+k}``, the token ``x_{j+k+1}``):

1. **Pass 1** (no gradients): teacher-forced inputs -- the target's final states plus U(-0.1, 0.1) noise and the
   true next tokens. The drafter's tokens are compared with the target's over the loss positions: Hamming distance
   d per sequence.
2. **Glancing.** The inputs of pass 2 are the drafter's own pass-1 predictions, as at decode time, where every block
   after the first reads the previous block's predicted features and drafted tokens: row j reads
   ``(x^_{j+1}, f^_j)`` produced by row j - k (rows j < k, which nothing predicts, stay true). Then N = round(lambda d)
   of those rows get the ground truth back (:func:`glance`): whole blocks picked at random, each block's rows taken
   from its end -- consecutive positions just preceding the block they condition -- until exactly N are replaced.
   ``lambda = 0.4 (E - e) / E`` (the paper's schedule; e = the 0-based epoch, E the run's epochs), so the drafter
   sees more of its own predictions as training goes on.
3. **Pass 2 loss** (the paper's eqs. 2-8): ``SmoothL1(f^, f)`` averaged over d + ``0.1 (0.9 KL(p || p^) +
   0.1 CE(x, p^))``, p the target's next-token distribution over the draft vocabulary (its final state through the
   same frozen head rows), x the response token (the target's own, so a hard label needs no sampling).

``csgd=False`` trains plain teacher forcing (pass 2's inputs = pass 1's), the ablation of Table 4. Logged: ``acc{i}``,
top-1 agreement of the rows at offset i - 1 of their block (the token at depth i of a first pass), and ``lambda``,
``glanced`` (the share of rows given back).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.eagle import target_embedding_rows
from ..drafters.falcon import FalconDrafter, block_mask, save_falcon, training_mask
from ..drafters.vocab import DraftVocab
from ..errors import UsageError
from .drafter_train import DrafterMethod

DEFAULT_BLOCK = 2
DEFAULT_DRAFT_VOCAB = 8192
DISTILL_WEIGHT = 0.1  # omega_dist
KL_SHARE = 0.9  # alpha: KL(p || p^) vs hard-label CE
NOISE = 0.1  # U(-NOISE, NOISE) on true input features
LAMBDA_START = 0.4  # lambda = 0.4 (E - e) / E
CSGD_FORMS = ("two-pass", "sequence", "off")
DEFAULT_CSGD = "two-pass"


def glance_lambda(epoch: int, epochs: int) -> float:
    """The paper's schedule ``0.4 (E - e) / E`` (e 0-based): 0.4 in the first epoch, 0.4 / E in the last."""
    epochs = max(1, epochs)
    return LAMBDA_START * (epochs - min(epoch, epochs - 1)) / epochs


def glance(candidates: torch.Tensor, n: int, k: int, rng: random.Random) -> torch.Tensor:
    """Which rows get the ground truth back: ``candidates`` [T] bool (rows holding a predicted input) -> a [T] bool
    mask with exactly ``min(n, candidates.sum())`` rows set, all candidates: blocks (rows ``bk .. bk + k - 1``) in a
    random order, each block's candidate rows taken from its end, so the replaced rows are consecutive positions
    just before the block they condition."""
    out = torch.zeros_like(candidates)
    rows = candidates.nonzero().flatten().tolist()
    if n <= 0 or not rows:
        return out
    blocks: dict[int, list[int]] = {}
    for r in rows:
        blocks.setdefault(r // k, []).append(r)
    order = list(blocks)
    rng.shuffle(order)
    chosen = [r for b in order for r in reversed(blocks[b])][: min(n, len(rows))]
    out[torch.tensor(chosen, device=out.device)] = True  # one write (on a GPU, not one small kernel per row)
    return out


class FalconTraining(DrafterMethod):
    name = "falcon"

    def __init__(self, block_size: int = DEFAULT_BLOCK, draft_vocab: int = DEFAULT_DRAFT_VOCAB,
                 csgd: str = DEFAULT_CSGD):
        if csgd not in CSGD_FORMS:
            raise UsageError(f"csgd must be one of {', '.join(CSGD_FORMS)}, got {csgd!r}")
        self.block_size, self.draft_vocab, self.csgd = block_size, draft_vocab, csgd
        self.embed = None
        self.vocab: DraftVocab | None = None

    def build(self, target, records, cfg):
        self.read_target(target, records, self.draft_vocab)
        return FalconDrafter.for_target(target, self.vocab, self.block_size, seed=cfg.seed)

    def loss(self, drafter, batch):
        ids, response, final, lengths = batch["ids"], batch["response"], batch["final"], batch["lengths"]
        B, T = ids.shape
        k = self.block_size
        inner = getattr(drafter, "module", drafter)
        head = inner.lm_head.weight  # frozen rows of the target's head
        dev = ids.device
        gen = torch.Generator().manual_seed(int(batch.get("seed", 0)))  # on the CPU: the same noise on any device
        rng = random.Random(int(batch.get("seed", 0)))
        mask = training_mask(lengths, T, k)

        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]  # row j reads x_{j+1}
        emb = F.embedding(nxt, self.embed)
        feat = final + ((torch.rand(final.shape, generator=gen, device="cpu") * 2 - 1) * NOISE).to(dev)
        rows = T - k - 1  # row j predicts x_{j+k+1}, which must exist
        if rows <= 0:
            return torch.zeros((), device=dev, requires_grad=True), {}
        keep = torch.zeros(B, T, dtype=torch.bool, device=dev)
        keep[:, :rows] = response[:, k + 1 :]  # the predicted token is a response token
        labels = torch.full((B, T), -1, dtype=torch.long, device=dev)
        labels[:, :rows] = self.vocab.to_draft(ids[:, k + 1 :])
        f_next = torch.zeros_like(final)
        f_next[:, :rows] = final[:, k : T - 1]  # the target's final state at j + k
        metrics = {}
        if self.csgd == "off":
            out = drafter(emb, feat, mask)
        else:
            lam = glance_lambda(int(batch.get("epoch", 0)), int(batch.get("epochs", 1)))
            emb2, feat2, share = self._glanced_inputs(drafter, emb, feat, mask, labels, keep, lengths, lam, rng)
            metrics["lambda"], metrics["glanced"] = lam, share
            if self.csgd == "sequence":
                out = drafter(emb2, feat2, mask)
            else:  # two-pass: [true rows ; second-pass rows], each block's second pass over the true rows before it
                valid = (torch.arange(T, device=dev).unsqueeze(0) < lengths.unsqueeze(1)).repeat(1, 2)  # [B, 2T] keys
                both = (chain_mask(T, k, dev).unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)
                out = drafter(torch.cat([emb, emb2], 1), torch.cat([feat, feat2], 1), both,
                              positions=torch.arange(T, device=dev).repeat(2))
                keep, labels, f_next = keep.repeat(1, 2), labels.repeat(1, 2), f_next.repeat(1, 2, 1)
        total = F.smooth_l1_loss(out[keep], f_next[keep], reduction="none").mean() if bool(keep.any()) else 0.0
        sel = keep & (labels >= 0)
        if bool(sel.any()):
            p_log = (f_next[sel] @ head.t()).log_softmax(-1)
            q_log = inner.logits(out[sel]).log_softmax(-1)
            kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
            ce = F.nll_loss(q_log, labels[sel])
            total = total + DISTILL_WEIGHT * (KL_SHARE * kl + (1 - KL_SHARE) * ce)
            right = q_log.argmax(-1) == labels[sel]
            depth = torch.arange(out.shape[1], device=dev).unsqueeze(0).expand(B, -1)
            depth = (depth % k + k * (depth >= T))[sel]  # 0-based depth: offset in block (+ k on second-pass rows)
            for i in range(int(depth.max()) + 1):
                if bool((depth == i).any()):
                    metrics[f"acc{i + 1}"] = float(right[depth == i].float().mean())
        return total, metrics

    def _glanced_inputs(self, drafter, emb, feat, mask, labels, keep, lengths, lam, rng):
        """Pass 1 (no gradients) and glancing: the inputs of a second pass -- row j reads what row j - k predicted,
        (x^_{j+1}, f^_j) -- with N = round(lambda d) rows per sequence given the ground truth back."""
        B, T = labels.shape
        k = self.block_size
        inner = getattr(drafter, "module", drafter)
        with torch.no_grad():
            out1 = drafter(emb, feat, mask)
            pred = inner.logits(out1).argmax(-1)  # [B, T] draft ids
            wrong = (pred != labels) & keep  # Hamming distance to the target's tokens over the loss rows
            pred_emb = F.embedding(self.vocab.to_target(pred), self.embed)
        has_pred = torch.arange(T, device=labels.device).unsqueeze(0).expand(B, T)
        has_pred = (has_pred >= k) & (has_pred < lengths.unsqueeze(1))
        n_wrong = wrong.sum(1).tolist()  # one read back, not one per sequence
        given = torch.stack([glance(has_pred[b], round(lam * n_wrong[b]), k, rng) for b in range(B)])
        use_pred = (has_pred & ~given).unsqueeze(-1)
        emb2, feat2 = emb.clone(), feat.clone()
        emb2[:, k:] = torch.where(use_pred[:, k:], pred_emb[:, :-k], emb[:, k:])
        feat2[:, k:] = torch.where(use_pred[:, k:], out1[:, :-k], feat[:, k:])
        return emb2, feat2, float(given.sum()) / max(1, int(has_pred.sum()))

    def save(self, drafter, folder: Path) -> None:
        save_falcon(drafter, folder, dtype="float16")

    def heldout(self, drafter, target, records, store=None):
        return heldout_agreement(target, drafter, records, store=store)


def chain_mask(T: int, k: int, device=None) -> torch.Tensor:
    """[2T, 2T] mask of the two-pass evaluation: rows 0..T-1 are true rows (block mask); row T + j is row j's second
    pass input (predicted by row j - k) and sees the true rows of every block before its own plus its own block's
    second-pass rows -- exactly what a decode-time second pass sees when block(j) - 1 is the first pass's block."""
    pos = torch.arange(T, device=device)
    blk = pos // k
    top = torch.cat([block_mask(T, k, device), torch.zeros(T, T, dtype=torch.bool, device=device)], dim=1)
    before = blk.unsqueeze(0) < blk.unsqueeze(1)  # [T, T]: key's block precedes the row's block
    same = blk.unsqueeze(0) == blk.unsqueeze(1)
    return torch.cat([top, torch.cat([before, same], dim=1)], dim=0)


@torch.no_grad()
def heldout_agreement(target, drafter: FalconDrafter, records: list[dict], max_length: int = 768, *,
                      store=None) -> dict:
    """Teacher-forced agreement of a drafter with the target on ``records`` (e.g. the held-out split of ``make-data``),
    as a decode-time two-pass chain sees it: for every block b (rows bk .. bk + k - 1, true inputs), its outputs
    draft depths 1..k after position bk + k; the second pass (block b + 1 fed the first pass's features and tokens,
    seeing the true rows before it) drafts depths k+1..2k. ``top1[i]``: depth i + 1's top-1 == the target's token;
    ``chain[i]``: depths 1..i + 1 all right -- the rate at which a two-pass chain reaches depth i + 1."""
    from ..drafters.features import compute_features

    dev = next(drafter.parameters()).device  # scored where the drafter is
    embed = target_embedding_rows(target, torch.arange(target.vocab_size, device="cpu")).to(dev)
    vocab = drafter.vocab.to(dev)
    k = drafter.cfg.block_size
    depths = 2 * k
    hits, joint, total = torch.zeros(depths, device=dev), torch.zeros(depths, device=dev), 0
    for r in records:
        ids = torch.tensor(list(r["prompt_ids"]) + list(r["response_ids"]), device="cpu")[:max_length]
        P, T = len(r["prompt_ids"]), ids.numel()
        final = (store.get(r) if store is not None else compute_features(target, ids))["final"][:T].float().to(dev)
        ids = ids.to(dev)
        nxt = torch.zeros_like(ids)
        nxt[:-1] = ids[1:]
        emb = F.embedding(nxt, embed)
        out1 = drafter(emb.unsqueeze(0), final.unsqueeze(0), block_mask(T, k, dev))[0]  # [T, d]
        pred = vocab.to_target(drafter.logits(out1).argmax(-1))
        emb2, feat2 = emb.clone(), final.clone()
        emb2[k:], feat2[k:] = F.embedding(pred[:-k], embed), out1[:-k]
        both_emb = torch.cat([emb, emb2]).unsqueeze(0)
        both_feat = torch.cat([final, feat2]).unsqueeze(0)
        out2 = drafter(both_emb, both_feat, chain_mask(T, k, dev),
                       positions=torch.arange(T, device=dev).repeat(2))[0, T:]
        tok1 = pred
        tok2 = vocab.to_target(drafter.logits(out2).argmax(-1))
        # blocks whose first-pass root (position bk + k) is a response position and whose depths all have labels
        starts = [s for s in range(0, T, k) if s + k >= P and s + k + depths < T and s + 2 * k <= T]
        for s in starts:
            root = s + k  # the root token's position; depth i's token is at root + i
            guess = torch.cat([tok1[s : s + k], tok2[s + k : s + 2 * k]])  # row s + i drafts depth i + 1
            truth = ids[root + 1 : root + 1 + depths]
            right = guess == truth
            hits += right.float()
            joint += right.int().cumprod(0).float()
            total += 1
    return {"positions": total, "top1": (hits / max(total, 1)).tolist(), "chain": (joint / max(total, 1)).tolist()}
