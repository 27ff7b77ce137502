"""PASTA's two training stages over the shared trainer (``fastforward train pasta-sft``, ``... pasta-bon``).

**Pasta-SFT** (paper §4): next-token SFT on PASTA-LANG-annotated answers with the paper's three changes, all read
off :func:`~fastforward.pasta.layout.pasta_layout` -- the rule the interpreter decodes with -- through
:func:`~fastforward.train.pasta.sft.pasta_batch`: the PASTA attention mask, the Pred-10X positions, and the promise's
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

from ...errors import PastaSyntaxError, UsageError
from ...jsonl import jsonl_records
from ...pasta.language import PastaVocab, add_pasta_tokens, parse_ids
from ...validation import token_ids_problem
from ..data import Encoded, parse_paths, subsample
from .sft import pasta_batch, pasta_token_losses


def read_jsonl(paths: str) -> list[dict]:
    """The records of one or more comma-separated .jsonl files (:func:`jsonl_records`)."""
    return [record for path in parse_paths(paths) for _, record in jsonl_records(path)]


def check_record(record: dict, keys: tuple[str, ...], where: str, what: str) -> dict:
    """``record`` (at ``where``, ``FILE:LINE``) must carry ``keys``, the ``*_ids`` among them lists of token ids;
    else a one-line :class:`UsageError` saying the file is not ``what``."""
    missing = [k for k in keys if k not in record]
    if missing:
        raise UsageError(f"{where} has no {', '.join(missing)}: not {what}")
    for key in (k for k in keys if k.endswith("_ids")):
        problem = token_ids_problem(record[key], allow_empty=True)
        if problem:
            raise UsageError(f"{where}: {key} {problem} (whole numbers >= 0), got {json.dumps(record[key])[:40]}")
    return record


def read_records(paths, keys: tuple[str, ...], what: str) -> list[dict]:
    """The records of the JSONL files ``paths`` (comma-separated, or a list), each checked by :func:`check_record`;
    files without a single record are a one-line :class:`UsageError` too."""
    files = parse_paths(paths)
    records = [check_record(record, keys, f"{path}:{n}", what) for path in files for n, record in jsonl_records(path)]
    if not records:
        raise UsageError(f"{', '.join(map(str, files))} holds no records")
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


DEFAULT_TOKEN_LR = 1e-2


class PastaSFT:
    """``fastforward train pasta-sft``: see the module docstring. ``token_lr``: the learning rate of the new
    tokens' rows (LoRA; peft's trainable tokens). They start at the mean row, whose logit is far below a list
    marker's, and at LoRA's 3e-4 Adam moves them ~0.07 in norm over a whole run against rows of norm ~3: measured,
    the SFT model then never writes a promise (p = 7e-10 where the data has one). So they get a rate of their own."""

    name = "pasta-sft"

    def __init__(self, token_lr: float = DEFAULT_TOKEN_LR):
        self.token_lr = token_lr
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

    def param_groups(self, named_params, lr: float) -> list[dict]:
        tokens = [p for n, p in named_params if "trainable_tokens" in n]
        rest = [p for n, p in named_params if "trainable_tokens" not in n]
        return [g for g in ({"params": rest, "lr": lr}, {"params": tokens, "lr": self.token_lr}) if g["params"]]

    def load_records(self, cfg, tokenizer):
        rows = read_records(cfg.data, ("prompt_ids", "pasta"), "'fastforward pasta annotate' output")
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


class PairExample(Encoded):
    """A preference pair: ``input_ids`` = prompt + the chosen answer (for length grouping); ``rejected`` = the
    rejected answer's ids."""

    def __init__(self, input_ids, prompt_len, rejected):
        super().__init__(input_ids, prompt_len)
        self.rejected = rejected


class PastaBoN(PastaSFT):
    """``fastforward train pasta-bon``: one BoNBoN round on ``fastforward pasta sample`` output (see
    :mod:`fastforward.train.pasta.bon`). The reference model ``p0`` is the starting model itself -- the base of the LoRA
    adapters, which are switched off for the reference pass -- so LoRA is required."""

    name = "pasta-bon"

    def __init__(self, lam: float, alpha: float = 0.005, token_lr: float | None = None):
        super().__init__(token_lr)
        self.lam, self.alpha = lam, alpha
        self.margin = None
        self.counts: dict = {}
        self._margins: list[float] = []

    def load_records(self, cfg, tokenizer):
        from .bon import best_worst, bonbon_margin, sample_from_dict

        if not cfg.lora:
            raise UsageError("pasta-bon trains LoRA adapters (the reference model is the adapters switched off): "
                             "drop --full")
        rows = read_records(cfg.data, ("prompt_ids", "samples"), "'fastforward pasta sample' output")
        ns = {len(r["samples"]) for r in rows}
        if len(ns) != 1:
            raise UsageError(f"{cfg.data} mixes prompts with {sorted(ns)} samples; BoNBoN's margin needs one n")
        self.margin = bonbon_margin(ns.pop())
        examples, counts = [], {"tied": 0, "too_long": 0, "unparsable_samples": 0}
        for r in rows:
            samples = []
            for s in map(sample_from_dict, r["samples"]):
                try:  # a sample cut by the token budget inside a block does not parse: it cannot be trained on
                    parse_ids(s.ids, self.vocab, self.eos_ids)
                    samples.append(s)
                except PastaSyntaxError:
                    counts["unparsable_samples"] += 1
            pair = best_worst(samples, self.lam)
            if pair is None:
                counts["tied"] += 1
                continue
            prompt = list(r["prompt_ids"])
            if len(prompt) + max(len(pair[0].ids), len(pair[1].ids)) > cfg.max_length:
                counts["too_long"] += 1
                continue
            examples.append(PairExample(prompt + pair[0].ids, len(prompt), pair[1].ids))
        examples = subsample(examples, cfg.limit, cfg.seed)
        if not examples:
            raise UsageError(f"{cfg.data} gives no preference pair (every prompt's samples tie)")
        self.counts = dict(counts, pairs=len(examples), margin=round(self.margin, 4), lam=self.lam)
        return examples, 0, counts["too_long"]

    def collate(self, examples, key: int) -> dict:
        pairs = [(e.input_ids[: e.prompt_len], e.input_ids[e.prompt_len:]) for e in examples]
        pairs += [(e.input_ids[: e.prompt_len], list(e.rejected)) for e in examples]
        batch = pasta_batch(pairs, self.vocab, self.eos_ids, self.pad_id)
        batch["num_tokens"] = len(examples)  # the loss is a mean over pairs
        return batch

    def loss(self, model, batch):
        import torch

        from .bon import bonbon_loss, sequence_logprobs

        b = batch["input_ids"].shape[0] // 2
        logp = sequence_logprobs(model, batch)
        peft_model = getattr(model, "module", model)
        with torch.no_grad(), peft_model.disable_adapter():
            ref = sequence_logprobs(peft_model, batch)
        losses = bonbon_loss(logp[:b], logp[b:], ref[:b], ref[b:], self.margin, self.alpha)
        gap = ((logp[:b] - logp[b:]) - (ref[:b] - ref[b:])).detach()
        self._margins.extend(gap.tolist())
        return losses.sum()

    def stats(self) -> dict:
        recent = self._margins[-64:]
        return dict(self.counts, mean_log_ratio_gap_last=round(sum(recent) / len(recent), 4) if recent else None)
