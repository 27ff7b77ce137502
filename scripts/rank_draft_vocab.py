"""Rank a drafter's draft tokens by how often the target's own answers use them, for its head's ``head_vocab``
option (FR-Spec's frequency-ranked head; docs/drafters.md#the-heads-rows-by-frequency).

Counts the ``response_ids`` of a ``fastforward make-data`` folder's training split (its held-out records left out) and
writes ``draft_vocab_frequency.json`` into the drafter folder. ``fastforward train eagle|fasteagle|falcon`` writes the
same file from the data it trains on; this script ranks a drafter that was made without it.

    python scripts/rank_draft_vocab.py --drafter DRAFTER_FOLDER --data DATA_DIR [--coverage 4096,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fastforward.drafters.checkpoint import WEIGHTS
from fastforward.drafters.vocab import DraftVocab, write_frequency_order
from fastforward.errors import UsageError
from fastforward.train.make_data import read_records


def drafter_vocab(folder: Path) -> DraftVocab:
    """The draft vocabulary of any of fastforward's drafter folders (its ``d2t`` / ``t2d``)."""
    from safetensors import SafetensorError, safe_open

    path = folder / WEIGHTS
    try:
        with safe_open(str(path), framework="pt") as f:
            if not {"d2t", "t2d"} <= set(f.keys()):
                raise UsageError(f"{path}: no d2t / t2d: not a drafter with a draft vocabulary")
            return DraftVocab(f.get_tensor("d2t"), f.get_tensor("t2d"))
    except (OSError, SafetensorError) as e:
        raise UsageError(f"{path}: not readable as a drafter's weights ({e})") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, type=Path, help="the drafter folder (written into)")
    p.add_argument("--data", required=True, type=Path, help="a 'fastforward make-data' folder")
    p.add_argument("--coverage", default="", help="head sizes to report the held-out records' coverage of")
    args = p.parse_args(argv)
    try:
        vocab = drafter_vocab(args.drafter)
        records = read_records(args.data)
        train = [r["response_ids"] for r in records if r.get("split") == "train"]
        held = [r["response_ids"] for r in records if r.get("split") != "train"]
        if not train:
            raise UsageError(f"{args.data}: no training records (run 'fastforward make-data' first)")
        order = vocab.frequency_order(train)
        tokens = sum(len(s) for s in train)
        path = write_frequency_order(args.drafter, order, tokens,
                                     f"the target's answers in a make-data folder ({len(train)} training records)")
        print(f"{path}: {vocab.size} draft ids ranked over {tokens:,} response tokens of {len(train)} records")
        for n in [int(x) for x in args.coverage.split(",") if x.strip()]:
            keep, d2t = vocab.keep_most_frequent(order, n)
            kept = DraftVocab.from_target_ids((torch.arange(keep.numel()) + d2t).tolist(), vocab.vocab_size)
            print(f"head_vocab={n}: {kept.coverage(held):.4f} of the {sum(len(s) for s in held):,} held-out response "
                  f"tokens (the whole draft vocabulary: {vocab.coverage(held):.4f})")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
