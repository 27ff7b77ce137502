"""Batches for PASTA's supervised fine-tuning, built from :func:`~fastforward.pasta.layout.pasta_layout` -- the
rule the interpreter decodes with -- so training sees exactly the positions and visibility inference will use.

The paper's three changes to next-token SFT (§4), all read off the layout:

1. the attention mask: tokens after a promise do not see its block until a ``<sync/>`` (a 4-D additive mask);
2. the positions: Pred-10X estimates (``position_ids``), the main thread jumping by 10*N + 2 after a promise;
3. the targets: each row predicts its *thread's* next token -- a promise's closing token predicts the first main
   token after its block, ``</async>`` predicts nothing. The targets are row-aligned (``targets[b, i]`` is what
   row i's logits must predict), not shifted as in plain SFT; :func:`pasta_token_losses` takes that into account.

This is the collator's core; the training method over the shared trainer (``fastforward train pasta-sft``) is still
to come (docs/pasta.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...pasta.language import PastaVocab
from ...pasta.layout import pasta_layout


def pasta_batch(examples, vocab: PastaVocab, eos_ids=(), pad_id: int = 0, dtype=torch.float32) -> dict:
    """``examples``: ``(prompt_ids, answer_ids)`` pairs (the answer with its tags, EOS included if it ended).
    Returns ``input_ids`` [B, T], ``position_ids`` [B, T], ``attention_mask`` [B, 1, T, T] (0 = visible, the
    dtype's minimum = hidden), ``targets`` [B, T] (-100 = no loss: the prompt, ``</async>``, padding),
    ``num_tokens``. Padding rows see only themselves."""
    layouts = [pasta_layout(p, a, vocab, eos_ids) for p, a in examples]
    b, t = len(layouts), max(lay.ids.numel() for lay in layouts)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    positions = torch.zeros((b, t), dtype=torch.long)
    visible = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
    targets = torch.full((b, t), -100, dtype=torch.long)
    for k, lay in enumerate(layouts):
        n, p = lay.ids.numel(), lay.prompt_length
        ids[k, :n] = lay.ids
        positions[k, :n] = lay.positions
        visible[k, :n, :n] = lay.mask
        rows = lay.targets[p - 1:n]  # the prompt's last row predicts the first answer token
        targets[k, p - 1:n] = torch.where(rows >= 0, rows, torch.full_like(rows, -100))
    mask = torch.zeros((b, 1, t, t), dtype=dtype).masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": mask, "targets": targets,
            "num_tokens": int((targets != -100).sum())}


def pasta_token_losses(model, batch: dict) -> torch.Tensor:
    """Per-row cross-entropy [B, T] of an HF causal LM on a :func:`pasta_batch` (0 where there is no target)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=batch["attention_mask"].to(model.dtype), use_cache=False).logits
    b, t, v = logits.shape
    return F.cross_entropy(logits.reshape(-1, v).float(), batch["targets"].reshape(-1), ignore_index=-100,
                           reduction="none").view(b, t)
