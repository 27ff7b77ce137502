"""PASTA's two training stages over the shared trainer (``fastforward train pasta-sft``, ``... pasta-bon``).

**Pasta-SFT** (paper §4): next-token SFT on PASTA-LANG-annotated answers with the paper's three changes, all read
off :func:`~fastforward.pasta.layout.pasta_layout` -- the rule the interpreter decodes with -- through
:func:`~fastforward.pasta.sft.pasta_batch`: the PASTA attention mask, the Pred-10X positions, and the promise's
target set to the first main-thread token after its block.

The base model grows by PASTA-LANG's special tokens (:func:`~fastforward.pasta.language.add_pasta_tokens`; the new
embedding rows start at the mean of the old ones -- the model's embedding and head are tied). With LoRA the new rows
are trained too (peft's ``trainable_token_indices``) and every other weight of the base stays frozen, so the
adapter is small enough to ship.

Records are what ``fastforward pasta annotate`` writes (``prompt_ids``, the tagged answer ``pasta``,
``finish_reason``, ``split``): the answer's tokens are the tagged text encoded by the grown tokenizer, EOS appended
when the answer ended; records in the ``heldout`` split are not trained on, and a record whose ids break the
grammar or its length cap (a block longer than its promise allows) or does not fit ``--max-length`` is dropped and
counted.

**Pasta-BoN** (one BoNBoN round): see :class:`PastaBoN`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import PastaSyntaxError, UsageError
from ..pasta.language import PastaVocab, add_pasta_tokens, parse_ids
from ..pasta.sft import pasta_batch, pasta_token_losses
from .data import Encoded, parse_paths, subsample


def read_jsonl(paths: str) -> list[dict]:
    """The records of one or more comma-separated .jsonl files (a torn last line is skipped)."""
    records = []
    for path in parse_paths(paths):
        lines = Path(path).read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    continue  # an interrupted writer's last line
                raise UsageError(f"{path}:{i + 1} is not a JSON line") from None
    return records


def grow_tokenizer(model, tokenizer) -> PastaVocab:
    """Add PASTA-LANG's tokens to ``tokenizer`` and rows for them to the model's embedding (and head, when not
    tied), each new row set to the mean of the existing tokens' rows -- deterministic, so a resumed LoRA run rebuilds
    the same base. Idempotent: a model that already has the tokens is left alone."""
    import torch

    vocab = add_pasta_tokens(tokenizer)
    n = len(tokenizer.get_vocab())
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < n:
        model.resize_token_embeddings(n, mean_resizing=False)
    new = torch.tensor(vocab.all_ids)
    first = int(new.min())
    with torch.no_grad():
        for layer in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())
                      if m is not None}.values():
            w = layer.weight
            if rows < n or torch.equal(w[new], torch.zeros_like(w[new])):  # rows this call made
                w[new] = w[:first].mean(0)
    return vocab


class PastaSFT:
    """``fastforward train pasta-sft``: see the module docstring."""

    name = "pasta-sft"

    def __init__(self):
        self.vocab: PastaVocab | None = None
        self.eos_ids: tuple[int, ...] = ()
        self.pad_id = 0
        self.counts: dict = {}

    # -- the trainer's hooks --------------------------------------------------------------------------------------

    def prepare_model(self, model, tokenizer):
        self.vocab = grow_tokenizer(model, tokenizer)
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos])
        return model, tokenizer

    def lora_options(self) -> dict:
        return {"trainable_token_indices": {"embed_tokens": list(self.vocab.all_ids)}}

    def load_records(self, cfg, tokenizer):
        rows = read_jsonl(cfg.data)
        if not rows:
            raise UsageError(f"{cfg.data} holds no records")
        missing = [k for k in ("prompt_ids", "pasta") if k not in rows[0]]
        if missing:
            raise UsageError(f"{cfg.data} is not 'fastforward pasta annotate' output (no {', '.join(missing)})")
        train_rows = [r for r in rows if r.get("split", "train") != "heldout"]
        held = len(rows) - len(train_rows)
        examples, counts = [], {"grammar": 0, "too_long": 0, "tagged": 0}
        for r in train_rows:
            answer = tokenizer.encode(r["pasta"], add_special_tokens=False)
            if r.get("finish_reason") == "eos":
                answer = answer + [self.eos_ids[0]]
            try:
                parse_ids(answer, self.vocab, self.eos_ids)
            except PastaSyntaxError:
                counts["grammar"] += 1
                continue
            ids = list(r["prompt_ids"]) + answer
            if len(ids) > cfg.max_length:
                counts["too_long"] += 1
                continue
            counts["tagged"] += any(self.vocab.is_tag(t) for t in answer)
            examples.append(Encoded(ids, len(r["prompt_ids"])))
        examples = subsample(examples, cfg.limit, cfg.seed)
        self.counts = dict(counts, records=len(examples), heldout=held)
        return examples, held, counts["grammar"] + counts["too_long"]

    def collate(self, examples, key: int) -> dict:
        pairs = [(e.input_ids[: e.prompt_len], e.input_ids[e.prompt_len:]) for e in examples]
        return pasta_batch(pairs, self.vocab, self.eos_ids, self.pad_id)

    def loss(self, model, batch):
        return pasta_token_losses(model, batch).sum()

    def stats(self) -> dict:
        return dict(self.counts)
